/* READ over active messages (the UCX backend, see ucx.c and ucx_int.h).
 *
 * Over tcp UCP has no hardware GET: ucp_get_nbx is emulated with a request message
 * that the target's UCP answers from inside its own progress (ucp_get_req_handler).
 * In UCX 1.13 that handler aborts the target process (ucs_fatal "unexpected error")
 * when its reply cannot be sent because the initiator has closed in the meantime: a
 * reader that timed out and left crashes the node it read from, as soon as that node
 * progresses again. No endpoint option avoids it (the endpoint is found by id even
 * once failed, and a failed lane returns an error too). So where the READ would be
 * software-emulated anyway, we emulate it ourselves with the same shape: one request
 * message per op (UCX_AM_RDREQ), one reply carrying the bytes (UCX_AM_RDREP; UCX
 * sends large replies by rendezvous, received straight into the local registration).
 * A reply that cannot be sent is an error we see and turn into a failed endpoint.
 *
 * Small replies (up to UCX_RD_EAGER_BYTES) and refusals are sent from inside the
 * request's AM handler, as UCX answers a GET, eager and short with
 * UCP_OP_ATTR_FLAG_FORCE_IMM_CMPL: UCX has copied the bytes when the call returns, so
 * no reply record, memh, dispatch round or completion callback; if UCX cannot take
 * it now (NO_RESOURCE) the reply is queued like a large one. The client copies small
 * replies into place in its reply handler, and only into an op still waiting on a
 * connected endpoint: a reply for a cancelled or timed-out READ finds no op (the
 * endpoint failed, its ops ended at teardown) and is dropped.
 *
 * The server checks every requested range against its remote registrations
 * (tp->mrs) before it sends a byte; a refused range is answered with err set. */
#include <errno.h>
#include <stdint.h>
#include <string.h>

#include "kvt/alloc.h"
#include "kvt/log.h"
#include "ucx_int.h"

static bool ucx_rd_hdr_ok(const void *header, size_t header_length, struct ucx_rd_hdr *h)
{
    if (header_length != sizeof(*h))
        return false;
    memcpy(h, header, sizeof(*h));
    return h->magic == UCX_MAGIC && h->version == UCX_VERSION;
}

static struct kvt_tp_mr *ucx_mr_find(struct ucx_tp *tp, uint64_t addr, uint64_t len)
{
    struct kvt_list *pos, *tmp;

    kvt_list_for_each_safe(pos, tmp, &tp->mrs)
    {
        struct kvt_tp_mr *mr = kvt_list_entry(pos, struct kvt_tp_mr, node);
        uint64_t base = (uint64_t)(uintptr_t)mr->base;

        if (addr >= base && len <= mr->len && addr - base <= mr->len - len)
            return mr;
    }
    return NULL;
}

/* A reply sent from the request handler: completes in the call (FORCE_IMM_CMPL), so
 * this runs only if UCX ever returns a request there after all. */
static void ucx_rdrep_imm_sent(void *req, ucs_status_t status, void *user_data)
{
    struct ucx_ep *ep = user_data;

    ep->ucx_reqs--;
    if (status != UCS_OK)
        kvt__ucx_ep_fail(ep, kvt__ucx_errno(status));
    ucp_request_free(req);
}

/* Server: a request for one op. Small replies and refusals are sent at once; the
 * others (and any that UCX cannot take now) are queued and sent from dispatch, at
 * most UCX_RD_INFLIGHT_BYTES in flight. */
ucs_status_t kvt__ucx_rdreq_cb(void *arg, const void *header, size_t header_length, void *data,
                               size_t length, const ucp_am_recv_param_t *param)
{
    struct ucx_tp *tp = arg;
    struct ucx_rd_hdr h;
    struct ucx_rd_tx *tx;
    struct kvt_tp_mr *mr;
    struct ucx_ep *ep;

    ep = kvt__ucx_am_ep(tp, param);
    if (ep == NULL || ep->state != EP_CONNECTED)
        return UCS_OK; /* dropped: the endpoint is closing */
    if (!ucx_rd_hdr_ok(header, header_length, &h) || length != 0 || h.err != 0 || h.len == 0) {
        kvt_warn("ucx", "endpoint %llu: bad READ request", (unsigned long long)ep->id);
        kvt__ucx_ep_fail(ep, -EPROTO);
        return UCS_OK;
    }
    mr = ucx_mr_find(tp, h.addr, h.len);
    if (mr == NULL) {
        h.err = EFAULT;
        h.len = 0;
    }
    if (h.len <= UCX_RD_EAGER_BYTES && kvt_list_empty(&ep->rd_q)) {
        /* Small (or refused): answered here, inside progress, as UCX answers a GET.
         * Sent short with the bytes copied before the call returns, or not at all
         * (NO_RESOURCE: queued below), so no request, record or memh. */
        ucp_request_param_t p = {
            .op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FLAG_FORCE_IMM_CMPL |
                            UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA,
            .flags = UCP_AM_SEND_FLAG_REPLY | UCP_AM_SEND_FLAG_EAGER,
            .cb.send = ucx_rdrep_imm_sent,
            .user_data = ep,
        };
        ucs_status_ptr_t req = ucp_am_send_nbx(ep->uep, UCX_AM_RDREP, &h, sizeof(h),
                                               (void *)(uintptr_t)h.addr, h.len, &p);

        if (req == NULL)
            return UCS_OK;
        if (UCS_PTR_IS_PTR(req)) { /* FORCE_IMM_CMPL says never; keep the ep alive */
            ep->ucx_reqs++;
            return UCS_OK;
        }
        if (UCS_PTR_STATUS(req) != UCS_ERR_NO_RESOURCE) {
            kvt__ucx_ep_fail(ep, kvt__ucx_errno(UCS_PTR_STATUS(req)));
            return UCS_OK;
        }
    }
    tx = kvt_malloc(sizeof(*tx));
    if (tx == NULL) {
        kvt__ucx_ep_fail(ep, -ENOMEM);
        return UCS_OK;
    }
    tx->ep = ep;
    tx->mr = mr;
    tx->hdr = h;
    kvt_list_add_tail(&ep->rd_q, &tx->node);
    tp->kick = true;
    return UCS_OK;
}

static void ucx_rdrep_sent(void *req, ucs_status_t status, void *user_data)
{
    struct ucx_rd_tx *tx = user_data;

    kvt_list_del(&tx->node);
    tx->ep->ucx_reqs--;
    tx->ep->rd_inflight -= tx->hdr.len;
    tx->ep->tp->kick = !kvt_list_empty(&tx->ep->rd_q) || tx->ep->tp->kick;
    if (tx->mr != NULL)
        tx->mr->inflight--;
    if (status != UCS_OK)
        kvt__ucx_ep_fail(tx->ep, kvt__ucx_errno(status));
    kvt_free(tx);
    ucp_request_free(req);
}

/* Server, from dispatch: sends the replies an endpoint owes. */
int kvt__ucx_rd_send_replies(struct ucx_ep *ep)
{
    int n = 0;

    while (!kvt_list_empty(&ep->rd_q) && ep->state == EP_CONNECTED) {
        struct ucx_rd_tx *tx = kvt_list_entry(ep->rd_q.next, struct ucx_rd_tx, node);

        if (ep->rd_inflight > 0 && ep->rd_inflight + tx->hdr.len > UCX_RD_INFLIGHT_BYTES)
            break;
        ucp_request_param_t param = {
            .op_attr_mask =
                UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS,
            .flags = UCP_AM_SEND_FLAG_REPLY,
            .cb.send = ucx_rdrep_sent,
            .user_data = tx,
        };

        if (tx->mr != NULL) {
            param.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
            param.memh = tx->mr->memh;
        }
        kvt_list_del(&tx->node);
        n++;

        ucs_status_ptr_t req =
            ucp_am_send_nbx(ep->uep, UCX_AM_RDREP, &tx->hdr, sizeof(tx->hdr),
                            (void *)(uintptr_t)tx->hdr.addr, tx->hdr.len, &param);

        if (req == NULL) {
            kvt_free(tx);
            continue;
        }
        if (UCS_PTR_IS_ERR(req)) {
            kvt_free(tx);
            kvt__ucx_ep_fail(ep, kvt__ucx_errno(UCS_PTR_STATUS(req)));
            break;
        }
        ep->ucx_reqs++;
        ep->rd_inflight += tx->hdr.len;
        kvt_list_add_tail(&ep->tp->rd_sent, &tx->node);
        if (tx->mr != NULL)
            tx->mr->inflight++;
    }
    return n;
}

static void ucx_rd_op_done(struct ucx_rd_op *op, int err)
{
    struct ucx_batch *b = op->b;

    op->state = RD_DONE;
    if (err != 0) {
        if (b->status == 0)
            b->status = err;
        kvt__ucx_ep_fail(b->ep, err);
    }
    if (--b->pending == 0)
        kvt__ucx_batch_finish(b);
}

static void ucx_rd_recv_done(void *req, ucs_status_t status, size_t length, void *user_data)
{
    struct ucx_rd_op *op = user_data;
    struct ucx_batch *b = op->b;

    ucp_request_free(req);
    if (b->ep == NULL) { /* orphaned by ucx_close: reported already, freed there */
        b->pending--;
        return;
    }
    b->ep->ucx_reqs--;
    ucx_rd_op_done(op, status != UCS_OK        ? kvt__ucx_errno(status)
                       : length != op->hdr.len ? -EPROTO
                                               : 0);
}

/* Client: the op the tag names, if it is still waiting for its reply. */
static struct ucx_rd_op *ucx_rd_op_find(struct ucx_ep *ep, uint64_t tag)
{
    uint32_t id = (uint32_t)(tag >> 32), idx = (uint32_t)tag;
    struct kvt_list *pos, *tmp;

    kvt_list_for_each_safe(pos, tmp, &ep->batches)
    {
        struct ucx_batch *b = kvt_list_entry(pos, struct ucx_batch, node);

        if (b->id != id)
            continue;
        if (idx >= b->n_ops || b->ops[idx].state != RD_WAIT)
            return NULL;
        return &b->ops[idx];
    }
    return NULL;
}

/* Client: a reply; eager bytes are copied, rendezvous bytes received in place. */
ucs_status_t kvt__ucx_rdrep_cb(void *arg, const void *header, size_t header_length, void *data,
                               size_t length, const ucp_am_recv_param_t *param)
{
    struct ucx_tp *tp = arg;
    struct ucx_rd_hdr h;
    struct ucx_rd_op *op;
    struct ucx_ep *ep;

    ep = kvt__ucx_am_ep(tp, param);
    if (ep == NULL || ep->state >= EP_FAILED)
        return UCS_OK; /* dropped: the endpoint is closing, its ops end at teardown */
    op = ucx_rd_hdr_ok(header, header_length, &h) ? ucx_rd_op_find(ep, h.tag) : NULL;
    if (op == NULL || h.addr != op->hdr.addr) {
        kvt_warn("ucx", "endpoint %llu: READ reply for no pending op", (unsigned long long)ep->id);
        kvt__ucx_ep_fail(ep, -EPROTO);
        return UCS_OK;
    }
    if (h.err != 0) {
        kvt_warn("ucx", "endpoint %llu: the peer refused a READ of %llu bytes: %s",
                 (unsigned long long)ep->id, (unsigned long long)op->hdr.len, strerror(h.err));
        ucx_rd_op_done(op, -EFAULT);
        return UCS_OK;
    }
    if (length != op->hdr.len) {
        ucx_rd_op_done(op, -EPROTO);
        return UCS_OK;
    }
    if (!(param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV)) {
        memcpy(op->dst, data, length);
        ucx_rd_op_done(op, 0);
        return UCS_OK;
    }

    ucp_request_param_t rp = {
        .op_attr_mask =
            UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_MEMH,
        .cb.recv_am = ucx_rd_recv_done,
        .user_data = op,
        .memh = op->memh,
    };
    ucs_status_ptr_t req = ucp_am_recv_data_nbx(tp->worker, data, op->dst, length, &rp);

    if (req == NULL) {
        ucx_rd_op_done(op, 0);
    } else if (UCS_PTR_IS_ERR(req)) {
        ucx_rd_op_done(op, kvt__ucx_errno(UCS_PTR_STATUS(req)));
    } else {
        op->state = RD_RECV;
        ep->ucx_reqs++;
    }
    return UCS_OK;
}

/* Completion of a UCX request that counts in a batch's pending: a request of a READ
 * over AM (user_data: the batch, not the op) and a ucp_get_nbx alike. */
void kvt__ucx_batch_req_done(void *req, ucs_status_t status, void *user_data)
{
    struct ucx_batch *b = user_data;

    ucp_request_free(req);
    if (b->ep == NULL) { /* orphaned by ucx_close: reported already, freed there */
        b->pending--;
        return;
    }
    b->ep->ucx_reqs--;
    if (status != UCS_OK) {
        if (b->status == 0)
            b->status = kvt__ucx_errno(status);
        kvt__ucx_ep_fail(b->ep, kvt__ucx_errno(status));
    }
    if (--b->pending == 0)
        kvt__ucx_batch_finish(b);
}

/* Client: posts the request of each op; returns 0 or the first posting error. */
int kvt__ucx_read_am(struct ucx_ep *ep, struct ucx_batch *b, struct kvt_tp_rkey *rk,
                     struct kvt_tp_mr *local, const struct kvt_read_op *ops, size_t n,
                     size_t *posted_p)
{
    size_t i;

    for (i = 0; i < n; i++) {
        struct ucx_rd_op *op = &b->ops[i];
        ucp_request_param_t param = {
            .op_attr_mask =
                UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS,
            .flags = UCP_AM_SEND_FLAG_REPLY,
            .cb.send = kvt__ucx_batch_req_done,
            .user_data = b,
        };

        op->b = b;
        op->memh = local->memh;
        op->dst = local->base + ops[i].local_off;
        op->hdr = (struct ucx_rd_hdr){.magic = UCX_MAGIC,
                                      .version = UCX_VERSION,
                                      .addr = rk->base + ops[i].remote_off,
                                      .len = ops[i].len,
                                      .tag = (uint64_t)b->id << 32 | (uint32_t)i};
        op->state = RD_WAIT;
        b->pending++; /* the reply */

        ucs_status_ptr_t req =
            ucp_am_send_nbx(ep->uep, UCX_AM_RDREQ, &op->hdr, sizeof(op->hdr), NULL, 0, &param);

        if (req == NULL)
            continue;
        if (UCS_PTR_IS_ERR(req)) {
            op->state = RD_DONE;
            b->pending--;
            *posted_p = i;
            return kvt__ucx_errno(UCS_PTR_STATUS(req));
        }
        b->pending++; /* the request's send */
        ep->ucx_reqs++;
    }
    *posted_p = n;
    return 0;
}

/* READ over active messages, both sides (the UCX backend, see ucx.c and ucx_int.h).
 *
 * Every READ is a request message per op (UCX_AM_RDREQ: address, length, tag) and a
 * reply carrying the bytes (UCX_AM_RDREP; UCX sends large replies by rendezvous,
 * received straight into the local registration: over RDMA where there is hardware,
 * cma between two nodes on one host; UCX has no tcp, so a connection with neither
 * moves its READs over our own socket instead, ucx_sock_read.c). The server side
 * (the checks of a request) and the client's ops are shared with socket mode. There
 * is no ucp_get_nbx: a
 * worker with UCP_FEATURE_RMA answers software GETs from inside its own progress
 * (ucp_get_req_handler), from whatever address the request names and to anyone wired
 * up to it (a forged rkey read our heap, an unmapped address crashed the node), and
 * in UCX 1.13 it aborted the process when a reply could not be sent to a reader that
 * had left. Our reply is our own send: an error we see and turn into a failed
 * endpoint.
 *
 * The server answers only an authorized endpoint (a request from one that is not is
 * refused, counted and the endpoint closed), and only a range that lies inside one
 * of its remote registrations (tp->mrs) and that may_read grants; both refusals are
 * the same reply (err UCX_RD_REFUSED, no bytes), counted apart. Requests come as
 * active messages naming our token (an unknown token is dropped and counted), or,
 * from a peer that had not authorized us yet, as RDREQ frames on the socket,
 * served from dispatch in order with its messages.
 *
 * Small replies (up to UCX_RD_EAGER_BYTES) and refusals are sent at once, eager and
 * short with UCP_OP_ATTR_FLAG_FORCE_IMM_CMPL: UCX has copied the bytes when the call
 * returns, so no reply record, memh, dispatch round or completion callback; if UCX
 * cannot take it now (NO_RESOURCE) the reply is queued like a large one. Large ones
 * go from dispatch, at most UCX_RD_INFLIGHT_BYTES in flight per endpoint. The client
 * copies small replies into place in its reply handler, and only into an op still
 * waiting on a connected endpoint: a reply for a cancelled or timed-out READ finds no
 * op (the endpoint failed, its ops ended at teardown) and is dropped. */
#include <endian.h>
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

/* A reply sent at once: completes in the call (FORCE_IMM_CMPL), so this runs only if
 * UCX ever returns a request there after all. */
static void ucx_rdrep_imm_sent(void *req, ucs_status_t status, void *user_data)
{
    struct ucx_ep *ep = user_data;

    ep->ucx_reqs--;
    if (status != UCS_OK)
        kvt__ucx_ep_fail(ep, kvt__ucx_errno(status));
    ucp_request_free(req);
}

void kvt__ucx_rd_serve(struct ucx_ep *ep, struct ucx_rd_hdr *h, uint64_t asked)
{
    struct ucx_tp *tp = ep->tp;
    const struct kvt_tp_callbacks *cb = &tp->pub.cfg.cb;
    struct ucx_rd_tx *tx;
    struct kvt_tp_mr *mr;

    if (!ep->authorized) {
        tp->counters.refused[KVT_TP_READ_UNAUTH]++;
        kvt_warn("ucx", "endpoint %llu: a READ request before it was authorized; closed",
                 (unsigned long long)ep->id);
        kvt__ucx_ep_fail(ep, -EACCES);
        return;
    }
    mr = ucx_mr_find(tp, h->addr, h->len);
    if (mr == NULL) {
        tp->counters.refused[KVT_TP_READ_RANGE]++;
    } else if (cb->may_read == NULL ||
               !cb->may_read(cb->arg, &ep->pub, mr, h->addr - (uint64_t)(uintptr_t)mr->base,
                             h->len)) {
        tp->counters.refused[KVT_TP_READ_GRANT]++;
        mr = NULL;
    }
    if (mr == NULL) { /* one answer for both: no layout oracle */
        h->err = UCX_RD_REFUSED;
        h->len = 0;
    }
    memcpy(h->token, ep->peer_token, UCX_TOKEN_BYTES);
    if (tp->test_bad_token)
        h->token[0] ^= 0xff;
    if (h->len <= UCX_RD_EAGER_BYTES && kvt_list_empty(&ep->rd_q) && ep->uep != NULL) {
        /* Small (or refused): sent short with the bytes copied before the call
         * returns, or not at all (NO_RESOURCE: queued below), so no request, record
         * or memh. */
        ucp_request_param_t p = {
            .op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FLAG_FORCE_IMM_CMPL |
                            UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA,
            .flags = UCP_AM_SEND_FLAG_EAGER,
            .cb.send = ucx_rdrep_imm_sent,
            .user_data = ep,
        };
        ucs_status_ptr_t req = ucp_am_send_nbx(ep->uep, UCX_AM_RDREP, h, sizeof(*h),
                                               (void *)(uintptr_t)h->addr, h->len, &p);

        if (req == NULL)
            return;
        if (UCS_PTR_IS_PTR(req)) { /* FORCE_IMM_CMPL says never; keep the ep alive */
            ep->ucx_reqs++;
            return;
        }
        if (UCS_PTR_STATUS(req) != UCS_ERR_NO_RESOURCE) {
            kvt__ucx_ep_fail(ep, kvt__ucx_errno(UCS_PTR_STATUS(req)));
            return;
        }
    }
    /* Large, or UCX busy, or no ucp ep yet (the peer's ADDR is still on its way), or
     * socket mode. */
    tx = kvt_malloc(sizeof(*tx));
    if (tx == NULL) {
        kvt__ucx_ep_fail(ep, -ENOMEM);
        return;
    }
    tx->ep = ep;
    tx->mr = mr;
    tx->hdr = *h;
    tx->asked = asked;
    tx->inflight = 0;
    tx->out.own = NULL;
    kvt_list_add_tail(&ep->rd_q, &tx->node);
    tp->kick = true;
}

/* Server: a request for one op, as an active message. */
ucs_status_t kvt__ucx_rdreq_cb(void *arg, const void *header, size_t header_length, void *data,
                               size_t length, const ucp_am_recv_param_t *param)
{
    struct ucx_tp *tp = arg;
    struct ucx_rd_hdr h;
    struct ucx_ep *ep;

    (void)data;
    (void)param;
    if (header_length != sizeof(h)) {
        tp->counters.refused[KVT_TP_UNKNOWN_CONN]++;
        return UCS_OK;
    }
    memcpy(&h, header, sizeof(h));
    ep = kvt__ucx_ep_by_token(tp, h.token);
    if (ep == NULL || ep->path == PATH_SOCK) { /* socket mode: nothing comes over UCX */
        tp->counters.refused[KVT_TP_UNKNOWN_CONN]++;
        return UCS_OK; /* names no endpoint of ours: dropped, no answer */
    }
    if (ep->state != EP_CONNECTED)
        return UCS_OK; /* dropped: the endpoint is closing */
    if (!ucx_rd_hdr_ok(header, header_length, &h) || length != 0 || h.err != 0 || h.len == 0) {
        kvt_warn("ucx", "endpoint %llu: bad READ request", (unsigned long long)ep->id);
        kvt__ucx_ep_fail(ep, -EPROTO);
        return UCS_OK;
    }
    kvt__ucx_rd_serve(ep, &h, 0);
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

    if (ep->path == PATH_SOCK) {
        n = kvt__ucx_sock_fill(ep);
        kvt__ucx_sock_flush(ep);
        return n;
    }
    while (!kvt_list_empty(&ep->rd_q) && ep->state == EP_CONNECTED && ep->uep != NULL) {
        struct ucx_rd_tx *tx = kvt_list_entry(ep->rd_q.next, struct ucx_rd_tx, node);

        if (ep->rd_inflight > 0 && ep->rd_inflight + tx->hdr.len > UCX_RD_INFLIGHT_BYTES)
            break;
        ucp_request_param_t param = {
            .op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA,
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

void kvt__ucx_rd_op_done(struct ucx_rd_op *op, int err)
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
    kvt__ucx_rd_op_done(op, status != UCS_OK        ? kvt__ucx_errno(status)
                            : length != op->hdr.len ? -EPROTO
                                                    : 0);
}

/* Client: the op the tag names, if it is still waiting for its reply. */
struct ucx_rd_op *kvt__ucx_rd_op_find(struct ucx_ep *ep, uint64_t tag)
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

    if (!ucx_rd_hdr_ok(header, header_length, &h) ||
        (ep = kvt__ucx_ep_by_token(tp, h.token)) == NULL || ep->path == PATH_SOCK) {
        tp->counters.refused[KVT_TP_UNKNOWN_CONN]++;
        return UCS_OK; /* names no endpoint of ours: dropped */
    }
    if (ep->state >= EP_FAILED)
        return UCS_OK; /* dropped: the endpoint is closing, its ops end at teardown */
    op = kvt__ucx_rd_op_find(ep, h.tag);
    if (op == NULL || h.addr != op->hdr.addr) {
        kvt_warn("ucx", "endpoint %llu: READ reply for no pending op", (unsigned long long)ep->id);
        kvt__ucx_ep_fail(ep, -EPROTO);
        return UCS_OK;
    }
    if (h.err != 0) {
        kvt_warn("ucx", "endpoint %llu: the peer refused a READ of %llu bytes",
                 (unsigned long long)ep->id, (unsigned long long)op->hdr.len);
        kvt__ucx_rd_op_done(op, h.err == UCX_RD_REFUSED && length == 0 ? -EACCES : -EPROTO);
        return UCS_OK;
    }
    if (length != op->hdr.len) {
        kvt__ucx_rd_op_done(op, -EPROTO);
        return UCS_OK;
    }
    if (!(param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV)) {
        memcpy(op->dst, data, length);
        kvt__ucx_rd_op_done(op, 0);
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
        kvt__ucx_rd_op_done(op, 0);
    } else if (UCS_PTR_IS_ERR(req)) {
        kvt__ucx_rd_op_done(op, kvt__ucx_errno(UCS_PTR_STATUS(req)));
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

/* Client: one op's request as an active message. */
static int ucx_rd_post_am(struct ucx_ep *ep, struct ucx_rd_op *op)
{
    struct ucx_batch *b = op->b;
    ucp_request_param_t param = {
        .op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA,
        .cb.send = kvt__ucx_batch_req_done,
        .user_data = b,
    };

    memcpy(op->hdr.token, ep->peer_token, UCX_TOKEN_BYTES);
    if (ep->tp->test_bad_token)
        op->hdr.token[0] ^= 0xff;
    op->state = RD_WAIT;

    ucs_status_ptr_t req =
        ucp_am_send_nbx(ep->uep, UCX_AM_RDREQ, &op->hdr, sizeof(op->hdr), NULL, 0, &param);

    if (req == NULL)
        return 0;
    if (UCS_PTR_IS_ERR(req)) {
        op->state = RD_DONE;
        return kvt__ucx_errno(UCS_PTR_STATUS(req));
    }
    b->pending++; /* the request's send */
    ep->ucx_reqs++;
    return 0;
}

/* Client: one op's request as a RDREQ frame on the socket (before we authorized). */
static int ucx_rd_post_frame(struct ucx_ep *ep, struct ucx_rd_op *op)
{
    uint64_t p[3] = {htole64(op->hdr.addr), htole64(op->hdr.len), htole64(op->hdr.tag)};
    int ret = kvt__ucx_sock_frame(ep, KVT_TP_FRAME_RDREQ, p, sizeof(p), NULL, 0);

    if (ret < 0) {
        op->state = RD_DONE;
        return ret;
    }
    op->state = RD_WAIT;
    ep->tcp_msgs++;
    ep->tx_seq++;
    return 0;
}

int kvt__ucx_read_post(struct ucx_ep *ep, struct ucx_batch *b, size_t first, size_t *posted_p)
{
    size_t i;

    for (i = first; i < b->n_ops; i++) {
        struct ucx_rd_op *op = &b->ops[i];
        int ret = 0;

        b->pending++; /* the reply */
        if (!ep->authorized)
            ret = ucx_rd_post_frame(ep, op);
        else if (ep->uep != NULL)
            ret = ucx_rd_post_am(ep, op);
        else if (ep->path == PATH_SOCK && ep->n_unsent == 0) /* in order behind those */
            ret = kvt__ucx_sock_post(ep, op);
        /* else: RD_UNSENT until the path is known (or, in socket mode, the window has
         * room) */
        if (ret < 0) {
            b->pending--;
            *posted_p = i;
            return ret;
        }
        if (op->state == RD_UNSENT)
            ep->n_unsent++;
    }
    *posted_p = i;
    return 0;
}

void kvt__ucx_read_post_unsent(struct ucx_ep *ep)
{
    struct kvt_list *pos, *tmp;

    kvt_list_for_each_safe(pos, tmp, &ep->batches)
    {
        struct ucx_batch *b = kvt_list_entry(pos, struct ucx_batch, node);

        for (size_t i = 0; i < b->n_ops; i++) {
            int ret;

            if (b->ops[i].state != RD_UNSENT)
                continue;
            ep->n_unsent--;
            ret = ucx_rd_post_am(ep, &b->ops[i]);
            if (ret < 0) {
                kvt__ucx_ep_fail(ep, ret); /* teardown ends the ops left */
                b->ops[i].state = RD_DONE;
                if (b->status == 0)
                    b->status = ret;
                if (--b->pending == 0)
                    kvt__ucx_batch_finish(b);
                return;
            }
        }
    }
}

/* The UCX backend of the transport interface (kvt/transport.h, DESIGN.md §7).
 *
 * One UCP context and one worker per transport, single-threaded, owned by the node's
 * loop. Control messages are active messages (one AM id) with a small header
 * {magic, version, type, seq}; data moves with ucp_get_nbx against rkeys the peer
 * packed with ucp_rkey_pack over RDMA, else as READ over active messages (see
 * ucx_ep_rd_path; that path is ucx_am_read.c, the shared structures ucx_int.h). UCX_TLS is left
 * alone: tcp and shared memory (sysv, cma) here, verbs where a device exists.
 *
 * Why every user callback is deferred: UCX calls us back from inside
 * ucp_worker_progress() (AM arrival, peer failure, request completion, new
 * connection) and from inside ucp_ep_close_nbx() (force close completes every
 * outstanding request). Those UCX callbacks only record what happened in our own
 * structures; dispatch() runs after ucp_worker_progress() returns and calls the
 * owner's callbacks, so the owner may call any transport function from them.
 *
 * Endpoint states:
 *   ACCEPTING  passive side, ucp ep created in the listener callback; dispatch
 *              calls on_accept, then sends HELLO (seq 0) and the ep is CONNECTED.
 *   CONNECTING active side, waiting for the server's HELLO (or connect timeout).
 *   CONNECTED  usable.
 *   FAILED     an error or a local close was seen (ep->err); teardown force-closes
 *              the ucp ep, which completes every request; its batches complete with
 *              the ep's error (-ECANCELED for a local close), then CLOSED is
 *              reported once (not for a refused accept).
 *   DEAD       CLOSED reported; the ep waits on tp->zombies until UCX holds no
 *              request that names it, then it is freed.
 *
 * Control message order: the AM handler files each message into ep->rx sorted by
 * seq; eager data is kept (persistent UCX descriptor) or copied, rendezvous data is
 * fetched with ucp_am_recv_data_nbx. dispatch delivers the head while it is
 * complete and in sequence, so a rendezvous message never overtakes an eager one.
 * -EAGAIN on send is the local bound: recv_credits messages not yet completed by UCX.
 *
 * READ batches (GET path): n ucp_get_nbx into the local registration (its memh
 * passed, no per-op registration); the batch counts its outstanding requests; it completes
 * (from dispatch, never inside read()) when the count reaches 0, with the first
 * error seen. Any request error fails the endpoint. Batches older than
 * op_timeout_ms fail the endpoint with -ETIMEDOUT.
 *
 * Event fd: an epoll fd holding the worker's efd and a timerfd armed (in arm) for
 * the nearest connect or op deadline, so a sleeping loop wakes for timeouts too.
 *
 * Handle layout (pack/unpack): {magic, rkey length, base, length} little-endian,
 * then the UCX rkey bytes. The base address stays inside the handle: the owner names
 * remote memory by offsets only, and every op is checked against the length. */
#include <dirent.h>
#include <endian.h>
#include <errno.h>
#include <netdb.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <sys/timerfd.h>
#include <time.h>
#include <unistd.h>
#include <netinet/in.h>

#include <ucp/api/ucp.h>

#include "kvt/alloc.h"
#include "kvt/common.h"
#include "kvt/list.h"
#include "kvt/log.h"
#include "kvt/transport.h"
#include "ucx_int.h"

/* The one place UCX status codes become negative errno. */
int kvt__ucx_errno(ucs_status_t st)
{
    if (st >= UCS_ERR_LAST_LINK_FAILURE && st <= UCS_ERR_FIRST_LINK_FAILURE)
        return -ECONNRESET;
    /* uct tcp reports a peer whose connection closed (a killed process) as
     * ENDPOINT_TIMEOUT; to the owner that is a peer gone. -ETIMEDOUT stays ours: the
     * connect and op deadlines. */
    if (st == UCS_ERR_ENDPOINT_TIMEOUT)
        return -ECONNRESET;
    if (st >= UCS_ERR_LAST_ENDPOINT_FAILURE && st <= UCS_ERR_FIRST_ENDPOINT_FAILURE)
        return -ECONNRESET;
    switch (st) {
    case UCS_OK:
        return 0;
    case UCS_INPROGRESS:
        return -EINPROGRESS;
    case UCS_ERR_NO_MESSAGE:
        return -ENOMSG;
    case UCS_ERR_NO_RESOURCE:
        return -EAGAIN;
    case UCS_ERR_NO_MEMORY:
        return -ENOMEM;
    case UCS_ERR_INVALID_PARAM:
    case UCS_ERR_INVALID_ADDR:
        return -EINVAL;
    case UCS_ERR_UNREACHABLE:
        return -EHOSTUNREACH;
    case UCS_ERR_NOT_IMPLEMENTED:
    case UCS_ERR_UNSUPPORTED:
        return -EOPNOTSUPP;
    case UCS_ERR_MESSAGE_TRUNCATED:
        return -EMSGSIZE;
    case UCS_ERR_BUFFER_TOO_SMALL:
        return -ENOSPC;
    case UCS_ERR_NO_ELEM:
        return -ENOENT;
    case UCS_ERR_SOME_CONNECTS_FAILED:
    case UCS_ERR_REJECTED:
        return -ECONNREFUSED;
    case UCS_ERR_NO_DEVICE:
        return -ENODEV;
    case UCS_ERR_BUSY:
        return -EBUSY;
    case UCS_ERR_CANCELED:
        return -ECANCELED;
    case UCS_ERR_ALREADY_EXISTS:
        return -EEXIST;
    case UCS_ERR_OUT_OF_RANGE:
        return -ERANGE;
    case UCS_ERR_TIMED_OUT:
        return -ETIMEDOUT;
    case UCS_ERR_EXCEEDS_LIMIT:
        return -E2BIG;
    case UCS_ERR_NOT_CONNECTED:
        return -ENOTCONN;
    case UCS_ERR_CONNECTION_RESET:
        return -ECONNRESET;
    default:
        return -EIO;
    }
}

/* ---- endpoints ---- */

/* Records a failure; teardown and the CLOSED report happen in dispatch. Safe from
 * inside UCX callbacks. The first error wins. */
void kvt__ucx_ep_fail(struct ucx_ep *ep, int err)
{
    if (ep->state >= EP_FAILED)
        return;
    if (ep->state == EP_ACCEPTING)
        ep->silent = true;
    if (err != 0)
        kvt_debug("ucx", "endpoint %llu failed: %s", (unsigned long long)ep->id, strerror(-err));
    ep->state = EP_FAILED;
    ep->err = err;
    ep->tp->kick = true;
}

void kvt__ucx_batch_finish(struct ucx_batch *b)
{
    struct ucx_ep *ep = b->ep;

    kvt_list_del(&b->node);
    ep->n_batches--;
    kvt_list_add_tail(&ep->tp->done, &b->node);
    ep->tp->kick = true;
}

/* Force-closes the ucp ep of a FAILED endpoint: UCX completes each outstanding
 * request (with UCS_ERR_CANCELED) before ucp_ep_close_nbx returns. Not from inside a
 * UCX callback. */
static void ucx_ep_teardown(struct ucx_ep *ep)
{
    struct kvt_list *pos, *tmp;
    ucp_request_param_t param = {
        .op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS,
        .flags = UCP_EP_CLOSE_FLAG_FORCE,
    };

    if (ep->uep == NULL)
        return;
    kvt_list_for_each_safe(pos, tmp, &ep->batches)
    {
        struct ucx_batch *b = kvt_list_entry(pos, struct ucx_batch, node);

        if (b->status == 0)
            b->status = ep->err != 0 ? ep->err : -ECANCELED;
    }
    if (ep->tp->last_ep == ep)
        ep->tp->last_ep = NULL;

    ucs_status_ptr_t req = ucp_ep_close_nbx(ep->uep, &param);

    ep->uep = NULL;
    if (UCS_PTR_IS_PTR(req))
        ep->close_req = req;
    else if (UCS_PTR_IS_ERR(req))
        kvt_debug("ucx", "ucp_ep_close_nbx: %s", ucs_status_string(UCS_PTR_STATUS(req)));
    /* READs over AM still waiting for a reply will never get one; those whose bytes
     * are being received complete from UCX (the close cancels them). */
    kvt_list_for_each_safe(pos, tmp, &ep->batches)
    {
        struct ucx_batch *b = kvt_list_entry(pos, struct ucx_batch, node);

        for (size_t i = 0; i < b->n_ops; i++) {
            if (b->ops[i].state != RD_WAIT)
                continue;
            b->ops[i].state = RD_DONE;
            if (--b->pending == 0)
                kvt__ucx_batch_finish(b);
        }
    }
    kvt_list_for_each_safe(pos, tmp, &ep->rd_q)
    {
        kvt_list_del(pos);
        kvt_free(kvt_list_entry(pos, struct ucx_rd_tx, node));
    }
}

static struct ucx_ep *ucx_ep_alloc(struct ucx_tp *tp)
{
    struct ucx_ep *ep = kvt_calloc(1, sizeof(*ep));

    if (ep == NULL)
        return NULL;
    ep->pub.tp = &tp->pub;
    ep->tp = tp;
    ep->id = ++tp->next_ep_id;
    kvt_list_init(&ep->node);
    kvt_list_init(&ep->rx);
    kvt_list_init(&ep->batches);
    kvt_list_init(&ep->rd_q);
    return ep;
}

static void ucx_msg_free(struct ucx_tp *tp, struct ucx_msg *m)
{
    kvt_list_del(&m->node);
    if (m->desc != NULL)
        ucp_am_data_release(tp->worker, m->desc);
    kvt_free(m);
}

/* Frees an endpoint UCX no longer references (force: at transport close). */
static void ucx_ep_free(struct ucx_ep *ep)
{
    struct kvt_list *pos, *tmp;

    kvt_list_for_each_safe(pos, tmp, &ep->rx)
    {
        struct ucx_msg *m = kvt_list_entry(pos, struct ucx_msg, node);

        if (m->ready)
            ucx_msg_free(ep->tp, m);
        else
            m->ep = NULL; /* freed by its receive callback */
    }
    kvt_list_for_each_safe(pos, tmp, &ep->rd_q)
    {
        kvt_list_del(pos);
        kvt_free(kvt_list_entry(pos, struct ucx_rd_tx, node));
    }
    kvt_list_del(&ep->node);
    kvt_free(ep);
}

static struct ucx_ep *ucx_ep_find(struct ucx_tp *tp, ucp_ep_h uep)
{
    struct kvt_list *pos, *tmp;

    if (tp->last_ep != NULL && tp->last_ep->uep == uep)
        return tp->last_ep;
    kvt_list_for_each_safe(pos, tmp, &tp->eps)
    {
        struct ucx_ep *ep = kvt_list_entry(pos, struct ucx_ep, node);

        if (ep->uep == uep) {
            tp->last_ep = ep;
            return ep;
        }
    }
    return NULL;
}

static void ucx_err_cb(void *arg, ucp_ep_h uep, ucs_status_t status)
{
    kvt__ucx_ep_fail(arg, kvt__ucx_errno(status));
}

/* ---- control messages ---- */

static void ucx_send_done(void *req, ucs_status_t status, void *user_data)
{
    struct ucx_tx *tx = user_data;

    tx->ep->tx_inflight--;
    tx->ep->ucx_reqs--;
    if (status != UCS_OK)
        kvt__ucx_ep_fail(tx->ep, kvt__ucx_errno(status));
    kvt_free(tx);
    ucp_request_free(req);
}

static int ucx_post_am(struct ucx_ep *ep, uint16_t type, uint64_t seq, const void *buf, size_t len)
{
    struct ucx_tx *tx = kvt_malloc(sizeof(*tx) + len);
    ucp_request_param_t param = {
        .op_attr_mask =
            UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS,
        .flags = UCP_AM_SEND_FLAG_REPLY,
        .cb.send = ucx_send_done,
    };

    if (tx == NULL)
        return -ENOMEM;
    tx->ep = ep;
    tx->hdr =
        (struct ucx_am_hdr){.magic = UCX_MAGIC, .version = UCX_VERSION, .type = type, .seq = seq};
    if (len > 0)
        memcpy(tx->data, buf, len);
    param.user_data = tx;

    ucs_status_ptr_t req =
        ucp_am_send_nbx(ep->uep, UCX_AM_ID, &tx->hdr, sizeof(tx->hdr), tx->data, len, &param);

    if (req == NULL) {
        kvt_free(tx);
        return 0;
    }
    if (UCS_PTR_IS_ERR(req)) {
        int err = kvt__ucx_errno(UCS_PTR_STATUS(req));

        kvt_free(tx);
        kvt__ucx_ep_fail(ep, err);
        return err;
    }
    ep->tx_inflight++;
    ep->ucx_reqs++;
    return 0;
}

static void ucx_rx_insert(struct ucx_ep *ep, struct ucx_msg *m)
{
    struct kvt_list *pos = ep->rx.prev;

    /* Almost always the tail: walk back past later sequence numbers. */
    while (pos != &ep->rx && kvt_list_entry(pos, struct ucx_msg, node)->seq > m->seq)
        pos = pos->prev;
    kvt_list__insert(&m->node, pos, pos->next);
}

static void ucx_rndv_done(void *req, ucs_status_t status, size_t length, void *user_data)
{
    struct ucx_msg *m = user_data;

    ucp_request_free(req);
    if (m->ep == NULL) { /* its endpoint is gone */
        kvt_free(m);
        return;
    }
    m->ep->ucx_reqs--;
    m->ready = true;
    m->ep->tp->kick = true;
    if (status != UCS_OK || length != m->len) {
        m->failed = true;
        kvt__ucx_ep_fail(m->ep, status != UCS_OK ? kvt__ucx_errno(status) : -EPROTO);
    }
}

/* The endpoint an active message came on, or NULL (no reply ep: not one of ours). */
struct ucx_ep *kvt__ucx_am_ep(struct ucx_tp *tp, const ucp_am_recv_param_t *param)
{
    if (!(param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP))
        return NULL;
    return ucx_ep_find(tp, param->reply_ep);
}

static ucs_status_t ucx_am_cb(void *arg, const void *header, size_t header_length, void *data,
                              size_t length, const ucp_am_recv_param_t *param)
{
    struct ucx_tp *tp = arg;
    struct ucx_am_hdr hdr;
    struct ucx_ep *ep;
    bool rndv = param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV;
    bool keep = param->recv_attr & UCP_AM_RECV_ATTR_FLAG_DATA;

    ep = kvt__ucx_am_ep(tp, param);
    if (ep == NULL || ep->state >= EP_FAILED)
        return UCS_OK; /* dropped: the endpoint is closing */
    if (header_length != sizeof(hdr)) {
        kvt__ucx_ep_fail(ep, -EPROTO);
        return UCS_OK;
    }
    memcpy(&hdr, header, sizeof(hdr));
    if (hdr.magic != UCX_MAGIC || hdr.version != UCX_VERSION || hdr.seq < ep->rx_seq ||
        (hdr.type == UCX_MSG_DATA && length > tp->pub.cfg.max_msg_bytes) ||
        (hdr.type == UCX_MSG_HELLO && (length != 0 || hdr.seq != 0)) ||
        (hdr.type != UCX_MSG_DATA && hdr.type != UCX_MSG_HELLO)) {
        kvt_warn("ucx", "endpoint %llu: bad message (type %u, seq %llu, %zu bytes)",
                 (unsigned long long)ep->id, hdr.type, (unsigned long long)hdr.seq, length);
        kvt__ucx_ep_fail(ep, -EPROTO);
        return UCS_OK;
    }

    struct ucx_msg *m = kvt_malloc(sizeof(*m) + (keep ? 0 : length));

    if (m == NULL) {
        kvt__ucx_ep_fail(ep, -ENOMEM);
        return UCS_OK;
    }
    *m = (struct ucx_msg){.ep = ep, .seq = hdr.seq, .type = hdr.type, .len = length};
    m->data = m->buf;
    ucx_rx_insert(ep, m);
    tp->kick = true;
    if (rndv) {
        ucp_request_param_t rp = {
            .op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA,
            .cb.recv_am = ucx_rndv_done,
            .user_data = m,
        };
        ucs_status_ptr_t req = ucp_am_recv_data_nbx(tp->worker, data, m->buf, length, &rp);

        if (req == NULL) {
            m->ready = true;
        } else if (UCS_PTR_IS_ERR(req)) {
            m->ready = true;
            m->failed = true;
            kvt__ucx_ep_fail(ep, kvt__ucx_errno(UCS_PTR_STATUS(req)));
        } else {
            ep->ucx_reqs++;
        }
        return UCS_OK;
    }
    m->ready = true;
    if (keep) {
        m->desc = data;
        m->data = data;
        return UCS_INPROGRESS;
    }
    if (length > 0)
        memcpy(m->buf, data, length);
    return UCS_OK;
}

/* ---- dispatch: the owner's callbacks, outside ucp_worker_progress ---- */

static int ucx_deliver_rx(struct ucx_ep *ep)
{
    const struct kvt_tp_callbacks *cb = &ep->tp->pub.cfg.cb;
    int n = 0;

    while (!kvt_list_empty(&ep->rx) && (ep->state == EP_CONNECTED || ep->state == EP_CONNECTING)) {
        struct ucx_msg *m = kvt_list_entry(ep->rx.next, struct ucx_msg, node);

        if (!m->ready || m->seq != ep->rx_seq || m->failed)
            break;
        ep->rx_seq++;
        n++;
        if (m->type == UCX_MSG_HELLO) {
            ucx_msg_free(ep->tp, m);
            if (ep->state != EP_CONNECTING) {
                kvt__ucx_ep_fail(ep, -EPROTO);
                break;
            }
            ep->state = EP_CONNECTED;
            ep->connected_ns = ucx_now_ns();
            if (cb->on_ep_state != NULL)
                cb->on_ep_state(cb->arg, &ep->pub, KVT_EP_CONNECTED, 0);
            continue;
        }
        if (ep->state != EP_CONNECTED) { /* data before HELLO */
            ucx_msg_free(ep->tp, m);
            kvt__ucx_ep_fail(ep, -EPROTO);
            break;
        }
        /* Unlinked first: on_msg may close the endpoint. */
        kvt_list_del(&m->node);
        kvt_list_init(&m->node);
        if (cb->on_msg != NULL)
            cb->on_msg(cb->arg, &ep->pub, m->data, m->len);
        ucx_msg_free(ep->tp, m);
    }
    return n;
}

static int ucx_accept(struct ucx_ep *ep)
{
    const struct kvt_tp_callbacks *cb = &ep->tp->pub.cfg.cb;
    int ret;

    ep->state = EP_CONNECTED;
    ep->connected_ns = ucx_now_ns();
    ret = cb->on_accept != NULL ? cb->on_accept(cb->arg, &ep->pub) : 0;
    if (ret < 0) {
        ep->silent = true;
        kvt__ucx_ep_fail(ep, ret);
        return 1;
    }
    if (ep->state == EP_CONNECTED) /* the owner may have closed it already */
        ucx_post_am(ep, UCX_MSG_HELLO, 0, NULL, 0);
    return 1;
}

static int ucx_dispatch(struct ucx_tp *tp, bool deliver)
{
    const struct kvt_tp_callbacks *cb = &tp->pub.cfg.cb;
    struct kvt_list *pos, *tmp;
    int n = 0;

    if (deliver) {
        kvt_list_for_each_safe(pos, tmp, &tp->eps)
        {
            struct ucx_ep *ep = kvt_list_entry(pos, struct ucx_ep, node);

            if (ep->state == EP_ACCEPTING)
                n += ucx_accept(ep);
            n += ucx_deliver_rx(ep);
            n += kvt__ucx_rd_send_replies(ep);
        }
    }
    kvt_list_for_each_safe(pos, tmp, &tp->eps)
    {
        struct ucx_ep *ep = kvt_list_entry(pos, struct ucx_ep, node);

        if (ep->state == EP_FAILED)
            ucx_ep_teardown(ep);
    }
    while (!kvt_list_empty(&tp->done)) {
        struct ucx_batch *b = kvt_list_entry(tp->done.next, struct ucx_batch, node);

        kvt_list_del(&b->node);
        b->cb(b->arg, b->status);
        kvt_free(b);
        n++;
    }
    kvt_list_for_each_safe(pos, tmp, &tp->eps)
    {
        struct ucx_ep *ep = kvt_list_entry(pos, struct ucx_ep, node);

        if (ep->state != EP_FAILED || ep->uep != NULL || !kvt_list_empty(&ep->batches))
            continue;
        ep->state = EP_DEAD;
        kvt_list_del(&ep->node);
        kvt_list_add_tail(&tp->zombies, &ep->node);
        if (!ep->silent && cb->on_ep_state != NULL)
            cb->on_ep_state(cb->arg, &ep->pub, KVT_EP_CLOSED, ep->err);
        n++;
    }
    return n;
}

/* Frees the zombies UCX has let go of; true when none is left. */
static bool ucx_reap(struct ucx_tp *tp)
{
    struct kvt_list *pos, *tmp;

    kvt_list_for_each_safe(pos, tmp, &tp->zombies)
    {
        struct ucx_ep *ep = kvt_list_entry(pos, struct ucx_ep, node);

        if (ep->close_req != NULL && ucp_request_check_status(ep->close_req) != UCS_INPROGRESS) {
            ucp_request_free(ep->close_req);
            ep->close_req = NULL;
        }
        if (ep->close_req == NULL && ep->ucx_reqs == 0)
            ucx_ep_free(ep);
    }
    return kvt_list_empty(&tp->zombies);
}

/* Marks connect and op timeouts; returns the nearest deadline still ahead (0: none). */
static uint64_t ucx_check_timeouts(struct ucx_tp *tp, uint64_t now)
{
    uint64_t op_ns = (uint64_t)tp->pub.cfg.op_timeout_ms * 1000000ull;
    uint64_t next = 0;
    struct kvt_list *pos, *tmp;

    kvt_list_for_each_safe(pos, tmp, &tp->eps)
    {
        struct ucx_ep *ep = kvt_list_entry(pos, struct ucx_ep, node);
        uint64_t dl = 0;

        if (ep->state == EP_CONNECTING)
            dl = ep->deadline_ns;
        else if (ep->state == EP_CONNECTED && !kvt_list_empty(&ep->batches))
            dl = kvt_list_entry(ep->batches.next, struct ucx_batch, node)->start_ns + op_ns;
        if (dl == 0)
            continue;
        if (dl <= now) {
            kvt__ucx_ep_fail(ep, -ETIMEDOUT);
            continue;
        }
        if (next == 0 || dl < next)
            next = dl;
    }
    return next;
}

/* True when dispatch has work without any new UCX event. */
static bool ucx_work_pending(struct ucx_tp *tp)
{
    struct kvt_list *pos, *tmp;

    if (!kvt_list_empty(&tp->done))
        return true;
    kvt_list_for_each_safe(pos, tmp, &tp->eps)
    {
        struct ucx_ep *ep = kvt_list_entry(pos, struct ucx_ep, node);

        if (ep->state == EP_ACCEPTING || ep->state == EP_FAILED)
            return true;
        if (!kvt_list_empty(&ep->rd_q) && ep->state == EP_CONNECTED &&
            (ep->rd_inflight == 0 ||
             ep->rd_inflight + kvt_list_entry(ep->rd_q.next, struct ucx_rd_tx, node)->hdr.len <=
                 UCX_RD_INFLIGHT_BYTES))
            return true;
        if (!kvt_list_empty(&ep->rx)) {
            struct ucx_msg *m = kvt_list_entry(ep->rx.next, struct ucx_msg, node);

            if (m->ready && m->seq == ep->rx_seq)
                return true;
        }
    }
    return false;
}

/* ---- transport ---- */

static void ucx_close(struct kvt_transport *t);

/* KVT_UCX_READ=get|am: every endpoint's READs take that path; else each endpoint's
 * own lanes decide (ucx_ep_rd_path). */
static enum ucx_rd_path ucx_read_force(void)
{
    const char *force = getenv("KVT_UCX_READ");

    if (force != NULL && strcmp(force, "am") == 0)
        return RD_PATH_AM;
    if (force != NULL && strcmp(force, "get") == 0)
        return RD_PATH_GET;
    return RD_PATH_AUTO;
}

/* Whether a comma-separated list (UCX_TLS, or our lists of lane transports) holds
 * the first n bytes of name as an entry: whole, after UCX_TLS's leading "^", or with
 * a ":aux"-like suffix. */
static bool ucx_list_has(const char *list, const char *name, size_t n)
{
    for (const char *p = list + (list[0] == '^'); *p != '\0'; p += *p == ',') {
        size_t len = strcspn(p, ",");

        if (len >= n && strncmp(p, name, n) == 0 && (len == n || p[n] == ':'))
            return true;
        p += len;
    }
    return false;
}

static bool ucx_tls_names(const char *tls, const char *name)
{
    return ucx_list_has(tls, name, strlen(name));
}

/* Whether UCX_TLS (NULL: UCX's default, all) lets UCX open posix or sysv. */
static bool ucx_tls_has_mm(const char *tls)
{
    bool group, posix, sysv;

    if (tls == NULL)
        return true;
    group = ucx_tls_names(tls, "sm") || ucx_tls_names(tls, "shm") || ucx_tls_names(tls, "mm");
    posix = ucx_tls_names(tls, "posix");
    sysv = ucx_tls_names(tls, "sysv");
    if (tls[0] == '^') /* an exclusion list: is any of the two left? */
        return !group && !(posix && sysv);
    return group || posix || sysv || ucx_tls_names(tls, "all");
}

/* Peer-failure handling on posix/sysv and invalidation on cma (above), as UCT
 * settings on the config: each unless the user set it. Not for a UCX_TLS without
 * posix/sysv: UCX warns (on stdout) about a setting no transport took. */
static void ucx_config_shm(ucp_config_t *config)
{
    if (getenv("UCX_POSIX_ERROR_HANDLING") == NULL && getenv("UCX_SYSV_ERROR_HANDLING") == NULL &&
        getenv("UCX_MM_ERROR_HANDLING") == NULL && ucx_tls_has_mm(getenv("UCX_TLS")))
        (void)ucp_config_modify(config, "MM_ERROR_HANDLING", "y");
    /* Only cma's memory domain has this field in UCX 1.13 (src/uct/sm/scopy/cma). */
    if (getenv("UCX_CMA_MEMORY_INVALIDATE") == NULL)
        (void)ucp_config_modify(config, "MEMORY_INVALIDATE", "y");
}

static int ucx_open(const struct kvt_transport_config *cfg, struct kvt_transport **tp_p)
{
    extern const struct kvt_transport_ops kvt_ucx_transport_ops;
    struct ucx_tp *tp;
    ucp_config_t *config;
    ucs_status_t st;
    int ret;

    if (cfg == NULL || tp_p == NULL)
        return -EINVAL;
    tp = kvt_calloc(1, sizeof(*tp));
    if (tp == NULL)
        return -ENOMEM;
    tp->pub.ops = &kvt_ucx_transport_ops;
    tp->pub.cfg = *cfg;
    kvt_transport_config_defaults(&tp->pub.cfg);
    tp->epfd = tp->wfd = tp->tfd = -1;
    kvt_list_init(&tp->eps);
    kvt_list_init(&tp->zombies);
    kvt_list_init(&tp->done);
    kvt_list_init(&tp->orphans);
    kvt_list_init(&tp->mrs);
    kvt_list_init(&tp->rd_sent);
    tp->read_force = ucx_read_force();
    /* Test-only (tests/conformance test_read_refused_by_server): READs over AM skip
     * the client's check of the remote range, so the server's check is what refuses
     * them. Never set in production; ucp_get_nbx keeps the check (nothing on the
     * server checks a GET). */
    tp->test_no_rcheck = getenv("KVT_UCX_TEST_NO_CLIENT_RANGE_CHECK") != NULL;

    /* The user's settings win over each of these. A node restarted after SIGKILL
     * listens on its port again while the dead process's connections sit in
     * TIME_WAIT. */
    setenv("UCX_TCP_CM_REUSEADDR", "y", 0);
    setenv("UCX_RDMA_CM_REUSEADDR", "y", 0);
    st = ucp_config_read(NULL, NULL, &config);
    if (st != UCS_OK) {
        ret = kvt__ucx_errno(st);
        goto err_free;
    }
    /* Shared memory between two nodes on one host: our endpoints need peer-failure
     * handling (mode PEER), and UCX 1.13 gives such endpoints shared memory only
     * when posix/sysv report peer failures (off by default) and cma invalidates
     * registrations (required of PEER-mode rendezvous lanes). With them active
     * messages move over sysv and large ones by rendezvous over cma
     * (process_vm_readv); without them every byte went through loopback tcp. */
    ucx_config_shm(config);
    ucp_params_t params = {
        .field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_NAME,
        .features = UCP_FEATURE_AM | UCP_FEATURE_RMA | UCP_FEATURE_WAKEUP,
        .name = "kvtier",
    };
    st = ucp_init(&params, config, &tp->ctx);
    ucp_config_release(config);
    if (st != UCS_OK) {
        ret = kvt__ucx_errno(st);
        kvt_error("ucx", "ucp_init: %s", ucs_status_string(st));
        goto err_free;
    }
    ucp_worker_params_t wp = {
        .field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE,
        .thread_mode = UCS_THREAD_MODE_SINGLE,
    };
    st = ucp_worker_create(tp->ctx, &wp, &tp->worker);
    if (st != UCS_OK) {
        ret = kvt__ucx_errno(st);
        kvt_error("ucx", "ucp_worker_create: %s", ucs_status_string(st));
        goto err_cleanup;
    }
    ucp_am_handler_param_t ap = {
        .field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_FLAGS |
                      UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG,
        .id = UCX_AM_ID,
        .flags = UCP_AM_FLAG_WHOLE_MSG,
        .cb = ucx_am_cb,
        .arg = tp,
    };
    st = ucp_worker_set_am_recv_handler(tp->worker, &ap);
    ap.id = UCX_AM_RDREQ;
    ap.cb = kvt__ucx_rdreq_cb;
    if (st == UCS_OK)
        st = ucp_worker_set_am_recv_handler(tp->worker, &ap);
    ap.id = UCX_AM_RDREP;
    ap.cb = kvt__ucx_rdrep_cb;
    if (st == UCS_OK)
        st = ucp_worker_set_am_recv_handler(tp->worker, &ap);
    if (st == UCS_OK)
        st = ucp_worker_get_efd(tp->worker, &tp->wfd);
    if (st != UCS_OK) {
        ret = kvt__ucx_errno(st);
        kvt_error("ucx", "worker setup: %s", ucs_status_string(st));
        goto err_worker;
    }
    tp->tfd = timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC);
    tp->epfd = epoll_create1(EPOLL_CLOEXEC);
    if (tp->tfd < 0 || tp->epfd < 0) {
        ret = -errno;
        goto err_fds;
    }
    struct epoll_event ev = {.events = EPOLLIN};
    if (epoll_ctl(tp->epfd, EPOLL_CTL_ADD, tp->wfd, &ev) < 0 ||
        epoll_ctl(tp->epfd, EPOLL_CTL_ADD, tp->tfd, &ev) < 0) {
        ret = -errno;
        goto err_fds;
    }
    *tp_p = &tp->pub;
    return 0;

err_fds:
    if (tp->tfd >= 0)
        close(tp->tfd);
    if (tp->epfd >= 0)
        close(tp->epfd);
err_worker:
    ucp_worker_destroy(tp->worker);
err_cleanup:
    ucp_cleanup(tp->ctx);
err_free:
    kvt_free(tp);
    return ret;
}

/* The close deadline passed with requests still in UCX: reports every batch left and
 * every endpoint as closed now; the batches stay allocated (orphans) until the worker
 * is destroyed, because UCX may still complete their requests. */
static void ucx_abandon(struct ucx_tp *tp)
{
    struct kvt_list *pos, *tmp, *bpos, *btmp;

    kvt_warn("ucx", "close: requests still in flight after %llu ms, abandoned",
             (unsigned long long)(UCX_CLOSE_WAIT_NS / 1000000));
    kvt_list_for_each_safe(pos, tmp, &tp->eps)
    {
        struct ucx_ep *ep = kvt_list_entry(pos, struct ucx_ep, node);

        kvt_list_for_each_safe(bpos, btmp, &ep->batches)
        {
            struct ucx_batch *b = kvt_list_entry(bpos, struct ucx_batch, node);

            kvt_list_del(&b->node);
            ep->n_batches--;
            ep->ucx_reqs -= b->pending;
            b->ep = NULL;
            b->cb(b->arg, b->status != 0 ? b->status : -ECANCELED);
            kvt_list_add_tail(&tp->orphans, &b->node);
        }
    }
    ucx_dispatch(tp, false); /* the CLOSED reports */
}

static void ucx_close(struct kvt_transport *t)
{
    struct ucx_tp *tp = tp_of(t);
    struct kvt_list *pos, *tmp;

    tp->closing = true;
    if (tp->listener != NULL) {
        ucp_listener_destroy(tp->listener);
        tp->listener = NULL;
    }
    kvt_list_for_each_safe(pos, tmp, &tp->eps)
        kvt__ucx_ep_fail(kvt_list_entry(pos, struct ucx_ep, node), 0);
    /* Batches and CLOSED reports before close returns; no more messages. A force
     * close does not complete every request inside ucp_ep_close_nbx (a get still on
     * its way over tcp completes from progress), so the worker keeps running. */
    uint64_t until = ucx_now_ns() + UCX_CLOSE_WAIT_NS;

    for (;;) {
        ucx_dispatch(tp, false);
        if (kvt_list_empty(&tp->eps) && kvt_list_empty(&tp->done))
            break;
        if (ucx_now_ns() >= until) {
            ucx_abandon(tp);
            break;
        }
        ucp_worker_progress(tp->worker);
    }

    while (!ucx_reap(tp) && ucx_now_ns() < until)
        ucp_worker_progress(tp->worker);
    kvt_list_for_each_safe(pos, tmp, &tp->zombies)
    {
        struct ucx_ep *ep = kvt_list_entry(pos, struct ucx_ep, node);

        if (ep->close_req != NULL)
            ucp_request_free(ep->close_req);
        ucx_ep_free(ep);
    }
    close(tp->epfd);
    close(tp->tfd);
    ucp_worker_destroy(tp->worker);
    ucp_cleanup(tp->ctx);
    kvt_list_for_each_safe(pos, tmp, &tp->orphans)
    {
        kvt_list_del(pos);
        kvt_free(kvt_list_entry(pos, struct ucx_batch, node));
    }
    kvt_list_for_each_safe(pos, tmp, &tp->rd_sent) /* sends UCX never completed */
    {
        kvt_list_del(pos);
        kvt_free(kvt_list_entry(pos, struct ucx_rd_tx, node));
    }
    kvt_free(tp);
}

static int ucx_sockaddr(const char *addr, uint16_t port, struct sockaddr_storage *ss,
                        socklen_t *len_p)
{
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM};
    struct addrinfo *res;

    if (addr == NULL)
        return -EINVAL;
    if (getaddrinfo(addr, NULL, &hints, &res) != 0 || res == NULL)
        return -EINVAL;
    if (res->ai_addrlen > sizeof(*ss)) {
        freeaddrinfo(res);
        return -EINVAL;
    }
    memcpy(ss, res->ai_addr, res->ai_addrlen);
    *len_p = res->ai_addrlen;
    freeaddrinfo(res);
    if (ss->ss_family == AF_INET)
        ((struct sockaddr_in *)ss)->sin_port = htons(port);
    else if (ss->ss_family == AF_INET6)
        ((struct sockaddr_in6 *)ss)->sin6_port = htons(port);
    else
        return -EAFNOSUPPORT;
    return 0;
}

static void ucx_conn_cb(ucp_conn_request_h creq, void *arg)
{
    struct ucx_tp *tp = arg;
    struct ucx_ep *ep = tp->closing ? NULL : ucx_ep_alloc(tp);
    ucs_status_t st;

    if (ep == NULL) {
        ucp_listener_reject(tp->listener, creq);
        return;
    }
    ucp_ep_params_t p = {
        .field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                      UCP_EP_PARAM_FIELD_ERR_HANDLER,
        .conn_request = creq,
        .err_mode = UCP_ERR_HANDLING_MODE_PEER,
        .err_handler = {.cb = ucx_err_cb, .arg = ep},
    };
    st = ucp_ep_create(tp->worker, &p, &ep->uep);
    if (st != UCS_OK) {
        kvt_warn("ucx", "accept: ucp_ep_create: %s", ucs_status_string(st));
        kvt_free(ep);
        return;
    }
    ep->state = EP_ACCEPTING;
    ep->tx_seq = 1; /* 0 is the HELLO sent once the owner accepts */
    kvt_list_add_tail(&tp->eps, &ep->node);
    tp->kick = true;
}

static int ucx_listen(struct kvt_transport *t, const char *addr, uint16_t port, uint16_t *port_p)
{
    struct ucx_tp *tp = tp_of(t);
    struct sockaddr_storage ss;
    socklen_t len;
    ucs_status_t st;
    int ret;

    if (tp->listener != NULL)
        return -EBUSY;
    ret = ucx_sockaddr(addr, port, &ss, &len);
    if (ret < 0)
        return ret;
    ucp_listener_params_t lp = {
        .field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER,
        .sockaddr = {.addr = (const struct sockaddr *)&ss, .addrlen = len},
        .conn_handler = {.cb = ucx_conn_cb, .arg = tp},
    };
    st = ucp_listener_create(tp->worker, &lp, &tp->listener);
    if (st != UCS_OK) {
        kvt_error("ucx", "listen on %s:%u: %s", addr, port, ucs_status_string(st));
        tp->listener = NULL;
        return st == UCS_ERR_BUSY ? -EADDRINUSE : kvt__ucx_errno(st);
    }
    ucp_listener_attr_t la = {.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR};
    st = ucp_listener_query(tp->listener, &la);
    if (st != UCS_OK) {
        ucp_listener_destroy(tp->listener);
        tp->listener = NULL;
        return kvt__ucx_errno(st);
    }
    if (port_p != NULL)
        *port_p = la.sockaddr.ss_family == AF_INET6
                      ? ntohs(((struct sockaddr_in6 *)&la.sockaddr)->sin6_port)
                      : ntohs(((struct sockaddr_in *)&la.sockaddr)->sin_port);
    return 0;
}

static int ucx_connect(struct kvt_transport *t, const char *addr, uint16_t port, void *user,
                       struct kvt_tp_ep **ep_p)
{
    struct ucx_tp *tp = tp_of(t);
    struct sockaddr_storage ss;
    struct ucx_ep *ep;
    socklen_t len;
    ucs_status_t st;
    int ret;

    if (ep_p == NULL || port == 0)
        return -EINVAL;
    ret = ucx_sockaddr(addr, port, &ss, &len);
    if (ret < 0)
        return ret;
    ep = ucx_ep_alloc(tp);
    if (ep == NULL)
        return -ENOMEM;
    ep->pub.user = user;
    ep->state = EP_CONNECTING;
    ep->deadline_ns = ucx_now_ns() + (uint64_t)tp->pub.cfg.connect_timeout_ms * 1000000ull;

    ucp_ep_params_t p = {
        .field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR |
                      UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER,
        .flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER,
        .sockaddr = {.addr = (const struct sockaddr *)&ss, .addrlen = len},
        .err_mode = UCP_ERR_HANDLING_MODE_PEER,
        .err_handler = {.cb = ucx_err_cb, .arg = ep},
    };
    st = ucp_ep_create(tp->worker, &p, &ep->uep);
    if (st != UCS_OK) {
        kvt_free(ep);
        return kvt__ucx_errno(st);
    }
    kvt_list_add_tail(&tp->eps, &ep->node);
    *ep_p = &ep->pub;
    return 0;
}

static void ucx_ep_close(struct kvt_tp_ep *pep)
{
    struct ucx_ep *ep = ep_of(pep);

    kvt__ucx_ep_fail(ep, 0);
    ucx_ep_teardown(ep);
}

static int ucx_send(struct kvt_tp_ep *pep, const void *buf, size_t len)
{
    struct ucx_ep *ep = ep_of(pep);
    int ret;

    if (ep->state != EP_CONNECTED)
        return -ENOTCONN;
    if (buf == NULL && len > 0)
        return -EINVAL;
    if (len > ep->tp->pub.cfg.max_msg_bytes)
        return -EMSGSIZE;
    if (ep->tx_inflight >= ep->tp->pub.cfg.recv_credits)
        return -EAGAIN;
    ret = ucx_post_am(ep, UCX_MSG_DATA, ep->tx_seq, buf, len);
    if (ret == 0)
        ep->tx_seq++;
    return ret;
}

/* ---- memory ---- */

static int ucx_reg(struct kvt_transport *t, void *base, size_t len, bool remote,
                   struct kvt_tp_mr **mr_p)
{
    struct ucx_tp *tp = tp_of(t);
    struct kvt_tp_mr *mr;
    ucs_status_t st;
    int ret;

    if (base == NULL || len == 0 || len > UCX_MAX_REG_BYTES || mr_p == NULL)
        return -EINVAL;
    mr = kvt_calloc(1, sizeof(*mr));
    if (mr == NULL)
        return -ENOMEM;
    mr->tp = tp;
    mr->base = base;
    mr->len = len;
    kvt_list_init(&mr->node);

    ucp_mem_map_params_t mp = {
        .field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                      UCP_MEM_MAP_PARAM_FIELD_PROT,
        .address = base,
        .length = len,
        .prot = UCP_MEM_MAP_PROT_LOCAL_READ | UCP_MEM_MAP_PROT_LOCAL_WRITE |
                (remote ? UCP_MEM_MAP_PROT_REMOTE_READ : 0),
    };
    st = ucp_mem_map(tp->ctx, &mp, &mr->memh);
    if (st != UCS_OK) {
        ret = kvt__ucx_errno(st);
        kvt_error("ucx", "ucp_mem_map of %zu bytes: %s", len, ucs_status_string(st));
        goto err_free;
    }
    if (remote) {
        st = ucp_rkey_pack(tp->ctx, mr->memh, &mr->rkey_buf, &mr->rkey_len);
        if (st != UCS_OK) {
            ret = kvt__ucx_errno(st);
            kvt_error("ucx", "ucp_rkey_pack: %s", ucs_status_string(st));
            goto err_unmap;
        }
        if (mr->rkey_len > KVT_TP_MAX_HANDLE_SIZE - sizeof(struct ucx_handle_hdr)) {
            kvt_error("ucx", "packed rkey of %zu bytes exceeds the handle size", mr->rkey_len);
            ret = -E2BIG;
            goto err_rkey;
        }
        kvt_list_add_tail(&tp->mrs, &mr->node);
    }
    *mr_p = mr;
    return 0;

err_rkey:
    ucp_rkey_buffer_release(mr->rkey_buf);
err_unmap:
    ucp_mem_unmap(tp->ctx, mr->memh);
err_free:
    kvt_free(mr);
    return ret;
}

static int ucx_reg_remote(struct kvt_transport *t, void *base, size_t len, struct kvt_tp_mr **mr_p)
{
    return ucx_reg(t, base, len, true, mr_p);
}

static int ucx_reg_local(struct kvt_transport *t, void *base, size_t len, struct kvt_tp_mr **mr_p)
{
    return ucx_reg(t, base, len, false, mr_p);
}

static void ucx_dereg(struct kvt_tp_mr *mr)
{
    struct kvt_list *pos, *tmp;

    if (mr == NULL)
        return;
    /* No new READ reply from it; those in flight read it until UCX is done. */
    kvt_list_del(&mr->node);
    kvt_list_init(&mr->node);
    if (mr->inflight > 0) {
        uint64_t until = ucx_now_ns() + UCX_CLOSE_WAIT_NS;

        while (mr->inflight > 0 && ucx_now_ns() < until)
            ucp_worker_progress(mr->tp->worker);
        if (mr->inflight > 0)
            kvt_warn("ucx", "dereg: %u READ replies still in flight", mr->inflight);
    }
    /* Queued replies from it become refusals; late completions forget it. */
    kvt_list_for_each_safe(pos, tmp, &mr->tp->rd_sent)
    {
        struct ucx_rd_tx *tx = kvt_list_entry(pos, struct ucx_rd_tx, node);

        if (tx->mr == mr)
            tx->mr = NULL;
    }
    kvt_list_for_each_safe(pos, tmp, &mr->tp->eps)
    {
        struct ucx_ep *ep = kvt_list_entry(pos, struct ucx_ep, node);
        struct kvt_list *q, *qtmp;

        kvt_list_for_each_safe(q, qtmp, &ep->rd_q)
        {
            struct ucx_rd_tx *tx = kvt_list_entry(q, struct ucx_rd_tx, node);

            if (tx->mr == mr) {
                tx->mr = NULL;
                tx->hdr.err = EFAULT;
                tx->hdr.len = 0;
            }
        }
    }
    if (mr->rkey_buf != NULL)
        ucp_rkey_buffer_release(mr->rkey_buf);
    ucp_mem_unmap(mr->tp->ctx, mr->memh);
    kvt_free(mr);
}

static int ucx_pack(struct kvt_tp_mr *mr, void *buf, size_t cap, size_t *len_p)
{
    struct ucx_handle_hdr h;
    size_t total;

    if (mr == NULL || mr->rkey_buf == NULL || len_p == NULL)
        return -EINVAL;
    total = sizeof(h) + mr->rkey_len;
    if (buf == NULL || cap < total)
        return -ENOSPC;
    h.magic = htole32(UCX_MAGIC);
    h.rkey_len = htole32((uint32_t)mr->rkey_len);
    h.base = htole64((uint64_t)(uintptr_t)mr->base);
    h.len = htole64(mr->len);
    memcpy(buf, &h, sizeof(h));
    memcpy((uint8_t *)buf + sizeof(h), mr->rkey_buf, mr->rkey_len);
    *len_p = total;
    return 0;
}

static int ucx_unpack(struct kvt_tp_ep *pep, const void *buf, size_t len, struct kvt_tp_rkey **rk_p)
{
    struct ucx_ep *ep = ep_of(pep);
    struct ucx_handle_hdr h;
    struct kvt_tp_rkey *rk;
    ucs_status_t st;

    if (buf == NULL || rk_p == NULL)
        return -EINVAL;
    if (ep->state != EP_CONNECTED)
        return -ENOTCONN;
    if (len < sizeof(h) || len > KVT_TP_MAX_HANDLE_SIZE)
        return -EPROTO;
    memcpy(&h, buf, sizeof(h));
    h.magic = le32toh(h.magic);
    h.rkey_len = le32toh(h.rkey_len);
    h.base = le64toh(h.base);
    h.len = le64toh(h.len);
    if (h.magic != UCX_MAGIC || h.rkey_len != len - sizeof(h) || h.rkey_len == 0 || h.len == 0 ||
        h.len > UCX_MAX_REG_BYTES || h.base + h.len < h.base)
        return -EPROTO;
    rk = kvt_calloc(1, sizeof(*rk));
    if (rk == NULL)
        return -ENOMEM;
    st = ucp_ep_rkey_unpack(ep->uep, (const uint8_t *)buf + sizeof(h), &rk->rkey);
    if (st != UCS_OK) {
        kvt_free(rk);
        return st == UCS_ERR_INVALID_PARAM ? -EPROTO : kvt__ucx_errno(st);
    }
    rk->ep_id = ep->id;
    rk->base = h.base;
    rk->len = h.len;
    *rk_p = rk;
    return 0;
}

static void ucx_rkey_destroy(struct kvt_tp_rkey *rk)
{
    if (rk == NULL)
        return;
    ucp_rkey_destroy(rk->rkey);
    kvt_free(rk);
}

/* ---- READ batches ---- */

/* Appends the transport of a ucp_ep_print_info lane line ("lane[3]:  5:cma/memory.0
 * md[4] -> ... rma_bw#0") to the comma-separated list out, once. False when the line
 * cannot be read or the name does not fit: the caller then assumes the worst. */
static bool ucx_lane_add(const char *line, char *out, size_t cap)
{
    const char *p = strstr(line, "]:");
    size_t n, used = strlen(out);

    if (p == NULL)
        return false;
    p += 2;
    while (*p == ' ' || (*p >= '0' && *p <= '9'))
        p++;
    if (*p++ != ':')
        return false;
    n = strcspn(p, "/ ");
    if (n == 0)
        return false;
    if (ucx_list_has(out, p, n))
        return true;
    if (used + n + 2 > cap)
        return false;
    snprintf(out + used, cap - used, "%s%.*s", used > 0 ? "," : "", (int)n, p);
    return true;
}

/* Whether a lane line carries the given role word (" am", "rma_bw#0", ...). */
static bool ucx_lane_is(const char *line, const char *role)
{
    size_t n = strlen(role);

    for (const char *p = strstr(line, role); p != NULL; p = strstr(p + 1, role))
        if (p[n] == ' ' || p[n] == '\0' || p[n] == '#')
            return true;
    return false;
}

/* The transports of ep's AM lane and of its high-bandwidth RMA lanes (GET, and the
 * rendezvous of large AM replies), from ucp_ep_print_info: UCX 1.13 has no query.
 * False when some lane could not be read (the lists are then incomplete). */
static bool ucx_ep_lanes(struct ucx_ep *ep)
{
    char *text = NULL, *line, *save = NULL;
    size_t len = 0;
    bool ok = true;
    FILE *f = open_memstream(&text, &len);

    ep->am_lanes[0] = ep->bw_lanes[0] = '\0';
    if (f == NULL)
        return false;
    ucp_ep_print_info(ep->uep, f);
    if (fclose(f) != 0 || text == NULL) {
        free(text);
        return false;
    }
    for (line = strtok_r(text, "\n", &save); line != NULL; line = strtok_r(NULL, "\n", &save)) {
        if (strstr(line, "lane[") == NULL)
            continue;
        if (ucx_lane_is(line, " am"))
            ok &= ucx_lane_add(line, ep->am_lanes, sizeof(ep->am_lanes));
        if (ucx_lane_is(line, "rma_bw"))
            ok &= ucx_lane_add(line, ep->bw_lanes, sizeof(ep->bw_lanes));
    }
    free(text);
    return ok;
}

/* Whether every name in the list is an RDMA transport (rc_verbs, rc_mlx5, dc_mlx5). */
static bool ucx_lanes_rdma(const char *list)
{
    if (list[0] == '\0')
        return false;
    for (const char *p = list;; p++) {
        if (strncmp(p, "rc", 2) != 0 && strncmp(p, "dc", 2) != 0)
            return false;
        if ((p = strchr(p, ',')) == NULL)
            return true;
    }
}

/* How ep's READs move: ucp_get_nbx where UCP does the GET in hardware, i.e. the
 * endpoint's RMA lanes are RDMA; everywhere else UCP 1.13 would emulate GET over
 * its AM lane (tcp, or sysv shared memory between two nodes on one host: UCP does
 * not GET over cma from memory it did not allocate itself), with the abort
 * described at "READ over active messages", so there our own READ over AM (on one
 * host: requests over sysv, large replies by rendezvous over cma). An AM choice is
 * re-checked while wireup may still move the endpoint to other lanes; GET is final.
 * KVT_UCX_READ overrides. */
static enum ucx_rd_path ucx_ep_rd_path(struct ucx_ep *ep)
{
    uint64_t now;

    if (ep->tp->read_force != RD_PATH_AUTO)
        return ep->tp->read_force;
    if (ep->rd_path_final) /* every READ after the first seconds: no clock, no parse */
        return ep->rd_path;
    now = ucx_now_ns();
    if (ep->rd_path == RD_PATH_AM && now - ep->rd_path_checked_ns < UCX_RD_PATH_RECHECK_NS)
        return RD_PATH_AM;
    ep->rd_path_checked_ns = now;
    ep->rd_path = ucx_ep_lanes(ep) && ucx_lanes_rdma(ep->bw_lanes) ? RD_PATH_GET : RD_PATH_AM;
    ep->rd_path_final = ep->rd_path == RD_PATH_GET || now - ep->connected_ns > UCX_WIREUP_SETTLE_NS;
    return ep->rd_path;
}

static int ucx_read(struct kvt_tp_ep *pep, struct kvt_tp_rkey *rk, struct kvt_tp_mr *local,
                    const struct kvt_read_op *ops, size_t n, kvt_read_cb cb, void *arg)
{
    struct ucx_ep *ep = ep_of(pep);
    struct ucx_batch *b;
    int err = 0;

    if (ep->state != EP_CONNECTED)
        return -ENOTCONN;
    if (rk == NULL || local == NULL || ops == NULL || n == 0 || n > UINT32_MAX || cb == NULL ||
        rk->ep_id != ep->id || local->tp != ep->tp)
        return -EINVAL;
    bool am = ucx_ep_rd_path(ep) == RD_PATH_AM;

    for (size_t i = 0; i < n; i++)
        if ((!(am && ep->tp->test_no_rcheck) &&
             !ucx_in_range(ops[i].remote_off, ops[i].len, rk->len)) ||
            !ucx_in_range(ops[i].local_off, ops[i].len, local->len))
            return -EINVAL;
    if (ep->n_batches >= ep->tp->pub.cfg.max_batches)
        return -EAGAIN;

    b = kvt_calloc(1, sizeof(*b) + (am ? n * sizeof(b->ops[0]) : 0));
    if (b == NULL)
        return -ENOMEM;
    b->ep = ep;
    b->id = ep->next_batch_id++;
    b->n_ops = am ? n : 0;
    b->cb = cb;
    b->arg = arg;
    b->start_ns = ucx_now_ns();
    b->pending = 1; /* held while posting */
    kvt_list_add_tail(&ep->batches, &b->node);
    ep->n_batches++;

    ucp_request_param_t param = {
        .op_attr_mask =
            UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_MEMH,
        .cb.send = kvt__ucx_batch_req_done,
        .user_data = b,
        .memh = local->memh,
    };
    size_t i = 0;

    if (am)
        err = kvt__ucx_read_am(ep, b, rk, local, ops, n, &i);
    for (; !am && i < n; i++) {
        ucs_status_ptr_t req = ucp_get_nbx(ep->uep, local->base + ops[i].local_off, ops[i].len,
                                           rk->base + ops[i].remote_off, rk->rkey, &param);

        if (req == NULL)
            continue;
        if (UCS_PTR_IS_ERR(req)) {
            err = kvt__ucx_errno(UCS_PTR_STATUS(req));
            break;
        }
        b->pending++;
        ep->ucx_reqs++;
    }
    if (err != 0) {
        kvt__ucx_ep_fail(ep, err);
        if (i == 0) { /* nothing posted: fail without a callback */
            kvt_list_del(&b->node);
            ep->n_batches--;
            kvt_free(b);
            return err;
        }
        if (b->status == 0)
            b->status = err;
    }
    if (--b->pending == 0)
        kvt__ucx_batch_finish(b);
    return -EINPROGRESS;
}

/* ---- the loop ---- */

/* The busy-polling owner calls this in a tight loop, so it costs no system call of
 * its own: the timerfd is read only once its deadline has passed (arm resets it
 * anyway), and worker progress stops as soon as a UCX callback has left work for
 * dispatch, so a completion reaches its callback without one more empty
 * ucp_worker_progress (an epoll_wait over tcp) first. */
static int ucx_progress(struct kvt_transport *t)
{
    struct ucx_tp *tp = tp_of(t);
    uint64_t now;
    int n = 0;

    tp->kick = false;
    for (int i = 0; i < UCX_PROGRESS_MAX; i++) {
        unsigned k = ucp_worker_progress(tp->worker);

        n += (int)k;
        if (k == 0 || tp->kick)
            break;
    }
    n += ucx_dispatch(tp, true);
    now = ucx_now_ns();
    if (tp->timer_at_ns != 0 && now >= tp->timer_at_ns) {
        uint64_t expirations;

        while (read(tp->tfd, &expirations, sizeof(expirations)) > 0)
            ;
        tp->timer_at_ns = 0;
    }
    ucx_check_timeouts(tp, now);
    if (tp->kick) /* a deadline passed, or dispatch's callbacks left work */
        n += ucx_dispatch(tp, true);
    if (!kvt_list_empty(&tp->zombies))
        ucx_reap(tp);
    return n;
}

static int ucx_event_fd(struct kvt_transport *t)
{
    return tp_of(t)->epfd;
}

static int ucx_arm(struct kvt_transport *t)
{
    struct ucx_tp *tp = tp_of(t);
    uint64_t now = ucx_now_ns();
    uint64_t next;
    ucs_status_t st;

    if (ucx_work_pending(tp))
        return -EAGAIN;
    next = ucx_check_timeouts(tp, now);
    if (ucx_work_pending(tp))
        return -EAGAIN; /* a deadline just passed */
    st = ucp_worker_arm(tp->worker);
    if (st == UCS_ERR_BUSY)
        return -EAGAIN;
    if (st != UCS_OK)
        return kvt__ucx_errno(st);

    struct itimerspec its = {0};

    if (next != 0) {
        its.it_value.tv_sec = (time_t)(next / 1000000000ull);
        its.it_value.tv_nsec = (long)(next % 1000000000ull);
    }
    if (timerfd_settime(tp->tfd, TFD_TIMER_ABSTIME, &its, NULL) < 0)
        return -errno;
    tp->timer_at_ns = next;
    return 0;
}

static int ucx_ep_info(struct kvt_tp_ep *pep, char *buf, size_t cap)
{
    struct ucx_ep *ep = ep_of(pep);
    const char *forced;
    enum ucx_rd_path path;

    if (cap == 0)
        return -EINVAL;
    if (ep->state != EP_CONNECTED)
        return -ENOTCONN;
    path = ucx_ep_rd_path(ep);
    (void)ucx_ep_lanes(ep); /* as they are now, for people */
    forced = ep->tp->read_force != RD_PATH_AUTO ? " (KVT_UCX_READ)" : "";
    if (path == RD_PATH_GET)
        snprintf(buf, cap, "get over %s%s", ep->bw_lanes, forced);
    else
        snprintf(buf, cap, "am over %s, rndv over %s%s", ep->am_lanes, ep->bw_lanes, forced);
    return 0;
}

const struct kvt_transport_ops kvt_ucx_transport_ops = {
    .name = "ucx",
    .open = ucx_open,
    .close = ucx_close,
    .listen = ucx_listen,
    .connect = ucx_connect,
    .ep_close = ucx_ep_close,
    .send = ucx_send,
    .reg_remote = ucx_reg_remote,
    .reg_local = ucx_reg_local,
    .dereg = ucx_dereg,
    .pack = ucx_pack,
    .unpack = ucx_unpack,
    .rkey_destroy = ucx_rkey_destroy,
    .read = ucx_read,
    .progress = ucx_progress,
    .event_fd = ucx_event_fd,
    .arm = ucx_arm,
    .ep_info = ucx_ep_info,
};

/* SPDX-License-Identifier: Apache-2.0 */
/* The UCX backend of the transport interface (kvt/transport.h).
 *
 * One UCP context and one worker per transport, single-threaded, owned by the node's
 * loop. A connection starts on a TCP socket of our own (ucx_sock.c: our listener,
 * frames of kvt/tp_frame.h), which carries everything until the owner authorizes
 * the endpoint: the HELLO, control messages bounded in size and number, READ
 * requests (refused). Authorizing sends our worker address and a fresh 128-bit token
 * as the last frame; with the peer's address and token in too, each side gets a ucp
 * ep to the other's worker (one makes it, the other adopts UCX's match once told:
 * kvt__ucx_ep_wire) and every later message and READ moves as an active message that
 * names the receiver's token. Our AM handlers find the endpoint by that
 * token and drop (and count) anything else, so nobody reaches our worker's handlers
 * without the handshake, even one who wires up to our worker directly. The UCX
 * context has no RMA feature: no software GET handler answers anyone from our memory;
 * READs are request/reply over active messages (ucx_am_read.c; UCX moves large
 * replies by rendezvous, over RDMA where there is hardware, over cma between two
 * local nodes). UCX never gets tcp (ucx_config_tls: UCX's own tcp port lets anyone
 * write into our memory): a connection whose peers have neither shared memory nor
 * RDMA between them moves its messages and READs over our own socket instead
 * (socket mode, ucx_sock_read.c; the path is chosen per connection after both
 * authorized, kvt__ucx_ep_wire). Shared structures: ucx_int.h.
 *
 * Why every user callback is deferred: UCX calls us back from inside
 * ucp_worker_progress() (AM arrival, peer failure, request completion) and from inside
 * ucp_ep_close_nbx() (force close completes every outstanding request). Those UCX
 * callbacks only record what happened in our own structures; dispatch() runs after
 * ucp_worker_progress() returns and calls the owner's callbacks, so the owner may call
 * any transport function from them. (may_read is the exception: a question asked
 * from the READ request handler, see kvt/transport.h.)
 *
 * Endpoint states:
 *   ACCEPTING  passive side, the socket accepted; dispatch queues our HELLO frame,
 *              calls on_accept, then writes what is queued and the ep is CONNECTED.
 *   CONNECTING active side, waiting for the server's HELLO (or connect timeout).
 *   CONNECTED  usable (messages bounded until authorized).
 *   FAILED     an error or a local close was seen (ep->err); teardown closes the
 *              socket and force-closes the ucp ep, which completes every request; its
 *              batches complete with the ep's error (-ECANCELED for a local close),
 *              then CLOSED is reported once (not for a refused accept).
 *   DEAD       CLOSED reported; the ep waits on tp->zombies until UCX holds no
 *              request that names it, then it is freed.
 * Across CONNECTED: authorized (our ep_authorize, our ADDR sent), peer_addr (the
 * peer's ADDR read), path (both: decided by the creator, told in its MODE frame;
 * PATH_UCX: uep, the active-message channel; PATH_SOCK: frames on the socket).
 *
 * Control message order: one sequence space per direction over both channels. The
 * passive side's HELLO is 0; every DATA or RDREQ frame on the socket before ADDR,
 * and every MSG frame of socket mode, takes the next number on both ends, and each
 * active message carries its own. Socket frames are
 * filed into ep->rx as they are read, active messages by their seq; eager data is
 * kept (persistent UCX descriptor) or copied, rendezvous data is fetched with
 * ucp_am_recv_data_nbx. dispatch delivers the head while it is complete and in
 * sequence, so nothing overtakes what was sent before it, on either channel.
 * -EAGAIN on send is the local bound: recv_credits messages not yet completed by UCX
 * (or waiting for the ucp ep).
 *
 * Event fd: an epoll fd holding the worker's efd, a timerfd armed (in arm) for the
 * nearest deadline, and the epoll set of our sockets.
 *
 * Handle layout (pack/unpack): {magic, 0, base, length} little-endian. The base
 * address stays inside the handle: the owner names remote memory by offsets only,
 * every op is checked against the length, and the server checks each request against
 * its registrations again. */
#include <dirent.h>
#include <endian.h>
#include <errno.h>
#include <ifaddrs.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/random.h>
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
    kvt__ucx_ep_account(ep);
}

void kvt__ucx_ep_proto(struct ucx_ep *ep, const char *why)
{
    if (ep->state >= EP_FAILED)
        return;
    ep->tp->counters.refused[KVT_TP_PROTO]++;
    kvt_warn("ucx", "endpoint %llu: %s; closed", (unsigned long long)ep->id, why);
    kvt__ucx_ep_fail(ep, -EPROTO);
}

void kvt__ucx_batch_finish(struct ucx_batch *b)
{
    struct ucx_ep *ep = b->ep;

    kvt_list_del(&b->node);
    ep->n_batches--;
    kvt_list_add_tail(&ep->tp->done, &b->node);
    ep->tp->kick = true;
}

void kvt__ucx_ep_account(struct ucx_ep *ep)
{
    struct ucx_tp *tp = ep->tp;
    bool alive = ep->state < EP_FAILED;
    bool preauth = alive && ep->passive && !ep->authorized;
    bool busy = alive && ep->sock >= 0 &&
                (ep->sock_connecting || !ep->peer_addr || ep->out_bytes > 0 || !ep->authorized ||
                 ep->path != PATH_UCX);

    if (preauth != ep->preauth_counted) {
        tp->n_preauth += preauth ? 1 : -1;
        ep->preauth_counted = preauth;
    }
    if (busy != ep->sock_busy) {
        tp->n_sock_busy += busy ? 1 : -1;
        ep->sock_busy = busy;
    }
}

static void ucx_tx_free_queue(struct ucx_ep *ep)
{
    struct kvt_list *pos, *tmp;

    kvt_list_for_each_safe(pos, tmp, &ep->txq)
    {
        kvt_list_del(pos);
        ep->tx_inflight--;
        kvt_free(kvt_list_entry(pos, struct ucx_tx, node));
    }
}

static void ucx_uep_close(ucp_ep_h uep, void **req_p);

/* Closes the socket and force-closes the ucp ep of a FAILED endpoint: UCX completes
 * each outstanding request (with UCS_ERR_CANCELED) before ucp_ep_close_nbx returns.
 * Not from inside a UCX callback. */
static void ucx_ep_teardown(struct ucx_ep *ep)
{
    struct kvt_list *pos, *tmp;

    if (ep->torn)
        return;
    ep->torn = true;
    kvt_list_for_each_safe(pos, tmp, &ep->batches)
    {
        struct ucx_batch *b = kvt_list_entry(pos, struct ucx_batch, node);

        if (b->status == 0)
            b->status = ep->err != 0 ? ep->err : -ECANCELED;
    }
    if (ep->tp->last_ep == ep)
        ep->tp->last_ep = NULL;
    kvt__ucx_sock_close(ep); /* drops the output: replies of ours, messages */
    kvt_free(ep->out_spare);
    ep->out_spare = NULL;
    kvt_free(ep->reader);
    ep->reader = NULL;
    if (ep->sink_msg != NULL) { /* half read: never delivered, freed with the ep */
        ep->sink_msg->ready = true;
        ep->sink_msg->failed = true;
        ep->sink_msg = NULL;
    }
    ep->sink_op = NULL; /* ended below with the ops waiting */
    kvt_free(ep->peer_waddr);
    ep->peer_waddr = NULL;
    ucx_tx_free_queue(ep);
    if (ep->uep != NULL) {
        ucx_uep_close(ep->uep, &ep->close_req);
        ep->uep = NULL;
        kvt_free(ep->conn); /* no error callback after the close */
        ep->conn = NULL;
    }
    /* READs still waiting for a reply (or for the ucp ep) will never get one; those
     * whose bytes are being received complete from UCX (the close cancels them), or,
     * in socket mode, end here (the socket is closed: no byte lands after). */
    kvt_list_for_each_safe(pos, tmp, &ep->batches)
    {
        struct ucx_batch *b = kvt_list_entry(pos, struct ucx_batch, node);

        for (size_t i = 0; i < b->n_ops; i++) {
            enum ucx_rd_state st = b->ops[i].state;

            if (st != RD_WAIT && st != RD_UNSENT && !(st == RD_RECV && ep->path == PATH_SOCK))
                continue;
            b->ops[i].in_window = false;
            b->ops[i].state = RD_DONE;
            if (--b->pending == 0)
                kvt__ucx_batch_finish(b);
        }
    }
    ep->n_unsent = 0;
    ep->win_ops = 0;
    ep->win_bytes = 0;
    kvt_list_for_each_safe(pos, tmp, &ep->rd_q)
    {
        kvt_list_del(pos);
        kvt_free(kvt_list_entry(pos, struct ucx_rd_tx, node));
    }
    kvt__ucx_ep_account(ep);
}

/* A new endpoint on socket fd (-1: none yet), on tp->eps. */
struct ucx_ep *kvt__ucx_ep_new(struct ucx_tp *tp, int fd, bool passive)
{
    struct ucx_ep *ep = kvt_calloc(1, sizeof(*ep));
    size_t got = 0;

    if (ep == NULL)
        return NULL;
    ep->reader = kvt_malloc(sizeof(*ep->reader));
    while (ep->reader != NULL && got < sizeof(ep->token)) {
        ssize_t n = getrandom(ep->token + got, sizeof(ep->token) - got, 0);

        if (n < 0 && errno != EINTR)
            break;
        got += n > 0 ? (size_t)n : 0;
    }
    if (ep->reader == NULL || got < sizeof(ep->token)) {
        kvt_error("ucx", "a new endpoint: %s", ep->reader == NULL ? "out of memory" : "no random");
        kvt_free(ep->reader);
        kvt_free(ep);
        return NULL;
    }
    kvt_tp_frame_reader_init(ep->reader, !passive);
    ep->pub.tp = &tp->pub;
    ep->tp = tp;
    ep->id = ++tp->next_ep_id;
    ep->sock = fd;
    ep->passive = passive;
    ep->preauth_deadline_ns = ucx_now_ns() + (uint64_t)tp->pub.cfg.preauth_timeout_ms * 1000000ull;
    kvt_list_init(&ep->node);
    kvt_list_init(&ep->rx);
    kvt_list_init(&ep->txq);
    kvt_list_init(&ep->batches);
    kvt_list_init(&ep->rd_q);
    kvt_list_init(&ep->outq);
    kvt_list_add_tail(&tp->eps, &ep->node);
    kvt__ucx_ep_account(ep);
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

/* Constant time: the token is the only secret an active message shows. */
static bool ucx_token_eq(const uint8_t *a, const uint8_t *b)
{
    uint8_t d = 0;

    for (size_t i = 0; i < UCX_TOKEN_BYTES; i++)
        d |= a[i] ^ b[i];
    return d == 0;
}

struct ucx_ep *kvt__ucx_ep_by_token(struct ucx_tp *tp, const uint8_t *token)
{
    struct kvt_list *pos, *tmp;

    if (tp->last_ep != NULL && ucx_token_eq(tp->last_ep->token, token))
        return tp->last_ep;
    kvt_list_for_each_safe(pos, tmp, &tp->eps)
    {
        struct ucx_ep *ep = kvt_list_entry(pos, struct ucx_ep, node);

        /* Only an authorized endpoint has shown its token to anyone. */
        if (ep->authorized && ucx_token_eq(ep->token, token)) {
            tp->last_ep = ep;
            return ep;
        }
    }
    return NULL;
}

static void ucx_err_cb(void *arg, ucp_ep_h uep, ucs_status_t status)
{
    struct ucx_conn *c = arg;

    if (c->ep != NULL)
        kvt__ucx_ep_fail(c->ep, kvt__ucx_errno(status));
    else
        c->failed = true; /* stashed: closed by ucx_stash_reap */
}

static struct ucx_conn *ucx_conn_new(struct ucx_tp *tp)
{
    struct ucx_conn *c = kvt_calloc(1, sizeof(*c));

    if (c != NULL) {
        c->tp = tp;
        kvt_list_init(&c->node);
    }
    return c;
}

/* Makes (or adopts: see ucx_ep_adopt) a ucp ep to addr, with error handling PEER.
 * quiet: a failure is an answer (the path is being chosen), not worth a warning. */
static int ucx_conn_create(struct ucx_tp *tp, const void *addr, bool quiet, struct ucx_conn **c_p)
{
    struct ucx_conn *c = ucx_conn_new(tp);
    ucs_status_t st;

    if (c == NULL)
        return -ENOMEM;
    ucp_ep_params_t p = {
        .field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                      UCP_EP_PARAM_FIELD_ERR_HANDLER,
        .address = (const ucp_address_t *)addr,
        .err_mode = UCP_ERR_HANDLING_MODE_PEER,
        .err_handler = {.cb = ucx_err_cb, .arg = c},
    };
    st = ucp_ep_create(tp->worker, &p, &c->uep);
    if (st != UCS_OK) {
        if (quiet)
            kvt_debug("ucx", "ucp_ep_create from a peer's address: %s", ucs_status_string(st));
        else
            kvt_warn("ucx", "ucp_ep_create from a peer's address: %s", ucs_status_string(st));
        kvt_free(c);
        return st == UCS_ERR_INVALID_PARAM ? -EPROTO : kvt__ucx_errno(st);
    }
    *c_p = c;
    return 0;
}

/* Force-closes a ucp ep of ours; *req_p: the close request still running, or NULL. */
static void ucx_uep_close(ucp_ep_h uep, void **req_p)
{
    ucp_request_param_t param = {
        .op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS,
        .flags = UCP_EP_CLOSE_FLAG_FORCE,
    };
    ucs_status_ptr_t req = ucp_ep_close_nbx(uep, &param);

    *req_p = UCS_PTR_IS_PTR(req) ? req : NULL;
    if (UCS_PTR_IS_ERR(req))
        kvt_debug("ucx", "ucp_ep_close_nbx: %s", ucs_status_string(UCS_PTR_STATUS(req)));
}

/* Closes stashed eps that failed or that nobody claimed for this long (all: at
 * transport close). Their close requests are waited for briefly, then let go. */
#define UCX_STASH_NS (10ull * 1000000000ull)

static void ucx_stash_reap(struct ucx_tp *tp, bool all)
{
    struct kvt_list *pos, *tmp;
    uint64_t now = ucx_now_ns();

    kvt_list_for_each_safe(pos, tmp, &tp->stash)
    {
        struct ucx_conn *c = kvt_list_entry(pos, struct ucx_conn, node);
        void *req;

        if (!all && !c->failed && now - c->since_ns < UCX_STASH_NS)
            continue;
        kvt_list_del(&c->node);
        ucx_uep_close(c->uep, &req);
        if (req != NULL) {
            uint64_t until = ucx_now_ns() + 100000000ull;

            while (ucp_request_check_status(req) == UCS_INPROGRESS && ucx_now_ns() < until)
                ucp_worker_progress(tp->worker);
            ucp_request_free(req);
        }
        kvt_free(c);
    }
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

/* Sends a queued (or new) message as an active message on uep (reply: with our ep
 * for the receiver to answer on, the WIRE). */
static int ucx_post_tx(struct ucx_ep *ep, struct ucx_tx *tx, bool reply)
{
    ucp_request_param_t param = {
        .op_attr_mask =
            UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS,
        .flags = reply ? UCP_AM_SEND_FLAG_REPLY : 0,
        .cb.send = ucx_send_done,
        .user_data = tx,
    };

    memcpy(tx->hdr.token, ep->peer_token, UCX_TOKEN_BYTES);
    if (ep->tp->test_bad_token && tx->hdr.kind == UCX_AM_DATA)
        tx->hdr.token[0] ^= 0xff;

    ucs_status_ptr_t req =
        ucp_am_send_nbx(ep->uep, UCX_AM_ID, &tx->hdr, sizeof(tx->hdr), tx->data, tx->len, &param);

    if (req == NULL) {
        ep->tx_inflight--;
        kvt_free(tx);
        return 0;
    }
    if (UCS_PTR_IS_ERR(req)) {
        int err = kvt__ucx_errno(UCS_PTR_STATUS(req));

        ep->tx_inflight--;
        kvt_free(tx);
        kvt__ucx_ep_fail(ep, err);
        return err;
    }
    ep->ucx_reqs++;
    return 0;
}

void kvt__ucx_rx_insert(struct ucx_ep *ep, struct ucx_msg *m)
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

static ucs_status_t ucx_am_cb(void *arg, const void *header, size_t header_length, void *data,
                              size_t length, const ucp_am_recv_param_t *param)
{
    struct ucx_tp *tp = arg;
    struct ucx_am_hdr hdr;
    struct ucx_ep *ep;
    bool rndv = param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV;
    bool keep = param->recv_attr & UCP_AM_RECV_ATTR_FLAG_DATA;

    if (header_length != sizeof(hdr)) {
        tp->counters.refused[KVT_TP_UNKNOWN_CONN]++;
        return UCS_OK; /* names no endpoint: dropped (and its data with it) */
    }
    memcpy(&hdr, header, sizeof(hdr));
    ep = kvt__ucx_ep_by_token(tp, hdr.token);
    if (ep == NULL || ep->path == PATH_SOCK) { /* socket mode: nothing comes over UCX */
        tp->counters.refused[KVT_TP_UNKNOWN_CONN]++;
        return UCS_OK;
    }
    if (ep->state >= EP_FAILED)
        return UCS_OK; /* dropped: the endpoint is closing */
    if (hdr.magic == UCX_MAGIC && hdr.version == UCX_VERSION && hdr.kind == UCX_AM_WIRE &&
        length == 0 && !ep->creator && ep->uep == NULL && !ep->wire_rx &&
        (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP)) {
        ep->wire_ep = param->reply_ep; /* the ep UCX made for the creator's */
        ep->wire_rx = true;
        tp->kick = true;
        return UCS_OK;
    }
    if (hdr.magic != UCX_MAGIC || hdr.version != UCX_VERSION || hdr.kind != UCX_AM_DATA ||
        hdr.seq < ep->rx_seq || length > tp->pub.cfg.max_msg_bytes) {
        kvt_warn("ucx", "endpoint %llu: bad message (seq %llu, %zu bytes)",
                 (unsigned long long)ep->id, (unsigned long long)hdr.seq, length);
        kvt__ucx_ep_fail(ep, -EPROTO);
        return UCS_OK;
    }

    struct ucx_msg *m = kvt_malloc(sizeof(*m) + (keep ? 0 : length));

    if (m == NULL) {
        kvt__ucx_ep_fail(ep, -ENOMEM);
        return UCS_OK;
    }
    *m = (struct ucx_msg){.ep = ep, .seq = hdr.seq, .kind = RX_DATA, .len = length};
    m->data = m->buf;
    kvt__ucx_rx_insert(ep, m);
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

/* ---- authorization ---- */

/* Sends what waited for the active-message channel, in order. */
static void ucx_ep_flush_waiting(struct ucx_ep *ep)
{
    struct kvt_list *pos, *tmp;

    kvt_list_for_each_safe(pos, tmp, &ep->txq)
    {
        kvt_list_del(pos);
        if (ucx_post_tx(ep, kvt_list_entry(pos, struct ucx_tx, node), false) < 0)
            return; /* the ep failed; teardown frees the rest */
    }
    kvt__ucx_read_post_unsent(ep);
    ep->tp->kick = true;
}

/* Whether we are the side that makes this connection's ucp ep: the one whose worker
 * address sorts first. -1: the same address (our own worker). */
static int ucx_ep_role(const struct ucx_ep *ep)
{
    const struct ucx_tp *tp = ep->tp;
    size_t n = KVT_MIN(tp->waddr_len, ep->peer_waddr_len);
    int c = memcmp(tp->waddr, ep->peer_waddr, n);

    if (c == 0 && tp->waddr_len == ep->peer_waddr_len)
        return -1;
    return c < 0 || (c == 0 && tp->waddr_len < ep->peer_waddr_len);
}

static bool ucx_ep_lanes(struct ucx_ep *ep);
static bool ucx_list_has(const char *list, const char *name, size_t n);

/* Whether the peer's shared memory is out of our reach for certain (another boot id
 * or IPC namespace; UCX judges shared memory so too), from the ADDR frames. */
static bool ucx_other_host(const struct ucx_ep *ep)
{
    static const uint8_t unknown[sizeof(ep->peer_host)];

    if (memcmp(ep->tp->host, unknown, sizeof(unknown)) == 0 ||
        memcmp(ep->peer_host, unknown, sizeof(unknown)) == 0)
        return false;
    return memcmp(ep->tp->host, ep->peer_host, sizeof(unknown)) != 0;
}

/* The creator's choice of path (see kvt__ucx_ep_wire): PATH_UCX with ep->conn made,
 * or PATH_SOCK; *why_p says why socket mode. Negative: the ep fails (KVT_UCX_MODE=ucx
 * on both sides and UCX cannot reach the peer). */
static int ucx_ep_choose(struct ucx_ep *ep, const char **why_p)
{
    struct ucx_tp *tp = ep->tp;
    uint32_t both = tp->addr_flags & ep->peer_flags;
    bool tcp_ok = both & KVT_TP_ADDR_TCP_OK;
    int ret;

    if ((tp->addr_flags | ep->peer_flags) & KVT_TP_ADDR_SOCKET) {
        *why_p = "KVT_UCX_MODE=socket";
        return PATH_SOCK;
    }
    /* Another host and no RDMA transport on both: UCX would find no lane but tcp,
     * which it does not have (and ucp_ep_create would say so as an error). */
    if (!tcp_ok && ucx_other_host(ep) && !(both & KVT_TP_ADDR_NET)) {
        *why_p = "the peer is on another host and RDMA is not on both";
        return PATH_SOCK;
    }
    ret = ucx_conn_create(tp, ep->peer_waddr, !tcp_ok, &ep->conn);
    if (ret < 0) {
        if (tcp_ok)
            return ret;
        *why_p = "UCX has no transport that reaches the peer";
        return PATH_SOCK;
    }
    ep->conn->ep = ep;
    ep->uep = ep->conn->uep;
    /* UCX has tcp only when the user's UCX_TLS named it: our data stays off it
     * unless both sides asked for it (KVT_UCX_MODE=ucx). */
    if (tp->ucx_tcp && !tcp_ok &&
        (!ucx_ep_lanes(ep) || ucx_list_has(ep->am_lanes, "tcp", 3) ||
         ucx_list_has(ep->bw_lanes, "tcp", 3))) {
        ep->conn->ep = NULL;
        ep->conn->failed = true; /* closed by ucx_stash_reap */
        ep->conn->since_ns = ucx_now_ns();
        kvt_list_add_tail(&tp->stash, &ep->conn->node);
        ep->conn = NULL;
        ep->uep = NULL;
        *why_p = "UCX reaches the peer over tcp only";
        return PATH_SOCK;
    }
    return PATH_UCX;
}

/* The path of a connection both ends authorized. The side whose worker address sorts
 * first (the creator; the same side for every connection between two workers)
 * decides and says so in a MODE frame on the socket:
 *   - socket mode when either side asks for it (KVT_UCX_MODE=socket), when the peer
 *     is on another host (boot id, IPC namespace) and RDMA is not on both, when
 *     ucp_ep_create finds no transport to the peer, or when UCX reaches it over tcp
 *     only (the user's UCX_TLS gave UCX tcp): messages and READs then move on our own
 *     socket (ucx_sock_read.c);
 *   - else UCX: the creator's ucp ep (made above) carries a WIRE active message, and
 *     the other side makes its own only once that WIRE arrived (ucx_ep_adopt), by
 *     when UCX has the ep it made for the creator's waiting to be matched, and
 *     ucp_ep_create adopts that one (no wireup of its own).
 * Why the sides take turns: UCX 1.13 resolves a simultaneous connect, and a wireup
 * REPLY left pending on a shared-memory lane (the peer stalled with its FIFO full)
 * trips an assertion when the ep is purged ("got REP message", ucp_request.c:684; the
 * assertion is gone in 1.14): a stalled peer aborted us at close. Why not use the ep
 * UCX made (the WIRE's reply_ep): UCX destroys such an ep by itself when the peer
 * fails, and closing it asserts. */
int kvt__ucx_ep_wire(struct ucx_ep *ep)
{
    const char *why = NULL;
    uint32_t mode;
    int role, ret;

    if (ep->uep != NULL || ep->path != PATH_NONE || !ep->authorized || !ep->peer_addr ||
        ep->state >= EP_FAILED)
        return 0;
    role = ucx_ep_role(ep);
    if (role < 0) {
        kvt_warn("ucx", "endpoint %llu: the peer is this transport itself",
                 (unsigned long long)ep->id);
        return -EPROTO;
    }
    ep->creator = role == 1;
    if (!ep->creator) {
        ep->tp->kick = ep->wire_rx || ep->tp->kick; /* the WIRE may be in already */
        return 0;
    }
    ret = ucx_ep_choose(ep, &why);
    if (ret < 0)
        return ret;
    mode = htole32(ret == PATH_SOCK ? KVT_TP_MODE_SOCKET : KVT_TP_MODE_UCX);
    if (ret == PATH_SOCK) {
        kvt_info("ucx", "endpoint %llu: socket mode (%s)", (unsigned long long)ep->id, why);
        ret = kvt__ucx_sock_frame(ep, KVT_TP_FRAME_MODE, &mode, sizeof(mode), NULL, 0);
        return ret < 0 ? ret : kvt__ucx_sock_start(ep);
    }
    ret = kvt__ucx_sock_frame(ep, KVT_TP_FRAME_MODE, &mode, sizeof(mode), NULL, 0);
    if (ret < 0)
        return ret; /* teardown closes the ucp ep */
    kvt_free(ep->peer_waddr);
    ep->peer_waddr = NULL;
    ep->path = PATH_UCX;
    ep->connected_ns = ucx_now_ns();
    kvt__ucx_ep_account(ep);

    struct ucx_tx *tx = kvt_malloc(sizeof(*tx));

    if (tx == NULL)
        return -ENOMEM;
    tx->ep = ep;
    tx->len = 0;
    tx->hdr = (struct ucx_am_hdr){.magic = UCX_MAGIC, .version = UCX_VERSION, .kind = UCX_AM_WIRE};
    ep->tx_inflight++;
    if (ucx_post_tx(ep, tx, true) < 0)
        return 0; /* the ep failed */
    ucx_ep_flush_waiting(ep);
    return 0;
}

int kvt__ucx_ep_mode(struct ucx_ep *ep, uint32_t mode)
{
    /* Only from the creator, once, after both ADDRs and our authorize (it decides only
     * then), and never against what already happened. */
    if (!ep->authorized || !ep->peer_addr || ep->creator || ep->mode_rx ||
        (mode != KVT_TP_MODE_UCX && mode != KVT_TP_MODE_SOCKET))
        return -EPROTO;
    ep->mode_rx = true;
    if (mode == KVT_TP_MODE_UCX)
        return 0; /* the WIRE comes (or came) over UCX */
    if (ep->path != PATH_NONE || ep->wire_rx)
        return -EPROTO;
    kvt_info("ucx", "endpoint %llu: socket mode (the peer's choice)", (unsigned long long)ep->id);
    return kvt__ucx_sock_start(ep);
}

/* Not the creator, the WIRE in (on wire_ep) and the peer's address known: makes our
 * ucp ep, which UCX matches with wire_ep. UCX matches by a per-peer counter, so when
 * the creator made eps for several connections and their WIREs came out of order, or
 * one of its eps died before its WIRE reached us, ucp_ep_create hands us the ep
 * matched with another connection's: kept aside (tp->stash) for the connection it
 * belongs to, and we ask again. From dispatch. */
#define UCX_ADOPT_TRIES 8

static int ucx_ep_adopt(struct ucx_ep *ep)
{
    struct ucx_tp *tp = ep->tp;
    struct kvt_list *pos, *tmp;
    struct ucx_conn *c = NULL;
    int ret;

    kvt_list_for_each_safe(pos, tmp, &tp->stash)
    {
        struct ucx_conn *s = kvt_list_entry(pos, struct ucx_conn, node);

        if (s->uep == ep->wire_ep && !s->failed) {
            kvt_list_del(&s->node);
            c = s;
            break;
        }
    }
    for (int i = 0; c == NULL && i < UCX_ADOPT_TRIES; i++) {
        ret = ucx_conn_create(tp, ep->peer_waddr, false, &c);
        if (ret < 0)
            return ret;
        if (c->uep == ep->wire_ep)
            break;
        c->since_ns = ucx_now_ns();
        kvt_list_add_tail(&tp->stash, &c->node);
        c = NULL;
    }
    if (c == NULL) {
        kvt_warn("ucx", "endpoint %llu: UCX matched none of %d eps with the peer's",
                 (unsigned long long)ep->id, UCX_ADOPT_TRIES);
        return -EPROTO;
    }
    kvt_free(ep->peer_waddr);
    ep->peer_waddr = NULL;
    c->ep = ep;
    ep->conn = c;
    ep->uep = c->uep;
    ep->path = PATH_UCX;
    ep->connected_ns = ucx_now_ns();
    kvt__ucx_ep_account(ep);
    ucx_ep_flush_waiting(ep);
    return 0;
}

static int ucx_ep_authorize(struct kvt_tp_ep *pep)
{
    struct ucx_ep *ep = ep_of(pep);
    struct ucx_tp *tp = ep->tp;
    int ret;

    if (ep->state != EP_CONNECTED)
        return -ENOTCONN;
    if (ep->authorized)
        return 0;
    /* Our last frame before authorization ends: the token the peer must name us by,
     * what we want and have (the creator decides the path from both), and where we
     * are. */
    uint8_t head[UCX_TOKEN_BYTES + KVT_TP_FRAME_CAPS_BYTES] = {0};
    uint32_t flags = htole32(tp->addr_flags);

    memcpy(head, ep->token, UCX_TOKEN_BYTES);
    memcpy(head + UCX_TOKEN_BYTES, &flags, 4);
    memcpy(head + UCX_TOKEN_BYTES + 8, tp->host, sizeof(tp->host));
    ret = kvt__ucx_sock_frame(ep, KVT_TP_FRAME_ADDR, head, sizeof(head), tp->waddr, tp->waddr_len);
    if (ret < 0) {
        kvt__ucx_ep_fail(ep, ret);
        return ret;
    }
    ep->authorized = true;
    kvt__ucx_ep_account(ep);
    ret = kvt__ucx_ep_wire(ep);
    if (ret < 0)
        kvt__ucx_ep_fail(ep, ret);
    return ret;
}

static int ucx_get_counters(struct kvt_transport *t, struct kvt_tp_counters *out)
{
    if (out == NULL)
        return -EINVAL;
    *out = tp_of(t)->counters;
    return 0;
}

/* ---- dispatch: the owner's callbacks, outside ucp_worker_progress ---- */

/* A READ request that came as a frame on the socket, in order with the messages. */
static void ucx_rx_rdreq(struct ucx_ep *ep, const struct ucx_msg *m)
{
    struct ucx_rd_hdr h = {.magic = UCX_MAGIC, .version = UCX_VERSION};

    memcpy(&h.addr, m->data, 8);
    memcpy(&h.len, m->data + 8, 8);
    memcpy(&h.tag, m->data + 16, 8);
    h.addr = le64toh(h.addr);
    h.len = le64toh(h.len);
    h.tag = le64toh(h.tag);
    if (h.len == 0) {
        kvt__ucx_ep_fail(ep, -EPROTO);
        return;
    }
    kvt__ucx_rd_serve(ep, &h, 0);
}

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
        if (m->kind == RX_HELLO) {
            ucx_msg_free(ep->tp, m);
            if (ep->state != EP_CONNECTING) {
                kvt__ucx_ep_fail(ep, -EPROTO);
                break;
            }
            ep->state = EP_CONNECTED;
            if (cb->on_ep_state != NULL)
                cb->on_ep_state(cb->arg, &ep->pub, KVT_EP_CONNECTED, 0);
            continue;
        }
        if (ep->state != EP_CONNECTED) { /* data before HELLO */
            ucx_msg_free(ep->tp, m);
            kvt__ucx_ep_fail(ep, -EPROTO);
            break;
        }
        if (m->kind == RX_RDREQ) {
            ucx_rx_rdreq(ep, m);
            ucx_msg_free(ep->tp, m);
            continue;
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
    uint32_t version = htole32(UCX_VERSION);
    int ret;

    /* HELLO first on the socket, before anything on_accept sends (written after it). */
    ret = kvt__ucx_sock_frame(ep, KVT_TP_FRAME_HELLO, &version, sizeof(version), NULL, 0);
    if (ret < 0) {
        kvt__ucx_ep_fail(ep, ret);
        return 1;
    }
    ep->tx_seq = 1;
    ep->state = EP_CONNECTED;
    ret = cb->on_accept != NULL ? cb->on_accept(cb->arg, &ep->pub) : 0;
    if (ret < 0) {
        ep->silent = true;
        kvt__ucx_ep_fail(ep, ret);
        return 1;
    }
    kvt__ucx_sock_flush(ep);
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
            if (ep->wire_rx && ep->state == EP_CONNECTED && ep->peer_addr && ep->uep == NULL &&
                ep->path == PATH_NONE) {
                int ret = ucx_ep_adopt(ep);

                ep->wire_rx = false;
                if (ret < 0)
                    kvt__ucx_ep_fail(ep, ret);
                n++;
            }
            n += ucx_deliver_rx(ep);
            n += kvt__ucx_rd_send_replies(ep);
            if (ep->sock_eof && ep->state < EP_FAILED)
                kvt__ucx_ep_fail(ep, -ECONNRESET); /* after what came before the end */
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

        if (ep->state != EP_FAILED || !ep->torn || !kvt_list_empty(&ep->batches))
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

/* Marks connect, pre-auth and op timeouts; returns the nearest deadline still ahead
 * (0: none). */
static uint64_t ucx_check_timeouts(struct ucx_tp *tp, uint64_t now)
{
    uint64_t op_ns = (uint64_t)tp->pub.cfg.op_timeout_ms * 1000000ull;
    uint64_t next = 0;
    struct kvt_list *pos, *tmp;

    kvt_list_for_each_safe(pos, tmp, &tp->eps)
    {
        struct ucx_ep *ep = kvt_list_entry(pos, struct ucx_ep, node);
        uint64_t dl = 0;

        if (ep->state >= EP_FAILED)
            continue;
        if (!ep->authorized) {
            if (ep->preauth_deadline_ns <= now) {
                tp->counters.refused[KVT_TP_PREAUTH_TIMEOUT]++;
                kvt_debug("ucx", "endpoint %llu: not authorized in %u ms; closed",
                          (unsigned long long)ep->id, tp->pub.cfg.preauth_timeout_ms);
                kvt__ucx_ep_fail(ep, -ETIMEDOUT);
                continue;
            }
            dl = ep->preauth_deadline_ns;
        }
        if (ep->state == EP_CONNECTING && (dl == 0 || ep->deadline_ns < dl))
            dl = ep->deadline_ns;
        if (ep->state == EP_CONNECTED && !kvt_list_empty(&ep->batches)) {
            uint64_t b = kvt_list_entry(ep->batches.next, struct ucx_batch, node)->start_ns + op_ns;

            dl = dl == 0 || b < dl ? b : dl;
        }
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

/* True when dispatch has work without any new event. */
static bool ucx_work_pending(struct ucx_tp *tp)
{
    struct kvt_list *pos, *tmp;

    if (!kvt_list_empty(&tp->done))
        return true;
    kvt_list_for_each_safe(pos, tmp, &tp->eps)
    {
        struct ucx_ep *ep = kvt_list_entry(pos, struct ucx_ep, node);

        if (ep->state == EP_ACCEPTING || ep->state == EP_FAILED || ep->sock_eof ||
            (ep->wire_rx && ep->peer_addr && ep->path == PATH_NONE))
            return true;
        /* Replies owed: over UCX as the in-flight bound lets them; in socket mode they
         * wait for the socket (EPOLLOUT) while anything is queued on it. */
        if (!kvt_list_empty(&ep->rd_q) && ep->state == EP_CONNECTED &&
            (ep->path == PATH_SOCK
                 ? ep->out_bytes == 0
                 : ep->uep != NULL &&
                       (ep->rd_inflight == 0 ||
                        ep->rd_inflight +
                                kvt_list_entry(ep->rd_q.next, struct ucx_rd_tx, node)->hdr.len <=
                            UCX_RD_INFLIGHT_BYTES)))
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

/* The user's UCX_TLS, or NULL (unset or empty: compose files pass an empty one). */
static const char *ucx_user_tls(void)
{
    const char *tls = getenv("UCX_TLS");

    return tls != NULL && tls[0] != '\0' ? tls : NULL;
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

/* Reads the first line of root/a/b/c (at most cap - 1 bytes, newline cut); false when
 * there is no such file. */
static bool ucx_sysfs_line(const char *root, const char *a, const char *b, const char *c, char *buf,
                           size_t cap)
{
    char path[1024];
    FILE *f;
    bool ok;

    if (snprintf(path, sizeof(path), "%s/%s/%s%s%s", root, a, b, c[0] != '\0' ? "/" : "", c) >=
        (int)sizeof(path))
        return false;
    f = fopen(path, "re");
    if (f == NULL)
        return false;
    ok = fgets(buf, (int)cap, f) != NULL;
    fclose(f);
    if (ok)
        buf[strcspn(buf, "\n")] = '\0';
    return ok;
}

/* Whether UCX_TLS (NULL: UCX's default, all) may give UCX an InfiniBand/RoCE transport
 * (rc, ud, dc and their variants, "ib", "all"; an exclusion list is taken as yes). */
static bool ucx_tls_has_ib(const char *tls)
{
    if (tls == NULL || tls[0] == '^')
        return true;
    for (const char *p = tls; *p != '\0'; p += *p == ',') {
        size_t len = strcspn(p, ",");

        if (len >= 2 && (strncmp(p, "rc", 2) == 0 || strncmp(p, "ud", 2) == 0 ||
                         strncmp(p, "dc", 2) == 0 || strncmp(p, "ib", 2) == 0))
            return true;
        if (len == 3 && strncmp(p, "all", 3) == 0)
            return true;
        p += len;
    }
    return false;
}

/* The GID index UCX should use when every RDMA device under root (sysfs's
 * class/infiniband) is soft-RoCE (rdma_rxe, whose devices have a "parent" netdev
 * attribute that hardware ones lack; siw has one too but is iWARP, no channel
 * adapter) and the first link-local
 * ("fe80:") RoCE v2 GID has the same index on every port; -1 otherwise (hardware, a
 * mix, no devices, no such GID). Why: UCX 1.13 wires an rc lane up from a worker
 * address over ud_verbs, and its ud_verbs never connects over soft-RoCE with the
 * IPv4-mapped GID it picks by itself (its own ucx_perftest aborts between two hosts:
 * "UD endpoint ...: unhandled timeout error"); with the link-local one it does
 * (docs/rdma.md). */
#define UCX_GID_SCAN 16

int kvt__ucx_softroce_gid(const char *root)
{
    DIR *d = opendir(root);
    struct dirent *de;
    int found = -1, ports = 0;
    char buf[128];

    if (d == NULL)
        return -1;
    while ((de = readdir(d)) != NULL) {
        char sub[768];
        DIR *pd;
        struct dirent *pe;

        if (de->d_name[0] == '.')
            continue;
        if (!ucx_sysfs_line(root, de->d_name, "parent", "", buf, sizeof(buf)) ||
            !ucx_sysfs_line(root, de->d_name, "node_type", "", buf, sizeof(buf)) ||
            strstr(buf, "CA") == NULL) {
            found = -2; /* hardware, or not an InfiniBand/RoCE channel adapter */
            break;
        }
        pd = snprintf(sub, sizeof(sub), "%s/%s/ports", root, de->d_name) < (int)sizeof(sub)
                 ? opendir(sub)
                 : NULL;
        if (pd == NULL) {
            found = -2;
            break;
        }
        while (found != -2 && (pe = readdir(pd)) != NULL) {
            char port[600], gid[64], type[64], idx[16];
            int at = -1;

            if (pe->d_name[0] == '.')
                continue;
            if (snprintf(port, sizeof(port), "%s/ports/%s", de->d_name, pe->d_name) >=
                (int)sizeof(port))
                continue;
            for (int i = 0; i < UCX_GID_SCAN && at < 0; i++) {
                snprintf(idx, sizeof(idx), "%d", i);
                if (ucx_sysfs_line(root, port, "gids", idx, gid, sizeof(gid)) &&
                    strncmp(gid, "fe80:", 5) == 0 &&
                    ucx_sysfs_line(root, port, "gid_attrs/types", idx, type, sizeof(type)) &&
                    strcmp(type, "RoCE v2") == 0)
                    at = i;
            }
            if (at < 0 || (found >= 0 && at != found))
                found = -2;
            else
                found = at;
            ports++;
        }
        closedir(pd);
        if (found == -2)
            break;
    }
    closedir(d);
    return found >= 0 && ports > 0 ? found : -1;
}

/* UCX_IB_GID_INDEX for soft-RoCE (kvt__ucx_softroce_gid), unless the user chose. */
static void ucx_config_gid(ucp_config_t *config)
{
    char idx[16];
    int gid;

    /* Not when no IB transport may take it: UCX warns about a setting none took. */
    if (getenv("UCX_IB_GID_INDEX") != NULL || !ucx_tls_has_ib(ucx_user_tls()))
        return;
    gid = kvt__ucx_softroce_gid("/sys/class/infiniband");
    if (gid < 0)
        return;
    snprintf(idx, sizeof(idx), "%d", gid);
    /* The field's bare name: UCX matches a cached setting against each transport's
     * table by field name or by that transport's own prefix ("UD_VERBS_"), so
     * "IB_GID_INDEX" reached no transport ("invalid configuration"). */
    if (ucp_config_modify(config, "GID_INDEX", idx) != UCS_OK)
        kvt_warn("ucx",
                 "UCX_IB_GID_INDEX=%s refused: UCX may not reach other hosts over "
                 "soft-RoCE",
                 idx);
    else
        kvt_info("ucx",
                 "soft-RoCE: UCX_IB_GID_INDEX=%s (the link-local RoCE v2 GID; UCX "
                 "1.13's ud_verbs does not connect with the IPv4 one)",
                 idx);
}

/* Peer-failure handling on posix/sysv and invalidation on cma (above), as UCT
 * settings on the config: each unless the user set it. Not for a UCX_TLS without
 * posix/sysv: UCX warns (on stdout) about a setting no transport took. */
static void ucx_config_shm(ucp_config_t *config)
{
    if (getenv("UCX_POSIX_ERROR_HANDLING") == NULL && getenv("UCX_SYSV_ERROR_HANDLING") == NULL &&
        getenv("UCX_MM_ERROR_HANDLING") == NULL && ucx_tls_has_mm(ucx_user_tls()))
        (void)ucp_config_modify(config, "MM_ERROR_HANDLING", "y");
    /* Only cma's memory domain has this field in UCX 1.13 (src/uct/sm/scopy/cma). */
    if (getenv("UCX_CMA_MEMORY_INVALIDATE") == NULL)
        (void)ucp_config_modify(config, "MEMORY_INVALIDATE", "y");
}

/* The device that holds addr, as UCX names net devices ("lo", "eth0"), into dev;
 * false when addr is a wildcard or no interface has it. */
static bool ucx_addr_device(const char *addr, char *dev, size_t cap)
{
    struct sockaddr_storage ss;
    struct ifaddrs *ifs, *i;
    socklen_t len;
    bool found = false;

    if (kvt__ucx_sockaddr(addr, 0, &ss, &len) < 0 || getifaddrs(&ifs) < 0)
        return false;
    for (i = ifs; i != NULL && !found; i = i->ifa_next) {
        if (i->ifa_addr == NULL || i->ifa_addr->sa_family != ss.ss_family)
            continue;
        if (ss.ss_family == AF_INET)
            found = ((struct sockaddr_in *)i->ifa_addr)->sin_addr.s_addr ==
                    ((struct sockaddr_in *)&ss)->sin_addr.s_addr;
        else
            found = memcmp(&((struct sockaddr_in6 *)i->ifa_addr)->sin6_addr,
                           &((struct sockaddr_in6 *)&ss)->sin6_addr, sizeof(struct in6_addr)) == 0;
        if (found)
            snprintf(dev, cap, "%s", i->ifa_name);
    }
    freeifaddrs(ifs);
    return found;
}

/* Appends every RDMA device port ("mlx5_0:1") to list: UCX_NET_DEVICES names those
 * too, and confining tcp must not take RDMA away. */
static void ucx_rdma_ports(char *list, size_t cap)
{
    DIR *d = opendir("/sys/class/infiniband");
    struct dirent *e;

    if (d == NULL)
        return;
    while ((e = readdir(d)) != NULL) {
        char path[512];
        DIR *pd;
        struct dirent *pe;

        if (e->d_name[0] == '.')
            continue;
        snprintf(path, sizeof(path), "/sys/class/infiniband/%s/ports", e->d_name);
        pd = opendir(path);
        if (pd == NULL)
            continue;
        while ((pe = readdir(pd)) != NULL) {
            size_t used = strlen(list);

            if (pe->d_name[0] != '.')
                snprintf(list + used, cap - used, ",%s:%s", e->d_name, pe->d_name);
        }
        closedir(pd);
    }
    closedir(d);
}

/* UCX's tcp interface accepts a connection from anyone who reaches its port (an
 * ephemeral one of its own) and, in 1.13, writes the payload of a uct PUT request
 * wherever the request's header says (uct_tcp_ep_handle_put_req; tests/security's
 * uct-put probe wrote into a node's primary that way, whatever the worker's UCP
 * features). So UCX never gets tcp: peers on this host are reached over shared
 * memory, peers elsewhere over RDMA, and a connection with neither moves over our
 * own socket (socket mode). Unless the user set UCX_TLS: then it is theirs, and a
 * UCX_TLS that gives UCX tcp is warned about at open (ucx_probe_resources). */
static void ucx_config_tls(ucp_config_t *config)
{
    if (ucx_user_tls() != NULL)
        return;
    if (ucp_config_modify(config, "TLS", "^tcp") != UCS_OK)
        kvt_warn("ucx", "UCX_TLS=^tcp refused: UCX may open its tcp port");
}

/* A UCX_TLS of the user's may hold tcp, whose interfaces listen on every device UCX
 * uses: unless the user chose (UCX_NET_DEVICES), only the device of the address we
 * listen on (and every RDMA port). */
static void ucx_config_devices(ucp_config_t *config, const char *local_addr)
{
    char list[1024];

    if (ucx_user_tls() == NULL || getenv("UCX_NET_DEVICES") != NULL || local_addr == NULL)
        return;
    if (!ucx_addr_device(local_addr, list, sizeof(list))) {
        kvt_debug("ucx", "%s is no interface's address: UCX uses every device", local_addr);
        return;
    }
    ucx_rdma_ports(list, sizeof(list));
    if (ucp_config_modify(config, "NET_DEVICES", list) != UCS_OK)
        kvt_warn("ucx", "UCX_NET_DEVICES=%s refused: UCX uses every device", list);
    else
        kvt_debug("ucx", "UCX net devices: %s", list);
}

/* Where this process's shared memory reaches, as UCX judges it (another boot id or
 * IPC namespace: unreachable): the boot id's two halves xored, and the IPC namespace's
 * inode. Zeros when unknown (then the creator asks UCX itself). */
static void ucx_host_id(uint8_t host[16])
{
    char text[64] = "", ns[64] = "";
    uint8_t boot[16];
    unsigned long long ino = 0;
    size_t k = 0;
    FILE *f = fopen("/proc/sys/kernel/random/boot_id", "r");
    ssize_t n;

    memset(host, 0, 16);
    if (f == NULL)
        return;
    if (fgets(text, sizeof(text), f) == NULL)
        text[0] = '\0';
    fclose(f);
    for (const char *p = text; *p != '\0' && k < 32; p++) {
        int v = *p >= '0' && *p <= '9'   ? *p - '0'
                : *p >= 'a' && *p <= 'f' ? *p - 'a' + 10
                : *p >= 'A' && *p <= 'F' ? *p - 'A' + 10
                                         : -1;

        if (v < 0)
            continue;
        if (k % 2 == 0)
            boot[k / 2] = (uint8_t)(v << 4);
        else
            boot[k / 2] |= (uint8_t)v;
        k++;
    }
    n = readlink("/proc/self/ns/ipc", ns, sizeof(ns) - 1);
    if (k < 32 || n <= 0)
        return;
    ns[n] = '\0';
    if (sscanf(ns, "ipc:[%llu]", &ino) != 1)
        return;
    for (int i = 0; i < 8; i++)
        host[i] = boot[i] ^ boot[8 + i];
    ino = htole64(ino);
    memcpy(host + 8, &ino, 8);
}

/* The transports UCX opened (ucp_context_print_info's resources, "tcp/lo"): whether
 * one is tcp (the user's UCX_TLS named it: warned about) and whether one reaches
 * other hosts without tcp (verbs: rc, dc, ud). */
static void ucx_probe_resources(struct ucx_tp *tp)
{
    char *text = NULL, *line, *save = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&text, &len);

    if (f == NULL)
        return;
    ucp_context_print_info(tp->ctx, f);
    if (fclose(f) != 0 || text == NULL) {
        free(text);
        return;
    }
    for (line = strtok_r(text, "\n", &save); line != NULL; line = strtok_r(NULL, "\n", &save)) {
        const char *p = strstr(line, "resource");
        const char *tl;

        if (p == NULL || (tl = strstr(p, "-- ")) == NULL)
            continue;
        tl += 3;
        if (strncmp(tl, "tcp/", 4) == 0)
            tp->ucx_tcp = true;
        else if (strncmp(tl, "rc", 2) == 0 || strncmp(tl, "dc", 2) == 0 ||
                 strncmp(tl, "ud", 2) == 0)
            tp->addr_flags |= KVT_TP_ADDR_NET;
    }
    free(text);
    if (tp->ucx_tcp)
        kvt_warn("ucx",
                 "SECURITY: UCX_TLS=%s gives UCX its tcp transport, which listens on a port "
                 "of its own that accepts anyone, and UCX 1.13 writes a uct PUT's payload "
                 "wherever its header says: whoever reaches that port can write into this "
                 "node's memory without the cluster secret. kvtier keeps its own data off "
                 "UCX's tcp (socket mode) unless KVT_UCX_MODE=ucx; unset UCX_TLS to close "
                 "the port",
                 ucx_user_tls() != NULL ? ucx_user_tls() : "(all)");
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
    tp->epfd = tp->wfd = tp->tfd = tp->sfd = tp->lfd = -1;
    kvt_list_init(&tp->eps);
    kvt_list_init(&tp->zombies);
    kvt_list_init(&tp->done);
    kvt_list_init(&tp->orphans);
    kvt_list_init(&tp->stash);
    kvt_list_init(&tp->mrs);
    kvt_list_init(&tp->rd_sent);
    /* Test-only hooks, read once here. KVT_UCX_TEST_NO_CLIENT_RANGE_CHECK: READs skip
     * the client's check of the remote range, so the server's check is what refuses
     * them (tests/conformance test_read_refused_by_server). KVT_UCX_TEST_BAD_TOKEN:
     * every active message names a token the peer never gave (test_unknown_token).
     * Never set in production. */
    tp->test_no_rcheck = getenv("KVT_UCX_TEST_NO_CLIENT_RANGE_CHECK") != NULL;
    tp->test_bad_token = getenv("KVT_UCX_TEST_BAD_TOKEN") != NULL;
    if (getenv("KVT_UCX_READ") != NULL)
        kvt_warn("ucx", "KVT_UCX_READ is no longer read: READs are always active messages");
    /* KVT_UCX_MODE: socket mode on every connection (tests; two hosts emulated on one),
     * or UCX over tcp allowed (a bench switch; it needs UCX_TLS with tcp). */
    const char *mode = getenv("KVT_UCX_MODE");

    if (mode != NULL && strcmp(mode, "socket") == 0) {
        tp->force = MODE_SOCKET;
        tp->addr_flags |= KVT_TP_ADDR_SOCKET;
    } else if (mode != NULL && strcmp(mode, "ucx") == 0) {
        tp->force = MODE_UCX;
        tp->addr_flags |= KVT_TP_ADDR_TCP_OK;
        kvt_warn("ucx", "KVT_UCX_MODE=ucx: UCX may carry this node's data over tcp (a bench "
                        "switch; see the warning about UCX_TLS)");
    } else if (mode != NULL && mode[0] != '\0' && strcmp(mode, "auto") != 0) {
        kvt_error("ucx", "KVT_UCX_MODE=%s: expected auto, socket or ucx", KVT_LOG_STR(mode));
        kvt_free(tp);
        return -EINVAL;
    }
    ucx_host_id(tp->host);

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
    ucx_config_gid(config);
    ucx_config_tls(config);
    ucx_config_devices(config, cfg->local_addr);
    /* No UCP_FEATURE_RMA: a worker with it answers software GETs (ucp_get_req_handler)
     * from whatever address the request names, to anyone wired up to it. */
    ucp_params_t params = {
        .field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_NAME,
        .features = UCP_FEATURE_AM | UCP_FEATURE_WAKEUP,
        .name = "kvtier",
    };
    st = ucp_init(&params, config, &tp->ctx);
    ucp_config_release(config);
    if (st != UCS_OK) {
        ret = kvt__ucx_errno(st);
        kvt_error("ucx", "ucp_init: %s", ucs_status_string(st));
        goto err_free;
    }
    ucx_probe_resources(tp);
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
    if (st == UCS_OK)
        st = ucp_worker_get_address(tp->worker, &tp->waddr, &tp->waddr_len);
    if (st == UCS_OK && tp->waddr_len > KVT_TP_FRAME_WADDR_MAX) {
        kvt_error("ucx", "our worker address of %zu bytes exceeds %d", tp->waddr_len,
                  KVT_TP_FRAME_WADDR_MAX);
        st = UCS_ERR_EXCEEDS_LIMIT;
    }
    if (st != UCS_OK) {
        ret = kvt__ucx_errno(st);
        kvt_error("ucx", "worker setup: %s", ucs_status_string(st));
        goto err_worker;
    }
    tp->tfd = timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC);
    tp->epfd = epoll_create1(EPOLL_CLOEXEC);
    tp->sfd = epoll_create1(EPOLL_CLOEXEC);
    if (tp->tfd < 0 || tp->epfd < 0 || tp->sfd < 0) {
        ret = -errno;
        goto err_fds;
    }
    struct epoll_event ev = {.events = EPOLLIN};
    if (epoll_ctl(tp->epfd, EPOLL_CTL_ADD, tp->wfd, &ev) < 0 ||
        epoll_ctl(tp->epfd, EPOLL_CTL_ADD, tp->tfd, &ev) < 0 ||
        epoll_ctl(tp->epfd, EPOLL_CTL_ADD, tp->sfd, &ev) < 0) {
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
    if (tp->sfd >= 0)
        close(tp->sfd);
err_worker:
    if (tp->waddr != NULL)
        ucp_worker_release_address(tp->worker, tp->waddr);
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
    kvt__ucx_sock_close_listener(tp);
    kvt_list_for_each_safe(pos, tmp, &tp->eps)
        kvt__ucx_ep_fail(kvt_list_entry(pos, struct ucx_ep, node), 0);
    /* Batches and CLOSED reports before close returns; no more messages. A force
     * close does not complete every request inside ucp_ep_close_nbx (a rendezvous
     * still on its way over tcp completes from progress), so the worker keeps
     * running. */
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

    ucx_stash_reap(tp, true);
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
    close(tp->sfd);
    ucp_worker_release_address(tp->worker, tp->waddr);
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

static int ucx_listen(struct kvt_transport *t, const char *addr, uint16_t port, uint16_t *port_p)
{
    return kvt__ucx_sock_listen(tp_of(t), addr, port, port_p);
}

static int ucx_connect(struct kvt_transport *t, const char *addr, uint16_t port, void *user,
                       struct kvt_tp_ep **ep_p)
{
    struct ucx_tp *tp = tp_of(t);
    struct ucx_ep *ep;
    int ret;

    if (ep_p == NULL || port == 0 || addr == NULL)
        return -EINVAL;
    ep = kvt__ucx_ep_new(tp, -1, false);
    if (ep == NULL)
        return -ENOMEM;
    ep->pub.user = user;
    ep->state = EP_CONNECTING;
    ep->deadline_ns = ucx_now_ns() + (uint64_t)tp->pub.cfg.connect_timeout_ms * 1000000ull;
    ret = kvt__ucx_sock_connect(ep, addr, port);
    if (ret < 0) {
        /* Never announced: gone without a callback. */
        kvt_list_del(&ep->node);
        kvt_list_init(&ep->node);
        ep->state = EP_DEAD;
        kvt__ucx_ep_account(ep);
        kvt_free(ep->reader);
        kvt_free(ep);
        return ret;
    }
    kvt__ucx_ep_account(ep);
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
    struct ucx_tx *tx;
    int ret;

    if (ep->state != EP_CONNECTED)
        return -ENOTCONN;
    if (buf == NULL && len > 0)
        return -EINVAL;
    if (len > ep->tp->pub.cfg.max_msg_bytes)
        return -EMSGSIZE;
    if (!ep->authorized) { /* a frame on the socket, within the pre-auth bounds */
        if (len > KVT_TP_PREAUTH_MSG_BYTES)
            return -EMSGSIZE;
        if (ep->tcp_msgs >= KVT_TP_PREAUTH_MSGS)
            return -ENOBUFS;
        ret = kvt__ucx_sock_frame(ep, KVT_TP_FRAME_DATA, buf, len, NULL, 0);
        if (ret < 0)
            return ret;
        ep->tcp_msgs++;
        ep->tx_seq++;
        return 0;
    }
    if (ep->tx_inflight >= ep->tp->pub.cfg.recv_credits)
        return -EAGAIN;
    if (ep->path == PATH_SOCK) { /* a MSG frame on our socket */
        ret = kvt__ucx_sock_msg(ep, buf, len);
        if (ret == 0)
            ep->tx_seq++;
        return ret;
    }
    tx = kvt_malloc(sizeof(*tx) + len);
    if (tx == NULL)
        return -ENOMEM;
    tx->ep = ep;
    tx->len = len;
    tx->hdr = (struct ucx_am_hdr){.magic = UCX_MAGIC, .version = UCX_VERSION, .seq = ep->tx_seq};
    if (len > 0)
        memcpy(tx->data, buf, len);
    ep->tx_seq++;
    ep->tx_inflight++;
    if (ep->uep == NULL) { /* the peer has not authorized us yet: in order, later */
        kvt_list_add_tail(&ep->txq, &tx->node);
        return 0;
    }
    return ucx_post_tx(ep, tx, false);
}

static int ucx_send_room(struct kvt_tp_ep *pep, unsigned *room, unsigned *cap)
{
    struct ucx_ep *ep = ep_of(pep);

    if (ep->state != EP_CONNECTED)
        return -ENOTCONN;
    if (!ep->authorized) { /* the pre-auth frames on the socket */
        *cap = KVT_TP_PREAUTH_MSGS;
        *room = ep->tcp_msgs < *cap ? *cap - ep->tcp_msgs : 0;
        return 0;
    }
    *cap = ep->tp->pub.cfg.recv_credits;
    *room = ep->tx_inflight < *cap ? *cap - ep->tx_inflight : 0;
    return 0;
}

/* ---- memory ---- */

static int ucx_reg(struct kvt_transport *t, void *base, size_t len, bool remote,
                   struct kvt_tp_mr **mr_p)
{
    struct ucx_tp *tp = tp_of(t);
    struct kvt_tp_mr *mr;
    ucs_status_t st;

    if (base == NULL || len == 0 || len > UCX_MAX_REG_BYTES || mr_p == NULL)
        return -EINVAL;
    mr = kvt_calloc(1, sizeof(*mr));
    if (mr == NULL)
        return -ENOMEM;
    mr->tp = tp;
    mr->base = base;
    mr->len = len;
    kvt_list_init(&mr->node);

    /* Registered for UCX's rendezvous: replies are sent from it (zero copy), and
     * received into local registrations. */
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
        kvt_error("ucx", "ucp_mem_map of %zu bytes: %s", len, ucs_status_string(st));
        kvt_free(mr);
        return kvt__ucx_errno(st);
    }
    if (remote)
        kvt_list_add_tail(&tp->mrs, &mr->node);
    mr->remote = remote;
    *mr_p = mr;
    return 0;
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
    /* Socket mode: replies on the output stop reading it. */
    kvt__ucx_sock_dereg(mr->tp, mr);
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
                tx->hdr.err = UCX_RD_REFUSED;
                tx->hdr.len = 0;
            }
        }
    }
    ucp_mem_unmap(mr->tp->ctx, mr->memh);
    kvt_free(mr);
}

static int ucx_pack(struct kvt_tp_mr *mr, void *buf, size_t cap, size_t *len_p)
{
    struct ucx_handle_hdr h;

    if (mr == NULL || !mr->remote || len_p == NULL)
        return -EINVAL;
    if (buf == NULL || cap < sizeof(h))
        return -ENOSPC;
    h.magic = htole32(UCX_MAGIC);
    h.reserved = 0;
    h.base = htole64((uint64_t)(uintptr_t)mr->base);
    h.len = htole64(mr->len);
    memcpy(buf, &h, sizeof(h));
    *len_p = sizeof(h);
    return 0;
}

static int ucx_unpack(struct kvt_tp_ep *pep, const void *buf, size_t len, struct kvt_tp_rkey **rk_p)
{
    struct ucx_ep *ep = ep_of(pep);
    struct ucx_handle_hdr h;
    struct kvt_tp_rkey *rk;

    if (buf == NULL || rk_p == NULL)
        return -EINVAL;
    if (ep->state != EP_CONNECTED)
        return -ENOTCONN;
    if (len != sizeof(h))
        return -EPROTO;
    memcpy(&h, buf, sizeof(h));
    h.magic = le32toh(h.magic);
    h.base = le64toh(h.base);
    h.len = le64toh(h.len);
    if (h.magic != UCX_MAGIC || h.reserved != 0 || h.len == 0 || h.len > UCX_MAX_REG_BYTES ||
        h.base + h.len < h.base)
        return -EPROTO;
    rk = kvt_calloc(1, sizeof(*rk));
    if (rk == NULL)
        return -ENOMEM;
    rk->ep_id = ep->id;
    rk->base = h.base;
    rk->len = h.len;
    *rk_p = rk;
    return 0;
}

static void ucx_rkey_destroy(struct kvt_tp_rkey *rk)
{
    kvt_free(rk);
}

/* ---- READ batches ---- */

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

/* The transports of ep's AM lane and of its high-bandwidth lanes (the rendezvous of
 * large AM replies), from ucp_ep_print_info: UCX 1.13 has no query.
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
    char am_bw[sizeof(ep->bw_lanes)] = "";

    for (line = strtok_r(text, "\n", &save); line != NULL; line = strtok_r(NULL, "\n", &save)) {
        if (strstr(line, "lane[") == NULL)
            continue;
        if (ucx_lane_is(line, " am"))
            ok &= ucx_lane_add(line, ep->am_lanes, sizeof(ep->am_lanes));
        if (ucx_lane_is(line, "rma_bw"))
            ok &= ucx_lane_add(line, ep->bw_lanes, sizeof(ep->bw_lanes));
        if (ucx_lane_is(line, "am_bw"))
            ok &= ucx_lane_add(line, am_bw, sizeof(am_bw));
    }
    /* No zero-copy lane (tcp without RMA): UCX sends rendezvous data as active
     * messages on its am_bw lanes (or the am lane). */
    if (ep->bw_lanes[0] == '\0')
        snprintf(ep->bw_lanes, sizeof(ep->bw_lanes), "%s", am_bw[0] != '\0' ? am_bw : ep->am_lanes);
    free(text);
    return ok;
}

static int ucx_read(struct kvt_tp_ep *pep, struct kvt_tp_rkey *rk, struct kvt_tp_mr *local,
                    const struct kvt_read_op *ops, size_t n, kvt_read_cb cb, void *arg)
{
    struct ucx_ep *ep = ep_of(pep);
    struct ucx_batch *b;
    size_t posted = 0;
    int err;

    if (ep->state != EP_CONNECTED)
        return -ENOTCONN;
    if (rk == NULL || local == NULL || ops == NULL || n == 0 || n > UINT32_MAX || cb == NULL ||
        rk->ep_id != ep->id || local->tp != ep->tp)
        return -EINVAL;
    for (size_t i = 0; i < n; i++)
        if ((!ep->tp->test_no_rcheck && !ucx_in_range(ops[i].remote_off, ops[i].len, rk->len)) ||
            !ucx_in_range(ops[i].local_off, ops[i].len, local->len))
            return -EINVAL;
    if (ep->n_batches >= ep->tp->pub.cfg.max_batches)
        return -EAGAIN;
    /* Before we authorized, requests go as frames on the socket (the peer refuses
     * them unless it authorized us), within the same bound as messages. */
    if (!ep->authorized && n > KVT_TP_PREAUTH_MSGS - ep->tcp_msgs)
        return -ENOBUFS;

    b = kvt_calloc(1, sizeof(*b) + n * sizeof(b->ops[0]));
    if (b == NULL)
        return -ENOMEM;
    b->ep = ep;
    b->id = ep->next_batch_id++;
    b->n_ops = n;
    b->cb = cb;
    b->arg = arg;
    b->start_ns = ucx_now_ns();
    b->pending = 1; /* held while posting */
    for (size_t i = 0; i < n; i++) {
        struct ucx_rd_op *op = &b->ops[i];

        op->b = b;
        op->memh = local->memh;
        op->dst = local->base + ops[i].local_off;
        op->hdr = (struct ucx_rd_hdr){.magic = UCX_MAGIC,
                                      .version = UCX_VERSION,
                                      .addr = rk->base + ops[i].remote_off,
                                      .len = ops[i].len,
                                      .tag = (uint64_t)b->id << 32 | (uint32_t)i};
        op->state = RD_UNSENT;
    }
    kvt_list_add_tail(&ep->batches, &b->node);
    ep->n_batches++;

    ep->cork++; /* socket frames: one write for the batch */
    err = kvt__ucx_read_post(ep, b, 0, &posted);
    ep->cork--;
    kvt__ucx_sock_flush(ep);
    if (err != 0) {
        kvt__ucx_ep_fail(ep, err);
        if (posted == 0) { /* nothing posted: fail without a callback */
            kvt_list_del(&b->node);
            ep->n_batches--;
            kvt_free(b);
            return err;
        }
        if (b->status == 0)
            b->status = err;
        for (size_t i = posted; i < n; i++) { /* never posted: no reply to wait for */
            b->ops[i].state = RD_DONE;
            b->pending--;
        }
    }
    if (--b->pending == 0)
        kvt__ucx_batch_finish(b);
    return -EINPROGRESS;
}

/* ---- the loop ---- */

/* The busy-polling owner calls this in a tight loop, so it costs no system call of
 * its own once every endpoint is authorized and quiet: the sockets are looked at only
 * while one matters (or after a sleep, or every UCX_SOCK_EVERY_NS), the timerfd is
 * read only once its deadline has passed (arm resets it anyway), and worker progress
 * stops as soon as a UCX callback has left work for dispatch, so a completion reaches
 * its callback without one more empty ucp_worker_progress (an epoll_wait over tcp)
 * first. */
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
    now = ucx_now_ns();
    if (tp->n_sock_busy > 0 || tp->slept || now - tp->sock_check_ns >= UCX_SOCK_EVERY_NS) {
        tp->slept = false;
        tp->sock_check_ns = now;
        n += kvt__ucx_sock_poll(tp);
    }
    n += ucx_dispatch(tp, true);
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
    if (!kvt_list_empty(&tp->stash))
        ucx_stash_reap(tp, false);
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
    tp->slept = true; /* the sockets, in the event fd, may be why the owner wakes */
    return 0;
}

static int ucx_ep_info(struct kvt_tp_ep *pep, char *buf, size_t cap)
{
    struct ucx_ep *ep = ep_of(pep);

    if (cap == 0)
        return -EINVAL;
    if (ep->state != EP_CONNECTED)
        return -ENOTCONN;
    if (ep->path == PATH_SOCK) {
        snprintf(buf, cap, "socket");
        return 0;
    }
    if (ep->uep == NULL) {
        snprintf(buf, cap, "not yet authorized both ways");
        return 0;
    }
    (void)ucx_ep_lanes(ep);
    snprintf(buf, cap, "am over %s, rndv over %s", ep->am_lanes, ep->bw_lanes);
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
    .send_room = ucx_send_room,
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
    .ep_authorize = ucx_ep_authorize,
    .get_counters = ucx_get_counters,
};

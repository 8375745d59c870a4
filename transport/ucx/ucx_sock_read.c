/* Socket mode, both sides (the UCX backend, see ucx.c and ucx_int.h): a connection
 * whose peers have no shared-memory or RDMA lane between them moves its messages and
 * READs over our own authenticated TCP connection, the one that carried the
 * handshake, and UCX never gets tcp at all.
 *
 * Why: UCX's tcp interface listens on a port of its own that accepts anyone, and in
 * UCX 1.13 it writes the payload of a uct PUT request wherever the request's header
 * says (uct_tcp_ep_handle_put_req), whatever the UCP features of the worker: with UCX
 * over tcp, anyone who reached that port could write into the node's memory without
 * the cluster secret (issue #21). Our socket is the only thing we listen on, and its
 * first bytes pass our frame reader.
 *
 * Messages: MSG frames, copied when sent (kvt_tp_send copies anyway), received
 * straight into the message's buffer, delivered in order with what came before on
 * the socket (one sequence space, as over UCX). At most recv_credits not yet
 * written (-EAGAIN beyond).
 *
 * READ, client: one RDREQ frame per op {address, length, tag}; the reply is an RDREP
 * frame {tag, length, err} followed by the bytes, which the reader puts straight into
 * the op's place in the local registration (readv into it: no copy but the part that
 * came in the same read as the header). A reply for no op waiting, or of another
 * length than asked, fails the endpoint (counted "proto"). At most
 * UCX_SOCK_WINDOW_OPS requests and UCX_SOCK_WINDOW_BYTES outstanding (an op alone
 * may be larger); the others wait, in order, and go as replies come in. Timeouts and
 * cancellation are the endpoint's, as over UCX: a batch fails whole, its bytes
 * undefined.
 *
 * READ, server: a request is checked as over active messages (authorized endpoint,
 * range inside a remote registration, may_read; the same refusals, counters and
 * answer), then queued; the reply goes onto the socket's output as a piece that
 * references the registered bytes (sendmsg takes them from there: no copy), at most
 * UCX_RD_INFLIGHT_BYTES of replies on the output per endpoint. The rows a reply reads
 * are pinned by the network tier's lease while granted. A peer whose outstanding
 * requests exceed the window fails (counted "proto"): what a peer can make us hold is
 * bounded. Deregistering memory a queued reply would read turns the reply into a
 * refusal (nothing of it written yet) or gives it a copy of its bytes (started). */
#include <endian.h>
#include <errno.h>
#include <stdint.h>
#include <string.h>

#include "kvt/alloc.h"
#include "kvt/log.h"
#include "ucx_int.h"

int kvt__ucx_sock_start(struct ucx_ep *ep)
{
    struct kvt_list *pos, *tmp;
    size_t max = ep->tp->pub.cfg.max_msg_bytes;
    int ret = kvt_tp_frame_reader_open(ep->reader, max > UINT32_MAX ? UINT32_MAX : (uint32_t)max);

    if (ret < 0)
        return ret;
    kvt_free(ep->peer_waddr);
    ep->peer_waddr = NULL;
    ep->path = PATH_SOCK;
    ep->connected_ns = ucx_now_ns();
    kvt__ucx_ep_account(ep);
    ep->cork++;
    /* Messages sent since our authorize, in order (each still counts in tx_inflight,
     * now as a MSG frame on the output). */
    kvt_list_for_each_safe(pos, tmp, &ep->txq)
    {
        struct ucx_tx *tx = kvt_list_entry(pos, struct ucx_tx, node);

        kvt_list_del(&tx->node);
        if (ret == 0)
            ret = kvt__ucx_sock_frame(ep, KVT_TP_FRAME_MSG, tx->data, tx->len, NULL, 0);
        else
            ep->tx_inflight--;
        kvt_free(tx);
    }
    if (ret == 0)
        kvt__ucx_sock_post_unsent(ep);
    ep->cork--;
    kvt__ucx_sock_flush(ep);
    ep->tp->kick = true; /* replies owed to requests that came before */
    return ret;
}

int kvt__ucx_sock_msg(struct ucx_ep *ep, const void *buf, size_t len)
{
    int ret;

    ep->tx_inflight++; /* given back when the frame is written (or dropped) */
    ret = kvt__ucx_sock_frame(ep, KVT_TP_FRAME_MSG, buf, len, NULL, 0);
    if (ret < 0)
        ep->tx_inflight--;
    return ret;
}

/* ---- client ---- */

static bool win_room(unsigned ops, uint64_t bytes, uint64_t len)
{
    return ops == 0 || (ops < UCX_SOCK_WINDOW_OPS && bytes + len <= UCX_SOCK_WINDOW_BYTES);
}

/* 0: posted, 1: no room in the window (stays RD_UNSENT), negative: failed. */
int kvt__ucx_sock_post(struct ucx_ep *ep, struct ucx_rd_op *op)
{
    uint64_t p[3] = {htole64(op->hdr.addr), htole64(op->hdr.len), htole64(op->hdr.tag)};
    int ret;

    if (!win_room(ep->win_ops, ep->win_bytes, op->hdr.len))
        return 1;
    ret = kvt__ucx_sock_frame(ep, KVT_TP_FRAME_RDREQ, p, sizeof(p), NULL, 0);
    if (ret < 0) {
        op->state = RD_DONE;
        return ret;
    }
    op->state = RD_WAIT;
    op->in_window = true;
    ep->win_ops++;
    ep->win_bytes += op->hdr.len;
    return 0;
}

void kvt__ucx_sock_post_unsent(struct ucx_ep *ep)
{
    struct kvt_list *pos, *tmp;

    if (ep->n_unsent == 0 || ep->path != PATH_SOCK || ep->state != EP_CONNECTED)
        return;
    ep->cork++;
    kvt_list_for_each_safe(pos, tmp, &ep->batches)
    {
        struct ucx_batch *b = kvt_list_entry(pos, struct ucx_batch, node);
        size_t i;

        for (i = b->next_unsent; i < b->n_ops; i++) {
            int ret;

            if (b->ops[i].state != RD_UNSENT)
                continue;
            ret = kvt__ucx_sock_post(ep, &b->ops[i]);
            if (ret == 1)
                break;
            ep->n_unsent--;
            if (ret < 0) { /* the ep fails; teardown ends the ops left */
                if (b->status == 0)
                    b->status = ret;
                if (--b->pending == 0)
                    kvt__ucx_batch_finish(b);
                kvt__ucx_ep_fail(ep, ret);
                break;
            }
        }
        b->next_unsent = i;
        if (i < b->n_ops || ep->state != EP_CONNECTED)
            break; /* in order: nothing of a later batch before these */
    }
    ep->cork--;
    kvt__ucx_sock_flush(ep);
}

static void win_release(struct ucx_ep *ep, struct ucx_rd_op *op)
{
    if (!op->in_window)
        return;
    op->in_window = false;
    ep->win_ops--;
    ep->win_bytes -= op->hdr.len;
}

int kvt__ucx_sock_rdrep(struct ucx_ep *ep, const uint8_t *fixed, uint64_t sink_len, uint8_t **dst_p)
{
    uint64_t tag;
    uint32_t err;
    struct ucx_rd_op *op;

    memcpy(&tag, fixed, 8);
    memcpy(&err, fixed + 16, 4);
    tag = le64toh(tag);
    err = le32toh(err);
    op = kvt__ucx_rd_op_find(ep, tag);
    if (op == NULL) {
        kvt__ucx_ep_proto(ep, "a READ reply for no READ waiting");
        return -EPROTO;
    }
    if (err != 0) { /* a refusal: no bytes (the reader checked) */
        kvt_warn("ucx", "endpoint %llu: the peer refused a READ of %llu bytes",
                 (unsigned long long)ep->id, (unsigned long long)op->hdr.len);
        win_release(ep, op);
        if (err != UCX_RD_REFUSED) {
            kvt__ucx_ep_proto(ep, "a READ reply with an unknown error");
            return -EPROTO; /* teardown ends the op */
        }
        kvt__ucx_rd_op_done(op, -EACCES);
        return 0;
    }
    if (sink_len != op->hdr.len) {
        kvt__ucx_ep_proto(ep, "a READ reply of another length than asked");
        return -EPROTO;
    }
    op->state = RD_RECV;
    ep->sink_op = op;
    *dst_p = op->dst;
    return 0;
}

void kvt__ucx_sock_rdrep_done(struct ucx_ep *ep)
{
    struct ucx_rd_op *op = ep->sink_op;

    ep->sink_op = NULL;
    win_release(ep, op);
    kvt__ucx_rd_op_done(op, 0);
    kvt__ucx_sock_post_unsent(ep);
}

/* ---- server ---- */

void kvt__ucx_sock_rdreq(struct ucx_ep *ep, const uint8_t *payload)
{
    struct ucx_rd_hdr h = {.magic = UCX_MAGIC, .version = UCX_VERSION};

    memcpy(&h.addr, payload, 8);
    memcpy(&h.len, payload + 8, 8);
    memcpy(&h.tag, payload + 16, 8);
    h.addr = le64toh(h.addr);
    h.len = le64toh(h.len);
    h.tag = le64toh(h.tag);
    if (h.len == 0) {
        kvt__ucx_ep_proto(ep, "a READ request of 0 bytes");
        return;
    }
    if (!win_room(ep->srv_ops, ep->srv_bytes, h.len)) {
        kvt__ucx_ep_proto(ep, "READ requests beyond the window");
        return;
    }
    ep->srv_ops++;
    ep->srv_bytes += h.len;
    kvt__ucx_rd_serve(ep, &h, h.len);
}

int kvt__ucx_sock_fill(struct ucx_ep *ep)
{
    int n = 0;

    while (!kvt_list_empty(&ep->rd_q) && ep->state == EP_CONNECTED && ep->path == PATH_SOCK &&
           ep->sock >= 0) {
        struct ucx_rd_tx *tx = kvt_list_entry(ep->rd_q.next, struct ucx_rd_tx, node);
        struct ucx_out *o = &tx->out;
        uint64_t fixed[3];

        if (ep->rd_inflight > 0 && ep->rd_inflight + tx->hdr.len > UCX_RD_INFLIGHT_BYTES)
            break;
        kvt_list_del(&tx->node);
        kvt_list_init(&tx->node);
        fixed[0] = htole64(tx->hdr.tag);
        fixed[1] = htole64(tx->hdr.len);
        fixed[2] = htole64((uint64_t)tx->hdr.err); /* err, then 0 */
        kvt_tp_frame_hdr(o->hdr, KVT_TP_FRAME_RDREP, KVT_TP_FRAME_RDREP_BYTES);
        memcpy(o->hdr + KVT_TP_FRAME_HDR, fixed, sizeof(fixed));
        o->hdr_len = KVT_TP_FRAME_HDR + KVT_TP_FRAME_RDREP_BYTES;
        o->data = (const uint8_t *)(uintptr_t)tx->hdr.addr;
        o->data_len = tx->mr != NULL ? tx->hdr.len : 0;
        o->own = NULL;
        o->cap = 0;
        o->rd = tx;
        o->n_msgs = 0;
        tx->inflight = o->data_len;
        ep->rd_inflight += tx->inflight;
        kvt__ucx_sock_queue(ep, o);
        n++;
    }
    return n;
}

void kvt__ucx_sock_reply_done(struct ucx_ep *ep, struct ucx_rd_tx *tx)
{
    ep->rd_inflight -= tx->inflight;
    if (tx->asked > 0) {
        ep->srv_ops--;
        ep->srv_bytes -= tx->asked;
    }
    kvt_free(tx->out.own);
    kvt_free(tx);
}

void kvt__ucx_sock_dereg(struct ucx_tp *tp, struct kvt_tp_mr *mr)
{
    struct kvt_list *pos, *tmp, *q, *qtmp;

    kvt_list_for_each_safe(pos, tmp, &tp->eps)
    {
        struct ucx_ep *ep = kvt_list_entry(pos, struct ucx_ep, node);

        kvt_list_for_each_safe(q, qtmp, &ep->outq)
        {
            struct ucx_out *o = kvt_list_entry(q, struct ucx_out, node);
            struct ucx_rd_tx *tx = o->rd;
            uint32_t err = htole32(UCX_RD_REFUSED);

            if (tx == NULL || tx->mr != mr)
                continue;
            tx->mr = NULL;
            if (o->sent == 0) { /* nothing of it out: a refusal instead */
                memset(o->hdr + KVT_TP_FRAME_HDR + 8, 0, 8);
                memcpy(o->hdr + KVT_TP_FRAME_HDR + 16, &err, 4);
                ep->out_bytes -= o->data_len;
                o->data_len = 0;
                continue;
            }
            o->own = kvt_malloc(o->data_len > 0 ? o->data_len : 1);
            if (o->own == NULL) { /* nothing may read mr after this: the socket goes */
                kvt__ucx_ep_fail(ep, -ENOMEM);
                kvt__ucx_sock_close(ep);
                break;
            }
            memcpy(o->own, o->data, o->data_len);
            o->data = o->own;
        }
    }
}

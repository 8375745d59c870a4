/* SPDX-License-Identifier: Apache-2.0 */
/* The transport interface: how kvtier nodes move bytes.
 *
 * A transport is one backend instance (a UCP context + worker, or an rdma_cm event
 * channel + PD + CQ) owned by one thread, the node's loop: every call and every
 * callback happens on that thread, inside kvt_tp_progress(). Nothing blocks; the
 * loop waits on kvt_tp_event_fd() (after kvt_tp_arm() returned 0) and calls progress.
 *
 * Endpoints: one per peer, from kvt_tp_connect() (active side) or the accept
 * callback (passive side). An endpoint is usable once on_ep_state reports
 * KVT_EP_CONNECTED; it ends exactly once with KVT_EP_CLOSED and an error code
 * (0 for a local close, -ECONNRESET for a peer that went away, -ETIMEDOUT, ...).
 * After the CLOSED callback the endpoint is freed by the transport; the owner drops
 * its pointer in that callback.
 *
 * Control messages: bytes up to max_msg_bytes, delivered in order, whole, to
 * on_msg; the buffer is valid only during the callback. kvt_tp_send copies.
 * -EAGAIN when the peer has no receive credit left (try after progress).
 *
 * Authorization: a connection is unauthenticated until its owner says otherwise.
 * The owner runs its own handshake (cluster/peers.c: HELLO/AUTH, an HMAC over the
 * cluster secret) with control messages, then calls kvt_tp_ep_authorize on its end.
 * Before that call no memory of ours is readable by that endpoint: its READ
 * requests are refused, counted (KVT_TP_READ_UNAUTH) and the endpoint is closed
 * (verbs: its QP has no remote access flag until then, so the NIC refuses the READ,
 * the reader's batch fails with -EACCES and its endpoint closes; the access ends
 * with the endpoint).
 * Until an endpoint is authorized, messages are bounded in both directions: at
 * most KVT_TP_PREAUTH_MSGS messages of at most KVT_TP_PREAUTH_MSG_BYTES each
 * (kvt_tp_send says -EMSGSIZE or -ENOBUFS past them), and an endpoint the owner has
 * not authorized within preauth_timeout_ms is closed (-ETIMEDOUT, counted). Each
 * side authorizes its own end: READs and messages flow both ways once both have.
 * Messages sent between our authorize and the peer's keep their order.
 * For backends that serve READs in software (UCX), every READ request of an
 * authorized endpoint whose range lies inside a remote registration is also put to
 * the may_read callback; a range outside every registration and a range may_read
 * refuses get the same answer (the READ fails with -EACCES at the reader), so a
 * reader learns nothing of our layout. Refusals of every kind are counted
 * (kvt_tp_get_counters).
 *
 * Grants: kvt_tp_reg_granted registers memory that peers may READ only where the
 * owner has exposed it to them: kvt_tp_expose(ep, mr, ranges) makes exactly those
 * byte ranges of mr readable by the peer of ep alone and packs the handle that peer
 * unpacks (kvt_tp_unpack) to READ them; kvt_tp_revoke ends it. The verbs backend
 * enforces it in the device: the registration itself grants no remote access, each
 * range is a type-2 memory window bound to ep's QP (its own rkey, valid on that QP
 * only), and revoke deallocates the windows (no READ is served with them once it
 * returns). Backends that serve READs in software (UCX) expose nothing: the handle
 * is the registration's, kvt_tp_revoke does nothing, and may_read decides each READ.
 * An exposure ends with its endpoint too (the owner still calls kvt_tp_revoke, which
 * then only frees it). Revoke every exposure of mr before deregistering it and before
 * closing the transport.
 *
 * Memory: kvt_tp_reg_remote registers memory that peers may READ (read only to
 * them; any length a node's primary may have: verbs splits it into registrations of
 * at most KVT_TP_MAX_REG_BYTES, UCX maps it whole); its handle is
 * packed to bytes the peer unpacks into a kvt_tp_rkey. kvt_tp_reg_local registers
 * a destination for our own READs. Register once, not per operation. A peer names
 * remote memory by offsets from the start of the registration, never by pointer.
 *
 * READ batches: a list of {remote offset, local offset, length}; one completion
 * callback per batch with 0 or a negative errno; many batches in flight. A batch
 * that fails leaves the local bytes undefined: the caller treats every chunk of it
 * as a miss. Closing an endpoint or the transport with batches in flight completes
 * each of them with -ECANCELED (or the endpoint's error), before the close returns
 * or from the next progress; never after the memory they name was deregistered.
 *
 * Errors: negative errno everywhere; each backend converts its library's errors in
 * one place. */
#ifndef KVT_TRANSPORT_H
#define KVT_TRANSPORT_H

#include <errno.h>
#include <stddef.h>
#include <stdint.h>
#include <stdbool.h>

#define KVT_TP_MAX_REG_BYTES   (2ull << 30) /* verbs: one ibv_reg_mr covers at most 2 GiB */
#define KVT_TP_MAX_HANDLE_SIZE 4096         /* packed handle of one registered region */
/* Before an endpoint is authorized: messages each way, and bytes per message. */
#define KVT_TP_PREAUTH_MSGS      8
#define KVT_TP_PREAUTH_MSG_BYTES 4096
/* Ranges of one kvt_tp_expose, at most, after adjacent ones are merged (its handle
 * fits KVT_TP_MAX_HANDLE_SIZE); more fail with -EMSGSIZE. */
#define KVT_TP_MAX_EXPOSE_RANGES 240

struct kvt_transport;
struct kvt_tp_ep;
struct kvt_tp_mr;
struct kvt_tp_rkey;
struct kvt_tp_grant;

enum kvt_ep_state { KVT_EP_CONNECTED, KVT_EP_CLOSED };

struct kvt_tp_callbacks {
    /* Passive side: a new endpoint, already in the CONNECTED state (no separate
     * on_ep_state(CONNECTED) follows). Return 0 to keep it, negative to refuse
     * (the transport then closes it without a CLOSED callback). */
    int (*on_accept)(void *arg, struct kvt_tp_ep *ep);
    void (*on_ep_state)(void *arg, struct kvt_tp_ep *ep, enum kvt_ep_state state, int err);
    void (*on_msg)(void *arg, struct kvt_tp_ep *ep, const void *buf, size_t len);
    /* Backends that serve READs in software (UCX): may the authorized endpoint ep
     * read [off, off + len) of our remote registration mr? Asked for every READ
     * request whose range lies inside mr, from inside progress (while the backend's
     * library runs its handlers): a pure question, it must not call any transport
     * function. NULL refuses every READ. A refusal is answered exactly as a range
     * outside every registration is, and counted (KVT_TP_READ_GRANT). */
    bool (*may_read)(void *arg, struct kvt_tp_ep *ep, struct kvt_tp_mr *mr, uint64_t off,
                     uint64_t len);
    void *arg;
};

/* What a transport refused, by reason (kvt_tp_counters.refused[]). */
enum kvt_tp_refusal {
    KVT_TP_READ_UNAUTH,       /* a READ request from an endpoint not authorized; closed */
    KVT_TP_READ_RANGE,        /* a READ outside every remote registration */
    KVT_TP_READ_GRANT,        /* a READ inside one that may_read refused (or no may_read) */
    KVT_TP_PREAUTH_CONNS,     /* a connection beyond max_preauth: accepted, closed at once */
    KVT_TP_PREAUTH_MALFORMED, /* bytes before authorize that are not our protocol; closed */
    KVT_TP_PREAUTH_TIMEOUT,   /* not authorized within preauth_timeout_ms; closed */
    KVT_TP_UNKNOWN_CONN,      /* a message that names no endpoint of ours; dropped */
    KVT_TP_PROTO, /* an authorized peer broke the protocol (a READ reply for no READ or of
                   * another length, requests beyond the window, a frame over its bound,
                   * bytes out of place); closed */
    KVT_TP_N_REFUSALS
};

/* Cumulative since the transport opened. */
struct kvt_tp_counters {
    uint64_t refused[KVT_TP_N_REFUSALS];
};

/* "read_unauth", "read_range", "read_grant", "preauth_conns", "preauth_malformed",
 * "preauth_timeout", "unknown_conn", "proto" (metric labels); "?" out of range. */
const char *kvt_tp_refusal_name(unsigned r);

struct kvt_transport_config {
    const char *backend;         /* "ucx" or "verbs" */
    size_t max_msg_bytes;        /* largest control message; 0 = 64 KiB */
    unsigned recv_credits;       /* pre-posted receives per endpoint; 0 = 64 */
    unsigned max_batches;        /* READ batches in flight per endpoint; 0 = 256 */
    unsigned connect_timeout_ms; /* 0 = 5000 */
    unsigned op_timeout_ms;      /* a READ batch older than this fails; 0 = 10000 */
    unsigned preauth_timeout_ms; /* an endpoint not authorized by then is closed; 0 = 10000 */
    unsigned max_preauth;        /* accepted endpoints not yet authorized, at most; 0 = 64 */
    /* The address this transport will listen on. UCX confines its own tcp
     * interfaces to that address's device unless UCX_NET_DEVICES is set; NULL, or a
     * wildcard address, leaves UCX's choice (every device). */
    const char *local_addr;
    struct kvt_tp_callbacks cb;
};

/* One element of a READ batch. */
struct kvt_read_op {
    uint64_t remote_off; /* from the start of the peer's registration */
    uint64_t local_off;  /* from the start of the local registration */
    uint64_t len;
};

/* One byte range of a registration, for kvt_tp_expose. */
struct kvt_tp_range {
    uint64_t off;
    uint64_t len;
};

/* status 0, or negative errno (the whole batch failed). */
typedef void (*kvt_read_cb)(void *arg, int status);

struct kvt_transport_ops {
    const char *name;
    int (*open)(const struct kvt_transport_config *cfg, struct kvt_transport **tp_p);
    void (*close)(struct kvt_transport *tp);
    /* addr "127.0.0.1" etc.; port 0 = pick one, returned in *port_p. */
    int (*listen)(struct kvt_transport *tp, const char *addr, uint16_t port, uint16_t *port_p);
    int (*connect)(struct kvt_transport *tp, const char *addr, uint16_t port, void *user,
                   struct kvt_tp_ep **ep_p);
    void (*ep_close)(struct kvt_tp_ep *ep);
    int (*send)(struct kvt_tp_ep *ep, const void *buf, size_t len);
    /* Optional. How many messages send would take now without -EAGAIN (*room) and
     * at most (*cap: the peer's receive credits), so that bulk traffic can leave
     * room for replies. 0, or -ENOTCONN. */
    int (*send_room)(struct kvt_tp_ep *ep, unsigned *room, unsigned *cap);
    int (*reg_remote)(struct kvt_transport *tp, void *base, size_t len, struct kvt_tp_mr **mr_p);
    int (*reg_local)(struct kvt_transport *tp, void *base, size_t len, struct kvt_tp_mr **mr_p);
    void (*dereg)(struct kvt_tp_mr *mr);
    /* Handle bytes of a reg_remote registration, to send to peers. */
    int (*pack)(struct kvt_tp_mr *mr, void *buf, size_t cap, size_t *len_p);
    int (*unpack)(struct kvt_tp_ep *ep, const void *buf, size_t len, struct kvt_tp_rkey **rk_p);
    void (*rkey_destroy)(struct kvt_tp_rkey *rk);
    /* -EINPROGRESS: posted; cb runs exactly once, from a later progress. Else
     * nothing is posted and cb never runs: -EINVAL for an op outside either
     * registration, -EAGAIN when max_batches are in flight, -ENOTCONN on a closed
     * endpoint. */
    int (*read)(struct kvt_tp_ep *ep, struct kvt_tp_rkey *rk, struct kvt_tp_mr *local,
                const struct kvt_read_op *ops, size_t n, kvt_read_cb cb, void *arg);
    /* Runs callbacks; returns how many events it handled (>= 0) or negative errno. */
    int (*progress)(struct kvt_transport *tp);
    int (*event_fd)(struct kvt_transport *tp);
    /* 0: safe to sleep on event_fd; -EAGAIN: call progress again first. */
    int (*arm)(struct kvt_transport *tp);
    /* How READs to this peer move, for people and tests ("am over sysv, rndv over
     * cma", "rdma read"): a NUL-terminated line in buf. Optional. */
    int (*ep_info)(struct kvt_tp_ep *ep, char *buf, size_t cap);
    /* The owner's handshake with the peer on ep succeeded: from now on the peer may
     * READ our remote registrations (subject to may_read) and messages are no
     * longer bounded by the pre-auth limits. 0 (again 0 when already authorized),
     * -ENOTCONN before CONNECTED or after a failure. May be called from callbacks. */
    int (*ep_authorize)(struct kvt_tp_ep *ep);
    /* Fills *out with the refusal counters. */
    int (*get_counters)(struct kvt_transport *tp, struct kvt_tp_counters *out);
    /* Optional (NULL: reg_remote). Memory peers may READ only through exposures. */
    int (*reg_granted)(struct kvt_transport *tp, void *base, size_t len, struct kvt_tp_mr **mr_p);
    /* Optional (NULL: the handle of pack, no grant object; may_read decides). Makes
     * ranges r[0..n) of the reg_granted registration mr readable by ep's peer alone
     * and packs into buf the handle it unpacks; *g_p for revoke. 0, or: -EINVAL (a
     * range outside mr, empty, or mr not reg_granted), -EPERM (ep not authorized),
     * -ENOTCONN, -EMSGSIZE (more than KVT_TP_MAX_EXPOSE_RANGES ranges), -ENOSPC (cap),
     * -EAGAIN (the endpoint's room for exposures in flight is used: try after
     * progress), or the device's error (nothing exposed). The ranges are readable by
     * the time a message sent after this call reaches the peer. */
    int (*expose)(struct kvt_tp_ep *ep, struct kvt_tp_mr *mr, const struct kvt_tp_range *r,
                  size_t n, void *buf, size_t cap, size_t *len_p, struct kvt_tp_grant **g_p);
    /* Ends an exposure at once and frees it; also after its endpoint closed. */
    void (*revoke)(struct kvt_tp_grant *g);
};

/* Fields every backend's endpoint and transport start with. */
struct kvt_transport {
    const struct kvt_transport_ops *ops;
    struct kvt_transport_config cfg;
};

struct kvt_tp_ep {
    struct kvt_transport *tp;
    void *user; /* the owner's pointer (connect's user, or set in on_accept) */
};

/* Backends that are built in ("ucx", "verbs"); NULL if unknown or not built. */
const struct kvt_transport_ops *kvt_transport_find(const char *name);
/* Fills the defaults of every zero field. */
void kvt_transport_config_defaults(struct kvt_transport_config *cfg);

static inline int kvt_tp_open(const struct kvt_transport_config *cfg, struct kvt_transport **tp_p)
{
    const struct kvt_transport_ops *ops = kvt_transport_find(cfg->backend);

    return ops == NULL ? -ENOTSUP : ops->open(cfg, tp_p);
}
static inline void kvt_tp_close(struct kvt_transport *tp)
{
    if (tp != NULL)
        tp->ops->close(tp);
}
static inline int kvt_tp_listen(struct kvt_transport *tp, const char *addr, uint16_t port,
                                uint16_t *port_p)
{
    return tp->ops->listen(tp, addr, port, port_p);
}
static inline int kvt_tp_connect(struct kvt_transport *tp, const char *addr, uint16_t port,
                                 void *user, struct kvt_tp_ep **ep_p)
{
    return tp->ops->connect(tp, addr, port, user, ep_p);
}
static inline void kvt_tp_ep_close(struct kvt_tp_ep *ep)
{
    ep->tp->ops->ep_close(ep);
}
static inline int kvt_tp_send(struct kvt_tp_ep *ep, const void *buf, size_t len)
{
    return ep->tp->ops->send(ep, buf, len);
}
/* -ENOTSUP when the backend does not say (send alone then bounds the sender). */
static inline int kvt_tp_send_room(struct kvt_tp_ep *ep, unsigned *room, unsigned *cap)
{
    return ep->tp->ops->send_room == NULL ? -ENOTSUP : ep->tp->ops->send_room(ep, room, cap);
}
static inline int kvt_tp_reg_remote(struct kvt_transport *tp, void *base, size_t len,
                                    struct kvt_tp_mr **mr_p)
{
    return tp->ops->reg_remote(tp, base, len, mr_p);
}
static inline int kvt_tp_reg_local(struct kvt_transport *tp, void *base, size_t len,
                                   struct kvt_tp_mr **mr_p)
{
    return tp->ops->reg_local(tp, base, len, mr_p);
}
static inline void kvt_tp_dereg(struct kvt_tp_mr *mr, struct kvt_transport *tp)
{
    tp->ops->dereg(mr);
}
static inline int kvt_tp_pack(struct kvt_transport *tp, struct kvt_tp_mr *mr, void *buf, size_t cap,
                              size_t *len_p)
{
    return tp->ops->pack(mr, buf, cap, len_p);
}
static inline int kvt_tp_unpack(struct kvt_tp_ep *ep, const void *buf, size_t len,
                                struct kvt_tp_rkey **rk_p)
{
    return ep->tp->ops->unpack(ep, buf, len, rk_p);
}
static inline void kvt_tp_rkey_destroy(struct kvt_transport *tp, struct kvt_tp_rkey *rk)
{
    tp->ops->rkey_destroy(rk);
}
static inline int kvt_tp_read(struct kvt_tp_ep *ep, struct kvt_tp_rkey *rk, struct kvt_tp_mr *local,
                              const struct kvt_read_op *ops, size_t n, kvt_read_cb cb, void *arg)
{
    return ep->tp->ops->read(ep, rk, local, ops, n, cb, arg);
}
static inline int kvt_tp_progress(struct kvt_transport *tp)
{
    return tp->ops->progress(tp);
}
static inline int kvt_tp_event_fd(struct kvt_transport *tp)
{
    return tp->ops->event_fd(tp);
}
static inline int kvt_tp_ep_info(struct kvt_tp_ep *ep, char *buf, size_t cap)
{
    return ep->tp->ops->ep_info == NULL ? -ENOTSUP : ep->tp->ops->ep_info(ep, buf, cap);
}
static inline int kvt_tp_arm(struct kvt_transport *tp)
{
    return tp->ops->arm(tp);
}
static inline int kvt_tp_ep_authorize(struct kvt_tp_ep *ep)
{
    return ep->tp->ops->ep_authorize == NULL ? -EOPNOTSUPP : ep->tp->ops->ep_authorize(ep);
}
static inline int kvt_tp_reg_granted(struct kvt_transport *tp, void *base, size_t len,
                                     struct kvt_tp_mr **mr_p)
{
    return tp->ops->reg_granted != NULL ? tp->ops->reg_granted(tp, base, len, mr_p)
                                        : tp->ops->reg_remote(tp, base, len, mr_p);
}
/* *g_p is NULL when the backend needs no grant object (kvt_tp_revoke accepts it). */
static inline int kvt_tp_expose(struct kvt_tp_ep *ep, struct kvt_tp_mr *mr,
                                const struct kvt_tp_range *r, size_t n, void *buf, size_t cap,
                                size_t *len_p, struct kvt_tp_grant **g_p)
{
    if (ep->tp->ops->expose != NULL)
        return ep->tp->ops->expose(ep, mr, r, n, buf, cap, len_p, g_p);
    *g_p = NULL;
    return ep->tp->ops->pack(mr, buf, cap, len_p);
}
static inline void kvt_tp_revoke(struct kvt_transport *tp, struct kvt_tp_grant *g)
{
    if (g != NULL && tp->ops->revoke != NULL)
        tp->ops->revoke(g);
}
static inline int kvt_tp_get_counters(struct kvt_transport *tp, struct kvt_tp_counters *out)
{
    return tp->ops->get_counters == NULL ? -EOPNOTSUPP : tp->ops->get_counters(tp, out);
}

#endif

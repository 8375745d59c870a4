/* SPDX-License-Identifier: Apache-2.0 */
/* The verbs backend of the transport interface (kvt/transport.h):
 * librdmacm for connection setup, RC QPs, SEND/RECV for control messages and
 * chained RDMA READs for data.
 *
 * Resources. open() takes every device rdma_cm knows (rdma_get_devices) and makes a
 * PD and a completion channel on each; memory is registered on every device, split
 * into pieces of KVT_TP_MAX_REG_BYTES. Each endpoint has its own CQ on its device's
 * channel (cq_context = the ep), its RC QP (ibv_create_qp: ours, not rdma_cm's; see
 * Access) and one registered buffer pool: n_rx receive buffers (recv_credits + 2,
 * all posted before connect or accept) and n_tx send buffers, each VB_HDR +
 * max_msg_bytes.
 *
 * Handshake: the private data of the connect request and of the accept carries
 * struct vb_hello {magic, version, receive credits, largest message, node GUID};
 * a bad one is rejected. The GUID names the device the peer's QP sits on, so
 * unpack picks that device's rkeys out of a handle. Nothing in it names memory: rkeys
 * and offsets travel only in handles, which the owner sends after its own handshake.
 *
 * Access (who may READ our memory). Remote registrations are shared by every QP of a
 * device's PD, so the gate is the QP: a QP serves RDMA READs only with
 * IBV_ACCESS_REMOTE_READ in its access flags. Every QP starts with no access flag at
 * all and gets IBV_ACCESS_REMOTE_READ (and nothing else) from ep_authorize, an
 * RTS->RTS modify, once the owner's handshake has authenticated the peer; a READ
 * before that fails at the peer (rxe: remote invalid request) and moves our QP to
 * the error state: our receives are flushed though we did not stop the QP, so the
 * endpoint closes with -EACCES (logged). Failing or closing an endpoint moves its
 * QP to the error state at once (no more responses) and the reap destroys it: the
 * access ends with the link, and a new connection is a new QP with none.
 * rdma_create_qp would let librdmacm move the QP through INIT, RTR and RTS with the
 * access flags the kernel's CM computes (remote write, read and atomics whenever the
 * peer asked for a read depth), inside rdma_accept and inside rdma_get_cm_event on
 * the active side, before we see the connection: clearing them afterwards leaves a
 * window. So we create the QP ourselves and make each transition (vb_qp_modify) with
 * rdma_init_qp_attr's attributes but our access flags: rdma_accept and rdma_connect
 * get the QP number, the active side takes CONNECT_RESPONSE, moves its QP to RTR
 * and RTS and completes with rdma_establish.
 *
 * Grants (what an authorized peer may READ). A reg_remote registration is readable
 * whole through the QP gate. A reg_granted one (the network tier's primary and fence
 * words) is registered with no access flag (rxe gives it rkey 0; no rkey of it reads
 * anything), and expose makes byte ranges of it readable by one endpoint: each
 * window (ranges sorted, merged, cut at pieces) is its own registration of exactly
 * that range (MW_BIND only) and a type-2 memory window bound over all of it on the
 * endpoint's QP, by one chain of BIND_MW work requests posted before the owner's
 * next message (RC runs a send queue in order, so the windows are valid before
 * the GRANT that names them arrives). The window's own registration is there for
 * rxe: its responder checks a READ through a window against the bounds of the
 * registration the window is bound to, not the window's own (measured: a window
 * over one row of the region's registration read the next row), so bounds come from
 * the registration and the QP binding from the window; rxe checks both (a window
 * answers only on its QP, S10 of verbs_attack). revoke deallocates the windows and
 * then their registrations (synchronous: nothing is served with their rkeys once
 * it returns); an endpoint that goes deallocates its windows before its QP (a bound
 * window holds the QP: rxe's destroy waited 50 s for it). Bind chains have their
 * own room on the send queue (VB_BIND_WR_MAX WRs, VB_BIND_SEGS chains) and segment
 * slots after the reads'; expose says -EAGAIN when it is used up. Costs and the
 * alternatives measured: docs/rdma.md ("Who may read").
 *
 * Endpoint states:
 *   RESOLVING  active side: address and route resolution (rdma_cm events).
 *   CONNECTING active side: QP made (INIT), rdma_connect sent, waiting for
 *              CONNECT_RESPONSE; then RTR, RTS, rdma_establish and CONNECTED.
 *   ACCEPTING  passive side: QP made and moved to RTS, rdma_accept sent, waiting
 *              for ESTABLISHED; on_accept is called then (the ep is CONNECTED by then).
 *   CONNECTED  usable. Its CQ is polled only in this state, so a message that
 *              lands before ESTABLISHED is processed waits in the CQ.
 *   DYING      failed or closed (ep->err set; QP in the error state); the next reap
 *              destroys QP, CQ, buffers
 *              and cm_id (ibv_destroy_qp returns only once the device has stopped
 *              using the QP), then completes every batch with the ep's error, then
 *              queues the CLOSED callback (none for an ep that was never announced).
 *   DEAD       on tp->dead until its CLOSED callback ran; then freed.
 * Nothing is torn down inside a callback or inside ep_close: ep_close marks the ep
 * DYING (its QP to the error state and rdma_disconnect, so the device stops at
 * once), progress reaps it.
 *
 * Control messages and credits. Every message starts with struct vb_msg_hdr
 * {credits returned, type, flags}. A peer has posted R + 2 receives (R from its
 * hello): DATA messages are bounded by credits (R), a CREDIT message (credits only,
 * sent when R/2 are owed and no DATA carried them) is outstanding at most once, until
 * the peer acks it (F_ACK on any later message), and an ACK message (sent when an ack
 * is owed and nothing carried it) needs no ack: the next one can only follow another
 * CREDIT, which its sender sends only after it reposted the buffer of the previous
 * ACK. So at most R + 2 messages are ever unreposted and RNR never happens.
 * Receive buffers are reposted right after on_msg returns; the credit is owed then.
 *
 * READ batches. A batch copies its ops and holds a reference on the rkey and the
 * local registration. Its ops are cut into work requests: one remote-contiguous range
 * inside one remote piece per WR, with a scatter list of up to max_sge local ranges
 * (adjacent ops whose remote ranges touch share one WR), at most the port's max_msg_sz
 * bytes. WRs are posted in chains (segments) of up to VB_SEG_WRS, only the last one
 * signaled: RC completes a send queue in order, so its completion retires the whole
 * segment. Read WRs in flight are bounded by read_wr_max (from max_qp_wr, with room
 * for the sends); the QP's max_rd_atomic (initiator depth, from max_qp_init_rd_atom
 * and the peer's max_qp_rd_atom) bounds what the device has on the wire. What does
 * not fit waits on ep->pending and is posted as segments retire. A failed WR fails
 * its batch and the endpoint (the QP is in error anyway). A batch older than
 * op_timeout_ms fails the endpoint with -ETIMEDOUT. Completions run from progress,
 * never inside read().
 *
 * Event fd: an epoll fd holding the rdma_cm channel's fd, every device's completion
 * channel fd and a timerfd that arm() sets to the nearest connect or batch deadline.
 * Progress re-arms each notified CQ before draining it: a CQ is unarmed only while
 * its notification is unread, and then the event fd is readable. Progress polls the
 * CQs first and looks at the fds (one epoll_wait, no wait) only when the CQs had
 * nothing or every VB_FD_EVERY calls: a busy-polling loop makes no system call per
 * completion.
 *
 * Handle layout (pack/unpack), little-endian: struct vb_handle_hdr {magic, version,
 * devices, length, page offset, pieces}, then per device {GUID, rkey[pieces]}. An
 * expose handle: struct vb_grant_hdr {magic "kvGr", version, windows, GUID of the
 * device, length, page offset}, then per window {offset, length, rkey}; unpack
 * checks the windows are sorted, disjoint and inside one piece, and read() refuses
 * (-EINVAL) an op not inside a run of them.
 * Remote pieces are registered with ibv_reg_mr_iova at iova = page offset + piece
 * start, so a remote address is page offset + region offset: no pointer leaves the
 * node (windows' registrations use the same iova). Remote registrations carry
 * IBV_ACCESS_REMOTE_READ only, granted ones no access flag.
 *
 * Errors: ibverbs (positive errno or -1/errno), librdmacm (-1/errno), work
 * completion statuses and rdma_cm event statuses become negative errno in the
 * "error conversion" block below, nowhere else.
 *
 * Threads: every field belongs to the owner's thread; the library's own threads are
 * not visible here. close() must not be called from a callback. */
#include <assert.h>
#include <endian.h>
#include <errno.h>
#include <fcntl.h>
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

#include <infiniband/verbs.h>
#include <rdma/rdma_cma.h>

#include "kvt/alloc.h"
#include "kvt/common.h"
#include "kvt/list.h"
#include "kvt/log.h"
#include "kvt/transport.h"

#define VB_MOD           "verbs"
#define VB_MAGIC         0x6b767476u /* "kvtv" */
#define VB_VERSION       1
#define VB_HANDLE_MAGIC  0x6b76486eu
#define VB_HDR           8u   /* struct vb_msg_hdr */
#define VB_SEG_WRS       16u  /* read WRs per signaled chain */
#define VB_READ_WR_MAX   512u /* read WRs in flight per endpoint, at most */
#define VB_MAX_SGE       32u  /* scatter entries per read WR, at most */
#define VB_MAX_MSG_CAP   (16u << 20)
#define VB_MAX_CREDITS   4096u
#define VB_POLL_BATCH    32
#define VB_FD_EVERY      16 /* progress calls between two looks at the fds, at most */
#define VB_REAP_ROUNDS   8
#define VB_CLOSE_WAIT_NS (2ull * 1000000000ull)
#define VB_PIECE         KVT_TP_MAX_REG_BYTES
#define VB_GRANT_MAGIC   0x6b764772u /* a kvt_tp_expose handle: windows, not pieces */
#define VB_BIND_WR_MAX   (2u * KVT_TP_MAX_EXPOSE_RANGES + 32u) /* bind WRs in flight */
#define VB_BIND_SEGS     16u /* exposures whose bind chain is in flight, per endpoint */

/* wr_id: (index << 2) | kind */
enum vb_wr_kind { WR_SEG = 0, WR_SEG_LAST = 1, WR_RX = 2, WR_TX = 3 };
enum vb_msg_type { MSG_DATA = 1, MSG_CREDIT = 2, MSG_ACK = 3 };
#define VB_F_ACK 1u

enum vb_ep_state { EP_RESOLVING, EP_CONNECTING, EP_ACCEPTING, EP_CONNECTED, EP_DYING, EP_DEAD };

/* Connection private data (<= 56 bytes, the smallest rdma_cm allows). */
struct vb_hello {
    uint32_t magic;
    uint16_t version;
    uint16_t flags;
    uint32_t credits; /* receives the sender posted for DATA (R) */
    uint32_t max_msg; /* largest message body the sender receives */
    uint64_t guid;    /* node GUID of the sender's device */
    uint64_t reserved;
};

struct vb_msg_hdr {
    uint32_t credits; /* DATA receive buffers reposted since the last header */
    uint8_t type;
    uint8_t flags;
    uint16_t reserved;
};

struct vb_handle_hdr {
    uint32_t magic;
    uint16_t version;
    uint16_t n_dev;
    uint64_t len;
    uint32_t page_off;
    uint32_t n_pieces;
};

/* The handle of an exposure: this header, then n_win struct vb_win_wire. */
struct vb_grant_hdr {
    uint32_t magic;
    uint16_t version;
    uint16_t n_win;
    uint64_t guid; /* the device the windows live on (the peer's QP's) */
    uint64_t len;  /* of the registration */
    uint32_t page_off;
    uint32_t reserved;
};

struct vb_win_wire {
    uint64_t off; /* from the start of the registration */
    uint32_t len; /* inside one piece, so below 2^32 */
    uint32_t rkey;
};

/* One device: opened by rdma_get_devices, PD and completion channel ours. */
struct vb_dev {
    struct ibv_context *ctx;
    struct ibv_pd *pd;
    struct ibv_comp_channel *ch;
    struct ibv_device_attr attr;
    uint64_t guid;
};

/* The transport; every field belongs to the owner's thread. */
struct vb_tp {
    struct kvt_transport pub;
    struct rdma_event_channel *ech;
    struct ibv_context **ctx_list;
    int n_dev;
    struct vb_dev *devs;
    struct rdma_cm_id *listen_id;
    int epfd, tfd;
    unsigned fd_skip;       /* progress calls since the fds were last looked at */
    struct kvt_list eps;    /* endpoints not yet DEAD */
    struct kvt_list dead;   /* DEAD, CLOSED callback due */
    struct kvt_list done;   /* batches whose callback is due */
    struct kvt_list mrs;    /* live registrations */
    struct kvt_list rkeys;  /* live unpacked rkeys */
    struct kvt_list grants; /* exposures whose endpoint is gone, not yet revoked */
    bool closing;
    struct kvt_tp_counters ctr; /* refusals (the NIC's, as far as we see them) */
};

/* A registration: n_dev * n_pieces ibv_mr, device-major. refs: the owner's (until
 * dereg) plus one per batch that names it. */
struct kvt_tp_mr {
    struct vb_tp *tp;
    struct kvt_list node;
    bool remote;
    bool granted; /* reg_granted: MW_BIND only, readable through windows alone */
    uint8_t *base;
    size_t len;
    uint32_t page_off;
    uint32_t n_pieces;
    unsigned refs;
    struct ibv_mr *mr[];
};

/* A window of an exposure as its reader sees it. */
struct vb_win {
    uint64_t off, len;
    uint32_t rkey;
};

/* A peer's registration as seen through one endpoint's device: per-piece rkeys (a
 * pack handle), or n_win windows (an expose handle: sorted, disjoint, each inside
 * one piece; READs outside them are refused by read()). */
struct kvt_tp_rkey {
    struct vb_tp *tp;
    struct kvt_list node;
    uint64_t guid; /* the peer device these rkeys belong to */
    uint64_t len;
    uint32_t page_off;
    uint32_t n_pieces;
    unsigned refs;
    uint32_t n_win;
    struct vb_win *win; /* n_win entries, or NULL */
    uint32_t rkey[];
};

/* An exposure (kvt_tp_expose): n_mw type-2 windows on ep's device, bound by one
 * chain of BIND_MW work requests on ep's QP (only its last signaled), each over one
 * range of mr (a reference held). On ep->grants while ep lives; the reap deallocates
 * the windows of an ep that goes and moves the unrevoked ones to tp->grants (ep
 * NULL). revoke deallocates them (ibv_dealloc_mw: the device serves no READ with
 * their rkeys once it returns), unless the bind chain is still in flight: then they
 * go when its completion is polled (a window deallocated under a pending bind would
 * fail the QP). */
struct vb_gwin {
    struct ibv_mr *mr; /* the window's range alone, MW_BIND only (rkey unusable) */
    struct ibv_mw *mw; /* type 2, bound over all of mr on the ep's QP */
};

struct kvt_tp_grant {
    struct vb_tp *tp;
    struct vb_ep *ep;
    struct kvt_list node;
    struct kvt_tp_mr *mr;
    bool binding; /* the bind chain has not completed */
    bool revoked; /* revoke came while binding */
    unsigned n_mw;
    struct vb_gwin w[];
};

struct vb_ep;

/* A READ batch: on ep->batches from read() to its completion (then tp->done), and on
 * ep->pending while some of its ops are not posted. */
struct vb_batch {
    struct kvt_list node;  /* ep->batches or tp->done */
    struct kvt_list pnode; /* ep->pending */
    struct vb_ep *ep;
    struct kvt_tp_rkey *rk;  /* ref held */
    struct kvt_tp_mr *local; /* ref held */
    kvt_read_cb cb;
    void *arg;
    uint64_t start_ns;
    size_t cur_op;    /* posting cursor */
    uint64_t cur_off; /* bytes of ops[cur_op] posted */
    unsigned segs_out;
    bool on_pending;
    int status;
    size_t n;
    struct kvt_read_op ops[];
};

/* A posted chain of read WRs; retired by the completion of its last WR. */
struct vb_seg {
    struct vb_batch *batch;
    struct kvt_tp_grant *grant; /* a bind chain (segs[read_wr_max..]) */
    unsigned n_wr;
};

/* An endpoint; owned by tp (tp->eps, then tp->dead). */
struct vb_ep {
    struct kvt_tp_ep pub;
    struct vb_tp *tp;
    struct kvt_list node;
    struct vb_dev *dev;
    unsigned dev_idx;
    struct rdma_cm_id *id;
    struct ibv_qp *qp; /* ours (ibv_create_qp), not id->qp: see Access */
    struct ibv_cq *cq;
    bool cq_event;   /* a notification was read: re-arm before polling */
    bool authorized; /* ep_authorize granted the peer IBV_ACCESS_REMOTE_READ */
    bool passive;    /* accepted (counts against max_preauth until authorized) */
    bool link_ib;    /* InfiniBand link layer (not RoCE): see vb_qp_attr_restrict */
    enum vb_ep_state state;
    int err;        /* the CLOSED error; 0 for a local close */
    bool announced; /* the owner knows it (connect, or on_accept kept it) */
    bool was_connected;
    uint64_t deadline_ns; /* connect deadline while not CONNECTED */

    uint8_t *bufs; /* n_rx + n_tx buffers of buf_sz */
    struct ibv_mr *buf_mr;
    size_t buf_sz;
    unsigned n_rx, n_tx;
    unsigned *tx_free;
    unsigned n_tx_free;

    uint32_t peer_max_msg;
    uint64_t peer_guid;
    unsigned tx_credits;     /* DATA messages the peer can take */
    unsigned tx_credits_max; /* the peer's receive credits (its hello) */
    unsigned rx_owed;        /* DATA credits to return */
    unsigned credit_threshold;
    bool cm_out;  /* a CREDIT message waits for its ack */
    bool owe_ack; /* we received a CREDIT message */

    uint32_t max_msg_sz; /* port's largest message */
    unsigned max_sge;
    unsigned read_wr_max, read_wr_free;
    struct vb_seg *segs; /* read_wr_max read chains, then VB_BIND_SEGS bind chains */
    unsigned *seg_free;
    unsigned n_seg_free;
    unsigned bind_wr_free;
    unsigned bind_seg_free[VB_BIND_SEGS];
    unsigned n_bind_seg_free;
    struct kvt_list grants;  /* exposures bound on this QP */
    struct kvt_list batches; /* all of this ep's batches, oldest first */
    struct kvt_list pending; /* batches with ops not yet posted */
    unsigned n_batches;
    struct ibv_send_wr wrs[VB_SEG_WRS];
    struct ibv_sge sges[VB_SEG_WRS * VB_MAX_SGE];
};

extern const struct kvt_transport_ops kvt_verbs_transport_ops;

static inline struct vb_tp *tp_of(struct kvt_transport *t)
{
    return KVT_CONTAINER_OF(t, struct vb_tp, pub);
}
static inline struct vb_ep *ep_of(struct kvt_tp_ep *e)
{
    return KVT_CONTAINER_OF(e, struct vb_ep, pub);
}

static uint64_t vb_now_ns(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* ---- error conversion: the only place library conventions become -errno ---- */

/* librdmacm and NULL-returning ibverbs calls: -1 (or NULL) with errno set. */
static int vb_errno(void)
{
    return errno > 0 ? -errno : -EIO;
}

/* ibverbs calls that return 0 or a positive errno (some return -1 with errno). */
static int vb_ret(int rc)
{
    if (rc > 0)
        return -rc;
    if (rc == -1)
        return vb_errno();
    return rc;
}

static int vb_wc_err(enum ibv_wc_status st)
{
    switch (st) {
    case IBV_WC_SUCCESS:
        return 0;
    case IBV_WC_WR_FLUSH_ERR:
        return -ECANCELED;
    case IBV_WC_REM_ACCESS_ERR:
    case IBV_WC_LOC_ACCESS_ERR:
        return -EACCES;
    case IBV_WC_LOC_PROT_ERR:
    case IBV_WC_MW_BIND_ERR:
        return -EFAULT;
    case IBV_WC_LOC_LEN_ERR:
        return -EMSGSIZE;
    case IBV_WC_RETRY_EXC_ERR:
    case IBV_WC_RNR_RETRY_EXC_ERR:
    case IBV_WC_RESP_TIMEOUT_ERR:
        return -ETIMEDOUT;
    case IBV_WC_REM_INV_REQ_ERR:
    case IBV_WC_REM_OP_ERR:
    case IBV_WC_BAD_RESP_ERR:
    case IBV_WC_REM_ABORT_ERR:
        return -EPROTO;
    default:
        return -EIO;
    }
}

/* The same for our RDMA READ work requests: a peer whose QP refuses our READ (no
 * remote read access: it has not authorized us; rxe answers remote invalid request,
 * hardware may answer remote access error) or whose registration does not cover the
 * range gives -EACCES, as a software backend's refusal does. */
static int vb_read_wc_err(enum ibv_wc_status st)
{
    return st == IBV_WC_REM_INV_REQ_ERR ? -EACCES : vb_wc_err(st);
}

/* rdma_cm event status for an event that ends a connection attempt. */
static int vb_cm_err(enum rdma_cm_event_type ev, int status)
{
    switch (ev) {
    case RDMA_CM_EVENT_REJECTED:
        return -ECONNREFUSED; /* status is a CM reject reason, not an errno */
    case RDMA_CM_EVENT_ADDR_ERROR:
    case RDMA_CM_EVENT_ROUTE_ERROR:
        return status < 0 ? status : -EHOSTUNREACH;
    case RDMA_CM_EVENT_UNREACHABLE:
        return status < 0 ? status : -EHOSTUNREACH;
    case RDMA_CM_EVENT_CONNECT_ERROR:
        return status < 0 ? status : -ECONNABORTED;
    case RDMA_CM_EVENT_DISCONNECTED:
        return -ECONNRESET;
    case RDMA_CM_EVENT_DEVICE_REMOVAL:
        return -ENODEV;
    default:
        return status < 0 ? status : -EIO;
    }
}

/* ---- small helpers ---- */

static bool vb_in_range(uint64_t off, uint64_t len, uint64_t size)
{
    return len > 0 && len <= size && off <= size - len;
}

static int vb_set_nonblock(int fd)
{
    int fl = fcntl(fd, F_GETFL);

    if (fl < 0 || fcntl(fd, F_SETFL, fl | O_NONBLOCK) < 0)
        return vb_errno();
    return 0;
}

static uint32_t vb_n_pieces(uint64_t len)
{
    return (uint32_t)((len + VB_PIECE - 1) / VB_PIECE);
}

static void vb_mr_unref(struct kvt_tp_mr *mr)
{
    struct vb_tp *tp = mr->tp;

    if (mr->refs == 0)
        return;
    if (--mr->refs > 0)
        return;
    for (unsigned i = 0; i < (unsigned)tp->n_dev * mr->n_pieces; i++)
        if (mr->mr[i] != NULL && ibv_dereg_mr(mr->mr[i]) != 0)
            kvt_warn(VB_MOD, "ibv_dereg_mr: %s", strerror(errno));
    kvt_list_del(&mr->node);
    kvt_free(mr);
}

static void vb_rkey_unref(struct kvt_tp_rkey *rk)
{
    if (rk->refs == 0 || --rk->refs > 0)
        return;
    kvt_list_del(&rk->node);
    kvt_free(rk->win);
    kvt_free(rk);
}

/* Deallocates g's windows, then their registrations (the device serves none of
 * them once this returns; a registration with a window bound cannot go first). */
static void vb_grant_unbind(struct kvt_tp_grant *g)
{
    for (unsigned i = 0; i < g->n_mw; i++) {
        if (g->w[i].mw != NULL && ibv_dealloc_mw(g->w[i].mw) != 0)
            kvt_warn(VB_MOD, "ibv_dealloc_mw: %s", strerror(errno));
        g->w[i].mw = NULL;
        if (g->w[i].mr != NULL && ibv_dereg_mr(g->w[i].mr) != 0)
            kvt_warn(VB_MOD, "ibv_dereg_mr of a window's range: %s", strerror(errno));
        g->w[i].mr = NULL;
    }
}

static void vb_grant_free(struct kvt_tp_grant *g)
{
    vb_grant_unbind(g);
    kvt_list_del(&g->node);
    vb_mr_unref(g->mr);
    kvt_free(g);
}

/* ---- endpoints: failure, teardown, callbacks ---- */

/* Marks ep DYING with err (0: local close) and stops the device's work on it at once
 * (rdma_disconnect moves the QP to the error state). Idempotent. */
static void vb_ep_fail(struct vb_ep *ep, int err)
{
    if (ep->state == EP_DYING || ep->state == EP_DEAD)
        return;
    if (err != 0)
        kvt_debug(VB_MOD, "endpoint %p fails: %s", (void *)ep, strerror(-err));
    ep->err = err;
    /* The responder stops now, authorized or not: a QP in the error state answers
     * nothing (rdma_disconnect does not do it for a QP it did not create). */
    if (ep->qp != NULL) {
        struct ibv_qp_attr a = {.qp_state = IBV_QPS_ERR};

        ibv_modify_qp(ep->qp, &a, IBV_QP_STATE); /* errors ignored: destroyed next */
    }
    if (ep->id != NULL &&
        (ep->state == EP_CONNECTED || ep->state == EP_CONNECTING || ep->state == EP_ACCEPTING))
        rdma_disconnect(ep->id); /* errors ignored: we destroy the QP next */
    ep->state = EP_DYING;
}

static void vb_batch_finish(struct vb_batch *b, int status)
{
    struct vb_ep *ep = b->ep;

    if (b->on_pending) {
        kvt_list_del(&b->pnode);
        b->on_pending = false;
    }
    kvt_list_del(&b->node);
    ep->n_batches--;
    if (b->status == 0)
        b->status = status;
    kvt_list_add_tail(&ep->tp->done, &b->node);
}

/* Frees what the device uses for ep; the QP goes first (after ibv_destroy_qp the
 * device no longer touches any buffer of ep), then every batch completes. */
static void vb_ep_teardown(struct vb_ep *ep)
{
    struct vb_tp *tp = ep->tp;
    struct kvt_list *pos, *tmp;
    int berr = ep->err != 0 ? ep->err : -ECANCELED;

    /* Its exposures end with it, before the QP: a window bound to a QP holds the
     * QP (rxe's ibv_destroy_qp waits 50 s for it). The QP is in the error state
     * already, so no bind still queued runs. The unrevoked ones wait for their
     * revoke. */
    kvt_list_for_each_safe(pos, tmp, &ep->grants)
    {
        struct kvt_tp_grant *g = kvt_list_entry(pos, struct kvt_tp_grant, node);

        g->binding = false;
        if (g->revoked) {
            vb_grant_free(g);
            continue;
        }
        vb_grant_unbind(g);
        g->ep = NULL;
        kvt_list_del(&g->node);
        kvt_list_add_tail(&tp->grants, &g->node);
    }
    if (ep->qp != NULL && ibv_destroy_qp(ep->qp) != 0)
        kvt_warn(VB_MOD, "ibv_destroy_qp: %s", strerror(errno));
    ep->qp = NULL;
    if (ep->cq != NULL && ibv_destroy_cq(ep->cq) != 0)
        kvt_warn(VB_MOD, "ibv_destroy_cq: %s", strerror(errno));
    ep->cq = NULL;
    if (ep->buf_mr != NULL && ibv_dereg_mr(ep->buf_mr) != 0)
        kvt_warn(VB_MOD, "ibv_dereg_mr: %s", strerror(errno));
    ep->buf_mr = NULL;
    if (ep->id != NULL && rdma_destroy_id(ep->id) != 0)
        kvt_warn(VB_MOD, "rdma_destroy_id: %s", strerror(errno));
    ep->id = NULL;
    kvt_list_for_each_safe(pos, tmp, &ep->batches)
    {
        vb_batch_finish(kvt_list_entry(pos, struct vb_batch, node), berr);
    }
    kvt_free(ep->bufs);
    ep->bufs = NULL;
    kvt_free(ep->tx_free);
    ep->tx_free = NULL;
    kvt_free(ep->segs);
    ep->segs = NULL;
    kvt_free(ep->seg_free);
    ep->seg_free = NULL;
    ep->state = EP_DEAD;
    kvt_list_del(&ep->node);
    if (ep->announced) {
        kvt_list_add_tail(&tp->dead, &ep->node);
    } else {
        kvt_free(ep);
    }
}

static int vb_reap(struct vb_tp *tp)
{
    struct kvt_list *pos, *tmp;
    int n = 0;

    kvt_list_for_each_safe(pos, tmp, &tp->eps)
    {
        struct vb_ep *ep = kvt_list_entry(pos, struct vb_ep, node);

        if (ep->state == EP_DYING) {
            vb_ep_teardown(ep);
            n++;
        }
    }
    return n;
}

/* Runs the callbacks that are due: batch completions, then CLOSED. */
static int vb_dispatch(struct vb_tp *tp)
{
    int n = 0;

    while (!kvt_list_empty(&tp->done)) {
        struct vb_batch *b = kvt_list_entry(tp->done.next, struct vb_batch, node);

        kvt_list_del(&b->node);
        vb_rkey_unref(b->rk);
        vb_mr_unref(b->local);
        b->cb(b->arg, b->status);
        kvt_free(b);
        n++;
    }
    while (!kvt_list_empty(&tp->dead)) {
        struct vb_ep *ep = kvt_list_entry(tp->dead.next, struct vb_ep, node);

        kvt_list_del(&ep->node);
        if (tp->pub.cfg.cb.on_ep_state != NULL)
            tp->pub.cfg.cb.on_ep_state(tp->pub.cfg.cb.arg, &ep->pub, KVT_EP_CLOSED, ep->err);
        kvt_free(ep);
        n++;
    }
    return n;
}

/* ---- endpoint resources ---- */

static struct vb_dev *vb_dev_find(struct vb_tp *tp, struct ibv_context *ctx, unsigned *idx_p)
{
    for (int i = 0; i < tp->n_dev; i++)
        if (tp->devs[i].ctx == ctx) {
            *idx_p = (unsigned)i;
            return &tp->devs[i];
        }
    return NULL;
}

static struct vb_ep *vb_ep_alloc(struct vb_tp *tp)
{
    struct vb_ep *ep = kvt_calloc(1, sizeof(*ep));

    if (ep == NULL)
        return NULL;
    ep->pub.tp = &tp->pub;
    ep->tp = tp;
    kvt_list_init(&ep->node);
    kvt_list_init(&ep->batches);
    kvt_list_init(&ep->pending);
    kvt_list_init(&ep->grants);
    ep->deadline_ns = vb_now_ns() + (uint64_t)tp->pub.cfg.connect_timeout_ms * 1000000ull;
    return ep;
}

static uint8_t *vb_buf(struct vb_ep *ep, unsigned idx)
{
    return ep->bufs + (size_t)idx * ep->buf_sz;
}

static int vb_post_rx(struct vb_ep *ep, unsigned idx)
{
    struct ibv_sge sge = {
        .addr = (uintptr_t)vb_buf(ep, idx),
        .length = (uint32_t)ep->buf_sz,
        .lkey = ep->buf_mr->lkey,
    };
    struct ibv_recv_wr wr = {.wr_id = ((uint64_t)idx << 2) | WR_RX, .sg_list = &sge, .num_sge = 1};
    struct ibv_recv_wr *bad;

    return vb_ret(ibv_post_recv(ep->qp, &wr, &bad));
}

/* ---- queue pair states and access ---- */

/* What rdma_init_qp_attr computed for a transition, made ours: the access flags are
 * always set, and to IBV_ACCESS_REMOTE_READ only once the peer is authorized, else to
 * none (the kernel's CM gives remote write, read and atomics whenever the peer asked
 * for a read depth, already at INIT on the passive side). rd_dest/rd_init >= 0
 * replace the read depths (RTR's max_dest_rd_atomic, RTS's max_rd_atomic), as
 * librdmacm does with the accept's values. On an InfiniBand link the kernel may
 * return bits 21-23 (RoCE source MAC and VLAN) that modify_qp refuses there: dropped,
 * as librdmacm does. */
static void vb_qp_attr_restrict(struct ibv_qp_attr *a, int *mask, bool authorized, bool link_ib,
                                int rd_dest, int rd_init)
{
    a->qp_access_flags = authorized ? IBV_ACCESS_REMOTE_READ : 0;
    *mask |= IBV_QP_ACCESS_FLAGS;
    if (link_ib)
        *mask &= ~0xe00000;
    if (a->qp_state == IBV_QPS_RTR && rd_dest >= 0)
        a->max_dest_rd_atomic = (uint8_t)rd_dest;
    if (a->qp_state == IBV_QPS_RTS && rd_init >= 0)
        a->max_rd_atomic = (uint8_t)rd_init;
}

/* Moves ep's QP to state with the connection's attributes (path, PSNs, QP numbers,
 * timeouts: rdma_init_qp_attr) and our access flags. */
static int vb_qp_modify(struct vb_ep *ep, enum ibv_qp_state state, int rd_dest, int rd_init)
{
    struct ibv_qp_attr a;
    int mask = 0;

    memset(&a, 0, sizeof(a));
    a.qp_state = state;
    if (rdma_init_qp_attr(ep->id, &a, &mask) != 0)
        return vb_errno();
    vb_qp_attr_restrict(&a, &mask, ep->authorized, ep->link_ib, rd_dest, rd_init);
    return vb_ret(ibv_modify_qp(ep->qp, &a, mask));
}

/* RTR then RTS, once rdma_cm knows the peer (passive: its request; active: its
 * response). */
static int vb_qp_ready(struct vb_ep *ep, int rd_dest, int rd_init)
{
    int err = vb_qp_modify(ep, IBV_QPS_RTR, rd_dest, rd_init);

    return err != 0 ? err : vb_qp_modify(ep, IBV_QPS_RTS, rd_dest, rd_init);
}

/* Which step of an endpoint's setup failed, in the log (the caller logs only
 * the errno), with the sizes it asked for. */
static int vb_setup_err(const struct vb_ep *ep, const char *what, int err)
{
    kvt_warn(VB_MOD, "endpoint setup: %s failed (%s; %u receives, %u sends, %u READ WRs)", what,
             strerror(-err), ep->n_rx, ep->n_tx, ep->read_wr_max);
    return err;
}

/* Device, CQ, QP, buffers and posted receives for ep->id (its device is known:
 * after route resolution or in a connect request). */
static int vb_ep_setup(struct vb_ep *ep)
{
    struct vb_tp *tp = ep->tp;
    const struct kvt_transport_config *cfg = &tp->pub.cfg;
    struct ibv_port_attr pattr;
    struct ibv_qp_init_attr qa;
    unsigned sq, cqe;
    int err;

    ep->dev = vb_dev_find(tp, ep->id->verbs, &ep->dev_idx);
    if (ep->dev == NULL) {
        kvt_error(VB_MOD, "connection on a device rdma_get_devices did not list");
        return -ENODEV;
    }
    const struct ibv_device_attr *da = &ep->dev->attr;

    if (ibv_query_port(ep->id->verbs, ep->id->port_num, &pattr) != 0)
        return vb_setup_err(ep, "ibv_query_port", vb_errno());
    ep->max_msg_sz = pattr.max_msg_sz > 0 ? pattr.max_msg_sz : (1u << 30);
    ep->link_ib = pattr.link_layer == IBV_LINK_LAYER_INFINIBAND;
    ep->n_rx = cfg->recv_credits + 2;
    ep->n_tx = cfg->recv_credits + 2;
    if (da->max_qp_wr > 0 && (unsigned)da->max_qp_wr < ep->n_tx + 8) {
        kvt_error(VB_MOD, "recv_credits %u exceed the device's max_qp_wr %d", cfg->recv_credits,
                  da->max_qp_wr);
        return -EINVAL;
    }
    ep->read_wr_max = VB_READ_WR_MAX;
    ep->bind_wr_free = VB_BIND_WR_MAX;
    if (da->max_qp_wr > 0 && (unsigned)da->max_qp_wr < ep->n_tx + 8 + 2 * VB_BIND_WR_MAX)
        ep->bind_wr_free = ((unsigned)da->max_qp_wr - ep->n_tx) / 2;
    if (da->max_qp_wr > 0)
        ep->read_wr_max =
            KVT_MIN(ep->read_wr_max, (unsigned)da->max_qp_wr - ep->n_tx - ep->bind_wr_free);
    ep->max_sge = KVT_MIN(VB_MAX_SGE, da->max_sge > 0 ? (unsigned)da->max_sge : 1u);
    sq = ep->n_tx + ep->read_wr_max + ep->bind_wr_free;
    cqe = sq + ep->n_rx + 16;
    if (da->max_cqe > 0 && cqe > (unsigned)da->max_cqe)
        return vb_setup_err(ep, "the device's max_cqe", -EINVAL);

    ep->buf_sz = VB_HDR + cfg->max_msg_bytes;
    ep->bufs = kvt_calloc(ep->n_rx + ep->n_tx, ep->buf_sz);
    ep->tx_free = kvt_calloc(ep->n_tx, sizeof(unsigned));
    ep->segs = kvt_calloc(ep->read_wr_max + VB_BIND_SEGS, sizeof(struct vb_seg));
    ep->seg_free = kvt_calloc(ep->read_wr_max, sizeof(unsigned));
    if (ep->bufs == NULL || ep->tx_free == NULL || ep->segs == NULL || ep->seg_free == NULL)
        return -ENOMEM;
    for (unsigned i = 0; i < ep->n_tx; i++)
        ep->tx_free[i] = ep->n_rx + ep->n_tx - 1 - i;
    ep->n_tx_free = ep->n_tx;
    for (unsigned i = 0; i < ep->read_wr_max; i++)
        ep->seg_free[i] = ep->read_wr_max - 1 - i;
    ep->n_seg_free = ep->read_wr_max;
    ep->read_wr_free = ep->read_wr_max;
    for (unsigned i = 0; i < VB_BIND_SEGS; i++)
        ep->bind_seg_free[i] = ep->read_wr_max + VB_BIND_SEGS - 1 - i;
    ep->n_bind_seg_free = VB_BIND_SEGS;

    ep->buf_mr = ibv_reg_mr(ep->dev->pd, ep->bufs, (ep->n_rx + ep->n_tx) * ep->buf_sz,
                            IBV_ACCESS_LOCAL_WRITE);
    if (ep->buf_mr == NULL)
        return vb_setup_err(ep, "ibv_reg_mr", vb_errno());
    ep->cq = ibv_create_cq(ep->id->verbs, (int)cqe, ep, ep->dev->ch, 0);
    if (ep->cq == NULL)
        return vb_setup_err(ep, "ibv_create_cq", vb_errno());
    err = vb_ret(ibv_req_notify_cq(ep->cq, 0));
    if (err != 0)
        return vb_setup_err(ep, "ibv_req_notify_cq", err);

    memset(&qa, 0, sizeof(qa));
    qa.send_cq = ep->cq;
    qa.recv_cq = ep->cq;
    qa.qp_type = IBV_QPT_RC;
    qa.sq_sig_all = 0;
    qa.cap.max_send_wr = sq;
    qa.cap.max_recv_wr = ep->n_rx;
    qa.cap.max_send_sge = ep->max_sge;
    qa.cap.max_recv_sge = 1;
    ep->qp = ibv_create_qp(ep->dev->pd, &qa);
    if (ep->qp == NULL)
        return vb_setup_err(ep, "ibv_create_qp", vb_errno());
    if (qa.cap.max_send_sge < ep->max_sge)
        ep->max_sge = KVT_MAX(qa.cap.max_send_sge, 1u);
    err = vb_qp_modify(ep, IBV_QPS_INIT, -1, -1);
    if (err != 0)
        return vb_setup_err(ep, "the QP's INIT", err);

    for (unsigned i = 0; i < ep->n_rx; i++) {
        err = vb_post_rx(ep, i);
        if (err != 0)
            return vb_setup_err(ep, "ibv_post_recv", err);
    }
    ep->credit_threshold = KVT_MAX(1u, cfg->recv_credits / 2);
    return 0;
}

static void vb_hello_fill(struct vb_ep *ep, struct vb_hello *h)
{
    memset(h, 0, sizeof(*h));
    h->magic = htole32(VB_MAGIC);
    h->version = htole16(VB_VERSION);
    h->credits = htole32(ep->tp->pub.cfg.recv_credits);
    h->max_msg = htole32((uint32_t)ep->tp->pub.cfg.max_msg_bytes);
    h->guid = htole64(ep->dev->guid);
}

/* 0 and the peer's fields set, or -EPROTO. */
static int vb_hello_parse(struct vb_ep *ep, const void *data, size_t len)
{
    struct vb_hello h;

    if (data == NULL || len < sizeof(h))
        return -EPROTO;
    memcpy(&h, data, sizeof(h));
    if (le32toh(h.magic) != VB_MAGIC || le16toh(h.version) != VB_VERSION)
        return -EPROTO;
    if (le32toh(h.credits) == 0 || le32toh(h.credits) > VB_MAX_CREDITS || le32toh(h.max_msg) == 0)
        return -EPROTO;
    ep->tx_credits = ep->tx_credits_max = le32toh(h.credits);
    ep->peer_max_msg = le32toh(h.max_msg);
    ep->peer_guid = le64toh(h.guid);
    return 0;
}

/* req_resp, req_init (passive side): the connect request's responder_resources and
 * initiator_depth as the CONNECT_REQUEST event gives them, already from our side's
 * view (the CM swaps the requester's fields): req_resp is the read depth the
 * requester initiates (ours to answer), req_init the depth it answers (ours to use). */
static void vb_conn_param(struct vb_ep *ep, struct rdma_conn_param *p, struct vb_hello *h,
                          uint8_t req_resp, uint8_t req_init, bool passive)
{
    const struct ibv_device_attr *da = &ep->dev->attr;

    vb_hello_fill(ep, h);
    memset(p, 0, sizeof(*p));
    p->private_data = h;
    p->private_data_len = sizeof(*h);
    p->responder_resources = (uint8_t)KVT_MIN(da->max_qp_rd_atom, 255);
    p->initiator_depth = (uint8_t)KVT_MIN(da->max_qp_init_rd_atom, 255);
    if (passive) {
        p->responder_resources = KVT_MIN(p->responder_resources, req_resp);
        p->initiator_depth = KVT_MIN(p->initiator_depth, req_init);
    }
    p->retry_count = 7;
    p->rnr_retry_count = 7;
    p->qp_num = ep->qp->qp_num; /* our QP, not id->qp (see Access) */
}

/* ---- control messages ---- */

static int vb_send_raw(struct vb_ep *ep, uint8_t type, const void *buf, size_t len)
{
    struct vb_msg_hdr h = {.credits = htole32(ep->rx_owed), .type = type};
    unsigned idx;
    uint8_t *p;
    int err;

    assert(ep->n_tx_free > 0);
    idx = ep->tx_free[--ep->n_tx_free];
    if (ep->owe_ack)
        h.flags = VB_F_ACK;
    p = vb_buf(ep, idx);
    memcpy(p, &h, sizeof(h));
    if (len > 0)
        memcpy(p + VB_HDR, buf, len);

    struct ibv_sge sge = {
        .addr = (uintptr_t)p,
        .length = (uint32_t)(VB_HDR + len),
        .lkey = ep->buf_mr->lkey,
    };
    struct ibv_send_wr wr = {
        .wr_id = ((uint64_t)idx << 2) | WR_TX,
        .sg_list = &sge,
        .num_sge = 1,
        .opcode = IBV_WR_SEND,
        .send_flags = IBV_SEND_SIGNALED,
    };
    struct ibv_send_wr *bad;

    err = vb_ret(ibv_post_send(ep->qp, &wr, &bad));
    if (err != 0) {
        ep->tx_free[ep->n_tx_free++] = idx;
        vb_ep_fail(ep, err);
        return err;
    }
    ep->rx_owed = 0;
    ep->owe_ack = false;
    if (type == MSG_DATA)
        ep->tx_credits--;
    else if (type == MSG_CREDIT)
        ep->cm_out = true;
    return 0;
}

/* Returns credits and acks that no DATA message carried. */
static void vb_flush_credits(struct vb_ep *ep)
{
    if (ep->state != EP_CONNECTED || ep->n_tx_free == 0)
        return;
    if (ep->rx_owed >= ep->credit_threshold && !ep->cm_out)
        vb_send_raw(ep, MSG_CREDIT, NULL, 0);
    else if (ep->owe_ack)
        vb_send_raw(ep, MSG_ACK, NULL, 0);
}

static void vb_on_recv(struct vb_ep *ep, unsigned idx, uint32_t byte_len)
{
    struct vb_tp *tp = ep->tp;
    struct vb_msg_hdr h;
    const uint8_t *p = vb_buf(ep, idx);
    int err;

    if (byte_len < VB_HDR) {
        kvt_warn(VB_MOD, "a peer sent a %u-byte message", byte_len);
        vb_ep_fail(ep, -EPROTO);
        return;
    }
    memcpy(&h, p, sizeof(h));
    ep->tx_credits += le32toh(h.credits);
    if (h.flags & VB_F_ACK)
        ep->cm_out = false;
    switch (h.type) {
    case MSG_DATA:
        if (tp->pub.cfg.cb.on_msg != NULL)
            tp->pub.cfg.cb.on_msg(tp->pub.cfg.cb.arg, &ep->pub, p + VB_HDR, byte_len - VB_HDR);
        if (ep->state != EP_CONNECTED)
            return; /* closed in the callback: the buffer goes with the QP */
        ep->rx_owed++;
        break;
    case MSG_CREDIT:
        ep->owe_ack = true;
        break;
    case MSG_ACK:
        break;
    default:
        kvt_warn(VB_MOD, "a peer sent message type %u", h.type);
        vb_ep_fail(ep, -EPROTO);
        return;
    }
    err = vb_post_rx(ep, idx);
    if (err != 0)
        vb_ep_fail(ep, err);
}

/* ---- READ batches ---- */

/* Index of rk's window holding remote offset r, or -1 (binary search). */
static long vb_win_find(const struct kvt_tp_rkey *rk, uint64_t r)
{
    size_t lo = 0, hi = rk->n_win;

    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        const struct vb_win *w = &rk->win[mid];

        if (r < w->off)
            hi = mid;
        else if (r - w->off >= w->len)
            lo = mid + 1;
        else
            return (long)mid;
    }
    return -1;
}

/* The rkey for remote offset r (inside rk: checked by read()) and the end of the
 * piece or window it is valid in. */
static uint32_t vb_rkey_at(const struct kvt_tp_rkey *rk, uint64_t r, uint64_t *end_p)
{
    long w;

    if (rk->n_win == 0) {
        *end_p = (r / VB_PIECE + 1) * VB_PIECE;
        return rk->rkey[r / VB_PIECE];
    }
    w = vb_win_find(rk, r);
    assert(w >= 0);
    *end_p = rk->win[w].off + rk->win[w].len;
    return rk->win[w].rkey;
}

/* Is [off, off + len) inside rk: its length, and for windows, a run of them? */
static bool vb_rkey_covers(const struct kvt_tp_rkey *rk, uint64_t off, uint64_t len)
{
    long w;

    if (!vb_in_range(off, len, rk->len))
        return false;
    if (rk->n_win == 0)
        return true;
    w = vb_win_find(rk, off);
    if (w < 0)
        return false;
    for (uint64_t end = off + len;;) {
        uint64_t wend = rk->win[w].off + rk->win[w].len;

        if (end <= wend)
            return true;
        if ((uint32_t)++w >= rk->n_win || rk->win[w].off != wend)
            return false;
    }
}

/* Builds up to max_wr WRs of b from its cursor into ep->wrs; returns their count. */
static unsigned vb_build_wrs(struct vb_ep *ep, struct vb_batch *b, unsigned max_wr)
{
    const struct kvt_tp_rkey *rk = b->rk;
    const struct kvt_tp_mr *lm = b->local;
    unsigned nw = 0;

    while (nw < max_wr && b->cur_op < b->n) {
        struct ibv_send_wr *wr = &ep->wrs[nw];
        struct ibv_sge *sg = &ep->sges[nw * ep->max_sge];
        unsigned nsge = 0;
        uint64_t total = 0, next_r = 0, rend = 0;

        memset(wr, 0, sizeof(*wr));

        while (b->cur_op < b->n && nsge < ep->max_sge && total < ep->max_msg_sz) {
            const struct kvt_read_op *op = &b->ops[b->cur_op];
            uint64_t r = op->remote_off + b->cur_off;
            uint64_t l = op->local_off + b->cur_off;
            uint64_t take = op->len - b->cur_off;

            /* One WR reads inside one remote piece (or window): one rkey. */
            if (nsge == 0) {
                wr->wr.rdma.remote_addr = rk->page_off + r;
                wr->wr.rdma.rkey = vb_rkey_at(rk, r, &rend);
            } else if (r != next_r || r >= rend) {
                break;
            }
            take = KVT_MIN(take, rend - r);
            take = KVT_MIN(take, VB_PIECE - l % VB_PIECE);
            take = KVT_MIN(take, (uint64_t)ep->max_msg_sz - total);
            sg[nsge].addr = (uintptr_t)(lm->base + l);
            sg[nsge].length = (uint32_t)take;
            sg[nsge].lkey = lm->mr[ep->dev_idx * lm->n_pieces + l / VB_PIECE]->lkey;
            nsge++;
            total += take;
            next_r = r + take;
            b->cur_off += take;
            if (b->cur_off == op->len) {
                b->cur_op++;
                b->cur_off = 0;
            }
        }
        wr->sg_list = sg;
        wr->num_sge = (int)nsge;
        wr->opcode = IBV_WR_RDMA_READ;
        if (nw > 0)
            ep->wrs[nw - 1].next = wr;
        nw++;
    }
    return nw;
}

/* Posts what fits of the pending batches, oldest first. */
static void vb_pump(struct vb_ep *ep)
{
    while (ep->state == EP_CONNECTED && !kvt_list_empty(&ep->pending) && ep->read_wr_free > 0 &&
           ep->n_seg_free > 0) {
        struct vb_batch *b = kvt_list_entry(ep->pending.next, struct vb_batch, pnode);
        unsigned si = ep->seg_free[--ep->n_seg_free];
        struct vb_seg *seg = &ep->segs[si];
        struct ibv_send_wr *bad;
        unsigned nw;
        int err;

        nw = vb_build_wrs(ep, b, KVT_MIN(VB_SEG_WRS, ep->read_wr_free));
        assert(nw > 0);
        for (unsigned i = 0; i < nw; i++)
            ep->wrs[i].wr_id = ((uint64_t)si << 2) | WR_SEG;
        ep->wrs[nw - 1].wr_id |= WR_SEG_LAST;
        ep->wrs[nw - 1].send_flags = IBV_SEND_SIGNALED;
        seg->batch = b;
        seg->n_wr = nw;
        err = vb_ret(ibv_post_send(ep->qp, ep->wrs, &bad));
        if (err != 0) {
            kvt_error(VB_MOD, "ibv_post_send of %u RDMA READs: %s", nw, strerror(-err));
            b->status = err;
            vb_ep_fail(ep, err);
            return;
        }
        b->segs_out++;
        ep->read_wr_free -= nw;
        if (b->cur_op == b->n) {
            kvt_list_del(&b->pnode);
            b->on_pending = false;
        }
    }
}

/* A bind chain's WR completed (only the last one does, unless the QP failed). */
static void vb_on_bind(struct vb_ep *ep, unsigned si, bool last, int err)
{
    struct vb_seg *seg = &ep->segs[si];
    struct kvt_tp_grant *g = seg->grant;

    if (err != 0) {
        if (err != -ECANCELED)
            kvt_error(VB_MOD, "binding a memory window: %s", strerror(-err));
        vb_ep_fail(ep, err); /* its windows go with the endpoint */
    }
    if (!last || g == NULL)
        return;
    seg->grant = NULL;
    ep->bind_wr_free += seg->n_wr;
    ep->bind_seg_free[ep->n_bind_seg_free++] = si;
    g->binding = false;
    if (g->revoked)
        vb_grant_free(g);
}

static void vb_on_seg(struct vb_ep *ep, unsigned si, bool last, int err)
{
    struct vb_seg *seg = &ep->segs[si];
    struct vb_batch *b = seg->batch;

    if (seg->grant != NULL) { /* a bind chain (segs[read_wr_max..]) */
        vb_on_bind(ep, si, last, err);
        return;
    }
    if (err != 0) {
        if (b != NULL && b->status == 0 && err != -ECANCELED)
            b->status = err;
        vb_ep_fail(ep, err);
    }
    if (!last || b == NULL)
        return;
    seg->batch = NULL;
    ep->read_wr_free += seg->n_wr;
    ep->seg_free[ep->n_seg_free++] = si;
    b->segs_out--;
    if (!b->on_pending && b->segs_out == 0 && ep->state == EP_CONNECTED)
        vb_batch_finish(b, 0);
}

/* ---- completion queue ---- */

static int vb_poll_ep(struct vb_ep *ep)
{
    struct ibv_wc wc[VB_POLL_BATCH];
    int n, total = 0;

    while (ep->state == EP_CONNECTED) {
        n = ibv_poll_cq(ep->cq, VB_POLL_BATCH, wc);
        if (n < 0) {
            vb_ep_fail(ep, -EIO);
            break;
        }
        if (n == 0)
            break;
        for (int i = 0; i < n; i++) {
            unsigned idx = (unsigned)(wc[i].wr_id >> 2);
            int kind = (int)(wc[i].wr_id & 3);
            int err = kind == WR_RX || kind == WR_TX ? vb_wc_err(wc[i].status)
                                                     : vb_read_wc_err(wc[i].status);

            total++;
            if (err != 0 && err != -ECANCELED)
                kvt_warn(VB_MOD, "work completion error: %s (%s)", ibv_wc_status_str(wc[i].status),
                         strerror(-err));
            switch (kind) {
            case WR_RX:
                if (err == -ECANCELED && ep->state == EP_CONNECTED && !ep->authorized) {
                    /* Flushed while we had not stopped the QP: the device did, after
                     * a bad request of the peer; before authorization that is an
                     * RDMA request the access gate refused (rxe answers remote
                     * invalid request and moves our QP to the error state). */
                    kvt_warn(VB_MOD, "closing an endpoint not yet authorized: its peer sent an "
                                     "RDMA request the device refused (a READ before the "
                                     "handshake?)");
                    ep->tp->ctr.refused[KVT_TP_READ_UNAUTH]++;
                    err = -EACCES;
                }
                if (err != 0)
                    vb_ep_fail(ep, err);
                else if (ep->state == EP_CONNECTED)
                    vb_on_recv(ep, idx, wc[i].byte_len);
                break;
            case WR_TX:
                ep->tx_free[ep->n_tx_free++] = idx;
                if (err != 0)
                    vb_ep_fail(ep, err);
                break;
            default:
                vb_on_seg(ep, idx, kind == WR_SEG_LAST, err);
                break;
            }
        }
    }
    return total;
}

/* Reads every completion channel notification and re-arms its CQ. */
static void vb_drain_channels(struct vb_tp *tp)
{
    for (int d = 0; d < tp->n_dev; d++) {
        struct ibv_cq *cq;
        void *ctx;

        while (ibv_get_cq_event(tp->devs[d].ch, &cq, &ctx) == 0) {
            struct vb_ep *ep = ctx;

            ibv_ack_cq_events(cq, 1);
            ep->cq_event = true;
        }
    }
}

/* ---- connection manager events ---- */

/* Accepted endpoints alive and not yet authorized. */
static unsigned vb_preauth_count(struct vb_tp *tp)
{
    struct kvt_list *pos, *tmp;
    unsigned n = 0;

    kvt_list_for_each_safe(pos, tmp, &tp->eps)
    {
        struct vb_ep *ep = kvt_list_entry(pos, struct vb_ep, node);

        n += ep->passive && !ep->authorized && ep->state < EP_DYING;
    }
    return n;
}

static void vb_on_connect_request(struct vb_tp *tp, struct rdma_cm_id *id, const void *pdata,
                                  size_t plen, uint8_t req_resp, uint8_t req_init)
{
    struct rdma_conn_param param;
    struct vb_hello hello;
    struct vb_ep *ep;
    int err;

    if (tp->closing) {
        rdma_reject(id, NULL, 0);
        rdma_destroy_id(id);
        return;
    }
    /* An accepted endpoint registers its message buffers (recv_credits of
     * max_msg_bytes each way) before its peer proved anything: at most max_preauth
     * of them at once, the rest refused and counted like the UCX backend's. */
    if (vb_preauth_count(tp) >= tp->pub.cfg.max_preauth) {
        if (tp->ctr.refused[KVT_TP_PREAUTH_CONNS]++ == 0)
            kvt_warn(VB_MOD,
                     "%u accepted connections not yet authorized: more are refused "
                     "(counted, logged once)",
                     tp->pub.cfg.max_preauth);
        rdma_reject(id, NULL, 0);
        rdma_destroy_id(id);
        return;
    }
    ep = vb_ep_alloc(tp);
    if (ep == NULL) {
        rdma_reject(id, NULL, 0);
        rdma_destroy_id(id);
        return;
    }
    ep->id = id;
    id->context = ep;
    ep->passive = true;
    ep->state = EP_ACCEPTING;
    kvt_list_add_tail(&tp->eps, &ep->node);
    err = vb_hello_parse(ep, pdata, plen);
    if (err != 0) {
        kvt_warn(VB_MOD, "refusing a connection request with a bad handshake");
        rdma_reject(id, NULL, 0);
        ep->state = EP_RESOLVING;
        vb_ep_fail(ep, err);
        return;
    }
    err = vb_ep_setup(ep);
    if (err != 0) {
        kvt_error(VB_MOD, "setting up an accepted endpoint: %s", strerror(-err));
        rdma_reject(id, NULL, 0);
        ep->state = EP_RESOLVING;
        vb_ep_fail(ep, err);
        return;
    }
    vb_conn_param(ep, &param, &hello, req_resp, req_init, true);
    err = vb_qp_ready(ep, param.responder_resources, param.initiator_depth);
    if (err != 0) {
        kvt_error(VB_MOD, "moving an accepted QP to RTS: %s", strerror(-err));
        rdma_reject(id, NULL, 0);
        ep->state = EP_RESOLVING;
        vb_ep_fail(ep, err);
        return;
    }
    if (rdma_accept(id, &param) != 0) {
        err = vb_errno();
        kvt_error(VB_MOD, "rdma_accept: %s", strerror(-err));
        vb_ep_fail(ep, err);
    }
}

/* Active side: the server accepted. Our QP goes to RTR and RTS (read depths as the
 * CM negotiated them), then rdma_establish sends the RTU: connected. */
static void vb_on_connect_response(struct vb_tp *tp, struct vb_ep *ep, const void *pdata,
                                   size_t plen)
{
    const struct kvt_tp_callbacks *cb = &tp->pub.cfg.cb;
    int err;

    if (ep->state != EP_CONNECTING)
        return;
    err = vb_hello_parse(ep, pdata, plen);
    if (err != 0) {
        kvt_warn(VB_MOD, "the server's handshake is bad");
        vb_ep_fail(ep, err);
        return;
    }
    err = vb_qp_ready(ep, -1, -1);
    if (err == 0 && rdma_establish(ep->id) != 0)
        err = vb_errno();
    if (err != 0) {
        kvt_warn(VB_MOD, "completing a connection (RTR, RTS, rdma_establish): %s", strerror(-err));
        vb_ep_fail(ep, err);
        return;
    }
    ep->state = EP_CONNECTED;
    ep->was_connected = true;
    if (cb->on_ep_state != NULL)
        cb->on_ep_state(cb->arg, &ep->pub, KVT_EP_CONNECTED, 0);
}

/* Passive side: the client's RTU arrived. */
static void vb_on_established(struct vb_tp *tp, struct vb_ep *ep)
{
    const struct kvt_tp_callbacks *cb = &tp->pub.cfg.cb;
    int err;

    if (ep->state == EP_ACCEPTING) {
        ep->state = EP_CONNECTED;
        ep->was_connected = true;
        err = cb->on_accept != NULL ? cb->on_accept(cb->arg, &ep->pub) : -ECONNREFUSED;
        if (err < 0) {
            vb_ep_fail(ep, err);
            return;
        }
        ep->announced = true;
    }
}

static void vb_on_cm_event(struct vb_tp *tp, struct rdma_cm_event *ev)
{
    enum rdma_cm_event_type type = ev->event;
    struct rdma_cm_id *id = ev->id;
    int status = ev->status;
    uint8_t pdata[64];
    size_t plen = 0;
    uint8_t req_resp = 0, req_init = 0;
    struct vb_ep *ep;
    int err;

    if (ev->param.conn.private_data != NULL) {
        plen = KVT_MIN((size_t)ev->param.conn.private_data_len, sizeof(pdata));
        memcpy(pdata, ev->param.conn.private_data, plen);
    }
    req_resp = ev->param.conn.responder_resources;
    req_init = ev->param.conn.initiator_depth;
    rdma_ack_cm_event(ev);
    kvt_debug(VB_MOD, "%s (status %d)", rdma_event_str(type), status);

    if (type == RDMA_CM_EVENT_CONNECT_REQUEST) {
        vb_on_connect_request(tp, id, plen ? pdata : NULL, plen, req_resp, req_init);
        return;
    }
    if (id == tp->listen_id || id->context == NULL)
        return; /* listener events (device removal): nothing to do per endpoint */
    ep = id->context;
    if (ep->state == EP_DYING || ep->state == EP_DEAD)
        return;

    switch (type) {
    case RDMA_CM_EVENT_ADDR_RESOLVED:
        if (rdma_resolve_route(id, (int)tp->pub.cfg.connect_timeout_ms) != 0)
            vb_ep_fail(ep, vb_errno());
        break;
    case RDMA_CM_EVENT_ROUTE_RESOLVED: {
        struct rdma_conn_param param;
        struct vb_hello hello;

        err = vb_ep_setup(ep);
        if (err != 0) {
            kvt_error(VB_MOD, "setting up an endpoint: %s", strerror(-err));
            vb_ep_fail(ep, err);
            break;
        }
        vb_conn_param(ep, &param, &hello, 0, 0, false);
        ep->state = EP_CONNECTING;
        if (rdma_connect(id, &param) != 0) {
            err = vb_errno();
            ep->state = EP_RESOLVING; /* nothing to disconnect */
            vb_ep_fail(ep, err);
        }
        break;
    }
    case RDMA_CM_EVENT_CONNECT_RESPONSE:
        vb_on_connect_response(tp, ep, plen ? pdata : NULL, plen);
        break;
    case RDMA_CM_EVENT_ESTABLISHED:
        vb_on_established(tp, ep);
        break;
    case RDMA_CM_EVENT_DISCONNECTED:
        if (ep->state == EP_CONNECTED)
            vb_poll_ep(ep); /* what the peer sent before it left is delivered */
        vb_ep_fail(ep, -ECONNRESET);
        break;
    case RDMA_CM_EVENT_ADDR_ERROR:
    case RDMA_CM_EVENT_ROUTE_ERROR:
    case RDMA_CM_EVENT_UNREACHABLE:
    case RDMA_CM_EVENT_REJECTED:
    case RDMA_CM_EVENT_CONNECT_ERROR:
    case RDMA_CM_EVENT_DEVICE_REMOVAL:
        err = vb_cm_err(type, status);
        kvt_debug(VB_MOD, "%s: %s", rdma_event_str(type), strerror(-err));
        if (type != RDMA_CM_EVENT_DEVICE_REMOVAL && ep->state != EP_CONNECTED)
            ep->state = EP_RESOLVING; /* the connection never was: nothing to disconnect */
        vb_ep_fail(ep, err);
        break;
    default:
        break; /* TIMEWAIT_EXIT, ADDR_CHANGE, ... */
    }
}

static int vb_drain_cm(struct vb_tp *tp)
{
    struct rdma_cm_event *ev;
    int n = 0;

    while (rdma_get_cm_event(tp->ech, &ev) == 0) {
        vb_on_cm_event(tp, ev);
        n++;
    }
    return n;
}

static void vb_check_timeouts(struct vb_tp *tp, uint64_t now)
{
    uint64_t op_ns = (uint64_t)tp->pub.cfg.op_timeout_ms * 1000000ull;
    struct kvt_list *pos, *tmp;

    kvt_list_for_each_safe(pos, tmp, &tp->eps)
    {
        struct vb_ep *ep = kvt_list_entry(pos, struct vb_ep, node);

        if (ep->state == EP_RESOLVING || ep->state == EP_CONNECTING || ep->state == EP_ACCEPTING) {
            if (now >= ep->deadline_ns)
                vb_ep_fail(ep, -ETIMEDOUT);
        } else if (ep->state == EP_CONNECTED && !kvt_list_empty(&ep->batches)) {
            struct vb_batch *b = kvt_list_entry(ep->batches.next, struct vb_batch, node);

            if (now >= b->start_ns + op_ns) {
                kvt_warn(VB_MOD, "a READ batch is older than %u ms", tp->pub.cfg.op_timeout_ms);
                b->status = -ETIMEDOUT;
                vb_ep_fail(ep, -ETIMEDOUT);
            }
        }
    }
}

/* ---- ops ---- */

static void vb_close(struct kvt_transport *t);

static int vb_open(const struct kvt_transport_config *cfg, struct kvt_transport **tp_p)
{
    struct vb_tp *tp;
    struct epoll_event ee = {.events = EPOLLIN};
    int err;

    if (cfg == NULL || tp_p == NULL)
        return -EINVAL;
    tp = kvt_calloc(1, sizeof(*tp));
    if (tp == NULL)
        return -ENOMEM;
    tp->pub.ops = &kvt_verbs_transport_ops;
    tp->pub.cfg = *cfg;
    kvt_transport_config_defaults(&tp->pub.cfg);
    tp->epfd = tp->tfd = -1;
    kvt_list_init(&tp->eps);
    kvt_list_init(&tp->dead);
    kvt_list_init(&tp->done);
    kvt_list_init(&tp->mrs);
    kvt_list_init(&tp->rkeys);
    kvt_list_init(&tp->grants);
    if (tp->pub.cfg.max_msg_bytes > VB_MAX_MSG_CAP || tp->pub.cfg.recv_credits > VB_MAX_CREDITS) {
        kvt_free(tp);
        return -EINVAL;
    }

    tp->ctx_list = rdma_get_devices(&tp->n_dev);
    if (tp->ctx_list == NULL || tp->n_dev <= 0) {
        kvt_error(VB_MOD, "no RDMA device (rdma_get_devices found none)");
        err = -ENODEV;
        goto fail;
    }
    tp->devs = kvt_calloc((size_t)tp->n_dev, sizeof(*tp->devs));
    if (tp->devs == NULL) {
        err = -ENOMEM;
        goto fail;
    }
    tp->epfd = epoll_create1(EPOLL_CLOEXEC);
    tp->tfd = timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC);
    if (tp->epfd < 0 || tp->tfd < 0) {
        err = vb_errno();
        goto fail;
    }
    ee.data.fd = tp->tfd;
    if (epoll_ctl(tp->epfd, EPOLL_CTL_ADD, tp->tfd, &ee) != 0) {
        err = vb_errno();
        goto fail;
    }
    for (int i = 0; i < tp->n_dev; i++) {
        struct vb_dev *d = &tp->devs[i];

        d->ctx = tp->ctx_list[i];
        if (ibv_query_device(d->ctx, &d->attr) != 0) {
            err = vb_errno();
            goto fail;
        }
        d->guid = be64toh(d->attr.node_guid);
        d->pd = ibv_alloc_pd(d->ctx);
        d->ch = d->pd != NULL ? ibv_create_comp_channel(d->ctx) : NULL;
        if (d->ch == NULL) {
            err = vb_errno();
            kvt_error(VB_MOD, "PD or completion channel on %s: %s",
                      ibv_get_device_name(d->ctx->device), strerror(-err));
            goto fail;
        }
        err = vb_set_nonblock(d->ch->fd);
        if (err != 0)
            goto fail;
        ee.data.fd = d->ch->fd;
        if (epoll_ctl(tp->epfd, EPOLL_CTL_ADD, d->ch->fd, &ee) != 0) {
            err = vb_errno();
            goto fail;
        }
    }
    tp->ech = rdma_create_event_channel();
    if (tp->ech == NULL) {
        err = vb_errno();
        goto fail;
    }
    err = vb_set_nonblock(tp->ech->fd);
    if (err != 0)
        goto fail;
    ee.data.fd = tp->ech->fd;
    if (epoll_ctl(tp->epfd, EPOLL_CTL_ADD, tp->ech->fd, &ee) != 0) {
        err = vb_errno();
        goto fail;
    }
    *tp_p = &tp->pub;
    return 0;

fail:
    vb_close(&tp->pub);
    return err;
}

static void vb_close(struct kvt_transport *t)
{
    struct vb_tp *tp = tp_of(t);
    struct kvt_list *pos, *tmp;

    tp->closing = true;
    if (tp->listen_id != NULL) {
        rdma_destroy_id(tp->listen_id);
        tp->listen_id = NULL;
    }
    /* Every endpoint goes now; callbacks may close more (they become DYING too). */
    for (int round = 0; round < VB_REAP_ROUNDS; round++) {
        kvt_list_for_each_safe(pos, tmp, &tp->eps)
        {
            vb_ep_fail(kvt_list_entry(pos, struct vb_ep, node), 0);
        }
        int n = vb_reap(tp);
        n += vb_dispatch(tp);
        if (n == 0 && kvt_list_empty(&tp->eps))
            break;
    }
    kvt_list_for_each_safe(pos, tmp, &tp->grants)
    {
        kvt_warn(VB_MOD, "close: an exposure was never revoked");
        vb_grant_free(kvt_list_entry(pos, struct kvt_tp_grant, node));
    }
    kvt_list_for_each_safe(pos, tmp, &tp->rkeys)
    {
        struct kvt_tp_rkey *rk = kvt_list_entry(pos, struct kvt_tp_rkey, node);

        rk->refs = 1;
        vb_rkey_unref(rk);
    }
    kvt_list_for_each_safe(pos, tmp, &tp->mrs)
    {
        struct kvt_tp_mr *mr = kvt_list_entry(pos, struct kvt_tp_mr, node);

        kvt_warn(VB_MOD, "close: a registration of %zu bytes was never deregistered", mr->len);
        mr->refs = 1;
        vb_mr_unref(mr);
    }
    if (tp->ech != NULL)
        rdma_destroy_event_channel(tp->ech);
    for (int i = 0; tp->devs != NULL && i < tp->n_dev; i++) {
        if (tp->devs[i].ch != NULL)
            ibv_destroy_comp_channel(tp->devs[i].ch);
        if (tp->devs[i].pd != NULL)
            ibv_dealloc_pd(tp->devs[i].pd);
    }
    kvt_free(tp->devs);
    if (tp->ctx_list != NULL)
        rdma_free_devices(tp->ctx_list);
    if (tp->tfd >= 0)
        close(tp->tfd);
    if (tp->epfd >= 0)
        close(tp->epfd);
    kvt_free(tp);
}

static int vb_sockaddr(const char *addr, uint16_t port, bool passive, struct sockaddr_storage *ss)
{
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM};
    struct addrinfo *res;
    char pstr[8];

    if (passive)
        hints.ai_flags = AI_PASSIVE;
    hints.ai_flags |= AI_NUMERICSERV;
    snprintf(pstr, sizeof(pstr), "%u", port);
    if (getaddrinfo(addr, pstr, &hints, &res) != 0 || res == NULL)
        return -EINVAL;
    memcpy(ss, res->ai_addr, res->ai_addrlen);
    freeaddrinfo(res);
    return 0;
}

static int vb_listen(struct kvt_transport *t, const char *addr, uint16_t port, uint16_t *port_p)
{
    struct vb_tp *tp = tp_of(t);
    struct sockaddr_storage ss;
    int err;

    if (tp->closing)
        return -ESHUTDOWN;
    if (tp->listen_id != NULL)
        return -EBUSY;
    err = vb_sockaddr(addr, port, true, &ss);
    if (err != 0)
        return err;
    if (rdma_create_id(tp->ech, &tp->listen_id, NULL, RDMA_PS_TCP) != 0)
        return vb_errno();
    if (rdma_bind_addr(tp->listen_id, (struct sockaddr *)&ss) != 0 ||
        rdma_listen(tp->listen_id, 128) != 0) {
        err = vb_errno();
        kvt_error(VB_MOD, "listen on %s:%u: %s", addr != NULL ? addr : "*", port, strerror(-err));
        rdma_destroy_id(tp->listen_id);
        tp->listen_id = NULL;
        return err;
    }
    if (port_p != NULL)
        *port_p = ntohs(rdma_get_src_port(tp->listen_id));
    return 0;
}

static int vb_connect(struct kvt_transport *t, const char *addr, uint16_t port, void *user,
                      struct kvt_tp_ep **ep_p)
{
    struct vb_tp *tp = tp_of(t);
    struct sockaddr_storage ss;
    struct vb_ep *ep;
    int err;

    if (tp->closing)
        return -ESHUTDOWN;
    if (addr == NULL || port == 0 || ep_p == NULL)
        return -EINVAL;
    err = vb_sockaddr(addr, port, false, &ss);
    if (err != 0)
        return err;
    ep = vb_ep_alloc(tp);
    if (ep == NULL)
        return -ENOMEM;
    ep->pub.user = user;
    ep->state = EP_RESOLVING;
    if (rdma_create_id(tp->ech, &ep->id, ep, RDMA_PS_TCP) != 0) {
        err = vb_errno();
        kvt_free(ep);
        return err;
    }
    if (rdma_resolve_addr(ep->id, NULL, (struct sockaddr *)&ss,
                          (int)tp->pub.cfg.connect_timeout_ms) != 0) {
        err = vb_errno();
        rdma_destroy_id(ep->id);
        kvt_free(ep);
        return err;
    }
    ep->announced = true;
    kvt_list_add_tail(&tp->eps, &ep->node);
    *ep_p = &ep->pub;
    return 0;
}

static void vb_ep_close(struct kvt_tp_ep *pep)
{
    struct vb_ep *ep = ep_of(pep);

    vb_ep_fail(ep, 0);
}

static int vb_send(struct kvt_tp_ep *pep, const void *buf, size_t len)
{
    struct vb_ep *ep = ep_of(pep);

    if (ep->state != EP_CONNECTED)
        return -ENOTCONN;
    if (buf == NULL && len > 0)
        return -EINVAL;
    if (len > ep->tp->pub.cfg.max_msg_bytes || len > ep->peer_max_msg)
        return -EMSGSIZE;
    /* Two send buffers stay for CREDIT and ACK messages. */
    if (ep->tx_credits == 0 || ep->n_tx_free <= 2)
        return -EAGAIN;
    return vb_send_raw(ep, MSG_DATA, buf, len);
}

static int vb_send_room(struct kvt_tp_ep *pep, unsigned *room, unsigned *cap)
{
    struct vb_ep *ep = ep_of(pep);

    if (ep->state != EP_CONNECTED)
        return -ENOTCONN;
    *room = KVT_MIN(ep->tx_credits, ep->n_tx_free > 2 ? ep->n_tx_free - 2 : 0);
    *cap = KVT_MIN(ep->tx_credits_max, ep->n_tx - 2);
    return 0;
}

/* remote: peers READ it through the QP's gate (reg_remote); granted: through
 * windows alone (reg_granted: MW_BIND, no remote access of its own). */
static int vb_reg(struct vb_tp *tp, void *base, size_t len, bool remote, bool granted,
                  struct kvt_tp_mr **mr_p)
{
    struct kvt_tp_mr *mr;
    uint32_t np;
    int err;

    if (base == NULL || len == 0 || mr_p == NULL)
        return -EINVAL;
    if (tp->closing)
        return -ESHUTDOWN;
    np = vb_n_pieces(len);
    mr = kvt_calloc(1, sizeof(*mr) + (size_t)tp->n_dev * np * sizeof(struct ibv_mr *));
    if (mr == NULL)
        return -ENOMEM;
    mr->tp = tp;
    mr->remote = remote;
    mr->granted = granted;
    mr->base = base;
    mr->len = len;
    mr->n_pieces = np;
    mr->page_off = (uint32_t)((uintptr_t)base & 4095u);
    mr->refs = 1;
    kvt_list_add_tail(&tp->mrs, &mr->node);
    for (int d = 0; d < tp->n_dev; d++) {
        for (uint32_t k = 0; k < np; k++) {
            uint8_t *p = mr->base + (uint64_t)k * VB_PIECE;
            size_t plen = KVT_MIN((uint64_t)len - (uint64_t)k * VB_PIECE, VB_PIECE);
            struct ibv_mr **slot = &mr->mr[(size_t)d * np + k];

            if (remote)
                *slot =
                    ibv_reg_mr_iova(tp->devs[d].pd, p, plen, mr->page_off + (uint64_t)k * VB_PIECE,
                                    granted ? 0 : IBV_ACCESS_REMOTE_READ);
            else
                *slot = ibv_reg_mr(tp->devs[d].pd, p, plen, IBV_ACCESS_LOCAL_WRITE);
            if (*slot == NULL) {
                err = vb_errno();
                kvt_error(VB_MOD, "registering %zu bytes (%s): %s", plen,
                          granted  ? "no remote access"
                          : remote ? "remote read"
                                   : "local write",
                          strerror(-err));
                vb_mr_unref(mr);
                return err;
            }
        }
    }
    *mr_p = mr;
    return 0;
}

static int vb_reg_remote(struct kvt_transport *t, void *base, size_t len, struct kvt_tp_mr **mr_p)
{
    return vb_reg(tp_of(t), base, len, true, false, mr_p);
}

static int vb_reg_granted(struct kvt_transport *t, void *base, size_t len, struct kvt_tp_mr **mr_p)
{
    return vb_reg(tp_of(t), base, len, true, true, mr_p);
}

static int vb_reg_local(struct kvt_transport *t, void *base, size_t len, struct kvt_tp_mr **mr_p)
{
    return vb_reg(tp_of(t), base, len, false, false, mr_p);
}

static void vb_dereg(struct kvt_tp_mr *mr)
{
    if (mr != NULL)
        vb_mr_unref(mr);
}

static int vb_pack(struct kvt_tp_mr *mr, void *buf, size_t cap, size_t *len_p)
{
    struct vb_tp *tp;
    struct vb_handle_hdr h;
    size_t need;
    uint8_t *p = buf;

    if (mr == NULL || buf == NULL || len_p == NULL || !mr->remote)
        return -EINVAL;
    tp = mr->tp;
    need = sizeof(h) + (size_t)tp->n_dev * (8 + 4 * (size_t)mr->n_pieces);
    if (need > KVT_TP_MAX_HANDLE_SIZE)
        return -EMSGSIZE;
    if (cap < need)
        return -ENOSPC;
    h.magic = htole32(VB_HANDLE_MAGIC);
    h.version = htole16(VB_VERSION);
    h.n_dev = htole16((uint16_t)tp->n_dev);
    h.len = htole64(mr->len);
    h.page_off = htole32(mr->page_off);
    h.n_pieces = htole32(mr->n_pieces);
    memcpy(p, &h, sizeof(h));
    p += sizeof(h);
    for (int d = 0; d < tp->n_dev; d++) {
        uint64_t g = htole64(tp->devs[d].guid);

        memcpy(p, &g, 8);
        p += 8;
        for (uint32_t k = 0; k < mr->n_pieces; k++) {
            uint32_t rkey = htole32(mr->mr[(size_t)d * mr->n_pieces + k]->rkey);

            memcpy(p, &rkey, 4);
            p += 4;
        }
    }
    *len_p = need;
    return 0;
}

/* An expose handle: windows sorted, disjoint, each non-empty and inside one piece
 * of a registration of len bytes, on the device ep reaches. */
static int vb_unpack_grant(struct vb_ep *ep, const void *buf, size_t len, struct kvt_tp_rkey **rk_p)
{
    struct vb_grant_hdr h;
    struct kvt_tp_rkey *rk;
    const uint8_t *p = buf;
    uint64_t rlen, prev_end = 0;
    uint32_t nw;

    if (len < sizeof(h))
        return -EPROTO;
    memcpy(&h, p, sizeof(h));
    nw = le16toh(h.n_win);
    rlen = le64toh(h.len);
    if (le16toh(h.version) != VB_VERSION || nw == 0 || nw > KVT_TP_MAX_EXPOSE_RANGES ||
        len != sizeof(h) + (size_t)nw * sizeof(struct vb_win_wire) || rlen == 0 ||
        le32toh(h.page_off) > 4095)
        return -EPROTO;
    if (le64toh(h.guid) != ep->peer_guid)
        return -ENODEV;
    rk = kvt_calloc(1, sizeof(*rk));
    if (rk == NULL)
        return -ENOMEM;
    rk->win = kvt_calloc(nw, sizeof(*rk->win));
    if (rk->win == NULL) {
        kvt_free(rk);
        return -ENOMEM;
    }
    p += sizeof(h);
    for (uint32_t i = 0; i < nw; i++, p += sizeof(struct vb_win_wire)) {
        struct vb_win_wire w;
        struct vb_win *v = &rk->win[i];

        memcpy(&w, p, sizeof(w));
        v->off = le64toh(w.off);
        v->len = le32toh(w.len);
        v->rkey = le32toh(w.rkey);
        if (v->len == 0 || !vb_in_range(v->off, v->len, rlen) || (i > 0 && v->off < prev_end) ||
            v->off / VB_PIECE != (v->off + v->len - 1) / VB_PIECE) {
            kvt_free(rk->win);
            kvt_free(rk);
            return -EPROTO;
        }
        prev_end = v->off + v->len;
    }
    rk->tp = ep->tp;
    rk->guid = ep->peer_guid;
    rk->len = rlen;
    rk->page_off = le32toh(h.page_off);
    rk->n_win = nw;
    rk->refs = 1;
    kvt_list_add_tail(&ep->tp->rkeys, &rk->node);
    *rk_p = rk;
    return 0;
}

static int vb_unpack(struct kvt_tp_ep *pep, const void *buf, size_t len, struct kvt_tp_rkey **rk_p)
{
    struct vb_ep *ep = ep_of(pep);
    struct vb_handle_hdr h;
    struct kvt_tp_rkey *rk;
    const uint8_t *p = buf;
    uint64_t rlen;
    uint32_t np, nd;
    size_t per_dev;

    if (buf == NULL || rk_p == NULL)
        return -EINVAL;
    if (ep->state != EP_CONNECTED)
        return -ENOTCONN;
    if (len < sizeof(h) || len > KVT_TP_MAX_HANDLE_SIZE)
        return -EPROTO;
    memcpy(&h, p, sizeof(h));
    if (le32toh(h.magic) == VB_GRANT_MAGIC)
        return vb_unpack_grant(ep, buf, len, rk_p);
    rlen = le64toh(h.len);
    np = le32toh(h.n_pieces);
    nd = le16toh(h.n_dev);
    if (le32toh(h.magic) != VB_HANDLE_MAGIC || le16toh(h.version) != VB_VERSION || rlen == 0 ||
        nd == 0 || np == 0 || np > KVT_TP_MAX_HANDLE_SIZE / 4 || np != vb_n_pieces(rlen) ||
        le32toh(h.page_off) > 4095)
        return -EPROTO;
    per_dev = 8 + 4 * (size_t)np;
    if (len != sizeof(h) + nd * per_dev)
        return -EPROTO;
    p += sizeof(h);
    for (uint32_t d = 0; d < nd; d++, p += per_dev) {
        uint64_t g;

        memcpy(&g, p, 8);
        if (le64toh(g) != ep->peer_guid)
            continue;
        rk = kvt_calloc(1, sizeof(*rk) + np * sizeof(uint32_t));
        if (rk == NULL)
            return -ENOMEM;
        rk->tp = ep->tp;
        rk->guid = ep->peer_guid;
        rk->len = rlen;
        rk->page_off = le32toh(h.page_off);
        rk->n_pieces = np;
        rk->refs = 1;
        for (uint32_t k = 0; k < np; k++) {
            uint32_t v;

            memcpy(&v, p + 8 + 4 * (size_t)k, 4);
            rk->rkey[k] = le32toh(v);
        }
        kvt_list_add_tail(&ep->tp->rkeys, &rk->node);
        *rk_p = rk;
        return 0;
    }
    return -ENODEV; /* no rkeys for the device this endpoint reaches */
}

static void vb_rkey_destroy(struct kvt_tp_rkey *rk)
{
    if (rk != NULL)
        vb_rkey_unref(rk);
}

static int vb_read(struct kvt_tp_ep *pep, struct kvt_tp_rkey *rk, struct kvt_tp_mr *local,
                   const struct kvt_read_op *ops, size_t n, kvt_read_cb cb, void *arg)
{
    struct vb_ep *ep = ep_of(pep);
    struct vb_batch *b;

    if (ep->state != EP_CONNECTED)
        return -ENOTCONN;
    if (rk == NULL || local == NULL || ops == NULL || n == 0 || cb == NULL || local->tp != ep->tp ||
        rk->tp != ep->tp || rk->guid != ep->peer_guid || local->remote)
        return -EINVAL;
    if (n > (SIZE_MAX - sizeof(*b)) / sizeof(*ops))
        return -EINVAL;
    for (size_t i = 0; i < n; i++)
        if (!vb_rkey_covers(rk, ops[i].remote_off, ops[i].len) ||
            !vb_in_range(ops[i].local_off, ops[i].len, local->len))
            return -EINVAL;
    if (ep->n_batches >= ep->tp->pub.cfg.max_batches)
        return -EAGAIN;
    b = kvt_malloc(sizeof(*b) + n * sizeof(*ops));
    if (b == NULL)
        return -ENOMEM;
    memset(b, 0, sizeof(*b));
    memcpy(b->ops, ops, n * sizeof(*ops));
    b->n = n;
    b->ep = ep;
    b->rk = rk;
    b->local = local;
    rk->refs++;
    local->refs++;
    b->cb = cb;
    b->arg = arg;
    b->start_ns = vb_now_ns();
    kvt_list_add_tail(&ep->batches, &b->node);
    kvt_list_add_tail(&ep->pending, &b->pnode);
    b->on_pending = true;
    ep->n_batches++;
    vb_pump(ep); /* a posting error fails the batch from progress, with its callback */
    return -EINPROGRESS;
}

/* Polls the CQ of every endpoint, re-arming the notified ones first. No system call
 * (for the devices that poll in user space). */
static int vb_poll_all(struct vb_tp *tp)
{
    struct kvt_list *pos, *tmp;
    int n = 0;

    kvt_list_for_each_safe(pos, tmp, &tp->eps)
    {
        struct vb_ep *ep = kvt_list_entry(pos, struct vb_ep, node);

        if (ep->cq == NULL)
            continue;
        if (ep->cq_event) {
            ep->cq_event = false;
            if (ibv_req_notify_cq(ep->cq, 0) != 0)
                vb_ep_fail(ep, -EIO);
        }
        n += vb_poll_ep(ep);
    }
    return n;
}

/* The CQs first, without a system call; the fds (one epoll_wait with no wait) when
 * the CQs had nothing, and at least every VB_FD_EVERY calls, so a busy-polling loop
 * pays no system call per completion and still sees connection events and timers. */
static int vb_progress(struct kvt_transport *t)
{
    struct vb_tp *tp = tp_of(t);
    struct kvt_list *pos, *tmp;
    int n = vb_poll_all(tp);

    if (n == 0 || ++tp->fd_skip >= VB_FD_EVERY) {
        struct epoll_event ev[8];
        bool tmr = false, cm = false, chan = false;
        int k;

        tp->fd_skip = 0;
        k = epoll_wait(tp->epfd, ev, (int)KVT_ARRAY_SIZE(ev), 0);
        for (int i = 0; i < k; i++) {
            if (ev[i].data.fd == tp->tfd)
                tmr = true;
            else if (ev[i].data.fd == tp->ech->fd)
                cm = true;
            else
                chan = true;
        }
        if (tmr) {
            uint64_t junk;

            while (read(tp->tfd, &junk, sizeof(junk)) == (ssize_t)sizeof(junk))
                ;
        }
        if (cm)
            n += vb_drain_cm(tp);
        if (chan)
            vb_drain_channels(tp);
        if (cm || chan)
            n += vb_poll_all(tp); /* re-armed CQs, endpoints that just connected */
    }
    vb_check_timeouts(tp, vb_now_ns());
    for (int round = 0; round < VB_REAP_ROUNDS; round++) {
        int m = 0;

        kvt_list_for_each_safe(pos, tmp, &tp->eps)
        {
            struct vb_ep *ep = kvt_list_entry(pos, struct vb_ep, node);

            vb_pump(ep);
            vb_flush_credits(ep);
        }
        m += vb_reap(tp);
        m += vb_dispatch(tp);
        n += m;
        if (m == 0)
            break;
    }
    return n;
}

static int vb_event_fd(struct kvt_transport *t)
{
    return tp_of(t)->epfd;
}

static int vb_arm(struct kvt_transport *t)
{
    struct vb_tp *tp = tp_of(t);
    uint64_t now = vb_now_ns(), next = UINT64_MAX;
    uint64_t op_ns = (uint64_t)tp->pub.cfg.op_timeout_ms * 1000000ull;
    struct itimerspec its;
    struct kvt_list *pos;

    if (!kvt_list_empty(&tp->done) || !kvt_list_empty(&tp->dead))
        return -EAGAIN;
    for (pos = tp->eps.next; pos != &tp->eps; pos = pos->next) {
        struct vb_ep *ep = kvt_list_entry(pos, struct vb_ep, node);

        if (ep->state == EP_DYING || ep->cq_event)
            return -EAGAIN;
        if (ep->state == EP_CONNECTED) {
            if (!kvt_list_empty(&ep->pending) && ep->read_wr_free > 0 && ep->n_seg_free > 0)
                return -EAGAIN;
            if (ep->n_tx_free > 0 &&
                (ep->owe_ack || (ep->rx_owed >= ep->credit_threshold && !ep->cm_out)))
                return -EAGAIN;
            if (!kvt_list_empty(&ep->batches)) {
                struct vb_batch *b = kvt_list_entry(ep->batches.next, struct vb_batch, node);

                next = KVT_MIN(next, b->start_ns + op_ns);
            }
        } else if (ep->state != EP_DEAD) {
            next = KVT_MIN(next, ep->deadline_ns);
        }
    }
    if (next <= now)
        return -EAGAIN;
    memset(&its, 0, sizeof(its));
    if (next != UINT64_MAX) {
        its.it_value.tv_sec = (time_t)(next / 1000000000ull);
        its.it_value.tv_nsec = (long)(next % 1000000000ull);
    }
    if (timerfd_settime(tp->tfd, TFD_TIMER_ABSTIME, &its, NULL) != 0)
        return vb_errno();
    return 0;
}

/* The peer may READ our remote registrations through ep from now on: the QP gets
 * IBV_ACCESS_REMOTE_READ (and no other access flag), in place (RTS->RTS; rxe checks
 * the flags per request). A failure fails the endpoint: the owner wanted this peer
 * served and the QP's state is unknown. */
static int vb_ep_authorize(struct kvt_tp_ep *pep)
{
    struct vb_ep *ep = ep_of(pep);
    struct ibv_qp_attr a;
    int err;

    if (ep->state != EP_CONNECTED)
        return -ENOTCONN;
    if (ep->authorized)
        return 0;
    memset(&a, 0, sizeof(a));
    a.qp_access_flags = IBV_ACCESS_REMOTE_READ;
    err = vb_ret(ibv_modify_qp(ep->qp, &a, IBV_QP_ACCESS_FLAGS));
    if (err != 0) {
        kvt_error(VB_MOD, "granting a peer remote read (RTS->RTS access flags): %s",
                  strerror(-err));
        vb_ep_fail(ep, err);
        return err;
    }
    ep->authorized = true;
    return 0;
}

/* "rdma read over <device>; peer reads ours: yes|no", the second part from the QP
 * itself (ibv_query_qp), so tests see what the device enforces. */
static int vb_ep_info(struct kvt_tp_ep *pep, char *buf, size_t cap)
{
    struct vb_ep *ep = ep_of(pep);
    struct ibv_qp_attr a;
    struct ibv_qp_init_attr ia;
    const char *peer_reads = "?";

    if (cap == 0)
        return -EINVAL;
    if (ep->state != EP_CONNECTED)
        return -ENOTCONN;
    memset(&a, 0, sizeof(a));
    if (ibv_query_qp(ep->qp, &a, IBV_QP_ACCESS_FLAGS, &ia) == 0)
        peer_reads = (a.qp_access_flags & IBV_ACCESS_REMOTE_READ) ? "yes" : "no";
    snprintf(buf, cap, "rdma read over %s; peer reads ours: %s",
             ep->id != NULL && ep->id->verbs != NULL ? ibv_get_device_name(ep->id->verbs->device)
                                                     : "?",
             peer_reads);
    return 0;
}

/* The NIC serves READs without us: what we count is what we see of its refusals (an
 * unauthorized endpoint whose QP the device stopped after a peer's RDMA request). */
static int vb_get_counters(struct kvt_transport *t, struct kvt_tp_counters *out)
{
    if (out == NULL)
        return -EINVAL;
    *out = tp_of(t)->ctr;
    return 0;
}

/* ---- exposures: type-2 memory windows ---- */

static int vb_range_cmp(const void *x, const void *y)
{
    const struct kvt_tp_range *a = x, *b = y;

    return a->off < b->off ? -1 : a->off > b->off;
}

/* Sorts r, merges ranges that touch or overlap and cuts them at piece boundaries:
 * the windows, in w (cap entries). Their count, or -EMSGSIZE past cap. */
static long vb_windows(struct kvt_tp_range *r, size_t n, struct kvt_tp_range *w, size_t cap)
{
    size_t nw = 0;

    qsort(r, n, sizeof(*r), vb_range_cmp);
    for (size_t i = 0; i < n;) {
        uint64_t off = r[i].off, end = r[i].off + r[i].len;

        for (i++; i < n && r[i].off <= end; i++)
            end = KVT_MAX(end, r[i].off + r[i].len);
        while (off < end) {
            uint64_t cut = KVT_MIN(end, (off / VB_PIECE + 1) * VB_PIECE);

            if (nw == cap)
                return -EMSGSIZE;
            w[nw++] = (struct kvt_tp_range){.off = off, .len = cut - off};
            off = cut;
        }
    }
    return (long)nw;
}

static int vb_expose(struct kvt_tp_ep *pep, struct kvt_tp_mr *mr, const struct kvt_tp_range *r,
                     size_t n, void *buf, size_t cap, size_t *len_p, struct kvt_tp_grant **g_p)
{
    struct vb_ep *ep = ep_of(pep);
    struct kvt_tp_range *sorted = NULL, w[KVT_TP_MAX_EXPOSE_RANGES];
    struct ibv_send_wr *wrs = NULL, *bad;
    struct kvt_tp_grant *g = NULL;
    struct vb_grant_hdr h;
    uint8_t *p = buf;
    size_t need;
    unsigned si;
    long nw;
    int err;

    if (ep->state != EP_CONNECTED)
        return -ENOTCONN;
    if (!ep->authorized)
        return -EPERM;
    if (mr == NULL || mr->tp != ep->tp || !mr->granted || r == NULL || n == 0 || buf == NULL ||
        len_p == NULL || g_p == NULL || n > SIZE_MAX / sizeof(*r))
        return -EINVAL;
    for (size_t i = 0; i < n; i++)
        if (r[i].len == 0 || !vb_in_range(r[i].off, r[i].len, mr->len))
            return -EINVAL;
    sorted = kvt_malloc(n * sizeof(*r));
    if (sorted == NULL)
        return -ENOMEM;
    memcpy(sorted, r, n * sizeof(*r));
    nw = vb_windows(sorted, n, w, KVT_ARRAY_SIZE(w));
    kvt_free(sorted);
    if (nw < 0)
        return (int)nw;
    need = sizeof(h) + (size_t)nw * sizeof(struct vb_win_wire);
    if (cap < need)
        return -ENOSPC;
    if ((unsigned)nw > ep->bind_wr_free || ep->n_bind_seg_free == 0)
        return -EAGAIN;
    g = kvt_calloc(1, sizeof(*g) + (size_t)nw * sizeof(struct vb_gwin));
    wrs = kvt_calloc((size_t)nw, sizeof(*wrs));
    if (g == NULL || wrs == NULL) {
        err = -ENOMEM;
        goto fail_free;
    }
    g->tp = ep->tp;
    g->ep = ep;
    g->mr = mr;
    g->n_mw = (unsigned)nw;
    kvt_list_init(&g->node);
    mr->refs++;
    memset(&h, 0, sizeof(h));
    h.magic = htole32(VB_GRANT_MAGIC);
    h.version = htole16(VB_VERSION);
    h.n_win = htole16((uint16_t)nw);
    h.guid = htole64(ep->dev->guid);
    h.len = htole64(mr->len);
    h.page_off = htole32(mr->page_off);
    memcpy(p, &h, sizeof(h));
    p += sizeof(h);
    for (long i = 0; i < nw; i++) {
        struct ibv_mr *wmr;
        struct ibv_mw *mw;
        struct vb_win_wire ww;
        uint32_t rkey;

        /* The window's own registration, same iova as in the region: rxe checks a
         * READ through a window against the registration it is bound to, not the
         * window's bounds (see Access). */
        wmr = ibv_reg_mr_iova(ep->dev->pd, mr->base + w[i].off, w[i].len, mr->page_off + w[i].off,
                              IBV_ACCESS_MW_BIND);
        if (wmr == NULL) {
            err = vb_errno();
            kvt_error(VB_MOD, "registering a window's %llu bytes: %s", (unsigned long long)w[i].len,
                      strerror(-err));
            goto fail_unbind;
        }
        g->w[i].mr = wmr;
        mw = ibv_alloc_mw(ep->dev->pd, IBV_MW_TYPE_2);
        if (mw == NULL) {
            err = vb_errno();
            kvt_error(VB_MOD, "ibv_alloc_mw (type 2): %s", strerror(-err));
            goto fail_unbind;
        }
        g->w[i].mw = mw;
        rkey = ibv_inc_rkey(mw->rkey);
        wrs[i].wr_id = ((uint64_t)0 << 2) | WR_SEG; /* set below */
        wrs[i].opcode = IBV_WR_BIND_MW;
        wrs[i].bind_mw.mw = mw;
        wrs[i].bind_mw.rkey = rkey;
        wrs[i].bind_mw.bind_info = (struct ibv_mw_bind_info){
            .mr = wmr,
            .addr = mr->page_off + w[i].off,
            .length = w[i].len,
            .mw_access_flags = IBV_ACCESS_REMOTE_READ,
        };
        if (i > 0)
            wrs[i - 1].next = &wrs[i];
        ww = (struct vb_win_wire){
            .off = htole64(w[i].off), .len = htole32((uint32_t)w[i].len), .rkey = htole32(rkey)};
        memcpy(p, &ww, sizeof(ww));
        p += sizeof(ww);
    }
    si = ep->bind_seg_free[--ep->n_bind_seg_free];
    for (long i = 0; i < nw; i++)
        wrs[i].wr_id = ((uint64_t)si << 2) | WR_SEG;
    wrs[nw - 1].wr_id |= WR_SEG_LAST;
    wrs[nw - 1].send_flags = IBV_SEND_SIGNALED;
    err = vb_ret(ibv_post_send(ep->qp, wrs, &bad));
    kvt_free(wrs);
    if (err != 0) {
        /* Some binds may be queued: the windows go with the QP (the reap). */
        kvt_error(VB_MOD, "ibv_post_send of %ld memory window binds: %s", nw, strerror(-err));
        ep->bind_seg_free[ep->n_bind_seg_free++] = si;
        g->revoked = true;
        g->binding = true;
        kvt_list_add_tail(&ep->grants, &g->node);
        vb_ep_fail(ep, err);
        return err;
    }
    ep->segs[si].grant = g;
    ep->segs[si].n_wr = (unsigned)nw;
    ep->bind_wr_free -= (unsigned)nw;
    g->binding = true;
    kvt_list_add_tail(&ep->grants, &g->node);
    *len_p = need;
    *g_p = g;
    return 0;
fail_unbind:
    vb_grant_unbind(g);
    vb_mr_unref(mr);
fail_free:
    kvt_free(wrs);
    kvt_free(g);
    return err;
}

static void vb_revoke(struct kvt_tp_grant *g)
{
    if (g == NULL)
        return;
    if (g->ep != NULL && g->binding) {
        g->revoked = true; /* freed when its bind chain completes, or with the ep */
        return;
    }
    vb_grant_free(g);
}

const struct kvt_transport_ops kvt_verbs_transport_ops = {
    .name = "verbs",
    .open = vb_open,
    .close = vb_close,
    .listen = vb_listen,
    .connect = vb_connect,
    .ep_close = vb_ep_close,
    .send = vb_send,
    .send_room = vb_send_room,
    .reg_remote = vb_reg_remote,
    .reg_local = vb_reg_local,
    .dereg = vb_dereg,
    .pack = vb_pack,
    .unpack = vb_unpack,
    .rkey_destroy = vb_rkey_destroy,
    .read = vb_read,
    .progress = vb_progress,
    .event_fd = vb_event_fd,
    .arm = vb_arm,
    .ep_info = vb_ep_info,
    .ep_authorize = vb_ep_authorize,
    .get_counters = vb_get_counters,
    .reg_granted = vb_reg_granted,
    .expose = vb_expose,
    .revoke = vb_revoke,
};

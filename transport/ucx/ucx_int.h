/* Private to the UCX backend (the .c files of transport/ucx): the wire headers, the
 * transport, endpoint, batch and registration structures, and the functions the
 * files share.
 * ucx.c holds the transport, its endpoints, control messages and the loop;
 * ucx_am_read.c holds READ over active messages (both sides). Only these files include
 * <ucp/api/ucp.h>. */
#ifndef KVT_UCX_INT_H
#define KVT_UCX_INT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <time.h>

#include <ucp/api/ucp.h>

#include "kvt/common.h"
#include "kvt/list.h"
#include "kvt/transport.h"

#define UCX_AM_ID    7 /* control messages */
#define UCX_AM_RDREQ 8 /* READ over active messages: a request for one op */
#define UCX_AM_RDREP 9 /* ... and its reply, carrying the bytes */
/* READ replies in flight per endpoint (at least one): UCX moves concurrent
 * rendezvous replies interleaved, so without a bound the first batch of many would
 * complete only when nearly all of them had. */
#define UCX_RD_INFLIGHT_BYTES (2u << 20)
/* READ replies up to this many bytes are sent from the request's AM handler, eager
 * and short (over tcp UCX sends up to ~8 KiB short). */
#define UCX_RD_EAGER_BYTES (4u << 10)
#define UCX_MAGIC          0x6b767475u /* "kvtu" */
#define UCX_VERSION        1
#define UCX_PROGRESS_MAX   64 /* ucp_worker_progress rounds per kvt_tp_progress */
#define UCX_CLOSE_WAIT_NS  (2ull * 1000000000ull)

enum ucx_msg_type { UCX_MSG_HELLO = 1, UCX_MSG_DATA = 2 };

struct ucx_am_hdr {
    uint32_t magic;
    uint16_t version;
    uint16_t type;
    uint64_t seq;
};

/* READ over active messages: the request (client to server, no data) and the reply
 * (server to client, the bytes as data, or err != 0 and no data). */
struct ucx_rd_hdr {
    uint32_t magic;
    uint16_t version;
    uint16_t err;  /* reply: 0, or the positive errno of a refusal */
    uint64_t addr; /* the server's address, inside one of its remote registrations */
    uint64_t len;
    uint64_t tag; /* the requester's: batch id << 32 | op index */
};

/* One ucp_mem_map covers a whole region, however large (a node's primary: kvtierd
 * takes up to 64 TiB); UCX registers it with each of its transports as they need.
 * KVT_TP_MAX_REG_BYTES is the verbs backend's piece size, not a bound here: with it,
 * a primary over 2 GiB could not be registered and its node served no peer. */
#define UCX_MAX_REG_BYTES (64ull << 40)

struct ucx_handle_hdr {
    uint32_t magic;
    uint32_t rkey_len;
    uint64_t base;
    uint64_t len;
};

enum ucx_ep_state { EP_ACCEPTING, EP_CONNECTING, EP_CONNECTED, EP_FAILED, EP_DEAD };

/* How an endpoint's READs move (see ucx_ep_rd_path): not yet known, ucp_get_nbx (a
 * one-sided GET: RDMA or cross-memory attach), or our READ over active messages. */
enum ucx_rd_path { RD_PATH_AUTO, RD_PATH_GET, RD_PATH_AM };
/* UCX may still move an endpoint to other lanes this long after it connected
 * (wireup ends after the first messages); until then an AM choice is re-checked. */
#define UCX_WIREUP_SETTLE_NS   (2ull * 1000000000ull)
#define UCX_RD_PATH_RECHECK_NS (10ull * 1000000ull)

/* The transport; every field belongs to the owner's thread. */
struct ucx_tp {
    struct kvt_transport pub;
    ucp_context_h ctx;
    ucp_worker_h worker;
    ucp_listener_h listener;
    int epfd, wfd, tfd;      /* epoll (the event fd), worker efd, timerfd */
    struct kvt_list eps;     /* endpoints not yet reported CLOSED */
    struct kvt_list zombies; /* reported CLOSED, waiting for UCX to let go */
    struct kvt_list done;    /* batches whose callback is due */
    struct kvt_list orphans; /* batches reported at close whose UCX requests never ended */
    struct ucx_ep *last_ep;  /* lookup cache for ucx_ep_find */
    uint64_t next_ep_id;
    struct kvt_list mrs;         /* remote registrations (READ over AM serves these) */
    struct kvt_list rd_sent;     /* ucx_rd_tx whose send UCX has not completed */
    uint64_t timer_at_ns;        /* when the armed timerfd fires (0: not armed) */
    enum ucx_rd_path read_force; /* KVT_UCX_READ: the path every endpoint takes */
    bool test_no_rcheck;         /* tests only: READs over AM skip the remote range check */
    bool kick;                   /* a UCX callback left work for dispatch */
    bool closing;
};

/* An endpoint: owned by tp (on tp->eps, then tp->zombies). rx holds ucx_msg,
 * batches holds ucx_batch in submission order (oldest first). ucx_reqs counts UCX
 * requests whose completion names this ep (sends, gets, rendezvous receives). */
struct ucx_ep {
    struct kvt_tp_ep pub;
    struct ucx_tp *tp;
    struct kvt_list node;
    ucp_ep_h uep;    /* NULL after teardown */
    void *close_req; /* ucp_ep_close_nbx request still running */
    uint64_t id;
    enum ucx_ep_state state;
    int err;     /* the CLOSED error */
    bool silent; /* never announced (accept refused or failed first) */
    uint64_t deadline_ns;
    uint64_t tx_seq, rx_seq;
    unsigned tx_inflight;
    unsigned ucx_reqs;
    struct kvt_list rx;
    struct kvt_list batches;
    unsigned n_batches;
    uint32_t next_batch_id;
    struct kvt_list rd_q; /* ucx_rd_tx: READ replies to send from dispatch */
    uint64_t rd_inflight; /* bytes of the replies UCX is still sending */
    enum ucx_rd_path rd_path;
    bool rd_path_final; /* GET, or AM once wireup has had time to settle */
    uint64_t connected_ns, rd_path_checked_ns;
    char am_lanes[32], bw_lanes[32]; /* the transports of its AM and rma_bw lanes */
};

struct ucx_msg {
    struct kvt_list node;
    struct ucx_ep *ep;
    uint64_t seq;
    uint16_t type;
    bool ready;  /* bytes complete (rendezvous finished) */
    bool failed; /* rendezvous receive failed */
    void *desc;  /* persistent UCX descriptor to release, or NULL */
    const uint8_t *data;
    size_t len;
    uint8_t buf[];
};

struct ucx_tx {
    struct ucx_ep *ep;
    struct ucx_am_hdr hdr;
    uint8_t data[];
};

/* One op of a READ over active messages. */
enum ucx_rd_state { RD_WAIT, RD_RECV, RD_DONE };

struct ucx_rd_op {
    struct ucx_batch *b;
    uint8_t *dst;
    ucp_mem_h memh;        /* the local registration's */
    struct ucx_rd_hdr hdr; /* the request, alive until its send completes */
    enum ucx_rd_state state;
};

struct ucx_batch {
    struct kvt_list node; /* ep->batches, then tp->done */
    struct ucx_ep *ep;
    kvt_read_cb cb;
    void *arg;
    uint64_t start_ns;
    unsigned pending; /* UCX requests not yet completed, and AM ops not yet answered */
    int status;
    uint32_t id;            /* READ over AM: the tag's upper half */
    size_t n_ops;           /* READ over AM: ops[] */
    struct ucx_rd_op ops[]; /* READ over AM only */
};

/* A READ reply the server owes (queued by the request's AM handler, sent by
 * dispatch), then in flight until UCX completes its send. */
struct ucx_rd_tx {
    struct kvt_list node; /* ep->rd_q while queued, then tp->rd_sent */
    struct ucx_ep *ep;
    struct kvt_tp_mr *mr;
    struct ucx_rd_hdr hdr;
};

struct kvt_tp_mr {
    struct ucx_tp *tp;
    struct kvt_list node; /* tp->mrs (remote registrations) */
    unsigned inflight;    /* READ replies sent from it, not yet completed */
    ucp_mem_h memh;
    uint8_t *base;
    size_t len;
    void *rkey_buf; /* packed rkey (remote registrations only) */
    size_t rkey_len;
};

struct kvt_tp_rkey {
    ucp_rkey_h rkey;
    uint64_t ep_id; /* the endpoint it was unpacked on */
    uint64_t base;
    uint64_t len;
};

static inline uint64_t ucx_now_ns(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static inline struct ucx_tp *tp_of(struct kvt_transport *t)
{
    return KVT_CONTAINER_OF(t, struct ucx_tp, pub);
}

static inline struct ucx_ep *ep_of(struct kvt_tp_ep *e)
{
    return KVT_CONTAINER_OF(e, struct ucx_ep, pub);
}

static inline bool ucx_in_range(uint64_t off, uint64_t len, uint64_t size)
{
    return len > 0 && off <= size && len <= size - off;
}

/* ucx.c */
/* The one place UCX status codes become negative errno. */
int kvt__ucx_errno(ucs_status_t st);
/* Records a failure; teardown and the CLOSED report happen in dispatch. Safe from
 * inside UCX callbacks. The first error wins. */
void kvt__ucx_ep_fail(struct ucx_ep *ep, int err);
/* Moves a batch whose pending count reached 0 to tp->done (its callback is due). */
void kvt__ucx_batch_finish(struct ucx_batch *b);
/* The endpoint an active message came on, or NULL (not one of ours). */
struct ucx_ep *kvt__ucx_am_ep(struct ucx_tp *tp, const ucp_am_recv_param_t *param);

/* ucx_am_read.c */
ucs_status_t kvt__ucx_rdreq_cb(void *arg, const void *header, size_t header_length, void *data,
                               size_t length, const ucp_am_recv_param_t *param);
ucs_status_t kvt__ucx_rdrep_cb(void *arg, const void *header, size_t header_length, void *data,
                               size_t length, const ucp_am_recv_param_t *param);
/* Server, from dispatch: sends the READ replies an endpoint owes; how many. */
int kvt__ucx_rd_send_replies(struct ucx_ep *ep);
/* Client: posts the request of each op; 0 or the first posting error, *posted_p the
 * ops posted. */
int kvt__ucx_read_am(struct ucx_ep *ep, struct ucx_batch *b, struct kvt_tp_rkey *rk,
                     struct kvt_tp_mr *local, const struct kvt_read_op *ops, size_t n,
                     size_t *posted_p);
void kvt__ucx_batch_req_done(void *req, ucs_status_t status, void *user_data);

#endif

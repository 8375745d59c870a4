/* Private to the UCX backend (the .c files of transport/ucx): the wire headers, the
 * transport, endpoint, batch and registration structures, and the functions the
 * files share. ucx.c holds the transport, its endpoints, control messages and the
 * loop; ucx_sock.c our own TCP listener and connections (everything before an
 * endpoint is authorized); ucx_am_read.c READ over active messages (both sides).
 * Only these files include <ucp/api/ucp.h>. */
#ifndef KVT_UCX_INT_H
#define KVT_UCX_INT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <time.h>
#include <sys/socket.h>

#include <ucp/api/ucp.h>

#include "kvt/common.h"
#include "kvt/list.h"
#include "kvt/tp_frame.h"
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
/* 2: our own TCP connection and per-endpoint tokens (1: UCX's listener) */
#define UCX_VERSION       2
#define UCX_PROGRESS_MAX  64 /* ucp_worker_progress rounds per kvt_tp_progress */
#define UCX_CLOSE_WAIT_NS (2ull * 1000000000ull)
#define UCX_TOKEN_BYTES   KVT_TP_FRAME_TOKEN_BYTES
/* With every endpoint authorized and quiet, the sockets are looked at this often
 * by a busy-polling owner (and after each sleep on the event fd). */
#define UCX_SOCK_EVERY_NS (1000000ull)
/* What a READ refusal says on the wire, whatever the reason (no layout oracle). */
#define UCX_RD_REFUSED EACCES

/* Control messages (UCX_AM_ID). token: the receiver's token of this connection.
 * kind WIRE (no seq, no data): the first active message of the side that made the
 * ucp ep; the other side replies on the message's reply_ep (see kvt__ucx_ep_wire). */
enum ucx_am_kind { UCX_AM_DATA = 0, UCX_AM_WIRE = 1 };

struct ucx_am_hdr {
    uint32_t magic;
    uint16_t version;
    uint16_t kind;
    uint64_t seq;
    uint8_t token[UCX_TOKEN_BYTES];
};

/* READ over active messages: the request (client to server, no data) and the reply
 * (server to client, the bytes as data, or err != 0 and no data). token: the
 * receiver's. */
struct ucx_rd_hdr {
    uint32_t magic;
    uint16_t version;
    uint16_t err;  /* reply: 0, or UCX_RD_REFUSED */
    uint64_t addr; /* the server's address, inside one of its remote registrations */
    uint64_t len;
    uint64_t tag; /* the requester's: batch id << 32 | op index */
    uint8_t token[UCX_TOKEN_BYTES];
};

/* One ucp_mem_map covers a whole region, however large (a node's primary: kvtierd
 * takes up to 64 TiB); UCX registers it with each of its transports as they need.
 * KVT_TP_MAX_REG_BYTES is the verbs backend's piece size, not a bound here: with it,
 * a primary over 2 GiB could not be registered and its node served no peer. */
#define UCX_MAX_REG_BYTES (64ull << 40)

struct ucx_handle_hdr {
    uint32_t magic;
    uint32_t reserved; /* 0 */
    uint64_t base;
    uint64_t len;
};

enum ucx_ep_state { EP_ACCEPTING, EP_CONNECTING, EP_CONNECTED, EP_FAILED, EP_DEAD };

/* One ucp ep we made or adopted (UCP_EP_FLAG_USED: UCX never destroys it under us),
 * and the endpoint it serves; ep NULL while it waits to be claimed (tp->stash, see
 * ucx_ep_adopt). The error handler's argument. */
struct ucx_conn {
    struct kvt_list node; /* tp->stash while unclaimed */
    struct ucx_tp *tp;
    ucp_ep_h uep;
    struct ucx_ep *ep;
    uint64_t since_ns; /* stashed since */
    bool failed;       /* its error handler ran while stashed */
};

/* The transport; every field belongs to the owner's thread. */
struct ucx_tp {
    struct kvt_transport pub;
    ucp_context_h ctx;
    ucp_worker_h worker;
    ucp_address_t *waddr; /* our worker's address (sent in ADDR frames) */
    size_t waddr_len;
    int epfd, wfd, tfd;      /* epoll (the event fd), worker efd, timerfd */
    int sfd;                 /* epoll of our sockets (in epfd): listener and endpoints */
    int lfd;                 /* our listening socket, or -1 */
    struct kvt_list eps;     /* endpoints not yet reported CLOSED */
    struct kvt_list zombies; /* reported CLOSED, waiting for UCX to let go */
    struct kvt_list done;    /* batches whose callback is due */
    struct kvt_list orphans; /* batches reported at close whose UCX requests never ended */
    struct kvt_list stash;   /* ucx_conn adopted for an endpoint whose WIRE is still due */
    struct ucx_ep *last_ep;  /* lookup cache for kvt__ucx_ep_by_token */
    uint64_t next_ep_id;
    unsigned n_preauth;      /* accepted endpoints not authorized yet (max_preauth) */
    unsigned n_sock_busy;    /* endpoints whose socket still matters every progress */
    uint64_t sock_check_ns;  /* when progress last looked at the sockets */
    bool slept;              /* arm returned 0 since: look at the sockets next progress */
    struct kvt_list mrs;     /* remote registrations (READ over AM serves these) */
    struct kvt_list rd_sent; /* ucx_rd_tx whose send UCX has not completed */
    uint64_t timer_at_ns;    /* when the armed timerfd fires (0: not armed) */
    bool test_no_rcheck;     /* tests only: READs skip the client's remote range check */
    bool test_bad_token;     /* tests only: every active message names a wrong token */
    bool kick;               /* a UCX callback left work for dispatch */
    bool closing;
    struct kvt_tp_counters counters;
};

/* An endpoint: owned by tp (on tp->eps, then tp->zombies). rx holds ucx_msg,
 * batches holds ucx_batch in submission order (oldest first). ucx_reqs counts UCX
 * requests whose completion names this ep (sends, rendezvous receives).
 *
 * Its connection: a TCP socket of our own (sock) until teardown, carrying the
 * frames of kvt/tp_frame.h; frames received so far (reader) and bytes to write
 * (out). After ep_authorize we send our ADDR frame; once the peer's ADDR arrived
 * too (peer_waddr) and we are authorized, the active-message channel opens (uep, see
 * kvt__ucx_ep_wire) and every later message and READ moves on it, naming the peer's
 * token. */
struct ucx_ep {
    struct kvt_tp_ep pub;
    struct ucx_tp *tp;
    struct kvt_list node;
    ucp_ep_h uep;          /* NULL until both ADDRs are known, and after teardown */
    struct ucx_conn *conn; /* uep's record */
    void *close_req;       /* ucp_ep_close_nbx request still running */
    uint64_t id;
    enum ucx_ep_state state;
    int err;      /* the CLOSED error */
    bool silent;  /* never announced (accept refused or failed first) */
    bool passive; /* accepted, not dialled */
    bool torn;    /* teardown ran */
    bool authorized;
    bool preauth_counted; /* counted in tp->n_preauth */
    bool sock_busy;       /* counted in tp->n_sock_busy */
    bool sock_connecting; /* active side: the TCP connect has not completed */
    bool sock_eof;        /* the peer closed its end */
    uint64_t deadline_ns; /* connect (CONNECTING) */
    uint64_t preauth_deadline_ns;
    int sock;
    uint32_t sock_events;               /* what sfd watches */
    struct kvt_tp_frame_reader *reader; /* NULL once the peer's ADDR arrived */
    uint8_t *out;                       /* frames to write */
    size_t out_len, out_cap;
    unsigned tcp_msgs;                   /* DATA and RDREQ frames sent (KVT_TP_PREAUTH_MSGS) */
    uint8_t token[UCX_TOKEN_BYTES];      /* ours: the peer names us by it */
    uint8_t peer_token[UCX_TOKEN_BYTES]; /* the peer's, from its ADDR */
    uint8_t *peer_waddr;                 /* from its ADDR, until uep is made */
    size_t peer_waddr_len;
    bool peer_addr;   /* its ADDR arrived */
    bool creator;     /* we make the ucp ep (our worker address sorts first) */
    bool wire_rx;     /* not creator: the WIRE came (on wire_ep): adopt, then flush */
    ucp_ep_h wire_ep; /* the ep UCX made for the creator's (reply_ep): compared only */
    uint64_t tx_seq, rx_seq;
    uint64_t rx_tcp_seq; /* the sequence number of the next frame read from sock */
    unsigned tx_inflight;
    unsigned ucx_reqs;
    struct kvt_list rx;
    struct kvt_list txq; /* ucx_tx: messages sent after authorize, before uep */
    struct kvt_list batches;
    unsigned n_batches;
    uint32_t next_batch_id;
    struct kvt_list rd_q; /* ucx_rd_tx: READ replies to send from dispatch */
    uint64_t rd_inflight; /* bytes of the replies UCX is still sending */
    uint64_t connected_ns;
    char am_lanes[32], bw_lanes[32]; /* the transports of its AM and rma_bw lanes */
};

/* A received message (or, from the socket, a HELLO or a READ request), in seq order
 * on ep->rx. */
enum ucx_rx_kind { RX_DATA, RX_HELLO, RX_RDREQ };

struct ucx_msg {
    struct kvt_list node;
    struct ucx_ep *ep;
    uint64_t seq;
    enum ucx_rx_kind kind;
    bool ready;  /* bytes complete (rendezvous finished) */
    bool failed; /* rendezvous receive failed */
    void *desc;  /* persistent UCX descriptor to release, or NULL */
    const uint8_t *data;
    size_t len;
    uint8_t buf[];
};

struct ucx_tx {
    struct kvt_list node; /* ep->txq while it waits for uep */
    struct ucx_ep *ep;
    size_t len;
    struct ucx_am_hdr hdr;
    uint8_t data[];
};

/* One op of a READ over active messages. */
enum ucx_rd_state { RD_UNSENT, RD_WAIT, RD_RECV, RD_DONE };

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
    unsigned pending; /* UCX requests not yet completed, and ops not yet answered */
    int status;
    uint32_t id; /* the tag's upper half */
    size_t n_ops;
    struct ucx_rd_op ops[];
};

/* A READ reply the server owes (queued by the request's handler, sent by dispatch),
 * then in flight until UCX completes its send. */
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
    bool remote; /* reg_remote: on tp->mrs, packable */
};

/* Nothing but the bounds: READs are requests to the peer, which checks them. */
struct kvt_tp_rkey {
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
/* A new endpoint on socket fd (-1: none yet), on tp->eps, or NULL (out of memory). */
struct ucx_ep *kvt__ucx_ep_new(struct ucx_tp *tp, int fd, bool passive);
/* The endpoint a token names (ours, sent in our ADDR), or NULL. */
struct ucx_ep *kvt__ucx_ep_by_token(struct ucx_tp *tp, const uint8_t *token);
/* Files a received message into ep->rx by its sequence number. */
void kvt__ucx_rx_insert(struct ucx_ep *ep, struct ucx_msg *m);
/* The peer's ADDR and our authorize are both in: makes uep and sends what waited. */
int kvt__ucx_ep_wire(struct ucx_ep *ep);
/* Counts an endpoint in or out of n_sock_busy / n_preauth as its state says. */
void kvt__ucx_ep_account(struct ucx_ep *ep);

/* ucx_sock.c */
int kvt__ucx_sock_listen(struct ucx_tp *tp, const char *addr, uint16_t port, uint16_t *port_p);
int kvt__ucx_sock_connect(struct ucx_ep *ep, const char *addr, uint16_t port);
/* Accepts, reads and writes whatever our sockets have ready (one epoll_wait, no
 * wait); returns how many events it handled. */
int kvt__ucx_sock_poll(struct ucx_tp *tp);
/* Queues a frame on ep's socket (written now as far as the socket takes it). */
int kvt__ucx_sock_frame(struct ucx_ep *ep, uint8_t type, const void *a, size_t alen, const void *b,
                        size_t blen);
/* Writes what ep->out holds, as far as the socket takes it. */
void kvt__ucx_sock_flush(struct ucx_ep *ep);
/* Closes ep's socket (a last write of what is queued first). */
void kvt__ucx_sock_close(struct ucx_ep *ep);
void kvt__ucx_sock_close_listener(struct ucx_tp *tp);
/* Resolves addr:port (numeric or a name) for a socket. */
int kvt__ucx_sockaddr(const char *addr, uint16_t port, struct sockaddr_storage *ss,
                      socklen_t *len_p);

/* ucx_am_read.c */
ucs_status_t kvt__ucx_rdreq_cb(void *arg, const void *header, size_t header_length, void *data,
                               size_t length, const ucp_am_recv_param_t *param);
ucs_status_t kvt__ucx_rdrep_cb(void *arg, const void *header, size_t header_length, void *data,
                               size_t length, const ucp_am_recv_param_t *param);
/* Server: one READ request (from an active message, or a RDREQ frame in dispatch):
 * refused unless the endpoint is authorized, the range inside a registration and
 * may_read agrees; answered at once when small, else queued on rd_q. */
void kvt__ucx_rd_serve(struct ucx_ep *ep, struct ucx_rd_hdr *h);
/* Server, from dispatch: sends the READ replies an endpoint owes; how many. */
int kvt__ucx_rd_send_replies(struct ucx_ep *ep);
/* Client: posts the requests of a batch's ops (over the socket before we
 * authorized, as active messages once uep exists, else they wait as RD_UNSENT); 0
 * or the first posting error, *posted_p the ops posted. */
int kvt__ucx_read_post(struct ucx_ep *ep, struct ucx_batch *b, size_t first, size_t *posted_p);
/* Client: posts the ops that waited for uep, of every batch. */
void kvt__ucx_read_post_unsent(struct ucx_ep *ep);
void kvt__ucx_batch_req_done(void *req, ucs_status_t status, void *user_data);

#endif

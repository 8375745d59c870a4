/* Private to the UCX backend (the .c files of transport/ucx): the wire headers, the
 * transport, endpoint, batch and registration structures, and the functions the
 * files share. ucx.c holds the transport, its endpoints, control messages and the
 * loop; ucx_sock.c our own TCP listener and connections (everything before an
 * endpoint is authorized, and the frames of socket mode); ucx_am_read.c READ over
 * active messages (both sides); ucx_sock_read.c READ and messages in socket mode
 * (both sides). Only these files include <ucp/api/ucp.h>. */
#ifndef KVT_UCX_INT_H
#define KVT_UCX_INT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <time.h>
#include <sys/socket.h>
#include <sys/uio.h>

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
/* 3: ADDR says what its sender wants and has, MODE, socket mode (2: per-endpoint
 * tokens over our own TCP connection; 1: UCX's listener) */
#define UCX_VERSION       3
#define UCX_PROGRESS_MAX  64 /* ucp_worker_progress rounds per kvt_tp_progress */
#define UCX_CLOSE_WAIT_NS (2ull * 1000000000ull)
#define UCX_TOKEN_BYTES   KVT_TP_FRAME_TOKEN_BYTES
/* With every endpoint authorized and quiet, the sockets are looked at this often
 * by a busy-polling owner (and after each sleep on the event fd). */
#define UCX_SOCK_EVERY_NS (1000000ull)
/* What a READ refusal says on the wire, whatever the reason (no layout oracle). */
#define UCX_RD_REFUSED EACCES
/* Socket mode: READ requests a client keeps outstanding on one endpoint (sent, reply
 * not yet all in), at most this many and this many bytes (one op alone may be
 * larger); the server fails a peer that sends more (counted "proto"), so what it
 * holds per peer is bounded. */
#define UCX_SOCK_WINDOW_OPS   1024u
#define UCX_SOCK_WINDOW_BYTES (8ull << 20)

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

/* How an authorized connection's messages and READs move: not decided yet (they
 * wait), over UCX (active messages on a ucp ep over shared memory or RDMA), or over
 * our own TCP connection (socket mode: UCX has no lane to the peer but tcp, and UCX
 * never gets tcp; see kvt__ucx_ep_wire). */
enum ucx_path { PATH_NONE, PATH_UCX, PATH_SOCK };

/* KVT_UCX_MODE: auto (unset), "socket" (socket mode on every connection: tests, and
 * two hosts emulated on one), "ucx" (UCX may carry our data over tcp: a bench
 * switch, which needs UCX_TLS with tcp set by the user). */
enum ucx_mode_force { MODE_AUTO, MODE_SOCKET, MODE_UCX };

/* One piece of a connection's output, in order on ep->outq: frames copied when they
 * were queued (own != NULL: bytes we own, small frames coalesced), or a READ reply of
 * socket mode (rd != NULL: its frame header and fixed part in hdr, its bytes read
 * from the registration when the socket takes them: no copy). */
struct ucx_out {
    struct kvt_list node;
    size_t sent; /* of hdr_len + data_len */
    size_t hdr_len, data_len, cap;
    const uint8_t *data;
    uint8_t *own;
    struct ucx_rd_tx *rd;
    unsigned n_msgs; /* MSG frames in it: send credits given back when it is out */
    uint8_t hdr[KVT_TP_FRAME_HDR + KVT_TP_FRAME_RDREP_BYTES];
};

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
    unsigned n_preauth;        /* accepted endpoints not authorized yet (max_preauth) */
    unsigned n_sock_busy;      /* endpoints whose socket still matters every progress */
    uint64_t sock_check_ns;    /* when progress last looked at the sockets */
    bool slept;                /* arm returned 0 since: look at the sockets next progress */
    struct kvt_list mrs;       /* remote registrations (READ over AM serves these) */
    struct kvt_list rd_sent;   /* ucx_rd_tx whose send UCX has not completed */
    uint64_t timer_at_ns;      /* when the armed timerfd fires (0: not armed) */
    enum ucx_mode_force force; /* KVT_UCX_MODE */
    uint32_t addr_flags;       /* KVT_TP_ADDR_* we send */
    uint8_t host[16];          /* this host's boot id (zeros: unknown) */
    bool ucx_tcp;              /* UCX has tcp (the user's UCX_TLS named it) */
    bool test_no_rcheck;       /* tests only: READs skip the client's remote range check */
    bool test_bad_token;       /* tests only: every active message names a wrong token */
    bool kick;                 /* a UCX callback left work for dispatch */
    bool closing;
    struct kvt_tp_counters counters;
};

/* An endpoint: owned by tp (on tp->eps, then tp->zombies). rx holds ucx_msg,
 * batches holds ucx_batch in submission order (oldest first). ucx_reqs counts UCX
 * requests whose completion names this ep (sends, rendezvous receives).
 *
 * Its connection: a TCP socket of our own (sock) until teardown, carrying the
 * frames of kvt/tp_frame.h; frames received so far (reader) and what to write
 * (outq). After ep_authorize we send our ADDR frame; once the peer's ADDR arrived
 * too (peer_waddr) and we are authorized, the side whose worker address sorts first
 * decides the path (kvt__ucx_ep_wire) and says it in a MODE frame: UCX (the
 * active-message channel opens, uep, and every later message and READ moves on it,
 * naming the peer's token) or socket mode (they move as frames on sock). */
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
    uint32_t sock_events;                /* what sfd watches */
    struct kvt_tp_frame_reader *reader;  /* until teardown */
    struct kvt_list outq;                /* ucx_out: what to write, in order */
    size_t out_bytes;                    /* not written yet, of every piece on outq */
    struct ucx_out *out_spare;           /* an own piece kept for the next frames */
    unsigned cork;                       /* > 0: frames are queued, written at uncork */
    unsigned tcp_msgs;                   /* DATA and RDREQ frames sent (KVT_TP_PREAUTH_MSGS) */
    uint8_t token[UCX_TOKEN_BYTES];      /* ours: the peer names us by it */
    uint8_t peer_token[UCX_TOKEN_BYTES]; /* the peer's, from its ADDR */
    uint8_t *peer_waddr;                 /* from its ADDR, until uep is made */
    size_t peer_waddr_len;
    bool peer_addr;      /* its ADDR arrived */
    uint32_t peer_flags; /* KVT_TP_ADDR_* from its ADDR */
    uint8_t peer_host[16];
    enum ucx_path path;
    bool mode_rx;     /* not creator: the creator's MODE frame came */
    bool creator;     /* we decide the path and make the ucp ep (our address sorts first) */
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
    uint64_t rd_inflight; /* bytes of the replies UCX (or our socket) is still sending */
    /* Socket mode. Client: requests sent whose reply is not all in (the window), ops
     * not sent yet; the message or op whose bytes the reader puts in place. Server:
     * requests received whose reply is not all written. */
    unsigned win_ops;
    uint64_t win_bytes;
    size_t n_unsent;
    struct ucx_msg *sink_msg;
    struct ucx_rd_op *sink_op;
    unsigned srv_ops;
    uint64_t srv_bytes;
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
    bool in_window; /* socket mode: counted in the ep's window until its reply is in */
};

struct ucx_batch {
    struct kvt_list node; /* ep->batches, then tp->done */
    struct ucx_ep *ep;
    kvt_read_cb cb;
    void *arg;
    uint64_t start_ns;
    unsigned pending; /* UCX requests not yet completed, and ops not yet answered */
    int status;
    uint32_t id;        /* the tag's upper half */
    size_t next_unsent; /* socket mode: ops before it are sent (they go in order) */
    size_t n_ops;
    struct ucx_rd_op ops[];
};

/* A READ reply the server owes (queued by the request's handler, sent by dispatch),
 * then in flight until UCX completes its send. In socket mode: on ep->rd_q, then its
 * out piece on ep->outq until the socket took the last byte (counted in rd_inflight
 * meanwhile: inflight bytes). */
struct ucx_rd_tx {
    struct kvt_list node; /* ep->rd_q while queued, then tp->rd_sent */
    struct ucx_ep *ep;
    struct kvt_tp_mr *mr;
    struct ucx_rd_hdr hdr;
    uint64_t asked; /* socket mode: the length asked (the window's count) */
    uint64_t inflight;
    struct ucx_out out;
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

/* Records a protocol error of an authorized peer: counted ("proto"), the ep fails. */
void kvt__ucx_ep_proto(struct ucx_ep *ep, const char *why);
/* The creator's MODE frame (KVT_TP_MODE_*): 0, -EPROTO when it may not come now or
 * names no mode, or another negative errno (the caller fails the ep). */
int kvt__ucx_ep_mode(struct ucx_ep *ep, uint32_t mode);

/* ucx_sock.c */
int kvt__ucx_sock_listen(struct ucx_tp *tp, const char *addr, uint16_t port, uint16_t *port_p);
int kvt__ucx_sock_connect(struct ucx_ep *ep, const char *addr, uint16_t port);
/* Accepts, reads and writes whatever our sockets have ready (one epoll_wait, no
 * wait); returns how many events it handled. */
int kvt__ucx_sock_poll(struct ucx_tp *tp);
/* Queues a frame on ep's socket (copied; written now as far as the socket takes it,
 * unless corked). A MSG frame counts in tx_inflight until it is written. */
int kvt__ucx_sock_frame(struct ucx_ep *ep, uint8_t type, const void *a, size_t alen, const void *b,
                        size_t blen);
/* Queues a READ reply's piece (tx->out, filled in) behind what is queued. */
void kvt__ucx_sock_queue(struct ucx_ep *ep, struct ucx_out *o);
/* Writes what ep->outq holds, as far as the socket takes it (nothing while corked). */
void kvt__ucx_sock_flush(struct ucx_ep *ep);
/* Closes ep's socket (a last write of what is queued first) and drops what is
 * queued. */
void kvt__ucx_sock_close(struct ucx_ep *ep);
void kvt__ucx_sock_close_listener(struct ucx_tp *tp);
/* Resolves addr:port (numeric or a name) for a socket. */
int kvt__ucx_sockaddr(const char *addr, uint16_t port, struct sockaddr_storage *ss,
                      socklen_t *len_p);

/* ucx_sock_read.c: socket mode */
/* Starts socket mode on an authorized endpoint whose path was decided so: opens the
 * reader, sends what waited. 0 or a negative errno (the caller fails the ep). */
int kvt__ucx_sock_start(struct ucx_ep *ep);
/* Sends a control message as a MSG frame (counts in tx_inflight until written). */
int kvt__ucx_sock_msg(struct ucx_ep *ep, const void *buf, size_t len);
/* Client: posts op's request if the window has room (else it stays RD_UNSENT). */
int kvt__ucx_sock_post(struct ucx_ep *ep, struct ucx_rd_op *op);
/* Client: posts what waited for room in the window, in order. */
void kvt__ucx_sock_post_unsent(struct ucx_ep *ep);
/* Client: an RDREP's fixed part; the op it answers gets its bytes into place
 * (*dst_p, f_sink_len bytes), or the ep fails. 0, or negative (failed). */
int kvt__ucx_sock_rdrep(struct ucx_ep *ep, const uint8_t *fixed, uint64_t sink_len,
                        uint8_t **dst_p);
/* Client: the bytes of the reply being received are all in place. */
void kvt__ucx_sock_rdrep_done(struct ucx_ep *ep);
/* Server: a RDREQ frame of an open connection (the window is checked, then served). */
void kvt__ucx_sock_rdreq(struct ucx_ep *ep, const uint8_t *payload);
/* Server: queues the reply of a checked request (mr NULL: refused; h->err set). */
void kvt__ucx_sock_serve(struct ucx_ep *ep, const struct ucx_rd_hdr *h, struct kvt_tp_mr *mr);
/* Server: moves replies from rd_q to the output while the in-flight bound allows;
 * how many. */
int kvt__ucx_sock_fill(struct ucx_ep *ep);
/* A reply's piece left the output: written (sent) or dropped with the socket. */
void kvt__ucx_sock_reply_done(struct ucx_ep *ep, struct ucx_rd_tx *tx);
/* mr is deregistered: replies of socket mode that would read it are made refusals
 * (not started) or get a copy of their bytes (started). */
void kvt__ucx_sock_dereg(struct ucx_tp *tp, struct kvt_tp_mr *mr);

/* ucx_am_read.c */
ucs_status_t kvt__ucx_rdreq_cb(void *arg, const void *header, size_t header_length, void *data,
                               size_t length, const ucp_am_recv_param_t *param);
ucs_status_t kvt__ucx_rdrep_cb(void *arg, const void *header, size_t header_length, void *data,
                               size_t length, const ucp_am_recv_param_t *param);
/* Server: one READ request (from an active message, or a RDREQ frame): refused
 * unless the endpoint is authorized, the range inside a registration and may_read
 * agrees; answered at once when small over UCX, else queued on rd_q. asked: the
 * bytes it counts in the socket-mode window (0: not counted). */
void kvt__ucx_rd_serve(struct ucx_ep *ep, struct ucx_rd_hdr *h, uint64_t asked);
/* Client: the op a reply's tag names, if it still waits for its reply; NULL. */
struct ucx_rd_op *kvt__ucx_rd_op_find(struct ucx_ep *ep, uint64_t tag);
/* Client: an op has its answer (err 0, or the batch and the ep fail with it). */
void kvt__ucx_rd_op_done(struct ucx_rd_op *op, int err);
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

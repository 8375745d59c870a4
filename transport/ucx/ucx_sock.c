/* Our own TCP listener and connections for the UCX backend (see ucx.c, ucx_int.h):
 * everything a peer can send before its endpoint is authorized arrives here, as the
 * frames of kvt/tp_frame.h, and nowhere else; in socket mode everything after, too.
 *
 * Why not UCX's listener: in UCX 1.13 the sockcm listener parses what any peer
 * sends on its async thread and asserts on malformed input (16-64 raw bytes on the
 * port aborted a node), its cleanup of ~1,100 idle connections crashed
 * ucp_worker_destroy, and a ucp ep made from a connection request can send active
 * messages to our worker before anything authenticated it. Here the first 8 bytes
 * of a connection are judged by our frame reader, which holds at most one bounded
 * payload, and no UCX code sees a byte from a peer until both ends authorized.
 *
 * Bounds before authorize: max_preauth accepted endpoints (those beyond are accepted
 * and closed at once, counted), KVT_TP_PREAUTH_MSGS messages of at most
 * KVT_TP_PREAUTH_MSG_BYTES each way (the reader), preauth_timeout_ms (ucx.c's
 * timeouts). Bytes that are not our protocol close the endpoint, counted.
 *
 * The socket stays open after both ADDR frames. With UCX as the path nothing more
 * may arrive on it but the creator's MODE and the end of the stream, which is how we
 * learn that the peer went away (a process that dies closes it at once). In socket
 * mode it carries the connection's messages and READs (ucx_sock_read.c), and its end
 * is still the liveness signal.
 *
 * Output: an ordered queue of pieces (struct ucx_out), written with sendmsg as far as
 * the socket takes them: frames copied when queued (small ones coalesced into one
 * piece), and READ replies that reference the registered memory they read, so a
 * reply's bytes go from the registration to the socket with no copy of ours.
 * Input: readv into the reader's staging buffer, or, while a frame's bulk bytes are
 * due (a READ reply, a message), straight into their destination, with the staging
 * buffer behind it for the headers that follow.
 *
 * Sockets sit in their own epoll set (tp->sfd), which is inside the event fd. The
 * owner's loop may busy-poll kvt_tp_progress, so ucx.c looks at this set only when
 * some socket matters (a handshake, a connect, bytes to write, socket mode), after
 * the owner slept, or once every UCX_SOCK_EVERY_NS. */
#include <endian.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <netdb.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>
#include <netinet/in.h>
#include <netinet/tcp.h>

#include "kvt/alloc.h"
#include "kvt/log.h"
#include "ucx_int.h"

#define SOCK_READ_BYTES   (16u << 10) /* the staging buffer of one readv */
#define SOCK_STAGE_SINK   (2u << 10)  /* ... behind a sink (the next frame's header) */
#define SOCK_READS        16          /* readv per endpoint per poll, at most */
#define SOCK_POLL_BYTES   (4u << 20)  /* bytes read per endpoint per poll, at most */
#define SOCK_IOV          64          /* iovecs per sendmsg */
#define SOCK_OWN_BYTES    (16u << 10) /* an own piece: small frames coalesce up to this */
#define SOCK_ACCEPTS      256         /* accepts per poll, at most */
#define SOCK_POLL_EVENTS  64
#define SOCK_LISTEN_QUEUE 128

int kvt__ucx_sockaddr(const char *addr, uint16_t port, struct sockaddr_storage *ss,
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

/* Sets what tp->sfd watches on ep's socket (0: nothing). */
static void sock_watch(struct ucx_ep *ep, uint32_t events)
{
    struct epoll_event ev = {.events = events, .data.ptr = ep};
    int op;

    if (ep->sock < 0 || events == ep->sock_events)
        return;
    op = ep->sock_events == 0 ? EPOLL_CTL_ADD : events == 0 ? EPOLL_CTL_DEL : EPOLL_CTL_MOD;
    if (epoll_ctl(ep->tp->sfd, op, ep->sock, &ev) < 0) {
        kvt__ucx_ep_fail(ep, -errno);
        return;
    }
    ep->sock_events = events;
}

static uint32_t sock_wanted(const struct ucx_ep *ep)
{
    if (ep->sock_connecting)
        return EPOLLOUT;
    return (ep->sock_eof ? 0 : EPOLLIN) | (ep->out_bytes > 0 ? EPOLLOUT : 0);
}

static void sock_setup(int fd)
{
    int one = 1;

    (void)setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

/* A read failure or a protocol error: the ep fails, counted (pre-auth: malformed;
 * from an authorized peer: proto). */
static void sock_bad_input(struct ucx_ep *ep, const char *why)
{
    if (!ep->authorized) {
        ep->tp->counters.refused[KVT_TP_PREAUTH_MALFORMED]++;
        kvt_debug("ucx", "endpoint %llu: %s before authorize; closed", (unsigned long long)ep->id,
                  why);
        kvt__ucx_ep_fail(ep, -EPROTO);
        return;
    }
    kvt__ucx_ep_proto(ep, why);
}

/* ---- output ---- */

/* A piece has left the queue: written, or dropped with the socket. */
static void out_release(struct ucx_ep *ep, struct ucx_out *o)
{
    kvt_list_del(&o->node);
    ep->out_bytes -= o->hdr_len + o->data_len - o->sent;
    if (o->rd != NULL) {
        kvt__ucx_sock_reply_done(ep, o->rd);
        return;
    }
    ep->tx_inflight -= o->n_msgs;
    if (ep->out_spare == NULL && o->cap == SOCK_OWN_BYTES)
        ep->out_spare = o;
    else
        kvt_free(o);
}

static void out_drop_all(struct ucx_ep *ep)
{
    while (!kvt_list_empty(&ep->outq))
        out_release(ep, kvt_list_entry(ep->outq.next, struct ucx_out, node));
}

/* An own piece with room for need more bytes: the last one queued, or a new one. */
static struct ucx_out *out_own(struct ucx_ep *ep, size_t need)
{
    struct ucx_out *o;

    if (!kvt_list_empty(&ep->outq)) {
        o = kvt_list_entry(ep->outq.prev, struct ucx_out, node);
        if (o->own != NULL && o->rd == NULL && o->cap - o->data_len >= need)
            return o;
    }
    if (ep->out_spare != NULL && need <= SOCK_OWN_BYTES) {
        o = ep->out_spare;
        ep->out_spare = NULL;
    } else {
        size_t cap = KVT_MAX(need, SOCK_OWN_BYTES);

        o = kvt_malloc(sizeof(*o) + cap);
        if (o == NULL)
            return NULL;
        o->cap = cap;
        o->own = (uint8_t *)(o + 1);
    }
    o->sent = o->hdr_len = o->data_len = 0;
    o->data = o->own;
    o->rd = NULL;
    o->n_msgs = 0;
    kvt_list_add_tail(&ep->outq, &o->node);
    return o;
}

/* The iovecs of what is queued, from the head, at most SOCK_IOV; their bytes. */
static size_t out_iov(struct ucx_ep *ep, struct iovec *iov, int *n_p)
{
    struct kvt_list *pos, *tmp;
    size_t total = 0;
    int n = 0;

    kvt_list_for_each_safe(pos, tmp, &ep->outq)
    {
        struct ucx_out *o = kvt_list_entry(pos, struct ucx_out, node);
        size_t s = o->sent;

        if (n + 2 > SOCK_IOV)
            break;
        if (s < o->hdr_len) {
            iov[n++] = (struct iovec){(void *)(o->hdr + s), o->hdr_len - s};
            total += o->hdr_len - s;
            s = o->hdr_len;
        }
        if (s - o->hdr_len < o->data_len) {
            size_t d = s - o->hdr_len;

            iov[n++] = (struct iovec){(void *)(uintptr_t)(o->data + d), o->data_len - d};
            total += o->data_len - d;
        }
    }
    *n_p = n;
    return total;
}

void kvt__ucx_sock_close(struct ucx_ep *ep)
{
    if (ep->sock < 0)
        return;
    /* What is queued goes out first (a REFUSE before the close), unless the owner
     * refused the connection: then not even our HELLO. */
    if (ep->out_bytes > 0 && !ep->sock_connecting && !ep->silent) {
        struct iovec iov[SOCK_IOV];
        int n;

        out_iov(ep, iov, &n);
        struct msghdr mh = {.msg_iov = iov, .msg_iovlen = (size_t)n};

        (void)sendmsg(ep->sock, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
    }
    sock_watch(ep, 0);
    close(ep->sock);
    ep->sock = -1;
    ep->sock_events = 0;
    out_drop_all(ep);
    kvt__ucx_ep_account(ep);
}

void kvt__ucx_sock_flush(struct ucx_ep *ep)
{
    if (ep->sock < 0 || ep->sock_connecting || ep->state == EP_ACCEPTING || ep->cork > 0)
        return;
    for (;;) {
        struct iovec iov[SOCK_IOV];
        size_t want;
        ssize_t n;
        int n_iov;

        if (ep->path == PATH_SOCK)
            kvt__ucx_sock_fill(ep); /* READ replies, as the in-flight bound lets them */
        if (kvt_list_empty(&ep->outq))
            break;
        want = out_iov(ep, iov, &n_iov);

        struct msghdr mh = {.msg_iov = iov, .msg_iovlen = (size_t)n_iov};

        n = sendmsg(ep->sock, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
            break;
        if (n <= 0) {
            ep->sock_eof = true; /* the peer is gone: dispatch fails the ep */
            ep->tp->kick = true;
            out_drop_all(ep);
            break;
        }
        for (size_t left = (size_t)n; left > 0;) {
            struct ucx_out *o = kvt_list_entry(ep->outq.next, struct ucx_out, node);
            size_t rest = o->hdr_len + o->data_len - o->sent;

            if (left < rest) {
                o->sent += left;
                ep->out_bytes -= left;
                break;
            }
            left -= rest;
            o->sent += rest;
            ep->out_bytes -= rest;
            out_release(ep, o);
        }
        if ((size_t)n < want)
            break; /* the socket is full */
    }
    sock_watch(ep, sock_wanted(ep));
    kvt__ucx_ep_account(ep);
}

int kvt__ucx_sock_frame(struct ucx_ep *ep, uint8_t type, const void *a, size_t alen, const void *b,
                        size_t blen)
{
    size_t need = KVT_TP_FRAME_HDR + alen + blen;
    struct ucx_out *o;
    uint8_t *p;

    if (ep->sock < 0)
        return -ENOTCONN;
    if (alen + blen > UINT32_MAX)
        return -EMSGSIZE;
    o = out_own(ep, need);
    if (o == NULL)
        return -ENOMEM;
    p = o->own + o->data_len;
    kvt_tp_frame_hdr(p, type, (uint32_t)(alen + blen));
    if (alen > 0)
        memcpy(p + KVT_TP_FRAME_HDR, a, alen);
    if (blen > 0)
        memcpy(p + KVT_TP_FRAME_HDR + alen, b, blen);
    o->data_len += need;
    ep->out_bytes += need;
    if (type == KVT_TP_FRAME_MSG)
        o->n_msgs++;
    kvt__ucx_sock_flush(ep);
    return 0;
}

void kvt__ucx_sock_queue(struct ucx_ep *ep, struct ucx_out *o)
{
    o->sent = 0;
    kvt_list_add_tail(&ep->outq, &o->node);
    ep->out_bytes += o->hdr_len + o->data_len;
}

/* ---- input ---- */

/* A HELLO, DATA or RDREQ frame: filed on ep->rx in stream order. */
static int sock_rx(struct ucx_ep *ep, enum ucx_rx_kind kind, const uint8_t *p, size_t len)
{
    struct ucx_msg *m = kvt_malloc(sizeof(*m) + len);

    if (m == NULL)
        return -ENOMEM;
    *m = (struct ucx_msg){
        .ep = ep, .seq = ep->rx_tcp_seq++, .kind = kind, .ready = true, .len = len};
    m->data = m->buf;
    if (len > 0)
        memcpy(m->buf, p, len);
    kvt__ucx_rx_insert(ep, m);
    ep->tp->kick = true;
    return 0;
}

/* A MSG frame of socket mode: filed on ep->rx now, its bytes read into it. */
static int sock_msg_in(struct ucx_ep *ep, uint32_t len)
{
    struct ucx_msg *m = kvt_malloc(sizeof(*m) + len);

    if (m == NULL)
        return -ENOMEM;
    *m = (struct ucx_msg){
        .ep = ep, .seq = ep->rx_tcp_seq++, .kind = RX_DATA, .ready = len == 0, .len = len};
    m->data = m->buf;
    kvt__ucx_rx_insert(ep, m);
    if (len > 0) {
        ep->sink_msg = m;
        kvt_tp_frame_sink(ep->reader, m->buf);
    } else {
        ep->tp->kick = true;
    }
    return 0;
}

/* The bytes a sink was given for are all in. */
static void sock_sink_done(struct ucx_ep *ep)
{
    if (ep->sink_msg != NULL) {
        ep->sink_msg->ready = true;
        ep->sink_msg = NULL;
        ep->tp->kick = true;
    } else if (ep->sink_op != NULL) {
        kvt__ucx_sock_rdrep_done(ep);
    }
}

/* The peer's ADDR: its token, what it wants and has, its worker address; kept until
 * we authorize too. */
static int sock_peer_addr(struct ucx_ep *ep, const uint8_t *p, size_t len)
{
    size_t wlen = len - UCX_TOKEN_BYTES - KVT_TP_FRAME_CAPS_BYTES;
    const uint8_t *caps = p + UCX_TOKEN_BYTES;
    uint32_t flags, zero;

    memcpy(&flags, caps, 4);
    memcpy(&zero, caps + 4, 4);
    flags = le32toh(flags);
    if ((flags & ~KVT_TP_ADDR_FLAGS) != 0 || zero != 0)
        return -EPROTO;
    ep->peer_waddr = kvt_malloc(wlen);
    if (ep->peer_waddr == NULL)
        return -ENOMEM;
    memcpy(ep->peer_token, p, UCX_TOKEN_BYTES);
    ep->peer_flags = flags;
    memcpy(ep->peer_host, caps + 8, sizeof(ep->peer_host));
    memcpy(ep->peer_waddr, caps + KVT_TP_FRAME_CAPS_BYTES, wlen);
    ep->peer_waddr_len = wlen;
    ep->peer_addr = true;
    return 0;
}

static void sock_frame_in(struct ucx_ep *ep, const struct kvt_tp_frame *f)
{
    uint32_t u32;
    uint8_t *dst;
    int rc = 0;

    switch (f->type) {
    case KVT_TP_FRAME_HELLO:
        memcpy(&u32, f->payload, sizeof(u32));
        if (le32toh(u32) != UCX_VERSION) {
            kvt_warn("ucx", "endpoint %llu: the peer speaks version %u, we %u",
                     (unsigned long long)ep->id, le32toh(u32), UCX_VERSION);
            sock_bad_input(ep, "another protocol version");
            return;
        }
        rc = sock_rx(ep, RX_HELLO, NULL, 0);
        break;
    case KVT_TP_FRAME_DATA:
        rc = sock_rx(ep, RX_DATA, f->payload, f->len);
        break;
    case KVT_TP_FRAME_RDREQ:
        if (ep->reader->open) /* socket mode: served now, not in order with messages */
            kvt__ucx_sock_rdreq(ep, f->payload);
        else
            rc = sock_rx(ep, RX_RDREQ, f->payload, f->len);
        break;
    case KVT_TP_FRAME_ADDR:
        rc = sock_peer_addr(ep, f->payload, f->len);
        if (rc == -EPROTO) {
            sock_bad_input(ep, "an ADDR frame with unknown flags");
            return;
        }
        if (rc == 0 && ep->authorized)
            rc = kvt__ucx_ep_wire(ep);
        break;
    case KVT_TP_FRAME_MODE:
        memcpy(&u32, f->payload, sizeof(u32));
        rc = kvt__ucx_ep_mode(ep, le32toh(u32));
        if (rc == -EPROTO) {
            sock_bad_input(ep, "a MODE frame out of place");
            return;
        }
        break;
    case KVT_TP_FRAME_MSG:
        rc = sock_msg_in(ep, f->len);
        break;
    case KVT_TP_FRAME_RDREP:
        rc = kvt__ucx_sock_rdrep(ep, f->payload, f->sink_len, &dst);
        if (rc == 0 && f->sink_len > 0)
            kvt_tp_frame_sink(ep->reader, dst);
        return; /* a failure failed the ep */
    default:    /* the reader lets no other type through */
        rc = -EPROTO;
    }
    if (rc < 0)
        kvt__ucx_ep_fail(ep, rc);
}

/* Pushes staged bytes through the reader, frame by frame. */
static void sock_take(struct ucx_ep *ep, const uint8_t *buf, size_t n)
{
    size_t off = 0;

    while (off < n && ep->state < EP_FAILED) {
        struct kvt_tp_frame f;
        size_t used;
        int rc = kvt_tp_frame_push(ep->reader, buf + off, n - off, &used, &f);

        off += used;
        if (rc < 0) {
            sock_bad_input(ep, rc == -EPROTO ? "bytes that are not our protocol"
                                             : "a frame whose bytes had nowhere to go");
            return;
        }
        if (rc == 0)
            break;
        if (rc == 2)
            sock_sink_done(ep);
        else
            sock_frame_in(ep, &f);
    }
}

static void sock_read(struct ucx_ep *ep)
{
    uint8_t buf[SOCK_READ_BYTES];
    size_t total = 0;

    for (int i = 0;
         i < SOCK_READS && total < SOCK_POLL_BYTES && ep->sock >= 0 && ep->state < EP_FAILED; i++) {
        struct iovec iov[2];
        uint8_t *dst;
        uint64_t want = kvt_tp_frame_sink_want(ep->reader, &dst);
        size_t direct = 0;
        int n_iov = 0;
        ssize_t n;

        /* Bulk bytes due: straight into place, the next headers behind them. */
        if (want > 0) {
            direct = want > SSIZE_MAX / 2 ? SSIZE_MAX / 2 : (size_t)want;
            iov[n_iov++] = (struct iovec){dst, direct};
        }
        iov[n_iov++] = (struct iovec){buf, want > 0 ? SOCK_STAGE_SINK : sizeof(buf)};
        n = readv(ep->sock, iov, n_iov);
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
            break;
        if (n <= 0) { /* the peer closed (or reset): deliver what came, then fail */
            ep->sock_eof = true;
            ep->tp->kick = true;
            kvt__ucx_sock_close(ep);
            return;
        }
        total += (size_t)n;
        if (direct > 0) {
            size_t d = KVT_MIN((size_t)n, direct);

            if (kvt_tp_frame_sink_got(ep->reader, d))
                sock_sink_done(ep);
            sock_take(ep, buf, (size_t)n - d);
        } else {
            sock_take(ep, buf, (size_t)n);
        }
    }
    /* Replies to what was asked, and anything else queued meanwhile, in one write. */
    if (ep->sock >= 0 && ep->path == PATH_SOCK && ep->state == EP_CONNECTED)
        kvt__ucx_sock_flush(ep);
}

static void sock_connected(struct ucx_ep *ep)
{
    int err = 0;
    socklen_t len = sizeof(err);

    if (getsockopt(ep->sock, SOL_SOCKET, SO_ERROR, &err, &len) < 0)
        err = errno;
    if (err == EINPROGRESS)
        return;
    if (err != 0) {
        kvt__ucx_ep_fail(ep, -err);
        return;
    }
    ep->sock_connecting = false;
    kvt__ucx_sock_flush(ep); /* also watches for input from now on */
}

static void sock_accept(struct ucx_tp *tp)
{
    for (int i = 0; i < SOCK_ACCEPTS; i++) {
        int fd = accept4(tp->lfd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        struct ucx_ep *ep;

        if (fd < 0) {
            if (errno == EINTR || errno == ECONNABORTED)
                continue;
            if (errno != EAGAIN && errno != EWOULDBLOCK)
                kvt_warn("ucx", "accept: %s", strerror(errno));
            return;
        }
        if (tp->closing) {
            close(fd);
            continue;
        }
        if (tp->n_preauth >= tp->pub.cfg.max_preauth) {
            /* Not another unauthenticated connection: each holds a reader. */
            if (tp->counters.refused[KVT_TP_PREAUTH_CONNS]++ == 0)
                kvt_warn("ucx",
                         "%u connections not yet authenticated: more are closed at once "
                         "(counted, logged once)",
                         tp->pub.cfg.max_preauth);
            close(fd);
            continue;
        }
        ep = kvt__ucx_ep_new(tp, fd, true);
        if (ep == NULL) {
            close(fd);
            return;
        }
        sock_setup(fd);
        ep->state = EP_ACCEPTING;
        sock_watch(ep, EPOLLIN);
        tp->kick = true;
    }
}

int kvt__ucx_sock_poll(struct ucx_tp *tp)
{
    struct epoll_event ev[SOCK_POLL_EVENTS];
    int n = epoll_wait(tp->sfd, ev, SOCK_POLL_EVENTS, 0);

    for (int i = 0; i < n; i++) {
        struct ucx_ep *ep = ev[i].data.ptr;
        uint32_t e = ev[i].events;

        if (ep == NULL) {
            sock_accept(tp);
            continue;
        }
        if (ep->sock < 0 || ep->state >= EP_FAILED)
            continue;
        if (ep->sock_connecting) {
            sock_connected(ep);
            continue;
        }
        if (e & (EPOLLIN | EPOLLHUP | EPOLLERR))
            sock_read(ep);
        if ((e & EPOLLOUT) && ep->sock >= 0)
            kvt__ucx_sock_flush(ep);
    }
    return n > 0 ? n : 0;
}

int kvt__ucx_sock_connect(struct ucx_ep *ep, const char *addr, uint16_t port)
{
    struct sockaddr_storage ss;
    socklen_t len;
    int fd, ret;

    ret = kvt__ucx_sockaddr(addr, port, &ss, &len);
    if (ret < 0)
        return ret;
    fd = socket(ss.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return -errno;
    sock_setup(fd);
    ep->sock = fd;
    ep->sock_connecting = true;
    if (connect(fd, (struct sockaddr *)&ss, len) < 0 && errno != EINPROGRESS) {
        ret = -errno;
        close(fd);
        ep->sock = -1;
        return ret;
    }
    sock_watch(ep, EPOLLOUT);
    return 0;
}

int kvt__ucx_sock_listen(struct ucx_tp *tp, const char *addr, uint16_t port, uint16_t *port_p)
{
    struct sockaddr_storage ss;
    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = NULL};
    socklen_t len;
    int fd, one = 1, ret;

    if (tp->lfd >= 0)
        return -EBUSY;
    ret = kvt__ucx_sockaddr(addr, port, &ss, &len);
    if (ret < 0)
        return ret;
    fd = socket(ss.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return -errno;
    /* A node restarted after SIGKILL listens on its port again while the dead
     * process's connections sit in TIME_WAIT. */
    (void)setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (bind(fd, (struct sockaddr *)&ss, len) < 0 || listen(fd, SOCK_LISTEN_QUEUE) < 0 ||
        getsockname(fd, (struct sockaddr *)&ss, &len) < 0 ||
        epoll_ctl(tp->sfd, EPOLL_CTL_ADD, fd, &ev) < 0) {
        ret = -errno;
        kvt_error("ucx", "listen on %s:%u: %s", addr, port, strerror(-ret));
        close(fd);
        return ret;
    }
    tp->lfd = fd;
    if (port_p != NULL)
        *port_p = ss.ss_family == AF_INET6 ? ntohs(((struct sockaddr_in6 *)&ss)->sin6_port)
                                           : ntohs(((struct sockaddr_in *)&ss)->sin_port);
    return 0;
}

void kvt__ucx_sock_close_listener(struct ucx_tp *tp)
{
    if (tp->lfd < 0)
        return;
    (void)epoll_ctl(tp->sfd, EPOLL_CTL_DEL, tp->lfd, NULL);
    close(tp->lfd);
    tp->lfd = -1;
}

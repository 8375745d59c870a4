/* Our own TCP listener and connections for the UCX backend (see ucx.c, ucx_int.h):
 * everything a peer can send before its endpoint is authorized arrives here, as the
 * frames of kvt/tp_frame.h, and nowhere else.
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
 * The socket stays open after both ADDR frames: nothing more may arrive on it but
 * the end of the stream, which is how we learn that the peer went away (a process
 * that dies closes it at once); data after ADDR is a protocol error.
 *
 * Sockets sit in their own epoll set (tp->sfd), which is inside the event fd. The
 * owner's loop may busy-poll kvt_tp_progress, so ucx.c looks at this set only when
 * some socket matters (a handshake, a connect, bytes to write), after the owner
 * slept, or once every UCX_SOCK_EVERY_NS. */
#include <endian.h>
#include <errno.h>
#include <fcntl.h>
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

#define SOCK_READ_BYTES   (16u << 10) /* one read() */
#define SOCK_READS        4           /* reads per endpoint per poll, at most */
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
    return (ep->sock_eof ? 0 : EPOLLIN) | (ep->out_len > 0 ? EPOLLOUT : 0);
}

static void sock_setup(int fd)
{
    int one = 1;

    (void)setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

/* A read failure or a protocol error: the ep fails (counted while unauthorized). */
static void sock_bad_input(struct ucx_ep *ep, const char *why)
{
    if (!ep->authorized) {
        ep->tp->counters.refused[KVT_TP_PREAUTH_MALFORMED]++;
        kvt_debug("ucx", "endpoint %llu: %s before authorize; closed", (unsigned long long)ep->id,
                  why);
    } else {
        kvt_warn("ucx", "endpoint %llu: %s on its connection; closed", (unsigned long long)ep->id,
                 why);
    }
    kvt__ucx_ep_fail(ep, -EPROTO);
}

void kvt__ucx_sock_close(struct ucx_ep *ep)
{
    if (ep->sock < 0)
        return;
    /* What is queued goes out first (a REFUSE before the close), unless the owner
     * refused the connection: then not even our HELLO. */
    if (ep->out_len > 0 && !ep->sock_connecting && !ep->silent)
        (void)send(ep->sock, ep->out, ep->out_len, MSG_NOSIGNAL | MSG_DONTWAIT);
    sock_watch(ep, 0);
    close(ep->sock);
    ep->sock = -1;
    ep->sock_events = 0;
    ep->out_len = 0;
    kvt__ucx_ep_account(ep);
}

void kvt__ucx_sock_flush(struct ucx_ep *ep)
{
    size_t off = 0;

    if (ep->sock < 0 || ep->sock_connecting || ep->state == EP_ACCEPTING)
        return;
    while (off < ep->out_len) {
        ssize_t n = send(ep->sock, ep->out + off, ep->out_len - off, MSG_NOSIGNAL | MSG_DONTWAIT);

        if (n > 0) {
            off += (size_t)n;
            continue;
        }
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
            break;
        ep->sock_eof = true; /* the peer is gone: dispatch fails the ep */
        ep->tp->kick = true;
        off = ep->out_len;
    }
    if (off > 0) {
        memmove(ep->out, ep->out + off, ep->out_len - off);
        ep->out_len -= off;
    }
    sock_watch(ep, sock_wanted(ep));
    kvt__ucx_ep_account(ep);
}

int kvt__ucx_sock_frame(struct ucx_ep *ep, uint8_t type, const void *a, size_t alen, const void *b,
                        size_t blen)
{
    size_t need = ep->out_len + KVT_TP_FRAME_HDR + alen + blen;

    if (ep->sock < 0)
        return -ENOTCONN;
    if (need > ep->out_cap) {
        size_t cap = KVT_MAX(need, ep->out_cap * 2);
        uint8_t *p = kvt_realloc(ep->out, cap);

        if (p == NULL)
            return -ENOMEM;
        ep->out = p;
        ep->out_cap = cap;
    }
    kvt_tp_frame_hdr(ep->out + ep->out_len, type, (uint32_t)(alen + blen));
    ep->out_len += KVT_TP_FRAME_HDR;
    if (alen > 0)
        memcpy(ep->out + ep->out_len, a, alen);
    ep->out_len += alen;
    if (blen > 0)
        memcpy(ep->out + ep->out_len, b, blen);
    ep->out_len += blen;
    kvt__ucx_sock_flush(ep);
    return 0;
}

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

/* The peer's ADDR: its token and worker address, kept until we authorize too. */
static int sock_peer_addr(struct ucx_ep *ep, const uint8_t *p, size_t len)
{
    size_t wlen = len - UCX_TOKEN_BYTES;

    ep->peer_waddr = kvt_malloc(wlen);
    if (ep->peer_waddr == NULL)
        return -ENOMEM;
    memcpy(ep->peer_token, p, UCX_TOKEN_BYTES);
    memcpy(ep->peer_waddr, p + UCX_TOKEN_BYTES, wlen);
    ep->peer_waddr_len = wlen;
    ep->peer_addr = true;
    return 0;
}

static void sock_frame_in(struct ucx_ep *ep, const struct kvt_tp_frame *f)
{
    uint32_t version;
    int rc = 0;

    switch (f->type) {
    case KVT_TP_FRAME_HELLO:
        memcpy(&version, f->payload, sizeof(version));
        if (le32toh(version) != UCX_VERSION) {
            kvt_warn("ucx", "endpoint %llu: the peer speaks version %u, we %u",
                     (unsigned long long)ep->id, le32toh(version), UCX_VERSION);
            sock_bad_input(ep, "another protocol version");
            return;
        }
        rc = sock_rx(ep, RX_HELLO, NULL, 0);
        break;
    case KVT_TP_FRAME_DATA:
        rc = sock_rx(ep, RX_DATA, f->payload, f->len);
        break;
    case KVT_TP_FRAME_RDREQ:
        rc = sock_rx(ep, RX_RDREQ, f->payload, f->len);
        break;
    case KVT_TP_FRAME_ADDR:
        rc = sock_peer_addr(ep, f->payload, f->len);
        if (rc == 0 && ep->authorized)
            rc = kvt__ucx_ep_wire(ep);
        break;
    default: /* the reader lets no other type through */
        rc = -EPROTO;
    }
    if (rc < 0)
        kvt__ucx_ep_fail(ep, rc);
}

static void sock_read(struct ucx_ep *ep)
{
    uint8_t buf[SOCK_READ_BYTES];

    for (int i = 0; i < SOCK_READS && ep->sock >= 0 && ep->state < EP_FAILED; i++) {
        ssize_t n = recv(ep->sock, buf, sizeof(buf), MSG_DONTWAIT);
        size_t off = 0;

        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
            return;
        if (n <= 0) { /* the peer closed (or reset): deliver what came, then fail */
            ep->sock_eof = true;
            ep->tp->kick = true;
            kvt__ucx_sock_close(ep);
            return;
        }
        while (off < (size_t)n && ep->state < EP_FAILED) {
            struct kvt_tp_frame f;
            size_t used;
            int rc;

            if (ep->reader == NULL) {
                sock_bad_input(ep, "bytes after the peer's address");
                return;
            }
            rc = kvt_tp_frame_push(ep->reader, buf + off, (size_t)n - off, &used, &f);
            off += used;
            if (rc < 0) {
                sock_bad_input(ep, "bytes that are not our protocol");
                return;
            }
            if (rc == 0)
                break;
            sock_frame_in(ep, &f);
            if (f.type == KVT_TP_FRAME_ADDR) { /* the last frame: the reader is done */
                kvt_free(ep->reader);
                ep->reader = NULL;
                kvt__ucx_ep_account(ep);
            }
        }
    }
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

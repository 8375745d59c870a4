/* SPDX-License-Identifier: Apache-2.0 */
/* kvtierd's /metrics and /healthz (see kvt/metrics_http.h): a small HTTP/1.x server on
 * one thread of its own, poll() over an eventfd (stop), the listen socket and at most
 * max_connections connections.
 *
 * A connection lives in three states, each with a deadline from the thread's clock:
 *   READ   until the request's headers end ("\r\n\r\n"), read_timeout_ms from accept:
 *          a client that sends one byte a second is closed like a silent one;
 *   WRITE  until the reply has left, write_timeout_ms from the end of the request;
 *   DRAIN  the reply is out and our side shut down: what the client still sends is
 *          read and dropped until its EOF (closing with unread bytes would reset the
 *          connection and could cut the reply short), at most read_timeout_ms.
 * When every slot is taken, a new connection first closes one that is done (DRAIN),
 * else the oldest one still in READ (counted "full"), else it is closed itself: a
 * crowd of slow connections delays a scrape by at most the time to open enough new
 * ones, never for good. Requests are one per connection; their headers are bounded
 * (8 KiB) and a body is never read.
 *
 * It replaces libmicrohttpd, whose idle timeout restarts at every byte and whose full
 * server refuses new connections: 64 clients sending a byte now and then held it.
 *
 * The page is a snapshot: publish copies the new text outside the lock and swaps the
 * pointer under it; a reply copies the current text under the same lock. The HTTP
 * thread never sees anything of the node but that text and the health flag. */
#include <errno.h>
#include <netdb.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include "accept_rest.h"
#include "kvt/alloc.h"
#include "kvt/clock.h"
#include "kvt/log.h"
#include "kvt/metrics_http.h"
#include "kvt/prom.h"

#define MOD         "metrics_http"
#define REQUEST_MAX 8192 /* bytes of a request line and its headers */
#define HEAD_MAX    512  /* bytes of our reply's status line and headers */
#define TURN_MAX    64   /* recv or accept calls per connection (or listen socket) per poll */

enum hstate { H_READ, H_WRITE, H_DRAIN };

/* HTTP thread only. */
struct hconn {
    int fd;
    enum hstate state;
    uint64_t accepted_ns;
    uint64_t deadline_ns;
    size_t in_len;
    char in[REQUEST_MAX + 1];
    char *out; /* the whole reply */
    size_t out_len, out_off;
};

/* Owned: the listen socket, the eventfd, the thread, the connections, the page. The
 * node thread writes page/page_len under lock; the server thread reads them under
 * lock. Counters are written by the server thread, read by the node thread. */
struct kvt_metrics_http {
    int listen_fd;
    int wake_fd;
    uint16_t port;
    pthread_t thread;
    atomic_bool stop;
    atomic_bool healthy;
    pthread_mutex_t lock;
    char *page; /* NULL until the first publish */
    size_t page_len;
    int failed; /* negative errno of the last render or publish that failed, else 0 */
    unsigned max_conns;
    uint64_t read_ns, write_ns;
    struct hconn *conns; /* [0..n_conns), HTTP thread only */
    unsigned n_conns;
    struct pollfd *pfds;                /* 2 + max_conns */
    struct kvt_accept_rest accept_rest; /* HTTP thread only: the listen socket's rest */
    _Atomic uint64_t accepted, served, open;
    _Atomic uint64_t dropped[KVT_MHTTP_DROP_COUNT];
};

static const char *const drop_names[KVT_MHTTP_DROP_COUNT] = {
    [KVT_MHTTP_FULL] = "full",
    [KVT_MHTTP_READ_TIMEOUT] = "read_timeout",
    [KVT_MHTTP_WRITE_TIMEOUT] = "write_timeout",
    [KVT_MHTTP_BAD_REQUEST] = "bad_request",
};

const char *kvt_metrics_http_drop_name(enum kvt_metrics_http_drop d)
{
    return (unsigned)d < KVT_MHTTP_DROP_COUNT ? drop_names[d] : "unknown";
}

static void count_drop(struct kvt_metrics_http *srv, enum kvt_metrics_http_drop d)
{
    atomic_fetch_add_explicit(&srv->dropped[d], 1, memory_order_relaxed);
}

/* ---- replies ---------------------------------------------------------------------- */

static const char *reason(unsigned status)
{
    switch (status) {
    case 200:
        return "OK";
    case 400:
        return "Bad Request";
    case 404:
        return "Not Found";
    case 405:
        return "Method Not Allowed";
    case 500:
        return "Internal Server Error";
    default:
        return "Service Unavailable";
    }
}

/* Makes c's reply: status line, headers, and body[0..len) unless head_only. The page
 * is copied under the lock when body is NULL and the page is published. */
static int make_reply(struct kvt_metrics_http *srv, struct hconn *c, unsigned status,
                      const char *type, const char *body, size_t len, bool allow, bool head_only)
{
    char head[HEAD_MAX];
    bool page = body == NULL;
    int n;

    if (page)
        pthread_mutex_lock(&srv->lock);
    if (page)
        len = srv->page_len;
    n = snprintf(head, sizeof(head),
                 "HTTP/1.1 %u %s\r\nContent-Type: %s\r\nContent-Length: %zu\r\n"
                 "Connection: close\r\n%s\r\n",
                 status, reason(status), type, len, allow ? "Allow: GET, HEAD\r\n" : "");
    c->out_len = (size_t)n + (head_only ? 0 : len);
    c->out = kvt_malloc(c->out_len);
    if (c->out != NULL) {
        memcpy(c->out, head, (size_t)n);
        if (!head_only && len > 0)
            memcpy(c->out + n, page ? srv->page : body, len);
    }
    if (page)
        pthread_mutex_unlock(&srv->lock);
    c->out_off = 0;
    return c->out != NULL ? 0 : -ENOMEM;
}

static int reply_text(struct kvt_metrics_http *srv, struct hconn *c, unsigned status,
                      const char *text, bool allow, bool head_only)
{
    return make_reply(srv, c, status, "text/plain; charset=utf-8", text, strlen(text), allow,
                      head_only);
}

enum kvt_metrics_http_route kvt__metrics_http_route(char *req, bool *head_p)
{
    char *method = req, *target, *version, *eol = strpbrk(req, "\r\n");
    bool is_metrics, is_health;

    *head_p = false;
    if (eol == NULL) /* (the caller found the headers' end: never) */
        return KVT_MHTTP_ROUTE_BAD;
    *eol = '\0';
    target = strchr(method, ' ');
    version = target != NULL ? strchr(target + 1, ' ') : NULL;
    if (target == NULL || version == NULL || strncmp(version + 1, "HTTP/1.", 7) != 0 ||
        target == method)
        return KVT_MHTTP_ROUTE_BAD;
    *target++ = '\0';
    *version = '\0';
    target[strcspn(target, "?#")] = '\0'; /* the path alone */
    is_metrics = strcmp(target, "/metrics") == 0;
    is_health = strcmp(target, "/healthz") == 0;
    *head_p = strcmp(method, "HEAD") == 0;
    if (!is_metrics && !is_health)
        return KVT_MHTTP_ROUTE_NOT_FOUND;
    if (strcmp(method, "GET") != 0 && !*head_p)
        return KVT_MHTTP_ROUTE_METHOD;
    return is_health ? KVT_MHTTP_ROUTE_HEALTH : KVT_MHTTP_ROUTE_METRICS;
}

/* Answers the request in c->in (headers complete). */
static int answer(struct kvt_metrics_http *srv, struct hconn *c)
{
    bool head;

    switch (kvt__metrics_http_route(c->in, &head)) {
    case KVT_MHTTP_ROUTE_BAD:
        count_drop(srv, KVT_MHTTP_BAD_REQUEST);
        return reply_text(srv, c, 400, "bad request\n", false, false);
    case KVT_MHTTP_ROUTE_NOT_FOUND:
        return reply_text(srv, c, 404, "not found\n", false, head);
    case KVT_MHTTP_ROUTE_METHOD:
        return reply_text(srv, c, 405, "method not allowed\n", true, false);
    case KVT_MHTTP_ROUTE_HEALTH:
        return atomic_load(&srv->healthy) ? reply_text(srv, c, 200, "ok\n", false, head)
                                          : reply_text(srv, c, 503, "unavailable\n", false, head);
    case KVT_MHTTP_ROUTE_METRICS:
        break;
    }
    pthread_mutex_lock(&srv->lock);
    bool published = srv->page != NULL;
    int failed = srv->failed;
    pthread_mutex_unlock(&srv->lock); /* the page only ever changes, never goes */
    if (failed != 0) {
        /* Never the last good page: a scraper must see that the numbers stopped. */
        char body[128];

        snprintf(body, sizeof(body), "metrics could not be rendered: %s\n", strerror(-failed));
        return reply_text(srv, c, 500, body, false, head);
    }
    if (!published)
        return reply_text(srv, c, 503, "no metrics published yet\n", false, head);
    return make_reply(srv, c, 200, KVT_PROM_CONTENT_TYPE, NULL, 0, false, head);
}

/* ---- connections ---------------------------------------------------------------- */

/* Closes c (the slot is reused by the caller's compaction). */
static void conn_close(struct kvt_metrics_http *srv, struct hconn *c)
{
    close(c->fd);
    c->fd = -1;
    kvt_free(c->out);
    c->out = NULL;
    atomic_fetch_sub_explicit(&srv->open, 1, memory_order_relaxed);
}

static void start_write(struct kvt_metrics_http *srv, struct hconn *c, uint64_t now)
{
    c->state = H_WRITE;
    c->deadline_ns = now + srv->write_ns;
}

/* A 400 for a request that cannot be answered, counted. */
static void refuse_request(struct kvt_metrics_http *srv, struct hconn *c, const char *why,
                           uint64_t now)
{
    count_drop(srv, KVT_MHTTP_BAD_REQUEST);
    if (reply_text(srv, c, 400, why, false, false) != 0) {
        conn_close(srv, c);
        return;
    }
    start_write(srv, c, now);
}

static void conn_read(struct kvt_metrics_http *srv, struct hconn *c, uint64_t now)
{
    /* Bounded per turn: a client that floods its connection waits for the next one
     * (and for its deadline) like the others. */
    for (int i = 0; i < TURN_MAX; i++) {
        ssize_t n;

        if (c->state == H_DRAIN) {
            char sink[4096];

            n = recv(c->fd, sink, sizeof(sink), MSG_DONTWAIT);
        } else {
            n = recv(c->fd, c->in + c->in_len, REQUEST_MAX - c->in_len, MSG_DONTWAIT);
        }
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
            return;
        if (n <= 0) { /* gone (before its request was whole: nothing to answer) */
            conn_close(srv, c);
            return;
        }
        if (c->state == H_DRAIN)
            continue;
        /* Only the new bytes and the 3 before them can complete the end of the
         * headers: a client sending a byte at a time costs O(1) per byte. */
        char *from = c->in + (c->in_len > 3 ? c->in_len - 3 : 0);
        /* HTTP has no NUL in its headers, and the string functions below would stop
         * at one: the end could be found past a NUL that hides the request line. */
        bool nul = memchr(c->in + c->in_len, '\0', (size_t)n) != NULL;

        c->in_len += (size_t)n;
        c->in[c->in_len] = '\0';
        if (nul) {
            refuse_request(srv, c, "bad request\n", now);
            return;
        }
        if (strstr(from, "\r\n\r\n") != NULL || strstr(from, "\n\n") != NULL) {
            if (answer(srv, c) != 0) {
                conn_close(srv, c);
                return;
            }
            start_write(srv, c, now);
            return;
        }
        if (c->in_len == REQUEST_MAX) {
            refuse_request(srv, c, "request headers too large\n", now);
            return;
        }
    }
}

static void conn_write(struct kvt_metrics_http *srv, struct hconn *c, uint64_t now)
{
    while (c->out_off < c->out_len) {
        ssize_t n =
            send(c->fd, c->out + c->out_off, c->out_len - c->out_off, MSG_NOSIGNAL | MSG_DONTWAIT);

        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
            return;
        if (n < 0) {
            conn_close(srv, c);
            return;
        }
        c->out_off += (size_t)n;
    }
    atomic_fetch_add_explicit(&srv->served, 1, memory_order_relaxed);
    kvt_free(c->out);
    c->out = NULL;
    shutdown(c->fd, SHUT_WR);
    c->state = H_DRAIN;
    c->deadline_ns = now + srv->read_ns;
}

/* Room for one more connection: closes one that is done, else the oldest one still
 * reading its request. False when every connection is writing a reply. */
static bool make_room(struct kvt_metrics_http *srv)
{
    struct hconn *victim = NULL;

    for (unsigned i = 0; i < srv->n_conns; i++) {
        struct hconn *c = &srv->conns[i];

        if (c->fd < 0)
            return true;
        if (c->state == H_DRAIN) {
            conn_close(srv, c);
            return true;
        }
        if (c->state == H_READ && (victim == NULL || c->accepted_ns < victim->accepted_ns))
            victim = c;
    }
    if (victim == NULL)
        return false;
    count_drop(srv, KVT_MHTTP_FULL);
    conn_close(srv, victim);
    return true;
}

/* Removes closed connections from the array. */
static void compact(struct kvt_metrics_http *srv)
{
    unsigned n = 0;

    for (unsigned i = 0; i < srv->n_conns; i++)
        if (srv->conns[i].fd >= 0)
            srv->conns[n++] = srv->conns[i];
    srv->n_conns = n;
}

static void accept_all(struct kvt_metrics_http *srv, uint64_t now)
{
    for (int i = 0; i < TURN_MAX; i++) {
        int fd = accept4(srv->listen_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        struct hconn *c;

        if (fd < 0) {
            if (errno == EINTR || errno == ECONNABORTED)
                continue;
            if (errno != EAGAIN && errno != EWOULDBLOCK)
                (void)kvt_accept_failed(&srv->accept_rest, MOD, "the metrics port", errno, now);
            return;
        }
        atomic_fetch_add_explicit(&srv->accepted, 1, memory_order_relaxed);
        atomic_fetch_add_explicit(&srv->open, 1, memory_order_relaxed);
        if (srv->n_conns == srv->max_conns) {
            bool room = make_room(srv);

            compact(srv);
            if (!room) {
                count_drop(srv, KVT_MHTTP_FULL);
                close(fd);
                atomic_fetch_sub_explicit(&srv->open, 1, memory_order_relaxed);
                continue;
            }
        }
        c = &srv->conns[srv->n_conns++];
        c->fd = fd;
        c->state = H_READ;
        c->accepted_ns = now;
        c->deadline_ns = now + srv->read_ns;
        c->in_len = 0;
        c->out = NULL;
        c->out_len = c->out_off = 0;
    }
}

static void *serve(void *arg)
{
    struct kvt_metrics_http *srv = arg;

    while (!atomic_load(&srv->stop)) {
        uint64_t now = kvt_now_ns(), next = UINT64_MAX;
        int timeout = -1, n;

        srv->pfds[0] = (struct pollfd){.fd = srv->wake_fd, .events = POLLIN};
        if (srv->accept_rest.until != 0 && now >= srv->accept_rest.until)
            srv->accept_rest.until = 0;
        if (srv->accept_rest.until != 0)
            next = srv->accept_rest.until;
        /* A negative fd is left out by poll: the listen socket rests. */
        srv->pfds[1] = (struct pollfd){.fd = srv->accept_rest.until != 0 ? -1 : srv->listen_fd,
                                       .events = POLLIN};
        for (unsigned i = 0; i < srv->n_conns; i++) {
            struct hconn *c = &srv->conns[i];

            srv->pfds[2 + i] =
                (struct pollfd){.fd = c->fd, .events = c->state == H_WRITE ? POLLOUT : POLLIN};
            if (c->deadline_ns < next)
                next = c->deadline_ns;
        }
        if (next != UINT64_MAX)
            timeout = next <= now ? 0 : (int)((next - now + 999999) / 1000000);
        n = poll(srv->pfds, 2 + srv->n_conns, timeout);
        if (n < 0 && errno != EINTR) {
            kvt_error(MOD, "poll: %s", strerror(errno));
            break;
        }
        now = kvt_now_ns();
        for (unsigned i = 0; n > 0 && i < srv->n_conns; i++) {
            struct hconn *c = &srv->conns[i];
            short re = srv->pfds[2 + i].revents;

            if (re == 0)
                continue;
            if (c->state == H_WRITE)
                conn_write(srv, c, now);
            else
                conn_read(srv, c, now);
        }
        for (unsigned i = 0; i < srv->n_conns; i++) {
            struct hconn *c = &srv->conns[i];

            if (c->fd < 0 || c->deadline_ns > now)
                continue;
            if (c->state == H_READ)
                count_drop(srv, KVT_MHTTP_READ_TIMEOUT);
            else if (c->state == H_WRITE)
                count_drop(srv, KVT_MHTTP_WRITE_TIMEOUT);
            conn_close(srv, c);
        }
        compact(srv);
        if (n > 0 && (srv->pfds[1].revents & POLLIN))
            accept_all(srv, now);
        if (n > 0 && (srv->pfds[0].revents & POLLIN)) {
            uint64_t v;

            if (read(srv->wake_fd, &v, sizeof(v)) < 0) { /* EAGAIN: nothing to clear */
            }
        }
    }
    return NULL;
}

/* ---- life cycle ------------------------------------------------------------------- */

/* A bound, listening, non-blocking socket on listen:port. */
static int listen_socket(const char *listen_addr, uint16_t port, int *fd_p, uint16_t *port_p)
{
    struct addrinfo hints = {.ai_socktype = SOCK_STREAM, .ai_flags = AI_PASSIVE | AI_NUMERICSERV};
    struct addrinfo *ai;
    struct sockaddr_storage ss;
    socklen_t sl = sizeof(ss);
    char service[8];
    int fd, rc, one = 1;

    snprintf(service, sizeof(service), "%u", (unsigned)port);
    rc = getaddrinfo(listen_addr, service, &hints, &ai);
    if (rc != 0) {
        kvt_error(MOD, "listen address %s: %s", listen_addr, gai_strerror(rc));
        return rc == EAI_MEMORY ? -ENOMEM : -EINVAL;
    }
    fd = socket(ai->ai_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) {
        rc = -errno;
        kvt_error(MOD, "socket: %s", strerror(errno));
        goto out_ai;
    }
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (bind(fd, ai->ai_addr, ai->ai_addrlen) < 0 || listen(fd, 64) < 0 ||
        getsockname(fd, (struct sockaddr *)&ss, &sl) < 0) {
        rc = -errno;
        kvt_error(MOD, "listen on %s:%u: %s", listen_addr, (unsigned)port, strerror(errno));
        close(fd);
        goto out_ai;
    }
    *port_p = ntohs(ss.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&ss)->sin6_port
                                             : ((struct sockaddr_in *)&ss)->sin_port);
    *fd_p = fd;
    rc = 0;
out_ai:
    freeaddrinfo(ai);
    return rc;
}

int kvt_metrics_http_create_cfg(const struct kvt_metrics_http_config *cfg,
                                struct kvt_metrics_http **srv_p)
{
    struct kvt_metrics_http *srv;
    int rc;

    if (cfg == NULL || cfg->listen == NULL || srv_p == NULL)
        return -EINVAL;
    srv = kvt_calloc(1, sizeof(*srv));
    if (srv == NULL)
        return -ENOMEM;
    srv->listen_fd = srv->wake_fd = -1;
    pthread_mutex_init(&srv->lock, NULL);
    atomic_init(&srv->healthy, true);
    atomic_init(&srv->stop, false);
    srv->max_conns = cfg->max_connections ? cfg->max_connections : 16;
    srv->read_ns = (cfg->read_timeout_ms ? cfg->read_timeout_ms : 5000) * 1000000ull;
    srv->write_ns = (cfg->write_timeout_ms ? cfg->write_timeout_ms : 10000) * 1000000ull;
    srv->conns = kvt_calloc(srv->max_conns, sizeof(*srv->conns));
    srv->pfds = kvt_calloc(2 + (size_t)srv->max_conns, sizeof(*srv->pfds));
    if (srv->conns == NULL || srv->pfds == NULL) {
        rc = -ENOMEM;
        goto err_free;
    }
    rc = listen_socket(cfg->listen, cfg->port, &srv->listen_fd, &srv->port);
    if (rc < 0)
        goto err_free;
    srv->wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (srv->wake_fd < 0) {
        rc = -errno;
        goto err_listen;
    }
    rc = -pthread_create(&srv->thread, NULL, serve, srv);
    if (rc != 0) {
        kvt_error(MOD, "cannot start the HTTP thread: %s", strerror(-rc));
        goto err_wake;
    }
    kvt_info(MOD, "serving /metrics and /healthz on %s:%u", cfg->listen, (unsigned)srv->port);
    *srv_p = srv;
    return 0;

err_wake:
    close(srv->wake_fd);
err_listen:
    close(srv->listen_fd);
err_free:
    kvt_free(srv->conns);
    kvt_free(srv->pfds);
    pthread_mutex_destroy(&srv->lock);
    kvt_free(srv);
    return rc;
}

int kvt_metrics_http_create(const char *listen_addr, uint16_t port, struct kvt_metrics_http **srv_p)
{
    struct kvt_metrics_http_config cfg = {.listen = listen_addr, .port = port};

    return kvt_metrics_http_create_cfg(&cfg, srv_p);
}

void kvt_metrics_http_destroy(struct kvt_metrics_http *srv)
{
    uint64_t one = 1;

    if (srv == NULL)
        return;
    atomic_store(&srv->stop, true);
    if (write(srv->wake_fd, &one, sizeof(one)) < 0) { /* a full eventfd wakes it too */
    }
    pthread_join(srv->thread, NULL);
    for (unsigned i = 0; i < srv->n_conns; i++)
        if (srv->conns[i].fd >= 0)
            conn_close(srv, &srv->conns[i]);
    close(srv->wake_fd);
    close(srv->listen_fd);
    pthread_mutex_destroy(&srv->lock);
    kvt_free(srv->conns);
    kvt_free(srv->pfds);
    kvt_free(srv->page);
    kvt_free(srv);
}

uint16_t kvt_metrics_http_port(const struct kvt_metrics_http *srv)
{
    return srv->port;
}

int kvt_metrics_http_publish(struct kvt_metrics_http *srv, const char *text, size_t len)
{
    char *copy = kvt_malloc(len + 1), *old;

    if (copy == NULL) {
        kvt_metrics_http_publish_failure(srv, -ENOMEM);
        return -ENOMEM;
    }
    memcpy(copy, text, len);
    copy[len] = '\0';
    pthread_mutex_lock(&srv->lock);
    old = srv->page;
    srv->page = copy;
    srv->page_len = len;
    srv->failed = 0;
    pthread_mutex_unlock(&srv->lock);
    kvt_free(old);
    return 0;
}

void kvt_metrics_http_publish_failure(struct kvt_metrics_http *srv, int err)
{
    pthread_mutex_lock(&srv->lock);
    srv->failed = err < 0 ? err : -EIO;
    pthread_mutex_unlock(&srv->lock);
}

void kvt_metrics_http_set_healthy(struct kvt_metrics_http *srv, bool healthy)
{
    atomic_store(&srv->healthy, healthy);
}

void kvt_metrics_http_get_counters(const struct kvt_metrics_http *srv,
                                   struct kvt_metrics_http_counters *out)
{
    struct kvt_metrics_http *s = (struct kvt_metrics_http *)srv; /* atomics: loads only */

    out->accepted = atomic_load_explicit(&s->accepted, memory_order_relaxed);
    out->served = atomic_load_explicit(&s->served, memory_order_relaxed);
    out->connections = atomic_load_explicit(&s->open, memory_order_relaxed);
    for (int i = 0; i < KVT_MHTTP_DROP_COUNT; i++)
        out->dropped[i] = atomic_load_explicit(&s->dropped[i], memory_order_relaxed);
}

/* kvtierd's /metrics and /healthz over libmicrohttpd (see kvt/metrics_http.h).
 *
 * We bind and listen on the socket ourselves and hand it to libmicrohttpd
 * (MHD_OPTION_LISTEN_SOCKET): bind errors come back as the errno that caused them, and
 * getsockname gives the port chosen for port 0 without depending on a libmicrohttpd
 * version. libmicrohttpd runs one internal polling thread and closes the socket when it
 * stops.
 *
 * The page is a snapshot: publish copies the new text outside the lock and swaps the
 * pointer under it; the request handler copies the current text into its response
 * under the same lock (MHD_RESPMEM_MUST_COPY). The lock is held for one memcpy on either
 * side, so neither thread waits for the other's work, and the HTTP thread never sees
 * anything of the node but that text and the health flag. */
#include <errno.h>
#include <netdb.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include <microhttpd.h>

#include "kvt/alloc.h"
#include "kvt/log.h"
#include "kvt/metrics_http.h"
#include "kvt/prom.h"

#define MOD "metrics_http"

/* Owned: daemon (which owns the listen socket once started), the page. Node thread
 * writes page/page_len under lock; the server thread reads them under lock. */
struct kvt_metrics_http {
    struct MHD_Daemon *daemon;
    uint16_t port;
    pthread_mutex_t lock;
    char *page; /* NULL until the first publish */
    size_t page_len;
    int failed; /* negative errno of the last render or publish that failed, else 0 */
    atomic_bool healthy;
};

static const char not_found[] = "not found\n";
static const char not_allowed[] = "method not allowed\n";
static const char no_page[] = "no metrics published yet\n";
static const char ok_body[] = "ok\n";
static const char failed_page[] = "metrics could not be rendered: ";
static const char unavailable[] = "unavailable\n";

static enum MHD_Result reply(struct MHD_Connection *conn, unsigned status, const char *type,
                             const void *body, size_t len, bool allow_header)
{
    struct MHD_Response *r;
    enum MHD_Result ret;

    r = MHD_create_response_from_buffer(len, (void *)body, MHD_RESPMEM_MUST_COPY);
    if (r == NULL)
        return MHD_NO; /* out of memory: libmicrohttpd closes the connection */
    if (MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, type) != MHD_YES ||
        (allow_header &&
         MHD_add_response_header(r, MHD_HTTP_HEADER_ALLOW, "GET, HEAD") != MHD_YES)) {
        MHD_destroy_response(r);
        return MHD_NO;
    }
    ret = MHD_queue_response(conn, status, r);
    MHD_destroy_response(r);
    return ret;
}

static enum MHD_Result reply_text(struct MHD_Connection *conn, unsigned status, const char *body,
                                  size_t len)
{
    return reply(conn, status, "text/plain; charset=utf-8", body, len, false);
}

static enum MHD_Result serve_metrics(struct kvt_metrics_http *srv, struct MHD_Connection *conn)
{
    struct MHD_Response *r = NULL;
    enum MHD_Result ret;
    int failed;

    pthread_mutex_lock(&srv->lock);
    failed = srv->failed;
    if (srv->page != NULL && failed == 0)
        r = MHD_create_response_from_buffer(srv->page_len, srv->page, MHD_RESPMEM_MUST_COPY);
    pthread_mutex_unlock(&srv->lock);
    if (failed != 0) {
        /* Never the last good page: a scraper must see that the numbers stopped. */
        char body[128];
        int n = snprintf(body, sizeof(body), "%s%s\n", failed_page, strerror(-failed));

        return reply_text(conn, MHD_HTTP_INTERNAL_SERVER_ERROR, body, (size_t)n);
    }
    if (r == NULL) {
        bool published;

        pthread_mutex_lock(&srv->lock);
        published = srv->page != NULL;
        pthread_mutex_unlock(&srv->lock);
        if (published)
            return MHD_NO; /* out of memory */
        return reply_text(conn, MHD_HTTP_SERVICE_UNAVAILABLE, no_page, sizeof(no_page) - 1);
    }
    if (MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, KVT_PROM_CONTENT_TYPE) !=
        MHD_YES) {
        MHD_destroy_response(r);
        return MHD_NO;
    }
    ret = MHD_queue_response(conn, MHD_HTTP_OK, r);
    MHD_destroy_response(r);
    return ret;
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *conn, const char *url,
                                  const char *method, const char *version, const char *upload_data,
                                  size_t *upload_data_size, void **req_cls)
{
    struct kvt_metrics_http *srv = cls;
    bool is_metrics = strcmp(url, "/metrics") == 0, is_health = strcmp(url, "/healthz") == 0;

    (void)version;
    (void)upload_data;
    (void)upload_data_size;
    (void)req_cls;
    /* Answered at the first call, before any body: a body is never read. */
    if (!is_metrics && !is_health)
        return reply_text(conn, MHD_HTTP_NOT_FOUND, not_found, sizeof(not_found) - 1);
    if (strcmp(method, MHD_HTTP_METHOD_GET) != 0 && strcmp(method, MHD_HTTP_METHOD_HEAD) != 0)
        return reply(conn, MHD_HTTP_METHOD_NOT_ALLOWED, "text/plain; charset=utf-8", not_allowed,
                     sizeof(not_allowed) - 1, true);
    if (is_metrics)
        return serve_metrics(srv, conn);
    if (atomic_load(&srv->healthy))
        return reply_text(conn, MHD_HTTP_OK, ok_body, sizeof(ok_body) - 1);
    return reply_text(conn, MHD_HTTP_SERVICE_UNAVAILABLE, unavailable, sizeof(unavailable) - 1);
}

static void mhd_log(void *cls, const char *fmt, va_list ap)
{
    char msg[256];

    (void)cls;
    vsnprintf(msg, sizeof(msg), fmt, ap);
    msg[strcspn(msg, "\n")] = '\0';
    kvt_warn(MOD, "libmicrohttpd: %s", msg);
}

/* A bound, listening socket on listen:port; its family in *family_p. */
static int listen_socket(const char *listen_addr, uint16_t port, int *fd_p, int *family_p,
                         uint16_t *port_p)
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
    fd = socket(ai->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
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
    *family_p = ai->ai_family;
    *port_p = ntohs(ss.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&ss)->sin6_port
                                             : ((struct sockaddr_in *)&ss)->sin_port);
    *fd_p = fd;
    rc = 0;
out_ai:
    freeaddrinfo(ai);
    return rc;
}

int kvt_metrics_http_create(const char *listen_addr, uint16_t port, struct kvt_metrics_http **srv_p)
{
    struct kvt_metrics_http *srv;
    unsigned flags = MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_AUTO | MHD_USE_ERROR_LOG;
    int fd = -1, family = AF_UNSPEC, rc;

    if (listen_addr == NULL || srv_p == NULL)
        return -EINVAL;
    srv = kvt_calloc(1, sizeof(*srv));
    if (srv == NULL)
        return -ENOMEM;
    pthread_mutex_init(&srv->lock, NULL);
    atomic_init(&srv->healthy, true);
    rc = listen_socket(listen_addr, port, &fd, &family, &srv->port);
    if (rc < 0)
        goto out_free;
    if (family == AF_INET6)
        flags |= MHD_USE_IPv6;
    srv->daemon = MHD_start_daemon(
        flags, 0, NULL, NULL, on_request, srv, MHD_OPTION_EXTERNAL_LOGGER, mhd_log, NULL,
        MHD_OPTION_LISTEN_SOCKET, (MHD_socket)fd, MHD_OPTION_CONNECTION_LIMIT, (unsigned)64,
        MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)10, MHD_OPTION_END);
    if (srv->daemon == NULL) {
        kvt_error(MOD, "libmicrohttpd did not start on %s:%u", listen_addr, (unsigned)srv->port);
        close(fd);
        rc = -EIO;
        goto out_free;
    }
    kvt_info(MOD, "serving /metrics and /healthz on %s:%u", listen_addr, (unsigned)srv->port);
    *srv_p = srv;
    return 0;
out_free:
    pthread_mutex_destroy(&srv->lock);
    kvt_free(srv);
    return rc;
}

void kvt_metrics_http_destroy(struct kvt_metrics_http *srv)
{
    if (srv == NULL)
        return;
    MHD_stop_daemon(srv->daemon); /* joins the thread, closes the listen socket */
    pthread_mutex_destroy(&srv->lock);
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

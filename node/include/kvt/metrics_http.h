/* SPDX-License-Identifier: Apache-2.0 */
/* kvtierd's HTTP endpoint (one thread of its own):
 *   GET /metrics  the latest published page, Content-Type KVT_PROM_CONTENT_TYPE
 *                 (503 until the first publish; 500 with the cause while the node's
 *                 last render or publish failed: never a stale page)
 *   GET /healthz  "ok\n" (503 "unavailable\n" once the node says it is not healthy,
 *                 e.g. while it drains on SIGTERM)
 *   anything else 404; a method other than GET or HEAD 405 (with "Allow: GET, HEAD").
 * The node loop renders the page (kvt/prom.h) and publishes it; the HTTP thread only
 * copies the latest published text under a mutex, so it never touches the manager.
 *
 * Slow or idle clients cannot take the endpoint: at most max_connections at once,
 * each with read_timeout_ms from its connection to its whole request and
 * write_timeout_ms for the whole reply; when all are taken, a new connection closes
 * the oldest one still sending its request. One request per connection (the reply
 * says "Connection: close"). Every connection closed early is counted by reason.
 *
 * Threads: create, publish, set_healthy, get_counters and destroy on one thread (the
 * node loop); the server thread only reads the snapshot. */
#ifndef KVT_METRICS_HTTP_H
#define KVT_METRICS_HTTP_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct kvt_metrics_http;

struct kvt_metrics_http_config {
    const char *listen;        /* a numeric address or a host name (its first address) */
    uint16_t port;             /* 0: any free port, see kvt_metrics_http_port */
    unsigned max_connections;  /* 0 = 16 */
    unsigned read_timeout_ms;  /* 0 = 5000: connection to the end of the request */
    unsigned write_timeout_ms; /* 0 = 10000: the whole reply */
};

/* Listens and starts the server thread. -EINVAL for an address that does not resolve,
 * the bind/listen errno (-EADDRINUSE, -EACCES, -EADDRNOTAVAIL...), -ENOMEM, or the
 * errno of a thread that cannot start. Logs the cause once. */
int kvt_metrics_http_create_cfg(const struct kvt_metrics_http_config *cfg,
                                struct kvt_metrics_http **srv_p);
/* The same with the default bounds. */
int kvt_metrics_http_create(const char *listen, uint16_t port, struct kvt_metrics_http **srv_p);
/* Stops the thread (requests in progress are cut), closes every socket. */
void kvt_metrics_http_destroy(struct kvt_metrics_http *srv);

/* The port the server listens on (the chosen one when created with port 0). */
uint16_t kvt_metrics_http_port(const struct kvt_metrics_http *srv);

/* Replaces the page served on /metrics by a copy of text[0..len). 0, or -ENOMEM
 * (then /metrics answers 500 until a publish succeeds). */
int kvt_metrics_http_publish(struct kvt_metrics_http *srv, const char *text, size_t len);
/* The node could not render its page (err: negative errno): /metrics answers 500
 * naming the cause until the next successful publish. */
void kvt_metrics_http_publish_failure(struct kvt_metrics_http *srv, int err);
void kvt_metrics_http_set_healthy(struct kvt_metrics_http *srv, bool healthy);

/* Why a connection was closed before its reply was sent. */
enum kvt_metrics_http_drop {
    KVT_MHTTP_FULL = 0,      /* max_connections reached: the oldest reading one, or the new */
    KVT_MHTTP_READ_TIMEOUT,  /* no whole request within read_timeout_ms */
    KVT_MHTTP_WRITE_TIMEOUT, /* the reply not taken within write_timeout_ms */
    KVT_MHTTP_BAD_REQUEST,   /* not an HTTP request, or headers over 8 KiB (400 sent) */
    KVT_MHTTP_DROP_COUNT,
};
/* "full", "read_timeout", ... (a Prometheus label value). */
const char *kvt_metrics_http_drop_name(enum kvt_metrics_http_drop d);

/* What a request asks for (kvt__metrics_http_route; for the fuzz target and tests). */
enum kvt_metrics_http_route {
    KVT_MHTTP_ROUTE_METRICS = 0, /* GET or HEAD /metrics */
    KVT_MHTTP_ROUTE_HEALTH,      /* GET or HEAD /healthz */
    KVT_MHTTP_ROUTE_BAD,         /* not an HTTP/1.x request line: 400 */
    KVT_MHTTP_ROUTE_NOT_FOUND,   /* another path: 404 */
    KVT_MHTTP_ROUTE_METHOD,      /* a known path, a method other than GET or HEAD: 405 */
};
/* The route of a request whose headers are whole in req (NUL-terminated, no NUL
 * before the end; a line break in it), and whether it is a HEAD. req is cut into
 * pieces (NULs written over its separators). */
enum kvt_metrics_http_route kvt__metrics_http_route(char *req, bool *head_p);

struct kvt_metrics_http_counters {
    uint64_t accepted;    /* connections, ever */
    uint64_t served;      /* replies sent whole */
    uint64_t connections; /* open now */
    uint64_t dropped[KVT_MHTTP_DROP_COUNT];
};
void kvt_metrics_http_get_counters(const struct kvt_metrics_http *srv,
                                   struct kvt_metrics_http_counters *out);

#endif

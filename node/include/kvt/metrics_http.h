/* kvtierd's HTTP endpoint (libmicrohttpd, one internal thread):
 *   GET /metrics  the latest published page, Content-Type KVT_PROM_CONTENT_TYPE
 *                 (503 until the first publish; 500 with the cause while the node's
 *                 last render or publish failed: never a stale page)
 *   GET /healthz  "ok\n" (503 "unavailable\n" once the node says it is not healthy,
 *                 e.g. while it drains on SIGTERM)
 *   anything else 404; a method other than GET or HEAD 405 (with "Allow: GET, HEAD").
 * The node loop renders the page (kvt/prom.h) and publishes it; the HTTP thread only
 * copies the latest published text under a mutex, so it never touches the manager.
 *
 * Threads: create, publish, set_healthy and destroy on one thread (the node loop);
 * the server thread only reads the snapshot. */
#ifndef KVT_METRICS_HTTP_H
#define KVT_METRICS_HTTP_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct kvt_metrics_http;

/* Listens on listen (a numeric address or a host name; its first address) and port
 * (0: any free port, see kvt_metrics_http_port) and starts the server thread.
 * -EINVAL for an address that does not resolve, the bind/listen errno
 * (-EADDRINUSE, -EACCES, -EADDRNOTAVAIL...), -ENOMEM, or -EIO when libmicrohttpd
 * refuses to start. Logs the cause once. */
int kvt_metrics_http_create(const char *listen, uint16_t port, struct kvt_metrics_http **srv_p);
/* Stops the thread (requests in progress finish or are cut), closes the socket. */
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

#endif

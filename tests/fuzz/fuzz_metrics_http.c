/* SPDX-License-Identifier: Apache-2.0 */
/* libFuzzer target for the request reader of kvtierd's /metrics and /healthz
 * (node/metrics_http.c): what anyone who reaches the metrics port can send.
 *
 * Input: the bytes a client sends, taken as the server's connection reader takes
 * them: at most its 8 KiB; one with a NUL is refused before any parsing; one whose
 * headers do not end ("\r\n\r\n" or "\n\n") is not answered. What remains goes to
 * kvt__metrics_http_route, the routing answer() replies by, in a buffer of exactly
 * its bytes and the NUL (so a read past it is a sanitizer's finding).
 *
 * Checked on every input, beyond the sanitizers' own checks:
 * - the route is one of the five;
 * - /metrics or /healthz are served only for a first line "GET <path> HTTP/1.x" or
 *   "HEAD <path> HTTP/1.x" whose path, up to a '?' or '#', is exactly that one, and
 *   HEAD is said only of a request whose method is HEAD. */
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz_check.h"
#include "kvt/metrics_http.h"

#define REQUEST_MAX 8192 /* the server's bound on a request's bytes */

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* Whether the request's first line asks with method for exactly path. */
static bool asks(const char *req, const char *method, const char *path)
{
    size_t m = strlen(method), p = strlen(path), line = strcspn(req, "\r\n");
    const char *after = req + m + 1 + p;

    if (line < m + 1 + p + 1 + 7 || memcmp(req, method, m) != 0 || req[m] != ' ' ||
        memcmp(req + m + 1, path, p) != 0)
        return false;
    /* the path ends there, or its query or fragment starts; the version is a word on */
    if (*after == '?' || *after == '#')
        after = memchr(after, ' ', (size_t)(req + line - after));
    return after != NULL && after < req + line && after[0] == ' ' &&
           memcmp(after + 1, "HTTP/1.", 7) == 0 && memchr(req + m + 1, ' ', p) == NULL;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    enum kvt_metrics_http_route r;
    char *req, *copy;
    bool head;

    if (size > REQUEST_MAX || memchr(data, '\0', size) != NULL)
        return 0; /* refused before any parsing (headers too large, a NUL) */
    req = malloc(size + 1);
    copy = malloc(size + 1);
    CHECK(req != NULL && copy != NULL);
    memcpy(req, data, size);
    req[size] = '\0';
    memcpy(copy, req, size + 1);
    if (strstr(req, "\r\n\r\n") == NULL && strstr(req, "\n\n") == NULL) {
        free(req);
        free(copy);
        return 0; /* the server waits for the rest */
    }
    r = kvt__metrics_http_route(req, &head);
    CHECK(r == KVT_MHTTP_ROUTE_METRICS || r == KVT_MHTTP_ROUTE_HEALTH || r == KVT_MHTTP_ROUTE_BAD ||
          r == KVT_MHTTP_ROUTE_NOT_FOUND || r == KVT_MHTTP_ROUTE_METHOD);
    if (head)
        CHECK(strncmp(copy, "HEAD ", 5) == 0);
    if (r == KVT_MHTTP_ROUTE_METRICS)
        CHECK(asks(copy, head ? "HEAD" : "GET", "/metrics"));
    if (r == KVT_MHTTP_ROUTE_HEALTH)
        CHECK(asks(copy, head ? "HEAD" : "GET", "/healthz"));
    free(req);
    free(copy);
    return 0;
}

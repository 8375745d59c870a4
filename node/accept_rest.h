/* SPDX-License-Identifier: Apache-2.0 */
/* A listening socket whose accept fails for want of a descriptor or memory stays
 * readable (the connection waits in the backlog): retried at once, it spins its thread
 * and floods the log. Its owner takes it out of its poll set until r->until instead,
 * and such failures are logged at most once per 10 s with a count. Private to
 * kvt_node: the engine socket (engine_api.c) and the metrics endpoint (metrics_http.c). */
#ifndef KVT_ACCEPT_REST_H
#define KVT_ACCEPT_REST_H

#include <stdbool.h>
#include <stdint.h>

struct kvt_accept_rest {
    uint64_t until;     /* the socket rests (out of the poll set) until then; 0 = it does not */
    uint64_t logged_ns; /* when a failure was last logged */
    uint64_t unlogged;  /* failures since */
};

/* A failed accept (err: not EAGAIN, EINTR or ECONNABORTED) of the socket named what,
 * at now, logged under mod. True when it was for want of a descriptor or memory: the
 * socket then rests until r->until (100 ms on). */
bool kvt_accept_failed(struct kvt_accept_rest *r, const char *mod, const char *what, int err,
                       uint64_t now);

#endif

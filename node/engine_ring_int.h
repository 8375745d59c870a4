/* SPDX-License-Identifier: Apache-2.0 */
/* The node's side of an engine's shared-memory ring (layout and protocol in
 * kvtier/engine_ring.h). Internal to kvt_node: node/engine_api.c owns one ring per
 * engine that asked for one, takes requests from it and runs them through the same
 * dispatch as the socket's frames.
 *
 * Threads: the loop thread only (the engine side is another process). */
#ifndef KVT_ENGINE_RING_INT_H
#define KVT_ENGINE_RING_INT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct kvt_ering;

/* A ring of cap bytes each way (rounded up to pages; at least one page), its memfd
 * sealed against resizing, mapped here, and its eventfd. -ENOMEM, -EMFILE, ... */
int kvt__ering_create(size_t cap, struct kvt_ering **ring_p);
/* Closes the fds and unmaps (the engine's own mapping stays valid). NULL ignored. */
void kvt__ering_destroy(struct kvt_ering *ring);

/* What HELLO's reply passes, after the region's fd. */
int kvt__ering_memfd(const struct kvt_ering *ring);
int kvt__ering_eventfd(const struct kvt_ering *ring);

/* Takes the next request, copied out of the ring into the ring's own buffer:
 * 1 (*body_p, *len_p valid until the next take), 0 none waiting, -EAGAIN the reply
 * ring has no room for even a REDIRECT (the engine has not read its replies: the
 * request waits), -EPROTO the engine broke the ring (a counter, a record header or
 * a sequence number that does not add up, a body over max_body; once a check
 * failed, in any call, every take after says -EPROTO too). After 1 the
 * caller must call kvt__ering_reply exactly once before the next take. */
int kvt__ering_take(struct kvt_ering *ring, uint32_t max_body, const uint8_t **body_p,
                    size_t *len_p);
/* Publishes the reply body of the request taken, and wakes the engine if it waits.
 * 0, or 1 when the reply does not fit: a REDIRECT was published instead and the
 * caller sends the reply on the socket. -EPROTO the engine broke the ring. */
int kvt__ering_reply(struct kvt_ering *ring, const uint8_t *body, size_t len);
/* The same with the body in two pieces (a binary reply's header and payload),
 * copied straight into the record. */
int kvt__ering_reply2(struct kvt_ering *ring, const void *a, size_t a_len, const void *b,
                      size_t b_len);
/* A request record is waiting (not validated: take decides). */
bool kvt__ering_pending(struct kvt_ering *ring);
/* Which check the engine failed when a call said -EPROTO (for the log). */
const char *kvt__ering_why(const struct kvt_ering *ring);
/* Tells the engine whether it must write the eventfd after publishing. */
void kvt__ering_set_sleeping(struct kvt_ering *ring, bool sleeping);
/* Empties the eventfd (after it woke the loop). */
void kvt__ering_drain_wake(struct kvt_ering *ring);
/* The connection is closing: the engine stops waiting on the ring and reads the
 * socket (its ERROR frame). No request is taken after this. */
void kvt__ering_close(struct kvt_ering *ring);
bool kvt__ering_closed(const struct kvt_ering *ring);

#endif

/* SPDX-License-Identifier: Apache-2.0 */
/* libkvtier-client's side of the shared-memory ring (protocol in
 * kvtier/engine_ring.h): internal to the library. The client's mutex serializes
 * every use. Requests may be posted ahead of their replies (the library posts
 * calls whose reply only says they worked); replies come back in request order
 * and are consumed in that order. */
#ifndef KVTIER_RING_INT_H
#define KVTIER_RING_INT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct kvt_cring;

/* Maps the node's memfd (the caller closes it afterwards) and takes the eventfd.
 * -EPROTO when the control page does not describe a ring that fits the memfd. */
int kvt__cring_open(int memfd, int evfd, struct kvt_cring **ring_p);
/* Unmaps and closes the eventfd. NULL ignored. */
void kvt__cring_close(struct kvt_cring *ring);
/* How long a call spins on its reply before it sleeps on the futex. */
void kvt__cring_set_spin(struct kvt_cring *ring, uint32_t spin_us);

/* Publishes one request body (wakes the node if it sleeps); *seq_p (may be NULL)
 * receives its sequence number. 0; -EMSGSIZE: larger than a ring record may be,
 * send it on the socket; -EBUSY: no room until replies are consumed; -EPROTO: the
 * node's acks do not add up. */
int kvt__cring_post(struct kvt_cring *ring, const uint8_t *body, size_t len, uint32_t *seq_p);
/* kvt__cring_post in two steps, for a caller that writes the body in place:
 * reserve says where len body bytes go (same errors as post, nothing published),
 * commit publishes them (after the caller wrote them all) as post does. Nothing
 * else is done with the ring in between. */
int kvt__cring_reserve(struct kvt_cring *ring, size_t len, uint8_t **body_p);
void kvt__cring_commit(struct kvt_cring *ring, uint32_t *seq_p);
/* Requests posted whose replies are not consumed yet. */
uint32_t kvt__cring_outstanding(const struct kvt_cring *ring);
/* The next reply, in request order, until deadline_ns (CLOCK_MONOTONIC; 0 = none;
 * wait false: do not wait at all). *seq_p: the request it answers. 0: its body is in
 * *buf_p (grown as needed), *len_p bytes; 1: that reply is on the socket (REDIRECT);
 * 2: none yet (wait false only); 3: read the socket: the node closed the ring, or
 * the socket has something (an ERROR frame, EOF); -ETIMEDOUT; -EPROTO; -ENOMEM. */
int kvt__cring_next(struct kvt_cring *ring, int sockfd, bool wait, uint64_t deadline_ns,
                    uint8_t **buf_p, size_t *cap_p, size_t *len_p, uint32_t *seq_p);

/* Counters for tests and benchmarks. */
struct kvt_cring_stats {
    uint64_t posted;     /* requests through the ring */
    uint64_t wakeups;    /* eventfd writes (the node slept) */
    uint64_t sleeps;     /* futex waits (the reply took longer than the spin) */
    uint64_t redirects;  /* replies that came on the socket */
    uint64_t spin_rests; /* spins that lost their core: no spinning for a while */
};
void kvt__cring_stats(const struct kvt_cring *ring, struct kvt_cring_stats *out);
/* The check that broke the ring (a call returned -EPROTO), or NULL. */
const char *kvt__cring_why(const struct kvt_cring *ring);

#endif

/* libkvtier-client's side of the shared-memory ring (protocol in
 * kvtier/engine_ring.h): internal to the library. The client's mutex serializes
 * every use, and a call posts one request and waits for its reply before the next
 * (so the ring holds at most one request and one reply). */
#ifndef KVTIER_RING_INT_H
#define KVTIER_RING_INT_H

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

/* Publishes one request body (wakes the node if it sleeps). 0; -EMSGSIZE: larger
 * than a ring record may be, send it on the socket; -EBUSY: no room now (not in the
 * library's one-call-at-a-time use); -EPROTO: the node's counters do not add up. */
int kvt__cring_post(struct kvt_cring *ring, const uint8_t *body, size_t len);
/* Waits for the reply of the request posted, until deadline_ns (CLOCK_MONOTONIC;
 * 0 = none). 0: its body is in *buf_p (grown as needed), *len_p bytes; 1: read the
 * socket (the reply was redirected there, the node closed the ring, or the socket
 * has something: an ERROR frame or EOF); -ETIMEDOUT; -EPROTO; -ENOMEM. */
int kvt__cring_wait(struct kvt_cring *ring, int sockfd, uint64_t deadline_ns, uint8_t **buf_p,
                    size_t *cap_p, size_t *len_p);

/* Counters for tests and benchmarks. */
struct kvt_cring_stats {
    uint64_t posted;    /* requests through the ring */
    uint64_t wakeups;   /* eventfd writes (the node slept) */
    uint64_t sleeps;    /* futex waits (the reply took longer than the spin) */
    uint64_t redirects; /* replies that came on the socket */
};
void kvt__cring_stats(const struct kvt_cring *ring, struct kvt_cring_stats *out);

#endif

/* SPDX-License-Identifier: Apache-2.0 */
/* AsyncLookupManager: a reusable asynchronous existence
 * check for secondary tiers with slow lookups. Scheduler-thread state (lookup
 * states, reverse index, batch) needs no lock; one worker thread runs batch_lookup
 * on one queue item per step and posts one result list per item.
 *
 *   lookup   -> drain results once after a flush, then answer from the cache
 *   flush    -> (tier's on_schedule_end) drain, post this step's batch
 *   cleanup  -> (tier's on_request_finished) drop the request's references
 *   mark_miss-> (tier's get_finished_jobs, on a failed load) force the verdict to MISS
 *
 * Every function but batch_lookup (worker) and the ones marked "any thread" runs
 * on the scheduler thread only.
 */
#ifndef KVT_ASYNC_LOOKUP_H
#define KVT_ASYNC_LOOKUP_H

#include <stddef.h>
#include <stdbool.h>

#include "kvt/types.h"

/* Runs on the worker thread, once per request of a step's batch (keys grouped by
 * req_id in first-seen order; ctx is the first context seen for that req_id).
 * Fills found[i] for keys[i]. A negative return means the whole call failed: every
 * key is taken as not found (and a warning logged). Must not touch scheduler or
 * primary state. */
typedef int (*kvt_batch_lookup_fn)(void *arg, const struct kvt_key *keys, size_t n,
                                   const struct kvt_req_ctx *ctx, bool *found);

/* A tier whose lookups are round trips (the network tier) would pay one per request
 * of every queued item if the worker ran them one after the other. With a spans
 * function it gets every request of every item queued at once (up to
 * KVT_AL_MAX_SPANS items, one span each: the item's keys and found[]) in one call,
 * and answers them in one round trip. The verdicts are the same; only when they
 * arrive changes. A negative return takes every key of every span as not found. */
struct kvt_al_span {
    const struct kvt_key *keys;
    size_t n;
    bool *found;
};
#define KVT_AL_MAX_SPANS 64
typedef int (*kvt_batch_lookup_spans_fn)(void *arg, const struct kvt_al_span *spans,
                                         size_t n_spans);

/* A tier whose lookup is a round trip its own loop completes (the network tier's
 * LOCATE) needs no worker thread: with a submit function, flush() hands it the
 * step's item on the scheduler thread, and the tier calls kvt_async_lookup_complete
 * with the token once it wrote found[] (every key, or the ones found: found[] starts
 * false). Items in flight do not wait for each other, and no thread has to be
 * scheduled between the step, the request and its answer. A negative return
 * completes the item at once, every key not found. keys and found stay valid until
 * complete, or until destroy for an item never completed (the tier must not touch
 * them after destroy). */
typedef int (*kvt_lookup_submit_fn)(void *arg, const struct kvt_key *keys, size_t n, bool *found,
                                    void *token);

/* lookup() answers (vLLM: None / True / False) */
#define KVT_AL_ABSENT  0
#define KVT_AL_FOUND   1
#define KVT_AL_PENDING 2

enum kvt_al_phase { KVT_AL_PHASE_PENDING, KVT_AL_PHASE_IN_FLIGHT, KVT_AL_PHASE_RESOLVED };

struct kvt_async_lookup;

/* Starts the worker thread ("kvt_al_<tier_type>", truncated). 0, -ENOMEM, or the
 * negated pthread_create error. */
int kvt_async_lookup_create(const char *tier_type, kvt_batch_lookup_fn fn, void *arg,
                            struct kvt_async_lookup **al_p);
/* The same with a spans function: the worker hands it all queued items at once. */
int kvt_async_lookup_create_spans(const char *tier_type, kvt_batch_lookup_spans_fn fn, void *arg,
                                  struct kvt_async_lookup **al_p);
/* The same with a submit function and no worker thread. */
int kvt_async_lookup_create_submit(const char *tier_type, kvt_lookup_submit_fn fn, void *arg,
                                   struct kvt_async_lookup **al_p);
/* A submitted item's verdicts are in its found[]: the next drain applies them
 * (any thread; once per token). */
void kvt_async_lookup_complete(struct kvt_async_lookup *al, void *token);
/* Shuts the worker down if still running, then frees everything. */
void kvt_async_lookup_destroy(struct kvt_async_lookup *al);

/* KVT_AL_ABSENT, KVT_AL_FOUND, KVT_AL_PENDING, or -ENOMEM (nothing changed).
 * A key seen for the first time is added to this step's batch, once; the verdict
 * is shared by every request that asks for the key while its state lives. The
 * batch holds a reference on ctx until the worker is done with it. */
int kvt_async_lookup_lookup(struct kvt_async_lookup *al, const struct kvt_key *key,
                            struct kvt_req_ctx *ctx);
/* Drains results, then posts this step's batch as one queue item (nothing when
 * it is empty). -ENOMEM: nothing posted, the batch is kept for the next flush. */
int kvt_async_lookup_flush(struct kvt_async_lookup *al);
void kvt_async_lookup_drain_results(struct kvt_async_lookup *al);
/* Forces the verdict of each key that has a state to ABSENT (RESOLVED) without a
 * new probe; keys without a state are ignored. A probe still in flight for the key
 * is discarded when its result arrives, so the miss sticks. */
void kvt_async_lookup_mark_miss(struct kvt_async_lookup *al, const struct kvt_key *keys, size_t n);
/* Drops req_id's references; states left without requests are freed, except those
 * in flight, kept until their result arrives so a new request can share the probe.
 * Unknown req_id: no-op. */
void kvt_async_lookup_cleanup(struct kvt_async_lookup *al, const char *req_id);
/* Lets the worker finish what was posted, joins it, drains. Idempotent. */
void kvt_async_lookup_shutdown(struct kvt_async_lookup *al);

/* Introspection for tests and stats. */
size_t kvt_async_lookup_batch_len(const struct kvt_async_lookup *al);
size_t kvt_async_lookup_num_states(const struct kvt_async_lookup *al);
/* Requests with an entry in the reverse index. */
size_t kvt_async_lookup_num_reqs(const struct kvt_async_lookup *al);
/* Whether req_id's reverse-index entry holds key. */
bool kvt_async_lookup_req_has_key(const struct kvt_async_lookup *al, const char *req_id,
                                  const struct kvt_key *key);
/* Queue items posted to the worker and not yet taken by it (any thread). */
size_t kvt_async_lookup_queue_len(struct kvt_async_lookup *al);
/* Result items posted by the worker and not yet drained (any thread). */
size_t kvt_async_lookup_results_len(struct kvt_async_lookup *al);
/* -ENOENT when the key has no state. *result_p is KVT_AL_PENDING while unknown. */
int kvt_async_lookup_state(const struct kvt_async_lookup *al, const struct kvt_key *key,
                           enum kvt_al_phase *phase_p, int *result_p, unsigned long *gen_p);
/* Any thread. */
bool kvt_async_lookup_worker_alive(struct kvt_async_lookup *al);

#endif

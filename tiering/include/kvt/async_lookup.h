/* AsyncLookupManager of spec §4.3 (seed 004): a reusable asynchronous existence
 * check for secondary tiers with slow lookups. Scheduler-thread state (lookup
 * states, reverse index, batch) needs no lock; one worker thread runs batch_lookup
 * on one queue item per step and posts one result list per item.
 *
 *   lookup   -> drain results once after a flush, then answer from the cache
 *   flush    -> (tier's on_schedule_end) drain, post this step's batch
 *   cleanup  -> (tier's on_request_finished) drop the request's references
 *   mark_miss-> (tier's get_finished_jobs, on a failed load) force the verdict to MISS
 */
#ifndef KVT_ASYNC_LOOKUP_H
#define KVT_ASYNC_LOOKUP_H

#include <stddef.h>
#include <stdbool.h>

#include "kvt/types.h"

/* Runs on the worker thread. Fills found[i] for keys[i]. A negative return means
 * the whole batch failed: every key is taken as not found (and a warning logged).
 * Must not touch scheduler or primary state. */
typedef int (*kvt_batch_lookup_fn)(void *arg, const struct kvt_key *keys, size_t n,
                                   const struct kvt_req_ctx *ctx, bool *found);

/* lookup() answers */
#define KVT_AL_ABSENT  0
#define KVT_AL_FOUND   1
#define KVT_AL_PENDING 2

enum kvt_al_phase { KVT_AL_PHASE_PENDING, KVT_AL_PHASE_IN_FLIGHT, KVT_AL_PHASE_RESOLVED };

struct kvt_async_lookup;

int kvt_async_lookup_create(const char *tier_type, kvt_batch_lookup_fn fn, void *arg,
                            struct kvt_async_lookup **al_p);
/* Shuts the worker down if still running, then frees everything. */
void kvt_async_lookup_destroy(struct kvt_async_lookup *al);

/* KVT_AL_ABSENT, KVT_AL_FOUND, KVT_AL_PENDING, or -ENOMEM. */
int kvt_async_lookup_lookup(struct kvt_async_lookup *al, const struct kvt_key *key,
                            struct kvt_req_ctx *ctx);
void kvt_async_lookup_flush(struct kvt_async_lookup *al);
void kvt_async_lookup_drain_results(struct kvt_async_lookup *al);
void kvt_async_lookup_mark_miss(struct kvt_async_lookup *al, const struct kvt_key *keys,
                                size_t n);
void kvt_async_lookup_cleanup(struct kvt_async_lookup *al, const char *req_id);
/* Posts the shutdown sentinel, joins the worker, drains. Idempotent. */
void kvt_async_lookup_shutdown(struct kvt_async_lookup *al);

/* Introspection for tests and stats. */
size_t kvt_async_lookup_batch_len(const struct kvt_async_lookup *al);
size_t kvt_async_lookup_num_states(const struct kvt_async_lookup *al);
/* Queue items posted to the worker and not yet taken by it. */
size_t kvt_async_lookup_queue_len(struct kvt_async_lookup *al);
/* Blocks until the worker has posted results for every item handed to it (tests). */
void kvt_async_lookup_wait_idle(struct kvt_async_lookup *al);
/* -ENOENT when the key has no state. */
int kvt_async_lookup_state(const struct kvt_async_lookup *al, const struct kvt_key *key,
                           enum kvt_al_phase *phase_p, int *result_p, unsigned long *gen_p);
/* Tests only: posts a result as if the worker had produced it. */
int kvt__async_lookup_inject_result(struct kvt_async_lookup *al, const struct kvt_key *key,
                                    unsigned long generation, bool found);
bool kvt_async_lookup_worker_alive(struct kvt_async_lookup *al);

#endif

/* SPDX-License-Identifier: Apache-2.0 */
/* The secondary-tier contract (vLLM's SecondaryTierManager) as an ops table, and
 * the parent handle tiers use to act for remote requesters.
 *
 * Every call happens on the scheduler thread and must not block (drain_jobs and
 * shutdown excepted). Tier back ends talk to the scheduler only through queues
 * drained in get_finished_jobs(), lookup() and on_schedule_end().
 *
 * Jobs: submit_store/submit_load accept a job (0) or refuse it (a negative errno,
 * -ENOMEM when memory is short) before doing anything with it. Every job accepted,
 * or created through the parent's create_store_job, must be reported exactly once
 * through get_finished_jobs (success or failure); a refused job is never reported.
 * The job stays valid and unchanged until then; the tier must not keep it after
 * reporting it.
 *
 * Out of memory, one policy for the manager and every tier:
 * - A call that cannot get the memory it needs fails with -ENOMEM before it changes
 *   anything: a refused submit leaves the job to the manager, which unpins a
 *   cascade's rows or frees a promotion's slots at once, as for a failed job; a
 *   kvt_parent_create_store_job that fails has pinned nothing.
 * - Once a job is accepted, everything its report needs - the finished record and
 *   room for its successful keys - exists (allocated at submit, inside the tier's
 *   own record of the job), so finishing, reporting, expiring, releasing and
 *   draining never allocate and cannot fail. Memory that runs out while an accepted
 *   job runs fails some of its keys (reported failed, never lost); a slot is never
 *   left pinned or write-pending for want of memory.
 * - What no slot depends on - stats, events, publications to peers, lookup caches,
 *   a lookup's RETRY that becomes a MISS - is best effort: lost with a warning or a
 *   counter, and repaired by the next step, TTL or re-publication where it can be.
 *
 * A tier that caches positive lookup verdicts must invalidate them when one of its
 * own loads fails or is refused (vLLM's livelock rule, vLLM PR #49176). */
#ifndef KVT_TIER_H
#define KVT_TIER_H

#include <errno.h>
#include <stddef.h>
#include <stdbool.h>
#include <stdint.h>

#include "kvt/types.h"
#include "kvt/stats.h"

struct kvt_tier;
struct kvt_parent;
struct kvt_bp;

typedef void (*kvt_job_result_cb_t)(void *arg, const struct kvt_job_result *result);

/* How full a tier is (kvt_tier_usage): what it holds now and what it can hold, in
 * chunks and in bytes as the tier counts them (a file's header included). */
struct kvt_tier_usage {
    uint64_t used_chunks, capacity_chunks;
    uint64_t used_bytes, capacity_bytes;
};

struct kvt_tier_ops {
    /* Required. */
    enum kvt_lookup_result (*lookup)(struct kvt_tier *t, const struct kvt_key *key,
                                     struct kvt_req_ctx *ctx); /* HIT, MISS or RETRY */
    /* 0: accepted, reported once; negative errno: refused, never reported. */
    int (*submit_store)(struct kvt_tier *t, const struct kvt_job *job);
    int (*submit_load)(struct kvt_tier *t, const struct kvt_job *job);
    /* Calls cb once per finished job, then forgets those jobs; never allocates. */
    void (*get_finished_jobs)(struct kvt_tier *t, kvt_job_result_cb_t cb, void *arg);
    /* Blocks until every submitted job is complete or failed (never aborts a copy). */
    int (*drain_jobs)(struct kvt_tier *t);
    /* Optional (defaults in the wrappers below). */
    enum kvt_offload_policy (*on_new_request)(struct kvt_tier *t, struct kvt_req_ctx *ctx);
    void (*on_request_finished)(struct kvt_tier *t, struct kvt_req_ctx *ctx);
    bool (*has_pending_work)(struct kvt_tier *t);
    int (*take_events)(struct kvt_tier *t, struct kvt_events *out);
    void (*touch)(struct kvt_tier *t, const struct kvt_key *keys, size_t n,
                  struct kvt_req_ctx *ctx);
    void (*serve_external_requests)(struct kvt_tier *t, struct kvt_parent *parent);
    void (*on_schedule_end)(struct kvt_tier *t, const struct kvt_schedule_end_ctx *ctx);
    int (*get_stats)(struct kvt_tier *t, struct kvt_stats *out); /* return-and-reset */
    /* The node loop's hooks, so that it runs every tier alike: event_fds writes at
     * most cap fds that turn readable when the tier has work for poll and returns how
     * many; poll does that work between schedule ends without blocking; arm, called
     * before the loop sleeps on those fds, returns 0 when it may, -EAGAIN (or another
     * negative errno) when poll has work now. */
    size_t (*event_fds)(struct kvt_tier *t, int *fds, size_t cap);
    int (*poll)(struct kvt_tier *t);
    int (*arm)(struct kvt_tier *t);
    /* Optional: when poll next has work that no fd announces (kvt_now_ns clock), 0
     * for none: the loop sleeps no longer. */
    uint64_t (*wake_at_ns)(struct kvt_tier *t);
    /* Optional: a count that moves whenever work of the tier waits for the manager's
     * next schedule end (a job ended, a peer's request parked). A loop that steps
     * when it moved reports and serves them at once, not at its next tick. Any
     * thread may move it; the loop reads it. */
    uint64_t (*news)(struct kvt_tier *t);
    /* How full the tier is; unset: it keeps no chunks of its own. */
    int (*usage)(struct kvt_tier *t, struct kvt_tier_usage *out);
    /* Forgets everything the tier holds (the node's cache is reset: the engine API's
     * reset, kvt_manager_reset_all). Called with no job of the tier in flight (every
     * tier drained, the manager took their results) and after the primary was cleared.
     * A tier that keeps data across restarts makes sure none of it is served again,
     * after a restart either. */
    int (*reset)(struct kvt_tier *t);
    int (*shutdown)(struct kvt_tier *t); /* release threads and connections */
    void (*destroy)(struct kvt_tier *t); /* free; after shutdown */
};

#define KVT_TIER_TYPE_MAX 32

/* Embedded as the first member of every tier. The manager fills index, row_bytes,
 * primary_base and num_chunks when it adopts the tier. */
struct kvt_tier {
    const struct kvt_tier_ops *ops;
    char type[KVT_TIER_TYPE_MAX]; /* config "type": "example", "storage", "network" */
    int medium;                   /* enum kvt_medium or KVT_ANY */
    int locality;                 /* enum kvt_locality or KVT_ANY */
    struct kvt_bp *bp;            /* back-pressure detector (owned), or NULL */
    int index;                    /* tier_idx in the manager */
    size_t row_bytes;             /* block_size_bytes: one primary row */
    uint8_t *primary_base;        /* the primary view: chunk c at base + c*row_bytes */
    size_t num_chunks;
};

/* Initialises the common part; type is copied (truncated to 31 bytes). */
void kvt_tier_init(struct kvt_tier *t, const struct kvt_tier_ops *ops, const char *type, int medium,
                   int locality);

static inline enum kvt_lookup_result kvt_tier_lookup(struct kvt_tier *t, const struct kvt_key *key,
                                                     struct kvt_req_ctx *ctx)
{
    return t->ops->lookup(t, key, ctx);
}
static inline int kvt_tier_submit_store(struct kvt_tier *t, const struct kvt_job *job)
{
    return t->ops->submit_store(t, job);
}
static inline int kvt_tier_submit_load(struct kvt_tier *t, const struct kvt_job *job)
{
    return t->ops->submit_load(t, job);
}
static inline void kvt_tier_get_finished_jobs(struct kvt_tier *t, kvt_job_result_cb_t cb, void *arg)
{
    t->ops->get_finished_jobs(t, cb, arg);
}
static inline int kvt_tier_drain_jobs(struct kvt_tier *t)
{
    return t->ops->drain_jobs ? t->ops->drain_jobs(t) : -EOPNOTSUPP;
}
static inline enum kvt_offload_policy kvt_tier_on_new_request(struct kvt_tier *t,
                                                              struct kvt_req_ctx *ctx)
{
    return t->ops->on_new_request ? t->ops->on_new_request(t, ctx) : KVT_CHUNK_LEVEL;
}
static inline void kvt_tier_on_request_finished(struct kvt_tier *t, struct kvt_req_ctx *ctx)
{
    if (t->ops->on_request_finished)
        t->ops->on_request_finished(t, ctx);
}
static inline bool kvt_tier_has_pending_work(struct kvt_tier *t)
{
    return t->ops->has_pending_work ? t->ops->has_pending_work(t) : false;
}
static inline int kvt_tier_take_events(struct kvt_tier *t, struct kvt_events *out)
{
    return t->ops->take_events ? t->ops->take_events(t, out) : 0;
}
static inline void kvt_tier_touch(struct kvt_tier *t, const struct kvt_key *keys, size_t n,
                                  struct kvt_req_ctx *ctx)
{
    if (t->ops->touch)
        t->ops->touch(t, keys, n, ctx);
}
static inline void kvt_tier_serve_external_requests(struct kvt_tier *t, struct kvt_parent *p)
{
    if (t->ops->serve_external_requests)
        t->ops->serve_external_requests(t, p);
}
static inline void kvt_tier_on_schedule_end(struct kvt_tier *t,
                                            const struct kvt_schedule_end_ctx *ctx)
{
    if (t->ops->on_schedule_end)
        t->ops->on_schedule_end(t, ctx);
}
static inline int kvt_tier_get_stats(struct kvt_tier *t, struct kvt_stats *out)
{
    return t->ops->get_stats ? t->ops->get_stats(t, out) : 0;
}
/* Defaults: no fd, nothing to poll, always ready to sleep (a tier whose threads
 * finish its jobs is heard from at the next step), -EOPNOTSUPP for usage. */
static inline size_t kvt_tier_event_fds(struct kvt_tier *t, int *fds, size_t cap)
{
    return t->ops->event_fds ? t->ops->event_fds(t, fds, cap) : 0;
}
static inline int kvt_tier_poll(struct kvt_tier *t)
{
    return t->ops->poll ? t->ops->poll(t) : 0;
}
static inline int kvt_tier_arm(struct kvt_tier *t)
{
    return t->ops->arm ? t->ops->arm(t) : 0;
}
static inline uint64_t kvt_tier_wake_at_ns(struct kvt_tier *t)
{
    return t->ops->wake_at_ns ? t->ops->wake_at_ns(t) : 0;
}
static inline uint64_t kvt_tier_news(struct kvt_tier *t)
{
    return t->ops->news ? t->ops->news(t) : 0;
}
static inline int kvt_tier_usage(struct kvt_tier *t, struct kvt_tier_usage *out)
{
    return t->ops->usage ? t->ops->usage(t, out) : -EOPNOTSUPP;
}
/* -EOPNOTSUPP: the tier cannot forget what it holds (its data survives a reset). */
static inline int kvt_tier_reset(struct kvt_tier *t)
{
    return t->ops->reset ? t->ops->reset(t) : -EOPNOTSUPP;
}
static inline int kvt_tier_shutdown(struct kvt_tier *t)
{
    return t->ops->shutdown ? t->ops->shutdown(t) : 0;
}
/* Frees the tier and its detector. */
void kvt_tier_destroy(struct kvt_tier *t);

/* ParentManager: valid only during serve_external_requests. Every call
 * excludes the calling tier. Per remote request: on_new_request, lookup per key,
 * create_store_job for the hits (pins them; the tier owns and reports the job),
 * on_request_finished (always, even when nothing was found). */
int kvt_parent_on_new_request(struct kvt_parent *p, struct kvt_req_ctx *ctx,
                              enum kvt_offload_policy *policy_p);
enum kvt_lookup_result kvt_parent_lookup(struct kvt_parent *p, const struct kvt_key *key,
                                         struct kvt_req_ctx *ctx);
/* -EINVAL (nothing pinned) unless every key is present and ready in the primary;
 * -ENOMEM (nothing pinned). On success the job is the calling tier's to report. */
int kvt_parent_create_store_job(struct kvt_parent *p, const struct kvt_key *keys, size_t n,
                                struct kvt_req_ctx *ctx, const struct kvt_job **job_p);
int kvt_parent_on_request_finished(struct kvt_parent *p, struct kvt_req_ctx *ctx);

#endif

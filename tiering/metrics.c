/* SPDX-License-Identifier: Apache-2.0 */
/* TieringMetricsTracker, a port of vLLM's tiering/metrics.py:
 * - per request, per tier label, per key: whether a resolved lookup was already
 *   counted, or when the first RETRY started (async delay); nothing is counted after
 *   the request was allocated;
 * - per tier: active promotion / cascade jobs and the primary chunks they write / pin;
 * - accumulated counters and histograms, popped by take_stats, after gauges that are
 *   re-emitted on every call.
 * Bytes of a finished job are keys x primary row size, as vLLM counts them (a tier's
 * own transfer_bytes is for back-pressure, not for these counters).
 *
 * Every engine lookup passes through here, so the lookup path allocates nothing
 * and compares no strings: a request's observed (label, key) pairs are an
 * open-addressing table of 64-bit fingerprints (the key's XXH3-64 mixed with the
 * label) in one array, and the last request asked for is remembered (lookups come
 * in runs per request); the per-label query and hit counts and the two delay
 * histograms accumulate in plain arrays and enter the stats at take_stats, exactly
 * as if each observation had been added at once. The primary's common
 * observations may wait in a queue the caller fills inline (kvt/metrics.h says
 * when); every call here applies it first. Two (label, key) pairs of one
 * request whose fingerprints collide (about 2^-64 per pair) would count as one
 * query: a metric, never a cache answer. */
#include <assert.h>
#include <errno.h>
#include <stdio.h>
#include <string.h>

#include "kvt/alloc.h"
#include "kvt/clock.h"
#include "kvt/hash.h"
#include "kvt/backpressure.h"
#include "kvt/map.h"
#include "kvt/metrics.h"
#include "kvt/tier.h"

struct tier_state {
    size_t active_promotions, active_cascades;
    size_t write_chunks, read_chunks;
};

/* One observed (tier label, key) of a request: fp 0 is an empty cell. */
struct observed {
    uint64_t fp;    /* fingerprint of (label, key) */
    double start_s; /* >= 0: a RETRY started the async delay clock then; < 0: none */
};

struct req_metrics {
    bool observing;      /* false once allocated (Python: observed_lookups = None) */
    bool saw_retry;      /* a RETRY was observed: its lookups are not queued */
    struct observed *ob; /* open addressing, linear probing; NULL until the first */
    size_t n_ob, mask;
};

/* A histogram's observations since the last take_stats. */
struct hist_acc {
    uint64_t count;
    double sum;
    uint64_t buckets[KVT_HIST_BUCKETS];
};

struct label_acc {
    uint64_t queries, hits;
    struct hist_acc sync_delay, async_delay;
};

struct kvt_metrics {
    size_t n_tiers;
    size_t num_primary_chunks;
    size_t row_bytes;
    char (*labels)[KVT_STAT_LABEL_MAX]; /* [0] primary, [i+1] tier i */
    struct tier_state *tiers;
    struct label_acc *acc;        /* [n_tiers + 1], by label index */
    struct kvt_map requests;      /* req_id -> struct req_metrics */
    struct kvt_req_ctx *last_ctx; /* the request asked for last (a reference held, so no
                                     other context can take its address), */
    struct req_metrics *last_rm;  /* and its metrics */
    struct kvt_stats stats;
    /* The buckets of the two delay histograms (vLLM's, by their names). */
    const struct kvt_hist_layout *sync_layout, *async_layout;
    struct kvt_metrics_queue queue; /* of last_ctx, primary label */
};

static void apply_queued(struct kvt_metrics *mt);

int kvt_metrics_create(const char *const *tier_types, size_t n_tiers, size_t num_primary_chunks,
                       size_t primary_row_bytes, struct kvt_metrics **mt_p)
{
    struct kvt_metrics *mt = kvt_calloc(1, sizeof(*mt));

    if (mt == NULL)
        return -ENOMEM;
    mt->n_tiers = n_tiers;
    mt->num_primary_chunks = num_primary_chunks;
    mt->row_bytes = primary_row_bytes;
    mt->labels = kvt_calloc(n_tiers + 1, sizeof(*mt->labels));
    mt->tiers = kvt_calloc(n_tiers ? n_tiers : 1, sizeof(*mt->tiers));
    mt->acc = kvt_calloc(n_tiers + 1, sizeof(*mt->acc));
    if (mt->labels == NULL || mt->tiers == NULL || mt->acc == NULL) {
        kvt_free(mt->labels);
        kvt_free(mt->tiers);
        kvt_free(mt->acc);
        kvt_free(mt);
        return -ENOMEM;
    }
    snprintf(mt->labels[0], KVT_STAT_LABEL_MAX, "%s", KVT_PRIMARY_LABEL);
    for (size_t i = 0; i < n_tiers; i++)
        snprintf(mt->labels[i + 1], KVT_STAT_LABEL_MAX, "%zu:%s", i + 1, tier_types[i]);
    kvt_map_init(&mt->requests);
    kvt_stats_init(&mt->stats);
    mt->sync_layout = kvt_hist_layout_of(KVT_M_LOOKUP_SYNC_DELAY);
    mt->async_layout = kvt_hist_layout_of(KVT_M_LOOKUP_ASYNC_DELAY);
    *mt_p = mt;
    return 0;
}

static void req_metrics_free(struct req_metrics *rm)
{
    kvt_free(rm->ob);
    kvt_free(rm);
}

/* Whether the last request's lookups may be queued, after any change to it. */
static void queue_allow(struct kvt_metrics *mt)
{
    const struct req_metrics *rm = mt->last_rm;

    mt->queue.ctx = rm != NULL && rm->observing && !rm->saw_retry ? mt->last_ctx : NULL;
}

static void req_forget_last(struct kvt_metrics *mt)
{
    assert(mt->queue.n == 0);
    kvt_req_ctx_unref(mt->last_ctx);
    mt->last_ctx = NULL;
    mt->last_rm = NULL;
    queue_allow(mt);
}

/* Forgets the remembered request when it goes. */
static void req_forget(struct kvt_metrics *mt, struct req_metrics *rm)
{
    if (mt->last_rm == rm)
        req_forget_last(mt);
}

void kvt_metrics_destroy(struct kvt_metrics *mt)
{
    struct kvt_map_entry *e;

    if (mt == NULL)
        return;
    apply_queued(mt);
    req_forget_last(mt);
    for (size_t it = 0; kvt_map_next(&mt->requests, &it, &e);)
        req_metrics_free(e->value);
    kvt_map_cleanup(&mt->requests);
    kvt_stats_cleanup(&mt->stats);
    kvt_free(mt->labels);
    kvt_free(mt->tiers);
    kvt_free(mt->acc);
    kvt_free(mt);
}

const char *kvt_metrics_label(const struct kvt_metrics *mt, size_t idx)
{
    assert(idx <= mt->n_tiers);
    return mt->labels[idx];
}

static struct req_metrics *req_new(struct kvt_metrics *mt, const struct kvt_req_ctx *ctx)
{
    struct req_metrics *rm = kvt_calloc(1, sizeof(*rm));

    if (rm == NULL)
        return NULL;
    rm->observing = true;
    struct req_metrics *old = kvt_map_get(&mt->requests, ctx->req_id, ctx->req_id_len);

    if (kvt_map_put(&mt->requests, ctx->req_id, ctx->req_id_len, rm) < 0) {
        req_metrics_free(rm);
        return NULL;
    }
    if (old != NULL) {
        req_forget(mt, old);
        req_metrics_free(old);
    }
    return rm;
}

void kvt_metrics_on_new_request(struct kvt_metrics *mt, const struct kvt_req_ctx *ctx)
{
    apply_queued(mt);
    /* Metrics are best effort: out of memory loses observations, never state. */
    (void)req_new(mt, ctx);
}

void kvt_metrics_on_request_allocated(struct kvt_metrics *mt, const struct kvt_req_ctx *ctx)
{
    struct req_metrics *rm;

    apply_queued(mt);
    rm = kvt_map_get(&mt->requests, ctx->req_id, ctx->req_id_len);
    if (rm == NULL)
        return;
    rm->observing = false;
    queue_allow(mt);
    kvt_free(rm->ob);
    rm->ob = NULL;
    rm->n_ob = rm->mask = 0;
}

void kvt_metrics_on_request_finished(struct kvt_metrics *mt, const struct kvt_req_ctx *ctx)
{
    struct req_metrics *rm;

    apply_queued(mt);
    rm = kvt_map_remove(&mt->requests, ctx->req_id, ctx->req_id_len);

    if (rm != NULL) {
        req_forget(mt, rm);
        req_metrics_free(rm);
    }
}

static void hist_add(struct hist_acc *h, const struct kvt_hist_layout *l, double v)
{
    h->count++;
    h->sum += v;
    /* A lookup's delay is below the first bound (10 us) almost always: that bucket
     * without the call (kvt_hist_bucket answers 0 for it too, NaN included). */
    h->buckets[l->n == 0 || !(v > l->bounds[0]) ? 0 : kvt_hist_bucket(l, v)]++;
}

static void observe_resolved(struct kvt_metrics *mt, size_t label_idx,
                             enum kvt_lookup_result result, double dt_s, double start_s)
{
    struct label_acc *a = &mt->acc[label_idx];

    a->queries++;
    a->hits += result == KVT_HIT;
    hist_add(&a->sync_delay, mt->sync_layout, dt_s);
    if (start_s >= 0)
        hist_add(&a->async_delay, mt->async_layout, kvt_now_s() - start_s);
}

/* The request's metrics, created on first sight (Python's setdefault). */
static struct req_metrics *req_of(struct kvt_metrics *mt, const struct kvt_req_ctx *ctx)
{
    struct req_metrics *rm;

    if (mt->last_ctx == ctx)
        return mt->last_rm;
    rm = kvt_map_get(&mt->requests, ctx->req_id, ctx->req_id_len);
    if (rm == NULL && (rm = req_new(mt, ctx)) == NULL)
        return NULL;
    req_forget_last(mt);
    /* The reference only pins the address; the context is never changed. */
    mt->last_ctx = kvt_req_ctx_ref((struct kvt_req_ctx *)ctx);
    mt->last_rm = rm;
    queue_allow(mt);
    return rm;
}

/* The cell of fp in rm's table: its own, or the empty one where it goes (room
 * reserved). */
static struct observed *ob_cell(struct req_metrics *rm, uint64_t fp)
{
    for (size_t i = (size_t)fp & rm->mask;; i = (i + 1) & rm->mask)
        if (rm->ob[i].fp == fp || rm->ob[i].fp == 0)
            return &rm->ob[i];
}

/* Room for one more observation at load factor <= 1/2. */
static int ob_reserve(struct req_metrics *rm)
{
    /* 512 cells hold 256 keys (a 4096-token prompt at 16 tokens a block) before the
     * first regrowth (a rehash in the middle of a request's lookups); then x4. */
    size_t cap = rm->ob == NULL ? 512 : 4 * (rm->mask + 1);
    struct observed *old = rm->ob;
    size_t old_cap = old == NULL ? 0 : rm->mask + 1;

    if (old != NULL && 2 * (rm->n_ob + 1) <= old_cap)
        return 0;
    rm->ob = kvt_calloc(cap, sizeof(*rm->ob));
    if (rm->ob == NULL) {
        rm->ob = old;
        return -ENOMEM;
    }
    rm->mask = cap - 1;
    for (size_t i = 0; i < old_cap; i++)
        if (old[i].fp != 0)
            *ob_cell(rm, old[i].fp) = old[i];
    kvt_free(old);
    return 0;
}

static uint64_t lookup_fp(uint64_t hash, size_t label_idx)
{
    uint64_t fp = hash ^ ((uint64_t)(label_idx + 1) * 0x9e3779b97f4a7c15ull);

    return fp != 0 ? fp : 1;
}

void kvt_metrics_on_lookup(struct kvt_metrics *mt, const struct kvt_req_ctx *ctx,
                           const struct kvt_key *key, size_t label_idx,
                           enum kvt_lookup_result result, double dt_s)
{
    kvt_metrics_on_lookup_h(mt, ctx, key, kvt_key_hash(key), label_idx, result, dt_s);
}

/* Every case of a lookup's observation (kvt_metrics_on_lookup_h). Kept out of
 * line, so that the common case's path saves no registers. */
__attribute__((noinline)) static void on_lookup_slow(struct kvt_metrics *mt,
                                                     const struct kvt_req_ctx *ctx, uint64_t hash,
                                                     size_t label_idx,
                                                     enum kvt_lookup_result result, double dt_s)
{
    struct req_metrics *rm = req_of(mt, ctx);
    struct observed *ob;
    uint64_t fp = lookup_fp(hash, label_idx);

    assert(label_idx <= mt->n_tiers);
    if (rm == NULL || !rm->observing ||
        (result != KVT_HIT && result != KVT_MISS && result != KVT_RETRY))
        return;
    if (ob_reserve(rm) != 0)
        return; /* best effort: out of memory loses the observation */
    ob = ob_cell(rm, fp);
    if (result == KVT_RETRY) {
        rm->saw_retry = true;
        queue_allow(mt);
        if (ob->fp != 0)
            return; /* setdefault: the first RETRY starts the clock */
        ob->fp = fp;
        ob->start_s = kvt_now_s() - dt_s;
        rm->n_ob++;
        return;
    }
    /* HIT or MISS: counted once, unless a RETRY left a start time. */
    if (ob->fp == 0) {
        ob->fp = fp;
        ob->start_s = -1;
        rm->n_ob++;
        observe_resolved(mt, label_idx, result, dt_s, -1);
        return;
    }
    if (ob->start_s < 0)
        return;
    observe_resolved(mt, label_idx, result, dt_s, ob->start_s);
    ob->start_s = -1;
}

/* One observation, as vLLM makes it at the lookup. The common case first, with no
 * frame of its own: the request asked last, still observing, a table with room, a
 * HIT or MISS of a (label, key) it has not observed. Anything else goes the whole
 * way (on_lookup_slow), which starts over: this path changes nothing unless it
 * completes. */
static inline void apply_lookup(struct kvt_metrics *mt, const struct kvt_req_ctx *ctx,
                                uint64_t hash, size_t label_idx, enum kvt_lookup_result result,
                                double dt_s)
{
    struct req_metrics *rm = mt->last_rm;

    if (mt->last_ctx == ctx && rm != NULL && rm->observing && rm->ob != NULL &&
        2 * (rm->n_ob + 1) <= rm->mask + 1 && (result == KVT_HIT || result == KVT_MISS) &&
        label_idx <= mt->n_tiers) {
        uint64_t fp = lookup_fp(hash, label_idx);
        struct observed *ob = ob_cell(rm, fp);

        if (ob->fp == 0) {
            struct label_acc *a = &mt->acc[label_idx];

            ob->fp = fp;
            ob->start_s = -1;
            rm->n_ob++;
            a->queries++;
            a->hits += result == KVT_HIT;
            hist_add(&a->sync_delay, mt->sync_layout, dt_s);
            return;
        }
        if (ob->start_s < 0)
            return; /* counted already */
    }
    on_lookup_slow(mt, ctx, hash, label_idx, result, dt_s);
}

/* The queue, in order: all of it is last_ctx's primary lookups (queue.ctx is
 * last_ctx or NULL, and whatever changes last_ctx applies the queue first). Out of
 * line: it has many callers. */
__attribute__((noinline)) static void apply_queued_now(struct kvt_metrics *mt)
{
    struct kvt_metrics_queue *q = &mt->queue;
    uint32_t n = q->n;

    q->n = 0;
    for (uint32_t i = 0; i < n; i++)
        apply_lookup(mt, mt->last_ctx, q->q[i].hash, 0, (enum kvt_lookup_result)q->q[i].result,
                     q->q[i].dt_s);
}

static void apply_queued(struct kvt_metrics *mt)
{
    if (mt->queue.n > 0)
        apply_queued_now(mt);
}

struct kvt_metrics_queue *kvt_metrics_queue_of(struct kvt_metrics *mt)
{
    return &mt->queue;
}

void kvt_metrics_on_lookup_h(struct kvt_metrics *mt, const struct kvt_req_ctx *ctx,
                             const struct kvt_key *key, uint64_t hash, size_t label_idx,
                             enum kvt_lookup_result result, double dt_s)
{
    (void)key;
    apply_queued(mt);
    apply_lookup(mt, ctx, hash, label_idx, result, dt_s);
}

void kvt_metrics_on_job_registered(struct kvt_metrics *mt, const struct kvt_job *job, int tier_idx)
{
    assert(tier_idx >= 0 && (size_t)tier_idx < mt->n_tiers);
    struct tier_state *ts = &mt->tiers[tier_idx];

    if (job->is_promotion) {
        ts->active_promotions++;
        ts->write_chunks += job->n;
    } else {
        ts->active_cascades++;
        ts->read_chunks += job->n;
    }
}

void kvt_metrics_on_job_finished(struct kvt_metrics *mt, const struct kvt_job *job, int tier_idx,
                                 const struct kvt_job_result *result)
{
    assert(tier_idx >= 0 && (size_t)tier_idx < mt->n_tiers);
    const char *label = mt->labels[tier_idx + 1];
    struct tier_state *ts = &mt->tiers[tier_idx];
    size_t done = job->n;
    bool count_bytes = true;

    if (!result->success) {
        kvt_stats_increase(&mt->stats,
                           job->is_promotion ? KVT_M_PROMOTION_FAILURES : KVT_M_CASCADE_FAILURES,
                           label, 1);
        if (job->is_promotion && result->n_successful > 0)
            done = result->n_successful;
        else
            count_bytes = false;
    }
    if (count_bytes) {
        kvt_stats_increase(&mt->stats, job->is_promotion ? KVT_M_READ_BYTES : KVT_M_WRITE_BYTES,
                           label, (double)done * (double)mt->row_bytes);
        if (result->transfer_time >= 0)
            kvt_stats_increase(&mt->stats, job->is_promotion ? KVT_M_READ_TIME : KVT_M_WRITE_TIME,
                               label, result->transfer_time);
    }
    if (job->is_promotion) {
        assert(ts->active_promotions > 0 && ts->write_chunks >= job->n);
        ts->active_promotions--;
        ts->write_chunks -= job->n;
    } else {
        assert(ts->active_cascades > 0 && ts->read_chunks >= job->n);
        ts->active_cascades--;
        ts->read_chunks -= job->n;
    }
}

void kvt_metrics_on_promotion_allocation_failure(struct kvt_metrics *mt)
{
    kvt_stats_increase(&mt->stats, KVT_M_PROMOTION_ALLOC_FAILURES, NULL, 1);
}

void kvt_metrics_record_backpressure(struct kvt_metrics *mt, struct kvt_tier *const *tiers,
                                     size_t n)
{
    assert(n <= mt->n_tiers);
    for (size_t i = 0; i < n; i++) {
        struct kvt_bp *bp = tiers[i]->bp;
        uint64_t stores, chunks;

        if (bp == NULL)
            continue;
        const char *label = mt->labels[i + 1];

        kvt_stats_set_gauge(&mt->stats, KVT_M_BP_EMA, label, kvt_bp_ema(bp));
        kvt_bp_pop_dropped(bp, &stores, &chunks);
        if (stores > 0)
            kvt_stats_increase(&mt->stats, KVT_M_BP_STORES_DROPPED, label, (double)stores);
        if (chunks > 0)
            kvt_stats_increase(&mt->stats, KVT_M_BP_BLOCKS_DROPPED, label, (double)chunks);
    }
}

bool kvt_metrics_is_idle(const struct kvt_metrics *mt)
{
    for (size_t i = 0; i < mt->n_tiers; i++) {
        const struct tier_state *ts = &mt->tiers[i];

        if (ts->active_promotions || ts->active_cascades || ts->write_chunks || ts->read_chunks)
            return false;
    }
    return true;
}

static int flush_hist(struct kvt_stats *st, const char *name, const char *label, struct hist_acc *h)
{
    struct kvt_stats one;
    int rc;

    if (h->count == 0)
        return 0;
    /* one histogram entry with these observations, merged as aggregate merges */
    kvt_stats_init(&one);
    rc = kvt_stats_observe(&one, name, label, 0);
    if (rc == 0) {
        struct kvt_stat *s = &one.s[0];

        s->count = h->count;
        s->sum = h->sum;
        memcpy(s->buckets, h->buckets, sizeof(s->buckets));
        rc = kvt_stats_aggregate(st, &one);
    }
    kvt_stats_cleanup(&one);
    memset(h, 0, sizeof(*h));
    return rc;
}

/* The lookup observations since the last take_stats, into mt->stats. */
static int flush_lookups(struct kvt_metrics *mt)
{
    int rc = 0;

    for (size_t i = 0; rc == 0 && i <= mt->n_tiers; i++) {
        struct label_acc *a = &mt->acc[i];
        const char *label = mt->labels[i];

        if (a->queries > 0)
            rc = kvt_stats_increase(&mt->stats, KVT_M_CHUNK_QUERIES, label, (double)a->queries);
        if (rc == 0 && a->hits > 0)
            rc = kvt_stats_increase(&mt->stats, KVT_M_CHUNK_HITS, label, (double)a->hits);
        if (rc == 0)
            rc = flush_hist(&mt->stats, KVT_M_LOOKUP_SYNC_DELAY, label, &a->sync_delay);
        if (rc == 0)
            rc = flush_hist(&mt->stats, KVT_M_LOOKUP_ASYNC_DELAY, label, &a->async_delay);
        a->queries = a->hits = 0;
    }
    return rc;
}

int kvt_metrics_take_stats(struct kvt_metrics *mt, struct kvt_stats *out)
{
    double n = (double)mt->num_primary_chunks;
    int rc = 0;

    apply_queued(mt);
    for (size_t i = 0; i < mt->n_tiers && rc == 0; i++) {
        const struct tier_state *ts = &mt->tiers[i];
        const char *label = mt->labels[i + 1];

        rc = kvt_stats_set_gauge(out, KVT_M_PRIMARY_WRITE_USAGE, label,
                                 n > 0 ? (double)ts->write_chunks / n : 0.0);
        if (rc == 0)
            rc = kvt_stats_set_gauge(out, KVT_M_PRIMARY_READ_USAGE, label,
                                     n > 0 ? (double)ts->read_chunks / n : 0.0);
        if (rc == 0)
            rc = kvt_stats_set_gauge(out, KVT_M_ACTIVE_PROMOTIONS, label,
                                     (double)ts->active_promotions);
        if (rc == 0)
            rc =
                kvt_stats_set_gauge(out, KVT_M_ACTIVE_CASCADES, label, (double)ts->active_cascades);
    }
    if (rc == 0)
        rc = flush_lookups(mt);
    if (rc == 0)
        rc = kvt_stats_aggregate(out, &mt->stats);
    kvt_stats_clear(&mt->stats);
    return rc;
}

/* TieringMetricsTracker (spec §5.5), a port of vLLM's tiering/metrics.py:
 * - per request, per tier label, per key: whether a resolved lookup was already
 *   counted, or when the first RETRY started (async delay); nothing is counted after
 *   the request was allocated;
 * - per tier: active promotion / cascade jobs and the primary chunks they write / pin;
 * - accumulated counters and histograms, popped by take_stats, after gauges that are
 *   re-emitted on every call.
 * Bytes of a finished job are keys x primary row size, as vLLM counts them (a tier's
 * own transfer_bytes is for back-pressure, not for these counters). */
#include <assert.h>
#include <errno.h>
#include <stdio.h>
#include <string.h>

#include "kvt/alloc.h"
#include "kvt/clock.h"
#include "kvt/backpressure.h"
#include "kvt/map.h"
#include "kvt/metrics.h"
#include "kvt/tier.h"

struct tier_state {
    size_t active_promotions, active_cascades;
    size_t write_chunks, read_chunks;
};

/* One observed (tier label, key) of a request. */
struct observed {
    bool has_start; /* a RETRY started the async delay clock */
    double start_s;
};

struct req_metrics {
    bool observing;          /* false once allocated (Python: observed_lookups = None) */
    struct kvt_map observed; /* label_idx byte || key bytes -> struct observed */
};

struct kvt_metrics {
    size_t n_tiers;
    size_t num_primary_chunks;
    size_t row_bytes;
    char (*labels)[KVT_STAT_LABEL_MAX]; /* [0] primary, [i+1] tier i */
    struct tier_state *tiers;
    struct kvt_map requests; /* req_id -> struct req_metrics */
    struct kvt_stats stats;
};

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
    if (mt->labels == NULL || mt->tiers == NULL) {
        kvt_free(mt->labels);
        kvt_free(mt->tiers);
        kvt_free(mt);
        return -ENOMEM;
    }
    snprintf(mt->labels[0], KVT_STAT_LABEL_MAX, "%s", KVT_PRIMARY_LABEL);
    for (size_t i = 0; i < n_tiers; i++)
        snprintf(mt->labels[i + 1], KVT_STAT_LABEL_MAX, "%zu:%s", i + 1, tier_types[i]);
    kvt_map_init(&mt->requests);
    kvt_stats_init(&mt->stats);
    *mt_p = mt;
    return 0;
}

static void req_metrics_free(struct req_metrics *rm)
{
    struct kvt_map_entry *e;

    for (size_t it = 0; kvt_map_next(&rm->observed, &it, &e);)
        kvt_free(e->value);
    kvt_map_cleanup(&rm->observed);
    kvt_free(rm);
}

void kvt_metrics_destroy(struct kvt_metrics *mt)
{
    struct kvt_map_entry *e;

    if (mt == NULL)
        return;
    for (size_t it = 0; kvt_map_next(&mt->requests, &it, &e);)
        req_metrics_free(e->value);
    kvt_map_cleanup(&mt->requests);
    kvt_stats_cleanup(&mt->stats);
    kvt_free(mt->labels);
    kvt_free(mt->tiers);
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
    kvt_map_init(&rm->observed);
    struct req_metrics *old = kvt_map_get(&mt->requests, ctx->req_id, ctx->req_id_len);

    if (kvt_map_put(&mt->requests, ctx->req_id, ctx->req_id_len, rm) < 0) {
        req_metrics_free(rm);
        return NULL;
    }
    if (old != NULL)
        req_metrics_free(old);
    return rm;
}

void kvt_metrics_on_new_request(struct kvt_metrics *mt, const struct kvt_req_ctx *ctx)
{
    /* Metrics are best effort: out of memory loses observations, never state. */
    (void)req_new(mt, ctx);
}

void kvt_metrics_on_request_allocated(struct kvt_metrics *mt, const struct kvt_req_ctx *ctx)
{
    struct req_metrics *rm = kvt_map_get(&mt->requests, ctx->req_id, ctx->req_id_len);

    if (rm == NULL)
        return;
    rm->observing = false;
    struct kvt_map_entry *e;

    for (size_t it = 0; kvt_map_next(&rm->observed, &it, &e);)
        kvt_free(e->value);
    kvt_map_clear(&rm->observed);
}

void kvt_metrics_on_request_finished(struct kvt_metrics *mt, const struct kvt_req_ctx *ctx)
{
    struct req_metrics *rm = kvt_map_remove(&mt->requests, ctx->req_id, ctx->req_id_len);

    if (rm != NULL)
        req_metrics_free(rm);
}

static void observe_resolved(struct kvt_metrics *mt, size_t label_idx,
                             enum kvt_lookup_result result, double dt_s,
                             const struct observed *start)
{
    const char *label = mt->labels[label_idx];

    kvt_stats_increase(&mt->stats, KVT_M_CHUNK_QUERIES, label, 1);
    if (result == KVT_HIT)
        kvt_stats_increase(&mt->stats, KVT_M_CHUNK_HITS, label, 1);
    kvt_stats_observe(&mt->stats, KVT_M_LOOKUP_SYNC_DELAY, label, dt_s);
    if (start != NULL && start->has_start)
        kvt_stats_observe(&mt->stats, KVT_M_LOOKUP_ASYNC_DELAY, label,
                          kvt_now_s() - start->start_s);
}

void kvt_metrics_on_lookup(struct kvt_metrics *mt, const struct kvt_req_ctx *ctx,
                           const struct kvt_key *key, size_t label_idx,
                           enum kvt_lookup_result result, double dt_s)
{
    struct req_metrics *rm = kvt_map_get(&mt->requests, ctx->req_id, ctx->req_id_len);
    uint8_t okey[1 + KVT_KEY_MAX];

    assert(label_idx <= mt->n_tiers);
    if (rm == NULL && (rm = req_new(mt, ctx)) == NULL)
        return;
    if (!rm->observing || (result != KVT_HIT && result != KVT_MISS && result != KVT_RETRY))
        return;
    okey[0] = (uint8_t)label_idx;
    memcpy(okey + 1, key->bytes, key->len);
    struct observed *ob = kvt_map_get(&rm->observed, okey, 1u + key->len);

    if (result == KVT_RETRY) {
        if (ob != NULL)
            return; /* setdefault: the first RETRY starts the clock */
        ob = kvt_malloc(sizeof(*ob));
        if (ob == NULL)
            return;
        ob->has_start = true;
        ob->start_s = kvt_now_s() - dt_s;
        if (kvt_map_put(&rm->observed, okey, 1u + key->len, ob) < 0)
            kvt_free(ob);
        return;
    }
    /* HIT or MISS: counted once, unless a RETRY left a start time. */
    if (ob != NULL && !ob->has_start)
        return;
    if (ob == NULL) {
        ob = kvt_malloc(sizeof(*ob));
        if (ob == NULL)
            return;
        ob->has_start = false;
        if (kvt_map_put(&rm->observed, okey, 1u + key->len, ob) < 0) {
            kvt_free(ob);
            return;
        }
        observe_resolved(mt, label_idx, result, dt_s, NULL);
        return;
    }
    observe_resolved(mt, label_idx, result, dt_s, ob);
    ob->has_start = false;
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

int kvt_metrics_take_stats(struct kvt_metrics *mt, struct kvt_stats *out)
{
    double n = (double)mt->num_primary_chunks;
    int rc = 0;

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
        rc = kvt_stats_aggregate(out, &mt->stats);
    kvt_stats_clear(&mt->stats);
    return rc;
}

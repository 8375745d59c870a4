/* SPDX-License-Identifier: Apache-2.0 */
/* TieringMetricsTracker: per-request lookup observations, job
 * accounting per tier, allocation failures; take_stats pops counters and
 * re-emits gauges. Tier labels: "0:primary", "<i+1>:<type>". */
#ifndef KVT_METRICS_H
#define KVT_METRICS_H

#include <stddef.h>
#include <stdint.h>
#include <stdbool.h>

#include "kvt/types.h"
#include "kvt/stats.h"

struct kvt_metrics;
struct kvt_tier;

/* Metric names (vLLM's). */
#define KVT_M_LOOKUP_SYNC_DELAY        "vllm:kv_offload_tiering_lookup_sync_delay_seconds"
#define KVT_M_LOOKUP_ASYNC_DELAY       "vllm:kv_offload_tiering_lookup_async_delay_seconds"
#define KVT_M_READ_BYTES               "vllm:kv_offload_tiering_read_bytes"
#define KVT_M_READ_TIME                "vllm:kv_offload_tiering_read_time"
#define KVT_M_WRITE_BYTES              "vllm:kv_offload_tiering_write_bytes"
#define KVT_M_WRITE_TIME               "vllm:kv_offload_tiering_write_time"
#define KVT_M_PROMOTION_FAILURES       "vllm:kv_offload_tiering_promotion_job_failures"
#define KVT_M_CASCADE_FAILURES         "vllm:kv_offload_tiering_cascade_job_failures"
#define KVT_M_CHUNK_QUERIES            "vllm:kv_offload_tiering_chunk_queries"
#define KVT_M_CHUNK_HITS               "vllm:kv_offload_tiering_chunk_hits"
#define KVT_M_PRIMARY_WRITE_USAGE      "vllm:kv_offload_tiering_primary_write_usage_perc"
#define KVT_M_PRIMARY_READ_USAGE       "vllm:kv_offload_tiering_primary_read_usage_perc"
#define KVT_M_PROMOTION_ALLOC_FAILURES "vllm:kv_offload_tiering_promotion_allocation_failures"
#define KVT_M_ACTIVE_PROMOTIONS        "vllm:kv_offload_tiering_active_promotion_jobs"
#define KVT_M_ACTIVE_CASCADES          "vllm:kv_offload_tiering_active_cascade_jobs"
#define KVT_M_BP_EMA                   "vllm:kv_offload_tiering_backpressure_store_latency_ema"
#define KVT_M_BP_STORES_DROPPED        "vllm:kv_offload_tiering_backpressure_stores_dropped"
#define KVT_M_BP_BLOCKS_DROPPED        "vllm:kv_offload_tiering_backpressure_blocks_dropped"
#define KVT_M_CPU_USAGE                "vllm:kv_offload_cpu_cache_usage_perc"
#define KVT_M_CPU_WRITE_USAGE          "vllm:kv_offload_cpu_cache_write_usage_perc"
#define KVT_M_CPU_READ_USAGE           "vllm:kv_offload_cpu_cache_read_usage_perc"
#define KVT_M_CPU_ALLOC_SIZE           "vllm:kv_offload_cpu_allocation_size"

#define KVT_PRIMARY_LABEL "0:primary"

/* tier_types[i] is the type of secondary tier i. */
int kvt_metrics_create(const char *const *tier_types, size_t n_tiers, size_t num_primary_chunks,
                       size_t primary_row_bytes, struct kvt_metrics **mt_p);
void kvt_metrics_destroy(struct kvt_metrics *mt);

/* Label of tier slot idx: 0 = primary, i+1 = secondary tier i. */
const char *kvt_metrics_label(const struct kvt_metrics *mt, size_t idx);

void kvt_metrics_on_new_request(struct kvt_metrics *mt, const struct kvt_req_ctx *ctx);
void kvt_metrics_on_request_allocated(struct kvt_metrics *mt, const struct kvt_req_ctx *ctx);
void kvt_metrics_on_request_finished(struct kvt_metrics *mt, const struct kvt_req_ctx *ctx);
/* label_idx as in kvt_metrics_label; dt_s the time spent in that tier's lookup. */
void kvt_metrics_on_lookup(struct kvt_metrics *mt, const struct kvt_req_ctx *ctx,
                           const struct kvt_key *key, size_t label_idx,
                           enum kvt_lookup_result result, double dt_s);
/* The same, with hash == kvt_key_hash(key) (the caller has it already). */
void kvt_metrics_on_lookup_h(struct kvt_metrics *mt, const struct kvt_req_ctx *ctx,
                             const struct kvt_key *key, uint64_t hash, size_t label_idx,
                             enum kvt_lookup_result result, double dt_s);

/* Observations of the primary's lookups that a caller may queue without a call:
 * the common one (a HIT or MISS of the request whose lookups are being observed,
 * which has had no RETRY) is stored here and applied, in order, before anything
 * else reads or changes the observations (every other kvt_metrics_* call, and when
 * the queue is full). A one-key lookup at a million chunks takes two cache misses;
 * without the call the core starts the next lookup's under them. Queued
 * observations carry their own delay and start no clock, so applying them later
 * changes no figure. */
#define KVT_METRICS_QUEUE_MAX 32
struct kvt_metrics_queue {
    /* The request whose primary lookups may be queued now, or NULL. Set only to a
     * request the metrics hold a reference to, so no other can take its address. */
    const struct kvt_req_ctx *ctx;
    uint32_t n;
    struct {
        uint64_t hash;
        double dt_s;
        uint32_t result;
    } q[KVT_METRICS_QUEUE_MAX];
};

struct kvt_metrics_queue *kvt_metrics_queue_of(struct kvt_metrics *mt);

/* kvt_metrics_on_lookup_h(mt, ctx, key, hash, 0, result, dt_s) when it returns true;
 * when false, the caller makes that call. */
static inline bool kvt_metrics_queue_lookup(struct kvt_metrics_queue *q,
                                            const struct kvt_req_ctx *ctx, uint64_t hash,
                                            enum kvt_lookup_result result, double dt_s)
{
    if (q->ctx != ctx || q->n == KVT_METRICS_QUEUE_MAX || (result != KVT_HIT && result != KVT_MISS))
        return false;
    q->q[q->n].hash = hash;
    q->q[q->n].dt_s = dt_s;
    q->q[q->n].result = (uint32_t)result;
    q->n++;
    return true;
}

void kvt_metrics_on_job_registered(struct kvt_metrics *mt, const struct kvt_job *job, int tier_idx);
void kvt_metrics_on_job_finished(struct kvt_metrics *mt, const struct kvt_job *job, int tier_idx,
                                 const struct kvt_job_result *result);
void kvt_metrics_on_promotion_allocation_failure(struct kvt_metrics *mt);
/* EMA gauge and popped drop counters for every tier that has a detector. */
void kvt_metrics_record_backpressure(struct kvt_metrics *mt, struct kvt_tier *const *tiers,
                                     size_t n);
bool kvt_metrics_is_idle(const struct kvt_metrics *mt);
/* Gauges for every tier, then the accumulated counters and histograms (reset). */
int kvt_metrics_take_stats(struct kvt_metrics *mt, struct kvt_stats *out);

#endif

/* SPDX-License-Identifier: Apache-2.0 */
/* EMA back-pressure detector (seconds per MiB), with the
 * throttled-drop and drop-store policies, idle decay, cooldown and healthy bypass.
 * Single-threaded: owned by a tier, driven by the manager on the scheduler thread.
 * Time comes from kvt_now_s() so tests can fake it. */
#ifndef KVT_BACKPRESSURE_H
#define KVT_BACKPRESSURE_H

#include <stddef.h>
#include <stdint.h>
#include <stdbool.h>

#define KVT_BP_LOCAL_HIGH_WATER_S   0.005
#define KVT_BP_LOCAL_LOW_WATER_S    0.001
#define KVT_BP_NETWORK_HIGH_WATER_S 0.020
#define KVT_BP_NETWORK_LOW_WATER_S  0.005

enum kvt_bp_policy {
    KVT_BP_THROTTLED_DROP = 0, /* default */
    KVT_BP_DROP_STORE = 1,
};

struct kvt_bp_config {
    double high_water_s;
    double low_water_s;
    double alpha;                /* 0.3 */
    unsigned warmup_completions; /* 3 */
    double decay_half_life_s;    /* 2.0 */
    double cooldown_s;           /* 1.0 */
    enum kvt_bp_policy policy;
    double ramp_factor; /* throttled drop: 2.0 */
};

/* default_config(tier_type, locality): NETWORK watermarks for locality REMOTE or
 * tier type "obj", LOCAL otherwise. locality is enum kvt_locality or KVT_ANY. */
void kvt_bp_default_config(const char *tier_type, int locality, struct kvt_bp_config *cfg);

struct kvt_bp;

/* -EINVAL unless 0 < alpha <= 1 and low <= high (as vLLM; NaN fails both), and
 * also for what Python would only trip over later: an unknown policy,
 * ramp_factor <= 0 with the throttled policy, warmup_completions == UINT_MAX
 * (the completion count saturates there). -ENOMEM. */
int kvt_bp_create(const struct kvt_bp_config *cfg, struct kvt_bp **bp_p);
void kvt_bp_destroy(struct kvt_bp *bp);

/* update(submit_time, num_bytes): ignored when num_bytes <= 0. */
void kvt_bp_update(struct kvt_bp *bp, double submit_time_s, int64_t num_bytes);
void kvt_bp_on_store_completed(struct kvt_bp *bp, double elapsed_s, int64_t num_bytes);
/* Decides one cascade of num_chunks chunks; a "no" is counted as a dropped store. */
bool kvt_bp_should_store(struct kvt_bp *bp, size_t num_chunks);
bool kvt_bp_is_under_pressure(struct kvt_bp *bp); /* applies idle decay */
bool kvt_bp_is_healthy(const struct kvt_bp *bp);
void kvt_bp_reset(struct kvt_bp *bp);
double kvt_bp_ema(const struct kvt_bp *bp);
/* Return-and-reset of the dropped counters (stores, chunks). */
void kvt_bp_pop_dropped(struct kvt_bp *bp, uint64_t *stores_p, uint64_t *chunks_p);

#endif

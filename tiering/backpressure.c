/* SPDX-License-Identifier: Apache-2.0 */
/* Back-pressure detection for secondary tiers (vLLM's
 * EMABackpressureDetector with ThrottledDropPolicy / DropStorePolicy).
 *
 * A tier that cannot keep up with cascade stores pins primary chunks for as long
 * as its copies are in flight, which starves the GPU->CPU stores; so the manager
 * asks this detector before every cascade and skips (drops) the store when the
 * tier is pressured. Loads and promotions are never gated.
 *
 * Signal: an exponential moving average of store latency normalised by size,
 * in seconds per MiB, so batch size does not matter.
 *
 *   warmup       the first warmup_completions samples only seed the EMA (their
 *                mean); no pressure decision is made until then
 *   EMA update   ema = alpha * x + (1 - alpha) * ema, then
 *                ema > high -> pressured; ema < low -> not pressured, and one
 *                more "healthy" completion; in between (hysteresis band) the
 *                flag stays and the healthy streak restarts
 *   idle decay   only when queried while pressured: ema *= 0.5^(dt/half_life),
 *                because when every store is dropped no completion arrives and
 *                the flag could otherwise never clear
 *   cooldown     for cooldown_s after pressure clears every second store is
 *                dropped, so the backlog does not re-overwhelm the tier at once
 *   healthy      after 10 consecutive completions below low water the policy is
 *                bypassed entirely
 *   policy       DropStore: drop everything while pressured. ThrottledDrop: drop
 *                rate min(1, overshoot / ramp_factor) with overshoot =
 *                (ema - high) / high, applied deterministically as "drop every
 *                period-th store", period = max(2, round-half-even(1 / rate)).
 *
 * Single-threaded (the scheduler thread). Time is kvt_now_s(), so tests fake it. */
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kvt/alloc.h"
#include "kvt/backpressure.h"
#include "kvt/backpressure_test.h"
#include "kvt/clock.h"
#include "kvt/types.h"

#define BP_MIB               ((double)(1 << 20))
#define BP_HEALTHY_THRESHOLD 10u

/* Everything here is owned by the detector and touched by one thread. The state
 * vLLM's tests poke at is kept as the struct the test hooks exchange:
 *   ema             s/MiB
 *   completions     store completions seen (warmup gating); saturates
 *   last_update_s   kvt_now_s() of the last EMA change; 0 = never
 *   healthy_streak  consecutive completions with ema < low; saturates
 *   pressure_cleared_at_s  kvt_now_s() when pressure last cleared; 0 = never */
struct kvt_bp {
    struct kvt_bp_config cfg;
    struct kvt_bp_state s;
    double warmup_sum; /* sum and count of the warmup samples */
    unsigned warmup_n;
    /* policy state */
    uint64_t stores_dropped;
    uint64_t chunks_dropped;
    uint64_t call_count; /* throttled drop: decisions taken at a partial drop rate */
};

void kvt_bp_default_config(const char *tier_type, int locality, struct kvt_bp_config *cfg)
{
    bool network = locality == KVT_REMOTE || (tier_type != NULL && strcmp(tier_type, "obj") == 0);

    memset(cfg, 0, sizeof(*cfg));
    cfg->high_water_s = network ? KVT_BP_NETWORK_HIGH_WATER_S : KVT_BP_LOCAL_HIGH_WATER_S;
    cfg->low_water_s = network ? KVT_BP_NETWORK_LOW_WATER_S : KVT_BP_LOCAL_LOW_WATER_S;
    cfg->alpha = 0.3;
    cfg->warmup_completions = 3;
    cfg->decay_half_life_s = 2.0;
    cfg->cooldown_s = 1.0;
    cfg->policy = KVT_BP_THROTTLED_DROP;
    cfg->ramp_factor = 2.0;
}

int kvt_bp_create(const struct kvt_bp_config *cfg, struct kvt_bp **bp_p)
{
    struct kvt_bp *bp;

    if (cfg == NULL || bp_p == NULL)
        return -EINVAL;
    /* Written as negations so that NaN is rejected too. */
    if (!(cfg->alpha > 0 && cfg->alpha <= 1))
        return -EINVAL;
    if (!(cfg->low_water_s <= cfg->high_water_s))
        return -EINVAL;
    /* completions saturates at UINT_MAX, so warmup must end below it. */
    if (cfg->warmup_completions == UINT_MAX)
        return -EINVAL;
    if (cfg->policy != KVT_BP_THROTTLED_DROP && cfg->policy != KVT_BP_DROP_STORE)
        return -EINVAL;
    /* vLLM divides by ramp_factor at decision time; refuse it up front. */
    if (cfg->policy == KVT_BP_THROTTLED_DROP && !(cfg->ramp_factor > 0))
        return -EINVAL;
    bp = kvt_calloc(1, sizeof(*bp));
    if (bp == NULL)
        return -ENOMEM;
    bp->cfg = *cfg;
    *bp_p = bp;
    return 0;
}

void kvt_bp_destroy(struct kvt_bp *bp)
{
    kvt_free(bp);
}

void kvt_bp_update(struct kvt_bp *bp, double submit_time_s, int64_t num_bytes)
{
    if (num_bytes <= 0)
        return;
    kvt_bp_on_store_completed(bp, kvt_now_s() - submit_time_s, num_bytes);
}

void kvt_bp_on_store_completed(struct kvt_bp *bp, double elapsed_s, int64_t num_bytes)
{
    double now, x;

    if (num_bytes <= 0) /* vLLM would divide by zero; there is no sample */
        return;
    now = kvt_now_s();
    x = elapsed_s / ((double)num_bytes / BP_MIB);
    /* Python's counters are unbounded. Ours saturate: a wrapped count would send a
     * detector that has run for days back into warmup (and a wrapped streak would
     * end the healthy bypass for no reason). Only comparisons with small
     * thresholds read them, so saturation changes nothing else. */
    if (bp->s.completions < UINT_MAX)
        bp->s.completions++;
    if (bp->s.completions <= bp->cfg.warmup_completions) {
        bp->warmup_sum += x;
        bp->warmup_n++;
        if (bp->s.completions == bp->cfg.warmup_completions) {
            bp->s.ema = bp->warmup_sum / bp->warmup_n;
            bp->s.last_update_s = now;
        }
        return;
    }
    bp->s.ema = bp->cfg.alpha * x + (1 - bp->cfg.alpha) * bp->s.ema;
    bp->s.last_update_s = now;
    if (bp->s.ema > bp->cfg.high_water_s) {
        bp->s.under_pressure = true;
        bp->s.pressure_cleared_at_s = 0;
        bp->s.healthy_streak = 0;
    } else if (bp->s.ema < bp->cfg.low_water_s) {
        if (bp->s.under_pressure) {
            bp->s.pressure_cleared_at_s = now;
            bp->s.cooldown_count = 0;
        }
        bp->s.under_pressure = false;
        if (bp->s.healthy_streak < UINT_MAX)
            bp->s.healthy_streak++;
    } else {
        bp->s.healthy_streak = 0;
    }
}

bool kvt_bp_is_under_pressure(struct kvt_bp *bp)
{
    if (bp->s.under_pressure && bp->s.completions >= bp->cfg.warmup_completions) {
        double now = kvt_now_s();
        double dt = now - bp->s.last_update_s;
        if (dt > 0 && bp->cfg.decay_half_life_s > 0) {
            bp->s.ema *= pow(0.5, dt / bp->cfg.decay_half_life_s);
            bp->s.last_update_s = now;
        }
        if (bp->s.ema < bp->cfg.low_water_s) {
            bp->s.under_pressure = false;
            bp->s.pressure_cleared_at_s = now;
            bp->s.cooldown_count = 0;
        }
    }
    return bp->s.under_pressure;
}

bool kvt_bp_is_healthy(const struct kvt_bp *bp)
{
    return !bp->s.under_pressure && bp->s.healthy_streak >= BP_HEALTHY_THRESHOLD;
}

static bool throttled_allows(struct kvt_bp *bp)
{
    double high = bp->cfg.high_water_s;
    double overshoot, rate, period;

    if (!kvt_bp_is_under_pressure(bp))
        return true;
    if (!(high > 0))
        return false;
    /* max(0, ema - high) as Python computes it: a NaN difference gives 0. */
    overshoot = bp->s.ema - high > 0 ? (bp->s.ema - high) / high : 0;
    rate = fmin(1.0, overshoot / bp->cfg.ramp_factor);
    if (rate <= 0)
        return true;
    if (rate >= 1.0)
        return false;
    bp->call_count++;
    period = nearbyint(1.0 / rate); /* ties to even, as Python's round() */
    if (period < 2)
        period = 2;
    if (period >= 0x1p63) /* a rate so small that no store is ever dropped */
        return true;
    return bp->call_count % (uint64_t)period != 0;
}

bool kvt_bp_policy_allows(struct kvt_bp *bp)
{
    if (bp->cfg.policy == KVT_BP_DROP_STORE)
        return !kvt_bp_is_under_pressure(bp);
    return throttled_allows(bp);
}

static void bp_skip(struct kvt_bp *bp, size_t num_chunks)
{
    bp->stores_dropped++;
    bp->chunks_dropped += num_chunks;
}

bool kvt_bp_should_store(struct kvt_bp *bp, size_t num_chunks)
{
    if (kvt_bp_is_healthy(bp))
        return true;
    if (!bp->s.under_pressure && bp->s.pressure_cleared_at_s > 0 &&
        kvt_now_s() - bp->s.pressure_cleared_at_s < bp->cfg.cooldown_s) {
        bp->s.cooldown_count++;
        if (bp->s.cooldown_count % 2 == 0) {
            bp_skip(bp, num_chunks);
            return false;
        }
    }
    if (!kvt_bp_policy_allows(bp)) {
        bp_skip(bp, num_chunks);
        return false;
    }
    return true;
}

void kvt_bp_reset(struct kvt_bp *bp)
{
    struct kvt_bp_config cfg = bp->cfg;

    memset(bp, 0, sizeof(*bp));
    bp->cfg = cfg;
}

double kvt_bp_ema(const struct kvt_bp *bp)
{
    return bp->s.ema;
}

void kvt_bp_set_ema(struct kvt_bp *bp, double ema)
{
    bp->s.ema = ema;
}

void kvt_bp_pop_dropped(struct kvt_bp *bp, uint64_t *stores_p, uint64_t *chunks_p)
{
    if (stores_p != NULL)
        *stores_p = bp->stores_dropped;
    if (chunks_p != NULL)
        *chunks_p = bp->chunks_dropped;
    bp->stores_dropped = 0;
    bp->chunks_dropped = 0;
}

void kvt__bp_get_state(const struct kvt_bp *bp, struct kvt_bp_state *st_p)
{
    *st_p = bp->s;
}

void kvt__bp_set_state(struct kvt_bp *bp, const struct kvt_bp_state *st)
{
    bp->s = *st;
}

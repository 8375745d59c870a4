/* SPDX-License-Identifier: Apache-2.0 */
/* The back-pressure detector against vLLM's scenarios
 * (tests/v1/kv_offload/tiering/test_backpressure.py), plus
 * default_config, create's -EINVAL cases and pop_dropped's return-and-reset.
 *
 * Upstream patches time.monotonic and pokes private fields; here the clock is
 * faked (kvt_clock_set_fake, starting at T0 = 1000 s) and the fields are set
 * through kvt__bp_set_state. Water marks as upstream: high 1000 / low 500 s/MiB,
 * scaled for 16-byte rows, so one row taking L seconds is L * 65536 s/MiB.
 *
 * The manager-level class (TestBackpressure) runs against a port of upstream's
 * DelayedSecondaryTierManager: stores are kept at once but reported only after
 * release; a "latency" is the fake time that passes between submit and the poll.
 * Five of that class (stores_skipped_under_pressure, loads_continue_under_pressure,
 * request_level_tier_respects_backpressure, metrics_reported_via_get_stats,
 * reset_cache_clears_backpressure) live in test_manager.c with the example tier. */
#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "test_util.h"

#include "kvt/backpressure.h"
#include "kvt/backpressure_test.h"
#include "kvt/clock.h"
#include "kvt/clock_test.h"
#include "kvt/manager.h"
#include "kvt/primary.h"

#define HIGH   1000.0
#define LOW    500.0
#define ALPHA  0.3
#define WARMUP 3u
#define ROW    16
#define MIB    ((double)(1 << 20))
#define SCALE  (MIB / ROW) /* s/MiB per second of latency for one row */

/* ---- fake clock ------------------------------------------------------------ */

#define T0_NS 1000000000000ull

static uint64_t fake_ns;

static int clock_setup(void **state)
{
    fake_ns = T0_NS;
    kvt_clock_set_fake(&fake_ns);
    return 0;
}

static int clock_teardown(void **state)
{
    kvt_clock_set_fake(NULL);
    return 0;
}

static void advance(double seconds)
{
    fake_ns += (uint64_t)llround(seconds * 1e9);
}

/* ---- detectors --------------------------------------------------------------- */

static struct kvt_bp *detector(double cooldown_s, enum kvt_bp_policy policy)
{
    struct kvt_bp_config c;
    struct kvt_bp *bp = NULL;
    kvt_bp_default_config("fs", KVT_ANY, &c);
    c.high_water_s = HIGH;
    c.low_water_s = LOW;
    c.cooldown_s = cooldown_s;
    c.policy = policy;
    assert_int_equal(kvt_bp_create(&c, &bp), 0);
    return bp;
}

/* TestIdleDecay's and TestThrottledDropPolicy's detectors (cooldown as upstream). */
static struct kvt_bp *decay_detector(void)
{
    return detector(1.0, KVT_BP_THROTTLED_DROP);
}
static struct kvt_bp *no_cooldown_detector(void)
{
    return detector(0.0, KVT_BP_THROTTLED_DROP);
}

static struct kvt_bp_state state_of(const struct kvt_bp *bp)
{
    struct kvt_bp_state st;
    kvt__bp_get_state(bp, &st);
    return st;
}

/* bp._completions = c; bp._ema = ema; bp._under_pressure = p; bp._last_update = now */
static void set_pressure(struct kvt_bp *bp, unsigned completions, double ema, bool pressured)
{
    struct kvt_bp_state st = state_of(bp);
    st.completions = completions;
    st.ema = ema;
    st.under_pressure = pressured;
    st.last_update_s = kvt_now_s();
    kvt__bp_set_state(bp, &st);
}

/* bp._healthy_streak = n */
static void set_streak(struct kvt_bp *bp, unsigned n)
{
    struct kvt_bp_state st = state_of(bp);
    st.healthy_streak = n;
    kvt__bp_set_state(bp, &st);
}

/* bp._pressure_cleared_at = cleared_at_s; bp._cooldown_count = count */
static void set_cooldown(struct kvt_bp *bp, double cleared_at_s, unsigned count)
{
    struct kvt_bp_state st = state_of(bp);
    st.pressure_cleared_at_s = cleared_at_s;
    st.cooldown_count = count;
    kvt__bp_set_state(bp, &st);
}

/* elapsed seconds that make one sample of s_per_mib for nbytes */
static double elapsed_for(double s_per_mib, double nbytes)
{
    return s_per_mib * (nbytes / MIB);
}

static void expect_dropped(struct kvt_bp *bp, uint64_t stores, uint64_t chunks)
{
    uint64_t s = ~0ull, c = ~0ull;
    kvt_bp_pop_dropped(bp, &s, &c);
    assert_int_equal(s, stores);
    assert_int_equal(c, chunks);
}

/* How many of n should_store(1) calls are refused. */
static unsigned count_drops(struct kvt_bp *bp, unsigned n)
{
    unsigned drops = 0;
    for (unsigned i = 0; i < n; i++)
        drops += !kvt_bp_should_store(bp, 1);
    return drops;
}

/* ---- TestDefaultConfig ------------------------------------------------------- */

static void expect_watermarks(const char *type, int locality, double high, double low)
{
    struct kvt_bp_config c;
    memset(&c, 0xa5, sizeof(c));
    kvt_bp_default_config(type, locality, &c);
    assert_true(c.high_water_s == high);
    assert_true(c.low_water_s == low);
}

static void test_fs_gets_local_watermarks(void **state)
{
    expect_watermarks("fs", KVT_ANY, KVT_BP_LOCAL_HIGH_WATER_S, KVT_BP_LOCAL_LOW_WATER_S);
    assert_true(KVT_BP_LOCAL_HIGH_WATER_S == 0.005);
    assert_true(KVT_BP_LOCAL_LOW_WATER_S == 0.001);
}

static void test_obj_gets_network_watermarks(void **state)
{
    expect_watermarks("obj", KVT_ANY, KVT_BP_NETWORK_HIGH_WATER_S, KVT_BP_NETWORK_LOW_WATER_S);
    assert_true(KVT_BP_NETWORK_HIGH_WATER_S == 0.020);
    assert_true(KVT_BP_NETWORK_LOW_WATER_S == 0.005);
}

static void test_p2p_gets_local_watermarks(void **state)
{
    expect_watermarks("p2p", KVT_ANY, KVT_BP_LOCAL_HIGH_WATER_S, KVT_BP_LOCAL_LOW_WATER_S);
}

static void test_fs_with_remote_locality_gets_network_watermarks(void **state)
{
    expect_watermarks("fs", KVT_REMOTE, KVT_BP_NETWORK_HIGH_WATER_S, KVT_BP_NETWORK_LOW_WATER_S);
}

static void test_fs_with_local_locality_gets_local_watermarks(void **state)
{
    expect_watermarks("fs", KVT_LOCAL, KVT_BP_LOCAL_HIGH_WATER_S, KVT_BP_LOCAL_LOW_WATER_S);
}

/* The constructor defaults of EMABackpressureDetector and ThrottledDropPolicy. */
static void test_default_config(void **state)
{
    struct kvt_bp_config c;
    struct kvt_bp *bp;
    memset(&c, 0xa5, sizeof(c));
    kvt_bp_default_config(NULL, KVT_ANY, &c);
    assert_true(c.high_water_s == KVT_BP_LOCAL_HIGH_WATER_S);
    assert_true(c.low_water_s == KVT_BP_LOCAL_LOW_WATER_S);
    assert_true(c.alpha == 0.3);
    assert_int_equal(c.warmup_completions, 3);
    assert_true(c.decay_half_life_s == 2.0);
    assert_true(c.cooldown_s == 1.0);
    assert_int_equal(c.policy, KVT_BP_THROTTLED_DROP);
    assert_true(c.ramp_factor == 2.0);
    /* "obj" is a network type whatever the locality says. */
    expect_watermarks("obj", KVT_LOCAL, KVT_BP_NETWORK_HIGH_WATER_S, KVT_BP_NETWORK_LOW_WATER_S);
    /* A fresh detector: nothing seen, nothing pressured, nothing dropped. */
    assert_int_equal(kvt_bp_create(&c, &bp), 0);
    assert_true(kvt_bp_ema(bp) == 0);
    assert_false(kvt_bp_is_under_pressure(bp));
    assert_false(kvt_bp_is_healthy(bp));
    expect_dropped(bp, 0, 0);
    kvt_bp_destroy(bp);
}

static void expect_create(const struct kvt_bp_config *c, int rc)
{
    static char sentinel;
    struct kvt_bp *before = (struct kvt_bp *)&sentinel, *bp = before; /* kept on failure */
    assert_int_equal(kvt_bp_create(c, &bp), rc);
    if (rc == 0)
        kvt_bp_destroy(bp);
    else
        assert_ptr_equal(bp, before);
}

static void test_create_rejects_invalid_config(void **state)
{
    struct kvt_bp_config good, c;
    struct kvt_bp *bp;
    kvt_bp_default_config("fs", KVT_ANY, &good);
    assert_int_equal(kvt_bp_create(NULL, &bp), -EINVAL);
    assert_int_equal(kvt_bp_create(&good, NULL), -EINVAL);
    expect_create(&good, 0);

    /* 0 < alpha <= 1 */
    c = good, c.alpha = 0;
    expect_create(&c, -EINVAL);
    c = good, c.alpha = -0.1;
    expect_create(&c, -EINVAL);
    c = good, c.alpha = 1.0000001;
    expect_create(&c, -EINVAL);
    c = good, c.alpha = NAN;
    expect_create(&c, -EINVAL);
    c = good, c.alpha = 1;
    expect_create(&c, 0);

    /* low <= high */
    c = good, c.low_water_s = c.high_water_s * 2;
    expect_create(&c, -EINVAL);
    c = good, c.low_water_s = c.high_water_s;
    expect_create(&c, 0);
    c = good, c.high_water_s = NAN;
    expect_create(&c, -EINVAL);

    /* What Python would only trip over later. */
    c = good, c.policy = (enum kvt_bp_policy)7;
    expect_create(&c, -EINVAL);
    c = good, c.ramp_factor = 0;
    expect_create(&c, -EINVAL);
    c = good, c.ramp_factor = -1;
    expect_create(&c, -EINVAL);
    c = good, c.policy = KVT_BP_DROP_STORE, c.ramp_factor = 0; /* unused there */
    expect_create(&c, 0);
    c = good, c.warmup_completions = UINT_MAX;
    expect_create(&c, -EINVAL);
    c = good, c.warmup_completions = 0;
    expect_create(&c, 0);
}

static void test_pop_dropped_returns_and_resets(void **state)
{
    struct kvt_bp *bp = no_cooldown_detector();
    uint64_t s = 0;
    set_pressure(bp, 0, HIGH * 4, true); /* 100 % drop */
    assert_false(kvt_bp_should_store(bp, 1));
    assert_false(kvt_bp_should_store(bp, 4));
    assert_false(kvt_bp_should_store(bp, 0));
    expect_dropped(bp, 3, 5);
    expect_dropped(bp, 0, 0);
    /* Either pointer may be NULL; the counters are reset all the same. */
    assert_false(kvt_bp_should_store(bp, 2));
    kvt_bp_pop_dropped(bp, &s, NULL);
    assert_int_equal(s, 1);
    expect_dropped(bp, 0, 0);
    assert_false(kvt_bp_should_store(bp, 2));
    kvt_bp_pop_dropped(bp, NULL, NULL);
    expect_dropped(bp, 0, 0);
    /* The policy test hook decides without counting. */
    assert_false(kvt_bp_policy_allows(bp));
    expect_dropped(bp, 0, 0);
    kvt_bp_destroy(bp);
}

/* ---- TestIdleDecay -------------------------------------------------------------- */

static void test_ema_decays_while_under_pressure(void **state)
{
    struct kvt_bp *bp = decay_detector();
    struct kvt_bp_state st;
    set_pressure(bp, WARMUP, HIGH * 2, true);
    set_cooldown(bp, 0, 3); /* left over from an earlier cooldown */
    advance(4.1);           /* ~2.05 half-lives */
    assert_false(kvt_bp_is_under_pressure(bp));
    assert_float_equal(kvt_bp_ema(bp), HIGH * 2 * pow(0.5, 4.1 / 2.0), 1e-6);
    assert_true(kvt_bp_ema(bp) < LOW);
    st = state_of(bp);
    assert_true(st.last_update_s == kvt_now_s());
    assert_true(st.pressure_cleared_at_s == kvt_now_s()); /* cooldown starts now */
    assert_int_equal(st.cooldown_count, 0);
    kvt_bp_destroy(bp);
}

static void test_ema_stays_pressured_if_not_enough_decay(void **state)
{
    struct kvt_bp *bp = decay_detector();
    set_pressure(bp, WARMUP, HIGH * 4, true);
    advance(2.0); /* one half-life */
    assert_true(kvt_bp_is_under_pressure(bp));
    assert_float_equal(kvt_bp_ema(bp), HIGH * 2, 1e-6);
    assert_true(state_of(bp).pressure_cleared_at_s == 0);
    /* The decay is persistent: asking again at the same time changes nothing. */
    assert_true(kvt_bp_is_under_pressure(bp));
    assert_float_equal(kvt_bp_ema(bp), HIGH * 2, 1e-6);
    /* And it goes on from there: another half-life, 1000, still not below 1000. */
    advance(2.0);
    assert_true(kvt_bp_is_under_pressure(bp));
    assert_float_equal(kvt_bp_ema(bp), HIGH, 1e-6);
    kvt_bp_destroy(bp);
}

static void test_no_decay_before_warmup(void **state)
{
    struct kvt_bp *bp = decay_detector();
    double t = kvt_now_s();
    set_pressure(bp, 0, HIGH * 2, true);
    advance(10.0);
    assert_true(kvt_bp_is_under_pressure(bp));
    assert_true(kvt_bp_ema(bp) == HIGH * 2);
    assert_true(state_of(bp).last_update_s == t);
    /* One short of warmup is still warmup. */
    set_pressure(bp, WARMUP - 1, HIGH * 2, true);
    advance(10.0);
    assert_true(kvt_bp_is_under_pressure(bp));
    assert_true(kvt_bp_ema(bp) == HIGH * 2);
    kvt_bp_destroy(bp);
}

static void test_no_decay_applied_during_new_sample(void **state)
{
    struct kvt_bp *bp = decay_detector();
    set_pressure(bp, WARMUP, HIGH * 2, true);
    advance(4.0);
    kvt_bp_on_store_completed(bp, 0.0, ROW);
    /* alpha * 0 + (1 - alpha) * 2000, not decayed first. */
    assert_true(kvt_bp_ema(bp) == (1 - ALPHA) * HIGH * 2);
    assert_true(state_of(bp).last_update_s == kvt_now_s());
    assert_true(kvt_bp_is_under_pressure(bp)); /* 1400 > high */
    assert_true(kvt_bp_ema(bp) == (1 - ALPHA) * HIGH * 2);
    kvt_bp_destroy(bp);
}

static void test_reset_clears_last_update(void **state)
{
    struct kvt_bp *bp = decay_detector();
    struct kvt_bp_state st;
    set_pressure(bp, WARMUP, HIGH * 4, true);
    set_streak(bp, 3);
    set_cooldown(bp, kvt_now_s(), 2);
    kvt_bp_reset(bp);
    st = state_of(bp);
    assert_true(st.last_update_s == 0);
    assert_true(st.ema == 0);
    assert_false(st.under_pressure);
    assert_int_equal(st.completions, 0);
    assert_int_equal(st.healthy_streak, 0);
    assert_true(st.pressure_cleared_at_s == 0);
    assert_int_equal(st.cooldown_count, 0);
    kvt_bp_destroy(bp);
}

/* ---- EMA rules at detector level (what TestBackpressure drives through a tier) --- */

/* Warmup seeds the EMA with the mean of its samples; nothing is decided before. */
static void test_warmup_seeds_ema_with_mean(void **state)
{
    struct kvt_bp *bp = decay_detector();
    /* 6000, 9000 and 3000 s/MiB: each far above high water. */
    kvt_bp_on_store_completed(bp, elapsed_for(6000, 4 * ROW), 4 * ROW);
    kvt_bp_on_store_completed(bp, elapsed_for(9000, ROW), ROW);
    assert_true(kvt_bp_ema(bp) == 0);
    assert_false(kvt_bp_is_under_pressure(bp));
    kvt_bp_on_store_completed(bp, elapsed_for(3000, 2 * ROW), 2 * ROW);
    assert_float_equal(kvt_bp_ema(bp), 6000, 1e-9);
    assert_false(kvt_bp_is_under_pressure(bp)); /* vLLM's detector decides nothing */
    assert_int_equal(state_of(bp).completions, 3);
    /* The first sample after warmup does decide. */
    kvt_bp_on_store_completed(bp, elapsed_for(6000, ROW), ROW);
    assert_float_equal(kvt_bp_ema(bp), 6000, 1e-9);
    assert_true(kvt_bp_is_under_pressure(bp));
    kvt_bp_destroy(bp);
}

/* update(submit_time, bytes): latency is now - submit_time; no bytes, no sample. */
static void test_update_measures_from_submit_time(void **state)
{
    struct kvt_bp *bp = decay_detector();
    double submit;
    set_pressure(bp, WARMUP, 0, false);
    submit = kvt_now_s();
    advance(0.25);
    kvt_bp_update(bp, submit, 0);
    kvt_bp_update(bp, submit, -ROW);
    assert_int_equal(state_of(bp).completions, WARMUP);
    assert_true(kvt_bp_ema(bp) == 0);
    kvt_bp_update(bp, submit, 8 * ROW); /* 0.25 s for 128 bytes */
    assert_int_equal(state_of(bp).completions, WARMUP + 1);
    assert_float_equal(kvt_bp_ema(bp), ALPHA * 0.25 * SCALE / 8, 1e-6);
    /* on_store_completed refuses a sample of no bytes too (Python would divide by 0). */
    kvt_bp_on_store_completed(bp, 1.0, 0);
    assert_int_equal(state_of(bp).completions, WARMUP + 1);
    kvt_bp_destroy(bp);
}

/* Hysteresis at detector level: the band keeps the flag and ends a healthy streak. */
static void test_band_keeps_flag_and_resets_streak(void **state)
{
    struct kvt_bp *bp = decay_detector();
    double mid = (LOW + HIGH) / 2;
    set_pressure(bp, WARMUP, mid, false);
    set_streak(bp, 5);
    kvt_bp_on_store_completed(bp, elapsed_for(mid, ROW), ROW);
    assert_false(kvt_bp_is_under_pressure(bp));
    assert_int_equal(state_of(bp).healthy_streak, 0);
    set_pressure(bp, WARMUP, mid, true);
    kvt_bp_on_store_completed(bp, elapsed_for(mid, ROW), ROW);
    assert_true(kvt_bp_is_under_pressure(bp));
    assert_float_equal(kvt_bp_ema(bp), mid, 1e-9);
    /* Exactly at a water mark is inside the band: > high and < low are strict. */
    set_pressure(bp, WARMUP, HIGH, false);
    kvt_bp_on_store_completed(bp, elapsed_for(HIGH, ROW), ROW);
    assert_false(kvt_bp_is_under_pressure(bp));
    set_pressure(bp, WARMUP, LOW, true);
    kvt_bp_on_store_completed(bp, elapsed_for(LOW, ROW), ROW);
    assert_true(kvt_bp_is_under_pressure(bp));
    kvt_bp_destroy(bp);
}

/* A detector that has seen UINT_MAX completions neither wraps back into warmup nor
 * loses its healthy streak (Python's counters are unbounded). */
static void test_counters_saturate(void **state)
{
    struct kvt_bp *bp = decay_detector();
    struct kvt_bp_state st;
    set_pressure(bp, UINT_MAX, 100, false);
    set_streak(bp, UINT_MAX);
    kvt_bp_on_store_completed(bp, elapsed_for(100, ROW), ROW);
    st = state_of(bp);
    assert_int_equal(st.completions, UINT_MAX);
    assert_int_equal(st.healthy_streak, UINT_MAX);
    assert_float_equal(st.ema, 100, 1e-9); /* an EMA step, not a warmup sample */
    assert_true(kvt_bp_is_healthy(bp));
    kvt_bp_on_store_completed(bp, elapsed_for(HIGH * 10, ROW), ROW);
    assert_float_equal(kvt_bp_ema(bp), 0.3 * HIGH * 10 + 0.7 * 100, 1e-9);
    assert_true(kvt_bp_is_under_pressure(bp));
    assert_int_equal(state_of(bp).completions, UINT_MAX);
    kvt_bp_destroy(bp);
}

/* ---- TestThrottledDropPolicy ------------------------------------------------- */

static void test_no_drop_when_not_under_pressure(void **state)
{
    struct kvt_bp *bp = no_cooldown_detector();
    set_pressure(bp, 0, HIGH * 4, false); /* the flag decides, not the EMA */
    assert_int_equal(count_drops(bp, 20), 0);
    expect_dropped(bp, 0, 0);
    kvt_bp_destroy(bp);
}

static void test_no_drop_at_exactly_high_water(void **state)
{
    struct kvt_bp *bp = no_cooldown_detector();
    set_pressure(bp, 0, HIGH, true);
    assert_int_equal(count_drops(bp, 20), 0);
    expect_dropped(bp, 0, 0);
    assert_true(kvt_bp_is_under_pressure(bp)); /* pressured, yet a 0 % drop rate */
    kvt_bp_destroy(bp);
}

static void test_partial_drop_at_moderate_pressure(void **state)
{
    struct kvt_bp *bp = no_cooldown_detector();
    set_pressure(bp, 0, HIGH * 2, true);
    /* 2x high: rate 0.5, period 2 -> every second store is dropped. */
    for (int i = 1; i <= 20; i++)
        assert_int_equal(kvt_bp_should_store(bp, 1), i % 2 != 0);
    expect_dropped(bp, 10, 10);
    kvt_bp_destroy(bp);
}

static void test_full_drop_at_severe_pressure(void **state)
{
    struct kvt_bp *bp = no_cooldown_detector();
    set_pressure(bp, 0, HIGH * 4, true);
    assert_int_equal(count_drops(bp, 20), 20);
    expect_dropped(bp, 20, 20);
    /* 3x high is already 100 %. */
    set_pressure(bp, 0, HIGH * 3, true);
    assert_int_equal(count_drops(bp, 20), 20);
    kvt_bp_destroy(bp);
}

static void test_drop_rate_increases_with_severity(void **state)
{
    /* rate = min(1, (m - 1) / 2); period = max(2, round(1 / rate)):
     * 1.5x -> 0.25, every 4th; 2x -> 0.5, every 2nd; 2.5x -> 0.75, round(1.33) = 1,
     * so still every 2nd; 3.5x -> all. */
    const double mult[] = {1.5, 2.0, 2.5, 3.5};
    const unsigned want[] = {25, 50, 50, 100};
    unsigned prev = 0;
    for (size_t i = 0; i < 4; i++) {
        struct kvt_bp *bp = no_cooldown_detector();
        unsigned drops;
        set_pressure(bp, 0, HIGH * mult[i], true);
        drops = count_drops(bp, 100);
        assert_int_equal(drops, want[i]);
        assert_true(drops >= prev);
        prev = drops;
        kvt_bp_destroy(bp);
    }
}

/* 1.8x high: rate 0.4, 1 / 0.4 == 2.5 exactly in doubles; Python's round() gives 2
 * (half to even), so every 2nd store is dropped, not every 3rd. */
static void test_period_rounds_half_to_even(void **state)
{
    struct kvt_bp *bp = no_cooldown_detector();
    set_pressure(bp, 0, HIGH * 1.8, true);
    assert_int_equal(count_drops(bp, 30), 15);
    kvt_bp_destroy(bp);
}

static void test_explicit_drop_store_policy_still_drops_all(void **state)
{
    struct kvt_bp *bp = detector(0.0, KVT_BP_DROP_STORE);
    set_pressure(bp, 0, HIGH * 1.5, true);
    assert_int_equal(count_drops(bp, 20), 20);
    expect_dropped(bp, 20, 20);
    /* Even at a "0 %" EMA the flag alone drops. */
    set_pressure(bp, 0, HIGH, true);
    assert_int_equal(count_drops(bp, 5), 5);
    set_pressure(bp, 0, HIGH * 4, false);
    assert_int_equal(count_drops(bp, 5), 0);
    kvt_bp_destroy(bp);
}

/* The throttled policy asks is_under_pressure() first, so idle decay can clear
 * pressure (and start the cooldown) in the middle of a decision. */
static void test_policy_sees_decayed_ema(void **state)
{
    struct kvt_bp *bp = detector(1.0, KVT_BP_THROTTLED_DROP);
    set_pressure(bp, WARMUP, HIGH * 4, true);
    advance(2.0); /* 4000 -> 2000: rate 0.5 */
    assert_true(kvt_bp_should_store(bp, 1));
    assert_false(kvt_bp_should_store(bp, 1));
    advance(2.1); /* 2000 -> 966: under high, rate 0, still pressured (band) */
    assert_true(kvt_bp_should_store(bp, 1));
    assert_true(kvt_bp_should_store(bp, 1));
    advance(1.8); /* -> 518: still not below low */
    assert_true(kvt_bp_is_under_pressure(bp));
    assert_float_equal(kvt_bp_ema(bp), HIGH * 4 * pow(0.5, 5.9 / 2.0), 1e-6);
    advance(0.2); /* -> 483, below low: clears inside should_store, which then allows */
    assert_true(kvt_bp_should_store(bp, 1));
    assert_false(kvt_bp_is_under_pressure(bp));
    assert_true(state_of(bp).pressure_cleared_at_s == kvt_now_s());
    /* ... and the next call is the cooldown's first (odd: allowed), then even. */
    assert_true(kvt_bp_should_store(bp, 1));
    assert_false(kvt_bp_should_store(bp, 1));
    expect_dropped(bp, 2, 2);
    kvt_bp_destroy(bp);
}

/* ---- TestHealthyBypass --------------------------------------------------------- */

static void test_not_healthy_initially(void **state)
{
    struct kvt_bp *bp = no_cooldown_detector();
    assert_false(kvt_bp_is_healthy(bp));
    assert_int_equal(state_of(bp).healthy_streak, 0);
    kvt_bp_destroy(bp);
}

static void test_healthy_after_streak(void **state)
{
    struct kvt_bp *bp = no_cooldown_detector();
    double fast = elapsed_for(LOW * 0.5, ROW);
    set_pressure(bp, WARMUP, 0, false);
    for (unsigned i = 1; i <= 10 + WARMUP; i++) {
        kvt_bp_on_store_completed(bp, fast, ROW);
        assert_int_equal(state_of(bp).healthy_streak, i);
        assert_int_equal(kvt_bp_is_healthy(bp), i >= 10);
    }
    kvt_bp_destroy(bp);
}

static void test_healthy_resets_on_high_latency(void **state)
{
    struct kvt_bp *bp = no_cooldown_detector();
    set_pressure(bp, WARMUP, 0, false);
    set_streak(bp, 10);
    assert_true(kvt_bp_is_healthy(bp));
    kvt_bp_on_store_completed(bp, elapsed_for(HIGH * 2, ROW), ROW);
    /* 0.3 * 2000 = 600: in the band, so the streak ends without pressure. */
    assert_float_equal(kvt_bp_ema(bp), 600, 1e-9);
    assert_false(kvt_bp_is_healthy(bp));
    assert_int_equal(state_of(bp).healthy_streak, 0);
    assert_false(kvt_bp_is_under_pressure(bp));
    /* Pressure ends it too. */
    set_streak(bp, 10);
    kvt_bp_on_store_completed(bp, elapsed_for(HIGH * 10, ROW), ROW);
    assert_false(kvt_bp_is_healthy(bp));
    assert_int_equal(state_of(bp).healthy_streak, 0);
    assert_true(kvt_bp_is_under_pressure(bp));
    kvt_bp_destroy(bp);
}

static void test_healthy_bypasses_policy(void **state)
{
    struct kvt_bp *bp = detector(1.0, KVT_BP_THROTTLED_DROP);
    set_pressure(bp, WARMUP, 0, false);
    set_streak(bp, 10);
    assert_true(kvt_bp_should_store(bp, 1));
    /* Observable: inside a cooldown window whose next call would be dropped,
     * a healthy detector still stores and does not even count the call. */
    set_cooldown(bp, kvt_now_s(), 1);
    for (int i = 0; i < 5; i++)
        assert_true(kvt_bp_should_store(bp, 1));
    assert_int_equal(state_of(bp).cooldown_count, 1);
    expect_dropped(bp, 0, 0);
    /* One short of the threshold: the cooldown applies again. */
    set_streak(bp, 9);
    assert_false(kvt_bp_should_store(bp, 1));
    expect_dropped(bp, 1, 1);
    kvt_bp_destroy(bp);
}

static void test_reset_clears_healthy_streak(void **state)
{
    struct kvt_bp *bp = no_cooldown_detector();
    set_streak(bp, 10);
    assert_true(kvt_bp_is_healthy(bp));
    kvt_bp_reset(bp);
    assert_int_equal(state_of(bp).healthy_streak, 0);
    assert_false(kvt_bp_is_healthy(bp));
    kvt_bp_destroy(bp);
}

/* ---- TestCooldown ----------------------------------------------------------------- */

static void test_cooldown_throttles_stores(void **state)
{
    struct kvt_bp *bp = detector(1.0, KVT_BP_THROTTLED_DROP);
    double cleared;
    set_pressure(bp, WARMUP, HIGH * 2, true);
    advance(10.0);
    assert_false(kvt_bp_is_under_pressure(bp));
    cleared = state_of(bp).pressure_cleared_at_s;
    assert_true(cleared == kvt_now_s());
    advance(0.1);
    /* Odd calls allowed, even ones dropped: exactly 5 of 10. */
    for (int i = 1; i <= 10; i++)
        assert_int_equal(kvt_bp_should_store(bp, 2), i % 2 != 0);
    assert_int_equal(state_of(bp).cooldown_count, 10);
    expect_dropped(bp, 5, 10);
    /* Once the second has passed, everything is stored again. */
    advance(0.95);
    assert_int_equal(count_drops(bp, 10), 0);
    assert_int_equal(state_of(bp).cooldown_count, 10);
    kvt_bp_destroy(bp);
}

static void test_no_cooldown_when_never_pressured(void **state)
{
    struct kvt_bp *bp = detector(1.0, KVT_BP_THROTTLED_DROP);
    assert_int_equal(count_drops(bp, 20), 0);
    assert_int_equal(state_of(bp).cooldown_count, 0);
    kvt_bp_destroy(bp);
}

static void test_no_cooldown_after_window_expires(void **state)
{
    struct kvt_bp *bp = detector(1.0, KVT_BP_THROTTLED_DROP);
    set_cooldown(bp, kvt_now_s() - 2.0, 0);
    assert_int_equal(count_drops(bp, 20), 0);
    assert_int_equal(state_of(bp).cooldown_count, 0);
    kvt_bp_destroy(bp);
}

static void test_reset_clears_cooldown(void **state)
{
    struct kvt_bp *bp = detector(1.0, KVT_BP_THROTTLED_DROP);
    struct kvt_bp_state st;
    set_cooldown(bp, kvt_now_s(), 5);
    kvt_bp_reset(bp);
    st = state_of(bp);
    assert_true(st.pressure_cleared_at_s == 0);
    assert_int_equal(st.cooldown_count, 0);
    assert_int_equal(count_drops(bp, 4), 0); /* no window left */
    kvt_bp_destroy(bp);
}

/* ---- the delayed tier (upstream's DelayedSecondaryTierManager) --------------------- */

#define DT_MAX 64

struct delayed_tier {
    struct kvt_tier base;
    struct kvt_key blocks[DT_MAX]; /* stored keys, at submit time */
    size_t n_blocks;
    kvt_job_id_t held[DT_MAX], released[DT_MAX];
    size_t n_held, n_released;
    unsigned stores; /* submit_store calls */
    /* Upstream's create_store_job + tier.submit_store: at the next
     * serve_external_requests, pin these keys through the parent and store them. */
    struct kvt_key force[8];
    size_t n_force;
    struct kvt_req_ctx *force_ctx;
};

static struct delayed_tier *dt_of(struct kvt_tier *t)
{
    return (struct delayed_tier *)t;
}

static bool dt_has(struct delayed_tier *d, const struct kvt_key *k)
{
    for (size_t i = 0; i < d->n_blocks; i++)
        if (kvt_key_eq(&d->blocks[i], k))
            return true;
    return false;
}

static enum kvt_lookup_result dt_lookup(struct kvt_tier *t, const struct kvt_key *k,
                                        struct kvt_req_ctx *ctx)
{
    return dt_has(dt_of(t), k) ? KVT_HIT : KVT_MISS;
}

static int dt_submit_store(struct kvt_tier *t, const struct kvt_job *job)
{
    struct delayed_tier *d = dt_of(t);
    for (size_t i = 0; i < job->n; i++) {
        if (!dt_has(d, &job->keys[i])) {
            assert_true(d->n_blocks < DT_MAX);
            d->blocks[d->n_blocks++] = job->keys[i];
        }
    }
    assert_true(d->n_held < DT_MAX);
    d->held[d->n_held++] = job->id;
    d->stores++;
    return 0;
}

static int dt_submit_load(struct kvt_tier *t, const struct kvt_job *job)
{
    struct delayed_tier *d = dt_of(t);
    assert_true(d->n_released < DT_MAX);
    d->released[d->n_released++] = job->id;
    return 0;
}

static void dt_get_finished_jobs(struct kvt_tier *t, kvt_job_result_cb_t cb, void *arg)
{
    struct delayed_tier *d = dt_of(t);
    size_t n = d->n_released;
    d->n_released = 0;
    for (size_t i = 0; i < n; i++) {
        struct kvt_job_result r = {
            .job_id = d->released[i], .success = true, .transfer_time = -1, .transfer_bytes = -1};
        cb(arg, &r);
    }
}

static void dt_release(struct delayed_tier *d)
{
    assert_true(d->n_released + d->n_held <= DT_MAX);
    memcpy(d->released + d->n_released, d->held, d->n_held * sizeof(d->held[0]));
    d->n_released += d->n_held;
    d->n_held = 0;
}

static int dt_drain(struct kvt_tier *t)
{
    dt_release(dt_of(t));
    return 0;
}

static bool dt_has_pending_work(struct kvt_tier *t)
{
    return dt_of(t)->n_held > 0;
}

static void dt_serve(struct kvt_tier *t, struct kvt_parent *p)
{
    struct delayed_tier *d = dt_of(t);
    const struct kvt_job *job;
    if (d->n_force == 0)
        return;
    assert_int_equal(kvt_parent_create_store_job(p, d->force, d->n_force, d->force_ctx, &job), 0);
    d->n_force = 0;
    assert_int_equal(dt_submit_store(t, job), 0);
}

static void dt_destroy(struct kvt_tier *t)
{
    free(dt_of(t));
}

static const struct kvt_tier_ops delayed_ops = {
    .lookup = dt_lookup,
    .submit_store = dt_submit_store,
    .submit_load = dt_submit_load,
    .get_finished_jobs = dt_get_finished_jobs,
    .drain_jobs = dt_drain,
    .has_pending_work = dt_has_pending_work,
    .serve_external_requests = dt_serve,
    .destroy = dt_destroy,
};

/* ---- TestBackpressure: manager, primary of 20 rows of 16 bytes, one delayed tier ---- */

struct mfx {
    struct kvt_manager *m;
    struct kvt_primary *p;
    struct delayed_tier *tier;
    struct kvt_bp *bp;
    struct kvt_req_ctx *ctx; /* upstream's _CTX, "test" */
    struct kvt_store_output out;
};

static struct mfx *mfx_new(void)
{
    struct mfx *f = calloc(1, sizeof(*f));
    struct kvt_primary_config pc = {.num_chunks = 20, .row_bytes = ROW};
    struct kvt_tier *tiers[1];
    assert_non_null(f);
    f->tier = calloc(1, sizeof(*f->tier));
    assert_non_null(f->tier);
    kvt_tier_init(&f->tier->base, &delayed_ops, "delayed", KVT_MEDIUM_CPU, KVT_ANY);
    /* EMABackpressureDetector(high_water_s=1000, low_water_s=500), other defaults. */
    f->bp = detector(1.0, KVT_BP_THROTTLED_DROP);
    f->tier->base.bp = f->bp;
    assert_int_equal(kvt_primary_create(&pc, NULL, &f->p), 0);
    tiers[0] = &f->tier->base;
    assert_int_equal(kvt_manager_create(f->p, tiers, 1, &f->m), 0);
    f->ctx = kt_ctx("test");
    kvt_store_output_init(&f->out);
    assert_int_equal(kvt_manager_on_new_request(f->m, f->ctx, NULL), 0);
    return f;
}

static void mfx_free(struct mfx *f)
{
    assert_int_equal(kvt_manager_shutdown(f->m), 0);
    kvt_manager_destroy(f->m); /* frees the tier and its detector */
    kvt_req_ctx_unref(f->ctx);
    kvt_store_output_cleanup(&f->out);
    free(f);
}

static void mstep(struct mfx *f)
{
    kvt_manager_on_schedule_end(f->m, NULL);
}

/* _store_blocks: prepare_store + complete_store (the cascade decision). */
static void mstore(struct mfx *f, const struct kvt_key *k, size_t n)
{
    assert_int_equal(kvt_manager_prepare_store(f->m, k, n, f->ctx, &f->out), 0);
    assert_int_equal(kvt_manager_complete_store(f->m, k, n, f->ctx, true), 0);
}

/* The jobs submitted so far complete after latency_s: end this step (serving any
 * forced store), let the time pass, release, and let the next step poll them. */
static void mcomplete_after(struct mfx *f, double latency_s)
{
    mstep(f);
    advance(latency_s);
    dt_release(f->tier);
    mstep(f);
}

static void mforce_store(struct mfx *f, const struct kvt_key *k, size_t n)
{
    memcpy(f->tier->force, k, n * sizeof(*k));
    f->tier->n_force = n;
    f->tier->force_ctx = f->ctx;
}

static void test_ema_updates_on_store_completion(void **state)
{
    struct mfx *f = mfx_new();
    struct kvt_key k;
    double fast = 0.01, slow = 0.05;
    for (unsigned i = 0; i < WARMUP - 1; i++) {
        k = kt_key(300 + (int)i);
        mstore(f, &k, 1);
        mcomplete_after(f, fast);
        assert_true(kvt_bp_ema(f->bp) == 0);
        assert_int_equal(state_of(f->bp).completions, i + 1);
    }
    k = kt_key(400);
    mstore(f, &k, 1);
    mcomplete_after(f, fast);
    assert_float_equal(kvt_bp_ema(f->bp), fast * SCALE, 1e-6); /* 655.36 */
    k = kt_key(401);
    mstore(f, &k, 1);
    mcomplete_after(f, slow);
    /* 0.3 * 3276.8 + 0.7 * 655.36 */
    assert_float_equal(kvt_bp_ema(f->bp), ALPHA * slow * SCALE + (1 - ALPHA) * fast * SCALE, 1e-6);
    assert_float_equal(kvt_bp_ema(f->bp), 1441.792, 1e-6);
    assert_true(kvt_bp_is_under_pressure(f->bp));
    assert_int_equal(kvt_manager_num_jobs(f->m), 0); /* every cascade reported */
    mfx_free(f);
}

static void test_pressure_activates_above_high_water(void **state)
{
    struct mfx *f = mfx_new();
    struct kvt_key k;
    for (int i = 0; i < (int)WARMUP; i++) {
        k = kt_key(200 + i);
        mstore(f, &k, 1);
        mcomplete_after(f, 0.001);
    }
    assert_float_equal(kvt_bp_ema(f->bp), 0.001 * SCALE, 1e-6);
    assert_false(kvt_bp_is_under_pressure(f->bp));
    k = kt_key(100);
    mstore(f, &k, 1);
    mcomplete_after(f, 0.1); /* 6553.6 s/MiB */
    assert_float_equal(kvt_bp_ema(f->bp), ALPHA * 0.1 * SCALE + (1 - ALPHA) * 0.001 * SCALE, 1e-6);
    assert_true(kvt_bp_ema(f->bp) > HIGH);
    assert_true(kvt_bp_is_under_pressure(f->bp));
    mfx_free(f);
}

static void test_pressure_clears_below_low_water(void **state)
{
    struct mfx *f = mfx_new();
    int id = 100, iterations = 0;
    set_pressure(f->bp, WARMUP, HIGH * 2, true);
    set_cooldown(f->bp, 0, 3); /* left over from an earlier cooldown */
    /* Fast completions (1 ms a row, 65.5 s/MiB) of forced stores until the EMA is
     * below low water. The throttle lets every cascade through on the way, so
     * each iteration feeds two samples (cascade + forced):
     *   1: 2000, rate 0.5, call 1 of period 2 allowed  -> 1420 -> 1013
     *   2: 1013, rate 0.0067, call 2 of period ~149     ->  729 ->  530 (band)
     *   3:  530, under high, rate 0                      ->  391 (cleared) -> 293 */
    while (kvt_bp_ema(f->bp) >= LOW) {
        struct kvt_key k = kt_key(id++);
        assert_true(iterations++ < 10);
        mstore(f, &k, 1);
        mforce_store(f, &k, 1);
        mcomplete_after(f, 0.001);
    }
    assert_int_equal(iterations, 3);
    assert_false(kvt_bp_is_under_pressure(f->bp));
    assert_int_equal(state_of(f->bp).completions, WARMUP + 6);
    assert_int_equal(state_of(f->bp).healthy_streak, 2);
    assert_true(state_of(f->bp).pressure_cleared_at_s == kvt_now_s());
    assert_int_equal(state_of(f->bp).cooldown_count, 0);
    assert_int_equal(f->tier->stores, 6);
    expect_dropped(f->bp, 0, 0);
    mfx_free(f);
}

static void test_hysteresis_prevents_oscillation(void **state)
{
    struct mfx *f = mfx_new();
    struct kvt_key k[2], k2[2];
    double mid = (LOW + HIGH) / 2, lat = elapsed_for(mid, 2 * ROW), decayed;
    kt_keys(k, 0, 2);
    kt_keys(k2, 10, 2);

    /* Not pressured: a mid-band EMA does not activate. */
    set_pressure(f->bp, WARMUP, mid, false);
    mstore(f, k, 2);
    mcomplete_after(f, lat);
    assert_false(kvt_bp_is_under_pressure(f->bp));
    assert_float_equal(kvt_bp_ema(f->bp), mid, 1e-3);

    /* Pressured: a mid-band EMA does not clear. Rows written to the primary
     * directly, then a forced store job (a cascade might be throttled). */
    set_pressure(f->bp, WARMUP, mid, true);
    assert_int_equal(kvt_primary_prepare_store(f->p, k2, 2, &f->out), 0);
    assert_int_equal(kvt_primary_complete_store(f->p, k2, 2, true), 0);
    mforce_store(f, k2, 2);
    mcomplete_after(f, lat);
    assert_true(kvt_bp_is_under_pressure(f->bp));
    /* The manager asks is_under_pressure() before feeding the sample, so the EMA
     * decays over the job's latency first, then takes the sample. */
    decayed = mid * pow(0.5, lat / 2.0);
    assert_float_equal(kvt_bp_ema(f->bp), ALPHA * mid + (1 - ALPHA) * decayed, 1e-3);
    mfx_free(f);
}

static void test_stores_resume_after_pressure_clears(void **state)
{
    struct mfx *f = mfx_new();
    struct kvt_key k1[2], k2[2];
    kt_keys(k1, 60, 2);
    kt_keys(k2, 70, 2);
    set_pressure(f->bp, 0, HIGH * 4, true);
    mstore(f, k1, 2);
    assert_false(dt_has(f->tier, &k1[0]));
    assert_false(dt_has(f->tier, &k1[1]));
    assert_int_equal(f->tier->stores, 0);

    set_pressure(f->bp, 0, HIGH * 4, false); /* bp._under_pressure = False */
    mstore(f, k2, 2);
    assert_true(dt_has(f->tier, &k2[0]));
    assert_true(dt_has(f->tier, &k2[1]));
    assert_false(dt_has(f->tier, &k1[0])); /* a dropped cascade is not retried */
    assert_int_equal(f->tier->stores, 1);
    expect_dropped(f->bp, 1, 2);
    mfx_free(f);
}

static void test_dropped_store_count_tracked(void **state)
{
    struct mfx *f = mfx_new();
    struct kvt_key a = kt_key(80), b[2];
    kt_keys(b, 81, 2);
    set_pressure(f->bp, 0, HIGH * 4, true);
    expect_dropped(f->bp, 0, 0);
    mstore(f, &a, 1);
    mstore(f, b, 2);
    expect_dropped(f->bp, 2, 3);
    expect_dropped(f->bp, 0, 0);
    assert_int_equal(f->tier->stores, 0);
    assert_int_equal(kvt_manager_num_jobs(f->m), 0); /* no job id, no pin */
    mfx_free(f);
}

#define T(fn) cmocka_unit_test_setup_teardown(fn, clock_setup, clock_teardown)

int main(void)
{
    const struct CMUnitTest tests[] = {
        T(test_fs_gets_local_watermarks),
        T(test_obj_gets_network_watermarks),
        T(test_p2p_gets_local_watermarks),
        T(test_fs_with_remote_locality_gets_network_watermarks),
        T(test_fs_with_local_locality_gets_local_watermarks),
        T(test_default_config),
        T(test_create_rejects_invalid_config),
        T(test_pop_dropped_returns_and_resets),
        T(test_ema_decays_while_under_pressure),
        T(test_ema_stays_pressured_if_not_enough_decay),
        T(test_no_decay_before_warmup),
        T(test_no_decay_applied_during_new_sample),
        T(test_reset_clears_last_update),
        T(test_warmup_seeds_ema_with_mean),
        T(test_update_measures_from_submit_time),
        T(test_band_keeps_flag_and_resets_streak),
        T(test_counters_saturate),
        T(test_ema_updates_on_store_completion),
        T(test_pressure_activates_above_high_water),
        T(test_pressure_clears_below_low_water),
        T(test_hysteresis_prevents_oscillation),
        T(test_stores_resume_after_pressure_clears),
        T(test_dropped_store_count_tracked),
        T(test_no_drop_when_not_under_pressure),
        T(test_no_drop_at_exactly_high_water),
        T(test_partial_drop_at_moderate_pressure),
        T(test_full_drop_at_severe_pressure),
        T(test_drop_rate_increases_with_severity),
        T(test_period_rounds_half_to_even),
        T(test_explicit_drop_store_policy_still_drops_all),
        T(test_policy_sees_decayed_ema),
        T(test_not_healthy_initially),
        T(test_healthy_after_streak),
        T(test_healthy_resets_on_high_latency),
        T(test_healthy_bypasses_policy),
        T(test_reset_clears_healthy_streak),
        T(test_cooldown_throttles_stores),
        T(test_no_cooldown_when_never_pressured),
        T(test_no_cooldown_after_window_expires),
        T(test_reset_clears_cooldown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

/* SPDX-License-Identifier: Apache-2.0 */
/* TieringMetricsTracker (vLLM's tests/v1/kv_offload/tiering/test_metrics.py)
 * and OffloadingConnectorStats. */
#include <errno.h>
#include <stdio.h>
#include <string.h>

#include "test_util.h"
#include "kvt/clock.h"
#include "kvt/clock_test.h"
#include "kvt/common.h"
#include "kvt/metrics.h"
#include "kvt/stats.h"

static const char *const fs_p2p[] = {"fs", "p2p"};
static const char *const fs_only[] = {"fs"};

static double val(struct kvt_stats *st, const char *name, const char *label)
{
    return kvt_stats_value(st, name, label);
}

static void lookup(struct kvt_metrics *mt, struct kvt_req_ctx *ctx, int key, size_t label,
                   enum kvt_lookup_result r, double dt)
{
    struct kvt_key k = kt_key(key);

    kvt_metrics_on_lookup(mt, ctx, &k, label, r, dt);
}

static void test_tiering_metrics_tracker_records_lookup_metrics(void **state)
{
    struct kvt_metrics *mt;
    struct kvt_req_ctx *ctx = kt_ctx("test");
    struct kvt_stats st;

    assert_int_equal(kvt_metrics_create(fs_p2p, 2, 5, 16, &mt), 0);
    kvt_stats_init(&st);
    kvt_metrics_on_new_request(mt, ctx);
    lookup(mt, ctx, 1, 0, KVT_MISS, 0.0);
    lookup(mt, ctx, 1, 1, KVT_MISS, 0.0);
    lookup(mt, ctx, 1, 2, KVT_HIT, 0.0);
    lookup(mt, ctx, 1, 2, KVT_HIT, 0.0);
    assert_int_equal(kvt_metrics_take_stats(mt, &st), 0);
    assert_true(val(&st, KVT_M_CHUNK_QUERIES, "0:primary") == 1);
    assert_true(val(&st, KVT_M_CHUNK_QUERIES, "1:fs") == 1);
    assert_true(val(&st, KVT_M_CHUNK_QUERIES, "2:p2p") == 1);
    assert_true(val(&st, KVT_M_CHUNK_HITS, "2:p2p") == 1);
    assert_null(kvt_stats_find(&st, KVT_M_CHUNK_HITS, "1:fs"));
    assert_true(val(&st, KVT_M_LOOKUP_SYNC_DELAY, "2:p2p") == 1); /* histogram count */
    kvt_stats_cleanup(&st);
    kvt_metrics_on_request_finished(mt, ctx);
    kvt_metrics_destroy(mt);
    kvt_req_ctx_unref(ctx);
}

static void test_tiering_metrics_tracker_stops_lookup_metrics_after_allocation(void **state)
{
    struct kvt_metrics *mt;
    struct kvt_req_ctx *ctx = kt_ctx("test");
    struct kvt_stats st;

    assert_int_equal(kvt_metrics_create(fs_only, 1, 5, 16, &mt), 0);
    kvt_stats_init(&st);
    kvt_metrics_on_new_request(mt, ctx);
    lookup(mt, ctx, 1, 0, KVT_MISS, 0.0);
    lookup(mt, ctx, 1, 1, KVT_HIT, 0.0);
    assert_int_equal(kvt_metrics_take_stats(mt, &st), 0);
    assert_true(val(&st, KVT_M_CHUNK_QUERIES, "0:primary") == 1);
    assert_true(val(&st, KVT_M_CHUNK_QUERIES, "1:fs") == 1);
    assert_true(val(&st, KVT_M_CHUNK_HITS, "1:fs") == 1);

    kvt_metrics_on_request_allocated(mt, ctx);
    lookup(mt, ctx, 1, 0, KVT_MISS, 0.0);
    lookup(mt, ctx, 1, 1, KVT_HIT, 0.0);
    kvt_stats_clear(&st);
    assert_int_equal(kvt_metrics_take_stats(mt, &st), 0);
    assert_null(kvt_stats_find(&st, KVT_M_CHUNK_QUERIES, "0:primary"));
    assert_null(kvt_stats_find(&st, KVT_M_CHUNK_QUERIES, "1:fs"));
    assert_null(kvt_stats_find(&st, KVT_M_CHUNK_HITS, "1:fs"));
    /* The gauges are re-emitted on every read. */
    assert_non_null(kvt_stats_find(&st, KVT_M_ACTIVE_CASCADES, "1:fs"));
    kvt_stats_cleanup(&st);
    kvt_metrics_destroy(mt); /* frees the still-registered request */
    kvt_req_ctx_unref(ctx);
}

/* RETRY then HIT: one query, one sync and one async delay sample measured from the
 * first RETRY (minus its own duration); later RETRYs do not restart the clock. */
static void test_tiering_metrics_tracker_async_delay_from_first_retry(void **state)
{
    struct kvt_metrics *mt;
    struct kvt_req_ctx *ctx = kt_ctx("test");
    struct kvt_stats st;
    uint64_t now = 10 * 1000000000ull;

    kvt_clock_set_fake(&now);
    assert_int_equal(kvt_metrics_create(fs_only, 1, 5, 16, &mt), 0);
    kvt_stats_init(&st);
    kvt_metrics_on_new_request(mt, ctx);
    lookup(mt, ctx, 7, 1, KVT_RETRY, 0.5); /* started at 9.5 s */
    now += 1000000000ull;
    lookup(mt, ctx, 7, 1, KVT_RETRY, 0.0);
    lookup(mt, ctx, 7, 1, KVT_HIT_PENDING, 0.0);
    now += 1000000000ull;
    lookup(mt, ctx, 7, 1, KVT_HIT, 0.25);
    lookup(mt, ctx, 7, 1, KVT_HIT, 0.25); /* counted once */
    assert_int_equal(kvt_metrics_take_stats(mt, &st), 0);
    assert_true(val(&st, KVT_M_CHUNK_QUERIES, "1:fs") == 1);
    assert_true(val(&st, KVT_M_CHUNK_HITS, "1:fs") == 1);
    const struct kvt_stat *sync = kvt_stats_find(&st, KVT_M_LOOKUP_SYNC_DELAY, "1:fs");
    const struct kvt_stat *async = kvt_stats_find(&st, KVT_M_LOOKUP_ASYNC_DELAY, "1:fs");

    assert_non_null(sync);
    assert_non_null(async);
    assert_int_equal(sync->count, 1);
    assert_true(sync->sum == 0.25);
    assert_int_equal(async->count, 1);
    assert_true(async->sum > 2.499 && async->sum < 2.501);
    kvt_stats_cleanup(&st);
    kvt_metrics_destroy(mt);
    kvt_req_ctx_unref(ctx);
    kvt_clock_set_fake(NULL);
}

/* Both stats hold the same series with the same figures. */
static void assert_stats_same(const struct kvt_stats *a, const struct kvt_stats *b)
{
    assert_int_equal(a->n, b->n);
    for (size_t i = 0; i < a->n; i++) {
        const struct kvt_stat *x = &a->s[i];
        const struct kvt_stat *y = kvt_stats_find(b, x->name, x->label);

        assert_non_null(y);
        assert_true(x->value == y->value);
        assert_int_equal(x->count, y->count);
        assert_true(x->sum == y->sum);
        assert_memory_equal(x->buckets, y->buckets, sizeof(x->buckets));
    }
}

/* What a manager does with a primary lookup's observation: queue it inline
 * (kvt_metrics_queue_lookup) or, when that says no, make the call. */
static void lookup_queued(struct kvt_metrics *mt, struct kvt_req_ctx *ctx, int key,
                          enum kvt_lookup_result r, double dt)
{
    struct kvt_key k = kt_key(key);

    if (!kvt_metrics_queue_lookup(kvt_metrics_queue_of(mt), ctx, kvt_key_hash(&k), r, dt))
        kvt_metrics_on_lookup_h(mt, ctx, &k, kvt_key_hash(&k), 0, r, dt);
}

/* The queue of primary lookups changes no figure: two trackers see the same random
 * calls (requests started, looked up at every label with every result, allocated,
 * finished; the clock moving; stats taken at random points), one with every primary
 * lookup made as a call, the other queueing them as a manager does; every
 * take_stats gives the same series, counts, sums and buckets. The sequence queues
 * more than the queue holds, RETRYs (whose requests are then never queued), and
 * switches requests in the middle of a queue. */
static void test_queued_lookups_change_no_figure(void **state)
{
    enum { N_CTX = 4, OPS = 40000 };
    static const enum kvt_lookup_result results[] = {KVT_HIT, KVT_MISS, KVT_RETRY, KVT_HIT_PENDING};
    struct kvt_metrics *ref, *q;
    struct kvt_req_ctx *ctx[N_CTX] = {0};
    struct kvt_stats sa, sb;
    uint64_t now = 1000000000ull, rng = 0x9e3779b97f4a7c15ull, queued = 0;
    unsigned serial = 0;
    char id[32];

    (void)state;
    kvt_clock_set_fake(&now);
    assert_int_equal(kvt_metrics_create(fs_p2p, 2, 64, 16, &ref), 0);
    assert_int_equal(kvt_metrics_create(fs_p2p, 2, 64, 16, &q), 0);
    kvt_stats_init(&sa);
    kvt_stats_init(&sb);
    for (int op = 0; op < OPS; op++) {
        uint64_t x = rng = rng * 6364136223846793005ull + 1442695040888963407ull;
        unsigned c = (unsigned)(x >> 33) % N_CTX, what = (unsigned)(x >> 40) % 100;
        int key = (int)((x >> 20) % 48);
        double dt = (double)((x >> 8) % 4096) * 1e-6;
        enum kvt_lookup_result r = results[(x >> 50) % 16 < 7    ? 0
                                           : (x >> 50) % 16 < 14 ? 1
                                           : (x >> 50) % 16 < 15 ? 2
                                                                 : 3];

        if (ctx[c] == NULL) { /* a new request */
            snprintf(id, sizeof(id), "r%u", serial++);
            ctx[c] = kt_ctx(id);
            kvt_metrics_on_new_request(ref, ctx[c]);
            kvt_metrics_on_new_request(q, ctx[c]);
            continue;
        }
        /* Runs of lookups of one request, as an engine makes them. */
        if (what < 80) {
            size_t label = (x >> 60) % 4 == 0 ? 1 + (x >> 62) % 2 : 0;

            for (int run = 0; run < 1 + (int)(x % 40); run++, key = (key + 7) % 48) {
                if (label == 0) {
                    struct kvt_key k = kt_key(key);
                    uint32_t before = kvt_metrics_queue_of(q)->n;

                    kvt_metrics_on_lookup_h(ref, ctx[c], &k, kvt_key_hash(&k), 0, r, dt);
                    lookup_queued(q, ctx[c], key, r, dt);
                    queued += kvt_metrics_queue_of(q)->n > before;
                } else {
                    lookup(ref, ctx[c], key, label, r, dt);
                    lookup(q, ctx[c], key, label, r, dt);
                }
            }
        } else if (what < 85) {
            kvt_metrics_on_request_allocated(ref, ctx[c]);
            kvt_metrics_on_request_allocated(q, ctx[c]);
        } else if (what < 92) {
            kvt_metrics_on_request_finished(ref, ctx[c]);
            kvt_metrics_on_request_finished(q, ctx[c]);
            kvt_req_ctx_unref(ctx[c]);
            ctx[c] = NULL;
        } else if (what < 97) {
            now += (x % 5000) * 1000; /* async delays move */
        } else {
            assert_int_equal(kvt_metrics_take_stats(ref, &sa), 0);
            assert_int_equal(kvt_metrics_take_stats(q, &sb), 0);
            assert_stats_same(&sa, &sb);
            kvt_stats_clear(&sa);
            kvt_stats_clear(&sb);
        }
    }
    assert_int_equal(kvt_metrics_take_stats(ref, &sa), 0);
    assert_int_equal(kvt_metrics_take_stats(q, &sb), 0);
    assert_stats_same(&sa, &sb);
    assert_true(queued > OPS / 4); /* the queue was used, and often */
    for (int c = 0; c < N_CTX; c++) {
        if (ctx[c] != NULL) {
            kvt_metrics_on_request_finished(ref, ctx[c]);
            kvt_metrics_on_request_finished(q, ctx[c]);
            kvt_req_ctx_unref(ctx[c]);
        }
    }
    kvt_stats_cleanup(&sa);
    kvt_stats_cleanup(&sb);
    kvt_metrics_destroy(ref);
    kvt_metrics_destroy(q);
    kvt_clock_set_fake(NULL);
}

static void make_job(struct kvt_job *job, kvt_job_id_t id, struct kvt_key *keys, int64_t *ids,
                     size_t n, bool promotion, struct kvt_req_ctx *ctx)
{
    memset(job, 0, sizeof(*job));
    job->id = id;
    job->keys = keys;
    job->chunk_ids = ids;
    job->n = n;
    job->is_promotion = promotion;
    job->ctx = ctx;
}

static void test_tiering_metrics_tracker_records_finished_job_metrics(void **state)
{
    struct kvt_metrics *mt;
    struct kvt_req_ctx *ctx = kt_ctx("test");
    struct kvt_key keys[4];
    int64_t ids[4] = {0, 1, 2, 3};
    struct kvt_job jobs[4];
    struct kvt_stats st;

    kt_keys(keys, 0, 4);
    assert_int_equal(kvt_metrics_create(fs_only, 1, 5, 16, &mt), 0);
    kvt_stats_init(&st);
    for (int i = 0; i < 4; i++) {
        make_job(&jobs[i], (kvt_job_id_t)i, &keys[i], &ids[i], 1, i % 2 == 1, ctx);
        kvt_metrics_on_job_registered(mt, &jobs[i], 0);
    }
    assert_false(kvt_metrics_is_idle(mt));
    struct kvt_job_result r0 = {.job_id = 0, .success = true, .transfer_time = 0.5};
    struct kvt_job_result r1 = {.job_id = 1, .success = true, .transfer_time = 0.25};
    struct kvt_job_result r2 = {.job_id = 2, .success = false, .transfer_time = -1};
    struct kvt_job_result r3 = {.job_id = 3, .success = false, .transfer_time = -1};

    kvt_metrics_on_job_finished(mt, &jobs[0], 0, &r0);
    kvt_metrics_on_job_finished(mt, &jobs[1], 0, &r1);
    kvt_metrics_on_job_finished(mt, &jobs[2], 0, &r2);
    kvt_metrics_on_job_finished(mt, &jobs[3], 0, &r3);
    assert_int_equal(kvt_metrics_take_stats(mt, &st), 0);
    assert_true(val(&st, KVT_M_WRITE_BYTES, "1:fs") == 16);
    assert_true(val(&st, KVT_M_WRITE_TIME, "1:fs") == 0.5);
    assert_true(val(&st, KVT_M_READ_BYTES, "1:fs") == 16);
    assert_true(val(&st, KVT_M_READ_TIME, "1:fs") == 0.25);
    assert_true(val(&st, KVT_M_CASCADE_FAILURES, "1:fs") == 1);
    assert_true(val(&st, KVT_M_PROMOTION_FAILURES, "1:fs") == 1);
    assert_true(kvt_metrics_is_idle(mt));
    /* Counters are popped: the next read has only the gauges. */
    kvt_stats_clear(&st);
    assert_int_equal(kvt_metrics_take_stats(mt, &st), 0);
    assert_null(kvt_stats_find(&st, KVT_M_WRITE_BYTES, "1:fs"));
    assert_int_equal(st.n, 4);
    kvt_stats_cleanup(&st);
    kvt_metrics_destroy(mt);
    kvt_req_ctx_unref(ctx);
}

static void test_tiering_metrics_tracker_records_partial_promotion_success_bytes(void **state)
{
    struct kvt_metrics *mt;
    struct kvt_req_ctx *ctx = kt_ctx("test");
    struct kvt_key keys[3], ok[2];
    int64_t ids[3] = {0, 1, 2};
    struct kvt_job job;
    struct kvt_stats st;

    kt_keys(keys, 0, 3);
    ok[0] = keys[0];
    ok[1] = keys[2];
    assert_int_equal(kvt_metrics_create(fs_only, 1, 5, 16, &mt), 0);
    kvt_stats_init(&st);
    make_job(&job, 0, keys, ids, 3, true, ctx);
    kvt_metrics_on_job_registered(mt, &job, 0);
    struct kvt_job_result r = {
        .job_id = 0,
        .success = false,
        .successful_keys = ok,
        .n_successful = 2,
        .transfer_time = 0.5,
    };

    kvt_metrics_on_job_finished(mt, &job, 0, &r);
    assert_int_equal(kvt_metrics_take_stats(mt, &st), 0);
    assert_true(val(&st, KVT_M_READ_BYTES, "1:fs") == 32);
    assert_true(val(&st, KVT_M_READ_TIME, "1:fs") == 0.5);
    assert_true(val(&st, KVT_M_PROMOTION_FAILURES, "1:fs") == 1);
    assert_true(kvt_metrics_is_idle(mt));
    kvt_stats_cleanup(&st);
    kvt_metrics_destroy(mt);
    kvt_req_ctx_unref(ctx);
}

static void test_tiering_metrics_tracker_reports_active_job_and_primary_usage_gauges(void **state)
{
    struct kvt_metrics *mt;
    struct kvt_req_ctx *ctx = kt_ctx("test");
    struct kvt_key k1[2], k2[3];
    int64_t i1[2] = {0, 1}, i2[3] = {2, 3, 4};
    struct kvt_job fs_job, p2p_job;
    struct kvt_stats st;

    kt_keys(k1, 0, 2);
    kt_keys(k2, 2, 3);
    assert_int_equal(kvt_metrics_create(fs_p2p, 2, 6, 16, &mt), 0);
    kvt_stats_init(&st);
    make_job(&fs_job, 0, k1, i1, 2, false, ctx);
    make_job(&p2p_job, 1, k2, i2, 3, true, ctx);
    kvt_metrics_on_job_registered(mt, &fs_job, 0);
    kvt_metrics_on_job_registered(mt, &p2p_job, 1);
    assert_int_equal(kvt_metrics_take_stats(mt, &st), 0);
    assert_float_equal(val(&st, KVT_M_PRIMARY_READ_USAGE, "1:fs"), 2.0 / 6, 1e-12);
    assert_true(val(&st, KVT_M_ACTIVE_CASCADES, "1:fs") == 1);
    assert_float_equal(val(&st, KVT_M_PRIMARY_WRITE_USAGE, "2:p2p"), 3.0 / 6, 1e-12);
    assert_true(val(&st, KVT_M_ACTIVE_PROMOTIONS, "2:p2p") == 1);
    assert_true(val(&st, KVT_M_ACTIVE_PROMOTIONS, "1:fs") == 0);
    kvt_stats_cleanup(&st);
    kvt_metrics_destroy(mt);
    kvt_req_ctx_unref(ctx);
}

static void test_tiering_metrics_tracker_records_promotion_allocation_failures(void **state)
{
    struct kvt_metrics *mt;
    struct kvt_stats st;

    assert_int_equal(kvt_metrics_create(fs_only, 1, 1, 16, &mt), 0);
    kvt_stats_init(&st);
    kvt_metrics_on_promotion_allocation_failure(mt);
    assert_int_equal(kvt_metrics_take_stats(mt, &st), 0);
    assert_true(val(&st, KVT_M_PROMOTION_ALLOC_FAILURES, "") == 1);
    assert_true(val(&st, KVT_M_PROMOTION_ALLOC_FAILURES, NULL) == 1);
    kvt_stats_cleanup(&st);
    kvt_metrics_destroy(mt);
}

static void finished_job_on_idle_tracker(void *arg)
{
    struct kvt_metrics *mt = arg;
    struct kvt_key k = kt_key(1);
    int64_t id = 0;
    struct kvt_job job;
    struct kvt_job_result r = {.success = true, .transfer_time = -1};

    make_job(&job, 0, &k, &id, 1, true, NULL);
    kvt_metrics_on_job_finished(mt, &job, 0, &r);
}

/* _decrement_tier_state asserts: finishing a job that was never registered aborts. */
static void test_tiering_metrics_tracker_asserts_on_unregistered_job(void **state)
{
    struct kvt_metrics *mt;

    assert_int_equal(kvt_metrics_create(fs_only, 1, 1, 16, &mt), 0);
    assert_true(kt_expect_abort(finished_job_on_idle_tracker, mt));
    kvt_metrics_destroy(mt);
}

static void test_stats_aggregate_counters_gauges_histograms(void **state)
{
    struct kvt_stats a, b;

    kvt_stats_init(&a);
    kvt_stats_init(&b);
    assert_true(kvt_stats_is_empty(&a));
    assert_int_equal(kvt_stats_increase(&a, "c", "1:fs", 2), 0);
    assert_int_equal(kvt_stats_set_gauge(&a, "g", NULL, 5), 0);
    assert_int_equal(kvt_stats_observe(&a, "h", "0:primary", 0.002), 0);
    assert_int_equal(kvt_stats_increase(&b, "c", "1:fs", 3), 0);
    assert_int_equal(kvt_stats_increase(&b, "c", "2:p2p", 1), 0);
    assert_int_equal(kvt_stats_set_gauge(&b, "g", NULL, 7), 0);
    assert_int_equal(kvt_stats_observe(&b, "h", "0:primary", 100), 0);
    assert_int_equal(kvt_stats_aggregate(&a, &b), 0);
    assert_true(kvt_stats_value(&a, "c", "1:fs") == 5);
    assert_true(kvt_stats_value(&a, "c", "2:p2p") == 1);
    assert_true(kvt_stats_value(&a, "g", "") == 7);
    const struct kvt_stat *h = kvt_stats_find(&a, "h", "0:primary");

    assert_non_null(h);
    assert_int_equal(h->count, 2);
    assert_true(h->sum == 100.002);
    assert_int_equal(h->buckets[5], 1);  /* 0.002 <= 5e-3 */
    assert_int_equal(h->buckets[14], 1); /* 100 <= 256 */
    assert_true(kvt_stats_value(&a, "absent", NULL) == 0);
    kvt_stats_cleanup(&a);
    kvt_stats_cleanup(&b);
}

static void test_stats_refuses_kind_clash_and_long_names(void **state)
{
    struct kvt_stats a;
    char longname[KVT_STAT_NAME_MAX + 4];

    kvt_stats_init(&a);
    assert_int_equal(kvt_stats_increase(&a, "x", NULL, 1), 0);
    assert_int_equal(kvt_stats_set_gauge(&a, "x", NULL, 1), -EINVAL);
    assert_int_equal(kvt_stats_observe(&a, "x", "other", 1), -EINVAL);
    memset(longname, 'n', sizeof(longname) - 1);
    longname[sizeof(longname) - 1] = 0;
    assert_int_equal(kvt_stats_increase(&a, longname, NULL, 1), -EINVAL);
    assert_int_equal(a.n, 1);
    assert_true(kvt_stats_value(&a, "x", NULL) == 1);
    kvt_stats_cleanup(&a);
}

static void expect_layout(const char *name, size_t n, const double *bounds)
{
    const struct kvt_hist_layout *l = kvt_hist_layout_of(name);

    if (l->n != n)
        fail_msg("%s: %zu bounds, expected %zu", name, l->n, n);
    for (size_t i = 0; i < n; i++)
        if (l->bounds[i] != bounds[i])
            fail_msg("%s: bound %zu is %g, expected %g", name, i, l->bounds[i], bounds[i]);
}

/* Buckets per metric: vLLM's own for its three histograms, by unit for kvtier's names,
 * the common layout otherwise; observations land in the metric's buckets, and a
 * histogram keeps them through aggregate. */
static void test_histogram_buckets_per_metric(void **state)
{
    static const double sync[] = {1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 1e-2, 5e-2, 0.1, 0.5, 1};
    static const double async[] = {1e-4, 5e-4, 1e-3, 5e-3, 1e-2, 5e-2, 0.1, 0.5, 1, 5, 10};
    static const double alloc[] = {1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144};
    static const double secs[] = {1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2,
                                  3e-2, 0.1,  0.3,  1,    3,    10};
    static const double chunks[] = {1, 4, 16, 64, 256, 1024, 4096, 16384, 65536};
    struct kvt_stats a, b;
    const struct kvt_stat *h;

    (void)state;
    expect_layout(KVT_M_LOOKUP_SYNC_DELAY, KVT_ARRAY_SIZE(sync), sync);
    expect_layout(KVT_M_LOOKUP_ASYNC_DELAY, KVT_ARRAY_SIZE(async), async);
    expect_layout(KVT_M_CPU_ALLOC_SIZE, KVT_ARRAY_SIZE(alloc), alloc);
    expect_layout("kvtier_net_fetch_seconds", KVT_ARRAY_SIZE(secs), secs);
    expect_layout("kvtier_net_fetch_chunks", KVT_ARRAY_SIZE(chunks), chunks);
    expect_layout("kvtier_whatever", kvt_hist_default.n, kvt_hist_default.bounds);
    expect_layout("vllm:kv_offload_unknown_seconds", kvt_hist_default.n, kvt_hist_default.bounds);
    for (size_t i = 0; i < kvt_hist_default.n; i++)
        assert_true(kvt_hist_default.bounds[i] == kvt_hist_bounds[i]);
    /* Bucket i takes (bounds[i-1], bounds[i]]; above the last, bucket n. */
    assert_int_equal(kvt_hist_bucket(kvt_hist_layout_of(KVT_M_CPU_ALLOC_SIZE), 1), 0);
    assert_int_equal(kvt_hist_bucket(kvt_hist_layout_of(KVT_M_CPU_ALLOC_SIZE), 2), 1);
    assert_int_equal(kvt_hist_bucket(kvt_hist_layout_of(KVT_M_CPU_ALLOC_SIZE), 262144), 9);
    assert_int_equal(kvt_hist_bucket(kvt_hist_layout_of(KVT_M_CPU_ALLOC_SIZE), 262145), 10);

    kvt_stats_init(&a);
    kvt_stats_init(&b);
    assert_int_equal(kvt_stats_observe(&a, KVT_M_LOOKUP_SYNC_DELAY, "1:fs", 20), 0);
    assert_int_equal(kvt_stats_observe(&b, KVT_M_LOOKUP_SYNC_DELAY, "1:fs", 0.7), 0);
    assert_int_equal(kvt_stats_observe(&b, "kvtier_x_chunks", NULL, 5), 0);
    assert_int_equal(kvt_stats_aggregate(&a, &b), 0);
    h = kvt_stats_find(&a, KVT_M_LOOKUP_SYNC_DELAY, "1:fs");
    assert_non_null(h);
    assert_ptr_equal(h->layout, kvt_hist_layout_of(KVT_M_LOOKUP_SYNC_DELAY));
    assert_int_equal(h->buckets[11], 1); /* 20 s: above vLLM's last bound, 1 s */
    assert_int_equal(h->buckets[10], 1); /* 0.7 <= 1 */
    h = kvt_stats_find(&a, "kvtier_x_chunks", NULL);
    assert_non_null(h);
    assert_int_equal(h->buckets[2], 1); /* 5 <= 16 */
    kvt_stats_cleanup(&a);
    kvt_stats_cleanup(&b);
}

/* The tracker's delay histograms are vLLM's: a 20 s wait is above its last bucket. */
static void test_tracker_delays_use_vllm_buckets(void **state)
{
    struct kvt_metrics *mt;
    struct kvt_req_ctx *ctx = kt_ctx("test");
    struct kvt_stats st;
    const struct kvt_stat *h;

    (void)state;
    assert_int_equal(kvt_metrics_create(fs_only, 1, 5, 16, &mt), 0);
    kvt_stats_init(&st);
    kvt_metrics_on_new_request(mt, ctx);
    lookup(mt, ctx, 1, 1, KVT_HIT, 20.0);
    lookup(mt, ctx, 2, 1, KVT_HIT, 0.003);
    lookup(mt, ctx, 3, 1, KVT_HIT, 1e-5);   /* the first bound: bucket 0 */
    lookup(mt, ctx, 4, 1, KVT_HIT, 1.1e-5); /* just above it: bucket 1 */
    lookup(mt, ctx, 5, 1, KVT_HIT, 2e-7);
    assert_int_equal(kvt_metrics_take_stats(mt, &st), 0);
    h = kvt_stats_find(&st, KVT_M_LOOKUP_SYNC_DELAY, "1:fs");
    assert_non_null(h);
    assert_int_equal(h->count, 5);
    assert_int_equal(h->buckets[11], 1);
    assert_int_equal(h->buckets[5], 1); /* 0.003 <= 5e-3 */
    assert_int_equal(h->buckets[0], 2);
    assert_int_equal(h->buckets[1], 1);
    kvt_stats_cleanup(&st);
    kvt_metrics_on_request_finished(mt, ctx);
    kvt_metrics_destroy(mt);
    kvt_req_ctx_unref(ctx);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_tiering_metrics_tracker_records_lookup_metrics),
        cmocka_unit_test(test_tiering_metrics_tracker_stops_lookup_metrics_after_allocation),
        cmocka_unit_test(test_tiering_metrics_tracker_async_delay_from_first_retry),
        cmocka_unit_test(test_queued_lookups_change_no_figure),
        cmocka_unit_test(test_tiering_metrics_tracker_records_finished_job_metrics),
        cmocka_unit_test(test_tiering_metrics_tracker_records_partial_promotion_success_bytes),
        cmocka_unit_test(test_tiering_metrics_tracker_reports_active_job_and_primary_usage_gauges),
        cmocka_unit_test(test_tiering_metrics_tracker_records_promotion_allocation_failures),
        cmocka_unit_test(test_tiering_metrics_tracker_asserts_on_unregistered_job),
        cmocka_unit_test(test_stats_aggregate_counters_gauges_histograms),
        cmocka_unit_test(test_stats_refuses_kind_clash_and_long_names),
        cmocka_unit_test(test_histogram_buckets_per_metric),
        cmocka_unit_test(test_tracker_delays_use_vllm_buckets),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

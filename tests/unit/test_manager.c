/* SPDX-License-Identifier: Apache-2.0 */
/* The tiering manager against vLLM's own scenarios
 * (tests/v1/kv_offload/tiering/test_tiering_offloading.py) and the
 * manager-level back-pressure scenarios (test_backpressure.py).
 *
 * Fixture as upstream: a primary of 5 chunks with 16-byte rows and two example
 * tiers; keys kt_key(i) = make_offload_key(str(i).encode(), 0); a step is
 * on_schedule_end with no new requests followed by take_events. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "test_util.h"

#include "kvt/alloc.h"
#include "kvt/alloc_test.h"
#include "kvt/backpressure.h"
#include "kvt/backpressure_test.h"
#include "kvt/clock.h"
#include "kvt/clock_test.h"
#include "kvt/common.h"
#include "kvt/example_tier.h"
#include "kvt/manager.h"
#include "kvt/manager_test.h"
#include "kvt/metrics.h"

/* ---- a call log shared by the example tiers ----------------------------- */

#define LOG_MAX 64
struct call_log {
    struct {
        int tier;
        enum kvt_example_call call;
        char req_id[KVT_REQ_ID_MAX + 1];
        size_t n;
        struct kvt_key keys[8];
        const struct kvt_job *job;
    } e[LOG_MAX];
    size_t n;
};

static void log_call(void *arg, struct kvt_tier *t, enum kvt_example_call call,
                     const struct kvt_job *job, struct kvt_req_ctx *ctx, const struct kvt_key *keys,
                     size_t n)
{
    struct call_log *l = arg;
    if (call == KVT_EX_LOOKUP || call == KVT_EX_TAKE_EVENTS || call == KVT_EX_SERVE ||
        call == KVT_EX_ON_SCHEDULE_END || l->n == LOG_MAX)
        return;
    l->e[l->n].tier = t->index;
    l->e[l->n].call = call;
    l->e[l->n].job = job;
    l->e[l->n].n = n;
    for (size_t i = 0; i < n && i < 8; i++)
        l->e[l->n].keys[i] = keys[i];
    snprintf(l->e[l->n].req_id, sizeof(l->e[l->n].req_id), "%s", ctx ? ctx->req_id : "");
    l->n++;
}

static size_t count_calls(const struct call_log *l, int tier, enum kvt_example_call call)
{
    size_t c = 0;
    for (size_t i = 0; i < l->n; i++)
        c += l->e[i].tier == tier && l->e[i].call == call;
    return c;
}

/* Index of the nth (0-based) call of this kind to tier in the log; fails the test
 * when there is none. */
static size_t nth_call(const struct call_log *l, int tier, enum kvt_example_call call, size_t nth)
{
    for (size_t i = 0; i < l->n; i++)
        if (l->e[i].tier == tier && l->e[i].call == call && nth-- == 0)
            return i;
    fail_msg("call %d to tier %d not logged", (int)call, tier);
    return 0;
}

/* ---- fixture --------------------------------------------------------------- */

struct fx {
    struct kvt_manager *m;
    struct kvt_primary *p;
    struct kvt_tier *t1, *t2;
    struct kvt_req_ctx *ctx; /* upstream's _CTX, req_id "test" */
    struct kvt_store_output out;
    struct call_log log;
};

static struct fx *fx_new_with(size_t n_tiers, const struct kvt_example_tier_config *c1,
                              const struct kvt_example_tier_config *c2, bool events)
{
    struct fx *f = calloc(1, sizeof(*f));
    struct kvt_primary_config pc = {.num_chunks = 5, .row_bytes = 16, .enable_events = events};
    struct kvt_example_tier_config d1 = {0}, d2 = {0};
    struct kvt_tier *tiers[2];
    assert_non_null(f);
    assert_int_equal(kvt_primary_create(&pc, NULL, &f->p), 0);
    if (c1)
        d1 = *c1;
    if (c2)
        d2 = *c2;
    d1.on_call = d2.on_call = log_call;
    d1.cb_arg = d2.cb_arg = &f->log;
    if (n_tiers > 0) {
        assert_int_equal(kvt_example_tier_create(&d1, &f->t1), 0);
        tiers[0] = f->t1;
    }
    if (n_tiers > 1) {
        assert_int_equal(kvt_example_tier_create(&d2, &f->t2), 0);
        tiers[1] = f->t2;
    }
    assert_int_equal(kvt_manager_create(f->p, tiers, n_tiers, &f->m), 0);
    f->ctx = kt_ctx("test");
    kvt_store_output_init(&f->out);
    return f;
}

static struct fx *fx_new(void)
{
    return fx_new_with(2, NULL, NULL, false);
}

static void fx_free(struct fx *f)
{
    assert_int_equal(kvt_manager_shutdown(f->m), 0);
    kvt_manager_destroy(f->m);
    kvt_req_ctx_unref(f->ctx);
    kvt_store_output_cleanup(&f->out);
    free(f);
}

static void step_new(struct fx *f, const char *new_req_id)
{
    struct kvt_schedule_end_ctx sc = {0};
    struct kvt_events ev;
    const char *ids[1] = {new_req_id};
    if (new_req_id) {
        sc.new_req_ids = ids;
        sc.n_new = 1;
    }
    kvt_manager_on_schedule_end(f->m, &sc);
    kvt_events_init(&ev);
    assert_int_equal(kvt_manager_take_events(f->m, &ev), 0);
    kvt_events_cleanup(&ev);
}

static void step(struct fx *f)
{
    step_new(f, NULL);
}

static void start(struct fx *f, struct kvt_req_ctx *ctx)
{
    if (!kvt_manager_has_request(f->m, ctx->req_id))
        assert_int_equal(kvt_manager_on_new_request(f->m, ctx, NULL), 0);
}

static void store(struct fx *f, struct kvt_req_ctx *ctx, const struct kvt_key *k, size_t n)
{
    assert_int_equal(kvt_manager_prepare_store(f->m, k, n, ctx, &f->out), 0);
    assert_int_equal(kvt_manager_complete_store(f->m, k, n, ctx, true), 0);
}

static int ref_cnt(struct fx *f, const struct kvt_key *k)
{
    struct kvt_primary_entry_info info;
    assert_int_equal(kvt_primary_entry_info(f->p, k, &info), 0);
    return info.ref_cnt;
}

/* count_hits: leading HITs; -1 when a HIT_PENDING or RETRY comes first. */
static int count_hits_manager(struct fx *f, const struct kvt_key *k, size_t n)
{
    int c = 0;
    for (size_t i = 0; i < n; i++) {
        enum kvt_lookup_result r = kvt_manager_lookup(f->m, &k[i], f->ctx);
        if (r == KVT_HIT_PENDING || r == KVT_RETRY)
            return -1;
        if (r != KVT_HIT)
            break;
        c++;
    }
    return c;
}

static int count_hits_primary(struct fx *f, const struct kvt_key *k, size_t n)
{
    int c = 0;
    for (size_t i = 0; i < n; i++) {
        enum kvt_lookup_result r = kvt_primary_lookup(f->p, &k[i]);
        if (r == KVT_HIT_PENDING || r == KVT_RETRY)
            return -1;
        if (r != KVT_HIT)
            break;
        c++;
    }
    return c;
}

/* ---- a scripted tier: programmable lookups, recorded jobs, queued results --- */

struct script_tier {
    struct kvt_tier base;
    enum kvt_lookup_result seq[8]; /* lookup answers in order, then dflt */
    size_t n_seq, next_seq;
    enum kvt_lookup_result dflt;
    unsigned lookups;
    const struct kvt_job *stores[32], *loads[32];
    size_t n_stores, n_loads;
    struct kvt_job_result res[32];
    size_t n_res;
    struct kvt_stats once; /* returned by the next get_stats */
    void (*serve)(struct script_tier *s, struct kvt_parent *p);
    void *serve_arg;
};

static struct script_tier *st_of(struct kvt_tier *t)
{
    return (struct script_tier *)t;
}
static enum kvt_lookup_result st_lookup(struct kvt_tier *t, const struct kvt_key *k,
                                        struct kvt_req_ctx *c)
{
    struct script_tier *s = st_of(t);
    s->lookups++;
    return s->next_seq < s->n_seq ? s->seq[s->next_seq++] : s->dflt;
}
static int st_store(struct kvt_tier *t, const struct kvt_job *j)
{
    st_of(t)->stores[st_of(t)->n_stores++] = j;
    return 0;
}
static int st_load(struct kvt_tier *t, const struct kvt_job *j)
{
    st_of(t)->loads[st_of(t)->n_loads++] = j;
    return 0;
}
static void st_finished(struct kvt_tier *t, kvt_job_result_cb_t cb, void *arg)
{
    struct script_tier *s = st_of(t);
    for (size_t i = 0; i < s->n_res; i++)
        cb(arg, &s->res[i]);
    s->n_res = 0;
}
static int st_drain(struct kvt_tier *t)
{
    return 0;
}
static int st_stats(struct kvt_tier *t, struct kvt_stats *out)
{
    struct script_tier *s = st_of(t);
    int rc = kvt_stats_aggregate(out, &s->once);
    kvt_stats_clear(&s->once);
    return rc;
}
static void st_serve(struct kvt_tier *t, struct kvt_parent *p)
{
    if (st_of(t)->serve)
        st_of(t)->serve(st_of(t), p);
}
static void st_destroy(struct kvt_tier *t)
{
    kvt_stats_cleanup(&st_of(t)->once);
    free(t);
}
static const struct kvt_tier_ops script_ops = {
    .lookup = st_lookup,
    .submit_store = st_store,
    .submit_load = st_load,
    .get_finished_jobs = st_finished,
    .drain_jobs = st_drain,
    .get_stats = st_stats,
    .serve_external_requests = st_serve,
    .destroy = st_destroy,
};
static struct script_tier *script_tier_new(const char *type)
{
    struct script_tier *s = calloc(1, sizeof(*s));
    assert_non_null(s);
    kvt_tier_init(&s->base, &script_ops, type, KVT_MEDIUM_CPU, KVT_ANY);
    kvt_stats_init(&s->once);
    return s;
}
static void st_finish(struct script_tier *s, const struct kvt_job *j, bool ok,
                      const struct kvt_key *ok_keys, size_t n_ok)
{
    s->res[s->n_res++] = (struct kvt_job_result){.job_id = j->id,
                                                 .success = ok,
                                                 .successful_keys = ok_keys,
                                                 .n_successful = n_ok,
                                                 .transfer_time = -1,
                                                 .transfer_bytes = -1};
}

/* ---- §6.1 ---------------------------------------------------------------- */

static void test_tiering_manager_aggregates_secondary_stats(void **state)
{
    struct kvt_primary_config pc = {.num_chunks = 5, .row_bytes = 16};
    struct kvt_primary *p;
    struct kvt_manager *m;
    struct script_tier *s = script_tier_new("test_metrics");
    struct kvt_tier *tiers[1] = {&s->base};
    struct kvt_stats st;
    assert_int_equal(kvt_primary_create(&pc, NULL, &p), 0);
    assert_int_equal(kvt_manager_create(p, tiers, 1, &m), 0);
    assert_int_equal(kvt_stats_increase(&s->once, "my_tier_metric", "test_metrics", 7), 0);

    kvt_stats_init(&st);
    assert_int_equal(kvt_manager_get_stats(m, &st), 0);
    assert_true(kvt_stats_value(&st, "my_tier_metric", "test_metrics") == 7);
    kvt_stats_clear(&st);
    /* The primary's usage gauge is always there; the tier's metric is consumed. */
    assert_int_equal(kvt_manager_get_stats(m, &st), 0);
    assert_false(kvt_stats_is_empty(&st));
    assert_null(kvt_stats_find(&st, "my_tier_metric", "test_metrics"));
    assert_non_null(kvt_stats_find(&st, KVT_M_CPU_USAGE, NULL));
    kvt_stats_cleanup(&st);
    assert_int_equal(kvt_manager_shutdown(m), 0);
    kvt_manager_destroy(m);
}

static void test_basic_store_and_lookup(void **state)
{
    struct kvt_tier *t;
    struct kvt_key k[3];
    struct kvt_req_ctx *ctx = kt_ctx("test");
    kt_keys(k, 0, 3);
    assert_int_equal(kvt_example_tier_create(NULL, &t), 0);
    assert_int_equal(kvt_tier_lookup(t, &k[0], ctx), KVT_MISS);
    kvt_example_tier_insert(t, &k[0], NULL);
    kvt_example_tier_insert(t, &k[1], NULL);
    assert_int_equal(kvt_tier_lookup(t, &k[0], ctx), KVT_HIT);
    assert_int_equal(kvt_tier_lookup(t, &k[1], ctx), KVT_HIT);
    assert_int_equal(kvt_tier_lookup(t, &k[2], ctx), KVT_MISS);
    kvt_tier_destroy(t);
    kvt_req_ctx_unref(ctx);
}

static void test_take_events_aggregates_tier_owned_events(void **state)
{
    struct kvt_example_tier_config c1 = {.emit_events = true, .medium = KVT_MEDIUM_STORAGE};
    struct kvt_example_tier_config c2 = {.emit_events = true, .medium = KVT_MEDIUM_STORAGE};
    struct fx *f = fx_new_with(2, &c1, &c2, true);
    struct kvt_key k[1];
    struct kvt_events ev;
    kt_keys(k, 1, 1);
    start(f, f->ctx);
    store(f, f->ctx, k, 1);
    kvt_events_init(&ev);
    assert_int_equal(kvt_manager_take_events(f->m, &ev), 0);
    assert_int_equal(ev.n, 3);
    assert_int_equal(ev.ev[0].medium, KVT_MEDIUM_CPU); /* primary first */
    assert_false(ev.ev[0].removed);
    assert_int_equal(ev.ev[1].medium, KVT_MEDIUM_STORAGE);
    assert_int_equal(ev.ev[2].medium, KVT_MEDIUM_STORAGE);
    for (size_t i = 0; i < 3; i++) {
        assert_int_equal(ev.ev[i].n, 1);
        assert_true(kvt_key_eq(&ev.ev[i].keys[0], &k[0]));
    }
    assert_int_equal(kvt_example_tier_calls(f->t1, KVT_EX_TAKE_EVENTS), 1);
    assert_int_equal(kvt_example_tier_calls(f->t2, KVT_EX_TAKE_EVENTS), 1);
    kvt_events_cleanup(&ev);
    fx_free(f);
}

static void test_basic_store_to_primary(void **state)
{
    struct fx *f = fx_new();
    struct kvt_key k[3];
    kt_keys(k, 0, 3);
    start(f, f->ctx);
    assert_int_equal(kvt_manager_prepare_store(f->m, k, 3, f->ctx, &f->out), 0);
    assert_int_equal(f->out.n_store, 3);
    assert_int_equal(kvt_manager_complete_store(f->m, k, 3, f->ctx, true), 0);
    assert_int_equal(count_hits_primary(f, k, 3), 3);
    fx_free(f);
}

static void test_cascade_to_all_secondary_tiers(void **state)
{
    struct fx *f = fx_new();
    struct kvt_key k[3];
    kt_keys(k, 0, 3);
    start(f, f->ctx);
    store(f, f->ctx, k, 3);
    assert_int_equal(kvt_example_tier_calls(f->t1, KVT_EX_SUBMIT_STORE), 1);
    assert_int_equal(kvt_example_tier_calls(f->t2, KVT_EX_SUBMIT_STORE), 1);
    assert_int_equal(kvt_example_tier_num_keys(f->t1), 3);
    assert_int_equal(kvt_example_tier_num_keys(f->t2), 3);
    for (int i = 0; i < 3; i++) {
        assert_int_equal(kvt_tier_lookup(f->t1, &k[i], f->ctx), KVT_HIT);
        assert_int_equal(kvt_tier_lookup(f->t2, &k[i], f->ctx), KVT_HIT);
    }
    fx_free(f);
}

static void test_ref_cnt_protection_during_cascade(void **state)
{
    struct fx *f = fx_new();
    struct kvt_key k[3];
    kt_keys(k, 0, 3);
    start(f, f->ctx);
    store(f, f->ctx, k, 3);
    for (int i = 0; i < 3; i++)
        assert_int_equal(ref_cnt(f, &k[i]), 2); /* one pin per secondary tier */
    /* Step 1: prepare_store already used this step's poll, so the synchronous
     * cascade completions wait for the next step. */
    step(f);
    for (int i = 0; i < 3; i++)
        assert_int_equal(ref_cnt(f, &k[i]), 2);
    assert_true(kvt_example_tier_num_unreported(f->t1) > 0);
    assert_true(kvt_example_tier_num_unreported(f->t2) > 0);
    step(f);
    for (int i = 0; i < 3; i++)
        assert_int_equal(ref_cnt(f, &k[i]), 0);
    assert_int_equal(kvt_example_tier_num_unreported(f->t1), 0);
    assert_int_equal(kvt_example_tier_num_unreported(f->t2), 0);
    fx_free(f);
}

/* kvt_manager_lookup_many answers as one kvt_manager_lookup per key, also when a
 * lookup of the group promotes from a secondary tier and so evicts keys that the
 * group's own primary answers had seen present. Two identical managers, the same
 * history; one asks key by key, the other all at once. */
static void lookup_many_history(struct fx *f, struct kvt_key *k)
{
    kt_keys(k, 0, 8);
    start(f, f->ctx);
    store(f, f->ctx, k, 5);
    step(f); /* cascades k0..k4 to both tiers */
    step(f); /* their completions unpin them */
    kvt_example_tier_insert(f->t1, &k[5], NULL);
    kvt_example_tier_insert(f->t1, &k[6], NULL);
}

static void test_lookup_many_matches_one_by_one(void **state)
{
    struct fx *one = fx_new(), *many = fx_new();
    enum kvt_lookup_result want[10], got[10];
    struct kvt_key k[8], ask[10];
    size_t n_ask = 0;

    (void)state;
    lookup_many_history(one, k);
    lookup_many_history(many, k);
    /* k5 promotes (evicting the LRU-most of k0..k4), then every k0..k4 is asked:
     * the group's first answers are stale after that promotion. */
    ask[n_ask++] = k[5];
    for (int i = 0; i < 5; i++)
        ask[n_ask++] = k[i];
    ask[n_ask++] = k[7]; /* nowhere */
    ask[n_ask++] = k[6];
    for (size_t i = 0; i < n_ask; i++)
        want[i] = kvt_manager_lookup(one->m, &ask[i], one->ctx);
    assert_int_equal(kvt_manager_lookup_many(many->m, ask, n_ask, many->ctx, false, got), n_ask);
    for (size_t i = 0; i < n_ask; i++) {
        if (got[i] != want[i])
            fail_msg("key %zu: lookup_many %d, one by one %d", i, (int)got[i], (int)want[i]);
    }
    assert_int_equal(want[0], KVT_HIT_PENDING);
    assert_int_equal(want[6], KVT_MISS);
    for (int i = 0; i < 8; i++)
        assert_int_equal(kvt_primary_lookup(many->p, &k[i]), kvt_primary_lookup(one->p, &k[i]));

    /* prefix: stops after the first MISS or RETRY, as the engine API's prefix flag. */
    assert_int_equal(kvt_manager_lookup_many(many->m, ask + 6, 2, many->ctx, true, got), 1);
    assert_int_equal(got[0], KVT_MISS);
    fx_free(one);
    fx_free(many);
}

static void test_lookup_from_primary(void **state)
{
    struct fx *f = fx_new();
    struct kvt_key k[3];
    kt_keys(k, 0, 3);
    start(f, f->ctx);
    store(f, f->ctx, k, 3);
    assert_int_equal(count_hits_manager(f, k, 3), 3);
    fx_free(f);
}

static void test_promotion_from_secondary(void **state)
{
    struct fx *f = fx_new();
    struct kvt_key k[3];
    kt_keys(k, 0, 3);
    for (int i = 0; i < 3; i++)
        kvt_example_tier_insert(f->t1, &k[i], NULL);
    for (int i = 0; i < 3; i++)
        assert_int_equal(kvt_manager_lookup(f->m, &k[i], f->ctx), KVT_HIT_PENDING);
    step(f); /* submits the loads */
    step(f); /* consumes their completions */
    assert_int_equal(count_hits_primary(f, k, 3), 3);
    assert_int_equal(count_hits_manager(f, k, 3), 3);
    fx_free(f);
}

static void failed_promotion_case(const int *ok_idx, size_t n_ok, const enum kvt_lookup_result *exp)
{
    struct kvt_primary_config pc = {.num_chunks = 5, .row_bytes = 16};
    struct kvt_primary *p;
    struct kvt_manager *m;
    struct script_tier *s = script_tier_new("example");
    struct kvt_tier *tiers[1] = {&s->base};
    struct kvt_req_ctx *ctx = kt_ctx("test");
    struct kvt_key k[3], ok[3];
    struct kvt_schedule_end_ctx sc = {0};
    kt_keys(k, 0, 3);
    s->dflt = KVT_HIT;
    assert_int_equal(kvt_primary_create(&pc, NULL, &p), 0);
    assert_int_equal(kvt_manager_create(p, tiers, 1, &m), 0);
    for (int i = 0; i < 3; i++)
        assert_int_equal(kvt_manager_lookup(m, &k[i], ctx), KVT_HIT_PENDING);
    kvt_manager_on_schedule_end(m, &sc);
    assert_int_equal(s->n_loads, 1);
    assert_int_equal(s->loads[0]->n, 3);
    for (size_t i = 0; i < n_ok; i++)
        ok[i] = k[ok_idx[i]];
    st_finish(s, s->loads[0], false, n_ok ? ok : NULL, n_ok);
    kvt_manager_on_schedule_end(m, &sc);
    for (int i = 0; i < 3; i++)
        assert_int_equal(kvt_primary_lookup(p, &k[i]), exp[i]);
    assert_int_equal(kvt_manager_num_jobs(m), 0);
    assert_int_equal(kvt_primary_num_write_pending(p), 0);
    assert_int_equal(kvt_manager_shutdown(m), 0);
    kvt_manager_destroy(m);
    kvt_req_ctx_unref(ctx);
}

static void test_failed_promotion_keeps_only_successful_blocks_partial(void **state)
{
    static const int ok[] = {0, 2};
    static const enum kvt_lookup_result exp[] = {KVT_HIT, KVT_MISS, KVT_HIT};
    failed_promotion_case(ok, 2, exp);
}

static void test_failed_promotion_keeps_only_successful_blocks_legacy_full_failure(void **state)
{
    static const enum kvt_lookup_result exp[] = {KVT_MISS, KVT_MISS, KVT_MISS};
    failed_promotion_case(NULL, 0, exp);
}

static double hist_count(struct kvt_stats *st, const char *name, const char *label)
{
    const struct kvt_stat *s = kvt_stats_find(st, name, label);
    return s ? (double)s->count : 0;
}

static bool has_hist(struct kvt_stats *st, const char *name)
{
    for (size_t i = 0; i < st->n; i++) {
        if (strcmp(st->s[i].name, name) == 0 && st->s[i].count > 0)
            return true;
    }
    return false;
}

static void test_lookup_reports_sync_delay_for_resolved_lookups(void **state)
{
    struct fx *f = fx_new();
    struct kvt_key k[2];
    struct kvt_stats st;
    kt_keys(k, 0, 2);
    start(f, f->ctx);
    for (int i = 0; i < 2; i++)
        assert_int_equal(kvt_manager_lookup(f->m, &k[i], f->ctx), KVT_MISS);
    kvt_stats_init(&st);
    assert_int_equal(kvt_manager_get_stats(f->m, &st), 0);
    assert_true(hist_count(&st, KVT_M_LOOKUP_SYNC_DELAY, "0:primary") == 2);
    assert_true(hist_count(&st, KVT_M_LOOKUP_SYNC_DELAY, "1:example") == 2);
    assert_true(hist_count(&st, KVT_M_LOOKUP_SYNC_DELAY, "2:example") == 2);
    assert_false(has_hist(&st, KVT_M_LOOKUP_ASYNC_DELAY));
    kvt_stats_cleanup(&st);
    fx_free(f);
}

static void test_lookup_does_not_report_async_delay_for_promotion(void **state)
{
    struct fx *f = fx_new();
    struct kvt_key k[1];
    struct kvt_stats st;
    kt_keys(k, 0, 1);
    start(f, f->ctx);
    kvt_example_tier_insert(f->t1, &k[0], NULL);
    assert_int_equal(kvt_manager_lookup(f->m, &k[0], f->ctx), KVT_HIT_PENDING);
    step_new(f, "test");
    kvt_stats_init(&st);
    assert_int_equal(kvt_manager_get_stats(f->m, &st), 0);
    assert_true(hist_count(&st, KVT_M_LOOKUP_SYNC_DELAY, "0:primary") == 1);
    assert_true(hist_count(&st, KVT_M_LOOKUP_SYNC_DELAY, "1:example") == 1);
    assert_false(has_hist(&st, KVT_M_LOOKUP_ASYNC_DELAY));
    step(f);
    assert_int_equal(kvt_manager_lookup(f->m, &k[0], f->ctx), KVT_HIT);
    kvt_stats_clear(&st);
    assert_int_equal(kvt_manager_get_stats(f->m, &st), 0);
    assert_false(has_hist(&st, KVT_M_LOOKUP_ASYNC_DELAY));
    kvt_stats_cleanup(&st);
    fx_free(f);
}

static void test_lookup_reports_async_delay_when_deferred_lookup_resolves(void **state)
{
    struct kvt_primary_config pc = {.num_chunks = 5, .row_bytes = 16};
    struct kvt_primary *p;
    struct kvt_manager *m;
    struct script_tier *s = script_tier_new("example");
    struct kvt_tier *tiers[1] = {&s->base};
    struct kvt_req_ctx *ctx = kt_ctx("req_lookup_finish");
    struct kvt_key k = kt_key(0);
    struct kvt_stats st;
    s->seq[0] = KVT_RETRY;
    s->seq[1] = KVT_HIT;
    s->n_seq = 2;
    assert_int_equal(kvt_primary_create(&pc, NULL, &p), 0);
    assert_int_equal(kvt_manager_create(p, tiers, 1, &m), 0);
    assert_int_equal(kvt_manager_on_new_request(m, ctx, NULL), 0);
    assert_int_equal(kvt_manager_lookup(m, &k, ctx), KVT_RETRY);
    kvt_stats_init(&st);
    assert_int_equal(kvt_manager_get_stats(m, &st), 0);
    assert_false(has_hist(&st, KVT_M_LOOKUP_ASYNC_DELAY));
    assert_int_equal(kvt_manager_lookup(m, &k, ctx), KVT_HIT_PENDING);
    kvt_stats_clear(&st);
    assert_int_equal(kvt_manager_get_stats(m, &st), 0);
    assert_true(hist_count(&st, KVT_M_LOOKUP_SYNC_DELAY, "1:example") == 1);
    assert_true(hist_count(&st, KVT_M_LOOKUP_ASYNC_DELAY, "1:example") == 1);
    kvt_stats_cleanup(&st);
    kvt_manager_destroy(m); /* no shutdown: destroy alone must also free all */
    kvt_req_ctx_unref(ctx);
}

static void test_partial_lookup(void **state)
{
    struct fx *f = fx_new();
    struct kvt_key k[5];
    kt_keys(k, 0, 5);
    start(f, f->ctx);
    store(f, f->ctx, k, 3);
    assert_int_equal(count_hits_manager(f, k, 5), 3);
    fx_free(f);
}

static void test_eviction_in_primary_tier(void **state)
{
    struct fx *f = fx_new();
    struct kvt_key k[7];
    kt_keys(k, 0, 7);
    start(f, f->ctx);
    assert_int_equal(kvt_manager_prepare_store(f->m, k, 5, f->ctx, &f->out), 0);
    assert_int_equal(f->out.n_store, 5);
    assert_int_equal(kvt_manager_complete_store(f->m, k, 5, f->ctx, true), 0);
    step(f);
    assert_int_equal(kvt_manager_prepare_store(f->m, k + 5, 2, f->ctx, &f->out), 0);
    assert_int_equal(f->out.n_evicted, 2);
    assert_int_equal(f->out.n_store, 2);
    assert_int_equal(kvt_manager_complete_store(f->m, k + 5, 2, f->ctx, true), 0);
    fx_free(f);
}

static void test_touch_propagates_to_all_tiers(void **state)
{
    struct fx *f = fx_new();
    struct kvt_key k[3], order[5];
    size_t n;
    kt_keys(k, 0, 3);
    start(f, f->ctx);
    store(f, f->ctx, k, 3);
    step(f);
    step(f);
    f->log.n = 0;
    kvt_manager_touch(f->m, k, 3, f->ctx);
    n = kvt_primary_policy_list(f->p, 0, order, 5);
    assert_true(n >= 3);
    for (int i = 0; i < 3; i++)
        assert_true(kvt_key_eq(&order[n - 3 + i], &k[2 - i])); /* reversed(blocks) */
    assert_int_equal(count_calls(&f->log, 0, KVT_EX_TOUCH), 1);
    assert_int_equal(count_calls(&f->log, 1, KVT_EX_TOUCH), 1);
    for (size_t i = 0; i < f->log.n; i++) {
        assert_int_equal(f->log.e[i].n, 3);
        assert_string_equal(f->log.e[i].req_id, "test");
        for (int j = 0; j < 3; j++)
            assert_true(kvt_key_eq(&f->log.e[i].keys[j], &k[j]));
    }
    fx_free(f);
}

static void test_failed_store_no_cascade(void **state)
{
    struct fx *f = fx_new();
    struct kvt_key k[3];
    kt_keys(k, 0, 3);
    start(f, f->ctx);
    assert_int_equal(kvt_manager_prepare_store(f->m, k, 3, f->ctx, &f->out), 0);
    assert_int_equal(kvt_manager_complete_store(f->m, k, 3, f->ctx, false), 0);
    assert_int_equal(kvt_example_tier_calls(f->t1, KVT_EX_SUBMIT_STORE), 0);
    assert_int_equal(kvt_example_tier_calls(f->t2, KVT_EX_SUBMIT_STORE), 0);
    assert_int_equal(kvt_primary_num_entries(f->p), 0);
    fx_free(f);
}

static void test_lookup_batches_submit_load_per_request(void **state)
{
    struct fx *f = fx_new();
    struct kvt_key k[4];
    struct kvt_req_ctx *a = kt_ctx("req_a"), *b = kt_ctx("req_b");
    kt_keys(k, 0, 4);
    for (int i = 0; i < 4; i++)
        kvt_example_tier_insert(f->t1, &k[i], NULL);
    assert_int_equal(kvt_manager_lookup(f->m, &k[0], a), KVT_HIT_PENDING);
    assert_int_equal(kvt_manager_lookup(f->m, &k[1], a), KVT_HIT_PENDING);
    assert_int_equal(kvt_manager_lookup(f->m, &k[2], b), KVT_HIT_PENDING);
    assert_int_equal(kvt_manager_lookup(f->m, &k[3], b), KVT_HIT_PENDING);
    assert_int_equal(kvt_example_tier_calls(f->t1, KVT_EX_SUBMIT_LOAD), 0);
    step(f);
    assert_int_equal(count_calls(&f->log, 0, KVT_EX_SUBMIT_LOAD), 2);
    assert_int_equal(f->log.e[0].call, KVT_EX_SUBMIT_LOAD);
    assert_ptr_equal(f->log.e[0].job->ctx, a);
    assert_int_equal(f->log.e[0].n, 2);
    assert_true(kvt_key_eq(&f->log.e[0].keys[0], &k[0]) && kvt_key_eq(&f->log.e[0].keys[1], &k[1]));
    assert_ptr_equal(f->log.e[1].job->ctx, b);
    assert_true(kvt_key_eq(&f->log.e[1].keys[0], &k[2]) && kvt_key_eq(&f->log.e[1].keys[1], &k[3]));
    kvt_req_ctx_unref(a);
    kvt_req_ctx_unref(b);
    fx_free(f);
}

static void test_lookup_shared_block_no_duplicate_promotion(void **state)
{
    struct fx *f = fx_new();
    struct kvt_key k = kt_key(0);
    struct kvt_req_ctx *a = kt_ctx("req_a"), *b = kt_ctx("req_b");
    kvt_example_tier_insert(f->t1, &k, NULL);
    assert_int_equal(kvt_manager_lookup(f->m, &k, a), KVT_HIT_PENDING);
    assert_int_equal(kvt_manager_lookup(f->m, &k, b), KVT_HIT_PENDING);
    step(f);
    assert_int_equal(count_calls(&f->log, 0, KVT_EX_SUBMIT_LOAD), 1);
    assert_int_equal(f->log.e[0].n, 1);
    assert_true(kvt_key_eq(&f->log.e[0].keys[0], &k));
    assert_ptr_equal(f->log.e[0].job->ctx, a);
    kvt_req_ctx_unref(a);
    kvt_req_ctx_unref(b);
    fx_free(f);
}

static void test_complete_store_forwards_req_context_to_submit_store(void **state)
{
    struct fx *f = fx_new();
    struct kvt_key k[2];
    struct kvt_req_ctx *ctx;
    kt_keys(k, 0, 2);
    assert_int_equal(kvt_req_ctx_create("req_ctx", "{\"key\": \"value\"}", &ctx), 0);
    start(f, ctx);
    store(f, ctx, k, 2);
    assert_int_equal(count_calls(&f->log, 0, KVT_EX_SUBMIT_STORE), 1);
    size_t i = nth_call(&f->log, 0, KVT_EX_SUBMIT_STORE, 0);
    assert_non_null(f->log.e[i].job);
    assert_ptr_equal(f->log.e[i].job->ctx, ctx);
    assert_false(f->log.e[i].job->is_promotion);
    kvt_req_ctx_unref(ctx);
    fx_free(f);
}

static void test_on_request_finished_delays_secondary_until_store_submitted(void **state)
{
    struct fx *f = fx_new();
    struct kvt_key k[2];
    struct kvt_req_ctx *ctx = kt_ctx("req_delayed_secondary");
    static const struct {
        int tier;
        enum kvt_example_call call;
    } want[] = {{0, KVT_EX_SUBMIT_STORE},
                {1, KVT_EX_SUBMIT_STORE},
                {0, KVT_EX_ON_REQUEST_FINISHED},
                {1, KVT_EX_ON_REQUEST_FINISHED}};
    kt_keys(k, 0, 2);
    start(f, ctx);
    f->log.n = 0;
    assert_int_equal(kvt_manager_prepare_store(f->m, k, 2, ctx, &f->out), 0);
    assert_int_equal(kvt_manager_on_request_finished(f->m, ctx), 0);
    assert_int_equal(f->log.n, 0); /* secondaries wait for the cascade */
    assert_int_equal(kvt_manager_complete_store(f->m, k, 2, ctx, true), 0);
    assert_int_equal(f->log.n, 4);
    for (size_t i = 0; i < 4; i++) {
        assert_int_equal(f->log.e[i].tier, want[i].tier);
        assert_int_equal(f->log.e[i].call, want[i].call);
        assert_string_equal(f->log.e[i].req_id, "req_delayed_secondary");
    }
    assert_false(kvt_manager_has_request(f->m, "req_delayed_secondary"));
    kvt_req_ctx_unref(ctx);
    fx_free(f);
}

static void test_failed_store_finalizes_finished_request(void **state)
{
    struct fx *f = fx_new();
    struct kvt_key k[2];
    struct kvt_req_ctx *ctx = kt_ctx("req_failed_store_finalize");
    kt_keys(k, 0, 2);
    start(f, ctx);
    assert_int_equal(kvt_manager_prepare_store(f->m, k, 2, ctx, &f->out), 0);
    assert_int_equal(kvt_manager_on_request_finished(f->m, ctx), 0);
    assert_int_equal(count_calls(&f->log, 0, KVT_EX_ON_REQUEST_FINISHED), 0);
    assert_int_equal(kvt_manager_complete_store(f->m, k, 2, ctx, false), 0);
    assert_int_equal(count_calls(&f->log, 0, KVT_EX_SUBMIT_STORE), 0);
    assert_int_equal(count_calls(&f->log, 1, KVT_EX_SUBMIT_STORE), 0);
    assert_int_equal(count_calls(&f->log, 0, KVT_EX_ON_REQUEST_FINISHED), 1);
    assert_int_equal(count_calls(&f->log, 1, KVT_EX_ON_REQUEST_FINISHED), 1);
    assert_false(kvt_manager_has_request(f->m, "req_failed_store_finalize"));
    kvt_req_ctx_unref(ctx);
    fx_free(f);
}

static void test_zero_store_request_finalizes_immediately(void **state)
{
    struct fx *f = fx_new();
    struct kvt_req_ctx *ctx = kt_ctx("req_zero_store_finalize");
    start(f, ctx);
    assert_int_equal(kvt_manager_on_request_finished(f->m, ctx), 0);
    assert_int_equal(count_calls(&f->log, 0, KVT_EX_ON_REQUEST_FINISHED), 1);
    assert_int_equal(count_calls(&f->log, 1, KVT_EX_ON_REQUEST_FINISHED), 1);
    assert_false(kvt_manager_has_request(f->m, "req_zero_store_finalize"));
    kvt_req_ctx_unref(ctx);
    fx_free(f);
}

static void test_reset_cache_finalizes_delayed_secondary_request(void **state)
{
    struct fx *f = fx_new();
    struct kvt_key k[2];
    struct kvt_req_ctx *ctx = kt_ctx("req_reset_finalize_secondary");
    kt_keys(k, 0, 2);
    start(f, ctx);
    assert_int_equal(kvt_manager_prepare_store(f->m, k, 2, ctx, &f->out), 0);
    assert_int_equal(kvt_manager_on_request_finished(f->m, ctx), 0);
    assert_int_equal(count_calls(&f->log, 0, KVT_EX_ON_REQUEST_FINISHED), 0);
    assert_int_equal(kvt_manager_reset_cache(f->m), 0);
    assert_int_equal(count_calls(&f->log, 0, KVT_EX_ON_REQUEST_FINISHED), 1);
    assert_int_equal(count_calls(&f->log, 1, KVT_EX_ON_REQUEST_FINISHED), 1);
    assert_int_equal(kvt_manager_num_requests(f->m), 0);
    kvt_req_ctx_unref(ctx);
    fx_free(f);
}

static void test_reset_cache_clears_pending_primary_stores_for_active_request(void **state)
{
    struct fx *f = fx_new();
    struct kvt_key k[4];
    struct kvt_req_ctx *ctx = kt_ctx("req_reset_resume");
    struct kvt_manager_req_info info;
    kt_keys(k, 0, 4);
    start(f, ctx);
    assert_int_equal(kvt_manager_prepare_store(f->m, k, 2, ctx, &f->out), 0);
    assert_int_equal(kvt_manager_request_info(f->m, "req_reset_resume", &info), 0);
    assert_int_equal(info.pending_primary_stores, 1);
    assert_int_equal(kvt_manager_reset_cache(f->m), 0);
    assert_int_equal(kvt_manager_request_info(f->m, "req_reset_resume", &info), 0);
    assert_int_equal(info.pending_primary_stores, 0);
    assert_int_equal(count_calls(&f->log, 0, KVT_EX_ON_REQUEST_FINISHED), 0);
    store(f, ctx, k + 2, 2);
    assert_int_equal(kvt_manager_on_request_finished(f->m, ctx), 0);
    assert_int_equal(count_calls(&f->log, 0, KVT_EX_ON_REQUEST_FINISHED), 1);
    assert_int_equal(count_calls(&f->log, 1, KVT_EX_ON_REQUEST_FINISHED), 1);
    assert_false(kvt_manager_has_request(f->m, "req_reset_resume"));
    kvt_req_ctx_unref(ctx);
    fx_free(f);
}

static void test_on_new_request_lifecycle(void **state)
{
    struct kvt_example_tier_config rl = {.request_level = true};
    struct fx *f = fx_new();
    struct fx *g = fx_new_with(2, &rl, NULL, false);
    struct kvt_req_ctx *ctx = kt_ctx("req_policy_lifecycle");
    struct kvt_manager_req_info info;
    enum kvt_offload_policy pol;
    assert_int_equal(kvt_manager_on_new_request(f->m, ctx, &pol), 0);
    assert_int_equal(pol, KVT_CHUNK_LEVEL);
    assert_int_equal(kvt_manager_request_info(f->m, ctx->req_id, &info), 0);
    assert_int_equal(info.request_level_tiers, 0);
    assert_int_equal(kvt_manager_on_request_finished(f->m, ctx), 0);
    assert_false(kvt_manager_has_request(f->m, ctx->req_id));

    assert_int_equal(kvt_manager_on_new_request(g->m, ctx, &pol), 0);
    assert_int_equal(pol, KVT_REQUEST_LEVEL);
    assert_int_equal(kvt_manager_request_info(g->m, ctx->req_id, &info), 0);
    assert_int_equal(info.request_level_tiers, 1u << 0);
    assert_int_equal(kvt_manager_on_request_finished(g->m, ctx), 0);
    assert_false(kvt_manager_has_request(g->m, ctx->req_id));
    kvt_req_ctx_unref(ctx);
    fx_free(f);
    fx_free(g);
}

static void cascade_existing_case(const int *new_ids, size_t n_new)
{
    struct kvt_example_tier_config rl = {.request_level = true};
    struct fx *f = fx_new_with(2, &rl, NULL, false);
    struct kvt_key all[5];
    struct kvt_req_ctx *ctx = kt_ctx("req_cascade");
    kt_keys(all, 0, 3);
    for (size_t i = 0; i < n_new; i++)
        all[3 + i] = kt_key(new_ids[i]);
    start(f, f->ctx);
    store(f, f->ctx, all, 3);
    step(f);
    assert_int_equal(kvt_manager_on_new_request(f->m, ctx, NULL), 0);
    f->log.n = 0;
    assert_int_equal(kvt_manager_prepare_store(f->m, all, 3 + n_new, ctx, &f->out), 0);
    assert_int_equal(f->out.n_store, n_new);
    for (size_t i = 0; i < n_new; i++)
        assert_true(kvt_key_eq(&f->out.keys_to_store[i], &all[3 + i]));
    assert_int_equal(count_calls(&f->log, 0, KVT_EX_SUBMIT_STORE), 1);
    assert_int_equal(f->log.e[0].n, 3);
    for (int i = 0; i < 3; i++)
        assert_true(kvt_key_eq(&f->log.e[0].keys[i], &all[i]));
    assert_int_equal(count_calls(&f->log, 1, KVT_EX_SUBMIT_STORE), 0);
    if (n_new)
        assert_int_equal(kvt_manager_complete_store(f->m, all + 3, n_new, ctx, true), 0);
    kvt_req_ctx_unref(ctx);
    fx_free(f);
}

static void
test_prepare_store_cascades_existing_blocks_to_request_level_tiers_fully_warm(void **state)
{
    cascade_existing_case(NULL, 0);
}

static void test_prepare_store_cascades_existing_blocks_to_request_level_tiers_mixed(void **state)
{
    static const int ids[] = {3, 4};
    cascade_existing_case(ids, 2);
}

static void test_reset_cache_clears_orchestrator_state(void **state)
{
    struct kvt_example_tier_config rl = {.request_level = true};
    struct fx *f = fx_new_with(2, &rl, NULL, false);
    struct kvt_key k[3], promo = kt_key(99);
    struct kvt_req_ctx *pending = kt_ctx("pending"), *rlc = kt_ctx("rl");
    struct kvt_manager_req_info info;
    kt_keys(k, 0, 3);
    start(f, f->ctx);
    store(f, f->ctx, k, 3);
    assert_true(kvt_manager_num_jobs(f->m) > 0);
    kvt_example_tier_insert(f->t1, &promo, NULL);
    assert_int_equal(kvt_manager_lookup(f->m, &promo, pending), KVT_HIT_PENDING);
    assert_int_equal(kvt_manager_on_new_request(f->m, rlc, NULL), 0);
    assert_int_equal(kvt_manager_request_info(f->m, "rl", &info), 0);
    assert_int_equal(info.request_level_tiers, 1);
    f->log.n = 0;
    assert_int_equal(kvt_manager_reset_cache(f->m), 0);
    assert_int_equal(kvt_manager_num_jobs(f->m), 0);
    assert_int_equal(kvt_manager_num_requests(f->m), 2);
    assert_true(kvt_manager_has_request(f->m, "test"));
    assert_true(kvt_manager_has_request(f->m, "rl"));
    assert_int_equal(kvt_primary_num_entries(f->p), 0);
    assert_int_equal(kvt_primary_num_free(f->p), 5);
    for (int i = 0; i < 3; i++)
        assert_int_equal(kvt_primary_lookup(f->p, &k[i]), KVT_MISS);
    assert_int_equal(count_calls(&f->log, 0, KVT_EX_SUBMIT_LOAD), 0);
    /* The gate was cleared: the next step polls (and submits nothing stale). */
    step(f);
    assert_int_equal(count_calls(&f->log, 0, KVT_EX_SUBMIT_LOAD), 0);
    kvt_req_ctx_unref(pending);
    kvt_req_ctx_unref(rlc);
    fx_free(f);
}

/* A tier with a reset op (kvt_manager_reset_all): it records whether it was drained
 * before, what the primary held when it was reset, and fails when told to. */
struct reset_tier {
    struct kvt_tier base;
    struct kvt_primary *p;
    unsigned drains, resets;
    size_t primary_entries_at_reset;
    bool drained_before_reset;
    int reset_rc;
};
static enum kvt_lookup_result rt_lookup(struct kvt_tier *t, const struct kvt_key *k,
                                        struct kvt_req_ctx *c)
{
    return KVT_MISS;
}
static int rt_submit(struct kvt_tier *t, const struct kvt_job *j)
{
    return -ENOSPC;
}
static void rt_finished(struct kvt_tier *t, kvt_job_result_cb_t cb, void *arg)
{
}
static int rt_drain(struct kvt_tier *t)
{
    ((struct reset_tier *)t)->drains++;
    return 0;
}
static int rt_reset(struct kvt_tier *t)
{
    struct reset_tier *r = (struct reset_tier *)t;
    r->resets++;
    r->drained_before_reset = r->drains > 0;
    r->primary_entries_at_reset = kvt_primary_num_entries(r->p);
    return r->reset_rc;
}
static void rt_destroy(struct kvt_tier *t)
{
    free(t);
}
static const struct kvt_tier_ops reset_tier_ops = {
    .lookup = rt_lookup,
    .submit_store = rt_submit,
    .submit_load = rt_submit,
    .get_finished_jobs = rt_finished,
    .drain_jobs = rt_drain,
    .reset = rt_reset,
    .destroy = rt_destroy,
};

/* reset_all: reset_cache (drain, primary cleared), then each tier's reset; a tier
 * without one keeps its data, a failing one's error is returned after the others. */
static void test_reset_all_resets_every_tier_after_the_primary(void **state)
{
    struct kvt_primary_config pc = {.num_chunks = 5, .row_bytes = 16};
    struct kvt_primary *p;
    struct kvt_manager *m;
    struct kvt_tier *ex;
    struct reset_tier *a = calloc(1, sizeof(*a)), *b = calloc(1, sizeof(*b));
    struct kvt_key k[2], kept = kt_key(77);
    struct kvt_req_ctx *ctx = kt_ctx("req_reset_all");
    struct kvt_store_output out;
    struct kvt_tier *tiers[3];

    assert_non_null(a);
    assert_non_null(b);
    assert_int_equal(kvt_primary_create(&pc, NULL, &p), 0);
    kvt_tier_init(&a->base, &reset_tier_ops, "reset_a", KVT_MEDIUM_CPU, KVT_ANY);
    kvt_tier_init(&b->base, &reset_tier_ops, "reset_b", KVT_MEDIUM_CPU, KVT_ANY);
    a->p = b->p = p;
    b->reset_rc = -EIO;
    assert_int_equal(kvt_example_tier_create(NULL, &ex), 0);
    tiers[0] = &a->base;
    tiers[1] = &b->base;
    tiers[2] = ex;
    assert_int_equal(kvt_manager_create(p, tiers, 3, &m), 0);
    kvt_store_output_init(&out);
    kt_keys(k, 0, 2);
    assert_int_equal(kvt_manager_on_new_request(m, ctx, NULL), 0);
    assert_int_equal(kvt_manager_prepare_store(m, k, 2, ctx, &out), 0);
    assert_int_equal(kvt_manager_complete_store(m, k, 2, ctx, true), 0);
    assert_int_equal(kvt_example_tier_insert(ex, &kept, NULL), 0);
    assert_int_equal(kvt_primary_num_entries(p), 2);

    /* reset_cache alone never asks a tier to forget. */
    assert_int_equal(kvt_manager_reset_cache(m), 0);
    assert_int_equal(a->resets + b->resets, 0);
    assert_int_equal(kvt_manager_prepare_store(m, k, 2, ctx, &out), 0);
    assert_int_equal(kvt_manager_complete_store(m, k, 2, ctx, true), 0);

    a->drains = b->drains = 0;
    assert_int_equal(kvt_manager_reset_all(m), -EIO); /* b's error, after a and b ran */
    assert_int_equal(a->resets, 1);
    assert_int_equal(b->resets, 1);
    assert_true(a->drained_before_reset);
    assert_true(b->drained_before_reset);
    assert_int_equal(a->primary_entries_at_reset, 0);
    assert_int_equal(kvt_primary_num_entries(p), 0);
    assert_true(kvt_example_tier_has(ex, &kept));             /* no reset op: kept */
    assert_true(kvt_manager_has_request(m, "req_reset_all")); /* active: kept */
    b->reset_rc = 0;
    assert_int_equal(kvt_manager_reset_all(m), 0);
    assert_int_equal(kvt_manager_on_request_finished(m, ctx), 0);
    kvt_req_ctx_unref(ctx);
    kvt_store_output_cleanup(&out);
    assert_int_equal(kvt_manager_shutdown(m), 0);
    kvt_manager_destroy(m);
}

static void test_reset_cache_drains_all_tiers(void **state)
{
    struct kvt_example_tier_config hold = {.hold_jobs = true};
    struct fx *f = fx_new_with(2, &hold, &hold, false);
    struct kvt_key k[3];
    kt_keys(k, 0, 3);
    start(f, f->ctx);
    store(f, f->ctx, k, 3);
    assert_int_equal(kvt_manager_num_jobs(f->m), 2);
    assert_int_equal(kvt_manager_reset_cache(f->m), 0);
    assert_int_equal(kvt_example_tier_calls(f->t1, KVT_EX_DRAIN), 1);
    assert_int_equal(kvt_example_tier_calls(f->t2, KVT_EX_DRAIN), 1);
    assert_int_equal(kvt_manager_num_jobs(f->m), 0);
    fx_free(f);
}

static void filter_case(const struct kvt_tier_filter *flt, bool allowed)
{
    struct fx *f = fx_new();
    struct kvt_key k[2];
    struct kvt_req_ctx *ctx = kt_ctx("r1");
    kt_keys(k, 0, 2);
    ctx->load_tier_filter = *flt;
    start(f, f->ctx);
    store(f, f->ctx, k, 1);
    kvt_example_tier_insert(f->t1, &k[1], NULL);
    unsigned before = kvt_example_tier_calls(f->t1, KVT_EX_LOOKUP);
    assert_int_equal(kvt_manager_lookup(f->m, &k[0], ctx), KVT_HIT);
    assert_int_equal(kvt_manager_lookup(f->m, &k[1], ctx), allowed ? KVT_HIT_PENDING : KVT_MISS);
    if (allowed)
        assert_true(kvt_example_tier_calls(f->t1, KVT_EX_LOOKUP) > before);
    else
        assert_int_equal(kvt_example_tier_calls(f->t1, KVT_EX_LOOKUP), before);
    kvt_req_ctx_unref(ctx);
    fx_free(f);
}

static void test_tier_filter_skips_filtered_secondary(void **state)
{
    struct kvt_tier_filter storage = {.n = 1, .m = {{KVT_MEDIUM_STORAGE, KVT_ANY}}};
    struct kvt_tier_filter none = {.n = 0};
    filter_case(&storage, false);
    filter_case(&none, false);
}

static void test_tier_filter_allows_matching_secondary(void **state)
{
    struct kvt_tier_filter cpu = {.n = 1, .m = {{KVT_MEDIUM_CPU, KVT_ANY}}};
    struct kvt_tier_filter any = {.n = 1, .m = {{KVT_ANY, KVT_ANY}}};
    filter_case(&kvt_filter_all, true);
    filter_case(&cpu, true);
    filter_case(&any, true);
}

static void test_works_without_secondary_tiers(void **state)
{
    struct fx *f = fx_new_with(0, NULL, NULL, false);
    struct kvt_key k[3];
    kt_keys(k, 0, 3);
    start(f, f->ctx);
    store(f, f->ctx, k, 3);
    assert_int_equal(count_hits_manager(f, k, 3), 3);
    fx_free(f);
}

static void test_parse_tier_filter(void **state)
{
    struct kvt_tier_filter f;
    struct kvt_tier_filter_entry e[4];
    /* valid */
    e[0] = (struct kvt_tier_filter_entry){true, "storage", NULL};
    kvt_tier_filter_parse(&f, true, e, 1);
    assert_false(f.all);
    assert_int_equal(f.n, 1);
    assert_int_equal(f.m[0].medium, KVT_MEDIUM_STORAGE);
    assert_int_equal(f.m[0].locality, KVT_ANY);
    e[0] = (struct kvt_tier_filter_entry){true, "CPU", NULL};
    kvt_tier_filter_parse(&f, true, e, 1);
    assert_int_equal(f.m[0].medium, KVT_MEDIUM_CPU);
    e[0] = (struct kvt_tier_filter_entry){true, NULL, NULL};
    kvt_tier_filter_parse(&f, true, e, 1);
    assert_false(f.all);
    assert_int_equal(f.n, 1);
    assert_int_equal(f.m[0].medium, KVT_ANY);
    e[0] = (struct kvt_tier_filter_entry){true, "storage", "local"};
    kvt_tier_filter_parse(&f, true, e, 1);
    assert_int_equal(f.m[0].locality, KVT_LOCAL);
    e[0] = (struct kvt_tier_filter_entry){true, "cpu", NULL};
    e[1] = (struct kvt_tier_filter_entry){true, "storage", NULL};
    kvt_tier_filter_parse(&f, true, e, 2);
    assert_int_equal(f.n, 2);
    kvt_tier_filter_parse(&f, true, e, 0); /* [] denies everything */
    assert_false(f.all);
    assert_int_equal(f.n, 0);
    assert_false(kvt_tier_filter_allows(&f, KVT_ANY, KVT_ANY));
    /* invalid -> ALL */
    kvt_tier_filter_parse(&f, false, NULL, 0);
    assert_true(f.all);
    e[0] = (struct kvt_tier_filter_entry){true, "unknown", NULL};
    kvt_tier_filter_parse(&f, true, e, 1);
    assert_true(f.all);
    e[0] = (struct kvt_tier_filter_entry){true, NULL, "nowhere"};
    kvt_tier_filter_parse(&f, true, e, 1);
    assert_true(f.all);
    /* skips bad entries */
    e[0] = (struct kvt_tier_filter_entry){true, "storage", NULL};
    e[1] = (struct kvt_tier_filter_entry){false, NULL, NULL};
    e[2] = (struct kvt_tier_filter_entry){true, "bogus", NULL};
    e[3] = (struct kvt_tier_filter_entry){true, "cpu", NULL};
    kvt_tier_filter_parse(&f, true, e, 4);
    assert_false(f.all);
    assert_int_equal(f.n, 2);
    assert_int_equal(f.m[0].medium, KVT_MEDIUM_STORAGE);
    assert_int_equal(f.m[1].medium, KVT_MEDIUM_CPU);
    /* a tier without a medium matches any constraint on that axis */
    assert_true(kvt_tier_filter_allows(&f, KVT_ANY, KVT_REMOTE));
}

/* ---- vLLM manager rules beyond its test file ------------------------------------ */

/* #53062: a request-level cascade of a chunk whose primary write is in flight parks
 * the key, holds finalization and reports pending work until the write resolves. */
static void test_request_level_cascade_parks_hit_pending_keys(void **state)
{
    struct kvt_example_tier_config rl = {.request_level = true};
    struct fx *f = fx_new_with(2, &rl, NULL, false);
    struct kvt_key k[2];
    struct kvt_req_ctx *writer = kt_ctx("writer"), *ctx = kt_ctx("rl");
    struct kvt_manager_req_info info;
    struct kvt_store_output o2;
    kt_keys(k, 0, 2);
    kvt_store_output_init(&o2);
    start(f, writer);
    assert_int_equal(kvt_manager_prepare_store(f->m, k, 2, writer, &o2), 0); /* -1 */
    assert_int_equal(kvt_manager_on_new_request(f->m, ctx, NULL), 0);
    f->log.n = 0;
    assert_int_equal(kvt_manager_prepare_store(f->m, k, 2, ctx, &f->out), 0);
    assert_int_equal(f->out.n_store, 0);
    assert_int_equal(kvt_manager_request_info(f->m, "rl", &info), 0);
    assert_int_equal(info.n_pending_cascade_keys, 2);
    assert_int_equal(count_calls(&f->log, 0, KVT_EX_SUBMIT_STORE), 0);
    assert_int_equal(kvt_manager_on_request_finished(f->m, ctx), 0);
    assert_true(kvt_manager_has_request(f->m, "rl")); /* held by the parked keys */
    assert_true(kvt_manager_has_pending_work(f->m));
    step(f); /* still pending: nothing changes */
    assert_int_equal(kvt_manager_request_info(f->m, "rl", &info), 0);
    assert_int_equal(info.n_pending_cascade_keys, 2);
    /* The writer completes only key 0; key 1 fails (removed -> MISS -> dropped). */
    assert_int_equal(kvt_manager_complete_store(f->m, k, 1, writer, true), 0);
    kvt_primary_complete_store(f->p, k + 1, 1, false);
    f->log.n = 0;
    step(f);
    assert_false(kvt_manager_has_request(f->m, "rl"));
    /* tier 0 got the request-level cascade of key 0 and then the finish */
    size_t stores = 0;
    for (size_t i = 0; i < f->log.n; i++) {
        if (f->log.e[i].tier == 0 && f->log.e[i].call == KVT_EX_SUBMIT_STORE &&
            strcmp(f->log.e[i].req_id, "rl") == 0) {
            stores++;
            assert_int_equal(f->log.e[i].n, 1);
            assert_true(kvt_key_eq(&f->log.e[i].keys[0], &k[0]));
        }
    }
    assert_int_equal(stores, 1);
    assert_int_equal(count_calls(&f->log, 0, KVT_EX_ON_REQUEST_FINISHED), 1);
    kvt_store_output_cleanup(&o2);
    kvt_req_ctx_unref(writer);
    kvt_req_ctx_unref(ctx);
    fx_free(f);
}

static void test_promotion_allocation_failure_is_miss(void **state)
{
    struct fx *f = fx_new();
    struct kvt_key k[6];
    int64_t ids[5];
    struct kvt_stats st;
    kt_keys(k, 0, 6);
    start(f, f->ctx);
    store(f, f->ctx, k, 5);
    step(f);
    step(f);
    /* Pin every chunk: nothing can be evicted for a promotion. */
    assert_int_equal(kvt_manager_prepare_load(f->m, k, 5, f->ctx, ids), 0);
    kvt_example_tier_insert(f->t1, &k[5], NULL);
    assert_int_equal(kvt_manager_lookup(f->m, &k[5], f->ctx), KVT_MISS);
    kvt_stats_init(&st);
    assert_int_equal(kvt_manager_get_stats(f->m, &st), 0);
    assert_true(kvt_stats_value(&st, KVT_M_PROMOTION_ALLOC_FAILURES, NULL) == 1);
    kvt_stats_cleanup(&st);
    assert_int_equal(kvt_manager_complete_load(f->m, k, 5, f->ctx), 0);
    assert_int_equal(kvt_manager_lookup(f->m, &k[5], f->ctx), KVT_HIT_PENDING);
    fx_free(f);
}

static void test_later_tier_hit_wins_over_earlier_retry(void **state)
{
    struct kvt_example_tier_config retry = {.retry_first_lookup = true};
    struct fx *f = fx_new_with(2, &retry, NULL, false);
    struct kvt_key k = kt_key(7);
    kvt_example_tier_insert(f->t2, &k, NULL);
    assert_int_equal(kvt_manager_lookup(f->m, &k, f->ctx), KVT_HIT_PENDING);
    struct kvt_key m = kt_key(8); /* only tier 1 says RETRY: RETRY */
    assert_int_equal(kvt_manager_lookup(f->m, &m, f->ctx), KVT_RETRY);
    assert_int_equal(kvt_manager_lookup(f->m, &m, f->ctx), KVT_MISS);
    fx_free(f);
}

static void test_misuse_returns_einval_and_changes_nothing(void **state)
{
    struct fx *f = fx_new();
    struct kvt_key k[3];
    struct kvt_req_ctx *stranger = kt_ctx("stranger");
    kt_keys(k, 0, 3);
    assert_int_equal(kvt_manager_prepare_store(f->m, k, 1, stranger, &f->out), -EINVAL);
    assert_int_equal(kvt_primary_num_entries(f->p), 0);
    start(f, f->ctx);
    assert_int_equal(kvt_manager_on_new_request(f->m, f->ctx, NULL), -EEXIST);
    assert_int_equal(kvt_manager_complete_store(f->m, k, 1, f->ctx, true), -EINVAL);
    assert_int_equal(kvt_manager_on_request_finished(f->m, stranger), -EINVAL);
    store(f, f->ctx, k, 2);
    step(f);
    step(f);
    assert_int_equal(kvt_manager_complete_load(f->m, k, 1, f->ctx), -EINVAL); /* not pinned */
    assert_int_equal(ref_cnt(f, &k[0]), 0);
    /* completing an unknown key as stored */
    assert_int_equal(kvt_manager_prepare_store(f->m, k + 2, 1, f->ctx, &f->out), 0);
    struct kvt_key unknown = kt_key(42);
    struct kvt_key mix[2] = {k[2], unknown};
    assert_int_equal(kvt_manager_complete_store(f->m, mix, 2, f->ctx, true), -EINVAL);
    assert_int_equal(kvt_primary_lookup(f->p, &k[2]), KVT_HIT_PENDING); /* unchanged */
    assert_int_equal(kvt_manager_complete_store(f->m, k + 2, 1, f->ctx, true), 0);
    /* prepare_load of something not ready */
    int64_t ids[1];
    assert_int_equal(kvt_manager_prepare_load(f->m, &unknown, 1, f->ctx, ids), -EINVAL);
    kvt_req_ctx_unref(stranger);
    fx_free(f);
}

/* A request's state is found again for the next call of the same context; once
 * the request is finished and its state freed, its context (and a new one,
 * whichever address it gets) names no request (under ASan, a stale state would be
 * a use after free). */
static void test_finished_request_state_is_forgotten(void **state)
{
    struct fx *f = fx_new();
    struct kvt_key k[4];
    struct kvt_req_ctx *a = kt_ctx("a"), *b;

    kt_keys(k, 0, 4);
    start(f, a);
    store(f, a, k, 2);
    store(f, a, k + 2, 2);
    assert_int_equal(kvt_manager_on_request_finished(f->m, a), 0);
    assert_false(kvt_manager_has_request(f->m, "a"));
    assert_int_equal(kvt_manager_prepare_store(f->m, k, 1, a, &f->out), -EINVAL);
    kvt_req_ctx_unref(a);
    b = kt_ctx("b");
    assert_int_equal(kvt_manager_prepare_store(f->m, k, 1, b, &f->out), -EINVAL);
    assert_int_equal(kvt_manager_complete_store(f->m, k, 1, b, true), -EINVAL);
    start(f, b);
    assert_int_equal(kvt_manager_prepare_store(f->m, k, 1, b, &f->out), 0);
    assert_int_equal(f->out.n_store, 0); /* present */
    assert_int_equal(kvt_manager_on_request_finished(f->m, b), 0);
    kvt_req_ctx_unref(b);
    fx_free(f);
}

struct abort_arg {
    int which;
};

static void report_unknown_job(void *arg)
{
    struct abort_arg *a = arg;
    struct kvt_primary_config pc = {.num_chunks = 5, .row_bytes = 16};
    struct kvt_primary *p;
    struct kvt_manager *m;
    struct script_tier *s = script_tier_new("x"), *s2 = script_tier_new("y");
    struct kvt_tier *tiers[2] = {&s->base, &s2->base};
    struct kvt_req_ctx *ctx = kt_ctx("test");
    struct kvt_key k = kt_key(1);
    struct kvt_store_output out;
    struct kvt_schedule_end_ctx sc = {0};
    kvt_store_output_init(&out);
    kvt_primary_create(&pc, NULL, &p);
    kvt_manager_create(p, tiers, 2, &m);
    kvt_manager_on_new_request(m, ctx, NULL);
    kvt_manager_prepare_store(m, &k, 1, ctx, &out);
    kvt_manager_complete_store(m, &k, 1, ctx, true);
    if (a->which == 0) {
        struct kvt_job fake = {.id = 12345};
        st_finish(s, &fake, true, NULL, 0); /* never issued */
    } else {
        st_finish(s2, s->stores[0], true, NULL, 0); /* tier 0's job, from tier 1 */
    }
    /* This step already polled (prepare_store); the next step's poll sees it. */
    kvt_manager_on_schedule_end(m, &sc);
    kvt_manager_on_schedule_end(m, &sc);
}

static void test_unknown_or_foreign_job_report_asserts(void **state)
{
    struct abort_arg a0 = {0}, a1 = {1};
    assert_true(kt_expect_abort(report_unknown_job, &a0));
    assert_true(kt_expect_abort(report_unknown_job, &a1));
}

static void test_shutdown_keeps_primary_when_tier_fails(void **state)
{
    struct kvt_example_tier_config bad = {.shutdown_error = -EIO};
    struct fx *f = fx_new_with(2, &bad, NULL, false);
    assert_int_equal(kvt_manager_shutdown(f->m), -EIO);
    /* every tier got its attempt */
    assert_int_equal(kvt_example_tier_calls(f->t1, KVT_EX_SHUTDOWN), 1);
    assert_int_equal(kvt_example_tier_calls(f->t2, KVT_EX_SHUTDOWN), 1);
    struct kvt_primary *p = kvt_manager_primary(f->m);
    assert_non_null(p);
    assert_int_equal(kvt_primary_num_chunks(p), 5); /* still usable */
    kvt_manager_destroy(f->m);
    kvt_primary_destroy(p); /* the caller's, after a failed shutdown */
    kvt_req_ctx_unref(f->ctx);
    kvt_store_output_cleanup(&f->out);
    free(f);
}

/* A tier serving a remote request through the parent handle. */
struct serve_plan {
    struct kvt_key keys[3];
    enum kvt_lookup_result got[3];
    const struct kvt_job *job;
    int rc_job;
    unsigned own_lookups_during;
};

static void serve_remote(struct script_tier *s, struct kvt_parent *p)
{
    struct serve_plan *plan = s->serve_arg;
    struct kvt_req_ctx *ctx;
    struct kvt_key hits[3];
    size_t n_hits = 0;
    unsigned before = s->lookups;
    if (plan == NULL || plan->job != NULL)
        return;
    ctx = kt_ctx("p2p:peer:1:lu0");
    assert_int_equal(kvt_parent_on_new_request(p, ctx, NULL), 0);
    for (int i = 0; i < 3; i++) {
        plan->got[i] = kvt_parent_lookup(p, &plan->keys[i], ctx);
        if (plan->got[i] == KVT_HIT)
            hits[n_hits++] = plan->keys[i];
    }
    plan->own_lookups_during = s->lookups - before;
    plan->rc_job = kvt_parent_create_store_job(p, hits, n_hits, ctx, &plan->job);
    assert_int_equal(kvt_parent_on_request_finished(p, ctx), 0);
    kvt_req_ctx_unref(ctx);
}

static void test_serve_external_requests_through_parent(void **state)
{
    struct kvt_primary_config pc = {.num_chunks = 5, .row_bytes = 16};
    struct kvt_primary *p;
    struct kvt_manager *m;
    struct script_tier *net = script_tier_new("network");
    struct kvt_tier *ex1;
    struct kvt_example_tier_config c = {0};
    struct kvt_tier *tiers[2];
    struct kvt_req_ctx *ctx = kt_ctx("local");
    struct kvt_store_output out;
    struct serve_plan plan = {0};
    struct kvt_schedule_end_ctx sc = {0};
    struct kvt_primary_entry_info info;
    kvt_store_output_init(&out);
    assert_int_equal(kvt_example_tier_create(&c, &ex1), 0);
    tiers[0] = ex1;
    tiers[1] = &net->base;
    net->dflt = KVT_HIT; /* would promote from itself if not excluded */
    assert_int_equal(kvt_primary_create(&pc, NULL, &p), 0);
    assert_int_equal(kvt_manager_create(p, tiers, 2, &m), 0);
    kt_keys(plan.keys, 0, 3);
    /* key 0 in primary, key 1 only in tier 0 (promotion), key 2 nowhere */
    assert_int_equal(kvt_manager_on_new_request(m, ctx, NULL), 0);
    assert_int_equal(kvt_manager_prepare_store(m, plan.keys, 1, ctx, &out), 0);
    assert_int_equal(kvt_manager_complete_store(m, plan.keys, 1, ctx, true), 0);
    kvt_example_tier_insert(ex1, &plan.keys[1], NULL);
    net->serve = serve_remote;
    net->serve_arg = &plan;
    /* outside a serve window the parent refuses */
    kvt_manager_on_schedule_end(m, &sc);
    assert_int_equal(plan.got[0], KVT_HIT);
    assert_int_equal(plan.got[1], KVT_HIT_PENDING); /* promoted from tier 0 */
    assert_int_equal(plan.got[2], KVT_MISS);
    assert_int_equal(plan.own_lookups_during, 0); /* the serving tier is excluded */
    assert_int_equal(plan.rc_job, 0);
    assert_non_null(plan.job);
    assert_int_equal(plan.job->n, 1);
    assert_int_equal(kvt_primary_entry_info(p, &plan.keys[0], &info), 0);
    assert_true(info.ref_cnt >= 1); /* pinned for the peer (+ the cascades) */
    assert_false(kvt_manager_has_request(m, "p2p:peer:1:lu0"));
    /* report the store job: unpinned */
    st_finish(net, plan.job, true, NULL, 0);
    for (int i = 0; i < 3; i++)
        kvt_manager_on_schedule_end(m, &sc);
    for (size_t i = 0; i < net->n_stores; i++)
        st_finish(net, net->stores[i], true, NULL, 0);
    kvt_manager_on_schedule_end(m, &sc);
    kvt_manager_on_schedule_end(m, &sc);
    assert_int_equal(kvt_primary_entry_info(p, &plan.keys[0], &info), 0);
    assert_int_equal(info.ref_cnt, 0);
    assert_int_equal(kvt_primary_lookup(p, &plan.keys[1]), KVT_HIT);
    assert_int_equal(kvt_manager_num_jobs(m), 0);
    assert_int_equal(kvt_manager_shutdown(m), 0);
    kvt_manager_destroy(m);
    kvt_store_output_cleanup(&out);
    kvt_req_ctx_unref(ctx);
}

/* ---- §6.2 manager-level back-pressure ---------------------------------------- */

static uint64_t fake_now;

/* What upstream's tests do with bp._ema = x; bp._under_pressure = True after the
 * warmup: a detector that is pressured at the given EMA. */
static void force_pressure(struct kvt_bp *bp, double ema)
{
    struct kvt_bp_state st;
    kvt__bp_get_state(bp, &st);
    st.ema = ema;
    st.under_pressure = true;
    st.completions = 4;
    st.last_update_s = kvt_now_s();
    kvt__bp_set_state(bp, &st);
}

static struct fx *bp_fx(struct kvt_example_tier_config *c)
{
    struct fx *f = fx_new_with(1, c, NULL, false);
    struct kvt_bp_config bc;
    struct kvt_bp *bp;
    kvt_bp_default_config("delayed", KVT_ANY, &bc);
    bc.high_water_s = 1000; /* scaled for 16-byte rows, as upstream */
    bc.low_water_s = 500;
    assert_int_equal(kvt_bp_create(&bc, &bp), 0);
    kvt_example_tier_set_bp(f->t1, bp);
    return f;
}

static void test_stores_skipped_under_pressure(void **state)
{
    struct fx *f = bp_fx(NULL);
    struct kvt_key k[2];
    kt_keys(k, 0, 2);
    force_pressure(f->t1->bp, 4000);
    assert_true(kvt_bp_is_under_pressure(f->t1->bp));
    start(f, f->ctx);
    store(f, f->ctx, k, 2);
    assert_int_equal(count_hits_primary(f, k, 2), 2);
    assert_int_equal(kvt_example_tier_num_keys(f->t1), 0);
    assert_int_equal(kvt_manager_num_jobs(f->m), 0); /* no job id, no pin */
    assert_int_equal(ref_cnt(f, &k[0]), 0);
    uint64_t stores, chunks;
    kvt_bp_pop_dropped(f->t1->bp, &stores, &chunks);
    assert_int_equal(stores, 1);
    assert_int_equal(chunks, 2);
    fx_free(f);
}

static void test_loads_continue_under_pressure(void **state)
{
    struct fx *f = bp_fx(NULL);
    struct kvt_key k = kt_key(3);
    force_pressure(f->t1->bp, 4000);
    kvt_example_tier_insert(f->t1, &k, NULL);
    assert_int_equal(kvt_manager_lookup(f->m, &k, f->ctx), KVT_HIT_PENDING);
    fx_free(f);
}

static void test_completed_cascade_feeds_detector(void **state)
{
    struct kvt_example_tier_config hold = {.hold_jobs = true};
    struct fx *f = bp_fx(&hold);
    struct kvt_key k[3];
    kt_keys(k, 0, 3);
    fake_now = 1000000000000ull;
    kvt_clock_set_fake(&fake_now);
    start(f, f->ctx);
    for (int i = 0; i < 3; i++) {
        store(f, f->ctx, &k[i], 1);
        fake_now += 2000000000ull; /* 2 s for 16 bytes: far above high water */
        kvt_example_tier_release(f->t1);
        step(f);
        step(f);
        kvt_example_tier_set_hold(f->t1, true);
    }
    /* Three warmup samples of 2 s per 16 bytes seed the EMA with their mean. */
    assert_float_equal(kvt_bp_ema(f->t1->bp), 2.0 / (16.0 / (1 << 20)), 1e-6);
    kvt_clock_set_fake(NULL);
    fx_free(f);
}

static void test_request_level_tier_respects_backpressure(void **state)
{
    struct kvt_example_tier_config rl = {.request_level = true};
    struct fx *f = bp_fx(&rl);
    struct kvt_key k[3];
    struct kvt_req_ctx *ctx = kt_ctx("req_rl");
    kt_keys(k, 0, 3);
    start(f, f->ctx);
    store(f, f->ctx, k, 3);
    step(f);
    step(f);
    force_pressure(f->t1->bp, 4000);
    assert_int_equal(kvt_manager_on_new_request(f->m, ctx, NULL), 0);
    unsigned before = kvt_example_tier_calls(f->t1, KVT_EX_SUBMIT_STORE);
    assert_int_equal(kvt_manager_prepare_store(f->m, k, 3, ctx, &f->out), 0);
    assert_int_equal(kvt_example_tier_calls(f->t1, KVT_EX_SUBMIT_STORE), before);
    kvt_req_ctx_unref(ctx);
    fx_free(f);
}

static void test_metrics_reported_via_get_stats(void **state)
{
    struct fx *f = bp_fx(NULL);
    struct kvt_key k[5];
    struct kvt_stats st;
    kt_keys(k, 0, 5);
    fake_now = 1000000000000ull; /* frozen: no idle decay between the reads */
    kvt_clock_set_fake(&fake_now);
    force_pressure(f->t1->bp, 4000); /* 4x high: every store dropped */
    start(f, f->ctx);
    store(f, f->ctx, k, 2);
    store(f, f->ctx, k + 2, 3);
    kvt_stats_init(&st);
    assert_int_equal(kvt_manager_get_stats(f->m, &st), 0);
    assert_true(kvt_stats_value(&st, KVT_M_BP_EMA, "1:example") == 4000);
    assert_true(kvt_stats_value(&st, KVT_M_BP_STORES_DROPPED, "1:example") == 2);
    assert_true(kvt_stats_value(&st, KVT_M_BP_BLOCKS_DROPPED, "1:example") == 5);
    kvt_stats_clear(&st);
    assert_int_equal(kvt_manager_get_stats(f->m, &st), 0);
    assert_true(kvt_stats_value(&st, KVT_M_BP_EMA, "1:example") == 4000); /* persists */
    assert_true(kvt_stats_value(&st, KVT_M_BP_STORES_DROPPED, "1:example") == 0);
    kvt_stats_cleanup(&st);
    kvt_clock_set_fake(NULL);
    fx_free(f);
}

static void test_reset_cache_clears_backpressure(void **state)
{
    struct fx *f = bp_fx(NULL);
    force_pressure(f->t1->bp, 4000);
    assert_true(kvt_bp_is_under_pressure(f->t1->bp));
    assert_int_equal(kvt_manager_reset_cache(f->m), 0);
    assert_true(kvt_bp_ema(f->t1->bp) == 0);
    assert_false(kvt_bp_is_under_pressure(f->t1->bp));
    fx_free(f);
}

/* ---- out of memory ------------------------------------------------------------- */

/* A tier that keeps a record of each job from kvt_malloc, so failure injection
 * reaches it as it reaches real tiers: without its record it refuses the job
 * (-ENOMEM), with it the job is reported at the next get_finished_jobs, from the
 * record, without allocating. Every job it is handed is counted by id: accepted,
 * refused, reported. It is request-level, so prepare_store cascades existing keys
 * to it, and while serve_keys is set it serves one remote request through the
 * parent, recording its job before asking the parent for it. */
#define LT_IDS 1024
struct lt_rec {
    struct lt_rec *next;
    kvt_job_id_t id;
};
struct ledger_tier {
    struct kvt_tier base;
    struct lt_rec *pending;
    int accepted[LT_IDS], refused[LT_IDS], reported[LT_IDS];
    struct kvt_key has[64];
    size_t n_has;
    const struct kvt_key *serve_keys;
    size_t n_serve;
    struct kvt_req_ctx *serve_ctx;
    unsigned stores, loads, served; /* accepted */
};

static struct ledger_tier *lt_of(struct kvt_tier *t)
{
    return (struct ledger_tier *)t;
}
static enum kvt_lookup_result lt_lookup(struct kvt_tier *t, const struct kvt_key *k,
                                        struct kvt_req_ctx *c)
{
    struct ledger_tier *l = lt_of(t);
    for (size_t i = 0; i < l->n_has; i++) {
        if (kvt_key_eq(&l->has[i], k))
            return KVT_HIT;
    }
    return KVT_MISS;
}
/* The record of a job handed to the tier, or NULL (counted refused). */
static struct lt_rec *lt_record(struct ledger_tier *l, const struct kvt_job *j)
{
    struct lt_rec *r = kvt_malloc(sizeof(*r));
    assert_true(j->id < LT_IDS);
    if (r == NULL) {
        l->refused[j->id]++;
        return NULL;
    }
    r->id = j->id;
    r->next = l->pending;
    l->pending = r;
    l->accepted[j->id]++;
    return r;
}
static int lt_store(struct kvt_tier *t, const struct kvt_job *j)
{
    struct ledger_tier *l = lt_of(t);
    if (lt_record(l, j) == NULL)
        return -ENOMEM;
    l->stores++;
    for (size_t i = 0; i < j->n && l->n_has < KVT_ARRAY_SIZE(l->has); i++) {
        if (lt_lookup(t, &j->keys[i], NULL) == KVT_MISS)
            l->has[l->n_has++] = j->keys[i];
    }
    return 0;
}
static int lt_load(struct kvt_tier *t, const struct kvt_job *j)
{
    if (lt_record(lt_of(t), j) == NULL)
        return -ENOMEM;
    lt_of(t)->loads++;
    return 0;
}
static void lt_finished(struct kvt_tier *t, kvt_job_result_cb_t cb, void *arg)
{
    struct ledger_tier *l = lt_of(t);
    struct lt_rec *r = l->pending;
    l->pending = NULL;
    while (r != NULL) {
        struct lt_rec *next = r->next;
        struct kvt_job_result res = {
            .job_id = r->id, .success = true, .transfer_time = -1, .transfer_bytes = -1};
        l->reported[r->id]++;
        kvt_free(r);
        cb(arg, &res);
        r = next;
    }
}
static bool lt_pending(struct kvt_tier *t)
{
    return lt_of(t)->pending != NULL;
}
static int lt_drain(struct kvt_tier *t)
{
    return 0;
}
static enum kvt_offload_policy lt_on_new_request(struct kvt_tier *t, struct kvt_req_ctx *ctx)
{
    return KVT_REQUEST_LEVEL;
}
static void lt_serve(struct kvt_tier *t, struct kvt_parent *p)
{
    struct ledger_tier *l = lt_of(t);
    struct lt_rec *r;
    const struct kvt_job *job;
    enum kvt_offload_policy pol;
    bool all = true;
    if (l->serve_keys == NULL || kvt_parent_on_new_request(p, l->serve_ctx, &pol) != 0)
        return;
    for (size_t i = 0; i < l->n_serve; i++)
        all &= kvt_parent_lookup(p, &l->serve_keys[i], l->serve_ctx) == KVT_HIT;
    r = all ? kvt_malloc(sizeof(*r)) : NULL; /* the record first, as the contract asks */
    if (r != NULL &&
        kvt_parent_create_store_job(p, l->serve_keys, l->n_serve, l->serve_ctx, &job) == 0) {
        assert_true(job->id < LT_IDS);
        r->id = job->id;
        r->next = l->pending;
        l->pending = r;
        l->accepted[job->id]++;
        l->served++;
        l->serve_keys = NULL;
    } else {
        kvt_free(r);
    }
    kvt_parent_on_request_finished(p, l->serve_ctx);
}
static void lt_destroy(struct kvt_tier *t)
{
    free(t);
}
static const struct kvt_tier_ops ledger_ops = {
    .lookup = lt_lookup,
    .submit_store = lt_store,
    .submit_load = lt_load,
    .get_finished_jobs = lt_finished,
    .drain_jobs = lt_drain,
    .has_pending_work = lt_pending,
    .on_new_request = lt_on_new_request,
    .serve_external_requests = lt_serve,
    .destroy = lt_destroy,
};

/* What an engine does with the manager, carrying on whatever a call returns: request
 * A stores keys 0-5 (cascades to both tiers), B stores 10-17 (evicting A's), C looks
 * 0-5 up (promotions from the ledger tier), D stores 10-13 again (the ledger tier
 * is request-level: existing keys cascade), the ledger tier serves 14-17 to a
 * remote requester; every request ends. */
static void oom_workload(struct kvt_manager *m, struct ledger_tier *l, struct kvt_req_ctx **ctx)
{
    struct kvt_key keys[8];
    struct kvt_store_output out;
    enum kvt_lookup_result r;
    const int first[4] = {0, 10, 0, 10};
    const size_t n[4] = {6, 8, 6, 4};
    kvt_store_output_init(&out);
    for (int q = 0; q < 4; q++) {
        (void)kvt_manager_on_new_request(m, ctx[q], NULL);
        kt_keys(keys, first[q], n[q]);
        if (q == 2) {
            for (size_t i = 0; i < n[q]; i++)
                r = kvt_manager_lookup(m, &keys[i], ctx[q]);
            (void)r;
        } else if (kvt_manager_prepare_store(m, keys, n[q], ctx[q], &out) == 0) {
            (void)kvt_manager_complete_store(m, out.keys_to_store, out.n_store, ctx[q], true);
        }
        kvt_manager_on_schedule_end(m, NULL);
        kvt_manager_on_schedule_end(m, NULL);
    }
    l->serve_keys = &keys[4]; /* 14-17, stored by B */
    l->n_serve = 4;
    for (int i = 0; i < 3; i++)
        kvt_manager_on_schedule_end(m, NULL);
    l->serve_keys = NULL;
    for (int q = 0; q < 4; q++)
        (void)kvt_manager_on_request_finished(m, ctx[q]);
    kvt_store_output_cleanup(&out);
}

/* Every allocation index of oom_workload, in turn, and all that follow it, fail:
 * no crash, no leak (ASan); every job a tier accepted is reported exactly once and
 * a refused one never; once memory is back and the manager settles, no job is
 * left, no request, no row pinned or write-pending, and the metrics are idle
 * (reset_cache asserts it). An example tier takes the cascades too. */
static void test_allocation_failures_keep_the_job_contract(void **state)
{
    long n;
    int refused = 0;
    for (n = 0; n < 100000; n++) {
        struct kvt_primary_config pc = {.num_chunks = 8, .row_bytes = 16, .enable_events = true};
        struct kvt_example_tier_config ec = {0};
        struct kvt_primary *p;
        struct kvt_tier *tiers[2];
        struct kvt_manager *m;
        struct ledger_tier *l = calloc(1, sizeof(*l));
        struct kvt_req_ctx *ctx[4] = {kt_ctx("oom-a"), kt_ctx("oom-b"), kt_ctx("oom-c"),
                                      kt_ctx("oom-d")};
        void *probe;
        bool reached;
        assert_non_null(l);
        kvt_tier_init(&l->base, &ledger_ops, "ledger", KVT_MEDIUM_CPU, KVT_ANY);
        l->serve_ctx = kt_ctx("oom-remote");
        assert_int_equal(kvt_primary_create(&pc, NULL, &p), 0);
        assert_int_equal(kvt_example_tier_create(&ec, &tiers[1]), 0);
        tiers[0] = &l->base;
        assert_int_equal(kvt_manager_create(p, tiers, 2, &m), 0);

        kvt_alloc_fail_after(n);
        oom_workload(m, l, ctx);
        probe = kvt_malloc(1);
        reached = probe == NULL;
        kvt_free(probe);
        kvt_alloc_fail_after(-1);

        for (int i = 0; i < 4 && kvt_manager_has_pending_work(m); i++)
            kvt_manager_on_schedule_end(m, NULL);
        assert_false(kvt_manager_has_pending_work(m));
        assert_int_equal(kvt_manager_num_jobs(m), 0);
        assert_int_equal(kvt_manager_num_requests(m), 0);
        for (size_t id = 0; id < LT_IDS; id++) {
            assert_true(l->accepted[id] + l->refused[id] <= 1);
            assert_int_equal(l->reported[id], l->accepted[id]);
            refused += l->refused[id];
        }
        assert_int_equal(kvt_example_tier_num_unreported(tiers[1]), 0);
        assert_int_equal(kvt_primary_num_write_pending(p), 0);
        assert_int_equal(kvt_primary_num_entries(p), kvt_primary_num_evictable(p));
        assert_int_equal(kvt_manager_reset_cache(m), 0);
        /* With memory the workload does all it says: cascades (A, B and D's
         * existing keys), promotions, a remote request served. */
        if (!reached)
            assert_true(l->stores >= 3 && l->loads >= 1 && l->served == 1);
        kvt_req_ctx_unref(l->serve_ctx);
        assert_int_equal(kvt_manager_shutdown(m), 0);
        kvt_manager_destroy(m); /* and the tiers */
        for (int q = 0; q < 4; q++)
            kvt_req_ctx_unref(ctx[q]);
        if (!reached)
            break; /* the workload needed fewer allocations than n: every index failed */
    }
    print_message("manager: allocation indexes 0-%ld failed in turn, %d jobs refused\n", n - 1,
                  refused);
    assert_true(n > 0 && n < 100000);
    assert_true(refused > 0);
}

/* ---- the policies as vLLM's CPU tier drives them ---------------------------
 * A manager without secondary tiers over a tiny primary; A, B, ... are
 * kt_key(1), kt_key(2), ... Each scenario's evictions were checked against
 * vLLM 0.34's CPUOffloadingManager (tests/conformance/vllm_policy_replay.py). */

struct pfx {
    struct kvt_manager *m;
    struct kvt_primary *p;
    struct kvt_req_ctx *r[3];
    struct kvt_store_output out;
};

static struct pfx *pfx_new(size_t chunks, const char *policy)
{
    struct pfx *f = calloc(1, sizeof(*f));
    struct kvt_primary_config pc = {.num_chunks = chunks, .policy = policy};
    char id[8];

    assert_non_null(f);
    assert_int_equal(kvt_primary_create(&pc, NULL, &f->p), 0);
    assert_int_equal(kvt_manager_create(f->p, NULL, 0, &f->m), 0);
    for (int i = 0; i < 3; i++) {
        snprintf(id, sizeof(id), "r%d", i);
        f->r[i] = kt_ctx(id);
        assert_int_equal(kvt_manager_on_new_request(f->m, f->r[i], NULL), 0);
    }
    kvt_store_output_init(&f->out);
    return f;
}

static void pfx_free(struct pfx *f)
{
    for (int i = 0; i < 3; i++) {
        if (kvt_manager_has_request(f->m, f->r[i]->req_id))
            assert_int_equal(kvt_manager_on_request_finished(f->m, f->r[i]), 0);
        kvt_req_ctx_unref(f->r[i]);
    }
    assert_int_equal(kvt_manager_shutdown(f->m), 0);
    kvt_manager_destroy(f->m);
    kvt_store_output_cleanup(&f->out);
    free(f);
}

/* prepare_store + complete_store of ids (-1 ends) by request r; the evicted ids
 * (-1 ends) must be exactly evicted, in order. */
static void pstore(struct pfx *f, int r, const int *ids, const int *evicted)
{
    struct kvt_key k[8];
    size_t n = 0, e = 0;

    for (; ids[n] >= 0; n++)
        k[n] = kt_key(ids[n]);
    assert_int_equal(kvt_manager_prepare_store(f->m, k, n, f->r[r], &f->out), 0);
    for (; evicted[e] >= 0; e++) {
        struct kvt_key x = kt_key(evicted[e]);

        assert_true(e < f->out.n_evicted);
        if (!kvt_key_eq(&f->out.evicted[e], &x))
            fail_msg("eviction %zu is not key %d", e, evicted[e]);
    }
    assert_int_equal(f->out.n_evicted, e);
    assert_int_equal(
        kvt_manager_complete_store(f->m, f->out.keys_to_store, f->out.n_store, f->r[r], true), 0);
}
#define IDS(...) ((const int[]){__VA_ARGS__, -1})
#define NO_IDS   ((const int[]){-1})

enum { A = 1, B, C, D, E };

/* 1. LRU: a request's finish gives its keys a new rank. */
static void test_lru_request_finish_ranks_its_keys(void **state)
{
    struct pfx *f = pfx_new(2, "lru");

    pstore(f, 0, IDS(A), NO_IDS);
    pstore(f, 1, IDS(B), NO_IDS);
    assert_int_equal(kvt_manager_on_request_finished(f->m, f->r[0]), 0);
    pstore(f, 2, IDS(C), IDS(B)); /* the simple form evicted A */
    pfx_free(f);
}

/* 2. ARC: a key a request reused while ready moves T1 -> T2 at its finish. */
static void test_arc_request_finish_promotes_reused_keys(void **state)
{
    struct pfx *f = pfx_new(2, "arc");
    struct kvt_key a = kt_key(A), t2[2];
    int64_t slot;

    pstore(f, 0, IDS(A, B), NO_IDS);
    assert_int_equal(kvt_manager_prepare_load(f->m, &a, 1, f->r[1], &slot), 0);
    assert_int_equal(kvt_manager_complete_load(f->m, &a, 1, f->r[1]), 0);
    assert_int_equal(kvt_primary_policy_list(f->p, 1, t2, 2), 0); /* not before the finish */
    assert_int_equal(kvt_manager_on_request_finished(f->m, f->r[1]), 0);
    assert_int_equal(kvt_primary_policy_list(f->p, 1, t2, 2), 1);
    assert_true(kvt_key_eq(&t2[0], &a));
    pstore(f, 2, IDS(C), IDS(B)); /* the simple form evicted A */
    pfx_free(f);
}

/* 3. ARC: store misses of ghost keys adapt the target before the store evicts. */
static void test_arc_store_miss_adapts_before_eviction(void **state)
{
    struct pfx *f = pfx_new(3, "arc");
    struct kvt_key c = kt_key(C), a = kt_key(A), b = kt_key(B);

    pstore(f, 0, IDS(A, B, C), NO_IDS);
    kvt_manager_touch(f->m, &c, 1, f->r[0]); /* an access of its own: C reused, to T2 */
    pstore(f, 0, IDS(D, E), IDS(A, B));
    assert_int_equal(kvt_primary_arc_ghost_of(f->p, &a), 1);
    assert_int_equal(kvt_primary_arc_ghost_of(f->p, &b), 1);
    assert_float_equal(kvt_primary_arc_target(f->p), 0.0, 0);
    /* B then A hit B1: target 0 -> 1 -> 2; then |T1| = 2 >= 2 gives D, and 1 < 2
     * C from T2 (without the adaptation: D and E) */
    pstore(f, 1, IDS(A, B), IDS(D, C));
    assert_float_equal(kvt_primary_arc_target(f->p), 2.0, 0);
    assert_int_equal(kvt_primary_arc_ghost_len(f->p, 1), 1); /* D; A and B stored */
    assert_int_equal(kvt_primary_arc_ghost_len(f->p, 2), 1); /* C */
    pfx_free(f);
}

/* prepare_store polls the tiers even when the step's gate is set (vLLM 0.34):
 * cascades that finished since the step's first lookup unpin their chunks before
 * the eviction decision. */
static void test_prepare_store_polls_past_the_step_gate(void **state)
{
    struct fx *f = fx_new_with(1, NULL, NULL, false);
    struct kvt_key k[7];

    kt_keys(k, 0, 7);
    start(f, f->ctx);
    assert_int_equal(kvt_manager_lookup(f->m, &k[6], f->ctx), KVT_MISS); /* sets the gate */
    assert_int_equal(kvt_manager_prepare_store(f->m, k, 5, f->ctx, &f->out), 0);
    assert_int_equal(kvt_manager_complete_store(f->m, k, 5, f->ctx, true), 0);
    assert_int_equal(kvt_primary_num_evictable(f->p), 0); /* pinned by the cascade */
    /* The cascade has finished in the tier; the same step's store must see it. */
    assert_int_equal(kvt_manager_prepare_store(f->m, k + 5, 1, f->ctx, &f->out), 0);
    assert_int_equal(f->out.n_evicted, 1);
    assert_int_equal(kvt_manager_complete_store(f->m, k + 5, 1, f->ctx, true), 0);
    fx_free(f);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_tiering_manager_aggregates_secondary_stats),
        cmocka_unit_test(test_basic_store_and_lookup),
        cmocka_unit_test(test_take_events_aggregates_tier_owned_events),
        cmocka_unit_test(test_basic_store_to_primary),
        cmocka_unit_test(test_cascade_to_all_secondary_tiers),
        cmocka_unit_test(test_ref_cnt_protection_during_cascade),
        cmocka_unit_test(test_lookup_from_primary),
        cmocka_unit_test(test_promotion_from_secondary),
        cmocka_unit_test(test_failed_promotion_keeps_only_successful_blocks_partial),
        cmocka_unit_test(test_failed_promotion_keeps_only_successful_blocks_legacy_full_failure),
        cmocka_unit_test(test_lookup_reports_sync_delay_for_resolved_lookups),
        cmocka_unit_test(test_lookup_does_not_report_async_delay_for_promotion),
        cmocka_unit_test(test_lookup_reports_async_delay_when_deferred_lookup_resolves),
        cmocka_unit_test(test_partial_lookup),
        cmocka_unit_test(test_eviction_in_primary_tier),
        cmocka_unit_test(test_touch_propagates_to_all_tiers),
        cmocka_unit_test(test_failed_store_no_cascade),
        cmocka_unit_test(test_lookup_batches_submit_load_per_request),
        cmocka_unit_test(test_lookup_shared_block_no_duplicate_promotion),
        cmocka_unit_test(test_complete_store_forwards_req_context_to_submit_store),
        cmocka_unit_test(test_on_request_finished_delays_secondary_until_store_submitted),
        cmocka_unit_test(test_failed_store_finalizes_finished_request),
        cmocka_unit_test(test_zero_store_request_finalizes_immediately),
        cmocka_unit_test(test_reset_cache_finalizes_delayed_secondary_request),
        cmocka_unit_test(test_reset_cache_clears_pending_primary_stores_for_active_request),
        cmocka_unit_test(test_on_new_request_lifecycle),
        cmocka_unit_test(
            test_prepare_store_cascades_existing_blocks_to_request_level_tiers_fully_warm),
        cmocka_unit_test(test_prepare_store_cascades_existing_blocks_to_request_level_tiers_mixed),
        cmocka_unit_test(test_reset_cache_clears_orchestrator_state),
        cmocka_unit_test(test_reset_cache_drains_all_tiers),
        cmocka_unit_test(test_reset_all_resets_every_tier_after_the_primary),
        cmocka_unit_test(test_tier_filter_skips_filtered_secondary),
        cmocka_unit_test(test_tier_filter_allows_matching_secondary),
        cmocka_unit_test(test_works_without_secondary_tiers),
        cmocka_unit_test(test_parse_tier_filter),
        cmocka_unit_test(test_request_level_cascade_parks_hit_pending_keys),
        cmocka_unit_test(test_promotion_allocation_failure_is_miss),
        cmocka_unit_test(test_later_tier_hit_wins_over_earlier_retry),
        cmocka_unit_test(test_misuse_returns_einval_and_changes_nothing),
        cmocka_unit_test(test_finished_request_state_is_forgotten),
        cmocka_unit_test(test_unknown_or_foreign_job_report_asserts),
        cmocka_unit_test(test_shutdown_keeps_primary_when_tier_fails),
        cmocka_unit_test(test_serve_external_requests_through_parent),
        cmocka_unit_test(test_stores_skipped_under_pressure),
        cmocka_unit_test(test_loads_continue_under_pressure),
        cmocka_unit_test(test_completed_cascade_feeds_detector),
        cmocka_unit_test(test_request_level_tier_respects_backpressure),
        cmocka_unit_test(test_metrics_reported_via_get_stats),
        cmocka_unit_test(test_reset_cache_clears_backpressure),
        cmocka_unit_test(test_lookup_many_matches_one_by_one),
        cmocka_unit_test(test_allocation_failures_keep_the_job_contract),
        cmocka_unit_test(test_lru_request_finish_ranks_its_keys),
        cmocka_unit_test(test_arc_request_finish_promotes_reused_keys),
        cmocka_unit_test(test_arc_store_miss_adapts_before_eviction),
        cmocka_unit_test(test_prepare_store_polls_past_the_step_gate),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

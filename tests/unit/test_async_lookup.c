/* SPDX-License-Identifier: Apache-2.0 */
/* AsyncLookupManager against vLLM's scenarios
 * (tests/v1/kv_offload/tiering/test_async_lookup.py), then vLLM's
 * remaining rules: generations, in-flight orphans, grouping per request, failed
 * batches, the drain timing, allocation failures.
 *
 * Fixture as upstream: a manager of tier type "test" whose batch_lookup answers from
 * an in-memory key set; keys kt_key(i); contexts "r1" unless named. Upstream waits on
 * an event set inside batch_lookup; here wait_idle() waits until the result list is
 * posted, which is what the scenarios mean (and is not racy). The fake can also hold
 * the worker inside batch_lookup (gate) to keep a probe in flight. */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "test_util.h"

#include "kvt/alloc.h"
#include "kvt/alloc_test.h"
#include "kvt/async_lookup.h"
#include "kvt/async_lookup_test.h"
#include "kvt/common.h"

/* ---- the in-memory tier ---------------------------------------------------- */

#define FAKE_MAX 16

struct fake {
    struct kvt_key present[FAKE_MAX];
    size_t n_present;
    int fail_rc; /* returned by every call when negative */

    /* Written by the worker, read by the test after wait_idle(). */
    size_t calls;
    char call_req[FAKE_MAX][KVT_REQ_ID_MAX + 1];
    size_t call_n[FAKE_MAX];
    struct kvt_key call_keys[FAKE_MAX][FAKE_MAX];

    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool gated;   /* hold the worker inside batch_lookup */
    bool in_call; /* the worker reached the gate */
};

static bool fake_has(const struct fake *f, const struct kvt_key *k)
{
    for (size_t i = 0; i < f->n_present; i++)
        if (kvt_key_eq(&f->present[i], k))
            return true;
    return false;
}

/* The worker entered batch_lookup: says so, and waits there while the test holds it. */
static void fake_enter(struct fake *f)
{
    pthread_mutex_lock(&f->mu);
    f->in_call = true;
    pthread_cond_broadcast(&f->cv);
    while (f->gated)
        pthread_cond_wait(&f->cv, &f->mu);
    pthread_mutex_unlock(&f->mu);
}

static int fake_batch_lookup(void *arg, const struct kvt_key *keys, size_t n,
                             const struct kvt_req_ctx *ctx, bool *found)
{
    struct fake *f = arg;
    size_t c;

    fake_enter(f);

    c = f->calls++;
    if (c < FAKE_MAX) {
        snprintf(f->call_req[c], sizeof(f->call_req[c]), "%s", ctx->req_id);
        f->call_n[c] = n;
        for (size_t i = 0; i < n && i < FAKE_MAX; i++)
            f->call_keys[c][i] = keys[i];
    }
    if (f->fail_rc < 0) {
        for (size_t i = 0; i < n; i++)
            found[i] = true; /* garbage the manager must ignore */
        return f->fail_rc;
    }
    for (size_t i = 0; i < n; i++)
        found[i] = fake_has(f, &keys[i]);
    return 0;
}

/* Spans mode: the same answers, one call for every queued item (call_n: its spans). */
static int fake_batch_lookup_spans(void *arg, const struct kvt_al_span *spans, size_t n_spans)
{
    struct fake *f = arg;
    size_t c;

    fake_enter(f);

    c = f->calls++;
    if (c < FAKE_MAX)
        f->call_n[c] = n_spans;
    for (size_t s = 0; s < n_spans; s++)
        for (size_t i = 0; i < spans[s].n; i++)
            spans[s].found[i] = f->fail_rc < 0 || fake_has(f, &spans[s].keys[i]);
    return f->fail_rc < 0 ? f->fail_rc : 0;
}

static void fake_gate(struct fake *f)
{
    pthread_mutex_lock(&f->mu);
    f->gated = true;
    f->in_call = false;
    pthread_mutex_unlock(&f->mu);
}

/* Waits until the worker sits inside batch_lookup. */
static void fake_wait_in_call(struct fake *f)
{
    pthread_mutex_lock(&f->mu);
    while (!f->in_call)
        pthread_cond_wait(&f->cv, &f->mu);
    pthread_mutex_unlock(&f->mu);
}

static void fake_release(struct fake *f)
{
    pthread_mutex_lock(&f->mu);
    f->gated = false;
    pthread_cond_broadcast(&f->cv);
    pthread_mutex_unlock(&f->mu);
}

/* ---- fixture --------------------------------------------------------------- */

struct fx {
    struct fake f;
    struct kvt_async_lookup *al;
    struct kvt_req_ctx *ctx[4];
    size_t n_ctx;
};

/* InMemoryLookupManager(existing_keys={kt_key(present[i])}). */
static struct fx *fx_new(const int *present, size_t n)
{
    struct fx *fx = calloc(1, sizeof(*fx));

    assert_non_null(fx);
    assert_true(n <= FAKE_MAX);
    for (size_t i = 0; i < n; i++)
        fx->f.present[i] = kt_key(present[i]);
    fx->f.n_present = n;
    pthread_mutex_init(&fx->f.mu, NULL);
    pthread_cond_init(&fx->f.cv, NULL);
    assert_int_equal(kvt_async_lookup_create("test", fake_batch_lookup, &fx->f, &fx->al), 0);
    return fx;
}

/* FX(1, 3): a manager whose backing set holds kt_key(1) and kt_key(3). */
#define FX(...) fx_new((const int[]){__VA_ARGS__}, sizeof((const int[]){__VA_ARGS__}) / sizeof(int))

/* A context owned by the fixture (upstream's _ctx(req_id)). */
static struct kvt_req_ctx *fx_ctx(struct fx *fx, const char *req_id)
{
    assert_true(fx->n_ctx < KVT_ARRAY_SIZE(fx->ctx));
    fx->ctx[fx->n_ctx] = kt_ctx(req_id);
    return fx->ctx[fx->n_ctx++];
}

static void fx_free(struct fx *fx)
{
    kvt_async_lookup_destroy(fx->al);
    for (size_t i = 0; i < fx->n_ctx; i++)
        kvt_req_ctx_unref(fx->ctx[i]);
    pthread_cond_destroy(&fx->f.cv);
    pthread_mutex_destroy(&fx->f.mu);
    free(fx);
}

/* Upstream's mgr.shutdown() at the end of every test, then the teardown. */
static void fx_done(struct fx *fx)
{
    kvt_async_lookup_shutdown(fx->al);
    fx_free(fx);
}

static int lk(struct fx *fx, int i, struct kvt_req_ctx *ctx)
{
    struct kvt_key k = kt_key(i);

    return kvt_async_lookup_lookup(fx->al, &k, ctx);
}

/* mgr.flush(); mgr._results_ready.wait() */
static void flush_wait(struct fx *fx)
{
    assert_int_equal(kvt_async_lookup_flush(fx->al), 0);
    kvt_async_lookup_wait_idle(fx->al);
}

/* Once the worker is idle: batch_lookup ran n times in all. */
static void expect_calls(struct fx *fx, size_t n)
{
    kvt_async_lookup_wait_idle(fx->al);
    assert_int_equal(fx->f.calls, n);
}

static bool has_state(struct fx *fx, int i)
{
    struct kvt_key k = kt_key(i);

    return kvt_async_lookup_state(fx->al, &k, NULL, NULL, NULL) == 0;
}

static void expect_state(struct fx *fx, int i, enum kvt_al_phase phase, int result)
{
    struct kvt_key k = kt_key(i);
    enum kvt_al_phase ph;
    int r;

    assert_int_equal(kvt_async_lookup_state(fx->al, &k, &ph, &r, NULL), 0);
    assert_int_equal(ph, phase);
    assert_int_equal(r, result);
}

static unsigned long gen_of(struct fx *fx, int i)
{
    struct kvt_key k = kt_key(i);
    unsigned long g;

    assert_int_equal(kvt_async_lookup_state(fx->al, &k, NULL, NULL, &g), 0);
    return g;
}

static void mark_miss(struct fx *fx, int i)
{
    struct kvt_key k = kt_key(i);

    kvt_async_lookup_mark_miss(fx->al, &k, 1);
}

/* ---- spans mode (kvtier's: a tier whose lookup is a round trip) --------------- */

/* Items queued behind a call in flight go out together in the next call, in order,
 * and every verdict lands as one at a time would have it. */
static void test_spans_take_every_queued_item_at_once(void **state)
{
    struct fx *fx = FX(2, 5);
    struct kvt_req_ctx *a = fx_ctx(fx, "req_a"), *b = fx_ctx(fx, "req_b");

    (void)state;
    kvt_async_lookup_destroy(fx->al);
    assert_int_equal(
        kvt_async_lookup_create_spans("test", fake_batch_lookup_spans, &fx->f, &fx->al), 0);
    fake_gate(&fx->f);
    lk(fx, 1, a);
    lk(fx, 2, b);
    assert_int_equal(kvt_async_lookup_flush(fx->al), 0); /* item 1: in the gated call */
    fake_wait_in_call(&fx->f);
    for (int i = 3; i <= 5; i++) { /* items 2..4 queue behind it */
        lk(fx, i, i % 2 ? a : b);
        assert_int_equal(kvt_async_lookup_flush(fx->al), 0);
    }
    assert_int_equal(kvt_async_lookup_queue_len(fx->al), 3);
    fake_release(&fx->f);
    kvt_async_lookup_wait_idle(fx->al);
    assert_int_equal(fx->f.calls, 2);
    assert_int_equal(fx->f.call_n[0], 1); /* one item: two requests' keys, one span */
    assert_int_equal(fx->f.call_n[1], 3);
    assert_int_equal(kvt_async_lookup_results_len(fx->al), 4);
    for (int i = 1; i <= 5; i++)
        assert_int_equal(lk(fx, i, a), i == 2 || i == 5 ? KVT_AL_FOUND : KVT_AL_ABSENT);
    assert_int_equal(kvt_async_lookup_results_len(fx->al), 0);
    /* the lists survived: another round goes through */
    lk(fx, 7, b);
    flush_wait(fx);
    assert_int_equal(fx->f.calls, 3);
    assert_int_equal(lk(fx, 7, b), KVT_AL_ABSENT);
    fx_done(fx);
}

/* A failing spans call: every key of every span is not found. */
static void test_spans_failure_is_all_not_found(void **state)
{
    struct fx *fx = FX(1);
    struct kvt_req_ctx *a = fx_ctx(fx, "req_a");

    (void)state;
    kvt_async_lookup_destroy(fx->al);
    assert_int_equal(
        kvt_async_lookup_create_spans("test", fake_batch_lookup_spans, &fx->f, &fx->al), 0);
    fx->f.fail_rc = -EIO;
    lk(fx, 1, a);
    lk(fx, 2, a);
    flush_wait(fx);
    assert_int_equal(lk(fx, 1, a), KVT_AL_ABSENT);
    assert_int_equal(lk(fx, 2, a), KVT_AL_ABSENT);
    assert_int_equal(
        kvt_async_lookup_create_spans("test", NULL, NULL, &(struct kvt_async_lookup *){NULL}),
        -EINVAL);
    fx_done(fx);
}

/* ---- submit mode (the network tier: its loop sends and answers) --------------- */

/* What the fake tier was handed, not yet answered. */
struct submitted {
    const struct kvt_key *keys;
    size_t n;
    bool *found;
    void *token;
};

static struct submitted subs[FAKE_MAX];
static size_t n_subs;

static int fake_submit(void *arg, const struct kvt_key *keys, size_t n, bool *found, void *token)
{
    struct fake *f = arg;

    f->calls++;
    if (f->fail_rc < 0)
        return f->fail_rc;
    assert_true(n_subs < FAKE_MAX);
    subs[n_subs++] = (struct submitted){keys, n, found, token};
    return 0;
}

/* The fake's loop answers submission i. */
static void fake_answer(struct fx *fx, size_t i)
{
    for (size_t k = 0; k < subs[i].n; k++)
        subs[i].found[k] = fake_has(&fx->f, &subs[i].keys[k]);
    kvt_async_lookup_complete(fx->al, subs[i].token);
}

/* Every flush reaches the tier at once, on the caller's thread, whatever is still
 * unanswered (a worker would hold each step's keys behind the round trip before);
 * answers in any order land as their own keys' verdicts at the next lookup. */
static void test_submit_overlaps_round_trips(void **state)
{
    struct fx *fx = FX(2, 3);
    struct kvt_req_ctx *a = fx_ctx(fx, "req_a"), *b = fx_ctx(fx, "req_b");

    (void)state;
    kvt_async_lookup_destroy(fx->al);
    n_subs = 0;
    assert_int_equal(kvt_async_lookup_create_submit("test", fake_submit, &fx->f, &fx->al), 0);
    assert_int_equal(lk(fx, 1, a), KVT_AL_PENDING);
    assert_int_equal(lk(fx, 2, b), KVT_AL_PENDING);
    assert_int_equal(kvt_async_lookup_flush(fx->al), 0);
    assert_int_equal(n_subs, 1); /* handed over in the flush itself */
    assert_int_equal(subs[0].n, 2);
    assert_int_equal(lk(fx, 3, a), KVT_AL_PENDING);
    assert_int_equal(kvt_async_lookup_flush(fx->al), 0);
    assert_int_equal(n_subs, 2); /* the first is still out */
    assert_int_equal(lk(fx, 1, a), KVT_AL_PENDING);
    fake_answer(fx, 1); /* the later step's answer first */
    assert_int_equal(kvt_async_lookup_results_len(fx->al), 1);
    assert_int_equal(kvt_async_lookup_flush(fx->al), 0); /* the next step: drained */
    assert_int_equal(lk(fx, 3, b), KVT_AL_FOUND);
    assert_int_equal(lk(fx, 1, a), KVT_AL_PENDING);
    fake_answer(fx, 0);
    assert_int_equal(kvt_async_lookup_flush(fx->al), 0); /* drains; nothing new to post */
    assert_int_equal(n_subs, 2);
    assert_int_equal(lk(fx, 1, a), KVT_AL_ABSENT);
    assert_int_equal(lk(fx, 2, b), KVT_AL_FOUND);
    kvt_async_lookup_wait_idle(fx->al); /* nothing out: returns */
    assert_true(kvt_async_lookup_worker_alive(fx->al));
    fx_done(fx);
}

/* A submission refused: its keys are not found; one never answered is freed by
 * destroy (ASan: nothing leaks). */
static void test_submit_refused_or_never_answered(void **state)
{
    struct fx *fx = FX(1, 2);
    struct kvt_req_ctx *a = fx_ctx(fx, "req_a");

    (void)state;
    kvt_async_lookup_destroy(fx->al);
    n_subs = 0;
    assert_int_equal(kvt_async_lookup_create_submit("test", fake_submit, &fx->f, &fx->al), 0);
    fx->f.fail_rc = -EIO;
    lk(fx, 1, a);
    assert_int_equal(kvt_async_lookup_flush(fx->al), 0);
    assert_int_equal(lk(fx, 1, a), KVT_AL_ABSENT);
    fx->f.fail_rc = 0;
    lk(fx, 2, a);
    assert_int_equal(kvt_async_lookup_flush(fx->al), 0);
    assert_int_equal(n_subs, 1);
    assert_int_equal(lk(fx, 2, a), KVT_AL_PENDING);
    assert_int_equal(
        kvt_async_lookup_create_submit("test", NULL, NULL, &(struct kvt_async_lookup *){NULL}),
        -EINVAL);
    fx_done(fx);
}

/* ---- vLLM's tests ------------------------------------------------------------ */

static void test_new_key_returns_none(void **state)
{
    struct fx *fx = fx_new(NULL, 0);

    assert_int_equal(lk(fx, 1, fx_ctx(fx, "r1")), KVT_AL_PENDING);
    fx_done(fx);
}

static void test_found_key_returns_true(void **state)
{
    struct fx *fx = FX(1);

    assert_int_equal(lk(fx, 1, fx_ctx(fx, "r1")), KVT_AL_PENDING);
    flush_wait(fx);
    /* A fresh context with the same req_id, as upstream's _ctx(). */
    assert_int_equal(lk(fx, 1, fx_ctx(fx, "r1")), KVT_AL_FOUND);
    fx_done(fx);
}

static void test_not_found_key_returns_false(void **state)
{
    struct fx *fx = fx_new(NULL, 0);

    assert_int_equal(lk(fx, 1, fx_ctx(fx, "r1")), KVT_AL_PENDING);
    flush_wait(fx);
    assert_int_equal(lk(fx, 1, fx_ctx(fx, "r1")), KVT_AL_ABSENT);
    fx_done(fx);
}

static void test_multiple_keys_single_step(void **state)
{
    struct fx *fx = FX(1, 3);
    struct kvt_req_ctx *ctx = fx_ctx(fx, "r1");

    for (int i = 1; i < 5; i++)
        assert_int_equal(lk(fx, i, ctx), KVT_AL_PENDING);
    flush_wait(fx);
    assert_int_equal(lk(fx, 1, ctx), KVT_AL_FOUND);
    assert_int_equal(lk(fx, 2, ctx), KVT_AL_ABSENT);
    assert_int_equal(lk(fx, 3, ctx), KVT_AL_FOUND);
    assert_int_equal(lk(fx, 4, ctx), KVT_AL_ABSENT);
    /* One step, one request: one batch_lookup call with the four keys in order. */
    assert_int_equal(fx->f.calls, 1);
    assert_int_equal(fx->f.call_n[0], 4);
    for (int i = 0; i < 4; i++) {
        struct kvt_key k = kt_key(i + 1);
        assert_true(kvt_key_eq(&fx->f.call_keys[0][i], &k));
    }
    fx_done(fx);
}

static void test_cleanup_removes_entries(void **state)
{
    struct fx *fx = FX(1);
    struct kvt_req_ctx *ctx = fx_ctx(fx, "req_a");

    lk(fx, 1, ctx);
    flush_wait(fx);
    assert_int_equal(lk(fx, 1, ctx), KVT_AL_FOUND);
    kvt_async_lookup_cleanup(fx->al, "req_a");
    assert_false(has_state(fx, 1));
    assert_int_equal(kvt_async_lookup_num_states(fx->al), 0);
    assert_int_equal(kvt_async_lookup_num_reqs(fx->al), 0);
    fx_done(fx);
}

static void test_cleanup_preserves_shared_entries(void **state)
{
    struct fx *fx = FX(1);
    struct kvt_req_ctx *ctx_a = fx_ctx(fx, "req_a");
    struct kvt_req_ctx *ctx_b = fx_ctx(fx, "req_b");

    lk(fx, 1, ctx_a);
    lk(fx, 1, ctx_b);
    flush_wait(fx);
    /* Drain so the result is applied. */
    assert_int_equal(lk(fx, 1, ctx_a), KVT_AL_FOUND);
    kvt_async_lookup_cleanup(fx->al, "req_a");
    /* Still there: req_b references it. */
    assert_true(has_state(fx, 1));
    expect_state(fx, 1, KVT_AL_PHASE_RESOLVED, KVT_AL_FOUND);
    kvt_async_lookup_cleanup(fx->al, "req_b");
    assert_false(has_state(fx, 1));
    /* Shared: one probe for both requests, grouped under the first requester. */
    assert_int_equal(fx->f.calls, 1);
    assert_string_equal(fx->f.call_req[0], "req_a");
    fx_done(fx);
}

static void test_flush_no_queue_post_when_empty(void **state)
{
    struct fx *fx = fx_new(NULL, 0);

    assert_int_equal(kvt_async_lookup_flush(fx->al), 0);
    assert_int_equal(kvt_async_lookup_queue_len(fx->al), 0);
    expect_calls(fx, 0);
    fx_done(fx);
}

static void test_repeated_lookup_same_key_no_duplicate_batch(void **state)
{
    struct fx *fx = FX(1);
    struct kvt_req_ctx *ctx = fx_ctx(fx, "r1");

    lk(fx, 1, ctx);
    lk(fx, 1, ctx);
    assert_int_equal(kvt_async_lookup_batch_len(fx->al), 1);
    fx_done(fx);
}

static void test_cleanup_unknown_req_id_is_noop(void **state)
{
    struct fx *fx = FX(1);
    struct kvt_req_ctx *ctx = fx_ctx(fx, "req_a");

    lk(fx, 1, ctx);
    flush_wait(fx);
    lk(fx, 1, ctx);
    kvt_async_lookup_cleanup(fx->al, "nonexistent");
    assert_true(has_state(fx, 1));
    expect_state(fx, 1, KVT_AL_PHASE_RESOLVED, KVT_AL_FOUND);
    {
        struct kvt_key k = kt_key(1);
        assert_true(kvt_async_lookup_req_has_key(fx->al, "req_a", &k));
    }
    fx_done(fx);
}

static void test_multiple_flushes_across_steps(void **state)
{
    struct fx *fx = FX(1, 2, 3);
    struct kvt_req_ctx *ctx = fx_ctx(fx, "r1");

    /* Step 1: key 1. */
    lk(fx, 1, ctx);
    flush_wait(fx);
    /* Step 2: keys 2 and 3 (the first lookup drains key 1's result). */
    lk(fx, 2, ctx);
    lk(fx, 3, ctx);
    flush_wait(fx);

    assert_int_equal(lk(fx, 1, ctx), KVT_AL_FOUND);
    assert_int_equal(lk(fx, 2, ctx), KVT_AL_FOUND);
    assert_int_equal(lk(fx, 3, ctx), KVT_AL_FOUND);
    /* One queue item per step. */
    assert_int_equal(fx->f.calls, 2);
    assert_int_equal(fx->f.call_n[0], 1);
    assert_int_equal(fx->f.call_n[1], 2);
    fx_done(fx);
}

static void test_shutdown_unblocks_worker(void **state)
{
    struct fx *fx = fx_new(NULL, 0);

    assert_true(kvt_async_lookup_worker_alive(fx->al));
    kvt_async_lookup_shutdown(fx->al);
    assert_false(kvt_async_lookup_worker_alive(fx->al));
    kvt_async_lookup_shutdown(fx->al); /* idempotent */
    assert_false(kvt_async_lookup_worker_alive(fx->al));
    fx_free(fx);
}

/* Failed-load livelock regression (vLLM #49176): after a failed load the tier calls
 * mark_miss(); the cached found turns into absent and stays so without a re-probe,
 * and the entry is kept so cleanup's reverse index stays consistent. */
static void test_mark_miss_flips_cached_verdict_without_reprobing(void **state)
{
    struct fx *fx = FX(1, 2);
    struct kvt_req_ctx *ctx = fx_ctx(fx, "reqA");
    struct kvt_key k1 = kt_key(1), k2 = kt_key(2);

    assert_int_equal(lk(fx, 1, ctx), KVT_AL_PENDING);
    lk(fx, 2, ctx);
    flush_wait(fx);
    assert_int_equal(lk(fx, 1, ctx), KVT_AL_FOUND);

    /* An unknown key: no error, no entry planted. */
    mark_miss(fx, 99);
    assert_false(has_state(fx, 99));
    assert_int_equal(kvt_async_lookup_num_states(fx->al), 2);

    /* The backing set still has key 1, so a re-probe would say found again. */
    mark_miss(fx, 1);
    assert_int_equal(lk(fx, 1, ctx), KVT_AL_ABSENT);
    assert_int_equal(kvt_async_lookup_batch_len(fx->al), 0); /* no fresh probe */
    assert_int_equal(kvt_async_lookup_flush(fx->al), 0);
    assert_int_equal(kvt_async_lookup_queue_len(fx->al), 0); /* nothing posted */
    assert_int_equal(lk(fx, 1, ctx), KVT_AL_ABSENT);
    expect_calls(fx, 1);

    /* Retained as absent with the reverse index intact; cleanup tears both down. */
    expect_state(fx, 1, KVT_AL_PHASE_RESOLVED, KVT_AL_ABSENT);
    assert_true(kvt_async_lookup_req_has_key(fx->al, "reqA", &k1));
    assert_true(kvt_async_lookup_req_has_key(fx->al, "reqA", &k2));
    kvt_async_lookup_cleanup(fx->al, "reqA");
    assert_false(has_state(fx, 1));
    assert_false(has_state(fx, 2));
    assert_false(kvt_async_lookup_req_has_key(fx->al, "reqA", &k1));
    assert_int_equal(kvt_async_lookup_num_reqs(fx->al), 0);
    fx_done(fx);
}

static void drain_stray_result(void *arg)
{
    struct fx *fx = arg;
    struct kvt_key k = kt_key(1);

    /* A duplicate result for the decided generation. */
    if (kvt__async_lookup_inject_result(fx->al, &k, gen_of(fx, 1), true) == 0)
        kvt_async_lookup_drain_results(fx->al);
}

/* A generation is probed once, so drain sees at most one result for it; a second
 * one for a decided key asserts (a silent overwrite could flip a corrected miss). */
static void test_enqueue_once_invariant_enforced(void **state)
{
    struct fx *fx = FX(1);
    struct kvt_req_ctx *ctx = fx_ctx(fx, "reqA");

    /* (a) Normal operation: enqueued once, decided once, nothing left pending. */
    assert_int_equal(lk(fx, 1, ctx), KVT_AL_PENDING);
    flush_wait(fx);
    assert_int_equal(lk(fx, 1, ctx), KVT_AL_FOUND);
    assert_int_equal(kvt_async_lookup_results_len(fx->al), 0);
    assert_int_equal(fx->f.calls, 1);

    /* (b) A stray second result trips the assertion (in a forked child). */
    assert_true(kt_expect_abort(drain_stray_result, fx));
    /* The same after mark_miss: a stray found must not undo the miss silently. */
    mark_miss(fx, 1);
    assert_true(kt_expect_abort(drain_stray_result, fx));
    expect_state(fx, 1, KVT_AL_PHASE_RESOLVED, KVT_AL_ABSENT);
    fx_done(fx);
}

/* ---- vLLM's remaining rules -------------------------------------------------- */

/* Each new state gets the next generation; a result stamped with an older one
 * (the key was cleaned up and looked up again) is ignored. */
static void test_stale_generation_result_ignored(void **state)
{
    struct fx *fx = FX(1);
    struct kvt_req_ctx *a = fx_ctx(fx, "req_a"), *b = fx_ctx(fx, "req_b");

    lk(fx, 1, a);
    lk(fx, 2, a);
    assert_int_equal(gen_of(fx, 1), 0);
    assert_int_equal(gen_of(fx, 2), 1);
    /* Cleaned up while still PENDING: freed; re-looked-up: a new generation. */
    kvt_async_lookup_cleanup(fx->al, "req_a");
    assert_int_equal(kvt_async_lookup_num_states(fx->al), 0);
    assert_int_equal(lk(fx, 1, b), KVT_AL_PENDING);
    assert_int_equal(gen_of(fx, 1), 2);
    assert_int_equal(kvt_async_lookup_batch_len(fx->al), 3);
    /* The flush drops the batch entries of the freed generations. */
    flush_wait(fx);
    assert_int_equal(fx->f.calls, 1);
    assert_string_equal(fx->f.call_req[0], "req_b");
    assert_int_equal(fx->f.call_n[0], 1);

    /* A late result of generation 0 (absent) must not decide generation 2. */
    {
        struct kvt_key k = kt_key(1);
        assert_int_equal(kvt__async_lookup_inject_result(fx->al, &k, 0, false), 0);
    }
    kvt_async_lookup_drain_results(fx->al);
    expect_state(fx, 1, KVT_AL_PHASE_RESOLVED, KVT_AL_FOUND);
    assert_int_equal(lk(fx, 1, b), KVT_AL_FOUND);
    fx_done(fx);
}

/* An in-flight state whose requests all finished stays until its result arrives,
 * and a new request shares the probe instead of issuing another. */
static void test_in_flight_orphan_retained_and_shared(void **state)
{
    struct fx *fx = FX(1);
    struct kvt_req_ctx *a = fx_ctx(fx, "req_a"), *b = fx_ctx(fx, "req_b");

    fake_gate(&fx->f);
    lk(fx, 1, a);
    assert_int_equal(kvt_async_lookup_flush(fx->al), 0);
    fake_wait_in_call(&fx->f);
    assert_int_equal(kvt_async_lookup_queue_len(fx->al), 0); /* taken by the worker */
    expect_state(fx, 1, KVT_AL_PHASE_IN_FLIGHT, KVT_AL_PENDING);

    kvt_async_lookup_cleanup(fx->al, "req_a");
    assert_true(has_state(fx, 1));
    assert_int_equal(lk(fx, 1, b), KVT_AL_PENDING);
    assert_int_equal(kvt_async_lookup_batch_len(fx->al), 0);

    fake_release(&fx->f);
    kvt_async_lookup_wait_idle(fx->al);
    assert_int_equal(lk(fx, 1, b), KVT_AL_PENDING); /* this step already drained */
    assert_int_equal(kvt_async_lookup_flush(fx->al), 0);
    assert_int_equal(lk(fx, 1, b), KVT_AL_FOUND);
    assert_int_equal(fx->f.calls, 1);
    fx_done(fx);
}

static void test_in_flight_orphan_freed_when_result_arrives(void **state)
{
    struct fx *fx = fx_new(NULL, 0);

    fake_gate(&fx->f);
    lk(fx, 1, fx_ctx(fx, "req_a"));
    assert_int_equal(kvt_async_lookup_flush(fx->al), 0);
    fake_wait_in_call(&fx->f);
    kvt_async_lookup_cleanup(fx->al, "req_a");
    assert_int_equal(kvt_async_lookup_num_states(fx->al), 1);
    assert_int_equal(kvt_async_lookup_num_reqs(fx->al), 0);
    fake_release(&fx->f);
    kvt_async_lookup_wait_idle(fx->al);
    assert_int_equal(kvt_async_lookup_results_len(fx->al), 1);
    kvt_async_lookup_drain_results(fx->al);
    assert_int_equal(kvt_async_lookup_num_states(fx->al), 0);
    fx_done(fx);
}

/* Results are drained at the first lookup after a flush and at every flush: one
 * that lands after step N+1's first lookup is seen only in step N+2. */
static void test_result_drained_at_first_lookup_or_next_flush(void **state)
{
    struct fx *fx = FX(1, 2);
    struct kvt_req_ctx *ctx = fx_ctx(fx, "r1");

    /* Step N. */
    fake_gate(&fx->f);
    lk(fx, 1, ctx);
    assert_int_equal(kvt_async_lookup_flush(fx->al), 0);
    fake_wait_in_call(&fx->f);
    /* Step N+1: the first lookup drains (nothing yet) ... */
    assert_int_equal(lk(fx, 1, ctx), KVT_AL_PENDING);
    fake_release(&fx->f);
    kvt_async_lookup_wait_idle(fx->al);
    /* ... and later ones in the step do not. */
    assert_int_equal(lk(fx, 1, ctx), KVT_AL_PENDING);
    assert_int_equal(lk(fx, 2, ctx), KVT_AL_PENDING);
    assert_int_equal(kvt_async_lookup_results_len(fx->al), 1);
    kvt_async_lookup_flush(fx->al); /* drains key 1, posts key 2 */
    kvt_async_lookup_wait_idle(fx->al);
    /* Step N+2: key 1 decided at the flush, key 2 at this first lookup. */
    assert_int_equal(lk(fx, 1, ctx), KVT_AL_FOUND);
    assert_int_equal(lk(fx, 2, ctx), KVT_AL_FOUND);
    fx_done(fx);
}

/* The worker calls batch_lookup once per req_id, in first-seen order, with that
 * request's keys in order, and posts one result list for the whole item. */
static void test_worker_groups_keys_by_request(void **state)
{
    struct fx *fx = FX(2, 3);
    struct kvt_req_ctx *a = fx_ctx(fx, "req_a"), *b = fx_ctx(fx, "req_b");
    struct kvt_req_ctx *a2 = fx_ctx(fx, "req_a"); /* another context, same request */
    struct kvt_key k;

    fake_gate(&fx->f);
    lk(fx, 1, a);
    lk(fx, 2, b);
    lk(fx, 3, a2);
    lk(fx, 2, a); /* shared with req_b: not enqueued again */
    assert_int_equal(kvt_async_lookup_batch_len(fx->al), 3);
    assert_int_equal(kvt_async_lookup_flush(fx->al), 0);
    fake_wait_in_call(&fx->f);
    fake_release(&fx->f);
    kvt_async_lookup_wait_idle(fx->al);
    assert_int_equal(kvt_async_lookup_results_len(fx->al), 1);

    assert_int_equal(fx->f.calls, 2);
    assert_string_equal(fx->f.call_req[0], "req_a");
    assert_int_equal(fx->f.call_n[0], 2);
    k = kt_key(1);
    assert_true(kvt_key_eq(&fx->f.call_keys[0][0], &k));
    k = kt_key(3);
    assert_true(kvt_key_eq(&fx->f.call_keys[0][1], &k));
    assert_string_equal(fx->f.call_req[1], "req_b");
    assert_int_equal(fx->f.call_n[1], 1);
    k = kt_key(2);
    assert_true(kvt_key_eq(&fx->f.call_keys[1][0], &k));

    assert_int_equal(lk(fx, 1, a), KVT_AL_ABSENT);
    assert_int_equal(lk(fx, 2, a), KVT_AL_FOUND);
    assert_int_equal(lk(fx, 3, b), KVT_AL_FOUND);
    fx_done(fx);
}

/* Runs fn with stderr sent to a file; returns what was written (caller frees). */
static char *capture_stderr(void (*fn)(struct fx *), struct fx *fx)
{
    char path[] = "/tmp/kvt-al-log.XXXXXX";
    int fd = mkstemp(path), saved;
    char *buf = calloc(1, 4096);
    ssize_t n;

    assert_true(fd >= 0);
    assert_non_null(buf);
    fflush(stderr);
    saved = dup(STDERR_FILENO);
    assert_true(saved >= 0);
    assert_true(dup2(fd, STDERR_FILENO) >= 0);
    fn(fx);
    fflush(stderr);
    assert_true(dup2(saved, STDERR_FILENO) >= 0);
    close(saved);
    n = pread(fd, buf, 4095, 0);
    assert_true(n >= 0);
    close(fd);
    unlink(path);
    return buf;
}

static void failing_step(struct fx *fx)
{
    flush_wait(fx);
}

/* A failed batch_lookup: every key of that call is not found, with a warning; the
 * other requests of the item are unaffected. */
static void test_failed_batch_is_all_not_found(void **state)
{
    struct fx *fx = FX(1, 2, 3);
    struct kvt_req_ctx *a = fx_ctx(fx, "req_a");
    char *log;

    lk(fx, 1, a);
    lk(fx, 2, a);
    fx->f.fail_rc = -EIO; /* the worker is idle: ordered by the flush */
    log = capture_stderr(failing_step, fx);
    assert_non_null(strstr(log, "batch_lookup failed on tier test for 2 keys"));
    free(log);
    assert_int_equal(lk(fx, 1, a), KVT_AL_ABSENT);
    assert_int_equal(lk(fx, 2, a), KVT_AL_ABSENT);
    expect_state(fx, 1, KVT_AL_PHASE_RESOLVED, KVT_AL_ABSENT);

    /* The verdict is cached: no retry even when the tier recovers. */
    fx->f.fail_rc = 0;
    lk(fx, 3, a);
    flush_wait(fx);
    assert_int_equal(lk(fx, 1, a), KVT_AL_ABSENT);
    assert_int_equal(lk(fx, 3, a), KVT_AL_FOUND);
    assert_int_equal(fx->f.calls, 2);
    fx_done(fx);
}

/* mark_miss on a key whose probe is in flight: the miss sticks when the (found)
 * result arrives, instead of vLLM's assertion. */
static void test_mark_miss_in_flight_sticks(void **state)
{
    struct fx *fx = FX(1);
    struct kvt_req_ctx *ctx = fx_ctx(fx, "r1");

    fake_gate(&fx->f);
    lk(fx, 1, ctx);
    assert_int_equal(kvt_async_lookup_flush(fx->al), 0);
    fake_wait_in_call(&fx->f);
    mark_miss(fx, 1);
    assert_int_equal(lk(fx, 1, ctx), KVT_AL_ABSENT);
    fake_release(&fx->f);
    kvt_async_lookup_wait_idle(fx->al);
    kvt_async_lookup_drain_results(fx->al);
    expect_state(fx, 1, KVT_AL_PHASE_RESOLVED, KVT_AL_ABSENT);
    assert_int_equal(lk(fx, 1, ctx), KVT_AL_ABSENT);
    /* That was its one result: another one is a duplicate again. */
    assert_true(kt_expect_abort(drain_stray_result, fx));
    fx_done(fx);
}

/* mark_miss on a key still in this step's batch: the flush does not probe it. */
static void test_mark_miss_pending_skips_probe(void **state)
{
    struct fx *fx = FX(1);
    struct kvt_req_ctx *ctx = fx_ctx(fx, "r1");

    lk(fx, 1, ctx);
    mark_miss(fx, 1);
    assert_int_equal(kvt_async_lookup_flush(fx->al), 0);
    assert_int_equal(kvt_async_lookup_queue_len(fx->al), 0);
    assert_int_equal(kvt_async_lookup_batch_len(fx->al), 0);
    expect_calls(fx, 0);
    assert_int_equal(lk(fx, 1, ctx), KVT_AL_ABSENT);
    fx_done(fx);
}

/* shutdown lets the worker finish what was posted and drains it. */
static void test_shutdown_finishes_posted_items(void **state)
{
    struct fx *fx = FX(1);
    struct kvt_req_ctx *ctx = fx_ctx(fx, "r1");

    lk(fx, 1, ctx);
    lk(fx, 2, ctx);
    assert_int_equal(kvt_async_lookup_flush(fx->al), 0);
    kvt_async_lookup_shutdown(fx->al);
    expect_state(fx, 1, KVT_AL_PHASE_RESOLVED, KVT_AL_FOUND);
    expect_state(fx, 2, KVT_AL_PHASE_RESOLVED, KVT_AL_ABSENT);
    /* After shutdown nothing is probed; destroy frees what is left. */
    lk(fx, 3, ctx);
    assert_int_equal(kvt_async_lookup_flush(fx->al), 0);
    assert_int_equal(kvt_async_lookup_queue_len(fx->al), 1);
    kvt_async_lookup_wait_idle(fx->al); /* returns: no worker */
    expect_state(fx, 3, KVT_AL_PHASE_IN_FLIGHT, KVT_AL_PENDING);
    fx_free(fx);
}

/* Every allocation of lookup and flush may fail; nothing changes when one does. */
static void test_allocation_failures_unwind(void **state)
{
    struct fx *fx = FX(1);
    struct kvt_req_ctx *ctx = fx_ctx(fx, "r1");
    long n;
    int rc;

    for (n = 0;; n++) {
        kvt_alloc_fail_after(n);
        rc = lk(fx, 1, ctx);
        kvt_alloc_fail_after(-1);
        if (rc != -ENOMEM)
            break;
        assert_int_equal(kvt_async_lookup_num_states(fx->al), 0);
        assert_int_equal(kvt_async_lookup_num_reqs(fx->al), 0);
        assert_int_equal(kvt_async_lookup_batch_len(fx->al), 0);
    }
    assert_true(n > 0);
    assert_int_equal(rc, KVT_AL_PENDING);
    assert_int_equal(kvt_async_lookup_batch_len(fx->al), 1);

    for (n = 0;; n++) {
        kvt_alloc_fail_after(n);
        rc = kvt_async_lookup_flush(fx->al);
        kvt_alloc_fail_after(-1);
        if (rc != -ENOMEM)
            break;
        assert_int_equal(kvt_async_lookup_batch_len(fx->al), 1);
        assert_int_equal(kvt_async_lookup_queue_len(fx->al), 0);
        expect_state(fx, 1, KVT_AL_PHASE_PENDING, KVT_AL_PENDING);
    }
    assert_true(n > 0);
    assert_int_equal(rc, 0);
    kvt_async_lookup_wait_idle(fx->al);
    assert_int_equal(lk(fx, 1, ctx), KVT_AL_FOUND);
    assert_int_equal(fx->f.calls, 1);
    fx_done(fx);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_new_key_returns_none),
        cmocka_unit_test(test_found_key_returns_true),
        cmocka_unit_test(test_not_found_key_returns_false),
        cmocka_unit_test(test_multiple_keys_single_step),
        cmocka_unit_test(test_cleanup_removes_entries),
        cmocka_unit_test(test_cleanup_preserves_shared_entries),
        cmocka_unit_test(test_flush_no_queue_post_when_empty),
        cmocka_unit_test(test_repeated_lookup_same_key_no_duplicate_batch),
        cmocka_unit_test(test_cleanup_unknown_req_id_is_noop),
        cmocka_unit_test(test_multiple_flushes_across_steps),
        cmocka_unit_test(test_shutdown_unblocks_worker),
        cmocka_unit_test(test_mark_miss_flips_cached_verdict_without_reprobing),
        cmocka_unit_test(test_enqueue_once_invariant_enforced),
        cmocka_unit_test(test_stale_generation_result_ignored),
        cmocka_unit_test(test_in_flight_orphan_retained_and_shared),
        cmocka_unit_test(test_in_flight_orphan_freed_when_result_arrives),
        cmocka_unit_test(test_result_drained_at_first_lookup_or_next_flush),
        cmocka_unit_test(test_worker_groups_keys_by_request),
        cmocka_unit_test(test_failed_batch_is_all_not_found),
        cmocka_unit_test(test_mark_miss_in_flight_sticks),
        cmocka_unit_test(test_mark_miss_pending_skips_probe),
        cmocka_unit_test(test_shutdown_finishes_posted_items),
        cmocka_unit_test(test_allocation_failures_unwind),
        cmocka_unit_test(test_spans_take_every_queued_item_at_once),
        cmocka_unit_test(test_spans_failure_is_all_not_found),
        cmocka_unit_test(test_submit_overlaps_round_trips),
        cmocka_unit_test(test_submit_refused_or_never_answered),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

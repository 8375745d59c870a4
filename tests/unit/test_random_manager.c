/* Randomized manager test: long random sequences of engine calls (many requests,
 * three example tiers with delays, RETRYs, request-level policy and random
 * failures) with the invariants checked after every step:
 *   - ref counts are -1 or >= 0; counters equal a recount; slots add up;
 *   - nothing pinned or write-pending is ever evicted;
 *   - every loaded row holds exactly the bytes stored for its key;
 *   - every job is reported (the manager asserts on unknown or repeated reports)
 *     and at the end no job, pin or pending write is left;
 *   - every finished request is finalized exactly once in every tier.
 * Runs under ASan (leaks) and TSan. KVT_RANDOM_SEEDS / KVT_RANDOM_STEPS scale it. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "test_util.h"

#include "kvt/example_tier.h"
#include "kvt/hash.h"
#include "kvt/manager.h"

#define NUM_CHUNKS  24
#define ROW         64
#define KEYSPACE    80
#define MAX_REQS    6
#define N_TIERS     3
#define MAX_SERIALS 65536

struct rreq {
    struct kvt_req_ctx *ctx;
    bool live, finished;
    /* a prepared store not yet completed */
    struct kvt_key store_keys[8];
    size_t n_store_keys;
    bool store_pending;
    /* loads held across steps */
    struct kvt_key load_keys[8];
    size_t n_load;
};

struct world {
    struct kvt_manager *m;
    struct kvt_primary *p;
    struct kvt_tier *tiers[N_TIERS];
    struct rreq reqs[MAX_REQS];
    unsigned next_req;
    uint64_t rng;
    struct kvt_store_output out;
    /* finalization counts per tier for each request id (by serial) */
    unsigned finishes[N_TIERS][MAX_SERIALS];
    unsigned finished_reqs[MAX_SERIALS];
    unsigned n_finished_reqs;
    unsigned long loads_verified, evictions, promotions_seen;
};

static struct world *W;

static uint64_t rnd(struct world *w)
{
    w->rng ^= w->rng << 13;
    w->rng ^= w->rng >> 7;
    w->rng ^= w->rng << 17;
    return w->rng;
}

static unsigned rnd_n(struct world *w, unsigned n)
{
    return (unsigned)(rnd(w) % n);
}

/* Zipf-ish popularity: small ids far more often. */
static struct kvt_key pick_key(struct world *w)
{
    unsigned a = rnd_n(w, KEYSPACE), b = rnd_n(w, KEYSPACE);
    return kt_key((int)(a < b ? a : b));
}

static void fill_row(uint8_t *row, const struct kvt_key *k)
{
    uint64_t h = kvt_key_hash(k);
    for (size_t i = 0; i < ROW; i += 8)
        memcpy(row + i, &h, 8);
}

static unsigned serial_of(const char *req_id)
{
    return (unsigned)atoi(req_id + 2);
}

static void on_call(void *arg, struct kvt_tier *t, enum kvt_example_call call,
                    const struct kvt_job *job, struct kvt_req_ctx *ctx, const struct kvt_key *keys,
                    size_t n)
{
    struct world *w = arg;
    if (call == KVT_EX_ON_REQUEST_FINISHED)
        w->finishes[t->index][serial_of(ctx->req_id) % MAX_SERIALS]++;
    if (call == KVT_EX_SUBMIT_LOAD)
        w->promotions_seen++;
}

struct recount {
    size_t evictable, pending, entries;
};

static void count_entry(void *arg, const struct kvt_key *key,
                        const struct kvt_primary_entry_info *info)
{
    struct recount *r = arg;
    assert_true(info->ref_cnt >= -1);
    assert_true(info->slot >= 0 && info->slot < NUM_CHUNKS);
    r->entries++;
    r->evictable += info->ref_cnt == 0;
    r->pending += info->ref_cnt == -1;
}

static void check_invariants(struct world *w)
{
    struct recount r = {0};
    kvt_primary_for_each(w->p, count_entry, &r);
    assert_int_equal(r.evictable, kvt_primary_num_evictable(w->p));
    assert_int_equal(r.pending, kvt_primary_num_write_pending(w->p));
    assert_int_equal(r.entries, kvt_primary_num_entries(w->p));
    assert_int_equal(r.entries + kvt_primary_num_free(w->p), NUM_CHUNKS);
}

static bool engine_holds(struct world *w, const struct kvt_key *k)
{
    for (int i = 0; i < MAX_REQS; i++) {
        struct rreq *q = &w->reqs[i];
        if (!q->live)
            continue;
        for (size_t j = 0; j < q->n_load; j++)
            if (kvt_key_eq(&q->load_keys[j], k))
                return true; /* pinned by a GPU load */
        for (size_t j = 0; q->store_pending && j < q->n_store_keys; j++)
            if (kvt_key_eq(&q->store_keys[j], k))
                return true; /* GPU -> primary write in flight */
    }
    return false;
}

static void do_store(struct world *w, struct rreq *q)
{
    struct kvt_key keys[8];
    size_t n = 1 + rnd_n(w, 6);
    for (size_t i = 0; i < n; i++)
        keys[i] = pick_key(w);
    int rc = kvt_manager_prepare_store(w->m, keys, n, q->ctx, &w->out);
    if (rc == -ENOSPC)
        return;
    assert_int_equal(rc, 0);
    for (size_t e = 0; e < w->out.n_evicted; e++) {
        const struct kvt_key *ek = &w->out.evicted[e];
        /* Never a chunk the engine has pinned or is writing, never one this call
         * offered (the protected set), and it is gone now. */
        assert_false(engine_holds(w, ek));
        for (size_t j = 0; j < n; j++)
            assert_false(kvt_key_eq(&keys[j], ek));
        w->evictions++;
    }
    if (w->out.n_store == 0)
        return;
    /* The engine copies GPU -> slots now. */
    uint8_t *base = kvt_primary_base(w->p);
    for (size_t i = 0; i < w->out.n_store; i++)
        fill_row(base + (size_t)w->out.chunk_ids[i] * ROW, &w->out.keys_to_store[i]);
    if (q->store_pending) {
        /* One outstanding store per request in this model: complete it now. */
        assert_int_equal(kvt_manager_complete_store(w->m, w->out.keys_to_store, w->out.n_store,
                                                    q->ctx, rnd_n(w, 10) != 0),
                         0);
        return;
    }
    memcpy(q->store_keys, w->out.keys_to_store, w->out.n_store * sizeof(struct kvt_key));
    q->n_store_keys = w->out.n_store;
    q->store_pending = true;
}

static void do_lookup_and_load(struct world *w, struct rreq *q)
{
    struct kvt_key prefix[8];
    size_t n = 1 + rnd_n(w, 8), hits = 0;
    int64_t ids[8];
    for (size_t i = 0; i < n; i++)
        prefix[i] = pick_key(w);
    /* the scheduler's scan: HIT counts; HIT_PENDING/RETRY defer but continue. Half
     * the scans ask through the many-key lookup (the engine API's path): it must
     * answer as the one-key calls, or the loads below fail or read wrong bytes. */
    enum kvt_lookup_result res[8];
    bool defer = false, many = rnd_n(w, 2) == 0;
    for (size_t done = 0; many && done < n;) {
        done += kvt_manager_lookup_many(w->m, prefix + done, n - done, q->ctx, true, res + done);
        if (res[done - 1] == KVT_MISS)
            break;
    }
    for (size_t i = 0; i < n; i++) {
        enum kvt_lookup_result r = many ? res[i] : kvt_manager_lookup(w->m, &prefix[i], q->ctx);
        if (r == KVT_MISS)
            break;
        if (r != KVT_HIT)
            defer = true;
        else if (!defer)
            hits = i + 1;
    }
    /* A deferred scan loads nothing this step (the connector retries the request
     * next step): the promotions it started may have evicted its earlier hits. */
    if (defer || hits == 0 || q->n_load > 0)
        return;
    /* prepare_load takes only keys confirmed HIT this step, without duplicates */
    size_t m = 0;
    for (size_t i = 0; i < hits; i++) {
        bool dup = false;
        for (size_t j = 0; j < m; j++)
            dup |= kvt_key_eq(&q->load_keys[j], &prefix[i]);
        if (!dup)
            q->load_keys[m++] = prefix[i];
    }
    assert_int_equal(kvt_manager_prepare_load(w->m, q->load_keys, m, q->ctx, ids), 0);
    uint8_t *base = kvt_primary_base(w->p), want[ROW];
    for (size_t i = 0; i < m; i++) {
        fill_row(want, &q->load_keys[i]);
        assert_memory_equal(base + (size_t)ids[i] * ROW, want, ROW);
        w->loads_verified++;
    }
    q->n_load = m;
}

static void finish_loads(struct world *w, struct rreq *q)
{
    if (q->n_load) {
        assert_int_equal(kvt_manager_complete_load(w->m, q->load_keys, q->n_load, q->ctx), 0);
        q->n_load = 0;
    }
}

static void finish_store(struct world *w, struct rreq *q)
{
    if (q->store_pending) {
        assert_int_equal(kvt_manager_complete_store(w->m, q->store_keys, q->n_store_keys, q->ctx,
                                                    rnd_n(w, 10) != 0),
                         0);
        q->store_pending = false;
    }
}

static void step_world(struct world *w)
{
    for (int op = 0; op < 6; op++) {
        struct rreq *q = &w->reqs[rnd_n(w, MAX_REQS)];
        if (!q->live) {
            char id[32];
            snprintf(id, sizeof(id), "r-%u", w->next_req++);
            q->ctx = kt_ctx(id);
            memset(&q->store_keys, 0, sizeof(q->store_keys));
            q->live = true;
            q->finished = false;
            q->n_load = 0;
            q->store_pending = false;
            assert_int_equal(kvt_manager_on_new_request(w->m, q->ctx, NULL), 0);
            continue;
        }
        switch (rnd_n(w, 7)) {
        case 0:
        case 1:
            if (!q->finished)
                do_lookup_and_load(w, q);
            break;
        case 2:
            if (!q->finished)
                do_store(w, q);
            break;
        case 3:
            finish_store(w, q);
            break;
        case 4:
            finish_loads(w, q);
            break;
        case 5:
            if (q->n_load)
                kvt_manager_touch(w->m, q->load_keys, q->n_load, q->ctx);
            break;
        case 6:
            if (!q->finished) {
                assert_int_equal(kvt_manager_on_request_finished(w->m, q->ctx), 0);
                q->finished = true;
                w->finished_reqs[w->n_finished_reqs++ % MAX_SERIALS] = serial_of(q->ctx->req_id);
            } else if (!q->store_pending) {
                finish_loads(w, q);
                kvt_req_ctx_unref(q->ctx);
                q->live = false;
            }
            break;
        }
    }
    kvt_manager_on_schedule_end(w->m, NULL);
    struct kvt_events ev;
    kvt_events_init(&ev);
    assert_int_equal(kvt_manager_take_events(w->m, &ev), 0);
    kvt_events_cleanup(&ev);
    check_invariants(w);
}

static void run_seed(uint64_t seed, unsigned steps)
{
    struct world *w = calloc(1, sizeof(*w));
    struct kvt_primary_config pc = {.num_chunks = NUM_CHUNKS,
                                    .row_bytes = ROW,
                                    .policy = seed % 2 ? "arc" : "lru",
                                    .enable_events = true};
    struct kvt_example_tier_config tc[N_TIERS] = {
        {.type = "slow", .delay_polls = 2, .fail_rate = 0.1, .copy_bytes = true},
        {.type = "retry", .retry_first_lookup = true, .copy_bytes = true, .fail_rate = 0.05},
        {.type = "reqlevel", .request_level = true, .copy_bytes = true, .delay_polls = 1},
    };
    W = w;
    w->rng = seed * 2654435761u + 7;
    assert_int_equal(kvt_primary_create(&pc, NULL, &w->p), 0);
    for (int i = 0; i < N_TIERS; i++) {
        tc[i].seed = (unsigned)(seed + (uint64_t)i);
        tc[i].on_call = on_call;
        tc[i].cb_arg = w;
        assert_int_equal(kvt_example_tier_create(&tc[i], &w->tiers[i]), 0);
    }
    assert_int_equal(kvt_manager_create(w->p, w->tiers, N_TIERS, &w->m), 0);
    kvt_store_output_init(&w->out);

    for (unsigned s = 0; s < steps; s++) {
        step_world(w);
        if (s % 500 == 499) {
            /* reset_cache as at sleep: flush GPU loads, forget stores in flight */
            for (int i = 0; i < MAX_REQS; i++) {
                if (w->reqs[i].live) {
                    finish_loads(w, &w->reqs[i]);
                    w->reqs[i].store_pending = false;
                }
            }
            assert_int_equal(kvt_manager_reset_cache(w->m), 0);
            check_invariants(w);
        }
    }
    /* Wind down: finish everything and step until idle. */
    for (int i = 0; i < MAX_REQS; i++) {
        struct rreq *q = &w->reqs[i];
        if (!q->live)
            continue;
        finish_loads(w, q);
        finish_store(w, q);
        if (!q->finished) {
            assert_int_equal(kvt_manager_on_request_finished(w->m, q->ctx), 0);
            w->finished_reqs[w->n_finished_reqs++ % MAX_SERIALS] = serial_of(q->ctx->req_id);
        }
        kvt_req_ctx_unref(q->ctx);
        q->live = false;
    }
    for (int i = 0; i < 20 && kvt_manager_has_pending_work(w->m); i++)
        kvt_manager_on_schedule_end(w->m, NULL);
    assert_false(kvt_manager_has_pending_work(w->m));
    assert_int_equal(kvt_manager_num_jobs(w->m), 0);
    assert_int_equal(kvt_manager_num_requests(w->m), 0);
    assert_int_equal(kvt_primary_num_write_pending(w->p), 0);
    assert_int_equal(kvt_primary_num_evictable(w->p), kvt_primary_num_entries(w->p));
    check_invariants(w);
    for (unsigned i = 0; i < w->n_finished_reqs && i < MAX_SERIALS; i++) {
        unsigned sr = w->finished_reqs[i];
        for (int t = 0; t < N_TIERS; t++)
            assert_int_equal(w->finishes[t][sr % MAX_SERIALS], 1);
    }
    print_message("seed %llu (%s): %u steps, %lu loads verified, %lu evictions, %lu promotions\n",
                  (unsigned long long)seed, pc.policy, steps, w->loads_verified, w->evictions,
                  w->promotions_seen);
    assert_true(w->loads_verified > 0 && w->evictions > 0 && w->promotions_seen > 0);
    assert_int_equal(kvt_manager_shutdown(w->m), 0);
    kvt_manager_destroy(w->m);
    kvt_store_output_cleanup(&w->out);
    free(w);
}

static void test_random_operation_sequences(void **state)
{
    const char *s = getenv("KVT_RANDOM_SEEDS"), *n = getenv("KVT_RANDOM_STEPS");
    unsigned seeds = s ? (unsigned)atoi(s) : 6, steps = n ? (unsigned)atoi(n) : 3000;
    for (unsigned i = 1; i <= seeds; i++)
        run_seed(i, steps);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_random_operation_sequences),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

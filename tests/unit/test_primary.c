/* SPDX-License-Identifier: Apache-2.0 */
/* The CPU primary tier against vLLM's tests/v1/kv_offload/cpu/test_manager.py,
 * then what the C contract adds: misuse is -EINVAL and changes
 * nothing, generations, checksums, duplicate keys, the index under churn.
 *
 * Keys are kt_key(i) = make_offload_key(str(i).encode(), 0), as upstream.
 * Deviations from upstream, on purpose:
 * - num_chunks 0 is a configuration error here (-EINVAL), not an empty cache;
 * - store_threshold is not implemented (TieringOffloadingSpec rejects it), so
 *   test_filter_reused_manager* have no port. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "test_util.h"

#include "kvt/alloc.h"
#include "kvt/alloc_test.h"
#include "kvt/hash.h"
#include "kvt/metrics.h"
#include "kvt/primary.h"
#include "kvt/primary_test.h"

#define MAXK 32

struct fx {
    struct kvt_primary *p;
    struct kvt_store_output out;
    struct kvt_events ev;
};

static struct fx *fx_make(size_t n, const char *policy, bool events, size_t row_bytes)
{
    struct fx *f = calloc(1, sizeof(*f));
    struct kvt_primary_config pc = {
        .num_chunks = n, .row_bytes = row_bytes, .policy = policy, .enable_events = events};
    assert_non_null(f);
    assert_int_equal(kvt_primary_create(&pc, NULL, &f->p), 0);
    kvt_store_output_init(&f->out);
    kvt_events_init(&f->ev);
    return f;
}

static void fx_free(struct fx *f)
{
    kvt_primary_destroy(f->p);
    kvt_store_output_cleanup(&f->out);
    kvt_events_cleanup(&f->ev);
    free(f);
}

/* keys from a list of ints terminated by -1 */
static size_t ks(struct kvt_key *out, const int *ids)
{
    size_t n = 0;
    while (ids[n] >= 0) {
        out[n] = kt_key(ids[n]);
        n++;
    }
    return n;
}
#define KEYS(out, ...) ks(out, (const int[]){__VA_ARGS__, -1})

static int prep(struct fx *f, const int *ids)
{
    struct kvt_key k[MAXK];
    size_t n = ks(k, ids);
    return kvt_primary_prepare_store(f->p, k, n, &f->out);
}
#define PREP(f, ...) prep(f, (const int[]){__VA_ARGS__, -1})

static void complete(struct fx *f, bool ok, const int *ids)
{
    struct kvt_key k[MAXK];
    size_t n = ks(k, ids);
    assert_int_equal(kvt_primary_complete_store(f->p, k, n, ok), 0);
}
#define COMPLETE(f, ...)      complete(f, true, (const int[]){__VA_ARGS__, -1})
#define COMPLETE_FAIL(f, ...) complete(f, false, (const int[]){__VA_ARGS__, -1})

static void touch(struct fx *f, const int *ids)
{
    struct kvt_key k[MAXK];
    size_t n = ks(k, ids);
    kvt_primary_touch(f->p, k, n);
}
#define TOUCH(f, ...) touch(f, (const int[]){__VA_ARGS__, -1})

static int load(struct fx *f, int64_t *chunk_ids, const int *ids)
{
    struct kvt_key k[MAXK];
    size_t n = ks(k, ids);
    return kvt_primary_prepare_load(f->p, k, n, chunk_ids);
}
#define LOAD(f, c, ...) load(f, c, (const int[]){__VA_ARGS__, -1})

static int unload(struct fx *f, const int *ids)
{
    struct kvt_key k[MAXK];
    size_t n = ks(k, ids);
    return kvt_primary_complete_load(f->p, k, n);
}
#define UNLOAD(f, ...) unload(f, (const int[]){__VA_ARGS__, -1})

static enum kvt_lookup_result look(struct fx *f, int i)
{
    struct kvt_key k = kt_key(i);
    return kvt_primary_lookup(f->p, &k);
}

/* verify_store_output: keys_to_store, their chunk ids, the evicted keys. */
static void check_out(struct fx *f, const int *store, const int *ids, const int *evicted)
{
    size_t n = 0, e = 0;
    for (; store[n] >= 0; n++) {
        struct kvt_key k = kt_key(store[n]);
        assert_true(n < f->out.n_store);
        assert_true(kvt_key_eq(&f->out.keys_to_store[n], &k));
        assert_int_equal(f->out.chunk_ids[n], ids[n]);
    }
    assert_int_equal(f->out.n_store, n);
    for (; evicted[e] >= 0; e++) {
        struct kvt_key k = kt_key(evicted[e]);
        assert_true(e < f->out.n_evicted);
        assert_true(kvt_key_eq(&f->out.evicted[e], &k));
    }
    assert_int_equal(f->out.n_evicted, e);
}
#define L(...) ((const int[]){__VA_ARGS__, -1})
#define NONE   ((const int[]){-1})

static bool event_is(const struct kvt_event *ev, bool removed, const int *ids)
{
    size_t n = 0;
    if (ev->removed != removed || ev->medium != KVT_MEDIUM_CPU)
        return false;
    for (; ids[n] >= 0; n++) {
        struct kvt_key k = kt_key(ids[n]);
        bool found = false;
        for (size_t i = 0; i < ev->n; i++)
            found |= kvt_key_eq(&ev->keys[i], &k);
        if (!found)
            return false;
    }
    return ev->n == n;
}

static size_t take(struct fx *f)
{
    kvt_events_cleanup(&f->ev);
    kvt_events_init(&f->ev);
    assert_int_equal(kvt_primary_take_events(f->p, &f->ev), 0);
    return f->ev.n;
}

static bool in_list(struct fx *f, int which, int id)
{
    struct kvt_key k = kt_key(id), all[MAXK];
    size_t n = kvt_primary_policy_list(f->p, which, all, MAXK);
    for (size_t i = 0; i < n; i++)
        if (kvt_key_eq(&all[i], &k))
            return true;
    return false;
}

static size_t list_len(struct fx *f, int which)
{
    struct kvt_key all[MAXK];
    return kvt_primary_policy_list(f->p, which, all, MAXK);
}

static int ghost_of(struct fx *f, int id)
{
    struct kvt_key k = kt_key(id);
    return kvt_primary_arc_ghost_of(f->p, &k);
}

/* ---- upstream: test_manager.py ------------------------------------------ */

static void already_stored_not_evicted(const char *policy)
{
    struct fx *f = fx_make(4, policy, true, 0);
    assert_int_equal(PREP(f, 1, 2), 0);
    COMPLETE(f, 1, 2);
    TOUCH(f, 1); /* 2 becomes the LRU candidate */
    assert_int_equal(PREP(f, 2, 3, 4, 5), 0);
    check_out(f, L(3, 4, 5), L(2, 3, 0), L(1)); /* 1 evicted, not 2 */
    COMPLETE(f, 2, 3, 4, 5);
    assert_int_equal(look(f, 2), KVT_HIT);
    fx_free(f);
}

static void test_already_stored_block_not_evicted_during_prepare_store_lru(void **state)
{
    already_stored_not_evicted("lru");
}

static void test_already_stored_block_not_evicted_during_prepare_store_arc(void **state)
{
    already_stored_not_evicted("arc");
}

static double gauge(struct fx *f, const char *name)
{
    struct kvt_stats st;
    double v;
    kvt_stats_init(&st);
    assert_int_equal(kvt_primary_get_stats(f->p, &st), 0);
    assert_non_null(kvt_stats_find(&st, name, NULL));
    v = kvt_stats_value(&st, name, NULL);
    kvt_stats_cleanup(&st);
    return v;
}

static void test_cpu_manager_reports_cache_usage_gauge(void **state)
{
    struct kvt_primary_config zero = {.num_chunks = 0};
    struct kvt_primary *p = NULL;
    struct fx *f = fx_make(4, "lru", false, 0);
    assert_int_equal(kvt_primary_create(&zero, NULL, &p), -EINVAL); /* deviation, see top */
    assert_null(p);
    assert_true(gauge(f, KVT_M_CPU_USAGE) == 0.0);
    assert_int_equal(PREP(f, 1, 2), 0);
    assert_float_equal(gauge(f, KVT_M_CPU_USAGE), 0.5, 1e-12);
    assert_int_equal(PREP(f, 3, 4), 0);
    assert_float_equal(gauge(f, KVT_M_CPU_USAGE), 1.0, 1e-12);
    fx_free(f);
}

static void test_cpu_manager(void **state)
{
    struct fx *f = fx_make(4, "lru", true, 0);
    int64_t c[4];

    assert_int_equal(PREP(f, 1, 2), 0);
    check_out(f, L(1, 2), L(0, 1), NONE);
    assert_int_equal(look(f, 1), KVT_HIT_PENDING);
    assert_int_equal(look(f, 2), KVT_HIT_PENDING);
    assert_int_equal(take(f), 0);

    COMPLETE(f, 1, 2);
    assert_int_equal(take(f), 1);
    assert_true(event_is(&f->ev.ev[0], false, L(1, 2)));
    assert_int_equal(look(f, 1), KVT_HIT);
    assert_int_equal(look(f, 2), KVT_HIT);
    assert_int_equal(look(f, 3), KVT_MISS);

    assert_int_equal(PREP(f, 2, 3, 4, 5), 0);
    check_out(f, L(3, 4, 5), L(2, 3, 0), L(1));
    assert_int_equal(take(f), 1);
    assert_true(event_is(&f->ev.ev[0], true, L(1)));

    assert_int_equal(PREP(f, 1, 6), -ENOSPC); /* no space */
    COMPLETE(f, 2, 3, 4, 5);
    assert_int_equal(look(f, 1), KVT_MISS);
    for (int i = 2; i <= 5; i++)
        assert_int_equal(look(f, i), KVT_HIT);
    assert_int_equal(look(f, 0), KVT_MISS);

    assert_int_equal(LOAD(f, c, 2, 3), 0);
    assert_int_equal(c[0], 1);
    assert_int_equal(c[1], 2);
    assert_int_equal(PREP(f, 6, 7, 8), -ENOSPC); /* [2, 3] are being loaded */
    assert_int_equal(UNLOAD(f, 2, 3), 0);

    assert_int_equal(PREP(f, 6, 7, 8), 0);
    check_out(f, L(6, 7, 8), L(3, 2, 1), L(2, 3, 4)); /* oldest first */
    COMPLETE(f, 6, 7, 8);

    TOUCH(f, 5, 6, 7);
    assert_int_equal(PREP(f, 9), 0);
    check_out(f, L(9), L(1), L(8)); /* oldest after the touch */
    COMPLETE_FAIL(f, 7, 9);
    assert_int_equal(look(f, 7), KVT_HIT); /* already stored: kept */
    assert_int_equal(look(f, 9), KVT_MISS);

    assert_int_equal(take(f), 4);
    assert_true(event_is(&f->ev.ev[0], false, L(3, 4, 5)));
    assert_true(event_is(&f->ev.ev[1], true, L(2, 3, 4)));
    assert_true(event_is(&f->ev.ev[2], false, L(6, 7, 8)));
    assert_true(event_is(&f->ev.ev[3], true, L(8)));
    fx_free(f);
}

static void test_prepare_load_preserves_key_order(void **state)
{
    struct fx *f = fx_make(4, "lru", false, 0);
    int64_t id[3], c[3];
    assert_int_equal(PREP(f, 0, 1, 2), 0);
    memcpy(id, f->out.chunk_ids, sizeof(id));
    COMPLETE(f, 0, 1, 2);
    assert_int_equal(LOAD(f, c, 0, 1, 2), 0);
    assert_true(c[0] == id[0] && c[1] == id[1] && c[2] == id[2]);
    assert_int_equal(UNLOAD(f, 0, 1, 2), 0);
    assert_int_equal(LOAD(f, c, 1, 2, 0), 0);
    assert_true(c[0] == id[1] && c[1] == id[2] && c[2] == id[0]);
    assert_int_equal(UNLOAD(f, 0, 1, 2), 0); /* order irrelevant */
    assert_int_equal(kvt_primary_num_evictable(f->p), 3);
    fx_free(f);
}

/* TestARCPolicy */

static void test_arc_basic(void **state)
{
    struct fx *f = fx_make(4, "arc", true, 0);
    assert_int_equal(PREP(f, 1, 2), 0);
    check_out(f, L(1, 2), L(0, 1), NONE);
    assert_int_equal(look(f, 1), KVT_HIT_PENDING);
    assert_int_equal(look(f, 2), KVT_HIT_PENDING);
    assert_int_equal(take(f), 0);
    COMPLETE(f, 1, 2);
    assert_int_equal(take(f), 1);
    assert_true(event_is(&f->ev.ev[0], false, L(1, 2)));
    assert_int_equal(look(f, 1), KVT_HIT);
    assert_int_equal(look(f, 2), KVT_HIT);
    assert_int_equal(look(f, 3), KVT_MISS);
    assert_int_equal(list_len(f, 0), 2); /* in T1 (recent) */
    assert_int_equal(list_len(f, 1), 0);
    fx_free(f);
}

static void test_arc_t1_to_t2_promotion(void **state)
{
    struct fx *f = fx_make(4, "arc", false, 0);
    assert_int_equal(PREP(f, 1), 0);
    COMPLETE(f, 1);
    assert_true(in_list(f, 0, 1) && !in_list(f, 1, 1));
    TOUCH(f, 1);
    assert_true(!in_list(f, 0, 1) && in_list(f, 1, 1));
    fx_free(f);
}

static void test_arc_eviction_with_load(void **state)
{
    struct fx *f = fx_make(4, "arc", true, 0);
    int64_t c[2];
    assert_int_equal(PREP(f, 1, 2, 3, 4), 0);
    check_out(f, L(1, 2, 3, 4), L(0, 1, 2, 3), NONE);
    COMPLETE(f, 1, 2, 3, 4);
    assert_int_equal(LOAD(f, c, 2, 3), 0);
    assert_true(c[0] == 1 && c[1] == 2);
    assert_int_equal(PREP(f, 5, 6, 7), -ENOSPC); /* 2 and 3 are pinned */
    assert_int_equal(kvt_primary_num_entries(f->p), 4);
    assert_int_equal(UNLOAD(f, 2, 3), 0);
    assert_int_equal(PREP(f, 5, 6, 7), 0);
    /* T1 = 1,2,3,4 and target 0: the three oldest of T1 go, in order. */
    check_out(f, L(5, 6, 7), L(2, 1, 0), L(1, 2, 3));
    fx_free(f);
}

static void test_arc_adaptive_target(void **state)
{
    struct fx *f = fx_make(2, "arc", false, 0);
    double initial;
    assert_int_equal(PREP(f, 1, 2), 0);
    COMPLETE(f, 1, 2);
    initial = kvt_primary_arc_target(f->p);
    assert_int_equal(PREP(f, 3), 0); /* evicts 1 into B1 */
    COMPLETE(f, 3);
    assert_int_equal(ghost_of(f, 1), 1);
    TOUCH(f, 1); /* a ghost is not reused: no adaptation on a touch */
    assert_float_equal(kvt_primary_arc_target(f->p), initial, 0);
    assert_int_equal(PREP(f, 1), 0); /* a store miss, but a B1 hit: favour recency */
    assert_true(kvt_primary_arc_target(f->p) > initial);
    assert_float_equal(kvt_primary_arc_target(f->p), 1.0, 0); /* max(1, 0/1) */
    assert_int_equal(ghost_of(f, 1), 0);                      /* stored again */
    fx_free(f);
}

static void test_arc_adaptive_target_b2_hit_decreases(void **state)
{
    struct fx *f = fx_make(2, "arc", false, 0);
    int64_t c[2];
    assert_int_equal(PREP(f, 1, 2), 0);
    COMPLETE(f, 1, 2);
    TOUCH(f, 1, 2);                  /* both to T2 */
    assert_int_equal(PREP(f, 3), 0); /* T1 empty: evicts T2's LRU into B2 */
    COMPLETE(f, 3);
    assert_int_equal(ghost_of(f, 2), 2); /* reverse touch left 1 MRU, 2 LRU */
    kvt__primary_arc_set_target(f->p, 1.5);
    /* Everything pinned: the stores of 2 fail, after their store miss adapted. */
    assert_int_equal(LOAD(f, c, 1, 3), 0);
    assert_int_equal(PREP(f, 2), -ENOSPC);
    assert_float_equal(kvt_primary_arc_target(f->p), 0.5, 1e-12);
    assert_int_equal(PREP(f, 2), -ENOSPC);
    assert_float_equal(kvt_primary_arc_target(f->p), 0.0, 0); /* floored at 0 */
    assert_int_equal(ghost_of(f, 2), 2);
    assert_int_equal(kvt_primary_num_entries(f->p), 2);
    assert_int_equal(UNLOAD(f, 1, 3), 0);
    fx_free(f);
}

static void test_arc_t1_t2_eviction_policy(void **state)
{
    struct fx *f = fx_make(4, "arc", false, 0);
    assert_int_equal(PREP(f, 1, 2, 3, 4), 0);
    COMPLETE(f, 1, 2, 3, 4);
    TOUCH(f, 3, 4);
    assert_int_equal(list_len(f, 0), 2);
    assert_int_equal(list_len(f, 1), 2);
    kvt__primary_arc_set_target(f->p, 1);
    assert_int_equal(PREP(f, 5), 0);
    check_out(f, L(5), L(0), L(1));
    COMPLETE(f, 5);
    assert_int_equal(ghost_of(f, 1), 1);
    assert_true(in_list(f, 0, 5));
    fx_free(f);
}

static void test_arc_t2_eviction_when_t1_below_target(void **state)
{
    struct fx *f = fx_make(4, "arc", false, 0);
    assert_int_equal(PREP(f, 1, 2, 3, 4), 0);
    COMPLETE(f, 1, 2, 3, 4);
    TOUCH(f, 3, 4); /* T1 = 1,2; T2 = 4,3 (3 MRU) */
    kvt__primary_arc_set_target(f->p, 3);
    assert_int_equal(PREP(f, 5), 0); /* |T1| 2 < 3: from T2 */
    check_out(f, L(5), L(3), L(4));
    assert_int_equal(ghost_of(f, 4), 2);
    fx_free(f);
}

static void test_arc_ghost_list_bounds(void **state)
{
    struct fx *f = fx_make(2, "arc", false, 0);
    assert_int_equal(PREP(f, 1, 2), 0);
    COMPLETE(f, 1, 2);
    for (int i = 3; i < 20; i++) {
        assert_int_equal(PREP(f, i), 0);
        COMPLETE(f, i);
    }
    assert_int_equal(kvt_primary_arc_ghost_len(f->p, 1), 2); /* capped at capacity */
    assert_true(kvt_primary_arc_ghost_len(f->p, 2) <= 2);
    assert_int_equal(ghost_of(f, 17), 1); /* the newest ghosts survive */
    assert_int_equal(ghost_of(f, 16), 1);
    assert_int_equal(ghost_of(f, 15), 0);
    fx_free(f);
}

static void test_arc_touch_ordering(void **state)
{
    struct fx *f = fx_make(4, "arc", true, 0);
    struct kvt_key t2[4], k;
    assert_int_equal(PREP(f, 1, 2, 3, 4), 0);
    COMPLETE(f, 1, 2, 3, 4);
    TOUCH(f, 3, 4);
    TOUCH(f, 1, 3, 4);
    assert_int_equal(list_len(f, 0), 1);
    assert_int_equal(kvt_primary_policy_list(f->p, 1, t2, 4), 3);
    /* reverse order: 4, 3, then 1 most recent */
    k = kt_key(4);
    assert_true(kvt_key_eq(&t2[0], &k));
    k = kt_key(3);
    assert_true(kvt_key_eq(&t2[1], &k));
    k = kt_key(1);
    assert_true(kvt_key_eq(&t2[2], &k));
    assert_int_equal(PREP(f, 5), 0);
    check_out(f, L(5), L(1), L(2)); /* reuses block 2's slot */
    fx_free(f);
}

static void test_arc_failed_store(void **state)
{
    struct fx *f = fx_make(4, "arc", true, 0);
    assert_int_equal(PREP(f, 1, 2, 3, 4), 0);
    COMPLETE(f, 1, 2, 3, 4);
    assert_int_equal(PREP(f, 5), 0);
    assert_int_equal(f->out.n_evicted, 1);
    COMPLETE_FAIL(f, 5);
    assert_int_equal(look(f, 5), KVT_MISS);
    assert_false(in_list(f, 0, 5));
    assert_false(in_list(f, 1, 5));
    assert_int_equal(ghost_of(f, 1), 1); /* the victim stays a ghost */
    assert_int_equal(kvt_primary_num_free(f->p), 1);
    fx_free(f);
}

static void test_arc_full_scenario(void **state)
{
    struct fx *f = fx_make(4, "arc", true, 0);
    assert_int_equal(PREP(f, 1, 2), 0);
    COMPLETE(f, 1, 2);
    assert_int_equal(PREP(f, 3, 4, 5), 0);
    check_out(f, L(3, 4, 5), L(2, 3, 0), L(1));
    COMPLETE(f, 3, 4, 5);
    TOUCH(f, 2, 3);
    assert_int_equal(list_len(f, 0), 2);
    assert_int_equal(list_len(f, 1), 2);
    assert_int_equal(PREP(f, 6), 0);
    check_out(f, L(6), L(3), L(4)); /* 4 is the oldest in T1 */
    COMPLETE(f, 6);
    assert_int_equal(look(f, 2), KVT_HIT);
    assert_int_equal(look(f, 3), KVT_HIT);
    assert_int_equal(take(f), 5); /* stored, removed, stored, removed, stored */
    assert_true(event_is(&f->ev.ev[0], false, L(1, 2)));
    assert_true(event_is(&f->ev.ev[1], true, L(1)));
    assert_true(event_is(&f->ev.ev[2], false, L(3, 4, 5)));
    assert_true(event_is(&f->ev.ev[3], true, L(4)));
    assert_true(event_is(&f->ev.ev[4], false, L(6)));
    fx_free(f);
}

static void test_evictable_cache_block_count(void **state)
{
    struct fx *f = fx_make(4, "lru", false, 0);
    int64_t c[3];
    assert_int_equal(kvt_primary_num_evictable(f->p), 0);
    assert_int_equal(PREP(f, 1, 2, 3), 0);
    assert_int_equal(kvt_primary_num_evictable(f->p), 0);
    assert_int_equal(kvt_primary_num_write_pending(f->p), 3);
    COMPLETE(f, 1, 2, 3);
    assert_int_equal(kvt_primary_num_evictable(f->p), 3);
    assert_int_equal(LOAD(f, c, 1), 0);
    assert_int_equal(kvt_primary_num_evictable(f->p), 2);
    assert_int_equal(LOAD(f, c, 1), 0); /* a second concurrent load */
    assert_int_equal(kvt_primary_num_evictable(f->p), 2);
    assert_int_equal(UNLOAD(f, 1), 0);
    assert_int_equal(kvt_primary_num_evictable(f->p), 2);
    assert_int_equal(UNLOAD(f, 1), 0);
    assert_int_equal(kvt_primary_num_evictable(f->p), 3);
    assert_int_equal(PREP(f, 4, 5, 6), 0); /* one free slot, two evictions */
    assert_int_equal(kvt_primary_num_evictable(f->p), 1);
    check_out(f, L(4, 5, 6), L(3, 1, 0), L(1, 2)); /* LRU: 3 survives (no request finished) */
    COMPLETE_FAIL(f, 4, 5, 6);
    assert_int_equal(kvt_primary_num_evictable(f->p), 1);
    assert_int_equal(kvt_primary_num_write_pending(f->p), 0);
    kvt_primary_reset_cache(f->p);
    assert_int_equal(kvt_primary_num_evictable(f->p), 0);
    assert_int_equal(kvt_primary_num_entries(f->p), 0);
    assert_int_equal(kvt_primary_num_free(f->p), 4);
    assert_int_equal(PREP(f, 10, 11, 12), 0);
    check_out(f, L(10, 11, 12), L(0, 1, 2), NONE); /* fresh slots again after reset */
    COMPLETE(f, 10, 11, 12);
    assert_int_equal(LOAD(f, c, 10, 11, 12), 0);
    assert_int_equal(kvt_primary_num_evictable(f->p), 0);
    assert_int_equal(PREP(f, 14, 15), -ENOSPC); /* the fast path */
    assert_int_equal(kvt_primary_num_entries(f->p), 3);
    assert_int_equal(UNLOAD(f, 10, 11, 12), 0);
    assert_int_equal(kvt_primary_num_evictable(f->p), 3);
    assert_int_equal(PREP(f, 14, 15), 0);
    assert_int_equal(kvt_primary_num_evictable(f->p), 2);
    COMPLETE(f, 14, 15);
    assert_int_equal(kvt_primary_num_evictable(f->p), 4);
    fx_free(f);
}

/* ---- LRU touch order ---------------------------------------------------- */

static void test_lru_touch_reverses_prefix(void **state)
{
    struct fx *f = fx_make(8, "lru", false, 0);
    struct kvt_key order[8], k;
    assert_int_equal(PREP(f, 0, 1, 2, 3, 4), 0);
    COMPLETE(f, 0, 1, 2, 3, 4);
    TOUCH(f, 1, 2, 3);
    assert_int_equal(kvt_primary_policy_list(f->p, 0, order, 8), 5);
    /* list(evictable)[-3:] == reversed(blocks) */
    k = kt_key(3);
    assert_true(kvt_key_eq(&order[2], &k));
    k = kt_key(2);
    assert_true(kvt_key_eq(&order[3], &k));
    k = kt_key(1);
    assert_true(kvt_key_eq(&order[4], &k));
    fx_free(f);
}

/* ---- the C contract ----------------------------------------------------- */

struct snap {
    size_t entries, evictable, pending, free;
    int32_t ref[8];
};

static void snapshot(struct fx *f, struct snap *s)
{
    memset(s, 0, sizeof(*s));
    s->entries = kvt_primary_num_entries(f->p);
    s->evictable = kvt_primary_num_evictable(f->p);
    s->pending = kvt_primary_num_write_pending(f->p);
    s->free = kvt_primary_num_free(f->p);
    for (int i = 0; i < 8; i++) {
        struct kvt_key k = kt_key(i);
        struct kvt_primary_entry_info info;
        s->ref[i] = kvt_primary_entry_info(f->p, &k, &info) == 0 ? info.ref_cnt : -100;
    }
}

static void test_misuse_is_einval_and_changes_nothing(void **state)
{
    struct fx *f = fx_make(4, "lru", false, 0);
    struct snap a, b;
    int64_t c[4];
    struct kvt_key bad = {.len = 0}, mix[2];
    assert_int_equal(PREP(f, 0, 1, 2), 0);
    COMPLETE(f, 0, 1);
    assert_int_equal(LOAD(f, c, 0), 0);
    snapshot(f, &a);
    assert_int_equal(UNLOAD(f, 1), -EINVAL);     /* ready but not pinned */
    assert_int_equal(UNLOAD(f, 0, 0), -EINVAL);  /* pinned once, unpinned twice */
    assert_int_equal(UNLOAD(f, 0, 7), -EINVAL);  /* unknown key after a good one */
    assert_int_equal(LOAD(f, c, 0, 2), -EINVAL); /* 2 is write-pending */
    assert_int_equal(LOAD(f, c, 1, 7), -EINVAL); /* 7 is absent */
    mix[0] = kt_key(5);
    mix[1] = bad;
    assert_int_equal(kvt_primary_prepare_store(f->p, mix, 2, &f->out), -EINVAL);
    bad.len = KVT_KEY_MAX + 1;
    assert_int_equal(kvt_primary_prepare_store(f->p, &bad, 1, &f->out), -EINVAL);
    assert_int_equal(kvt_primary_lookup(f->p, &bad), KVT_MISS);
    snapshot(f, &b);
    assert_memory_equal(&a, &b, sizeof(a));
    assert_int_equal(look(f, 5), KVT_MISS);
    /* completing an unknown or ready key is ignored (idempotent) */
    COMPLETE(f, 7, 0);
    snapshot(f, &b);
    assert_memory_equal(&a, &b, sizeof(a));
    fx_free(f);
}

static void test_empty_prepare_store_is_empty_not_failure(void **state)
{
    struct fx *f = fx_make(2, "lru", false, 0);
    assert_int_equal(kvt_primary_prepare_store(f->p, NULL, 0, &f->out), 0);
    assert_int_equal(f->out.n_store, 0);
    assert_int_equal(PREP(f, 0, 1), 0);
    /* everything offered is present (pending) and the cache is full: not -ENOSPC */
    assert_int_equal(PREP(f, 0, 1), 0);
    assert_int_equal(f->out.n_store, 0);
    assert_int_equal(f->out.n_evicted, 0);
    fx_free(f);
}

static void test_duplicate_keys_in_one_store_take_one_slot(void **state)
{
    struct fx *f = fx_make(4, "lru", false, 0);
    assert_int_equal(PREP(f, 3, 3, 1, 3), 0);
    check_out(f, L(3, 1), L(0, 1), NONE);
    assert_int_equal(kvt_primary_num_free(f->p), 2);
    assert_int_equal(kvt_primary_num_write_pending(f->p), 2);
    COMPLETE(f, 3, 1, 3);
    assert_int_equal(kvt_primary_num_evictable(f->p), 2);
    fx_free(f);
}

/* Regression: the dedup table of a large batch must not leak into the next,
 * smaller one (a stale entry made a distinct key look like a duplicate). */
static void test_small_store_after_large_one_stores_every_key(void **state)
{
    struct fx *f = fx_make(128, "lru", false, 0);
    struct kvt_key k[40];
    kt_keys(k, 0, 40);
    assert_int_equal(kvt_primary_prepare_store(f->p, k, 32, &f->out), 0);
    assert_int_equal(f->out.n_store, 32);
    for (size_t n = 1; n <= 8; n++) {
        kt_keys(k, 100 + (int)(n * 10), n);
        assert_int_equal(kvt_primary_prepare_store(f->p, k, n, &f->out), 0);
        assert_int_equal(f->out.n_store, n);
    }
    assert_int_equal(kvt_primary_num_entries(f->p), 32 + 36);
    fx_free(f);
}

static void test_failed_eviction_is_atomic(void **state)
{
    struct fx *f = fx_make(3, "arc", true, 0);
    int64_t c[1];
    assert_int_equal(PREP(f, 0, 1, 2), 0);
    COMPLETE(f, 0, 1, 2);
    assert_int_equal(LOAD(f, c, 1), 0);
    take(f);
    /* needs 3 victims; 0 and 2 are evictable, 1 is pinned: nothing may change */
    assert_int_equal(PREP(f, 4, 5, 6), -ENOSPC);
    assert_int_equal(kvt_primary_num_entries(f->p), 3);
    assert_int_equal(kvt_primary_arc_ghost_len(f->p, 1), 0);
    assert_int_equal(take(f), 0);
    /* two victims exist for the offer 0,4,5? 0 is protected: only 2 -> fails */
    assert_int_equal(PREP(f, 0, 4, 5), -ENOSPC);
    assert_int_equal(look(f, 0), KVT_HIT);
    assert_int_equal(look(f, 2), KVT_HIT);
    fx_free(f);
}

static void test_generation_changes_on_every_reuse(void **state)
{
    struct fx *f = fx_make(1, "lru", false, 0);
    struct kvt_primary_entry_info a, b;
    struct kvt_key k0 = kt_key(0), k1 = kt_key(1);
    assert_int_equal(PREP(f, 0), 0);
    COMPLETE(f, 0);
    assert_int_equal(kvt_primary_entry_info(f->p, &k0, &a), 0);
    assert_int_equal(PREP(f, 1), 0); /* evicts 0, same slot */
    assert_int_equal(kvt_primary_entry_info(f->p, &k0, &b), -ENOENT);
    assert_int_equal(kvt_primary_entry_info(f->p, &k1, &b), 0);
    assert_int_equal(a.slot, b.slot);
    assert_int_not_equal(a.generation, b.generation);
    COMPLETE_FAIL(f, 1);
    assert_int_equal(PREP(f, 0), 0); /* a failed store frees; the next use bumps again */
    assert_int_equal(kvt_primary_entry_info(f->p, &k0, &a), 0);
    assert_int_not_equal(a.generation, b.generation);
    fx_free(f);
}

/* Fence words: odd from allocation to completion, even after, a new value at every
 * write of the slot; the entry keeps the value its bytes were completed under, and
 * an in-place rewrite moves the word on without changing it. */
static void test_fence_words_follow_every_write(void **state)
{
    struct fx *f = fx_make(1, "lru", false, 64);
    struct kvt_primary_entry_info a, b;
    struct kvt_key k0 = kt_key(0), k1 = kt_key(1);
    const _Atomic uint32_t *w;
    uint32_t seen[8];
    size_t n = 0, n_words;
    uint8_t *row;

    (void)state;
    w = kvt_primary_fence_words(f->p, &n_words);
    assert_int_equal(n_words, 1);
    assert_int_equal(w[0], 0);
    assert_int_equal(kvt_primary_rewrite_begin(f->p, &k0, &row), -ENOENT);
    assert_int_equal(PREP(f, 0), 0);
    seen[n++] = w[0];
    assert_true(w[0] & 1); /* being written */
    assert_int_equal(kvt_primary_rewrite_begin(f->p, &k0, &row), -EBUSY);
    assert_int_equal(kvt_primary_entry_info(f->p, &k0, &a), 0);
    assert_int_equal(a.fence, 0);
    COMPLETE(f, 0);
    seen[n++] = w[0];
    assert_false(w[0] & 1);
    assert_int_equal(kvt_primary_entry_info(f->p, &k0, &a), 0);
    assert_int_equal(a.fence, w[0]);
    /* In place: odd, then even again, the entry's fence unchanged. */
    assert_int_equal(kvt_primary_rewrite_end(f->p, &k0), -EINVAL); /* no begin */
    assert_int_equal(kvt_primary_rewrite_begin(f->p, &k0, &row), 0);
    seen[n++] = w[0];
    assert_true(w[0] & 1);
    row[0] ^= 1;
    assert_int_equal(kvt_primary_rewrite_end(f->p, &k0), 0);
    seen[n++] = w[0];
    assert_false(w[0] & 1);
    assert_int_equal(kvt_primary_entry_info(f->p, &k0, &b), 0);
    assert_int_equal(b.fence, a.fence);
    assert_int_not_equal(w[0], a.fence);
    /* The slot reused (0 evicted), a failed store, reused again. */
    assert_int_equal(PREP(f, 1), 0);
    seen[n++] = w[0];
    COMPLETE_FAIL(f, 1);
    seen[n++] = w[0];
    assert_false(w[0] & 1);
    assert_int_equal(PREP(f, 1), 0);
    seen[n++] = w[0];
    COMPLETE(f, 1);
    seen[n++] = w[0];
    assert_int_equal(kvt_primary_entry_info(f->p, &k1, &b), 0);
    assert_int_equal(b.fence, w[0]);
    for (size_t i = 1; i < n; i++) /* only forward */
        assert_true(seen[i] > seen[i - 1]);
    fx_free(f);
}

/* 4 rows of 256 bytes, each store hashed at completion; out is ready for use. */
static struct kvt_primary *checksum_primary(struct kvt_store_output *out)
{
    struct kvt_primary_config pc = {
        .num_chunks = 4, .row_bytes = 256, .checksum_on_complete = true};
    struct kvt_primary *p;

    assert_int_equal(kvt_primary_create(&pc, NULL, &p), 0);
    kvt_store_output_init(out);
    return p;
}

static void test_checksum_on_complete(void **state)
{
    struct kvt_store_output out;
    struct kvt_primary *p = checksum_primary(&out);
    struct kvt_key k = kt_key(9);
    struct kvt_primary_entry_info info;
    uint8_t *row;
    assert_int_equal(kvt_primary_prepare_store(p, &k, 1, &out), 0);
    row = kvt_primary_base(p) + out.chunk_ids[0] * 256;
    for (int i = 0; i < 256; i++)
        row[i] = (uint8_t)(i * 7);
    assert_int_equal(kvt_primary_entry_info(p, &k, &info), 0);
    assert_false(info.has_checksum);
    assert_int_equal(kvt_primary_complete_store(p, &k, 1, true), 0);
    assert_int_equal(kvt_primary_entry_info(p, &k, &info), 0);
    assert_true(info.has_checksum);
    assert_true(info.checksum == kvt_hash64(row, 256));
    assert_int_equal(kvt_primary_set_checksum(p, &k, 42), 0);
    assert_int_equal(kvt_primary_entry_info(p, &k, &info), 0);
    assert_true(info.checksum == 42);
    kvt_store_output_cleanup(&out);
    kvt_primary_destroy(p);
}

/* A promotion that verified its bytes sets the checksum while the write is pending:
 * completing keeps it (no second hash); a failed write leaves nothing behind for the
 * next store of the key, which is hashed again. */
static void test_checksum_set_while_pending(void **state)
{
    struct kvt_store_output out;
    struct kvt_primary *p = checksum_primary(&out);
    struct kvt_key k = kt_key(9);
    struct kvt_primary_entry_info info;
    uint8_t *row;
    assert_int_equal(kvt_primary_prepare_write(p, &k, 1, &out), 0);
    assert_int_equal(kvt_primary_set_checksum(p, &k, 42), 0);
    assert_int_equal(kvt_primary_complete_write(p, &k, 1, true), 0);
    assert_int_equal(kvt_primary_entry_info(p, &k, &info), 0);
    assert_true(info.has_checksum);
    assert_true(info.checksum == 42);

    k = kt_key(10);
    kvt_store_output_cleanup(&out);
    kvt_store_output_init(&out);
    assert_int_equal(kvt_primary_prepare_write(p, &k, 1, &out), 0);
    assert_int_equal(kvt_primary_set_checksum(p, &k, 42), 0);
    assert_int_equal(kvt_primary_complete_write(p, &k, 1, false), 0);
    assert_int_equal(kvt_primary_entry_info(p, &k, &info), -ENOENT);
    kvt_store_output_cleanup(&out);
    kvt_store_output_init(&out);
    assert_int_equal(kvt_primary_prepare_store(p, &k, 1, &out), 0);
    row = kvt_primary_base(p) + out.chunk_ids[0] * 256;
    memset(row, 0x5a, 256);
    assert_int_equal(kvt_primary_complete_store(p, &k, 1, true), 0);
    assert_int_equal(kvt_primary_entry_info(p, &k, &info), 0);
    assert_true(info.checksum == kvt_hash64(row, 256));
    kvt_store_output_cleanup(&out);
    kvt_primary_destroy(p);
}

static void test_stats_split_read_and_write(void **state)
{
    struct fx *f = fx_make(4, "lru", false, 0);
    struct kvt_stats st;
    const struct kvt_stat *h;
    int64_t c[1];
    assert_int_equal(PREP(f, 0, 1, 2), 0);
    COMPLETE(f, 0, 1);
    assert_int_equal(LOAD(f, c, 0), 0);
    kvt_stats_init(&st);
    assert_int_equal(kvt_primary_get_stats(f->p, &st), 0);
    assert_float_equal(kvt_stats_value(&st, KVT_M_CPU_USAGE, NULL), 0.5, 1e-12);
    assert_float_equal(kvt_stats_value(&st, KVT_M_CPU_WRITE_USAGE, NULL), 0.25, 1e-12);
    assert_float_equal(kvt_stats_value(&st, KVT_M_CPU_READ_USAGE, NULL), 0.25, 1e-12);
    h = kvt_stats_find(&st, KVT_M_CPU_ALLOC_SIZE, NULL);
    assert_non_null(h);
    assert_int_equal(h->count, 1);
    assert_float_equal(h->sum, 3, 0);
    assert_int_equal(h->buckets[1], 1); /* vLLM's buckets: 3 in (1, 4] */
    kvt_stats_clear(&st);
    assert_int_equal(kvt_primary_get_stats(f->p, &st), 0); /* histogram consumed */
    assert_null(kvt_stats_find(&st, KVT_M_CPU_ALLOC_SIZE, NULL));
    assert_non_null(kvt_stats_find(&st, KVT_M_CPU_USAGE, NULL));
    /* vLLM counts an allocation's size before it finds there is no room */
    assert_int_equal(PREP(f, 5, 6, 7, 8), -ENOSPC);
    kvt_stats_clear(&st);
    assert_int_equal(kvt_primary_get_stats(f->p, &st), 0);
    h = kvt_stats_find(&st, KVT_M_CPU_ALLOC_SIZE, NULL);
    assert_non_null(h);
    assert_int_equal(h->count, 1);
    assert_float_equal(h->sum, 4, 0);
    kvt_stats_cleanup(&st);
    fx_free(f);
}

static void count_entry(void *arg, const struct kvt_key *key,
                        const struct kvt_primary_entry_info *info)
{
    (void)key;
    assert_true(info->ref_cnt >= -1);
    (*(size_t *)arg)++;
}

/* The index against a reference model under heavy churn: random stores,
 * failures, pins and evictions in a small cache, so backward-shift deletion
 * runs through every wrap-around case. */
static void test_index_under_churn(void **state)
{
    enum { N = 64, KEYS = 300, STEPS = 20000 };
    static int32_t model[KEYS]; /* -100 absent, else ref_cnt */
    struct fx *f = fx_make(N, "arc", false, 0);
    unsigned seed = 12345;
    for (int i = 0; i < KEYS; i++)
        model[i] = -100;
    for (int step = 0; step < STEPS; step++) {
        int id = (int)(rand_r(&seed) % KEYS);
        struct kvt_key k = kt_key(id);
        int op = (int)(rand_r(&seed) % 4);
        int64_t c;
        if (op == 0 && model[id] == -100) {
            int rc = kvt_primary_prepare_store(f->p, &k, 1, &f->out);
            if (rc == 0) {
                model[id] = -1;
                for (size_t e = 0; e < f->out.n_evicted; e++)
                    for (int j = 0; j < KEYS; j++) {
                        struct kvt_key kj = kt_key(j);
                        if (kvt_key_eq(&kj, &f->out.evicted[e])) {
                            assert_int_equal(model[j], 0); /* only idle entries go */
                            model[j] = -100;
                        }
                    }
            } else {
                assert_int_equal(rc, -ENOSPC);
            }
        } else if (op == 1 && model[id] == -1) {
            bool ok = rand_r(&seed) % 4 != 0;
            assert_int_equal(kvt_primary_complete_store(f->p, &k, 1, ok), 0);
            model[id] = ok ? 0 : -100;
        } else if (op == 2 && model[id] >= 0 && model[id] < 3) {
            assert_int_equal(kvt_primary_prepare_load(f->p, &k, 1, &c), 0);
            model[id]++;
        } else if (op == 3 && model[id] > 0) {
            assert_int_equal(kvt_primary_complete_load(f->p, &k, 1), 0);
            model[id]--;
        } else if (op == 3) {
            kvt_primary_touch(f->p, &k, 1);
        }
        if (step % 97 == 0) {
            size_t entries = 0, idle = 0, pending = 0;
            for (int j = 0; j < KEYS; j++) {
                struct kvt_key kj = kt_key(j);
                enum kvt_lookup_result r = kvt_primary_lookup(f->p, &kj);
                assert_int_equal(r, model[j] == -100 ? KVT_MISS
                                    : model[j] == -1 ? KVT_HIT_PENDING
                                                     : KVT_HIT);
                entries += model[j] != -100;
                idle += model[j] == 0;
                pending += model[j] == -1;
            }
            assert_int_equal(kvt_primary_num_entries(f->p), entries);
            assert_int_equal(kvt_primary_num_evictable(f->p), idle);
            assert_int_equal(kvt_primary_num_write_pending(f->p), pending);
            assert_int_equal(kvt_primary_num_free(f->p), N - entries);
            size_t walked = 0;
            kvt_primary_for_each(f->p, count_entry, &walked);
            assert_int_equal(walked, entries);
        }
    }
    fx_free(f);
}

/* A store's insertions go on from where its finds ended (the cell that ended each
 * absent key's probe run) unless the store evicted: the index must end as if each
 * key were found and then inserted from its home. Random calls of up to 40 keys
 * (repeats, present and pending keys among them, some evicting) into primaries of
 * 37 and 64 chunks (index runs that wrap around and share cells), with and without
 * a request's access; every key's lookup is checked against a model after each
 * call. */
static void test_store_inserts_where_its_finds_ended(void **state)
{
    enum { KEYS = 400, CALLS = 3000, MAXN = 40 };
    static const size_t sizes[] = {37, 64};
    static const char *const policies[] = {"lru", "arc"};

    for (size_t z = 0; z < 2; z++) {
        for (size_t q = 0; q < 2; q++) {
            struct fx *f = fx_make(sizes[z], policies[q], false, 0);
            struct kvt_primary_access *acc = NULL;
            static int8_t model[KEYS]; /* 0 absent, 1 pending, 2 ready */
            unsigned seed = 777 + (unsigned)(z * 2 + q);

            memset(model, 0, sizeof(model));
            for (int call = 0; call < CALLS; call++) {
                struct kvt_key k[MAXN];
                size_t n = 1 + (size_t)(rand_r(&seed) % MAXN);
                int rc;

                if (call % 50 == 0) {
                    if (acc != NULL) {
                        kvt_primary_request_finished(f->p, acc);
                        kvt_primary_access_destroy(acc);
                        acc = NULL;
                    }
                    if (rand_r(&seed) % 2 == 0)
                        assert_int_equal(kvt_primary_access_create(&acc), 0);
                }
                for (size_t i = 0; i < n; i++)
                    k[i] = kt_key((int)(rand_r(&seed) % KEYS));
                rc = kvt_primary_prepare_store_req(f->p, k, n, acc, &f->out);
                if (rc == -ENOSPC)
                    continue;
                assert_int_equal(rc, 0);
                for (size_t e = 0; e < f->out.n_evicted; e++)
                    for (int j = 0; j < KEYS; j++) {
                        struct kvt_key kj = kt_key(j);

                        if (kvt_key_eq(&kj, &f->out.evicted[e]))
                            model[j] = 0;
                    }
                for (size_t i = 0; i < f->out.n_store; i++)
                    for (int j = 0; j < KEYS; j++) {
                        struct kvt_key kj = kt_key(j);

                        if (kvt_key_eq(&kj, &f->out.keys_to_store[i])) {
                            assert_int_equal(model[j], 0);
                            model[j] = 1;
                        }
                    }
                for (int j = 0; j < KEYS; j++) {
                    struct kvt_key kj = kt_key(j);

                    assert_int_equal(kvt_primary_lookup(f->p, &kj), model[j] == 0 ? KVT_MISS
                                                                    : model[j] == 1
                                                                        ? KVT_HIT_PENDING
                                                                        : KVT_HIT);
                }
                /* most stores complete; some keys stay pending a while */
                if (rand_r(&seed) % 4 != 0) {
                    for (int j = 0; j < KEYS; j++) {
                        struct kvt_key kj = kt_key(j);

                        if (model[j] != 1)
                            continue;
                        assert_int_equal(kvt_primary_complete_store(f->p, &kj, 1, true), 0);
                        model[j] = 2;
                    }
                }
            }
            if (acc != NULL) {
                kvt_primary_request_finished(f->p, acc);
                kvt_primary_access_destroy(acc);
            }
            fx_free(f);
        }
    }
}

static void test_create_rejects_bad_config(void **state)
{
    struct kvt_primary *p = NULL;
    struct kvt_primary_config pc = {.num_chunks = 4, .policy = "lfu"};
    assert_int_equal(kvt_primary_create(&pc, NULL, &p), -EINVAL);
    pc.policy = "arc";
    pc.num_chunks = (1ull << 31) + 1;
    assert_int_equal(kvt_primary_create(&pc, NULL, &p), -EINVAL);
    assert_null(p);
}

static void test_create_unwinds_on_allocation_failure(void **state)
{
    struct kvt_primary_config pc = {.num_chunks = 16, .row_bytes = 64, .policy = "arc"};
    for (long n = 0; n < 12; n++) {
        struct kvt_primary *p = NULL;
        int rc;
        kvt_alloc_fail_after(n);
        rc = kvt_primary_create(&pc, NULL, &p);
        kvt_alloc_fail_after(-1);
        if (rc == 0) {
            kvt_primary_destroy(p);
            return;
        }
        assert_int_equal(rc, -ENOMEM);
        assert_null(p);
    }
    fail_msg("create never succeeded");
}

/* The many-key lookup answers as the one-key lookup for every kind of key: ready,
 * pinned, write-pending, absent, repeated and invalid, across group boundaries,
 * in a table large enough to have collisions and long probe runs. */
static void test_lookup_many_matches_lookup(void **state)
{
    enum { N = 3000, ASK = 2 * N + 3 };
    struct kvt_primary_config pc = {.num_chunks = N, .row_bytes = 0};
    static struct kvt_key k[ASK];
    static enum kvt_lookup_result got[ASK];
    static uint64_t hash[ASK];
    struct kvt_store_output out;
    struct kvt_primary *p;
    int64_t id;
    size_t hits = 0, pending = 0, misses = 0;

    (void)state;
    assert_int_equal(kvt_primary_create(&pc, NULL, &p), 0);
    kvt_store_output_init(&out);
    kt_keys(k, 0, 2 * N);
    for (size_t i = 0; i < N; i += 10) { /* 2/3 of each ten ready, 1/3 write-pending */
        size_t n = i + 10 <= N ? 10 : N - i;

        assert_int_equal(kvt_primary_prepare_store(p, k + i, n, &out), 0);
        assert_int_equal(kvt_primary_complete_store(p, k + i, 7, true), 0);
    }
    assert_int_equal(kvt_primary_prepare_load(p, &k[3], 1, &id), 0); /* pinned */
    for (size_t i = 1000; i < 1300; i++) /* freed: slots and index cells reused below */
        assert_int_equal(kvt_primary_complete_store(p, &k[i], 1, false), 0);
    assert_int_equal(kvt_primary_prepare_store(p, k + N, 300, &out), 0);
    k[2 * N] = k[N - 4];    /* repeated (ready, recent: not evicted) */
    k[2 * N + 1].len = 0;   /* invalid */
    k[2 * N + 2].len = 200; /* invalid */
    for (size_t n = 1; n <= ASK; n = n < 40 ? n + 1 : n * 3) {
        size_t from = (size_t)ASK - n;

        kvt_primary_lookup_many(p, k + from, n, got, NULL);
        for (size_t i = 0; i < n; i++)
            if (got[i] != kvt_primary_lookup(p, &k[from + i]))
                fail_msg("n %zu key %zu: many %d, one %d", n, from + i, (int)got[i],
                         (int)kvt_primary_lookup(p, &k[from + i]));
    }
    memset(hash, 0xab, sizeof(hash));
    kvt_primary_lookup_many(p, k, ASK, got, hash);
    for (size_t i = 0; i < ASK; i++) {
        assert_int_equal(got[i], kvt_primary_lookup(p, &k[i]));
        /* each key's hash for the caller; 0 for the invalid ones */
        assert_true(hash[i] ==
                    (k[i].len >= 1 && k[i].len <= KVT_KEY_MAX ? kvt_key_hash(&k[i]) : 0));
        hits += got[i] == KVT_HIT;
        pending += got[i] == KVT_HIT_PENDING;
        misses += got[i] == KVT_MISS;
    }
    /* the history above, counted by hand: 2100 ready, minus the 210 the last store
     * evicted (90 slots were free, the failed write-pending ones of 1000..1299), + 1
     * repeat; 900 - 90 write-pending + 300 new ones; the rest absent or invalid */
    assert_int_equal(hits, 2100 - 210 + 1);
    assert_int_equal(pending, 900 - 90 + 300);
    assert_int_equal(misses, ASK - hits - pending);
    assert_int_equal(kvt_primary_complete_load(p, &k[3], 1), 0);
    kvt_store_output_cleanup(&out);
    kvt_primary_destroy(p);
}

/* ---- ARC against a reference model ----------------------------------------
 * vLLM's ARC rules written the obvious way (ordered arrays of key ids, LRU
 * first), driven side by side with the primary through random stores and
 * touches of present, ghost and unknown keys; after every call the lists T1, T2,
 * the ghost lists and the target must agree. A touch is a request of its own
 * that reuses the present keys and finishes at once (ghosts and unknown keys are
 * not touched); a store's misses adapt the target to ghosts, tail first, before
 * it evicts. Entries are always ready and unpinned here: the pin and
 * write-pending rules have their own tests above. */
#define ARC_CAP  8
#define ARC_KEYS 40

struct arc_model {
    int l[4][ARC_KEYS]; /* T1, T2, B1, B2; LRU first */
    size_t n[4];
    double target;
};

static int am_where(const struct arc_model *m, int k)
{
    for (int w = 0; w < 4; w++)
        for (size_t i = 0; i < m->n[w]; i++)
            if (m->l[w][i] == k)
                return w;
    return -1;
}

static void am_remove(struct arc_model *m, int w, int k)
{
    for (size_t i = 0; i < m->n[w]; i++)
        if (m->l[w][i] == k) {
            memmove(&m->l[w][i], &m->l[w][i + 1], (m->n[w] - i - 1) * sizeof(int));
            m->n[w]--;
            return;
        }
}

static void am_append(struct arc_model *m, int w, int k)
{
    m->l[w][m->n[w]++] = k;
}

static void am_touch(struct arc_model *m, const int *keys, size_t n)
{
    for (size_t i = n; i-- > 0;) {
        int w = am_where(m, keys[i]);

        if (w != 0 && w != 1)
            continue; /* a ghost or an unknown key: nothing to reuse */
        am_remove(m, w, keys[i]);
        am_append(m, 1, keys[i]); /* T1 -> T2, T2 -> its MRU end */
    }
}

/* on_store_miss: each miss, tail first, that is a ghost. */
static void am_store_miss(struct arc_model *m, const int *keys, size_t n)
{
    for (size_t i = n; i-- > 0;) {
        int w = am_where(m, keys[i]);
        double b1 = (double)m->n[2], b2 = (double)m->n[3];

        if (w < 2)
            continue;
        am_remove(m, w, keys[i]);
        am_append(m, w, keys[i]); /* a ghost moves to its MRU end */
        if (w == 2)
            m->target = fmin(m->target + fmax(1.0, b2 / b1), ARC_CAP);
        else
            m->target = fmax(m->target - fmax(1.0, b1 / b2), 0.0);
    }
}

/* prepare_store + complete_store of distinct keys; the offered present ones are
 * protected from eviction. */
static void am_store(struct arc_model *m, const int *keys, size_t n)
{
    int add[8];
    size_t n_add = 0, n_t = m->n[0] + m->n[1], need;
    bool prot[ARC_KEYS] = {false};
    size_t c1 = 0, c2 = 0, virtual_t1 = m->n[0], limit;
    int victims[8], from[8];

    for (size_t i = 0; i < n; i++) {
        int w = am_where(m, keys[i]);

        if (w == 0 || w == 1)
            prot[keys[i]] = true;
        else
            add[n_add++] = keys[i];
    }
    am_store_miss(m, add, n_add);
    limit = (size_t)floor(m->target);
    need = n_t + n_add > ARC_CAP ? n_t + n_add - ARC_CAP : 0;
    for (size_t v = 0; v < need; v++) { /* cursors walk T1 and T2 from the LRU end */
        int got = -1;

        while (virtual_t1 >= limit && c1 < m->n[0] && got < 0)
            if (!prot[m->l[0][c1++]])
                got = 0;
        if (got < 0)
            while (c2 < m->n[1] && got < 0)
                if (!prot[m->l[1][c2++]])
                    got = 1;
        if (got < 0)
            while (c1 < m->n[0] && got < 0)
                if (!prot[m->l[0][c1++]])
                    got = 0;
        assert_true(got >= 0);
        victims[v] = got == 0 ? m->l[0][c1 - 1] : m->l[1][c2 - 1];
        from[v] = got;
        if (got == 0)
            virtual_t1--;
    }
    for (size_t v = 0; v < need; v++) {
        am_remove(m, from[v], victims[v]);
        am_append(m, from[v] + 2, victims[v]);
    }
    for (int w = 2; w < 4; w++)
        while (m->n[w] > ARC_CAP)
            am_remove(m, w, m->l[w][0]);
    for (size_t i = 0; i < n_add; i++) {
        int w = am_where(m, add[i]);

        if (w >= 2)
            am_remove(m, w, add[i]);
        am_append(m, 0, add[i]);
    }
}

static void am_check(const struct arc_model *m, struct kvt_primary *p, int step)
{
    struct kvt_key got[ARC_KEYS];

    for (int w = 0; w < 2; w++) {
        size_t n = kvt_primary_policy_list(p, w, got, ARC_KEYS);

        if (n != m->n[w])
            fail_msg("step %d: T%d has %zu entries, the model %zu", step, w + 1, n, m->n[w]);
        for (size_t i = 0; i < n; i++) {
            struct kvt_key k = kt_key(m->l[w][i]);

            if (!kvt_key_eq(&got[i], &k))
                fail_msg("step %d: T%d[%zu] differs from the model's %d", step, w + 1, i,
                         m->l[w][i]);
        }
    }
    assert_int_equal(kvt_primary_arc_ghost_len(p, 1), m->n[2]);
    assert_int_equal(kvt_primary_arc_ghost_len(p, 2), m->n[3]);
    for (int k = 0; k < ARC_KEYS; k++) {
        struct kvt_key key = kt_key(k);
        int w = am_where(m, k);

        if (kvt_primary_arc_ghost_of(p, &key) != (w >= 2 ? w - 1 : 0))
            fail_msg("step %d: key %d ghost %d, the model %d", step, k,
                     kvt_primary_arc_ghost_of(p, &key), w >= 2 ? w - 1 : 0);
    }
    if (fabs(kvt_primary_arc_target(p) - m->target) > 1e-9)
        fail_msg("step %d: target %f, the model %f", step, kvt_primary_arc_target(p), m->target);
}

static void test_arc_matches_reference_model(void **state)
{
    uint64_t rng = 0x9e3779b97f4a7c15ull;

    (void)state;
    for (int run = 0; run < 20; run++) {
        struct fx *f = fx_make(ARC_CAP, "arc", false, 0);
        struct arc_model m = {0};

        for (int step = 0; step < 400; step++) {
            int ids[4];
            struct kvt_key keys[4];
            size_t n = 1;

            rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
            n += rng % 4;
            for (size_t i = 0; i < n; i++) { /* distinct ids; a few hot ones */
                bool dup;

                do {
                    rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
                    ids[i] = (int)(rng % (rng & 64 ? 12 : ARC_KEYS));
                    dup = false;
                    for (size_t j = 0; j < i; j++)
                        dup |= ids[j] == ids[i];
                } while (dup);
                keys[i] = kt_key(ids[i]);
            }
            if ((rng >> 20) % 2 == 0) {
                kvt_primary_touch(f->p, keys, n);
                am_touch(&m, ids, n);
            } else {
                assert_int_equal(kvt_primary_prepare_store(f->p, keys, n, &f->out), 0);
                assert_int_equal(
                    kvt_primary_complete_store(f->p, f->out.keys_to_store, f->out.n_store, true),
                    0);
                am_store(&m, ids, n);
            }
            am_check(&m, f->p, step);
        }
        fx_free(f);
    }
}

/* ---- request-scoped access ------------------------------------------------ */

static int rprep(struct fx *f, struct kvt_primary_access *acc, const int *ids, int group)
{
    struct kvt_key k[MAXK];
    size_t n = 0;

    for (; ids[n] >= 0; n++) {
        char s[16];
        int len = snprintf(s, sizeof(s), "%d", ids[n]);

        assert_int_equal(kvt_key_make(&k[n], s, (size_t)len, (uint32_t)group), 0);
    }
    return kvt_primary_prepare_store_req(f->p, k, n, acc, &f->out);
}

static struct kvt_key gkey(int id, int group)
{
    struct kvt_key k;
    char s[16];
    int len = snprintf(s, sizeof(s), "%d", id);

    assert_int_equal(kvt_key_make(&k, s, (size_t)len, (uint32_t)group), 0);
    return k;
}

static void complete_all(struct fx *f)
{
    assert_int_equal(kvt_primary_complete_store(f->p, f->out.keys_to_store, f->out.n_store, true),
                     0);
}

/* Key groups in ascending order, each in first-seen order, the tail applied
 * first: the head of the lowest group ends most recent. */
static void test_request_finish_orders_keys_by_group(void **state)
{
    struct fx *f = fx_make(8, "lru", false, 0);
    struct kvt_primary_access *acc;
    struct kvt_key order[8];
    struct kvt_key want[6] = {gkey(9, 0), gkey(2, 1), gkey(1, 1),
                              gkey(3, 0), gkey(2, 0), gkey(1, 0)}; /* LRU -> MRU */

    assert_int_equal(kvt_primary_access_create(&acc), 0);
    assert_int_equal(rprep(f, NULL, L(9), 0), 0); /* not the request's */
    complete_all(f);
    assert_int_equal(rprep(f, acc, L(1, 2), 1), 0); /* group 1 first */
    complete_all(f);
    assert_int_equal(rprep(f, acc, L(1, 2, 3), 0), 0);
    complete_all(f);
    assert_int_equal(kvt_primary_policy_list(f->p, 0, order, 8), 6);
    kvt_primary_request_finished(f->p, acc);
    assert_int_equal(kvt_primary_policy_list(f->p, 0, order, 8), 6);
    for (int i = 0; i < 6; i++)
        assert_true(kvt_key_eq(&order[i], &want[i]));
    kvt_primary_request_finished(f->p, acc); /* once only */
    assert_int_equal(kvt_primary_policy_list(f->p, 0, order, 8), 6);
    for (int i = 0; i < 6; i++)
        assert_true(kvt_key_eq(&order[i], &want[i]));
    kvt_primary_access_destroy(acc);
    fx_free(f);
}

/* ARC: loading a chunk the request itself stored is no reuse; loading one
 * another request stored is, and only a ready one counts. */
static void test_request_reuse_of_its_own_insert_is_not_reuse(void **state)
{
    struct fx *f = fx_make(8, "arc", false, 0);
    struct kvt_primary_access *r1, *r2;
    int64_t c[2];

    assert_int_equal(kvt_primary_access_create(&r1), 0);
    assert_int_equal(kvt_primary_access_create(&r2), 0);
    assert_int_equal(rprep(f, r1, L(1), 0), 0);
    complete_all(f);
    assert_int_equal(rprep(f, r2, L(2), 0), 0);
    complete_all(f);
    struct kvt_key k[2] = {kt_key(1), kt_key(2)};

    assert_int_equal(kvt_primary_prepare_load_req(f->p, k, 2, r1, c), 0);
    assert_int_equal(UNLOAD(f, 1, 2), 0);
    kvt_primary_request_finished(f->p, r1);
    assert_true(in_list(f, 0, 1)); /* its own: insertion only, stays in T1 */
    assert_true(in_list(f, 1, 2)); /* another's, ready: T1 -> T2 */
    /* r2 re-offers its own 2 (reused by r1, not by r2) and offers 3 */
    assert_int_equal(rprep(f, r2, L(2, 3), 0), 0);
    kvt_primary_request_finished(f->p, r2); /* 3 still being written */
    assert_true(in_list(f, 1, 2));
    assert_true(in_list(f, 0, 3));
    kvt_primary_access_destroy(r1);
    kvt_primary_access_destroy(r2);
    fx_free(f);
}

/* ARC: a request's store miss adapts once, even if its store fails and it
 * offers the key again; another request's miss adapts again. */
static void test_store_miss_adapts_once_per_request(void **state)
{
    struct fx *f = fx_make(2, "arc", false, 0);
    struct kvt_primary_access *r1, *r2;
    int64_t c[2];

    assert_int_equal(kvt_primary_access_create(&r1), 0);
    assert_int_equal(kvt_primary_access_create(&r2), 0);
    assert_int_equal(PREP(f, 1, 2), 0);
    COMPLETE(f, 1, 2);
    assert_int_equal(PREP(f, 3, 4), 0); /* 1 and 2 into B1 */
    COMPLETE(f, 3, 4);
    assert_int_equal(LOAD(f, c, 3, 4), 0);
    assert_int_equal(rprep(f, r1, L(1), 0), -ENOSPC);
    assert_float_equal(kvt_primary_arc_target(f->p), 1.0, 0);
    assert_int_equal(rprep(f, r1, L(1), 0), -ENOSPC);
    assert_float_equal(kvt_primary_arc_target(f->p), 1.0, 0); /* not again */
    assert_int_equal(rprep(f, r2, L(1), 0), -ENOSPC);
    assert_float_equal(kvt_primary_arc_target(f->p), 2.0, 0);
    assert_int_equal(PREP(f, 2), -ENOSPC);                    /* no request: every call adapts */
    assert_float_equal(kvt_primary_arc_target(f->p), 2.0, 0); /* at capacity */
    assert_int_equal(kvt_primary_num_entries(f->p), 2);
    assert_int_equal(UNLOAD(f, 3, 4), 0);
    kvt_primary_access_destroy(r1);
    kvt_primary_access_destroy(r2);
    fx_free(f);
}

/* An access recorded before reset_cache applies nothing; one recorded after it
 * does. */
static void test_access_before_reset_is_forgotten(void **state)
{
    struct fx *f = fx_make(4, "lru", false, 0);
    struct kvt_primary_access *r1, *r2;
    struct kvt_key order[4], k1 = kt_key(1), k2 = kt_key(2);

    assert_int_equal(kvt_primary_access_create(&r1), 0);
    assert_int_equal(kvt_primary_access_create(&r2), 0);
    assert_int_equal(rprep(f, r1, L(1), 0), 0);
    assert_int_equal(rprep(f, r2, L(2), 0), 0);
    kvt_primary_reset_cache(f->p);
    assert_int_equal(PREP(f, 1, 2, 3), 0);
    COMPLETE(f, 1, 2, 3);
    kvt_primary_request_finished(f->p, r1);     /* stale: 1 stays LRU */
    assert_int_equal(rprep(f, r2, L(2), 0), 0); /* after the reset: counts */
    kvt_primary_request_finished(f->p, r2);
    assert_int_equal(kvt_primary_policy_list(f->p, 0, order, 4), 3);
    assert_true(kvt_key_eq(&order[0], &k1));
    assert_true(kvt_key_eq(&order[2], &k2));
    kvt_primary_access_destroy(r1);
    kvt_primary_access_destroy(r2);
    fx_free(f);
}

/* With a request's access, a key offered twice in one prepare_store is stored
 * once, and a key offered by an earlier call of the same request that stored
 * nothing is no repeat. */
static void test_request_store_dedups_within_one_call_only(void **state)
{
    struct fx *f = fx_make(2, "lru", false, 0);
    struct kvt_primary_access *acc;
    struct kvt_key k1 = gkey(1, 0), k3 = gkey(3, 0), k4 = gkey(4, 0), k5 = gkey(5, 0);
    int64_t c[2];

    assert_int_equal(kvt_primary_access_create(&acc), 0);
    assert_int_equal(rprep(f, acc, L(3, 3, 1, 3), 0), 0);
    assert_int_equal(f->out.n_store, 2);
    assert_true(kvt_key_eq(&f->out.keys_to_store[0], &k3));
    assert_true(kvt_key_eq(&f->out.keys_to_store[1], &k1));
    complete_all(f);
    assert_int_equal(LOAD(f, c, 3, 1), 0);
    assert_int_equal(rprep(f, acc, L(4, 4), 0), -ENOSPC); /* both pinned */
    assert_int_equal(UNLOAD(f, 3, 1), 0);
    assert_int_equal(rprep(f, acc, L(4, 5, 4), 0), 0); /* 4 again: stored, once */
    assert_int_equal(f->out.n_store, 2);
    assert_true(kvt_key_eq(&f->out.keys_to_store[0], &k4));
    assert_true(kvt_key_eq(&f->out.keys_to_store[1], &k5));
    assert_int_equal(kvt_primary_num_write_pending(f->p), 2);
    kvt_primary_access_destroy(acc);
    fx_free(f);
}

/* complete_store with the request's access finds each key's slot whatever the
 * order, and never takes the slot its last prepare_store gave a key for the key
 * once another key holds it. */
static void test_request_complete_checks_the_slot_it_remembers(void **state)
{
    struct fx *f = fx_make(3, "lru", false, 0);
    struct kvt_primary_access *acc;
    struct kvt_key k[2] = {gkey(2, 0), gkey(1, 0)}, k5 = gkey(5, 0), k6 = gkey(6, 0);
    struct kvt_primary_entry_info a, b;

    assert_int_equal(kvt_primary_access_create(&acc), 0);
    assert_int_equal(rprep(f, acc, L(1, 2), 0), 0);
    assert_int_equal(kvt_primary_complete_store_strict(f->p, k, 2, true, acc), 0);
    assert_int_equal(kvt_primary_num_write_pending(f->p), 0);
    assert_int_equal(kvt_primary_num_evictable(f->p), 2);
    /* 5's slot freed by a failed store and taken by 6 */
    assert_int_equal(rprep(f, acc, L(5), 0), 0);
    assert_int_equal(kvt_primary_entry_info(f->p, &k5, &a), 0);
    assert_int_equal(kvt_primary_complete_store(f->p, &k5, 1, false), 0);
    assert_int_equal(kvt_primary_prepare_store(f->p, &k6, 1, &f->out), 0);
    assert_int_equal(kvt_primary_entry_info(f->p, &k6, &b), 0);
    assert_int_equal(a.slot, b.slot);
    assert_int_equal(kvt_primary_complete_store_strict(f->p, &k5, 1, true, acc), -EINVAL);
    assert_int_equal(kvt_primary_num_write_pending(f->p), 1); /* 6 untouched */
    assert_int_equal(rprep(f, acc, L(6), 0), 0);              /* pending: nothing to store */
    assert_int_equal(kvt_primary_complete_store_strict(f->p, &k6, 1, true, acc), 0);
    assert_int_equal(kvt_primary_num_write_pending(f->p), 0);
    assert_int_equal(kvt_primary_lookup(f->p, &k6), KVT_HIT);
    kvt_primary_access_destroy(acc);
    fx_free(f);
}

/* LRU, 2 chunks: r1 stores 1 and 2, then 3 (evicting its own 1); 1 comes back
 * by a store of another request (or none) before r1 finishes. r1's finish must
 * find 1 where it is now and make it the most recent; with 1 re-stored by r1
 * itself, the same. */
static void test_request_finish_finds_its_key_stored_again_by_another(void **state)
{
    for (int who = 0; who < 3; who++) { /* 1 stored again by: no request, r2, r1 */
        struct fx *f = fx_make(2, "lru", false, 0);
        struct kvt_primary_access *r1, *r2;
        struct kvt_key order[2], k1 = kt_key(1), k3 = kt_key(3);

        assert_int_equal(kvt_primary_access_create(&r1), 0);
        assert_int_equal(kvt_primary_access_create(&r2), 0);
        assert_int_equal(rprep(f, r1, L(1, 2), 0), 0);
        complete_all(f);
        assert_int_equal(rprep(f, r1, L(3), 0), 0); /* evicts 1 */
        complete_all(f);
        assert_int_equal(look(f, 1), KVT_MISS);
        assert_int_equal(rprep(f, who == 0 ? NULL : who == 1 ? r2 : r1, L(1), 0), 0); /* evicts 2 */
        complete_all(f);
        kvt_primary_request_finished(f->p, r1);
        assert_int_equal(kvt_primary_policy_list(f->p, 0, order, 2), 2);
        assert_true(kvt_key_eq(&order[0], &k3));
        assert_true(kvt_key_eq(&order[1], &k1)); /* most recent */
        kvt_primary_access_destroy(r1);
        kvt_primary_access_destroy(r2);
        fx_free(f);
    }
}

/* A finished request leaves its access's arrays to the next request, which must
 * not see the records in them: ARC, r1 stores 1, 2 and 3 and finishes; r2 (taking
 * r1's arrays) offers the ready 1 and 2 again, a reuse of each (T1 -> T2), and 4;
 * r3 the same after r2, with a reset in between for r4. */
static void test_request_access_arrays_start_empty_when_recycled(void **state)
{
    struct fx *f = fx_make(8, "arc", false, 0);
    struct kvt_primary_access *r1, *r2, *r3;

    assert_int_equal(kvt_primary_access_create(&r1), 0);
    assert_int_equal(rprep(f, r1, L(1, 2, 3), 0), 0);
    complete_all(f);
    kvt_primary_request_finished(f->p, r1);
    assert_true(in_list(f, 0, 1) && in_list(f, 0, 2) && in_list(f, 0, 3));
    assert_int_equal(kvt_primary_access_create(&r2), 0);
    assert_int_equal(rprep(f, r2, L(1, 2, 4), 0), 0);
    assert_int_equal(f->out.n_store, 1);
    complete_all(f);
    kvt_primary_request_finished(f->p, r2);
    assert_true(in_list(f, 1, 1) && in_list(f, 1, 2)); /* reused: T2 */
    assert_true(in_list(f, 0, 3) && in_list(f, 0, 4));
    assert_int_equal(kvt_primary_access_create(&r3), 0);
    assert_int_equal(rprep(f, r3, L(4, 3), 0), 0); /* r2's 4 and r1's 3: reuses */
    assert_int_equal(f->out.n_store, 0);
    kvt_primary_request_finished(f->p, r3);
    assert_true(in_list(f, 1, 3) && in_list(f, 1, 4));
    assert_int_equal(list_len(f, 0), 0);
    kvt_primary_access_destroy(r1);
    kvt_primary_access_destroy(r2);
    kvt_primary_access_destroy(r3);
    fx_free(f);
}

/* A request's store appends the records of absent keys without looking for them
 * only while no key it recorded can have left; once one has (another store
 * evicted it), its next offer of that key finds the record: ARC, r1 stores 1,
 * a store of 2 and 3 evicts it into B1, and r1 offering 1 again is no second store
 * miss of r1 (the target stays), while r2's first offer of a ghost is one. */
static void test_request_record_of_a_key_that_left_is_found_again(void **state)
{
    struct fx *f = fx_make(2, "arc", false, 0);
    struct kvt_primary_access *r1, *r2;

    assert_int_equal(kvt_primary_access_create(&r1), 0);
    assert_int_equal(kvt_primary_access_create(&r2), 0);
    assert_int_equal(rprep(f, r1, L(1), 0), 0);
    complete_all(f);
    assert_int_equal(PREP(f, 2, 3), 0); /* evicts 1 into B1 */
    COMPLETE(f, 2, 3);
    assert_int_equal(look(f, 1), KVT_MISS);
    assert_int_equal(ghost_of(f, 1), 1);
    assert_int_equal(rprep(f, r1, L(1), 0), 0); /* evicts 2 into B1 */
    assert_int_equal(f->out.n_store, 1);
    complete_all(f);
    assert_float_equal(kvt_primary_arc_target(f->p), 0.0, 0); /* r1 had its miss of 1 */
    assert_int_equal(ghost_of(f, 2), 1);
    assert_int_equal(rprep(f, r2, L(2), 0), 0);
    assert_float_equal(kvt_primary_arc_target(f->p), 1.0, 0); /* r2's first: adapts */
    complete_all(f);
    kvt_primary_request_finished(f->p, r1);
    kvt_primary_request_finished(f->p, r2);
    assert_int_equal(kvt_primary_num_entries(f->p), 2);
    kvt_primary_access_destroy(r1);
    kvt_primary_access_destroy(r2);
    fx_free(f);
}

/* A request's store of more keys than its short dedup scans (a table then) stores
 * each distinct key once, in first-offer order, in either form of the call. */
static void test_request_store_of_many_keys_dedups(void **state)
{
    enum { N = 100, DISTINCT = 70 };
    struct kvt_key k[N];

    for (int with_acc = 0; with_acc < 2; with_acc++) {
        struct fx *f = fx_make(128, "lru", false, 0);
        struct kvt_primary_access *acc = NULL;

        for (int i = 0; i < N; i++)
            k[i] = gkey(i < DISTINCT ? i : (i * 7) % DISTINCT, 0);
        if (with_acc)
            assert_int_equal(kvt_primary_access_create(&acc), 0);
        assert_int_equal(kvt_primary_prepare_store_req(f->p, k, N, acc, &f->out), 0);
        assert_int_equal(f->out.n_store, DISTINCT);
        for (int i = 0; i < DISTINCT; i++)
            assert_true(kvt_key_eq(&f->out.keys_to_store[i], &k[i]));
        complete_all(f);
        assert_int_equal(kvt_primary_num_entries(f->p), DISTINCT);
        kvt_primary_request_finished(f->p, acc);
        kvt_primary_access_destroy(acc);
        fx_free(f);
    }
}

/* A touch moves only present ready keys; pending keys and ghosts stay. */
static void test_touch_moves_ready_keys_only(void **state)
{
    struct fx *f = fx_make(3, "arc", false, 0);

    assert_int_equal(PREP(f, 1, 2), 0);
    COMPLETE(f, 1);
    TOUCH(f, 1, 2);
    assert_true(in_list(f, 1, 1)); /* ready: to T2 */
    assert_true(in_list(f, 0, 2)); /* being written: stays in T1 */
    COMPLETE(f, 2);
    fx_free(f);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_already_stored_block_not_evicted_during_prepare_store_lru),
        cmocka_unit_test(test_already_stored_block_not_evicted_during_prepare_store_arc),
        cmocka_unit_test(test_cpu_manager_reports_cache_usage_gauge),
        cmocka_unit_test(test_cpu_manager),
        cmocka_unit_test(test_prepare_load_preserves_key_order),
        cmocka_unit_test(test_arc_basic),
        cmocka_unit_test(test_arc_t1_to_t2_promotion),
        cmocka_unit_test(test_arc_eviction_with_load),
        cmocka_unit_test(test_arc_adaptive_target),
        cmocka_unit_test(test_arc_adaptive_target_b2_hit_decreases),
        cmocka_unit_test(test_arc_t1_t2_eviction_policy),
        cmocka_unit_test(test_arc_t2_eviction_when_t1_below_target),
        cmocka_unit_test(test_arc_ghost_list_bounds),
        cmocka_unit_test(test_arc_touch_ordering),
        cmocka_unit_test(test_arc_failed_store),
        cmocka_unit_test(test_arc_full_scenario),
        cmocka_unit_test(test_evictable_cache_block_count),
        cmocka_unit_test(test_lru_touch_reverses_prefix),
        cmocka_unit_test(test_misuse_is_einval_and_changes_nothing),
        cmocka_unit_test(test_empty_prepare_store_is_empty_not_failure),
        cmocka_unit_test(test_duplicate_keys_in_one_store_take_one_slot),
        cmocka_unit_test(test_small_store_after_large_one_stores_every_key),
        cmocka_unit_test(test_failed_eviction_is_atomic),
        cmocka_unit_test(test_generation_changes_on_every_reuse),
        cmocka_unit_test(test_checksum_on_complete),
        cmocka_unit_test(test_checksum_set_while_pending),
        cmocka_unit_test(test_stats_split_read_and_write),
        cmocka_unit_test(test_index_under_churn),
        cmocka_unit_test(test_store_inserts_where_its_finds_ended),
        cmocka_unit_test(test_request_access_arrays_start_empty_when_recycled),
        cmocka_unit_test(test_request_record_of_a_key_that_left_is_found_again),
        cmocka_unit_test(test_request_store_of_many_keys_dedups),
        cmocka_unit_test(test_create_rejects_bad_config),
        cmocka_unit_test(test_create_unwinds_on_allocation_failure),
        cmocka_unit_test(test_lookup_many_matches_lookup),
        cmocka_unit_test(test_arc_matches_reference_model),
        cmocka_unit_test(test_request_finish_orders_keys_by_group),
        cmocka_unit_test(test_request_reuse_of_its_own_insert_is_not_reuse),
        cmocka_unit_test(test_store_miss_adapts_once_per_request),
        cmocka_unit_test(test_access_before_reset_is_forgotten),
        cmocka_unit_test(test_touch_moves_ready_keys_only),
        cmocka_unit_test(test_request_store_dedups_within_one_call_only),
        cmocka_unit_test(test_request_complete_checks_the_slot_it_remembers),
        cmocka_unit_test(test_request_finish_finds_its_key_stored_again_by_another),
        cmocka_unit_test(test_fence_words_follow_every_write),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

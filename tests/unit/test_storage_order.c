/* SPDX-License-Identifier: Apache-2.0 */
/* The order in which the storage tier's I/O threads take work (issue 7: "a pool of
 * read and write threads, shortest-job-first queues, reads preferred";
 * vLLM's DualQueueThreadPool and fs/policy.py):
 * - stores: shortest job first over 32 log2(bytes) buckets, first come first served
 *   inside a bucket;
 * - loads: alternately first come first served and shortest first ("ping-pong"),
 *   starting with first come;
 * - reads preferred: a read thread takes no store while a load is queued, and a
 *   write thread never takes a load.
 * The threads are held (pause), jobs of different sizes are queued in a scrambled
 * order, the threads are released, and a hook in the pool (storage_int.h) records
 * each task as it is taken off its queue, under the pool's mutex, so the record is
 * the exact order. One read and one write thread; each job is one task (a load is
 * split over the read threads, a LOCAL store is never split). Run with and without
 * io_uring: the ring reader has its own loop. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "test_util.h"

#include "../../tiering/storage_int.h"
#include "kvt/common.h"
#include "kvt/storage_tier.h"
#include "kvt/storage_tier_test.h"
#include "kvt/tier.h"

#define ROW   4096u
#define SLOTS 128
#define MAX_T 64
#define N_PRE 32 /* keys stored first, for the loads */

struct took_rec {
    bool reader;
    enum st_kind kind;
    size_t n; /* items in the task = job size */
};

struct order_fx {
    char *root;
    struct kvt_tier *t;
    uint8_t *mem;
    struct kvt_job jobs[MAX_T];
    struct kvt_key keys[MAX_T][16];
    int64_t chunks[MAX_T][16];
    int n_jobs, n_reported, n_failed;
    struct took_rec rec[MAX_T];
    int n_rec;
};

static void on_take(void *arg, const struct st_thread *th, const struct st_task *t)
{
    struct order_fx *f = arg;
    if (f->n_rec < MAX_T)
        f->rec[f->n_rec] = (struct took_rec){th->reader, t->sj->kind, t->end - t->begin};
    f->n_rec++;
}

static void on_result(void *arg, const struct kvt_job_result *r)
{
    struct order_fx *f = arg;
    f->n_reported++;
    if (!r->success)
        f->n_failed++;
}

static struct order_fx *ofx_new(bool no_uring)
{
    struct order_fx *f = calloc(1, sizeof(*f));
    struct kvt_storage_tier_config c = {.n_read_threads = 1,
                                        .n_write_threads = 1,
                                        .no_io_uring = no_uring,
                                        .no_backpressure = true};
    struct kvt_storage_tier_info info;
    assert_non_null(f);
    f->root = kt_tmpdir("storage-order");
    f->mem = aligned_alloc(4096, (size_t)SLOTS * ROW);
    assert_non_null(f->mem);
    for (size_t i = 0; i < (size_t)SLOTS * ROW; i++)
        f->mem[i] = (uint8_t)(i * 131 + 7);
    c.root = f->root;
    memset(c.namespace_id, 0x5c, sizeof(c.namespace_id));
    assert_int_equal(kvt_storage_tier_create(&c, &f->t), 0);
    f->t->index = 0;
    f->t->row_bytes = ROW;
    f->t->primary_base = f->mem;
    f->t->num_chunks = SLOTS;
    kvt_storage_tier_info(f->t, &info);
    if (no_uring)
        assert_false(info.io_uring);
    else if (!info.io_uring)
        print_message("io_uring refused on this machine: the blocking path ran twice\n");
    return f;
}

static void ofx_free(struct order_fx *f)
{
    char cmd[4200];
    kvt_tier_shutdown(f->t);
    kvt_tier_destroy(f->t);
    snprintf(cmd, sizeof(cmd), "rm -rf '%s'", f->root);
    assert_int_equal(system(cmd), 0);
    free(f->mem);
    free(f->root);
    free(f);
}

/* A job of n keys kt_key(first..) at slots slot0..; returns nothing, counted. */
static void ofx_submit(struct order_fx *f, bool load, int first, size_t n, int64_t slot0)
{
    int id = f->n_jobs++;
    struct kvt_job *j = &f->jobs[id];
    assert_true(id < MAX_T && n <= 16);
    for (size_t i = 0; i < n; i++) {
        f->keys[id][i] = kt_key(first + (int)i);
        f->chunks[id][i] = slot0 + (int64_t)i;
    }
    *j = (struct kvt_job){.id = (kvt_job_id_t)id + 1,
                          .n = n,
                          .keys = f->keys[id],
                          .chunk_ids = f->chunks[id],
                          .is_promotion = load};
    if (load)
        kvt_tier_submit_load(f->t, j);
    else
        kvt_tier_submit_store(f->t, j);
}

static void ofx_settle(struct order_fx *f)
{
    kvt_storage_tier_wait_idle(f->t);
    kvt_tier_get_finished_jobs(f->t, on_result, f);
}

static void check_order(bool no_uring)
{
    /* Job sizes in submission order. Store sizes 3 and 2 share the 8-12 KiB bucket
     * (log2 of 12288 and 8192 is 13): first come first served there. */
    static const size_t load_n[] = {8, 4, 1, 16, 2};
    /* FCFS 8, SJF 1, FCFS 4, SJF 2, FCFS 16: neither pure FCFS nor pure SJF. */
    static const size_t want_loads[] = {8, 1, 4, 2, 16};
    static const size_t store_n[] = {8, 1, 4, 3, 2};
    static const size_t want_stores[] = {1, 3, 2, 4, 8};
    struct order_fx *f = ofx_new(no_uring);
    size_t loads_seen = 0, stores_seen = 0, key = 0;
    int64_t slot = 0;
    bool reader_took_store = false;

    /* The keys the loads read: stored first, from slots 0..N_PRE-1. */
    ofx_submit(f, false, 0, 16, 0);
    ofx_submit(f, false, 16, 16, 16);
    ofx_settle(f);
    assert_int_equal(f->n_reported, 2);
    assert_int_equal(f->n_failed, 0);

    kvt_storage_tier_pause(f->t, true);
    kvt__st_pool_set_take_hook(KVT_CONTAINER_OF(f->t, struct st_tier, base), on_take, f);
    /* Loads into slots 32.., stores of new keys 1000.. from slots 64.. */
    slot = 32;
    for (size_t i = 0; i < KVT_ARRAY_SIZE(load_n); i++) {
        ofx_submit(f, true, (int)(key % N_PRE), load_n[i], slot);
        key += load_n[i];
        slot += (int64_t)load_n[i];
    }
    slot = 64;
    key = 1000;
    for (size_t i = 0; i < KVT_ARRAY_SIZE(store_n); i++) {
        ofx_submit(f, false, (int)key, store_n[i], slot);
        key += store_n[i];
        slot += (int64_t)store_n[i];
    }
    assert_int_equal(f->n_rec, 0); /* nothing taken while paused */
    kvt_storage_tier_pause(f->t, false);
    ofx_settle(f);
    kvt__st_pool_set_take_hook(KVT_CONTAINER_OF(f->t, struct st_tier, base), NULL, NULL);

    assert_int_equal(f->n_reported, 2 + (int)KVT_ARRAY_SIZE(load_n) + (int)KVT_ARRAY_SIZE(store_n));
    assert_int_equal(f->n_failed, 0);
    assert_int_equal(f->n_rec, (int)(KVT_ARRAY_SIZE(load_n) + KVT_ARRAY_SIZE(store_n)));
    for (int i = 0; i < f->n_rec; i++) {
        const struct took_rec *r = &f->rec[i];
        if (r->kind == ST_LOAD) {
            /* Reads preferred: only read threads take loads, and a read thread has
             * taken no store while a load was still queued. */
            assert_true(r->reader);
            assert_false(reader_took_store);
            assert_true(loads_seen < KVT_ARRAY_SIZE(want_loads));
            assert_int_equal(r->n, want_loads[loads_seen]);
            loads_seen++;
        } else {
            assert_int_equal(r->kind, ST_STORE);
            if (r->reader)
                reader_took_store = true;
            assert_true(stores_seen < KVT_ARRAY_SIZE(want_stores));
            assert_int_equal(r->n, want_stores[stores_seen]);
            stores_seen++;
        }
    }
    assert_int_equal(loads_seen, KVT_ARRAY_SIZE(want_loads));
    assert_int_equal(stores_seen, KVT_ARRAY_SIZE(want_stores));
    ofx_free(f);
}

static void test_order_io_uring(void **state)
{
    (void)state;
    check_order(false);
}

static void test_order_thread_pool(void **state)
{
    (void)state;
    check_order(true);
}

/* Reads preferred, seen from one read thread alone: with a write thread busy or not,
 * every queued load is taken before the read thread's first store. Here the write
 * thread is kept out of it: stores queued behind loads, and loads queued after
 * stores, are all taken load-first by the read thread. */
static void test_read_thread_takes_loads_first(void **state)
{
    struct order_fx *f = ofx_new(true);
    int first_store = -1, last_load = -1;
    (void)state;
    ofx_submit(f, false, 0, 16, 0);
    ofx_settle(f);
    kvt_storage_tier_pause(f->t, true);
    kvt__st_pool_set_take_hook(KVT_CONTAINER_OF(f->t, struct st_tier, base), on_take, f);
    /* Stores first, then loads: arrival order must not matter. */
    for (int i = 0; i < 6; i++)
        ofx_submit(f, false, 2000 + 16 * i, 1, 64 + i);
    for (int i = 0; i < 6; i++)
        ofx_submit(f, true, 2 * i, 2, 32 + 2 * i);
    kvt_storage_tier_pause(f->t, false);
    ofx_settle(f);
    kvt__st_pool_set_take_hook(KVT_CONTAINER_OF(f->t, struct st_tier, base), NULL, NULL);
    assert_int_equal(f->n_failed, 0);
    assert_int_equal(f->n_rec, 12);
    for (int i = 0; i < f->n_rec; i++) {
        if (!f->rec[i].reader) {
            assert_int_equal(f->rec[i].kind, ST_STORE); /* write threads never load */
            continue;
        }
        if (f->rec[i].kind == ST_LOAD)
            last_load = i;
        else if (first_store < 0)
            first_store = i;
    }
    assert_true(last_load >= 0);
    if (first_store >= 0)
        assert_true(first_store > last_load);
    ofx_free(f);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_order_io_uring),
        cmocka_unit_test(test_order_thread_pool),
        cmocka_unit_test(test_read_thread_takes_loads_first),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

/* SPDX-License-Identifier: Apache-2.0 */
/* The local engine API end to end: kvtierd's server (kvt/engine_api.h) on a thread
 * of its own that owns the manager, engines as libkvtier-client connections (in
 * this process, in threads, in forked children). The manager's scenarios through
 * the socket: store, lookup, load, with bytes written by one client into its
 * mapped rows read back by another; the misuse the manager and the server refuse;
 * several engines at once; an engine SIGKILLed while it holds prepared stores and
 * pins; malformed and oversized frames; stale and taken socket paths.
 *
 * The server thread runs progress() under g.lock; the tests take g.lock to look at
 * the manager, so every access to it is ordered (TSan). */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "test_util.h"

#include "kvt/alloc.h"
#include "kvt/clock.h"
#include "kvt/engine_api.h"
#include "kvt/example_tier.h"
#include "kvt/log.h"
#include "kvt/manager.h"
#include "kvt/manager_test.h"
#include "kvt/primary.h"
#include "kvt/region.h"
#include "kvtier/client.h"
#include "kvtier/engine_proto.h"

#define NUM_CHUNKS 16
#define WORKERS    2

static struct {
    char *dir;
    char sock[256];
    char region_path[256];
    size_t page;
    struct kvt_manager *m;
    struct kvt_engine_server *srv;
    pthread_t thread;
    pthread_mutex_t lock;
    volatile int stop;
    struct kvt_tier *tiers[1]; /* the next start's secondary tiers (the manager owns them) */
    size_t n_tiers;
} g;

static void *server_main(void *arg)
{
    (void)arg;
    while (!__atomic_load_n(&g.stop, __ATOMIC_ACQUIRE)) {
        struct pollfd p = {.fd = kvt_engine_server_fd(g.srv), .events = POLLIN};

        poll(&p, 1, 5);
        pthread_mutex_lock(&g.lock);
        assert_int_equal(kvt_engine_server_progress(g.srv), 0);
        pthread_mutex_unlock(&g.lock);
    }
    return NULL;
}

/* Starts a server whose limits (max_*, hello_timeout_ms, socket mode and group) are
 * lim's; the rest is the test's. */
static void start_with(const struct kvt_engine_server_config *lim)
{
    static unsigned seq;
    struct kvt_region *r = kvt_calloc(1, sizeof(*r));
    struct kvt_primary *p;
    struct kvt_region_config rc = {.num_chunks = NUM_CHUNKS,
                                   .num_workers = WORKERS,
                                   .rank = KVT_REGION_RANK_ALL,
                                   .join_timeout_s = 5};
    struct kvt_primary_config pc = {.num_chunks = NUM_CHUNKS, .enable_events = true};
    struct kvt_engine_server_config sc = *lim;

    g.page = (size_t)sysconf(_SC_PAGESIZE);
    snprintf(g.region_path, sizeof(g.region_path), "%s/region.%u", g.dir, seq);
    snprintf(g.sock, sizeof(g.sock), "%s/engine.%u.sock", g.dir, seq++);
    rc.path = g.region_path;
    rc.page_bytes = g.page;
    assert_int_equal(kvt_region_open(&rc, r), 0);
    pc.row_bytes = r->row_bytes;
    assert_int_equal(kvt_primary_create(&pc, r, &p), 0);
    assert_int_equal(kvt_manager_create(p, g.tiers, g.n_tiers, &g.m), 0);
    sc.socket_path = g.sock;
    sc.manager = g.m;
    assert_int_equal(kvt_engine_server_create(&sc, &g.srv), 0);
    g.stop = 0;
    pthread_mutex_init(&g.lock, NULL);
    assert_int_equal(pthread_create(&g.thread, NULL, server_main, NULL), 0);
}

static void start(unsigned max_clients, uint32_t max_msg)
{
    start_with(
        &(struct kvt_engine_server_config){.max_clients = max_clients, .max_msg_bytes = max_msg});
}

static void stop(void)
{
    __atomic_store_n(&g.stop, 1, __ATOMIC_RELEASE);
    pthread_join(g.thread, NULL);
    kvt_engine_server_destroy(g.srv);
    assert_int_equal(access(g.sock, F_OK), -1); /* unlinked */
    kvt_manager_shutdown(g.m);
    kvt_manager_destroy(g.m);
    pthread_mutex_destroy(&g.lock);
    g.n_tiers = 0;
}

static int setup(void **state)
{
    (void)state;
    start(0, 0);
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    stop();
    return 0;
}

static struct kvtier_client *conn(const char *name)
{
    struct kvtier_client *c = NULL;
    struct kvtier_connect_opts o = {.name = name, .timeout_ms = 10000};

    assert_int_equal(kvtier_connect(g.sock, &o, &c), 0);
    return c;
}

static struct kvtier_key key(int i)
{
    struct kvtier_key k;
    struct kvt_key kk = kt_key(i);

    assert_int_equal(kvtier_key_set(&k, kk.bytes, kk.len), 0);
    return k;
}

static void keys(struct kvtier_key *out, int first, size_t n)
{
    for (size_t i = 0; i < n; i++)
        out[i] = key(first + (int)i);
}

static struct kvt_primary_entry_info entry(int i)
{
    struct kvt_primary_entry_info info = {.slot = -1, .ref_cnt = -99};
    struct kvt_key k = kt_key(i);

    pthread_mutex_lock(&g.lock);
    if (kvt_primary_entry_info(kvt_manager_primary(g.m), &k, &info) != 0)
        info.ref_cnt = -99; /* absent */
    pthread_mutex_unlock(&g.lock);
    return info;
}

static struct kvt_engine_server_counters counters(void)
{
    struct kvt_engine_server_counters c;

    pthread_mutex_lock(&g.lock);
    kvt_engine_server_get_counters(g.srv, &c);
    pthread_mutex_unlock(&g.lock);
    return c;
}

static bool has_request(const char *id)
{
    bool has;

    pthread_mutex_lock(&g.lock);
    has = kvt_manager_has_request(g.m, id);
    pthread_mutex_unlock(&g.lock);
    return has;
}

/* Waits (up to 10 s) until the server has seen `n` disconnects. */
static void wait_disconnects(uint64_t n)
{
    for (int i = 0; i < 2000 && counters().disconnects < n; i++)
        usleep(5000);
    assert_true(counters().disconnects >= n);
}

/* Stores keys first..first+n-1 through c with row bytes fill+i; returns 0 or the
 * error of prepare_store. */
static int store(struct kvtier_client *c, const char *req, int first, size_t n, uint8_t fill)
{
    struct kvtier_key k[8];
    uint32_t idx[8];
    int64_t ids[8];
    struct kvtier_store_plan plan = {.store_index = idx, .chunk_ids = ids};
    const struct kvtier_region *r = kvtier_client_region(c);
    int rc;

    assert_true(n <= 8);
    keys(k, first, n);
    rc = kvtier_prepare_store(c, req, k, n, &plan);
    if (rc != 0)
        return rc;
    for (size_t i = 0; i < plan.n_store; i++) {
        uint8_t *row = kvtier_client_row(c, ids[i]);

        assert_non_null(row);
        memset(row, fill + (int)idx[i], r->row_bytes);
    }
    return kvtier_complete_store(c, req, k, n, true);
}

/* ---- scenarios ----------------------------------------------------------------- */

static void test_hello_geometry(void **state)
{
    struct kvtier_client *c = conn("geo");
    const struct kvtier_region *r = kvtier_client_region(c);

    assert_int_equal(r->num_chunks, NUM_CHUNKS);
    assert_int_equal(r->num_workers, WORKERS);
    assert_int_equal(r->page_bytes, g.page);
    assert_int_equal(r->row_bytes, WORKERS * g.page);
    assert_int_equal(r->size, NUM_CHUNKS * WORKERS * g.page);
    assert_non_null(r->base);
    assert_true(kvtier_client_id(c) > 0);
    assert_true(kvtier_client_max_keys(c) >= 1024);
    assert_null(kvtier_client_row(c, NUM_CHUNKS));
    assert_null(kvtier_client_row(c, -1));
    assert_int_equal(counters().clients, 1);
    kvtier_close(c);
    wait_disconnects(1);
    assert_int_equal(counters().clients, 0);
}

/* Engine A stores, engine B finds and loads the very bytes A wrote. */
static void test_store_lookup_load_across_clients(void **state)
{
    struct kvtier_client *a = conn("a"), *b = conn("b");
    struct kvtier_key k[3];
    uint8_t res[3];
    int64_t ids[3];
    size_t done = 99;
    enum kvtier_offload_policy pol = KVTIER_REQUEST_LEVEL;

    keys(k, 0, 3);
    assert_int_equal(kvtier_on_new_request(a, "a-1", NULL, &pol), 0);
    assert_int_equal(pol, KVTIER_CHUNK_LEVEL);
    assert_int_equal(kvtier_lookup(a, "a-1", k, 3, 0, res, &done), 0);
    assert_int_equal(done, 3);
    for (int i = 0; i < 3; i++)
        assert_int_equal(res[i], KVTIER_MISS);

    /* prepare_store: write-pending until complete_store. */
    uint32_t idx[3];
    int64_t sids[3];
    struct kvtier_key ev[4];
    struct kvtier_store_plan plan = {
        .store_index = idx, .chunk_ids = sids, .evicted = ev, .cap_evicted = 4};
    assert_int_equal(kvtier_prepare_store(a, "a-1", k, 2, &plan), 0);
    assert_int_equal(plan.n_store, 2);
    assert_int_equal(plan.n_evicted, 0);
    assert_int_equal(entry(0).ref_cnt, -1);
    assert_int_equal(kvtier_lookup(b, "nobody", k, 1, 0, res, NULL), -EINVAL);
    assert_int_equal(kvtier_on_new_request(b, "b-1", NULL, NULL), 0);
    assert_int_equal(kvtier_lookup(b, "b-1", k, 1, 0, res, NULL), 0);
    assert_int_equal(res[0], KVTIER_HIT_PENDING);
    for (size_t i = 0; i < plan.n_store; i++) {
        assert_true(sids[i] >= 0 && sids[i] < NUM_CHUNKS);
        memset(kvtier_client_row(a, sids[i]), 0xa0 + (int)idx[i], WORKERS * g.page);
    }
    assert_int_equal(kvtier_complete_store(a, "a-1", k, 2, true), 0);
    assert_int_equal(entry(0).ref_cnt, 0);
    assert_int_equal(kvtier_on_schedule_end(a, NULL, 0, NULL, 0), 0);

    /* B: HIT HIT MISS, with prefix matching it stops at the MISS. */
    assert_int_equal(kvtier_lookup(b, "b-1", k, 3, KVTIER_LOOKUP_PREFIX, res, &done), 0);
    assert_int_equal(done, 3);
    assert_int_equal(res[0], KVTIER_HIT);
    assert_int_equal(res[1], KVTIER_HIT);
    assert_int_equal(res[2], KVTIER_MISS);
    struct kvtier_key k2[3] = {k[2], k[0], k[1]};
    assert_int_equal(kvtier_lookup(b, "b-1", k2, 3, KVTIER_LOOKUP_PREFIX, res, &done), 0);
    assert_int_equal(done, 1);
    assert_int_equal(res[0], KVTIER_MISS);

    /* B loads and sees A's bytes in its own mapping. */
    assert_int_equal(kvtier_prepare_load(b, "b-1", k, 2, ids), 0);
    assert_int_equal(entry(0).ref_cnt, 1);
    assert_int_equal(entry(1).ref_cnt, 1);
    for (int i = 0; i < 2; i++) {
        const uint8_t *row = kvtier_client_row(b, ids[i]);

        assert_int_equal(ids[i], entry(i).slot);
        for (size_t j = 0; j < WORKERS * g.page; j += 511)
            assert_int_equal(row[j], 0xa0 + i);
    }
    /* A may not unpin B's pins; B may. */
    assert_int_equal(kvtier_complete_load(a, NULL, k, 2), -EINVAL);
    assert_int_equal(entry(0).ref_cnt, 1);
    assert_int_equal(kvtier_complete_load(b, "b-1", k, 2), 0);
    assert_int_equal(entry(0).ref_cnt, 0);
    assert_int_equal(kvtier_complete_load(b, "b-1", k, 1), -EINVAL);
    assert_int_equal(kvtier_touch(b, NULL, k, 2), 0);

    assert_int_equal(kvtier_on_request_finished(a, "a-1"), 0);
    assert_int_equal(kvtier_on_request_finished(b, "b-1"), 0);
    assert_false(has_request("a-1"));
    assert_false(has_request("b-1"));
    kvtier_close(a);
    kvtier_close(b);
}

static void test_misuse_refused(void **state)
{
    struct kvtier_client *a = conn("a"), *b = conn("b");
    struct kvtier_key k[2], bad;
    int64_t ids[2];
    uint8_t res[2];
    uint32_t idx[2];
    struct kvtier_store_plan plan = {.store_index = idx, .chunk_ids = ids};

    keys(k, 10, 2);
    assert_int_equal(kvtier_on_new_request(a, "m-1", NULL, NULL), 0);
    assert_int_equal(kvtier_on_new_request(a, "m-1", NULL, NULL), -EEXIST);
    assert_int_equal(kvtier_on_new_request(b, "m-1", NULL, NULL), -EEXIST);
    /* B cannot use A's request. */
    assert_int_equal(kvtier_lookup(b, "m-1", k, 2, 0, res, NULL), -EINVAL);
    assert_int_equal(kvtier_prepare_store(b, "m-1", k, 2, &plan), -EINVAL);
    assert_int_equal(kvtier_on_request_finished(b, "m-1"), -EINVAL);
    assert_int_equal(kvtier_touch(b, "m-1", k, 2), -EINVAL);
    assert_true(has_request("m-1"));
    /* complete_store with nothing prepared; loading what is not stored. */
    assert_int_equal(kvtier_complete_store(a, "m-1", k, 2, true), -EINVAL);
    assert_int_equal(kvtier_prepare_load(a, "m-1", k, 2, ids), -EINVAL);
    assert_int_equal(entry(10).ref_cnt, -99);
    /* Arguments the library refuses before sending. */
    memset(&bad, 0, sizeof(bad));
    assert_int_equal(kvtier_lookup(a, "m-1", &bad, 1, 0, res, NULL), -EINVAL);
    assert_int_equal(kvtier_on_new_request(a, "", NULL, NULL), -EINVAL);
    assert_int_equal(kvtier_key_set(&bad, "x", 65), -EINVAL);
    assert_int_equal(kvtier_lookup(a, "m-1", k, 2, 0x80, res, NULL), -EINVAL);
    /* The connection is still good after refusals. */
    assert_int_equal(store(a, "m-1", 10, 2, 1), 0);
    assert_int_equal(entry(10).ref_cnt, 0);
    assert_int_equal(kvtier_on_request_finished(a, "m-1"), 0);
    assert_int_equal(kvtier_on_request_finished(a, "m-1"), -EINVAL);
    assert_int_equal(counters().malformed, 0);
    kvtier_close(a);
    kvtier_close(b);
}

/* The primary full of pinned chunks: prepare_store answers -ENOSPC, nothing changes. */
static void test_prepare_store_enospc(void **state)
{
    struct kvtier_client *a = conn("a");
    struct kvtier_key k[8];
    int64_t ids[8];

    assert_int_equal(kvtier_on_new_request(a, "f-1", NULL, NULL), 0);
    for (int i = 0; i < NUM_CHUNKS; i += 8) {
        assert_int_equal(store(a, "f-1", 100 + i, 8, 0), 0);
        keys(k, 100 + i, 8);
        assert_int_equal(kvtier_prepare_load(a, "f-1", k, 8, ids), 0);
    }
    struct kvtier_store_plan plan = {.store_index = (uint32_t[1]){0}, .chunk_ids = ids};
    k[0] = key(200);
    assert_int_equal(kvtier_prepare_store(a, "f-1", k, 1, &plan), -ENOSPC);
    assert_int_equal(entry(200).ref_cnt, -99);
    /* Unpin one batch: now the store evicts. */
    keys(k, 100, 8);
    assert_int_equal(kvtier_complete_load(a, "f-1", k, 8), 0);
    struct kvtier_key ev[1];
    plan.evicted = ev;
    plan.cap_evicted = 1;
    k[0] = key(200);
    assert_int_equal(kvtier_prepare_store(a, "f-1", k, 1, &plan), 0);
    assert_int_equal(plan.n_store, 1);
    assert_int_equal(plan.n_evicted, 1);
    assert_true(ev[0].len > 0);
    assert_int_equal(kvtier_complete_store(a, "f-1", k, 1, false), 0);
    assert_int_equal(entry(200).ref_cnt, -99); /* a failed store frees the slot */
    kvtier_close(a);                           /* the other pins are released by the server */
    wait_disconnects(1);
    assert_int_equal(entry(108).ref_cnt, 0);
    assert_false(has_request("f-1"));
}

static void test_events_and_stats(void **state)
{
    struct kvtier_client *a = conn("a");
    struct kvtier_events *ev = NULL;
    struct kvtier_stats *st = NULL;

    assert_int_equal(kvtier_on_new_request(a, "e-1", NULL, NULL), 0);
    assert_int_equal(store(a, "e-1", 300, 3, 0), 0);
    assert_int_equal(kvtier_take_events(a, &ev), 0);
    assert_int_equal(ev->n, 1);
    assert_int_equal(ev->ev[0].n, 3);
    assert_false(ev->ev[0].removed);
    assert_int_equal(ev->ev[0].medium, KVTIER_MEDIUM_CPU);
    struct kvtier_key k = key(301);
    assert_memory_equal(&ev->ev[0].keys[1], &k, sizeof(k));
    kvtier_events_free(ev);
    assert_int_equal(kvtier_take_events(a, &ev), 0);
    assert_int_equal(ev->n, 0);
    kvtier_events_free(ev);

    assert_int_equal(kvtier_get_stats(a, &st), 0);
    assert_true(st->n > 0);
    assert_true(st->bounds[0] > 0);
    for (size_t i = 0; i < st->n; i++)
        assert_true(strlen(st->s[i].name) > 0);
    /* Each histogram with its own buckets: vLLM's for the allocation sizes. */
    {
        bool seen = false;

        assert_non_null(st->stat_bounds);
        for (size_t i = 0; i < st->n; i++) {
            const struct kvtier_stat *h = &st->s[i];
            const struct kvtier_hist_bounds *hb = &st->stat_bounds[i];

            if (h->kind != KVTIER_HISTOGRAM) {
                assert_int_equal(hb->n, 0);
                continue;
            }
            if (strcmp(h->name, "vllm:kv_offload_cpu_allocation_size") != 0)
                continue;
            seen = true;
            assert_int_equal(hb->n, 10);
            assert_true(hb->bound[0] == 1 && hb->bound[9] == 262144);
            assert_int_equal(h->buckets[1], 1); /* one prepare_store of 3 keys */
        }
        assert_true(seen);
    }
    kvtier_stats_free(st);
    st = NULL; /* this server keeps no totals (no total_stats hook) */
    assert_int_equal(kvtier_get_stats_totals(a, &st), -EOPNOTSUPP);
    assert_null(st);
    assert_int_equal(kvtier_on_request_finished(a, "e-1"), 0);
    kvtier_close(a);
}

/* ---- several engines ------------------------------------------------------------- */

#define ENGINES 4
#define ROUNDS  25

struct engine_arg {
    int idx;
    int errors;
    int loads; /* loaded and verified */
};

static void *engine_main(void *p)
{
    struct engine_arg *a = p;
    char name[16], req[32];
    struct kvtier_client *c = NULL;

    snprintf(name, sizeof(name), "eng%d", a->idx);
    if (kvtier_connect(g.sock, &(struct kvtier_connect_opts){.name = name}, &c) != 0) {
        a->errors++;
        return NULL;
    }
    size_t row = kvtier_client_region(c)->row_bytes;
    for (int r = 0; r < ROUNDS; r++) {
        int base = 1000 + a->idx * 1000 + r * 2;
        struct kvtier_key k[2];
        int64_t ids[2];
        uint8_t res[2];

        snprintf(req, sizeof(req), "eng%d-%d", a->idx, r);
        keys(k, base, 2);
        if (kvtier_on_new_request(c, req, NULL, NULL) != 0)
            a->errors++;
        int rc = store(c, req, base, 2, (uint8_t)(a->idx * 16));
        if (rc != 0 && rc != -ENOSPC)
            a->errors++;
        if (rc == 0 && kvtier_lookup(c, req, k, 2, 0, res, NULL) == 0 && res[0] == KVTIER_HIT &&
            res[1] == KVTIER_HIT) {
            /* Between the lookup and the pin another engine's store may evict
             * the keys (16 chunks for 4 engines): then the pin is refused. */
            rc = kvtier_prepare_load(c, req, k, 2, ids);
            if (rc != 0) {
                if (rc != -EINVAL)
                    a->errors++;
            } else {
                a->loads++;
                for (int i = 0; i < 2; i++) {
                    const uint8_t *b = kvtier_client_row(c, ids[i]);
                    if (b[0] != (uint8_t)(a->idx * 16 + i) || b[row - 1] != b[0])
                        a->errors++;
                }
                if (kvtier_complete_load(c, req, k, 2) != 0)
                    a->errors++;
            }
        }
        if (kvtier_on_schedule_end(c, (const char *const[]){req}, 1, NULL, 0) != 0)
            a->errors++;
        if (kvtier_on_request_finished(c, req) != 0)
            a->errors++;
    }
    kvtier_close(c);
    return NULL;
}

static void test_several_engines(void **state)
{
    pthread_t t[ENGINES];
    struct engine_arg a[ENGINES];

    for (int i = 0; i < ENGINES; i++) {
        a[i] = (struct engine_arg){.idx = i};
        assert_int_equal(pthread_create(&t[i], NULL, engine_main, &a[i]), 0);
    }
    int loads = 0;
    for (int i = 0; i < ENGINES; i++) {
        pthread_join(t[i], NULL);
        assert_int_equal(a[i].errors, 0);
        loads += a[i].loads;
    }
    assert_true(loads > 0);
    wait_disconnects(ENGINES);
    pthread_mutex_lock(&g.lock);
    assert_int_equal(kvt_manager_num_requests(g.m), 0);
    assert_int_equal(kvt_primary_num_write_pending(kvt_manager_primary(g.m)), 0);
    assert_int_equal(kvt_primary_num_evictable(kvt_manager_primary(g.m)),
                     kvt_primary_num_entries(kvt_manager_primary(g.m)));
    pthread_mutex_unlock(&g.lock);
    assert_true(counters().requests >= ENGINES * ROUNDS * 4);
}

/* ---- an engine killed mid-request ---------------------------------------------------- */

static void test_client_killed_mid_request(void **state)
{
    struct kvtier_client *a = conn("parent");
    int pfd[2];
    pid_t pid;
    char ch;

    /* Chunks 500..501 are ready; the child will pin them. */
    assert_int_equal(kvtier_on_new_request(a, "p-1", NULL, NULL), 0);
    assert_int_equal(store(a, "p-1", 500, 2, 0x50), 0);
    assert_int_equal(kvtier_on_request_finished(a, "p-1"), 0);
    assert_int_equal(pipe(pfd), 0);
    pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        struct kvtier_client *c = NULL;
        struct kvtier_key k[2];
        uint32_t idx[2];
        int64_t ids[2];
        struct kvtier_store_plan plan = {.store_index = idx, .chunk_ids = ids};
        int ok = kvtier_connect(g.sock, NULL, &c) == 0;

        ok = ok && kvtier_on_new_request(c, "kill-1", NULL, NULL) == 0;
        ok = ok && kvtier_on_new_request(c, "kill-2", NULL, NULL) == 0;
        keys(k, 510, 2);
        ok = ok && kvtier_prepare_store(c, "kill-1", k, 2, &plan) == 0 && plan.n_store == 2;
        keys(k, 500, 2);
        ok = ok && kvtier_prepare_load(c, "kill-2", k, 2, ids) == 0;
        ok = ok && kvtier_prepare_load(c, NULL, k, 1, ids) == 0;
        ch = ok ? 'y' : 'n';
        if (write(pfd[1], &ch, 1) != 1)
            _exit(2);
        for (;;)
            pause();
    }
    close(pfd[1]);
    assert_int_equal(read(pfd[0], &ch, 1), 1);
    close(pfd[0]);
    assert_int_equal(ch, 'y');
    /* The child holds: two requests, a prepared store, three pins. */
    assert_true(has_request("kill-1"));
    assert_int_equal(entry(500).ref_cnt, 2);
    assert_int_equal(entry(501).ref_cnt, 1);
    assert_int_equal(entry(510).ref_cnt, -1);
    struct kvt_manager_req_info info;
    pthread_mutex_lock(&g.lock);
    assert_int_equal(kvt_manager_request_info(g.m, "kill-1", &info), 0);
    pthread_mutex_unlock(&g.lock);
    assert_int_equal(info.pending_primary_stores, 1);

    uint64_t before = counters().disconnects;
    kill(pid, SIGKILL);
    int status;
    assert_int_equal(waitpid(pid, &status, 0), pid);
    assert_true(WIFSIGNALED(status));
    wait_disconnects(before + 1);

    assert_false(has_request("kill-1"));
    assert_false(has_request("kill-2"));
    assert_int_equal(entry(500).ref_cnt, 0);
    assert_int_equal(entry(501).ref_cnt, 0);
    assert_int_equal(entry(510).ref_cnt, -99); /* the aborted store freed its slot */
    assert_int_equal(entry(511).ref_cnt, -99);
    pthread_mutex_lock(&g.lock);
    assert_int_equal(kvt_primary_num_write_pending(kvt_manager_primary(g.m)), 0);
    pthread_mutex_unlock(&g.lock);
    struct kvt_engine_server_counters c = counters();
    assert_int_equal(c.finished_reqs, 2);
    assert_int_equal(c.released_pins, 3);
    assert_int_equal(c.aborted_stores, 1);
    /* The other engine is unaffected, and the keys can be stored again. */
    assert_int_equal(kvtier_on_new_request(a, "p-2", NULL, NULL), 0);
    assert_int_equal(store(a, "p-2", 510, 2, 0), 0);
    assert_int_equal(entry(510).ref_cnt, 0);
    assert_int_equal(kvtier_on_request_finished(a, "p-2"), 0);
    kvtier_close(a);
}

/* ---- bad peers ------------------------------------------------------------------------ */

static int raw_connect(void)
{
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    int fd = socket(AF_UNIX, SOCK_STREAM, 0);

    assert_true(fd >= 0);
    strcpy(sa.sun_path, g.sock);
    assert_int_equal(connect(fd, (struct sockaddr *)&sa, sizeof(sa)), 0);
    return fd;
}

/* Reads until EOF; returns the rc of the ERROR frame received, or 1 if none. */
static int read_error_then_eof(int fd)
{
    uint8_t buf[4096];
    size_t len = 0;
    ssize_t n;
    struct kvt_eproto_limits lim;
    struct kvt_emsg m;
    int rc = 1;

    struct timeval tv = {.tv_sec = 10};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    while ((n = read(fd, buf + len, sizeof(buf) - len)) > 0)
        len += (size_t)n;
    assert_int_equal(n, 0); /* EOF, not a timeout */
    kvt__eproto_limits_default(&lim);
    if (len >= 4 && kvt__eproto_frame_len(buf) == len - 4 &&
        kvt__emsg_decode(buf + 4, len - 4, &lim, &m) == 0) {
        if (m.op == (KVT_EOP_ERROR | KVT_EOP_REPLY))
            rc = (int)m.rc;
        kvt__emsg_free(&m);
    }
    close(fd);
    return rc;
}

static void send_frame(int fd, const void *body, uint32_t len)
{
    uint8_t hdr[4] = {len >> 24, len >> 16, len >> 8, len};

    assert_int_equal(write(fd, hdr, 4), 4);
    if (len > 0)
        assert_int_equal(write(fd, body, len), (ssize_t)len);
}

static void test_malformed_refused_and_counted(void **state)
{
    struct kvtier_client *a = conn("good");
    struct kvt_engine_server_counters c0 = counters();
    int fd;

    /* Garbage body. */
    fd = raw_connect();
    send_frame(fd, "\xc1\xc1\xc1", 3);
    assert_int_equal(read_error_then_eof(fd), -EBADMSG);
    /* An array that claims more elements than there are bytes. */
    fd = raw_connect();
    send_frame(fd, "\xdd\xff\xff\xff\xff", 5);
    assert_int_equal(read_error_then_eof(fd), -EBADMSG);
    /* A well-formed request before HELLO. */
    fd = raw_connect();
    send_frame(fd, "\x82\x00\x03\x01\x01", 5); /* {op: LOOKUP, seq: 1} */
    assert_int_equal(read_error_then_eof(fd), -EPROTO);
    /* HELLO with another major. */
    fd = raw_connect();
    send_frame(fd, "\x83\x00\x01\x01\x01\x05\x09", 7);
    assert_int_equal(read_error_then_eof(fd), -EPROTO);
    /* A frame over max_msg_bytes: refused from its header alone. */
    fd = raw_connect();
    uint8_t big[4] = {0x7f, 0xff, 0xff, 0xff};
    assert_int_equal(write(fd, big, 4), 4);
    assert_int_equal(read_error_then_eof(fd), -EMSGSIZE);

    struct kvt_engine_server_counters c1 = counters();
    assert_int_equal(c1.malformed - c0.malformed, 4);
    assert_int_equal(c1.oversized - c0.oversized, 1);
    /* The good client kept going. */
    assert_int_equal(kvtier_on_new_request(a, "g-1", NULL, NULL), 0);
    assert_int_equal(store(a, "g-1", 600, 1, 0), 0);
    assert_int_equal(kvtier_on_request_finished(a, "g-1"), 0);
    kvtier_close(a);
}

/* A client cut off for a bad frame is cleaned up like a dead one. */
static void test_bad_frame_after_hello_releases(void **state)
{
    struct kvtier_client *a = conn("a");
    struct kvtier_key k = key(700);
    int64_t id;

    assert_int_equal(kvtier_on_new_request(a, "x-1", NULL, NULL), 0);
    assert_int_equal(store(a, "x-1", 700, 1, 0), 0);
    assert_int_equal(kvtier_prepare_load(a, "x-1", &k, 1, &id), 0);
    assert_int_equal(entry(700).ref_cnt, 1);
    /* Too many keys for the daemon: the library refuses without sending. */
    struct kvtier_key *many = calloc(kvtier_client_max_keys(a) + 1, sizeof(*many));
    for (size_t i = 0; i <= kvtier_client_max_keys(a); i++)
        many[i] = k;
    assert_int_equal(kvtier_touch(a, NULL, many, kvtier_client_max_keys(a) + 1), -EMSGSIZE);
    free(many);
    assert_int_equal(entry(700).ref_cnt, 1);
    kvtier_close(a);
    wait_disconnects(1);
    assert_int_equal(entry(700).ref_cnt, 0);
    assert_false(has_request("x-1"));
}

static void test_max_clients(void **state)
{
    struct kvtier_client *c[2] = {NULL, NULL}, *x = NULL;

    stop();
    start(2, 0);
    c[0] = conn("1");
    c[1] = conn("2");
    assert_int_equal(kvtier_connect(g.sock, NULL, &x), -EUSERS);
    assert_int_equal(counters().refused, 1);
    kvtier_close(c[0]);
    wait_disconnects(2);
    x = conn("3");
    kvtier_close(x);
    kvtier_close(c[1]);
}

static void test_socket_path_stale_and_taken(void **state)
{
    struct kvt_engine_server_config sc = {.socket_path = g.sock, .manager = g.m};
    struct kvt_engine_server *s2 = NULL;
    char path[300];
    int fd;

    /* Another daemon listens there: refused, and the socket keeps working. */
    pthread_mutex_lock(&g.lock);
    assert_int_equal(kvt_engine_server_create(&sc, &s2), -EADDRINUSE);
    pthread_mutex_unlock(&g.lock);
    kvtier_close(conn("still"));

    /* A stale socket file (bound, nobody listening) is replaced. */
    snprintf(path, sizeof(path), "%s/stale.sock", g.dir);
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    strcpy(sa.sun_path, path);
    fd = socket(AF_UNIX, SOCK_STREAM, 0);
    assert_int_equal(bind(fd, (struct sockaddr *)&sa, sizeof(sa)), 0);
    close(fd);
    assert_int_equal(access(path, F_OK), 0);
    sc.socket_path = path;
    pthread_mutex_lock(&g.lock);
    assert_int_equal(kvt_engine_server_create(&sc, &s2), 0);
    kvt_engine_server_destroy(s2);
    pthread_mutex_unlock(&g.lock);

    /* Not a socket: left alone. */
    FILE *f = fopen(path, "w");
    fclose(f);
    pthread_mutex_lock(&g.lock);
    assert_int_equal(kvt_engine_server_create(&sc, &s2), -EEXIST);
    sc.socket_path = NULL;
    assert_int_equal(kvt_engine_server_create(&sc, &s2), -EINVAL);
    pthread_mutex_unlock(&g.lock);
    assert_int_equal(access(path, F_OK), 0);
    unlink(path);
}

static void test_daemon_gone(void **state)
{
    struct kvtier_client *a = conn("a");
    struct kvtier_key k = key(1);
    uint8_t res;

    stop();
    assert_int_equal(kvtier_touch(a, NULL, &k, 1) < 0, 1);
    assert_int_equal(kvtier_lookup(a, "r", &k, 1, 0, &res, NULL) < 0, 1);
    kvtier_close(a);
    assert_int_equal(kvtier_connect(g.sock, NULL, &a), -ENOENT);
    start(0, 0);
}

/* ---- bounds and isolation ------------------------------------------------------------ */

/* Writes one encoded frame of m. */
static void raw_send(int fd, const struct kvt_emsg *m)
{
    struct kvt_ebuf b;

    kvt__ebuf_init(&b);
    assert_int_equal(kvt__emsg_encode(m, &b), 0);
    assert_int_equal(write(fd, b.data, b.len), (ssize_t)b.len);
    kvt__ebuf_cleanup(&b);
}

/* Reads one frame (10 s at most) and decodes it into *m; 0 or -1 (EOF or timeout). */
static int raw_recv(int fd, struct kvt_emsg *m)
{
    static const struct kvt_eproto_limits lim = {.max_body = 64u << 20,
                                                 .max_keys = UINT32_MAX,
                                                 .max_params = 1u << 20,
                                                 .max_events = UINT32_MAX,
                                                 .max_stats = UINT32_MAX};
    struct timeval tv = {.tv_sec = 10};
    uint8_t hdr[4], *body;
    uint32_t len;

    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    if (recv(fd, hdr, 4, MSG_WAITALL) != 4)
        return -1;
    len = kvt__eproto_frame_len(hdr);
    body = malloc(len ? len : 1);
    assert_non_null(body);
    if (len > 0 && recv(fd, body, len, MSG_WAITALL) != (ssize_t)len) {
        free(body);
        return -1;
    }
    assert_int_equal(kvt__emsg_decode(body, len, &lim, m), 0);
    free(body);
    return 0;
}

/* A raw connection that said HELLO (the region fd of the reply is discarded). */
static int raw_hello(const char *name)
{
    int fd = raw_connect();
    struct kvt_emsg m;

    kvt__emsg_init(&m);
    m.op = KVT_EOP_HELLO;
    m.seq = 1;
    m.major = KVTIER_PROTO_MAJOR;
    snprintf(m.name, sizeof(m.name), "%s", name);
    m.has = 1u << KVT_EF_OP | 1u << KVT_EF_SEQ | 1u << KVT_EF_MAJOR | 1u << KVT_EF_NAME;
    raw_send(fd, &m);
    assert_int_equal(raw_recv(fd, &m), 0);
    assert_int_equal(m.op, KVT_EOP_HELLO | KVT_EOP_REPLY);
    assert_int_equal(m.rc, 0);
    kvt__emsg_free(&m);
    return fd;
}

static uint64_t refused(enum kvt_engine_refusal r)
{
    return counters().refused_by[r];
}

/* Each stat's bucket bounds on the wire: they round-trip; bounds before the stats,
 * of another count, descending or not finite are a malformed message. */
static void test_stat_bounds_codec(void **state)
{
    static const struct kvt_eproto_limits lim = {.max_body = 1u << 20,
                                                 .max_keys = 4096,
                                                 .max_params = 1u << 16,
                                                 .max_events = 64,
                                                 .max_stats = 64};
    struct kvtier_stat st[2] = {{.name = "h", .kind = KVTIER_HISTOGRAM},
                                {.name = "c", .kind = KVTIER_COUNTER}};
    struct kvtier_hist_bounds hb[2] = {{.n = 3, .bound = {0.5, 1, 2}}, {.n = 0}};
    struct kvt_emsg m, d;
    struct kvt_ebuf b;

    (void)state;
    kvt__emsg_init(&m);
    m.op = KVT_EOP_GET_STATS | KVT_EOP_REPLY;
    m.stats = st;
    m.stat_bounds = hb;
    m.n_stats = 2;
    m.has = 1u << KVT_EF_OP | 1u << KVT_EF_STATS | 1u << KVT_EF_STAT_BOUNDS;
    kvt__ebuf_init(&b);
    assert_int_equal(kvt__emsg_encode(&m, &b), 0);
    assert_int_equal(kvt__emsg_decode(b.data + 4, b.len - 4, &lim, &d), 0);
    assert_true(kvt__emsg_has(&d, KVT_EF_STAT_BOUNDS));
    assert_int_equal(d.stat_bounds[0].n, 3);
    assert_true(d.stat_bounds[0].bound[0] == 0.5 && d.stat_bounds[0].bound[2] == 2);
    assert_int_equal(d.stat_bounds[1].n, 0);
    kvt__emsg_free(&d);
    kvt__ebuf_cleanup(&b);

    hb[0].bound[2] = 1; /* not ascending */
    kvt__ebuf_init(&b);
    assert_int_equal(kvt__emsg_encode(&m, &b), 0);
    assert_int_equal(kvt__emsg_decode(b.data + 4, b.len - 4, &lim, &d), -EBADMSG);
    kvt__ebuf_cleanup(&b);
    hb[0].bound[2] = INFINITY;
    kvt__ebuf_init(&b);
    assert_int_equal(kvt__emsg_encode(&m, &b), 0);
    assert_int_equal(kvt__emsg_decode(b.data + 4, b.len - 4, &lim, &d), -EBADMSG);
    kvt__ebuf_cleanup(&b);
    /* Bounds without their stats. */
    hb[0].bound[2] = 2;
    m.has = 1u << KVT_EF_OP | 1u << KVT_EF_STAT_BOUNDS;
    kvt__ebuf_init(&b);
    assert_int_equal(kvt__emsg_encode(&m, &b), 0);
    assert_int_equal(kvt__emsg_decode(b.data + 4, b.len - 4, &lim, &d), -EBADMSG);
    kvt__ebuf_cleanup(&b);
}

/* ---- a node that sends no bounds of each stat's own (before KVT_EF_STAT_BOUNDS) ---- */

/* One frame off fd into *m (the test's own limits). */
static int old_node_recv(int fd, struct kvt_emsg *m)
{
    static const struct kvt_eproto_limits lim = {.max_body = 1u << 20,
                                                 .max_keys = 4096,
                                                 .max_params = 1u << 16,
                                                 .max_events = 64,
                                                 .max_stats = 64};
    uint8_t hdr[4], body[65536];
    uint32_t len;

    if (recv(fd, hdr, 4, MSG_WAITALL) != 4)
        return -1;
    len = kvt__eproto_frame_len(hdr);
    if (len > sizeof(body) || recv(fd, body, len, MSG_WAITALL) != (ssize_t)len)
        return -1;
    return kvt__emsg_decode(body, len, &lim, m);
}

/* Sends m, with fd (>= 0) by SCM_RIGHTS. */
static void old_node_send(int sock, const struct kvt_emsg *m, int fd)
{
    char cbuf[CMSG_SPACE(sizeof(int))] = {0};
    struct kvt_ebuf b;
    struct iovec iov;
    struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1};

    kvt__ebuf_init(&b);
    assert_int_equal(kvt__emsg_encode(m, &b), 0);
    iov = (struct iovec){.iov_base = b.data, .iov_len = b.len};
    if (fd >= 0) {
        struct cmsghdr *cm;

        mh.msg_control = cbuf;
        mh.msg_controllen = sizeof(cbuf);
        cm = CMSG_FIRSTHDR(&mh);
        cm->cmsg_level = SOL_SOCKET;
        cm->cmsg_type = SCM_RIGHTS;
        cm->cmsg_len = CMSG_LEN(sizeof(int));
        memcpy(CMSG_DATA(cm), &fd, sizeof(int));
    }
    assert_int_equal(sendmsg(sock, &mh, 0), (ssize_t)b.len);
    kvt__ebuf_cleanup(&b);
}

/* Plays a node of the protocol before each stat's bounds: HELLO (a 1-chunk region of a
 * memfd), then one GET_STATS answered with a histogram and a counter, the common
 * bounds and nothing else. */
static void *old_node(void *arg)
{
    int sock = accept4(*(int *)arg, NULL, NULL, SOCK_CLOEXEC);
    int region = memfd_create("old-node", MFD_CLOEXEC);
    struct kvtier_stat st[2] = {{.name = "h", .kind = KVTIER_HISTOGRAM, .count = 1},
                                {.name = "c", .kind = KVTIER_COUNTER, .value = 2}};
    struct kvt_emsg q, r;

    assert_true(region >= 0 && ftruncate(region, 4096) == 0);
    assert_int_equal(old_node_recv(sock, &q), 0);
    kvt__emsg_init(&r);
    r.op = KVT_EOP_HELLO | KVT_EOP_REPLY;
    r.seq = q.seq;
    r.n_geom = KVT_EG_COUNT;
    r.geom[KVT_EG_CLIENT_ID] = 1;
    r.geom[KVT_EG_NUM_CHUNKS] = 1;
    r.geom[KVT_EG_ROW_BYTES] = r.geom[KVT_EG_PAGE_BYTES] = r.geom[KVT_EG_SIZE] = 4096;
    r.geom[KVT_EG_NUM_WORKERS] = 1;
    r.geom[KVT_EG_MAX_KEYS] = 64;
    r.has = 1u << KVT_EF_OP | 1u << KVT_EF_SEQ | 1u << KVT_EF_RC | 1u << KVT_EF_GEOM;
    old_node_send(sock, &r, region);
    kvt__emsg_free(&q);
    assert_int_equal(old_node_recv(sock, &q), 0);
    kvt__emsg_init(&r);
    r.op = KVT_EOP_GET_STATS | KVT_EOP_REPLY;
    r.seq = q.seq;
    st[0].buckets[15] = 1;
    r.stats = st;
    r.n_stats = 2;
    memcpy(r.bounds, kvt_hist_bounds, sizeof(r.bounds));
    r.n_bounds = KVTIER_HIST_BUCKETS;
    r.has = 1u << KVT_EF_OP | 1u << KVT_EF_SEQ | 1u << KVT_EF_RC | 1u << KVT_EF_STATS |
            1u << KVT_EF_BOUNDS;
    old_node_send(sock, &r, -1);
    kvt__emsg_free(&q);
    close(region);
    close(sock);
    return NULL;
}

/* Stats from an older node: every histogram gets the common bounds, the last (which
 * stood for +Inf) left out; a counter none. */
static void test_stat_bounds_from_older_node(void **state)
{
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    char path[300];
    int lfd;
    pthread_t th;
    struct kvtier_client *c = NULL;
    struct kvtier_stats *st = NULL;

    (void)state;
    snprintf(path, sizeof(path), "%s/old-node.sock", g.dir);
    unlink(path);
    lfd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    assert_true(lfd >= 0 && strlen(path) < sizeof(sa.sun_path));
    memcpy(sa.sun_path, path, strlen(path) + 1);
    assert_int_equal(bind(lfd, (struct sockaddr *)&sa, sizeof(sa)), 0);
    assert_int_equal(listen(lfd, 1), 0);
    assert_int_equal(pthread_create(&th, NULL, old_node, &lfd), 0);
    assert_int_equal(kvtier_connect(path, NULL, &c), 0);
    assert_int_equal(kvtier_get_stats(c, &st), 0);
    assert_int_equal(st->n, 2);
    assert_non_null(st->stat_bounds);
    assert_int_equal(st->stat_bounds[0].n, KVTIER_HIST_BUCKETS - 1);
    for (unsigned i = 0; i < KVTIER_HIST_BUCKETS - 1; i++)
        assert_true(st->stat_bounds[0].bound[i] == kvt_hist_bounds[i]);
    assert_int_equal(st->stat_bounds[1].n, 0);
    kvtier_stats_free(st);
    kvtier_close(c);
    pthread_join(th, NULL);
    close(lfd);
    unlink(path);
}

/* Engine B's complete_store of engine A's write-pending key is refused and counted:
 * the key stays write-pending, so a third engine cannot load a row A has not
 * finished writing. */
static void test_complete_store_of_another_clients_key_refused(void **state)
{
    struct kvtier_client *a = conn("a"), *b = conn("b"), *c = conn("c");
    struct kvtier_key ka[2], kb = key(811), kc = key(812), both[2];
    uint32_t idx[2];
    int64_t ids[2];
    uint8_t res;
    struct kvtier_store_plan plan = {.store_index = idx, .chunk_ids = ids};

    keys(ka, 800, 2);
    assert_int_equal(kvtier_on_new_request(a, "a-1", NULL, NULL), 0);
    assert_int_equal(kvtier_prepare_store(a, "a-1", ka, 2, &plan), 0);
    assert_int_equal(plan.n_store, 2);
    assert_int_equal(entry(800).ref_cnt, -1);

    /* B has a store of its own outstanding, then names A's key. */
    assert_int_equal(kvtier_on_new_request(b, "b-1", NULL, NULL), 0);
    assert_int_equal(kvtier_prepare_store(b, "b-1", &kb, 1, &plan), 0);
    assert_int_equal(kvtier_complete_store(b, "b-1", &ka[0], 1, true), -EINVAL);
    both[0] = kb;
    both[1] = ka[1];
    assert_int_equal(kvtier_complete_store(b, "b-1", both, 2, true), -EINVAL);
    assert_int_equal(refused(KVT_EREF_FOREIGN_STORE), 2);
    assert_int_equal(entry(800).ref_cnt, -1); /* still A's, still being written */
    assert_int_equal(entry(801).ref_cnt, -1);
    assert_int_equal(entry(811).ref_cnt, -1); /* the refusal was all or nothing */

    /* The third engine sees it pending and cannot pin it. */
    assert_int_equal(kvtier_on_new_request(c, "c-1", NULL, NULL), 0);
    assert_int_equal(kvtier_lookup(c, "c-1", &ka[0], 1, 0, &res, NULL), 0);
    assert_int_equal(res, KVTIER_HIT_PENDING);
    assert_int_equal(kvtier_prepare_load(c, "c-1", &ka[0], 1, ids), -EINVAL);

    /* A's other request cannot complete it either (per-request bookkeeping). */
    assert_int_equal(kvtier_on_new_request(a, "a-2", NULL, NULL), 0);
    assert_int_equal(kvtier_prepare_store(a, "a-2", &kc, 1, &plan), 0);
    assert_int_equal(kvtier_complete_store(a, "a-2", ka, 2, true), -EINVAL);
    assert_int_equal(refused(KVT_EREF_FOREIGN_STORE), 3);

    /* The owners complete; naming a key that is ready (nobody's store) is harmless. */
    assert_int_equal(kvtier_complete_store(b, "b-1", &kb, 1, true), 0);
    assert_int_equal(kvtier_complete_store(a, "a-1", ka, 2, true), 0);
    assert_int_equal(entry(800).ref_cnt, 0);
    both[0] = kc;
    both[1] = ka[0];
    assert_int_equal(kvtier_complete_store(a, "a-2", both, 2, true), 0);
    assert_int_equal(entry(812).ref_cnt, 0);
    assert_int_equal(refused(KVT_EREF_FOREIGN_STORE), 3);
    for (struct kvtier_client **x = (struct kvtier_client *[]){a, b, c, NULL}; *x; x++)
        kvtier_close(*x);
}

/* An engine that never takes events: the queue stays within max_event_keys, the
 * oldest events go first (counted), the newest are delivered. */
static void test_events_bounded_oldest_dropped(void **state)
{
    struct kvtier_client *a;
    struct kvtier_events *ev = NULL;

    stop();
    start_with(&(struct kvt_engine_server_config){.max_event_keys = 8});
    a = conn("quiet");
    assert_int_equal(kvtier_on_new_request(a, "q-1", NULL, NULL), 0);
    for (int i = 0; i < 5; i++)
        assert_int_equal(store(a, "q-1", 900 + 3 * i, 3, 0), 0);
    /* Wait for the server's loop to have queued the last one. */
    for (int i = 0; i < 2000 && refused(KVT_EREF_EVENTS_DROPPED) < 3; i++)
        usleep(5000);
    assert_int_equal(refused(KVT_EREF_EVENTS_DROPPED), 3);
    assert_true(counters().event_keys <= 8);
    assert_int_equal(kvtier_take_events(a, &ev), 0);
    assert_int_equal(ev->n, 2);
    struct kvtier_key k0 = key(909), k1 = key(914);
    assert_memory_equal(&ev->ev[0].keys[0], &k0, sizeof(k0));
    assert_memory_equal(&ev->ev[1].keys[2], &k1, sizeof(k1));
    kvtier_events_free(ev);
    assert_int_equal(counters().event_keys, 0);
    assert_int_equal(kvtier_on_request_finished(a, "q-1"), 0);
    kvtier_close(a);
}

/* Params over max_params_bytes, over the client's params budget, and requests over
 * max_requests are refused (the connection stays) and counted. */
static void test_params_and_requests_bounded(void **state)
{
    struct kvtier_client *a;
    char big[102], mid[81];

    stop();
    start_with(&(struct kvt_engine_server_config){
        .max_params_bytes = 100, .max_client_params_bytes = 200, .max_requests = 3});
    a = conn("params");
    memset(big, 'x', sizeof(big) - 1);
    big[sizeof(big) - 1] = '\0';
    memset(mid, 'y', sizeof(mid) - 1);
    mid[sizeof(mid) - 1] = '\0';
    assert_int_equal(
        kvtier_on_new_request(a, "p-big", &(struct kvtier_request_opts){.params_json = big}, NULL),
        -EMSGSIZE);
    assert_false(has_request("p-big"));
    assert_int_equal(refused(KVT_EREF_PARAMS), 1);
    assert_int_equal(
        kvtier_on_new_request(a, "p-1", &(struct kvtier_request_opts){.params_json = mid}, NULL),
        0);
    assert_int_equal(
        kvtier_on_new_request(a, "p-2", &(struct kvtier_request_opts){.params_json = mid}, NULL),
        0);
    /* 3 x 80 bytes > 200: the client's budget. */
    assert_int_equal(
        kvtier_on_new_request(a, "p-3", &(struct kvtier_request_opts){.params_json = mid}, NULL),
        -ENOBUFS);
    assert_int_equal(refused(KVT_EREF_CLIENT_PARAMS), 1);
    assert_int_equal(kvtier_on_new_request(a, "p-3", NULL, NULL), 0);
    /* A fourth request. */
    assert_int_equal(kvtier_on_new_request(a, "p-4", NULL, NULL), -ENOBUFS);
    assert_int_equal(refused(KVT_EREF_REQUESTS), 1);
    assert_false(has_request("p-4"));
    /* Finishing one gives its request slot and its params bytes back. */
    assert_int_equal(kvtier_on_request_finished(a, "p-1"), 0);
    assert_int_equal(
        kvtier_on_new_request(a, "p-4", &(struct kvtier_request_opts){.params_json = mid}, NULL),
        0);
    assert_int_equal(counters().malformed + counters().oversized, 0);
    kvtier_close(a);
}

/* A client that pipelines requests and does not read its replies: the server stops
 * executing them once its replies reach max_output_bytes (counted), and executes
 * the rest as the client reads. */
static void test_unread_replies_bounded(void **state)
{
    enum { N = 2000 };
    struct kvt_ebuf b;
    struct kvt_emsg m;
    uint64_t before, executed;
    int fd, replies = 0;

    stop();
    start_with(&(struct kvt_engine_server_config){.max_output_bytes = 4096});
    fd = raw_hello("pipeliner");
    kvt__ebuf_init(&b);
    for (int i = 0; i < N; i++) {
        kvt__emsg_init(&m);
        m.op = KVT_EOP_GET_STATS;
        m.seq = 2 + (uint64_t)i;
        m.has = 1u << KVT_EF_OP | 1u << KVT_EF_SEQ;
        assert_int_equal(kvt__emsg_encode(&m, &b), 0);
    }
    before = counters().requests;
    assert_int_equal(write(fd, b.data, b.len), (ssize_t)b.len);
    kvt__ebuf_cleanup(&b);
    usleep(300000);
    executed = counters().requests - before;
    print_message("%d get_stats pipelined, %llu executed while the client did not read\n", N,
                  (unsigned long long)executed);
    assert_true(executed < N / 2);
    assert_true(refused(KVT_EREF_OUTPUT_FULL) >= 1);
    /* Reading lets the rest through, in order. */
    while (replies < N && raw_recv(fd, &m) == 0) {
        assert_int_equal(m.seq, 2 + (uint64_t)replies);
        assert_int_equal(m.rc, 0);
        kvt__emsg_free(&m);
        replies++;
    }
    assert_int_equal(replies, N);
    assert_int_equal(counters().requests - before, N);
    close(fd);
}

/* A connection that never says HELLO is closed after hello_timeout_ms. */
static void test_hello_timeout(void **state)
{
    uint64_t t0;
    int fd;

    stop();
    start_with(&(struct kvt_engine_server_config){.hello_timeout_ms = 200});
    t0 = kvt_now_ns();
    fd = raw_connect();
    assert_int_equal(read_error_then_eof(fd), -ETIMEDOUT);
    assert_true(kvt_now_ns() - t0 >= 200000000ull);
    assert_int_equal(refused(KVT_EREF_HELLO_TIMEOUT), 1);
    kvtier_close(conn("after")); /* a real engine still gets in */
    assert_int_equal(refused(KVT_EREF_HELLO_TIMEOUT), 1);
}

/* Full of connections that never said HELLO: an engine still gets in, the oldest
 * silent one makes room. Full of engines: refused as before. */
static void test_full_of_silent_connections(void **state)
{
    struct kvtier_client *e1, *e2, *x = NULL;
    int s1, s2;

    stop();
    start_with(&(struct kvt_engine_server_config){.max_clients = 2, .hello_timeout_ms = 60000});
    s1 = raw_connect();
    s2 = raw_connect();
    for (int i = 0; i < 2000 && counters().accepted < 2; i++)
        usleep(5000);
    e1 = conn("e1");
    assert_int_equal(read_error_then_eof(s1), -EUSERS);
    assert_int_equal(refused(KVT_EREF_HELLO_EVICTED), 1);
    e2 = conn("e2");
    assert_int_equal(read_error_then_eof(s2), -EUSERS);
    assert_int_equal(refused(KVT_EREF_HELLO_EVICTED), 2);
    assert_int_equal(kvtier_connect(g.sock, NULL, &x), -EUSERS);
    assert_int_equal(counters().refused, 1);
    kvtier_close(e1);
    kvtier_close(e2);
}

/* CPU milliseconds the server's thread spent on 5 prepare_load + complete_load pairs
 * of one key named n times (its CPU time, not the wall clock: other processes on
 * the machine do not count). */
static double load_pairs_cpu_ms(struct kvtier_client *a, const struct kvtier_key *many, size_t n,
                                int64_t *ids)
{
    struct timespec t0, t1;
    clockid_t cid;

    assert_int_equal(pthread_getcpuclockid(g.thread, &cid), 0);
    assert_int_equal(clock_gettime(cid, &t0), 0);
    for (int r = 0; r < 5; r++) {
        assert_int_equal(kvtier_prepare_load(a, "l-1", many, n, ids), 0);
        assert_int_equal(kvtier_complete_load(a, "l-1", many, n), 0);
    }
    assert_int_equal(clock_gettime(cid, &t1), 0);
    return (double)(t1.tv_sec - t0.tv_sec) * 1e3 + (double)(t1.tv_nsec - t0.tv_nsec) / 1e6;
}

/* One key named 4096 times in prepare_load/complete_load: the mirror's checks cost
 * O(1) per key, so 8 times the keys take about 8 times as long (the quadratic check
 * took about 64 times as long: 36 ms a pair for 4096). */
static void test_repeated_key_loads_linear(void **state)
{
    struct kvtier_client *a = conn("repeat");
    size_t n = kvtier_client_max_keys(a);
    struct kvtier_key *many = calloc(n, sizeof(*many));
    int64_t *ids = calloc(n, sizeof(*ids));
    double small, large;

    assert_true(n >= 4096);
    n = 4096;
    assert_int_equal(kvtier_on_new_request(a, "l-1", NULL, NULL), 0);
    assert_int_equal(store(a, "l-1", 1000, 1, 0), 0);
    for (size_t i = 0; i < n; i++)
        many[i] = key(1000);
    load_pairs_cpu_ms(a, many, n, ids); /* warm: buffers at their size */
    small = load_pairs_cpu_ms(a, many, n / 8, ids);
    large = load_pairs_cpu_ms(a, many, n, ids);
    print_message("5 x prepare_load+complete_load of one key, server CPU: %zu times %.3f ms, "
                  "%zu times %.3f ms\n",
                  n / 8, small, n, large);
    assert_true(large < 24 * (small > 0.2 ? small : 0.2));
    assert_int_equal(entry(1000).ref_cnt, 0);
    /* One pin more named than held: refused, counted, nothing unpinned. */
    assert_int_equal(kvtier_prepare_load(a, "l-1", many, 2, ids), 0);
    assert_int_equal(kvtier_complete_load(a, "l-1", many, 3), -EINVAL);
    assert_int_equal(refused(KVT_EREF_FOREIGN_LOAD), 1);
    assert_int_equal(entry(1000).ref_cnt, 2);
    assert_int_equal(kvtier_complete_load(a, "l-1", many, 2), 0);
    assert_int_equal(kvtier_on_request_finished(a, "l-1"), 0);
    free(many);
    free(ids);
    kvtier_close(a);
}

/* Runs fn with stderr in a file; returns what was written (caller frees). */
static char *capture_stderr(void (*fn)(void))
{
    char path[300], *text;
    int saved = dup(2), fd;
    FILE *f;
    long len;

    snprintf(path, sizeof(path), "%s/stderr.txt", g.dir);
    fd = open(path, O_CREAT | O_TRUNC | O_RDWR, 0600);
    assert_true(fd >= 0 && saved >= 0);
    fflush(stderr);
    dup2(fd, 2);
    fn();
    fflush(stderr);
    dup2(saved, 2);
    close(saved);
    close(fd);
    f = fopen(path, "r");
    assert_non_null(f);
    fseek(f, 0, SEEK_END);
    len = ftell(f);
    rewind(f);
    text = calloc(1, (size_t)len + 1);
    assert_int_equal(fread(text, 1, (size_t)len, f), (size_t)len);
    fclose(f);
    unlink(path);
    return text;
}

static const char evil_name[] = "x\nwarn engine_api: forged line\x1b[2J\\";

static void attach_evil(void)
{
    enum kvt_log_level saved = kvt_log_get_level();
    uint64_t gone = counters().disconnects;

    kvt_log_set_level(KVT_LOG_INFO);
    kvtier_close(conn(evil_name));
    wait_disconnects(gone + 1);
    kvt_log_set_level(saved);
}

/* A HELLO name with a newline and escape sequences cannot forge a log line. */
static void test_hello_name_cannot_forge_log_lines(void **state)
{
    char *text = capture_stderr(attach_evil);

    print_message("log:\n%s", text);
    assert_non_null(strstr(text, "(x\\nwarn engine_api: forged line\\x1b[2J\\\\, pid"));
    for (char *l = text; l != NULL && *l; l = strchr(l, '\n') ? strchr(l, '\n') + 1 : NULL)
        assert_true(strncmp(l, "warn engine_api: forged", 23) != 0);
    assert_null(strchr(text, '\x1b'));
    free(text);
}

/* The socket's mode and group come from the configuration, whatever the umask. */
static void test_socket_mode_and_group(void **state)
{
    struct kvt_engine_server_config sc = {.manager = g.m};
    struct kvt_engine_server *s2 = NULL;
    char path[300], gid[32];
    struct stat st_default = {0}, st_set = {0};
    int rc_default, rc_set, rc_group, rc_mode, left_behind;
    mode_t old;

    snprintf(path, sizeof(path), "%s/mode.sock", g.dir);
    snprintf(gid, sizeof(gid), "%u", (unsigned)getgid());
    sc.socket_path = path;
    /* Under the lock (the manager is the server thread's); asserts after it. */
    pthread_mutex_lock(&g.lock);
    old = umask(0);
    rc_default = kvt_engine_server_create(&sc, &s2); /* 0660, even under umask 0 */
    if (rc_default == 0) {
        stat(path, &st_default);
        kvt_engine_server_destroy(s2);
    }
    umask(022);
    sc.socket_mode = 0600;
    sc.socket_group = gid;
    rc_set = kvt_engine_server_create(&sc, &s2);
    if (rc_set == 0) {
        stat(path, &st_set);
        kvt_engine_server_destroy(s2);
    }
    sc.socket_group = "no-such-group-kvtier";
    rc_group = kvt_engine_server_create(&sc, &s2);
    sc.socket_group = NULL;
    sc.socket_mode = 01777;
    rc_mode = kvt_engine_server_create(&sc, &s2);
    umask(old);
    pthread_mutex_unlock(&g.lock);

    assert_int_equal(rc_default, 0);
    assert_true(S_ISSOCK(st_default.st_mode));
    assert_int_equal(st_default.st_mode & 07777, 0660);
    assert_int_equal(rc_set, 0);
    assert_int_equal(st_set.st_mode & 07777, 0600);
    assert_int_equal(st_set.st_gid, getgid());
    /* A group that does not exist, a mode that is not one: refused, nothing left. */
    assert_int_equal(rc_group, -EINVAL);
    assert_int_equal(rc_mode, -EINVAL);
    assert_int_equal(access(path, F_OK), -1);
    /* No private directory was left beside the socket. */
    DIR *d = opendir(g.dir);
    left_behind = 0;
    for (struct dirent *e; (e = readdir(d)) != NULL;)
        left_behind += strncmp(e->d_name, ".kvtier-", 8) == 0;
    closedir(d);
    assert_int_equal(left_behind, 0);
}

/* An engine's own region (ATTACH) and its jobs (JOBS): refusals change nothing and
 * are counted; store rows go into the node, load rows come back byte for byte; a
 * key the node lacks fails alone; a client's jobs request goes with it. */
static void test_attach_and_jobs(void **state)
{
    struct kvtier_client *c = conn("jobs");
    size_t row = kvtier_client_region(c)->row_bytes, node_row = 0;
    char path[300];
    int fd;
    uint8_t *map;
    struct kvtier_key k[3];
    uint8_t verdicts[3];
    int64_t rows_st[2] = {0, 1}, rows_ld[3] = {2, 3, 4}, bad_rows[1] = {5};
    struct kvtier_jobs_done *done = NULL;
    struct kvt_engine_server_counters ct;

    snprintf(path, sizeof(path), "%s/engine-region", g.dir);
    fd = open(path, O_RDWR | O_CREAT | O_TRUNC, 0600);
    assert_true(fd >= 0);
    assert_int_equal(ftruncate(fd, (off_t)(5 * row)), 0);
    map = mmap(NULL, 5 * row, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    assert_true(map != MAP_FAILED);
    keys(k, 900, 3);

    /* Jobs before a region; a stride not the node's; rows past the file. */
    assert_int_equal(kvtier_jobs_step(c, k, 1, verdicts, NULL, 0, &done), -ENOTCONN);
    assert_int_equal(kvtier_attach_region(c, fd, 0, 5, row / 2, NULL), -EINVAL);
    assert_int_equal(kvtier_attach_region(c, fd, 0, 6, row, NULL), -EINVAL);
    ct = counters();
    assert_int_equal(ct.attach_refused, 2);
    assert_int_equal(ct.jobs_refused, 1);
    assert_int_equal(ct.attached, 0);
    assert_int_equal(kvtier_attach_region(c, fd, 0, 5, row, &node_row), 0);
    assert_int_equal(node_row, row);
    assert_int_equal(counters().attached, 1);
    assert_string_equal(kvtier_version(), KVTIER_TEST_VERSION);

    /* A row out of the region refuses the whole step: the store beside it does not
     * run (the key stays unknown). */
    memset(map, 0x5a, row);
    memset(map + row, 0xa5, row);
    struct kvtier_job bad[2] = {
        {.id = 1, .kind = KVTIER_JOB_STORE, .keys = k, .rows = rows_st, .n = 1},
        {.id = 2, .kind = KVTIER_JOB_LOAD, .keys = k, .rows = bad_rows, .n = 1}};
    assert_int_equal(kvtier_jobs_step(c, NULL, 0, NULL, bad, 2, &done), -EINVAL);
    assert_int_equal(counters().jobs_refused, 2);
    assert_int_equal(entry(900).ref_cnt, -99);

    /* Store two rows; look them up (HIT) and a third (MISS); load all three. */
    struct kvtier_job st = {.id = 3, .kind = KVTIER_JOB_STORE, .keys = k, .rows = rows_st, .n = 2};
    assert_int_equal(kvtier_jobs_step(c, NULL, 0, NULL, &st, 1, &done), 0);
    assert_int_equal(done->n, 1);
    assert_true(done->job[0].id == 3 && done->job[0].ok);
    kvtier_jobs_done_free(done);
    assert_int_equal(kvtier_jobs_step(c, k, 3, verdicts, NULL, 0, &done), 0);
    assert_int_equal(done->n, 0);
    kvtier_jobs_done_free(done);
    assert_int_equal(verdicts[0], KVTIER_HIT);
    assert_int_equal(verdicts[1], KVTIER_HIT);
    assert_int_equal(verdicts[2], KVTIER_MISS);
    memset(map + 2 * row, 0, 3 * row);
    struct kvtier_job ld = {.id = 4, .kind = KVTIER_JOB_LOAD, .keys = k, .rows = rows_ld, .n = 3};
    assert_int_equal(kvtier_jobs_step(c, NULL, 0, NULL, &ld, 1, &done), 0);
    assert_int_equal(done->n, 1);
    assert_true(done->job[0].id == 4 && !done->job[0].ok && done->job[0].n == 3);
    assert_int_equal(done->job[0].key_ok[0], 1);
    assert_int_equal(done->job[0].key_ok[1], 1);
    assert_int_equal(done->job[0].key_ok[2], 0);
    kvtier_jobs_done_free(done);
    assert_memory_equal(map + 2 * row, map, row);
    assert_memory_equal(map + 3 * row, map + row, row);
    ct = counters();
    assert_int_equal(ct.job_rows_stored, 2);
    assert_int_equal(ct.job_rows_loaded, 2);
    assert_int_equal(ct.job_rows_failed, 1);
    assert_int_equal(ct.jobs, 2);
    /* Nothing pinned or pending; the jobs request goes with the client. */
    assert_int_equal(entry(900).ref_cnt, 0);
    assert_true(has_request("kvtier-jobs-1"));
    kvtier_close(c);
    wait_disconnects(1);
    assert_false(has_request("kvtier-jobs-1"));
    munmap(map, 5 * row);
    close(fd);
}

/* The node's own region file cut under it (its user's doing): a new engine is refused
 * with -EBADFD, which says so, not -EPROTO ("another version"); nothing is mapped. */
static void test_node_region_cut_refused_clearly(void **state)
{
    struct kvtier_connect_opts o = {.name = "late", .timeout_ms = 10000};
    struct kvtier_client *c = NULL;
    struct stat st;

    (void)state;
    assert_int_equal(stat(g.region_path, &st), 0);
    assert_int_equal(truncate(g.region_path, st.st_size / 2), 0);
    assert_int_equal(kvtier_connect(g.sock, &o, &c), -EBADFD);
    assert_null(c);
    assert_int_equal(truncate(g.region_path, st.st_size), 0); /* for the teardown */
    c = conn("after");
    kvtier_close(c);
}

/* The engine truncates its region's file after ATTACH: the node's copies from and
 * to the mapping would raise SIGBUS (the daemon died); its jobs fail instead, and
 * nothing is stored. */
static void test_attached_region_truncated(void **state)
{
    struct kvtier_client *c = conn("truncator");
    size_t row = kvtier_client_region(c)->row_bytes;
    char path[300];
    int fd;
    struct kvtier_key k[2];
    int64_t rows[2] = {0, 1};
    struct kvtier_jobs_done *done = NULL;

    snprintf(path, sizeof(path), "%s/truncated-region", g.dir);
    fd = open(path, O_RDWR | O_CREAT | O_TRUNC, 0600);
    assert_true(fd >= 0);
    assert_int_equal(ftruncate(fd, (off_t)(2 * row)), 0);
    keys(k, 950, 2);
    assert_int_equal(kvtier_attach_region(c, fd, 0, 2, row, NULL), 0);
    struct kvtier_job st = {.id = 1, .kind = KVTIER_JOB_STORE, .keys = k, .rows = rows, .n = 1};
    assert_int_equal(kvtier_jobs_step(c, NULL, 0, NULL, &st, 1, &done), 0);
    assert_true(done->n == 1 && done->job[0].ok);
    kvtier_jobs_done_free(done);

    assert_int_equal(ftruncate(fd, 0), 0);
    struct kvtier_job st2 = {
        .id = 2, .kind = KVTIER_JOB_STORE, .keys = &k[1], .rows = &rows[1], .n = 1};
    assert_int_equal(kvtier_jobs_step(c, NULL, 0, NULL, &st2, 1, &done), 0);
    assert_true(done->n == 1 && done->job[0].id == 2 && !done->job[0].ok);
    kvtier_jobs_done_free(done);
    assert_int_equal(entry(951).ref_cnt, -99); /* not stored */
    struct kvtier_job ld = {.id = 3, .kind = KVTIER_JOB_LOAD, .keys = k, .rows = rows, .n = 1};
    assert_int_equal(kvtier_jobs_step(c, NULL, 0, NULL, &ld, 1, &done), 0);
    assert_true(done->n == 1 && done->job[0].id == 3 && !done->job[0].ok);
    kvtier_jobs_done_free(done);
    assert_int_equal(entry(950).ref_cnt, 0); /* not left pinned */
    assert_int_equal(counters().job_rows_failed, 2);
    kvtier_close(c);
    wait_disconnects(1);
    close(fd);
}

/* A client's jobs request does not live as long as the client: after 4096 keys the
 * next JOBS message starts another ("kvtier-jobs-<id>.1"), and the one before
 * finishes two messages later, giving the keys it saw their recency; before, it
 * recorded every key the engine ever used (its access and its metrics grew without
 * bound) and its loads never counted as reuse. Jobs go on across the turn. */
static void test_jobs_request_turns_over(void **state)
{
    enum { PER_STEP = 512 };
    struct kvtier_client *c = conn("long-lived");
    size_t row = kvtier_client_region(c)->row_bytes;
    static struct kvtier_key many[PER_STEP];
    uint8_t verdicts[PER_STEP];
    struct kvtier_key k[1];
    int64_t rows[1] = {0};
    struct kvtier_jobs_done *done = NULL;
    char path[300], first[64], second[80];
    uint8_t *map;
    int fd;

    (void)state;
    snprintf(path, sizeof(path), "%s/turn-region", g.dir);
    fd = open(path, O_RDWR | O_CREAT | O_TRUNC, 0600);
    assert_true(fd >= 0);
    assert_int_equal(ftruncate(fd, (off_t)row), 0);
    map = mmap(NULL, row, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    assert_true(map != MAP_FAILED);
    assert_int_equal(kvtier_attach_region(c, fd, 0, 1, row, NULL), 0);
    snprintf(first, sizeof(first), "kvtier-jobs-%llu",
             (unsigned long long)counters().attached); /* client ids count from 1 */
    snprintf(second, sizeof(second), "%s.1", first);
    assert_true(has_request(first));
    /* 8 steps of 512 lookups: 4096 keys seen, no turn yet. */
    for (int s = 0; s < 8; s++) {
        keys(many, 20000 + s * PER_STEP, PER_STEP);
        assert_int_equal(kvtier_jobs_step(c, many, PER_STEP, verdicts, NULL, 0, &done), 0);
        kvtier_jobs_done_free(done);
        assert_true(has_request(first));
        assert_false(has_request(second));
    }
    /* The next message turns it over; the first finishes two messages later. */
    keys(k, 960, 1);
    memset(map, 0x5a, row);
    struct kvtier_job st = {.id = 1, .kind = KVTIER_JOB_STORE, .keys = k, .rows = rows, .n = 1};
    assert_int_equal(kvtier_jobs_step(c, NULL, 0, NULL, &st, 1, &done), 0);
    assert_true(done->n == 1 && done->job[0].ok);
    kvtier_jobs_done_free(done);
    assert_true(has_request(second));
    assert_true(has_request(first));
    assert_int_equal(kvtier_jobs_step(c, NULL, 0, NULL, NULL, 0, &done), 0);
    kvtier_jobs_done_free(done);
    assert_true(has_request(first));
    memset(map, 0, row);
    struct kvtier_job ld = {.id = 2, .kind = KVTIER_JOB_LOAD, .keys = k, .rows = rows, .n = 1};
    assert_int_equal(kvtier_jobs_step(c, NULL, 0, NULL, &ld, 1, &done), 0);
    assert_true(done->n == 1 && done->job[0].id == 2 && done->job[0].ok);
    kvtier_jobs_done_free(done);
    assert_false(has_request(first));
    assert_true(has_request(second));
    assert_int_equal(map[0], 0x5a);
    assert_int_equal(map[row - 1], 0x5a);
    kvtier_close(c);
    wait_disconnects(1);
    assert_false(has_request(second));
    munmap(map, row);
    close(fd);
}

/* A request named like a client's jobs request ("kvtier-jobs-<id>") is the node's:
 * taken first by one engine, the next engine's ATTACH was refused (-EEXIST). */
static void test_jobs_request_name_reserved(void **state)
{
    struct kvtier_client *a = conn("squatter"), *b;
    size_t row = kvtier_client_region(a)->row_bytes;
    uint64_t before = counters().refused_by[KVT_EREF_UNKNOWN_REQUEST];
    char path[300];
    int fd;

    assert_int_equal(kvtier_on_new_request(a, "kvtier-jobs-2", NULL, NULL), -EINVAL);
    assert_int_equal(kvtier_on_new_request(a, "kvtierd-engine-api", NULL, NULL), -EINVAL);
    assert_int_equal(counters().refused_by[KVT_EREF_UNKNOWN_REQUEST], before + 2);
    assert_false(has_request("kvtier-jobs-2"));
    b = conn("victim"); /* client 2 */
    snprintf(path, sizeof(path), "%s/victim-region", g.dir);
    fd = open(path, O_RDWR | O_CREAT | O_TRUNC, 0600);
    assert_true(fd >= 0);
    assert_int_equal(ftruncate(fd, (off_t)row), 0);
    assert_int_equal(kvtier_attach_region(b, fd, 0, 1, row, NULL), 0);
    assert_true(has_request("kvtier-jobs-2"));
    kvtier_close(a);
    kvtier_close(b);
    wait_disconnects(2);
    close(fd);
}

/* ---- reset, pending work, fingerprints, peers (minor 1) -------------------------------- */

static struct kvtier_client *conn_fp(const char *name, const char *fp, int *rc_p, char *err,
                                     size_t err_len)
{
    struct kvtier_client *c = NULL;
    struct kvtier_connect_ex o = {.size = sizeof(o),
                                  .name = name,
                                  .timeout_ms = 10000,
                                  .fingerprint = fp,
                                  .error = err,
                                  .error_len = err_len};

    *rc_p = kvtier_connect_ex(g.sock, &o, &c);
    return c;
}

static enum kvtier_lookup_result look1(struct kvtier_client *c, const char *req, int i)
{
    struct kvtier_key k = key(i);
    uint8_t r = 0xff;

    assert_int_equal(kvtier_lookup(c, req, &k, 1, 0, &r, NULL), 0);
    return r;
}

/* reset: refused (-EBUSY, counted, nothing changed) while an engine holds a pin or a
 * prepared store; done once nothing is held: every chunk gone, the queued events
 * dropped, live requests kept, engines still attached. */
static void test_reset_refused_while_held_then_done(void **state)
{
    struct kvtier_client *a = conn("a"), *b = conn("b");
    struct kvtier_key k = key(1100), k2 = key(1101);
    struct kvtier_events *ev = NULL;
    uint32_t idx;
    int64_t id;
    struct kvtier_store_plan plan = {.store_index = &idx, .chunk_ids = &id};

    (void)state;
    assert_int_equal(kvtier_client_node_minor(a), 1);
    assert_int_equal(kvtier_on_new_request(a, "r-a", NULL, NULL), 0);
    assert_int_equal(kvtier_on_new_request(b, "r-b", NULL, NULL), 0);
    assert_int_equal(store(a, "r-a", 1100, 1, 7), 0);
    assert_int_equal(look1(a, "r-a", 1100), KVTIER_HIT);

    /* b pins the chunk: refused, nothing changed. */
    assert_int_equal(kvtier_prepare_load(b, "r-b", &k, 1, &id), 0);
    assert_int_equal(kvtier_reset(a), -EBUSY);
    assert_int_equal(refused(KVT_EREF_RESET_BUSY), 1);
    assert_int_equal(counters().resets, 0);
    assert_int_equal(entry(1100).ref_cnt, 1);
    assert_int_equal(kvtier_complete_load(b, "r-b", &k, 1), 0);

    /* a prepared store not completed (its own): refused too. */
    assert_int_equal(kvtier_prepare_store(a, "r-a", &k2, 1, &plan), 0);
    assert_int_equal(kvtier_reset(b), -EBUSY);
    assert_int_equal(refused(KVT_EREF_RESET_BUSY), 2);
    assert_int_equal(kvtier_complete_store(a, "r-a", &k2, 1, true), 0);

    assert_int_equal(kvtier_reset(b), 0);
    assert_int_equal(counters().resets, 1);
    assert_int_equal(entry(1100).ref_cnt, -99);
    assert_int_equal(entry(1101).ref_cnt, -99);
    assert_int_equal(look1(a, "r-a", 1100), KVTIER_MISS);
    assert_int_equal(kvtier_take_events(b, &ev), 0); /* the stored events went too */
    assert_int_equal(ev->n, 0);
    kvtier_events_free(ev);
    /* Requests and connections live on: a stores again. */
    assert_true(has_request("r-a") && has_request("r-b"));
    assert_int_equal(store(a, "r-a", 1100, 1, 9), 0);
    assert_int_equal(look1(b, "r-b", 1100), KVTIER_HIT);
    assert_int_equal(kvtier_on_request_finished(a, "r-a"), 0);
    assert_int_equal(kvtier_on_request_finished(b, "r-b"), 0);
    kvtier_close(a);
    kvtier_close(b);
}

/* has_pending_work follows the manager's (a cascade the secondary tier holds), and
 * reset drains that tier before it clears the primary. */
static void test_pending_work_and_reset_drain(void **state)
{
    struct kvt_example_tier_config hold = {.hold_jobs = true};
    struct kvtier_client *a;
    bool pending = true;

    (void)state;
    stop();
    assert_int_equal(kvt_example_tier_create(&hold, &g.tiers[0]), 0);
    g.n_tiers = 1;
    start(0, 0);
    a = conn("a");
    assert_int_equal(kvtier_has_pending_work(a, &pending), 0);
    assert_false(pending);
    assert_int_equal(kvtier_on_new_request(a, "p-a", NULL, NULL), 0);
    assert_int_equal(store(a, "p-a", 1200, 2, 1), 0);
    assert_int_equal(kvtier_on_schedule_end(a, NULL, 0, NULL, 0), 0); /* the cascade goes */
    assert_int_equal(kvtier_has_pending_work(a, &pending), 0);
    assert_true(pending);
    /* The held cascade is drained by the reset (example tier: drain completes it). */
    assert_int_equal(kvtier_reset(a), 0);
    assert_int_equal(kvtier_has_pending_work(a, &pending), 0);
    assert_false(pending);
    pthread_mutex_lock(&g.lock);
    assert_int_equal(kvt_primary_num_entries(kvt_manager_primary(g.m)), 0);
    /* The example tier has no reset op: it keeps what it stored (vLLM's semantics). */
    assert_int_equal(kvt_example_tier_num_keys(g.tiers[0]), 2);
    pthread_mutex_unlock(&g.lock);
    assert_int_equal(kvtier_on_request_finished(a, "p-a"), 0);
    kvtier_close(a);
}

/* A client's waiting load keys are looked up again at most waiting_keys_per_pass
 * (here 4) per pass of the loop, its jobs in turn; all of them end once their chunks
 * arrive. (Before, every pass looked up every waiting key: up to 2^20 per client.) */
static void test_waiting_loads_bounded_per_pass(void **state)
{
    struct kvt_example_tier_config hold = {.hold_jobs = true};
    struct kvtier_client *c;
    char path[300];
    int fd;
    size_t row, n_done = 0;
    struct kvtier_key k[12];
    int64_t rows[12];
    struct kvtier_job ld[3];
    struct kvtier_jobs_done *done = NULL;
    struct kvt_engine_server_counters ct;

    (void)state;
    stop();
    assert_int_equal(kvt_example_tier_create(&hold, &g.tiers[0]), 0);
    g.n_tiers = 1;
    start_with(&(struct kvt_engine_server_config){.waiting_keys_per_pass = 4});
    c = conn("waiter");
    row = kvtier_client_region(c)->row_bytes;
    snprintf(path, sizeof(path), "%s/waiting-region", g.dir);
    fd = open(path, O_RDWR | O_CREAT | O_TRUNC, 0600);
    assert_true(fd >= 0);
    assert_int_equal(ftruncate(fd, (off_t)(12 * row)), 0);
    assert_int_equal(kvtier_attach_region(c, fd, 0, 12, row, NULL), 0);
    keys(k, 1300, 12);
    pthread_mutex_lock(&g.lock);
    for (int i = 0; i < 12; i++) {
        struct kvt_key kk = kt_key(1300 + i);

        assert_int_equal(kvt_example_tier_insert(g.tiers[0], &kk, NULL), 0);
    }
    pthread_mutex_unlock(&g.lock);
    for (int i = 0; i < 12; i++)
        rows[i] = i;
    for (int i = 0; i < 3; i++)
        ld[i] = (struct kvtier_job){.id = 10 + (uint64_t)i,
                                    .kind = KVTIER_JOB_LOAD,
                                    .keys = k + 4 * i,
                                    .rows = rows + 4 * i,
                                    .n = 4};
    assert_int_equal(kvtier_jobs_step(c, NULL, 0, NULL, ld, 3, &done), 0);
    assert_int_equal(done->n, 0); /* every key is being promoted; the tier holds them */
    kvtier_jobs_done_free(done);
    assert_int_equal(kvtier_on_schedule_end(c, NULL, 0, NULL, 0), 0); /* the promotions go */
    /* One pass at a time: the lock keeps the server's thread out. */
    pthread_mutex_lock(&g.lock);
    for (int pass = 0; pass < 6; pass++) {
        uint64_t before;

        kvt_engine_server_get_counters(g.srv, &ct);
        before = ct.job_keys_relooked;
        assert_int_equal(kvt_engine_server_progress(g.srv), 0);
        kvt_engine_server_get_counters(g.srv, &ct);
        assert_int_equal(ct.job_keys_relooked - before, 4);
    }
    kvt_example_tier_release(g.tiers[0]);
    pthread_mutex_unlock(&g.lock);
    /* The promotions end: every job is reported, each once. */
    for (int i = 0; i < 500 && n_done < 3; i++) {
        assert_int_equal(kvtier_on_schedule_end(c, NULL, 0, NULL, 0), 0);
        assert_int_equal(kvtier_jobs_step(c, NULL, 0, NULL, NULL, 0, &done), 0);
        for (size_t j = 0; j < done->n; j++)
            assert_true(done->job[j].id >= 10 && done->job[j].id <= 12);
        n_done += done->n;
        kvtier_jobs_done_free(done);
        if (n_done < 3)
            usleep(2000);
    }
    assert_int_equal(n_done, 3);
    kvtier_close(c);
    wait_disconnects(1);
    close(fd);
}

static struct {
    int calls;
    int rc;
    char last[KVTIER_FINGERPRINT_MAX + 1];
} fp_cb;

static int on_fingerprint(void *arg, const char *fp)
{
    (void)arg;
    fp_cb.calls++;
    snprintf(fp_cb.last, sizeof(fp_cb.last), "%s", fp);
    return fp_cb.rc;
}

/* The first engine that declares a fingerprint sets the node's (told once); another is
 * refused with both named (counted); none is accepted; a configured one is fixed. */
static void test_fingerprint_first_engine_sets_it(void **state)
{
    char err[KVTIER_ERROR_MAX + 1], big[KVTIER_FINGERPRINT_MAX + 2];
    struct kvtier_client *a, *b, *c, *d;
    int rc;

    (void)state;
    stop();
    memset(&fp_cb, 0, sizeof(fp_cb));
    fp_cb.rc = -EIO;
    start_with(&(struct kvt_engine_server_config){.fingerprint_set = on_fingerprint});
    /* The node cannot take it: refused, still unset. */
    assert_null(conn_fp("a", "model-a", &rc, err, sizeof(err)));
    assert_int_equal(rc, -EIO);
    assert_non_null(strstr(err, "model-a"));
    fp_cb.rc = 0;
    a = conn_fp("a", "model-a", &rc, err, sizeof(err));
    assert_int_equal(rc, 0);
    assert_int_equal(fp_cb.calls, 2);
    assert_string_equal(fp_cb.last, "model-a");
    assert_string_equal(kvtier_client_node_fingerprint(a), "model-a"); /* its own, now */
    b = conn_fp("b", "model-b", &rc, err, sizeof(err));
    assert_null(b);
    assert_int_equal(rc, -EKEYREJECTED);
    assert_non_null(strstr(err, "'model-b'"));
    assert_non_null(strstr(err, "'model-a'"));
    assert_int_equal(refused(KVT_EREF_FINGERPRINT), 2); /* the -EIO one, and this */
    assert_int_equal(counters().malformed, 0);
    c = conn_fp("c", NULL, &rc, err, sizeof(err)); /* declares none: accepted */
    assert_int_equal(rc, 0);
    assert_string_equal(kvtier_client_node_fingerprint(c), "model-a");
    d = conn_fp("d", "model-a", &rc, err, sizeof(err));
    assert_int_equal(rc, 0);
    assert_int_equal(fp_cb.calls, 2); /* set once */
    memset(big, 'x', sizeof(big) - 1);
    big[sizeof(big) - 1] = '\0';
    assert_null(conn_fp("e", big, &rc, err, sizeof(err)));
    assert_int_equal(rc, -EINVAL); /* refused by the library, not sent */
    kvtier_close(a);
    kvtier_close(c);
    kvtier_close(d);

    /* Configured: fixed from the start, the callback never told. */
    stop();
    memset(&fp_cb, 0, sizeof(fp_cb));
    start_with(&(struct kvt_engine_server_config){.fingerprint = "fixed",
                                                  .fingerprint_set = on_fingerprint});
    assert_null(conn_fp("x", "model-a", &rc, err, sizeof(err)));
    assert_int_equal(rc, -EKEYREJECTED);
    assert_non_null(strstr(err, "'fixed'"));
    a = conn_fp("y", "fixed", &rc, err, sizeof(err));
    assert_int_equal(rc, 0);
    assert_string_equal(kvtier_client_node_fingerprint(a), "fixed");
    assert_int_equal(fp_cb.calls, 0);
    kvtier_close(a);
}

static int fake_peers(void *arg, struct kvtier_peer *out, size_t cap, size_t *n_p)
{
    (void)arg;
    assert_true(cap >= 2);
    out[0] = (struct kvtier_peer){
        .node_id = 7, .incarnation = 70, .port = 7170, .state = KVTIER_PEER_SELF};
    snprintf(out[0].addr, sizeof(out[0].addr), "127.0.0.1");
    out[1] = (struct kvtier_peer){.node_id = 8,
                                  .incarnation = 80,
                                  .port = 7171,
                                  .state = KVTIER_PEER_DOWN,
                                  .last_heard_ms = 1500,
                                  .pulled_bytes = 4096,
                                  .served_bytes = 8192};
    snprintf(out[1].addr, sizeof(out[1].addr), "10.0.0.8");
    *n_p = 2;
    return 0;
}

/* PEERS: what the node's callback lists, field by field; -EOPNOTSUPP (the connection
 * stays) on a node without one. */
static void test_peers_listed(void **state)
{
    struct kvtier_client *a = conn("a");
    struct kvtier_peers *p = NULL;

    (void)state;
    assert_int_equal(kvtier_get_peers(a, &p), -EOPNOTSUPP);
    assert_int_equal(kvtier_on_new_request(a, "still-up", NULL, NULL), 0);
    kvtier_close(a);
    stop();
    start_with(&(struct kvt_engine_server_config){.peers = fake_peers});
    a = conn("a");
    assert_int_equal(kvtier_get_peers(a, &p), 0);
    assert_int_equal(p->n, 2);
    assert_true(p->p[0].node_id == 7 && p->p[0].state == KVTIER_PEER_SELF);
    assert_string_equal(p->p[0].addr, "127.0.0.1");
    assert_true(p->p[1].node_id == 8 && p->p[1].incarnation == 80 && p->p[1].port == 7171);
    assert_string_equal(p->p[1].addr, "10.0.0.8");
    assert_int_equal(p->p[1].state, KVTIER_PEER_DOWN);
    assert_true(p->p[1].last_heard_ms == 1500 && p->p[1].pulled_bytes == 4096 &&
                p->p[1].served_bytes == 8192);
    kvtier_peers_free(p);
    kvtier_close(a);
}

/* An ERROR frame's message reaches the caller (kvtier_client_error): a request the
 * server cannot decode closes the connection with its reason. */
static void test_error_message_surfaced(void **state)
{
    int fd = raw_hello("raw");
    struct kvt_emsg m;

    (void)state;
    send_frame(fd, "\xc1", 1);
    assert_int_equal(raw_recv(fd, &m), 0);
    assert_int_equal(m.op, KVT_EOP_ERROR | KVT_EOP_REPLY);
    assert_true(kvt__emsg_has(&m, KVT_EF_MESSAGE));
    assert_non_null(strstr(m.message, "bad request"));
    kvt__emsg_free(&m);
    close(fd);
}

/* A node of minor 0 (a fake that answers HELLO as one): the minor-1 calls return
 * -EOPNOTSUPP without sending anything (such a node closes on an unknown op). */
struct minor0 {
    int lfd;
    int frames_after_hello;
};

static void *minor0_main(void *arg)
{
    struct minor0 *z = arg;
    int fd = accept(z->lfd, NULL, NULL), mfd = memfd_create("region", 0);
    struct kvt_emsg m;
    struct kvt_ebuf b;
    char cbuf[CMSG_SPACE(sizeof(int))] = {0};
    struct iovec iov;
    struct msghdr mh = {
        .msg_iov = &iov, .msg_iovlen = 1, .msg_control = cbuf, .msg_controllen = sizeof(cbuf)};
    struct cmsghdr *cm = CMSG_FIRSTHDR(&mh);

    assert_true(fd >= 0 && mfd >= 0);
    assert_int_equal(ftruncate(mfd, 4 * 4096), 0);
    assert_int_equal(raw_recv(fd, &m), 0);
    assert_int_equal(m.op, KVT_EOP_HELLO);
    kvt__emsg_free(&m);
    kvt__emsg_init(&m);
    m.op = KVT_EOP_HELLO | KVT_EOP_REPLY;
    m.seq = 1;
    m.rc = 0;
    m.major = 1;
    m.minor = 0;
    m.geom[KVT_EG_CLIENT_ID] = 1;
    m.geom[KVT_EG_NUM_CHUNKS] = 4;
    m.geom[KVT_EG_ROW_BYTES] = 4096;
    m.geom[KVT_EG_PAGE_BYTES] = 4096;
    m.geom[KVT_EG_NUM_WORKERS] = 1;
    m.geom[KVT_EG_SIZE] = 4 * 4096;
    m.geom[KVT_EG_MAX_KEYS] = 16;
    m.n_geom = KVT_EG_COUNT;
    m.has = 1u << KVT_EF_OP | 1u << KVT_EF_SEQ | 1u << KVT_EF_RC | 1u << KVT_EF_MAJOR |
            1u << KVT_EF_MINOR | 1u << KVT_EF_GEOM;
    kvt__ebuf_init(&b);
    assert_int_equal(kvt__emsg_encode(&m, &b), 0);
    iov = (struct iovec){b.data, b.len};
    cm->cmsg_level = SOL_SOCKET;
    cm->cmsg_type = SCM_RIGHTS;
    cm->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(cm), &mfd, sizeof(int));
    assert_int_equal(sendmsg(fd, &mh, 0), (ssize_t)b.len);
    kvt__ebuf_cleanup(&b);
    close(mfd);
    /* Anything more the client sends is counted until it closes. */
    while (raw_recv(fd, &m) == 0) {
        z->frames_after_hello++;
        kvt__emsg_free(&m);
    }
    close(fd);
    return NULL;
}

static void test_minor0_node_not_asked(void **state)
{
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    struct minor0 z = {0};
    struct kvtier_client *c = NULL;
    struct kvtier_peers *p = NULL;
    pthread_t t;
    bool pending;

    (void)state;
    snprintf(sa.sun_path, sizeof(sa.sun_path), "%s/minor0.sock", g.dir);
    z.lfd = socket(AF_UNIX, SOCK_STREAM, 0);
    assert_int_equal(bind(z.lfd, (struct sockaddr *)&sa, sizeof(sa)), 0);
    assert_int_equal(listen(z.lfd, 1), 0);
    assert_int_equal(pthread_create(&t, NULL, minor0_main, &z), 0);
    assert_int_equal(kvtier_connect(sa.sun_path, NULL, &c), 0);
    assert_int_equal(kvtier_client_node_minor(c), 0);
    assert_int_equal(kvtier_reset(c), -EOPNOTSUPP);
    assert_int_equal(kvtier_has_pending_work(c, &pending), -EOPNOTSUPP);
    assert_int_equal(kvtier_get_peers(c, &p), -EOPNOTSUPP);
    kvtier_close(c);
    pthread_join(t, NULL);
    close(z.lfd);
    unlink(sa.sun_path);
    assert_int_equal(z.frames_after_hello, 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_hello_geometry, setup, teardown),
        cmocka_unit_test_setup_teardown(test_store_lookup_load_across_clients, setup, teardown),
        cmocka_unit_test_setup_teardown(test_misuse_refused, setup, teardown),
        cmocka_unit_test_setup_teardown(test_prepare_store_enospc, setup, teardown),
        cmocka_unit_test_setup_teardown(test_events_and_stats, setup, teardown),
        cmocka_unit_test_setup_teardown(test_several_engines, setup, teardown),
        cmocka_unit_test_setup_teardown(test_client_killed_mid_request, setup, teardown),
        cmocka_unit_test_setup_teardown(test_malformed_refused_and_counted, setup, teardown),
        cmocka_unit_test_setup_teardown(test_bad_frame_after_hello_releases, setup, teardown),
        cmocka_unit_test_setup_teardown(test_max_clients, setup, teardown),
        cmocka_unit_test_setup_teardown(test_socket_path_stale_and_taken, setup, teardown),
        cmocka_unit_test_setup_teardown(test_daemon_gone, setup, teardown),
        cmocka_unit_test(test_stat_bounds_codec),
        cmocka_unit_test(test_stat_bounds_from_older_node),
        cmocka_unit_test_setup_teardown(test_complete_store_of_another_clients_key_refused, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(test_events_bounded_oldest_dropped, setup, teardown),
        cmocka_unit_test_setup_teardown(test_params_and_requests_bounded, setup, teardown),
        cmocka_unit_test_setup_teardown(test_unread_replies_bounded, setup, teardown),
        cmocka_unit_test_setup_teardown(test_hello_timeout, setup, teardown),
        cmocka_unit_test_setup_teardown(test_full_of_silent_connections, setup, teardown),
        cmocka_unit_test_setup_teardown(test_repeated_key_loads_linear, setup, teardown),
        cmocka_unit_test_setup_teardown(test_hello_name_cannot_forge_log_lines, setup, teardown),
        cmocka_unit_test_setup_teardown(test_socket_mode_and_group, setup, teardown),
        cmocka_unit_test_setup_teardown(test_attach_and_jobs, setup, teardown),
        cmocka_unit_test_setup_teardown(test_attached_region_truncated, setup, teardown),
        cmocka_unit_test_setup_teardown(test_jobs_request_name_reserved, setup, teardown),
        cmocka_unit_test_setup_teardown(test_jobs_request_turns_over, setup, teardown),
        cmocka_unit_test_setup_teardown(test_reset_refused_while_held_then_done, setup, teardown),
        cmocka_unit_test_setup_teardown(test_pending_work_and_reset_drain, setup, teardown),
        cmocka_unit_test_setup_teardown(test_waiting_loads_bounded_per_pass, setup, teardown),
        cmocka_unit_test_setup_teardown(test_node_region_cut_refused_clearly, setup, teardown),
        cmocka_unit_test_setup_teardown(test_fingerprint_first_engine_sets_it, setup, teardown),
        cmocka_unit_test_setup_teardown(test_peers_listed, setup, teardown),
        cmocka_unit_test_setup_teardown(test_error_message_surfaced, setup, teardown),
        cmocka_unit_test_setup_teardown(test_minor0_node_not_asked, setup, teardown),
    };
    int rc;

    signal(SIGPIPE, SIG_IGN);
    g.dir = kt_tmpdir("engine_api");
    assert_non_null(g.dir);
    rc = cmocka_run_group_tests(tests, NULL, NULL);
    free(g.dir);
    return rc;
}

/* SPDX-License-Identifier: Apache-2.0 */
/* kvtier-bench core: single-threaded cost of the primary tier's hot operations at
 * 1e3, 1e5 and 1e6 chunks (index only, no row memory), for LRU and ARC.
 *
 * Keys are 36 bytes like vLLM's (32-byte block hash + 4-byte group) and are visited
 * in a random order, so that large tables pay their cache misses as they would under
 * a real engine. Figures are ns per chunk (ns per call for touch) and bytes of
 * index + policy memory per chunk. */
#include <errno.h>
#include <stdbool.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench.h"
#include "kvt/alloc.h"
#include "kvt/hash.h"
#include "kvt/manager.h"
#include "kvt/primary.h"

#define BATCH 16

struct core_result {
    size_t n;
    const char *policy;
    double hit_ns, hit_many_ns, miss_ns, store_ns, store_evict_ns, touch16_ns;
    double index_bytes_per_chunk;
    double dram_ns; /* dram_read_ns over the index's size */
};

static double now_ns(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e9 + (double)ts.tv_nsec;
}

static void make_key(struct kvt_key *k, uint64_t i)
{
    uint64_t h[4];

    for (int w = 0; w < 4; w++)
        h[w] = kvt_hash64_seed(&i, sizeof(i), (uint64_t)w * 0x9e3779b97f4a7c15ull);
    kvt_key_make(k, h, sizeof(h), 0);
}

static uint64_t rng_state = 0x2545f4914f6cdd1dull;
static uint64_t rnd(void)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}

static void shuffle(uint32_t *a, size_t n)
{
    for (size_t i = n - 1; i > 0; i--) {
        size_t j = rnd() % (i + 1);
        uint32_t t = a[i];

        a[i] = a[j];
        a[j] = t;
    }
}

/* Stores keys[from..to) in batches, completing each batch; returns ns per chunk. */
static int store_range(struct kvt_primary *p, const struct kvt_key *keys, size_t from, size_t to,
                       struct kvt_store_output *out, double *ns_p)
{
    double t0 = now_ns();

    for (size_t i = from; i < to; i += BATCH) {
        size_t n = to - i < BATCH ? to - i : BATCH;
        int rc = kvt_primary_prepare_store(p, keys + i, n, out);

        if (rc < 0)
            return rc;
        kvt_primary_complete_store(p, keys + i, n, true);
    }
    *ns_p = (now_ns() - t0) / (double)(to - from);
    return 0;
}

/* The keys of the lookup phases, laid out in the order they are asked for: an
 * engine hashes the key it looks up just before, so the key itself is in cache;
 * what must miss is the index, not the benchmark's own key array. */
static struct kvt_key *probe_keys(const struct kvt_key *keys, const uint32_t *order, size_t n,
                                  size_t offset)
{
    struct kvt_key *k = malloc(n * sizeof(*k));

    if (k != NULL)
        for (size_t i = 0; i < n; i++)
            k[i] = keys[offset + order[i]];
    return k;
}

static int run_one(size_t n, const char *policy, const struct kvt_key *keys, uint32_t *order,
                   struct core_result *res)
{
    enum kvt_lookup_result results[BATCH];
    struct kvt_primary_config cfg = {.num_chunks = n, .row_bytes = 0, .policy = policy};
    struct kvt_store_output out;
    struct kvt_primary *p;
    volatile unsigned sink = 0;
    size_t ops = n < 1000000 ? 1000000 : n;
    int rc;

    rc = kvt_primary_create(&cfg, NULL, &p);
    if (rc < 0)
        return rc;
    kvt_store_output_init(&out);
    res->n = n;
    res->policy = policy;

    /* Fill: no eviction. */
    rc = store_range(p, keys, 0, n, &out, &res->store_ns);
    if (rc < 0)
        goto out;

    struct kvt_key *hits = probe_keys(keys, order, n, 0), *misses = probe_keys(keys, order, n, n);

    if (hits == NULL || misses == NULL) {
        free(hits);
        free(misses);
        rc = -ENOMEM;
        goto out;
    }
    double t0 = now_ns();

    for (size_t i = 0; i < ops; i++)
        sink += kvt_primary_lookup(p, &hits[i % n]) == KVT_HIT;
    res->hit_ns = (now_ns() - t0) / (double)ops;

    /* The same keys BATCH at a time through the many-key lookup. */
    t0 = now_ns();
    for (size_t i = 0, m; i < ops; i += m) {
        size_t at = i % n;

        m = n - at < BATCH ? n - at : BATCH;
        if (m > ops - i)
            m = ops - i;

        kvt_primary_lookup_many(p, &hits[at], m, results, NULL);
        for (size_t j = 0; j < m; j++)
            sink += results[j] == KVT_HIT;
    }
    res->hit_many_ns = (now_ns() - t0) / (double)ops;
    if (sink != 2 * ops) {
        fprintf(stderr, "bench core: %u of %zu lookups hit\n", sink, 2 * ops);
        free(hits);
        free(misses);
        rc = -EIO;
        goto out;
    }

    t0 = now_ns();
    for (size_t i = 0; i < ops; i++)
        sink += kvt_primary_lookup(p, &misses[i % n]) == KVT_HIT;
    res->miss_ns = (now_ns() - t0) / (double)ops;
    free(hits);
    free(misses);

    size_t touches = ops / BATCH;

    t0 = now_ns();
    for (size_t i = 0; i < touches; i++) {
        size_t start = order[i % n] % (n - BATCH + 1);

        kvt_primary_touch(p, keys + start, BATCH);
    }
    res->touch16_ns = (now_ns() - t0) / (double)touches;

    /* Full: every batch evicts BATCH chunks. A first pass of n such stores brings
     * the policy to its steady state (ARC's ghost lists fill up to capacity, its
     * tables grow once); the second pass is the figure, and the memory is counted
     * after it, ghosts included. */
    double warm_ns;

    rc = store_range(p, keys, n, 2 * n, &out, &warm_ns);
    if (rc == 0)
        rc = store_range(p, keys, 2 * n, 3 * n, &out, &res->store_evict_ns);
    if (rc == 0 && kvt_primary_num_entries(p) != n)
        rc = -EIO;
    res->index_bytes_per_chunk = (double)kvt_primary_index_bytes(p) / (double)n;
out:
    kvt_store_output_cleanup(&out);
    kvt_primary_destroy(p);
    return rc;
}

/* ---- the manager's calls, side by side with vLLM's ------------------------
 * The engine-facing calls of the tiering manager (no secondary tiers), in the
 * call sequence tools/bench/bench_core_vllm.py makes on vLLM's
 * TieringOffloadingManager: requests of PER_REQ keys, each storing them in
 * batches of BATCH and then finishing; requests of PER_REQ one-key lookups
 * (hits, then misses); loads of BATCH hits; touches of BATCH ready keys; and a
 * second and third pass of stores that evict BATCH chunks each. Figures are ns
 * per key (touch16: per call). */
#define PER_REQ 256

struct mgr_result {
    double store_ns, finish_ns, lookup_hit_ns, lookup_miss_ns, load_ns, touch16_ns;
    double store_evict_ns, finish_evict_ns;
};

static struct kvt_req_ctx *bench_req(struct kvt_manager *m)
{
    static unsigned long serial;
    struct kvt_req_ctx *ctx;
    char id[32];

    snprintf(id, sizeof(id), "b%lu", ++serial);
    if (kvt_req_ctx_create(id, NULL, &ctx) != 0)
        return NULL;
    if (kvt_manager_on_new_request(m, ctx, NULL) != 0) {
        kvt_req_ctx_unref(ctx);
        return NULL;
    }
    return ctx;
}

static int bench_finish(struct kvt_manager *m, struct kvt_req_ctx *ctx)
{
    int rc = kvt_manager_on_request_finished(m, ctx);

    kvt_req_ctx_unref(ctx);
    return rc;
}

static int mgr_store_range(struct kvt_manager *m, const struct kvt_key *keys, size_t lo, size_t hi,
                           struct kvt_store_output *out, double *store_ns, double *finish_ns)
{
    double t_store = 0, t_fin = 0;

    for (size_t r = lo; r < hi; r += PER_REQ) {
        struct kvt_req_ctx *ctx = bench_req(m);
        size_t end = r + PER_REQ < hi ? r + PER_REQ : hi;
        double t0, t1;

        if (ctx == NULL)
            return -ENOMEM;
        t0 = now_ns();
        for (size_t b = r; b < end; b += BATCH) {
            size_t k = end - b < BATCH ? end - b : BATCH;
            int rc = kvt_manager_prepare_store(m, keys + b, k, ctx, out);

            if (rc == 0)
                rc = kvt_manager_complete_store(m, out->keys_to_store, out->n_store, ctx, true);
            if (rc != 0) {
                bench_finish(m, ctx);
                return rc;
            }
        }
        t1 = now_ns();
        if (bench_finish(m, ctx) != 0)
            return -EIO;
        t_fin += now_ns() - t1;
        t_store += t1 - t0;
    }
    *store_ns = t_store / (double)(hi - lo);
    *finish_ns = t_fin / (double)(hi - lo);
    return 0;
}

static int mgr_lookups(struct kvt_manager *m, const struct kvt_key *probe, size_t n, size_t ops,
                       enum kvt_lookup_result want, double *ns)
{
    double t = 0;

    for (size_t done = 0; done < ops;) {
        struct kvt_req_ctx *ctx = bench_req(m);
        size_t k = ops - done < PER_REQ ? ops - done : PER_REQ;
        unsigned bad = 0;
        double t0;

        if (ctx == NULL)
            return -ENOMEM;
        t0 = now_ns();
        for (size_t j = 0; j < k; j++)
            bad += kvt_manager_lookup(m, &probe[(done + j) % n], ctx) != want;
        t += now_ns() - t0;
        const char *ids[1] = {ctx->req_id};
        struct kvt_schedule_end_ctx se = {.new_req_ids = ids, .n_new = 1};

        kvt_manager_on_schedule_end(m, &se);
        bench_finish(m, ctx);
        if (bad)
            return -EIO;
        done += k;
    }
    *ns = t / (double)ops;
    return 0;
}

static int run_manager(size_t n, const char *policy, const struct kvt_key *keys,
                       const uint32_t *order, size_t ops, struct mgr_result *res)
{
    struct kvt_primary_config cfg = {.num_chunks = n, .row_bytes = 0, .policy = policy};
    struct kvt_store_output out;
    struct kvt_primary *p;
    struct kvt_manager *m;
    struct kvt_key *hits = NULL, *misses = NULL;
    int64_t ids[BATCH];
    int rc;

    rc = kvt_primary_create(&cfg, NULL, &p);
    if (rc < 0)
        return rc;
    rc = kvt_manager_create(p, NULL, 0, &m);
    if (rc < 0) {
        kvt_primary_destroy(p);
        return rc;
    }
    kvt_store_output_init(&out);
    rc = mgr_store_range(m, keys, 0, n, &out, &res->store_ns, &res->finish_ns);
    if (rc == 0) {
        hits = probe_keys(keys, order, n, 0);
        misses = probe_keys(keys, order, n, n);
        if (hits == NULL || misses == NULL)
            rc = -ENOMEM;
    }
    if (rc == 0)
        rc = mgr_lookups(m, hits, n, ops, KVT_HIT, &res->lookup_hit_ns);
    if (rc == 0)
        rc = mgr_lookups(m, misses, n, ops, KVT_MISS, &res->lookup_miss_ns);

    /* prepare_load + complete_load of BATCH hits, requests of PER_REQ keys */
    double t = 0;

    for (size_t done = 0; rc == 0 && done < ops;) {
        struct kvt_req_ctx *ctx = bench_req(m);
        size_t k = ops - done < PER_REQ ? ops - done : PER_REQ;
        struct kvt_key sel[PER_REQ];
        double t0;

        if (ctx == NULL) {
            rc = -ENOMEM;
            break;
        }
        for (size_t j = 0; j < k; j++)
            sel[j] = hits[(done + j) % n];
        t0 = now_ns();
        for (size_t b = 0; rc == 0 && b < k; b += BATCH) {
            size_t c = k - b < BATCH ? k - b : BATCH;

            rc = kvt_manager_prepare_load(m, sel + b, c, ctx, ids);
            if (rc == 0)
                rc = kvt_manager_complete_load(m, sel + b, c, ctx);
        }
        t += now_ns() - t0;
        bench_finish(m, ctx);
        done += k;
    }
    res->load_ns = t / (double)ops;

    /* touch16 (vLLM: a request of its own re-offering BATCH ready keys) */
    size_t calls = ops / BATCH > 0 ? ops / BATCH : 1;
    struct kvt_req_ctx *tctx = rc == 0 ? bench_req(m) : NULL;

    if (rc == 0 && tctx == NULL)
        rc = -ENOMEM;
    if (rc == 0) {
        double t0 = now_ns();

        for (size_t i = 0; i < calls; i++)
            kvt_manager_touch(m, keys + order[i % n] % (n - BATCH + 1), BATCH, tctx);
        res->touch16_ns = (now_ns() - t0) / (double)calls;
        bench_finish(m, tctx);
    }
    double warm_store, warm_fin;

    if (rc == 0)
        rc = mgr_store_range(m, keys, n, 2 * n, &out, &warm_store, &warm_fin);
    if (rc == 0)
        rc = mgr_store_range(m, keys, 2 * n, 3 * n, &out, &res->store_evict_ns,
                             &res->finish_evict_ns);
    free(hits);
    free(misses);
    kvt_store_output_cleanup(&out);
    kvt_manager_shutdown(m);
    kvt_manager_destroy(m);
    return rc;
}

/* Runs tools/bench/bench_core_vllm.py under python for one size and policy and
 * reads its JSON object into res; -ENOENT when it cannot run. */
static int run_vllm(const char *python, const char *script, size_t n, const char *policy,
                    size_t ops, struct mgr_result *res)
{
    char cmd[4096], buf[4096];
    size_t len;
    FILE *f;
    int st;

    if (snprintf(cmd, sizeof(cmd), "'%s' '%s' --chunks %zu --policy %s --lookups %zu", python,
                 script, n, policy, ops) >= (int)sizeof(cmd))
        return -ENAMETOOLONG;
    f = popen(cmd, "r");
    if (f == NULL)
        return -errno;
    len = fread(buf, 1, sizeof(buf) - 1, f);
    buf[len] = '\0';
    st = pclose(f);
    if (st != 0)
        return -ENOENT;
#define VGET(name)                                                                                 \
    do {                                                                                           \
        const char *at = strstr(buf, "\"" #name "\":");                                            \
        if (at == NULL)                                                                            \
            return -EPROTO;                                                                        \
        res->name = strtod(at + strlen("\"" #name "\":"), NULL);                                   \
    } while (0)
    VGET(store_ns);
    VGET(finish_ns);
    VGET(lookup_hit_ns);
    VGET(lookup_miss_ns);
    VGET(load_ns);
    VGET(touch16_ns);
    VGET(store_evict_ns);
    VGET(finish_evict_ns);
#undef VGET
    return 0;
}

/* Each figure is the best of `repeat` rounds, and each round runs every row once
 * (rows: sizes x policies, kvtier's and vLLM's sides), so a slow stretch of the host
 * that lasts seconds lands on one round of a row, not on all its runs; and a
 * neighbour's burst only ever adds time, so the minimum is the closest to the
 * code's own cost. */
static void keep_min_core(struct core_result *best, const struct core_result *one)
{
#define KEEP_MIN(f) best->f = one->f < best->f ? one->f : best->f
    KEEP_MIN(hit_ns);
    KEEP_MIN(hit_many_ns);
    KEEP_MIN(miss_ns);
    KEEP_MIN(store_ns);
    KEEP_MIN(store_evict_ns);
    KEEP_MIN(touch16_ns);
    KEEP_MIN(dram_ns);
#undef KEEP_MIN
}

/* The floor under a lookup at scale: the latency of one random read from a
 * buffer as large as the primary's index at that size, measured as a pointer
 * chase (each address depends on the last read, so misses cannot overlap). A
 * lookup that misses the caches pays at least one of these, in practice two or
 * three (index slot, entry; the benchmark's own key array is a third). */
static double dram_read_ns(size_t bytes, const uint32_t *order, size_t n, size_t ops)
{
    size_t words = bytes / sizeof(uint64_t), stride = words / n;
    /* the same kind of memory as the index (huge pages where the kernel gives them) */
    uint64_t *buf = kvt_calloc_table(words, sizeof(*buf));
    uint64_t at;
    double t0, ns;

    if (buf == NULL || stride == 0) {
        kvt_free_table(buf, words, sizeof(*buf));
        return 0;
    }
    /* one cycle through the n slots in shuffled order */
    for (size_t i = 0; i < n; i++)
        buf[(size_t)order[i] * stride] = (uint64_t)order[(i + 1) % n] * stride;
    at = (uint64_t)order[0] * stride;
    t0 = now_ns();
    for (size_t i = 0; i < ops; i++)
        at = buf[at];
    ns = (now_ns() - t0) / (double)ops;
    kvt_free_table(buf, words, sizeof(*buf));
    return at == UINT64_MAX ? 0 : ns; /* uses at, so the chase is not optimised away */
}

static void keep_min_mgr(struct mgr_result *best, const struct mgr_result *one)
{
#define KEEP_MIN(f) best->f = one->f < best->f ? one->f : best->f
    KEEP_MIN(store_ns);
    KEEP_MIN(finish_ns);
    KEEP_MIN(lookup_hit_ns);
    KEEP_MIN(lookup_miss_ns);
    KEEP_MIN(load_ns);
    KEEP_MIN(touch16_ns);
    KEEP_MIN(store_evict_ns);
    KEEP_MIN(finish_evict_ns);
#undef KEEP_MIN
}

static void print_mgr_json(const struct mgr_result *r, size_t n, const char *policy, bool first)
{
    printf("%s{\"chunks\":%zu,\"policy\":\"%s\",\"store_ns\":%.1f,\"finish_ns\":%.1f,"
           "\"lookup_hit_ns\":%.1f,\"lookup_miss_ns\":%.1f,\"load_ns\":%.1f,\"touch16_ns\":%.1f,"
           "\"store_evict_ns\":%.1f,\"finish_evict_ns\":%.1f}",
           first ? "" : ",", n, policy, r->store_ns, r->finish_ns, r->lookup_hit_ns,
           r->lookup_miss_ns, r->load_ns, r->touch16_ns, r->store_evict_ns, r->finish_evict_ns);
}

static void print_mgr_row(const char *who, const struct mgr_result *r, size_t n, const char *policy)
{
    printf("%9zu %6s %7s %9.1f %9.1f %9.1f %9.1f %9.1f %10.1f %11.1f %11.1f\n", n, policy, who,
           r->lookup_hit_ns, r->lookup_miss_ns, r->store_ns, r->store_evict_ns, r->load_ns,
           r->touch16_ns, r->finish_ns, r->finish_evict_ns);
}

static void print_ratio_row(const struct mgr_result *v, const struct mgr_result *k, size_t n,
                            const char *policy)
{
    printf("%9zu %6s %7s %8.0fx %8.0fx %8.0fx %8.0fx %8.0fx %9.0fx %10.0fx %10.0fx\n", n, policy,
           "vllm/kv", v->lookup_hit_ns / k->lookup_hit_ns, v->lookup_miss_ns / k->lookup_miss_ns,
           v->store_ns / k->store_ns, v->store_evict_ns / k->store_evict_ns,
           v->load_ns / k->load_ns, v->touch16_ns / k->touch16_ns, v->finish_ns / k->finish_ns,
           v->finish_evict_ns / k->finish_evict_ns);
}

int kvt_bench_core(int argc, char **argv)
{
    static const size_t sizes[] = {1000, 100000, 1000000};
    static const char *const policies[] = {"lru", "arc"};
    struct core_result res[6];
    struct mgr_result mres[6], vres[6];
    bool json = false, have_vllm[6] = {false};
    const char *vllm_python = NULL, *vllm_script = KVT_BENCH_CORE_VLLM_SCRIPT;
    size_t nres = 0, vllm_ops = 100000, max_chunks = 1000000;
    long repeat = 3;

    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--json") == 0) {
            json = true;
        } else if (strcmp(argv[i], "--repeat") == 0 && i + 1 < argc) {
            repeat = strtol(argv[++i], NULL, 10);
        } else if (strcmp(argv[i], "--vllm-python") == 0 && i + 1 < argc) {
            vllm_python = argv[++i];
        } else if (strcmp(argv[i], "--vllm-script") == 0 && i + 1 < argc) {
            vllm_script = argv[++i];
        } else if (strcmp(argv[i], "--max-chunks") == 0 && i + 1 < argc) {
            max_chunks = strtoul(argv[++i], NULL, 10);
            if (max_chunks < sizes[0])
                repeat = 0;
        } else if (strcmp(argv[i], "--vllm-ops") == 0 && i + 1 < argc) {
            vllm_ops = strtoul(argv[++i], NULL, 10);
            if (vllm_ops < BATCH)
                repeat = 0;
        } else {
            repeat = 0;
        }
        if (repeat < 1 || repeat > 100) {
            fprintf(stderr, "usage: kvtier-bench core [--json] [--repeat R (1..100, default 3)]\n"
                            "                         [--vllm-python PY [--vllm-script PATH] "
                            "[--vllm-ops N (default 100000)]]\n");
            return 2;
        }
    }
    size_t max = sizes[2];
    struct kvt_key *keys = malloc(3 * max * sizeof(*keys));
    uint32_t *orders[3] = {NULL, NULL, NULL};
    size_t n_sizes = 0;
    int rc = 0;

    while (n_sizes < 3 && sizes[n_sizes] <= max_chunks)
        n_sizes++;
    if (keys == NULL)
        rc = -ENOMEM;
    for (size_t s = 0; rc == 0 && s < n_sizes; s++) {
        orders[s] = malloc(sizes[s] * sizeof(*orders[s]));
        if (orders[s] == NULL) {
            rc = -ENOMEM;
            break;
        }
        for (uint32_t i = 0; i < sizes[s]; i++)
            orders[s][i] = i;
        shuffle(orders[s], sizes[s]);
    }
    if (rc != 0)
        fprintf(stderr, "bench core: out of memory\n");
    for (size_t i = 0; rc == 0 && i < 3 * max; i++)
        make_key(&keys[i], i);
    nres = 2 * n_sizes;
    for (long r = 0; rc == 0 && r < repeat; r++) {
        for (size_t row = 0; rc == 0 && row < nres; row++) {
            size_t s = row / 2, n = sizes[s], ops = n < 1000000 ? 1000000 : n;
            const char *policy = policies[row % 2];
            struct core_result one;
            struct mgr_result mone, vone;

            rc = run_one(n, policy, keys, orders[s], &one);
            if (rc == 0)
                rc = run_manager(n, policy, keys, orders[s], ops, &mone);
            if (rc < 0) {
                fprintf(stderr, "bench core: %s at %zu chunks failed: %s\n", policy, n,
                        strerror(-rc));
                break;
            }
            /* the floor, measured beside the figures it is the floor of */
            one.dram_ns =
                dram_read_ns((size_t)(one.index_bytes_per_chunk * (double)n), orders[s], n, ops);
            if (r == 0) {
                res[row] = one;
                mres[row] = mone;
            } else {
                keep_min_core(&res[row], &one);
                keep_min_mgr(&mres[row], &mone);
            }
            if (vllm_python != NULL) {
                int vrc = run_vllm(vllm_python, vllm_script, n, policy, vllm_ops, &vone);

                if (vrc < 0)
                    fprintf(stderr, "bench core: vLLM's side at %zu chunks (%s) did not run: %s\n",
                            n, policy, strerror(-vrc));
                else if (have_vllm[row])
                    keep_min_mgr(&vres[row], &vone);
                else
                    vres[row] = vone;
                have_vllm[row] = have_vllm[row] || vrc == 0;
            }
        }
    }
    free(keys);
    for (size_t s = 0; s < 3; s++)
        free(orders[s]);
    if (rc != 0)
        return 1;

    if (json) {
        printf("{\"bench\":\"core\",\"key_bytes\":36,\"batch\":%d,\"best_of\":%ld,"
               "\"results\":[",
               BATCH, repeat);
        for (size_t i = 0; i < nres; i++)
            printf("%s{\"chunks\":%zu,\"policy\":\"%s\",\"lookup_hit_ns\":%.1f,"
                   "\"lookup_hit_many_ns\":%.1f,\"lookup_miss_ns\":%.1f,\"store_complete_ns\":%.1f,"
                   "\"store_complete_evict_ns\":%.1f,\"touch16_ns\":%.1f,"
                   "\"index_bytes_per_chunk\":%.1f,\"key_bytes_per_chunk\":%zu,"
                   "\"dram_random_read_ns\":%.1f}",
                   i ? "," : "", res[i].n, res[i].policy, res[i].hit_ns, res[i].hit_many_ns,
                   res[i].miss_ns, res[i].store_ns, res[i].store_evict_ns, res[i].touch16_ns,
                   res[i].index_bytes_per_chunk, sizeof(struct kvt_key), res[i].dram_ns);
        printf("],\"manager\":[");
        for (size_t i = 0; i < nres; i++)
            print_mgr_json(&mres[i], res[i].n, res[i].policy, i == 0);
        printf("],\"vllm\":[");
        for (size_t i = 0, first = 1; i < nres; i++) {
            if (!have_vllm[i])
                continue;
            print_mgr_json(&vres[i], res[i].n, res[i].policy, first);
            first = 0;
        }
        printf("]}\n");
        return 0;
    }
    printf("kvtier-bench core (single thread, 36-byte keys, batches of %d, ns per chunk, best of "
           "%ld runs)\n",
           BATCH, repeat);
    printf("%9s %6s %8s %9s %8s %8s %12s %9s %14s %9s\n", "chunks", "policy", "hit", "hit-many",
           "miss", "store", "store+evict", "touch16", "index B/chunk", "dram rd");
    for (size_t i = 0; i < nres; i++)
        printf("%9zu %6s %8.1f %9.1f %8.1f %8.1f %12.1f %9.1f %14.1f %9.1f\n", res[i].n,
               res[i].policy, res[i].hit_ns, res[i].hit_many_ns, res[i].miss_ns, res[i].store_ns,
               res[i].store_evict_ns, res[i].touch16_ns, res[i].index_bytes_per_chunk,
               res[i].dram_ns);
    printf("index B/chunk includes the %zu-byte key held in each entry\n", sizeof(struct kvt_key));
    for (size_t q = 0; q < 2 && nres == 6; q++)
        printf("growth 1e3 -> 1e6 (%s): hit %.2fx, hit-many %.2fx, store+evict %.2fx\n",
               res[q].policy, res[4 + q].hit_ns / res[q].hit_ns,
               res[4 + q].hit_many_ns / res[q].hit_many_ns,
               res[4 + q].store_evict_ns / res[q].store_evict_ns);
    printf("\nthe manager's calls (no secondary tiers; requests of %d keys; ns per key, touch16 "
           "per call)%s\n",
           PER_REQ, vllm_python != NULL ? ", beside vLLM's TieringOffloadingManager" : "");
    printf("%9s %6s %7s %9s %9s %9s %9s %9s %10s %11s %11s\n", "chunks", "policy", "who", "lookup",
           "miss", "store", "st+evict", "load", "touch16", "finish", "fin+evict");
    for (size_t i = 0; i < nres; i++) {
        print_mgr_row("kvtier", &mres[i], res[i].n, res[i].policy);
        if (have_vllm[i]) {
            print_mgr_row("vllm", &vres[i], res[i].n, res[i].policy);
            print_ratio_row(&vres[i], &mres[i], res[i].n, res[i].policy);
        }
    }
    return 0;
}

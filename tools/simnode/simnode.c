/* SPDX-License-Identifier: Apache-2.0 */
/* kvtier-simnode: one kvtier node and a small engine simulator in one process, for
 * the cluster tests. The node is kvtierd's own (kvt_node_open: the runtime folders,
 * the region, the tiers in their configured order, the peer links, the manager, the
 * engine socket, /metrics), configured as kvtierd is, from a YAML file and --set
 * overrides, with kvtierd's defaults for whatever they leave out; it must run the
 * network tier. The "engine" plays vLLM through the manager API: it stores chunks of
 * known content and loads them back, checking every byte.
 *
 *   kvtier-simnode [--config FILE] [--set KEY=VALUE]...
 *   kvtier-simnode --version | --help
 *
 * (kvtierd --help lists the keys.) It prints "ready id=<hex> port=<p> inc=<hex>" and
 * then reads commands on stdin, one per line, answering each with one line "ok ..." or
 * "err ..." (progress lines "progress ..." may come before the answer). Between
 * commands the node runs kvtierd's loop: it sleeps on the node's fd as long as the
 * node allows, then lets it do what is due (the tick's step, the tiers' polls).
 *
 *   store SEED FIRST N            stores chunks (SEED, FIRST..FIRST+N-1)
 *   load SEED FIRST N TIMEOUT_MS [pause]
 *                                 looks them up until HIT or MISS, loads the hits and
 *                                 checks their bytes: hit miss corrupt retry pending
 *                                 steps_p50 steps_p99 ms_p50 ms_p99 seconds. With
 *                                 "pause", once the load's first GRANT is in (or, in
 *                                 network.fetch direct, its first READs posted
 *                                 direct), the node
 *                                 prints "progress paused ..." and neither steps nor
 *                                 reads more until the line "continue": a fixed point
 *                                 mid-pull (leases held, at most fetches_per_peer
 *                                 FETCHes granted) for the tests that kill a node there
 *   pull SEED FIRST N TIMEOUT_MS REQ_KEYS INFLIGHT [STEP_US]
 *                                 the same keys as engine requests of REQ_KEYS keys,
 *                                 INFLIGHT of them at a time (a new one starts when one
 *                                 is loaded); the engine looks its waiting keys up and
 *                                 steps every STEP_US (500) us, the node's loop runs in
 *                                 between and sleeps only when nothing is in flight; a
 *                                 loaded request's hits stay prepared
 *                                 for load until the last request has answered, then
 *                                 every byte is checked (struct held_load): hit miss
 *                                 corrupt timeout requests req_ms_p50 req_ms_p99
 *                                 (request start to its last key HIT) ms_p50 ms_p99
 *                                 (per key) steps seconds (to the last answer)
 *                                 check_seconds cpu_seconds (this process's CPU
 *                                 time until the last answer, every thread)
 *   timing                        where the network tier's time went (sums, ms; and
 *                                 idle_poll_ms, the loop's busy poll with nothing
 *                                 arriving while transfers were in flight)
 *   cpu                           this process's CPU time so far (cpu_seconds)
 *   pages                         how much of the primary region is on huge pages
 *                                 (huge_bytes region_bytes): a peer's READs over
 *                                 shared memory pin and copy 4 KiB pages one by one
 *   rewrite SEED FIRST N MS       rewrites those chunks' rows in place for MS ms,
 *                                 each row between kvt_primary_rewrite_begin and
 *                                 _end (its fence word odd, then moved on): torn and
 *                                 changed rows for the peers, which must refuse them
 *                                 under either network.verify
 *   garbage PEER_ID N             sends N malformed / truncated / oversized control
 *                                 messages to that peer on an authenticated link
 *   wait-live N MS [ID...]        until N members (self included) are live; with
 *                                 IDs (hex, as garbage's, self included), until the
 *                                 live members are exactly those (a count alone
 *                                 passes on the wrong pair while a death or a
 *                                 return is not seen yet); answers the live ids
 *   counts                        the network tier's and the peer links' counters
 *   step MS                       keeps stepping for MS ms
 *   quit                          orderly shutdown (kvtierd's SIGTERM), exit 0
 */
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <poll.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

#include "kvt/alloc.h"
#include "kvt/clock.h"
#include "kvt/common.h"
#include "kvt/config.h"
#include "kvt/hash.h"
#include "kvt/log.h"
#include "kvt/manager.h"
#include "kvt/net_tier.h"
#include "kvt/node.h"
#include "kvt/peers.h"
#include "kvt/primary.h"
#include "kvt/region.h"
#include "kvt/version.h"

/* The node and its parts the simulator drives (all owned by kvt_node). */
struct node {
    struct kvt_node *node;
    struct kvt_peers *peers;
    struct kvt_manager *m;
    struct kvt_tier *net;
    struct kvt_primary *primary;
    size_t row;
    size_t chunks;
    unsigned req_seq;
    uint64_t *pattern; /* row / 8 words, the same in every node: see fill() */
};

static void key_of(uint32_t seed, uint32_t i, struct kvt_key *k)
{
    uint8_t b[16];
    uint64_t h;

    memcpy(b + 8, &seed, 4);
    memcpy(b + 12, &i, 4);
    h = kvt_hash64(b + 8, 8);
    memcpy(b, &h, 8);
    kvt_key_set(k, b, sizeof(b));
}

/* The content of a chunk: a function of its key only, word w being pattern[w] (random
 * words from a fixed seed, the same in every node) XOR a word of the key's hash. A
 * chunk of another key, a shifted or a torn one differs in some word, and the
 * engine's byte-for-byte check of a pulled chunk is one pass at memory speed (it is
 * timed in the pull bench). */
static uint64_t *pattern_create(size_t row)
{
    uint64_t *p = kvt_calloc(row / 8 + 1, sizeof(*p)), x = 0x2545f4914f6cdd1dull; /* +1: row < 8 */

    for (size_t w = 0; p != NULL && w < row / 8; w++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        p[w] = x;
    }
    return p;
}

static uint64_t pattern_key_word(const struct kvt_key *k)
{
    return kvt_hash64(k->bytes, k->len) | 1;
}

static void fill(const struct node *n, uint8_t *row, const struct kvt_key *k)
{
    uint64_t kw = pattern_key_word(k);

    for (size_t w = 0; w < n->row / 8; w++) {
        uint64_t x = n->pattern[w] ^ kw;

        memcpy(row + w * 8, &x, 8);
    }
}

static bool check(const struct node *n, const uint8_t *row, const struct kvt_key *k)
{
    uint64_t kw = pattern_key_word(k), diff = 0;

    for (size_t w = 0; w < n->row / 8; w++) {
        uint64_t y;

        memcpy(&y, row + w * 8, 8);
        diff |= y ^ n->pattern[w] ^ kw;
    }
    return diff == 0;
}

static uint8_t *row_of(const struct node *n, int64_t slot)
{
    return n->net->primary_base + (size_t)slot * n->row;
}

/* The engine's schedule end. */
static void step(struct node *n)
{
    kvt_node_step(n->node);
}

static void step_for(struct node *n, unsigned ms)
{
    uint64_t end = kvt_now_ns() + (uint64_t)ms * 1000000ull;

    while (kvt_now_ns() < end) {
        step(n);
        usleep(500);
    }
}

static struct kvt_req_ctx *new_req(struct node *n, const char *what)
{
    char id[64];
    struct kvt_req_ctx *ctx;
    enum kvt_offload_policy pol;

    snprintf(id, sizeof(id), "%s-%u", what, ++n->req_seq);
    if (kvt_req_ctx_create(id, NULL, &ctx) != 0)
        return NULL;
    if (kvt_manager_on_new_request(n->m, ctx, &pol) != 0) {
        kvt_req_ctx_unref(ctx);
        return NULL;
    }
    return ctx;
}

static void end_req(struct node *n, struct kvt_req_ctx *ctx)
{
    kvt_manager_on_request_finished(n->m, ctx);
    kvt_req_ctx_unref(ctx);
}

static void cmd_store(struct node *n, uint32_t seed, uint32_t first, uint32_t count)
{
    struct kvt_store_output out;
    struct kvt_key keys[64];
    uint32_t stored = 0, refused = 0;

    kvt_store_output_init(&out);
    for (uint32_t base = 0; base < count; base += 64) {
        uint32_t k = count - base < 64 ? count - base : 64;
        struct kvt_req_ctx *ctx = new_req(n, "store");

        if (ctx == NULL)
            break;
        for (uint32_t i = 0; i < k; i++)
            key_of(seed, first + base + i, &keys[i]);
        if (kvt_manager_prepare_store(n->m, keys, k, ctx, &out) != 0) {
            refused += k;
        } else {
            for (size_t i = 0; i < out.n_store; i++)
                fill(n, row_of(n, out.chunk_ids[i]), &out.keys_to_store[i]);
            kvt_manager_complete_store(n->m, out.keys_to_store, out.n_store, ctx, true);
            stored += (uint32_t)out.n_store;
        }
        end_req(n, ctx);
        step(n);
    }
    kvt_store_output_cleanup(&out);
    step_for(n, 20); /* cascades run, publishes go out */
    printf("ok stored=%u refused=%u\n", stored, refused);
}

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;

    return x < y ? -1 : x > y;
}

/* The "pause" of a load: blocks, not stepping, until the driver says "continue". */
static void pause_until_continue(struct node *n)
{
    struct kvt_net_tier_counts c;
    char line[64];

    kvt_net_tier_counts(n->net, &c);
    printf("progress paused fetches=%" PRIu64 " grants=%" PRIu64 " pulled=%" PRIu64
           " direct_fetches=%" PRIu64 " direct=%" PRIu64 "\n",
           c.fetches, c.grants, c.pulled_chunks, c.direct_fetches, c.direct_chunks);
    fflush(stdout);
    while (fgets(line, sizeof(line), stdin) != NULL) {
        if (strncmp(line, "continue", 8) == 0)
            return;
        printf("progress paused: expected continue, got %s", line);
        fflush(stdout);
    }
    exit(0); /* the driver went away */
}

static void cmd_load(struct node *n, uint32_t seed, uint32_t first, uint32_t count,
                     unsigned timeout_ms, bool pause)
{
    struct kvt_key *keys = kvt_calloc(count ? count : 1, sizeof(*keys));
    int *res = kvt_calloc(count ? count : 1, sizeof(*res));
    uint64_t *steps = kvt_calloc(count ? count : 1, sizeof(*steps));
    uint64_t *ns = kvt_calloc(count ? count : 1, sizeof(*ns));
    struct kvt_req_ctx *ctx = new_req(n, "load");
    uint64_t t0 = kvt_now_ns(), deadline = t0 + (uint64_t)timeout_ms * 1000000ull;
    uint64_t last_progress = t0, nstep = 0;
    uint32_t left = count, hit = 0, miss = 0, corrupt = 0, retry = 0, pending = 0, timeout = 0;
    uint32_t n_hits = 0;
    struct kvt_key *hk;
    int64_t *slots;
    struct kvt_net_tier_counts c0;

    if (keys == NULL || res == NULL || steps == NULL || ns == NULL || ctx == NULL) {
        printf("err out of memory\n");
        goto out;
    }
    kvt_net_tier_counts(n->net, &c0);
    for (uint32_t i = 0; i < count; i++) {
        key_of(seed, first + i, &keys[i]);
        res[i] = -1;
    }
    while (left > 0 && kvt_now_ns() < deadline) {
        for (uint32_t i = 0; i < count; i++) {
            enum kvt_lookup_result r;

            if (res[i] >= 0)
                continue;
            r = kvt_manager_lookup(n->m, &keys[i], ctx);
            if (r == KVT_HIT || r == KVT_MISS) {
                res[i] = (int)r;
                steps[i] = nstep;
                ns[i] = kvt_now_ns() - t0;
                left--;
            } else if (r == KVT_RETRY) {
                retry++;
            } else {
                pending++;
            }
        }
        step(n);
        nstep++;
        if (pause) {
            struct kvt_net_tier_counts c;

            kvt_net_tier_counts(n->net, &c);
            if (c.grants > c0.grants || c.direct_fetches > c0.direct_fetches) {
                pause_until_continue(n);
                pause = false;
            }
        }
        if (kvt_now_ns() - last_progress > 5000000ull) {
            struct kvt_net_tier_counts c;

            kvt_net_tier_counts(n->net, &c);
            printf("progress fetches=%" PRIu64 " pulled=%" PRIu64 " left=%u\n", c.fetches,
                   c.pulled_chunks, left);
            fflush(stdout);
            last_progress = kvt_now_ns();
        }
        usleep(200);
    }
    hk = kvt_calloc(count ? count : 1, sizeof(*hk));
    slots = kvt_calloc(count ? count : 1, sizeof(*slots));
    for (uint32_t i = 0; i < count; i++) {
        if (res[i] == KVT_HIT && hk != NULL)
            hk[n_hits++] = keys[i];
        else if (res[i] == KVT_MISS)
            miss++;
        else if (res[i] < 0)
            timeout++;
    }
    if (n_hits > 0 && kvt_manager_prepare_load(n->m, hk, n_hits, ctx, slots) == 0) {
        for (uint32_t i = 0; i < n_hits; i++) {
            if (check(n, row_of(n, slots[i]), &hk[i]))
                hit++;
            else
                corrupt++;
        }
        kvt_manager_complete_load(n->m, hk, n_hits, ctx);
    } else if (n_hits > 0) {
        corrupt = n_hits; /* a HIT that cannot be loaded is a lie too */
    }
    kvt_free(hk);
    kvt_free(slots);
    {
        uint64_t sv[2] = {0, 0}, tv[2] = {0, 0};
        uint64_t *s2 = kvt_calloc(count ? count : 1, sizeof(*s2));
        uint64_t *t2 = kvt_calloc(count ? count : 1, sizeof(*t2));
        uint32_t k = 0;

        for (uint32_t i = 0; s2 != NULL && t2 != NULL && i < count; i++) {
            if (res[i] == KVT_HIT) {
                s2[k] = steps[i];
                t2[k++] = ns[i];
            }
        }
        if (k > 0) {
            qsort(s2, k, sizeof(*s2), cmp_u64);
            qsort(t2, k, sizeof(*t2), cmp_u64);
            sv[0] = s2[k / 2], sv[1] = s2[(k * 99) / 100];
            tv[0] = t2[k / 2], tv[1] = t2[(k * 99) / 100];
        }
        kvt_free(s2);
        kvt_free(t2);
        printf("ok hit=%u miss=%u corrupt=%u timeout=%u retry=%u pending=%u steps_p50=%" PRIu64
               " steps_p99=%" PRIu64 " ms_p50=%.1f ms_p99=%.1f seconds=%.3f\n",
               hit, miss, corrupt, timeout, retry, pending, sv[0], sv[1], (double)tv[0] / 1e6,
               (double)tv[1] / 1e6, (double)(kvt_now_ns() - t0) / 1e9);
    }
out:
    if (ctx != NULL)
        end_req(n, ctx);
    kvt_free(keys);
    kvt_free(res);
    kvt_free(steps);
    kvt_free(ns);
}

/* Sleeps until the node has news, at most 200 us, when the node lets it sleep at all
 * (nothing in flight: over tcp both sides' progress moves a READ's bytes, as in
 * kvtier-bench transport, which busy-polls). */
static void wait_events(struct node *n)
{
    struct pollfd pfd = {.fd = kvt_node_fd(n->node), .events = POLLIN};
    struct timespec ts = {0, 200000};

    if (kvt_node_timeout_ms(n->node) > 0)
        ppoll(&pfd, 1, &ts, NULL);
}

struct pull_req {
    struct kvt_req_ctx *ctx;
    uint32_t first, n, left;
    uint64_t t0;
};

/* A loaded request's hits, prepared for load (pinned) until the pull's timed phase
 * is over; then every byte is checked and the load completed. In a deployment the
 * engine consumes its loaded blocks by DMA to the GPU, which costs the host no CPU;
 * checking them here, on the two cores the nodes share, would time this simulator's
 * oracle, not the pull (the transport ceiling and redis-benchmark check nothing). */
struct held_load {
    struct held_load *next;
    struct kvt_req_ctx *ctx;
    struct kvt_key *keys;
    int64_t *slots;
    uint32_t n;
};

static void held_load_free(struct held_load *h)
{
    if (h == NULL)
        return;
    kvt_free(h->keys);
    kvt_free(h->slots);
    kvt_free(h);
}

/* A request whose keys all answered: its hits are prepared for load and held. */
static void pull_req_end(struct node *n, struct pull_req *r, const struct kvt_key *keys,
                         const int *res, struct held_load **held, uint32_t *corrupt)
{
    struct held_load *h = kvt_calloc(1, sizeof(*h));
    uint32_t nh = 0;

    if (h != NULL) {
        h->keys = kvt_calloc(r->n, sizeof(*h->keys));
        h->slots = kvt_calloc(r->n, sizeof(*h->slots));
    }
    if (h == NULL || h->keys == NULL || h->slots == NULL) {
        fprintf(stderr, "kvtier-simnode: pull: out of memory, a request's hits not loaded\n");
        end_req(n, r->ctx);
        held_load_free(h);
        r->ctx = NULL;
        return;
    }
    for (uint32_t i = 0; i < r->n; i++) {
        if (res[r->first + i] == KVT_HIT)
            h->keys[nh++] = keys[r->first + i];
    }
    if (nh > 0 && kvt_manager_prepare_load(n->m, h->keys, nh, r->ctx, h->slots) == 0) {
        h->n = nh;
        h->ctx = r->ctx;
        h->next = *held;
        *held = h;
    } else {
        *corrupt += nh; /* a HIT that cannot be loaded is a lie too */
        end_req(n, r->ctx);
        held_load_free(h);
    }
    r->ctx = NULL;
}

/* Checks every held row, completes the loads and ends their requests. */
static void check_held(struct node *n, struct held_load *h, uint32_t *hit, uint32_t *corrupt)
{
    while (h != NULL) {
        struct held_load *next = h->next;

        for (uint32_t i = 0; i < h->n; i++) {
            if (check(n, row_of(n, h->slots[i]), &h->keys[i]))
                (*hit)++;
            else
                (*corrupt)++;
        }
        kvt_manager_complete_load(n->m, h->keys, h->n, h->ctx);
        end_req(n, h->ctx);
        held_load_free(h);
        h = next;
    }
}

/* CPU time of this process (every thread, user and system), in seconds. */
static double cpu_s(void)
{
    struct rusage ru;

    if (getrusage(RUSAGE_SELF, &ru) != 0)
        return 0;
    return (double)(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) +
           (double)(ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) / 1e6;
}

static void cmd_pull(struct node *n, uint32_t seed, uint32_t first, uint32_t count,
                     unsigned timeout_ms, uint32_t per, uint32_t inflight, unsigned step_us)
{
    uint32_t n_req = per ? (count + per - 1) / per : 0;
    struct kvt_key *keys = kvt_calloc(count ? count : 1, sizeof(*keys));
    int *res = kvt_calloc(count ? count : 1, sizeof(*res));
    uint64_t *ns = kvt_calloc(count ? count : 1, sizeof(*ns));
    uint64_t *req_ns = kvt_calloc(n_req ? n_req : 1, sizeof(*req_ns));
    struct pull_req *act = kvt_calloc(inflight ? inflight : 1, sizeof(*act));
    uint64_t t0 = kvt_now_ns(), deadline = t0 + (uint64_t)timeout_ms * 1000000ull;
    uint32_t next = 0, done = 0, hit = 0, miss = 0, corrupt = 0, timeout = 0, k = 0;
    uint64_t steps = 0, next_step = 0, t_pull = 0;
    struct held_load *held = NULL;
    double cpu0 = cpu_s(), cpu_pull = 0;

    if (per == 0 || inflight == 0 || keys == NULL || res == NULL || ns == NULL || req_ns == NULL ||
        act == NULL) {
        printf("err bad arguments or out of memory\n");
        goto out;
    }
    for (uint32_t i = 0; i < count; i++) {
        key_of(seed, first + i, &keys[i]);
        res[i] = -1;
    }
    while (done < n_req && kvt_now_ns() < deadline) {
        if (kvt_now_ns() < next_step) { /* between engine steps: the node's own loop */
            kvt_node_progress(n->node);
            wait_events(n);
            continue;
        }
        next_step = kvt_now_ns() + (uint64_t)step_us * 1000u;
        for (uint32_t a = 0; a < inflight; a++) {
            struct pull_req *r = &act[a];

            if (r->ctx == NULL && next < n_req) {
                r->ctx = new_req(n, "pull");
                if (r->ctx == NULL)
                    continue;
                r->first = next * per;
                r->n = KVT_MIN(per, count - r->first);
                r->left = r->n;
                r->t0 = kvt_now_ns();
                next++;
            }
            if (r->ctx == NULL)
                continue;
            for (uint32_t i = r->first; i < r->first + r->n; i++) {
                enum kvt_lookup_result lr;

                if (res[i] >= 0)
                    continue;
                lr = kvt_manager_lookup(n->m, &keys[i], r->ctx);
                if (lr == KVT_HIT || lr == KVT_MISS) {
                    res[i] = (int)lr;
                    ns[i] = kvt_now_ns() - r->t0;
                    r->left--;
                }
            }
            if (r->left == 0) {
                req_ns[done++] = kvt_now_ns() - r->t0;
                pull_req_end(n, r, keys, res, &held, &corrupt);
            }
        }
        step(n);
        steps++;
        wait_events(n);
    }
    t_pull = kvt_now_ns() - t0;
    cpu_pull = cpu_s() - cpu0; /* the byte check below is the bench's, not the pull's */
    check_held(n, held, &hit, &corrupt);
    for (uint32_t a = 0; a < inflight; a++) {
        if (act[a].ctx != NULL)
            end_req(n, act[a].ctx);
    }
    for (uint32_t i = 0; i < count; i++) {
        if (res[i] == KVT_MISS)
            miss++;
        else if (res[i] < 0)
            timeout++;
        else
            ns[k++] = ns[i];
    }
    qsort(ns, k, sizeof(*ns), cmp_u64);
    qsort(req_ns, done, sizeof(*req_ns), cmp_u64);
    printf("ok hit=%u miss=%u corrupt=%u timeout=%u requests=%u req_ms_p50=%.1f req_ms_p99=%.1f "
           "ms_p50=%.1f ms_p99=%.1f steps=%" PRIu64 " seconds=%.3f check_seconds=%.3f "
           "cpu_seconds=%.4f\n",
           hit, miss, corrupt, timeout, done, done ? (double)req_ns[done / 2] / 1e6 : 0,
           done ? (double)req_ns[(done * 99) / 100] / 1e6 : 0, k ? (double)ns[k / 2] / 1e6 : 0,
           k ? (double)ns[(k * 99) / 100] / 1e6 : 0, steps, (double)t_pull / 1e9,
           (double)(kvt_now_ns() - t0 - t_pull) / 1e9, cpu_pull);
out:
    kvt_free(keys);
    kvt_free(res);
    kvt_free(ns);
    kvt_free(req_ns);
    kvt_free(act);
}

/* The primary's pages: huge_bytes of region_bytes on huge pages (smaps). */
static void cmd_pages(struct node *n)
{
    const struct kvt_region *r = kvt_node_region(n->node);
    size_t huge = 0;
    int rc = r != NULL ? kvt_region_huge_bytes(r, &huge) : -ENOENT;

    if (rc != 0)
        printf("err pages: %s\n", strerror(-rc));
    else
        printf("ok huge_bytes=%zu region_bytes=%zu\n", huge, r->size);
}

static void cmd_timing(struct node *n)
{
    struct kvt_net_tier_counts c;

    kvt_net_tier_counts(n->net, &c);
    printf("ok locate_rtts=%" PRIu64 " locate_rtt_ms=%.1f fetches=%" PRIu64
           " fetch_queue_ms=%.1f grants=%" PRIu64 " grant_wait_ms=%.1f read_ms=%.1f"
           " verify_ms=%.1f served_fetches=%" PRIu64 " serve_wait_ms=%.1f direct_chunks=%" PRIu64
           " direct_misses=%" PRIu64 " idle_polls=%" PRIu64 " idle_poll_ms=%.1f\n",
           c.locate_rtts, (double)c.locate_rtt_ns / 1e6, c.fetches, (double)c.fetch_queue_ns / 1e6,
           c.grants, (double)c.grant_wait_ns / 1e6, (double)c.read_ns / 1e6,
           (double)c.verify_ns / 1e6, c.served_fetches, (double)c.serve_wait_ns / 1e6,
           c.direct_chunks, c.direct_misses, c.idle_polls, (double)c.idle_poll_ns / 1e6);
}

static void cmd_rewrite(struct node *n, uint32_t seed, uint32_t first, uint32_t count, unsigned ms)
{
    uint64_t end = kvt_now_ns() + (uint64_t)ms * 1000000ull, rounds = 0;

    while (kvt_now_ns() < end) {
        for (uint32_t i = 0; i < count; i++) {
            struct kvt_key k;
            uint8_t *row;

            key_of(seed, first + i, &k);
            if (kvt_primary_rewrite_begin(n->primary, &k, &row) != 0)
                continue;
            /* One word per 4 KiB page, incremented: a READ in flight sees some
             * pages changed, and no round brings the stored bytes back (an XOR
             * with rounds + 1 did every 4th round, so a READ served between two
             * rounds could see the original). */
            for (size_t off = 0; off + 8 <= n->row; off += 4096) {
                uint64_t w;

                memcpy(&w, row + off, 8);
                w++;
                memcpy(row + off, &w, 8);
            }
            (void)kvt_primary_rewrite_end(n->primary, &k);
        }
        rounds++;
        step(n);
    }
    printf("ok rounds=%" PRIu64 "\n", rounds);
}

static void cmd_garbage(struct node *n, uint64_t peer, unsigned count)
{
    struct kvt_tp_ep *ep = kvt_peers_link(n->peers, peer);
    static uint8_t big[60000];
    unsigned sent = 0;

    if (ep == NULL) {
        printf("err no link to %016" PRIx64 "\n", peer);
        return;
    }
    for (unsigned i = 0; i < count; i++) {
        uint8_t junk[64];
        const void *buf = junk;
        size_t len;
        int rc;

        switch (i % 4) {
        case 0: /* not msgpack at all */
            memset(junk, 0xc1, sizeof(junk));
            len = sizeof(junk);
            break;
        case 1: /* a map that declares more than it holds (truncated) */
            junk[0] = 0xdf, junk[1] = 0xff, junk[2] = 0xff, junk[3] = 0xff, junk[4] = 0xff;
            len = 5;
            break;
        case 2: /* a bin that claims 4 GiB */
            junk[0] = 0x81, junk[1] = 0x00, junk[2] = 0xc6;
            memset(junk + 3, 0xff, 4);
            len = 7;
            break;
        default: /* big, and nothing but nested arrays (over the depth limit) */
            memset(big, 0x91, sizeof(big));
            buf = big;
            len = sizeof(big);
            break;
        }
        for (int tries = 0; tries < 1000; tries++) {
            rc = kvt_tp_send(ep, buf, len);
            if (rc != -EAGAIN)
                break;
            step(n);
        }
        if (rc == 0)
            sent++;
    }
    step_for(n, 50);
    printf("ok sent=%u\n", sent);
}

static void cmd_counts(struct node *n)
{
    struct kvt_net_tier_counts c;
    struct kvt_peers_counts p;
    uint64_t live[64];

    kvt_net_tier_counts(n->net, &c);
    kvt_peers_counts(n->peers, &p);
    printf("ok fetches=%" PRIu64 " grants=%" PRIu64 " denies=%" PRIu64 " pulled=%" PRIu64
           " served=%" PRIu64 " checksum_fail=%" PRIu64 " fence_fail=%" PRIu64
           " fence_changed=%" PRIu64 " fence_writing=%" PRIu64 " fence_unread=%" PRIu64
           " leases=%" PRIu64 " lease_exp=%" PRIu64 " reaped=%" PRIu64 " refused=%" PRIu64
           " send_failures=%" PRIu64 " failed_fetches=%" PRIu64 " records=%" PRIu64
           " published=%" PRIu64 " malformed=%" PRIu64 " peer_refused=%" PRIu64
           " auth_refused=%" PRIu64 " ns_refused=%" PRIu64 " direct=%" PRIu64
           " direct_miss=%" PRIu64 " exposed=%" PRIu64 " locates=%" PRIu64
           " locate_timeouts=%" PRIu64 " down=%" PRIu64 " down_silent=%" PRIu64 " live=%zu\n",
           c.fetches, c.grants, c.denies, c.pulled_chunks, c.served_chunks, c.checksum_failures,
           c.fence_failures, c.fence_fail[KVT_NET_FENCE_CHANGED],
           c.fence_fail[KVT_NET_FENCE_WRITING], c.fence_fail[KVT_NET_FENCE_UNREAD], c.active_leases,
           c.lease_expiries, c.leases_reaped, c.refused, c.send_failures, c.failed_fetches,
           c.directory_records, c.published_keys, p.malformed, p.refused,
           p.refused_by_reason[KVT_WIRE_R_AUTH], p.refused_by_reason[KVT_WIRE_R_NAMESPACE],
           c.direct_chunks, c.direct_misses, c.direct_exposed_links, c.locates, c.locate_timeouts,
           p.members_down, p.members_silent, kvt_peers_live(n->peers, live, 64));
}

/* The live ids are exactly want[0..n) (in any order). */
static bool live_set_is(const uint64_t *live, size_t got, const uint64_t *want, size_t n)
{
    if (got != n)
        return false;
    for (size_t i = 0; i < n; i++) {
        bool found = false;

        for (size_t j = 0; j < got && !found; j++)
            found = live[j] == want[i];
        if (!found)
            return false;
    }
    return true;
}

/* args: what follows "wait-live N MS" (the optional ids). */
static void cmd_wait_live(struct node *n, size_t want, unsigned ms, const char *args)
{
    uint64_t end = kvt_now_ns() + (uint64_t)ms * 1000000ull;
    uint64_t live[64], ids[64];
    size_t got = 0, n_ids = 0;
    bool ok = false;

    while (args != NULL && *args != '\0' && n_ids < KVT_ARRAY_SIZE(ids)) {
        char *e;
        uint64_t id = strtoull(args, &e, 16);

        if (e == args)
            break;
        ids[n_ids++] = id;
        args = e;
    }
    if (n_ids > 0 && n_ids != want) {
        printf("err wait-live: %zu ids for %zu members\n", n_ids, want);
        return;
    }
    while (kvt_now_ns() < end) {
        got = kvt_peers_live(n->peers, live, 64);
        ok = n_ids > 0 ? live_set_is(live, got, ids, n_ids) : got == want;
        if (ok)
            break;
        step(n);
        usleep(500);
    }
    printf("%s live=%zu ids=", ok ? "ok" : "err", got);
    for (size_t i = 0; i < got; i++)
        printf("%s%" PRIx64, i > 0 ? "," : "", live[i]);
    printf("\n");
}

static void usage(FILE *f)
{
    fprintf(f, "usage: kvtier-simnode [--config FILE] [--set KEY=VALUE]...\n"
               "       kvtier-simnode --version | --help\n\n"
               "One kvtier node (kvtierd's, configured as kvtierd is: kvtierd --help lists\n"
               "the keys; it must run the network tier) and an engine simulator driven by\n"
               "commands on stdin (see tools/simnode/simnode.c).\n");
}

static int run(struct node *n)
{
    char line[256];
    uint64_t next_look = 0;

    for (;;) {
        struct pollfd pfd[2] = {{.fd = 0, .events = POLLIN},
                                {.fd = kvt_node_fd(n->node), .events = POLLIN}};
        /* kvtierd's loop, with stdin beside the node: sleep as long as the node lets
         * it (not at all with transfers in flight: peers' READs over tcp need our
         * progress to be served). Busy, look at stdin once a ms, not once a loop: a
         * serving node spent a tenth of its time in that poll(). */
        int wait_ms = kvt_node_timeout_ms(n->node);
        int pr = 0;

        if (wait_ms > 0 || kvt_now_ns() >= next_look) {
            pr = poll(pfd, 2, wait_ms);
            next_look = kvt_now_ns() + 1000000ull;
        }
        kvt_node_progress(n->node);
        if (pr <= 0 || !(pfd[0].revents & (POLLIN | POLLHUP)))
            continue;
        if (fgets(line, sizeof(line), stdin) == NULL)
            return 0; /* the driver went away */
        {
            unsigned a, b, c, d, e, f, g;
            uint64_t id;
            size_t want;
            int used = 0;
            int got = sscanf(line, "pull %u %u %u %u %u %u %u", &a, &b, &c, &d, &e, &f, &g);

            if (got >= 6)
                cmd_pull(n, a, b, c, d, e, f, got == 7 ? g : 500);
            else if (strncmp(line, "timing", 6) == 0)
                cmd_timing(n);
            else if (strncmp(line, "cpu", 3) == 0)
                printf("ok cpu_seconds=%.4f\n", cpu_s());
            else if (strncmp(line, "pages", 5) == 0)
                cmd_pages(n);
            else if (sscanf(line, "store %u %u %u", &a, &b, &c) == 3)
                cmd_store(n, a, b, c);
            else if (sscanf(line, "load %u %u %u %u", &a, &b, &c, &d) == 4)
                cmd_load(n, a, b, c, d, strstr(line, " pause") != NULL);
            else if (sscanf(line, "rewrite %u %u %u %u", &a, &b, &c, &d) == 4)
                cmd_rewrite(n, a, b, c, d);
            else if (sscanf(line, "garbage %" SCNx64 " %u", &id, &a) == 2)
                cmd_garbage(n, id, a);
            else if (sscanf(line, "wait-live %zu %u%n", &want, &a, &used) == 2)
                cmd_wait_live(n, want, a, line + used);
            else if (strncmp(line, "counts", 6) == 0)
                cmd_counts(n);
            else if (sscanf(line, "step %u", &a) == 1) {
                step_for(n, a);
                printf("ok\n");
            } else if (strncmp(line, "quit", 4) == 0)
                return 0;
            else
                printf("err unknown command\n");
            fflush(stdout);
        }
    }
}

int main(int argc, char **argv)
{
    static const struct option opts[] = {
        {"config", required_argument, NULL, 'c'},
        {"set", required_argument, NULL, 's'},
        {"help", no_argument, NULL, 'h'},
        {"version", no_argument, NULL, 'V'},
        {NULL, 0, NULL, 0},
    };
    char **sets = kvt_calloc((size_t)argc + 1, sizeof(*sets));
    const char *cfg_path = NULL;
    size_t n_sets = 0;
    struct kvt_config cfg;
    struct node n = {0};
    char err[512];
    int c, rc;

    setvbuf(stdout, NULL, _IOLBF, 0);
    if (sets == NULL)
        return 1;
    while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        switch (c) {
        case 'c':
            cfg_path = optarg;
            break;
        case 's':
            sets[n_sets++] = optarg;
            break;
        case 'h':
            usage(stdout);
            kvt_free(sets);
            return 0;
        case 'V':
            printf("kvtier-simnode %s\n", kvt_version_string());
            kvt_free(sets);
            return 0;
        default:
            usage(stderr);
            kvt_free(sets);
            return 2;
        }
    }
    if (optind < argc) {
        fprintf(stderr, "kvtier-simnode: unexpected argument '%s'\n", argv[optind]);
        kvt_free(sets);
        return 2;
    }
    rc = kvt_config_load(&cfg, cfg_path, sets, n_sets, err, sizeof(err));
    kvt_free(sets);
    if (rc != 0) {
        fprintf(stderr, "kvtier-simnode: %s\n", err);
        return KVT_CONFIG_EXIT;
    }
    /* log.level, unless KVT_LOG_LEVEL says otherwise (a debugging run of one test). */
    if (getenv("KVT_LOG_LEVEL") == NULL)
        kvt_log_set_level(cfg.log_level);
    signal(SIGPIPE, SIG_IGN);
    rc = kvt_node_open(&cfg, &n.node);
    kvt_config_free(&cfg);
    if (rc != 0) {
        fprintf(stderr, "kvtier-simnode: node: %s\n", strerror(-rc));
        return 1;
    }
    n.net = kvt_node_tier(n.node, KVT_TIER_NETWORK);
    if (n.net == NULL) {
        fprintf(stderr, "kvtier-simnode: the configuration runs no network tier "
                        "(network.enabled, tiers)\n");
        kvt_node_close(n.node);
        return KVT_CONFIG_EXIT;
    }
    n.peers = kvt_node_peers(n.node);
    n.m = kvt_node_manager(n.node);
    n.primary = kvt_node_primary(n.node);
    n.row = kvt_primary_row_bytes(n.primary);
    n.chunks = kvt_primary_num_chunks(n.primary);
    n.pattern = pattern_create(n.row);
    if (n.pattern == NULL) {
        fprintf(stderr, "kvtier-simnode: out of memory\n");
        kvt_node_close(n.node);
        return 1;
    }
    printf("ready id=%016" PRIx64 " port=%u inc=%016" PRIx64 "\n", kvt_peers_self(n.peers),
           kvt_peers_port(n.peers), kvt_peers_incarnation(n.peers));
    run(&n);
    rc = kvt_node_stop(n.node);
    kvt_node_close(n.node);
    kvt_free(n.pattern);
    return rc == 0 ? 0 : 1;
}

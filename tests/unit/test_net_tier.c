/* SPDX-License-Identifier: Apache-2.0 */
/* The network tier (cluster/net_*.c) between two nodes in one process over the
 * UCX transport on 127.0.0.1: each node is peers + primary + network tier + manager,
 * stepped round-robin by the test thread. A stores chunks of known content, B looks
 * them up through its manager (RETRY, HIT_PENDING, HIT) and loads them. Checked:
 * every byte, the FETCH pipeline (a job split into fetches of keys_per_fetch keys),
 * and the per-peer byte counts in get_stats (label "peer:<16 hex digits>"). */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "test_util.h"

#include "kvt/alloc.h"
#include "kvt/alloc_test.h"
#include "kvt/auth.h"
#include "kvt/clock.h"
#include "kvt/common.h"
#include "kvt/hash.h"
#include "kvt/manager.h"
#include "kvt/net_tier.h"
#include "kvt/net_tier_test.h"
#include "kvt/peers.h"
#include "kvt/placement.h"
#include "kvt/primary.h"
#include "kvt/stats.h"

#define ROW    16384
#define CHUNKS 128
#define NKEYS  40
#define FLOODK 256 /* keys per message, as the tier's own */

static const uint8_t secret[] = "kvtier-test-secret-0123456789abcdef";

struct tn {
    uint64_t id;
    struct kvt_peers *p;
    struct kvt_primary *pr;
    struct kvt_tier *net;
    struct kvt_manager *m;
    unsigned seq;
};

/* base: timeouts and lease of the network tier (zero: its defaults); chunks: the
 * primary's; credits: the transport's receive credits per link (0: its default). */
static void tn_start_opts(struct tn *t, uint64_t id, uint16_t seed_port,
                          const struct kvt_net_tier_config *base, size_t chunks, unsigned credits)
{
    char seed[32];
    const char *seeds[1] = {seed};
    struct kvt_peers_config pc = {0};
    struct kvt_primary_config prc = {0};
    struct kvt_net_tier_config nc = base != NULL ? *base : (struct kvt_net_tier_config){0};

    memset(t, 0, sizeof(*t));
    t->id = id;
    snprintf(seed, sizeof(seed), "127.0.0.1:%u", seed_port);
    pc.node_id = id;
    kvt_auth_namespace("test-ns", pc.ns);
    pc.secret = secret;
    pc.secret_len = strlen((const char *)secret);
    pc.listen_addr = "127.0.0.1";
    pc.seeds = seeds;
    pc.n_seeds = seed_port != 0;
    pc.heartbeat_ms = 100;
    pc.heartbeat_misses = 20;
    pc.transport.backend = "ucx";
    pc.transport.recv_credits = credits;
    assert_int_equal(kvt_peers_create(&pc, &t->p), 0);
    prc.num_chunks = chunks;
    prc.row_bytes = ROW;
    prc.policy = "lru";
    prc.checksum_on_complete = true;
    assert_int_equal(kvt_primary_create(&prc, NULL, &t->pr), 0);
    nc.peers = t->p;
    nc.primary = t->pr;
    nc.keys_per_fetch = 4; /* NKEYS keys: 10 fetches, at most 2 out at a time */
    nc.fetches_per_peer = 2;
    nc.max_ops_per_batch = 3;
    assert_int_equal(kvt_net_tier_create(&nc, &t->net), 0);
    assert_int_equal(kvt_manager_create(t->pr, &t->net, 1, &t->m), 0);
}

static void tn_start_cfg(struct tn *t, uint64_t id, uint16_t seed_port,
                         const struct kvt_net_tier_config *base)
{
    tn_start_opts(t, id, seed_port, base, CHUNKS, 0);
}

static void tn_start(struct tn *t, uint64_t id, uint16_t seed_port)
{
    tn_start_cfg(t, id, seed_port, NULL);
}

static void tn_stop(struct tn *t)
{
    kvt_manager_shutdown(t->m);
    kvt_manager_destroy(t->m);
    kvt_peers_destroy(t->p);
}

static struct tn *g_a, *g_b, *g_c; /* g_c: a third node, when a test has one */

static void spin(void)
{
    kvt_manager_on_schedule_end(g_a->m, NULL);
    kvt_manager_on_schedule_end(g_b->m, NULL);
    if (g_c != NULL)
        kvt_manager_on_schedule_end(g_c->m, NULL);
    usleep(100);
}

#define WAIT_FOR(ms, cond)                                                                         \
    ({                                                                                             \
        uint64_t end_ = kvt_now_ns() + (uint64_t)(ms)*1000000ull;                                  \
        bool ok_;                                                                                  \
        while (!(ok_ = (cond)) && kvt_now_ns() < end_)                                             \
            spin();                                                                                \
        ok_;                                                                                       \
    })

static size_t live(struct tn *t)
{
    uint64_t ids[8];

    return kvt_peers_live(t->p, ids, 8);
}

/* A (0xA, with nca) and B (0xB, with ncb, seeded with A), linked; spin steps them.
 * A NULL config: the defaults. */
static void linked_pair(struct tn *a, struct tn *b, const struct kvt_net_tier_config *nca,
                        const struct kvt_net_tier_config *ncb)
{
    tn_start_cfg(a, 0xA, 0, nca);
    tn_start_cfg(b, 0xB, kvt_peers_port(a->p), ncb);
    g_a = a;
    g_b = b;
    assert_true(WAIT_FOR(10000, live(a) == 2 && live(b) == 2));
}

static void key_of(uint32_t i, struct kvt_key *k)
{
    uint8_t b[8] = {'n', 't', 0, 0};

    memcpy(b + 4, &i, 4);
    kvt_key_set(k, b, sizeof(b));
}

static void fill(uint8_t *row, const struct kvt_key *k)
{
    uint64_t x = kvt_hash64(k->bytes, k->len) | 1;

    for (size_t off = 0; off < ROW; off += 8) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        memcpy(row + off, &x, 8);
    }
}

static struct kvt_req_ctx *new_req(struct tn *t)
{
    char id[32];
    struct kvt_req_ctx *ctx;
    enum kvt_offload_policy pol;

    snprintf(id, sizeof(id), "r-%" PRIx64 "-%u", t->id, ++t->seq);
    assert_int_equal(kvt_req_ctx_create(id, NULL, &ctx), 0);
    assert_int_equal(kvt_manager_on_new_request(t->m, ctx, &pol), 0);
    return ctx;
}

static void end_req(struct tn *t, struct kvt_req_ctx *ctx)
{
    kvt_manager_on_request_finished(t->m, ctx);
    kvt_req_ctx_unref(ctx);
}

static double stat_of(struct kvt_stats *st, const char *name, uint64_t peer)
{
    char label[KVT_STAT_LABEL_MAX];

    snprintf(label, sizeof(label), "peer:%016" PRIx64, peer);
    return kvt_stats_value(st, name, label);
}

/* Observations of histogram name in st, over every label. */
static uint64_t hist_count(const struct kvt_stats *st, const char *name)
{
    uint64_t n = 0;

    for (size_t i = 0; i < st->n; i++)
        if (strcmp(st->s[i].name, name) == 0) {
            assert_int_equal(st->s[i].kind, KVT_METRIC_HISTOGRAM);
            n += st->s[i].count;
        }
    return n;
}

static void test_pull_pipelined_and_per_peer_stats(void **state)
{
    struct tn a, b;
    struct kvt_key keys[NKEYS];
    struct kvt_store_output out;
    struct kvt_req_ctx *ctx;
    struct kvt_net_tier_counts ca, cb;
    struct kvt_stats st;
    int64_t slots[NKEYS];
    bool got_retry = false, got_pending = false;
    size_t left = NKEYS;
    int res[NKEYS];

    (void)state;
    linked_pair(&a, &b, NULL, NULL);

    /* A stores NKEYS chunks; the cascade publishes them to their homes. */
    for (uint32_t i = 0; i < NKEYS; i++)
        key_of(i, &keys[i]);
    kvt_store_output_init(&out);
    ctx = new_req(&a);
    assert_int_equal(kvt_manager_prepare_store(a.m, keys, NKEYS, ctx, &out), 0);
    assert_int_equal(out.n_store, NKEYS);
    for (size_t i = 0; i < out.n_store; i++)
        fill(a.net->primary_base + (size_t)out.chunk_ids[i] * ROW, &out.keys_to_store[i]);
    kvt_manager_complete_store(a.m, out.keys_to_store, out.n_store, ctx, true);
    end_req(&a, ctx);
    kvt_store_output_cleanup(&out);
    for (int i = 0; i < 100; i++)
        spin();

    /* B pulls them through its manager. */
    ctx = new_req(&b);
    for (size_t i = 0; i < NKEYS; i++)
        res[i] = -1;
    assert_true(WAIT_FOR(20000, ({
                             for (size_t i = 0; i < NKEYS; i++) {
                                 enum kvt_lookup_result r;

                                 if (res[i] >= 0)
                                     continue;
                                 r = kvt_manager_lookup(b.m, &keys[i], ctx);
                                 got_retry |= r == KVT_RETRY;
                                 got_pending |= r == KVT_HIT_PENDING;
                                 if (r == KVT_HIT || r == KVT_MISS) {
                                     res[i] = (int)r;
                                     left--;
                                 }
                             }
                             left == 0;
                         })));
    assert_true(got_retry);
    assert_true(got_pending);
    for (size_t i = 0; i < NKEYS; i++)
        assert_int_equal(res[i], KVT_HIT);
    assert_int_equal(kvt_manager_prepare_load(b.m, keys, NKEYS, ctx, slots), 0);
    for (size_t i = 0; i < NKEYS; i++) {
        uint8_t want[ROW];

        fill(want, &keys[i]);
        assert_memory_equal(b.net->primary_base + (size_t)slots[i] * ROW, want, ROW);
    }
    kvt_manager_complete_load(b.m, keys, NKEYS, ctx);
    end_req(&b, ctx);
    /* A's leases end with B's RELEASEs. */
    assert_true(WAIT_FOR(5000, (kvt_net_tier_counts(a.net, &ca), ca.active_leases == 0)));

    /* One job of NKEYS keys became NKEYS / keys_per_fetch fetches, all granted. */
    kvt_net_tier_counts(b.net, &cb);
    assert_int_equal(cb.fetches, NKEYS / 4);
    assert_int_equal(cb.grants, NKEYS / 4);
    assert_int_equal(cb.pulled_chunks, NKEYS);
    assert_int_equal(cb.pulled_bytes, (uint64_t)NKEYS * ROW);
    assert_int_equal(cb.checksum_failures, 0);
    assert_int_equal(cb.failed_fetches, 0);
    assert_int_equal(ca.served_fetches, NKEYS / 4);
    assert_int_equal(ca.served_bytes, (uint64_t)NKEYS * ROW);

    /* Per-peer bytes in get_stats: B pulled from A, A served B, nothing the other way. */
    kvt_stats_init(&st);
    assert_int_equal(kvt_manager_get_stats(b.m, &st), 0);
    assert_true(stat_of(&st, KVT_M_NET_PEER_PULLED_BYTES, 0xA) == (double)NKEYS * ROW);
    assert_true(stat_of(&st, KVT_M_NET_PEER_SERVED_BYTES, 0xA) == 0);
    /* Where the pull's time went, one observation per fetch, LOCATE, job. */
    assert_true(hist_count(&st, KVT_M_NET_LOOKUP_QUEUE_SECONDS) >= 1);
    assert_true(hist_count(&st, KVT_M_NET_LOCATE_SECONDS) >= 1);
    assert_int_equal(hist_count(&st, KVT_M_NET_FETCH_QUEUE_SECONDS), NKEYS / 4);
    assert_int_equal(hist_count(&st, KVT_M_NET_GRANT_WAIT_SECONDS), NKEYS / 4);
    assert_int_equal(hist_count(&st, KVT_M_NET_READ_SECONDS), NKEYS / 4);
    assert_int_equal(hist_count(&st, KVT_M_NET_LOAD_JOB_SECONDS), 1);
    assert_int_equal(hist_count(&st, KVT_M_NET_SERVE_WAIT_SECONDS), 0);
    kvt_stats_clear(&st);
    assert_int_equal(kvt_manager_get_stats(a.m, &st), 0);
    assert_true(stat_of(&st, KVT_M_NET_PEER_SERVED_BYTES, 0xB) == (double)NKEYS * ROW);
    assert_true(stat_of(&st, KVT_M_NET_PEER_PULLED_BYTES, 0xB) == 0);
    assert_int_equal(hist_count(&st, KVT_M_NET_SERVE_WAIT_SECONDS), NKEYS / 4);
    assert_int_equal(hist_count(&st, KVT_M_NET_READ_SECONDS), 0);
    /* Counters and histograms are deltas: a second report adds nothing. */
    kvt_stats_clear(&st);
    assert_int_equal(kvt_manager_get_stats(a.m, &st), 0);
    assert_true(stat_of(&st, KVT_M_NET_PEER_SERVED_BYTES, 0xB) == 0);
    assert_int_equal(hist_count(&st, KVT_M_NET_SERVE_WAIT_SECONDS), 0);
    kvt_stats_cleanup(&st);

    tn_stop(&b);
    tn_stop(&a);
}

/* ---- helpers of the tests below ------------------------------------------------ */

static void a_store(struct tn *a, uint32_t first, size_t n, int64_t *slots_p);
static void a_store_keys(struct tn *a, const struct kvt_key *keys, size_t n, int64_t *slots_p);
static void hold_grants(struct tn *a, struct tn *b, struct kvt_req_ctx *ctx, uint32_t first,
                        size_t n, uint64_t want_leases);
static bool settled(struct tn *t);

/* A stores keys [first, first + n) with fill()'s bytes through its manager; their
 * slots (in key order) go to slots_p when it is not NULL. */
static void a_store(struct tn *a, uint32_t first, size_t n, int64_t *slots_p)
{
    struct kvt_key keys[64];

    assert_true(n <= KVT_ARRAY_SIZE(keys));
    for (size_t i = 0; i < n; i++)
        key_of(first + (uint32_t)i, &keys[i]);
    a_store_keys(a, keys, n, slots_p);
}

/* A stores keys[0..n) as a_store does. */
static void a_store_keys(struct tn *a, const struct kvt_key *keys, size_t n, int64_t *slots_p)
{
    struct kvt_store_output out;
    struct kvt_req_ctx *ctx = new_req(a);

    kvt_store_output_init(&out);
    assert_int_equal(kvt_manager_prepare_store(a->m, keys, n, ctx, &out), 0);
    assert_int_equal(out.n_store, n);
    for (size_t i = 0; i < n; i++) {
        assert_true(kvt_key_eq(&out.keys_to_store[i], &keys[i]));
        fill(a->net->primary_base + (size_t)out.chunk_ids[i] * ROW, &keys[i]);
        if (slots_p != NULL)
            slots_p[i] = out.chunk_ids[i];
    }
    assert_int_equal(kvt_manager_complete_store(a->m, out.keys_to_store, n, ctx, true), 0);
    end_req(a, ctx);
    kvt_store_output_cleanup(&out);
}

/* B's network tier finds a holder for each key (its own lookups: the manager starts
 * no promotion), then B's manager promotes them all as one job and sends its
 * FETCHes; A alone is stepped until it has granted want_leases of them, so the
 * leases stay active until the test steps B again. */
static void hold_grants(struct tn *a, struct tn *b, struct kvt_req_ctx *ctx, uint32_t first,
                        size_t n, uint64_t want_leases)
{
    struct kvt_net_tier_counts c;
    struct kvt_key keys[64];

    assert_true(n <= KVT_ARRAY_SIZE(keys));
    for (size_t i = 0; i < n; i++)
        key_of(first + (uint32_t)i, &keys[i]);
    assert_true(WAIT_FOR(10000, ({
                             bool all = true;

                             for (size_t i = 0; i < n; i++)
                                 all &= kvt_tier_lookup(b->net, &keys[i], ctx) == KVT_HIT;
                             all;
                         })));
    for (size_t i = 0; i < n; i++)
        assert_int_equal(kvt_manager_lookup(b->m, &keys[i], ctx), KVT_HIT_PENDING);
    kvt_manager_on_schedule_end(b->m, NULL); /* the promotion's FETCHes leave */
    for (int i = 0; i < 10000; i++) {
        kvt_manager_on_schedule_end(a->m, NULL);
        kvt_net_tier_counts(a->net, &c);
        if (c.active_leases >= want_leases)
            break;
        usleep(100);
    }
    kvt_net_tier_counts(a->net, &c);
    assert_int_equal(c.active_leases, want_leases);
}

/* Nothing in flight on t, and no row of its primary pinned or write-pending. */
static bool settled(struct tn *t)
{
    struct kvt_net_tier_counts c;

    kvt_net_tier_counts(t->net, &c);
    return kvt_manager_num_jobs(t->m) == 0 && !kvt_manager_has_pending_work(t->m) &&
           c.active_leases == 0 && kvt_primary_num_write_pending(t->pr) == 0 &&
           kvt_primary_num_entries(t->pr) == kvt_primary_num_evictable(t->pr);
}

/* The grant check: a peer may read the rows of its active leases, nothing else, and
 * not after RELEASE or past the lease's deadline. */
static void test_may_read_answers_from_active_leases(void **state)
{
    enum { K = 8 }; /* two fetches of 4 keys, both out at once */
    struct kvt_net_tier_config nc = {.lease_ms = 1000};
    struct kvt_net_tier_counts ca;
    struct kvt_req_ctx *ctx;
    struct tn a, b;
    int64_t slot[2 * K];
    bool pair_in = false, pair_edge = false;

    (void)state;
    linked_pair(&a, &b, &nc, &nc);
    a_store(&a, 100, 2 * K, slot);
    for (int i = 0; i < 100; i++)
        spin();

    /* Keys 100..107 granted to B and not read yet: their rows, only to B. */
    ctx = new_req(&b);
    hold_grants(&a, &b, ctx, 100, K, 2);
    for (size_t i = 0; i < 2 * K; i++) {
        uint64_t off = (uint64_t)slot[i] * ROW;

        assert_int_equal(kvt_net_tier_may_read(a.net, 0xB, off, ROW), i < K);
        assert_int_equal(kvt_net_tier_may_read(a.net, 0xB, off + ROW / 4, ROW / 2), i < K);
        assert_false(kvt_net_tier_may_read(a.net, 0xC, off, ROW)); /* not its lease */
        assert_false(kvt_net_tier_may_read(a.net, 0xA, off, ROW));
        assert_false(kvt_net_tier_may_read(a.net, 0xB, off, 0));
    }
    /* A range over two rows needs both granted. */
    for (size_t i = 0; i < 2 * K; i++) {
        for (size_t j = 0; j < 2 * K; j++) {
            uint64_t off = (uint64_t)slot[i] * ROW + ROW / 2;

            if (slot[j] != slot[i] + 1 || i >= K)
                continue;
            assert_int_equal(kvt_net_tier_may_read(a.net, 0xB, off, ROW), j < K);
            pair_in |= j < K;
            pair_edge |= j >= K;
        }
    }
    assert_true(pair_in && pair_edge);
    assert_false(kvt_net_tier_may_read(a.net, 0xB, (uint64_t)CHUNKS * ROW, ROW));
    assert_false(kvt_net_tier_may_read(a.net, 0xB, UINT64_MAX - ROW / 2, ROW));

    /* B reads and releases: nothing may be read any more. */
    assert_true(WAIT_FOR(5000, settled(&a) && settled(&b)));
    for (size_t i = 0; i < K; i++)
        assert_false(kvt_net_tier_may_read(a.net, 0xB, (uint64_t)slot[i] * ROW, ROW));

    /* Keys 108..115 granted, then the leases run out while A is not stepped: the
     * leases are still there (nothing reaped them) but their deadline has passed. */
    hold_grants(&a, &b, ctx, 100 + K, K, 2);
    assert_true(kvt_net_tier_may_read(a.net, 0xB, (uint64_t)slot[K] * ROW, ROW));
    usleep((nc.lease_ms + 100) * 1000);
    kvt_net_tier_counts(a.net, &ca);
    assert_int_equal(ca.active_leases, 2);
    for (size_t i = 0; i < 2 * K; i++)
        assert_false(kvt_net_tier_may_read(a.net, 0xB, (uint64_t)slot[i] * ROW, ROW));
    end_req(&b, ctx);
    assert_true(WAIT_FOR(10000, settled(&a) && settled(&b)));

    tn_stop(&b);
    tn_stop(&a);
}

/* A and B linked (their configs), A holding keys first..first+7, B with two
 * fetches of them granted and not read (hold_grants): two leases on A. */
static struct kvt_req_ctx *two_leases(struct tn *a, struct tn *b,
                                      const struct kvt_net_tier_config *nca,
                                      const struct kvt_net_tier_config *ncb, uint32_t first)
{
    struct kvt_req_ctx *ctx;

    linked_pair(a, b, nca, ncb);
    a_store(a, first, 8, NULL);
    for (int i = 0; i < 100; i++)
        spin();
    ctx = new_req(b);
    hold_grants(a, b, ctx, first, 8, 2);
    return ctx;
}

/* network.busy_poll_us: with transfers in flight a loop polls, for at most that
 * long after the transport's last event. A (busy_poll_us 2000) holds two leases
 * and B has two fetches out, neither stepped: A's network tier soon lets its loop
 * sleep on the transport's events (kvt_tier_arm 0) with its leases still held, while
 * B's (busy_poll_us 0: as long as anything is in flight) never does. */
static void test_busy_poll_then_sleep_in_flight(void **state)
{
    struct kvt_net_tier_config nca = {.lease_ms = 10000, .busy_poll_us = 2000};
    struct kvt_net_tier_config ncb = {.lease_ms = 10000};
    struct kvt_net_tier_counts ca, cb;
    struct kvt_req_ctx *ctx;
    struct tn a, b;
    bool a_armed = false, b_armed = false;
    uint64_t end;

    (void)state;
    ctx = two_leases(&a, &b, &nca, &ncb, 400);
    end = kvt_now_ns() + 500000000ull;
    while (kvt_now_ns() < end && !a_armed) {
        kvt_net_tier_poll(a.net); /* not B's: its fetches stay out */
        a_armed = kvt_tier_arm(a.net) == 0;
        b_armed |= kvt_tier_arm(b.net) == 0;
        usleep(200);
    }
    kvt_net_tier_counts(a.net, &ca);
    kvt_net_tier_counts(b.net, &cb);
    assert_true(a_armed);
    assert_int_equal(ca.active_leases, 2);
    assert_false(b_armed);
    assert_true(cb.fetches >= 2);
    assert_int_equal(cb.pulled_chunks, 0);
    end_req(&b, ctx);
    assert_true(WAIT_FOR(10000, settled(&a) && settled(&b)));
    tn_stop(&b);
    tn_stop(&a);
}

/* The busy poll is counted (idle_polls, idle_poll_ns: kvtier-bench pull's CPU per
 * chunk less polling): A holds two leases, and its polls that find nothing count,
 * with the time between them, but not a gap of a ms (the loop away, not polling);
 * once nothing is in flight its polls count nothing. */
static void test_idle_poll_counted(void **state)
{
    struct kvt_net_tier_config nc = {.lease_ms = 10000};
    struct kvt_net_tier_counts c0, c1, c2, c3;
    struct kvt_req_ctx *ctx;
    struct tn a, b;

    (void)state;
    ctx = two_leases(&a, &b, &nc, &nc, 500);
    kvt_net_tier_counts(a.net, &c0);
    assert_int_equal(c0.active_leases, 2);
    for (int i = 0; i < 200; i++)
        kvt_net_tier_poll(a.net);
    kvt_net_tier_counts(a.net, &c1);
    assert_true(c1.idle_polls >= c0.idle_polls + 100);
    assert_true(c1.idle_poll_ns > c0.idle_poll_ns);
    usleep(2000);
    kvt_net_tier_poll(a.net);
    kvt_net_tier_counts(a.net, &c2);
    assert_true(c2.idle_poll_ns - c1.idle_poll_ns < 50000);
    end_req(&b, ctx);
    assert_true(WAIT_FOR(10000, settled(&a) && settled(&b)));
    kvt_net_tier_counts(a.net, &c2);
    assert_int_equal(c2.active_leases, 0);
    for (int i = 0; i < 200; i++)
        kvt_net_tier_poll(a.net);
    kvt_net_tier_counts(a.net, &c3);
    assert_int_equal(c3.idle_polls, c2.idle_polls);
    assert_int_equal(c3.idle_poll_ns, c2.idle_poll_ns);
    tn_stop(&b);
    tn_stop(&a);
}

/* A holder changes rows it granted before the puller's READs of them end: key 1
 * rewritten whole (its fence word moved on), key 2 left mid-write (odd) while B
 * reads. B refuses exactly those two - under fences by their words, counted by
 * reason, under checksums by their hash - loads the others byte for byte, and
 * answers MISS for the two: never wrong bytes. old_holder: A's GRANTs carry no fence
 * words (wire 1.0), so B, in fence mode, checks them by checksum. */
static void rewrite_during_read(enum kvt_net_verify mode, bool old_holder)
{
    enum { K = 8 }; /* two fetches of 4 keys, both granted before B reads */
    struct kvt_net_tier_config nc = {.verify = mode};
    struct kvt_net_tier_counts cb;
    struct kvt_primary_entry_info info;
    struct kvt_req_ctx *ctx;
    struct kvt_key keys[K];
    struct tn a, b;
    int64_t slot[K];
    int res[K];
    uint8_t *row;

    linked_pair(&a, &b, &nc, &nc);
    if (old_holder)
        kvt__net_tier_test_omit_fences(a.net);
    a_store(&a, 300, K, slot);
    for (int i = 0; i < 100; i++)
        spin();
    for (size_t i = 0; i < K; i++) {
        key_of(300 + (uint32_t)i, &keys[i]);
        assert_int_equal(kvt_primary_entry_info(a.pr, &keys[i], &info), 0);
        assert_true(info.fence != 0 && !(info.fence & 1));
    }

    ctx = new_req(&b);
    hold_grants(&a, &b, ctx, 300, K, 2);
    assert_int_equal(kvt_primary_rewrite_begin(a.pr, &keys[1], &row), 0);
    row[100] ^= 0xff;
    assert_int_equal(kvt_primary_rewrite_end(a.pr, &keys[1]), 0);
    assert_int_equal(kvt_primary_rewrite_begin(a.pr, &keys[2], &row), 0);
    row[200] ^= 0xff; /* and still being written while B reads */

    /* B reads, validates, releases; then looks every key up again. */
    assert_true(WAIT_FOR(10000, settled(&b) && settled(&a)));
    for (size_t i = 0; i < K; i++)
        res[i] = -1;
    assert_true(WAIT_FOR(10000, ({
                             bool all = true;

                             for (size_t i = 0; i < K; i++) {
                                 if (res[i] != KVT_HIT && res[i] != KVT_MISS)
                                     res[i] = (int)kvt_manager_lookup(b.m, &keys[i], ctx);
                                 all &= res[i] == KVT_HIT || res[i] == KVT_MISS;
                             }
                             all;
                         })));
    for (size_t i = 0; i < K; i++) {
        uint8_t want[ROW];
        int64_t s;

        if (i == 1 || i == 2) {
            assert_int_equal(res[i], KVT_MISS);
            continue;
        }
        assert_int_equal(res[i], KVT_HIT);
        assert_int_equal(kvt_manager_prepare_load(b.m, &keys[i], 1, ctx, &s), 0);
        fill(want, &keys[i]);
        assert_memory_equal(b.net->primary_base + (size_t)s * ROW, want, ROW);
        assert_int_equal(kvt_manager_complete_load(b.m, &keys[i], 1, ctx), 0);
    }
    end_req(&b, ctx);
    assert_int_equal(kvt_primary_rewrite_end(a.pr, &keys[2]), 0);

    kvt_net_tier_counts(b.net, &cb);
    assert_int_equal(cb.grants, 2);
    assert_int_equal(cb.pulled_chunks, K - 2);
    if (mode == KVT_NET_VERIFY_FENCE && !old_holder) {
        assert_int_equal(cb.fence_failures, 2);
        assert_int_equal(cb.fence_fail[KVT_NET_FENCE_CHANGED], 1);
        assert_int_equal(cb.fence_fail[KVT_NET_FENCE_WRITING], 1);
        assert_int_equal(cb.fence_fail[KVT_NET_FENCE_UNREAD], 0);
        assert_int_equal(cb.checksum_failures, 0);
    } else {
        assert_int_equal(cb.checksum_failures, 2);
        assert_int_equal(cb.fence_failures, 0);
    }
    assert_true(WAIT_FOR(10000, settled(&a) && settled(&b)));
    tn_stop(&b);
    tn_stop(&a);
}

static void test_fence_refuses_rows_rewritten_during_read(void **state)
{
    (void)state;
    rewrite_during_read(KVT_NET_VERIFY_FENCE, false);
}

static void test_fence_mode_checks_old_holders_by_checksum(void **state)
{
    (void)state;
    rewrite_during_read(KVT_NET_VERIFY_FENCE, true);
}

static void test_checksum_refuses_rows_rewritten_during_read(void **state)
{
    (void)state;
    rewrite_during_read(KVT_NET_VERIFY_CHECKSUM, false);
}

/* Fence words are readable only where their rows are: a word of a granted row, by
 * that peer, while the lease lasts. */
static void test_may_read_fence_words_of_grants_only(void **state)
{
    enum { K = 4 };
    struct kvt_req_ctx *ctx;
    struct tn a, b;
    int64_t slot[2 * K];

    (void)state;
    linked_pair(&a, &b, NULL, NULL);
    a_store(&a, 400, 2 * K, slot);
    for (int i = 0; i < 100; i++)
        spin();
    ctx = new_req(&b);
    hold_grants(&a, &b, ctx, 400, K, 1);
    for (size_t i = 0; i < 2 * K; i++) {
        uint64_t off = (uint64_t)slot[i] * 4;
        assert_int_equal(kvt__net_tier_test_may_read_fence(a.net, 0xB, off, 4), i < K);
        assert_false(kvt__net_tier_test_may_read_fence(a.net, 0xC, off, 4));
        assert_false(kvt__net_tier_test_may_read_fence(a.net, 0xB, off, 0));
    }
    assert_false(kvt__net_tier_test_may_read_fence(a.net, 0xB, (uint64_t)CHUNKS * 4, 4));
    assert_false(kvt__net_tier_test_may_read_fence(a.net, 0xB, UINT64_MAX - 1, 4));
    end_req(&b, ctx);
    assert_true(WAIT_FOR(10000, settled(&a) && settled(&b)));
    for (size_t i = 0; i < 2 * K; i++)
        assert_false(kvt__net_tier_test_may_read_fence(a.net, 0xB, (uint64_t)slot[i] * 4, 4));
    tn_stop(&b);
    tn_stop(&a);
}

struct read_done {
    bool done;
    int status;
};

static void on_read(void *arg, int status)
{
    struct read_done *d = arg;

    d->done = true;
    d->status = status;
}

/* An authenticated peer that holds A's handle (as if from an earlier GRANT) READs
 * rows it was never granted: refused, no byte lands, counted on A as not granted;
 * then, granted, the same rows read. */
static void test_authenticated_peer_reads_only_its_grants(void **state)
{
    enum { K = 4 };
    struct kvt_net_tier_config nc = {.lease_ms = 5000};
    struct kvt_peers_counts pa;
    struct tn a, b;
    int64_t slot[K];
    const void *handle;
    size_t handle_len;
    struct kvt_transport *tpb;
    struct kvt_tp_ep *ep;
    struct kvt_tp_rkey *rk = NULL;
    struct kvt_tp_mr *local = NULL;
    uint8_t *buf = aligned_alloc(4096, ROW);
    struct read_done d = {0};

    (void)state;
    assert_non_null(buf);
    linked_pair(&a, &b, &nc, &nc);
    a_store(&a, 200, K, slot);
    assert_int_equal(kvt__net_tier_test_handle(a.net, &handle, &handle_len), 0);

    tpb = kvt_peers_transport(b.p);
    ep = kvt_peers_link(b.p, 0xA);
    assert_non_null(ep);
    assert_int_equal(kvt_tp_unpack(ep, handle, handle_len, &rk), 0);
    assert_int_equal(kvt_tp_reg_local(tpb, buf, ROW, &local), 0);
    memset(buf, 0x5a, ROW);
    {
        struct kvt_read_op op = {.remote_off = (uint64_t)slot[0] * ROW, .local_off = 0, .len = ROW};

        assert_int_equal(kvt_tp_read(ep, rk, local, &op, 1, on_read, &d), -EINPROGRESS);
    }
    assert_true(WAIT_FOR(10000, d.done));
    assert_int_equal(d.status, -EACCES);
    for (size_t i = 0; i < ROW; i++)
        assert_int_equal(buf[i], 0x5a);
    kvt_peers_counts(a.p, &pa);
    assert_int_equal(pa.tp.refused[KVT_TP_READ_GRANT], 1);
    kvt_tp_rkey_destroy(tpb, rk);
    kvt_tp_dereg(local, tpb);
    free(buf);

    /* The refusal closed that link; the peers link again and B pulls the same rows
     * through the protocol: granted, read, verified. */
    {
        struct kvt_req_ctx *ctx = new_req(&b);
        struct kvt_key keys[K];

        for (size_t i = 0; i < K; i++)
            key_of(200 + (uint32_t)i, &keys[i]);
        assert_true(WAIT_FOR(10000, live(&a) == 2 && live(&b) == 2));
        assert_true(WAIT_FOR(20000, ({
                                 bool all = true;

                                 for (size_t i = 0; i < K; i++)
                                     all &= kvt_manager_lookup(b.m, &keys[i], ctx) == KVT_HIT;
                                 all;
                             })));
        end_req(&b, ctx);
    }
    kvt_peers_counts(a.p, &pa);
    assert_int_equal(pa.tp.refused[KVT_TP_READ_GRANT], 1);
    assert_true(WAIT_FOR(10000, settled(&a) && settled(&b)));
    tn_stop(&b);
    tn_stop(&a);
}

/* Every allocation index of a pull, in turn, and all that follow it, fail: B looks
 * keys up and pulls them while A serves, both stepped as usual; memory comes back
 * and both settle. Checked: no crash, no leak (ASan), every job the managers
 * registered reported once (a second report, or one of a refused job, trips the
 * manager's assertion; num_jobs 0 means none is missing), no lease left, no row
 * pinned or write-pending, and every key B answers HIT for holds A's bytes. */
static void test_pull_survives_allocation_failures(void **state)
{
    enum { K = 4 };
    struct kvt_net_tier_config nc = {
        .lease_ms = 500, .fetch_timeout_ms = 300, .locate_timeout_ms = 300, .park_timeout_ms = 100};
    struct tn a, b;
    long n;
    unsigned hits = 0, misses = 0, clean = 0;

    (void)state;
    linked_pair(&a, &b, &nc, &nc);
    for (n = 0; n < 100000; n++) {
        uint32_t first = 1000 + (uint32_t)n * K;
        struct kvt_key keys[K];
        int res[K];
        struct kvt_req_ctx *ctx;
        void *probe;
        bool reached;

        for (size_t i = 0; i < K; i++) {
            key_of(first + (uint32_t)i, &keys[i]);
            res[i] = -1;
        }
        assert_true(WAIT_FOR(10000, live(&a) == 2 && live(&b) == 2));
        a_store(&a, first, K, NULL);
        for (int i = 0; i < 20; i++)
            spin();
        ctx = new_req(&b);

        kvt_alloc_fail_after(n);
        for (int s = 0; s < 60; s++) {
            for (size_t i = 0; i < K; i++) {
                if (res[i] != KVT_HIT && res[i] != KVT_MISS)
                    res[i] = (int)kvt_manager_lookup(b.m, &keys[i], ctx);
            }
            spin();
        }
        probe = kvt_malloc(1);
        reached = probe == NULL;
        kvt_free(probe);
        kvt_alloc_fail_after(-1);

        assert_true(WAIT_FOR(10000, ({
                                 bool all = true;

                                 for (size_t i = 0; i < K; i++) {
                                     if (res[i] != KVT_HIT && res[i] != KVT_MISS)
                                         res[i] = (int)kvt_manager_lookup(b.m, &keys[i], ctx);
                                     all &= res[i] == KVT_HIT || res[i] == KVT_MISS;
                                 }
                                 all;
                             })));
        for (size_t i = 0; i < K; i++) {
            uint8_t want[ROW];
            int64_t s;

            if (res[i] != KVT_HIT) {
                misses++;
                continue;
            }
            hits++;
            assert_int_equal(kvt_manager_prepare_load(b.m, &keys[i], 1, ctx, &s), 0);
            fill(want, &keys[i]);
            assert_memory_equal(b.net->primary_base + (size_t)s * ROW, want, ROW);
            assert_int_equal(kvt_manager_complete_load(b.m, &keys[i], 1, ctx), 0);
        }
        end_req(&b, ctx);
        assert_true(WAIT_FOR(10000, settled(&a) && settled(&b)));
        /* A pull that needed fewer allocations than n: every index was failed. Its
         * count varies a little (heartbeats, the lookup worker), hence a few more. */
        clean = reached ? 0 : clean + 1;
        if (clean == 5)
            break;
    }
    print_message("net tier: allocation indexes 0-%ld failed in turn; %u keys loaded, %u missed\n",
                  n - (long)clean, hits, misses);
    assert_true(n > 0 && n < 100000);
    assert_true(misses > 0);          /* the failures were felt */
    assert_true(hits >= (unsigned)K); /* the last pull, with memory, loaded every key */

    tn_stop(&b);
    tn_stop(&a);
}

/* The node's reset (kvt_manager_reset_all on A) withdraws every record of A's chunks
 * at once: the homes' directories drop them and B's new lookups MISS where they were
 * HIT. Publications of keys removed before a flush are not sent. */
static void test_reset_unpublishes_everything(void **state)
{
    struct tn a, b;
    struct kvt_net_tier_counts ca, cb;
    struct kvt_key keys[24];
    struct kvt_req_ctx *ctx;

    (void)state;
    linked_pair(&a, &b, NULL, NULL);
    for (uint32_t i = 0; i < 24; i++)
        key_of(300 + i, &keys[i]);
    a_store(&a, 300, 24, NULL);
    assert_true(WAIT_FOR(5000, ({
                             kvt_net_tier_counts(a.net, &ca);
                             kvt_net_tier_counts(b.net, &cb);
                             ca.directory_records + cb.directory_records == 24;
                         })));
    assert_int_equal(ca.published_keys, 24);
    assert_true(ca.directory_records > 0 && cb.directory_records > 0); /* both are homes */
    ctx = new_req(&b);
    assert_true(WAIT_FOR(10000, ({
                             bool all = true;

                             for (size_t i = 0; i < 24; i++)
                                 all &= kvt_tier_lookup(b.net, &keys[i], ctx) == KVT_HIT;
                             all;
                         })));
    end_req(&b, ctx);

    assert_int_equal(kvt_manager_reset_all(a.m), 0);
    kvt_net_tier_counts(a.net, &ca);
    assert_int_equal(ca.published_keys, 0);
    /* A's own records of itself went at once (no step in between); B's when the
     * UNPUBLISH arrives. */
    assert_int_equal(ca.directory_records, 0);
    assert_true(WAIT_FOR(5000, ({
                             kvt_net_tier_counts(a.net, &ca);
                             kvt_net_tier_counts(b.net, &cb);
                             ca.directory_records + cb.directory_records == 0;
                         })));
    ctx = new_req(&b);
    {
        size_t missed = 0, answered = 0;
        int res[24];

        for (size_t i = 0; i < 24; i++)
            res[i] = -1;
        assert_true(WAIT_FOR(10000, ({
                                 for (size_t i = 0; i < 24; i++) {
                                     enum kvt_lookup_result r;

                                     if (res[i] >= 0)
                                         continue;
                                     r = kvt_tier_lookup(b.net, &keys[i], ctx);
                                     if (r != KVT_RETRY) {
                                         res[i] = (int)r;
                                         missed += r == KVT_MISS;
                                         answered++;
                                     }
                                 }
                                 answered == 24;
                             })));
        assert_int_equal(missed, 24);
    }
    end_req(&b, ctx);

    /* Stored and removed within one step: never published. */
    a_store(&a, 400, 2, NULL);
    assert_int_equal(kvt_manager_reset_all(a.m), 0);
    for (int i = 0; i < 50; i++)
        spin();
    kvt_net_tier_counts(a.net, &ca);
    kvt_net_tier_counts(b.net, &cb);
    assert_int_equal(ca.directory_records + cb.directory_records, 0);
    tn_stop(&b);
    tn_stop(&a);
}

/* ---- fetch into: rows READ straight into a caller's region --------------------- */

struct into_res {
    int calls;
    bool ok[16];
    size_t n;
};

static void into_done(void *arg, const bool *ok, size_t n)
{
    struct into_res *r = arg;

    r->calls++;
    r->n = n;
    memcpy(r->ok, ok, n * sizeof(*ok));
}

static int g_freed;
static void *g_freed_base;

static void region_freed(void *base, size_t len)
{
    (void)len;
    g_freed++;
    g_freed_base = base;
}

/* B pulls K keys of A into a region of its own (not its primary), each at the row
 * the test names (in reverse order); A rewrites one granted row and is still
 * writing another while B reads: those two keys fail, the others hold A's bytes
 * in the region, B's primary holds none of them, and into_chunks counts K - 2. */
static void into_rewrite_during_read(enum kvt_net_verify mode)
{
    enum { K = 8, REGION_ROWS = K + 2 };
    struct kvt_net_tier_config nc = {.verify = mode};
    struct kvt_net_tier_counts cb;
    struct kvt_net_region *reg;
    struct kvt_req_ctx *ctx;
    struct kvt_key keys[K];
    struct into_res res = {0};
    uint64_t offs[K];
    uint8_t *region, *row;
    struct kvt_stats st;
    char label[48];
    struct tn a, b;

    linked_pair(&a, &b, &nc, &nc);
    a_store(&a, 500, K, NULL);
    for (int i = 0; i < 100; i++)
        spin();
    region = aligned_alloc(4096, REGION_ROWS * ROW);
    assert_non_null(region);
    memset(region, 0xaa, REGION_ROWS * ROW);
    assert_int_equal(kvt_net_tier_region_add(b.net, region, REGION_ROWS * ROW, &reg), 0);
    for (size_t i = 0; i < K; i++) {
        key_of(500 + (uint32_t)i, &keys[i]);
        offs[i] = (uint64_t)(REGION_ROWS - 1 - i) * ROW;
    }
    /* Bad destinations: refused, nothing started. */
    offs[0] += 1;
    assert_int_equal(kvt_net_tier_fetch_into(b.net, reg, keys, offs, K, into_done, &res), -EINVAL);
    offs[0] = (uint64_t)REGION_ROWS * ROW;
    assert_int_equal(kvt_net_tier_fetch_into(b.net, reg, keys, offs, K, into_done, &res), -EINVAL);
    offs[0] = (uint64_t)(REGION_ROWS - 1) * ROW;

    /* B's tier locates every key (no manager lookup: nothing is promoted). */
    ctx = new_req(&b);
    assert_true(WAIT_FOR(10000, ({
                             bool all = true;

                             for (size_t i = 0; i < K; i++)
                                 all &= kvt_tier_lookup(b.net, &keys[i], ctx) == KVT_HIT;
                             all;
                         })));
    assert_int_equal(kvt_net_tier_fetch_into(b.net, reg, keys, offs, K, into_done, &res),
                     -EINPROGRESS);
    assert_int_equal(res.calls, 0); /* never inside the call */
    for (int i = 0; i < 10000; i++) {
        struct kvt_net_tier_counts ca;

        kvt_manager_on_schedule_end(a.m, NULL);
        kvt_net_tier_counts(a.net, &ca);
        if (ca.active_leases >= 2)
            break;
        usleep(100);
    }
    assert_int_equal(kvt_primary_rewrite_begin(a.pr, &keys[1], &row), 0);
    row[100] ^= 0xff;
    assert_int_equal(kvt_primary_rewrite_end(a.pr, &keys[1]), 0);
    assert_int_equal(kvt_primary_rewrite_begin(a.pr, &keys[2], &row), 0);
    row[200] ^= 0xff; /* and still being written while B reads */

    assert_true(WAIT_FOR(10000, res.calls == 1));
    assert_int_equal(res.n, K);
    for (size_t i = 0; i < K; i++) {
        uint8_t want[ROW];

        if (i == 1 || i == 2) {
            assert_false(res.ok[i]);
            continue;
        }
        assert_true(res.ok[i]);
        fill(want, &keys[i]);
        assert_memory_equal(region + offs[i], want, ROW);
    }
    /* The rows the test named no key for were not written. */
    assert_int_equal(region[0], 0xaa);
    assert_int_equal(region[ROW + ROW - 1], 0xaa);
    assert_int_equal(kvt_primary_rewrite_end(a.pr, &keys[2]), 0);

    kvt_net_tier_counts(b.net, &cb);
    assert_int_equal(cb.into_chunks, K - 2);
    assert_int_equal(cb.into_bytes, (uint64_t)(K - 2) * ROW);
    assert_int_equal(cb.pulled_chunks, K - 2);
    if (mode == KVT_NET_VERIFY_FENCE) {
        assert_int_equal(cb.fence_failures, 2);
        assert_int_equal(cb.checksum_failures, 0);
    } else {
        assert_int_equal(cb.checksum_failures, 2);
        assert_int_equal(cb.fence_failures, 0);
    }
    /* Nothing went through B's primary. */
    assert_int_equal(kvt_primary_num_entries(b.pr), 0);
    kvt_stats_init(&st);
    assert_int_equal(kvt_manager_get_stats(b.m, &st), 0);
    snprintf(label, sizeof(label), "1:%s", b.net->type);
    assert_true(kvt_stats_value(&st, KVT_M_NET_INTO_CHUNKS, label) == (double)(K - 2));
    kvt_stats_cleanup(&st);
    /* The failed keys are misses now (vLLM's livelock rule). */
    assert_int_equal(kvt_tier_lookup(b.net, &keys[1], ctx), KVT_MISS);
    end_req(&b, ctx);

    /* Removed with nothing in flight: handed back at once. */
    g_freed = 0;
    kvt_net_tier_region_remove(b.net, reg, region_freed);
    assert_int_equal(g_freed, 1);
    assert_ptr_equal(g_freed_base, region);
    assert_true(WAIT_FOR(10000, settled(&a) && settled(&b)));
    free(region);
    tn_stop(&b);
    tn_stop(&a);
}

static void test_fetch_into_fence_refuses_rewritten_rows(void **state)
{
    (void)state;
    into_rewrite_during_read(KVT_NET_VERIFY_FENCE);
}

static void test_fetch_into_checksum_refuses_rewritten_rows(void **state)
{
    (void)state;
    into_rewrite_during_read(KVT_NET_VERIFY_CHECKSUM);
}

/* A region removed while its job is out: the callback never fires, and the region
 * is handed back only once no READ of it is in flight. */
static void test_fetch_into_region_removed_in_flight(void **state)
{
    enum { K = 8 };
    struct kvt_net_region *reg;
    struct kvt_req_ctx *ctx;
    struct kvt_key keys[K];
    struct into_res res = {0};
    uint64_t offs[K];
    uint8_t *region;
    struct tn a, b;

    (void)state;
    linked_pair(&a, &b, NULL, NULL);
    a_store(&a, 600, K, NULL);
    for (int i = 0; i < 100; i++)
        spin();
    region = aligned_alloc(4096, K * ROW);
    assert_non_null(region);
    assert_int_equal(kvt_net_tier_region_add(b.net, region, K * ROW, &reg), 0);
    ctx = new_req(&b);
    for (size_t i = 0; i < K; i++) {
        key_of(600 + (uint32_t)i, &keys[i]);
        offs[i] = i * ROW;
    }
    assert_true(WAIT_FOR(10000, ({
                             bool all = true;

                             for (size_t i = 0; i < K; i++)
                                 all &= kvt_tier_lookup(b.net, &keys[i], ctx) == KVT_HIT;
                             all;
                         })));
    end_req(&b, ctx);
    assert_int_equal(kvt_net_tier_fetch_into(b.net, reg, keys, offs, K, into_done, &res),
                     -EINPROGRESS);
    g_freed = 0;
    kvt_net_tier_region_remove(b.net, reg, region_freed);
    assert_int_equal(kvt_net_tier_fetch_into(b.net, reg, keys, offs, K, into_done, &res),
                     -ESHUTDOWN);
    assert_true(WAIT_FOR(10000, g_freed == 1 && settled(&a) && settled(&b)));
    assert_int_equal(res.calls, 0);
    free(region);
    tn_stop(&b);
    tn_stop(&a);
}

/* ---- direct reads (network.fetch direct) --------------------------------------- */

/* Looks keys [first, first + n) up on b's manager until each is HIT or MISS (res[i]);
 * the HITs' bytes (loaded through a prepare/complete_load) must be A's, byte for
 * byte. Returns how many were HIT. */
static size_t pull_and_check(struct tn *b, struct kvt_req_ctx *ctx, uint32_t first, size_t n,
                             int *res)
{
    struct kvt_key keys[64];
    size_t hits = 0;

    assert_true(n <= KVT_ARRAY_SIZE(keys));
    for (size_t i = 0; i < n; i++) {
        key_of(first + (uint32_t)i, &keys[i]);
        res[i] = -1;
    }
    assert_true(WAIT_FOR(10000, ({
                             bool all = true;

                             for (size_t i = 0; i < n; i++) {
                                 if (res[i] != KVT_HIT && res[i] != KVT_MISS)
                                     res[i] = (int)kvt_manager_lookup(b->m, &keys[i], ctx);
                                 all &= res[i] == KVT_HIT || res[i] == KVT_MISS;
                             }
                             all;
                         })));
    for (size_t i = 0; i < n; i++) {
        uint8_t want[ROW];
        int64_t s;

        if (res[i] != KVT_HIT)
            continue;
        hits++;
        assert_int_equal(kvt_manager_prepare_load(b->m, &keys[i], 1, ctx, &s), 0);
        fill(want, &keys[i]);
        assert_memory_equal(b->net->primary_base + (size_t)s * ROW, want, ROW);
        assert_int_equal(kvt_manager_complete_load(b->m, &keys[i], 1, ctx), 0);
    }
    return hits;
}

/* Two nodes in direct mode, A holding keys [first, first + 1 + n): B pulls the first
 * by lease (its FETCH asks for A's direct handles), then looks the n others up in
 * its network tier, in a request *ctx_p left open (its lookups are cached for it),
 * until each is found with its place. */
static void direct_setup(struct tn *a, struct tn *b, enum kvt_net_fetch fa, enum kvt_net_fetch fb,
                         uint32_t first, size_t n, struct kvt_req_ctx **ctx_p)
{
    struct kvt_net_tier_config nca = {.fetch = fa}, ncb = {.fetch = fb};
    struct kvt_req_ctx *ctx;
    struct kvt_key keys[64];
    int res[1];

    linked_pair(a, b, &nca, &ncb);
    a_store(a, first, 1 + n, NULL);
    for (int i = 0; i < 100; i++)
        spin();
    ctx = new_req(b);
    assert_int_equal(pull_and_check(b, ctx, first, 1, res), 1);
    end_req(b, ctx);
    assert_true(WAIT_FOR(10000, settled(a) && settled(b)));
    ctx = new_req(b);
    for (size_t i = 0; i < n; i++)
        key_of(first + 1 + (uint32_t)i, &keys[i]);
    assert_true(WAIT_FOR(10000, ({
                             bool all = true;

                             for (size_t i = 0; i < n; i++)
                                 all &= kvt_tier_lookup(b->net, &keys[i], ctx) == KVT_HIT;
                             all;
                         })));
    *ctx_p = ctx;
}

/* Direct pull: after the one lease that brought A's handles, B reads every row
 * straight from A's primary - no FETCH, no GRANT, no lease on A - byte for byte. */
static void test_direct_pull_byte_exact(void **state)
{
    enum { K = 24 };
    struct kvt_net_tier_counts ca, cb, ca0, cb0;
    struct kvt_req_ctx *ctx;
    struct kvt_stats st;
    struct tn a, b;
    int res[K];

    (void)state;
    direct_setup(&a, &b, KVT_NET_FETCH_DIRECT, KVT_NET_FETCH_DIRECT, 700, K, &ctx);
    kvt_net_tier_counts(a.net, &ca0);
    kvt_net_tier_counts(b.net, &cb0);
    assert_int_equal(ca0.direct_exposures, 1);
    assert_int_equal(ca0.direct_exposed_links, 1);
    assert_int_equal(cb0.grants, 1);
    assert_int_equal(pull_and_check(&b, ctx, 701, K, res), K);
    end_req(&b, ctx);
    assert_true(WAIT_FOR(10000, settled(&a) && settled(&b)));
    kvt_net_tier_counts(a.net, &ca);
    kvt_net_tier_counts(b.net, &cb);
    assert_int_equal(cb.direct_chunks, K);
    assert_true(cb.direct_fetches > cb0.direct_fetches);
    assert_int_equal(cb.direct_misses, 0);
    assert_int_equal(cb.pulled_chunks, 1 + K);
    assert_int_equal(cb.fetches, cb0.fetches); /* no FETCH for them */
    assert_int_equal(cb.grants, cb0.grants);
    assert_int_equal(ca.served_fetches, ca0.served_fetches);
    assert_int_equal(cb.fence_failures, 0);
    kvt_stats_init(&st);
    assert_int_equal(kvt_tier_get_stats(b.net, &st), 0);
    assert_true(kvt_stats_value(&st, KVT_M_NET_DIRECT_CHUNKS, "1:network") == K);
    kvt_stats_cleanup(&st);
    /* B goes away: A's exposure to its link ends with the link. */
    tn_stop(&b);
    for (uint64_t end = kvt_now_ns() + 10000000000ull; kvt_now_ns() < end; usleep(100)) {
        kvt_manager_on_schedule_end(a.m, NULL);
        kvt_net_tier_counts(a.net, &ca);
        if (ca.direct_exposed_links == 0)
            break;
    }
    assert_int_equal(ca.direct_exposed_links, 0);
    assert_int_equal(ca.direct_exposures, 1);
    tn_stop(&a);
}

/* A holder in lease mode publishes no places and exposes nothing: a puller in
 * direct mode pulls everything by lease (as from a holder before wire 1.2). */
static void test_direct_puller_lease_holder(void **state)
{
    enum { K = 8 };
    struct kvt_net_tier_counts ca, cb;
    struct kvt_req_ctx *ctx;
    struct tn a, b;
    int res[K];
    struct kvt_key k;

    (void)state;
    linked_pair(&a, &b, &(struct kvt_net_tier_config){.fetch = KVT_NET_FETCH_LEASE},
                &(struct kvt_net_tier_config){.fetch = KVT_NET_FETCH_DIRECT});
    a_store(&a, 760, K, NULL);
    for (int i = 0; i < 100; i++)
        spin();
    ctx = new_req(&b);
    assert_int_equal(pull_and_check(&b, ctx, 760, 1, res), 1);
    assert_int_equal(pull_and_check(&b, ctx, 761, K - 1, res), K - 1);
    end_req(&b, ctx);
    assert_true(WAIT_FOR(10000, settled(&a) && settled(&b)));
    kvt_net_tier_counts(a.net, &ca);
    kvt_net_tier_counts(b.net, &cb);
    assert_int_equal(ca.direct_exposures, 0);
    assert_int_equal(cb.direct_fetches, 0);
    assert_int_equal(cb.direct_chunks, 0);
    assert_int_equal(cb.pulled_chunks, K);
    assert_true(cb.grants >= 2);
    key_of(760, &k);
    (void)k;
    tn_stop(&b);
    tn_stop(&a);
}

/* Between B's LOCATE (which gave each key's place) and its READs, A's primary
 * moves on: every row evicted and its slot reused by another key (case evict), or
 * key 1 rewritten whole and key 2 left mid-write (case rewrite). B refuses exactly
 * those rows by their fence words - changed, or odd - and answers MISS for them:
 * never wrong bytes; the others load byte for byte. */
static void direct_stale(bool evict)
{
    enum { K = 8 };
    struct kvt_net_tier_counts cb0, cb;
    struct kvt_req_ctx *ctx;
    struct kvt_key keys[K];
    struct tn a, b;
    int res[K];
    uint8_t *row;
    size_t hits;

    direct_setup(&a, &b, KVT_NET_FETCH_DIRECT, KVT_NET_FETCH_DIRECT, 800, K, &ctx);
    for (size_t i = 0; i < K; i++)
        key_of(801 + (uint32_t)i, &keys[i]);
    if (evict) {
        /* CHUNKS new keys: every old row evicted (LRU), every slot reused. */
        a_store(&a, 2000, 64, NULL);
        a_store(&a, 2064, 64, NULL);
        for (size_t i = 0; i < K; i++) {
            struct kvt_primary_entry_info info;

            assert_int_equal(kvt_primary_entry_info(a.pr, &keys[i], &info), -ENOENT);
        }
    } else {
        assert_int_equal(kvt_primary_rewrite_begin(a.pr, &keys[1], &row), 0);
        row[100] ^= 0xff;
        assert_int_equal(kvt_primary_rewrite_end(a.pr, &keys[1]), 0);
        assert_int_equal(kvt_primary_rewrite_begin(a.pr, &keys[2], &row), 0);
        row[200] ^= 0xff; /* and still being written while B reads */
    }
    kvt_net_tier_counts(b.net, &cb0);
    hits = pull_and_check(&b, ctx, 801, K, res);
    end_req(&b, ctx);
    if (!evict)
        assert_int_equal(kvt_primary_rewrite_end(a.pr, &keys[2]), 0);
    assert_true(WAIT_FOR(10000, settled(&a) && settled(&b)));
    kvt_net_tier_counts(b.net, &cb);
    assert_int_equal(cb.fetches, cb0.fetches); /* all of them direct */
    if (evict) {
        assert_int_equal(hits, 0);
        assert_int_equal(cb.direct_misses - cb0.direct_misses, K);
        assert_int_equal(
            cb.fence_fail[KVT_NET_FENCE_CHANGED] - cb0.fence_fail[KVT_NET_FENCE_CHANGED], K);
        assert_int_equal(cb.direct_chunks, 0);
    } else {
        assert_int_equal(hits, K - 2);
        assert_int_equal(res[1], KVT_MISS);
        assert_int_equal(res[2], KVT_MISS);
        assert_int_equal(cb.direct_misses - cb0.direct_misses, 2);
        assert_int_equal(
            cb.fence_fail[KVT_NET_FENCE_CHANGED] - cb0.fence_fail[KVT_NET_FENCE_CHANGED], 1);
        assert_int_equal(
            cb.fence_fail[KVT_NET_FENCE_WRITING] - cb0.fence_fail[KVT_NET_FENCE_WRITING], 1);
        assert_int_equal(cb.direct_chunks, K - 2);
    }
    assert_int_equal(cb.checksum_failures, 0);
    tn_stop(&b);
    tn_stop(&a);
}

static void test_direct_evicted_and_reused_is_a_miss(void **state)
{
    (void)state;
    direct_stale(true);
}

static void test_direct_rewritten_or_mid_write_refused(void **state)
{
    (void)state;
    direct_stale(false);
}

/* Fetch into in direct mode: rows whose place B's LOCATE gave go straight from A's
 * primary into B's region, fenced, no FETCH; a row rewritten since is refused; B's
 * primary holds none of them. */
static void test_direct_fetch_into(void **state)
{
    enum { K = 8 };
    struct kvt_net_tier_counts cb0, cb;
    struct kvt_net_region *reg;
    struct kvt_req_ctx *ctx;
    struct kvt_key keys[K];
    struct into_res res = {0};
    uint64_t offs[K];
    uint8_t *region, *row;
    struct tn a, b;

    (void)state;
    direct_setup(&a, &b, KVT_NET_FETCH_DIRECT, KVT_NET_FETCH_DIRECT, 950, K, &ctx);
    region = aligned_alloc(4096, K * ROW);
    assert_non_null(region);
    memset(region, 0xaa, K * ROW);
    assert_int_equal(kvt_net_tier_region_add(b.net, region, K * ROW, &reg), 0);
    for (size_t i = 0; i < K; i++) {
        key_of(951 + (uint32_t)i, &keys[i]);
        offs[i] = (uint64_t)(K - 1 - i) * ROW;
    }
    assert_int_equal(kvt_primary_rewrite_begin(a.pr, &keys[3], &row), 0);
    row[300] ^= 0xff;
    assert_int_equal(kvt_primary_rewrite_end(a.pr, &keys[3]), 0);
    kvt_net_tier_counts(b.net, &cb0);
    assert_int_equal(kvt_net_tier_fetch_into(b.net, reg, keys, offs, K, into_done, &res),
                     -EINPROGRESS);
    assert_true(WAIT_FOR(10000, res.calls == 1));
    assert_int_equal(res.n, K);
    for (size_t i = 0; i < K; i++) {
        uint8_t want[ROW];

        if (i == 3) {
            assert_false(res.ok[i]);
            continue;
        }
        assert_true(res.ok[i]);
        fill(want, &keys[i]);
        assert_memory_equal(region + offs[i], want, ROW);
    }
    kvt_net_tier_counts(b.net, &cb);
    assert_int_equal(cb.fetches, cb0.fetches);
    assert_int_equal(cb.direct_chunks - cb0.direct_chunks, K - 1);
    assert_int_equal(cb.direct_misses - cb0.direct_misses, 1);
    assert_int_equal(cb.into_chunks - cb0.into_chunks, K - 1);
    for (size_t i = 0; i < K; i++) {
        struct kvt_primary_entry_info info;

        assert_int_equal(kvt_primary_entry_info(b.pr, &keys[i], &info), -ENOENT);
    }
    end_req(&b, ctx);
    g_freed = 0;
    kvt_net_tier_region_remove(b.net, reg, region_freed);
    assert_true(WAIT_FOR(10000, g_freed == 1 && settled(&a) && settled(&b)));
    free(region);
    tn_stop(&b);
    tn_stop(&a);
}

static void raw_on_state(void *arg, struct kvt_tp_ep *ep, enum kvt_ep_state st, int err)
{
    int *s = arg;

    (void)ep;
    (void)err;
    *s = st == KVT_EP_CONNECTED ? 1 : 2;
}

static void raw_on_msg(void *arg, struct kvt_tp_ep *ep, const void *buf, size_t len)
{
    (void)arg, (void)ep, (void)buf, (void)len;
}

/* What direct mode opens, and to whom: while A exposes its primary to B (B asked),
 * a peer that did not ask (C, authenticated, lease mode, holding A's handle) and an
 * endpoint that never authenticated (a bare transport connection) READ nothing of
 * it: refused, no byte lands, counted on A by reason. */
static void test_direct_exposed_to_authenticated_askers_only(void **state)
{
    enum { K = 4 };
    struct kvt_peers_counts pa;
    struct kvt_req_ctx *ctx0;
    struct tn a, b, c;
    const void *handle;
    size_t handle_len;
    struct kvt_primary_entry_info info;
    struct kvt_key k;
    uint8_t *buf = aligned_alloc(4096, ROW);
    struct kvt_read_op op;

    (void)state;
    assert_non_null(buf);
    direct_setup(&a, &b, KVT_NET_FETCH_DIRECT, KVT_NET_FETCH_DIRECT, 900, K, &ctx0);
    end_req(&b, ctx0);
    key_of(902, &k);
    assert_int_equal(kvt_primary_entry_info(a.pr, &k, &info), 0);
    op = (struct kvt_read_op){.remote_off = (uint64_t)info.slot * ROW, .local_off = 0, .len = ROW};
    assert_int_equal(kvt__net_tier_test_handle(a.net, &handle, &handle_len), 0);

    /* C: authenticated, never asked. */
    tn_start_cfg(&c, 0xC, kvt_peers_port(a.p),
                 &(struct kvt_net_tier_config){.fetch = KVT_NET_FETCH_LEASE});
    {
        struct kvt_transport *tpc = kvt_peers_transport(c.p);
        struct kvt_tp_ep *ep;
        struct kvt_tp_rkey *rk = NULL;
        struct kvt_tp_mr *local = NULL;
        struct read_done d = {0};

        assert_true(WAIT_FOR(10000, ({
                                 kvt_manager_on_schedule_end(c.m, NULL);
                                 kvt_peers_link(c.p, 0xA) != NULL &&live(&a) == 3;
                             })));
        ep = kvt_peers_link(c.p, 0xA);
        assert_int_equal(kvt_tp_unpack(ep, handle, handle_len, &rk), 0);
        assert_int_equal(kvt_tp_reg_local(tpc, buf, ROW, &local), 0);
        memset(buf, 0x5a, ROW);
        assert_int_equal(kvt_tp_read(ep, rk, local, &op, 1, on_read, &d), -EINPROGRESS);
        assert_true(WAIT_FOR(10000, ({
                                 kvt_manager_on_schedule_end(c.m, NULL);
                                 d.done;
                             })));
        assert_int_equal(d.status, -EACCES);
        for (size_t i = 0; i < ROW; i++)
            assert_int_equal(buf[i], 0x5a);
        kvt_peers_counts(a.p, &pa);
        assert_int_equal(pa.tp.refused[KVT_TP_READ_GRANT], 1);
        kvt_tp_rkey_destroy(tpc, rk);
        kvt_tp_dereg(local, tpc);
    }
    tn_stop(&c);

    /* A bare connection to A's port: no handshake, so not authorized. */
    {
        struct kvt_transport_config tc = {.backend = "ucx"};
        struct kvt_transport *tp;
        struct kvt_tp_ep *ep;
        struct kvt_tp_rkey *rk = NULL;
        struct kvt_tp_mr *local = NULL;
        struct read_done d = {0};
        int st = 0, rc;

        tc.cb = (struct kvt_tp_callbacks){
            .on_ep_state = raw_on_state, .on_msg = raw_on_msg, .arg = &st};
        assert_int_equal(kvt_tp_open(&tc, &tp), 0);
        assert_int_equal(kvt_tp_connect(tp, "127.0.0.1", kvt_peers_port(a.p), NULL, &ep), 0);
        assert_true(WAIT_FOR(10000, ({
                                 kvt_tp_progress(tp);
                                 st != 0;
                             })));
        assert_int_equal(st, 1);
        assert_int_equal(kvt_tp_unpack(ep, handle, handle_len, &rk), 0);
        assert_int_equal(kvt_tp_reg_local(tp, buf, ROW, &local), 0);
        memset(buf, 0x5a, ROW);
        rc = kvt_tp_read(ep, rk, local, &op, 1, on_read, &d);
        if (rc == -EINPROGRESS)
            assert_true(WAIT_FOR(10000, ({
                                     kvt_tp_progress(tp);
                                     d.done;
                                 })));
        assert_true(rc != 0 && (rc != -EINPROGRESS || d.status != 0));
        for (size_t i = 0; i < ROW; i++)
            assert_int_equal(buf[i], 0x5a);
        assert_true(WAIT_FOR(10000, ({
                                 kvt_tp_progress(tp);
                                 kvt_peers_counts(a.p, &pa);
                                 pa.tp.refused[KVT_TP_READ_UNAUTH] >= 1;
                             })));
        kvt_tp_rkey_destroy(tp, rk);
        kvt_tp_dereg(local, tp);
        kvt_tp_close(tp);
    }

    /* B, which asked, reads the same row directly. */
    {
        struct kvt_req_ctx *ctx = new_req(&b);
        int res[1];

        assert_int_equal(pull_and_check(&b, ctx, 902, 1, res), 1);
        end_req(&b, ctx);
    }
    {
        struct kvt_net_tier_counts cb;

        kvt_net_tier_counts(b.net, &cb);
        assert_int_equal(cb.direct_chunks, 1);
    }
    free(buf);
    assert_true(WAIT_FOR(10000, settled(&a) && settled(&b)));
    tn_stop(&b);
    tn_stop(&a);
}

/* ---- lookups whose LOCATEs are not answered ------------------------------------ */

/* n keys from first on whose home, among A and B, is A (LOCATEs to A). */
static void keys_homed_on_a(uint32_t first, struct kvt_key *keys, size_t n)
{
    const uint64_t ids[2] = {0xA, 0xB};

    for (size_t got = 0; got < n; first++) {
        key_of(first, &keys[got]);
        if (kvt_hrw_home(&keys[got], ids, 2) == 0)
            got++;
    }
}

/* B's lookups of keys (none held) for up to ms, stepping B alone: true when every
 * one answered MISS, and none answered anything but RETRY before. */
static bool b_alone_until_missed(struct tn *b, const struct kvt_key *keys, size_t n,
                                 struct kvt_req_ctx *ctx, unsigned ms)
{
    uint64_t end = kvt_now_ns() + (uint64_t)ms * 1000000ull;
    int res[16];
    size_t left = n;

    assert_true(n <= KVT_ARRAY_SIZE(res));
    for (size_t i = 0; i < n; i++)
        res[i] = -1;
    while (left > 0 && kvt_now_ns() < end) {
        for (size_t i = 0; i < n; i++) {
            enum kvt_lookup_result r;

            if (res[i] >= 0)
                continue;
            r = kvt_manager_lookup(b->m, &keys[i], ctx);
            if (r == KVT_RETRY)
                continue;
            if (r != KVT_MISS)
                return false;
            res[i] = (int)r;
            left--;
        }
        kvt_manager_on_schedule_end(b->m, NULL);
        usleep(100);
    }
    return left == 0;
}

/* A and B linked, with LOCATEs that give up after 200 ms. */
static void locate_pair(struct tn *a, struct tn *b)
{
    struct kvt_net_tier_config nc = {.locate_timeout_ms = 200};

    linked_pair(a, b, &nc, &nc);
}

/* B looks keys up (each RETRY: asked of their home) and ends its step: their
 * LOCATEs leave. */
static void locates_leave(struct tn *b, const struct kvt_key *keys, size_t n,
                          struct kvt_req_ctx *ctx)
{
    for (size_t i = 0; i < n; i++)
        assert_int_equal(kvt_manager_lookup(b->m, &keys[i], ctx), KVT_RETRY);
    kvt_manager_on_schedule_end(b->m, NULL);
}

/* A home that does not answer: B's lookups RETRY until the LOCATE's deadline, then
 * MISS (a failed lookup is a miss); the answer that comes after is refused and
 * counted, and changes nothing. B stopped with LOCATEs in flight frees them (the
 * sanitizer's leak check), and so does A stopped with LOCATEs of B's parked. */
static void test_locates_unanswered_then_late(void **state)
{
    struct kvt_net_tier_counts cb;
    struct tn a, b;
    struct kvt_key keys[8];
    struct kvt_req_ctx *ctx;
    uint64_t t0;

    (void)state;
    locate_pair(&a, &b);
    keys_homed_on_a(7000, keys, 8);

    /* A is not stepped: its answer never comes in time. */
    ctx = new_req(&b);
    t0 = kvt_now_ns();
    assert_true(b_alone_until_missed(&b, keys, 8, ctx, 5000));
    assert_true(kvt_now_ns() - t0 >= 150ull * 1000000ull); /* not before the deadline */
    kvt_net_tier_counts(b.net, &cb);
    assert_int_equal(cb.locates, 8);
    assert_true(cb.locate_timeouts >= 1);
    assert_int_equal(cb.refused, 0);
    /* Now A answers: too late, refused and counted; the verdicts stay misses. */
    assert_true(WAIT_FOR(5000, (kvt_net_tier_counts(b.net, &cb), cb.refused >= 1)));
    for (size_t i = 0; i < 8; i++)
        assert_int_equal(kvt_manager_lookup(b.m, &keys[i], ctx), KVT_MISS);
    end_req(&b, ctx);

    /* LOCATEs in flight to A (not stepped), then B stops. */
    keys_homed_on_a(8000, keys, 8);
    ctx = new_req(&b);
    locates_leave(&b, keys, 8, ctx);
    kvt_net_tier_counts(b.net, &cb);
    assert_int_equal(cb.locates, 16);
    kvt_req_ctx_unref(ctx); /* the request is never finished */
    tn_stop(&b);
    tn_stop(&a);
}

/* The home dies with B's LOCATEs in flight: they end as soon as B calls it down,
 * MISS, not at their deadline (30 s here). */
static void test_locates_in_flight_when_the_home_dies(void **state)
{
    struct kvt_net_tier_config nc = {.locate_timeout_ms = 30000};
    struct kvt_net_tier_counts cb;
    struct tn a, b;
    struct kvt_key keys[8];
    struct kvt_req_ctx *ctx;

    (void)state;
    linked_pair(&a, &b, &nc, &nc);
    keys_homed_on_a(9000, keys, 8);
    ctx = new_req(&b);
    locates_leave(&b, keys, 8, ctx);
    tn_stop(&a);
    assert_true(b_alone_until_missed(&b, keys, 8, ctx, 10000));
    kvt_net_tier_counts(b.net, &cb);
    assert_int_equal(cb.locates, 8);
    assert_int_equal(cb.locate_timeouts, 0);
    end_req(&b, ctx);
    tn_stop(&b);
}

/* ---- a stalled holder --------------------------------------------------------- */

/* A (0xA) stores keys 0..NKEYS and publishes them; B (0xB), home of some of them,
 * holds their records. Returns how many are homed at B (> 0). */
static uint64_t a_publishes_to_b(struct tn *a, struct tn *b)
{
    const uint64_t ids[2] = {0xA, 0xB};
    struct kvt_net_tier_counts cb;
    uint64_t homed_b = 0;

    for (uint32_t i = 0; i < NKEYS; i++) {
        struct kvt_key k;

        key_of(i, &k);
        homed_b += kvt_hrw_home(&k, ids, 2) == 1;
    }
    assert_true(homed_b > 0);
    a_store(a, 0, NKEYS, NULL);
    assert_true(
        WAIT_FOR(10000, (kvt_net_tier_counts(b->net, &cb), cb.directory_records == homed_b)));
    return homed_b;
}

/* A stalls (is not stepped) past B's heartbeat limit: B, home of about half of A's
 * keys, calls A down and drops A's records. Down is never one-sided: B closes its
 * link, so A, stepped again, calls B down too, both see the other join, and A
 * publishes its keys again. B then finds every one at A. (Were A heard again on a
 * link it never lost, its records would stay dropped until its periodic
 * republication, minutes later, and B's lookups would miss meanwhile.) */
static void test_records_come_back_after_a_stall(void **state)
{
    struct kvt_net_tier_counts cb;
    struct kvt_req_ctx *ctx;
    struct tn a, b;
    uint64_t homed_b = 0, end;
    int res[NKEYS];

    (void)state;
    locate_pair(&a, &b);
    homed_b = a_publishes_to_b(&a, &b);

    /* A stalls; B alone goes on until it has called A down (20 heartbeats of 100 ms). */
    end = kvt_now_ns() + 10000ull * 1000000ull;
    while (live(&b) != 1 && kvt_now_ns() < end) {
        kvt_manager_on_schedule_end(b.m, NULL);
        usleep(1000);
    }
    assert_int_equal(live(&b), 1);
    kvt_net_tier_counts(b.net, &cb);
    assert_int_equal(cb.directory_records, 0);
    assert_null(kvt_peers_link(b.p, 0xA)); /* closed: A will learn it was called down */

    /* Both go on: A's records are back at B, and B finds every key at A. */
    assert_true(
        WAIT_FOR(10000, live(&a) == 2 && live(&b) == 2 &&
                            (kvt_net_tier_counts(b.net, &cb), cb.directory_records == homed_b)));
    ctx = new_req(&b);
    assert_int_equal(pull_and_check(&b, ctx, 0, NKEYS, res), NKEYS);
    end_req(&b, ctx);
    assert_true(WAIT_FOR(10000, settled(&a) && settled(&b)));
    tn_stop(&b);
    tn_stop(&a);
}

/* ---- homes after a membership change ------------------------------------------- */

static uint64_t records(struct tn *t)
{
    struct kvt_net_tier_counts c;

    kvt_net_tier_counts(t->net, &c);
    return c.directory_records;
}

/* C joins A and B: A re-publishes the keys now homed at C to C, but B, their home
 * before, keeps their records until every node can have seen the change (twice the
 * 2 s it takes to call a silent member down, plus 1 s), and drops them only then:
 * a home whose view lagged would otherwise drop what a publisher past the change
 * sent it, for good. */
static void test_home_keeps_moved_keys_until_views_settle(void **state)
{
    const uint64_t two[2] = {0xA, 0xB}, three[3] = {0xA, 0xB, 0xC};
    uint64_t homed_b = 0, homed_b3 = 0, homed_c = 0, t_join;
    struct tn a, b, c;

    (void)state;
    linked_pair(&a, &b, NULL, NULL);
    for (uint32_t i = 0; i < NKEYS; i++) {
        struct kvt_key k;

        key_of(i, &k);
        homed_b += kvt_hrw_home(&k, two, 2) == 1;
        homed_b3 += kvt_hrw_home(&k, three, 3) == 1;
        homed_c += kvt_hrw_home(&k, three, 3) == 2;
    }
    assert_true(homed_c > 0 && homed_b3 < homed_b);
    a_store(&a, 0, NKEYS, NULL);
    assert_true(WAIT_FOR(10000, records(&b) == homed_b));

    tn_start(&c, 0xC, kvt_peers_port(a.p));
    g_c = &c;
    assert_true(WAIT_FOR(10000, live(&b) == 3));
    t_join = kvt_now_ns();
    assert_true(WAIT_FOR(10000, live(&a) == 3 && live(&c) == 3 && records(&c) == homed_c));
    spin();
    assert_true(kvt_now_ns() - t_join < 4000ull * 1000000ull);
    assert_int_equal(records(&b), homed_b); /* kept so far */
    assert_true(WAIT_FOR(10000, records(&b) == homed_b3));
    assert_true(kvt_now_ns() - t_join >= 4500ull * 1000000ull); /* 5 s, less B's lag */
    g_c = NULL;
    tn_stop(&c);
    tn_stop(&b);
    tn_stop(&a);
}

/* A member that had called this node down and dropped its records, seen through a
 * new link while this node held it live all along (KVT_MEMBER_DROPPED_US): the node
 * publishes everything again. Here B is made to drop A's records (its tier is told
 * A went down); they stay dropped (nothing else makes A publish them before its
 * periodic refresh) until A's tier hears that B dropped them, then come back. */
static void test_records_come_back_when_a_member_dropped_them(void **state)
{
    struct kvt_member_event down = {.kind = KVT_MEMBER_DOWN_EV, .node_id = 0xA},
                            dropped = {.kind = KVT_MEMBER_DROPPED_US, .node_id = 0xB};
    uint64_t homed_b = 0;
    struct tn a, b;

    (void)state;
    linked_pair(&a, &b, NULL, NULL);
    homed_b = a_publishes_to_b(&a, &b);
    down.incarnation = kvt_peers_incarnation(a.p);
    kvt__net_tier_test_member_event(b.net, &down);
    assert_int_equal(records(&b), 0);
    (void)WAIT_FOR(500, false);
    assert_int_equal(records(&b), 0);
    dropped.incarnation = kvt_peers_incarnation(b.p);
    kvt__net_tier_test_member_event(a.net, &dropped);
    assert_true(WAIT_FOR(5000, records(&b) == homed_b));
    tn_stop(&b);
    tn_stop(&a);
}

/* ---- a publication burst beyond the link's send credits ------------------------ */

/* Stores n keys of the longest kind (64 bytes, as an engine's are) at a, 64 at a
 * time, cascaded and published at a's next step; homed[i] counts those homed at
 * ids[i] of n_ids. A message of 256 of them is sent by rendezvous, so it holds its
 * credit until the home has fetched it. */
static void a_store_long_keys(struct tn *a, uint32_t n, const uint64_t *ids, size_t n_ids,
                              size_t *homed)
{
    struct kvt_key keys[64];

    for (uint32_t first = 0; first < n; first += 64) {
        for (uint32_t i = 0; i < 64; i++) {
            uint8_t b64[KVT_KEY_MAX];
            uint32_t x = first + i;

            memset(b64, 'k', sizeof(b64));
            memcpy(b64, &x, sizeof(x));
            kvt_key_set(&keys[i], b64, sizeof(b64));
            homed[kvt_hrw_home(&keys[i], ids, n_ids)]++;
        }
        a_store_keys(a, keys, 64, NULL);
    }
}

/* A (room for chunks) and B, linked with 2 send credits each way. */
static void two_credit_pair(struct tn *a, struct tn *b, size_t chunks)
{
    tn_start_opts(a, 0xA, 0, NULL, chunks, 2);
    tn_start_opts(b, 0xB, kvt_peers_port(a->p), NULL, CHUNKS, 2);
    g_a = a;
    g_b = b;
    assert_true(WAIT_FOR(10000, live(a) == 2 && live(b) == 2));
}

/* A burst of publications (a large cascade; every key after a membership change)
 * is one message per home and 256 keys: here more than the link's 2 send credits.
 * Those refused for credits leave at a later flush instead of being lost: B, home
 * of about half of A's 1600 keys, ends with a record of every one, and nothing is
 * counted as a failed send. */
static void test_publish_burst_beyond_credits(void **state)
{
    enum { N = 1600 };
    const uint64_t ids[2] = {0xA, 0xB};
    struct kvt_net_tier_counts ca, cb;
    struct kvt_stats st;
    struct tn a, b;
    size_t homed[2] = {0};

    (void)state;
    two_credit_pair(&a, &b, N);
    a_store_long_keys(&a, N, ids, 2, homed);
    assert_true(homed[1] > 3 * 256); /* at least 4 messages to B in the first flush */
    /* Some wait for credits (a message takes one of the two, the other stays for
     * answers), then all arrive. */
    assert_true(WAIT_FOR(10000, (kvt_net_tier_counts(a.net, &ca), ca.publish_waiting > 0)));
    /* The loop is told to come back for them within a ms, whatever its tick. */
    assert_true(kvt_tier_wake_at_ns(a.net) != 0);
    assert_true(kvt_tier_wake_at_ns(a.net) <= kvt_now_ns() + 1000000ull);
    kvt_stats_init(&st);
    assert_int_equal(kvt_tier_get_stats(a.net, &st), 0);
    assert_true(kvt_stats_value(&st, KVT_M_NET_PUBLISH_WAITING, "1:network") > 0);
    kvt_stats_cleanup(&st);
    assert_true(
        WAIT_FOR(10000, (kvt_net_tier_counts(b.net, &cb), cb.directory_records == homed[1])));
    kvt_net_tier_counts(a.net, &ca);
    assert_int_equal(ca.published_keys, N);
    assert_int_equal(ca.publish_waiting, 0);
    assert_int_equal(ca.send_failures, 0);
    assert_int_equal(kvt_tier_wake_at_ns(a.net), 0);
    tn_stop(&b);
    tn_stop(&a);
}

/* An authenticated peer floods PUBLISH of keys it does not hold (here 40 messages of
 * 256 fresh keys): its home keeps at most max_records_per_node of its records and
 * counts each message past that as refused, so the peer cannot grow the home's memory
 * without bound (the limit is per node: other nodes' records are not held back). */
static void test_publish_flood_bounded_per_node(void **state)
{
    enum { LIMIT = 300, MSGS = 40 };
    struct kvt_net_tier_config nc = {.max_records_per_node = LIMIT};
    struct kvt_net_tier_counts ca;
    struct tn a, b;
    static struct kvt_key ks[FLOODK];
    uint64_t refused0;

    (void)state;
    linked_pair(&a, &b, &nc, &nc);
    kvt_net_tier_counts(a.net, &ca);
    refused0 = ca.refused;
    for (uint32_t m = 0; m < MSGS; m++) {
        struct kvt_wire_msg msg;

        for (uint32_t i = 0; i < FLOODK; i++)
            key_of(1000000 + m * FLOODK + i, &ks[i]);
        kvt_wire_msg_init(&msg, KVT_WIRE_PUBLISH);
        msg.u.publish.node_id = 0xB;
        msg.u.publish.incarnation = kvt_peers_incarnation(b.p);
        msg.u.publish.n_keys = FLOODK;
        msg.u.publish.keys = ks;
        assert_true(WAIT_FOR(5000, kvt_peers_send(b.p, 0xA, &msg) == 0));
    }
    assert_true(WAIT_FOR(
        10000, (kvt_net_tier_counts(a.net, &ca), ca.refused - refused0 >= MSGS - LIMIT / FLOODK)));
    for (int i = 0; i < 100; i++)
        spin();
    kvt_net_tier_counts(a.net, &ca);
    assert_int_equal(ca.directory_records, LIMIT);
    tn_stop(&b);
    tn_stop(&a);
}

/* An authenticated peer floods FETCHes of a row A holds and never RELEASEs: A
 * serves at most serve_per_peer of its FETCHes at once (each lease pins the row and,
 * over verbs, takes windows), denies the rest BUSY and counts them refused; the
 * leases end with their lease time, and A serves the peer again. */
static void test_fetch_flood_bounded_per_peer(void **state)
{
    enum { CAP = 8, MSGS = 40 };
    struct kvt_net_tier_config nc = {.lease_ms = 2000, .serve_per_peer = CAP};
    struct kvt_net_tier_counts ca;
    struct tn a, b;
    struct kvt_key k;
    uint64_t refused0;

    (void)state;
    linked_pair(&a, &b, &nc, &nc);
    a_store(&a, 3000, 1, NULL);
    key_of(3000, &k);
    kvt_net_tier_counts(a.net, &ca);
    refused0 = ca.refused;
    for (uint32_t m = 0; m < MSGS; m++) {
        struct kvt_wire_msg msg;

        kvt_wire_msg_init(&msg, KVT_WIRE_FETCH);
        msg.u.fetch.job_id = 0x7000000 + m; /* no fetch of B's: B refuses the answers */
        msg.u.fetch.n_keys = 1;
        msg.u.fetch.keys = &k;
        assert_true(WAIT_FOR(5000, kvt_peers_send(b.p, 0xA, &msg) == 0));
    }
    assert_true(WAIT_FOR(10000, (kvt_net_tier_counts(a.net, &ca),
                                 ca.active_leases + (ca.refused - refused0) == MSGS)));
    assert_int_equal(ca.active_leases, CAP);
    assert_int_equal(ca.refused - refused0, MSGS - CAP);
    /* Expired: the peer is served again. */
    assert_true(WAIT_FOR(10000, (kvt_net_tier_counts(a.net, &ca), ca.active_leases == 0)));
    {
        struct kvt_wire_msg msg;

        kvt_wire_msg_init(&msg, KVT_WIRE_FETCH);
        msg.u.fetch.job_id = 0x7100000;
        msg.u.fetch.n_keys = 1;
        msg.u.fetch.keys = &k;
        assert_int_equal(kvt_peers_send(b.p, 0xA, &msg), 0);
    }
    assert_true(WAIT_FOR(10000, (kvt_net_tier_counts(a.net, &ca), ca.active_leases == 1)));
    assert_int_equal(ca.refused - refused0, MSGS - CAP);
    tn_stop(&b);
    tn_stop(&a);
}

/* The membership changes while publications wait for credits: C joins while A's
 * burst to B is still queued. What waited is placed again (or published again, as
 * every held key is after a change), and each of the three homes ends with exactly
 * the records of the keys homed there now; nothing is left waiting, no send failed. */
static void test_waiting_publications_follow_a_new_member(void **state)
{
    enum { N = 1600 };
    const uint64_t three[3] = {0xA, 0xB, 0xC};
    struct kvt_net_tier_counts ca;
    size_t homed[3] = {0};
    struct tn a, b, c;

    (void)state;
    two_credit_pair(&a, &b, N);
    a_store_long_keys(&a, N, three, 3, homed);
    assert_true(WAIT_FOR(10000, (kvt_net_tier_counts(a.net, &ca), ca.publish_waiting > 0)));
    tn_start_opts(&c, 0xC, kvt_peers_port(a.p), NULL, CHUNKS, 2);
    g_c = &c;
    assert_true(WAIT_FOR(10000, live(&a) == 3 && live(&b) == 3 && live(&c) == 3));
    /* The homes drop the keys that moved away once the views settled (5 s). */
    assert_true(WAIT_FOR(20000, records(&a) == homed[0] && records(&b) == homed[1] &&
                                    records(&c) == homed[2]));
    kvt_net_tier_counts(a.net, &ca);
    assert_int_equal(ca.published_keys, N);
    assert_int_equal(ca.publish_waiting, 0);
    assert_int_equal(ca.send_failures, 0);
    g_c = NULL;
    tn_stop(&c);
    tn_stop(&b);
    tn_stop(&a);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_pull_pipelined_and_per_peer_stats),
        cmocka_unit_test(test_direct_pull_byte_exact),
        cmocka_unit_test(test_direct_puller_lease_holder),
        cmocka_unit_test(test_direct_evicted_and_reused_is_a_miss),
        cmocka_unit_test(test_direct_rewritten_or_mid_write_refused),
        cmocka_unit_test(test_direct_exposed_to_authenticated_askers_only),
        cmocka_unit_test(test_direct_fetch_into),
        cmocka_unit_test(test_busy_poll_then_sleep_in_flight),
        cmocka_unit_test(test_idle_poll_counted),
        cmocka_unit_test(test_may_read_answers_from_active_leases),
        cmocka_unit_test(test_authenticated_peer_reads_only_its_grants),
        cmocka_unit_test(test_pull_survives_allocation_failures),
        cmocka_unit_test(test_reset_unpublishes_everything),
        cmocka_unit_test(test_fence_refuses_rows_rewritten_during_read),
        cmocka_unit_test(test_checksum_refuses_rows_rewritten_during_read),
        cmocka_unit_test(test_fence_mode_checks_old_holders_by_checksum),
        cmocka_unit_test(test_may_read_fence_words_of_grants_only),
        cmocka_unit_test(test_fetch_into_fence_refuses_rewritten_rows),
        cmocka_unit_test(test_fetch_into_checksum_refuses_rewritten_rows),
        cmocka_unit_test(test_fetch_into_region_removed_in_flight),
        cmocka_unit_test(test_locates_unanswered_then_late),
        cmocka_unit_test(test_locates_in_flight_when_the_home_dies),
        cmocka_unit_test(test_records_come_back_after_a_stall),
        cmocka_unit_test(test_records_come_back_when_a_member_dropped_them),
        cmocka_unit_test(test_publish_flood_bounded_per_node),
        cmocka_unit_test(test_fetch_flood_bounded_per_peer),
        cmocka_unit_test(test_publish_burst_beyond_credits),
        cmocka_unit_test(test_waiting_publications_follow_a_new_member),
        cmocka_unit_test(test_home_keeps_moved_keys_until_views_settle),
    };

    return cmocka_run_group_tests(tests, NULL, NULL);
}

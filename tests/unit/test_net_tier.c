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

#include "kvt/auth.h"
#include "kvt/clock.h"
#include "kvt/hash.h"
#include "kvt/manager.h"
#include "kvt/net_tier.h"
#include "kvt/peers.h"
#include "kvt/primary.h"
#include "kvt/stats.h"

#define ROW    16384
#define CHUNKS 128
#define NKEYS  40

static const uint8_t secret[] = "kvtier-test-secret-0123456789abcdef";

struct tn {
    uint64_t id;
    struct kvt_peers *p;
    struct kvt_primary *pr;
    struct kvt_tier *net;
    struct kvt_manager *m;
    unsigned seq;
};

static void tn_start(struct tn *t, uint64_t id, uint16_t seed_port)
{
    char seed[32];
    const char *seeds[1] = {seed};
    struct kvt_peers_config pc = {0};
    struct kvt_primary_config prc = {0};
    struct kvt_net_tier_config nc = {0};

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
    assert_int_equal(kvt_peers_create(&pc, &t->p), 0);
    prc.num_chunks = CHUNKS;
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

static void tn_stop(struct tn *t)
{
    kvt_manager_shutdown(t->m);
    kvt_manager_destroy(t->m);
    kvt_peers_destroy(t->p);
}

static struct tn *g_a, *g_b;

static void spin(void)
{
    kvt_manager_on_schedule_end(g_a->m, NULL);
    kvt_manager_on_schedule_end(g_b->m, NULL);
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
    tn_start(&a, 0xA, 0);
    tn_start(&b, 0xB, kvt_peers_port(a.p));
    g_a = &a;
    g_b = &b;
    assert_true(WAIT_FOR(10000, live(&a) == 2 && live(&b) == 2));

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
    kvt_stats_clear(&st);
    assert_int_equal(kvt_manager_get_stats(a.m, &st), 0);
    assert_true(stat_of(&st, KVT_M_NET_PEER_SERVED_BYTES, 0xB) == (double)NKEYS * ROW);
    assert_true(stat_of(&st, KVT_M_NET_PEER_PULLED_BYTES, 0xB) == 0);
    /* Counters are deltas: a second report adds nothing. */
    kvt_stats_clear(&st);
    assert_int_equal(kvt_manager_get_stats(a.m, &st), 0);
    assert_true(stat_of(&st, KVT_M_NET_PEER_SERVED_BYTES, 0xB) == 0);
    kvt_stats_cleanup(&st);

    tn_stop(&b);
    tn_stop(&a);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_pull_pipelined_and_per_peer_stats),
    };

    return cmocka_run_group_tests(tests, NULL, NULL);
}

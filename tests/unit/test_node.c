/* SPDX-License-Identifier: Apache-2.0 */
/* The node as kvtierd and kvtier-simnode open it (node/node.c): what kvt_node_open
 * builds from a configuration (runtime folder, region, lock, engine socket, the tiers
 * in their configured order), what the loop's calls do (the one fd wakes up for an
 * engine connecting and for a peer dialling: the network tier's fds come through the
 * tier ops; the timeout follows the tick and a reload of it), the stop (files gone),
 * a refused start (an unsafe folder: -EPERM, nothing created), the tier ops'
 * defaults and the storage tier's usage as the node runs them, and the node's own
 * series on /metrics (build, this process from /proc/self, how full each tier is). */
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <inttypes.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "test_util.h"

#include "kvt/alloc.h"
#include "kvt/clock.h"
#include "kvt/common.h"
#include "kvt/config.h"
#include "kvt/manager.h"
#include "kvt/net_tier.h"
#include "kvt/node.h"
#include "kvt/peers.h"
#include "kvt/proc_stats.h"
#include "kvt/region.h"
#include "kvt/tier.h"
#include "kvt/version.h"

#define ROW (256 * 1024)

static char *tmp;
static char shm[128], secret[600];
static uint64_t next_id = 0x7e5700;

/* A node with this test's settings beside kvtierd's defaults: a 4 MiB primary in a
 * runtime folder on /dev/shm, storage under the test folder (no back-pressure: every
 * cascade lands), the network tier on any port of 127.0.0.1, no /metrics; then the
 * NULL-terminated extra keys. */
static int open_node(struct kvt_node **nd_p, uint64_t id, ...)
{
    char k[8][700], err[512];
    char *sets[24];
    size_t n = 0;
    struct kvt_config cfg;
    va_list ap;
    const char *a;
    int rc;

    snprintf(k[0], sizeof(k[0]), "node.id=%" PRIu64, id);
    snprintf(k[1], sizeof(k[1]), "primary.path=%s/{id}/primary.mmap", shm);
    snprintf(k[2], sizeof(k[2]), "engine.socket=%s/{id}/engine.sock", shm);
    snprintf(k[3], sizeof(k[3]), "storage.root=%s/storage-{id}", tmp);
    snprintf(k[4], sizeof(k[4]), "cluster.secret_file=%s", secret);
    for (int i = 0; i < 5; i++)
        sets[n++] = k[i];
    sets[n++] = "primary.size=4MiB";
    sets[n++] = "primary.row_bytes=256KiB";
    sets[n++] = "storage.high_water_us=60000000";
    sets[n++] = "storage.low_water_us=60000000";
    sets[n++] = "network.port=0";
    sets[n++] = "metrics.port=0";
    sets[n++] = "node.namespace=test-node";
    sets[n++] = "log.level=warn";
    va_start(ap, id);
    while ((a = va_arg(ap, const char *)) != NULL && n < KVT_ARRAY_SIZE(sets))
        sets[n++] = (char *)a;
    va_end(ap);
    rc = kvt_config_load(&cfg, NULL, sets, n, err, sizeof(err));
    if (rc != 0)
        fail_msg("config: %s", err);
    rc = kvt_node_open(&cfg, nd_p);
    kvt_config_free(&cfg);
    return rc;
}

static void node_path(char *buf, size_t len, uint64_t id, const char *name)
{
    snprintf(buf, len, "%s/%016" PRIx64 "/%s", shm, id, name);
}

static bool exists(const char *path)
{
    struct stat st;

    return lstat(path, &st) == 0;
}

static bool readable(int fd, int ms)
{
    struct pollfd p = {.fd = fd, .events = POLLIN};

    return poll(&p, 1, ms) == 1 && (p.revents & POLLIN);
}

/* Runs the node's loop until its fd stays quiet for quiet_ms (at most 5 s). */
static void settle(struct kvt_node *nd, int quiet_ms)
{
    uint64_t end = kvt_now_ns() + 5000000000ull;

    while (kvt_now_ns() < end) {
        kvt_node_progress(nd);
        if (!readable(kvt_node_fd(nd), quiet_ms))
            return;
    }
    fail_msg("the node's fd never went quiet");
}

/* Opens, serves an engine connection through the one fd, stops: the runtime files
 * exist while it runs and are gone after the stop. */
static void test_open_and_stop(void **state)
{
    uint64_t id = next_id++;
    struct kvt_node *nd = NULL;
    char region[300], lock[300], sock[300];
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    int c;

    (void)state;
    assert_int_equal(open_node(&nd, id, NULL), 0);
    node_path(region, sizeof(region), id, "primary.mmap");
    node_path(lock, sizeof(lock), id, "primary.mmap.lock");
    node_path(sock, sizeof(sock), id, "engine.sock");
    assert_true(exists(region) && exists(lock) && exists(sock));
    assert_int_equal(kvt_node_config(nd)->node_id, id);
    assert_non_null(kvt_node_manager(nd));
    assert_non_null(kvt_node_primary(nd));
    assert_int_equal(kvt_node_region(nd)->size, 4 << 20);
    assert_non_null(kvt_node_peers(nd));
    assert_int_equal(kvt_node_metrics_port(nd), 0);
    /* The default order: storage, then network. */
    assert_string_equal(kvt_node_tier(nd, KVT_TIER_STORAGE)->type, "storage");
    assert_string_equal(kvt_node_tier(nd, KVT_TIER_NETWORK)->type, "network");
    assert_int_equal(kvt_node_tier(nd, KVT_TIER_STORAGE)->index, 0);
    assert_int_equal(kvt_node_tier(nd, KVT_TIER_NETWORK)->index, 1);
    settle(nd, 100);
    /* An engine connecting wakes the loop: the engine socket is in the node's fd. */
    c = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    assert_true(c >= 0);
    assert_true(strlen(sock) < sizeof(sa.sun_path));
    memcpy(sa.sun_path, sock, strlen(sock) + 1);
    assert_int_equal(connect(c, (struct sockaddr *)&sa, sizeof(sa)), 0);
    assert_true(readable(kvt_node_fd(nd), 2000));
    assert_int_equal(kvt_node_progress(nd), 0);
    close(c);
    assert_int_equal(kvt_node_stop(nd), 0);
    assert_false(exists(region));
    assert_false(exists(lock));
    assert_false(exists(sock));
    assert_int_equal(kvt_node_stop(nd), 0); /* once is enough */
    kvt_node_close(nd);
}

/* tiers lists the order; a disabled tier is skipped; close stops a running node. */
static void test_tier_order_and_disabled(void **state)
{
    uint64_t id = next_id++;
    struct kvt_node *nd = NULL;
    char region[300];

    (void)state;
    assert_int_equal(open_node(&nd, id, "tiers=network,storage", NULL), 0);
    assert_int_equal(kvt_node_tier(nd, KVT_TIER_NETWORK)->index, 0);
    assert_int_equal(kvt_node_tier(nd, KVT_TIER_STORAGE)->index, 1);
    kvt_node_close(nd);
    node_path(region, sizeof(region), id, "primary.mmap");
    assert_false(exists(region));

    assert_int_equal(open_node(&nd, id, "storage.enabled=false", NULL), 0);
    assert_null(kvt_node_tier(nd, KVT_TIER_STORAGE));
    assert_non_null(kvt_node_tier(nd, KVT_TIER_NETWORK));
    kvt_node_close(nd);

    assert_int_equal(open_node(&nd, id, "network.enabled=false", NULL), 0);
    assert_null(kvt_node_tier(nd, KVT_TIER_NETWORK));
    assert_null(kvt_node_peers(nd));
    assert_int_equal(kvt_node_stop(nd), 0);
    kvt_node_close(nd);
}

/* A runtime folder others may write to: refused (-EPERM), no lock, no region. */
static void test_refuses_unsafe_folder(void **state)
{
    uint64_t id = next_id++;
    struct kvt_node *nd = NULL;
    char dir[300], region[300], lock[300];

    (void)state;
    snprintf(dir, sizeof(dir), "%s/%016" PRIx64, shm, id);
    assert_int_equal(mkdir(dir, 0700), 0);
    assert_int_equal(chmod(dir, 0777), 0);
    assert_int_equal(open_node(&nd, id, NULL), -EPERM);
    node_path(region, sizeof(region), id, "primary.mmap");
    node_path(lock, sizeof(lock), id, "primary.mmap.lock");
    assert_false(exists(region));
    assert_false(exists(lock));
    chmod(dir, 0700);
}

/* The loop may sleep until the next tick's step; a reload of loop.tick_ms applies. */
static void test_timeout_follows_tick(void **state)
{
    uint64_t id = next_id++;
    struct kvt_node *nd = NULL;
    struct kvt_config next;
    int t;

    (void)state;
    assert_int_equal(open_node(&nd, id, "loop.tick_ms=50", "network.enabled=false", NULL), 0);
    kvt_node_step(nd);
    t = kvt_node_timeout_ms(nd);
    assert_true(t > 0 && t <= 50);
    usleep(60000);
    assert_int_equal(kvt_node_timeout_ms(nd), 0); /* the tick's step is due */
    assert_int_equal(kvt_node_progress(nd), 0);   /* which takes it */
    t = kvt_node_timeout_ms(nd);
    assert_true(t > 0 && t <= 50);
    assert_int_equal(kvt_config_copy(&next, kvt_node_config(nd)), 0);
    next.loop_tick_ms = 400;
    assert_int_equal(kvt_node_reload(nd, &next), 0);
    kvt_config_free(&next);
    assert_int_equal(kvt_node_config(nd)->loop_tick_ms, 400);
    kvt_node_step(nd);
    t = kvt_node_timeout_ms(nd);
    assert_true(t > 50 && t <= 400);
    kvt_node_close(nd);
}

/* A peer dialling wakes the loop: the network tier's transport fd reaches the node's
 * fd through kvt_tier_event_fds (the loop knows no network tier). Both nodes then see
 * each other through nothing but their loops. */
static void test_peer_wakes_the_loop(void **state)
{
    uint64_t ida = next_id++, idb = next_id++;
    struct kvt_node *a = NULL, *b = NULL;
    struct kvt_tier *net;
    char peer[64];
    int fds[8];
    uint64_t end, live[4];

    (void)state;
    assert_int_equal(open_node(&a, ida, "storage.enabled=false", NULL), 0);
    net = kvt_node_tier(a, KVT_TIER_NETWORK);
    assert_int_equal(kvt_tier_event_fds(net, fds, KVT_ARRAY_SIZE(fds)), 2);
    assert_int_equal(kvt_tier_event_fds(net, fds, 1), 1); /* at most cap */
    settle(a, 100);
    snprintf(peer, sizeof(peer), "network.peers=127.0.0.1:%u", kvt_peers_port(kvt_node_peers(a)));
    assert_int_equal(open_node(&b, idb, "storage.enabled=false", peer, NULL), 0);
    end = kvt_now_ns() + 5000000000ull;
    while (!readable(kvt_node_fd(a), 0) && kvt_now_ns() < end) {
        kvt_node_progress(b); /* B dials A */
        usleep(1000);
    }
    assert_true(readable(kvt_node_fd(a), 0));
    end = kvt_now_ns() + 10000000000ull;
    while ((kvt_peers_live(kvt_node_peers(a), live, 4) < 2 ||
            kvt_peers_live(kvt_node_peers(b), live, 4) < 2) &&
           kvt_now_ns() < end) {
        struct pollfd p[2] = {{.fd = kvt_node_fd(a), .events = POLLIN},
                              {.fd = kvt_node_fd(b), .events = POLLIN}};

        poll(p, 2, KVT_MIN(kvt_node_timeout_ms(a), kvt_node_timeout_ms(b)));
        kvt_node_progress(a);
        kvt_node_progress(b);
    }
    assert_int_equal(kvt_peers_live(kvt_node_peers(a), live, 4), 2);
    assert_int_equal(kvt_peers_live(kvt_node_peers(b), live, 4), 2);
    kvt_node_close(b);
    kvt_node_close(a);
}

/* Stores n chunks (keys first..first+n-1) as an engine would. */
static void store(struct kvt_node *nd, uint32_t first, uint32_t n)
{
    struct kvt_manager *m = kvt_node_manager(nd);
    struct kvt_region *r = kvt_node_region(nd);
    struct kvt_store_output out;
    struct kvt_req_ctx *ctx;
    enum kvt_offload_policy pol;
    struct kvt_key keys[16];
    char rid[32];

    assert_true(n <= KVT_ARRAY_SIZE(keys));
    snprintf(rid, sizeof(rid), "store-%u", first);
    assert_int_equal(kvt_req_ctx_create(rid, NULL, &ctx), 0);
    assert_int_equal(kvt_manager_on_new_request(m, ctx, &pol), 0);
    for (uint32_t i = 0; i < n; i++) {
        uint32_t k = first + i;

        kvt_key_set(&keys[i], &k, sizeof(k));
    }
    kvt_store_output_init(&out);
    assert_int_equal(kvt_manager_prepare_store(m, keys, n, ctx, &out), 0);
    assert_int_equal(out.n_store, n);
    for (size_t i = 0; i < out.n_store; i++)
        memset(r->base + (size_t)out.chunk_ids[i] * ROW, (int)i + 1, ROW);
    kvt_manager_complete_store(m, out.keys_to_store, out.n_store, ctx, true);
    kvt_store_output_cleanup(&out);
    kvt_manager_on_request_finished(m, ctx);
    kvt_req_ctx_unref(ctx);
}

/* A storage job's end wakes the loop, which steps and reports it: the cascade of a
 * stored key to the storage tier is reported well before the 10 s tick with nothing
 * but the node's loop running (its fd polled, then progress), as a promotion a
 * peer's parked FETCH waits for is. Without the wake-up the loop sleeps to its tick. */
static void test_storage_job_wakes_the_loop(void **state)
{
    uint64_t id = next_id++, end;
    struct kvt_node *nd = NULL;
    struct kvt_manager *m;

    (void)state;
    assert_int_equal(open_node(&nd, id, "network.enabled=false", "loop.tick_ms=10000", NULL), 0);
    m = kvt_node_manager(nd);
    kvt_node_step(nd);
    store(nd, 300, 4);
    kvt_node_step(nd); /* the cascade: a store job on the storage tier */
    assert_true(kvt_manager_num_jobs(m) > 0);
    end = kvt_now_ns() + 2000000000ull;
    while (kvt_manager_num_jobs(m) > 0 && kvt_now_ns() < end) {
        struct pollfd p = {.fd = kvt_node_fd(nd), .events = POLLIN};

        poll(&p, 1, KVT_MIN(kvt_node_timeout_ms(nd), 2000));
        kvt_node_progress(nd);
    }
    assert_int_equal(kvt_manager_num_jobs(m), 0);
    /* Reported, the tier's fd is quiet again: the loop may sleep. */
    assert_false(readable(kvt_node_fd(nd), 50));
    assert_true(kvt_node_timeout_ms(nd) > 0);
    kvt_node_close(nd);
}

/* The storage tier's usage (files of a 4 KiB header and the row) under a bound and
 * without; the loop's hooks: one event fd (its I/O threads' wake-up, quiet while no
 * job ended), and the tier ops' defaults for poll and arm. */
static void test_storage_usage(void **state)
{
    uint64_t id = next_id++, file = 4096 + ROW, end;
    struct kvt_node *nd = NULL;
    struct kvt_tier *st;
    struct kvt_tier_usage u;
    int fds[4];

    (void)state;
    assert_int_equal(open_node(&nd, id, "network.enabled=false", "storage.capacity=64MiB", NULL),
                     0);
    st = kvt_node_tier(nd, KVT_TIER_STORAGE);
    assert_int_equal(kvt_tier_event_fds(st, fds, 4), 1);
    assert_false(readable(fds[0], 0));
    assert_int_equal(kvt_tier_poll(st), 0);
    assert_int_equal(kvt_tier_arm(st), 0);
    assert_int_equal(kvt_tier_usage(st, &u), 0);
    assert_int_equal(u.used_chunks, 0);
    assert_int_equal(u.used_bytes, 0);
    assert_int_equal(u.capacity_bytes, 64 << 20);
    assert_int_equal(u.capacity_chunks, (64 << 20) / file);
    store(nd, 100, 3);
    end = kvt_now_ns() + 10000000000ull;
    do {
        kvt_node_step(nd);
        usleep(2000);
        assert_int_equal(kvt_tier_usage(st, &u), 0);
    } while ((u.used_chunks != 3 || kvt_tier_has_pending_work(st)) && kvt_now_ns() < end);
    assert_int_equal(u.used_chunks, 3);
    assert_int_equal(u.used_bytes, 3 * file);
    kvt_node_close(nd);

    /* Unbounded: the capacity is what the file system holds for it, files included. */
    assert_int_equal(open_node(&nd, id, "network.enabled=false", "storage.capacity=0", NULL), 0);
    st = kvt_node_tier(nd, KVT_TIER_STORAGE);
    assert_int_equal(kvt_tier_usage(st, &u), 0);
    assert_int_equal(u.used_chunks, 3); /* found again at the restart */
    assert_true(u.capacity_bytes > u.used_bytes);
    assert_int_equal(u.capacity_chunks, u.capacity_bytes / file);
    kvt_node_close(nd);
}

/* Runs both nodes' loops (progress only: neither steps but at its tick) for ms. */
static void run_loops(struct kvt_node *a, struct kvt_node *b, int ms)
{
    uint64_t end = kvt_now_ns() + (uint64_t)ms * 1000000ull;

    do {
        struct pollfd p[2] = {{.fd = kvt_node_fd(a), .events = POLLIN},
                              {.fd = kvt_node_fd(b), .events = POLLIN}};

        poll(p, 2, KVT_MIN(KVT_MIN(kvt_node_timeout_ms(a), kvt_node_timeout_ms(b)), 2));
        kvt_node_progress(a);
        kvt_node_progress(b);
    } while (kvt_now_ns() < end);
}

/* A and B with 10 s ticks (the holder, A, has no engine to step it), linked; A
 * stores key k and publishes it to its home, and the PUBLISH gets there. */
static void two_nodes_one_published(struct kvt_node **a_p, struct kvt_node **b_p, uint32_t k)
{
    uint64_t ida = next_id++, idb = next_id++, live[4], end;
    struct kvt_node *a = NULL, *b = NULL;
    struct kvt_net_tier_counts c;
    char peer[64];

    assert_int_equal(open_node(&a, ida, "storage.enabled=false", "loop.tick_ms=10000", NULL), 0);
    snprintf(peer, sizeof(peer), "network.peers=127.0.0.1:%u", kvt_peers_port(kvt_node_peers(a)));
    assert_int_equal(open_node(&b, idb, "storage.enabled=false", "loop.tick_ms=10000", peer, NULL),
                     0);
    end = kvt_now_ns() + 10000000000ull;
    while ((kvt_peers_live(kvt_node_peers(a), live, 4) < 2 ||
            kvt_peers_live(kvt_node_peers(b), live, 4) < 2) &&
           kvt_now_ns() < end)
        run_loops(a, b, 5);
    assert_int_equal(kvt_peers_live(kvt_node_peers(b), live, 4), 2);
    store(a, k, 1);
    kvt_node_step(a); /* the cascade: A publishes the key to its home */
    end = kvt_now_ns() + 5000000000ull;
    do {
        run_loops(a, b, 5);
        kvt_net_tier_counts(kvt_node_tier(a, KVT_TIER_NETWORK), &c);
    } while (c.published_keys < 1 && kvt_now_ns() < end);
    assert_int_equal(c.published_keys, 1);
    run_loops(a, b, 100); /* the PUBLISH reaches the home */
    *a_p = a;
    *b_p = b;
}

/* One lookup of key by B's engine in *ctx_p, a request of its own made first when
 * there is none (named pull-<seq>); a MISS (the home had not heard yet) ends that
 * request, so the next call asks again in a new one. */
static enum kvt_lookup_result pull_lookup(struct kvt_manager *m, const struct kvt_key *key,
                                          struct kvt_req_ctx **ctx_p, unsigned *seq)
{
    enum kvt_offload_policy pol;
    enum kvt_lookup_result r;
    char rid[32];

    if (*ctx_p == NULL) {
        snprintf(rid, sizeof(rid), "pull-%u", (*seq)++);
        assert_int_equal(kvt_req_ctx_create(rid, NULL, ctx_p), 0);
        assert_int_equal(kvt_manager_on_new_request(m, *ctx_p, &pol), 0);
    }
    r = kvt_manager_lookup(m, key, *ctx_p);
    if (r == KVT_MISS) {
        kvt_manager_on_request_finished(m, *ctx_p);
        kvt_req_ctx_unref(*ctx_p);
        *ctx_p = NULL;
    }
    return r;
}

/* A peer's FETCH is served when it arrives, not at the holder's next tick: the
 * holder's loop steps (its serving loop runs) as soon as a FETCH is parked, and the
 * puller's as soon as its load ended. Both ticks are 10 s here and the holder has no
 * engine to step it; the pull takes well under a second. */
static void test_fetch_served_before_the_tick(void **state)
{
    uint64_t end, t0 = 0;
    struct kvt_node *a = NULL, *b = NULL;
    struct kvt_manager *m;
    struct kvt_req_ctx *ctx = NULL;
    enum kvt_lookup_result r = KVT_MISS;
    struct kvt_key key;
    uint32_t k = 200;
    unsigned seq = 0;

    (void)state;
    two_nodes_one_published(&a, &b, k);

    /* B's engine: look up, end the step, until HIT (a MISS: the home had not heard
     * yet, ask again in a new request). */
    m = kvt_node_manager(b);
    kvt_key_set(&key, &k, sizeof(k));
    end = kvt_now_ns() + 5000000000ull;
    while (r != KVT_HIT && kvt_now_ns() < end) {
        r = pull_lookup(m, &key, &ctx, &seq);
        if (r == KVT_HIT_PENDING && t0 == 0)
            t0 = kvt_now_ns();
        kvt_manager_on_schedule_end(m, NULL);
        run_loops(a, b, 1);
    }
    assert_int_equal(r, KVT_HIT);
    assert_true(t0 != 0);
    /* Without the steps on news the holder would GRANT at its tick, 10 s later. */
    assert_true(kvt_now_ns() - t0 < 2000000000ull);
    /* B's RELEASE ends A's lease: its store job (the rows it pinned) is reported, and
     * A's loop may sleep again, at once rather than at A's tick (until then the tier
     * would not arm, with a job to report: the loop would spin for 10 s). */
    end = kvt_now_ns() + 2000000000ull;
    do
        run_loops(a, b, 5);
    while ((kvt_manager_num_jobs(kvt_node_manager(a)) > 0 || kvt_node_timeout_ms(a) == 0) &&
           kvt_now_ns() < end);
    assert_int_equal(kvt_manager_num_jobs(kvt_node_manager(a)), 0);
    assert_true(kvt_node_timeout_ms(a) > 0);
    kvt_manager_on_request_finished(m, ctx);
    kvt_req_ctx_unref(ctx);
    kvt_node_close(b);
    kvt_node_close(a);
}

/* One turn of both loops; A's engine (a_ctx not NULL) first looks a key up, as an
 * engine does in its step before that step's end reaches the node. */
static void turn(struct kvt_node *a, struct kvt_node *b, struct kvt_req_ctx *a_ctx,
                 const struct kvt_key *a_key)
{
    struct pollfd p[2] = {{.fd = kvt_node_fd(a), .events = POLLIN},
                          {.fd = kvt_node_fd(b), .events = POLLIN}};

    if (a_ctx != NULL)
        assert_int_equal(kvt_manager_lookup(kvt_node_manager(a), a_key, a_ctx), KVT_HIT);
    poll(p, 2, KVT_MIN(KVT_MIN(kvt_node_timeout_ms(a), kvt_node_timeout_ms(b)), 2));
    kvt_node_progress(a);
    kvt_node_progress(b);
}

/* A peer's RELEASE ends its lease's store job, and the holder's loop steps at once
 * (the manager hears of the job and unpins its rows) and may sleep again, instead of
 * polling until its tick with the job unreported (the tier does not arm while a job
 * waits to be reported). A loop that polls is a busy process to the scheduler of a
 * loaded host: a peer's next message waited for a turn on a core instead of waking
 * it, and did so for as long as the tick. Both ticks are 10 s here. */
static void release_then_sleep(bool a_looks_up)
{
    uint64_t end, t0;
    struct kvt_node *a = NULL, *b = NULL;
    struct kvt_net_tier_counts c;
    struct kvt_manager *m;
    struct kvt_req_ctx *ctx = NULL;
    enum kvt_offload_policy pol;
    enum kvt_lookup_result r = KVT_MISS;
    struct kvt_key key;
    uint32_t k = 300;
    unsigned seq = 0;
    int wait_ms = 0;
    struct kvt_req_ctx *actx = NULL;

    two_nodes_one_published(&a, &b, k);

    m = kvt_node_manager(b);
    kvt_key_set(&key, &k, sizeof(k));
    if (a_looks_up) {
        assert_int_equal(kvt_req_ctx_create("a-engine", NULL, &actx), 0);
        assert_int_equal(kvt_manager_on_new_request(kvt_node_manager(a), actx, &pol), 0);
    }
    end = kvt_now_ns() + 5000000000ull;
    while (r != KVT_HIT && kvt_now_ns() < end) {
        r = pull_lookup(m, &key, &ctx, &seq);
        kvt_manager_on_schedule_end(m, NULL);
        /* Until A's lease ended, A's engine (if any) looks a key up before each turn
         * and never ends its step: the manager takes finished jobs once a step, at
         * such a lookup, so the step the RELEASE brings does not report the lease's
         * job. Then the engine is quiet. */
        for (uint64_t t1 = kvt_now_ns(); kvt_now_ns() - t1 < 1000000ull;) {
            kvt_net_tier_counts(kvt_node_tier(a, KVT_TIER_NETWORK), &c);
            turn(a, b, c.served_fetches == 0 || c.active_leases > 0 ? actx : NULL, &key);
        }
    }
    assert_int_equal(r, KVT_HIT);
    kvt_net_tier_counts(kvt_node_tier(a, KVT_TIER_NETWORK), &c);
    assert_true(c.served_fetches >= 1);

    /* B's RELEASE reaches A: its lease ends. */
    end = kvt_now_ns() + 5000000000ull;
    while (c.active_leases > 0 && kvt_now_ns() < end) {
        turn(a, b, actx, &key);
        kvt_net_tier_counts(kvt_node_tier(a, KVT_TIER_NETWORK), &c);
    }
    assert_int_equal(c.active_leases, 0);
    /* Then A's loop may sleep (on its events, until its tick) well before that tick,
     * its engine quiet from now on. */
    t0 = kvt_now_ns();
    end = t0 + 2000000000ull;
    while ((wait_ms = kvt_node_timeout_ms(a)) == 0 && kvt_now_ns() < end)
        run_loops(a, b, 1);
    assert_true(wait_ms > 0);
    assert_true(kvt_now_ns() - t0 < 2000000000ull);
    if (actx != NULL) {
        kvt_manager_on_request_finished(kvt_node_manager(a), actx);
        kvt_req_ctx_unref(actx);
    }
    kvt_manager_on_request_finished(m, ctx);
    kvt_req_ctx_unref(ctx);
    kvt_node_close(b);
    kvt_node_close(a);
}

static void test_release_lets_the_holder_sleep(void **state)
{
    (void)state;
    release_then_sleep(false);
}

/* The same with the holder's engine in a step (its lookups made, its end not yet
 * sent) when the RELEASE arrives. */
static void test_release_lets_the_holder_sleep_mid_step(void **state)
{
    (void)state;
    release_then_sleep(true);
}

/* The network tier keeps no chunks of its own: no usage. */
static void test_network_usage_unsupported(void **state)
{
    uint64_t id = next_id++;
    struct kvt_node *nd = NULL;
    struct kvt_tier_usage u;

    (void)state;
    assert_int_equal(open_node(&nd, id, "storage.enabled=false", NULL), 0);
    assert_int_equal(kvt_tier_usage(kvt_node_tier(nd, KVT_TIER_NETWORK), &u), -EOPNOTSUPP);
    kvt_node_close(nd);
}

static bool has_line(const char *text, const char *line)
{
    size_t n = strlen(line);

    for (const char *p = strstr(text, line); p != NULL; p = strstr(p + 1, line))
        if ((p == text || p[-1] == '\n') && (p[n] == '\n' || p[n] == '\0'))
            return true;
    return false;
}

/* The page's value of one series (its name and labels as printed); -1 when absent. */
static double series_value(const char *text, const char *series)
{
    size_t n = strlen(series);

    for (const char *p = strstr(text, series); p != NULL; p = strstr(p + 1, series))
        if ((p == text || p[-1] == '\n') && p[n] == ' ')
            return strtod(p + n + 1, NULL);
    return -1;
}

/* The node's own series: its build, this process, how full each tier is (the primary
 * and the storage tier; the network tier keeps nothing). */
static void test_metrics_page(void **state)
{
    uint64_t id = next_id++, file = 4096 + ROW, end;
    struct kvt_node *nd = NULL;
    struct kvt_tier_usage u;
    char *text = NULL, want[256];
    size_t len = 0;

    (void)state;
    assert_int_equal(open_node(&nd, id, "storage.capacity=16MiB", NULL), 0);
    store(nd, 200, 5);
    end = kvt_now_ns() + 10000000000ull;
    do {
        kvt_node_step(nd);
        usleep(2000);
        assert_int_equal(kvt_tier_usage(kvt_node_tier(nd, KVT_TIER_STORAGE), &u), 0);
    } while (u.used_chunks != 5 && kvt_now_ns() < end);
    assert_int_equal(kvt_node_render_metrics(nd, &text, &len), 0);
    assert_int_equal(strlen(text), len);
    snprintf(want, sizeof(want), "kvtier_build_info{version=\"%s\",revision=\"%s\"} 1",
             kvt_version(), kvt_git_revision());
    assert_true(has_line(text, want));
    assert_true(series_value(text, "process_cpu_seconds_total") > 0);
    assert_true(series_value(text, "process_resident_memory_bytes") > 0);
    assert_true(series_value(text, "process_open_fds") > 0);
    assert_true(series_value(text, "process_max_fds") >= series_value(text, "process_open_fds"));
    assert_true(series_value(text, "process_start_time_seconds") > 1e9);
    assert_true(series_value(text, "kvtier_tier_used_chunks{tier=\"0:primary\"}") == 5);
    assert_true(series_value(text, "kvtier_tier_capacity_chunks{tier=\"0:primary\"}") == 16);
    assert_true(series_value(text, "kvtier_tier_used_bytes{tier=\"0:primary\"}") == 5.0 * ROW);
    assert_true(series_value(text, "kvtier_tier_capacity_bytes{tier=\"0:primary\"}") == 4 << 20);
    assert_true(series_value(text, "kvtier_tier_used_chunks{tier=\"1:storage\"}") == 5);
    assert_true(series_value(text, "kvtier_tier_capacity_chunks{tier=\"1:storage\"}") ==
                (double)((16 << 20) / file));
    assert_true(series_value(text, "kvtier_tier_used_bytes{tier=\"1:storage\"}") ==
                5.0 * (double)file);
    assert_true(series_value(text, "kvtier_tier_capacity_bytes{tier=\"1:storage\"}") == 16 << 20);
    assert_true(series_value(text, "kvtier_tier_used_chunks{tier=\"2:network\"}") == -1);
    assert_true(series_value(text, "kvtier_tier_capacity_bytes{tier=\"2:network\"}") == -1);
    assert_true(series_value(text, "vllm:kv_offload_tiering_active_cascade_jobs"
                                   "{tier=\"2:network\"}") >= 0); /* the label is the same */
    assert_true(has_line(text, "# TYPE kvtier_tier_used_chunks gauge"));
    assert_true(has_line(text, "# TYPE process_cpu_seconds_total counter"));
    kvt_free(text);
    kvt_node_close(nd);
}

static uint64_t cpu_ns(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* /proc/self as the page shows it: descriptors and CPU time follow what the process
 * does; the start time is this process's; the limit is RLIMIT_NOFILE's. */
static void test_proc_stats(void **state)
{
    struct kvt_proc_stats a, b;
    struct rlimit rl;
    volatile uint64_t x = 0;
    uint64_t end;
    int fd;

    (void)state;
    assert_int_equal(kvt_proc_stats_read(&a), 0);
    fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
    assert_true(fd >= 0);
    end = cpu_ns() + 300000000ull;
    while (cpu_ns() < end) /* 0.3 s of CPU, however loaded the host */
        x++;
    assert_int_equal(kvt_proc_stats_read(&b), 0);
    close(fd);
    assert_int_equal(b.open_fds, a.open_fds + 1);
    assert_true(b.cpu_seconds >= a.cpu_seconds + 0.25); /* ticks of 10 ms */
    assert_true(b.resident_bytes > 0);
    assert_int_equal(getrlimit(RLIMIT_NOFILE, &rl), 0);
    assert_int_equal(b.max_fds, rl.rlim_cur);
    assert_true(a.start_time_s == b.start_time_s);
    assert_true(b.start_time_s <= (double)time(NULL) + 1);
    assert_true(b.start_time_s >= (double)time(NULL) - 600); /* this test started it */
}

static int rm_one(const char *path, const struct stat *st, int flag, struct FTW *ftw)
{
    (void)st;
    (void)flag;
    (void)ftw;
    chmod(path, 0700);
    remove(path);
    return 0;
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_open_and_stop),
        cmocka_unit_test(test_tier_order_and_disabled),
        cmocka_unit_test(test_refuses_unsafe_folder),
        cmocka_unit_test(test_timeout_follows_tick),
        cmocka_unit_test(test_peer_wakes_the_loop),
        cmocka_unit_test(test_storage_usage),
        cmocka_unit_test(test_storage_job_wakes_the_loop),
        cmocka_unit_test(test_network_usage_unsupported),
        cmocka_unit_test(test_fetch_served_before_the_tick),
        cmocka_unit_test(test_release_lets_the_holder_sleep),
        cmocka_unit_test(test_release_lets_the_holder_sleep_mid_step),
        cmocka_unit_test(test_metrics_page),
        cmocka_unit_test(test_proc_stats),
    };
    int fd, rc;

    setenv("UCX_TLS", "tcp", 0); /* loopback, as the conformance suite runs it */
    setenv("UCX_NET_DEVICES", "lo", 0);
    if (getenv("KVT_LOG") == NULL)
        kvt_log_set_level(KVT_LOG_WARN);
    tmp = kt_tmpdir("node");
    snprintf(shm, sizeof(shm), "/dev/shm/kvt-test-node.%d", (int)getpid());
    snprintf(secret, sizeof(secret), "%s/secret", tmp);
    if (tmp == NULL || mkdir(shm, 0700) != 0)
        return 1;
    fd = open(secret, O_WRONLY | O_CREAT | O_EXCL, 0600);
    if (fd < 0 || write(fd, "test-node secret 0123456789abcdef\n", 34) != 34)
        return 1;
    close(fd);
    rc = cmocka_run_group_tests(tests, NULL, NULL);
    nftw(shm, rm_one, 16, FTW_DEPTH | FTW_PHYS);
    nftw(tmp, rm_one, 16, FTW_DEPTH | FTW_PHYS);
    free(tmp);
    return rc;
}

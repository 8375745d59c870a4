/* SPDX-License-Identifier: Apache-2.0 */
/* Clusters of kvtier-simnode processes on loopback (issue #5's scenarios). Each test
 * starts its own nodes, drives them through their command lines, and prints the
 * figures it measured. The transport is UCX unless KVT_CLUSTER_BACKEND says
 * otherwise. Usage: test_cluster <path of kvtier-simnode>.
 *
 * The nodes are kvtierd's (kvtier-simnode opens them as kvtierd does) with kvtierd's
 * defaults, except for what one configuration file, written by setup(), and each
 * node's --set arguments say: see NODE_CONFIG and the tests' own sets (the lease
 * TTL of test_kill_requester_with_leases, the rows and primary sizes). */
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <inttypes.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "test_util.h"

static const char *simnode;
static pid_t spawned[64]; /* every node a test started, killed by its teardown */
static size_t n_spawned;
static char *tmp;
static char good_secret[512], bad_secret[512], node_config[512], shm_dir[256];

/* What every node runs with beside kvtierd's defaults: its runtime folder on /dev/shm
 * (the region, lock and engine socket of node <id>, which a restarted node finds
 * again), 1024 chunks of 64 KiB, no storage tier (these are the network tier's
 * tests) and no /metrics (several nodes on one host). */
#define NODE_CONFIG                                                                                \
    "primary:\n"                                                                                   \
    "  path: %s/{id}/primary.mmap\n"                                                               \
    "  size: 64MiB\n"                                                                              \
    "  row_bytes: 64KiB\n"                                                                         \
    "engine:\n"                                                                                    \
    "  socket: %s/{id}/engine.sock\n"                                                              \
    "storage:\n"                                                                                   \
    "  enabled: false\n"                                                                           \
    "metrics:\n"                                                                                   \
    "  port: 0\n"

struct sn {
    pid_t pid;
    FILE *in;
    int out_fd;
    char buf[8192];
    size_t len;
    unsigned port;
    uint64_t id;
    char last[1024];
};

static uint64_t now_ms(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

/* Next line from the node, within ms; false on timeout or EOF. */
static bool sn_line(struct sn *s, char *line, size_t cap, unsigned ms)
{
    uint64_t end = now_ms() + ms;

    for (;;) {
        char *nl = memchr(s->buf, '\n', s->len);

        if (nl != NULL) {
            size_t n = (size_t)(nl - s->buf);
            size_t c = n < cap - 1 ? n : cap - 1;

            memcpy(line, s->buf, c);
            line[c] = '\0';
            memmove(s->buf, nl + 1, s->len - n - 1);
            s->len -= n + 1;
            return true;
        }
        uint64_t now = now_ms();
        if (now >= end)
            return false;
        struct pollfd p = {.fd = s->out_fd, .events = POLLIN};
        if (poll(&p, 1, (int)(end - now)) <= 0)
            continue;
        ssize_t r = read(s->out_fd, s->buf + s->len, sizeof(s->buf) - s->len - 1);
        if (r <= 0)
            return false;
        s->len += (size_t)r;
    }
}

/* Starts node id on port (0: any) with that secret file and namespace; the rest of
 * the arguments, up to a NULL, are configuration keys ("key=value") for --set. */
/* How long a node may take to say it is ready: creating and touching its primary
 * region is most of it, so a test with a large one allows more (on a loaded host, a
 * 4 GiB region under ASan took more than 20 s beside the soft-RoCE guests). */
static unsigned start_ms = 20000;

static void sn_start(struct sn *s, uint64_t id, unsigned port, const char *secret, const char *ns,
                     ...)
{
    int in[2], out[2];
    char *argv[64];
    char sets[6][600], line[256];
    int argc = 0, n_sets = 0;
    va_list ap;
    const char *a;

    memset(s, 0, sizeof(*s));
    assert_int_equal(pipe2(in, O_CLOEXEC), 0); /* other nodes must not inherit them */
    assert_int_equal(pipe2(out, O_CLOEXEC), 0);
    snprintf(sets[n_sets++], sizeof(sets[0]), "node.id=%" PRIu64, id);
    snprintf(sets[n_sets++], sizeof(sets[0]), "network.port=%u", port);
    snprintf(sets[n_sets++], sizeof(sets[0]), "cluster.secret_file=%s", secret);
    snprintf(sets[n_sets++], sizeof(sets[0]), "node.namespace=%s", ns);
    if (getenv("KVT_CLUSTER_BACKEND") != NULL)
        snprintf(sets[n_sets++], sizeof(sets[0]), "network.transport=%s",
                 getenv("KVT_CLUSTER_BACKEND"));
    argv[argc++] = (char *)simnode;
    argv[argc++] = "--config";
    argv[argc++] = node_config;
    for (int i = 0; i < n_sets; i++) {
        argv[argc++] = "--set";
        argv[argc++] = sets[i];
    }
    va_start(ap, ns);
    for (a = va_arg(ap, const char *); a != NULL && argc < 60; a = va_arg(ap, const char *)) {
        argv[argc++] = "--set";
        argv[argc++] = (char *)a;
    }
    va_end(ap);
    argv[argc] = NULL;
    s->pid = fork();
    assert_true(s->pid >= 0);
    if (s->pid == 0) {
        dup2(in[0], 0);
        dup2(out[1], 1);
        close(in[1]);
        close(out[0]);
        execv(simnode, argv);
        _exit(127);
    }
    close(in[0]);
    close(out[1]);
    if (n_spawned < 64)
        spawned[n_spawned++] = s->pid;
    s->in = fdopen(in[1], "w");
    s->out_fd = out[0];
    s->id = id;
    if (!sn_line(s, line, sizeof(line), start_ms))
        fail_msg("node %" PRIu64 " did not start within %u ms", id, start_ms);
    assert_int_equal(sscanf(line, "ready id=%*x port=%u", &s->port), 1);
}

/* Sends a command and returns its answer line ("ok ..."); fails the test on "err"
 * unless allow_err. Progress lines go to on_progress when given. */
static const char *sn_cmd_ex(struct sn *s, unsigned ms, bool allow_err,
                             bool (*on_progress)(void *, const char *), void *arg, const char *fmt,
                             ...)
{
    va_list ap;

    va_start(ap, fmt);
    vfprintf(s->in, fmt, ap);
    va_end(ap);
    fputc('\n', s->in);
    fflush(s->in);
    for (;;) {
        if (!sn_line(s, s->last, sizeof(s->last), ms))
            fail_msg("node %" PRIu64 ": no answer to '%s'", s->id, fmt);
        if (strncmp(s->last, "progress", 8) == 0) {
            if (on_progress != NULL)
                on_progress(arg, s->last);
            continue;
        }
        break;
    }
    if (!allow_err && strncmp(s->last, "ok", 2) != 0)
        fail_msg("node %" PRIu64 ": '%s' answered '%s'", s->id, fmt, s->last);
    return s->last;
}

#define sn_cmd(s, ms, ...) sn_cmd_ex((s), (ms), false, NULL, NULL, __VA_ARGS__)

static uint64_t field(const char *line, const char *name)
{
    char pat[64];
    const char *p;

    snprintf(pat, sizeof(pat), " %s=", name);
    p = strstr(line, pat);
    if (p == NULL)
        fail_msg("no field %s in '%s'", name, line);
    return strtoull(p + strlen(pat), NULL, 10);
}

static void sn_kill(struct sn *s)
{
    int st;

    if (s->pid <= 0)
        return;
    kill(s->pid, SIGKILL);
    waitpid(s->pid, &st, 0);
    fclose(s->in);
    close(s->out_fd);
    s->pid = 0;
}

/* Orderly stop: "quit", exit 0 within 10 s. */
static void sn_quit(struct sn *s)
{
    int st = 0;
    uint64_t end = now_ms() + 10000;
    pid_t r = 0;

    if (s->pid <= 0)
        return;
    fprintf(s->in, "quit\n");
    fflush(s->in);
    while ((r = waitpid(s->pid, &st, WNOHANG)) == 0 && now_ms() < end)
        usleep(10000);
    if (r == 0) {
        sn_kill(s);
        fail_msg("node %" PRIu64 " did not stop within 10 s", s->id);
    }
    fclose(s->in);
    close(s->out_fd);
    s->pid = 0;
    assert_true(WIFEXITED(st));
    assert_int_equal(WEXITSTATUS(st), 0);
}

/* The key that makes a node dial s: "network.peers=127.0.0.1:<port>" (in buf). */
static const char *peer_of(const struct sn *s, char *buf, size_t len)
{
    snprintf(buf, len, "network.peers=127.0.0.1:%u", s->port);
    return buf;
}

/* A, B, C, each with the keys set1 and set2 (NULL: none): B and C join through A;
 * all see three live members. */
static void start3(struct sn *n, const char *set1, const char *set2)
{
    char seed[64];

    sn_start(&n[0], 1, 0, good_secret, "ns", set1, set2, NULL);
    peer_of(&n[0], seed, sizeof(seed));
    sn_start(&n[1], 2, 0, good_secret, "ns", seed, set1, set2, NULL);
    sn_start(&n[2], 3, 0, good_secret, "ns", seed, set1, set2, NULL);
    for (int i = 0; i < 3; i++)
        sn_cmd(&n[i], 15000, "wait-live 3 10000");
}

static void stop3(struct sn *n)
{
    for (int i = 0; i < 3; i++)
        sn_quit(&n[i]);
}

/* A stores 1000 chunks; B looks them up: RETRY, then HIT_PENDING, then HIT; every
 * byte equals A's. */
static void test_pull_1000(void **state)
{
    struct sn n[3];
    const char *r;

    (void)state;
    start3(n, NULL, NULL);
    r = sn_cmd(&n[0], 30000, "store 1 0 1000");
    assert_int_equal(field(r, "stored"), 1000);
    r = sn_cmd(&n[1], 60000, "load 1 0 1000 30000");
    printf("# pull 1000 x 64 KiB: %s\n", r);
    assert_int_equal(field(r, "hit"), 1000);
    assert_int_equal(field(r, "corrupt"), 0);
    assert_true(field(r, "retry") > 0);
    assert_true(field(r, "pending") > 0);
    r = sn_cmd(&n[0], 5000, "counts");
    assert_true(field(r, "served") >= 1000);
    r = sn_cmd(&n[1], 5000, "counts");
    assert_int_equal(field(r, "pulled"), 1000);
    assert_int_equal(field(r, "checksum_fail"), 0);
    /* Loaded once, now local: a second load needs no peer. */
    r = sn_cmd(&n[1], 30000, "load 1 0 1000 10000");
    assert_int_equal(field(r, "hit"), 1000);
    r = sn_cmd(&n[1], 5000, "counts");
    assert_int_equal(field(r, "pulled"), 1000);
    /* C pulls them as the bench does (engine requests of 32 keys, 4 in flight, the
     * bytes checked on the simulator's checker thread), from A or B. */
    r = sn_cmd(&n[2], 60000, "pull 1 0 1000 30000 32 4");
    printf("# pull as requests: %s\n", r);
    assert_int_equal(field(r, "hit"), 1000);
    assert_int_equal(field(r, "corrupt"), 0);
    assert_int_equal(field(r, "requests"), 32);
    r = sn_cmd(&n[2], 5000, "counts");
    assert_int_equal(field(r, "pulled"), 1000);
    assert_int_equal(field(r, "checksum_fail"), 0);
    stop3(n);
}

/* A evicts some: lookups of those become MISS, the rest still pull. */
static void test_evicted_become_miss(void **state)
{
    struct sn n[3];
    const char *r;

    (void)state;
    start3(n, "primary.size=64000KiB", NULL); /* 1000 chunks */
    sn_cmd(&n[0], 30000, "store 2 0 1000");
    /* 300 more: LRU evicts the first 300 (nothing touched them). */
    r = sn_cmd(&n[0], 30000, "store 2 1000 300");
    assert_int_equal(field(r, "stored"), 300);
    sn_cmd(&n[0], 5000, "step 200"); /* unpublishes go out */
    r = sn_cmd(&n[2], 60000, "load 2 0 1000 30000");
    printf("# after 300 evictions: %s\n", r);
    assert_int_equal(field(r, "miss"), 300);
    assert_int_equal(field(r, "hit"), 700);
    assert_int_equal(field(r, "corrupt"), 0);
    stop3(n);
}

/* The home of keys dies: records move, lookups recover after re-publication. */
static void test_home_dies(void **state)
{
    struct sn n[3];
    const char *r;
    uint64_t t0;

    (void)state;
    start3(n, NULL, NULL);
    sn_cmd(&n[0], 30000, "store 3 0 600");
    sn_kill(&n[2]); /* C was the home of about a third of them */
    t0 = now_ms();
    sn_cmd(&n[0], 15000, "wait-live 2 10000 1 2");
    sn_cmd(&n[1], 15000, "wait-live 2 10000 1 2");
    sn_cmd(&n[0], 5000, "step 300"); /* re-publication */
    r = sn_cmd(&n[1], 60000, "load 3 0 600 30000");
    printf("# home died: recovered in %" PRIu64 " ms: %s\n", now_ms() - t0, r);
    assert_int_equal(field(r, "hit"), 600);
    assert_int_equal(field(r, "corrupt"), 0);
    sn_quit(&n[0]);
    sn_quit(&n[1]);
}

struct kill_when {
    struct sn *victim; /* SIGKILLed when the load pauses */
    struct sn *loader; /* the node whose "load ... pause" it is; told to continue */
    bool killed;
    uint64_t at_ms;
};

/* The load paused at its first GRANT (leases held, at most fetches_per_peer FETCHes
 * granted, the rest not yet sent): the victim dies there, then the load goes on.
 * A fixed point, not a race against a pull that may end first. */
static bool kill_on_pause(void *arg, const char *line)
{
    struct kill_when *k = arg;

    if (k->killed || strncmp(line, "progress paused ", 16) != 0)
        return true;
    kill(k->victim->pid, SIGKILL);
    waitpid(k->victim->pid, NULL, 0);
    k->killed = true;
    k->at_ms = now_ms();
    if (k->loader != k->victim) {
        fprintf(k->loader->in, "continue\n");
        fflush(k->loader->in);
    }
    return true;
}

/* SIGKILL of A during pulls: B's jobs fail within the deadline, no corrupt chunk,
 * B keeps serving; A restarts with a new incarnation and serves again. */
static void test_kill_holder_mid_pull(void **state)
{
    struct sn n[3];
    struct kill_when k = {0};
    const char *r;
    char seed[64];
    unsigned a_port;
    uint64_t hit, t_end;

    (void)state;
    start3(n, "primary.row_bytes=256KiB", "primary.size=256MiB");
    sn_cmd(&n[0], 60000, "store 4 0 1000");
    k.victim = &n[0];
    k.loader = &n[1];
    r = sn_cmd_ex(&n[1], 60000, false, kill_on_pause, &k, "load 4 0 1000 20000 pause");
    t_end = now_ms();
    assert_true(k.killed);
    hit = field(r, "hit");
    printf("# holder killed mid-pull: B ended %" PRIu64 " ms after the kill: %s\n", t_end - k.at_ms,
           r);
    assert_int_equal(field(r, "corrupt"), 0);
    /* at most 4 FETCHes of 64 keys were granted before the kill */
    assert_true(hit <= 256);
    assert_true(t_end - k.at_ms < 15000); /* fetch timeout + heartbeat bound, not a figure */
    a_port = n[0].port;
    fclose(n[0].in);
    close(n[0].out_fd);
    n[0].pid = 0;
    /* B keeps serving C. */
    sn_cmd(&n[1], 30000, "store 5 0 100");
    r = sn_cmd(&n[2], 60000, "load 5 0 100 20000");
    assert_int_equal(field(r, "hit"), 100);
    /* A comes back on its port with a new incarnation and serves again. */
    sn_start(&n[0], 1, a_port, good_secret, "ns", "primary.row_bytes=256KiB", "primary.size=256MiB",
             peer_of(&n[1], seed, sizeof(seed)), NULL);
    sn_cmd(&n[0], 15000, "wait-live 3 10000");
    sn_cmd(&n[2], 15000, "wait-live 3 10000");
    sn_cmd(&n[0], 60000, "store 6 0 200");
    r = sn_cmd(&n[2], 60000, "load 6 0 200 20000");
    assert_int_equal(field(r, "hit"), 200);
    assert_int_equal(field(r, "corrupt"), 0);
    stop3(n);
}

/* SIGKILL of B while it holds leases: A's pins are released within TTL + 1 s. */
static void test_kill_requester_with_leases(void **state)
{
    struct sn n[3];
    struct kill_when k = {0};
    const char *r = "";
    char seed[64];
    uint64_t t0, leases = 1;

    (void)state;
    /* A 2 s lease (kvtierd's is 10 s): the bound below is the lease TTL + 1 s. */
    sn_start(&n[0], 1, 0, good_secret, "ns", "primary.row_bytes=256KiB", "primary.size=256MiB",
             "network.lease_ms=2000", NULL);
    sn_start(&n[1], 2, 0, good_secret, "ns", "primary.row_bytes=256KiB", "primary.size=256MiB",
             "network.lease_ms=2000", peer_of(&n[0], seed, sizeof(seed)), NULL);
    sn_start(&n[2], 3, 0, good_secret, "ns", "primary.row_bytes=256KiB", "primary.size=256MiB",
             "network.lease_ms=2000", seed, NULL);
    for (int i = 0; i < 3; i++)
        sn_cmd(&n[i], 15000, "wait-live 3 10000");
    sn_cmd(&n[0], 60000, "store 7 0 1000");
    k.victim = &n[1];
    k.loader = &n[1];
    fprintf(n[1].in, "load 7 0 1000 20000 pause\n");
    fflush(n[1].in);
    {
        char line[512];

        while (sn_line(&n[1], line, sizeof(line), 20000)) {
            if (strncmp(line, "progress paused ", 16) == 0) {
                /* B holds A's leases now and cannot RELEASE them */
                r = sn_cmd(&n[0], 5000, "counts");
                assert_true(field(r, "leases") > 0);
            }
            kill_on_pause(&k, line);
            if (k.killed)
                break;
        }
    }
    assert_true(k.killed);
    t0 = k.at_ms;
    fclose(n[1].in);
    close(n[1].out_fd);
    n[1].pid = 0;
    while (now_ms() - t0 < 2000 + 1000) { /* network.lease_ms=2000 above */
        r = sn_cmd(&n[0], 5000, "counts");
        leases = field(r, "leases");
        if (leases == 0)
            break;
        usleep(20000);
    }
    printf("# requester killed: holder's leases at 0 after %" PRIu64 " ms: %s\n", now_ms() - t0, r);
    assert_int_equal(leases, 0);
    sn_quit(&n[0]);
    sn_quit(&n[2]);
}

/* A rewrites slots while B reads them (each row between rewrite_begin and _end):
 * under network.verify (mode) B refuses every rewritten row, by its fence or by its
 * checksum, and accepts none: no corrupt chunk, no hit. direct: every node in
 * network.fetch direct, and B first pulls one other key (its FETCH brings A's
 * handles), so the torn rows are READ straight from A's primary, no lease. */
static void torn_reads(const char *mode, bool direct)
{
    struct sn n[3];
    const char *r;
    char verify[64];
    const char *fetch = direct ? "network.fetch=direct" : "network.fetch=lease";
    uint64_t fails = 0, corrupt = 0, hits = 0, rounds = 0, fetches0 = 0;
    bool fence = strcmp(mode, "fence") == 0;

    snprintf(verify, sizeof(verify), "network.verify=%s", mode);
    sn_start(&n[0], 1, 0, good_secret, "ns", "primary.row_bytes=256KiB", "primary.size=256MiB",
             verify, fetch, NULL);
    {
        char seed[64];

        peer_of(&n[0], seed, sizeof(seed));
        sn_start(&n[1], 2, 0, good_secret, "ns", seed, "primary.row_bytes=256KiB",
                 "primary.size=256MiB", verify, fetch, NULL);
        sn_start(&n[2], 3, 0, good_secret, "ns", seed, "primary.row_bytes=256KiB",
                 "primary.size=256MiB", verify, fetch, NULL);
        for (int i = 0; i < 3; i++)
            sn_cmd(&n[i], 15000, "wait-live 3 10000");
    }
    sn_cmd(&n[0], 60000, "store 8 0 300");
    if (direct) {
        sn_cmd(&n[0], 60000, "store 8 300 1");
        r = sn_cmd(&n[1], 60000, "load 8 300 1 20000");
        assert_int_equal(field(r, "hit"), 1);
        r = sn_cmd(&n[1], 5000, "counts");
        fetches0 = field(r, "fetches");
    }
    /* A scribbles for 3 s; B loads meanwhile (the two run in parallel). */
    fprintf(n[0].in, "rewrite 8 0 300 3000\n");
    fflush(n[0].in);
    r = sn_cmd(&n[1], 60000, "load 8 0 300 20000");
    printf("# torn reads (%s): %s\n", mode, r);
    corrupt = field(r, "corrupt");
    hits = field(r, "hit");
    {
        char line[256];

        assert_true(sn_line(&n[0], line, sizeof(line), 20000));
        rounds = field(line, "rounds");
    }
    r = sn_cmd(&n[1], 5000, "counts");
    fails = field(r, fence ? "fence_fail" : "checksum_fail");
    printf("# torn reads (%s): %" PRIu64 " %s failures, %" PRIu64 " rewrite rounds: %s\n", mode,
           fails, mode, rounds, r);
    assert_int_equal(corrupt, 0);
    /* Direct reads skip the FETCH round trip: a row A has not rewritten yet may be
     * read whole before A's first round reaches it (its bytes are A's: corrupt 0). */
    if (!direct)
        assert_int_equal(hits, 0);
    assert_true(fails > 0);
    /* Each mode refuses by its own check only. */
    assert_int_equal(field(r, fence ? "checksum_fail" : "fence_fail"), 0);
    if (direct) { /* no FETCH for the torn rows: each one READ directly, a miss */
        assert_int_equal(field(r, "fetches"), fetches0);
        assert_int_equal(field(r, "direct_miss"), fails);
        assert_int_equal(field(r, "direct") + fails, 300);
        assert_int_equal(field(r, "direct"), hits);
    }
    stop3(n);
}

static void test_torn_reads(void **state)
{
    (void)state;
    torn_reads("fence", false);
}

static void test_torn_reads_checksum(void **state)
{
    (void)state;
    torn_reads("checksum", false);
}

static void test_torn_reads_direct(void **state)
{
    (void)state;
    torn_reads("fence", true);
}

/* A peer with a wrong secret or another namespace gets nothing. */
static void test_wrong_secret_and_namespace(void **state)
{
    struct sn a, bad, other;
    char seed[64];
    const char *r;

    (void)state;
    sn_start(&a, 1, 0, good_secret, "ns", NULL);
    sn_cmd(&a, 30000, "store 9 0 50");
    peer_of(&a, seed, sizeof(seed));
    sn_start(&bad, 5, 0, bad_secret, "ns", seed, NULL);
    sn_start(&other, 6, 0, good_secret, "other-ns", seed, NULL);
    sn_cmd(&bad, 5000, "step 1000");
    sn_cmd(&other, 5000, "step 1000");
    r = sn_cmd(&bad, 30000, "load 9 0 50 2000");
    assert_int_equal(field(r, "hit"), 0);
    r = sn_cmd(&other, 30000, "load 9 0 50 2000");
    assert_int_equal(field(r, "hit"), 0);
    r = sn_cmd(&bad, 5000, "counts");
    assert_int_equal(field(r, "live"), 1);
    r = sn_cmd(&a, 5000, "counts");
    printf("# refused: %s\n", r);
    assert_int_equal(field(r, "live"), 1);
    assert_true(field(r, "auth_refused") >= 1);
    assert_true(field(r, "ns_refused") >= 1);
    assert_int_equal(field(r, "served"), 0);
    sn_quit(&bad);
    sn_quit(&other);
    sn_quit(&a);
}

/* Malformed, truncated and oversized messages from a connected peer: refused and
 * counted; the node keeps serving the others. */
static void test_malformed_from_peer(void **state)
{
    struct sn n[3];
    const char *r;

    (void)state;
    start3(n, NULL, NULL);
    sn_cmd(&n[0], 30000, "store 10 0 100");
    r = sn_cmd(&n[2], 30000, "garbage 1 40");
    assert_int_equal(field(r, "sent"), 40);
    sn_cmd(&n[0], 5000, "step 200");
    r = sn_cmd(&n[0], 5000, "counts");
    printf("# garbage: %s\n", r);
    assert_true(field(r, "malformed") >= 30); /* the oversized ones may be refused locally */
    r = sn_cmd(&n[1], 30000, "load 10 0 100 20000");
    assert_int_equal(field(r, "hit"), 100);
    r = sn_cmd(&n[2], 30000, "load 10 0 100 20000");
    assert_int_equal(field(r, "hit"), 100);
    stop3(n);
}

/* A failed test leaves its nodes running: stop them before the next one. */
static int kill_spawned(void **state)
{
    (void)state;
    for (size_t i = 0; i < n_spawned; i++) {
        if (kill(spawned[i], SIGKILL) == 0)
            waitpid(spawned[i], NULL, 0);
    }
    n_spawned = 0;
    return 0;
}

/* Primaries over 2 and 4 GiB (kvtierd takes up to 64 TiB): both nodes register them
 * and B pulls 32 of A's chunks on both sides of 4 GiB. Until 2026-12-06 the UCX
 * backend refused registrations over 2 GiB and such a node served no peer. Rows of
 * 4 MiB, so that A's region fills in 1040 chunks; A's slots are handed out fresh and
 * in order, so key k of the store is in row k: keys 1008..1023 below 4 GiB,
 * 1024..1039 above. */
static void test_primary_over_4gib(void **state)
{
    struct sn a, b;
    char seed[64];
    const char *r;

    (void)state;
    start_ms = 120000;
    sn_start(&a, 1, 0, good_secret, "ns", "primary.row_bytes=4MiB", "primary.size=4160MiB",
             "network.lease_ms=20000", NULL);
    sn_start(&b, 2, 0, good_secret, "ns", peer_of(&a, seed, sizeof(seed)), "primary.row_bytes=4MiB",
             "primary.size=2400MiB", "network.fetch_timeout_ms=20000", "network.lease_ms=20000",
             NULL);
    start_ms = 20000;
    sn_cmd(&a, 15000, "wait-live 2 10000");
    sn_cmd(&b, 15000, "wait-live 2 10000");
    r = sn_cmd(&a, 120000, "store 9 0 1040"); /* slots 0..1039: 1024 and up above 4 GiB */
    assert_int_equal(field(r, "stored"), 1040);
    r = sn_cmd(&b, 120000, "load 9 1008 32 60000");
    printf("# 32 x 4 MiB pulled from around 4 GiB of a 4.06 GiB primary (16 above): %s\n", r);
    assert_int_equal(field(r, "hit"), 32);
    assert_int_equal(field(r, "corrupt"), 0);
    r = sn_cmd(&b, 5000, "counts");
    assert_int_equal(field(r, "pulled"), 32);
    assert_int_equal(field(r, "checksum_fail"), 0);
    sn_quit(&b);
    sn_quit(&a);
}

static void write_secret(const char *path, const char *text)
{
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0600);

    assert_true(fd >= 0);
    assert_int_equal(write(fd, text, strlen(text)), (ssize_t)strlen(text));
    close(fd);
}

static int setup(void **state)
{
    FILE *f;

    (void)state;
    tmp = kt_tmpdir("cluster");
    snprintf(good_secret, sizeof(good_secret), "%s/secret", tmp);
    snprintf(bad_secret, sizeof(bad_secret), "%s/wrong", tmp);
    write_secret(good_secret, "correct horse battery staple 0123456789\n");
    write_secret(bad_secret, "an entirely different secret 9876543210\n");
    /* The nodes' runtime folders, on the /dev/shm tmpfs (kvtierd refuses /dev/shm
     * itself: others may write there). */
    snprintf(shm_dir, sizeof(shm_dir), "/dev/shm/kvt-cluster.%d", (int)getpid());
    if (mkdir(shm_dir, 0700) != 0)
        return -1;
    snprintf(node_config, sizeof(node_config), "%s/node.yaml", tmp);
    f = fopen(node_config, "w");
    if (f == NULL)
        return -1;
    fprintf(f, NODE_CONFIG, shm_dir, shm_dir);
    return fclose(f) == 0 ? 0 : -1;
}

static int rm_one(const char *path, const struct stat *st, int flag, struct FTW *ftw)
{
    (void)st;
    (void)flag;
    (void)ftw;
    remove(path); /* best effort */
    return 0;
}

/* The runtime folders of the nodes (a SIGKILLed node leaves its region behind). */
static void teardown_all(void)
{
    if (shm_dir[0] != '\0')
        nftw(shm_dir, rm_one, 16, FTW_DEPTH | FTW_PHYS);
}

int main(int argc, char **argv)
{
    int rc;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_pull_1000, kill_spawned),
        cmocka_unit_test_teardown(test_evicted_become_miss, kill_spawned),
        cmocka_unit_test_teardown(test_home_dies, kill_spawned),
        cmocka_unit_test_teardown(test_kill_holder_mid_pull, kill_spawned),
        cmocka_unit_test_teardown(test_kill_requester_with_leases, kill_spawned),
        cmocka_unit_test_teardown(test_torn_reads, kill_spawned),
        cmocka_unit_test_teardown(test_torn_reads_checksum, kill_spawned),
        cmocka_unit_test_teardown(test_torn_reads_direct, kill_spawned),
        cmocka_unit_test_teardown(test_wrong_secret_and_namespace, kill_spawned),
        cmocka_unit_test_teardown(test_malformed_from_peer, kill_spawned),
        cmocka_unit_test_teardown(test_primary_over_4gib, kill_spawned),
    };

    if (argc < 2) {
        fprintf(stderr, "usage: test_cluster <kvtier-simnode>\n");
        return 2;
    }
    simnode = argv[1];
    signal(SIGPIPE, SIG_IGN);
    if (setup(NULL) != 0) {
        fprintf(stderr, "test_cluster: cannot set up %s: %s\n", shm_dir, strerror(errno));
        return 1;
    }
    rc = cmocka_run_group_tests(tests, NULL, NULL);
    teardown_all();
    return rc;
}

/* SPDX-License-Identifier: Apache-2.0 */
/* kvtier-bench engine: what one call of the engine API costs, side by side in one
 * run, in microseconds per call:
 *
 *   in_process  the same manager call made in this process (kvt_manager_*), the
 *               work any transport adds its cost to;
 *   floor       a cache-line ping-pong between two processes on two cores (the
 *               least any shared-memory IPC can take), and a 64-byte unix-socket
 *               ping-pong between them (the least a socket call can take);
 *   ring        libkvtier-client against a real kvtierd through the shared-memory
 *               ring (the node's loop polling, and "cold": the node asleep, woken
 *               through its eventfd);
 *   socket      the same client and node with the ring switched off.
 *
 * Calls: a 1-key lookup (a HIT), an empty on_schedule_end, and prepare_store +
 * complete_store of one new key (an eviction each: the node's primary is full).
 * The engine runs on CPU 0 and the node on CPU 1 (when the host has two), so every
 * round trip crosses cores as it does in production. Calls are timed in windows of
 * WIN calls; a row's figure is its best window (on a shared host a neighbour only
 * ever adds time, so the best window is the closest to the code's own cost) and
 * its median window is printed beside it (what a loaded host gave).
 *
 * With --python PY the Python rows follow (tools/bench/bench_engine.py under PY,
 * which must import vLLM for its in-process rows and the scheduler-step
 * comparison): the same calls through kvtier's Python package, and vLLM's own
 * in-process manager measured in that run. */
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "bench.h"
#include "kvt/hash.h"
#include "kvt/manager.h"
#include "kvt/primary.h"
#include "kvtier/client.h"

#ifndef KVT_BENCH_FAST_MODULE
#define KVT_BENCH_FAST_MODULE "" /* (built without Python's headers: ctypes only) */
#endif
#ifndef KVT_BENCH_PRELOAD
#define KVT_BENCH_PRELOAD "" /* (a sanitized build preloads its runtime into Python) */
#endif

#define KEYS     512 /* stored before the lookups: every lookup HITs */
#define CHUNKS   1024
#define ROW      4096u /* small rows: the figures are about the call, not hashing rows */
#define MAX_ROWS 32

#define WIN     1000 /* calls per timed window */
#define MAX_WIN 4096

/* A row: the averages of its timed windows, in us per call. */
struct row {
    char name[64];
    double win[MAX_WIN];
    size_t n;
};

static struct row rows[MAX_ROWS];
static size_t n_rows;

static struct row *row_of(const char *name)
{
    for (size_t i = 0; i < n_rows; i++) {
        if (strcmp(rows[i].name, name) == 0)
            return &rows[i];
    }
    if (n_rows == MAX_ROWS)
        return NULL;
    snprintf(rows[n_rows].name, sizeof(rows[n_rows].name), "%s", name);
    return &rows[n_rows++];
}

static void add(const char *name, double us)
{
    struct row *r = row_of(name);

    if (r != NULL && r->n < MAX_WIN)
        r->win[r->n++] = us;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;

    return x < y ? -1 : x > y;
}

static double best(const char *name)
{
    struct row *r = row_of(name);
    double b = 0;

    for (size_t i = 0; r != NULL && i < r->n; i++)
        if (i == 0 || r->win[i] < b)
            b = r->win[i];
    return b;
}

static double median(struct row *r)
{
    if (r->n == 0)
        return 0;
    qsort(r->win, r->n, sizeof(r->win[0]), cmp_double);
    return r->win[r->n / 2];
}

static double now_s(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Times body (which may use i) for i in [0, n), window by window, into row name. */
#define TIMED(name, n, body)                                                                       \
    do {                                                                                           \
        for (long w0_ = 0; w0_ < (long)(n); w0_ += WIN) {                                          \
            long w1_ = w0_ + WIN < (long)(n) ? w0_ + WIN : (long)(n);                              \
            double t_ = now_s();                                                                   \
            for (long i = w0_; i < w1_; i++) {                                                     \
                body;                                                                              \
            }                                                                                      \
            add(name, (now_s() - t_) / (double)(w1_ - w0_) * 1e6);                                 \
        }                                                                                          \
    } while (0)

static int n_cpus(void)
{
    cpu_set_t s;

    return sched_getaffinity(0, sizeof(s), &s) == 0 ? CPU_COUNT(&s) : 1;
}

static void pin(int cpu)
{
    cpu_set_t s;

    if (cpu < 0)
        return;
    CPU_ZERO(&s);
    CPU_SET(cpu, &s);
    sched_setaffinity(0, sizeof(s), &s);
}

static void make_key(struct kvt_key *k, uint64_t i)
{
    uint64_t h[4];

    for (int w = 0; w < 4; w++)
        h[w] = kvt_hash64_seed(&i, sizeof(i), (uint64_t)w * 0x9e3779b97f4a7c15ull);
    kvt_key_make(k, h, sizeof(h), 0);
}

/* ---- (a) in process ------------------------------------------------------------------ */

static int in_process(long iters)
{
    /* as kvtierd makes its primary: rows in memory, events, checksums on complete */
    struct kvt_primary_config pc = {.num_chunks = CHUNKS,
                                    .row_bytes = ROW,
                                    .enable_events = true,
                                    .checksum_on_complete = true};
    struct kvt_primary *p;
    struct kvt_manager *m;
    struct kvt_req_ctx *ctx;
    struct kvt_store_output out;
    struct kvt_schedule_end_ctx se = {0};
    struct kvt_events ev;
    struct kvt_key *k = malloc(KEYS * sizeof(*k)), *st = malloc((size_t)iters * sizeof(*st));
    enum kvt_lookup_result res;
    int rc = kvt_primary_create(&pc, NULL, &p);

    if (rc < 0 || k == NULL || st == NULL)
        return rc < 0 ? rc : -ENOMEM;
    rc = kvt_manager_create(p, NULL, 0, &m);
    if (rc < 0)
        return rc;
    kvt_store_output_init(&out);
    kvt_events_init(&ev);
    if (kvt_req_ctx_create("bench", NULL, &ctx) < 0 || kvt_manager_on_new_request(m, ctx, NULL))
        return -ENOMEM;
    for (uint64_t i = 0; i < CHUNKS; i++) {
        struct kvt_key key;

        make_key(&key, i);
        if (kvt_manager_prepare_store(m, &key, 1, ctx, &out) < 0 ||
            kvt_manager_complete_store(m, &key, 1, ctx, true) < 0)
            return -EIO;
    }
    for (uint64_t i = 0; i < KEYS; i++)
        make_key(&k[i], CHUNKS - KEYS + i);
    for (long i = 0; i < iters; i++)
        make_key(&st[i], 1000000 + (uint64_t)i);
    TIMED("in_process.c.lookup1_us", iters,
          kvt_manager_lookup_many(m, &k[i % KEYS], 1, ctx, false, &res));
    TIMED("in_process.c.schedule_end_us", iters, kvt_manager_on_schedule_end(m, &se));
    TIMED("in_process.c.store1_us", iters, {
        kvt_manager_prepare_store(m, &st[i], 1, ctx, &out);
        kvt_manager_complete_store(m, &st[i], 1, ctx, true);
    });
    kvt_manager_take_events(m, &ev);
    kvt_events_cleanup(&ev);
    kvt_manager_on_request_finished(m, ctx);
    kvt_req_ctx_unref(ctx);
    kvt_store_output_cleanup(&out);
    kvt_manager_shutdown(m);
    kvt_manager_destroy(m);
    free(k);
    free(st);
    return 0;
}

/* ---- (b) floors --------------------------------------------------------------------- */

/* One cache line each way between this process (cpu_a) and a child (cpu_b). */
static int cacheline_pingpong(long iters, int cpu_a, int cpu_b)
{
    volatile uint64_t *sh =
        mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    volatile uint64_t *ping = sh, *pong = sh + 16; /* two cache lines */
    pid_t pid;

    if (sh == MAP_FAILED)
        return -errno;
    pid = fork();
    if (pid == 0) {
        pin(cpu_b);
        for (uint64_t i = 1; i <= (uint64_t)iters + 1000; i++) {
            while (__atomic_load_n(ping, __ATOMIC_ACQUIRE) != i)
                __builtin_ia32_pause();
            __atomic_store_n(pong, i, __ATOMIC_RELEASE);
        }
        _exit(0);
    }
    pin(cpu_a);
    for (uint64_t i = 1; i <= 1000; i++) { /* warm-up: both sides running */
        __atomic_store_n(ping, i, __ATOMIC_RELEASE);
        while (__atomic_load_n(pong, __ATOMIC_ACQUIRE) != i)
            __builtin_ia32_pause();
    }
    TIMED("floor.cacheline_pingpong_us", iters, {
        uint64_t v = (uint64_t)i + 1001;

        __atomic_store_n(ping, v, __ATOMIC_RELEASE);
        while (__atomic_load_n(pong, __ATOMIC_ACQUIRE) != v)
            __builtin_ia32_pause();
    });
    waitpid(pid, NULL, 0);
    munmap((void *)sh, 4096);
    return 0;
}

/* 64 bytes each way over a unix stream socketpair, blocking, across the cores. */
static int socket_pingpong(long iters, int cpu_a, int cpu_b)
{
    int sv[2];
    char buf[64] = {0};
    pid_t pid;
    bool ok = true;

    if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv) != 0)
        return -errno;
    pid = fork();
    if (pid == 0) {
        pin(cpu_b);
        close(sv[0]);
        while (read(sv[1], buf, sizeof(buf)) == (ssize_t)sizeof(buf)) {
            if (write(sv[1], buf, sizeof(buf)) != (ssize_t)sizeof(buf))
                break;
        }
        _exit(0);
    }
    close(sv[1]);
    pin(cpu_a);
    TIMED("floor.unix_socket_pingpong_us", iters, {
        if (ok && (write(sv[0], buf, sizeof(buf)) != (ssize_t)sizeof(buf) ||
                   read(sv[0], buf, sizeof(buf)) != (ssize_t)sizeof(buf)))
            ok = false;
    });
    close(sv[0]);
    waitpid(pid, NULL, 0);
    return ok ? 0 : -EIO;
}

/* ---- (c), (d) a real kvtierd ---------------------------------------------------------- */

struct node {
    char dir[128];
    char sock[192];
    char region[192];
    pid_t pid;
};

static int node_start(struct node *n, const char *kvtierd, int cpu, unsigned spin_us)
{
    char cfg[256];
    FILE *f;

    snprintf(n->dir, sizeof(n->dir), "/tmp/kvtier-bench-engine.XXXXXX");
    if (mkdtemp(n->dir) == NULL)
        return -errno;
    snprintf(n->sock, sizeof(n->sock), "%s/engine.sock", n->dir);
    snprintf(n->region, sizeof(n->region), "/dev/shm/kvtier-bench-engine-%d/primary.mmap",
             (int)getpid());
    snprintf(cfg, sizeof(cfg), "%s/node.yaml", n->dir);
    f = fopen(cfg, "w");
    if (f == NULL)
        return -errno;
    fprintf(f,
            "node:\n  id: 77\nprimary:\n  path: %s\n  size: %u\n  row_bytes: %u\n"
            "storage:\n  enabled: false\nnetwork:\n  enabled: false\n"
            "engine:\n  socket: %s\n  ring_spin_us: %u\nmetrics:\n  port: 0\n"
            "log:\n  level: warn\n",
            n->region, CHUNKS * ROW, ROW, n->sock, spin_us);
    fclose(f);
    n->pid = fork();
    if (n->pid == 0) {
        pin(cpu);
        execl(kvtierd, kvtierd, "--config", cfg, (char *)NULL);
        _exit(127);
    }
    for (int i = 0; i < 600; i++) {
        struct stat st;
        int status;

        if (stat(n->sock, &st) == 0)
            return 0;
        if (waitpid(n->pid, &status, WNOHANG) == n->pid) {
            n->pid = -1;
            return -ECHILD;
        }
        usleep(50000);
    }
    return -ETIMEDOUT;
}

static void node_stop(struct node *n)
{
    char path[256];

    if (n->pid > 0) {
        kill(n->pid, SIGTERM);
        waitpid(n->pid, NULL, 0);
    }
    snprintf(path, sizeof(path), "%s/node.yaml", n->dir);
    unlink(path);
    rmdir(n->dir);
    unlink(n->region);
    snprintf(path, sizeof(path), "/dev/shm/kvtier-bench-engine-%d", (int)getpid());
    rmdir(path);
}

static void ckey(struct kvtier_key *k, uint64_t i)
{
    struct kvt_key kk;

    make_key(&kk, i);
    kvtier_key_set(k, kk.bytes, kk.len);
}

/* The three calls through c (rows "<path>.c.*"), iters each, and cold_iters lookups
 * after 5 ms of quiet each (the node asleep). Keys are made before the timing. */
static int client_run(struct kvtier_client *c, const char *path, long iters, long cold_iters,
                      uint64_t *next_key)
{
    struct kvtier_key *k = malloc(KEYS * sizeof(*k)), *s = malloc((size_t)iters * sizeof(*s));
    uint32_t idx[1];
    int64_t ids[1];
    struct kvtier_store_plan plan = {.store_index = idx, .chunk_ids = ids};
    char name[64];
    uint8_t res = KVTIER_HIT;
    int rc = 0;

    if (k == NULL || s == NULL) {
        rc = -ENOMEM;
        goto out;
    }
    for (uint64_t i = 0; i < KEYS && rc == 0; i++) {
        /* (stored again when the last run's stores evicted them) */
        ckey(&k[i], CHUNKS - KEYS + i);
        rc = kvtier_prepare_store(c, "bench", &k[i], 1, &plan);
        if (rc == 0 && plan.n_store > 0)
            rc = kvtier_complete_store(c, "bench", &k[i], 1, true);
    }
    for (long i = 0; i < iters; i++)
        ckey(&s[i], (*next_key)++);
    for (long i = 0; i < 1000 && rc == 0; i++) /* warm-up */
        rc = kvtier_lookup(c, "bench", &k[i % KEYS], 1, 0, &res, NULL);
    snprintf(name, sizeof(name), "%s.c.lookup1_us", path);
    TIMED(name, iters, {
        if (rc == 0)
            rc = kvtier_lookup(c, "bench", &k[i % KEYS], 1, 0, &res, NULL);
    });
    if (rc == 0 && res != KVTIER_HIT) {
        fprintf(stderr, "bench engine: a lookup answered %s, not HIT\n",
                kvtier_lookup_result_name(res));
        rc = -EPROTO;
    }
    snprintf(name, sizeof(name), "%s.c.schedule_end_us", path);
    TIMED(name, iters, {
        if (rc == 0)
            rc = kvtier_on_schedule_end(c, NULL, 0, NULL, 0);
    });
    snprintf(name, sizeof(name), "%s.c.store1_us", path);
    TIMED(name, iters, {
        if (rc == 0)
            rc = kvtier_prepare_store(c, "bench", &s[i], 1, &plan);
        if (rc == 0)
            rc = kvtier_complete_store(c, "bench", &s[i], 1, true);
    });
    snprintf(name, sizeof(name), "%s.c.lookup1_node_asleep_us", path);
    for (long i = 0; i < cold_iters && rc == 0; i++) {
        double t;

        usleep(5000);
        t = now_s();
        rc = kvtier_lookup(c, "bench", &k[i % KEYS], 1, 0, &res, NULL);
        add(name, (now_s() - t) * 1e6);
    }
out:
    free(k);
    free(s);
    return rc;
}

/* Runs the Python rows; its JSON object (one line) into py. */
static int run_python(const char *python, const char *script, const char *sock, const char *lib,
                      long iters, const long step[3], int cpu, char *py, size_t cap)
{
    char cmd[2048];
    size_t len;
    FILE *f;

    if (snprintf(cmd, sizeof(cmd),
                 "LD_PRELOAD='%s' KVTIER_CLIENT_LIB='%s' KVTIER_FAST_MODULE='%s' PYTHONPATH='%s' "
                 "'%s' '%s' --socket '%s' "
                 "--iters %ld "
                 "--requests %ld --blocks %ld --steps %ld --cpu %d --json",
                 KVT_BENCH_PRELOAD, lib, KVT_BENCH_FAST_MODULE, KVT_BENCH_PYTHONPATH, python,
                 script, sock, iters, step[0], step[1], step[2], cpu) >= (int)sizeof(cmd))
        return -ENAMETOOLONG;
    f = popen(cmd, "r");
    if (f == NULL)
        return -errno;
    len = fread(py, 1, cap - 1, f);
    py[len] = '\0';
    while (len > 0 && (py[len - 1] == '\n' || py[len - 1] == ' '))
        py[--len] = '\0';
    if (pclose(f) != 0 || len == 0 || py[0] != '{')
        return -EIO;
    return 0;
}

static void usage(void)
{
    fprintf(stderr,
            "usage: kvtier-bench engine [--json] [--kvtierd PATH] [--iters N] [--repeat R]\n"
            "                           [--spin-us US] [--python PY [--script PATH]\n"
            "                           [--requests N] [--blocks K] [--steps S]]\n"
            "  --kvtierd   the daemon to measure against (default: %s)\n"
            "  --python    a Python with vLLM: adds the Python rows and the step comparison\n"
            "              (one scheduler step of N requests x K blocks, S steps timed;\n"
            "              default 16 x 16, 200)\n",
            KVT_BENCH_KVTIERD);
}

int kvt_bench_engine(int argc, char **argv)
{
    const char *kvtierd = KVT_BENCH_KVTIERD, *python = NULL, *script = KVT_BENCH_ENGINE_SCRIPT;
    long iters = 20000, repeat = 5, step[3] = {16, 16, 200};
    unsigned spin_us = 100;
    bool json = false;
    int cpu_a = -1, cpu_b = -1, rc;
    struct node node = {.pid = -1};
    struct kvtier_client *c = NULL;
    struct kvtier_connect_opts opts = {.name = "kvtier-bench", .timeout_ms = 10000};
    static char py[1 << 16];
    bool have_py = false, py_failed = false;
    uint64_t next_key = 10000000;
    double ratio;

    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--json") == 0)
            json = true;
        else if (strcmp(argv[i], "--kvtierd") == 0 && i + 1 < argc)
            kvtierd = argv[++i];
        else if (strcmp(argv[i], "--python") == 0 && i + 1 < argc)
            python = argv[++i];
        else if (strcmp(argv[i], "--script") == 0 && i + 1 < argc)
            script = argv[++i];
        else if (strcmp(argv[i], "--iters") == 0 && i + 1 < argc)
            iters = strtol(argv[++i], NULL, 10);
        else if (strcmp(argv[i], "--repeat") == 0 && i + 1 < argc)
            repeat = strtol(argv[++i], NULL, 10);
        else if (strcmp(argv[i], "--requests") == 0 && i + 1 < argc)
            step[0] = strtol(argv[++i], NULL, 10);
        else if (strcmp(argv[i], "--blocks") == 0 && i + 1 < argc)
            step[1] = strtol(argv[++i], NULL, 10);
        else if (strcmp(argv[i], "--steps") == 0 && i + 1 < argc)
            step[2] = strtol(argv[++i], NULL, 10);
        else if (strcmp(argv[i], "--spin-us") == 0 && i + 1 < argc)
            spin_us = (unsigned)strtoul(argv[++i], NULL, 10);
        else {
            usage();
            return 2;
        }
    }
    if (iters < WIN || iters > 10000000 || repeat < 1 || repeat > 100 || step[0] < 1 ||
        step[0] > 4096 || step[1] < 2 || step[1] > 4096 || step[2] < 1 || step[2] > 100000) {
        usage();
        return 2;
    }
    if (n_cpus() >= 2) {
        cpu_a = 0;
        cpu_b = 1;
    }

    /* (a) and (b) */
    for (long r = 0; r < repeat; r++) {
        pin(cpu_a);
        rc = in_process(iters);
        if (rc == 0)
            rc = cacheline_pingpong(iters, cpu_a, cpu_b);
        if (rc == 0)
            rc = socket_pingpong(iters / 10, cpu_a, cpu_b);
        if (rc < 0) {
            fprintf(stderr, "bench engine: in-process and floor rows: %s\n", strerror(-rc));
            return 1;
        }
    }

    /* (c), (d) */
    rc = node_start(&node, kvtierd, cpu_b, spin_us);
    if (rc < 0) {
        fprintf(stderr, "bench engine: cannot start %s: %s\n", kvtierd, strerror(-rc));
        node_stop(&node);
        return 1;
    }
    pin(cpu_a);
    rc = kvtier_connect(node.sock, &opts, &c);
    if (rc == 0 && !kvtier_client_has_ring(c))
        rc = -EOPNOTSUPP;
    if (rc == 0)
        rc = kvtier_on_new_request(c, "bench", NULL, NULL);
    for (long r = 0; rc == 0 && r < repeat; r++) {
        kvtier_client_set_ring(c, true, -1);
        rc = client_run(c, "ring", iters, 10, &next_key);
        kvtier_client_set_ring(c, false, -1);
        if (rc == 0)
            rc = client_run(c, "socket", iters / 10 > WIN ? iters / 10 : WIN, 10, &next_key);
    }
    if (rc < 0) {
        fprintf(stderr, "bench engine: calls to the node failed: %s\n", strerror(-rc));
        kvtier_close(c);
        node_stop(&node);
        return 1;
    }
    kvtier_on_request_finished(c, "bench");
    kvtier_close(c);

    /* (e) Python */
    if (python != NULL) {
        rc = run_python(python, script, node.sock, KVT_BENCH_CLIENT_LIB, iters, step, cpu_a, py,
                        sizeof(py));
        if (rc < 0)
            fprintf(stderr, "bench engine: the Python rows did not run (%s)\n", strerror(-rc));
        have_py = rc == 0;
        py_failed = rc < 0;
    }
    node_stop(&node);

    ratio = best("ring.c.lookup1_us") /
            (best("in_process.c.lookup1_us") + best("floor.cacheline_pingpong_us"));
    if (json) {
        printf("{\"bench\":\"engine\",\"unit\":\"us per call\",\"cpus\":[%d,%d],"
               "\"window_calls\":%d,\"iters\":%ld,\"repeat\":%ld,\"node_ring_spin_us\":%u,"
               "\"rows\":{",
               cpu_a, cpu_b, WIN, iters, repeat, spin_us);
        for (size_t i = 0; i < n_rows; i++)
            printf("%s\"%s\":%.3f", i ? "," : "", rows[i].name, best(rows[i].name));
        printf("},\"rows_median\":{");
        for (size_t i = 0; i < n_rows; i++)
            printf("%s\"%s\":%.3f", i ? "," : "", rows[i].name, median(&rows[i]));
        /* the headline figures: a 1-key lookup (a HIT) from C, by path */
        printf("},\"in_process\":%.3f,\"floor\":%.3f,\"ring\":%.3f,\"socket\":%.3f",
               best("in_process.c.lookup1_us"), best("floor.cacheline_pingpong_us"),
               best("ring.c.lookup1_us"), best("socket.c.lookup1_us"));
        printf(",\"ring_lookup_over_in_process_plus_floor\":%.2f,\"python\":%s}\n", ratio,
               have_py ? py : "null");
        return py_failed ? 1 : 0; /* (the C rows are printed all the same) */
    }
    printf("engine API, us per call (engine on CPU %d, node on CPU %d; best and median of "
           "%d-call windows):\n",
           cpu_a, cpu_b, WIN);
    for (size_t i = 0; i < n_rows; i++) {
        double b = best(rows[i].name);

        printf("  %-36s %9.3f %9.3f\n", rows[i].name, b, median(&rows[i]));
    }
    printf("  ring 1-key lookup / (in-process + floor): %.2f\n", ratio);
    if (have_py)
        printf("python: %s\n", py);
    return py_failed ? 1 : 0;
}

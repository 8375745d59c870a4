/* SPDX-License-Identifier: Apache-2.0 */
/* kvtier-bench pull: two nodes on 127.0.0.1; A holds N chunks of 256 KiB, B pulls
 * them all through its manager (lookup, LOCATE, FETCH, READ, validation (fence or checksum),
 * RELEASE, byte check against the expected content: everything included), as an
 * engine would: requests of --req-keys keys (32), --inflight of them at a time (4), a
 * new one as soon as one is loaded, the engine stepping every 500 us. Reported as
 * GB/s over the whole pull and p50/p99 lookup-to-HIT time per request (request start
 * to its last key HIT) and per key, side by side in the same run with:
 *   - the transport ceiling: `kvtier-bench transport --chunks N` (256 KiB, its 32 x 2
 *     shape: batches of 32, two in flight, both sides busy-polling, every READ the next
 *     of N distinct chunks, as the pull moves them), median of --reps; and the same
 *     READs of 32 chunks read again and again, which stay in the caches (the figure
 *     ucx_perftest's single buffer gives), for comparison;
 *   - redis-benchmark GET of 256 KiB values against a local redis-server (what users
 *     pick instead today), with the same number of values;
 *   - Mooncake Store (the distributed KV pool users pick) moving the same chunk bytes
 *     over its tcp transport on 127.0.0.1: tools/bench/bench_mooncake.py under the
 *     venv tools/mooncake-env makes (--mooncake-python PY, default
 *     build/mooncake-venv/bin/python in the source tree), one client putting, another
 *     getting them as requests of --req-keys keys, --inflight at a time and one at a
 *     time (the better pass is its figure), every byte checked after each pass. Without the venv
 * its column says "absent", and "failed" when the run did not get every chunk back intact: never a
 * figure. Each row runs with one UCX transport selection (--tls, both by default) and one
 * validation of pulled chunks (--verify, both by default: network.verify fence, the
 * holder's generation word READ after each row, and checksum, XXH3-64 of every
 * byte), the two validations of a selection one after the other, then its ceiling:
 *   tcp      UCX_TLS=tcp for the nodes and the ceiling;
 *   default  UCX_TLS unset for the nodes (UCX picks), UCX_TLS=all (the same thing:
 *            UCX's default value) for the ceiling, which forces tcp when unset.
 * and one way of pulling (--fetch, both by default: network.fetch lease, every row
 * through FETCH, GRANT, READ, RELEASE; and direct, rows whose place the home's LOCATE
 * answer gave READ straight from A's primary and fenced, with no FETCH: fence
 * validation only, so a checksum row is always a lease row), the lease and direct
 * pulls of a validation one after the other.
 * The nodes are kvtier-simnode processes (tools/simnode), found next to this binary's
 * build folder or with --simnode PATH; --set KEY=VALUE gives both more settings. Their
 * runtime folders, primary regions included, go in /dev/shm, or in --run-dir DIR. On
 * /dev/shm (huge=never on Debian) the primaries get 4 KiB pages, while the ceiling's
 * buffers are anonymous memory advised for transparent huge pages; over shared memory
 * the reader's process_vm_readv pins and copies the holder's pages one by one, so the
 * output says what each side ran on (pages: the share of each primary on huge pages,
 * and the kernel's THP mode), and --run-dir on a tmpfs mounted huge=advise (or
 * hugetlbfs) runs the nodes as docs/operations.md sets a production node up. Each
 * selection's ceiling is also measured with its buffers as files in the nodes' run
 * folder (`transport --buffer-dir`, the "on pages" column): the same copy on the same
 * kind of pages as the pull's, which the anonymous ceiling is not on /dev/shm.
 *
 * CPU per pulled chunk: each node process's CPU time (every thread, user and system)
 * over the pull, per chunk, on B (the puller: its engine's calls included) and on A
 * (the holder); and the same less one memcpy of the chunk's bytes (cold rows, timed in
 * this run): what is left when a NIC moves the bytes. From that, the fraction of a
 * 200 and a 400 Gb/s NIC one core of each side keeps busy: the bytes per second one
 * core's CPU per chunk allows, over the NIC's line rate, at most 1. */
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <poll.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "bench.h"
#include "kvt/common.h"

struct proc {
    pid_t pid;
    FILE *in;
    FILE *out;
};

static double bp_now_s(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static int bp_spawn(struct proc *p, char *const argv[])
{
    int in[2], out[2];

    if (pipe2(in, O_CLOEXEC) != 0 || pipe2(out, O_CLOEXEC) != 0)
        return -errno;
    p->pid = fork();
    if (p->pid < 0)
        return -errno;
    if (p->pid == 0) {
        dup2(in[0], 0);
        dup2(out[1], 1);
        execv(argv[0], argv);
        fprintf(stderr, "kvtier-bench pull: cannot run %s: %s\n", argv[0], strerror(errno));
        _exit(127);
    }
    close(in[0]);
    close(out[1]);
    p->in = fdopen(in[1], "w");
    p->out = fdopen(out[0], "r");
    return 0;
}

/* The next line that is not a progress line. */
static bool bp_answer(struct proc *p, char *line, size_t cap)
{
    while (fgets(line, (int)cap, p->out) != NULL) {
        if (strncmp(line, "progress", 8) != 0)
            return true;
    }
    return false;
}

static bool bp_cmd(struct proc *p, char *line, size_t cap, const char *cmd)
{
    fprintf(p->in, "%s\n", cmd);
    fflush(p->in);
    return bp_answer(p, line, cap) && strncmp(line, "ok", 2) == 0;
}

static double bp_field(const char *line, const char *name)
{
    char pat[64];
    const char *s;

    snprintf(pat, sizeof(pat), " %s=", name);
    s = strstr(line, pat);
    return s == NULL ? -1 : strtod(s + strlen(pat), NULL);
}

static void bp_stop(struct proc *p)
{
    if (p->pid <= 0)
        return;
    fprintf(p->in, "quit\n");
    fflush(p->in);
    fclose(p->in);
    waitpid(p->pid, NULL, 0);
    fclose(p->out);
    p->pid = 0;
}

/* GET GB/s of redis-benchmark against a fresh local redis-server; < 0 if absent. */
static double bp_redis(unsigned n, size_t size, unsigned clients, char *cmd, size_t cap)
{
    char buf[512], line[512];
    unsigned port = 20000 + (unsigned)(getpid() % 20000);
    pid_t srv;
    FILE *f;
    double rps = -1;

    srv = fork();
    if (srv == 0) {
        char portb[16];

        snprintf(portb, sizeof(portb), "%u", port);
        /* Its log (warnings included) goes to stderr: our stdout is the figures, one
         * JSON object with --json. */
        if (dup2(STDERR_FILENO, STDOUT_FILENO) < 0)
            _exit(127);
        execlp("redis-server", "redis-server", "--port", portb, "--bind", "127.0.0.1", "--save", "",
               "--appendonly", "no", "--daemonize", "no", "--loglevel", "warning", (char *)NULL);
        _exit(127);
    }
    if (srv < 0)
        return -1;
    usleep(300000);
    /* -r keyspace = n, so GETs hit n distinct stored values (SET first). */
    snprintf(buf, sizeof(buf),
             "redis-benchmark -h 127.0.0.1 -p %u -t set -d %zu -n %u -r %u -c %u -q >/dev/null "
             "2>&1 && redis-benchmark -h 127.0.0.1 -p %u -t get -d %zu -n %u -r %u -c %u --csv "
             "2>/dev/null",
             port, size, n, n, clients, port, size, n, n, clients);
    snprintf(cmd, cap, "redis-benchmark -t get -d %zu -n %u -r %u -c %u --csv", size, n, n,
             clients);
    f = popen(buf, "r");
    while (f != NULL && fgets(line, sizeof(line), f) != NULL) {
        if (strncmp(line, "\"GET\"", 5) == 0)
            rps = strtod(line + 7, NULL);
    }
    if (f != NULL)
        pclose(f);
    kill(srv, SIGTERM);
    waitpid(srv, NULL, 0);
    return rps < 0 ? -1 : rps * (double)size / 1e9;
}

/* Mooncake Store's side by side (tools/bench/bench_mooncake.py). */
struct bp_mooncake {
    const char *status; /* "measured", "absent" (no venv) or "failed" */
    double gbps, req_p50, req_p99;
    int inflight;     /* requests at a time in its best pass */
    double cold_gbps; /* its untimed first pass (connections, first touches) */
    char cmd[256];
};

static double bp_json_num(const char *buf, const char *name)
{
    char pat[64];
    const char *s;

    snprintf(pat, sizeof(pat), "\"%s\": ", name);
    s = strstr(buf, pat);
    return s == NULL ? -1 : strtod(s + strlen(pat), NULL);
}

/* Runs the Mooncake script under python for the pull's shape, inflight requests at a
 * time and one at a time (Mooncake moves more that way here); its figure is the
 * better pass's (the top-level names of the script's answer), and only when every
 * pass got every one of the n chunks back and each matched, byte for byte. */
static void bp_mooncake(const char *python, const char *script, unsigned n, size_t size,
                        unsigned per, unsigned inflight, struct bp_mooncake *mc)
{
    char buf[4096], out[8192], args[128];
    size_t len;
    FILE *f;

    mc->status = "absent";
    mc->gbps = mc->req_p50 = mc->req_p99 = mc->cold_gbps = -1;
    mc->inflight = 0;
    snprintf(args, sizeof(args), "--chunks %u --size %zu --req-keys %u --inflight %u%s", n, size,
             per, inflight, inflight == 1 ? "" : ",1");
    snprintf(mc->cmd, sizeof(mc->cmd), "bench_mooncake.py %s", args);
    if (python == NULL || access(python, X_OK) != 0 || access(script, R_OK) != 0)
        return;
    mc->status = "failed";
    /* Its own error line, if any, goes to our stderr; its daemons' logs to files. */
    if (snprintf(buf, sizeof(buf), "'%s' '%s' --json %s", python, script, args) >= (int)sizeof(buf))
        return;
    f = popen(buf, "r");
    if (f == NULL)
        return;
    len = fread(out, 1, sizeof(out) - 1, f);
    out[len] = '\0';
    if (pclose(f) != 0 || bp_json_num(out, "got") != (double)n || bp_json_num(out, "corrupt") != 0)
        return;
    mc->gbps = bp_json_num(out, "gbps");
    mc->req_p50 = bp_json_num(out, "req_ms_p50");
    mc->req_p99 = bp_json_num(out, "req_ms_p99");
    mc->cold_gbps = bp_json_num(out, "cold_gbps");
    mc->inflight = (int)bp_json_num(out, "inflight");
    if (mc->gbps > 0)
        mc->status = "measured";
}

/* Transport ceiling in GB/s from `<self> transport --json` (its median read_mbps:
 * our READs, the 32 x 2 shape) over chunks distinct chunks (0: the same 32, cached),
 * its buffers anonymous or, with buffer_dir, files there; < 0 on failure. */
static double bp_transport(const char *self, size_t size, unsigned reps, unsigned chunks,
                           const char *buffer_dir)
{
    char buf[8400], line[16384];
    FILE *f;
    double mbps = -1;

    static const char key[] = "\"median\":{\"read_mbps\":";

    snprintf(buf, sizeof(buf),
             "%s transport --json --size %zu --reps %u --chunks %u%s%s%s 2>/dev/null", self, size,
             reps, chunks, buffer_dir ? " --buffer-dir '" : "", buffer_dir ? buffer_dir : "",
             buffer_dir ? "'" : "");
    f = popen(buf, "r");
    while (f != NULL && fgets(line, sizeof(line), f) != NULL) {
        const char *s = strstr(line, key); /* ours, the 32 x 2 shape (not perftest's) */

        if (s != NULL && mbps < 0)
            mbps = strtod(s + strlen(key), NULL);
    }
    if (f != NULL)
        pclose(f);
    return mbps < 0 ? -1 : mbps / 1e3;
}

static void bp_default_simnode(const char *self, char *buf, size_t cap)
{
    const char *slash = strrchr(self, '/');
    int dir = slash == NULL ? 0 : (int)(slash - self);

    /* build/tools/bench/kvtier-bench -> build/tools/simnode/kvtier-simnode */
    snprintf(buf, cap, "%.*s/../simnode/kvtier-simnode", dir, slash == NULL ? "." : self);
}

struct bp_row {
    const char *tls;    /* "tcp" or "default" */
    const char *verify; /* "fence" or "checksum" (network.verify) */
    const char *fetch;  /* "lease" or "direct" (network.fetch) */
    double direct;      /* B's rows read direct (timing's direct_chunks) */
    int hit, corrupt, requests;
    double secs, gbps, req_p50, req_p99, key_p50, key_p99;
    double verify_ms;    /* B's validation time over the pull (timing's verify_ms) */
    double cpu_b, cpu_a; /* CPU seconds of B (puller) and A (holder) over the pull */
    /* Wall seconds of B's and A's loop busy-polling with nothing arriving while
     * transfers were in flight (timing's idle_poll_ms over the pull), < 0 unknown. */
    double poll_b, poll_a;
    /* From those, per chunk (us), the same less one memcpy of the chunk, and less
     * the copy and the polling. */
    double puller_us, holder_us, puller_less_us, holder_less_us;
    double puller_work_us, holder_work_us;
    /* The holder's CPU per chunk less the polling only: over shared memory the reader
     * copies (cma), so the holder has no copy to take off. */
    double holder_nopoll_us;
    double huge_a, huge_b; /* fraction of A's and B's primary on huge pages, < 0 unknown */
    double ceiling;        /* the transport moving the same N distinct chunks */
    double ceiling_hot;    /* the same READs over 32 chunks that stay in the caches */
    double ceiling_pages;  /* the same N chunks between files in the nodes' run folder */
};

static int bp_rm(const char *path, const struct stat *st, int flag, struct FTW *ftw)
{
    (void)st;
    (void)flag;
    (void)ftw;
    remove(path); /* best effort */
    return 0;
}

/* The nodes' runtime folder (a node that died leaves its region there) and secret. */
static void bp_clean(const char *run, const char *secret)
{
    nftw(run, bp_rm, 8, FTW_DEPTH | FTW_PHYS);
    unlink(secret);
}

/* --set KEY=VALUE options, given to both nodes after the bench's own settings. */
#define BP_MAX_SETS 8
static const char *bp_sets[BP_MAX_SETS];
static size_t bp_n_sets;
/* --run-dir: where the nodes' runtime folders (their primary regions) go. */
static const char *bp_run_dir = "/dev/shm";

/* The fraction of a node's primary region on huge pages (its "pages" answer), < 0 if
 * it cannot tell. */
static double bp_huge(struct proc *p)
{
    char line[256];
    double huge, size;

    if (!bp_cmd(p, line, sizeof(line), "pages"))
        return -1;
    huge = bp_field(line, "huge_bytes");
    size = bp_field(line, "region_bytes");
    return size > 0 && huge >= 0 ? huge / size : -1;
}

/* Seconds a node's loop has busy-polled with nothing arriving while transfers were
 * in flight (its timing answer), < 0 if it does not say. */
static double bp_poll_s(struct proc *p)
{
    char line[1024];
    double ms;

    if (!bp_cmd(p, line, sizeof(line), "timing"))
        return -1;
    ms = bp_field(line, "idle_poll_ms");
    return ms < 0 ? -1 : ms / 1e3;
}

/* One pull: A and B started under the row's UCX_TLS, A stores n chunks, B pulls them
 * as requests of per keys, inflight at a time. 0, or -1 with a message. */
static int bp_pull(const char *simnode, size_t n, size_t size, unsigned per, unsigned inflight,
                   struct bp_row *r)
{
    char secret[] = "/tmp/kvtier-bench-pull-secret-XXXXXX";
    char run[4096];
    char line[1024], cmd[256], portb[16];
    /* The nodes are kvtierd's with its defaults, but their runtime folders in run, no
     * storage tier (the pull is the network tier's) and no /metrics. */
    char k_path[4200], k_sock[4200], k_secret[128], k_row[64], k_size[64], k_peer[64];
    char k_verify[64], k_fetch[64];
    char *common[] = {"--set", k_path,           "--set", k_sock,
                      "--set", k_secret,         "--set", k_row,
                      "--set", k_size,           "--set", "storage.enabled=false",
                      "--set", "metrics.port=0", "--set", "network.port=0",
                      "--set", k_verify,         "--set", k_fetch};
    char *av[32 + 2 * BP_MAX_SETS];
    size_t ac = 0;
    struct proc a = {0}, b = {0};
    double t0, t, poll_a0, poll_b0;
    int fd;

    snprintf(run, sizeof(run), "%s/kvtier-bench-pull-XXXXXX", bp_run_dir);
    if (mkdtemp(run) == NULL &&
        (snprintf(run, sizeof(run), "/tmp/kvtier-bench-pull-XXXXXX"), mkdtemp(run) == NULL)) {
        fprintf(stderr, "kvtier-bench pull: cannot make a runtime folder: %s\n", strerror(errno));
        return -1;
    }
    fd = mkstemp(secret);
    if (fd < 0 || write(fd, "kvtier-bench pull shared secret 0123\n", 37) != 37) {
        fprintf(stderr, "kvtier-bench pull: cannot write a secret file\n");
        rmdir(run);
        return -1;
    }
    close(fd);
    snprintf(k_path, sizeof(k_path), "primary.path=%s/{id}/primary.mmap", run);
    snprintf(k_sock, sizeof(k_sock), "engine.socket=%s/{id}/engine.sock", run);
    snprintf(k_secret, sizeof(k_secret), "cluster.secret_file=%s", secret);
    snprintf(k_row, sizeof(k_row), "primary.row_bytes=%zu", size);
    snprintf(k_size, sizeof(k_size), "primary.size=%zu", (n + 16) * size);
    snprintf(k_verify, sizeof(k_verify), "network.verify=%s", r->verify);
    snprintf(k_fetch, sizeof(k_fetch), "network.fetch=%s", r->fetch);
    av[ac++] = (char *)simnode;
    for (size_t i = 0; i < KVT_ARRAY_SIZE(common); i++)
        av[ac++] = common[i];
    for (size_t i = 0; i < bp_n_sets; i++) {
        av[ac++] = "--set";
        av[ac++] = (char *)bp_sets[i];
    }
    av[ac++] = "--set";
    av[ac++] = "node.id=1";
    av[ac] = NULL;
    if (bp_spawn(&a, av) != 0 || !bp_answer(&a, line, sizeof(line)) ||
        sscanf(line, "ready id=%*x port=%15s", portb) != 1) {
        fprintf(stderr, "kvtier-bench pull: node A did not start\n");
        bp_clean(run, secret);
        return -1;
    }
    snprintf(k_peer, sizeof(k_peer), "network.peers=127.0.0.1:%s", portb);
    av[ac - 1] = "node.id=2";
    av[ac++] = "--set";
    av[ac++] = k_peer;
    av[ac] = NULL;
    if (bp_spawn(&b, av) != 0 || !bp_answer(&b, line, sizeof(line))) {
        fprintf(stderr, "kvtier-bench pull: node B did not start\n");
        bp_stop(&a);
        bp_clean(run, secret);
        return -1;
    }
    if (!bp_cmd(&a, line, sizeof(line), "wait-live 2 10000") ||
        !bp_cmd(&b, line, sizeof(line), "wait-live 2 10000")) {
        fprintf(stderr, "kvtier-bench pull: the nodes did not see each other: %s", line);
        goto fail;
    }
    r->huge_a = bp_huge(&a);
    r->huge_b = bp_huge(&b);
    snprintf(cmd, sizeof(cmd), "store 1 0 %zu", n);
    if (!bp_cmd(&a, line, sizeof(line), cmd))
        goto fail;
    snprintf(cmd, sizeof(cmd), "pull 1 0 %zu 120000 %u %u", n, per, inflight);
    if (!bp_cmd(&a, line, sizeof(line), "cpu"))
        goto fail;
    r->cpu_a = bp_field(line, "cpu_seconds");
    poll_a0 = bp_poll_s(&a);
    poll_b0 = bp_poll_s(&b);
    t0 = bp_now_s();
    if (!bp_cmd(&b, line, sizeof(line), cmd))
        goto fail;
    r->secs = bp_field(line, "seconds") > 0 ? bp_field(line, "seconds") : bp_now_s() - t0;
    r->hit = (int)bp_field(line, "hit");
    r->corrupt = (int)bp_field(line, "corrupt");
    r->requests = (int)bp_field(line, "requests");
    r->gbps = (double)r->hit * (double)size / r->secs / 1e9;
    r->req_p50 = bp_field(line, "req_ms_p50");
    r->req_p99 = bp_field(line, "req_ms_p99");
    r->key_p50 = bp_field(line, "ms_p50");
    r->key_p99 = bp_field(line, "ms_p99");
    r->cpu_b = bp_field(line, "cpu_seconds");
    /* A served every READ before B's last answer, and sleeps since (no lease). */
    r->cpu_a =
        bp_cmd(&a, line, sizeof(line), "cpu") ? bp_field(line, "cpu_seconds") - r->cpu_a : -1;
    r->poll_a = poll_a0 >= 0 && (t = bp_poll_s(&a)) >= 0 ? t - poll_a0 : -1;
    if (bp_cmd(&b, line, sizeof(line), "timing")) {
        t = bp_field(line, "idle_poll_ms");
        r->poll_b = poll_b0 >= 0 && t >= 0 ? t / 1e3 - poll_b0 : -1;
        r->verify_ms = bp_field(line, "verify_ms");
        r->direct = bp_field(line, "direct_chunks");
        fprintf(stderr, "kvtier-bench pull: B (UCX_TLS %s, verify %s, fetch %s) %s", r->tls,
                r->verify, r->fetch, line + 3);
    }
    bp_stop(&a);
    bp_stop(&b);
    bp_clean(run, secret);
    return 0;
fail:
    fprintf(stderr, "kvtier-bench pull: failed: %s", line);
    bp_stop(&a);
    bp_stop(&b);
    bp_clean(run, secret);
    return -1;
}

/* Seconds one memcpy of a size-byte row takes, rows cold: n distinct rows (at most
 * 1 GiB of them, at least 64) copied once each into distinct rows; < 0 if no memory. */
static double bp_copy_s(size_t size, size_t n)
{
    size_t rows = KVT_MAX((size_t)64, KVT_MIN(n, ((size_t)1 << 30) / size));
    uint8_t *src = malloc(rows * size), *dst = malloc(rows * size);
    double t0, t;

    if (src == NULL || dst == NULL) {
        free(src);
        free(dst);
        return -1;
    }
    memset(src, 0x5a, rows * size); /* pages present: the pull's rows are */
    memset(dst, 0xa5, rows * size);
    t0 = bp_now_s();
    for (size_t i = 0; i < rows; i++)
        memcpy(dst + i * size, src + i * size, size);
    t = bp_now_s() - t0;
    /* the copies are used, so none is optimised away */
    if (dst[(rows - 1) * size] != 0x5a)
        t = -1;
    free(src);
    free(dst);
    return t < 0 ? -1 : t / (double)rows;
}

/* CPU microseconds per chunk, less the copy (at least 0); the fraction of a NIC of
 * gbit Gb/s one core keeps busy at that cost (at most 1). */
static double bp_less_copy_us(double cpu_s, unsigned n, double copy_s)
{
    return cpu_s < 0 || n == 0 ? -1 : KVT_MAX(0.0, (cpu_s / n - KVT_MAX(copy_s, 0.0)) * 1e6);
}

static double bp_nic_fraction(double us_per_chunk, size_t size, double gbit)
{
    if (us_per_chunk < 0)
        return -1;
    if (us_per_chunk == 0)
        return 1;
    return KVT_MIN(1.0, (double)size / (us_per_chunk * 1e-6) / (gbit * 1e9 / 8));
}

/* The kernel's transparent huge page mode for anonymous memory (the bracketed word of
 * /sys/kernel/mm/transparent_hugepage/enabled), which the ceiling's buffers get. */
static void bp_thp(char *buf, size_t cap)
{
    char line[128] = "";
    FILE *f = fopen("/sys/kernel/mm/transparent_hugepage/enabled", "r");
    const char *a, *b;

    snprintf(buf, cap, "unknown");
    if (f == NULL)
        return;
    if (fgets(line, sizeof(line), f) != NULL && (a = strchr(line, '[')) != NULL &&
        (b = strchr(a, ']')) != NULL)
        snprintf(buf, cap, "%.*s", (int)(b - a - 1), a + 1);
    fclose(f);
}

/* The row's transport selection for the nodes and the ceiling. */
static void bp_set_tls(const char *tls, bool for_ceiling)
{
    if (strcmp(tls, "tcp") == 0)
        setenv("UCX_TLS", "tcp", 1);
    else if (for_ceiling)
        setenv("UCX_TLS", "all", 1); /* kvtier-bench transport forces tcp when unset */
    else
        unsetenv("UCX_TLS");
}

int kvt_bench_pull(int argc, char **argv)
{
    /* 6400 chunks: the bytes the ceiling moves (kvtier-bench transport: 200 x 32 chunks
     * of 256 KiB), so both are timed over the same volume; at 1000 chunks the pull's
     * first round trips weighed a fifth of its time. */
    unsigned n = 6400, clients = 4, per = 32, inflight = 4, reps = 1;
    size_t size = 262144;
    bool json = false;
    const char *tls_opt = "both", *verify_opt = "both", *fetch_opt = "both";
    const char *mc_python = getenv("KVT_MOONCAKE_PYTHON");
    struct bp_mooncake mc;
    const char *rows_tls[2], *verifies[2], *fetches[2];
    size_t n_rows = 0, n_tls = 0, n_verify = 0, n_fetch = 0;
    struct bp_row rows[8];
    char simnode[4096], redis_cmd[256] = "";
    char self[4096], thp[32];
    double redis, copy_s;
    ssize_t sl;
    int rc = 0;

    if (mc_python == NULL)
        mc_python = KVT_BENCH_MOONCAKE_PYTHON;
    sl = readlink("/proc/self/exe", self, sizeof(self) - 1);
    self[sl > 0 ? sl : 0] = '\0';
    bp_default_simnode(self, simnode, sizeof(simnode));
    /* Both nodes, the ceiling and Redis on 127.0.0.1: UCX's lanes over loopback only
     * (it would add one to this host's address on every other interface). */
    setenv("UCX_NET_DEVICES", "lo", 0);
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--json") == 0)
            json = true;
        else if (strcmp(argv[i], "--chunks") == 0 && i + 1 < argc)
            n = (unsigned)strtoul(argv[++i], NULL, 0);
        else if (strcmp(argv[i], "--size") == 0 && i + 1 < argc)
            size = strtoull(argv[++i], NULL, 0);
        else if (strcmp(argv[i], "--req-keys") == 0 && i + 1 < argc)
            per = (unsigned)strtoul(argv[++i], NULL, 0);
        else if (strcmp(argv[i], "--inflight") == 0 && i + 1 < argc)
            inflight = (unsigned)strtoul(argv[++i], NULL, 0);
        else if (strcmp(argv[i], "--reps") == 0 && i + 1 < argc)
            reps = (unsigned)strtoul(argv[++i], NULL, 0);
        else if (strcmp(argv[i], "--tls") == 0 && i + 1 < argc)
            tls_opt = argv[++i];
        else if (strcmp(argv[i], "--verify") == 0 && i + 1 < argc)
            verify_opt = argv[++i];
        else if (strcmp(argv[i], "--fetch") == 0 && i + 1 < argc)
            fetch_opt = argv[++i];
        else if (strcmp(argv[i], "--simnode") == 0 && i + 1 < argc)
            snprintf(simnode, sizeof(simnode), "%s", argv[++i]);
        else if (strcmp(argv[i], "--mooncake-python") == 0 && i + 1 < argc)
            mc_python = argv[++i];
        else if (strcmp(argv[i], "--no-mooncake") == 0)
            mc_python = NULL;
        else if (strcmp(argv[i], "--run-dir") == 0 && i + 1 < argc)
            bp_run_dir = argv[++i];
        else if (strcmp(argv[i], "--set") == 0 && i + 1 < argc && bp_n_sets < BP_MAX_SETS)
            bp_sets[bp_n_sets++] = argv[++i];
        else {
            fprintf(stderr, "usage: kvtier-bench pull [--json] [--chunks 6400] [--size 262144] "
                            "[--req-keys 32] [--inflight 4] [--tls tcp|default|both] "
                            "[--verify fence|checksum|both] [--fetch lease|direct|both] "
                            "[--reps 1 (of the ceiling)] "
                            "[--simnode PATH] [--mooncake-python PY | --no-mooncake] "
                            "[--run-dir DIR (the nodes' primaries; /dev/shm)] "
                            "[--set KEY=VALUE (both nodes; up to 8)]\n");
            return 2;
        }
    }
    if (per == 0 || inflight == 0 || reps == 0 || n == 0) {
        fprintf(stderr, "kvtier-bench pull: --chunks, --req-keys, --inflight, --reps >= 1\n");
        return 2;
    }
    if (access(simnode, X_OK) != 0) {
        fprintf(stderr, "kvtier-bench pull: %s not found (build tools/simnode or --simnode)\n",
                simnode);
        return 1;
    }
    if (strcmp(tls_opt, "tcp") == 0 || strcmp(tls_opt, "both") == 0)
        rows_tls[n_tls++] = "tcp";
    if (strcmp(tls_opt, "default") == 0 || strcmp(tls_opt, "both") == 0)
        rows_tls[n_tls++] = "default";
    if (n_tls == 0) {
        fprintf(stderr, "kvtier-bench pull: --tls tcp, default or both\n");
        return 2;
    }
    if (strcmp(verify_opt, "fence") == 0 || strcmp(verify_opt, "both") == 0)
        verifies[n_verify++] = "fence";
    if (strcmp(verify_opt, "checksum") == 0 || strcmp(verify_opt, "both") == 0)
        verifies[n_verify++] = "checksum";
    if (n_verify == 0) {
        fprintf(stderr, "kvtier-bench pull: --verify fence, checksum or both\n");
        return 2;
    }
    if (strcmp(fetch_opt, "lease") == 0 || strcmp(fetch_opt, "both") == 0)
        fetches[n_fetch++] = "lease";
    if (strcmp(fetch_opt, "direct") == 0 || strcmp(fetch_opt, "both") == 0)
        fetches[n_fetch++] = "direct";
    if (n_fetch == 0) {
        fprintf(stderr, "kvtier-bench pull: --fetch lease, direct or both\n");
        return 2;
    }
    /* Per transport selection: its pulls, one per validation, then its ceiling, so
     * the rows of a selection run under the same load. */
    for (size_t k = 0; k < n_tls; k++) {
        struct bp_row *first = &rows[n_rows];
        double ceiling, ceiling_hot, ceiling_pages;

        for (size_t v = 0; v < n_verify; v++) {
            for (size_t f = 0; f < n_fetch; f++) {
                struct bp_row *r;

                /* Direct reads are fenced only: under checksums they are lease rows. */
                if (strcmp(fetches[f], "direct") == 0 && strcmp(verifies[v], "checksum") == 0)
                    continue;
                r = &rows[n_rows++];
                memset(r, 0, sizeof(*r));
                r->tls = rows_tls[k];
                r->verify = verifies[v];
                r->fetch = fetches[f];
                bp_set_tls(r->tls, false);
                if (bp_pull(simnode, n, size, per, inflight, r) != 0)
                    return 1;
                if (r->corrupt != 0 || r->hit != (int)n)
                    rc = 1;
            }
        }
        bp_set_tls(rows_tls[k], true);
        ceiling = bp_transport(self, size, reps, n, NULL);
        ceiling_hot = bp_transport(self, size, reps, 0, NULL);
        ceiling_pages = bp_transport(self, size, reps, n, bp_run_dir);
        for (struct bp_row *r = first; r < &rows[n_rows]; r++) {
            r->ceiling = ceiling;
            r->ceiling_hot = ceiling_hot;
            r->ceiling_pages = ceiling_pages;
        }
    }
    unsetenv("UCX_TLS");
    redis = bp_redis(n, size, clients, redis_cmd, sizeof(redis_cmd));
    copy_s = bp_copy_s(size, n);
    for (size_t k = 0; k < n_rows; k++) {
        struct bp_row *r = &rows[k];

        r->puller_us = r->hit ? r->cpu_b / r->hit * 1e6 : -1;
        r->holder_us = r->hit && r->cpu_a >= 0 ? r->cpu_a / r->hit * 1e6 : -1;
        r->puller_less_us = bp_less_copy_us(r->cpu_b, (unsigned)r->hit, copy_s);
        r->holder_less_us = bp_less_copy_us(r->cpu_a, (unsigned)r->hit, copy_s);
        r->puller_work_us =
            r->poll_b >= 0 ? bp_less_copy_us(r->cpu_b - r->poll_b, (unsigned)r->hit, copy_s) : -1;
        r->holder_work_us =
            r->poll_a >= 0 ? bp_less_copy_us(r->cpu_a - r->poll_a, (unsigned)r->hit, copy_s) : -1;
        r->holder_nopoll_us =
            r->poll_a >= 0 ? bp_less_copy_us(r->cpu_a - r->poll_a, (unsigned)r->hit, 0) : -1;
    }
    bp_mooncake(mc_python, KVT_BENCH_MOONCAKE_SCRIPT, n, size, per, inflight, &mc);
    bp_thp(thp, sizeof(thp));

    if (json) {
        printf("{\"bench\":\"pull\",\"chunks\":%u,\"size\":%zu,\"req_keys\":%u,\"inflight\":%u,"
               "\"redis_gbps\":%.3f,\"copy_us_per_chunk\":%.2f,"
               "\"mooncake\":{\"status\":\"%s\",\"protocol\":\"tcp\","
               "\"gbps\":%.3f,\"req_ms_p50\":%.1f,\"req_ms_p99\":%.1f,\"inflight\":%d,"
               "\"cold_gbps\":%.3f},"
               "\"rows\":[",
               n, size, per, inflight, redis, copy_s * 1e6, mc.status, mc.gbps, mc.req_p50,
               mc.req_p99, mc.inflight, mc.cold_gbps);
        for (size_t k = 0; k < n_rows; k++) {
            const struct bp_row *r = &rows[k];

            printf("%s{\"ucx_tls\":\"%s\",\"verify\":\"%s\",\"fetch\":\"%s\","
                   "\"direct_chunks\":%.0f,\"verify_ms\":%.1f,"
                   "\"hit\":%d,\"corrupt\":%d,\"requests\":%d,"
                   "\"seconds\":%.3f,\"gbps\":%.3f,\"req_lookup_to_hit_ms_p50\":%.1f,"
                   "\"req_lookup_to_hit_ms_p99\":%.1f,\"key_lookup_to_hit_ms_p50\":%.1f,"
                   "\"key_lookup_to_hit_ms_p99\":%.1f,\"transport_gbps\":%.3f,"
                   "\"ratio_transport\":%.3f,\"transport_cached_gbps\":%.3f,"
                   "\"ratio_transport_cached\":%.3f,\"transport_same_pages_gbps\":%.3f,"
                   "\"ratio_transport_same_pages\":%.3f,\"ratio_redis\":%.3f,"
                   "\"puller_cpu_us_per_chunk\":%.2f,\"holder_cpu_us_per_chunk\":%.2f,"
                   "\"puller_cpu_us_per_chunk_less_copy\":%.2f,"
                   "\"holder_cpu_us_per_chunk_less_copy\":%.2f,"
                   "\"puller_core_nic_fraction_200g\":%.3f,\"puller_core_nic_fraction_400g\":%.3f,"
                   "\"holder_core_nic_fraction_200g\":%.3f,\"holder_core_nic_fraction_400g\":%.3f,"
                   "\"primary_huge_a\":%.3f,\"primary_huge_b\":%.3f,"
                   "\"puller_poll_us_per_chunk\":%.2f,\"holder_poll_us_per_chunk\":%.2f,"
                   "\"puller_cpu_us_per_chunk_less_copy_and_poll\":%.2f,"
                   "\"holder_cpu_us_per_chunk_less_copy_and_poll\":%.2f,"
                   "\"holder_cpu_us_per_chunk_less_poll\":%.2f,"
                   "\"ratio_mooncake\":%.3f}",
                   k ? "," : "", r->tls, r->verify, r->fetch, r->direct, r->verify_ms, r->hit,
                   r->corrupt, r->requests, r->secs, r->gbps, r->req_p50, r->req_p99, r->key_p50,
                   r->key_p99, r->ceiling, r->ceiling > 0 ? r->gbps / r->ceiling : 0,
                   r->ceiling_hot, r->ceiling_hot > 0 ? r->gbps / r->ceiling_hot : 0,
                   r->ceiling_pages, r->ceiling_pages > 0 ? r->gbps / r->ceiling_pages : 0,
                   redis > 0 ? r->gbps / redis : 0, r->puller_us, r->holder_us, r->puller_less_us,
                   r->holder_less_us, bp_nic_fraction(r->puller_less_us, size, 200),
                   bp_nic_fraction(r->puller_less_us, size, 400),
                   bp_nic_fraction(r->holder_less_us, size, 200),
                   bp_nic_fraction(r->holder_less_us, size, 400), r->huge_a, r->huge_b,
                   r->hit && r->poll_b >= 0 ? r->poll_b / r->hit * 1e6 : -1,
                   r->hit && r->poll_a >= 0 ? r->poll_a / r->hit * 1e6 : -1, r->puller_work_us,
                   r->holder_work_us, r->holder_nopoll_us, mc.gbps > 0 ? r->gbps / mc.gbps : 0);
        }
        printf("],\"run_dir\":\"%s\",\"thp_enabled\":\"%s\"}\n", bp_run_dir, thp);
        return rc;
    }
    printf("pull: B pulls %u chunks of %zu B that A holds (127.0.0.1), as requests of %u keys, "
           "%u in flight\n",
           n, size, per, inflight);
    printf("  %-8s %-8s %-6s %9s %9s %6s %9s %6s %9s %6s %9s %6s %13s %6s %21s %17s %10s\n",
           "UCX_TLS", "verify", "fetch", "pull GB/s", "ceiling", "ratio", "on pages", "ratio",
           "cached", "ratio", "redis", "ratio", "mooncake GB/s", "ratio", "req lookup-to-HIT ms",
           "key p50/p99 ms", "verify ms");
    for (size_t k = 0; k < n_rows; k++) {
        const struct bp_row *r = &rows[k];
        char mcb[16], mcr[16];

        /* No figure when Mooncake was not measured: the column says why. */
        if (mc.gbps > 0) {
            snprintf(mcb, sizeof(mcb), "%.3f", mc.gbps);
            snprintf(mcr, sizeof(mcr), "%.3f", r->gbps / mc.gbps);
        } else {
            snprintf(mcb, sizeof(mcb), "%s", mc.status);
            snprintf(mcr, sizeof(mcr), "-");
        }
        printf("  %-8s %-8s %-6s %9.3f %9.3f %6.3f %9.3f %6.3f %9.3f %6.3f %9.3f %6.3f %13s %6s "
               "%10.1f / %8.1f %8.1f / %6.1f %10.1f  (%d hit, %.0f direct, %d corrupt, %d "
               "requests, %.3f s)\n",
               r->tls, r->verify, r->fetch, r->gbps, r->ceiling,
               r->ceiling > 0 ? r->gbps / r->ceiling : 0, r->ceiling_pages,
               r->ceiling_pages > 0 ? r->gbps / r->ceiling_pages : 0, r->ceiling_hot,
               r->ceiling_hot > 0 ? r->gbps / r->ceiling_hot : 0, redis,
               redis > 0 ? r->gbps / redis : 0, mcb, mcr, r->req_p50, r->req_p99, r->key_p50,
               r->key_p99, r->verify_ms, r->hit, r->direct, r->corrupt, r->requests, r->secs);
    }
    printf("  CPU per chunk (us; less one memcpy of the chunk, %.1f us) and the share of a 200 / "
           "400 Gb/s NIC one core keeps busy at that cost:\n",
           copy_s * 1e6);
    for (size_t k = 0; k < n_rows; k++) {
        const struct bp_row *r = &rows[k];

        printf("  %-8s %-8s %-6s puller %7.1f (%7.1f) %4.2f / %4.2f   holder %7.1f (%7.1f) %4.2f / "
               "%4.2f\n",
               r->tls, r->verify, r->fetch, r->puller_us, r->puller_less_us,
               bp_nic_fraction(r->puller_less_us, size, 200),
               bp_nic_fraction(r->puller_less_us, size, 400), r->holder_us, r->holder_less_us,
               bp_nic_fraction(r->holder_less_us, size, 200),
               bp_nic_fraction(r->holder_less_us, size, 400));
    }
    printf("  the same less the loop's busy poll (its wall time with nothing arriving while "
           "transfers were in flight, us per chunk), and what one core keeps busy then (over "
           "shared memory the puller copies: the holder's figure less poll only):\n");
    for (size_t k = 0; k < n_rows; k++) {
        const struct bp_row *r = &rows[k];

        printf("  %-8s %-8s %-6s puller poll %5.1f, less copy and poll %5.1f %4.2f / %4.2f   "
               "holder poll %5.1f, less poll %5.1f, less copy and poll %5.1f %4.2f / %4.2f\n",
               r->tls, r->verify, r->fetch,
               r->hit && r->poll_b >= 0 ? r->poll_b / r->hit * 1e6 : -1, r->puller_work_us,
               bp_nic_fraction(r->puller_work_us, size, 200),
               bp_nic_fraction(r->puller_work_us, size, 400),
               r->hit && r->poll_a >= 0 ? r->poll_a / r->hit * 1e6 : -1, r->holder_nopoll_us,
               r->holder_work_us, bp_nic_fraction(r->holder_work_us, size, 200),
               bp_nic_fraction(r->holder_work_us, size, 400));
    }
    printf("  ceiling: the transport moving the same %u distinct chunks between anonymous buffers; "
           "on pages: the same between files in %s, the nodes' kind of pages; cached: its READs "
           "of 32 chunks read again and again (in the caches)\n",
           n, bp_run_dir);
    /* The copy over shared memory pins and walks the holder's pages: 512 times fewer
     * on huge pages, so say what each side ran on. */
    printf("  pages: the nodes' primaries in %s, on huge pages (A / B):", bp_run_dir);
    for (size_t k = 0; k < n_rows; k++)
        printf("%s %.0f%% / %.0f%%", k ? "," : "", rows[k].huge_a * 100, rows[k].huge_b * 100);
    printf("; the ceiling's buffers: anonymous, advised for transparent huge pages "
           "(transparent_hugepage/enabled: %s)\n",
           thp);
    printf("  targets: >= 0.8 x the ceiling, >= 1.5 x redis (%s)\n",
           redis > 0 ? redis_cmd : "redis not measured: redis-server / redis-benchmark missing");
    if (mc.gbps > 0)
        printf("  mooncake: Mooncake Store over tcp on 127.0.0.1 (%s): its best pass %d in "
               "flight, request p50 / p99 %.1f / %.1f ms; its untimed first pass %.3f GB/s\n",
               mc.cmd, mc.inflight, mc.req_p50, mc.req_p99, mc.cold_gbps);
    else if (strcmp(mc.status, "absent") == 0)
        printf("  mooncake not measured: %s\n",
               mc_python == NULL ? "--no-mooncake"
                                 : "no Mooncake venv (tools/mooncake-env, or --mooncake-python)");
    else
        printf("  mooncake failed: %s did not get every chunk back intact (its stderr says why)\n",
               mc.cmd);
    return rc;
}

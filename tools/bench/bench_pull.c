/* kvtier-bench pull: two nodes on 127.0.0.1; A holds N chunks of 256 KiB, B pulls
 * them all through its manager (lookup, LOCATE, FETCH, READ, checksum verify,
 * RELEASE, byte check against the expected content: everything included). Reported
 * as GB/s and p50/p99 lookup-to-HIT time, side by side in the same run with:
 *   - the transport ceiling: `kvtier-bench transport` (same size, batches of 32);
 *   - redis-benchmark GET of 256 KiB values against a local redis-server (what users
 *     pick instead today), with the same number of values.
 * The nodes are kvtier-simnode processes (tools/simnode), found next to this binary's
 * build folder or with --simnode PATH. UCX_TLS defaults to tcp for all three. */
#include <errno.h>
#include <fcntl.h>
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

/* Transport ceiling in GB/s from `<self> transport --json`; < 0 on failure. */
static double bp_transport(const char *self, size_t size)
{
    char buf[4200], line[4096];
    FILE *f;
    double mbps = -1;

    snprintf(buf, sizeof(buf), "%s transport --json --size %zu --batch 32 2>/dev/null", self, size);
    f = popen(buf, "r");
    while (f != NULL && fgets(line, sizeof(line), f) != NULL) {
        const char *s = strstr(line, "\"read_mbps\":");

        if (s != NULL && mbps < 0)
            mbps = strtod(s + 12, NULL);
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

int kvt_bench_pull(int argc, char **argv)
{
    unsigned n = 1000, clients = 4;
    size_t size = 262144;
    bool json = false;
    char simnode[4096], secret[] = "/tmp/kvtier-bench-pull-secret-XXXXXX";
    char line[1024], cmd[256], portb[16], seed[64], nb[32], sizeb[32], redis_cmd[256];
    struct proc a = {0}, b = {0};
    double t0, secs, gbps, ms_p50, ms_p99, ceiling, redis;
    int fd, hit, corrupt;
    char self[4096];
    ssize_t sl;

    sl = readlink("/proc/self/exe", self, sizeof(self) - 1);
    self[sl > 0 ? sl : 0] = '\0';
    bp_default_simnode(self, simnode, sizeof(simnode));
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--json") == 0)
            json = true;
        else if (strcmp(argv[i], "--chunks") == 0 && i + 1 < argc)
            n = (unsigned)strtoul(argv[++i], NULL, 0);
        else if (strcmp(argv[i], "--size") == 0 && i + 1 < argc)
            size = strtoull(argv[++i], NULL, 0);
        else if (strcmp(argv[i], "--simnode") == 0 && i + 1 < argc)
            snprintf(simnode, sizeof(simnode), "%s", argv[++i]);
        else {
            fprintf(stderr, "usage: kvtier-bench pull [--json] [--chunks 1000] [--size 262144] "
                            "[--simnode PATH]\n");
            return 2;
        }
    }
    if (access(simnode, X_OK) != 0) {
        fprintf(stderr, "kvtier-bench pull: %s not found (build tools/simnode or --simnode)\n",
                simnode);
        return 1;
    }
    setenv("UCX_TLS", getenv("UCX_TLS") ? getenv("UCX_TLS") : "tcp", 1);
    fd = mkstemp(secret);
    if (fd < 0 || write(fd, "kvtier-bench pull shared secret 0123\n", 37) != 37) {
        fprintf(stderr, "kvtier-bench pull: cannot write a secret file\n");
        return 1;
    }
    close(fd);
    snprintf(nb, sizeof(nb), "%u", n + 16);
    snprintf(sizeb, sizeof(sizeb), "%zu", size);
    {
        char *av[] = {simnode,    "--id", "1",     "--secret", secret,
                      "--chunks", nb,     "--row", sizeb,      NULL};

        if (bp_spawn(&a, av) != 0 || !bp_answer(&a, line, sizeof(line)) ||
            sscanf(line, "ready id=%*x port=%15s", portb) != 1) {
            fprintf(stderr, "kvtier-bench pull: node A did not start\n");
            unlink(secret);
            return 1;
        }
    }
    snprintf(seed, sizeof(seed), "127.0.0.1:%s", portb);
    {
        char *av[] = {simnode, "--id",  "2",   "--secret", secret, "--chunks",
                      nb,      "--row", sizeb, "--peer",   seed,   NULL};

        if (bp_spawn(&b, av) != 0 || !bp_answer(&b, line, sizeof(line))) {
            fprintf(stderr, "kvtier-bench pull: node B did not start\n");
            bp_stop(&a);
            unlink(secret);
            return 1;
        }
    }
    if (!bp_cmd(&a, line, sizeof(line), "wait-live 2 10000") ||
        !bp_cmd(&b, line, sizeof(line), "wait-live 2 10000")) {
        fprintf(stderr, "kvtier-bench pull: the nodes did not see each other: %s", line);
        goto fail;
    }
    snprintf(cmd, sizeof(cmd), "store 1 0 %u", n);
    if (!bp_cmd(&a, line, sizeof(line), cmd))
        goto fail;
    snprintf(cmd, sizeof(cmd), "load 1 0 %u 120000", n);
    t0 = bp_now_s();
    if (!bp_cmd(&b, line, sizeof(line), cmd))
        goto fail;
    secs = bp_now_s() - t0;
    hit = (int)bp_field(line, "hit");
    corrupt = (int)bp_field(line, "corrupt");
    secs = bp_field(line, "seconds") > 0 ? bp_field(line, "seconds") : secs;
    gbps = (double)hit * (double)size / secs / 1e9;
    ms_p50 = bp_field(line, "ms_p50");
    ms_p99 = bp_field(line, "ms_p99");
    bp_stop(&a);
    bp_stop(&b);
    unlink(secret);

    ceiling = bp_transport(self, size);
    redis = bp_redis(n, size, clients, redis_cmd, sizeof(redis_cmd));

    if (json) {
        printf("{\"bench\":\"pull\",\"chunks\":%u,\"size\":%zu,\"hit\":%d,\"corrupt\":%d,"
               "\"seconds\":%.3f,\"gbps\":%.3f,\"lookup_to_hit_ms_p50\":%.1f,"
               "\"lookup_to_hit_ms_p99\":%.1f,\"transport_gbps\":%.3f,\"redis_gbps\":%.3f,"
               "\"ratio_transport\":%.3f,\"ratio_redis\":%.3f}\n",
               n, size, hit, corrupt, secs, gbps, ms_p50, ms_p99, ceiling, redis,
               ceiling > 0 ? gbps / ceiling : 0, redis > 0 ? gbps / redis : 0);
    } else {
        printf("pull: B pulls %u chunks of %zu B that A holds (UCX_TLS=%s, 127.0.0.1)\n", n, size,
               getenv("UCX_TLS"));
        printf("  kvtier pull       %8.3f GB/s  (%d hit, %d corrupt, %.3f s; lookup-to-HIT "
               "p50 %.1f ms p99 %.1f ms)\n",
               gbps, hit, corrupt, secs, ms_p50, ms_p99);
        if (ceiling > 0)
            printf("  transport ceiling %8.3f GB/s  ratio %.3f (target >= 0.8: %s)\n", ceiling,
                   gbps / ceiling, gbps / ceiling >= 0.8 ? "met" : "NOT met");
        else
            printf("  transport ceiling: not measured (kvtier-bench transport failed)\n");
        if (redis > 0)
            printf("  redis GET         %8.3f GB/s  ratio %.3f (target >= 1.5: %s)  (%s)\n", redis,
                   gbps / redis, gbps / redis >= 1.5 ? "met" : "NOT met", redis_cmd);
        else
            printf("  redis: not measured (redis-server / redis-benchmark missing)\n");
    }
    return corrupt == 0 && hit == (int)n ? 0 : 1;
fail:
    fprintf(stderr, "kvtier-bench pull: failed: %s", line);
    bp_stop(&a);
    bp_stop(&b);
    unlink(secret);
    return 1;
}

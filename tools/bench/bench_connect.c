/* kvtier-bench connect: how long a peer link takes to come up, from the dial to the
 * end of the authenticated handshake (kvt/peers.h: HELLO, HELLO_ACK, AUTH, AUTH_OK),
 * between two processes on 127.0.0.1.
 *
 * A server process (a fork, node 1) listens and serves links for the whole run. The
 * client (node 2) creates a fresh kvt_peers per iteration, seeded with the server:
 * the clock starts right before its first progress (which dials the seed) and stops
 * when kvt_peers_link() names the server, i.e. when the client's link is UP. Opening
 * the transport (ucp_init, listen) is before the clock; destroying it after. Both
 * sides wait on their event fd when idle, as a node's loop does (no busy polling).
 * --iters (50) links; min, p10, median, p90 and max in microseconds. UCX_TLS=tcp and
 * UCX_NET_DEVICES=lo unless the environment sets them. */
#include <errno.h>
#include <inttypes.h>
#include <poll.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "bench.h"
#include "kvt/auth.h"
#include "kvt/log.h"
#include "kvt/peers.h"

#define BC_MAX_ITERS 10000

static const uint8_t bc_secret[] = "kvtier-bench-connect-secret-0123456789";

static uint64_t bc_now_ns(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void bc_config(struct kvt_peers_config *c, uint64_t id, const char *backend)
{
    memset(c, 0, sizeof(*c));
    c->node_id = id;
    kvt_auth_namespace("kvtier-bench-connect", c->ns);
    c->secret = bc_secret;
    c->secret_len = sizeof(bc_secret) - 1;
    c->listen_addr = "127.0.0.1";
    c->transport.backend = backend;
}

/* One loop turn: progress, and sleep on the event fd when there was nothing to do. */
static int bc_turn(struct kvt_peers *p)
{
    int n = kvt_peers_progress(p);

    if (n < 0)
        return n;
    if (n == 0 && kvt_peers_arm(p) == 0) {
        struct pollfd pfd = {.fd = kvt_peers_event_fd(p), .events = POLLIN};

        poll(&pfd, 1, kvt_peers_next_timeout_ms(p));
    }
    return 0;
}

static volatile sig_atomic_t bc_stop;

static void bc_on_term(int sig)
{
    (void)sig;
    bc_stop = 1;
}

static int bc_server(const char *backend, int ready_fd)
{
    struct kvt_peers_config c;
    struct kvt_peers *p;
    int rc;

    signal(SIGTERM, bc_on_term);
    bc_config(&c, 1, backend);
    rc = kvt_peers_create(&c, &p);
    if (rc < 0) {
        fprintf(stderr, "bench server: %s\n", strerror(-rc));
        return 1;
    }
    dprintf(ready_fd, "%u\n", kvt_peers_port(p));
    close(ready_fd);
    while (!bc_stop && rc == 0)
        rc = bc_turn(p);
    kvt_peers_destroy(p);
    return rc == 0 ? 0 : 1;
}

/* One link: microseconds from the first progress to UP, or negative errno. */
static int64_t bc_one(const char *backend, uint16_t port)
{
    char seed[32];
    const char *seeds[1] = {seed};
    struct kvt_peers_config c;
    struct kvt_peers *p;
    uint64_t t0, t1 = 0, deadline;
    int rc;

    snprintf(seed, sizeof(seed), "127.0.0.1:%u", port);
    bc_config(&c, 2, backend);
    c.seeds = seeds;
    c.n_seeds = 1;
    rc = kvt_peers_create(&c, &p);
    if (rc < 0)
        return rc;
    t0 = bc_now_ns();
    deadline = t0 + 10ull * 1000000000ull;
    while (rc == 0) {
        if (kvt_peers_link(p, 1) != NULL) {
            t1 = bc_now_ns();
            break;
        }
        if (bc_now_ns() > deadline) {
            rc = -ETIMEDOUT;
            break;
        }
        rc = bc_turn(p);
    }
    kvt_peers_destroy(p);
    return rc < 0 ? rc : (int64_t)((t1 - t0) / 1000);
}

static int bc_cmp(const void *a, const void *b)
{
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;

    return x < y ? -1 : x > y;
}

static int bc_usage(void)
{
    fprintf(stderr, "usage: kvtier-bench connect [--json] [--backend ucx] [--iters 50]\n");
    return 2;
}

int kvt_bench_connect(int argc, char **argv)
{
    const char *backend = "ucx";
    unsigned iters = 50;
    bool json = false;
    int fds[2], st;
    char line[32] = {0};
    unsigned port;
    int64_t *us;
    pid_t srv;

    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--json") == 0)
            json = true;
        else if (strcmp(argv[i], "--backend") == 0 && i + 1 < argc)
            backend = argv[++i];
        else if (strcmp(argv[i], "--iters") == 0 && i + 1 < argc)
            iters = (unsigned)strtoul(argv[++i], NULL, 10);
        else
            return bc_usage();
    }
    if (iters == 0 || iters > BC_MAX_ITERS)
        return bc_usage();
    setenv("UCX_TLS", "tcp", 0);
    setenv("UCX_NET_DEVICES", "lo", 0);
    if (getenv("KVT_LOG") == NULL)
        kvt_log_set_level(KVT_LOG_ERROR);
    us = calloc(iters, sizeof(*us));
    if (us == NULL || pipe(fds) < 0)
        return 1;
    srv = fork();
    if (srv < 0)
        return 1;
    if (srv == 0) {
        close(fds[0]);
        _exit(bc_server(backend, fds[1]));
    }
    close(fds[1]);
    if (read(fds[0], line, sizeof(line) - 1) <= 0 || sscanf(line, "%u", &port) != 1) {
        fprintf(stderr, "kvtier-bench connect: the server did not start\n");
        waitpid(srv, &st, 0);
        return 1;
    }
    close(fds[0]);
    for (unsigned i = 0; i < iters; i++) {
        us[i] = bc_one(backend, (uint16_t)port);
        if (us[i] < 0) {
            fprintf(stderr, "kvtier-bench connect: link %u: %s\n", i, strerror((int)-us[i]));
            kill(srv, SIGTERM);
            waitpid(srv, &st, 0);
            free(us);
            return 1;
        }
    }
    kill(srv, SIGTERM);
    waitpid(srv, &st, 0);
    qsort(us, iters, sizeof(*us), bc_cmp);

    int64_t p10 = us[iters / 10], p50 = us[iters / 2], p90 = us[iters * 9 / 10];

    if (json)
        printf("{\"bench\":\"connect\",\"backend\":\"%s\",\"ucx_tls\":\"%s\",\"iters\":%u,"
               "\"us\":{\"min\":%" PRId64 ",\"p10\":%" PRId64 ",\"median\":%" PRId64
               ",\"p90\":%" PRId64 ",\"max\":%" PRId64 "}}\n",
               backend, getenv("UCX_TLS"), iters, us[0], p10, p50, p90, us[iters - 1]);
    else
        printf("connect -> UP, %s (UCX_TLS=%s), two processes on 127.0.0.1, %u links, us:\n"
               "  min %" PRId64 "  p10 %" PRId64 "  median %" PRId64 "  p90 %" PRId64
               "  max %" PRId64 "\n",
               backend, getenv("UCX_TLS"), iters, us[0], p10, p50, p90, us[iters - 1]);
    free(us);
    return WIFEXITED(st) && WEXITSTATUS(st) == 0 ? 0 : 1;
}

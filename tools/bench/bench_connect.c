/* kvtier-bench connect: how long a peer link takes to come up, from the dial to the
 * end of the authenticated handshake (kvt/peers.h: HELLO, HELLO_ACK, AUTH, AUTH_OK),
 * between two processes on 127.0.0.1.
 *
 * A server process (a fork, node 1) listens and serves links for the whole run. The
 * client (node 2) creates a fresh kvt_peers per iteration, seeded with the server:
 * the clock starts right before its first progress (which dials the seed) and stops
 * when kvt_peers_link() names the server, i.e. when the client's link is UP. A
 * second figure goes on to the first round trip on the link: a LOCATE the server
 * answers (its reply is the first message we get after UP besides heartbeats), so it
 * includes whatever the transport still sets up after the handshake. Opening the
 * transport (ucp_init, listen) is before the clock; destroying it after. Both sides
 * wait on their event fd when idle, as a node's loop does (no busy polling: on a
 * shared 2-core machine two spinning processes measured 3x slower).
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

/* Server: answers every LOCATE with an empty LOCATE_REPLY. */
static void bc_srv_msg(void *arg, uint64_t from, struct kvt_tp_ep *ep, const struct kvt_wire_msg *m)
{
    struct kvt_peers *p = *(struct kvt_peers **)arg;
    struct kvt_wire_msg r;

    (void)from;
    if (m->type != KVT_WIRE_LOCATE)
        return;
    kvt_wire_msg_init(&r, KVT_WIRE_LOCATE_REPLY);
    r.u.locate_reply.req_id = m->u.locate.req_id;
    (void)kvt_peers_reply(p, ep, &r);
}

/* Client: the reply's arrival time. */
static void bc_cli_msg(void *arg, uint64_t from, struct kvt_tp_ep *ep, const struct kvt_wire_msg *m)
{
    (void)from;
    (void)ep;
    if (m->type == KVT_WIRE_LOCATE_REPLY && *(uint64_t *)arg == 0)
        *(uint64_t *)arg = bc_now_ns();
}

static int bc_server(const char *backend, int ready_fd)
{
    static struct kvt_peers *p;
    struct kvt_peers_config c;
    int rc;

    signal(SIGTERM, bc_on_term);
    bc_config(&c, 1, backend);
    c.h = (struct kvt_peers_handlers){.on_msg = bc_srv_msg, .arg = &p};
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

/* One link: microseconds from the first progress to UP (*up_p) and to the reply of
 * the first request (*rt_p); 0 or negative errno. */
static int bc_one(const char *backend, uint16_t port, int64_t *up_p, int64_t *rt_p)
{
    char seed[32];
    const char *seeds[1] = {seed};
    struct kvt_peers_config c;
    struct kvt_peers *p;
    struct kvt_wire_msg m;
    uint64_t t0, t1 = 0, t2 = 0, deadline;
    int rc;

    snprintf(seed, sizeof(seed), "127.0.0.1:%u", port);
    bc_config(&c, 2, backend);
    c.seeds = seeds;
    c.n_seeds = 1;
    c.h = (struct kvt_peers_handlers){.on_msg = bc_cli_msg, .arg = &t2};
    rc = kvt_peers_create(&c, &p);
    if (rc < 0)
        return rc;
    t0 = bc_now_ns();
    deadline = t0 + 10ull * 1000000000ull;
    while (rc == 0 && t2 == 0) {
        if (t1 == 0 && kvt_peers_link(p, 1) != NULL) {
            t1 = bc_now_ns();
            kvt_wire_msg_init(&m, KVT_WIRE_LOCATE);
            m.u.locate.req_id = 1;
            rc = kvt_peers_send(p, 1, &m);
            if (rc < 0)
                break;
        }
        if (bc_now_ns() > deadline) {
            rc = -ETIMEDOUT;
            break;
        }
        rc = bc_turn(p);
    }
    kvt_peers_destroy(p);
    if (rc < 0)
        return rc;
    *up_p = (int64_t)((t1 - t0) / 1000);
    *rt_p = (int64_t)((t2 - t0) / 1000);
    return 0;
}

static int bc_cmp(const void *a, const void *b)
{
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;

    return x < y ? -1 : x > y;
}

static void bc_line(const char *what, const int64_t *v, unsigned n)
{
    printf("  %s min %" PRId64 "  p10 %" PRId64 "  median %" PRId64 "  p90 %" PRId64
           "  max %" PRId64 "\n",
           what, v[0], v[n / 10], v[n / 2], v[n * 9 / 10], v[n - 1]);
}

static void bc_json(const char *name, const int64_t *v, unsigned n)
{
    printf(",\"%s\":{\"min\":%" PRId64 ",\"p10\":%" PRId64 ",\"median\":%" PRId64
           ",\"p90\":%" PRId64 ",\"max\":%" PRId64 "}",
           name, v[0], v[n / 10], v[n / 2], v[n * 9 / 10], v[n - 1]);
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
    int64_t *us, *rt;
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
    rt = calloc(iters, sizeof(*rt));
    if (us == NULL || rt == NULL || pipe(fds) < 0)
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
        int rc = bc_one(backend, (uint16_t)port, &us[i], &rt[i]);

        if (rc < 0) {
            fprintf(stderr, "kvtier-bench connect: link %u: %s\n", i, strerror(-rc));
            kill(srv, SIGTERM);
            waitpid(srv, &st, 0);
            free(us);
            free(rt);
            return 1;
        }
    }
    kill(srv, SIGTERM);
    waitpid(srv, &st, 0);
    qsort(us, iters, sizeof(*us), bc_cmp);
    qsort(rt, iters, sizeof(*rt), bc_cmp);
    if (json) {
        printf("{\"bench\":\"connect\",\"backend\":\"%s\",\"ucx_tls\":\"%s\",\"iters\":%u", backend,
               getenv("UCX_TLS"), iters);
        bc_json("up_us", us, iters);
        bc_json("first_rtt_us", rt, iters);
        printf("}\n");
    } else {
        printf("%s (UCX_TLS=%s), two processes on 127.0.0.1, %u links, us:\n", backend,
               getenv("UCX_TLS"), iters);
        bc_line("connect -> UP            ", us, iters);
        bc_line("connect -> first reply   ", rt, iters);
    }
    free(us);
    free(rt);
    return WIFEXITED(st) && WEXITSTATUS(st) == 0 ? 0 : 1;
}

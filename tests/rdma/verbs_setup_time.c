/* How long a verbs connection takes until the peer may READ (issue #21, docs/rdma.md
 * "Who may read"), on a real RDMA device (the tests/rdma guests):
 *
 *   verbs_setup_time --addr A [--links N] [--label L]
 *
 * A fork serves; the parent makes N links one after the other (each closed before
 * the next) and times, from the call that dials:
 *   transport  kvt_tp_connect -> CONNECTED; then its own kvt_tp_ep_authorize (the
 *              call alone is timed too) -> the server's first message, which the
 *              server sends from on_accept right after authorizing its end: the
 *              moment both ends are authorized and the client knows it;
 *   link       a fresh kvt_peers per link, seeded with the server's kvt_peers: the
 *              first progress -> kvt_peers_link() names the server (the client's
 *              link is UP: HELLO, HELLO_ACK, AUTH, AUTH_OK, both ends authorized).
 * Median, p10 and p90 in microseconds, printed and written to
 * $KVT_RESULTS/setup_time_<label>.txt. Both sides sleep on their event fd when idle.
 *
 * Built with -DKVT_NO_AUTHORIZE against the transport before ep_authorize existed, it
 * times that transport the same way (no authorize calls): the "before" figures. */
#include <errno.h>
#include <getopt.h>
#include <poll.h>
#include <signal.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "kvt/auth.h"
#include "kvt/peers.h"
#include "kvt/transport.h"

#define MAX_LINKS 1000
#define SERVER_ID 1
#define WAIT_MS   30000

static uint64_t now_us(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000ull + (uint64_t)ts.tv_nsec / 1000;
}

static volatile sig_atomic_t stop;

static void on_term(int sig)
{
    (void)sig;
    stop = 1;
}

static void wait_fd(int fd, int ms)
{
    struct pollfd pfd = {.fd = fd, .events = POLLIN};

    poll(&pfd, 1, ms);
}

/* ---- transport level ---- */

static struct {
    bool connected, msg, closed;
    uint64_t t_conn, t_msg, auth_us;
    int auth_err;
} C;

static int srv_accept(void *arg, struct kvt_tp_ep *ep)
{
    uint8_t one = 1;
    int rc = 0;

    (void)arg;
#ifndef KVT_NO_AUTHORIZE
    rc = kvt_tp_ep_authorize(ep);
#endif
    if (rc == 0)
        rc = kvt_tp_send(ep, &one, 1);
    if (rc != 0)
        fprintf(stderr, "server: authorize/send: %s\n", strerror(-rc));
    return rc;
}

static void srv_state(void *arg, struct kvt_tp_ep *ep, enum kvt_ep_state st, int err)
{
    (void)arg;
    (void)ep;
    (void)st;
    (void)err;
}

static void cli_state(void *arg, struct kvt_tp_ep *ep, enum kvt_ep_state st, int err)
{
    (void)arg;
    if (st == KVT_EP_CONNECTED) {
        C.connected = true;
        C.t_conn = now_us();
#ifndef KVT_NO_AUTHORIZE
        C.auth_err = kvt_tp_ep_authorize(ep);
        C.auth_us = now_us() - C.t_conn;
#endif
    } else {
        C.closed = true;
        if (!C.msg)
            fprintf(stderr, "client: closed before the first message: %s\n", strerror(-err));
    }
}

static void cli_msg(void *arg, struct kvt_tp_ep *ep, const void *buf, size_t len)
{
    (void)arg;
    (void)ep;
    (void)buf;
    (void)len;
    if (!C.msg) {
        C.msg = true;
        C.t_msg = now_us();
    }
}

static int tp_pump(struct kvt_transport *tp, bool *flag)
{
    uint64_t end = now_us() + WAIT_MS * 1000ull;

    while (!*flag) {
        int n = kvt_tp_progress(tp);

        if (n < 0)
            return n;
        if (now_us() >= end)
            return -ETIMEDOUT;
        if (n == 0 && kvt_tp_arm(tp) == 0)
            wait_fd(kvt_tp_event_fd(tp), 20);
    }
    return 0;
}

static int tp_server(const char *addr, int ready_fd)
{
    struct kvt_transport_config cfg = {.backend = "verbs",
                                       .cb = {.on_accept = srv_accept, .on_ep_state = srv_state}};
    struct kvt_transport *tp;
    uint16_t port;
    int rc = kvt_tp_open(&cfg, &tp);

    if (rc == 0)
        rc = kvt_tp_listen(tp, addr, 0, &port);
    if (rc != 0) {
        fprintf(stderr, "server: %s\n", strerror(-rc));
        return 1;
    }
    dprintf(ready_fd, "%u\n", port);
    close(ready_fd);
    while (!stop) {
        int n = kvt_tp_progress(tp);

        if (n < 0)
            break;
        if (n == 0 && kvt_tp_arm(tp) == 0)
            wait_fd(kvt_tp_event_fd(tp), 50);
    }
    kvt_tp_close(tp);
    return 0;
}

static int tp_links(const char *addr, uint16_t port, unsigned n, uint64_t *conn, uint64_t *both,
                    uint64_t *auth)
{
    struct kvt_transport_config cfg = {
        .backend = "verbs",
        .cb = {.on_ep_state = cli_state, .on_msg = cli_msg},
    };
    struct kvt_transport *tp;
    int rc = kvt_tp_open(&cfg, &tp);

    if (rc != 0)
        return rc;
    for (unsigned i = 0; i < n && rc == 0; i++) {
        struct kvt_tp_ep *ep;
        uint64_t t0;

        memset(&C, 0, sizeof(C));
        t0 = now_us();
        rc = kvt_tp_connect(tp, addr, port, NULL, &ep);
        if (rc == 0)
            rc = tp_pump(tp, &C.msg);
        if (rc == 0 && C.auth_err != 0)
            rc = C.auth_err;
        if (rc != 0) {
            fprintf(stderr, "client: link %u: %s\n", i, strerror(-rc));
            break;
        }
        conn[i] = C.t_conn - t0;
        both[i] = C.t_msg - t0;
        auth[i] = C.auth_us;
        kvt_tp_ep_close(ep);
        rc = tp_pump(tp, &C.closed);
    }
    kvt_tp_close(tp);
    return rc;
}

/* ---- link level (kvt_peers) ---- */

static const uint8_t secret[32] = "verbs_setup_time verbs_setup_t";

static void peers_cfg(struct kvt_peers_config *cfg, uint64_t id, const char *addr)
{
    memset(cfg, 0, sizeof(*cfg));
    cfg->node_id = id;
    cfg->secret = secret;
    cfg->secret_len = sizeof(secret);
    cfg->listen_addr = addr;
    /* No heartbeat tick during a run: each tick re-dials every member without a
     * link, and the server knows every client of the run (all gone but the last),
     * each dial a whole endpoint (~8.6 MiB of buffers with the defaults): after 90
     * links that burst took a 1 GiB guest out of memory, and smaller ones skewed the
     * figures. */
    cfg->heartbeat_ms = 3600u * 1000u;
    cfg->transport.backend = "verbs";
    kvt_auth_namespace("verbs_setup_time", cfg->ns);
}

static int peers_server(const char *addr, int ready_fd)
{
    struct kvt_peers_config cfg;
    struct kvt_peers *p;
    int rc;

    peers_cfg(&cfg, SERVER_ID, addr);
    rc = kvt_peers_create(&cfg, &p);
    if (rc != 0) {
        fprintf(stderr, "server: kvt_peers_create: %s\n", strerror(-rc));
        return 1;
    }
    dprintf(ready_fd, "%u\n", kvt_peers_port(p));
    close(ready_fd);
    while (!stop) {
        int n = kvt_peers_progress(p);

        if (n < 0)
            break;
        if (n == 0 && kvt_peers_arm(p) == 0) {
            int ms = kvt_peers_next_timeout_ms(p);

            wait_fd(kvt_peers_event_fd(p), ms < 0 || ms > 50 ? 50 : ms);
        }
    }
    kvt_peers_destroy(p);
    return 0;
}

static int peers_links(const char *addr, uint16_t port, unsigned n, uint64_t *up)
{
    char seed[96];
    const char *seeds[1] = {seed};

    snprintf(seed, sizeof(seed), "%s:%u", addr, port);
    for (unsigned i = 0; i < n; i++) {
        struct kvt_peers_config cfg;
        struct kvt_peers *p;
        uint64_t t0, end;
        int rc;

        peers_cfg(&cfg, 100 + i, addr);
        cfg.seeds = seeds;
        cfg.n_seeds = 1;
        rc = kvt_peers_create(&cfg, &p);
        if (rc != 0)
            return rc;
        t0 = now_us();
        end = t0 + WAIT_MS * 1000ull;
        while (kvt_peers_link(p, SERVER_ID) == NULL && rc == 0) {
            int k = kvt_peers_progress(p);

            if (k < 0)
                rc = k;
            else if (now_us() >= end)
                rc = -ETIMEDOUT;
            else if (k == 0 && kvt_peers_arm(p) == 0)
                wait_fd(kvt_peers_event_fd(p), 20);
        }
        up[i] = now_us() - t0;
        kvt_peers_destroy(p);
        if (rc != 0) {
            fprintf(stderr, "client: link %u: %s\n", i, strerror(-rc));
            return rc;
        }
    }
    return 0;
}

/* ---- main ---- */

static int cmp_u64(const void *x, const void *y)
{
    uint64_t a = *(const uint64_t *)x, b = *(const uint64_t *)y;

    return a < b ? -1 : a > b;
}

static void line(FILE *f, const char *label, const char *what, uint64_t *v, unsigned n)
{
    qsort(v, n, sizeof(*v), cmp_u64);
    fprintf(f, "%s %s: median %llu us, p10 %llu, p90 %llu (%u links)\n", label, what,
            (unsigned long long)v[n / 2], (unsigned long long)v[n / 10],
            (unsigned long long)v[n * 9 / 10], n);
}

static pid_t start_server(const char *addr, bool peers, uint16_t *port_p)
{
    char buf[16];
    int pfd[2];
    ssize_t k;
    pid_t pid;

    if (pipe(pfd) != 0)
        return -1;
    fflush(NULL);
    pid = fork();
    if (pid == 0) {
        struct sigaction sa = {.sa_handler = on_term};

        sigaction(SIGTERM, &sa, NULL);
        close(pfd[0]);
        _exit(peers ? peers_server(addr, pfd[1]) : tp_server(addr, pfd[1]));
    }
    close(pfd[1]);
    k = read(pfd[0], buf, sizeof(buf) - 1);
    close(pfd[0]);
    if (pid < 0 || k <= 0)
        return -1;
    buf[k] = '\0';
    *port_p = (uint16_t)strtoul(buf, NULL, 10);
    return pid;
}

int main(int argc, char **argv)
{
    static const struct option opts[] = {{"addr", required_argument, NULL, 'a'},
                                         {"links", required_argument, NULL, 'n'},
                                         {"label", required_argument, NULL, 'l'},
                                         {"only", required_argument, NULL, 'o'},
                                         {NULL, 0, NULL, 0}};
    static uint64_t conn[MAX_LINKS], both[MAX_LINKS], auth[MAX_LINKS], up[MAX_LINKS];
    const char *addr = NULL, *label = "after", *rdir = getenv("KVT_RESULTS"), *only = "";
    unsigned n = 30;
    uint16_t port = 0, port2 = 0;
    char path[4096];
    FILE *out;
    pid_t pid, pid2;
    int opt, rc;

    while ((opt = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        if (opt == 'a')
            addr = optarg;
        else if (opt == 'n')
            n = (unsigned)strtoul(optarg, NULL, 10);
        else if (opt == 'l')
            label = optarg;
        else if (opt == 'o')
            only = optarg;
        else
            return 2;
    }
    if (addr == NULL || n == 0 || n > MAX_LINKS) {
        fprintf(stderr, "usage: verbs_setup_time --addr A [--links 1..%d] [--label L]\n",
                MAX_LINKS);
        return 2;
    }
    /* Both servers fork before this process opens a device: a child cannot use the
     * uverbs files its parent opened (the kernel refuses other credentials, EACCES),
     * and librdmacm keeps its devices open for the life of the process. */
    pid = start_server(addr, false, &port);
    pid2 = start_server(addr, true, &port2);
    rc = pid < 0 || pid2 < 0         ? -ECHILD
         : strcmp(only, "link") != 0 ? tp_links(addr, port, n, conn, both, auth)
                                     : 0;
    if (rc == 0 && strcmp(only, "transport") != 0)
        rc = peers_links(addr, port2, n, up);
    if (pid > 0)
        kill(pid, SIGTERM);
    if (pid2 > 0)
        kill(pid2, SIGTERM);
    while (wait(NULL) > 0)
        ;
    if (rc != 0)
        return 1;
    snprintf(path, sizeof(path), "%s/setup_time_%s.txt", rdir != NULL ? rdir : ".", label);
    out = fopen(path, "w");
    for (int k = 0; k < 2; k++) {
        FILE *f = k == 0 ? stdout : out;

        if (f == NULL)
            continue;
        line(f, label, "transport connect -> CONNECTED", conn, n);
        line(f, label, "transport connect -> both ends authorized, first message", both, n);
#ifndef KVT_NO_AUTHORIZE
        line(f, label, "transport kvt_tp_ep_authorize call", auth, n);
#endif
        line(f, label, "link dial -> UP (HMAC handshake, both ends authorized)", up, n);
    }
    if (out != NULL)
        fclose(out);
    return 0;
}

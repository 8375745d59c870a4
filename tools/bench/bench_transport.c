/* kvtier-bench transport: READ throughput (256 KiB chunks in batches of 32, one batch
 * in flight, so 32 READs outstanding) and the latency of one 4 KiB READ (p50/p99),
 * between two processes on 127.0.0.1; for UCX, ucx_perftest -t ucp_get with the same
 * size and 32 outstanding (throughput) or 1 outstanding (latency) runs in the same
 * invocation as server and client subprocesses, and the ratios are printed.
 *
 * The server is a fork taken before anything touches the transport library: it
 * registers a region of batch x size bytes, sends its packed handle on accept and
 * busy-polls until the client leaves. The client busy-polls too (as ucx_perftest
 * does). UCX_TLS is set to tcp when the environment does not set it, for both
 * kvtier and the reference, so both measure the same transport. */
#include <errno.h>
#include <inttypes.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/utsname.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <netinet/in.h>

#include "bench.h"
#include "kvt/transport.h"

struct bt_opts {
    const char *backend;
    size_t size;
    unsigned batch;
    unsigned iters;     /* throughput batches */
    unsigned lat_iters; /* 4 KiB READs */
    bool json;
};

struct bt_result {
    bool ok;
    double mbps; /* MB/s (1e6), as ucx_perftest prints */
    double lat_p50_us, lat_p99_us, lat_avg_us;
};

/* Where server and client meet: 127.0.0.1, or --addr (soft-RoCE guests: the rxe
 * device's address, since rdma_cm does not listen on loopback). */
static const char *bt_addr = "127.0.0.1";

static double bt_now_us(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec / 1e3;
}

/* ---- the server process ---- */

struct bt_server {
    struct kvt_tp_ep *ep;
    uint8_t handle[KVT_TP_MAX_HANDLE_SIZE];
    size_t handle_len;
    bool done;
};

static int bt_srv_accept(void *arg, struct kvt_tp_ep *ep)
{
    struct bt_server *s = arg;

    if (s->ep != NULL)
        return -EBUSY;
    s->ep = ep;
    return kvt_tp_send(ep, s->handle, s->handle_len) < 0 ? -EIO : 0;
}

static void bt_srv_state(void *arg, struct kvt_tp_ep *ep, enum kvt_ep_state st, int err)
{
    struct bt_server *s = arg;

    if (st == KVT_EP_CLOSED && ep == s->ep)
        s->done = true;
}

static int bt_server(const struct bt_opts *o, size_t region, int ready_fd)
{
    struct bt_server s = {0};
    struct kvt_transport_config cfg = {
        .backend = o->backend,
        .cb = {.on_accept = bt_srv_accept, .on_ep_state = bt_srv_state, .arg = &s},
    };
    struct kvt_transport *tp;
    struct kvt_tp_mr *mr;
    uint8_t *buf = aligned_alloc(4096, region);
    uint16_t port = 0;
    int ret;

    if (buf == NULL)
        return 1;
    memset(buf, 0x5a, region);
    ret = kvt_tp_open(&cfg, &tp);
    if (ret < 0)
        return 1;
    ret = kvt_tp_reg_remote(tp, buf, region, &mr);
    if (ret == 0)
        ret = kvt_tp_pack(tp, mr, s.handle, sizeof(s.handle), &s.handle_len);
    if (ret == 0)
        ret = kvt_tp_listen(tp, bt_addr, 0, &port);
    if (ret < 0) {
        fprintf(stderr, "bench server: %s\n", strerror(-ret));
        return 1;
    }
    dprintf(ready_fd, "%u\n", port);
    close(ready_fd);
    while (!s.done && kvt_tp_progress(tp) >= 0)
        ;
    kvt_tp_dereg(mr, tp);
    kvt_tp_close(tp);
    free(buf);
    return 0;
}

/* ---- the client ---- */

struct bt_client {
    struct kvt_tp_ep *ep;
    bool connected, closed, have_handle;
    uint8_t handle[KVT_TP_MAX_HANDLE_SIZE];
    size_t handle_len;
    unsigned done;
    int status;
};

static void bt_cli_state(void *arg, struct kvt_tp_ep *ep, enum kvt_ep_state st, int err)
{
    struct bt_client *c = arg;

    if (st == KVT_EP_CONNECTED)
        c->connected = true;
    else
        c->closed = true;
}

static void bt_cli_msg(void *arg, struct kvt_tp_ep *ep, const void *buf, size_t len)
{
    struct bt_client *c = arg;

    if (!c->have_handle && len <= sizeof(c->handle)) {
        memcpy(c->handle, buf, len);
        c->handle_len = len;
        c->have_handle = true;
    }
}

static void bt_read_cb(void *arg, int status)
{
    struct bt_client *c = arg;

    c->done++;
    if (status != 0)
        c->status = status;
}

static int bt_cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;

    return x < y ? -1 : x > y;
}

/* One batch in flight at a time until it completes; returns its status. */
static int bt_read_wait(struct kvt_transport *tp, struct bt_client *c, struct kvt_tp_rkey *rk,
                        struct kvt_tp_mr *local, const struct kvt_read_op *ops, size_t n)
{
    unsigned want = c->done + 1;
    int ret = kvt_tp_read(c->ep, rk, local, ops, n, bt_read_cb, c);

    if (ret == 0)
        return 0;
    if (ret != -EINPROGRESS)
        return ret;
    while (c->done < want && !c->closed)
        if ((ret = kvt_tp_progress(tp)) < 0)
            return ret;
    return c->closed && c->done < want ? -ECONNRESET : c->status;
}

static int bt_client_run(const struct bt_opts *o, uint16_t port, size_t region, struct bt_result *r)
{
    struct bt_client c = {0};
    struct kvt_transport_config cfg = {
        .backend = o->backend,
        .cb = {.on_ep_state = bt_cli_state, .on_msg = bt_cli_msg, .arg = &c},
    };
    struct kvt_transport *tp;
    struct kvt_tp_mr *local = NULL;
    struct kvt_tp_rkey *rk = NULL;
    struct kvt_read_op *ops = calloc(o->batch, sizeof(*ops));
    double *lat = calloc(o->lat_iters, sizeof(*lat));
    uint8_t *buf = aligned_alloc(4096, region);
    int ret;

    if (ops == NULL || lat == NULL || buf == NULL)
        return -ENOMEM;
    memset(buf, 0, region);
    ret = kvt_tp_open(&cfg, &tp);
    if (ret < 0)
        goto out_free;
    ret = kvt_tp_reg_local(tp, buf, region, &local);
    if (ret == 0)
        ret = kvt_tp_connect(tp, bt_addr, port, &c, &c.ep);
    while (ret == 0 && !c.closed && !(c.connected && c.have_handle))
        ret = kvt_tp_progress(tp) < 0 ? -EIO : 0;
    if (ret == 0 && c.closed)
        ret = -ECONNREFUSED;
    if (ret == 0)
        ret = kvt_tp_unpack(c.ep, c.handle, c.handle_len, &rk);
    if (ret < 0)
        goto out_close;

    for (unsigned i = 0; i < o->batch; i++)
        ops[i] = (struct kvt_read_op){.remote_off = (uint64_t)i * o->size,
                                      .local_off = (uint64_t)i * o->size,
                                      .len = o->size};
    /* warm-up, then throughput */
    for (unsigned i = 0; i < 20 && ret == 0; i++)
        ret = bt_read_wait(tp, &c, rk, local, ops, o->batch);
    double t0 = bt_now_us();

    for (unsigned i = 0; i < o->iters && ret == 0; i++)
        ret = bt_read_wait(tp, &c, rk, local, ops, o->batch);
    double t1 = bt_now_us();

    if (ret < 0)
        goto out_close;
    r->mbps = (double)o->iters * o->batch * o->size / (t1 - t0); /* bytes/us = MB/s */

    struct kvt_read_op one = {.remote_off = 0, .local_off = 0, .len = 4096};

    for (unsigned i = 0; i < 100 && ret == 0; i++)
        ret = bt_read_wait(tp, &c, rk, local, &one, 1);
    double sum = 0;

    for (unsigned i = 0; i < o->lat_iters && ret == 0; i++) {
        double s = bt_now_us();

        ret = bt_read_wait(tp, &c, rk, local, &one, 1);
        lat[i] = bt_now_us() - s;
        sum += lat[i];
    }
    if (ret < 0)
        goto out_close;
    qsort(lat, o->lat_iters, sizeof(*lat), bt_cmp_double);
    r->lat_p50_us = lat[o->lat_iters / 2];
    r->lat_p99_us = lat[(size_t)((double)o->lat_iters * 0.99)];
    r->lat_avg_us = sum / o->lat_iters;
    r->ok = true;

out_close:
    if (rk != NULL)
        kvt_tp_rkey_destroy(tp, rk);
    if (c.ep != NULL && !c.closed) {
        kvt_tp_ep_close(c.ep);
        while (!c.closed && kvt_tp_progress(tp) >= 0)
            ;
    }
    if (local != NULL)
        kvt_tp_dereg(local, tp);
    kvt_tp_close(tp);
out_free:
    free(buf);
    free(lat);
    free(ops);
    return ret;
}

static int bt_ours(const struct bt_opts *o, struct bt_result *r)
{
    size_t region = (size_t)o->batch * o->size;
    int fds[2], st, ret;
    char line[32] = {0};
    unsigned port;
    pid_t pid;

    if (pipe(fds) < 0)
        return -errno;
    pid = fork();
    if (pid < 0)
        return -errno;
    if (pid == 0) {
        close(fds[0]);
        _exit(bt_server(o, region, fds[1]));
    }
    close(fds[1]);
    ssize_t n = read(fds[0], line, sizeof(line) - 1);

    close(fds[0]);
    if (n <= 0 || sscanf(line, "%u", &port) != 1) {
        waitpid(pid, &st, 0);
        return -EIO;
    }
    ret = bt_client_run(o, (uint16_t)port, region, r);
    if (ret < 0)
        kill(pid, SIGKILL);
    waitpid(pid, &st, 0);
    return ret;
}

/* ---- ucx_perftest ---- */

static uint16_t bt_free_port(void)
{
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t sl = sizeof(sa);
    int s = socket(AF_INET, SOCK_STREAM, 0);
    uint16_t port = 0;

    if (s < 0)
        return 0;
    if (bind(s, (struct sockaddr *)&sa, sizeof(sa)) == 0 &&
        getsockname(s, (struct sockaddr *)&sa, &sl) == 0)
        port = ntohs(sa.sin_port);
    close(s);
    return port;
}

/* Runs a ucx_perftest server and client; parses the client's "Final:" line
 * (iterations, p50 us, avg us, overall us, MB/s avg, MB/s overall, ...). */
static int bt_perftest(size_t size, unsigned outstanding, unsigned iters, double *p50_us,
                       double *avg_us, double *mbps, char *cmd, size_t cmd_cap)
{
    char s_size[32], s_out[32], s_iters[32], s_port[32];
    uint16_t port = bt_free_port();
    int st;

    snprintf(s_size, sizeof(s_size), "%zu", size);
    snprintf(s_out, sizeof(s_out), "%u", outstanding);
    snprintf(s_iters, sizeof(s_iters), "%u", iters);
    snprintf(s_port, sizeof(s_port), "%u", port);
    snprintf(cmd, cmd_cap, "ucx_perftest -t ucp_get -s %s -O %s -n %s -p %s [127.0.0.1]", s_size,
             s_out, s_iters, s_port);

    pid_t srv = fork();

    if (srv < 0)
        return -errno;
    if (srv == 0) {
        freopen("/dev/null", "w", stdout);
        execlp("ucx_perftest", "ucx_perftest", "-t", "ucp_get", "-s", s_size, "-O", s_out, "-n",
               s_iters, "-p", s_port, (char *)NULL);
        _exit(127);
    }
    usleep(500000);

    int fds[2];

    if (pipe(fds) < 0)
        return -errno;
    pid_t cli = fork();

    if (cli == 0) {
        dup2(fds[1], STDOUT_FILENO);
        close(fds[0]);
        close(fds[1]);
        execlp("ucx_perftest", "ucx_perftest", "127.0.0.1", "-t", "ucp_get", "-s", s_size, "-O",
               s_out, "-n", s_iters, "-p", s_port, (char *)NULL);
        _exit(127);
    }
    close(fds[1]);

    FILE *f = fdopen(fds[0], "r");
    char line[512];
    bool found = false;

    while (f != NULL && fgets(line, sizeof(line), f) != NULL) {
        unsigned long it;
        double p50, avg, overall, bw;

        if (sscanf(line, " Final: %lu %lf %lf %lf %lf", &it, &p50, &avg, &overall, &bw) == 5) {
            *p50_us = p50;
            *avg_us = avg;
            *mbps = bw;
            found = true;
        }
    }
    if (f != NULL)
        fclose(f);
    waitpid(cli, &st, 0);
    if (waitpid(srv, &st, WNOHANG) == 0) {
        usleep(200000);
        kill(srv, SIGKILL);
        waitpid(srv, &st, 0);
    }
    return found ? 0 : -EIO;
}

static int bt_usage(void)
{
    fprintf(stderr, "usage: kvtier-bench transport [--json] [--backend ucx|verbs] [--size 262144] "
                    "[--batch 32] [--iters N] [--lat-iters N] [--addr 127.0.0.1]\n");
    return 2;
}

int kvt_bench_transport(int argc, char **argv)
{
    struct bt_opts o = {
        .backend = "ucx", .size = 262144, .batch = 32, .iters = 500, .lat_iters = 10000};
    struct bt_result ours = {0}, ref = {0};
    char ref_bw_cmd[256] = "", ref_lat_cmd[256] = "";
    bool have_ref = false;
    int ret;

    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--json") == 0)
            o.json = true;
        else if (i + 1 < argc && strcmp(argv[i], "--backend") == 0)
            o.backend = argv[++i];
        else if (i + 1 < argc && strcmp(argv[i], "--size") == 0)
            o.size = strtoull(argv[++i], NULL, 0);
        else if (i + 1 < argc && strcmp(argv[i], "--batch") == 0)
            o.batch = (unsigned)strtoul(argv[++i], NULL, 0);
        else if (i + 1 < argc && strcmp(argv[i], "--iters") == 0)
            o.iters = (unsigned)strtoul(argv[++i], NULL, 0);
        else if (i + 1 < argc && strcmp(argv[i], "--lat-iters") == 0)
            o.lat_iters = (unsigned)strtoul(argv[++i], NULL, 0);
        else if (i + 1 < argc && strcmp(argv[i], "--addr") == 0)
            bt_addr = argv[++i];
        else
            return bt_usage();
    }
    if (o.size < 4096 || o.batch == 0 || o.iters == 0 || o.lat_iters < 100 ||
        (uint64_t)o.size * o.batch > KVT_TP_MAX_REG_BYTES) {
        fprintf(stderr, "kvtier-bench transport: size >= 4096, batch >= 1, iters >= 1, "
                        "lat-iters >= 100, size x batch <= 2 GiB\n");
        return 2;
    }
    if (kvt_transport_find(o.backend) == NULL) {
        fprintf(stderr, "kvtier-bench transport: backend '%s' is not built\n", o.backend);
        return 2;
    }
    if (getenv("UCX_TLS") == NULL)
        setenv("UCX_TLS", "tcp", 1);

    ret = bt_ours(&o, &ours);
    if (ret < 0) {
        fprintf(stderr, "kvtier-bench transport: %s run failed: %s\n", o.backend, strerror(-ret));
        return 1;
    }
    if (strcmp(o.backend, "ucx") == 0) {
        double p50, avg, bw, lp50, lavg, lbw;

        if (bt_perftest(o.size, o.batch, o.iters * o.batch, &p50, &avg, &bw, ref_bw_cmd,
                        sizeof(ref_bw_cmd)) == 0 &&
            bt_perftest(4096, 1, o.lat_iters, &lp50, &lavg, &lbw, ref_lat_cmd,
                        sizeof(ref_lat_cmd)) == 0) {
            ref.mbps = bw;
            ref.lat_p50_us = lp50;
            ref.lat_avg_us = lavg;
            have_ref = true;
        } else {
            fprintf(stderr, "kvtier-bench transport: ucx_perftest failed or its output did not "
                            "parse; no reference\n");
        }
    }

    double bw_ratio = have_ref ? ours.mbps / ref.mbps : 0;
    double lat_ratio = have_ref ? ours.lat_p50_us / ref.lat_p50_us : 0;
    const char *tls = getenv("UCX_TLS");

    if (o.json) {
        printf("{\"bench\":\"transport\",\"backend\":\"%s\",\"ucx_tls\":\"%s\",\"size\":%zu,"
               "\"batch\":%u,\"iters\":%u,\"lat_iters\":%u,"
               "\"ours\":{\"read_mbps\":%.1f,\"lat4k_p50_us\":%.2f,\"lat4k_p99_us\":%.2f,"
               "\"lat4k_avg_us\":%.2f}",
               o.backend, tls, o.size, o.batch, o.iters, o.lat_iters, ours.mbps, ours.lat_p50_us,
               ours.lat_p99_us, ours.lat_avg_us);
        if (have_ref)
            printf(",\"reference\":{\"tool\":\"ucx_perftest\",\"bw_cmd\":\"%s\",\"lat_cmd\":\"%s\","
                   "\"read_mbps\":%.1f,\"lat4k_p50_us\":%.2f,\"lat4k_avg_us\":%.2f},"
                   "\"ratio\":{\"throughput\":%.3f,\"latency_p50\":%.3f},"
                   "\"targets_met\":{\"throughput_ge_0.9\":%s,\"latency_le_1.2\":%s}",
                   ref_bw_cmd, ref_lat_cmd, ref.mbps, ref.lat_p50_us, ref.lat_avg_us, bw_ratio,
                   lat_ratio, bw_ratio >= 0.9 ? "true" : "false",
                   lat_ratio <= 1.2 ? "true" : "false");
        printf("}\n");
        return 0;
    }
    printf("transport %s (UCX_TLS=%s), two processes on %s\n", o.backend, tls, bt_addr);
    printf("  READ %zu B x %u per batch, 1 batch in flight, %u batches:\n", o.size, o.batch,
           o.iters);
    printf("    kvtier        %10.1f MB/s\n", ours.mbps);
    if (have_ref)
        printf("    ucx_perftest  %10.1f MB/s   (%s)\n    ratio         %10.3f   (target >= 0.9: "
               "%s)\n",
               ref.mbps, ref_bw_cmd, bw_ratio, bw_ratio >= 0.9 ? "met" : "NOT met");
    printf("  one 4 KiB READ, %u iterations:\n", o.lat_iters);
    printf("    kvtier        p50 %8.2f us  p99 %8.2f us  avg %8.2f us\n", ours.lat_p50_us,
           ours.lat_p99_us, ours.lat_avg_us);
    if (have_ref)
        printf("    ucx_perftest  p50 %8.2f us  (p99 not reported)  avg %8.2f us   (%s)\n"
               "    ratio (p50)   %10.3f   (target <= 1.2: %s)\n",
               ref.lat_p50_us, ref.lat_avg_us, ref_lat_cmd, lat_ratio,
               lat_ratio <= 1.2 ? "met" : "NOT met");
    else if (strcmp(o.backend, "verbs") == 0)
        printf("  reference: ib_read_bw / ib_read_lat run inside a soft-RoCE guest (not here)\n");
    return 0;
}

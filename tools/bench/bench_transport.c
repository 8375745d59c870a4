/* SPDX-License-Identifier: Apache-2.0 */
/* kvtier-bench transport: READ throughput for 256 KiB chunks and the latency of one
 * 4 KiB READ between two processes on 127.0.0.1, side by side with the references,
 * repeated --reps times with the two sides interleaved (ours, reference, ours, ...)
 * so that the load of a shared machine falls on both; ratios are taken per repetition
 * and their median is reported.
 *
 * Throughput: --batch (32) chunks of --size (256 KiB) per READ batch, with --window
 * batches kept in flight: each batch is posted again as soon as it completes, so the
 * number of READs outstanding never drains to zero between batches (ucx_perftest -O 32
 * keeps 32 outstanding all the time). Three shapes run in every repetition on the
 * same connection, each moving the same bytes (--iters x 32 chunks):
 *   32 x 1   one batch of 32 in flight (drains to 0 at the end of each batch);
 *   32 x 2   batches of 32, two in flight (32..64 outstanding): the headline figure;
 *   8 x 4    batches of 8, four in flight (24..32 outstanding, never more than the
 *            reference's 32).
 * With --chunks N every READ takes the next of N distinct chunks on both sides, so
 * the bytes come from and go to memory as in a pull of N chunks; without it the same
 * 32 remote chunks are read again and again and stay in the caches (ucx_perftest too
 * reads one buffer).
 * Latency: one 4 KiB READ (a batch of one) at a time, --lat-iters, p50/p99/avg.
 *
 * References (UCX only), each run in every repetition:
 *   ucx_perftest -t ucp_get -s 262144 -O 32 (throughput) and -s 4096 -O 1 (latency:
 *     over tcp ~1.1 ms an op, a wait in its flow rather than a transfer; kept as a
 *     figure, not as the floor);
 *   kvt-ucp-get-lat (transport/ucx/ref/): a raw UCP ucp_get_nbx ping loop, one
 *     endpoint, busy progress, p50/p99: the latency floor the 1.2x target is
 *     measured against.
 *
 * Memory: both sides' buffers are anonymous and advised for transparent huge pages,
 * or, with --buffer-dir DIR, MAP_SHARED mappings of (unlinked) files in DIR, as a
 * node's primary region in its run folder: how a copy over shared memory (UCX's cma
 * pins and walks the pages it reads) runs depends on the pages under it, so a
 * ceiling for a pull compares like with like only on the nodes' kind of pages.
 *
 * Our server is a fork taken before anything touches the transport library; our
 * client is a second fork, so the bench process itself never initialises UCX and
 * every repetition starts clean. Both busy-poll (as ucx_perftest does), except the
 * verbs server, which sleeps when idle (the NIC serves READs). UCX_TLS is set
 * to tcp when the environment does not set it, for kvtier and the references alike. */
#include <errno.h>
#include <inttypes.h>
#include <poll.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <netinet/in.h>

#include "bench.h"
#include "kvt/alloc.h"
#include "kvt/transport.h"

#define BT_SHAPES   3
#define BT_MAX_REPS 32

struct bt_shape {
    unsigned batch, window;
};

static const struct bt_shape bt_shapes[BT_SHAPES] = {{32, 1}, {32, 2}, {8, 4}};
#define BT_HEADLINE 1 /* 32 x 2 */

struct bt_opts {
    const char *backend;
    size_t size;
    unsigned iters;     /* throughput: bytes moved per shape = iters x 32 x size */
    unsigned lat_iters; /* 4 KiB READs */
    unsigned ref_lat_iters;
    unsigned reps;
    /* 0: the chunks of a batch are read from the same 32 remote chunks into the same
     * local ones every time (as ucx_perftest reads one buffer), so both sides stay in
     * the caches. N: regions of N chunks on both sides and every READ takes the next
     * chunk, remote chunk i into local chunk i, so each is moved from and into memory
     * as a pull of N distinct chunks moves them. */
    unsigned chunks;
    const char *buffer_dir; /* NULL: anonymous buffers; else files there (Memory above) */
    bool json;
};

/* A side's buffer, zeroed (Memory above); NULL when it cannot be had. */
static void *bt_alloc(const struct bt_opts *o, size_t bytes)
{
    char path[4096];
    void *p;
    int fd;

    if (o->buffer_dir == NULL)
        return kvt_calloc_table(bytes, 1);
    snprintf(path, sizeof(path), "%s/kvtier-bench-buf-XXXXXX", o->buffer_dir);
    fd = mkstemp(path);
    if (fd < 0)
        return NULL;
    (void)unlink(path);
    p = ftruncate(fd, (off_t)bytes) == 0
            ? mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)
            : MAP_FAILED;
    close(fd);
    if (p == MAP_FAILED)
        return NULL;
    (void)madvise(p, bytes, MADV_HUGEPAGE); /* as a node's region does (tiering/region.c) */
    return p;
}

static void bt_free(const struct bt_opts *o, void *p, size_t bytes)
{
    if (o->buffer_dir == NULL)
        kvt_free_table(p, bytes, 1);
    else
        munmap(p, bytes);
}

/* What one of our client runs measured (written through a pipe by the client). */
struct bt_result {
    int ok;
    double mbps[BT_SHAPES]; /* MB/s (1e6), as ucx_perftest prints */
    double lat_p50_us, lat_p99_us, lat_avg_us;
};

struct bt_rep {
    struct bt_result ours;
    bool have_pt, have_raw;
    double pt_mbps, pt_lat_p50_us, pt_lat_avg_us;
    double raw_p50_us, raw_p99_us, raw_avg_us;
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
    /* The bench's own client: no handshake, it may read everything (bt_srv_may_read);
     * authorized before it learns the handle. */
    if (kvt_tp_ep_authorize(ep) < 0 || kvt_tp_send(ep, s->handle, s->handle_len) < 0)
        return -EIO;
    return 0;
}

static bool bt_srv_may_read(void *arg, struct kvt_tp_ep *ep, struct kvt_tp_mr *mr, uint64_t off,
                            uint64_t len)
{
    return true;
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
        .cb = {.on_accept = bt_srv_accept,
               .on_ep_state = bt_srv_state,
               .may_read = bt_srv_may_read,
               .arg = &s},
    };
    struct kvt_transport *tp;
    struct kvt_tp_mr *mr;
    uint8_t *buf = bt_alloc(o, region);
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
    /* Over verbs the NIC serves READs without this process, so it sleeps on the event
     * fd when idle, as a node does and as ib_read_bw/ib_read_lat's server waits: a
     * busy-polling server only takes a (guest) CPU from the kernel's rxe work. Over
     * UCX tcp the server's progress answers the READs: it busy-polls, as the
     * references do. */
    bool sleeps = strcmp(o->backend, "verbs") == 0;

    while (!s.done) {
        ret = kvt_tp_progress(tp);
        if (ret < 0)
            break;
        if (sleeps && ret == 0 && kvt_tp_arm(tp) == 0) {
            struct pollfd pfd = {.fd = kvt_tp_event_fd(tp), .events = POLLIN};

            poll(&pfd, 1, 100);
        }
    }
    kvt_tp_dereg(mr, tp);
    kvt_tp_close(tp);
    bt_free(o, buf, region);
    return 0;
}

/* ---- the client ---- */

struct bt_client {
    struct kvt_tp_ep *ep;
    bool connected, closed, have_handle;
    uint8_t handle[KVT_TP_MAX_HANDLE_SIZE];
    size_t handle_len;
    unsigned done;           /* batches completed */
    int status;              /* the last error a batch reported */
    size_t size;             /* --chunks: bytes of a chunk, the chunks of both regions, */
    unsigned chunks, cursor; /* and the next chunk to read */
};

/* One batch's place in the window: its own local chunks, busy while in flight. */
struct bt_slot {
    struct bt_client *c;
    struct kvt_read_op *ops;
    bool busy;
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
    struct bt_slot *s = arg;

    s->busy = false;
    s->c->done++;
    if (status != 0)
        s->c->status = status;
}

static int bt_cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;

    return x < y ? -1 : x > y;
}

/* Runs nbatches READ batches of the shape, keeping shape->window in flight: a slot
 * is posted again in the same pass that sees it complete. Returns 0 or the error. */
static int bt_run_window(struct kvt_transport *tp, struct bt_client *c, struct kvt_tp_rkey *rk,
                         struct kvt_tp_mr *local, struct bt_slot *slots, const struct bt_shape *sh,
                         unsigned nbatches)
{
    unsigned posted = 0, want = c->done + nbatches;
    int ret;

    while (c->done < want) {
        for (unsigned w = 0; w < sh->window && posted < nbatches; w++) {
            if (slots[w].busy)
                continue;
            slots[w].busy = true;
            for (unsigned i = 0; c->chunks != 0 && i < sh->batch; i++) {
                uint64_t off = (uint64_t)c->cursor * c->size;

                slots[w].ops[i] =
                    (struct kvt_read_op){.remote_off = off, .local_off = off, .len = c->size};
                c->cursor = (c->cursor + 1) % c->chunks;
            }
            ret = kvt_tp_read(c->ep, rk, local, slots[w].ops, sh->batch, bt_read_cb, &slots[w]);
            if (ret == -EAGAIN) {
                slots[w].busy = false;
                break;
            }
            posted++;
            if (ret == 0) {
                bt_read_cb(&slots[w], 0);
            } else if (ret != -EINPROGRESS) {
                slots[w].busy = false;
                return ret;
            }
        }
        if (c->status != 0)
            return c->status;
        if (c->closed)
            return -ECONNRESET;
        if ((ret = kvt_tp_progress(tp)) < 0)
            return ret;
    }
    return c->status;
}

/* Throughput of one shape: a warm-up, then bytes = iters x 32 x size. */
static int bt_throughput(struct kvt_transport *tp, struct bt_client *c, struct kvt_tp_rkey *rk,
                         struct kvt_tp_mr *local, const struct bt_opts *o,
                         const struct bt_shape *sh, double *mbps)
{
    struct kvt_read_op *ops = calloc((size_t)sh->batch * sh->window, sizeof(*ops));
    struct bt_slot slots[16];
    unsigned nbatches = (unsigned)(((uint64_t)o->iters * 32 + sh->batch - 1) / sh->batch);
    int ret;

    if (ops == NULL || sh->window > 16)
        return -ENOMEM;
    for (unsigned w = 0; w < sh->window; w++) {
        for (unsigned i = 0; i < sh->batch; i++)
            ops[w * sh->batch + i] =
                (struct kvt_read_op){.remote_off = (uint64_t)i * o->size,
                                     .local_off = ((uint64_t)w * sh->batch + i) * o->size,
                                     .len = o->size};
        slots[w] = (struct bt_slot){.c = c, .ops = ops + (size_t)w * sh->batch};
    }
    ret = bt_run_window(tp, c, rk, local, slots, sh, nbatches / 10 + sh->window);

    double t0 = bt_now_us();

    if (ret == 0)
        ret = bt_run_window(tp, c, rk, local, slots, sh, nbatches);

    double t1 = bt_now_us();

    if (ret == 0)
        *mbps = (double)nbatches * sh->batch * o->size / (t1 - t0); /* bytes/us = MB/s */
    free(ops);
    return ret;
}

static int bt_latency(struct kvt_transport *tp, struct bt_client *c, struct kvt_tp_rkey *rk,
                      struct kvt_tp_mr *local, const struct bt_opts *o, struct bt_result *r)
{
    static const struct bt_shape one_sh = {1, 1};
    struct kvt_read_op one = {.remote_off = 0, .local_off = 0, .len = 4096};
    struct bt_slot slot = {.c = c, .ops = &one};
    double *lat = calloc(o->lat_iters, sizeof(*lat));
    double sum = 0;
    int ret;

    if (lat == NULL)
        return -ENOMEM;
    ret = bt_run_window(tp, c, rk, local, &slot, &one_sh, 100);
    for (unsigned i = 0; i < o->lat_iters && ret == 0; i++) {
        double s = bt_now_us();

        ret = bt_run_window(tp, c, rk, local, &slot, &one_sh, 1);
        lat[i] = bt_now_us() - s;
        sum += lat[i];
    }
    if (ret == 0) {
        qsort(lat, o->lat_iters, sizeof(*lat), bt_cmp_double);
        r->lat_p50_us = lat[o->lat_iters / 2];
        r->lat_p99_us = lat[(size_t)((double)o->lat_iters * 0.99)];
        r->lat_avg_us = sum / o->lat_iters;
    }
    free(lat);
    return ret;
}

static int bt_client_run(const struct bt_opts *o, uint16_t port, size_t local_bytes,
                         struct bt_result *r)
{
    struct bt_client c = {0};
    struct kvt_transport_config cfg = {
        .backend = o->backend,
        .cb = {.on_ep_state = bt_cli_state, .on_msg = bt_cli_msg, .arg = &c},
    };
    struct kvt_transport *tp;
    struct kvt_tp_mr *local = NULL;
    struct kvt_tp_rkey *rk = NULL;
    uint8_t *buf = bt_alloc(o, local_bytes);
    int ret;

    if (buf == NULL)
        return -ENOMEM;
    memset(buf, 0, local_bytes);
    ret = kvt_tp_open(&cfg, &tp);
    if (ret < 0)
        goto out_free;
    ret = kvt_tp_reg_local(tp, buf, local_bytes, &local);
    if (ret == 0)
        ret = kvt_tp_connect(tp, bt_addr, port, &c, &c.ep);
    /* No handshake here: each side authorizes its end at once (the server before it
     * sends the handle, which may then travel on the data plane authorizing sets up). */
    while (ret == 0 && !c.closed && !c.connected)
        ret = kvt_tp_progress(tp) < 0 ? -EIO : 0;
    if (ret == 0 && !c.closed)
        ret = kvt_tp_ep_authorize(c.ep);
    while (ret == 0 && !c.closed && !c.have_handle)
        ret = kvt_tp_progress(tp) < 0 ? -EIO : 0;
    if (ret == 0 && c.closed)
        ret = -ECONNREFUSED;
    if (ret == 0)
        ret = kvt_tp_unpack(c.ep, c.handle, c.handle_len, &rk);
    c.size = o->size;
    c.chunks = o->chunks;
    for (unsigned k = 0; k < BT_SHAPES && ret == 0; k++)
        ret = bt_throughput(tp, &c, rk, local, o, &bt_shapes[k], &r->mbps[k]);
    c.chunks = 0; /* the latency READ is one 4 KiB op of its own */
    if (ret == 0)
        ret = bt_latency(tp, &c, rk, local, o, r);
    if (ret == 0 && buf[0] != 0x5a)
        ret = -EIO; /* the bytes read are not the server's */
    r->ok = ret == 0;

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
    bt_free(o, buf, local_bytes);
    return ret;
}

/* One run of our side: a server fork and a client fork; the client's result comes
 * back through a pipe. */
static int bt_ours(const struct bt_opts *o, struct bt_result *r)
{
    size_t region = (size_t)(o->chunks != 0 ? o->chunks : 32) * o->size, local_bytes = 0;
    int fds[2], res[2], st, ret = 0;
    char line[32] = {0};
    unsigned port;
    pid_t srv, cli;

    for (unsigned k = 0; k < BT_SHAPES; k++) {
        size_t need = (size_t)bt_shapes[k].batch * bt_shapes[k].window * o->size;

        local_bytes = need > local_bytes ? need : local_bytes;
    }
    if (o->chunks != 0)
        local_bytes = region;
    if (pipe(fds) < 0)
        return -errno;
    srv = fork();
    if (srv < 0)
        return -errno;
    if (srv == 0) {
        close(fds[0]);
        _exit(bt_server(o, region, fds[1]));
    }
    close(fds[1]);
    ssize_t n = read(fds[0], line, sizeof(line) - 1);

    close(fds[0]);
    if (n <= 0 || sscanf(line, "%u", &port) != 1) {
        waitpid(srv, &st, 0);
        return -EIO;
    }
    if (pipe(res) < 0)
        return -errno;
    cli = fork();
    if (cli < 0)
        return -errno;
    if (cli == 0) {
        struct bt_result mine = {0};
        int rc;

        close(res[0]);
        rc = bt_client_run(o, (uint16_t)port, local_bytes, &mine);
        if (rc < 0)
            fprintf(stderr, "bench client: %s\n", strerror(-rc));
        _exit(write(res[1], &mine, sizeof(mine)) == (ssize_t)sizeof(mine) && rc == 0 ? 0 : 1);
    }
    close(res[1]);
    memset(r, 0, sizeof(*r));
    if (read(res[0], r, sizeof(*r)) != (ssize_t)sizeof(*r) || !r->ok)
        ret = -EIO;
    close(res[0]);
    waitpid(cli, &st, 0);
    if (ret < 0)
        kill(srv, SIGKILL);
    waitpid(srv, &st, 0);
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

/* ---- the raw UCP floor ---- */

/* Runs kvt-ucp-get-lat (beside this binary, or $KVT_UCP_GET_LAT) for 4 KiB. */
static int bt_raw_ref(unsigned iters, struct bt_rep *rep, char *cmd, size_t cmd_cap)
{
    static char path[4096];
    const char *env = getenv("KVT_UCP_GET_LAT");
    char line[256];
    bool found = false;

    if (env != NULL) {
        snprintf(path, sizeof(path), "%s", env);
    } else {
        ssize_t n = readlink("/proc/self/exe", path, sizeof(path) - 32);
        char *slash;

        if (n <= 0)
            return -ENOENT;
        path[n] = '\0';
        slash = strrchr(path, '/');
        if (slash == NULL)
            return -ENOENT;
        strcpy(slash + 1, "kvt-ucp-get-lat");
    }
    if (access(path, X_OK) != 0)
        return -ENOENT;
    snprintf(cmd, cmd_cap, "'%s' -s 4096 -n %u", path, iters);

    FILE *f = popen(cmd, "r");

    if (f == NULL)
        return -errno;
    while (fgets(line, sizeof(line), f) != NULL) {
        size_t sz;
        unsigned it;

        if (sscanf(line, "ucp_get_lat size %zu iters %u p50 %lf p99 %lf avg %lf", &sz, &it,
                   &rep->raw_p50_us, &rep->raw_p99_us, &rep->raw_avg_us) == 5)
            found = true;
    }
    if (pclose(f) != 0 || !found)
        return -EIO;
    rep->have_raw = true;
    return 0;
}

static int bt_usage(void)
{
    fprintf(stderr, "usage: kvtier-bench transport [--json] [--backend ucx|verbs] [--size 262144] "
                    "[--iters N] [--lat-iters N] [--ref-lat-iters N] [--reps N] [--chunks N] "
                    "[--addr 127.0.0.1] [--buffer-dir DIR]\n");
    return 2;
}

static double bt_median(double *v, unsigned n)
{
    if (n == 0)
        return 0;
    qsort(v, n, sizeof(*v), bt_cmp_double);
    return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

/* The medians over the repetitions, and of the per-repetition ratios. */
struct bt_summary {
    unsigned n_ours, n_pt, n_raw;
    double mbps[BT_SHAPES], pt_mbps, bw_ratio[BT_SHAPES];
    double lat_p50, lat_p99, pt_lat_p50, raw_p50, raw_p99;
    double lat_ratio_raw, lat_ratio_pt;
};

static void bt_summarise(const struct bt_rep *reps, unsigned n, struct bt_summary *s)
{
    double v[BT_MAX_REPS], w[BT_MAX_REPS];
    unsigned k;

    memset(s, 0, sizeof(*s));
    for (unsigned sh = 0; sh < BT_SHAPES; sh++) {
        unsigned a = 0, b = 0;

        for (unsigned i = 0; i < n; i++) {
            v[a++] = reps[i].ours.mbps[sh];
            if (reps[i].have_pt)
                w[b++] = reps[i].ours.mbps[sh] / reps[i].pt_mbps;
        }
        s->mbps[sh] = bt_median(v, a);
        s->bw_ratio[sh] = bt_median(w, b);
        s->n_ours = a;
    }
#define BT_MED(field, cond, expr)                                                                  \
    do {                                                                                           \
        k = 0;                                                                                     \
        for (unsigned i = 0; i < n; i++)                                                           \
            if (cond)                                                                              \
                v[k++] = (expr);                                                                   \
        s->field = bt_median(v, k);                                                                \
    } while (0)
    BT_MED(pt_mbps, reps[i].have_pt, reps[i].pt_mbps);
    s->n_pt = k;
    BT_MED(lat_p50, true, reps[i].ours.lat_p50_us);
    BT_MED(lat_p99, true, reps[i].ours.lat_p99_us);
    BT_MED(pt_lat_p50, reps[i].have_pt, reps[i].pt_lat_p50_us);
    BT_MED(raw_p50, reps[i].have_raw, reps[i].raw_p50_us);
    s->n_raw = k;
    BT_MED(raw_p99, reps[i].have_raw, reps[i].raw_p99_us);
    BT_MED(lat_ratio_raw, reps[i].have_raw, reps[i].ours.lat_p50_us / reps[i].raw_p50_us);
    BT_MED(lat_ratio_pt, reps[i].have_pt, reps[i].ours.lat_p50_us / reps[i].pt_lat_p50_us);
#undef BT_MED
}

static void bt_print_json(const struct bt_opts *o, const struct bt_rep *reps, unsigned n,
                          const struct bt_summary *s, const char *bw_cmd, const char *lat_cmd,
                          const char *raw_cmd)
{
    printf("{\"bench\":\"transport\",\"backend\":\"%s\",\"ucx_tls\":\"%s\",\"size\":%zu,"
           "\"iters\":%u,\"chunks\":%u,\"lat_iters\":%u,\"ref_lat_iters\":%u,\"reps\":[",
           o->backend, getenv("UCX_TLS"), o->size, o->iters, o->chunks, o->lat_iters,
           o->ref_lat_iters);
    for (unsigned i = 0; i < n; i++) {
        const struct bt_rep *r = &reps[i];

        printf("%s{\"ours\":{", i ? "," : "");
        for (unsigned k = 0; k < BT_SHAPES; k++)
            printf("\"read_mbps_%ux%u\":%.1f,", bt_shapes[k].batch, bt_shapes[k].window,
                   r->ours.mbps[k]);
        printf("\"lat4k_p50_us\":%.2f,\"lat4k_p99_us\":%.2f,\"lat4k_avg_us\":%.2f}",
               r->ours.lat_p50_us, r->ours.lat_p99_us, r->ours.lat_avg_us);
        if (r->have_pt)
            printf(",\"ucx_perftest\":{\"read_mbps\":%.1f,\"lat4k_p50_us\":%.2f,"
                   "\"lat4k_avg_us\":%.2f}",
                   r->pt_mbps, r->pt_lat_p50_us, r->pt_lat_avg_us);
        if (r->have_raw)
            printf(",\"raw_ucp_get\":{\"lat4k_p50_us\":%.2f,\"lat4k_p99_us\":%.2f,"
                   "\"lat4k_avg_us\":%.2f}",
                   r->raw_p50_us, r->raw_p99_us, r->raw_avg_us);
        printf("}");
    }
    printf("],\"median\":{\"read_mbps\":%.1f,\"lat4k_p50_us\":%.2f,\"lat4k_p99_us\":%.2f",
           s->mbps[BT_HEADLINE], s->lat_p50, s->lat_p99);
    if (s->n_pt > 0) {
        printf(",\"ucx_perftest_read_mbps\":%.1f,\"ucx_perftest_lat4k_p50_us\":%.2f", s->pt_mbps,
               s->pt_lat_p50);
        for (unsigned k = 0; k < BT_SHAPES; k++)
            printf(",\"ratio_throughput_%ux%u\":%.3f", bt_shapes[k].batch, bt_shapes[k].window,
                   s->bw_ratio[k]);
        printf(",\"ratio_latency_vs_perftest\":%.3f", s->lat_ratio_pt);
    }
    if (s->n_raw > 0)
        printf(",\"raw_ucp_get_lat4k_p50_us\":%.2f,\"raw_ucp_get_lat4k_p99_us\":%.2f,"
               "\"ratio_latency_vs_raw\":%.3f",
               s->raw_p50, s->raw_p99, s->lat_ratio_raw);
    printf("},\"commands\":{\"ucx_perftest_bw\":\"%s\",\"ucx_perftest_lat\":\"%s\","
           "\"raw_ucp_get\":\"%s\"}",
           bw_cmd, lat_cmd, raw_cmd);
    if (s->n_pt > 0 && s->n_raw > 0)
        printf(",\"targets_met\":{\"throughput_ge_0.9\":%s,\"latency_le_1.2_raw\":%s}",
               s->bw_ratio[BT_HEADLINE] >= 0.9 ? "true" : "false",
               s->lat_ratio_raw <= 1.2 ? "true" : "false");
    printf("}\n");
}

static void bt_print_text(const struct bt_opts *o, const struct bt_rep *reps, unsigned n,
                          const struct bt_summary *s, const char *bw_cmd, const char *lat_cmd,
                          const char *raw_cmd)
{
    printf("transport %s (UCX_TLS=%s), two processes on %s, %u repetitions interleaved\n",
           o->backend, getenv("UCX_TLS"), bt_addr, n);
    if (o->chunks != 0)
        printf("READ %zu B chunks, each the next of %u distinct chunks (both sides), MB/s "
               "(batch x batches in flight):\n",
               o->size, o->chunks);
    else
        printf("READ %zu B chunks, MB/s (batch x batches in flight):\n", o->size);
    printf("  rep   ");
    for (unsigned k = 0; k < BT_SHAPES; k++)
        printf("    %2ux%u", bt_shapes[k].batch, bt_shapes[k].window);
    printf("   perftest   ratio(%ux%u)\n", bt_shapes[BT_HEADLINE].batch,
           bt_shapes[BT_HEADLINE].window);
    for (unsigned i = 0; i < n; i++) {
        printf("  %-4u  ", i + 1);
        for (unsigned k = 0; k < BT_SHAPES; k++)
            printf(" %7.1f", reps[i].ours.mbps[k]);
        if (reps[i].have_pt)
            printf("   %8.1f   %6.3f\n", reps[i].pt_mbps,
                   reps[i].ours.mbps[BT_HEADLINE] / reps[i].pt_mbps);
        else
            printf("   %8s\n", "-");
    }
    printf("  median");
    for (unsigned k = 0; k < BT_SHAPES; k++)
        printf(" %7.1f", s->mbps[k]);
    if (s->n_pt > 0) {
        printf("   %8.1f   %6.3f (median of ratios; target >= 0.9: %s)\n", s->pt_mbps,
               s->bw_ratio[BT_HEADLINE], s->bw_ratio[BT_HEADLINE] >= 0.9 ? "met" : "NOT met");
        printf("  median ratio per shape:");
        for (unsigned k = 0; k < BT_SHAPES; k++)
            printf(" %ux%u %.3f", bt_shapes[k].batch, bt_shapes[k].window, s->bw_ratio[k]);
        printf("\n  reference: %s\n", bw_cmd);
    } else {
        printf("\n");
    }
    printf("one 4 KiB READ, p50 / p99 us (kvtier %u iterations):\n", o->lat_iters);
    printf("  rep    kvtier p50/p99     raw ucp_get p50/p99   perftest p50\n");
    for (unsigned i = 0; i < n; i++) {
        printf("  %-4u  %8.2f %8.2f", i + 1, reps[i].ours.lat_p50_us, reps[i].ours.lat_p99_us);
        if (reps[i].have_raw)
            printf("   %8.2f %8.2f", reps[i].raw_p50_us, reps[i].raw_p99_us);
        else
            printf("   %8s %8s", "-", "-");
        if (reps[i].have_pt)
            printf("   %8.2f\n", reps[i].pt_lat_p50_us);
        else
            printf("   %8s\n", "-");
    }
    printf("  median %8.2f %8.2f   %8.2f %8.2f   %8.2f\n", s->lat_p50, s->lat_p99, s->raw_p50,
           s->raw_p99, s->pt_lat_p50);
    if (s->n_raw > 0)
        printf("  kvtier / raw ucp_get p50: %.3f (median of ratios; target <= 1.2: %s)\n"
               "  raw floor: %s\n",
               s->lat_ratio_raw, s->lat_ratio_raw <= 1.2 ? "met" : "NOT met", raw_cmd);
    if (s->n_pt > 0)
        printf("  kvtier / ucx_perftest p50: %.3f (%s: a wait in its flow, not a floor)\n",
               s->lat_ratio_pt, lat_cmd);
    if (strcmp(o->backend, "verbs") == 0)
        printf("  reference: ib_read_bw / ib_read_lat run inside a soft-RoCE guest (not here)\n");
}

int kvt_bench_transport(int argc, char **argv)
{
    struct bt_opts o = {.backend = "ucx",
                        .size = 262144,
                        .iters = 200,
                        .lat_iters = 10000,
                        .ref_lat_iters = 2000,
                        .reps = 3};
    static struct bt_rep reps[BT_MAX_REPS];
    struct bt_summary sum;
    char bw_cmd[256] = "", lat_cmd[256] = "", raw_cmd[4400] = "";
    bool ucx;
    int ret;

    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--json") == 0)
            o.json = true;
        else if (i + 1 < argc && strcmp(argv[i], "--backend") == 0)
            o.backend = argv[++i];
        else if (i + 1 < argc && strcmp(argv[i], "--size") == 0)
            o.size = strtoull(argv[++i], NULL, 0);
        else if (i + 1 < argc && strcmp(argv[i], "--iters") == 0)
            o.iters = (unsigned)strtoul(argv[++i], NULL, 0);
        else if (i + 1 < argc && strcmp(argv[i], "--lat-iters") == 0)
            o.lat_iters = (unsigned)strtoul(argv[++i], NULL, 0);
        else if (i + 1 < argc && strcmp(argv[i], "--ref-lat-iters") == 0)
            o.ref_lat_iters = (unsigned)strtoul(argv[++i], NULL, 0);
        else if (i + 1 < argc && strcmp(argv[i], "--reps") == 0)
            o.reps = (unsigned)strtoul(argv[++i], NULL, 0);
        else if (i + 1 < argc && strcmp(argv[i], "--chunks") == 0)
            o.chunks = (unsigned)strtoul(argv[++i], NULL, 0);
        else if (i + 1 < argc && strcmp(argv[i], "--addr") == 0)
            bt_addr = argv[++i];
        else if (i + 1 < argc && strcmp(argv[i], "--buffer-dir") == 0)
            o.buffer_dir = argv[++i];
        else
            return bt_usage();
    }
    if (o.size < 4096 || o.iters == 0 || o.lat_iters < 100 || o.ref_lat_iters < 100 ||
        o.reps == 0 || o.reps > BT_MAX_REPS || (uint64_t)o.size * 64 > KVT_TP_MAX_REG_BYTES ||
        (o.chunks != 0 && (o.chunks < 64 || (uint64_t)o.size * o.chunks > KVT_TP_MAX_REG_BYTES))) {
        fprintf(stderr,
                "kvtier-bench transport: size >= 4096, size x 64 <= 2 GiB, iters >= 1, "
                "lat-iters and ref-lat-iters >= 100, 1 <= reps <= %u, chunks 0 or >= 64 "
                "with size x chunks <= 2 GiB\n",
                BT_MAX_REPS);
        return 2;
    }
    if (kvt_transport_find(o.backend) == NULL) {
        fprintf(stderr, "kvtier-bench transport: backend '%s' is not built\n", o.backend);
        return 2;
    }
    if (getenv("UCX_TLS") == NULL)
        setenv("UCX_TLS", "tcp", 1);
    /* Two processes on this host: otherwise UCX also opens a tcp lane to this host's
     * address on every other interface (measured: 2.7 GB/s with that lane, 3.8 on lo
     * alone). */
    if (strncmp(bt_addr, "127.", 4) == 0)
        setenv("UCX_NET_DEVICES", "lo", 0);
    ucx = strcmp(o.backend, "ucx") == 0;

    /* A B A B ...: ours, then the references, in every repetition. */
    for (unsigned r = 0; r < o.reps; r++) {
        struct bt_rep *rep = &reps[r];
        double p50, avg, bw, lp50, lavg, lbw;

        ret = bt_ours(&o, &rep->ours);
        if (ret < 0) {
            fprintf(stderr, "kvtier-bench transport: %s run failed: %s\n", o.backend,
                    strerror(-ret));
            return 1;
        }
        if (!ucx)
            continue;
        if (bt_perftest(o.size, 32, o.iters * 32, &p50, &avg, &bw, bw_cmd, sizeof(bw_cmd)) == 0 &&
            bt_perftest(4096, 1, o.ref_lat_iters, &lp50, &lavg, &lbw, lat_cmd, sizeof(lat_cmd)) ==
                0) {
            rep->pt_mbps = bw;
            rep->pt_lat_p50_us = lp50;
            rep->pt_lat_avg_us = lavg;
            rep->have_pt = true;
        } else {
            fprintf(stderr,
                    "kvtier-bench transport: ucx_perftest failed or its output did not "
                    "parse; no reference in repetition %u\n",
                    r + 1);
        }
        if (bt_raw_ref(o.lat_iters, rep, raw_cmd, sizeof(raw_cmd)) < 0)
            fprintf(stderr,
                    "kvtier-bench transport: kvt-ucp-get-lat failed or is not built; no "
                    "raw floor in repetition %u\n",
                    r + 1);
    }
    bt_summarise(reps, o.reps, &sum);
    if (o.json)
        bt_print_json(&o, reps, o.reps, &sum, bw_cmd, lat_cmd, raw_cmd);
    else
        bt_print_text(&o, reps, o.reps, &sum, bw_cmd, lat_cmd, raw_cmd);
    return 0;
}

/* The verbs backend between two processes, on a real RDMA device (soft-RoCE in the
 * tests/rdma guests): the backend's own test, beside the transport conformance suite.
 *
 *   verbs_pair --local-pair --addr A        forks a server on A, runs the checks
 *   verbs_pair --role server --addr A --port P
 *   verbs_pair --role client --addr A --port P
 *
 * The server registers a region filled with a pattern (byte o = f(o)), sends its
 * packed handle as the first message, echoes every other message back and exits 0
 * when its endpoint closes. The client (cmocka) checks: connect and handle exchange;
 * messages both ways in order with -EAGAIN back-pressure; READ batches of 1..1024
 * chunks of 4 KiB..4 MiB, every byte verified; 64 batches in flight; the local range
 * checks; a batch of chained reads with adjacent remote ranges (scatter lists); close
 * with batches in flight (each fails with -ECANCELED, CLOSED with 0). Without an RDMA
 * device it fails: nothing here skips. */
#include <errno.h>
#include <getopt.h>
#include <poll.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <cmocka.h>

#include "kvt/transport.h"

#define REGION_BYTES (32u << 20)
#define MAX_MSG      (16u << 10)
#define N_MSGS       3000
#define ECHO_QUEUE   4096

static uint8_t pattern_byte(uint64_t o)
{
    uint64_t x = o * 0x9e3779b97f4a7c15ull;

    return (uint8_t)(x >> 56 ^ o);
}

static uint64_t now_ms(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

/* Progress until done() or timeout; sleeps on the event fd when arm allows. */
static int pump(struct kvt_transport *tp, bool (*done)(void), unsigned timeout_ms)
{
    uint64_t end = now_ms() + timeout_ms;

    while (done == NULL || !done()) {
        int rc = kvt_tp_progress(tp);

        if (rc < 0)
            return rc;
        if (now_ms() >= end)
            return done == NULL ? 0 : -ETIMEDOUT;
        if (rc == 0 && kvt_tp_arm(tp) == 0) {
            struct pollfd pfd = {.fd = kvt_tp_event_fd(tp), .events = POLLIN};

            poll(&pfd, 1, 50);
        }
    }
    return 0;
}

/* ---- server ---- */

struct echo {
    size_t len;
    uint8_t data[MAX_MSG];
};

static struct {
    struct kvt_transport *tp;
    struct kvt_tp_ep *ep;
    struct kvt_tp_mr *mr;
    struct echo *q;
    size_t q_head, q_len;
    bool gone;
    int closed_err;
} srv;

static void srv_flush(void)
{
    while (srv.q_len > 0 && srv.ep != NULL) {
        struct echo *e = &srv.q[srv.q_head];
        int rc = kvt_tp_send(srv.ep, e->data, e->len);

        if (rc == -EAGAIN)
            return;
        if (rc != 0) {
            fprintf(stderr, "server: send: %s\n", strerror(-rc));
            exit(1);
        }
        srv.q_head = (srv.q_head + 1) % ECHO_QUEUE;
        srv.q_len--;
    }
}

static int srv_accept(void *arg, struct kvt_tp_ep *ep)
{
    uint8_t h[KVT_TP_MAX_HANDLE_SIZE];
    size_t hl;
    int rc;

    if (srv.ep != NULL)
        return -EBUSY; /* one client */
    srv.ep = ep;
    rc = kvt_tp_ep_authorize(ep); /* no handshake here: the client is trusted */
    if (rc == 0)
        rc = kvt_tp_pack(srv.tp, srv.mr, h, sizeof(h), &hl);
    if (rc == 0)
        rc = kvt_tp_send(ep, h, hl);
    if (rc == 0)
        rc = kvt_tp_ep_authorize(ep); /* the test's own client: no handshake */
    if (rc != 0) {
        fprintf(stderr, "server: sending the handle: %s\n", strerror(-rc));
        exit(1);
    }
    return 0;
}

static void srv_state(void *arg, struct kvt_tp_ep *ep, enum kvt_ep_state st, int err)
{
    if (st == KVT_EP_CLOSED && ep == srv.ep) {
        srv.ep = NULL;
        srv.gone = true;
        srv.closed_err = err;
    }
}

static void srv_msg(void *arg, struct kvt_tp_ep *ep, const void *buf, size_t len)
{
    struct echo *e;

    if (srv.q_len == ECHO_QUEUE) {
        fprintf(stderr, "server: echo queue full\n");
        exit(1);
    }
    e = &srv.q[(srv.q_head + srv.q_len) % ECHO_QUEUE];
    memcpy(e->data, buf, len);
    e->len = len;
    srv.q_len++;
    srv_flush();
}

static bool srv_done(void)
{
    srv_flush();
    return srv.gone;
}

static int server_main(const char *addr, uint16_t port, int ready_fd)
{
    struct kvt_transport_config cfg = {
        .backend = "verbs",
        .max_msg_bytes = MAX_MSG,
        .cb = {.on_accept = srv_accept, .on_ep_state = srv_state, .on_msg = srv_msg},
    };
    uint8_t *region;
    uint16_t got;
    int rc;

    srv.q = calloc(ECHO_QUEUE, sizeof(*srv.q));
    region = malloc(REGION_BYTES);
    if (srv.q == NULL || region == NULL)
        return 1;
    for (uint64_t o = 0; o < REGION_BYTES; o++)
        region[o] = pattern_byte(o);
    rc = kvt_tp_open(&cfg, &srv.tp);
    if (rc == 0)
        rc = kvt_tp_reg_remote(srv.tp, region, REGION_BYTES, &srv.mr);
    if (rc == 0)
        rc = kvt_tp_listen(srv.tp, addr, port, &got);
    if (rc != 0) {
        fprintf(stderr, "server: open/register/listen on %s:%u: %s\n", addr, port, strerror(-rc));
        return 1;
    }
    if (ready_fd >= 0) {
        if (write(ready_fd, &got, sizeof(got)) != (ssize_t)sizeof(got))
            return 1;
        close(ready_fd);
    }
    fprintf(stderr, "server: listening on %s:%u\n", addr, got);
    rc = pump(srv.tp, srv_done, 600000);
    kvt_tp_dereg(srv.mr, srv.tp);
    kvt_tp_close(srv.tp);
    free(region);
    free(srv.q);
    if (rc != 0) {
        fprintf(stderr, "server: %s\n", strerror(-rc));
        return 1;
    }
    fprintf(stderr, "server: client gone (%s)\n", strerror(-srv.closed_err));
    return 0;
}

/* ---- client ---- */

static struct {
    const char *addr;
    uint16_t port;
    struct kvt_transport *tp;
    struct kvt_tp_ep *ep;
    struct kvt_tp_rkey *rk;
    struct kvt_tp_mr *local;
    uint8_t *buf;
    size_t buf_len;
    bool connected, closed;
    int closed_err;
    uint64_t rx_next; /* next echo sequence expected */
    uint64_t rx_bad;
    int batches_done, batches_failed, last_status;
} cli;

static size_t msg_len(uint64_t seq)
{
    return 8 + (seq * 7919) % (MAX_MSG - 8);
}

static void msg_fill(uint64_t seq, uint8_t *p, size_t len)
{
    memcpy(p, &seq, 8);
    for (size_t i = 8; i < len; i++)
        p[i] = (uint8_t)(seq + i);
}

static void cli_state(void *arg, struct kvt_tp_ep *ep, enum kvt_ep_state st, int err)
{
    if (st == KVT_EP_CONNECTED) {
        cli.connected = true;
        if (kvt_tp_ep_authorize(ep) != 0) {
            fprintf(stderr, "client: authorize failed\n");
            exit(1);
        }
    } else {
        cli.closed = true;
        cli.closed_err = err;
        cli.ep = NULL;
    }
}

static void cli_msg(void *arg, struct kvt_tp_ep *ep, const void *buf, size_t len)
{
    uint8_t tmp[MAX_MSG];
    uint64_t seq;

    if (cli.rk == NULL) { /* the first message is the handle */
        int rc = kvt_tp_unpack(ep, buf, len, &cli.rk);

        if (rc != 0) {
            fprintf(stderr, "client: unpack: %s\n", strerror(-rc));
            cli.rx_bad++;
        }
        return;
    }
    if (len < 8) {
        cli.rx_bad++;
        return;
    }
    memcpy(&seq, buf, 8);
    msg_fill(cli.rx_next, tmp, msg_len(cli.rx_next));
    if (seq != cli.rx_next || len != msg_len(seq) || memcmp(buf, tmp, len) != 0)
        cli.rx_bad++;
    cli.rx_next++;
}

static void cli_read_cb(void *arg, int status)
{
    cli.batches_done++;
    if (status != 0) {
        cli.batches_failed++;
        cli.last_status = status;
    }
}

static bool cli_ready(void)
{
    return cli.closed || (cli.connected && cli.rk != NULL);
}

static int client_setup(void **state)
{
    struct kvt_transport_config cfg = {
        .backend = "verbs",
        .max_msg_bytes = MAX_MSG,
        .cb = {.on_ep_state = cli_state, .on_msg = cli_msg},
    };

    cli.buf_len = 8u << 20;
    cli.buf = malloc(cli.buf_len);
    if (cli.buf == NULL)
        return -1;
    if (kvt_tp_open(&cfg, &cli.tp) != 0 ||
        kvt_tp_reg_local(cli.tp, cli.buf, cli.buf_len, &cli.local) != 0) {
        fprintf(stderr, "client: no verbs transport (is there an RDMA device?)\n");
        return -1;
    }
    /* The server may not listen yet: retry the connection for a while. */
    for (int i = 0; i < 40; i++) {
        cli.connected = cli.closed = false;
        if (kvt_tp_connect(cli.tp, cli.addr, cli.port, NULL, &cli.ep) == 0 &&
            pump(cli.tp, cli_ready, 10000) == 0 && !cli.closed)
            return 0;
        fprintf(stderr, "client: connect to %s:%u: %s, retrying\n", cli.addr, cli.port,
                strerror(-cli.closed_err));
        pump(cli.tp, NULL, 500);
    }
    return -1;
}

static int client_teardown(void **state)
{
    if (cli.rk != NULL)
        kvt_tp_rkey_destroy(cli.tp, cli.rk);
    if (cli.local != NULL)
        kvt_tp_dereg(cli.local, cli.tp);
    kvt_tp_close(cli.tp);
    free(cli.buf);
    return 0;
}

static void test_connected(void **state)
{
    assert_true(cli.connected);
    assert_non_null(cli.rk);
    assert_int_equal(cli.rx_bad, 0);
}

static bool all_echoed(void)
{
    return cli.closed || cli.rx_next == N_MSGS;
}

static void test_messages_both_ways(void **state)
{
    uint8_t buf[MAX_MSG];
    uint64_t seq = 0, again = 0, end = now_ms() + 120000;

    assert_int_equal(kvt_tp_send(cli.ep, buf, MAX_MSG + 1), -EMSGSIZE);
    while (seq < N_MSGS && now_ms() < end && !cli.closed) {
        size_t len = msg_len(seq);
        int rc;

        msg_fill(seq, buf, len);
        rc = kvt_tp_send(cli.ep, buf, len);
        if (rc == -EAGAIN) {
            again++;
            assert_true(kvt_tp_progress(cli.tp) >= 0);
            continue;
        }
        assert_int_equal(rc, 0);
        seq++;
    }
    assert_int_equal(seq, N_MSGS);
    assert_int_equal(pump(cli.tp, all_echoed, 120000), 0);
    assert_false(cli.closed);
    assert_int_equal(cli.rx_next, N_MSGS);
    assert_int_equal(cli.rx_bad, 0);
    printf("messages: %d each way, %llu sends refused with -EAGAIN (credits)\n", N_MSGS,
           (unsigned long long)again);
}

static int target_done;
static bool batches_reached(void)
{
    return cli.closed || cli.batches_done >= target_done;
}

static void check_bytes(const struct kvt_read_op *ops, size_t n)
{
    for (size_t i = 0; i < n; i++)
        for (uint64_t j = 0; j < ops[i].len; j++)
            if (cli.buf[ops[i].local_off + j] != pattern_byte(ops[i].remote_off + j))
                fail_msg("op %zu byte %llu differs", i, (unsigned long long)j);
}

/* One batch of n chunks of sz bytes from scattered remote offsets. */
static void read_one(size_t n, uint64_t sz, uint64_t seed)
{
    struct kvt_read_op *ops = calloc(n, sizeof(*ops));
    uint64_t slots = REGION_BYTES / sz;

    assert_non_null(ops);
    assert_true(n * sz <= cli.buf_len);
    for (size_t i = 0; i < n; i++) {
        ops[i].remote_off = ((seed + i * 7) % slots) * sz + (i % 3);
        if (ops[i].remote_off + sz > REGION_BYTES)
            ops[i].remote_off -= 3;
        ops[i].local_off = i * sz;
        ops[i].len = sz;
    }
    memset(cli.buf, 0, n * sz);
    uint64_t t0 = now_ms();
    target_done = cli.batches_done + 1;
    assert_int_equal(kvt_tp_read(cli.ep, cli.rk, cli.local, ops, n, cli_read_cb, NULL),
                     -EINPROGRESS);
    assert_int_equal(pump(cli.tp, batches_reached, 60000), 0);
    uint64_t dt = now_ms() - t0;
    assert_int_equal(cli.batches_failed, 0);
    check_bytes(ops, n);
    printf("read %4zu x %7llu bytes: %llu ms\n", n, (unsigned long long)sz, (unsigned long long)dt);
    free(ops);
}

static void test_read_sizes(void **state)
{
    static const uint64_t sizes[] = {4096, 65536, 262144, 1u << 20, 4u << 20};
    static const size_t counts[] = {1, 2, 32, 1024};

    for (size_t s = 0; s < sizeof(sizes) / sizeof(sizes[0]); s++)
        for (size_t c = 0; c < sizeof(counts) / sizeof(counts[0]); c++) {
            size_t n = counts[c];

            while (n > 1 && n * sizes[s] > cli.buf_len)
                n /= 2;
            read_one(n, sizes[s], s * 31 + c);
        }
}

/* Adjacent remote ranges into scattered local ranges: one WR with a scatter list. */
static void test_read_scatter(void **state)
{
    struct kvt_read_op ops[100];

    for (size_t i = 0; i < 100; i++) {
        ops[i].remote_off = 12345 + i * 1000;
        ops[i].local_off = (99 - i) * 4096;
        ops[i].len = 1000;
    }
    memset(cli.buf, 0, 100 * 4096);
    target_done = cli.batches_done + 1;
    assert_int_equal(kvt_tp_read(cli.ep, cli.rk, cli.local, ops, 100, cli_read_cb, NULL),
                     -EINPROGRESS);
    assert_int_equal(pump(cli.tp, batches_reached, 60000), 0);
    assert_int_equal(cli.batches_failed, 0);
    check_bytes(ops, 100);
}

static void test_read_64_in_flight(void **state)
{
    struct kvt_read_op ops[64][16];

    memset(cli.buf, 0, 64 * 16 * 4096);
    target_done = cli.batches_done + 64;
    for (size_t b = 0; b < 64; b++) {
        for (size_t i = 0; i < 16; i++) {
            ops[b][i].remote_off = (b * 16 + i) * 8192 + b;
            ops[b][i].local_off = (b * 16 + i) * 4096;
            ops[b][i].len = 4096;
        }
        assert_int_equal(kvt_tp_read(cli.ep, cli.rk, cli.local, ops[b], 16, cli_read_cb, NULL),
                         -EINPROGRESS);
    }
    assert_int_equal(pump(cli.tp, batches_reached, 60000), 0);
    assert_int_equal(cli.batches_failed, 0);
    for (size_t b = 0; b < 64; b++)
        check_bytes(ops[b], 16);
}

static void test_read_bounds(void **state)
{
    struct kvt_read_op op = {.remote_off = REGION_BYTES - 100, .local_off = 0, .len = 101};
    int done = cli.batches_done;

    assert_int_equal(kvt_tp_read(cli.ep, cli.rk, cli.local, &op, 1, cli_read_cb, NULL), -EINVAL);
    op = (struct kvt_read_op){.remote_off = 0, .local_off = cli.buf_len - 10, .len = 11};
    assert_int_equal(kvt_tp_read(cli.ep, cli.rk, cli.local, &op, 1, cli_read_cb, NULL), -EINVAL);
    op = (struct kvt_read_op){.remote_off = UINT64_MAX - 5, .local_off = 0, .len = 10};
    assert_int_equal(kvt_tp_read(cli.ep, cli.rk, cli.local, &op, 1, cli_read_cb, NULL), -EINVAL);
    op.len = 0;
    op.remote_off = 0;
    assert_int_equal(kvt_tp_read(cli.ep, cli.rk, cli.local, &op, 1, cli_read_cb, NULL), -EINVAL);
    assert_int_equal(kvt_tp_read(cli.ep, cli.rk, cli.local, &op, 0, cli_read_cb, NULL), -EINVAL);
    assert_int_equal(pump(cli.tp, NULL, 200), 0);
    assert_int_equal(cli.batches_done, done); /* nothing was posted, no callback */
}

static bool closed(void)
{
    return cli.closed;
}

static void test_close_in_flight(void **state)
{
    struct kvt_read_op ops[256];
    int done0 = cli.batches_done, failed0 = cli.batches_failed, posted = 0;

    for (size_t i = 0; i < 256; i++) {
        ops[i].remote_off = i * 65536;
        ops[i].local_off = (i % 64) * 65536;
        ops[i].len = 65536;
    }
    for (int b = 0; b < 32; b++)
        if (kvt_tp_read(cli.ep, cli.rk, cli.local, ops, 256, cli_read_cb, NULL) == -EINPROGRESS)
            posted++;
    assert_int_equal(posted, 32);
    kvt_tp_ep_close(cli.ep);
    assert_int_equal(cli.batches_done, done0); /* never inside the call */
    assert_int_equal(pump(cli.tp, closed, 10000), 0);
    assert_int_equal(cli.batches_done - done0, 32);
    assert_true(cli.batches_failed - failed0 >= 1); /* the tail at least was cut */
    if (cli.batches_failed > failed0)
        assert_int_equal(cli.last_status, -ECANCELED);
    assert_int_equal(cli.closed_err, 0);
    printf("close with 32 batches in flight: %d failed with -ECANCELED\n",
           cli.batches_failed - failed0);
}

static int client_main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_connected),         cmocka_unit_test(test_messages_both_ways),
        cmocka_unit_test(test_read_sizes),        cmocka_unit_test(test_read_scatter),
        cmocka_unit_test(test_read_64_in_flight), cmocka_unit_test(test_read_bounds),
        cmocka_unit_test(test_close_in_flight),
    };

    return cmocka_run_group_tests_name("verbs_pair", tests, client_setup, client_teardown);
}

int main(int argc, char **argv)
{
    static const struct option opts[] = {
        {"role", required_argument, NULL, 'r'},
        {"addr", required_argument, NULL, 'a'},
        {"port", required_argument, NULL, 'p'},
        {"local-pair", no_argument, NULL, 'l'},
        {NULL, 0, NULL, 0},
    };
    const char *role = NULL, *addr = NULL;
    unsigned port = 0;
    bool pair = false;
    int c;

    while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        switch (c) {
        case 'r':
            role = optarg;
            break;
        case 'a':
            addr = optarg;
            break;
        case 'p':
            port = (unsigned)strtoul(optarg, NULL, 10);
            break;
        case 'l':
            pair = true;
            break;
        default:
            return 2;
        }
    }
    if (addr == NULL || port > 65535 || (!pair && role == NULL)) {
        fprintf(stderr, "usage: %s (--local-pair | --role server|client --port P) --addr A\n",
                argv[0]);
        return 2;
    }
    if (pair) {
        int fds[2], status, rc;
        uint16_t got;
        pid_t pid;

        if (pipe(fds) != 0)
            return 1;
        pid = fork();
        if (pid < 0)
            return 1;
        if (pid == 0) {
            close(fds[0]);
            _exit(server_main(addr, (uint16_t)port, fds[1]));
        }
        close(fds[1]);
        if (read(fds[0], &got, sizeof(got)) != (ssize_t)sizeof(got)) {
            fprintf(stderr, "FAIL: the server did not start\n");
            waitpid(pid, &status, 0);
            return 1;
        }
        cli.addr = addr;
        cli.port = got;
        rc = client_main();
        if (waitpid(pid, &status, 0) != pid || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
            fprintf(stderr, "FAIL: the server process ended badly (status 0x%x)\n", status);
            return 1;
        }
        return rc;
    }
    if (strcmp(role, "server") == 0)
        return server_main(addr, (uint16_t)port, -1);
    if (strcmp(role, "client") == 0) {
        cli.addr = addr;
        cli.port = (uint16_t)port;
        return client_main();
    }
    return 2;
}

/* SPDX-License-Identifier: Apache-2.0 */
/* The transport conformance suite: one executable, one backend per run
 * (`kvt-conformance ucx`, `kvt-conformance verbs`), every scenario of the transport
 * contract (kvt/transport.h) checked against a real peer process.
 *
 * Single host (the default): each test starts its own peer, this binary exec'd with
 * --role peer on 127.0.0.1 and port 0, which reports its ports on a pipe; the test
 * ends by closing its endpoint and reaping the peer, whose exit status says whether
 * what it received was right (and, under ASan, that it leaked nothing). Two hosts:
 * `--role server --addr A --port P` on one host restarts a peer on P (mute listener
 * on P+1) for each connection; `--role client --addr A --port P` on the other runs the
 * tests against it, killing and stalling the peer by control message, and ends the
 * server with M_QUIT.
 *
 * Exit status: cmocka's (0 when every test passed), 77 when the backend is not built
 * or needs an RDMA device and there is none (a failure wherever it runs), 2 on usage. */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>
#include <netinet/in.h>
#include <setjmp.h>
#include <stdarg.h>
#include <cmocka.h>

#include "kvt/common.h"
#include "conf.h"

#define LOCAL_BYTES (CONF_REGION_BYTES + (1u << 20)) /* room for unaligned gaps */
#define FILL        0xa5

static struct {
    const char *backend;
    const char *self; /* /proc/self/exe */
    const char *addr;
    uint16_t port, mute_port; /* two-host mode: the server's; else 0 */
    bool two_host;
    uint8_t *expect; /* conf_pattern of the whole region */
} opt = {.addr = "127.0.0.1"};

/* ---- the checker's side of one connection ---- */

struct conn {
    struct kvt_transport *tp;
    struct kvt_tp_ep *ep;
    struct kvt_tp_mr *local_mr;
    struct kvt_tp_rkey *rk;
    uint8_t *local;
    uint64_t region_bytes;
    pid_t peer_pid; /* single host; 0 in two-host mode */
    uint16_t port, mute_port;
    /* callbacks seen */
    int connected, closed, closed_err;
    bool have_handle;
    uint8_t handle[KVT_TP_MAX_HANDLE_SIZE];
    size_t handle_len;
    uint64_t rx_next, rx_errors;
    bool stream_done;
    uint64_t peer_rx, peer_errors;
    int bad_msgs;
    bool in_read; /* a read callback must never fire inside kvt_tp_read */
    int cb_in_read;
    bool no_authorize; /* conn_connect leaves the connection unauthorized */
    int acks;          /* M_ACK seen */
};

static struct conn C;

static void c_on_ep_state(void *arg, struct kvt_tp_ep *ep, enum kvt_ep_state state, int err)
{
    struct conn *c = arg;

    if (ep != c->ep)
        return;
    if (state == KVT_EP_CONNECTED) {
        c->connected++;
    } else {
        c->closed++;
        c->closed_err = err;
        c->ep = NULL;
        c->rk = NULL; /* destroyed below by conn_close: kept in a side slot */
    }
}

static struct kvt_tp_rkey *rk_slot; /* the rkey, destroyed at conn_close */

static void c_on_msg(void *arg, struct kvt_tp_ep *ep, const void *buf, size_t len)
{
    struct conn *c = arg;
    struct conf_msg m;

    if (len < sizeof(m)) {
        c->bad_msgs++;
        return;
    }
    memcpy(&m, buf, sizeof(m));
    switch (m.type) {
    case M_HANDLE:
        if (c->have_handle || len - sizeof(m) > sizeof(c->handle)) {
            c->bad_msgs++;
            return;
        }
        c->region_bytes = m.a;
        c->handle_len = len - sizeof(m);
        memcpy(c->handle, (const uint8_t *)buf + sizeof(m), c->handle_len);
        c->have_handle = true;
        break;
    case M_DATA:
        if (m.a != c->rx_next ||
            !conf_payload_ok(m.a, (const uint8_t *)buf + sizeof(m), len - sizeof(m)))
            c->rx_errors++;
        c->rx_next++;
        break;
    case M_STREAM_DONE:
        c->stream_done = true;
        c->peer_rx = m.a;
        c->peer_errors = m.b;
        break;
    case M_ACK:
        c->acks++;
        break;
    default:
        c->bad_msgs++;
    }
}

static int conn_send_ab(struct conn *c, uint32_t type, uint64_t a, uint64_t b, const void *data,
                        size_t len)
{
    static uint8_t buf[sizeof(struct conf_msg) + CONF_MAX_MSG];
    struct conf_msg *m = (struct conf_msg *)buf;
    int ret;

    *m = (struct conf_msg){.type = type, .a = a, .b = b};
    if (len > 0)
        memcpy(m->data, data, len);
    while ((ret = kvt_tp_send(c->ep, buf, sizeof(*m) + len)) == -EAGAIN)
        kvt_tp_progress(c->tp);
    return ret;
}

static int conn_send(struct conn *c, uint32_t type, uint64_t a, const void *data, size_t len)
{
    return conn_send_ab(c, type, a, 0, data, len);
}

static bool acked(void *arg)
{
    struct conn *c = arg;

    return c->closed > 0 || c->acks > 0;
}

/* Sends M_EXPECT or M_DENY and waits for the peer's M_ACK: it is in effect then. */
static int conn_tell(struct conn *c, uint32_t type, uint64_t a, uint64_t b)
{
    int ret;

    c->acks = 0;
    ret = conn_send_ab(c, type, a, b, NULL, 0);
    if (ret == 0)
        ret = conf_pump(c->tp, acked, c, 10000);
    if (ret == 0 && c->acks == 0)
        ret = -ECONNRESET;
    return ret;
}

/* The peer's refusal counter r must be exactly n when it exits (single host: its
 * exit status says so). */
static void conn_expect(struct conn *c, enum kvt_tp_refusal r, uint64_t n)
{
    int ret = conn_tell(c, M_EXPECT, r, n);

    if (ret != 0)
        fail_msg("M_EXPECT: %s", strerror(-ret));
}

static bool conn_ready(void *arg)
{
    struct conn *c = arg;

    return c->closed > 0 || (c->connected > 0 && c->have_handle);
}

static bool conn_closed(void *arg)
{
    return ((struct conn *)arg)->closed > 0;
}

/* Starts a peer (single host) and fills c->port / c->mute_port. */
static int peer_start(struct conn *c)
{
    int fds[2];
    char port_s[16], fd_s[16];
    char buf[64] = {0};
    ssize_t n, got = 0;

    if (opt.two_host) {
        c->port = opt.port;
        c->mute_port = opt.mute_port;
        return 0;
    }
    if (pipe(fds) < 0)
        return -errno;
    c->peer_pid = fork();
    if (c->peer_pid < 0)
        return -errno;
    if (c->peer_pid == 0) {
        close(fds[0]);
        snprintf(port_s, sizeof(port_s), "%d", 0);
        snprintf(fd_s, sizeof(fd_s), "%d", fds[1]);
        execl(opt.self, opt.self, opt.backend, "--role", "peer", "--addr", opt.addr, "--port",
              port_s, "--ready-fd", fd_s, (char *)NULL);
        _exit(127);
    }
    close(fds[1]);
    while (got < (ssize_t)sizeof(buf) - 1 &&
           (n = read(fds[0], buf + got, sizeof(buf) - 1 - got)) > 0)
        got += n;
    close(fds[0]);
    unsigned p, mp;
    if (sscanf(buf, "%u %u", &p, &mp) != 2)
        return -EIO;
    c->port = (uint16_t)p;
    c->mute_port = (uint16_t)mp;
    return 0;
}

/* Waits for the single-host peer; returns its wait status. */
static int peer_reap(struct conn *c, unsigned timeout_ms)
{
    uint64_t until = conf_now_ms() + timeout_ms;
    int st = 0;

    if (c->peer_pid <= 0)
        return 0;
    while (waitpid(c->peer_pid, &st, WNOHANG) == 0) {
        if (conf_now_ms() >= until) {
            kill(c->peer_pid, SIGKILL);
            waitpid(c->peer_pid, &st, 0);
            fprintf(stderr, "peer %d did not exit in %u ms: killed\n", c->peer_pid, timeout_ms);
            c->peer_pid = 0;
            return -1;
        }
        if (c->tp != NULL)
            conf_pump(c->tp, NULL, NULL, 10);
        else
            usleep(10000);
    }
    c->peer_pid = 0;
    return st;
}

static bool rdma_device_present(void);

static void conn_config(struct kvt_transport_config *cfg)
{
    *cfg = (struct kvt_transport_config){
        .backend = opt.backend,
        .max_msg_bytes = CONF_MAX_MSG,
        /* soft-RoCE in TCG guests moves ~6 MB/s: a 64 MiB batch needs more than the
         * default 10 s there. */
        .op_timeout_ms = strcmp(opt.backend, "verbs") == 0 || rdma_device_present() ? 60000 : 0,
        .local_addr = opt.addr,
        .cb = {.on_ep_state = c_on_ep_state, .on_msg = c_on_msg, .arg = &C},
    };
}

static int conn_open(const struct kvt_transport_config *cfg)
{
    struct conn *c = &C;
    int ret;

    ret = kvt_tp_open(cfg, &c->tp);
    if (ret < 0)
        return ret;
    c->local = aligned_alloc(4096, LOCAL_BYTES);
    if (c->local == NULL)
        return -ENOMEM;
    return kvt_tp_reg_local(c->tp, c->local, LOCAL_BYTES, &c->local_mr);
}

/* Both ends authorize: M_AUTHORIZE (the peer authorizes and acks), ours, the ack. */
static int conn_authorize(struct conn *c)
{
    int ret;

    c->acks = 0;
    ret = conn_send(c, M_AUTHORIZE, 0, NULL, 0);
    if (ret == 0)
        ret = kvt_tp_ep_authorize(c->ep);
    if (ret == 0)
        ret = conf_pump(c->tp, acked, c, 10000);
    if (ret == 0 && c->acks == 0)
        ret = -ECONNRESET;
    return ret;
}

/* Connects to the peer (retrying while a two-host server restarts its peer). */
static int conn_connect(struct conn *c)
{
    uint64_t until = conf_now_ms() + 15000;
    int ret;

    for (;;) {
        c->connected = c->closed = 0;
        c->have_handle = false;
        ret = kvt_tp_connect(c->tp, opt.addr, c->port, c, &c->ep);
        if (ret < 0)
            return ret;
        ret = conf_pump(c->tp, conn_ready, c, 10000);
        if (ret < 0)
            return ret;
        if (c->closed == 0)
            break;
        if (!opt.two_host || conf_now_ms() >= until)
            return c->closed_err != 0 ? c->closed_err : -ECONNRESET;
        usleep(200000);
    }
    /* The handshake, as an owner runs one: the peer authorizes on M_AUTHORIZE, we
     * right after (our messages wait for the peer's authorize, in order), and its
     * M_ACK says it has. */
    if (!c->no_authorize) {
        ret = conn_authorize(c);
        if (ret < 0)
            return ret;
    }
    ret = kvt_tp_unpack(c->ep, c->handle, c->handle_len, &c->rk);
    if (ret == 0)
        rk_slot = c->rk;
    return ret;
}

/* A peer and a connection to it, opened with cfg (NULL: defaults). */
static int conn_setup(const struct kvt_transport_config *cfg)
{
    struct kvt_transport_config def;
    int ret;

    memset(&C, 0, sizeof(C));
    rk_slot = NULL;
    if (cfg == NULL) {
        conn_config(&def);
        cfg = &def;
    }
    ret = peer_start(&C);
    if (ret < 0)
        return ret;
    ret = conn_open(cfg);
    if (ret < 0)
        return ret;
    return conn_connect(&C);
}

static int setup_done(int ret);

static int setup_default(void **state)
{
    return setup_done(conn_setup(NULL));
}

/* Closes what is left, reaps the peer and checks nothing leaked into callbacks. */
static void conn_close(struct conn *c, bool expect_peer_ok)
{
    if (c->ep != NULL) {
        kvt_tp_ep_close(c->ep);
        conf_pump(c->tp, conn_closed, c, 5000);
    }
    if (rk_slot != NULL && c->tp != NULL) {
        kvt_tp_rkey_destroy(c->tp, rk_slot);
        rk_slot = NULL;
    }
    int st = peer_reap(c, 10000);

    if (c->local_mr != NULL)
        kvt_tp_dereg(c->local_mr, c->tp);
    kvt_tp_close(c->tp);
    free(c->local);
    c->tp = NULL;
    c->local = NULL;
    c->local_mr = NULL;
    if (expect_peer_ok && !opt.two_host) {
        if (!WIFEXITED(st) || WEXITSTATUS(st) != 0)
            fprintf(stderr, "peer wait status %#x\n", st);
        assert_true(WIFEXITED(st));
        assert_int_equal(WEXITSTATUS(st), 0);
    }
}

static int teardown_default(void **state)
{
    conn_close(&C, true);
    return 0;
}

/* A setup's result. cmocka runs no teardown after a failed setup, so a failed one
 * closes here what it opened (the transport, the local region, a single-host peer):
 * on two guests every test's setup once failed and each left ~70 MiB behind, until
 * the client guest (1 GiB, ASan) killed the suite. */
static int setup_done(int ret)
{
    if (ret >= 0)
        return 0;
    fprintf(stderr, "setup: %s\n", strerror(-ret));
    conn_close(&C, false);
    return -1;
}

/* ---- READ bookkeeping ---- */

struct batch {
    int done;   /* callbacks seen */
    int status; /* the last one */
    uint64_t done_ms;
};

static void batch_cb(void *arg, int status)
{
    struct batch *b = arg;

    if (C.in_read)
        C.cb_in_read++;
    b->done++;
    b->status = status;
    b->done_ms = conf_now_ms();
}

static int read_batch(struct conn *c, const struct kvt_read_op *ops, size_t n, struct batch *b)
{
    int ret;

    c->in_read = true;
    ret = kvt_tp_read(c->ep, c->rk, c->local_mr, ops, n, batch_cb, b);
    c->in_read = false;
    return ret;
}

struct waitn {
    struct batch *b;
    size_t n;
};

static bool all_done(void *arg)
{
    struct waitn *w = arg;

    for (size_t i = 0; i < w->n; i++)
        if (w->b[i].done == 0)
            return false;
    return true;
}

static uint64_t rnd_state = 0x1234567;

static uint64_t rnd(void)
{
    rnd_state ^= rnd_state << 13;
    rnd_state ^= rnd_state >> 7;
    rnd_state ^= rnd_state << 17;
    return rnd_state;
}

/* n ops of len bytes: random remote offsets (some unaligned), local offsets packed
 * from local_base with small gaps. Returns the local end. */
static uint64_t make_ops(struct kvt_read_op *ops, size_t n, uint64_t len, uint64_t local_base)
{
    uint64_t lo = local_base;

    for (size_t i = 0; i < n; i++) {
        uint64_t ro = rnd() % (CONF_REGION_BYTES - len + 1);

        if (i % 4 != 3)
            ro &= ~4095ull; /* mostly page aligned, every 4th not */
        ops[i] = (struct kvt_read_op){.remote_off = ro, .local_off = lo, .len = len};
        lo += len + (i % 3); /* gaps: bytes that must stay FILL */
    }
    return lo;
}

/* Every byte of every op equals the pattern; every other byte in [lo_begin, lo_end)
 * is still FILL. */
static void verify_ops(const struct conn *c, const struct kvt_read_op *ops, size_t n,
                       uint64_t lo_begin, uint64_t lo_end)
{
    uint64_t pos = lo_begin;

    for (size_t i = 0; i < n; i++) {
        for (; pos < ops[i].local_off; pos++)
            if (c->local[pos] != FILL)
                fail_msg("local byte %" PRIu64 " (a gap) was written", pos);
        if (memcmp(c->local + ops[i].local_off, opt.expect + ops[i].remote_off, ops[i].len) != 0) {
            uint64_t k = 0;

            while (c->local[ops[i].local_off + k] == opt.expect[ops[i].remote_off + k])
                k++;
            fail_msg("op %zu (remote %" PRIu64 ", %" PRIu64 " bytes): byte %" PRIu64 " differs", i,
                     ops[i].remote_off, ops[i].len, k);
        }
        pos = ops[i].local_off + ops[i].len;
    }
    for (; pos < lo_end; pos++)
        if (c->local[pos] != FILL)
            fail_msg("local byte %" PRIu64 " (after the ops) was written", pos);
}

/* ---- the tests ---- */

static bool closed_or(void *arg)
{
    return C.closed > 0;
}

/* Connect and accept: CONNECTED once, the handle sent from on_accept arrives first,
 * a local close reports CLOSED(0) once; a port nobody listens on fails the connect. */
static void test_connect_accept(void **state)
{
    assert_int_equal(C.connected, 1);
    assert_true(C.have_handle);
    assert_int_equal(C.region_bytes, CONF_REGION_BYTES);
    assert_int_equal(C.bad_msgs, 0);
    assert_non_null(C.rk);

    kvt_tp_ep_close(C.ep);
    assert_int_equal(conf_pump(C.tp, conn_closed, &C, 5000), 0);
    assert_int_equal(C.closed, 1);
    assert_int_equal(C.closed_err, 0);
    assert_int_equal(conf_pump(C.tp, NULL, NULL, 100), 0);
    assert_int_equal(C.closed, 1); /* exactly once */

    if (opt.two_host)
        return;
    /* A port with no listener: an error, reported as CLOSED, in bounded time. */
    int s = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t sl = sizeof(sa);

    assert_true(s >= 0);
    assert_int_equal(bind(s, (struct sockaddr *)&sa, sizeof(sa)), 0);
    assert_int_equal(getsockname(s, (struct sockaddr *)&sa, &sl), 0);
    close(s);

    struct kvt_tp_ep *ep;
    uint64_t t0 = conf_now_ms();

    C.closed = C.connected = 0;
    assert_int_equal(kvt_tp_connect(C.tp, opt.addr, ntohs(sa.sin_port), &C, &ep), 0);
    C.ep = ep;
    assert_int_equal(conf_pump(C.tp, closed_or, NULL, 10000), 0);
    assert_int_equal(C.connected, 0);
    assert_int_equal(C.closed, 1);
    assert_true(C.closed_err < 0);
    printf("# connect to a closed port: %s after %" PRIu64 " ms\n", strerror(-C.closed_err),
           conf_now_ms() - t0);
}

static bool stream_finished(void *arg)
{
    struct conn *c = arg;

    return c->closed > 0 || (c->stream_done && c->rx_next >= 10000);
}

/* 10,000 control messages each way at once, in order, every byte checked. */
static void test_messages_both_ways(void **state)
{
    static uint8_t payload[CONF_MAX_MSG];
    const uint64_t n = 10000;

    assert_int_equal(conn_send(&C, M_STREAM, n, NULL, 0), 0);
    for (uint64_t seq = 0; seq < n; seq++) {
        size_t len = conf_payload_len(seq);
        int ret;

        conf_payload(seq, payload, len);
        assert_int_equal(conn_send(&C, M_DATA, seq, payload, len), 0);
        if (seq % 64 == 0 && (ret = kvt_tp_progress(C.tp)) < 0)
            fail_msg("progress: %s", strerror(-ret));
    }
    assert_int_equal(conf_pump(C.tp, stream_finished, &C, 60000), 0);
    assert_int_equal(C.closed, 0);
    assert_int_equal(C.rx_next, n);
    assert_int_equal(C.rx_errors, 0);
    assert_int_equal(C.peer_rx, n);
    assert_int_equal(C.peer_errors, 0);
    assert_int_equal(C.bad_msgs, 0);
    /* Too large a message is refused and changes nothing. */
    assert_int_equal(kvt_tp_send(C.ep, payload, CONF_MAX_MSG + 1), -EMSGSIZE);
}

/* How this instance's READs moved (kvt_tp_ep_info, after the first batches: UCX may
 * move an endpoint to other lanes once wireup ends). KVT_CONF_EXPECT_PATH, when set,
 * must be exactly that: the shared-memory instance checks that its READs went over
 * sysv and cma and nothing else (not back over tcp). */
static void check_read_path(void)
{
    const char *want = getenv("KVT_CONF_EXPECT_PATH");
    char info[96] = "";
    int ret = kvt_tp_ep_info(C.ep, info, sizeof(info));

    if (ret == 0)
        printf("# READ path: %s\n", info);
    if (want != NULL && (ret != 0 || strcmp(info, want) != 0))
        fail_msg("READ path '%s' (ep_info %d), expected '%s'", info, ret, want);
}

/* READ batches of 1..1024 chunks of 4 KiB..4 MiB, every byte verified. */
static void test_read_batches(void **state)
{
    static const size_t counts[] = {1, 3, 16, 32, 256, 1024};
    static const uint64_t sizes[] = {4096, 65536, 1u << 20, 4u << 20};
    static struct kvt_read_op ops[1024];
    unsigned batches = 0;

    for (size_t ci = 0; ci < (size_t)KVT_ARRAY_SIZE(counts); ci++) {
        for (size_t si = 0; si < (size_t)KVT_ARRAY_SIZE(sizes); si++) {
            size_t n = counts[ci];
            uint64_t len = sizes[si];
            struct batch b = {0};
            struct waitn w = {&b, 1};

            if (n * len > CONF_REGION_BYTES)
                continue;
            uint64_t end = make_ops(ops, n, len, si % 2);

            memset(C.local, FILL, end + 64);
            int ret = read_batch(&C, ops, n, &b);

            if (ret != -EINPROGRESS && ret != 0)
                fail_msg("read of %zu x %" PRIu64 ": %s", n, len, strerror(-ret));
            if (ret == -EINPROGRESS)
                assert_int_equal(conf_pump(C.tp, all_done, &w, 60000), 0);
            else
                b.done = 1;
            assert_int_equal(b.done, 1);
            if (b.status != 0)
                fail_msg("batch of %zu x %" PRIu64 " failed: %s", n, len, strerror(-b.status));
            verify_ops(&C, ops, n, si % 2, end + 64);
            batches++;
        }
    }
    assert_int_equal(C.cb_in_read, 0);
    assert_int_equal(conf_pump(C.tp, NULL, NULL, 50), 0);
    assert_int_equal(C.closed, 0);
    printf("# %u batches verified\n", batches);
    check_read_path();
}

#define INFLIGHT         64
#define INFLIGHT_BASE(i) ((uint64_t)(i) * ((1u << 20) + 4096)) /* 16 x 64 KiB + gaps */

static int setup_inflight(void **state)
{
    struct kvt_transport_config cfg;

    conn_config(&cfg);
    cfg.max_batches = INFLIGHT;
    return setup_done(conn_setup(&cfg));
}

/* Posts INFLIGHT batches of 16 x 64 KiB (1 MiB apart locally), all before any
 * progress. */
static void post_inflight(struct kvt_read_op (*ops)[16], struct batch *b)
{
    for (int i = 0; i < INFLIGHT; i++) {
        make_ops(ops[i], 16, 65536, INFLIGHT_BASE(i));
        int ret = read_batch(&C, ops[i], 16, &b[i]);

        if (ret != -EINPROGRESS)
            fail_msg("batch %d: %s", i, strerror(-ret));
    }
}

/* 64 batches in flight; the 65th is refused with -EAGAIN (max_batches 64). */
static void test_inflight_64(void **state)
{
    static struct kvt_read_op ops[INFLIGHT][16];
    struct batch b[INFLIGHT + 1] = {0};
    struct waitn w = {b, INFLIGHT};
    bool refused = false;

    memset(C.local, FILL, LOCAL_BYTES);
    post_inflight(ops, b);
    /* All 64 still counted unless some finished already: then the 65th may pass. */
    int ret = read_batch(&C, ops[0], 16, &b[INFLIGHT]);

    if (ret == -EAGAIN)
        refused = true;
    else if (ret == -EINPROGRESS)
        w.n = INFLIGHT + 1;
    else
        fail_msg("65th batch: %s", strerror(-ret));
    assert_int_equal(conf_pump(C.tp, all_done, &w, 60000), 0);
    assert_int_equal(C.cb_in_read, 0);
    for (int i = 0; i < INFLIGHT; i++) {
        assert_int_equal(b[i].done, 1);
        if (b[i].status != 0)
            fail_msg("batch %d: %s", i, strerror(-b[i].status));
        verify_ops(&C, ops[i], 16, INFLIGHT_BASE(i), INFLIGHT_BASE(i) + 16 * 65536 + 16);
    }
    assert_int_equal(b[INFLIGHT].done, refused ? 0 : 1);
    printf("# 65th batch %s\n", refused ? "refused with -EAGAIN" : "accepted (some had finished)");
    assert_true(refused);
}

/* Closing the endpoint with 64 batches in flight: each completes exactly once,
 * the unfinished ones with -ECANCELED; CLOSED(0); nothing written after. */
static void test_close_endpoint_inflight(void **state)
{
    static struct kvt_read_op ops[INFLIGHT][16];
    struct batch b[INFLIGHT] = {0};
    struct waitn w = {b, INFLIGHT};
    int failed = 0;

    post_inflight(ops, b);
    kvt_tp_ep_close(C.ep);
    assert_int_equal(conf_pump(C.tp, all_done, &w, 10000), 0);
    assert_int_equal(conf_pump(C.tp, conn_closed, &C, 10000), 0);
    assert_int_equal(C.closed_err, 0);
    for (int i = 0; i < INFLIGHT; i++) {
        assert_int_equal(b[i].done, 1);
        if (b[i].status != 0) {
            assert_int_equal(b[i].status, -ECANCELED);
            failed++;
        }
    }
    printf("# endpoint close: %d of %d batches cancelled\n", failed, INFLIGHT);
    assert_true(failed > 0);
    /* The destination goes away; anything written after this is a use after free. */
    rk_slot != NULL ? kvt_tp_rkey_destroy(C.tp, rk_slot) : (void)0;
    rk_slot = NULL;
    kvt_tp_dereg(C.local_mr, C.tp);
    C.local_mr = NULL;
    free(C.local);
    C.local = NULL;
    assert_int_equal(conf_pump(C.tp, NULL, NULL, 300), 0);
    for (int i = 0; i < INFLIGHT; i++)
        assert_int_equal(b[i].done, 1);
}

/* Closing the transport with 64 batches in flight: every callback and the CLOSED
 * report happen before kvt_tp_close returns. */
static void test_close_transport_inflight(void **state)
{
    static struct kvt_read_op ops[INFLIGHT][16];
    struct batch b[INFLIGHT] = {0};
    int failed = 0;

    post_inflight(ops, b);
    if (rk_slot != NULL) {
        kvt_tp_rkey_destroy(C.tp, rk_slot);
        rk_slot = NULL;
    }
    kvt_tp_dereg(C.local_mr, C.tp); /* dereg needs the transport: before its close */
    C.local_mr = NULL;
    kvt_tp_close(C.tp);
    C.tp = NULL;
    free(C.local);
    C.local = NULL;
    assert_int_equal(C.closed, 1);
    assert_int_equal(C.closed_err, 0);
    for (int i = 0; i < INFLIGHT; i++) {
        assert_int_equal(b[i].done, 1);
        if (b[i].status != 0) {
            assert_int_equal(b[i].status, -ECANCELED);
            failed++;
        }
    }
    printf("# transport close: %d of %d batches cancelled\n", failed, INFLIGHT);
    assert_true(failed > 0);
}

/* ---- the peer killed with SIGKILL during transfers ---- */

#define KILL_SLOTS 32

static struct {
    struct batch b[KILL_SLOTS];
    struct kvt_read_op ops[KILL_SLOTS][8];
    bool killed;
    uint64_t kill_ms;
    unsigned ok, failed_after, resubmit_refused;
    int first_err;
} K;

static void kill_cb(void *arg, int status);

static int kill_post(int i)
{
    make_ops(K.ops[i], 8, 256 << 10, (uint64_t)i * ((2u << 20) + 4096));
    K.b[i] = (struct batch){0};
    C.in_read = true;
    int ret = kvt_tp_read(C.ep, C.rk, C.local_mr, K.ops[i], 8, kill_cb, &K.b[i]);
    C.in_read = false;
    return ret;
}

static void kill_cb(void *arg, int status)
{
    struct batch *b = arg;
    int i = (int)(b - K.b);

    if (C.in_read)
        C.cb_in_read++;
    b->done = 1;
    b->status = status;
    b->done_ms = conf_now_ms();
    if (status == 0) {
        K.ok++;
    } else {
        if (K.first_err == 0)
            K.first_err = status;
        if (K.killed)
            K.failed_after++;
    }
    /* Keep reading after the kill too: over RDMA the dead peer's kernel may finish
     * what was in flight, and only later READs meet the torn-down QP. */
    if (status == 0 && C.ep != NULL && C.closed == 0) {
        int ret = kill_post(i);

        /* Refused at once (the endpoint already failing, its CLOSED not yet delivered):
         * no callback will come, so the slot is settled here. */
        if (ret != -EINPROGRESS) {
            K.resubmit_refused++;
            K.b[i].done = 1;
            K.b[i].status = ret;
            K.b[i].done_ms = conf_now_ms();
        }
    }
}

static bool kill_settled(void *arg)
{
    if (C.closed == 0)
        return false;
    for (int i = 0; i < KILL_SLOTS; i++)
        if (K.b[i].done == 0)
            return false;
    return true;
}

static bool kill_some_ok(void *arg)
{
    return K.ok > 0 || C.closed > 0;
}

static void test_peer_sigkill(void **state)
{
    memset(&K, 0, sizeof(K));
    for (int i = 0; i < KILL_SLOTS; i++)
        assert_int_equal(kill_post(i), -EINPROGRESS);
    /* Transfers under way at the kill: 300 ms of them, and at least one batch done
     * (across two loaded TCG guests the first 2 MiB over UCX rc_verbs once took longer
     * than 300 ms; every completed batch is posted again, so 32 stay in flight). */
    assert_int_equal(conf_pump(C.tp, NULL, NULL, 300), 0);
    assert_int_equal(conf_pump(C.tp, kill_some_ok, NULL, 10000), 0);
    assert_int_equal(C.closed, 0);
    assert_true(K.ok > 0);

    unsigned ok_before = K.ok;

    K.killed = true;
    K.kill_ms = conf_now_ms();
    if (C.peer_pid > 0)
        assert_int_equal(kill(C.peer_pid, SIGKILL), 0);
    else
        assert_int_equal(conn_send(&C, M_KILL, 0, NULL, 0), 0);

    int pending = 0;

    for (int i = 0; i < KILL_SLOTS; i++)
        pending += K.b[i].done == 0;
    /* Bounded: the op timeout (conn_config: 10 s, 60 s on RDMA) plus slack. */
    struct kvt_transport_config kc;

    conn_config(&kc);
    int ret =
        conf_pump(C.tp, kill_settled, NULL, (kc.op_timeout_ms ? kc.op_timeout_ms : 10000) + 10000);
    uint64_t last = K.kill_ms;

    for (int i = 0; i < KILL_SLOTS; i++)
        if (K.b[i].done && K.b[i].done_ms > last)
            last = K.b[i].done_ms;
    printf("# peer SIGKILL: %d batches pending at the kill, %u failed (%s), %u completed "
           "after; all settled %" PRIu64 " ms after the kill, CLOSED(%s)\n",
           pending, K.failed_after, K.first_err ? strerror(-K.first_err) : "-", K.ok - ok_before,
           last - K.kill_ms, C.closed ? strerror(-C.closed_err) : "not yet");
    assert_int_equal(ret, 0);
    assert_int_equal(C.cb_in_read, 0);
    assert_true(C.closed_err < 0);
    /* A peer gone is -ECONNRESET (or the like); -ETIMEDOUT only from the op timeout. */
    if (C.closed_err == -ETIMEDOUT &&
        last - K.kill_ms < (kc.op_timeout_ms ? kc.op_timeout_ms : 10000) - 1000)
        fail_msg("a killed peer reported as -ETIMEDOUT after %" PRIu64 " ms, before the op "
                 "timeout (10 s)",
                 last - K.kill_ms);
    assert_true(K.failed_after > 0);
    if (C.peer_pid > 0) {
        int st = peer_reap(&C, 5000);

        assert_true(WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL);
    }
}

static int teardown_killed(void **state)
{
    conn_close(&C, false);
    return 0;
}

/* A READ outside either registration fails with -EINVAL, posts nothing, returns no
 * data and leaves the endpoint usable. */
static void test_read_out_of_range(void **state)
{
    const uint64_t R = C.region_bytes, L = LOCAL_BYTES;
    const struct kvt_read_op bad[] = {
        {.remote_off = R, .local_off = 0, .len = 4096},
        {.remote_off = R - 4095, .local_off = 0, .len = 4096},
        {.remote_off = UINT64_MAX - 100, .local_off = 0, .len = 4096},
        {.remote_off = 0, .local_off = 0, .len = UINT64_MAX},
        {.remote_off = 0, .local_off = 0, .len = R + 1},
        {.remote_off = 0, .local_off = L, .len = 4096},
        {.remote_off = 0, .local_off = L - 100, .len = 4096},
        {.remote_off = 0, .local_off = UINT64_MAX - 10, .len = 4096},
    };
    struct batch b = {0};

    memset(C.local, FILL, 1u << 20);
    for (size_t i = 0; i < (size_t)KVT_ARRAY_SIZE(bad); i++) {
        int ret = read_batch(&C, &bad[i], 1, &b);

        if (ret != -EINVAL)
            fail_msg("bad op %zu: %d (%s), expected -EINVAL", i, ret, strerror(-ret));
    }
    /* A good op then a bad one: the whole batch is refused, the good one not posted. */
    struct kvt_read_op mixed[2] = {
        {.remote_off = 8192, .local_off = 0, .len = 65536},
        {.remote_off = R - 100, .local_off = 65536, .len = 4096},
    };

    assert_int_equal(read_batch(&C, mixed, 2, &b), -EINVAL);
    assert_int_equal(read_batch(&C, mixed, 0, &b), -EINVAL);
    assert_int_equal(conf_pump(C.tp, NULL, NULL, 300), 0);
    assert_int_equal(b.done, 0);
    for (size_t i = 0; i < (1u << 20); i++)
        if (C.local[i] != FILL)
            fail_msg("byte %zu was written by a refused READ", i);
    /* Still usable. */
    struct waitn w = {&b, 1};

    assert_int_equal(read_batch(&C, mixed, 1, &b), -EINPROGRESS);
    assert_int_equal(conf_pump(C.tp, all_done, &w, 10000), 0);
    assert_int_equal(b.status, 0);
    verify_ops(&C, mixed, 1, 0, 65536 + 64);
    assert_int_equal(C.closed, 0);
}

/* A connection whose READs skip the client's check of the remote range: the UCX
 * backend's test-only hook KVT_UCX_TEST_NO_CLIENT_RANGE_CHECK, read when the
 * transport opens (the peer inherits it; it never reads). */
static int conn_setup_no_client_check(void)
{
    int ret;

    setenv("KVT_UCX_TEST_NO_CLIENT_RANGE_CHECK", "1", 1);
    ret = conn_setup(NULL);
    unsetenv("KVT_UCX_TEST_NO_CLIENT_RANGE_CHECK");
    return ret;
}

static int setup_no_client_check(void **state)
{
    int ret = strcmp(opt.backend, "ucx") == 0 ? conn_setup_no_client_check() : conn_setup(NULL);

    return setup_done(ret);
}

/* The server refuses a READ outside its registrations by itself: with the client's
 * range check skipped (UCX test hook), each bad range reaches the server, which must
 * refuse it without sending a byte, with the one answer it gives to a READ it does
 * not grant (-EACCES at the reader: no layout oracle), and count it; the batch fails
 * with -EACCES exactly once, nothing is written locally, the endpoint closes with
 * -EACCES and the server lives on (exits 0, its "read_range" count 1 as told). One
 * connection (and peer) per range: the first refusal fails the endpoint. Without the
 * server's check the peer sends what lies past its region (the batch succeeds) or
 * crashes reading it (-ECONNRESET): either fails here. */
static void test_read_refused_by_server(void **state)
{
    const uint64_t R = C.region_bytes;
    const struct kvt_read_op bad[] = {
        {.remote_off = R - 100, .local_off = 0, .len = 4096},          /* across the end, small */
        {.remote_off = R, .local_off = 4096, .len = 65536},            /* past the end, large */
        {.remote_off = UINT64_MAX - 100, .local_off = 0, .len = 4096}, /* wraps below the base */
    };

    for (size_t i = 0; i < (size_t)KVT_ARRAY_SIZE(bad); i++) {
        struct batch b = {0};
        struct waitn w = {&b, 1};

        if (i > 0) {
            conn_close(&C, true);
            if (conn_setup_no_client_check() < 0)
                fail_msg("range %zu: setup failed", i);
        }
        memset(C.local, FILL, 1u << 20);
        conn_expect(&C, KVT_TP_READ_RANGE, 1);
        conn_expect(&C, KVT_TP_READ_GRANT, 0);
        int ret = read_batch(&C, &bad[i], 1, &b);

        if (ret != -EINPROGRESS)
            fail_msg("range %zu: read returned %d (%s); the client check was not skipped", i, ret,
                     strerror(-ret));
        assert_int_equal(conf_pump(C.tp, all_done, &w, 10000), 0);
        assert_int_equal(C.cb_in_read, 0);
        assert_int_equal(b.done, 1);
        if (b.status != -EACCES)
            fail_msg("range %zu (remote %" PRIu64 ", %" PRIu64 " bytes): batch status %d (%s), "
                     "expected -EACCES",
                     i, bad[i].remote_off, bad[i].len, b.status, strerror(-b.status));
        for (size_t k = 0; k < (1u << 20); k++)
            if (C.local[k] != FILL)
                fail_msg("range %zu: byte %zu was written by a refused READ", i, k);
        assert_int_equal(conf_pump(C.tp, conn_closed, &C, 5000), 0);
        assert_int_equal(C.closed_err, -EACCES);
        assert_int_equal(conf_pump(C.tp, NULL, NULL, 100), 0);
        assert_int_equal(b.done, 1); /* exactly once */
    }
    printf("# %zu out-of-range READs refused by the server\n", (size_t)KVT_ARRAY_SIZE(bad));
}

/* A connection the peer has not authorized: the client asks nothing of it, the peer
 * never authorizes, and a READ is refused before a byte moves. */
static int setup_unauthorized(void **state)
{
    struct kvt_transport_config cfg;
    int ret;

    memset(&C, 0, sizeof(C));
    rk_slot = NULL;
    conn_config(&cfg);
    C.no_authorize = true;
    ret = peer_start(&C);
    if (ret == 0)
        ret = conn_open(&cfg);
    if (ret == 0)
        ret = conn_connect(&C);
    return setup_done(ret);
}

/* READ before authorize: the peer has not authorized us (nor we it, so the request
 * goes on the connection's socket, the only way anything of ours reaches it before
 * then). The peer refuses it, counts it ("read_unauth", checked by its exit status)
 * and closes the endpoint: the batch fails, nothing is written, we see CLOSED. */
static void test_read_before_authorize(void **state)
{
    struct kvt_read_op op = {.remote_off = 4096, .local_off = 0, .len = 4096};
    struct batch b = {0};
    struct waitn w = {&b, 1};

    (void)state;
    conn_expect(&C, KVT_TP_READ_UNAUTH, 1);
    memset(C.local, FILL, 1u << 20);
    assert_int_equal(read_batch(&C, &op, 1, &b), -EINPROGRESS);
    assert_int_equal(conf_pump(C.tp, all_done, &w, 10000), 0);
    printf("# READ before authorize: %s\n", b.status != 0 ? strerror(-b.status) : "completed");
    assert_int_equal(b.done, 1);
    assert_true(b.status < 0);
    for (size_t k = 0; k < (1u << 20); k++)
        if (C.local[k] != FILL)
            fail_msg("byte %zu was written by a READ before authorize", k);
    assert_int_equal(conf_pump(C.tp, conn_closed, &C, 5000), 0);
    assert_true(C.closed_err < 0);
    assert_int_equal(C.cb_in_read, 0);
}

/* may_read: the peer grants all of its region but a 64 KiB window. A READ beside the
 * window completes; one inside it fails with -EACCES (the answer an out-of-range READ
 * gets too), writes nothing, closes the endpoint and is counted as "read_grant", not
 * "read_range" (the peer's exit status checks both). */
static void test_read_not_granted(void **state)
{
    const uint64_t W = 1u << 20;
    struct kvt_read_op ok = {.remote_off = W - 4096, .local_off = 0, .len = 4096};
    struct kvt_read_op no = {.remote_off = W + 8192, .local_off = 8192, .len = 4096};
    struct batch b1 = {0}, b2 = {0};
    struct waitn w1 = {&b1, 1}, w2 = {&b2, 1};

    (void)state;
    assert_int_equal(conn_tell(&C, M_DENY, W, 64u << 10), 0);
    conn_expect(&C, KVT_TP_READ_GRANT, 1);
    conn_expect(&C, KVT_TP_READ_RANGE, 0);
    memset(C.local, FILL, 1u << 20);
    assert_int_equal(read_batch(&C, &ok, 1, &b1), -EINPROGRESS);
    assert_int_equal(conf_pump(C.tp, all_done, &w1, 10000), 0);
    assert_int_equal(b1.status, 0);
    verify_ops(&C, &ok, 1, 0, 8192);
    assert_int_equal(read_batch(&C, &no, 1, &b2), -EINPROGRESS);
    assert_int_equal(conf_pump(C.tp, all_done, &w2, 10000), 0);
    printf("# READ inside the window may_read refuses: %s\n",
           b2.status != 0 ? strerror(-b2.status) : "completed");
    assert_int_equal(b2.status, -EACCES);
    for (size_t k = 8192; k < (1u << 20); k++)
        if (C.local[k] != FILL)
            fail_msg("byte %zu was written by a READ may_read refused", k);
    assert_int_equal(conf_pump(C.tp, conn_closed, &C, 5000), 0);
    assert_int_equal(C.closed_err, -EACCES);
}

/* Our active messages name a token the peer never gave (UCX test hook
 * KVT_UCX_TEST_BAD_TOKEN, read when our transport opens; the peer is started before
 * and does not have it). The peer must drop them unseen and count each: the message
 * sent is M_KILL, so delivering it would kill the peer (exit status), and its
 * "unknown_conn" count must be exactly 1. */
static int setup_bad_token(void **state)
{
    struct kvt_transport_config cfg;
    int ret;

    memset(&C, 0, sizeof(C));
    rk_slot = NULL;
    conn_config(&cfg);
    C.no_authorize = true; /* M_EXPECT goes first, on the socket */
    ret = peer_start(&C);
    if (ret == 0) {
        setenv("KVT_UCX_TEST_BAD_TOKEN", "1", 1);
        ret = conn_open(&cfg);
        unsetenv("KVT_UCX_TEST_BAD_TOKEN");
    }
    if (ret == 0)
        ret = conn_connect(&C);
    return setup_done(ret);
}

static void test_unknown_token(void **state)
{
    (void)state;
    conn_expect(&C, KVT_TP_UNKNOWN_CONN, 1);
    assert_int_equal(conn_authorize(&C), 0); /* its ack names our token: it arrives */
    assert_int_equal(conn_send(&C, M_KILL, 0, NULL, 0), 0);
    assert_int_equal(conf_pump(C.tp, NULL, NULL, 500), 0);
    assert_int_equal(C.closed, 0);
}

/* A peer that never answers the connect: CLOSED(-ETIMEDOUT) after connect_timeout_ms. */
static void test_connect_timeout(void **state)
{
    struct kvt_transport_config cfg;
    struct kvt_tp_ep *ep;

    memset(&C, 0, sizeof(C));
    rk_slot = NULL;
    conn_config(&cfg);
    cfg.connect_timeout_ms = 700;
    assert_int_equal(peer_start(&C), 0);
    assert_int_equal(conn_open(&cfg), 0);

    uint64_t t0 = conf_now_ms();

    /* Two hosts: the server may still be restarting its peer (refused; over
     * rdma_cm not connected; UCX over rdma_cm calls the reject unreachable): try
     * again. */
    for (int tries = 0;; tries++) {
        t0 = conf_now_ms();
        assert_int_equal(kvt_tp_connect(C.tp, opt.addr, C.mute_port, &C, &ep), 0);
        C.ep = ep;
        assert_int_equal(conf_pump(C.tp, closed_or, NULL, 15000), 0);
        if ((C.closed_err != -ECONNREFUSED && C.closed_err != -ENOTCONN &&
             C.closed_err != -EHOSTUNREACH) ||
            tries == 50)
            break;
        C.closed = 0;
        C.closed_err = 0;
        usleep(100000);
    }
    uint64_t dt = conf_now_ms() - t0;

    printf("# connect to a mute peer: %s after %" PRIu64 " ms (timeout 700 ms)\n",
           strerror(-C.closed_err), dt);
    assert_int_equal(C.connected, 0);
    assert_int_equal(C.closed_err, -ETIMEDOUT);
    assert_true(dt >= 600);
    /* The real peer was never connected: end it by connecting and closing (slow
     * guests may need more than the 700 ms this transport was opened with). */
    int rc = -ETIMEDOUT;

    for (int tries = 0; tries < 10 && rc != 0; tries++)
        rc = conn_connect(&C);
    assert_int_equal(rc, 0);
}

static int setup_op_timeout(void **state)
{
    struct kvt_transport_config cfg;

    conn_config(&cfg);
    cfg.op_timeout_ms = 500;
    return setup_done(conn_setup(&cfg));
}

/* True when READs move without the peer's CPU (the NIC, here soft-RoCE, serves them). */
static bool reads_bypass_peer_cpu(void)
{
    return strcmp(opt.backend, "verbs") == 0 || rdma_device_present();
}

/* A peer that stops answering during a READ: the batch fails with -ETIMEDOUT after
 * op_timeout_ms and so does the endpoint. Over tcp the peer stalls (no progress) for
 * 4 s. Over RDMA the NIC answers READs without the peer's CPU, so the peer takes its
 * host's link down for 4 s instead (two hosts only: on one host both ends share the
 * link, and the test is not in that instance). The READs are small (64 x 4 KiB, ~40 ms
 * even at TCG soft-RoCE's ~6 MB/s), so only the silence can make them time out. */
static void test_op_timeout(void **state)
{
    static struct kvt_read_op ops[64];
    struct batch b = {0};
    struct waitn w = {&b, 1};
    bool silence = reads_bypass_peer_cpu();

    (void)state;
    assert_int_equal(conn_send(&C, silence ? M_SILENCE : M_STALL, 4000, NULL, 0), 0);
    assert_int_equal(conf_pump(C.tp, NULL, NULL, 500), 0); /* the peer is silent now */
    make_ops(ops, 64, 4096, 0);

    uint64_t t0 = conf_now_ms();

    assert_int_equal(read_batch(&C, ops, 64, &b), -EINPROGRESS);
    assert_int_equal(conf_pump(C.tp, all_done, &w, 15000), 0);
    uint64_t dt = conf_now_ms() - t0;

    printf("# READ from a %s peer: %s after %" PRIu64 " ms (op timeout 500 ms)\n",
           silence ? "silent (link down)" : "stalled", b.status ? strerror(-b.status) : "completed",
           dt);
    assert_int_equal(b.status, -ETIMEDOUT);
    assert_int_equal(conf_pump(C.tp, conn_closed, &C, 5000), 0);
    assert_int_equal(C.closed_err, -ETIMEDOUT);
    assert_true(dt >= 400);
}

static int teardown_stalled(void **state)
{
    conn_close(&C, false);
    return 0;
}

/* A reader that gives up on a stopped server and leaves must not bring the server
 * down when it runs again. Over tcp, UCX 1.13 emulates GET with requests the
 * server's UCP answers from its progress, and aborted the server (ucs_fatal in
 * ucp_get_req_handler) when those answers could not be sent to a reader that had
 * closed: a slow reader could crash a tcp server. The peer is SIGSTOPped, the reads
 * (1 MiB and 4 KiB ops, several batches) time out, the client's endpoint closes,
 * the peer gets SIGCONT and must then see its endpoint closed and exit 0. */
static void test_slow_reader_left(void **state)
{
    static struct kvt_read_op ops[4][16];
    struct batch b[4] = {{0}};
    struct waitn w = {b, 4};
    uint64_t lo = 0;

    assert_int_equal(kill(C.peer_pid, SIGSTOP), 0);
    for (int i = 0; i < 4; i++)
        lo = make_ops(ops[i], 16, i % 2 == 0 ? 1u << 20 : 4096, lo);
    for (int i = 0; i < 4; i++)
        assert_int_equal(read_batch(&C, ops[i], 16, &b[i]), -EINPROGRESS);
    assert_int_equal(conf_pump(C.tp, all_done, &w, 15000), 0);
    if (b[0].status == 0)
        kill(C.peer_pid, SIGCONT); /* and fail below */
    for (int i = 0; i < 4; i++)
        assert_int_not_equal(b[i].status, 0);
    assert_int_equal(conf_pump(C.tp, conn_closed, &C, 5000), 0);
    assert_int_equal(C.closed_err, -ETIMEDOUT);
    conf_pump(C.tp, NULL, NULL, 200); /* the close reaches the peer's socket */
    assert_int_equal(kill(C.peer_pid, SIGCONT), 0);

    int st = peer_reap(&C, 10000);

    printf("# stopped peer resumed after its reader left: wait status %#x%s\n", st,
           WIFSIGNALED(st) ? " (killed by a signal)" : "");
    assert_true(WIFEXITED(st));
    assert_int_equal(WEXITSTATUS(st), 0);
}

static int teardown_slow_reader(void **state)
{
    if (C.peer_pid > 0)
        kill(C.peer_pid, SIGCONT);
    conn_close(&C, false);
    return 0;
}

/* ---- main ---- */

/* Whether this UCX instance moves its data over the transport's own socket (socket
 * mode: forced by KVT_UCX_MODE=socket, or chosen between two hosts without RDMA; the
 * instance then expects the path "socket"). */
static bool socket_mode(void)
{
    const char *mode = getenv("KVT_UCX_MODE"), *path = getenv("KVT_CONF_EXPECT_PATH");

    return (mode != NULL && strcmp(mode, "socket") == 0) ||
           (path != NULL && strcmp(path, "socket") == 0);
}

/* Why a test cannot apply to this instance (backend, one or two hosts), or NULL. */
static const char *not_applicable(const char *test)
{
    bool ucx = strcmp(opt.backend, "ucx") == 0;

    if (strcmp(test, "test_read_refused_by_server") == 0 && !ucx)
        return "needs UCX's test hook that turns off the client's range check; "
               "test_read_out_of_range covers this backend";
    if (strcmp(test, "test_op_timeout") == 0 && !opt.two_host && reads_bypass_peer_cpu())
        return "over RDMA on one host the peer's CPU does not serve READs and its link "
               "is also ours: the two-host instance takes the peer's link down";
    if ((strcmp(test, "test_read_before_authorize") == 0 ||
         strcmp(test, "test_read_not_granted") == 0) &&
        strcmp(opt.backend, "verbs") == 0)
        return "the NIC serves this backend's READs: neither authorize nor may_read gates "
               "them yet (transport/verbs)";
    if (strcmp(test, "test_unknown_token") == 0 && !ucx)
        return "needs UCX's test hook that sends active messages with a wrong token";
    if (strcmp(test, "test_unknown_token") == 0 && socket_mode())
        return "socket mode sends no active message, so no token; the frames an "
               "authorized peer may not send are tests/unit/test_tp_socket's";
    if (strcmp(test, "test_slow_reader_left") == 0 && (!ucx || opt.two_host))
        return "a regression test of UCX's software GET, with the peer's pid on this host";
    if (strcmp(test, "test_slow_reader_left") == 0 && reads_bypass_peer_cpu())
        return "a regression test of UCX's software GET: here READs bypass the peer's CPU";
    return NULL;
}

static int usage(void)
{
    fprintf(stderr, "usage: kvt-conformance <backend> [--role server|client --addr A --port P]\n"
                    "       (single host when no --role: each test forks its own peer)\n");
    return 2;
}

static bool rdma_device_present(void)
{
    DIR *d = opendir("/sys/class/infiniband");
    struct dirent *e;
    bool found = false;

    if (d == NULL)
        return false;
    while ((e = readdir(d)) != NULL)
        if (e->d_name[0] != '.')
            found = true;
    closedir(d);
    return found;
}

/* Two-host server: a peer per connection on the fixed ports until one gets M_QUIT. */
static int serve_forever(void)
{
    for (;;) {
        pid_t pid = fork();
        int st;

        if (pid < 0)
            return 1;
        if (pid == 0) {
            char port_s[16], mute_s[16];

            snprintf(port_s, sizeof(port_s), "%u", opt.port);
            snprintf(mute_s, sizeof(mute_s), "%u", opt.mute_port);
            execl(opt.self, opt.self, opt.backend, "--role", "peer", "--addr", opt.addr, "--port",
                  port_s, "--mute-port", mute_s, (char *)NULL);
            _exit(127);
        }
        if (waitpid(pid, &st, 0) < 0)
            return 1;
        if (WIFEXITED(st) && WEXITSTATUS(st) == CONF_EXIT_QUIT)
            return 0;
        if (WIFEXITED(st) && WEXITSTATUS(st) == 127)
            return 1;
        fprintf(stderr, "server: peer ended (status %#x), restarting\n", st);
    }
}

int main(int argc, char **argv)
{
    const char *role = NULL;
    int ready_fd = -1;
    static char self[4096];

    if (argc < 2 || argv[1][0] == '-')
        return usage();
    opt.backend = argv[1];
    for (int i = 2; i < argc; i++) {
        if (i + 1 >= argc)
            return usage();
        if (strcmp(argv[i], "--role") == 0)
            role = argv[++i];
        else if (strcmp(argv[i], "--addr") == 0)
            opt.addr = argv[++i];
        else if (strcmp(argv[i], "--port") == 0)
            opt.port = (uint16_t)atoi(argv[++i]);
        else if (strcmp(argv[i], "--mute-port") == 0)
            opt.mute_port = (uint16_t)atoi(argv[++i]);
        else if (strcmp(argv[i], "--ready-fd") == 0)
            ready_fd = atoi(argv[++i]);
        else
            return usage();
    }
    ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);

    if (n <= 0)
        return 1;
    self[n] = '\0';
    opt.self = self;

    if (kvt_transport_find(opt.backend) == NULL) {
        printf("SKIP: the '%s' transport backend is not built in this build\n", opt.backend);
        return 77;
    }
    if (strcmp(opt.backend, "verbs") == 0 && !rdma_device_present()) {
        printf("SKIP: no RDMA device (/sys/class/infiniband is empty): the verbs suite "
               "runs in the soft-RoCE guests (label rdma)\n");
        return 77;
    }
    if (role != NULL && strcmp(role, "peer") == 0)
        return conf_peer_main(opt.backend, opt.addr, opt.port, opt.mute_port, ready_fd);
    if (role != NULL && strcmp(role, "server") != 0 && strcmp(role, "client") != 0)
        return usage();
    if (role != NULL) {
        if (opt.port == 0)
            return usage();
        if (opt.mute_port == 0)
            opt.mute_port = (uint16_t)(opt.port + 1);
        if (strcmp(role, "server") == 0)
            return serve_forever();
        opt.two_host = true;
    }
    signal(SIGPIPE, SIG_IGN);
    opt.expect = aligned_alloc(4096, CONF_REGION_BYTES);
    if (opt.expect == NULL)
        return 1;
    conf_pattern(opt.expect, CONF_REGION_BYTES);

    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_connect_accept, setup_default, teardown_default),
        cmocka_unit_test_setup_teardown(test_messages_both_ways, setup_default, teardown_default),
        cmocka_unit_test_setup_teardown(test_read_batches, setup_default, teardown_default),
        cmocka_unit_test_setup_teardown(test_inflight_64, setup_inflight, teardown_default),
        cmocka_unit_test_setup_teardown(test_close_endpoint_inflight, setup_default,
                                        teardown_default),
        cmocka_unit_test_setup_teardown(test_close_transport_inflight, setup_default,
                                        teardown_default),
        cmocka_unit_test_setup_teardown(test_read_out_of_range, setup_default, teardown_default),
        cmocka_unit_test_setup_teardown(test_read_refused_by_server, setup_no_client_check,
                                        teardown_default),
        cmocka_unit_test_setup_teardown(test_read_before_authorize, setup_unauthorized,
                                        teardown_default),
        cmocka_unit_test_setup_teardown(test_read_not_granted, setup_default, teardown_default),
        cmocka_unit_test_setup_teardown(test_unknown_token, setup_bad_token, teardown_default),
        cmocka_unit_test_setup_teardown(test_peer_sigkill, setup_default, teardown_killed),
        cmocka_unit_test_teardown(test_connect_timeout, teardown_default),
        cmocka_unit_test_setup_teardown(test_op_timeout, setup_op_timeout, teardown_stalled),
        cmocka_unit_test_setup_teardown(test_slow_reader_left, setup_op_timeout,
                                        teardown_slow_reader),
    };
    struct CMUnitTest run[KVT_ARRAY_SIZE(tests)];
    size_t n_run = 0;
    char name[64];
    const char *filter = getenv("KVT_CONF_FILTER"); /* one test, by name pattern */

    /* Tests that cannot apply to this instance are not in it, and it says so (never
     * a skip counted as a pass). */
    for (size_t i = 0; i < KVT_ARRAY_SIZE(tests); i++) {
        const char *why = not_applicable(tests[i].name);

        if (why != NULL)
            printf("# not in this instance: %s (%s)\n", tests[i].name, why);
        else
            run[n_run++] = tests[i];
    }
    if (filter != NULL)
        cmocka_set_test_filter(filter);

    snprintf(name, sizeof(name), "conformance_%s", opt.backend);
    int failed = _cmocka_run_group_tests(name, run, n_run, NULL, NULL);

    if (opt.two_host && conn_setup(NULL) == 0) { /* end the server */
        conn_send(&C, M_QUIT, 0, NULL, 0);
        conf_pump(C.tp, conn_closed, &C, 2000);
        conn_close(&C, false);
    }
    free(opt.expect);
    return failed;
}

/* Socket mode of the UCX transport (transport/ucx/ucx_sock_read.c) against a peer that
 * is a plain TCP socket in this test, speaking the frames of kvt/tp_frame.h itself:
 * the transport (listening on 127.0.0.1) authorizes the connection, the peer's ADDR
 * asks for socket mode, and the transport (whose worker address sorts first against
 * the peer's 0xff bytes) decides and says MODE=SOCKET. Then:
 *   - messages both ways, READs both ways with every byte checked (the transport's
 *     replies come from its registration; the peer's replies land in place);
 *   - what an authorized peer may not send, each on a connection of its own: a READ
 *     reply for no READ, of another length than asked, an error reply with bytes, a
 *     message over max_msg_bytes, READ requests beyond the window, a request of 0
 *     bytes, a DATA frame or a MODE frame from the side that does not decide: the
 *     endpoint closes with -EPROTO, each counted ("proto"), and a READ it had in
 *     flight fails without a byte written;
 *   - a MODE frame before authorize: refused as pre-auth bytes (counted);
 *   - deregistering memory that queued replies read: the reply already started is
 *     finished from a copy, the one not started becomes a refusal. */
#include <endian.h>
#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>
#include <netinet/in.h>
#include <arpa/inet.h>

#include "test_util.h"

#include "kvt/clock.h"
#include "kvt/tp_frame.h"
#include "kvt/transport.h"

#define REGION    (64u << 20) /* the transport's remote registration */
#define LOCAL     (1u << 20)  /* its local one (the peer's READ replies land here) */
#define MAX_MSG   (16u << 10)
#define PEER_BASE 0x7f0000100000ull /* the peer's "region", as its handle says */
#define PEER_LEN  (1u << 20)
#define FILL      0xa5

static struct {
    struct kvt_transport *tp;
    struct kvt_tp_mr *remote, *local;
    uint8_t *rbuf, *lbuf;
    struct kvt_tp_ep *ep;
    bool authorize; /* on_accept authorizes */
    int closed, closed_err;
    uint8_t msg[MAX_MSG];
    size_t msg_len;
    int msgs;
    int batch_done, batch_status;
    uint16_t port;
} S;

static uint8_t pat(uint64_t off)
{
    return (uint8_t)(off * 7 + (off >> 12));
}

static uint8_t peer_pat(uint64_t off)
{
    return (uint8_t)(off * 13 + 5);
}

static int s_accept(void *arg, struct kvt_tp_ep *ep)
{
    (void)arg;
    S.ep = ep;
    return S.authorize ? kvt_tp_ep_authorize(ep) : 0;
}

static void s_state(void *arg, struct kvt_tp_ep *ep, enum kvt_ep_state st, int err)
{
    (void)arg;
    if (st != KVT_EP_CLOSED || ep != S.ep)
        return;
    S.closed++;
    S.closed_err = err;
    S.ep = NULL;
}

static void s_msg(void *arg, struct kvt_tp_ep *ep, const void *buf, size_t len)
{
    (void)arg;
    (void)ep;
    S.msgs++;
    S.msg_len = len < sizeof(S.msg) ? len : sizeof(S.msg);
    memcpy(S.msg, buf, S.msg_len);
}

static bool s_may_read(void *arg, struct kvt_tp_ep *ep, struct kvt_tp_mr *mr, uint64_t off,
                       uint64_t len)
{
    return true;
}

static void s_batch(void *arg, int status)
{
    S.batch_done++;
    S.batch_status = status;
}

static void open_tp(void)
{
    struct kvt_transport_config cfg = {
        .backend = "ucx",
        .max_msg_bytes = MAX_MSG,
        .local_addr = "127.0.0.1",
        .cb = {.on_accept = s_accept,
               .on_ep_state = s_state,
               .on_msg = s_msg,
               .may_read = s_may_read},
    };

    S.rbuf = aligned_alloc(4096, REGION);
    S.lbuf = aligned_alloc(4096, LOCAL);
    assert_non_null(S.rbuf);
    assert_non_null(S.lbuf);
    for (uint64_t i = 0; i < REGION; i++)
        S.rbuf[i] = pat(i);
    memset(S.lbuf, FILL, LOCAL);
    assert_int_equal(kvt_tp_open(&cfg, &S.tp), 0);
    assert_int_equal(kvt_tp_listen(S.tp, "127.0.0.1", 0, &S.port), 0);
    assert_int_equal(kvt_tp_reg_remote(S.tp, S.rbuf, REGION, &S.remote), 0);
    assert_int_equal(kvt_tp_reg_local(S.tp, S.lbuf, LOCAL, &S.local), 0);
}

static int setup(void **state)
{
    (void)state;
    memset(&S, 0, sizeof(S));
    S.authorize = true;
    open_tp();
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    if (S.remote != NULL)
        kvt_tp_dereg(S.remote, S.tp);
    kvt_tp_dereg(S.local, S.tp);
    kvt_tp_close(S.tp);
    free(S.rbuf);
    free(S.lbuf);
    return 0;
}

static uint64_t refused(enum kvt_tp_refusal r)
{
    struct kvt_tp_counters c;

    assert_int_equal(kvt_tp_get_counters(S.tp, &c), 0);
    return c.refused[r];
}

static void pump(unsigned ms)
{
    uint64_t until = kvt_now_ns() + (uint64_t)ms * 1000000ull;

    while (kvt_now_ns() < until) {
        assert_true(kvt_tp_progress(S.tp) >= 0);
        usleep(200);
    }
}

/* Until the transport reported the endpoint closed (or ms pass). */
static void pump_closed(unsigned ms)
{
    uint64_t until = kvt_now_ns() + (uint64_t)ms * 1000000ull;

    while (S.closed == 0 && kvt_now_ns() < until) {
        assert_true(kvt_tp_progress(S.tp) >= 0);
        usleep(200);
    }
}

/* Reads exactly n bytes of fd, progressing the transport meanwhile; false when the
 * stream ended or ms passed first. */
static bool rd_exact(int fd, void *buf, size_t n, unsigned ms)
{
    uint64_t until = kvt_now_ns() + (uint64_t)ms * 1000000ull;
    size_t got = 0;

    while (got < n && kvt_now_ns() < until) {
        struct pollfd p = {.fd = fd, .events = POLLIN};
        ssize_t k;

        assert_true(kvt_tp_progress(S.tp) >= 0);
        if (poll(&p, 1, 1) <= 0)
            continue;
        k = recv(fd, (uint8_t *)buf + got, n - got, MSG_DONTWAIT);
        if (k == 0)
            return false;
        if (k > 0)
            got += (size_t)k;
    }
    return got == n;
}

/* The next frame's type and payload length (payload into p, at most cap bytes read;
 * the rest is left for the caller). */
static uint8_t rd_frame(int fd, uint8_t *p, size_t cap, uint32_t *len_p)
{
    uint8_t h[KVT_TP_FRAME_HDR];
    uint32_t len;

    assert_true(rd_exact(fd, h, sizeof(h), 5000));
    memcpy(&len, h + 4, 4);
    len = le32toh(len);
    *len_p = len;
    assert_true(rd_exact(fd, p, len < cap ? len : cap, 5000));
    return h[2];
}

static void wr_frame(int fd, uint8_t type, const void *p, size_t len)
{
    uint8_t h[KVT_TP_FRAME_HDR];

    kvt_tp_frame_hdr(h, type, (uint32_t)len);
    assert_int_equal(send(fd, h, sizeof(h), MSG_NOSIGNAL), (ssize_t)sizeof(h));
    if (len > 0)
        assert_int_equal(send(fd, p, len, MSG_NOSIGNAL), (ssize_t)len);
}

static void wr_rdreq(int fd, uint64_t off, uint64_t len, uint64_t tag)
{
    uint64_t p[3] = {htole64((uint64_t)(uintptr_t)S.rbuf + off), htole64(len), htole64(tag)};

    wr_frame(fd, KVT_TP_FRAME_RDREQ, p, sizeof(p));
}

/* An RDREP header and fixed part (the bytes follow separately). */
static void wr_rdrep(int fd, uint64_t tag, uint64_t len, uint32_t err)
{
    uint8_t p[KVT_TP_FRAME_RDREP_BYTES] = {0};

    tag = htole64(tag);
    len = htole64(len);
    err = htole32(err);
    memcpy(p, &tag, 8);
    memcpy(p + 8, &len, 8);
    memcpy(p + 16, &err, 4);
    wr_frame(fd, KVT_TP_FRAME_RDREP, p, sizeof(p));
}

/* Connects a plain socket and brings it to socket mode: the transport's HELLO and
 * ADDR, ours (flags: socket mode; a worker address of 0xff bytes, so the transport
 * decides), its MODE=SOCKET. The transport's endpoint is S.ep. */
static int peer_socket_mode(void)
{
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons(S.port)};
    static uint8_t buf[KVT_TP_FRAME_ADDR_MAX];
    uint8_t addr[KVT_TP_FRAME_TOKEN_BYTES + KVT_TP_FRAME_CAPS_BYTES + 64];
    uint32_t len, flags = htole32(KVT_TP_ADDR_SOCKET), mode;
    int fd = socket(AF_INET, SOCK_STREAM, 0), rcvbuf = 64 << 10;

    S.closed = 0;
    S.ep = NULL;
    assert_true(fd >= 0);
    /* A small receive buffer: replies we do not read stay on the transport's output. */
    assert_int_equal(setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &rcvbuf, sizeof(rcvbuf)), 0);
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    assert_int_equal(connect(fd, (struct sockaddr *)&sa, sizeof(sa)), 0);
    assert_int_equal(rd_frame(fd, buf, sizeof(buf), &len), KVT_TP_FRAME_HELLO);
    assert_int_equal(rd_frame(fd, buf, sizeof(buf), &len), KVT_TP_FRAME_ADDR);
    assert_non_null(S.ep);
    memset(addr, 0xff, sizeof(addr));
    memset(addr, 0x33, KVT_TP_FRAME_TOKEN_BYTES);
    memset(addr + KVT_TP_FRAME_TOKEN_BYTES, 0, KVT_TP_FRAME_CAPS_BYTES);
    memcpy(addr + KVT_TP_FRAME_TOKEN_BYTES, &flags, 4);
    wr_frame(fd, KVT_TP_FRAME_ADDR, addr, sizeof(addr));
    assert_int_equal(rd_frame(fd, buf, sizeof(buf), &len), KVT_TP_FRAME_MODE);
    assert_int_equal(len, KVT_TP_FRAME_MODE_BYTES);
    memcpy(&mode, buf, 4);
    assert_int_equal(le32toh(mode), KVT_TP_MODE_SOCKET);
    return fd;
}

/* The handle of the peer's "region", unpacked on S.ep. */
static struct kvt_tp_rkey *peer_rkey(void)
{
    struct kvt_tp_rkey *rk;
    uint32_t h32[2] = {htole32(0x6b767475u), 0};
    uint64_t h64[2] = {htole64(PEER_BASE), htole64(PEER_LEN)};
    uint8_t h[24];

    memcpy(h, h32, 8);
    memcpy(h + 8, h64, 16);
    assert_int_equal(kvt_tp_unpack(S.ep, h, sizeof(h), &rk), 0);
    return rk;
}

/* Reads an RDREQ the transport sent; its {addr, len, tag}. */
static void rd_rdreq(int fd, uint64_t *addr, uint64_t *len, uint64_t *tag)
{
    uint64_t p[3];
    uint32_t flen;

    assert_int_equal(rd_frame(fd, (uint8_t *)p, sizeof(p), &flen), KVT_TP_FRAME_RDREQ);
    assert_int_equal(flen, sizeof(p));
    *addr = le64toh(p[0]);
    *len = le64toh(p[1]);
    *tag = le64toh(p[2]);
}

/* Expects an RDREP for tag of len bytes (err 0) and checks its bytes against the
 * transport's region at off. */
static void expect_reply(int fd, uint64_t tag, uint64_t off, uint64_t len)
{
    uint8_t fixed[KVT_TP_FRAME_RDREP_BYTES];
    uint64_t t, l;
    uint32_t err, flen;
    uint8_t *b = malloc(len);

    assert_non_null(b);
    assert_int_equal(rd_frame(fd, fixed, sizeof(fixed), &flen), KVT_TP_FRAME_RDREP);
    memcpy(&t, fixed, 8);
    memcpy(&l, fixed + 8, 8);
    memcpy(&err, fixed + 16, 4);
    assert_int_equal(le64toh(t), tag);
    assert_int_equal(le32toh(err), 0);
    assert_int_equal(le64toh(l), len);
    assert_true(rd_exact(fd, b, len, 10000));
    assert_memory_equal(b, S.rbuf + off, len);
    free(b);
}

/* Messages both ways; READs both ways, every byte checked. */
static void test_socket_good(void **state)
{
    static uint8_t buf[MAX_MSG];
    const char hi[] = "hello over the socket";
    char info[64];
    uint32_t len;
    int fd = peer_socket_mode();

    (void)state;
    assert_int_equal(kvt_tp_ep_info(S.ep, info, sizeof(info)), 0);
    assert_string_equal(info, "socket");
    /* Messages: ours in order, whole; the transport's as MSG frames. */
    wr_frame(fd, KVT_TP_FRAME_MSG, hi, sizeof(hi));
    memset(buf, 0x5c, sizeof(buf));
    wr_frame(fd, KVT_TP_FRAME_MSG, buf, MAX_MSG);
    pump(100);
    assert_int_equal(S.msgs, 2);
    assert_int_equal(S.msg_len, MAX_MSG);
    assert_int_equal(S.msg[MAX_MSG - 1], 0x5c);
    assert_int_equal(kvt_tp_send(S.ep, hi, sizeof(hi)), 0);
    assert_int_equal(rd_frame(fd, buf, sizeof(buf), &len), KVT_TP_FRAME_MSG);
    assert_int_equal(len, sizeof(hi));
    assert_memory_equal(buf, hi, sizeof(hi));

    /* Our READs of the transport: small, large (above the in-flight bound), odd. */
    wr_rdreq(fd, 4096, 4096, 1);
    wr_rdreq(fd, 3u << 20, 5u << 20, 2);
    wr_rdreq(fd, 12345, 100, 3);
    expect_reply(fd, 1, 4096, 4096);
    expect_reply(fd, 2, 3u << 20, 5u << 20);
    expect_reply(fd, 3, 12345, 100);

    /* The transport's READs of us: two ops, replied to out of order, in pieces. */
    struct kvt_tp_rkey *rk = peer_rkey();
    struct kvt_read_op ops[2] = {{.remote_off = 0, .local_off = 100, .len = 70000},
                                 {.remote_off = 8192, .local_off = 200000, .len = 4096}};
    uint64_t addr[2], l[2], tag[2];
    static uint8_t data[70000];

    assert_int_equal(kvt_tp_read(S.ep, rk, S.local, ops, 2, s_batch, NULL), -EINPROGRESS);
    rd_rdreq(fd, &addr[0], &l[0], &tag[0]);
    rd_rdreq(fd, &addr[1], &l[1], &tag[1]);
    assert_int_equal(addr[0], PEER_BASE);
    assert_int_equal(l[0], 70000);
    assert_int_equal(addr[1], PEER_BASE + 8192);
    for (int k = 1; k >= 0; k--) {
        uint64_t off = addr[k] - PEER_BASE;

        for (uint64_t i = 0; i < l[k]; i++)
            data[i] = peer_pat(off + i);
        wr_rdrep(fd, tag[k], l[k], 0);
        for (uint64_t at = 0; at < l[k]; at += 1000) { /* in pieces, progress between */
            size_t n = l[k] - at < 1000 ? l[k] - at : 1000;

            assert_int_equal(send(fd, data + at, n, MSG_NOSIGNAL), (ssize_t)n);
            if (at % 16000 == 0)
                pump(1);
        }
    }
    pump(100);
    assert_int_equal(S.batch_done, 1);
    assert_int_equal(S.batch_status, 0);
    for (int k = 0; k < 2; k++)
        for (uint64_t i = 0; i < ops[k].len; i++)
            if (S.lbuf[ops[k].local_off + i] != peer_pat(ops[k].remote_off + i))
                fail_msg("op %d byte %llu", k, (unsigned long long)i);
    assert_int_equal(S.lbuf[99], FILL);
    assert_int_equal(S.lbuf[100 + 70000], FILL);
    assert_int_equal(S.lbuf[199999], FILL);
    assert_int_equal(S.lbuf[204096], FILL);
    kvt_tp_rkey_destroy(S.tp, rk);
    assert_int_equal(refused(KVT_TP_PROTO), 0);
    assert_int_equal(S.closed, 0);
    close(fd);
    pump_closed(2000);
    assert_int_equal(S.closed_err, -ECONNRESET);
}

/* The transport READs 4 KiB from the peer, who answers with a bad reply: the
 * endpoint closes (-EPROTO, counted), the batch fails, no byte lands. */
static void bad_reply(int how)
{
    struct kvt_read_op op = {.remote_off = 4096, .local_off = 8192, .len = 4096};
    uint64_t addr, len, tag, before = refused(KVT_TP_PROTO);
    uint8_t junk[8192];
    int fd = peer_socket_mode();
    struct kvt_tp_rkey *rk = peer_rkey();

    memset(junk, 0x11, sizeof(junk));
    S.batch_done = 0;
    assert_int_equal(kvt_tp_read(S.ep, rk, S.local, &op, 1, s_batch, NULL), -EINPROGRESS);
    rd_rdreq(fd, &addr, &len, &tag);
    switch (how) {
    case 0: /* a tag of no READ */
        wr_rdrep(fd, tag + 1, len, 0);
        break;
    case 1: /* fewer bytes than asked */
        wr_rdrep(fd, tag, len - 1, 0);
        break;
    case 2: /* more */
        wr_rdrep(fd, tag, len + 4096, 0);
        break;
    case 3: /* an error reply that carries bytes */
        wr_rdrep(fd, tag, len, 13);
        break;
    case 4: /* an error we do not send */
        wr_rdrep(fd, tag, 0, 5);
        break;
    }
    (void)send(fd, junk, sizeof(junk), MSG_NOSIGNAL);
    pump_closed(3000);
    pump(20);
    assert_int_equal(S.closed, 1);
    assert_int_equal(S.closed_err, -EPROTO);
    assert_int_equal(S.batch_done, 1);
    assert_true(S.batch_status < 0);
    assert_int_equal(refused(KVT_TP_PROTO), before + 1);
    for (size_t i = 0; i < LOCAL; i++)
        if (S.lbuf[i] != FILL)
            fail_msg("case %d: local byte %zu written by a bad reply", how, i);
    kvt_tp_rkey_destroy(S.tp, rk);
    close(fd);
}

static void test_socket_bad_replies(void **state)
{
    (void)state;
    for (int how = 0; how < 5; how++)
        bad_reply(how);
}

/* A frame an authorized peer may not send closes the endpoint, counted. */
static void bad_frame(int how)
{
    static uint8_t big[MAX_MSG + 1];
    uint64_t before = refused(KVT_TP_PROTO);
    uint32_t m = htole32(KVT_TP_MODE_SOCKET);
    int fd = peer_socket_mode();

    switch (how) {
    case 0: /* a message over max_msg_bytes (judged by its header) */
        wr_frame(fd, KVT_TP_FRAME_MSG, big, sizeof(big));
        break;
    case 1: /* beyond the window's bytes: 7 MiB outstanding (we do not read), 2 more */
        wr_rdreq(fd, 0, 7u << 20, 1);
        pump(100);
        wr_rdreq(fd, 0, 2u << 20, 2);
        break;
    case 2: /* a request of 0 bytes */
        wr_rdreq(fd, 0, 0, 1);
        break;
    case 3: /* a pre-auth frame after the switch */
        wr_frame(fd, KVT_TP_FRAME_DATA, big, 16);
        break;
    case 4: /* MODE from the side that does not decide */
        wr_frame(fd, KVT_TP_FRAME_MODE, &m, sizeof(m));
        break;
    case 5: /* 1025 requests outstanding (the first holds the output): the count */
        wr_rdreq(fd, 0, 7u << 20, 0);
        pump(100);
        for (int i = 1; i < 1025; i++)
            wr_rdreq(fd, 4096, 1, (uint64_t)i);
        break;
    case 6: /* the same within the window: 1024 outstanding is allowed (not closed) */
        wr_rdreq(fd, 0, 7u << 20, 0);
        pump(100);
        for (int i = 1; i < 1024; i++)
            wr_rdreq(fd, 4096, 1, (uint64_t)i);
        pump(500);
        assert_int_equal(S.closed, 0);
        assert_int_equal(refused(KVT_TP_PROTO), before);
        close(fd);
        pump_closed(2000);
        return;
    }
    pump_closed(5000);
    assert_int_equal(S.closed, 1);
    assert_int_equal(S.closed_err, -EPROTO);
    assert_int_equal(refused(KVT_TP_PROTO), before + 1);
    close(fd);
    pump(20);
}

static void test_socket_bounds(void **state)
{
    (void)state;
    for (int how = 0; how < 7; how++)
        bad_frame(how);
}

/* MODE before the transport authorized: not its turn, pre-auth bytes out of place. */
static void test_socket_mode_before_authorize(void **state)
{
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons(S.port)};
    uint8_t buf[64], addr[KVT_TP_FRAME_TOKEN_BYTES + KVT_TP_FRAME_CAPS_BYTES + 8] = {0};
    uint32_t len, m = htole32(KVT_TP_MODE_SOCKET);
    int fd = socket(AF_INET, SOCK_STREAM, 0);

    (void)state;
    S.authorize = false;
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    assert_int_equal(connect(fd, (struct sockaddr *)&sa, sizeof(sa)), 0);
    assert_int_equal(rd_frame(fd, buf, sizeof(buf), &len), KVT_TP_FRAME_HELLO);
    wr_frame(fd, KVT_TP_FRAME_ADDR, addr, sizeof(addr)); /* we "authorized" */
    wr_frame(fd, KVT_TP_FRAME_MODE, &m, sizeof(m));
    pump_closed(3000);
    assert_int_equal(S.closed, 1);
    assert_int_equal(S.closed_err, -EPROTO);
    assert_int_equal(refused(KVT_TP_PREAUTH_MALFORMED), 1);
    assert_int_equal(refused(KVT_TP_PROTO), 0);
    close(fd);
}

/* Replies queued when their memory is deregistered: the one started is finished from
 * a copy (the peer gets the right bytes), the one not started is a refusal. */
static void test_socket_dereg(void **state)
{
    uint8_t fixed[KVT_TP_FRAME_RDREP_BYTES];
    uint32_t flen, err;
    uint64_t t, l;
    int fd = peer_socket_mode();

    (void)state;
    wr_rdreq(fd, 0, 7u << 20, 1);    /* on the output, partly written (we do not read) */
    wr_rdreq(fd, 8192, 1u << 20, 2); /* behind the in-flight bound: queued */
    pump(200);
    kvt_tp_dereg(S.remote, S.tp);
    S.remote = NULL;
    memset(S.rbuf, 0, 7u << 20); /* gone: no reply may read it any more */
    /* The first reply: finished from the copy taken at dereg. */
    uint8_t *b = malloc(7u << 20);

    assert_non_null(b);
    assert_int_equal(rd_frame(fd, fixed, sizeof(fixed), &flen), KVT_TP_FRAME_RDREP);
    memcpy(&l, fixed + 8, 8);
    assert_int_equal(le64toh(l), 7u << 20);
    assert_true(rd_exact(fd, b, 7u << 20, 10000));
    for (uint64_t i = 0; i < (7u << 20); i++)
        if (b[i] != pat(i))
            fail_msg("reply byte %llu", (unsigned long long)i);
    free(b);
    assert_int_equal(rd_frame(fd, fixed, sizeof(fixed), &flen), KVT_TP_FRAME_RDREP);
    memcpy(&t, fixed, 8);
    memcpy(&l, fixed + 8, 8);
    memcpy(&err, fixed + 16, 4);
    assert_int_equal(le64toh(t), 2);
    assert_int_equal(le64toh(l), 0);
    assert_int_equal(le32toh(err), EACCES);
    close(fd);
    pump_closed(2000);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_socket_good, setup, teardown),
        cmocka_unit_test_setup_teardown(test_socket_bad_replies, setup, teardown),
        cmocka_unit_test_setup_teardown(test_socket_bounds, setup, teardown),
        cmocka_unit_test_setup_teardown(test_socket_mode_before_authorize, setup, teardown),
        cmocka_unit_test_setup_teardown(test_socket_dereg, setup, teardown),
    };

    unsetenv("KVT_UCX_MODE");
    unsetenv("UCX_TLS");
    return cmocka_run_group_tests(tests, NULL, NULL);
}

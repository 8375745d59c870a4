/* The UCX transport's bounds before authorize (transport/ucx/ucx_sock.c), against a
 * transport in this process listening on 127.0.0.1 and plain TCP sockets as peers:
 * connections beyond max_preauth are closed at once and counted; an endpoint not
 * authorized within preauth_timeout_ms is closed (CLOSED -ETIMEDOUT to its owner)
 * and counted; bytes that are not our protocol close the connection and are counted;
 * an authorized endpoint is out of the pre-auth bound. */
#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>
#include <netinet/in.h>
#include <arpa/inet.h>

#include "test_util.h"

#include "kvt/clock.h"
#include "kvt/tp_frame.h"
#include "kvt/transport.h"

#define PREAUTH_MS 300

static struct {
    struct kvt_transport *tp;
    int accepted, closed, closed_timeout;
    struct kvt_tp_ep *eps[8];
} S;

static int s_accept(void *arg, struct kvt_tp_ep *ep)
{
    (void)arg;
    if (S.accepted < 8)
        S.eps[S.accepted] = ep;
    S.accepted++;
    return 0;
}

static void s_state(void *arg, struct kvt_tp_ep *ep, enum kvt_ep_state st, int err)
{
    (void)arg;
    if (st != KVT_EP_CLOSED)
        return;
    S.closed++;
    S.closed_timeout += err == -ETIMEDOUT;
    for (int i = 0; i < 8; i++)
        if (S.eps[i] == ep)
            S.eps[i] = NULL;
}

static int raw_connect(uint16_t port)
{
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons(port)};
    int fd = socket(AF_INET, SOCK_STREAM, 0);

    assert_true(fd >= 0);
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    assert_int_equal(connect(fd, (struct sockaddr *)&sa, sizeof(sa)), 0);
    return fd;
}

/* Progresses the transport until fd has something (bytes or its end) or ms pass;
 * bytes read (0: the end), -1: nothing came. */
static ssize_t pump_read(int fd, uint8_t *buf, size_t cap, unsigned ms)
{
    uint64_t until = kvt_now_ns() + (uint64_t)ms * 1000000ull;

    while (kvt_now_ns() < until) {
        struct pollfd p = {.fd = fd, .events = POLLIN};

        assert_true(kvt_tp_progress(S.tp) >= 0);
        if (poll(&p, 1, 1) > 0)
            return recv(fd, buf, cap, 0);
    }
    return -1;
}

static void pump(unsigned ms)
{
    uint64_t until = kvt_now_ns() + (uint64_t)ms * 1000000ull;

    while (kvt_now_ns() < until) {
        assert_true(kvt_tp_progress(S.tp) >= 0);
        usleep(500);
    }
}

static uint64_t refused(enum kvt_tp_refusal r)
{
    struct kvt_tp_counters c;

    assert_int_equal(kvt_tp_get_counters(S.tp, &c), 0);
    return c.refused[r];
}

static void test_preauth_bounds(void **state)
{
    struct kvt_transport_config cfg = {
        .backend = "ucx",
        .preauth_timeout_ms = PREAUTH_MS,
        .max_preauth = 2,
        .local_addr = "127.0.0.1",
        .cb = {.on_accept = s_accept, .on_ep_state = s_state},
    };
    uint8_t buf[64], zeros[64] = {0};
    static uint8_t big[KVT_TP_FRAME_HDR + KVT_TP_FRAME_ADDR_MAX];
    uint16_t port;
    int a, b, c, d;
    uint64_t t0;

    (void)state;
    memset(&S, 0, sizeof(S));
    assert_int_equal(kvt_tp_open(&cfg, &S.tp), 0);
    assert_int_equal(kvt_tp_listen(S.tp, "127.0.0.1", 0, &port), 0);

    /* Two pre-auth connections get our HELLO; the third is closed at once. */
    t0 = kvt_now_ns();
    a = raw_connect(port);
    assert_int_equal(pump_read(a, buf, sizeof(buf), 2000),
                     KVT_TP_FRAME_HDR + KVT_TP_FRAME_HELLO_BYTES);
    b = raw_connect(port);
    assert_int_equal(pump_read(b, buf, sizeof(buf), 2000),
                     KVT_TP_FRAME_HDR + KVT_TP_FRAME_HELLO_BYTES);
    c = raw_connect(port);
    assert_int_equal(pump_read(c, buf, sizeof(buf), 2000), 0); /* closed, no HELLO */
    assert_int_equal(refused(KVT_TP_PREAUTH_CONNS), 1);
    assert_int_equal(S.accepted, 2);

    /* One of them authorized by its owner: no longer pre-auth, room for another. */
    assert_non_null(S.eps[1]);
    assert_int_equal(kvt_tp_ep_authorize(S.eps[1]), 0);
    d = raw_connect(port);
    assert_int_equal(pump_read(d, buf, sizeof(buf), 2000),
                     KVT_TP_FRAME_HDR + KVT_TP_FRAME_HELLO_BYTES);
    assert_int_equal(S.accepted, 3);

    /* Bytes that are not our protocol: closed at once, counted. */
    assert_int_equal(send(d, zeros, sizeof(zeros), 0), (ssize_t)sizeof(zeros));
    assert_int_equal(pump_read(d, buf, sizeof(buf), 2000), 0);
    assert_int_equal(refused(KVT_TP_PREAUTH_MALFORMED), 1);

    /* a said nothing and was never authorized: closed after preauth_timeout_ms. b
     * was authorized (it sent its ADDR: read it), so it stays. */
    assert_int_equal(pump_read(a, buf, sizeof(buf), 3 * PREAUTH_MS + 2000), 0);
    assert_true(kvt_now_ns() - t0 >= (uint64_t)PREAUTH_MS * 1000000ull);
    assert_int_equal(refused(KVT_TP_PREAUTH_TIMEOUT), 1);
    pump(50);
    assert_int_equal(S.closed_timeout, 1);
    assert_true(pump_read(b, big, sizeof(big), 200) > 0); /* its ADDR frame */
    assert_int_equal(pump_read(b, big, sizeof(big), 200), -1);
    assert_int_equal(S.closed, 2); /* a (timeout) and d (malformed) */

    close(a);
    close(b);
    close(c);
    close(d);
    kvt_tp_close(S.tp);
    assert_int_equal(S.closed, 3);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_preauth_bounds),
    };

    return cmocka_run_group_tests(tests, NULL, NULL);
}

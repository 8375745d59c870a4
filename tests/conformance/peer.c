/* The peer side of the transport conformance suite, and the helpers both sides share.
 *
 * A peer process serves exactly one connection: it registers CONF_REGION_BYTES of a
 * known pattern for remote READ, sends its packed handle from on_accept (the endpoint
 * is CONNECTED there, so this also checks that a send from on_accept arrives first),
 * authorizes its end when the client asks (M_AUTHORIZE: the client's handshake),
 * lets the client read all of the region but what M_DENY names (its may_read),
 * obeys the client's control messages (stream, stall, kill, quit) and exits once that
 * endpoint is CLOSED: 0 when everything it received was in order and intact and its
 * refusal counters are what M_EXPECT said, 1 otherwise. A second transport listens on the mute port
 * and is never progressed: a peer that never answers a connect. The single-host suite starts one
 * peer per test (exec of its own binary); the two-host supervisor restarts one per connection. */
#include <errno.h>
#include <net/if.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "conf.h"

/* ---- shared helpers ---- */

static uint64_t splitmix64(uint64_t x)
{
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

void conf_pattern(uint8_t *buf, size_t len)
{
    for (size_t w = 0; w * 8 < len; w++) {
        uint64_t v = splitmix64(w);
        size_t n = len - w * 8 < 8 ? len - w * 8 : 8;

        memcpy(buf + w * 8, &v, n);
    }
}

size_t conf_payload_len(uint64_t seq)
{
    if (seq % 997 == 996)
        return 48u << 10; /* above every eager threshold: rendezvous / large sends */
    return 1 + (size_t)((seq * 7919) % 1500);
}

void conf_payload(uint64_t seq, uint8_t *buf, size_t len)
{
    for (size_t j = 0; j < len; j++)
        buf[j] = (uint8_t)(seq * 131 + j * 7 + (j >> 8));
}

bool conf_payload_ok(uint64_t seq, const uint8_t *buf, size_t len)
{
    if (len != conf_payload_len(seq))
        return false;
    for (size_t j = 0; j < len; j++)
        if (buf[j] != (uint8_t)(seq * 131 + j * 7 + (j >> 8)))
            return false;
    return true;
}

uint64_t conf_now_ms(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

int conf_pump(struct kvt_transport *tp, bool (*done)(void *), void *arg, unsigned timeout_ms)
{
    uint64_t until = conf_now_ms() + timeout_ms;

    for (;;) {
        if (done != NULL && done(arg))
            return 0;
        if (conf_now_ms() >= until)
            return done == NULL ? 0 : -ETIMEDOUT;

        int n = kvt_tp_progress(tp);

        if (n < 0)
            return n;
        if (n == 0 && kvt_tp_arm(tp) == 0) {
            struct pollfd pfd = {.fd = kvt_tp_event_fd(tp), .events = POLLIN};

            poll(&pfd, 1, 20);
        }
    }
}

/* ---- the peer ---- */

struct peer {
    struct kvt_transport *tp;
    struct kvt_tp_ep *ep; /* the one client, NULL before and after */
    struct kvt_tp_mr *mr;
    uint8_t handle[KVT_TP_MAX_HANDLE_SIZE];
    size_t handle_len;
    bool served, closed;
    /* stream state */
    uint64_t stream_n, tx_next, rx_next, rx_errors;
    bool streaming;
    unsigned stall_ms;
    bool silence; /* during the stall, with the link down */
    bool kill, quit;
    int errors;                  /* anything that makes the peer exit 1 */
    uint64_t deny_off, deny_len; /* may_read refuses what overlaps this */
    struct {
        uint64_t refusal, count;
    } expect[8];
    unsigned n_expect;
};

/* Takes this host's link down or up: how an RDMA peer is made to stop answering, as
 * its NIC serves READs without its CPU. Only inside the soft-RoCE guests, which name
 * the link in KVT_NETDEV (tools/rxe-harness); anywhere else it refuses. An ioctl, not
 * `ip link`: the client posts its READs 500 ms after M_SILENCE, and a fork and exec
 * of ip in a loaded TCG guest took longer (the READ completed before the link went
 * down). */
static int peer_link(bool up)
{
    const char *dev = getenv("KVT_NETDEV");
    struct ifreq ifr = {0};
    int fd, rc = -1;

    if (dev == NULL || strlen(dev) >= sizeof(ifr.ifr_name) ||
        strspn(dev, "abcdefghijklmnopqrstuvwxyz0123456789") != strlen(dev)) {
        fprintf(stderr, "peer: M_SILENCE needs KVT_NETDEV (a soft-RoCE guest's link)\n");
        return -1;
    }
    memcpy(ifr.ifr_name, dev, strlen(dev));
    fd = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd >= 0 && ioctl(fd, SIOCGIFFLAGS, &ifr) == 0) {
        if (up)
            ifr.ifr_flags |= IFF_UP;
        else
            ifr.ifr_flags &= ~IFF_UP;
        rc = ioctl(fd, SIOCSIFFLAGS, &ifr);
    }
    if (rc != 0)
        fprintf(stderr, "peer: link %s %s: %s\n", dev, up ? "up" : "down", strerror(errno));
    if (fd >= 0)
        close(fd);
    return rc == 0 ? 0 : -1;
}

static int peer_send(struct peer *p, uint32_t type, uint64_t a, uint64_t b, const void *data,
                     size_t len)
{
    uint8_t buf[sizeof(struct conf_msg) + CONF_MAX_MSG];
    struct conf_msg *m = (struct conf_msg *)buf;

    if (len > CONF_MAX_MSG - sizeof(*m))
        return -EMSGSIZE;
    *m = (struct conf_msg){.type = type, .a = a, .b = b};
    if (len > 0)
        memcpy(m->data, data, len);
    return kvt_tp_send(p->ep, buf, sizeof(*m) + len);
}

static int peer_on_accept(void *arg, struct kvt_tp_ep *ep)
{
    struct peer *p = arg;
    int ret;

    if (p->ep != NULL || p->served)
        return -EBUSY; /* one client per peer process */
    p->ep = ep;
    p->served = true;
    ret = peer_send(p, M_HANDLE, CONF_REGION_BYTES, 0, p->handle, p->handle_len);
    if (ret < 0) {
        fprintf(stderr, "peer: sending the handle from on_accept: %s\n", strerror(-ret));
        p->errors++;
    }
    return 0;
}

static void peer_on_ep_state(void *arg, struct kvt_tp_ep *ep, enum kvt_ep_state state, int err)
{
    struct peer *p = arg;

    if (state == KVT_EP_CLOSED && ep == p->ep) {
        p->ep = NULL;
        p->closed = true;
    }
}

static void peer_on_msg(void *arg, struct kvt_tp_ep *ep, const void *buf, size_t len)
{
    struct peer *p = arg;
    struct conf_msg m;

    if (len < sizeof(m)) {
        p->errors++;
        return;
    }
    memcpy(&m, buf, sizeof(m));
    switch (m.type) {
    case M_STREAM:
        p->stream_n = m.a;
        p->tx_next = p->rx_next = p->rx_errors = 0;
        p->streaming = true;
        break;
    case M_DATA:
        if (m.a != p->rx_next ||
            !conf_payload_ok(m.a, (const uint8_t *)buf + sizeof(m), len - sizeof(m)))
            p->rx_errors++;
        p->rx_next++;
        break;
    case M_STALL:
    case M_SILENCE:
        p->stall_ms = (unsigned)m.a;
        p->silence = m.type == M_SILENCE;
        break;
    case M_KILL:
        p->kill = true;
        break;
    case M_QUIT:
        p->quit = true;
        break;
    case M_AUTHORIZE: {
        int ret = kvt_tp_ep_authorize(ep);

        if (ret < 0) {
            fprintf(stderr, "peer: authorize: %s\n", strerror(-ret));
            p->errors++;
        }
        (void)peer_send(p, M_ACK, M_AUTHORIZE, 0, NULL, 0);
        break;
    }
    case M_EXPECT:
        if (p->n_expect == sizeof(p->expect) / sizeof(p->expect[0]) || m.a >= KVT_TP_N_REFUSALS) {
            p->errors++;
            break;
        }
        p->expect[p->n_expect].refusal = m.a;
        p->expect[p->n_expect++].count = m.b;
        (void)peer_send(p, M_ACK, M_EXPECT, 0, NULL, 0);
        break;
    case M_DENY:
        p->deny_off = m.a;
        p->deny_len = m.b;
        (void)peer_send(p, M_ACK, M_DENY, 0, NULL, 0);
        break;
    default:
        fprintf(stderr, "peer: unknown message type %u\n", m.type);
        p->errors++;
    }
}

/* The region is the peer's to give: all of it but the M_DENY window. */
static bool peer_may_read(void *arg, struct kvt_tp_ep *ep, struct kvt_tp_mr *mr, uint64_t off,
                          uint64_t len)
{
    struct peer *p = arg;

    (void)ep;
    if (mr != p->mr)
        return false;
    return p->deny_len == 0 || off + len <= p->deny_off || off >= p->deny_off + p->deny_len;
}

/* The refusal counters against what the client said to expect; errors. */
static int peer_check_counters(struct peer *p)
{
    struct kvt_tp_counters c;
    int errors = 0;

    if (p->n_expect == 0)
        return 0;
    if (kvt_tp_get_counters(p->tp, &c) != 0)
        return 1;
    for (unsigned i = 0; i < p->n_expect; i++) {
        uint64_t got = c.refused[p->expect[i].refusal];

        if (got != p->expect[i].count) {
            fprintf(stderr, "peer: refusals \"%s\": %llu, expected %llu\n",
                    kvt_tp_refusal_name((unsigned)p->expect[i].refusal), (unsigned long long)got,
                    (unsigned long long)p->expect[i].count);
            errors++;
        }
    }
    return errors;
}

/* Sends what the stream still owes, as far as credits allow. */
static void peer_stream(struct peer *p)
{
    static uint8_t payload[CONF_MAX_MSG];

    while (p->streaming && p->ep != NULL && p->tx_next < p->stream_n) {
        size_t len = conf_payload_len(p->tx_next);
        int ret;

        conf_payload(p->tx_next, payload, len);
        ret = peer_send(p, M_DATA, p->tx_next, 0, payload, len);
        if (ret == -EAGAIN)
            return;
        if (ret < 0) {
            fprintf(stderr, "peer: send: %s\n", strerror(-ret));
            p->errors++;
            p->streaming = false;
            return;
        }
        p->tx_next++;
    }
    if (p->streaming && p->ep != NULL && p->rx_next >= p->stream_n) {
        if (peer_send(p, M_STREAM_DONE, p->rx_next, p->rx_errors, NULL, 0) == 0) {
            p->streaming = false;
            if (p->rx_errors != 0)
                p->errors++;
        }
    }
}

int conf_peer_main(const char *backend, const char *addr, uint16_t port, uint16_t mute_port,
                   int ready_fd)
{
    struct peer p = {0};
    struct kvt_transport *mute = NULL;
    struct kvt_transport_config cfg = {
        .backend = backend,
        .max_msg_bytes = CONF_MAX_MSG,
        .local_addr = addr,
        .cb = {.on_accept = peer_on_accept,
               .on_ep_state = peer_on_ep_state,
               .on_msg = peer_on_msg,
               .may_read = peer_may_read,
               .arg = &p},
    };
    struct kvt_transport_config mute_cfg = {.backend = backend};
    uint8_t *region = NULL;
    int ret, status = 1;

    region = aligned_alloc(4096, CONF_REGION_BYTES);
    if (region == NULL)
        return 1;
    conf_pattern(region, CONF_REGION_BYTES);
    ret = kvt_tp_open(&cfg, &p.tp);
    if (ret < 0) {
        fprintf(stderr, "peer: open %s: %s\n", backend, strerror(-ret));
        goto out_free;
    }
    ret = kvt_tp_reg_remote(p.tp, region, CONF_REGION_BYTES, &p.mr);
    if (ret == 0)
        ret = kvt_tp_pack(p.tp, p.mr, p.handle, sizeof(p.handle), &p.handle_len);
    if (ret == 0)
        ret = kvt_tp_listen(p.tp, addr, port, &port);
    if (ret == 0)
        ret = kvt_tp_open(&mute_cfg, &mute);
    if (ret == 0)
        ret = kvt_tp_listen(mute, addr, mute_port, &mute_port);
    if (ret < 0) {
        fprintf(stderr, "peer: setup on %s: %s\n", addr, strerror(-ret));
        goto out_close;
    }
    if (ready_fd >= 0) {
        dprintf(ready_fd, "%u %u\n", port, mute_port);
        close(ready_fd);
    }
    while (!p.closed) {
        ret = kvt_tp_progress(p.tp);
        if (ret < 0) {
            fprintf(stderr, "peer: progress: %s\n", strerror(-ret));
            goto out_close;
        }
        if (p.kill)
            raise(SIGKILL);
        if (p.stall_ms != 0) {
            if (p.silence && peer_link(false) != 0)
                p.errors++;
            usleep(p.stall_ms * 1000u);
            if (p.silence && peer_link(true) != 0)
                p.errors++;
            p.stall_ms = 0;
        }
        peer_stream(&p);
        if (p.quit) {
            kvt_tp_ep_close(p.ep);
            conf_pump(p.tp, NULL, NULL, 100);
            status = CONF_EXIT_QUIT;
            goto out_close;
        }
        if (ret == 0 && kvt_tp_arm(p.tp) == 0) {
            struct pollfd pfd = {.fd = kvt_tp_event_fd(p.tp), .events = POLLIN};

            poll(&pfd, 1, 50);
        }
    }
    p.errors += peer_check_counters(&p);
    status = p.errors == 0 ? 0 : 1;
    if (p.errors != 0)
        fprintf(stderr, "peer: %d errors\n", p.errors);
out_close:
    kvt_tp_close(mute);
    if (p.mr != NULL)
        kvt_tp_dereg(p.mr, p.tp);
    kvt_tp_close(p.tp);
out_free:
    free(region);
    return status;
}

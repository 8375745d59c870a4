/* SPDX-License-Identifier: Apache-2.0 */
/* Peer links (cluster/peers.c) over the UCX transport on 127.0.0.1, all in one
 * process: every node is a kvt_peers instance with its own UCX context, progressed
 * round-robin by the test thread (WAIT_FOR). Misbehaving peers are "raw" transports
 * driven by the test itself with wire.h and auth.h: silent, speaking out of turn, or
 * completing the handshake by hand and then sending garbage. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "test_util.h"

#include "kvt/auth.h"
#include "kvt/clock.h"
#include "kvt/log.h"
#include "kvt/peers.h"
#include "kvt/stats.h"
#include "kvt/transport.h"
#include "kvt/wire.h"

#define HB_MS      40
#define HB_MISSES  4
#define HS_MS      400
#define MAX_NODES  8
#define MAX_EVENTS 256

static const uint8_t good_secret[] = "kvtier-test-secret-0123456789abcdef";
static const uint8_t bad_secret[] = "kvtier-test-secret-WRONG-WRONG-WRONG";

/* ---- nodes ---- */

struct tnode {
    struct kvt_peers *p;
    uint64_t id;
    bool paused; /* WAIT_FOR skips it: a node that stopped progressing */
    struct kvt_member_event ev[MAX_EVENTS];
    size_t n_ev;
    size_t n_msgs;
    uint64_t last_from;
    struct kvt_tp_ep *last_ep;
    enum kvt_wire_type last_type;
    uint64_t last_req;
    size_t n_link_closed;
    uint64_t link_closed_ids[MAX_EVENTS];
};

struct raw;
static struct tnode *g_nodes[MAX_NODES];
static struct raw *g_raws[MAX_NODES];

static void on_msg(void *arg, uint64_t from, struct kvt_tp_ep *ep, const struct kvt_wire_msg *m)
{
    struct tnode *t = arg;

    t->n_msgs++;
    t->last_from = from;
    t->last_ep = ep;
    t->last_type = m->type;
    t->last_req = m->type == KVT_WIRE_LOCATE         ? m->u.locate.req_id
                  : m->type == KVT_WIRE_LOCATE_REPLY ? m->u.locate_reply.req_id
                                                     : 0;
}

static void on_member(void *arg, const struct kvt_member_event *ev)
{
    struct tnode *t = arg;

    if (t->n_ev < MAX_EVENTS)
        t->ev[t->n_ev++] = *ev;
}

static void on_link_closed(void *arg, uint64_t node_id, struct kvt_tp_ep *ep)
{
    struct tnode *t = arg;

    assert_non_null(ep);
    if (t->n_link_closed < MAX_EVENTS)
        t->link_closed_ids[t->n_link_closed] = node_id;
    t->n_link_closed++;
}

static void reg(void **tab, void *x, bool add)
{
    for (size_t i = 0; i < MAX_NODES; i++)
        if (add ? tab[i] == NULL : tab[i] == x) {
            tab[i] = add ? x : NULL;
            return;
        }
    fail_msg("registry full");
}

static void ns_of(const char *name, uint8_t ns[KVT_AUTH_NS_BYTES])
{
    kvt_auth_namespace(name, ns);
}

/* A node on 127.0.0.1, port 0, seeded with the ports given (0-terminated), with a
 * heartbeat every hb_ms and down after `misses` of them missed. */
static void node_start_hb(struct tnode *t, uint64_t id, const uint8_t *secret, const char *nsname,
                          const uint16_t *seed_ports, unsigned hb_ms, unsigned misses)
{
    char seed_buf[4][32];
    const char *seeds[4];
    size_t n = 0;
    struct kvt_peers_config c = {0};

    memset(t, 0, sizeof(*t));
    t->id = id;
    for (; seed_ports != NULL && seed_ports[n] != 0; n++) {
        snprintf(seed_buf[n], sizeof(seed_buf[n]), "127.0.0.1:%u", seed_ports[n]);
        seeds[n] = seed_buf[n];
    }
    c.node_id = id;
    ns_of(nsname, c.ns);
    c.secret = secret;
    c.secret_len = strlen((const char *)secret);
    c.listen_addr = "127.0.0.1";
    c.seeds = seeds;
    c.n_seeds = n;
    c.heartbeat_ms = hb_ms;
    c.heartbeat_misses = misses;
    c.handshake_timeout_ms = HS_MS;
    c.transport.backend = "ucx";
    c.h = (struct kvt_peers_handlers){
        .on_msg = on_msg, .on_member = on_member, .on_link_closed = on_link_closed, .arg = t};
    assert_int_equal(kvt_peers_create(&c, &t->p), 0);
    assert_int_not_equal(kvt_peers_port(t->p), 0);
    reg((void **)g_nodes, t, true);
}

static void node_start_ex(struct tnode *t, uint64_t id, const uint8_t *secret, const char *nsname,
                          const uint16_t *seed_ports)
{
    node_start_hb(t, id, secret, nsname, seed_ports, HB_MS, HB_MISSES);
}

static void node_start(struct tnode *t, uint64_t id, const uint16_t *seed_ports)
{
    node_start_ex(t, id, good_secret, "test-ns", seed_ports);
}

static void node_stop(struct tnode *t)
{
    reg((void **)g_nodes, t, false);
    kvt_peers_destroy(t->p);
    t->p = NULL;
}

static bool has_event(const struct tnode *t, enum kvt_member_event_kind kind, uint64_t id)
{
    for (size_t i = 0; i < t->n_ev; i++)
        if (t->ev[i].kind == kind && t->ev[i].node_id == id)
            return true;
    return false;
}

/* An event `then` of id after an event `first` of id. */
static bool has_event_after(const struct tnode *t, enum kvt_member_event_kind first,
                            enum kvt_member_event_kind then, uint64_t id)
{
    bool seen = false;

    for (size_t i = 0; i < t->n_ev; i++) {
        if (t->ev[i].node_id != id)
            continue;
        if (seen && t->ev[i].kind == then)
            return true;
        seen = seen || t->ev[i].kind == first;
    }
    return false;
}

static size_t live(const struct tnode *t)
{
    uint64_t ids[16];

    return kvt_peers_live(t->p, ids, 16);
}

static bool linked(const struct tnode *t, uint64_t id)
{
    return kvt_peers_link(t->p, id) != NULL;
}

/* ---- raw peers: a bare transport the test drives ---- */

struct raw {
    struct kvt_transport *tp;
    struct kvt_tp_ep *ep;
    bool connected, closed;
    size_t n_rx;
    size_t n_by_type[KVT_WIRE_TYPE_END];
    struct kvt_wire_msg last; /* last handshake-type message (no lists) */
    bool have_last;
};

static void raw_on_ep_state(void *arg, struct kvt_tp_ep *ep, enum kvt_ep_state st, int err)
{
    struct raw *r = arg;

    (void)err;
    if (ep != r->ep)
        return;
    if (st == KVT_EP_CONNECTED) {
        r->connected = true;
    } else {
        r->closed = true;
        r->ep = NULL;
    }
}

static void raw_on_msg(void *arg, struct kvt_tp_ep *ep, const void *buf, size_t len)
{
    struct raw *r = arg;
    const uint8_t *body;
    size_t blen;
    struct kvt_wire_msg m;

    (void)ep;
    r->n_rx++;
    assert_int_equal(kvt_wire_unframe(buf, len, NULL, &body, &blen), 0);
    assert_int_equal(kvt_wire_decode(body, blen, NULL, &m), 0);
    assert_true(m.type > 0 && m.type < KVT_WIRE_TYPE_END);
    r->n_by_type[m.type]++;
    if (m.type <= KVT_WIRE_REFUSE) {
        r->last = m;
        r->have_last = true;
    }
    kvt_wire_msg_free(&m);
}

static int raw_on_accept(void *arg, struct kvt_tp_ep *ep)
{
    (void)arg;
    (void)ep;
    return -ECONNREFUSED;
}

static void raw_open(struct raw *r, uint16_t port)
{
    struct kvt_transport_config c = {.backend = "ucx"};

    memset(r, 0, sizeof(*r));
    c.cb = (struct kvt_tp_callbacks){
        .on_accept = raw_on_accept, .on_ep_state = raw_on_ep_state, .on_msg = raw_on_msg, .arg = r};
    assert_int_equal(kvt_tp_open(&c, &r->tp), 0);
    assert_int_equal(kvt_tp_connect(r->tp, "127.0.0.1", port, r, &r->ep), 0);
    reg((void **)g_raws, r, true);
}

static void raw_close(struct raw *r)
{
    reg((void **)g_raws, r, false);
    kvt_tp_close(r->tp);
}

static int raw_send(struct raw *r, const struct kvt_wire_msg *m)
{
    struct kvt_wire_buf b;
    int ret;

    kvt_wire_buf_init(&b);
    assert_int_equal(kvt_wire_encode(m, &b), 0);
    ret = kvt_tp_send(r->ep, b.data, b.len);
    kvt_wire_buf_cleanup(&b);
    return ret;
}

/* ---- the loop ---- */

static void spin(void)
{
    for (size_t i = 0; i < MAX_NODES; i++)
        if (g_nodes[i] != NULL && !g_nodes[i]->paused)
            assert_true(kvt_peers_progress(g_nodes[i]->p) >= 0);
    for (size_t i = 0; i < MAX_NODES; i++)
        if (g_raws[i] != NULL)
            assert_true(kvt_tp_progress(g_raws[i]->tp) >= 0);
    usleep(200);
}

/* Progresses everything until cond holds or ms pass; the value of cond at the end. */
#define WAIT_FOR(ms, cond)                                                                         \
    ({                                                                                             \
        uint64_t end_ = kvt_now_ns() + (uint64_t)(ms)*1000000ull;                                  \
        bool ok_;                                                                                  \
        while (!(ok_ = (cond)) && kvt_now_ns() < end_)                                             \
            spin();                                                                                \
        ok_;                                                                                       \
    })

static void run_for(unsigned ms)
{
    (void)WAIT_FOR(ms, false);
}

static void mesh2(struct tnode *a, struct tnode *b)
{
    uint16_t pa[2] = {0, 0};

    node_start(a, 0xA, NULL);
    pa[0] = kvt_peers_port(a->p);
    node_start(b, 0xB, pa);
    assert_true(WAIT_FOR(5000, linked(a, 0xB) && linked(b, 0xA) && live(a) == 2 && live(b) == 2));
}

static struct kvt_wire_msg locate(uint64_t req_id, struct kvt_key *k)
{
    struct kvt_wire_msg m;

    kvt_wire_msg_init(&m, KVT_WIRE_LOCATE);
    m.u.locate.req_id = req_id;
    m.u.locate.n_keys = 1;
    m.u.locate.keys = k;
    return m;
}

/* The raw peer r, as node id (incarnation inc), says HELLO to a with nonce_c; a's
 * HELLO_ACK. */
static struct kvt_wire_msg raw_hello(struct raw *r, struct tnode *a, uint64_t id, uint64_t inc,
                                     uint8_t nonce_c[KVT_AUTH_NONCE_BYTES])
{
    struct kvt_wire_msg m, ack;
    uint8_t ns[KVT_AUTH_NS_BYTES];

    assert_true(WAIT_FOR(5000, r->connected));
    assert_int_equal(kvt_auth_nonce(nonce_c), 0);
    kvt_wire_msg_init(&m, KVT_WIRE_HELLO);
    m.u.hello.node_id = id;
    m.u.hello.incarnation = inc;
    ns_of("test-ns", ns);
    memcpy(m.u.hello.ns, ns, sizeof(ns));
    memcpy(m.u.hello.nonce, nonce_c, KVT_AUTH_NONCE_BYTES);
    assert_int_equal(raw_send(r, &m), 0);
    assert_true(WAIT_FOR(3000, r->n_by_type[KVT_WIRE_HELLO_ACK] == 1));
    ack = r->last;
    assert_int_equal(ack.u.hello.node_id, a->id);
    return ack;
}

/* The raw peer r, as node id (incarnation inc), dials a: HELLO -> HELLO_ACK (a's
 * proof verified) -> AUTH (with dropped_inc when dropped is not NULL, and drop_seq
 * when not 0) -> AUTH_OK, until a holds the link up. Returns a's HELLO_ACK. */
static struct kvt_wire_msg raw_handshake_seq(struct raw *r, struct tnode *a, uint64_t id,
                                             uint64_t inc, const uint64_t *dropped,
                                             uint64_t drop_seq)
{
    struct kvt_wire_msg m, ack;
    struct kvt_auth_params ap;
    uint8_t nonce_c[KVT_AUTH_NONCE_BYTES], ns[KVT_AUTH_NS_BYTES];

    ack = raw_hello(r, a, id, inc, nonce_c);
    ns_of("test-ns", ns);
    ap = (struct kvt_auth_params){.nonce_client = nonce_c,
                                  .nonce_server = ack.u.hello.nonce,
                                  .id_client = id,
                                  .id_server = a->id,
                                  .ns = ns};
    assert_true(kvt_auth_verify(good_secret, strlen((const char *)good_secret), KVT_AUTH_SERVER,
                                &ap, ack.u.hello.proof, KVT_AUTH_PROOF_BYTES));
    kvt_wire_msg_init(&m, KVT_WIRE_AUTH);
    m.u.hello.node_id = id;
    m.u.hello.incarnation = inc;
    if (dropped != NULL) {
        m.has |= KVT_WIRE_HAS(KVT_WIRE_F_DROPPED);
        m.u.hello.dropped_inc = *dropped;
    }
    if (drop_seq != 0) {
        m.has |= KVT_WIRE_HAS(KVT_WIRE_F_DROP_SEQ);
        m.u.hello.drop_seq = drop_seq;
    }
    assert_int_equal(kvt_auth_proof(good_secret, strlen((const char *)good_secret), KVT_AUTH_CLIENT,
                                    &ap, m.u.hello.proof),
                     0);
    assert_int_equal(raw_send(r, &m), 0);
    /* Our end, as a client does once the server's proof checked out and AUTH is sent
     * (the server's AUTH_OK may travel on the data plane that authorizing sets up). */
    assert_int_equal(kvt_tp_ep_authorize(r->ep), 0);
    assert_true(WAIT_FOR(3000, r->n_by_type[KVT_WIRE_AUTH_OK] == 1 && linked(a, id)));
    return ack;
}

static struct kvt_wire_msg raw_handshake(struct raw *r, struct tnode *a, uint64_t id, uint64_t inc,
                                         const uint64_t *dropped)
{
    return raw_handshake_seq(r, a, id, inc, dropped, 0);
}

/* ---- tests ---- */

static void test_config_errors(void **state)
{
    struct kvt_peers_config c = {0};
    struct kvt_peers *p = NULL;
    const char *bad_seeds[] = {"127.0.0.1"};

    (void)state;
    c.node_id = 1;
    c.secret = good_secret;
    c.secret_len = strlen((const char *)good_secret);
    c.listen_addr = "127.0.0.1";
    c.transport.backend = "ucx";

    c.node_id = 0;
    assert_int_equal(kvt_peers_create(&c, &p), -EINVAL);
    c.node_id = 1;
    c.secret_len = 4;
    assert_int_equal(kvt_peers_create(&c, &p), -EINVAL);
    c.secret_len = strlen((const char *)good_secret);
    c.seeds = bad_seeds;
    c.n_seeds = 1;
    assert_int_equal(kvt_peers_create(&c, &p), -EINVAL);
    c.n_seeds = 0;
    c.listen_addr = NULL;
    assert_int_equal(kvt_peers_create(&c, &p), -EINVAL);
    assert_null(p);
}

static void test_handshake_and_exchange(void **state)
{
    static struct tnode a, b;
    struct kvt_peers_counts ca, cb;
    struct kvt_key k = kt_key(1);
    struct kvt_wire_msg m = locate(42, &k), r;
    struct kvt_wire_holder_list hl = {0};
    struct kvt_stats st;
    uint64_t ids[4], id = 0, inc = 0;

    (void)state;
    mesh2(&a, &b);
    assert_int_equal(kvt_peers_live(a.p, ids, 4), 2);
    assert_true(ids[0] == 0xA && ids[1] == 0xB);
    assert_true(has_event(&a, KVT_MEMBER_JOINED, 0xB));
    assert_true(has_event(&b, KVT_MEMBER_JOINED, 0xA));

    /* A -> B, B replies on the link the request came on. */
    assert_int_equal(kvt_peers_send(a.p, 0xB, &m), 0);
    assert_true(WAIT_FOR(3000, b.n_msgs == 1));
    assert_int_equal(b.last_from, 0xA);
    assert_int_equal(b.last_type, KVT_WIRE_LOCATE);
    assert_int_equal(b.last_req, 42);
    assert_int_equal(kvt_peers_link_peer(b.p, b.last_ep, &id, &inc), 0);
    assert_int_equal(id, 0xA);
    assert_int_equal(inc, kvt_peers_incarnation(a.p));
    kvt_wire_msg_init(&r, KVT_WIRE_LOCATE_REPLY);
    r.u.locate_reply.req_id = 42;
    r.u.locate_reply.n_keys = 1;
    r.u.locate_reply.holders = &hl;
    assert_int_equal(kvt_peers_reply(b.p, b.last_ep, &r), 0);
    assert_true(WAIT_FOR(3000, a.n_msgs == 1));
    assert_int_equal(a.last_from, 0xB);
    assert_int_equal(a.last_type, KVT_WIRE_LOCATE_REPLY);
    assert_int_equal(a.last_req, 42);

    /* Misuse. */
    assert_int_equal(kvt_peers_send(a.p, 0xC, &m), -ENOTCONN);
    kvt_wire_msg_init(&r, KVT_WIRE_AUTH_OK);
    assert_int_equal(kvt_peers_send(a.p, 0xB, &r), -EINVAL);
    assert_int_equal(kvt_peers_send(a.p, 0xB, NULL), -EINVAL);
    assert_int_equal(kvt_peers_link_peer(a.p, NULL, &id, &inc), -ENOTCONN);

    /* Heartbeats keep both alive well past the miss limit. */
    run_for(HB_MS * HB_MISSES * 3);
    assert_int_equal(live(&a), 2);
    assert_int_equal(live(&b), 2);
    assert_false(has_event(&a, KVT_MEMBER_DOWN_EV, 0xB));

    kvt_peers_counts(a.p, &ca);
    kvt_peers_counts(b.p, &cb);
    assert_true(ca.handshakes >= 1 && cb.handshakes >= 1);
    assert_int_equal(ca.refused + cb.refused, 0);
    assert_int_equal(ca.malformed + cb.malformed, 0);

    kvt_stats_init(&st);
    assert_int_equal(kvt_peers_get_stats(a.p, &st), 0);
    assert_true(kvt_stats_value(&st, "peers_handshakes", "") >= 1);
    assert_true(kvt_stats_value(&st, "peers_live", "") == 2);
    assert_true(kvt_stats_value(&st, "peers_links", "") >= 1);
    assert_non_null(kvt_stats_find(&st, "peers_refused", "auth"));
    kvt_stats_clear(&st);
    assert_int_equal(kvt_peers_get_stats(a.p, &st), 0); /* return-and-reset */
    assert_true(kvt_stats_value(&st, "peers_handshakes", "") == 0);
    assert_true(kvt_stats_value(&st, "peers_live", "") == 2);
    kvt_stats_cleanup(&st);

    node_stop(&b);
    node_stop(&a);
}

/* X (wrong secret) dials A; A dials Y (wrong secret). Both refused as "auth". */
static void test_wrong_secret(void **state)
{
    static struct tnode a, x, y;
    struct kvt_peers_counts c;
    uint16_t py[2] = {0, 0}, pa[2] = {0, 0};
    struct kvt_stats st;

    (void)state;
    node_start_ex(&y, 0x7, bad_secret, "test-ns", NULL);
    py[0] = kvt_peers_port(y.p);
    node_start(&a, 0xA, py);
    pa[0] = kvt_peers_port(a.p);
    node_start_ex(&x, 0x8, bad_secret, "test-ns", pa);

    assert_true(WAIT_FOR(5000, ({
                             kvt_peers_counts(a.p, &c);
                             c.refused_by_reason[KVT_WIRE_R_AUTH] >= 2;
                         })));
    run_for(HB_MS * 4);
    kvt_peers_counts(a.p, &c);
    assert_int_equal(c.handshakes, 0);
    assert_true(c.refused_by_reason[KVT_WIRE_R_AUTH] >= 2);
    assert_int_equal(c.refused_by_reason[KVT_WIRE_R_NAMESPACE], 0);
    assert_int_equal(a.n_msgs + x.n_msgs + y.n_msgs, 0);
    assert_int_equal(a.n_ev, 0);
    assert_int_equal(a.n_link_closed, 0);
    assert_false(linked(&a, 0x7) || linked(&a, 0x8) || linked(&x, 0xA) || linked(&y, 0xA));
    assert_int_equal(live(&a), 1);
    assert_int_equal(live(&x), 1);
    kvt_stats_init(&st);
    assert_int_equal(kvt_peers_get_stats(a.p, &st), 0);
    assert_true(kvt_stats_value(&st, "peers_refused", "auth") >= 2);
    assert_true(kvt_stats_value(&st, "peers_links", "") == 0);
    kvt_stats_cleanup(&st);
    node_stop(&x);
    node_stop(&a);
    node_stop(&y);
}

static void test_other_namespace(void **state)
{
    static struct tnode a, x;
    struct kvt_peers_counts c;
    uint16_t pa[2] = {0, 0};

    (void)state;
    node_start(&a, 0xA, NULL);
    pa[0] = kvt_peers_port(a.p);
    node_start_ex(&x, 0x9, good_secret, "another-ns", pa);
    assert_true(WAIT_FOR(5000, ({
                             kvt_peers_counts(a.p, &c);
                             c.refused_by_reason[KVT_WIRE_R_NAMESPACE] >= 1;
                         })));
    run_for(HB_MS * 2);
    kvt_peers_counts(a.p, &c);
    assert_int_equal(c.handshakes, 0);
    assert_int_equal(c.refused_by_reason[KVT_WIRE_R_AUTH], 0);
    kvt_peers_counts(x.p, &c);
    assert_true(c.refused_by_reason[KVT_WIRE_R_NAMESPACE] >= 1); /* X got the REFUSE */
    assert_int_equal(a.n_msgs + x.n_msgs, 0);
    assert_false(linked(&a, 0x9) || linked(&x, 0xA));
    assert_int_equal(live(&a), 1);
    node_stop(&x);
    node_stop(&a);
}

/* A raw client with the right namespace but no secret: ignores A's proof and sends
 * an AUTH with a made-up one. A refuses it ("auth") and nothing else reaches it. */
static void test_bad_proof(void **state)
{
    static struct tnode a;
    static struct raw r;
    struct kvt_peers_counts c;
    struct kvt_wire_msg m;

    (void)state;
    node_start(&a, 0xA, NULL);
    raw_open(&r, kvt_peers_port(a.p));
    assert_true(WAIT_FOR(5000, r.connected));
    kvt_wire_msg_init(&m, KVT_WIRE_HELLO);
    m.u.hello.node_id = 0x66;
    m.u.hello.incarnation = 1;
    ns_of("test-ns", m.u.hello.ns);
    assert_int_equal(kvt_auth_nonce(m.u.hello.nonce), 0);
    assert_int_equal(raw_send(&r, &m), 0);
    assert_true(WAIT_FOR(3000, r.n_by_type[KVT_WIRE_HELLO_ACK] == 1));
    kvt_wire_msg_init(&m, KVT_WIRE_AUTH);
    m.u.hello.node_id = 0x66;
    m.u.hello.incarnation = 1;
    memset(m.u.hello.proof, 0x5a, sizeof(m.u.hello.proof));
    assert_int_equal(raw_send(&r, &m), 0);
    assert_true(WAIT_FOR(3000, r.closed));
    assert_int_equal(r.n_by_type[KVT_WIRE_REFUSE], 1);
    assert_int_equal(r.last.u.refuse.reason, KVT_WIRE_R_AUTH);
    assert_int_equal(r.n_by_type[KVT_WIRE_AUTH_OK] + r.n_by_type[KVT_WIRE_HEARTBEAT] +
                         r.n_by_type[KVT_WIRE_MEMBERS],
                     0);
    kvt_peers_counts(a.p, &c);
    assert_int_equal(c.refused_by_reason[KVT_WIRE_R_AUTH], 1);
    assert_int_equal(c.handshakes, 0);
    assert_false(linked(&a, 0x66));
    assert_null(kvt_members_find(kvt_peers_members(a.p), 0x66));
    raw_close(&r);
    node_stop(&a);
}

/* A raw peer sends a HEARTBEAT before any HELLO: REFUSE{PROTOCOL}, link closed. */
static void test_protocol_before_auth(void **state)
{
    static struct tnode a;
    static struct raw r;
    struct kvt_peers_counts c;
    struct kvt_wire_msg m;

    (void)state;
    node_start(&a, 0xA, NULL);
    raw_open(&r, kvt_peers_port(a.p));
    assert_true(WAIT_FOR(5000, r.connected));
    kvt_wire_msg_init(&m, KVT_WIRE_HEARTBEAT);
    m.u.heartbeat = (struct kvt_wire_heartbeat){.node_id = 0x55, .incarnation = 1, .seq = 1};
    assert_int_equal(raw_send(&r, &m), 0);
    assert_true(WAIT_FOR(3000, r.closed));
    assert_int_equal(r.n_by_type[KVT_WIRE_REFUSE], 1);
    assert_int_equal(r.last.u.refuse.reason, KVT_WIRE_R_PROTOCOL);
    assert_int_equal(r.n_rx, 1); /* nothing but the refusal */
    kvt_peers_counts(a.p, &c);
    assert_int_equal(c.refused_by_reason[KVT_WIRE_R_PROTOCOL], 1);
    assert_int_equal(c.refused, 1);
    assert_int_equal(c.handshakes, 0);
    assert_int_equal(a.n_msgs, 0);
    assert_int_equal(live(&a), 1);
    raw_close(&r);
    node_stop(&a);
}

/* A raw peer that connects and says nothing is closed after the handshake timeout. */
static void test_handshake_timeout(void **state)
{
    static struct tnode a;
    static struct raw r;
    struct kvt_peers_counts c;
    uint64_t t0;

    (void)state;
    node_start(&a, 0xA, NULL);
    t0 = kvt_now_ns(); /* A accepts after this: its deadline is after t0 + HS_MS */
    raw_open(&r, kvt_peers_port(a.p));
    assert_true(WAIT_FOR(5000, r.connected));
    assert_true(WAIT_FOR(HS_MS * 10, r.closed));
    assert_true(kvt_now_ns() - t0 >= (uint64_t)HS_MS * 1000000ull);
    kvt_peers_counts(a.p, &c);
    assert_int_equal(c.refused_by_reason[KVT_PEERS_R_TIMEOUT], 1);
    assert_int_equal(c.refused, 1);
    assert_int_equal(r.n_rx, 0);
    assert_int_equal(a.n_link_closed, 0); /* never authenticated */
    raw_close(&r);
    node_stop(&a);
}

/* A; B seeded with A; C seeded only with B learns A from B's MEMBERS. */
static void test_members_learned(void **state)
{
    static struct tnode a, b, c;
    uint16_t pa[2] = {0, 0}, pb[2] = {0, 0};
    uint64_t ids[4];

    (void)state;
    node_start(&a, 0xA, NULL);
    pa[0] = kvt_peers_port(a.p);
    node_start(&b, 0xB, pa);
    pb[0] = kvt_peers_port(b.p);
    assert_true(WAIT_FOR(5000, live(&a) == 2 && live(&b) == 2));
    node_start(&c, 0xC, pb);
    assert_true(WAIT_FOR(5000, linked(&c, 0xA) && linked(&a, 0xC) && live(&a) == 3 &&
                                   live(&b) == 3 && live(&c) == 3));
    assert_true(has_event(&c, KVT_MEMBER_JOINED, 0xA));
    assert_true(has_event(&a, KVT_MEMBER_JOINED, 0xC));
    assert_int_equal(kvt_peers_live(c.p, ids, 4), 3);
    assert_true(ids[0] == 0xA && ids[1] == 0xB && ids[2] == 0xC);
    node_stop(&c);
    node_stop(&b);
    node_stop(&a);
}

static void mesh3(struct tnode *a, struct tnode *b, struct tnode *c)
{
    uint16_t pa[2] = {0, 0}, pab[3] = {0, 0, 0};

    node_start(a, 0xA, NULL);
    pa[0] = pab[0] = kvt_peers_port(a->p);
    node_start(b, 0xB, pa);
    pab[1] = kvt_peers_port(b->p);
    node_start(c, 0xC, pab);
    assert_true(WAIT_FOR(5000, live(a) == 3 && live(b) == 3 && live(c) == 3 && linked(a, 0xC) &&
                                   linked(b, 0xC) && linked(a, 0xB)));
}

/* C stops progressing: A and B see it DOWN after heartbeat_misses, and close their
 * links to it, so that C learns it was called down (it sees A and B down) rather than
 * being heard again on a link it never lost; it comes back. */
static void test_silent_peer_down(void **state)
{
    static struct tnode a, b, c;
    struct kvt_peers_counts pc;
    uint64_t t0, ids[4];

    (void)state;
    mesh3(&a, &b, &c);
    c.paused = true;
    t0 = kvt_now_ns();
    assert_true(WAIT_FOR(5000, has_event(&a, KVT_MEMBER_DOWN_EV, 0xC) &&
                                   has_event(&b, KVT_MEMBER_DOWN_EV, 0xC)));
    /* not before k intervals without a heartbeat (the last one came before t0) */
    assert_true(kvt_now_ns() - t0 >= (uint64_t)HB_MS * (HB_MISSES - 1) * 1000000ull);
    assert_int_equal(kvt_peers_live(a.p, ids, 4), 2);
    assert_true(ids[0] == 0xA && ids[1] == 0xB);
    assert_int_equal(live(&b), 2);
    assert_false(has_event(&a, KVT_MEMBER_DOWN_EV, 0xB));
    /* Down is never one-sided: no link to C is left up (C, stalled, cannot finish a
     * new handshake). Counted as silent. */
    assert_false(linked(&a, 0xC));
    assert_false(linked(&b, 0xC));
    kvt_peers_counts(a.p, &pc);
    assert_int_equal(pc.members_down, 1);
    assert_int_equal(pc.members_silent, 1);
    /* It resumes: its links are gone, it calls A and B down too, and all three
     * join again (same incarnations). */
    c.paused = false;
    assert_true(WAIT_FOR(5000, has_event(&c, KVT_MEMBER_DOWN_EV, 0xA) &&
                                   has_event(&c, KVT_MEMBER_DOWN_EV, 0xB)));
    assert_true(WAIT_FOR(5000, live(&a) == 3 && live(&b) == 3 && live(&c) == 3));
    assert_true(
        WAIT_FOR(1000, has_event_after(&a, KVT_MEMBER_DOWN_EV, KVT_MEMBER_JOINED, 0xC) &&
                           has_event_after(&c, KVT_MEMBER_DOWN_EV, KVT_MEMBER_JOINED, 0xA)));
    node_stop(&c);
    node_stop(&b);
    node_stop(&a);
}

/* Bulk traffic (publications) takes at most half of a link's send credits: with B
 * not reading, A's bulk sends stop while half are still free, and an ordinary
 * message (a heartbeat, an answer) still goes; without the limit the bulk would
 * take every credit and the next message would be refused. Messages of 256 keys of
 * 64 bytes, as a publication's, hold their credit until B takes them. */
static void test_bulk_leaves_room(void **state)
{
    static struct tnode a, b;
    static struct kvt_key ks[256];
    struct kvt_wire_msg m;
    unsigned room = 0, cap = 0;
    size_t bulk = 0, plain = 0;

    (void)state;
    for (size_t i = 0; i < 256; i++) {
        uint8_t k64[KVT_KEY_MAX];

        memset(k64, 'k', sizeof(k64));
        memcpy(k64, &i, sizeof(i));
        kvt_key_set(&ks[i], k64, sizeof(k64));
    }
    kvt_wire_msg_init(&m, KVT_WIRE_LOCATE);
    m.u.locate.req_id = 7;
    m.u.locate.n_keys = 256;
    m.u.locate.keys = ks;
    mesh2(&a, &b);
    b.paused = true;
    while (bulk < 1000 && kvt_peers_send_bulk(a.p, 0xB, &m) == 0) {
        bulk++;
        spin();
    }
    assert_int_equal(kvt_tp_send_room(kvt_peers_link(a.p, 0xB), &room, &cap), 0);
    assert_true(bulk > 0 && bulk < 1000);
    assert_true(2 * room <= cap && room > 0);
    assert_int_equal(kvt_peers_send_bulk(a.p, 0xB, &m), -EAGAIN);
    /* Ordinary messages take the other half. */
    while (plain < 1000 && kvt_peers_send(a.p, 0xB, &m) == 0)
        plain++;
    assert_true(plain >= 1 && plain == room);
    /* B reads again: every message arrives, and bulk goes again. */
    b.paused = false;
    assert_true(WAIT_FOR(5000, b.n_msgs == bulk + plain));
    assert_true(WAIT_FOR(5000, kvt_peers_send_bulk(a.p, 0xB, &m) == 0));
    node_stop(&b);
    node_stop(&a);
}

/* B heartbeats every 200 ms; A calls a member down after 4 x 40 ms of silence. A
 * waits for the longer silence B says it allows (its HELLO), so neither calls the
 * other down; without that A would call B down between any two of its heartbeats,
 * over and over. */
static void test_slower_heartbeats_do_not_flap(void **state)
{
    static struct tnode a, b;
    uint16_t pa[2] = {0, 0};
    struct kvt_peers_counts ca, cb;

    (void)state;
    node_start(&a, 0xA, NULL);
    pa[0] = kvt_peers_port(a.p);
    node_start_hb(&b, 0xB, good_secret, "test-ns", pa, 200, HB_MISSES);
    assert_true(WAIT_FOR(5000, live(&a) == 2 && live(&b) == 2));
    run_for(2000);
    kvt_peers_counts(a.p, &ca);
    kvt_peers_counts(b.p, &cb);
    assert_int_equal(ca.members_down, 0);
    assert_int_equal(cb.members_down, 0);
    assert_true(live(&a) == 2 && live(&b) == 2);
    node_stop(&b);
    node_stop(&a);
}

/* B heartbeats every 2 s and says so; A calls a member down after 4 x 40 ms of
 * silence and allows a slower member at most 8 times that (1.28 s): it calls B down
 * anyway, and says so, rather than wait for whatever a peer declares (a stalled node
 * that said it may stay silent for days would be asked for as long). */
static void test_silence_allowance_capped(void **state)
{
    static struct tnode a, b;
    uint16_t pa[2] = {0, 0};

    (void)state;
    node_start(&a, 0xA, NULL);
    pa[0] = kvt_peers_port(a.p);
    node_start_hb(&b, 0xB, good_secret, "test-ns", pa, 2000, HB_MISSES);
    assert_true(WAIT_FOR(5000, live(&a) == 2));
    assert_true(WAIT_FOR(4000, has_event(&a, KVT_MEMBER_DOWN_EV, 0xB)));
    node_stop(&b);
    node_stop(&a);
}

/* B is destroyed (A: on_link_closed, DOWN) and re-created with a new incarnation
 * (A: RESTARTED or JOINED), and traffic flows again. */
static void test_restart_and_link_closed(void **state)
{
    static struct tnode a, b;
    uint16_t pa[2] = {0, 0};
    uint64_t old_inc;
    struct kvt_peers_counts c;
    struct kvt_key k = kt_key(7);
    struct kvt_wire_msg m = locate(7, &k);
    const struct kvt_member *x;
    size_t n_closed;

    (void)state;
    mesh2(&a, &b);
    old_inc = kvt_peers_incarnation(b.p);
    assert_int_equal(a.n_link_closed, 0);
    node_stop(&b);
    assert_true(WAIT_FOR(5000, has_event(&a, KVT_MEMBER_DOWN_EV, 0xB)));
    assert_false(linked(&a, 0xB));
    assert_int_equal(live(&a), 1);
    kvt_peers_counts(a.p, &c);
    assert_true(a.n_link_closed >= 1);
    assert_int_equal(a.n_link_closed, c.links_closed);
    assert_int_equal(c.members_down, 1); /* the connection, not silence */
    assert_int_equal(c.members_silent, 0);
    for (size_t i = 0; i < a.n_link_closed; i++)
        assert_int_equal(a.link_closed_ids[i], 0xB);
    n_closed = a.n_link_closed;

    pa[0] = kvt_peers_port(a.p);
    node_start(&b, 0xB, pa);
    assert_true(kvt_peers_incarnation(b.p) > old_inc);
    assert_true(WAIT_FOR(5000, linked(&a, 0xB) && linked(&b, 0xA) && live(&a) == 2));
    assert_true(has_event(&a, KVT_MEMBER_RESTARTED, 0xB) ||
                has_event(&a, KVT_MEMBER_JOINED, 0xB)); /* JOINED earlier is the first life */
    x = kvt_members_find(kvt_peers_members(a.p), 0xB);
    assert_non_null(x);
    assert_int_equal(x->incarnation, kvt_peers_incarnation(b.p));
    assert_int_equal(x->state, KVT_MEMBER_ALIVE);
    assert_int_equal(kvt_peers_send(a.p, 0xB, &m), 0);
    assert_true(WAIT_FOR(3000, b.n_msgs == 1));
    assert_int_equal(b.last_from, 0xA);
    assert_int_equal(a.n_link_closed, n_closed);

    /* Destroying a node closes its authenticated links: one call each. */
    kvt_peers_counts(b.p, &c);
    node_stop(&b);
    assert_true(WAIT_FOR(5000, !linked(&a, 0xB)));
    assert_true(a.n_link_closed > n_closed);
    node_stop(&a);
    assert_true(a.n_link_closed >= n_closed + 1);
}

/* A raw peer completes the handshake by hand, then sends garbage: counted as
 * malformed, the link and the other traffic go on. */
static void test_malformed_after_auth(void **state)
{
    static struct tnode a, b;
    static struct raw r;
    struct kvt_wire_msg m;
    struct kvt_peers_counts c;
    const uint64_t raw_id = 0x77;
    struct kvt_key k = kt_key(3);
    static const uint8_t not_a_frame[] = {0xde, 0xad, 0xbe, 0xef, 0x00};
    static const uint8_t bad_body[] = {0, 0, 0, 3, 0xc1, 0xc1, 0xc1};
    static const uint8_t truncated_map[] = {0, 0, 0, 5, 0xdf, 0xff, 0xff, 0xff, 0xff};
    static uint8_t deep[4 + 2000];
    size_t b_msgs;

    (void)state;
    mesh2(&a, &b);
    raw_open(&r, kvt_peers_port(a.p));
    raw_handshake(&r, &a, raw_id, 1, NULL);
    assert_true(WAIT_FOR(3000, r.n_by_type[KVT_WIRE_HEARTBEAT] >= 1)); /* A treats it as a peer */

    /* Garbage: not a frame; a frame of invalid msgpack; a truncated map; too deep;
     * a handshake message after the handshake. */
    assert_int_equal(kvt_tp_send(r.ep, not_a_frame, sizeof(not_a_frame)), 0);
    assert_int_equal(kvt_tp_send(r.ep, bad_body, sizeof(bad_body)), 0);
    assert_int_equal(kvt_tp_send(r.ep, truncated_map, sizeof(truncated_map)), 0);
    deep[0] = 0, deep[1] = 0, deep[2] = (2000 >> 8) & 0xff, deep[3] = 2000 & 0xff;
    memset(deep + 4, 0x91, 2000);
    assert_int_equal(kvt_tp_send(r.ep, deep, sizeof(deep)), 0);
    kvt_wire_msg_init(&m, KVT_WIRE_HELLO);
    m.u.hello.node_id = raw_id;
    m.u.hello.incarnation = 1;
    ns_of("test-ns", m.u.hello.ns);
    assert_int_equal(raw_send(&r, &m), 0);
    /* then a good message on the same link */
    m = locate(99, &k);
    assert_int_equal(raw_send(&r, &m), 0);
    assert_true(WAIT_FOR(3000, a.n_msgs == 1));
    assert_int_equal(a.last_from, raw_id);
    assert_int_equal(a.last_type, KVT_WIRE_LOCATE);
    assert_int_equal(a.last_req, 99);
    kvt_peers_counts(a.p, &c);
    assert_int_equal(c.malformed, 5);
    assert_int_equal(c.refused, 0);
    assert_true(linked(&a, raw_id));
    assert_false(r.closed);

    /* B's traffic with A is unaffected. */
    b_msgs = b.n_msgs;
    m = locate(100, &k);
    assert_int_equal(kvt_peers_send(a.p, 0xB, &m), 0);
    assert_true(WAIT_FOR(3000, b.n_msgs == b_msgs + 1));
    assert_int_equal(b.last_req, 100);
    assert_true(live(&a) >= 2);

    /* The raw peer goes away: A reports that authenticated link closed. */
    raw_close(&r);
    assert_true(WAIT_FOR(5000, !linked(&a, raw_id)));
    assert_true(a.n_link_closed >= 1);
    assert_int_equal(a.link_closed_ids[0], raw_id);
    node_stop(&b);
    node_stop(&a);
}

/* A member's new link says whether it called this node's life down and dropped its
 * records (wire 1.5, HELLO_ACK and AUTH). X (a raw peer) links to A. A second link
 * whose AUTH says X dropped nothing changes nothing: that is what a link racing the
 * first one up says, which wire 1.4's "which life do you hold live" answered with
 * "none" (X did not hold A yet) and A took for a drop. Nor does a link that says
 * nothing (an older node). One that names A's life (X called A down after a stall of
 * A's, and A has not read the old link's close) makes A see KVT_MEMBER_DROPPED_US
 * for X, counted, so that it publishes again what X dropped. */
static void test_new_link_says_we_were_dropped(void **state)
{
    static struct tnode a;
    static struct raw r1, r2, r3, r4, r5, r6, r7;
    const uint64_t x = 0x77, zero = 0;
    uint64_t a_inc;
    struct kvt_wire_msg ack;
    struct kvt_peers_counts c;

    (void)state;
    /* Slow heartbeats: the raw peer sends none, and must stay live meanwhile. */
    node_start_hb(&a, 0xA, good_secret, "test-ns", NULL, 1000, 10);
    a_inc = kvt_peers_incarnation(a.p);
    raw_open(&r1, kvt_peers_port(a.p));
    ack = raw_handshake(&r1, &a, x, 5, &zero);
    assert_true(ack.has & KVT_WIRE_HAS(KVT_WIRE_F_DROPPED));
    assert_int_equal(ack.u.hello.dropped_inc, 0); /* A did not know X */
    assert_true(has_event(&a, KVT_MEMBER_JOINED, x));

    raw_open(&r2, kvt_peers_port(a.p));
    ack = raw_handshake(&r2, &a, x, 5, &zero);
    assert_int_equal(ack.u.hello.dropped_inc, 0); /* A holds X live */
    raw_open(&r3, kvt_peers_port(a.p));
    (void)raw_handshake(&r3, &a, x, 5, NULL);
    run_for(50);
    assert_false(has_event(&a, KVT_MEMBER_DROPPED_US, x));
    kvt_peers_counts(a.p, &c);
    assert_int_equal(c.lost_our_records, 0);

    raw_open(&r4, kvt_peers_port(a.p));
    (void)raw_handshake(&r4, &a, x, 5, &a_inc);
    assert_true(WAIT_FOR(1000, has_event(&a, KVT_MEMBER_DROPPED_US, x)));
    kvt_peers_counts(a.p, &c);
    assert_int_equal(c.lost_our_records, 1);
    assert_false(has_event(&a, KVT_MEMBER_DOWN_EV, x)); /* X stays live */

    /* Wire 1.6 numbers the drops: two links naming X's third drop of A (as two links
     * racing up while X has A down do) count once; its fourth counts again. */
    raw_open(&r5, kvt_peers_port(a.p));
    (void)raw_handshake_seq(&r5, &a, x, 5, &a_inc, 3);
    assert_true(WAIT_FOR(1000, (kvt_peers_counts(a.p, &c), c.lost_our_records == 2)));
    raw_open(&r6, kvt_peers_port(a.p));
    (void)raw_handshake_seq(&r6, &a, x, 5, &a_inc, 3);
    run_for(50);
    kvt_peers_counts(a.p, &c);
    assert_int_equal(c.lost_our_records, 2);
    raw_open(&r7, kvt_peers_port(a.p));
    (void)raw_handshake_seq(&r7, &a, x, 5, &a_inc, 4);
    assert_true(WAIT_FOR(1000, (kvt_peers_counts(a.p, &c), c.lost_our_records == 3)));
    raw_close(&r7);
    raw_close(&r6);
    raw_close(&r5);
    raw_close(&r4);
    raw_close(&r3);
    raw_close(&r2);
    raw_close(&r1);
    node_stop(&a);
}

/* What A's handshakes say of a member: X's life A called down (X went silent) and
 * has not held live since is named in every HELLO_ACK until a link to it comes up
 * again; then, and of a life A never called down, the field says 0. */
static void test_handshake_names_the_life_it_dropped(void **state)
{
    static struct tnode a;
    static struct raw r1, r2, r3, r4, r5;
    const uint64_t x = 0x78, zero = 0;
    uint8_t nonce[KVT_AUTH_NONCE_BYTES];
    struct kvt_wire_msg ack;

    (void)state;
    /* Quick heartbeats: the raw peer sends none, so A calls it down. */
    node_start_hb(&a, 0xA, good_secret, "test-ns", NULL, 200, 3);
    raw_open(&r1, kvt_peers_port(a.p));
    ack = raw_handshake(&r1, &a, x, 9, &zero);
    assert_int_equal(ack.u.hello.dropped_inc, 0);
    assert_true(WAIT_FOR(5000, has_event(&a, KVT_MEMBER_DOWN_EV, x)));
    assert_true(WAIT_FOR(2000, r1.closed)); /* down closes every link to that life */

    /* Two links race up: both HELLO_ACKs are sent while X is down at A. */
    raw_open(&r2, kvt_peers_port(a.p));
    raw_open(&r3, kvt_peers_port(a.p));
    ack = raw_hello(&r2, &a, x, 9, nonce);
    assert_int_equal(ack.u.hello.dropped_inc, 9);
    assert_true(ack.has & KVT_WIRE_HAS(KVT_WIRE_F_DROP_SEQ));
    assert_int_equal(ack.u.hello.drop_seq, 1); /* both name A's first drop of X */
    ack = raw_handshake(&r3, &a, x, 9, &zero);
    assert_int_equal(ack.u.hello.dropped_inc, 9);
    assert_int_equal(ack.u.hello.drop_seq, 1);
    /* X is live at A again: a later link hears 0. */
    raw_open(&r4, kvt_peers_port(a.p));
    ack = raw_handshake(&r4, &a, x, 9, &zero);
    assert_int_equal(ack.u.hello.dropped_inc, 0);
    assert_false(ack.has & KVT_WIRE_HAS(KVT_WIRE_F_DROP_SEQ));
    /* Silent again, X is called down a second time: the next link names drop 2. */
    assert_true(WAIT_FOR(5000, r4.closed && r3.closed));
    raw_open(&r5, kvt_peers_port(a.p));
    ack = raw_hello(&r5, &a, x, 9, nonce);
    assert_int_equal(ack.u.hello.dropped_inc, 9);
    assert_int_equal(ack.u.hello.drop_seq, 2);
    raw_close(&r5);
    raw_close(&r4);
    raw_close(&r3);
    raw_close(&r2);
    raw_close(&r1);
    node_stop(&a);
}

/* ---- READs and the may_read hook ---- */

static struct {
    bool allow;
    size_t asked;
    uint64_t node, off, len;
    struct kvt_tp_ep *ep;
} g_mr;

static bool hook_may_read(void *arg, uint64_t node_id, struct kvt_tp_ep *ep, struct kvt_tp_mr *mr,
                          uint64_t off, uint64_t len)
{
    (void)arg;
    (void)mr;
    g_mr.asked++;
    g_mr.node = node_id;
    g_mr.ep = ep;
    g_mr.off = off;
    g_mr.len = len;
    return g_mr.allow;
}

struct rd_done {
    int n, status;
};

static void rd_cb(void *arg, int status)
{
    struct rd_done *d = arg;

    d->n++;
    d->status = status;
}

/* B reads A's registration over their link: A's transport asks peers, which asks
 * A's may_read handler with B's node id and the range. Allowed: the bytes arrive.
 * Refused: the READ fails with -EACCES, nothing is written, and A counts it
 * ("peers_net_refused" label "read_grant" in the stats, counts.tp). */
static void test_read_grant_hook(void **state)
{
    static struct tnode a, b;
    const size_t R = 1u << 20;
    uint8_t *region = aligned_alloc(4096, R), *local = aligned_alloc(4096, R);
    uint8_t handle[KVT_TP_MAX_HANDLE_SIZE];
    size_t hlen;
    struct kvt_tp_mr *mr, *lmr;
    struct kvt_tp_rkey *rk;
    struct kvt_tp_ep *ep;
    struct kvt_peers_handlers h;
    struct kvt_peers_counts c;
    struct kvt_stats st;
    struct rd_done d1 = {0}, d2 = {0};
    struct kvt_read_op op1 = {.remote_off = 4096, .local_off = 0, .len = 8192};
    struct kvt_read_op op2 = {.remote_off = 65536, .local_off = 65536, .len = 4096};

    (void)state;
    assert_non_null(region);
    assert_non_null(local);
    for (size_t i = 0; i < R; i++)
        region[i] = (uint8_t)(i * 7 + (i >> 12));
    memset(local, 0xa5, R);
    mesh2(&a, &b);
    h = (struct kvt_peers_handlers){.on_msg = on_msg,
                                    .on_member = on_member,
                                    .on_link_closed = on_link_closed,
                                    .may_read = hook_may_read,
                                    .arg = &a};
    kvt_peers_set_handlers(a.p, &h);
    assert_int_equal(kvt_tp_reg_remote(kvt_peers_transport(a.p), region, R, &mr), 0);
    assert_int_equal(kvt_tp_pack(kvt_peers_transport(a.p), mr, handle, sizeof(handle), &hlen), 0);
    assert_int_equal(kvt_tp_reg_local(kvt_peers_transport(b.p), local, R, &lmr), 0);
    ep = kvt_peers_link(b.p, 0xA);
    assert_non_null(ep);
    assert_int_equal(kvt_tp_unpack(ep, handle, hlen, &rk), 0);

    memset(&g_mr, 0, sizeof(g_mr));
    g_mr.allow = true;
    assert_int_equal(kvt_tp_read(ep, rk, lmr, &op1, 1, rd_cb, &d1), -EINPROGRESS);
    assert_true(WAIT_FOR(5000, d1.n == 1));
    assert_int_equal(d1.status, 0);
    assert_memory_equal(local, region + 4096, 8192);
    assert_int_equal(g_mr.asked, 1);
    assert_int_equal(g_mr.node, 0xB);
    assert_int_equal(g_mr.off, 4096);
    assert_int_equal(g_mr.len, 8192);
    assert_non_null(g_mr.ep);

    g_mr.allow = false;
    assert_int_equal(kvt_tp_read(ep, rk, lmr, &op2, 1, rd_cb, &d2), -EINPROGRESS);
    assert_true(WAIT_FOR(5000, d2.n == 1));
    assert_int_equal(d2.status, -EACCES);
    for (size_t i = 65536; i < 65536 + 4096; i++)
        assert_int_equal(local[i], 0xa5);
    assert_int_equal(g_mr.asked, 2);
    kvt_peers_counts(a.p, &c);
    assert_int_equal(c.tp.refused[KVT_TP_READ_GRANT], 1);
    assert_int_equal(c.tp.refused[KVT_TP_READ_RANGE], 0);
    assert_int_equal(c.tp.refused[KVT_TP_READ_UNAUTH], 0);
    kvt_stats_init(&st);
    assert_int_equal(kvt_peers_get_stats(a.p, &st), 0);
    assert_true(kvt_stats_value(&st, "peers_net_refused", "read_grant") == 1);
    assert_non_null(kvt_stats_find(&st, "peers_net_refused", "unknown_conn"));
    kvt_stats_cleanup(&st);

    kvt_tp_rkey_destroy(kvt_peers_transport(b.p), rk);
    kvt_tp_dereg(lmr, kvt_peers_transport(b.p));
    kvt_tp_dereg(mr, kvt_peers_transport(a.p));
    node_stop(&b);
    node_stop(&a);
    free(region);
    free(local);
}

/* After a failed test: whatever it left registered (its state is static, so the
 * pointers are still good). */
static int teardown(void **state)
{
    (void)state;
    for (size_t i = 0; i < MAX_NODES; i++)
        if (g_raws[i] != NULL)
            raw_close(g_raws[i]);
    for (size_t i = 0; i < MAX_NODES; i++)
        if (g_nodes[i] != NULL)
            node_stop(g_nodes[i]);
    return 0;
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_config_errors, teardown),
        cmocka_unit_test_teardown(test_handshake_and_exchange, teardown),
        cmocka_unit_test_teardown(test_wrong_secret, teardown),
        cmocka_unit_test_teardown(test_other_namespace, teardown),
        cmocka_unit_test_teardown(test_bad_proof, teardown),
        cmocka_unit_test_teardown(test_protocol_before_auth, teardown),
        cmocka_unit_test_teardown(test_handshake_timeout, teardown),
        cmocka_unit_test_teardown(test_members_learned, teardown),
        cmocka_unit_test_teardown(test_silent_peer_down, teardown),
        cmocka_unit_test_teardown(test_bulk_leaves_room, teardown),
        cmocka_unit_test_teardown(test_slower_heartbeats_do_not_flap, teardown),
        cmocka_unit_test_teardown(test_silence_allowance_capped, teardown),
        cmocka_unit_test_teardown(test_restart_and_link_closed, teardown),
        cmocka_unit_test_teardown(test_malformed_after_auth, teardown),
        cmocka_unit_test_teardown(test_new_link_says_we_were_dropped, teardown),
        cmocka_unit_test_teardown(test_handshake_names_the_life_it_dropped, teardown),
        cmocka_unit_test_teardown(test_read_grant_hook, teardown),
    };

    setenv("KVT_UCX_MODE", "socket", 0); /* nodes of hosts without RDMA, as in the cluster tests */
    setenv("UCX_NET_DEVICES", "lo", 0);
    if (getenv("KVT_LOG_LEVEL") == NULL)
        kvt_log_set_level(KVT_LOG_ERROR);
    return cmocka_run_group_tests(tests, NULL, NULL);
}

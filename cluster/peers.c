/* Peer links (kvt/peers.h): handshake, heartbeats, membership, dispatch.
 *
 * Every link is a struct link hung on the endpoint's user pointer, in one array.
 * States: DIALLED (outbound, waiting for CONNECTED), WAIT_HELLO (accepted),
 * WAIT_ACK (HELLO sent), WAIT_AUTH (HELLO_ACK sent), WAIT_OK (AUTH sent), UP,
 * CLOSING (ep_close called, waiting for the transport's CLOSED). A link leaves the
 * array only in the CLOSED callback, so every ep pointer we hold is alive. */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvt/alloc.h"
#include "kvt/clock.h"
#include "kvt/common.h"
#include "kvt/hash.h"
#include "kvt/log.h"
#include "kvt/peers.h"

#define MOD   "peers"
#define MS_NS 1000000ull

enum link_state { L_DIALLED, L_WAIT_HELLO, L_WAIT_ACK, L_WAIT_AUTH, L_WAIT_OK, L_UP, L_CLOSING };

struct link {
    struct kvt_peers *p;
    struct kvt_tp_ep *ep;
    enum link_state state;
    bool outbound;
    int seed; /* index of the seed it was dialled for, or -1 */
    uint64_t peer_id, peer_inc;
    char peer_addr[KVT_MEMBER_ADDR_MAX];
    uint16_t peer_port;
    char dial_addr[KVT_MEMBER_ADDR_MAX];
    uint16_t dial_port;
    uint8_t nonce_c[KVT_AUTH_NONCE_BYTES], nonce_s[KVT_AUTH_NONCE_BYTES];
    uint64_t deadline_ns; /* handshake */
    uint64_t next_hb_ns, hb_seq, last_members_ns;
    bool refused_logged;
    bool was_up; /* reached UP: its closing is reported */
};

struct seed {
    char addr[KVT_MEMBER_ADDR_MAX];
    uint16_t port;
    bool is_self;
};

struct kvt_peers {
    struct kvt_peers_config cfg;
    uint8_t secret[KVT_AUTH_SECRET_MAX];
    struct kvt_transport *tp;
    struct kvt_members *members;
    struct kvt_peers_handlers h;
    uint64_t self, inc;
    uint16_t port;
    char adv_addr[KVT_MEMBER_ADDR_MAX];
    struct seed *seeds;
    size_t n_seeds;
    struct link **links;
    size_t n_links, cap_links;
    struct kvt_wire_buf out;
    uint64_t next_dial_ns;
    struct kvt_peers_counts c, reported;
};

static const char *const reason_names[8] = {"unspec",   "version", "namespace", "auth",
                                            "protocol", "busy",    "shutdown",  "timeout"};
#define R_TIMEOUT 7 /* our own index for handshakes that never finished */

static uint64_t ms(uint32_t v)
{
    return (uint64_t)v * MS_NS;
}

/* ---- helpers ------------------------------------------------------------------- */

static int send_on(struct kvt_peers *p, struct kvt_tp_ep *ep, const struct kvt_wire_msg *m)
{
    int rc;

    kvt_wire_buf_reset(&p->out);
    rc = kvt_wire_encode(m, &p->out);
    if (rc != 0)
        return rc;
    if (p->out.len > p->cfg.transport.max_msg_bytes)
        return -EMSGSIZE;
    return kvt_tp_send(ep, p->out.data, p->out.len);
}

static void link_close(struct link *l)
{
    if (l->state == L_CLOSING)
        return;
    l->state = L_CLOSING;
    kvt_tp_ep_close(l->ep);
}

static void refuse(struct link *l, uint32_t reason, const char *why)
{
    struct kvt_wire_msg m;

    l->p->c.refused++;
    if (reason < 8)
        l->p->c.refused_by_reason[reason]++;
    if (!l->refused_logged)
        kvt_warn(MOD, "refused a peer (%s%s%s): %s", l->outbound ? "dialled " : "from ",
                 l->outbound ? l->dial_addr : "", l->outbound ? "" : "an inbound link", why);
    l->refused_logged = true;
    if (reason != R_TIMEOUT) {
        kvt_wire_msg_init(&m, KVT_WIRE_REFUSE);
        m.u.refuse.reason = reason;
        (void)send_on(l->p, l->ep, &m);
    }
    link_close(l);
}

static void flush_member_events(struct kvt_peers *p)
{
    struct kvt_member_event ev[32];
    size_t n;

    while ((n = kvt_members_take_events(p->members, ev, KVT_ARRAY_SIZE(ev))) > 0) {
        for (size_t i = 0; i < n; i++) {
            if (ev[i].kind == KVT_MEMBER_DOWN_EV) {
                /* Missed heartbeats: its links are dead weight (a stopped process
                 * keeps its sockets); close them. */
                for (size_t j = 0; j < p->n_links; j++) {
                    struct link *l = p->links[j];

                    if (l->state == L_UP && l->peer_id == ev[i].node_id)
                        link_close(l);
                }
            }
            kvt_info(MOD, "member %016" PRIx64 " (incarnation %016" PRIx64 ") %s", ev[i].node_id,
                     ev[i].incarnation,
                     ev[i].kind == KVT_MEMBER_JOINED    ? "joined"
                     : ev[i].kind == KVT_MEMBER_DOWN_EV ? "is down"
                                                        : "restarted");
            if (p->h.on_member != NULL)
                p->h.on_member(p->h.arg, &ev[i]);
        }
    }
}

static uint64_t digest(const struct kvt_peers *p)
{
    uint64_t ids[KVT_MEMBERS_MAX], acc[2 * KVT_MEMBERS_MAX];
    size_t n = kvt_members_live(p->members, ids, KVT_MEMBERS_MAX);

    for (size_t i = 0; i < n; i++) {
        const struct kvt_member *mb = kvt_members_find(p->members, ids[i]);

        acc[2 * i] = ids[i];
        acc[2 * i + 1] = mb != NULL ? mb->incarnation : p->inc;
    }
    return kvt_hash64(acc, n * 2 * sizeof(uint64_t));
}

static struct link *link_add(struct kvt_peers *p, struct kvt_tp_ep *ep, bool outbound)
{
    struct link *l;

    if (p->n_links == p->cap_links) {
        size_t cap = p->cap_links ? p->cap_links * 2 : 8;
        struct link **v = kvt_reallocarray(p->links, cap, sizeof(*v));

        if (v == NULL)
            return NULL;
        p->links = v;
        p->cap_links = cap;
    }
    l = kvt_calloc(1, sizeof(*l));
    if (l == NULL)
        return NULL;
    l->p = p;
    l->ep = ep;
    l->outbound = outbound;
    l->seed = -1;
    l->deadline_ns = kvt_now_ns() + ms(p->cfg.handshake_timeout_ms);
    p->links[p->n_links++] = l;
    if (ep != NULL)
        ep->user = l;
    return l;
}

static void link_remove(struct kvt_peers *p, struct link *l)
{
    for (size_t i = 0; i < p->n_links; i++) {
        if (p->links[i] == l) {
            p->links[i] = p->links[--p->n_links];
            break;
        }
    }
    kvt_free(l);
}

static size_t up_links(const struct kvt_peers *p, uint64_t id)
{
    size_t n = 0;

    for (size_t i = 0; i < p->n_links; i++)
        n += p->links[i]->state == L_UP && p->links[i]->peer_id == id;
    return n;
}

/* ---- the handshake ------------------------------------------------------------- */

static void fill_hello(struct kvt_peers *p, struct kvt_wire_msg *m, enum kvt_wire_type type,
                       const uint8_t *nonce)
{
    kvt_wire_msg_init(m, type);
    m->u.hello.node_id = p->self;
    m->u.hello.incarnation = p->inc;
    memcpy(m->u.hello.ns, p->cfg.ns, KVT_WIRE_BIN32);
    if (nonce != NULL)
        memcpy(m->u.hello.nonce, nonce, KVT_WIRE_BIN32);
    snprintf(m->u.hello.addr, sizeof(m->u.hello.addr), "%s", p->adv_addr);
    m->u.hello.port = p->port;
    m->has |= KVT_WIRE_HAS(KVT_WIRE_F_ADDR) | KVT_WIRE_HAS(KVT_WIRE_F_PORT);
}

static struct kvt_auth_params params(const struct kvt_peers *p, const struct link *l)
{
    struct kvt_auth_params a = {
        .nonce_client = l->nonce_c,
        .nonce_server = l->nonce_s,
        .id_client = l->outbound ? p->self : l->peer_id,
        .id_server = l->outbound ? l->peer_id : p->self,
        .ns = p->cfg.ns,
    };
    return a;
}

static void link_up(struct kvt_peers *p, struct link *l)
{
    int rc;

    l->state = L_UP;
    l->was_up = true;
    l->next_hb_ns = kvt_now_ns();
    p->c.handshakes++;
    rc = kvt_members_heard(p->members, l->peer_id, l->peer_inc, l->peer_addr, l->peer_port,
                           kvt_now_ns());
    if (rc == -ESTALE) {
        kvt_info(MOD, "link from an older life of %016" PRIx64 ": closed", l->peer_id);
        link_close(l);
        return;
    }
    kvt_debug(MOD, "link up with %016" PRIx64 " at %s:%u", l->peer_id, l->peer_addr, l->peer_port);
    flush_member_events(p);
}

static void on_hello(struct kvt_peers *p, struct link *l, const struct kvt_wire_msg *m)
{
    const struct kvt_wire_hello *h = &m->u.hello;
    struct kvt_auth_params a;
    struct kvt_wire_msg r;
    uint8_t proof[KVT_AUTH_PROOF_BYTES];

    if (memcmp(h->ns, p->cfg.ns, KVT_AUTH_NS_BYTES) != 0) {
        refuse(l, KVT_WIRE_R_NAMESPACE, "another namespace");
        return;
    }
    if (h->node_id == p->self) { /* we dialled ourselves through a seed */
        link_close(l);
        return;
    }
    l->peer_id = h->node_id;
    l->peer_inc = h->incarnation;
    memcpy(l->nonce_c, h->nonce, KVT_AUTH_NONCE_BYTES);
    snprintf(l->peer_addr, sizeof(l->peer_addr), "%s", h->addr);
    l->peer_port = h->port;
    if (kvt_auth_nonce(l->nonce_s) != 0) {
        link_close(l);
        return;
    }
    a = params(p, l);
    kvt_auth_proof(p->secret, p->cfg.secret_len, KVT_AUTH_SERVER, &a, proof);
    fill_hello(p, &r, KVT_WIRE_HELLO_ACK, l->nonce_s);
    memcpy(r.u.hello.proof, proof, KVT_AUTH_PROOF_BYTES);
    if (send_on(p, l->ep, &r) != 0) {
        link_close(l);
        return;
    }
    l->state = L_WAIT_AUTH;
}

static void on_hello_ack(struct kvt_peers *p, struct link *l, const struct kvt_wire_msg *m)
{
    const struct kvt_wire_hello *h = &m->u.hello;
    struct kvt_auth_params a;
    struct kvt_wire_msg r;

    if (memcmp(h->ns, p->cfg.ns, KVT_AUTH_NS_BYTES) != 0) {
        refuse(l, KVT_WIRE_R_NAMESPACE, "another namespace");
        return;
    }
    if (h->node_id == p->self) {
        if (l->seed >= 0)
            p->seeds[l->seed].is_self = true; /* do not dial it again */
        link_close(l);
        return;
    }
    l->peer_id = h->node_id;
    l->peer_inc = h->incarnation;
    memcpy(l->nonce_s, h->nonce, KVT_AUTH_NONCE_BYTES);
    snprintf(l->peer_addr, sizeof(l->peer_addr), "%s", h->addr);
    l->peer_port = h->port;
    a = params(p, l);
    if (!(m->has & KVT_WIRE_HAS(KVT_WIRE_F_PROOF)) ||
        !kvt_auth_verify(p->secret, p->cfg.secret_len, KVT_AUTH_SERVER, &a, h->proof,
                         KVT_AUTH_PROOF_BYTES)) {
        refuse(l, KVT_WIRE_R_AUTH, "its proof does not verify (another secret?)");
        return;
    }
    kvt_wire_msg_init(&r, KVT_WIRE_AUTH);
    r.u.hello.node_id = p->self;
    r.u.hello.incarnation = p->inc;
    kvt_auth_proof(p->secret, p->cfg.secret_len, KVT_AUTH_CLIENT, &a, r.u.hello.proof);
    if (send_on(p, l->ep, &r) != 0) {
        link_close(l);
        return;
    }
    l->state = L_WAIT_OK;
}

static void on_auth(struct kvt_peers *p, struct link *l, const struct kvt_wire_msg *m)
{
    struct kvt_auth_params a = params(p, l);
    struct kvt_wire_msg r;

    if (m->u.hello.node_id != l->peer_id || m->u.hello.incarnation != l->peer_inc) {
        refuse(l, KVT_WIRE_R_PROTOCOL, "AUTH names another node than its HELLO");
        return;
    }
    if (!kvt_auth_verify(p->secret, p->cfg.secret_len, KVT_AUTH_CLIENT, &a, m->u.hello.proof,
                         KVT_AUTH_PROOF_BYTES)) {
        refuse(l, KVT_WIRE_R_AUTH, "its proof does not verify (another secret?)");
        return;
    }
    kvt_wire_msg_init(&r, KVT_WIRE_AUTH_OK);
    if (send_on(p, l->ep, &r) != 0) {
        link_close(l);
        return;
    }
    link_up(p, l);
}

/* ---- membership messages ------------------------------------------------------- */

static bool linked_or_dialling(const struct kvt_peers *p, uint64_t id, const char *addr,
                               uint16_t port)
{
    for (size_t i = 0; i < p->n_links; i++) {
        const struct link *l = p->links[i];

        if (l->state == L_CLOSING)
            continue;
        if (id != 0 && l->peer_id == id)
            return true;
        if (l->outbound && l->dial_port == port && strcmp(l->dial_addr, addr) == 0)
            return true;
    }
    return false;
}

static void dial(struct kvt_peers *p, const char *addr, uint16_t port, int seed)
{
    struct kvt_tp_ep *ep = NULL;
    struct link *l = link_add(p, NULL, true);
    int rc;

    if (l == NULL)
        return;
    l->state = L_DIALLED;
    l->seed = seed;
    snprintf(l->dial_addr, sizeof(l->dial_addr), "%s", addr);
    l->dial_port = port;
    rc = kvt_tp_connect(p->tp, addr, port, l, &ep);
    if (rc != 0) {
        kvt_debug(MOD, "dial %s:%u: %s", addr, port, strerror(-rc));
        link_remove(p, l);
        return;
    }
    l->ep = ep;
}

static void send_members(struct kvt_peers *p, struct link *l)
{
    uint64_t ids[KVT_MEMBERS_MAX];
    struct kvt_wire_member v[KVT_MEMBERS_MAX];
    size_t n = kvt_members_live(p->members, ids, KVT_MEMBERS_MAX), k = 0;
    struct kvt_wire_msg m;

    for (size_t i = 0; i < n; i++) {
        const struct kvt_member *mb = kvt_members_find(p->members, ids[i]);

        if (ids[i] == p->self) {
            v[k] = (struct kvt_wire_member){
                .node_id = p->self, .incarnation = p->inc, .port = p->port};
            snprintf(v[k++].addr, KVT_WIRE_ADDR_MAX, "%s", p->adv_addr);
        } else if (mb != NULL) {
            v[k] = (struct kvt_wire_member){
                .node_id = mb->node_id, .incarnation = mb->incarnation, .port = mb->port};
            snprintf(v[k++].addr, KVT_WIRE_ADDR_MAX, "%s", mb->addr);
        }
    }
    kvt_wire_msg_init(&m, KVT_WIRE_MEMBERS);
    m.u.members.n = (uint32_t)k;
    m.u.members.v = v;
    (void)send_on(p, l->ep, &m);
    l->last_members_ns = kvt_now_ns();
}

static void on_heartbeat(struct kvt_peers *p, struct link *l, const struct kvt_wire_msg *m)
{
    const struct kvt_wire_heartbeat *hb = &m->u.heartbeat;

    if (hb->node_id != l->peer_id || hb->incarnation != l->peer_inc) {
        p->c.malformed++;
        return;
    }
    kvt_members_heard(p->members, l->peer_id, l->peer_inc, l->peer_addr, l->peer_port,
                      kvt_now_ns());
    flush_member_events(p);
    if ((m->has & KVT_WIRE_HAS(KVT_WIRE_F_DIGEST)) && hb->digest != digest(p) &&
        kvt_now_ns() - l->last_members_ns >= ms(p->cfg.heartbeat_ms))
        send_members(p, l);
}

static void on_members(struct kvt_peers *p, const struct kvt_wire_msg *m)
{
    for (uint32_t i = 0; i < m->u.members.n; i++) {
        const struct kvt_wire_member *mb = &m->u.members.v[i];

        if (mb->node_id == p->self || mb->port == 0 || mb->addr[0] == '\0')
            continue;
        if (!linked_or_dialling(p, mb->node_id, mb->addr, mb->port))
            dial(p, mb->addr, mb->port, -1);
    }
}

/* ---- transport callbacks ------------------------------------------------------- */

static int cb_accept(void *arg, struct kvt_tp_ep *ep)
{
    struct kvt_peers *p = arg;
    struct link *l = link_add(p, ep, false);

    if (l == NULL)
        return -ENOMEM;
    l->state = L_WAIT_HELLO;
    return 0;
}

static void cb_state(void *arg, struct kvt_tp_ep *ep, enum kvt_ep_state st, int err)
{
    struct kvt_peers *p = arg;
    struct link *l = ep->user;

    if (l == NULL)
        return;
    if (st == KVT_EP_CONNECTED) {
        struct kvt_wire_msg m;

        l->ep = ep;
        if (kvt_auth_nonce(l->nonce_c) != 0) {
            link_close(l);
            return;
        }
        fill_hello(p, &m, KVT_WIRE_HELLO, l->nonce_c);
        if (send_on(p, ep, &m) != 0) {
            link_close(l);
            return;
        }
        l->state = L_WAIT_ACK;
        l->deadline_ns = kvt_now_ns() + ms(p->cfg.handshake_timeout_ms);
        return;
    }
    /* CLOSED: the ep is freed after we return. */
    if (l->was_up) {
        uint64_t id = l->peer_id;
        const struct kvt_member *mb;

        p->c.links_closed++;
        if (p->h.on_link_closed != NULL)
            p->h.on_link_closed(p->h.arg, id, ep);
        link_remove(p, l);
        mb = kvt_members_find(p->members, id);
        if (up_links(p, id) == 0 && mb != NULL && mb->state == KVT_MEMBER_ALIVE) {
            kvt_info(MOD, "last link to %016" PRIx64 " closed (%s)", id,
                     err ? strerror(-err) : "locally");
            kvt_members_mark_down(p->members, id);
            flush_member_events(p);
        }
        return;
    }
    link_remove(p, l);
}

static void cb_msg(void *arg, struct kvt_tp_ep *ep, const void *buf, size_t len)
{
    struct kvt_peers *p = arg;
    struct link *l = ep->user;
    const uint8_t *body;
    size_t blen;
    struct kvt_wire_msg m;
    int rc;

    if (l == NULL || l->state == L_CLOSING)
        return;
    rc = kvt_wire_unframe(buf, len, &p->cfg.limits, &body, &blen);
    if (rc == 0)
        rc = kvt_wire_decode(body, blen, &p->cfg.limits, &m);
    if (rc != 0) {
        if (l->state != L_UP) {
            refuse(l, rc == -EPROTO ? KVT_WIRE_R_VERSION : KVT_WIRE_R_PROTOCOL,
                   "a malformed handshake message");
            return;
        }
        p->c.malformed++;
        kvt_debug(MOD, "malformed message from %016" PRIx64 " (%zu bytes): %s", l->peer_id, len,
                  strerror(-rc));
        return;
    }
    if (m.type == KVT_WIRE_REFUSE) {
        uint32_t r = m.u.refuse.reason;

        /* The other side refused us: count it here too (both sides see why). */
        p->c.refused++;
        if (r < 8)
            p->c.refused_by_reason[r]++;
        kvt_warn(MOD, "refused by %s: %s", l->outbound ? l->dial_addr : "an inbound peer",
                 r < 8 ? reason_names[r] : "?");
        link_close(l);
        goto out;
    }
    switch (l->state) {
    case L_WAIT_HELLO:
        if (m.type == KVT_WIRE_HELLO)
            on_hello(p, l, &m);
        else
            refuse(l, KVT_WIRE_R_PROTOCOL, "a message before the handshake");
        break;
    case L_WAIT_ACK:
        if (m.type == KVT_WIRE_HELLO_ACK)
            on_hello_ack(p, l, &m);
        else
            refuse(l, KVT_WIRE_R_PROTOCOL, "a message before the handshake");
        break;
    case L_WAIT_AUTH:
        if (m.type == KVT_WIRE_AUTH)
            on_auth(p, l, &m);
        else
            refuse(l, KVT_WIRE_R_PROTOCOL, "a message before the handshake");
        break;
    case L_WAIT_OK:
        if (m.type == KVT_WIRE_AUTH_OK)
            link_up(p, l);
        else
            refuse(l, KVT_WIRE_R_PROTOCOL, "a message before the handshake");
        break;
    case L_UP:
        switch (m.type) {
        case KVT_WIRE_HELLO:
        case KVT_WIRE_HELLO_ACK:
        case KVT_WIRE_AUTH:
        case KVT_WIRE_AUTH_OK:
            p->c.malformed++; /* a handshake replayed on an authenticated link */
            break;
        case KVT_WIRE_HEARTBEAT:
            on_heartbeat(p, l, &m);
            break;
        case KVT_WIRE_MEMBERS:
            on_members(p, &m);
            break;
        default:
            if (p->h.on_msg != NULL)
                p->h.on_msg(p->h.arg, l->peer_id, ep, &m);
            break;
        }
        break;
    default:
        break;
    }
out:
    kvt_wire_msg_free(&m);
}

/* ---- public API ---------------------------------------------------------------- */

static int parse_hostport(const char *s, char *addr, size_t cap, uint16_t *port)
{
    const char *colon = strrchr(s, ':');
    char *end;
    unsigned long v;
    size_t n;

    if (colon == NULL || colon == s)
        return -EINVAL;
    v = strtoul(colon + 1, &end, 10);
    if (*end != '\0' || v == 0 || v > 65535)
        return -EINVAL;
    n = (size_t)(colon - s);
    if (s[0] == '[' && n >= 2 && s[n - 1] == ']')
        s++, n -= 2;
    if (n == 0 || n >= cap)
        return -EINVAL;
    memcpy(addr, s, n);
    addr[n] = '\0';
    *port = (uint16_t)v;
    return 0;
}

int kvt_peers_create(const struct kvt_peers_config *cfg, struct kvt_peers **p_p)
{
    struct kvt_peers *p;
    struct kvt_transport_config tc;
    int rc;

    if (cfg == NULL || p_p == NULL || cfg->node_id == 0 || cfg->listen_addr == NULL) {
        kvt_error(MOD, "config: node_id and listen_addr are required");
        return -EINVAL;
    }
    if (cfg->secret == NULL || cfg->secret_len < KVT_AUTH_SECRET_MIN ||
        cfg->secret_len > KVT_AUTH_SECRET_MAX) {
        kvt_error(MOD, "config: the secret must be %d..%d bytes", KVT_AUTH_SECRET_MIN,
                  KVT_AUTH_SECRET_MAX);
        return -EINVAL;
    }
    p = kvt_calloc(1, sizeof(*p));
    if (p == NULL)
        return -ENOMEM;
    p->cfg = *cfg;
    memcpy(p->secret, cfg->secret, cfg->secret_len);
    p->cfg.secret = p->secret;
    if (p->cfg.heartbeat_ms == 0)
        p->cfg.heartbeat_ms = 500;
    if (p->cfg.heartbeat_misses == 0)
        p->cfg.heartbeat_misses = 4;
    if (p->cfg.handshake_timeout_ms == 0)
        p->cfg.handshake_timeout_ms = 3000;
    kvt_wire_limits_default(&p->cfg.limits);
    p->h = cfg->h;
    p->self = cfg->node_id;
    p->inc = cfg->incarnation;
    while (p->inc == 0) { /* a fresh life: random, never 0 */
        uint8_t r[KVT_AUTH_NONCE_BYTES];

        if (kvt_auth_nonce(r) != 0) {
            kvt_free(p);
            return -EIO;
        }
        memcpy(&p->inc, r, sizeof(p->inc));
    }
    snprintf(p->adv_addr, sizeof(p->adv_addr), "%s",
             cfg->advertise_addr ? cfg->advertise_addr : cfg->listen_addr);
    kvt_wire_buf_init(&p->out);
    p->seeds = kvt_calloc(cfg->n_seeds ? cfg->n_seeds : 1, sizeof(*p->seeds));
    if (p->seeds == NULL) {
        kvt_free(p);
        return -ENOMEM;
    }
    for (size_t i = 0; i < cfg->n_seeds; i++) {
        if (parse_hostport(cfg->seeds[i], p->seeds[i].addr, sizeof(p->seeds[i].addr),
                           &p->seeds[i].port) != 0) {
            kvt_error(MOD, "config: peer '%s' is not host:port", cfg->seeds[i]);
            kvt_free(p->seeds);
            kvt_free(p);
            return -EINVAL;
        }
    }
    p->n_seeds = cfg->n_seeds;
    rc = kvt_members_create(p->self, p->inc, ms(p->cfg.heartbeat_ms), p->cfg.heartbeat_misses,
                            &p->members);
    if (rc != 0)
        goto fail;
    tc = cfg->transport;
    kvt_transport_config_defaults(&tc);
    tc.cb = (struct kvt_tp_callbacks){
        .on_accept = cb_accept, .on_ep_state = cb_state, .on_msg = cb_msg, .arg = p};
    p->cfg.transport = tc;
    rc = kvt_tp_open(&tc, &p->tp);
    if (rc != 0) {
        kvt_error(MOD, "transport %s: %s", tc.backend ? tc.backend : "?", strerror(-rc));
        goto fail;
    }
    rc = kvt_tp_listen(p->tp, cfg->listen_addr, cfg->listen_port, &p->port);
    if (rc != 0) {
        kvt_error(MOD, "listen on %s:%u: %s", cfg->listen_addr, cfg->listen_port, strerror(-rc));
        goto fail;
    }
    *p_p = p;
    return 0;
fail:
    if (p->tp != NULL)
        kvt_tp_close(p->tp);
    if (p->members != NULL)
        kvt_members_destroy(p->members);
    kvt_wire_buf_cleanup(&p->out);
    kvt_free(p->seeds);
    kvt_free(p);
    return rc;
}

void kvt_peers_destroy(struct kvt_peers *p)
{
    if (p == NULL)
        return;
    p->h = (struct kvt_peers_handlers){0};
    kvt_tp_close(p->tp); /* CLOSED callbacks remove every link */
    for (size_t i = 0; i < p->n_links; i++)
        kvt_free(p->links[i]);
    kvt_free(p->links);
    kvt_members_destroy(p->members);
    kvt_wire_buf_cleanup(&p->out);
    kvt_free(p->seeds);
    kvt_free(p);
}

void kvt_peers_set_handlers(struct kvt_peers *p, const struct kvt_peers_handlers *h)
{
    if (h == NULL)
        p->h = (struct kvt_peers_handlers){0};
    else
        p->h = *h;
}

uint64_t kvt_peers_self(const struct kvt_peers *p)
{
    return p->self;
}
uint64_t kvt_peers_incarnation(const struct kvt_peers *p)
{
    return p->inc;
}
uint16_t kvt_peers_port(const struct kvt_peers *p)
{
    return p->port;
}
struct kvt_transport *kvt_peers_transport(struct kvt_peers *p)
{
    return p->tp;
}
const struct kvt_members *kvt_peers_members(const struct kvt_peers *p)
{
    return p->members;
}

int kvt_peers_progress(struct kvt_peers *p)
{
    uint64_t now, d;
    int rc = kvt_tp_progress(p->tp);

    now = kvt_now_ns();
    d = digest(p);
    for (size_t i = 0; i < p->n_links; i++) {
        struct link *l = p->links[i];

        if (l->state == L_UP) {
            if (now >= l->next_hb_ns) {
                struct kvt_wire_msg m;

                kvt_wire_msg_init(&m, KVT_WIRE_HEARTBEAT);
                m.u.heartbeat.node_id = p->self;
                m.u.heartbeat.incarnation = p->inc;
                m.u.heartbeat.seq = ++l->hb_seq;
                m.u.heartbeat.digest = d;
                m.has |= KVT_WIRE_HAS(KVT_WIRE_F_DIGEST);
                (void)send_on(p, l->ep, &m); /* -EAGAIN: the next one will do */
                l->next_hb_ns = now + ms(p->cfg.heartbeat_ms);
            }
        } else if (l->state != L_CLOSING && l->state != L_DIALLED && now >= l->deadline_ns) {
            refuse(l, R_TIMEOUT, "the handshake did not finish in time");
        } else if (l->state == L_DIALLED &&
                   now >= l->deadline_ns + ms(p->cfg.transport.connect_timeout_ms)) {
            link_close(l); /* the transport's connect timeout should have fired */
        }
    }
    kvt_members_tick(p->members, now);
    flush_member_events(p);
    if (now >= p->next_dial_ns) {
        /* Seeds we are not linked to, and members we know of but lost. */
        for (size_t i = 0; i < p->n_seeds; i++) {
            if (!p->seeds[i].is_self &&
                !linked_or_dialling(p, 0, p->seeds[i].addr, p->seeds[i].port)) {
                bool known = false;

                /* A seed already linked under its id (it dialled us) is skipped. */
                for (size_t j = 0; j < p->n_links; j++) {
                    const struct link *l = p->links[j];

                    if (l->state == L_UP && l->peer_port == p->seeds[i].port &&
                        strcmp(l->peer_addr, p->seeds[i].addr) == 0)
                        known = true;
                }
                if (!known)
                    dial(p, p->seeds[i].addr, p->seeds[i].port, (int)i);
            }
        }
        {
            uint64_t ids[KVT_MEMBERS_MAX];
            size_t n = kvt_members_live(p->members, ids, KVT_MEMBERS_MAX);

            for (size_t i = 0; i < n; i++) {
                const struct kvt_member *mb = kvt_members_find(p->members, ids[i]);

                if (mb != NULL && ids[i] != p->self && mb->port != 0 &&
                    !linked_or_dialling(p, mb->node_id, mb->addr, mb->port))
                    dial(p, mb->addr, mb->port, -1);
            }
        }
        p->next_dial_ns = now + ms(p->cfg.heartbeat_ms);
    }
    return rc;
}

int kvt_peers_event_fd(struct kvt_peers *p)
{
    return kvt_tp_event_fd(p->tp);
}

int kvt_peers_arm(struct kvt_peers *p)
{
    return kvt_tp_arm(p->tp);
}

int kvt_peers_next_timeout_ms(const struct kvt_peers *p)
{
    return (int)p->cfg.heartbeat_ms;
}

size_t kvt_peers_live(const struct kvt_peers *p, uint64_t *ids, size_t max)
{
    return kvt_members_live(p->members, ids, max);
}

struct kvt_tp_ep *kvt_peers_link(struct kvt_peers *p, uint64_t node_id)
{
    for (size_t i = 0; i < p->n_links; i++) {
        if (p->links[i]->state == L_UP && p->links[i]->peer_id == node_id)
            return p->links[i]->ep;
    }
    return NULL;
}

int kvt_peers_send(struct kvt_peers *p, uint64_t node_id, const struct kvt_wire_msg *m)
{
    struct kvt_tp_ep *ep = kvt_peers_link(p, node_id);

    return ep == NULL ? -ENOTCONN : send_on(p, ep, m);
}

int kvt_peers_reply(struct kvt_peers *p, struct kvt_tp_ep *ep, const struct kvt_wire_msg *m)
{
    const struct link *l = ep != NULL ? ep->user : NULL;

    if (l == NULL || l->state != L_UP)
        return -ENOTCONN;
    return send_on(p, ep, m);
}

int kvt_peers_link_peer(struct kvt_peers *p, struct kvt_tp_ep *ep, uint64_t *node_id_p,
                        uint64_t *incarnation_p)
{
    const struct link *l = ep != NULL ? ep->user : NULL;

    (void)p;
    if (l == NULL || l->state != L_UP)
        return -ENOTCONN;
    *node_id_p = l->peer_id;
    *incarnation_p = l->peer_inc;
    return 0;
}

int kvt_peers_get_stats(struct kvt_peers *p, struct kvt_stats *out)
{
    struct kvt_peers_counts *c = &p->c, *r = &p->reported;
    uint64_t ids[KVT_MEMBERS_MAX];
    size_t n_up = 0;
    int rc = 0;

    if (c->handshakes > r->handshakes)
        rc |= kvt_stats_increase(out, "kvtier_peers_handshakes", NULL,
                                 (double)(c->handshakes - r->handshakes));
    for (int i = 0; i < 8; i++) {
        if (c->refused_by_reason[i] > r->refused_by_reason[i])
            rc |= kvt_stats_increase(out, "kvtier_peers_refused", reason_names[i],
                                     (double)(c->refused_by_reason[i] - r->refused_by_reason[i]));
    }
    if (c->malformed > r->malformed)
        rc |= kvt_stats_increase(out, "kvtier_peers_malformed", NULL,
                                 (double)(c->malformed - r->malformed));
    if (c->links_closed > r->links_closed)
        rc |= kvt_stats_increase(out, "kvtier_peers_links_closed", NULL,
                                 (double)(c->links_closed - r->links_closed));
    *r = *c;
    for (size_t i = 0; i < p->n_links; i++)
        n_up += p->links[i]->state == L_UP;
    rc |= kvt_stats_set_gauge(out, "kvtier_peers_live", NULL,
                              (double)kvt_members_live(p->members, ids, KVT_MEMBERS_MAX));
    rc |= kvt_stats_set_gauge(out, "kvtier_peers_links", NULL, (double)n_up);
    return rc != 0 ? -ENOMEM : 0;
}

void kvt_peers_counts(const struct kvt_peers *p, struct kvt_peers_counts *out)
{
    *out = p->c;
}

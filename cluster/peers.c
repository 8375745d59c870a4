/* SPDX-License-Identifier: Apache-2.0 */
/* Peer links (see kvt/peers.h): one transport, a list of links, the member table.
 *
 * Link states:
 *   DIALING     client: kvt_tp_connect issued, waiting for the transport's CONNECTED
 *   HELLO_SENT  client: HELLO sent, waiting for HELLO_ACK
 *   AUTH_SENT   client: AUTH sent, waiting for AUTH_OK
 *   WAIT_HELLO  server: accepted, waiting for HELLO
 *   WAIT_AUTH   server: HELLO_ACK sent, waiting for AUTH
 *   UP          authenticated: heartbeats, MEMBERS, on_msg. Each side authorizes
 *               its transport endpoint (the peer may READ our memory from then on)
 *               as soon as the peer has proven the secret: the client once the
 *               server's proof in HELLO_ACK checked out and its AUTH is sent, the
 *               server before it sends AUTH_OK (a client may READ as soon as it
 *               has AUTH_OK). Nothing of ours that names memory goes out earlier.
 *   LINGER      refused: REFUSE sent; waiting for the peer to close (a force close
 *               right away could drop the REFUSE), at most PEERS_LINGER_NS
 *   CLOSING     kvt_tp_ep_close called; waiting for the transport's CLOSED
 * A link struct lives from connect/accept to the transport's CLOSED callback (ep->user
 * points at it until then), so a close decided here never frees anything by itself.
 * on_link_closed fires exactly once, when a link leaves UP, whichever side closed.
 *
 * The handshake deadline covers every pre-UP state except DIALING (the transport's
 * connect timeout covers that one: a node that is not there is no refusal).
 *
 * Membership: a link that becomes UP, and every message on it, is "heard" in the
 * member table (with the link's incarnation; -ESTALE means the link belongs to an
 * older life of that node and it is closed). The last UP link of a member closing
 * marks it down, and a member marked down for any cause (missed heartbeats too) has
 * every link to that life closed: down is never one-sided. One timer (every
 * heartbeat_ms) sends heartbeats, ticks the table and re-dials seeds and members
 * without any link. Events are drained from the table right after each change, so
 * on_member sees them before the next message. Each HELLO says how long its sender
 * lets a member stay silent; a member is given the longer of that and ours (at most
 * PEERS_SILENCE_MAX times ours).
 *
 * The digest of the member list is XXH3 over the sorted (id, incarnation) pairs of
 * the live members, ourselves included: two nodes with the same view compute the
 * same digest. It is cached by the table's epoch.
 *
 * The member table offers no iteration, so the ids ever heard are kept in known[]
 * (at most KVT_MEMBERS_MAX, like the table) for the re-dials. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvt/alloc.h"
#include "kvt/clock.h"
#include "kvt/common.h"
#include "kvt/hash.h"
#include "kvt/list.h"
#include "kvt/log.h"
#include "kvt/peers.h"

#define MOD               "peers"
#define PEERS_MAX_LINKS   (4 * KVT_MEMBERS_MAX)
#define PEERS_LINGER_NS   (250ull * 1000000ull)
#define NS_PER_MS         1000000ull
#define PEERS_SILENCE_MAX 8 /* a member's silence allowance, at most ours times this */

enum link_state {
    LINK_DIALING,
    LINK_HELLO_SENT,
    LINK_AUTH_SENT,
    LINK_WAIT_HELLO,
    LINK_WAIT_AUTH,
    LINK_UP,
    LINK_LINGER,
    LINK_CLOSING,
};

/* One connection. Owned by p->links from connect/accept until the transport's
 * CLOSED callback; everything here is the loop thread's. */
struct peer_link {
    struct kvt_list node; /* p->links, oldest first */
    struct kvt_peers *p;
    struct kvt_tp_ep *ep;
    enum link_state state;
    bool client;
    bool logged;          /* a refusal or malformed message was logged for this link */
    int seed;             /* index of the seed dialled, or -1 */
    uint64_t target_id;   /* the member dialled (client), 0 if unknown */
    uint64_t deadline_ns; /* handshake or linger deadline, 0 = none */
    uint64_t peer_id, peer_inc;
    char peer_addr[KVT_WIRE_ADDR_MAX]; /* where the peer listens ("" unknown) */
    uint16_t peer_port;
    uint32_t peer_down_after_ms; /* the silence the peer allows a member (0 unknown) */
    /* Our incarnation the peer called down and has not held live since, from its
     * HELLO_ACK or AUTH (wire 1.5), or 0; and which of its drops of us that is (wire
     * 1.6; 0 unknown). */
    uint64_t peer_dropped, peer_drop_seq;
    char dial_addr[KVT_WIRE_ADDR_MAX]; /* client: what we dialled */
    uint16_t dial_port;
    uint8_t nonce_c[KVT_AUTH_NONCE_BYTES], nonce_s[KVT_AUTH_NONCE_BYTES];
    uint64_t hb_seq;
    uint64_t members_sent_ns;
};

struct peers_seed {
    char host[KVT_WIRE_ADDR_MAX];
    uint16_t port;
};

/* Everything belongs to the loop thread. Owns the transport, the member table, the
 * links, the seeds and a copy of the secret (wiped on destroy). */
struct kvt_peers {
    uint64_t self, incarnation;
    uint8_t ns[KVT_AUTH_NS_BYTES];
    uint8_t secret[KVT_AUTH_SECRET_MAX];
    size_t secret_len;
    char listen_addr[KVT_WIRE_ADDR_MAX];
    char advertise[KVT_WIRE_ADDR_MAX];
    uint16_t port;           /* listened on */
    uint16_t advertise_port; /* told to peers: port, or the configured one */
    struct peers_seed *seeds;
    size_t n_seeds;
    uint64_t hb_ns, hs_ns, linger_ns;
    struct kvt_wire_limits lim;
    size_t max_msg;
    struct kvt_peers_handlers h;
    struct kvt_transport *tp;
    struct kvt_members *members;
    struct kvt_list links;
    size_t n_links, n_up;
    uint64_t next_tick_ns;
    uint64_t digest, digest_epoch;
    bool digest_valid;
    bool destroying;
    uint64_t known[KVT_MEMBERS_MAX];
    size_t n_known;
    struct kvt_wire_buf buf;
    struct kvt_wire_member mlist[KVT_MEMBERS_MAX + 1];
    struct kvt_peers_counts counts, reported;
};

static const char *reason_name(uint32_t r)
{
    switch (r) {
    case KVT_WIRE_R_VERSION:
        return "version";
    case KVT_WIRE_R_NAMESPACE:
        return "namespace";
    case KVT_WIRE_R_AUTH:
        return "auth";
    case KVT_WIRE_R_PROTOCOL:
        return "protocol";
    case KVT_WIRE_R_BUSY:
        return "busy";
    case KVT_WIRE_R_SHUTDOWN:
        return "shutdown";
    case KVT_WIRE_R_NOT_FOUND:
        return "not_found";
    case KVT_PEERS_R_TIMEOUT:
        return "timeout";
    default:
        return "unspec";
    }
}

static uint64_t fresh_incarnation(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* ---- member table helpers ---- */

static void link_close(struct kvt_peers *p, struct peer_link *l);

/* Closes every link to that life of node_id, whatever its state. A member we call
 * down must learn it: its last link to us closing makes it call us down as well,
 * and both sides then see the other join again. Without that, a member we called
 * down for missed heartbeats (a stalled process, heartbeats behind READ responses)
 * is heard again on the link it never lost, and never learns that the homes here
 * dropped its directory records when it went down: it does not publish them again,
 * and its chunks stay unfindable until its periodic republication. */
static void close_links_of(struct kvt_peers *p, uint64_t node_id, uint64_t incarnation)
{
    struct kvt_list *pos, *tmp;

    kvt_list_for_each_safe(pos, tmp, &p->links)
    {
        struct peer_link *l = kvt_list_entry(pos, struct peer_link, node);

        if (l->peer_id == node_id && l->peer_inc == incarnation && l->state != LINK_CLOSING &&
            l->state != LINK_LINGER)
            link_close(p, l);
    }
}

/* Delivers the member table's events; returns how many were DOWN. */
static size_t flush_events(struct kvt_peers *p)
{
    struct kvt_member_event ev[16];
    size_t n, downs = 0;

    while ((n = kvt_members_take_events(p->members, ev, KVT_ARRAY_SIZE(ev))) > 0)
        for (size_t i = 0; i < n && !p->destroying; i++) {
            if (p->h.on_member != NULL)
                p->h.on_member(p->h.arg, &ev[i]);
            if (ev[i].kind == KVT_MEMBER_DOWN_EV) {
                downs++;
                p->counts.members_down++;
                close_links_of(p, ev[i].node_id, ev[i].incarnation);
            }
        }
    return downs;
}

static void remember(struct kvt_peers *p, uint64_t id)
{
    for (size_t i = 0; i < p->n_known; i++)
        if (p->known[i] == id)
            return;
    if (p->n_known < KVT_ARRAY_SIZE(p->known))
        p->known[p->n_known++] = id;
}

static uint64_t digest(struct kvt_peers *p)
{
    uint64_t ids[KVT_MEMBERS_MAX + 1];
    uint64_t epoch = kvt_members_epoch(p->members);
    uint64_t h = 0;
    size_t n;

    if (p->digest_valid && p->digest_epoch == epoch)
        return p->digest;
    n = kvt_members_live(p->members, ids, KVT_ARRAY_SIZE(ids));
    for (size_t i = 0; i < n; i++) {
        const struct kvt_member *m = kvt_members_find(p->members, ids[i]);
        uint64_t pair[2] = {ids[i], m != NULL ? m->incarnation : p->incarnation};

        h = kvt_hash64_seed(pair, sizeof(pair), h);
    }
    p->digest = h;
    p->digest_epoch = epoch;
    p->digest_valid = true;
    return h;
}

/* ---- sending ---- */

/* Encodes m into p->buf and sends it on l. */
static int send_msg(struct kvt_peers *p, struct peer_link *l, const struct kvt_wire_msg *m)
{
    int ret;

    kvt_wire_buf_reset(&p->buf);
    ret = kvt_wire_encode(m, &p->buf);
    if (ret < 0)
        return ret;
    if (p->buf.len - KVT_WIRE_FRAME_HDR > p->lim.max_frame || p->buf.len > p->max_msg)
        return -EMSGSIZE;
    return kvt_tp_send(l->ep, p->buf.data, p->buf.len);
}

static void send_heartbeat(struct kvt_peers *p, struct peer_link *l)
{
    struct kvt_wire_msg m;
    int ret;

    kvt_wire_msg_init(&m, KVT_WIRE_HEARTBEAT);
    m.has = KVT_WIRE_HAS(KVT_WIRE_F_DIGEST);
    m.u.heartbeat = (struct kvt_wire_heartbeat){
        .node_id = p->self, .incarnation = p->incarnation, .seq = ++l->hb_seq, .digest = digest(p)};
    ret = send_msg(p, l, &m);
    if (ret < 0 && ret != -EAGAIN)
        kvt_debug(MOD, "heartbeat to %llu: %s", (unsigned long long)l->peer_id, strerror(-ret));
}

static void send_members(struct kvt_peers *p, struct peer_link *l, uint64_t now)
{
    uint64_t ids[KVT_MEMBERS_MAX + 1];
    struct kvt_wire_msg m;
    size_t n, k = 0;
    int ret;

    n = kvt_members_live(p->members, ids, KVT_ARRAY_SIZE(ids));
    for (size_t i = 0; i < n; i++) {
        struct kvt_wire_member *w = &p->mlist[k];

        if (ids[i] == p->self) {
            *w = (struct kvt_wire_member){
                .node_id = p->self, .incarnation = p->incarnation, .port = p->advertise_port};
            snprintf(w->addr, sizeof(w->addr), "%s", p->advertise);
        } else {
            const struct kvt_member *x = kvt_members_find(p->members, ids[i]);

            if (x == NULL || x->port == 0 || x->addr[0] == '\0')
                continue; /* nobody could dial it */
            *w = (struct kvt_wire_member){
                .node_id = x->node_id, .incarnation = x->incarnation, .port = x->port};
            snprintf(w->addr, sizeof(w->addr), "%s", x->addr);
        }
        k++;
    }
    kvt_wire_msg_init(&m, KVT_WIRE_MEMBERS);
    m.u.members = (struct kvt_wire_members){.n = (uint32_t)k, .v = p->mlist};
    ret = send_msg(p, l, &m);
    if (ret == 0)
        l->members_sent_ns = now;
    else if (ret != -EAGAIN)
        kvt_debug(MOD, "members to %llu: %s", (unsigned long long)l->peer_id, strerror(-ret));
}

/* ---- link lifetime ---- */

static bool has_other_up(struct kvt_peers *p, struct peer_link *l)
{
    struct kvt_list *pos, *tmp;

    kvt_list_for_each_safe(pos, tmp, &p->links)
    {
        struct peer_link *o = kvt_list_entry(pos, struct peer_link, node);

        if (o != l && o->state == LINK_UP && o->peer_id == l->peer_id)
            return true;
    }
    return false;
}

/* The link leaves UP (set to next): the owner drops what names its ep, the member
 * goes down if this was its last link. */
static void leave_up(struct kvt_peers *p, struct peer_link *l, enum link_state next)
{
    l->state = next;
    p->n_up--;
    p->counts.links_closed++;
    if (p->h.on_link_closed != NULL)
        p->h.on_link_closed(p->h.arg, l->peer_id, l->ep);
    if (!p->destroying && !has_other_up(p, l)) {
        const struct kvt_member *x = kvt_members_find(p->members, l->peer_id);

        if (x != NULL && x->incarnation == l->peer_inc)
            kvt_members_mark_down(p->members, l->peer_id);
        flush_events(p);
    }
}

static void link_close(struct kvt_peers *p, struct peer_link *l)
{
    if (l->state == LINK_CLOSING)
        return;
    if (l->state == LINK_UP)
        leave_up(p, l, LINK_CLOSING);
    l->state = LINK_CLOSING;
    l->deadline_ns = 0;
    kvt_tp_ep_close(l->ep);
}

static void count_refusal(struct kvt_peers *p, struct peer_link *l, uint32_t reason,
                          const char *what)
{
    unsigned idx = reason < KVT_ARRAY_SIZE(p->counts.refused_by_reason) ? reason : 0;

    p->counts.refused++;
    p->counts.refused_by_reason[idx]++;
    if (!l->logged) {
        l->logged = true;
        kvt_warn(MOD, "%s link (peer %llu, %s:%u): %s %s", l->client ? "outgoing" : "incoming",
                 (unsigned long long)l->peer_id, l->client ? KVT_LOG_STR(l->dial_addr) : "?",
                 l->client ? l->dial_port : 0, what, reason_name(idx));
    }
}

/* We refuse the peer: REFUSE{reason}, then linger until it closes. */
static void refuse(struct kvt_peers *p, struct peer_link *l, uint32_t reason)
{
    struct kvt_wire_msg m;

    count_refusal(p, l, reason, "refused:");
    kvt_wire_msg_init(&m, KVT_WIRE_REFUSE);
    m.u.refuse.reason = reason;
    if (send_msg(p, l, &m) != 0) {
        link_close(p, l);
        return;
    }
    l->state = LINK_LINGER;
    l->deadline_ns = kvt_now_ns() + p->linger_ns;
}

static struct peer_link *link_alloc(struct kvt_peers *p, bool client)
{
    struct peer_link *l;

    if (p->n_links >= PEERS_MAX_LINKS)
        return NULL;
    l = kvt_calloc(1, sizeof(*l));
    if (l == NULL)
        return NULL;
    l->p = p;
    l->client = client;
    l->seed = -1;
    kvt_list_add_tail(&p->links, &l->node);
    p->n_links++;
    return l;
}

static void link_free(struct kvt_peers *p, struct peer_link *l)
{
    kvt_list_del(&l->node);
    p->n_links--;
    kvt_free(l);
}

static void dial(struct kvt_peers *p, const char *host, uint16_t port, int seed, uint64_t target)
{
    struct peer_link *l = link_alloc(p, true);
    int ret;

    if (l == NULL)
        return;
    l->state = LINK_DIALING;
    l->seed = seed;
    l->target_id = target;
    snprintf(l->dial_addr, sizeof(l->dial_addr), "%s", host);
    l->dial_port = port;
    ret = kvt_tp_connect(p->tp, host, port, l, &l->ep);
    if (ret < 0) {
        kvt_debug(MOD, "connect %s:%u: %s", KVT_LOG_STR(host), port, strerror(-ret));
        link_free(p, l);
    }
}

/* Any link (not closing) that is, or is being dialled as, node id. */
static bool has_link_to(struct kvt_peers *p, uint64_t id)
{
    struct kvt_list *pos, *tmp;

    kvt_list_for_each_safe(pos, tmp, &p->links)
    {
        struct peer_link *l = kvt_list_entry(pos, struct peer_link, node);

        if (l->state != LINK_CLOSING && l->state != LINK_LINGER &&
            (l->peer_id == id || l->target_id == id))
            return true;
    }
    return false;
}

/* ---- handshake ---- */

static bool ns_equal(const struct kvt_peers *p, const struct kvt_wire_hello *h)
{
    return memcmp(p->ns, h->ns, KVT_AUTH_NS_BYTES) == 0;
}

static void auth_params(const struct kvt_peers *p, const struct peer_link *l,
                        struct kvt_auth_params *ap)
{
    *ap = (struct kvt_auth_params){
        .nonce_client = l->nonce_c,
        .nonce_server = l->nonce_s,
        .id_client = l->client ? p->self : l->peer_id,
        .id_server = l->client ? l->peer_id : p->self,
        .ns = p->ns,
    };
}

static void fill_hello(const struct kvt_peers *p, struct kvt_wire_msg *m, enum kvt_wire_type type,
                       const uint8_t *nonce)
{
    kvt_wire_msg_init(m, type);
    m->has = KVT_WIRE_HAS(KVT_WIRE_F_ADDR) | KVT_WIRE_HAS(KVT_WIRE_F_PORT);
    m->u.hello.node_id = p->self;
    m->u.hello.incarnation = p->incarnation;
    memcpy(m->u.hello.ns, p->ns, KVT_AUTH_NS_BYTES);
    memcpy(m->u.hello.nonce, nonce, KVT_AUTH_NONCE_BYTES);
    snprintf(m->u.hello.addr, sizeof(m->u.hello.addr), "%s", p->advertise);
    m->u.hello.port = p->advertise_port;
    m->has |= KVT_WIRE_HAS(KVT_WIRE_F_DOWN_AFTER);
    m->u.hello.down_after_ms =
        (uint32_t)KVT_MIN(kvt_members_down_after_ns(p->members) / NS_PER_MS, UINT32_MAX);
}

static void record_peer(struct peer_link *l, const struct kvt_wire_msg *m)
{
    l->peer_id = m->u.hello.node_id;
    l->peer_inc = m->u.hello.incarnation;
    if (m->has & KVT_WIRE_HAS(KVT_WIRE_F_DOWN_AFTER))
        l->peer_down_after_ms = m->u.hello.down_after_ms;
    if ((m->has & KVT_WIRE_HAS(KVT_WIRE_F_ADDR)) && (m->has & KVT_WIRE_HAS(KVT_WIRE_F_PORT)) &&
        m->u.hello.port != 0 && m->u.hello.addr[0] != '\0') {
        snprintf(l->peer_addr, sizeof(l->peer_addr), "%s", m->u.hello.addr);
        l->peer_port = m->u.hello.port;
    } else if (l->client) {
        snprintf(l->peer_addr, sizeof(l->peer_addr), "%s", l->dial_addr);
        l->peer_port = l->dial_port;
    }
}

/* HELLO_ACK and AUTH say whether we called the peer's life down and have not held
 * it live since: a peer that only stalled, and still holds us live, learns that we
 * dropped what it published to us, even when this link comes up before it reads the
 * old one's close (link_up). Said from the member's state, not from whether we hold
 * it live now: a second link racing the first one up would say "not held" of a
 * member whose records were never dropped. While the member is down every
 * handshake says so; the first link to come up here was one whose peer had this
 * message already (it answered it), so the peer heard it before the state changes.
 * Every link that races up meanwhile says the same drop: its number (the member's
 * downs) lets the peer act on it once. */
static void fill_dropped(const struct kvt_peers *p, const struct peer_link *l,
                         struct kvt_wire_msg *m)
{
    const struct kvt_member *x = kvt_members_find(p->members, l->peer_id);

    m->has |= KVT_WIRE_HAS(KVT_WIRE_F_DROPPED);
    if (x != NULL && x->incarnation == l->peer_inc && x->state == KVT_MEMBER_DOWN) {
        m->has |= KVT_WIRE_HAS(KVT_WIRE_F_DROP_SEQ);
        m->u.hello.dropped_inc = l->peer_inc;
        m->u.hello.drop_seq = x->downs;
    } else {
        m->u.hello.dropped_inc = 0;
    }
}

static void record_dropped(struct peer_link *l, const struct kvt_wire_msg *m)
{
    l->peer_dropped = (m->has & KVT_WIRE_HAS(KVT_WIRE_F_DROPPED)) != 0 ? m->u.hello.dropped_inc : 0;
    l->peer_drop_seq = (m->has & KVT_WIRE_HAS(KVT_WIRE_F_DROP_SEQ)) != 0 ? m->u.hello.drop_seq : 0;
}

static void client_connected(struct kvt_peers *p, struct peer_link *l)
{
    struct kvt_wire_msg m;
    int ret;

    ret = kvt_auth_nonce(l->nonce_c);
    if (ret == 0) {
        fill_hello(p, &m, KVT_WIRE_HELLO, l->nonce_c);
        ret = send_msg(p, l, &m);
    }
    if (ret < 0) {
        kvt_warn(MOD, "HELLO to %s:%u: %s", KVT_LOG_STR(l->dial_addr), l->dial_port,
                 strerror(-ret));
        link_close(p, l);
        return;
    }
    l->state = LINK_HELLO_SENT;
    l->deadline_ns = kvt_now_ns() + p->hs_ns;
}

/* Nodes that call a silent member down after different times (network.heartbeat_ms
 * x heartbeat_misses set differently) would flap: the quicker one calls the slower
 * one down between two of its heartbeats, closes its links, and both publish all
 * again. Said once per link; each member is given the longer of the two, but never
 * more than PEERS_SILENCE_MAX times ours: a member that says it may stay silent for
 * days would keep its records and be asked, stalled, for as long. */
static void allow_peer_silence(struct kvt_peers *p, struct peer_link *l)
{
    uint64_t ours = kvt_members_down_after_ns(p->members);
    uint64_t theirs = (uint64_t)l->peer_down_after_ms * NS_PER_MS;
    uint64_t allowed = KVT_MIN(theirs, PEERS_SILENCE_MAX * ours);

    if (l->peer_down_after_ms == 0) { /* a node before wire 1.3 does not say */
        kvt_members_allow_silence(p->members, l->peer_id, 0);
        return;
    }
    if (theirs != ours)
        kvt_warn(MOD,
                 "node %llu calls a silent member down after %u ms, this node after %llu ms "
                 "and gives it %llu: set network.heartbeat_ms and network.heartbeat_misses "
                 "alike on every node",
                 (unsigned long long)l->peer_id, l->peer_down_after_ms,
                 (unsigned long long)(ours / NS_PER_MS),
                 (unsigned long long)(KVT_MAX(allowed, ours) / NS_PER_MS));
    kvt_members_allow_silence(p->members, l->peer_id, allowed > ours ? allowed : 0);
}

static void link_up(struct kvt_peers *p, struct peer_link *l)
{
    struct kvt_list *pos, *tmp;
    uint64_t now = kvt_now_ns();
    bool was_live = kvt_members_is_live(p->members, l->peer_id, l->peer_inc);
    int ret;

    ret = kvt_members_heard(p->members, l->peer_id, l->peer_inc,
                            l->peer_addr[0] != '\0' ? l->peer_addr : NULL, l->peer_port, now);
    if (ret < 0) {
        kvt_warn(MOD, "link to node %llu (incarnation %llu) dropped: %s",
                 (unsigned long long)l->peer_id, (unsigned long long)l->peer_inc,
                 ret == -ESTALE ? "an older incarnation than known" : strerror(-ret));
        flush_events(p);
        link_close(p, l);
        return;
    }
    remember(p, l->peer_id);
    allow_peer_silence(p, l);
    /* Both sides authorized their end during the handshake (see the states above);
     * again here, a no-op, so that no path reaches UP unauthorized. */
    ret = kvt_tp_ep_authorize(l->ep);
    if (ret < 0) {
        kvt_warn(MOD, "link to node %llu: authorize: %s", (unsigned long long)l->peer_id,
                 strerror(-ret));
        link_close(p, l);
        return;
    }
    l->state = LINK_UP;
    l->deadline_ns = 0;
    p->n_up++;
    p->counts.handshakes++;
    kvt_debug(MOD, "link to node %llu (incarnation %llu) is up", (unsigned long long)l->peer_id,
              (unsigned long long)l->peer_inc);
    /* Links to an older life of this node are gone with it. */
    kvt_list_for_each_safe(pos, tmp, &p->links)
    {
        struct peer_link *o = kvt_list_entry(pos, struct peer_link, node);

        if (o != l && o->state == LINK_UP && o->peer_id == l->peer_id && o->peer_inc < l->peer_inc)
            link_close(p, o);
    }
    /* A member we held live all along says it called us down (we stalled) and
     * dropped our records, and we have not read its old link's close yet (that
     * would have called it down here too). A drop another link told of already was
     * acted on; one heard while the member was not live is acted on by its joining
     * (the network tier publishes to a member that joins). */
    if (l->peer_dropped != 0 && l->peer_dropped == p->incarnation &&
        kvt_members_heard_drop(p->members, l->peer_id, l->peer_inc, l->peer_drop_seq) && was_live) {
        kvt_info(MOD, "node %llu had called this node down (its new link says so)",
                 (unsigned long long)l->peer_id);
        p->counts.lost_our_records++;
        kvt_members_note_dropped_us(p->members, l->peer_id, l->peer_inc);
    }
    flush_events(p);
    if (l->state == LINK_UP)
        send_heartbeat(p, l);
}

/* A message on a link that is not UP yet. rc: the decoder's result. */
static void handshake_msg(struct kvt_peers *p, struct peer_link *l, int rc,
                          const struct kvt_wire_msg *m)
{
    struct kvt_auth_params ap;
    struct kvt_wire_msg out;
    int ret;

    if (rc < 0) {
        refuse(p, l, rc == -EPROTO ? KVT_WIRE_R_VERSION : KVT_WIRE_R_PROTOCOL);
        return;
    }
    if (m->type == KVT_WIRE_REFUSE) {
        count_refusal(p, l, m->u.refuse.reason, "refused by the peer:");
        link_close(p, l);
        return;
    }
    switch (l->state) {
    case LINK_WAIT_HELLO:
        if (m->type != KVT_WIRE_HELLO || m->u.hello.node_id == 0)
            break;
        if (!ns_equal(p, &m->u.hello)) {
            refuse(p, l, KVT_WIRE_R_NAMESPACE);
            return;
        }
        if (m->u.hello.node_id == p->self) {
            link_close(p, l); /* ourselves */
            return;
        }
        record_peer(l, m);
        memcpy(l->nonce_c, m->u.hello.nonce, KVT_AUTH_NONCE_BYTES);
        ret = kvt_auth_nonce(l->nonce_s);
        if (ret == 0) {
            fill_hello(p, &out, KVT_WIRE_HELLO_ACK, l->nonce_s);
            fill_dropped(p, l, &out);
            auth_params(p, l, &ap);
            ret = kvt_auth_proof(p->secret, p->secret_len, KVT_AUTH_SERVER, &ap, out.u.hello.proof);
        }
        if (ret == 0)
            ret = send_msg(p, l, &out);
        if (ret < 0) {
            kvt_warn(MOD, "HELLO_ACK to node %llu: %s", (unsigned long long)l->peer_id,
                     strerror(-ret));
            link_close(p, l);
            return;
        }
        l->state = LINK_WAIT_AUTH;
        return;

    case LINK_HELLO_SENT:
        if (m->type != KVT_WIRE_HELLO_ACK || m->u.hello.node_id == 0)
            break;
        if (!ns_equal(p, &m->u.hello)) {
            refuse(p, l, KVT_WIRE_R_NAMESPACE);
            return;
        }
        if (m->u.hello.node_id == p->self) {
            link_close(p, l); /* we dialled ourselves */
            return;
        }
        record_peer(l, m);
        record_dropped(l, m);
        memcpy(l->nonce_s, m->u.hello.nonce, KVT_AUTH_NONCE_BYTES);
        auth_params(p, l, &ap);
        if (!kvt_auth_verify(p->secret, p->secret_len, KVT_AUTH_SERVER, &ap, m->u.hello.proof,
                             KVT_AUTH_PROOF_BYTES)) {
            refuse(p, l, KVT_WIRE_R_AUTH);
            return;
        }
        kvt_wire_msg_init(&out, KVT_WIRE_AUTH);
        out.u.hello.node_id = p->self;
        out.u.hello.incarnation = p->incarnation;
        fill_dropped(p, l, &out);
        ret = kvt_auth_proof(p->secret, p->secret_len, KVT_AUTH_CLIENT, &ap, out.u.hello.proof);
        if (ret == 0)
            ret = send_msg(p, l, &out);
        /* The server has proven the secret: it may READ ours. Authorizing now, not
         * at AUTH_OK, lets a transport that exchanges its data-plane addresses at
         * authorize (UCX) do so while the server checks our proof; the server's
         * AUTH_OK may travel on that data plane. */
        if (ret == 0)
            ret = kvt_tp_ep_authorize(l->ep);
        if (ret < 0) {
            kvt_warn(MOD, "AUTH to node %llu: %s", (unsigned long long)l->peer_id, strerror(-ret));
            link_close(p, l);
            return;
        }
        l->state = LINK_AUTH_SENT;
        return;

    case LINK_WAIT_AUTH:
        if (m->type != KVT_WIRE_AUTH || m->u.hello.node_id != l->peer_id ||
            m->u.hello.incarnation != l->peer_inc)
            break;
        auth_params(p, l, &ap);
        if (!kvt_auth_verify(p->secret, p->secret_len, KVT_AUTH_CLIENT, &ap, m->u.hello.proof,
                             KVT_AUTH_PROOF_BYTES)) {
            refuse(p, l, KVT_WIRE_R_AUTH);
            return;
        }
        record_dropped(l, m);
        /* Authorized before AUTH_OK goes out: a client may READ as soon as it has
         * it (link_up's own call is then a no-op). */
        ret = kvt_tp_ep_authorize(l->ep);
        if (ret == 0) {
            kvt_wire_msg_init(&out, KVT_WIRE_AUTH_OK);
            ret = send_msg(p, l, &out);
        }
        if (ret < 0) {
            kvt_warn(MOD, "AUTH_OK to node %llu: %s", (unsigned long long)l->peer_id,
                     strerror(-ret));
            link_close(p, l);
            return;
        }
        link_up(p, l);
        return;

    case LINK_AUTH_SENT:
        if (m->type != KVT_WIRE_AUTH_OK)
            break;
        link_up(p, l);
        return;

    default:
        return;
    }
    refuse(p, l, KVT_WIRE_R_PROTOCOL);
}

/* ---- authenticated traffic ---- */

static void malformed(struct kvt_peers *p, struct peer_link *l, const char *why)
{
    p->counts.malformed++;
    if (!l->logged) {
        l->logged = true;
        kvt_warn(MOD, "node %llu sent a malformed message (%s); dropped (logged once per link)",
                 (unsigned long long)l->peer_id, why);
    } else {
        kvt_debug(MOD, "node %llu: malformed message (%s)", (unsigned long long)l->peer_id, why);
    }
}

static void learn_members(struct kvt_peers *p, const struct kvt_wire_members *ms)
{
    for (uint32_t i = 0; i < ms->n; i++) {
        const struct kvt_wire_member *w = &ms->v[i];
        const struct kvt_member *x;

        if (w->node_id == 0 || w->node_id == p->self || w->port == 0 || w->addr[0] == '\0')
            continue;
        x = kvt_members_find(p->members, w->node_id);
        if (x != NULL && x->incarnation > w->incarnation)
            continue; /* an older life than we know */
        if (has_link_to(p, w->node_id))
            continue;
        kvt_debug(MOD, "learned node %llu at %s:%u", (unsigned long long)w->node_id,
                  KVT_LOG_STR(w->addr), w->port);
        dial(p, w->addr, w->port, -1, w->node_id);
    }
}

static void up_msg(struct kvt_peers *p, struct peer_link *l, int rc, const struct kvt_wire_msg *m)
{
    uint64_t now;
    int ret;

    if (rc < 0) {
        malformed(p, l, strerror(-rc));
        return;
    }
    if (m->type < KVT_WIRE_HEARTBEAT) {
        malformed(p, l, kvt_wire_type_name((int)m->type));
        return;
    }
    now = kvt_now_ns();
    ret = kvt_members_heard(p->members, l->peer_id, l->peer_inc, NULL, 0, now);
    flush_events(p);
    if (ret == -ESTALE) {
        link_close(p, l);
        return;
    }
    if (l->state != LINK_UP)
        return;
    switch (m->type) {
    case KVT_WIRE_HEARTBEAT:
        if (m->u.heartbeat.node_id != l->peer_id || m->u.heartbeat.incarnation != l->peer_inc) {
            malformed(p, l, "heartbeat of another node");
            return;
        }
        if ((m->has & KVT_WIRE_HAS(KVT_WIRE_F_DIGEST)) && m->u.heartbeat.digest != digest(p) &&
            (l->members_sent_ns == 0 || now - l->members_sent_ns >= p->hb_ns))
            send_members(p, l, now);
        return;
    case KVT_WIRE_MEMBERS:
        learn_members(p, &m->u.members);
        return;
    default:
        if (p->h.on_msg != NULL)
            p->h.on_msg(p->h.arg, l->peer_id, l->ep, m);
        return;
    }
}

/* ---- transport callbacks ---- */

static int tp_on_accept(void *arg, struct kvt_tp_ep *ep)
{
    struct kvt_peers *p = arg;
    struct peer_link *l = p->destroying ? NULL : link_alloc(p, false);

    if (l == NULL)
        return -EBUSY;
    l->ep = ep;
    l->state = LINK_WAIT_HELLO;
    l->deadline_ns = kvt_now_ns() + p->hs_ns;
    ep->user = l;
    return 0;
}

static void tp_on_ep_state(void *arg, struct kvt_tp_ep *ep, enum kvt_ep_state state, int err)
{
    struct kvt_peers *p = arg;
    struct peer_link *l = ep->user;

    if (l == NULL)
        return;
    if (state == KVT_EP_CONNECTED) {
        if (l->state == LINK_DIALING)
            client_connected(p, l);
        return;
    }
    if (l->state == LINK_UP) {
        kvt_info(MOD, "link to node %llu closed: %s", (unsigned long long)l->peer_id,
                 err != 0 ? strerror(-err) : "by the peer");
        leave_up(p, l, LINK_CLOSING);
    } else if (l->state == LINK_DIALING) {
        kvt_debug(MOD, "connect %s:%u failed: %s", KVT_LOG_STR(l->dial_addr), l->dial_port,
                  strerror(err < 0 ? -err : EPIPE));
    }
    ep->user = NULL;
    link_free(p, l);
}

static void tp_on_msg(void *arg, struct kvt_tp_ep *ep, const void *buf, size_t len)
{
    struct kvt_peers *p = arg;
    struct peer_link *l = ep->user;
    const uint8_t *body;
    size_t blen;
    struct kvt_wire_msg m = {0};
    int rc;

    if (l == NULL || l->state == LINK_LINGER || l->state == LINK_CLOSING ||
        l->state == LINK_DIALING)
        return;
    rc = kvt_wire_unframe(buf, len, &p->lim, &body, &blen);
    if (rc == 0)
        rc = kvt_wire_decode(body, blen, &p->lim, &m);
    if (l->state == LINK_UP)
        up_msg(p, l, rc, &m);
    else
        handshake_msg(p, l, rc, &m);
    if (rc == 0)
        kvt_wire_msg_free(&m);
}

/* The transport asks before it serves a READ: only links that are UP, then the
 * owner's may_read (grants), if any. */
static bool tp_may_read(void *arg, struct kvt_tp_ep *ep, struct kvt_tp_mr *mr, uint64_t off,
                        uint64_t len)
{
    struct kvt_peers *p = arg;
    struct peer_link *l = ep->user;

    if (l == NULL || l->p != p || l->state != LINK_UP || p->destroying)
        return false;
    return p->h.may_read == NULL || p->h.may_read(p->h.arg, l->peer_id, ep, mr, off, len);
}

/* ---- timers ---- */

static bool seed_is_self(const struct kvt_peers *p, const struct peers_seed *s)
{
    return (s->port == p->advertise_port && strcmp(s->host, p->advertise) == 0) ||
           (s->port == p->port && strcmp(s->host, p->listen_addr) == 0);
}

static bool seed_linked(struct kvt_peers *p, size_t i)
{
    const struct peers_seed *s = &p->seeds[i];
    struct kvt_list *pos, *tmp;

    kvt_list_for_each_safe(pos, tmp, &p->links)
    {
        struct peer_link *l = kvt_list_entry(pos, struct peer_link, node);

        if (l->state == LINK_CLOSING || l->state == LINK_LINGER)
            continue;
        if (l->seed == (int)i)
            return true;
        if (l->state == LINK_UP && l->peer_port == s->port && strcmp(l->peer_addr, s->host) == 0)
            return true;
    }
    return false;
}

static void redial(struct kvt_peers *p)
{
    for (size_t i = 0; i < p->n_seeds; i++)
        if (!seed_is_self(p, &p->seeds[i]) && !seed_linked(p, i))
            dial(p, p->seeds[i].host, p->seeds[i].port, (int)i, 0);
    for (size_t i = 0; i < p->n_known; i++) {
        const struct kvt_member *x = kvt_members_find(p->members, p->known[i]);

        if (x != NULL && x->port != 0 && x->addr[0] != '\0' && !has_link_to(p, x->node_id))
            dial(p, x->addr, x->port, -1, x->node_id);
    }
}

static int timers(struct kvt_peers *p, uint64_t now)
{
    struct kvt_list *pos, *tmp;
    int n = 0;

    kvt_list_for_each_safe(pos, tmp, &p->links)
    {
        struct peer_link *l = kvt_list_entry(pos, struct peer_link, node);

        if (l->deadline_ns == 0 || now < l->deadline_ns)
            continue;
        n++;
        if (l->state == LINK_LINGER) {
            link_close(p, l);
        } else if (l->state != LINK_UP && l->state != LINK_CLOSING && l->state != LINK_DIALING) {
            count_refusal(p, l, KVT_PEERS_R_TIMEOUT, "handshake did not finish:");
            link_close(p, l);
        }
    }
    if (now >= p->next_tick_ns) {
        n++;
        p->next_tick_ns = now + p->hb_ns;
        kvt_list_for_each_safe(pos, tmp, &p->links)
        {
            struct peer_link *l = kvt_list_entry(pos, struct peer_link, node);

            if (l->state == LINK_UP)
                send_heartbeat(p, l);
        }
        kvt_members_tick(p->members, now);
        p->counts.members_silent += flush_events(p);
        redial(p);
    }
    return n;
}

/* ---- public ---- */

static int parse_seed(const char *s, struct peers_seed *out)
{
    const char *colon = s != NULL ? strrchr(s, ':') : NULL;
    size_t hlen;
    char *end;
    unsigned long port;

    if (colon == NULL)
        return -EINVAL;
    hlen = (size_t)(colon - s);
    if (hlen == 0 || hlen >= sizeof(out->host) || colon[1] == '\0')
        return -EINVAL;
    errno = 0;
    port = strtoul(colon + 1, &end, 10);
    if (errno != 0 || *end != '\0' || port == 0 || port > 65535)
        return -EINVAL;
    memcpy(out->host, s, hlen);
    out->host[hlen] = '\0';
    if (out->host[0] == '[' && hlen >= 2 && out->host[hlen - 1] == ']') { /* [v6]:port */
        memmove(out->host, out->host + 1, hlen - 2);
        out->host[hlen - 2] = '\0';
    }
    out->port = (uint16_t)port;
    return 0;
}

int kvt_peers_set_seeds(struct kvt_peers *p, const char *const *seeds, size_t n_seeds)
{
    struct peers_seed *next = NULL;
    struct kvt_list *pos, *tmp;

    if (n_seeds > 0 && seeds == NULL)
        return -EINVAL;
    if (n_seeds > 0) {
        next = kvt_calloc(n_seeds, sizeof(*next));
        if (next == NULL)
            return -ENOMEM;
    }
    for (size_t i = 0; i < n_seeds; i++) {
        if (parse_seed(seeds[i], &next[i]) < 0) {
            kvt_error(MOD, "seeds[%zu] \"%s\" is not host:port", i,
                      seeds[i] != NULL ? seeds[i] : "(null)");
            kvt_free(next);
            return -EINVAL;
        }
    }
    /* A link dialled as a seed keeps that seed's new index, or none when the seed is
     * gone (the link itself stays: the peer is a member like any other). */
    kvt_list_for_each_safe(pos, tmp, &p->links)
    {
        struct peer_link *l = kvt_list_entry(pos, struct peer_link, node);
        const struct peers_seed *old;
        int seed = -1;

        if (l->seed < 0 || (size_t)l->seed >= p->n_seeds)
            continue;
        old = &p->seeds[l->seed];
        for (size_t i = 0; i < n_seeds && seed < 0; i++)
            if (next[i].port == old->port && strcmp(next[i].host, old->host) == 0)
                seed = (int)i;
        l->seed = seed;
    }
    kvt_free(p->seeds);
    p->seeds = next;
    p->n_seeds = n_seeds;
    p->next_tick_ns = kvt_now_ns(); /* the next progress dials the new seeds */
    kvt_info(MOD, "%zu seed(s) now", n_seeds);
    return 0;
}

static int check_config(const struct kvt_peers_config *cfg)
{
    if (cfg->node_id == 0) {
        kvt_error(MOD, "config: node_id must not be 0");
        return -EINVAL;
    }
    if (cfg->secret == NULL || cfg->secret_len < KVT_AUTH_SECRET_MIN ||
        cfg->secret_len > KVT_AUTH_SECRET_MAX) {
        kvt_error(MOD, "config: secret must be %d..%d bytes", KVT_AUTH_SECRET_MIN,
                  KVT_AUTH_SECRET_MAX);
        return -EINVAL;
    }
    if (cfg->listen_addr == NULL || cfg->listen_addr[0] == '\0' ||
        strlen(cfg->listen_addr) >= KVT_WIRE_ADDR_MAX) {
        kvt_error(MOD, "config: listen_addr missing or longer than %d bytes",
                  KVT_WIRE_ADDR_MAX - 1);
        return -EINVAL;
    }
    if (cfg->advertise_addr != NULL &&
        (cfg->advertise_addr[0] == '\0' || strlen(cfg->advertise_addr) >= KVT_WIRE_ADDR_MAX)) {
        kvt_error(MOD, "config: advertise_addr empty or longer than %d bytes",
                  KVT_WIRE_ADDR_MAX - 1);
        return -EINVAL;
    }
    if (cfg->n_seeds > 0 && cfg->seeds == NULL) {
        kvt_error(MOD, "config: seeds is NULL with n_seeds %zu", cfg->n_seeds);
        return -EINVAL;
    }
    for (size_t i = 0; i < cfg->n_seeds; i++) {
        struct peers_seed s;

        if (parse_seed(cfg->seeds[i], &s) < 0) {
            kvt_error(MOD, "config: seeds[%zu] \"%s\" is not host:port", i,
                      cfg->seeds[i] != NULL ? cfg->seeds[i] : "(null)");
            return -EINVAL;
        }
    }
    if (cfg->heartbeat_ms > 3600u * 1000u || cfg->handshake_timeout_ms > 3600u * 1000u ||
        cfg->heartbeat_misses > 1000000u) {
        kvt_error(MOD, "config: heartbeat_ms, heartbeat_misses or handshake_timeout_ms too large");
        return -EINVAL;
    }
    return 0;
}

int kvt_peers_create(const struct kvt_peers_config *cfg, struct kvt_peers **p_p)
{
    struct kvt_transport_config tc;
    struct kvt_peers *p;
    unsigned misses;
    int ret;

    if (cfg == NULL || p_p == NULL)
        return -EINVAL;
    ret = check_config(cfg);
    if (ret < 0)
        return ret;
    p = kvt_calloc(1, sizeof(*p));
    if (p == NULL)
        return -ENOMEM;
    kvt_list_init(&p->links);
    kvt_wire_buf_init(&p->buf);
    p->self = cfg->node_id;
    p->incarnation = cfg->incarnation != 0 ? cfg->incarnation : fresh_incarnation();
    memcpy(p->ns, cfg->ns, KVT_AUTH_NS_BYTES);
    memcpy(p->secret, cfg->secret, cfg->secret_len);
    p->secret_len = cfg->secret_len;
    snprintf(p->listen_addr, sizeof(p->listen_addr), "%s", cfg->listen_addr);
    snprintf(p->advertise, sizeof(p->advertise), "%s",
             cfg->advertise_addr != NULL ? cfg->advertise_addr : cfg->listen_addr);
    p->hb_ns = (uint64_t)(cfg->heartbeat_ms != 0 ? cfg->heartbeat_ms : 500) * NS_PER_MS;
    p->hs_ns =
        (uint64_t)(cfg->handshake_timeout_ms != 0 ? cfg->handshake_timeout_ms : 3000) * NS_PER_MS;
    p->linger_ns = KVT_MIN(PEERS_LINGER_NS, p->hs_ns);
    misses = cfg->heartbeat_misses != 0 ? cfg->heartbeat_misses : 4;
    p->lim = cfg->limits;
    kvt_wire_limits_default(&p->lim);
    p->h = cfg->h;

    ret = -ENOMEM;
    if (cfg->n_seeds > 0) {
        p->seeds = kvt_calloc(cfg->n_seeds, sizeof(*p->seeds));
        if (p->seeds == NULL)
            goto err_free;
    }
    for (size_t i = 0; i < cfg->n_seeds; i++)
        (void)parse_seed(cfg->seeds[i], &p->seeds[p->n_seeds++]); /* checked above */

    ret = kvt_members_create(p->self, p->incarnation, p->hb_ns, misses, &p->members);
    if (ret < 0)
        goto err_seeds;

    tc = cfg->transport;
    if (tc.backend == NULL)
        tc.backend = "ucx";
    kvt_transport_config_defaults(&tc);
    tc.cb = (struct kvt_tp_callbacks){.on_accept = tp_on_accept,
                                      .on_ep_state = tp_on_ep_state,
                                      .on_msg = tp_on_msg,
                                      .may_read = tp_may_read,
                                      .arg = p};
    tc.local_addr = p->listen_addr; /* UCX's own tcp interfaces: on that device only */
    p->max_msg = tc.max_msg_bytes;
    ret = kvt_tp_open(&tc, &p->tp);
    if (ret < 0) {
        kvt_error(MOD, "transport \"%s\": %s", tc.backend, strerror(-ret));
        goto err_members;
    }
    ret = kvt_tp_listen(p->tp, p->listen_addr, cfg->listen_port, &p->port);
    if (ret < 0) {
        kvt_error(MOD, "listen on %s:%u: %s", p->listen_addr, cfg->listen_port, strerror(-ret));
        goto err_tp;
    }
    p->advertise_port = cfg->advertise_port != 0 ? cfg->advertise_port : p->port;
    p->next_tick_ns = kvt_now_ns(); /* the first progress dials the seeds */
    kvt_info(MOD, "node %llu (incarnation %llu) listening on %s:%u, known as %s:%u, %zu seed(s)",
             (unsigned long long)p->self, (unsigned long long)p->incarnation, p->listen_addr,
             p->port, p->advertise, p->advertise_port, p->n_seeds);
    *p_p = p;
    return 0;

err_tp:
    kvt_tp_close(p->tp);
err_members:
    kvt_members_destroy(p->members);
err_seeds:
    kvt_free(p->seeds);
err_free:
    kvt_wire_buf_cleanup(&p->buf);
    explicit_bzero(p->secret, sizeof(p->secret));
    kvt_free(p);
    return ret;
}

void kvt_peers_destroy(struct kvt_peers *p)
{
    struct kvt_list *pos, *tmp;

    if (p == NULL)
        return;
    p->destroying = true;
    kvt_list_for_each_safe(pos, tmp, &p->links)
    {
        struct peer_link *l = kvt_list_entry(pos, struct peer_link, node);

        if (l->state == LINK_UP)
            leave_up(p, l, LINK_CLOSING);
    }
    /* Reports CLOSED for every endpoint before it returns (which frees the links). */
    kvt_tp_close(p->tp);
    kvt_list_for_each_safe(pos, tmp, &p->links)
        link_free(p, kvt_list_entry(pos, struct peer_link, node));
    kvt_members_destroy(p->members);
    kvt_free(p->seeds);
    kvt_wire_buf_cleanup(&p->buf);
    explicit_bzero(p->secret, sizeof(p->secret));
    kvt_free(p);
}

void kvt_peers_set_handlers(struct kvt_peers *p, const struct kvt_peers_handlers *h)
{
    if (h != NULL)
        p->h = *h;
    else
        memset(&p->h, 0, sizeof(p->h));
}

uint64_t kvt_peers_self(const struct kvt_peers *p)
{
    return p->self;
}

uint64_t kvt_peers_incarnation(const struct kvt_peers *p)
{
    return p->incarnation;
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
    int n = kvt_tp_progress(p->tp);

    if (n < 0)
        return n;
    return n + timers(p, kvt_now_ns());
}

int kvt_peers_event_fd(struct kvt_peers *p)
{
    return kvt_tp_event_fd(p->tp);
}

int kvt_peers_arm(struct kvt_peers *p)
{
    if (kvt_peers_next_timeout_ms(p) == 0)
        return -EAGAIN;
    return kvt_tp_arm(p->tp);
}

int kvt_peers_next_timeout_ms(const struct kvt_peers *p)
{
    uint64_t now = kvt_now_ns();
    uint64_t next = p->next_tick_ns;
    struct kvt_list *pos, *tmp;

    kvt_list_for_each_safe(pos, tmp, (struct kvt_list *)&p->links)
    {
        const struct peer_link *l = kvt_list_entry(pos, struct peer_link, node);

        if (l->deadline_ns != 0 && l->deadline_ns < next)
            next = l->deadline_ns;
    }
    if (next <= now)
        return 0;
    return (int)KVT_MIN((next - now + NS_PER_MS - 1) / NS_PER_MS, (uint64_t)INT32_MAX);
}

size_t kvt_peers_live(const struct kvt_peers *p, uint64_t *ids, size_t max)
{
    return kvt_members_live(p->members, ids, max);
}

static struct peer_link *oldest_up(struct kvt_peers *p, uint64_t node_id)
{
    struct kvt_list *pos, *tmp;

    kvt_list_for_each_safe(pos, tmp, &p->links)
    {
        struct peer_link *l = kvt_list_entry(pos, struct peer_link, node);

        if (l->state == LINK_UP && l->peer_id == node_id)
            return l;
    }
    return NULL;
}

struct kvt_tp_ep *kvt_peers_link(struct kvt_peers *p, uint64_t node_id)
{
    struct peer_link *l = oldest_up(p, node_id);

    return l != NULL ? l->ep : NULL;
}

/* The link of one of our endpoints, if it is authenticated. */
static struct peer_link *up_link_of(struct kvt_peers *p, struct kvt_tp_ep *ep)
{
    struct peer_link *l;

    if (ep == NULL || ep->tp != p->tp)
        return NULL;
    l = ep->user;
    return l != NULL && l->p == p && l->state == LINK_UP ? l : NULL;
}

static int send_public(struct kvt_peers *p, struct peer_link *l, const struct kvt_wire_msg *m)
{
    if (m == NULL || m->type <= KVT_WIRE_REFUSE || m->type >= KVT_WIRE_TYPE_END)
        return -EINVAL; /* the handshake's messages are ours */
    if (l == NULL)
        return -ENOTCONN;
    return send_msg(p, l, m);
}

int kvt_peers_send(struct kvt_peers *p, uint64_t node_id, const struct kvt_wire_msg *m)
{
    return send_public(p, oldest_up(p, node_id), m);
}

/* Bulk messages leave the link's other half of its send credits to everything else
 * (heartbeats, answers, grants), which a burst would otherwise take to its end. A
 * backend that does not say its room bounds bulk traffic by send alone. */
int kvt_peers_send_bulk(struct kvt_peers *p, uint64_t node_id, const struct kvt_wire_msg *m)
{
    struct peer_link *l = oldest_up(p, node_id);
    unsigned room, cap;

    if (l != NULL && kvt_tp_send_room(l->ep, &room, &cap) == 0 && 2 * room <= cap)
        return -EAGAIN;
    return send_public(p, l, m);
}

int kvt_peers_reply(struct kvt_peers *p, struct kvt_tp_ep *ep, const struct kvt_wire_msg *m)
{
    return send_public(p, up_link_of(p, ep), m);
}

int kvt_peers_link_peer(struct kvt_peers *p, struct kvt_tp_ep *ep, uint64_t *node_id_p,
                        uint64_t *incarnation_p)
{
    struct peer_link *l = up_link_of(p, ep);

    if (l == NULL)
        return -ENOTCONN;
    if (node_id_p != NULL)
        *node_id_p = l->peer_id;
    if (incarnation_p != NULL)
        *incarnation_p = l->peer_inc;
    return 0;
}

/* The transport's refusal counters into p->counts.tp. */
static void peers_tp_counts(struct kvt_peers *p)
{
    (void)kvt_tp_get_counters(p->tp, &p->counts.tp);
}

/* Adds counter name{label} += v, or sets a gauge; keeps the first error in *ret. */
static void stat_put(struct kvt_stats *out, bool gauge, const char *name, const char *label,
                     uint64_t v, int *ret)
{
    int rc = gauge ? kvt_stats_set_gauge(out, name, label, (double)v)
                   : kvt_stats_increase(out, name, label, (double)v);

    if (*ret == 0)
        *ret = rc;
}

int kvt_peers_get_stats(struct kvt_peers *p, struct kvt_stats *out)
{
    /* Always reported (0 included); the others only when they happened. */
    static const uint32_t reasons[] = {KVT_WIRE_R_VERSION, KVT_WIRE_R_NAMESPACE, KVT_WIRE_R_AUTH,
                                       KVT_WIRE_R_PROTOCOL, KVT_PEERS_R_TIMEOUT};
    const struct kvt_peers_counts *c = &p->counts, *r = &p->reported;
    uint64_t ids[KVT_MEMBERS_MAX + 1];
    int ret = 0;

    if (out == NULL)
        return -EINVAL;
    stat_put(out, false, "peers_handshakes", NULL, c->handshakes - r->handshakes, &ret);
    for (uint32_t i = 0; i < KVT_ARRAY_SIZE(c->refused_by_reason); i++) {
        uint64_t d = c->refused_by_reason[i] - r->refused_by_reason[i];
        bool listed = false;

        for (size_t j = 0; j < KVT_ARRAY_SIZE(reasons); j++)
            listed |= reasons[j] == i;
        if (listed || d != 0)
            stat_put(out, false, "peers_refused", reason_name(i), d, &ret);
    }
    stat_put(out, false, "peers_malformed", NULL, c->malformed - r->malformed, &ret);
    peers_tp_counts(p);
    for (unsigned i = 0; i < KVT_TP_N_REFUSALS; i++)
        stat_put(out, false, "peers_net_refused", kvt_tp_refusal_name(i),
                 c->tp.refused[i] - r->tp.refused[i], &ret);
    stat_put(out, false, "peers_links_closed", NULL, c->links_closed - r->links_closed, &ret);
    stat_put(out, false, "peers_members_down", NULL, c->members_down - r->members_down, &ret);
    stat_put(out, false, "peers_members_silent", NULL, c->members_silent - r->members_silent, &ret);
    stat_put(out, false, "peers_lost_our_records", NULL, c->lost_our_records - r->lost_our_records,
             &ret);
    stat_put(out, true, "peers_live", NULL, kvt_members_live(p->members, ids, KVT_ARRAY_SIZE(ids)),
             &ret);
    stat_put(out, true, "peers_links", NULL, p->n_up, &ret);
    if (ret != 0)
        return ret;
    p->reported = p->counts;
    return 0;
}

void kvt_peers_counts(const struct kvt_peers *p, struct kvt_peers_counts *out)
{
    *out = p->counts;
    (void)kvt_tp_get_counters(p->tp, &out->tp);
}

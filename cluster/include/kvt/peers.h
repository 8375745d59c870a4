/* SPDX-License-Identifier: Apache-2.0 */
/* Peer links: the authenticated connections of one node to the
 * others, over one transport, with membership on top.
 *
 * A kvt_peers owns its transport (opened from cfg->transport, with its own
 * callbacks), listens, connects to the seed addresses and to every member it learns
 * of, and runs on every link first of all the handshake:
 *
 *   client -> HELLO     {node_id, incarnation, ns, nonce_c, addr, port}
 *   server -> HELLO_ACK {node_id, incarnation, ns, nonce_s, proof_s, addr, port}
 *   client -> AUTH      {node_id, incarnation, proof_c}
 *   server -> AUTH_OK
 *
 * proofs as in kvt/auth.h (HMAC-SHA256 over both nonces, both ids and the namespace,
 * role-separated). Another major version, another namespace or a proof that does not
 * verify gets REFUSE{reason} and the link is closed; nothing else is sent or accepted
 * on a link before it is authenticated (any other message is refused as PROTOCOL).
 * A handshake that does not finish within handshake_timeout_ms closes the link.
 * Each refusal is counted by reason and logged once per link. A link to ourselves
 * (same node_id) is closed silently.
 *
 * Membership: every authenticated link sends HEARTBEAT{node_id, incarnation, seq,
 * digest of our member list} every heartbeat_ms; a member not heard for
 * heartbeat_misses intervals is DOWN (kvt/members.h), and so is one whose last link
 * closed. A digest that differs from ours is answered with our MEMBERS (at most once
 * an interval per link; both ends do so, so each learns what the other knows), which
 * lists the live members with their listen addresses; members learned so are
 * connected to. A
 * member heard with a newer incarnation is a new member (RESTARTED event). Seeds and
 * down members are re-dialled every heartbeat interval, so a restarted node rejoins.
 *
 * A link becomes UP on our side when the handshake succeeded (client: AUTH_OK
 * received; server: AUTH verified, AUTH_OK sent), and only then is its transport
 * endpoint authorized (kvt_tp_ep_authorize): before, the peer can READ nothing of
 * ours and its messages are bounded by the transport's pre-auth limits. READs of an
 * UP link are put to the may_read handler.
 *
 * Messages after the handshake are decoded here (bounded, kvt/wire.h) and handed to
 * on_msg with the sender's id; a message that does not decode, or one of the
 * handshake's types, is refused and counted (malformed), the link stays up, and the
 * node keeps serving. Several links to one member may exist for a while (both sides
 * dialled); replies go back on the link a request came on (kvt_peers_reply).
 *
 * Threading: one thread, the node's loop. Callbacks run inside kvt_peers_progress.
 */
#ifndef KVT_PEERS_H
#define KVT_PEERS_H

#include <stddef.h>
#include <stdint.h>
#include <stdbool.h>

#include "kvt/auth.h"
#include "kvt/members.h"
#include "kvt/stats.h"
#include "kvt/transport.h"
#include "kvt/wire.h"

struct kvt_peers;

struct kvt_peers_handlers {
    /* An authenticated, decoded message of a type other than the handshake's,
     * HEARTBEAT and MEMBERS (those are handled here). msg is valid during the call. */
    void (*on_msg)(void *arg, uint64_t from, struct kvt_tp_ep *ep, const struct kvt_wire_msg *msg);
    /* A membership change (after the member table changed). */
    void (*on_member)(void *arg, const struct kvt_member_event *ev);
    /* An authenticated link is closing: drop what names ep (rkeys unpacked on it,
     * requests waiting for an answer on it) now; ep is freed after the call. */
    void (*on_link_closed)(void *arg, uint64_t node_id, struct kvt_tp_ep *ep);
    /* May node_id, on its authenticated link ep, READ [off, off + len) of our
     * registration mr? Asked by the transport for every READ request (backends that
     * serve READs in software: UCX), from inside progress: a question, it must not
     * call the transport or kvt_peers_send. Only ever asked for a link that is UP
     * (others are refused before); NULL allows every READ of an UP link. This is
     * where grant-level checking goes (the network tier: only chunks it granted to
     * that node, while the grant lasts). */
    bool (*may_read)(void *arg, uint64_t node_id, struct kvt_tp_ep *ep, struct kvt_tp_mr *mr,
                     uint64_t off, uint64_t len);
    void *arg;
};

struct kvt_peers_config {
    uint64_t node_id;     /* != 0 */
    uint64_t incarnation; /* 0: a fresh one (wall-clock ns: grows across restarts) */
    uint8_t ns[KVT_AUTH_NS_BYTES];
    const uint8_t *secret; /* KVT_AUTH_SECRET_MIN..MAX bytes; copied */
    size_t secret_len;
    const char *listen_addr;    /* "127.0.0.1" */
    uint16_t listen_port;       /* 0: any (kvt_peers_port tells) */
    const char *advertise_addr; /* sent to peers; NULL = listen_addr */
    uint16_t advertise_port;    /* sent to peers; 0 = the port listened on */
    const char *const *seeds;   /* "host:port" */
    size_t n_seeds;
    uint32_t heartbeat_ms;                 /* 0 = 500 */
    uint32_t heartbeat_misses;             /* 0 = 4 */
    uint32_t handshake_timeout_ms;         /* 0 = 3000 */
    struct kvt_wire_limits limits;         /* zero fields: defaults */
    struct kvt_transport_config transport; /* backend, sizes, timeouts; cb is ours */
    struct kvt_peers_handlers h;
};

/* 0, or -EINVAL (bad config: the message names the field), or the transport's
 * open/listen error. */
int kvt_peers_create(const struct kvt_peers_config *cfg, struct kvt_peers **p_p);
/* Closes every link (in-flight READ batches complete with an error first) and the
 * transport. */
void kvt_peers_destroy(struct kvt_peers *p);

/* Replaces the seeds (network.peers at a reload): host:port strings, as in the
 * config. A link to a seed that is gone stays; new seeds are dialled at the next
 * progress. 0, -EINVAL (one is not host:port: nothing changed) or -ENOMEM. */
int kvt_peers_set_seeds(struct kvt_peers *p, const char *const *seeds, size_t n_seeds);

/* Replaces the handlers (the network tier installs itself after the peers exist;
 * NULL restores "none"). */
void kvt_peers_set_handlers(struct kvt_peers *p, const struct kvt_peers_handlers *h);

uint64_t kvt_peers_self(const struct kvt_peers *p);
uint64_t kvt_peers_incarnation(const struct kvt_peers *p);
uint16_t kvt_peers_port(const struct kvt_peers *p);
struct kvt_transport *kvt_peers_transport(struct kvt_peers *p);
const struct kvt_members *kvt_peers_members(const struct kvt_peers *p);

/* Runs the transport's callbacks, the handshakes, heartbeats, member ticks and
 * re-dials. Returns the number of events handled (>= 0) or negative errno. */
int kvt_peers_progress(struct kvt_peers *p);
/* For the loop's poll: the transport's event fd; kvt_peers_arm() returns 0 when it
 * is safe to sleep on it, at most kvt_peers_next_timeout_ms() ms. */
int kvt_peers_event_fd(struct kvt_peers *p);
int kvt_peers_arm(struct kvt_peers *p);
int kvt_peers_next_timeout_ms(const struct kvt_peers *p);

/* Live members' ids including our own, sorted ascending (for placement). */
size_t kvt_peers_live(const struct kvt_peers *p, uint64_t *ids, size_t max);
/* An authenticated link to node_id (the oldest one), or NULL. */
struct kvt_tp_ep *kvt_peers_link(struct kvt_peers *p, uint64_t node_id);
/* Encodes and sends m to node_id on kvt_peers_link. -ENOTCONN: no authenticated
 * link; -EAGAIN: no credit now (retry after progress); -EMSGSIZE; -EINVAL. */
int kvt_peers_send(struct kvt_peers *p, uint64_t node_id, const struct kvt_wire_msg *m);
/* The same for bulk traffic (publications): -EAGAIN already while half of the link's
 * send credits are in use, so a burst never takes the room of heartbeats, answers
 * and grants. */
int kvt_peers_send_bulk(struct kvt_peers *p, uint64_t node_id, const struct kvt_wire_msg *m);
/* The same on one given (authenticated) link. */
int kvt_peers_reply(struct kvt_peers *p, struct kvt_tp_ep *ep, const struct kvt_wire_msg *m);
/* Who is on the other end of an authenticated link: 0 and its id/incarnation, or
 * -ENOTCONN. */
int kvt_peers_link_peer(struct kvt_peers *p, struct kvt_tp_ep *ep, uint64_t *node_id_p,
                        uint64_t *incarnation_p);

/* Counters since the last call (return-and-reset, kvt/stats.h), names
 * "peers_handshakes", "peers_refused" (label = reason: "version", "namespace",
 * "auth", "protocol", "timeout"), "peers_malformed", "peers_links_closed",
 * "peers_net_refused" (what the transport refused before or outside the handshake,
 * label = kvt_tp_refusal_name: "read_unauth", "read_range", "read_grant",
 * "preauth_conns", "preauth_malformed", "preauth_timeout", "unknown_conn"); gauges
 * "peers_live", "peers_links". */
int kvt_peers_get_stats(struct kvt_peers *p, struct kvt_stats *out);

/* Index of refused_by_reason for a handshake that did not finish in time (the wire
 * has no reason for it: nothing is sent). */
#define KVT_PEERS_R_TIMEOUT 8

/* Cumulative counts for tests and the CLI. A refusal is counted on both ends: by
 * the side that refuses and by the side that receives the REFUSE. */
struct kvt_peers_counts {
    uint64_t handshakes, refused, malformed, links_closed;
    /* Members we called down, and of those the ones gone silent (missed heartbeats:
     * a stalled process, heartbeats held up behind READ responses). Each down closes
     * the member's links, and both sides then publish everything again. */
    uint64_t members_down, members_silent;
    /* Members that had called this node down while it held them live (a stall of
     * ours): each makes this node publish everything again (KVT_MEMBER_DROPPED_US). */
    uint64_t lost_our_records;
    uint64_t refused_by_reason[KVT_PEERS_R_TIMEOUT + 1]; /* enum kvt_wire_reason, or
                                                            KVT_PEERS_R_TIMEOUT */
    struct kvt_tp_counters tp; /* the transport's refusals (kvt_tp_get_counters) */
};
void kvt_peers_counts(const struct kvt_peers *p, struct kvt_peers_counts *out);

#endif

/* SPDX-License-Identifier: Apache-2.0 */
/* Cluster membership as one node sees it: the members it has authenticated, their
 * incarnations and when each was last heard from. A member that misses k heartbeat
 * intervals is down; a member heard from with a new incarnation restarted and is a
 * new member (its old life's records and leases are dropped by whoever watches the
 * events). Every change bumps the epoch, which placement caches key on.
 * Scheduler thread only. */
#ifndef KVT_MEMBERS_H
#define KVT_MEMBERS_H

#include <stddef.h>
#include <stdint.h>
#include <stdbool.h>

#define KVT_MEMBER_ADDR_MAX 64
#define KVT_MEMBERS_MAX     256
#define KVT_MEMBERS_EVENTS  1024 /* pending events kept; older ones are dropped */

enum kvt_member_state { KVT_MEMBER_ALIVE, KVT_MEMBER_DOWN };

struct kvt_member {
    uint64_t node_id;
    uint64_t incarnation;
    char addr[KVT_MEMBER_ADDR_MAX];
    uint16_t port;
    enum kvt_member_state state;
    uint64_t last_heard_ns;
    uint64_t down_after_ns; /* silence allowed before down; 0: the table's */
    uint64_t downs;         /* times this table called the incarnation down */
    uint64_t drops_heard;   /* the latest of its downs of our life it told us of */
};

enum kvt_member_event_kind {
    KVT_MEMBER_JOINED,    /* first heard, or back after being down */
    KVT_MEMBER_DOWN_EV,   /* missed k heartbeats */
    KVT_MEMBER_RESTARTED, /* heard with a newer incarnation: old life is gone */
    /* A member we held live all along had called us down (its new link says so): it
     * dropped every record we published to it, and holds us live again. */
    KVT_MEMBER_DROPPED_US,
};

struct kvt_member_event {
    enum kvt_member_event_kind kind;
    uint64_t node_id;
    uint64_t incarnation;     /* the new one (JOINED, RESTARTED) or the lost one (DOWN) */
    uint64_t old_incarnation; /* RESTARTED */
};

struct kvt_members;

int kvt_members_create(uint64_t self_id, uint64_t self_incarnation, uint64_t interval_ns,
                       unsigned k_missed, struct kvt_members **m_p);
void kvt_members_destroy(struct kvt_members *m);

/* An authenticated message from node_id. 0; -ESTALE for an older incarnation than
 * known (ignored); -EINVAL for our own id; -ENOSPC when the table is full. */
int kvt_members_heard(struct kvt_members *m, uint64_t node_id, uint64_t incarnation,
                      const char *addr, uint16_t port, uint64_t now_ns);
/* Marks members down that were not heard within k intervals (down once now is more
 * than k * interval after the last time heard). */
void kvt_members_tick(struct kvt_members *m, uint64_t now_ns);
/* Explicit loss (the connection failed and will not come back by itself). */
void kvt_members_mark_down(struct kvt_members *m, uint64_t node_id);
/* Queues KVT_MEMBER_DROPPED_US for node_id's incarnation (see the kind). */
void kvt_members_note_dropped_us(struct kvt_members *m, uint64_t node_id, uint64_t incarnation);
/* node_id's incarnation says it called our life down, for the drop_seq-th time (its
 * member's downs; 0: it did not say which, a node before wire 1.6). Whether that is
 * news: every link that comes up while it has us down says the same drop, and only
 * the first to tell it here is. A drop of unknown number, or of a member or life
 * not in the table, always is. */
bool kvt_members_heard_drop(struct kvt_members *m, uint64_t node_id, uint64_t incarnation,
                            uint64_t drop_seq);

/* Live node ids including our own, ascending; if more than max are live, the max
 * lowest. Returns the count written. */
size_t kvt_members_live(const struct kvt_members *m, uint64_t *ids, size_t max);
const struct kvt_member *kvt_members_find(const struct kvt_members *m, uint64_t node_id);
bool kvt_members_is_live(const struct kvt_members *m, uint64_t node_id, uint64_t incarnation);
uint64_t kvt_members_epoch(const struct kvt_members *m);
size_t kvt_members_count(const struct kvt_members *m, enum kvt_member_state state);
uint64_t kvt_members_self(const struct kvt_members *m);
/* How long a member may stay silent before it is called down (k intervals). */
uint64_t kvt_members_down_after_ns(const struct kvt_members *m);
/* node_id (a member) may stay silent for ns before it is called down, when that is
 * longer than the table's own limit (a member that heartbeats less often than we
 * do would otherwise be called down over and over); 0: the table's limit again. */
void kvt_members_allow_silence(struct kvt_members *m, uint64_t node_id, uint64_t ns);
/* The longest silence any member is allowed (ours, or a longer allowance): the time
 * within which every node has called a silent member down. */
uint64_t kvt_members_longest_silence_ns(const struct kvt_members *m);
/* Moves pending events to out (at most max), oldest first; returns how many. The
 * ring keeps the newest KVT_MEMBERS_EVENTS: on overflow the oldest are dropped. */
size_t kvt_members_take_events(struct kvt_members *m, struct kvt_member_event *out, size_t max);

#endif

/* SPDX-License-Identifier: Apache-2.0 */
/* Membership table (see kvt/members.h): a small array (clusters are tens of nodes)
 * scanned linearly, and a bounded ring of events that the network tier drains each
 * step. If the ring overflows the oldest events are dropped and the epoch still
 * changes, so consumers that compare epochs notice; the network tier re-derives its
 * state from the table on every epoch change rather than from the events alone. */
#include <errno.h>
#include <stdio.h>
#include <string.h>

#include "kvt/alloc.h"
#include "kvt/common.h"
#include "kvt/log.h"
#include "kvt/members.h"

#define MOD       "members"
#define EVENT_CAP KVT_MEMBERS_EVENTS

struct kvt_members {
    uint64_t self_id, self_incarnation;
    uint64_t interval_ns;
    unsigned k_missed;
    uint64_t epoch;
    size_t n;
    struct kvt_member mem[KVT_MEMBERS_MAX];
    struct kvt_member_event ev[EVENT_CAP];
    size_t ev_head, ev_n;
};

int kvt_members_create(uint64_t self_id, uint64_t self_incarnation, uint64_t interval_ns,
                       unsigned k_missed, struct kvt_members **m_p)
{
    struct kvt_members *m;

    if (interval_ns == 0 || k_missed == 0 || k_missed > UINT64_MAX / interval_ns)
        return -EINVAL;
    m = kvt_calloc(1, sizeof(*m));
    if (m == NULL)
        return -ENOMEM;
    m->self_id = self_id;
    m->self_incarnation = self_incarnation;
    m->interval_ns = interval_ns;
    m->k_missed = k_missed;
    *m_p = m;
    return 0;
}

void kvt_members_destroy(struct kvt_members *m)
{
    kvt_free(m);
}

static void push_event(struct kvt_members *m, enum kvt_member_event_kind kind, uint64_t id,
                       uint64_t inc, uint64_t old_inc)
{
    if (m->ev_n == EVENT_CAP) {
        m->ev_head = (m->ev_head + 1) % EVENT_CAP;
        m->ev_n--;
    }
    m->ev[(m->ev_head + m->ev_n) % EVENT_CAP] = (struct kvt_member_event){kind, id, inc, old_inc};
    m->ev_n++;
    m->epoch++;
}

void kvt_members_note_dropped_us(struct kvt_members *m, uint64_t node_id, uint64_t incarnation)
{
    push_event(m, KVT_MEMBER_DROPPED_US, node_id, incarnation, 0);
}

static struct kvt_member *find(const struct kvt_members *m, uint64_t node_id);

bool kvt_members_heard_drop(struct kvt_members *m, uint64_t node_id, uint64_t incarnation,
                            uint64_t drop_seq)
{
    struct kvt_member *x = find(m, node_id);

    if (drop_seq == 0 || x == NULL || x->incarnation != incarnation)
        return true;
    if (drop_seq <= x->drops_heard)
        return false;
    x->drops_heard = drop_seq;
    return true;
}

static struct kvt_member *find(const struct kvt_members *m, uint64_t node_id)
{
    for (size_t i = 0; i < m->n; i++)
        if (m->mem[i].node_id == node_id)
            return (struct kvt_member *)&m->mem[i];
    return NULL;
}

int kvt_members_heard(struct kvt_members *m, uint64_t node_id, uint64_t incarnation,
                      const char *addr, uint16_t port, uint64_t now_ns)
{
    struct kvt_member *x;

    if (node_id == m->self_id)
        return -EINVAL;
    x = find(m, node_id);
    if (x == NULL) {
        if (m->n == KVT_MEMBERS_MAX)
            return -ENOSPC;
        x = &m->mem[m->n++];
        memset(x, 0, sizeof(*x));
        x->node_id = node_id;
        x->incarnation = incarnation;
        x->state = KVT_MEMBER_ALIVE;
        kvt_info(MOD, "node %llu (incarnation %llu) joined", (unsigned long long)node_id,
                 (unsigned long long)incarnation);
        push_event(m, KVT_MEMBER_JOINED, node_id, incarnation, 0);
    } else if (incarnation < x->incarnation) {
        return -ESTALE;
    } else if (incarnation > x->incarnation) {
        uint64_t old = x->incarnation;

        x->incarnation = incarnation;
        x->state = KVT_MEMBER_ALIVE;
        x->downs = x->drops_heard = 0; /* counted per life */
        kvt_info(MOD, "node %llu restarted (incarnation %llu -> %llu)", (unsigned long long)node_id,
                 (unsigned long long)old, (unsigned long long)incarnation);
        push_event(m, KVT_MEMBER_RESTARTED, node_id, incarnation, old);
    } else if (x->state == KVT_MEMBER_DOWN) {
        x->state = KVT_MEMBER_ALIVE;
        kvt_info(MOD, "node %llu is back", (unsigned long long)node_id);
        push_event(m, KVT_MEMBER_JOINED, node_id, incarnation, 0);
    }
    if (addr != NULL)
        snprintf(x->addr, sizeof(x->addr), "%s", addr);
    if (port != 0)
        x->port = port;
    x->last_heard_ns = now_ns;
    return 0;
}

static void set_down(struct kvt_members *m, struct kvt_member *x, const char *why)
{
    if (x->state == KVT_MEMBER_DOWN)
        return;
    x->state = KVT_MEMBER_DOWN;
    x->downs++;
    kvt_warn(MOD, "node %llu (incarnation %llu) is down: %s", (unsigned long long)x->node_id,
             (unsigned long long)x->incarnation, why);
    push_event(m, KVT_MEMBER_DOWN_EV, x->node_id, x->incarnation, 0);
}

void kvt_members_tick(struct kvt_members *m, uint64_t now_ns)
{
    uint64_t limit = kvt_members_down_after_ns(m);

    for (size_t i = 0; i < m->n; i++) {
        const struct kvt_member *x = &m->mem[i];

        if (x->state == KVT_MEMBER_ALIVE && now_ns > x->last_heard_ns &&
            now_ns - x->last_heard_ns > KVT_MAX(limit, x->down_after_ns))
            set_down(m, &m->mem[i], "missed heartbeats");
    }
}

uint64_t kvt_members_longest_silence_ns(const struct kvt_members *m)
{
    uint64_t longest = kvt_members_down_after_ns(m);

    for (size_t i = 0; i < m->n; i++)
        longest = KVT_MAX(longest, m->mem[i].down_after_ns);
    return longest;
}

void kvt_members_allow_silence(struct kvt_members *m, uint64_t node_id, uint64_t ns)
{
    struct kvt_member *x = find(m, node_id);

    if (x != NULL)
        x->down_after_ns = ns;
}

void kvt_members_mark_down(struct kvt_members *m, uint64_t node_id)
{
    struct kvt_member *x = find(m, node_id);

    if (x != NULL)
        set_down(m, x, "connection lost");
}

size_t kvt_members_live(const struct kvt_members *m, uint64_t *ids, size_t max)
{
    uint64_t all[KVT_MEMBERS_MAX + 1];
    size_t n = 0;

    /* Sort all of them first so that a short buffer gets the lowest ids, not
     * whichever members happen to sit first in the table. */
    all[n++] = m->self_id;
    for (size_t i = 0; i < m->n; i++)
        if (m->mem[i].state == KVT_MEMBER_ALIVE)
            all[n++] = m->mem[i].node_id;
    /* insertion sort: tens of members */
    for (size_t i = 1; i < n; i++)
        for (size_t j = i; j > 0 && all[j - 1] > all[j]; j--) {
            uint64_t t = all[j];

            all[j] = all[j - 1];
            all[j - 1] = t;
        }
    if (n > max)
        n = max;
    if (n > 0)
        memcpy(ids, all, n * sizeof(*ids));
    return n;
}

const struct kvt_member *kvt_members_find(const struct kvt_members *m, uint64_t node_id)
{
    return find(m, node_id);
}

bool kvt_members_is_live(const struct kvt_members *m, uint64_t node_id, uint64_t incarnation)
{
    const struct kvt_member *x;

    if (node_id == m->self_id)
        return incarnation == m->self_incarnation;
    x = find(m, node_id);
    return x != NULL && x->state == KVT_MEMBER_ALIVE && x->incarnation == incarnation;
}

uint64_t kvt_members_epoch(const struct kvt_members *m)
{
    return m->epoch;
}

size_t kvt_members_count(const struct kvt_members *m, enum kvt_member_state state)
{
    size_t n = 0;

    for (size_t i = 0; i < m->n; i++)
        n += m->mem[i].state == state;
    return n;
}

uint64_t kvt_members_down_after_ns(const struct kvt_members *m)
{
    return m->interval_ns * m->k_missed;
}

uint64_t kvt_members_self(const struct kvt_members *m)
{
    return m->self_id;
}

size_t kvt_members_take_events(struct kvt_members *m, struct kvt_member_event *out, size_t max)
{
    size_t n = 0;

    while (m->ev_n > 0 && n < max) {
        out[n++] = m->ev[m->ev_head];
        m->ev_head = (m->ev_head + 1) % EVENT_CAP;
        m->ev_n--;
    }
    return n;
}

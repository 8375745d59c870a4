/* SPDX-License-Identifier: Apache-2.0 */
/* The CPU primary tier: entries per slot, the key index, the slot allocator, the
 * ref-count state machine and its counters, events and gauges, and the record of
 * each request's cache access (vLLM's _RequestCacheAccess). The recency order and
 * victim choice belong to the policy (policy_*.c).
 *
 * One rule carries the whole design: an operation either succeeds completely or
 * changes nothing. prepare_store checks keys, capacity and victims before it
 * touches any entry; pin/unpin check every key before changing the first. The
 * one exception is vLLM's own: a store's request access and ARC's store-miss
 * adaptation are recorded before the store finds it has no room, so they stay
 * when it fails with -ENOSPC (memory for them is reserved first, so -ENOMEM
 * still changes nothing).
 *
 * A request's access is a table of the distinct keys it saw, in first-seen
 * order, each with its KV cache group and what the request did with it
 * (inserted, reused, missed on store). At finish the keys are ordered by group
 * (stable), given their kinds and handed to the policy once; the arrays then go
 * to the next request. Each record keeps the slot where the key was last seen and
 * that slot's generation, so a key still there is found without the index; one
 * that left is looked up again, unless only this request has inserted anything
 * since it was seen (then it is known absent: the request's own inserts update
 * its records). The records' hash table is filled only when a find needs it: a
 * store's absent keys are appended without one while no key the request recorded
 * can have left (no store of its failed, no entry released since its first
 * record), for then an absent key has no record; a scan of the call's own new
 * keys, behind a 256-bit filter of their hashes, dedups them instead.
 *
 * Fence words (seqlock order). Each slot has a 32-bit word, in an array of its own
 * that the network tier registers for peers' one-sided READs. The word turns odd
 * before any byte of the slot may change (allocation: a GPU store or a promotion
 * writes it next; kvt_primary_rewrite_begin) and even once the new bytes are in
 * place (complete_store, kvt_primary_rewrite_end); it only ever moves forward. The
 * entry records the even value its key's bytes were completed under. A peer granted
 * a row with that value READs the row, then the word: equal means no write began
 * between the grant and the word's READ, so the bytes it read are the key's. The
 * odd stores are followed by a full fence (one per prepare_store, after all of its
 * words: nothing in the call writes a row), so they are visible (to other
 * processes and to a NIC, which reads coherent memory) before any store of the new
 * bytes; the even store is a release, after them. Writers of the bytes in other processes (the
 * engines) are told of the slot after prepare_store returned and report back before
 * complete_store: the system calls between order them. */
#include <errno.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "kvt/alloc.h"
#include "kvt/common.h"
#include "kvt/hash.h"
#include "kvt/log.h"
#include "kvt/metrics.h"
#include "kvt/region.h"
#include "kvt/primary_test.h"
#include "primary_int.h"

#define PR_MAX_CHUNKS (1ull << 31)

/* ---- index -------------------------------------------------------------- */

/* Puts cell at the first empty cell from i on; i must lie in cell's probe run
 * (its home, or a cell up to which the run from its home is full). */
static void oa_put_from(uint64_t *cells, size_t size, uint64_t cell, size_t i)
{
    while (cells[i] != 0)
        i = kvt_oa_next(i, size);
    cells[i] = cell;
}

void kvt_oa_put(uint64_t *cells, size_t size, uint64_t cell)
{
    oa_put_from(cells, size, cell, kvt_oa_home(cell >> 32, size));
}

void kvt_oa_del(uint64_t *cells, size_t size, uint64_t cell)
{
    size_t i = kvt_oa_home(cell >> 32, size);

    while (cells[i] != cell)
        i = kvt_oa_next(i, size);
    /* Without a branch on the move (whether a cell moves is a coin toss the
     * predictor loses): the hole is written either way, with v or its own value. */
    for (size_t j = kvt_oa_next(i, size);; j = kvt_oa_next(j, size)) {
        uint64_t v = cells[j];
        size_t home, d_home, d_hole;
        bool move;

        if (v == 0)
            break;
        home = kvt_oa_home(v >> 32, size);
        d_home = j >= home ? j - home : j + size - home;
        d_hole = j >= i ? j - i : j + size - i;
        /* v may move into the hole i unless its home lies cyclically in (i, j]. */
        move = d_home >= d_hole;
        cells[i] = move ? v : cells[i];
        i = move ? j : i;
    }
    cells[i] = 0;
}

static inline size_t pr_home(const struct kvt_primary *p, uint64_t h)
{
    return kvt_oa_home(h, p->index_size);
}

/* The slot of key (hash h), or PR_NIL with *end the empty cell that ended its
 * probe run: where an insertion of the key goes while the table only gains cells
 * (every cell from the key's home up to *end stays full). Inlined: a call per key
 * cost more instructions than a find that ends at its first cell. */
__attribute__((always_inline)) static inline uint32_t
pr_find_end(const struct kvt_primary *p, const struct kvt_key *key, uint64_t h, size_t *end)
{
    for (size_t i = pr_home(p, h);; i = kvt_oa_next(i, p->index_size)) {
        uint64_t v = p->index[i];
        const struct pr_entry *x;

        if (v == 0) {
            *end = i;
            return PR_NIL;
        }
        if (!kvt_oa_tag_is(v, h))
            continue;
        x = &p->e[kvt_oa_id(v)];
        if (x->hash == h && x->key.len == key->len &&
            pr_bytes_eq(x->key.bytes, key->bytes, key->len))
            return kvt_oa_id(v);
    }
}

static uint32_t pr_find_h(const struct kvt_primary *p, const struct kvt_key *key, uint64_t h)
{
    size_t end;

    return pr_find_end(p, key, h, &end);
}

uint32_t kvt_pr_find(const struct kvt_primary *p, const struct kvt_key *key)
{
    if (!pr_key_ok(key))
        return PR_NIL;
    return pr_find_h(p, key, kvt_key_hash(key));
}

/* kvt_pr_find_group that also gives each absent key the cell its insertion takes
 * while the table only gains cells (pr_find_end), in end[] (or none: end NULL). */
static void pr_find_group_end(const struct kvt_primary *p, const struct kvt_key *keys, size_t n,
                              uint64_t *h, uint32_t *slot, uint32_t *end)
{
    for (size_t i = 0; i < n; i++) {
        h[i] = pr_key_ok(&keys[i]) ? kvt_key_hash(&keys[i]) : 0;
        __builtin_prefetch(&p->index[pr_home(p, h[i])]);
    }
    for (size_t i = 0; i < n; i++) {
        size_t home = pr_home(p, h[i]);
        uint64_t v = p->index[home];

        if (v != 0 && kvt_oa_tag_is(v, h[i])) {
            const char *x = (const char *)&p->e[kvt_oa_id(v)];

            __builtin_prefetch(x);
            __builtin_prefetch(x + offsetof(struct pr_entry, key) + keys[i].len);
        } else if (v != 0) {
            /* another key's cell: the probe reads the next one, in the next line
             * for one home in eight */
            __builtin_prefetch(&p->index[kvt_oa_next(home, p->index_size)]);
        }
    }
    for (size_t i = 0; i < n; i++) {
        size_t e = 0;

        slot[i] = pr_key_ok(&keys[i]) ? pr_find_end(p, &keys[i], h[i], &e) : PR_NIL;
        if (end != NULL)
            end[i] = (uint32_t)e;
    }
}

void kvt_pr_find_group(const struct kvt_primary *p, const struct kvt_key *keys, size_t n,
                       uint64_t *h, uint32_t *slot)
{
    pr_find_group_end(p, keys, n, h, slot, NULL);
}

/* from: a cell of the slot's key's probe run (pr_find_end), or SIZE_MAX: its home */
static void pr_index_put(struct kvt_primary *p, uint32_t s, size_t from)
{
    uint64_t h = p->e[s].hash;

    oa_put_from(p->index, p->index_size, kvt_oa_cell(h, s),
                from == SIZE_MAX ? pr_home(p, h) : from);
}

static void pr_index_del(struct kvt_primary *p, uint32_t s)
{
    kvt_oa_del(p->index, p->index_size, kvt_oa_cell(p->e[s].hash, s));
}

void kvt_pr_finish_each(struct kvt_primary *p, const uint32_t *slots, const uint8_t *kinds,
                        size_t n, pr_move_fn *move)
{
    enum { AHEAD = 8 };

    for (size_t i = n; i-- > 0;) {
        if (i >= AHEAD)
            pr_prefetch_links(p, slots[i - AHEAD]);
        move(p, slots[i], kinds[i]);
    }
}

/* ---- request access ----------------------------------------------------- */

enum { PR_AF_INSERTED = 1, PR_AF_REUSED = 2, PR_AF_STORE_MISS = 4 };

struct pr_acc_key {
    uint64_t hash;
    uint64_t seen_at; /* the primary's insert count when slot was recorded */
    uint32_t group;
    uint32_t slot, gen; /* where it was last seen (PR_NIL: absent), that slot's generation */
    uint32_t stamp;     /* == the access's stamp: to be stored by the running prepare_store */
    uint8_t flags;      /* PR_AF_* */
    struct kvt_key key;
};

/* Owned by its creator (the manager's request state); touched only by the
 * primary's calls, on the scheduler thread. */
struct kvt_primary_access {
    uint64_t generation; /* the primary's at the first record; another one is stale */
    bool finished;
    bool many_groups;     /* a key of another group than the first key's was seen */
    struct pr_acc_key *k; /* first-seen order */
    size_t n, cap;
    uint32_t *tab; /* open addressing by hash: index into k + 1, 0 empty */
    size_t tab_mask;
    /* k[0 .. tab_n) are in tab (none when 0: the table is all empty); the rest join
     * it when a find needs it (acc_tab_sync). A store of keys no record can hold
     * appends without it (acc_all_present). */
    size_t tab_n;
    /* Every record's key was present when recorded (none was left absent by a
     * store that failed), and the primary's count of releases was rel_at then:
     * while it still is, every recorded key is present, so an absent key has no
     * record. */
    bool all_in;
    uint64_t rel_at;
    uint32_t stamp; /* bumped by each prepare_store (its dedup of the keys to store) */
    /* [own_from, own_to): the last run of the primary's inserts that were all this
     * access's own (none by anyone else in between). While the primary's count is
     * still own_to, a record seen at or after own_from whose allocation left is
     * absent: only this access inserted since, and its inserts update their
     * records. The finish of a request whose stores evicted its own keys needs no
     * index lookup for them. */
    uint64_t own_from, own_to;
    /* The keys the last prepare_store allocated, when they are k[last_lo ..
     * last_lo + last_n) in store order (new keys, the usual case); else last_n 0.
     * complete_store tries key i there first: no hash, no probe. */
    uint32_t last_lo, last_n;
};

/* vLLM's get_offload_group_idx: the last 4 bytes, big-endian. */
static uint32_t pr_key_group(const struct kvt_key *k)
{
    uint32_t g = 0;

    if (k->len >= 4) { /* one load, not a loop of four (every record takes one) */
        memcpy(&g, k->bytes + k->len - 4, 4);
        return __builtin_bswap32(g);
    }
    for (size_t i = 0; i < k->len; i++)
        g = g << 8 | k->bytes[i];
    return g;
}

int kvt_primary_access_create(struct kvt_primary_access **acc_p)
{
    struct kvt_primary_access *acc = kvt_calloc(1, sizeof(*acc));

    if (acc == NULL)
        return -ENOMEM;
    *acc_p = acc;
    return 0;
}

static void acc_release(struct kvt_primary_access *acc)
{
    kvt_free(acc->k);
    kvt_free(acc->tab);
    acc->k = NULL;
    acc->tab = NULL;
    acc->n = acc->cap = acc->tab_mask = acc->tab_n = 0;
    acc->last_n = 0;
    acc->many_groups = false;
}

#define PR_SPARE_MAX 4096 /* records a finished access may leave to the next one */

/* A finished access gives its arrays to p for the next access to record into,
 * when they are larger than the spare p holds and not too large to keep. */
static void acc_recycle(struct kvt_primary *p, struct kvt_primary_access *acc)
{
    if (acc->cap > p->spare_cap && acc->cap <= PR_SPARE_MAX) {
        kvt_free(p->spare_k);
        kvt_free(p->spare_tab);
        p->spare_k = acc->k;
        p->spare_tab = acc->tab;
        p->spare_cap = acc->cap;
        p->spare_tab_mask = acc->tab_mask;
        p->spare_tab_clean = acc->tab_n == 0;
        acc->k = NULL;
        acc->tab = NULL;
        acc->cap = acc->tab_mask = 0;
    }
    acc_release(acc);
}

/* An access with no records takes p's spare arrays when they hold want records:
 * the table is cleared when the access that left them put records in it. */
static bool acc_adopt_spare(struct kvt_primary *p, struct kvt_primary_access *acc, size_t want)
{
    if (acc->n != 0 || p->spare_cap < want)
        return false;
    kvt_free(acc->k);
    kvt_free(acc->tab);
    acc->k = p->spare_k;
    acc->tab = p->spare_tab;
    acc->cap = p->spare_cap;
    acc->tab_mask = p->spare_tab_mask;
    acc->tab_n = 0;
    if (!p->spare_tab_clean)
        memset(acc->tab, 0, (acc->tab_mask + 1) * sizeof(*acc->tab));
    p->spare_k = NULL;
    p->spare_tab = NULL;
    p->spare_cap = p->spare_tab_mask = 0;
    return true;
}

void kvt_primary_access_destroy(struct kvt_primary_access *acc)
{
    if (acc == NULL)
        return;
    acc_release(acc);
    kvt_free(acc);
}

/* An access recorded before the last reset_cache starts over (vLLM makes a new
 * state for a stale cache generation). */
static void acc_bind(const struct kvt_primary *p, struct kvt_primary_access *acc)
{
    if (acc->generation == p->generation)
        return;
    acc->generation = p->generation;
    acc->finished = false;
    acc->many_groups = false;
    acc->n = 0;
    acc->last_n = 0;
    acc->own_from = acc->own_to = p->inserts;
    acc->all_in = true;
    acc->rel_at = p->releases;
    if (acc->tab != NULL && acc->tab_n > 0)
        memset(acc->tab, 0, (acc->tab_mask + 1) * sizeof(*acc->tab));
    acc->tab_n = 0;
}

static void acc_tab_put(struct kvt_primary_access *acc, uint32_t idx)
{
    size_t i = (size_t)acc->k[idx].hash & acc->tab_mask;

    while (acc->tab[i] != 0)
        i = (i + 1) & acc->tab_mask;
    acc->tab[i] = idx + 1;
}

/* Puts the records the table lacks into it, before a find. */
static void acc_tab_sync(struct kvt_primary_access *acc)
{
    for (; acc->tab_n < acc->n; acc->tab_n++)
        acc_tab_put(acc, (uint32_t)acc->tab_n);
}

/* Whether no record of acc can be of an absent key (see all_in). */
static bool acc_all_present(const struct kvt_primary *p, const struct kvt_primary_access *acc)
{
    return acc->all_in && acc->rel_at == p->releases;
}

/* Room for extra more keys, so that recording never fails half-way. */
static int acc_reserve(struct kvt_primary *p, struct kvt_primary_access *acc, size_t extra)
{
    size_t want = acc->n + extra, tab_cap = 16;

    if (want <= acc->cap || acc_adopt_spare(p, acc, want))
        return 0;
    /* x4 from 64 records: a request of hundreds of keys regrows (and rehashes) two
     * or three times, not five or six. */
    if (want < 4 * acc->cap)
        want = 4 * acc->cap;
    if (want < 64)
        want = 64;
    struct pr_acc_key *k = kvt_reallocarray(acc->k, want, sizeof(*k));

    if (k == NULL)
        return -ENOMEM;
    acc->k = k;
    while (tab_cap < 2 * want)
        tab_cap <<= 1;
    uint32_t *tab = kvt_calloc(tab_cap, sizeof(*tab));

    if (tab == NULL)
        return -ENOMEM; /* k grew, nothing else changed */
    kvt_free(acc->tab);
    acc->tab = tab;
    acc->tab_mask = tab_cap - 1;
    acc->cap = want;
    for (size_t i = 0; i < acc->tab_n; i++)
        acc_tab_put(acc, (uint32_t)i);
    return 0;
}

/* A new stamp for a prepare_store; on wrap-around every record's is reset, so an
 * old stamp never looks current. */
static void acc_next_stamp(struct kvt_primary_access *acc)
{
    if (++acc->stamp != 0)
        return;
    for (size_t i = 0; i < acc->n; i++)
        acc->k[i].stamp = 0;
    acc->stamp = 1;
}

/* A new record of key (room reserved), not yet in the table; its index. Inlined:
 * a store records every new key. */
__attribute__((always_inline)) static inline uint32_t
acc_append(struct kvt_primary_access *acc, const struct kvt_key *key, uint64_t h)
{
    uint32_t idx = (uint32_t)acc->n++;

    acc->k[idx].hash = h;
    acc->k[idx].group = pr_key_group(key);
    acc->k[idx].slot = PR_NIL;
    acc->k[idx].seen_at = 0; /* set where slot is */
    acc->k[idx].stamp = 0;   /* stamps start at 1 */
    acc->k[idx].flags = 0;
    acc->k[idx].key = *key;
    if (idx > 0 && acc->k[idx].group != acc->k[0].group)
        acc->many_groups = true;
    return idx;
}

/* The index of key in acc, recorded as seen if it was not (room reserved). */
static uint32_t acc_see(struct kvt_primary_access *acc, const struct kvt_key *key, uint64_t h)
{
    size_t i;

    acc_tab_sync(acc);
    i = (size_t)h & acc->tab_mask;
    for (uint32_t v; (v = acc->tab[i]) != 0; i = (i + 1) & acc->tab_mask) {
        const struct pr_acc_key *x = &acc->k[v - 1];

        if (x->hash == h && pr_key_eq(&x->key, key))
            return v - 1;
    }
    acc->tab[i] = (uint32_t)acc->n + 1;
    acc->tab_n++; /* == n: synced above */
    return acc_append(acc, key, h);
}

/* The slot where acc last saw key if that slot still holds the same allocation,
 * else PR_NIL (acc holds no record of it, or it moved). */
static uint32_t acc_slot_of(const struct kvt_primary *p, struct kvt_primary_access *acc,
                            const struct kvt_key *key, uint64_t h)
{
    if (acc->n == 0 || acc->generation != p->generation)
        return PR_NIL;
    acc_tab_sync(acc);
    for (size_t i = (size_t)h & acc->tab_mask;; i = (i + 1) & acc->tab_mask) {
        uint32_t v = acc->tab[i];
        const struct pr_acc_key *x;

        if (v == 0)
            return PR_NIL;
        x = &acc->k[v - 1];
        if (x->hash != h || !pr_key_eq(&x->key, key))
            continue;
        if (x->slot == PR_NIL || p->e[x->slot].generation != x->gen ||
            p->e[x->slot].list == PR_NONE || p->e[x->slot].hash != h)
            return PR_NIL;
        return x->slot;
    }
}

/* A use of a ready chunk: reuse, unless this request inserted it. */
static void acc_reuse(struct kvt_primary_access *acc, const struct kvt_key *key, uint64_t h,
                      const struct kvt_primary *p, uint32_t s)
{
    struct pr_acc_key *x = &acc->k[acc_see(acc, key, h)];

    x->slot = s;
    x->gen = p->e[s].generation;
    x->seen_at = p->inserts;

    if (!(x->flags & PR_AF_INSERTED))
        x->flags |= PR_AF_REUSED;
}

/* The access that records, or NULL (none given, or finished). */
static struct kvt_primary_access *acc_live(const struct kvt_primary *p,
                                           struct kvt_primary_access *acc)
{
    if (acc == NULL)
        return NULL;
    acc_bind(p, acc);
    return acc->finished ? NULL : acc;
}

static int fin_reserve(struct kvt_primary *p, size_t n)
{
    if (n <= p->fin_cap)
        return 0;
    uint32_t *order = kvt_reallocarray(p->fin_order, n, sizeof(*order));

    if (order == NULL)
        return -ENOMEM;
    p->fin_order = order;
    uint32_t *slots = kvt_reallocarray(p->fin_slots, n, sizeof(*slots));

    if (slots == NULL)
        return -ENOMEM;
    p->fin_slots = slots;
    uint8_t *kinds = kvt_reallocarray(p->fin_kinds, n, sizeof(*kinds));

    if (kinds == NULL)
        return -ENOMEM;
    p->fin_kinds = kinds;
    p->fin_cap = n;
    return 0;
}

/* (group << 32 | position) sorts to group order, stable. */
static int fin_cmp(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;

    return x < y ? -1 : x > y;
}

/* fin_order[0..n) := the positions 0..n-1 ordered by group, stable (vLLM's key
 * groups in ascending order); group(arg, i) is position i's group. */
static int fin_order_by_group(struct kvt_primary *p, size_t n, bool many_groups,
                              uint32_t (*group)(const void *arg, size_t i), const void *arg)
{
    uint64_t *sort;

    for (size_t i = 0; i < n; i++)
        p->fin_order[i] = (uint32_t)i;
    if (!many_groups)
        return 0;
    sort = kvt_reallocarray(NULL, n, sizeof(*sort));
    if (sort == NULL)
        return -ENOMEM;
    for (size_t i = 0; i < n; i++)
        sort[i] = (uint64_t)group(arg, i) << 32 | i;
    qsort(sort, n, sizeof(*sort), fin_cmp);
    for (size_t i = 0; i < n; i++)
        p->fin_order[i] = (uint32_t)sort[i];
    kvt_free(sort);
    return 0;
}

static uint32_t acc_group(const void *arg, size_t i)
{
    return ((const struct kvt_primary_access *)arg)->k[i].group;
}

#define PR_GONE (PR_NIL - 1) /* acc_apply: known absent without a find */

static void acc_apply(struct kvt_primary *p, struct kvt_primary_access *acc)
{
    size_t n = acc->n, m = 0;
    bool own_since = p->inserts == acc->own_to; /* no one else inserted since own_to */

    if (n == 0)
        return;
    if (fin_reserve(p, n) != 0 || fin_order_by_group(p, n, acc->many_groups, acc_group, acc) != 0) {
        kvt_warn("primary", "out of memory: a request's cache access of %zu keys was lost", n);
        return;
    }
    /* The present keys' slots in prefix order: where the access last saw the key
     * if that slot holds the same allocation still (its generation), else found
     * by the hash recorded (a key that left since, or was never allocated), a
     * group at a time: the entries requested first, then the index cells of the
     * keys that moved, then the finds. */
    for (size_t b = 0; b < n; b += PR_GROUP) {
        size_t e = n - b < PR_GROUP ? n : b + PR_GROUP;
        uint32_t slot[PR_GROUP];

        for (size_t i = b; i < e; i++) {
            const struct pr_acc_key *x = &acc->k[p->fin_order[i]];

            if (x->slot != PR_NIL)
                __builtin_prefetch(&p->e[x->slot]);
        }
        for (size_t i = b; i < e; i++) {
            const struct pr_acc_key *x = &acc->k[p->fin_order[i]];
            uint32_t s = x->slot;

            if (s != PR_NIL && (p->e[s].generation != x->gen || p->e[s].list == PR_NONE ||
                                p->e[s].hash != x->hash)) {
                /* It left that slot; absent for sure when only this request
                 * inserted since it was seen there. */
                s = own_since && acc->own_from <= x->seen_at ? PR_GONE : PR_NIL;
            }
            if (s == PR_NIL)
                __builtin_prefetch(&p->index[kvt_oa_home(x->hash, p->index_size)]);
            slot[i - b] = s;
        }
        for (size_t i = b; i < e; i++) {
            const struct pr_acc_key *x = &acc->k[p->fin_order[i]];
            uint32_t s = slot[i - b];

            if (s == PR_NIL)
                s = pr_find_h(p, &x->key, x->hash);
            if (s == PR_NIL || s == PR_GONE)
                continue;
            p->fin_slots[m] = s;
            p->fin_kinds[m++] = (x->flags & PR_AF_REUSED)     ? PR_ACC_REUSED
                                : (x->flags & PR_AF_INSERTED) ? PR_ACC_INSERTED_ONLY
                                                              : PR_ACC_NEITHER;
        }
    }
    if (m > 0)
        p->pol->finish(p, p->fin_slots, p->fin_kinds, m);
}

void kvt_primary_request_finished(struct kvt_primary *p, struct kvt_primary_access *acc)
{
    if (acc == NULL || acc->finished)
        return;
    /* A stale access (recorded before a reset) applies nothing. */
    if (acc->generation == p->generation)
        acc_apply(p, acc);
    acc->finished = true;
    acc_recycle(p, acc);
}

/* ---- slots and entries -------------------------------------------------- */

static size_t pr_num_free(const struct kvt_primary *p)
{
    return p->n_free_list + p->cfg.num_chunks - p->num_allocated;
}

/* Fresh slots in order first, then the LIFO free list (pinned ids). */
static uint32_t pr_alloc_slot(struct kvt_primary *p)
{
    if (p->num_allocated < p->cfg.num_chunks)
        return (uint32_t)p->num_allocated++;
    return p->free_list[--p->n_free_list];
}

/* The slot's bytes may change from now on: its word turns odd (a new value).
 * The caller issues the full fence (kvt_full_fence) before any store of the new
 * bytes: once per prepare_store, after all its words (nothing there writes a
 * row; the engine writes them after the call returns). */
static void pr_fence_begin_nofence(struct kvt_primary *p, uint32_t s)
{
    uint32_t w = atomic_load_explicit(&p->fence[s], memory_order_relaxed);

    atomic_store_explicit(&p->fence[s], (w + 1) | 1, memory_order_relaxed);
}

static void pr_fence_begin(struct kvt_primary *p, uint32_t s)
{
    pr_fence_begin_nofence(p, s);
    kvt_full_fence(); /* before any store of the new bytes */
}

/* The slot's bytes are in place: its word turns even; returns it. */
static uint32_t pr_fence_end(struct kvt_primary *p, uint32_t s)
{
    uint32_t w = atomic_load_explicit(&p->fence[s], memory_order_relaxed);

    if (w & 1)
        w++;
    atomic_store_explicit(&p->fence[s], w, memory_order_release);
    return w;
}

/* The slot's fence word turns odd here; the caller fences once after its inserts
 * and hands the new entries to the policy. The key's index cell is looked for
 * from cell from (pr_index_put). */
static uint32_t pr_insert(struct kvt_primary *p, const struct kvt_key *key, uint64_t h, size_t from)
{
    uint32_t s = pr_alloc_slot(p);
    struct pr_entry *x = &p->e[s];

    x->key = *key;
    x->hash = h;
    x->ref_cnt = -1;
    x->generation++;
    x->fence = 0;
    pr_fence_begin_nofence(p, s);
    x->mark = 0;
    x->checksum = 0;
    x->has_checksum = false;
    pr_index_put(p, s, from);
    p->inserts++;
    p->num_entries++;
    p->num_write_pending++;
    return s;
}

/* The entry must already be off the policy lists. */
static void pr_release(struct kvt_primary *p, uint32_t s)
{
    pr_index_del(p, s);
    p->e[s].list = PR_NONE;
    p->free_list[p->n_free_list++] = s;
    p->num_entries--;
    p->releases++;
}

/* ---- create / destroy --------------------------------------------------- */

static const struct pr_policy_ops *pr_policy_by_name(const char *name)
{
    if (name == NULL || strcmp(name, "lru") == 0)
        return &kvt_pr_lru_ops;
    if (strcmp(name, "arc") == 0)
        return &kvt_pr_arc_ops;
    return NULL;
}

int kvt_primary_create(const struct kvt_primary_config *cfg, struct kvt_region *region,
                       struct kvt_primary **primary_p)
{
    const struct pr_policy_ops *pol;
    struct kvt_primary *p;
    int rc;

    if (cfg == NULL || primary_p == NULL || cfg->num_chunks == 0 || cfg->num_chunks > PR_MAX_CHUNKS)
        return -EINVAL;
    pol = pr_policy_by_name(cfg->policy);
    if (pol == NULL)
        return -EINVAL;
    if (region != NULL && (region->num_chunks != cfg->num_chunks ||
                           (cfg->row_bytes != 0 && cfg->row_bytes != region->row_bytes)))
        return -EINVAL;

    p = kvt_calloc(1, sizeof(*p));
    if (p == NULL)
        return -ENOMEM;
    p->cfg = *cfg;
    p->cfg.policy = pol->name;
    if (region != NULL)
        p->cfg.row_bytes = region->row_bytes;
    p->pol = pol;
    p->mark = 2;
    p->generation = 1; /* a new access (generation 0) binds at its first record */
    pr_list_init(&p->l1);
    pr_list_init(&p->l2);
    kvt_events_init(&p->events);
    kvt_stats_init(&p->pending_stats);
    p->e = kvt_calloc_table(cfg->num_chunks, sizeof(*p->e));
    p->index_size = 2 * cfg->num_chunks; /* load factor <= 1/2 */
    p->index = kvt_calloc_table(p->index_size, sizeof(*p->index));
    p->free_list = kvt_calloc(cfg->num_chunks, sizeof(*p->free_list));
    p->fence = kvt_calloc_table(cfg->num_chunks, sizeof(*p->fence));
    if (p->e == NULL || p->index == NULL || p->free_list == NULL || p->fence == NULL) {
        rc = -ENOMEM;
        goto fail;
    }
    for (size_t i = 0; i < cfg->num_chunks; i++)
        p->e[i].prev = p->e[i].next = PR_NIL;
    /* The index and the fence words backed now, as the entries are by the loop
     * above: a page's first write faults (on a VM that shadows page tables, a host
     * exit too), and the stores that fill a fresh primary would take those faults
     * one by one. A write of the zero each page holds already. */
    for (size_t i = 0; i < p->index_size; i += 4096 / sizeof(*p->index))
        p->index[i] = 0;
    for (size_t i = 0; i < cfg->num_chunks; i += 4096 / sizeof(*p->fence))
        atomic_store_explicit(&p->fence[i], 0, memory_order_relaxed);
    rc = pol->init(p);
    if (rc != 0)
        goto fail;
    if (region != NULL) {
        p->base = region->base;
    } else if (p->cfg.row_bytes > 0) {
        size_t bytes = cfg->num_chunks * p->cfg.row_bytes;
        void *m;

        if (bytes / p->cfg.row_bytes != cfg->num_chunks) {
            rc = -EINVAL;
            goto fail_pol;
        }
        /* Huge pages (advised, from a 2 MiB boundary): a peer's READ of a row pins
         * or walks one 2 MiB page, not 512 (the pull bench: 2.7 -> 4.6 GB/s over
         * shared memory, 1.8 -> 2.7 over tcp on this machine), and the engine's
         * passes over rows miss the TLB less. At least one huge page, so that even a
         * small primary's rows are mapped pages (the storage tier's O_DIRECT and
         * verbs registrations want whole pages); only the pages touched are backed. */
        bytes = KVT_MAX(bytes, KVT_HUGE_PAGE_BYTES);
        m = kvt_calloc_table(1, bytes);
        if (m == NULL) {
            rc = -ENOMEM;
            goto fail_pol;
        }
        p->base = m;
        p->mem_bytes = bytes;
    }
    p->region = region;
    *primary_p = p;
    return 0;

fail_pol:
    pol->fini(p);
fail:
    kvt_free_table(p->e, p->cfg.num_chunks, sizeof(*p->e));
    kvt_free_table(p->index, p->index_size, sizeof(*p->index));
    kvt_free(p->free_list);
    kvt_free_table(p->fence, p->cfg.num_chunks, sizeof(*p->fence));
    kvt_free(p->victims);
    kvt_free(p);
    return rc;
}

void kvt_primary_destroy(struct kvt_primary *p)
{
    if (p == NULL)
        return;
    p->pol->fini(p);
    if (p->region != NULL) {
        kvt_region_cleanup(p->region);
        kvt_free(p->region);
    } else if (p->mem_bytes > 0) {
        kvt_free_table(p->base, 1, p->mem_bytes);
    }
    kvt_events_cleanup(&p->events);
    kvt_stats_cleanup(&p->pending_stats);
    kvt_free_table(p->e, p->cfg.num_chunks, sizeof(*p->e));
    kvt_free_table(p->index, p->index_size, sizeof(*p->index));
    kvt_free(p->free_list);
    kvt_free_table(p->fence, p->cfg.num_chunks, sizeof(*p->fence));
    kvt_free(p->victims);
    kvt_free(p->dedup);
    kvt_free(p->scratch);
    kvt_free(p->acc_idx);
    kvt_free(p->ins_end);
    kvt_free(p->miss_hash);
    kvt_free(p->fin_slots);
    kvt_free(p->cs_slot);
    kvt_free(p->fin_kinds);
    kvt_free(p->fin_order);
    kvt_free(p->spare_k);
    kvt_free(p->spare_tab);
    kvt_free(p);
}

/* ---- store output ------------------------------------------------------- */

void kvt_store_output_init(struct kvt_store_output *out)
{
    memset(out, 0, sizeof(*out));
}

void kvt_store_output_cleanup(struct kvt_store_output *out)
{
    kvt_free(out->keys_to_store);
    kvt_free(out->chunk_ids);
    kvt_free(out->evicted);
    memset(out, 0, sizeof(*out));
}

static int out_reserve(struct kvt_store_output *out, size_t n_store, size_t n_evicted)
{
    if (n_store > out->cap_store) {
        struct kvt_key *k = kvt_reallocarray(out->keys_to_store, n_store, sizeof(*k));
        int64_t *c;

        if (k == NULL)
            return -ENOMEM;
        out->keys_to_store = k;
        c = kvt_reallocarray(out->chunk_ids, n_store, sizeof(*c));
        if (c == NULL)
            return -ENOMEM;
        out->chunk_ids = c;
        out->cap_store = n_store;
    }
    if (n_evicted > out->cap_evicted) {
        struct kvt_key *k = kvt_reallocarray(out->evicted, n_evicted, sizeof(*k));

        if (k == NULL)
            return -ENOMEM;
        out->evicted = k;
        out->cap_evicted = n_evicted;
    }
    return 0;
}

/* ---- operations --------------------------------------------------------- */

static enum kvt_lookup_result pr_result(const struct kvt_primary *p, uint32_t s)
{
    if (s == PR_NIL)
        return KVT_MISS;
    return p->e[s].ref_cnt < 0 ? KVT_HIT_PENDING : KVT_HIT;
}

enum kvt_lookup_result kvt_primary_lookup(struct kvt_primary *p, const struct kvt_key *key)
{
    return pr_result(p, kvt_pr_find(p, key));
}

enum kvt_lookup_result kvt_primary_lookup_h(struct kvt_primary *p, const struct kvt_key *key,
                                            uint64_t hash)
{
    return pr_result(p, pr_key_ok(key) ? pr_find_h(p, key, hash) : PR_NIL);
}

void kvt_primary_prefetch_h(const struct kvt_primary *p, uint64_t hash)
{
    __builtin_prefetch(&p->index[pr_home(p, hash)]);
}

void kvt_primary_lookup_many(struct kvt_primary *p, const struct kvt_key *keys, size_t n,
                             enum kvt_lookup_result *out, uint64_t *hashes)
{
    uint64_t h[PR_GROUP];
    uint32_t s[PR_GROUP];

    for (size_t b = 0; b < n; b += PR_GROUP) {
        size_t m = n - b < PR_GROUP ? n - b : PR_GROUP;

        kvt_pr_find_group(p, keys + b, m, hashes != NULL ? hashes + b : h, s);
        for (size_t i = 0; i < m; i++)
            out[b + i] = pr_result(p, s[i]);
    }
}

static void pr_next_mark(struct kvt_primary *p)
{
    p->mark += 2;
    if (p->mark >= UINT32_MAX - 2) { /* wrapped: forget every old mark */
        for (size_t i = 0; i < p->cfg.num_chunks; i++)
            p->e[i].mark = 0;
        p->mark = 2;
    }
}

/* The dedup table of the keys a prepare_store adds: a key offered twice is
 * stored once (Python would insert it twice and leak a slot). Returns true when
 * key was already recorded. */
static bool pr_dedup_seen(struct kvt_primary *p, const struct kvt_key *keys, uint32_t idx,
                          uint64_t h)
{
    size_t mask = p->dedup_mask;

    for (size_t i = (size_t)h & mask;; i = (i + 1) & mask) {
        uint32_t v = p->dedup[i];

        if (v == 0) {
            p->dedup[i] = idx + 1;
            return false;
        }
        if (pr_key_eq(&keys[v - 1], &keys[idx]))
            return true;
    }
}

#define PR_DEDUP_SCAN_MAX 64 /* calls of up to this many keys dedup with pr_new_dup */

/* Whether key (hash h) is among the keys to store a prepare_store collected so
 * far (keys[0..n_new), hashes new_hash[]): a filter of 256 bits of the hashes'
 * top byte says no for a key not offered before without a look at them. */
__attribute__((always_inline)) static inline bool pr_new_dup(const struct kvt_key *keys,
                                                             const uint64_t *new_hash, size_t n_new,
                                                             const struct kvt_key *key, uint64_t h,
                                                             uint64_t filter[4])
{
    uint64_t bit = 1ull << (h >> 56 & 63), *w = &filter[h >> 62];

    if (!(*w & bit)) {
        *w |= bit;
        return false;
    }
    for (size_t j = 0; j < n_new; j++)
        if (new_hash[j] == h && pr_key_eq(&keys[j], key))
            return true;
    return false;
}

/* Whether keys[i] (hash h) was offered earlier in this prepare_store of n keys,
 * whose absent keys so far are new_keys[0..n_new): a scan behind the filter for
 * calls of up to PR_DEDUP_SCAN_MAX keys, else the call's dedup table. */
__attribute__((always_inline)) static inline bool
pr_offered_before(struct kvt_primary *p, const struct kvt_key *keys, size_t i, size_t n,
                  const struct kvt_key *new_keys, const uint64_t *new_hash, size_t n_new,
                  uint64_t h, uint64_t filter[4])
{
    return n <= PR_DEDUP_SCAN_MAX ? pr_new_dup(new_keys, new_hash, n_new, &keys[i], h, filter)
                                  : pr_dedup_seen(p, keys, (uint32_t)i, h);
}

static int pr_dedup_reserve(struct kvt_primary *p, size_t n)
{
    size_t cap = 16;

    while (cap < 2 * n)
        cap <<= 1;
    if (cap > p->dedup_cap) {
        uint32_t *d = kvt_reallocarray(p->dedup, cap, sizeof(*d));

        if (d == NULL)
            return -ENOMEM;
        p->dedup = d;
        p->dedup_cap = cap;
    }
    /* Only this call's part is cleared and probed: a small batch after a large
     * one costs what it needs. */
    p->dedup_mask = cap - 1;
    memset(p->dedup, 0, cap * sizeof(*p->dedup));
    return 0;
}

/* The allocation-size histogram: its one entry in pending_stats is updated in
 * place once it exists (no name compares on every store). */
static void pr_observe_alloc(struct kvt_primary *p, size_t n_new)
{
    struct kvt_stat *s;

    if (p->pending_stats.n != 1) {
        kvt_stats_observe(&p->pending_stats, KVT_M_CPU_ALLOC_SIZE, NULL, (double)n_new);
        return;
    }
    s = &p->pending_stats.s[0];
    s->count++;
    s->sum += (double)n_new;
    s->buckets[kvt_hist_bucket(s->layout, (double)n_new)]++;
}

/* Scratch of n entries for a prepare_store: victims (at most one per key), the
 * access index and hash of each key to store, the hashes of its store misses. */
static int pr_store_reserve(struct kvt_primary *p, size_t n)
{
    if (n > p->victims_cap) {
        uint32_t *v = kvt_reallocarray(p->victims, n, sizeof(*v));

        if (v == NULL)
            return -ENOMEM;
        p->victims = v;
        p->victims_cap = n;
    }
    if (n > p->miss_cap) {
        uint32_t *idx = kvt_reallocarray(p->acc_idx, n, sizeof(*idx));

        if (idx == NULL)
            return -ENOMEM;
        p->acc_idx = idx;
        idx = kvt_reallocarray(p->ins_end, n, sizeof(*idx));
        if (idx == NULL)
            return -ENOMEM;
        p->ins_end = idx;
        uint64_t *mh = kvt_reallocarray(p->miss_hash, 2 * n, sizeof(*mh));

        if (mh == NULL)
            return -ENOMEM;
        p->miss_hash = mh;
        p->miss_cap = n;
    }
    return 0;
}

int kvt_primary_prepare_store_req(struct kvt_primary *p, const struct kvt_key *keys, size_t n,
                                  struct kvt_primary_access *acc, struct kvt_store_output *out)
{
    size_t n_new = 0, n_miss = 0, need, free_slots;
    uint64_t *new_hash, *miss_hash;
    bool append; /* absent keys have no record: append theirs, dedup without it */
    uint64_t filter[4] = {0};
    int rc;

    out->n_store = 0;
    out->n_evicted = 0;
    /* Every line of the entries and the fence words of the fresh slots the first
     * insertions take, requested before the first read of the keys (a large
     * primary's entries and a caller's keys are both cache misses: they overlap).
     * Every line, not each entry's first and last: an entry spans three lines in
     * two of four slots. (In the call, not in a helper of its own: GCC takes a
     * function of prefetches alone for one without effects and drops the call.)
     * Slots from the free list are a store's victims, in cache from the eviction.
     * (No keys: no slot, and fence[s - 1] may be before the array.) */
    if (n > 0 && p->num_allocated < p->cfg.num_chunks) {
        size_t s = p->num_allocated,
               e = KVT_MIN(s + KVT_MIN(n, (size_t)PR_GROUP), p->cfg.num_chunks);

        for (const char *at = (const char *)&p->e[s]; at < (const char *)&p->e[e]; at += 64)
            __builtin_prefetch(at, 1);
        __builtin_prefetch((const char *)&p->e[e] - 1, 1);
        __builtin_prefetch((const void *)&p->fence[s], 1);
        __builtin_prefetch((const void *)&p->fence[e - 1], 1);
    }
    for (size_t i = 0; i < n; i++)
        if (!pr_key_ok(&keys[i]))
            return -EINVAL;
    if (n == 0)
        return 0;
    if (n > UINT32_MAX - 1)
        return -EINVAL;
    /* Every allocation first: past this point only -ENOSPC can fail. A request's
     * access dedups the offered keys itself (by its stamp); without one, a table
     * of this call's keys does. */
    acc = acc_live(p, acc);
    append = acc != NULL && acc_all_present(p, acc);
    rc = (acc == NULL || append) && n > PR_DEDUP_SCAN_MAX ? pr_dedup_reserve(p, n) : 0;
    if (rc == 0 && acc != NULL)
        rc = acc_reserve(p, acc, n);
    if (rc == 0)
        rc = out_reserve(out, n, n);
    if (rc == 0)
        rc = pr_store_reserve(p, n);
    if (rc != 0)
        return rc;
    if (acc != NULL) {
        acc->last_n = 0;
        acc_next_stamp(acc);
    }
    new_hash = p->miss_hash + n;
    miss_hash = p->miss_hash;

    /* Protect every offered key (present ones keep their place whatever happens)
     * and collect the absent ones, once each. The request's access records, in
     * offer order, the absent keys and the ready present ones (reused); a key
     * still being written is neither. */
    pr_next_mark(p);
    for (size_t b = 0; b < n; b += PR_GROUP) {
        size_t m = n - b < PR_GROUP ? n - b : PR_GROUP;
        uint64_t h[PR_GROUP];
        uint32_t s[PR_GROUP], end[PR_GROUP];

        pr_find_group_end(p, keys + b, m, h, s, end);
        for (size_t i = 0; i < m; i++) {
            if (s[i] != PR_NIL) {
                p->e[s[i]].mark = p->mark;
                if (acc != NULL && p->e[s[i]].ref_cnt >= 0)
                    acc_reuse(acc, &keys[b + i], h[i], p, s[i]);
            } else {
                /* Absent: one record (with an access) and one store, once per call. */
                uint32_t idx = 0;

                if (acc != NULL && !append) {
                    idx = acc_see(acc, &keys[b + i], h[i]);
                    if (acc->k[idx].stamp == acc->stamp)
                        continue; /* offered earlier in this call */
                } else if (pr_offered_before(p, keys, b + i, n, out->keys_to_store, new_hash, n_new,
                                             h[i], filter)) {
                    continue;
                } else if (acc != NULL) {
                    idx = acc_append(acc, &keys[b + i], h[i]);
                    acc->k[idx].flags = PR_AF_STORE_MISS; /* a new record's first */
                }
                if (acc != NULL) {
                    acc->k[idx].stamp = acc->stamp;
                    p->acc_idx[n_new] = idx;
                }
                p->ins_end[n_new] = end[i];
                new_hash[n_new] = h[i];
                out->keys_to_store[n_new++] = keys[b + i];
            }
        }
    }
    /* Store misses this request has not had yet, before allocation removes their
     * ghosts (ARC adapts to them even if the store then fails): every key to store
     * when its record was appended above (or there is no access). */
    if (acc != NULL && !append) {
        for (size_t i = 0; i < n_new; i++) {
            struct pr_acc_key *x = &acc->k[p->acc_idx[i]];

            if (x->flags & PR_AF_STORE_MISS)
                continue;
            x->flags |= PR_AF_STORE_MISS;
            miss_hash[n_miss++] = new_hash[i];
        }
    } else {
        miss_hash = new_hash;
        n_miss = n_new;
    }
    if (n_miss > 0 && p->pol->store_miss != NULL)
        p->pol->store_miss(p, miss_hash, n_miss);
    if (n_new == 0)
        return 0;
    /* vLLM counts the allocation's size before it knows whether there is room */
    pr_observe_alloc(p, n_new);

    free_slots = pr_num_free(p);
    need = n_new > free_slots ? n_new - free_slots : 0;
    if (need > 0) {
        /* On failure the new keys' records stay, of keys left absent. */
        rc = need > p->num_evictable ? -ENOSPC /* fail fast without a scan (#45757) */
                                     : p->pol->evict(p, need, p->victims); /* -ENOSPC: no change */
        if (rc != 0) {
            if (acc != NULL)
                acc->all_in = false;
            return rc;
        }
        for (size_t i = 0; i < need; i++) /* the victims' index cells, overlapped */
            __builtin_prefetch(&p->index[pr_home(p, p->e[p->victims[i]].hash)], 1);
        for (size_t i = 0; i < need; i++) {
            uint32_t s = p->victims[i];

            out->evicted[i] = p->e[s].key;
            p->num_evictable--;
            pr_release(p, s);
        }
        out->n_evicted = need;
        p->num_evicted += need;
        if (p->on_removed != NULL)
            p->on_removed(p->on_removed_arg, out->evicted, need);
        if (p->cfg.enable_events &&
            kvt_events_push(&p->events, out->evicted, need, KVT_MEDIUM_CPU, KVT_ANY, true) != 0)
            kvt_warn("primary", "out of memory: a removed event was lost");
    }
    if (acc != NULL && acc->own_to != p->inserts)
        acc->own_from = p->inserts; /* someone else inserted since: a new run */
    for (size_t b = 0; b < n_new; b += PR_GROUP) {
        size_t m = n_new - b < PR_GROUP ? n_new - b : PR_GROUP;
        uint32_t slot[PR_GROUP];

        if (p->pol->will_insert != NULL)
            p->pol->will_insert(p, new_hash + b, m);
        for (size_t i = b; i < b + m; i++) {
            /* Without eviction the index only gained cells since the finds: each
             * key's insertion goes on from where its find ended (an earlier key of
             * this call may have taken that cell: oa_put_from moves on). An
             * eviction's deletions shift cells back, so then each starts at its
             * home. */
            slot[i - b] = pr_insert(p, &out->keys_to_store[i], new_hash[i],
                                    need > 0 ? SIZE_MAX : p->ins_end[i]);
            out->chunk_ids[i] = slot[i - b];
            if (acc != NULL) {
                struct pr_acc_key *x = &acc->k[p->acc_idx[i]];

                x->flags |= PR_AF_INSERTED;
                x->slot = slot[i - b];
                x->gen = p->e[x->slot].generation;
                x->seen_at = p->inserts;
            }
        }
        p->pol->insert(p, slot, m); /* in store order, as one call per key would */
    }
    if (acc != NULL)
        acc->own_to = p->inserts;
    kvt_full_fence(); /* the words turned odd before any store of the new bytes */
    out->n_store = n_new;
    if (acc != NULL && p->acc_idx[n_new - 1] - p->acc_idx[0] == n_new - 1) {
        size_t i = 1; /* new keys were recorded in a row: complete_store's hint */

        while (i < n_new && p->acc_idx[i] == p->acc_idx[0] + i)
            i++;
        if (i == n_new) {
            acc->last_lo = p->acc_idx[0];
            acc->last_n = (uint32_t)n_new;
        }
    }
    return 0;
}

int kvt_primary_prepare_store(struct kvt_primary *p, const struct kvt_key *keys, size_t n,
                              struct kvt_store_output *out)
{
    return kvt_primary_prepare_store_req(p, keys, n, NULL, out);
}

/* Finds the slots of keys[0..n) into slot[]: through the request's access where it
 * saw them allocated (which spares the index: a cache miss per key in a large
 * primary), else through the index, PR_GROUP keys at a time. */
static void pr_complete_find(struct kvt_primary *p, const struct kvt_key *keys, size_t n,
                             struct kvt_primary_access *acc, uint32_t *slot)
{
    uint64_t h[PR_GROUP];

    if (acc != NULL && acc->n > 0 && acc->generation == p->generation) {
        for (size_t i = 0; i < n; i++) {
            uint64_t hk;

            /* The slot the last prepare_store gave key i, if a live entry there holds
             * this key: the index holds each key once, so that is its slot. */
            if (i < acc->last_n) {
                uint32_t s = acc->k[acc->last_lo + i].slot;

                if (s != PR_NIL && p->e[s].list != PR_NONE && pr_key_eq(&p->e[s].key, &keys[i])) {
                    slot[i] = s;
                    continue;
                }
            }
            hk = pr_key_ok(&keys[i]) ? kvt_key_hash(&keys[i]) : 0;

            slot[i] = pr_key_ok(&keys[i]) ? acc_slot_of(p, acc, &keys[i], hk) : PR_NIL;
            if (slot[i] == PR_NIL && pr_key_ok(&keys[i]))
                slot[i] = pr_find_h(p, &keys[i], hk);
        }
        return;
    }
    for (size_t b = 0; b < n; b += PR_GROUP)
        kvt_pr_find_group(p, keys + b, n - b < PR_GROUP ? n - b : PR_GROUP, h, slot + b);
}

/* Completes the write of slot s (of key): ready, or freed when !success. Returns
 * whether the key was stored by this call. */
__attribute__((always_inline)) static inline bool pr_complete_slot(struct kvt_primary *p,
                                                                   uint32_t s, bool success)
{
    struct pr_entry *x;

    /* absent, already ready (idempotent), or released by a repeat of the key
     * earlier in this call (nothing allocates here, so its slot stays free) */
    if (s == PR_NIL || p->e[s].ref_cnt >= 0 || p->e[s].list == PR_NONE)
        return false;
    x = &p->e[s];
    p->num_write_pending--;
    x->fence = pr_fence_end(p, s);
    if (!success) { /* no event: the key was never stored */
        x->fence = 0;
        p->pol->remove(p, s);
        pr_release(p, s);
        return false;
    }
    x->ref_cnt = 0;
    p->num_evictable++;
    /* A tier that checked the bytes it wrote (the network tier's READs, against the
     * holder's checksum) has set it already: no second pass over the row. */
    if (p->cfg.checksum_on_complete && p->base != NULL && !x->has_checksum) {
        x->checksum = kvt_hash64(p->base + (size_t)s * p->cfg.row_bytes, p->cfg.row_bytes);
        x->has_checksum = true;
    }
    return true;
}

/* complete_store; with strict, a successful one of a key that is absent is -EINVAL
 * and changes nothing. It never fails for memory (the slots complete whatever
 * happens; only the stored event can be lost): every key is found once, before the
 * first change, into a scratch array, or, when that array cannot grow, PR_GROUP keys
 * at a time on the stack, in two passes when strict. */
static int pr_complete(struct kvt_primary *p, const struct kvt_key *keys, size_t n, bool success,
                       bool strict, struct kvt_primary_access *acc)
{
    size_t n_stored = 0;
    bool event = success && p->cfg.enable_events;
    uint32_t *slot = p->cs_slot, group[PR_GROUP];

    if (event && n > p->scratch_cap) {
        struct kvt_key *k = kvt_reallocarray(p->scratch, n, sizeof(*k));

        if (k != NULL) {
            p->scratch = k;
            p->scratch_cap = n;
        } else {
            event = false; /* the slots still complete: only the event is lost */
        }
    }
    if (n > p->cs_cap) {
        uint32_t *c = kvt_reallocarray(p->cs_slot, n, sizeof(*c));

        if (c != NULL) {
            p->cs_slot = slot = c;
            p->cs_cap = n;
        } else {
            slot = NULL;
        }
    }
    if (slot != NULL) {
        pr_complete_find(p, keys, n, acc, slot);
        for (size_t i = 0; strict && success && i < n; i++)
            if (slot[i] == PR_NIL)
                return -EINVAL;
        for (size_t i = 0; i < n; i++)
            if (pr_complete_slot(p, slot[i], success) && event)
                p->scratch[n_stored++] = keys[i];
    } else {
        for (size_t b = 0; strict && success && b < n; b += PR_GROUP) {
            size_t m = KVT_MIN(n - b, (size_t)PR_GROUP);

            pr_complete_find(p, keys + b, m, acc, group);
            for (size_t i = 0; i < m; i++)
                if (group[i] == PR_NIL)
                    return -EINVAL;
        }
        for (size_t b = 0; b < n; b += PR_GROUP) {
            size_t m = KVT_MIN(n - b, (size_t)PR_GROUP);

            pr_complete_find(p, keys + b, m, acc, group);
            for (size_t i = 0; i < m; i++)
                if (pr_complete_slot(p, group[i], success) && event)
                    p->scratch[n_stored++] = keys[b + i];
        }
    }
    if (success && p->cfg.enable_events && !event) {
        kvt_warn("primary", "out of memory: a stored event was lost");
        return -ENOMEM;
    }
    if (n_stored > 0 &&
        kvt_events_push(&p->events, p->scratch, n_stored, KVT_MEDIUM_CPU, KVT_ANY, false) != 0) {
        kvt_warn("primary", "out of memory: a stored event was lost");
        return -ENOMEM;
    }
    return 0;
}

int kvt_primary_complete_store(struct kvt_primary *p, const struct kvt_key *keys, size_t n,
                               bool success)
{
    return pr_complete(p, keys, n, success, false, NULL);
}

int kvt_primary_complete_store_strict(struct kvt_primary *p, const struct kvt_key *keys, size_t n,
                                      bool success, struct kvt_primary_access *acc)
{
    return pr_complete(p, keys, n, success, true, acc);
}

/* Checks every key before pinning the first: all present and ready, or -EINVAL. */
static int pr_pin(struct kvt_primary *p, const struct kvt_key *keys, size_t n, int64_t *chunk_ids)
{
    uint64_t h[PR_GROUP];
    uint32_t slot[PR_GROUP];

    for (size_t i = 0; i < n; i++) {
        uint32_t s;

        if (i % PR_GROUP == 0)
            kvt_pr_find_group(p, keys + i, n - i < PR_GROUP ? n - i : PR_GROUP, h, slot);
        s = slot[i % PR_GROUP];

        if (s == PR_NIL || p->e[s].ref_cnt < 0)
            return -EINVAL;
        if (p->e[s].ref_cnt == INT32_MAX)
            return -EOVERFLOW;
        chunk_ids[i] = s;
    }
    for (size_t i = 0; i < n; i++) {
        struct pr_entry *x = &p->e[chunk_ids[i]];

        if (x->ref_cnt++ == 0)
            p->num_evictable--;
    }
    return 0;
}

int kvt_primary_prepare_load_req(struct kvt_primary *p, const struct kvt_key *keys, size_t n,
                                 struct kvt_primary_access *acc, int64_t *chunk_ids)
{
    int rc;

    acc = acc_live(p, acc);
    if (acc != NULL && (rc = acc_reserve(p, acc, n)) != 0)
        return rc;
    rc = pr_pin(p, keys, n, chunk_ids);
    if (rc != 0 || acc == NULL)
        return rc;
    /* A GPU load is a use of every key (vLLM's record_access=True). */
    for (size_t i = 0; i < n; i++)
        acc_reuse(acc, &keys[i], p->e[chunk_ids[i]].hash, p, (uint32_t)chunk_ids[i]);
    return 0;
}

int kvt_primary_prepare_load(struct kvt_primary *p, const struct kvt_key *keys, size_t n,
                             int64_t *chunk_ids)
{
    return pr_pin(p, keys, n, chunk_ids);
}

/* A cascade read is not a reuse: it records no access (vLLM's prepare_read). */
int kvt_primary_prepare_read(struct kvt_primary *p, const struct kvt_key *keys, size_t n,
                             int64_t *chunk_ids)
{
    return pr_pin(p, keys, n, chunk_ids);
}

int kvt_primary_complete_load(struct kvt_primary *p, const struct kvt_key *keys, size_t n)
{
    size_t m, became_evictable = 0;

    /* A key may be listed several times, each taking one pin: unpin tentatively
     * and roll back if one runs out, so misuse changes nothing. */
    for (m = 0; m < n; m++) {
        uint32_t s = kvt_pr_find(p, &keys[m]);

        if (s == PR_NIL || p->e[s].ref_cnt <= 0)
            break;
        if (--p->e[s].ref_cnt == 0)
            became_evictable++;
    }
    if (m < n) {
        for (size_t i = 0; i < m; i++)
            p->e[kvt_pr_find(p, &keys[i])].ref_cnt++;
        return -EINVAL;
    }
    p->num_evictable += became_evictable;
    return 0;
}

static uint32_t slot_group(const void *arg, size_t i)
{
    const struct kvt_primary *p = arg;

    return pr_key_group(&p->e[p->fin_slots[i]].key);
}

void kvt_primary_touch(struct kvt_primary *p, const struct kvt_key *keys, size_t n)
{
    uint64_t h[PR_GROUP];
    uint32_t s[PR_GROUP];
    size_t m = 0;
    bool many_groups = false;

    if (n == 0)
        return;
    if (fin_reserve(p, n) != 0) {
        kvt_warn("primary", "out of memory: a touch of %zu keys was lost", n);
        return;
    }
    /* A request of its own, finished at once: each present ready key once, in
     * first-seen order (a mark tells a repeat), reused. */
    pr_next_mark(p);
    for (size_t b = 0; b < n; b += PR_GROUP) {
        size_t g = n - b < PR_GROUP ? n - b : PR_GROUP;

        kvt_pr_find_group(p, keys + b, g, h, s);
        for (size_t i = 0; i < g; i++) {
            struct pr_entry *x;

            if (s[i] == PR_NIL)
                continue;
            x = &p->e[s[i]];
            if (x->ref_cnt < 0 || x->mark == p->mark)
                continue;
            x->mark = p->mark;
            if (m > 0 && !many_groups &&
                pr_key_group(&keys[b + i]) != pr_key_group(&p->e[p->fin_slots[0]].key))
                many_groups = true;
            p->fin_slots[m++] = s[i];
        }
    }
    if (m == 0)
        return;
    if (many_groups) {
        uint32_t *slots = kvt_reallocarray(NULL, m, sizeof(*slots));

        if (slots == NULL || fin_order_by_group(p, m, true, slot_group, p) != 0) {
            kvt_free(slots);
            kvt_warn("primary", "out of memory: a touch of %zu keys was lost", n);
            return;
        }
        memcpy(slots, p->fin_slots, m * sizeof(*slots));
        for (size_t i = 0; i < m; i++)
            p->fin_slots[i] = slots[p->fin_order[i]];
        kvt_free(slots);
    }
    memset(p->fin_kinds, PR_ACC_REUSED, m);
    p->pol->finish(p, p->fin_slots, p->fin_kinds, m);
}

void kvt_primary_reset_cache(struct kvt_primary *p)
{
    p->generation++; /* every access recorded so far is stale */
    p->pol->clear(p);
    kvt_zero_table(p->index, p->index_size, sizeof(*p->index));
    for (size_t i = 0; i < p->cfg.num_chunks; i++) {
        struct pr_entry *x = &p->e[i];

        x->list = PR_NONE;
        x->prev = x->next = PR_NIL;
        x->ref_cnt = 0;
        x->mark = 0;
    }
    pr_list_init(&p->l1);
    pr_list_init(&p->l2);
    p->num_allocated = 0;
    p->n_free_list = 0;
    p->num_entries = p->num_evictable = p->num_write_pending = 0;
    if (p->on_removed != NULL)
        p->on_removed(p->on_removed_arg, NULL, 0);
}

void kvt_primary_set_removed_hook(struct kvt_primary *p, kvt_primary_removed_fn fn, void *arg)
{
    p->on_removed = fn;
    p->on_removed_arg = arg;
}

int kvt_primary_take_events(struct kvt_primary *p, struct kvt_events *out)
{
    return kvt_events_splice(out, &p->events);
}

int kvt_primary_get_stats(struct kvt_primary *p, struct kvt_stats *out)
{
    double n = (double)p->cfg.num_chunks;
    double usage = (double)(p->num_entries - p->num_evictable) / n;
    double write = (double)p->num_write_pending / n;
    double read = usage - write > 0 ? usage - write : 0;
    int rc;

    rc = kvt_stats_set_gauge(out, KVT_M_CPU_USAGE, NULL, usage);
    if (rc == 0)
        rc = kvt_stats_set_gauge(out, KVT_M_CPU_WRITE_USAGE, NULL, write);
    if (rc == 0)
        rc = kvt_stats_set_gauge(out, KVT_M_CPU_READ_USAGE, NULL, read);
    if (rc == 0)
        rc = kvt_stats_aggregate(out, &p->pending_stats);
    if (rc == 0)
        kvt_stats_clear(&p->pending_stats);
    return rc;
}

/* ---- introspection ------------------------------------------------------ */

size_t kvt_primary_num_chunks(const struct kvt_primary *p)
{
    return p->cfg.num_chunks;
}

size_t kvt_primary_row_bytes(const struct kvt_primary *p)
{
    return p->cfg.row_bytes;
}

uint8_t *kvt_primary_base(const struct kvt_primary *p)
{
    return p->base;
}

struct kvt_region *kvt_primary_region(const struct kvt_primary *p)
{
    return p->region;
}

size_t kvt_primary_num_evictable(const struct kvt_primary *p)
{
    return p->num_evictable;
}

size_t kvt_primary_num_write_pending(const struct kvt_primary *p)
{
    return p->num_write_pending;
}

size_t kvt_primary_num_free(const struct kvt_primary *p)
{
    return pr_num_free(p);
}

size_t kvt_primary_num_entries(const struct kvt_primary *p)
{
    return p->num_entries;
}

uint64_t kvt_primary_num_evicted(const struct kvt_primary *p)
{
    return p->num_evicted;
}

size_t kvt_primary_index_bytes(const struct kvt_primary *p)
{
    size_t n = p->cfg.num_chunks;

    return n * sizeof(*p->e) + p->index_size * sizeof(*p->index) + n * sizeof(*p->free_list) +
           p->victims_cap * sizeof(*p->victims) + p->pol->mem_bytes(p);
}

static void pr_info(const struct kvt_primary *p, uint32_t s, struct kvt_primary_entry_info *info)
{
    const struct pr_entry *x = &p->e[s];

    info->slot = s;
    info->ref_cnt = x->ref_cnt;
    info->generation = x->generation;
    info->fence = x->fence;
    info->checksum = x->checksum;
    info->has_checksum = x->has_checksum;
}

int kvt_primary_entry_info(const struct kvt_primary *p, const struct kvt_key *key,
                           struct kvt_primary_entry_info *info_p)
{
    uint32_t s = kvt_pr_find(p, key);

    if (s == PR_NIL)
        return -ENOENT;
    pr_info(p, s, info_p);
    return 0;
}

int kvt_primary_set_checksum(struct kvt_primary *p, const struct kvt_key *key, uint64_t sum)
{
    uint32_t s = kvt_pr_find(p, key);

    if (s == PR_NIL)
        return -ENOENT;
    p->e[s].checksum = sum;
    p->e[s].has_checksum = true;
    return 0;
}

const _Atomic uint32_t *kvt_primary_fence_words(const struct kvt_primary *p, size_t *n_p)
{
    *n_p = p->cfg.num_chunks;
    return p->fence;
}

int kvt_primary_rewrite_begin(struct kvt_primary *p, const struct kvt_key *key, uint8_t **row_p)
{
    uint32_t s = kvt_pr_find(p, key);

    if (s == PR_NIL || p->base == NULL)
        return -ENOENT;
    if (p->e[s].ref_cnt < 0)
        return -EBUSY; /* a write is already in flight */
    pr_fence_begin(p, s);
    *row_p = p->base + (size_t)s * p->cfg.row_bytes;
    return 0;
}

int kvt_primary_rewrite_end(struct kvt_primary *p, const struct kvt_key *key)
{
    uint32_t s = kvt_pr_find(p, key);

    if (s == PR_NIL || !(atomic_load_explicit(&p->fence[s], memory_order_relaxed) & 1) ||
        p->e[s].ref_cnt < 0)
        return -EINVAL;
    (void)pr_fence_end(p, s);
    return 0;
}

size_t kvt_primary_policy_list(const struct kvt_primary *p, int which, struct kvt_key *out,
                               size_t max)
{
    return p->pol->list(p, which, out, max);
}

void kvt_primary_for_each(const struct kvt_primary *p, kvt_primary_entry_cb cb, void *arg)
{
    for (size_t s = 0; s < p->num_allocated; s++) {
        struct kvt_primary_entry_info info;

        if (p->e[s].list == PR_NONE)
            continue;
        pr_info(p, (uint32_t)s, &info);
        cb(arg, &p->e[s].key, &info);
    }
}

/* ---- helpers shared with the policies ----------------------------------- */

size_t kvt_pr_collect(struct kvt_primary *p, uint32_t *cursor, size_t want, uint32_t *out)
{
    size_t got = 0;

    while (got < want && *cursor != PR_NIL) {
        uint32_t s = *cursor;

        *cursor = p->e[s].next;
        if (pr_evictable(p, s) && p->e[s].mark != p->mark + 1) {
            p->e[s].mark = p->mark + 1;
            out[got++] = s;
        }
    }
    return got;
}

size_t kvt_pr_list_keys(const struct kvt_primary *p, const struct pr_list *l, struct kvt_key *out,
                        size_t max)
{
    size_t k = 0;

    for (uint32_t s = l->head; s != PR_NIL && k < max; s = p->e[s].next)
        out[k++] = p->e[s].key;
    return k;
}

/* SPDX-License-Identifier: Apache-2.0 */
/* The primary tier's private layout, shared by primary.c and the cache policies
 * (policy_lru.c, policy_arc.c).
 *
 * Every entry lives in the slot it owns: entry i describes chunk i of the region,
 * so there is one array of num_chunks entries and nothing to allocate per store.
 * The key index is an open-addressing table of slot ids tagged with 32 bits of
 * the key's hash (linear probing, backward-shift deletion), compared by full key. Policy lists are
 * doubly linked through slot ids, so the index never holds pointers and survives a realloc-free
 * life of the primary. */
#ifndef KVT_PRIMARY_INT_H
#define KVT_PRIMARY_INT_H

#include <stddef.h>
#include <stdint.h>
#include <stdbool.h>
#include <string.h>

#include "kvt/primary.h"
#include "kvt/stats.h"
#include "kvt/types.h"

#define PR_NIL UINT32_MAX

/* Which policy list an entry is on. LRU uses only PR_L1. */
enum { PR_NONE = 0, PR_L1 = 1, PR_L2 = 2 };

/* Hot fields first: a lookup reads hash, ref_cnt and the key, which for keys up
 * to 50 bytes share the entry's first cache line. */
struct pr_entry {
    uint64_t hash;
    int32_t ref_cnt;
    uint8_t list; /* PR_NONE when the slot is free */
    bool has_checksum;
    struct kvt_key key;
    uint32_t generation; /* bumped on every allocation of the slot */
    uint32_t fence;      /* the slot's fence word when the key's bytes were completed */
    uint32_t mark;       /* == primary mark: protected by the running prepare_store */
    uint32_t prev, next; /* policy list links */
    uint64_t checksum;
};

struct pr_list {
    uint32_t head, tail; /* head = LRU end, tail = MRU end */
    size_t n;
};

struct kvt_primary;
struct pr_acc_key; /* a record of a request's access (primary.c) */

/* What a request did with a key it accessed, as its finish tells the policy:
 * inserted it and never reused it (insertion-only), reused it while ready, or
 * neither (offered for store but never allocated). */
enum pr_access_kind { PR_ACC_NEITHER = 0, PR_ACC_INSERTED_ONLY = 1, PR_ACC_REUSED = 2 };

/* A cache policy: owns the recency order of the entries (and its own extra state,
 * such as ARC's ghosts); the primary owns the entries, slots and counters. */
struct pr_policy_ops {
    const char *name;
    int (*init)(struct kvt_primary *p);
    void (*fini)(struct kvt_primary *p);
    /* Optional: keys of hashes[0..n) are about to be inserted; start their cache
     * misses. */
    void (*will_insert)(struct kvt_primary *p, const uint64_t *hashes, size_t n);
    /* New entries (ref -1), in the order they were stored. */
    void (*insert)(struct kvt_primary *p, const uint32_t *slots, size_t n);
    void (*remove)(struct kvt_primary *p, uint32_t slot); /* a failed store leaves */
    /* Optional (ARC): store misses of one request, in offer order, each seen for
     * the first time by that request; applied in reverse (a ghost hit adapts). */
    void (*store_miss)(struct kvt_primary *p, const uint64_t *hashes, size_t n);
    /* One request-scoped access: the slots of its present keys in prefix order,
     * each once, with their kind (enum pr_access_kind); applied tail to head, so
     * the head ends most recent. */
    void (*finish)(struct kvt_primary *p, const uint32_t *slots, const uint8_t *kinds, size_t n);
    /* Chooses exactly n victims (ref 0, not marked) into victims[] and takes them
     * off the lists; -ENOSPC with no change when fewer exist. */
    int (*evict)(struct kvt_primary *p, size_t n, uint32_t *victims);
    void (*clear)(struct kvt_primary *p);
    size_t (*list)(const struct kvt_primary *p, int which, struct kvt_key *out, size_t max);
    size_t (*mem_bytes)(const struct kvt_primary *p);
};

extern const struct pr_policy_ops kvt_pr_lru_ops;
extern const struct pr_policy_ops kvt_pr_arc_ops;

struct kvt_primary {
    struct kvt_primary_config cfg;
    const struct pr_policy_ops *pol;
    void *pol_state;

    struct pr_entry *e; /* [num_chunks] */
    uint64_t *index;    /* kvt_oa cells: hash tag << 32 | slot + 1 */
    size_t index_size;

    size_t num_allocated; /* bump allocator */
    uint32_t *free_list;  /* LIFO of freed slots */
    size_t n_free_list;
    size_t num_entries, num_evictable, num_write_pending;
    uint64_t num_evicted; /* chunks evicted since the primary was created (/metrics) */
    uint64_t inserts;     /* entries ever inserted: a request's access dates its records by it */
    uint64_t releases;    /* entries ever released: while it stands, no key left */
    uint32_t mark;        /* current prepare_store's protection mark (never 0) */

    struct pr_list l1, l2;

    /* prepare_store scratch: victims and the dedup table of offered keys */
    uint32_t *victims;
    size_t victims_cap;
    uint32_t *dedup;
    size_t dedup_cap, dedup_mask;
    struct kvt_key *scratch; /* complete_store: the keys of the stored event */
    size_t scratch_cap;
    /* prepare_store scratch for the request's access: each key to store's index
     * in the access, and the hashes of the new store misses */
    uint32_t *acc_idx;
    uint32_t *ins_end; /* each key to store's index cell where its find ended */
    uint64_t *miss_hash;
    size_t miss_cap;
    uint32_t *cs_slot; /* complete_store: the slot of each key */
    size_t cs_cap;
    /* request_finished / touch scratch: the order of the keys, their slots and
     * kinds in prefix order */
    uint32_t *fin_order;
    uint32_t *fin_slots;
    uint8_t *fin_kinds;
    size_t fin_cap;
    uint64_t generation; /* bumped by reset_cache: stale accesses start over */
    /* A finished request's access arrays (records and table), kept for the next
     * request to record into: a request of hundreds of keys then allocates, grows
     * and rehashes nothing while it stores. At most PR_SPARE_MAX records. */
    struct pr_acc_key *spare_k;
    uint32_t *spare_tab;
    size_t spare_cap, spare_tab_mask;
    bool spare_tab_clean; /* spare_tab is all empty (its access put nothing in it) */

    struct kvt_events events;
    kvt_primary_removed_fn on_removed; /* secondary-tier observer, or NULL */
    void *on_removed_arg;
    struct kvt_stats pending_stats; /* allocation-size histogram since last get_stats */

    /* [num_chunks] the slots' fence words (kvt_primary_fence_words): odd while the
     * slot's bytes may change, even when they are stable; never the same value
     * twice for one slot (up to wrap-around). Written here, read by peers' NICs. */
    _Atomic uint32_t *fence;

    struct kvt_region *region;
    uint8_t *base;
    size_t mem_bytes; /* mapped for rows of our own (kvt_calloc_table, >= 2 MiB), no region */
};

static inline bool pr_key_ok(const struct kvt_key *k)
{
    return k->len >= 1 && k->len <= KVT_KEY_MAX;
}

/* Whether len bytes at a and b are equal, inline: 8 bytes at a time, the last word
 * overlapping the one before (keys are 36 bytes in vLLM; a call to memcmp and its
 * length dispatch cost more than the compare on every hit). */
static inline bool pr_bytes_eq(const uint8_t *a, const uint8_t *b, size_t len)
{
    uint64_t x, y, diff = 0;

    if (len < 8)
        return memcmp(a, b, len) == 0;
    for (size_t i = 0; i + 8 < len; i += 8) {
        memcpy(&x, a + i, 8);
        memcpy(&y, b + i, 8);
        diff |= x ^ y;
    }
    memcpy(&x, a + len - 8, 8);
    memcpy(&y, b + len - 8, 8);
    return (diff | (x ^ y)) == 0;
}

static inline bool pr_key_eq(const struct kvt_key *a, const struct kvt_key *b)
{
    return a->len == b->len && pr_bytes_eq(a->bytes, b->bytes, a->len);
}

/* Open-addressing tables of 64-bit cells, tag << 32 | id + 1 (0 = empty), with
 * linear probing and backward-shift deletion (no tombstones, so probe runs stay
 * short). The tag is 32 bits of the key's hash: it places the cell (its home is
 * tag * size >> 32, so a table of any size works and takes exactly the cells its
 * load factor asks for) and filters probes without reading what the id names;
 * deletion moves cells by their tags alone. */
static inline uint64_t kvt_oa_cell(uint64_t hash, uint32_t id)
{
    return ((uint64_t)(uint32_t)hash << 32) | ((uint64_t)id + 1);
}

static inline uint32_t kvt_oa_id(uint64_t cell)
{
    return (uint32_t)cell - 1;
}

static inline bool kvt_oa_tag_is(uint64_t cell, uint64_t hash)
{
    return (uint32_t)(cell >> 32) == (uint32_t)hash;
}

static inline size_t kvt_oa_home(uint64_t hash, size_t size)
{
    return (size_t)(((uint64_t)(uint32_t)hash * size) >> 32);
}

static inline size_t kvt_oa_next(size_t i, size_t size)
{
    return i + 1 == size ? 0 : i + 1;
}

/* cell must not be present; the table must have an empty cell. */
void kvt_oa_put(uint64_t *cells, size_t size, uint64_t cell);
/* cell must be present. */
void kvt_oa_del(uint64_t *cells, size_t size, uint64_t cell);

/* Slot of key or PR_NIL. */
uint32_t kvt_pr_find(const struct kvt_primary *p, const struct kvt_key *key);

#define PR_GROUP 16 /* keys whose cache misses are overlapped */

/* kvt_pr_find of up to PR_GROUP keys with their cache misses overlapped: every
 * key's index cell is requested before the first is read, and every candidate
 * entry before the first key compare, so a group in a large table waits for about
 * two memory latencies instead of two per key. h[] gets the hashes (0 for an
 * invalid key, whose slot is PR_NIL). The slots stay valid until an entry is
 * released. */
void kvt_pr_find_group(const struct kvt_primary *p, const struct kvt_key *keys, size_t n,
                       uint64_t *h, uint32_t *slot);

/* A policy's finish: calls move(p, slots[i], kinds[i]) for i from n - 1 down to 0
 * (the tail of a prefix first), with the neighbours of entries a few moves ahead
 * requested early. */
typedef void pr_move_fn(struct kvt_primary *p, uint32_t s, uint8_t kind);
void kvt_pr_finish_each(struct kvt_primary *p, const uint32_t *slots, const uint8_t *kinds,
                        size_t n, pr_move_fn *move);

/* Starts the cache misses of moving entry s in its list (its neighbours' links). */
static inline void pr_prefetch_links(const struct kvt_primary *p, uint32_t s)
{
    if (p->e[s].prev != PR_NIL)
        __builtin_prefetch(&p->e[p->e[s].prev].next, 1);
    if (p->e[s].next != PR_NIL)
        __builtin_prefetch(&p->e[p->e[s].next].prev, 1);
}

static inline void pr_list_init(struct pr_list *l)
{
    l->head = l->tail = PR_NIL;
    l->n = 0;
}

static inline void pr_list_append(struct kvt_primary *p, struct pr_list *l, uint8_t id, uint32_t s)
{
    struct pr_entry *x = &p->e[s];

    x->list = id;
    x->next = PR_NIL;
    x->prev = l->tail;
    if (l->tail != PR_NIL)
        p->e[l->tail].next = s;
    else
        l->head = s;
    l->tail = s;
    l->n++;
}

static inline void pr_list_unlink(struct kvt_primary *p, struct pr_list *l, uint32_t s)
{
    struct pr_entry *x = &p->e[s];

    if (x->prev != PR_NIL)
        p->e[x->prev].next = x->next;
    else
        l->head = x->next;
    if (x->next != PR_NIL)
        p->e[x->next].prev = x->prev;
    else
        l->tail = x->prev;
    x->prev = x->next = PR_NIL;
    x->list = PR_NONE;
    l->n--;
}

/* An eviction candidate: ready, unpinned, not protected by the running store. */
static inline bool pr_evictable(const struct kvt_primary *p, uint32_t s)
{
    return p->e[s].ref_cnt == 0 && p->e[s].mark != p->mark;
}

/* Walks l from the LRU end collecting up to want candidates that pass
 * pr_evictable and are not yet chosen; chosen entries get mark + 1 so a second
 * walk skips them. Returns the count found; *cursor continues the walk. */
size_t kvt_pr_collect(struct kvt_primary *p, uint32_t *cursor, size_t want, uint32_t *out);

size_t kvt_pr_list_keys(const struct kvt_primary *p, const struct pr_list *l, struct kvt_key *out,
                        size_t max);

#endif

/* SPDX-License-Identifier: Apache-2.0 */
/* ARC as vLLM's CPU tier drives it: T1 holds entries used once, T2 entries a
 * request reused; the ghost lists B1/B2 remember what T1/T2 evicted, and a store
 * miss on a ghost moves the target size of T1 (target_t1_size, 0..capacity)
 * towards the list that would have kept it.
 *
 *   insert      T1 MRU; the key leaves B1/B2
 *   store miss  a request's new store misses, in reverse: B1 hit: target +=
 *               max(1, |B2|/|B1|) (<= capacity); B2 hit: target -= max(1,
 *               |B1|/|B2|) (>= 0); the ghost moves to its MRU end. Before the
 *               store allocates (which removes the ghost), even if it fails.
 *   finish      a request's keys tail to head: one it only inserted moves to the
 *               MRU end of its list (T1 stays T1); one it reused moves T1 -> T2
 *               MRU, or to T2's MRU end; any other key stays.
 *   evict       per victim: from T1 while the simulated |T1| >= int(target), else
 *               from T2, else from T1 after all; exactly n or none. T1 victims
 *               join B1, T2 victims B2, then each ghost list is cut to capacity,
 *               oldest first.
 *
 * Ghosts keep the key's 64-bit hash (the one the primary's index uses), not the
 * key: 17 bytes instead of 90 per ghost, and there are up to 2 x capacity of
 * them, all in tables sized once at creation (touched only as ghosts arrive). A
 * hash collision (about 2^-64 per pair) could only nudge the target; a ghost never
 * answers a lookup, so it can never make the cache serve wrong bytes. */
#include <errno.h>
#include <math.h>
#include <string.h>

#include "kvt/alloc.h"
#include "kvt/primary_test.h"
#include "primary_int.h"

#define ARC_GROUP 16 /* ghosts whose index misses are overlapped */

struct ghost {
    uint32_t lo, hi;     /* the key's hash */
    uint32_t prev, next; /* list links; next also chains free nodes */
};

struct glist {
    uint32_t head, tail;
    size_t n;
};

struct arc {
    double target;
    size_t capacity;
    struct ghost *g; /* [2 x capacity] nodes: B1 and B2 are each <= capacity */
    uint8_t *in;     /* [2 x capacity] PR_L1 = B1, PR_L2 = B2, PR_NONE = free */
    size_t g_used;   /* nodes ever handed out since the last clear */
    uint32_t g_free; /* freed nodes chained through next, or PR_NIL */
    uint64_t *idx;   /* kvt_oa cells of the ghosts, by hash */
    size_t idx_size; /* 4 x capacity: load factor <= 1/2 */
    size_t n_ghosts;
    struct glist b1, b2;
};

static struct arc *arc_of(const struct kvt_primary *p)
{
    return p->pol_state;
}

/* ---- ghost set ---------------------------------------------------------- */

static uint64_t g_hash(const struct ghost *x)
{
    return (uint64_t)x->hi << 32 | x->lo;
}

static uint32_t g_find(const struct arc *a, uint64_t h)
{
    if (a->n_ghosts == 0)
        return PR_NIL;
    for (size_t i = kvt_oa_home(h, a->idx_size);; i = kvt_oa_next(i, a->idx_size)) {
        uint64_t v = a->idx[i];

        if (v == 0)
            return PR_NIL;
        if (kvt_oa_tag_is(v, h) && a->g[kvt_oa_id(v)].hi == (uint32_t)(h >> 32))
            return kvt_oa_id(v);
    }
}

static void g_prefetch(const struct arc *a, uint64_t h)
{
    __builtin_prefetch(&a->idx[kvt_oa_home(h, a->idx_size)], 1);
}

static struct glist *g_list(struct arc *a, uint8_t id)
{
    return id == PR_L1 ? &a->b1 : &a->b2;
}

static void g_append(struct arc *a, uint8_t id, uint32_t gi)
{
    struct glist *l = g_list(a, id);
    struct ghost *x = &a->g[gi];

    a->in[gi] = id;
    x->next = PR_NIL;
    x->prev = l->tail;
    if (l->tail != PR_NIL)
        a->g[l->tail].next = gi;
    else
        l->head = gi;
    l->tail = gi;
    l->n++;
}

static void g_unlink(struct arc *a, uint32_t gi)
{
    struct ghost *x = &a->g[gi];
    struct glist *l = g_list(a, a->in[gi]);

    if (x->prev != PR_NIL)
        a->g[x->prev].next = x->next;
    else
        l->head = x->next;
    if (x->next != PR_NIL)
        a->g[x->next].prev = x->prev;
    else
        l->tail = x->prev;
    l->n--;
}

/* The key of hash h is not a ghost; its list has room (g_trim). */
static void g_add(struct arc *a, uint8_t id, uint64_t h)
{
    uint32_t gi;

    if (a->g_free != PR_NIL) {
        gi = a->g_free;
        a->g_free = a->g[gi].next;
    } else {
        gi = (uint32_t)a->g_used++;
    }
    a->g[gi].lo = (uint32_t)h;
    a->g[gi].hi = (uint32_t)(h >> 32);
    g_append(a, id, gi);
    kvt_oa_put(a->idx, a->idx_size, kvt_oa_cell(h, gi));
    a->n_ghosts++;
}

static void g_drop(struct arc *a, uint32_t gi)
{
    g_unlink(a, gi);
    kvt_oa_del(a->idx, a->idx_size, kvt_oa_cell(g_hash(&a->g[gi]), gi));
    a->in[gi] = PR_NONE;
    a->g[gi].next = a->g_free;
    a->g_free = gi;
    a->n_ghosts--;
}

/* Cuts a ghost list to max entries, oldest first, a group at a time with the
 * group's index misses requested before the first drop. */
static void g_trim(struct arc *a, struct glist *l, size_t max)
{
    while (l->n > max) {
        uint32_t drop[ARC_GROUP];
        size_t m = 0;

        for (uint32_t gi = l->head; gi != PR_NIL && m < ARC_GROUP && l->n - m > max;
             gi = a->g[gi].next) {
            drop[m++] = gi;
            g_prefetch(a, g_hash(&a->g[gi]));
        }
        for (size_t i = 0; i < m; i++)
            g_drop(a, drop[i]);
    }
}

static void g_clear(struct arc *a)
{
    a->b1 = (struct glist){PR_NIL, PR_NIL, 0};
    a->b2 = (struct glist){PR_NIL, PR_NIL, 0};
    a->g_used = a->n_ghosts = 0;
    a->g_free = PR_NIL;
    kvt_zero_table(a->idx, a->idx_size, sizeof(*a->idx));
}

/* ---- policy ------------------------------------------------------------- */

static void arc_fini(struct kvt_primary *p)
{
    struct arc *a = arc_of(p);

    if (a == NULL)
        return;
    kvt_free_table(a->g, 2 * a->capacity, sizeof(*a->g));
    kvt_free_table(a->in, 2 * a->capacity, sizeof(*a->in));
    kvt_free_table(a->idx, a->idx_size, sizeof(*a->idx));
    kvt_free(a);
    p->pol_state = NULL;
}

static int arc_init(struct kvt_primary *p)
{
    struct arc *a = kvt_calloc(1, sizeof(*a));

    if (a == NULL)
        return -ENOMEM;
    p->pol_state = a;
    a->capacity = p->cfg.num_chunks;
    a->idx_size = 4 * a->capacity;
    if (2 * a->capacity > UINT32_MAX - 1) { /* ghost ids are 32-bit */
        arc_fini(p);
        return -EINVAL;
    }
    a->g = kvt_calloc_table(2 * a->capacity, sizeof(*a->g));
    a->in = kvt_calloc_table(2 * a->capacity, sizeof(*a->in));
    a->idx = kvt_calloc_table(a->idx_size, sizeof(*a->idx));
    if (a->g == NULL || a->in == NULL || a->idx == NULL) {
        arc_fini(p);
        return -ENOMEM;
    }
    g_clear(a);
    return 0;
}

static void arc_will_insert(struct kvt_primary *p, const uint64_t *hashes, size_t n)
{
    struct arc *a = arc_of(p);

    if (a->n_ghosts == 0)
        return;
    for (size_t i = 0; i < n; i++)
        g_prefetch(a, hashes[i]);
}

static void arc_insert(struct kvt_primary *p, const uint32_t *slots, size_t n)
{
    struct arc *a = arc_of(p);

    for (size_t i = 0; i < n; i++) {
        pr_list_append(p, &p->l1, PR_L1, slots[i]);
        if (a->n_ghosts > 0) {
            uint32_t gi = g_find(a, p->e[slots[i]].hash);

            if (gi != PR_NIL)
                g_drop(a, gi);
        }
    }
}

static void arc_remove(struct kvt_primary *p, uint32_t s)
{
    pr_list_unlink(p, p->e[s].list == PR_L1 ? &p->l1 : &p->l2, s);
}

static void arc_move(struct kvt_primary *p, uint32_t s, uint8_t kind)
{
    struct pr_list *from = p->e[s].list == PR_L1 ? &p->l1 : &p->l2;

    if (kind == PR_ACC_INSERTED_ONLY) {
        uint8_t id = p->e[s].list;

        /* a store is not a frequency hit: recency only, in the same list */
        pr_list_unlink(p, from, s);
        pr_list_append(p, from, id, s);
    } else if (kind == PR_ACC_REUSED) {
        pr_list_unlink(p, from, s);
        pr_list_append(p, &p->l2, PR_L2, s);
    }
}

static void arc_finish(struct kvt_primary *p, const uint32_t *slots, const uint8_t *kinds, size_t n)
{
    kvt_pr_finish_each(p, slots, kinds, n, arc_move);
}

static void arc_store_miss(struct kvt_primary *p, const uint64_t *hashes, size_t n)
{
    struct arc *a = arc_of(p);

    if (a->n_ghosts == 0)
        return;
    for (size_t i = 0; i < n && i < ARC_GROUP; i++)
        g_prefetch(a, hashes[n - 1 - i]);
    for (size_t i = n; i-- > 0;) {
        uint32_t gi;
        double delta;

        if (i >= ARC_GROUP)
            g_prefetch(a, hashes[i - ARC_GROUP]);
        if ((gi = g_find(a, hashes[i])) == PR_NIL)
            continue;
        if (a->in[gi] == PR_L1) {
            delta = fmax(1.0, (double)a->b2.n / (double)a->b1.n);
            a->target = fmin(a->target + delta, (double)a->capacity);
        } else {
            delta = fmax(1.0, (double)a->b1.n / (double)a->b2.n);
            a->target = fmax(a->target - delta, 0.0);
        }
        g_unlink(a, gi);
        g_append(a, a->in[gi], gi);
    }
}

static int arc_evict(struct kvt_primary *p, size_t n, uint32_t *victims)
{
    struct arc *a = arc_of(p);
    uint32_t c1 = p->l1.head, c2 = p->l2.head;
    size_t virtual_t1 = p->l1.n;
    size_t limit = (size_t)floor(a->target);
    size_t to_b1 = 0;

    for (size_t i = 0; i < n; i++) {
        bool found = false;

        if (virtual_t1 >= limit && kvt_pr_collect(p, &c1, 1, &victims[i]) == 1) {
            virtual_t1--;
            found = true;
        }
        if (!found && kvt_pr_collect(p, &c2, 1, &victims[i]) == 1)
            found = true;
        if (!found && kvt_pr_collect(p, &c1, 1, &victims[i]) == 1) {
            virtual_t1--;
            found = true;
        }
        if (!found)
            return -ENOSPC;
    }
    /* Each ghost list is cut to capacity, oldest first, before the victims join
     * (n <= capacity, so the cut only ever takes old ghosts: the same lists as
     * cutting after, and never more than 2 x capacity ghosts). */
    for (size_t i = 0; i < n; i++)
        to_b1 += p->e[victims[i]].list == PR_L1;
    g_trim(a, &a->b1, a->capacity - to_b1);
    g_trim(a, &a->b2, a->capacity - (n - to_b1));
    /* In groups, the new ghosts' index misses requested before the first put. */
    for (size_t b = 0; b < n; b += ARC_GROUP) {
        size_t m = n - b < ARC_GROUP ? n - b : ARC_GROUP;

        for (size_t i = 0; i < m; i++)
            g_prefetch(a, p->e[victims[b + i]].hash);
        for (size_t i = 0; i < m; i++) {
            uint32_t s = victims[b + i];
            uint8_t from = p->e[s].list;

            pr_list_unlink(p, from == PR_L1 ? &p->l1 : &p->l2, s);
            g_add(a, from, p->e[s].hash);
        }
    }
    return 0;
}

static void arc_clear(struct kvt_primary *p)
{
    struct arc *a = arc_of(p);

    a->target = 0;
    g_clear(a);
}

static size_t arc_list(const struct kvt_primary *p, int which, struct kvt_key *out, size_t max)
{
    if (which == 0)
        return kvt_pr_list_keys(p, &p->l1, out, max);
    if (which == 1)
        return kvt_pr_list_keys(p, &p->l2, out, max);
    return 0;
}

static size_t arc_mem_bytes(const struct kvt_primary *p)
{
    const struct arc *a = arc_of(p);

    return sizeof(*a) + 2 * a->capacity * (sizeof(*a->g) + sizeof(*a->in)) +
           a->idx_size * sizeof(*a->idx);
}

const struct pr_policy_ops kvt_pr_arc_ops = {
    .name = "arc",
    .init = arc_init,
    .fini = arc_fini,
    .will_insert = arc_will_insert,
    .insert = arc_insert,
    .remove = arc_remove,
    .store_miss = arc_store_miss,
    .finish = arc_finish,
    .evict = arc_evict,
    .clear = arc_clear,
    .list = arc_list,
    .mem_bytes = arc_mem_bytes,
};

/* ---- introspection (kvt/primary.h) -------------------------------------- */

double kvt_primary_arc_target(const struct kvt_primary *p)
{
    return p->pol == &kvt_pr_arc_ops ? arc_of(p)->target : 0;
}

int kvt_primary_arc_ghost_of(const struct kvt_primary *p, const struct kvt_key *key)
{
    uint32_t gi;

    if (p->pol != &kvt_pr_arc_ops || !pr_key_ok(key))
        return 0;
    gi = g_find(arc_of(p), kvt_key_hash(key));
    return gi == PR_NIL ? 0 : arc_of(p)->in[gi];
}

size_t kvt_primary_arc_ghost_len(const struct kvt_primary *p, int which)
{
    if (p->pol != &kvt_pr_arc_ops)
        return 0;
    return which == 1 ? arc_of(p)->b1.n : which == 2 ? arc_of(p)->b2.n : 0;
}

void kvt__primary_arc_set_target(struct kvt_primary *p, double target)
{
    if (p->pol == &kvt_pr_arc_ops)
        arc_of(p)->target = target;
}

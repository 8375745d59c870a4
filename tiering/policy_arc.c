/* ARC (spec §2.3): T1 holds entries seen once, T2 entries seen again; the ghost
 * lists B1/B2 remember what T1/T2 evicted, and a hit on a ghost moves the target
 * size of T1 (target_t1_size, 0..capacity) towards the list that would have kept
 * it.
 *
 *   insert  T1 MRU; the key leaves B1/B2
 *   touch   keys in reverse: T1 -> T2 MRU (a write-pending entry stays in T1, at
 *           its MRU end: it was just allocated, not used twice); T2 -> MRU;
 *           B1 hit: target += max(1, |B2|/|B1|) (<= capacity); B2 hit:
 *           target -= max(1, |B1|/|B2|) (>= 0); the ghost moves to its MRU end
 *   evict   per victim: from T1 while the simulated |T1| >= int(target), else
 *           from T2, else (newest upstream) from T1 after all; exactly n or none.
 *           T1 victims join B1, T2 victims B2, then each ghost list is cut to
 *           capacity, oldest first.
 *
 * Ghosts keep a 128-bit XXH3 fingerprint of the key, not the key: 32 bytes
 * instead of 90 per ghost, and there are up to 2 x capacity of them. A
 * fingerprint collision (about 2^-128 per pair) could only nudge the target; a
 * ghost never answers a lookup, so it can never make the cache serve wrong bytes. */
#include <errno.h>
#include <math.h>
#include <string.h>
#include <xxhash.h>

#include "kvt/alloc.h"
#include "primary_int.h"

#define ARC_GROUP 16 /* ghosts whose index misses are overlapped */

struct ghost {
    uint64_t lo, hi;
    uint32_t prev, next;
    uint8_t list; /* PR_L1 = B1, PR_L2 = B2, PR_NONE = free */
};

struct glist {
    uint32_t head, tail;
    size_t n;
};

struct arc {
    double target;
    size_t capacity;
    struct ghost *g; /* node pool, grown on demand */
    size_t g_cap, g_used;
    uint32_t *g_free; /* freed nodes (stack), sized g_cap */
    size_t n_free;
    uint64_t *idx; /* fingerprint tag << 32 | node + 1 by fingerprint; 0 = empty */
    size_t idx_mask;
    size_t n_ghosts;
    struct glist b1, b2;
};

static struct arc *arc_of(const struct kvt_primary *p)
{
    return p->pol_state;
}

/* ---- ghost set ---------------------------------------------------------- */

static XXH128_hash_t fp_of(const struct kvt_key *k)
{
    return XXH3_128bits(k->bytes, k->len);
}

/* Index cells as in the primary's index (primary.c): the low 32 bits of the
 * fingerprint hold the home and filter probes without reading ghost nodes. */
static inline uint64_t g_cell(uint64_t lo, uint32_t gi)
{
    return ((uint64_t)(uint32_t)lo << 32) | ((uint64_t)gi + 1);
}

static inline size_t g_home(const struct arc *a, uint64_t lo)
{
    return (size_t)(uint32_t)lo & a->idx_mask;
}

static uint32_t g_find(const struct arc *a, XXH128_hash_t fp)
{
    uint64_t tag = (uint64_t)(uint32_t)fp.low64 << 32;

    if (a->n_ghosts == 0)
        return PR_NIL;
    for (size_t i = g_home(a, fp.low64);; i = (i + 1) & a->idx_mask) {
        uint64_t v = a->idx[i];
        uint32_t gi = (uint32_t)v - 1;

        if (v == 0)
            return PR_NIL;
        if ((v & 0xffffffff00000000ull) == tag && a->g[gi].lo == fp.low64 &&
            a->g[gi].hi == fp.high64)
            return gi;
    }
}

static void g_prefetch(const struct arc *a, uint64_t lo)
{
    __builtin_prefetch(&a->idx[g_home(a, lo)], 1);
}

static void g_idx_put(struct arc *a, uint32_t gi)
{
    size_t i = g_home(a, a->g[gi].lo);

    while (a->idx[i] != 0)
        i = (i + 1) & a->idx_mask;
    a->idx[i] = g_cell(a->g[gi].lo, gi);
}

static void g_idx_del(struct arc *a, uint32_t gi)
{
    size_t mask = a->idx_mask;
    uint64_t cell = g_cell(a->g[gi].lo, gi);
    size_t i = g_home(a, a->g[gi].lo);

    while (a->idx[i] != cell)
        i = (i + 1) & mask;
    for (size_t j = (i + 1) & mask;; j = (j + 1) & mask) {
        uint64_t v = a->idx[j];
        size_t home;

        if (v == 0)
            break;
        home = (size_t)(v >> 32) & mask;
        if (((j - home) & mask) >= ((j - i) & mask)) {
            a->idx[i] = v;
            i = j;
        }
    }
    a->idx[i] = 0;
}

/* Room for `more` ghosts beyond the current ones, before anything changes. */
static int g_reserve(struct arc *a, size_t more)
{
    size_t want = a->n_ghosts + more;

    if (a->g_cap - a->g_used + a->n_free < more) {
        size_t cap = a->g_cap ? a->g_cap : 64;
        struct ghost *g;
        uint32_t *f;

        while (cap - a->g_used + a->n_free < more)
            cap *= 2;
        g = kvt_reallocarray(a->g, cap, sizeof(*g));
        if (g == NULL)
            return -ENOMEM;
        a->g = g;
        f = kvt_reallocarray(a->g_free, cap, sizeof(*f));
        if (f == NULL)
            return -ENOMEM;
        a->g_free = f;
        a->g_cap = cap;
    }
    if (2 * want > a->idx_mask + 1) {
        size_t size = a->idx_mask + 1;
        uint64_t *idx;

        while (2 * want > size)
            size *= 2;
        idx = kvt_calloc_table(size, sizeof(*idx));
        if (idx == NULL)
            return -ENOMEM;
        kvt_free_table(a->idx, a->idx_mask + 1, sizeof(*a->idx));
        a->idx = idx;
        a->idx_mask = size - 1;
        for (uint32_t gi = 0; gi < a->g_used; gi++)
            if (a->g[gi].list != PR_NONE)
                g_idx_put(a, gi);
    }
    return 0;
}

static struct glist *g_list(struct arc *a, uint8_t id)
{
    return id == PR_L1 ? &a->b1 : &a->b2;
}

static void g_append(struct arc *a, uint8_t id, uint32_t gi)
{
    struct glist *l = g_list(a, id);
    struct ghost *x = &a->g[gi];

    x->list = id;
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
    struct glist *l = g_list(a, x->list);

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

/* Needs room from g_reserve. */
static void g_add(struct arc *a, uint8_t id, XXH128_hash_t fp)
{
    uint32_t gi = a->n_free > 0 ? a->g_free[--a->n_free] : (uint32_t)a->g_used++;

    a->g[gi].lo = fp.low64;
    a->g[gi].hi = fp.high64;
    g_append(a, id, gi);
    g_idx_put(a, gi);
    a->n_ghosts++;
}

static void g_drop(struct arc *a, uint32_t gi)
{
    g_unlink(a, gi);
    g_idx_del(a, gi);
    a->g[gi].list = PR_NONE;
    a->g_free[a->n_free++] = gi;
    a->n_ghosts--;
}

/* Cuts a ghost list to capacity, oldest first. */
static void g_trim(struct arc *a, struct glist *l)
{
    while (l->n > a->capacity) {
        uint32_t drop[ARC_GROUP];
        size_t m = 0;

        for (uint32_t gi = l->head; gi != PR_NIL && m < ARC_GROUP && l->n - m > a->capacity;
             gi = a->g[gi].next) {
            drop[m++] = gi;
            g_prefetch(a, a->g[gi].lo);
        }
        for (size_t i = 0; i < m; i++)
            g_drop(a, drop[i]);
    }
}

static void g_clear(struct arc *a)
{
    a->b1 = (struct glist){PR_NIL, PR_NIL, 0};
    a->b2 = (struct glist){PR_NIL, PR_NIL, 0};
    a->g_used = a->n_free = a->n_ghosts = 0;
    memset(a->idx, 0, (a->idx_mask + 1) * sizeof(*a->idx));
}

/* ---- policy ------------------------------------------------------------- */

static int arc_init(struct kvt_primary *p)
{
    struct arc *a = kvt_calloc(1, sizeof(*a));

    if (a == NULL)
        return -ENOMEM;
    a->capacity = p->cfg.num_chunks;
    a->idx = kvt_calloc_table(64, sizeof(*a->idx));
    if (a->idx == NULL) {
        kvt_free(a);
        return -ENOMEM;
    }
    a->idx_mask = 63;
    g_clear(a);
    p->pol_state = a;
    return 0;
}

static void arc_fini(struct kvt_primary *p)
{
    struct arc *a = arc_of(p);

    if (a == NULL)
        return;
    kvt_free(a->g);
    kvt_free(a->g_free);
    kvt_free_table(a->idx, a->idx_mask + 1, sizeof(*a->idx));
    kvt_free(a);
    p->pol_state = NULL;
}

static void arc_will_insert(struct kvt_primary *p, const struct kvt_key *keys, size_t n)
{
    struct arc *a = arc_of(p);

    if (a->n_ghosts == 0)
        return;
    for (size_t i = 0; i < n; i++)
        g_prefetch(a, fp_of(&keys[i]).low64);
}

static void arc_insert(struct kvt_primary *p, uint32_t s)
{
    struct arc *a = arc_of(p);

    pr_list_append(p, &p->l1, PR_L1, s);
    if (a->n_ghosts > 0) {
        uint32_t gi = g_find(a, fp_of(&p->e[s].key));

        if (gi != PR_NIL)
            g_drop(a, gi);
    }
}

static void arc_remove(struct kvt_primary *p, uint32_t s)
{
    pr_list_unlink(p, p->e[s].list == PR_L1 ? &p->l1 : &p->l2, s);
}

static void arc_touch_one(struct kvt_primary *p, const struct kvt_key *key, uint32_t s)
{
    struct arc *a = arc_of(p);
    uint32_t gi;
    double delta;

    if (s != PR_NIL) {
        if (p->e[s].list == PR_L1) {
            pr_list_unlink(p, &p->l1, s);
            if (p->e[s].ref_cnt < 0)
                pr_list_append(p, &p->l1, PR_L1, s);
            else
                pr_list_append(p, &p->l2, PR_L2, s);
        } else {
            pr_list_unlink(p, &p->l2, s);
            pr_list_append(p, &p->l2, PR_L2, s);
        }
        return;
    }
    if (!pr_key_ok(key) || (gi = g_find(a, fp_of(key))) == PR_NIL)
        return;
    if (a->g[gi].list == PR_L1) {
        delta = fmax(1.0, (double)a->b2.n / (double)a->b1.n);
        a->target = fmin(a->target + delta, (double)a->capacity);
    } else {
        delta = fmax(1.0, (double)a->b1.n / (double)a->b2.n);
        a->target = fmax(a->target - delta, 0.0);
    }
    g_unlink(a, gi);
    g_append(a, a->g[gi].list, gi);
}

static void arc_touch(struct kvt_primary *p, const struct kvt_key *keys, size_t n)
{
    kvt_pr_touch_each(p, keys, n, arc_touch_one);
}

static int arc_evict(struct kvt_primary *p, size_t n, uint32_t *victims)
{
    struct arc *a = arc_of(p);
    uint32_t c1 = p->l1.head, c2 = p->l2.head;
    size_t virtual_t1 = p->l1.n;
    size_t limit = (size_t)floor(a->target);
    int rc;

    rc = g_reserve(a, n);
    if (rc != 0)
        return rc;
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
    /* In groups, each ghost-index miss requested before the first is waited for:
     * the new ghosts' cells, then the cells of the oldest ghosts that leave. */
    for (size_t b = 0; b < n; b += ARC_GROUP) {
        size_t m = n - b < ARC_GROUP ? n - b : ARC_GROUP;
        XXH128_hash_t fp[ARC_GROUP];

        for (size_t i = 0; i < m; i++) {
            fp[i] = fp_of(&p->e[victims[b + i]].key);
            g_prefetch(a, fp[i].low64);
        }
        for (size_t i = 0; i < m; i++) {
            uint32_t s = victims[b + i];
            uint8_t from = p->e[s].list;

            pr_list_unlink(p, from == PR_L1 ? &p->l1 : &p->l2, s);
            g_add(a, from, fp[i]);
        }
    }
    g_trim(a, &a->b1);
    g_trim(a, &a->b2);
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

    return sizeof(*a) + a->g_cap * (sizeof(*a->g) + sizeof(*a->g_free)) +
           (a->idx_mask + 1) * sizeof(*a->idx);
}

const struct pr_policy_ops kvt_pr_arc_ops = {
    .name = "arc",
    .init = arc_init,
    .fini = arc_fini,
    .will_insert = arc_will_insert,
    .insert = arc_insert,
    .remove = arc_remove,
    .touch = arc_touch,
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
    gi = g_find(arc_of(p), fp_of(key));
    return gi == PR_NIL ? 0 : arc_of(p)->g[gi].list;
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

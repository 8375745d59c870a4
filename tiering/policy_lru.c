/* LRU, the simple form of spec §2.3: one list from LRU (head) to MRU (tail).
 * insert appends at the MRU end; touch walks the keys in reverse and moves each
 * present one to the MRU end, so the head of a prefix ends most recent and its
 * tail is evicted first; evict takes the LRU-most candidates, exactly n or none.
 * Pinning does not move an entry: recency is logical. */
#include <errno.h>

#include "primary_int.h"

static int lru_init(struct kvt_primary *p)
{
    (void)p;
    return 0;
}

static void lru_fini(struct kvt_primary *p)
{
    (void)p;
}

static void lru_insert(struct kvt_primary *p, uint32_t s)
{
    pr_list_append(p, &p->l1, PR_L1, s);
}

static void lru_remove(struct kvt_primary *p, uint32_t s)
{
    pr_list_unlink(p, &p->l1, s);
}

static void lru_touch_one(struct kvt_primary *p, const struct kvt_key *key, uint64_t h, uint32_t s)
{
    (void)key;
    (void)h;
    if (s == PR_NIL)
        return;
    pr_list_unlink(p, &p->l1, s);
    pr_list_append(p, &p->l1, PR_L1, s);
}

static void lru_touch(struct kvt_primary *p, const struct kvt_key *keys, size_t n)
{
    kvt_pr_touch_each(p, keys, n, lru_touch_one);
}

static int lru_evict(struct kvt_primary *p, size_t n, uint32_t *victims)
{
    uint32_t cursor = p->l1.head;

    if (kvt_pr_collect(p, &cursor, n, victims) < n)
        return -ENOSPC;
    for (size_t i = 0; i < n; i++)
        pr_list_unlink(p, &p->l1, victims[i]);
    return 0;
}

static void lru_clear(struct kvt_primary *p)
{
    (void)p; /* the primary resets the lists */
}

static size_t lru_list(const struct kvt_primary *p, int which, struct kvt_key *out, size_t max)
{
    return which == 0 ? kvt_pr_list_keys(p, &p->l1, out, max) : 0;
}

static size_t lru_mem_bytes(const struct kvt_primary *p)
{
    (void)p;
    return 0;
}

const struct pr_policy_ops kvt_pr_lru_ops = {
    .name = "lru",
    .init = lru_init,
    .fini = lru_fini,
    .insert = lru_insert,
    .remove = lru_remove,
    .touch = lru_touch,
    .evict = lru_evict,
    .clear = lru_clear,
    .list = lru_list,
    .mem_bytes = lru_mem_bytes,
};

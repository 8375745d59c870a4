/* SPDX-License-Identifier: Apache-2.0 */
/* LRU, vLLM's rank LRU as its CPU tier drives it: every entry has a rank, a new
 * one at insert and another at its request's finish, and the entry of lowest rank
 * that can be evicted goes first. vLLM keeps (rank, key) in a lazy heap of the
 * evictable entries; a rank here is a place in one list from LRU (head) to MRU
 * (tail), which is the same order because every new rank is the highest yet
 * (request ranks ordered by token position only exist with positions, which
 * kvtier's requests do not carry):
 *   insert  appends at the MRU end;
 *   finish  walks the request's keys tail to head and moves each present one to
 *           the MRU end, whatever the request did with it;
 *   evict   takes the LRU-most candidates, exactly n or none.
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

static void lru_insert(struct kvt_primary *p, const uint32_t *slots, size_t n)
{
    for (size_t i = 0; i < n; i++)
        pr_list_append(p, &p->l1, PR_L1, slots[i]);
}

static void lru_remove(struct kvt_primary *p, uint32_t s)
{
    pr_list_unlink(p, &p->l1, s);
}

static void lru_move(struct kvt_primary *p, uint32_t s, uint8_t kind)
{
    (void)kind;
    pr_list_unlink(p, &p->l1, s);
    pr_list_append(p, &p->l1, PR_L1, s);
}

static void lru_finish(struct kvt_primary *p, const uint32_t *slots, const uint8_t *kinds, size_t n)
{
    kvt_pr_finish_each(p, slots, kinds, n, lru_move);
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
    .finish = lru_finish,
    .evict = lru_evict,
    .clear = lru_clear,
    .list = lru_list,
    .mem_bytes = lru_mem_bytes,
};

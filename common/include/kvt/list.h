/* SPDX-License-Identifier: Apache-2.0 */
/* Intrusive doubly linked circular list (the kernel's / UCX's shape). */
#ifndef KVT_LIST_H
#define KVT_LIST_H

#include <stdbool.h>
#include "kvt/common.h"

struct kvt_list {
    struct kvt_list *prev, *next;
};

static inline void kvt_list_init(struct kvt_list *h)
{
    h->prev = h->next = h;
}
static inline bool kvt_list_empty(const struct kvt_list *h)
{
    return h->next == h;
}
static inline void kvt_list__insert(struct kvt_list *n, struct kvt_list *prev,
                                    struct kvt_list *next)
{
    n->prev = prev;
    n->next = next;
    prev->next = n;
    next->prev = n;
}
static inline void kvt_list_add_tail(struct kvt_list *h, struct kvt_list *n)
{
    kvt_list__insert(n, h->prev, h);
}
static inline void kvt_list_add_head(struct kvt_list *h, struct kvt_list *n)
{
    kvt_list__insert(n, h, h->next);
}
static inline void kvt_list_del(struct kvt_list *n)
{
    n->prev->next = n->next;
    n->next->prev = n->prev;
    n->prev = n->next = n;
}

/* Moves every entry of from, in order, onto to (made empty first); from is left empty. */
static inline void kvt_list_move_all(struct kvt_list *from, struct kvt_list *to)
{
    kvt_list_init(to);
    if (kvt_list_empty(from))
        return;
    to->next = from->next;
    to->prev = from->prev;
    to->next->prev = to;
    to->prev->next = to;
    kvt_list_init(from);
}

#define kvt_list_entry(ptr, type, member) KVT_CONTAINER_OF(ptr, type, member)
#define kvt_list_for_each_safe(pos, tmp, head)                                                     \
    for ((pos) = (head)->next, (tmp) = (pos)->next; (pos) != (head);                               \
         (pos) = (tmp), (tmp) = (pos)->next)

#endif

/* SPDX-License-Identifier: Apache-2.0 */
/* A process-private hash map from byte strings to pointers: open addressing with
 * linear probing and backward-shift deletion (no tombstones), XXH3 hashes, full key
 * compare. The map copies keys (up to KVT_MAP_KEY_MAX bytes) and never owns values.
 *
 * Iteration order is insertion order where callers need it (the manager's
 * "for each pending request, in insertion order"): entries live in a dense array,
 * the probe table holds indices into it, and deletion moves the last entry into the
 * hole only when order is not requested (KVT_MAP_ORDERED keeps order with holes that
 * iteration skips and compaction removes). */
#ifndef KVT_MAP_H
#define KVT_MAP_H

#include <stddef.h>
#include <stdint.h>
#include <stdbool.h>

#define KVT_MAP_KEY_MAX 128

struct kvt_map_entry {
    uint64_t hash;
    void *value;
    uint8_t key_len;
    bool live;
    uint8_t key[KVT_MAP_KEY_MAX];
};

struct kvt_map {
    struct kvt_map_entry *entries; /* dense, insertion order, may hold dead entries */
    size_t n_entries;              /* used part of entries (live + dead) */
    size_t cap_entries;
    size_t n_live;
    uint32_t *table; /* index+1 into entries, 0 = empty */
    size_t table_mask;
};

void kvt_map_init(struct kvt_map *m);
void kvt_map_cleanup(struct kvt_map *m);
void kvt_map_clear(struct kvt_map *m);
static inline size_t kvt_map_size(const struct kvt_map *m)
{
    return m->n_live;
}
/* Returns the value or NULL. */
void *kvt_map_get(const struct kvt_map *m, const void *key, size_t len);
/* Inserts or replaces. 0, -EINVAL (key too long), -ENOMEM. */
int kvt_map_put(struct kvt_map *m, const void *key, size_t len, void *value);
/* Removes; returns the old value or NULL. */
void *kvt_map_remove(struct kvt_map *m, const void *key, size_t len);

static inline void *kvt_map_get_u64(const struct kvt_map *m, uint64_t k)
{
    return kvt_map_get(m, &k, sizeof(k));
}
static inline int kvt_map_put_u64(struct kvt_map *m, uint64_t k, void *v)
{
    return kvt_map_put(m, &k, sizeof(k), v);
}
static inline void *kvt_map_remove_u64(struct kvt_map *m, uint64_t k)
{
    return kvt_map_remove(m, &k, sizeof(k));
}

/* Iteration in insertion order: for (i = 0; kvt_map_next(m, &i, &e);) ...
 * Removing the current entry while iterating is allowed; inserting is not. */
bool kvt_map_next(const struct kvt_map *m, size_t *iter, struct kvt_map_entry **entry_p);

#endif

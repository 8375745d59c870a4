/* SPDX-License-Identifier: Apache-2.0 */
/* Byte-keyed hash map. Layout: a dense entry array in insertion order (deleted
 * entries stay as holes until the next growth compacts them) and a power-of-two
 * probe table of entry indices (+1; 0 = empty slot). Linear probing; deletion
 * shifts later members of the probe run back, so lookups never see tombstones.
 * Load factor is kept at or below 1/2. */
#include <errno.h>
#include <string.h>

#include "kvt/alloc.h"
#include "kvt/hash.h"
#include "kvt/map.h"

void kvt_map_init(struct kvt_map *m)
{
    memset(m, 0, sizeof(*m));
}

void kvt_map_cleanup(struct kvt_map *m)
{
    kvt_free(m->entries);
    kvt_free(m->table);
    memset(m, 0, sizeof(*m));
}

void kvt_map_clear(struct kvt_map *m)
{
    m->n_entries = 0;
    m->n_live = 0;
    if (m->table != NULL)
        memset(m->table, 0, (m->table_mask + 1) * sizeof(*m->table));
}

static bool entry_matches(const struct kvt_map_entry *e, uint64_t h, const void *key, size_t len)
{
    return e->hash == h && e->key_len == len && memcmp(e->key, key, len) == 0;
}

/* Returns the table position holding key, or the empty position where it would go. */
static size_t probe(const struct kvt_map *m, uint64_t h, const void *key, size_t len, bool *found)
{
    size_t pos = (size_t)h & m->table_mask;
    for (;;) {
        uint32_t idx = m->table[pos];
        if (idx == 0) {
            *found = false;
            return pos;
        }
        if (entry_matches(&m->entries[idx - 1], h, key, len)) {
            *found = true;
            return pos;
        }
        pos = (pos + 1) & m->table_mask;
    }
}

void *kvt_map_get(const struct kvt_map *m, const void *key, size_t len)
{
    bool found;
    size_t pos;
    if (m->table == NULL || len > KVT_MAP_KEY_MAX)
        return NULL;
    pos = probe(m, kvt_hash64(key, len), key, len, &found);
    return found ? m->entries[m->table[pos] - 1].value : NULL;
}

/* Compacts the entry array (dropping holes) and rebuilds a table of table_size. */
static int rebuild(struct kvt_map *m, size_t table_size, size_t entry_cap)
{
    uint32_t *table = kvt_calloc(table_size, sizeof(*table));
    struct kvt_map_entry *entries = m->entries;
    size_t j = 0;
    if (table == NULL)
        return -ENOMEM;
    if (entry_cap != m->cap_entries) {
        entries = kvt_reallocarray(m->entries, entry_cap, sizeof(*entries));
        if (entries == NULL) {
            kvt_free(table);
            return -ENOMEM;
        }
        m->entries = entries;
        m->cap_entries = entry_cap;
    }
    for (size_t i = 0; i < m->n_entries; i++) {
        if (!entries[i].live)
            continue;
        if (i != j)
            entries[j] = entries[i];
        size_t pos = (size_t)entries[j].hash & (table_size - 1);
        while (table[pos] != 0)
            pos = (pos + 1) & (table_size - 1);
        table[pos] = (uint32_t)(j + 1);
        j++;
    }
    m->n_entries = j;
    kvt_free(m->table);
    m->table = table;
    m->table_mask = table_size - 1;
    return 0;
}

int kvt_map_put(struct kvt_map *m, const void *key, size_t len, void *value)
{
    uint64_t h;
    bool found;
    size_t pos;
    struct kvt_map_entry *e;

    if (len > KVT_MAP_KEY_MAX)
        return -EINVAL;
    h = kvt_hash64(key, len);
    if (m->table != NULL) {
        pos = probe(m, h, key, len, &found);
        if (found) {
            m->entries[m->table[pos] - 1].value = value;
            return 0;
        }
    }
    if (m->n_entries == m->cap_entries) {
        /* Full entry array: compact away holes; grow if mostly live. */
        size_t cap = m->cap_entries;
        if (m->n_live * 2 >= cap)
            cap = cap ? cap * 2 : 8;
        size_t tsize = 16;
        while (tsize < cap * 2)
            tsize *= 2;
        int rc = rebuild(m, tsize, cap);
        if (rc != 0)
            return rc;
    }
    pos = probe(m, h, key, len, &found);
    e = &m->entries[m->n_entries];
    e->hash = h;
    e->value = value;
    e->key_len = (uint8_t)len;
    e->live = true;
    memcpy(e->key, key, len);
    m->table[pos] = (uint32_t)(++m->n_entries);
    m->n_live++;
    return 0;
}

void *kvt_map_remove(struct kvt_map *m, const void *key, size_t len)
{
    bool found;
    size_t pos, next;
    struct kvt_map_entry *e;
    void *value;

    if (m->table == NULL || len > KVT_MAP_KEY_MAX)
        return NULL;
    pos = probe(m, kvt_hash64(key, len), key, len, &found);
    if (!found)
        return NULL;
    e = &m->entries[m->table[pos] - 1];
    value = e->value;
    e->live = false;
    m->n_live--;
    /* Backward-shift deletion. */
    next = pos;
    for (;;) {
        next = (next + 1) & m->table_mask;
        uint32_t idx = m->table[next];
        if (idx == 0)
            break;
        size_t home = (size_t)m->entries[idx - 1].hash & m->table_mask;
        /* Move idx back to pos if its home is not in (pos, next]. */
        if (((next - home) & m->table_mask) >= ((next - pos) & m->table_mask)) {
            m->table[pos] = idx;
            pos = next;
        }
    }
    m->table[pos] = 0;
    return value;
}

bool kvt_map_next(const struct kvt_map *m, size_t *iter, struct kvt_map_entry **entry_p)
{
    while (*iter < m->n_entries) {
        struct kvt_map_entry *e = &m->entries[(*iter)++];
        if (e->live) {
            *entry_p = e;
            return true;
        }
    }
    return false;
}

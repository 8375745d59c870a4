/* SPDX-License-Identifier: Apache-2.0 */
/* The location directory (see kvt/directory.h): a byte-keyed map from key to a small
 * heap record holding up to max_holders holders, most recent first. Records are
 * tiny and holders per key are few (a chunk lives on the few nodes that computed or
 * pulled it), so a linear scan of a record beats any structure. A key with no
 * holder left is removed from the map at once. Each node's records are counted, so a
 * node that publishes more than its limit (a hostile or broken peer flooding
 * PUBLISH) adds no more records: refreshes still go through. */
#include <errno.h>
#include <string.h>

#include "kvt/alloc.h"
#include "kvt/directory.h"
#include "kvt/map.h"

struct dir_rec {
    unsigned n;
    struct kvt_dir_holder h[]; /* max_holders long, [0] most recent */
};

struct kvt_directory {
    uint64_t ttl_ns;
    unsigned max_holders;
    size_t n_records;
    size_t node_limit;       /* records per node; 0: no limit */
    uint64_t unlimited_node; /* ... but this one's (the home's own) */
    struct kvt_map keys;     /* key bytes -> struct dir_rec */
    struct kvt_map per_node; /* node id -> its record count, as a pointer-sized int */
};

static size_t node_count(const struct kvt_directory *d, uint64_t node_id)
{
    return (size_t)(uintptr_t)kvt_map_get_u64(&d->per_node, node_id);
}

/* One record of node_id fewer: its count goes with its last record. */
static void node_dec(struct kvt_directory *d, uint64_t node_id)
{
    size_t n = node_count(d, node_id);

    d->n_records--;
    if (n <= 1)
        kvt_map_remove_u64(&d->per_node, node_id);
    else
        kvt_map_put_u64(&d->per_node, node_id, (void *)(uintptr_t)(n - 1)); /* replaces */
}

int kvt_directory_create(uint64_t ttl_ns, unsigned max_holders, struct kvt_directory **d_p)
{
    struct kvt_directory *d;

    if (ttl_ns == 0 || max_holders == 0 || max_holders > 64)
        return -EINVAL;
    d = kvt_calloc(1, sizeof(*d));
    if (d == NULL)
        return -ENOMEM;
    d->ttl_ns = ttl_ns;
    d->max_holders = max_holders;
    kvt_map_init(&d->keys);
    kvt_map_init(&d->per_node);
    *d_p = d;
    return 0;
}

void kvt_directory_destroy(struct kvt_directory *d)
{
    struct kvt_map_entry *e;

    if (d == NULL)
        return;
    for (size_t it = 0; kvt_map_next(&d->keys, &it, &e);)
        kvt_free(e->value);
    kvt_map_cleanup(&d->keys);
    kvt_map_cleanup(&d->per_node);
    kvt_free(d);
}

void kvt_directory_set_node_limit(struct kvt_directory *d, size_t max_records,
                                  uint64_t unlimited_node)
{
    d->node_limit = max_records;
    d->unlimited_node = unlimited_node;
}

static void rec_remove_at(struct dir_rec *r, unsigned i)
{
    memmove(&r->h[i], &r->h[i + 1], (r->n - i - 1) * sizeof(r->h[0]));
    r->n--;
}

/* Drops the record of key when its last holder is gone. */
static void rec_gc(struct kvt_directory *d, const uint8_t *key, size_t len, struct dir_rec *r)
{
    if (r->n == 0) {
        kvt_map_remove(&d->keys, key, len);
        kvt_free(r);
    }
}

int kvt_directory_publish(struct kvt_directory *d, uint64_t node_id, uint64_t incarnation,
                          const struct kvt_key *keys, size_t n, uint64_t now_ns)
{
    return kvt_directory_publish_rows(d, node_id, incarnation, keys, NULL, n, now_ns);
}

int kvt_directory_publish_rows(struct kvt_directory *d, uint64_t node_id, uint64_t incarnation,
                               const struct kvt_key *keys, const struct kvt_dir_row *rows, size_t n,
                               uint64_t now_ns)
{
    int rc = 0;

    for (size_t k = 0; k < n; k++) {
        struct dir_rec *r = kvt_map_get(&d->keys, keys[k].bytes, keys[k].len);
        struct kvt_dir_holder h = {
            .node_id = node_id, .incarnation = incarnation, .expires_ns = now_ns + d->ttl_ns};
        unsigned i = 0;

        if (rows != NULL && rows[k].known) {
            h.row = rows[k].row;
            h.gen = rows[k].gen;
            h.has_row = true;
        }
        for (; r != NULL && i < r->n && r->h[i].node_id != node_id; i++)
            ;
        if (r != NULL && i < r->n) { /* a refresh: the node's count stays */
            if (r->h[i].incarnation > incarnation)
                continue; /* a late message from a previous life */
            rec_remove_at(r, i);
        } else {
            size_t held = node_count(d, node_id);

            if (d->node_limit != 0 && node_id != d->unlimited_node && held >= d->node_limit) {
                rc = -ENOSPC; /* the node holds its limit: no record more */
                continue;
            }
            if (r == NULL) {
                r = kvt_malloc(sizeof(*r) + d->max_holders * sizeof(r->h[0]));
                if (r == NULL)
                    return -ENOMEM;
                r->n = 0;
                if (kvt_map_put(&d->keys, keys[k].bytes, keys[k].len, r) < 0) {
                    kvt_free(r);
                    return -ENOMEM;
                }
            }
            if (kvt_map_put_u64(&d->per_node, node_id, (void *)(uintptr_t)(held + 1)) != 0) {
                rec_gc(d, keys[k].bytes, keys[k].len, r);
                return -ENOMEM;
            }
            d->n_records++;
            if (r->n == d->max_holders)
                node_dec(d, r->h[--r->n].node_id); /* forget the least recent holder */
        }
        memmove(&r->h[1], &r->h[0], r->n * sizeof(r->h[0]));
        r->h[0] = h;
        r->n++;
    }
    return rc;
}

void kvt_directory_unpublish(struct kvt_directory *d, uint64_t node_id, uint64_t incarnation,
                             const struct kvt_key *keys, size_t n)
{
    for (size_t k = 0; k < n; k++) {
        struct dir_rec *r = kvt_map_get(&d->keys, keys[k].bytes, keys[k].len);

        if (r == NULL)
            continue;
        for (unsigned i = 0; i < r->n; i++) {
            if (r->h[i].node_id == node_id && r->h[i].incarnation <= incarnation) {
                rec_remove_at(r, i);
                node_dec(d, node_id);
                break;
            }
        }
        rec_gc(d, keys[k].bytes, keys[k].len, r);
    }
}

/* Removes the holders of r for which drop(h) is true (counted off their nodes);
 * returns how many. */
static unsigned rec_filter(struct kvt_directory *d, struct dir_rec *r,
                           bool (*drop)(const struct kvt_dir_holder *h, const void *arg),
                           const void *arg)
{
    unsigned kept = 0, dropped = 0;

    for (unsigned i = 0; i < r->n; i++) {
        if (drop(&r->h[i], arg)) {
            node_dec(d, r->h[i].node_id);
            dropped++;
        } else {
            r->h[kept++] = r->h[i];
        }
    }
    r->n = kept;
    return dropped;
}

static bool expired(const struct kvt_dir_holder *h, const void *arg)
{
    return h->expires_ns <= *(const uint64_t *)arg;
}

size_t kvt_directory_locate(struct kvt_directory *d, const struct kvt_key *key, uint64_t now_ns,
                            struct kvt_dir_holder *out, size_t max)
{
    struct dir_rec *r = kvt_map_get(&d->keys, key->bytes, key->len);
    size_t n = 0;

    if (r == NULL)
        return 0;
    (void)rec_filter(d, r, expired, &now_ns);
    for (unsigned i = 0; i < r->n && n < max; i++)
        out[n++] = r->h[i];
    rec_gc(d, key->bytes, key->len, r);
    return n;
}

struct node_filter {
    uint64_t node_id, keep_from;
};

static bool of_node(const struct kvt_dir_holder *h, const void *arg)
{
    const struct node_filter *f = arg;

    return h->node_id == f->node_id && h->incarnation < f->keep_from;
}

/* Applies drop to every record, garbage-collecting emptied keys. */
static size_t filter_all(struct kvt_directory *d,
                         bool (*drop)(const struct kvt_dir_holder *h, const void *arg),
                         const void *arg)
{
    struct kvt_map_entry *e;
    size_t dropped = 0;

    for (size_t it = 0; kvt_map_next(&d->keys, &it, &e);) {
        struct dir_rec *r = e->value;
        dropped += rec_filter(d, r, drop, arg);
        if (r->n == 0) {
            struct kvt_key k;

            kvt_key_set(&k, e->key, e->key_len); /* e is reused by the removal */
            kvt_map_remove(&d->keys, k.bytes, k.len);
            kvt_free(r);
        }
    }
    return dropped;
}

size_t kvt_directory_drop_node(struct kvt_directory *d, uint64_t node_id, uint64_t keep_from)
{
    struct node_filter f = {node_id, keep_from};

    return filter_all(d, of_node, &f);
}

size_t kvt_directory_expire(struct kvt_directory *d, uint64_t now_ns)
{
    return filter_all(d, expired, &now_ns);
}

size_t kvt_directory_retain(struct kvt_directory *d,
                            bool (*keep)(void *arg, const struct kvt_key *key), void *arg)
{
    struct kvt_map_entry *e;
    size_t dropped = 0;

    for (size_t it = 0; kvt_map_next(&d->keys, &it, &e);) {
        struct kvt_key k;
        struct dir_rec *r = e->value;

        kvt_key_set(&k, e->key, e->key_len);
        if (keep(arg, &k))
            continue;
        for (unsigned i = 0; i < r->n; i++)
            node_dec(d, r->h[i].node_id);
        kvt_map_remove(&d->keys, k.bytes, k.len);
        kvt_free(r);
        dropped++;
    }
    return dropped;
}

size_t kvt_directory_num_keys(const struct kvt_directory *d)
{
    return kvt_map_size(&d->keys);
}

size_t kvt_directory_num_records(const struct kvt_directory *d)
{
    return d->n_records;
}

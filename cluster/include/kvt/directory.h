/* SPDX-License-Identifier: Apache-2.0 */
/* The location directory a home node keeps for the keys homed on it: key -> the
 * nodes that hold it, each with the holder's incarnation and an expiry. Holders
 * publish what their primary tier stores and unpublish what it evicts; records of a
 * holder that died, or restarted with a new incarnation, are dropped; records that
 * are not refreshed within the TTL expire (a lost UNPUBLISH costs at most one TTL of
 * stale answers, and a stale answer costs one failed FETCH, never wrong bytes).
 * Scheduler thread only. */
#ifndef KVT_DIRECTORY_H
#define KVT_DIRECTORY_H

#include <stddef.h>
#include <stdint.h>
#include <stdbool.h>

#include "kvt/types.h"

struct kvt_dir_holder {
    uint64_t node_id;
    uint64_t incarnation;
    uint64_t expires_ns;
    /* Where the key sits in the holder's primary, as the holder last published it
     * (network.fetch direct): its slot and the slot's even fence word. */
    uint64_t row;
    uint32_t gen;
    bool has_row;
};

/* A published key's place in its holder's primary (known false: not sent). */
struct kvt_dir_row {
    uint64_t row;
    uint32_t gen;
    bool known;
};

struct kvt_directory;

/* max_holders: holders kept per key (the most recent publishers win). */
int kvt_directory_create(uint64_t ttl_ns, unsigned max_holders, struct kvt_directory **d_p);
void kvt_directory_destroy(struct kvt_directory *d);
/* At most max_records records per node (0: no limit, the default) but
 * unlimited_node (the home itself: its own primary bounds its records): a peer that
 * publishes without end takes no more memory than that. */
void kvt_directory_set_node_limit(struct kvt_directory *d, size_t max_records,
                                  uint64_t unlimited_node);

/* Adds or refreshes node_id as a holder of each key. A publish from an older
 * incarnation than the one recorded for that node is ignored; a newer one replaces
 * it. 0, -ENOMEM (keys before the failure stay published) or -ENOSPC: node_id holds
 * its limit of records (kvt_directory_set_node_limit), the keys it did not hold yet
 * were skipped, the others refreshed. */
int kvt_directory_publish(struct kvt_directory *d, uint64_t node_id, uint64_t incarnation,
                          const struct kvt_key *keys, size_t n, uint64_t now_ns);
/* The same, with rows[i] (NULL: none known) the place of keys[i]: a publish
 * without one forgets the place an earlier one gave. */
int kvt_directory_publish_rows(struct kvt_directory *d, uint64_t node_id, uint64_t incarnation,
                               const struct kvt_key *keys, const struct kvt_dir_row *rows, size_t n,
                               uint64_t now_ns);
/* Removes node_id (of that incarnation or older) from each key's holders. */
void kvt_directory_unpublish(struct kvt_directory *d, uint64_t node_id, uint64_t incarnation,
                             const struct kvt_key *keys, size_t n);
/* Live holders of key (expired ones are dropped on the way), most recent first;
 * returns how many were written to out (at most max). */
size_t kvt_directory_locate(struct kvt_directory *d, const struct kvt_key *key, uint64_t now_ns,
                            struct kvt_dir_holder *out, size_t max);
/* Drops every record of node_id with an incarnation below keep_from (UINT64_MAX:
 * every record of the node). Returns the number of records dropped. */
size_t kvt_directory_drop_node(struct kvt_directory *d, uint64_t node_id, uint64_t keep_from);
/* Drops expired records. Returns how many. */
size_t kvt_directory_expire(struct kvt_directory *d, uint64_t now_ns);
/* Drops every key for which keep(arg, key) is false (keys no longer homed here
 * after a membership change). Returns the number of keys dropped. */
size_t kvt_directory_retain(struct kvt_directory *d,
                            bool (*keep)(void *arg, const struct kvt_key *key), void *arg);
size_t kvt_directory_num_keys(const struct kvt_directory *d);
size_t kvt_directory_num_records(const struct kvt_directory *d);

#endif

/* SPDX-License-Identifier: Apache-2.0 */
/* Rendezvous (highest random weight) hashing of keys over the live members: the
 * member with the highest score hash(key, node id) is the key's home. When a member
 * joins or leaves, only the keys whose home it is or becomes move, and every node
 * computes the same home from the same member list with no coordination. */
#ifndef KVT_PLACEMENT_H
#define KVT_PLACEMENT_H

#include <stddef.h>
#include <stdint.h>

#include "kvt/types.h"

/* Score of one (key, node) pair; higher wins. */
uint64_t kvt_hrw_score(const struct kvt_key *key, uint64_t node_id);
/* Index into nodes[] of the key's home, or -1 when n == 0. Ties (equal scores)
 * go to the smaller node id, so the answer never depends on the array order. */
long kvt_hrw_home(const struct kvt_key *key, const uint64_t *nodes, size_t n);

#endif

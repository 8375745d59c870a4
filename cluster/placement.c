/* SPDX-License-Identifier: Apache-2.0 */
/* Rendezvous hashing (see kvt/placement.h). The score is XXH3-64 of the key seeded
 * with the node id: one pass over the key per member, no allocation, and a good
 * spread even for node ids 1, 2, 3. O(members) per key is fine for clusters of
 * tens of nodes; a few hundred would want a skeleton of virtual groups. */
#include "kvt/hash.h"
#include "kvt/placement.h"

uint64_t kvt_hrw_score(const struct kvt_key *key, uint64_t node_id)
{
    return kvt_hash64_seed(key->bytes, key->len, node_id * 0x9e3779b97f4a7c15ull + 1);
}

long kvt_hrw_home(const struct kvt_key *key, const uint64_t *nodes, size_t n)
{
    long best = -1;
    uint64_t best_score = 0;

    for (size_t i = 0; i < n; i++) {
        uint64_t s = kvt_hrw_score(key, nodes[i]);

        if (best < 0 || s > best_score || (s == best_score && nodes[i] < nodes[best])) {
            best = (long)i;
            best_score = s;
        }
    }
    return best;
}

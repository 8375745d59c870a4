/* SPDX-License-Identifier: Apache-2.0 */
/* The CPU primary tier: the index of the chunks that live in the shared region,
 * their slots and ref counts, and the cache policy (LRU or ARC) that picks
 * eviction victims, with vLLM's request-scoped cache access (below).
 * Single-threaded (the scheduler thread).
 *
 * ref_cnt: -1 write in flight (GPU store or promotion), 0 ready and evictable,
 * n > 0 pinned by n readers (GPU loads, cascades). Only ref_cnt == 0 is evicted.
 * Slots: fresh slots in order first, then a LIFO free list (vLLM's CPU tier's order).
 * Every allocation of a slot bumps that slot's generation.
 * Fence words: one per slot, odd while the slot's bytes may change (from allocation
 * to complete_store, and between rewrite_begin and rewrite_end), even when stable,
 * never the same value twice (up to 2^31 writes of one slot). An entry's info.fence
 * is the even value its key's bytes were completed under: a reader that saw the word
 * equal to it after reading the row read the key's bytes.
 *
 * Misuse (unknown key, unpinning what is not pinned, loading what is not ready)
 * returns -EINVAL and changes nothing. */
#ifndef KVT_PRIMARY_H
#define KVT_PRIMARY_H

#include <stddef.h>
#include <stdint.h>
#include <stdbool.h>

#include "kvt/types.h"
#include "kvt/stats.h"

struct kvt_region;

struct kvt_primary_config {
    size_t num_chunks;
    size_t row_bytes;   /* bytes per chunk (row); 0 = no memory (index only) */
    const char *policy; /* "lru" (default when NULL) or "arc" */
    bool enable_events;
    /* Compute the XXH3-64 of a row when its write completes successfully. */
    bool checksum_on_complete;
};

struct kvt_primary;

/* The primary takes ownership of region, which must come from kvt_malloc/kvt_calloc
 * and be open (may be NULL: then, if row_bytes > 0, it maps private anonymous
 * memory of num_chunks * row_bytes). -EINVAL for bad config
 * (num_chunks 0 or > 2^31, unknown policy, region geometry that does not match). */
int kvt_primary_create(const struct kvt_primary_config *cfg, struct kvt_region *region,
                       struct kvt_primary **primary_p);
/* Releases the index and the region (unmapped; unlinked by its creator). */
void kvt_primary_destroy(struct kvt_primary *p);

/* PrepareStoreOutput, reused across calls to avoid allocation. keys_to_store[i]
 * goes to chunk_ids[i]; evicted keys in eviction order. */
struct kvt_store_output {
    struct kvt_key *keys_to_store;
    int64_t *chunk_ids;
    size_t n_store, cap_store;
    struct kvt_key *evicted;
    size_t n_evicted, cap_evicted;
};
void kvt_store_output_init(struct kvt_store_output *out);
void kvt_store_output_cleanup(struct kvt_store_output *out);

enum kvt_lookup_result kvt_primary_lookup(struct kvt_primary *p, const struct kvt_key *key);
/* The same, given hash == kvt_key_hash(key) (a caller that hashed the key already). */
enum kvt_lookup_result kvt_primary_lookup_h(struct kvt_primary *p, const struct kvt_key *key,
                                            uint64_t hash);
/* Starts the cache miss of the index cell of the key of this hash, for a lookup
 * that follows other work. */
void kvt_primary_prefetch_h(const struct kvt_primary *p, uint64_t hash);
/* lookup of each of keys[0..n) into out[], the same answers, with the cache misses
 * of neighbouring keys overlapped (what an engine's many-key lookup should call).
 * hashes, when not NULL, gets each key's kvt_key_hash (0 for an invalid key). */
void kvt_primary_lookup_many(struct kvt_primary *p, const struct kvt_key *keys, size_t n,
                             enum kvt_lookup_result *out, uint64_t *hashes);

/* 0 (out filled; n_store may be 0), -ENOSPC ("cannot store": no entry, slot or
 * event changed; ARC's store-miss adaptation has happened, see below), -EINVAL (a
 * key longer than 64 bytes / zero length), -ENOMEM (nothing changed). */
int kvt_primary_prepare_store(struct kvt_primary *p, const struct kvt_key *keys, size_t n,
                              struct kvt_store_output *out);
/* Keys absent or already ready are ignored (idempotent). Always 0 (or -ENOMEM for
 * the event). */
int kvt_primary_complete_store(struct kvt_primary *p, const struct kvt_key *keys, size_t n,
                               bool success);
/* The same, but a successful completion of a key that is absent is -EINVAL and
 * completes nothing (the manager: each tier's cascade must be able to pin every
 * key it names). acc (may be NULL) is the storing request's access: keys it saw
 * allocated are found where it saw them. */
struct kvt_primary_access;
int kvt_primary_complete_store_strict(struct kvt_primary *p, const struct kvt_key *keys, size_t n,
                                      bool success, struct kvt_primary_access *acc);
/* Pins every key (all present and ready, else -EINVAL and nothing pinned) and
 * writes their slots to chunk_ids (co-indexed). prepare_read records no access. */
int kvt_primary_prepare_load(struct kvt_primary *p, const struct kvt_key *keys, size_t n,
                             int64_t *chunk_ids);
int kvt_primary_prepare_read(struct kvt_primary *p, const struct kvt_key *keys, size_t n,
                             int64_t *chunk_ids);
/* Unpins every key; -EINVAL (nothing changed) if any is not pinned enough times. */
int kvt_primary_complete_load(struct kvt_primary *p, const struct kvt_key *keys, size_t n);
static inline int kvt_primary_complete_read(struct kvt_primary *p, const struct kvt_key *keys,
                                            size_t n)
{
    return kvt_primary_complete_load(p, keys, n);
}
/* Promotions allocate and complete exactly like GPU stores. */
static inline int kvt_primary_prepare_write(struct kvt_primary *p, const struct kvt_key *keys,
                                            size_t n, struct kvt_store_output *out)
{
    return kvt_primary_prepare_store(p, keys, n, out);
}
static inline int kvt_primary_complete_write(struct kvt_primary *p, const struct kvt_key *keys,
                                             size_t n, bool success)
{
    return kvt_primary_complete_store(p, keys, n, success);
}

/* ---- request-scoped access (vLLM's CPU tier) ----
 * A request's accesses are recorded while it runs and given to the policy once,
 * when it finishes, as one access in prefix order (keys grouped by KV cache
 * group, the group index being the key's last 4 bytes big-endian, groups in
 * ascending order, each in the order its keys were first seen; the tail is
 * applied first, so the head ends most recent):
 *   LRU  every present key it saw gets a new rank (moves to the MRU end);
 *   ARC  a key it only inserted moves to the MRU end of its list, a key it reused
 *        while ready moves T1 -> T2 (or to T2's MRU end).
 * What records, for a request's access acc:
 *   prepare_store  absent keys (seen) and present ready keys (seen, reused),
 *                  in offer order; pending keys nothing; the keys it allocates
 *                  become inserted. ARC adapts target_t1_size to each new store
 *                  miss that hits a ghost before allocating, even when the store
 *                  then fails with -ENOSPC (vLLM's order);
 *   prepare_load   every key (seen, reused).
 * A key counts as reused only if the request had not inserted it before (a
 * re-read of its own chunk is an internal transfer). reset_cache forgets every
 * access recorded before it. Calls without an access (the plain functions) are
 * those of a request that never finishes: they record nothing, but their store
 * misses still adapt ARC. */
struct kvt_primary_access;
int kvt_primary_access_create(struct kvt_primary_access **acc_p);
void kvt_primary_access_destroy(struct kvt_primary_access *acc);
/* As kvt_primary_prepare_store / prepare_load, recording into acc (NULL: none).
 * An access that has finished records nothing more. */
int kvt_primary_prepare_store_req(struct kvt_primary *p, const struct kvt_key *keys, size_t n,
                                  struct kvt_primary_access *acc, struct kvt_store_output *out);
int kvt_primary_prepare_load_req(struct kvt_primary *p, const struct kvt_key *keys, size_t n,
                                 struct kvt_primary_access *acc, int64_t *chunk_ids);
/* Applies acc's access (once: later calls do nothing) and frees what it holds. */
void kvt_primary_request_finished(struct kvt_primary *p, struct kvt_primary_access *acc);

/* An access of its own, applied at once: the present ready keys of keys[0..n)
 * as reused by a request that finishes now (vLLM's re-offer of a ready prefix by
 * a request of its own). Keys absent, still being written or ghosts are left
 * alone. */
void kvt_primary_touch(struct kvt_primary *p, const struct kvt_key *keys, size_t n);
/* Clears everything (policy, ghosts, counters, slots); no per-key events. */
void kvt_primary_reset_cache(struct kvt_primary *p);
/* Moves the pending events to out (empty unless enable_events). */
int kvt_primary_take_events(struct kvt_primary *p, struct kvt_events *out);
/* Usage gauges and the allocation-size histogram. Never empty. */
int kvt_primary_get_stats(struct kvt_primary *p, struct kvt_stats *out);

/* Geometry and memory. */
size_t kvt_primary_num_chunks(const struct kvt_primary *p);
size_t kvt_primary_row_bytes(const struct kvt_primary *p);
uint8_t *kvt_primary_base(const struct kvt_primary *p); /* NULL when row_bytes == 0 */
struct kvt_region *kvt_primary_region(const struct kvt_primary *p);

/* Counters. */
size_t kvt_primary_num_evictable(const struct kvt_primary *p);
size_t kvt_primary_num_write_pending(const struct kvt_primary *p);
size_t kvt_primary_num_free(const struct kvt_primary *p);
size_t kvt_primary_num_entries(const struct kvt_primary *p);
/* Chunks evicted to make room since creation (reset_cache does not count). */
uint64_t kvt_primary_num_evicted(const struct kvt_primary *p);
/* Bytes of index and policy memory (benchmarks). */
size_t kvt_primary_index_bytes(const struct kvt_primary *p);

struct kvt_primary_entry_info {
    int64_t slot;
    int32_t ref_cnt;
    uint32_t generation;
    uint32_t fence; /* the slot's fence word when the key's bytes were completed; 0 before */
    uint64_t checksum;
    bool has_checksum;
};
/* -ENOENT when absent. */
int kvt_primary_entry_info(const struct kvt_primary *p, const struct kvt_key *key,
                           struct kvt_primary_entry_info *info_p);
/* Stores the checksum of a present entry (promotions that verified their bytes). */
int kvt_primary_set_checksum(struct kvt_primary *p, const struct kvt_key *key, uint64_t sum);

/* The fence words, num_chunks of them (*n_p), slot s at index s: for the network
 * tier to register for peers' READs. Valid for the primary's life. */
const _Atomic uint32_t *kvt_primary_fence_words(const struct kvt_primary *p, size_t *n_p);
/* A stored row changed in place (a holder rewriting it, tests): rewrite_begin turns
 * the slot's fence word odd and gives the row (-ENOENT absent or no rows, -EBUSY
 * while its store is in flight); rewrite_end turns it even (-EINVAL without a
 * begin). The entry keeps the fence and checksum of the bytes it was stored with,
 * so peers refuse the row from then on. */
int kvt_primary_rewrite_begin(struct kvt_primary *p, const struct kvt_key *key, uint8_t **row_p);
int kvt_primary_rewrite_end(struct kvt_primary *p, const struct kvt_key *key);

/* Policy order, for tests and tools. LRU: which 0 = all entries LRU -> MRU.
 * ARC: which 0 = T1, 1 = T2, each LRU -> MRU. Returns the count written (at most
 * max). */
size_t kvt_primary_policy_list(const struct kvt_primary *p, int which, struct kvt_key *out,
                               size_t max);
/* ARC's target_t1_size (0 for LRU). */
double kvt_primary_arc_target(const struct kvt_primary *p);
/* ARC ghosts keep a fingerprint, not the key: which ghost list holds key
 * (1 = B1, 2 = B2, 0 = none or LRU), and the length of B1 (which 1) or B2 (2). */
int kvt_primary_arc_ghost_of(const struct kvt_primary *p, const struct kvt_key *key);
size_t kvt_primary_arc_ghost_len(const struct kvt_primary *p, int which);
/* Told of every key the primary drops (evictions, in eviction order; keys NULL and
 * n 0 after reset_cache: every key). The network tier unpublishes through it. */
typedef void (*kvt_primary_removed_fn)(void *arg, const struct kvt_key *keys, size_t n);
void kvt_primary_set_removed_hook(struct kvt_primary *p, kvt_primary_removed_fn fn, void *arg);

#endif

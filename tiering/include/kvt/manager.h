/* The tiering manager (spec §3, the seed's TieringOffloadingManager): the CPU
 * primary tier in front of ordered secondary tiers. Every chunk stored in the
 * primary is cascaded to every secondary tier (one job and one pin per tier);
 * secondary hits are promoted into freshly allocated primary slots at step end,
 * one job per (tier, request). Single-threaded: the scheduler thread.
 *
 * A step: any number of lookup / prepare_store / complete_store / prepare_load /
 * complete_load / touch calls, then exactly one on_schedule_end. Tier completions
 * are polled by every prepare_store (eviction must see them), and otherwise at most
 * once per step, by the first lookup or on_schedule_end of the step.
 *
 * Caller misuse (unknown request, complete_store without prepare_store, unpinning
 * what is not pinned) returns -EINVAL and changes nothing; broken internal
 * invariants (a tier reporting an unknown job) assert. */
#ifndef KVT_MANAGER_H
#define KVT_MANAGER_H

#include <stddef.h>
#include <stdint.h>
#include <stdbool.h>

#include "kvt/types.h"
#include "kvt/stats.h"
#include "kvt/primary.h"
#include "kvt/tier.h"

struct kvt_manager;

/* Takes ownership of the primary and of the tiers (at most KVT_MAX_TIERS), which
 * are consulted in array order. On failure nothing is taken. */
int kvt_manager_create(struct kvt_primary *primary, struct kvt_tier *const *tiers, size_t n_tiers,
                       struct kvt_manager **m_p);
/* Frees everything the manager owns. Call shutdown first for an orderly stop; if
 * shutdown failed, destroy leaves the primary (and its region) alone. */
void kvt_manager_destroy(struct kvt_manager *m);

enum kvt_lookup_result kvt_manager_lookup(struct kvt_manager *m, const struct kvt_key *key,
                                          struct kvt_req_ctx *ctx);
/* kvt_manager_lookup of keys[0..n) in order, into out[]; with prefix it stops
 * after the first MISS or RETRY. Returns how many keys were answered. The same
 * answers, metrics and promotions as one call per key, with the primary's cache
 * misses of neighbouring keys overlapped (what the engine API calls). */
size_t kvt_manager_lookup_many(struct kvt_manager *m, const struct kvt_key *keys, size_t n,
                               struct kvt_req_ctx *ctx, bool prefix, enum kvt_lookup_result *out);
int kvt_manager_prepare_load(struct kvt_manager *m, const struct kvt_key *keys, size_t n,
                             struct kvt_req_ctx *ctx, int64_t *chunk_ids);
int kvt_manager_complete_load(struct kvt_manager *m, const struct kvt_key *keys, size_t n,
                              struct kvt_req_ctx *ctx);
void kvt_manager_touch(struct kvt_manager *m, const struct kvt_key *keys, size_t n,
                       struct kvt_req_ctx *ctx);
/* 0, -ENOSPC ("None": cannot store), -EINVAL (request unknown). */
int kvt_manager_prepare_store(struct kvt_manager *m, const struct kvt_key *keys, size_t n,
                              struct kvt_req_ctx *ctx, struct kvt_store_output *out);
/* -EINVAL when the request has no prepared store outstanding. */
int kvt_manager_complete_store(struct kvt_manager *m, const struct kvt_key *keys, size_t n,
                               struct kvt_req_ctx *ctx, bool success);
/* -EEXIST when the request is already known. */
int kvt_manager_on_new_request(struct kvt_manager *m, struct kvt_req_ctx *ctx,
                               enum kvt_offload_policy *policy_p);
int kvt_manager_on_request_finished(struct kvt_manager *m, struct kvt_req_ctx *ctx);
void kvt_manager_on_schedule_end(struct kvt_manager *m, const struct kvt_schedule_end_ctx *ctx);
bool kvt_manager_has_pending_work(struct kvt_manager *m);
/* Primary's events, then each tier's, in tier order. */
int kvt_manager_take_events(struct kvt_manager *m, struct kvt_events *out);
int kvt_manager_get_stats(struct kvt_manager *m, struct kvt_stats *out);
/* Drains every tier, then clears the primary; secondary data survives. */
int kvt_manager_reset_cache(struct kvt_manager *m);
/* reset_cache, then every tier's reset (kvt_tier_reset): what the secondary tiers
 * hold is forgotten too (the engine API's reset). A tier without a reset keeps its
 * data; the first other error of a tier is returned, after every tier was asked. A
 * tier that fails to drain stops it before anything is cleared (its error). */
int kvt_manager_reset_all(struct kvt_manager *m);
/* Shuts every tier down; if one fails, returns its error and keeps the primary. */
int kvt_manager_shutdown(struct kvt_manager *m);

/* Introspection. */
struct kvt_primary *kvt_manager_primary(struct kvt_manager *m);
size_t kvt_manager_num_tiers(const struct kvt_manager *m);
struct kvt_tier *kvt_manager_tier(struct kvt_manager *m, size_t idx);
size_t kvt_manager_num_jobs(const struct kvt_manager *m);
size_t kvt_manager_num_requests(const struct kvt_manager *m);
bool kvt_manager_has_request(const struct kvt_manager *m, const char *req_id);
/* Request state for tests: -ENOENT if unknown. */
struct kvt_manager_req_info {
    int pending_primary_stores;
    bool is_finished;
    uint32_t request_level_tiers; /* bit i = tier i */
    size_t n_pending_cascade_keys;
};
int kvt_manager_request_info(const struct kvt_manager *m, const char *req_id,
                             struct kvt_manager_req_info *info_p);

#endif

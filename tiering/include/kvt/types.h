/* SPDX-License-Identifier: Apache-2.0 */
/* The vocabulary of the tiering core: keys, lookup results, tier filters,
 * request contexts, transfer jobs and their results, offloading events.
 *
 * Ownership in one line each:
 * - struct kvt_key is a value (65 bytes): copied freely, never allocated.
 * - struct kvt_req_ctx is reference counted (_ref/_unref); the manager keeps a
 *   reference for as long as it has request state or a job that names it, so an
 *   engine may drop its own reference right after on_request_finished.
 * - struct kvt_job is owned by the manager from submit until the tier reports it
 *   finished; the tier may read it (never write it) until then.
 */
#ifndef KVT_TYPES_H
#define KVT_TYPES_H

#include <stddef.h>
#include <stdint.h>
#include <stdbool.h>

#define KVT_KEY_MAX 64

/* Opaque 1..64-byte key (vLLM: 32-byte block hash + be32 group index). */
struct kvt_key {
    uint8_t len;
    uint8_t bytes[KVT_KEY_MAX];
};

/* Builds a key from bytes; returns -EINVAL unless 1 <= len <= 64. */
int kvt_key_set(struct kvt_key *key, const void *bytes, size_t len);
/* vLLM's make_offload_key: hash || be32(group). -EINVAL if it does not fit. */
int kvt_key_make(struct kvt_key *key, const void *hash, size_t hash_len, uint32_t group);
bool kvt_key_eq(const struct kvt_key *a, const struct kvt_key *b);
uint64_t kvt_key_hash(const struct kvt_key *key);
/* Lower-case hex, NUL-terminated; buf needs 2*len+1 bytes (129 is always enough). */
void kvt_key_to_hex(const struct kvt_key *key, char *buf);
/* -EINVAL for odd length, non-hex characters or a length outside 1..64 bytes. */
int kvt_key_from_hex(struct kvt_key *key, const char *hex);

/* LookupResult. */
enum kvt_lookup_result {
    KVT_MISS = 0,
    KVT_HIT,
    KVT_HIT_PENDING,
    KVT_RETRY,
};
const char *kvt_lookup_result_name(enum kvt_lookup_result r);

/* Medium / Locality; KVT_ANY is Python's None ("any / unconstrained"). */
#define KVT_ANY (-1)
enum kvt_medium { KVT_MEDIUM_CPU = 0, KVT_MEDIUM_STORAGE = 1 };
enum kvt_locality { KVT_LOCAL = 0, KVT_REMOTE = 1 };

#define KVT_FILTER_MAX_MATCHERS 8
struct kvt_tier_matcher {
    int medium;   /* enum kvt_medium or KVT_ANY */
    int locality; /* enum kvt_locality or KVT_ANY */
};
/* TierFilter. all=true is TierFilter.ALL; all=false with n=0 denies everything. */
struct kvt_tier_filter {
    bool all;
    uint8_t n;
    struct kvt_tier_matcher m[KVT_FILTER_MAX_MATCHERS];
};
extern const struct kvt_tier_filter kvt_filter_all;
bool kvt_tier_filter_allows(const struct kvt_tier_filter *f, int medium, int locality);
/* One entry of kv_transfer_params["kv_load_tiers"] as the caller's JSON layer saw
 * it: is_dict false for anything but an object (or an object whose medium or
 * locality is not a string); medium/locality NULL when the key is absent. */
struct kvt_tier_filter_entry {
    bool is_dict;
    const char *medium;
    const char *locality;
};
/* The parsing rules: not a list -> ALL; [] -> deny all; invalid
 * entries skipped; all of a non-empty list invalid -> ALL; [{}] -> unconstrained. */
void kvt_tier_filter_parse(struct kvt_tier_filter *f, bool is_list,
                           const struct kvt_tier_filter_entry *entries, size_t n);

/* OffloadPolicy. */
enum kvt_offload_policy {
    KVT_CHUNK_LEVEL = 0,
    KVT_REQUEST_LEVEL = 1,
};

#define KVT_REQ_ID_MAX 127
#define KVT_MAX_TIERS  8

/* ReqContext. Tiers keep per-request typed state in tier_state[their
 * index], set in on_new_request and released in on_request_finished. */
struct kvt_req_ctx {
    char req_id[KVT_REQ_ID_MAX + 1];
    size_t req_id_len;
    struct kvt_tier_filter load_tier_filter;
    char *params; /* kv_transfer_params as JSON text, or NULL; owned */
    void *tier_state[KVT_MAX_TIERS];
    int refs;
};

/* req_id must be 1..127 bytes; params may be NULL. Starts with one reference. */
int kvt_req_ctx_create(const char *req_id, const char *params_json, struct kvt_req_ctx **ctx_p);
struct kvt_req_ctx *kvt_req_ctx_ref(struct kvt_req_ctx *ctx);
void kvt_req_ctx_unref(struct kvt_req_ctx *ctx);

/* ScheduleEndContext. */
struct kvt_schedule_end_ctx {
    const char *const *new_req_ids;
    size_t n_new;
    const char *const *preempted_req_ids;
    size_t n_preempted;
};

typedef uint64_t kvt_job_id_t;

/* TransferJob. chunk_ids[i] is the primary slot of keys[i]. */
struct kvt_job {
    kvt_job_id_t id;
    size_t n;
    struct kvt_key *keys;
    int64_t *chunk_ids;
    bool is_promotion; /* true: secondary -> primary (writes slots); false: cascade */
    struct kvt_req_ctx *ctx;
    uint64_t submit_ns; /* kvt_now_ns() at creation; back-pressure latency origin */
};

/* JobResult. successful_keys: on a failed promotion, the subset that did
 * load (NULL/0 = every key failed); ignored when success. transfer_bytes < 0 means
 * "not reported" (the manager then uses n * row bytes). */
struct kvt_job_result {
    kvt_job_id_t job_id;
    bool success;
    const struct kvt_key *successful_keys;
    size_t n_successful;
    double transfer_time; /* seconds, < 0 = not reported */
    int64_t transfer_bytes;
};

/* OffloadingEvent. */
struct kvt_event {
    struct kvt_key *keys;
    size_t n;
    int medium;   /* enum kvt_medium */
    int locality; /* enum kvt_locality or KVT_ANY */
    bool removed;
};

/* A growable list of events; each event owns its key array. */
struct kvt_events {
    struct kvt_event *ev;
    size_t n, cap;
};
void kvt_events_init(struct kvt_events *l);
void kvt_events_cleanup(struct kvt_events *l);
/* Moves every event of src to the end of dst, leaving src empty. */
int kvt_events_splice(struct kvt_events *dst, struct kvt_events *src);
int kvt_events_push(struct kvt_events *l, const struct kvt_key *keys, size_t n, int medium,
                    int locality, bool removed);

#endif

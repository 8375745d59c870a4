/* SPDX-License-Identifier: Apache-2.0 */
/* libkvtier-client: the local engine API of kvtierd (node/).
 *
 * An inference engine on the same host attaches to its node's kvtierd over a unix
 * socket. At connect time the daemon passes the primary region's file descriptor
 * (SCM_RIGHTS); the library maps it MAP_SHARED, so the engine's workers copy KV
 * chunks straight into and out of the rows the daemon hands out:
 *
 *     row of chunk c          = region.base + c * region.row_bytes
 *     worker w's cell of row c = row + w * region.page_bytes  (w < num_workers)
 *
 * Every call below maps one-to-one onto the tiering manager (tiering's manager.h,
 * vLLM's TieringOffloadingManager) and is one synchronous round trip, through a
 * ring of shared memory the node sets up at connect time (no system call while the
 * node is busy; see kvtier_client_set_ring) or, for what does not fit it, the
 * socket:
 *
 *   on_new_request     register a request (its id names it in every later call)
 *   lookup             MISS / HIT / HIT_PENDING / RETRY per key, in order
 *   prepare_store      slots to write, or -ENOSPC ("cannot store", nothing changed)
 *   complete_store     the writes are done (or failed): chunks become ready
 *   prepare_load       pin ready chunks and learn their slots
 *   complete_load      unpin them once the copy out is done
 *   touch              record an access
 *   on_request_finished
 *   on_schedule_end    end of one scheduler step (drives promotions and cascades)
 *   take_events        stored / removed events since the last call
 *   get_stats          the manager's metrics (counters, gauges, histograms)
 *   has_pending_work   whether the node has transfers in flight (keep stepping)
 *   reset              the node forgets every chunk (vLLM's reset_cache, and more)
 *
 * Model fingerprint. Chunks mean something only to engines of one model and layout
 * (model, dtype, KV layout, block size, parallelism, hash seed). An engine declares
 * what it runs at connect time as an opaque string of up to KVTIER_FINGERPRINT_MAX
 * bytes (kvtier.vllm computes one from vLLM's config). The node serves one: its
 * node.model_fingerprint, or else the first one an engine declares, kept for the
 * daemon's life and recorded by its storage tier, so that after a model change and
 * a restart the old model's files are dropped, not served. An engine that declares
 * another is refused: kvtier_connect_ex fails with -EKEYREJECTED and the node's
 * reason in its error buffer (counted, kvtier_engine_refused_total{reason=
 * "fingerprint"}). An engine that declares none (tools like the kvtier CLI, engines
 * of earlier versions) is accepted by any node and trusted to run the node's model.
 *
 * Request ids are node-wide (several engines share one manager): an id another
 * engine uses is refused with -EEXIST, so engines should make them unique (e.g.
 * prefix them with the engine's name). A client may only name its own requests and
 * unpin only what it pinned (-EINVAL otherwise).
 *
 * If the engine dies or closes the connection, the daemon cleans up after it: every
 * store it prepared and did not complete is completed as failed (the slots are
 * freed), every chunk it pinned and did not unpin is unpinned, every request it did
 * not finish is finished.
 *
 * Errors: every function that can fail returns 0 or a negative errno:
 *   -EINVAL      bad argument (key length, request id, misuse the manager refuses)
 *   -EEXIST      on_new_request: the id is already known to the node
 *   -ENOSPC      prepare_store: cannot store (nothing changed)
 *   -EMSGSIZE    the call does not fit the daemon's limits (too many keys)
 *   -EPROTO      the daemon sent something this library does not understand
 *   -ETIMEDOUT   no reply within the timeout; the connection is then closed
 *   -EPIPE / -ECONNRESET  the daemon went away; every later call fails the same way
 *   -ENOMEM
 * A call that fails on the daemon's side changed nothing there.
 *
 * Threads: calls on one client are serialized by a mutex inside the client, so a
 * client may be shared by threads (each call still waits for its own reply). The
 * region's memory may be read and written by any thread at any time; which rows
 * are safe to touch is what prepare_store / prepare_load say.
 */
#ifndef KVTIER_CLIENT_H
#define KVTIER_CLIENT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Protocol version spoken by this library (the daemon refuses another major; minor
 * 1 adds the fingerprint, error messages, reset, has_pending_work and peers). */
#define KVTIER_PROTO_MAJOR 1
#define KVTIER_PROTO_MINOR 1

#define KVTIER_KEY_MAX         64  /* bytes of a key */
#define KVTIER_REQ_ID_MAX      127 /* bytes of a request id (not counting the NUL) */
#define KVTIER_NAME_MAX        63  /* bytes of an engine name */
#define KVTIER_STAT_NAME_MAX   96  /* including the NUL */
#define KVTIER_STAT_LABEL_MAX  48  /* including the NUL */
#define KVTIER_HIST_BUCKETS    16
#define KVTIER_FILTER_MAX      8
#define KVTIER_FINGERPRINT_MAX 255  /* bytes of a model fingerprint */
#define KVTIER_ADDR_MAX        63   /* bytes of a peer's address */
#define KVTIER_ERROR_MAX       1023 /* bytes of the daemon's reason for closing */

/* An opaque 1..64-byte key, compared bytewise (vLLM: 32-byte block hash followed by
 * the big-endian 32-bit KV-cache group index; see kvtier_key_make). A value type:
 * same layout as the daemon's struct kvt_key. */
struct kvtier_key {
    uint8_t len;
    uint8_t bytes[KVTIER_KEY_MAX];
};

/* -EINVAL unless 1 <= len <= 64. */
int kvtier_key_set(struct kvtier_key *key, const void *bytes, size_t len);
/* hash || be32(group), vLLM's make_offload_key; -EINVAL if it exceeds 64 bytes. */
int kvtier_key_make(struct kvtier_key *key, const void *hash, size_t hash_len, uint32_t group);

enum kvtier_lookup_result {
    KVTIER_MISS = 0,
    KVTIER_HIT = 1,
    KVTIER_HIT_PENDING = 2, /* being written (store or promotion): ask again next step */
    KVTIER_RETRY = 3,       /* a secondary tier is still looking: ask again next step */
};

enum kvtier_offload_policy {
    KVTIER_CHUNK_LEVEL = 0,
    KVTIER_REQUEST_LEVEL = 1,
};

/* Tier matching for a request's loads (vLLM's kv_load_tiers). KVTIER_ANY leaves the
 * field unconstrained. */
#define KVTIER_ANY (-1)
enum kvtier_medium { KVTIER_MEDIUM_CPU = 0, KVTIER_MEDIUM_STORAGE = 1 };
enum kvtier_locality { KVTIER_LOCAL = 0, KVTIER_REMOTE = 1 };

struct kvtier_tier_matcher {
    int medium;   /* enum kvtier_medium or KVTIER_ANY */
    int locality; /* enum kvtier_locality or KVTIER_ANY */
};

/* ---- connection ------------------------------------------------------------ */

/* The primary region as mapped into this process. */
struct kvtier_region {
    uint8_t *base;        /* MAP_SHARED, read-write */
    size_t size;          /* num_chunks * row_bytes */
    size_t num_chunks;    /* chunk (slot) ids are 0..num_chunks-1 */
    size_t row_bytes;     /* bytes of one chunk: num_workers * page_bytes */
    size_t page_bytes;    /* one worker's cell of a row */
    unsigned num_workers; /* cells per row */
    /* The region file's device and inode: another node (a restarted one) has
     * another region, so rows named by one connection mean nothing to the next. */
    uint64_t ident_dev, ident_ino;
};

/* Optional settings of kvtier_connect; zero/NULL fields take the defaults. */
struct kvtier_connect_opts {
    const char *name; /* the engine's name in the daemon's logs; default "engine" */
    int timeout_ms;   /* connect and per-call reply timeout; 0 = 30000, < 0 = none */
};

struct kvtier_client;

/* Connects to the daemon listening at socket_path, says hello, receives and maps
 * the region. opts may be NULL. -ENOENT / -ECONNREFUSED when no daemon listens,
 * -EPROTO for a daemon of another protocol major, -EBADFD when the region's file is
 * shorter than the daemon says (cut under it), -EMFILE etc. */
int kvtier_connect(const char *socket_path, const struct kvtier_connect_opts *opts,
                   struct kvtier_client **client_p);

/* kvtier_connect's settings and more. size is sizeof(struct kvtier_connect_ex) as the
 * caller's header has it (a later library reads only the fields the caller knows);
 * zero fields take the defaults. */
struct kvtier_connect_ex {
    size_t size;
    const char *name; /* as kvtier_connect_opts */
    int timeout_ms;   /* as kvtier_connect_opts */
    /* The engine's model fingerprint (1..KVTIER_FINGERPRINT_MAX bytes, see the top of
     * this file), or NULL / "" for none. -EINVAL when longer. */
    const char *fingerprint;
    /* When the daemon refuses the connection, its reason (NUL-terminated, cut to
     * error_len - 1 bytes; "" when it gave none). NULL: not wanted. */
    char *error;
    size_t error_len;
};

/* kvtier_connect with a fingerprint and the daemon's reason for a refusal:
 * -EKEYREJECTED another model's fingerprint, -EPROTO another major, and
 * kvtier_connect's errors. */
int kvtier_connect_ex(const char *socket_path, const struct kvtier_connect_ex *opts,
                      struct kvtier_client **client_p);
/* Closes the connection (the daemon cleans up whatever the client left open, see
 * above) and unmaps the region. NULL is ignored. */
void kvtier_close(struct kvtier_client *c);
/* The daemon's reason when it closed this connection (an ERROR frame), "" when it
 * gave none; valid until kvtier_close. */
const char *kvtier_client_error(const struct kvtier_client *c);
/* The model fingerprint the node announced at connect time ("" when it had none). */
const char *kvtier_client_node_fingerprint(const struct kvtier_client *c);
/* The protocol minor the node speaks (0: none of the minor-1 calls; they return
 * -EOPNOTSUPP without asking). */
unsigned kvtier_client_node_minor(const struct kvtier_client *c);

/* The mapped region; valid until kvtier_close. */
const struct kvtier_region *kvtier_client_region(const struct kvtier_client *c);
/* The first byte of chunk chunk_id's row (no bounds check beyond an assert). */
uint8_t *kvtier_client_row(const struct kvtier_client *c, int64_t chunk_id);
/* The id the daemon gave this connection (its logs name clients by it). */
uint64_t kvtier_client_id(const struct kvtier_client *c);
/* The most a single call may carry: keys per call (lookup, stores, loads, touch)
 * and request ids per on_schedule_end list, as the daemon announced them. */
size_t kvtier_client_max_keys(const struct kvtier_client *c);

/* Whether the node is still at the other end, without a round trip: false once the
 * connection broke or the node closed it (it went away, or restarted). */
bool kvtier_client_alive(struct kvtier_client *c);

/* The shared-memory ring. kvtier_connect asks the node for one (unless the
 * environment has KVTIER_RING=0); a node that gives none (rings off, an older node)
 * leaves every call on the socket. With a ring, a call writes its request into
 * memory the node polls and spins up to spin_us (default 20) on the reply before it
 * sleeps on a futex; the node wakes it. To a node that takes them, lookups, touch,
 * prepare_load, complete_load and complete_store whose keys are all of one length go
 * as compact binary messages rather than frames (unless KVTIER_RING_BIN=0); their
 * results are the same. */
bool kvtier_client_has_ring(const struct kvtier_client *c);
/* Sends calls through the ring (enabled) or the socket; spin_us < 0 keeps the spin.
 * -EOPNOTSUPP enabling without a ring. */
int kvtier_client_set_ring(struct kvtier_client *c, bool enabled, int spin_us);
struct kvtier_ring_stats {
    uint64_t posted;       /* calls through the ring */
    uint64_t wakeups;      /* of those, calls that had to wake the node (it slept) */
    uint64_t sleeps;       /* futex waits (a reply took longer than the spin) */
    uint64_t redirects;    /* replies too large for the ring, read from the socket */
    uint64_t posted_calls; /* calls posted without waiting (kvtier_client_set_posting) */
};
int kvtier_client_ring_stats(struct kvtier_client *c, struct kvtier_ring_stats *out);

/* Posting: with a ring, the calls whose reply is only their rc (complete_store,
 * complete_load, touch, on_request_finished, on_schedule_end) return 0 as soon as
 * they are in the ring; the node runs them in order, before anything called
 * after them, and their replies are checked by the next call that waits, by
 * kvtier_client_drain, and at kvtier_close. A posted call that failed does not
 * fail a later one: kvtier_client_drain says so. -EOPNOTSUPP without a ring. */
int kvtier_client_set_posting(struct kvtier_client *c, bool enabled);
/* Waits for every posted call: 0 when all of them since the last drain worked,
 * else the first failure's rc (or the error that broke the connection);
 * *failed_p (may be NULL) receives how many failed. */
int kvtier_client_drain(struct kvtier_client *c, uint64_t *failed_p);

/* ---- requests ---------------------------------------------------------------- */

/* Optional parts of a new request. */
struct kvtier_request_opts {
    /* kv_transfer_params as JSON text, handed to the tiers; NULL = none. */
    const char *params_json;
    /* The tiers this request may load from: NULL/0 with load_tiers_all = true (the
     * default when opts is NULL) is every tier; load_tiers_all = false with
     * n_load_tiers = 0 denies every tier; otherwise a tier matches if any matcher
     * does. At most KVTIER_FILTER_MAX matchers. */
    bool load_tiers_all;
    const struct kvtier_tier_matcher *load_tiers;
    size_t n_load_tiers;
};

/* on_new_request. opts may be NULL. policy_p (may be NULL) receives
 * REQUEST_LEVEL if some tier asked for it. -EEXIST if the id is known; the daemon's
 * bounds: -EMSGSIZE params over engine.max_params_bytes, -ENOBUFS this client has
 * engine.max_requests live requests or its params would pass engine.max_client_params. */
int kvtier_on_new_request(struct kvtier_client *c, const char *req_id,
                          const struct kvtier_request_opts *opts,
                          enum kvtier_offload_policy *policy_p);

/* on_request_finished. Stores still outstanding keep the request alive in the
 * manager until they complete. -EINVAL if this client has no such request. */
int kvtier_on_request_finished(struct kvtier_client *c, const char *req_id);

/* ---- lookups ------------------------------------------------------------------ */

/* Stop at the first key whose result is MISS or RETRY (prefix matching: the keys
 * after it are not looked up, so nothing is promoted for them). */
#define KVTIER_LOOKUP_PREFIX 1u

/* Looks up keys[0..n-1] in order for request req_id; results[i] is an enum
 * kvtier_lookup_result. n_done_p (may be NULL) receives how many keys were looked
 * up (n unless KVTIER_LOOKUP_PREFIX stopped early; results past it are not written).
 * A secondary-tier HIT allocates a primary slot and promotes the chunk at the end of
 * the step: the key answers HIT_PENDING until then. */
int kvtier_lookup(struct kvtier_client *c, const char *req_id, const struct kvtier_key *keys,
                  size_t n, unsigned flags, uint8_t *results, size_t *n_done_p);

/* ---- stores ----------------------------------------------------------------- */

/* What prepare_store decided, written into caller-provided arrays. */
struct kvtier_store_plan {
    /* in: arrays of at least n entries (n = the call's key count) */
    uint32_t *store_index; /* keys[store_index[i]] is to be written ...          */
    int64_t *chunk_ids;    /* ... into the row of chunk_ids[i], for i < n_store */
    /* in: optional buffer for the keys evicted to make room (may be NULL / 0) */
    struct kvtier_key *evicted;
    size_t cap_evicted;
    /* out */
    size_t n_store;   /* keys that need writing (the others are already stored) */
    size_t n_evicted; /* keys evicted; only the first cap_evicted are written */
};

/* prepare_store: keys already present are left out of the plan; the others get
 * write-pending slots (ref -1) the engine must fill and then complete_store.
 * -ENOSPC: cannot store (nothing changed). -EINVAL: unknown request. */
int kvtier_prepare_store(struct kvtier_client *c, const char *req_id, const struct kvtier_key *keys,
                         size_t n, struct kvtier_store_plan *plan);

/* complete_store: the rows of keys are written (success) or not (the slots are
 * freed). -EINVAL when the request has no prepared store outstanding, or when a key
 * is being written by a store this client did not prepare in this request (nothing
 * is completed then). Keys that are not being written are ignored. */
int kvtier_complete_store(struct kvtier_client *c, const char *req_id,
                          const struct kvtier_key *keys, size_t n, bool success);

/* ---- loads --------------------------------------------------------------------- */

/* prepare_load: pins every key (all must be ready: HIT; else -EINVAL and nothing is
 * pinned) and writes their slots to chunk_ids[0..n-1]. The rows stay valid and
 * unchanged until complete_load. req_id may be NULL (the manager does not scope
 * loads by request). */
int kvtier_prepare_load(struct kvtier_client *c, const char *req_id, const struct kvtier_key *keys,
                        size_t n, int64_t *chunk_ids);
/* complete_load: unpins keys this client pinned; -EINVAL (nothing changed) if one
 * of them is not pinned by this client. */
int kvtier_complete_load(struct kvtier_client *c, const char *req_id, const struct kvtier_key *keys,
                         size_t n);
/* touch: records an access to keys (cache policy). req_id may be NULL. */
int kvtier_touch(struct kvtier_client *c, const char *req_id, const struct kvtier_key *keys,
                 size_t n);

/* ---- steps ----------------------------------------------------------------------- */

/* on_schedule_end: the end of one scheduler step, with the requests scheduled for
 * the first time and the preempted ones (lists may be NULL when empty). */
int kvtier_on_schedule_end(struct kvtier_client *c, const char *const *new_req_ids, size_t n_new,
                           const char *const *preempted_req_ids, size_t n_preempted);

/* has_pending_work: *pending_p is true while the node's manager has transfers in
 * flight (vLLM's has_pending_work: keep stepping) or this client has jobs not yet
 * reported by kvtier_jobs_step. */
int kvtier_has_pending_work(struct kvtier_client *c, bool *pending_p);

/* reset: the node forgets every chunk it holds - its primary (the rows engines map),
 * its storage tier's files (dropped so that a restart does not serve them either)
 * and its publications in the cluster's directory (peers stop being sent here for
 * them). As vLLM's reset_cache it first waits for every tier's transfers to end and
 * keeps live requests. Refused with -EBUSY, nothing changed, while any engine of the
 * node holds pins (prepare_load not completed), prepared stores not completed or load
 * jobs waiting - as vLLM's reset_prefix_cache fails while blocks are in use. Engines
 * that hold nothing stay attached; what they remember of the node (lookup verdicts)
 * may be stale: their loads of dropped chunks fail, as for any chunk gone. A tier's
 * failure is returned (-errno) after every tier was asked. */
int kvtier_reset(struct kvtier_client *c);

/* ---- the cluster ---------------------------------------------------------------------- */

enum kvtier_peer_state { KVTIER_PEER_ALIVE = 0, KVTIER_PEER_DOWN = 1, KVTIER_PEER_SELF = 2 };

struct kvtier_peer {
    uint64_t node_id;
    uint64_t incarnation;
    char addr[KVTIER_ADDR_MAX + 1]; /* its listen address, NUL-terminated */
    uint16_t port;
    int state;              /* enum kvtier_peer_state */
    uint64_t last_heard_ms; /* since the node last heard from it (0: itself) */
    uint64_t pulled_bytes;  /* the node pulled from it, since the node started */
    uint64_t served_bytes;  /* the node served to it, since the node started */
};

struct kvtier_peers {
    struct kvtier_peer *p;
    size_t n;
};

/* The node's view of its cluster: itself (KVTIER_PEER_SELF) first, then every member
 * it has heard of. Free with kvtier_peers_free. -EOPNOTSUPP when the node runs no
 * network tier. */
int kvtier_get_peers(struct kvtier_client *c, struct kvtier_peers **peers_p);
void kvtier_peers_free(struct kvtier_peers *peers);

/* ---- events and stats -------------------------------------------------------------- */

struct kvtier_event {
    struct kvtier_key *keys;
    size_t n;
    int medium;   /* enum kvtier_medium */
    int locality; /* enum kvtier_locality or KVTIER_ANY */
    bool removed; /* false: stored, true: removed */
};

struct kvtier_events {
    struct kvtier_event *ev;
    size_t n;
};

/* take_events: moves the node's pending events (primary's, then each tier's) into
 * a list the library allocates; free it with kvtier_events_free. Events are
 * node-wide: each is delivered to exactly one caller of take_events. */
int kvtier_take_events(struct kvtier_client *c, struct kvtier_events **events_p);
void kvtier_events_free(struct kvtier_events *events);

enum kvtier_metric_kind { KVTIER_COUNTER = 0, KVTIER_GAUGE = 1, KVTIER_HISTOGRAM = 2 };

struct kvtier_stat {
    char name[KVTIER_STAT_NAME_MAX];       /* NUL-terminated */
    char label[KVTIER_STAT_LABEL_MAX];     /* the tier label ("1:fs") or "" */
    int kind;                              /* enum kvtier_metric_kind */
    double value;                          /* counter / gauge */
    uint64_t count;                        /* histogram: observations */
    double sum;                            /* histogram: sum of observations */
    uint64_t buckets[KVTIER_HIST_BUCKETS]; /* histogram: per bucket, not cumulative */
};

/* A histogram's own buckets (each metric has its own: vLLM's for vLLM's metrics): n
 * finite upper bounds, ascending; its buckets[i] counts the observations up to
 * bound[i] (above bound[i-1]), buckets[n] the rest (+Inf). n is 0 for a counter or a
 * gauge. */
struct kvtier_hist_bounds {
    uint32_t n;
    double bound[KVTIER_HIST_BUCKETS - 1];
};

struct kvtier_stats {
    struct kvtier_stat *s;
    size_t n;
    /* The buckets of a node that sends no bounds of each histogram's own (an older
     * one): the last bound stands for +Inf. */
    double bounds[KVTIER_HIST_BUCKETS];
    /* Each stat's own bucket bounds: s[i]'s are stat_bounds[i] (from an older node, the
     * ones above for every histogram). */
    struct kvtier_hist_bounds *stat_bounds;
};

/* get_stats: the manager's metrics since the previous get_stats (counters are
 * deltas, as vLLM's get_stats; gauges current). Free with kvtier_stats_free. */
int kvtier_get_stats(struct kvtier_client *c, struct kvtier_stats **stats_p);
/* The node's totals since it started (counters cumulative, over every engine; gauges
 * current), what `kvtier stats` and /metrics show; leaves this client's deltas alone.
 * -EOPNOTSUPP from a server that keeps no totals. */
int kvtier_get_stats_totals(struct kvtier_client *c, struct kvtier_stats **stats_p);
void kvtier_stats_free(struct kvtier_stats *stats);
/* A counter/gauge value or a histogram's count; 0 when absent. label NULL = "". */
double kvtier_stats_value(const struct kvtier_stats *stats, const char *name, const char *label);

/* The name of a lookup result ("MISS", "HIT", "HIT_PENDING", "RETRY", "?"). */
const char *kvtier_lookup_result_name(int result);

/* This library's version, the project's ("0.1.0"). */
const char *kvtier_version(void);

/* ---- packed keys ------------------------------------------------------------------
 *
 * The calls above with n keys of key_len bytes each back to back in keys (vLLM's
 * keys of one model all have one length): what a binding such as Python's ctypes
 * can pass without building struct kvtier_key arrays. Same results and errors. */
int kvtier_lookup_packed(struct kvtier_client *c, const char *req_id, const void *keys,
                         size_t key_len, size_t n, unsigned flags, uint8_t *results,
                         size_t *n_done_p);
/* One key: its enum kvtier_lookup_result (>= 0), or a negative errno. */
int kvtier_lookup_one(struct kvtier_client *c, const char *req_id, const void *key, size_t key_len);
/* prepare_store: store_index and chunk_ids as in struct kvtier_store_plan (n entries
 * each); the evicted keys are written to evicted as records of one length byte and
 * the key, as many as evicted_cap bytes hold (n * 65 bytes hold all: a call evicts at
 * most one key per key it stores). *n_evicted_p is how many were evicted,
 * *evicted_bytes_p (may be NULL) the bytes written. */
int kvtier_prepare_store_packed(struct kvtier_client *c, const char *req_id, const void *keys,
                                size_t key_len, size_t n, uint32_t *store_index, int64_t *chunk_ids,
                                size_t *n_store_p, void *evicted, size_t evicted_cap,
                                size_t *n_evicted_p, size_t *evicted_bytes_p);
int kvtier_complete_store_packed(struct kvtier_client *c, const char *req_id, const void *keys,
                                 size_t key_len, size_t n, bool success);
int kvtier_prepare_load_packed(struct kvtier_client *c, const char *req_id, const void *keys,
                               size_t key_len, size_t n, int64_t *chunk_ids);
int kvtier_complete_load_packed(struct kvtier_client *c, const char *req_id, const void *keys,
                                size_t key_len, size_t n);
int kvtier_touch_packed(struct kvtier_client *c, const char *req_id, const void *keys,
                        size_t key_len, size_t n);

/* ---- an engine's own region: kvtier as a secondary tier (vLLM) ----------------------
 *
 * An engine that keeps its own CPU region (vLLM's primary tier, a shared-memory
 * file) attaches it: the node maps it too, and then copies rows between it and its
 * own primary on the engine's behalf. Jobs run in the node; the engine polls for
 * them with kvtier_jobs_step, which never waits for a job (only for the reply). */

/* Passes fd (the region's file; the caller keeps its own copy) with the region's
 * geometry: rows of stride bytes starting at offset (page aligned) in the file. The
 * node checks the file's size and that stride equals its own row bytes.
 * node_row_bytes_p (may be NULL) receives those. -EINVAL bad geometry (nothing
 * mapped), -EBUSY attached already, -EBADF no fd arrived. */
int kvtier_attach_region(struct kvtier_client *c, int fd, uint64_t offset, size_t rows,
                         size_t stride, size_t *node_row_bytes_p);

enum kvtier_job_kind {
    KVTIER_JOB_STORE = 0, /* copy the rows into the node, as chunks of its keys */
    KVTIER_JOB_LOAD = 1,  /* fill the rows from the node (its primary, storage or a peer) */
};

struct kvtier_job {
    uint64_t id; /* the engine's; reported back as is */
    int kind;    /* enum kvtier_job_kind */
    const struct kvtier_key *keys;
    const int64_t *rows; /* rows of the attached region, co-indexed with keys */
    size_t n;
};

/* A finished job: ok when every key succeeded; key_ok[i] says so per key. */
struct kvtier_job_done {
    uint64_t id;
    bool ok;
    size_t n;
    const uint8_t *key_ok;
};

struct kvtier_jobs_done {
    struct kvtier_job_done *job;
    size_t n;
};

/* One engine step: looks up lookup[0..n_lookup) (verdicts[i]: enum
 * kvtier_lookup_result; RETRY and HIT_PENDING: ask again next step), submits
 * jobs[0..n_jobs), and returns the jobs finished since the last call in *done_p
 * (free with kvtier_jobs_done_free; may be empty). Every job is reported exactly
 * once. -EINVAL (nothing submitted) for a row out of the region or a bad kind,
 * -ENOTCONN no region attached, -EMSGSIZE over the node's key limit. */
int kvtier_jobs_step(struct kvtier_client *c, const struct kvtier_key *lookup, size_t n_lookup,
                     uint8_t *verdicts, const struct kvtier_job *jobs, size_t n_jobs,
                     struct kvtier_jobs_done **done_p);
void kvtier_jobs_done_free(struct kvtier_jobs_done *done);

#ifdef __cplusplus
}
#endif

#endif

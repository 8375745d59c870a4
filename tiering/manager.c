/* SPDX-License-Identifier: Apache-2.0 */
/* The tiering manager: vLLM's TieringOffloadingManager
 * (vllm/v1/kv_offload/tiering/manager.py), rule for rule.
 *
 * State, all owned by the scheduler thread:
 *   jobs             job id -> {job, tier_idx}: every cascade and promotion in flight
 *   pending_loads[i] req_id -> {ctx, keys, slots}: promotions allocated by lookups in
 *                    this step, submitted at step end as one job per (tier, request);
 *                    pending_tier_order keeps the tiers' first-use order (vLLM's
 *                    dict insertion order, which decides job ids)
 *   req_state        req_id -> {ctx, pending primary stores, finished, request-level
 *                    tiers, parked cascade keys}
 *   processed_jobs_this_step  the once-per-step polling gate
 *
 * The order inside on_schedule_end is vLLM's: poll, serve external requests,
 * reset the gate, flush promotions, flush parked cascades, tiers' on_schedule_end,
 * request-allocated metrics. Tests depend on the gate: a job completed in step N
 * after the step's first poll is consumed in step N+1 by lookups, but by the next
 * prepare_store at once (vLLM 0.34 polls there unconditionally).
 *
 * Out of memory, the policy of kvt/tier.h: a call fails with -ENOMEM before it
 * changes anything; a job a tier refuses leaves the registry at once, its rows
 * unpinned (cascade) or its slots freed (promotion), and is never reported. */
#include <assert.h>
#include <errno.h>
#include <string.h>

#include "kvt/alloc.h"
#include "kvt/backpressure.h"
#include "kvt/clock.h"
#include "kvt/hash.h"
#include "kvt/log.h"
#include "kvt/manager.h"
#include "kvt/manager_test.h"
#include "kvt/map.h"
#include "kvt/metrics.h"
#include "kvt/vec.h"

#define MOD        "tiering"
#define NO_EXCLUDE (-1)

struct job_meta {
    struct kvt_job job; /* keys and chunk_ids point into the same allocation */
    int tier_idx;
};

struct pending_promotion {
    struct kvt_req_ctx *ctx;
    struct kvt_key *keys;
    int64_t *chunk_ids;
    size_t n, cap;
};

struct req_state {
    struct kvt_req_ctx *ctx;
    int pending_primary_stores;
    bool is_finished;
    uint32_t request_level_tiers;   /* bit i: tier i asked for REQUEST_LEVEL */
    struct kvt_primary_access *acc; /* its cache access, given to the policy at finish */
    struct kvt_key *parked;         /* pending_cascade_keys */
    size_t n_parked, cap_parked;
};

struct kvt_parent {
    struct kvt_manager *m;
    int origin;
    bool active; /* valid only during serve_external_requests */
};

struct kvt_manager {
    struct kvt_primary *primary;
    struct kvt_tier *tiers[KVT_MAX_TIERS];
    size_t n_tiers;
    struct kvt_parent parents[KVT_MAX_TIERS];
    kvt_job_id_t next_job_id;
    struct kvt_map jobs;
    struct kvt_map pending_loads[KVT_MAX_TIERS];
    int pending_tier_order[KVT_MAX_TIERS];
    size_t n_pending_tiers;
    bool processed_jobs_this_step;
    struct kvt_map req_state;
    struct kvt_metrics *metrics;
    struct kvt_metrics_queue *lookups_seen; /* the metrics' queue of primary lookups */
    struct kvt_store_output scratch;        /* promotion allocations */
    bool shutdown_failed;
    uint64_t primary_lookups; /* one-key lookups, for the sampled sync delay */
    double primary_lookup_s;  /* the last one timed */
    /* The request state found last (an engine's calls come in runs per request):
     * valid while it lives (its reference keeps its context's address), cleared
     * when it is freed. */
    struct req_state *last_st;
};

static struct kvt_primary_access *req_acc(struct kvt_manager *m, const struct kvt_req_ctx *ctx);

/* ---- jobs ---------------------------------------------------------------- */

static struct job_meta *job_alloc(size_t n)
{
    size_t keys_off = sizeof(struct job_meta);
    size_t ids_off = keys_off + n * sizeof(struct kvt_key);
    ids_off = (ids_off + 7) & ~(size_t)7;
    struct job_meta *jm = kvt_malloc(ids_off + n * sizeof(int64_t) + 1);
    if (jm == NULL)
        return NULL;
    memset(jm, 0, sizeof(*jm));
    jm->job.n = n;
    jm->job.keys = (struct kvt_key *)((char *)jm + keys_off);
    jm->job.chunk_ids = (int64_t *)((char *)jm + ids_off);
    return jm;
}

static void job_free(struct job_meta *jm)
{
    kvt_req_ctx_unref(jm->job.ctx);
    kvt_free(jm);
}

static int register_job(struct kvt_manager *m, struct job_meta *jm, int tier_idx,
                        struct kvt_req_ctx *ctx, bool is_promotion)
{
    int rc;
    jm->tier_idx = tier_idx;
    jm->job.id = m->next_job_id;
    jm->job.is_promotion = is_promotion;
    jm->job.ctx = kvt_req_ctx_ref(ctx);
    jm->job.submit_ns = kvt_now_ns();
    rc = kvt_map_put_u64(&m->jobs, jm->job.id, jm);
    if (rc != 0)
        return rc;
    m->next_job_id++;
    return 0;
}

/* Hands a registered job to its tier. A refused job (out of memory: the tier did
 * nothing with it) leaves the registry unreported; the caller undoes its pins or
 * slots and frees it. */
static int submit_job(struct kvt_manager *m, struct job_meta *jm)
{
    struct kvt_tier *t = m->tiers[jm->tier_idx];
    int rc = jm->job.is_promotion ? kvt_tier_submit_load(t, &jm->job)
                                  : kvt_tier_submit_store(t, &jm->job);

    if (rc != 0) {
        kvt_map_remove_u64(&m->jobs, jm->job.id);
        kvt_error(MOD, "tier #%d (%s) refused a %s of %zu chunks: %s", jm->tier_idx, t->type,
                  jm->job.is_promotion ? "promotion" : "cascade", jm->job.n, strerror(-rc));
        return rc;
    }
    kvt_metrics_on_job_registered(m->metrics, &jm->job, jm->tier_idx);
    return 0;
}

/* create_store_job: pin keys (prepare_read) and register a cascade job. */
static int create_store_job(struct kvt_manager *m, const struct kvt_key *keys, size_t n,
                            struct kvt_req_ctx *ctx, int tier_idx, struct job_meta **jm_p)
{
    struct job_meta *jm = job_alloc(n);
    int rc;
    if (jm == NULL)
        return -ENOMEM;
    rc = kvt_primary_prepare_read(m->primary, keys, n, jm->job.chunk_ids);
    if (rc != 0) {
        kvt_free(jm);
        return rc;
    }
    memcpy(jm->job.keys, keys, n * sizeof(*keys));
    rc = register_job(m, jm, tier_idx, ctx, false);
    if (rc != 0) {
        kvt_primary_complete_read(m->primary, keys, n);
        job_free(jm);
        return rc;
    }
    *jm_p = jm;
    return 0;
}

/* A cascade of keys to tier tier_idx: pinned, submitted, or nothing pinned. */
static void cascade(struct kvt_manager *m, const struct kvt_key *keys, size_t n,
                    struct kvt_req_ctx *ctx, int tier_idx)
{
    struct job_meta *jm;
    int rc = create_store_job(m, keys, n, ctx, tier_idx, &jm);

    if (rc != 0) {
        kvt_error(MOD, "request %s: cascade of %zu chunks to tier #%d failed: %s",
                  KVT_LOG_STR(ctx->req_id), n, tier_idx, strerror(-rc));
        return;
    }
    if (submit_job(m, jm) != 0) {
        kvt_primary_complete_read(m->primary, jm->job.keys, jm->job.n);
        job_free(jm);
    }
}

static bool should_store_to_tier(struct kvt_tier *t, size_t n)
{
    return t->bp == NULL || kvt_bp_should_store(t->bp, n);
}

static void update_backpressure(struct kvt_manager *m, struct kvt_tier *t,
                                const struct job_meta *jm, const struct kvt_job_result *r)
{
    bool was;
    int64_t bytes;
    if (t->bp == NULL)
        return;
    was = kvt_bp_is_under_pressure(t->bp);
    bytes = r->transfer_bytes >= 0 ? r->transfer_bytes
                                   : (int64_t)(jm->job.n * kvt_primary_row_bytes(m->primary));
    kvt_bp_update(t->bp, (double)jm->job.submit_ns * 1e-9, bytes);
    if (kvt_bp_is_under_pressure(t->bp) != was)
        kvt_info(MOD, "tier #%d (%s) back-pressure %s (store_latency_ema=%g s/MiB)", jm->tier_idx,
                 t->type, was ? "cleared" : "activated", kvt_bp_ema(t->bp));
}

static bool key_in(const struct kvt_key *k, const struct kvt_key *set, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        if (kvt_key_eq(k, &set[i]))
            return true;
    }
    return false;
}

/* Splits a failed promotion into loaded and failed keys, completes both. */
static void complete_promotion(struct kvt_manager *m, struct job_meta *jm,
                               const struct kvt_job_result *r)
{
    const struct kvt_job *job = &jm->job;

    if (r->success) {
        kvt_primary_complete_write(m->primary, job->keys, job->n, true);
        return;
    }
    if (r->successful_keys == NULL || r->n_successful == 0) {
        kvt_primary_complete_write(m->primary, job->keys, job->n, false);
        return;
    }
    for (size_t i = 0; i < r->n_successful; i++)
        assert(key_in(&r->successful_keys[i], job->keys, job->n) &&
               "finished promotion reported unknown successful keys");
    kvt_primary_complete_write(m->primary, r->successful_keys, r->n_successful, true);
    /* A failed write emits no event, so key by key is the same as all at once. */
    for (size_t i = 0; i < job->n; i++) {
        if (!key_in(&job->keys[i], r->successful_keys, r->n_successful))
            kvt_primary_complete_write(m->primary, &job->keys[i], 1, false);
    }
}

struct finished_ctx {
    struct kvt_manager *m;
    int tier_idx;
};

static void on_finished_job(void *arg, const struct kvt_job_result *r)
{
    struct finished_ctx *fc = arg;
    struct kvt_manager *m = fc->m;
    struct job_meta *jm = kvt_map_remove_u64(&m->jobs, r->job_id);
    int rc;

    assert(jm != NULL && "finished job not in jobs");
    assert(jm->tier_idx == fc->tier_idx && "finished job reported by another tier");
    kvt_metrics_on_job_finished(m->metrics, &jm->job, jm->tier_idx, r);
    if (jm->job.is_promotion) {
        complete_promotion(m, jm, r);
    } else {
        rc = kvt_primary_complete_read(m->primary, jm->job.keys, jm->job.n);
        assert(rc == 0 && "cascade keys were not pinned");
        (void)rc;
        if (r->success)
            update_backpressure(m, m->tiers[jm->tier_idx], jm, r);
    }
    job_free(jm);
}

static void process_finished_jobs(struct kvt_manager *m)
{
    for (size_t i = 0; i < m->n_tiers; i++) {
        struct finished_ctx fc = {m, (int)i};
        kvt_tier_get_finished_jobs(m->tiers[i], on_finished_job, &fc);
    }
}

static void maybe_process_finished_jobs(struct kvt_manager *m)
{
    if (m->processed_jobs_this_step)
        return;
    m->processed_jobs_this_step = true;
    process_finished_jobs(m);
}

/* ---- promotions ------------------------------------------------------------ */

static void pending_free(struct pending_promotion *pp)
{
    kvt_req_ctx_unref(pp->ctx);
    kvt_free(pp->keys);
    kvt_free(pp->chunk_ids);
    kvt_free(pp);
}

static int pending_append(struct pending_promotion *pp, const struct kvt_key *keys,
                          const int64_t *ids, size_t n)
{
    if (pp->n + n > pp->cap) {
        size_t cap_keys = pp->cap, cap = pp->cap; /* one capacity for both arrays */

        if (kvt_vec_reserve(pp->keys, cap_keys, pp->n + n, 8) < 0 ||
            kvt_vec_reserve(pp->chunk_ids, cap, pp->n + n, 8) < 0)
            return -ENOMEM;
        pp->cap = cap;
    }
    memcpy(pp->keys + pp->n, keys, n * sizeof(*keys));
    memcpy(pp->chunk_ids + pp->n, ids, n * sizeof(*ids));
    pp->n += n;
    return 0;
}

static struct pending_promotion *pending_get(struct kvt_manager *m, int tier_idx,
                                             struct kvt_req_ctx *ctx)
{
    struct kvt_map *pl = &m->pending_loads[tier_idx];
    struct pending_promotion *pp = kvt_map_get(pl, ctx->req_id, ctx->req_id_len);
    if (pp != NULL)
        return pp;
    pp = kvt_calloc(1, sizeof(*pp));
    if (pp == NULL)
        return NULL;
    pp->ctx = kvt_req_ctx_ref(ctx);
    if (kvt_map_put(pl, ctx->req_id, ctx->req_id_len, pp) != 0) {
        pending_free(pp);
        return NULL;
    }
    if (kvt_map_size(pl) == 1)
        m->pending_tier_order[m->n_pending_tiers++] = tier_idx;
    return pp;
}

/* _initiate_promotion: allocate the primary slot now (ref -1, so a second lookup of
 * the key this step sees HIT_PENDING), submit at step end. False when the primary
 * is full: the caller answers MISS rather than retrying forever. */
static bool initiate_promotion(struct kvt_manager *m, int tier_idx, const struct kvt_key *key,
                               struct kvt_req_ctx *ctx)
{
    struct kvt_store_output *out = &m->scratch;
    struct pending_promotion *pp;
    /* vLLM's prepare_write is the request's prepare_store: it records the key in
     * the request's access and is a store miss (ARC adapts to a ghost). */
    if (kvt_primary_prepare_store_req(m->primary, key, 1, req_acc(m, ctx), out) != 0) {
        kvt_metrics_on_promotion_allocation_failure(m->metrics);
        return false;
    }
    pp = pending_get(m, tier_idx, ctx);
    if (pp == NULL || pending_append(pp, out->keys_to_store, out->chunk_ids, out->n_store) != 0) {
        kvt_primary_complete_write(m->primary, out->keys_to_store, out->n_store, false);
        kvt_metrics_on_promotion_allocation_failure(m->metrics);
        return false;
    }
    return true;
}

static void flush_pending_promotions(struct kvt_manager *m)
{
    for (size_t o = 0; o < m->n_pending_tiers; o++) {
        int tier_idx = m->pending_tier_order[o];
        struct kvt_map *pl = &m->pending_loads[tier_idx];
        struct kvt_map_entry *e;
        size_t it = 0;
        while (kvt_map_next(pl, &it, &e)) {
            struct pending_promotion *pp = e->value;
            struct job_meta *jm;
            if (pp->n == 0) { /* its only key could not be appended (out of memory) */
                pending_free(pp);
                continue;
            }
            jm = job_alloc(pp->n);
            if (jm != NULL) {
                memcpy(jm->job.keys, pp->keys, pp->n * sizeof(*pp->keys));
                memcpy(jm->job.chunk_ids, pp->chunk_ids, pp->n * sizeof(*pp->chunk_ids));
            }
            if (jm == NULL || register_job(m, jm, tier_idx, pp->ctx, true) != 0) {
                /* Out of memory: the promotion never starts; free its slots. */
                kvt_error(MOD, "cannot submit a promotion of %zu chunks: out of memory", pp->n);
                kvt_primary_complete_write(m->primary, pp->keys, pp->n, false);
                if (jm != NULL)
                    job_free(jm);
            } else if (submit_job(m, jm) != 0) {
                kvt_primary_complete_write(m->primary, pp->keys, pp->n, false);
                job_free(jm);
            }
            pending_free(pp);
        }
        kvt_map_clear(pl);
    }
    m->n_pending_tiers = 0;
}

static void clear_pending_promotions(struct kvt_manager *m)
{
    for (size_t o = 0; o < m->n_pending_tiers; o++) {
        struct kvt_map *pl = &m->pending_loads[m->pending_tier_order[o]];
        struct kvt_map_entry *e;
        size_t it = 0;
        while (kvt_map_next(pl, &it, &e))
            pending_free(e->value);
        kvt_map_clear(pl);
    }
    m->n_pending_tiers = 0;
}

/* ---- requests -------------------------------------------------------------- */

static struct req_state *req_get(struct kvt_manager *m, const struct kvt_req_ctx *ctx)
{
    struct req_state *st;

    /* The state of ctx's request is the one registered under its id: the same
     * context (a state holds a reference to it, so no other context has its
     * address) names the same request. */
    if (m->last_st != NULL && m->last_st->ctx == ctx)
        return m->last_st;
    st = kvt_map_get(&m->req_state, ctx->req_id, ctx->req_id_len);
    if (st != NULL)
        m->last_st = st;
    return st;
}

/* The cache access of the request of ctx, or NULL when the manager does not know
 * it. */
static struct kvt_primary_access *req_acc(struct kvt_manager *m, const struct kvt_req_ctx *ctx)
{
    struct req_state *st = req_get(m, ctx);

    return st != NULL ? st->acc : NULL;
}

static void req_free(struct kvt_manager *m, struct req_state *st)
{
    if (m->last_st == st)
        m->last_st = NULL;
    kvt_primary_access_destroy(st->acc);
    kvt_req_ctx_unref(st->ctx);
    kvt_free(st->parked);
    kvt_free(st);
}

static int park_key(struct req_state *st, const struct kvt_key *key)
{
    if (kvt_vec_reserve(st->parked, st->cap_parked, st->n_parked + 1, 8) < 0)
        return -ENOMEM;
    st->parked[st->n_parked++] = *key;
    return 0;
}

static void maybe_finalize_request(struct kvt_manager *m, struct req_state *st, int exclude)
{
    if (!st->is_finished || st->pending_primary_stores != 0 || st->n_parked != 0)
        return;
    for (size_t i = 0; i < m->n_tiers; i++) {
        if ((int)i != exclude)
            kvt_tier_on_request_finished(m->tiers[i], st->ctx);
    }
    kvt_metrics_on_request_finished(m->metrics, st->ctx);
    kvt_map_remove(&m->req_state, st->ctx->req_id, st->ctx->req_id_len);
    req_free(m, st);
}

/* _cascade_existing_chunks_to_request_level_tiers: chunks a request-level tier
 * needs although the primary already had them. HIT_PENDING keys are parked (the
 * #53062 fix), MISS keys dropped. */
static void cascade_existing(struct kvt_manager *m, struct req_state *st,
                             const struct kvt_key *keys, size_t n)
{
    struct kvt_key *ready = kvt_reallocarray(NULL, n ? n : 1, sizeof(*ready));
    size_t n_ready = 0;
    if (ready == NULL) {
        kvt_error(MOD, "request %s: no memory to cascade %zu existing chunks",
                  KVT_LOG_STR(st->ctx->req_id), n);
        return;
    }
    for (size_t i = 0; i < n; i++) {
        enum kvt_lookup_result r = kvt_primary_lookup(m->primary, &keys[i]);
        if (r == KVT_HIT)
            ready[n_ready++] = keys[i];
        else if (r == KVT_HIT_PENDING) {
            if (park_key(st, &keys[i]) != 0)
                kvt_error(MOD, "request %s: cannot park a cascade key",
                          KVT_LOG_STR(st->ctx->req_id));
        } else
            assert(r == KVT_MISS && "primary tier returned RETRY for a cascade key");
    }
    for (size_t i = 0; n_ready > 0 && i < m->n_tiers; i++) {
        if (!(st->request_level_tiers & (1u << i)))
            continue;
        if (!should_store_to_tier(m->tiers[i], n_ready))
            continue;
        cascade(m, ready, n_ready, st->ctx, (int)i);
    }
    kvt_free(ready);
}

static void flush_pending_cascades(struct kvt_manager *m)
{
    struct kvt_map_entry *e;
    size_t it = 0;
    while (kvt_map_next(&m->req_state, &it, &e)) {
        struct req_state *st = e->value;
        struct kvt_key *keys;
        size_t n;
        if (st->n_parked == 0)
            continue;
        assert(st->request_level_tiers != 0);
        keys = st->parked;
        n = st->n_parked;
        st->parked = NULL;
        st->n_parked = st->cap_parked = 0;
        cascade_existing(m, st, keys, n);
        kvt_free(keys);
        maybe_finalize_request(m, st, NO_EXCLUDE);
    }
}

#define PRIMARY_GROUP 16 /* keys per kvt_primary_lookup_many call */
#define PRIMARY_TIMED 16 /* one-key lookups per timed one */

/* ---- the OffloadingManager API ------------------------------------------------ */

/* Seconds since kvt_ticks() gave t0: a lookup's sync delay (vLLM times each tier's
 * lookup; two clock reads would cost more than the primary's lookup). */
static double ticks_since_s(uint64_t t0)
{
    uint64_t t1 = kvt_ticks();

    return t1 > t0 ? kvt_ticks_to_s(t1 - t0) : 0;
}

/* The secondary tiers' part of a lookup that missed the primary. */
static enum kvt_lookup_result lookup_secondaries_h(struct kvt_manager *m, const struct kvt_key *key,
                                                   uint64_t h, struct kvt_req_ctx *ctx, int exclude)
{
    enum kvt_lookup_result r;
    bool any_retry = false;
    uint64_t t0;

    for (size_t i = 0; i < m->n_tiers; i++) {
        struct kvt_tier *t = m->tiers[i];
        if ((int)i == exclude ||
            !kvt_tier_filter_allows(&ctx->load_tier_filter, t->medium, t->locality))
            continue;
        t0 = kvt_ticks();
        r = kvt_tier_lookup(t, key, ctx);
        kvt_metrics_on_lookup_h(m->metrics, ctx, key, h, i + 1, r, ticks_since_s(t0));
        if (r == KVT_HIT)
            return initiate_promotion(m, (int)i, key, ctx) ? KVT_HIT_PENDING : KVT_MISS;
        if (r == KVT_RETRY)
            any_retry = true;
    }
    return any_retry ? KVT_RETRY : KVT_MISS;
}

static enum kvt_lookup_result lookup_ex(struct kvt_manager *m, const struct kvt_key *key,
                                        struct kvt_req_ctx *ctx, int exclude)
{
    enum kvt_lookup_result r;
    uint64_t t0;

    /* An invalid key (length 0 or over 64) misses; it is hashed by no one. (The
     * hash is kvt_key_hash's, one call shorter.) */
    uint64_t h = key->len >= 1 && key->len <= KVT_KEY_MAX ? kvt_hash64(key->bytes, key->len) : 0;

    double dt;

    /* The index cell's miss starts as soon as the hash is known. */
    kvt_primary_prefetch_h(m->primary, h);
    maybe_process_finished_jobs(m);
    /* The primary's part of the sync delay: one lookup in PRIMARY_TIMED is timed
     * and the others take its figure (a clock read costs 25-100 ns on a VM, more
     * than the lookup it would time; the histogram still counts every lookup). */
    if (m->primary_lookups++ % PRIMARY_TIMED == 0) {
        t0 = kvt_ticks();
        r = kvt_primary_lookup_h(m->primary, key, h);
        m->primary_lookup_s = dt = ticks_since_s(t0);
    } else {
        r = kvt_primary_lookup_h(m->primary, key, h);
        dt = m->primary_lookup_s;
    }
    /* Queued inline, most of the time: a call here would keep the core from starting
     * the next lookup's cache misses under this one's. */
    if (!kvt_metrics_queue_lookup(m->lookups_seen, ctx, h, r, dt))
        kvt_metrics_on_lookup_h(m->metrics, ctx, key, h, 0, r, dt);
    if (r == KVT_HIT || r == KVT_HIT_PENDING)
        return r;
    return lookup_secondaries_h(m, key, h, ctx, exclude);
}

enum kvt_lookup_result kvt_manager_lookup(struct kvt_manager *m, const struct kvt_key *key,
                                          struct kvt_req_ctx *ctx)
{
    return lookup_ex(m, key, ctx, NO_EXCLUDE);
}

/* Each key as kvt_manager_lookup would answer it, in order: the primary answers a
 * group of keys at once (kvt_primary_lookup_many overlaps their cache misses),
 * and the group's answers are used only while nothing has changed the primary
 * since; a miss that reaches the secondary tiers may promote (allocate, evict), so
 * the rest of that group is asked again one key at a time. */
size_t kvt_manager_lookup_many(struct kvt_manager *m, const struct kvt_key *keys, size_t n,
                               struct kvt_req_ctx *ctx, bool prefix, enum kvt_lookup_result *out)
{
    enum kvt_lookup_result group[PRIMARY_GROUP];
    uint64_t hash[PRIMARY_GROUP];
    size_t done = 0;

    maybe_process_finished_jobs(m);
    while (done < n) {
        size_t g = n - done < PRIMARY_GROUP ? n - done : PRIMARY_GROUP;
        bool fresh = true;
        uint64_t t0 = kvt_ticks();
        double each;

        kvt_primary_lookup_many(m->primary, keys + done, g, group, hash);
        each = ticks_since_s(t0) / (double)g;
        for (size_t i = 0; i < g; i++) {
            const struct kvt_key *key = &keys[done];
            enum kvt_lookup_result r;

            if (fresh) {
                uint64_t h = hash[i]; /* the primary's (0 for an invalid key, as here) */

                r = group[i];
                if (!kvt_metrics_queue_lookup(m->lookups_seen, ctx, h, r, each))
                    kvt_metrics_on_lookup_h(m->metrics, ctx, key, h, 0, r, each);
                if (r == KVT_MISS && m->n_tiers > 0) {
                    r = lookup_secondaries_h(m, key, h, ctx, NO_EXCLUDE);
                    fresh = false;
                }
            } else {
                r = lookup_ex(m, key, ctx, NO_EXCLUDE);
            }
            out[done++] = r;
            if (prefix && (r == KVT_MISS || r == KVT_RETRY))
                return done;
        }
    }
    return done;
}

int kvt_manager_prepare_load(struct kvt_manager *m, const struct kvt_key *keys, size_t n,
                             struct kvt_req_ctx *ctx, int64_t *chunk_ids)
{
    /* A load of a request the manager does not know records nothing: no finish
     * would ever apply it. */
    return kvt_primary_prepare_load_req(m->primary, keys, n, req_acc(m, ctx), chunk_ids);
}

int kvt_manager_complete_load(struct kvt_manager *m, const struct kvt_key *keys, size_t n,
                              struct kvt_req_ctx *ctx)
{
    return kvt_primary_complete_load(m->primary, keys, n);
}

void kvt_manager_touch(struct kvt_manager *m, const struct kvt_key *keys, size_t n,
                       struct kvt_req_ctx *ctx)
{
    /* An access of its own, applied at once (as touch always was): it does not
     * join the request's access, which its finish applies. */
    kvt_primary_touch(m->primary, keys, n);
    for (size_t i = 0; i < m->n_tiers; i++)
        kvt_tier_touch(m->tiers[i], keys, n, ctx);
}

int kvt_manager_prepare_store(struct kvt_manager *m, const struct kvt_key *keys, size_t n,
                              struct kvt_req_ctx *ctx, struct kvt_store_output *out)
{
    struct req_state *st = req_get(m, ctx);
    struct kvt_key *existing = NULL;
    int rc;
    if (st == NULL)
        return -EINVAL;

    /* Completions first: cascade completions unpin and promotion completions make
     * chunks evictable for the first time, both before the eviction decision.
     * Unconditionally, as vLLM 0.34 does: the once-per-step gate may have been set
     * by this step's first lookup, and eviction must see the freshest completions. */
    m->processed_jobs_this_step = true;
    process_finished_jobs(m);
    if (st->request_level_tiers != 0) {
        /* Before the store: out of memory must change nothing. */
        existing = kvt_reallocarray(NULL, n ? n : 1, sizeof(*existing));
        if (existing == NULL)
            return -ENOMEM;
    }
    rc = kvt_primary_prepare_store_req(m->primary, keys, n, st->acc, out);
    if (rc != 0) {
        kvt_free(existing);
        return rc;
    }
    if (out->n_store > 0)
        st->pending_primary_stores++;

    if (existing != NULL) {
        size_t n_existing = 0;
        for (size_t i = 0; i < n; i++) {
            if (!key_in(&keys[i], out->keys_to_store, out->n_store))
                existing[n_existing++] = keys[i];
        }
        if (n_existing > 0)
            cascade_existing(m, st, existing, n_existing);
        kvt_free(existing);
    }
    return 0;
}

int kvt_manager_complete_store(struct kvt_manager *m, const struct kvt_key *keys, size_t n,
                               struct kvt_req_ctx *ctx, bool success)
{
    struct req_state *st = req_get(m, ctx);
    if (st == NULL || st->pending_primary_stores <= 0)
        return -EINVAL;
    /* Every key of a successful store must be in the primary (ready or being
     * written) so that each tier's cascade can pin it. */
    if (kvt_primary_complete_store_strict(m->primary, keys, n, success, st->acc) == -EINVAL)
        return -EINVAL;
    for (size_t i = 0; success && i < m->n_tiers; i++) {
        if (should_store_to_tier(m->tiers[i], n))
            cascade(m, keys, n, ctx, (int)i);
    }
    st->pending_primary_stores--;
    maybe_finalize_request(m, st, NO_EXCLUDE);
    return 0;
}

static int on_new_request_ex(struct kvt_manager *m, struct kvt_req_ctx *ctx, int exclude,
                             enum kvt_offload_policy *policy_p)
{
    struct req_state *st;
    if (req_get(m, ctx) != NULL)
        return -EEXIST;
    st = kvt_calloc(1, sizeof(*st));
    if (st == NULL)
        return -ENOMEM;
    st->ctx = kvt_req_ctx_ref(ctx);
    if (kvt_primary_access_create(&st->acc) != 0 ||
        kvt_map_put(&m->req_state, ctx->req_id, ctx->req_id_len, st) != 0) {
        req_free(m, st);
        return -ENOMEM;
    }
    kvt_metrics_on_new_request(m->metrics, ctx);
    for (size_t i = 0; i < m->n_tiers; i++) {
        if ((int)i == exclude)
            continue;
        if (kvt_tier_on_new_request(m->tiers[i], ctx) == KVT_REQUEST_LEVEL)
            st->request_level_tiers |= 1u << i;
    }
    if (policy_p != NULL)
        *policy_p = st->request_level_tiers ? KVT_REQUEST_LEVEL : KVT_CHUNK_LEVEL;
    return 0;
}

int kvt_manager_on_new_request(struct kvt_manager *m, struct kvt_req_ctx *ctx,
                               enum kvt_offload_policy *policy_p)
{
    return on_new_request_ex(m, ctx, NO_EXCLUDE, policy_p);
}

static int on_request_finished_ex(struct kvt_manager *m, struct kvt_req_ctx *ctx, int exclude)
{
    struct req_state *st = req_get(m, ctx);
    if (st == NULL)
        return -EINVAL;
    kvt_primary_request_finished(m->primary, st->acc);
    st->is_finished = true;
    maybe_finalize_request(m, st, exclude);
    return 0;
}

int kvt_manager_on_request_finished(struct kvt_manager *m, struct kvt_req_ctx *ctx)
{
    return on_request_finished_ex(m, ctx, NO_EXCLUDE);
}

void kvt_manager_on_schedule_end(struct kvt_manager *m, const struct kvt_schedule_end_ctx *ctx)
{
    static const struct kvt_schedule_end_ctx empty;
    if (ctx == NULL)
        ctx = &empty;
    /* Catch-all poll, so idle steps make progress. */
    maybe_process_finished_jobs(m);
    for (size_t i = 0; i < m->n_tiers; i++) {
        m->parents[i].active = true;
        kvt_tier_serve_external_requests(m->tiers[i], &m->parents[i]);
        m->parents[i].active = false;
    }
    /* After serving, so lookups made for peers did not re-poll. */
    m->processed_jobs_this_step = false;
    flush_pending_promotions(m);
    flush_pending_cascades(m);
    for (size_t i = 0; i < m->n_tiers; i++)
        kvt_tier_on_schedule_end(m->tiers[i], ctx);
    for (size_t i = 0; i < ctx->n_new; i++) {
        struct req_state *st =
            kvt_map_get(&m->req_state, ctx->new_req_ids[i], strlen(ctx->new_req_ids[i]));
        if (st != NULL)
            kvt_metrics_on_request_allocated(m->metrics, st->ctx);
    }
}

bool kvt_manager_has_pending_work(struct kvt_manager *m)
{
    struct kvt_map_entry *e;
    size_t it = 0;
    if (kvt_map_size(&m->jobs) > 0)
        return true;
    while (kvt_map_next(&m->req_state, &it, &e)) {
        if (((struct req_state *)e->value)->n_parked > 0)
            return true;
    }
    for (size_t i = 0; i < m->n_tiers; i++) {
        if (kvt_tier_has_pending_work(m->tiers[i]))
            return true;
    }
    return false;
}

int kvt_manager_take_events(struct kvt_manager *m, struct kvt_events *out)
{
    int rc = kvt_primary_take_events(m->primary, out);
    for (size_t i = 0; rc == 0 && i < m->n_tiers; i++)
        rc = kvt_tier_take_events(m->tiers[i], out);
    return rc;
}

int kvt_manager_get_stats(struct kvt_manager *m, struct kvt_stats *out)
{
    int rc = kvt_primary_get_stats(m->primary, out);
    if (rc == 0) {
        kvt_metrics_record_backpressure(m->metrics, m->tiers, m->n_tiers);
        rc = kvt_metrics_take_stats(m->metrics, out);
    }
    for (size_t i = 0; rc == 0 && i < m->n_tiers; i++)
        rc = kvt_tier_get_stats(m->tiers[i], out);
    return rc;
}

int kvt_manager_reset_cache(struct kvt_manager *m)
{
    struct kvt_map_entry *e;
    size_t it = 0;

    /* No tier I/O may touch primary memory when the primary is wiped. */
    for (size_t i = 0; i < m->n_tiers; i++) {
        int rc = kvt_tier_drain_jobs(m->tiers[i]);
        if (rc != 0 && rc != -EOPNOTSUPP) {
            kvt_error(MOD, "reset_cache: tier #%zu (%s) failed to drain: %s", i, m->tiers[i]->type,
                      strerror(-rc));
            return rc;
        }
    }
    process_finished_jobs(m);
    assert(kvt_map_size(&m->jobs) == 0 && "a drained tier still has unreported jobs");
    /* Their slots are about to be wiped and no I/O was started for them. */
    clear_pending_promotions(m);
    assert(kvt_metrics_is_idle(m->metrics));

    while (kvt_map_next(&m->req_state, &it, &e)) {
        struct req_state *st = e->value;
        st->pending_primary_stores = 0;
        st->n_parked = 0;
        if (!st->is_finished)
            continue;
        for (size_t i = 0; i < m->n_tiers; i++)
            kvt_tier_on_request_finished(m->tiers[i], st->ctx);
        kvt_metrics_on_request_finished(m->metrics, st->ctx);
        kvt_map_remove(&m->req_state, st->ctx->req_id, st->ctx->req_id_len);
        req_free(m, st);
    }
    kvt_primary_reset_cache(m->primary);
    m->processed_jobs_this_step = false;
    for (size_t i = 0; i < m->n_tiers; i++) {
        if (m->tiers[i]->bp != NULL)
            kvt_bp_reset(m->tiers[i]->bp);
    }
    return 0;
}

int kvt_manager_reset_all(struct kvt_manager *m)
{
    int err = kvt_manager_reset_cache(m);

    if (err != 0)
        return err;
    for (size_t i = 0; i < m->n_tiers; i++) {
        int rc = kvt_tier_reset(m->tiers[i]);

        if (rc == -EOPNOTSUPP) {
            kvt_info(MOD, "reset: tier #%zu (%s) keeps its data (no reset)", i, m->tiers[i]->type);
        } else if (rc != 0) {
            kvt_error(MOD, "reset: tier #%zu (%s): %s", i, m->tiers[i]->type, strerror(-rc));
            if (err == 0)
                err = rc;
        }
    }
    return err;
}

int kvt_manager_shutdown(struct kvt_manager *m)
{
    int err = 0;
    for (size_t i = 0; i < m->n_tiers; i++) {
        int rc = kvt_tier_shutdown(m->tiers[i]);
        if (rc != 0) {
            kvt_error(MOD, "failed to shut down secondary tier #%zu (tier_type=%s): %s", i,
                      m->tiers[i]->type, strerror(rc < 0 ? -rc : rc));
            err = rc;
        }
    }
    if (err != 0) {
        /* A failed tier may still use the region: keep the primary mapped. */
        m->shutdown_failed = true;
        return err;
    }
    kvt_primary_destroy(m->primary);
    m->primary = NULL;
    return 0;
}

/* ---- construction ------------------------------------------------------------ */

int kvt_manager_create(struct kvt_primary *primary, struct kvt_tier *const *tiers, size_t n_tiers,
                       struct kvt_manager **m_p)
{
    const char *types[KVT_MAX_TIERS];
    struct kvt_manager *m;
    int rc;

    if (primary == NULL || n_tiers > KVT_MAX_TIERS)
        return -EINVAL;
    m = kvt_calloc(1, sizeof(*m));
    if (m == NULL)
        return -ENOMEM;
    for (size_t i = 0; i < n_tiers; i++)
        types[i] = tiers[i]->type;
    rc = kvt_metrics_create(types, n_tiers, kvt_primary_num_chunks(primary),
                            kvt_primary_row_bytes(primary), &m->metrics);
    if (rc != 0) {
        kvt_free(m);
        return rc;
    }
    m->lookups_seen = kvt_metrics_queue_of(m->metrics);
    m->primary = primary;
    m->n_tiers = n_tiers;
    for (size_t i = 0; i < n_tiers; i++) {
        struct kvt_tier *t = tiers[i];
        t->index = (int)i;
        t->row_bytes = kvt_primary_row_bytes(primary);
        t->primary_base = kvt_primary_base(primary);
        t->num_chunks = kvt_primary_num_chunks(primary);
        m->tiers[i] = t;
        m->parents[i] = (struct kvt_parent){.m = m, .origin = (int)i};
        kvt_map_init(&m->pending_loads[i]);
    }
    kvt_map_init(&m->jobs);
    kvt_map_init(&m->req_state);
    kvt_store_output_init(&m->scratch);
    *m_p = m;
    return 0;
}

void kvt_manager_destroy(struct kvt_manager *m)
{
    struct kvt_map_entry *e;
    size_t it = 0;
    if (m == NULL)
        return;
    clear_pending_promotions(m);
    while (kvt_map_next(&m->jobs, &it, &e))
        job_free(e->value);
    kvt_map_cleanup(&m->jobs);
    it = 0;
    while (kvt_map_next(&m->req_state, &it, &e))
        req_free(m, e->value);
    kvt_map_cleanup(&m->req_state);
    for (size_t i = 0; i < m->n_tiers; i++) {
        kvt_tier_destroy(m->tiers[i]);
        kvt_map_cleanup(&m->pending_loads[i]);
    }
    if (!m->shutdown_failed)
        kvt_primary_destroy(m->primary);
    kvt_metrics_destroy(m->metrics);
    kvt_store_output_cleanup(&m->scratch);
    kvt_free(m);
}

/* ---- the parent handle --------------------------------------------------------- */

int kvt_parent_on_new_request(struct kvt_parent *p, struct kvt_req_ctx *ctx,
                              enum kvt_offload_policy *policy_p)
{
    if (!p->active)
        return -EINVAL;
    return on_new_request_ex(p->m, ctx, p->origin, policy_p);
}

enum kvt_lookup_result kvt_parent_lookup(struct kvt_parent *p, const struct kvt_key *key,
                                         struct kvt_req_ctx *ctx)
{
    if (!p->active)
        return KVT_MISS;
    return lookup_ex(p->m, key, ctx, p->origin);
}

int kvt_parent_create_store_job(struct kvt_parent *p, const struct kvt_key *keys, size_t n,
                                struct kvt_req_ctx *ctx, const struct kvt_job **job_p)
{
    struct job_meta *jm;
    int rc;
    if (!p->active)
        return -EINVAL;
    rc = create_store_job(p->m, keys, n, ctx, p->origin, &jm);
    if (rc != 0)
        return rc;
    kvt_metrics_on_job_registered(p->m->metrics, &jm->job, p->origin);
    *job_p = &jm->job;
    return 0;
}

int kvt_parent_on_request_finished(struct kvt_parent *p, struct kvt_req_ctx *ctx)
{
    if (!p->active)
        return -EINVAL;
    return on_request_finished_ex(p->m, ctx, p->origin);
}

/* ---- introspection --------------------------------------------------------------- */

struct kvt_primary *kvt_manager_primary(struct kvt_manager *m)
{
    return m->primary;
}

size_t kvt_manager_num_tiers(const struct kvt_manager *m)
{
    return m->n_tiers;
}

struct kvt_tier *kvt_manager_tier(struct kvt_manager *m, size_t idx)
{
    return idx < m->n_tiers ? m->tiers[idx] : NULL;
}

size_t kvt_manager_num_jobs(const struct kvt_manager *m)
{
    return kvt_map_size(&m->jobs);
}

size_t kvt_manager_num_requests(const struct kvt_manager *m)
{
    return kvt_map_size(&m->req_state);
}

bool kvt_manager_has_request(const struct kvt_manager *m, const char *req_id)
{
    return kvt_map_get(&m->req_state, req_id, strlen(req_id)) != NULL;
}

int kvt_manager_request_info(const struct kvt_manager *m, const char *req_id,
                             struct kvt_manager_req_info *info_p)
{
    const struct req_state *st = kvt_map_get(&m->req_state, req_id, strlen(req_id));
    if (st == NULL)
        return -ENOENT;
    *info_p = (struct kvt_manager_req_info){.pending_primary_stores = st->pending_primary_stores,
                                            .is_finished = st->is_finished,
                                            .request_level_tiers = st->request_level_tiers,
                                            .n_pending_cascade_keys = st->n_parked};
    return 0;
}

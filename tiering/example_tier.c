/* SPDX-License-Identifier: Apache-2.0 */
/* The in-memory example tier (vLLM's ExampleSecondaryTierManager) and
 * the test double every manager test drives.
 *
 * Keys live in a map (key -> row copy, or a marker when bytes are not kept).
 * Stores mark their keys present at submit time, as the original does; loads
 * check presence at submit time and, with copy_bytes, copy the rows into the
 * job's primary slots right away (the slots are write-pending, nobody reads them
 * before the job is reported). Results wait in a FIFO until they are reportable:
 * not held (hold_jobs) and delay_polls polls have passed. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "kvt/alloc.h"
#include "kvt/common.h"
#include "kvt/backpressure.h"
#include "kvt/example_tier.h"
#include "kvt/map.h"
#include "kvt/vec.h"

struct ex_result {
    struct kvt_job_result r;
    struct kvt_key *ok_keys; /* owned copy of successful keys */
    unsigned polls_left;
};

struct ex_tier {
    struct kvt_tier base;
    struct kvt_example_tier_config cfg;
    struct kvt_map keys; /* key -> row copy (copy_bytes) or &present_marker */
    struct kvt_map seen; /* retry_first_lookup: keys already answered RETRY once */
    struct ex_result *res;
    size_t n_res, cap_res;
    bool hold;
    double fail_rate;
    uint64_t rng;
    unsigned calls[KVT_EX_SHUTDOWN + 1];
    struct kvt_events events;
};

static char present_marker;

static struct ex_tier *ex(struct kvt_tier *t)
{
    return KVT_CONTAINER_OF(t, struct ex_tier, base);
}

static void note(struct ex_tier *x, enum kvt_example_call call, const struct kvt_job *job,
                 struct kvt_req_ctx *ctx, const struct kvt_key *keys, size_t n)
{
    x->calls[call]++;
    if (x->cfg.on_call)
        x->cfg.on_call(x->cfg.cb_arg, &x->base, call, job, ctx, keys, n);
}

static bool roll_fail(struct ex_tier *x)
{
    if (x->fail_rate <= 0)
        return false;
    /* xorshift64*: deterministic for a seed, independent of libc's rand(). */
    x->rng ^= x->rng >> 12;
    x->rng ^= x->rng << 25;
    x->rng ^= x->rng >> 27;
    uint64_t v = x->rng * 2685821657736338717ull;
    return (double)(v >> 11) / 9007199254740992.0 < x->fail_rate;
}

/* Room for the job's result, n_ok successful keys included, made before the job is
 * accepted (so reporting it never allocates); the caller fills it and counts it
 * (n_res++). NULL when memory is short. */
static struct ex_result *reserve_result(struct ex_tier *x, size_t n_ok)
{
    struct ex_result *r;
    if (kvt_vec_reserve(x->res, x->cap_res, x->n_res + 1, 16) < 0)
        return NULL;
    r = &x->res[x->n_res];
    memset(r, 0, sizeof(*r));
    if (n_ok > 0) {
        r->ok_keys = kvt_reallocarray(NULL, n_ok, sizeof(*r->ok_keys));
        if (r->ok_keys == NULL)
            return NULL;
    }
    return r;
}

static void queue_result(struct ex_tier *x, struct ex_result *r, const struct kvt_job *job,
                         bool success, size_t n_ok)
{
    r->r = (struct kvt_job_result){.job_id = job->id,
                                   .success = success,
                                   .successful_keys = n_ok > 0 ? r->ok_keys : NULL,
                                   .n_successful = n_ok,
                                   .transfer_time = -1,
                                   .transfer_bytes = -1};
    r->polls_left = x->cfg.delay_polls;
    x->n_res++;
}

static enum kvt_lookup_result ex_lookup(struct kvt_tier *t, const struct kvt_key *key,
                                        struct kvt_req_ctx *ctx)
{
    struct ex_tier *x = ex(t);
    note(x, KVT_EX_LOOKUP, NULL, ctx, key, 1);
    if (x->cfg.retry_first_lookup && kvt_map_get(&x->seen, key->bytes, key->len) == NULL) {
        if (kvt_map_put(&x->seen, key->bytes, key->len, &present_marker) == 0)
            return KVT_RETRY;
    }
    return kvt_map_get(&x->keys, key->bytes, key->len) ? KVT_HIT : KVT_MISS;
}

static int put_key(struct ex_tier *x, const struct kvt_key *key, const void *row)
{
    void *val = &present_marker;
    void *old = kvt_map_get(&x->keys, key->bytes, key->len);
    if (x->cfg.copy_bytes && x->base.row_bytes > 0) {
        val = old != NULL ? old : kvt_malloc(x->base.row_bytes);
        if (val == NULL)
            return -ENOMEM;
        if (row != NULL)
            memcpy(val, row, x->base.row_bytes);
        else
            memset(val, 0, x->base.row_bytes);
        if (old != NULL)
            return 0;
    }
    if (old != NULL)
        return 0;
    int rc = kvt_map_put(&x->keys, key->bytes, key->len, val);
    if (rc != 0 && val != &present_marker)
        kvt_free(val);
    return rc;
}

static int ex_submit_store(struct kvt_tier *t, const struct kvt_job *job)
{
    struct ex_tier *x = ex(t);
    struct ex_result *r = reserve_result(x, 0);
    bool ok = !roll_fail(x);
    note(x, KVT_EX_SUBMIT_STORE, job, job->ctx, job->keys, job->n);
    if (r == NULL)
        return -ENOMEM;
    for (size_t i = 0; ok && i < job->n; i++) {
        const uint8_t *row = NULL;
        if (t->primary_base != NULL)
            row = t->primary_base + (size_t)job->chunk_ids[i] * t->row_bytes;
        if (put_key(x, &job->keys[i], row) != 0)
            ok = false;
    }
    if (ok && x->cfg.emit_events)
        kvt_events_push(&x->events, job->keys, job->n, t->medium, t->locality, false);
    queue_result(x, r, job, ok, 0);
    return 0;
}

static int ex_submit_load(struct kvt_tier *t, const struct kvt_job *job)
{
    struct ex_tier *x = ex(t);
    struct ex_result *r = reserve_result(x, job->n);
    size_t n_ok = 0;
    bool any_absent = false;
    note(x, KVT_EX_SUBMIT_LOAD, job, job->ctx, job->keys, job->n);
    if (r == NULL)
        return -ENOMEM;
    for (size_t i = 0; i < job->n; i++) {
        void *row = kvt_map_get(&x->keys, job->keys[i].bytes, job->keys[i].len);
        if (row == NULL) {
            any_absent = true;
            continue;
        }
        if (roll_fail(x))
            continue;
        if (row != &present_marker && t->primary_base != NULL)
            memcpy(t->primary_base + (size_t)job->chunk_ids[i] * t->row_bytes, row, t->row_bytes);
        r->ok_keys[n_ok++] = job->keys[i];
    }
    /* The original fails the whole job when any key is absent; random failures
     * report the loaded subset (successful_keys), as real tiers do. */
    if (any_absent)
        n_ok = 0;
    queue_result(x, r, job, n_ok == job->n, n_ok == job->n ? 0 : n_ok);
    return 0;
}

static void ex_get_finished_jobs(struct kvt_tier *t, kvt_job_result_cb_t cb, void *arg)
{
    struct ex_tier *x = ex(t);
    size_t keep = 0, n = x->n_res;
    /* Report in submission order; keep what is not reportable yet. The callback
     * may not submit to this tier (the manager never does from a completion). */
    for (size_t i = 0; i < n; i++) {
        struct ex_result *r = &x->res[i];
        if (x->hold || r->polls_left > 0) {
            if (!x->hold)
                r->polls_left--;
            x->res[keep++] = *r;
            continue;
        }
        cb(arg, &r->r);
        kvt_free(r->ok_keys);
    }
    x->n_res = keep;
}

static int ex_drain_jobs(struct kvt_tier *t)
{
    struct ex_tier *x = ex(t);
    note(x, KVT_EX_DRAIN, NULL, NULL, NULL, 0);
    x->hold = false;
    for (size_t i = 0; i < x->n_res; i++)
        x->res[i].polls_left = 0;
    return 0;
}

static enum kvt_offload_policy ex_on_new_request(struct kvt_tier *t, struct kvt_req_ctx *ctx)
{
    struct ex_tier *x = ex(t);
    note(x, KVT_EX_ON_NEW_REQUEST, NULL, ctx, NULL, 0);
    return x->cfg.request_level ? KVT_REQUEST_LEVEL : KVT_CHUNK_LEVEL;
}

static void ex_on_request_finished(struct kvt_tier *t, struct kvt_req_ctx *ctx)
{
    note(ex(t), KVT_EX_ON_REQUEST_FINISHED, NULL, ctx, NULL, 0);
}

static bool ex_has_pending_work(struct kvt_tier *t)
{
    return ex(t)->n_res > 0;
}

static int ex_take_events(struct kvt_tier *t, struct kvt_events *out)
{
    struct ex_tier *x = ex(t);
    note(x, KVT_EX_TAKE_EVENTS, NULL, NULL, NULL, 0);
    return kvt_events_splice(out, &x->events);
}

static void ex_touch(struct kvt_tier *t, const struct kvt_key *keys, size_t n,
                     struct kvt_req_ctx *ctx)
{
    note(ex(t), KVT_EX_TOUCH, NULL, ctx, keys, n);
}

static void ex_serve(struct kvt_tier *t, struct kvt_parent *parent)
{
    note(ex(t), KVT_EX_SERVE, NULL, NULL, NULL, 0);
}

static void ex_on_schedule_end(struct kvt_tier *t, const struct kvt_schedule_end_ctx *ctx)
{
    note(ex(t), KVT_EX_ON_SCHEDULE_END, NULL, NULL, NULL, 0);
}

static int ex_shutdown(struct kvt_tier *t)
{
    struct ex_tier *x = ex(t);
    note(x, KVT_EX_SHUTDOWN, NULL, NULL, NULL, 0);
    return x->cfg.shutdown_error;
}

static void ex_destroy(struct kvt_tier *t)
{
    struct ex_tier *x = ex(t);
    size_t it = 0;
    struct kvt_map_entry *e;
    while (kvt_map_next(&x->keys, &it, &e)) {
        if (e->value != &present_marker)
            kvt_free(e->value);
    }
    kvt_map_cleanup(&x->keys);
    kvt_map_cleanup(&x->seen);
    for (size_t i = 0; i < x->n_res; i++)
        kvt_free(x->res[i].ok_keys);
    kvt_free(x->res);
    kvt_events_cleanup(&x->events);
    kvt_free(x);
}

static const struct kvt_tier_ops example_ops = {
    .lookup = ex_lookup,
    .submit_store = ex_submit_store,
    .submit_load = ex_submit_load,
    .get_finished_jobs = ex_get_finished_jobs,
    .drain_jobs = ex_drain_jobs,
    .on_new_request = ex_on_new_request,
    .on_request_finished = ex_on_request_finished,
    .has_pending_work = ex_has_pending_work,
    .take_events = ex_take_events,
    .touch = ex_touch,
    .serve_external_requests = ex_serve,
    .on_schedule_end = ex_on_schedule_end,
    .shutdown = ex_shutdown,
    .destroy = ex_destroy,
};

int kvt_example_tier_create(const struct kvt_example_tier_config *cfg, struct kvt_tier **tier_p)
{
    /* vLLM's example tier is CPU-like with no locality. */
    static const struct kvt_example_tier_config defaults = {.medium = KVT_MEDIUM_CPU,
                                                            .locality = KVT_ANY};
    struct ex_tier *x = kvt_calloc(1, sizeof(*x));
    if (x == NULL)
        return -ENOMEM;
    x->cfg = cfg ? *cfg : defaults;
    if (x->cfg.fail_rate < 0 || x->cfg.fail_rate > 1) {
        kvt_free(x);
        return -EINVAL;
    }
    kvt_tier_init(&x->base, &example_ops, x->cfg.type ? x->cfg.type : "example", x->cfg.medium,
                  x->cfg.locality);
    x->cfg.type = NULL; /* not kept: the tier's copy is base.type */
    kvt_map_init(&x->keys);
    kvt_map_init(&x->seen);
    kvt_events_init(&x->events);
    x->hold = x->cfg.hold_jobs;
    x->fail_rate = x->cfg.fail_rate;
    x->rng = x->cfg.seed * 0x9E3779B97F4A7C15ull + 1;
    *tier_p = &x->base;
    return 0;
}

bool kvt_example_tier_has(struct kvt_tier *t, const struct kvt_key *key)
{
    return kvt_map_get(&ex(t)->keys, key->bytes, key->len) != NULL;
}

int kvt_example_tier_insert(struct kvt_tier *t, const struct kvt_key *key, const void *row)
{
    return put_key(ex(t), key, row);
}

int kvt_example_tier_remove(struct kvt_tier *t, const struct kvt_key *key)
{
    void *v = kvt_map_remove(&ex(t)->keys, key->bytes, key->len);
    if (v == NULL)
        return -ENOENT;
    if (v != &present_marker)
        kvt_free(v);
    return 0;
}

size_t kvt_example_tier_num_keys(struct kvt_tier *t)
{
    return kvt_map_size(&ex(t)->keys);
}

size_t kvt_example_tier_num_unreported(struct kvt_tier *t)
{
    return ex(t)->n_res;
}

void kvt_example_tier_release(struct kvt_tier *t)
{
    struct ex_tier *x = ex(t);
    x->hold = false;
    for (size_t i = 0; i < x->n_res; i++)
        x->res[i].polls_left = 0;
}

void kvt_example_tier_set_hold(struct kvt_tier *t, bool hold)
{
    ex(t)->hold = hold;
}

void kvt_example_tier_set_fail_rate(struct kvt_tier *t, double fail_rate)
{
    ex(t)->fail_rate = fail_rate;
}

unsigned kvt_example_tier_calls(struct kvt_tier *t, enum kvt_example_call call)
{
    return ex(t)->calls[call];
}

void kvt_example_tier_set_bp(struct kvt_tier *t, struct kvt_bp *bp)
{
    if (t->bp != NULL)
        kvt_bp_destroy(t->bp);
    t->bp = bp;
}

/* SPDX-License-Identifier: Apache-2.0 */
/* AsyncLookupManager: the asynchronous existence check that
 * slow secondary tiers (fs, obj) compose. The tier answers its lookups from a cache
 * of per-key states; keys never seen before are collected into this step's batch,
 * which flush() hands to one worker thread as a single queue item; the worker runs
 * the tier's batch_lookup once per request of that item and posts the item back
 * with the verdicts; the scheduler applies them at the next drain.
 *
 * State of one key:
 *
 *      lookup (new key)        flush              result drained
 *   ---------------> PENDING ---------> IN_FLIGHT ---------------> RESOLVED
 *                       |                   |                         ^
 *                       +---- mark_miss ----+-------------------------+
 *
 * - A state carries the generation it was created with. cleanup() may free a state
 *   and a later lookup() recreate it; results and batch entries stamped with an
 *   older generation are then ignored, so a stale probe never decides a new state.
 * - Verdicts are shared: every request that looks a key up while its state lives
 *   counts towards it (n_reqs) and gets the same answer, possibly an old one.
 * - Each generation is probed exactly once (enqueue-once); a second result for a
 *   decided state is a bug and asserts, since it could flip a miss set by
 *   mark_miss() after a failed load back to found and re-open the load livelock.
 * - cleanup() frees states no request counts any more, except IN_FLIGHT ones: those
 *   stay until their result arrives (drain frees them if still orphaned), so a new
 *   request can share the probe instead of issuing another.
 * - The reverse index (req_id -> set of keys) makes cleanup cost the request's own
 *   keys, not the cache size. A key is in a request's set iff the request counts
 *   towards the key's current state, so the set's value is that state.
 *
 * Two departures from vLLM, both where vLLM would trip an assertion on a
 * reachable path: mark_miss() on a PENDING state makes flush() skip it (no probe
 * needed any more), and mark_miss() on an IN_FLIGHT state makes the eventual result
 * be dropped (probe_out), so the miss sticks.
 *
 * Spans (kvt_async_lookup_create_spans): the worker takes every item queued (up to
 * KVT_AL_MAX_SPANS) and hands them to the tier in one call, one span per item, for
 * a tier whose lookup is a round trip (the network tier's LOCATE): run one by one,
 * items that queue behind a slow round trip would wait for one more each, and
 * their verdicts minutes of steps later under load. vLLM's worker runs one item,
 * one request at a time; its verdicts are the same, they only come later.
 *
 * Submit (kvt_async_lookup_create_submit): no worker. flush() hands the item to the
 * tier on the scheduler thread and keeps it on an in-flight list until the tier
 * completes it (kvt_async_lookup_complete, onto the results); for a tier whose loop
 * sends the request and takes the answer (the network tier's LOCATE), which then
 * needs no thread woken on the way out or back, and whose round trips overlap
 * instead of queueing behind each other.
 *
 * Threads: vLLM uses two queues and no lock because Python's queues lock for
 * it. Here one mutex guards both lists (requests: scheduler -> worker; results:
 * worker -> scheduler) and the counters; the worker waits on work_cv, wait_idle()
 * on idle_cv. The worker touches only the item it took (keys, contexts it does not
 * reference-count, found[]), so it never allocates and never sees scheduler state.
 * Shutdown is vLLM's sentinel: the worker finishes every item posted before it.
 */
#include <assert.h>
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "kvt/alloc.h"
#include "kvt/async_lookup.h"
#include "kvt/async_lookup_test.h"
#include "kvt/list.h"
#include "kvt/log.h"
#include "kvt/map.h"
#include "kvt/vec.h"

#define MOD "async_lookup"

/* LookupState: scheduler thread only. */
struct al_state {
    unsigned long gen;
    enum kvt_al_phase phase;
    int result;     /* KVT_AL_PENDING (None) until decided */
    size_t n_reqs;  /* requests whose reverse-index set holds this key */
    bool probe_out; /* resolved by mark_miss while its probe was in flight */
};

/* Reverse-index entry of one request: key -> struct al_state *. */
struct al_req {
    struct kvt_map keys;
};

/* One entry of this step's batch; holds a reference on ctx. */
struct al_pending {
    struct kvt_key key;
    struct kvt_req_ctx *ctx;
    unsigned long gen;
    /* flush scratch */
    struct al_state *st;
    size_t group;
    bool owns_group;
};

/* One request's run of keys inside an item; owns a reference on ctx. */
struct al_group {
    struct kvt_req_ctx *ctx;
    size_t first, n;
};

/* A queue item: one step's batch on its way to the worker and back with found[].
 * The scheduler fills it and frees it; between posting and draining only the
 * worker touches found[]. One allocation holds the item and its arrays. */
struct al_item {
    struct kvt_list node;
    size_t n, n_groups;
    struct al_group *groups;
    unsigned long *gens;
    struct kvt_key *keys;
    bool *found;
};

#define NO_GROUP SIZE_MAX

struct kvt_async_lookup {
    /* Immutable after create (both threads read). */
    char tier_type[32];
    kvt_batch_lookup_fn fn;
    kvt_batch_lookup_spans_fn spans_fn; /* instead of fn: every queued item at once */
    kvt_lookup_submit_fn submit_fn;     /* instead of both: no worker (Submit above) */
    void *arg;
    pthread_t thread;

    /* Scheduler thread only. */
    struct kvt_map states;    /* key -> struct al_state * */
    struct kvt_map reqs;      /* req_id -> struct al_req * */
    struct kvt_map group_ids; /* flush scratch: req_id -> group index + 1 */
    unsigned long next_gen;
    struct al_pending *batch;
    size_t n_batch, cap_batch;
    bool need_to_drain;
    bool joined;

    /* Under lock. */
    pthread_mutex_t lock;
    pthread_cond_t work_cv;
    pthread_cond_t idle_cv;
    struct kvt_list requests; /* struct al_item, FIFO */
    struct kvt_list results;  /* struct al_item, FIFO */
    struct kvt_list inflight; /* struct al_item submitted, not yet completed */
    size_t n_requests, n_results;
    unsigned long posted, done; /* items handed to / finished by the worker */
    bool stop;
    bool alive;
};

static struct al_item *item_alloc(size_t n, size_t max_groups)
{
    size_t off_groups = (sizeof(struct al_item) + 7) & ~(size_t)7;
    size_t off_gens = off_groups + max_groups * sizeof(struct al_group);
    size_t off_keys = off_gens + n * sizeof(unsigned long);
    size_t off_found = off_keys + n * sizeof(struct kvt_key);
    char *mem = kvt_calloc(1, off_found + n * sizeof(bool));
    struct al_item *it = (struct al_item *)mem;

    if (mem == NULL)
        return NULL;
    kvt_list_init(&it->node);
    it->n = n;
    it->groups = (struct al_group *)(mem + off_groups);
    it->gens = (unsigned long *)(mem + off_gens);
    it->keys = (struct kvt_key *)(mem + off_keys);
    it->found = (bool *)(mem + off_found);
    return it;
}

static void item_free(struct al_item *it)
{
    for (size_t g = 0; g < it->n_groups; g++)
        kvt_req_ctx_unref(it->groups[g].ctx);
    kvt_free(it);
}

static void free_state(struct kvt_async_lookup *al, const struct kvt_key *key)
{
    kvt_free(kvt_map_remove(&al->states, key->bytes, key->len));
}

/* ---------------------------------------------------------------- worker */

/* The tier's call for n keys failed (the caller marks them not found). */
static void warn_failed(const struct kvt_async_lookup *al, size_t n, int rc)
{
    char buf[64];

    kvt_warn(MOD, "batch_lookup failed on tier %s for %zu keys: %s", al->tier_type, n,
             strerror_r(-rc, buf, sizeof(buf)));
}

/* Under the lock: it is answered, onto the results (idle_cv is the caller's). */
static void item_answered_locked(struct kvt_async_lookup *al, struct al_item *it)
{
    kvt_list_add_tail(&al->results, &it->node);
    al->n_results++;
    al->done++;
}

static void run_item(struct kvt_async_lookup *al, struct al_item *it)
{
    for (size_t g = 0; g < it->n_groups; g++) {
        const struct al_group *grp = &it->groups[g];
        bool *found = it->found + grp->first;
        int rc = al->fn(al->arg, it->keys + grp->first, grp->n, grp->ctx, found);

        if (rc < 0) {
            warn_failed(al, grp->n, rc);
            memset(found, 0, grp->n * sizeof(*found));
        }
    }
}

/* Spans: items[0..n) in one call of the tier. */
static void run_items_spans(struct kvt_async_lookup *al, struct al_item **items, size_t n)
{
    struct kvt_al_span spans[KVT_AL_MAX_SPANS];
    size_t keys = 0;
    int rc;

    for (size_t i = 0; i < n; i++) {
        spans[i] = (struct kvt_al_span){items[i]->keys, items[i]->n, items[i]->found};
        keys += items[i]->n;
    }
    rc = al->spans_fn(al->arg, spans, n);
    if (rc < 0) {
        warn_failed(al, keys, rc);
        for (size_t i = 0; i < n; i++)
            memset(items[i]->found, 0, items[i]->n * sizeof(bool));
    }
}

/* Under the lock, the queue not empty: unlinks its first item (with spans: up to
 * KVT_AL_MAX_SPANS of them, in order) into items; returns how many. */
static size_t take_items(struct kvt_async_lookup *al, struct al_item **items)
{
    size_t max = al->spans_fn != NULL ? KVT_AL_MAX_SPANS : 1, n = 0;
    struct kvt_list *pos, *tmp;

    kvt_list_for_each_safe(pos, tmp, &al->requests)
    {
        if (n == max)
            break;
        kvt_list_del(pos);
        items[n++] = kvt_list_entry(pos, struct al_item, node);
    }
    al->n_requests -= n;
    return n;
}

static void *worker_main(void *p)
{
    struct kvt_async_lookup *al = p;

    pthread_mutex_lock(&al->lock);
    for (;;) {
        struct al_item *items[KVT_AL_MAX_SPANS];
        size_t n = 0;

        while (kvt_list_empty(&al->requests) && !al->stop)
            pthread_cond_wait(&al->work_cv, &al->lock);
        if (kvt_list_empty(&al->requests))
            break; /* the sentinel: stop, and everything before it is done */
        /* One item, or with spans every item queued (in order), at most the array. */
        n = take_items(al, items);
        pthread_mutex_unlock(&al->lock);

        if (al->spans_fn != NULL)
            run_items_spans(al, items, n);
        else
            run_item(al, items[0]);

        pthread_mutex_lock(&al->lock);
        for (size_t i = 0; i < n; i++)
            item_answered_locked(al, items[i]);
        pthread_cond_broadcast(&al->idle_cv);
    }
    al->alive = false;
    pthread_cond_broadcast(&al->idle_cv);
    pthread_mutex_unlock(&al->lock);
    return NULL;
}

/* ---------------------------------------------------------------- lifetime */

static int al_create(const char *tier_type, kvt_batch_lookup_fn fn,
                     kvt_batch_lookup_spans_fn spans_fn, kvt_lookup_submit_fn submit_fn, void *arg,
                     struct kvt_async_lookup **al_p)
{
    struct kvt_async_lookup *al;
    char name[16];
    int rc;

    if ((fn != NULL) + (spans_fn != NULL) + (submit_fn != NULL) != 1 || tier_type == NULL)
        return -EINVAL;
    al = kvt_calloc(1, sizeof(*al));
    if (al == NULL)
        return -ENOMEM;
    snprintf(al->tier_type, sizeof(al->tier_type), "%s", tier_type);
    al->fn = fn;
    al->spans_fn = spans_fn;
    al->submit_fn = submit_fn;
    al->arg = arg;
    kvt_map_init(&al->states);
    kvt_map_init(&al->reqs);
    kvt_map_init(&al->group_ids);
    kvt_list_init(&al->requests);
    kvt_list_init(&al->results);
    kvt_list_init(&al->inflight);
    pthread_mutex_init(&al->lock, NULL);
    pthread_cond_init(&al->work_cv, NULL);
    pthread_cond_init(&al->idle_cv, NULL);
    al->alive = true;
    /* The log level is read lazily on first use; do it here, before the worker
     * exists, so the worker's first warning does not race with the scheduler. */
    (void)kvt_log_get_level();
    if (submit_fn != NULL) {
        al->joined = true; /* no worker to join */
        *al_p = al;
        return 0;
    }

    rc = pthread_create(&al->thread, NULL, worker_main, al);
    if (rc != 0) {
        kvt_error(MOD, "cannot start the lookup thread of tier %s: %s", al->tier_type,
                  strerror(rc));
        goto err_sync;
    }
    if (snprintf(name, sizeof(name), "kvt_al_%s", al->tier_type) >= (int)sizeof(name))
        name[sizeof(name) - 1] = '\0';
    pthread_setname_np(al->thread, name);
    *al_p = al;
    return 0;

err_sync:
    pthread_cond_destroy(&al->idle_cv);
    pthread_cond_destroy(&al->work_cv);
    pthread_mutex_destroy(&al->lock);
    kvt_free(al);
    return -rc;
}

int kvt_async_lookup_create(const char *tier_type, kvt_batch_lookup_fn fn, void *arg,
                            struct kvt_async_lookup **al_p)
{
    return fn == NULL ? -EINVAL : al_create(tier_type, fn, NULL, NULL, arg, al_p);
}

int kvt_async_lookup_create_spans(const char *tier_type, kvt_batch_lookup_spans_fn fn, void *arg,
                                  struct kvt_async_lookup **al_p)
{
    return fn == NULL ? -EINVAL : al_create(tier_type, NULL, fn, NULL, arg, al_p);
}

int kvt_async_lookup_create_submit(const char *tier_type, kvt_lookup_submit_fn fn, void *arg,
                                   struct kvt_async_lookup **al_p)
{
    return fn == NULL ? -EINVAL : al_create(tier_type, NULL, NULL, fn, arg, al_p);
}

void kvt_async_lookup_shutdown(struct kvt_async_lookup *al)
{
    if (!al->joined) {
        pthread_mutex_lock(&al->lock);
        al->stop = true;
        pthread_cond_signal(&al->work_cv);
        pthread_mutex_unlock(&al->lock);
        pthread_join(al->thread, NULL);
        al->joined = true;
    }
    kvt_async_lookup_drain_results(al);
}

static void free_list(struct kvt_list *head)
{
    struct kvt_list *pos, *tmp;

    kvt_list_for_each_safe(pos, tmp, head)
    {
        kvt_list_del(pos);
        item_free(kvt_list_entry(pos, struct al_item, node));
    }
}

void kvt_async_lookup_destroy(struct kvt_async_lookup *al)
{
    struct kvt_map_entry *e;
    size_t i;

    if (al == NULL)
        return;
    kvt_async_lookup_shutdown(al);
    /* Items flushed after shutdown never reached a worker. */
    free_list(&al->requests);
    free_list(&al->results);
    free_list(&al->inflight); /* never completed: the tier let go of them */
    for (i = 0; i < al->n_batch; i++)
        kvt_req_ctx_unref(al->batch[i].ctx);
    kvt_free(al->batch);
    for (i = 0; kvt_map_next(&al->reqs, &i, &e);) {
        struct al_req *req = e->value;
        kvt_map_cleanup(&req->keys);
        kvt_free(req);
    }
    for (i = 0; kvt_map_next(&al->states, &i, &e);)
        kvt_free(e->value);
    kvt_map_cleanup(&al->reqs);
    kvt_map_cleanup(&al->states);
    kvt_map_cleanup(&al->group_ids);
    pthread_cond_destroy(&al->idle_cv);
    pthread_cond_destroy(&al->work_cv);
    pthread_mutex_destroy(&al->lock);
    kvt_free(al);
}

/* ---------------------------------------------------------------- scheduler */

static void apply_item(struct kvt_async_lookup *al, const struct al_item *it)
{
    for (size_t i = 0; i < it->n; i++) {
        const struct kvt_key *key = &it->keys[i];
        struct al_state *st = kvt_map_get(&al->states, key->bytes, key->len);

        if (st == NULL || st->gen != it->gens[i])
            continue; /* stale: cleaned up (and maybe recreated) meanwhile */
        if (st->n_reqs == 0) {
            free_state(al, key); /* in-flight orphan, kept only for this result */
            continue;
        }
        if (st->phase == KVT_AL_PHASE_RESOLVED && st->probe_out) {
            st->probe_out = false; /* mark_miss decided it first; the miss sticks */
            continue;
        }
        assert(st->phase == KVT_AL_PHASE_IN_FLIGHT && "lookup result for a state not in flight");
        assert(st->result == KVT_AL_PENDING &&
               "cached key received a second lookup result; the enqueue-once invariant is "
               "broken and could reopen the failed-load livelock");
        st->result = it->found[i] ? KVT_AL_FOUND : KVT_AL_ABSENT;
        st->phase = KVT_AL_PHASE_RESOLVED;
    }
}

void kvt_async_lookup_drain_results(struct kvt_async_lookup *al)
{
    struct kvt_list local, *pos, *tmp;

    pthread_mutex_lock(&al->lock);
    kvt_list_move_all(&al->results, &local);
    al->n_results = 0;
    pthread_mutex_unlock(&al->lock);

    kvt_list_for_each_safe(pos, tmp, &local)
    {
        struct al_item *it = kvt_list_entry(pos, struct al_item, node);

        kvt_list_del(pos);
        apply_item(al, it);
        item_free(it);
    }
}

static void req_free(struct al_req *req)
{
    kvt_map_cleanup(&req->keys);
    kvt_free(req);
}

int kvt_async_lookup_lookup(struct kvt_async_lookup *al, const struct kvt_key *key,
                            struct kvt_req_ctx *ctx)
{
    struct al_state *st;
    struct al_req *req;
    bool new_req = false, new_state = false;

    if (al->need_to_drain) {
        kvt_async_lookup_drain_results(al);
        al->need_to_drain = false;
    }

    req = kvt_map_get(&al->reqs, ctx->req_id, ctx->req_id_len);
    if (req == NULL) {
        req = kvt_calloc(1, sizeof(*req));
        if (req == NULL)
            return -ENOMEM;
        kvt_map_init(&req->keys);
        if (kvt_map_put(&al->reqs, ctx->req_id, ctx->req_id_len, req) < 0) {
            kvt_free(req);
            return -ENOMEM;
        }
        new_req = true;
    }

    st = kvt_map_get(&al->states, key->bytes, key->len);
    if (st == NULL) {
        if (kvt_vec_reserve(al->batch, al->cap_batch, al->n_batch + 1, 16) < 0)
            goto err_req;
        st = kvt_calloc(1, sizeof(*st));
        if (st == NULL)
            goto err_req;
        st->gen = al->next_gen;
        st->phase = KVT_AL_PHASE_PENDING;
        st->result = KVT_AL_PENDING;
        if (kvt_map_put(&al->states, key->bytes, key->len, st) < 0) {
            kvt_free(st);
            goto err_req;
        }
        new_state = true;
    }

    if (kvt_map_get(&req->keys, key->bytes, key->len) == NULL) {
        if (kvt_map_put(&req->keys, key->bytes, key->len, st) < 0)
            goto err_state;
        st->n_reqs++;
    }

    if (new_state) {
        struct al_pending *e = &al->batch[al->n_batch++];

        al->next_gen++;
        e->key = *key;
        e->ctx = kvt_req_ctx_ref(ctx);
        e->gen = st->gen;
    }
    return st->result;

err_state:
    if (new_state)
        free_state(al, key);
err_req:
    if (new_req) {
        kvt_map_remove(&al->reqs, ctx->req_id, ctx->req_id_len);
        req_free(req);
    }
    return -ENOMEM;
}

void kvt_async_lookup_complete(struct kvt_async_lookup *al, void *token)
{
    struct al_item *it = token;

    pthread_mutex_lock(&al->lock);
    kvt_list_del(&it->node); /* off inflight */
    item_answered_locked(al, it);
    pthread_cond_broadcast(&al->idle_cv);
    pthread_mutex_unlock(&al->lock);
}

/* Submit: the tier has the item until it completes it. */
static void submit_item(struct kvt_async_lookup *al, struct al_item *it)
{
    int rc;

    pthread_mutex_lock(&al->lock);
    kvt_list_add_tail(&al->inflight, &it->node);
    al->posted++;
    pthread_mutex_unlock(&al->lock);
    rc = al->submit_fn(al->arg, it->keys, it->n, it->found, it);
    if (rc < 0) {
        warn_failed(al, it->n, rc);
        memset(it->found, 0, it->n * sizeof(bool));
        kvt_async_lookup_complete(al, it);
    }
}

static void post_item(struct kvt_async_lookup *al, struct al_item *it)
{
    if (al->submit_fn != NULL) {
        submit_item(al, it);
        return;
    }
    pthread_mutex_lock(&al->lock);
    kvt_list_add_tail(&al->requests, &it->node);
    al->n_requests++;
    al->posted++;
    pthread_cond_signal(&al->work_cv);
    pthread_mutex_unlock(&al->lock);
}

/* Pass 1 of flush (may fail, changes nothing but scratch): which entries are still
 * wanted, and the group of each, numbered in first-seen order of req_id. */
static int flush_group(struct kvt_async_lookup *al, struct al_item *it, size_t *n_keep_p)
{
    size_t n_keep = 0;

    kvt_map_clear(&al->group_ids);
    for (size_t i = 0; i < al->n_batch; i++) {
        struct al_pending *e = &al->batch[i];
        struct al_state *st = kvt_map_get(&al->states, e->key.bytes, e->key.len);
        void *g;

        e->group = NO_GROUP;
        e->owns_group = false;
        /* Gone or recreated since (cleanup), or decided by mark_miss: no probe. */
        if (st == NULL || st->gen != e->gen || st->phase != KVT_AL_PHASE_PENDING)
            continue;
        e->st = st;
        g = kvt_map_get(&al->group_ids, e->ctx->req_id, e->ctx->req_id_len);
        if (g == NULL) {
            g = (void *)(uintptr_t)(it->n_groups + 1);
            if (kvt_map_put(&al->group_ids, e->ctx->req_id, e->ctx->req_id_len, g) < 0)
                return -ENOMEM;
            it->groups[it->n_groups++].ctx = e->ctx;
            e->owns_group = true;
        }
        e->group = (uintptr_t)g - 1;
        it->groups[e->group].n++;
        n_keep++;
    }
    *n_keep_p = n_keep;
    return 0;
}

int kvt_async_lookup_flush(struct kvt_async_lookup *al)
{
    struct al_item *it;
    size_t n_keep, first = 0;

    kvt_async_lookup_drain_results(al);
    al->need_to_drain = true;
    if (al->n_batch == 0)
        return 0;

    it = item_alloc(al->n_batch, al->n_batch);
    if (it == NULL || flush_group(al, it, &n_keep) < 0) {
        kvt_warn(MOD, "tier %s: no memory to post %zu lookups, retrying next step", al->tier_type,
                 al->n_batch);
        kvt_free(it); /* holds no references yet */
        return -ENOMEM;
    }

    /* Pass 2 (cannot fail): lay the keys out per group, move the references. */
    for (size_t g = 0; g < it->n_groups; g++) {
        it->groups[g].first = first;
        first += it->groups[g].n;
        it->groups[g].n = 0;
    }
    for (size_t i = 0; i < al->n_batch; i++) {
        struct al_pending *e = &al->batch[i];
        struct al_group *grp;
        size_t slot;

        if (e->group == NO_GROUP) {
            kvt_req_ctx_unref(e->ctx);
            continue;
        }
        grp = &it->groups[e->group];
        slot = grp->first + grp->n++;
        assert(e->st->phase == KVT_AL_PHASE_PENDING && "key enqueued twice");
        e->st->phase = KVT_AL_PHASE_IN_FLIGHT;
        it->keys[slot] = e->key;
        it->gens[slot] = e->gen;
        if (!e->owns_group)
            kvt_req_ctx_unref(e->ctx); /* the group holds the first one's */
    }
    it->n = n_keep;
    al->n_batch = 0;

    if (n_keep == 0) {
        item_free(it);
        return 0;
    }
    post_item(al, it);
    return 0;
}

void kvt_async_lookup_mark_miss(struct kvt_async_lookup *al, const struct kvt_key *keys, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        struct al_state *st = kvt_map_get(&al->states, keys[i].bytes, keys[i].len);

        if (st == NULL)
            continue;
        if (st->phase == KVT_AL_PHASE_IN_FLIGHT)
            st->probe_out = true;
        st->result = KVT_AL_ABSENT;
        st->phase = KVT_AL_PHASE_RESOLVED;
    }
}

void kvt_async_lookup_cleanup(struct kvt_async_lookup *al, const char *req_id)
{
    struct al_req *req = kvt_map_remove(&al->reqs, req_id, strlen(req_id));
    struct kvt_map_entry *e;

    if (req == NULL)
        return;
    for (size_t i = 0; kvt_map_next(&req->keys, &i, &e);) {
        struct al_state *st = e->value;

        assert(st == kvt_map_get(&al->states, e->key, e->key_len) && "reverse index out of sync");
        assert(st->n_reqs > 0);
        st->n_reqs--;
        if (st->n_reqs == 0 && st->phase != KVT_AL_PHASE_IN_FLIGHT)
            kvt_free(kvt_map_remove(&al->states, e->key, e->key_len));
    }
    req_free(req);
}

/* ---------------------------------------------------------------- introspection */

size_t kvt_async_lookup_batch_len(const struct kvt_async_lookup *al)
{
    return al->n_batch;
}

size_t kvt_async_lookup_num_states(const struct kvt_async_lookup *al)
{
    return kvt_map_size(&al->states);
}

size_t kvt_async_lookup_num_reqs(const struct kvt_async_lookup *al)
{
    return kvt_map_size(&al->reqs);
}

bool kvt_async_lookup_req_has_key(const struct kvt_async_lookup *al, const char *req_id,
                                  const struct kvt_key *key)
{
    const struct al_req *req = kvt_map_get(&al->reqs, req_id, strlen(req_id));

    return req != NULL && kvt_map_get(&req->keys, key->bytes, key->len) != NULL;
}

static size_t read_locked(struct kvt_async_lookup *al, const size_t *field)
{
    size_t n;

    pthread_mutex_lock(&al->lock);
    n = *field;
    pthread_mutex_unlock(&al->lock);
    return n;
}

size_t kvt_async_lookup_queue_len(struct kvt_async_lookup *al)
{
    return read_locked(al, &al->n_requests);
}

size_t kvt_async_lookup_results_len(struct kvt_async_lookup *al)
{
    return read_locked(al, &al->n_results);
}

void kvt_async_lookup_wait_idle(struct kvt_async_lookup *al)
{
    pthread_mutex_lock(&al->lock);
    while (al->done != al->posted && al->alive)
        pthread_cond_wait(&al->idle_cv, &al->lock);
    pthread_mutex_unlock(&al->lock);
}

bool kvt_async_lookup_worker_alive(struct kvt_async_lookup *al)
{
    bool alive;

    pthread_mutex_lock(&al->lock);
    alive = al->alive;
    pthread_mutex_unlock(&al->lock);
    return alive;
}

int kvt_async_lookup_state(const struct kvt_async_lookup *al, const struct kvt_key *key,
                           enum kvt_al_phase *phase_p, int *result_p, unsigned long *gen_p)
{
    const struct al_state *st = kvt_map_get(&al->states, key->bytes, key->len);

    if (st == NULL)
        return -ENOENT;
    if (phase_p != NULL)
        *phase_p = st->phase;
    if (result_p != NULL)
        *result_p = st->result;
    if (gen_p != NULL)
        *gen_p = st->gen;
    return 0;
}

int kvt__async_lookup_inject_result(struct kvt_async_lookup *al, const struct kvt_key *key,
                                    unsigned long generation, bool found)
{
    struct al_item *it = item_alloc(1, 0);

    if (it == NULL)
        return -ENOMEM;
    it->keys[0] = *key;
    it->gens[0] = generation;
    it->found[0] = found;
    pthread_mutex_lock(&al->lock);
    kvt_list_add_tail(&al->results, &it->node);
    al->n_results++;
    pthread_mutex_unlock(&al->lock);
    return 0;
}

/* SPDX-License-Identifier: Apache-2.0 */
/* The storage tier's front end (scheduler thread): the in-memory index of the chunk
 * files, their recency and the capacity bound, job admission and completion, events
 * and stats. The back end (file format, I/O threads, restart scan) is storage_io.c.
 *
 * Why an index in memory: vLLM's fs tier asks the disk whether a file exists, through
 * the async lookup helper, and answers RETRY for a step. Here the index knows, so
 * lookup answers HIT or MISS synchronously and no async lookup helper is needed. A key
 * counts as present only once its file is published: a store that is queued or running
 * answers MISS, so the tier never promises what a crash could lose.
 *
 * Index entry states (see st_entry):
 *   (absent) --submit_store, room reserved--> WRITING --written--> PUBLISHED
 *   WRITING --write failed--> (absent)
 *   PUBLISHED --evicted (LRU, unpinned)--> DOOMED --file removed--> (absent)
 *   PUBLISHED --a load failed--> DOOMED --last reader done--> (absent)
 * A failed load (missing file, I/O error, bad header or checksum) deletes the file
 * (the I/O thread does it) and drops the key from the index on the scheduler thread,
 * in get_finished_jobs: that is this tier's mark_miss, so the manager's next lookup
 * misses instead of promoting the same doomed chunk forever (#49176). Loads report
 * per-key success (successful_keys).
 *
 * Capacity: every file is charged header block + row rounded to 4096. A store reserves
 * its bytes when it is admitted; when that does not fit, least recently used unpinned
 * files are evicted (the store's tasks wait until those files are removed, so a full
 * disk under the bound does not fail it); pinned files - those
 * a running load reads - are never evicted. Keys that still do not fit are dropped and
 * the job fails. Lookups that HIT, touch() and successful loads refresh recency.
 *
 * Warm restart (create): the index is rebuilt from the headers by a few threads;
 * leftover temporary files and files with bad headers (a header MAC that does not
 * verify, the old unkeyed format) are deleted and counted; another user's files are
 * left alone and counted; recency starts in file modification order. Row MACs are
 * verified on every load, not at start.
 *
 * Other users (create): the root is opened with kvt_private_dir_open (created 0700,
 * refused when another user owns it, group or others may write it, or it is a link),
 * the namespace folder and its 256 shards are created 0700 (ones of ours left from an
 * older version are chmodded 0700), the LOCK file is 0600 and must be ours. The MAC
 * keys derive from cfg.key or from <root>/storage.key (storage_mac.c).
 *
 * Generations (STATE, the file format in storage_io.c): a job takes the folder's
 * generation when it is made; stores write it into their files, loads accept only it.
 * A reset or a change of the model fingerprint writes a new generation to STATE first
 * (a crash after that leaves only stale files, removed at the next start) and then
 * dooms every indexed file and queues its removal. A job made before the change ends
 * failed (a load's bytes are not trusted, a store's file is removed): nothing of the
 * old generation becomes a HIT afterwards. STATE is written to a temporary file,
 * fsynced and renamed into place, and the folder fsynced.
 *
 * The model fingerprint (kvt/storage_tier.h) decides whether the files are kept: they
 * are the chunks of the model STATE records. Until the node knows its own (none
 * configured, no engine declared one yet) a folder with a recorded fingerprint is
 * withheld: lookups MISS, so a node restarted for another model serves nothing of the
 * old one, to its engines or its peers, before it knows which model it serves.
 *
 * Errors: ENOSPC, EIO, a read-only or vanished root fail the affected chunks (the job
 * fails, kvtier_storage_tier_errors rises) and the tier keeps serving what it can. A
 * root that cannot be created or written at start is a configuration error.
 *
 * Out of memory (the policy in kvt/tier.h): a submit is refused with -ENOMEM before
 * anything happens. An accepted job carries all it will need - its items, its tasks
 * and, for a load, room for its report's keys - so queueing, completing and
 * reporting it never allocate; a key that cannot get an index entry, or whose
 * eviction cannot be queued (a doomed file always has its removal queued), is
 * dropped and the job fails. */
#include <assert.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include "kvt/alloc.h"
#include "kvt/backpressure.h"
#include "kvt/clock.h"
#include "kvt/common.h"
#include "kvt/log.h"
#include "kvt/safe_path.h"
#include "kvt/storage_tier.h"
#include "kvt/storage_tier_test.h"
#include "kvt/vec.h"
#include "storage_int.h"

#define MOD "storage"

static const struct kvt_tier_ops storage_ops;

static struct st_tier *st(struct kvt_tier *t)
{
    assert(t->ops == &storage_ops);
    return KVT_CONTAINER_OF(t, struct st_tier, base);
}

static struct st_entry *find(struct st_tier *s, const struct kvt_key *key)
{
    return kvt_map_get(&s->index, key->bytes, key->len);
}

static void drop_entry(struct st_tier *s, struct st_entry *e)
{
    void *v = kvt_map_remove(&s->index, e->key.bytes, e->key.len);
    assert(v == e);
    (void)v;
    kvt_free(e);
}

static void maybe_free(struct st_tier *s, struct st_entry *e)
{
    if (e->state == ST_DOOMED && e->pins == 0 && !e->unlink_pending) {
        s->n_doomed--;
        drop_entry(s, e);
    }
}

static void lru_touch(struct st_tier *s, struct st_entry *e)
{
    if (e->state != ST_PUBLISHED)
        return;
    kvt_list_del(&e->lru);
    kvt_list_add_tail(&s->lru, &e->lru);
}

static void free_job(struct st_job *sj)
{
    kvt_free(sj->items);
    kvt_free(sj->tasks);
    kvt_free(sj->result_keys);
    kvt_free(sj);
}

/* A job with room for cap items, its tasks and (loads) its report's keys: all it
 * will need, so that once it is accepted nothing of it can fail for want of memory.
 * NULL when memory is short. */
static struct st_job *new_job(struct st_tier *s, const struct kvt_job *job, enum st_kind kind,
                              size_t cap)
{
    struct st_job *sj = kvt_calloc(1, sizeof(*sj));
    unsigned k = kvt__st_max_tasks(s, kind, cap);
    if (sj == NULL)
        return NULL;
    sj->job = job;
    sj->kind = kind;
    memcpy(sj->gen, s->gen, sizeof(sj->gen));
    if (cap > 0) {
        sj->items = kvt_reallocarray(NULL, cap, sizeof(*sj->items));
        sj->cap_items = cap;
    }
    if (k > 0)
        sj->tasks = kvt_calloc(k, sizeof(*sj->tasks));
    sj->cap_tasks = k;
    if (kind == ST_LOAD && cap > 0)
        sj->result_keys = kvt_reallocarray(NULL, cap, sizeof(*sj->result_keys));
    if ((cap > 0 && sj->items == NULL) || (k > 0 && sj->tasks == NULL) ||
        (kind == ST_LOAD && cap > 0 && sj->result_keys == NULL)) {
        free_job(sj);
        return NULL;
    }
    return sj;
}

/* Room in this call's removal job for one more file; -ENOMEM (nothing may be
 * evicted then: a doomed entry must have its removal queued). */
static int unlink_room(struct st_tier *s)
{
    struct st_job *sj = s->pending_unlinks;
    if (sj == NULL) {
        sj = new_job(s, NULL, ST_UNLINK, 16);
        if (sj == NULL)
            return -ENOMEM;
        s->pending_unlinks = sj;
    }
    return kvt_vec_reserve(sj->items, sj->cap_items, sj->n_items + 1, 16);
}

/* Queues the removal of e's file with the other removals of this call (room made by
 * unlink_room). */
static void add_unlink(struct st_tier *s, struct st_entry *e)
{
    struct st_job *sj = s->pending_unlinks;
    assert(sj != NULL && sj->n_items < sj->cap_items);
    sj->items[sj->n_items++] = (struct st_item){.key = e->key, .chunk = -1, .e = e};
    e->unlink_pending = true;
}

/* Takes the removals of this call (their removed event is pushed now), or NULL. */
static struct st_job *take_unlinks(struct st_tier *s)
{
    struct st_job *sj = s->pending_unlinks;
    if (sj == NULL)
        return NULL;
    s->pending_unlinks = NULL;
    if (s->enable_events) {
        struct kvt_key *keys = kvt_reallocarray(NULL, sj->n_items, sizeof(*keys));
        if (keys != NULL) {
            for (size_t i = 0; i < sj->n_items; i++)
                keys[i] = sj->items[i].key;
            if (kvt_events_push(&s->events, keys, sj->n_items, KVT_MEDIUM_STORAGE, s->base.locality,
                                true) != 0)
                kvt_warn(MOD, "out of memory: removed event lost");
            kvt_free(keys);
        }
    }
    return sj;
}

static void flush_unlinks(struct st_tier *s)
{
    struct st_job *sj = take_unlinks(s);
    if (sj != NULL)
        kvt__st_pool_submit(s, sj);
}

/* PUBLISHED -> DOOMED; the bytes are free for new stores at once. */
static void doom(struct st_tier *s, struct st_entry *e)
{
    assert(e->state == ST_PUBLISHED);
    kvt_list_del(&e->lru);
    e->state = ST_DOOMED;
    s->n_published--;
    s->n_doomed++;
    assert(s->used >= e->bytes);
    s->used -= e->bytes;
}

/* -ENOMEM (nothing done) when there is no room to queue the file's removal. */
static int evict(struct st_tier *s, struct st_entry *e)
{
    assert(e->pins == 0);
    if (unlink_room(s) != 0)
        return -ENOMEM;
    doom(s, e);
    add_unlink(s, e);
    s->c.evictions++;
    return 0;
}

/* Reserves need bytes, evicting least recently used unpinned files: 0, -ENOSPC when
 * it cannot fit, -ENOMEM when an eviction cannot be queued (nothing evicted beyond
 * what is already gone, in both cases). */
static int reserve(struct st_tier *s, uint64_t need)
{
    if (s->capacity == 0) {
        s->used += need;
        return 0;
    }
    if (need > s->capacity)
        return -ENOSPC;
    while (s->used + need > s->capacity) {
        struct kvt_list *pos, *tmp;
        struct st_entry *victim = NULL;
        kvt_list_for_each_safe(pos, tmp, &s->lru)
        {
            struct st_entry *e = kvt_list_entry(pos, struct st_entry, lru);
            if (e->pins == 0) {
                victim = e;
                break;
            }
        }
        if (victim == NULL)
            return -ENOSPC;
        if (evict(s, victim) != 0)
            return -ENOMEM;
    }
    s->used += need;
    return 0;
}

static bool use_direct(struct st_tier *s)
{
    return s->direct_ok && s->base.row_bytes % ST_BLOCK == 0 &&
           (uintptr_t)s->base.primary_base % ST_BLOCK == 0;
}

static bool slot_ok(struct st_tier *s, int64_t chunk)
{
    return s->base.primary_base != NULL && s->base.row_bytes > 0 && chunk >= 0 &&
           (uint64_t)chunk < s->base.num_chunks;
}

/* ---- ops ---------------------------------------------------------------------- */

static enum kvt_lookup_result st_lookup(struct kvt_tier *t, const struct kvt_key *key,
                                        struct kvt_req_ctx *ctx)
{
    struct st_tier *s = st(t);
    struct st_entry *e = find(s, key);
    (void)ctx;
    if (e == NULL || e->state != ST_PUBLISHED || s->withheld)
        return KVT_MISS;
    if (e->miss_until_ns != 0) { /* a transient load error: MISS for a while */
        if (kvt_now_ns() < e->miss_until_ns)
            return KVT_MISS;
        e->miss_until_ns = 0;
    }
    lru_touch(s, e); /* a promotion follows: keep it from being evicted first */
    return KVT_HIT;
}

static void st_touch(struct kvt_tier *t, const struct kvt_key *keys, size_t n,
                     struct kvt_req_ctx *ctx)
{
    struct st_tier *s = st(t);
    (void)ctx;
    for (size_t i = 0; i < n; i++) {
        struct st_entry *e = find(s, &keys[i]);
        if (e != NULL)
            lru_touch(s, e);
    }
}

/* Refused (-ENOMEM) only before anything happened. Once accepted, a key that cannot
 * be admitted - present already, a bad slot, no room, no memory for its entry or
 * for an eviction - is left out and the job fails. */
static int st_submit_store(struct kvt_tier *t, const struct kvt_job *job)
{
    struct st_tier *s = st(t);
    struct st_job *sj = new_job(s, job, ST_STORE, job->n);
    uint64_t fbytes = kvt__st_file_bytes(t->row_bytes);
    if (sj == NULL)
        return -ENOMEM;
    s->n_unreported++;
    for (size_t i = 0; i < job->n; i++) {
        const struct kvt_key *key = &job->keys[i];
        struct st_entry *e;
        int rc;
        if (find(s, key) != NULL) { /* present, being written, or being removed */
            sj->n_skipped++;
            s->c.skipped++;
            continue;
        }
        if (!slot_ok(s, job->chunk_ids[i])) {
            kvt_error(MOD, "store job %llu: chunk id %lld outside the primary",
                      (unsigned long long)job->id, (long long)job->chunk_ids[i]);
            sj->n_dropped++;
            s->c.errors++;
            continue;
        }
        rc = reserve(s, fbytes);
        if (rc == -ENOSPC) {
            sj->n_dropped++;
            s->c.capacity_drops++;
            continue;
        }
        e = rc == 0 ? kvt_calloc(1, sizeof(*e)) : NULL;
        if (e == NULL || kvt_map_put(&s->index, key->bytes, key->len, e) != 0) {
            if (rc == 0)
                s->used -= fbytes;
            kvt_free(e);
            kvt_warn(MOD, "store job %llu: out of memory, a chunk is not stored",
                     (unsigned long long)job->id);
            sj->n_dropped++;
            s->c.errors++;
            continue;
        }
        e->key = *key;
        e->bytes = fbytes;
        e->state = ST_WRITING;
        kvt_list_init(&e->lru);
        s->n_writing++;
        sj->items[sj->n_items++] =
            (struct st_item){.key = *key, .chunk = job->chunk_ids[i], .e = e};
    }
    sj->direct = use_direct(s);
    /* The evicted files go first: the store may need their room on disk. */
    kvt__st_pool_submit_after(s, take_unlinks(s), sj);
    return 0;
}

/* Refused (-ENOMEM) only before anything is pinned. */
static int st_submit_load(struct kvt_tier *t, const struct kvt_job *job)
{
    struct st_tier *s = st(t);
    struct st_job *sj = new_job(s, job, ST_LOAD, job->n);
    if (sj == NULL)
        return -ENOMEM;
    s->n_unreported++;
    for (size_t i = 0; i < job->n; i++) {
        struct st_entry *e = find(s, &job->keys[i]);
        if (e == NULL || e->state != ST_PUBLISHED || s->withheld || !slot_ok(s, job->chunk_ids[i]))
            continue; /* fails: not in successful_keys */
        e->pins++;
        sj->items[sj->n_items++] =
            (struct st_item){.key = job->keys[i], .chunk = job->chunk_ids[i], .e = e};
    }
    sj->direct = use_direct(s);
    kvt__st_pool_submit(s, sj);
    return 0;
}

static void count_error(struct st_tier *s, int err)
{
    if (err == ECANCELED)
        return;
    if (err == ST_ERR_STALE) { /* a reset's leftover, not a failure of the disk or file */
        s->c.stale++;
        return;
    }
    s->c.errors++;
    if (err == ENOSPC || err == EDQUOT)
        s->c.enospc++;
    else if (err == EIO)
        s->c.eio++;
    else if (err == ST_ERR_CORRUPT || err == ST_ERR_MAC || err == ST_ERR_OLD)
        s->c.checksum_fail++;
    if (err == ST_ERR_MAC)
        s->c.mac_fail++;
    else if (err == ST_ERR_OLD)
        s->c.old_format++;
    else if (err == ST_ERR_FOREIGN)
        s->c.foreign++;
}

static const char *err_name(int err)
{
    switch (err) {
    case ST_ERR_CORRUPT:
        return "bad header, size or key";
    case ST_ERR_MAC:
        return "MAC did not verify (the file was changed, or written under another key)";
    case ST_ERR_OLD:
        return "a file of the old unkeyed format";
    case ST_ERR_FOREIGN:
        return "not this tier's own file (another user's, a link, or open to group/others)";
    case ST_ERR_STALE:
        return "a file of an earlier generation (a reset or a model change)";
    default:
        return strerror(err);
    }
}

static void finish_unlinks(struct st_tier *s, struct st_job *sj)
{
    for (size_t i = 0; i < sj->n_items; i++) {
        struct st_item *it = &sj->items[i];
        if (it->err != 0 && it->err != ECANCELED) {
            kvt_warn(MOD, "cannot remove an evicted chunk file: %s", strerror(it->err));
            count_error(s, it->err);
        }
        it->e->unlink_pending = false;
        maybe_free(s, it->e);
    }
}

static double job_time(const struct st_job *sj)
{
    return sj->start_ns != 0 && sj->end_ns >= sj->start_ns
               ? (double)(sj->end_ns - sj->start_ns) * 1e-9
               : 0.0;
}

static void finish_store(struct st_tier *s, struct st_job *sj, kvt_job_result_cb_t cb, void *arg)
{
    const struct kvt_job *job = sj->job;
    size_t n_ok = 0, n_fail = 0;
    int first_err = 0;
    struct kvt_job_result r;
    bool stale = memcmp(sj->gen, s->gen, sizeof(sj->gen)) != 0;
    for (size_t i = 0; i < sj->n_items; i++) {
        struct st_item *it = &sj->items[i];
        struct st_entry *e = it->e;
        assert(e->state == ST_WRITING);
        s->n_writing--;
        if (it->err == 0 && stale) {
            /* Written under the generation a reset or model change ended: its file
             * goes (queued with this call's removals), the key is not stored. */
            e->state = ST_PUBLISHED;
            kvt_list_add_tail(&s->lru, &e->lru);
            s->n_published++;
            if (unlink_room(s) == 0) {
                doom(s, e);
                add_unlink(s, e);
            } else {
                doom(s, e); /* the file is stale: the next start removes it */
                s->n_doomed--;
                drop_entry(s, e);
            }
            it->err = ST_ERR_STALE;
        }
        if (it->err == 0) {
            e->state = ST_PUBLISHED;
            kvt_list_add_tail(&s->lru, &e->lru);
            s->n_published++;
            s->c.stored++;
            n_ok++;
            continue;
        }
        count_error(s, it->err);
        if (first_err == 0)
            first_err = it->err;
        n_fail++;
        if (it->err == ST_ERR_STALE)
            continue; /* doomed above: its bytes went with it */
        assert(s->used >= e->bytes);
        s->used -= e->bytes;
        drop_entry(s, e);
    }
    if (first_err != 0 && first_err != ECANCELED)
        kvt_warn(MOD, "store job %llu: %zu of %zu chunk(s) not written: %s",
                 (unsigned long long)job->id, n_fail, sj->n_items, err_name(first_err));
    r = (struct kvt_job_result){.job_id = job->id,
                                .success = n_fail == 0 && sj->n_dropped == 0,
                                .transfer_time = job_time(sj),
                                .transfer_bytes = (int64_t)(n_ok * s->base.row_bytes)};
    if (r.success && s->enable_events && job->n > 0) {
        /* Stored event: the job's keys that are on disk now (skipped keys included
         * when they are published; not those still being written or removed). */
        struct kvt_key *keys = kvt_reallocarray(NULL, job->n, sizeof(*keys));
        size_t n = 0;
        for (size_t i = 0; keys != NULL && i < job->n; i++) {
            struct st_entry *e = find(s, &job->keys[i]);
            if (e != NULL && e->state == ST_PUBLISHED)
                keys[n++] = job->keys[i];
        }
        if (keys == NULL || (n > 0 && kvt_events_push(&s->events, keys, n, KVT_MEDIUM_STORAGE,
                                                      s->base.locality, false) != 0))
            kvt_warn(MOD, "out of memory: stored event lost");
        kvt_free(keys);
    }
    s->n_unreported--;
    cb(arg, &r);
}

static void finish_load(struct st_tier *s, struct st_job *sj, kvt_job_result_cb_t cb, void *arg)
{
    const struct kvt_job *job = sj->job;
    /* Successful keys from the front, bad files' keys from the back (n_items keys in
     * all, at most job->n): room made at submit. */
    struct kvt_key *ok = sj->result_keys, *gone;
    size_t n_ok = 0, n_gone = 0;
    int first_err = 0;
    bool stale = memcmp(sj->gen, s->gen, sizeof(sj->gen)) != 0;
    struct kvt_job_result r;
    for (size_t i = 0; i < sj->n_items; i++) {
        struct st_item *it = &sj->items[i];
        struct st_entry *e = it->e;
        assert(e->pins > 0);
        e->pins--;
        if (it->err == 0 && stale)
            it->err = ECANCELED; /* read before a reset dropped it (counted there): not served */
        if (it->err == 0) {
            ok[n_ok++] = it->key;
            s->c.loaded++;
            lru_touch(s, e);
        } else if (it->err != ECANCELED) {
            /* The file is gone (the I/O thread deleted it): drop the key. After a
             * transient error the file is still there: the key stays, but MISSes
             * for a while (the livelock rule). */
            count_error(s, it->err);
            if (first_err == 0)
                first_err = it->err;
            if (e->state == ST_PUBLISHED && kvt__st_err_transient(it->err)) {
                e->miss_until_ns = kvt_now_ns() + ST_TRANSIENT_MISS_NS;
            } else if (e->state == ST_PUBLISHED) {
                doom(s, e);
                ok[sj->n_items - ++n_gone] = e->key;
            }
        }
        maybe_free(s, e);
    }
    if (first_err != 0)
        kvt_warn(MOD, "load job %llu: %zu of %zu chunk(s) failed: %s", (unsigned long long)job->id,
                 job->n - n_ok, job->n, err_name(first_err));
    gone = n_gone > 0 ? &ok[sj->n_items - n_gone] : NULL;
    for (size_t i = 0; i < n_gone / 2; i++) { /* back in item order */
        struct kvt_key k = gone[i];
        gone[i] = gone[n_gone - 1 - i];
        gone[n_gone - 1 - i] = k;
    }
    if (n_gone > 0 && s->enable_events &&
        kvt_events_push(&s->events, gone, n_gone, KVT_MEDIUM_STORAGE, s->base.locality, true) != 0)
        kvt_warn(MOD, "out of memory: removed event lost");
    r = (struct kvt_job_result){.job_id = job->id,
                                .success = n_ok == job->n,
                                .successful_keys = n_ok == job->n ? NULL : ok,
                                .n_successful = n_ok == job->n ? 0 : n_ok,
                                .transfer_time = job_time(sj),
                                .transfer_bytes = (int64_t)(n_ok * s->base.row_bytes)};
    s->n_unreported--;
    cb(arg, &r);
}

static void st_get_finished_jobs(struct kvt_tier *t, kvt_job_result_cb_t cb, void *arg)
{
    struct st_tier *s = st(t);
    struct kvt_list done, *pos, *tmp;
    kvt__st_pool_take_done(s, &done);
    kvt_list_for_each_safe(pos, tmp, &done)
    {
        struct st_job *sj = kvt_list_entry(pos, struct st_job, link);
        kvt_list_del(&sj->link);
        if (sj->kind == ST_UNLINK)
            finish_unlinks(s, sj);
        else if (sj->kind == ST_STORE)
            finish_store(s, sj, cb, arg);
        else
            finish_load(s, sj, cb, arg);
        free_job(sj);
    }
    flush_unlinks(s); /* stale stores' files */
}

static int st_drain_jobs(struct kvt_tier *t)
{
    struct st_tier *s = st(t);
    flush_unlinks(s);
    kvt__st_pool_wait_idle(s);
    return 0;
}

static bool st_has_pending_work(struct kvt_tier *t)
{
    return st(t)->n_unreported > 0;
}

static int st_take_events(struct kvt_tier *t, struct kvt_events *out)
{
    return kvt_events_splice(out, &st(t)->events);
}

static int st_get_stats(struct kvt_tier *t, struct kvt_stats *out)
{
    struct st_tier *s = st(t);
    const struct {
        const char *name;
        uint64_t v;
    } counters[] = {
        {KVT_M_STORAGE_STORED_CHUNKS, s->c.stored},
        {KVT_M_STORAGE_SKIPPED_CHUNKS, s->c.skipped},
        {KVT_M_STORAGE_LOADED_CHUNKS, s->c.loaded},
        {KVT_M_STORAGE_EVICTIONS, s->c.evictions},
        {KVT_M_STORAGE_CHECKSUM_FAIL, s->c.checksum_fail},
        {KVT_M_STORAGE_MAC_FAIL, s->c.mac_fail},
        {KVT_M_STORAGE_OLD_FORMAT, s->c.old_format},
        {KVT_M_STORAGE_FOREIGN, s->c.foreign},
        {KVT_M_STORAGE_ERRORS, s->c.errors},
        {KVT_M_STORAGE_ENOSPC, s->c.enospc},
        {KVT_M_STORAGE_EIO, s->c.eio},
        {KVT_M_STORAGE_NO_SPACE, s->c.capacity_drops},
        {KVT_M_STORAGE_STALE, s->c.stale},
        {KVT_M_STORAGE_RESET_DROPS, s->c.reset_drops},
        {KVT_M_STORAGE_FINGERPRINT_DROPS, s->c.fingerprint_drops},
    };
    int rc = 0;
    snprintf(s->label, sizeof(s->label), "%d:%s", t->index + 1, t->type);
    for (size_t i = 0; rc == 0 && i < KVT_ARRAY_SIZE(counters); i++) {
        if (counters[i].v > 0)
            rc = kvt_stats_increase(out, counters[i].name, s->label, (double)counters[i].v);
    }
    if (rc == 0)
        rc = kvt_stats_set_gauge(out, KVT_M_STORAGE_USED_BYTES, s->label, (double)s->used);
    if (rc == 0)
        rc = kvt_stats_set_gauge(out, KVT_M_STORAGE_CAPACITY_BYTES, s->label, (double)s->capacity);
    if (rc == 0)
        rc = kvt_stats_set_gauge(out, KVT_M_STORAGE_FILES, s->label, (double)s->n_published);
    if (rc == 0)
        rc = kvt_stats_set_gauge(out, KVT_M_STORAGE_WITHHELD, s->label, s->withheld ? 1.0 : 0.0);
    if (rc == 0)
        memset(&s->c, 0, sizeof(s->c));
    return rc;
}

/* Used: the published files and the room reserved for those being written. Capacity:
 * storage.capacity, or with no bound what the file system still holds for the tier
 * (its files plus the space free to it); chunks at one file per row. */
static int st_usage(struct kvt_tier *t, struct kvt_tier_usage *out)
{
    struct st_tier *s = st(t);
    uint64_t fbytes = t->row_bytes > 0 ? kvt__st_file_bytes(t->row_bytes) : 0;
    uint64_t cap = s->capacity;

    if (cap == 0) {
        struct statvfs vfs;

        if (fstatvfs(s->dir_fd, &vfs) != 0)
            return -errno;
        cap = s->used + (uint64_t)vfs.f_bavail * (uint64_t)vfs.f_frsize;
    }
    *out = (struct kvt_tier_usage){
        .used_chunks = s->n_published + s->n_writing,
        .capacity_chunks = fbytes > 0 ? cap / fbytes : 0,
        .used_bytes = s->used,
        .capacity_bytes = cap,
    };
    return 0;
}

static int st_shutdown(struct kvt_tier *t)
{
    struct st_tier *s = st(t);
    if (s->shut_down)
        return 0;
    flush_unlinks(s);
    kvt__st_pool_stop(s);
    s->shut_down = true;
    return 0;
}

static void st_free(struct st_tier *s)
{
    struct kvt_list done, *pos, *tmp;
    size_t it = 0;
    struct kvt_map_entry *me;
    if (s->pending_unlinks != NULL)
        free_job(s->pending_unlinks);
    kvt__st_pool_take_done(s, &done);
    kvt_list_for_each_safe(pos, tmp, &done)
    {
        struct st_job *sj = kvt_list_entry(pos, struct st_job, link);
        kvt_list_del(&sj->link);
        free_job(sj);
    }
    kvt__st_pool_cleanup(s);
    pthread_cond_destroy(&s->pool.read_cv);
    pthread_cond_destroy(&s->pool.write_cv);
    pthread_cond_destroy(&s->pool.idle_cv);
    pthread_mutex_destroy(&s->pool.mu);
    while (kvt_map_next(&s->index, &it, &me))
        kvt_free(me->value);
    kvt_map_cleanup(&s->index);
    kvt_events_cleanup(&s->events);
    if (s->lock_fd >= 0)
        close(s->lock_fd); /* releases the folder lock */
    if (s->dir_fd >= 0)
        close(s->dir_fd);
    kvt_free(s->dir);
    kvt_free(s->root);
    kvt_free(s->fingerprint);
    kvt_free(s);
}

static void st_destroy(struct kvt_tier *t)
{
    struct st_tier *s = st(t);
    st_shutdown(t);
    st_free(s);
}

/* ---- generations and the model fingerprint (STATE) -------------------------------- */

#define STATE_MAGIC "kvtier-storage-state 1\n"
#define STATE_MAX   1024 /* bytes of a STATE file, at most */

static void to_hex(const uint8_t *b, size_t n, char *out)
{
    static const char digits[] = "0123456789abcdef";
    for (size_t i = 0; i < n; i++) {
        out[2 * i] = digits[b[i] >> 4];
        out[2 * i + 1] = digits[b[i] & 15];
    }
    out[2 * n] = '\0';
}

static int hex_val(char c)
{
    return c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
}

/* n bytes from 2n lowercase hex digits; -EBADMSG otherwise. */
static int from_hex(const char *h, size_t n, uint8_t *out)
{
    for (size_t i = 0; i < n; i++) {
        int a = hex_val(h[2 * i]), b = a < 0 ? -1 : hex_val(h[2 * i + 1]);
        if (b < 0)
            return -EBADMSG;
        out[i] = (uint8_t)(a << 4 | b);
    }
    return 0;
}

/* 1..KVT_STORAGE_FP_MAX bytes, no NUL (a C string). */
static bool fp_ok(const char *fp)
{
    return fp != NULL && fp[0] != '\0' && strlen(fp) <= KVT_STORAGE_FP_MAX;
}

/* Parses STATE's text: 0, gen and *fp_p (NULL: none; kvt_free); -EBADMSG. */
static int state_parse(const char *text, uint8_t gen[ST_GEN_BYTES], char **fp_p)
{
    const char *p = text, *nl;
    uint8_t fp[KVT_STORAGE_FP_MAX];
    size_t n;
    if (strncmp(p, STATE_MAGIC, strlen(STATE_MAGIC)) != 0)
        return -EBADMSG;
    p += strlen(STATE_MAGIC);
    if (strncmp(p, "generation ", 11) != 0)
        return -EBADMSG;
    p += 11;
    nl = strchr(p, '\n');
    if (nl == NULL || nl - p != 2 * ST_GEN_BYTES || from_hex(p, ST_GEN_BYTES, gen) != 0)
        return -EBADMSG;
    p = nl + 1;
    if (strncmp(p, "fingerprint ", 12) != 0)
        return -EBADMSG;
    p += 12;
    nl = strchr(p, '\n');
    if (nl == NULL || nl[1] != '\0')
        return -EBADMSG;
    n = (size_t)(nl - p);
    if (n == 1 && p[0] == '-') {
        *fp_p = NULL;
        return 0;
    }
    if (n == 0 || n % 2 != 0 || n / 2 > KVT_STORAGE_FP_MAX || from_hex(p, n / 2, fp) != 0 ||
        memchr(fp, 0, n / 2) != NULL)
        return -EBADMSG;
    *fp_p = kvt_malloc(n / 2 + 1);
    if (*fp_p == NULL)
        return -ENOMEM;
    memcpy(*fp_p, fp, n / 2);
    (*fp_p)[n / 2] = '\0';
    return 0;
}

/* Reads STATE: 0 with gen and *fp_p; -ENOENT when there is none; -EBADMSG when it
 * does not parse; -EPERM when it is not our own private file (or a link). */
static int state_read(struct st_tier *s, uint8_t gen[ST_GEN_BYTES], char **fp_p)
{
    char text[STATE_MAX + 1], what[4200];
    struct stat st;
    ssize_t n;
    /* O_NONBLOCK: a FIFO there is refused below, not waited on (no effect on a file). */
    int fd = openat(s->dir_fd, ST_STATE_FILE, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC), rc;
    if (fd < 0)
        return errno == ENOENT ? -ENOENT : errno == ELOOP ? -EPERM : -errno;
    snprintf(what, sizeof(what), "%s/%s", s->dir, ST_STATE_FILE);
    rc = kvt_private_file_check(fd, what, 0600, &st);
    if (rc != 0) {
        close(fd);
        return rc;
    }
    n = pread(fd, text, sizeof(text), 0);
    close(fd);
    if (n < 0)
        return -EIO;
    if (n > STATE_MAX)
        return -EBADMSG;
    text[n] = '\0';
    return state_parse(text, gen, fp_p);
}

/* Writes STATE: a temporary file, fsynced, renamed into place, the folder fsynced.
 * 0 or -errno (the old STATE stays). */
static int state_write(struct st_tier *s, const uint8_t gen[ST_GEN_BYTES], const char *fp)
{
    static const char tmp[] = ST_STATE_FILE ".tmp";
    char text[STATE_MAX], ghex[2 * ST_GEN_BYTES + 1], fhex[2 * KVT_STORAGE_FP_MAX + 1];
    int fd, n, rc = 0;
    to_hex(gen, ST_GEN_BYTES, ghex);
    if (fp != NULL)
        to_hex((const uint8_t *)fp, strlen(fp), fhex);
    else
        snprintf(fhex, sizeof(fhex), "-");
    n = snprintf(text, sizeof(text), "%sgeneration %s\nfingerprint %s\n", STATE_MAGIC, ghex, fhex);
    assert(n > 0 && (size_t)n < sizeof(text));
    unlinkat(s->dir_fd, tmp, 0); /* a leftover of ours (the folder is ours alone) */
    fd = openat(s->dir_fd, tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd < 0)
        rc = -errno;
    else if (write(fd, text, (size_t)n) != n)
        rc = errno ? -errno : -EIO;
    else if (fsync(fd) != 0)
        rc = -errno;
    if (fd >= 0 && close(fd) != 0 && rc == 0)
        rc = -errno;
    if (rc == 0 && renameat(s->dir_fd, tmp, s->dir_fd, ST_STATE_FILE) != 0)
        rc = -errno;
    if (rc == 0 && fsync(s->dir_fd) != 0)
        rc = -errno;
    if (rc != 0) {
        unlinkat(s->dir_fd, tmp, 0);
        kvt_error(MOD, "cannot write '%s/%s': %s", s->dir, ST_STATE_FILE, strerror(-rc));
    }
    return rc;
}

/* Dooms every indexed file and queues its removal; returns how many. A file whose
 * removal cannot be queued (no memory) leaves the index at once: it is stale, so the
 * next start removes it. Files being written are left to their jobs, which end
 * failed (their generation is the old one). */
static size_t drop_all(struct st_tier *s)
{
    struct kvt_map_entry *me;
    size_t it = 0, n = 0;
    while (kvt_map_next(&s->index, &it, &me)) {
        struct st_entry *e = me->value;
        if (e->state != ST_PUBLISHED)
            continue;
        n++;
        if (unlink_room(s) == 0) {
            doom(s, e);
            add_unlink(s, e); /* a reader still at it fails: its generation is old */
        } else if (e->pins == 0) {
            doom(s, e);
            s->n_doomed--;
            drop_entry(s, e);
        } else {
            doom(s, e); /* leaves the index with its last reader */
        }
    }
    flush_unlinks(s);
    return n;
}

/* A new generation recorded with fp, then every file dropped. 0 and *n_p, or the
 * -errno of writing STATE (nothing changed). */
static int new_generation(struct st_tier *s, const char *fp, size_t *n_p)
{
    uint8_t gen[ST_GEN_BYTES];
    int rc = kvt__st_random(gen, sizeof(gen));
    if (rc == 0)
        rc = state_write(s, gen, fp);
    if (rc != 0)
        return rc;
    memcpy(s->gen, gen, sizeof(gen));
    *n_p = drop_all(s);
    return 0;
}

/* Replaces the recorded fingerprint (a copy of fp, or none). */
static int set_recorded(struct st_tier *s, const char *fp)
{
    char *copy = NULL;
    if (fp != NULL && (copy = kvt_strdup(fp)) == NULL)
        return -ENOMEM;
    kvt_free(s->fingerprint);
    s->fingerprint = copy;
    return 0;
}

/* At create, before the scan: STATE read (or written: a folder of an earlier version
 * keeps its files under the namespace id as generation), and checked against
 * want_fp (the node's fingerprint when known). */
static int load_state(struct st_tier *s, const char *want_fp)
{
    uint8_t gen[ST_GEN_BYTES];
    char *fp = NULL;
    bool write = false, fresh = false;
    int rc = state_read(s, gen, &fp);
    if (rc == -ENOENT) {
        memcpy(gen, s->ns, sizeof(gen));
        write = true;
        rc = 0;
    } else if (rc == -EBADMSG) {
        kvt_warn(MOD, "'%s/%s' does not parse: a new generation (every file is dropped)", s->dir,
                 ST_STATE_FILE);
        fresh = write = true;
        rc = 0;
    } else if (rc != 0) {
        kvt_error(MOD, "'%s/%s': %s", s->dir, ST_STATE_FILE,
                  rc == -EPERM ? "not this tier's own private file: refused" : strerror(-rc));
        return rc;
    }
    if (want_fp != NULL && (fp == NULL || strcmp(fp, want_fp) != 0)) {
        if (fp != NULL) {
            kvt_warn(MOD,
                     "'%s': its chunks were stored for model fingerprint %s, the node's is %s: "
                     "they are dropped",
                     s->dir, KVT_LOG_STR(fp), KVT_LOG_STR(want_fp));
            fresh = true;
            s->restart.fingerprint_changed = true;
        }
        kvt_free(fp);
        fp = kvt_strdup(want_fp);
        if (fp == NULL)
            return -ENOMEM;
        write = true;
    } else if (want_fp == NULL && fp != NULL) {
        kvt_info(MOD,
                 "'%s': chunks of model fingerprint %s, withheld until the node's fingerprint "
                 "is known (node.model_fingerprint, or an engine that declares one)",
                 s->dir, KVT_LOG_STR(fp));
        s->withheld = true;
    }
    if (fresh)
        rc = kvt__st_random(gen, sizeof(gen));
    if (rc == 0 && write)
        rc = state_write(s, gen, fp);
    if (rc != 0) {
        kvt_free(fp);
        return rc;
    }
    memcpy(s->gen, gen, sizeof(gen));
    s->fingerprint = fp;
    return 0;
}

static int st_reset(struct kvt_tier *t)
{
    struct st_tier *s = st(t);
    size_t n = 0;
    int rc = new_generation(s, s->fingerprint, &n);
    if (rc != 0)
        return rc;
    s->c.reset_drops += n;
    kvt_info(MOD, "'%s': reset, %zu chunk file(s) dropped", s->dir, n);
    return 0;
}

int kvt_storage_tier_set_fingerprint(struct kvt_tier *t, const char *fp)
{
    struct st_tier *s = st(t);
    size_t n = 0;
    int rc;
    if (!fp_ok(fp))
        return -EINVAL;
    if (s->fingerprint != NULL && strcmp(s->fingerprint, fp) == 0) {
        if (s->withheld)
            kvt_info(MOD, "'%s': the node's model fingerprint is %s: its %zu chunk file(s) served",
                     s->dir, KVT_LOG_STR(fp), s->n_published);
        s->withheld = false;
        return 0;
    }
    if (s->fingerprint == NULL) {
        rc = state_write(s, s->gen, fp);
        if (rc == 0)
            rc = set_recorded(s, fp);
        if (rc == 0)
            s->withheld = false;
        return rc;
    }
    rc = new_generation(s, fp, &n);
    if (rc == 0)
        rc = set_recorded(s, fp);
    if (rc != 0)
        return rc;
    s->c.fingerprint_drops += n;
    s->withheld = false;
    kvt_warn(MOD, "'%s': the node's model fingerprint is %s: %zu chunk file(s) of another dropped",
             s->dir, KVT_LOG_STR(fp), n);
    return 0;
}

const char *kvt_storage_tier_fingerprint(struct kvt_tier *t)
{
    return st(t)->fingerprint;
}

/* The loop wakes when an I/O thread ends a job (st_news). */
static size_t st_event_fds(struct kvt_tier *t, int *fds, size_t cap)
{
    struct st_tier *s = st(t);

    if (cap == 0 || s->pool.done_fd < 0)
        return 0;
    fds[0] = s->pool.done_fd;
    return 1;
}

/* The tier's news (kvt_tier_news): the jobs its I/O threads have ended so far. */
static uint64_t st_news(struct kvt_tier *t)
{
    return __atomic_load_n(&st(t)->pool.n_done, __ATOMIC_ACQUIRE);
}

static const struct kvt_tier_ops storage_ops = {
    .lookup = st_lookup,
    .submit_store = st_submit_store,
    .submit_load = st_submit_load,
    .get_finished_jobs = st_get_finished_jobs,
    .drain_jobs = st_drain_jobs,
    .has_pending_work = st_has_pending_work,
    .take_events = st_take_events,
    .touch = st_touch,
    .event_fds = st_event_fds,
    .news = st_news,
    .get_stats = st_get_stats,
    .usage = st_usage,
    .reset = st_reset,
    .shutdown = st_shutdown,
    .destroy = st_destroy,
};

/* ---- create and warm restart ---------------------------------------------------- */

static int cmp_found(const void *a, const void *b)
{
    const struct st_found *x = a, *y = b;
    return x->mtime_ns < y->mtime_ns ? -1 : x->mtime_ns > y->mtime_ns;
}

static int rebuild_index(struct st_tier *s)
{
    struct st_found *found = NULL;
    size_t n = 0;
    int rc = kvt__st_scan(s, &found, &n);
    if (rc != 0)
        return rc;
    if (n > 1) /* found is NULL when nothing was found */
        qsort(found, n, sizeof(*found), cmp_found);
    for (size_t i = 0; i < n; i++) {
        struct st_entry *e = kvt_calloc(1, sizeof(*e));
        if (e == NULL || kvt_map_put(&s->index, found[i].key.bytes, found[i].key.len, e) != 0) {
            kvt_free(e);
            kvt_free(found);
            return -ENOMEM;
        }
        e->key = found[i].key;
        e->bytes = found[i].bytes;
        e->mtime_ns = found[i].mtime_ns;
        e->state = ST_PUBLISHED;
        kvt_list_add_tail(&s->lru, &e->lru);
        s->n_published++;
        s->used += e->bytes;
    }
    s->restart.files_found = n;
    s->restart.bytes_found = s->used;
    /* What the scan refused shows in the first stats, with its reason. */
    s->c.checksum_fail += s->restart.bad_removed;
    s->c.mac_fail += s->restart.mac_removed;
    s->c.old_format += s->restart.old_removed;
    s->c.foreign += s->restart.foreign;
    if (s->restart.fingerprint_changed)
        s->c.fingerprint_drops += s->restart.stale_removed;
    else
        s->c.stale += s->restart.stale_removed;
    if (s->enable_events && n > 0) {
        struct kvt_key *keys = kvt_reallocarray(NULL, n, sizeof(*keys));
        if (keys == NULL) {
            kvt_free(found);
            return -ENOMEM;
        }
        for (size_t i = 0; i < n; i++)
            keys[i] = found[i].key;
        rc = kvt_events_push(&s->events, keys, n, KVT_MEDIUM_STORAGE, s->base.locality, false);
        kvt_free(keys);
    }
    kvt_free(found);
    /* A smaller capacity than last time: evict the oldest. */
    while (rc == 0 && s->capacity > 0 && s->used > s->capacity) {
        rc = evict(s, kvt_list_entry(s->lru.next, struct st_entry, lru));
        s->restart.evicted += rc == 0;
    }
    s->c.evictions = 0;
    return rc;
}

static int check_config(const struct kvt_storage_tier_config *cfg)
{
    if (cfg == NULL || cfg->root == NULL || cfg->root[0] == '\0') {
        kvt_error(MOD, "config: root is required");
        return -EINVAL;
    }
    if (cfg->locality != KVT_LOCAL && cfg->locality != KVT_REMOTE && cfg->locality != KVT_ANY) {
        kvt_error(MOD, "config: locality %d is not LOCAL or REMOTE", cfg->locality);
        return -EINVAL;
    }
    if (cfg->io != KVT_STORAGE_IO_AUTO && cfg->io != KVT_STORAGE_IO_BUFFERED &&
        cfg->io != KVT_STORAGE_IO_DIRECT) {
        kvt_error(MOD, "config: io mode %d unknown", (int)cfg->io);
        return -EINVAL;
    }
    if (cfg->key != NULL && (cfg->key_len < 16 || cfg->key_len > 1024)) {
        kvt_error(MOD, "config: a MAC secret of %zu bytes (16..1024 expected)", cfg->key_len);
        return -EINVAL;
    }
    if (cfg->fingerprint != NULL && !fp_ok(cfg->fingerprint)) {
        kvt_error(MOD, "config: a model fingerprint of 1..%d bytes expected", KVT_STORAGE_FP_MAX);
        return -EINVAL;
    }
    if (cfg->n_read_threads > 256 || cfg->n_write_threads > 256 || cfg->scan_threads > 64 ||
        cfg->read_depth > 256) {
        kvt_error(MOD, "config: too many threads");
        return -EINVAL;
    }
    return 0;
}

/* Opens (creating it 0700) a folder of the tier under dir_fd: it must be ours, and a
 * folder of ours with wider permissions (an older version made them 0755) is made
 * 0700. Returns the fd or -errno (-EPERM: not ours, or a link; logged). */
static int open_own_dir(struct st_tier *s, int dir_fd, const char *shown, const char *name,
                        int flags)
{
    struct stat st;
    int fd, rc;
    if (mkdirat(dir_fd, name, 0700) != 0 && errno != EEXIST) {
        rc = -errno;
        kvt_error(MOD, "config: cannot create '%s/%s': %s", shown, name, strerror(-rc));
        return rc;
    }
    fd = openat(dir_fd, name, flags | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) {
        rc = errno == ELOOP || errno == ENOTDIR ? -EPERM : -errno;
        kvt_error(MOD, "config: cannot open '%s/%s': %s", shown, name,
                  rc == -EPERM ? "not a folder (a link?): refused" : strerror(-rc));
        return rc;
    }
    if (fstat(fd, &st) != 0) {
        rc = -errno;
        close(fd);
        return rc;
    }
    if (st.st_uid != s->uid) {
        kvt_error(MOD, "config: '%s/%s' is owned by uid %u, not by this process: refused", shown,
                  name, (unsigned)st.st_uid);
        close(fd);
        return -EPERM;
    }
    if ((st.st_mode & 077) && fchmod(fd, 0700) != 0) {
        rc = -errno;
        kvt_error(MOD, "config: chmod 0700 '%s/%s': %s", shown, name, strerror(-rc));
        close(fd);
        return rc;
    }
    return fd;
}

static int open_folders(struct st_tier *s, const struct kvt_storage_tier_config *cfg)
{
    static const struct kvt_dir_policy root_policy = {
        .mode = 0700, .gid = KVT_GROUP_NONE, .create = true};
    char hex[2 * KVT_STORAGE_NS_BYTES + 1];
    int root_fd = -1, rc;
    for (size_t i = 0; i < KVT_STORAGE_NS_BYTES; i++)
        snprintf(hex + 2 * i, 3, "%02x", s->ns[i]);
    rc = kvt_private_dir_open(s->root, &root_policy, &root_fd);
    if (rc != 0) {
        kvt_error(MOD, "config: cannot use root '%s': %s", s->root,
                  rc == -EPERM ? "not safe (see above)" : strerror(-rc));
        return rc;
    }
    rc = kvt__st_mac_keys(s, root_fd, cfg->key, cfg->key_len);
    if (rc != 0) {
        kvt_error(MOD, "config: no MAC key for '%s': %s", s->root, strerror(-rc));
        goto out;
    }
    s->dir = kvt_malloc(strlen(s->root) + sizeof(hex) + 1);
    if (s->dir == NULL) {
        rc = -ENOMEM;
        goto out;
    }
    sprintf(s->dir, "%s/%s", s->root, hex);
    s->dir_fd = open_own_dir(s, root_fd, s->root, hex, O_RDONLY);
    if (s->dir_fd < 0) {
        rc = s->dir_fd;
        goto out;
    }
    /* Read-only: flock needs no write access, and a file open for writing would keep
     * the file system from being remounted read-only. O_NONBLOCK: a FIFO there is
     * refused by the check below instead of blocking the start. */
    s->lock_fd =
        openat(s->dir_fd, "LOCK", O_RDONLY | O_CREAT | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC, 0600);
    if (s->lock_fd < 0) {
        rc = errno == ELOOP ? -EPERM : -errno;
        kvt_error(MOD, "config: '%s' is not writable: %s", s->dir,
                  rc == -EPERM ? "its LOCK is a symbolic link" : strerror(-rc));
        goto out;
    }
    {
        char what[4200];
        struct stat st;
        snprintf(what, sizeof(what), "%s/LOCK", s->dir);
        rc = kvt_private_file_check(s->lock_fd, what, 07777, &st);
        if (rc != 0)
            goto out;
        if ((st.st_mode & 077) && fchmod(s->lock_fd, 0600) != 0)
            kvt_warn(MOD, "chmod 0600 '%s': %s", what, strerror(errno));
    }
    if (flock(s->lock_fd, LOCK_EX | LOCK_NB) != 0) {
        rc = errno == EWOULDBLOCK ? -EBUSY : -errno;
        kvt_error(MOD, "'%s' is in use by another storage tier", s->dir);
        goto out;
    }
    for (unsigned i = 0; i < ST_SCAN_SHARDS; i++) {
        char name[3];
        int fd;
        snprintf(name, sizeof(name), "%02x", i);
        fd = open_own_dir(s, s->dir_fd, s->dir, name, O_RDONLY);
        if (fd < 0) {
            rc = fd;
            goto out;
        }
        close(fd);
    }
    rc = 0;
out:
    close(root_fd);
    return rc;
}

int kvt_storage_tier_create(const struct kvt_storage_tier_config *cfg, struct kvt_tier **tier_p)
{
    struct st_tier *s;
    struct kvt_bp *bp = NULL;
    uint64_t t0 = kvt_now_ns();
    int rc = check_config(cfg), probe;
    if (rc != 0)
        return rc;
    s = kvt_calloc(1, sizeof(*s));
    if (s == NULL)
        return -ENOMEM;
    kvt_tier_init(&s->base, &storage_ops, cfg->type ? cfg->type : "storage", KVT_MEDIUM_STORAGE,
                  cfg->locality);
    s->dir_fd = s->lock_fd = -1;
    memcpy(s->ns, cfg->namespace_id, sizeof(s->ns));
    s->capacity = cfg->capacity_bytes;
    s->fsync = cfg->fsync;
    s->enable_events = cfg->enable_events;
    s->n_read = cfg->n_read_threads ? cfg->n_read_threads : 4;
    s->n_write = cfg->n_write_threads ? cfg->n_write_threads : 2;
    s->n_scan = cfg->scan_threads ? cfg->scan_threads : 4;
    s->read_depth = cfg->read_depth ? cfg->read_depth : 16;
    s->no_uring = cfg->no_io_uring;
    kvt_map_init(&s->index);
    kvt_list_init(&s->lru);
    kvt_events_init(&s->events);
    kvt__st_pool_init(s);
    s->pool.done_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    s->root = kvt_strdup(cfg->root);
    if (s->pool.done_fd < 0 || s->root == NULL) {
        rc = s->pool.done_fd < 0 ? -errno : -ENOMEM;
        goto free_tier;
    }
    s->uid = geteuid();
    rc = open_folders(s, cfg);
    if (rc != 0)
        goto free_tier;
    probe = kvt__st_probe_direct(s->dir_fd);
    if (probe < 0) {
        rc = probe;
        kvt_error(MOD, "config: '%s' is not writable: %s", s->dir, strerror(-rc));
        goto free_tier;
    }
    if (cfg->io == KVT_STORAGE_IO_DIRECT && probe == 0) {
        kvt_error(MOD, "config: O_DIRECT required but not supported in '%s'", s->dir);
        rc = -EINVAL;
        goto free_tier;
    }
    s->direct_ok = cfg->io != KVT_STORAGE_IO_BUFFERED && probe == 1;
    if (cfg->io == KVT_STORAGE_IO_AUTO && probe == 0)
        kvt_warn(MOD, "O_DIRECT not supported in '%s': buffered I/O", s->dir);
    rc = load_state(s, cfg->fingerprint);
    if (rc != 0)
        goto free_tier;
    rc = rebuild_index(s);
    if (rc != 0)
        goto free_tier;
    if (!cfg->no_backpressure) {
        struct kvt_bp_config bc;
        if (cfg->bp != NULL)
            bc = *cfg->bp;
        else
            kvt_bp_default_config(s->base.type, s->base.locality, &bc);
        rc = kvt_bp_create(&bc, &bp);
        if (rc != 0) {
            kvt_error(MOD, "config: bad back-pressure settings");
            goto free_tier;
        }
        s->base.bp = bp;
    }
    rc = kvt__st_pool_start(s);
    if (rc != 0)
        goto free_bp;
    flush_unlinks(s);
    s->restart.seconds = (double)(kvt_now_ns() - t0) * 1e-9;
    kvt_info(MOD,
             "'%s': %zu chunk file(s), %llu bytes indexed in %.3f s (%zu temporary and %zu bad "
             "file(s) removed, %zu evicted); %s I/O, %s",
             s->dir, s->restart.files_found, (unsigned long long)s->restart.bytes_found,
             s->restart.seconds, s->restart.tmp_removed, s->restart.bad_removed, s->restart.evicted,
             s->direct_ok ? "direct" : "buffered",
             s->uring_ok ? "reads through io_uring" : "blocking reads");
    if (s->restart.mac_removed > 0 || s->restart.old_removed > 0)
        kvt_warn(MOD,
                 "'%s': removed %zu file(s) whose MAC did not verify (changed by someone, or "
                 "written under another key: a new secret or storage.key) and %zu of the old "
                 "unkeyed format",
                 s->dir, s->restart.mac_removed, s->restart.old_removed);
    if (s->restart.stale_removed > 0)
        kvt_info(MOD, "'%s': removed %zu file(s) of an earlier generation (%s)", s->dir,
                 s->restart.stale_removed,
                 s->restart.fingerprint_changed ? "another model" : "a reset or model change");
    if (s->restart.skipped > 0)
        kvt_warn(MOD,
                 "'%s': %zu chunk file(s) could not be opened or read (out of descriptors or "
                 "memory): kept on disk, not indexed until the next start",
                 s->dir, s->restart.skipped);
    if (s->restart.foreign > 0)
        kvt_warn(MOD,
                 "'%s': %zu file(s) refused: another user's or a link (left alone), or open to "
                 "group/others (removed)",
                 s->dir, s->restart.foreign);
    *tier_p = &s->base;
    return 0;

free_bp:
    s->base.bp = NULL;
    kvt_bp_destroy(bp);
free_tier:
    st_free(s);
    return rc;
}

/* ---- introspection and test hooks ------------------------------------------------- */

void kvt_storage_tier_restart_info(struct kvt_tier *t, struct kvt_storage_restart_info *info_p)
{
    *info_p = st(t)->restart;
}

void kvt_storage_tier_info(struct kvt_tier *t, struct kvt_storage_tier_info *info_p)
{
    struct st_tier *s = st(t);
    *info_p = (struct kvt_storage_tier_info){.num_keys = s->n_published,
                                             .num_writing = s->n_writing,
                                             .num_doomed = s->n_doomed,
                                             .used_bytes = s->used,
                                             .capacity_bytes = s->capacity,
                                             .direct_io = use_direct(s),
                                             .io_uring = s->uring_ok,
                                             .read_depth = s->uring_ok ? s->read_depth : 1,
                                             .num_unreported = s->n_unreported,
                                             .withheld = s->withheld};
}

bool kvt_storage_tier_has(struct kvt_tier *t, const struct kvt_key *key)
{
    struct st_entry *e = find(st(t), key);
    return e != NULL && e->state == ST_PUBLISHED;
}

int kvt_storage_tier_path(struct kvt_tier *t, const struct kvt_key *key, char *buf, size_t len)
{
    char name[ST_NAME_MAX];
    kvt__st_name(key, ".kvc", name);
    if ((size_t)snprintf(buf, len, "%s/%s", st(t)->dir, name) >= len)
        return -ENAMETOOLONG;
    return 0;
}

const char *kvt_storage_tier_dir(struct kvt_tier *t)
{
    return st(t)->dir;
}

void kvt_storage_tier_inject_fault(struct kvt_tier *t, enum kvt_storage_fault op, int err,
                                   unsigned n)
{
    struct st_tier *s = st(t);
    assert(op == KVT_STORAGE_FAULT_WRITE || op == KVT_STORAGE_FAULT_READ ||
           op == KVT_STORAGE_FAULT_SYNC);
    __atomic_store_n(&s->fault_err[op], err, __ATOMIC_RELAXED);
    __atomic_store_n(&s->fault_n[op], (int)n, __ATOMIC_RELEASE);
}

void kvt_storage_tier_pause(struct kvt_tier *t, bool paused)
{
    kvt__st_pool_pause(st(t), paused);
}

void kvt_storage_tier_wait_idle(struct kvt_tier *t)
{
    struct st_tier *s = st(t);
    flush_unlinks(s);
    kvt__st_pool_wait_idle(s);
}

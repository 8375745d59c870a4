/* SPDX-License-Identifier: Apache-2.0 */
/* The network tier's holder side of the directory (net_tier_int.h): what this node
 * holds is published to each key's home, what the primary evicts is unpublished.
 *
 * The cascade (submit_store) only records the keys: the bytes stay in the primary,
 * so the job is done at once. Keys to PUBLISH and UNPUBLISH collect in two vectors
 * and leave batched, one message per home and NT_KEYS_PER_MSG keys, at the next
 * flush (every schedule end and poll); keys homed here go straight to our own
 * directory. What leaves is what holds at the flush: a key queued for PUBLISH that
 * the primary removed since, or queued for UNPUBLISH and stored again since, is not
 * sent as such (the order of the two vectors would otherwise decide). Every record
 * has a TTL: all held keys are re-published at half of it, and at once after a
 * membership change (homes moved); a home drops the keys homed elsewhere now only
 * once every node can have seen the change (retain_at_ns).
 *
 * Publications are bulk traffic: they take at most half of a link's send credits
 * (kvt_peers_send_bulk), so that heartbeats, answers and grants to that peer are
 * never starved by a re-publication, a burst of one message per NT_KEYS_PER_MSG
 * keys. Keys for a home whose link has no credits to spare wait in that home's
 * queue (struct nt_later), placed once; each flush a ms apart sends what the link
 * has room for, so a million waiting keys cost the loop nothing while their home is
 * slow, and a membership change places the waiting unpublications again. A publication
 * lost to a failed send or to memory is repaired by the next re-publication; a lost
 * unpublication ages out with its record. The node's reset (the primary cleared)
 * unpublishes everything at once (kvt__nt_reset; what a link has no credits for, a
 * ms or so later), so no peer is sent here for a chunk the reset dropped.
 *
 * In direct mode (network.fetch direct) a PUBLISH also says where each key sits in
 * the primary - its slot and the fence word its bytes were completed under - read
 * at the flush, so the home's LOCATE answers let peers READ the row without asking
 * us. A place that goes stale (the slot reused or rewritten) costs the peer a
 * refused fence and a miss, never wrong bytes; a key stored again is published
 * again with its new place. */
#include <errno.h>
#include <string.h>

#include "kvt/alloc.h"
#include "kvt/clock.h"
#include "kvt/log.h"
#include "kvt/vec.h"
#include "net_tier_int.h"

/* The job's record first: without it the job is refused, nothing published. */
int kvt__nt_submit_store(struct kvt_tier *t, const struct kvt_job *job)
{
    struct net_tier *nt = nt_of(t);
    struct nt_done *d = kvt_calloc(1, sizeof(*d));

    if (d == NULL)
        return -ENOMEM;
    for (size_t i = 0; i < job->n; i++) {
        const struct kvt_key *k = &job->keys[i];

        if (kvt_map_get(&nt->published, k->bytes, k->len) != NULL)
            continue;
        if (kvt_map_put(&nt->published, k->bytes, k->len, (void *)1) != 0 ||
            kvt__nt_keyvec_push(&nt->pub, k) != 0)
            kvt_warn(NT_MOD, "out of memory: a chunk is not published (peers will miss it)");
    }
    *d = (struct nt_done){.job_id = job->id, .success = true, .seconds = -1, .bytes = 0};
    kvt__nt_job_done(nt, d);
    return 0;
}

void kvt__nt_on_removed(void *arg, const struct kvt_key *keys, size_t n)
{
    struct net_tier *nt = arg;

    if (keys == NULL) { /* reset_cache: everything */
        struct kvt_map_entry *e;
        size_t it = 0;

        while (kvt_map_next(&nt->published, &it, &e)) {
            struct kvt_key k;

            k.len = e->key_len;
            memcpy(k.bytes, e->key, e->key_len);
            if (kvt__nt_keyvec_push(&nt->unpub, &k) != 0)
                break; /* the records age out with their TTL */
        }
        kvt_map_clear(&nt->published);
        nt->pub.n = 0; /* nothing is held any more */
        return;
    }
    for (size_t i = 0; i < n; i++) {
        if (kvt_map_remove(&nt->published, keys[i].bytes, keys[i].len) != NULL &&
            kvt__nt_keyvec_push(&nt->unpub, &keys[i]) != 0)
            kvt_warn(NT_MOD, "out of memory: an unpublish was lost (its record ages out)");
    }
}

/* Where each key sits in our primary now (direct reads): its slot and the fence word
 * its bytes were completed under; not known for a key absent or not yet complete. */
static void nt_rows_of(struct net_tier *nt, const struct kvt_key *ks, size_t n,
                       struct kvt_wire_row *rows)
{
    for (size_t i = 0; i < n; i++) {
        struct kvt_primary_entry_info info;

        rows[i] = (struct kvt_wire_row){.known = false};
        if (kvt_primary_entry_info(nt->primary, &ks[i], &info) == 0 && info.slot >= 0 &&
            info.fence != 0 && !(info.fence & 1))
            rows[i] =
                (struct kvt_wire_row){.row = (uint64_t)info.slot, .gen = info.fence, .known = true};
    }
}

/* 0, or -EAGAIN when the link to home has no send credits to spare for now (the
 * caller keeps the keys for the next flush). */
static int nt_send_keys(struct net_tier *nt, uint64_t home, enum kvt_wire_type type,
                        const struct kvt_key *ks, size_t n)
{
    uint64_t inc = kvt_peers_incarnation(nt->peers);
    struct kvt_wire_row rows[NT_KEYS_PER_MSG];
    bool with_rows =
        type == KVT_WIRE_PUBLISH && nt->cfg.fetch == KVT_NET_FETCH_DIRECT && !nt->omit_fences;
    struct kvt_wire_msg m;

    if (with_rows)
        nt_rows_of(nt, ks, n, rows);
    if (home == nt->self) {
        struct kvt_dir_row dr[NT_KEYS_PER_MSG];

        for (size_t i = 0; with_rows && i < n; i++)
            dr[i] = (struct kvt_dir_row){
                .row = rows[i].row, .gen = rows[i].gen, .known = rows[i].known};
        if (type == KVT_WIRE_PUBLISH)
            kvt_directory_publish_rows(nt->dir, nt->self, inc, ks, with_rows ? dr : NULL, n,
                                       kvt_now_ns());
        else
            kvt_directory_unpublish(nt->dir, nt->self, inc, ks, n);
        return 0;
    }
    if (home == 0)
        return 0;
    kvt_wire_msg_init(&m, type);
    m.u.publish.node_id = nt->self;
    m.u.publish.incarnation = inc;
    m.u.publish.n_keys = (uint32_t)n;
    m.u.publish.keys = (struct kvt_key *)ks;
    if (with_rows) {
        m.u.publish.n_rows = (uint32_t)n;
        m.u.publish.rows = rows;
        m.has |= KVT_WIRE_HAS(KVT_WIRE_F_ROWS);
    }
    /* A home we cannot reach now gets the keys at the next membership change; one
     * whose link has no credits to spare (a burst: every key re-published after a
     * membership change) at the next flush. */
    return kvt__nt_send_bulk(nt, home, &m) == -EAGAIN ? -EAGAIN : 0;
}

/* ---- keys waiting for send credits, per home ----------------------------------- */

static int type_ix(enum kvt_wire_type type)
{
    return type == KVT_WIRE_PUBLISH ? 0 : 1;
}

static struct nt_later *later_of(struct net_tier *nt, uint64_t home, bool create)
{
    for (size_t i = 0; i < nt->n_later; i++)
        if (nt->later[i].home == home)
            return &nt->later[i];
    if (!create || kvt_vec_reserve(nt->later, nt->cap_later, nt->n_later + 1, 8) < 0)
        return NULL;
    nt->later[nt->n_later] = (struct nt_later){.home = home};
    return &nt->later[nt->n_later++];
}

/* Queues ks for home; a key lost to memory is repaired as nt_send_keys' failures
 * are (the next re-publication, or its record's TTL). */
static void nt_defer(struct net_tier *nt, uint64_t home, enum kvt_wire_type type,
                     const struct kvt_key *ks, size_t n)
{
    struct nt_later *w = later_of(nt, home, true);

    for (size_t i = 0; i < n; i++)
        if (w == NULL || kvt__nt_keyvec_push(&w->kv[type_ix(type)], &ks[i]) != 0) {
            kvt_warn(NT_MOD, "out of memory: %s of %zu keys lost", kvt_wire_type_name((int)type),
                     n - i);
            return;
        }
}

static void later_free_at(struct net_tier *nt, size_t i)
{
    kvt__nt_keyvec_free(&nt->later[i].kv[0]);
    kvt__nt_keyvec_free(&nt->later[i].kv[1]);
    nt->later[i] = nt->later[--nt->n_later];
}

size_t kvt__nt_later_pending(const struct net_tier *nt)
{
    size_t n = 0;

    for (size_t i = 0; i < nt->n_later; i++)
        for (int t = 0; t < 2; t++)
            n += nt->later[i].kv[t].n - nt->later[i].head[t];
    return n;
}

void kvt__nt_later_free(struct net_tier *nt)
{
    while (nt->n_later > 0)
        later_free_at(nt, nt->n_later - 1);
    kvt_free(nt->later);
    nt->later = NULL;
    nt->cap_later = 0;
}

/* The membership changed (or every key is re-published): the waiting PUBLISHes are
 * dropped (all held keys follow anyway), the waiting UNPUBLISHes are placed again. */
static void nt_later_replace(struct net_tier *nt)
{
    while (nt->n_later > 0) {
        struct nt_later *w = &nt->later[nt->n_later - 1];

        for (size_t i = w->head[1]; i < w->kv[1].n; i++)
            if (kvt__nt_keyvec_push(&nt->unpub, &w->kv[1].v[i]) != 0)
                break; /* the records age out with their TTL */
        later_free_at(nt, nt->n_later - 1);
    }
}

/* Sends what home's link has room for, a message at a time from the oldest key; a
 * key whose state changed since (a PUBLISH of a key no longer held, an UNPUBLISH of
 * one stored again) is dropped, as keep_if_published does for fresh keys. */
static void nt_drain_one(struct net_tier *nt, struct nt_later *w, enum kvt_wire_type type)
{
    struct keyvec *kv = &w->kv[type_ix(type)];
    size_t *head = &w->head[type_ix(type)];
    bool held = type == KVT_WIRE_PUBLISH;

    while (*head < kv->n) {
        struct kvt_key ks[NT_KEYS_PER_MSG];
        size_t n = 0;

        for (; *head < kv->n && n < NT_KEYS_PER_MSG; ++*head) {
            const struct kvt_key *k = &kv->v[*head];

            if ((kvt_map_get(&nt->published, k->bytes, k->len) != NULL) == held)
                ks[n++] = *k;
        }
        if (n > 0 && nt_send_keys(nt, w->home, type, ks, n) == -EAGAIN) {
            /* Back where they were taken from: the last n places before head. */
            *head -= n;
            memcpy(&kv->v[*head], ks, n * sizeof(*ks));
            break;
        }
    }
    if (*head == kv->n) {
        kv->n = *head = 0;
    } else if (*head >= 4096 && 2 * *head >= kv->n) { /* the sent half goes */
        memmove(kv->v, &kv->v[*head], (kv->n - *head) * sizeof(*kv->v));
        kv->n -= *head;
        *head = 0;
    }
}

static void nt_drain_later(struct net_tier *nt)
{
    for (size_t i = nt->n_later; i-- > 0;) {
        struct nt_later *w = &nt->later[i];

        nt_drain_one(nt, w, KVT_WIRE_UNPUBLISH);
        nt_drain_one(nt, w, KVT_WIRE_PUBLISH);
        if (w->kv[0].n == 0 && w->kv[1].n == 0)
            later_free_at(nt, i);
    }
}

/* Sends ks to home unless full (its link had no credits to spare already), or
 * queues them for it when it has none; true when they were queued. */
static bool nt_send_or_defer(struct net_tier *nt, uint64_t home, enum kvt_wire_type type,
                             const struct kvt_key *ks, size_t n, bool full)
{
    if (!full && nt_send_keys(nt, home, type, ks, n) != -EAGAIN)
        return false;
    nt_defer(nt, home, type, ks, n);
    return true;
}

/* Sends the keys of kv to their homes as PUBLISH or UNPUBLISH, and empties kv. A
 * home whose link has no credits to spare (at its first refused message) gets the
 * rest of its keys queued, and they leave from there (nt_drain_later), placed once. */
void kvt__nt_flush_keys(struct net_tier *nt, struct keyvec *kv, enum kvt_wire_type type)
{
    uint64_t live[NT_MAX_NODES];
    size_t n_live;
    uint64_t *homes;
    bool *done;

    if (kv->n == 0)
        return;
    n_live = kvt_peers_live(nt->peers, live, NT_MAX_NODES);
    homes = kvt_malloc(kv->n * sizeof(*homes));
    done = kvt_calloc(kv->n, sizeof(*done));
    if (homes == NULL || done == NULL) {
        kvt_warn(NT_MOD, "out of memory: %s of %zu keys lost", kvt_wire_type_name((int)type),
                 kv->n);
        goto out;
    }
    for (size_t i = 0; i < kv->n; i++)
        homes[i] = nt_home(&kv->v[i], live, n_live);
    for (size_t i = 0; i < kv->n; i++) {
        struct kvt_key ks[NT_KEYS_PER_MSG];
        size_t n = 0;
        bool full = false; /* the home's link has no credits to spare */

        if (done[i])
            continue;
        for (size_t j = i; j < kv->n; j++) {
            if (done[j] || homes[j] != homes[i])
                continue;
            done[j] = true;
            ks[n++] = kv->v[j];
            if (n == NT_KEYS_PER_MSG) {
                full = nt_send_or_defer(nt, homes[i], type, ks, n, full);
                n = 0;
            }
        }
        if (n > 0)
            nt_send_or_defer(nt, homes[i], type, ks, n, full);
    }
out:
    kv->n = 0;
    kvt_free(homes);
    kvt_free(done);
}

/* Keeps in kv the keys whose presence in the published set is held (order kept). */
static void keep_if_published(struct net_tier *nt, struct keyvec *kv, bool held)
{
    size_t w = 0;

    for (size_t i = 0; i < kv->n; i++) {
        const struct kvt_key *k = &kv->v[i];

        if ((kvt_map_get(&nt->published, k->bytes, k->len) != NULL) == held)
            kv->v[w++] = *k;
    }
    kv->n = w;
}

void kvt__nt_reset(struct net_tier *nt)
{
    kvt__nt_on_removed(nt, NULL, 0); /* (the primary's reset did it: nothing left) */
    keep_if_published(nt, &nt->unpub, false);
    kvt__nt_flush_keys(nt, &nt->unpub, KVT_WIRE_UNPUBLISH);
}

static bool nt_homed_here(void *arg, const struct kvt_key *key)
{
    struct net_tier *nt = arg;
    uint64_t live[NT_MAX_NODES];
    size_t n_live = kvt_peers_live(nt->peers, live, NT_MAX_NODES);

    return nt_home(key, live, n_live) == nt->self;
}

void kvt__nt_flush_publishes(struct net_tier *nt)
{
    uint64_t now = kvt_now_ns();

    if (now >= nt->next_republish_ns) { /* refresh records before their TTL ends */
        nt->republish_all = true;
        nt->next_republish_ns = now + ms_ns(nt->cfg.record_ttl_ms) / 2;
    }
    if (nt->republish_all) {
        struct kvt_map_entry *e;
        size_t it = 0;

        nt->republish_all = false;
        nt_later_replace(nt); /* homes may have moved */
        nt->pub.n = 0;        /* all of them follow */
        while (kvt_map_next(&nt->published, &it, &e)) {
            struct kvt_key k;

            k.len = e->key_len;
            memcpy(k.bytes, e->key, e->key_len);
            if (kvt__nt_keyvec_push(&nt->pub, &k) != 0)
                break;
        }
    }
    if (nt->retain_at_ns != 0 && now >= nt->retain_at_ns) { /* see nt_on_member */
        size_t moved = kvt_directory_retain(nt->dir, nt_homed_here, nt);

        nt->retain_at_ns = 0;
        if (moved > 0)
            kvt_info(NT_MOD, "dropped %zu directory keys homed elsewhere now", moved);
    }
    /* Keys waiting for a link's credits are tried again a ms later, not on every
     * turn of a polling loop; then the fresh keys. */
    if (nt->n_later > 0 && now >= nt->next_flush_ns)
        nt_drain_later(nt);
    keep_if_published(nt, &nt->unpub, false);
    keep_if_published(nt, &nt->pub, true);
    kvt__nt_flush_keys(nt, &nt->unpub, KVT_WIRE_UNPUBLISH);
    kvt__nt_flush_keys(nt, &nt->pub, KVT_WIRE_PUBLISH);
    if (nt->n_later > 0 && nt->next_flush_ns <= now) /* the next try */
        nt->next_flush_ns = now + MS;
    /* A scan of every record: once a second (locate checks each record's expiry
     * anyway; this only frees them). */
    if (now >= nt->next_dir_expire_ns) {
        nt->next_dir_expire_ns = now + 1000 * MS;
        kvt_directory_expire(nt->dir, now);
    }
}

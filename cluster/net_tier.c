/* The network tier (kvt/net_tier.h): lookups by LOCATE to each key's home, loads by
 * FETCH + GRANT + one-sided READ + RELEASE, serving peers through the parent.
 *
 * Everything but the lookup worker's batch_lookup runs on the loop thread. The
 * worker hands its keys to the loop through nt->mu (a queue of locate_req, each
 * shared by the worker and the loop and freed by whichever lets go last) and waits
 * on nt->cv; the loop answers from LOCATE_REPLYs and its own directory. */
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <sys/eventfd.h>
#include <time.h>
#include <unistd.h>

#include "kvt/alloc.h"
#include "kvt/async_lookup.h"
#include "kvt/clock.h"
#include "kvt/common.h"
#include "kvt/directory.h"
#include "kvt/hash.h"
#include "kvt/list.h"
#include "kvt/log.h"
#include "kvt/map.h"
#include "kvt/net_tier.h"
#include "kvt/placement.h"

#define NT_MOD "net"
/* Keys per PUBLISH/UNPUBLISH/LOCATE/FETCH: keeps every message far below the
 * transport's 64 KiB control-message default. */
#define NT_KEYS_PER_MSG 256
#define NT_MAX_NODES    KVT_MEMBERS_MAX
#define MS              1000000ull

/* ---- shared with the lookup worker (under nt->mu) ----------------------------- */

enum { LR_QUEUED, LR_TAKEN, LR_DONE };

struct locate_req {
    struct locate_req *next;
    struct kvt_key *keys; /* the worker's copy; the loop reads it while TAKEN */
    size_t n;
    bool *found; /* written by the loop under mu, then state DONE */
    int state;
    int refs; /* worker + loop */
};

/* ---- loop-side state ----------------------------------------------------------- */

struct locate_op { /* one locate_req being answered */
    uint64_t id;
    struct locate_req *req;
    bool *found;
    size_t parts_pending;
    uint64_t deadline_ns;
};

struct locate_part { /* one LOCATE on the wire */
    uint64_t wire_id;
    struct locate_op *op;
    uint64_t node;
    uint32_t *idx; /* into op->req->keys */
    uint32_t n;
    uint64_t sent_ns;
};

struct holder {
    uint64_t node_id;
    uint64_t incarnation;
};

struct load_job {
    const struct kvt_job *job;
    bool *ok;
    size_t parts_pending;
    uint64_t start_ns;
    uint64_t bytes;
};

/* A fetch waits QUEUED on its peer until fewer than fetches_per_peer of that peer's
 * fetches are SENT or READING; its deadline starts when its FETCH leaves. */
enum { F_QUEUED, F_SENT, F_READING };

struct fetch {
    uint64_t id;
    struct load_job *lj;
    uint64_t node, incarnation;
    int state;
    struct kvt_list qnode; /* on its nt_peer's queue while QUEUED */
    uint64_t queued_ns, sent_ns, grant_ns;
    uint32_t *idx; /* job key indexes, in FETCH order */
    uint32_t n;
    uint64_t deadline_ns, lease_deadline_ns;
    uint64_t lease_id;
    struct kvt_tp_ep *ep;
    struct kvt_tp_rkey *rk;
    struct kvt_wire_chunk *chunks;
    bool *chunk_ok;
    uint32_t n_chunks, next_chunk;
    unsigned batches_in_flight;
    bool failed; /* timed out, link lost or peer down: no more batches, no RELEASE */
};

struct batch {
    struct net_tier *nt;
    uint64_t fetch_id;
    uint32_t first, n;
};

struct inbound { /* a peer's FETCH waiting for the serving loop */
    uint64_t from, from_inc;
    struct kvt_tp_ep *ep; /* NULL once the link closed */
    uint64_t fetch_id;
    struct kvt_key *keys;
    uint32_t n;
    uint64_t arrival_ns;
    struct kvt_req_ctx *ctx; /* after on_new_request */
};

struct lease {
    uint64_t id;
    const struct kvt_job *job;
    uint64_t from;
    struct kvt_tp_ep *ep;
    uint64_t deadline_ns;
};

struct finished {
    kvt_job_id_t job_id;
    bool success;
    struct kvt_key *ok_keys;
    size_t n_ok;
    double seconds;
    int64_t bytes;
};

struct keyvec {
    struct kvt_key *v;
    size_t n, cap;
};

/* Per peer node id (any incarnation): the FETCH window and the per-peer byte counts
 * of get_stats. Created on first use, kept for the tier's life (bounded by the
 * members ever seen). */
struct nt_peer {
    uint64_t node;
    struct kvt_list queue; /* QUEUED fetches, FIFO */
    unsigned active;       /* fetches SENT or READING */
    uint64_t pulled_bytes, served_bytes;
    uint64_t reported_pulled, reported_served;
};

struct net_tier {
    struct kvt_tier base;
    struct kvt_net_tier_config cfg;
    struct kvt_peers *peers;
    struct kvt_primary *primary;
    struct kvt_async_lookup *al;
    struct kvt_directory *dir;
    uint64_t self;

    pthread_mutex_t mu;
    pthread_cond_t cv;
    struct locate_req *lq_head, **lq_tail;
    bool stopping; /* under mu */
    int wake_fd;
    bool woken; /* under mu: wake_fd was written and not yet read (one read a wake,
                   not one read per poll) */

    struct kvt_map locate_ops;   /* id -> locate_op */
    struct kvt_map locate_parts; /* wire id -> locate_part */
    struct kvt_map holders;      /* key -> holder */
    struct kvt_map fetches;      /* id -> fetch */
    struct kvt_map leases;       /* id -> lease */
    struct kvt_map nodes;        /* node id -> nt_peer */
    struct kvt_map published;    /* key -> (void *)1: what we told homes we hold */
    uint64_t next_id;
    uint64_t next_expire_ns, next_dir_expire_ns;

    struct inbound *in;
    size_t n_in, cap_in;
    struct finished *fin;
    size_t n_fin, cap_fin;
    struct keyvec pub, unpub;
    bool republish_all;
    uint64_t next_republish_ns;

    struct kvt_tp_mr *mr_remote, *mr_local;
    uint8_t handle[KVT_TP_MAX_HANDLE_SIZE];
    size_t handle_len;
    bool reg_failed;

    struct kvt_net_tier_counts c, reported;
    bool shut;
};

static struct net_tier *nt_of(struct kvt_tier *t)
{
    return KVT_CONTAINER_OF(t, struct net_tier, base);
}

/* The values of m, for loops whose body may remove the element it is given and no
 * other (removal under kvt_map_next would skip entries). NULL when m is empty or
 * memory is short: the caller's work waits for its next poll. */
static void **nt_values(const struct kvt_map *m, size_t *n_p)
{
    struct kvt_map_entry *e;
    size_t it = 0, n = 0;
    void **v = kvt_map_size(m) ? kvt_malloc(kvt_map_size(m) * sizeof(*v)) : NULL;

    while (v != NULL && kvt_map_next(m, &it, &e))
        v[n++] = e->value;
    *n_p = n;
    return v;
}

static int keyvec_push(struct keyvec *kv, const struct kvt_key *k)
{
    if (kv->n == kv->cap) {
        size_t cap = kv->cap ? kv->cap * 2 : 64;
        struct kvt_key *v = kvt_reallocarray(kv->v, cap, sizeof(*v));

        if (v == NULL)
            return -ENOMEM;
        kv->v = v;
        kv->cap = cap;
    }
    kv->v[kv->n++] = *k;
    return 0;
}

static void keyvec_free(struct keyvec *kv)
{
    kvt_free(kv->v);
    memset(kv, 0, sizeof(*kv));
}

static uint64_t ms_ns(uint32_t ms)
{
    return (uint64_t)ms * MS;
}

/* Home of a key among the live members (self included); 0 when nobody is live. */
static uint64_t nt_home(const struct kvt_key *key, const uint64_t *live, size_t n_live)
{
    long i = kvt_hrw_home(key, live, n_live);

    return i < 0 ? 0 : live[i];
}

static bool nt_holder_live(struct net_tier *nt, const struct holder *h)
{
    return h->node_id != nt->self &&
           kvt_members_is_live(kvt_peers_members(nt->peers), h->node_id, h->incarnation);
}

/* Every message of the tier goes through here: a message that could not be sent is
 * counted and logged (the protocol recovers by timeouts, TTLs and re-publication). */
static int nt_send(struct net_tier *nt, uint64_t node, struct kvt_tp_ep *ep,
                   const struct kvt_wire_msg *m)
{
    int rc = ep != NULL ? kvt_peers_reply(nt->peers, ep, m) : kvt_peers_send(nt->peers, node, m);

    if (rc != 0) {
        nt->c.send_failures++;
        kvt_info(NT_MOD, "%s to %016" PRIx64 " not sent: %s", kvt_wire_type_name((int)m->type),
                 node, strerror(-rc));
    }
    return rc;
}

/* ---- finished jobs ------------------------------------------------------------- */

static int nt_finish_job(struct net_tier *nt, kvt_job_id_t id, bool success,
                         const struct kvt_key *ok_keys, size_t n_ok, double secs, int64_t bytes)
{
    struct finished *f;

    if (nt->n_fin == nt->cap_fin) {
        size_t cap = nt->cap_fin ? nt->cap_fin * 2 : 32;
        struct finished *v = kvt_reallocarray(nt->fin, cap, sizeof(*v));

        if (v == NULL)
            return -ENOMEM;
        nt->fin = v;
        nt->cap_fin = cap;
    }
    f = &nt->fin[nt->n_fin];
    *f = (struct finished){.job_id = id, .success = success, .seconds = secs, .bytes = bytes};
    if (!success && n_ok > 0) {
        f->ok_keys = kvt_malloc(n_ok * sizeof(*ok_keys));
        if (f->ok_keys == NULL)
            n_ok = 0; /* reported as all failed: a lost hit, never a lie */
        else
            memcpy(f->ok_keys, ok_keys, n_ok * sizeof(*ok_keys));
        f->n_ok = n_ok;
    }
    nt->n_fin++;
    return 0;
}

/* ---- the lookup worker --------------------------------------------------------- */

static void lr_unref_locked(struct locate_req *r)
{
    if (--r->refs == 0) {
        kvt_free(r->keys);
        kvt_free(r);
    }
}

static int nt_batch_lookup(void *arg, const struct kvt_key *keys, size_t n,
                           const struct kvt_req_ctx *ctx, bool *found)
{
    struct net_tier *nt = arg;
    struct locate_req *r = kvt_calloc(1, sizeof(*r));
    struct timespec ts;
    uint64_t one = 1, deadline;
    int rc = 0;

    (void)ctx;
    if (r == NULL)
        return -ENOMEM;
    r->keys = kvt_malloc(n * sizeof(*keys));
    r->found = found;
    if (r->keys == NULL) {
        kvt_free(r);
        return -ENOMEM;
    }
    memcpy(r->keys, keys, n * sizeof(*keys));
    r->n = n;
    r->refs = 2;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    deadline = (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec +
               ms_ns(nt->cfg.locate_timeout_ms);
    ts.tv_sec = (time_t)(deadline / 1000000000ull);
    ts.tv_nsec = (long)(deadline % 1000000000ull);

    pthread_mutex_lock(&nt->mu);
    if (nt->stopping) {
        pthread_mutex_unlock(&nt->mu);
        kvt_free(r->keys);
        kvt_free(r);
        return -ECANCELED;
    }
    *nt->lq_tail = r;
    nt->lq_tail = &r->next;
    /* Under mu, so woken says exactly whether the loop has a read to do. */
    if (!nt->woken && write(nt->wake_fd, &one, sizeof(one)) == sizeof(one))
        nt->woken = true; /* a failed write: the loop also polls every step */
    pthread_mutex_unlock(&nt->mu);

    pthread_mutex_lock(&nt->mu);
    while (r->state != LR_DONE && !nt->stopping) {
        if (pthread_cond_timedwait(&nt->cv, &nt->mu, &ts) == ETIMEDOUT)
            break;
    }
    if (r->state != LR_DONE) {
        rc = nt->stopping ? -ECANCELED : -ETIMEDOUT;
        if (r->state == LR_QUEUED) { /* the loop never saw it: unlink, drop its ref */
            struct locate_req **pp = &nt->lq_head;

            while (*pp != r)
                pp = &(*pp)->next;
            *pp = r->next;
            if (nt->lq_tail == &r->next)
                nt->lq_tail = pp;
            r->refs--;
        }
        r->found = NULL; /* the loop must not write into our caller's array now */
    }
    lr_unref_locked(r);
    pthread_mutex_unlock(&nt->mu);
    return rc;
}

/* Loop: the op is answered (or abandoned); hand the verdicts over, drop the op. */
static void nt_locate_op_done(struct net_tier *nt, struct locate_op *op)
{
    pthread_mutex_lock(&nt->mu);
    if (op->req->found != NULL) {
        memcpy(op->req->found, op->found, op->req->n * sizeof(bool));
        op->req->state = LR_DONE;
        pthread_cond_broadcast(&nt->cv);
    }
    lr_unref_locked(op->req);
    pthread_mutex_unlock(&nt->mu);
    kvt_map_remove_u64(&nt->locate_ops, op->id);
    kvt_free(op->found);
    kvt_free(op);
}

/* A holder for key from a list of candidates: the first live one that is not us. */
static bool nt_pick_holder(struct net_tier *nt, const struct kvt_key *key, const struct holder *c,
                           size_t n)
{
    for (size_t i = 0; i < n; i++) {
        struct holder *h;

        if (!nt_holder_live(nt, &c[i]))
            continue;
        h = kvt_map_get(&nt->holders, key->bytes, key->len);
        if (h == NULL) {
            h = kvt_malloc(sizeof(*h));
            if (h == NULL || kvt_map_put(&nt->holders, key->bytes, key->len, h) != 0) {
                kvt_free(h);
                return false;
            }
        }
        *h = c[i];
        return true;
    }
    return false;
}

static void nt_locate_local(struct net_tier *nt, const struct kvt_key *key, bool *found)
{
    struct kvt_dir_holder d[16];
    struct holder c[16];
    size_t n = kvt_directory_locate(nt->dir, key, kvt_now_ns(), d,
                                    KVT_MIN(KVT_ARRAY_SIZE(d), nt->cfg.max_holders));

    for (size_t i = 0; i < n; i++)
        c[i] = (struct holder){d[i].node_id, d[i].incarnation};
    *found = nt_pick_holder(nt, key, c, n);
}

static void nt_take_locates(struct net_tier *nt)
{
    struct locate_req *list;
    uint64_t live[NT_MAX_NODES];
    size_t n_live;

    pthread_mutex_lock(&nt->mu);
    if (nt->woken) {
        uint64_t one;

        if (read(nt->wake_fd, &one, sizeof(one)) < 0) { /* EAGAIN: already read */
        }
        nt->woken = false;
    }
    list = nt->lq_head;
    nt->lq_head = NULL;
    nt->lq_tail = &nt->lq_head;
    for (struct locate_req *r = list; r != NULL; r = r->next)
        r->state = LR_TAKEN;
    pthread_mutex_unlock(&nt->mu);
    if (list == NULL)
        return;
    n_live = kvt_peers_live(nt->peers, live, NT_MAX_NODES);

    while (list != NULL) {
        struct locate_req *r = list;
        struct locate_op *op = kvt_calloc(1, sizeof(*op));
        uint64_t homes[NT_KEYS_PER_MSG];

        list = r->next;
        r->next = NULL;
        if (op != NULL)
            op->found = kvt_calloc(r->n ? r->n : 1, sizeof(bool));
        if (op == NULL || op->found == NULL ||
            kvt_map_put_u64(&nt->locate_ops, nt->next_id, op) != 0) {
            if (op != NULL)
                kvt_free(op->found);
            kvt_free(op);
            pthread_mutex_lock(&nt->mu);
            lr_unref_locked(r); /* the worker times out: every key not found */
            pthread_mutex_unlock(&nt->mu);
            continue;
        }
        op->id = nt->next_id++;
        op->req = r;
        op->deadline_ns = kvt_now_ns() + ms_ns(nt->cfg.locate_timeout_ms);
        nt->c.locates += r->n;

        /* Keys in chunks of NT_KEYS_PER_MSG; each chunk grouped by home. */
        for (size_t base = 0; base < r->n; base += NT_KEYS_PER_MSG) {
            size_t m = KVT_MIN((size_t)NT_KEYS_PER_MSG, r->n - base);
            bool used[NT_KEYS_PER_MSG] = {false};

            for (size_t i = 0; i < m; i++)
                homes[i] = nt_home(&r->keys[base + i], live, n_live);
            for (size_t i = 0; i < m; i++) {
                struct locate_part *pt;
                struct kvt_wire_msg msg;
                struct kvt_key ks[NT_KEYS_PER_MSG];
                uint64_t home = homes[i];

                if (used[i])
                    continue;
                if (home == nt->self || home == 0) {
                    used[i] = true;
                    if (home == nt->self)
                        nt_locate_local(nt, &r->keys[base + i], &op->found[base + i]);
                    continue;
                }
                pt = kvt_calloc(1, sizeof(*pt));
                if (pt != NULL)
                    pt->idx = kvt_malloc(m * sizeof(uint32_t));
                if (pt == NULL || pt->idx == NULL) {
                    if (pt != NULL)
                        kvt_free(pt->idx);
                    kvt_free(pt);
                    used[i] = true;
                    continue;
                }
                for (size_t j = i; j < m; j++) {
                    if (!used[j] && homes[j] == home) {
                        used[j] = true;
                        ks[pt->n] = r->keys[base + j];
                        pt->idx[pt->n++] = (uint32_t)(base + j);
                    }
                }
                pt->wire_id = nt->next_id++;
                pt->op = op;
                pt->node = home;
                pt->sent_ns = kvt_now_ns();
                kvt_wire_msg_init(&msg, KVT_WIRE_LOCATE);
                msg.u.locate.req_id = pt->wire_id;
                msg.u.locate.n_keys = pt->n;
                msg.u.locate.keys = ks;
                if (nt_send(nt, home, NULL, &msg) != 0 ||
                    kvt_map_put_u64(&nt->locate_parts, pt->wire_id, pt) != 0) {
                    kvt_free(pt->idx); /* those keys stay not found */
                    kvt_free(pt);
                    continue;
                }
                op->parts_pending++;
            }
        }
        if (op->parts_pending == 0)
            nt_locate_op_done(nt, op);
    }
}

static void nt_part_free(struct net_tier *nt, struct locate_part *pt)
{
    kvt_map_remove_u64(&nt->locate_parts, pt->wire_id);
    kvt_free(pt->idx);
    kvt_free(pt);
}

static void nt_on_locate_reply(struct net_tier *nt, uint64_t from, const struct kvt_wire_msg *m)
{
    const struct kvt_wire_locate_reply *lr = &m->u.locate_reply;
    struct locate_part *pt = kvt_map_get_u64(&nt->locate_parts, lr->req_id);
    struct locate_op *op;

    if (pt == NULL || pt->node != from || lr->n_keys != pt->n) {
        nt->c.refused++;
        return;
    }
    op = pt->op;
    nt->c.locate_rtts++;
    nt->c.locate_rtt_ns += kvt_now_ns() - pt->sent_ns;
    for (uint32_t i = 0; i < pt->n; i++) {
        const struct kvt_wire_holder_list *hl = &lr->holders[i];
        struct holder c[16];
        size_t n = KVT_MIN((size_t)hl->n, KVT_ARRAY_SIZE(c));

        for (size_t j = 0; j < n; j++)
            c[j] = (struct holder){hl->v[j].node_id, hl->v[j].incarnation};
        op->found[pt->idx[i]] = nt_pick_holder(nt, &op->req->keys[pt->idx[i]], c, n);
    }
    nt_part_free(nt, pt);
    if (--op->parts_pending == 0)
        nt_locate_op_done(nt, op);
}

static void nt_expire_locates(struct net_tier *nt, uint64_t now)
{
    size_t n;
    void **parts = nt_values(&nt->locate_parts, &n);

    for (size_t i = 0; i < n; i++) {
        struct locate_part *pt = parts[i];
        struct locate_op *op = pt->op;

        if (now < op->deadline_ns)
            continue;
        nt->c.locate_timeouts++;
        nt_part_free(nt, pt);
        if (--op->parts_pending == 0) /* its other parts were freed before */
            nt_locate_op_done(nt, op);
    }
    kvt_free(parts);
}

/* ---- home side: directory ------------------------------------------------------ */

static void nt_on_publish(struct net_tier *nt, uint64_t from, struct kvt_tp_ep *ep,
                          const struct kvt_wire_msg *m)
{
    const struct kvt_wire_publish *p = &m->u.publish;
    uint64_t id, inc;

    if (kvt_peers_link_peer(nt->peers, ep, &id, &inc) != 0 || p->node_id != from ||
        p->incarnation != inc) {
        nt->c.refused++; /* a node speaks only for itself, in its current life */
        return;
    }
    if (m->type == KVT_WIRE_PUBLISH)
        kvt_directory_publish(nt->dir, from, inc, p->keys, p->n_keys, kvt_now_ns());
    else
        kvt_directory_unpublish(nt->dir, from, inc, p->keys, p->n_keys);
}

static void nt_on_locate(struct net_tier *nt, struct kvt_tp_ep *ep, const struct kvt_wire_msg *m)
{
    const struct kvt_wire_locate *l = &m->u.locate;
    struct kvt_wire_holder_list *hl = kvt_calloc(l->n_keys ? l->n_keys : 1, sizeof(*hl));
    struct kvt_wire_holder *hv =
        kvt_calloc((size_t)(l->n_keys ? l->n_keys : 1) * nt->cfg.max_holders, sizeof(*hv));
    struct kvt_dir_holder d[16];
    struct kvt_wire_msg r;
    uint64_t now = kvt_now_ns();

    if (hl == NULL || hv == NULL)
        goto out;
    for (uint32_t i = 0; i < l->n_keys; i++) {
        size_t n = kvt_directory_locate(nt->dir, &l->keys[i], now, d,
                                        KVT_MIN(KVT_ARRAY_SIZE(d), nt->cfg.max_holders));

        hl[i].v = &hv[(size_t)i * nt->cfg.max_holders];
        for (size_t j = 0; j < n; j++) {
            if (!kvt_members_is_live(kvt_peers_members(nt->peers), d[j].node_id,
                                     d[j].incarnation) &&
                d[j].node_id != nt->self)
                continue;
            hl[i].v[hl[i].n++] = (struct kvt_wire_holder){d[j].node_id, d[j].incarnation};
        }
    }
    kvt_wire_msg_init(&r, KVT_WIRE_LOCATE_REPLY);
    r.u.locate_reply.req_id = l->req_id;
    r.u.locate_reply.n_keys = l->n_keys;
    r.u.locate_reply.holders = hl;
    if (nt_send(nt, 0, ep, &r) != 0)
        kvt_debug(NT_MOD, "LOCATE_REPLY not sent (the requester times out)");
out:
    kvt_free(hl);
    kvt_free(hv);
}

/* ---- holder side: publish / unpublish ------------------------------------------ */

static void nt_on_removed(void *arg, const struct kvt_key *keys, size_t n)
{
    struct net_tier *nt = arg;

    if (keys == NULL) { /* reset_cache: everything */
        struct kvt_map_entry *e;
        size_t it = 0;

        while (kvt_map_next(&nt->published, &it, &e)) {
            struct kvt_key k;

            k.len = e->key_len;
            memcpy(k.bytes, e->key, e->key_len);
            if (keyvec_push(&nt->unpub, &k) != 0)
                break; /* the records age out with their TTL */
        }
        kvt_map_clear(&nt->published);
        return;
    }
    for (size_t i = 0; i < n; i++) {
        if (kvt_map_remove(&nt->published, keys[i].bytes, keys[i].len) != NULL &&
            keyvec_push(&nt->unpub, &keys[i]) != 0)
            kvt_warn(NT_MOD, "out of memory: an unpublish was lost (its record ages out)");
    }
}

static void nt_send_keys(struct net_tier *nt, uint64_t home, enum kvt_wire_type type,
                         const struct kvt_key *ks, size_t n)
{
    uint64_t inc = kvt_peers_incarnation(nt->peers);
    struct kvt_wire_msg m;

    if (home == nt->self) {
        if (type == KVT_WIRE_PUBLISH)
            kvt_directory_publish(nt->dir, nt->self, inc, ks, n, kvt_now_ns());
        else
            kvt_directory_unpublish(nt->dir, nt->self, inc, ks, n);
        return;
    }
    if (home == 0)
        return;
    kvt_wire_msg_init(&m, type);
    m.u.publish.node_id = nt->self;
    m.u.publish.incarnation = inc;
    m.u.publish.n_keys = (uint32_t)n;
    m.u.publish.keys = (struct kvt_key *)ks;
    /* A home we cannot reach now gets the keys at the next membership change. */
    (void)nt_send(nt, home, NULL, &m);
}

/* Sends the keys of kv to their homes as PUBLISH or UNPUBLISH; empties kv. */
static void nt_flush_keys(struct net_tier *nt, struct keyvec *kv, enum kvt_wire_type type)
{
    uint64_t live[NT_MAX_NODES];
    size_t n_live;
    uint64_t *homes;
    bool *used;

    if (kv->n == 0)
        return;
    n_live = kvt_peers_live(nt->peers, live, NT_MAX_NODES);
    homes = kvt_malloc(kv->n * sizeof(*homes));
    used = kvt_calloc(kv->n, sizeof(*used));
    if (homes == NULL || used == NULL)
        goto out;
    for (size_t i = 0; i < kv->n; i++)
        homes[i] = nt_home(&kv->v[i], live, n_live);
    for (size_t i = 0; i < kv->n; i++) {
        struct kvt_key ks[NT_KEYS_PER_MSG];
        size_t n = 0;

        if (used[i])
            continue;
        for (size_t j = i; j < kv->n; j++) {
            if (used[j] || homes[j] != homes[i])
                continue;
            used[j] = true;
            ks[n++] = kv->v[j];
            if (n == NT_KEYS_PER_MSG) {
                nt_send_keys(nt, homes[i], type, ks, n);
                n = 0;
            }
        }
        if (n > 0)
            nt_send_keys(nt, homes[i], type, ks, n);
    }
out:
    kvt_free(homes);
    kvt_free(used);
    kv->n = 0;
}

static bool nt_homed_here(void *arg, const struct kvt_key *key)
{
    struct net_tier *nt = arg;
    uint64_t live[NT_MAX_NODES];
    size_t n_live = kvt_peers_live(nt->peers, live, NT_MAX_NODES);

    return nt_home(key, live, n_live) == nt->self;
}

static void nt_flush_publishes(struct net_tier *nt)
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
        nt->pub.n = 0; /* all of them follow */
        while (kvt_map_next(&nt->published, &it, &e)) {
            struct kvt_key k;

            k.len = e->key_len;
            memcpy(k.bytes, e->key, e->key_len);
            if (keyvec_push(&nt->pub, &k) != 0)
                break;
        }
        kvt_directory_retain(nt->dir, nt_homed_here, nt);
    }
    nt_flush_keys(nt, &nt->unpub, KVT_WIRE_UNPUBLISH);
    nt_flush_keys(nt, &nt->pub, KVT_WIRE_PUBLISH);
    /* A scan of every record: once a second (locate checks each record's expiry
     * anyway; this only frees them). */
    if (now >= nt->next_dir_expire_ns) {
        nt->next_dir_expire_ns = now + 1000 * MS;
        kvt_directory_expire(nt->dir, now);
    }
}

/* ---- per-peer state ------------------------------------------------------------ */

static struct nt_peer *nt_peer_get(struct net_tier *nt, uint64_t node)
{
    struct nt_peer *p = kvt_map_get_u64(&nt->nodes, node);

    if (p != NULL)
        return p;
    p = kvt_calloc(1, sizeof(*p));
    if (p == NULL)
        return NULL;
    p->node = node;
    kvt_list_init(&p->queue);
    if (kvt_map_put_u64(&nt->nodes, node, p) != 0) {
        kvt_free(p);
        return NULL;
    }
    return p;
}

/* ---- requester side: FETCH, READ, verify, RELEASE ------------------------------- */

static void nt_load_part_done(struct net_tier *nt, struct load_job *lj)
{
    const struct kvt_job *job = lj->job;
    struct kvt_key *ok_keys;
    size_t n_ok = 0, n_bad = 0;

    if (--lj->parts_pending > 0)
        return;
    ok_keys = kvt_malloc((job->n ? job->n : 1) * sizeof(*ok_keys));
    for (size_t i = 0; i < job->n; i++) {
        if (lj->ok[i]) {
            if (ok_keys != NULL)
                ok_keys[n_ok++] = job->keys[i];
            continue;
        }
        n_bad++;
        /* Seed livelock rule: a failed load makes the verdict MISS, and this holder
         * is not asked again for the key. */
        kvt_async_lookup_mark_miss(nt->al, &job->keys[i], 1);
        kvt_free(kvt_map_remove(&nt->holders, job->keys[i].bytes, job->keys[i].len));
    }
    if (ok_keys == NULL) /* cannot list them: report every key failed */
        n_ok = 0, n_bad = job->n;
    nt_finish_job(nt, job->id, n_bad == 0, ok_keys, n_ok,
                  (double)(kvt_now_ns() - lj->start_ns) * 1e-9, (int64_t)lj->bytes);
    kvt_free(ok_keys);
    kvt_free(lj->ok);
    kvt_free(lj);
}

static void nt_fetch_free(struct net_tier *nt, struct fetch *f)
{
    kvt_map_remove_u64(&nt->fetches, f->id);
    if (f->rk != NULL)
        kvt_tp_rkey_destroy(kvt_peers_transport(nt->peers), f->rk);
    kvt_free(f->idx);
    kvt_free(f->chunks);
    kvt_free(f->chunk_ok);
    kvt_free(f);
}

/* Ends a fetch once nothing of it is in flight: verdicts, RELEASE, job part. */
static void nt_fetch_end(struct net_tier *nt, struct fetch *f)
{
    struct load_job *lj = f->lj;
    uint64_t now = kvt_now_ns();
    bool in_time = now < f->lease_deadline_ns && now < f->deadline_ns;

    if (f->batches_in_flight > 0)
        return;
    if (f->state == F_QUEUED) {
        kvt_list_del(&f->qnode);
    } else {
        struct nt_peer *p = kvt_map_get_u64(&nt->nodes, f->node);

        /* The window opens; nt_pump sends the next one from the loop's top level. */
        if (p != NULL && p->active > 0)
            p->active--;
    }
    if (f->state == F_READING) {
        if (!f->failed && !in_time) {
            nt->c.lease_expiries++; /* read too late: the slot may have been reused */
            f->failed = true;
        }
        struct nt_peer *p = kvt_map_get_u64(&nt->nodes, f->node);

        for (uint32_t i = 0; i < f->n_chunks; i++) {
            if (f->failed || !f->chunk_ok[i])
                continue;
            lj->ok[f->idx[f->chunks[i].key_index]] = true;
            lj->bytes += f->chunks[i].length;
            nt->c.pulled_chunks++;
            nt->c.pulled_bytes += f->chunks[i].length;
            if (p != NULL)
                p->pulled_bytes += f->chunks[i].length;
        }
        if (f->grant_ns != 0)
            nt->c.read_ns += now - f->grant_ns;
        if (f->ep != NULL) {
            struct kvt_wire_msg m;

            kvt_wire_msg_init(&m, KVT_WIRE_RELEASE);
            m.u.release.job_id = f->id;
            m.u.release.lease_id = f->lease_id;
            /* Lost RELEASE: the holder's lease expires on its own. */
            (void)nt_send(nt, f->node, f->ep, &m);
        }
    }
    if (f->failed)
        nt->c.failed_fetches++;
    nt_fetch_free(nt, f);
    nt_load_part_done(nt, lj);
}

static void nt_read_done(void *arg, int status)
{
    struct batch *b = arg;
    struct net_tier *nt = b->nt;
    struct fetch *f = kvt_map_get_u64(&nt->fetches, b->fetch_id);

    if (f != NULL) {
        f->batches_in_flight--;
        for (uint32_t i = b->first; i < b->first + b->n; i++) {
            const struct kvt_wire_chunk *ch = &f->chunks[i];
            const struct kvt_job *job = f->lj->job;
            uint32_t ki = f->idx[ch->key_index]; /* the key's place in the job */
            const uint8_t *row =
                nt->base.primary_base + (size_t)job->chunk_ids[ki] * nt->base.row_bytes;

            uint64_t h, t0;

            if (status != 0)
                continue;
            t0 = kvt_now_ns();
            h = kvt_hash64(row, ch->length);
            nt->c.verify_ns += kvt_now_ns() - t0;
            if (h == ch->checksum) {
                f->chunk_ok[i] = true;
                /* The primary then need not hash the row again when the promotion
                 * completes (checksum_on_complete). */
                (void)kvt_primary_set_checksum(nt->primary, &job->keys[ki], h);
            } else {
                nt->c.checksum_failures++; /* torn or stale read: never loaded */
                kvt_warn(NT_MOD, "checksum mismatch on a chunk from %016" PRIx64 " (gen %u)",
                         f->node, ch->generation);
            }
        }
        if (status != 0 && !f->failed) {
            kvt_info(NT_MOD, "READ from %016" PRIx64 " failed: %s", f->node, strerror(-status));
            f->failed = true;
        }
        if (f->batches_in_flight == 0 && (f->failed || f->next_chunk == f->n_chunks))
            nt_fetch_end(nt, f);
    }
    kvt_free(b);
}

static void nt_post_reads(struct net_tier *nt, struct fetch *f)
{
    struct kvt_read_op ops[256];
    unsigned per = KVT_MIN(nt->cfg.max_ops_per_batch, (unsigned)KVT_ARRAY_SIZE(ops));

    while (!f->failed && f->next_chunk < f->n_chunks) {
        uint32_t n = KVT_MIN(per, f->n_chunks - f->next_chunk);
        struct batch *b = kvt_malloc(sizeof(*b));
        int rc;

        if (b == NULL)
            break; /* retried at the next poll */
        for (uint32_t i = 0; i < n; i++) {
            const struct kvt_wire_chunk *ch = &f->chunks[f->next_chunk + i];

            ops[i].remote_off = ch->offset;
            ops[i].local_off =
                (uint64_t)f->lj->job->chunk_ids[f->idx[ch->key_index]] * nt->base.row_bytes;
            ops[i].len = ch->length;
        }
        *b = (struct batch){.nt = nt, .fetch_id = f->id, .first = f->next_chunk, .n = n};
        rc = kvt_tp_read(f->ep, f->rk, nt->mr_local, ops, n, nt_read_done, b);
        if (rc == -EINPROGRESS)
            rc = 0; /* posted: nt_read_done follows */
        if (rc == -EAGAIN) {
            kvt_free(b);
            break;
        }
        if (rc != 0) {
            kvt_free(b);
            kvt_info(NT_MOD, "READ not posted to %016" PRIx64 ": %s", f->node, strerror(-rc));
            f->failed = true;
            break;
        }
        f->batches_in_flight++;
        f->next_chunk += n;
    }
    if (f->batches_in_flight == 0 && (f->failed || f->next_chunk == f->n_chunks))
        nt_fetch_end(nt, f);
}

static bool nt_register(struct net_tier *nt)
{
    struct kvt_transport *tp = kvt_peers_transport(nt->peers);
    size_t len = nt->base.num_chunks * nt->base.row_bytes;
    int rc;

    if (nt->mr_remote != NULL)
        return true;
    if (nt->reg_failed || nt->base.primary_base == NULL || len == 0)
        return false;
    rc = kvt_tp_reg_remote(tp, nt->base.primary_base, len, &nt->mr_remote);
    if (rc == 0)
        rc = kvt_tp_reg_local(tp, nt->base.primary_base, len, &nt->mr_local);
    if (rc == 0)
        rc = kvt_tp_pack(tp, nt->mr_remote, nt->handle, sizeof(nt->handle), &nt->handle_len);
    if (rc != 0) {
        kvt_error(NT_MOD, "cannot register the primary region (%zu bytes): %s", len, strerror(-rc));
        nt->reg_failed = true;
        return false;
    }
    return true;
}

static void nt_on_grant(struct net_tier *nt, uint64_t from, struct kvt_tp_ep *ep,
                        const struct kvt_wire_msg *m)
{
    const struct kvt_wire_grant *g = &m->u.grant;
    struct fetch *f = kvt_map_get_u64(&nt->fetches, g->job_id);
    size_t row = nt->base.row_bytes;
    bool *seen;
    int rc;

    if (f == NULL || f->node != from || f->state != F_SENT || f->failed) {
        nt->c.refused++;
        return;
    }
    seen = kvt_calloc(f->n ? f->n : 1, sizeof(*seen));
    if (seen == NULL)
        goto fail;
    for (uint32_t i = 0; i < g->n_chunks; i++) {
        const struct kvt_wire_chunk *ch = &g->chunks[i];

        if (ch->key_index >= f->n || seen[ch->key_index] || ch->length != row) {
            kvt_warn(NT_MOD, "GRANT from %016" PRIx64 " names chunk %u wrongly: refused", from,
                     ch->key_index);
            nt->c.refused++;
            kvt_free(seen);
            goto fail;
        }
        seen[ch->key_index] = true;
    }
    kvt_free(seen);
    nt->c.grants++;
    f->grant_ns = kvt_now_ns();
    nt->c.grant_wait_ns += f->grant_ns - f->sent_ns;
    f->lease_id = g->lease_id;
    /* The lease started after our FETCH left: timing it from then errs early. */
    f->lease_deadline_ns = kvt_now_ns() + ms_ns(g->lease_ttl_ms);
    f->ep = ep;
    f->state = F_READING;
    if (g->n_chunks == 0) {
        nt_fetch_end(nt, f);
        return;
    }
    f->chunks = kvt_malloc(g->n_chunks * sizeof(*f->chunks));
    f->chunk_ok = kvt_calloc(g->n_chunks, sizeof(bool));
    if (f->chunks == NULL || f->chunk_ok == NULL || !nt_register(nt))
        goto fail_reading;
    memcpy(f->chunks, g->chunks, g->n_chunks * sizeof(*f->chunks));
    f->n_chunks = g->n_chunks;
    rc = kvt_tp_unpack(ep, g->handle, g->handle_len, &f->rk);
    if (rc != 0) {
        kvt_warn(NT_MOD, "GRANT from %016" PRIx64 ": region handle refused: %s", from,
                 strerror(-rc));
        nt->c.refused++;
        goto fail_reading;
    }
    nt_post_reads(nt, f);
    return;
fail_reading:
    f->failed = true;
    nt_fetch_end(nt, f);
    return;
fail:
    f->failed = true;
    f->state = F_READING; /* nothing granted is read; RELEASE still frees the pins */
    f->n_chunks = 0;
    f->ep = ep;
    f->lease_id = g->lease_id;
    nt_fetch_end(nt, f);
}

static void nt_on_deny(struct net_tier *nt, uint64_t from, const struct kvt_wire_msg *m)
{
    struct fetch *f = kvt_map_get_u64(&nt->fetches, m->u.deny.job_id);

    if (f == NULL || f->node != from || f->state != F_SENT) {
        nt->c.refused++;
        return;
    }
    nt->c.denies++;
    nt_fetch_end(nt, f); /* every key of this part fails */
}

/* Sends p's queued fetches while fewer than fetches_per_peer of its fetches are out.
 * Only from the loop's top level (nt_progress, nt_submit_load): a send that fails
 * ends a fetch, which must not happen inside a walk over the fetches. */
static void nt_pump_peer(struct net_tier *nt, struct nt_peer *p)
{
    while (!kvt_list_empty(&p->queue) && p->active < nt->cfg.fetches_per_peer) {
        struct fetch *f = kvt_list_entry(p->queue.next, struct fetch, qnode);
        const struct kvt_job *job = f->lj->job;
        struct kvt_key ks[NT_KEYS_PER_MSG];
        struct kvt_wire_msg m;

        kvt_list_del(&f->qnode);
        f->state = F_SENT;
        p->active++;
        f->sent_ns = kvt_now_ns();
        nt->c.fetch_queue_ns += f->sent_ns - f->queued_ns;
        f->deadline_ns = f->sent_ns + ms_ns(nt->cfg.fetch_timeout_ms);
        f->lease_deadline_ns = f->deadline_ns;
        for (uint32_t i = 0; i < f->n; i++)
            ks[i] = job->keys[f->idx[i]];
        kvt_wire_msg_init(&m, KVT_WIRE_FETCH);
        m.u.fetch.job_id = f->id;
        m.u.fetch.n_keys = f->n;
        m.u.fetch.keys = ks;
        nt->c.fetches++;
        if (nt_send(nt, f->node, NULL, &m) != 0) {
            f->failed = true;
            nt_fetch_end(nt, f);
        }
    }
}

static void nt_pump(struct net_tier *nt)
{
    struct kvt_map_entry *e;
    size_t it = 0;

    /* Ending fetches never adds or removes nodes: a plain walk is safe. */
    while (kvt_map_next(&nt->nodes, &it, &e))
        nt_pump_peer(nt, e->value);
}

/* A load job becomes fetches of at most keys_per_fetch keys per holder, queued on
 * their peer; each peer has at most fetches_per_peer of them out, so READs of one
 * fetch overlap the FETCH/GRANT round trip of the next, every fetch's READs end well
 * inside its lease however big the job, and the holder pins only what is in flight. */
static void nt_submit_load(struct kvt_tier *t, const struct kvt_job *job)
{
    struct net_tier *nt = nt_of(t);
    struct load_job *lj = kvt_calloc(1, sizeof(*lj));
    uint32_t *idx = NULL;
    bool *used = NULL;
    uint32_t per = KVT_MIN(nt->cfg.keys_per_fetch, (unsigned)NT_KEYS_PER_MSG);

    if (lj == NULL || (lj->ok = kvt_calloc(job->n ? job->n : 1, sizeof(bool))) == NULL)
        goto fail;
    idx = kvt_malloc((job->n ? job->n : 1) * sizeof(*idx));
    used = kvt_calloc(job->n ? job->n : 1, sizeof(*used));
    if (idx == NULL || used == NULL)
        goto fail;
    lj->job = job;
    lj->start_ns = kvt_now_ns();
    lj->parts_pending = 1; /* ours, dropped at the end: parts may end synchronously */
    for (size_t i = 0; i < job->n; i++) {
        const struct holder *h = kvt_map_get(&nt->holders, job->keys[i].bytes, job->keys[i].len);
        struct holder hh;
        struct nt_peer *p;
        struct fetch *f;
        uint32_t n = 0;

        if (used[i])
            continue;
        if (h == NULL || !nt_holder_live(nt, h)) {
            used[i] = true; /* no live holder: this key fails */
            continue;
        }
        hh = *h;
        for (size_t j = i; j < job->n && n < per; j++) {
            const struct holder *hj;

            if (used[j])
                continue;
            hj = kvt_map_get(&nt->holders, job->keys[j].bytes, job->keys[j].len);
            if (hj == NULL || hj->node_id != hh.node_id || hj->incarnation != hh.incarnation)
                continue;
            used[j] = true;
            idx[n++] = (uint32_t)j;
        }
        p = nt_peer_get(nt, hh.node_id);
        f = p != NULL ? kvt_calloc(1, sizeof(*f)) : NULL;
        if (f == NULL || (f->idx = kvt_malloc(n * sizeof(*idx))) == NULL) {
            kvt_free(f); /* these keys fail */
            continue;
        }
        memcpy(f->idx, idx, n * sizeof(*idx));
        f->n = n;
        f->id = nt->next_id++;
        f->lj = lj;
        f->node = hh.node_id;
        f->incarnation = hh.incarnation;
        f->state = F_QUEUED;
        f->queued_ns = kvt_now_ns();
        if (kvt_map_put_u64(&nt->fetches, f->id, f) != 0) {
            kvt_free(f->idx);
            kvt_free(f);
            continue;
        }
        kvt_list_add_tail(&p->queue, &f->qnode);
        lj->parts_pending++;
    }
    kvt_free(idx);
    kvt_free(used);
    nt_pump(nt);
    nt_load_part_done(nt, lj);
    return;
fail:
    kvt_free(idx);
    kvt_free(used);
    if (lj != NULL)
        kvt_free(lj->ok);
    kvt_free(lj);
    nt_finish_job(nt, job->id, false, NULL, 0, -1, -1);
}

/* Fails every fetch to node (any incarnation older than keep_from) not yet reading;
 * those reading end when their batches complete (the transport fails them). */
static void nt_fail_fetches(struct net_tier *nt, uint64_t node, uint64_t keep_from,
                            struct kvt_tp_ep *ep)
{
    size_t n;
    void **fs = nt_values(&nt->fetches, &n);

    for (size_t i = 0; i < n; i++) {
        struct fetch *f = fs[i];
        bool hit = ep != NULL ? f->ep == ep : (f->node == node && f->incarnation < keep_from);

        if (!hit || f->failed)
            continue;
        f->failed = true;
        if (ep != NULL)
            f->ep = NULL; /* the link is gone: no RELEASE on it */
        if (f->batches_in_flight == 0)
            nt_fetch_end(nt, f);
    }
    kvt_free(fs);
}

static void nt_expire_fetches(struct net_tier *nt, uint64_t now)
{
    size_t n;
    void **fs = nt_values(&nt->fetches, &n);

    for (size_t i = 0; i < n; i++) {
        struct fetch *f = fs[i];

        if (f->failed || f->state == F_QUEUED) /* no deadline before it is sent */
            continue;
        if (now >= f->deadline_ns) {
            f->failed = true;
            kvt_info(NT_MOD, "fetch %" PRIu64 " from %016" PRIx64 " timed out", f->id, f->node);
            if (f->batches_in_flight == 0)
                nt_fetch_end(nt, f);
        } else if (f->state == F_READING && f->next_chunk < f->n_chunks) {
            nt_post_reads(nt, f); /* -EAGAIN earlier: room now? */
        }
    }
    kvt_free(fs);
}

/* ---- holder side: serving FETCH through the parent ------------------------------ */

static void nt_lease_end(struct net_tier *nt, struct lease *l, bool expired)
{
    if (expired)
        nt->c.lease_expiries++;
    kvt_map_remove_u64(&nt->leases, l->id);
    nt_finish_job(nt, l->job->id, true, NULL, 0, -1, -1); /* unpins */
    kvt_free(l);
}

static void nt_on_release(struct net_tier *nt, uint64_t from, const struct kvt_wire_msg *m)
{
    struct lease *l = kvt_map_get_u64(&nt->leases, m->u.release.lease_id);

    if (l == NULL || l->from != from) {
        nt->c.refused++; /* also a RELEASE after its lease expired */
        return;
    }
    nt_lease_end(nt, l, false);
}

static void nt_reap_leases(struct net_tier *nt, uint64_t node, struct kvt_tp_ep *ep)
{
    size_t n;
    void **ls = nt_values(&nt->leases, &n);

    for (size_t i = 0; i < n; i++) {
        struct lease *l = ls[i];

        if (ep != NULL ? l->ep != ep : l->from != node)
            continue;
        nt->c.leases_reaped++;
        nt_lease_end(nt, l, false);
    }
    kvt_free(ls);
}

static void nt_expire_leases(struct net_tier *nt, uint64_t now)
{
    size_t n;
    void **ls = nt_values(&nt->leases, &n);

    for (size_t i = 0; i < n; i++) {
        struct lease *l = ls[i];

        if (now >= l->deadline_ns)
            nt_lease_end(nt, l, true);
    }
    kvt_free(ls);
}

static void nt_on_fetch(struct net_tier *nt, uint64_t from, struct kvt_tp_ep *ep,
                        const struct kvt_wire_msg *m)
{
    struct inbound *in;
    uint64_t id, inc;

    if (kvt_peers_link_peer(nt->peers, ep, &id, &inc) != 0)
        return;
    if (nt->n_in == nt->cap_in) {
        size_t cap = nt->cap_in ? nt->cap_in * 2 : 16;
        struct inbound *v = kvt_reallocarray(nt->in, cap, sizeof(*v));

        if (v == NULL)
            goto busy;
        nt->in = v;
        nt->cap_in = cap;
    }
    in = &nt->in[nt->n_in];
    *in = (struct inbound){.from = from,
                           .from_inc = inc,
                           .ep = ep,
                           .fetch_id = m->u.fetch.job_id,
                           .n = m->u.fetch.n_keys,
                           .arrival_ns = kvt_now_ns()};
    in->keys = kvt_malloc((in->n ? in->n : 1) * sizeof(*in->keys));
    if (in->keys == NULL)
        goto busy;
    memcpy(in->keys, m->u.fetch.keys, in->n * sizeof(*in->keys));
    nt->n_in++;
    return;
busy : {
    struct kvt_wire_msg d;

    kvt_wire_msg_init(&d, KVT_WIRE_DENY);
    d.u.deny.job_id = m->u.fetch.job_id;
    d.u.deny.reason = KVT_WIRE_R_BUSY;
    (void)nt_send(nt, 0, ep, &d);
}
}

static void nt_send_deny(struct net_tier *nt, struct inbound *in, uint32_t reason)
{
    struct kvt_wire_msg d;

    if (in->ep == NULL)
        return;
    kvt_wire_msg_init(&d, KVT_WIRE_DENY);
    d.u.deny.job_id = in->fetch_id;
    d.u.deny.reason = reason;
    (void)nt_send(nt, in->from, in->ep, &d);
}

/* One parked FETCH: true when it is answered (and can be dropped). */
static bool nt_serve_one(struct net_tier *nt, struct kvt_parent *parent, struct inbound *in,
                         uint64_t now)
{
    enum kvt_lookup_result *res;
    struct kvt_key *hit_keys = NULL;
    uint32_t *hit_idx = NULL, *denied = NULL;
    struct kvt_wire_chunk *chunks = NULL;
    uint32_t n_hit = 0, n_denied = 0;
    bool waiting = false;
    const struct kvt_job *job = NULL;

    if (in->ep == NULL || nt->shut) { /* requester gone, or we are stopping */
        if (nt->shut)
            nt_send_deny(nt, in, KVT_WIRE_R_SHUTDOWN);
        goto done;
    }
    if (in->ctx == NULL) {
        char id[64];
        enum kvt_offload_policy pol;

        snprintf(id, sizeof(id), "net-%016" PRIx64 "-%" PRIu64, in->from, in->fetch_id);
        if (kvt_req_ctx_create(id, NULL, &in->ctx) != 0) {
            nt_send_deny(nt, in, KVT_WIRE_R_BUSY);
            goto done;
        }
        if (kvt_parent_on_new_request(parent, in->ctx, &pol) != 0) {
            nt_send_deny(nt, in, KVT_WIRE_R_BUSY);
            goto done;
        }
    }
    res = kvt_malloc(in->n * sizeof(*res) + 1);
    hit_keys = kvt_malloc((in->n + 1) * sizeof(*hit_keys));
    hit_idx = kvt_malloc((in->n + 1) * sizeof(*hit_idx));
    denied = kvt_malloc((in->n + 1) * sizeof(*denied));
    chunks = kvt_malloc((in->n + 1) * sizeof(*chunks));
    if (res == NULL || hit_keys == NULL || hit_idx == NULL || denied == NULL || chunks == NULL) {
        kvt_free(res);
        nt_send_deny(nt, in, KVT_WIRE_R_BUSY);
        goto finish;
    }
    for (uint32_t i = 0; i < in->n; i++) {
        res[i] = kvt_parent_lookup(parent, &in->keys[i], in->ctx);
        if (res[i] == KVT_RETRY || res[i] == KVT_HIT_PENDING)
            waiting = true;
    }
    if (waiting && now < in->arrival_ns + ms_ns(nt->cfg.park_timeout_ms)) {
        kvt_free(res);
        kvt_free(hit_keys);
        kvt_free(hit_idx);
        kvt_free(denied);
        kvt_free(chunks);
        return false; /* parked: asked again at the next schedule end */
    }
    for (uint32_t i = 0; i < in->n; i++) {
        if (res[i] == KVT_HIT) {
            hit_keys[n_hit] = in->keys[i];
            hit_idx[n_hit++] = i;
        } else {
            denied[n_denied++] = i;
        }
    }
    kvt_free(res);
    if (n_hit > 0 && !nt_register(nt))
        n_hit = 0;
    if (n_hit > 0 && kvt_parent_create_store_job(parent, hit_keys, n_hit, in->ctx, &job) != 0)
        job = NULL;
    if (job == NULL) {
        nt->c.denies++;
        nt_send_deny(nt, in, KVT_WIRE_R_NOT_FOUND);
        goto finish;
    }
    for (uint32_t i = 0; i < n_hit; i++) {
        struct kvt_primary_entry_info info;
        const uint8_t *rowp;

        if (kvt_primary_entry_info(nt->primary, &hit_keys[i], &info) != 0 || info.slot < 0) {
            /* Cannot happen while the job pins it; refuse rather than guess. */
            nt_finish_job(nt, job->id, false, NULL, 0, -1, -1);
            nt_send_deny(nt, in, KVT_WIRE_R_UNSPEC);
            goto finish;
        }
        rowp = nt->base.primary_base + (size_t)info.slot * nt->base.row_bytes;
        if (!info.has_checksum) {
            info.checksum = kvt_hash64(rowp, nt->base.row_bytes);
            kvt_primary_set_checksum(nt->primary, &hit_keys[i], info.checksum);
        }
        chunks[i] = (struct kvt_wire_chunk){.key_index = hit_idx[i],
                                            .length = (uint32_t)nt->base.row_bytes,
                                            .generation = info.generation,
                                            .offset = (uint64_t)info.slot * nt->base.row_bytes,
                                            .checksum = info.checksum};
    }
    {
        struct lease *l = kvt_calloc(1, sizeof(*l));
        struct kvt_wire_msg g;

        if (l == NULL || kvt_map_put_u64(&nt->leases, nt->next_id, l) != 0) {
            kvt_free(l);
            nt_finish_job(nt, job->id, false, NULL, 0, -1, -1);
            nt_send_deny(nt, in, KVT_WIRE_R_BUSY);
            goto finish;
        }
        *l = (struct lease){.id = nt->next_id++,
                            .job = job,
                            .from = in->from,
                            .ep = in->ep,
                            .deadline_ns = now + ms_ns(nt->cfg.lease_ms)};
        kvt_wire_msg_init(&g, KVT_WIRE_GRANT);
        g.u.grant.job_id = in->fetch_id;
        g.u.grant.lease_id = l->id;
        g.u.grant.lease_ttl_ms = nt->cfg.lease_ms;
        g.u.grant.handle_len = (uint32_t)nt->handle_len;
        g.u.grant.handle = nt->handle;
        g.u.grant.n_chunks = n_hit;
        g.u.grant.chunks = chunks;
        g.u.grant.n_denied = n_denied;
        g.u.grant.denied = denied;
        if (nt_send(nt, in->from, in->ep, &g) != 0) {
            nt_lease_end(nt, l, false); /* the requester times out */
        } else {
            struct nt_peer *p = nt_peer_get(nt, in->from);
            uint64_t bytes = (uint64_t)n_hit * nt->base.row_bytes;

            nt->c.served_chunks += n_hit;
            nt->c.served_bytes += bytes;
            nt->c.served_fetches++;
            nt->c.serve_wait_ns += kvt_now_ns() - in->arrival_ns;
            if (p != NULL)
                p->served_bytes += bytes;
        }
    }
finish:
    kvt_parent_on_request_finished(parent, in->ctx);
done:
    if (in->ctx != NULL)
        kvt_req_ctx_unref(in->ctx);
    in->ctx = NULL;
    kvt_free(hit_keys);
    kvt_free(hit_idx);
    kvt_free(denied);
    kvt_free(chunks);
    return true;
}

/* ---- peer callbacks ------------------------------------------------------------ */

static void nt_on_msg(void *arg, uint64_t from, struct kvt_tp_ep *ep, const struct kvt_wire_msg *m)
{
    struct net_tier *nt = arg;

    switch (m->type) {
    case KVT_WIRE_PUBLISH:
    case KVT_WIRE_UNPUBLISH:
        nt_on_publish(nt, from, ep, m);
        break;
    case KVT_WIRE_LOCATE:
        nt_on_locate(nt, ep, m);
        break;
    case KVT_WIRE_LOCATE_REPLY:
        nt_on_locate_reply(nt, from, m);
        break;
    case KVT_WIRE_FETCH:
        nt_on_fetch(nt, from, ep, m);
        break;
    case KVT_WIRE_GRANT:
        nt_on_grant(nt, from, ep, m);
        break;
    case KVT_WIRE_DENY:
        nt_on_deny(nt, from, m);
        break;
    case KVT_WIRE_RELEASE:
        nt_on_release(nt, from, m);
        break;
    default:
        nt->c.refused++;
        break;
    }
}

static void nt_forget_holders(struct net_tier *nt, uint64_t node, uint64_t keep_from)
{
    struct keyvec gone = {0};
    struct kvt_map_entry *e;
    size_t it = 0;

    /* Keys first, removals after: removal under kvt_map_next would skip entries. */
    while (kvt_map_next(&nt->holders, &it, &e)) {
        const struct holder *h = e->value;
        struct kvt_key k = {.len = e->key_len};

        memcpy(k.bytes, e->key, e->key_len);
        if (h->node_id == node && h->incarnation < keep_from && keyvec_push(&gone, &k) != 0)
            break; /* the rest fail their next load and are forgotten then */
    }
    for (size_t i = 0; i < gone.n; i++)
        kvt_free(kvt_map_remove(&nt->holders, gone.v[i].bytes, gone.v[i].len));
    keyvec_free(&gone);
}

static void nt_on_member(void *arg, const struct kvt_member_event *ev)
{
    struct net_tier *nt = arg;
    uint64_t keep_from = ev->kind == KVT_MEMBER_RESTARTED ? ev->incarnation : UINT64_MAX;

    kvt_info(NT_MOD, "member %016" PRIx64 " %s", ev->node_id,
             ev->kind == KVT_MEMBER_JOINED    ? "joined"
             : ev->kind == KVT_MEMBER_DOWN_EV ? "is down"
                                              : "restarted");
    if (ev->kind != KVT_MEMBER_JOINED) {
        kvt_directory_drop_node(nt->dir, ev->node_id, keep_from);
        nt_forget_holders(nt, ev->node_id, keep_from);
        nt_fail_fetches(nt, ev->node_id, keep_from, NULL);
        nt_reap_leases(nt, ev->node_id, NULL);
    }
    nt->republish_all = true; /* homes moved */
}

static void nt_on_link_closed(void *arg, uint64_t node_id, struct kvt_tp_ep *ep)
{
    struct net_tier *nt = arg;
    struct kvt_map_entry *e;
    size_t it = 0;

    (void)node_id;
    nt_fail_fetches(nt, 0, 0, ep);
    /* Fetches still reading on ep: the transport completed their batches before
     * this call; their rkeys go now, while ep lives. */
    while (kvt_map_next(&nt->fetches, &it, &e)) {
        struct fetch *f = e->value;

        if (f->ep == ep) {
            f->ep = NULL;
            f->failed = true;
        }
        if (f->ep == NULL && f->rk != NULL && f->batches_in_flight == 0) {
            kvt_tp_rkey_destroy(kvt_peers_transport(nt->peers), f->rk);
            f->rk = NULL;
        }
    }
    nt_reap_leases(nt, 0, ep);
    for (size_t i = 0; i < nt->n_in; i++) {
        if (nt->in[i].ep == ep)
            nt->in[i].ep = NULL;
    }
}

/* ---- the tier ops -------------------------------------------------------------- */

static int nt_progress(struct net_tier *nt)
{
    uint64_t now;
    int rc;

    rc = kvt_peers_progress(nt->peers);
    nt_take_locates(nt);
    now = kvt_now_ns();
    /* Deadlines are in ms: the scans (a snapshot of each map) run once a ms, not on
     * every poll of a busy loop. */
    if (now >= nt->next_expire_ns) {
        nt->next_expire_ns = now + MS;
        nt_expire_locates(nt, now);
        nt_expire_fetches(nt, now);
        nt_expire_leases(nt, now);
    }
    nt_pump(nt);
    return rc;
}

int kvt_net_tier_poll(struct kvt_tier *t)
{
    struct net_tier *nt = nt_of(t);
    int rc = nt_progress(nt);

    nt_flush_publishes(nt);
    return rc;
}

int kvt_net_tier_wake_fd(struct kvt_tier *t)
{
    return nt_of(t)->wake_fd;
}

static enum kvt_lookup_result nt_lookup(struct kvt_tier *t, const struct kvt_key *key,
                                        struct kvt_req_ctx *ctx)
{
    struct net_tier *nt = nt_of(t);
    const struct holder *h;
    int r = kvt_async_lookup_lookup(nt->al, key, ctx);

    if (r == KVT_AL_PENDING)
        return KVT_RETRY;
    if (r != KVT_AL_FOUND)
        return KVT_MISS;
    h = kvt_map_get(&nt->holders, key->bytes, key->len);
    if (h == NULL || !nt_holder_live(nt, h)) {
        kvt_async_lookup_mark_miss(nt->al, key, 1);
        return KVT_MISS;
    }
    return KVT_HIT;
}

static void nt_submit_store(struct kvt_tier *t, const struct kvt_job *job)
{
    struct net_tier *nt = nt_of(t);

    for (size_t i = 0; i < job->n; i++) {
        const struct kvt_key *k = &job->keys[i];

        if (kvt_map_get(&nt->published, k->bytes, k->len) != NULL)
            continue;
        if (kvt_map_put(&nt->published, k->bytes, k->len, (void *)1) != 0 ||
            keyvec_push(&nt->pub, k) != 0)
            kvt_warn(NT_MOD, "out of memory: a chunk is not published (peers will miss it)");
    }
    nt_finish_job(nt, job->id, true, NULL, 0, -1, 0);
}

static void nt_get_finished_jobs(struct kvt_tier *t, kvt_job_result_cb_t cb, void *arg)
{
    struct net_tier *nt = nt_of(t);
    struct finished *fin = nt->fin;
    size_t n = nt->n_fin;

    /* The callbacks may hand us new jobs that finish at once: they go to a new list. */
    nt->fin = NULL;
    nt->n_fin = nt->cap_fin = 0;
    for (size_t i = 0; i < n; i++) {
        struct kvt_job_result r = {.job_id = fin[i].job_id,
                                   .success = fin[i].success,
                                   .successful_keys = fin[i].ok_keys,
                                   .n_successful = fin[i].n_ok,
                                   .transfer_time = fin[i].seconds,
                                   .transfer_bytes = fin[i].bytes};

        cb(arg, &r);
        kvt_free(fin[i].ok_keys);
    }
    kvt_free(fin);
}

static bool nt_busy(struct net_tier *nt)
{
    return kvt_map_size(&nt->fetches) > 0 || kvt_map_size(&nt->leases) > 0 || nt->n_in > 0 ||
           nt->n_fin > 0;
}

static int nt_drain_jobs(struct kvt_tier *t)
{
    struct net_tier *nt = nt_of(t);
    void **ls;
    size_t n;

    /* Our own loads end by their deadlines; peers' leases end now (their READs then
     * fail their checksums if a slot is reused: a miss, not wrong bytes). */
    while (kvt_map_size(&nt->fetches) > 0) {
        nt_progress(nt);
        if (kvt_map_size(&nt->fetches) > 0)
            usleep(1000);
    }
    ls = nt_values(&nt->leases, &n);
    for (size_t i = 0; i < n; i++)
        nt_lease_end(nt, ls[i], false);
    kvt_free(ls);
    return 0;
}

static bool nt_has_pending_work(struct kvt_tier *t)
{
    return nt_busy(nt_of(t));
}

static void nt_on_request_finished(struct kvt_tier *t, struct kvt_req_ctx *ctx)
{
    kvt_async_lookup_cleanup(nt_of(t)->al, ctx->req_id);
}

static void nt_serve(struct kvt_tier *t, struct kvt_parent *parent)
{
    struct net_tier *nt = nt_of(t);
    uint64_t now;
    size_t w = 0;

    nt_progress(nt);
    now = kvt_now_ns();
    for (size_t i = 0; i < nt->n_in; i++) {
        if (nt_serve_one(nt, parent, &nt->in[i], now))
            kvt_free(nt->in[i].keys);
        else
            nt->in[w++] = nt->in[i];
    }
    nt->n_in = w;
}

static void nt_on_schedule_end(struct kvt_tier *t, const struct kvt_schedule_end_ctx *ctx)
{
    struct net_tier *nt = nt_of(t);

    (void)ctx;
    if (kvt_async_lookup_flush(nt->al) != 0)
        kvt_warn(NT_MOD, "out of memory: lookups wait for the next step");
    nt_progress(nt);
    nt_flush_publishes(nt);
}

static int nt_stat(struct kvt_stats *out, const char *name, const char *label, uint64_t now,
                   uint64_t *then)
{
    int rc = 0;

    if (now > *then)
        rc = kvt_stats_increase(out, name, label, (double)(now - *then));
    *then = now;
    return rc;
}

static int nt_get_stats(struct kvt_tier *t, struct kvt_stats *out)
{
    struct net_tier *nt = nt_of(t);
    struct kvt_net_tier_counts *c = &nt->c, *r = &nt->reported;
    char label[48];
    int rc = 0;

    snprintf(label, sizeof(label), "%d:%s", t->index + 1, t->type);
    rc |= nt_stat(out, KVT_M_NET_LOCATES, label, c->locates, &r->locates);
    rc |= nt_stat(out, KVT_M_NET_LOCATE_TIMEOUT, label, c->locate_timeouts, &r->locate_timeouts);
    rc |= nt_stat(out, KVT_M_NET_FETCHES, label, c->fetches, &r->fetches);
    rc |= nt_stat(out, KVT_M_NET_GRANTS, label, c->grants, &r->grants);
    rc |= nt_stat(out, KVT_M_NET_DENIES, label, c->denies, &r->denies);
    rc |= nt_stat(out, KVT_M_NET_PULLED_CHUNKS, label, c->pulled_chunks, &r->pulled_chunks);
    rc |= nt_stat(out, KVT_M_NET_PULLED_BYTES, label, c->pulled_bytes, &r->pulled_bytes);
    rc |= nt_stat(out, KVT_M_NET_SERVED_BYTES, label, c->served_bytes, &r->served_bytes);
    rc |= nt_stat(out, KVT_M_NET_CHECKSUM_FAIL, label, c->checksum_failures, &r->checksum_failures);
    rc |= nt_stat(out, KVT_M_NET_LEASE_EXPIRED, label, c->lease_expiries, &r->lease_expiries);
    rc |= nt_stat(out, KVT_M_NET_FETCH_FAILED, label, c->failed_fetches, &r->failed_fetches);
    rc |= nt_stat(out, KVT_M_NET_REFUSED, label, c->refused, &r->refused);
    {
        struct kvt_map_entry *e;
        size_t it = 0;

        while (kvt_map_next(&nt->nodes, &it, &e)) {
            struct nt_peer *p = e->value;
            char pl[KVT_STAT_LABEL_MAX];

            snprintf(pl, sizeof(pl), "peer:%016" PRIx64, p->node);
            rc |=
                nt_stat(out, KVT_M_NET_PEER_PULLED_BYTES, pl, p->pulled_bytes, &p->reported_pulled);
            rc |=
                nt_stat(out, KVT_M_NET_PEER_SERVED_BYTES, pl, p->served_bytes, &p->reported_served);
        }
    }
    rc |= kvt_stats_set_gauge(out, KVT_M_NET_LEASES, label, (double)kvt_map_size(&nt->leases));
    rc |= kvt_stats_set_gauge(out, KVT_M_NET_RECORDS, label,
                              (double)kvt_directory_num_records(nt->dir));
    return rc != 0 ? -ENOMEM : 0;
}

void kvt_net_tier_counts(struct kvt_tier *t, struct kvt_net_tier_counts *out)
{
    struct net_tier *nt = nt_of(t);

    *out = nt->c;
    out->active_leases = kvt_map_size(&nt->leases);
    out->directory_records = kvt_directory_num_records(nt->dir);
    out->published_keys = kvt_map_size(&nt->published);
}

static int nt_shutdown(struct kvt_tier *t)
{
    struct net_tier *nt = nt_of(t);

    if (nt->shut)
        return 0;
    pthread_mutex_lock(&nt->mu);
    nt->stopping = true;
    pthread_cond_broadcast(&nt->cv);
    pthread_mutex_unlock(&nt->mu);
    kvt_async_lookup_shutdown(nt->al);
    nt->shut = true;
    nt_drain_jobs(t);
    /* Unpublish what we hold: peers stop asking us at once, not at the TTL. */
    nt_on_removed(nt, NULL, 0);
    nt_flush_keys(nt, &nt->unpub, KVT_WIRE_UNPUBLISH);
    kvt_primary_set_removed_hook(nt->primary, NULL, NULL);
    return 0;
}

static void nt_free_map(struct kvt_map *m)
{
    struct kvt_map_entry *e;
    size_t it = 0;

    while (kvt_map_next(m, &it, &e))
        kvt_free(e->value);
    kvt_map_cleanup(m);
}

static void nt_destroy(struct kvt_tier *t)
{
    struct net_tier *nt = nt_of(t);
    struct kvt_transport *tp = kvt_peers_transport(nt->peers);
    struct kvt_map_entry *e;
    size_t it = 0;

    nt_shutdown(t);
    kvt_peers_set_handlers(nt->peers, NULL);
    kvt_async_lookup_destroy(nt->al);
    /* Locate ops hold a reference on their worker request. */
    while (kvt_map_next(&nt->locate_ops, &it, &e)) {
        struct locate_op *op = e->value;

        lr_unref_locked(op->req);
        kvt_free(op->found);
    }
    nt_free_map(&nt->locate_ops);
    it = 0;
    while (kvt_map_next(&nt->locate_parts, &it, &e))
        kvt_free(((struct locate_part *)e->value)->idx);
    nt_free_map(&nt->locate_parts);
    nt_free_map(&nt->holders);
    it = 0;
    while (kvt_map_next(&nt->fetches, &it, &e)) {
        struct fetch *f = e->value;

        if (f->rk != NULL)
            kvt_tp_rkey_destroy(tp, f->rk);
        kvt_free(f->idx);
        kvt_free(f->chunks);
        kvt_free(f->chunk_ok);
    }
    nt_free_map(&nt->fetches);
    nt_free_map(&nt->leases);
    nt_free_map(&nt->nodes);
    kvt_map_cleanup(&nt->published);
    for (size_t i = 0; i < nt->n_in; i++) {
        kvt_free(nt->in[i].keys);
        if (nt->in[i].ctx != NULL)
            kvt_req_ctx_unref(nt->in[i].ctx);
    }
    kvt_free(nt->in);
    for (size_t i = 0; i < nt->n_fin; i++)
        kvt_free(nt->fin[i].ok_keys);
    kvt_free(nt->fin);
    keyvec_free(&nt->pub);
    keyvec_free(&nt->unpub);
    if (nt->mr_local != NULL)
        kvt_tp_dereg(nt->mr_local, tp);
    if (nt->mr_remote != NULL)
        kvt_tp_dereg(nt->mr_remote, tp);
    kvt_directory_destroy(nt->dir);
    close(nt->wake_fd);
    pthread_cond_destroy(&nt->cv);
    pthread_mutex_destroy(&nt->mu);
    kvt_free(nt);
}

static const struct kvt_tier_ops nt_ops = {
    .lookup = nt_lookup,
    .submit_store = nt_submit_store,
    .submit_load = nt_submit_load,
    .get_finished_jobs = nt_get_finished_jobs,
    .drain_jobs = nt_drain_jobs,
    .has_pending_work = nt_has_pending_work,
    .on_request_finished = nt_on_request_finished,
    .serve_external_requests = nt_serve,
    .on_schedule_end = nt_on_schedule_end,
    .get_stats = nt_get_stats,
    .shutdown = nt_shutdown,
    .destroy = nt_destroy,
};

int kvt_net_tier_create(const struct kvt_net_tier_config *cfg, struct kvt_tier **t_p)
{
    struct net_tier *nt;
    struct kvt_peers_handlers h;
    pthread_condattr_t ca;
    int rc;

    if (cfg == NULL || cfg->peers == NULL || cfg->primary == NULL || t_p == NULL)
        return -EINVAL;
    nt = kvt_calloc(1, sizeof(*nt));
    if (nt == NULL)
        return -ENOMEM;
    kvt_tier_init(&nt->base, &nt_ops, "network", KVT_MEDIUM_CPU, KVT_REMOTE);
    nt->cfg = *cfg;
#define DEFAULT(f, v)                                                                              \
    if (nt->cfg.f == 0)                                                                            \
    nt->cfg.f = (v)
    DEFAULT(lease_ms, 5000);
    DEFAULT(fetch_timeout_ms, 3000);
    DEFAULT(locate_timeout_ms, 2000);
    DEFAULT(park_timeout_ms, 1000);
    DEFAULT(record_ttl_ms, 600000);
    DEFAULT(max_holders, 8);
    /* 8 rows of 256 KiB are 2 MiB, this core's L2: a batch's rows are hashed right
     * after their READs, while still there (with 32 the check read them back from L3:
     * verify 55-68 ms against 33-44 ms for a 6400-chunk pull). Counted in ops, so
     * the reason holds for 256 KiB rows; larger rows want fewer ops per batch. */
    DEFAULT(max_ops_per_batch, 8);
    DEFAULT(keys_per_fetch, 64);
    DEFAULT(fetches_per_peer, 4);
#undef DEFAULT
    if (nt->cfg.max_holders > 16)
        nt->cfg.max_holders = 16;
    nt->peers = cfg->peers;
    nt->primary = cfg->primary;
    nt->self = kvt_peers_self(cfg->peers);
    nt->next_id = 1;
    nt->lq_tail = &nt->lq_head;
    nt->next_republish_ns = kvt_now_ns() + ms_ns(nt->cfg.record_ttl_ms) / 2;
    pthread_mutex_init(&nt->mu, NULL);
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&nt->cv, &ca);
    pthread_condattr_destroy(&ca);
    kvt_map_init(&nt->locate_ops);
    kvt_map_init(&nt->locate_parts);
    kvt_map_init(&nt->holders);
    kvt_map_init(&nt->fetches);
    kvt_map_init(&nt->leases);
    kvt_map_init(&nt->nodes);
    kvt_map_init(&nt->published);
    nt->wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC); /* fail path: -1 or valid */
    if (nt->wake_fd < 0) {
        rc = -errno;
        goto fail;
    }
    rc = kvt_directory_create(ms_ns(nt->cfg.record_ttl_ms), nt->cfg.max_holders, &nt->dir);
    if (rc != 0)
        goto fail;
    rc = kvt_async_lookup_create("network", nt_batch_lookup, nt, &nt->al);
    if (rc != 0)
        goto fail;
    h = (struct kvt_peers_handlers){.on_msg = nt_on_msg,
                                    .on_member = nt_on_member,
                                    .on_link_closed = nt_on_link_closed,
                                    .arg = nt};
    kvt_peers_set_handlers(nt->peers, &h);
    kvt_primary_set_removed_hook(nt->primary, nt_on_removed, nt);
    *t_p = &nt->base;
    return 0;
fail:
    if (nt->dir != NULL)
        kvt_directory_destroy(nt->dir);
    if (nt->wake_fd >= 0)
        close(nt->wake_fd);
    pthread_cond_destroy(&nt->cv);
    pthread_mutex_destroy(&nt->mu);
    kvt_free(nt);
    return rc;
}

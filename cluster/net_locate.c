/* SPDX-License-Identifier: Apache-2.0 */
/* The network tier's lookups and the location directory (net_tier_int.h).
 *
 * Requester: the manager's lookup goes through the async lookup helper, in submit
 * mode (no worker thread): at a schedule end its flush hands the step's new keys to
 * kvt__nt_lookup_submit, which queues a locate_req, and the loop's progress right
 * after takes the queue, sends one LOCATE per key's home (rendezvous hashing over
 * the live members; keys homed here are answered from our own directory) and
 * completes the helper's item when every LOCATE_REPLY is in, its deadline passed, or
 * the home of the rest went down or restarted (their keys are not found).
 * So a LOCATE leaves in the step that asked, whatever is still in flight, and its
 * answer reaches the next lookup without a thread in between. (A worker that ran the
 * round trips one after the other made each step's keys wait for the LOCATEs of the
 * steps before.) A found key remembers its holder (nt->holders) for the load that
 * follows.
 *
 * Home: PUBLISH/UNPUBLISH from a node about itself, in its current incarnation, keep
 * the directory of the keys homed here (at most cfg.max_records_per_node records of
 * each node: a flood past it is refused, counted); LOCATE is answered from it with the holders
 * that are live, each with the key's place in its primary when the holder published
 * one (direct reads, network.fetch), which the requester keeps with the holder. */
#include <errno.h>
#include <inttypes.h>
#include <string.h>
#include <time.h>

#include "kvt/alloc.h"
#include "kvt/clock.h"
#include "kvt/log.h"
#include "net_tier_int.h"

/* ---- requester: lookups by LOCATE ---------------------------------------------- */

bool kvt__nt_holder_live(struct net_tier *nt, const struct holder *h)
{
    return h->node_id != nt->self &&
           kvt_members_is_live(kvt_peers_members(nt->peers), h->node_id, h->incarnation);
}

static void lr_free(struct locate_req *r)
{
    kvt_free(r->keys);
    kvt_free(r);
}

int kvt__nt_lookup_submit(void *arg, const struct kvt_key *keys, size_t n, bool *found, void *token)
{
    struct net_tier *nt = arg;
    struct locate_req *r = kvt_calloc(1, sizeof(*r));

    if (r == NULL)
        return -ENOMEM;
    r->keys = kvt_malloc((n ? n : 1) * sizeof(*keys));
    if (r->keys == NULL) {
        kvt_free(r);
        return -ENOMEM;
    }
    memcpy(r->keys, keys, n * sizeof(*keys));
    r->n = n;
    r->found = found;
    r->token = token;
    /* No wake-up: the flush that called us runs on the loop, whose progress right
     * after (nt_on_schedule_end) takes the queue and sends the LOCATEs. */
    *nt->lq_tail = r;
    nt->lq_tail = &r->next;
    return 0;
}

/* r is answered (the keys not written stay not found): completes the helper's item
 * and frees r. */
static void lr_done(struct net_tier *nt, struct locate_req *r)
{
    void *token = r->token;

    lr_free(r);
    kvt_async_lookup_complete(nt->al, token);
}

/* Loop: the op is answered (or abandoned); hand the verdicts over, drop the op. */
static void nt_locate_op_done(struct net_tier *nt, struct locate_op *op)
{
    memcpy(op->req->found, op->found, op->req->n * sizeof(bool));
    lr_done(nt, op->req);
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

        if (!kvt__nt_holder_live(nt, &c[i]))
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
        c[i] = (struct holder){.node_id = d[i].node_id,
                               .incarnation = d[i].incarnation,
                               .row = d[i].row,
                               .gen = d[i].gen,
                               .has_row = d[i].has_row};
    *found = nt_pick_holder(nt, key, c, n);
}

void kvt__nt_take_locates(struct net_tier *nt)
{
    struct locate_req *list;
    uint64_t live[NT_MAX_NODES];
    size_t n_live;

    list = nt->lq_head;
    nt->lq_head = NULL;
    nt->lq_tail = &nt->lq_head;
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
            lr_done(nt, r); /* every key not found */
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
                if (kvt__nt_send(nt, home, NULL, &msg) != 0 ||
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

/* A LOCATE answered or given up: the op is done with its last part (the keys of the
 * parts given up stay not found). */
static void nt_part_end(struct net_tier *nt, struct locate_part *pt)
{
    struct locate_op *op = pt->op;

    nt_part_free(nt, pt);
    if (--op->parts_pending == 0)
        nt_locate_op_done(nt, op);
}

void kvt__nt_on_locate_reply(struct net_tier *nt, uint64_t from, const struct kvt_wire_msg *m)
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
    nt_time(nt, &nt->c.locate_rtt_ns, KVT_M_NET_LOCATE_SECONDS, kvt_now_ns() - pt->sent_ns);
    for (uint32_t i = 0; i < pt->n; i++) {
        const struct kvt_wire_holder_list *hl = &lr->holders[i];
        struct holder c[16];
        size_t n = KVT_MIN((size_t)hl->n, KVT_ARRAY_SIZE(c));

        for (size_t j = 0; j < n; j++)
            c[j] = (struct holder){.node_id = hl->v[j].node_id,
                                   .incarnation = hl->v[j].incarnation,
                                   .row = hl->v[j].row,
                                   .gen = hl->v[j].gen,
                                   .has_row = hl->v[j].has_row};
        op->found[pt->idx[i]] = nt_pick_holder(nt, &op->req->keys[pt->idx[i]], c, n);
    }
    nt_part_end(nt, pt);
}

static void nt_expire_part(struct net_tier *nt, void *v, void *arg)
{
    struct locate_part *pt = v;

    if (*(const uint64_t *)arg < pt->op->deadline_ns)
        return;
    nt->c.locate_timeouts++;
    nt_part_end(nt, pt);
}

void kvt__nt_expire_locates(struct net_tier *nt, uint64_t now)
{
    kvt__nt_for_each(nt, &nt->locate_parts, nt_expire_part, &now);
}

static void nt_home_gone(struct net_tier *nt, void *v, void *arg)
{
    struct locate_part *pt = v;

    if (pt->node == *(const uint64_t *)arg)
        nt_part_end(nt, pt);
}

void kvt__nt_fail_locates(struct net_tier *nt, uint64_t node)
{
    kvt__nt_for_each(nt, &nt->locate_parts, nt_home_gone, &node);
}

void kvt__nt_forget_holders(struct net_tier *nt, uint64_t node, uint64_t keep_from)
{
    struct keyvec gone = {0};
    struct kvt_map_entry *e;
    size_t it = 0;

    /* Keys first, removals after: removal under kvt_map_next would skip entries. */
    while (kvt_map_next(&nt->holders, &it, &e)) {
        const struct holder *h = e->value;
        struct kvt_key k = {.len = e->key_len};

        memcpy(k.bytes, e->key, e->key_len);
        if (h->node_id == node && h->incarnation < keep_from && kvt__nt_keyvec_push(&gone, &k) != 0)
            break; /* the rest fail their next load and are forgotten then */
    }
    for (size_t i = 0; i < gone.n; i++)
        kvt_free(kvt_map_remove(&nt->holders, gone.v[i].bytes, gone.v[i].len));
    kvt__nt_keyvec_free(&gone);
}

enum kvt_lookup_result kvt__nt_lookup(struct kvt_tier *t, const struct kvt_key *key,
                                      struct kvt_req_ctx *ctx)
{
    struct net_tier *nt = nt_of(t);
    const struct holder *h;
    size_t queued = kvt_async_lookup_batch_len(nt->al);
    int r = kvt_async_lookup_lookup(nt->al, key, ctx);

    if (queued == 0 && kvt_async_lookup_batch_len(nt->al) > 0)
        nt->lookup_first_ns = kvt_now_ns(); /* KVT_M_NET_LOOKUP_QUEUE_SECONDS */

    if (r == KVT_AL_PENDING)
        return KVT_RETRY;
    if (r != KVT_AL_FOUND)
        return KVT_MISS;
    h = kvt_map_get(&nt->holders, key->bytes, key->len);
    if (h == NULL || !kvt__nt_holder_live(nt, h)) {
        kvt_async_lookup_mark_miss(nt->al, key, 1);
        return KVT_MISS;
    }
    return KVT_HIT;
}

/* Destroy: locate ops hold the reference on their request, whose token is not
 * completed any more (the async lookup helper was destroyed first and freed it);
 * requests never taken are still queued. */
void kvt__nt_locate_cleanup(struct net_tier *nt)
{
    struct kvt_map_entry *e;
    size_t it = 0;

    while (nt->lq_head != NULL) {
        struct locate_req *r = nt->lq_head;

        nt->lq_head = r->next;
        lr_free(r);
    }
    nt->lq_tail = &nt->lq_head;
    while (kvt_map_next(&nt->locate_ops, &it, &e)) {
        struct locate_op *op = e->value;

        lr_free(op->req);
        kvt_free(op->found);
    }
    kvt__nt_free_map(&nt->locate_ops);
    it = 0;
    while (kvt_map_next(&nt->locate_parts, &it, &e))
        kvt_free(((struct locate_part *)e->value)->idx);
    kvt__nt_free_map(&nt->locate_parts);
    kvt__nt_free_map(&nt->holders);
}

/* ---- home: the directory ------------------------------------------------------- */

void kvt__nt_on_publish(struct net_tier *nt, uint64_t from, struct kvt_tp_ep *ep,
                        const struct kvt_wire_msg *m)
{
    const struct kvt_wire_publish *p = &m->u.publish;
    uint64_t id, inc;

    if (kvt_peers_link_peer(nt->peers, ep, &id, &inc) != 0 || p->node_id != from ||
        p->incarnation != inc) {
        nt->c.refused++; /* a node speaks only for itself, in its current life */
        return;
    }
    if (m->type == KVT_WIRE_PUBLISH) {
        struct kvt_dir_row *rows = NULL;

        /* Where the keys sit (direct reads; the codec checked one per key). Out of
         * memory: published without them (those keys go the lease way). */
        if ((m->has & KVT_WIRE_HAS(KVT_WIRE_F_ROWS)) && p->n_rows == p->n_keys && p->n_keys > 0)
            rows = kvt_malloc(p->n_keys * sizeof(*rows));
        for (uint32_t i = 0; rows != NULL && i < p->n_keys; i++)
            rows[i] = (struct kvt_dir_row){
                .row = p->rows[i].row, .gen = p->rows[i].gen, .known = p->rows[i].known};
        /* Past its limit of records the node is refused the new keys, counted. */
        if (kvt_directory_publish_rows(nt->dir, from, inc, p->keys, rows, p->n_keys,
                                       kvt_now_ns()) == -ENOSPC)
            nt->c.refused++;
        kvt_free(rows);
    } else
        kvt_directory_unpublish(nt->dir, from, inc, p->keys, p->n_keys);
}

void kvt__nt_on_locate(struct net_tier *nt, struct kvt_tp_ep *ep, const struct kvt_wire_msg *m)
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
            hl[i].v[hl[i].n++] = (struct kvt_wire_holder){.node_id = d[j].node_id,
                                                          .incarnation = d[j].incarnation,
                                                          .row = d[j].row,
                                                          .gen = d[j].gen,
                                                          .has_row = d[j].has_row};
        }
    }
    kvt_wire_msg_init(&r, KVT_WIRE_LOCATE_REPLY);
    r.u.locate_reply.req_id = l->req_id;
    r.u.locate_reply.n_keys = l->n_keys;
    r.u.locate_reply.holders = hl;
    if (kvt__nt_send(nt, 0, ep, &r) != 0)
        kvt_debug(NT_MOD, "LOCATE_REPLY not sent (the requester times out)");
out:
    kvt_free(hl);
    kvt_free(hv);
}

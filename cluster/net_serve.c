/* SPDX-License-Identifier: Apache-2.0 */
/* The network tier's holder side (net_tier_int.h): peers' FETCHes served through the
 * parent, and the leases that keep the granted rows pinned while peers read them.
 *
 * A FETCH is parked (nt->in) until the next schedule end, when the manager lets the
 * tier act as a requester of its own (serve_external_requests): each parked FETCH
 * becomes a synthetic request - on_new_request, a lookup per key, kept parked while
 * any key answers RETRY or HIT_PENDING (up to park_timeout_ms), create_store_job for
 * the hits (which pins their rows), on_request_finished - and is answered by a GRANT
 * (offset, length, generation and checksum of each row, the region handle, a lease)
 * or a DENY. The store job is the lease's: it ends, and unpins, on RELEASE, at the
 * lease's expiry, or when the requester's link closes or its node goes down. A
 * requester reading after the lease ended may read a reused slot: the fence word it
 * READs after the row (the GRANT's generation is the word the row's bytes were
 * completed under; the GRANT carries the words' handle) or the checksum in the GRANT
 * tells it so.
 *
 * A lease also keeps the offsets of the rows it granted, so that the transport can
 * ask, for each one-sided READ a peer posts, whether that peer holds an active lease
 * on every row the READ touches (kvt__net_may_read). Transports whose device serves
 * READs without asking (verbs) are told instead what to expose to the requester's
 * endpoint (kvt_tp_expose: the granted rows and their fence words, nothing else);
 * the GRANT carries the handles of those exposures, not of the regions, and the
 * lease revokes them when it ends (RELEASE, expiry, link down, drain). A grant
 * whose rows need more windows than one exposure holds grants the first rows that
 * fit and denies the rest. A peer's FETCHes served at once (parked or leased) are
 * at most cfg.serve_per_peer: past it a FETCH is denied BUSY and counted refused,
 * so a peer flooding FETCHes without RELEASE pins no more.
 *
 * Direct reads (network.fetch direct): a FETCH may ask for the handles of direct
 * reads; a holder in direct mode then exposes its whole primary and fence words to
 * the requester's endpoint - an authenticated link, as every FETCH's - once, until
 * that link closes, and puts the handles in its GRANTs on that link. The peer then
 * READs rows whose place the home told it without asking us (no pin: the fence
 * word it READs after the row says whether the slot changed). Software-checked
 * transports let such an endpoint READ anywhere in the two registrations (nt_may_read
 * asks kvt__nt_direct_exposed); verbs binds a window per registration piece to its
 * QP. Lease mode exposes exactly what it granted, as above. */
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "kvt/alloc.h"
#include "kvt/clock.h"
#include "kvt/hash.h"
#include "kvt/log.h"
#include "kvt/primary.h"
#include "kvt/vec.h"
#include "net_tier_int.h"

struct serve_scratch;

static struct lease *nt_lease_new(uint32_t n_rows);
static void nt_lease_done(struct net_tier *nt, struct lease *l, bool success);
static void nt_lease_end(struct net_tier *nt, struct lease *l, bool expired);
static int nt_lease_expose(struct net_tier *nt, struct lease *l, struct serve_scratch *sc,
                           uint32_t *n_denied, uint8_t *handle, size_t *handle_len,
                           uint8_t *fhandle, size_t *fhandle_len);

/* ---- inbound FETCHes ----------------------------------------------------------- */

/* A FETCH of node served from now (+1: parked, or its lease) or no more (-1:
 * answered, or its lease ended). */
static void nt_serving(struct net_tier *nt, uint64_t node, int d)
{
    struct nt_peer *p = kvt_map_get_u64(&nt->nodes, node);

    if (p != NULL && (d > 0 || p->serving > 0))
        p->serving += (unsigned)d;
}

/* Parks the FETCH for the next schedule end; BUSY when it cannot be kept, or when
 * the peer has its share of our serving already (counted refused). */
void kvt__nt_on_fetch(struct net_tier *nt, uint64_t from, struct kvt_tp_ep *ep,
                      const struct kvt_wire_msg *m)
{
    struct inbound *in;
    struct nt_peer *p;
    uint64_t id, inc;

    if (kvt_peers_link_peer(nt->peers, ep, &id, &inc) != 0)
        return;
    p = kvt__nt_peer_get(nt, from);
    if (p == NULL)
        goto busy;
    if (p->serving >= nt->cfg.serve_per_peer) {
        nt->c.refused++; /* its share taken: a flood pins no more rows */
        goto busy;
    }
    if (kvt_vec_reserve(nt->in, nt->cap_in, nt->n_in + 1, 16) < 0)
        goto busy;
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
    in->direct = (m->has & KVT_WIRE_HAS(KVT_WIRE_F_DIRECT)) && m->u.fetch.direct == 1;
    nt->n_in++;
    nt->news++;
    p->serving++;
    return;
busy : {
    struct kvt_wire_msg d;

    kvt_wire_msg_init(&d, KVT_WIRE_DENY);
    d.u.deny.job_id = m->u.fetch.job_id;
    d.u.deny.reason = KVT_WIRE_R_BUSY;
    (void)kvt__nt_send(nt, 0, ep, &d);
}
}

/* ---- direct reads: our primary exposed to a peer that asked --------------------- */

static struct direct_exp *nt_direct_find(struct net_tier *nt, struct kvt_tp_ep *ep)
{
    struct kvt_list *pos, *tmp;

    kvt_list_for_each_safe(pos, tmp, &nt->exposures)
    {
        struct direct_exp *x = kvt_list_entry(pos, struct direct_exp, link);

        if (x->ep == ep)
            return x;
    }
    return NULL;
}

static void nt_direct_free(struct net_tier *nt, struct direct_exp *x)
{
    struct kvt_transport *tp = kvt_peers_transport(nt->peers);

    kvt_list_del(&x->link);
    kvt_tp_revoke(tp, x->grant);
    kvt_tp_revoke(tp, x->fence_grant);
    kvt_free(x);
}

/* The exposure of our whole primary and fence words to ep (an authenticated link:
 * a FETCH came on it), made on first need and kept until the link closes; NULL when
 * we are not in direct mode or it cannot be made now (the GRANT then carries no
 * direct handles, and the peer asks again with its next FETCH). */
static const struct direct_exp *nt_direct_expose(struct net_tier *nt, struct kvt_tp_ep *ep)
{
    struct direct_exp *x;
    struct kvt_tp_range r;
    int rc;

    if (nt->cfg.fetch != KVT_NET_FETCH_DIRECT || nt->omit_fences || ep == NULL ||
        nt->mr_remote == NULL)
        return NULL;
    x = nt_direct_find(nt, ep);
    if (x != NULL)
        return x;
    x = kvt_calloc(1, sizeof(*x));
    if (x == NULL)
        return NULL;
    x->ep = ep;
    r = (struct kvt_tp_range){.off = 0, .len = (uint64_t)nt->base.num_chunks * nt->base.row_bytes};
    rc = kvt_tp_expose(ep, nt->mr_remote, &r, 1, x->handle, sizeof(x->handle), &x->handle_len,
                       &x->grant);
    if (rc == 0) {
        r = (struct kvt_tp_range){.off = 0,
                                  .len = (uint64_t)nt->base.num_chunks * sizeof(uint32_t)};
        rc = kvt_tp_expose(ep, nt->mr_fence, &r, 1, x->fence_handle, sizeof(x->fence_handle),
                           &x->fence_handle_len, &x->fence_grant);
    }
    kvt_list_add_tail(&nt->exposures, &x->link);
    if (rc != 0) {
        kvt_info(NT_MOD, "cannot expose the primary for direct reads: %s", strerror(-rc));
        nt_direct_free(nt, x);
        return NULL;
    }
    nt->c.direct_exposures++;
    return x;
}

bool kvt__nt_direct_exposed(struct net_tier *nt, struct kvt_tp_ep *ep)
{
    return nt->cfg.fetch == KVT_NET_FETCH_DIRECT && ep != NULL && nt_direct_find(nt, ep) != NULL;
}

void kvt__nt_direct_link_closed(struct net_tier *nt, struct kvt_tp_ep *ep)
{
    struct direct_exp *x = nt_direct_find(nt, ep);

    if (x != NULL)
        nt_direct_free(nt, x);
}

/* ---- the serving loop ---------------------------------------------------------- */

static void nt_send_deny(struct net_tier *nt, struct inbound *in, uint32_t reason)
{
    struct kvt_wire_msg d;

    if (in->ep == NULL)
        return;
    kvt_wire_msg_init(&d, KVT_WIRE_DENY);
    d.u.deny.job_id = in->fetch_id;
    d.u.deny.reason = reason;
    (void)kvt__nt_send(nt, in->from, in->ep, &d);
}

/* The arrays of one FETCH being served, n + 1 entries each (never zero bytes), in
 * one allocation: the parent's verdict per key, the hits (key, index in the FETCH,
 * the GRANT's chunk) and the indexes denied. */
struct serve_scratch {
    struct kvt_wire_chunk *chunks;
    struct kvt_key *hit_keys;
    uint32_t *hit_idx, *denied;
    enum kvt_lookup_result *res;
};

#define NT_ROUND8(x) (((x) + 7) & ~(size_t)7)

/* The block to free, or NULL. */
static void *nt_scratch_alloc(struct serve_scratch *sc, uint32_t n)
{
    size_t m = (size_t)n + 1;
    size_t chunks = NT_ROUND8(m * sizeof(*sc->chunks)), keys = NT_ROUND8(m * sizeof(*sc->hit_keys));
    size_t idx = NT_ROUND8(m * sizeof(uint32_t)), res = m * sizeof(*sc->res);
    char *p = kvt_malloc(chunks + keys + 2 * idx + res);

    if (p == NULL)
        return NULL;
    sc->chunks = (struct kvt_wire_chunk *)p;
    sc->hit_keys = (struct kvt_key *)(p + chunks);
    sc->hit_idx = (uint32_t *)(p + chunks + keys);
    sc->denied = (uint32_t *)(p + chunks + keys + idx);
    sc->res = (enum kvt_lookup_result *)(p + chunks + keys + 2 * idx);
    return p;
}

/* One parked FETCH: true when it is answered (and can be dropped). */
static bool nt_serve_one(struct net_tier *nt, struct kvt_parent *parent, struct inbound *in,
                         uint64_t now)
{
    struct serve_scratch sc;
    void *block = NULL;
    uint32_t n_hit = 0, n_denied = 0;
    bool waiting = false;
    const struct kvt_job *job = NULL;
    struct lease *l = NULL;
    struct kvt_wire_msg g;
    uint8_t handle[KVT_TP_MAX_HANDLE_SIZE], fhandle[KVT_TP_MAX_HANDLE_SIZE];
    size_t handle_len = 0, fhandle_len = 0;
    int rc;

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
    block = nt_scratch_alloc(&sc, in->n);
    if (block == NULL) {
        nt_send_deny(nt, in, KVT_WIRE_R_BUSY);
        goto finish;
    }
    for (uint32_t i = 0; i < in->n; i++) {
        sc.res[i] = kvt_parent_lookup(parent, &in->keys[i], in->ctx);
        if (sc.res[i] == KVT_RETRY || sc.res[i] == KVT_HIT_PENDING)
            waiting = true;
    }
    if (waiting && now < in->arrival_ns + ms_ns(nt->cfg.park_timeout_ms)) {
        kvt_free(block);
        return false; /* parked: asked again at the next schedule end */
    }
    for (uint32_t i = 0; i < in->n; i++) {
        if (sc.res[i] == KVT_HIT) {
            sc.hit_keys[n_hit] = in->keys[i];
            sc.hit_idx[n_hit++] = i;
        } else {
            sc.denied[n_denied++] = i;
        }
    }
    if (n_hit > 0 && !kvt__nt_register(nt))
        n_hit = 0;
    /* The lease, with the store job's finished record, before the job: once the
     * parent has pinned the rows, ending the job cannot fail. */
    if (n_hit > 0 && (l = nt_lease_new(n_hit)) == NULL) {
        nt_send_deny(nt, in, KVT_WIRE_R_BUSY);
        goto finish;
    }
    if (n_hit > 0 && kvt_parent_create_store_job(parent, sc.hit_keys, n_hit, in->ctx, &job) != 0)
        job = NULL;
    if (job == NULL) {
        kvt_free(l);
        nt->c.denies++;
        nt_send_deny(nt, in, KVT_WIRE_R_NOT_FOUND);
        goto finish;
    }
    *l = (struct lease){.job = job,
                        .from = in->from,
                        .ep = in->ep,
                        .deadline_ns = now + ms_ns(nt->cfg.lease_ms),
                        .n_rows = n_hit};
    for (uint32_t i = 0; i < n_hit; i++) {
        struct kvt_primary_entry_info info;
        const uint8_t *rowp;

        if (kvt_primary_entry_info(nt->primary, &sc.hit_keys[i], &info) != 0 || info.slot < 0) {
            /* Cannot happen while the job pins it; refuse rather than guess. */
            nt_lease_done(nt, l, false);
            nt_send_deny(nt, in, KVT_WIRE_R_UNSPEC);
            goto finish;
        }
        rowp = nt->base.primary_base + (size_t)info.slot * nt->base.row_bytes;
        if (!info.has_checksum) {
            info.checksum = kvt_hash64(rowp, nt->base.row_bytes);
            kvt_primary_set_checksum(nt->primary, &sc.hit_keys[i], info.checksum);
        }
        l->rows[i] = (uint64_t)info.slot * nt->base.row_bytes;
        sc.chunks[i] = (struct kvt_wire_chunk){.key_index = sc.hit_idx[i],
                                               .length = (uint32_t)nt->base.row_bytes,
                                               .generation = info.fence,
                                               .offset = l->rows[i],
                                               .checksum = info.checksum};
    }
    rc = nt_lease_expose(nt, l, &sc, &n_denied, handle, &handle_len, fhandle, &fhandle_len);
    if (rc != 0) {
        kvt_warn(NT_MOD, "cannot expose %u rows to %016" PRIx64 ": %s", l->n_rows, in->from,
                 strerror(-rc));
        nt_lease_done(nt, l, false);
        nt_send_deny(nt, in, KVT_WIRE_R_BUSY);
        goto finish;
    }
    n_hit = l->n_rows;
    l->id = nt->next_id++;
    if (kvt_map_put_u64(&nt->leases, l->id, l) != 0) {
        nt_lease_done(nt, l, false);
        nt_send_deny(nt, in, KVT_WIRE_R_BUSY);
        goto finish;
    }
    nt_serving(nt, in->from, +1); /* the lease's, until nt_lease_end */
    kvt_wire_msg_init(&g, KVT_WIRE_GRANT);
    g.u.grant.job_id = in->fetch_id;
    g.u.grant.lease_id = l->id;
    g.u.grant.lease_ttl_ms = nt->cfg.lease_ms;
    g.u.grant.handle_len = (uint32_t)handle_len;
    g.u.grant.handle = handle;
    g.u.grant.n_chunks = n_hit;
    g.u.grant.chunks = sc.chunks;
    g.u.grant.n_denied = n_denied;
    g.u.grant.denied = sc.denied;
    if (!nt->omit_fences) {
        g.u.grant.fence_handle_len = (uint32_t)fhandle_len;
        g.u.grant.fence_handle = fhandle;
        g.has |= KVT_WIRE_HAS(KVT_WIRE_F_FENCE_HANDLE);
    }
    if (in->direct) {
        const struct direct_exp *x = nt_direct_expose(nt, in->ep);

        if (x != NULL) {
            g.u.grant.direct_handle_len = (uint32_t)x->handle_len;
            g.u.grant.direct_handle = (uint8_t *)x->handle;
            g.u.grant.direct_fence_handle_len = (uint32_t)x->fence_handle_len;
            g.u.grant.direct_fence_handle = (uint8_t *)x->fence_handle;
            g.has |= KVT_WIRE_HAS(KVT_WIRE_F_DIRECT_HANDLE) |
                     KVT_WIRE_HAS(KVT_WIRE_F_DIRECT_FENCE_HANDLE);
        }
    }
    if (kvt__nt_send(nt, in->from, in->ep, &g) != 0) {
        nt_lease_end(nt, l, false); /* the requester times out */
    } else {
        struct nt_peer *p = kvt__nt_peer_get(nt, in->from);
        uint64_t bytes = (uint64_t)n_hit * nt->base.row_bytes;

        nt->c.served_chunks += n_hit;
        nt->c.served_bytes += bytes;
        nt->c.served_fetches++;
        nt_time(nt, &nt->c.serve_wait_ns, KVT_M_NET_SERVE_WAIT_SECONDS,
                kvt_now_ns() - in->arrival_ns);
        if (p != NULL)
            p->served_bytes += bytes;
    }
finish:
    kvt_parent_on_request_finished(parent, in->ctx);
done:
    if (in->ctx != NULL)
        kvt_req_ctx_unref(in->ctx);
    in->ctx = NULL;
    kvt_free(block);
    return true;
}

void kvt__nt_serve(struct kvt_tier *t, struct kvt_parent *parent)
{
    struct net_tier *nt = nt_of(t);
    uint64_t now;
    size_t w = 0;

    kvt__nt_progress(nt);
    now = kvt_now_ns();
    for (size_t i = 0; i < nt->n_in; i++) {
        if (nt_serve_one(nt, parent, &nt->in[i], now)) {
            kvt_free(nt->in[i].keys);
            nt_serving(nt, nt->in[i].from, -1);
        } else
            nt->in[w++] = nt->in[i];
    }
    nt->n_in = w;
}

void kvt__nt_serve_link_closed(struct net_tier *nt, struct kvt_tp_ep *ep)
{
    for (size_t i = 0; i < nt->n_in; i++) {
        if (nt->in[i].ep == ep)
            nt->in[i].ep = NULL;
    }
}

/* ---- leases -------------------------------------------------------------------- */

/* Room for n_rows granted rows; the caller fills the rest once the job exists. */
static struct lease *nt_lease_new(uint32_t n_rows)
{
    return kvt_calloc(1, sizeof(struct lease) + (size_t)n_rows * sizeof(uint64_t));
}

/* Ends what the requester's device may read of the lease: at once (verbs: its
 * windows are deallocated). */
static void nt_lease_revoke(struct net_tier *nt, struct lease *l)
{
    struct kvt_transport *tp = kvt_peers_transport(nt->peers);

    kvt_tp_revoke(tp, l->grant);
    kvt_tp_revoke(tp, l->fence_grant);
    l->grant = l->fence_grant = NULL;
}

/* Exposes l's rows (and, unless fences are omitted, their fence words) to the
 * requester's endpoint and packs the two handles. When the rows need more windows
 * than one exposure holds, the lease keeps the first ones that fit and the others
 * join the denied list. 0, or the transport's error (nothing exposed). */
static int nt_lease_expose(struct net_tier *nt, struct lease *l, struct serve_scratch *sc,
                           uint32_t *n_denied, uint8_t *handle, size_t *handle_len,
                           uint8_t *fhandle, size_t *fhandle_len)
{
    uint64_t row = nt->base.row_bytes;
    uint32_t n = l->n_rows;
    struct kvt_tp_range *r = kvt_malloc((size_t)n * sizeof(*r));
    int rc;

    if (r == NULL)
        return -ENOMEM;
    for (;;) {
        for (uint32_t i = 0; i < n; i++)
            r[i] = (struct kvt_tp_range){.off = l->rows[i], .len = row};
        rc = kvt_tp_expose(l->ep, nt->mr_remote, r, n, handle, KVT_TP_MAX_HANDLE_SIZE, handle_len,
                           &l->grant);
        if (rc == 0 && !nt->omit_fences) {
            for (uint32_t i = 0; i < n; i++)
                r[i] = (struct kvt_tp_range){.off = l->rows[i] / row * sizeof(uint32_t),
                                             .len = sizeof(uint32_t)};
            rc = kvt_tp_expose(l->ep, nt->mr_fence, r, n, fhandle, KVT_TP_MAX_HANDLE_SIZE,
                               fhandle_len, &l->fence_grant);
        }
        if (rc != -EMSGSIZE || n == 1)
            break;
        nt_lease_revoke(nt, l);
        /* Scattered rows take a window each; rows across 2 GiB pieces two. */
        n = n > KVT_TP_MAX_EXPOSE_RANGES ? KVT_TP_MAX_EXPOSE_RANGES : n / 2;
    }
    kvt_free(r);
    if (rc != 0) {
        nt_lease_revoke(nt, l);
        return rc;
    }
    for (uint32_t i = n; i < l->n_rows; i++)
        sc->denied[(*n_denied)++] = sc->hit_idx[i];
    l->n_rows = n;
    return 0;
}

/* The lease's store job ended (the manager unpins its rows): reported at the next
 * get_finished_jobs, which frees the lease. Not in nt->leases any more. */
static void nt_lease_done(struct net_tier *nt, struct lease *l, bool success)
{
    nt_lease_revoke(nt, l);
    l->done =
        (struct nt_done){.job_id = l->job->id, .success = success, .seconds = -1, .bytes = -1};
    kvt__nt_job_done(nt, &l->done);
}

/* RELEASE, expiry, reaping, drain: the rows may no longer be read. */
static void nt_lease_end(struct net_tier *nt, struct lease *l, bool expired)
{
    if (expired)
        nt->c.lease_expiries++;
    kvt_map_remove_u64(&nt->leases, l->id);
    nt_serving(nt, l->from, -1);
    nt_lease_done(nt, l, true);
}

bool kvt__net_may_read(struct net_tier *nt, uint64_t peer_node_id, uint64_t off, uint64_t len)
{
    uint64_t row = nt->base.row_bytes, now = kvt_now_ns(), end;

    if (len == 0 || row == 0 || off > UINT64_MAX - len)
        return false;
    end = off + len;
    /* Row by row: each row the range touches must be granted to this peer. */
    for (uint64_t r = off - off % row; r < end; r += row) {
        struct kvt_map_entry *e;
        bool granted = false;

        for (size_t it = 0; !granted && kvt_map_next(&nt->leases, &it, &e);) {
            const struct lease *l = e->value;

            if (l->from != peer_node_id || now >= l->deadline_ns)
                continue;
            for (uint32_t i = 0; !granted && i < l->n_rows; i++)
                granted = l->rows[i] == r;
        }
        if (!granted)
            return false;
    }
    return true;
}

bool kvt__nt_may_read_fence(struct net_tier *nt, uint64_t peer_node_id, uint64_t off, uint64_t len)
{
    uint64_t first, last, row = nt->base.row_bytes;

    if (len == 0 || off > UINT64_MAX - len)
        return false;
    first = off / sizeof(uint32_t);
    last = (off + len - 1) / sizeof(uint32_t);
    if (last >= nt->base.num_chunks)
        return false;
    return kvt__net_may_read(nt, peer_node_id, first * row, (last - first + 1) * row);
}

void kvt__nt_on_release(struct net_tier *nt, uint64_t from, const struct kvt_wire_msg *m)
{
    struct lease *l = kvt_map_get_u64(&nt->leases, m->u.release.lease_id);

    if (l == NULL || l->from != from) {
        nt->c.refused++; /* also a RELEASE after its lease expired */
        return;
    }
    nt_lease_end(nt, l, false);
}

struct reap_match {
    uint64_t node;
    struct kvt_tp_ep *ep;
};

static void nt_reap_lease(struct net_tier *nt, void *v, void *arg)
{
    const struct reap_match *rm = arg;
    struct lease *l = v;

    if (rm->ep != NULL ? l->ep != rm->ep : l->from != rm->node)
        return;
    nt->c.leases_reaped++;
    nt_lease_end(nt, l, false);
}

void kvt__nt_reap_leases(struct net_tier *nt, uint64_t node, struct kvt_tp_ep *ep)
{
    struct reap_match rm = {.node = node, .ep = ep};

    kvt__nt_for_each(nt, &nt->leases, nt_reap_lease, &rm);
}

static void nt_expire_lease(struct net_tier *nt, void *v, void *arg)
{
    struct lease *l = v;

    if (*(const uint64_t *)arg >= l->deadline_ns)
        nt_lease_end(nt, l, true);
}

void kvt__nt_expire_leases(struct net_tier *nt, uint64_t now)
{
    kvt__nt_for_each(nt, &nt->leases, nt_expire_lease, &now);
}

static void nt_end_lease(struct net_tier *nt, void *v, void *arg)
{
    (void)arg;
    nt_lease_end(nt, v, false);
}

void kvt__nt_end_leases(struct net_tier *nt)
{
    kvt__nt_for_each(nt, &nt->leases, nt_end_lease, NULL);
}

void kvt__nt_serve_cleanup(struct net_tier *nt)
{
    struct kvt_map_entry *e;
    size_t it = 0;

    while (kvt_map_next(&nt->leases, &it, &e))
        nt_lease_revoke(nt, e->value);
    while (!kvt_list_empty(&nt->exposures))
        nt_direct_free(nt, kvt_list_entry(nt->exposures.next, struct direct_exp, link));
    kvt__nt_free_map(&nt->leases);
    for (size_t i = 0; i < nt->n_in; i++) {
        kvt_free(nt->in[i].keys);
        if (nt->in[i].ctx != NULL)
            kvt_req_ctx_unref(nt->in[i].ctx);
    }
    kvt_free(nt->in);
}

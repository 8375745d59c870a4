/* SPDX-License-Identifier: Apache-2.0 */
/* The network tier (kvt/net_tier.h): the other nodes' primary tiers as this node's
 * slowest secondary tier. This file is the tier itself - the ops table, create and
 * destroy, the poll, finished jobs, stats - and the peer callbacks, which hand each
 * message to its role: lookups and the directory (net_locate.c), publication
 * (net_publish.c), loads (net_fetch.c) and serving peers (net_serve.c). Their shared
 * state, and which thread touches what, is net_tier_int.h.
 *
 * Everything runs on the loop thread: the async lookup helper has no worker here
 * (submit mode); its flush queues the keys on the loop, which answers from
 * LOCATE_REPLYs and its own directory and completes the helper's item. */
#include <errno.h>
#include <inttypes.h>
#include <sched.h>
#include <stdio.h>
#include <string.h>
#include <sys/eventfd.h>
#include <time.h>
#include <unistd.h>

#include "kvt/alloc.h"
#include "kvt/clock.h"
#include "kvt/log.h"
#include "kvt/net_tier_test.h"
#include "kvt/vec.h"
#include "net_tier_int.h"

/* ---- helpers the roles share --------------------------------------------------- */

void kvt__nt_for_each(struct net_tier *nt, const struct kvt_map *m, kvt__nt_visit_fn fn, void *arg)
{
    struct kvt_map_entry *e;

    /* The map allows removing the current entry while iterating (kvt/map.h). */
    for (size_t it = 0; kvt_map_next(m, &it, &e);)
        fn(nt, e->value, arg);
}

int kvt__nt_keyvec_push(struct keyvec *kv, const struct kvt_key *k)
{
    if (kvt_vec_reserve(kv->v, kv->cap, kv->n + 1, 64) < 0)
        return -ENOMEM;
    kv->v[kv->n++] = *k;
    return 0;
}

void kvt__nt_keyvec_free(struct keyvec *kv)
{
    kvt_free(kv->v);
    memset(kv, 0, sizeof(*kv));
}

/* Every message of the tier goes through kvt__nt_send or kvt__nt_send_bulk: a message
 * that could not be sent is counted and logged (the protocol recovers by timeouts,
 * TTLs and re-publication). */
static int nt_sent(struct net_tier *nt, uint64_t node, const struct kvt_wire_msg *m, int rc)
{
    if (rc != 0) {
        nt->c.send_failures++;
        kvt_info(NT_MOD, "%s to %016" PRIx64 " not sent: %s", kvt_wire_type_name((int)m->type),
                 node, strerror(-rc));
    }
    return rc;
}

int kvt__nt_send_bulk(struct net_tier *nt, uint64_t node, const struct kvt_wire_msg *m)
{
    int rc = kvt_peers_send_bulk(nt->peers, node, m);

    return rc == -EAGAIN ? rc : nt_sent(nt, node, m, rc);
}

int kvt__nt_send(struct net_tier *nt, uint64_t node, struct kvt_tp_ep *ep,
                 const struct kvt_wire_msg *m)
{
    return nt_sent(nt, node, m,
                   ep != NULL ? kvt_peers_reply(nt->peers, ep, m)
                              : kvt_peers_send(nt->peers, node, m));
}

struct nt_peer *kvt__nt_peer_get(struct net_tier *nt, uint64_t node)
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

/* Undoes kvt__nt_register, whatever part of it was done. */
static void nt_dereg(struct net_tier *nt)
{
    struct kvt_transport *tp = kvt_peers_transport(nt->peers);
    struct kvt_tp_mr **mrs[] = {&nt->mr_fence_in, &nt->mr_fence, &nt->mr_local, &nt->mr_remote};

    for (size_t i = 0; i < KVT_ARRAY_SIZE(mrs); i++) {
        if (*mrs[i] != NULL)
            kvt_tp_dereg(*mrs[i], tp);
        *mrs[i] = NULL;
    }
    if (nt->fence_in != NULL)
        kvt_free_table(nt->fence_in, nt->base.num_chunks, sizeof(*nt->fence_in));
    nt->fence_in = NULL;
}

bool kvt__nt_register(struct net_tier *nt)
{
    struct kvt_transport *tp = kvt_peers_transport(nt->peers);
    size_t len = nt->base.num_chunks * nt->base.row_bytes, n_words = 0;
    const _Atomic uint32_t *words = kvt_primary_fence_words(nt->primary, &n_words);
    int rc;

    if (nt->mr_remote != NULL)
        return true;
    if (nt->reg_failed || nt->base.primary_base == NULL || len == 0)
        return false;
    rc = n_words == nt->base.num_chunks ? 0 : -EINVAL;
    if (rc == 0) {
        nt->fence_in = kvt_calloc_table(n_words, sizeof(*nt->fence_in));
        rc = nt->fence_in != NULL ? 0 : -ENOMEM;
    }
    if (rc == 0)
        rc = kvt_tp_reg_granted(tp, nt->base.primary_base, len, &nt->mr_remote);
    if (rc == 0)
        rc = kvt_tp_reg_local(tp, nt->base.primary_base, len, &nt->mr_local);
    if (rc == 0)
        rc = kvt_tp_pack(tp, nt->mr_remote, nt->handle, sizeof(nt->handle), &nt->handle_len);
    /* Peers READ the words; the primary writes them (never through a pointer of
     * ours: registration only needs the address). */
    if (rc == 0)
        rc = kvt_tp_reg_granted(tp, (void *)(uintptr_t)words, n_words * sizeof(*words),
                                &nt->mr_fence);
    if (rc == 0)
        rc = kvt_tp_reg_local(tp, nt->fence_in, n_words * sizeof(*nt->fence_in), &nt->mr_fence_in);
    if (rc == 0)
        rc = kvt_tp_pack(tp, nt->mr_fence, nt->fence_handle, sizeof(nt->fence_handle),
                         &nt->fence_handle_len);
    if (rc != 0) {
        kvt_error(NT_MOD, "cannot register the primary region (%zu bytes) and its fence words: %s",
                  len, strerror(-rc));
        nt_dereg(nt);
        nt->reg_failed = true;
        return false;
    }
    return true;
}

int kvt__net_tier_test_handle(struct kvt_tier *t, const void **handle_p, size_t *len_p)
{
    struct net_tier *nt = nt_of(t);

    if (!kvt__nt_register(nt))
        return -EIO;
    *handle_p = nt->handle;
    *len_p = nt->handle_len;
    return 0;
}

bool kvt__net_tier_test_may_read_fence(struct kvt_tier *t, uint64_t peer_node_id, uint64_t off,
                                       uint64_t len)
{
    return kvt__nt_may_read_fence(nt_of(t), peer_node_id, off, len);
}

void kvt__net_tier_test_omit_fences(struct kvt_tier *t)
{
    nt_of(t)->omit_fences = true;
}

static void nt_on_member(void *arg, const struct kvt_member_event *ev);

void kvt__net_tier_test_member_event(struct kvt_tier *t, const struct kvt_member_event *ev)
{
    nt_on_member(nt_of(t), ev);
}

/* ---- finished jobs ------------------------------------------------------------- */

/* Only the manager's next schedule end reports it (get_finished_jobs), and until
 * then the tier does not arm (nt_has_local_work): news, so the loop steps now. A
 * job that waited for the tick kept the loop polling that long, a process the
 * scheduler then treats as busy, and a peer's next message waited for its turn on a
 * core instead of waking it. */
void kvt__nt_job_done(struct net_tier *nt, struct nt_done *d)
{
    kvt_list_add_tail(&nt->done, &d->link);
    nt->news++;
}

static void nt_get_finished_jobs(struct kvt_tier *t, kvt_job_result_cb_t cb, void *arg)
{
    struct net_tier *nt = nt_of(t);
    struct kvt_list done, *pos, *tmp;

    /* The callbacks may hand us new jobs that end at once: they wait for the next
     * call, on a list of their own. */
    kvt_list_move_all(&nt->done, &done);
    kvt_list_for_each_safe(pos, tmp, &done)
    {
        struct nt_done *d = kvt_list_entry(pos, struct nt_done, link);
        struct kvt_job_result r = {.job_id = d->job_id,
                                   .success = d->success,
                                   .successful_keys = d->ok_keys,
                                   .n_successful = d->n_ok,
                                   .transfer_time = d->seconds,
                                   .transfer_bytes = d->bytes};

        kvt_list_del(&d->link);
        cb(arg, &r);
        kvt_free(d); /* with the load_job or lease it opens */
    }
}

/* ---- peer callbacks: each message to its role ---------------------------------- */

static void nt_on_msg(void *arg, uint64_t from, struct kvt_tp_ep *ep, const struct kvt_wire_msg *m)
{
    struct net_tier *nt = arg;

    switch (m->type) {
    case KVT_WIRE_PUBLISH:
    case KVT_WIRE_UNPUBLISH:
        kvt__nt_on_publish(nt, from, ep, m);
        break;
    case KVT_WIRE_LOCATE:
        kvt__nt_on_locate(nt, ep, m);
        break;
    case KVT_WIRE_LOCATE_REPLY:
        kvt__nt_on_locate_reply(nt, from, m);
        break;
    case KVT_WIRE_FETCH:
        kvt__nt_on_fetch(nt, from, ep, m);
        break;
    case KVT_WIRE_GRANT:
        kvt__nt_on_grant(nt, from, ep, m);
        break;
    case KVT_WIRE_DENY:
        kvt__nt_on_deny(nt, from, m);
        break;
    case KVT_WIRE_RELEASE:
        kvt__nt_on_release(nt, from, m);
        break;
    default:
        nt->c.refused++;
        break;
    }
}

static void nt_on_member(void *arg, const struct kvt_member_event *ev)
{
    struct net_tier *nt = arg;
    uint64_t keep_from = ev->kind == KVT_MEMBER_RESTARTED ? ev->incarnation : UINT64_MAX;

    if (ev->kind == KVT_MEMBER_DROPPED_US) { /* homes did not move: our records did */
        kvt_info(NT_MOD, "member %016" PRIx64 " dropped our records: publishing them again",
                 ev->node_id);
        nt->republish_all = true;
        return;
    }
    kvt_info(NT_MOD, "member %016" PRIx64 " %s", ev->node_id,
             ev->kind == KVT_MEMBER_JOINED    ? "joined"
             : ev->kind == KVT_MEMBER_DOWN_EV ? "is down"
                                              : "restarted");
    if (ev->kind != KVT_MEMBER_JOINED) {
        size_t dropped = kvt_directory_drop_node(nt->dir, ev->node_id, keep_from);

        if (dropped > 0)
            kvt_info(NT_MOD, "dropped %zu directory records of member %016" PRIx64, dropped,
                     ev->node_id);
        kvt__nt_forget_holders(nt, ev->node_id, keep_from);
        kvt__nt_fail_locates(nt, ev->node_id);
        kvt__nt_fail_fetches(nt, ev->node_id, keep_from, NULL);
        kvt__nt_reap_leases(nt, ev->node_id, NULL);
    }
    nt->republish_all = true; /* homes moved */
    /* The keys homed elsewhere now go once every node can have seen this change
     * (each calls a silent member down within the longest silence allowed; twice
     * that): a home whose view lags a publisher's would otherwise drop what that
     * publisher, already past the change, sent it as their home, and the publisher
     * would not send them again before its periodic republication. */
    nt->retain_at_ns =
        kvt_now_ns() + 2 * kvt_members_longest_silence_ns(kvt_peers_members(nt->peers)) + 1000 * MS;
}

static void nt_on_link_closed(void *arg, uint64_t node_id, struct kvt_tp_ep *ep)
{
    struct net_tier *nt = arg;

    (void)node_id;
    kvt__nt_fetch_link_closed(nt, ep);
    kvt__nt_direct_link_closed(nt, ep);
    kvt__nt_reap_leases(nt, 0, ep);
    kvt__nt_serve_link_closed(nt, ep);
}

/* ---- the tier ops -------------------------------------------------------------- */

static bool nt_in_flight(struct net_tier *nt);

#define NT_POLL_TURN_MAX_NS 50000ull

int kvt__nt_progress(struct net_tier *nt)
{
    uint64_t t0 = kvt_now_ns(), now;
    int rc;

    rc = kvt_peers_progress(nt->peers);
    kvt__nt_take_locates(nt);
    now = kvt_now_ns();
    /* The busy poll's time: from a call that found nothing to this one's start (the
     * work an event brings is not in it). A turn of a polling loop is a few us: a
     * longer gap is the process preempted or the loop at other work, not polling. */
    if (nt->idle_since_ns != 0 && t0 - nt->idle_since_ns < NT_POLL_TURN_MAX_NS)
        nt->c.idle_poll_ns += t0 - nt->idle_since_ns;
    nt->idle_since_ns = 0;
    if (rc > 0) {
        nt->last_event_ns = now;
    } else if (rc == 0 && (nt_in_flight(nt) || now < nt->direct_awake_until_ns)) {
        nt->c.idle_polls++;
        nt->idle_since_ns = t0;
        /* Nothing arrived: another thread of this CPU (the peer a transfer waits on,
         * when it shares the host, or an engine's) runs first. With a process that
         * keeps a core busy beside two nodes on 2 vCPUs, the pull went from 0.9-1.0
         * to 2.2-2.4 GB/s over shared memory; alone on its core it returns at once. */
        sched_yield();
    }
    /* Deadlines are in ms: the scans of the maps run once a ms, not on
     * every poll of a busy loop. */
    if (now >= nt->next_expire_ns) {
        nt->next_expire_ns = now + MS;
        kvt__nt_expire_locates(nt, now);
        kvt__nt_expire_fetches(nt, now);
        kvt__nt_expire_leases(nt, now);
    }
    kvt__nt_pump(nt);
    kvt__nt_into_deliver(nt);
    return rc;
}

int kvt_net_tier_poll(struct kvt_tier *t)
{
    struct net_tier *nt = nt_of(t);
    int rc = kvt__nt_progress(nt);

    kvt__nt_flush_publishes(nt);
    return rc;
}

int kvt_net_tier_wake_fd(struct kvt_tier *t)
{
    return nt_of(t)->wake_fd;
}

/* The tier's news (kvt_tier_news): a peer's FETCH parked for the serving loop, a job
 * ended and not yet reported (a load of ours, a peer's lease its RELEASE ended, a
 * publication), again after a schedule end that did not report one. The tier does
 * not arm while such work waits. */
static uint64_t nt_news(struct kvt_tier *t)
{
    return nt_of(t)->news;
}

/* Work of ours the loop must do: peers' requests parked for the serving loop, loads
 * ended and not yet reported. */
static bool nt_has_local_work(struct net_tier *nt)
{
    return nt->n_in > 0 || !kvt_list_empty(&nt->done) || !kvt_list_empty(&nt->into_done);
}

/* Transfers in flight: our fetches, peers' leases on our rows. */
static bool nt_in_flight(struct net_tier *nt)
{
    return kvt_map_size(&nt->fetches) > 0 || kvt_map_size(&nt->leases) > 0;
}

static int nt_drain_jobs(struct kvt_tier *t)
{
    struct net_tier *nt = nt_of(t);

    /* Our own loads end by their deadlines; peers' leases end now (their READs then
     * fail their checksums if a slot is reused: a miss, not wrong bytes). */
    while (kvt_map_size(&nt->fetches) > 0) {
        kvt__nt_progress(nt);
        if (kvt_map_size(&nt->fetches) > 0)
            usleep(1000);
    }
    kvt__nt_end_leases(nt);
    return 0;
}

/* After the manager drained us and cleared the primary: the primary's removed hook
 * queued every publication for UNPUBLISH; they leave now, not at the next flush
 * (those a link has no send credits for, a ms or so later). */
static int nt_reset(struct kvt_tier *t)
{
    kvt__nt_reset(nt_of(t));
    return 0;
}

static bool nt_has_pending_work(struct kvt_tier *t)
{
    struct net_tier *nt = nt_of(t);

    return nt_has_local_work(nt) || nt_in_flight(nt);
}

/* The loop's hooks: the tier's wake eventfd and the peer links' transport fd;
 * the loop may sleep only with the transport armed, and with transfers in flight
 * only after busy_poll_us without an event (nt_arm). */
static size_t nt_event_fds(struct kvt_tier *t, int *fds, size_t cap)
{
    struct net_tier *nt = nt_of(t);
    int pfd = kvt_peers_event_fd(nt->peers);
    size_t n = 0;

    if (n < cap)
        fds[n++] = nt->wake_fd;
    if (n < cap && pfd >= 0)
        fds[n++] = pfd;
    return n;
}

static int nt_arm(struct kvt_tier *t)
{
    struct net_tier *nt = nt_of(t);
    uint64_t now;
    int rc;

    if (nt_has_local_work(nt))
        return -EAGAIN;
    now = kvt_now_ns();
    /* With transfers in flight the loop polls: over transports that serve READs in
     * software our progress moves their bytes (in direct mode there is no lease, so
     * for a while after a direct READ was served). Not longer than busy_poll_us
     * after the transport's last event: then it sleeps on the transport's events,
     * which wake it for the next message, READ or completion, instead of taking a
     * core from the other processes of a loaded host (the tick bounds the sleep;
     * deadlines are counted in ms). */
    if ((nt_in_flight(nt) || now < nt->direct_awake_until_ns) &&
        (nt->cfg.busy_poll_us == 0 ||
         now - nt->last_event_ns < (uint64_t)nt->cfg.busy_poll_us * 1000))
        return -EAGAIN;
    rc = kvt_peers_arm(nt->peers);
    if (rc == 0)
        nt->idle_since_ns = 0; /* the loop may sleep now: not polling */
    return rc;
}

/* Publications waiting for a link's send credits are tried again then (a loop with
 * a long tick would otherwise leave them until its next step or message). */
static uint64_t nt_wake_at_ns(struct kvt_tier *t)
{
    struct net_tier *nt = nt_of(t);

    return nt->n_later > 0 ? nt->next_flush_ns : 0;
}

static void nt_on_request_finished(struct kvt_tier *t, struct kvt_req_ctx *ctx)
{
    kvt_async_lookup_cleanup(nt_of(t)->al, ctx->req_id);
}

static void nt_on_schedule_end(struct kvt_tier *t, const struct kvt_schedule_end_ctx *ctx)
{
    struct net_tier *nt = nt_of(t);

    (void)ctx;
    if (kvt_async_lookup_flush(nt->al) != 0)
        kvt_warn(NT_MOD, "out of memory: lookups wait for the next step");
    else if (nt->lookup_first_ns != 0) { /* their LOCATEs leave in the progress below */
        nt_observe(nt, KVT_M_NET_LOOKUP_QUEUE_SECONDS, kvt_now_ns() - nt->lookup_first_ns);
        nt->lookup_first_ns = 0;
    }
    kvt__nt_progress(nt);
    kvt__nt_flush_publishes(nt);
    /* A job this schedule end did not report (the manager takes finished jobs once
     * a step, and an engine's lookup may have taken them before this one ended):
     * news again, so the loop steps once more, instead of polling until its tick. */
    if (!kvt_list_empty(&nt->done))
        nt->news++;
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
    rc |= nt_stat(out, KVT_M_NET_INTO_CHUNKS, label, c->into_chunks, &r->into_chunks);
    rc |= nt_stat(out, KVT_M_NET_CHECKSUM_FAIL, label, c->checksum_failures, &r->checksum_failures);
    rc |= nt_stat(out, KVT_M_NET_FENCE_FAIL, label, c->fence_failures, &r->fence_failures);
    rc |= nt_stat(out, KVT_M_NET_LEASE_EXPIRED, label, c->lease_expiries, &r->lease_expiries);
    rc |= nt_stat(out, KVT_M_NET_FETCH_FAILED, label, c->failed_fetches, &r->failed_fetches);
    rc |= nt_stat(out, KVT_M_NET_REFUSED, label, c->refused, &r->refused);
    rc |= nt_stat(out, KVT_M_NET_DIRECT_CHUNKS, label, c->direct_chunks, &r->direct_chunks);
    rc |= nt_stat(out, KVT_M_NET_DIRECT_MISSES, label, c->direct_misses, &r->direct_misses);
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
    rc |= kvt_stats_aggregate(out, &nt->phases);
    kvt_stats_clear(&nt->phases);
    rc |= kvt_stats_set_gauge(out, KVT_M_NET_LEASES, label, (double)kvt_map_size(&nt->leases));
    rc |= kvt_stats_set_gauge(out, KVT_M_NET_RECORDS, label,
                              (double)kvt_directory_num_records(nt->dir));
    rc |= kvt_stats_set_gauge(out, KVT_M_NET_PUBLISH_WAITING, label,
                              (double)kvt__nt_later_pending(nt));
    return rc != 0 ? -ENOMEM : 0;
}

/* The transport's question for every READ a peer asks of us (UCX serves them in
 * software): only rows of the primary granted to that peer by a lease still held;
 * in direct mode also anything of the primary and its fence words on a link we
 * exposed them to (an authenticated peer that asked: kvt__nt_direct_exposed). */
static bool nt_may_read(void *arg, uint64_t node_id, struct kvt_tp_ep *ep, struct kvt_tp_mr *mr,
                        uint64_t off, uint64_t len)
{
    struct net_tier *nt = arg;

    if (mr != NULL && (mr == nt->mr_remote || mr == nt->mr_fence) &&
        kvt__nt_direct_exposed(nt, ep)) {
        /* Counts as busy a little (nt_arm): the peer's next READs follow. */
        nt->direct_awake_until_ns = kvt_now_ns() + NT_DIRECT_AWAKE_NS;
        return true;
    }
    if (mr != NULL && mr == nt->mr_fence)
        return kvt__nt_may_read_fence(nt, node_id, off, len);
    return mr != NULL && mr == nt->mr_remote && kvt__net_may_read(nt, node_id, off, len);
}

const char *kvt_net_fence_reason_name(unsigned r)
{
    static const char *const names[KVT_NET_FENCE_N_REASONS] = {
        [KVT_NET_FENCE_CHANGED] = "changed",
        [KVT_NET_FENCE_WRITING] = "writing",
        [KVT_NET_FENCE_UNREAD] = "unread",
    };

    return r < KVT_NET_FENCE_N_REASONS ? names[r] : "?";
}

static const struct kvt_tier_ops nt_ops;

bool kvt_net_tier_is(const struct kvt_tier *t)
{
    return t != NULL && t->ops == &nt_ops;
}

bool kvt_net_tier_may_read(struct kvt_tier *t, uint64_t peer_node_id, uint64_t off, uint64_t len)
{
    return kvt__net_may_read(nt_of(t), peer_node_id, off, len);
}

void kvt_net_tier_counts(struct kvt_tier *t, struct kvt_net_tier_counts *out)
{
    struct net_tier *nt = nt_of(t);

    *out = nt->c;
    out->active_leases = kvt_map_size(&nt->leases);
    out->directory_records = kvt_directory_num_records(nt->dir);
    out->published_keys = kvt_map_size(&nt->published);
    out->publish_waiting = kvt__nt_later_pending(nt);
    out->direct_exposed_links = 0;
    for (struct kvt_list *pos = nt->exposures.next; pos != &nt->exposures; pos = pos->next)
        out->direct_exposed_links++;
}

static int nt_shutdown(struct kvt_tier *t)
{
    struct net_tier *nt = nt_of(t);

    if (nt->shut)
        return 0;
    kvt_async_lookup_shutdown(nt->al);
    nt->shut = true;
    nt_drain_jobs(t);
    /* Unpublish what we hold: peers stop asking us at once, not at the TTL. */
    kvt__nt_on_removed(nt, NULL, 0);
    kvt__nt_flush_keys(nt, &nt->unpub, KVT_WIRE_UNPUBLISH);
    if (kvt__nt_later_pending(nt) > 0) /* the peers drop them when they call us down */
        kvt_info(NT_MOD,
                 "%zu publications and unpublications not sent at shutdown (no send "
                 "credits): peers drop the records when they call this node down",
                 kvt__nt_later_pending(nt));
    kvt_primary_set_removed_hook(nt->primary, NULL, NULL);
    return 0;
}

/* Frees every value of m, then m. */
void kvt__nt_free_map(struct kvt_map *m)
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
    struct kvt_list *pos, *tmp;

    nt_shutdown(t);
    kvt_peers_set_handlers(nt->peers, NULL);
    kvt_async_lookup_destroy(nt->al);
    kvt__nt_locate_cleanup(nt);
    kvt__nt_fetch_cleanup(nt);
    kvt__nt_into_cleanup(nt);
    kvt__nt_serve_cleanup(nt);
    kvt__nt_free_map(&nt->nodes);
    kvt_map_cleanup(&nt->published);
    kvt_list_for_each_safe(pos, tmp, &nt->done)
    {
        kvt_list_del(pos);
        kvt_free(kvt_list_entry(pos, struct nt_done, link));
    }
    kvt__nt_keyvec_free(&nt->pub);
    kvt__nt_keyvec_free(&nt->unpub);
    kvt__nt_later_free(nt);
    nt_dereg(nt);
    kvt_directory_destroy(nt->dir);
    kvt_stats_cleanup(&nt->phases);
    close(nt->wake_fd);
    kvt_free(nt);
}

static const struct kvt_tier_ops nt_ops = {
    .lookup = kvt__nt_lookup,
    .submit_store = kvt__nt_submit_store,
    .submit_load = kvt__nt_submit_load,
    .get_finished_jobs = nt_get_finished_jobs,
    .drain_jobs = nt_drain_jobs,
    .has_pending_work = nt_has_pending_work,
    .event_fds = nt_event_fds,
    .poll = kvt_net_tier_poll,
    .arm = nt_arm,
    .wake_at_ns = nt_wake_at_ns,
    .news = nt_news,
    .on_request_finished = nt_on_request_finished,
    .serve_external_requests = kvt__nt_serve,
    .on_schedule_end = nt_on_schedule_end,
    .get_stats = nt_get_stats,
    .reset = nt_reset,
    .shutdown = nt_shutdown,
    .destroy = nt_destroy,
};

int kvt_net_tier_create(const struct kvt_net_tier_config *cfg, struct kvt_tier **t_p)
{
    struct net_tier *nt;
    struct kvt_peers_handlers h;
    int rc;

    if (cfg == NULL || cfg->peers == NULL || cfg->primary == NULL || t_p == NULL ||
        (cfg->verify != KVT_NET_VERIFY_FENCE && cfg->verify != KVT_NET_VERIFY_CHECKSUM) ||
        (cfg->fetch != KVT_NET_FETCH_LEASE && cfg->fetch != KVT_NET_FETCH_DIRECT))
        return -EINVAL;
    nt = kvt_calloc(1, sizeof(*nt));
    if (nt == NULL)
        return -ENOMEM;
    kvt_tier_init(&nt->base, &nt_ops, "network", KVT_MEDIUM_CPU, KVT_REMOTE);
    kvt_stats_init(&nt->phases);
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
    DEFAULT(max_records_per_node, 1u << 20);
    DEFAULT(serve_per_peer, 4096);
#undef DEFAULT
    if (nt->cfg.max_holders > 16)
        nt->cfg.max_holders = 16;
    nt->peers = cfg->peers;
    nt->primary = cfg->primary;
    nt->self = kvt_peers_self(cfg->peers);
    nt->next_id = 1;
    nt->lq_tail = &nt->lq_head;
    kvt_list_init(&nt->done);
    kvt_list_init(&nt->regions);
    kvt_list_init(&nt->into_done);
    kvt_list_init(&nt->exposures);
    nt->next_republish_ns = kvt_now_ns() + ms_ns(nt->cfg.record_ttl_ms) / 2;
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
    kvt_directory_set_node_limit(nt->dir, nt->cfg.max_records_per_node, nt->self);
    /* Every lookup queued behind a round trip goes out with the next one. */
    rc = kvt_async_lookup_create_submit("network", kvt__nt_lookup_submit, nt, &nt->al);
    if (rc != 0)
        goto fail;
    h = (struct kvt_peers_handlers){.on_msg = nt_on_msg,
                                    .on_member = nt_on_member,
                                    .on_link_closed = nt_on_link_closed,
                                    .may_read = nt_may_read,
                                    .arg = nt};
    kvt_peers_set_handlers(nt->peers, &h);
    kvt_primary_set_removed_hook(nt->primary, kvt__nt_on_removed, nt);
    *t_p = &nt->base;
    return 0;
fail:
    if (nt->dir != NULL)
        kvt_directory_destroy(nt->dir);
    if (nt->wake_fd >= 0)
        close(nt->wake_fd);
    kvt_free(nt);
    return rc;
}

/* SPDX-License-Identifier: Apache-2.0 */
/* Private parts of the network tier (kvt/net_tier.h), shared by its five files:
 *   net_tier.c     the ops table, create/destroy, the poll, finished jobs, stats and
 *                  the peer callbacks that fan out to the roles below
 *   net_locate.c   requester: lookups by LOCATE (the worker's queue, the loop's
 *                  parts); home: the location directory (PUBLISH/UNPUBLISH, LOCATE)
 *   net_publish.c  holder: publishing what the primary holds, unpublishing evictions
 *   net_fetch.c    requester: a load as FETCH, GRANT, READ, validation (fences or
 *                  checksums), RELEASE
 *   net_serve.c    holder: inbound FETCHes, the serving loop, leases
 *
 * Threads: everything runs on the loop thread (the manager's scheduler thread; the
 * transport's callbacks run inside its progress, on the same thread). The async
 * lookup helper has no worker here (kvt_async_lookup_create_submit): its flush hands
 * a step's keys to kvt__nt_lookup_submit on the loop thread, so nothing here takes
 * a lock (the helper locks its own lists in kvt_async_lookup_complete). */
#ifndef KVT_NET_TIER_INT_H
#define KVT_NET_TIER_INT_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdbool.h>
#include <stdio.h>

#include "kvt/async_lookup.h"
#include "kvt/common.h"
#include "kvt/directory.h"
#include "kvt/list.h"
#include "kvt/map.h"
#include "kvt/net_tier.h"
#include "kvt/placement.h"
#include "kvt/stats.h"

#define NT_MOD "net"
/* Keys per PUBLISH/UNPUBLISH/LOCATE/FETCH: keeps every message far below the
 * transport's 64 KiB control-message default. */
#define NT_KEYS_PER_MSG 256
#define NT_MAX_NODES    KVT_MEMBERS_MAX
#define MS              1000000ull
/* After serving a peer's direct READ (software transports), the loop counts as busy
 * for this long, as a lease keeps it while granted rows are read (both within
 * busy_poll_us of the transport's last event: nt_arm). */
#define NT_DIRECT_AWAKE_NS (20 * MS)

/* ---- the lookups' LOCATEs ------------------------------------------------------- */

/* A step's lookup keys, queued by kvt__nt_lookup_submit until the loop sends their
 * LOCATEs; then owned by its locate_op until answered. */
struct locate_req {
    struct locate_req *next;
    struct kvt_key *keys; /* a copy */
    size_t n;
    bool *found; /* the helper's item's: the verdicts, written when answered */
    void *token; /* the helper's item (kvt_async_lookup_complete) */
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
    /* Where the key sits in the holder's primary, when the home knew (direct). */
    uint64_t row;
    uint32_t gen;
    bool has_row;
};

/* A job's finished record. It is part of what the tier keeps for the job from the
 * moment it accepts it - the first member of the load_job, of the lease, or a
 * store's record on its own - goes on nt->done when the job ends and is freed, with
 * what it is part of, after get_finished_jobs reported it: reporting a job never
 * allocates and cannot fail. */
struct nt_done {
    struct kvt_list link; /* on nt->done once the job ended */
    kvt_job_id_t job_id;
    bool success;
    const struct kvt_key *ok_keys; /* successful_keys of a failed load, or NULL */
    size_t n_ok;
    double seconds; /* -1: not measured */
    int64_t bytes;  /* -1: not measured */
};

/* A load job: made whole at submit (job->n entries in each array, one allocation),
 * freed after its report. A fetch-into job (region not NULL) is the same with a
 * job of its own (own: keys copied, no chunk ids) and a destination per key; it
 * ends on nt->into_done, and is freed after its callback, through its link. */
struct load_job {
    struct nt_done done; /* first: the block is freed through it */
    const struct kvt_job *job;
    struct kvt_net_region *region; /* fetch into: where the rows land; else NULL */
    uint64_t *dst_off;             /* fetch into: key i's row at region->base + dst_off[i] */
    kvt_net_into_cb_t cb;
    void *cb_arg;
    struct kvt_job own;
    size_t parts_pending; /* fetches not ended, + 1 while submit runs */
    uint64_t start_ns;
    uint64_t bytes;
    uint32_t *idx;           /* submit's scratch: one fetch's key indexes */
    struct kvt_key *ok_keys; /* the report's successful keys */
    bool *ok;                /* key i was read and verified */
    bool *used;              /* submit's scratch: key i is in a fetch, or failed */
};

/* A fetch waits QUEUED on its peer until fewer than fetches_per_peer of that peer's
 * fetches are SENT or READING; its deadline starts when its FETCH leaves. */
enum { F_QUEUED, F_SENT, F_READING };

/* A fetch and its arrays (idx, chunks, chunk_ok: n entries each) are one block,
 * made at submit: a GRANT is validated and read without allocating. */
struct fetch {
    uint64_t id;
    struct load_job *lj;
    uint64_t node, incarnation;
    int state;
    struct kvt_list qnode; /* on its nt_peer's queue while QUEUED */
    uint64_t queued_ns, sent_ns, grant_ns;
    uint32_t *idx; /* job key indexes, in FETCH order (n <= NT_KEYS_PER_MSG) */
    uint32_t n;
    uint64_t deadline_ns, lease_deadline_ns;
    uint64_t lease_id;
    struct kvt_tp_ep *ep;
    struct kvt_tp_rkey *rk;
    struct kvt_tp_rkey *fk;        /* the holder's fence words; NULL: checked by checksum */
    struct kvt_wire_chunk *chunks; /* the GRANT's, at most n (checked) */
    bool *chunk_ok;                /* chunk i read and verified */
    uint32_t n_chunks, next_chunk;
    unsigned batches_in_flight;
    bool failed; /* timed out, link lost or peer down: no more batches, no RELEASE */
    bool direct; /* no FETCH/GRANT/RELEASE: chunks from the holders' places; rk and
                    fk are the peer's (nt_peer.direct_*), not the fetch's */
};

/* A batch of a fetch's READs: its rows, then (fence mode) the same batch again for
 * their fence words, posted from the rows' completion. */
struct batch {
    struct net_tier *nt;
    uint64_t fetch_id;
    uint32_t first, n;
    bool fences;      /* the READ in flight is of the fence words */
    uint32_t n_words; /* fetch into with fences: n words of nt->into_fence, held */
    uint32_t words[]; /* chunk first + i's fence word lands in into_fence[words[i]] */
};

/* A caller's region for fetch into (kvt/net_tier.h). jobs counts its load jobs not
 * yet freed: a removed region is deregistered and handed back when it reaches 0,
 * so no READ lands in memory the caller unmapped. */
struct kvt_net_region {
    struct kvt_list link; /* nt->regions */
    uint8_t *base;
    size_t len;
    struct kvt_tp_mr *mr;
    unsigned jobs;
    bool removed;
    kvt_net_region_free_cb free_cb;
};

/* Fence words of fetch-into READs land in a pool of their own (the primary's
 * fence_in is indexed by primary slot): a batch takes a word per chunk when its
 * rows are posted and gives them back when it is freed. */
#define NT_INTO_FENCE_WORDS 4096u

struct inbound { /* a peer's FETCH waiting for the serving loop */
    uint64_t from, from_inc;
    struct kvt_tp_ep *ep; /* NULL once the link closed */
    uint64_t fetch_id;
    struct kvt_key *keys;
    uint32_t n;
    uint64_t arrival_ns;
    struct kvt_req_ctx *ctx; /* after on_new_request */
    bool direct;             /* the FETCH asked for the handles of direct reads */
};

/* Holder side of direct reads: our whole primary and fence words exposed to one
 * authenticated peer's endpoint (it asked in a FETCH), until that link closes; the
 * handles go in the GRANTs on it. In nt->exposures. */
struct direct_exp {
    struct kvt_list link;
    struct kvt_tp_ep *ep;
    struct kvt_tp_grant *grant, *fence_grant; /* NULL over software-checked transports */
    size_t handle_len, fence_handle_len;
    uint8_t handle[KVT_TP_MAX_HANDLE_SIZE], fence_handle[KVT_TP_MAX_HANDLE_SIZE];
};

/* A GRANT's lease: the store job that pins the granted rows, and the rows (their
 * offsets in the primary region, each row_bytes long) the peer may read until it
 * ends. Made before the job, so ending it cannot fail; in nt->leases while active,
 * then on nt->done until reported. */
struct lease {
    struct nt_done done; /* first: the lease is freed through it */
    uint64_t id;
    const struct kvt_job *job;
    uint64_t from;
    struct kvt_tp_ep *ep;
    uint64_t deadline_ns;
    /* What the requester's device may read (kvt_tp_expose: its rows and their fence
     * words, to its endpoint alone), revoked when the lease ends; NULL over
     * transports that check each READ in software (may_read). */
    struct kvt_tp_grant *grant, *fence_grant;
    uint32_t n_rows;
    uint64_t rows[]; /* granted row offsets */
};

struct keyvec {
    struct kvt_key *v;
    size_t n, cap;
};

/* The keys waiting for one home whose link had no send credits to spare when they
 * were flushed, placed under the membership of that flush (net_publish.c): a
 * membership change places them again. */
struct nt_later {
    uint64_t home;
    struct keyvec kv[2]; /* to PUBLISH, to UNPUBLISH */
    size_t head[2];      /* kv[i].v[0..head[i]) have left */
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
    /* Its FETCHes we serve: parked, or granted with a lease in nt->leases (bounded
     * by cfg.serve_per_peer, net_serve.c). */
    unsigned serving;
    /* Direct reads of this peer's primary: the handles its GRANT gave, unpacked on
     * the link it came on (direct_ep), until that link closes. */
    struct kvt_tp_ep *direct_ep;
    struct kvt_tp_rkey *direct_rk, *direct_fk;
};

/* The tier. Owns every map's values, the directory, the async lookup helper, the
 * wake eventfd and the primary region's registrations; not the peers or the
 * primary. The manager fills base's primary fields at adoption; the loop thread
 * touches everything else, without a lock. */
struct net_tier {
    struct kvt_tier base;
    struct kvt_net_tier_config cfg;
    struct kvt_peers *peers;
    struct kvt_primary *primary;
    struct kvt_async_lookup *al;
    struct kvt_directory *dir; /* loop: the records of the keys homed here */
    uint64_t self;

    struct locate_req *lq_head, **lq_tail; /* queued by kvt__nt_lookup_submit */
    int wake_fd;                           /* kvt_net_tier_wake_fd */
    struct kvt_map locate_ops;             /* id -> locate_op (net_locate.c) */
    struct kvt_map locate_parts;           /* wire id -> locate_part (net_locate.c) */
    struct kvt_map holders;                /* key -> holder: who to fetch a found key from */
    struct kvt_map fetches;                /* id -> fetch (net_fetch.c) */
    struct kvt_map leases;                 /* id -> lease (net_serve.c) */
    struct kvt_map nodes;                  /* node id -> nt_peer */
    struct kvt_map published;              /* key -> (void *)1: what we told homes we hold */
    uint64_t next_id;                      /* locate ops and parts, fetches, leases */
    uint64_t next_expire_ns, next_dir_expire_ns;
    struct nt_later *later; /* per home: keys waiting for send credits (net_publish.c) */
    size_t n_later, cap_later;
    uint64_t next_flush_ns; /* ... until then */

    struct inbound *in; /* parked FETCHes, in arrival order (net_serve.c) */
    size_t n_in, cap_in;
    struct kvt_list done;     /* nt_done of ended jobs, reported by get_finished_jobs */
    uint64_t news;            /* FETCHes parked, jobs ended (kvt_net_tier_news) */
    uint64_t lookup_first_ns; /* the first new key of this step's lookups (0: none) */
    struct keyvec pub, unpub; /* keys to PUBLISH / UNPUBLISH at the next flush */
    bool republish_all;
    uint64_t next_republish_ns;
    /* When the directory drops the keys no longer homed here: a while after the last
     * membership change, once every node can have seen it (0: nothing to drop). */
    uint64_t retain_at_ns;

    struct kvt_tp_mr *mr_remote, *mr_local; /* the primary region, on first need */
    uint8_t handle[KVT_TP_MAX_HANDLE_SIZE];
    size_t handle_len;
    /* The primary's fence words for peers (remote), and where the words we READ
     * land (local: fence_in[s] for a row read into our slot s, which no other READ
     * targets while its load runs), registered with the region. */
    struct kvt_tp_mr *mr_fence, *mr_fence_in;
    uint32_t *fence_in; /* [num_chunks] */
    uint8_t fence_handle[KVT_TP_MAX_HANDLE_SIZE];
    size_t fence_handle_len;
    /* Fetch into: the callers' regions, ended into jobs waiting for their callback
     * (load_job.done.link), the fence word pool and its free stack. */
    struct kvt_list regions, into_done;
    uint32_t *into_fence, *into_free;
    uint32_t n_into_free;
    struct kvt_tp_mr *mr_into_fence;
    struct kvt_list exposures;      /* struct direct_exp (net_serve.c) */
    uint64_t direct_awake_until_ns; /* a direct READ was served: busy until then */
    uint64_t last_event_ns;         /* the transport's last event (nt_arm's busy poll) */
    uint64_t idle_since_ns;         /* a progress call found nothing: c.idle_poll_ns */
    bool omit_fences;               /* tests: GRANTs as a holder before wire 1.1 sends them */
    bool reg_failed;

    struct kvt_net_tier_counts c, reported;
    struct kvt_stats phases; /* the phase histograms (KVT_M_NET_*_SECONDS) since get_stats */
    char phase_label[KVT_STAT_LABEL_MAX]; /* their label (nt_observe) */
    bool shut;
};

/* get_finished_jobs frees a record and what it opens in one kvt_free. */
_Static_assert(offsetof(struct load_job, done) == 0, "a load job opens with its record");
_Static_assert(offsetof(struct lease, done) == 0, "a lease opens with its record");

static inline struct net_tier *nt_of(struct kvt_tier *t)
{
    return KVT_CONTAINER_OF(t, struct net_tier, base);
}

/* One observation of a phase histogram; lost when out of memory (a statistic). The
 * tier's label is made at the first: its index is set once the manager has it. */
static inline void nt_observe(struct net_tier *nt, const char *name, uint64_t ns)
{
    if (nt->phase_label[0] == '\0')
        snprintf(nt->phase_label, sizeof(nt->phase_label), "%d:%s", nt->base.index + 1,
                 nt->base.type);
    (void)kvt_stats_observe(&nt->phases, name, nt->phase_label, (double)ns * 1e-9);
}

/* A phase that has a sum in the counts too: adds ns to *sum and observes it. */
static inline void nt_time(struct net_tier *nt, uint64_t *sum, const char *name, uint64_t ns)
{
    *sum += ns;
    nt_observe(nt, name, ns);
}

static inline uint64_t ms_ns(uint32_t ms)
{
    return (uint64_t)ms * MS;
}

/* Home of a key among the live members (self included); 0 when nobody is live. */
static inline uint64_t nt_home(const struct kvt_key *key, const uint64_t *live, size_t n_live)
{
    long i = kvt_hrw_home(key, live, n_live);

    return i < 0 ? 0 : live[i];
}

/* ---- net_tier.c ---------------------------------------------------------------- */

/* Calls fn(nt, v, arg) for every value v of m, in place (it never allocates, so
 * expiry, reaping and drain cannot fail): fn may remove v from m, and must neither
 * remove another value from m nor add one. */
typedef void (*kvt__nt_visit_fn)(struct net_tier *nt, void *v, void *arg);
void kvt__nt_for_each(struct net_tier *nt, const struct kvt_map *m, kvt__nt_visit_fn fn, void *arg);
int kvt__nt_keyvec_push(struct keyvec *kv, const struct kvt_key *k);
void kvt__nt_keyvec_free(struct keyvec *kv);
/* Every message of the tier goes through here: to node, or on ep when it is not NULL
 * (a reply). A message that could not be sent is counted and logged. */
int kvt__nt_send(struct net_tier *nt, uint64_t node, struct kvt_tp_ep *ep,
                 const struct kvt_wire_msg *m);
/* As kvt__nt_send to a node, for bulk messages (publications) the caller sends again
 * later when the link has no send credits to spare (-EAGAIN, kvt_peers_send_bulk):
 * that is neither counted nor logged. */
int kvt__nt_send_bulk(struct net_tier *nt, uint64_t node, const struct kvt_wire_msg *m);
/* The job of d ended: d is filled in, queued for get_finished_jobs (news). */
void kvt__nt_job_done(struct net_tier *nt, struct nt_done *d);
/* The per-peer state of node, created on first use; NULL when out of memory. */
struct nt_peer *kvt__nt_peer_get(struct net_tier *nt, uint64_t node);
/* Peer messages, LOCATEs from the worker, deadlines (once a ms), FETCH windows. */
int kvt__nt_progress(struct net_tier *nt);
/* Frees every value of m, then m. */
void kvt__nt_free_map(struct kvt_map *m);
/* Registers the primary region with the transport once (both directions); false
 * when it cannot be (logged once, never retried). */
bool kvt__nt_register(struct net_tier *nt);

/* ---- net_locate.c -------------------------------------------------------------- */

/* The async lookup helper's submit (kvt_async_lookup_create_submit), on the loop
 * thread at a schedule end: queues the keys for the LOCATEs the loop sends next;
 * the answer completes the token. */
int kvt__nt_lookup_submit(void *arg, const struct kvt_key *keys, size_t n, bool *found,
                          void *token);
/* Loop: sends the LOCATEs of the requests queued. */
void kvt__nt_take_locates(struct net_tier *nt);
void kvt__nt_on_locate_reply(struct net_tier *nt, uint64_t from, const struct kvt_wire_msg *m);
void kvt__nt_expire_locates(struct net_tier *nt, uint64_t now);
/* The LOCATEs out to node end now, their keys not found: it went down or restarted
 * (a new life knows none of them), so no answer will come before the deadline. */
void kvt__nt_fail_locates(struct net_tier *nt, uint64_t node);
bool kvt__nt_holder_live(struct net_tier *nt, const struct holder *h);
/* Forgets the holders on node with an incarnation below keep_from. */
void kvt__nt_forget_holders(struct net_tier *nt, uint64_t node, uint64_t keep_from);
enum kvt_lookup_result kvt__nt_lookup(struct kvt_tier *t, const struct kvt_key *key,
                                      struct kvt_req_ctx *ctx);
/* Home side. */
void kvt__nt_on_publish(struct net_tier *nt, uint64_t from, struct kvt_tp_ep *ep,
                        const struct kvt_wire_msg *m);
void kvt__nt_on_locate(struct net_tier *nt, struct kvt_tp_ep *ep, const struct kvt_wire_msg *m);
/* Destroy: frees the locate ops and parts (with their worker references). */
void kvt__nt_locate_cleanup(struct net_tier *nt);

/* ---- net_publish.c ------------------------------------------------------------- */

int kvt__nt_submit_store(struct kvt_tier *t, const struct kvt_job *job);
/* The primary's removed hook (keys NULL: everything). */
void kvt__nt_on_removed(void *arg, const struct kvt_key *keys, size_t n);
/* Sends the keys of kv to their homes as PUBLISH or UNPUBLISH and empties kv; those
 * for a home whose link has no send credits to spare wait in its nt_later. */
void kvt__nt_flush_keys(struct net_tier *nt, struct keyvec *kv, enum kvt_wire_type type);
/* Re-publication when due, then the waiting and the batched UNPUBLISHes and
 * PUBLISHes. */
void kvt__nt_flush_publishes(struct net_tier *nt);
/* The tier's reset op: every publication is withdrawn now (UNPUBLISH to each home,
 * those a link has no send credits for at the next flushes; our own directory's
 * records of us dropped). */
void kvt__nt_reset(struct net_tier *nt);
/* Keys waiting for send credits; kvt__nt_later_free drops them (destroy). */
size_t kvt__nt_later_pending(const struct net_tier *nt);
void kvt__nt_later_free(struct net_tier *nt);

/* ---- net_fetch.c --------------------------------------------------------------- */

int kvt__nt_submit_load(struct kvt_tier *t, const struct kvt_job *job);
/* Sends queued fetches where a peer's window has room (loop top level only). */
void kvt__nt_pump(struct net_tier *nt);
void kvt__nt_on_grant(struct net_tier *nt, uint64_t from, struct kvt_tp_ep *ep,
                      const struct kvt_wire_msg *m);
void kvt__nt_on_deny(struct net_tier *nt, uint64_t from, const struct kvt_wire_msg *m);
/* Fails every fetch to node with an incarnation below keep_from not yet reading, or
 * with ep not NULL every fetch on ep. */
void kvt__nt_fail_fetches(struct net_tier *nt, uint64_t node, uint64_t keep_from,
                          struct kvt_tp_ep *ep);
void kvt__nt_expire_fetches(struct net_tier *nt, uint64_t now);
/* ep's link closed: its fetches fail, their rkeys go while ep lives. */
void kvt__nt_fetch_link_closed(struct net_tier *nt, struct kvt_tp_ep *ep);
/* Destroy: frees the fetches. */
void kvt__nt_fetch_cleanup(struct net_tier *nt);
/* Whether this tier reads direct (network.fetch direct with fence verification). */
bool kvt__nt_reads_direct(const struct net_tier *nt);
/* Fires the callbacks of the fetch-into jobs that ended (loop top level). */
void kvt__nt_into_deliver(struct net_tier *nt);
/* Destroy: frees the into jobs not delivered, the regions, the word pool. */
void kvt__nt_into_cleanup(struct net_tier *nt);

/* ---- net_serve.c --------------------------------------------------------------- */

void kvt__nt_on_fetch(struct net_tier *nt, uint64_t from, struct kvt_tp_ep *ep,
                      const struct kvt_wire_msg *m);
void kvt__nt_on_release(struct net_tier *nt, uint64_t from, const struct kvt_wire_msg *m);
/* The ParentManager loop over the parked FETCHes. */
void kvt__nt_serve(struct kvt_tier *t, struct kvt_parent *parent);
/* Ends every lease of node, or with ep not NULL every lease on ep (reaped). */
void kvt__nt_reap_leases(struct net_tier *nt, uint64_t node, struct kvt_tp_ep *ep);
void kvt__nt_expire_leases(struct net_tier *nt, uint64_t now);
/* Drain: ends every lease now. */
void kvt__nt_end_leases(struct net_tier *nt);
/* ep's link closed: its parked FETCHes get no answer. */
void kvt__nt_serve_link_closed(struct net_tier *nt, struct kvt_tp_ep *ep);
/* The grant check for one-sided READs of the primary region (the transport asks it
 * for each READ a peer posts): true when every byte of [off, off + len) - offsets in
 * the region, as in a GRANT's chunks - lies in a row granted to peer_node_id by a
 * lease that is active: neither released, reaped nor past its deadline. Loop
 * thread. */
bool kvt__net_may_read(struct net_tier *nt, uint64_t peer_node_id, uint64_t off, uint64_t len);
/* The same for [off, off + len) of the fence words (4 bytes per row): true when the
 * row of every word it touches may be read. */
bool kvt__nt_may_read_fence(struct net_tier *nt, uint64_t peer_node_id, uint64_t off, uint64_t len);
/* Direct reads: is ep (authenticated) a link we exposed our primary to? */
bool kvt__nt_direct_exposed(struct net_tier *nt, struct kvt_tp_ep *ep);
/* ep's link closed: the exposures to it end. */
void kvt__nt_direct_link_closed(struct net_tier *nt, struct kvt_tp_ep *ep);
/* Destroy: frees the leases and the parked FETCHes. */
void kvt__nt_serve_cleanup(struct net_tier *nt);

#endif

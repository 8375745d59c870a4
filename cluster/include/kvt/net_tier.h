/* SPDX-License-Identifier: Apache-2.0 */
/* The network tier: a kvt_tier_ops backend that makes the other nodes' primary
 * tiers this node's slowest secondary tier.
 *
 * Requester side (this node's engines miss locally):
 *   lookup        async lookup helper in submit mode (no worker thread): at the
 *                 schedule end the loop sends LOCATE to each new key's home
 *                 (rendezvous over live members) and completes the helper's item on
 *                 LOCATE_REPLY: RETRY until the answer, then HIT (a live holder is
 *                 known) or MISS.
 *   submit_load   FETCHes of at most keys_per_fetch keys to each holder, at most
 *                 fetches_per_peer of them out per peer (the rest wait queued, their
 *                 deadline not yet started), so one fetch's READs overlap the next
 *                 one's FETCH/GRANT round trip; on GRANT, one-sided READs of every
 *                 granted chunk straight into the job's primary slots (batches of
 *                 max_ops_per_batch, all of a fetch's in flight); each chunk must pass
 *                 its check (cfg.verify: the fence word READ after it equals the
 *                 granted one, or its XXH3-64 matches the granted checksum) and the
 *                 reads must end before the lease does;
 *                 then RELEASE. Keys denied, timed out, on a dead peer or failing a
 *                 check are not in successful_keys and are marked missing (vLLM's
 *                 livelock rule). A job is reported only once no READ of it is in
 *                 flight, so a failed job's slots are never written after it ends.
 * Holder side (peers miss):
 *   submit_store  the cascade: publish "we hold K" to K's home (batched per home per
 *                 step), report the job done at once; the bytes stay in the primary.
 *                 Primary evictions unpublish (batched); the tier's reset op (the
 *                 node's reset, after the primary was cleared) unpublishes every key
 *                 at once.
 *   serve_external_requests  the ParentManager loop, every schedule end: each FETCH
 *                 becomes a synthetic request (on_new_request, lookup per key, kept
 *                 parked while any key is RETRY/HIT_PENDING up to park_timeout_ms,
 *                 create_store_job for the hits, on_request_finished) and a GRANT
 *                 with offsets, lengths, generations, checksums and a lease. RELEASE,
 *                 the lease's expiry or the requester's link closing ends the store
 *                 job, which unpins.
 * Home side: PUBLISH/UNPUBLISH keep the location directory of the keys homed here;
 *   LOCATE is answered from it. On membership change every held key is re-published
 *   to its (new) home and records of dead holders are dropped.
 *
 * Peer messages are trusted only as far as the peer link authenticated their sender
 * (kvt/peers.h); PUBLISH for another node, GRANTs for fetches never sent, chunk
 * indexes out of range, lengths other than a row: refused and counted.
 *
 * Out of memory (kvt/tier.h's policy): submit_load and submit_store refuse a job
 * whose record cannot be made (-ENOMEM; a refused load drops the keys' lookup
 * verdicts as a failed one does); a load's fetches and a GRANT's lease, with room
 * for everything the job's report needs, are made before anything is sent or
 * pinned, so ending and reporting a job never allocate. What memory fails later
 * fails keys (a fetch, a LOCATE, a GRANT becomes a DENY BUSY), never a report.
 *
 * Threading: the loop thread (the manager's), except the async lookup worker. */
#ifndef KVT_NET_TIER_H
#define KVT_NET_TIER_H

#include <stddef.h>
#include <stdint.h>
#include <stdbool.h>

#include "kvt/peers.h"
#include "kvt/primary.h"
#include "kvt/tier.h"

/* Stat names (get_stats, label "<tier index + 1>:network"). */
#define KVT_M_NET_LOCATES        "kvtier_net_locate_requests"
#define KVT_M_NET_LOCATE_TIMEOUT "kvtier_net_locate_timeouts"
#define KVT_M_NET_FETCHES        "kvtier_net_fetches"
#define KVT_M_NET_GRANTS         "kvtier_net_grants"
#define KVT_M_NET_DENIES         "kvtier_net_denies"
#define KVT_M_NET_PULLED_CHUNKS  "kvtier_net_pulled_chunks"
#define KVT_M_NET_PULLED_BYTES   "kvtier_net_pulled_bytes"
#define KVT_M_NET_SERVED_BYTES   "kvtier_net_served_bytes"
/* The same bytes per peer (label "peer:<16 hex digits>"); own names, so a sum over
 * the names above is not counted twice. */
#define KVT_M_NET_PEER_PULLED_BYTES "kvtier_net_peer_pulled_bytes"
/* Where a pull's time goes, per observation (histograms, seconds): a step's first
 * new key asked to its LOCATEs sent (the step's end); a LOCATE's round trip; a fetch queued behind
 * its peer's fetches_per_peer; FETCH sent to GRANT; GRANT to the fetch's last row verified; a load
 * job submitted to reported; the holder's FETCH arrival to GRANT sent. */
#define KVT_M_NET_LOOKUP_QUEUE_SECONDS "kvtier_net_lookup_queue_seconds"
#define KVT_M_NET_LOCATE_SECONDS       "kvtier_net_locate_seconds"
#define KVT_M_NET_FETCH_QUEUE_SECONDS  "kvtier_net_fetch_queue_seconds"
#define KVT_M_NET_GRANT_WAIT_SECONDS   "kvtier_net_grant_wait_seconds"
#define KVT_M_NET_READ_SECONDS         "kvtier_net_read_seconds"
#define KVT_M_NET_LOAD_JOB_SECONDS     "kvtier_net_load_job_seconds"
#define KVT_M_NET_SERVE_WAIT_SECONDS   "kvtier_net_serve_wait_seconds"
#define KVT_M_NET_PEER_SERVED_BYTES    "kvtier_net_peer_served_bytes"
#define KVT_M_NET_INTO_CHUNKS          "kvtier_net_pulled_into_chunks"
#define KVT_M_NET_CHECKSUM_FAIL        "kvtier_net_checksum_failures"
#define KVT_M_NET_FENCE_FAIL           "kvtier_net_fence_failures"
#define KVT_M_NET_LEASE_EXPIRED        "kvtier_net_lease_expiries"
#define KVT_M_NET_FETCH_FAILED         "kvtier_net_failed_fetches"
#define KVT_M_NET_REFUSED              "kvtier_net_refused_messages"
#define KVT_M_NET_LEASES               "kvtier_net_active_leases"
#define KVT_M_NET_RECORDS              "kvtier_net_directory_records"
/* Gauge: keys whose PUBLISH or UNPUBLISH waits for a link's send credits. */
#define KVT_M_NET_PUBLISH_WAITING "kvtier_net_publish_waiting"
#define KVT_M_NET_DIRECT_CHUNKS   "kvtier_net_direct_chunks"
#define KVT_M_NET_DIRECT_MISSES   "kvtier_net_direct_misses"

/* How a pulled row is validated (network.verify). */
enum kvt_net_verify {
    /* Generation fences (the default): after a row's READ completed, the holder's
     * fence word of that row is READ on the same endpoint; the row is accepted only
     * when the word equals the (even) one the GRANT carried, so no write of the slot
     * began between the grant and the end of the row's READ. A GRANT without fence
     * words (a holder before wire 1.1) is checked by checksum. */
    KVT_NET_VERIFY_FENCE = 0,
    /* XXH3-64 of every byte read against the GRANT's checksum. */
    KVT_NET_VERIFY_CHECKSUM,
};

/* How a puller reads rows whose place the home knows (network.fetch).
 * Lease: every row through FETCH, GRANT (the holder pins it and exposes it to us
 * alone), READ, fence, RELEASE: a holder round trip and a pin per fetch.
 * Direct: a holder in direct mode publishes with each key resident in its primary
 * the key's slot and even fence word, which the home's LOCATE answer carries; the
 * puller READs such a row straight into its destination, then the fence word on the
 * same endpoint, and accepts the row only when the word is that generation. Nothing
 * is pinned: a slot reused or rewritten since the publication fails the fence and
 * the key is a miss (a wasted READ). The holder exposes its whole primary and fence
 * words to each authenticated peer that asks (the first FETCH on a link asks, and
 * goes the lease way); keys without a known place, a holder in lease mode or before
 * wire 1.2, and checksum verification (network.verify checksum: direct reads have
 * no checksum to compare) take the lease path. */
enum kvt_net_fetch {
    KVT_NET_FETCH_LEASE = 0,
    KVT_NET_FETCH_DIRECT,
};

/* Why a row failed its fence (kvt_net_tier_counts.fence_fail[]). */
enum kvt_net_fence_reason {
    KVT_NET_FENCE_CHANGED, /* the word moved on: the slot was rewritten or reused */
    KVT_NET_FENCE_WRITING, /* the word was odd: a write of the slot was in progress */
    KVT_NET_FENCE_UNREAD,  /* the word's READ could not be posted or failed */
    KVT_NET_FENCE_N_REASONS
};
/* "changed", "writing", "unread" (metric labels); "?" out of range. */
const char *kvt_net_fence_reason_name(unsigned r);

struct kvt_net_tier_config {
    struct kvt_peers *peers;     /* not owned; the tier installs itself as its handler */
    struct kvt_primary *primary; /* the manager's: generations, checksums, evictions */
    uint32_t lease_ms;           /* 0 = 5000 */
    uint32_t fetch_timeout_ms;   /* FETCH sent to last READ done; 0 = 3000 */
    uint32_t locate_timeout_ms;  /* 0 = 2000 */
    uint32_t park_timeout_ms;    /* serving: RETRY/HIT_PENDING wait; 0 = 1000 */
    uint32_t record_ttl_ms;      /* directory records (re-published at half); 0 = 600000 */
    unsigned max_holders;        /* per key in the directory; 0 = 8 */
    unsigned max_ops_per_batch;  /* READ ops per batch; 0 = 8 */
    unsigned keys_per_fetch;     /* keys per FETCH (at most 256); 0 = 64 */
    unsigned fetches_per_peer;   /* FETCHes out (sent, not ended) per peer; 0 = 4 */
    enum kvt_net_verify verify;  /* how pulled rows are checked; 0 = fences */
    enum kvt_net_fetch fetch;    /* lease or direct reads; 0 = lease */
    /* With transfers in flight (our fetches, peers' leases), the loop polls for at
     * most this long after the transport's last event, then sleeps on its events
     * (kvt_tier_arm succeeds); 0 = it polls as long as anything is in flight. */
    uint32_t busy_poll_us;
    /* Directory records a home keeps per publishing peer (its own are not limited):
     * a peer publishing without end (hostile or broken) is refused past it
     * (counted); 0 = 1048576. */
    uint32_t max_records_per_node;
    /* A peer's FETCHes this node serves at once (parked, or granted and not yet
     * released or expired: each lease pins rows): past it they are denied BUSY and
     * counted refused, so a peer that floods FETCHes and never RELEASEs pins no
     * more; 0 = 4096 (four times the largest network.fetches_per_peer). */
    uint32_t serve_per_peer;
};

int kvt_net_tier_create(const struct kvt_net_tier_config *cfg, struct kvt_tier **t_p);

/* Progress between schedule ends (the daemon's idle tick; tests): peer messages,
 * the lookups' LOCATEs queued, READ completions, publishes, leases. */
int kvt_net_tier_poll(struct kvt_tier *t);
/* The tier's wake eventfd, in the loop's event set. Nothing writes it since the
 * lookups queue their LOCATEs on the loop thread, just before its progress; it stays
 * because callers count on the event set (the transport's fd and this one). */
int kvt_net_tier_wake_fd(struct kvt_tier *t);

/* The grant check for one-sided READs of this node's primary region (and of its
 * fence words, kvt__nt_may_read_fence in the tier): true when
 * every byte of [off, off + len) (offsets in the region, as in GRANTs) lies in a row
 * granted to peer_node_id by an active lease (not released, reaped or past its
 * deadline). For the transport to ask before it serves a peer's READ: an
 * authenticated peer reads only the rows it was granted, while the grant lasts.
 * Loop thread. */
bool kvt_net_tier_may_read(struct kvt_tier *t, uint64_t peer_node_id, uint64_t off, uint64_t len);

/* ---- loads into the caller's memory (an engine's attached region) -------------
 * A load job of the manager READs a peer's rows into the node's primary slots; a
 * "fetch into" job READs them straight into a region the caller registered here
 * (an engine's attached region), with no copy through the primary and without
 * the rows entering it. The same path as a load job otherwise: FETCH, GRANT,
 * one-sided READs, each row validated (cfg.verify: its fence word READ after it,
 * or its checksum), RELEASE; keys that fail are marked missing (vLLM's livelock
 * rule). A row is reported successful only once it validated; a failed key's row
 * may hold any bytes (the READ may have landed, torn), so the caller must treat
 * it as not loaded. Loop thread only. */
struct kvt_net_region;

/* Registers [base, base + len) with the transport (kvt_tp_reg_local) for fetch
 * into. -EINVAL (NULL, empty), -ENOMEM, or the transport's error. */
int kvt_net_tier_region_add(struct kvt_tier *t, void *base, size_t len,
                            struct kvt_net_region **r_p);
/* Called with the region's base and len once no READ targets it any more. */
typedef void (*kvt_net_region_free_cb)(void *base, size_t len);
/* Ends the region: its jobs' callbacks never fire again and their fetches fail;
 * once no READ of them is in flight (now, or from a later poll) the region is
 * deregistered and free_cb (if not NULL) called, so the caller unmaps it there
 * and not before. */
void kvt_net_tier_region_remove(struct kvt_tier *t, struct kvt_net_region *r,
                                kvt_net_region_free_cb free_cb);

/* ok[i]: keys[i] was read into its destination and validated. */
typedef void (*kvt_net_into_cb_t)(void *arg, const bool *ok, size_t n);
/* Pulls keys[0..n) from the peers the tier's lookups located them on (a key it
 * has no live holder for fails) into r at offs[i] (one row, row_bytes, each;
 * rows must not overlap and nothing else may write them until the callback).
 * -EINPROGRESS: cb fires exactly once, from a later kvt_net_tier_poll (or the
 * manager's polling of the tier), never inside this call, unless r is removed
 * first. Otherwise no callback: -EINVAL (n 0 or over 1 << 20, an offset not
 * inside r or not row aligned), -ESHUTDOWN (r removed, the tier shut down),
 * -ENOTSUP (the tier cannot register memory), -ENOMEM. */
int kvt_net_tier_fetch_into(struct kvt_tier *t, struct kvt_net_region *r,
                            const struct kvt_key *keys, const uint64_t *offs, size_t n,
                            kvt_net_into_cb_t cb, void *arg);
/* Whether t is a network tier (the engine API looks for it among the manager's). */
bool kvt_net_tier_is(const struct kvt_tier *t);

/* Cumulative counts (tests, the CLI, /metrics). */
struct kvt_net_tier_counts {
    uint64_t locates, locate_timeouts, fetches, grants, denies;
    uint64_t pulled_chunks, pulled_bytes, served_chunks, served_bytes;
    uint64_t checksum_failures, lease_expiries, leases_reaped, failed_fetches, refused;
    /* Rows refused by their fence: the sum, and by reason (enum kvt_net_fence_reason). */
    uint64_t fence_failures, fence_fail[KVT_NET_FENCE_N_REASONS];
    uint64_t send_failures;
    /* Of pulled_chunks/bytes, those READ straight into a fetch-into region. */
    uint64_t into_chunks, into_bytes;
    uint64_t active_leases, directory_records, published_keys;
    uint64_t publish_waiting; /* keys waiting for a link's send credits */
    /* Where the time of a pull goes (sums, ns): LOCATE sent to its reply (locate_rtts
     * of them); load submitted to FETCH sent (fetches); FETCH sent to GRANT (grants);
     * GRANT to the fetch's last READ verified (grants); checksum verification of
     * pulled chunks; holder side, FETCH arrival to GRANT sent (served_fetches). */
    uint64_t locate_rtts, locate_rtt_ns, fetch_queue_ns, grant_wait_ns, read_ns, verify_ns;
    uint64_t served_fetches, serve_wait_ns;
    /* Direct reads (network.fetch direct): fetches whose READs went out without a
     * FETCH, rows read and accepted that way (also in pulled_chunks), rows that
     * failed on that path (a fence that moved on
     * or was odd, a READ that failed, a link gone: each a miss), and the exposures
     * of our whole primary we made to peers that asked (holder side), and how many
     * links hold one now (each ends when its link closes). */
    uint64_t direct_fetches, direct_chunks, direct_misses, direct_exposures, direct_exposed_links;
    /* The loop's busy poll: progress calls that found no transport event while
     * transfers were in flight, and the loop's wall time from each to the next call
     * (what network.busy_poll_us costs), gaps over 50 us left out (the process
     * preempted, or the loop at other work). */
    uint64_t idle_polls, idle_poll_ns;
};
void kvt_net_tier_counts(struct kvt_tier *t, struct kvt_net_tier_counts *out);

#endif

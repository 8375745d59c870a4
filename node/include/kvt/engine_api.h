/* SPDX-License-Identifier: Apache-2.0 */
/* kvtierd's local engine API server (issue #6): engines on this host
 * connect to a unix socket, receive the primary region's fd (SCM_RIGHTS) and drive
 * the tiering manager with msgpack requests (kvtier/engine_proto.h), one request per
 * manager call. The client side is libkvtier-client (kvtier/client.h).
 *
 * Threads: everything runs on the daemon's loop thread, the one that owns the
 * manager. kvt_engine_server_fd is one epoll fd (listen socket and every client);
 * when it is readable, kvt_engine_server_progress accepts, reads, decodes, calls the
 * manager and replies, without blocking.
 *
 * Rings: an engine that asks for one in HELLO gets a shared-memory ring
 * (kvtier/engine_ring.h, node/engine_ring.c) and sends its calls there instead of
 * the socket: the same frames, the same dispatch, the same mirror and bounds. While
 * engines are busy the loop polls the rings (kvt_engine_server_spin); when they
 * are quiet it sleeps and engines wake it through an eventfd in the server's fd.
 *
 * Per client the server keeps what the client holds in the manager: its requests,
 * its prepared stores not yet completed, its pins (prepared loads not completed).
 * A client may only name its own requests and unpin its own pins. When a client
 * goes away (closes, dies, or is cut off for a protocol error) the server completes
 * its outstanding stores as failed, unpins its pins and finishes its requests.
 *
 * Bad peers: every frame is bounded (max_msg_bytes) and decoded without allocation
 * from declared lengths; a malformed, oversized or out-of-order message gets an
 * ERROR reply, is counted, and its connection is closed (after the cleanup above).
 * Other clients are not affected. What one client can make the server hold is
 * bounded too: its requests and their params, its queued replies, the time it may
 * take to say HELLO; the events queued for take_events are bounded for all. A
 * request that would pass a bound is refused (its rc) and counted by reason. An
 * ERROR frame carries the reason as text (kvtier_client_error).
 *
 * Model fingerprint (kvtier/client.h): the node's is cfg.fingerprint, or else the
 * first one an engine declares at HELLO (fingerprint_set is told, once); an engine
 * that declares another is refused (ERROR -EKEYREJECTED with both named, counted as
 * "fingerprint"); one that declares none is accepted.
 *
 * Reset (RESET): kvt_manager_reset_all, refused with -EBUSY (counted "reset_busy")
 * while any client holds pins, prepared stores or waiting load jobs, since the rows
 * they name would be wiped under them. The events queued for take_events are dropped
 * with the chunks they describe. */
#ifndef KVT_ENGINE_API_H
#define KVT_ENGINE_API_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvt/stats.h"
#include "kvtier/client.h"

struct kvt_manager;
struct kvt_region;

struct kvt_engine_server_config {
    const char *socket_path; /* required; a stale socket file is replaced */
    /* The socket file's mode (0 = 0660) and group (NULL = the daemon's): set before
     * the path appears, so the umask never decides who may attach. The group is a
     * name or a number; the daemon must be allowed to give the file that group. */
    unsigned socket_mode;
    const char *socket_group;
    struct kvt_manager *manager;
    /* The region whose fd engines map; NULL = the manager primary's region (the
     * primary must then have one). */
    struct kvt_region *region;
    unsigned max_clients;      /* 0 = 64; more connections are refused (ERROR reply) */
    uint32_t max_msg_bytes;    /* 0 = 1 MiB: largest request body */
    uint32_t max_keys;         /* 0 = 4096: keys (and request ids) per request */
    uint32_t max_requests;     /* 0 = 4096: live requests per client */
    uint32_t max_params_bytes; /* 0 = 64 KiB: kv_transfer_params JSON of one request */
    /* 0 = 4 MiB: params bytes of all the live requests of one client */
    uint64_t max_client_params_bytes;
    /* 0 = 1 MiB: replies queued for one client; at the bound its further requests
     * wait (unread) until it has read its replies */
    uint64_t max_output_bytes;
    uint32_t hello_timeout_ms; /* 0 = 5000: a connection without HELLO by then is closed */
    /* 0 = 65536: keys of the events queued for take_events; past it the oldest events
     * are dropped (an engine that never takes events costs at most this much) */
    uint32_t max_event_keys;
    /* 0 = 4096: keys of a client's waiting load jobs looked up again in one pass of
     * the loop; the jobs past it wait for the next pass, in turn (a client with a
     * million keys waiting costs each pass this much, not a million lookups) */
    uint32_t waiting_keys_per_pass;
    /* Stats fan-out (several consumers of return-and-reset stats): when set,
     * get_stats calls collect(arg) first, which should take the manager's delta and
     * hand it to kvt_engine_server_fanout_stats (and to its own consumers, /metrics);
     * each client then gets what accumulated since its own last get_stats. NULL:
     * get_stats takes kvt_manager_get_stats directly (one consumer). */
    void (*collect_stats)(void *arg);
    /* get_stats with KVT_ESTATS_TOTALS: adds the node's totals since start to *out
     * (0 or -errno). NULL: such requests get -EOPNOTSUPP. Same arg. */
    int (*total_stats)(void *arg, struct kvt_stats *out);
    /* The node's model fingerprint (1..KVTIER_FINGERPRINT_MAX bytes, copied), or NULL:
     * the first engine that declares one sets it for the server's life. */
    const char *fingerprint;
    /* Told when an engine's HELLO sets the node's fingerprint (may be NULL): 0, or a
     * -errno that refuses that engine, the fingerprint staying unset. Same arg. */
    int (*fingerprint_set)(void *arg, const char *fp);
    /* PEERS: writes the node's peers (itself first) into out[0..cap) and their count
     * to *n_p; 0 or -errno. NULL: the node has no cluster (-EOPNOTSUPP). Same arg. */
    int (*peers)(void *arg, struct kvtier_peer *out, size_t cap, size_t *n_p);
    void *collect_arg;
    /* Shared-memory rings (kvtier/engine_ring.h): bytes each way of the ring an
     * engine gets when it asks in HELLO; 0 = 256 KiB, < 0 = no rings (engines use
     * the socket). A message larger than half of it travels on the socket. */
    int64_t ring_bytes;
    /* How long the loop keeps polling the rings after their last request, when it
     * calls kvt_engine_server_spin; 0 = it never spins (every ring request then
     * wakes it through the engine's eventfd). */
    uint32_t ring_spin_us;
};

/* Why the server refused a request or a client, or dropped something: one counter
 * each (kvt_engine_server_counters.refused_by), named by kvt_engine_refusal_name for
 * /metrics. */
enum kvt_engine_refusal {
    KVT_EREF_CLIENTS = 0,     /* a connection over max_clients */
    KVT_EREF_MALFORMED,       /* a frame that did not decode, or came out of order */
    KVT_EREF_OVERSIZED,       /* a frame over max_msg_bytes or a count limit */
    KVT_EREF_HELLO_TIMEOUT,   /* no HELLO within hello_timeout_ms: closed */
    KVT_EREF_HELLO_EVICTED,   /* no HELLO yet, closed to make room for a new connection */
    KVT_EREF_FOREIGN_STORE,   /* complete_store of a write-pending key it did not prepare */
    KVT_EREF_FOREIGN_LOAD,    /* complete_load of a key it has not pinned */
    KVT_EREF_UNKNOWN_REQUEST, /* names a request not its own (or not live, or the node's) */
    KVT_EREF_PARAMS,          /* new_request params over max_params_bytes */
    KVT_EREF_CLIENT_PARAMS,   /* new_request params over the client's budget */
    KVT_EREF_REQUESTS,        /* new_request over max_requests */
    KVT_EREF_OUTPUT_FULL,     /* replies reached max_output_bytes: reading paused */
    KVT_EREF_EVENTS_DROPPED,  /* events dropped, oldest first, over max_event_keys */
    KVT_EREF_FINGERPRINT, /* HELLO with another model's fingerprint (or one the node cannot record)
                           */
    KVT_EREF_RESET_BUSY,  /* RESET while an engine holds pins, stores or loads */
    KVT_EREF_RING,        /* an engine broke its ring's protocol (counter, record, seq): closed */
    KVT_EREF_COUNT,
};
/* "clients", "malformed", ... (a Prometheus label value). */
const char *kvt_engine_refusal_name(enum kvt_engine_refusal r);

struct kvt_engine_server_counters {
    uint64_t clients;        /* connected now */
    uint64_t accepted;       /* connections accepted, ever */
    uint64_t refused;        /* connections refused (max_clients) */
    uint64_t accept_failed;  /* accepts failed (no descriptor or memory): the socket rested */
    uint64_t requests;       /* requests decoded and executed */
    uint64_t malformed;      /* frames that did not decode, or came out of order */
    uint64_t oversized;      /* frames over max_msg_bytes or a count limit */
    uint64_t disconnects;    /* clients gone, for whatever reason */
    uint64_t finished_reqs;  /* requests finished on behalf of gone clients */
    uint64_t released_pins;  /* pins released on behalf of gone clients */
    uint64_t aborted_stores; /* prepared stores completed as failed for them */
    uint64_t event_keys;     /* keys of the events queued now */
    /* Every refusal and drop by reason (clients, malformed and oversized repeat the
     * three counters above); events_dropped counts events. */
    uint64_t refused_by[KVT_EREF_COUNT];
    /* Attached regions and jobs (node/engine_jobs.c). */
    uint64_t attached;             /* regions attached, ever */
    uint64_t attach_refused;       /* ATTACH refused: no fd, bad geometry, a second one */
    uint64_t jobs;                 /* store and load jobs accepted */
    uint64_t jobs_refused;         /* JOBS requests refused whole (bad rows, kinds, counts) */
    uint64_t job_rows_stored;      /* rows of store jobs validated in the node */
    uint64_t job_rows_loaded;      /* rows of load jobs validated in the engine's region */
    uint64_t job_rows_read_direct; /* of those, READ from a peer straight into the region */
    uint64_t job_rows_failed;      /* rows of jobs reported failed */
    uint64_t job_keys_relooked;    /* keys of waiting load jobs looked up again */
    uint64_t resets;               /* RESETs done (the node's cache forgotten) */
    /* Shared-memory rings. */
    uint64_t ring_clients;    /* engines given a ring, ever */
    uint64_t ring_requests;   /* requests served from rings (also in requests) */
    uint64_t ring_binary;     /* of those, binary messages (kvt__ebin_*) */
    uint64_t ring_redirects;  /* ring replies too large for the ring, sent on the socket */
    uint64_t ring_wakeups;    /* times an engine's eventfd woke the loop */
    uint64_t ring_spin_rests; /* spins that lost their core: then a rest from spinning */
};

struct kvt_engine_server;

/* Binds and listens. -EINVAL bad config (no region fd, path too long),
 * -EADDRINUSE another daemon listens on socket_path, -EEXIST socket_path exists
 * and is not a socket, other -errno. Nothing is left behind on failure. */
int kvt_engine_server_create(const struct kvt_engine_server_config *cfg,
                             struct kvt_engine_server **srv_p);
/* Disconnects every client (with the cleanup above), closes and unlinks the socket. */
void kvt_engine_server_destroy(struct kvt_engine_server *srv);

/* The one fd to poll for readability. */
int kvt_engine_server_fd(const struct kvt_engine_server *srv);
/* Does all the work that is ready, never blocks. 0, or a negative errno when the
 * server itself failed (epoll); errors of one client only close that client. Call it
 * also when the fd is not readable, every loop turn or tick: it moves the manager's
 * events to the bounded queue and enforces the HELLO deadline. */
int kvt_engine_server_progress(struct kvt_engine_server *srv);

/* Serves the engines' rings by polling them, for at most max_ns, while they had a
 * request within ring_spin_us. true: call it (and progress) again without sleeping;
 * false: the rings are quiet and every engine now wakes the fd above when it posts,
 * so the caller may sleep on it. A loop that never calls this still serves the
 * rings, woken by the fd after every ring request (slower: a wake-up per call). */
bool kvt_engine_server_spin(struct kvt_engine_server *srv, uint64_t max_ns);

/* Adds one stats delta to every attached client's pending stats (see collect_stats). */
int kvt_engine_server_fanout_stats(struct kvt_engine_server *srv, const struct kvt_stats *delta);

void kvt_engine_server_get_counters(const struct kvt_engine_server *srv,
                                    struct kvt_engine_server_counters *out);

#endif

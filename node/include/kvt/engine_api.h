/* kvtierd's local engine API server (DESIGN.md §2, issue #6): engines on this host
 * connect to a unix socket, receive the primary region's fd (SCM_RIGHTS) and drive
 * the tiering manager with msgpack requests (kvtier/engine_proto.h), one request per
 * manager call. The client side is libkvtier-client (kvtier/client.h).
 *
 * Threads: everything runs on the daemon's loop thread, the one that owns the
 * manager. kvt_engine_server_fd is one epoll fd (listen socket and every client);
 * when it is readable, kvt_engine_server_progress accepts, reads, decodes, calls the
 * manager and replies, without blocking.
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
 * Other clients are not affected. */
#ifndef KVT_ENGINE_API_H
#define KVT_ENGINE_API_H

#include <stddef.h>
#include <stdint.h>

#include "kvt/stats.h"

struct kvt_manager;
struct kvt_region;

struct kvt_engine_server_config {
    const char *socket_path; /* required; a stale socket file is replaced */
    struct kvt_manager *manager;
    /* The region whose fd engines map; NULL = the manager primary's region (the
     * primary must then have one). */
    struct kvt_region *region;
    unsigned max_clients;      /* 0 = 64; more connections are refused (ERROR reply) */
    uint32_t max_msg_bytes;    /* 0 = 1 MiB: largest request body */
    uint32_t max_keys;         /* 0 = 4096: keys (and request ids) per request */
    uint32_t max_requests;     /* 0 = 65536: live requests per client */
    uint32_t max_params_bytes; /* 0 = 64 KiB: kv_transfer_params JSON */
    /* Stats fan-out (several consumers of return-and-reset stats): when set,
     * get_stats calls collect(arg) first, which should take the manager's delta and
     * hand it to kvt_engine_server_fanout_stats (and to its own consumers, /metrics);
     * each client then gets what accumulated since its own last get_stats. NULL:
     * get_stats takes kvt_manager_get_stats directly (one consumer). */
    void (*collect_stats)(void *arg);
    /* get_stats with KVT_ESTATS_TOTALS: adds the node's totals since start to *out
     * (0 or -errno). NULL: such requests get -EOPNOTSUPP. Same arg. */
    int (*total_stats)(void *arg, struct kvt_stats *out);
    void *collect_arg;
};

struct kvt_engine_server_counters {
    uint64_t clients;        /* connected now */
    uint64_t accepted;       /* connections accepted, ever */
    uint64_t refused;        /* connections refused (max_clients) */
    uint64_t requests;       /* requests decoded and executed */
    uint64_t malformed;      /* frames that did not decode, or came out of order */
    uint64_t oversized;      /* frames over max_msg_bytes or a count limit */
    uint64_t disconnects;    /* clients gone, for whatever reason */
    uint64_t finished_reqs;  /* requests finished on behalf of gone clients */
    uint64_t released_pins;  /* pins released on behalf of gone clients */
    uint64_t aborted_stores; /* prepared stores completed as failed for them */
    /* Attached regions and jobs (node/engine_jobs.c). */
    uint64_t attached;        /* regions attached, ever */
    uint64_t attach_refused;  /* ATTACH refused: no fd, bad geometry, a second one */
    uint64_t jobs;            /* store and load jobs accepted */
    uint64_t jobs_refused;    /* JOBS requests refused whole (bad rows, kinds, counts) */
    uint64_t job_rows_stored; /* rows of store jobs validated in the node */
    uint64_t job_rows_loaded; /* rows of load jobs validated in the engine's region */
    uint64_t job_rows_failed; /* rows of jobs reported failed */
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
 * server itself failed (epoll); errors of one client only close that client. */
int kvt_engine_server_progress(struct kvt_engine_server *srv);

/* Adds one stats delta to every attached client's pending stats (see collect_stats). */
int kvt_engine_server_fanout_stats(struct kvt_engine_server *srv, const struct kvt_stats *delta);

void kvt_engine_server_get_counters(const struct kvt_engine_server *srv,
                                    struct kvt_engine_server_counters *out);

#endif

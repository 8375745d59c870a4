/* SPDX-License-Identifier: Apache-2.0 */
/* The local engine API server (contract in kvt/engine_api.h, wire format in
 * kvtier/engine_proto.h).
 *
 * Layout: one epoll fd over the listen socket (data.ptr NULL) and every client
 * (data.ptr its struct eclient), level-triggered. progress() takes what is ready:
 * accepts, reads into the client's bounded input buffer (header + max_msg_bytes),
 * executes the complete frames in order, queues replies in the client's output
 * buffer and writes what the socket takes. While a client has output queued the
 * server reads no more from it (EPOLLOUT instead of EPOLLIN), and it stops executing
 * a client's buffered frames once its queued replies reach max_output_bytes: a
 * client that does not read its replies stalls only itself and costs at most its
 * input buffer plus max_output_bytes (and one reply).
 *
 * Client state machine: NEW (only HELLO accepted) -> READY -> gone. HELLO's reply
 * carries the region fd; it is the first frame queued, so the fd rides on the
 * first byte written. A NEW client has hello_timeout_ms to say HELLO; when the
 * server is full, a new connection closes the oldest NEW client rather than being
 * refused, so connections that never speak cannot keep engines out. Going away
 * (EOF, error, protocol violation) runs the cleanup: stores prepared and not
 * completed are completed as failed (each outstanding manager-level prepare_store
 * once, so the manager's per-request count drops to 0 and the write-pending slots
 * are freed), pins are unpinned one by one, unfinished requests are finished, and
 * the client's references dropped.
 *
 * What a client holds is mirrored here exactly as the manager accepted it (only
 * calls that returned 0 change the mirror), so the cleanup never asks the manager
 * for something it would refuse, and a client cannot name what another holds: its
 * complete_store may name only write-pending keys it prepared in that request (the
 * manager alone would complete anyone's), its complete_load only its own pins. The
 * mirror is hash maps (requests, each request's keys being written, pins) so that
 * every check costs O(1) per key, whatever a client holds.
 *
 * Rings (engine_ring.c): a client that asked in HELLO has a ring whose memfd and
 * eventfd ride with the region's fd. Its requests are taken from the ring (copied
 * out, checked) and run through exec_frame like the socket's; the reply goes back
 * into the ring, or on the socket behind a REDIRECT record when it is too large. A
 * ring that breaks its protocol is refused like a malformed frame (counted: ring);
 * closing the client closes its ring first, so an engine waiting there wakes. The
 * eventfds are in the epoll set with their client pointer tagged (RING_TAG).
 * kvt_engine_server_spin polls the rings while they are busy and tells them when
 * the loop is about to sleep. A spin pays only while the loop has a core of its
 * own: one whose clock reads, a few empty passes apart, are SPIN_LOST_NS apart lost
 * its core meanwhile (more runnable threads than cores: the engines it waits for
 * wait for that core too), and the loop then rests from spinning for SPIN_REST_NS,
 * woken by the engines' eventfds (counted: ring_spin_rests).
 *
 * Events: the manager's events are moved into one queue here at every progress()
 * and handed to whichever client calls take_events. The queue holds at most
 * max_event_keys keys; past it the oldest events are dropped (and counted): the
 * newest say what the primary holds now, the oldest are the likeliest to be stale
 * (evicted since), and an engine that never takes events then costs a bounded
 * amount instead of ~150 bytes per chunk ever stored.
 *
 * HELLO and the model fingerprint: the node's (cfg.fingerprint, or the first an engine
 * declares, handed to fingerprint_set once) is compared with the engine's; another is
 * refused with an ERROR frame that names both. Every ERROR frame says why in its
 * message, so that the client library can tell its caller.
 *
 * RESET runs kvt_manager_reset_all when no client holds anything the manager's reset
 * would wipe under it: pins (its rows would be reused while it copies out), prepared
 * stores (the write-pending rows are freed) or load jobs waiting for a promotion.
 * Otherwise -EBUSY and nothing changes - what vLLM's reset_prefix_cache does while
 * blocks are in use, rather than waiting for engines that may never let go. Requests
 * stay; the queued events go with the chunks they describe. */
#include <assert.h>
#include <errno.h>
#include <grp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "accept_rest.h"
#include "kvt/alloc.h"
#include "kvt/clock.h"
#include "kvt/common.h"
#include "kvt/engine_api.h"
#include "kvt/log.h"
#include "kvt/manager.h"
#include "kvt/map.h"
#include "kvt/pins.h"
#include "kvt/primary.h"
#include "kvt/region.h"
#include "kvtier/engine_proto.h"
#include "kvtier/engine_ring.h"
#include "engine_jobs_int.h"
#include "engine_ring_int.h"

#define MOD        "engine_api"
#define MAX_EVENTS 64
/* recv calls for one client per progress(): a client that keeps sending cannot keep
 * the loop from the others (epoll is level-triggered: the rest waits a turn). */
#define READS_PER_TURN 16
/* A refused client's ERROR frame gets this long to leave before the connection goes. */
#define CLOSING_GRACE_NS 1000000000ull
/* An input buffer larger than this is freed when empty (it grew for a rare big frame;
 * bulk requests of max_keys keys, ~70 KiB, keep theirs). */
#define IN_KEEP_BYTES (256u << 10)
/* Ring requests of one engine per pass over the rings: the others get their turn. */
#define RING_PER_TURN 16
/* epoll data of an engine's ring eventfd: its struct eclient, tagged. */
#define RING_TAG ((uintptr_t)1)
/* The request of touches and loads that name none (anon_ctx). */
#define ANON_REQ_ID "kvtierd-engine-api"

_Static_assert(sizeof(struct kvtier_key) == sizeof(struct kvt_key), "key layouts differ");
_Static_assert(offsetof(struct kvtier_key, bytes) == offsetof(struct kvt_key, bytes),
               "key layouts differ");
_Static_assert(sizeof(struct kvtier_tier_matcher) == sizeof(struct kvt_tier_matcher),
               "matcher layouts differ");
_Static_assert(KVTIER_HIST_BUCKETS == KVT_HIST_BUCKETS, "histogram buckets differ");
_Static_assert(sizeof(((struct kvtier_hist_bounds *)0)->bound) ==
                   sizeof(((struct kvt_hist_layout *)0)->bounds),
               "histogram bounds differ");
_Static_assert(KVTIER_STAT_NAME_MAX == KVT_STAT_NAME_MAX, "stat names differ");
_Static_assert(KVTIER_STAT_LABEL_MAX == KVT_STAT_LABEL_MAX, "stat labels differ");

/* One request of a client: its context reference, whether the client finished it,
 * how many manager-level prepared stores are outstanding, the bytes of its params
 * (charged to the client's budget) and the keys it prepared and has not completed
 * (key bytes -> (void *)1). */
struct ereq {
    struct kvt_req_ctx *ctx;
    bool finished;
    int pending_stores;
    size_t params_bytes;
    struct kvt_map writing;
};

/* Loop thread only. */
struct eclient {
    int fd;
    uint64_t id;
    pid_t pid;
    uint64_t accepted_ns;
    uint64_t closing_ns;
    char name[KVT_LOG_ESC_MAX]; /* the HELLO name, escaped: only ever logged */
    bool hello_done;
    bool closing;    /* flush what is queued, then go */
    bool fd_to_send; /* the next byte written carries the region fd */
    bool want_out;   /* epoll watches EPOLLOUT (else EPOLLIN) */
    bool out_full;   /* frames wait for max_output_bytes (counted once per wait) */
    bool shut_wr;    /* closing: all sent, our side shut down, waiting for its EOF */
    uint8_t *in;
    size_t in_len, in_cap;
    struct kvt_ebuf out;
    size_t out_off;
    uint64_t params_bytes;  /* of its live requests */
    struct kvt_map reqs;    /* req_id -> struct ereq */
    struct kvt_map pins;    /* key bytes -> (uintptr_t) pin count */
    struct kvt_stats stats; /* fan-out mode: deltas since this client's last get_stats */
    int passed_fd;          /* the last fd the client passed (ATTACH takes it), or -1 */
    struct kvt_ejobs *jobs; /* its attached region and jobs, or NULL */
    struct kvt_ering *ring; /* its shared-memory ring (engine_ring.c), or NULL */
    struct eclient *next;
};

struct kvt_engine_server {
    char path[sizeof(((struct sockaddr_un *)0)->sun_path)];
    int listen_fd;
    int epfd;
    struct kvt_manager *m;
    int region_fd;
    uint64_t geom[KVT_EG_COUNT];
    struct kvt_eproto_limits lim;
    unsigned max_clients;
    uint32_t max_requests;
    uint32_t max_params;
    uint64_t max_client_params;
    uint64_t max_output;
    uint64_t hello_timeout_ns;
    uint32_t max_event_keys;
    uint32_t waiting_keys_per_pass;
    uint64_t next_id;
    struct kvt_accept_rest accept_rest; /* the listening socket out of epfd (accept_failed) */
    unsigned n_new;                     /* clients without HELLO */
    struct eclient *clients;
    struct kvt_engine_server_counters ctr;
    void (*collect_stats)(void *arg);
    int (*total_stats)(void *arg, struct kvt_stats *out);
    int (*fingerprint_set)(void *arg, const char *fp);
    int (*peers)(void *arg, struct kvtier_peer *out, size_t cap, size_t *n_p);
    void *collect_arg;
    char fingerprint[KVTIER_FINGERPRINT_MAX + 1]; /* the node's, "" while none */
    char why[KVT_EPROTO_MSG_MAX + 1];             /* a refused HELLO's reason */
    bool why_counted;                             /* ... counted already, by reason */
    struct kvt_req_ctx *anon_ctx;                 /* touch/loads that name no request */
    struct kvt_store_output store_out;            /* prepare_store's, reused */
    struct kvt_events evq;                        /* queued for take_events: ev[evq_head..n) */
    size_t evq_head;
    uint64_t evq_keys;     /* keys of ev[evq_head..n), an event counting at least 1 */
    struct kvt_events evs; /* take_events', until its reply is encoded */
    struct kvt_map named;  /* complete_load's scratch: key bytes -> times named */
    /* Rings: size each way (0 = none), how long to keep polling after the last
     * request, when that was, whether engines were told the loop sleeps, whether
     * the loop polls them (kvt_engine_server_spin called), the reply scratch. */
    size_t ring_bytes;
    uint64_t ring_spin_ns;
    uint64_t ring_active_ns;
    uint64_t ring_rest_until; /* no spinning before (a spin lost its core) */
    bool rings_sleeping;
    bool ring_polled;
    unsigned n_rings;
    struct kvt_ebuf ring_out;
    /* binary requests (exec_bin): their keys, unpacked for the manager (max_keys of
     * them), and the message the ops are given, zeroed once */
    struct kvtier_key *bin_keys;
    struct kvt_emsg bin_q, bin_r;
    /* op_lookup's results, max_keys of each, lent to its reply */
    enum kvt_lookup_result *lookup_res;
    uint8_t *lookup_out;
};

static const char *const refusal_names[KVT_EREF_COUNT] = {
    [KVT_EREF_CLIENTS] = "clients",
    [KVT_EREF_MALFORMED] = "malformed",
    [KVT_EREF_OVERSIZED] = "oversized",
    [KVT_EREF_HELLO_TIMEOUT] = "hello_timeout",
    [KVT_EREF_HELLO_EVICTED] = "hello_evicted",
    [KVT_EREF_FOREIGN_STORE] = "foreign_store",
    [KVT_EREF_FOREIGN_LOAD] = "foreign_load",
    [KVT_EREF_UNKNOWN_REQUEST] = "unknown_request",
    [KVT_EREF_PARAMS] = "params_bytes",
    [KVT_EREF_CLIENT_PARAMS] = "client_params_bytes",
    [KVT_EREF_REQUESTS] = "requests",
    [KVT_EREF_OUTPUT_FULL] = "output_full",
    [KVT_EREF_EVENTS_DROPPED] = "events_dropped",
    [KVT_EREF_RING] = "ring",
    [KVT_EREF_FINGERPRINT] = "fingerprint",
    [KVT_EREF_RESET_BUSY] = "reset_busy",
};

const char *kvt_engine_refusal_name(enum kvt_engine_refusal r)
{
    return (unsigned)r < KVT_EREF_COUNT ? refusal_names[r] : "unknown";
}

static void count(struct kvt_engine_server *s, enum kvt_engine_refusal r)
{
    s->ctr.refused_by[r]++;
}

/* ---- the client's mirror ------------------------------------------------------ */

static void ereq_free(struct eclient *c, struct ereq *r)
{
    c->params_bytes -= r->params_bytes;
    kvt_req_ctx_unref(r->ctx);
    kvt_map_cleanup(&r->writing);
    kvt_free(r);
}

/* Remembers keys[0..n) as being written by r; all or nothing. */
static int writing_add(struct ereq *r, const struct kvt_key *keys, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        if (kvt_map_put(&r->writing, keys[i].bytes, keys[i].len, (void *)1) != 0) {
            /* The manager planned each key once and none of them was being written
             * (write-pending keys are never planned): every one of them is new. */
            for (size_t j = 0; j < i; j++)
                kvt_map_remove(&r->writing, keys[j].bytes, keys[j].len);
            return -ENOMEM;
        }
    }
    return 0;
}

/* Drops the mirror of a request the client finished and holds nothing of. */
static void ereq_maybe_drop(struct eclient *c, struct ereq *r)
{
    if (!r->finished || r->pending_stores > 0 || kvt_map_size(&r->writing) > 0)
        return;
    kvt_map_remove(&c->reqs, r->ctx->req_id, r->ctx->req_id_len);
    ereq_free(c, r);
}

/* Fails every key r is writing, in batches and without allocating: the primary
 * frees their slots; the manager's outstanding count is settled by the caller. */
static void writing_abort(struct kvt_primary *primary, struct ereq *r)
{
    struct kvt_key batch[64];
    struct kvt_map_entry *e;
    size_t it = 0, n = 0;

    while (kvt_map_next(&r->writing, &it, &e)) {
        kvt_key_set(&batch[n++], e->key, e->key_len);
        if (n == KVT_ARRAY_SIZE(batch)) {
            kvt_primary_complete_store(primary, batch, n, false);
            n = 0;
        }
    }
    if (n > 0)
        kvt_primary_complete_store(primary, batch, n, false);
    kvt_map_clear(&r->writing);
}

/* The cleanup of a client that went away (see the top of the file). */
static void client_release(struct kvt_engine_server *s, struct eclient *c)
{
    struct kvt_primary *primary = kvt_manager_primary(s->m);
    struct kvt_map_entry *e;
    size_t it = 0;

    while (kvt_map_next(&c->reqs, &it, &e)) {
        struct ereq *r = e->value;

        if (r->pending_stores > 0 || kvt_map_size(&r->writing) > 0) {
            /* A failed complete_store is the primary's failure plus the manager's
             * count: the same, one step at a time. */
            writing_abort(primary, r);
            for (int i = 0; i < r->pending_stores; i++)
                kvt_manager_complete_store(s->m, NULL, 0, r->ctx, false);
            s->ctr.aborted_stores += r->pending_stores > 0 ? (uint64_t)r->pending_stores : 1;
        }
        if (!r->finished) {
            kvt_manager_on_request_finished(s->m, r->ctx);
            s->ctr.finished_reqs++;
        }
        ereq_free(c, r);
    }
    kvt_map_clear(&c->reqs);
    it = 0;
    while (kvt_map_next(&c->pins, &it, &e)) {
        struct kvt_key k;
        uintptr_t n = (uintptr_t)e->value;

        kvt_key_set(&k, e->key, e->key_len);
        for (uintptr_t i = 0; i < n; i++) {
            int rc = kvt_manager_complete_load(s->m, &k, 1, NULL);

            assert(rc == 0 && "a mirrored pin was not pinned");
            (void)rc;
        }
        s->ctr.released_pins += n;
    }
    kvt_map_clear(&c->pins);
}

/* ---- events --------------------------------------------------------------------- */

static uint64_t event_weight(const struct kvt_event *e)
{
    return e->n > 0 ? e->n : 1;
}

/* Drops the oldest events until the queue is within max_event_keys. */
static void evq_trim(struct kvt_engine_server *s)
{
    while (s->evq_keys > s->max_event_keys && s->evq_head < s->evq.n) {
        struct kvt_event *e = &s->evq.ev[s->evq_head++];

        s->evq_keys -= event_weight(e);
        kvt_free(e->keys);
        e->keys = NULL;
        e->n = 0;
        count(s, KVT_EREF_EVENTS_DROPPED);
    }
    if (s->evq_head > 0 && (s->evq_head == s->evq.n || 2 * s->evq_head >= s->evq.n)) {
        memmove(s->evq.ev, s->evq.ev + s->evq_head, (s->evq.n - s->evq_head) * sizeof(*s->evq.ev));
        s->evq.n -= s->evq_head;
        s->evq_head = 0;
    }
}

/* Moves the manager's new events to the queue. */
static void evq_fill(struct kvt_engine_server *s)
{
    size_t n0 = s->evq.n;
    int rc = kvt_manager_take_events(s->m, &s->evq);

    if (rc < 0)
        kvt_debug(MOD, "taking the manager's events: %s", strerror(-rc));
    for (size_t i = n0; i < s->evq.n; i++)
        s->evq_keys += event_weight(&s->evq.ev[i]);
    if (s->evq_keys > s->max_event_keys || s->evq_head > 0)
        evq_trim(s);
}

/* ---- connections ------------------------------------------------------------------ */

static int watch(struct kvt_engine_server *s, struct eclient *c, bool out)
{
    struct epoll_event ev = {.events = out ? EPOLLOUT : EPOLLIN, .data.ptr = c};

    if (epoll_ctl(s->epfd, EPOLL_CTL_MOD, c->fd, &ev) != 0)
        return -errno;
    c->want_out = out;
    return 0;
}

static void client_destroy(struct kvt_engine_server *s, struct eclient *c, const char *why)
{
    struct eclient **pp = &s->clients;

    while (*pp != c)
        pp = &(*pp)->next;
    *pp = c->next;
    if (c->hello_done)
        kvt_info(MOD, "client %llu (%s, pid %d) gone: %s", (unsigned long long)c->id, c->name,
                 (int)c->pid, why);
    else
        s->n_new--;
    kvt__ejobs_destroy(c->jobs);
    if (c->passed_fd >= 0)
        close(c->passed_fd);
    if (c->ring != NULL) {
        kvt__ering_close(c->ring); /* an engine waiting on it wakes and finds the socket closed */
        epoll_ctl(s->epfd, EPOLL_CTL_DEL, kvt__ering_eventfd(c->ring), NULL);
        kvt__ering_destroy(c->ring);
        s->n_rings--;
    }
    client_release(s, c);
    epoll_ctl(s->epfd, EPOLL_CTL_DEL, c->fd, NULL);
    close(c->fd);
    kvt_map_cleanup(&c->reqs);
    kvt_map_cleanup(&c->pins);
    kvt_stats_cleanup(&c->stats);
    kvt__ebuf_cleanup(&c->out);
    kvt_free(c->in);
    kvt_free(c);
    s->ctr.clients--;
    s->ctr.disconnects++;
}

/* Writes what the socket takes (the caller updates the epoll watch). 0, or -errno
 * when the client is to be dropped. */
static int flush_out(struct kvt_engine_server *s, struct eclient *c)
{
    while (c->out_off < c->out.len) {
        union {
            struct cmsghdr h;
            char buf[CMSG_SPACE(3 * sizeof(int))];
        } ctl;
        struct iovec iov = {.iov_base = c->out.data + c->out_off,
                            .iov_len = c->out.len - c->out_off};
        struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1};
        ssize_t w;

        if (c->fd_to_send) {
            /* The region's fd; with a ring, its memfd and eventfd after it. */
            int fds[3] = {s->region_fd, -1, -1};
            size_t nfd = 1;

            if (c->ring != NULL) {
                fds[1] = kvt__ering_memfd(c->ring);
                fds[2] = kvt__ering_eventfd(c->ring);
                nfd = 3;
            }
            memset(&ctl, 0, sizeof(ctl));
            mh.msg_control = ctl.buf;
            mh.msg_controllen = CMSG_SPACE(nfd * sizeof(int));
            struct cmsghdr *cm = CMSG_FIRSTHDR(&mh);
            cm->cmsg_level = SOL_SOCKET;
            cm->cmsg_type = SCM_RIGHTS;
            cm->cmsg_len = CMSG_LEN(nfd * sizeof(int));
            memcpy(CMSG_DATA(cm), fds, nfd * sizeof(int));
        }
        w = sendmsg(c->fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (w < 0) {
            if (errno == EINTR)
                continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK)
                break;
            return -errno;
        }
        c->fd_to_send = false;
        c->out_off += (size_t)w;
    }
    if (c->out_off == c->out.len) {
        c->out.len = 0;
        c->out_off = 0;
    }
    return 0;
}

/* EPOLLOUT while replies are queued, else EPOLLIN. */
static int update_watch(struct kvt_engine_server *s, struct eclient *c)
{
    bool pending = c->out.len > 0;

    return pending != c->want_out ? watch(s, c, pending) : 0;
}

static int queue(struct eclient *c, const struct kvt_emsg *m)
{
    return kvt__emsg_encode(m, &c->out);
}

/* Queues an ERROR frame (best effort) with why as its message, and marks the client
 * for closing. */
static void refuse(struct eclient *c, int err, const char *why)
{
    struct kvt_emsg m;

    kvt__emsg_init(&m);
    m.op = KVT_EOP_ERROR | KVT_EOP_REPLY;
    m.rc = err;
    snprintf(m.message, sizeof(m.message), "%s", why);
    m.has = 1u << KVT_EF_OP | 1u << KVT_EF_RC | 1u << KVT_EF_MESSAGE;
    queue(c, &m);
    c->closing = true;
    c->closing_ns = kvt_now_ns();
    if (c->ring != NULL)
        kvt__ering_close(c->ring); /* the engine stops waiting there and reads the socket */
    kvt_warn(MOD, "client %llu (%s, pid %d): %s (%s); closing", (unsigned long long)c->id,
             c->name[0] ? c->name : "-", (int)c->pid, why, strerror(-err));
}

/* The oldest client other than except that has not said HELLO and is not closing. */
static struct eclient *oldest_new(struct kvt_engine_server *s, const struct eclient *except)
{
    struct eclient *found = NULL;

    for (struct eclient *x = s->clients; x != NULL; x = x->next) /* newest first */
        if (x != except && !x->hello_done && !x->closing)
            found = x;
    return found;
}

/* accept failed with err (not EAGAIN): counted and logged (kvt_accept_failed); on a
 * lack of descriptors or memory the listening socket leaves the epoll set for its rest
 * (accept_resume puts it back). */
static void accept_failed(struct kvt_engine_server *s, int err)
{
    bool resting = s->accept_rest.until != 0;
    struct epoll_event ev = {.events = 0, .data.ptr = NULL};

    s->ctr.accept_failed++;
    if (kvt_accept_failed(&s->accept_rest, MOD, s->path, err, kvt_now_ns()) && !resting &&
        epoll_ctl(s->epfd, EPOLL_CTL_MOD, s->listen_fd, &ev) != 0)
        s->accept_rest.until = 0; /* still in: retried at the next event */
}

/* The listening socket's rest is over: it goes back into the epoll set. */
static void accept_resume(struct kvt_engine_server *s)
{
    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = NULL};

    if (s->accept_rest.until == 0 || kvt_now_ns() < s->accept_rest.until)
        return;
    if (epoll_ctl(s->epfd, EPOLL_CTL_MOD, s->listen_fd, &ev) == 0)
        s->accept_rest.until = 0;
}

static void accept_one(struct kvt_engine_server *s)
{
    struct eclient *c;
    struct epoll_event ev;
    struct ucred cred;
    socklen_t cl = sizeof(cred);
    int fd = accept4(s->listen_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);

    if (fd < 0) {
        if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR && errno != ECONNABORTED)
            accept_failed(s, errno);
        return;
    }
    c = kvt_calloc(1, sizeof(*c));
    if (c == NULL) {
        kvt_error(MOD, "no memory for a new client");
        close(fd);
        return;
    }
    c->fd = fd;
    c->passed_fd = -1;
    c->id = ++s->next_id;
    c->pid = getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &cl) == 0 ? cred.pid : -1;
    c->accepted_ns = kvt_now_ns();
    kvt_map_init(&c->reqs);
    kvt_map_init(&c->pins);
    kvt_stats_init(&c->stats);
    kvt__ebuf_init(&c->out);
    ev = (struct epoll_event){.events = EPOLLIN, .data.ptr = c};
    if (epoll_ctl(s->epfd, EPOLL_CTL_ADD, fd, &ev) != 0) {
        kvt_error(MOD, "epoll_ctl add client: %s", strerror(errno));
        close(fd);
        kvt_free(c);
        return;
    }
    c->next = s->clients;
    s->clients = c;
    s->n_new++;
    s->ctr.clients++;
    s->ctr.accepted++;
    if (s->ctr.clients > s->max_clients) {
        /* Full: a connection that never said HELLO gives way to the new one (closed
         * at the end of this progress, not now: events of this batch may name it). */
        struct eclient *old = oldest_new(s, c);

        if (old != NULL) {
            count(s, KVT_EREF_HELLO_EVICTED);
            refuse(old, -EUSERS, "no HELLO yet and the server is full");
        } else {
            s->ctr.refused++;
            refuse(c, -EUSERS, "too many clients");
        }
    }
}

/* ---- requests ------------------------------------------------------------------- */

static struct ereq *own_req(struct eclient *c, const struct kvt_emsg *q)
{
    if (!kvt__emsg_has(q, KVT_EF_REQ_ID))
        return NULL;
    return kvt_map_get(&c->reqs, q->req_id, strlen(q->req_id));
}

/* The request q names, which must be one of the client's: NULL (counted) if not. */
static struct ereq *named_req(struct kvt_engine_server *s, struct eclient *c,
                              const struct kvt_emsg *q)
{
    struct ereq *er = own_req(c, q);

    if (er == NULL && kvt__emsg_has(q, KVT_EF_REQ_ID))
        count(s, KVT_EREF_UNKNOWN_REQUEST);
    return er;
}

static const struct kvt_key *keys_of(const struct kvt_emsg *q)
{
    return (const struct kvt_key *)q->keys;
}

/* Gives c a ring whose fds ride with HELLO's reply (and says so in its flags). */
static void ring_attach(struct kvt_engine_server *s, struct eclient *c, struct kvt_emsg *r)
{
    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = (void *)((uintptr_t)c | RING_TAG)};

    if (kvt__ering_create(s->ring_bytes, &c->ring) != 0)
        return;
    if (epoll_ctl(s->epfd, EPOLL_CTL_ADD, kvt__ering_eventfd(c->ring), &ev) != 0) {
        kvt_warn(MOD, "client %llu: epoll_ctl add ring: %s", (unsigned long long)c->id,
                 strerror(errno));
        kvt__ering_destroy(c->ring);
        c->ring = NULL;
        return;
    }
    kvt__ering_set_sleeping(c->ring, s->rings_sleeping || !s->ring_polled);
    s->n_rings++;
    s->ctr.ring_clients++;
    r->flags = KVT_HELLO_RING | KVT_HELLO_BIN;
    r->has |= 1u << KVT_EF_FLAGS;
}

/* The engine's fingerprint against the node's: 0 (accepted; the node's set by it
 * when it had none), or -EKEYREJECTED / fingerprint_set's error with s->why set. */
static int hello_fingerprint(struct kvt_engine_server *s, struct eclient *c,
                             const struct kvt_emsg *q)
{
    const char *fp = q->fingerprint;
    int rc;

    if (!kvt__emsg_has(q, KVT_EF_FINGERPRINT) || fp[0] == '\0')
        return 0; /* declares none: a tool, or an engine of an earlier version */
    if (s->fingerprint[0] == '\0') {
        rc = s->fingerprint_set != NULL ? s->fingerprint_set(s->collect_arg, fp) : 0;
        if (rc < 0) {
            count(s, KVT_EREF_FINGERPRINT);
            s->why_counted = true;
            snprintf(s->why, sizeof(s->why), "the node cannot take the model fingerprint '%s': %s",
                     fp, strerror(-rc));
            return rc;
        }
        snprintf(s->fingerprint, sizeof(s->fingerprint), "%s", fp);
        kvt_info(MOD, "client %llu (%s): the node's model fingerprint is now %s",
                 (unsigned long long)c->id, c->name, KVT_LOG_STR(fp));
        return 0;
    }
    if (strcmp(fp, s->fingerprint) == 0)
        return 0;
    count(s, KVT_EREF_FINGERPRINT);
    s->why_counted = true;
    snprintf(s->why, sizeof(s->why),
             "model fingerprint mismatch: the engine declares '%s', the node serves '%s' "
             "(node.model_fingerprint, or the first engine's); its chunks are not this "
             "engine's",
             fp, s->fingerprint);
    return -EKEYREJECTED;
}

static int op_hello(struct kvt_engine_server *s, struct eclient *c, const struct kvt_emsg *q,
                    struct kvt_emsg *r)
{
    int rc;

    if (!kvt__emsg_has(q, KVT_EF_MAJOR) || q->major != KVTIER_PROTO_MAJOR) {
        snprintf(s->why, sizeof(s->why), "protocol major %llu, the node speaks %d",
                 (unsigned long long)q->major, KVTIER_PROTO_MAJOR);
        return -EPROTO;
    }
    /* The name is the engine's to choose: kept only in its log-safe form. */
    kvt_log_escape(c->name, sizeof(c->name), q->name[0] ? q->name : "engine");
    rc = hello_fingerprint(s, c, q);
    if (rc < 0)
        return rc;
    c->hello_done = true;
    s->n_new--;
    memcpy(r->geom, s->geom, sizeof(s->geom));
    r->geom[KVT_EG_CLIENT_ID] = c->id;
    r->n_geom = KVT_EG_COUNT;
    r->major = KVTIER_PROTO_MAJOR;
    r->minor = KVTIER_PROTO_MINOR;
    r->has |= 1u << KVT_EF_GEOM | 1u << KVT_EF_MAJOR | 1u << KVT_EF_MINOR;
    if (s->fingerprint[0] != '\0') {
        memcpy(r->fingerprint, s->fingerprint, sizeof(r->fingerprint));
        r->has |= 1u << KVT_EF_FINGERPRINT;
    }
    c->fd_to_send = true;
    if (kvt__emsg_has(q, KVT_EF_FLAGS) && (q->flags & KVT_HELLO_RING) && s->ring_bytes > 0)
        ring_attach(s, c, r); /* without one the engine uses the socket */
    kvt_info(MOD, "client %llu (%s, pid %d) attached%s", (unsigned long long)c->id, c->name,
             (int)c->pid, c->ring != NULL ? " with a ring" : "");
    return 0;
}

static int op_new_request(struct kvt_engine_server *s, struct eclient *c, const struct kvt_emsg *q,
                          struct kvt_emsg *r)
{
    enum kvt_offload_policy policy = KVT_CHUNK_LEVEL;
    size_t params_bytes = q->params != NULL ? q->params_len : 0;
    struct kvt_req_ctx *ctx;
    struct ereq *er;
    int rc;

    if (!kvt__emsg_has(q, KVT_EF_REQ_ID))
        return -EINVAL;
    if (strncmp(q->req_id, KVT_EJOBS_REQ_PREFIX, strlen(KVT_EJOBS_REQ_PREFIX)) == 0 ||
        strcmp(q->req_id, ANON_REQ_ID) == 0) {
        /* The node's own requests' names (request ids are one namespace): taken
         * first, they would refuse a later engine's ATTACH or hold every engine's
         * anonymous loads. */
        count(s, KVT_EREF_UNKNOWN_REQUEST);
        return -EINVAL;
    }
    if (own_req(c, q) != NULL)
        return -EEXIST; /* (the mirror's entry must not be replaced) */
    if (kvt_map_size(&c->reqs) >= s->max_requests) {
        count(s, KVT_EREF_REQUESTS);
        return -ENOBUFS;
    }
    if (params_bytes > s->max_params) {
        count(s, KVT_EREF_PARAMS);
        return -EMSGSIZE;
    }
    if (c->params_bytes + params_bytes > s->max_client_params) {
        count(s, KVT_EREF_CLIENT_PARAMS);
        return -ENOBUFS;
    }
    rc = kvt_req_ctx_create(q->req_id, q->params, &ctx);
    if (rc < 0)
        return rc;
    if (kvt__emsg_has(q, KVT_EF_FILTER)) {
        ctx->load_tier_filter.all = false;
        ctx->load_tier_filter.n = (uint8_t)q->n_filter;
        for (uint32_t i = 0; i < q->n_filter; i++) {
            ctx->load_tier_filter.m[i].medium = q->filter[i].medium;
            ctx->load_tier_filter.m[i].locality = q->filter[i].locality;
        }
    }
    er = kvt_calloc(1, sizeof(*er));
    if (er == NULL) {
        kvt_req_ctx_unref(ctx);
        return -ENOMEM;
    }
    er->ctx = ctx;
    er->params_bytes = params_bytes;
    c->params_bytes += params_bytes;
    kvt_map_init(&er->writing);
    if (kvt_map_put(&c->reqs, ctx->req_id, ctx->req_id_len, er) != 0) {
        ereq_free(c, er);
        return -ENOMEM;
    }
    rc = kvt_manager_on_new_request(s->m, ctx, &policy);
    if (rc < 0) {
        kvt_map_remove(&c->reqs, ctx->req_id, ctx->req_id_len);
        ereq_free(c, er);
        return rc;
    }
    r->flags = policy == KVT_REQUEST_LEVEL;
    r->has |= 1u << KVT_EF_FLAGS;
    return 0;
}

static int op_lookup(struct kvt_engine_server *s, struct eclient *c, const struct kvt_emsg *q,
                     struct kvt_emsg *r)
{
    struct ereq *er = named_req(s, c, q);
    enum kvt_lookup_result *res;
    size_t n;

    if (er == NULL || er->finished || !kvt__emsg_has(q, KVT_EF_KEYS) ||
        (q->flags & ~(uint64_t)KVTIER_LOOKUP_PREFIX) != 0)
        return -EINVAL;
    /* The server's scratch (max_keys each, as q's keys): the reply borrows it, and
     * exec_frame and exec_bin detach it before they free the reply. */
    res = s->lookup_res;
    r->results = s->lookup_out;
    n = kvt_manager_lookup_many(s->m, keys_of(q), q->n_keys, er->ctx,
                                (q->flags & KVTIER_LOOKUP_PREFIX) != 0, res);
    for (size_t i = 0; i < n; i++)
        r->results[i] = (uint8_t)res[i];
    r->n_results = (uint32_t)n;
    r->has |= 1u << KVT_EF_RESULTS;
    return 0;
}

static int op_prepare_store(struct kvt_engine_server *s, struct eclient *c,
                            const struct kvt_emsg *q, struct kvt_emsg *r)
{
    struct kvt_store_output *out = &s->store_out;
    struct ereq *er = named_req(s, c, q);
    uint32_t i = 0;
    int rc;

    if (er == NULL || er->finished || !kvt__emsg_has(q, KVT_EF_KEYS))
        return -EINVAL;
    rc = kvt_manager_prepare_store(s->m, keys_of(q), q->n_keys, er->ctx, out);
    if (rc < 0)
        return rc;
    r->index = kvt_calloc(out->n_store ? out->n_store : 1, sizeof(*r->index));
    r->ids = kvt_calloc(out->n_store ? out->n_store : 1, sizeof(*r->ids));
    if (r->index == NULL || r->ids == NULL || writing_add(er, out->keys_to_store, out->n_store)) {
        /* The manager already allocated: undo it so nothing changed. */
        if (out->n_store > 0)
            kvt_manager_complete_store(s->m, out->keys_to_store, out->n_store, er->ctx, false);
        return -ENOMEM;
    }
    /* The plan lists the first occurrence of each planned key in the order given:
     * one forward pass finds every index. */
    for (size_t j = 0; j < out->n_store; j++) {
        while (i < q->n_keys && !kvt_key_eq(&keys_of(q)[i], &out->keys_to_store[j]))
            i++;
        assert(i < q->n_keys && "prepare_store planned a key it was not given, or out of order");
        r->index[j] = i;
        r->ids[j] = out->chunk_ids[j];
    }
    if (out->n_store > 0)
        er->pending_stores++;
    r->n_index = r->n_ids = (uint32_t)out->n_store;
    r->evicted = (struct kvtier_key *)out->evicted; /* not owned: detached before free */
    r->n_evicted = (uint32_t)out->n_evicted;
    r->has |= 1u << KVT_EF_INDEX | 1u << KVT_EF_IDS | 1u << KVT_EF_EVICTED;
    return 0;
}

/* Every key the client names in complete_store that is being written must be one it
 * prepared in this request: the manager would complete anyone's write-pending key,
 * and a third engine would then load a row nobody finished writing. A key that is not
 * being written (ready, or gone) is left to the manager, which ignores it. */
static int op_complete_store(struct kvt_engine_server *s, struct eclient *c,
                             const struct kvt_emsg *q, struct kvt_emsg *r)
{
    struct kvt_primary *primary = kvt_manager_primary(s->m);
    struct ereq *er = named_req(s, c, q);
    int rc;

    if (er == NULL || er->pending_stores <= 0 || !kvt__emsg_has(q, KVT_EF_KEYS))
        return -EINVAL;
    for (uint32_t i = 0; i < q->n_keys; i++) {
        const struct kvt_key *k = &keys_of(q)[i];
        struct kvt_primary_entry_info info;

        if (kvt_map_get(&er->writing, k->bytes, k->len) != NULL)
            continue;
        if (kvt_primary_entry_info(primary, k, &info) == 0 && info.ref_cnt < 0) {
            count(s, KVT_EREF_FOREIGN_STORE);
            kvt_debug(MOD, "client %llu (%s): complete_store of a key it is not writing",
                      (unsigned long long)c->id, c->name);
            return -EINVAL;
        }
    }
    rc = kvt_manager_complete_store(s->m, keys_of(q), q->n_keys, er->ctx, q->flags != 0);
    if (rc < 0)
        return rc;
    er->pending_stores--;
    for (uint32_t i = 0; i < q->n_keys; i++)
        kvt_map_remove(&er->writing, keys_of(q)[i].bytes, keys_of(q)[i].len);
    ereq_maybe_drop(c, er);
    return 0;
}

static struct kvt_req_ctx *ctx_for(struct kvt_engine_server *s, struct eclient *c,
                                   const struct kvt_emsg *q, int *rc_p)
{
    struct ereq *er = named_req(s, c, q);

    *rc_p = 0;
    if (er != NULL)
        return er->ctx;
    if (kvt__emsg_has(q, KVT_EF_REQ_ID))
        *rc_p = -EINVAL; /* names a request that is not this client's */
    return s->anon_ctx;
}

static int op_prepare_load(struct kvt_engine_server *s, struct eclient *c, const struct kvt_emsg *q,
                           struct kvt_emsg *r)
{
    int rc;
    struct kvt_req_ctx *ctx = ctx_for(s, c, q, &rc);

    if (rc < 0 || !kvt__emsg_has(q, KVT_EF_KEYS))
        return -EINVAL;
    r->ids = kvt_calloc(q->n_keys ? q->n_keys : 1, sizeof(*r->ids));
    if (r->ids == NULL)
        return -ENOMEM;
    rc = kvt_manager_prepare_load(s->m, keys_of(q), q->n_keys, ctx, r->ids);
    if (rc < 0)
        return rc;
    if (kvt_pins_add(&c->pins, keys_of(q), q->n_keys) != 0) {
        /* Out of memory for the mirror: unpin what is not mirrored. */
        kvt_manager_complete_load(s->m, keys_of(q), q->n_keys, ctx);
        return -ENOMEM;
    }
    r->n_ids = q->n_keys;
    r->has |= 1u << KVT_EF_IDS;
    return 0;
}

static int op_complete_load(struct kvt_engine_server *s, struct eclient *c,
                            const struct kvt_emsg *q, struct kvt_emsg *r)
{
    int rc;
    struct kvt_req_ctx *ctx = ctx_for(s, c, q, &rc);

    if (rc < 0 || !kvt__emsg_has(q, KVT_EF_KEYS))
        return -EINVAL;
    rc = kvt_pins_cover(&c->pins, keys_of(q), q->n_keys, &s->named);
    if (rc < 0)
        return rc;
    if (rc == 0) {
        count(s, KVT_EREF_FOREIGN_LOAD);
        return -EINVAL;
    }
    rc = kvt_manager_complete_load(s->m, keys_of(q), q->n_keys, ctx);
    if (rc < 0)
        return rc;
    kvt_pins_drop(&c->pins, keys_of(q), q->n_keys);
    return 0;
}

static int op_touch(struct kvt_engine_server *s, struct eclient *c, const struct kvt_emsg *q,
                    struct kvt_emsg *r)
{
    int rc;
    struct kvt_req_ctx *ctx = ctx_for(s, c, q, &rc);

    if (rc < 0 || !kvt__emsg_has(q, KVT_EF_KEYS))
        return -EINVAL;
    kvt_manager_touch(s->m, keys_of(q), q->n_keys, ctx);
    return 0;
}

static int op_request_finished(struct kvt_engine_server *s, struct eclient *c,
                               const struct kvt_emsg *q, struct kvt_emsg *r)
{
    struct ereq *er = named_req(s, c, q);
    int rc;

    if (er == NULL || er->finished)
        return -EINVAL;
    rc = kvt_manager_on_request_finished(s->m, er->ctx);
    if (rc < 0)
        return rc;
    er->finished = true;
    ereq_maybe_drop(c, er);
    return 0;
}

static int op_schedule_end(struct kvt_engine_server *s, struct eclient *c, const struct kvt_emsg *q,
                           struct kvt_emsg *r)
{
    const char **ids = kvt_calloc((size_t)q->n_new + q->n_preempted + 1, sizeof(*ids));
    struct kvt_schedule_end_ctx ctx;

    if (ids == NULL)
        return -ENOMEM;
    for (uint32_t i = 0; i < q->n_new; i++)
        ids[i] = q->new_ids[i];
    for (uint32_t i = 0; i < q->n_preempted; i++)
        ids[q->n_new + i] = q->preempted[i];
    ctx = (struct kvt_schedule_end_ctx){.new_req_ids = ids,
                                        .n_new = q->n_new,
                                        .preempted_req_ids = ids + q->n_new,
                                        .n_preempted = q->n_preempted};
    kvt_manager_on_schedule_end(s->m, &ctx);
    kvt_free(ids);
    return 0;
}

static int op_take_events(struct kvt_engine_server *s, struct eclient *c, const struct kvt_emsg *q,
                          struct kvt_emsg *r)
{
    struct kvt_events *evs = &s->evs; /* emptied once the reply is encoded */
    struct kvt_events tmp;

    /* The whole queue becomes this reply's (s->evs is empty between frames). */
    evq_fill(s);
    if (s->evq_head > 0) {
        memmove(s->evq.ev, s->evq.ev + s->evq_head, (s->evq.n - s->evq_head) * sizeof(*s->evq.ev));
        s->evq.n -= s->evq_head;
        s->evq_head = 0;
    }
    tmp = *evs;
    *evs = s->evq;
    s->evq = tmp;
    s->evq_keys = 0;
    if (evs->n > 0) {
        r->events = kvt_calloc(evs->n, sizeof(*r->events));
        if (r->events == NULL)
            return -ENOMEM;
    }
    for (size_t i = 0; i < evs->n; i++) {
        r->events[i] = (struct kvtier_event){.keys = (struct kvtier_key *)evs->ev[i].keys,
                                             .n = evs->ev[i].n,
                                             .medium = evs->ev[i].medium,
                                             .locality = evs->ev[i].locality,
                                             .removed = evs->ev[i].removed};
    }
    r->n_events = (uint32_t)evs->n;
    r->has |= 1u << KVT_EF_EVENTS;
    return 0;
}

static int op_get_stats(struct kvt_engine_server *s, struct eclient *c, const struct kvt_emsg *q,
                        struct kvt_emsg *r)
{
    struct kvt_stats st;
    int rc;

    kvt_stats_init(&st);
    if (kvt__emsg_has(q, KVT_EF_FLAGS) && (q->flags & KVT_ESTATS_TOTALS)) {
        rc = s->total_stats != NULL ? s->total_stats(s->collect_arg, &st) : -EOPNOTSUPP;
    } else if (s->collect_stats != NULL) {
        s->collect_stats(s->collect_arg); /* fills every client's c->stats */
        rc = kvt_stats_aggregate(&st, &c->stats);
        kvt_stats_clear(&c->stats);
    } else {
        rc = kvt_manager_get_stats(s->m, &st);
    }
    if (rc == 0) {
        r->stats = kvt_calloc(st.n ? st.n : 1, sizeof(*r->stats));
        r->stat_bounds = kvt_calloc(st.n ? st.n : 1, sizeof(*r->stat_bounds));
        if (r->stats == NULL || r->stat_bounds == NULL)
            rc = -ENOMEM;
    }
    if (rc == 0) {
        for (size_t i = 0; i < st.n; i++) {
            struct kvtier_stat *o = &r->stats[i];
            const struct kvt_stat *in = &st.s[i];

            memcpy(o->name, in->name, sizeof(o->name));
            memcpy(o->label, in->label, sizeof(o->label));
            o->name[sizeof(o->name) - 1] = o->label[sizeof(o->label) - 1] = '\0';
            o->kind = (int)in->kind;
            o->value = in->value;
            o->count = in->count;
            o->sum = in->sum;
            memcpy(o->buckets, in->buckets, sizeof(o->buckets));
            if (in->kind == KVT_METRIC_HISTOGRAM) {
                const struct kvt_hist_layout *l =
                    in->layout != NULL ? in->layout : kvt_hist_layout_of(in->name);

                r->stat_bounds[i].n = (uint32_t)l->n;
                memcpy(r->stat_bounds[i].bound, l->bounds, l->n * sizeof(l->bounds[0]));
            }
        }
        r->n_stats = (uint32_t)st.n;
        /* Each histogram's own bounds, and the default ones for older clients. */
        memcpy(r->bounds, kvt_hist_bounds, sizeof(r->bounds));
        r->n_bounds = KVTIER_HIST_BUCKETS;
        r->has |= 1u << KVT_EF_STATS | 1u << KVT_EF_BOUNDS | 1u << KVT_EF_STAT_BOUNDS;
    }
    kvt_stats_cleanup(&st);
    return rc;
}

static int op_attach(struct kvt_engine_server *s, struct eclient *c, const struct kvt_emsg *q,
                     struct kvt_emsg *r)
{
    int fd = c->passed_fd;

    c->passed_fd = -1;
    return kvt__ejobs_attach(&c->jobs, s->m, c->id, fd, q, r, &s->ctr, s->waiting_keys_per_pass);
}

static int op_jobs(struct kvt_engine_server *s, struct eclient *c, const struct kvt_emsg *q,
                   struct kvt_emsg *r)
{
    if (c->jobs == NULL) {
        s->ctr.jobs_refused++;
        return -ENOTCONN; /* no region attached */
    }
    return kvt__ejobs_step(c->jobs, q, r, s->lim.max_keys);
}

/* What of x a reset would wipe under it, or NULL. */
static const char *holds(const struct eclient *x)
{
    struct kvt_map_entry *e;
    size_t it = 0;

    if (kvt_map_size(&x->pins) > 0)
        return "pins";
    while (kvt_map_next(&x->reqs, &it, &e)) {
        const struct ereq *r = e->value;

        if (r->pending_stores > 0 || kvt_map_size(&r->writing) > 0)
            return "prepared stores";
    }
    if (x->jobs != NULL && kvt__ejobs_waiting(x->jobs))
        return "load jobs waiting";
    return NULL;
}

static int op_reset(struct kvt_engine_server *s, struct eclient *c, const struct kvt_emsg *q,
                    struct kvt_emsg *r)
{
    int rc;

    for (struct eclient *x = s->clients; x != NULL; x = x->next) {
        const char *what = x->hello_done ? holds(x) : NULL;

        if (what != NULL) {
            count(s, KVT_EREF_RESET_BUSY);
            kvt_info(MOD, "client %llu (%s): reset refused, client %llu (%s) holds %s",
                     (unsigned long long)c->id, c->name, (unsigned long long)x->id, x->name, what);
            return -EBUSY;
        }
    }
    rc = kvt_manager_reset_all(s->m);
    /* The chunks the queued events describe are gone (whatever a tier said). */
    for (size_t i = s->evq_head; i < s->evq.n; i++)
        kvt_free(s->evq.ev[i].keys);
    s->evq.n = s->evq_head = 0;
    s->evq_keys = 0;
    s->ctr.resets++;
    if (rc == 0)
        kvt_info(MOD, "client %llu (%s, pid %d) reset the node's cache", (unsigned long long)c->id,
                 c->name, (int)c->pid);
    else
        kvt_error(MOD, "client %llu (%s): reset: %s", (unsigned long long)c->id, c->name,
                  strerror(-rc));
    return rc;
}

static int op_pending(struct kvt_engine_server *s, struct eclient *c, const struct kvt_emsg *q,
                      struct kvt_emsg *r)
{
    r->flags = 0;
    if (kvt_manager_has_pending_work(s->m))
        r->flags |= KVT_EPENDING_NODE;
    if (c->jobs != NULL && kvt__ejobs_unreported(c->jobs))
        r->flags |= KVT_EPENDING_CLIENT;
    r->has |= 1u << KVT_EF_FLAGS;
    return 0;
}

static int op_peers(struct kvt_engine_server *s, struct eclient *c, const struct kvt_emsg *q,
                    struct kvt_emsg *r)
{
    size_t cap = 1024, n = 0;
    int rc;

    if (s->peers == NULL)
        return -EOPNOTSUPP;
    r->peers = kvt_calloc(cap, sizeof(*r->peers));
    if (r->peers == NULL)
        return -ENOMEM;
    rc = s->peers(s->collect_arg, r->peers, cap, &n);
    if (rc < 0)
        return rc;
    r->n_peers = (uint32_t)KVT_MIN(n, cap);
    r->has |= 1u << KVT_EF_PEERS;
    return 0;
}

typedef int (*op_fn)(struct kvt_engine_server *, struct eclient *, const struct kvt_emsg *,
                     struct kvt_emsg *);

static const op_fn ops[KVT_EOP_MAX_REQUEST + 1] = {
    [KVT_EOP_HELLO] = op_hello,
    [KVT_EOP_NEW_REQUEST] = op_new_request,
    [KVT_EOP_LOOKUP] = op_lookup,
    [KVT_EOP_PREPARE_STORE] = op_prepare_store,
    [KVT_EOP_COMPLETE_STORE] = op_complete_store,
    [KVT_EOP_PREPARE_LOAD] = op_prepare_load,
    [KVT_EOP_COMPLETE_LOAD] = op_complete_load,
    [KVT_EOP_TOUCH] = op_touch,
    [KVT_EOP_REQUEST_FINISHED] = op_request_finished,
    [KVT_EOP_SCHEDULE_END] = op_schedule_end,
    [KVT_EOP_TAKE_EVENTS] = op_take_events,
    [KVT_EOP_GET_STATS] = op_get_stats,
    [KVT_EOP_ATTACH] = op_attach,
    [KVT_EOP_JOBS] = op_jobs,
    [KVT_EOP_RESET] = op_reset,
    [KVT_EOP_PENDING] = op_pending,
    [KVT_EOP_PEERS] = op_peers,
};

/* Executes one frame body (from the socket or the ring) and encodes its reply into
 * out (a whole frame, header included). A frame that must close the connection
 * queues an ERROR frame on the socket instead (refuse). */
static void exec_frame(struct kvt_engine_server *s, struct eclient *c, const uint8_t *body,
                       size_t len, struct kvt_ebuf *out)
{
    struct kvt_emsg q, r;
    int rc = kvt__emsg_decode(body, len, &s->lim, &q);

    if (rc < 0) {
        if (rc == -EMSGSIZE)
            s->ctr.oversized++;
        else if (rc != -ENOMEM)
            s->ctr.malformed++;
        refuse(c, rc,
               rc == -ENOMEM ? "no memory to decode a request"
                             : "bad request (malformed or over a limit)");
        return;
    }
    if (q.op < 1 || q.op > KVT_EOP_MAX_REQUEST || !kvt__emsg_has(&q, KVT_EF_SEQ) ||
        (q.op == KVT_EOP_HELLO) == c->hello_done) {
        s->ctr.malformed++;
        refuse(c, -EPROTO, c->hello_done ? "unknown op or a second hello" : "no hello first");
        kvt__emsg_free(&q);
        return;
    }
    s->ctr.requests++;
    kvt__emsg_init(&r);
    s->why[0] = '\0';
    s->why_counted = false;
    rc = ops[q.op](s, c, &q, &r);
    if (q.op == KVT_EOP_HELLO && rc < 0) {
        if (!s->why_counted)
            s->ctr.malformed++;
        refuse(c, rc, s->why[0] ? s->why : "incompatible hello");
        kvt__emsg_free(&r);
        kvt__emsg_free(&q);
        return;
    }
    if (rc < 0)
        r.has = 0; /* a failed call returns nothing but its rc */
    r.op = q.op | KVT_EOP_REPLY;
    r.seq = q.seq;
    r.rc = rc;
    r.has |= 1u << KVT_EF_OP | 1u << KVT_EF_SEQ | 1u << KVT_EF_RC;
    if (kvt__emsg_encode(&r, out) != 0)
        refuse(c, -ENOMEM, "no memory for a reply");
    /* Borrowed from the server's scratch, not the reply's to free. */
    r.evicted = NULL;
    r.results = r.results == s->lookup_out ? NULL : r.results;
    for (uint32_t i = 0; i < r.n_events; i++)
        r.events[i].keys = NULL;
    kvt_events_cleanup(&s->evs);
    kvt_events_init(&s->evs);
    kvt__emsg_free(&r);
    kvt__emsg_free(&q);
}

/* Executes one binary request from the ring (kvt__ebin_req_parse checks it whole
 * first) through the same op as its frame. Its binary reply is *rh_p and the
 * payload (plen bytes at *payload_p: lookup's results, prepare_load's ids), valid
 * until bin_done: the caller writes them straight into the ring's reply record (no
 * frame is encoded unless the reply goes on the socket). false: the request did
 * not parse, it was refused and counted like a malformed frame. The op sees a
 * message with only the fields the frame would have had. */
static bool exec_bin(struct kvt_engine_server *s, struct eclient *c, const uint8_t *body,
                     size_t len, struct kvt_ebin_rep *rh_p, const uint8_t **payload_p,
                     size_t *plen_p)
{
    struct kvt_emsg *q = &s->bin_q, *r = &s->bin_r;
    struct kvt_ebin_req h;
    struct kvt_ebin_rep rh = {.magic = KVT_EBIN_MAGIC};
    const uint8_t *kp, *payload = NULL;
    const char *id;
    size_t plen = 0;
    int rc = kvt__ebin_req_parse(body, len, &s->lim, &h, &id, &kp);

    if (rc < 0) {
        if (rc == -EMSGSIZE)
            s->ctr.oversized++;
        else
            s->ctr.malformed++;
        refuse(c, rc, "bad binary request (malformed or over a limit)");
        return false;
    }
    s->ctr.requests++;
    q->op = h.op;
    q->seq = h.seq;
    q->flags = h.flags;
    q->has = 1u << KVT_EF_OP | 1u << KVT_EF_SEQ | 1u << KVT_EF_KEYS | 1u << KVT_EF_FLAGS;
    if (h.id_len > 0) {
        kvt_ering_copy(q->req_id, id, h.id_len);
        q->req_id[h.id_len] = '\0';
        q->has |= 1u << KVT_EF_REQ_ID;
    }
    for (uint32_t i = 0; i < h.n; i++) {
        struct kvtier_key *k = &s->bin_keys[i];

        k->len = h.key_len;
        /* (keys are compared and hashed by len; zeroed as decoded. Whole, then the
         * key over it: both copies inline, see kvt_ering_copy) */
        __builtin_memset(k->bytes, 0, KVTIER_KEY_MAX);
        kvt_ering_copy(k->bytes, kp + (size_t)i * h.key_len, h.key_len);
    }
    q->keys = s->bin_keys;
    q->n_keys = h.n;
    s->why[0] = '\0';
    s->why_counted = false;
    rc = ops[h.op](s, c, q, r);
    rh.op = (uint8_t)(h.op | KVT_EOP_REPLY);
    rh.rc = rc < 0 ? rc : 0;
    rh.seq = h.seq;
    if (rc >= 0 && h.op == KVT_EOP_LOOKUP) {
        rh.n = r->n_results;
        payload = r->results;
        plen = r->n_results;
    } else if (rc >= 0 && h.op == KVT_EOP_PREPARE_LOAD) {
        rh.n = r->n_ids;
        payload = (const uint8_t *)r->ids;
        plen = (size_t)r->n_ids * sizeof(*r->ids);
    }
    *rh_p = rh;
    *payload_p = payload;
    *plen_p = plen;
    return true;
}

/* After exec_bin's reply went out: frees what the binary ops allocate for their
 * replies (lookup's results are the server's scratch). */
static void bin_done(struct kvt_engine_server *s)
{
    struct kvt_emsg *q = &s->bin_q, *r = &s->bin_r;

    if (r->results != s->lookup_out)
        kvt_free(r->results);
    kvt_free(r->ids);
    r->results = NULL;
    r->ids = NULL;
    r->n_results = r->n_ids = 0;
    r->has = 0;
    q->has = 0;
}

static void handle_frame(struct kvt_engine_server *s, struct eclient *c, const uint8_t *body,
                         size_t len)
{
    exec_frame(s, c, body, len, &c->out);
}

/* Executes the complete frames buffered, in order, until the client's queued replies
 * reach max_output_bytes; the rest wait in the input buffer. */
static void run_frames(struct kvt_engine_server *s, struct eclient *c)
{
    size_t off = 0;

    while (!c->closing && c->in_len - off >= KVT_EPROTO_HDR) {
        uint32_t len = kvt__eproto_frame_len(c->in + off);

        if (len > s->lim.max_body) {
            s->ctr.oversized++;
            refuse(c, -EMSGSIZE, "frame over max_msg_bytes");
            break;
        }
        if (c->in_len - off < KVT_EPROTO_HDR + (size_t)len)
            break;
        if (c->out.len - c->out_off >= s->max_output) {
            if (!c->out_full)
                count(s, KVT_EREF_OUTPUT_FULL);
            c->out_full = true;
            break;
        }
        c->out_full = false;
        handle_frame(s, c, c->in + off + KVT_EPROTO_HDR, len);
        off += KVT_EPROTO_HDR + len;
    }
    if (off > 0) {
        memmove(c->in, c->in + off, c->in_len - off);
        c->in_len -= off;
    }
    if (c->in_len == 0 && c->in_cap > IN_KEEP_BYTES) {
        kvt_free(c->in);
        c->in = NULL;
        c->in_cap = 0;
    }
}

/* ---- rings (engine_ring.c) ------------------------------------------------------ */

/* c broke its ring: counted, refused, and the log says which check it failed. */
static void ring_broken(struct kvt_engine_server *s, struct eclient *c, int rc)
{
    char why[96];

    count(s, KVT_EREF_RING);
    snprintf(why, sizeof(why), "broke its ring's protocol: %s",
             rc == -EPROTO ? kvt__ering_why(c->ring) : strerror(-rc));
    refuse(c, rc, why);
}

/* One binary request from c's ring: executed, its reply header and payload
 * written straight into the reply record (kvt__ering_reply2), or, when they do
 * not fit, behind a REDIRECT as a frame on the socket (1). 0, 1, or -EPROTO (the
 * engine broke its ring); c->closing when the request was refused. */
static int ring_bin(struct kvt_engine_server *s, struct eclient *c, const uint8_t *body, size_t len)
{
    struct kvt_ebin_rep rh;
    const uint8_t *payload;
    size_t plen;
    int rc;

    if (!exec_bin(s, c, body, len, &rh, &payload, &plen) || c->closing) {
        bin_done(s);
        return 0; /* refused: its ERROR frame is on the socket, the ring closed */
    }
    rc = kvt__ering_reply2(c->ring, &rh, sizeof(rh), payload, plen);
    if (rc == 1) {
        uint32_t flen = (uint32_t)(sizeof(rh) + plen);
        uint8_t fhdr[KVT_EPROTO_HDR] = {(uint8_t)(flen >> 24), (uint8_t)(flen >> 16),
                                        (uint8_t)(flen >> 8), (uint8_t)flen};

        if (kvt__ebuf_append(&c->out, fhdr, sizeof(fhdr)) != 0 ||
            kvt__ebuf_append(&c->out, &rh, sizeof(rh)) != 0 ||
            (plen > 0 && kvt__ebuf_append(&c->out, payload, plen) != 0))
            refuse(c, -ENOMEM, "no memory for a reply");
    }
    bin_done(s);
    return rc;
}

/* Serves up to RING_PER_TURN requests from c's ring through exec_frame, as the
 * socket's frames are served. A ring that breaks its protocol is refused like a
 * malformed frame (counted: ring); a reply too large for the ring goes on the
 * socket behind a REDIRECT. While c's socket replies are at max_output_bytes the
 * ring waits too. Returns how many requests it served. */
static int ring_service(struct kvt_engine_server *s, struct eclient *c)
{
    int served = 0;

    while (served < RING_PER_TURN && !c->closing) {
        const uint8_t *body;
        size_t len;
        int rc;

        if (c->out.len - c->out_off >= s->max_output)
            break;
        rc = kvt__ering_take(c->ring, s->lim.max_body, &body, &len);
        if (rc == 0 || rc == -EAGAIN)
            break;
        if (rc < 0) {
            ring_broken(s, c, rc);
            break;
        }
        s->ring_out.len = 0;
        if (len > 0 && body[0] == KVT_EBIN_MAGIC) {
            s->ctr.ring_binary++;
            rc = ring_bin(s, c, body, len);
        } else {
            exec_frame(s, c, body, len, &s->ring_out);
            if (c->closing)
                break; /* refused: its ERROR frame is on the socket, the ring closed */
            rc = kvt__ering_reply(c->ring, s->ring_out.data + KVT_EPROTO_HDR,
                                  s->ring_out.len - KVT_EPROTO_HDR);
            if (rc == 1 && kvt__ebuf_append(&c->out, s->ring_out.data, s->ring_out.len) != 0) {
                refuse(c, -ENOMEM, "no memory for a reply");
                break;
            }
        }
        if (c->closing)
            break;
        if (rc < 0) {
            ring_broken(s, c, rc);
            break;
        }
        if (rc == 1)
            s->ctr.ring_redirects++;
        s->ctr.ring_requests++;
        served++;
    }
    if (c->out.len > 0 && (flush_out(s, c) < 0 || update_watch(s, c) < 0)) {
        /* The socket failed: its epoll event (HUP or ERR) ends the client. */
    }
    return served;
}

/* Tells every ring whether the loop sleeps (engines then write its eventfd). */
static void rings_set_sleeping(struct kvt_engine_server *s, bool sleeping)
{
    if (s->rings_sleeping == sleeping)
        return;
    s->rings_sleeping = sleeping;
    for (struct eclient *c = s->clients; c != NULL; c = c->next) {
        if (c->ring != NULL)
            kvt__ering_set_sleeping(c->ring, sleeping);
    }
}

/* One pass over every ring; returns the requests served. */
static int rings_poll(struct kvt_engine_server *s)
{
    int served = 0;
    struct eclient *next;

    for (struct eclient *c = s->clients; c != NULL; c = next) {
        next = c->next;
        if (c->ring != NULL && !c->closing && kvt__ering_pending(c->ring))
            served += ring_service(s, c);
    }
    return served;
}

/* Whether a ring has a request the loop could serve now. */
static bool rings_pending(struct kvt_engine_server *s)
{
    for (struct eclient *c = s->clients; c != NULL; c = c->next) {
        if (c->ring != NULL && !c->closing && c->out.len - c->out_off < s->max_output &&
            kvt__ering_pending(c->ring))
            return true;
    }
    return false;
}

/* Clock reads of an empty spin this far apart: it lost its core meanwhile. */
#define SPIN_LOST_NS 200000ull
/* Then no spinning for this long. */
#define SPIN_REST_NS 100000000ull

static inline void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

bool kvt_engine_server_spin(struct kvt_engine_server *s, uint64_t max_ns)
{
    uint64_t now = kvt_now_ns(), end = now + max_ns;

    s->ring_polled = true;
    if (s->n_rings == 0)
        return false;
    while (s->ring_spin_ns > 0 && now - s->ring_active_ns < s->ring_spin_ns &&
           now >= s->ring_rest_until) {
        uint64_t before = now;
        bool served = false;

        rings_set_sleeping(s, false);
        /* A pass over the rings is a few loads; the clock costs more on a VM: it is
         * read once per 16 empty passes or per pass that served (one read). */
        for (int i = 0; i < 16 && !served; i++) {
            served = rings_poll(s) > 0;
            if (!served)
                cpu_relax();
        }
        now = kvt_now_ns();
        if (served)
            s->ring_active_ns = now;
        else if (now - before > SPIN_LOST_NS) {
            s->ring_rest_until = now + SPIN_REST_NS; /* the spin lost its core */
            s->ctr.ring_spin_rests++;
            break;
        }
        if (now >= end)
            return true;
    }
    /* Going to sleep: engines must wake the loop from now on. A request published
     * before they could see the flag is found by the look after the fence. */
    rings_set_sleeping(s, true);
    kvt_full_fence();
    if (rings_pending(s)) {
        s->ring_active_ns = kvt_now_ns();
        return true;
    }
    return false;
}

/* recv that keeps the last descriptor the client passed (SCM_RIGHTS) for ATTACH;
 * any earlier one not taken is closed. */
static ssize_t recv_fd(struct eclient *c, uint8_t *p, size_t len)
{
    union {
        struct cmsghdr h;
        char buf[CMSG_SPACE(sizeof(int))];
    } ctl;
    struct iovec iov = {.iov_base = p, .iov_len = len};
    struct msghdr mh = {.msg_iov = &iov,
                        .msg_iovlen = 1,
                        .msg_control = ctl.buf,
                        .msg_controllen = sizeof(ctl.buf)};
    ssize_t n = recvmsg(c->fd, &mh, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);

    for (struct cmsghdr *cm = n > 0 ? CMSG_FIRSTHDR(&mh) : NULL; cm != NULL;
         cm = CMSG_NXTHDR(&mh, cm)) {
        if (cm->cmsg_level != SOL_SOCKET || cm->cmsg_type != SCM_RIGHTS ||
            cm->cmsg_len < CMSG_LEN(sizeof(int)))
            continue;
        if (c->passed_fd >= 0)
            close(c->passed_fd);
        memcpy(&c->passed_fd, CMSG_DATA(cm), sizeof(int));
    }
    return n;
}

/* One recv into the input buffer: 1 bytes came, 0 nothing to read, or -errno. */
static int read_some(struct kvt_engine_server *s, struct eclient *c)
{
    size_t frame_cap = KVT_EPROTO_HDR + s->lim.max_body;

    if (c->in_len == c->in_cap) {
        size_t cap = c->in_cap ? c->in_cap * 2 : 4096;
        uint8_t *p;

        /* A header says how much is coming: room for the whole frame at once. */
        if (c->in_len >= KVT_EPROTO_HDR &&
            KVT_EPROTO_HDR + (size_t)kvt__eproto_frame_len(c->in) > cap)
            cap = KVT_EPROTO_HDR + (size_t)kvt__eproto_frame_len(c->in);

        if (cap > frame_cap)
            cap = frame_cap;
        /* Full at frame_cap would hold a whole frame, and run_frames left none. */
        if (cap <= c->in_cap)
            return -EMSGSIZE;
        p = kvt_realloc(c->in, cap);
        if (p == NULL)
            return -ENOMEM;
        c->in = p;
        c->in_cap = cap;
    }
    for (;;) {
        ssize_t n = recv_fd(c, c->in + c->in_len, c->in_cap - c->in_len);

        if (n > 0) {
            c->in_len += (size_t)n;
            return 1;
        }
        if (n == 0)
            return -ECONNRESET;
        if (errno == EINTR)
            continue;
        return errno == EAGAIN || errno == EWOULDBLOCK ? 0 : -errno;
    }
}

/* A closing client whose replies have all left: our side is shut down (it reads the
 * ERROR frame, then EOF) and what it still sends is read and dropped until its EOF,
 * because closing a unix socket with unread bytes resets the peer's connection before
 * it could read the ERROR frame. 1 when it is gone, 0 while we wait. */
static int linger(struct eclient *c)
{
    uint8_t sink[4096];

    if (!c->shut_wr) {
        shutdown(c->fd, SHUT_WR);
        c->shut_wr = true;
    }
    /* Bounded: a client that keeps sending waits for the next turn (and is closed
     * after CLOSING_GRACE_NS whatever it does). */
    for (int i = 0; i < READS_PER_TURN; i++) {
        ssize_t n = recv(c->fd, sink, sizeof(sink), MSG_DONTWAIT);

        if (n > 0 || (n < 0 && errno == EINTR))
            continue;
        return n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK) ? 0 : 1;
    }
    return 0;
}

/* Moves a client on as far as it can go now: replies out, then the frames waiting,
 * then new bytes in; requests are executed only when the previous replies have left,
 * so what is queued for a client is bounded by max_output_bytes plus one reply. */
static int client_service(struct kvt_engine_server *s, struct eclient *c)
{
    for (int reads = 0;;) {
        int rc = flush_out(s, c);

        if (rc < 0)
            return rc;
        if (c->closing && c->out.len == 0)
            return linger(c) ? -ECONNRESET : update_watch(s, c);
        if (c->closing || c->out.len > 0)
            break;
        run_frames(s, c);
        if (c->closing || c->out.len > 0)
            continue;
        if (reads++ == READS_PER_TURN)
            break;
        rc = read_some(s, c);
        if (rc < 0)
            return rc;
        if (rc == 0)
            break;
    }
    return update_watch(s, c);
}

static void client_event(struct kvt_engine_server *s, struct eclient *c, uint32_t events)
{
    int rc;

    if (!(events & (EPOLLIN | EPOLLOUT)) && (events & (EPOLLERR | EPOLLHUP)))
        rc = -ECONNRESET;
    else
        rc = client_service(s, c);
    if (rc < 0)
        client_destroy(s, c,
                       c->closing          ? "closed by the server"
                       : rc == -ECONNRESET ? "disconnected"
                                           : strerror(-rc));
}

/* Refuses clients past their HELLO deadline, and closes refused clients once their
 * ERROR frame has left and they closed too (or had CLOSING_GRACE_NS to). Runs after
 * the events of a batch, never during. */
static void sweep(struct kvt_engine_server *s)
{
    uint64_t now = kvt_now_ns();
    struct eclient *next;

    for (struct eclient *c = s->clients; c != NULL; c = next) {
        next = c->next;
        if (!c->hello_done && !c->closing && now - c->accepted_ns >= s->hello_timeout_ns) {
            count(s, KVT_EREF_HELLO_TIMEOUT);
            refuse(c, -ETIMEDOUT, "no HELLO in time");
        }
        if (!c->closing)
            continue;
        if (flush_out(s, c) < 0 || (c->out.len == 0 && linger(c)) ||
            now - c->closing_ns >= CLOSING_GRACE_NS)
            client_destroy(s, c, "closed by the server");
        else
            update_watch(s, c);
    }
}

int kvt_engine_server_progress(struct kvt_engine_server *s)
{
    accept_resume(s);
    evq_fill(s);
    for (;;) {
        struct epoll_event evs[MAX_EVENTS];
        int n = epoll_wait(s->epfd, evs, MAX_EVENTS, 0);

        if (n < 0) {
            if (errno == EINTR)
                continue;
            kvt_error(MOD, "epoll_wait: %s", strerror(errno));
            return -errno;
        }
        for (int i = 0; i < n; i++) {
            if (evs[i].data.ptr == NULL)
                accept_one(s);
        }
        for (int i = 0; i < n; i++) {
            uintptr_t tag = (uintptr_t)evs[i].data.ptr & RING_TAG;
            struct eclient *c = (struct eclient *)((uintptr_t)evs[i].data.ptr & ~RING_TAG);
            bool live = false;

            if (c == NULL)
                continue;
            /* An earlier event of this batch may have destroyed it (refused). */
            for (struct eclient *x = s->clients; x != NULL && !live; x = x->next)
                live = x == c;
            if (live && tag) {
                kvt__ering_drain_wake(c->ring); /* served below, with every ring */
                s->ctr.ring_wakeups++;
            } else if (live) {
                client_event(s, c, evs[i].events);
            }
        }
        if (n < MAX_EVENTS)
            break;
    }
    if (s->n_rings > 0 && rings_poll(s) > 0) {
        s->ring_active_ns = kvt_now_ns();
        if (s->ring_polled && s->ring_spin_ns > 0 && s->ring_active_ns >= s->ring_rest_until)
            rings_set_sleeping(s, false); /* the loop spins now (kvt_engine_server_spin) */
    }
    if (s->clients != NULL)
        sweep(s);
    for (struct eclient *c = s->clients; c != NULL; c = c->next) {
        if (c->jobs != NULL)
            kvt__ejobs_progress(c->jobs);
    }
    return 0;
}

/* ---- life cycle --------------------------------------------------------------------- */

/* Stale socket handling: a socket nobody listens on is removed; one a daemon listens
 * on is refused, as is anything that is not a socket. */
static int claim_path(const char *path)
{
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    struct stat st;
    int fd, rc;

    if (lstat(path, &st) != 0)
        return errno == ENOENT ? 0 : -errno;
    if (!S_ISSOCK(st.st_mode))
        return -EEXIST;
    fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return -errno;
    memcpy(sa.sun_path, path, strlen(path) + 1);
    rc = connect(fd, (struct sockaddr *)&sa, sizeof(sa));
    close(fd);
    if (rc == 0)
        return -EADDRINUSE;
    if (errno != ECONNREFUSED)
        return -errno;
    kvt_info(MOD, "removing the stale socket %s", path);
    if (unlink(path) != 0 && errno != ENOENT)
        return -errno;
    return 0;
}

/* A group name or number; -EINVAL when there is no such group. */
static int resolve_group(const char *name, gid_t *gid_p)
{
    struct group gr, *found = NULL;
    char buf[4096], *end;
    unsigned long v;

    errno = 0;
    v = strtoul(name, &end, 10);
    if (name[0] >= '0' && name[0] <= '9' && *end == '\0' && errno == 0 && v < (gid_t)-1) {
        *gid_p = (gid_t)v;
        return 0;
    }
    if (getgrnam_r(name, &gr, buf, sizeof(buf), &found) != 0 || found == NULL)
        return -EINVAL;
    *gid_p = gr.gr_gid;
    return 0;
}

/* Gives the socket file at path its mode and group. */
static int set_owner(const char *path, mode_t mode, bool has_gid, gid_t gid)
{
    if (has_gid && chown(path, (uid_t)-1, gid) != 0) {
        int rc = -errno;

        kvt_error(MOD, "cannot give %s the group %u: %s", path, (unsigned)gid, strerror(-rc));
        return rc;
    }
    if (chmod(path, mode) != 0) {
        int rc = -errno;

        kvt_error(MOD, "chmod %04o %s: %s", (unsigned)mode, path, strerror(-rc));
        return rc;
    }
    return 0;
}

/* Binds and listens on s->path with the socket's mode and group set before the path
 * appears: the socket is bound in a fresh 0700 directory beside the path (nobody else
 * can reach it there), given its mode and group, then renamed into place. When that
 * directory's name would not fit in sun_path, the bind runs under umask 0177 instead
 * (the socket is the owner's only until chmod; other threads creating files meanwhile
 * get stricter modes, never looser). */
static int bind_listen(struct kvt_engine_server *s, mode_t mode, bool has_gid, gid_t gid)
{
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    char dir[sizeof(sa.sun_path)];
    const char *slash = strrchr(s->path, '/');
    int dir_len = slash == NULL ? 1 : slash == s->path ? 1 : (int)(slash - s->path);
    const char *dir_of = slash == NULL ? "." : s->path;
    int n, rc;

    n = snprintf(dir, sizeof(dir), "%.*s/.kvtier-XXXXXX", dir_len, dir_of);
    if (n > 0 && (size_t)n + 3 <= sizeof(sa.sun_path)) {
        if (mkdtemp(dir) == NULL) {
            rc = -errno;
            kvt_error(MOD, "cannot create a private directory beside %s: %s", s->path,
                      strerror(-rc));
            return rc;
        }
        memcpy(sa.sun_path, dir, (size_t)n);
        memcpy(sa.sun_path + n, "/s", 3); /* fits: checked above */
        if (bind(s->listen_fd, (struct sockaddr *)&sa, sizeof(sa)) != 0) {
            rc = -errno;
            kvt_error(MOD, "bind %s: %s", sa.sun_path, strerror(-rc));
            rmdir(dir);
            return rc;
        }
        rc = set_owner(sa.sun_path, mode, has_gid, gid);
        if (rc == 0 && listen(s->listen_fd, 64) != 0)
            rc = -errno;
        if (rc == 0 && rename(sa.sun_path, s->path) != 0) {
            rc = -errno;
            kvt_error(MOD, "rename %s to %s: %s", sa.sun_path, s->path, strerror(-rc));
        }
        if (rc != 0)
            unlink(sa.sun_path);
        rmdir(dir);
        return rc;
    }
    memcpy(sa.sun_path, s->path, strlen(s->path) + 1);
    mode_t old = umask(0177);
    rc = bind(s->listen_fd, (struct sockaddr *)&sa, sizeof(sa)) == 0 ? 0 : -errno;
    umask(old);
    if (rc != 0) {
        kvt_error(MOD, "bind %s: %s", s->path, strerror(-rc));
        return rc;
    }
    rc = set_owner(s->path, mode, has_gid, gid);
    if (rc == 0 && listen(s->listen_fd, 64) != 0)
        rc = -errno;
    if (rc != 0)
        unlink(s->path);
    return rc;
}

int kvt_engine_server_create(const struct kvt_engine_server_config *cfg,
                             struct kvt_engine_server **srv_p)
{
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    struct kvt_engine_server *s;
    struct kvt_region *region;
    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = NULL};
    mode_t mode;
    gid_t gid = 0;
    int rc;

    if (cfg == NULL || cfg->socket_path == NULL || cfg->manager == NULL ||
        strlen(cfg->socket_path) == 0 || strlen(cfg->socket_path) >= sizeof(sa.sun_path) ||
        cfg->socket_mode > 0777 ||
        (cfg->fingerprint != NULL &&
         (cfg->fingerprint[0] == '\0' || strlen(cfg->fingerprint) > KVTIER_FINGERPRINT_MAX)))
        return -EINVAL;
    mode = cfg->socket_mode ? (mode_t)cfg->socket_mode : 0660;
    if (cfg->socket_group != NULL && resolve_group(cfg->socket_group, &gid) != 0) {
        kvt_error(MOD, "engine socket group %s: no such group", KVT_LOG_STR(cfg->socket_group));
        return -EINVAL;
    }
    region =
        cfg->region != NULL ? cfg->region : kvt_primary_region(kvt_manager_primary(cfg->manager));
    if (region == NULL || region->fd < 0 || !region->open || region->num_chunks == 0) {
        kvt_error(MOD, "engine API needs the primary's shared region (its fd)");
        return -EINVAL;
    }
    s = kvt_calloc(1, sizeof(*s));
    if (s == NULL)
        return -ENOMEM;
    s->listen_fd = s->epfd = -1;
    s->m = cfg->manager;
    s->collect_stats = cfg->collect_stats;
    s->total_stats = cfg->total_stats;
    s->fingerprint_set = cfg->fingerprint_set;
    s->peers = cfg->peers;
    s->collect_arg = cfg->collect_arg;
    if (cfg->fingerprint != NULL)
        snprintf(s->fingerprint, sizeof(s->fingerprint), "%s", cfg->fingerprint);
    s->region_fd = region->fd;
    snprintf(s->path, sizeof(s->path), "%s", cfg->socket_path);
    kvt__eproto_limits_default(&s->lim);
    if (cfg->max_msg_bytes)
        s->lim.max_body = cfg->max_msg_bytes;
    if (cfg->max_keys)
        s->lim.max_keys = cfg->max_keys;
    /* Params are bounded per request by op_new_request (a refusal, not a cut
     * connection); the decoder only keeps them within the frame. */
    s->lim.max_params = s->lim.max_body;
    s->lim.max_events = 0; /* requests carry none */
    s->lim.max_stats = 0;
    s->lim.max_peers = 0;
    s->max_clients = cfg->max_clients ? cfg->max_clients : 64;
    s->max_requests = cfg->max_requests ? cfg->max_requests : 4096;
    s->max_params = cfg->max_params_bytes ? cfg->max_params_bytes : 64u << 10;
    s->max_client_params = cfg->max_client_params_bytes ? cfg->max_client_params_bytes : 4ull << 20;
    s->max_output = cfg->max_output_bytes ? cfg->max_output_bytes : 1ull << 20;
    s->hello_timeout_ns = (cfg->hello_timeout_ms ? cfg->hello_timeout_ms : 5000) * 1000000ull;
    s->max_event_keys = cfg->max_event_keys ? cfg->max_event_keys : 65536;
    s->waiting_keys_per_pass = cfg->waiting_keys_per_pass ? cfg->waiting_keys_per_pass : 4096;
    s->ring_bytes = cfg->ring_bytes < 0 ? 0
                    : cfg->ring_bytes   ? (size_t)cfg->ring_bytes
                                        : 256u << 10;
    s->ring_spin_ns = (uint64_t)cfg->ring_spin_us * 1000;
    s->rings_sleeping = true;
    kvt__ebuf_init(&s->ring_out);
    kvt__emsg_init(&s->bin_q);
    kvt__emsg_init(&s->bin_r);
    s->geom[KVT_EG_NUM_CHUNKS] = region->num_chunks;
    s->geom[KVT_EG_ROW_BYTES] = region->row_bytes;
    s->geom[KVT_EG_PAGE_BYTES] = region->page_bytes;
    s->geom[KVT_EG_NUM_WORKERS] = region->num_workers;
    s->geom[KVT_EG_SIZE] = region->size;
    s->geom[KVT_EG_MAX_KEYS] = s->lim.max_keys;
    kvt_store_output_init(&s->store_out);
    kvt_events_init(&s->evq);
    kvt_events_init(&s->evs);
    kvt_map_init(&s->named);
    s->bin_keys = kvt_calloc(s->lim.max_keys ? s->lim.max_keys : 1, sizeof(*s->bin_keys));
    s->lookup_res = kvt_calloc(s->lim.max_keys ? s->lim.max_keys : 1, sizeof(*s->lookup_res));
    s->lookup_out = kvt_calloc(s->lim.max_keys ? s->lim.max_keys : 1, 1);
    if (s->bin_keys == NULL || s->lookup_res == NULL || s->lookup_out == NULL) {
        rc = -ENOMEM;
        goto err_free;
    }
    rc = kvt_req_ctx_create(ANON_REQ_ID, NULL, &s->anon_ctx);
    if (rc < 0)
        goto err_free;

    rc = claim_path(s->path);
    if (rc < 0) {
        kvt_error(MOD, "cannot listen on %s: %s", s->path,
                  rc == -EADDRINUSE ? "another daemon listens there" : strerror(-rc));
        goto err_free;
    }
    s->listen_fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (s->listen_fd < 0) {
        rc = -errno;
        goto err_free;
    }
    rc = bind_listen(s, mode, cfg->socket_group != NULL, gid);
    if (rc != 0)
        goto err_close;
    s->epfd = epoll_create1(EPOLL_CLOEXEC);
    if (s->epfd < 0) {
        rc = -errno;
        goto err_unlink;
    }
    if (epoll_ctl(s->epfd, EPOLL_CTL_ADD, s->listen_fd, &ev) != 0) {
        rc = -errno;
        goto err_epoll;
    }
    kvt_info(MOD, "engine API on %s (mode %04o; %zu chunks of %zu bytes)", s->path, (unsigned)mode,
             region->num_chunks, region->row_bytes);
    *srv_p = s;
    return 0;

err_epoll:
    close(s->epfd);
err_unlink:
    unlink(s->path);
err_close:
    close(s->listen_fd);
err_free:
    if (s->anon_ctx != NULL)
        kvt_req_ctx_unref(s->anon_ctx);
    kvt_store_output_cleanup(&s->store_out);
    kvt_free(s->bin_keys);
    kvt_free(s->lookup_res);
    kvt_free(s->lookup_out);
    kvt_free(s);
    return rc;
}

void kvt_engine_server_destroy(struct kvt_engine_server *s)
{
    if (s == NULL)
        return;
    while (s->clients != NULL)
        client_destroy(s, s->clients, "server shutting down");
    close(s->epfd);
    close(s->listen_fd);
    unlink(s->path);
    kvt_req_ctx_unref(s->anon_ctx);
    kvt_store_output_cleanup(&s->store_out);
    kvt_events_cleanup(&s->evq);
    kvt_events_cleanup(&s->evs);
    kvt_map_cleanup(&s->named);
    kvt__ebuf_cleanup(&s->ring_out);
    kvt_free(s->bin_keys);
    kvt_free(s->lookup_res);
    kvt_free(s->lookup_out);
    kvt_free(s);
}

int kvt_engine_server_fd(const struct kvt_engine_server *s)
{
    return s->epfd;
}

int kvt_engine_server_fanout_stats(struct kvt_engine_server *srv, const struct kvt_stats *delta)
{
    int rc = 0;

    for (struct eclient *c = srv->clients; c != NULL; c = c->next) {
        if (c->hello_done && kvt_stats_aggregate(&c->stats, delta) != 0)
            rc = -ENOMEM; /* that client's next stats miss this delta */
    }
    return rc;
}

void kvt_engine_server_get_counters(const struct kvt_engine_server *s,
                                    struct kvt_engine_server_counters *out)
{
    *out = s->ctr;
    out->event_keys = s->evq_keys;
    out->refused_by[KVT_EREF_CLIENTS] = s->ctr.refused;
    out->refused_by[KVT_EREF_MALFORMED] = s->ctr.malformed;
    out->refused_by[KVT_EREF_OVERSIZED] = s->ctr.oversized;
}

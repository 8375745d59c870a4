/* The local engine API server (contract in kvt/engine_api.h, wire format in
 * kvtier/engine_proto.h).
 *
 * Layout: one epoll fd over the listen socket (data.ptr NULL) and every client
 * (data.ptr its struct eclient), level-triggered. progress() takes what is ready:
 * accepts, reads into the client's bounded input buffer (header + max_msg_bytes),
 * executes every complete frame in order, queues replies in the client's output
 * buffer and writes what the socket takes. While a client has output queued the
 * server reads no more from it (EPOLLOUT instead of EPOLLIN): a client that does
 * not read its replies stalls only itself.
 *
 * Client state machine: NEW (only HELLO accepted) -> READY -> gone. HELLO's reply
 * carries the region fd; it is the first frame queued, so the fd rides on the
 * first byte written. Going away (EOF, error, protocol violation) runs the
 * cleanup: stores prepared and not completed are completed as failed (each
 * outstanding manager-level prepare_store once, so the manager's per-request
 * count drops to 0 and the write-pending slots are freed), pins are unpinned one
 * by one, unfinished requests are finished, and the client's references dropped.
 *
 * What a client holds is mirrored here exactly as the manager accepted it (only
 * calls that returned 0 change the mirror), so the cleanup never asks the manager
 * for something it would refuse. */
#include <assert.h>
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "kvt/alloc.h"
#include "kvt/engine_api.h"
#include "kvt/log.h"
#include "kvt/manager.h"
#include "kvt/map.h"
#include "kvt/primary.h"
#include "kvt/region.h"
#include "kvtier/engine_proto.h"
#include "engine_jobs_int.h"

#define MOD        "engine_api"
#define MAX_EVENTS 64
#define READ_CHUNK (64u << 10)

_Static_assert(sizeof(struct kvtier_key) == sizeof(struct kvt_key), "key layouts differ");
_Static_assert(offsetof(struct kvtier_key, bytes) == offsetof(struct kvt_key, bytes),
               "key layouts differ");
_Static_assert(sizeof(struct kvtier_tier_matcher) == sizeof(struct kvt_tier_matcher),
               "matcher layouts differ");
_Static_assert(KVTIER_HIST_BUCKETS == KVT_HIST_BUCKETS, "histogram buckets differ");
_Static_assert(KVTIER_STAT_NAME_MAX == KVT_STAT_NAME_MAX, "stat names differ");
_Static_assert(KVTIER_STAT_LABEL_MAX == KVT_STAT_LABEL_MAX, "stat labels differ");

/* One request of a client: its context reference, whether the client finished it,
 * how many manager-level prepared stores are outstanding, and the keys it prepared
 * and has not completed yet. */
struct ereq {
    struct kvt_req_ctx *ctx;
    bool finished;
    int pending_stores;
    struct kvt_key *writing;
    size_t n_writing, cap_writing;
};

/* Loop thread only. */
struct eclient {
    int fd;
    uint64_t id;
    pid_t pid;
    char name[KVTIER_NAME_MAX + 1];
    bool hello_done;
    bool closing;    /* flush what is queued, then go */
    bool fd_to_send; /* the next byte written carries the region fd */
    bool want_out;   /* epoll watches EPOLLOUT (else EPOLLIN) */
    uint8_t *in;
    size_t in_len, in_cap;
    struct kvt_ebuf out;
    size_t out_off;
    struct kvt_map reqs;    /* req_id -> struct ereq */
    struct kvt_map pins;    /* key bytes -> (uintptr_t) pin count */
    struct kvt_stats stats; /* fan-out mode: deltas since this client's last get_stats */
    int passed_fd;          /* the last fd the client passed (ATTACH takes it), or -1 */
    struct kvt_ejobs *jobs; /* its attached region and jobs, or NULL */
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
    uint64_t next_id;
    struct eclient *clients;
    struct kvt_engine_server_counters ctr;
    void (*collect_stats)(void *arg);
    int (*total_stats)(void *arg, struct kvt_stats *out);
    void *collect_arg;
    struct kvt_req_ctx *anon_ctx;      /* touch/loads that name no request */
    struct kvt_store_output store_out; /* prepare_store's, reused */
    struct kvt_events evs;             /* take_events', until its reply is encoded */
};

/* ---- the client's mirror ------------------------------------------------------ */

static void ereq_free(struct ereq *r)
{
    kvt_req_ctx_unref(r->ctx);
    kvt_free(r->writing);
    kvt_free(r);
}

static int writing_add(struct ereq *r, const struct kvt_key *keys, size_t n)
{
    if (n == 0)
        return 0; /* a plan with nothing to write: memcpy(NULL, ..., 0) is UB */
    if (r->n_writing + n > r->cap_writing) {
        size_t cap = r->cap_writing ? r->cap_writing : 8;
        struct kvt_key *p;

        while (cap < r->n_writing + n)
            cap *= 2;
        p = kvt_reallocarray(r->writing, cap, sizeof(*p));
        if (p == NULL)
            return -ENOMEM;
        r->writing = p;
        r->cap_writing = cap;
    }
    memcpy(r->writing + r->n_writing, keys, n * sizeof(*keys));
    r->n_writing += n;
    return 0;
}

static void writing_remove(struct ereq *r, const struct kvt_key *key)
{
    for (size_t i = 0; i < r->n_writing; i++) {
        if (kvt_key_eq(&r->writing[i], key)) {
            r->writing[i] = r->writing[--r->n_writing];
            return;
        }
    }
}

/* Drops the mirror of a request the client finished and holds nothing of. */
static void ereq_maybe_drop(struct eclient *c, struct ereq *r)
{
    if (!r->finished || r->pending_stores > 0 || r->n_writing > 0)
        return;
    kvt_map_remove(&c->reqs, r->ctx->req_id, r->ctx->req_id_len);
    ereq_free(r);
}

static uintptr_t pin_count(const struct eclient *c, const struct kvt_key *k)
{
    return (uintptr_t)kvt_map_get(&c->pins, k->bytes, k->len);
}

static int pin_set(struct eclient *c, const struct kvt_key *k, uintptr_t n)
{
    if (n == 0) {
        kvt_map_remove(&c->pins, k->bytes, k->len);
        return 0;
    }
    return kvt_map_put(&c->pins, k->bytes, k->len, (void *)n);
}

/* The cleanup of a client that went away (see the top of the file). */
static void client_release(struct kvt_engine_server *s, struct eclient *c)
{
    struct kvt_primary *primary = kvt_manager_primary(s->m);
    struct kvt_map_entry *e;
    size_t it = 0;

    while (kvt_map_next(&c->reqs, &it, &e)) {
        struct ereq *r = e->value;

        if (r->pending_stores > 0) {
            kvt_manager_complete_store(s->m, r->writing, r->n_writing, r->ctx, false);
            for (int i = 1; i < r->pending_stores; i++)
                kvt_manager_complete_store(s->m, NULL, 0, r->ctx, false);
            s->ctr.aborted_stores += (uint64_t)r->pending_stores;
        } else if (r->n_writing > 0) {
            /* Keys left out of every complete_store: free their slots directly. */
            kvt_primary_complete_store(primary, r->writing, r->n_writing, false);
            s->ctr.aborted_stores++;
        }
        if (!r->finished) {
            kvt_manager_on_request_finished(s->m, r->ctx);
            s->ctr.finished_reqs++;
        }
        ereq_free(r);
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
    kvt__ejobs_destroy(c->jobs);
    if (c->passed_fd >= 0)
        close(c->passed_fd);
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

/* Writes what the socket takes. 0, or -errno when the client is to be dropped. */
static int flush_out(struct kvt_engine_server *s, struct eclient *c)
{
    while (c->out_off < c->out.len) {
        union {
            struct cmsghdr h;
            char buf[CMSG_SPACE(sizeof(int))];
        } ctl;
        struct iovec iov = {.iov_base = c->out.data + c->out_off,
                            .iov_len = c->out.len - c->out_off};
        struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1};
        ssize_t w;

        if (c->fd_to_send) {
            memset(&ctl, 0, sizeof(ctl));
            mh.msg_control = ctl.buf;
            mh.msg_controllen = sizeof(ctl.buf);
            struct cmsghdr *cm = CMSG_FIRSTHDR(&mh);
            cm->cmsg_level = SOL_SOCKET;
            cm->cmsg_type = SCM_RIGHTS;
            cm->cmsg_len = CMSG_LEN(sizeof(int));
            memcpy(CMSG_DATA(cm), &s->region_fd, sizeof(int));
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
    bool pending = c->out.len > 0;

    if (pending != c->want_out)
        return watch(s, c, pending);
    return 0;
}

static int queue(struct eclient *c, const struct kvt_emsg *m)
{
    return kvt__emsg_encode(m, &c->out);
}

/* Queues an ERROR frame (best effort) and marks the client for closing. */
static void refuse(struct eclient *c, int err, const char *why)
{
    struct kvt_emsg m;

    kvt__emsg_init(&m);
    m.op = KVT_EOP_ERROR | KVT_EOP_REPLY;
    m.rc = err;
    m.has = 1u << KVT_EF_OP | 1u << KVT_EF_RC;
    queue(c, &m);
    c->closing = true;
    kvt_warn(MOD, "client %llu (%s, pid %d): %s (%s); closing", (unsigned long long)c->id,
             c->name[0] ? c->name : "-", (int)c->pid, why, strerror(-err));
}

static void accept_one(struct kvt_engine_server *s)
{
    struct eclient *c;
    struct epoll_event ev;
    struct ucred cred;
    socklen_t cl = sizeof(cred);
    int fd = accept4(s->listen_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);

    if (fd < 0) {
        if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
            kvt_warn(MOD, "accept on %s: %s", s->path, strerror(errno));
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
    s->ctr.clients++;
    s->ctr.accepted++;
    if (s->ctr.clients > s->max_clients) {
        s->ctr.refused++;
        refuse(c, -EUSERS, "too many clients");
    }
}

/* ---- requests ------------------------------------------------------------------- */

static struct ereq *own_req(struct eclient *c, const struct kvt_emsg *q)
{
    if (!kvt__emsg_has(q, KVT_EF_REQ_ID))
        return NULL;
    return kvt_map_get(&c->reqs, q->req_id, strlen(q->req_id));
}

static const struct kvt_key *keys_of(const struct kvt_emsg *q)
{
    return (const struct kvt_key *)q->keys;
}

static int op_hello(struct kvt_engine_server *s, struct eclient *c, const struct kvt_emsg *q,
                    struct kvt_emsg *r)
{
    if (!kvt__emsg_has(q, KVT_EF_MAJOR) || q->major != KVTIER_PROTO_MAJOR)
        return -EPROTO;
    snprintf(c->name, sizeof(c->name), "%s", q->name[0] ? q->name : "engine");
    c->hello_done = true;
    memcpy(r->geom, s->geom, sizeof(s->geom));
    r->geom[KVT_EG_CLIENT_ID] = c->id;
    r->n_geom = KVT_EG_COUNT;
    r->major = KVTIER_PROTO_MAJOR;
    r->minor = KVTIER_PROTO_MINOR;
    r->has |= 1u << KVT_EF_GEOM | 1u << KVT_EF_MAJOR | 1u << KVT_EF_MINOR;
    c->fd_to_send = true;
    kvt_info(MOD, "client %llu (%s, pid %d) attached", (unsigned long long)c->id, c->name,
             (int)c->pid);
    return 0;
}

static int op_new_request(struct kvt_engine_server *s, struct eclient *c, const struct kvt_emsg *q,
                          struct kvt_emsg *r)
{
    enum kvt_offload_policy policy = KVT_CHUNK_LEVEL;
    struct kvt_req_ctx *ctx;
    struct ereq *er;
    int rc;

    if (!kvt__emsg_has(q, KVT_EF_REQ_ID))
        return -EINVAL;
    if (own_req(c, q) != NULL)
        return -EEXIST; /* (the mirror's entry must not be replaced) */
    if (kvt_map_size(&c->reqs) >= s->max_requests)
        return -ENOBUFS;
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
    if (kvt_map_put(&c->reqs, ctx->req_id, ctx->req_id_len, er) != 0) {
        ereq_free(er);
        return -ENOMEM;
    }
    rc = kvt_manager_on_new_request(s->m, ctx, &policy);
    if (rc < 0) {
        kvt_map_remove(&c->reqs, ctx->req_id, ctx->req_id_len);
        ereq_free(er);
        return rc;
    }
    r->flags = policy == KVT_REQUEST_LEVEL;
    r->has |= 1u << KVT_EF_FLAGS;
    return 0;
}

static int op_lookup(struct kvt_engine_server *s, struct eclient *c, const struct kvt_emsg *q,
                     struct kvt_emsg *r)
{
    struct ereq *er = own_req(c, q);
    enum kvt_lookup_result *res;
    size_t n;

    if (er == NULL || er->finished || !kvt__emsg_has(q, KVT_EF_KEYS) ||
        (q->flags & ~(uint64_t)KVTIER_LOOKUP_PREFIX) != 0)
        return -EINVAL;
    r->results = kvt_malloc(q->n_keys ? q->n_keys : 1);
    res = kvt_calloc(q->n_keys ? q->n_keys : 1, sizeof(*res));
    if (r->results == NULL || res == NULL) {
        kvt_free(res);
        return -ENOMEM; /* r->results is freed with r */
    }
    n = kvt_manager_lookup_many(s->m, keys_of(q), q->n_keys, er->ctx,
                                (q->flags & KVTIER_LOOKUP_PREFIX) != 0, res);
    for (size_t i = 0; i < n; i++)
        r->results[i] = (uint8_t)res[i];
    kvt_free(res);
    r->n_results = (uint32_t)n;
    r->has |= 1u << KVT_EF_RESULTS;
    return 0;
}

static int op_prepare_store(struct kvt_engine_server *s, struct eclient *c,
                            const struct kvt_emsg *q, struct kvt_emsg *r)
{
    struct kvt_store_output *out = &s->store_out;
    struct ereq *er = own_req(c, q);
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
    for (size_t j = 0; j < out->n_store; j++) {
        uint32_t i = 0;

        while (i < q->n_keys && !kvt_key_eq(&keys_of(q)[i], &out->keys_to_store[j]))
            i++;
        assert(i < q->n_keys && "prepare_store planned a key it was not given");
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

static int op_complete_store(struct kvt_engine_server *s, struct eclient *c,
                             const struct kvt_emsg *q, struct kvt_emsg *r)
{
    struct ereq *er = own_req(c, q);
    int rc;

    if (er == NULL || er->pending_stores <= 0 || !kvt__emsg_has(q, KVT_EF_KEYS))
        return -EINVAL;
    rc = kvt_manager_complete_store(s->m, keys_of(q), q->n_keys, er->ctx, q->flags != 0);
    if (rc < 0)
        return rc;
    er->pending_stores--;
    for (uint32_t i = 0; i < q->n_keys; i++)
        writing_remove(er, &keys_of(q)[i]);
    ereq_maybe_drop(c, er);
    return 0;
}

static struct kvt_req_ctx *ctx_for(struct kvt_engine_server *s, struct eclient *c,
                                   const struct kvt_emsg *q, int *rc_p)
{
    struct ereq *er = own_req(c, q);

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
    uint32_t i;

    if (rc < 0 || !kvt__emsg_has(q, KVT_EF_KEYS))
        return -EINVAL;
    r->ids = kvt_calloc(q->n_keys ? q->n_keys : 1, sizeof(*r->ids));
    if (r->ids == NULL)
        return -ENOMEM;
    rc = kvt_manager_prepare_load(s->m, keys_of(q), q->n_keys, ctx, r->ids);
    if (rc < 0)
        return rc;
    for (i = 0; i < q->n_keys; i++) {
        const struct kvt_key *k = &keys_of(q)[i];

        if (pin_set(c, k, pin_count(c, k) + 1) != 0)
            break;
    }
    if (i < q->n_keys) {
        /* Out of memory for the mirror: unpin what is not mirrored. */
        for (uint32_t j = 0; j < i; j++) {
            const struct kvt_key *k = &keys_of(q)[j];
            pin_set(c, k, pin_count(c, k) - 1);
        }
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
    /* Every key must be pinned by this client as many times as it is named. */
    for (uint32_t i = 0; i < q->n_keys; i++) {
        const struct kvt_key *k = &keys_of(q)[i];
        uintptr_t named = 0;

        for (uint32_t j = 0; j < q->n_keys; j++)
            named += kvt_key_eq(k, &keys_of(q)[j]);
        if (pin_count(c, k) < named)
            return -EINVAL;
    }
    rc = kvt_manager_complete_load(s->m, keys_of(q), q->n_keys, ctx);
    if (rc < 0)
        return rc;
    for (uint32_t i = 0; i < q->n_keys; i++) {
        const struct kvt_key *k = &keys_of(q)[i];

        pin_set(c, k, pin_count(c, k) - 1); /* removal never allocates */
    }
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
    struct ereq *er = own_req(c, q);
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
    int rc = kvt_manager_take_events(s->m, evs);

    if (rc == 0 && evs->n > 0) {
        r->events = kvt_calloc(evs->n, sizeof(*r->events));
        if (r->events == NULL)
            rc = -ENOMEM;
    }
    if (rc < 0)
        return rc;
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
        if (r->stats == NULL)
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
        }
        r->n_stats = (uint32_t)st.n;
        memcpy(r->bounds, kvt_hist_bounds, sizeof(r->bounds));
        r->n_bounds = KVTIER_HIST_BUCKETS;
        r->has |= 1u << KVT_EF_STATS | 1u << KVT_EF_BOUNDS;
    }
    kvt_stats_cleanup(&st);
    return rc;
}

static int op_attach(struct kvt_engine_server *s, struct eclient *c, const struct kvt_emsg *q,
                     struct kvt_emsg *r)
{
    int fd = c->passed_fd;

    c->passed_fd = -1;
    return kvt__ejobs_attach(&c->jobs, s->m, c->id, fd, q, r, &s->ctr);
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
};

/* Executes one frame body and queues its reply. */
static void handle_frame(struct kvt_engine_server *s, struct eclient *c, const uint8_t *body,
                         size_t len)
{
    struct kvt_emsg q, r;
    int rc = kvt__emsg_decode(body, len, &s->lim, &q);

    if (rc < 0) {
        if (rc == -EMSGSIZE)
            s->ctr.oversized++;
        else if (rc != -ENOMEM)
            s->ctr.malformed++;
        refuse(c, rc, rc == -ENOMEM ? "no memory to decode a request" : "bad request");
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
    rc = ops[q.op](s, c, &q, &r);
    if (q.op == KVT_EOP_HELLO && rc < 0) {
        s->ctr.malformed++;
        refuse(c, rc, "incompatible hello");
        kvt__emsg_free(&q);
        return;
    }
    if (rc < 0)
        r.has = 0; /* a failed call returns nothing but its rc */
    r.op = q.op | KVT_EOP_REPLY;
    r.seq = q.seq;
    r.rc = rc;
    r.has |= 1u << KVT_EF_OP | 1u << KVT_EF_SEQ | 1u << KVT_EF_RC;
    if (queue(c, &r) != 0)
        refuse(c, -ENOMEM, "no memory for a reply");
    /* Borrowed from the server's scratch, not the reply's to free. */
    r.evicted = NULL;
    for (uint32_t i = 0; i < r.n_events; i++)
        r.events[i].keys = NULL;
    kvt_events_cleanup(&s->evs);
    kvt_events_init(&s->evs);
    kvt__emsg_free(&r);
    kvt__emsg_free(&q);
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

/* Reads what is there and runs every complete frame. */
static int client_read(struct kvt_engine_server *s, struct eclient *c)
{
    size_t frame_cap = KVT_EPROTO_HDR + s->lim.max_body;

    for (;;) {
        ssize_t n;

        if (c->in_len == c->in_cap) {
            size_t cap = c->in_cap ? c->in_cap * 2 : 4096;
            uint8_t *p;

            if (cap > frame_cap)
                cap = frame_cap;
            if (cap <= c->in_cap)
                return -EMSGSIZE; /* cannot happen: frames are checked below */
            p = kvt_realloc(c->in, cap);
            if (p == NULL)
                return -ENOMEM;
            c->in = p;
            c->in_cap = cap;
        }
        n = recv_fd(c, c->in + c->in_len, c->in_cap - c->in_len);
        if (n == 0)
            return -ECONNRESET;
        if (n < 0) {
            if (errno == EINTR)
                continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK)
                return 0;
            return -errno;
        }
        c->in_len += (size_t)n;

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
            handle_frame(s, c, c->in + off + KVT_EPROTO_HDR, len);
            off += KVT_EPROTO_HDR + len;
        }
        if (off > 0) {
            memmove(c->in, c->in + off, c->in_len - off);
            c->in_len -= off;
        }
        if (c->closing || c->out.len > 0)
            return 0; /* replies first (EPOLLOUT), then read on */
    }
}

static void client_event(struct kvt_engine_server *s, struct eclient *c, uint32_t events)
{
    int rc = 0;

    if (events & EPOLLIN)
        rc = client_read(s, c);
    else if (events & (EPOLLERR | EPOLLHUP))
        rc = -ECONNRESET;
    if (rc == 0)
        rc = flush_out(s, c);
    if (rc < 0) {
        client_destroy(s, c, rc == -ECONNRESET ? "disconnected" : strerror(-rc));
        return;
    }
    if (c->closing && c->out.len == 0)
        client_destroy(s, c, "closed by the server");
}

int kvt_engine_server_progress(struct kvt_engine_server *s)
{
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
            struct eclient *c = evs[i].data.ptr;
            bool live = false;

            if (c == NULL)
                continue;
            /* An earlier event of this batch may have destroyed it (refused). */
            for (struct eclient *x = s->clients; x != NULL && !live; x = x->next)
                live = x == c;
            if (live)
                client_event(s, c, evs[i].events);
        }
        if (n < MAX_EVENTS)
            break;
    }
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

int kvt_engine_server_create(const struct kvt_engine_server_config *cfg,
                             struct kvt_engine_server **srv_p)
{
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    struct kvt_engine_server *s;
    struct kvt_region *region;
    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = NULL};
    int rc;

    if (cfg == NULL || cfg->socket_path == NULL || cfg->manager == NULL ||
        strlen(cfg->socket_path) == 0 || strlen(cfg->socket_path) >= sizeof(sa.sun_path))
        return -EINVAL;
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
    s->collect_arg = cfg->collect_arg;
    s->region_fd = region->fd;
    snprintf(s->path, sizeof(s->path), "%s", cfg->socket_path);
    kvt__eproto_limits_default(&s->lim);
    if (cfg->max_msg_bytes)
        s->lim.max_body = cfg->max_msg_bytes;
    if (cfg->max_keys)
        s->lim.max_keys = cfg->max_keys;
    if (cfg->max_params_bytes)
        s->lim.max_params = cfg->max_params_bytes;
    s->lim.max_events = 0; /* requests carry none */
    s->lim.max_stats = 0;
    s->max_clients = cfg->max_clients ? cfg->max_clients : 64;
    s->max_requests = cfg->max_requests ? cfg->max_requests : 65536;
    s->geom[KVT_EG_NUM_CHUNKS] = region->num_chunks;
    s->geom[KVT_EG_ROW_BYTES] = region->row_bytes;
    s->geom[KVT_EG_PAGE_BYTES] = region->page_bytes;
    s->geom[KVT_EG_NUM_WORKERS] = region->num_workers;
    s->geom[KVT_EG_SIZE] = region->size;
    s->geom[KVT_EG_MAX_KEYS] = s->lim.max_keys;
    kvt_store_output_init(&s->store_out);
    kvt_events_init(&s->evs);
    rc = kvt_req_ctx_create("kvtierd-engine-api", NULL, &s->anon_ctx);
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
    memcpy(sa.sun_path, s->path, strlen(s->path) + 1);
    if (bind(s->listen_fd, (struct sockaddr *)&sa, sizeof(sa)) != 0) {
        rc = -errno;
        kvt_error(MOD, "bind %s: %s", s->path, strerror(-rc));
        goto err_close;
    }
    if (listen(s->listen_fd, 64) != 0) {
        rc = -errno;
        goto err_unlink;
    }
    s->epfd = epoll_create1(EPOLL_CLOEXEC);
    if (s->epfd < 0) {
        rc = -errno;
        goto err_unlink;
    }
    if (epoll_ctl(s->epfd, EPOLL_CTL_ADD, s->listen_fd, &ev) != 0) {
        rc = -errno;
        goto err_epoll;
    }
    kvt_info(MOD, "engine API on %s (%zu chunks of %zu bytes)", s->path, region->num_chunks,
             region->row_bytes);
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
    kvt_events_cleanup(&s->evs);
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
}

/* SPDX-License-Identifier: Apache-2.0 */
/* libkvtier-client: the engine side of kvtierd's local engine API (contract in
 * kvtier/client.h, wire format in kvtier/engine_proto.h).
 *
 * One blocking unix stream connection per client. Each call encodes one request
 * frame, writes it whole, then reads frames until its reply (same op and seq)
 * arrives, each read bounded by the client's timeout (poll). The region's fd comes
 * as SCM_RIGHTS with the HELLO reply; it is mapped MAP_SHARED and closed (the
 * mapping stays). A timeout, a short read or a reply that does not decode breaks
 * the connection: the socket is shut down and every later call returns the same
 * error, since the stream can no longer be trusted to be in step. An ERROR frame
 * breaks it too; its message is kept (kvtier_client_error, and kvtier_connect_ex's
 * error buffer when it comes in answer to HELLO).
 *
 * The minor-1 calls (reset, has_pending_work, peers) are sent only to a node whose
 * HELLO reply said minor >= 1: a minor-0 node would close the connection on an
 * unknown op, so they return -EOPNOTSUPP there without asking.
 *
 * A mutex serializes calls; the buffers it guards are reused across calls.
 *
 * The ring (ring.c, kvtier/engine_ring.h): HELLO asks the node for one (unless
 * $KVTIER_RING is 0); when the reply brings its memfd and eventfd, every call whose
 * request fits a ring record goes through shared memory instead of the socket, with
 * the same frame bodies. The socket keeps what passes a descriptor (ATTACH), what
 * is too large for the ring, and the ERROR frame; a call is over before the next
 * starts, so the two paths never reorder anything. To a node whose HELLO reply has
 * KVT_HELLO_BIN the hot calls go over the ring as binary messages (bin_call; the
 * layout in kvtier/engine_proto.h): no map to encode or walk, no allocation; a call
 * without a binary form here (keys of several lengths, too large) is a frame. */
#include <errno.h>
#include <stddef.h>
#include <stdio.h>
#include <poll.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "kvt/alloc.h"
#include "kvt/common.h"
#include "kvtier/client.h"
#include "kvtier/engine_proto.h"
#include "kvtier/engine_ring.h"
#include "ring_int.h"

#define DEFAULT_TIMEOUT_MS 30000
#define CLIENT_MAX_BODY    (256u << 20) /* replies: events and stats can be long */
#define HELLO_FDS          3            /* the region's, the ring's memfd and eventfd */
#define POSTED_MAX         128          /* posted calls out at once */
#define PACKED_STACK_KEYS  32           /* keys a call unpacks (or takes ids of) on the stack */
#define COARSE_TICK_MS     10 /* CLOCK_MONOTONIC_COARSE's resolution, at most (HZ >= 100) */

/* Everything below is guarded by lock, except region (immutable after connect). */
struct kvtier_client {
    pthread_mutex_t lock;
    int fd;
    int broken; /* 0, or the error every call now returns */
    int timeout_ms;
    uint64_t id;
    uint64_t seq;
    size_t max_keys;
    unsigned node_minor;
    char node_fp[KVTIER_FINGERPRINT_MAX + 1];
    char error[KVTIER_ERROR_MAX + 1]; /* the ERROR frame's message */
    struct kvtier_region region;
    struct kvt_eproto_limits lim;
    struct kvt_ebuf out;
    uint8_t *in;
    size_t in_cap;
    struct kvt_cring *ring; /* the node's ring, or NULL */
    bool use_ring;          /* calls go through it (kvtier_client_set_ring) */
    bool posting;           /* post the calls whose reply is only an rc */
    bool bin;               /* the node takes binary requests on the ring (KVT_HELLO_BIN) */
    /* The posted calls whose replies are not consumed, by ring sequence number
     * (mod POSTED_MAX): their op and frame seq, and whether they were binary, to
     * check their replies. */
    struct {
        uint32_t op;
        uint64_t seq;
        bool bin;
    } posted[POSTED_MAX];
    uint64_t posted_calls, posted_failed;
    int posted_err; /* the first failure since the last drain */
};

/* ---- keys ------------------------------------------------------------------ */

int kvtier_key_set(struct kvtier_key *key, const void *bytes, size_t len)
{
    if (len < 1 || len > KVTIER_KEY_MAX || bytes == NULL)
        return -EINVAL;
    memset(key, 0, sizeof(*key));
    key->len = (uint8_t)len;
    memcpy(key->bytes, bytes, len);
    return 0;
}

int kvtier_key_make(struct kvtier_key *key, const void *hash, size_t hash_len, uint32_t group)
{
    if (hash_len + 4 > KVTIER_KEY_MAX || (hash == NULL && hash_len > 0))
        return -EINVAL;
    memset(key, 0, sizeof(*key));
    if (hash_len > 0)
        memcpy(key->bytes, hash, hash_len);
    key->bytes[hash_len] = (uint8_t)(group >> 24);
    key->bytes[hash_len + 1] = (uint8_t)(group >> 16);
    key->bytes[hash_len + 2] = (uint8_t)(group >> 8);
    key->bytes[hash_len + 3] = (uint8_t)group;
    key->len = (uint8_t)(hash_len + 4);
    return 0;
}

const char *kvtier_version(void)
{
    return KVTIER_VERSION;
}

const char *kvtier_lookup_result_name(int result)
{
    static const char *const names[] = {"MISS", "HIT", "HIT_PENDING", "RETRY"};

    return result >= 0 && result <= KVTIER_RETRY ? names[result] : "?";
}

/* ---- the stream -------------------------------------------------------------- */

static int64_t now_ms(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* A call's deadline (-1: none), from the coarse clock: a few ns against 30 for the
 * precise one on a VM, and a call over the ring takes about a microsecond. One
 * tick later than the coarse reading says, so that it is never early. */
static int64_t call_deadline(const struct kvtier_client *c)
{
    struct timespec ts;

    if (c->timeout_ms < 0)
        return -1;
    if (clock_gettime(CLOCK_MONOTONIC_COARSE, &ts) != 0)
        return now_ms() + c->timeout_ms;
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000 + COARSE_TICK_MS + c->timeout_ms;
}

static int wait_fd(int fd, short events, int64_t deadline)
{
    for (;;) {
        struct pollfd p = {.fd = fd, .events = events};
        int t = -1;
        int rc;

        if (deadline >= 0) {
            int64_t left = deadline - now_ms();

            if (left <= 0)
                return -ETIMEDOUT;
            t = left > 1000000 ? 1000000 : (int)left;
        }
        rc = poll(&p, 1, t);
        if (rc > 0)
            return 0;
        if (rc < 0 && errno != EINTR)
            return -errno;
    }
}

/* Writes p[0..n); send_fd >= 0 rides (SCM_RIGHTS) on the first byte written. */
static int write_all(int fd, const uint8_t *p, size_t n, int64_t deadline, int send_fd)
{
    while (n > 0) {
        union {
            struct cmsghdr h;
            char buf[CMSG_SPACE(sizeof(int))];
        } ctl;
        struct iovec iov = {.iov_base = (void *)p, .iov_len = n};
        struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1};
        ssize_t w;

        if (send_fd >= 0) {
            memset(&ctl, 0, sizeof(ctl));
            mh.msg_control = ctl.buf;
            mh.msg_controllen = sizeof(ctl.buf);
            struct cmsghdr *cm = CMSG_FIRSTHDR(&mh);
            cm->cmsg_level = SOL_SOCKET;
            cm->cmsg_type = SCM_RIGHTS;
            cm->cmsg_len = CMSG_LEN(sizeof(int));
            memcpy(CMSG_DATA(cm), &send_fd, sizeof(int));
        }
        w = sendmsg(fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (w > 0)
            send_fd = -1;

        if (w > 0) {
            p += w;
            n -= (size_t)w;
            continue;
        }
        if (w < 0 && errno == EINTR)
            continue;
        if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            int rc = wait_fd(fd, POLLOUT, deadline);

            if (rc < 0)
                return rc;
            continue;
        }
        return w < 0 ? -errno : -EPIPE;
    }
    return 0;
}

/* Reads exactly n bytes; descriptors passed along fill the free (-1) slots of
 * fds[0..HELLO_FDS) in order (with fds NULL, or no slot free, they are closed). */
static int read_all(int fd, uint8_t *p, size_t n, int64_t deadline, int *fds)
{
    while (n > 0) {
        union {
            struct cmsghdr h;
            char buf[CMSG_SPACE(HELLO_FDS * sizeof(int))];
        } ctl;
        struct iovec iov = {.iov_base = p, .iov_len = n};
        struct msghdr mh = {.msg_iov = &iov,
                            .msg_iovlen = 1,
                            .msg_control = ctl.buf,
                            .msg_controllen = sizeof(ctl.buf)};
        ssize_t r = recvmsg(fd, &mh, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);

        if (r > 0) {
            for (struct cmsghdr *cm = CMSG_FIRSTHDR(&mh); cm != NULL; cm = CMSG_NXTHDR(&mh, cm)) {
                if (cm->cmsg_level != SOL_SOCKET || cm->cmsg_type != SCM_RIGHTS)
                    continue;
                size_t nfd = (cm->cmsg_len - CMSG_LEN(0)) / sizeof(int);
                for (size_t i = 0; i < nfd; i++) {
                    int got, k = 0;

                    memcpy(&got, CMSG_DATA(cm) + i * sizeof(int), sizeof(int));
                    while (fds != NULL && k < HELLO_FDS && fds[k] >= 0)
                        k++;
                    if (fds != NULL && k < HELLO_FDS)
                        fds[k] = got;
                    else
                        close(got);
                }
            }
            p += r;
            n -= (size_t)r;
            continue;
        }
        if (r == 0)
            return -ECONNRESET;
        if (errno == EINTR)
            continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) {
            int rc = wait_fd(fd, POLLIN, deadline);

            if (rc < 0)
                return rc;
            continue;
        }
        return -errno;
    }
    return 0;
}

static void mark_broken(struct kvtier_client *c, int err)
{
    if (c->broken == 0) {
        c->broken = err;
        /* Which of the ring's checks failed, unless the node said why already. */
        if (err == -EPROTO && c->ring != NULL && kvt__cring_why(c->ring) != NULL &&
            c->error[0] == '\0')
            snprintf(c->error, sizeof(c->error), "ring: %s", kvt__cring_why(c->ring));
        shutdown(c->fd, SHUT_RDWR);
    }
}

static const struct kvt_eproto_limits reply_limits = {.max_body = CLIENT_MAX_BODY,
                                                      .max_keys = UINT32_MAX,
                                                      .max_params = 1u << 20,
                                                      .max_events = UINT32_MAX,
                                                      .max_stats = UINT32_MAX,
                                                      .max_peers = UINT32_MAX};

/* Reads one frame's body from the socket into c->in; its length into *len_p. */
static int read_frame(struct kvtier_client *c, int64_t deadline, int *fds, uint32_t *len_p)
{
    uint8_t hdr[KVT_EPROTO_HDR];
    uint32_t len;
    int rc = read_all(c->fd, hdr, sizeof(hdr), deadline, fds);

    if (rc < 0)
        return rc;
    len = kvt__eproto_frame_len(hdr);
    if (len > CLIENT_MAX_BODY)
        return -EPROTO;
    if (len > c->in_cap) {
        uint8_t *p = kvt_realloc(c->in, len);

        if (p == NULL)
            return -ENOMEM;
        c->in = p;
        c->in_cap = len;
    }
    rc = read_all(c->fd, c->in, len, deadline, fds);
    if (rc < 0)
        return rc;
    *len_p = len;
    return 0;
}

/* Decodes the reply in c->in to the request (op, seq) into rep: 0 (rep holds it),
 * or the error that breaks the connection (an ERROR frame's rc, -EPROTO). */
static int decode_reply(struct kvtier_client *c, uint32_t len, uint32_t op, uint64_t seq,
                        struct kvt_emsg *rep)
{
    int rc = kvt__emsg_decode(c->in, len, &reply_limits, rep);

    if (rc < 0)
        return -EPROTO;
    if (rep->op == (KVT_EOP_ERROR | KVT_EOP_REPLY) || rep->op == KVT_EOP_ERROR) {
        rc = kvt__emsg_has(rep, KVT_EF_RC) && rep->rc < 0 ? (int)rep->rc : -EPROTO;
        if (kvt__emsg_has(rep, KVT_EF_MESSAGE))
            snprintf(c->error, sizeof(c->error), "%s", rep->message);
        kvt__emsg_free(rep);
        return rc;
    }
    if (rep->op != (op | KVT_EOP_REPLY) || rep->seq != seq || !kvt__emsg_has(rep, KVT_EF_RC)) {
        kvt__emsg_free(rep);
        return -EPROTO;
    }
    return 0;
}

/* The reply of posted call rseq (its body in c->in, or on the socket when
 * on_socket): checked, its failure remembered. <0 only when the connection
 * breaks. */
static int posted_reply(struct kvtier_client *c, uint32_t rseq, uint32_t len, bool on_socket,
                        int64_t deadline)
{
    struct kvt_emsg rep;
    int rc = 0;

    if (on_socket)
        rc = read_frame(c, deadline, NULL, &len);
    if (rc == 0 && c->posted[rseq % POSTED_MAX].bin) {
        struct kvt_ebin_req q = {.op = (uint8_t)c->posted[rseq % POSTED_MAX].op,
                                 .seq = c->posted[rseq % POSTED_MAX].seq};
        struct kvt_ebin_rep h;
        const uint8_t *payload;

        if (kvt__ebin_rep_parse(c->in, len, &q, &h, &payload) < 0)
            return -EPROTO;
        if (h.rc < 0) {
            c->posted_failed++;
            if (c->posted_err == 0)
                c->posted_err = h.rc;
        }
        return 0;
    }
    if (rc == 0)
        rc = decode_reply(c, len, c->posted[rseq % POSTED_MAX].op, c->posted[rseq % POSTED_MAX].seq,
                          &rep);
    if (rc < 0)
        return rc;
    if (rep.rc < 0) {
        c->posted_failed++;
        if (c->posted_err == 0)
            c->posted_err = (int)rep.rc;
    }
    kvt__emsg_free(&rep);
    return 0;
}

/* Consumes the replies of posted calls: all of them (all) or those already there.
 * <0: the connection broke. */
static int drain_posted(struct kvtier_client *c, bool all, int64_t deadline)
{
    uint64_t dl_ns = deadline < 0 ? 0 : (uint64_t)deadline * 1000000ull;

    while (c->ring != NULL && kvt__cring_outstanding(c->ring) > 0) {
        uint32_t got = 0;
        size_t n = 0;
        int rc = kvt__cring_next(c->ring, c->fd, all, dl_ns, &c->in, &c->in_cap, &n, &got);

        if (rc == 2)
            return 0; /* (not all) nothing more there yet */
        if (rc == 3) {
            /* the node closed the ring: its ERROR frame (or EOF) says why */
            uint32_t len;

            rc = read_frame(c, deadline, NULL, &len);
            if (rc == 0) {
                struct kvt_emsg rep;

                rc = decode_reply(c, len, 0, 0, &rep);
                if (rc == 0) {
                    kvt__emsg_free(&rep);
                    rc = -EPROTO;
                }
            }
            return rc;
        }
        if (rc < 0)
            return rc;
        rc = posted_reply(c, got, (uint32_t)n, rc == 1, deadline);
        if (rc < 0)
            return rc;
    }
    return 0;
}

/* Posts body on the ring; when posted calls fill it, their replies are drained (they
 * make room) and the post is tried once more. 0 (*rseq_p its ring sequence number),
 * 1 it does not go on the ring (too large, or still no room: the caller takes
 * another way), or the error that broke the connection. */
static int ring_post(struct kvtier_client *c, const uint8_t *body, size_t len, int64_t deadline,
                     uint32_t *rseq_p)
{
    int rc = kvt__cring_post(c->ring, body, len, rseq_p);

    if (rc == -EBUSY) {
        rc = drain_posted(c, true, deadline);
        if (rc < 0)
            return rc;
        rc = kvt__cring_post(c->ring, body, len, rseq_p);
    }
    return rc == -EMSGSIZE || rc == -EBUSY ? 1 : rc;
}

/* ring_post in place: where len body bytes go on the ring (*dst_p), published by
 * kvt__cring_commit once written. 0, 1 no room or too large (the caller takes
 * another way), or the error that broke the connection. */
static int ring_reserve(struct kvtier_client *c, size_t len, int64_t deadline, uint8_t **dst_p)
{
    int rc = kvt__cring_reserve(c->ring, len, dst_p);

    if (rc == -EBUSY) {
        rc = drain_posted(c, true, deadline);
        if (rc < 0)
            return rc;
        rc = kvt__cring_reserve(c->ring, len, dst_p);
    }
    return rc == -EMSGSIZE || rc == -EBUSY ? 1 : rc;
}

/* A posted call's ring sequence number rseq, and what its reply is checked against. */
static void note_posted(struct kvtier_client *c, uint32_t rseq, unsigned op, uint64_t seq, bool bin)
{
    c->posted[rseq % POSTED_MAX].op = op;
    c->posted[rseq % POSTED_MAX].seq = seq;
    c->posted[rseq % POSTED_MAX].bin = bin;
    c->posted_calls++;
}

/* Waits on the ring for the reply of rseq, consuming the replies of posted calls
 * that come first. What kvt__cring_next says of ours (0: on the ring, *n_p bytes
 * in c->in; 1: on the socket; 3: the node closed), or the error that broke the
 * connection. */
static int ring_wait(struct kvtier_client *c, uint32_t rseq, uint64_t dl_ns, int64_t deadline,
                     size_t *n_p)
{
    for (;;) {
        uint32_t got = 0;
        size_t n = 0;
        int rc = kvt__cring_next(c->ring, c->fd, true, dl_ns, &c->in, &c->in_cap, &n, &got);

        if (rc < 0)
            return rc;
        if ((rc == 0 || rc == 1) && got != rseq) {
            rc = posted_reply(c, got, (uint32_t)n, rc == 1, deadline);
            if (rc < 0)
                return rc;
            continue;
        }
        *n_p = n;
        return rc;
    }
}

/* One round trip: sends req (op and seq filled in here), waits for its reply into
 * rep. rep's rc is returned (after the transport's own errors). Over the ring when
 * there is one, nothing rides along (fds, send_fd) and the request fits a record;
 * replies of posted calls that come first are consumed on the way. A call on the
 * socket first waits for every posted call, so that nothing is reordered. */
static int call_fd(struct kvtier_client *c, struct kvt_emsg *req, struct kvt_emsg *rep, int *fds,
                   int send_fd)
{
    int64_t deadline = call_deadline(c);
    uint64_t dl_ns = deadline < 0 ? 0 : (uint64_t)deadline * 1000000ull;
    bool via_ring = false;
    uint32_t rseq = 0, len = 0;
    int rc;

    kvt__emsg_init(rep);
    if (c->broken)
        return c->broken;
    req->seq = ++c->seq;
    req->has |= 1u << KVT_EF_OP | 1u << KVT_EF_SEQ;
    c->out.len = 0;
    rc = kvt__emsg_encode(req, &c->out);
    if (rc < 0)
        return rc;
    if (c->out.len - KVT_EPROTO_HDR > c->lim.max_body)
        return -EMSGSIZE;
    if (c->ring != NULL && c->use_ring && fds == NULL && send_fd < 0) {
        const uint8_t *body = c->out.data + KVT_EPROTO_HDR;
        size_t blen = c->out.len - KVT_EPROTO_HDR;

        rc = ring_post(c, body, blen, deadline, &rseq);
        if (rc < 0)
            goto broken;
        via_ring = rc == 0;
    }
    if (!via_ring) {
        rc = drain_posted(c, true, deadline);
        if (rc == 0)
            rc = write_all(c->fd, c->out.data, c->out.len, deadline, send_fd);
        if (rc < 0)
            goto broken;
    }
    if (via_ring) {
        size_t n = 0;

        rc = ring_wait(c, rseq, dl_ns, deadline, &n);
        if (rc < 0)
            goto broken;
        len = (uint32_t)n;
        via_ring = rc == 0; /* 1: ours is on the socket; 3: read why the node closed */
    }
    if (!via_ring) {
        rc = read_frame(c, deadline, fds, &len);
        if (rc < 0)
            goto broken;
    }
    rc = decode_reply(c, len, req->op, req->seq, rep);
    if (rc < 0)
        goto broken;
    return (int)rep->rc;
broken:
    mark_broken(c, rc);
    return rc;
}

/* Posts req on the ring without waiting for its reply (checked later, when a call
 * or a drain consumes it). 1: it cannot be posted (call it), else 0 or the error
 * that broke the connection. */
static int post_call(struct kvtier_client *c, struct kvt_emsg *req)
{
    int64_t deadline = call_deadline(c);
    uint32_t rseq;
    int rc;

    if (c->broken)
        return c->broken;
    rc = drain_posted(c, kvt__cring_outstanding(c->ring) >= POSTED_MAX - 1, deadline);
    if (rc < 0)
        goto broken;
    req->seq = c->seq + 1;
    req->has |= 1u << KVT_EF_OP | 1u << KVT_EF_SEQ;
    c->out.len = 0;
    rc = kvt__emsg_encode(req, &c->out);
    if (rc < 0 || c->out.len - KVT_EPROTO_HDR > c->lim.max_body)
        return 1;
    rc = ring_post(c, c->out.data + KVT_EPROTO_HDR, c->out.len - KVT_EPROTO_HDR, deadline, &rseq);
    if (rc == 1)
        return 1;
    if (rc < 0)
        goto broken;
    c->seq++;
    note_posted(c, rseq, req->op, req->seq, false);
    return 0;
broken:
    mark_broken(c, rc);
    return rc;
}

static int call(struct kvtier_client *c, struct kvt_emsg *req, struct kvt_emsg *rep, int *fds)
{
    return call_fd(c, req, rep, fds, -1);
}

/* ---- binary calls ------------------------------------------------------------------ */

/* The keys of a binary call: n * key_len packed bytes, or n keys of one length. */
struct bin_keys {
    const uint8_t *packed;
    const struct kvtier_key *keys;
    size_t key_len, n;
};

/* The header of op's binary request (*h_p) and its body's bytes (*len_p): 0, or 1
 * when it has no binary form here (no binary ring, no keys, keys of several
 * lengths, an argument the frame path refuses: it says why). */
static int bin_plan(struct kvtier_client *c, unsigned op, const char *req_id,
                    const struct bin_keys *k, uint32_t flags, struct kvt_ebin_req *h_p,
                    size_t *len_p)
{
    struct kvt_ebin_req h = {.magic = KVT_EBIN_MAGIC, .op = (uint8_t)op, .flags = flags};
    size_t id_len = 0, key_len = k->key_len;

    /* the id's length, at most one past the longest allowed (refused below); a
     * loop, not strlen: see kvt_ering_copy on library calls in a ring call */
    while (req_id != NULL && id_len <= KVT_EPROTO_ID_MAX && req_id[id_len] != '\0')
        id_len++;
    if (!c->bin || c->ring == NULL || !c->use_ring || c->broken || k->n == 0 ||
        k->n > c->lim.max_keys || id_len > KVT_EPROTO_ID_MAX || (req_id != NULL && id_len == 0))
        return 1;
    if (k->keys != NULL) {
        key_len = k->keys[0].len;
        for (size_t i = 1; i < k->n; i++)
            if (k->keys[i].len != key_len)
                return 1;
    } else if (k->packed == NULL) {
        return 1;
    }
    if (key_len < 1 || key_len > KVTIER_KEY_MAX ||
        KVT_EBIN_HDR + id_len + k->n * key_len > c->lim.max_body)
        return 1;
    h.key_len = (uint8_t)key_len;
    h.id_len = (uint8_t)id_len;
    h.n = (uint32_t)k->n;
    h.seq = c->seq + 1;
    *h_p = h;
    *len_p = KVT_EBIN_HDR + id_len + k->n * key_len;
    return 0;
}

/* Writes the binary request bin_plan made the header of to p (in the ring). */
static void bin_write(uint8_t *p, const struct kvt_ebin_req *h, const char *req_id,
                      const struct bin_keys *k)
{
    memcpy(p, h, sizeof(*h));
    p += sizeof(*h);
    if (h->id_len > 0)
        kvt_ering_copy(p, req_id, h->id_len);
    p += h->id_len;
    if (k->packed != NULL) {
        kvt_ering_copy(p, k->packed, (size_t)h->n * h->key_len);
        return;
    }
    for (size_t i = 0; i < h->n; i++, p += h->key_len)
        kvt_ering_copy(p, k->keys[i].bytes, h->key_len);
}

/* One call of op as a binary message over the ring. 1: not made (no binary form
 * here, or it does not fit the ring): make it as a frame. Else what the frame
 * path gives: the node's rc, or the error that broke the connection. The reply's
 * payload (lookup's result bytes, prepare_load's chunk ids) goes to out, its
 * entries to *n_out_p. post: only posted (the client posts, and the reply is only
 * an rc: checked by a later call or a drain). Under the client's lock. */
static int bin_call(struct kvtier_client *c, unsigned op, const char *req_id,
                    const struct bin_keys *k, uint32_t flags, bool post, void *out, size_t *n_out_p)
{
    int64_t deadline = call_deadline(c);
    uint64_t dl_ns = deadline < 0 ? 0 : (uint64_t)deadline * 1000000ull;
    struct kvt_ebin_req q;
    struct kvt_ebin_rep h;
    const uint8_t *payload;
    uint8_t *dst;
    uint32_t rseq = 0, len;
    size_t n = 0, blen;
    int rc;

    if (post && kvt__cring_outstanding(c->ring) >= POSTED_MAX - 1) {
        rc = drain_posted(c, true, deadline);
        if (rc < 0)
            goto broken;
    }
    if (bin_plan(c, op, req_id, k, flags, &q, &blen) != 0)
        return 1;
    /* written in place: no copy of the request but the one into the ring */
    rc = ring_reserve(c, blen, deadline, &dst);
    if (rc == 1)
        return 1;
    if (rc < 0)
        goto broken;
    bin_write(dst, &q, req_id, k);
    kvt__cring_commit(c->ring, &rseq);
    c->seq++;
    if (post) {
        note_posted(c, rseq, op, q.seq, true);
        return 0;
    }
    rc = ring_wait(c, rseq, dl_ns, deadline, &n);
    if (rc < 0)
        goto broken;
    len = (uint32_t)n;
    if (rc == 1 || rc == 3) { /* ours is on the socket, or why the node closed */
        rc = read_frame(c, deadline, NULL, &len);
        if (rc < 0)
            goto broken;
    }
    if (len == 0 || c->in[0] != KVT_EBIN_MAGIC) {
        struct kvt_emsg rep; /* an ERROR frame (anything else breaks the call) */

        rc = decode_reply(c, len, op, q.seq, &rep);
        if (rc == 0) {
            kvt__emsg_free(&rep);
            rc = -EPROTO;
        }
        goto broken;
    }
    if (kvt__ebin_rep_parse(c->in, len, &q, &h, &payload) < 0) {
        rc = -EPROTO;
        goto broken;
    }
    if (h.rc == 0 && out != NULL)
        kvt_ering_copy(out, payload, (size_t)h.n * kvt__ebin_rep_elem(op));
    if (n_out_p != NULL)
        *n_out_p = h.n;
    return h.rc;
broken:
    mark_broken(c, rc);
    return rc;
}

/* ---- connect / close ----------------------------------------------------------- */

/* Whether to ask the node for a ring: yes unless $KVTIER_RING is "0". */
static bool want_ring(void)
{
    const char *v = getenv("KVTIER_RING");

    return v == NULL || strcmp(v, "0") != 0;
}

/* Whether to send the hot calls as binary messages when the node takes them: yes
 * unless $KVTIER_RING_BIN is "0" (then every call is a frame, as to an older node). */
static bool want_bin(void)
{
    const char *v = getenv("KVTIER_RING_BIN");

    return v == NULL || strcmp(v, "0") != 0;
}

static int hello(struct kvtier_client *c, const char *name, const char *fingerprint)
{
    struct kvt_emsg req, rep;
    int fds[HELLO_FDS] = {-1, -1, -1};
    int rfd;
    int rc;
    struct stat st;

    kvt__emsg_init(&req);
    req.op = KVT_EOP_HELLO;
    req.major = KVTIER_PROTO_MAJOR;
    req.minor = KVTIER_PROTO_MINOR;
    snprintf(req.name, sizeof(req.name), "%s", name);
    req.has = 1u << KVT_EF_MAJOR | 1u << KVT_EF_MINOR | 1u << KVT_EF_NAME;
    if (want_ring()) {
        req.flags = KVT_HELLO_RING;
        req.has |= 1u << KVT_EF_FLAGS;
    }
    if (fingerprint != NULL && fingerprint[0] != '\0') {
        snprintf(req.fingerprint, sizeof(req.fingerprint), "%s", fingerprint);
        req.has |= 1u << KVT_EF_FINGERPRINT;
    }
    rc = call(c, &req, &rep, fds);
    rfd = fds[0];
    if (rc < 0)
        goto out;
    c->node_minor =
        kvt__emsg_has(&rep, KVT_EF_MINOR) && rep.minor < 0xffff ? (unsigned)rep.minor : 0;
    if (kvt__emsg_has(&rep, KVT_EF_FINGERPRINT))
        snprintf(c->node_fp, sizeof(c->node_fp), "%s", rep.fingerprint);
    if (rep.n_geom < KVT_EG_COUNT || rfd < 0) {
        rc = -EPROTO;
        goto out;
    }
    struct kvtier_region *r = &c->region;
    r->num_chunks = rep.geom[KVT_EG_NUM_CHUNKS];
    r->row_bytes = rep.geom[KVT_EG_ROW_BYTES];
    r->page_bytes = rep.geom[KVT_EG_PAGE_BYTES];
    r->num_workers = (unsigned)rep.geom[KVT_EG_NUM_WORKERS];
    r->size = rep.geom[KVT_EG_SIZE];
    c->id = rep.geom[KVT_EG_CLIENT_ID];
    c->max_keys = rep.geom[KVT_EG_MAX_KEYS];
    if (r->num_chunks == 0 || r->row_bytes == 0 || r->size / r->num_chunks != r->row_bytes ||
        r->size % r->num_chunks != 0 || (uint64_t)r->num_workers * r->page_bytes != r->row_bytes ||
        c->max_keys == 0) {
        rc = -EPROTO;
        goto out;
    }
    if (c->max_keys < c->lim.max_keys)
        c->lim.max_keys = (uint32_t)c->max_keys;
    if (fstat(rfd, &st) != 0) {
        rc = -errno;
        goto out;
    }
    if ((uint64_t)st.st_size < r->size) { /* cut under the daemon: pages past it would SIGBUS */
        rc = -EBADFD;
        goto out;
    }
    r->base = mmap(NULL, r->size, PROT_READ | PROT_WRITE, MAP_SHARED, rfd, 0);
    if (r->base == MAP_FAILED) {
        r->base = NULL;
        rc = -errno;
        goto out;
    }
    r->ident_dev = (uint64_t)st.st_dev;
    r->ident_ino = (uint64_t)st.st_ino;
    /* A ring that does not check out leaves the client on the socket. */
    if (kvt__emsg_has(&rep, KVT_EF_FLAGS) && (rep.flags & KVT_HELLO_RING) && fds[1] >= 0 &&
        fds[2] >= 0 && kvt__cring_open(fds[1], fds[2], &c->ring) == 0) {
        fds[2] = -1; /* the ring's now */
        c->use_ring = true;
        c->bin = (rep.flags & KVT_HELLO_BIN) != 0 && want_bin();
    }
out:
    for (int i = 0; i < HELLO_FDS; i++) {
        if (fds[i] >= 0)
            close(fds[i]);
    }
    kvt__emsg_free(&rep);
    return rc;
}

/* The fields of a caller's kvtier_connect_ex that its size covers. */
#define EX_HAS(o, field)                                                                           \
    ((o) != NULL && (o)->size >= offsetof(struct kvtier_connect_ex, field) + sizeof((o)->field))

int kvtier_connect(const char *socket_path, const struct kvtier_connect_opts *opts,
                   struct kvtier_client **client_p)
{
    struct kvtier_connect_ex ex = {.size = sizeof(ex)};

    if (opts != NULL) {
        ex.name = opts->name;
        ex.timeout_ms = opts->timeout_ms;
    }
    return kvtier_connect_ex(socket_path, &ex, client_p);
}

int kvtier_connect_ex(const char *socket_path, const struct kvtier_connect_ex *opts,
                      struct kvtier_client **client_p)
{
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    struct kvtier_client *c;
    const char *name = EX_HAS(opts, name) && opts->name != NULL ? opts->name : "engine";
    const char *fp = EX_HAS(opts, fingerprint) ? opts->fingerprint : NULL;
    int timeout = EX_HAS(opts, timeout_ms) ? opts->timeout_ms : 0;
    char *err = EX_HAS(opts, error_len) ? opts->error : NULL;
    size_t err_len = err != NULL ? opts->error_len : 0;
    int rc;

    if (err_len > 0)
        err[0] = '\0';
    if (socket_path == NULL || client_p == NULL || strlen(socket_path) >= sizeof(sa.sun_path) ||
        strlen(name) > KVTIER_NAME_MAX || (fp != NULL && strlen(fp) > KVTIER_FINGERPRINT_MAX))
        return -EINVAL;
    c = kvt_calloc(1, sizeof(*c));
    if (c == NULL)
        return -ENOMEM;
    pthread_mutex_init(&c->lock, NULL);
    kvt__eproto_limits_default(&c->lim);
    kvt__ebuf_init(&c->out);
    c->timeout_ms = timeout != 0 ? timeout : DEFAULT_TIMEOUT_MS;
    c->fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (c->fd < 0) {
        rc = -errno;
        goto err_free;
    }
    memcpy(sa.sun_path, socket_path, strlen(socket_path) + 1);
    if (connect(c->fd, (struct sockaddr *)&sa, sizeof(sa)) != 0) {
        rc = -errno;
        goto err_close;
    }
    rc = hello(c, name, fp);
    if (rc < 0) {
        if (err_len > 0)
            snprintf(err, err_len, "%s", c->error);
        goto err_close;
    }
    *client_p = c;
    return 0;

err_close:
    close(c->fd);
err_free:
    kvt__ebuf_cleanup(&c->out);
    kvt_free(c->in);
    pthread_mutex_destroy(&c->lock);
    kvt_free(c);
    return rc;
}

void kvtier_close(struct kvtier_client *c)
{
    if (c == NULL)
        return;
    /* Posted calls reach the node before the connection ends. */
    if (c->broken == 0 && c->ring != NULL && kvt__cring_outstanding(c->ring) > 0)
        drain_posted(c, true, c->timeout_ms < 0 ? -1 : now_ms() + c->timeout_ms);
    if (c->region.base != NULL)
        munmap(c->region.base, c->region.size);
    kvt__cring_close(c->ring);
    close(c->fd);
    kvt__ebuf_cleanup(&c->out);
    kvt_free(c->in);
    pthread_mutex_destroy(&c->lock);
    kvt_free(c);
}

const struct kvtier_region *kvtier_client_region(const struct kvtier_client *c)
{
    return &c->region;
}

uint8_t *kvtier_client_row(const struct kvtier_client *c, int64_t chunk_id)
{
    if (chunk_id < 0 || (uint64_t)chunk_id >= c->region.num_chunks)
        return NULL;
    return c->region.base + (size_t)chunk_id * c->region.row_bytes;
}

uint64_t kvtier_client_id(const struct kvtier_client *c)
{
    return c->id;
}

size_t kvtier_client_max_keys(const struct kvtier_client *c)
{
    return c->max_keys;
}

bool kvtier_client_alive(struct kvtier_client *c)
{
    struct pollfd p = {.fd = c->fd, .events = POLLIN};
    bool alive;

    /* Between calls nothing is to be read: readable means EOF or an ERROR frame. */
    pthread_mutex_lock(&c->lock);
    alive = c->broken == 0 && poll(&p, 1, 0) == 0;
    pthread_mutex_unlock(&c->lock);
    return alive;
}

bool kvtier_client_has_ring(const struct kvtier_client *c)
{
    return c->ring != NULL;
}

int kvtier_client_set_ring(struct kvtier_client *c, bool enabled, int spin_us)
{
    if (c->ring == NULL)
        return enabled ? -EOPNOTSUPP : 0;
    pthread_mutex_lock(&c->lock);
    if (!enabled && c->broken == 0 && drain_posted(c, true, now_ms() + c->timeout_ms) < 0)
        mark_broken(c, -EPROTO);
    c->use_ring = enabled;
    if (spin_us >= 0)
        kvt__cring_set_spin(c->ring, (uint32_t)spin_us);
    pthread_mutex_unlock(&c->lock);
    return 0;
}

int kvtier_client_set_posting(struct kvtier_client *c, bool enabled)
{
    if (c->ring == NULL)
        return enabled ? -EOPNOTSUPP : 0;
    pthread_mutex_lock(&c->lock);
    c->posting = enabled;
    pthread_mutex_unlock(&c->lock);
    return 0;
}

int kvtier_client_drain(struct kvtier_client *c, uint64_t *failed_p)
{
    int rc;

    pthread_mutex_lock(&c->lock);
    rc = c->broken;
    if (rc == 0 && c->ring != NULL) {
        rc = drain_posted(c, true, c->timeout_ms < 0 ? -1 : now_ms() + c->timeout_ms);
        if (rc < 0)
            mark_broken(c, rc);
    }
    if (rc == 0)
        rc = c->posted_err;
    if (failed_p != NULL)
        *failed_p = c->posted_failed;
    c->posted_err = 0;
    c->posted_failed = 0;
    pthread_mutex_unlock(&c->lock);
    return rc;
}

int kvtier_client_ring_stats(struct kvtier_client *c, struct kvtier_ring_stats *out)
{
    struct kvt_cring_stats st;

    if (c->ring == NULL)
        return -EOPNOTSUPP;
    pthread_mutex_lock(&c->lock);
    kvt__cring_stats(c->ring, &st);
    out->posted_calls = c->posted_calls;
    pthread_mutex_unlock(&c->lock);
    out->posted = st.posted;
    out->wakeups = st.wakeups;
    out->sleeps = st.sleeps;
    out->redirects = st.redirects;
    return 0;
}

const char *kvtier_client_error(const struct kvtier_client *c)
{
    return c->error;
}

const char *kvtier_client_node_fingerprint(const struct kvtier_client *c)
{
    return c->node_fp;
}

unsigned kvtier_client_node_minor(const struct kvtier_client *c)
{
    return c->node_minor;
}

/* ---- the calls -------------------------------------------------------------------- */

static int set_req_id(struct kvt_emsg *m, const char *req_id, bool required)
{
    size_t n;

    if (req_id == NULL)
        return required ? -EINVAL : 0;
    n = strlen(req_id);
    if (n < 1 || n > KVTIER_REQ_ID_MAX)
        return -EINVAL;
    memcpy(m->req_id, req_id, n + 1);
    m->has |= 1u << KVT_EF_REQ_ID;
    return 0;
}

static int set_keys(struct kvtier_client *c, struct kvt_emsg *m, const struct kvtier_key *keys,
                    size_t n)
{
    if (n > 0 && keys == NULL)
        return -EINVAL;
    if (n > c->lim.max_keys)
        return -EMSGSIZE;
    for (size_t i = 0; i < n; i++) {
        if (keys[i].len < 1 || keys[i].len > KVTIER_KEY_MAX)
            return -EINVAL;
    }
    m->keys = (struct kvtier_key *)keys;
    m->n_keys = (uint32_t)n;
    m->has |= 1u << KVT_EF_KEYS;
    return 0;
}

/* Prepares req for op with req_id and keys; returns an argument error or 0. */
static int prep(struct kvtier_client *c, struct kvt_emsg *req, uint32_t op, const char *req_id,
                bool id_required, const struct kvtier_key *keys, size_t n)
{
    int rc;

    kvt__emsg_init(req);
    req->op = op;
    rc = set_req_id(req, req_id, id_required);
    if (rc == 0 && (keys != NULL || n > 0))
        rc = set_keys(c, req, keys, n);
    return rc;
}

/* Runs one call under the lock; the reply is left in rep for the caller to read
 * (and free). */
static int locked_call(struct kvtier_client *c, struct kvt_emsg *req, struct kvt_emsg *rep)
{
    int rc;

    pthread_mutex_lock(&c->lock);
    rc = call(c, req, rep, NULL);
    pthread_mutex_unlock(&c->lock);
    return rc;
}

/* A call whose reply is only its rc: posted when the caller asked for posting. */
static int simple_call(struct kvtier_client *c, struct kvt_emsg *req)
{
    struct kvt_emsg rep;
    int rc;

    pthread_mutex_lock(&c->lock);
    if (kvt__ebin_op(req->op) && kvt__emsg_has(req, KVT_EF_KEYS)) {
        struct bin_keys k = {.keys = req->keys, .n = req->n_keys};

        rc = bin_call(c, req->op, kvt__emsg_has(req, KVT_EF_REQ_ID) ? req->req_id : NULL, &k,
                      (uint32_t)req->flags, c->posting, NULL, NULL);
        if (rc != 1) {
            pthread_mutex_unlock(&c->lock);
            return rc;
        }
    }
    if (c->posting && c->ring != NULL && c->use_ring) {
        rc = post_call(c, req);
        if (rc != 1) {
            pthread_mutex_unlock(&c->lock);
            return rc;
        }
    }
    rc = call(c, req, &rep, NULL);
    pthread_mutex_unlock(&c->lock);
    kvt__emsg_free(&rep);
    return rc;
}

int kvtier_on_new_request(struct kvtier_client *c, const char *req_id,
                          const struct kvtier_request_opts *opts,
                          enum kvtier_offload_policy *policy_p)
{
    struct kvt_emsg req, rep;
    int rc = prep(c, &req, KVT_EOP_NEW_REQUEST, req_id, true, NULL, 0);

    if (rc < 0)
        return rc;
    if (opts != NULL && opts->params_json != NULL) {
        size_t n = strlen(opts->params_json);

        if (n > c->lim.max_params)
            return -EMSGSIZE;
        req.params = (char *)opts->params_json;
        req.params_len = (uint32_t)n;
        req.has |= 1u << KVT_EF_PARAMS;
    }
    if (opts != NULL && !opts->load_tiers_all) {
        if (opts->n_load_tiers > KVTIER_FILTER_MAX ||
            (opts->n_load_tiers > 0 && opts->load_tiers == NULL))
            return -EINVAL;
        for (size_t i = 0; i < opts->n_load_tiers; i++) {
            const struct kvtier_tier_matcher *mt = &opts->load_tiers[i];

            if (mt->medium < -1 || mt->medium > 1 || mt->locality < -1 || mt->locality > 1)
                return -EINVAL;
            req.filter[i] = *mt;
        }
        req.n_filter = (uint32_t)opts->n_load_tiers;
        req.has |= 1u << KVT_EF_FILTER;
    }
    rc = locked_call(c, &req, &rep);
    if (rc == 0 && policy_p != NULL)
        *policy_p = rep.flags ? KVTIER_REQUEST_LEVEL : KVTIER_CHUNK_LEVEL;
    kvt__emsg_free(&rep);
    return rc;
}

int kvtier_on_request_finished(struct kvtier_client *c, const char *req_id)
{
    struct kvt_emsg req;
    int rc = prep(c, &req, KVT_EOP_REQUEST_FINISHED, req_id, true, NULL, 0);

    return rc < 0 ? rc : simple_call(c, &req);
}

/* A lookup as a binary call: 1 not made (a frame then), else as the frame's. */
static int bin_lookup(struct kvtier_client *c, const char *req_id, const struct bin_keys *k,
                      unsigned flags, uint8_t *results, size_t *n_done_p)
{
    size_t done = 0;
    int rc;

    pthread_mutex_lock(&c->lock);
    rc = bin_call(c, KVT_EOP_LOOKUP, req_id, k, flags, false, results, &done);
    pthread_mutex_unlock(&c->lock);
    if (rc == 0 && n_done_p != NULL)
        *n_done_p = done;
    return rc;
}

/* A call whose reply is only an rc, as a binary call (posted when the client
 * posts): 1 not made (a frame then), else as the frame's. */
static int bin_simple(struct kvtier_client *c, unsigned op, const char *req_id,
                      const struct bin_keys *k, uint32_t flags)
{
    int rc;

    pthread_mutex_lock(&c->lock);
    rc = bin_call(c, op, req_id, k, flags, c->posting, NULL, NULL);
    pthread_mutex_unlock(&c->lock);
    return rc;
}

int kvtier_lookup(struct kvtier_client *c, const char *req_id, const struct kvtier_key *keys,
                  size_t n, unsigned flags, uint8_t *results, size_t *n_done_p)
{
    struct kvt_emsg req, rep;
    int rc;

    if (c->bin && req_id != NULL && keys != NULL && results != NULL &&
        (flags & ~KVTIER_LOOKUP_PREFIX) == 0) {
        struct bin_keys k = {.keys = keys, .n = n};

        rc = bin_lookup(c, req_id, &k, flags, results, n_done_p);
        if (rc != 1)
            return rc;
    }
    rc = prep(c, &req, KVT_EOP_LOOKUP, req_id, true, keys, n);
    if (rc < 0)
        return rc;
    if ((n > 0 && results == NULL) || (flags & ~KVTIER_LOOKUP_PREFIX) != 0)
        return -EINVAL;
    req.flags = flags;
    req.has |= 1u << KVT_EF_FLAGS | 1u << KVT_EF_KEYS;
    rc = locked_call(c, &req, &rep);
    if (rc == 0 && rep.n_results > n)
        rc = -EPROTO;
    if (rc == 0) {
        memcpy(results, rep.results, rep.n_results);
        if (n_done_p != NULL)
            *n_done_p = rep.n_results;
    }
    kvt__emsg_free(&rep);
    return rc;
}

int kvtier_prepare_store(struct kvtier_client *c, const char *req_id, const struct kvtier_key *keys,
                         size_t n, struct kvtier_store_plan *plan)
{
    struct kvt_emsg req, rep;
    int rc = prep(c, &req, KVT_EOP_PREPARE_STORE, req_id, true, keys, n);

    if (rc < 0)
        return rc;
    if (plan == NULL || (n > 0 && (plan->store_index == NULL || plan->chunk_ids == NULL)) ||
        (plan->cap_evicted > 0 && plan->evicted == NULL))
        return -EINVAL;
    req.has |= 1u << KVT_EF_KEYS;
    rc = locked_call(c, &req, &rep);
    if (rc == 0) {
        if (rep.n_index != rep.n_ids || rep.n_ids > n) {
            rc = -EPROTO;
        } else {
            for (uint32_t i = 0; i < rep.n_index; i++) {
                if (rep.index[i] >= n || rep.ids[i] < 0 ||
                    (uint64_t)rep.ids[i] >= c->region.num_chunks)
                    rc = -EPROTO;
            }
        }
    }
    if (rc == 0) {
        size_t ne = rep.n_evicted < plan->cap_evicted ? rep.n_evicted : plan->cap_evicted;

        memcpy(plan->store_index, rep.index, rep.n_index * sizeof(*rep.index));
        memcpy(plan->chunk_ids, rep.ids, rep.n_ids * sizeof(*rep.ids));
        if (ne > 0)
            memcpy(plan->evicted, rep.evicted, ne * sizeof(*rep.evicted));
        plan->n_store = rep.n_index;
        plan->n_evicted = rep.n_evicted;
    }
    kvt__emsg_free(&rep);
    return rc;
}

int kvtier_complete_store(struct kvtier_client *c, const char *req_id,
                          const struct kvtier_key *keys, size_t n, bool success)
{
    struct kvt_emsg req;
    int rc = prep(c, &req, KVT_EOP_COMPLETE_STORE, req_id, true, keys, n);

    if (rc < 0)
        return rc;
    req.flags = success;
    req.has |= 1u << KVT_EF_FLAGS | 1u << KVT_EF_KEYS;
    return simple_call(c, &req);
}

/* prepare_load as a binary call: 1 not made (a frame then), else as the frame's.
 * The ids are checked as the frame's are, and written only when they all are. */
static int bin_prepare_load(struct kvtier_client *c, const char *req_id, const struct bin_keys *k,
                            int64_t *chunk_ids)
{
    int64_t stack[PACKED_STACK_KEYS], *ids = stack;
    size_t done = 0;
    int rc;

    if (k->n > PACKED_STACK_KEYS) {
        ids = kvt_malloc(k->n * sizeof(*ids));
        if (ids == NULL)
            return -ENOMEM;
    }
    pthread_mutex_lock(&c->lock);
    rc = bin_call(c, KVT_EOP_PREPARE_LOAD, req_id, k, 0, false, ids, &done);
    pthread_mutex_unlock(&c->lock);
    if (rc == 0 && done != k->n)
        rc = -EPROTO;
    for (size_t i = 0; rc == 0 && i < done; i++) {
        if (ids[i] < 0 || (uint64_t)ids[i] >= c->region.num_chunks)
            rc = -EPROTO;
    }
    if (rc == 0)
        memcpy(chunk_ids, ids, k->n * sizeof(*ids));
    if (ids != stack)
        kvt_free(ids);
    return rc;
}

int kvtier_prepare_load(struct kvtier_client *c, const char *req_id, const struct kvtier_key *keys,
                        size_t n, int64_t *chunk_ids)
{
    struct kvt_emsg req, rep;
    int rc = prep(c, &req, KVT_EOP_PREPARE_LOAD, req_id, false, keys, n);

    if (rc < 0)
        return rc;
    if (n > 0 && chunk_ids == NULL)
        return -EINVAL;
    if (c->bin) {
        struct bin_keys k = {.keys = keys, .n = n};

        rc = bin_prepare_load(c, req_id, &k, chunk_ids);
        if (rc != 1)
            return rc;
    }
    req.has |= 1u << KVT_EF_KEYS;
    rc = locked_call(c, &req, &rep);
    if (rc == 0 && rep.n_ids != n)
        rc = -EPROTO;
    for (uint32_t i = 0; rc == 0 && i < rep.n_ids; i++) {
        if (rep.ids[i] < 0 || (uint64_t)rep.ids[i] >= c->region.num_chunks)
            rc = -EPROTO;
    }
    if (rc == 0)
        memcpy(chunk_ids, rep.ids, n * sizeof(*chunk_ids));
    kvt__emsg_free(&rep);
    return rc;
}

int kvtier_complete_load(struct kvtier_client *c, const char *req_id, const struct kvtier_key *keys,
                         size_t n)
{
    struct kvt_emsg req;
    int rc = prep(c, &req, KVT_EOP_COMPLETE_LOAD, req_id, false, keys, n);

    if (rc < 0)
        return rc;
    req.has |= 1u << KVT_EF_KEYS;
    return simple_call(c, &req);
}

int kvtier_touch(struct kvtier_client *c, const char *req_id, const struct kvtier_key *keys,
                 size_t n)
{
    struct kvt_emsg req;
    int rc = prep(c, &req, KVT_EOP_TOUCH, req_id, false, keys, n);

    if (rc < 0)
        return rc;
    req.has |= 1u << KVT_EF_KEYS;
    return simple_call(c, &req);
}

static int copy_ids(struct kvtier_client *c, const char *const *ids, size_t n,
                    kvt_eproto_id_t **out_p)
{
    kvt_eproto_id_t *out;

    if (n > c->lim.max_keys)
        return -EMSGSIZE;
    if (n > 0 && ids == NULL)
        return -EINVAL;
    out = kvt_calloc(n ? n : 1, sizeof(*out));
    if (out == NULL)
        return -ENOMEM;
    for (size_t i = 0; i < n; i++) {
        size_t len = ids[i] != NULL ? strlen(ids[i]) : 0;

        if (len < 1 || len > KVTIER_REQ_ID_MAX) {
            kvt_free(out);
            return -EINVAL;
        }
        memcpy(out[i], ids[i], len + 1);
    }
    *out_p = out;
    return 0;
}

int kvtier_on_schedule_end(struct kvtier_client *c, const char *const *new_req_ids, size_t n_new,
                           const char *const *preempted_req_ids, size_t n_preempted)
{
    struct kvt_emsg req;
    kvt_eproto_id_t *a = NULL, *b = NULL;
    int rc;

    kvt__emsg_init(&req);
    req.op = KVT_EOP_SCHEDULE_END;
    rc = copy_ids(c, new_req_ids, n_new, &a);
    if (rc == 0)
        rc = copy_ids(c, preempted_req_ids, n_preempted, &b);
    if (rc == 0) {
        req.new_ids = a;
        req.n_new = (uint32_t)n_new;
        req.preempted = b;
        req.n_preempted = (uint32_t)n_preempted;
        req.has |= 1u << KVT_EF_NEW | 1u << KVT_EF_PREEMPTED;
        rc = simple_call(c, &req);
    }
    kvt_free(a);
    kvt_free(b);
    return rc;
}

int kvtier_take_events(struct kvtier_client *c, struct kvtier_events **events_p)
{
    struct kvt_emsg req, rep;
    struct kvtier_events *out;
    int rc;

    if (events_p == NULL)
        return -EINVAL;
    kvt__emsg_init(&req);
    req.op = KVT_EOP_TAKE_EVENTS;
    rc = locked_call(c, &req, &rep);
    if (rc < 0)
        goto out;
    out = kvt_calloc(1, sizeof(*out));
    if (out == NULL) {
        rc = -ENOMEM;
        goto out;
    }
    /* The reply's arrays become the list's: events and their one key array. */
    out->ev = rep.events;
    out->n = rep.n_events;
    rep.events = NULL;
    if (out->n > 0) {
        out->ev[0].keys = rep.heap; /* event 0's keys start the array */
        rep.heap = NULL;
    }
    *events_p = out;
out:
    kvt__emsg_free(&rep);
    return rc;
}

void kvtier_events_free(struct kvtier_events *events)
{
    if (events == NULL)
        return;
    if (events->n > 0)
        kvt_free(events->ev[0].keys);
    kvt_free(events->ev);
    kvt_free(events);
}

static int get_stats(struct kvtier_client *c, uint64_t flags, struct kvtier_stats **stats_p)
{
    struct kvt_emsg req, rep;
    struct kvtier_stats *out;
    int rc;

    if (stats_p == NULL)
        return -EINVAL;
    kvt__emsg_init(&req);
    req.op = KVT_EOP_GET_STATS;
    if (flags != 0) {
        req.flags = flags;
        req.has |= 1u << KVT_EF_FLAGS;
    }
    rc = locked_call(c, &req, &rep);
    if (rc < 0)
        goto out;
    out = kvt_calloc(1, sizeof(*out));
    if (out == NULL) {
        rc = -ENOMEM;
        goto out;
    }
    out->s = rep.stats;
    out->n = rep.n_stats;
    rep.stats = NULL;
    memcpy(out->bounds, rep.bounds, sizeof(out->bounds));
    if (kvt__emsg_has(&rep, KVT_EF_STAT_BOUNDS)) {
        out->stat_bounds = rep.stat_bounds;
        rep.stat_bounds = NULL;
    } else {
        /* A node that sends no bounds of each histogram's own: the common ones, whose
         * last stands for +Inf. */
        out->stat_bounds = kvt_calloc(out->n ? out->n : 1, sizeof(*out->stat_bounds));
        if (out->stat_bounds == NULL) {
            kvtier_stats_free(out);
            rc = -ENOMEM;
            goto out;
        }
        for (size_t i = 0; rep.n_bounds > 0 && i < out->n; i++) {
            if (out->s[i].kind != KVTIER_HISTOGRAM)
                continue;
            out->stat_bounds[i].n = rep.n_bounds - 1;
            memcpy(out->stat_bounds[i].bound, rep.bounds,
                   (rep.n_bounds - 1) * sizeof(rep.bounds[0]));
        }
    }
    *stats_p = out;
out:
    kvt__emsg_free(&rep);
    return rc;
}

int kvtier_get_stats(struct kvtier_client *c, struct kvtier_stats **stats_p)
{
    return get_stats(c, 0, stats_p);
}

int kvtier_get_stats_totals(struct kvtier_client *c, struct kvtier_stats **stats_p)
{
    return get_stats(c, KVT_ESTATS_TOTALS, stats_p);
}

void kvtier_stats_free(struct kvtier_stats *stats)
{
    if (stats == NULL)
        return;
    kvt_free(stats->s);
    kvt_free(stats->stat_bounds);
    kvt_free(stats);
}

double kvtier_stats_value(const struct kvtier_stats *stats, const char *name, const char *label)
{
    if (stats == NULL || name == NULL)
        return 0;
    if (label == NULL)
        label = "";
    for (size_t i = 0; i < stats->n; i++) {
        const struct kvtier_stat *s = &stats->s[i];

        if (strcmp(s->name, name) == 0 && strcmp(s->label, label) == 0)
            return s->kind == KVTIER_HISTOGRAM ? (double)s->count : s->value;
    }
    return 0;
}

/* ---- reset, pending work, peers (minor 1) ---------------------------------------------- */

int kvtier_reset(struct kvtier_client *c)
{
    struct kvt_emsg req;

    if (c->node_minor < 1)
        return -EOPNOTSUPP;
    kvt__emsg_init(&req);
    req.op = KVT_EOP_RESET;
    return simple_call(c, &req);
}

int kvtier_has_pending_work(struct kvtier_client *c, bool *pending_p)
{
    struct kvt_emsg req, rep;
    int rc;

    if (pending_p == NULL)
        return -EINVAL;
    if (c->node_minor < 1)
        return -EOPNOTSUPP;
    kvt__emsg_init(&req);
    req.op = KVT_EOP_PENDING;
    rc = locked_call(c, &req, &rep);
    if (rc == 0)
        *pending_p = (rep.flags & (KVT_EPENDING_NODE | KVT_EPENDING_CLIENT)) != 0;
    kvt__emsg_free(&rep);
    return rc;
}

int kvtier_get_peers(struct kvtier_client *c, struct kvtier_peers **peers_p)
{
    struct kvt_emsg req, rep;
    struct kvtier_peers *out;
    int rc;

    if (peers_p == NULL)
        return -EINVAL;
    if (c->node_minor < 1)
        return -EOPNOTSUPP;
    kvt__emsg_init(&req);
    req.op = KVT_EOP_PEERS;
    rc = locked_call(c, &req, &rep);
    if (rc < 0)
        goto out;
    out = kvt_calloc(1, sizeof(*out));
    if (out == NULL) {
        rc = -ENOMEM;
        goto out;
    }
    out->p = rep.peers;
    out->n = rep.n_peers;
    rep.peers = NULL;
    *peers_p = out;
out:
    kvt__emsg_free(&rep);
    return rc;
}

void kvtier_peers_free(struct kvtier_peers *peers)
{
    if (peers == NULL)
        return;
    kvt_free(peers->p);
    kvt_free(peers);
}

/* ---- an engine's own region and jobs ------------------------------------------------ */

int kvtier_attach_region(struct kvtier_client *c, int fd, uint64_t offset, size_t rows,
                         size_t stride, size_t *node_row_bytes_p)
{
    struct kvt_emsg req, rep;
    int rc;

    if (fd < 0 || rows == 0 || stride == 0 || rows > SIZE_MAX / stride)
        return -EINVAL;
    kvt__emsg_init(&req);
    req.op = KVT_EOP_ATTACH;
    req.geom[KVT_EA_ROWS] = rows;
    req.geom[KVT_EA_STRIDE] = stride;
    req.geom[KVT_EA_SIZE] = (uint64_t)rows * stride;
    req.geom[KVT_EA_OFFSET] = offset;
    req.n_geom = KVT_EA_COUNT;
    req.has |= 1u << KVT_EF_GEOM;
    pthread_mutex_lock(&c->lock);
    rc = call_fd(c, &req, &rep, NULL, fd);
    pthread_mutex_unlock(&c->lock);
    if (rc == 0 && node_row_bytes_p != NULL)
        *node_row_bytes_p = rep.n_geom > KVT_EG_ROW_BYTES ? rep.geom[KVT_EG_ROW_BYTES] : 0;
    kvt__emsg_free(&rep);
    return rc;
}

int kvtier_jobs_step(struct kvtier_client *c, const struct kvtier_key *lookup, size_t n_lookup,
                     uint8_t *verdicts, const struct kvtier_job *jobs, size_t n_jobs,
                     struct kvtier_jobs_done **done_p)
{
    struct kvt_emsg req, rep;
    struct kvtier_jobs_done *out = NULL;
    size_t n_keys = 0, off = 0;
    int rc;

    if (done_p == NULL || (n_lookup > 0 && (lookup == NULL || verdicts == NULL)) ||
        (n_jobs > 0 && jobs == NULL))
        return -EINVAL;
    for (size_t i = 0; i < n_jobs; i++) {
        if ((jobs[i].kind != KVTIER_JOB_STORE && jobs[i].kind != KVTIER_JOB_LOAD) ||
            (jobs[i].n > 0 && (jobs[i].keys == NULL || jobs[i].rows == NULL)))
            return -EINVAL;
        n_keys += jobs[i].n;
    }
    if (n_lookup > c->lim.max_keys || n_keys > c->lim.max_keys || n_jobs > c->lim.max_keys)
        return -EMSGSIZE;
    kvt__emsg_init(&req);
    req.op = KVT_EOP_JOBS;
    req.keys = (struct kvtier_key *)lookup;
    req.n_keys = (uint32_t)n_lookup;
    req.has |= 1u << KVT_EF_KEYS;
    req.job_keys = kvt_calloc(n_keys ? n_keys : 1, sizeof(*req.job_keys));
    req.ids = kvt_calloc(n_keys ? n_keys : 1, sizeof(*req.ids));
    req.jobs = kvt_calloc(n_jobs ? n_jobs * 3 : 1, sizeof(*req.jobs));
    if (req.job_keys == NULL || req.ids == NULL || req.jobs == NULL) {
        rc = -ENOMEM;
        goto out;
    }
    for (size_t i = 0; i < n_jobs; i++) {
        if (jobs[i].n > 0) {
            memcpy(req.job_keys + off, jobs[i].keys, jobs[i].n * sizeof(*req.job_keys));
            memcpy(req.ids + off, jobs[i].rows, jobs[i].n * sizeof(*req.ids));
        }
        off += jobs[i].n;
        req.jobs[3 * i] = jobs[i].id;
        req.jobs[3 * i + 1] = (uint64_t)jobs[i].kind;
        req.jobs[3 * i + 2] = jobs[i].n;
    }
    req.n_job_keys = req.n_ids = (uint32_t)n_keys;
    req.n_jobs = (uint32_t)(n_jobs * 3);
    req.has |= 1u << KVT_EF_JOB_KEYS | 1u << KVT_EF_IDS | 1u << KVT_EF_JOBS;
    rc = locked_call(c, &req, &rep);
    if (rc < 0)
        goto out;
    /* What the node reports must add up; else the stream is not to be trusted. */
    size_t ok_total = 0;
    if (rep.n_results != n_lookup || rep.n_jobs % 3 != 0) {
        rc = -EPROTO;
        goto out_rep;
    }
    for (uint32_t t = 0; t < rep.n_jobs; t += 3)
        ok_total += rep.jobs[t + 2];
    if (ok_total != rep.n_ok) {
        rc = -EPROTO;
        goto out_rep;
    }
    out = kvt_calloc(1, sizeof(*out) + rep.n_ok);
    if (out != NULL)
        out->job = kvt_calloc(rep.n_jobs ? rep.n_jobs / 3 : 1, sizeof(*out->job));
    if (out == NULL || out->job == NULL) {
        kvt_free(out);
        rc = -ENOMEM; /* (those jobs are lost to the caller, which times them out) */
        goto out_rep;
    }
    uint8_t *okp = (uint8_t *)(out + 1);
    if (rep.n_ok > 0)
        memcpy(okp, rep.ok, rep.n_ok);
    for (uint32_t t = 0; t < rep.n_jobs; t += 3) {
        struct kvtier_job_done *d = &out->job[out->n++];

        d->id = rep.jobs[t];
        d->ok = rep.jobs[t + 1] == KVT_EJ_OK;
        d->n = rep.jobs[t + 2];
        d->key_ok = okp;
        okp += d->n;
    }
    if (n_lookup > 0)
        memcpy(verdicts, rep.results, n_lookup);
    *done_p = out;
out_rep:
    kvt__emsg_free(&rep);
out:
    req.keys = NULL; /* the caller's */
    kvt__emsg_free(&req);
    return rc;
}

void kvtier_jobs_done_free(struct kvtier_jobs_done *done)
{
    if (done == NULL)
        return;
    kvt_free(done->job);
    kvt_free(done);
}

/* ---- packed keys ------------------------------------------------------------------- */

/* Keys of one length back to back, unpacked into struct kvtier_key: on the stack for
 * the common short call, else on the heap (*heap_p, freed by the caller). */

static int unpack(const void *keys, size_t key_len, size_t n, struct kvtier_key *stack,
                  struct kvtier_key **out_p, struct kvtier_key **heap_p)
{
    const uint8_t *p = keys;
    struct kvtier_key *out = stack;

    *heap_p = NULL;
    if ((n > 0 && keys == NULL) || key_len < 1 || key_len > KVTIER_KEY_MAX)
        return -EINVAL;
    if (n > PACKED_STACK_KEYS) {
        if (n > SIZE_MAX / sizeof(*out))
            return -EMSGSIZE;
        out = kvt_malloc(n * sizeof(*out));
        if (out == NULL)
            return -ENOMEM;
        *heap_p = out;
    }
    for (size_t i = 0; i < n; i++) {
        out[i].len = (uint8_t)key_len;
        memcpy(out[i].bytes, p + i * key_len, key_len);
        memset(out[i].bytes + key_len, 0, KVTIER_KEY_MAX - key_len);
    }
    *out_p = out;
    return 0;
}

int kvtier_lookup_packed(struct kvtier_client *c, const char *req_id, const void *keys,
                         size_t key_len, size_t n, unsigned flags, uint8_t *results,
                         size_t *n_done_p)
{
    struct kvtier_key stack[PACKED_STACK_KEYS], *k, *heap;
    int rc;

    if (c->bin && req_id != NULL && results != NULL && (flags & ~KVTIER_LOOKUP_PREFIX) == 0) {
        struct bin_keys bk = {.packed = keys, .key_len = key_len, .n = n};

        rc = bin_lookup(c, req_id, &bk, flags, results, n_done_p);
        if (rc != 1)
            return rc;
    }
    rc = unpack(keys, key_len, n, stack, &k, &heap);
    if (rc == 0)
        rc = kvtier_lookup(c, req_id, k, n, flags, results, n_done_p);
    kvt_free(heap);
    return rc;
}

int kvtier_lookup_one(struct kvtier_client *c, const char *req_id, const void *key, size_t key_len)
{
    uint8_t res = 0;
    size_t done = 0;
    int rc = kvtier_lookup_packed(c, req_id, key, key_len, 1, 0, &res, &done);

    if (rc == 0 && done != 1)
        rc = -EPROTO;
    return rc < 0 ? rc : (int)res;
}

int kvtier_prepare_store_packed(struct kvtier_client *c, const char *req_id, const void *keys,
                                size_t key_len, size_t n, uint32_t *store_index, int64_t *chunk_ids,
                                size_t *n_store_p, void *evicted, size_t evicted_cap,
                                size_t *n_evicted_p, size_t *evicted_bytes_p)
{
    struct kvtier_key stack[PACKED_STACK_KEYS], *k, *heap, ev_stack[PACKED_STACK_KEYS];
    struct kvtier_key *ev = ev_stack, *ev_heap = NULL;
    /* each takes at least a length byte and one key byte; a call evicts at most one
     * key per key it stores */
    size_t cap_ev = KVT_MIN(evicted_cap / 2, n);
    struct kvtier_store_plan plan = {.store_index = store_index, .chunk_ids = chunk_ids};
    int rc;

    if (n_store_p == NULL || n_evicted_p == NULL || (evicted_cap > 0 && evicted == NULL))
        return -EINVAL;
    rc = unpack(keys, key_len, n, stack, &k, &heap);
    if (rc < 0)
        return rc;
    if (cap_ev > PACKED_STACK_KEYS) {
        ev = ev_heap = kvt_calloc(cap_ev, sizeof(*ev));
        if (ev == NULL) {
            kvt_free(heap);
            return -ENOMEM;
        }
    }
    plan.evicted = ev;
    plan.cap_evicted = cap_ev;
    rc = kvtier_prepare_store(c, req_id, k, n, &plan);
    if (rc == 0) {
        uint8_t *out = evicted;
        size_t off = 0, shown = KVT_MIN(plan.n_evicted, cap_ev);

        for (size_t i = 0; i < shown && off + 1 + ev[i].len <= evicted_cap; i++) {
            out[off] = ev[i].len;
            memcpy(out + off + 1, ev[i].bytes, ev[i].len);
            off += 1 + (size_t)ev[i].len;
        }
        *n_store_p = plan.n_store;
        *n_evicted_p = plan.n_evicted;
        if (evicted_bytes_p != NULL)
            *evicted_bytes_p = off;
    }
    kvt_free(ev_heap);
    kvt_free(heap);
    return rc;
}

/* A call of packed keys whose reply is only an rc (complete_store, complete_load,
 * touch): binary when bin allows (bin_simple answers 1 when it is not made), else
 * the keys unpacked into the frame call's. */
static int packed_simple(struct kvtier_client *c, unsigned op, const char *req_id, const void *keys,
                         size_t key_len, size_t n, bool bin, bool success)
{
    struct kvtier_key stack[PACKED_STACK_KEYS], *k, *heap;
    int rc;

    if (bin && c->bin) {
        struct bin_keys bk = {.packed = keys, .key_len = key_len, .n = n};

        rc = bin_simple(c, op, req_id, &bk, success);
        if (rc != 1)
            return rc;
    }
    rc = unpack(keys, key_len, n, stack, &k, &heap);
    if (rc == 0) {
        if (op == KVT_EOP_COMPLETE_STORE)
            rc = kvtier_complete_store(c, req_id, k, n, success);
        else if (op == KVT_EOP_COMPLETE_LOAD)
            rc = kvtier_complete_load(c, req_id, k, n);
        else
            rc = kvtier_touch(c, req_id, k, n);
    }
    kvt_free(heap);
    return rc;
}

int kvtier_complete_store_packed(struct kvtier_client *c, const char *req_id, const void *keys,
                                 size_t key_len, size_t n, bool success)
{
    return packed_simple(c, KVT_EOP_COMPLETE_STORE, req_id, keys, key_len, n, req_id != NULL,
                         success);
}

int kvtier_prepare_load_packed(struct kvtier_client *c, const char *req_id, const void *keys,
                               size_t key_len, size_t n, int64_t *chunk_ids)
{
    struct kvtier_key stack[PACKED_STACK_KEYS], *k, *heap;
    int rc;

    if (c->bin && chunk_ids != NULL) {
        struct bin_keys bk = {.packed = keys, .key_len = key_len, .n = n};

        rc = bin_prepare_load(c, req_id, &bk, chunk_ids);
        if (rc != 1)
            return rc;
    }
    rc = unpack(keys, key_len, n, stack, &k, &heap);
    if (rc == 0)
        rc = kvtier_prepare_load(c, req_id, k, n, chunk_ids);
    kvt_free(heap);
    return rc;
}

int kvtier_complete_load_packed(struct kvtier_client *c, const char *req_id, const void *keys,
                                size_t key_len, size_t n)
{
    return packed_simple(c, KVT_EOP_COMPLETE_LOAD, req_id, keys, key_len, n, true, false);
}

int kvtier_touch_packed(struct kvtier_client *c, const char *req_id, const void *keys,
                        size_t key_len, size_t n)
{
    return packed_simple(c, KVT_EOP_TOUCH, req_id, keys, key_len, n, true, false);
}

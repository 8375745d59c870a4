/* The node's side of an engine's shared-memory ring (protocol and layout in
 * kvtier/engine_ring.h, contract in engine_ring_int.h).
 *
 * The memfd is the node's: created here, sized, sealed against growing and
 * shrinking (so an engine cannot truncate it under the node's mapping and make the
 * node fault), mapped, and passed to the engine with HELLO's reply. Everything the
 * engine may write is read once (an atomic load of a counter, an 8-byte load of a
 * record header), checked against the node's own copies of the counters and
 * sizes, and a request body is copied into this ring's private buffer before
 * anyone decodes it: what the engine scribbles afterwards cannot change what the
 * node is working on. A check that fails is the engine's fault and only closes its
 * own connection (the caller's business, -EPROTO here).
 *
 * One request at a time: take copies one out and advances req_tail at once (the
 * engine may reuse the space), the caller executes it, reply publishes the answer.
 * take refuses to start a request unless the reply ring has room for at least a
 * REDIRECT record, so every request taken gets its reply record. */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/futex.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "kvt/alloc.h"
#include "kvt/log.h"
#include "kvtier/engine_ring.h"
#include "engine_ring_int.h"

#define MOD "engine_ring"

/* Loop thread only. ctl and the data areas are shared with the engine: only the
 * node-written fields are stored to, and engine-written ones are loaded once. */
struct kvt_ering {
    int memfd;
    int evfd;
    uint8_t *map;
    size_t map_bytes;
    struct kvt_ering_ctl *ctl;
    uint8_t *req, *rep; /* the two data areas */
    uint64_t cap;       /* bytes of each area, a power of two */
    /* the node's own copies */
    uint64_t req_tail, rep_head;
    uint32_t req_seq; /* sequence number of the last request taken */
    uint32_t rep_seq;
    bool taken; /* a request was taken and awaits its reply */
    bool closed;
    uint8_t *in; /* the request taken, copied out (cap / 2 bytes) */
};

static uint64_t pow2_at_least(uint64_t v)
{
    uint64_t p = 1;

    while (p < v)
        p <<= 1;
    return p;
}

int kvt__ering_create(size_t cap, struct kvt_ering **ring_p)
{
    long page = sysconf(_SC_PAGESIZE);
    struct kvt_ering *r;
    int rc;

    if (cap > (1ull << 30))
        return -EINVAL;
    r = kvt_calloc(1, sizeof(*r));
    if (r == NULL)
        return -ENOMEM;
    r->memfd = r->evfd = -1;
    r->cap = pow2_at_least(cap < (size_t)page ? (size_t)page : cap);
    r->map_bytes = KVT_ERING_CTL_BYTES + 2 * r->cap;
    r->in = kvt_malloc(r->cap / 2);
    if (r->in == NULL) {
        rc = -ENOMEM;
        goto err;
    }
    r->memfd = memfd_create("kvtier-engine-ring", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (r->memfd < 0 || ftruncate(r->memfd, (off_t)r->map_bytes) != 0 ||
        fcntl(r->memfd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
        rc = -errno;
        goto err;
    }
    r->map = mmap(NULL, r->map_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, r->memfd, 0);
    if (r->map == MAP_FAILED) {
        r->map = NULL;
        rc = -errno;
        goto err;
    }
    r->evfd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (r->evfd < 0) {
        rc = -errno;
        goto err;
    }
    r->ctl = (struct kvt_ering_ctl *)r->map;
    r->req = r->map + KVT_ERING_CTL_BYTES;
    r->rep = r->req + r->cap;
    r->ctl->version = KVT_ERING_VERSION;
    r->ctl->ctl_bytes = KVT_ERING_CTL_BYTES;
    r->ctl->req_off = KVT_ERING_CTL_BYTES;
    r->ctl->req_cap = r->cap;
    r->ctl->rep_off = KVT_ERING_CTL_BYTES + r->cap;
    r->ctl->rep_cap = r->cap;
    /* Until the loop says it polls, engines wake it after every request. */
    r->ctl->node_sleeping = 1;
    __atomic_store_n(&r->ctl->magic, KVT_ERING_MAGIC, __ATOMIC_RELEASE);
    *ring_p = r;
    return 0;

err:
    if (rc == -ENOMEM || rc == -EMFILE || rc == -ENFILE)
        kvt_warn(MOD, "cannot make an engine ring: %s", strerror(-rc));
    kvt__ering_destroy(r);
    return rc;
}

void kvt__ering_destroy(struct kvt_ering *r)
{
    if (r == NULL)
        return;
    if (r->map != NULL)
        munmap(r->map, r->map_bytes);
    if (r->memfd >= 0)
        close(r->memfd);
    if (r->evfd >= 0)
        close(r->evfd);
    kvt_free(r->in);
    kvt_free(r);
}

int kvt__ering_memfd(const struct kvt_ering *r)
{
    return r->memfd;
}

int kvt__ering_eventfd(const struct kvt_ering *r)
{
    return r->evfd;
}

/* Free bytes of the reply ring, from the engine's rep_tail: -EPROTO when that
 * counter is behind what it already consumed or ahead of what was published. */
static int rep_free(struct kvt_ering *r, uint64_t *free_p)
{
    uint64_t tail = __atomic_load_n(&r->ctl->rep_tail, __ATOMIC_ACQUIRE);
    uint64_t used = r->rep_head - tail;

    if (used > r->cap || (tail & 7) != 0)
        return -EPROTO;
    *free_p = r->cap - used;
    return 0;
}

static struct kvt_ering_rec load_rec(const uint8_t *p)
{
    uint64_t v = __atomic_load_n((const uint64_t *)(const void *)p, __ATOMIC_RELAXED);
    struct kvt_ering_rec h;

    memcpy(&h, &v, sizeof(h));
    return h;
}

static void store_rec(uint8_t *p, uint32_t len, uint32_t seq)
{
    struct kvt_ering_rec h = {.len = len, .seq = seq};
    uint64_t v;

    memcpy(&v, &h, sizeof(v));
    __atomic_store_n((uint64_t *)(void *)p, v, __ATOMIC_RELAXED);
}

bool kvt__ering_pending(const struct kvt_ering *r)
{
    uint64_t head, tail;

    if (r->closed)
        return false;
    head = __atomic_load_n(&r->ctl->req_head, __ATOMIC_ACQUIRE);
    tail = __atomic_load_n(&r->ctl->rep_tail, __ATOMIC_RELAXED);
    /* A request that must wait for the engine to read its replies is not work: the
     * loop may sleep (an engine that reads replies without asking anything is not
     * one the library makes; the loop's tick serves it). */
    /* (A rep_tail that does not add up is work too: take refuses the engine.) */
    return head != r->req_tail &&
           (r->rep_head - tail > r->cap || r->rep_head - tail + KVT_ERING_REC_BYTES <= r->cap);
}

int kvt__ering_take(struct kvt_ering *r, uint32_t max_body, const uint8_t **body_p, size_t *len_p)
{
    uint64_t head, free;
    bool padded = false;
    int rc;

    if (r->closed || r->taken)
        return 0;
    head = __atomic_load_n(&r->ctl->req_head, __ATOMIC_ACQUIRE);
    for (;;) {
        uint64_t avail = head - r->req_tail, off, need;
        struct kvt_ering_rec h;

        if (avail == 0)
            return 0;
        if (avail > r->cap || (avail & 7) != 0)
            return -EPROTO;
        rc = rep_free(r, &free);
        if (rc < 0)
            return rc;
        if (free < KVT_ERING_REC_BYTES)
            return -EAGAIN;
        off = r->req_tail & (r->cap - 1);
        h = load_rec(r->req + off);
        if (h.len == KVT_ERING_PAD) {
            if (padded || r->cap - off > avail)
                return -EPROTO;
            padded = true;
            r->req_tail += r->cap - off;
            continue;
        }
        if (h.len > max_body || h.len > KVT_ERING_LEN_MAX)
            return -EPROTO;
        need = kvt_ering_rec_bytes(h.len);
        if (need > r->cap / 2 || need > avail || off + need > r->cap || h.seq != r->req_seq + 1)
            return -EPROTO;
        memcpy(r->in, r->req + off + KVT_ERING_REC_BYTES, h.len);
        r->req_tail += need;
        r->req_seq++;
        r->taken = true;
        __atomic_store_n(&r->ctl->req_tail, r->req_tail, __ATOMIC_RELEASE);
        *body_p = r->in;
        *len_p = h.len;
        return 1;
    }
}

static void futex_wake(uint32_t *addr)
{
    syscall(SYS_futex, addr, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

/* Bumps rep_seq and wakes the engine if it futex-waits on it. */
static void notify(struct kvt_ering *r)
{
    __atomic_store_n(&r->ctl->rep_seq, ++r->rep_seq, __ATOMIC_RELEASE);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    if (__atomic_load_n(&r->ctl->client_waiting, __ATOMIC_RELAXED) != 0)
        futex_wake(&r->ctl->rep_seq);
}

int kvt__ering_reply(struct kvt_ering *r, const uint8_t *body, size_t len)
{
    uint64_t free, need = kvt_ering_rec_bytes(len), off = r->rep_head & (r->cap - 1);
    uint64_t to_end = r->cap - off;
    bool fits;
    int rc = rep_free(r, &free);

    if (!r->taken)
        return -EINVAL;
    r->taken = false;
    if (rc < 0)
        return rc;
    if (free < KVT_ERING_REC_BYTES)
        return -EPROTO; /* take saw room for a marker: the engine took it back */
    fits = len <= KVT_ERING_LEN_MAX && need <= r->cap / 2 &&
           (to_end >= need ? need <= free : to_end + need <= free);
    if (!fits) {
        store_rec(r->rep + off, KVT_ERING_REDIRECT, r->req_seq);
        r->rep_head += KVT_ERING_REC_BYTES;
    } else {
        if (to_end < need) {
            store_rec(r->rep + off, KVT_ERING_PAD, r->req_seq);
            r->rep_head += to_end;
            off = 0;
        }
        memcpy(r->rep + off + KVT_ERING_REC_BYTES, body, len);
        store_rec(r->rep + off, (uint32_t)len, r->req_seq);
        r->rep_head += need;
    }
    __atomic_store_n(&r->ctl->rep_head, r->rep_head, __ATOMIC_RELEASE);
    notify(r);
    return fits ? 0 : 1;
}

void kvt__ering_set_sleeping(struct kvt_ering *r, bool sleeping)
{
    __atomic_store_n(&r->ctl->node_sleeping, sleeping ? 1u : 0u, __ATOMIC_RELAXED);
}

void kvt__ering_drain_wake(struct kvt_ering *r)
{
    uint64_t v;

    while (read(r->evfd, &v, sizeof(v)) == (ssize_t)sizeof(v)) {
    }
}

void kvt__ering_close(struct kvt_ering *r)
{
    if (r->closed)
        return;
    r->closed = true;
    __atomic_store_n(&r->ctl->closed, 1u, __ATOMIC_RELEASE);
    notify(r);
}

bool kvt__ering_closed(const struct kvt_ering *r)
{
    return r->closed;
}

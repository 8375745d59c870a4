/* SPDX-License-Identifier: Apache-2.0 */
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
#include "kvt/common.h"
#include "kvt/log.h"
#include "kvtier/engine_ring.h"
#include "engine_ring_int.h"

#define MOD "engine_ring"

/* The engine writes the shared memory whenever it likes, also between two of the
 * node's loads. The fuzz target tests/fuzz/fuzz_ering.c compiles this file with
 * KVT_ERING_FUZZ and plays the engine in kvt__ering_fuzz_load, which runs before
 * every load of memory the engine writes (p: what is loaded). Nothing otherwise. */
#ifdef KVT_ERING_FUZZ
void kvt__ering_fuzz_load(const void *p);
#define ENGINE_MAY_WRITE(p) kvt__ering_fuzz_load(p)
#else
#define ENGINE_MAY_WRITE(p) ((void)0)
#endif
/* A marker record (REDIRECT, CLOSED) takes one line. */
#define MARK_BYTES KVT_ERING_ALIGN

/* Loop thread only. ctl and the data areas are shared with the engine: only the
 * node-written fields and the reply area are stored to, and what the engine writes
 * is loaded once and checked. */
struct kvt_ering {
    int memfd;
    int evfd;
    uint8_t *map;
    size_t map_bytes;
    struct kvt_ering_ctl *ctl;
    uint8_t *req, *rep; /* the two data areas */
    uint64_t cap;       /* bytes of each area, a power of two */
    /* the node's own copies */
    uint64_t req_tail;  /* request bytes taken */
    uint64_t rep_head;  /* reply bytes published */
    uint64_t rep_acked; /* reply bytes the engine said it consumed (the later of:) */
    uint64_t hdr_ack;   /* the last ack in a request's header */
    uint64_t ctl_ack;   /* the last rep_tail read from the control page */
    uint32_t req_seq;   /* sequence number of the last request taken */
    bool taken;         /* a request was taken and awaits its reply */
    bool closed;
    uint8_t *in;     /* the request taken, copied out (cap / 2 bytes) */
    const char *why; /* the check the engine failed (-EPROTO), or NULL */
};

/* -EPROTO, saying which check failed (kvt__ering_why: the node's log says it). */
static int broken(struct kvt_ering *r, const char *why)
{
    r->why = why;
    return -EPROTO;
}

const char *kvt__ering_why(const struct kvt_ering *r)
{
    return r->why != NULL ? r->why : "no check failed";
}

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

/* The header word (len, seq) at p, loaded with acquire: the body and ack it
 * publishes are visible after it. */
static void load_head(const uint8_t *p, uint32_t *len_p, uint32_t *seq_p)
{
    uint64_t v;
    struct kvt_ering_rec h;

    ENGINE_MAY_WRITE(p);
    v = __atomic_load_n((const uint64_t *)(const void *)p, __ATOMIC_ACQUIRE);
    memcpy(&h, &v, sizeof(v));
    *len_p = h.len;
    *seq_p = h.seq;
}

static uint64_t load_ack(const uint8_t *p)
{
    ENGINE_MAY_WRITE(p + 8);
    return __atomic_load_n((const uint64_t *)(const void *)(p + 8), __ATOMIC_RELAXED);
}

/* Publishes a record's header at p: ack first, then len and seq (release). */
static void store_head(uint8_t *p, uint32_t len, uint32_t seq, uint64_t ack)
{
    struct kvt_ering_rec h = {.len = len, .seq = seq};
    uint64_t v;

    __atomic_store_n((uint64_t *)(void *)(p + 8), ack, __ATOMIC_RELAXED);
    memcpy(&v, &h, sizeof(v));
    __atomic_store_n((uint64_t *)(void *)p, v, __ATOMIC_RELEASE);
}

/* Takes an ack of the engine (reply bytes it consumed) from one of its two
 * channels (*last: request headers or rep_tail): -EPROTO unless it lies between
 * what that channel said before and what was published. The channels are read at
 * different times: a request posted earlier carries an older ack than rep_tail
 * may already say, so each goes forward on its own and the later one counts. */
static int see_ack(struct kvt_ering *r, uint64_t ack, uint64_t *last)
{
    if ((ack & (KVT_ERING_ALIGN - 1)) != 0 || ack - *last > r->rep_head - *last)
        return broken(r, last == &r->hdr_ack ? "a request's ack outside its window"
                                             : "rep_tail outside its window");
    *last = ack;
    if (r->rep_head - ack < r->rep_head - r->rep_acked)
        r->rep_acked = ack;
    return 0;
}

/* Free bytes of the reply ring; when the acks say it is (nearly) full, the
 * engine's rep_tail is consulted too. */
static int rep_free(struct kvt_ering *r, uint64_t need, uint64_t *free_p)
{
    uint64_t free = r->cap - (r->rep_head - r->rep_acked);

    if (free < need) {
        int rc;

        ENGINE_MAY_WRITE(&r->ctl->rep_tail);
        rc = see_ack(r, __atomic_load_n(&r->ctl->rep_tail, __ATOMIC_ACQUIRE), &r->ctl_ack);
        if (rc < 0)
            return rc;
        free = r->cap - (r->rep_head - r->rep_acked);
    }
    *free_p = free;
    return 0;
}

/* Where the next request is due: its slot, after a PAD if there is one. 1 a
 * record with the expected sequence number is there (*off_p, *len_p), 0 not yet,
 * -EPROTO a PAD that leads nowhere. */
static int peek(struct kvt_ering *r, uint64_t *off_p, uint64_t *skip_p, uint32_t *len_p)
{
    uint64_t off = r->req_tail & (r->cap - 1), skip = 0;
    uint32_t len, seq, want = r->req_seq + 1;

    /* A request of more than a line (a 1-key lookup's is two): its second line is
     * fetched while the first is polled, not after the header was seen. */
    __builtin_prefetch(r->req + ((off + KVT_ERING_ALIGN) & (r->cap - 1)));
    load_head(r->req + off, &len, &seq);
    if (seq != want)
        return 0;
    if (len == KVT_ERING_PAD) {
        if (off == 0)
            return broken(r, "a request PAD at the ring's start");
        skip = r->cap - off;
        off = 0;
        load_head(r->req, &len, &seq);
        /* the record is written before its PAD */
        if (seq != want || len == KVT_ERING_PAD)
            return broken(r, seq != want ? "a request PAD before its record"
                                         : "a request PAD after a PAD");
    }
    *off_p = off;
    *skip_p = skip;
    *len_p = len;
    return 1;
}

bool kvt__ering_pending(struct kvt_ering *r)
{
    uint64_t off, skip;
    uint32_t len;

    /* (A request that breaks the protocol is work too: take refuses the engine.) */
    return !r->closed && !r->taken && peek(r, &off, &skip, &len) != 0;
}

int kvt__ering_take(struct kvt_ering *r, uint32_t max_body, const uint8_t **body_p, size_t *len_p)
{
    uint64_t off, skip, need, free;
    uint32_t len;
    int rc;

    /* A ring the engine broke stays broken: the engine may have mended what failed
     * the check since, but the node's counters need not add up with it any more. */
    if (r->why != NULL)
        return -EPROTO;
    if (r->closed || r->taken)
        return 0;
    rc = peek(r, &off, &skip, &len);
    if (rc <= 0)
        return rc;
    need = kvt_ering_rec_bytes(len);
    if (len > max_body || len > KVT_ERING_LEN_MAX || need > r->cap / 2 || off + need > r->cap) {
        kvt_warn(MOD,
                 "request %u: %u bytes at %llu (+%llu skipped) of a %llu-byte ring, at most %u: "
                 "too long",
                 r->req_seq + 1, len, (unsigned long long)off, (unsigned long long)skip,
                 (unsigned long long)r->cap, max_body);
        return broken(r, "a request longer than the ring allows");
    }
    rc = see_ack(r, load_ack(r->req + off), &r->hdr_ack);
    if (rc < 0)
        return rc;
    /* Every request taken gets its reply record: room for a REDIRECT at least. */
    rc = rep_free(r, MARK_BYTES, &free);
    if (rc < 0)
        return rc;
    if (free < MARK_BYTES)
        return -EAGAIN;
    ENGINE_MAY_WRITE(r->req + off + KVT_ERING_REC_BYTES);
    kvt_ering_copy(r->in, r->req + off + KVT_ERING_REC_BYTES, len);
    r->req_tail += skip + need;
    r->req_seq++;
    r->taken = true;
    kvt_ering_scrub(r->req + off, len, r->req_seq);
    /* release: the copy and the scrub are done before the engine may reuse them */
    __atomic_store_n(&r->ctl->req_tail, r->req_tail, __ATOMIC_RELEASE);
    *body_p = r->in;
    *len_p = len;
    return 1;
}

static void futex_wake(const uint8_t *slot)
{
    /* the slot's seq word: the engine waits on it */
    syscall(SYS_futex, (const uint32_t *)(const void *)(slot + 4), FUTEX_WAKE, INT_MAX, NULL, NULL,
            0);
}

/* After a record was published at slot: wakes the engine if it sleeps on it. */
static void notify(struct kvt_ering *r, const uint8_t *slot)
{
    kvt_full_fence();
    ENGINE_MAY_WRITE(&r->ctl->client_waiting);
    if (__atomic_load_n(&r->ctl->client_waiting, __ATOMIC_RELAXED) != 0)
        futex_wake(slot);
}

/* The body's two pieces to p. */
static void put_body(uint8_t *p, const void *a, size_t a_len, const void *b, size_t b_len)
{
    kvt_ering_copy(p, a, a_len);
    kvt_ering_copy(p + a_len, b, b_len);
}

int kvt__ering_reply(struct kvt_ering *r, const uint8_t *body, size_t len)
{
    return kvt__ering_reply2(r, body, len, NULL, 0);
}

int kvt__ering_reply2(struct kvt_ering *r, const void *a, size_t a_len, const void *b, size_t b_len)
{
    size_t len = a_len + b_len;
    uint64_t free, need = kvt_ering_rec_bytes(len), off = r->rep_head & (r->cap - 1);
    uint64_t to_end = r->cap - off;
    uint8_t *slot = r->rep + off; /* where the engine waits */
    bool fits;
    int rc;

    if (!r->taken)
        return -EINVAL;
    r->taken = false;
    fits = len <= KVT_ERING_LEN_MAX && need <= r->cap / 2;
    rc = rep_free(r, fits ? (to_end >= need ? need : to_end + need) : MARK_BYTES, &free);
    if (rc < 0)
        return rc;
    if (free < MARK_BYTES)
        /* take saw room for a marker: the engine took it back */
        return broken(r, "reply room taken back");
    fits = fits && (to_end >= need ? need <= free : to_end + need <= free);
    if (!fits) {
        store_head(slot, KVT_ERING_REDIRECT, r->req_seq, r->req_tail);
        r->rep_head += MARK_BYTES;
    } else if (to_end < need) {
        /* The record at the start, then the PAD that leads there. */
        put_body(r->rep + KVT_ERING_REC_BYTES, a, a_len, b, b_len);
        store_head(r->rep, (uint32_t)len, r->req_seq, r->req_tail);
        store_head(slot, KVT_ERING_PAD, r->req_seq, r->req_tail);
        r->rep_head += to_end + need;
    } else {
        put_body(slot + KVT_ERING_REC_BYTES, a, a_len, b, b_len);
        store_head(slot, (uint32_t)len, r->req_seq, r->req_tail);
        r->rep_head += need;
    }
    notify(r, slot);
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
    uint64_t free, off = r->rep_head & (r->cap - 1);
    uint8_t *slot = r->rep + off;

    if (r->closed)
        return;
    r->closed = true;
    __atomic_store_n(&r->ctl->closed, 1u, __ATOMIC_RELEASE);
    /* Into the slot the engine waits on, when the engine left room there (it has,
     * unless it broke the protocol): it stops waiting at once. */
    if (rep_free(r, MARK_BYTES, &free) == 0 && free >= MARK_BYTES)
        store_head(slot, KVT_ERING_CLOSED, r->req_seq + (r->taken ? 0 : 1), r->req_tail);
    kvt_full_fence();
    futex_wake(slot);
}

bool kvt__ering_closed(const struct kvt_ering *r)
{
    return r->closed;
}

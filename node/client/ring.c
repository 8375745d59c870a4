/* SPDX-License-Identifier: Apache-2.0 */
/* libkvtier-client's side of the shared-memory ring (protocol and layout in
 * kvtier/engine_ring.h, contract in ring_int.h).
 *
 * A call writes its request record (body, ack, then the header word), and if the
 * node said it sleeps, writes the eventfd. It then waits for the reply record in
 * the slot where it is due: first spinning on the slot's seq word (a busy node
 * answers in about a microsecond), then futex-waiting on that word in slices,
 * looking at the socket between slices: a node that died or closed the connection
 * leaves an EOF or an ERROR frame there, and a node that closes the connection on
 * purpose also writes a CLOSED record into the slot and wakes it.
 *
 * A spin pays only while the node has a core of its own. A spin that lost its core
 * (two of its clock reads, a few microseconds of spinning apart, SPIN_LOST_NS
 * apart) says the host has none to spare: the node we wait for is then likely
 * waiting for ours, and the spin only delays it. Such a ring rests from spinning
 * for SPIN_REST_NS (futex-waits at once; counted: spin_rests), then tries again.
 *
 * The node is trusted to follow the protocol but checked anyway: acks that do not
 * add up or a record out of bounds give -EPROTO (the connection is then broken by
 * the caller), never a read outside the mapping. */
#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <poll.h>
#include <stdbool.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "kvt/alloc.h"
#include "kvt/common.h"
#include "kvtier/engine_ring.h"
#include "ring_int.h"

#define DEFAULT_SPIN_US 20
/* A futex wait lasts at most this long before the socket is looked at. */
#define SLICE_NS 20000000ull
/* Clock reads of a spin this far apart: it lost its core meanwhile. */
#define SPIN_LOST_NS 200000ull
/* Then no spinning for this long. */
#define SPIN_REST_NS 100000000ull

struct kvt_cring {
    uint8_t *map;
    size_t map_bytes;
    struct kvt_ering_ctl *ctl;
    uint8_t *req, *rep;
    uint64_t req_cap, rep_cap;
    int evfd;
    uint64_t spin_ns;
    uint64_t rest_until; /* no spinning before (a spin lost its core) */
    uint64_t req_head;   /* request bytes published */
    uint64_t req_acked;  /* of those, taken by the node (the later of:) */
    uint64_t hdr_ack;    /* the last ack in a reply's header */
    uint64_t ctl_ack;    /* the last req_tail read from the control page */
    uint64_t rep_tail;   /* reply bytes consumed */
    uint32_t seq;        /* of the last request posted */
    uint32_t rep_next;   /* of the next reply due */
    uint32_t res_len;    /* body bytes of the record reserved (kvt__cring_reserve) */
    struct kvt_cring_stats st;
    const char *why; /* the check that broke the ring (-EPROTO), or NULL */
};

/* -EPROTO, saying which check failed (kvt__cring_why; the client's error text). */
static int broken(struct kvt_cring *r, const char *why)
{
    r->why = why;
    return -EPROTO;
}

const char *kvt__cring_why(const struct kvt_cring *r)
{
    return r->why;
}

static uint64_t now_ns(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static inline void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static bool pow2(uint64_t v)
{
    return v != 0 && (v & (v - 1)) == 0;
}

int kvt__cring_open(int memfd, int evfd, struct kvt_cring **ring_p)
{
    struct kvt_cring *r;
    struct kvt_ering_ctl ctl;
    struct stat st;
    long page = sysconf(_SC_PAGESIZE);
    int rc;

    if (fstat(memfd, &st) != 0)
        return -errno;
    if ((uint64_t)st.st_size < KVT_ERING_CTL_BYTES)
        return -EPROTO;
    r = kvt_calloc(1, sizeof(*r));
    if (r == NULL)
        return -ENOMEM;
    r->map_bytes = (size_t)st.st_size;
    r->map = mmap(NULL, r->map_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, memfd, 0);
    if (r->map == MAP_FAILED) {
        rc = -errno;
        kvt_free(r);
        return rc;
    }
    r->ctl = (struct kvt_ering_ctl *)r->map;
    memcpy(&ctl, r->ctl, sizeof(ctl));
    if (__atomic_load_n(&r->ctl->magic, __ATOMIC_ACQUIRE) != KVT_ERING_MAGIC ||
        ctl.version != KVT_ERING_VERSION || ctl.ctl_bytes != KVT_ERING_CTL_BYTES ||
        !pow2(ctl.req_cap) || !pow2(ctl.rep_cap) || ctl.req_cap < (uint64_t)page ||
        ctl.rep_cap < (uint64_t)page || ctl.req_off != KVT_ERING_CTL_BYTES ||
        ctl.rep_off != ctl.req_off + ctl.req_cap || ctl.rep_cap > r->map_bytes ||
        ctl.rep_off > r->map_bytes - ctl.rep_cap) {
        munmap(r->map, r->map_bytes);
        kvt_free(r);
        return -EPROTO;
    }
    r->req = r->map + ctl.req_off;
    r->rep = r->map + ctl.rep_off;
    r->req_cap = ctl.req_cap;
    r->rep_cap = ctl.rep_cap;
    r->req_head = r->req_acked = __atomic_load_n(&r->ctl->req_tail, __ATOMIC_RELAXED);
    r->hdr_ack = r->ctl_ack = r->req_acked;
    r->rep_tail = __atomic_load_n(&r->ctl->rep_tail, __ATOMIC_RELAXED);
    r->rep_next = 1;
    r->evfd = evfd;
    r->spin_ns = DEFAULT_SPIN_US * 1000ull;
    *ring_p = r;
    return 0;
}

void kvt__cring_close(struct kvt_cring *r)
{
    if (r == NULL)
        return;
    munmap(r->map, r->map_bytes);
    if (r->evfd >= 0)
        close(r->evfd);
    kvt_free(r);
}

void kvt__cring_set_spin(struct kvt_cring *r, uint32_t spin_us)
{
    r->spin_ns = (uint64_t)spin_us * 1000ull;
}

static void load_head(const uint8_t *p, uint32_t *len_p, uint32_t *seq_p)
{
    uint64_t v = __atomic_load_n((const uint64_t *)(const void *)p, __ATOMIC_ACQUIRE);
    struct kvt_ering_rec h;

    memcpy(&h, &v, sizeof(v));
    *len_p = h.len;
    *seq_p = h.seq;
}

static void store_head(uint8_t *p, uint32_t len, uint32_t seq, uint64_t ack)
{
    struct kvt_ering_rec h = {.len = len, .seq = seq};
    uint64_t v;

    __atomic_store_n((uint64_t *)(void *)(p + 8), ack, __ATOMIC_RELAXED);
    memcpy(&v, &h, sizeof(v));
    __atomic_store_n((uint64_t *)(void *)p, v, __ATOMIC_RELEASE);
}

/* The node's ack of request bytes taken, from one of its two channels (*last:
 * reply headers or req_tail): -EPROTO unless it lies between what that channel
 * said before and what was published. req_tail moves when the node takes a
 * request, a reply's ack when it answers: each goes forward on its own, and the
 * later one counts. */
static int see_ack(struct kvt_cring *r, uint64_t ack, uint64_t *last)
{
    if ((ack & (KVT_ERING_ALIGN - 1)) != 0 || ack - *last > r->req_head - *last)
        return broken(r, last == &r->hdr_ack ? "a reply's ack outside its window"
                                             : "req_tail outside its window");
    *last = ack;
    if (r->req_head - ack < r->req_head - r->req_acked)
        r->req_acked = ack;
    return 0;
}

uint32_t kvt__cring_outstanding(const struct kvt_cring *r)
{
    return r->seq + 1 - r->rep_next;
}

int kvt__cring_reserve(struct kvt_cring *r, size_t len, uint8_t **body_p)
{
    uint64_t need = kvt_ering_rec_bytes(len), off, to_end, want, free;

    if (len > KVT_ERING_LEN_MAX || need > r->req_cap / 2)
        return -EMSGSIZE;
    off = r->req_head & (r->req_cap - 1);
    to_end = r->req_cap - off;
    want = to_end >= need ? need : to_end + need;
    free = r->req_cap - (r->req_head - r->req_acked);
    if (free < want) {
        int rc = see_ack(r, __atomic_load_n(&r->ctl->req_tail, __ATOMIC_ACQUIRE), &r->ctl_ack);

        if (rc < 0)
            return rc;
        free = r->req_cap - (r->req_head - r->req_acked);
        if (free < want)
            return -EBUSY;
    }
    r->res_len = (uint32_t)len;
    /* (a record that does not fit before the end goes at the start, behind a PAD) */
    *body_p = (to_end < need ? r->req : r->req + off) + KVT_ERING_REC_BYTES;
    return 0;
}

int kvt__cring_post(struct kvt_cring *r, const uint8_t *body, size_t len, uint32_t *seq_p)
{
    uint8_t *p;
    int rc = kvt__cring_reserve(r, len, &p);

    if (rc < 0)
        return rc;
    kvt_ering_copy(p, body, len);
    kvt__cring_commit(r, seq_p);
    return 0;
}

void kvt__cring_commit(struct kvt_cring *r, uint32_t *seq_p)
{
    uint64_t len = r->res_len, need = kvt_ering_rec_bytes(len), want;
    uint64_t off = r->req_head & (r->req_cap - 1), to_end = r->req_cap - off;
    uint32_t seq = r->seq + 1;

    if (to_end < need) {
        /* The record at the start, then the PAD that leads there. */
        store_head(r->req, (uint32_t)len, seq, r->rep_tail);
        store_head(r->req + off, KVT_ERING_PAD, seq, r->rep_tail);
        want = to_end + need;
    } else {
        store_head(r->req + off, (uint32_t)len, seq, r->rep_tail);
        want = need;
    }
    r->req_head += want;
    r->seq = seq;
    if (seq_p != NULL)
        *seq_p = seq;
    r->st.posted++;
    /* Dekker with the node's "set node_sleeping, fence, look at the rings". */
    kvt_full_fence();
    if (__atomic_load_n(&r->ctl->node_sleeping, __ATOMIC_RELAXED) != 0) {
        uint64_t one = 1;

        r->st.wakeups++;
        if (write(r->evfd, &one, sizeof(one)) < 0) {
            /* EAGAIN: the counter is full, the node has a wake-up pending anyway */
        }
    }
}

/* The reply slot: where the next reply is due. */
static uint8_t *slot(const struct kvt_cring *r)
{
    return r->rep + (r->rep_tail & (r->rep_cap - 1));
}

/* Looks at the reply slot: 0 a reply was taken, 2 nothing yet, or what next
 * returns. */
static int take_reply(struct kvt_cring *r, uint8_t **buf_p, size_t *cap_p, size_t *len_p,
                      uint32_t *seq_p)
{
    uint64_t off = r->rep_tail & (r->rep_cap - 1), skip = 0, need, avail;
    uint32_t len, seq;
    int rc;

    if (r->rep_next == r->seq + 1)
        return 2; /* nothing outstanding */
    load_head(r->rep + off, &len, &seq);
    if (len == KVT_ERING_CLOSED)
        return 3;
    if (seq != r->rep_next)
        return 2;
    if (len == KVT_ERING_PAD) {
        if (off == 0)
            return broken(r, "a reply PAD at the ring's start");
        skip = r->rep_cap - off;
        off = 0;
        load_head(r->rep, &len, &seq);
        if (seq != r->rep_next || len == KVT_ERING_PAD)
            return broken(r, seq != r->rep_next ? "a reply PAD before its record"
                                                : "a reply PAD after a PAD");
    }
    *seq_p = seq;
    rc = see_ack(
        r, __atomic_load_n((const uint64_t *)(const void *)(r->rep + off + 8), __ATOMIC_RELAXED),
        &r->hdr_ack);
    if (rc < 0)
        return rc;
    if (len == KVT_ERING_CLOSED)
        return 3;
    if (len == KVT_ERING_REDIRECT) {
        r->rep_tail += skip + kvt_ering_rec_bytes(0);
        r->rep_next++;
        __atomic_store_n(&r->ctl->rep_tail, r->rep_tail, __ATOMIC_RELEASE);
        r->st.redirects++;
        return 1;
    }
    need = kvt_ering_rec_bytes(len);
    avail = r->rep_cap - off;
    if (len > KVT_ERING_LEN_MAX || need > avail || need > r->rep_cap / 2)
        return broken(r, "a reply longer than the ring allows");
    if (len > *cap_p) {
        uint8_t *p = kvt_realloc(*buf_p, len);

        if (p == NULL)
            return -ENOMEM;
        *buf_p = p;
        *cap_p = len;
    }
    kvt_ering_copy(*buf_p, r->rep + off + KVT_ERING_REC_BYTES, len);
    kvt_ering_scrub(r->rep + off, len, seq);
    *len_p = len;
    r->rep_tail += skip + need;
    r->rep_next++;
    __atomic_store_n(&r->ctl->rep_tail, r->rep_tail, __ATOMIC_RELEASE);
    return 0;
}

static bool socket_has_news(int sockfd)
{
    struct pollfd p = {.fd = sockfd, .events = POLLIN};

    return poll(&p, 1, 0) > 0;
}

int kvt__cring_next(struct kvt_cring *r, int sockfd, bool wait, uint64_t deadline_ns,
                    uint8_t **buf_p, size_t *cap_p, size_t *len_p, uint32_t *seq_p)
{
    uint64_t start = 0, last = 0;
    unsigned spins = 0;

    for (;;) {
        int rc = take_reply(r, buf_p, cap_p, len_p, seq_p);
        uint64_t now;

        if (rc != 2 || !wait || r->rep_next == r->seq + 1)
            return rc;
        /* The clock is read every 64 turns of the spin. */
        if ((++spins & 63) != 0) {
            cpu_relax();
            continue;
        }
        if (__atomic_load_n(&r->ctl->closed, __ATOMIC_ACQUIRE) != 0)
            return 3;
        now = now_ns();
        if (start == 0)
            start = now;
        if (deadline_ns != 0 && now >= deadline_ns)
            return -ETIMEDOUT;
        if (now - start < r->spin_ns && now >= r->rest_until) {
            if (last == 0 || now - last <= SPIN_LOST_NS) {
                last = now;
                cpu_relax();
                continue;
            }
            r->rest_until = now + SPIN_REST_NS; /* the spin lost its core */
            r->st.spin_rests++;
        }
        last = 0; /* a sleep is no lost core */
        /* Sleep: say so, then look again (the node wakes the slot's seq word after
         * publishing there when it sees client_waiting). */
        uint32_t *word = (uint32_t *)(void *)(slot(r) + 4);

        __atomic_store_n(&r->ctl->client_waiting, 1u, __ATOMIC_RELAXED);
        kvt_full_fence();
        uint32_t seen = __atomic_load_n(word, __ATOMIC_ACQUIRE);
        uint32_t len_now, seq_now;

        load_head(slot(r), &len_now, &seq_now);
        if (seq_now != r->rep_next && len_now != KVT_ERING_CLOSED &&
            __atomic_load_n(&r->ctl->closed, __ATOMIC_ACQUIRE) == 0) {
            uint64_t slice = SLICE_NS;
            struct timespec ts;

            if (deadline_ns != 0 && deadline_ns - now < slice)
                slice = deadline_ns - now;
            ts.tv_sec = (time_t)(slice / 1000000000ull);
            ts.tv_nsec = (long)(slice % 1000000000ull);
            r->st.sleeps++;
            syscall(SYS_futex, word, FUTEX_WAIT, seen, &ts, NULL, 0);
        }
        __atomic_store_n(&r->ctl->client_waiting, 0u, __ATOMIC_RELAXED);
        load_head(slot(r), &len_now, &seq_now);
        if (seq_now != r->rep_next && len_now != KVT_ERING_CLOSED && socket_has_news(sockfd))
            return 3;
    }
}

void kvt__cring_stats(const struct kvt_cring *r, struct kvt_cring_stats *out)
{
    *out = r->st;
}

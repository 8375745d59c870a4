/* libkvtier-client's side of the shared-memory ring (protocol and layout in
 * kvtier/engine_ring.h, contract in ring_int.h).
 *
 * A call posts its request record, publishes req_head, and if the node said it
 * sleeps, writes the eventfd. It then waits for the reply record: first spinning
 * on rep_head (a busy node answers in about a microsecond), then futex-waiting on
 * rep_seq in slices, looking at the socket between slices: a node that died or
 * closed the connection leaves an EOF or an ERROR frame there, and a node that
 * closes the connection on purpose also sets closed and wakes the futex.
 *
 * The node is trusted to follow the protocol but checked anyway: counters that do
 * not add up or a record out of bounds give -EPROTO (the connection is then broken
 * by the caller), never a read outside the mapping. */
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
#include "kvtier/engine_ring.h"
#include "ring_int.h"

#define DEFAULT_SPIN_US 20
/* A futex wait lasts at most this long before the socket is looked at. */
#define SLICE_NS 20000000ull

struct kvt_cring {
    uint8_t *map;
    size_t map_bytes;
    struct kvt_ering_ctl *ctl;
    uint8_t *req, *rep;
    uint64_t req_cap, rep_cap;
    int evfd;
    uint64_t spin_ns;
    uint64_t req_head, rep_tail; /* ours */
    uint32_t seq;                /* of the last request posted */
    struct kvt_cring_stats st;
};

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
    r->req_head = __atomic_load_n(&r->ctl->req_head, __ATOMIC_RELAXED);
    r->rep_tail = __atomic_load_n(&r->ctl->rep_tail, __ATOMIC_RELAXED);
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

static void store_rec(uint8_t *p, uint32_t len, uint32_t seq)
{
    struct kvt_ering_rec h = {.len = len, .seq = seq};
    uint64_t v;

    memcpy(&v, &h, sizeof(v));
    __atomic_store_n((uint64_t *)(void *)p, v, __ATOMIC_RELAXED);
}

static struct kvt_ering_rec load_rec(const uint8_t *p)
{
    uint64_t v = __atomic_load_n((const uint64_t *)(const void *)p, __ATOMIC_RELAXED);
    struct kvt_ering_rec h;

    memcpy(&h, &v, sizeof(h));
    return h;
}

int kvt__cring_post(struct kvt_cring *r, const uint8_t *body, size_t len)
{
    uint64_t need = kvt_ering_rec_bytes(len), tail, used, free, off, to_end;

    if (len > KVT_ERING_LEN_MAX || need > r->req_cap / 2)
        return -EMSGSIZE;
    tail = __atomic_load_n(&r->ctl->req_tail, __ATOMIC_ACQUIRE);
    used = r->req_head - tail;
    if (used > r->req_cap)
        return -EPROTO;
    free = r->req_cap - used;
    off = r->req_head & (r->req_cap - 1);
    to_end = r->req_cap - off;
    if (to_end < need) {
        if (to_end + need > free)
            return -EBUSY;
        store_rec(r->req + off, KVT_ERING_PAD, r->seq + 1);
        r->req_head += to_end;
        off = 0;
    } else if (need > free) {
        return -EBUSY;
    }
    memcpy(r->req + off + KVT_ERING_REC_BYTES, body, len);
    store_rec(r->req + off, (uint32_t)len, ++r->seq);
    r->req_head += need;
    __atomic_store_n(&r->ctl->req_head, r->req_head, __ATOMIC_RELEASE);
    r->st.posted++;
    /* Dekker with the node's "set node_sleeping, fence, look at req_head". */
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    if (__atomic_load_n(&r->ctl->node_sleeping, __ATOMIC_RELAXED) != 0) {
        uint64_t one = 1;

        r->st.wakeups++;
        if (write(r->evfd, &one, sizeof(one)) < 0) {
            /* EAGAIN: the counter is full, the node has a wake-up pending anyway */
        }
    }
    return 0;
}

/* Looks at the reply ring: 0 a record was taken (see wait), 2 nothing yet, or what
 * wait returns. */
static int take_reply(struct kvt_cring *r, uint8_t **buf_p, size_t *cap_p, size_t *len_p)
{
    uint64_t head = __atomic_load_n(&r->ctl->rep_head, __ATOMIC_ACQUIRE);

    for (int pads = 0;; pads++) {
        uint64_t avail = head - r->rep_tail, off, need;
        struct kvt_ering_rec h;

        if (avail == 0)
            return 2;
        if (avail > r->rep_cap || (avail & 7) != 0 || pads > 1)
            return -EPROTO;
        off = r->rep_tail & (r->rep_cap - 1);
        h = load_rec(r->rep + off);
        if (h.len == KVT_ERING_PAD) {
            if (r->rep_cap - off > avail)
                return -EPROTO;
            r->rep_tail += r->rep_cap - off;
            continue;
        }
        if (h.seq != r->seq)
            return -EPROTO;
        if (h.len == KVT_ERING_REDIRECT) {
            r->rep_tail += KVT_ERING_REC_BYTES;
            __atomic_store_n(&r->ctl->rep_tail, r->rep_tail, __ATOMIC_RELEASE);
            r->st.redirects++;
            return 1;
        }
        need = kvt_ering_rec_bytes(h.len);
        if (h.len > KVT_ERING_LEN_MAX || need > avail || off + need > r->rep_cap)
            return -EPROTO;
        if (h.len > *cap_p) {
            uint8_t *p = kvt_realloc(*buf_p, h.len);

            if (p == NULL)
                return -ENOMEM;
            *buf_p = p;
            *cap_p = h.len;
        }
        memcpy(*buf_p, r->rep + off + KVT_ERING_REC_BYTES, h.len);
        *len_p = h.len;
        r->rep_tail += need;
        __atomic_store_n(&r->ctl->rep_tail, r->rep_tail, __ATOMIC_RELEASE);
        return 0;
    }
}

static bool socket_has_news(int sockfd)
{
    struct pollfd p = {.fd = sockfd, .events = POLLIN};

    return poll(&p, 1, 0) > 0;
}

int kvt__cring_wait(struct kvt_cring *r, int sockfd, uint64_t deadline_ns, uint8_t **buf_p,
                    size_t *cap_p, size_t *len_p)
{
    uint64_t start = now_ns();
    unsigned spins = 0;

    for (;;) {
        int rc = take_reply(r, buf_p, cap_p, len_p);
        uint64_t now;

        if (rc != 2)
            return rc;
        if (__atomic_load_n(&r->ctl->closed, __ATOMIC_ACQUIRE) != 0)
            return 1;
        /* The clock is read every 64 turns of the spin. */
        if ((++spins & 63) != 0) {
            cpu_relax();
            continue;
        }
        now = now_ns();
        if (deadline_ns != 0 && now >= deadline_ns)
            return -ETIMEDOUT;
        if (now - start < r->spin_ns) {
            cpu_relax();
            continue;
        }
        /* Sleep: say so, then look again (the node bumps rep_seq after publishing
         * and wakes us if it saw client_waiting). */
        __atomic_store_n(&r->ctl->client_waiting, 1u, __ATOMIC_RELAXED);
        __atomic_thread_fence(__ATOMIC_SEQ_CST);
        uint32_t seen = __atomic_load_n(&r->ctl->rep_seq, __ATOMIC_ACQUIRE);

        if (__atomic_load_n(&r->ctl->rep_head, __ATOMIC_ACQUIRE) == r->rep_tail &&
            __atomic_load_n(&r->ctl->closed, __ATOMIC_ACQUIRE) == 0) {
            uint64_t slice = SLICE_NS;
            struct timespec ts;

            if (deadline_ns != 0 && deadline_ns - now < slice)
                slice = deadline_ns - now;
            ts.tv_sec = (time_t)(slice / 1000000000ull);
            ts.tv_nsec = (long)(slice % 1000000000ull);
            r->st.sleeps++;
            syscall(SYS_futex, &r->ctl->rep_seq, FUTEX_WAIT, seen, &ts, NULL, 0);
        }
        __atomic_store_n(&r->ctl->client_waiting, 0u, __ATOMIC_RELAXED);
        if (__atomic_load_n(&r->ctl->rep_head, __ATOMIC_ACQUIRE) == r->rep_tail &&
            socket_has_news(sockfd))
            return 1;
    }
}

void kvt__cring_stats(const struct kvt_cring *r, struct kvt_cring_stats *out)
{
    *out = r->st;
}

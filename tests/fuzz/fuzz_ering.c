/* SPDX-License-Identifier: Apache-2.0 */
/* libFuzzer target for the node's side of an engine's shared-memory ring
 * (node/engine_ring.c; layout and protocol in kvtier/engine_ring.h): everything in
 * the memfd is the engine's to write, at any moment, and the node reads its
 * counters, record headers, sequence numbers and bodies from there.
 *
 * The target creates a ring (kvt__ering_create), opens the engine's side on its
 * memfd with the real client (node/client/ring.c, compiled in), maps the memfd once
 * more for the engine's own scribbles, and runs the input as a program (one op byte
 * and its arguments, until the input ends; byte 0 picks the ring's size and the
 * node's max_body):
 *   post      the client publishes a request of a chosen length;
 *   take      kvt__ering_take (never while a request awaits its reply: the caller's
 *             contract);
 *   reply     kvt__ering_reply or kvt__ering_reply2 (split where the input says) of
 *             a chosen length, for the request taken;
 *   pending, sleeping, close, drain   the other node calls;
 *   next      the client reads the next reply (not waiting);
 *   write     the engine writes a value now: the control page's counters and flags,
 *             a request or reply line's header fields (length, sequence number, ack:
 *             raw, near what the node expects, or a marker), or any bytes anywhere;
 *   arm       the same write, done from inside the node's next calls, before its
 *             n-th load of engine-written memory (engine_ring.c calls
 *             kvt__ering_fuzz_load there when built with KVT_ERING_FUZZ): the engine
 *             changing the memory between two of the node's reads;
 *   round     post, take, reply and next in one op (to reach the ring's later laps).
 * (Seeds in corpus/ering: calls of every size through several laps, wrapping records
 * and PADs, replies redirected, a full reply ring, close with a request taken; and
 * hostile ones: acks out of their window, lengths over the limits, PADs that lead
 * nowhere, the wrong sequence number, a header changed between the node's reads.)
 *
 * Checked on every input, beyond the sanitizers' own checks:
 * - take says 1, 0, -EAGAIN or -EPROTO; reply 0, 1 or -EPROTO;
 * - after -EPROTO the ring stays broken: every later take says -EPROTO, and
 *   kvt__ering_why names a check;
 * - a body taken lies in the node's own heap copy (not the shared memory), is at most
 *   max_body and half the ring, and stays unchanged, whatever the engine writes,
 *   until the reply;
 * - the node writes only what it owns: take the scrub words of the record it took and
 *   req_tail, reply its record (and PAD) where the reply is due, close the flag and a
 *   CLOSED marker there, sleeping its flag; and never more replies than the ring holds
 *   beyond the furthest ack the engine ever offered;
 * - a reply said published is there in the ring: its header (the request's sequence
 *   number, the node's req_tail as ack) and exactly the bytes given; a REDIRECT is a
 *   REDIRECT;
 * - while the engine has written nothing but through the client, the ring works as
 *   the protocol says: every request is taken exactly as posted, -EAGAIN only when
 *   the reply ring is full, a reply fits exactly when there is room, the client reads
 *   each reply as given, and nothing says -EPROTO. */
#include <errno.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "kvt/log.h"
#include "kvtier/engine_ring.h"
#include "engine_ring_int.h"
#include "fuzz_check.h"
#include "ring_int.h"

#if defined(__has_feature)
#if __has_feature(address_sanitizer)
#define FUZZ_ASAN 1
#endif
#endif
#ifdef __SANITIZE_ADDRESS__
#define FUZZ_ASAN 1
#endif
#ifdef FUZZ_ASAN
/* sanitizer/allocator_interface.h (clang's; gcc's libasan has them but not the
 * header) */
int __sanitizer_get_ownership(const volatile void *p);
size_t __sanitizer_get_allocated_size(const volatile void *p);
#endif

/* The target's own loops over the memfd are not under test: no coverage there. */
#ifdef __clang__
#define NO_COV __attribute__((no_sanitize("coverage")))
#else
#define NO_COV
#endif

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
void kvt__ering_fuzz_load(const void *p);

#define MAX_ARMED   4
#define MAX_QUEUED  256
#define LINE        KVT_ERING_ALIGN
#define NO_CHECK    "no check failed" /* kvt__ering_why of a ring not broken */
#define ASK_LEN_MAX 0xffffu

/* One write of the engine: up to three stores (a record header's fields). */
struct wr {
    unsigned n;
    struct {
        uint32_t off;  /* in the memfd */
        uint8_t width; /* 1, 2, 4 or 8 */
        uint64_t val;
    } p[3];
};

struct armed {
    bool on;
    unsigned at; /* before the node's at-th load of the next calls */
    struct wr w;
};

/* A body's bytes: its request's or reply's number and a salt, so a body is never
 * kept. */
static uint8_t body_byte(uint32_t seq, uint32_t salt, size_t i)
{
    return (uint8_t)(salt + i * 29u + (i >> 8) * 7u + seq * 131u);
}

static struct {
    const uint8_t *p; /* the rest of the input */
    size_t n;
    struct kvt_ering *ring;
    struct kvt_cring *cl; /* the engine's client side; NULL when it broke */
    uint8_t *map;         /* the engine's own mapping */
    uint8_t *shadow;      /* the memfd before a node call, with the engine's writes */
    uint8_t *allow;       /* bytes the node's call may write */
    size_t bytes;
    uint64_t cap;
    uint32_t max_body;
    struct kvt_ering_ctl *ctl;
    uint8_t *req, *rep;
    /* the node as the protocol says it is */
    bool clean;        /* the engine wrote only through the client */
    bool taken;        /* a request awaits its reply */
    bool broken;       /* a call said -EPROTO */
    bool closed;       /* kvt__ering_close was called */
    uint32_t seq;      /* requests taken */
    uint64_t req_tail; /* the node's, after its last take */
    uint64_t rep_head; /* reply bytes published */
    uint64_t released; /* the furthest ack the engine offered (at most rep_head) */
    const uint8_t *in; /* the body taken */
    size_t in_len;
    uint8_t *in_copy;
    /* the engine inside the node's calls */
    bool in_call;
    bool hook_wrote;
    unsigned loads;
    struct armed armed[MAX_ARMED];
    /* the client's requests not taken yet and replies not read yet (clean only) */
    struct {
        uint32_t len, salt;
    } posted[MAX_QUEUED];
    unsigned posted_head, posted_n;
    struct {
        uint32_t seq, len, salt;
        int rc;
    } replies[MAX_QUEUED];
    unsigned rep_q_head, rep_q_n;
    uint32_t salt;
    uint8_t *cbuf; /* the client's reply buffer */
    size_t ccap;
} f;

/* ---- the input ------------------------------------------------------------------ */

static uint8_t u8(void)
{
    if (f.n == 0)
        return 0;
    f.n--;
    return *f.p++;
}

static uint64_t un(unsigned bytes)
{
    uint64_t v = 0;

    for (unsigned i = 0; i < bytes; i++)
        v |= (uint64_t)u8() << (8 * i);
    return v;
}

/* A body length: mostly small, up to the ring's half and a little past it. */
static size_t ask_len(void)
{
    uint8_t b = u8();

    if (b < 0xc0)
        return b;
    return (size_t)(un(2) % (f.cap / 2 + 2 * LINE));
}

/* ---- the engine's writes -------------------------------------------------------- */

enum field { F_LEN, F_SEQ, F_ACK, F_RAW };

static uint64_t value(enum field fd)
{
    static const uint64_t marks[] = {
        KVT_ERING_PAD, KVT_ERING_REDIRECT, KVT_ERING_CLOSED, KVT_ERING_LEN_MAX, 0x80000000u, 0, 1,
        UINT32_MAX,    UINT64_MAX,         1ull << 32,       1ull << 63};
    uint8_t k = u8(), b;

    switch (k & 3) {
    case 0:
        return un(8);
    case 1:
        b = u8();
        return (k & 4) ? (uint64_t)b * LINE : b;
    case 2: /* near what the node expects */
        b = u8();
        switch (fd) {
        case F_SEQ:
            return (uint32_t)(f.seq + 1 + (int8_t)b);
        case F_ACK:
            return f.rep_head - (uint64_t)(int8_t)b * LINE + ((k & 4) ? f.cap : 0);
        case F_LEN:
            return (uint32_t)(f.cap / 2 - KVT_ERING_REC_BYTES + (int8_t)b);
        default:
            return f.req_tail + (int8_t)b;
        }
    default:
        b = u8();
        if (k & 4)
            return f.cap * (b & 3) + (uint64_t)(b >> 2) * LINE - (k & 8 ? 1 : 0);
        return marks[b % (sizeof(marks) / sizeof(marks[0]))];
    }
}

static void piece(struct wr *w, uint64_t off, uint8_t width, enum field fd)
{
    w->p[w->n].off = (uint32_t)off;
    w->p[w->n].width = width;
    w->p[w->n].val = value(fd);
    w->n++;
}

/* A write as the input says: where, then the values. */
static void read_wr(struct wr *w)
{
    uint8_t k = u8();
    uint64_t lines = f.cap / LINE, line;
    uint64_t base = KVT_ERING_CTL_BYTES + ((k & 0x10) ? f.cap : 0); /* request / reply area */
    static const uint8_t widths[] = {1, 2, 4, 8};

    w->n = 0;
    switch (k & 7) {
    case 0:
        piece(w, offsetof(struct kvt_ering_ctl, rep_tail), 8, F_ACK);
        break;
    case 1:
        piece(w, offsetof(struct kvt_ering_ctl, client_waiting), 4, F_RAW);
        break;
    case 2: /* one field of a line's header */
    case 3:
        line = u8() % lines;
        switch ((k >> 5) & 3) {
        case 0:
            piece(w, base + line * LINE, 4, F_LEN);
            break;
        case 1:
            piece(w, base + line * LINE + 4, 4, F_SEQ);
            break;
        default:
            piece(w, base + line * LINE + 8, 8, F_ACK);
            break;
        }
        break;
    case 4: /* a whole header: ack, len, seq */
    case 5:
        line = u8() % lines;
        piece(w, base + line * LINE + 8, 8, F_ACK);
        piece(w, base + line * LINE, 4, F_LEN);
        piece(w, base + line * LINE + 4, 4, F_SEQ);
        break;
    case 6: /* anything in an area */
        piece(w, base + un(2) % f.cap, widths[(k >> 5) & 3], F_RAW);
        break;
    default: /* anything anywhere (the node's own fields and constants too) */
        piece(w, un(2) % f.bytes, widths[(k >> 5) & 3], F_RAW);
        break;
    }
    for (unsigned i = 0; i < w->n; i++) { /* (inside the memfd) */
        if (w->p[i].off + w->p[i].width > f.bytes)
            w->p[i].off = (uint32_t)(f.bytes - w->p[i].width);
    }
}

static void note_released(void);

static void store(uint8_t *base, const struct wr *w)
{
    for (unsigned i = 0; i < w->n; i++)
        memcpy(base + w->p[i].off, &w->p[i].val, w->p[i].width);
}

static void do_wr(const struct wr *w)
{
    store(f.map, w);
    if (f.in_call) {
        store(f.shadow, w); /* the engine's, not the node's */
        f.hook_wrote = true;
    }
    f.clean = false;
    note_released();
}

/* engine_ring.c, before each of its loads of engine-written memory. */
void kvt__ering_fuzz_load(const void *p)
{
    (void)p;
    if (!f.in_call)
        return;
    f.loads++;
    for (unsigned i = 0; i < MAX_ARMED; i++) {
        if (f.armed[i].on && f.armed[i].at == f.loads) {
            f.armed[i].on = false;
            do_wr(&f.armed[i].w);
        }
    }
}

/* ---- what the node may write ---------------------------------------------------- */

/* The furthest ack the engine has offered that the node could accept (aligned, not
 * past what was published): the control page's rep_tail and every request line's
 * ack, whenever the node could have read them. */
NO_COV static void note_released(void)
{
    uint64_t v;

    memcpy(&v, (const uint8_t *)f.ctl + offsetof(struct kvt_ering_ctl, rep_tail), sizeof(v));
    for (uint64_t o = 0;; o += LINE) {
        if ((v & (LINE - 1)) == 0 && f.rep_head - v <= f.rep_head - f.released)
            f.released = v;
        if (o >= f.cap)
            break;
        memcpy(&v, f.req + o + 8, sizeof(v));
    }
}

static void allow(uint64_t off, uint64_t len)
{
    CHECK(off + len <= f.bytes);
    memset(f.allow + off, 1, len);
}

static void before_call(void)
{
    note_released();
    memcpy(f.shadow, f.map, f.bytes);
    memset(f.allow, 0, f.bytes);
    f.in_call = true;
    f.hook_wrote = false;
    f.loads = 0;
}

/* The node's call is over: what it wrote was allowed. (Line by line: a loop over
 * every byte cost most of the target's time.) */
NO_COV static void after_call(const char *what)
{
    f.in_call = false;
    for (size_t i = 0; i < f.bytes; i++) {
        if (i % LINE == 0 && memcmp(f.map + i, f.shadow + i, LINE) == 0) {
            i += LINE - 1;
            continue;
        }
        if (f.map[i] != f.shadow[i] && !f.allow[i]) {
            fprintf(stderr, "fuzz_ering: %s wrote byte %zu of the memfd (%#x -> %#x)\n", what, i,
                    f.shadow[i], f.map[i]);
            CHECK(!"the node wrote where it may not");
        }
    }
}

static uint64_t rep_off(uint64_t pos)
{
    return KVT_ERING_CTL_BYTES + f.cap + (pos & (f.cap - 1));
}

/* The header at off of the memfd says len, seq and ack. */
static bool head_is(uint64_t off, uint32_t len, uint32_t seq, uint64_t ack)
{
    struct kvt_ering_rec h;

    memcpy(&h, f.map + off, sizeof(h));
    return h.len == len && h.seq == seq && h.ack == ack;
}

/* ---- the node's calls ----------------------------------------------------------- */

static void set_broken(void)
{
    f.broken = true;
    CHECK(strcmp(kvt__ering_why(f.ring), NO_CHECK) != 0);
}

static void op_take(void)
{
    const uint8_t *body = NULL;
    size_t len = 0;
    uint64_t free_now = f.cap - (f.rep_head - f.ctl->rep_tail);
    bool clean = f.clean && !f.closed;
    int rc;

    if (f.taken)
        return; /* the caller replies first */
    before_call();
    rc = kvt__ering_take(f.ring, f.max_body, &body, &len);
    if (rc == 1) {
        uint64_t need = kvt_ering_rec_bytes(len), tail = f.ctl->req_tail;
        uint64_t start = (tail - need) & (f.cap - 1), step = tail - f.req_tail;

        allow(offsetof(struct kvt_ering_ctl, req_tail), 8);
        CHECK(start + need <= f.cap);
        CHECK(step == need || (start == 0 && step == need + (f.cap - (f.req_tail & (f.cap - 1)))));
        for (uint64_t o = LINE; o < need; o += LINE)
            allow(KVT_ERING_CTL_BYTES + start + o, 8);
    }
    after_call("take");
    clean = clean && f.clean; /* (unless the engine wrote during the call) */
    CHECK(rc == 1 || rc == 0 || rc == -EAGAIN || rc == -EPROTO);
    if (f.broken)
        CHECK(rc == -EPROTO);
    if (rc == -EPROTO)
        set_broken();
    if (f.closed && !f.broken)
        CHECK(rc == 0);
    if (clean) {
        if (f.posted_n == 0)
            CHECK(rc == 0);
        else if (f.posted[f.posted_head].len > f.max_body)
            CHECK(rc == -EPROTO); /* (a request over the node's limit breaks the ring) */
        else if (free_now < LINE)
            CHECK(rc == -EAGAIN);
        else
            CHECK(rc == 1);
    }
    if (rc != 1)
        return;
    CHECK(len <= f.max_body && len <= f.cap / 2 - KVT_ERING_REC_BYTES);
    CHECK(body != NULL);
    CHECK(body + len <= f.map || body >= f.map + f.bytes);
#ifdef FUZZ_ASAN
    CHECK(__sanitizer_get_ownership(body) && __sanitizer_get_allocated_size(body) >= len);
#endif
    if (clean) {
        uint32_t plen = f.posted[f.posted_head].len, salt = f.posted[f.posted_head].salt;

        CHECK(len == plen);
        for (size_t i = 0; i < len; i++)
            CHECK(body[i] == body_byte(f.seq + 1, salt, i));
        f.posted_head = (f.posted_head + 1) % MAX_QUEUED;
        f.posted_n--;
    }
    f.taken = true;
    f.seq++;
    f.req_tail = f.ctl->req_tail;
    f.in = body;
    f.in_len = len;
    if (len > 0)
        memcpy(f.in_copy, body, len);
}

static void op_reply(size_t len, bool two, size_t split)
{
    uint8_t *b = malloc(len + 1);
    uint64_t need = kvt_ering_rec_bytes(len), off = f.rep_head & (f.cap - 1);
    uint64_t to_end = f.cap - off, want = to_end >= need ? need : to_end + need;
    uint64_t free_now = f.cap - (f.rep_head - f.ctl->rep_tail), at;
    bool clean = f.clean, wrapped;
    uint32_t salt = f.salt++;
    int rc;

    if (!f.taken || f.closed) {
        free(b);
        return;
    }
    CHECK(b != NULL);
    for (size_t i = 0; i < len; i++)
        b[i] = body_byte(f.seq, salt, i);
    /* the body taken is still the node's copy, as it was */
    CHECK(f.in_len == 0 || memcmp(f.in, f.in_copy, f.in_len) == 0);
    if (split > len)
        split = len;
    before_call();
    if (two)
        rc = kvt__ering_reply2(f.ring, b, split, b + split, len - split);
    else
        rc = kvt__ering_reply(f.ring, b, len);
    f.taken = false;
    wrapped = rc == 0 && to_end < need;
    at = wrapped ? f.rep_head + to_end : f.rep_head;
    if (rc == 0) {
        allow(rep_off(at), KVT_ERING_REC_BYTES + len);
        if (wrapped)
            allow(rep_off(f.rep_head), KVT_ERING_REC_BYTES);
    } else if (rc == 1) {
        allow(rep_off(f.rep_head), KVT_ERING_REC_BYTES);
    }
    after_call("reply");
    CHECK(rc == 0 || rc == 1 || rc == -EPROTO);
    clean = clean && f.clean;
    if (clean) {
        bool fits = len <= KVT_ERING_LEN_MAX && need <= f.cap / 2 && want <= free_now;

        CHECK(rc == (fits ? 0 : 1));
    }
    if (rc < 0) {
        set_broken();
        free(b);
        return;
    }
    if (!f.hook_wrote) { /* (an armed write may land on the record after it was written) */
        if (rc == 0) {
            CHECK(head_is(rep_off(at), (uint32_t)len, f.seq, f.req_tail));
            CHECK(len == 0 || memcmp(f.map + rep_off(at) + KVT_ERING_REC_BYTES, b, len) == 0);
            if (wrapped)
                CHECK(head_is(rep_off(f.rep_head), KVT_ERING_PAD, f.seq, f.req_tail));
        } else {
            CHECK(head_is(rep_off(f.rep_head), KVT_ERING_REDIRECT, f.seq, f.req_tail));
        }
    }
    f.rep_head += rc == 0 ? want : LINE;
    /* never over a reply the engine has not said it consumed */
    CHECK(f.rep_head - f.released <= f.cap);
    if (clean && f.rep_q_n < MAX_QUEUED) {
        unsigned i = (f.rep_q_head + f.rep_q_n++) % MAX_QUEUED;

        f.replies[i].seq = f.seq;
        f.replies[i].len = (uint32_t)len;
        f.replies[i].salt = salt;
        f.replies[i].rc = rc;
    }
    free(b);
}

static void op_close(void)
{
    uint64_t slot = rep_off(f.rep_head);
    uint32_t seq = f.seq + (f.taken ? 0 : 1);

    before_call();
    kvt__ering_close(f.ring);
    if (!f.closed) {
        allow(offsetof(struct kvt_ering_ctl, closed), 4);
        allow(slot, KVT_ERING_REC_BYTES);
    }
    after_call("close");
    CHECK(kvt__ering_closed(f.ring));
    if (!f.closed && memcmp(f.map + slot, f.shadow + slot, KVT_ERING_REC_BYTES) != 0) {
        /* a CLOSED marker where the next reply was due, in room the engine left */
        if (!f.hook_wrote)
            CHECK(head_is(slot, KVT_ERING_CLOSED, seq, f.req_tail));
        CHECK(f.rep_head + LINE - f.released <= f.cap);
    }
    f.closed = true;
    f.taken = false;
}

static void op_pending(void)
{
    before_call();
    (void)kvt__ering_pending(f.ring);
    after_call("pending");
}

static void op_sleeping(bool on)
{
    before_call();
    kvt__ering_set_sleeping(f.ring, on);
    allow(offsetof(struct kvt_ering_ctl, node_sleeping), 4);
    after_call("set_sleeping");
}

/* ---- the client ----------------------------------------------------------------- */

static void op_post(size_t len)
{
    uint8_t *b = malloc(len + 1);
    uint32_t seq = 0, salt = f.salt++;
    int rc;

    CHECK(b != NULL);
    if (f.cl == NULL) {
        free(b);
        return;
    }
    /* (the sequence number it will get: the client's own count) */
    seq = f.seq + f.posted_n + 1;
    for (size_t i = 0; i < len; i++)
        b[i] = body_byte(seq, salt, i);
    rc = kvt__cring_post(f.cl, b, len, &seq);
    CHECK(rc == 0 || rc == -EMSGSIZE || rc == -EBUSY || rc == -EPROTO);
    if (f.clean) {
        CHECK(rc != -EPROTO);
        CHECK((rc == -EMSGSIZE) == (kvt_ering_rec_bytes(len) > f.cap / 2));
        if (rc == 0) {
            CHECK(seq == f.seq + f.posted_n + 1);
            CHECK(f.posted_n < MAX_QUEUED);
            f.posted[(f.posted_head + f.posted_n++) % MAX_QUEUED].len = (uint32_t)len;
            f.posted[(f.posted_head + f.posted_n - 1) % MAX_QUEUED].salt = salt;
        }
    }
    if (rc == -EPROTO) {
        kvt__cring_close(f.cl);
        f.cl = NULL;
    }
    free(b);
}

static void op_next(void)
{
    size_t len = 0;
    uint32_t seq = 0;
    int rc;

    if (f.cl == NULL)
        return;
    rc = kvt__cring_next(f.cl, -1, false, 0, &f.cbuf, &f.ccap, &len, &seq);
    CHECK((rc >= 0 && rc <= 3) || rc == -EPROTO || rc == -ENOMEM);
    if (rc == 0)
        CHECK(len <= f.cap / 2 && len <= f.ccap);
    if (f.clean) {
        CHECK(rc >= 0);
        if (f.rep_q_n > 0) {
            unsigned i = f.rep_q_head;

            CHECK(rc == f.replies[i].rc && seq == f.replies[i].seq);
            if (rc == 0) {
                CHECK(len == f.replies[i].len);
                for (size_t j = 0; j < len; j++)
                    CHECK(f.cbuf[j] == body_byte(seq, f.replies[i].salt, j));
            }
            f.rep_q_head = (f.rep_q_head + 1) % MAX_QUEUED;
            f.rep_q_n--;
        } else {
            CHECK(rc == 2 || (rc == 3 && f.closed));
        }
    }
    if (rc < 0) {
        kvt__cring_close(f.cl);
        f.cl = NULL;
    }
}

/* ---- the program ---------------------------------------------------------------- */

static bool setup(uint8_t conf)
{
    uint64_t cap = (conf & 1) ? 8192 : 4096;
    static const uint32_t bodies[] = {0, 1, 64, 200, 0, 0, 0, UINT32_MAX};
    int evfd;

    memset(&f, 0, sizeof(f));
    if (kvt__ering_create(cap, &f.ring) != 0)
        return false;
    f.cap = cap;
    f.bytes = KVT_ERING_CTL_BYTES + 2 * cap;
    f.max_body = bodies[(conf >> 1) & 7];
    if (f.max_body == 0)
        f.max_body = (uint32_t)(cap / 2 - KVT_ERING_REC_BYTES);
    f.map = mmap(NULL, f.bytes, PROT_READ | PROT_WRITE, MAP_SHARED, kvt__ering_memfd(f.ring), 0);
    CHECK(f.map != MAP_FAILED);
    f.ctl = (struct kvt_ering_ctl *)(void *)f.map;
    f.req = f.map + KVT_ERING_CTL_BYTES;
    f.rep = f.req + cap;
    f.shadow = malloc(f.bytes);
    f.allow = malloc(f.bytes);
    f.in_copy = malloc(cap / 2);
    CHECK(f.shadow != NULL && f.allow != NULL && f.in_copy != NULL);
    evfd = dup(kvt__ering_eventfd(f.ring));
    CHECK(evfd >= 0);
    CHECK(kvt__cring_open(kvt__ering_memfd(f.ring), evfd, &f.cl) == 0);
    kvt__cring_set_spin(f.cl, 0);
    f.clean = true;
    return true;
}

static void teardown(void)
{
    kvt__cring_close(f.cl);
    kvt__ering_destroy(f.ring);
    munmap(f.map, f.bytes);
    free(f.shadow);
    free(f.allow);
    free(f.in_copy);
    free(f.cbuf);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size == 0)
        return 0;
    kvt_log_set_level(KVT_LOG_ERROR);
    if (!setup(data[0]))
        return 0;
    f.p = data + 1;
    f.n = size - 1;
    while (f.n > 0) {
        uint8_t op = u8();
        size_t len, split;
        struct wr w;

        switch (op % 12) {
        case 0:
            op_post(ask_len());
            break;
        case 1:
            op_take();
            break;
        case 2:
            len = ask_len();
            split = u8();
            op_reply(len, (op & 0x80) != 0, split);
            break;
        case 3:
            op_pending();
            break;
        case 4:
            op_sleeping((op & 0x80) != 0);
            break;
        case 5:
            op_close();
            break;
        case 6:
            op_next();
            break;
        case 7:
            read_wr(&w);
            do_wr(&w);
            break;
        case 8: {
            unsigned at = 1 + u8() % 8, slot = (op >> 4) % MAX_ARMED;

            read_wr(&f.armed[slot].w);
            f.armed[slot].at = at;
            f.armed[slot].on = true;
            break;
        }
        case 9:
            kvt__ering_drain_wake(f.ring);
            break;
        default: /* a round trip */
            op_post(ask_len());
            op_take();
            len = ask_len();
            op_reply(len, (op & 0x80) != 0, (op >> 2) & 0x1f);
            op_next();
            break;
        }
    }
    teardown();
    return 0;
}

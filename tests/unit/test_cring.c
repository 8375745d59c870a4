/* SPDX-License-Identifier: Apache-2.0 */
/* libkvtier-client's side of the shared-memory ring (node/client/ring.c, compiled
 * into this test: its functions are internal to the library) against a node played
 * by the test, in one thread, so that every interleaving is chosen here.
 *
 * What is checked: the reply slot the engine polls before the node has answered
 * may lie, in the ring's second lap, inside an earlier reply's body; bytes there
 * that read as the awaited header are not taken for a reply (the engine scrubs
 * the bodies it consumed), and a reply published there afterwards is. Records
 * start on cache lines, through many laps of the ring with PADs, bodies exact; a
 * scrub touches only the line starts after a record's first line; a control
 * page of another version is refused (the engine then stays on the socket). */
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <unistd.h>

#include "test_util.h"

#include "kvt/alloc.h"
#include "kvt/clock.h"
#include "kvtier/engine_ring.h"
#include "ring_int.h"

#define CAP 4096u

/* The node's side, played by the test. */
static struct {
    int memfd;
    uint8_t *map;
    struct kvt_ering_ctl *ctl;
    uint8_t *req, *rep;
    uint64_t req_tail, rep_head;
    uint32_t req_seq;
} n;

static void node_create(void)
{
    size_t bytes = KVT_ERING_CTL_BYTES + 2 * CAP;

    n.memfd = memfd_create("test-cring", MFD_CLOEXEC);
    assert_true(n.memfd >= 0);
    assert_int_equal(ftruncate(n.memfd, (off_t)bytes), 0);
    n.map = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, n.memfd, 0);
    assert_true(n.map != MAP_FAILED);
    n.ctl = (struct kvt_ering_ctl *)n.map;
    n.req = n.map + KVT_ERING_CTL_BYTES;
    n.rep = n.req + CAP;
    n.ctl->version = KVT_ERING_VERSION;
    n.ctl->ctl_bytes = KVT_ERING_CTL_BYTES;
    n.ctl->req_off = KVT_ERING_CTL_BYTES;
    n.ctl->req_cap = CAP;
    n.ctl->rep_off = KVT_ERING_CTL_BYTES + CAP;
    n.ctl->rep_cap = CAP;
    n.ctl->magic = KVT_ERING_MAGIC;
    n.req_tail = n.rep_head = 0;
    n.req_seq = 0;
}

static void store_head(uint8_t *p, uint32_t len, uint32_t seq, uint64_t ack)
{
    struct kvt_ering_rec h = {.len = len, .seq = seq, .ack = ack};

    memcpy(p, &h, sizeof(h));
}

/* Takes the next request (no PADs in this test's request ring: its records are
 * one line and the ring's size is a multiple of that). */
static void node_take(void)
{
    struct kvt_ering_rec h;

    memcpy(&h, n.req + (n.req_tail & (CAP - 1)), sizeof(h));
    assert_int_equal(h.seq, n.req_seq + 1);
    n.req_seq++;
    n.req_tail += kvt_ering_rec_bytes(h.len);
}

/* Where the reply of body len will start. */
static uint64_t node_reply_at(size_t len)
{
    uint64_t off = n.rep_head & (CAP - 1);

    return off + kvt_ering_rec_bytes(len) > CAP ? n.rep_head + (CAP - off) : n.rep_head;
}

/* Publishes the reply to the request taken (a PAD first when it does not fit). */
static void node_reply(const uint8_t *body, size_t len)
{
    uint64_t off = n.rep_head & (CAP - 1), need = kvt_ering_rec_bytes(len);

    if (off + need > CAP) {
        memcpy(n.rep + KVT_ERING_REC_BYTES, body, len);
        store_head(n.rep, (uint32_t)len, n.req_seq, n.req_tail);
        store_head(n.rep + off, KVT_ERING_PAD, n.req_seq, n.req_tail);
        n.rep_head += CAP - off;
    } else {
        memcpy(n.rep + off + KVT_ERING_REC_BYTES, body, len);
        store_head(n.rep + off, (uint32_t)len, n.req_seq, n.req_tail);
    }
    n.rep_head += need;
}

/* The node played by a thread on the waiter's core: it keeps that core busy for
 * 300 ms, then answers. */
static void *busy_node(void *arg)
{
    uint8_t body[8] = {0x42};

    (void)arg;
    kt_busy_ms(300);
    node_take();
    node_reply(body, sizeof(body));
    return NULL;
}

/* A spin that loses its core (the node it waits for runs on that core) stops
 * spinning and sleeps, though its spin budget (1 s) is far from spent; and it rests
 * from spinning for a while after. */
static void test_spin_that_lost_its_core_sleeps(void **state)
{
    struct kvt_cring *r;
    struct kvt_cring_stats st;
    uint8_t req[8] = {7}, *buf = NULL;
    size_t cap = 0, len = 0;
    uint32_t seq = 0;
    int evfd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    cpu_set_t old;
    pthread_t node;

    (void)state;
    assert_int_equal(pthread_getaffinity_np(pthread_self(), sizeof(old), &old), 0);
    node_create();
    assert_int_equal(kvt__cring_open(n.memfd, evfd, &r), 0);
    kvt__cring_set_spin(r, 1000000);
    kt_pin_to(pthread_self(), 0);
    assert_int_equal(kvt__cring_post(r, req, sizeof(req), &seq), 0);
    assert_int_equal(pthread_create(&node, NULL, busy_node, NULL), 0);
    kt_pin_to(node, 0);
    assert_int_equal(
        kvt__cring_next(r, -1, true, kvt_now_ns() + 5000000000ull, &buf, &cap, &len, &seq), 0);
    pthread_join(node, NULL);
    assert_int_equal(pthread_setaffinity_np(pthread_self(), sizeof(old), &old), 0);
    assert_int_equal(len, 8);
    kvt__cring_stats(r, &st);
    assert_true(st.spin_rests >= 1);
    assert_true(st.sleeps >= 1); /* a spin of its whole budget would not have slept */
    kvt_free(buf);
    kvt__cring_close(r);
    munmap(n.map, KVT_ERING_CTL_BYTES + 2 * CAP);
    close(n.memfd);
}

static void test_stale_reply_body_is_no_reply(void **state)
{
    struct kvt_cring *r;
    uint8_t req[8] = {1, 2, 3, 4, 5, 6, 7, 8}, body[256], small[8] = {0x81};
    uint8_t *buf = NULL;
    size_t cap = 0, len = 0;
    uint32_t seq = 0;
    uint64_t poison_at, pos;
    uint32_t want_at[CAP / KVT_ERING_ALIGN] = {0}, s;
    uint64_t small_rec = kvt_ering_rec_bytes(sizeof(small));
    int evfd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC), planted = 0, calls = 0;

    (void)state;
    node_create();
    assert_int_equal(kvt__cring_open(n.memfd, evfd, &r), 0);
    /* A few small calls, then one whose 256-byte reply body is poisoned. */
    for (int i = 0; i < 3; i++) {
        assert_int_equal(kvt__cring_post(r, req, sizeof(req), &seq), 0);
        node_take();
        node_reply(small, sizeof(small));
        assert_int_equal(kvt__cring_next(r, -1, false, 0, &buf, &cap, &len, &seq), 0);
    }
    poison_at = node_reply_at(sizeof(body));
    /* The next lap: small replies (one-line records) from the poisoned one's end on;
     * the sequence number the engine awaits at each slot it polls. */
    assert_int_equal(small_rec, KVT_ERING_ALIGN);
    pos = poison_at + kvt_ering_rec_bytes(sizeof(body));
    s = n.req_seq + 2;
    while (pos < poison_at + CAP + kvt_ering_rec_bytes(sizeof(body))) {
        uint64_t off = pos & (CAP - 1);

        if (pos >= poison_at + CAP)
            want_at[off / KVT_ERING_ALIGN] = s;
        if (off + small_rec > CAP) {
            pos += CAP - off;
        } else {
            pos += small_rec;
            s++;
            calls++;
        }
    }
    memset(body, 0x5a, sizeof(body));
    /* (the body's bytes at every line start of the record after its first) */
    for (uint64_t o = KVT_ERING_ALIGN - KVT_ERING_REC_BYTES; o + 16 <= sizeof(body);
         o += KVT_ERING_ALIGN) {
        uint64_t at = ((poison_at & (CAP - 1)) + KVT_ERING_REC_BYTES + o) & (CAP - 1);
        struct kvt_ering_rec h = {.len = 8, .seq = want_at[at / KVT_ERING_ALIGN], .ack = 0};

        if (h.seq != 0) {
            memcpy(body + o, &h, sizeof(h));
            planted++;
        }
    }
    assert_true(planted >= 4);
    assert_int_equal(kvt__cring_post(r, req, sizeof(req), &seq), 0);
    node_take();
    node_reply(body, sizeof(body));
    assert_int_equal(kvt__cring_next(r, -1, false, 0, &buf, &cap, &len, &seq), 0);
    assert_int_equal(len, sizeof(body));
    assert_memory_equal(buf, body, sizeof(body));
    /* The next lap: after each post the engine looks before the node answers and
     * finds nothing; then the answer. */
    for (int i = 0; i < calls; i++) {
        uint32_t posted;

        assert_int_equal(kvt__cring_post(r, req, sizeof(req), &posted), 0);
        node_take();
        assert_int_equal(kvt__cring_next(r, -1, false, 0, &buf, &cap, &len, &seq), 2);
        assert_null(kvt__cring_why(r));
        small[1] = (uint8_t)i;
        node_reply(small, sizeof(small));
        assert_int_equal(kvt__cring_next(r, -1, false, 0, &buf, &cap, &len, &seq), 0);
        assert_int_equal(seq, posted);
        assert_int_equal(len, sizeof(small));
        assert_int_equal(buf[1], (uint8_t)i);
    }
    assert_true(n.rep_head > poison_at + CAP);
    kvt_free(buf);
    kvt__cring_close(r);
    munmap(n.map, KVT_ERING_CTL_BYTES + 2 * CAP);
    close(n.memfd);
}

/* Takes the next request wherever it is (after a PAD too) into body: its length. */
static size_t node_take_any(uint8_t *body, size_t cap)
{
    uint64_t off = n.req_tail & (CAP - 1);
    struct kvt_ering_rec h;

    memcpy(&h, n.req + off, sizeof(h));
    assert_int_equal(h.seq, n.req_seq + 1);
    if (h.len == KVT_ERING_PAD) {
        n.req_tail += CAP - off;
        off = 0;
        memcpy(&h, n.req, sizeof(h));
        assert_int_equal(h.seq, n.req_seq + 1);
    }
    assert_int_equal(off % KVT_ERING_ALIGN, 0);
    assert_true(h.len <= cap);
    memcpy(body, n.req + off + KVT_ERING_REC_BYTES, h.len);
    n.req_seq++;
    n.req_tail += kvt_ering_rec_bytes(h.len);
    return h.len;
}

/* Many laps of both rings with records of every size up to a few lines (PADs at
 * the ends): every record starts on a line, every body arrives exact, and both
 * sides' counters stay in step. */
static void test_many_laps_line_aligned(void **state)
{
    struct kvt_cring *r;
    uint8_t req[300], rep[300], got[300];
    uint8_t *buf = NULL;
    size_t cap = 0, len = 0;
    uint32_t seq = 0, posted = 0;
    uint64_t x = 0x9e3779b97f4a7c15ull;
    int evfd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);

    (void)state;
    node_create();
    assert_int_equal(kvt__cring_open(n.memfd, evfd, &r), 0);
    for (int i = 0; i < 3000; i++) {
        size_t qlen, plen;

        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        qlen = 1 + (size_t)(x % sizeof(req));
        plen = 1 + (size_t)((x >> 20) % sizeof(rep));
        for (size_t j = 0; j < qlen; j++)
            req[j] = (uint8_t)(i + j * 7);
        for (size_t j = 0; j < plen; j++)
            rep[j] = (uint8_t)(i * 3 + j);
        assert_int_equal(kvt__cring_post(r, req, qlen, &posted), 0);
        assert_int_equal(posted, (uint32_t)i + 1);
        assert_int_equal(node_take_any(got, sizeof(got)), qlen);
        assert_memory_equal(got, req, qlen);
        /* the engine's next record will start on a line */
        assert_int_equal(n.req_tail % KVT_ERING_ALIGN, 0);
        assert_int_equal(kvt__cring_next(r, -1, false, 0, &buf, &cap, &len, &seq), 2);
        node_reply(rep, plen);
        assert_int_equal(n.rep_head % KVT_ERING_ALIGN, 0);
        assert_int_equal(kvt__cring_next(r, -1, false, 0, &buf, &cap, &len, &seq), 0);
        assert_int_equal(seq, posted);
        assert_int_equal(len, plen);
        assert_memory_equal(buf, rep, plen);
        /* the node learns how far the engine read: everything */
        assert_int_equal(__atomic_load_n(&n.ctl->rep_tail, __ATOMIC_ACQUIRE), n.rep_head);
    }
    assert_true(n.req_tail > 20 * CAP && n.rep_head > 20 * CAP);
    assert_null(kvt__cring_why(r));
    kvt_free(buf);
    kvt__cring_close(r);
    munmap(n.map, KVT_ERING_CTL_BYTES + 2 * CAP);
    close(n.memfd);
}

/* The engine never writes over a request the node has not taken: posts (in one
 * step and in two, reserve then commit) fill the ring until it says -EBUSY with
 * nothing published, and every request then taken is the one posted, bytes
 * exact; once the node acks them (req_tail) there is room again. */
static void test_full_ring_overwrites_nothing(void **state)
{
    struct kvt_cring *r;
    uint8_t req[100], got[100], *p;
    int evfd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC), posted = 0;
    uint32_t seq = 0;

    (void)state;
    node_create();
    assert_int_equal(kvt__cring_open(n.memfd, evfd, &r), 0);
    for (;; posted++) {
        int rc;

        memset(req, posted + 1, sizeof(req));
        if (posted % 2 == 0) {
            rc = kvt__cring_post(r, req, sizeof(req), &seq);
        } else {
            rc = kvt__cring_reserve(r, sizeof(req), &p);
            if (rc == 0) {
                memcpy(p, req, sizeof(req));
                kvt__cring_commit(r, &seq);
            }
        }
        if (rc == -EBUSY)
            break;
        assert_int_equal(rc, 0);
        assert_int_equal(seq, (uint32_t)posted + 1);
    }
    /* 4096 bytes of 128-byte records */
    assert_int_equal(posted, CAP / kvt_ering_rec_bytes(sizeof(req)));
    assert_int_equal(kvt__cring_reserve(r, sizeof(req), &p), -EBUSY);
    for (int i = 0; i < posted; i++) {
        assert_int_equal(node_take_any(got, sizeof(got)), sizeof(req));
        memset(req, i + 1, sizeof(req));
        assert_memory_equal(got, req, sizeof(req));
    }
    /* nothing more was published */
    {
        struct kvt_ering_rec h;

        memcpy(&h, n.req + (n.req_tail & (CAP - 1)), sizeof(h));
        assert_int_not_equal(h.seq, n.req_seq + 1);
    }
    __atomic_store_n(&n.ctl->req_tail, n.req_tail, __ATOMIC_RELEASE);
    assert_int_equal(kvt__cring_post(r, req, sizeof(req), &seq), 0);
    assert_int_equal(seq, (uint32_t)posted + 1);
    assert_null(kvt__cring_why(r));
    kvt__cring_close(r);
    munmap(n.map, KVT_ERING_CTL_BYTES + 2 * CAP);
    close(n.memfd);
}

/* kvt_ering_copy copies exactly n bytes, at any alignment, for every size up to
 * and past its inline limit, and writes nothing beyond them. */
static void test_copy_exact(void **state)
{
    uint8_t src[600], dst[640], want[640];

    (void)state;
    for (size_t i = 0; i < sizeof(src); i++)
        src[i] = (uint8_t)(i * 131 + 7);
    for (size_t len = 0; len <= 520; len++) {
        for (size_t so = 0; so < 3; so++) {
            size_t dof = (len * 7 + so) % 17;

            memset(dst, 0xee, sizeof(dst));
            memset(want, 0xee, sizeof(want));
            memcpy(want + dof, src + so, len);
            kvt_ering_copy(dst + dof, src + so, len);
            assert_memory_equal(dst, want, sizeof(dst));
        }
    }
}

/* The scrub writes the first word of each line after the record's first, as a
 * header {0, the record's seq}, and nothing else: a one-line record is left alone. */
static void test_scrub_line_starts_only(void **state)
{
    uint8_t rec[4 * KVT_ERING_ALIGN], want[sizeof(rec)];
    struct kvt_ering_rec h = {.len = 0, .seq = 77};

    (void)state;
    memset(rec, 0x5a, sizeof(rec));
    memcpy(want, rec, sizeof(rec));
    kvt_ering_scrub(rec, KVT_ERING_ALIGN - KVT_ERING_REC_BYTES, 77); /* one line */
    assert_memory_equal(rec, want, sizeof(rec));
    /* 2 * 64 + 1 bytes of record: three lines */
    kvt_ering_scrub(rec, 2 * KVT_ERING_ALIGN + 1 - KVT_ERING_REC_BYTES, 77);
    memcpy(want + KVT_ERING_ALIGN, &h, 8);
    memcpy(want + 2 * KVT_ERING_ALIGN, &h, 8);
    assert_memory_equal(rec, want, sizeof(rec));
}

/* A control page of the 16-byte-record layout (version 2) is not opened: the two
 * sides would disagree on where every record starts. */
static void test_other_version_refused(void **state)
{
    struct kvt_cring *r = NULL;
    int evfd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);

    (void)state;
    node_create();
    n.ctl->version = 2;
    assert_int_equal(kvt__cring_open(n.memfd, evfd, &r), -EPROTO);
    assert_null(r);
    n.ctl->version = KVT_ERING_VERSION;
    n.ctl->magic = 0x32304752544b564bull; /* version 2's magic */
    assert_int_equal(kvt__cring_open(n.memfd, evfd, &r), -EPROTO);
    n.ctl->magic = KVT_ERING_MAGIC;
    assert_int_equal(kvt__cring_open(n.memfd, evfd, &r), 0);
    kvt__cring_close(r); /* (closes evfd) */
    munmap(n.map, KVT_ERING_CTL_BYTES + 2 * CAP);
    close(n.memfd);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_stale_reply_body_is_no_reply),
        cmocka_unit_test(test_many_laps_line_aligned),
        cmocka_unit_test(test_full_ring_overwrites_nothing),
        cmocka_unit_test(test_scrub_line_starts_only),
        cmocka_unit_test(test_copy_exact),
        cmocka_unit_test(test_other_version_refused),
        cmocka_unit_test(test_spin_that_lost_its_core_sleeps),
    };

    return cmocka_run_group_tests(tests, NULL, NULL);
}

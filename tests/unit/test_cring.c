/* SPDX-License-Identifier: Apache-2.0 */
/* libkvtier-client's side of the shared-memory ring (node/client/ring.c, compiled
 * into this test: its functions are internal to the library) against a node played
 * by the test, in one thread, so that every interleaving is chosen here.
 *
 * What is checked: the reply slot the engine polls before the node has answered
 * may lie, in the ring's second lap, inside an earlier reply's body; bytes there
 * that read as the awaited header are not taken for a reply (the engine scrubs
 * the bodies it consumed), and a reply published there afterwards is. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <unistd.h>

#include "test_util.h"

#include "kvt/alloc.h"
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
 * 32 bytes and the ring's size is a multiple of that). */
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

static void test_stale_reply_body_is_no_reply(void **state)
{
    struct kvt_cring *r;
    uint8_t req[8] = {1, 2, 3, 4, 5, 6, 7, 8}, body[256], small[8] = {0x81};
    uint8_t *buf = NULL;
    size_t cap = 0, len = 0;
    uint32_t seq = 0;
    uint64_t poison_at, pos;
    uint32_t want_at[CAP / 16] = {0}, s;
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
    /* The next lap: small replies (32-byte records) from the poisoned one's end on;
     * the sequence number the engine awaits at each slot it polls. */
    pos = poison_at + kvt_ering_rec_bytes(sizeof(body));
    s = n.req_seq + 2;
    while (pos < poison_at + CAP + kvt_ering_rec_bytes(sizeof(body))) {
        uint64_t off = pos & (CAP - 1);

        if (pos >= poison_at + CAP)
            want_at[off / 16] = s;
        if (off + 32 > CAP) {
            pos += CAP - off;
        } else {
            pos += 32;
            s++;
            calls++;
        }
    }
    memset(body, 0x5a, sizeof(body));
    for (uint64_t o = 0; o + 16 <= sizeof(body); o += 16) {
        uint64_t at = ((poison_at & (CAP - 1)) + KVT_ERING_REC_BYTES + o) & (CAP - 1);
        struct kvt_ering_rec h = {.len = 8, .seq = want_at[at / 16], .ack = 0};

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

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_stale_reply_body_is_no_reply),
    };

    return cmocka_run_group_tests(tests, NULL, NULL);
}

/* SPDX-License-Identifier: Apache-2.0 */
/* White-box test of the verbs backend's READ work-request builder (vb_build_wrs in
 * transport/verbs/verbs.c, included here for its statics), on any machine: no device
 * is opened, the registrations are fakes with known keys. It covers what the
 * soft-RoCE guests cannot (1 GiB of memory): ops that cross the 2 GiB piece boundary
 * of the remote or the local registration, and the limits of one WR (max_sge, the
 * port's max_msg_sz), plus merging adjacent remote ranges into one scatter list. */
#include "../../transport/verbs/verbs.c"

#include <setjmp.h>
#include <stdarg.h>
#include <stdlib.h>
#include <cmocka.h>

#define GiB (1ull << 30)

/* Fakes: an endpoint on device 0 and registrations of n pieces whose keys encode the
 * piece (rkey 0x100 + k, lkey 0x200 + k). The local base is a fake address: the
 * builder only computes with it. */
static struct {
    struct vb_ep ep;
    struct kvt_tp_rkey *rk;
    struct kvt_tp_mr *lm;
    struct ibv_mr mrs[8];
} F;

static void fake_setup(uint64_t rlen, uint64_t llen, unsigned max_sge, uint32_t max_msg)
{
    uint32_t rn = vb_n_pieces(rlen), ln = vb_n_pieces(llen);

    memset(&F.ep, 0, sizeof(F.ep));
    F.ep.max_sge = max_sge;
    F.ep.max_msg_sz = max_msg;
    F.rk = calloc(1, sizeof(*F.rk) + rn * sizeof(uint32_t));
    F.lm = calloc(1, sizeof(*F.lm) + ln * sizeof(struct ibv_mr *));
    assert_non_null(F.rk);
    assert_non_null(F.lm);
    F.rk->len = rlen;
    F.rk->page_off = 0x123;
    F.rk->n_pieces = rn;
    for (uint32_t k = 0; k < rn; k++)
        F.rk->rkey[k] = 0x100 + k;
    F.lm->base = (uint8_t *)(uintptr_t)0x10000000ull;
    F.lm->len = llen;
    F.lm->n_pieces = ln;
    for (uint32_t k = 0; k < ln; k++) {
        F.mrs[k].lkey = 0x200 + k;
        F.lm->mr[k] = &F.mrs[k];
    }
}

static void fake_teardown(void)
{
    free(F.rk);
    free(F.lm);
}

static struct vb_batch *batch_of(const struct kvt_read_op *ops, size_t n)
{
    struct vb_batch *b = calloc(1, sizeof(*b) + n * sizeof(*ops));

    assert_non_null(b);
    memcpy(b->ops, ops, n * sizeof(*ops));
    b->n = n;
    b->rk = F.rk;
    b->local = F.lm;
    return b;
}

static uint64_t wr_bytes(const struct ibv_send_wr *wr)
{
    uint64_t t = 0;

    for (int i = 0; i < wr->num_sge; i++)
        t += wr->sg_list[i].length;
    return t;
}

/* A remote range across the 2 GiB boundary: two WRs, each in its own piece with
 * that piece's rkey; the remote address is page offset + region offset. */
static void test_remote_boundary(void **state)
{
    struct kvt_read_op op = {.remote_off = 2 * GiB - 4096, .local_off = 0, .len = 12288};
    struct vb_batch *b;
    unsigned nw;

    fake_setup(3 * GiB, 1 * GiB, 32, 1u << 30);
    b = batch_of(&op, 1);
    nw = vb_build_wrs(&F.ep, b, 16);
    assert_int_equal(nw, 2);
    assert_int_equal(F.ep.wrs[0].wr.rdma.rkey, 0x100);
    assert_int_equal(F.ep.wrs[0].wr.rdma.remote_addr, 0x123 + 2 * GiB - 4096);
    assert_int_equal(wr_bytes(&F.ep.wrs[0]), 4096);
    assert_int_equal(F.ep.wrs[1].wr.rdma.rkey, 0x101);
    assert_int_equal(F.ep.wrs[1].wr.rdma.remote_addr, 0x123 + 2 * GiB);
    assert_int_equal(wr_bytes(&F.ep.wrs[1]), 8192);
    assert_int_equal(F.ep.wrs[1].sg_list[0].addr, 0x10000000ull + 4096);
    assert_ptr_equal(F.ep.wrs[0].next, &F.ep.wrs[1]);
    assert_null(F.ep.wrs[1].next);
    assert_int_equal(F.ep.wrs[0].opcode, IBV_WR_RDMA_READ);
    assert_int_equal(b->cur_op, 1); /* all posted */
    free(b);
    fake_teardown();
}

/* A local range across the local 2 GiB boundary: one WR (the remote side is
 * contiguous), two scatter entries with the two pieces' lkeys. */
static void test_local_boundary(void **state)
{
    struct kvt_read_op op = {.remote_off = 4096, .local_off = 2 * GiB - 100, .len = 300};
    struct vb_batch *b;

    fake_setup(1 * GiB, 3 * GiB, 32, 1u << 30);
    b = batch_of(&op, 1);
    assert_int_equal(vb_build_wrs(&F.ep, b, 16), 1);
    assert_int_equal(F.ep.wrs[0].num_sge, 2);
    assert_int_equal(F.ep.wrs[0].sg_list[0].lkey, 0x200);
    assert_int_equal(F.ep.wrs[0].sg_list[0].length, 100);
    assert_int_equal(F.ep.wrs[0].sg_list[1].lkey, 0x201);
    assert_int_equal(F.ep.wrs[0].sg_list[1].length, 200);
    assert_int_equal(F.ep.wrs[0].sg_list[1].addr, 0x10000000ull + 2 * GiB);
    free(b);
    fake_teardown();
}

/* Adjacent remote ranges share a WR (scatter list) up to max_sge; a gap starts a new
 * WR; max_msg_sz splits a long op; max_wr stops the chain and the cursor resumes. */
static void test_merge_and_limits(void **state)
{
    struct kvt_read_op ops[10];
    struct vb_batch *b;
    unsigned nw;

    fake_setup(1 * GiB, 1 * GiB, 4, 64 * 1024);
    for (int i = 0; i < 6; i++) /* 6 adjacent remote ranges, scattered locally */
        ops[i] = (struct kvt_read_op){
            .remote_off = 1000 + i * 100ull, .local_off = (5 - i) * 4096ull, .len = 100};
    ops[6] = (struct kvt_read_op){.remote_off = 9000, .local_off = 65536, .len = 50}; /* gap */
    ops[7] = (struct kvt_read_op){
        .remote_off = 1u << 20, .local_off = 1u << 20, .len = 200 * 1024}; /* > max_msg_sz */
    b = batch_of(ops, 8);
    nw = vb_build_wrs(&F.ep, b, 16);
    /* 4 + 2 sges, then the gap's own WR, then 200 KiB in 64 KiB WRs (4). */
    assert_int_equal(nw, 7);
    assert_int_equal(F.ep.wrs[0].num_sge, 4);
    assert_int_equal(wr_bytes(&F.ep.wrs[0]), 400);
    assert_int_equal(F.ep.wrs[1].num_sge, 2);
    assert_int_equal(F.ep.wrs[1].wr.rdma.remote_addr, 0x123 + 1400);
    assert_int_equal(F.ep.wrs[1].sg_list[0].addr, 0x10000000ull + 1 * 4096);
    assert_int_equal(F.ep.wrs[2].wr.rdma.remote_addr, 0x123 + 9000);
    for (int i = 3; i < 6; i++)
        assert_int_equal(wr_bytes(&F.ep.wrs[i]), 64 * 1024);
    assert_int_equal(wr_bytes(&F.ep.wrs[6]), 8 * 1024);
    assert_int_equal(F.ep.wrs[6].wr.rdma.remote_addr, 0x123 + (1u << 20) + 3 * 65536);
    free(b);

    /* The same batch two WRs at a time: the cursor resumes where it stopped. */
    b = batch_of(ops, 8);
    uint64_t total = 0;
    unsigned calls = 0;

    while (b->cur_op < b->n) {
        nw = vb_build_wrs(&F.ep, b, 2);
        assert_true(nw >= 1 && nw <= 2);
        for (unsigned i = 0; i < nw; i++)
            total += wr_bytes(&F.ep.wrs[i]);
        calls++;
    }
    assert_int_equal(total, 6 * 100 + 50 + 200 * 1024);
    assert_int_equal(calls, 4);
    free(b);
    fake_teardown();
}

/* Handles: pack/unpack round trip of a fake remote registration, and the checks
 * unpack makes on bytes a peer sent. */
static void test_handle_checks(void **state)
{
    struct vb_tp tp = {.n_dev = 1};
    struct vb_dev dev = {.guid = 0x1122334455667788ull};
    struct kvt_tp_mr *mr = calloc(1, sizeof(*mr) + 2 * sizeof(struct ibv_mr *));
    struct ibv_mr m[2] = {{.rkey = 0xaaaa}, {.rkey = 0xbbbb}};
    struct vb_ep ep = {.tp = &tp, .state = EP_CONNECTED, .peer_guid = dev.guid};
    uint8_t buf[256];
    size_t len;
    struct kvt_tp_rkey *rk;

    assert_non_null(mr);
    tp.devs = &dev;
    kvt_list_init(&tp.rkeys);
    mr->tp = &tp;
    mr->remote = true;
    mr->len = 2 * GiB + 5;
    mr->n_pieces = 2;
    mr->page_off = 0x40;
    mr->mr[0] = &m[0];
    mr->mr[1] = &m[1];
    assert_int_equal(vb_pack(mr, buf, 10, &len), -ENOSPC);
    assert_int_equal(vb_pack(mr, buf, sizeof(buf), &len), 0);
    assert_int_equal(len, sizeof(struct vb_handle_hdr) + 8 + 8);
    assert_int_equal(vb_unpack(&ep.pub, buf, len, &rk), 0);
    assert_int_equal(rk->len, 2 * GiB + 5);
    assert_int_equal(rk->rkey[0], 0xaaaa);
    assert_int_equal(rk->rkey[1], 0xbbbb);
    assert_int_equal(rk->page_off, 0x40);
    vb_rkey_destroy(rk);
    assert_true(kvt_list_empty(&tp.rkeys));
    /* Truncated, trailing bytes, a wrong piece count, another device: refused. */
    assert_int_equal(vb_unpack(&ep.pub, buf, len - 1, &rk), -EPROTO);
    assert_int_equal(vb_unpack(&ep.pub, buf, 4, &rk), -EPROTO);
    buf[len] = 0;
    assert_int_equal(vb_unpack(&ep.pub, buf, len + 1, &rk), -EPROTO);
    struct vb_handle_hdr h;

    memcpy(&h, buf, sizeof(h));
    h.n_pieces = htole32(1); /* 2 GiB + 5 needs 2 */
    memcpy(buf, &h, sizeof(h));
    assert_int_equal(vb_unpack(&ep.pub, buf, len - 4, &rk), -EPROTO);
    h.n_pieces = htole32(2);
    memcpy(buf, &h, sizeof(h));
    ep.peer_guid = 1;
    assert_int_equal(vb_unpack(&ep.pub, buf, len, &rk), -ENODEV);
    ep.state = EP_DYING;
    assert_int_equal(vb_unpack(&ep.pub, buf, len, &rk), -ENOTCONN);
    free(mr);
}

/* kvt_tp_expose's windows: sorted, touching and overlapping ranges merged, cut at
 * 2 GiB pieces; past the cap -EMSGSIZE. */
static void test_expose_windows(void **state)
{
    struct kvt_tp_range r[] = {{.off = 3 * 4096, .len = 4096},
                               {.off = 0, .len = 4096},
                               {.off = 4096, .len = 4096},    /* touches the first */
                               {.off = 4096 + 10, .len = 20}, /* inside */
                               {.off = 2 * GiB - 100, .len = 300}};
    struct kvt_tp_range w[8];

    (void)state;
    assert_int_equal(vb_windows(r, 5, w, 8), 4);
    assert_int_equal(w[0].off, 0);
    assert_int_equal(w[0].len, 8192);
    assert_int_equal(w[1].off, 3 * 4096);
    assert_int_equal(w[1].len, 4096);
    assert_int_equal(w[2].off, 2 * GiB - 100); /* cut at the piece boundary */
    assert_int_equal(w[2].len, 100);
    assert_int_equal(w[3].off, 2 * GiB);
    assert_int_equal(w[3].len, 200);
    assert_int_equal(vb_windows(r, 5, w, 3), -EMSGSIZE);
}

/* An expose handle as the reader sees it: READs inside its windows (a run of
 * touching windows too) are cut at window ends, each WR with its window's rkey;
 * anything outside is refused before posting; malformed handles are refused. */
static void test_grant_handle(void **state)
{
    struct vb_tp tp = {0};
    struct vb_ep ep = {
        .tp = &tp, .state = EP_CONNECTED, .peer_guid = 0x77, .max_sge = 4, .max_msg_sz = 1u << 30};
    struct {
        struct vb_grant_hdr h;
        struct vb_win_wire w[3];
    } hd = {
        .h = {.magic = htole32(VB_GRANT_MAGIC),
              .version = htole16(VB_VERSION),
              .n_win = htole16(3),
              .guid = htole64(0x77),
              .len = htole64(1 << 20),
              .page_off = htole32(0x10)},
        .w = {{.off = htole64(4096), .len = htole32(4096), .rkey = htole32(0xa1)},
              {.off = htole64(8192), .len = htole32(4096), .rkey = htole32(0xa2)},
              {.off = htole64(65536), .len = htole32(4), .rkey = htole32(0xa3)}},
    };
    struct kvt_read_op op = {.remote_off = 6144, .local_off = 0, .len = 4096};
    struct kvt_tp_rkey *rk;
    struct vb_batch *b;
    uint64_t end;

    (void)state;
    kvt_list_init(&tp.rkeys);
    assert_int_equal(vb_unpack(&ep.pub, &hd, sizeof(hd), &rk), 0);
    assert_int_equal(rk->n_win, 3);
    assert_int_equal(vb_rkey_at(rk, 65536 + 3, &end), 0xa3);
    assert_int_equal(end, 65540);
    assert_true(vb_rkey_covers(rk, 6144, 4096)); /* two touching windows */
    assert_true(vb_rkey_covers(rk, 65536, 4));
    assert_false(vb_rkey_covers(rk, 0, 4096));    /* before the first */
    assert_false(vb_rkey_covers(rk, 8192, 8192)); /* past the second */
    assert_false(vb_rkey_covers(rk, 65536, 5));   /* past the third */
    assert_false(vb_rkey_covers(rk, 12288, 4));   /* between */
    fake_setup(1 << 20, 1 << 20, 4, 1u << 30);
    b = batch_of(&op, 1);
    b->rk = rk;
    F.ep.max_sge = 4;
    assert_int_equal(vb_build_wrs(&F.ep, b, 16), 2);
    assert_int_equal(F.ep.wrs[0].wr.rdma.rkey, 0xa1);
    assert_int_equal(F.ep.wrs[0].wr.rdma.remote_addr, 0x10 + 6144);
    assert_int_equal(wr_bytes(&F.ep.wrs[0]), 2048);
    assert_int_equal(F.ep.wrs[1].wr.rdma.rkey, 0xa2);
    assert_int_equal(F.ep.wrs[1].wr.rdma.remote_addr, 0x10 + 8192);
    assert_int_equal(wr_bytes(&F.ep.wrs[1]), 2048);
    free(b);
    fake_teardown();
    vb_rkey_destroy(rk);
    assert_true(kvt_list_empty(&tp.rkeys));

    /* Overlapping, empty, across a piece, out of the registration, another
     * device, a count that does not match the length: refused. */
    hd.w[1].off = htole64(6000);
    assert_int_equal(vb_unpack(&ep.pub, &hd, sizeof(hd), &rk), -EPROTO);
    hd.w[1].off = htole64(8192);
    hd.w[2].len = 0;
    assert_int_equal(vb_unpack(&ep.pub, &hd, sizeof(hd), &rk), -EPROTO);
    hd.w[2].len = htole32(4);
    hd.w[2].off = htole64((1 << 20) - 2);
    assert_int_equal(vb_unpack(&ep.pub, &hd, sizeof(hd), &rk), -EPROTO);
    hd.w[2].off = htole64(65536);
    assert_int_equal(vb_unpack(&ep.pub, &hd, sizeof(hd) - 1, &rk), -EPROTO);
    hd.h.n_win = htole16(2);
    assert_int_equal(vb_unpack(&ep.pub, &hd, sizeof(hd), &rk), -EPROTO);
    hd.h.n_win = htole16(3);
    hd.h.guid = htole64(0x78);
    assert_int_equal(vb_unpack(&ep.pub, &hd, sizeof(hd), &rk), -ENODEV);
    hd.h.guid = htole64(0x77);
    hd.h.len = htole64(4 * GiB);
    hd.w[2].off = htole64(2 * GiB - 2);
    assert_int_equal(vb_unpack(&ep.pub, &hd, sizeof(hd), &rk), -EPROTO);
    assert_true(kvt_list_empty(&tp.rkeys));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_remote_boundary),  cmocka_unit_test(test_local_boundary),
        cmocka_unit_test(test_merge_and_limits), cmocka_unit_test(test_handle_checks),
        cmocka_unit_test(test_expose_windows),   cmocka_unit_test(test_grant_handle),
    };

    return cmocka_run_group_tests_name("verbs_wr", tests, NULL, NULL);
}

/* White-box test of who may READ through a verbs endpoint (transport/verbs/verbs.c,
 * included here for its statics; its "Access" paragraph), on any machine: no device
 * is opened. The linker wraps ibv_modify_qp, ibv_query_qp and rdma_init_qp_attr
 * (-Wl,--wrap, tests/rdma/CMakeLists.txt): each call is recorded and answered from
 * the test, so what the backend asks of the device is checked exactly:
 *   - every QP transition carries our access flags, never what rdma_cm computed:
 *     none before ep_authorize (the kernel's CM grants remote write, read and
 *     atomics at INIT on the passive side), IBV_ACCESS_REMOTE_READ alone after it;
 *   - ep_authorize is one RTS->RTS modify of the access flags only, once; refused
 *     (-ENOTCONN, nothing asked of the device) outside CONNECTED; a failure fails
 *     the endpoint, and failing an endpoint moves its QP to the error state;
 *   - receives the device flushed before authorization (it refused a peer's RDMA
 *     request) close the endpoint with -EACCES, and so does our READ that a peer
 *     refused;
 *   - the handshake's private data carries no rkey and no address, and an accept
 *     answers the read depth the requester asked for;
 *   - ep_info reports what ibv_query_qp says the QP allows.
 * The soft-RoCE guests check the same against a real device (verbs_attack.c). */
#include "../../transport/verbs/verbs.c"

#include <setjmp.h>
#include <stdarg.h>
#include <stdlib.h>
#include <cmocka.h>

int __wrap_ibv_modify_qp(struct ibv_qp *qp, struct ibv_qp_attr *attr, int attr_mask);
int __wrap_ibv_query_qp(struct ibv_qp *qp, struct ibv_qp_attr *attr, int attr_mask,
                        struct ibv_qp_init_attr *init_attr);
int __wrap_rdma_init_qp_attr(struct rdma_cm_id *id, struct ibv_qp_attr *qp_attr, int *qp_attr_mask);

#define MAX_CALLS 8

static struct {
    /* what the backend asked */
    unsigned n_modify;
    struct ibv_qp_attr modify[MAX_CALLS];
    int modify_mask[MAX_CALLS];
    struct ibv_qp *modify_qp[MAX_CALLS];
    unsigned n_query;
    int query_mask;
    /* the answers */
    int modify_ret;             /* what ibv_modify_qp returns */
    struct ibv_qp_attr cm_attr; /* what rdma_init_qp_attr fills in (qp_state kept) */
    int cm_mask;
    int query_access; /* the QP's access flags, for ibv_query_qp */
} W;

int __wrap_ibv_modify_qp(struct ibv_qp *qp, struct ibv_qp_attr *attr, int attr_mask)
{
    assert_true(W.n_modify < MAX_CALLS);
    W.modify[W.n_modify] = *attr;
    W.modify_mask[W.n_modify] = attr_mask;
    W.modify_qp[W.n_modify] = qp;
    W.n_modify++;
    return W.modify_ret;
}

int __wrap_ibv_query_qp(struct ibv_qp *qp, struct ibv_qp_attr *attr, int attr_mask,
                        struct ibv_qp_init_attr *init_attr)
{
    W.n_query++;
    W.query_mask = attr_mask;
    memset(attr, 0, sizeof(*attr));
    memset(init_attr, 0, sizeof(*init_attr));
    attr->qp_access_flags = W.query_access;
    return 0;
}

int __wrap_rdma_init_qp_attr(struct rdma_cm_id *id, struct ibv_qp_attr *qp_attr, int *qp_attr_mask)
{
    enum ibv_qp_state st = qp_attr->qp_state;

    *qp_attr = W.cm_attr;
    qp_attr->qp_state = st;
    *qp_attr_mask = W.cm_mask;
    return 0;
}

/* Fakes: a transport, a device and a CONNECTED endpoint whose QP is a plain struct
 * (the wrapped calls never dereference it). */
static struct {
    struct vb_tp tp;
    struct vb_dev dev;
    struct vb_ep ep;
    struct ibv_qp qp;
} F;

static int setup(void **state)
{
    (void)state;
    memset(&W, 0, sizeof(W));
    memset(&F, 0, sizeof(F));
    F.tp.pub.ops = &kvt_verbs_transport_ops;
    F.tp.pub.cfg.recv_credits = 64;
    F.tp.pub.cfg.max_msg_bytes = 65536;
    kvt_list_init(&F.tp.eps);
    F.dev.guid = 0x0011223344556677ull;
    F.dev.attr.max_qp_rd_atom = 16;
    F.dev.attr.max_qp_init_rd_atom = 16;
    F.qp.qp_num = 0x1234;
    F.ep.tp = &F.tp;
    F.ep.pub.tp = &F.tp.pub;
    F.ep.dev = &F.dev;
    F.ep.qp = &F.qp;
    F.ep.state = EP_CONNECTED;
    kvt_list_init(&F.ep.node);
    kvt_list_init(&F.ep.batches);
    kvt_list_init(&F.ep.pending);
    return 0;
}

#define ALL_REMOTE (IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_ATOMIC)

/* The kernel CM's INIT for an accepted connection whose peer asked for a read depth:
 * remote write, read and atomics. Ours: none, and the flags are always in the mask. */
static void test_restrict_before_authorize(void **state)
{
    struct ibv_qp_attr a = {.qp_state = IBV_QPS_INIT, .qp_access_flags = ALL_REMOTE};
    int mask = IBV_QP_STATE | IBV_QP_ACCESS_FLAGS | IBV_QP_PKEY_INDEX | IBV_QP_PORT;

    (void)state;
    vb_qp_attr_restrict(&a, &mask, false, false, -1, -1);
    assert_int_equal(a.qp_access_flags, 0);
    assert_int_equal(mask, IBV_QP_STATE | IBV_QP_ACCESS_FLAGS | IBV_QP_PKEY_INDEX | IBV_QP_PORT);

    /* RTR and RTS: the CM does not set the flags; we still do, to none. */
    struct ibv_qp_attr r = {.qp_state = IBV_QPS_RTR, .max_dest_rd_atomic = 4};
    int rmask = IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER;

    vb_qp_attr_restrict(&r, &rmask, false, false, 9, 3);
    assert_int_equal(r.qp_access_flags, 0);
    assert_true(rmask & IBV_QP_ACCESS_FLAGS);
    assert_int_equal(r.max_dest_rd_atomic, 9); /* the accept's responder resources */

    struct ibv_qp_attr t = {.qp_state = IBV_QPS_RTS, .max_rd_atomic = 4};
    int tmask = IBV_QP_STATE | IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC;

    vb_qp_attr_restrict(&t, &tmask, false, false, 9, 3);
    assert_int_equal(t.qp_access_flags, 0);
    assert_true(tmask & IBV_QP_ACCESS_FLAGS);
    assert_int_equal(t.max_rd_atomic, 3); /* the accept's initiator depth */

    /* -1: the CM's depths stay (the active side). */
    t.max_rd_atomic = 4;
    vb_qp_attr_restrict(&t, &tmask, false, false, -1, -1);
    assert_int_equal(t.max_rd_atomic, 4);
}

/* Authorized: remote read and nothing else, whatever the CM computed. InfiniBand
 * drops the RoCE-only bits 21-23 the kernel may return, and only those. */
static void test_restrict_after_authorize_and_ib(void **state)
{
    struct ibv_qp_attr a = {.qp_state = IBV_QPS_RTS, .qp_access_flags = ALL_REMOTE};
    int mask = IBV_QP_STATE | 0xe00000 | IBV_QP_SQ_PSN;

    (void)state;
    vb_qp_attr_restrict(&a, &mask, true, false, -1, -1);
    assert_int_equal(a.qp_access_flags, IBV_ACCESS_REMOTE_READ);
    assert_int_equal(mask, IBV_QP_STATE | 0xe00000 | IBV_QP_SQ_PSN | IBV_QP_ACCESS_FLAGS);
    vb_qp_attr_restrict(&a, &mask, true, true, -1, -1);
    assert_int_equal(mask, IBV_QP_STATE | IBV_QP_SQ_PSN | IBV_QP_ACCESS_FLAGS);
}

/* vb_qp_modify takes rdma_cm's attributes (PSN, peer QP, depths) and replaces only the
 * access flags; the whole setup of a connection asks for no remote access at all. */
static void test_transitions_grant_nothing(void **state)
{
    (void)state;
    W.cm_attr = (struct ibv_qp_attr){.qp_access_flags = ALL_REMOTE,
                                     .rq_psn = 777,
                                     .sq_psn = 888,
                                     .dest_qp_num = 55,
                                     .max_dest_rd_atomic = 16,
                                     .max_rd_atomic = 16};
    W.cm_mask = IBV_QP_STATE | IBV_QP_ACCESS_FLAGS | IBV_QP_RQ_PSN | IBV_QP_DEST_QPN;
    assert_int_equal(vb_qp_modify(&F.ep, IBV_QPS_INIT, -1, -1), 0);
    assert_int_equal(vb_qp_ready(&F.ep, 2, 1), 0); /* the passive side's RTR and RTS */
    assert_int_equal(W.n_modify, 3);
    for (unsigned i = 0; i < W.n_modify; i++) {
        assert_ptr_equal(W.modify_qp[i], &F.qp);
        assert_int_equal(W.modify[i].qp_access_flags, 0);
        assert_true(W.modify_mask[i] & IBV_QP_ACCESS_FLAGS);
        assert_int_equal(W.modify[i].rq_psn, 777);
        assert_int_equal(W.modify[i].dest_qp_num, 55);
    }
    assert_int_equal(W.modify[0].qp_state, IBV_QPS_INIT);
    assert_int_equal(W.modify[1].qp_state, IBV_QPS_RTR);
    assert_int_equal(W.modify[1].max_dest_rd_atomic, 2);
    assert_int_equal(W.modify[2].qp_state, IBV_QPS_RTS);
    assert_int_equal(W.modify[2].max_rd_atomic, 1);
}

/* ep_authorize: one modify of the access flags alone (RTS->RTS: no state in the
 * mask), to remote read alone; again: nothing asked, 0. A transition after it keeps
 * remote read. */
static void test_authorize(void **state)
{
    (void)state;
    assert_int_equal(kvt_verbs_transport_ops.ep_authorize(&F.ep.pub), 0);
    assert_int_equal(W.n_modify, 1);
    assert_int_equal(W.modify_mask[0], IBV_QP_ACCESS_FLAGS);
    assert_int_equal(W.modify[0].qp_access_flags, IBV_ACCESS_REMOTE_READ);
    assert_ptr_equal(W.modify_qp[0], &F.qp);
    assert_true(F.ep.authorized);
    assert_int_equal(kvt_tp_ep_authorize(&F.ep.pub), 0); /* the public wrapper */
    assert_int_equal(W.n_modify, 1);

    W.cm_attr.qp_access_flags = ALL_REMOTE;
    W.cm_mask = IBV_QP_STATE | IBV_QP_ACCESS_FLAGS;
    assert_int_equal(vb_qp_modify(&F.ep, IBV_QPS_RTS, -1, -1), 0);
    assert_int_equal(W.modify[1].qp_access_flags, IBV_ACCESS_REMOTE_READ);
}

/* Outside CONNECTED nothing is granted and the device is not asked. */
static void test_authorize_not_connected(void **state)
{
    static const enum vb_ep_state states[] = {EP_RESOLVING, EP_CONNECTING, EP_ACCEPTING, EP_DYING,
                                              EP_DEAD};

    (void)state;
    for (size_t i = 0; i < KVT_ARRAY_SIZE(states); i++) {
        F.ep.state = states[i];
        assert_int_equal(kvt_tp_ep_authorize(&F.ep.pub), -ENOTCONN);
    }
    assert_int_equal(W.n_modify, 0);
    assert_false(F.ep.authorized);
}

/* The device refuses the modify: the error comes back, the endpoint fails and its
 * QP is moved to the error state; it is not marked authorized. */
static void test_authorize_failure(void **state)
{
    (void)state;
    W.modify_ret = EINVAL;
    assert_int_equal(kvt_tp_ep_authorize(&F.ep.pub), -EINVAL);
    assert_false(F.ep.authorized);
    assert_int_equal(F.ep.state, EP_DYING);
    assert_int_equal(F.ep.err, -EINVAL);
    assert_int_equal(W.n_modify, 2);
    assert_int_equal(W.modify_mask[1], IBV_QP_STATE);
    assert_int_equal(W.modify[1].qp_state, IBV_QPS_ERR);
    assert_int_equal(kvt_tp_ep_authorize(&F.ep.pub), -ENOTCONN);
}

/* Closing an authorized endpoint stops its responder at once: QP to the error state
 * (the reap destroys it later). */
static void test_close_withdraws(void **state)
{
    (void)state;
    assert_int_equal(kvt_tp_ep_authorize(&F.ep.pub), 0);
    kvt_verbs_transport_ops.ep_close(&F.ep.pub);
    assert_int_equal(F.ep.state, EP_DYING);
    assert_int_equal(W.n_modify, 2);
    assert_int_equal(W.modify_mask[1], IBV_QP_STATE);
    assert_int_equal(W.modify[1].qp_state, IBV_QPS_ERR);
}

/* A fake CQ (ibv_poll_cq calls its context's poll_cq): one flushed receive. */
static struct ibv_context fake_ctx;
static struct ibv_cq fake_cq = {.context = &fake_ctx};
static int polls;

static int fake_poll_cq(struct ibv_cq *cq, int num, struct ibv_wc *wc)
{
    (void)cq;
    if (polls++ > 0 || num < 1)
        return 0;
    memset(wc, 0, sizeof(*wc));
    wc->wr_id = (0u << 2) | WR_RX;
    wc->status = IBV_WC_WR_FLUSH_ERR;
    return 1;
}

/* The device flushed our receives while we had not stopped the QP: before
 * authorization the peer's RDMA request was refused (the gate) and the endpoint
 * closes with -EACCES; after it, the old -ECANCELED. */
static void test_refused_request_closes(void **state)
{
    (void)state;
    fake_ctx.ops.poll_cq = fake_poll_cq;
    F.ep.cq = &fake_cq;
    polls = 0;
    assert_int_equal(vb_poll_ep(&F.ep), 1);
    assert_int_equal(F.ep.state, EP_DYING);
    assert_int_equal(F.ep.err, -EACCES);

    setup(NULL);
    F.ep.cq = &fake_cq;
    F.ep.authorized = true;
    polls = 0;
    assert_int_equal(vb_poll_ep(&F.ep), 1);
    assert_int_equal(F.ep.err, -ECANCELED);
}

static int fake_poll_refused_read(struct ibv_cq *cq, int num, struct ibv_wc *wc)
{
    (void)cq;
    if (polls++ > 0 || num < 1)
        return 0;
    memset(wc, 0, sizeof(*wc));
    wc->wr_id = (0u << 2) | WR_SEG_LAST;
    wc->status = IBV_WC_REM_INV_REQ_ERR;
    return 1;
}

/* Our READ refused by a peer that has not authorized us (rxe: remote invalid
 * request): the endpoint fails with -EACCES, as a software backend's refusal. */
static void test_our_read_refused(void **state)
{
    struct vb_seg seg = {0};
    unsigned seg_free[1];

    (void)state;
    fake_ctx.ops.poll_cq = fake_poll_refused_read;
    F.ep.cq = &fake_cq;
    F.ep.segs = &seg;
    F.ep.seg_free = seg_free;
    polls = 0;
    assert_int_equal(vb_poll_ep(&F.ep), 1);
    assert_int_equal(F.ep.state, EP_DYING);
    assert_int_equal(F.ep.err, -EACCES);
}

/* The connection's private data is the 32-byte hello and nothing else: magic,
 * version, no flags, credits, largest message, node GUID, zero. No rkey, no address.
 * The connect parameters name our own QP. */
static void test_hello_names_no_memory(void **state)
{
    struct rdma_conn_param p;
    struct vb_hello h;
    uint8_t want[32], got[32];
    uint32_t u32;
    uint16_t u16;
    uint64_t u64;

    (void)state;
    assert_int_equal(sizeof(struct vb_hello), 32);
    vb_conn_param(&F.ep, &p, &h, 0, 0, false);
    assert_ptr_equal(p.private_data, &h);
    assert_int_equal(p.private_data_len, sizeof(h));
    assert_int_equal(p.qp_num, 0x1234);
    memset(want, 0, sizeof(want));
    u32 = htole32(VB_MAGIC);
    memcpy(want, &u32, 4);
    u16 = htole16(VB_VERSION);
    memcpy(want + 4, &u16, 2);
    u32 = htole32(64);
    memcpy(want + 8, &u32, 4);
    u32 = htole32(65536);
    memcpy(want + 12, &u32, 4);
    u64 = htole64(0x0011223344556677ull);
    memcpy(want + 16, &u64, 8);
    memcpy(got, &h, sizeof(got));
    assert_memory_equal(got, want, sizeof(want));
}

/* The read depths of an accept: the CONNECT_REQUEST event gives the requester's
 * fields from our side (responder_resources: what it will initiate, ours to answer).
 * A requester that initiates 4 and answers none (it does not want to be read) gets
 * 4 responder resources and an initiator depth of 0; before this was fixed the two
 * were swapped and such a peer could not READ at all (found by verbs_attack). */
static void test_accept_read_depths(void **state)
{
    struct rdma_conn_param p;
    struct vb_hello h;

    (void)state;
    vb_conn_param(&F.ep, &p, &h, 4, 0, true);
    assert_int_equal(p.responder_resources, 4);
    assert_int_equal(p.initiator_depth, 0);
    vb_conn_param(&F.ep, &p, &h, 200, 200, true);
    assert_int_equal(p.responder_resources, 16); /* the device's max_qp_rd_atom */
    assert_int_equal(p.initiator_depth, 16);
    vb_conn_param(&F.ep, &p, &h, 0, 0, false); /* active: the device's limits */
    assert_int_equal(p.responder_resources, 16);
    assert_int_equal(p.initiator_depth, 16);
}

/* ep_info says what the QP itself allows (ibv_query_qp of the access flags). */
static void test_ep_info(void **state)
{
    char buf[128];

    (void)state;
    W.query_access = 0;
    assert_int_equal(kvt_tp_ep_info(&F.ep.pub, buf, sizeof(buf)), 0);
    assert_string_equal(buf, "rdma read over ?; peer reads ours: no");
    assert_true(W.query_mask & IBV_QP_ACCESS_FLAGS);
    W.query_access = IBV_ACCESS_REMOTE_READ;
    assert_int_equal(kvt_tp_ep_info(&F.ep.pub, buf, sizeof(buf)), 0);
    assert_string_equal(buf, "rdma read over ?; peer reads ours: yes");
    assert_int_equal(W.n_query, 2);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup(test_restrict_before_authorize, setup),
        cmocka_unit_test_setup(test_restrict_after_authorize_and_ib, setup),
        cmocka_unit_test_setup(test_transitions_grant_nothing, setup),
        cmocka_unit_test_setup(test_authorize, setup),
        cmocka_unit_test_setup(test_authorize_not_connected, setup),
        cmocka_unit_test_setup(test_authorize_failure, setup),
        cmocka_unit_test_setup(test_close_withdraws, setup),
        cmocka_unit_test_setup(test_refused_request_closes, setup),
        cmocka_unit_test_setup(test_our_read_refused, setup),
        cmocka_unit_test_setup(test_hello_names_no_memory, setup),
        cmocka_unit_test_setup(test_accept_read_depths, setup),
        cmocka_unit_test_setup(test_ep_info, setup),
    };

    return cmocka_run_group_tests_name("verbs_auth", tests, NULL, NULL);
}

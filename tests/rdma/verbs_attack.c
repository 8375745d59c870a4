/* An attacker against a node's verbs endpoint (issue #21), on a real RDMA device
 * (soft-RoCE in the tests/rdma guests): no memory of a node is readable by a peer
 * whose link has not authenticated, even one that knows the exact rkey and address.
 *
 *   verbs_attack --addr A [--results DIR]           the attack scenarios (one guest)
 *   verbs_attack --addr A --costs [--results DIR]   what each way of gating costs
 *
 * A fork is "the node": a kvt_peers (cluster/peers.c, the HMAC handshake) over the
 * verbs transport, with a 1 MiB region of a known pattern registered for remote READ.
 * Its packed handle (rkeys and offsets) is written to DIR/leaked-handle.bin: the leak
 * this test assumes (an eavesdropped GRANT, a guessed rxe rkey). The parent is the
 * attacker: plain librdmacm and libibverbs, none of the kvtier transport. It connects
 * with a well-formed connection hello (the public struct vb_hello) and posts an RDMA
 * READ of 4 KiB with the leaked rkey and address into a buffer filled with a canary:
 *   S1 right after connecting, no handshake               -> refused, canary intact
 *   S2 halfway: HELLO answered, the node waits for AUTH    -> refused, canary intact;
 *      then a handshake with a wrong secret (REFUSE)       -> fails, canary intact
 *   S3 after the full handshake (HELLO/HELLO_ACK/AUTH/AUTH_OK with the secret: the
 *      node's peers.c authorizes the endpoint at link up) -> the pattern's bytes
 *   S4 a second connection while S3's link is up, no handshake -> refused (the grant
 *      is S3's QP's alone); S3 reads again                  -> the pattern's bytes
 *   S5 S3 closed; a new connection, no handshake            -> refused
 * "Refused" means the READ completed with remote invalid request (what rxe answers
 * for a QP without remote read) or remote access error, not a timeout, and not one
 * byte of the canary changed. The node checks its side: the authenticated link's QP
 * reports remote read (ep_info, from ibv_query_qp), one handshake, one auth refusal.
 * Results in DIR/verbs_attack.txt; exit 0 only when every scenario held.
 *
 * --costs: on one connection to the node, the device work of each way to gate READs
 * per peer: the QP access flags (what the backend does: one modify), a protection
 * domain per peer (register the region once per peer) and type-2 memory windows
 * (bind per peer, invalidate at close). DIR/verbs_costs.txt; docs/rdma.md. */
#include <errno.h>
#include <getopt.h>
#include <netdb.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <endian.h>

#include <infiniband/verbs.h>
#include <rdma/rdma_cma.h>

#include "kvt/auth.h"
#include "kvt/peers.h"
#include "kvt/transport.h"
#include "kvt/wire.h"

#define NODE_ID      1
#define ATTACKER_ID  2
#define NS_DESC      "kvtier verbs_attack"
#define REGION_BYTES (1u << 20)
#define READ_OFF     8192u
#define READ_LEN     4096u
#define CANARY       0xa5
#define RX_CREDITS   16u
#define RX_N         (RX_CREDITS + 2)
#define MSG_MAX      16384u
#define BUF_SZ       (8u + MSG_MAX)
#define WAIT_MS      30000
#define WR_TX        1000u
#define WR_READ      1001u
#define WR_MW        1002u

/* The public connection hello of the verbs backend (transport/verbs/verbs.c). */
struct hello {
    uint32_t magic;
    uint16_t version;
    uint16_t flags;
    uint32_t credits;
    uint32_t max_msg;
    uint64_t guid;
    uint64_t reserved;
};
#define HELLO_MAGIC 0x6b767476u

static uint8_t pattern_byte(uint64_t o)
{
    uint64_t x = o * 0x9e3779b97f4a7c15ull;

    return (uint8_t)(x >> 56 ^ o);
}

static uint64_t now_us(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000ull + (uint64_t)ts.tv_nsec / 1000;
}

static const char *results_dir(const char *opt)
{
    const char *d = opt != NULL ? opt : getenv("KVT_RESULTS");

    return d != NULL ? d : ".";
}

/* ---- the node (a fork) ---- */

static volatile sig_atomic_t node_stop;

static void node_on_term(int sig)
{
    (void)sig;
    node_stop = 1;
}

/* costs: the attacker's connection stays unauthenticated for minutes (no handshake
 * deadline) and the attack checks do not apply. */
static int node_main(const char *addr, const uint8_t *secret, size_t slen, const char *leak_path,
                     int ready_fd, bool costs)
{
    struct kvt_peers_config cfg = {
        .node_id = NODE_ID,
        .secret = secret,
        .secret_len = slen,
        .listen_addr = addr,
        .heartbeat_ms = 10000, /* the attacker sends none: nobody is declared down */
        .handshake_timeout_ms = costs ? 3600u * 1000u : 0,
        .transport = {.backend = "verbs"},
    };
    struct sigaction sa = {.sa_handler = node_on_term};
    struct kvt_peers_counts c;
    struct kvt_peers *p;
    struct kvt_transport *tp;
    struct kvt_tp_mr *mr = NULL;
    struct kvt_tp_ep *seen = NULL;
    uint8_t handle[KVT_TP_MAX_HANDLE_SIZE];
    size_t hl;
    uint8_t *region;
    unsigned links_up = 0;
    int errors = 0, rc;
    FILE *f;

    sigaction(SIGTERM, &sa, NULL);
    kvt_auth_namespace(NS_DESC, cfg.ns);
    region = aligned_alloc(4096, REGION_BYTES);
    if (region == NULL)
        return 1;
    for (uint64_t o = 0; o < REGION_BYTES; o++)
        region[o] = pattern_byte(o);
    rc = kvt_peers_create(&cfg, &p);
    if (rc != 0) {
        fprintf(stderr, "node: kvt_peers_create on %s: %s\n", addr, strerror(-rc));
        return 1;
    }
    tp = kvt_peers_transport(p);
    rc = kvt_tp_reg_remote(tp, region, REGION_BYTES, &mr);
    if (rc == 0)
        rc = kvt_tp_pack(tp, mr, handle, sizeof(handle), &hl);
    if (rc != 0) {
        fprintf(stderr, "node: registering the region: %s\n", strerror(-rc));
        return 1;
    }
    f = fopen(leak_path, "wb");
    if (f == NULL || fwrite(handle, 1, hl, f) != hl || fclose(f) != 0) {
        fprintf(stderr, "node: writing %s: %s\n", leak_path, strerror(errno));
        return 1;
    }
    dprintf(ready_fd, "%u\n", kvt_peers_port(p));
    close(ready_fd);
    fprintf(stderr, "node: listening on %s:%u, handle leaked to %s\n", addr, kvt_peers_port(p),
            leak_path);
    while (!node_stop) {
        struct kvt_tp_ep *ep;
        int n = kvt_peers_progress(p);

        if (n < 0) {
            fprintf(stderr, "node: progress: %s\n", strerror(-n));
            errors++;
            break;
        }
        ep = kvt_peers_link(p, ATTACKER_ID);
        if (ep != NULL && ep != seen) {
            char info[128];

            seen = ep;
            links_up++;
            rc = kvt_tp_ep_info(ep, info, sizeof(info));
            fprintf(stderr, "node: link to node %d is up: %s\n", ATTACKER_ID,
                    rc == 0 ? info : strerror(-rc));
            if (rc != 0 || strstr(info, "peer reads ours: yes") == NULL) {
                fprintf(stderr, "node: FAIL the authenticated link's QP does not allow reads\n");
                errors++;
            }
        }
        if (n == 0 && kvt_peers_arm(p) == 0) {
            struct pollfd pfd = {.fd = kvt_peers_event_fd(p), .events = POLLIN};
            int ms = kvt_peers_next_timeout_ms(p);

            poll(&pfd, 1, ms < 0 || ms > 50 ? 50 : ms);
        }
    }
    kvt_peers_counts(p, &c);
    fprintf(stderr, "node: handshakes %llu, refused %llu (auth %llu, timeout %llu), links up %u\n",
            (unsigned long long)c.handshakes, (unsigned long long)c.refused,
            (unsigned long long)c.refused_by_reason[KVT_WIRE_R_AUTH],
            (unsigned long long)c.refused_by_reason[KVT_PEERS_R_TIMEOUT], links_up);
    if (!costs &&
        (c.handshakes != 1 || links_up != 1 || c.refused_by_reason[KVT_WIRE_R_AUTH] < 1)) {
        fprintf(stderr, "node: FAIL expected one handshake (S3) and an auth refusal (S2)\n");
        errors++;
    }
    kvt_tp_dereg(mr, tp);
    kvt_peers_destroy(p);
    free(region);
    return errors == 0 ? 0 : 1;
}

/* ---- the attacker: plain librdmacm + libibverbs ---- */

struct atk {
    struct rdma_event_channel *ech;
    struct rdma_cm_id *id;
    struct ibv_pd *pd;
    struct ibv_cq *cq;
    struct ibv_mr *mr;
    uint8_t *mem; /* RX_N receive buffers, one send buffer, the READ destination */
    uint64_t peer_guid;
    unsigned rx_owed;
    unsigned ready[RX_N], n_ready; /* received, not yet looked at */
    uint32_t ready_len[RX_N];
    bool tx_done, read_done, mw_done;
    enum ibv_wc_status tx_status, read_status, mw_status;
    bool disconnected;
};

static uint8_t *atk_rx(struct atk *a, unsigned i)
{
    return a->mem + (size_t)i * BUF_SZ;
}
static uint8_t *atk_tx(struct atk *a)
{
    return a->mem + (size_t)RX_N * BUF_SZ;
}
static uint8_t *atk_dst(struct atk *a)
{
    return a->mem + (size_t)(RX_N + 1) * BUF_SZ;
}

/* The next rdma_cm event within ms; its private data copied out. */
static int atk_cm_event(struct atk *a, enum rdma_cm_event_type *type, void *pdata, size_t *plen,
                        int ms)
{
    struct pollfd pfd = {.fd = a->ech->fd, .events = POLLIN};
    struct rdma_cm_event *ev;

    if (poll(&pfd, 1, ms) != 1)
        return -ETIMEDOUT;
    if (rdma_get_cm_event(a->ech, &ev) != 0)
        return -errno;
    *type = ev->event;
    if (pdata != NULL && plen != NULL) {
        size_t n = ev->param.conn.private_data_len;

        if (ev->param.conn.private_data == NULL)
            n = 0;
        if (n > *plen)
            n = *plen;
        memcpy(pdata, ev->param.conn.private_data, n);
        *plen = n;
    }
    rdma_ack_cm_event(ev);
    return 0;
}

static int atk_expect(struct atk *a, enum rdma_cm_event_type want, void *pdata, size_t *plen)
{
    enum rdma_cm_event_type t;
    int rc = atk_cm_event(a, &t, pdata, plen, WAIT_MS);

    if (rc != 0)
        return rc;
    if (t != want) {
        fprintf(stderr, "attacker: %s while waiting for %s\n", rdma_event_str(t),
                rdma_event_str(want));
        return t == RDMA_CM_EVENT_REJECTED ? -ECONNREFUSED : -EPROTO;
    }
    return 0;
}

static int atk_post_rx(struct atk *a, unsigned i)
{
    struct ibv_sge sge = {.addr = (uintptr_t)atk_rx(a, i), .length = BUF_SZ, .lkey = a->mr->lkey};
    struct ibv_recv_wr wr = {.wr_id = i, .sg_list = &sge, .num_sge = 1}, *bad;

    return ibv_post_recv(a->id->qp, &wr, &bad) == 0 ? 0 : -EIO;
}

static void atk_close(struct atk *a)
{
    if (a->id != NULL && a->id->qp != NULL) {
        enum rdma_cm_event_type t;

        rdma_disconnect(a->id);
        while (!a->disconnected && atk_cm_event(a, &t, NULL, NULL, 5000) == 0)
            a->disconnected = t == RDMA_CM_EVENT_DISCONNECTED;
        rdma_destroy_qp(a->id);
    }
    if (a->mr != NULL)
        ibv_dereg_mr(a->mr);
    if (a->cq != NULL)
        ibv_destroy_cq(a->cq);
    if (a->pd != NULL)
        ibv_dealloc_pd(a->pd);
    if (a->id != NULL)
        rdma_destroy_id(a->id);
    if (a->ech != NULL)
        rdma_destroy_event_channel(a->ech);
    free(a->mem);
    memset(a, 0, sizeof(*a));
}

/* Connects to the node as any verbs client does: a QP whose READs may go out
 * (initiator depth 4) and a hello the backend accepts. */
static int atk_connect(struct atk *a, const char *addr, uint16_t port)
{
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM}, *ai;
    struct ibv_qp_init_attr qa = {0};
    struct ibv_device_attr da;
    struct rdma_conn_param cp = {0};
    struct hello h = {0}, sh;
    size_t shl = sizeof(sh);
    struct ibv_qp_attr q;
    struct ibv_qp_init_attr qi;
    char pstr[8];
    int rc;

    memset(a, 0, sizeof(*a));
    snprintf(pstr, sizeof(pstr), "%u", port);
    if (getaddrinfo(addr, pstr, &hints, &ai) != 0)
        return -EINVAL;
    a->ech = rdma_create_event_channel();
    rc = a->ech != NULL && rdma_create_id(a->ech, &a->id, NULL, RDMA_PS_TCP) == 0 ? 0 : -errno;
    if (rc == 0 && rdma_resolve_addr(a->id, NULL, ai->ai_addr, 5000) != 0)
        rc = -errno;
    freeaddrinfo(ai);
    if (rc == 0)
        rc = atk_expect(a, RDMA_CM_EVENT_ADDR_RESOLVED, NULL, NULL);
    if (rc == 0 && rdma_resolve_route(a->id, 5000) != 0)
        rc = -errno;
    if (rc == 0)
        rc = atk_expect(a, RDMA_CM_EVENT_ROUTE_RESOLVED, NULL, NULL);
    if (rc != 0)
        goto fail;
    a->pd = ibv_alloc_pd(a->id->verbs);
    a->cq = a->pd != NULL ? ibv_create_cq(a->id->verbs, 64, NULL, NULL, 0) : NULL;
    a->mem = calloc(RX_N + 2, BUF_SZ);
    a->mr = a->cq != NULL && a->mem != NULL
                ? ibv_reg_mr(a->pd, a->mem, (size_t)(RX_N + 2) * BUF_SZ, IBV_ACCESS_LOCAL_WRITE)
                : NULL;
    if (a->mr == NULL || ibv_query_device(a->id->verbs, &da) != 0) {
        rc = -ENOMEM;
        goto fail;
    }
    qa.send_cq = qa.recv_cq = a->cq;
    qa.qp_type = IBV_QPT_RC;
    qa.cap.max_send_wr = 16;
    qa.cap.max_recv_wr = RX_N;
    qa.cap.max_send_sge = qa.cap.max_recv_sge = 1;
    if (rdma_create_qp(a->id, a->pd, &qa) != 0) {
        rc = -errno;
        goto fail;
    }
    for (unsigned i = 0; i < RX_N && rc == 0; i++)
        rc = atk_post_rx(a, i);
    if (rc != 0)
        goto fail;
    h.magic = htole32(HELLO_MAGIC);
    h.version = htole16(1);
    h.credits = htole32(RX_CREDITS);
    h.max_msg = htole32(MSG_MAX);
    h.guid = htole64(be64toh(da.node_guid));
    cp.private_data = &h;
    cp.private_data_len = sizeof(h);
    cp.initiator_depth = 4;
    /* 1, not 0: a node before issue #21 swapped the two depths in its accept and
     * would have given 0 to read with (the attack must reach the gate, if any). */
    cp.responder_resources = 1;
    cp.retry_count = 7;
    cp.rnr_retry_count = 7;
    if (rdma_connect(a->id, &cp) != 0) {
        rc = -errno;
        goto fail;
    }
    rc = atk_expect(a, RDMA_CM_EVENT_ESTABLISHED, &sh, &shl);
    if (rc == 0 && (shl < sizeof(sh) || le32toh(sh.magic) != HELLO_MAGIC))
        rc = -EPROTO;
    if (rc != 0)
        goto fail;
    a->peer_guid = le64toh(sh.guid);
    /* Our READs can go out only with a read depth the node granted in its accept. */
    if (ibv_query_qp(a->id->qp, &q, IBV_QP_MAX_QP_RD_ATOMIC, &qi) != 0 || q.max_rd_atomic == 0) {
        rc = -EPROTO;
        fprintf(stderr, "attacker: the node granted no read depth\n");
        goto fail;
    }
    return 0;
fail:
    fprintf(stderr, "attacker: connect to %s:%u: %s\n", addr, port, strerror(-rc));
    atk_close(a);
    return rc;
}

/* Polls the CQ until cond() holds or ms passed. */
static int atk_poll(struct atk *a, bool (*cond)(struct atk *), int ms)
{
    uint64_t end = now_us() + (uint64_t)ms * 1000;

    while (!cond(a)) {
        struct ibv_wc wc[8];
        int n = ibv_poll_cq(a->cq, 8, wc);

        if (n < 0)
            return -EIO;
        for (int i = 0; i < n; i++) {
            if (wc[i].wr_id < RX_N) {
                if (wc[i].status == IBV_WC_SUCCESS) {
                    a->ready_len[a->n_ready] = wc[i].byte_len;
                    a->ready[a->n_ready++] = (unsigned)wc[i].wr_id;
                }
            } else if (wc[i].wr_id == WR_TX) {
                a->tx_done = true;
                a->tx_status = wc[i].status;
            } else if (wc[i].wr_id == WR_READ) {
                a->read_done = true;
                a->read_status = wc[i].status;
            } else if (wc[i].wr_id == WR_MW) {
                a->mw_done = true;
                a->mw_status = wc[i].status;
            }
        }
        if (n == 0) {
            if (now_us() >= end)
                return -ETIMEDOUT;
            usleep(200);
        }
    }
    return 0;
}

static bool cond_tx(struct atk *a)
{
    return a->tx_done;
}
static bool cond_read(struct atk *a)
{
    return a->read_done;
}
static bool cond_rx(struct atk *a)
{
    return a->n_ready > 0;
}
static bool cond_mw(struct atk *a)
{
    return a->mw_done;
}

/* RDMA READ of READ_LEN bytes at raddr with rkey into a canary-filled buffer. 0 and
 * the completion's status, or -ETIMEDOUT (no completion at all). */
static int atk_read(struct atk *a, uint32_t rkey, uint64_t raddr, enum ibv_wc_status *st)
{
    struct ibv_sge sge = {.addr = (uintptr_t)atk_dst(a), .length = READ_LEN, .lkey = a->mr->lkey};
    struct ibv_send_wr wr = {.wr_id = WR_READ,
                             .sg_list = &sge,
                             .num_sge = 1,
                             .opcode = IBV_WR_RDMA_READ,
                             .send_flags = IBV_SEND_SIGNALED},
                       *bad;
    int rc;

    memset(atk_dst(a), CANARY, READ_LEN);
    wr.wr.rdma.remote_addr = raddr;
    wr.wr.rdma.rkey = rkey;
    a->read_done = false;
    if (ibv_post_send(a->id->qp, &wr, &bad) != 0)
        return -EIO;
    rc = atk_poll(a, cond_read, WAIT_MS);
    if (rc == 0)
        *st = a->read_status;
    return rc;
}

/* One message of the backend's framing: {credits, DATA, flags} + a wire frame. */
static int atk_send(struct atk *a, const struct kvt_wire_msg *m)
{
    struct kvt_wire_buf b;
    struct ibv_sge sge = {.addr = (uintptr_t)atk_tx(a), .lkey = a->mr->lkey};
    struct ibv_send_wr wr = {.wr_id = WR_TX,
                             .sg_list = &sge,
                             .num_sge = 1,
                             .opcode = IBV_WR_SEND,
                             .send_flags = IBV_SEND_SIGNALED},
                       *bad;
    uint32_t credits = htole32(a->rx_owed);
    uint8_t *p = atk_tx(a);
    int rc;

    kvt_wire_buf_init(&b);
    rc = kvt_wire_encode(m, &b);
    if (rc == 0 && b.len > MSG_MAX)
        rc = -EMSGSIZE;
    if (rc == 0) {
        memcpy(p, &credits, 4);
        p[4] = 1; /* DATA */
        p[5] = p[6] = p[7] = 0;
        memcpy(p + 8, b.data, b.len);
        sge.length = (uint32_t)(8 + b.len);
        a->rx_owed = 0;
        a->tx_done = false;
        rc = ibv_post_send(a->id->qp, &wr, &bad) == 0 ? 0 : -EIO;
    }
    kvt_wire_buf_cleanup(&b);
    if (rc == 0)
        rc = atk_poll(a, cond_tx, WAIT_MS);
    if (rc == 0 && a->tx_status != IBV_WC_SUCCESS)
        rc = -EIO;
    return rc;
}

/* The next DATA message, decoded (CREDIT and ACK messages are skipped). */
static int atk_recv(struct atk *a, struct kvt_wire_msg *m)
{
    for (;;) {
        const uint8_t *body;
        size_t blen;
        unsigned i;
        uint32_t len;
        uint8_t type;
        int rc = atk_poll(a, cond_rx, WAIT_MS);

        if (rc != 0)
            return rc;
        i = a->ready[0];
        len = a->ready_len[0];
        a->n_ready--;
        memmove(a->ready, a->ready + 1, a->n_ready * sizeof(a->ready[0]));
        memmove(a->ready_len, a->ready_len + 1, a->n_ready * sizeof(a->ready_len[0]));
        type = len >= 8 ? atk_rx(a, i)[4] : 0; /* after the 4-byte credits */
        if (type == 1) {
            rc = kvt_wire_unframe(atk_rx(a, i) + 8, len - 8, NULL, &body, &blen);
            if (rc == 0)
                rc = kvt_wire_decode(body, blen, NULL, m);
        }
        if (atk_post_rx(a, i) != 0)
            return -EIO;
        if (type == 1) {
            a->rx_owed++;
            return rc;
        }
    }
}

/* The peers handshake as a client (cluster/peers.c). 0 on AUTH_OK; -EACCES on REFUSE.
 * half: stop after HELLO_ACK (0), the node waiting for AUTH. */
static int atk_handshake(struct atk *a, const uint8_t *secret, size_t slen, bool must_verify,
                         bool half)
{
    struct kvt_wire_msg m, r;
    struct kvt_auth_params ap;
    uint8_t ns[KVT_AUTH_NS_BYTES], nonce_c[KVT_AUTH_NONCE_BYTES], nonce_s[KVT_AUTH_NONCE_BYTES];
    uint64_t inc = now_us();
    uint64_t server = 0;
    int rc;

    kvt_auth_namespace(NS_DESC, ns);
    rc = kvt_auth_nonce(nonce_c);
    if (rc != 0)
        return rc;
    kvt_wire_msg_init(&m, KVT_WIRE_HELLO);
    m.u.hello.node_id = ATTACKER_ID;
    m.u.hello.incarnation = inc;
    memcpy(m.u.hello.ns, ns, sizeof(ns));
    memcpy(m.u.hello.nonce, nonce_c, sizeof(nonce_c));
    rc = atk_send(a, &m);
    if (rc == 0)
        rc = atk_recv(a, &r);
    if (rc != 0)
        return rc;
    if (r.type == KVT_WIRE_REFUSE) {
        kvt_wire_msg_free(&r);
        return -EACCES;
    }
    if (r.type != KVT_WIRE_HELLO_ACK) {
        kvt_wire_msg_free(&r);
        return -EPROTO;
    }
    server = r.u.hello.node_id;
    memcpy(nonce_s, r.u.hello.nonce, sizeof(nonce_s));
    ap = (struct kvt_auth_params){.nonce_client = nonce_c,
                                  .nonce_server = nonce_s,
                                  .id_client = ATTACKER_ID,
                                  .id_server = server,
                                  .ns = ns};
    if (must_verify && !kvt_auth_verify(secret, slen, KVT_AUTH_SERVER, &ap, r.u.hello.proof,
                                        KVT_AUTH_PROOF_BYTES)) {
        kvt_wire_msg_free(&r);
        fprintf(stderr, "attacker: the node's proof does not verify\n");
        return -EPROTO;
    }
    kvt_wire_msg_free(&r);
    if (half)
        return 0;
    kvt_wire_msg_init(&m, KVT_WIRE_AUTH);
    m.u.hello.node_id = ATTACKER_ID;
    m.u.hello.incarnation = inc;
    rc = kvt_auth_proof(secret, slen, KVT_AUTH_CLIENT, &ap, m.u.hello.proof);
    if (rc == 0)
        rc = atk_send(a, &m);
    if (rc == 0)
        rc = atk_recv(a, &r);
    if (rc != 0)
        return rc;
    rc = r.type == KVT_WIRE_AUTH_OK ? 0 : r.type == KVT_WIRE_REFUSE ? -EACCES : -EPROTO;
    kvt_wire_msg_free(&r);
    return rc;
}

/* ---- the leaked handle (the backend's packed handle, transport/verbs/verbs.c) ---- */

struct leak {
    uint64_t len;
    uint32_t page_off;
    uint32_t rkey; /* piece 0 on the device whose GUID the node's hello named */
};

static int leak_load(const char *path, uint64_t guid, struct leak *lk)
{
    uint8_t buf[KVT_TP_MAX_HANDLE_SIZE];
    uint32_t magic, page_off, np;
    uint16_t nd;
    uint64_t len;
    size_t n;
    FILE *f = fopen(path, "rb");

    if (f == NULL)
        return -errno;
    n = fread(buf, 1, sizeof(buf), f);
    fclose(f);
    if (n < 24)
        return -EPROTO;
    memcpy(&magic, buf, 4);
    memcpy(&nd, buf + 6, 2);
    memcpy(&len, buf + 8, 8);
    memcpy(&page_off, buf + 16, 4);
    memcpy(&np, buf + 20, 4);
    nd = le16toh(nd);
    np = le32toh(np);
    if (le32toh(magic) != 0x6b76486eu || np == 0 || n != 24 + (size_t)nd * (8 + 4 * (size_t)np))
        return -EPROTO;
    for (uint16_t d = 0; d < nd; d++) {
        const uint8_t *e = buf + 24 + (size_t)d * (8 + 4 * (size_t)np);
        uint64_t g;
        uint32_t rk;

        memcpy(&g, e, 8);
        if (le64toh(g) != guid)
            continue;
        memcpy(&rk, e + 8, 4);
        lk->len = le64toh(len);
        lk->page_off = le32toh(page_off);
        lk->rkey = le32toh(rk);
        return 0;
    }
    return -ENODEV;
}

/* ---- scenarios ---- */

static struct {
    FILE *out;
    int failed;
    struct leak lk;
    uint64_t raddr;
} R;

static void report(bool ok, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void report(bool ok, const char *fmt, ...)
{
    char line[512];
    va_list ap;

    va_start(ap, fmt);
    vsnprintf(line, sizeof(line), fmt, ap);
    va_end(ap);
    printf("%s %s\n", ok ? "PASS" : "FAIL", line);
    if (R.out != NULL)
        fprintf(R.out, "%s %s\n", ok ? "PASS" : "FAIL", line);
    fflush(stdout);
    if (!ok)
        R.failed++;
}

static size_t canary_changed(struct atk *a)
{
    size_t n = 0;

    for (size_t i = 0; i < READ_LEN; i++)
        n += atk_dst(a)[i] != CANARY;
    return n;
}

static bool pattern_ok(struct atk *a)
{
    for (size_t i = 0; i < READ_LEN; i++)
        if (atk_dst(a)[i] != pattern_byte(READ_OFF + i))
            return false;
    return true;
}

/* A READ that must be refused by the node's device. */
static void expect_refused(struct atk *a, const char *what)
{
    enum ibv_wc_status st = IBV_WC_SUCCESS;
    int rc = atk_read(a, R.lk.rkey, R.raddr, &st);
    size_t changed = canary_changed(a);
    bool ok =
        rc == 0 && (st == IBV_WC_REM_INV_REQ_ERR || st == IBV_WC_REM_ACCESS_ERR) && changed == 0;

    report(ok, "%s: READ %s, %zu of %u bytes changed", what,
           rc != 0 ? strerror(-rc) : ibv_wc_status_str(st), changed, READ_LEN);
}

/* A READ that must fail in any way, not one byte arriving. */
static void expect_failed(struct atk *a, const char *what)
{
    enum ibv_wc_status st = IBV_WC_SUCCESS;
    int rc = atk_read(a, R.lk.rkey, R.raddr, &st);
    size_t changed = canary_changed(a);

    report((rc != 0 || st != IBV_WC_SUCCESS) && changed == 0,
           "%s: READ %s, %zu of %u bytes changed", what,
           rc != 0 ? strerror(-rc) : ibv_wc_status_str(st), changed, READ_LEN);
}

static void expect_read(struct atk *a, const char *what)
{
    enum ibv_wc_status st = IBV_WC_GENERAL_ERR;
    int rc = atk_read(a, R.lk.rkey, R.raddr, &st);
    bool ok = rc == 0 && st == IBV_WC_SUCCESS && pattern_ok(a);

    report(ok, "%s: READ %s, %s", what, rc != 0 ? strerror(-rc) : ibv_wc_status_str(st),
           ok ? "the region's bytes" : "wrong bytes or none");
}

static void run_attacks(const char *addr, uint16_t port, const uint8_t *secret, size_t slen,
                        const char *leak_path)
{
    struct atk a, b;
    uint8_t wrong[32];
    int rc;

    /* S1: no handshake at all. The node's GUID comes with its connection hello. */
    if (atk_connect(&a, addr, port) != 0) {
        report(false, "S1: cannot connect");
        return;
    }
    rc = leak_load(leak_path, a.peer_guid, &R.lk);
    if (rc != 0 || R.lk.len != REGION_BYTES) {
        report(false, "the leaked handle %s: %s", leak_path, strerror(-rc));
        atk_close(&a);
        return;
    }
    R.raddr = R.lk.page_off + READ_OFF; /* the backend's iova: page offset + offset */
    printf("# leaked: rkey 0x%x, region %llu bytes, READ at address 0x%llx\n", R.lk.rkey,
           (unsigned long long)R.lk.len, (unsigned long long)R.raddr);
    expect_refused(&a, "S1 no handshake");
    atk_close(&a);

    /* S2: halfway (HELLO answered, the node waits for AUTH), then a wrong secret. */
    if (atk_connect(&a, addr, port) != 0) {
        report(false, "S2: cannot connect");
        return;
    }
    rc = atk_handshake(&a, secret, slen, true, true);
    report(rc == 0, "S2 halfway: HELLO_ACK %s", rc == 0 ? "received" : strerror(-rc));
    expect_refused(&a, "S2 halfway");
    atk_close(&a);
    memset(wrong, 0x5c, sizeof(wrong));
    if (atk_connect(&a, addr, port) != 0) {
        report(false, "S2: cannot connect");
        return;
    }
    rc = atk_handshake(&a, wrong, sizeof(wrong), false, false);
    report(rc == -EACCES, "S2 wrong secret: handshake %s",
           rc == -EACCES ? "refused"
           : rc == 0     ? "accepted"
                         : strerror(-rc));
    /* The node lingers 250 ms after its REFUSE, then closes: a READ may meet the
     * refusal or the closed connection; either way not one byte may arrive. */
    expect_failed(&a, "S2 wrong secret");
    atk_close(&a);

    /* S3: the full handshake: the node authorizes the endpoint at link up. */
    if (atk_connect(&a, addr, port) != 0) {
        report(false, "S3: cannot connect");
        return;
    }
    rc = atk_handshake(&a, secret, slen, true, false);
    report(rc == 0, "S3 authenticated: handshake %s", rc == 0 ? "AUTH_OK" : strerror(-rc));
    expect_read(&a, "S3 authenticated");

    /* S4: S3's grant belongs to S3's QP alone. */
    if (atk_connect(&b, addr, port) != 0) {
        report(false, "S4: cannot connect");
    } else {
        expect_refused(&b, "S4 no handshake while S3 is up");
        atk_close(&b);
    }
    expect_read(&a, "S4 S3 again");

    /* S5: after S3 closed, a new connection has nothing. */
    atk_close(&a);
    usleep(500 * 1000); /* the node sees the disconnect */
    if (atk_connect(&a, addr, port) != 0) {
        report(false, "S5: cannot connect");
        return;
    }
    expect_refused(&a, "S5 no handshake after S3 closed");
    atk_close(&a);
}

/* ---- costs of the ways to gate READs per peer ---- */

static int cmp_u64(const void *x, const void *y)
{
    uint64_t a = *(const uint64_t *)x, b = *(const uint64_t *)y;

    return a < b ? -1 : a > b;
}

static uint64_t median(uint64_t *v, size_t n)
{
    qsort(v, n, sizeof(*v), cmp_u64);
    return n == 0 ? 0 : v[n / 2];
}

static void run_costs(const char *addr, uint16_t port)
{
    enum { N_MODIFY = 200, N_MW = 100, N_REG = 5 };
    static const size_t reg_mib[] = {64, 256};
    static uint64_t t[N_MODIFY];
    struct atk a;
    struct ibv_qp_attr qa;
    struct ibv_qp_init_attr ia;
    struct ibv_mw *mw;
    struct ibv_mr *mr;
    uint8_t *buf;
    int rc;

    if (atk_connect(&a, addr, port) != 0) {
        report(false, "costs: cannot connect");
        return;
    }
    /* The QP access flags, RTS->RTS: what ep_authorize does, once per link. */
    for (int i = 0; i < N_MODIFY; i++) {
        uint64_t t0 = now_us();

        memset(&qa, 0, sizeof(qa));
        qa.qp_access_flags = (i % 2 == 0) ? IBV_ACCESS_REMOTE_READ : 0;
        rc = ibv_modify_qp(a.id->qp, &qa, IBV_QP_ACCESS_FLAGS);
        t[i] = now_us() - t0;
        if (rc != 0) {
            report(false, "costs: RTS->RTS access flags: %s", strerror(rc));
            break;
        }
    }
    memset(&qa, 0, sizeof(qa));
    rc = ibv_query_qp(a.id->qp, &qa, IBV_QP_ACCESS_FLAGS, &ia);
    report(rc == 0 && qa.qp_access_flags == 0,
           "costs: QP access flags (RTS->RTS modify): median %llu us of %d; the QP reads back "
           "flags 0x%x",
           (unsigned long long)median(t, N_MODIFY), N_MODIFY, qa.qp_access_flags);

    /* A protection domain per peer: the region registered again for each peer. */
    for (size_t s = 0; s < sizeof(reg_mib) / sizeof(reg_mib[0]); s++) {
        size_t len = reg_mib[s] << 20;
        uint64_t treg[N_REG], tdereg[N_REG];

        buf = aligned_alloc(4096, len);
        if (buf == NULL) {
            report(false, "costs: %zu MiB: no memory", reg_mib[s]);
            continue;
        }
        memset(buf, 1, len);
        for (int i = 0; i < N_REG; i++) {
            uint64_t t0 = now_us(), t1;
            struct ibv_pd *pd = ibv_alloc_pd(a.id->verbs);

            mr = pd != NULL ? ibv_reg_mr(pd, buf, len, IBV_ACCESS_REMOTE_READ) : NULL;
            t1 = now_us();
            if (mr == NULL) {
                report(false, "costs: a PD and %zu MiB registration: %s", reg_mib[s],
                       strerror(errno));
                if (pd != NULL)
                    ibv_dealloc_pd(pd);
                break;
            }
            ibv_dereg_mr(mr);
            ibv_dealloc_pd(pd);
            treg[i] = t1 - t0;
            tdereg[i] = now_us() - t1;
        }
        report(true,
               "costs: a PD per peer, %zu MiB region: register median %llu us, deregister "
               "%llu us (%d each)",
               reg_mib[s], (unsigned long long)median(treg, N_REG),
               (unsigned long long)median(tdereg, N_REG), N_REG);
        free(buf);
    }

    /* Type-2 memory windows: bound to the peer's QP after its handshake, invalidated
     * at close (the MR itself registered without remote access). */
    buf = aligned_alloc(4096, REGION_BYTES);
    mr = buf != NULL
             ? ibv_reg_mr(a.pd, buf, REGION_BYTES,
                          IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_MW_BIND)
             : NULL;
    mw = mr != NULL ? ibv_alloc_mw(a.pd, IBV_MW_TYPE_2) : NULL;
    if (mw == NULL) {
        report(true, "costs: type-2 memory windows: not available (%s)", strerror(errno));
    } else {
        uint32_t rkey = mw->rkey;
        int i;

        for (i = 0; i < N_MW; i++) {
            struct ibv_send_wr wr = {0}, *bad;
            uint64_t t0 = now_us();

            rkey = ibv_inc_rkey(rkey);
            wr.wr_id = WR_MW;
            wr.opcode = IBV_WR_BIND_MW;
            wr.send_flags = IBV_SEND_SIGNALED;
            wr.bind_mw.mw = mw;
            wr.bind_mw.rkey = rkey;
            wr.bind_mw.bind_info =
                (struct ibv_mw_bind_info){.mr = mr,
                                          .addr = (uintptr_t)buf,
                                          .length = REGION_BYTES,
                                          .mw_access_flags = IBV_ACCESS_REMOTE_READ};
            a.mw_done = false;
            rc = ibv_post_send(a.id->qp, &wr, &bad);
            if (rc == 0)
                rc = atk_poll(&a, cond_mw, WAIT_MS) == 0 && a.mw_status == IBV_WC_SUCCESS ? 0 : EIO;
            if (rc == 0) {
                mw->rkey = rkey; /* the provider names the window by its current rkey */
                memset(&wr, 0, sizeof(wr));
                wr.wr_id = WR_MW;
                wr.opcode = IBV_WR_LOCAL_INV;
                wr.send_flags = IBV_SEND_SIGNALED;
                wr.invalidate_rkey = rkey;
                a.mw_done = false;
                rc = ibv_post_send(a.id->qp, &wr, &bad);
                if (rc == 0)
                    rc = atk_poll(&a, cond_mw, WAIT_MS) == 0 && a.mw_status == IBV_WC_SUCCESS ? 0
                                                                                              : EIO;
            }
            if (rc != 0) {
                report(false, "costs: memory window bind/invalidate %d: %s (%s)", i, strerror(rc),
                       ibv_wc_status_str(a.mw_status));
                break;
            }
            t[i] = now_us() - t0;
        }
        if (i == N_MW)
            report(true,
                   "costs: a type-2 memory window per peer: bind + invalidate median %llu us "
                   "(%d)",
                   (unsigned long long)median(t, N_MW), N_MW);
        ibv_dealloc_mw(mw);
    }
    if (mr != NULL)
        ibv_dereg_mr(mr);
    free(buf);
    atk_close(&a);
}

/* ---- main ---- */

int main(int argc, char **argv)
{
    static const struct option opts[] = {{"addr", required_argument, NULL, 'a'},
                                         {"results", required_argument, NULL, 'r'},
                                         {"costs", no_argument, NULL, 'c'},
                                         {NULL, 0, NULL, 0}};
    const char *addr = NULL, *rdir = NULL;
    bool costs = false;
    char leak_path[4096], out_path[4096], line[32];
    uint8_t secret[32];
    int pfd[2], opt, status = 1;
    unsigned port = 0;
    ssize_t n;
    pid_t pid;

    while ((opt = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        if (opt == 'a')
            addr = optarg;
        else if (opt == 'r')
            rdir = optarg;
        else if (opt == 'c')
            costs = true;
        else
            return 2;
    }
    if (addr == NULL) {
        fprintf(stderr, "usage: verbs_attack --addr A [--results DIR] [--costs]\n");
        return 2;
    }
    rdir = results_dir(rdir);
    snprintf(leak_path, sizeof(leak_path), "%s/leaked-handle.bin", rdir);
    snprintf(out_path, sizeof(out_path), "%s/%s", rdir,
             costs ? "verbs_costs.txt" : "verbs_attack.txt");
    if (kvt_auth_nonce(secret) != 0 || pipe(pfd) != 0)
        return 1;
    fflush(NULL);
    pid = fork();
    if (pid < 0)
        return 1;
    if (pid == 0) {
        close(pfd[0]);
        _exit(node_main(addr, secret, sizeof(secret), leak_path, pfd[1], costs));
    }
    close(pfd[1]);
    n = read(pfd[0], line, sizeof(line) - 1);
    close(pfd[0]);
    if (n > 0) {
        line[n] = '\0';
        port = (unsigned)strtoul(line, NULL, 10);
    }
    R.out = fopen(out_path, "w");
    if (port == 0 || port > 65535) {
        report(false, "the node did not start");
    } else if (costs) {
        run_costs(addr, (uint16_t)port);
    } else {
        run_attacks(addr, (uint16_t)port, secret, sizeof(secret), leak_path);
    }
    if (pid > 0) {
        kill(pid, SIGTERM);
        if (waitpid(pid, &status, 0) != pid)
            status = -1;
        if (!costs)
            report(WIFEXITED(status) && WEXITSTATUS(status) == 0,
                   "the node's own checks (exit status %d)",
                   WIFEXITED(status) ? WEXITSTATUS(status) : -1);
    }
    if (R.out != NULL)
        fclose(R.out);
    printf("%s\n", R.failed == 0 ? "verbs_attack: PASS" : "verbs_attack: FAIL");
    return R.failed == 0 ? 0 : 1;
}

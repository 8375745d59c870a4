/* SPDX-License-Identifier: Apache-2.0 */
/* An attacker against a node's verbs endpoint (issue #21), on a real RDMA device
 * (soft-RoCE in the tests/rdma guests): no memory of a node is readable by a peer
 * whose link has not authenticated, even one that knows the exact rkey and address.
 *
 *   verbs_attack --addr A [--results DIR]           the attack scenarios (one guest)
 *   verbs_attack --addr A --costs [--results DIR]   what each way of gating costs
 *
 * A fork is "the node": a kvt_peers (cluster/peers.c, the HMAC handshake) over the
 * verbs transport, with a 1 MiB region of a known pattern registered as the network
 * tier registers its primary (kvt_tp_reg_granted: readable through exposures alone).
 * Its packed handle (rkeys and offsets) is written to DIR/leaked-handle.bin: the leak
 * this test assumes (an eavesdropped GRANT, a guessed rxe rkey). To a FETCH on an
 * authenticated link the node answers a GRANT of one 4 KiB row (at 64 KiB) exposed to
 * that link alone (kvt_tp_expose; its handle names a window), with a lease of 60 s
 * (FETCH job 1) or 1 s (job 2); it revokes the exposure at RELEASE (and then says so
 * with a DENY naming the lease) and at expiry. The parent is the
 * attacker: plain librdmacm and libibverbs, none of the kvtier transport. It connects
 * with a well-formed connection hello (the public struct vb_hello) and posts an RDMA
 * READ of 4 KiB with the leaked rkey and address into a buffer filled with a canary:
 *   S1 right after connecting, no handshake               -> refused, canary intact
 *   S2 halfway: HELLO answered, the node waits for AUTH    -> refused, canary intact;
 *      then a handshake with a wrong secret (REFUSE)       -> fails, canary intact
 *   S3 after the full handshake (HELLO/HELLO_ACK/AUTH/AUTH_OK with the secret: the
 *      node's peers.c authorizes the endpoint at link up) and a FETCH: the granted
 *      row with the GRANT's window                          -> the pattern's bytes
 *   S4 a second connection while S3's link is up, no handshake, S3's window
 *                                                           -> refused;
 *      S3 reads again                                       -> the pattern's bytes;
 *      S3 reads the next row (not granted) with its window  -> refused
 *   S5 S3 closed; a new connection, no handshake            -> refused
 *   S7 authenticated, no grant, the region's own rkey       -> refused
 *   S8 granted, read, RELEASE (the node revokes), the same row -> refused
 *   S9 granted with a 1 s lease, read, 2.5 s later the same row -> refused
 *   S10 two authenticated peers granted the same row: each reads with its own
 *      window; the second with the first's window           -> refused
 *   S6 max_preauth (3) connections without a handshake; one more  -> rejected, counted;
 *      accepted again once they closed
 * "Refused" means the READ completed with remote invalid request (what rxe answers
 * for a QP without remote read) or remote access error, not a timeout, and not one
 * byte of the canary changed (a refused READ ends the attacker's connection, so it
 * is the last READ on it). The node checks its side: every link it grants on
 * reports remote read on its QP (ep_info, from ibv_query_qp), six handshakes, five
 * grants, one auth refusal; on the first FETCH it also times expose and revoke of
 * 1, 16 and 120 windows (DIR/verbs_grant_costs.txt).
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
/* Grants (S7-S10): the node exposes one 4 KiB row at GRANT_OFF to a FETCH; the row
 * after it is never granted. FETCH job 1 asks for a long lease, job 2 for a short one. */
#define GRANT_OFF      (64u * 1024u)
#define ROW_LEN        4096u
#define UNGRANTED_OFF  (GRANT_OFF + ROW_LEN)
#define LEASE_LONG_MS  60000u
#define LEASE_SHORT_MS 1000u
#define MAX_LEASES     16
#define N_AUTH         6 /* handshakes the scenarios make: S3, S7, S8, S9, S10 (two) */

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

static int cmp_u64(const void *x, const void *y);

/* ---- the node (a fork) ---- */

/* The node's max_preauth in the attacks (S6). */
#define PREAUTH_MAX 3u

static volatile sig_atomic_t node_stop;

static void node_on_term(int sig)
{
    (void)sig;
    node_stop = 1;
}

/* The node's leases: one exposed row each (kvt_tp_expose), revoked at RELEASE, at
 * expiry and at exit. Messages are queued by on_msg and acted on in the loop. */
struct node_lease {
    uint64_t id;
    struct kvt_tp_grant *g;
    uint64_t deadline_us;
};

static char grant_cost_path[4096]; /* DIR/verbs_grant_costs.txt */

static struct {
    struct kvt_peers *p;
    struct kvt_transport *tp;
    struct kvt_tp_mr *mr;
    struct node_lease leases[MAX_LEASES];
    uint64_t next_lease;
    struct kvt_tp_ep *fetch_ep; /* a FETCH to answer, or NULL */
    uint64_t fetch_job;
    uint64_t release_id; /* a RELEASE to act on, or 0 */
    struct kvt_tp_ep *release_ep;
    bool costs_done;
    int errors;
    FILE *cost_out;
} N;

static void node_on_msg(void *arg, uint64_t from, struct kvt_tp_ep *ep,
                        const struct kvt_wire_msg *m)
{
    (void)arg;
    (void)from;
    if (m->type == KVT_WIRE_FETCH) {
        N.fetch_ep = ep;
        N.fetch_job = m->u.fetch.job_id;
    } else if (m->type == KVT_WIRE_RELEASE) {
        N.release_id = m->u.release.lease_id;
        N.release_ep = ep;
    }
}

static void node_progress_ms(unsigned ms)
{
    uint64_t end = now_us() + ms * 1000ull;

    while (now_us() < end)
        (void)kvt_peers_progress(N.p);
}

/* What an exposure costs: expose (alloc + bind n windows), then, once the binds
 * completed, revoke (dealloc), on the FETCH's authenticated endpoint. */
static void node_costs(struct kvt_tp_ep *ep)
{
    enum { N_RUNS = 40 };
    static const unsigned widths[] = {1, 16, 120};
    uint64_t te[N_RUNS], tr[N_RUNS];

    for (size_t w = 0; w < sizeof(widths) / sizeof(widths[0]); w++) {
        struct kvt_tp_range r[120];
        uint8_t h[KVT_TP_MAX_HANDLE_SIZE];
        size_t hl;
        int i, rc = 0;

        for (unsigned k = 0; k < widths[w]; k++) /* scattered: one window each */
            r[k] = (struct kvt_tp_range){.off = (uint64_t)k * 2 * ROW_LEN, .len = ROW_LEN};
        for (i = 0; i < N_RUNS; i++) {
            struct kvt_tp_grant *g;
            uint64_t t0 = now_us();

            rc = kvt_tp_expose(ep, N.mr, r, widths[w], h, sizeof(h), &hl, &g);
            te[i] = now_us() - t0;
            if (rc != 0)
                break;
            node_progress_ms(5); /* the bind chain completes */
            t0 = now_us();
            kvt_tp_revoke(N.tp, g);
            tr[i] = now_us() - t0;
        }
        if (rc != 0) {
            fprintf(stderr, "node: FAIL expose of %u windows: %s\n", widths[w], strerror(-rc));
            N.errors++;
            return;
        }
        qsort(te, N_RUNS, sizeof(te[0]), cmp_u64);
        qsort(tr, N_RUNS, sizeof(tr[0]), cmp_u64);
        fprintf(stderr,
                "node: cost of an exposure of %u windows: expose median %llu us (max %llu), "
                "revoke median %llu us (max %llu), %d runs\n",
                widths[w], (unsigned long long)te[N_RUNS / 2], (unsigned long long)te[N_RUNS - 1],
                (unsigned long long)tr[N_RUNS / 2], (unsigned long long)tr[N_RUNS - 1], N_RUNS);
        if (N.cost_out != NULL)
            fprintf(N.cost_out,
                    "expose %u windows: median %llu us, max %llu us; revoke: median %llu us, "
                    "max %llu us (%d runs)\n",
                    widths[w], (unsigned long long)te[N_RUNS / 2],
                    (unsigned long long)te[N_RUNS - 1], (unsigned long long)tr[N_RUNS / 2],
                    (unsigned long long)tr[N_RUNS - 1], N_RUNS);
    }
}

/* A FETCH: GRANT of the row at GRANT_OFF, exposed to the asking endpoint alone. */
static void node_grant(void)
{
    struct kvt_tp_ep *ep = N.fetch_ep;
    struct kvt_tp_range r = {.off = GRANT_OFF, .len = ROW_LEN};
    struct kvt_wire_chunk ch = {.key_index = 0, .offset = GRANT_OFF, .length = ROW_LEN};
    uint8_t h[KVT_TP_MAX_HANDLE_SIZE];
    struct node_lease *l = NULL;
    struct kvt_wire_msg m;
    char info[128];
    size_t hl;
    int rc;

    N.fetch_ep = NULL;
    if (kvt_tp_ep_info(ep, info, sizeof(info)) != 0 ||
        strstr(info, "peer reads ours: yes") == NULL) {
        fprintf(stderr, "node: FAIL the authenticated link's QP does not allow reads\n");
        N.errors++;
    }
    if (!N.costs_done) {
        N.costs_done = true;
        node_costs(ep);
    }
    for (int i = 0; i < MAX_LEASES && l == NULL; i++)
        if (N.leases[i].id == 0)
            l = &N.leases[i];
    if (l == NULL) {
        fprintf(stderr, "node: FAIL out of leases\n");
        N.errors++;
        return;
    }
    rc = kvt_tp_expose(ep, N.mr, &r, 1, h, sizeof(h), &hl, &l->g);
    if (rc != 0) {
        fprintf(stderr, "node: FAIL expose: %s\n", strerror(-rc));
        N.errors++;
        return;
    }
    l->id = ++N.next_lease;
    l->deadline_us = now_us() + 1000ull * (N.fetch_job == 2 ? LEASE_SHORT_MS : LEASE_LONG_MS);
    kvt_wire_msg_init(&m, KVT_WIRE_GRANT);
    m.u.grant.job_id = N.fetch_job;
    m.u.grant.lease_id = l->id;
    m.u.grant.lease_ttl_ms = N.fetch_job == 2 ? LEASE_SHORT_MS : LEASE_LONG_MS;
    m.u.grant.handle = h;
    m.u.grant.handle_len = (uint32_t)hl;
    m.u.grant.n_chunks = 1;
    m.u.grant.chunks = &ch;
    rc = kvt_peers_reply(N.p, ep, &m);
    fprintf(stderr, "node: lease %llu: row at %u exposed (%zu-byte handle), GRANT %s\n",
            (unsigned long long)l->id, GRANT_OFF, hl, rc == 0 ? "sent" : strerror(-rc));
}

static void node_lease_end(struct node_lease *l, const char *why)
{
    kvt_tp_revoke(N.tp, l->g);
    fprintf(stderr, "node: lease %llu revoked (%s)\n", (unsigned long long)l->id, why);
    memset(l, 0, sizeof(*l));
}

/* A RELEASE: revoke, then say so (a DENY naming the lease). */
static void node_release(void)
{
    struct kvt_wire_msg m;
    struct kvt_tp_ep *ep = N.release_ep;
    uint64_t id = N.release_id;

    N.release_id = 0;
    for (int i = 0; i < MAX_LEASES; i++)
        if (N.leases[i].id == id)
            node_lease_end(&N.leases[i], "RELEASE");
    kvt_wire_msg_init(&m, KVT_WIRE_DENY);
    m.u.deny.job_id = id;
    m.u.deny.reason = KVT_WIRE_R_NOT_FOUND;
    (void)kvt_peers_reply(N.p, ep, &m);
}

static void node_expire(void)
{
    uint64_t now = now_us();

    for (int i = 0; i < MAX_LEASES; i++)
        if (N.leases[i].id != 0 && now >= N.leases[i].deadline_us)
            node_lease_end(&N.leases[i], "expired");
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
        .transport = {.backend = "verbs", .max_preauth = costs ? 0 : PREAUTH_MAX},
        .h = {.on_msg = node_on_msg},
    };
    struct kvt_tp_counters tc = {0};
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
    /* Readable through exposures alone: the leaked handle is the registration's. */
    rc = kvt_tp_reg_granted(tp, region, REGION_BYTES, &mr);
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
    N.p = p;
    N.tp = tp;
    N.mr = mr;
    if (!costs)
        N.cost_out = fopen(grant_cost_path, "w");
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
        if (N.fetch_ep != NULL)
            node_grant();
        if (N.release_id != 0)
            node_release();
        node_expire();
        if (n == 0 && kvt_peers_arm(p) == 0) {
            struct pollfd pfd = {.fd = kvt_peers_event_fd(p), .events = POLLIN};
            int ms = kvt_peers_next_timeout_ms(p);

            poll(&pfd, 1, ms < 0 || ms > 50 ? 50 : ms);
        }
    }
    kvt_peers_counts(p, &c);
    kvt_tp_get_counters(tp, &tc);
    fprintf(stderr, "node: connections refused beyond max_preauth %u: %llu\n", PREAUTH_MAX,
            (unsigned long long)tc.refused[KVT_TP_PREAUTH_CONNS]);
    if (!costs && tc.refused[KVT_TP_PREAUTH_CONNS] < 1) {
        fprintf(stderr, "node: FAIL no connection was refused beyond max_preauth (S6)\n");
        errors++;
    }
    fprintf(stderr, "node: handshakes %llu, refused %llu (auth %llu, timeout %llu), links up %u\n",
            (unsigned long long)c.handshakes, (unsigned long long)c.refused,
            (unsigned long long)c.refused_by_reason[KVT_WIRE_R_AUTH],
            (unsigned long long)c.refused_by_reason[KVT_PEERS_R_TIMEOUT], links_up);
    if (!costs &&
        (c.handshakes != N_AUTH || links_up < 1 || c.refused_by_reason[KVT_WIRE_R_AUTH] < 1)) {
        fprintf(stderr, "node: FAIL expected %d handshakes (S3, S7-S10) and an auth refusal (S2)\n",
                N_AUTH);
        errors++;
    }
    if (!costs && N.next_lease != 5) {
        fprintf(stderr, "node: FAIL expected 5 grants (S3, S8, S9, S10 twice), made %llu\n",
                (unsigned long long)N.next_lease);
        errors++;
    }
    for (int i = 0; i < MAX_LEASES; i++)
        if (N.leases[i].id != 0)
            node_lease_end(&N.leases[i], "exit");
    errors += N.errors;
    if (N.cost_out != NULL)
        fclose(N.cost_out);
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
static int atk_handshake_as(struct atk *a, uint64_t my_id, const uint8_t *secret, size_t slen,
                            bool must_verify, bool half)
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
    m.u.hello.node_id = my_id;
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
                                  .id_client = my_id,
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
    m.u.hello.node_id = my_id;
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

static int atk_handshake(struct atk *a, const uint8_t *secret, size_t slen, bool must_verify,
                         bool half)
{
    return atk_handshake_as(a, ATTACKER_ID, secret, slen, must_verify, half);
}

/* The next DATA message of type want (heartbeats and the like are skipped). */
static int atk_recv_type(struct atk *a, enum kvt_wire_type want, struct kvt_wire_msg *m)
{
    for (int i = 0; i < 64; i++) {
        int rc = atk_recv(a, m);

        if (rc != 0)
            return rc;
        if (m->type == want)
            return 0;
        kvt_wire_msg_free(m);
    }
    return -EPROTO;
}

/* A granted window, from a GRANT's handle (the backend's expose handle,
 * transport/verbs/verbs.c): {magic, version, windows, GUID, length, page offset,
 * reserved}, then {offset, length, rkey} per window. */
struct win {
    uint64_t lease_id;
    uint64_t off;
    uint32_t len, rkey, page_off;
};

/* FETCH job (1: long lease, 2: short), GRANT, its one window. */
static int atk_fetch(struct atk *a, uint64_t job, struct win *w)
{
    struct kvt_wire_msg m, r;
    uint32_t magic, page_off, len, rkey;
    uint16_t nw;
    uint64_t off;
    int rc;

    kvt_wire_msg_init(&m, KVT_WIRE_FETCH);
    m.u.fetch.job_id = job;
    rc = atk_send(a, &m);
    if (rc == 0)
        rc = atk_recv_type(a, KVT_WIRE_GRANT, &r);
    if (rc != 0)
        return rc;
    rc = -EPROTO;
    if (r.u.grant.handle_len == 32 + 16 && r.u.grant.n_chunks == 1) {
        const uint8_t *h = r.u.grant.handle;

        memcpy(&magic, h, 4);
        memcpy(&nw, h + 6, 2);
        memcpy(&page_off, h + 24, 4);
        memcpy(&off, h + 32, 8);
        memcpy(&len, h + 40, 4);
        memcpy(&rkey, h + 44, 4);
        if (le32toh(magic) == 0x6b764772u && le16toh(nw) == 1) {
            *w = (struct win){.lease_id = r.u.grant.lease_id,
                              .off = le64toh(off),
                              .len = le32toh(len),
                              .rkey = le32toh(rkey),
                              .page_off = le32toh(page_off)};
            rc = 0;
        }
    }
    kvt_wire_msg_free(&r);
    return rc;
}

/* RELEASE the lease and wait for the node's word that it revoked it. */
static int atk_release(struct atk *a, const struct win *w)
{
    struct kvt_wire_msg m, r;
    int rc;

    kvt_wire_msg_init(&m, KVT_WIRE_RELEASE);
    m.u.release.job_id = 1;
    m.u.release.lease_id = w->lease_id;
    rc = atk_send(a, &m);
    if (rc == 0)
        rc = atk_recv_type(a, KVT_WIRE_DENY, &r);
    if (rc == 0) {
        rc = r.u.deny.job_id == w->lease_id ? 0 : -EPROTO;
        kvt_wire_msg_free(&r);
    }
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

static bool pattern_ok(struct atk *a, uint64_t off)
{
    for (size_t i = 0; i < READ_LEN; i++)
        if (atk_dst(a)[i] != pattern_byte(off + i))
            return false;
    return true;
}

/* A READ with rkey at raddr that must be refused by the node's device. */
static void expect_refused_at(struct atk *a, uint32_t rkey, uint64_t raddr, const char *what)
{
    enum ibv_wc_status st = IBV_WC_SUCCESS;
    int rc = atk_read(a, rkey, raddr, &st);
    size_t changed = canary_changed(a);
    bool ok =
        rc == 0 && (st == IBV_WC_REM_INV_REQ_ERR || st == IBV_WC_REM_ACCESS_ERR) && changed == 0;

    report(ok, "%s: READ %s, %zu of %u bytes changed", what,
           rc != 0 ? strerror(-rc) : ibv_wc_status_str(st), changed, READ_LEN);
}

static void expect_refused(struct atk *a, const char *what)
{
    expect_refused_at(a, R.lk.rkey, R.raddr, what);
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

/* A READ of the region's bytes at off, with rkey at raddr. */
static void expect_read_at(struct atk *a, uint32_t rkey, uint64_t raddr, uint64_t off,
                           const char *what)
{
    enum ibv_wc_status st = IBV_WC_GENERAL_ERR;
    int rc = atk_read(a, rkey, raddr, &st);
    bool ok = rc == 0 && st == IBV_WC_SUCCESS && pattern_ok(a, off);

    report(ok, "%s: READ %s, %s", what, rc != 0 ? strerror(-rc) : ibv_wc_status_str(st),
           ok ? "the region's bytes" : "wrong bytes or none");
}

static void run_attacks(const char *addr, uint16_t port, const uint8_t *secret, size_t slen,
                        const char *leak_path)
{
    struct atk a, b;
    struct win w = {0};
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

    /* S3: the full handshake (the node authorizes the endpoint at link up), then a
     * FETCH: the GRANT's handle names a window over the granted row alone. */
    if (atk_connect(&a, addr, port) != 0) {
        report(false, "S3: cannot connect");
        return;
    }
    rc = atk_handshake(&a, secret, slen, true, false);
    report(rc == 0, "S3 authenticated: handshake %s", rc == 0 ? "AUTH_OK" : strerror(-rc));
    rc = atk_fetch(&a, 1, &w);
    report(rc == 0 && w.off == GRANT_OFF && w.len == ROW_LEN && w.rkey != R.lk.rkey,
           "S3 GRANT: %s, window [%llu, +%u) rkey 0x%x (the region's 0x%x)",
           rc == 0 ? "one window" : strerror(-rc), (unsigned long long)w.off, w.len, w.rkey,
           R.lk.rkey);
    expect_read_at(&a, w.rkey, w.page_off + GRANT_OFF, GRANT_OFF, "S3 authenticated, granted row");

    /* S4: S3's grant belongs to S3's QP alone. */
    if (atk_connect(&b, addr, port) != 0) {
        report(false, "S4: cannot connect");
    } else {
        expect_refused_at(&b, w.rkey, w.page_off + GRANT_OFF,
                          "S4 no handshake while S3 is up, S3's window");
        atk_close(&b);
    }
    expect_read_at(&a, w.rkey, w.page_off + GRANT_OFF, GRANT_OFF, "S4 S3 again");
    /* The row after the granted one, with the window's rkey: outside the window.
     * (A refused READ ends the attacker's connection: the last one on it.) */
    expect_refused_at(&a, w.rkey, w.page_off + UNGRANTED_OFF, "S3 the row after the granted one");

    /* S5: after S3 closed, a new connection has nothing. */
    atk_close(&a);
    usleep(500 * 1000); /* the node sees the disconnect */
    if (atk_connect(&a, addr, port) != 0) {
        report(false, "S5: cannot connect");
        return;
    }
    expect_refused(&a, "S5 no handshake after S3 closed");
    atk_close(&a);
    usleep(500 * 1000);

    /* S7: authenticated, the region's own rkey (leaked or forged): the registration
     * grants no remote access, windows alone do. */
    if (atk_connect(&a, addr, port) == 0) {
        rc = atk_handshake(&a, secret, slen, true, false);
        report(rc == 0, "S7 authenticated: handshake %s", rc == 0 ? "AUTH_OK" : strerror(-rc));
        expect_refused_at(&a, R.lk.rkey, R.lk.page_off + GRANT_OFF,
                          "S7 authenticated, the region's rkey at the granted row");
        atk_close(&a);
    } else {
        report(false, "S7: cannot connect");
    }

    /* S8: granted, read, RELEASE (the node revokes, then says so): refused. */
    if (atk_connect(&a, addr, port) == 0) {
        rc = atk_handshake(&a, secret, slen, true, false);
        if (rc == 0)
            rc = atk_fetch(&a, 1, &w);
        report(rc == 0, "S8 authenticated and granted: %s", rc == 0 ? "yes" : strerror(-rc));
        expect_read_at(&a, w.rkey, w.page_off + GRANT_OFF, GRANT_OFF, "S8 granted row");
        rc = atk_release(&a, &w);
        report(rc == 0, "S8 RELEASE: %s", rc == 0 ? "revoked" : strerror(-rc));
        expect_refused_at(&a, w.rkey, w.page_off + GRANT_OFF, "S8 the same row after RELEASE");
        atk_close(&a);
    } else {
        report(false, "S8: cannot connect");
    }

    /* S9: granted with a short lease; read; after its expiry: refused. */
    if (atk_connect(&a, addr, port) == 0) {
        rc = atk_handshake(&a, secret, slen, true, false);
        if (rc == 0)
            rc = atk_fetch(&a, 2, &w);
        report(rc == 0, "S9 authenticated and granted (%u ms lease): %s", LEASE_SHORT_MS,
               rc == 0 ? "yes" : strerror(-rc));
        expect_read_at(&a, w.rkey, w.page_off + GRANT_OFF, GRANT_OFF, "S9 granted row");
        usleep((LEASE_SHORT_MS + 1500) * 1000);
        expect_refused_at(&a, w.rkey, w.page_off + GRANT_OFF, "S9 the same row after expiry");
        atk_close(&a);
    } else {
        report(false, "S9: cannot connect");
    }

    /* S10: two authenticated peers granted the same row: a window answers only on
     * the QP it is bound to. */
    if (atk_connect(&a, addr, port) == 0 && atk_connect(&b, addr, port) == 0) {
        struct win wb = {0};

        rc = atk_handshake(&a, secret, slen, true, false);
        if (rc == 0)
            rc = atk_fetch(&a, 1, &w);
        if (rc == 0)
            rc = atk_handshake_as(&b, ATTACKER_ID + 1, secret, slen, true, false);
        if (rc == 0)
            rc = atk_fetch(&b, 1, &wb);
        report(rc == 0 && wb.rkey != w.rkey, "S10 two peers granted the same row: %s",
               rc == 0 ? "two windows" : strerror(-rc));
        expect_read_at(&b, wb.rkey, wb.page_off + GRANT_OFF, GRANT_OFF,
                       "S10 the second peer, its own window");
        expect_refused_at(&b, w.rkey, w.page_off + GRANT_OFF,
                          "S10 the second peer, the first peer's window");
        expect_read_at(&a, w.rkey, w.page_off + GRANT_OFF, GRANT_OFF,
                       "S10 the first peer, its window, after that");
        atk_close(&b);
        atk_close(&a);
    } else {
        report(false, "S10: cannot connect");
        atk_close(&a);
    }
    usleep(500 * 1000);

    /* S6: connections that never authenticate hold registered buffers: the node takes
     * PREAUTH_MAX of them at once and rejects the next; once they go, it accepts
     * again. */
    {
        struct atk held[PREAUTH_MAX];
        bool ok[PREAUTH_MAX];
        unsigned up = 0;

        for (unsigned i = 0; i < PREAUTH_MAX; i++)
            up += ok[i] = atk_connect(&held[i], addr, port) == 0;
        report(up == PREAUTH_MAX, "S6 %u of %u unauthenticated connections accepted", up,
               PREAUTH_MAX);
        rc = atk_connect(&b, addr, port);
        report(rc != 0, "S6 one more is refused (%s)", rc != 0 ? strerror(-rc) : "accepted");
        if (rc == 0)
            atk_close(&b);
        for (unsigned i = 0; i < PREAUTH_MAX; i++)
            if (ok[i])
                atk_close(&held[i]);
        usleep(500 * 1000); /* the node sees the disconnects */
        rc = atk_connect(&b, addr, port);
        report(rc == 0, "S6 after they closed, a connection is accepted again (%s)",
               rc == 0 ? "yes" : strerror(-rc));
        if (rc == 0)
            atk_close(&b);
    }
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
    snprintf(grant_cost_path, sizeof(grant_cost_path), "%s/verbs_grant_costs.txt", rdir);
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

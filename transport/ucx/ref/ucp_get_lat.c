/* SPDX-License-Identifier: Apache-2.0 */
/* kvt-ucp-get-lat: the floor for one small READ over UCP, written against the raw
 * UCP API with nothing of kvtier in the path, for `kvtier-bench transport` to put
 * next to the UCX backend's 4 KiB READ latency (ucx_perftest has no GET latency
 * test: its ucp_get with -O 1 over tcp takes ~1.1 ms an op).
 *
 * Two processes joined by a socketpair, forked before UCP is touched. The target
 * maps a region (ucp_mem_map), packs its rkey and sends {worker address, rkey, base}
 * over the socket, then busy-polls its worker (the tcp transport emulates GET in
 * software, so the target's CPU must run) until the initiator writes a byte. The
 * initiator creates one endpoint from the worker address (UCP_ERR_HANDLING_MODE_PEER,
 * as kvtier's endpoints), maps its local buffer, unpacks the rkey and loops: one
 * ucp_get_nbx of --size bytes with the local memh, busy ucp_worker_progress until
 * ucp_request_check_status leaves INPROGRESS. Prints one line:
 *   "ucp_get_lat size <B> iters <N> p50 <us> p99 <us> avg <us>"
 * Exit 0 on success. UCX_TLS is whatever the environment says (the bench sets tcp). */
#include <errno.h>
#include <poll.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <ucp/api/ucp.h>

struct ref_ucp {
    ucp_context_h ctx;
    ucp_worker_h worker;
};

static double ref_now_us(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec / 1e3;
}

/* Moves all len bytes through fd (write when out, else read); 0 or -1. */
static int ref_io_all(int fd, void *buf, size_t len, bool out)
{
    uint8_t *p = buf;

    while (len > 0) {
        ssize_t n = out ? write(fd, p, len) : read(fd, p, len);

        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            return -1;
        p += n;
        len -= (size_t)n;
    }
    return 0;
}

static int ref_ucp_open(struct ref_ucp *u)
{
    ucp_params_t params = {
        .field_mask = UCP_PARAM_FIELD_FEATURES,
        .features = UCP_FEATURE_RMA,
    };
    ucp_worker_params_t wp = {
        .field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE,
        .thread_mode = UCS_THREAD_MODE_SINGLE,
    };
    ucp_config_t *config;
    ucs_status_t st;

    st = ucp_config_read(NULL, NULL, &config);
    if (st != UCS_OK)
        return -1;
    st = ucp_init(&params, config, &u->ctx);
    ucp_config_release(config);
    if (st != UCS_OK)
        return -1;
    st = ucp_worker_create(u->ctx, &wp, &u->worker);
    if (st != UCS_OK) {
        ucp_cleanup(u->ctx);
        return -1;
    }
    return 0;
}

static void ref_ucp_close(struct ref_ucp *u)
{
    ucp_worker_destroy(u->worker);
    ucp_cleanup(u->ctx);
}

static ucs_status_t ref_map(struct ref_ucp *u, void *buf, size_t len, ucp_mem_h *memh_p)
{
    ucp_mem_map_params_t mp = {
        .field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH,
        .address = buf,
        .length = len,
    };

    return ucp_mem_map(u->ctx, &mp, memh_p);
}

/* The target: exposes size bytes, progresses until the initiator says stop. */
static int ref_target(int sock, size_t size)
{
    struct ref_ucp u;
    ucp_mem_h memh;
    ucp_address_t *addr;
    size_t addr_len, rkey_len;
    void *rkey_buf;
    uint8_t *buf = aligned_alloc(4096, size);
    int rc = 1;

    if (buf == NULL || ref_ucp_open(&u) < 0)
        return 1;
    memset(buf, 0x5a, size);
    if (ref_map(&u, buf, size, &memh) != UCS_OK)
        goto out_close;
    if (ucp_rkey_pack(u.ctx, memh, &rkey_buf, &rkey_len) != UCS_OK)
        goto out_unmap;
    if (ucp_worker_get_address(u.worker, &addr, &addr_len) != UCS_OK)
        goto out_rkey;

    uint64_t hdr[3] = {addr_len, rkey_len, (uint64_t)(uintptr_t)buf};

    if (ref_io_all(sock, hdr, sizeof(hdr), true) < 0 ||
        ref_io_all(sock, addr, addr_len, true) < 0 ||
        ref_io_all(sock, rkey_buf, rkey_len, true) < 0)
        goto out_addr;
    for (unsigned long i = 0;; i++) {
        ucp_worker_progress(u.worker);
        if ((i & 1023) == 0) {
            struct pollfd pfd = {.fd = sock, .events = POLLIN};

            if (poll(&pfd, 1, 0) > 0)
                break;
        }
    }
    rc = 0;
out_addr:
    ucp_worker_release_address(u.worker, addr);
out_rkey:
    ucp_rkey_buffer_release(rkey_buf);
out_unmap:
    ucp_mem_unmap(u.ctx, memh);
out_close:
    ref_ucp_close(&u);
    free(buf);
    return rc;
}

static int ref_cmp(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;

    return x < y ? -1 : x > y;
}

static void ref_err_cb(void *arg, ucp_ep_h ep, ucs_status_t status)
{
    *(ucs_status_t *)arg = status;
}

/* One get, waited for by busy progress. */
static ucs_status_t ref_get(struct ref_ucp *u, ucp_ep_h ep, void *local, size_t size,
                            uint64_t remote, ucp_rkey_h rkey, const ucp_request_param_t *param)
{
    ucs_status_ptr_t req = ucp_get_nbx(ep, local, size, remote, rkey, param);
    ucs_status_t st;

    if (req == NULL)
        return UCS_OK;
    if (UCS_PTR_IS_ERR(req))
        return UCS_PTR_STATUS(req);
    while ((st = ucp_request_check_status(req)) == UCS_INPROGRESS)
        ucp_worker_progress(u->worker);
    ucp_request_free(req);
    return st;
}

static int ref_initiator(int sock, size_t size, unsigned iters, unsigned warmup)
{
    struct ref_ucp u;
    uint64_t hdr[3];
    uint8_t *addr = NULL, *rkey_buf = NULL;
    uint8_t *local = aligned_alloc(4096, size);
    double *lat = calloc(iters, sizeof(*lat));
    ucs_status_t ep_status = UCS_OK, st = UCS_OK;
    ucp_ep_h ep = NULL;
    ucp_rkey_h rkey = NULL;
    ucp_mem_h memh = NULL;
    int rc = 1;

    if (local == NULL || lat == NULL || ref_io_all(sock, hdr, sizeof(hdr), false) < 0 ||
        hdr[0] > (1u << 20) || hdr[1] > (1u << 20))
        return 1;
    addr = malloc(hdr[0]);
    rkey_buf = malloc(hdr[1]);
    if (addr == NULL || rkey_buf == NULL || ref_io_all(sock, addr, hdr[0], false) < 0 ||
        ref_io_all(sock, rkey_buf, hdr[1], false) < 0 || ref_ucp_open(&u) < 0)
        return 1;

    ucp_ep_params_t ep_params = {
        .field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                      UCP_EP_PARAM_FIELD_ERR_HANDLER,
        .address = (const ucp_address_t *)addr,
        .err_mode = UCP_ERR_HANDLING_MODE_PEER,
        .err_handler = {.cb = ref_err_cb, .arg = &ep_status},
    };

    if (ucp_ep_create(u.worker, &ep_params, &ep) != UCS_OK ||
        ref_map(&u, local, size, &memh) != UCS_OK ||
        ucp_ep_rkey_unpack(ep, rkey_buf, &rkey) != UCS_OK)
        goto out;

    ucp_request_param_t param = {.op_attr_mask = UCP_OP_ATTR_FIELD_MEMH, .memh = memh};
    double sum = 0;

    for (unsigned i = 0; i < warmup && st == UCS_OK; i++)
        st = ref_get(&u, ep, local, size, hdr[2], rkey, &param);
    for (unsigned i = 0; i < iters && st == UCS_OK; i++) {
        double t = ref_now_us();

        st = ref_get(&u, ep, local, size, hdr[2], rkey, &param);
        lat[i] = ref_now_us() - t;
        sum += lat[i];
    }
    if (st != UCS_OK || ep_status != UCS_OK) {
        fprintf(stderr, "kvt-ucp-get-lat: get: %s\n",
                ucs_status_string(st != UCS_OK ? st : ep_status));
        goto out;
    }
    if (local[0] != 0x5a || local[size - 1] != 0x5a) {
        fprintf(stderr, "kvt-ucp-get-lat: the bytes read are not the target's\n");
        goto out;
    }
    qsort(lat, iters, sizeof(*lat), ref_cmp);
    printf("ucp_get_lat size %zu iters %u p50 %.2f p99 %.2f avg %.2f\n", size, iters,
           lat[iters / 2], lat[(size_t)((double)iters * 0.99)], sum / iters);
    rc = 0;
out:
    if (rkey != NULL)
        ucp_rkey_destroy(rkey);
    if (ep != NULL) {
        ucp_request_param_t cp = {.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS,
                                  .flags = UCP_EP_CLOSE_FLAG_FORCE};
        ucs_status_ptr_t req = ucp_ep_close_nbx(ep, &cp);

        if (UCS_PTR_IS_PTR(req)) {
            while (ucp_request_check_status(req) == UCS_INPROGRESS)
                ucp_worker_progress(u.worker);
            ucp_request_free(req);
        }
    }
    if (memh != NULL)
        ucp_mem_unmap(u.ctx, memh);
    ref_ucp_close(&u);
    free(addr);
    free(rkey_buf);
    free(local);
    free(lat);
    return rc;
}

int main(int argc, char **argv)
{
    size_t size = 4096;
    unsigned iters = 10000, warmup = 100;
    int sv[2], st, rc;

    for (int i = 1; i + 1 < argc; i += 2) {
        if (strcmp(argv[i], "-s") == 0)
            size = strtoull(argv[i + 1], NULL, 0);
        else if (strcmp(argv[i], "-n") == 0)
            iters = (unsigned)strtoul(argv[i + 1], NULL, 0);
        else if (strcmp(argv[i], "-w") == 0)
            warmup = (unsigned)strtoul(argv[i + 1], NULL, 0);
        else
            argc = 0;
    }
    if (argc % 2 != 1 || size == 0 || iters < 100) {
        fprintf(stderr, "usage: kvt-ucp-get-lat [-s bytes] [-n iters >= 100] [-w warmup]\n");
        return 2;
    }
    if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv) < 0)
        return 1;

    pid_t pid = fork();

    if (pid < 0)
        return 1;
    if (pid == 0) {
        close(sv[0]);
        _exit(ref_target(sv[1], size));
    }
    close(sv[1]);
    rc = ref_initiator(sv[0], size, iters, warmup);
    (void)!write(sv[0], "x", 1);
    close(sv[0]);
    if (waitpid(pid, &st, 0) < 0 || !WIFEXITED(st) || WEXITSTATUS(st) != 0)
        rc = 1;
    return rc;
}

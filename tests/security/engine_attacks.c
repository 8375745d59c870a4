/* SPDX-License-Identifier: Apache-2.0 */
/* A real kvtierd against clients that do not follow the protocol ("engine
 * isolation and bounds"): each attack below once worked against the daemon; here it
 * must be refused or bounded, counted on /metrics with its reason, and leave the
 * daemon serving real engines.
 *
 *   1  engine B completes engine A's write-pending store (a third engine would load a
 *      row nobody finished writing)
 *   2  events pile up when no engine calls take_events
 *   3  big params on many requests
 *   4  pipelined get_stats whose replies are never read (each executed one queued its
 *      reply: ~33 MB per connection)
 *   5  connections that never say HELLO take every slot
 *   6  one-byte /metrics connections take every HTTP slot
 *   7  one key named 4096 times in prepare_load/complete_load (a quadratic check)
 *   8  a HELLO name with a newline and escape sequences forges log lines
 *   9  a configuration of 100,000 nested '['
 *  10  the engine socket's mode comes from the configuration, not the umask
 *  11  an engine truncates its attached region's file: the node's copies to and from
 *      the mapping fault (SIGBUS killed the daemon)
 *  12  an engine creates the request "kvtier-jobs-<N>" before engine N attaches: the
 *      node's jobs request for N then exists and N's ATTACH is refused
 *
 * The clients speak raw frames over the unix socket (the wire codec builds them, the
 * order and contents are the attacker's). The daemon runs with small bounds so that
 * each attack reaches them quickly; it is started on a free metrics port with its
 * region in /dev/shm and its socket in a fresh directory, and is stopped with SIGTERM
 * (exit 0, nothing pinned or write-pending).
 *
 *   kvt-engine-attacks KVTIERD TMPDIR */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "kvtier/engine_proto.h"

static const char *kvtierd;
static char work[512], sock_path[600], log_path[600], cfg_path[600], region[256], region_dir[200];
static uint16_t mport;
static pid_t daemon_pid = -1;
static int failures, passes;

/* ---- reporting ---------------------------------------------------------------------- */

static void check(bool ok, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void check(bool ok, const char *fmt, ...)
{
    va_list ap;

    printf("%s - ", ok ? "ok" : "FAIL");
    va_start(ap, fmt);
    vprintf(fmt, ap);
    va_end(ap);
    printf("\n");
    fflush(stdout);
    if (ok)
        passes++;
    else
        failures++;
}

static void die(const char *what)
{
    fprintf(stderr, "engine_attacks: %s: %s\n", what, strerror(errno));
    if (daemon_pid > 0)
        kill(daemon_pid, SIGKILL);
    exit(2);
}

static double now_ms(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

/* ---- the daemon ------------------------------------------------------------------------ */

static uint16_t free_port(void)
{
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t sl = sizeof(sa);
    int fd = socket(AF_INET, SOCK_STREAM, 0);

    if (fd < 0 || bind(fd, (struct sockaddr *)&sa, sizeof(sa)) != 0 ||
        getsockname(fd, (struct sockaddr *)&sa, &sl) != 0)
        die("free port");
    close(fd);
    return ntohs(sa.sin_port);
}

/* The whole file (also /proc files, whose size reads as 0); "" when absent. */
static char *read_file(const char *path)
{
    FILE *f = fopen(path, "r");
    char *text = NULL;
    size_t len = 0, cap = 0, n;

    if (f == NULL)
        return strdup("");
    do {
        if (cap - len < 4096) {
            cap = cap ? 2 * cap : 65536;
            text = realloc(text, cap + 1);
            if (text == NULL)
                die("realloc");
        }
        n = fread(text + len, 1, cap - len, f);
        len += n;
    } while (n > 0);
    fclose(f);
    text[len] = '\0';
    return text;
}

/* Runs kvtierd with args, stderr and stdout into log_path; returns its pid. */
static pid_t spawn(char *const argv[], mode_t umask_in_child)
{
    pid_t pid = fork();

    if (pid < 0)
        die("fork");
    if (pid == 0) {
        int fd = open(log_path, O_WRONLY | O_CREAT | O_TRUNC, 0600);

        if (fd < 0)
            _exit(126);
        dup2(fd, 1);
        dup2(fd, 2);
        umask(umask_in_child);
        execv(kvtierd, argv);
        _exit(127);
    }
    return pid;
}

static void write_config(void)
{
    FILE *f = fopen(cfg_path, "w");

    if (f == NULL)
        die("config");
    fprintf(f,
            "node: {id: 21}\n"
            "primary: {path: %s, size: 64MiB, row_bytes: 256KiB}\n"
            "storage: {enabled: false}\n"
            "network: {enabled: false}\n"
            "engine:\n"
            "  socket: %s\n"
            "  socket_mode: 0600\n"
            "  hello_timeout_ms: 300\n"
            "  max_requests: 16\n"
            "  max_params_bytes: 1KiB\n"
            "  max_output_bytes: 64KiB\n"
            "  max_event_keys: 64\n"
            "metrics: {port: %u, max_connections: 8, read_timeout_ms: 300, write_timeout_ms: 500}\n"
            "log: {level: info}\n",
            region, sock_path, (unsigned)mport);
    fclose(f);
}

static void start_daemon(void)
{
    char *argv[] = {(char *)kvtierd, "--config", cfg_path, NULL};

    daemon_pid = spawn(argv, 0); /* umask 0: the socket's mode must not come from it */
    for (int i = 0; i < 400; i++) {
        char *log = read_file(log_path);
        bool ready = strstr(log, "kvtierd: ready") != NULL;

        free(log);
        if (ready)
            return;
        if (waitpid(daemon_pid, NULL, WNOHANG) == daemon_pid) {
            daemon_pid = -1;
            break;
        }
        usleep(25000);
    }
    char *log = read_file(log_path);
    fprintf(stderr, "kvtierd did not start:\n%s\n", log);
    free(log);
    die("start");
}

/* ---- HTTP ---------------------------------------------------------------------------- */

static int tcp_connect(void)
{
    struct sockaddr_in sa = {
        .sin_family = AF_INET, .sin_port = htons(mport), .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);

    if (fd < 0 || connect(fd, (struct sockaddr *)&sa, sizeof(sa)) != 0)
        die("connect to /metrics");
    return fd;
}

/* GET path; the status (0: no reply within 5 s), the body in *body_p (free it). */
static int http_get(const char *path, char **body_p)
{
    struct timeval tv = {.tv_sec = 5};
    char req[256], *buf = NULL, *sep;
    size_t len = 0, cap = 0;
    int fd = tcp_connect(), status = 0, n;

    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    n = snprintf(req, sizeof(req), "GET %s HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", path);
    if (send(fd, req, (size_t)n, MSG_NOSIGNAL) != n)
        die("send");
    for (;;) {
        if (cap - len < 65536) {
            cap = cap ? 2 * cap : 1 << 20;
            buf = realloc(buf, cap);
            if (buf == NULL)
                die("realloc");
        }
        ssize_t got = recv(fd, buf + len, cap - len - 1, 0);

        if (got <= 0)
            break;
        len += (size_t)got;
    }
    close(fd);
    if (buf == NULL)
        buf = strdup("");
    buf[len] = '\0';
    sscanf(buf, "HTTP/1.%*d %d", &status);
    sep = strstr(buf, "\r\n\r\n");
    if (body_p != NULL)
        *body_p = strdup(sep != NULL ? sep + 4 : "");
    free(buf);
    return status;
}

/* The value of one series on /metrics, e.g. metric("kvtier_engine_refused_total",
 * "foreign_store"); -1 when absent. */
static double metric(const char *name, const char *reason)
{
    char line[256], *body = NULL, *p;
    double v = -1;

    if (reason != NULL)
        snprintf(line, sizeof(line), "\n%s{reason=\"%s\"} ", name, reason);
    else
        snprintf(line, sizeof(line), "\n%s ", name);
    if (http_get("/metrics", &body) == 200 && (p = strstr(body, line)) != NULL)
        v = strtod(p + strlen(line), NULL);
    free(body);
    return v;
}

/* Waits (the page is published once a second) until the series reaches at least min. */
static double metric_at_least(const char *name, const char *reason, double min)
{
    double v = -1;

    for (int i = 0; i < 40 && (v = metric(name, reason)) < min; i++)
        usleep(100000);
    return v;
}

/* ---- the engine socket --------------------------------------------------------------- */

struct eng {
    int fd;
    uint64_t seq;
};

static int unix_connect(void)
{
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);

    if (strlen(sock_path) >= sizeof(sa.sun_path))
        die("engine socket path too long");
    memcpy(sa.sun_path, sock_path, strlen(sock_path) + 1);
    if (fd < 0 || connect(fd, (struct sockaddr *)&sa, sizeof(sa)) != 0)
        die("connect to the engine socket");
    return fd;
}

static void send_msg(int fd, const struct kvt_emsg *m)
{
    struct kvt_ebuf b;

    kvt__ebuf_init(&b);
    if (kvt__emsg_encode(m, &b) != 0 || send(fd, b.data, b.len, MSG_NOSIGNAL) != (ssize_t)b.len)
        die("send a frame");
    kvt__ebuf_cleanup(&b);
}

/* One frame (5 s at most); 0 or -1 (EOF, reset or timeout). */
static int recv_msg(int fd, struct kvt_emsg *m)
{
    static const struct kvt_eproto_limits lim = {.max_body = 256u << 20,
                                                 .max_keys = UINT32_MAX,
                                                 .max_params = 1u << 20,
                                                 .max_events = UINT32_MAX,
                                                 .max_stats = UINT32_MAX};
    struct timeval tv = {.tv_sec = 5};
    uint8_t hdr[4], *body;
    uint32_t len;
    int rc;

    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    if (recv(fd, hdr, 4, MSG_WAITALL) != 4)
        return -1;
    len = kvt__eproto_frame_len(hdr);
    body = malloc(len ? len : 1);
    if (body == NULL)
        die("malloc");
    if (len > 0 && recv(fd, body, len, MSG_WAITALL) != (ssize_t)len) {
        free(body);
        return -1;
    }
    rc = kvt__emsg_decode(body, len, &lim, m);
    free(body);
    return rc == 0 ? 0 : -1;
}

static void req_init(struct eng *e, struct kvt_emsg *m, uint32_t op, const char *req_id)
{
    kvt__emsg_init(m);
    m->op = op;
    m->seq = ++e->seq;
    m->has = 1u << KVT_EF_OP | 1u << KVT_EF_SEQ;
    if (req_id != NULL) {
        snprintf(m->req_id, sizeof(m->req_id), "%s", req_id);
        m->has |= 1u << KVT_EF_REQ_ID;
    }
}

/* Sends m, reads its reply into *r (kvt__emsg_free it); the reply's rc, or -EPIPE. */
static int call(struct eng *e, struct kvt_emsg *m, struct kvt_emsg *r)
{
    send_msg(e->fd, m);
    if (recv_msg(e->fd, r) != 0)
        return -EPIPE;
    if (r->op == (KVT_EOP_ERROR | KVT_EOP_REPLY))
        return (int)r->rc;
    return r->seq == m->seq ? (int)r->rc : -EPROTO;
}

static int call0(struct eng *e, struct kvt_emsg *m)
{
    struct kvt_emsg r;
    int rc = call(e, m, &r);

    if (rc != -EPIPE)
        kvt__emsg_free(&r);
    return rc;
}

static struct eng hello(const char *name)
{
    struct eng e = {.fd = unix_connect()};
    struct kvt_emsg m;

    req_init(&e, &m, KVT_EOP_HELLO, NULL);
    m.major = KVTIER_PROTO_MAJOR;
    snprintf(m.name, sizeof(m.name), "%s", name);
    m.has |= 1u << KVT_EF_MAJOR | 1u << KVT_EF_NAME;
    if (call0(&e, &m) != 0)
        die("HELLO");
    return e;
}

static struct kvtier_key mkkey(int i)
{
    struct kvtier_key k = {0};

    k.len = (uint8_t)snprintf((char *)k.bytes, sizeof(k.bytes), "attack-key-%d", i);
    return k;
}

static int new_request(struct eng *e, const char *id, const char *params)
{
    struct kvt_emsg m;

    req_init(e, &m, KVT_EOP_NEW_REQUEST, id);
    if (params != NULL) {
        m.params = (char *)params;
        m.params_len = (uint32_t)strlen(params);
        m.has |= 1u << KVT_EF_PARAMS;
    }
    return call0(e, &m);
}

static int keys_op(struct eng *e, uint32_t op, const char *id, struct kvtier_key *k, uint32_t n,
                   uint64_t flags, struct kvt_emsg *r)
{
    struct kvt_emsg m, scratch;
    int rc;

    req_init(e, &m, op, id);
    m.keys = k;
    m.n_keys = n;
    m.flags = flags;
    m.has |= 1u << KVT_EF_KEYS | 1u << KVT_EF_FLAGS;
    rc = call(e, &m, r != NULL ? r : &scratch);
    if (r == NULL && rc != -EPIPE)
        kvt__emsg_free(&scratch);
    return rc;
}

static int store(struct eng *e, const char *id, int first, int n)
{
    struct kvtier_key k[64];
    int rc;

    for (int i = 0; i < n; i++)
        k[i] = mkkey(first + i);
    rc = keys_op(e, KVT_EOP_PREPARE_STORE, id, k, (uint32_t)n, 0, NULL);
    if (rc == 0)
        rc = keys_op(e, KVT_EOP_COMPLETE_STORE, id, k, (uint32_t)n, 1, NULL);
    return rc;
}

/* Sends m with fd passed beside its first byte (SCM_RIGHTS), as ATTACH wants it. */
static void send_msg_fd(int sock, const struct kvt_emsg *m, int fd)
{
    union {
        struct cmsghdr h;
        char buf[CMSG_SPACE(sizeof(int))];
    } ctl;
    struct kvt_ebuf b;
    struct iovec iov;
    struct msghdr mh = {.msg_iov = &iov,
                        .msg_iovlen = 1,
                        .msg_control = ctl.buf,
                        .msg_controllen = sizeof(ctl.buf)};
    struct cmsghdr *cm;

    kvt__ebuf_init(&b);
    if (kvt__emsg_encode(m, &b) != 0)
        die("encode");
    iov = (struct iovec){.iov_base = b.data, .iov_len = b.len};
    memset(&ctl, 0, sizeof(ctl));
    cm = CMSG_FIRSTHDR(&mh);
    cm->cmsg_level = SOL_SOCKET;
    cm->cmsg_type = SCM_RIGHTS;
    cm->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(cm), &fd, sizeof(int));
    if (sendmsg(sock, &mh, MSG_NOSIGNAL) != (ssize_t)b.len)
        die("send a frame with an fd");
    kvt__ebuf_cleanup(&b);
}

/* HELLO as hello() does, with the reply's geometry (KVT_EG_*) in geom. */
static struct eng hello_geom(const char *name, uint64_t geom[KVT_EPROTO_GEOM_MAX])
{
    struct eng e = {.fd = unix_connect()};
    struct kvt_emsg m, r;

    req_init(&e, &m, KVT_EOP_HELLO, NULL);
    m.major = KVTIER_PROTO_MAJOR;
    snprintf(m.name, sizeof(m.name), "%s", name);
    m.has |= 1u << KVT_EF_MAJOR | 1u << KVT_EF_NAME;
    if (call(&e, &m, &r) != 0 || r.n_geom < KVT_EG_COUNT)
        die("HELLO");
    memcpy(geom, r.geom, sizeof(r.geom));
    kvt__emsg_free(&r);
    return e;
}

/* ATTACH of fd's first rows rows of stride bytes; the reply's rc. */
static int attach(struct eng *e, int fd, uint64_t rows, uint64_t stride)
{
    struct kvt_emsg m, r;
    int rc;

    req_init(e, &m, KVT_EOP_ATTACH, NULL);
    m.geom[KVT_EA_ROWS] = rows;
    m.geom[KVT_EA_STRIDE] = stride;
    m.geom[KVT_EA_SIZE] = rows * stride;
    m.geom[KVT_EA_OFFSET] = 0;
    m.n_geom = KVT_EA_COUNT;
    m.has |= 1u << KVT_EF_GEOM;
    send_msg_fd(e->fd, &m, fd);
    if (recv_msg(e->fd, &r) != 0)
        return -EPIPE;
    rc = r.seq == m.seq ? (int)r.rc : -EPROTO;
    kvt__emsg_free(&r);
    return rc;
}

/* One JOBS request of one job (id, kind) of n keys into rows; 0 with the job's key
 * bytes (1 done) in ok[0..n) when the reply reports it, -EAGAIN when it does not yet,
 * else the rc. */
static int job(struct eng *e, uint64_t id, uint64_t kind, struct kvtier_key *k, const int64_t *rows,
               uint32_t n, uint8_t *ok)
{
    uint64_t triple[3] = {id, kind, n};
    struct kvt_emsg m, r;
    int rc;

    req_init(e, &m, KVT_EOP_JOBS, NULL);
    m.job_keys = k;
    m.n_job_keys = n;
    m.ids = (int64_t *)rows;
    m.n_ids = n;
    m.jobs = triple;
    m.n_jobs = 3;
    m.has |= 1u << KVT_EF_JOB_KEYS | 1u << KVT_EF_IDS | 1u << KVT_EF_JOBS;
    rc = call(e, &m, &r);
    if (rc == -EPIPE)
        return rc;
    if (rc == 0)
        rc = r.n_jobs == 3 && r.jobs[0] == id && r.n_ok == n ? 0 : -EAGAIN;
    if (rc == 0)
        memcpy(ok, r.ok, n);
    kvt__emsg_free(&r);
    return rc;
}

/* Whether kvtierd still runs after a call that returned rc (-EPIPE: it is given
 * a moment to end); when it does not, says how it ended and stops. */
static void daemon_alive(const char *after, int rc)
{
    int status;

    for (int i = 0; i < (rc == -EPIPE ? 100 : 1); i++) {
        if (waitpid(daemon_pid, &status, WNOHANG) == daemon_pid) {
            check(false, "kvtierd %s %d after %s",
                  WIFSIGNALED(status) ? "was killed by signal" : "exited",
                  WIFSIGNALED(status) ? WTERMSIG(status) : WEXITSTATUS(status), after);
            daemon_pid = -1;
            printf("# %d passed, %d failed (daemon log: %s)\n", passes, failures, log_path);
            exit(1);
        }
        if (rc == -EPIPE)
            usleep(50000);
    }
}

/* A region file of rows rows of row bytes in the work folder, row r filled with r + 1. */
static int region_file(const char *name, size_t rows, size_t row)
{
    char path[700];
    uint8_t *buf = malloc(row);
    int fd;

    snprintf(path, sizeof(path), "%s/%s", work, name);
    fd = open(path, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0 || buf == NULL)
        die("region file");
    for (size_t r = 0; r < rows; r++) {
        memset(buf, (int)r + 1, row);
        if (pwrite(fd, buf, row, (off_t)(r * row)) != (ssize_t)row)
            die("region file");
    }
    free(buf);
    return fd;
}

/* ---- the attacks ---------------------------------------------------------------------- */

static void attack_foreign_complete_store(void)
{
    struct eng a = hello("a"), b = hello("b"), c = hello("c");
    struct kvtier_key x = mkkey(1), y = mkkey(2);
    struct kvt_emsg r;
    int rc;

    new_request(&a, "a-1", NULL);
    new_request(&b, "b-1", NULL);
    new_request(&c, "c-1", NULL);
    check(keys_op(&a, KVT_EOP_PREPARE_STORE, "a-1", &x, 1, 0, NULL) == 0, "1: A prepares key X");
    check(keys_op(&b, KVT_EOP_PREPARE_STORE, "b-1", &y, 1, 0, NULL) == 0,
          "1: B prepares a key of its own");
    rc = keys_op(&b, KVT_EOP_COMPLETE_STORE, "b-1", &x, 1, 1, NULL);
    check(rc == -EINVAL, "1: B's complete_store of A's key X is refused (rc %d)", rc);
    rc = keys_op(&c, KVT_EOP_LOOKUP, "c-1", &x, 1, 0, &r);
    check(rc == 0 && r.n_results == 1 && r.results[0] == KVTIER_HIT_PENDING,
          "1: a third engine sees X still being written");
    kvt__emsg_free(&r);
    rc = keys_op(&c, KVT_EOP_PREPARE_LOAD, "c-1", &x, 1, 0, NULL);
    check(rc == -EINVAL, "1: and cannot load it (rc %d)", rc);
    check(keys_op(&a, KVT_EOP_COMPLETE_STORE, "a-1", &x, 1, 1, NULL) == 0,
          "1: A completes its own store");
    check(keys_op(&b, KVT_EOP_COMPLETE_STORE, "b-1", &y, 1, 1, NULL) == 0,
          "1: B completes its own store");
    check(metric_at_least("kvtier_engine_refused_total", "foreign_store", 1) >= 1,
          "1: /metrics counts it: kvtier_engine_refused_total{reason=\"foreign_store\"}");
    close(a.fd);
    close(b.fd);
    close(c.fd);
}

static void attack_events_never_taken(void)
{
    struct eng a = hello("hoarder");
    double dropped, queued;
    int ok = 0;

    new_request(&a, "ev-1", NULL);
    for (int i = 0; i < 25; i++)
        ok += store(&a, "ev-1", 1000 + 8 * i, 8) == 0;
    check(ok == 25, "2: 200 chunks stored in 25 stores, take_events never called");
    dropped = metric_at_least("kvtier_engine_events_dropped_total", NULL, 17);
    queued = metric("kvtier_engine_event_keys_queued", NULL);
    check(dropped >= 17 && queued >= 0 && queued <= 64,
          "2: events bounded to engine.max_event_keys: %.0f keys queued, %.0f events dropped",
          queued, dropped);
    close(a.fd);
}

static void attack_params_and_requests(void)
{
    struct eng a = hello("params");
    char *big = malloc(2049);
    int rc, refused_at = -1;

    memset(big, 'p', 2048);
    big[2048] = '\0';
    rc = new_request(&a, "big-params", big);
    check(rc == -EMSGSIZE, "3: 2 KiB of params refused (rc %d), the connection stays", rc);
    for (int i = 0; i < 20 && refused_at < 0; i++) {
        char id[32];

        snprintf(id, sizeof(id), "many-%d", i);
        if (new_request(&a, id, "{}") == -ENOBUFS)
            refused_at = i;
    }
    check(refused_at == 16, "3: the 17th live request of one engine is refused (at %d)",
          refused_at);
    check(metric_at_least("kvtier_engine_refused_total", "params_bytes", 1) >= 1 &&
              metric_at_least("kvtier_engine_refused_total", "requests", 1) >= 1,
          "3: /metrics counts reasons params_bytes and requests");
    free(big);
    close(a.fd);
}

static void attack_unread_replies(void)
{
    enum { N = 20000 };
    struct eng a = hello("pipeliner");
    struct kvt_ebuf b;
    struct kvt_emsg m;
    double before, after;
    size_t off = 0;

    usleep(1100000); /* a fresh page: the count below starts from here */
    before = metric("kvtier_engine_requests_total", NULL);
    kvt__ebuf_init(&b);
    for (int i = 0; i < N; i++) {
        req_init(&a, &m, KVT_EOP_GET_STATS, NULL);
        if (kvt__emsg_encode(&m, &b) != 0)
            die("encode");
    }
    /* Write without blocking, as much as the daemon and the socket take. */
    fcntl(a.fd, F_SETFL, O_NONBLOCK);
    for (int i = 0; i < 50 && off < b.len; i++) {
        ssize_t n = send(a.fd, b.data + off, b.len - off, MSG_NOSIGNAL);

        if (n > 0)
            off += (size_t)n;
        else
            usleep(10000);
    }
    usleep(1500000); /* the next page */
    after = metric("kvtier_engine_requests_total", NULL);
    check(before >= 0 && after - before < N / 4,
          "4: %d get_stats pipelined (%zu bytes sent), replies unread: %.0f executed, the rest "
          "wait",
          N, off, after - before);
    check(metric_at_least("kvtier_engine_refused_total", "output_full", 1) >= 1,
          "4: /metrics counts reason output_full");
    kvt__ebuf_cleanup(&b);
    close(a.fd);
}

static void attack_silent_connections(void)
{
    int fds[70];
    double t0;
    struct eng e;
    bool all_closed = true;

    for (int i = 0; i < 70; i++)
        fds[i] = unix_connect();
    usleep(100000);
    t0 = now_ms();
    e = hello("late-engine");
    /* Attaching at all is the check (the time is printed, never asserted: a loaded
     * host is no failure); the silent ones are evicted or time out, counted below. */
    check(e.fd >= 0, "5: 70 connections without HELLO; an engine still attaches (%.0f ms)",
          now_ms() - t0);
    check(new_request(&e, "late-1", NULL) == 0, "5: and works");
    for (int i = 0; i < 70; i++) {
        struct kvt_emsg m;

        if (recv_msg(fds[i], &m) == 0) {
            all_closed = all_closed && m.op == (KVT_EOP_ERROR | KVT_EOP_REPLY);
            kvt__emsg_free(&m);
        } else {
            all_closed = false;
        }
        close(fds[i]);
    }
    check(all_closed, "5: every silent connection got an ERROR frame and was closed");
    check(metric_at_least("kvtier_engine_refused_total", "hello_timeout", 1) >= 1 &&
              metric_at_least("kvtier_engine_refused_total", "hello_evicted", 6) >= 6,
          "5: /metrics counts reasons hello_timeout and hello_evicted");
    close(e.fd);
}

static void attack_metrics_slots(void)
{
    int fds[70];
    double t0, full, timed_out;
    char *body = NULL;
    int status;

    for (int i = 0; i < 70; i++) {
        fds[i] = tcp_connect();
        if (send(fds[i], "G", 1, MSG_NOSIGNAL) != 1)
            die("send");
    }
    usleep(100000);
    t0 = now_ms();
    status = http_get("/metrics", &body);
    check(status == 200 && strstr(body, "kvtier_engine_clients") != NULL,
          "6: 70 one-byte /metrics connections; a scrape still gets the page in %.0f ms",
          now_ms() - t0);
    free(body);
    usleep(600000); /* past metrics.read_timeout_ms */
    for (int i = 0; i < 70; i++)
        close(fds[i]);
    /* Every one of the 70 ends refused for want of a slot or timed out in its slot; how
     * many of each depends on how fast the server thread ran meanwhile. */
    for (int i = 0; i < 40 && metric("kvtier_metrics_http_dropped_total", "full") +
                                      metric("kvtier_metrics_http_dropped_total", "read_timeout") <
                                  70;
         i++)
        usleep(100000);
    full = metric("kvtier_metrics_http_dropped_total", "full");
    timed_out = metric("kvtier_metrics_http_dropped_total", "read_timeout");
    check(full >= 1 && timed_out >= 1 && full + timed_out >= 70,
          "6: /metrics counts the 70 as reasons full (%.0f) and read_timeout (%.0f)", full,
          timed_out);
}

/* Nanoseconds the daemon's loop thread (its main thread) has run, from schedstat. */
static double loop_cpu_ms(void)
{
    char path[96], *text;
    double ns;

    snprintf(path, sizeof(path), "/proc/%d/task/%d/schedstat", (int)daemon_pid, (int)daemon_pid);
    text = read_file(path);
    ns = strtod(text, NULL);
    free(text);
    return ns / 1e6;
}

/* The daemon's CPU milliseconds (and the wall clock's in *wall_p) for 5
 * prepare_load + complete_load pairs of one key named n times; -1 on error. */
static double load_pairs_ms(struct eng *e, struct kvtier_key *k, uint32_t n, double *wall_p)
{
    double c0 = loop_cpu_ms(), t0 = now_ms();

    for (int r = 0; r < 5; r++) {
        if (keys_op(e, KVT_EOP_PREPARE_LOAD, "rep-1", k, n, 0, NULL) != 0 ||
            keys_op(e, KVT_EOP_COMPLETE_LOAD, "rep-1", k, n, 0, NULL) != 0)
            return -1;
    }
    *wall_p = (now_ms() - t0) / 5;
    return (loop_cpu_ms() - c0) / 5;
}

static void attack_repeated_key(void)
{
    struct eng a = hello("repeater");
    struct kvtier_key *k = calloc(4096, sizeof(*k));
    double small, large, wall;

    new_request(&a, "rep-1", NULL);
    store(&a, "rep-1", 5000, 1);
    for (int i = 0; i < 4096; i++)
        k[i] = mkkey(5000);
    load_pairs_ms(&a, k, 4096, &wall); /* warm: buffers at their size */
    small = load_pairs_ms(&a, k, 512, &wall);
    large = load_pairs_ms(&a, k, 4096, &wall);
    /* The loop's own ticks run meanwhile: a floor of 0.2 ms. */
    check(small >= 0 && large >= 0 && large < 24 * (small > 0.2 ? small : 0.2),
          "7: one key named 4096 times: prepare_load+complete_load %.2f ms of daemon CPU "
          "(%.2f ms wall; 512 times: %.2f ms CPU)",
          large, wall, small);
    free(k);
    close(a.fd);
}

static void attack_log_forgery(void)
{
    struct eng e = hello("x\nerror kvtierd: forged\x1b[2J\x07");
    char *log, *line;
    bool forged = false;

    close(e.fd);
    usleep(300000);
    log = read_file(log_path);
    for (line = log; line != NULL && *line;
         line = strchr(line, '\n') ? strchr(line, '\n') + 1 : NULL)
        forged = forged || strncmp(line, "error kvtierd: forged", 21) == 0;
    check(!forged && strchr(log, '\x1b') == NULL && strchr(log, '\x07') == NULL &&
              strstr(log, "x\\nerror kvtierd: forged\\x1b[2J\\x07") != NULL,
          "8: a HELLO name with a newline and escapes is logged escaped, on one line");
    free(log);
}

static void attack_deep_config(void)
{
    char deep_path[700], saved_log[sizeof(log_path)];
    FILE *f;
    double t0;
    int status;
    char *argv[] = {(char *)kvtierd, "--config", deep_path, NULL};

    snprintf(deep_path, sizeof(deep_path), "%s/deep.yaml", work);
    f = fopen(deep_path, "w");
    if (f == NULL)
        die("deep.yaml");
    fputs("log: {level: info}\nprimary: ", f);
    for (int i = 0; i < 100000; i++)
        fputc('[', f);
    fputc('\n', f);
    fclose(f);
    memcpy(saved_log, log_path, sizeof(log_path));
    snprintf(log_path, sizeof(log_path), "%s/deep.log", work);
    t0 = now_ms();
    pid_t pid = spawn(argv, 022);
    if (waitpid(pid, &status, 0) != pid)
        die("waitpid");
    double ms = now_ms() - t0;
    char *out = read_file(log_path);
    check(WIFEXITED(status) && WEXITSTATUS(status) == 78 && ms < 2000 &&
              strstr(out, "deep.yaml:2:") != NULL && strstr(out, "nested deeper") != NULL,
          "9: 100,000 nested '[': exit %d in %.0f ms, the line named",
          WIFEXITED(status) ? WEXITSTATUS(status) : -1, ms);
    free(out);
    memcpy(log_path, saved_log, sizeof(log_path));
}

static void socket_mode(void)
{
    struct stat st = {0};
    bool found = stat(sock_path, &st) == 0;

    check(found && S_ISSOCK(st.st_mode) && (st.st_mode & 07777) == 0600,
          "10: the engine socket has engine.socket_mode 0600 (daemon started with umask 0): %04o",
          (unsigned)(st.st_mode & 07777));
}

static void attack_truncated_region(void)
{
    uint64_t geom[KVT_EPROTO_GEOM_MAX];
    struct eng e = hello_geom("truncator", geom);
    size_t row = geom[KVT_EG_ROW_BYTES];
    struct kvtier_key k[2] = {mkkey(11000), mkkey(11001)};
    int64_t rows[2] = {0, 1};
    uint8_t ok[2] = {0, 0};
    int fd = region_file("truncated-region", 2, row), rc;

    check(attach(&e, fd, 2, row) == 0, "11: an engine attaches a region of 2 rows");
    rc = job(&e, 1, KVT_EJ_STORE, &k[0], &rows[0], 1, ok);
    check(rc == 0 && ok[0] == 1, "11: a store job from its row 0 is done (rc %d)", rc);
    if (ftruncate(fd, 0) != 0)
        die("ftruncate");
    ok[0] = 1;
    rc = job(&e, 2, KVT_EJ_STORE, &k[1], &rows[1], 1, ok);
    daemon_alive("a store job from a truncated region", rc);
    check(rc == 0 && ok[0] == 0, "11: the file truncated, a store job from it fails (rc %d)", rc);
    ok[0] = 1;
    rc = job(&e, 3, KVT_EJ_LOAD, &k[0], &rows[0], 1, ok);
    daemon_alive("a load job into a truncated region", rc);
    check(rc == 0 && ok[0] == 0, "11: and a load job into it fails (rc %d)", rc);
    close(fd);
    close(e.fd);
}

static void attack_jobs_request_squatted(void)
{
    uint64_t ga[KVT_EPROTO_GEOM_MAX], gb[KVT_EPROTO_GEOM_MAX];
    struct eng a = hello_geom("squatter", ga), b;
    char id[64];
    int fd, rc;
    double before = metric("kvtier_engine_refused_total", "unknown_request");

    /* Client ids are given in order: the next engine's is a's + 1. */
    snprintf(id, sizeof(id), "kvtier-jobs-%llu", (unsigned long long)ga[KVT_EG_CLIENT_ID] + 1);
    rc = new_request(&a, id, NULL);
    check(rc == -EINVAL, "12: an engine cannot create the request %s, the node's (rc %d)", id, rc);
    check(metric_at_least("kvtier_engine_refused_total", "unknown_request", before + 1) >=
              before + 1,
          "12: /metrics counts it: reason unknown_request");
    b = hello_geom("victim", gb);
    fd = region_file("victim-region", 1, gb[KVT_EG_ROW_BYTES]);
    rc = attach(&b, fd, 1, gb[KVT_EG_ROW_BYTES]);
    check(gb[KVT_EG_CLIENT_ID] == ga[KVT_EG_CLIENT_ID] + 1 && rc == 0,
          "12: engine %llu then attaches its region (rc %d)",
          (unsigned long long)gb[KVT_EG_CLIENT_ID], rc);
    close(fd);
    close(a.fd);
    close(b.fd);
}

static void still_serving_then_stop(void)
{
    struct eng e = hello("after-the-attacks");
    int status;

    check(new_request(&e, "final-1", NULL) == 0 && store(&e, "final-1", 9000, 4) == 0,
          "the daemon still serves an engine after the attacks");
    check(http_get("/healthz", NULL) == 200, "/healthz answers 200");
    close(e.fd);
    kill(daemon_pid, SIGTERM);
    for (int i = 0; i < 200; i++) {
        if (waitpid(daemon_pid, &status, WNOHANG) == daemon_pid) {
            char *log = read_file(log_path);

            check(WIFEXITED(status) && WEXITSTATUS(status) == 0 &&
                      strstr(log, "0 pinned, 0 write-pending") != NULL,
                  "SIGTERM: exit 0, nothing pinned or write-pending");
            free(log);
            daemon_pid = -1;
            return;
        }
        usleep(50000);
    }
    check(false, "SIGTERM: kvtierd did not exit within 10 s");
    kill(daemon_pid, SIGKILL);
    waitpid(daemon_pid, NULL, 0);
    daemon_pid = -1;
}

int main(int argc, char **argv)
{
    if (argc != 3) {
        fprintf(stderr, "usage: %s KVTIERD TMPDIR\n", argv[0]);
        return 2;
    }
    signal(SIGPIPE, SIG_IGN);
    kvtierd = argv[1];
    mkdir(argv[2], 0700);
    snprintf(work, sizeof(work), "%s/engine-attacks.XXXXXX", argv[2]);
    if (mkdtemp(work) == NULL)
        die("mkdtemp");
    snprintf(sock_path, sizeof(sock_path), "%s/engine.sock", work);
    snprintf(log_path, sizeof(log_path), "%s/daemon.log", work);
    snprintf(cfg_path, sizeof(cfg_path), "%s/kvtierd.yaml", work);
    /* The region in a folder of its own on the /dev/shm tmpfs (kvtierd refuses a
     * folder others may write, such as /dev/shm itself). */
    snprintf(region_dir, sizeof(region_dir), "/dev/shm/kvt-engine-attacks-%d", (int)getpid());
    snprintf(region, sizeof(region), "%s/region.mmap", region_dir);
    mport = free_port();
    write_config();

    attack_deep_config();
    start_daemon();
    socket_mode();
    attack_foreign_complete_store();
    attack_events_never_taken();
    attack_params_and_requests();
    attack_unread_replies();
    attack_silent_connections();
    attack_metrics_slots();
    attack_repeated_key();
    attack_log_forgery();
    attack_truncated_region();
    attack_jobs_request_squatted();
    still_serving_then_stop();

    printf("# %d passed, %d failed (daemon log: %s)\n", passes, failures, log_path);
    if (failures == 0) {
        char cmd[1200];

        snprintf(cmd, sizeof(cmd), "rm -rf '%s'", work);
        if (system(cmd) != 0)
            fprintf(stderr, "could not remove %s\n", work);
    }
    unlink(region);
    snprintf(region, sizeof(region), "%s/region.mmap.lock", region_dir);
    unlink(region);
    rmdir(region_dir);
    return failures == 0 ? 0 : 1;
}

/* SPDX-License-Identifier: Apache-2.0 */
/* kvtier: the node's command-line tool (docs/cli.md).
 *
 *   kvtier <command> [--socket PATH] [command options]
 *
 * Every command but bench connects to kvtierd's unix socket as an engine named
 * "kvtier-cli" through libkvtier-client, exactly as an inference engine would, and
 * declares no model fingerprint (a node accepts such an engine whatever its model):
 * status and stats read the node's totals (what /metrics shows), peers its member
 * table, reset asks it to forget every chunk. There is no HTTP client here: a node
 * that answers on its engine socket is serving (it stops accepting engines first
 * when it drains). bench execs kvtier-bench with the remaining arguments. Every
 * command is one short-lived connection: the daemon cleans up whatever a killed CLI
 * left (pins, prepared stores, requests).
 *
 * Exit status: 0 success, 1 the operation failed (daemon unreachable, key not
 * found, verify mismatch, unhealthy), 2 bad command line. */
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <glob.h>
#include <inttypes.h>
#include <limits.h>
#include <math.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <termios.h>
#include <unistd.h>

#include <jansson.h>

#include "kvt/version.h"
#include "kvtier/client.h"
#include "tool_util.h"

#define EX_FAIL  KVT_TOOL_EX_FAIL
#define EX_USAGE KVT_TOOL_EX_USAGE

#define LOOKUP_STEPS 200 /* steps a lookup may stay RETRY / HIT_PENDING */

struct cli {
    const char *cmd;
    const char *socket;
    int timeout_ms;
    /* command options */
    const char *file;
    const char *out;
    bool has_pattern;
    uint64_t pattern;
    bool once;
    bool json;
    uint64_t iterations; /* top: 0 = until q */
    double interval_s;
    char **args;
    int n_args;
};

static void usage(FILE *f)
{
    fprintf(f, "usage: kvtier <command> [--socket PATH] [options]\n\n"
               "commands:\n"
               "  status                  node reachable, region, model fingerprint, chunks,\n"
               "                          engines and peers\n"
               "  stats [--json]          the node's stats since it started (as /metrics)\n"
               "  peers                   the node's cluster: every member, its state and the\n"
               "                          bytes pulled from and served to it\n"
               "  reset                   the node forgets every chunk (primary, storage\n"
               "                          files, cluster records); refused while an engine\n"
               "                          holds pins or stores\n"
               "  lookup KEYHEX... [--once]\n"
               "                          look keys up (steps until HIT or MISS unless --once)\n"
               "  put KEYHEX (--file F | --pattern SEED)\n"
               "                          store one test chunk through the engine API\n"
               "  get KEYHEX [--out F] [--pattern SEED]\n"
               "                          load one chunk; write it to F, or verify it against\n"
               "                          the pattern, or print its summary\n"
               "  top [--interval S] [--iterations N]\n"
               "                          live view of stats deltas (q or Ctrl-C quits)\n"
               "  bench ARGS...           runs kvtier-bench ARGS...\n\n"
               "common options:\n"
               "  --socket PATH           the daemon's engine socket (default: $KVTIER_SOCKET,\n"
               "                          else the only /run/kvtier/[*/]engine.sock)\n"
               "  --timeout MS            per-call timeout (default 10000)\n"
               "  -h, --help              this text\n"
               "  -V, --version           the version and git revision of this build\n\n"
               "exit status: 0 ok, 1 failed, 2 bad command line\n");
}

static int bad_usage(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static int bad_usage(const char *fmt, ...)
{
    va_list ap;

    fprintf(stderr, "kvtier: ");
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fprintf(stderr, "\n(kvtier --help for usage)\n");
    return EX_USAGE;
}

static int fail(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static int fail(const char *fmt, ...)
{
    va_list ap;

    fprintf(stderr, "kvtier: ");
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    return EX_FAIL;
}

/* --socket, else $KVTIER_SOCKET, else the only socket where kvtierd puts it:
 * /run/kvtier/<id>/engine.sock (its default) or /run/kvtier/engine.sock (the packaged
 * service's); folders only the daemon writes, so no name another user could have made,
 * as one in /tmp could be. */
static int resolve_socket(struct cli *cl)
{
    static char found[PATH_MAX];
    glob_t g;

    if (cl->socket != NULL)
        return 0;
    cl->socket = getenv("KVTIER_SOCKET");
    if (cl->socket != NULL && *cl->socket)
        return 0;
    cl->socket = NULL;
    glob("/run/kvtier/engine.sock", 0, NULL, &g); /* the packaged service's */
    glob("/run/kvtier/*/engine.sock", GLOB_APPEND, NULL, &g);
    if (g.gl_pathc == 1) {
        snprintf(found, sizeof(found), "%s", g.gl_pathv[0]);
        cl->socket = found;
    } else if (g.gl_pathc > 1) {
        globfree(&g);
        return fail("several sockets in /run/kvtier: say which with --socket");
    }
    globfree(&g);
    if (cl->socket == NULL)
        return fail("no daemon socket: give --socket PATH or set KVTIER_SOCKET");
    return 0;
}

static int connect_node(struct cli *cl, struct kvtier_client **c_p)
{
    struct kvtier_connect_opts o = {.name = "kvtier-cli", .timeout_ms = cl->timeout_ms};
    int rc = resolve_socket(cl);

    if (rc != 0)
        return rc;
    char why[KVTIER_ERROR_MAX + 1];
    struct kvtier_connect_ex ex = {.size = sizeof(ex),
                                   .name = o.name,
                                   .timeout_ms = o.timeout_ms,
                                   .error = why,
                                   .error_len = sizeof(why)};

    rc = kvtier_connect_ex(cl->socket, &ex, c_p);
    if (rc < 0)
        return fail("cannot connect to %s: %s%s%s", cl->socket, kvt_tool_strerror(rc),
                    why[0] ? ": " : "", why);
    return 0;
}

static void fmt_bytes(double b, char *out, size_t n)
{
    static const char *units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
    int u = 0;

    while (b >= 1024 && u < 4) {
        b /= 1024;
        u++;
    }
    snprintf(out, n, u ? "%.1f %s" : "%.0f %s", b, units[u]);
}

/* A stat's value for people: bytes with a unit, whole counts as integers, other
 * values (ratios, seconds, rates) with two decimals; suffix ("/s") appended. */
static void fmt_value(const char *name, double v, const char *suffix, char *out, size_t n)
{
    char num[32];

    if (strstr(name, "bytes") != NULL && v >= 0)
        fmt_bytes(v, num, sizeof(num));
    else if (v == floor(v) && fabs(v) < 1e15)
        snprintf(num, sizeof(num), "%.0f", v);
    else
        snprintf(num, sizeof(num), "%.2f", v);
    snprintf(out, n, "%s%s", num, suffix);
}

/* ---- status ------------------------------------------------------------------- */

/* A stat's value, summed over its labels (e.g. every tier's), or -1 when absent. */
static double stat_sum(const struct kvtier_stats *st, const char *name)
{
    double v = -1;

    for (size_t i = 0; i < st->n; i++) {
        if (strcmp(st->s[i].name, name) == 0)
            v = (v < 0 ? 0 : v) +
                (st->s[i].kind == KVTIER_HISTOGRAM ? (double)st->s[i].count : st->s[i].value);
    }
    return v;
}

static int cmd_status(struct cli *cl)
{
    struct kvtier_client *c;
    const struct kvtier_region *r;
    struct kvtier_stats *st = NULL;
    struct kvtier_peers *peers = NULL;
    char sz[32], row[32], page[32], a[32], b[32];
    const char *fp;
    int rc;

    rc = connect_node(cl, &c);
    if (rc != 0)
        return rc;
    r = kvtier_client_region(c);
    fp = kvtier_client_node_fingerprint(c);
    fmt_bytes((double)r->size, sz, sizeof(sz));
    fmt_bytes((double)r->row_bytes, row, sizeof(row));
    fmt_bytes((double)r->page_bytes, page, sizeof(page));
    printf("node       %s: reachable (client id %" PRIu64 ", protocol 1.%u)\n", cl->socket,
           kvtier_client_id(c), kvtier_client_node_minor(c));
    printf("health     ok (serving engines)\n");
    printf("region     %zu chunks x %s = %s (%u workers x %s pages)\n", r->num_chunks, row, sz,
           r->num_workers, page);
    printf("limits     %zu keys per call\n", kvtier_client_max_keys(c));
    printf("model      %s\n", fp[0] ? fp : "(no fingerprint: none configured, none declared yet)");
    rc = kvtier_get_stats_totals(c, &st);
    if (rc == 0) {
        double chunks = stat_sum(st, "kvtier_primary_chunks");
        double files = stat_sum(st, "kvtier_storage_files");
        double withheld = stat_sum(st, "kvtier_storage_withheld");

        if (chunks >= 0)
            printf("primary    %.0f of %zu chunks in use\n", chunks, r->num_chunks);
        if (files >= 0) {
            fmt_bytes(stat_sum(st, "kvtier_storage_used_bytes"), a, sizeof(a));
            printf("storage    %.0f chunk files, %s%s\n", files, a,
                   withheld > 0 ? " (withheld until the node's model fingerprint is known)" : "");
        } else {
            printf("storage    off\n");
        }
        if (stat_sum(st, "kvtier_engine_clients") >= 0)
            printf("engines    %.0f attached (this one included), %.0f resets\n",
                   stat_sum(st, "kvtier_engine_clients"),
                   fmax(stat_sum(st, "kvtier_engine_resets"), 0));
        kvtier_stats_free(st);
    } else if (rc != -EOPNOTSUPP) {
        kvtier_close(c);
        return fail("get_stats: %s", kvt_tool_strerror(rc));
    }
    rc = kvtier_get_peers(c, &peers);
    if (rc == 0) {
        size_t up = 0;
        uint64_t pulled = 0, served = 0;

        for (size_t i = 0; i < peers->n; i++) {
            up += peers->p[i].state != KVTIER_PEER_DOWN;
            pulled += peers->p[i].pulled_bytes;
            served += peers->p[i].served_bytes;
        }
        fmt_bytes((double)pulled, a, sizeof(a));
        fmt_bytes((double)served, b, sizeof(b));
        printf("cluster    %zu of %zu members up (this node included); %s pulled, %s served\n", up,
               peers->n, a, b);
        kvtier_peers_free(peers);
    } else if (rc == -EOPNOTSUPP) {
        printf("cluster    none (the network tier is off)\n");
    } else {
        kvtier_close(c);
        return fail("peers: %s", kvt_tool_strerror(rc));
    }
    kvtier_close(c);
    return 0;
}

/* ---- stats --------------------------------------------------------------------- */

static const char *kind_name(int kind)
{
    return kind == KVTIER_COUNTER ? "counter" : kind == KVTIER_GAUGE ? "gauge" : "histogram";
}

static void print_stats(const struct kvtier_stats *st, bool json)
{
    if (json) {
        json_t *arr = json_array();

        for (size_t i = 0; i < st->n; i++) {
            const struct kvtier_stat *s = &st->s[i];
            json_t *o = json_pack("{s:s, s:s, s:s}", "name", s->name, "label", s->label, "kind",
                                  kind_name(s->kind));

            if (s->kind == KVTIER_HISTOGRAM) {
                json_object_set_new(o, "count", json_integer((json_int_t)s->count));
                json_object_set_new(o, "sum", json_real(s->sum));
            } else {
                json_object_set_new(o, "value", json_real(s->value));
            }
            json_array_append_new(arr, o);
        }
        json_dumpf(arr, stdout, JSON_INDENT(1));
        putchar('\n');
        json_decref(arr);
        return;
    }
    printf("%-62s %-12s %-9s %s\n", "NAME", "TIER", "KIND", "VALUE");
    for (size_t i = 0; i < st->n; i++) {
        const struct kvtier_stat *s = &st->s[i];

        char v[48], sum[48], mean[48];

        printf("%-62s %-12s %-9s ", s->name, s->label[0] ? s->label : "-", kind_name(s->kind));
        if (s->kind == KVTIER_HISTOGRAM) {
            fmt_value(s->name, s->sum, "", sum, sizeof(sum));
            fmt_value(s->name, s->count ? s->sum / (double)s->count : 0.0, "", mean, sizeof(mean));
            printf("count %" PRIu64 " sum %s mean %s\n", s->count, sum, mean);
        } else {
            fmt_value(s->name, s->value, "", v, sizeof(v));
            printf("%s\n", v);
        }
    }
    if (st->n == 0)
        printf("(no stats since the last get_stats)\n");
}

static int cmd_stats(struct cli *cl)
{
    struct kvtier_client *c;
    struct kvtier_stats *st;
    int rc = connect_node(cl, &c);

    if (rc != 0)
        return rc;
    rc = kvtier_get_stats_totals(c, &st); /* since the node started, as /metrics */
    kvtier_close(c);
    if (rc < 0)
        return fail("get_stats: %s", kvt_tool_strerror(rc));
    print_stats(st, cl->json);
    kvtier_stats_free(st);
    return 0;
}

/* ---- peers --------------------------------------------------------------------- */

static const char *peer_state(int state)
{
    return state == KVTIER_PEER_SELF ? "self" : state == KVTIER_PEER_ALIVE ? "up" : "down";
}

static bool is_peer_stat(const char *name)
{
    return strncmp(name, "kvtier_peers_", 13) == 0 || strncmp(name, "kvtier_net_", 11) == 0;
}

static int cmd_peers(struct cli *cl)
{
    struct kvtier_client *c;
    struct kvtier_peers *p = NULL;
    struct kvtier_stats *st = NULL;
    int rc = connect_node(cl, &c);

    if (rc != 0)
        return rc;
    rc = kvtier_get_peers(c, &p);
    if (rc == -EOPNOTSUPP) {
        kvtier_close(c);
        printf("(no cluster: the node's network tier is off)\n");
        return 0;
    }
    if (rc < 0) {
        kvtier_close(c);
        return fail("peers: %s", kvt_tool_strerror(rc));
    }
    rc = kvtier_get_stats_totals(c, &st);
    kvtier_close(c);
    printf("%-16s %-16s %-28s %-5s %10s %12s %12s\n", "NODE", "INCARNATION", "ADDRESS", "STATE",
           "HEARD", "PULLED", "SERVED");
    for (size_t i = 0; i < p->n; i++) {
        const struct kvtier_peer *x = &p->p[i];
        char addr[KVTIER_ADDR_MAX + 8], heard[32], pulled[32], served[32];

        snprintf(addr, sizeof(addr), "%s:%u", x->addr, (unsigned)x->port);
        if (x->state == KVTIER_PEER_SELF)
            snprintf(heard, sizeof(heard), "-");
        else
            snprintf(heard, sizeof(heard), "%.1fs ago", (double)x->last_heard_ms / 1000.0);
        fmt_bytes((double)x->pulled_bytes, pulled, sizeof(pulled));
        fmt_bytes((double)x->served_bytes, served, sizeof(served));
        printf("%016" PRIx64 " %016" PRIx64 " %-28s %-5s %10s %12s %12s\n", x->node_id,
               x->incarnation, addr, peer_state(x->state), heard, pulled, served);
    }
    if (p->n <= 1)
        printf("(no peer seen yet)\n");
    kvtier_peers_free(p);
    if (rc == 0) {
        printf("\n%-48s %-12s %s\n", "COUNTER / GAUGE", "LABEL", "VALUE");
        for (size_t i = 0; i < st->n; i++) {
            char v[48];

            if (!is_peer_stat(st->s[i].name) || st->s[i].kind == KVTIER_HISTOGRAM)
                continue;
            fmt_value(st->s[i].name, st->s[i].value, "", v, sizeof(v));
            printf("%-48s %-12s %s\n", st->s[i].name, st->s[i].label[0] ? st->s[i].label : "-", v);
        }
        kvtier_stats_free(st);
    }
    return 0;
}

/* ---- reset -------------------------------------------------------------------------- */

static int cmd_reset(struct cli *cl)
{
    struct kvtier_client *c;
    int rc = connect_node(cl, &c);

    if (rc != 0)
        return rc;
    rc = kvtier_reset(c);
    kvtier_close(c);
    if (rc == -EBUSY)
        return fail("reset refused: an engine holds chunks (pins, stores being written or "
                    "loads waiting); retry when it is idle");
    if (rc < 0)
        return fail("reset: %s", kvt_tool_strerror(rc));
    printf("node reset: its primary, its storage tier's files and its records in the "
           "cluster's directory are dropped\n");
    return 0;
}

/* ---- lookup / put / get ------------------------------------------------------------ */

static int parse_keys(struct cli *cl, struct kvtier_key **keys_p)
{
    struct kvtier_key *keys;

    if (cl->n_args == 0)
        return bad_usage("%s: missing KEYHEX", cl->cmd);
    keys = calloc((size_t)cl->n_args, sizeof(*keys));
    if (keys == NULL)
        return fail("out of memory");
    for (int i = 0; i < cl->n_args; i++)
        if (kvt_tool_parse_key(cl->args[i], &keys[i]) < 0) {
            free(keys);
            return bad_usage("%s: bad key '%s' (1 to %d bytes as hex)", cl->cmd, cl->args[i],
                             KVTIER_KEY_MAX);
        }
    *keys_p = keys;
    return 0;
}

static void req_name(char *out, size_t n)
{
    static unsigned seq;

    snprintf(out, n, "kvtier-cli-%ld-%u", (long)getpid(), seq++);
}

/* Looks keys up step by step until none is RETRY / HIT_PENDING (or once). */
static int lookup_resolved(struct kvtier_client *c, const char *req, const struct kvtier_key *keys,
                           size_t n, bool once, uint8_t *res, unsigned *steps_p)
{
    unsigned steps = 0;
    int rc;

    for (;;) {
        bool pending = false;

        rc = kvtier_lookup(c, req, keys, n, 0, res, NULL);
        if (rc < 0)
            return rc;
        for (size_t i = 0; i < n; i++)
            pending |= res[i] == KVTIER_RETRY || res[i] == KVTIER_HIT_PENDING;
        if (!pending || once || steps >= LOOKUP_STEPS)
            break;
        rc = kvtier_on_schedule_end(c, steps == 0 ? &req : NULL, steps == 0, NULL, 0);
        if (rc < 0)
            return rc;
        steps++;
        usleep(5000);
    }
    *steps_p = steps;
    return 0;
}

static int cmd_lookup(struct cli *cl)
{
    struct kvtier_client *c;
    struct kvtier_key *keys = NULL;
    uint8_t *res;
    char req[64], hex[2 * KVTIER_KEY_MAX + 1];
    unsigned steps = 0;
    size_t n;
    int rc;

    rc = parse_keys(cl, &keys);
    if (rc != 0)
        return rc;
    n = (size_t)cl->n_args;
    res = calloc(n, 1);
    if (res == NULL) {
        free(keys);
        return fail("out of memory");
    }
    rc = connect_node(cl, &c);
    if (rc != 0)
        goto out;
    req_name(req, sizeof(req));
    rc = kvtier_on_new_request(c, req, NULL, NULL);
    if (rc == 0) {
        rc = lookup_resolved(c, req, keys, n, cl->once, res, &steps);
        kvtier_on_request_finished(c, req);
    }
    if (rc < 0) {
        rc = fail("lookup: %s", kvt_tool_strerror(rc));
    } else {
        for (size_t i = 0; i < n; i++) {
            kvt_tool_key_hex(&keys[i], hex);
            printf("%s %s\n", hex, kvtier_lookup_result_name(res[i]));
        }
        if (steps > 0)
            fprintf(stderr, "(resolved after %u steps)\n", steps);
        rc = 0;
    }
    kvtier_close(c);
out:
    free(res);
    free(keys);
    return rc;
}

static int read_file(const char *path, uint8_t *buf, size_t cap, size_t *len_p)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    struct stat sb;
    size_t len = 0;

    if (fd < 0)
        return fail("%s: %s", path, strerror(errno));
    if (fstat(fd, &sb) == 0 && S_ISREG(sb.st_mode) && (uint64_t)sb.st_size > cap) {
        close(fd);
        return fail("%s: %lld bytes do not fit one chunk (%zu bytes)", path, (long long)sb.st_size,
                    cap);
    }
    for (;;) {
        ssize_t r = read(fd, buf + len, cap - len);
        char extra;

        if (r < 0) {
            if (errno == EINTR)
                continue;
            close(fd);
            return fail("%s: %s", path, strerror(errno));
        }
        if (r == 0)
            break;
        len += (size_t)r;
        if (len == cap) {
            r = read(fd, &extra, 1);
            if (r > 0) {
                close(fd);
                return fail("%s: more than one chunk (%zu bytes)", path, cap);
            }
            break;
        }
    }
    close(fd);
    *len_p = len;
    return 0;
}

static int cmd_put(struct cli *cl)
{
    struct kvtier_client *c;
    struct kvtier_key key;
    struct kvtier_store_plan plan = {0};
    uint32_t idx;
    int64_t chunk;
    uint8_t *data = NULL;
    size_t row, len = 0;
    char req[64];
    int rc;

    if (cl->n_args != 1)
        return bad_usage("put: expects exactly one KEYHEX");
    if ((cl->file != NULL) == cl->has_pattern)
        return bad_usage("put: give exactly one of --file F and --pattern SEED");
    if (kvt_tool_parse_key(cl->args[0], &key) < 0)
        return bad_usage("put: bad key '%s' (1 to %d bytes as hex)", cl->args[0], KVTIER_KEY_MAX);
    rc = connect_node(cl, &c);
    if (rc != 0)
        return rc;
    row = kvtier_client_region(c)->row_bytes;
    data = calloc(1, row);
    if (data == NULL) {
        rc = fail("out of memory");
        goto out;
    }
    if (cl->file != NULL) {
        rc = read_file(cl->file, data, row, &len);
        if (rc != 0)
            goto out;
    } else {
        kvt_tool_content_fill(cl->pattern, data, row);
        len = row;
    }
    req_name(req, sizeof(req));
    rc = kvtier_on_new_request(c, req, NULL, NULL);
    if (rc < 0) {
        rc = fail("on_new_request: %s", kvt_tool_strerror(rc));
        goto out;
    }
    plan.store_index = &idx;
    plan.chunk_ids = &chunk;
    rc = kvtier_prepare_store(c, req, &key, 1, &plan);
    if (rc < 0) {
        rc = fail("prepare_store: %s", kvt_tool_strerror(rc));
        goto finish;
    }
    if (plan.n_store == 0) {
        printf("%s already stored (not overwritten)\n", cl->args[0]);
        rc = 0;
        goto finish;
    }
    memcpy(kvtier_client_row(c, chunk), data, row);
    rc = kvtier_complete_store(c, req, &key, 1, true);
    if (rc < 0) {
        rc = fail("complete_store: %s", kvt_tool_strerror(rc));
        goto finish;
    }
    printf("%s stored in chunk %" PRId64 " (%zu bytes%s, %zu evicted)\n", cl->args[0], chunk, len,
           len < row ? ", zero-padded to the row" : "", plan.n_evicted);
    rc = 0;
finish:
    kvtier_on_request_finished(c, req);
    kvtier_on_schedule_end(c, NULL, 0, NULL, 0);
out:
    free(data);
    kvtier_close(c);
    return rc;
}

static int write_file(const char *path, const uint8_t *buf, size_t len)
{
    FILE *f = strcmp(path, "-") == 0 ? stdout : fopen(path, "wb");

    if (f == NULL)
        return fail("%s: %s", path, strerror(errno));
    if (fwrite(buf, 1, len, f) != len || (f != stdout ? fclose(f) : fflush(f)) != 0)
        return fail("%s: write failed: %s", path, strerror(errno));
    return 0;
}

static int cmd_get(struct cli *cl)
{
    struct kvtier_client *c;
    struct kvtier_key key;
    uint8_t res = KVTIER_MISS, *copy = NULL;
    int64_t chunk;
    size_t row;
    unsigned steps = 0;
    char req[64];
    int rc;

    if (cl->n_args != 1)
        return bad_usage("get: expects exactly one KEYHEX");
    if (kvt_tool_parse_key(cl->args[0], &key) < 0)
        return bad_usage("get: bad key '%s' (1 to %d bytes as hex)", cl->args[0], KVTIER_KEY_MAX);
    rc = connect_node(cl, &c);
    if (rc != 0)
        return rc;
    row = kvtier_client_region(c)->row_bytes;
    copy = malloc(row);
    if (copy == NULL) {
        rc = fail("out of memory");
        goto out;
    }
    req_name(req, sizeof(req));
    rc = kvtier_on_new_request(c, req, NULL, NULL);
    if (rc < 0) {
        rc = fail("on_new_request: %s", kvt_tool_strerror(rc));
        goto out;
    }
    rc = lookup_resolved(c, req, &key, 1, false, &res, &steps);
    if (rc < 0) {
        rc = fail("lookup: %s", kvt_tool_strerror(rc));
        goto finish;
    }
    if (res != KVTIER_HIT) {
        rc = fail("%s: %s", cl->args[0],
                  res == KVTIER_MISS ? "not found" : "still pending after many steps");
        goto finish;
    }
    rc = kvtier_prepare_load(c, req, &key, 1, &chunk);
    if (rc < 0) {
        rc = fail("prepare_load: %s", kvt_tool_strerror(rc));
        goto finish;
    }
    memcpy(copy, kvtier_client_row(c, chunk), row);
    rc = kvtier_complete_load(c, req, &key, 1);
    if (rc < 0) {
        rc = fail("complete_load: %s", kvt_tool_strerror(rc));
        goto finish;
    }
    if (cl->has_pattern) {
        size_t off = kvt_tool_content_check(cl->pattern, copy, row);

        if (off != row) {
            rc = fail("%s: content differs from pattern %" PRIu64 " at byte %zu", cl->args[0],
                      cl->pattern, off);
            goto finish;
        }
        fprintf(cl->out && !strcmp(cl->out, "-") ? stderr : stdout,
                "%s matches pattern %" PRIu64 " (%zu bytes)\n", cl->args[0], cl->pattern, row);
    }
    if (cl->out != NULL) {
        rc = write_file(cl->out, copy, row);
        if (rc != 0)
            goto finish;
    } else if (!cl->has_pattern) {
        printf("%s chunk %" PRId64 ", %zu bytes, xxh3 %016" PRIx64 ", first bytes", cl->args[0],
               chunk, row, kvt_tool_hash(copy, row));
        for (size_t i = 0; i < 16 && i < row; i++)
            printf(" %02x", copy[i]);
        printf("\n");
    }
    rc = 0;
finish:
    kvtier_on_request_finished(c, req);
    kvtier_on_schedule_end(c, NULL, 0, NULL, 0);
out:
    free(copy);
    kvtier_close(c);
    return rc;
}

/* ---- top --------------------------------------------------------------------------- */

static volatile sig_atomic_t stop_flag;

static void on_sigint(int sig)
{
    (void)sig;
    stop_flag = 1;
}

struct tier_row {
    char label[KVTIER_STAT_LABEL_MAX];
    double queries, hits, read_b, write_b;
};

static struct tier_row *tier_row(struct tier_row *rows, size_t *n, size_t cap, const char *label)
{
    for (size_t i = 0; i < *n; i++)
        if (strcmp(rows[i].label, label) == 0)
            return &rows[i];
    if (*n == cap)
        return NULL;
    memset(&rows[*n], 0, sizeof(rows[*n]));
    snprintf(rows[*n].label, sizeof(rows[*n].label), "%s", label);
    return &rows[(*n)++];
}

static void top_frame(const struct cli *cl, const struct kvtier_stats *st, double dt, bool tty,
                      uint64_t frame)
{
    struct tier_row rows[16];
    size_t n = 0;
    char rb[32], wb[32];

    for (size_t i = 0; i < st->n; i++) {
        const struct kvtier_stat *s = &st->s[i];
        struct tier_row *r;

        if (s->label[0] == '\0' || s->kind != KVTIER_COUNTER)
            continue;
        r = tier_row(rows, &n, 16, s->label);
        if (r == NULL)
            continue;
        if (strstr(s->name, "chunk_queries"))
            r->queries += s->value;
        else if (strstr(s->name, "chunk_hits"))
            r->hits += s->value;
        else if (strstr(s->name, "read_bytes"))
            r->read_b += s->value;
        else if (strstr(s->name, "write_bytes"))
            r->write_b += s->value;
    }
    if (tty)
        printf("\033[H\033[2J");
    printf("kvtier top  %s  every %.1fs  frame %" PRIu64 "%s\n\n", cl->socket, dt, frame,
           tty ? "  (q quits)" : "");
    printf("%-14s %12s %12s %7s %14s %14s\n", "TIER", "queries/s", "hits/s", "hit%", "read/s",
           "write/s");
    for (size_t i = 0; i < n; i++) {
        fmt_bytes(rows[i].read_b / dt, rb, sizeof(rb));
        fmt_bytes(rows[i].write_b / dt, wb, sizeof(wb));
        printf("%-14s %12.1f %12.1f %6.1f%% %14s %14s\n", rows[i].label, rows[i].queries / dt,
               rows[i].hits / dt, rows[i].queries > 0 ? 100 * rows[i].hits / rows[i].queries : 0,
               rb, wb);
    }
    if (n == 0)
        printf("(idle: no lookups or transfers in this interval)\n");
    printf("\n%-62s %-12s %s\n", "GAUGE / COUNTER", "TIER", "VALUE (counters per second)");
    for (size_t i = 0; i < st->n; i++) {
        const struct kvtier_stat *s = &st->s[i];

        char v[48];

        if (s->kind == KVTIER_HISTOGRAM)
            continue;
        if (s->kind == KVTIER_COUNTER)
            fmt_value(s->name, s->value / dt, "/s", v, sizeof(v));
        else
            fmt_value(s->name, s->value, "", v, sizeof(v));
        printf("%-62s %-12s %s\n", s->name, s->label[0] ? s->label : "-", v);
    }
    fflush(stdout);
}

static int cmd_top(struct cli *cl)
{
    struct kvtier_client *c;
    struct kvtier_stats *st;
    struct termios old, raw;
    bool tty = isatty(STDOUT_FILENO), raw_on = false;
    struct sigaction sa = {.sa_handler = on_sigint};
    double last;
    uint64_t frame = 0;
    int rc = connect_node(cl, &c);

    if (rc != 0)
        return rc;
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    if (isatty(STDIN_FILENO) && tcgetattr(STDIN_FILENO, &old) == 0) {
        raw = old;
        raw.c_lflag &= ~(tcflag_t)(ICANON | ECHO);
        raw.c_cc[VMIN] = 0;
        raw.c_cc[VTIME] = 0;
        raw_on = tcsetattr(STDIN_FILENO, TCSANOW, &raw) == 0;
    }
    /* The first get_stats drains whatever accumulated before: deltas start now. */
    rc = kvtier_get_stats(c, &st);
    if (rc == 0)
        kvtier_stats_free(st);
    last = kvt_tool_now_s();
    while (rc == 0 && !stop_flag && (cl->iterations == 0 || frame < cl->iterations)) {
        struct pollfd pfd = {.fd = STDIN_FILENO, .events = POLLIN};
        double wait = cl->interval_s - (kvt_tool_now_s() - last), now;

        if (wait > 0 && poll(raw_on ? &pfd : NULL, raw_on ? 1 : 0, (int)(wait * 1000)) > 0) {
            char ch;

            if (read(STDIN_FILENO, &ch, 1) == 1 && (ch == 'q' || ch == 'Q'))
                break;
            continue;
        }
        if (stop_flag)
            break;
        rc = kvtier_get_stats(c, &st);
        if (rc < 0)
            break;
        now = kvt_tool_now_s();
        top_frame(cl, st, now - last > 1e-3 ? now - last : 1e-3, tty, ++frame);
        kvtier_stats_free(st);
        last = now;
    }
    if (raw_on)
        tcsetattr(STDIN_FILENO, TCSANOW, &old);
    kvtier_close(c);
    if (rc < 0)
        return fail("get_stats: %s", kvt_tool_strerror(rc));
    return 0;
}

/* ---- bench --------------------------------------------------------------------------- */

static int cmd_bench(struct cli *cl, int argc, char **argv)
{
    char self[PATH_MAX], path[PATH_MAX + 32];
    ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
    char **av = calloc((size_t)argc + 2, sizeof(*av));

    if (av == NULL)
        return fail("out of memory");
    av[0] = "kvtier-bench";
    for (int i = 0; i < argc; i++)
        av[i + 1] = argv[i];
    if (n > 0) {
        char *slash;

        self[n] = '\0';
        slash = strrchr(self, '/');
        if (slash != NULL) {
            *slash = '\0';
            /* next to kvtier (installed), then the build tree's tools/bench/ */
            snprintf(path, sizeof(path), "%s/kvtier-bench", self);
            if (access(path, X_OK) == 0)
                execv(path, av);
            snprintf(path, sizeof(path), "%s/../bench/kvtier-bench", self);
            if (access(path, X_OK) == 0)
                execv(path, av);
        }
    }
    execvp("kvtier-bench", av);
    free(av);
    (void)cl;
    return fail("cannot run kvtier-bench: %s", strerror(errno));
}

/* ---- main ------------------------------------------------------------------------------ */

enum { O_SOCKET = 256, O_TIMEOUT, O_FILE, O_PATTERN, O_OUT, O_ONCE, O_JSON, O_ITER, O_INTERVAL };

static const struct option long_opts[] = {
    {"socket", required_argument, NULL, O_SOCKET},
    {"timeout", required_argument, NULL, O_TIMEOUT},
    {"file", required_argument, NULL, O_FILE},
    {"pattern", required_argument, NULL, O_PATTERN},
    {"out", required_argument, NULL, O_OUT},
    {"once", no_argument, NULL, O_ONCE},
    {"json", no_argument, NULL, O_JSON},
    {"iterations", required_argument, NULL, O_ITER},
    {"interval", required_argument, NULL, O_INTERVAL},
    {"help", no_argument, NULL, 'h'},
    {NULL, 0, NULL, 0},
};

static const char *opt_name(int opt)
{
    for (const struct option *o = long_opts; o->name != NULL; o++)
        if (o->val == opt)
            return o->name;
    return "?";
}

/* Which options each command takes (the common ones are always allowed). */
static bool option_allowed(const char *cmd, int opt)
{
    switch (opt) {
    case O_SOCKET:
    case O_TIMEOUT:
        return true;
    case O_FILE:
        return !strcmp(cmd, "put");
    case O_PATTERN:
        return !strcmp(cmd, "put") || !strcmp(cmd, "get");
    case O_OUT:
        return !strcmp(cmd, "get");
    case O_ONCE:
        return !strcmp(cmd, "lookup");
    case O_JSON:
        return !strcmp(cmd, "stats");
    case O_ITER:
    case O_INTERVAL:
        return !strcmp(cmd, "top");
    default:
        return false;
    }
}

static int cli_main(int argc, char **argv)
{
    static const char *const cmds[] = {"status", "stats", "peers", "reset", "lookup",
                                       "put",    "get",   "top",   "bench"};
    struct cli cl = {.timeout_ms = 10000, .interval_s = 1.0};
    bool known = false;
    int opt;

    if (argc < 2)
        return bad_usage("missing command");
    if (!strcmp(argv[1], "-h") || !strcmp(argv[1], "--help") || !strcmp(argv[1], "help")) {
        usage(stdout);
        return 0;
    }
    if (!strcmp(argv[1], "-V") || !strcmp(argv[1], "--version") || !strcmp(argv[1], "version")) {
        printf("kvtier %s\n", kvt_version_string());
        return 0;
    }
    cl.cmd = argv[1];
    for (size_t i = 0; i < sizeof(cmds) / sizeof(cmds[0]); i++)
        known |= strcmp(cl.cmd, cmds[i]) == 0;
    if (!known)
        return bad_usage("unknown command '%s'", cl.cmd);
    if (!strcmp(cl.cmd, "bench"))
        return cmd_bench(&cl, argc - 2, argv + 2);

    opterr = 0;
    optind = 2;
    while ((opt = getopt_long(argc, argv, ":h", long_opts, NULL)) != -1) {
        uint64_t v;

        if (opt == 'h') {
            usage(stdout);
            return 0;
        }
        if (opt == '?')
            return bad_usage("%s: unknown option '%s'", cl.cmd, argv[optind - 1]);
        if (opt == ':')
            return bad_usage("%s: option '%s' needs a value", cl.cmd, argv[optind - 1]);
        if (!option_allowed(cl.cmd, opt))
            return bad_usage("%s: option '--%s' does not apply to this command", cl.cmd,
                             opt_name(opt));
        switch (opt) {
        case O_SOCKET:
            if (*optarg == '\0' || strlen(optarg) > 107)
                return bad_usage("--socket: a unix socket path of 1 to 107 bytes");
            cl.socket = optarg;
            break;
        case O_TIMEOUT:
            if (kvt_tool_parse_u64(optarg, 1, 3600000, &v) < 0)
                return bad_usage("--timeout: '%s' is not 1..3600000 ms", optarg);
            cl.timeout_ms = (int)v;
            break;
        case O_FILE:
            cl.file = optarg;
            break;
        case O_PATTERN:
            if (kvt_tool_parse_u64(optarg, 0, UINT64_MAX, &cl.pattern) < 0)
                return bad_usage("--pattern: '%s' is not an unsigned integer", optarg);
            cl.has_pattern = true;
            break;
        case O_OUT:
            cl.out = optarg;
            break;
        case O_ONCE:
            cl.once = true;
            break;
        case O_JSON:
            cl.json = true;
            break;
        case O_ITER:
            if (kvt_tool_parse_u64(optarg, 1, UINT32_MAX, &cl.iterations) < 0)
                return bad_usage("--iterations: '%s' is not a positive integer", optarg);
            break;
        case O_INTERVAL:
            if (kvt_tool_parse_double(optarg, 0.05, 3600, &cl.interval_s) < 0)
                return bad_usage("--interval: '%s' is not 0.05..3600 seconds", optarg);
            break;
        }
    }
    cl.args = argv + optind;
    cl.n_args = argc - optind;
    if (strcmp(cl.cmd, "lookup") && strcmp(cl.cmd, "put") && strcmp(cl.cmd, "get") && cl.n_args > 0)
        return bad_usage("%s: unexpected argument '%s'", cl.cmd, cl.args[0]);

    if (!strcmp(cl.cmd, "status"))
        return cmd_status(&cl);
    if (!strcmp(cl.cmd, "stats"))
        return cmd_stats(&cl);
    if (!strcmp(cl.cmd, "peers"))
        return cmd_peers(&cl);
    if (!strcmp(cl.cmd, "reset"))
        return cmd_reset(&cl);
    if (!strcmp(cl.cmd, "lookup"))
        return cmd_lookup(&cl);
    if (!strcmp(cl.cmd, "put"))
        return cmd_put(&cl);
    if (!strcmp(cl.cmd, "get"))
        return cmd_get(&cl);
    return cmd_top(&cl);
}

/* What a command printed must have reached its standard output: a full disk or a
 * closed pipe's EIO turns a success into exit 1 (a script must not take a cut-off
 * `stats --json` for the node's figures). */
int main(int argc, char **argv)
{
    int rc = cli_main(argc, argv);
    bool failed;

    errno = 0; /* what fflush sets, else an error of an earlier write */
    failed = fflush(stdout) != 0 || ferror(stdout);
    if (failed) {
        int err = errno;

        fprintf(stderr, "kvtier: standard output: write failed: %s\n",
                err != 0 ? strerror(err) : "I/O error");
        if (rc == 0)
            rc = 1;
    }
    return rc;
}

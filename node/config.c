/* SPDX-License-Identifier: Apache-2.0 */
/* kvtierd's configuration (see kvt/config.h for the keys' rules).
 *
 * One table, `keys[]`, names every key with its type, the field it fills, its default
 * (written as the file would spell it and parsed by the same code as any value, so a
 * default can never disagree with the parser), its range, whether SIGHUP may change it
 * and its --help line. Everything else is driven by the table:
 *
 *   defaults -> file (libyaml document tree; each node keeps its line) -> --set args
 *   -> derived values (node.id, "{id}" in paths) -> cross-key checks -> *cfg
 *
 * Every key remembers where its value came from (default, file line, --set argument) so
 * that a cross-key error names the line or option of the value at fault. The loader
 * works on a private copy and writes the caller's struct only on success: a bad reload
 * leaves the running configuration untouched.
 *
 * Dump writes every key in table order, grouped by section, in a form the loader reads
 * back; the reload diff compares keys by that printed form, which makes "equal" mean
 * exactly "prints the same". */
#include <assert.h>
#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <fcntl.h>
#include <grp.h>
#include <arpa/inet.h>
#include <poll.h>
#include <sys/stat.h>
#include <unistd.h>

#include <yaml.h>

#include "kvt/alloc.h"
#include "kvt/auth.h"
#include "kvt/clock.h"
#include "kvt/common.h"
#include "kvt/config.h"
#include "kvt/hash.h"

enum key_type {
    T_U64,   /* uint64_t, decimal or 0x hex */
    T_U32,   /* uint32_t */
    T_PORT,  /* uint16_t */
    T_MODE,  /* uint32_t permission bits, octal ("0660") */
    T_SIZE,  /* uint64_t bytes with unit suffixes */
    T_BOOL,  /* bool */
    T_STR,   /* char *, plain */
    T_PATH,  /* char *, "{id}" expanded */
    T_ENUM,  /* an enum stored as int; names[] index = value */
    T_PEERS, /* char **, count at off2 */
    T_TIERS, /* enum kvt_tier_kind[], count at off2 */
};

#define K_RELOAD   0x1u /* may change at run time (SIGHUP) */
#define K_OPTIONAL 0x2u /* a string that may be unset (empty value) */
#define K_ADDR     0x4u /* a string that is a host name or numeric address */

struct key_def {
    const char *name;
    enum key_type type;
    size_t off, off2;
    const char *def; /* default in file syntax; NULL: derived (node.id) or unset */
    uint64_t min, max;
    const char *const *names; /* T_ENUM / T_TIERS value names, NULL-terminated */
    unsigned flags;
    const char *help;
};

_Static_assert(sizeof(enum kvt_policy_kind) == sizeof(int), "enums are stored as int");
_Static_assert(sizeof(enum kvt_log_level) == sizeof(int), "enums are stored as int");
_Static_assert(sizeof(enum kvt_verify_kind) == sizeof(int), "enums are stored as int");
_Static_assert(sizeof(enum kvt_fetch_kind) == sizeof(int), "enums are stored as int");

static const char *const policy_names[] = {"lru", "arc", NULL};
static const char *const transport_names[] = {"ucx", "verbs", NULL};
static const char *const verify_names[] = {"fence", "checksum", NULL};
static const char *const fetch_names[] = {"lease", "direct", NULL};
static const char *const level_names[] = {"error", "warn", "info", "debug", NULL};
static const char *const tier_names[] = {"storage", "network", NULL};

#define F(field)               offsetof(struct kvt_config, field)
#define KIB                    1024ull
#define MIB                    (1024ull * KIB)
#define GIB                    (1024ull * MIB)
#define TIB                    (1024ull * GIB)
#define PEERS_MAX              256u
#define CONFIG_READ_TIMEOUT_MS 5000 /* to read the file whole (a FIFO, a pipe) */

static const struct key_def keys[] = {
    {"node.id", T_U64, F(node_id), 0, NULL, 1, UINT64_MAX, NULL, 0,
     "node identity; default: a hash of the host name and network.port"},
    {"node.namespace", T_STR, F(node_namespace), 0, "default", 1, 63, NULL, 0,
     "cache namespace; only nodes (and engines) of one namespace share chunks"},
    {"node.model_fingerprint", T_STR, F(node_model_fingerprint), 0, "", 1, 255, NULL, K_OPTIONAL,
     "the model (and KV layout) this node's chunks are of, as its engines declare it; an "
     "engine declaring another is refused, the storage tier drops files of another at start; "
     "unset: the first engine that declares one sets it"},
    {"node.group", T_STR, F(node_group), 0, "", 1, 255, NULL, K_OPTIONAL,
     "group (name or number) that may enter the runtime folders of primary.path and "
     "engine.socket, for engines of other users; unset: the folders are 0700"},
    {"primary.path", T_PATH, F(primary_path), 0, "/run/kvtier/{id}/primary.mmap", 1, PATH_MAX - 1,
     NULL, 0,
     "file of the shared primary region (tmpfs or hugetlbfs), in a folder only the daemon "
     "may write"},
    {"primary.size", T_SIZE, F(primary_size), 0, "1GiB", 4096, 64 * TIB, NULL, 0,
     "bytes of the primary region, a multiple of primary.row_bytes"},
    {"primary.row_bytes", T_SIZE, F(primary_row_bytes), 0, "256KiB", 512, 1 * GIB, NULL, 0,
     "bytes of one chunk (one row), a multiple of primary.workers"},
    {"primary.policy", T_ENUM, F(primary_policy), 0, "lru", 0, 0, policy_names, 0,
     "eviction policy of the primary tier"},
    {"primary.workers", T_U32, F(primary_workers), 0, "1", 1, 1024, NULL, 0,
     "engine workers (GPU ranks) that each own a slice of every row"},
    {"storage.enabled", T_BOOL, F(storage_enabled), 0, "true", 0, 0, NULL, 0,
     "run the storage tier (chunks in files on a local disk)"},
    {"storage.root", T_PATH, F(storage_root), 0, "/var/lib/kvtier/{id}", 1, PATH_MAX - 1, NULL, 0,
     "folder of the storage tier, created 0700 if missing; must be the daemon's own"},
    {"storage.capacity", T_SIZE, F(storage_capacity), 0, "10GiB", 0, UINT64_MAX, NULL, 0,
     "bound on the storage tier's bytes; 0 = none"},
    {"storage.read_depth", T_U32, F(storage_read_depth), 0, "16", 1, 256, NULL, 0,
     "chunk reads each of the storage tier's 4 read threads keeps in flight (io_uring); 1 = "
     "one blocking read at a time"},
    {"storage.high_water_us", T_U32, F(storage_high_water_us), 0, "5000", 1, 60000000, NULL, 0,
     "back-pressure high watermark: store latency EMA in us per MiB"},
    {"storage.low_water_us", T_U32, F(storage_low_water_us), 0, "1000", 1, 60000000, NULL, 0,
     "back-pressure low watermark (<= storage.high_water_us)"},
    {"network.enabled", T_BOOL, F(network_enabled), 0, "true", 0, 0, NULL, 0,
     "run the network tier (chunks from peers)"},
    {"network.transport", T_ENUM, F(network_transport), 0, "ucx", 0, 0, transport_names, 0,
     "transport between peers"},
    {"network.listen", T_STR, F(network_listen), 0, "127.0.0.1", 1, 255, NULL, K_ADDR,
     "address the network tier listens on"},
    {"network.advertise", T_STR, F(network_advertise), 0, "", 1, 255, NULL, K_ADDR | K_OPTIONAL,
     "address peers reach this node at (default network.listen; required when that is a "
     "wildcard such as 0.0.0.0 or ::)"},
    {"network.advertise_port", T_PORT, F(network_advertise_port), 0, "0", 0, 65535, NULL, 0,
     "port peers dial to reach this node (0 = network.port; differs behind a port "
     "forward)"},
    {"network.port", T_PORT, F(network_port), 0, "7170", 0, 65535, NULL, 0,
     "port of the network tier; 0 = any free port (then node.id must be set)"},
    {"network.peers", T_PEERS, F(network_peers), F(n_network_peers), "", 0, PEERS_MAX, NULL,
     K_RELOAD, "seed peers, a list of host:port (or [v6addr]:port)"},
    {"network.lease_ms", T_U32, F(network_lease_ms), 0, "10000", 10, 3600000, NULL, 0,
     "how long a peer may pin chunks it was granted, in ms"},
    {"network.fetch_timeout_ms", T_U32, F(network_fetch_timeout_ms), 0, "2000", 1, 3600000, NULL, 0,
     "a fetch from a peer not answered by then fails (the engine recomputes), in ms"},
    {"network.locate_timeout_ms", T_U32, F(network_locate_timeout_ms), 0, "2000", 1, 3600000, NULL,
     0, "a lookup's question to the key's home not answered by then is a miss, in ms"},
    {"network.heartbeat_ms", T_U32, F(network_heartbeat_ms), 0, "500", 10, 600000, NULL, 0,
     "interval of heartbeats to peers, in ms (< network.lease_ms)"},
    {"network.heartbeat_misses", T_U32, F(network_heartbeat_misses), 0, "3", 1, 1000, NULL, 0,
     "heartbeats a peer may miss before it counts as down"},
    {"network.keys_per_fetch", T_U32, F(network_keys_per_fetch), 0, "64", 1, 256, NULL, 0,
     "keys asked of one peer in one FETCH"},
    {"network.fetches_per_peer", T_U32, F(network_fetches_per_peer), 0, "4", 1, 1024, NULL, 0,
     "FETCHes out to one peer at once (the rest wait their turn, their deadline not started)"},
    {"network.reads_per_batch", T_U32, F(network_reads_per_batch), 0, "8", 1, 256, NULL, 0,
     "one-sided READs of pulled chunks posted together (8 rows of 256 KiB fit a 2 MiB L2)"},
    {"network.verify", T_ENUM, F(network_verify), 0, "fence", 0, 0, verify_names, 0,
     "how a pulled chunk is checked: fence (the holder's generation word of the row, READ "
     "after it, must equal the granted one) or checksum (XXH3-64 of every byte)"},
    {"network.busy_poll_us", T_U32, F(network_busy_poll_us), 0, "100", 0, 60000000, NULL, 0,
     "with transfers in flight, how long the loop polls after the last network event "
     "before it sleeps until the next (0 = it polls as long as anything is in flight)"},
    {"network.fetch", T_ENUM, F(network_fetch), 0, "lease", 0, 0, fetch_names, 0,
     "how rows are pulled: lease (FETCH, GRANT with pins, READ, RELEASE) or direct (rows "
     "whose place the home knows READ straight from the holder's primary and fenced, no "
     "round trip to the holder; others by lease)"},
    {"network.max_unauthenticated", T_U32, F(network_max_unauthenticated), 0, "64", 1, 4096, NULL,
     0,
     "peer connections accepted and not yet authenticated, at most (more are refused and "
     "counted); each holds its message buffers, about 8.6 MiB with verbs"},
    {"network.max_records_per_peer", T_U32, F(network_max_records_per_peer), 0, "0", 0, UINT32_MAX,
     NULL, 0,
     "directory records this node keeps as the home of one peer's keys; past it the "
     "peer's new keys are refused and counted (0 = four times this node's own chunks, "
     "primary and storage, at least 1048576; no bound with an unbounded storage tier)"},
    {"network.serve_per_peer", T_U32, F(network_serve_per_peer), 0, "4096", 1, 1048576, NULL, 0,
     "a peer's FETCHes this node serves at once (waiting, or granted and not yet released: "
     "each pins rows); past it they are denied busy and counted"},
    {"cluster.secret_file", T_PATH, F(cluster_secret_file), 0, "", 1, PATH_MAX - 1, NULL,
     K_OPTIONAL, "file with the shared secret peers prove; no group/other access"},
    {"engine.socket", T_PATH, F(engine_socket), 0, "/run/kvtier/{id}/engine.sock", 1, 107, NULL, 0,
     "unix socket the engines attach to, in a folder only the daemon may write"},
    {"engine.socket_mode", T_MODE, F(engine_socket_mode), 0, "0660", 0600, 0777, NULL, 0,
     "permission bits of the engine socket (octal; owner read and write required)"},
    {"engine.socket_group", T_STR, F(engine_socket_group), 0, "", 1, 255, NULL, K_OPTIONAL,
     "group of the engine socket (a name or number); none = the daemon's"},
    {"engine.hello_timeout_ms", T_U32, F(engine_hello_timeout_ms), 0, "5000", 10, 3600000, NULL, 0,
     "an engine connection that has not said HELLO by then is closed, in ms"},
    {"engine.max_requests", T_U32, F(engine_max_requests), 0, "4096", 1, 1048576, NULL, 0,
     "live requests per engine; more are refused"},
    {"engine.max_params_bytes", T_SIZE, F(engine_max_params_bytes), 0, "64KiB", 1, 1 * MIB, NULL, 0,
     "kv_transfer_params of one request; larger are refused"},
    {"engine.max_client_params", T_SIZE, F(engine_max_client_params), 0, "4MiB", 1, 1 * GIB, NULL,
     0, "kv_transfer_params bytes of all the live requests of one engine"},
    {"engine.max_output_bytes", T_SIZE, F(engine_max_output_bytes), 0, "1MiB", 4 * KIB, 1 * GIB,
     NULL, 0, "replies queued for an engine that does not read them; its requests then wait"},
    {"engine.max_event_keys", T_U32, F(engine_max_event_keys), 0, "65536", 1, 16777216, NULL, 0,
     "keys of the events kept for take_events; past it the oldest events are dropped"},
    {"engine.ring_bytes", T_SIZE, F(engine_ring_bytes), 0, "256KiB", 0, 64 * MIB, NULL, 0,
     "shared-memory ring of each engine, each way (0 = none: engines use the socket); "
     "messages over half of it use the socket"},
    {"engine.ring_spin_us", T_U32, F(engine_ring_spin_us), 0, "100", 0, 1000000, NULL, 0,
     "how long the loop keeps polling the engines' rings after a request, in us (0 = never: "
     "each ring request wakes the loop); a spin that loses its core rests for 100 ms"},
    {"metrics.listen", T_STR, F(metrics_listen), 0, "127.0.0.1", 1, 255, NULL, K_ADDR,
     "address of the /metrics and /healthz HTTP server"},
    {"metrics.port", T_PORT, F(metrics_port), 0, "9464", 0, 65535, NULL, 0,
     "port of the HTTP server; 0 = off"},
    {"metrics.max_connections", T_U32, F(metrics_max_connections), 0, "16", 1, 1024, NULL, 0,
     "HTTP connections at once; when full, the oldest still sending its request is closed"},
    {"metrics.read_timeout_ms", T_U32, F(metrics_read_timeout_ms), 0, "5000", 10, 600000, NULL, 0,
     "an HTTP request not received whole by then is closed, in ms"},
    {"metrics.write_timeout_ms", T_U32, F(metrics_write_timeout_ms), 0, "10000", 10, 600000, NULL,
     0, "an HTTP reply not taken whole by then is closed, in ms"},
    {"log.level", T_ENUM, F(log_level), 0, "info", 0, 0, level_names, K_RELOAD, "log level"},
    {"loop.tick_ms", T_U32, F(loop_tick_ms), 0, "1", 1, 10000, NULL, K_RELOAD,
     "step loop timer tick when no engine drives it, in ms"},
    {"tiers", T_TIERS, F(tiers), F(n_tiers), "storage, network", 0, KVT_CONFIG_TIERS_MAX,
     tier_names, 0, "secondary tiers in lookup order; a disabled tier is skipped"},
};
#define N_KEYS KVT_ARRAY_SIZE(keys)
_Static_assert(KVT_ARRAY_SIZE(keys) <= KVT_CONFIG_KEYS_MAX, "KVT_CONFIG_KEYS_MAX too small");

/* Where a key's value came from: 0 default, > 0 a line of the file, < 0 -(1 + index of
 * the --set argument). */
struct loader {
    struct kvt_config cfg;
    const char *path;
    char *const *sets;
    int origin[N_KEYS];
    char *err;
    size_t err_len;
};

#define FIELD(cfg, k, type)  ((type *)((char *)(cfg) + (k)->off))
#define FIELD2(cfg, k, type) ((type *)((char *)(cfg) + (k)->off2))

/* ---- values ---- */

static const struct key_def *find_key(const char *name)
{
    for (size_t i = 0; i < N_KEYS; i++)
        if (strcmp(keys[i].name, name) == 0)
            return &keys[i];
    return NULL;
}

static size_t key_index(const struct key_def *k)
{
    return (size_t)(k - keys);
}

static int parse_u64(const char *s, uint64_t *v_p)
{
    int base = 10;
    char *end;

    if (s[0] == '0' && (s[1] == 'x' || s[1] == 'X')) {
        base = 16;
        s += 2;
    }
    /* Digits only: strtoull would also take a second "0x" ("0x0x10" read as 16). */
    if (s[0] == '\0' || s[strspn(s, base == 16 ? "0123456789abcdefABCDEF" : "0123456789")] != '\0')
        return -EINVAL;
    errno = 0;
    unsigned long long v = strtoull(s, &end, base);
    if (*end != '\0')
        return -EINVAL;
    if (errno == ERANGE)
        return -ERANGE;
    *v_p = v;
    return 0;
}

/* Octal permission bits: "0660", "660" or "0o660". */
static int parse_mode(const char *s, uint64_t *v_p)
{
    uint64_t v = 0;

    if (s[0] == '0' && (s[1] == 'o' || s[1] == 'O'))
        s += 2;
    if (*s == '\0' || strlen(s) > 5)
        return -EINVAL;
    for (; *s; s++) {
        if (*s < '0' || *s > '7')
            return -EINVAL;
        v = v * 8 + (uint64_t)(*s - '0');
    }
    *v_p = v;
    return 0;
}

static const struct {
    const char *suffix;
    uint64_t mult;
} size_units[] = {
    {"", 1},      {"B", 1},     {"KiB", KIB},    {"MiB", MIB},       {"GiB", GIB},
    {"TiB", TIB}, {"Ki", KIB},  {"Mi", MIB},     {"Gi", GIB},        {"Ti", TIB},
    {"kB", 1000}, {"KB", 1000}, {"MB", 1000000}, {"GB", 1000000000}, {"TB", 1000000000000ull},
};

int kvt_config_parse_size(const char *s, uint64_t *bytes_p)
{
    char num[32];
    size_t n = 0;
    uint64_t v, bytes;
    int rc;

    while (s[n] >= '0' && s[n] <= '9')
        n++;
    if (n == 0 || n >= sizeof(num))
        return n == 0 ? -EINVAL : -ERANGE;
    memcpy(num, s, n);
    num[n] = '\0';
    rc = parse_u64(num, &v);
    if (rc < 0)
        return rc;
    s += n;
    if (*s == ' ' && s[1] != '\0') /* "1 GiB", not "1 " */
        s++;
    for (size_t i = 0; i < KVT_ARRAY_SIZE(size_units); i++) {
        if (strcmp(s, size_units[i].suffix) != 0)
            continue;
        if (__builtin_mul_overflow(v, size_units[i].mult, &bytes))
            return -ERANGE;
        *bytes_p = bytes;
        return 0;
    }
    return -EINVAL;
}

static void format_size(FILE *out, uint64_t v)
{
    static const char *const units[] = {"TiB", "GiB", "MiB", "KiB"};
    static const uint64_t mults[] = {TIB, GIB, MIB, KIB};

    for (size_t i = 0; i < KVT_ARRAY_SIZE(units); i++) {
        if (v != 0 && v % mults[i] == 0) {
            fprintf(out, "%" PRIu64 "%s", v / mults[i], units[i]);
            return;
        }
    }
    fprintf(out, "%" PRIu64, v);
}

static int parse_bool(const char *s, bool *v_p)
{
    static const char *const yes[] = {"true", "yes", "on", "1"};
    static const char *const no[] = {"false", "no", "off", "0"};

    for (size_t i = 0; i < KVT_ARRAY_SIZE(yes); i++) {
        if (strcasecmp(s, yes[i]) == 0) {
            *v_p = true;
            return 0;
        }
        if (strcasecmp(s, no[i]) == 0) {
            *v_p = false;
            return 0;
        }
    }
    return -EINVAL;
}

static int parse_enum(const char *const *names, const char *s)
{
    for (int i = 0; names[i] != NULL; i++)
        if (strcmp(names[i], s) == 0)
            return i;
    return -EINVAL;
}

static void join_names(const char *const *names, char *buf, size_t len)
{
    size_t used = 0;

    buf[0] = '\0';
    for (size_t i = 0; names[i] != NULL && used < len; i++)
        used += (size_t)snprintf(buf + used, len - used, "%s%s", i ? "|" : "", names[i]);
}

static bool host_char(char c)
{
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
           c == '-' || c == '_';
}

/* A host name, an IPv4 address or an IPv6 address (hex digits, ':' and '.'). */
static bool valid_host(const char *s, size_t len, bool v6)
{
    if (len == 0 || len > 255)
        return false;
    for (size_t i = 0; i < len; i++) {
        char c = s[i];

        if (v6 ? !((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F') ||
                   c == ':' || c == '.')
               : !host_char(c))
            return false;
    }
    return true;
}

static bool valid_peer(const char *s)
{
    const char *colon, *host = s;
    size_t host_len;
    bool v6 = s[0] == '[';
    uint64_t port;

    if (v6) {
        const char *close = strchr(s, ']');

        if (close == NULL || close[1] != ':')
            return false;
        host = s + 1;
        host_len = (size_t)(close - host);
        colon = close + 1;
    } else {
        colon = strrchr(s, ':');
        if (colon == NULL)
            return false;
        host_len = (size_t)(colon - s);
    }
    return valid_host(host, host_len, v6) && parse_u64(colon + 1, &port) == 0 && port >= 1 &&
           port <= 65535;
}

static bool valid_namespace(const char *s)
{
    for (; *s; s++)
        if (!host_char(*s))
            return false;
    return true;
}

/* A group name or number this host knows (the engine socket is given it). */
static bool valid_group(const char *s)
{
    struct group gr, *found = NULL;
    char buf[4096], *end;
    unsigned long v;

    errno = 0;
    v = strtoul(s, &end, 10);
    if (s[0] >= '0' && s[0] <= '9' && *end == '\0')
        return errno == 0 && v < (gid_t)-1;
    return getgrnam_r(s, &gr, buf, sizeof(buf), &found) == 0 && found != NULL;
}

static char *trim(char *s)
{
    char *end;

    while (*s == ' ' || *s == '\t')
        s++;
    end = s + strlen(s);
    while (end > s && (end[-1] == ' ' || end[-1] == '\t'))
        *--end = '\0';
    return s;
}

static void free_peers(char **peers, size_t n)
{
    for (size_t i = 0; i < n; i++)
        kvt_free(peers[i]);
    kvt_free(peers);
}

/* Sets a list key from items[] (already trimmed, none empty). why gets the cause. */
static int set_list(struct kvt_config *cfg, const struct key_def *k, char **items, size_t n,
                    char *why, size_t why_len)
{
    if (n > k->max) {
        snprintf(why, why_len, "%zu items, at most %" PRIu64 " allowed", n, k->max);
        return -EINVAL;
    }
    if (k->type == T_TIERS) {
        enum kvt_tier_kind *tiers = FIELD(cfg, k, enum kvt_tier_kind);
        enum kvt_tier_kind tmp[KVT_CONFIG_TIERS_MAX];
        char names[64];

        for (size_t i = 0; i < n; i++) {
            int v = parse_enum(k->names, items[i]);

            if (v < 0) {
                join_names(k->names, names, sizeof(names));
                snprintf(why, why_len, "\"%s\" is not one of %s", items[i], names);
                return -EINVAL;
            }
            for (size_t j = 0; j < i; j++) {
                if (tmp[j] == (enum kvt_tier_kind)v) {
                    snprintf(why, why_len, "\"%s\" is listed twice", items[i]);
                    return -EINVAL;
                }
            }
            tmp[i] = (enum kvt_tier_kind)v;
        }
        memcpy(tiers, tmp, n * sizeof(*tmp));
        *FIELD2(cfg, k, size_t) = n;
        return 0;
    }
    /* T_PEERS */
    char **peers = kvt_calloc(n ? n : 1, sizeof(*peers));

    if (peers == NULL)
        return -ENOMEM;
    for (size_t i = 0; i < n; i++) {
        if (!valid_peer(items[i])) {
            snprintf(why, why_len, "\"%s\" is not host:port", items[i]);
            free_peers(peers, i);
            return -EINVAL;
        }
        peers[i] = kvt_strdup(items[i]);
        if (peers[i] == NULL) {
            free_peers(peers, i);
            return -ENOMEM;
        }
    }
    free_peers(*FIELD(cfg, k, char **), *FIELD2(cfg, k, size_t));
    *FIELD(cfg, k, char **) = peers;
    *FIELD2(cfg, k, size_t) = n;
    return 0;
}

/* Sets a list key from one scalar: comma-separated items, "[a, b]" brackets allowed. */
static int set_list_scalar(struct kvt_config *cfg, const struct key_def *k, const char *s,
                           char *why, size_t why_len)
{
    char *copy = kvt_strdup(s), *p, *items[PEERS_MAX + 1];
    size_t n = 0;
    int rc;

    if (copy == NULL)
        return -ENOMEM;
    p = trim(copy);
    if (p[0] == '[' && p[strlen(p) - 1] == ']') {
        p[strlen(p) - 1] = '\0';
        p++;
    }
    for (char *save = NULL, *tok = strtok_r(p, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        char *item = trim(tok);

        if (item[0] == '"' && strlen(item) >= 2 && item[strlen(item) - 1] == '"') {
            item[strlen(item) - 1] = '\0';
            item++;
        }
        if (item[0] == '\0')
            continue;
        if (n == KVT_ARRAY_SIZE(items)) {
            snprintf(why, why_len, "more than %" PRIu64 " items", k->max);
            kvt_free(copy);
            return -EINVAL;
        }
        items[n++] = item;
    }
    rc = set_list(cfg, k, items, n, why, why_len);
    kvt_free(copy);
    return rc;
}

/* Text libyaml reads (UTF-8 of printable characters, control characters aside: the
 * dump escapes those): a --set value may be any bytes, and one of others would make a
 * dump that does not load. */
static bool yaml_text(const char *s)
{
    static const unsigned min[] = {0, 0x80, 0x800, 0x10000}; /* shorter: overlong */
    const unsigned char *p = (const unsigned char *)s;

    while (*p != '\0') {
        unsigned c = *p++, n = c < 0x80 ? 0 : c < 0xc0 ? 4 : c < 0xe0 ? 1 : c < 0xf0 ? 2 : 3;

        if (n == 4 || c >= 0xf8)
            return false;
        c &= 0x7fu >> n;
        for (unsigned i = 0; i < n; i++, p++) {
            if ((*p & 0xc0) != 0x80)
                return false;
            c = c << 6 | (*p & 0x3fu);
        }
        if (c < min[n] || (c >= 0x80 && c < 0xa0 && c != 0x85) || (c >= 0xd800 && c < 0xe000) ||
            c == 0xfffe || c == 0xffff || c > 0x10ffff)
            return false;
    }
    return true;
}

static int set_string(struct kvt_config *cfg, const struct key_def *k, const char *s, char *why,
                      size_t why_len)
{
    size_t len = strlen(s);
    char *copy = NULL;

    if (len == 0 && !(k->flags & K_OPTIONAL)) {
        snprintf(why, why_len, "needs a value");
        return -EINVAL;
    }
    if (len > k->max) {
        snprintf(why, why_len, "longer than %" PRIu64 " characters", k->max);
        return -EINVAL;
    }
    if (!yaml_text(s)) {
        snprintf(why, why_len, "not UTF-8 text");
        return -EINVAL;
    }
    if ((k->flags & K_ADDR) && len != 0 && !valid_host(s, len, strchr(s, ':') != NULL)) {
        snprintf(why, why_len, "\"%s\" is not a host name or address", s);
        return -EINVAL;
    }
    if (k->off == F(engine_socket_group) && len != 0 && !valid_group(s)) {
        snprintf(why, why_len, "\"%s\" is not a group of this host", s);
        return -EINVAL;
    }
    if (k->off == F(node_model_fingerprint)) {
        for (size_t i = 0; i < len; i++) {
            if ((unsigned char)s[i] < 0x20 || s[i] == 0x7f) {
                snprintf(why, why_len, "a control character at offset %zu", i);
                return -EINVAL;
            }
        }
    }
    if (k->off == F(node_namespace) && !valid_namespace(s)) {
        snprintf(why, why_len, "\"%s\" may hold only letters, digits, '.', '-' and '_'", s);
        return -EINVAL;
    }
    if (len != 0 && (copy = kvt_strdup(s)) == NULL)
        return -ENOMEM;
    kvt_free(*FIELD(cfg, k, char *));
    *FIELD(cfg, k, char *) = copy;
    return 0;
}

/* Sets key k from a scalar. On -EINVAL why holds the cause (without the key). */
static int set_scalar(struct kvt_config *cfg, const struct key_def *k, const char *s, char *why,
                      size_t why_len)
{
    uint64_t v;
    bool b;
    int rc, e;
    char names[64];

    switch (k->type) {
    case T_U64:
    case T_U32:
    case T_PORT:
    case T_SIZE:
        rc = k->type == T_SIZE ? kvt_config_parse_size(s, &v) : parse_u64(s, &v);
        if (rc == -EINVAL) {
            snprintf(why, why_len, "\"%s\" is not %s", s,
                     k->type == T_SIZE ? "a size" : "a number");
            return rc;
        }
        if (rc < 0 || v < k->min || v > k->max) {
            snprintf(why, why_len, "%s is out of range (%" PRIu64 "..%" PRIu64 ")", s, k->min,
                     k->max);
            return -EINVAL;
        }
        if (k->type == T_U32)
            *FIELD(cfg, k, uint32_t) = (uint32_t)v;
        else if (k->type == T_PORT)
            *FIELD(cfg, k, uint16_t) = (uint16_t)v;
        else
            *FIELD(cfg, k, uint64_t) = v;
        return 0;
    case T_MODE:
        rc = parse_mode(s, &v);
        if (rc < 0) {
            snprintf(why, why_len, "\"%s\" is not an octal mode (e.g. 0660)", s);
            return rc;
        }
        if (v > k->max || (v & k->min) != k->min) {
            snprintf(why, why_len,
                     "%s: the owner must keep read and write (%04" PRIo64 "), at most %04" PRIo64,
                     s, k->min, k->max);
            return -EINVAL;
        }
        *FIELD(cfg, k, uint32_t) = (uint32_t)v;
        return 0;
    case T_BOOL:
        if (parse_bool(s, &b) < 0) {
            snprintf(why, why_len, "\"%s\" is not a boolean (true|false)", s);
            return -EINVAL;
        }
        *FIELD(cfg, k, bool) = b;
        return 0;
    case T_ENUM:
        e = parse_enum(k->names, s);
        if (e < 0) {
            join_names(k->names, names, sizeof(names));
            snprintf(why, why_len, "\"%s\" is not one of %s", s, names);
            return -EINVAL;
        }
        *FIELD(cfg, k, int) = e;
        return 0;
    case T_STR:
    case T_PATH:
        return set_string(cfg, k, s, why, why_len);
    case T_PEERS:
    case T_TIERS:
        return set_list_scalar(cfg, k, s, why, why_len);
    }
    return -EINVAL;
}

/* ---- errors ---- */

/* Where an error is, its origin: a line of the file (> 0), a --set argument (< 0: -1
 * the first), the defaults (0), or the file as a whole (it cannot be read, is too
 * large, is not text). */
#define ORIGIN_FILE INT_MAX

static void where(const struct loader *ld, int origin, char *buf, size_t len)
{
    if (origin == ORIGIN_FILE)
        snprintf(buf, len, "config %s", ld->path);
    else if (origin > 0)
        snprintf(buf, len, "config %s:%d", ld->path, origin);
    else if (origin < 0)
        snprintf(buf, len, "option --set %s", ld->sets[-origin - 1]);
    else
        snprintf(buf, len, "config defaults");
}

static int fail(struct loader *ld, int origin, const char *key, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

/* src into dst (len bytes) with its control characters written "\xNN", as the dump
 * writes them: an error is one line, whatever the value or argument it quotes holds. */
static void one_line(char *dst, size_t len, const char *src)
{
    size_t n = 0;

    if (len == 0)
        return;
    for (; *src != '\0'; src++) {
        unsigned char c = (unsigned char)*src;
        char esc[5] = {*src};
        size_t e = 1;

        if (c < 0x20 || c == 0x7f)
            e = (size_t)snprintf(esc, sizeof(esc), "\\x%02x", c);
        if (n + e >= len)
            break;
        memcpy(dst + n, esc, e);
        n += e;
    }
    dst[n] = '\0';
}

static int fail(struct loader *ld, int origin, const char *key, const char *fmt, ...)
{
    char at[PATH_MAX + 64], msg[512], line[sizeof(at) + sizeof(msg) + 130];
    va_list ap;

    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    where(ld, origin, at, sizeof(at));
    if (key != NULL)
        snprintf(line, sizeof(line), "%s: %s: %s", at, key, msg);
    else
        snprintf(line, sizeof(line), "%s: %s", at, msg);
    one_line(ld->err, ld->err_len, line);
    return -EINVAL;
}

static size_t edit_distance(const char *a, const char *b)
{
    size_t la = strlen(a), lb = strlen(b), row[64];

    if (lb >= KVT_ARRAY_SIZE(row))
        return SIZE_MAX;
    for (size_t j = 0; j <= lb; j++)
        row[j] = j;
    for (size_t i = 1; i <= la; i++) {
        size_t diag = row[0];

        row[0] = i;
        for (size_t j = 1; j <= lb; j++) {
            size_t up = row[j];

            row[j] = KVT_MIN(KVT_MIN(row[j] + 1, row[j - 1] + 1), diag + (a[i - 1] != b[j - 1]));
            diag = up;
        }
    }
    return row[lb];
}

static bool is_section(const char *name)
{
    size_t len = strlen(name);

    for (size_t i = 0; i < N_KEYS; i++)
        if (strncmp(keys[i].name, name, len) == 0 && keys[i].name[len] == '.')
            return true;
    return false;
}

static int fail_unknown(struct loader *ld, int origin, const char *name)
{
    const struct key_def *best = NULL;
    size_t best_d = 3;

    if (is_section(name))
        return fail(ld, origin, name, "is a section, not a key (use %s.<key>)", name);
    for (size_t i = 0; i < N_KEYS; i++) {
        size_t d = edit_distance(name, keys[i].name);

        if (d < best_d) {
            best_d = d;
            best = &keys[i];
        }
    }
    if (best != NULL)
        return fail(ld, origin, name, "unknown key (did you mean %s?)", best->name);
    return fail(ld, origin, name, "unknown key");
}

/* Sets key `name` from a scalar, recording origin. */
static int apply(struct loader *ld, int origin, const char *name, const char *value)
{
    const struct key_def *k = find_key(name);
    char why[400];
    int rc;

    if (k == NULL)
        return fail_unknown(ld, origin, name);
    if (origin > 0 && ld->origin[key_index(k)] > 0)
        return fail(ld, origin, name, "set twice in the file (first on line %d)",
                    ld->origin[key_index(k)]);
    rc = set_scalar(&ld->cfg, k, value, why, sizeof(why));
    if (rc == -EINVAL)
        return fail(ld, origin, name, "%s", why);
    if (rc < 0)
        return rc;
    ld->origin[key_index(k)] = origin;
    return 0;
}

/* ---- the file ---- */

static int node_line(const yaml_node_t *n)
{
    return (int)n->start_mark.line + 1;
}

static const char *scalar(const yaml_node_t *n)
{
    return (const char *)n->data.scalar.value;
}

/* A "\0" escape in a quoted scalar: the C string would end there and the rest of the
 * key or value be dropped without a word ("prod\0x" read as "prod"). */
static bool holds_nul(const yaml_node_t *n)
{
    return strlen(scalar(n)) != n->data.scalar.length;
}

/* A YAML null ("~", "null", nothing) given as a value: an empty value. */
static const char *scalar_value(const yaml_node_t *n)
{
    const char *s = scalar(n);

    if (n->data.scalar.style == YAML_PLAIN_SCALAR_STYLE &&
        (strcmp(s, "~") == 0 || strcmp(s, "null") == 0 || strcmp(s, "Null") == 0 ||
         strcmp(s, "NULL") == 0))
        return "";
    return s;
}

static int apply_sequence(struct loader *ld, int origin, const char *name, yaml_document_t *doc,
                          yaml_node_t *seq)
{
    const struct key_def *k = find_key(name);
    size_t n = 0;
    char *items[PEERS_MAX + 1], why[400];
    int rc;

    if (k == NULL)
        return fail_unknown(ld, origin, name);
    if (k->type != T_PEERS && k->type != T_TIERS)
        return fail(ld, origin, name, "expected a single value, not a list");
    if (ld->origin[key_index(k)] > 0)
        return fail(ld, origin, name, "set twice in the file (first on line %d)",
                    ld->origin[key_index(k)]);
    for (yaml_node_item_t *it = seq->data.sequence.items.start; it < seq->data.sequence.items.top;
         it++) {
        yaml_node_t *item = yaml_document_get_node(doc, *it);

        if (item->type != YAML_SCALAR_NODE)
            return fail(ld, node_line(item), name, "list items must be single values");
        if (holds_nul(item))
            return fail(ld, node_line(item), name, "a NUL character in a list item");
        if (n == KVT_ARRAY_SIZE(items))
            return fail(ld, node_line(item), name, "more than %" PRIu64 " items", k->max);
        items[n++] = (char *)scalar(item);
    }
    rc = set_list(&ld->cfg, k, items, n, why, sizeof(why));
    if (rc == -EINVAL)
        return fail(ld, origin, name, "%s", why);
    if (rc < 0)
        return rc;
    ld->origin[key_index(k)] = origin;
    return 0;
}

static int apply_mapping(struct loader *ld, const char *prefix, yaml_document_t *doc,
                         yaml_node_t *map, int depth)
{
    for (yaml_node_pair_t *p = map->data.mapping.pairs.start; p < map->data.mapping.pairs.top;
         p++) {
        yaml_node_t *kn = yaml_document_get_node(doc, p->key);
        yaml_node_t *vn = yaml_document_get_node(doc, p->value);
        char name[128];
        int rc;

        if (kn->type != YAML_SCALAR_NODE)
            return fail(ld, node_line(kn), NULL, "keys must be plain names");
        if (holds_nul(kn))
            return fail(ld, node_line(kn), scalar(kn), "a NUL character in the key");
        if (snprintf(name, sizeof(name), "%s%s%s", prefix, prefix[0] ? "." : "", scalar(kn)) >=
                (int)sizeof(name) ||
            depth > 4)
            return fail(ld, node_line(kn), scalar(kn), "unknown key");
        for (yaml_node_pair_t *q = map->data.mapping.pairs.start; q < p; q++) {
            yaml_node_t *prev = yaml_document_get_node(doc, q->key);

            if (prev->type == YAML_SCALAR_NODE && strcmp(scalar(prev), scalar(kn)) == 0)
                return fail(ld, node_line(kn), name, "duplicate key (first on line %d)",
                            node_line(prev));
        }
        switch (vn->type) {
        case YAML_SCALAR_NODE:
            if (holds_nul(vn))
                return fail(ld, node_line(kn), name, "a NUL character in the value");
            rc = apply(ld, node_line(kn), name, scalar_value(vn));
            break;
        case YAML_SEQUENCE_NODE:
            rc = apply_sequence(ld, node_line(kn), name, doc, vn);
            break;
        case YAML_MAPPING_NODE:
            if (find_key(name) != NULL)
                return fail(ld, node_line(kn), name, "expected a single value, not a mapping");
            if (!is_section(name))
                return fail_unknown(ld, node_line(kn), name);
            rc = apply_mapping(ld, name, doc, vn, depth + 1);
            break;
        default:
            return fail(ld, node_line(kn), name, "has no value");
        }
        if (rc < 0)
            return rc;
    }
    return 0;
}

/* libyaml nests collections without limit, and its scanner slows down with the depth
 * of flow collections (100,000 '[' took minutes to refuse): the file is first read as
 * events, which stops at the first collection deeper than KVT_CONFIG_DEPTH_MAX (no
 * configuration needs more than a few levels) before libyaml scans the rest. Syntax
 * errors are left to the document load that follows, which reports them. */
static int check_depth(struct loader *ld, const unsigned char *text, size_t len)
{
    yaml_parser_t parser;
    yaml_event_t ev;
    int depth = 0, rc = 0;
    bool done = false;

    if (!yaml_parser_initialize(&parser))
        return -ENOMEM;
    yaml_parser_set_input_string(&parser, text, len);
    while (!done && rc == 0) {
        if (!yaml_parser_parse(&parser, &ev)) {
            rc = parser.error == YAML_MEMORY_ERROR ? -ENOMEM : 0;
            break;
        }
        switch (ev.type) {
        case YAML_SEQUENCE_START_EVENT:
        case YAML_MAPPING_START_EVENT:
            if (++depth > KVT_CONFIG_DEPTH_MAX)
                rc = fail(ld, (int)ev.start_mark.line + 1, NULL,
                          "nested deeper than %d levels of mappings and lists",
                          KVT_CONFIG_DEPTH_MAX);
            break;
        case YAML_SEQUENCE_END_EVENT:
        case YAML_MAPPING_END_EVENT:
            depth--;
            break;
        case YAML_STREAM_END_EVENT:
            done = true;
            break;
        default:
            break;
        }
        yaml_event_delete(&ev);
    }
    yaml_parser_delete(&parser);
    return rc;
}

/* The whole file in memory (both passes read it; a pipe cannot be read twice). The
 * file is opened non-blocking and every read waits in poll() with a deadline: opening
 * or reading a FIFO with no writer (a `<(...)` path read again at SIGHUP) would
 * otherwise block the daemon's loop for good. */
static int read_text(struct loader *ld, int fd, unsigned char **text_p, size_t *len_p)
{
    unsigned char *text = NULL;
    size_t len = 0, cap = 0;
    uint64_t deadline = kvt_now_ns() + CONFIG_READ_TIMEOUT_MS * 1000000ull;
    int rc = 0;

    for (;;) {
        if (len == cap) {
            unsigned char *p;

            if (cap >= KVT_CONFIG_FILE_MAX) {
                kvt_free(text);
                return fail(ld, ORIGIN_FILE, NULL, "larger than %d MiB", KVT_CONFIG_FILE_MAX >> 20);
            }
            cap = cap ? 2 * cap : 16384;
            p = kvt_realloc(text, cap);
            if (p == NULL) {
                kvt_free(text);
                return -ENOMEM;
            }
            text = p;
        }
        uint64_t now = kvt_now_ns();
        struct pollfd pfd = {.fd = fd, .events = POLLIN};
        int ready = now >= deadline ? 0 : poll(&pfd, 1, (int)((deadline - now + 999999) / 1000000));

        if (ready < 0 && errno == EINTR)
            continue;
        if (ready == 0) {
            fail(ld, ORIGIN_FILE, NULL, "not read to its end within %d s (a FIFO with no writer?)",
                 CONFIG_READ_TIMEOUT_MS / 1000);
            rc = -ETIMEDOUT;
            break;
        }
        ssize_t n = ready < 0 ? -1 : read(fd, text + len, cap - len);

        if (n < 0 && (errno == EINTR || errno == EAGAIN))
            continue;
        if (n < 0) {
            rc = -errno;
            fail(ld, ORIGIN_FILE, NULL, "%s", strerror(-rc));
            break;
        }
        if (n == 0)
            break;
        len += (size_t)n;
    }
    if (rc < 0) {
        kvt_free(text);
        return rc;
    }
    *text_p = text;
    *len_p = len;
    return 0;
}

/* The line of libyaml's mark. At the end of a text whose last line has no line break,
 * libyaml breaks the line itself and counts one more: the text's last is named (its
 * lines counted as libyaml counts them: \r\n, \r, \n, NEL, LS and PS end one). */
static int mark_line(const yaml_mark_t *mark, const unsigned char *t, size_t len)
{
    int lines = 1;

    for (size_t i = 0; i < len; i++) {
        if (t[i] == '\r' && i + 1 < len && t[i + 1] == '\n')
            i++;
        lines += t[i] == '\n' || t[i] == '\r' ||
                 (t[i] == 0xc2 && i + 1 < len && t[i + 1] == 0x85) ||
                 (t[i] == 0xe2 && i + 2 < len && t[i + 1] == 0x80 && (t[i + 2] | 1) == 0xa9);
    }
    return KVT_MIN((int)mark->line + 1, lines);
}

/* The file's text, as read whole by load_file. */
static int load_text(struct loader *ld, const unsigned char *text, size_t len)
{
    yaml_parser_t parser;
    yaml_document_t doc;
    yaml_node_t *root;
    int rc = check_depth(ld, text, len);

    if (rc < 0)
        return rc;
    if (!yaml_parser_initialize(&parser))
        return -ENOMEM;
    yaml_parser_set_input_string(&parser, text, len);
    if (!yaml_parser_load(&parser, &doc)) {
        if (parser.error == YAML_MEMORY_ERROR) {
            rc = -ENOMEM;
        } else if (parser.error == YAML_READER_ERROR) {
            /* Not text libyaml can read (bad UTF-8, control characters): no line. */
            rc = fail(ld, ORIGIN_FILE, NULL, "offset %zu: %s", parser.problem_offset,
                      parser.problem ? parser.problem : "cannot be read");
        } else {
            rc = fail(ld, mark_line(&parser.problem_mark, text, len), NULL,
                      "YAML syntax error: %s%s%s", parser.problem ? parser.problem : "malformed",
                      parser.context ? " " : "", parser.context ? parser.context : "");
        }
        goto out_parser;
    }
    root = yaml_document_get_root_node(&doc);
    if (root == NULL) /* an empty file: all defaults */
        goto out_doc;
    if (root->type == YAML_SCALAR_NODE && scalar_value(root)[0] == '\0')
        goto out_doc;
    if (root->type != YAML_MAPPING_NODE) {
        rc = fail(ld, node_line(root), NULL, "expected a mapping of keys at the top level");
        goto out_doc;
    }
    rc = apply_mapping(ld, "", &doc, root, 0);
    if (rc == 0) {
        yaml_document_t next;

        /* A second document would be ignored silently: refuse it. */
        if (!yaml_parser_load(&parser, &next)) {
            rc = fail(ld, mark_line(&parser.problem_mark, text, len), NULL, "YAML syntax error: %s",
                      parser.problem ? parser.problem : "malformed");
        } else {
            if (yaml_document_get_root_node(&next) != NULL)
                rc = fail(ld, (int)next.start_mark.line + 1, NULL,
                          "a second YAML document; the configuration is one document");
            yaml_document_delete(&next);
        }
    }
out_doc:
    yaml_document_delete(&doc);
out_parser:
    yaml_parser_delete(&parser);
    return rc;
}

static int load_file(struct loader *ld)
{
    unsigned char *text = NULL;
    size_t len = 0;
    struct stat st;
    int fd, rc = 0;

    fd = open(ld->path, O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
    if (fd < 0) {
        rc = -errno;
        fail(ld, ORIGIN_FILE, NULL, "%s", strerror(-rc));
        return rc;
    }
    if (fstat(fd, &st) == 0 && S_ISDIR(st.st_mode)) {
        close(fd);
        fail(ld, ORIGIN_FILE, NULL, "%s", strerror(EISDIR));
        return -EISDIR;
    }
    rc = read_text(ld, fd, &text, &len);
    close(fd);
    if (rc < 0)
        return rc;
    rc = load_text(ld, text, len);
    kvt_free(text);
    return rc;
}

/* ---- derived values and checks ---- */

static uint64_t derived_node_id(uint16_t port)
{
    char host[256], buf[300];
    uint64_t id;

    if (gethostname(host, sizeof(host)) < 0)
        snprintf(host, sizeof(host), "localhost");
    host[sizeof(host) - 1] = '\0';
    snprintf(buf, sizeof(buf), "%s:%u", host, (unsigned)port);
    id = kvt_hash64(buf, strlen(buf));
    return id ? id : 1;
}

/* Replaces every "{id}" in *s by the node id. */
static int expand_id(char **s, uint64_t id)
{
    char idhex[17], *out, *o;
    const char *p;
    size_t n = 0;

    for (p = *s; (p = strstr(p, "{id}")) != NULL; p += 4)
        n++;
    if (n == 0)
        return 0;
    snprintf(idhex, sizeof(idhex), "%016" PRIx64, id);
    out = kvt_malloc(strlen(*s) + n * 12 + 1);
    if (out == NULL)
        return -ENOMEM;
    o = out;
    for (p = *s; *p;) {
        if (strncmp(p, "{id}", 4) == 0) {
            memcpy(o, idhex, 16);
            o += 16;
            p += 4;
        } else {
            *o++ = *p++;
        }
    }
    *o = '\0';
    kvt_free(*s);
    *s = out;
    return 0;
}

static int origin_of(const struct loader *ld, const char *key)
{
    return ld->origin[key_index(find_key(key))];
}

/* The rules of kvt_auth_load_secret (cluster/auth.c), checked here so that a bad secret
 * file is a configuration error with its key and line, before anything is created. The
 * bytes read are wiped; the daemon reads the secret again through the cluster module. */
static int check_secret_file(struct loader *ld)
{
    static const char *const key = "cluster.secret_file";
    const char *path = ld->cfg.cluster_secret_file;
    int origin = origin_of(ld, key), fd, rc = 0;
    uint8_t buf[KVT_AUTH_SECRET_MAX + 3];
    size_t n = 0;
    struct stat st;

    if (path == NULL) {
        if (ld->cfg.n_network_peers > 0)
            return fail(ld, origin_of(ld, "network.peers"), "network.peers",
                        "peers need %s (peers prove a shared secret)", key);
        return 0;
    }
    fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK | O_NOCTTY);
    if (fd < 0) {
        if (errno == ELOOP)
            return fail(ld, origin, key, "%s is a symbolic link; name the file itself", path);
        return fail(ld, origin, key, "%s: %s", path, strerror(errno));
    }
    if (fstat(fd, &st) < 0) {
        rc = fail(ld, origin, key, "%s: %s", path, strerror(errno));
        goto out;
    }
    if (!S_ISREG(st.st_mode)) {
        rc = fail(ld, origin, key, "%s is not a regular file", path);
        goto out;
    }
    if (st.st_mode & (S_IRWXG | S_IRWXO)) {
        rc = fail(ld, origin, key,
                  "%s has mode %04o; group and others must have no access (chmod 600)", path,
                  (unsigned)(st.st_mode & 07777));
        goto out;
    }
    for (;;) {
        ssize_t r = read(fd, buf + n, sizeof(buf) - n);

        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0) {
            rc = fail(ld, origin, key, "%s: %s", path, strerror(errno));
            goto out;
        }
        if (r == 0 || (n += (size_t)r) == sizeof(buf))
            break;
    }
    while (n > 0 && (buf[n - 1] == '\n' || buf[n - 1] == '\r'))
        n--;
    if (n < KVT_AUTH_SECRET_MIN || n > KVT_AUTH_SECRET_MAX)
        rc =
            fail(ld, origin, key, "%s holds %s%zu bytes; a secret has %d..%d", path,
                 n > KVT_AUTH_SECRET_MAX ? "more than " : "",
                 KVT_MIN(n, (size_t)KVT_AUTH_SECRET_MAX), KVT_AUTH_SECRET_MIN, KVT_AUTH_SECRET_MAX);
out:
    explicit_bzero(buf, sizeof(buf));
    close(fd);
    return rc;
}

/* node.group names a group this host knows: a name, or a number. */
static int check_group(struct loader *ld)
{
    static const char *const key = "node.group";
    const char *g = ld->cfg.node_group;
    struct group gr, *found = NULL;
    char buf[4096];
    uint64_t gid;

    if (g == NULL)
        return 0;
    if (parse_u64(g, &gid) == 0)
        return gid < (gid_t)-1 ? 0 : fail(ld, origin_of(ld, key), key, "%s is not a group id", g);
    if (getgrnam_r(g, &gr, buf, sizeof(buf), &found) != 0 || found == NULL)
        return fail(ld, origin_of(ld, key), key, "no group named \"%s\" on this host", g);
    return 0;
}

/* Of two keys that disagree, the one to name: the one set last (a --set after the
 * file, a later line), else the one that was set at all, else a. */
/* A numeric address that means "every address" (0.0.0.0, ::, [::]). */
static bool is_wildcard(const char *addr)
{
    unsigned char a[sizeof(struct in6_addr)] = {0}, zero[sizeof(a)] = {0};
    char buf[INET6_ADDRSTRLEN + 2];
    size_t len = strlen(addr);

    if (len >= 2 && addr[0] == '[' && addr[len - 1] == ']' && len - 2 < sizeof(buf)) {
        memcpy(buf, addr + 1, len - 2);
        buf[len - 2] = '\0';
        addr = buf;
    }
    if (inet_pton(AF_INET, addr, a) == 1)
        return memcmp(a, zero, sizeof(struct in_addr)) == 0;
    if (inet_pton(AF_INET6, addr, a) == 1)
        return memcmp(a, zero, sizeof(a)) == 0;
    return false;
}

static const char *blame(const struct loader *ld, const char *a, const char *b)
{
    int oa = origin_of(ld, a), ob = origin_of(ld, b);

    if (oa == 0 && ob == 0)
        return a;
    if (oa == 0 || ob == 0)
        return oa == 0 ? b : a;
    if ((oa < 0) != (ob < 0))
        return oa < 0 ? a : b; /* --set comes after the file */
    if (oa < 0)
        return oa < ob ? a : b; /* -(1 + index): more negative is later */
    return oa > ob ? a : b;
}

static int finish(struct loader *ld)
{
    struct kvt_config *c = &ld->cfg;
    const char *key;
    int rc;

    if (origin_of(ld, "node.id") == 0) {
        if (c->network_port == 0)
            return fail(ld, origin_of(ld, "network.port"), "network.port",
                        "0 (any port) needs node.id set: the default id derives from the port");
        c->node_id = derived_node_id(c->network_port);
    }
    for (size_t i = 0; i < N_KEYS; i++) {
        if (keys[i].type != T_PATH || *FIELD(c, &keys[i], char *) == NULL)
            continue;
        rc = expand_id(FIELD(c, &keys[i], char *), c->node_id);
        if (rc < 0)
            return rc;
        if (strlen(*FIELD(c, &keys[i], char *)) > keys[i].max)
            return fail(ld, ld->origin[i], keys[i].name, "longer than %" PRIu64 " characters",
                        keys[i].max);
    }
    if (c->primary_row_bytes % c->primary_workers != 0) {
        key = blame(ld, "primary.row_bytes", "primary.workers");
        return fail(ld, origin_of(ld, key), key,
                    "primary.row_bytes %" PRIu64 " is not a multiple of primary.workers (%u)",
                    c->primary_row_bytes, c->primary_workers);
    }
    if (c->primary_size < c->primary_row_bytes || c->primary_size % c->primary_row_bytes != 0) {
        key = blame(ld, "primary.size", "primary.row_bytes");
        return fail(ld, origin_of(ld, key), key,
                    "primary.size %" PRIu64 " is not a multiple of primary.row_bytes (%" PRIu64 ")",
                    c->primary_size, c->primary_row_bytes);
    }
    if (c->storage_low_water_us > c->storage_high_water_us) {
        key = blame(ld, "storage.low_water_us", "storage.high_water_us");
        return fail(ld, origin_of(ld, key), key,
                    "storage.low_water_us %u is above storage.high_water_us %u",
                    c->storage_low_water_us, c->storage_high_water_us);
    }
    if (c->network_fetch_timeout_ms > c->network_lease_ms) {
        key = blame(ld, "network.fetch_timeout_ms", "network.lease_ms");
        return fail(ld, origin_of(ld, key), key,
                    "network.fetch_timeout_ms %u is longer than network.lease_ms %u (a grant "
                    "must outlive the fetch)",
                    c->network_fetch_timeout_ms, c->network_lease_ms);
    }
    if (c->network_heartbeat_ms >= c->network_lease_ms) {
        key = blame(ld, "network.heartbeat_ms", "network.lease_ms");
        return fail(ld, origin_of(ld, key), key,
                    "network.heartbeat_ms %u is not below network.lease_ms %u",
                    c->network_heartbeat_ms, c->network_lease_ms);
    }
    /* Peers are told the address to reach this node at: never a wildcard. */
    if (c->network_enabled && c->network_advertise != NULL && is_wildcard(c->network_advertise))
        return fail(ld, origin_of(ld, "network.advertise"), "network.advertise",
                    "'%s' is a wildcard: name the address peers reach this node at",
                    c->network_advertise);
    if (c->network_enabled && c->network_advertise == NULL && is_wildcard(c->network_listen))
        return fail(ld, origin_of(ld, "network.listen"), "network.listen",
                    "'%s' listens on every address; set network.advertise to the one peers "
                    "reach this node at",
                    c->network_listen);
    if (c->network_enabled && c->metrics_port != 0 && c->metrics_port == c->network_port &&
        strcmp(c->metrics_listen, c->network_listen) == 0) {
        key = blame(ld, "metrics.port", "network.port");
        return fail(ld, origin_of(ld, key), key, "metrics.port and network.port are both %u",
                    (unsigned)c->metrics_port);
    }
    rc = check_group(ld);
    if (rc < 0)
        return rc;
    if (c->network_enabled)
        return check_secret_file(ld);
    return 0;
}

/* ---- API ---- */

void kvt_config_free(struct kvt_config *cfg)
{
    for (size_t i = 0; i < N_KEYS; i++) {
        const struct key_def *k = &keys[i];

        if (k->type == T_STR || k->type == T_PATH)
            kvt_free(*FIELD(cfg, k, char *));
        else if (k->type == T_PEERS)
            free_peers(*FIELD(cfg, k, char **), *FIELD2(cfg, k, size_t));
    }
    memset(cfg, 0, sizeof(*cfg));
}

int kvt_config_copy(struct kvt_config *dst, const struct kvt_config *src)
{
    struct kvt_config c = *src;
    size_t done;

    /* Fields first, then every owned string and list replaced by a copy of its own. */
    for (done = 0; done < N_KEYS; done++) {
        const struct key_def *k = &keys[done];

        if (k->type == T_STR || k->type == T_PATH) {
            const char *from = *FIELD(src, k, char *);
            char *to = from != NULL ? kvt_strdup(from) : NULL;

            if (from != NULL && to == NULL)
                break;
            *FIELD(&c, k, char *) = to;
        } else if (k->type == T_PEERS) {
            size_t n = *FIELD2(src, k, size_t);
            char **from = *FIELD(src, k, char **), **to = NULL;
            size_t i = 0;

            if (n > 0 && (to = kvt_calloc(n, sizeof(*to))) == NULL)
                break;
            for (; i < n && (to[i] = kvt_strdup(from[i])) != NULL; i++)
                ;
            if (i < n) {
                free_peers(to, i);
                break;
            }
            *FIELD(&c, k, char **) = to;
        }
    }
    if (done < N_KEYS) {
        /* Free what was copied: the keys before the one that failed. */
        for (size_t i = 0; i < done; i++) {
            const struct key_def *k = &keys[i];

            if (k->type == T_STR || k->type == T_PATH)
                kvt_free(*FIELD(&c, k, char *));
            else if (k->type == T_PEERS)
                free_peers(*FIELD(&c, k, char **), *FIELD2(&c, k, size_t));
        }
        return -ENOMEM;
    }
    *dst = c;
    return 0;
}

static int load_defaults(struct kvt_config *cfg)
{
    char why[400];

    memset(cfg, 0, sizeof(*cfg));
    for (size_t i = 0; i < N_KEYS; i++) {
        int rc;

        if (keys[i].def == NULL)
            continue;
        rc = set_scalar(cfg, &keys[i], keys[i].def, why, sizeof(why));
        assert(rc != -EINVAL); /* the table's defaults parse */
        if (rc < 0) {
            kvt_config_free(cfg);
            return rc;
        }
    }
    return 0;
}

int kvt_config_defaults(struct kvt_config *cfg)
{
    char err[256];

    return kvt_config_load(cfg, NULL, NULL, 0, err, sizeof(err));
}

/* kvt_config_load, with the file's text given (text != NULL: path only names it). */
static int load(struct kvt_config *cfg, const char *path, const char *text, size_t len,
                char *const *sets, size_t n_sets, char *err, size_t err_len)
{
    struct loader ld = {.path = path, .sets = sets, .err = err, .err_len = err_len};
    int rc;

    if (err_len > 0)
        err[0] = '\0';
    rc = load_defaults(&ld.cfg);
    if (rc < 0)
        goto oom;
    if (text != NULL || path != NULL) {
        rc = text != NULL ? load_text(&ld, (const unsigned char *)text, len) : load_file(&ld);
        if (rc < 0)
            goto out_free;
    }
    for (size_t i = 0; i < n_sets; i++) {
        int origin = -(int)i - 1;
        const char *eq = strchr(sets[i], '=');
        char name[128];

        if (eq == NULL || eq == sets[i] || (size_t)(eq - sets[i]) >= sizeof(name)) {
            rc = fail(&ld, origin, NULL, "expected key=value");
            goto out_free;
        }
        memcpy(name, sets[i], (size_t)(eq - sets[i]));
        name[eq - sets[i]] = '\0';
        rc = apply(&ld, origin, name, eq + 1);
        if (rc < 0)
            goto out_free;
    }
    rc = finish(&ld);
    if (rc < 0)
        goto out_free;
    *cfg = ld.cfg;
    return 0;
out_free:
    kvt_config_free(&ld.cfg);
oom:
    if (rc == -ENOMEM)
        snprintf(err, err_len, "config: out of memory");
    return rc;
}

int kvt_config_load(struct kvt_config *cfg, const char *path, char *const *sets, size_t n_sets,
                    char *err, size_t err_len)
{
    return load(cfg, path, NULL, 0, sets, n_sets, err, err_len);
}

int kvt__config_load_text(struct kvt_config *cfg, const char *name, const char *text, size_t len,
                          char *const *sets, size_t n_sets, char *err, size_t err_len)
{
    return load(cfg, name, text, len, sets, n_sets, err, err_len);
}

/* ---- printing ---- */

/* s as a YAML double-quoted scalar that loads back to s: control characters escaped,
 * and so are the line breaks YAML takes beyond ASCII's (NEL U+0085, LS U+2028, PS
 * U+2029, as UTF-8; found by fuzz_config), which a quoted scalar would fold into a
 * space. */
static void print_quoted(FILE *out, const char *s)
{
    fputc('"', out);
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;

        if (c == '"' || c == '\\') {
            fprintf(out, "\\%c", c);
        } else if (c < 0x20 || c == 0x7f) {
            fprintf(out, "\\x%02x", c);
        } else if (c == 0xc2 && (unsigned char)s[1] == 0x85) {
            fputs("\\N", out);
            s++;
        } else if (c == 0xe2 && (unsigned char)s[1] == 0x80 &&
                   ((unsigned char)s[2] == 0xa8 || (unsigned char)s[2] == 0xa9)) {
            fputs((unsigned char)s[2] == 0xa8 ? "\\L" : "\\P", out);
            s += 2;
        } else {
            fputc(c, out);
        }
    }
    fputc('"', out);
}

static void print_value(FILE *out, const struct kvt_config *cfg, const struct key_def *k)
{
    switch (k->type) {
    case T_U64:
        fprintf(out, "0x%016" PRIx64, *FIELD(cfg, k, uint64_t));
        break;
    case T_U32:
        fprintf(out, "%" PRIu32, *FIELD(cfg, k, uint32_t));
        break;
    case T_PORT:
        fprintf(out, "%u", (unsigned)*FIELD(cfg, k, uint16_t));
        break;
    case T_MODE:
        fprintf(out, "0%03" PRIo32, *FIELD(cfg, k, uint32_t));
        break;
    case T_SIZE:
        format_size(out, *FIELD(cfg, k, uint64_t));
        break;
    case T_BOOL:
        fputs(*FIELD(cfg, k, bool) ? "true" : "false", out);
        break;
    case T_ENUM:
        fputs(k->names[*FIELD(cfg, k, int)], out);
        break;
    case T_STR:
    case T_PATH: {
        const char *s = *FIELD(cfg, k, char *);

        print_quoted(out, s ? s : "");
        break;
    }
    case T_PEERS:
    case T_TIERS: {
        size_t n = *FIELD2(cfg, k, size_t);

        fputc('[', out);
        for (size_t i = 0; i < n; i++) {
            if (i)
                fputs(", ", out);
            if (k->type == T_PEERS)
                print_quoted(out, (*FIELD(cfg, k, char **))[i]);
            else
                fputs(k->names[FIELD(cfg, k, enum kvt_tier_kind)[i]], out);
        }
        fputc(']', out);
        break;
    }
    }
}

void kvt_config_dump(FILE *out, const struct kvt_config *cfg)
{
    char section[64] = "";

    for (size_t i = 0; i < N_KEYS; i++) {
        const struct key_def *k = &keys[i];
        const char *dot = strchr(k->name, '.');
        size_t len = dot ? (size_t)(dot - k->name) : 0;

        if (len != strlen(section) || strncmp(section, k->name, len) != 0) {
            memcpy(section, k->name, len);
            section[len] = '\0';
            if (len)
                fprintf(out, "%s:\n", section);
        }
        fprintf(out, "%s%s: ", len ? "  " : "", len ? dot + 1 : k->name);
        print_value(out, cfg, k);
        fputc('\n', out);
    }
}

static const char *type_name(const struct key_def *k, char *buf, size_t len)
{
    switch (k->type) {
    case T_U64:
    case T_U32:
        return "N";
    case T_PORT:
        return "PORT";
    case T_MODE:
        return "MODE";
    case T_SIZE:
        return "SIZE";
    case T_BOOL:
        return "BOOL";
    case T_STR:
        return k->flags & K_ADDR ? "ADDR" : "STRING";
    case T_PATH:
        return "PATH";
    case T_PEERS:
        return "LIST";
    case T_ENUM:
    case T_TIERS:
        join_names(k->names, buf, len);
        return buf;
    }
    return "?";
}

/* Prints text at indent, wrapped at word boundaries to HELP_WIDTH columns. */
#define HELP_WIDTH 80
static void print_wrapped(FILE *out, int indent, const char *text)
{
    int col = indent;

    fprintf(out, "%*s", indent, "");
    while (*text != '\0') {
        size_t word = strcspn(text, " ");

        if (col > indent && col + 1 + (int)word > HELP_WIDTH) {
            fprintf(out, "\n%*s", indent, "");
            col = indent;
        } else if (col > indent) {
            fputc(' ', out);
            col++;
        }
        fprintf(out, "%.*s", (int)word, text);
        col += (int)word;
        text += word;
        text += strspn(text, " ");
    }
    fputc('\n', out);
}

/* One key per paragraph: name, value type and default on the first line (the names
 * padded to the longest), its help wrapped below. */
void kvt_config_print_help(FILE *out)
{
    int name_w = 0;

    for (size_t i = 0; i < N_KEYS; i++)
        name_w = KVT_MAX(name_w, (int)strlen(keys[i].name));
    fprintf(out, "Configuration keys (in the YAML file, or --set KEY=VALUE after it):\n");
    for (size_t i = 0; i < N_KEYS; i++) {
        const struct key_def *k = &keys[i];
        char names[64], range[64] = "";

        if (k->type == T_U32 || k->type == T_U64 || k->type == T_PORT)
            snprintf(range, sizeof(range), ", %" PRIu64 "..%" PRIu64, k->min, k->max);
        fprintf(out, "\n  %-*s  %s  (default: %s%s)%s\n", name_w, k->name, type_name(k, names, 64),
                k->def == NULL ? "derived"
                : k->def[0]    ? k->def
                               : "none",
                range, k->flags & K_RELOAD ? " [reloadable]" : "");
        print_wrapped(out, 6, k->help);
    }
    fprintf(out, "\nSizes take KiB, MiB, GiB, TiB (x1024) or kB, MB, GB, TB (x1000); lists are\n"
                 "YAML sequences or comma-separated; \"{id}\" in a path is node.id in hex.\n");
}

/* ---- reload ---- */

bool kvt_config_key_reloadable(const char *key)
{
    const struct key_def *k = find_key(key);

    return k != NULL && (k->flags & K_RELOAD);
}

static char *value_text(const struct kvt_config *cfg, const struct key_def *k)
{
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);

    if (f == NULL)
        return NULL;
    print_value(f, cfg, k);
    fclose(f);
    return buf;
}

bool kvt_config_diff_reloadable(const struct kvt_config *old_cfg, const struct kvt_config *new_cfg,
                                struct kvt_config_diff *d)
{
    memset(d, 0, sizeof(*d));
    d->reloadable = true;
    for (size_t i = 0; i < N_KEYS; i++) {
        char *a = value_text(old_cfg, &keys[i]), *b = value_text(new_cfg, &keys[i]);
        /* Cannot compare (no memory): count the key as changed. */
        bool changed = a == NULL || b == NULL || strcmp(a, b) != 0;

        free(a);
        free(b);
        if (!changed)
            continue;
        d->changed[d->n_changed++] = keys[i].name;
        if (!(keys[i].flags & K_RELOAD) && d->reloadable) {
            d->reloadable = false;
            d->first_fixed = keys[i].name;
        }
    }
    return d->reloadable;
}

const char *kvt_tier_kind_name(enum kvt_tier_kind k)
{
    return (unsigned)k < KVT_ARRAY_SIZE(tier_names) - 1 ? tier_names[k] : "?";
}

const char *kvt_transport_kind_name(enum kvt_transport_kind k)
{
    return (unsigned)k < KVT_ARRAY_SIZE(transport_names) - 1 ? transport_names[k] : "?";
}

const char *kvt_verify_kind_name(enum kvt_verify_kind k)
{
    return (unsigned)k < KVT_ARRAY_SIZE(verify_names) - 1 ? verify_names[k] : "?";
}

const char *kvt_fetch_kind_name(enum kvt_fetch_kind k)
{
    return (unsigned)k < KVT_ARRAY_SIZE(fetch_names) - 1 ? fetch_names[k] : "?";
}

const char *kvt_policy_kind_name(enum kvt_policy_kind k)
{
    return (unsigned)k < KVT_ARRAY_SIZE(policy_names) - 1 ? policy_names[k] : "?";
}

int kvt_config_reload(struct kvt_config *running, const char *path, char *const *sets,
                      size_t n_sets, struct kvt_config_diff *d, char *err, size_t err_len)
{
    struct kvt_config next;
    int rc;

    rc = kvt_config_load(&next, path, sets, n_sets, err, err_len);
    if (rc < 0)
        return rc;
    /* node.id derives from the host name: a renamed host is a change of a fixed key. */
    if (!kvt_config_diff_reloadable(running, &next, d)) {
        char line[PATH_MAX + 128];

        snprintf(line, sizeof(line), "config %s: %s: cannot change at run time (restart kvtierd)",
                 path ? path : "(none)", d->first_fixed);
        one_line(err, err_len, line);
        kvt_config_free(&next);
        return -EPERM;
    }
    kvt_config_free(running);
    *running = next;
    return 0;
}

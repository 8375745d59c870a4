/* SPDX-License-Identifier: Apache-2.0 */
/* kvtierd's configuration: defaults with no file, the file and --set layers, every
 * class of bad configuration (the message names the key and its line or the --set
 * argument, the caller's struct is untouched and nothing is created), dump/load round
 * trip, --help, and the SIGHUP reload rules. */
#include <dirent.h>
#include <errno.h>
#include <inttypes.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "test_util.h"

#include "kvt/alloc.h"
#include "kvt/alloc_test.h"
#include "kvt/clock.h"
#include "kvt/common.h"
#include "kvt/config.h"

struct fixture {
    char *dir;
    char conf[512];
    char secret[512];
    char region[512], storage[512], sock[512];
    char set_region[600], set_storage[600], set_sock[600], set_secret[600];
};

static struct fixture fx;

static void write_file(const char *path, const char *text, mode_t mode)
{
    FILE *f = fopen(path, "w");

    assert_non_null(f);
    fputs(text, f);
    assert_int_equal(fclose(f), 0);
    assert_int_equal(chmod(path, mode), 0);
}

static int setup(void **state)
{
    (void)state;
    memset(&fx, 0, sizeof(fx));
    fx.dir = kt_tmpdir("config");
    assert_non_null(fx.dir);
    snprintf(fx.conf, sizeof(fx.conf), "%s/kvtierd.yaml", fx.dir);
    snprintf(fx.secret, sizeof(fx.secret), "%s/secret", fx.dir);
    snprintf(fx.region, sizeof(fx.region), "%s/region", fx.dir);
    snprintf(fx.storage, sizeof(fx.storage), "%s/storage", fx.dir);
    snprintf(fx.sock, sizeof(fx.sock), "%s/sock", fx.dir);
    snprintf(fx.set_region, sizeof(fx.set_region), "primary.path=%s", fx.region);
    snprintf(fx.set_storage, sizeof(fx.set_storage), "storage.root=%s", fx.storage);
    snprintf(fx.set_sock, sizeof(fx.set_sock), "engine.socket=%s", fx.sock);
    snprintf(fx.set_secret, sizeof(fx.set_secret), "cluster.secret_file=%s", fx.secret);
    write_file(fx.secret, "0123456789abcdef0123456789abcdef\n", 0600);
    return 0;
}

static void remove_tree(const char *dir)
{
    DIR *d = opendir(dir);
    struct dirent *e;
    char path[1024];

    if (d == NULL)
        return;
    while ((e = readdir(d)) != NULL) {
        struct stat st;

        if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0)
            continue;
        snprintf(path, sizeof(path), "%s/%s", dir, e->d_name);
        if (lstat(path, &st) == 0 && S_ISDIR(st.st_mode)) {
            chmod(path, 0700);
            remove_tree(path);
        } else {
            unlink(path);
        }
    }
    closedir(d);
    rmdir(dir);
}

static int teardown(void **state)
{
    (void)state;
    remove_tree(fx.dir);
    free(fx.dir);
    return 0;
}

/* Names in fx.dir, sorted, joined by ','. */
static void list_dir(char *buf, size_t len)
{
    struct dirent **names;
    int n = scandir(fx.dir, &names, NULL, alphasort);
    size_t used = 0;

    assert_true(n >= 0);
    buf[0] = '\0';
    for (int i = 0; i < n; i++) {
        if (names[i]->d_name[0] != '.')
            used += (size_t)snprintf(buf + used, len - used, "%s,", names[i]->d_name);
        free(names[i]);
    }
    free(names);
}

/* A load that must fail: -EINVAL (unless want_rc says otherwise), err holds every
 * one of the NULL-terminated strings, *cfg is not written, and no file appears. */
static void expect_bad(const char *file_text, char *const *extra_sets, size_t n_extra, int want_rc,
                       const char *const *want)
{
    char *sets[16], err[1024], before[2048], after[2048];
    struct kvt_config cfg, sentinel;
    size_t n = 0;
    int rc;

    if (file_text != NULL)
        write_file(fx.conf, file_text, 0644);
    else
        unlink(fx.conf);
    sets[n++] = fx.set_region;
    sets[n++] = fx.set_storage;
    sets[n++] = fx.set_sock;
    for (size_t i = 0; i < n_extra; i++)
        sets[n++] = extra_sets[i];
    memset(&cfg, 0xa5, sizeof(cfg));
    memcpy(&sentinel, &cfg, sizeof(cfg));
    list_dir(before, sizeof(before));
    rc = kvt_config_load(&cfg, file_text != NULL ? fx.conf : NULL, sets, n, err, sizeof(err));
    list_dir(after, sizeof(after));
    if (rc != (want_rc ? want_rc : -EINVAL))
        fail_msg("load of <<%s>> returned %d (%s), err \"%s\"", file_text ? file_text : "", rc,
                 strerror(-rc), err);
    assert_memory_equal(&cfg, &sentinel, sizeof(cfg));
    assert_string_equal(before, after);
    if (strchr(err, '\n') != NULL)
        fail_msg("error \"%s\" is more than one line", err);
    for (size_t i = 0; want[i] != NULL; i++)
        if (strstr(err, want[i]) == NULL)
            fail_msg("error \"%s\" lacks \"%s\"", err, want[i]);
}

/* "config <fx.conf>:<line>" */
static const char *at_line(int line)
{
    static char buf[8][600];
    static int next;
    char *b = buf[next++ % 8];

    snprintf(b, sizeof(buf[0]), "config %s:%d: ", fx.conf, line);
    return b;
}

#define WANT(...) ((const char *const[]){__VA_ARGS__, NULL})

static void test_defaults_without_file(void **state)
{
    struct kvt_config cfg;
    char err[512], idhex[17];

    (void)state;
    assert_int_equal(kvt_config_defaults(&cfg), 0);
    snprintf(idhex, sizeof(idhex), "%016" PRIx64, cfg.node_id);
    assert_true(cfg.node_id != 0);
    assert_int_equal(cfg.primary_size, 1ull << 30);
    assert_int_equal(cfg.primary_row_bytes, 256 * 1024);
    assert_int_equal(cfg.primary_size % cfg.primary_row_bytes, 0);
    /* The runtime folder /run/kvtier/<id> (tmpfs, the daemon's own) and the storage
     * under /var/lib, not names in /tmp or /dev/shm that another user could take. */
    {
        char want[64];
        snprintf(want, sizeof(want), "/run/kvtier/%s/primary.mmap", idhex);
        assert_string_equal(cfg.primary_path, want);
        snprintf(want, sizeof(want), "/run/kvtier/%s/engine.sock", idhex);
        assert_string_equal(cfg.engine_socket, want);
        snprintf(want, sizeof(want), "/var/lib/kvtier/%s", idhex);
        assert_string_equal(cfg.storage_root, want);
    }
    assert_null(cfg.node_group);
    assert_null(cfg.node_model_fingerprint);
    assert_non_null(strstr(cfg.primary_path, idhex));
    assert_null(strstr(cfg.primary_path, "{id}"));
    assert_true(cfg.storage_enabled);
    assert_true(cfg.network_enabled);
    assert_string_equal(cfg.network_listen, "127.0.0.1");
    assert_int_equal(cfg.network_port, 7170);
    assert_int_equal(cfg.network_transport, KVT_TRANSPORT_UCX);
    assert_int_equal(cfg.n_network_peers, 0);
    assert_null(cfg.cluster_secret_file);
    assert_true(cfg.network_fetch_timeout_ms <= cfg.network_lease_ms);
    assert_int_equal(cfg.network_locate_timeout_ms, 2000);
    assert_true(cfg.network_heartbeat_ms < cfg.network_lease_ms);
    assert_true(cfg.network_heartbeat_misses >= 1);
    assert_true(cfg.storage_low_water_us <= cfg.storage_high_water_us);
    assert_int_equal(cfg.storage_read_depth, 16);
    assert_string_equal(cfg.metrics_listen, "127.0.0.1");
    assert_int_equal(cfg.metrics_port, 9464);
    assert_int_equal(cfg.log_level, KVT_LOG_INFO);
    assert_int_equal(cfg.n_tiers, 2);
    assert_int_equal(cfg.tiers[0], KVT_TIER_STORAGE);
    assert_int_equal(cfg.tiers[1], KVT_TIER_NETWORK);
    assert_int_equal(cfg.primary_policy, KVT_POLICY_LRU);
    kvt_config_free(&cfg);

    /* Same as a load with no file and no --set. */
    assert_int_equal(kvt_config_load(&cfg, NULL, NULL, 0, err, sizeof(err)), 0);
    assert_string_equal(err, "");
    assert_int_equal(cfg.primary_size, 1ull << 30);
    kvt_config_free(&cfg);
}

static void test_file_and_sets(void **state)
{
    char text[2048], err[512];
    struct kvt_config cfg;
    char *sets[] = {"primary.workers=4", "log.level=debug", "network.peers=10.0.0.2:7170"};

    (void)state;
    snprintf(text, sizeof(text),
             "# a comment\n"
             "node:\n"
             "  id: 0x1234\n"
             "  namespace: llama-70b.fp8\n"
             "primary:\n"
             "  path: /dev/shm/r-{id}\n"
             "  size: 2GiB\n"
             "  row_bytes: 64KiB\n"
             "  workers: 2\n"
             "  policy: arc\n"
             "storage.enabled: false\n"
             "storage:\n"
             "  capacity: 10GB\n"
             "  read_depth: 4\n"
             "  high_water_us: 9000\n"
             "  low_water_us: 3000\n"
             "network:\n"
             "  transport: verbs\n"
             "  listen: \"::1\"\n"
             "  port: 0\n"
             "  peers:\n"
             "    - a.example:7000\n"
             "    - \"[fe80::1]:7001\"\n"
             "  lease_ms: 5000\n"
             "  fetch_timeout_ms: 1500\n"
             "  locate_timeout_ms: 700\n"
             "  heartbeat_ms: 250\n"
             "  heartbeat_misses: 5\n"
             "cluster: {secret_file: %s}\n"
             "metrics: {listen: 0.0.0.0, port: 0}\n"
             "log: {level: warn}\n"
             "tiers: [network]\n",
             fx.secret);
    write_file(fx.conf, text, 0644);

    assert_int_equal(kvt_config_load(&cfg, fx.conf, NULL, 0, err, sizeof(err)), 0);
    assert_int_equal(cfg.node_id, 0x1234);
    assert_string_equal(cfg.node_namespace, "llama-70b.fp8");
    assert_string_equal(cfg.primary_path, "/dev/shm/r-0000000000001234");
    assert_int_equal(cfg.primary_size, 2ull << 30);
    assert_int_equal(cfg.primary_row_bytes, 65536);
    assert_int_equal(cfg.primary_workers, 2);
    assert_int_equal(cfg.primary_policy, KVT_POLICY_ARC);
    assert_false(cfg.storage_enabled);
    assert_int_equal(cfg.storage_capacity, 10000000000ull);
    assert_int_equal(cfg.storage_read_depth, 4);
    assert_int_equal(cfg.storage_high_water_us, 9000);
    assert_int_equal(cfg.storage_low_water_us, 3000);
    assert_int_equal(cfg.network_transport, KVT_TRANSPORT_VERBS);
    assert_string_equal(cfg.network_listen, "::1");
    assert_int_equal(cfg.network_port, 0);
    assert_int_equal(cfg.n_network_peers, 2);
    assert_string_equal(cfg.network_peers[0], "a.example:7000");
    assert_string_equal(cfg.network_peers[1], "[fe80::1]:7001");
    assert_int_equal(cfg.network_lease_ms, 5000);
    assert_int_equal(cfg.network_fetch_timeout_ms, 1500);
    assert_int_equal(cfg.network_locate_timeout_ms, 700);
    assert_int_equal(cfg.network_heartbeat_ms, 250);
    assert_int_equal(cfg.network_heartbeat_misses, 5);
    assert_string_equal(cfg.cluster_secret_file, fx.secret);
    assert_string_equal(cfg.metrics_listen, "0.0.0.0");
    assert_int_equal(cfg.metrics_port, 0);
    assert_int_equal(cfg.log_level, KVT_LOG_WARN);
    assert_int_equal(cfg.n_tiers, 1);
    assert_int_equal(cfg.tiers[0], KVT_TIER_NETWORK);
    kvt_config_free(&cfg);

    /* --set comes after the file, in order; a list given on the command line replaces
     * the file's list. */
    assert_int_equal(kvt_config_load(&cfg, fx.conf, sets, 3, err, sizeof(err)), 0);
    assert_int_equal(cfg.primary_workers, 4);
    assert_int_equal(cfg.log_level, KVT_LOG_DEBUG);
    assert_int_equal(cfg.n_network_peers, 1);
    assert_string_equal(cfg.network_peers[0], "10.0.0.2:7170");
    assert_int_equal(cfg.primary_size, 2ull << 30);
    kvt_config_free(&cfg);

    /* An empty file is all defaults. */
    write_file(fx.conf, "# nothing\n", 0644);
    assert_int_equal(kvt_config_load(&cfg, fx.conf, NULL, 0, err, sizeof(err)), 0);
    assert_int_equal(cfg.primary_size, 1ull << 30);
    kvt_config_free(&cfg);
}

static void test_unknown_key(void **state)
{
    (void)state;
    expect_bad("primary:\n  size: 2GiB\n  sise: 2GiB\n", NULL, 0, 0,
               WANT(at_line(3), "primary.sise", "unknown key", "did you mean primary.size"));
    expect_bad("node:\n  id: 7\nprimery:\n  size: 1GiB\n", NULL, 0, 0,
               WANT(at_line(3), "primery", "unknown key"));
    expect_bad("log.level: info\nfrobnicate: 1\n", NULL, 0, 0,
               WANT(at_line(2), "frobnicate", "unknown key"));
    /* A section where a key belongs. */
    expect_bad("primary: 5\n", NULL, 0, 0, WANT(at_line(1), "primary", "is a section"));
}

static void test_wrong_type(void **state)
{
    (void)state;
    expect_bad("storage:\n  enabled: maybe\n", NULL, 0, 0,
               WANT(at_line(2), "storage.enabled", "not a boolean"));
    expect_bad("primary:\n  workers: two\n", NULL, 0, 0,
               WANT(at_line(2), "primary.workers", "not a number"));
    expect_bad("primary:\n  size: [1GiB, 2GiB]\n", NULL, 0, 0,
               WANT(at_line(2), "primary.size", "not a list"));
    expect_bad("network:\n  peers:\n    host: a\n", NULL, 0, 0,
               WANT(at_line(2), "network.peers", "not a mapping"));
    expect_bad("network:\n  peers: [localhost]\n", NULL, 0, 0,
               WANT(at_line(2), "network.peers", "not host:port"));
    expect_bad("primary:\n  policy: fifo\n", NULL, 0, 0,
               WANT(at_line(2), "primary.policy", "not one of lru|arc"));
    expect_bad("network:\n  transport: tcp\n", NULL, 0, 0,
               WANT(at_line(2), "network.transport", "ucx|verbs"));
    expect_bad("network:\n  listen: \"bad host!\"\n", NULL, 0, 0,
               WANT(at_line(2), "network.listen", "not a host name or address"));
    expect_bad("tiers: [storage, tape]\n", NULL, 0, 0, WANT(at_line(1), "tiers", "tape"));
    expect_bad("tiers: [storage, storage]\n", NULL, 0, 0,
               WANT(at_line(1), "tiers", "listed twice"));
    expect_bad("node:\n  namespace: \"a b\"\n", NULL, 0, 0,
               WANT(at_line(2), "node.namespace", "only letters"));
    expect_bad("- a\n- b\n", NULL, 0, 0, WANT(at_line(1), "mapping of keys"));
}

static void test_out_of_range(void **state)
{
    (void)state;
    expect_bad("primary:\n  workers: 0\n", NULL, 0, 0,
               WANT(at_line(2), "primary.workers", "out of range (1..1024)"));
    expect_bad("network:\n  port: 70000\n", NULL, 0, 0,
               WANT(at_line(2), "network.port", "out of range"));
    expect_bad("primary:\n  size: 65TiB\n", NULL, 0, 0,
               WANT(at_line(2), "primary.size", "out of range"));
    expect_bad("node:\n  id: 99999999999999999999999\n", NULL, 0, 0,
               WANT(at_line(2), "node.id", "out of range"));
    expect_bad("node:\n  id: 0\n", NULL, 0, 0, WANT(at_line(2), "node.id", "out of range"));
    expect_bad("storage:\n  read_depth: 0\n", NULL, 0, 0,
               WANT(at_line(2), "storage.read_depth", "out of range (1..256)"));
    expect_bad("\n\nnetwork:\n  lease_ms: 5\n", NULL, 0, 0,
               WANT(at_line(4), "network.lease_ms", "out of range"));
    expect_bad("network:\n  locate_timeout_ms: 0\n", NULL, 0, 0,
               WANT(at_line(2), "network.locate_timeout_ms", "out of range"));
    /* Cross-key: the key that was set is the one named. */
    expect_bad("primary:\n  row_bytes: 3000\n", NULL, 0, 0,
               WANT(at_line(2), "primary.row_bytes", "not a multiple"));
    expect_bad("primary:\n  size: 1GiB\n  row_bytes: 256KiB\n  workers: 3\n", NULL, 0, 0,
               WANT(at_line(4), "primary.workers", "not a multiple of primary.workers"));
    expect_bad("storage:\n  low_water_us: 6000\n", NULL, 0, 0,
               WANT(at_line(2), "storage.low_water_us", "above"));
    expect_bad("network:\n  lease_ms: 10000\n  fetch_timeout_ms: 20000\n", NULL, 0, 0,
               WANT(at_line(3), "network.fetch_timeout_ms", "longer than network.lease_ms"));
    expect_bad("network:\n  heartbeat_ms: 60000\n", NULL, 0, 0,
               WANT(at_line(2), "network.heartbeat_ms", "not below"));
    expect_bad("metrics:\n  port: 7170\n", NULL, 0, 0,
               WANT(at_line(2), "metrics.port", "both 7170"));
    expect_bad("network:\n  port: 0\n", NULL, 0, 0,
               WANT(at_line(2), "network.port", "needs node.id"));
}

static void test_bad_size_suffix(void **state)
{
    uint64_t v = 0;

    (void)state;
    expect_bad("primary:\n  size: 2GB/s\n", NULL, 0, 0,
               WANT(at_line(2), "primary.size", "\"2GB/s\" is not a size"));
    expect_bad("primary:\n  size: 2 GiBs\n", NULL, 0, 0,
               WANT(at_line(2), "primary.size", "not a size"));
    expect_bad("storage:\n  capacity: GiB\n", NULL, 0, 0,
               WANT(at_line(2), "storage.capacity", "not a size"));
    expect_bad("storage:\n  capacity: -1GiB\n", NULL, 0, 0,
               WANT(at_line(2), "storage.capacity", "not a size"));

    assert_int_equal(kvt_config_parse_size("4096", &v), 0);
    assert_int_equal(v, 4096);
    assert_int_equal(kvt_config_parse_size("256KiB", &v), 0);
    assert_int_equal(v, 262144);
    assert_int_equal(kvt_config_parse_size("2GiB", &v), 0);
    assert_int_equal(v, 2ull << 30);
    assert_int_equal(kvt_config_parse_size("10GB", &v), 0);
    assert_int_equal(v, 10000000000ull);
    assert_int_equal(kvt_config_parse_size("1 MiB", &v), 0);
    assert_int_equal(v, 1 << 20);
    assert_int_equal(kvt_config_parse_size("3kB", &v), 0);
    assert_int_equal(v, 3000);
    v = 77;
    assert_int_equal(kvt_config_parse_size("20000000TiB", &v), -ERANGE);
    assert_int_equal(kvt_config_parse_size("99999999999999999999", &v), -ERANGE);
    assert_int_equal(kvt_config_parse_size("", &v), -EINVAL);
    assert_int_equal(kvt_config_parse_size("5XB", &v), -EINVAL);
    assert_int_equal(kvt_config_parse_size("5 ", &v), -EINVAL);
    assert_int_equal(kvt_config_parse_size("1.5GiB", &v), -EINVAL);
    assert_int_equal(v, 77); /* written only on success */
}

static void test_secret_file(void **state)
{
    char text[1024], link[600], sub[600];

    (void)state;
    snprintf(text, sizeof(text), "cluster:\n  secret_file: %s/nope\n", fx.dir);
    expect_bad(text, NULL, 0, 0,
               WANT(at_line(2), "cluster.secret_file", "No such file or directory"));

    write_file(fx.secret, "0123456789abcdef0123\n", 0644);
    snprintf(text, sizeof(text), "node: {id: 9}\ncluster:\n  secret_file: %s\n", fx.secret);
    expect_bad(text, NULL, 0, 0, WANT(at_line(3), "cluster.secret_file", "mode 0644"));

    write_file(fx.secret, "short\n", 0600);
    expect_bad(text, NULL, 0, 0, WANT(at_line(3), "cluster.secret_file", "5 bytes"));

    snprintf(sub, sizeof(sub), "%s/secret.d", fx.dir);
    assert_int_equal(mkdir(sub, 0700), 0);
    snprintf(text, sizeof(text), "cluster:\n  secret_file: %s\n", sub);
    expect_bad(text, NULL, 0, 0, WANT(at_line(2), "cluster.secret_file", "not a regular file"));

    write_file(fx.secret, "0123456789abcdef0123\n", 0600);
    snprintf(link, sizeof(link), "%s/secret.link", fx.dir);
    assert_int_equal(symlink(fx.secret, link), 0);
    snprintf(text, sizeof(text), "cluster:\n  secret_file: %s\n", link);
    expect_bad(text, NULL, 0, 0, WANT(at_line(2), "cluster.secret_file", "symbolic link"));

    /* Unreadable for a user without CAP_DAC_OVERRIDE; root reads mode 0000 anyway. */
    if (geteuid() != 0) {
        chmod(fx.secret, 0000);
        snprintf(text, sizeof(text), "cluster:\n  secret_file: %s\n", fx.secret);
        expect_bad(text, NULL, 0, 0, WANT(at_line(2), "cluster.secret_file", "Permission"));
        chmod(fx.secret, 0600);
    }

    /* By --set: the option is named. */
    {
        char opt[700];
        char *sets[] = {opt};

        snprintf(opt, sizeof(opt), "cluster.secret_file=%s/missing", fx.dir);
        expect_bad(NULL, sets, 1, 0,
                   WANT("option --set cluster.secret_file=", "cluster.secret_file", "No such"));
    }
    /* Peers need a secret. */
    expect_bad("network:\n  peers: [\"10.0.0.1:7170\"]\n", NULL, 0, 0,
               WANT(at_line(2), "network.peers", "need cluster.secret_file"));
    /* With the network tier off the secret is not read. */
    {
        struct kvt_config cfg;
        char err[512];
        char *sets[] = {"network.enabled=false", "cluster.secret_file=/nonexistent/x"};

        assert_int_equal(kvt_config_load(&cfg, NULL, sets, 2, err, sizeof(err)), 0);
        kvt_config_free(&cfg);
    }
}

/* node.group: a group this host knows, by name or number; unset by default. */
static void test_node_group(void **state)
{
    char *sets[] = {fx.set_region, fx.set_storage, fx.set_sock, "node.group=root"};
    struct kvt_config cfg;
    char err[512];

    (void)state;
    assert_int_equal(kvt_config_load(&cfg, NULL, sets, KVT_ARRAY_SIZE(sets), err, sizeof(err)), 0);
    assert_string_equal(cfg.node_group, "root");
    kvt_config_free(&cfg);
    sets[3] = "node.group=4242";
    assert_int_equal(kvt_config_load(&cfg, NULL, sets, KVT_ARRAY_SIZE(sets), err, sizeof(err)), 0);
    assert_string_equal(cfg.node_group, "4242");
    kvt_config_free(&cfg);
    expect_bad("node:\n  group: kvt-no-such-group\n", NULL, 0, 0,
               WANT(at_line(2), "node.group", "no group named \"kvt-no-such-group\""));
    expect_bad(NULL, (char *[]){"node.group=4294967295"}, 1, 0,
               WANT("node.group", "not a group id"));
}

/* node.model_fingerprint: unset by default, any printable text up to 255 bytes. */
static void test_model_fingerprint(void **state)
{
    char *sets[] = {fx.set_region, fx.set_storage, fx.set_sock,
                    "node.model_fingerprint=vllm:Qwen/Qwen3-0.6B:5e1f"};
    struct kvt_config cfg;
    char err[512];

    (void)state;
    assert_int_equal(kvt_config_load(&cfg, NULL, sets, KVT_ARRAY_SIZE(sets), err, sizeof(err)), 0);
    assert_string_equal(cfg.node_model_fingerprint, "vllm:Qwen/Qwen3-0.6B:5e1f");
    kvt_config_free(&cfg);
    expect_bad("node:\n  model_fingerprint: \"a\\tb\"\n", NULL, 0, 0,
               WANT(at_line(2), "node.model_fingerprint", "control character"));
    {
        char big[300], set[340];

        memset(big, 'x', sizeof(big) - 1);
        big[sizeof(big) - 1] = '\0';
        snprintf(set, sizeof(set), "node.model_fingerprint=%s", big);
        expect_bad(NULL, (char *[]){set}, 1, 0, WANT("node.model_fingerprint", "longer than 255"));
    }
}

static void test_malformed_yaml(void **state)
{
    (void)state;
    expect_bad("primary:\n  size: [1GiB\nlog:\n  level: info\n", NULL, 0, 0,
               WANT("config ", "YAML syntax error"));
    expect_bad("primary:\n  size: 1GiB\n   workers: 2\n", NULL, 0, 0,
               WANT(at_line(3), "YAML syntax error"));
    expect_bad("primary:\n\tsize: 1GiB\n", NULL, 0, 0, WANT(at_line(2), "YAML syntax error"));
    expect_bad("log: {level: info}\n---\nlog: {level: debug}\n", NULL, 0, 0,
               WANT(at_line(2), "second YAML document"));
    expect_bad("log:\n  level: \"\xff\xfe\"\n", NULL, 0, 0, WANT("config ", "offset"));
    /* an error at the end of a last line without a line break is on that line, not the
     * next (libyaml counts one more; found by fuzz_config: corpus/config/end-no-break) */
    expect_bad("log:\n  level: info\nlog.level", NULL, 0, 0, WANT(at_line(3), "YAML syntax error"));
}

static void test_duplicate_key(void **state)
{
    (void)state;
    expect_bad("primary:\n  size: 1GiB\n  size: 2GiB\n", NULL, 0, 0,
               WANT(at_line(3), "primary.size", "duplicate key (first on line 2)"));
    expect_bad("log: {level: info}\nprimary: {size: 1GiB}\nlog: {level: warn}\n", NULL, 0, 0,
               WANT(at_line(3), "log", "duplicate key (first on line 1)"));
    expect_bad("primary.size: 1GiB\nprimary:\n  size: 2GiB\n", NULL, 0, 0,
               WANT(at_line(3), "primary.size", "set twice in the file (first on line 1)"));
}

/* An error is one line: a value or an argument with a line break is quoted with its
 * control characters escaped (found by fuzz_config: corpus/config/block-scalar and
 * set-newline), so no value can add a line of its own to the daemon's log. */
static void test_error_one_line(void **state)
{
    char *set_nl[] = {"node.namespace=a\nkvtierd: ready"};

    (void)state;
    expect_bad("node:\n  namespace: |\n    abc\n", NULL, 0, 0,
               WANT(at_line(2), "node.namespace", "\"abc\\x0a\" may hold only"));
    expect_bad(NULL, set_nl, 1, 0,
               WANT("option --set node.namespace=a\\x0akvtierd: ready: node.namespace: "
                    "\"a\\x0akvtierd: ready\" may hold only"));
}

/* The same for the config file's path (the command line's): a file that cannot be
 * read, or is a folder, is named with its control characters escaped. */
static void test_path_error_one_line(void **state)
{
    char path[700], dir[700], err[1024];
    struct kvt_config cfg;

    (void)state;
    snprintf(path, sizeof(path), "%s/absent\nkvtierd: ready.yaml", fx.dir);
    assert_int_equal(kvt_config_load(&cfg, path, NULL, 0, err, sizeof(err)), -ENOENT);
    assert_null(strchr(err, '\n'));
    assert_non_null(strstr(err, "absent\\x0akvtierd: ready.yaml: "));
    snprintf(dir, sizeof(dir), "%s/a\nfolder", fx.dir);
    assert_int_equal(mkdir(dir, 0700), 0);
    assert_int_equal(kvt_config_load(&cfg, dir, NULL, 0, err, sizeof(err)), -EISDIR);
    assert_null(strchr(err, '\n'));
    assert_non_null(strstr(err, "a\\x0afolder: "));
    assert_int_equal(rmdir(dir), 0);
}

/* A --set value is any bytes; one that is not UTF-8 text (which the file always is)
 * is refused: its dump would not load (found by fuzz_config: corpus/config/set-latin1). */
static void test_set_not_utf8(void **state)
{
    char *latin1[] = {"node.namespace=caf\xe9"};
    char *c1[] = {"engine.socket_group=a\xc2\x81"};
    char *overlong[] = {"primary.path=/tmp/\xc0\xaf"};

    (void)state;
    expect_bad(NULL, latin1, 1, 0, WANT("node.namespace: not UTF-8 text"));
    expect_bad(NULL, c1, 1, 0, WANT("engine.socket_group: not UTF-8 text"));
    expect_bad(NULL, overlong, 1, 0, WANT("primary.path: not UTF-8 text"));
}

static void test_bad_set(void **state)
{
    char *no_eq[] = {"primary.size"};
    char *empty_key[] = {"=5"};
    char *unknown[] = {"primary.sise=1GiB"};
    char *bad_num[] = {"log.level=info", "primary.workers=abc"};
    char *bad_peer[] = {"network.peers=a:1,b"};
    char *range[] = {"metrics.port=65536"};
    char *empty[] = {"network.listen="};

    (void)state;
    expect_bad(NULL, no_eq, 1, 0, WANT("option --set primary.size", "expected key=value"));
    expect_bad(NULL, empty_key, 1, 0, WANT("option --set =5", "expected key=value"));
    expect_bad(NULL, unknown, 1, 0,
               WANT("option --set primary.sise=1GiB: primary.sise: unknown key",
                    "did you mean primary.size"));
    expect_bad(NULL, bad_num, 2, 0,
               WANT("option --set primary.workers=abc: primary.workers", "not a number"));
    expect_bad(NULL, bad_peer, 1, 0,
               WANT("option --set network.peers=a:1,b", "network.peers", "\"b\" is not"));
    expect_bad(NULL, range, 1, 0, WANT("--set metrics.port=65536", "out of range"));
    expect_bad(NULL, empty, 1, 0, WANT("--set network.listen=", "needs a value"));
    /* A --set that causes a cross-key error is named rather than the file line. */
    {
        char *later[] = {"primary.workers=7"};

        expect_bad("primary:\n  row_bytes: 256KiB\n", later, 1, 0,
                   WANT("option --set primary.workers=7: primary.workers", "not a multiple"));
    }
}

static void test_unreadable_config(void **state)
{
    char err[1024], path[600];
    struct kvt_config cfg;

    (void)state;
    snprintf(path, sizeof(path), "%s/absent.yaml", fx.dir);
    assert_int_equal(kvt_config_load(&cfg, path, NULL, 0, err, sizeof(err)), -ENOENT);
    assert_non_null(strstr(err, path));
    assert_int_equal(kvt_config_load(&cfg, fx.dir, NULL, 0, err, sizeof(err)), -EISDIR);
    assert_non_null(strstr(err, fx.dir));
}

/* A "\0" escape in a quoted key, value or list item is refused with its line: read as
 * a C string it would silently end the text there. */
static void test_nul_in_scalar(void **state)
{
    (void)state;
    expect_bad("node:\n  namespace: \"prod\\0x\"\n", NULL, 0, 0,
               WANT(at_line(2), "node.namespace", "NUL"));
    expect_bad("log: {level: info}\n\"primary.size\\0zz\": 2GiB\n", NULL, 0, 0,
               WANT(at_line(2), "primary.size", "NUL"));
    expect_bad("network:\n  peers:\n    - \"a:1\\0junk\"\n", NULL, 0, 0,
               WANT(at_line(3), "network.peers", "NUL"));
}

/* Hex numbers take one "0x" prefix: strtoull would read a second one. */
static void test_hex_prefix_once(void **state)
{
    char *twice[] = {"node.id=0x0x10"};

    (void)state;
    expect_bad("node:\n  id: 0x0x10\n", NULL, 0, 0, WANT(at_line(2), "node.id", "not a number"));
    expect_bad(NULL, twice, 1, 0, WANT("--set node.id=0x0x10", "not a number"));
    expect_bad("primary:\n  workers: 0X0x2\n", NULL, 0, 0,
               WANT(at_line(2), "primary.workers", "not a number"));
}

/* A FIFO with no writer (a `<(...)` path read again at SIGHUP) neither blocks the load
 * for good in open() nor in read(): refused after the read deadline. */
static void test_fifo_without_writer(void **state)
{
    char err[1024], path[600];
    struct kvt_config cfg;
    uint64_t t0;

    (void)state;
    snprintf(path, sizeof(path), "%s/fifo.yaml", fx.dir);
    assert_int_equal(mkfifo(path, 0600), 0);
    alarm(30); /* without the deadline the load never returns: fail, don't hang */
    t0 = kvt_now_ns();
    assert_int_equal(kvt_config_load(&cfg, path, NULL, 0, err, sizeof(err)), -ETIMEDOUT);
    alarm(0);
    assert_true(kvt_now_ns() - t0 < 20 * 1000000000ull);
    assert_non_null(strstr(err, path));
    unlink(path);
}

static char *dump_text(const struct kvt_config *cfg)
{
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);

    assert_non_null(f);
    kvt_config_dump(f, cfg);
    fclose(f);
    return buf;
}

static void test_dump_round_trip(void **state)
{
    char *sets[] = {"primary.size=3GiB",      "network.peers=h1:1,[::1]:2", fx.set_secret,
                    "node.namespace=ns.1",    "tiers=network,storage",      "log.level=error",
                    "storage.capacity=12345", "primary.policy=arc"};
    struct kvt_config a, b;
    struct kvt_config_diff d;
    char err[512], *text, *text2;

    (void)state;
    assert_int_equal(kvt_config_load(&a, NULL, sets, KVT_ARRAY_SIZE(sets), err, sizeof(err)), 0);
    text = dump_text(&a);
    assert_non_null(strstr(text, "primary:\n"));
    assert_non_null(strstr(text, "  size: 3GiB\n"));
    write_file(fx.conf, text, 0644);
    assert_int_equal(kvt_config_load(&b, fx.conf, NULL, 0, err, sizeof(err)), 0);
    text2 = dump_text(&b);
    assert_string_equal(text, text2);
    assert_true(kvt_config_diff_reloadable(&a, &b, &d));
    assert_int_equal(d.n_changed, 0);
    assert_int_equal(b.tiers[0], KVT_TIER_NETWORK);
    assert_int_equal(b.n_network_peers, 2);
    assert_int_equal(b.storage_capacity, 12345);
    free(text);
    free(text2);
    kvt_config_free(&a);
    kvt_config_free(&b);
}

/* A value holding YAML's line breaks beyond ASCII (NEL, LS, PS) dumps to a file that
 * loads back to the same value: a quoted scalar folds a raw one into a space (found by
 * fuzz_config: corpus/config/set-nel). */
static void test_dump_unicode_line_breaks(void **state)
{
    char set[700], *sets[] = {fx.set_region, fx.set_storage, set}, err[512], *text, *text2;
    char want[600];
    struct kvt_config a, b;

    (void)state;
    snprintf(want, sizeof(want),
             "%s/a\xc2\x85"
             "b\xe2\x80\xa8"
             "c\xe2\x80\xa9"
             "d",
             fx.dir);
    snprintf(set, sizeof(set), "engine.socket=%s", want);
    assert_int_equal(kvt_config_load(&a, NULL, sets, KVT_ARRAY_SIZE(sets), err, sizeof(err)), 0);
    assert_string_equal(a.engine_socket, want);
    text = dump_text(&a);
    assert_non_null(strstr(text, "/a\\Nb\\Lc\\Pd\""));
    write_file(fx.conf, text, 0644);
    assert_int_equal(kvt_config_load(&b, fx.conf, NULL, 0, err, sizeof(err)), 0);
    assert_string_equal(b.engine_socket, want);
    text2 = dump_text(&b);
    assert_string_equal(text, text2);
    free(text);
    free(text2);
    kvt_config_free(&a);
    kvt_config_free(&b);
}

static void test_help(void **state)
{
    static const char *const every[] = {"node.id",
                                        "node.namespace",
                                        "node.group",
                                        "node.model_fingerprint",
                                        "primary.path",
                                        "primary.size",
                                        "primary.row_bytes",
                                        "primary.workers",
                                        "primary.policy",
                                        "storage.enabled",
                                        "storage.root",
                                        "storage.capacity",
                                        "storage.high_water_us",
                                        "storage.low_water_us",
                                        "network.enabled",
                                        "network.transport",
                                        "network.listen",
                                        "network.port",
                                        "network.peers",
                                        "network.lease_ms",
                                        "network.fetch_timeout_ms",
                                        "network.locate_timeout_ms",
                                        "network.heartbeat_ms",
                                        "network.heartbeat_misses",
                                        "cluster.secret_file",
                                        "engine.socket",
                                        "metrics.listen",
                                        "metrics.port",
                                        "log.level",
                                        "tiers"};
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);

    (void)state;
    assert_non_null(f);
    kvt_config_print_help(f);
    fclose(f);
    for (size_t i = 0; i < KVT_ARRAY_SIZE(every); i++) {
        char needle[80];

        snprintf(needle, sizeof(needle), "  %s ", every[i]);
        if (strstr(buf, needle) == NULL)
            fail_msg("--help lacks %s", every[i]);
    }
    assert_non_null(strstr(buf, "ucx|verbs"));
    assert_non_null(strstr(buf, "[reloadable]"));
    assert_non_null(strstr(buf, "1GiB"));
    /* Columns hold for the longest key, the header comes once, help wraps at 80. */
    assert_null(strstr(strstr(buf, "Configuration keys") + 1, "Configuration keys"));
    for (const char *line = buf; *line != '\0';) {
        size_t n = strcspn(line, "\n");

        if (n > 80 && line[0] == ' ' && line[2] == ' ')
            fail_msg("help line over 80 columns: %.*s", (int)n, line);
        line += n + (line[n] == '\n');
    }
    free(buf);
}

static void test_reload(void **state)
{
    char text[1024], err[512], *before, *after;
    struct kvt_config running;
    struct kvt_config_diff d;
    char *sets[] = {fx.set_secret};

    (void)state;
    write_file(fx.conf, "node: {id: 5}\nlog: {level: info}\n", 0644);
    assert_int_equal(kvt_config_load(&running, fx.conf, sets, 1, err, sizeof(err)), 0);

    /* No change. */
    assert_int_equal(kvt_config_reload(&running, fx.conf, sets, 1, &d, err, sizeof(err)), 0);
    assert_int_equal(d.n_changed, 0);
    assert_true(d.reloadable);

    /* Reloadable keys: applied, listed in table order. */
    snprintf(text, sizeof(text),
             "node: {id: 5}\nnetwork: {peers: [\"10.1.1.1:7170\"]}\nlog: {level: debug}\n");
    write_file(fx.conf, text, 0644);
    assert_int_equal(kvt_config_reload(&running, fx.conf, sets, 1, &d, err, sizeof(err)), 0);
    assert_true(d.reloadable);
    assert_null(d.first_fixed);
    assert_int_equal(d.n_changed, 2);
    assert_string_equal(d.changed[0], "network.peers");
    assert_string_equal(d.changed[1], "log.level");
    assert_int_equal(running.log_level, KVT_LOG_DEBUG);
    assert_int_equal(running.n_network_peers, 1);

    /* A fixed key among reloadable ones: refused as a whole, old config kept. */
    before = dump_text(&running);
    write_file(fx.conf, "node: {id: 5}\nprimary: {size: 2GiB}\nlog: {level: warn}\n", 0644);
    assert_int_equal(kvt_config_reload(&running, fx.conf, sets, 1, &d, err, sizeof(err)), -EPERM);
    assert_false(d.reloadable);
    assert_string_equal(d.first_fixed, "primary.size");
    assert_non_null(strstr(err, "primary.size"));
    assert_non_null(strstr(err, "cannot change at run time"));
    after = dump_text(&running);
    assert_string_equal(before, after);
    free(after);

    /* A bad file: the load error, old config kept. */
    write_file(fx.conf, "node: {id: 5}\nlog: {level: loud}\n", 0644);
    assert_int_equal(kvt_config_reload(&running, fx.conf, sets, 1, &d, err, sizeof(err)), -EINVAL);
    assert_non_null(strstr(err, "log.level"));
    assert_non_null(strstr(err, ":2: "));
    after = dump_text(&running);
    assert_string_equal(before, after);
    free(after);
    free(before);

    assert_true(kvt_config_key_reloadable("log.level"));
    assert_true(kvt_config_key_reloadable("network.peers"));
    assert_false(kvt_config_key_reloadable("primary.size"));
    assert_false(kvt_config_key_reloadable("cluster.secret_file"));
    assert_false(kvt_config_key_reloadable("no.such"));
    kvt_config_free(&running);
}

/* Every allocation failure unwinds with -ENOMEM and leaks nothing (ASan checks). */
static void test_out_of_memory(void **state)
{
    char *sets[] = {"network.peers=a:1,b:2", fx.set_secret, "node.namespace=x"};
    struct kvt_config cfg;
    char err[512];
    int rc = -ENOMEM;
    long n;

    (void)state;
    write_file(fx.conf, "primary:\n  path: /dev/shm/x-{id}\n  size: 1GiB\ntiers: [storage]\n",
               0644);
    for (n = 0; n < 10000 && rc == -ENOMEM; n++) {
        kvt_alloc_fail_after(n);
        rc = kvt_config_load(&cfg, fx.conf, sets, 3, err, sizeof(err));
        kvt_alloc_fail_after(-1);
        if (rc == -ENOMEM)
            assert_non_null(strstr(err, "out of memory"));
    }
    if (rc != 0)
        fail_msg("after %ld allocations: %d, %s", n, rc, err);
    assert_true(n > 3);
    kvt_config_free(&cfg);
}

/* Nesting: refused at the line where it gets deeper than KVT_CONFIG_DEPTH_MAX, and
 * quickly, however deep the file goes (100,000 '[' took minutes in libyaml). */
static void test_deep_nesting_refused_quickly(void **state)
{
    char *text;
    size_t n = 100000;
    uint64_t t0;

    (void)state;
    text = malloc(n + 64);
    assert_non_null(text);
    /* Flow style: 100,000 '[' on line 3. */
    strcpy(text, "log:\n  level: info\nprimary: ");
    memset(text + strlen(text), '[', n);
    strcpy(text + strlen("log:\n  level: info\nprimary: ") + n, "\n");
    t0 = kvt_now_ns();
    expect_bad(text, NULL, 0, 0, WANT(at_line(3), "nested deeper than 16 levels"));
    print_message("100000 '[' refused in %.3f s\n", (double)(kvt_now_ns() - t0) / 1e9);
    assert_true(kvt_now_ns() - t0 < 2000000000ull);
    /* '{' too. */
    memset(text, '{', n);
    strcpy(text + n, "\n");
    t0 = kvt_now_ns();
    expect_bad(text, NULL, 0, 0, WANT(at_line(1), "nested deeper"));
    assert_true(kvt_now_ns() - t0 < 2000000000ull);
    free(text);

    /* Block style: one level per line; the 17th level is on line 17. */
    text = malloc(64 * 1024);
    assert_non_null(text);
    text[0] = '\0';
    for (int i = 0; i < 40; i++)
        sprintf(text + strlen(text), "%*sk%d:\n", 2 * i, "", i);
    sprintf(text + strlen(text), "%*sv\n", 80, "");
    expect_bad(text, NULL, 0, 0, WANT(at_line(17), "nested deeper"));
    /* 16 levels are read (and refused for what they hold, not for depth); 17 are not. */
    for (int depth = 16; depth <= 17; depth++) {
        text[0] = '\0';
        for (int i = 0; i < depth; i++)
            strcat(text, "[");
        strcat(text, "1");
        for (int i = 0; i < depth; i++)
            strcat(text, "]");
        strcat(text, "\n");
        expect_bad(text, NULL, 0, 0,
                   WANT(at_line(1), depth == 16 ? "mapping of keys" : "nested deeper"));
    }
    free(text);
}

/* A file over KVT_CONFIG_FILE_MAX bytes is refused without parsing it. */
static void test_huge_file_refused(void **state)
{
    size_t n = KVT_CONFIG_FILE_MAX + 1;
    char *text = malloc(n + 1);

    (void)state;
    assert_non_null(text);
    memset(text, '#', n);
    text[n] = '\0';
    expect_bad(text, NULL, 0, 0, WANT("larger than 16 MiB"));
    free(text);
}

static void test_engine_and_metrics_keys(void **state)
{
    struct kvt_config cfg;
    char text[1024], err[512], gid[32], *sets[] = {fx.set_region, fx.set_storage, fx.set_sock};

    (void)state;
    assert_int_equal(kvt_config_defaults(&cfg), 0);
    assert_int_equal(cfg.engine_socket_mode, 0660);
    assert_null(cfg.engine_socket_group);
    assert_int_equal(cfg.engine_hello_timeout_ms, 5000);
    assert_int_equal(cfg.engine_max_requests, 4096);
    assert_int_equal(cfg.engine_max_params_bytes, 64 * 1024);
    assert_int_equal(cfg.engine_max_client_params, 4 << 20);
    assert_int_equal(cfg.engine_max_output_bytes, 1 << 20);
    assert_int_equal(cfg.engine_max_event_keys, 65536);
    assert_int_equal(cfg.metrics_max_connections, 16);
    assert_int_equal(cfg.metrics_read_timeout_ms, 5000);
    assert_int_equal(cfg.metrics_write_timeout_ms, 10000);
    kvt_config_free(&cfg);

    snprintf(gid, sizeof(gid), "%u", (unsigned)getgid());
    snprintf(text, sizeof(text),
             "engine:\n  socket_mode: 0600\n  socket_group: %s\n  hello_timeout_ms: 250\n"
             "  max_requests: 8\n  max_params_bytes: 1KiB\n  max_client_params: 4KiB\n"
             "  max_output_bytes: 64KiB\n  max_event_keys: 100\n"
             "metrics:\n  max_connections: 4\n  read_timeout_ms: 300\n  write_timeout_ms: 400\n",
             gid);
    write_file(fx.conf, text, 0644);
    assert_int_equal(kvt_config_load(&cfg, fx.conf, sets, 3, err, sizeof(err)), 0);
    assert_int_equal(cfg.engine_socket_mode, 0600);
    assert_string_equal(cfg.engine_socket_group, gid);
    assert_int_equal(cfg.engine_hello_timeout_ms, 250);
    assert_int_equal(cfg.engine_max_requests, 8);
    assert_int_equal(cfg.engine_max_params_bytes, 1024);
    assert_int_equal(cfg.engine_max_client_params, 4096);
    assert_int_equal(cfg.engine_max_output_bytes, 65536);
    assert_int_equal(cfg.engine_max_event_keys, 100);
    assert_int_equal(cfg.metrics_max_connections, 4);
    assert_int_equal(cfg.metrics_read_timeout_ms, 300);
    assert_int_equal(cfg.metrics_write_timeout_ms, 400);
    kvt_config_free(&cfg);

    expect_bad("engine:\n  socket_mode: 0999\n", NULL, 0, 0,
               WANT(at_line(2), "engine.socket_mode", "not an octal mode"));
    expect_bad("engine:\n  socket_mode: 0440\n", NULL, 0, 0,
               WANT(at_line(2), "engine.socket_mode", "owner must keep read and write"));
    expect_bad("engine:\n  socket_mode: 01660\n", NULL, 0, 0,
               WANT(at_line(2), "engine.socket_mode"));
    expect_bad("\nengine:\n  socket_group: no-such-group-kvtier\n", NULL, 0, 0,
               WANT(at_line(3), "engine.socket_group", "not a group of this host"));
    expect_bad("engine:\n  hello_timeout_ms: 0\n", NULL, 0, 0,
               WANT(at_line(2), "engine.hello_timeout_ms", "out of range"));
    expect_bad("engine:\n  max_params_bytes: 2MiB\n", NULL, 0, 0,
               WANT(at_line(2), "engine.max_params_bytes", "out of range"));
    expect_bad("metrics:\n  max_connections: 0\n", NULL, 0, 0,
               WANT(at_line(2), "metrics.max_connections", "out of range"));
    char *bad_set[] = {"engine.socket_mode=rw"};
    expect_bad(NULL, bad_set, 1, 0, WANT("option --set engine.socket_mode=rw"));
}

/* The engines' shared-memory rings: size each way (0 = none) and the loop's spin. */
static void test_engine_ring_keys(void **state)
{
    struct kvt_config cfg;
    char err[512], *sets[] = {fx.set_region, fx.set_storage, fx.set_sock, "engine.ring_bytes=1MiB",
                              "engine.ring_spin_us=0"};

    (void)state;
    assert_int_equal(kvt_config_defaults(&cfg), 0);
    assert_int_equal(cfg.engine_ring_bytes, 256 * 1024);
    assert_int_equal(cfg.engine_ring_spin_us, 100);
    kvt_config_free(&cfg);
    assert_int_equal(kvt_config_load(&cfg, NULL, sets, 5, err, sizeof(err)), 0);
    assert_int_equal(cfg.engine_ring_bytes, 1 << 20);
    assert_int_equal(cfg.engine_ring_spin_us, 0);
    kvt_config_free(&cfg);
    expect_bad("engine:\n  ring_bytes: 65MiB\n", NULL, 0, 0,
               WANT(at_line(2), "engine.ring_bytes", "out of range"));
    expect_bad("engine:\n  ring_spin_us: 1000001\n", NULL, 0, 0,
               WANT(at_line(2), "engine.ring_spin_us", "out of range"));
    expect_bad("engine:\n  ring_spin_us: -1\n", NULL, 0, 0,
               WANT(at_line(2), "engine.ring_spin_us"));
}

/* The network tier's fetch shape: defaults as the tier's own, file values, ranges. */
static void test_network_fetch_keys(void **state)
{
    struct kvt_config cfg;
    char err[512], *sets[] = {fx.set_region, fx.set_storage, fx.set_sock};

    (void)state;
    assert_int_equal(kvt_config_defaults(&cfg), 0);
    assert_int_equal(cfg.network_keys_per_fetch, 64);
    assert_int_equal(cfg.network_fetches_per_peer, 4);
    assert_int_equal(cfg.network_reads_per_batch, 8);
    assert_int_equal(cfg.network_max_unauthenticated, 64);
    assert_int_equal(cfg.network_max_records_per_peer, 0);
    assert_int_equal(cfg.network_serve_per_peer, 4096);
    kvt_config_free(&cfg);
    write_file(fx.conf,
               "network:\n  keys_per_fetch: 256\n  fetches_per_peer: 2\n  reads_per_batch: 32\n",
               0644);
    assert_int_equal(kvt_config_load(&cfg, fx.conf, sets, 3, err, sizeof(err)), 0);
    assert_int_equal(cfg.network_keys_per_fetch, 256);
    assert_int_equal(cfg.network_fetches_per_peer, 2);
    assert_int_equal(cfg.network_reads_per_batch, 32);
    kvt_config_free(&cfg);
    expect_bad("network:\n  keys_per_fetch: 257\n", NULL, 0, 0,
               WANT(at_line(2), "network.keys_per_fetch"));
    expect_bad("network:\n  reads_per_batch: 0\n", NULL, 0, 0,
               WANT(at_line(2), "network.reads_per_batch"));
    expect_bad("network:\n  fetches_per_peer: 0\n", NULL, 0, 0,
               WANT(at_line(2), "network.fetches_per_peer"));
    expect_bad("network:\n  max_unauthenticated: 0\n", NULL, 0, 0,
               WANT(at_line(2), "network.max_unauthenticated", "out of range"));
}

/* network.verify: fence by default, checksum on request, anything else refused with
 * the key, its line and the names it takes; a dump says what was set. */
static void test_network_verify(void **state)
{
    struct kvt_config cfg;
    char err[512], *sets[] = {fx.set_region, fx.set_storage, fx.set_sock};
    char *sets4[] = {fx.set_region, fx.set_storage, fx.set_sock, "network.verify=fence"};

    (void)state;
    assert_int_equal(kvt_config_defaults(&cfg), 0);
    assert_int_equal(cfg.network_verify, KVT_VERIFY_FENCE);
    kvt_config_free(&cfg);
    write_file(fx.conf, "network:\n  verify: checksum\n", 0644);
    assert_int_equal(kvt_config_load(&cfg, fx.conf, sets, 3, err, sizeof(err)), 0);
    assert_int_equal(cfg.network_verify, KVT_VERIFY_CHECKSUM);
    assert_string_equal(kvt_verify_kind_name(cfg.network_verify), "checksum");
    kvt_config_free(&cfg);
    /* --set wins over the file. */
    assert_int_equal(kvt_config_load(&cfg, fx.conf, sets4, 4, err, sizeof(err)), 0);
    assert_int_equal(cfg.network_verify, KVT_VERIFY_FENCE);
    assert_string_equal(kvt_verify_kind_name(cfg.network_verify), "fence");
    kvt_config_free(&cfg);
    assert_string_equal(kvt_verify_kind_name((enum kvt_verify_kind)7), "?");
    expect_bad("network:\n  verify: xxh3\n", NULL, 0, 0,
               WANT(at_line(2), "network.verify", "fence|checksum"));
    expect_bad("network:\n  verify: [fence]\n", NULL, 0, 0, WANT(at_line(2), "network.verify"));
}

/* network.fetch: lease by default, direct on request, anything else refused with the
 * key, its line and the names it takes. */
static void test_network_fetch(void **state)
{
    struct kvt_config cfg;
    char err[512], *sets[] = {fx.set_region, fx.set_storage, fx.set_sock};
    char *sets4[] = {fx.set_region, fx.set_storage, fx.set_sock, "network.fetch=lease"};

    (void)state;
    assert_int_equal(kvt_config_defaults(&cfg), 0);
    assert_int_equal(cfg.network_fetch, KVT_FETCH_LEASE);
    kvt_config_free(&cfg);
    write_file(fx.conf, "network:\n  fetch: direct\n", 0644);
    assert_int_equal(kvt_config_load(&cfg, fx.conf, sets, 3, err, sizeof(err)), 0);
    assert_int_equal(cfg.network_fetch, KVT_FETCH_DIRECT);
    assert_string_equal(kvt_fetch_kind_name(cfg.network_fetch), "direct");
    kvt_config_free(&cfg);
    assert_int_equal(kvt_config_load(&cfg, fx.conf, sets4, 4, err, sizeof(err)), 0);
    assert_int_equal(cfg.network_fetch, KVT_FETCH_LEASE);
    assert_string_equal(kvt_fetch_kind_name(cfg.network_fetch), "lease");
    kvt_config_free(&cfg);
    assert_string_equal(kvt_fetch_kind_name((enum kvt_fetch_kind)7), "?");
    expect_bad("network:\n  fetch: rdma\n", NULL, 0, 0,
               WANT(at_line(2), "network.fetch", "lease|direct"));
    expect_bad("network:\n  fetch: [direct]\n", NULL, 0, 0, WANT(at_line(2), "network.fetch"));
}

/* network.advertise: what peers are told; a wildcard listen address needs one, and an
 * advertised wildcard is refused, each naming the key and its line. */
static void test_network_advertise(void **state)
{
    struct kvt_config cfg;
    char err[512], *sets[] = {fx.set_region, fx.set_storage, fx.set_sock};

    (void)state;
    assert_int_equal(kvt_config_defaults(&cfg), 0);
    assert_null(cfg.network_advertise);
    kvt_config_free(&cfg);
    write_file(fx.conf, "network:\n  listen: 0.0.0.0\n  advertise: 10.1.2.3\n", 0644);
    assert_int_equal(kvt_config_load(&cfg, fx.conf, sets, 3, err, sizeof(err)), 0);
    assert_string_equal(cfg.network_listen, "0.0.0.0");
    assert_string_equal(cfg.network_advertise, "10.1.2.3");
    kvt_config_free(&cfg);
    write_file(fx.conf, "network:\n  listen: \"::\"\n  advertise: \"fd00::5\"\n", 0644);
    assert_int_equal(kvt_config_load(&cfg, fx.conf, sets, 3, err, sizeof(err)), 0);
    assert_string_equal(cfg.network_advertise, "fd00::5");
    kvt_config_free(&cfg);
    expect_bad("network:\n  port: 7170\n  listen: 0.0.0.0\n", NULL, 0, 0,
               WANT(at_line(3), "network.listen", "network.advertise"));
    expect_bad("network:\n  listen: \"::\"\n", NULL, 0, 0,
               WANT(at_line(2), "network.listen", "every address"));
    expect_bad("network:\n  listen: \"::1\"\n  advertise: \"0:0::0\"\n", NULL, 0, 0,
               WANT(at_line(3), "network.advertise", "wildcard"));
    expect_bad("network:\n  advertise: \"a b\"\n", NULL, 0, 0,
               WANT(at_line(2), "network.advertise", "not a host name"));
    /* Without a network tier, nothing is advertised: a wildcard is fine. */
    write_file(fx.conf, "network:\n  enabled: false\n  listen: 0.0.0.0\n", 0644);
    assert_int_equal(kvt_config_load(&cfg, fx.conf, sets, 3, err, sizeof(err)), 0);
    kvt_config_free(&cfg);
}

/* A copy owns its strings and peer list: equal by dump, unchanged when the original
 * goes; out of memory at any allocation fails whole and leaks nothing (the test
 * allocator and ASan). */
static void test_copy(void **state)
{
    char *sets[] = {"network.peers=a:1,b:2,[::1]:3",
                    fx.set_secret,
                    "node.namespace=ns-x",
                    "node.group=0",
                    fx.set_region,
                    fx.set_storage,
                    fx.set_sock};
    struct kvt_config a, b, c;
    char err[512], *ta, *tb;
    int rc = -ENOMEM;
    long n;

    (void)state;
    assert_int_equal(kvt_config_load(&a, NULL, sets, KVT_ARRAY_SIZE(sets), err, sizeof(err)), 0);
    assert_int_equal(kvt_config_copy(&b, &a), 0);
    ta = dump_text(&a);
    tb = dump_text(&b);
    assert_string_equal(ta, tb);
    assert_true(b.network_peers != a.network_peers);
    assert_true(b.network_peers[2] != a.network_peers[2]);
    assert_true(b.node_namespace != a.node_namespace);
    kvt_config_free(&a);
    free(tb);
    tb = dump_text(&b);
    assert_string_equal(ta, tb); /* b stands alone */
    for (n = 0; n < 1000 && rc == -ENOMEM; n++) {
        memset(&c, 0xa5, sizeof(c));
        kvt_alloc_fail_after(n);
        rc = kvt_config_copy(&c, &b);
        kvt_alloc_fail_after(-1);
    }
    assert_int_equal(rc, 0);
    assert_true(n > 3); /* it did fail at the first allocations */
    free(ta);
    ta = dump_text(&c);
    assert_string_equal(ta, tb);
    free(ta);
    free(tb);
    kvt_config_free(&b);
    kvt_config_free(&c);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_engine_ring_keys, setup, teardown),
        cmocka_unit_test_setup_teardown(test_defaults_without_file, setup, teardown),
        cmocka_unit_test_setup_teardown(test_file_and_sets, setup, teardown),
        cmocka_unit_test_setup_teardown(test_unknown_key, setup, teardown),
        cmocka_unit_test_setup_teardown(test_wrong_type, setup, teardown),
        cmocka_unit_test_setup_teardown(test_out_of_range, setup, teardown),
        cmocka_unit_test_setup_teardown(test_bad_size_suffix, setup, teardown),
        cmocka_unit_test_setup_teardown(test_secret_file, setup, teardown),
        cmocka_unit_test_setup_teardown(test_node_group, setup, teardown),
        cmocka_unit_test_setup_teardown(test_model_fingerprint, setup, teardown),
        cmocka_unit_test_setup_teardown(test_malformed_yaml, setup, teardown),
        cmocka_unit_test_setup_teardown(test_duplicate_key, setup, teardown),
        cmocka_unit_test_setup_teardown(test_error_one_line, setup, teardown),
        cmocka_unit_test_setup_teardown(test_path_error_one_line, setup, teardown),
        cmocka_unit_test_setup_teardown(test_set_not_utf8, setup, teardown),
        cmocka_unit_test_setup_teardown(test_bad_set, setup, teardown),
        cmocka_unit_test_setup_teardown(test_unreadable_config, setup, teardown),
        cmocka_unit_test_setup_teardown(test_nul_in_scalar, setup, teardown),
        cmocka_unit_test_setup_teardown(test_hex_prefix_once, setup, teardown),
        cmocka_unit_test_setup_teardown(test_fifo_without_writer, setup, teardown),
        cmocka_unit_test_setup_teardown(test_dump_round_trip, setup, teardown),
        cmocka_unit_test_setup_teardown(test_dump_unicode_line_breaks, setup, teardown),
        cmocka_unit_test_setup_teardown(test_help, setup, teardown),
        cmocka_unit_test_setup_teardown(test_reload, setup, teardown),
        cmocka_unit_test_setup_teardown(test_out_of_memory, setup, teardown),
        cmocka_unit_test_setup_teardown(test_deep_nesting_refused_quickly, setup, teardown),
        cmocka_unit_test_setup_teardown(test_huge_file_refused, setup, teardown),
        cmocka_unit_test_setup_teardown(test_engine_and_metrics_keys, setup, teardown),
        cmocka_unit_test_setup_teardown(test_network_advertise, setup, teardown),
        cmocka_unit_test_setup_teardown(test_network_fetch_keys, setup, teardown),
        cmocka_unit_test_setup_teardown(test_network_verify, setup, teardown),
        cmocka_unit_test_setup_teardown(test_network_fetch, setup, teardown),
        cmocka_unit_test_setup_teardown(test_copy, setup, teardown),
    };

    return cmocka_run_group_tests(tests, NULL, NULL);
}

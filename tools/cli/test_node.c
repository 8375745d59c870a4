/* The kvtier CLI and kvtier-load against a live engine API: a kvtierd started
 * here with a temporary socket, region and storage folder (mode kvtierd), or the
 * node tests' stand-in engine server while kvtierd is not built (mode standin).
 * status, put/get round trips by file and by pattern, lookup, stats, peers (no
 * cluster here: the network tier is off), reset (kvtierd: a restart after it serves
 * nothing stored before it, and what was stored after it from the storage tier), and
 * a 5-second kvtier-load that must end with 0 errors. The daemon is stopped with
 * SIGTERM and must exit 0.
 *
 *   test_cli_node kvtierd|standin SERVER KVTIER KVTIER_LOAD */
#include <errno.h>
#include <fcntl.h>
#include <setjmp.h>
#include <signal.h>
#include <spawn.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>
#include <jansson.h>

#include "tool_util.h"

extern char **environ;

static const char *mode, *server_bin, *kvtier_bin, *load_bin;
static char dir[256], sock[300];
static pid_t server_pid = -1;

/* Runs argv (NULL-terminated list), captures stdout+stderr into out. */
static int run_argv(char *out, size_t out_len, char *const *argv)
{
    int pfd[2], status;
    posix_spawn_file_actions_t fa;
    pid_t pid;
    size_t len = 0;
    ssize_t r;

    assert_int_equal(pipe(pfd), 0);
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, pfd[1], STDOUT_FILENO);
    posix_spawn_file_actions_adddup2(&fa, pfd[1], STDERR_FILENO);
    posix_spawn_file_actions_addclose(&fa, pfd[0]);
    assert_int_equal(posix_spawn(&pid, argv[0], &fa, NULL, argv, environ), 0);
    posix_spawn_file_actions_destroy(&fa);
    close(pfd[1]);
    while ((r = read(pfd[0], out + len, out_len - 1 - len)) > 0) {
        len += (size_t)r;
        if (len == out_len - 1) {
            char sink[4096];

            while (read(pfd[0], sink, sizeof(sink)) > 0)
                ;
            break;
        }
    }
    out[len] = '\0';
    close(pfd[0]);
    assert_int_equal(waitpid(pid, &status, 0), pid);
    assert_true(WIFEXITED(status));
    return WEXITSTATUS(status);
}

static int run(char *out, size_t out_len, const char *bin, ...)
{
    char *argv[40];
    int n = 0;
    va_list ap;

    argv[n++] = (char *)bin;
    va_start(ap, bin);
    while ((argv[n] = va_arg(ap, char *)) != NULL && n < 39)
        n++;
    va_end(ap);
    return run_argv(out, out_len, argv);
}

#define CHECK(want_rc, want_text, ...)                                                             \
    do {                                                                                           \
        static char out_[65536];                                                                   \
        int rc_ = run(out_, sizeof(out_), __VA_ARGS__, (char *)NULL);                              \
        if (rc_ != (want_rc) || strstr(out_, want_text) == NULL)                                   \
            fail_msg("exit %d (want %d), output:\n%s\n(want \"%s\")", rc_, want_rc, out_,          \
                     want_text);                                                                   \
    } while (0)

/* Serving: the engine API answers (a node that drains stops accepting engines). */
static bool ready(void)
{
    struct stat sb;
    struct kvtier_client *c = NULL;
    struct kvtier_connect_opts o = {.name = "cli-test-ready", .timeout_ms = 500};

    if (stat(sock, &sb) != 0 || !S_ISSOCK(sb.st_mode))
        return false;
    if (kvtier_connect(sock, &o, &c) != 0)
        return false;
    kvtier_close(c);
    return true;
}

/* Starts the server on dir's files (kept across restarts). */
static int spawn_server(void)
{
    char region[320], storage[320], logf[320];
    char set_sock[400], set_region[400], set_storage[400];
    posix_spawn_file_actions_t fa;
    char *argv[32];
    int n = 0;

    snprintf(sock, sizeof(sock), "%s/engine.sock", dir);
    snprintf(region, sizeof(region), "%s/run/region", dir);
    snprintf(storage, sizeof(storage), "%s/storage", dir);
    snprintf(logf, sizeof(logf), "%s/server.log", dir);
    argv[n++] = (char *)server_bin;
    if (strcmp(mode, "kvtierd") == 0) {
        snprintf(set_sock, sizeof(set_sock), "engine.socket=%s", sock);
        snprintf(set_region, sizeof(set_region), "primary.path=%s", region);
        snprintf(set_storage, sizeof(set_storage), "storage.root=%s", storage);
        char *sets[] = {set_sock,
                        set_region,
                        "primary.size=64MiB",
                        "primary.row_bytes=64KiB",
                        set_storage,
                        "storage.capacity=256MiB",
                        "network.enabled=false",
                        "metrics.port=0",
                        "node.id=7"};
        for (size_t i = 0; i < sizeof(sets) / sizeof(sets[0]); i++) {
            argv[n++] = "--set";
            argv[n++] = sets[i];
        }
    } else {
        argv[n++] = sock;
        argv[n++] = region;
        argv[n++] = "1024";
        argv[n++] = "65536";
        argv[n++] = "1";
    }
    argv[n] = NULL;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, STDOUT_FILENO, logf, O_WRONLY | O_CREAT | O_APPEND, 0644);
    posix_spawn_file_actions_adddup2(&fa, STDOUT_FILENO, STDERR_FILENO);
    if (posix_spawn(&server_pid, server_bin, &fa, NULL, argv, environ) != 0)
        return -1;
    posix_spawn_file_actions_destroy(&fa);
    for (int i = 0; i < 200 && !ready(); i++) {
        int status;

        if (waitpid(server_pid, &status, WNOHANG) == server_pid) {
            fprintf(stderr, "%s exited before it was ready (see %s)\n", server_bin, logf);
            server_pid = -1;
            return -1;
        }
        usleep(50000);
    }
    if (!ready()) {
        fprintf(stderr, "%s not ready after 10 s (see %s)\n", server_bin, logf);
        return -1;
    }
    return 0;
}

/* SIGTERM: it must exit 0 within 15 s. */
static int term_server(void)
{
    int status = -1;

    if (server_pid <= 0)
        return 0;
    kill(server_pid, SIGTERM);
    for (int i = 0; i < 150; i++) {
        if (waitpid(server_pid, &status, WNOHANG) == server_pid)
            break;
        usleep(100000);
        if (i == 149) {
            kill(server_pid, SIGKILL);
            waitpid(server_pid, &status, 0);
            fprintf(stderr, "server did not exit within 15 s of SIGTERM\n");
            server_pid = -1;
            return -1;
        }
    }
    server_pid = -1;
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        fprintf(stderr, "server exit status %d after SIGTERM (log in %s)\n", status, dir);
        return -1;
    }
    return 0;
}

static int start_server(void **state)
{
    char run[320];

    (void)state;
    snprintf(dir, sizeof(dir), "/tmp/kvtier-cli-test-XXXXXX");
    if (mkdtemp(dir) == NULL)
        return -1;
    /* The region's folder: kvtierd's own (a folder others may write is refused). */
    snprintf(run, sizeof(run), "%s/run", dir);
    if (mkdir(run, 0700) != 0)
        return -1;
    return spawn_server();
}

static int stop_server(void **state)
{
    char cmd[400];
    int rc;

    (void)state;
    rc = term_server();
    snprintf(cmd, sizeof(cmd), "rm -rf '%s'", dir);
    return system(cmd) == 0 && rc == 0 ? 0 : -1;
}

static void test_status(void **state)
{
    (void)state;
    CHECK(0, "health     ok", kvtier_bin, "status", "--socket", sock);
    CHECK(0, "region     1024 chunks x 64.0 KiB", kvtier_bin, "status", "--socket", sock);
    CHECK(0, "cluster    none", kvtier_bin, "status", "--socket", sock);
    if (strcmp(mode, "kvtierd") == 0) {
        CHECK(0, "model      (no fingerprint", kvtier_bin, "status", "--socket", sock);
        CHECK(0, "storage    ", kvtier_bin, "status", "--socket", sock);
        CHECK(0, "engines    1 attached", kvtier_bin, "status", "--socket", sock);
    }
}

static void test_put_get_file(void **state)
{
    char in[400], out[400];
    uint8_t data[5000], back[65536];
    FILE *f;
    size_t n;

    (void)state;
    snprintf(in, sizeof(in), "%s/in.bin", dir);
    snprintf(out, sizeof(out), "%s/out.bin", dir);
    kvt_tool_content_fill(99, data, sizeof(data));
    f = fopen(in, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(data, 1, sizeof(data), f), sizeof(data));
    fclose(f);
    CHECK(0, "stored in chunk", kvtier_bin, "put", "c0ffee01", "--file", in, "--socket", sock);
    CHECK(0, "already stored", kvtier_bin, "put", "c0ffee01", "--file", in, "--socket", sock);
    CHECK(0, "", kvtier_bin, "get", "c0ffee01", "--out", out, "--socket", sock);
    f = fopen(out, "rb");
    assert_non_null(f);
    n = fread(back, 1, sizeof(back), f);
    fclose(f);
    assert_true(n >= sizeof(data)); /* the whole row */
    assert_memory_equal(back, data, sizeof(data));
    for (size_t i = sizeof(data); i < n; i++)
        assert_int_equal(back[i], 0); /* zero-padded */
    CHECK(0, "c0ffee01 HIT", kvtier_bin, "lookup", "c0ffee01", "c0ffee02", "--socket", sock);
    CHECK(0, "c0ffee02 MISS", kvtier_bin, "lookup", "c0ffee01", "c0ffee02", "--socket", sock);
    CHECK(1, "not found", kvtier_bin, "get", "c0ffee02", "--socket", sock);
}

static void test_put_get_pattern(void **state)
{
    (void)state;
    CHECK(0, "stored in chunk", kvtier_bin, "put", "0badcafe", "--pattern", "12345", "--socket",
          sock);
    CHECK(0, "matches pattern 12345", kvtier_bin, "get", "0badcafe", "--pattern", "12345",
          "--socket", sock);
    CHECK(1, "differs from pattern 12346", kvtier_bin, "get", "0badcafe", "--pattern", "12346",
          "--socket", sock);
    CHECK(0, "vllm:kv_offload_tiering_chunk_queries", kvtier_bin, "stats", "--socket", sock);
    /* Totals since the node started: neither a second reader nor the node's own
     * once-a-second collection for /metrics takes them away. */
    usleep(1100 * 1000);
    CHECK(0, "vllm:kv_offload_tiering_chunk_queries", kvtier_bin, "stats", "--socket", sock);
}

/* stats --json is JSON (jansson parses it, every element named, with a value or a
 * count); the human forms print no exponents (1.3312e+06 bytes was unreadable). */
static void test_stats_forms(void **state)
{
    static char out[1 << 20];
    char *json_argv[] = {(char *)kvtier_bin, "stats", "--json", "--socket", sock, NULL};
    char *top_argv[] = {(char *)kvtier_bin,
                        "top",
                        "--iterations",
                        "2",
                        "--interval",
                        "0.2",
                        "--socket",
                        sock,
                        NULL};
    json_error_t err;
    json_t *arr;
    (void)state;

    CHECK(0, "stored in chunk", kvtier_bin, "put", "5eed0001", "--pattern", "7", "--socket", sock);
    assert_int_equal(run_argv(out, sizeof(out), json_argv), 0);
    arr = json_loads(out, 0, &err);
    if (arr == NULL)
        fail_msg("stats --json is not JSON (%s at line %d):\n%s", err.text, err.line, out);
    assert_true(json_is_array(arr) && json_array_size(arr) > 0);
    for (size_t i = 0; i < json_array_size(arr); i++) {
        json_t *o = json_array_get(arr, i);

        assert_true(json_is_string(json_object_get(o, "name")));
        assert_true(json_object_get(o, "value") != NULL || json_object_get(o, "count") != NULL);
    }
    json_decref(arr);
    CHECK(0, "vllm:kv_offload_tiering", kvtier_bin, "stats", "--socket", sock);
    assert_int_equal(run_argv(out, sizeof(out), top_argv), 0);
    assert_non_null(strstr(out, "kvtier top"));
    if (strstr(out, "e+") != NULL)
        fail_msg("top prints an exponent:\n%s", out);
}

static void test_peers(void **state)
{
    (void)state;
    CHECK(0, "(no cluster: the node's network tier is off)", kvtier_bin, "peers", "--socket", sock);
}

/* reset drops every chunk. With kvtierd: chunks that a restart serves from the
 * storage tier (so they are there) are served by none after a reset and another
 * restart, while what was stored after the reset comes back. A fresh daemon first,
 * so that no back-pressure left by the load test keeps the chunks from the storage
 * tier. */
static void test_reset_then_restart(void **state)
{
    bool daemon = strcmp(mode, "kvtierd") == 0;

    (void)state;
    if (daemon) {
        assert_int_equal(term_server(), 0);
        assert_int_equal(spawn_server(), 0);
    }
    CHECK(0, "stored in chunk", kvtier_bin, "put", "5e7a0001", "--pattern", "41", "--socket", sock);
    CHECK(0, "stored in chunk", kvtier_bin, "put", "5e7a0002", "--pattern", "42", "--socket", sock);
    if (daemon) {
        assert_int_equal(term_server(), 0); /* drains: both are in the storage tier */
        assert_int_equal(spawn_server(), 0);
    }
    CHECK(0, "matches pattern 41", kvtier_bin, "get", "5e7a0001", "--pattern", "41", "--socket",
          sock);
    CHECK(0, "node reset", kvtier_bin, "reset", "--socket", sock);
    CHECK(1, "not found", kvtier_bin, "get", "5e7a0001", "--socket", sock);
    CHECK(1, "not found", kvtier_bin, "get", "5e7a0002", "--socket", sock);
    CHECK(0, "stored in chunk", kvtier_bin, "put", "5e7a0003", "--pattern", "43", "--socket", sock);
    if (!daemon)
        return;
    CHECK(0, "1 resets", kvtier_bin, "status", "--socket", sock);
    assert_int_equal(term_server(), 0);
    assert_int_equal(spawn_server(), 0);
    CHECK(1, "not found", kvtier_bin, "get", "5e7a0001", "--socket", sock);
    CHECK(1, "not found", kvtier_bin, "get", "5e7a0002", "--socket", sock);
    CHECK(0, "matches pattern 43", kvtier_bin, "get", "5e7a0003", "--pattern", "43", "--socket",
          sock);
}

static void test_load(void **state)
{
    static char out[65536];
    char *argv[] = {(char *)load_bin, "--node",  sock, "--engines-per-node", "2", "--duration", "5",
                    "--json",         "--quiet", NULL};
    int rc = run_argv(out, sizeof(out), argv);
    const char *req = strstr(out, "\"requests\": ");

    if (rc != 0 || strstr(out, "\"errors\": 0}") == NULL || req == NULL)
        fail_msg("kvtier-load exit %d:\n%s", rc, out);
    assert_true(strtoull(req + 12, NULL, 10) > 0);
    assert_non_null(strstr(out, "\"verify_failures\": 0"));
    assert_null(strstr(out, "\"loaded_chunks\": 0,")); /* something was loaded and verified */
}

int main(int argc, char **argv)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_status),
        cmocka_unit_test(test_put_get_file),
        cmocka_unit_test(test_put_get_pattern),
        cmocka_unit_test(test_load),
        cmocka_unit_test(test_stats_forms),
        cmocka_unit_test(test_peers),
        cmocka_unit_test(test_reset_then_restart),
    };
    size_t n_tests = sizeof(tests) / sizeof(tests[0]);

    if (argc != 5 || (strcmp(argv[1], "kvtierd") && strcmp(argv[1], "standin"))) {
        fprintf(stderr, "usage: test_cli_node kvtierd|standin SERVER KVTIER KVTIER_LOAD\n");
        return 2;
    }
    mode = argv[1];
    server_bin = argv[2];
    kvtier_bin = argv[3];
    load_bin = argv[4];
    signal(SIGPIPE, SIG_IGN);
    return _cmocka_run_group_tests("cli_node", tests, n_tests, start_server, stop_server);
}

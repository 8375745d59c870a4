/* SPDX-License-Identifier: Apache-2.0 */
/* Tests of the kvtier CLI and kvtier-load that need no daemon: the shared helpers
 * (hex keys, chunk content, number and address parsers, the Prometheus text
 * parser) and the command lines of both tools (bad flags exit 2 with a message,
 * an absent daemon exits 1 with one).
 *
 *   test_cli KVTIER KVTIER_LOAD */
#include <errno.h>
#include <math.h>
#include <setjmp.h>
#include <spawn.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>

#include "tool_util.h"

extern char **environ;

static const char *kvtier_bin, *load_bin;
static const char *run_stdout = "/dev/null"; /* where run() sends the program's stdout */

/* Runs argv, returns its exit status and (the start of) its stderr. */
static int run(char *err, size_t err_len, const char *bin, ...)
{
    char *argv[32];
    int n = 0, pfd[2], status;
    posix_spawn_file_actions_t fa;
    va_list ap;
    pid_t pid;
    size_t len = 0;
    ssize_t r;

    argv[n++] = (char *)bin;
    va_start(ap, bin);
    while ((argv[n] = va_arg(ap, char *)) != NULL && n < 31)
        n++;
    va_end(ap);
    argv[n] = NULL;
    assert_int_equal(pipe(pfd), 0);
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, pfd[1], STDERR_FILENO);
    posix_spawn_file_actions_addopen(&fa, STDOUT_FILENO, run_stdout, 01, 0);
    posix_spawn_file_actions_addclose(&fa, pfd[0]);
    assert_int_equal(posix_spawn(&pid, bin, &fa, NULL, argv, environ), 0);
    posix_spawn_file_actions_destroy(&fa);
    close(pfd[1]);
    while ((r = read(pfd[0], err + len, err_len - 1 - len)) > 0 && len + (size_t)r < err_len - 1)
        len += (size_t)r;
    if (r > 0)
        len += (size_t)r;
    err[len] = '\0';
    close(pfd[0]);
    assert_int_equal(waitpid(pid, &status, 0), pid);
    assert_true(WIFEXITED(status));
    return WEXITSTATUS(status);
}

#define ASSERT_RUN(want_rc, want_msg, ...)                                                         \
    do {                                                                                           \
        char err_[4096];                                                                           \
        int rc_ = run(err_, sizeof(err_), __VA_ARGS__, (char *)NULL);                              \
        if (rc_ != (want_rc) || strstr(err_, want_msg) == NULL)                                    \
            fail_msg("exit %d (want %d), stderr: %s (want \"%s\")", rc_, want_rc, err_, want_msg); \
    } while (0)

static void test_parse_key(void **state)
{
    struct kvtier_key k;
    char hex[2 * KVTIER_KEY_MAX + 1];
    char long_hex[2 * KVTIER_KEY_MAX + 3];

    (void)state;
    assert_int_equal(kvt_tool_parse_key("00ff10Ab", &k), 0);
    assert_int_equal(k.len, 4);
    assert_int_equal(k.bytes[0], 0x00);
    assert_int_equal(k.bytes[1], 0xff);
    assert_int_equal(k.bytes[3], 0xab);
    kvt_tool_key_hex(&k, hex);
    assert_string_equal(hex, "00ff10ab");
    assert_int_equal(kvt_tool_parse_key("0x01", &k), 0);
    assert_int_equal(k.len, 1);
    assert_int_equal(kvt_tool_parse_key("", &k), -EINVAL);
    assert_int_equal(kvt_tool_parse_key("abc", &k), -EINVAL);
    assert_int_equal(kvt_tool_parse_key("zz", &k), -EINVAL);
    assert_int_equal(kvt_tool_parse_key("0x", &k), -EINVAL);
    memset(long_hex, 'a', 2 * KVTIER_KEY_MAX);
    long_hex[2 * KVTIER_KEY_MAX] = '\0';
    assert_int_equal(kvt_tool_parse_key(long_hex, &k), 0);
    assert_int_equal(k.len, KVTIER_KEY_MAX);
    strcat(long_hex, "aa");
    assert_int_equal(kvt_tool_parse_key(long_hex, &k), -EINVAL);
}

static void test_numbers(void **state)
{
    uint64_t v = 7;
    double d = 7;

    (void)state;
    assert_int_equal(kvt_tool_parse_u64("42", 0, 100, &v), 0);
    assert_int_equal(v, 42);
    assert_int_equal(kvt_tool_parse_u64("0x10", 0, 100, &v), 0);
    assert_int_equal(v, 16);
    assert_int_equal(kvt_tool_parse_u64("-1", 0, 100, &v), -EINVAL);
    assert_int_equal(kvt_tool_parse_u64("101", 0, 100, &v), -EINVAL);
    assert_int_equal(kvt_tool_parse_u64("4x", 0, 100, &v), -EINVAL);
    assert_int_equal(kvt_tool_parse_u64("", 0, 100, &v), -EINVAL);
    assert_int_equal(v, 16); /* unchanged on failure */
    assert_int_equal(kvt_tool_parse_double("1.5", 0, 2, &d), 0);
    assert_true(d == 1.5);
    assert_int_equal(kvt_tool_parse_double("nan", 0, 2, &d), -EINVAL);
    assert_int_equal(kvt_tool_parse_double("3", 0, 2, &d), -EINVAL);
    assert_int_equal(kvt_tool_parse_double("1e", 0, 2, &d), -EINVAL);
}

static void test_content(void **state)
{
    uint8_t a[1003], b[1003];

    (void)state;
    kvt_tool_content_fill(5, a, sizeof(a));
    kvt_tool_content_fill(5, b, sizeof(b));
    assert_memory_equal(a, b, sizeof(a));
    assert_int_equal(kvt_tool_content_check(5, a, sizeof(a)), sizeof(a));
    kvt_tool_content_fill(6, b, sizeof(b));
    assert_memory_not_equal(a, b, sizeof(a));
    assert_true(kvt_tool_content_check(6, a, sizeof(a)) < 8);
    a[517] ^= 1;
    assert_int_equal(kvt_tool_content_check(5, a, sizeof(a)), 517);
    a[517] ^= 1;
    a[1002] ^= 0x80; /* the tail past the last whole word */
    assert_int_equal(kvt_tool_content_check(5, a, sizeof(a)), 1002);
    /* a prefix of the content is the content of the shorter length */
    kvt_tool_content_fill(5, b, 100);
    assert_int_equal(kvt_tool_content_check(5, b, 100), 100);
}

static void test_cli_usage(void **state)
{
    (void)state;
    ASSERT_RUN(2, "missing command", kvtier_bin);
    ASSERT_RUN(2, "unknown command 'frobnicate'", kvtier_bin, "frobnicate");
    ASSERT_RUN(2, "unknown option '--bogus'", kvtier_bin, "status", "--bogus");
    ASSERT_RUN(2, "needs a value", kvtier_bin, "status", "--socket");
    ASSERT_RUN(2, "does not apply", kvtier_bin, "stats", "--file", "x");
    /* status and peers speak the engine API: no --metrics (no HTTP client) any more */
    ASSERT_RUN(2, "unknown option '--metrics'", kvtier_bin, "peers", "--metrics", "nowhere");
    ASSERT_RUN(2, "unexpected argument", kvtier_bin, "reset", "now");
    ASSERT_RUN(2, "does not apply", kvtier_bin, "reset", "--json");
    ASSERT_RUN(2, "missing KEYHEX", kvtier_bin, "lookup", "--socket", "/nonexistent");
    ASSERT_RUN(2, "bad key 'xyz'", kvtier_bin, "lookup", "xyz");
    ASSERT_RUN(2, "exactly one of --file", kvtier_bin, "put", "00");
    ASSERT_RUN(2, "exactly one of --file", kvtier_bin, "put", "00", "--file", "f", "--pattern",
               "1");
    ASSERT_RUN(2, "--pattern", kvtier_bin, "put", "00", "--pattern", "-3");
    ASSERT_RUN(2, "exactly one KEYHEX", kvtier_bin, "get", "00", "01");
    ASSERT_RUN(2, "--iterations", kvtier_bin, "top", "--iterations", "0");
    ASSERT_RUN(2, "unexpected argument", kvtier_bin, "status", "extra");
    ASSERT_RUN(0, "", kvtier_bin, "--help");
}

static void test_cli_no_daemon(void **state)
{
    (void)state;
    ASSERT_RUN(1, "cannot connect to /nonexistent/kvtier.sock", kvtier_bin, "status", "--socket",
               "/nonexistent/kvtier.sock");
    ASSERT_RUN(1, "cannot connect", kvtier_bin, "lookup", "--socket", "/nonexistent/s", "00ff");
    ASSERT_RUN(1, "cannot connect", kvtier_bin, "put", "--socket", "/nonexistent/s", "00ff",
               "--pattern", "1");
    ASSERT_RUN(1, "cannot connect to /nonexistent/s", kvtier_bin, "peers", "--socket",
               "/nonexistent/s");
    ASSERT_RUN(1, "cannot connect to /nonexistent/s", kvtier_bin, "reset", "--socket",
               "/nonexistent/s");
}

/* What kvtier prints must get out: a full standard output is a failure (exit 1, the
 * write error named), never a success with the text lost. */
static void test_cli_full_stdout(void **state)
{
    (void)state;
    run_stdout = "/dev/full";
    ASSERT_RUN(1, "standard output: write failed", kvtier_bin, "--version");
    ASSERT_RUN(1, "standard output: write failed", kvtier_bin, "--help");
    ASSERT_RUN(1, "standard output: write failed", kvtier_bin, "status", "--help");
    /* a failure keeps its own status */
    ASSERT_RUN(2, "unknown command", kvtier_bin, "bogus");
}

static int stdout_null(void **state)
{
    (void)state;
    run_stdout = "/dev/null";
    return 0;
}

static void test_load_usage(void **state)
{
    (void)state;
    ASSERT_RUN(2, "at least one --node", load_bin);
    ASSERT_RUN(2, "unknown option '--bogus'", load_bin, "--node", "/x", "--bogus");
    ASSERT_RUN(2, "--zipf", load_bin, "--node", "/x", "--zipf", "-1");
    ASSERT_RUN(2, "--duration", load_bin, "--node", "/x", "--duration", "0");
    ASSERT_RUN(2, "--engines-per-node", load_bin, "--node", "/x", "--engines-per-node", "0");
    ASSERT_RUN(2, "--blocks-per-prompt", load_bin, "--node", "/x", "--blocks-per-prompt", "x");
    ASSERT_RUN(2, "exceed --blocks-per-prompt", load_bin, "--node", "/x", "--system-blocks", "9",
               "--blocks-per-prompt", "8");
    ASSERT_RUN(2, "needs a value", load_bin, "--node");
    ASSERT_RUN(2, "unexpected argument", load_bin, "--node", "/x", "stray");
    ASSERT_RUN(0, "", load_bin, "--help");
    ASSERT_RUN(1, "cannot connect to /nonexistent/s", load_bin, "--node", "/nonexistent/s",
               "--duration", "1");
}

int main(int argc, char **argv)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_parse_key),
        cmocka_unit_test(test_numbers),
        cmocka_unit_test(test_content),
        cmocka_unit_test(test_cli_usage),
        cmocka_unit_test(test_cli_no_daemon),
        cmocka_unit_test_teardown(test_cli_full_stdout, stdout_null),
        cmocka_unit_test(test_load_usage),
    };

    if (argc != 3) {
        fprintf(stderr, "usage: test_cli KVTIER KVTIER_LOAD\n");
        return 2;
    }
    kvtier_bin = argv[1];
    load_bin = argv[2];
    return cmocka_run_group_tests(tests, NULL, NULL);
}

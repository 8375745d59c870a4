/* SPDX-License-Identifier: Apache-2.0 */
/* The log module's defences against strings from engines and peers: kvt_log_escape
 * (every byte printable, nothing ambiguous, bounded) and kvt_log_write (one event,
 * one line, whatever the arguments hold). */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "test_util.h"

#include "kvt/log.h"

static void test_escape(void **state)
{
    char buf[64];

    (void)state;
    assert_string_equal(kvt_log_escape(buf, sizeof(buf), "engine-1"), "engine-1");
    assert_string_equal(kvt_log_escape(buf, sizeof(buf), "a\nb\rc\td"), "a\\nb\\rc\\td");
    assert_string_equal(kvt_log_escape(buf, sizeof(buf), "back\\slash"), "back\\\\slash");
    assert_string_equal(kvt_log_escape(buf, sizeof(buf), "\x1b[2J\x07\x7f\xff"),
                        "\\x1b[2J\\x07\\x7f\\xff");
    assert_string_equal(kvt_log_escape(buf, sizeof(buf), NULL), "(null)");
    assert_string_equal(kvt_log_escape(buf, sizeof(buf), ""), "");
    /* Too long: cut at an escape's boundary, "..." says so, never past the buffer. */
    assert_string_equal(kvt_log_escape(buf, 10, "abcdefghijklmnop"), "abcdef...");
    assert_string_equal(kvt_log_escape(buf, 10, "abcdefghi"), "abcdefghi");
    assert_string_equal(kvt_log_escape(buf, 10, "abcde\nfghij"), "abcde...");
    assert_string_equal(kvt_log_escape(buf, 3, "abcdef"), "");
    for (size_t len = 1; len < 40; len++) {
        kvt_log_escape(buf, len, "\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n");
        assert_true(strlen(buf) < len);
        assert_null(strchr(buf, '\n'));
    }
    /* A 63-byte name of the worst bytes fits KVT_LOG_STR whole. */
    char name[64];
    memset(name, '\x01', 63);
    name[63] = '\0';
    assert_int_equal(strlen(KVT_LOG_STR(name)), 4 * 63);
}

/* A control byte in a logged string cannot start a line of its own. */
static void test_write_keeps_one_line(void **state)
{
    char path[] = "/tmp/kvt-test-log.XXXXXX", text[512] = "";
    int fd = mkstemp(path), saved = dup(2);
    ssize_t n;

    (void)state;
    assert_true(fd >= 0 && saved >= 0);
    fflush(stderr);
    dup2(fd, 2);
    kvt_log_write(KVT_LOG_ERROR, "test", "name %s end", "x\nerror test: forged\x1b[2J");
    fflush(stderr);
    dup2(saved, 2);
    close(saved);
    n = pread(fd, text, sizeof(text) - 1, 0);
    close(fd);
    unlink(path);
    assert_true(n > 0);
    /* "2026-12-06T13:50:01.123456Z " then the event. */
    assert_true(n > 28 && text[4] == '-' && text[10] == 'T' && text[26] == 'Z' && text[27] == ' ');
    assert_string_equal(text + 28, "error test: name x?error test: forged?[2J end\n");
}

/* With stderr on the journal (JOURNAL_STREAM names it), a line starts with its syslog
 * priority and carries no time of its own (in a child: its environment and stderr). */
static void test_write_to_journal(void **state)
{
    char path[] = "/tmp/kvt-test-log.XXXXXX", text[512] = "", env[64];
    int fd = mkstemp(path), status;
    struct stat st;
    pid_t pid;
    ssize_t n;

    (void)state;
    assert_true(fd >= 0 && fstat(fd, &st) == 0);
    pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        snprintf(env, sizeof(env), "%llu:%llu", (unsigned long long)st.st_dev,
                 (unsigned long long)st.st_ino);
        setenv("JOURNAL_STREAM", env, 1);
        dup2(fd, 2);
        kvt_log_write(KVT_LOG_ERROR, "test", "one");
        kvt_log_write(KVT_LOG_WARN, "test", "two");
        kvt_log_write(KVT_LOG_INFO, "test", "three");
        fflush(stderr);
        _exit(0);
    }
    assert_int_equal(waitpid(pid, &status, 0), pid);
    n = pread(fd, text, sizeof(text) - 1, 0);
    close(fd);
    unlink(path);
    assert_true(n > 0);
    assert_string_equal(text, "<3>error test: one\n<4>warn test: two\n<6>info test: three\n");
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_escape),
        cmocka_unit_test(test_write_keeps_one_line),
        cmocka_unit_test(test_write_to_journal),
    };

    return cmocka_run_group_tests(tests, NULL, NULL);
}

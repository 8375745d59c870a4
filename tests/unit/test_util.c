/* SPDX-License-Identifier: Apache-2.0 */
/* Shared test helpers: keys like vLLM's fixtures, contexts, abort expectations. */
#include <dirent.h>
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "test_util.h"

struct kvt_key kt_key(int i)
{
    char buf[32];
    struct kvt_key k;
    int n = snprintf(buf, sizeof(buf), "%d", i);
    int rc = kvt_key_make(&k, buf, (size_t)n, 0);
    assert_int_equal(rc, 0);
    return k;
}

void kt_keys(struct kvt_key *out, int first, size_t n)
{
    for (size_t i = 0; i < n; i++)
        out[i] = kt_key(first + (int)i);
}

struct kvt_req_ctx *kt_ctx(const char *req_id)
{
    struct kvt_req_ctx *ctx = NULL;
    assert_int_equal(kvt_req_ctx_create(req_id, NULL, &ctx), 0);
    return ctx;
}

bool kt_expect_abort(void (*fn)(void *), void *arg)
{
    int status = 0;
    pid_t pid;
    fflush(NULL);
    pid = fork();
    if (pid == 0) {
        /* Quiet child: the expected assertion message is noise. */
        if (freopen("/dev/null", "w", stderr) == NULL)
            _exit(3);
        signal(SIGABRT, SIG_DFL);
        fn(arg);
        _exit(0);
    }
    if (pid < 0 || waitpid(pid, &status, 0) != pid)
        return false;
    return WIFSIGNALED(status) && WTERMSIG(status) == SIGABRT;
}

char *kt_tmpdir(const char *name)
{
    const char *base = getenv("KVT_TEST_TMPDIR");
    char *path;
    if (base == NULL)
        base = "/tmp";
    mkdir(base, 0700);
    if (asprintf(&path, "%s/%s.%d.XXXXXX", base, name, (int)getpid()) < 0)
        return NULL;
    if (mkdtemp(path) == NULL) {
        free(path);
        return NULL;
    }
    return path;
}

int kt_open_fds(void)
{
    DIR *d = opendir("/proc/self/fd");
    int n = 0;
    assert_non_null(d);
    while (readdir(d) != NULL)
        n++;
    closedir(d);
    return n;
}

/* SPDX-License-Identifier: Apache-2.0 */
/* Shared test helpers that need only kvt_common: abort expectations, temporary
 * folders, open descriptors, threads sharing a core (keys and contexts are in
 * test_util_keys.c, which needs the tiering library). */
#include <dirent.h>
#include <errno.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "test_util.h"

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

void kt_pin_to(pthread_t t, int cpu)
{
    cpu_set_t set;

    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    assert_int_equal(pthread_setaffinity_np(t, sizeof(set), &set), 0);
}

void kt_busy_ms(unsigned ms)
{
    struct timespec a, b;

    clock_gettime(CLOCK_MONOTONIC, &a);
    do
        clock_gettime(CLOCK_MONOTONIC, &b);
    while ((b.tv_sec - a.tv_sec) * 1000 + (b.tv_nsec - a.tv_nsec) / 1000000 < (long)ms);
}

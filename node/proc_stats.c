/* This process's figures for /metrics (kvt/proc_stats.h), from /proc/self as
 * Prometheus's client libraries take them:
 *   /proc/self/stat   utime + stime (clock ticks), starttime (ticks after boot), rss
 *                     (pages); the fields are counted after the last ')', because the
 *                     command name in parentheses may itself hold spaces and ')'
 *   /proc/stat        btime, the boot time in seconds since the epoch (read once)
 *   /proc/self/fd     one entry per open descriptor (the one reading it excluded)
 *   getrlimit         RLIMIT_NOFILE's soft limit
 * Read on the node's loop once a second: a few small reads. */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

#include "kvt/proc_stats.h"

/* The whole of a small /proc file into buf (NUL-terminated). */
static int read_small(const char *path, char *buf, size_t cap)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    size_t n = 0;

    if (fd < 0)
        return -errno;
    while (n < cap - 1) {
        ssize_t r = read(fd, buf + n, cap - 1 - n);

        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0) {
            int rc = -errno;

            close(fd);
            return rc;
        }
        if (r == 0)
            break;
        n += (size_t)r;
    }
    close(fd);
    buf[n] = '\0';
    return 0;
}

/* Fields 14 (utime), 15 (stime), 22 (starttime), 24 (rss) of /proc/self/stat. */
static int parse_stat(const char *text, unsigned long long *utime, unsigned long long *stime,
                      unsigned long long *start, long long *rss)
{
    const char *p = strrchr(text, ')');

    /* After ")": field 3 (state) onwards. */
    if (p == NULL ||
        sscanf(p + 1,
               " %*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %llu %llu %*d %*d %*d %*d %*d %*d "
               "%llu %*u %lld",
               utime, stime, start, rss) != 4)
        return -EPROTO;
    return 0;
}

/* btime of /proc/stat, read line by line (its "intr" line, before btime, runs to tens
 * of KiB on large hosts); read once, the boot time does not change. */
static int boot_time(unsigned long long *btime_p)
{
    static unsigned long long cached;
    FILE *f;
    char *line = NULL;
    size_t cap = 0;
    int rc = -EPROTO;

    if (cached != 0) {
        *btime_p = cached;
        return 0;
    }
    f = fopen("/proc/stat", "re");
    if (f == NULL)
        return -errno;
    while (getline(&line, &cap, f) > 0) {
        if (sscanf(line, "btime %llu", btime_p) == 1) {
            cached = *btime_p;
            rc = 0;
            break;
        }
    }
    free(line);
    fclose(f);
    return rc;
}

static int count_fds(uint64_t *n_p)
{
    DIR *d = opendir("/proc/self/fd");
    struct dirent *e;
    uint64_t n = 0;

    if (d == NULL)
        return -errno;
    while ((e = readdir(d)) != NULL)
        if (e->d_name[0] != '.')
            n++;
    closedir(d);
    *n_p = n > 0 ? n - 1 : 0; /* the descriptor that read the folder */
    return 0;
}

int kvt_proc_stats_read(struct kvt_proc_stats *out)
{
    unsigned long long utime = 0, stime = 0, start = 0, btime = 0;
    long long rss = 0;
    long tick = sysconf(_SC_CLK_TCK), page = sysconf(_SC_PAGESIZE);
    struct rlimit rl;
    char buf[1024];
    uint64_t fds = 0;
    int rc;

    if (tick <= 0 || page <= 0)
        return -EPROTO;
    rc = read_small("/proc/self/stat", buf, sizeof(buf));
    if (rc == 0)
        rc = parse_stat(buf, &utime, &stime, &start, &rss);
    if (rc == 0)
        rc = boot_time(&btime);
    if (rc == 0)
        rc = count_fds(&fds);
    if (rc == 0 && getrlimit(RLIMIT_NOFILE, &rl) != 0)
        rc = -errno;
    if (rc < 0)
        return rc;
    *out = (struct kvt_proc_stats){
        .cpu_seconds = (double)(utime + stime) / (double)tick,
        .resident_bytes = rss > 0 ? (uint64_t)rss * (uint64_t)page : 0,
        .open_fds = fds,
        .max_fds = rl.rlim_cur == RLIM_INFINITY ? UINT64_MAX : (uint64_t)rl.rlim_cur,
        .start_time_s = (double)btime + (double)start / (double)tick,
    };
    return 0;
}

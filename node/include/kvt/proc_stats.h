/* This process's own figures for /metrics, named as Prometheus's client libraries name
 * them (process_cpu_seconds_total, process_resident_memory_bytes, process_open_fds,
 * process_max_fds, process_start_time_seconds), read from /proc/self. */
#ifndef KVT_PROC_STATS_H
#define KVT_PROC_STATS_H

#include <stdint.h>

struct kvt_proc_stats {
    double cpu_seconds;      /* user + system CPU time, all threads */
    uint64_t resident_bytes; /* resident set size */
    uint64_t open_fds;       /* open file descriptors */
    uint64_t max_fds;        /* the soft limit on them (RLIMIT_NOFILE) */
    double start_time_s;     /* when the process started, seconds since the epoch */
};

/* Reads them now. 0, or the negative errno of a /proc file that cannot be read, or
 * -EPROTO for one that does not parse (nothing written to *out then). */
int kvt_proc_stats_read(struct kvt_proc_stats *out);

#endif

/* SPDX-License-Identifier: Apache-2.0 */
/* The shared primary region (vLLM's SharedOffloadRegion): one file,
 * on a tmpfs, of num_chunks rows of num_workers * page_bytes, mapped
 * MAP_SHARED by the node and by every engine worker.
 *
 * Creation race: everybody opens with O_CREAT|O_EXCL; the winner (creator) checks
 * free space with fstatvfs, ftruncates to the full size; the others open the
 * existing file and wait (5 ms polls, join timeout) until it has the full size.
 * The file is opened with O_NOFOLLOW, and a joiner refuses (-EPERM) a file that is
 * not a regular file of its own user with mode 0600 or stricter. Only the creator
 * unlinks, and only the file it created. Cleanup is idempotent. */
#ifndef KVT_REGION_H
#define KVT_REGION_H

#include <limits.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#define KVT_REGION_RANK_ALL (-1) /* the scheduler / node: pre-faults the whole region */

struct kvt_region_config {
    const char *path; /* the file, e.g. /dev/shm/kvtier_<node>.mmap */
    size_t num_chunks;
    size_t page_bytes;     /* one worker's cell of a row */
    unsigned num_workers;  /* cells per row */
    int rank;              /* worker index, or KVT_REGION_RANK_ALL */
    double join_timeout_s; /* how long a joiner waits for the full size (30 s) */
    bool populate;         /* pre-fault with MADV_POPULATE_WRITE */
    bool exclusive;        /* create only: an existing file is refused (-EEXIST), not joined */
};

struct kvt_region {
    char path[PATH_MAX];
    int fd;
    uint8_t *base;
    size_t size; /* num_chunks * row_bytes */
    size_t num_chunks;
    size_t row_bytes; /* num_workers * page_bytes */
    size_t page_bytes;
    unsigned num_workers;
    int rank;
    bool creator;
    size_t cursor; /* next free byte of this worker's cell (create_next_view) */
    bool open;
};

/* A strided view of one tensor across all rows: row c starts at base + c*row_stride. */
struct kvt_region_view {
    uint8_t *base;
    size_t rows;
    size_t row_stride;
    size_t bytes;  /* tensor page bytes of this view */
    size_t offset; /* storage offset inside a row */
};

/* 0, or -EINVAL (bad geometry), -ENOSPC (not enough space, no file left behind),
 * -ETIMEDOUT (joiner: the creator did not size the file in time), -EPERM (joiner: the
 * file is another user's, or group/other may use it), -EEXIST (exclusive: the file
 * exists), -ELOOP (the path is a symbolic link), other -errno. */
int kvt_region_open(const struct kvt_region_config *cfg, struct kvt_region *r);
/* Unmaps and closes; the creator also unlinks the file, if the path still names the
 * one it created. Safe to call twice. */
void kvt_region_cleanup(struct kvt_region *r);
/* Bytes of this process's mapping of the region that sit on huge pages (hugetlbfs,
 * or a tmpfs mounted huge=advise or more: see kvt_region_open), counted once faulted in (a
 * populated region): peers' READs pin or walk one 2 MiB page instead of 512. 0 or
 * -errno. kvt_region_huge_bytes_from reads the smaps text of the mapping at base. */
int kvt_region_huge_bytes(const struct kvt_region *r, size_t *huge);
int kvt_region_huge_bytes_from(FILE *smaps, const void *base, size_t size, size_t *huge);

/* Next tensor view of this worker's cell; -ERANGE if it would exceed the worker
 * area end (cursor unchanged); -EINVAL for rank ALL. */
int kvt_region_next_view(struct kvt_region *r, size_t tensor_page_bytes,
                         struct kvt_region_view *view_p);

static inline uint8_t *kvt_region_row(const struct kvt_region *r, size_t chunk)
{
    return r->base + chunk * r->row_bytes;
}

/* Waits until fstat(fd).st_size >= size, polling every 5 ms. -ETIMEDOUT after timeout_s. */
int kvt_region_wait_for_size(int fd, size_t size, double timeout_s);

#endif

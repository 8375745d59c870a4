/* SPDX-License-Identifier: Apache-2.0 */
/* The shared primary region (vLLM's SharedOffloadRegion).
 *
 * One file, mapped MAP_SHARED by the node and by every engine worker (kvtierd puts
 * it in its private runtime folder on a tmpfs, node/README.md). Layout ("interleaved
 * rows"):
 *
 *     row c = [ worker0 cell | worker1 cell | ... | worker{M-1} cell ]
 *     cell  = page_bytes bytes = that worker's tensors for chunk c, concatenated
 *     total = num_chunks * row_bytes,  row_bytes = num_workers * page_bytes
 *
 * so tensor t of worker r in chunk c lives at c*row_bytes + r*page_bytes + offset_t.
 * Secondary tiers move whole rows: one chunk is row_bytes long.
 *
 * Who sizes the file. The participants coordinate through the file system only:
 * each one opens with O_CREAT|O_EXCL and exactly one wins. The winner (creator)
 * checks with fstatvfs that the file system has room for the whole region before it
 * ftruncates (a tmpfs that is too small otherwise only shows up later, as EFAULT
 * from the pre-fault or SIGBUS on first touch); on a shortage it logs the numbers,
 * unlinks the file it created and fails with -ENOSPC, so that nothing is left
 * behind for the next start to trip over. The losers (joiners) open the existing
 * file and poll fstat every 5 ms until the creator has sized it, or give up with
 * -ETIMEDOUT. Everybody then maps the whole file, and optionally pre-faults with
 * MADV_POPULATE_WRITE: a worker its own cells row by row, the node (rank ALL) the
 * whole region. Old kernels answer that advice with EINVAL, which only costs the
 * pre-fault and is not an error.
 *
 * Other users. Whatever is mapped here is KV data, so a file is only ever used when
 * it is this process's own: the last component is opened with O_NOFOLLOW (a link is
 * refused, never followed), and a joiner checks the file it opened (fstat on the fd)
 * is a regular file of its own user with no group/other permission bits; another
 * user's file is refused with -EPERM, not joined. An exclusive open (the daemon's:
 * it removed its own stale file first) refuses any existing file with -EEXIST.
 *
 * Lifetime: only the creator unlinks, in kvt_region_cleanup(), and only while the
 * path still names the file it created (same device and inode): a file that took
 * its place is not ours to remove. Cleanup keys off r->open, so it is idempotent and
 * safe on a zeroed struct or after a failed open (which leaves r closed). Views are
 * plain pointers into the mapping and need no release of their own. */
#include <assert.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <time.h>
#include <unistd.h>

#include "kvt/alloc.h"
#include "kvt/clock.h"
#include "kvt/common.h"
#include "kvt/log.h"
#include "kvt/region.h"
#include "kvt/safe_path.h"

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23 /* Linux 5.14 */
#endif

#define REGION_LOG                  "region"
#define REGION_POLL_NS              5000000L /* joiner poll interval: 5 ms */
#define REGION_DEFAULT_JOIN_TIMEOUT 30.0     /* seconds, vLLM's default */
#define REGION_OPEN_ATTEMPTS        16       /* create/join retries if the file vanishes */

static void region_reset(struct kvt_region *r)
{
    memset(r, 0, sizeof(*r));
    r->fd = -1;
}

/* Validates the config and computes the geometry; touches nothing outside. */
static int region_check_config(const struct kvt_region_config *cfg, size_t *row_bytes_p,
                               size_t *size_p, double *timeout_p)
{
    size_t row_bytes, size;

    if (cfg->path == NULL || cfg->path[0] == '\0') {
        kvt_error(REGION_LOG, "no region path given");
        return -EINVAL;
    }
    if (strlen(cfg->path) >= PATH_MAX) {
        kvt_error(REGION_LOG, "region path is longer than %d bytes", PATH_MAX - 1);
        return -ENAMETOOLONG;
    }
    if (cfg->num_chunks == 0 || cfg->page_bytes == 0 || cfg->num_workers == 0) {
        kvt_error(REGION_LOG, "%s: zero geometry (num_chunks %zu, page_bytes %zu, num_workers %u)",
                  cfg->path, cfg->num_chunks, cfg->page_bytes, cfg->num_workers);
        return -EINVAL;
    }
    if (__builtin_mul_overflow(cfg->page_bytes, (size_t)cfg->num_workers, &row_bytes) ||
        __builtin_mul_overflow(cfg->num_chunks, row_bytes, &size) || size > (size_t)INT64_MAX) {
        kvt_error(REGION_LOG, "%s: region size overflows (%zu chunks x %u workers x %zu bytes)",
                  cfg->path, cfg->num_chunks, cfg->num_workers, cfg->page_bytes);
        return -EINVAL;
    }
    if (cfg->rank != KVT_REGION_RANK_ALL &&
        (cfg->rank < 0 || (unsigned)cfg->rank >= cfg->num_workers)) {
        kvt_error(REGION_LOG, "%s: rank %d out of range for %u workers", cfg->path, cfg->rank,
                  cfg->num_workers);
        return -EINVAL;
    }
    if (isnan(cfg->join_timeout_s) || cfg->join_timeout_s < 0) {
        kvt_error(REGION_LOG, "%s: bad join timeout %g s", cfg->path, cfg->join_timeout_s);
        return -EINVAL;
    }
    *row_bytes_p = row_bytes;
    *size_p = size;
    *timeout_p = cfg->join_timeout_s > 0 ? cfg->join_timeout_s : REGION_DEFAULT_JOIN_TIMEOUT;
    return 0;
}

/* Creator: is there room for the whole region on the file system of fd? */
static int region_check_space(const struct kvt_region *r)
{
    struct statvfs st;
    unsigned long long avail;
    unsigned long frsize;

    if (fstatvfs(r->fd, &st) < 0) {
        int rc = -errno;
        kvt_error(REGION_LOG, "%s: fstatvfs: %s", r->path, strerror(-rc));
        return rc;
    }
    frsize = st.f_frsize != 0 ? st.f_frsize : st.f_bsize;
    if (__builtin_mul_overflow((unsigned long long)st.f_bavail, (unsigned long long)frsize, &avail))
        avail = ~0ULL;
    if (avail < (unsigned long long)r->size) {
        kvt_error(REGION_LOG,
                  "Not enough space for the shared region %s: %zu bytes (%.2f GiB) required, "
                  "%llu bytes (%.2f GiB) available; shrink the region or enlarge the file "
                  "system (e.g. mount -o remount,size=... /dev/shm)",
                  r->path, r->size, (double)r->size / (1 << 30), avail, (double)avail / (1 << 30));
        return -ENOSPC;
    }
    return 0;
}

/* Unlinks r->path if it still names the file open at r->fd (same device and inode);
 * false when it names something else or nothing. */
static bool region_unlink_own(const struct kvt_region *r)
{
    struct stat mine, there;

    if (r->fd < 0 || fstat(r->fd, &mine) != 0)
        return false;
    if (fstatat(AT_FDCWD, r->path, &there, AT_SYMLINK_NOFOLLOW) != 0) {
        kvt_warn(REGION_LOG, "%s: %s (not removed)", r->path, strerror(errno));
        return false;
    }
    if (there.st_dev != mine.st_dev || there.st_ino != mine.st_ino) {
        kvt_warn(REGION_LOG, "%s is no longer the file this process created: not removing it",
                 r->path);
        return false;
    }
    if (unlink(r->path) < 0) {
        kvt_warn(REGION_LOG, "%s: unlink: %s", r->path, strerror(errno));
        return false;
    }
    return true;
}

/* Creator path after winning O_EXCL: check space, size the file. On failure the
 * file we created is unlinked and closed, so no joiner is left waiting on a stub
 * longer than it takes to notice, and no stale file blocks the next start. */
static int region_size_new_file(struct kvt_region *r)
{
    int rc = region_check_space(r);
    if (rc == 0 && ftruncate(r->fd, (off_t)r->size) < 0) {
        rc = -errno;
        kvt_error(REGION_LOG, "%s: ftruncate to %zu bytes: %s", r->path, r->size, strerror(-rc));
    }
    if (rc < 0) {
        region_unlink_own(r);
        close(r->fd);
        r->fd = -1;
        return rc;
    }
    r->creator = true;
    kvt_info(REGION_LOG, "created region %s (%.2f GB)", r->path, (double)r->size / 1e9);
    return 0;
}

/* Joiner: the file must be this user's own before anything of it is mapped. */
static int region_check_joined(struct kvt_region *r)
{
    int rc = kvt_private_file_check(r->fd, r->path, 0600, NULL);

    if (rc < 0)
        kvt_error(REGION_LOG, "%s: refusing to join a region file that is not this user's own",
                  r->path);
    return rc;
}

/* The creation race: leaves r->fd open on a file of at least r->size bytes. */
static int region_create_or_join(struct kvt_region *r, bool exclusive, double timeout_s)
{
    int rc;

    for (int attempt = 0; attempt < REGION_OPEN_ATTEMPTS; attempt++) {
        r->fd = open(r->path, O_CREAT | O_EXCL | O_RDWR | O_NOFOLLOW | O_CLOEXEC, 0600);
        if (r->fd >= 0)
            return region_size_new_file(r);
        if (errno != EEXIST)
            break;
        if (exclusive) {
            kvt_error(REGION_LOG,
                      "%s already exists: refusing to join a region this process did not "
                      "create",
                      r->path);
            return -EEXIST;
        }
        r->fd = open(r->path, O_RDWR | O_NOFOLLOW | O_CLOEXEC);
        if (r->fd >= 0) {
            rc = region_check_joined(r);
            if (rc == 0)
                rc = kvt_region_wait_for_size(r->fd, r->size, timeout_s);
            if (rc < 0) {
                if (rc == -ETIMEDOUT)
                    kvt_error(REGION_LOG,
                              "%s: timed out after %.3f s waiting for the file to reach %zu bytes",
                              r->path, timeout_s, r->size);
                close(r->fd);
                r->fd = -1;
                return rc;
            }
            kvt_info(REGION_LOG, "opened existing region %s", r->path);
            return 0;
        }
        /* The file went away between the two opens (a failed or finished creator
         * unlinked it): race for creation again. */
        if (errno != ENOENT)
            break;
    }
    rc = -errno;
    if (rc == -ELOOP)
        kvt_error(REGION_LOG, "%s is a symbolic link: refusing it (name the file itself)", r->path);
    else
        kvt_error(REGION_LOG, "%s: open: %s", r->path, strerror(-rc));
    return rc;
}

/* MADV_POPULATE_WRITE over [addr, addr+len); *unsupported_p on EINVAL. */
static int region_populate_range(struct kvt_region *r, size_t off, size_t len, bool *unsupported_p)
{
    while (madvise(r->base + off, len, MADV_POPULATE_WRITE) < 0) {
        int rc = -errno;
        if (rc == -EINTR)
            continue;
        if (rc == -EINVAL) {
            kvt_debug(REGION_LOG, "%s: MADV_POPULATE_WRITE not supported, not pre-faulting",
                      r->path);
            *unsupported_p = true;
            return 0;
        }
        kvt_error(REGION_LOG,
                  "%s: pre-faulting %zu bytes at offset %zu failed: %s (is the file system "
                  "full?)",
                  r->path, len, off, strerror(-rc));
        return rc;
    }
    return 0;
}

/* A worker pre-faults its own cell of every row (page-aligned start); rank ALL the
 * whole region at once. */
static int region_populate(struct kvt_region *r)
{
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    bool unsupported = false;
    int rc;

    if (r->rank == KVT_REGION_RANK_ALL) {
        /* The node's own transfers copy in and out of the whole region: its first
         * touches by the process and by the kernel happen now, not inside them. */
        rc = region_populate_range(r, 0, r->size, &unsupported);
        if (rc == 0)
            kvt_mem_touch(r->base, r->size);
        return rc;
    }
    for (size_t c = 0; c < r->num_chunks && !unsupported; c++) {
        size_t raw = c * r->row_bytes + (size_t)r->rank * r->page_bytes;
        size_t aligned = raw - raw % page;
        rc = region_populate_range(r, aligned, raw + r->page_bytes - aligned, &unsupported);
        if (rc < 0)
            return rc;
    }
    return 0;
}

int kvt_region_open(const struct kvt_region_config *cfg, struct kvt_region *r)
{
    size_t row_bytes, size;
    double timeout_s;
    void *base;
    int rc;

    if (r == NULL)
        return -EINVAL;
    region_reset(r);
    if (cfg == NULL)
        return -EINVAL;
    rc = region_check_config(cfg, &row_bytes, &size, &timeout_s);
    if (rc < 0)
        return rc;

    memcpy(r->path, cfg->path, strlen(cfg->path) + 1);
    r->size = size;
    r->num_chunks = cfg->num_chunks;
    r->row_bytes = row_bytes;
    r->page_bytes = cfg->page_bytes;
    r->num_workers = cfg->num_workers;
    r->rank = cfg->rank;

    rc = region_create_or_join(r, cfg->exclusive, timeout_s);
    if (rc < 0)
        goto err_reset;

    base = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, r->fd, 0);
    if (base == MAP_FAILED) {
        rc = -errno;
        kvt_error(REGION_LOG, "%s: mmap of %zu bytes: %s", r->path, size, strerror(-rc));
        goto err_close;
    }
    r->base = base;
    /* Huge pages where the file system gives them: a tmpfs mounted huge=advise,
     * within_size or always (/dev/shm is huge=never unless remounted; shmem_enabled
     * deny or force overrides every mount), or hugetlbfs, whose pages are huge anyway.
     * See the anonymous primary in primary.c for what they save a pulling peer. Advice
     * only; kvt_region_huge_bytes says what came of it. */
    (void)madvise(base, size, MADV_HUGEPAGE);

    if (cfg->populate) {
        rc = region_populate(r);
        if (rc < 0)
            goto err_unmap;
    }

    r->cursor = r->rank == KVT_REGION_RANK_ALL ? 0 : (size_t)r->rank * r->page_bytes;
    r->open = true;
    return 0;

err_unmap:
    munmap(r->base, r->size);
err_close:
    if (r->creator)
        region_unlink_own(r);
    close(r->fd);
err_reset:
    region_reset(r);
    return rc;
}

/* /proc/self/smaps: each mapping's header line is "start-end perms offset dev inode
 * path", then "Key: n kB" lines. Huge pages of a shared file mapping show as
 * ShmemPmdMapped (tmpfs) or FilePmdMapped; a hugetlbfs mapping has a KernelPageSize
 * above the base page. The region may be split into several mappings (mprotect, a
 * partial madvise): every one inside [base, base + size) counts. */
int kvt_region_huge_bytes_from(FILE *smaps, const void *base, size_t size, size_t *huge)
{
    unsigned long long lo = (uintptr_t)base, hi = lo + size, len = 0, sum = 0;
    unsigned long long page = (unsigned long long)sysconf(_SC_PAGESIZE);
    char *line = NULL;
    size_t cap = 0;
    bool in = false, found = false;

    while (getline(&line, &cap, smaps) > 0) {
        unsigned long long start, end, v;
        char key[64];

        /* A header: hex, '-', hex at the start of a line (no key has a '-'). */
        if (sscanf(line, "%llx-%llx ", &start, &end) == 2) {
            in = start >= lo && end <= hi && start < end;
            len = in ? end - start : 0;
            found = found || in;
            continue;
        }
        if (!in || sscanf(line, "%63[^:]: %llu kB", key, &v) != 2)
            continue;
        if (strcmp(key, "ShmemPmdMapped") == 0 || strcmp(key, "FilePmdMapped") == 0)
            sum += v * 1024;
        else if (strcmp(key, "KernelPageSize") == 0 && v * 1024 > page)
            sum += len; /* hugetlbfs: the whole mapping */
    }
    free(line);
    if (!found)
        return -ENOENT;
    *huge = (size_t)KVT_MIN(sum, (unsigned long long)size);
    return 0;
}

int kvt_region_huge_bytes(const struct kvt_region *r, size_t *huge)
{
    FILE *f;
    int rc;

    if (r == NULL || !r->open || huge == NULL)
        return -EINVAL;
    f = fopen("/proc/self/smaps", "re");
    if (f == NULL)
        return -errno;
    rc = kvt_region_huge_bytes_from(f, r->base, r->size, huge);
    fclose(f);
    return rc;
}

void kvt_region_cleanup(struct kvt_region *r)
{
    if (r == NULL || !r->open)
        return;
    if (r->base != NULL && munmap(r->base, r->size) < 0)
        kvt_warn(REGION_LOG, "%s: munmap: %s", r->path, strerror(errno));
    if (r->creator && region_unlink_own(r))
        kvt_info(REGION_LOG, "removed region %s", r->path);
    if (r->fd >= 0 && close(r->fd) < 0)
        kvt_warn(REGION_LOG, "%s: close: %s", r->path, strerror(errno));
    r->base = NULL;
    r->fd = -1;
    r->creator = false;
    r->cursor = 0;
    r->open = false;
}

int kvt_region_next_view(struct kvt_region *r, size_t tensor_page_bytes,
                         struct kvt_region_view *view_p)
{
    size_t area_end;

    if (r == NULL || view_p == NULL || !r->open || r->rank == KVT_REGION_RANK_ALL)
        return -EINVAL;
    area_end = ((size_t)r->rank + 1) * r->page_bytes;
    assert(r->cursor <= area_end);
    if (tensor_page_bytes > area_end - r->cursor) {
        kvt_error(REGION_LOG,
                  "%s: worker offset %zu + %zu exceeds worker area end %zu (overflowed by %zu "
                  "bytes)",
                  r->path, r->cursor, tensor_page_bytes, area_end,
                  tensor_page_bytes - (area_end - r->cursor));
        return -ERANGE;
    }
    view_p->base = r->base + r->cursor;
    view_p->rows = r->num_chunks;
    view_p->row_stride = r->row_bytes;
    view_p->bytes = tensor_page_bytes;
    view_p->offset = r->cursor;
    r->cursor += tensor_page_bytes;
    return 0;
}

int kvt_region_wait_for_size(int fd, size_t size, double timeout_s)
{
    const struct timespec poll = {.tv_sec = 0, .tv_nsec = REGION_POLL_NS};
    uint64_t deadline, polls, max_polls;
    struct stat st;

    if (fd < 0 || isnan(timeout_s) || timeout_s < 0)
        return -EINVAL;
    /* The deadline is on kvt_now_ns(); the poll count bounds the wait as well, so
     * a test that freezes the clock cannot make a joiner wait forever. */
    if (timeout_s > 1e9)
        timeout_s = 1e9;
    deadline = kvt_now_ns() + (uint64_t)(timeout_s * 1e9);
    max_polls = (uint64_t)(timeout_s * 1e9 / (double)REGION_POLL_NS) + 1;
    for (polls = 0;; polls++) {
        if (fstat(fd, &st) < 0)
            return -errno;
        if (st.st_size >= 0 && (uint64_t)st.st_size >= (uint64_t)size)
            return 0;
        if (kvt_now_ns() > deadline || polls >= max_polls)
            return -ETIMEDOUT;
        nanosleep(&poll, NULL);
    }
}

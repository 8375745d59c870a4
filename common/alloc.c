/* SPDX-License-Identifier: Apache-2.0 */
/* Allocation with an injectable failure point for tests. The counter is atomic so
 * tier threads may allocate too. */
#include <fcntl.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <unistd.h>

#include "kvt/alloc.h"
#include "kvt/alloc_test.h"

static long fail_after = -1;

static int should_fail(void)
{
    long n = __atomic_load_n(&fail_after, __ATOMIC_RELAXED);
    if (n < 0)
        return 0;
    if (n == 0)
        return 1;
    __atomic_fetch_sub(&fail_after, 1, __ATOMIC_RELAXED);
    return 0;
}

void kvt_alloc_fail_after(long n)
{
    __atomic_store_n(&fail_after, n, __ATOMIC_RELAXED);
}

void *kvt_malloc(size_t size)
{
    return should_fail() ? NULL : malloc(size);
}

void *kvt_calloc(size_t n, size_t size)
{
    return should_fail() ? NULL : calloc(n, size);
}

void *kvt_realloc(void *p, size_t size)
{
    return should_fail() ? NULL : realloc(p, size);
}

void *kvt_reallocarray(void *p, size_t n, size_t size)
{
    if (size != 0 && n > (size_t)-1 / size)
        return NULL;
    return kvt_realloc(p, n * size);
}

void kvt_free(void *p)
{
    free(p);
}

char *kvt_strdup(const char *s)
{
    size_t n = strlen(s) + 1;
    char *d = kvt_malloc(n);
    if (d != NULL)
        memcpy(d, s, n);
    return d;
}

/* Below one huge page a table is not worth its own mapping; larger ones start on a
 * huge-page boundary. */
#define TABLE_MIN_BYTES KVT_HUGE_PAGE_BYTES

/* len zeroed bytes starting on a huge-page boundary (NULL: no memory): mapped one huge
 * page larger and trimmed, since a mapping that starts inside a huge page cannot hold
 * one there. munmap(p, len) frees exactly it. */
static void *map_aligned(size_t len)
{
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    size_t lead, mapped = (len + page - 1) / page * page;
    uint8_t *m = mmap(NULL, mapped + TABLE_MIN_BYTES, PROT_READ | PROT_WRITE,
                      MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);

    if (m == MAP_FAILED)
        return NULL;
    lead = (TABLE_MIN_BYTES - (uintptr_t)m % TABLE_MIN_BYTES) % TABLE_MIN_BYTES;
    if (lead > 0)
        munmap(m, lead);
    munmap(m + lead + mapped, TABLE_MIN_BYTES - lead);
    return m + lead;
}

void *kvt_calloc_table(size_t n, size_t size)
{
    void *p;

    if (size != 0 && n > (size_t)-1 / size)
        return NULL;
    if (n * size < TABLE_MIN_BYTES)
        return kvt_calloc(n, size);
    if (should_fail())
        return NULL;
    p = map_aligned(n * size);
    if (p != NULL)
        (void)madvise(p, n * size, MADV_HUGEPAGE); /* advice only: 4 KiB pages still work */
    return p;
}

void kvt_free_table(void *p, size_t n, size_t size)
{
    if (p == NULL)
        return;
    if (n * size < TABLE_MIN_BYTES)
        kvt_free(p);
    else
        munmap(p, n * size);
}

void kvt_zero_table(void *p, size_t n, size_t size)
{
    if (n * size < TABLE_MIN_BYTES || madvise(p, n * size, MADV_DONTNEED) != 0)
        memset(p, 0, n * size);
}

/* Hypervisors that shadow the guest's page tables (PVM, the kind these machines run
 * on) fault the first access to a page once for the process and once more for the
 * kernel's copies through the same addresses (send/recv over tcp), a host exit each:
 * measured here, the first 256 MiB through a socket moved at 0.3-0.7 GB/s, every later
 * pass at 5-7 GB/s. One atomic add of 0 per page is the process's touch and a writev
 * of one byte per page into a pipe the kernel's; neither changes a byte, so a region
 * others already write is safe to touch. On other machines both cost a page walk. */
void kvt_mem_touch(void *base, size_t len)
{
    enum { PAGES = 1024 };
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    uint8_t *p = base, sink[PAGES];
    struct iovec iov[PAGES];
    int pp[2];

    if (p == NULL || len == 0)
        return;
    for (size_t off = 0; off < len; off += page)
        (void)__atomic_fetch_add(p + off, 0, __ATOMIC_RELAXED);
    if (pipe2(pp, O_CLOEXEC | O_NONBLOCK) != 0)
        return; /* best effort: the first transfers pay it instead */
    for (size_t off = 0; off < len;) {
        int k = 0;
        ssize_t w;

        for (; k < PAGES && off < len; k++, off += page)
            iov[k] = (struct iovec){.iov_base = p + off, .iov_len = 1};
        w = writev(pp[1], iov, k);
        if (w <= 0 || read(pp[0], sink, (size_t)w) != w)
            break;
    }
    close(pp[0]);
    close(pp[1]);
}

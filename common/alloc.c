/* Allocation with an injectable failure point for tests. The counter is atomic so
 * tier threads may allocate too. */
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "kvt/alloc.h"

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

/* Below one huge page a table is not worth its own mapping. */
#define TABLE_MIN_BYTES (2u << 20)

void *kvt_calloc_table(size_t n, size_t size)
{
    void *p;

    if (size != 0 && n > (size_t)-1 / size)
        return NULL;
    if (n * size < TABLE_MIN_BYTES)
        return kvt_calloc(n, size);
    if (should_fail())
        return NULL;
    p = mmap(NULL, n * size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED)
        return NULL;
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

/* Allocation with an injectable failure point for tests. The counter is atomic so
 * tier threads may allocate too. */
#include <stdlib.h>
#include <string.h>

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

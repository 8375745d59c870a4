/* SPDX-License-Identifier: Apache-2.0 */
/* Allocation hook: every allocation of the project goes through these, so tests can
 * inject failures (kvt_alloc_fail_after) and check that errors unwind cleanly. */
#ifndef KVT_ALLOC_H
#define KVT_ALLOC_H

#include <stddef.h>

void *kvt_malloc(size_t size);
void *kvt_calloc(size_t n, size_t size);
void *kvt_realloc(void *p, size_t size);
/* realloc of n * size with overflow check. */
void *kvt_reallocarray(void *p, size_t n, size_t size);
void kvt_free(void *p);
char *kvt_strdup(const char *s);

/* A huge page: from this size on kvt_calloc_table maps (on this boundary); below
 * it a table is heap memory, not even page aligned. */
#define KVT_HUGE_PAGE_BYTES ((size_t)2 << 20)

/* Zeroed n * size bytes for large, randomly accessed tables (indexes of millions
 * of entries) and I/O buffers: from 2 MiB on, a private mapping that starts on a
 * 2 MiB boundary, advised for transparent huge pages, so a lookup pays a cache miss
 * but not also a TLB miss and an O_DIRECT request is not a scatter list of 4 KiB
 * pages. Same failure injection as the others; free with kvt_free_table and the
 * same n * size. */
void *kvt_calloc_table(size_t n, size_t size);
void kvt_free_table(void *p, size_t n, size_t size);
/* Zeroes such a table; a large one is handed back to the kernel (zero pages on the
 * next touch) instead of being written. */
void kvt_zero_table(void *p, size_t n, size_t size);

/* Touches every page of a populated mapping from the process and from the kernel,
 * without changing a byte, so the first transfers out of and into it run at the speed
 * of the later ones (see alloc.c for the machines where that differs). */
void kvt_mem_touch(void *base, size_t len);

#endif

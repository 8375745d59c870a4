/* SPDX-License-Identifier: Apache-2.0 */
/* Test hook of the allocator (kvt/alloc.h): failures on demand, so a test can check
 * that every error path unwinds. Included by the tests and by alloc.c only. */
#ifndef KVT_ALLOC_TEST_H
#define KVT_ALLOC_TEST_H

/* The next n allocations succeed, then every one fails until reset with -1. */
void kvt_alloc_fail_after(long n);

#endif

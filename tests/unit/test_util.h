/* SPDX-License-Identifier: Apache-2.0 */
/* Helpers shared by the cmocka tests. */
#ifndef KVT_TEST_UTIL_H
#define KVT_TEST_UTIL_H

#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "kvt/types.h"

/* The spec's make_offload_key(str(i).encode(), 0). */
struct kvt_key kt_key(int i);
/* n keys kt_key(first..first+n-1) into out. */
void kt_keys(struct kvt_key *out, int first, size_t n);
/* A request context with req_id "req-<i>" (or the given id). */
struct kvt_req_ctx *kt_ctx(const char *req_id);

/* Runs fn(arg) in a forked child and returns true if the child died of SIGABRT
 * (an internal assertion); the way to test that invariants are enforced. */
bool kt_expect_abort(void (*fn)(void *), void *arg);

/* A fresh directory for this test under $KVT_TEST_TMPDIR (or /tmp); caller frees. */
char *kt_tmpdir(const char *name);

/* How many file descriptors this process has open (entries of /proc/self/fd, the
 * one reading them included): for tests that nothing leaks one. */
int kt_open_fds(void);

/* Pins thread t to cpu (asserts it could): two threads pinned to one core share it,
 * for tests of what a thread does when it loses its core. */
void kt_pin_to(pthread_t t, int cpu);
/* Keeps the calling thread's core busy for ms milliseconds. */
void kt_busy_ms(unsigned ms);

#endif

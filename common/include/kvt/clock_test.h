/* SPDX-License-Identifier: Apache-2.0 */
/* Test hook of the clock (kvt/clock.h): a fake time, so tests of latencies and
 * lease expiry set the time instead of sleeping. Included by the tests and by
 * clock.c only. */
#ifndef KVT_CLOCK_TEST_H
#define KVT_CLOCK_TEST_H

#include <stdint.h>

/* While set, kvt_now_ns() returns *fake_ns. NULL restores the real clock. */
void kvt_clock_set_fake(const uint64_t *fake_ns);

#endif

/* Monotonic clock with a test override: tests that fake latency (back-pressure,
 * leases) set a fake time instead of sleeping. */
#ifndef KVT_CLOCK_H
#define KVT_CLOCK_H

#include <stdint.h>

uint64_t kvt_now_ns(void);
static inline double kvt_now_s(void)
{
    return (double)kvt_now_ns() * 1e-9;
}

/* Tests only: while set, kvt_now_ns() returns *fake_ns. NULL restores the real clock. */
void kvt_clock_set_fake(const uint64_t *fake_ns);

#endif

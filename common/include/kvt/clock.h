/* SPDX-License-Identifier: Apache-2.0 */
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

/* Short durations (a lookup's few tens of ns) cheaply: kvt_ticks() reads the CPU's
 * invariant time-stamp counter where there is one (x86-64; a clock_gettime costs
 * 20-45 ns on a VM, more than the lookup it would time), kvt_now_ns() elsewhere
 * and while the clock is faked; kvt_ticks_to_s() converts a difference of two. The
 * counter's rate is measured once against CLOCK_MONOTONIC (2 ms, at the first
 * conversion). */
extern const uint64_t *kvt__clock_fake; /* kvt_clock_set_fake's; NULL: the real clock */
extern double kvt__tick_s;              /* seconds per tick once measured, else 0 */
double kvt__ticks_to_s_slow(uint64_t dticks);

#if defined(__x86_64__)
static inline uint64_t kvt_ticks(void)
{
    return kvt__clock_fake == NULL ? __builtin_ia32_rdtsc() : kvt_now_ns();
}

static inline double kvt_ticks_to_s(uint64_t dticks)
{
    double tick_s;

    __atomic_load(&kvt__tick_s, &tick_s, __ATOMIC_RELAXED);
    if (kvt__clock_fake == NULL && tick_s > 0)
        return (double)dticks * tick_s;
    return kvt__ticks_to_s_slow(dticks);
}
#else
static inline uint64_t kvt_ticks(void)
{
    return kvt_now_ns();
}

static inline double kvt_ticks_to_s(uint64_t dticks)
{
    return (double)dticks * 1e-9;
}
#endif

#endif

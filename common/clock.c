/* SPDX-License-Identifier: Apache-2.0 */
/* Monotonic nanoseconds, overridable by tests that need to fake elapsed time, and
 * cheap ticks for short durations (the time-stamp counter, its rate measured once
 * against the monotonic clock). */
#include <pthread.h>
#include <stdbool.h>
#include <time.h>
#if defined(__x86_64__)
#include <x86intrin.h>
#endif

#include "kvt/clock.h"
#include "kvt/clock_test.h"

const uint64_t *kvt__clock_fake;
double kvt__tick_s;

uint64_t kvt_now_ns(void)
{
    struct timespec ts;
    if (kvt__clock_fake != NULL)
        return *kvt__clock_fake;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

void kvt_clock_set_fake(const uint64_t *fake_ns)
{
    kvt__clock_fake = fake_ns;
}

#if defined(__x86_64__)
static pthread_once_t tick_once = PTHREAD_ONCE_INIT;

static uint64_t mono_ns(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void tick_calibrate(void)
{
    uint64_t n0 = mono_ns(), t0 = __rdtsc(), n1, t1;

    do {
        n1 = mono_ns();
        t1 = __rdtsc();
    } while (n1 - n0 < 2000000);
    double tick_s = t1 > t0 ? (double)(n1 - n0) * 1e-9 / (double)(t1 - t0) : 1e-9;

    __atomic_store(&kvt__tick_s, &tick_s, __ATOMIC_RELEASE);
}
#endif

double kvt__ticks_to_s_slow(uint64_t dticks)
{
#if defined(__x86_64__)
    if (kvt__clock_fake == NULL) {
        double tick_s;

        pthread_once(&tick_once, tick_calibrate);
        __atomic_load(&kvt__tick_s, &tick_s, __ATOMIC_RELAXED);
        return (double)dticks * tick_s;
    }
#endif
    return (double)dticks * 1e-9;
}

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

static const uint64_t *fake_now;

uint64_t kvt_now_ns(void)
{
    struct timespec ts;
    if (fake_now != NULL)
        return *fake_now;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

void kvt_clock_set_fake(const uint64_t *fake_ns)
{
    fake_now = fake_ns;
}

#if defined(__x86_64__)
static double tick_s; /* seconds per tick */
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
    tick_s = t1 > t0 ? (double)(n1 - n0) * 1e-9 / (double)(t1 - t0) : 1e-9;
}
#endif

uint64_t kvt_ticks(void)
{
#if defined(__x86_64__)
    if (fake_now == NULL)
        return __rdtsc();
#endif
    return kvt_now_ns();
}

double kvt_ticks_to_s(uint64_t dticks)
{
#if defined(__x86_64__)
    if (fake_now == NULL) {
        pthread_once(&tick_once, tick_calibrate);
        return (double)dticks * tick_s;
    }
#endif
    return (double)dticks * 1e-9;
}

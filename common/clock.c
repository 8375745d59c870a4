/* Monotonic nanoseconds, overridable by tests that need to fake elapsed time. */
#include <time.h>

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

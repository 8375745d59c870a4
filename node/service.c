/* SPDX-License-Identifier: Apache-2.0 */
/* kvtierd and its service manager: the sd_notify messages of a Type=notify unit.
 *
 *   start -> READY=1 (+STATUS) once the engine socket and /metrics serve
 *         -> WATCHDOG=1 every WATCHDOG_USEC/2 from the loop while it turns
 *         -> STOPPING=1 when SIGTERM starts the drain -> exit
 *
 * systemd sets $NOTIFY_SOCKET (and $WATCHDOG_USEC with WatchdogSec=) for the main
 * process; libsystemd reads them, so a daemon started by hand or by a test sends
 * nothing. The watchdog is fed from the loop itself, not from a thread of its own:
 * what it proves is that the loop that steps the manager and serves engines still
 * turns. libsystemd is optional at build time (KVT_HAVE_SYSTEMD): without it the unit
 * must be Type=simple, and a daemon that finds $NOTIFY_SOCKET says why it is silent. */
#include <inttypes.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kvt/clock.h"
#include "kvt/log.h"
#include "kvt/service.h"

#ifdef KVT_HAVE_SYSTEMD
#include <systemd/sd-daemon.h>
#endif

#define MOD "kvtierd"

#ifdef KVT_HAVE_SYSTEMD

/* Loop thread only. */
static struct {
    uint64_t watchdog_ns; /* ping period (half of WATCHDOG_USEC); 0: no watchdog */
    uint64_t last_ping_ns;
} svc;

void kvt_service_ready(const char *status)
{
    uint64_t usec = 0;
    int rc = sd_notifyf(0, "READY=1\nSTATUS=%s", status);

    if (rc < 0)
        kvt_warn(MOD, "cannot tell the service manager we are ready: %s", strerror(-rc));
    /* > 0: a watchdog for this process (WATCHDOG_PID, when set, is ours). */
    rc = sd_watchdog_enabled(0, &usec);
    if (rc < 0) {
        kvt_warn(MOD, "WATCHDOG_USEC: %s; no watchdog pings", strerror(-rc));
    } else if (rc > 0) {
        svc.watchdog_ns = usec * 1000ull / 2;
        svc.last_ping_ns = kvt_now_ns();
        sd_notify(0, "WATCHDOG=1");
        kvt_info(MOD, "service watchdog: %" PRIu64 " ms, pinged every %" PRIu64 " ms", usec / 1000,
                 svc.watchdog_ns / 1000000);
    }
}

void kvt_service_stopping(void)
{
    sd_notify(0, "STOPPING=1\nSTATUS=draining");
}

void kvt_service_tick(void)
{
    uint64_t now;

    if (svc.watchdog_ns == 0)
        return;
    now = kvt_now_ns();
    if (now - svc.last_ping_ns < svc.watchdog_ns)
        return;
    svc.last_ping_ns = now;
    sd_notify(0, "WATCHDOG=1");
}

#else /* no libsystemd */

void kvt_service_ready(const char *status)
{
    (void)status;
    if (getenv("NOTIFY_SOCKET") != NULL)
        kvt_warn(MOD, "NOTIFY_SOCKET is set but this kvtierd was built without libsystemd: "
                      "nothing is sent (run it as Type=simple, without WatchdogSec=)");
}

void kvt_service_stopping(void)
{
}

void kvt_service_tick(void)
{
}

#endif

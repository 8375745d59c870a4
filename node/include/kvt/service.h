/* SPDX-License-Identifier: Apache-2.0 */
/* kvt_service: tells the service manager that started kvtierd how it is doing
 * (systemd's notify protocol through libsystemd's sd_notify: Type=notify units, and
 * their watchdog). Process-wide, like $NOTIFY_SOCKET itself; called from the daemon's
 * loop thread only. Without a service manager, or in a build without libsystemd,
 * every call does nothing (the latter says so once when $NOTIFY_SOCKET is set). */
#ifndef KVT_SERVICE_H
#define KVT_SERVICE_H

/* Serving: engines may attach, /healthz answers. Sends READY=1 and STATUS=status,
 * and reads the watchdog period ($WATCHDOG_USEC, for this process). */
void kvt_service_ready(const char *status);
/* SIGTERM taken: the drain starts (STOPPING=1). */
void kvt_service_stopping(void);
/* Every turn of the loop: WATCHDOG=1 once per half watchdog period, so a loop that
 * stops turning gets the daemon restarted. */
void kvt_service_tick(void);

#endif

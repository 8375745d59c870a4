#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""kvtierd speaks systemd's notify protocol (a Type=notify unit with WatchdogSec=).

The test plays the service manager: it listens on a unix datagram socket, starts
kvtierd with NOTIFY_SOCKET pointing at it, and checks
  - READY=1 (with a STATUS=) comes once the node serves: /healthz answers 200 then;
  - with WATCHDOG_USEC set, WATCHDOG=1 comes every half period (never a gap of a whole
    period) while the loop turns;
  - SIGTERM brings STOPPING=1 before the daemon exits 0;
  - without WATCHDOG_USEC, or with WATCHDOG_PID naming another process, no WATCHDOG=1.

  test_sd_notify.py KVTIERD TMPDIR
"""
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

kvtierd, tmp = sys.argv[1], sys.argv[2]
os.makedirs(tmp, exist_ok=True)
work = tempfile.mkdtemp(prefix="notify.", dir=os.path.abspath(tmp))
passed = failed = 0
procs = []  # every daemon started: killed at exit if still running
regions = []


def ok(what):
    global passed
    passed += 1
    print("ok - " + what, flush=True)


def bad(what):
    global failed
    failed += 1
    print("FAIL - " + what, flush=True)


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def healthz(port):
    try:
        with urllib.request.urlopen("http://127.0.0.1:%d/healthz" % port, timeout=2) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return None


class Manager:
    """The service manager's end: a datagram socket and the messages that came."""

    def __init__(self, name):
        self.path = os.path.join(work, name)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.msgs = []  # (monotonic time, {key: value})

    def wait_for(self, key, timeout):
        """The first message with key (after those already seen), or None."""
        end = time.monotonic() + timeout
        for t, m in self.msgs:
            if key in m:
                return t, m
        while time.monotonic() < end:
            self.sock.settimeout(max(0.01, end - time.monotonic()))
            try:
                data = self.sock.recv(4096)
            except socket.timeout:
                break
            m = dict(line.split("=", 1) for line in data.decode().splitlines() if "=" in line)
            self.msgs.append((time.monotonic(), m))
            if key in m:
                return self.msgs[-1]
        return None

    def drain(self, seconds):
        """Takes every message for seconds."""
        self.wait_for("\0none", seconds)

    def times(self, key):
        return [t for t, m in self.msgs if key in m]


def start(name, extra_env):
    mport = free_port()
    cfg = os.path.join(work, name + ".yaml")
    with open(cfg, "w") as f:
        f.write("""node:
  id: 11
primary:
  path: /dev/shm/kvtier-notify-%d-%s/region.mmap
  size: 16MiB
  row_bytes: 64KiB
storage:
  enabled: false
network:
  enabled: false
engine:
  socket: %s/%s.sock
metrics:
  port: %d
""" % (os.getpid(), name, work, name, mport))
    # The region in a folder of its own (kvtierd makes it 0700; /dev/shm itself is
    # writable by others and refused).
    regions.append("/dev/shm/kvtier-notify-%d-%s" % (os.getpid(), name))
    mgr = Manager(name + ".notify")
    env = dict(os.environ, NOTIFY_SOCKET=mgr.path, **extra_env)
    log = open(os.path.join(work, name + ".log"), "w")
    p = subprocess.Popen([kvtierd, "--config", cfg], env=env, stdout=log, stderr=subprocess.STDOUT)
    procs.append(p)
    return p, mgr, mport


def stop(p, mgr, name):
    p.send_signal(signal.SIGTERM)
    got = mgr.wait_for("STOPPING", 15)
    try:
        rc = p.wait(15)
    except subprocess.TimeoutExpired:
        p.kill()
        rc = p.wait()
    return got, rc


def log_tail(name):
    with open(os.path.join(work, name + ".log")) as f:
        return f.read()[-1500:]


try:
    # ---- READY, WATCHDOG, STOPPING ----
    period_us = 400000
    p, mgr, mport = start("wd", {"WATCHDOG_USEC": str(period_us)})
    got = mgr.wait_for("READY", 60)
    if got is None:
        bad("no READY=1 within 60 s: " + log_tail("wd"))
    else:
        code = healthz(mport)
        if got[1]["READY"] == "1" and code == 200:
            ok("READY=1 once the node serves (/healthz 200 at that moment)")
        else:
            bad("READY=%s, /healthz %s" % (got[1]["READY"], code))
        status = got[1].get("STATUS", "")
        if status.startswith("serving"):
            ok("STATUS with READY: " + status)
        else:
            bad("STATUS with READY is '%s'" % status)
        t_ready = got[0]
        mgr.drain(2.0)
        pings = [t for t in mgr.times("WATCHDOG") if t >= t_ready - 0.1]
        gaps = [b - a for a, b in zip(pings, pings[1:])]
        if len(pings) >= 4 and max(gaps) < period_us / 1e6:
            ok("WATCHDOG=1: %d pings in 2 s, largest gap %.0f ms (< %d ms)"
               % (len(pings), 1000 * max(gaps), period_us // 1000))
        else:
            bad("WATCHDOG=1: %d pings in 2 s, gaps %s ms" %
                (len(pings), [round(1000 * g) for g in gaps]))
        if all(m.get("WATCHDOG", "1") == "1" for _, m in mgr.msgs):
            ok("every watchdog message is WATCHDOG=1")
        else:
            bad("a watchdog message is not WATCHDOG=1: %s" % mgr.msgs)
        got, rc = stop(p, mgr, "wd")
        if got is not None and got[1]["STOPPING"] == "1":
            ok("SIGTERM: STOPPING=1")
        else:
            bad("SIGTERM: no STOPPING=1: " + log_tail("wd"))
        if rc == 0:
            ok("SIGTERM: exit 0")
        else:
            bad("SIGTERM: exit %s: %s" % (rc, log_tail("wd")))

    # ---- no watchdog asked for, or asked for another process: no pings ----
    for name, env in (("nowd", {}), ("otherpid", {"WATCHDOG_USEC": str(period_us),
                                                    "WATCHDOG_PID": "1"})):
        p, mgr, mport = start(name, env)
        got = mgr.wait_for("READY", 60)
        if got is None:
            bad("%s: no READY=1: %s" % (name, log_tail(name)))
            p.kill()
            p.wait()
            continue
        mgr.drain(1.0)
        n = len(mgr.times("WATCHDOG"))
        if n == 0:
            ok("%s: READY=1 and no WATCHDOG=1 in 1 s" % name)
        else:
            bad("%s: %d WATCHDOG=1 messages" % (name, n))
        got, rc = stop(p, mgr, name)
        if got is not None and rc == 0:
            ok("%s: STOPPING=1, exit 0" % name)
        else:
            bad("%s: STOPPING %s, exit %s" % (name, got, rc))
finally:
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    for r in regions:
        shutil.rmtree(r, ignore_errors=True)
    shutil.rmtree(work, ignore_errors=True)

print("%d passed, %d failed" % (passed, failed))
sys.exit(0 if failed == 0 else 1)

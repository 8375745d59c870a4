# SPDX-License-Identifier: Apache-2.0
"""Real kvtierd nodes for the vLLM tests and benchmark: a cluster of N daemons on
loopback, each with its own primary (a /dev/shm file in a folder of its own: kvtierd
refuses a region directly in a folder others may write), storage folder, engine
socket and network port, sharing one cluster secret."""

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time


def free_ports(n):
    """n distinct free ports (all held open until all are chosen)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class Cluster:
    """n kvtierd processes that know each other as peers. row_bytes is the nodes'
    chunk size (vLLM's row stride must equal it)."""

    def __init__(self, kvtierd, n=2, row_bytes=256 << 10, primary="64MiB", storage=True,
                 tmp=None, log_level="warn", network=True, workers=1, policy="lru",
                 engine_extra=""):
        self.kvtierd = kvtierd
        self.dir = tempfile.mkdtemp(prefix="kvt-vllm.", dir=tmp)
        self.n = n
        self.procs = [None] * n
        self.socks = [os.path.join(self.dir, "node%d.sock" % i) for i in range(n)]
        # Each region in a folder of its own (kvtierd refuses a folder others may
        # write, such as /dev/shm itself); kvtierd makes the folder.
        self.shm_dirs = ["/dev/shm/kvt-vllm-%d-%d-%s" % (os.getpid(), i,
                                                         os.path.basename(self.dir))
                         for i in range(n)]
        self.shm = [os.path.join(d, "primary.mmap") for d in self.shm_dirs]
        self.logs = [os.path.join(self.dir, "node%d.log" % i) for i in range(n)]
        chosen = free_ports(2 * n)
        self.metrics, ports = chosen[:n], chosen[n:]
        with open(os.path.join(self.dir, "secret"), "w") as f:
            f.write(os.urandom(36).hex())
        os.chmod(os.path.join(self.dir, "secret"), 0o600)
        self.cfgs = []
        for i in range(n):
            peers = "".join("    - 127.0.0.1:%d\n" % ports[j] for j in range(n) if j != i)
            cfg = os.path.join(self.dir, "node%d.yaml" % i)
            with open(cfg, "w") as f:
                f.write("node:\n  id: %d\n  namespace: kvt-vllm\n" % (i + 1))
                f.write("primary:\n  path: %s\n  size: %s\n  row_bytes: %d\n  workers: %d\n"
                        "  policy: %s\n" % (self.shm[i], primary, row_bytes, workers, policy))
                f.write("storage:\n  enabled: %s\n  root: %s\n  capacity: 256MiB\n"
                        % ("true" if storage else "false", os.path.join(self.dir, "st%d" % i)))
                f.write("network:\n  enabled: %s\n  listen: 127.0.0.1\n  port: %d\n"
                        % ("true" if network else "false", ports[i]))
                if peers:
                    f.write("  peers:\n" + peers)
                f.write("cluster:\n  secret_file: %s\n" % os.path.join(self.dir, "secret"))
                f.write("engine:\n  socket: %s\n%s" % (self.socks[i], engine_extra))
                f.write("metrics:\n  port: %d\n" % self.metrics[i])
                f.write("log:\n  level: %s\n" % log_level)
            self.cfgs.append(cfg)
        self.env = dict(os.environ, KVT_UCX_MODE=os.environ.get("KVT_UCX_MODE", "socket"),
                        UCX_NET_DEVICES=os.environ.get("UCX_NET_DEVICES", "lo"))
        self.env.setdefault("ASAN_OPTIONS", "detect_leaks=0")

    def start(self, i=None):
        for k in range(self.n) if i is None else [i]:
            log = open(self.logs[k], "a")
            self.procs[k] = subprocess.Popen([self.kvtierd, "--config", self.cfgs[k]],
                                             stdout=log, stderr=subprocess.STDOUT, env=self.env)
            log.close()
        for k in range(self.n) if i is None else [i]:
            deadline = time.monotonic() + 60
            while not os.path.exists(self.socks[k]):
                if self.procs[k].poll() is not None:
                    raise RuntimeError("kvtierd %d died:\n%s" % (k, self.log(k)))
                if time.monotonic() > deadline:
                    raise RuntimeError("kvtierd %d did not start:\n%s" % (k, self.log(k)))
                time.sleep(0.05)
        if self.n > 1 or i is None:
            time.sleep(1.0 if self.n > 1 else 0.0)  # heartbeats: the nodes find each other
        return self

    def log(self, i):
        with open(self.logs[i]) as f:
            return f.read()[-4000:]

    def kill(self, i):
        p = self.procs[i]
        if p is not None and p.poll() is None:
            p.kill()
            p.wait()

    def stop(self):
        """SIGTERM every node; returns their exit codes."""
        rcs = []
        for p in self.procs:
            if p is None:
                rcs.append(None)
                continue
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
            rcs.append(p.returncode)
        return rcs

    def cleanup(self):
        for i in range(self.n):
            self.kill(i)
        for path in self.shm:
            for suffix in ("", ".lock"):
                try:
                    os.unlink(path + suffix)
                except FileNotFoundError:
                    pass
        for d in self.shm_dirs:
            shutil.rmtree(d, ignore_errors=True)
        shutil.rmtree(self.dir, ignore_errors=True)

    def metric(self, i, name):
        """The largest sample of name (or name_total), any labels, in node i's
        /metrics; None when absent."""
        import urllib.request

        best = None
        with urllib.request.urlopen("http://127.0.0.1:%d/metrics" % self.metrics[i],
                                    timeout=5) as r:
            for line in r.read().decode().splitlines():
                for n in (name, name + "_total"):
                    if line.startswith(n + " ") or line.startswith(n + "{"):
                        v = float(line.rsplit(" ", 1)[1])
                        best = v if best is None else max(best, v)
        return best

    def wait_metric(self, i, name, at_least, timeout=5.0):
        """Node i's metric once it reaches at_least (/metrics is refreshed each
        second), or its last value."""
        deadline = time.monotonic() + timeout
        while True:
            v = self.metric(i, name)
            if (v is not None and v >= at_least) or time.monotonic() > deadline:
                return v
            time.sleep(0.2)

# SPDX-License-Identifier: Apache-2.0
"""kvtierd itself (not the stand-in) through python/kvtier and the kvtier CLI: what
needs the daemon's storage and network tiers.

- The module's docstring example, run as written against a node with a network tier:
  a key the node has not seen answers RETRY first, and the example stores it anyway.
- reset with a storage tier: refused while an engine holds a pin (the CLI exits 1),
  then every chunk dropped; a restart serves none of them (they were in the storage
  tier: a restart before the reset served them).
- The model fingerprint: the first engine's is the node's, another is refused with
  the node's reason and counted; the storage tier withholds its chunks after a
  restart until an engine of that fingerprint attaches, and drops them at a start
  with another node.model_fingerprint (counted).
- Two nodes: peers() and `kvtier peers` list each other with the bytes moved; a
  reset of the holder withdraws its directory records at once, so the other node's
  first verdict for its chunks is MISS, never HIT_PENDING.
- Two nodes, load jobs into an attached region: B's engine loads chunks A's engine
  stored; each row is READ from A straight into B's engine region (kvtier_net_pulled_
  into_chunks and /metrics' kvtier_engine_job_rows_read_direct count them, B's
  primary never holds them); a row A rewrites while B reads fails its key, never
  arrives as wrong bytes.

Run by ctest (label "node"): argv[1] kvtierd, argv[2] the kvtier CLI;
$KVTIER_CLIENT_LIB the library, $PYTHONPATH the package's folder."""

import errno
import mmap
import socket
import urllib.request
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import unittest

import kvtier

KVTIERD = CLI = None
ROW = 64 * 1024


def key(tag, i):
    return kvtier.make_key(b"%s-%d" % (tag.encode(), i), 0)


def content(k):
    return (k * (ROW // len(k) + 1))[:ROW]


class Node:
    """One kvtierd with its folders under work/name (its region on /dev/shm)."""

    def __init__(self, work, name, node_id, secret, storage=True, network=True, seeds=(),
                 listen=None, advertise=None):
        self.dir = os.path.join(work, name)
        os.makedirs(self.dir, exist_ok=True)
        self.shm = "/dev/shm/kvt-py-%d-%s" % (os.getpid(), name)
        self.sock = os.path.join(self.dir, "engine.sock")
        self.log = os.path.join(self.dir, "daemon.log")
        self.node_id, self.secret, self.storage, self.network = node_id, secret, storage, network
        self.seeds = list(seeds)
        self.listen, self.advertise = listen, advertise
        self.fingerprint = None
        self.metrics_port = 0  # 0: no /metrics
        self.proc = None
        self.port = None

    def config(self):
        lines = ["node:", "  id: %d" % self.node_id]
        if self.fingerprint is not None:
            lines.append("  model_fingerprint: %s" % self.fingerprint)
        lines += ["primary:", "  path: %s/region" % self.shm, "  size: 32MiB",
                  "  row_bytes: 64KiB",
                  "storage:", "  enabled: %s" % ("true" if self.storage else "false"),
                  "  root: %s/storage" % self.dir, "  capacity: 128MiB",
                  "network:", "  enabled: %s" % ("true" if self.network else "false"),
                  "  port: 0", "  peers: [%s]" % ", ".join('"%s"' % s for s in self.seeds),
                  "  heartbeat_ms: 100",
                  "  listen: \"%s\"" % (self.listen or "127.0.0.1"),
                  "  advertise: \"%s\"" % (self.advertise or ""),
                  "cluster:", "  secret_file: %s" % self.secret,
                  "engine:", "  socket: %s" % self.sock,
                  "metrics:", "  port: %d" % self.metrics_port,
                  "log:", "  level: info"]
        return "\n".join(lines) + "\n"

    def start(self):
        cfg = os.path.join(self.dir, "kvtierd.yaml")
        with open(cfg, "w") as f:
            f.write(self.config())
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen([KVTIERD, "--config", cfg], stdout=out,
                                         stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("kvtierd exited %d:\n%s" % (self.proc.returncode,
                                                               self.read_log()[-3000:]))
            text = self.read_log()
            if "kvtierd: ready" in text:
                m = re.search(r"network: node [0-9a-f]+ incarnation [0-9a-f]+ on \S*:(\d+)",
                              text)
                self.port = int(m.group(1)) if m else None
                return
            time.sleep(0.05)
        raise RuntimeError("kvtierd not ready:\n" + self.read_log()[-3000:])

    def stop(self):
        """SIGTERM: it must exit 0 (nothing pinned at exit)."""
        self.proc.send_signal(signal.SIGTERM)
        rc = self.proc.wait(timeout=30)
        self.proc = None
        if rc != 0:
            raise RuntimeError("kvtierd exited %d after SIGTERM:\n%s" % (rc,
                                                                       self.read_log()[-3000:]))

    def restart(self):
        self.stop()
        self.start()

    def kill(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def read_log(self):
        with open(self.log, errors="replace") as f:
            return f.read()

    def client(self, name, fingerprint=None):
        return kvtier.Client(self.sock, name=name, timeout_ms=10000, fingerprint=fingerprint)

    def cli(self, *args):
        p = subprocess.run([CLI] + list(args) + ["--socket", self.sock], capture_output=True,
                           text=True, timeout=60)
        return p.returncode, p.stdout + p.stderr


def total(c, name, label=None):
    """A stat of the node's totals, summed over labels unless one is named."""
    v = 0.0
    for s in c.get_stats(totals=True):
        if s.name == name and (label is None or s.label == label):
            v += s.value if s.kind != 2 else s.count
    return v


def resolve(c, req, keys, seen=None, steps=2000):
    """Looks keys up until none answers RETRY or HIT_PENDING (the docstring's loop);
    every verdict seen per key goes to seen when given."""
    res = c.lookup(req, keys)
    for _ in range(steps):
        if seen is not None:
            for k, r in zip(keys, res):
                seen.setdefault(k, []).append(r)
        if kvtier.RETRY not in res and kvtier.HIT_PENDING not in res:
            return res
        c.on_schedule_end()
        time.sleep(0.002)
        res = c.lookup(req, keys)
    raise AssertionError("still pending: %s" % res)


def store(c, req, keys):
    c.on_new_request(req)
    plan = c.prepare_store(req, keys)
    for idx, chunk in plan.stores:
        c.row(chunk)[:] = content(keys[idx])
    c.complete_store(req, keys)
    c.on_request_finished(req)
    c.on_schedule_end()


def load_and_check(test, c, req, keys):
    ids = c.prepare_load(req, keys)
    for k, chunk in zip(keys, ids):
        test.assertEqual(bytes(c.row(chunk)), content(k))
    c.complete_load(req, keys)


class Kvtierd(unittest.TestCase):
    def setUp(self):
        self.work = tempfile.mkdtemp(prefix="kvtierd-py.", dir=os.environ.get("KVT_TEST_TMPDIR"))
        self.secret = os.path.join(self.work, "secret")
        with open(self.secret, "wb") as f:
            f.write(os.urandom(32).hex().encode())
        os.chmod(self.secret, 0o600)
        self.nodes = []

    def tearDown(self):
        for n in self.nodes:
            n.kill()
            shutil.rmtree(n.shm, ignore_errors=True)
        shutil.rmtree(self.work, ignore_errors=True)

    def node(self, name, node_id, **kw):
        n = Node(self.work, name, node_id, self.secret, **kw)
        self.nodes.append(n)
        return n

    def wait_storage(self, c, files):
        for _ in range(2000):
            c.on_schedule_end()
            if total(c, "kvtier_storage_files") >= files:
                return
            time.sleep(0.005)
        self.fail("the storage tier never held %d files" % files)

    def test_docstring_example_with_a_network_tier(self):
        n = self.node("doc", 0x11, storage=False)
        n.start()
        with n.client("probe") as c:
            c.on_new_request("probe")
            # Why the example loops: a key the node has not seen answers RETRY first.
            self.assertEqual(c.lookup("probe", [key("probe", 1)]), [kvtier.RETRY])
            c.on_request_finished("probe")
        doc = kvtier.__doc__
        start = doc.index("    import time\n")
        example = textwrap.dedent(doc[start:doc.index("\n\n", start)])
        example = example.replace('"/run/kvtier/engine.sock"', repr(n.sock))
        hashes = [b"doc-hash-%02d" % i for i in range(6)]
        exec(compile(example, "kvtier.__doc__", "exec"),
             {"hashes": hashes, "chunk_bytes_of": content})
        keys = [kvtier.make_key(h, 0) for h in hashes]
        with n.client("reader") as c:
            c.on_new_request("r")
            self.assertEqual(resolve(c, "r", keys), [kvtier.HIT] * 6)
            load_and_check(self, c, "r", keys)
            c.on_request_finished("r")
        n.stop()

    def test_reset_with_storage_across_restarts(self):
        n = self.node("reset", 0x12, network=False)
        n.start()
        keys = [key("rs", i) for i in range(8)]
        with n.client("writer") as c:
            store(c, "w", keys)
            self.wait_storage(c, 8)
        n.restart()  # a restart serves them: they are in the storage tier
        with n.client("a") as a, n.client("b") as b:
            a.on_new_request("a")
            self.assertEqual(resolve(a, "a", keys), [kvtier.HIT] * 8)
            load_and_check(self, a, "a", keys)
            b.on_new_request("b")
            b.prepare_load("b", keys[:1])  # a pin: a reset would wipe its row
            rc, out = n.cli("reset")
            self.assertEqual(rc, 1, out)
            self.assertIn("reset refused", out)
            with self.assertRaises(kvtier.KvtierError) as e:
                a.reset()
            self.assertEqual(e.exception.errno, errno.EBUSY)
            self.assertEqual(total(a, "kvtier_engine_refused", "reset_busy"), 2)
            self.assertEqual(a.lookup("a", keys), [kvtier.HIT] * 8)  # nothing changed
            b.complete_load("b", keys[:1])
            b.on_request_finished("b")
            rc, out = n.cli("reset")
            self.assertEqual(rc, 0, out)
            self.assertEqual(total(a, "kvtier_storage_reset_drops"), 8)
            self.assertEqual(resolve(a, "a", keys), [kvtier.MISS] * 8)
            a.on_request_finished("a")
            self.wait_storage(a, 0)
        n.restart()
        with n.client("after") as c:
            c.on_new_request("c")
            self.assertEqual(resolve(c, "c", keys), [kvtier.MISS] * 8)
            self.assertEqual(total(c, "kvtier_storage_files"), 0)
            c.on_request_finished("c")
        n.stop()

    def test_model_fingerprint(self):
        n = self.node("fp", 0x13, network=False)
        n.start()
        k = [key("fp", 1)]
        with n.client("m1", fingerprint="model-one") as c:
            self.assertEqual(c.node_fingerprint, "model-one")
            store(c, "s", k)
            self.wait_storage(c, 1)
            with self.assertRaises(kvtier.KvtierError) as e:
                n.client("m2", fingerprint="model-two")
            self.assertEqual(e.exception.errno, errno.EKEYREJECTED)
            self.assertIn("'model-two'", e.exception.reason)
            self.assertIn("'model-one'", e.exception.reason)
            self.assertEqual(total(c, "kvtier_engine_refused", "fingerprint"), 1)
        rc, out = n.cli("status")
        self.assertIn("model      model-one", out)

        # Restarted with no fingerprint configured: the storage tier withholds its
        # chunks until an engine of the recorded fingerprint attaches.
        n.restart()
        rc, out = n.cli("status")
        self.assertIn("withheld", out)
        with n.client("tool") as t:
            t.on_new_request("t")
            self.assertEqual(resolve(t, "t", k), [kvtier.MISS])
            t.on_request_finished("t")
            with n.client("m1", fingerprint="model-one") as c:
                c.on_new_request("s2")
                self.assertEqual(resolve(c, "s2", k), [kvtier.HIT])
                load_and_check(self, c, "s2", k)
                c.on_request_finished("s2")
            self.assertEqual(total(t, "kvtier_storage_withheld"), 0)

        # Another model configured: the files are dropped at start (counted).
        n.fingerprint = "model-two"
        n.restart()
        with n.client("m2", fingerprint="model-two") as c:
            self.assertEqual(total(c, "kvtier_storage_fingerprint_drops"), 1)
            c.on_new_request("s3")
            self.assertEqual(resolve(c, "s3", k), [kvtier.MISS])
            c.on_request_finished("s3")
            with self.assertRaises(kvtier.KvtierError) as e:
                n.client("m1", fingerprint="model-one")
            self.assertEqual(e.exception.errno, errno.EKEYREJECTED)
        n.stop()

    def metrics(self, n):
        """n's /metrics text, the next snapshot (n.metrics_port was set)."""
        time.sleep(1.2)
        url = "http://127.0.0.1:%d/metrics" % n.metrics_port
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.read().decode()

    def test_load_jobs_read_peer_rows_into_the_region(self):
        a = self.node("ja", 0xA, storage=False)
        a.start()
        b = self.node("jb", 0xB, storage=False, seeds=["127.0.0.1:%d" % a.port])
        with socket.socket() as sk:
            sk.bind(("127.0.0.1", 0))
            b.metrics_port = sk.getsockname()[1]
        b.start()
        region = os.path.join(self.work, "engine-b.region")
        rows = 8
        fd = os.open(region, os.O_RDWR | os.O_CREAT, 0o600)
        os.ftruncate(fd, rows * ROW)
        mm = mmap.mmap(fd, rows * ROW)
        try:
            with a.client("ea") as ea, b.client("eb") as eb:
                for _ in range(500):
                    if len([p for p in eb.peers() if p.state == kvtier.PEER_ALIVE]) == 1:
                        break
                    time.sleep(0.02)
                keys = [key("direct", i) for i in range(5)]
                store(ea, "sa", keys)
                eb.attach_region(fd, 0, rows, ROW)
                mm[:] = b"\xee" * (rows * ROW)
                # The lookup: RETRY while A is located, then HIT (never HIT_PENDING:
                # nothing is promoted into B's primary).
                seen = set()
                for _ in range(2000):
                    verdicts, _ = eb.jobs_step(keys)
                    seen.update(verdicts)
                    if verdicts == [kvtier.HIT] * 5:
                        break
                    time.sleep(0.005)
                self.assertEqual(verdicts, [kvtier.HIT] * 5)
                self.assertNotIn(kvtier.HIT_PENDING, seen)
                dest = [7, 0, 3, 1, 5]
                _, fin = eb.jobs_step([], [kvtier.Job(30, kvtier.JOB_LOAD, keys, dest)])
                done = {d.id: d for d in fin}
                for _ in range(2000):
                    if 30 in done:
                        break
                    time.sleep(0.002)
                    _, fin = eb.jobs_step()
                    done.update({d.id: d for d in fin})
                self.assertTrue(done[30].ok, done[30].key_ok)
                for k, r in zip(keys, dest):
                    self.assertEqual(mm[r * ROW:(r + 1) * ROW], content(k), "row %d" % r)
                for r in set(range(rows)) - set(dest):
                    self.assertEqual(mm[r * ROW:(r + 1) * ROW], b"\xee" * ROW, "row %d" % r)
                self.assertEqual(total(eb, "kvtier_net_pulled_into_chunks"), 5)
                text = self.metrics(b)
                self.assertRegex(text, r"(?m)^kvtier_engine_job_rows_read_direct_total 5$")
                self.assertRegex(text, r"(?m)^kvtier_primary_chunks 0$")
                # Not in B's primary: a plain lookup is no HIT at first.
                eb.on_new_request("plain")
                first = eb.lookup("plain", keys)
                self.assertNotIn(kvtier.HIT, first)
                eb.on_request_finished("plain")
                eb.on_schedule_end()
        finally:
            mm.close()
            os.close(fd)
        b.stop()
        a.stop()

    def test_two_nodes_peers_and_reset(self):
        a = self.node("a", 0xA, storage=False)
        a.start()
        b = self.node("b", 0xB, storage=False, seeds=["127.0.0.1:%d" % a.port])
        b.start()
        with a.client("ea") as ea, b.client("eb") as eb:
            for _ in range(500):
                if len([p for p in ea.peers() if p.state == kvtier.PEER_ALIVE]) == 1:
                    break
                time.sleep(0.02)
            pulled = [key("net", i) for i in range(3)]
            other = [key("net", i) for i in range(3, 6)]
            store(ea, "sa", pulled + other)
            eb.on_new_request("rb")
            self.assertEqual(resolve(eb, "rb", pulled), [kvtier.HIT] * 3)
            load_and_check(self, eb, "rb", pulled)
            eb.on_request_finished("rb")

            pa = {p.node_id: p for p in ea.peers()}
            self.assertEqual(pa[0xA].state, kvtier.PEER_SELF)
            self.assertEqual(pa[0xB].state, kvtier.PEER_ALIVE)
            self.assertGreaterEqual(pa[0xB].served_bytes, 3 * ROW)
            pb = {p.node_id: p for p in eb.peers()}
            self.assertGreaterEqual(pb[0xA].pulled_bytes, 3 * ROW)
            self.assertEqual(pb[0xA].port, a.port)
            rc, out = a.cli("peers")
            self.assertEqual(rc, 0, out)
            self.assertRegex(out, r"(?m)^000000000000000b [0-9a-f]{16} 127\.0\.0\.1:%d +up"
                             % b.port)
            rc, out = a.cli("status")
            self.assertIn("cluster    2 of 2 members up", out)

            # A's reset withdraws its records at once: B's first verdict for the
            # chunks it never pulled is MISS (a record would make it HIT_PENDING).
            ea.reset()
            eb.on_new_request("rb2")
            seen = {}
            self.assertEqual(resolve(eb, "rb2", other, seen), [kvtier.MISS] * 3)
            for k in other:
                self.assertNotIn(kvtier.HIT_PENDING, seen[k])
                self.assertNotIn(kvtier.HIT, seen[k])
            eb.on_request_finished("rb2")
        b.stop()
        a.stop()

    def test_three_hosts_advertised_addresses(self):
        """A listens on every address and advertises 127.0.0.3; B and C listen on IPv6
        ::1, C seeded with B only: C learns A's advertised address from B's member list,
        dials it and pulls A's chunks byte for byte; peers() shows what each advertised."""
        a = self.node("a", 0xA, storage=False, listen="0.0.0.0", advertise="127.0.0.3")
        a.start()
        b = self.node("b", 0xB, storage=False, listen="::1", seeds=["127.0.0.3:%d" % a.port])
        b.start()
        c = self.node("c", 0xC, storage=False, listen="::1", seeds=["[::1]:%d" % b.port])
        c.start()
        with a.client("ea") as ea, c.client("ec") as ec:
            for _ in range(500):
                if len([p for p in ec.peers() if p.state == kvtier.PEER_ALIVE]) == 2:
                    break
                time.sleep(0.02)
            pc = {p.node_id: p for p in ec.peers()}
            self.assertEqual(pc[0xA].state, kvtier.PEER_ALIVE)
            self.assertEqual((pc[0xA].addr, pc[0xA].port), ("127.0.0.3", a.port))
            self.assertEqual((pc[0xB].addr, pc[0xB].port), ("::1", b.port))
            self.assertEqual(pc[0xC].addr, "::1")
            self.assertEqual({p.node_id: p for p in ea.peers()}[0xA].addr, "127.0.0.3")
            keys = [key("adv", i) for i in range(4)]
            store(ea, "sa", keys)
            ec.on_new_request("rc")
            self.assertEqual(resolve(ec, "rc", keys), [kvtier.HIT] * 4)
            load_and_check(self, ec, "rc", keys)
            ec.on_request_finished("rc")
            self.assertGreaterEqual({p.node_id: p for p in ec.peers()}[0xA].pulled_bytes,
                                    4 * ROW)
        for n in (c, b, a):
            n.stop()


if __name__ == "__main__":
    KVTIERD = sys.argv.pop(1)
    CLI = sys.argv.pop(1)
    unittest.main(verbosity=2)

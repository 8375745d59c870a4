"""The Python module (python/kvtier, the package's ctypes layer) against the engine API server.

Run by ctest (label "node"): argv[1] the test server (kvt-test-engine-server),
$KVTIER_CLIENT_LIB the library, $PYTHONPATH the module's folder. Each test class
starts its own server in a fresh folder; the server's last line on SIGTERM says
what it cleaned up and what is left, and every test ends with nothing left."""

import errno
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import unittest

import kvtier

SERVER = None
NUM_CHUNKS, PAGE, WORKERS = 16, 4096, 2


def key(i):
    return kvtier.make_key(str(i).encode(), 0)


class Server:
    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="kvtier-py.", dir=os.environ.get("KVT_TEST_TMPDIR"))
        self.sock = os.path.join(self.dir, "engine.sock")
        self.proc = subprocess.Popen(
            [SERVER, self.sock, os.path.join(self.dir, "region"), str(NUM_CHUNKS), str(PAGE),
             str(WORKERS)], stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        if line.strip() != "ready":
            self.proc.kill()
            raise RuntimeError("server did not start: %r" % line)

    def stop(self):
        """SIGTERM; returns the server's report as a dict of ints."""
        self.proc.send_signal(signal.SIGTERM)
        out, _ = self.proc.communicate(timeout=30)
        if self.proc.returncode != 0:
            raise RuntimeError("server exited %d" % self.proc.returncode)
        last = out.strip().splitlines()[-1]
        return {k: int(v) for k, v in (f.split("=") for f in last.split())}


class KvtierPy(unittest.TestCase):
    def setUp(self):
        self.srv = Server()

    def tearDown(self):
        if self.srv.proc.poll() is None:
            self.srv.proc.kill()
            self.srv.proc.wait()
        self.srv.proc.stdout.close()

    def connect(self, name):
        return kvtier.Client(self.srv.sock, name=name, timeout_ms=10000)

    def finish(self):
        rep = self.srv.stop()
        self.assertEqual(rep["requests_left"], 0)
        self.assertEqual(rep["write_pending"], 0)
        self.assertEqual(rep["pinned"], 0)
        return rep

    def test_geometry(self):
        with self.connect("geo") as c:
            self.assertEqual(c.num_chunks, NUM_CHUNKS)
            self.assertEqual(c.page_bytes, PAGE)
            self.assertEqual(c.num_workers, WORKERS)
            self.assertEqual(c.row_bytes, PAGE * WORKERS)
            self.assertEqual(len(c.row(3)), PAGE * WORKERS)
            self.assertEqual(len(c.cell(3, 1)), PAGE)
            self.assertGreater(c.max_keys, 0)
            with self.assertRaises(IndexError):
                c.row(NUM_CHUNKS)
        self.finish()

    def test_store_then_load_in_another_client(self):
        a, b = self.connect("a"), self.connect("b")
        keys = [key(i) for i in range(3)]
        self.assertEqual(a.on_new_request("a-1"), kvtier.CHUNK_LEVEL)
        self.assertEqual(a.lookup("a-1", keys), [kvtier.MISS] * 3)
        plan = a.prepare_store("a-1", keys)
        self.assertEqual(sorted(i for i, _ in plan.stores), [0, 1, 2])
        self.assertEqual(plan.evicted, [])
        for i, chunk in plan.stores:
            a.row(chunk)[:] = bytes([0x30 + i]) * a.row_bytes
        a.complete_store("a-1", keys)
        a.on_schedule_end(new=["a-1"])

        b.on_new_request("b-1", params_json='{"x": 1}',
                         load_tiers=[(kvtier.MEDIUM_CPU, kvtier.ANY)])
        self.assertEqual(b.lookup("b-1", keys + [key(99)], prefix=True),
                         [kvtier.HIT] * 3 + [kvtier.MISS])
        ids = b.prepare_load("b-1", keys)
        for i, chunk in enumerate(ids):
            self.assertEqual(bytes(b.row(chunk)), bytes([0x30 + i]) * b.row_bytes)
        with self.assertRaises(kvtier.KvtierError) as e:
            a.complete_load(None, keys)  # not a's pins
        self.assertEqual(e.exception.errno, errno.EINVAL)
        b.complete_load("b-1", keys)
        b.touch(keys)

        evs = a.take_events()
        self.assertEqual(len(evs), 1)
        self.assertEqual(evs[0].keys, keys)
        self.assertFalse(evs[0].removed)
        stats = a.get_stats()
        self.assertTrue(stats and all(s.name for s in stats))
        # Each histogram with its own buckets: vLLM's for the allocation sizes.
        alloc = [s for s in stats if s.name == "vllm:kv_offload_cpu_allocation_size"]
        self.assertEqual(len(alloc), 1)
        self.assertEqual(alloc[0].bounds,
                         (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144))
        self.assertEqual(sum(alloc[0].buckets), alloc[0].count)
        self.assertTrue(all(s.bounds == () for s in stats if s.kind != kvtier.HISTOGRAM))

        a.on_request_finished("a-1")
        b.on_request_finished("b-1")
        a.close()
        b.close()
        self.finish()

    def test_errors(self):
        with self.connect("e") as c:
            c.on_new_request("e-1")
            with self.assertRaises(kvtier.KvtierError) as e:
                c.on_new_request("e-1")
            self.assertEqual(e.exception.errno, errno.EEXIST)
            with self.assertRaises(kvtier.KvtierError) as e:
                c.complete_store("e-1", [key(1)])
            self.assertEqual(e.exception.errno, errno.EINVAL)
            with self.assertRaises(ValueError):
                c.lookup("e-1", [b""])
            # Fill the primary with pinned chunks: cannot store.
            for base in (0, 8):
                ks = [key(100 + base + i) for i in range(8)]
                c.prepare_store("e-1", ks)
                c.complete_store("e-1", ks)
                c.prepare_load("e-1", ks)
            with self.assertRaises(kvtier.KvtierError) as e:
                c.prepare_store("e-1", [key(500)])
            self.assertEqual(e.exception.errno, errno.ENOSPC)
            c.on_request_finished("e-1")
        rep = self.finish()  # the close released the 16 pins
        self.assertEqual(rep["released_pins"], 16)

    def test_killed_python_engine(self):
        child = textwrap.dedent("""
            import os, sys, time, kvtier
            c = kvtier.Client(sys.argv[1], name="doomed")
            k = lambda i: kvtier.make_key(str(i).encode(), 0)
            c.on_new_request("doomed-1")
            c.prepare_store("doomed-1", [k(1), k(2)])          # never completed
            c.prepare_store("doomed-1", [k(3)])
            c.complete_store("doomed-1", [k(3)])
            c.prepare_load("doomed-1", [k(3)])                  # never unpinned
            print("held", flush=True)
            time.sleep(60)
        """)
        p = subprocess.Popen([sys.executable, "-c", child, self.srv.sock],
                             stdout=subprocess.PIPE, text=True)
        self.assertEqual(p.stdout.readline().strip(), "held")
        with self.connect("survivor") as c:
            c.on_new_request("s-1")
            # key 1 is being written by the child: nothing to store, HIT_PENDING.
            self.assertEqual(c.lookup("s-1", [key(1)]), [kvtier.HIT_PENDING])
            p.kill()
            p.wait()
            p.stdout.close()
            for _ in range(1000):
                if c.lookup("s-1", [key(1)]) == [kvtier.MISS]:
                    break
                time.sleep(0.01)
            self.assertEqual(c.lookup("s-1", [key(1), key(2)]), [kvtier.MISS] * 2)
            plan = c.prepare_store("s-1", [key(1), key(2)])
            self.assertEqual(len(plan.stores), 2)
            c.complete_store("s-1", [key(1), key(2)], success=False)
            c.on_request_finished("s-1")
        rep = self.finish()
        self.assertEqual(rep["released_pins"], 1)
        self.assertEqual(rep["aborted_stores"], 1)
        self.assertEqual(rep["finished_reqs"], 1)

    def test_reset_busy_then_done(self):
        a, b = self.connect("a"), self.connect("b")
        self.assertEqual(a.node_minor, 1)
        keys = [key(i) for i in range(40, 43)]
        a.on_new_request("ra")
        plan = a.prepare_store("ra", keys)
        for _, chunk in plan.stores:
            a.row(chunk)[:] = b"\x11" * a.row_bytes
        a.complete_store("ra", keys)
        b.on_new_request("rb")
        b.prepare_load("rb", keys[:1])  # b holds a pin: a reset would wipe its row
        with self.assertRaises(kvtier.KvtierError) as e:
            a.reset()
        self.assertEqual(e.exception.errno, errno.EBUSY)
        self.assertEqual(a.lookup("ra", keys), [kvtier.HIT] * 3)  # nothing changed
        b.complete_load("rb", keys[:1])
        self.assertFalse(a.has_pending_work())
        a.reset()
        self.assertEqual(a.lookup("ra", keys), [kvtier.MISS] * 3)
        self.assertEqual(b.lookup("rb", keys), [kvtier.MISS] * 3)
        self.assertEqual(a.take_events(), [])  # they described chunks that are gone
        with self.assertRaises(kvtier.KvtierError) as e:
            a.peers()  # the stand-in has no cluster
        self.assertEqual(e.exception.errno, errno.EOPNOTSUPP)
        a.on_request_finished("ra")
        b.on_request_finished("rb")
        a.close()
        b.close()
        self.finish()

    def test_fingerprint_refused_with_reason(self):
        a = kvtier.Client(self.srv.sock, name="a", fingerprint="model-one")
        self.assertEqual(a.node_fingerprint, "model-one")  # the first declared sets it
        with self.assertRaises(kvtier.KvtierError) as e:
            kvtier.Client(self.srv.sock, name="b", fingerprint="model-two")
        self.assertEqual(e.exception.errno, errno.EKEYREJECTED)
        self.assertIn("'model-two'", e.exception.reason)
        self.assertIn("'model-one'", e.exception.reason)
        self.assertIn("model-one", str(e.exception))
        with kvtier.Client(self.srv.sock, name="tool") as t:  # declares none: accepted
            self.assertEqual(t.node_fingerprint, "model-one")
        with self.assertRaises(ValueError):
            kvtier.Client(self.srv.sock, fingerprint="x" * 256)
        a.close()
        self.finish()


if __name__ == "__main__":
    SERVER = sys.argv.pop(1)
    unittest.main(verbosity=2)

"""Attached regions and jobs (node/engine_jobs.c) through python/kvtier against the
engine API server: what kvtier.vllm builds on.

Run by ctest (label "node"): argv[1] the test server (kvt-test-engine-server),
$KVTIER_CLIENT_LIB the library, $PYTHONPATH the package's folder. Each engine's
region is a file of its own (as vLLM's /dev/shm one); the node maps it from the fd
the client passes and copies rows between it and the node's primary."""

import errno
import mmap
import os
import signal
import subprocess
import sys
import tempfile
import unittest

import kvtier

SERVER = None
NUM_CHUNKS, PAGE, WORKERS = 16, 4096, 2
ROW = PAGE * WORKERS


def key(i):
    return kvtier.make_key(b"jobs-%d" % i, 0)


def pattern(i):
    return (b"%08d" % i) * (ROW // 8)


class Region:
    """An engine's own region: rows of ROW bytes in a file, mapped here."""

    def __init__(self, path, rows, offset=0):
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        os.ftruncate(self.fd, offset + rows * ROW)
        self.rows, self.offset = rows, offset
        self.map = mmap.mmap(self.fd, offset + rows * ROW)

    def row(self, r):
        off = self.offset + r * ROW
        return self.map[off:off + ROW]

    def write(self, r, data):
        off = self.offset + r * ROW
        self.map[off:off + ROW] = data

    def close(self):
        self.map.close()
        os.close(self.fd)


class EngineJobs(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="kvtier-jobs.", dir=os.environ.get("KVT_TEST_TMPDIR"))
        self.sock = os.path.join(self.dir, "engine.sock")
        self.proc = subprocess.Popen(
            [SERVER, self.sock, os.path.join(self.dir, "region"), str(NUM_CHUNKS), str(PAGE),
             str(WORKERS)], stdout=subprocess.PIPE, text=True)
        self.assertEqual(self.proc.stdout.readline().strip(), "ready")
        self.regions = []

    def tearDown(self):
        for r in self.regions:
            r.close()
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()

    def finish(self):
        """SIGTERM; the server's report says nothing is left in the manager."""
        self.proc.send_signal(signal.SIGTERM)
        out, _ = self.proc.communicate(timeout=30)
        self.assertEqual(self.proc.returncode, 0)
        rep = {k: int(v) for k, v in (f.split("=") for f in out.strip().splitlines()[-1].split())}
        self.assertEqual(rep["requests_left"], 0)
        self.assertEqual(rep["write_pending"], 0)
        self.assertEqual(rep["pinned"], 0)

    def engine(self, name, rows=8, offset=0):
        c = kvtier.Client(self.sock, name=name, timeout_ms=10000)
        r = Region(os.path.join(self.dir, name + ".region"), rows, offset)
        self.regions.append(r)
        return c, r

    def step_until_done(self, c, want_ids, lookup=()):
        """Polls with empty steps until every job in want_ids is reported (once)."""
        done = {}
        for _ in range(1000):
            _, fin = c.jobs_step(lookup)
            for d in fin:
                self.assertNotIn(d.id, done, "a job reported twice")
                done[d.id] = d
            if set(done) >= set(want_ids):
                return done
        self.fail("jobs %s never finished" % sorted(set(want_ids) - set(done)))

    def test_attach_checks_the_geometry(self):
        c, r = self.engine("geo", rows=8)
        with c:
            # Jobs before a region: refused.
            with self.assertRaises(kvtier.KvtierError) as e:
                c.jobs_step([key(1)])
            self.assertEqual(e.exception.errno, errno.ENOTCONN)
            # A stride other than the node's rows.
            with self.assertRaises(kvtier.KvtierError) as e:
                c.attach_region(r.fd, 0, 8, ROW // 2)
            self.assertEqual(e.exception.errno, errno.EINVAL)
            # More rows than the file holds.
            with self.assertRaises(kvtier.KvtierError) as e:
                c.attach_region(r.fd, 0, 9, ROW)
            self.assertEqual(e.exception.errno, errno.EINVAL)
            # An offset that is not page aligned.
            with self.assertRaises(kvtier.KvtierError) as e:
                c.attach_region(r.fd, 100, 4, ROW)
            self.assertEqual(e.exception.errno, errno.EINVAL)
            # Not a regular file.
            rd, wr = os.pipe()
            try:
                with self.assertRaises(kvtier.KvtierError) as e:
                    c.attach_region(rd, 0, 1, ROW)
                self.assertEqual(e.exception.errno, errno.EINVAL)
            finally:
                os.close(rd)
                os.close(wr)
            # The refusals changed nothing: the right geometry attaches, once.
            self.assertEqual(c.attach_region(r.fd, 0, 8, ROW), ROW)
            with self.assertRaises(kvtier.KvtierError) as e:
                c.attach_region(r.fd, 0, 8, ROW)
            self.assertEqual(e.exception.errno, errno.EBUSY)
            # A row out of the region refuses the whole step: the store beside it
            # does not run.
            r.write(0, pattern(1))
            with self.assertRaises(kvtier.KvtierError) as e:
                c.jobs_step([], [kvtier.Job(1, kvtier.JOB_STORE, [key(1)], [0]),
                                 kvtier.Job(2, kvtier.JOB_LOAD, [key(2)], [8])])
            self.assertEqual(e.exception.errno, errno.EINVAL)
            with self.assertRaises(kvtier.KvtierError) as e:
                c.jobs_step([], [kvtier.Job(3, 7, [key(1)], [0])])
            self.assertEqual(e.exception.errno, errno.EINVAL)
            verdicts, done = c.jobs_step([key(1)])
            self.assertEqual(verdicts, [kvtier.MISS])
            self.assertEqual(done, [])
        self.finish()

    def test_store_in_one_engine_load_in_another(self):
        a, ra = self.engine("a", rows=8, offset=mmap.PAGESIZE * 2)
        b, rb = self.engine("b", rows=8)
        with a, b:
            a.attach_region(ra.fd, ra.offset, ra.rows, ROW)
            b.attach_region(rb.fd, 0, rb.rows, ROW)
            keys = [key(i) for i in range(5)]
            for i in range(5):
                ra.write(i + 2, pattern(i))
            _, done = a.jobs_step([], [kvtier.Job(10, kvtier.JOB_STORE, keys, [2, 3, 4, 5, 6])])
            done = {d.id: d for d in done} or self.step_until_done(a, [10])
            self.assertTrue(done[10].ok)
            self.assertEqual(done[10].key_ok, [True] * 5)
            # The node holds them: b's lookups are HITs, an unknown key a MISS.
            verdicts, _ = b.jobs_step(keys + [key(99)])
            self.assertEqual(verdicts, [kvtier.HIT] * 5 + [kvtier.MISS])
            # b loads them into other rows; every byte is a's.
            rb.write(7, b"\xee" * ROW)
            _, done = b.jobs_step([], [kvtier.Job(20, kvtier.JOB_LOAD, keys, [7, 0, 1, 2, 3])])
            done = {d.id: d for d in done} or self.step_until_done(b, [20])
            self.assertTrue(done[20].ok)
            for i, row in enumerate([7, 0, 1, 2, 3]):
                self.assertEqual(rb.row(row), pattern(i), "row %d" % row)
            # Storing a key the node holds already is a success with no copy.
            _, done = b.jobs_step([], [kvtier.Job(21, kvtier.JOB_STORE, [keys[0]], [5])])
            self.assertEqual([(d.id, d.ok) for d in done], [(21, True)])
        self.finish()

    def test_partial_failure_says_which_keys(self):
        a, ra = self.engine("p", rows=4)
        with a:
            a.attach_region(ra.fd, 0, 4, ROW)
            ra.write(0, pattern(7))
            _, done = a.jobs_step([], [kvtier.Job(1, kvtier.JOB_STORE, [key(7)], [0])])
            self.assertTrue(done[0].ok)
            ra.write(1, b"\x11" * ROW)
            ra.write(2, b"\x22" * ROW)
            _, done = a.jobs_step([], [kvtier.Job(2, kvtier.JOB_LOAD, [key(7), key(8)], [1, 2])])
            self.assertEqual(len(done), 1)
            self.assertEqual(done[0].id, 2)
            self.assertFalse(done[0].ok)
            self.assertEqual(done[0].key_ok, [True, False])
            self.assertEqual(ra.row(1), pattern(7))
            # Every job is reported exactly once: nothing more comes.
            _, done = a.jobs_step()
            self.assertEqual(done, [])
        self.finish()

    def test_client_gone_leaves_nothing(self):
        a, ra = self.engine("gone", rows=4)
        a.attach_region(ra.fd, 0, 4, ROW)
        ra.write(0, pattern(3))
        a.jobs_step([key(5)], [kvtier.Job(1, kvtier.JOB_STORE, [key(3)], [0]),
                               kvtier.Job(2, kvtier.JOB_LOAD, [key(4)], [1])])
        a.close()  # with a job's report unread
        with kvtier.Client(self.sock, name="after", timeout_ms=10000) as b:
            # The stored chunk stays in the node; the gone client's request does not
            # (finish() checks no request, pin or write is left).
            b.on_new_request("after-1")
            self.assertEqual(b.lookup("after-1", [key(3), key(4)]), [kvtier.HIT, kvtier.MISS])
            b.on_request_finished("after-1")
        self.finish()

    def test_reset_drops_what_jobs_stored(self):
        a, ra = self.engine("r", rows=4)
        with a, kvtier.Client(self.sock, name="admin", timeout_ms=10000) as admin:
            a.attach_region(ra.fd, 0, 4, ROW)
            ra.write(0, pattern(5))
            _, done = a.jobs_step([], [kvtier.Job(1, kvtier.JOB_STORE, [key(5)], [0])])
            self.assertTrue(done[0].ok)
            self.assertEqual(a.jobs_step([key(5)])[0], [kvtier.HIT])
            self.assertFalse(a.has_pending_work())
            admin.reset()  # the engine holds nothing between its steps
            self.assertEqual(a.jobs_step([key(5)])[0], [kvtier.MISS])
            ra.write(1, b"\x33" * ROW)
            _, done = a.jobs_step([], [kvtier.Job(2, kvtier.JOB_LOAD, [key(5)], [1])])
            self.assertEqual([(d.id, d.ok) for d in done], [(2, False)])
            self.assertEqual(ra.row(1), b"\x33" * ROW)  # not written
            # Still attached: it stores again.
            _, done = a.jobs_step([], [kvtier.Job(3, kvtier.JOB_STORE, [key(5)], [0])])
            self.assertTrue(done[0].ok)
        self.finish()


if __name__ == "__main__":
    SERVER = sys.argv.pop(1)
    unittest.main(verbosity=2)

# SPDX-License-Identifier: Apache-2.0
"""kvtier._fast, the package's CPython extension of the hot calls, against the engine
API server (kvt-test-engine-server), next to the ctypes layer it replaces.

Run by ctest (label "node"): argv[1] the test server, $KVTIER_FAST_MODULE the
extension this build made, $KVTIER_CLIENT_LIB the library, $PYTHONPATH the
package's folder. The extension must be there: this test fails without it. Every
test compares the extension's answer with the ctypes layer's (a client whose
`fast` is None) for the same call on the same node state."""

import errno
import mmap
import os
import random
import sys
import time
import unittest

import kvtier
import test_kvtier_py as base
from test_kvtier_py import Server

NUM_CHUNKS = base.NUM_CHUNKS


def key(i, n=0):
    """Key i; n > 0 makes it n bytes long (keys of several lengths)."""
    k = kvtier.make_key(str(i).encode(), 0)
    return (k * 2)[:n] if n else k


def outcome(fn, *args):
    """("ok", result) or ("err", errno, message): what a call did."""
    try:
        return ("ok", fn(*args))
    except kvtier.KvtierError as e:
        return ("err", e.errno, str(e))


class FastVsCtypes(unittest.TestCase):
    def setUp(self):
        self.srvs = []

    def tearDown(self):
        for s in self.srvs:
            if s.proc.poll() is None:
                s.proc.kill()
                s.proc.wait()
            s.proc.stdout.close()

    def server(self):
        s = Server()
        self.srvs.append(s)
        return s

    def connect(self, srv, fast=True):
        c = kvtier.Client(srv.sock, name="fast" if fast else "ctypes", timeout_ms=10000)
        if fast:
            self.assertIsInstance(c.fast, kvtier._fast.Conn)
        else:
            c.fast = None  # the hot calls through ctypes
        return c

    def finish(self, srv):
        rep = srv.stop()
        self.assertEqual(rep["requests_left"], 0)
        self.assertEqual(rep["write_pending"], 0)
        self.assertEqual(rep["pinned"], 0)
        return rep

    def test_the_extension_is_this_builds(self):
        self.assertIsNotNone(kvtier._fast)
        self.assertEqual(os.path.realpath(kvtier._fast.__file__),
                         os.path.realpath(os.environ["KVTIER_FAST_MODULE"]))
        srv = self.server()
        with self.connect(srv) as c:
            self.assertTrue(c.has_ring)
            before = c.ring_stats()["posted"]
            c.on_new_request("r")
            self.assertEqual(c.lookup_one("r", key(1)), kvtier.MISS)
            self.assertEqual(c.fast.lookup(b"r", [key(1), key(2)]), [kvtier.MISS] * 2)
            self.assertGreaterEqual(c.ring_stats()["posted"] - before, 2)  # over the ring
            c.on_request_finished("r")
        self.finish(srv)

    def test_errors_are_the_ctypes_layers(self):
        srv = self.server()
        f, k = self.connect(srv), self.connect(srv, fast=False)
        for c, rid in ((f, "f"), (k, "k")):
            c.on_new_request(rid)
        cases = [
            ("complete_store, nothing prepared", lambda c, r: c.complete_store(r, [key(1)])),
            ("prepare_load of a missing key", lambda c, r: c.prepare_load(r, [key(2)])),
            ("complete_load, not pinned", lambda c, r: c.complete_load(None, [key(3)])),
            ("lookup of an unknown request", lambda c, r: c.lookup("nobody", [key(4)])),
            ("lookup_one of an unknown request", lambda c, r: c.lookup_one("nobody", key(4))),
            ("prepare_store of an unknown request",
             lambda c, r: c.prepare_store("nobody", [key(5)])),
            ("touch of too many keys",
             lambda c, r: c.touch([key(i) for i in range(c.max_keys + 1)])),
            ("lookup of too many keys, several lengths",
             lambda c, r: c.lookup(r, [key(i, 20 + i % 3) for i in range(c.max_keys + 1)])),
        ]
        for what, call in cases:
            got_f, got_k = outcome(call, f, "f"), outcome(call, k, "k")
            self.assertEqual(got_f[0], "err", what)
            self.assertEqual(got_f, got_k, what)
        # ENOSPC: the primary full of pinned chunks, both ways
        for c, rid in ((f, "f"), (k, "k")):
            ks = [key(100 + i) for i in range(8)] if c is f else [key(200 + i) for i in range(8)]
            c.prepare_store(rid, ks)
            c.complete_store(rid, ks)
            c.prepare_load(rid, ks)
        got = [outcome(c.prepare_store, r, [key(500)]) for c, r in ((f, "f"), (k, "k"))]
        self.assertEqual(got[0][:2], ("err", errno.ENOSPC))
        self.assertEqual(got[0], got[1])
        self.assertIsInstance(outcome(f.fast.prepare_store, b"f", [key(500)])[2], str)
        for c, rid in ((f, "f"), (k, "k")):
            c.on_request_finished(rid)
        f.close()
        k.close()
        self.finish(srv)

    def test_bad_arguments_raise_and_send_nothing(self):
        srv = self.server()
        with self.connect(srv) as c:
            c.on_new_request("r")
            fc = c.fast
            before = c.ring_stats()["posted"]
            bad_type = [
                lambda: fc.lookup_one(b"r", "a str key"),
                lambda: fc.lookup_one(b"r", 7),
                lambda: fc.lookup_one(7, key(1)),
                lambda: fc.lookup(b"r", key(1)),  # one key, not a list
                lambda: fc.lookup(b"r", [key(1), "x"]),
                lambda: fc.lookup(b"r", [key(1), 3]),
                lambda: fc.lookup(b"r", 5),
                lambda: fc.touch(None, [None]),
                lambda: fc.prepare_store(b"r"),  # too few arguments
                lambda: fc.complete_load(None, [key(1)], 1),  # too many
                lambda: fc.on_schedule_end([3]),
                lambda: kvtier._fast.Conn(c.lib._handle, c.handle, "not a class"),
            ]
            for i, call in enumerate(bad_type):
                with self.assertRaises(TypeError, msg="case %d" % i):
                    call()
            bad_value = [
                lambda: fc.lookup_one(b"r", b""),
                lambda: fc.lookup_one(b"r", b"x" * 65),
                lambda: fc.lookup(b"r", [key(1), b""]),
                lambda: fc.prepare_load(b"r", [b"y" * 65]),
                lambda: fc.lookup_one(b"x" * 128, key(1)),
                lambda: fc.lookup_one(b"", key(1)),
                lambda: fc.lookup_one(b"r\0r", key(1)),
                lambda: fc.on_schedule_end([b"r"], ["p" * 128]),
                lambda: kvtier._fast.Conn(c.lib._handle, 0, kvtier.KvtierError),
            ]
            for i, call in enumerate(bad_value):
                with self.assertRaises(ValueError, msg="case %d" % i):
                    call()
            self.assertEqual(c.ring_stats()["posted"], before)  # nothing went to the node
            # bytes-like keys are taken as bytes(k) would take them, as through ctypes
            self.assertEqual(fc.lookup(b"r", [bytearray(key(1)), memoryview(key(2))]),
                             [kvtier.MISS] * 2)
            c.on_request_finished("r")
        self.finish(srv)

    def test_a_closed_client_raises(self):
        srv = self.server()
        c = self.connect(srv)
        fc, view = c.fast, c.fast_view(("m", "h", "p", "r"))
        c.on_new_request("r")
        self.assertEqual(view.lookup_one(b"r", key(1)), "m")  # results as asked
        self.assertEqual(view.lookup(b"r", [key(1)]), ["m"])
        c.on_request_finished("r")
        c.close()
        self.assertTrue(fc.closed)
        calls = [lambda o: o.lookup_one(b"r", key(1)), lambda o: o.lookup(b"r", [key(1)]),
                 lambda o: o.prepare_store(b"r", [key(1)]),
                 lambda o: o.complete_store(b"r", [key(1)], True),
                 lambda o: o.prepare_load(b"r", [key(1)]),
                 lambda o: o.complete_load(None, [key(1)]), lambda o: o.touch(None, [key(1)]),
                 lambda o: o.on_schedule_end()]
        for obj in (fc, view):
            for call in calls:
                with self.assertRaises(kvtier.KvtierError) as e:
                    call(obj)
                self.assertEqual(e.exception.errno, errno.EBADF)
        for call in (lambda: c.lookup("r", [key(1)]), lambda: c.lookup_one("r", key(1)),
                     lambda: c.touch([key(1)]), lambda: c.fast_view()):
            with self.assertRaises(kvtier.KvtierError) as e:
                call()
            self.assertEqual(e.exception.errno, errno.EBADF)
        self.finish(srv)

    def jobs_run(self, srv, fast):
        """Stores and loads through an attached region of this client's own, with a
        row out of the region, a bad kind, a job of keys the node lacks and mismatched
        rows on the way; what every call did, jobs in the order they finished."""
        row = base.PAGE * base.WORKERS
        path = os.path.join(srv.dir, "own-%d" % fast)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        os.ftruncate(fd, 8 * row)
        reg = mmap.mmap(fd, 8 * row)
        log = []
        try:
            c = self.connect(srv, fast)
            log.append(outcome(c.jobs_step, [key(1)], []))  # no region: ENOTCONN
            c.attach_region(fd, 0, 8, row)
            for i in range(4):
                reg[i * row:(i + 1) * row] = bytes([i + 1]) * row
            keys = [key(i) for i in range(4)]
            log.append(outcome(c.jobs_step, [], [kvtier.Job(1, kvtier.JOB_STORE, keys[:2], [0, 1]),
                                                 kvtier.Job(2, kvtier.JOB_LOAD, keys[:1], [8])]))
            log.append(outcome(c.jobs_step, [], [kvtier.Job(3, 9, keys[:1], [0])]))
            with self.assertRaises(ValueError) as e:
                c.jobs_step([], [kvtier.Job(4, kvtier.JOB_STORE, keys, [0])])
            log.append(str(e.exception))
            log.append(outcome(c.jobs_step, keys, [
                kvtier.Job(5, kvtier.JOB_STORE, keys, [0, 1, 2, 3])]))
            finished = [d for d in log[-1][1][1]] if log[-1][0] == "ok" else []
            for _ in range(500):
                if any(d.id == 5 for d in finished):
                    break
                time.sleep(0.005)
                got = c.jobs_step([], [])
                finished += got[1]
            log.append(finished)
            # a load of two stored keys and one the node never saw: a partial failure
            got = c.jobs_step(keys + [key(99)], [
                kvtier.Job(6, kvtier.JOB_LOAD, [keys[0], key(99), keys[3]], [4, 5, 6])])
            log.append(got[0])
            finished = list(got[1])
            for _ in range(500):
                if any(d.id == 6 for d in finished):
                    break
                time.sleep(0.005)
                finished += c.jobs_step([], [])[1]
            log.append(finished)
            log.append(bytes(reg[4 * row:5 * row]) == bytes([1]) * row)
            log.append(bytes(reg[6 * row:7 * row]) == bytes([4]) * row)
            c.close()
        finally:
            reg.close()
            os.close(fd)
        return log

    def test_jobs_step_gives_the_ctypes_results(self):
        a, b = self.server(), self.server()
        fast, slow = self.jobs_run(a, True), self.jobs_run(b, False)
        self.assertEqual(fast[0][:2], ("err", errno.ENOTCONN))
        self.assertEqual(fast[1][:2], ("err", errno.EINVAL))  # row 8 is out of the region
        self.assertEqual(fast[2][:2], ("err", errno.EINVAL))  # kind 9
        self.assertEqual(fast[3], "job 4: 4 keys but 1 rows")
        self.assertEqual([(d.id, d.ok) for d in fast[5]], [(5, True)])
        self.assertEqual([(d.id, d.ok, d.key_ok) for d in fast[7]], [(6, False, [True, False, True])])
        self.assertEqual(fast[8:], [True, True])
        self.assertEqual(fast, slow)
        self.finish(a)
        self.finish(b)

    def test_jobs_step_bad_arguments(self):
        srv = self.server()
        with self.connect(srv) as c:
            fc = c.fast
            for call in (lambda: fc.jobs_step([], [(1, 0, [key(1)])]),  # 3 fields
                         lambda: fc.jobs_step([], [[1, 0, [key(1)], [0]]]),  # not a tuple
                         lambda: fc.jobs_step([], [(1, 0, ["k"], [0])]),
                         lambda: fc.jobs_step(["k"], []),
                         lambda: fc.jobs_step([], [(1, 0, [key(1)], ["row"])]),
                         lambda: fc.jobs_step([], [("id", 0, [key(1)], [0])])):
                with self.assertRaises(TypeError):
                    call()
            for call in (lambda: fc.jobs_step([b""], []),
                         lambda: fc.jobs_step([], [(1, 0, [b"x" * 65], [0])]),
                         lambda: fc.jobs_step([], [(-1, 0, [key(1)], [0])])):
                with self.assertRaises((ValueError, OverflowError)):
                    call()
        self.finish(srv)

    def random_run(self, srv, fast, seed, ops=400):
        """A random call sequence (a few requests, stores, loads, evictions, bad
        calls, keys of several lengths); the list of what every call did."""
        rng = random.Random(seed)
        c = self.connect(srv, fast)
        reqs = ["q%d" % i for i in range(3)]
        for r in reqs:
            c.on_new_request(r)
        prepared = {r: [] for r in reqs}
        pinned = []
        log = []

        def keys(n):
            odd = rng.random() < 0.15  # keys of several lengths: not the packed path
            return [key(rng.randrange(40), (20 + rng.randrange(3)) if odd else 0)
                    for _ in range(n)]

        for _ in range(ops):
            op = rng.randrange(9)
            r = rng.choice(reqs)
            if op == 0:
                log.append(outcome(c.lookup, r, keys(rng.randrange(1, 12)), rng.random() < 0.5))
            elif op == 1:
                log.append(outcome(c.lookup_one, r, keys(1)[0]))
            elif op == 2:
                ks = keys(rng.randrange(1, 6))
                got = outcome(c.prepare_store, r, ks)
                log.append(got)
                if got[0] == "ok" and got[1].stores:
                    prepared[r].append([ks[i] for i, _ in got[1].stores])
            elif op == 3 and prepared[r]:
                log.append(outcome(c.complete_store, r, prepared[r].pop(0), rng.random() < 0.8))
            elif op == 4:
                ks = keys(rng.randrange(1, 4))
                got = outcome(c.prepare_load, r, ks)
                log.append(got)
                if got[0] == "ok":
                    pinned.append(ks)
            elif op == 5 and pinned:
                log.append(outcome(c.complete_load, None, pinned.pop(rng.randrange(len(pinned)))))
            elif op == 6:
                log.append(outcome(c.touch, keys(rng.randrange(1, 5)),
                                   r if rng.random() < 0.5 else None))
            elif op == 7:
                log.append(outcome(c.on_schedule_end, [r] if rng.random() < 0.3 else [], []))
            elif op == 8:
                log.append(outcome(c.complete_load, None, keys(1)))  # mostly not pinned
        for r in reqs:
            for ks in prepared[r]:
                c.complete_store(r, ks, False)
        for ks in pinned:
            c.complete_load(None, ks)
        for r in reqs:
            c.on_request_finished(r)
        c.close()
        return log

    def test_random_sequences_give_the_ctypes_results(self):
        for seed in range(6):
            a, b = self.server(), self.server()
            fast = self.random_run(a, True, seed)
            slow = self.random_run(b, False, seed)
            self.assertGreater(len(fast), 200)
            self.assertTrue(any(o[0] == "err" for o in fast), "seed %d: no failures" % seed)
            self.assertTrue(any(o[0] == "ok" and getattr(o[1], "evicted", None) for o in fast),
                            "seed %d: no evictions" % seed)
            for i, (x, y) in enumerate(zip(fast, slow)):
                self.assertEqual(x, y, "seed %d, call %d" % (seed, i))
            self.assertEqual(len(fast), len(slow))
            self.finish(a)
            self.finish(b)


if __name__ == "__main__":
    base.SERVER = sys.argv.pop(1)
    unittest.main(verbosity=2)

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

    def test_sequences_changed_under_the_call(self):
        """A row's __index__ or a key's iteration runs Python code in the middle of a
        call; code that empties the call's lists or drops their items changes
        nothing the call reads: it sees the lists as they were when it began
        (before: a missing item was read, and the process crashed)."""
        srv = self.server()
        row = base.PAGE * base.WORKERS
        path = os.path.join(srv.dir, "hostile")
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        os.ftruncate(fd, 8 * row)
        try:
            with self.connect(srv) as c:
                c.attach_region(fd, 0, 8, row)
                fc = c.fast
                keys1, keys2 = [key(1), key(2)], [key(3)]
                jobs = []

                class Emptier:  # a row whose conversion empties every list
                    def __init__(self, value):
                        self.value = value

                    def __index__(self):
                        for lst in (keys1, keys2, jobs, rows1):
                            lst.clear()
                        return self.value

                rows1 = [Emptier(0), 1]
                jobs += [(1, kvtier.JOB_STORE, keys1, rows1), (2, kvtier.JOB_STORE, keys2, [2])]
                lookups = [key(1), key(9)]
                verdicts, first = fc.jobs_step(lookups, jobs)
                self.assertEqual(len(verdicts), 2)
                done = [d[0] for d in first]
                for _ in range(500):
                    done += [d[0] for d in fc.jobs_step([], [])[1]]
                    if {1, 2} <= set(done):
                        break
                    time.sleep(0.005)
                self.assertEqual(sorted(done), [1, 2])

                class Key:  # a key given as an iterable of ints, which empties the list
                    def __init__(self, b):
                        self.b = b

                    def __iter__(self):
                        ks.clear()
                        return iter(self.b)

                c.on_new_request("r")
                ks = [Key(key(1)), key(2), key(3)]
                self.assertEqual(c.lookup("r", ks, False),
                                 c.lookup("r", [key(1), key(2), key(3)], False))
                c.on_request_finished("r")
        finally:
            os.close(fd)
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


class KeyTableRules(unittest.TestCase):
    """kvtier._fast.KeyTable (kvtier.vllm's lookup table) against a model of its
    rules, on random sequences (under the sanitizers in this build), and its
    references: a key the table forgot, or a table gone, holds none."""

    R, H, M = "retry", "hit", "miss"

    class Model:
        """The rules, as plainly as they read (kvtier.vllm._PyKeyTable's docstring)."""

        def __init__(self):
            self.keys, self.reqs, self.step, self.gen = {}, {}, [], 0

        def state(self, k):
            e = self.keys.get(k)
            return None if e is None else tuple(e)

        def lookup(self, k, rid, up):
            if k not in self.keys:
                if not up:
                    return "miss"
                self.keys[k] = [self.gen, "retry", False, 0]
                self.step.append((k, self.gen))
                self.gen += 1
            rk = self.reqs.setdefault(rid, set())
            if k not in rk:
                rk.add(k)
                self.keys[k][3] += 1
            return self.keys[k][1]

        def request_finished(self, rid):
            for k in self.reqs.pop(rid, ()):
                e = self.keys.get(k)
                if e is not None:
                    e[3] -= 1
                    if e[3] <= 0 and not e[2]:
                        del self.keys[k]

        def mark(self, ks, present):
            for k in ks:
                e = self.keys.get(k)
                if e is None:
                    continue
                if present and e[3] <= 0:
                    del self.keys[k]
                elif present:
                    e[0], e[1], e[2] = self.gen, "hit", False
                    self.gen += 1
                elif e[1] != "retry":
                    e[1] = "miss"

        def flush(self):
            out = [(k, g) for k, g in self.step
                   if k in self.keys and self.keys[k][0] == g and self.keys[k][1] == "retry"]
            for k, _ in out:
                self.keys[k][2] = True
            self.step = []
            return [k for k, _ in out], [g for _, g in out]

        def apply(self, ks, gs, vs):
            counts = [0, 0, 0, 0]
            for k, g, v in zip(ks, gs, vs):
                counts[v] += 1
                e = self.keys.get(k)
                if v == kvtier.RETRY or e is None or e[0] != g:
                    continue
                e[2] = False
                if e[3] <= 0:
                    del self.keys[k]
                else:
                    e[1] = "hit" if v in (kvtier.HIT, kvtier.HIT_PENDING) else "miss"
            return tuple(counts)

        def node_down(self):
            for k, e in list(self.keys.items()):
                if e[1] == "retry":
                    e[1], e[2] = "miss", False
                    if e[3] <= 0:
                        del self.keys[k]

    def table(self):
        self.assertIsNotNone(kvtier._fast, "kvtier._fast not loaded")
        return kvtier._fast.KeyTable(self.R, self.H, self.M)

    def test_random_sequences_keep_the_rules(self):
        for seed in range(8):
            rng = random.Random(seed)
            t, m = self.table(), self.Model()
            universe = [key(i, rng.choice([0, 1, 40, 64])) for i in range(rng.choice([6, 300]))]
            rids = ["r%d" % i for i in range(rng.choice([3, 20]))]
            probes = []
            for _ in range(3000):
                op = rng.random()
                if op < 0.55:
                    k, rid, up = rng.choice(universe), rng.choice(rids), rng.random() > 0.05
                    self.assertEqual(t.lookup(bytes(bytearray(k)), rid, up), m.lookup(k, rid, up))
                elif op < 0.63:
                    rid = rng.choice(rids)
                    t.request_finished(rid)
                    m.request_finished(rid)
                elif op < 0.73:
                    ks = rng.sample(universe, min(8, len(universe)))
                    present = rng.random() < 0.5
                    t.mark(iter(ks), present)
                    m.mark(ks, present)
                elif op < 0.83:
                    got = t.flush()
                    self.assertEqual(got, m.flush())
                    probes.append(got)
                elif op < 0.99 and probes:
                    ks, gs = probes.pop(rng.randrange(len(probes)))
                    vs = [rng.randrange(4) for _ in ks]
                    self.assertEqual(t.apply(ks, gs, vs), m.apply(ks, gs, vs))
                else:
                    t.node_down()
                    m.node_down()
                self.assertEqual(len(t), len(m.keys))
                self.assertEqual(t.requests, len(m.reqs))
                self.assertEqual(t.pending, len(m.step))
                for k in universe:
                    self.assertEqual(t.state(k), m.state(k), "seed %d" % seed)

    def test_keys_are_released(self):
        t = self.table()
        ks = [bytes(bytearray(b"held-%d" % i)) for i in range(500)]  # objects of their own
        base_refs = [sys.getrefcount(k) for k in ks]
        for i, k in enumerate(ks):
            t.lookup(k, "r%d" % (i % 7), True)
        del k  # (the loop's variable holds the last key)
        self.assertTrue(all(sys.getrefcount(k) > b for k, b in zip(ks, base_refs)))
        got = t.flush()
        t.apply(got[0], got[1], [kvtier.HIT] * len(ks))
        del got
        for i in range(7):
            t.request_finished("r%d" % i)
        self.assertEqual((len(t), t.requests, t.pending), (0, 0, 0))
        self.assertEqual([sys.getrefcount(k) for k in ks], base_refs)
        for i, k in enumerate(ks):  # a table that goes holds nothing either
            t.lookup(k, "r%d" % (i % 7), True)
        del k, t
        self.assertEqual([sys.getrefcount(k) for k in ks], base_refs)

    def test_apply_reads_what_it_checked(self):
        """apply's values run Python code as they are converted (an __index__): that
        code can neither slip a verdict past the check nor pull a list from under
        the call (before: a verdict of 100000 counted out of bounds; an emptied key
        list read a missing item: both crashed the process)."""
        t = self.table()

        class Shifty:  # 1 (HIT) when checked, then 100000
            calls = 0

            def __index__(self):
                Shifty.calls += 1
                return kvtier.HIT if Shifty.calls == 1 else 100000

        t.lookup(b"k", "r", True)
        ks, gs = t.flush()
        self.assertEqual(t.apply(ks, gs, [Shifty()]), (0, 1, 0, 0))
        self.assertEqual(t.state(b"k")[1], self.H)

        keys = [b"k%d" % i for i in range(100)]
        for k in keys:
            t.lookup(k, "r2", True)
        ks, gs = t.flush()

        class Emptier:  # empties every list of the call
            def __index__(self):
                for lst in (ks, gs, vs):
                    lst.clear()
                return kvtier.MISS

        vs = [Emptier()] + [kvtier.HIT] * 99
        self.assertEqual(t.apply(ks, gs, vs), (1, 99, 0, 0))
        self.assertEqual([t.state(k)[1] for k in keys], [self.M] + [self.H] * 99)

    def test_bad_input(self):
        t = self.table()
        self.assertRaises(TypeError, t.lookup, "str", "r", True)
        self.assertRaises(TypeError, t.mark, [1], True)
        self.assertRaises(TypeError, t.state, 1)
        self.assertEqual(t.lookup(b"k", "r", True), self.R)
        ks, gs = t.flush()
        for bad in ((ks, gs, []), (ks, gs, [4]), (ks, gs, [-1]), (ks, [-1], [1]),
                    ([1], gs, [1]), (tuple(ks), gs, [1])):
            self.assertRaises((TypeError, ValueError, OverflowError), t.apply, *bad)
        self.assertEqual(t.state(b"k"), (0, self.R, True, 1))
        self.assertRaises(TypeError, kvtier._fast.KeyTable, 1, 2)
        self.assertRaises(TypeError, kvtier._fast.KeyTable, 1, 2, 3, x=1)


if __name__ == "__main__":
    base.SERVER = sys.argv.pop(1)
    unittest.main(verbosity=2)

# SPDX-License-Identifier: Apache-2.0
"""kvtier._fast (and the ctypes layer where it does the same) under hostile Python
input: arguments whose conversion runs Python code (__index__, __bool__, __iter__,
__bytes__, __hash__, __eq__, a finalizer) that raises, changes the call's lists,
closes the client or calls back into the same KeyTable. Nothing may crash, and the
table must hold what kvtier.vllm._PyKeyTable (the same rules in Python) holds.

Run by ctest (label "node") as test_kvtier_fast.py is. The file runs itself again
under PYTHONMALLOC=debug: CPython's own code is not instrumented by the sanitizers,
so an object freed under a call (a request's key set) is poisoned and its use
crashes, rather than read quietly from pymalloc's pool."""

import ast
import errno
import gc
import os
import random
import sys
import time
import typing
import unittest

if __name__ == "__main__" and os.environ.get("PYTHONMALLOC") != "debug":
    os.execve(sys.executable, [sys.executable] + sys.argv,
              dict(os.environ, PYTHONMALLOC="debug"))

import kvtier  # noqa: E402
import test_kvtier_py as base  # noqa: E402

R, H, M = "retry", "hit", "miss"


def key(i):
    return kvtier.make_key(str(i).encode(), 0)


def py_key_table():
    """kvtier.vllm._PyKeyTable, taken from vllm.py's source (importing the module
    needs vLLM, which this build's tests do not have)."""
    path = os.path.join(os.path.dirname(kvtier.__file__), "vllm.py")
    with open(path) as f:
        tree = ast.parse(f.read())
    body = [n for n in tree.body
            if isinstance(n, ast.ClassDef) and n.name in ("_Key", "_PyKeyTable")]
    ns = {"_kvt": kvtier, "OffloadKey": bytes, "LookupResult": object,
          "Iterable": typing.Iterable}
    exec(compile(ast.Module(body=body, type_ignores=[]), path, "exec"), ns)
    return ns["_PyKeyTable"](R, H, M)


class Boom(Exception):
    pass


class Counted:
    """Calls of a hostile key's or request id's __hash__ / __eq__ (the table keeps
    plain copies: it must make none)."""
    calls = 0
    hook = None  # what a call does besides (a re-entrant call into the table)

    @classmethod
    def hit(cls):
        cls.calls += 1
        if cls.hook is not None:
            cls.hook()


class Hostile:
    """A bytes or str subclass whose __hash__ and __eq__ count their calls."""

    def __hash__(self):
        Counted.hit()
        return super().__hash__()

    def __eq__(self, o):
        Counted.hit()
        return super().__eq__(o)


class HKey(Hostile, bytes):
    pass


class HRid(Hostile, str):
    pass


class Effect:
    """A value whose conversion (__bool__, __index__, __bytes__, __iter__) first does
    effect() (which may raise or close a client)."""

    def __init__(self, value, effect):
        self.value, self.effect = value, effect

    def __bool__(self):
        self.effect()
        return bool(self.value)

    def __index__(self):
        self.effect()
        return self.value

    def __bytes__(self):
        self.effect()
        return bytes(self.value)

    def __iter__(self):  # (a key given as an iterable of its bytes)
        self.effect()
        return iter(self.value)


def boom():
    raise Boom()


def collected_during(threshold, finalizer, call):
    """call() with the collector's threshold at threshold and a garbage cycle whose
    finalizer runs finalizer() when collected (inside call, if it allocates enough);
    call's result."""
    class Garbage:
        def __del__(self):
            finalizer()
    gc.collect()
    g = Garbage()
    g.cycle = g
    del g
    old = gc.get_threshold()
    gc.set_threshold(threshold)
    try:
        return call()
    finally:
        gc.set_threshold(*old)
        gc.collect()


class TableUnderHostileInput(unittest.TestCase):
    def setUp(self):
        self.assertIsNotNone(kvtier._fast, "kvtier._fast not loaded")
        Counted.calls, Counted.hook = 0, None

    def tearDown(self):
        Counted.hook = None

    def table(self):
        return kvtier._fast.KeyTable(R, H, M)

    def test_a_key_or_request_id_runs_no_code_in_the_table(self):
        """A bytes subclass's __hash__ / __eq__ or a str subclass's, called by the
        table, could change it under the call: grow it (the slot a lookup was about
        to count moved: written after it was freed), or finish the request whose key
        set the call was in (the set freed under it: a crash). The table keeps plain
        copies and calls neither; it answers as for plain bytes and str."""
        t, py = self.table(), py_key_table()

        def grow():  # 200 new keys: the slot array is reallocated
            for i in range(200):
                t.lookup(b"g%d" % i, "other", True)
        Counted.hook = grow
        self.assertEqual(t.lookup(HKey(b"k"), "r", True), py.lookup(b"k", "r", True))
        Counted.hook = lambda: t.request_finished("r")
        for k, rid in ((b"a", "r"), (HKey(b"k2"), "r"), (b"k3", HRid("r")), (b"a", HRid("s"))):
            self.assertEqual(t.lookup(k, rid, True), py.lookup(bytes(k), str(rid), True))
        t.mark([HKey(b"k")], True)
        py.mark([b"k"], True)
        self.assertEqual(t.state(HKey(b"k")), py.state(b"k"))
        got = t.flush()
        self.assertEqual(got, py.flush())
        self.assertEqual({type(k) for k in got[0]}, {bytes})  # the plain copies
        t.request_finished(HRid("r"))
        py.request_finished("r")
        self.assertEqual(Counted.calls, 0)
        self.assertEqual((len(t), t.requests, t.pending), (len(py), py.requests, py.pending))
        for k in (b"a", b"k", b"k2", b"k3", b"g0"):
            self.assertEqual(t.state(k), py.state(k))
        self.assertRaises(TypeError, t.lookup, b"k", 5, True)  # a request id is str or bytes
        self.assertRaises(TypeError, t.request_finished, (1, 2))
        self.assertEqual(t.lookup(b"unknown", 5, False), M)  # (no request counted then)

    def test_a_finalizer_run_by_flush_keeps_its_lookup(self):
        """flush() makes its result after it read the step: the collector may run
        then, and a finalizer look a key up. That key's probe stays for the next
        flush (before: the step was emptied after, and the key stayed RETRY, never
        asked)."""
        lost = 0
        for threshold in range(1, 8):
            t = self.table()
            k = b"late-%d" % threshold
            t.lookup(b"first", "r", True)
            got = collected_during(threshold, lambda: t.lookup(k, "r", True), t.flush)
            if t.state(k) is None:
                continue  # (the finalizer did not run in this flush)
            if k not in got[0]:
                again = t.flush()
                lost += k not in again[0]
            self.assertTrue(t.state(k)[2], "threshold %d: %r asked" % (threshold, k))
        self.assertEqual(lost, 0)

    def test_a_finalizer_run_by_a_new_requests_set_counts_once(self):
        """lookup makes a new request's key set; the collector may run then, and a
        finalizer look up another key of the same request, making the request's set
        first. The request keeps one set, so its finish releases both keys (before:
        the finalizer's set was replaced, and its key was held for ever)."""
        ran = 0
        for threshold in range(1, 8):
            t = self.table()
            rid = "req-%d" % threshold
            collected_during(threshold, lambda: t.lookup(b"from-finalizer", rid, True),
                             lambda: t.lookup(b"first", rid, True))
            if t.state(b"from-finalizer") is None:
                continue  # (the finalizer did not run in that lookup)
            ran += 1
            self.assertEqual(t.requests, 1)
            t.request_finished(rid)
            self.assertEqual((len(t), t.requests), (0, 0), "threshold %d" % threshold)
        self.assertGreater(ran, 0, "no finalizer ran inside a lookup")

    def test_random_hostile_sequences_keep_the_python_tables_state(self):
        """Seeded random calls, each with hostile values: every effect a conversion has
        (a re-entrant call) is done on both tables, then the call itself; the C table
        must hold what the Python one holds after every call, call no key's or
        request id's code, and keep no reference once gone."""
        for seed in range(16):
            rng = random.Random(seed)
            universe = [bytes(bytearray(key(i)[:rng.choice([1, 8, 64])])) for i in range(40)]
            refs = [sys.getrefcount(k) for k in universe]
            self.random_run(seed, rng, universe)
            gc.collect()
            self.assertEqual([sys.getrefcount(k) for k in universe], refs, "seed %d" % seed)

    def random_run(self, seed, rng, universe, ops=3000):
        t, py = self.table(), py_key_table()
        rids = ["r%d" % i for i in range(6)]
        probes = []
        depth = [0]

        def side():
            """A call into both tables from inside a call of the C one."""
            if depth[0]:
                return
            depth[0] += 1
            try:
                op = rng.randrange(5)
                if op == 0:
                    k, rid = rng.choice(universe), rng.choice(rids)
                    self.assertEqual(t.lookup(k, rid, True), py.lookup(k, rid, True))
                elif op == 1:
                    rid = rng.choice(rids)
                    t.request_finished(rid)
                    py.request_finished(rid)
                elif op == 2:
                    t.node_down()
                    py.node_down()
                elif op == 3:
                    got = t.flush()
                    self.assertEqual(got, py.flush())
                    probes.append(got)
                else:
                    ks = rng.sample(universe, 3)
                    t.mark(ks, True)
                    py.mark(ks, True)
            finally:
                depth[0] -= 1

        def effect():
            """An effect for a conversion: nothing, a re-entrant call, or raise."""
            r = rng.random()
            return (lambda: None) if r < 0.4 else side if r < 0.85 else boom

        def hkey(k):
            return HKey(k) if rng.random() < 0.3 else k

        def hrid(rid):
            return HRid(rid) if rng.random() < 0.3 else rid

        def flag(v):
            return Effect(v, effect()) if rng.random() < 0.4 else v

        for _ in range(ops):
            op = rng.random()
            try:
                if op < 0.45:
                    k, rid, up = rng.choice(universe), rng.choice(rids), rng.random() > 0.1
                    if rng.random() < 0.03:  # not a request id: TypeError, unless a MISS first
                        unknown = py.state(k) is None and not up
                        try:
                            self.assertEqual(t.lookup(k, rng.choice([5, None, (1,)]), up), M)
                            self.assertTrue(unknown)
                        except TypeError:
                            self.assertFalse(unknown)
                        continue
                    got = t.lookup(hkey(k), hrid(rid), flag(up))
                    self.assertEqual(got, py.lookup(k, rid, up))
                elif op < 0.55:
                    rid = rng.choice(rids)
                    t.request_finished(hrid(rid))
                    py.request_finished(rid)
                elif op < 0.68:
                    ks = rng.sample(universe, rng.randint(0, 6))
                    present = rng.random() < 0.5
                    bad = rng.random() < 0.1
                    marked = []

                    def items():
                        for k in ks:
                            if rng.random() < 0.3:
                                side()
                            yield hkey(k)
                            marked.append(k)  # (the C table marked it before asking on)
                            py.mark([k], present)
                        if bad:
                            yield 7  # TypeError: the keys before are marked
                    pf = flag(present)
                    try:
                        t.mark(items(), pf)
                    except TypeError:
                        self.assertTrue(bad)
                elif op < 0.8:
                    got = t.flush()
                    self.assertEqual(got, py.flush())
                    if got[0]:
                        probes.append(got)
                elif op < 0.97 and probes:
                    ks, gs = probes.pop(rng.randrange(len(probes)))
                    vals = [rng.randrange(4) for _ in ks]
                    vs = [Effect(v, effect()) if rng.random() < 0.2 else v for v in vals]
                    ks2, gs2 = [hkey(k) for k in ks], list(gs)
                    bad = bool(ks) and rng.random() < 0.05
                    if bad:
                        vs[rng.randrange(len(vs))] = rng.choice([4, -1, 1 << 70])
                    elif rng.random() < 0.1 and ks:  # a value that empties every list
                        lists = (ks2, gs2, vs)
                        vs[0] = Effect(vals[0], lambda: [x.clear() for x in lists])
                    try:
                        got = t.apply(ks2, gs2, vs)
                    except (ValueError, OverflowError):
                        self.assertTrue(bad)  # (nothing changed but the conversions' effects)
                    else:
                        self.assertFalse(bad)
                        self.assertEqual(got, py.apply(ks, gs, vals))
                else:
                    t.node_down()
                    py.node_down()
            except Boom:
                pass  # a conversion raised before the call changed anything
            self.assertEqual((len(t), t.requests, t.pending), (len(py), py.requests, py.pending))
            for k in universe:
                self.assertEqual(t.state(k), py.state(k), "seed %d" % seed)
            self.assertEqual(Counted.calls, 0)


class ConnUnderHostileInput(unittest.TestCase):
    def setUp(self):
        self.srv = base.Server()

    def tearDown(self):
        if self.srv.proc.poll() is None:
            self.srv.proc.kill()
            self.srv.proc.wait()
        self.srv.proc.stdout.close()

    def connect(self, fast=True):
        c = kvtier.Client(self.srv.sock, name="hostile", timeout_ms=10000)
        if not fast:
            c.fast = None
        c.on_new_request("r")
        return c

    def calls(self, c, arg):
        """Every hot call, with arg (made by arg(value)) where a conversion runs code."""
        row = Effect(0, lambda: None)
        return {
            "lookup": lambda: c.fast.lookup(b"r", arg([key(1), key(2)])),
            "lookup prefix": lambda: c.fast.lookup(b"r", [key(1)], arg(True)),
            "prepare_store": lambda: c.fast.prepare_store(b"r", arg([key(3)])),
            "complete_store": lambda: c.fast.complete_store(b"r", [key(3)], arg(True)),
            "prepare_load": lambda: c.fast.prepare_load(b"r", arg([key(1)])),
            "complete_load": lambda: c.fast.complete_load(None, arg([key(1)])),
            "touch": lambda: c.fast.touch(None, arg([key(1)])),
            "on_schedule_end": lambda: c.fast.on_schedule_end(arg([b"r"])),
            "jobs_step keys": lambda: c.fast.jobs_step(arg([key(1)]), []),
            "jobs_step rows": lambda: c.fast.jobs_step(
                [], [kvtier.Job(1, kvtier.JOB_STORE, [key(1)], arg([row]))]),
            "jobs_step kind": lambda: c.fast.jobs_step(
                [], [kvtier.Job(1, Effect(kvtier.JOB_STORE, arg.effect), [key(1)], [0])]),
        }

    def test_a_client_closed_under_a_call(self):
        """A conversion that closes the client (a key iterable's __next__, a row's
        __index__, a flag's __bool__, a request id's __bytes__ through ctypes): the
        call raises EBADF (before: it ran on the handle taken before, freed by then)."""
        for what in list(self.calls(None, None)) + ["ctypes " + w for w in (
                "lookup", "lookup_one", "prepare_store", "complete_store", "prepare_load",
                "complete_load", "touch", "on_request_finished", "lookup prefix")]:
            c = self.connect(fast=not what.startswith("ctypes"))

            def close():
                c.close()

            def arg(v):
                if isinstance(v, bool):
                    return Effect(v, close)

                def gen():  # the first item comes, then the client goes
                    it = iter(v)
                    yield next(it)
                    close()
                    yield from it
                return gen()
            arg.effect = close
            rid = Effect(b"r", close)
            if what.startswith("ctypes"):
                call = {
                    "ctypes lookup": lambda: c.lookup(rid, [key(1)]),
                    "ctypes lookup_one": lambda: c.lookup_one(rid, key(1)),
                    "ctypes prepare_store": lambda: c.prepare_store(rid, [key(3)]),
                    "ctypes complete_store": lambda: c.complete_store(rid, [key(3)]),
                    "ctypes prepare_load": lambda: c.prepare_load(rid, [key(1)]),
                    "ctypes complete_load": lambda: c.complete_load(rid, [key(1)]),
                    "ctypes touch": lambda: c.touch([key(1)], rid),
                    "ctypes on_request_finished": lambda: c.on_request_finished(rid),
                    "ctypes lookup prefix": lambda: c.lookup("r", [key(1)], Effect(1, close)),
                }[what]
            else:
                call = self.calls(c, arg)[what]
            with self.assertRaises(kvtier.KvtierError, msg=what) as e:
                call()
            self.assertEqual(e.exception.errno, errno.EBADF, what)
            self.assertIsNone(c._c, what)

    def test_random_hostile_calls_answer_as_plain_ones(self):
        """Seeded random lookups, touches and steps of the hot calls with hostile
        arguments (key lists as tuples, generators, iterables; keys as bytes-like or
        iterables of ints; flags and rows with code): one whose conversion raises
        raises that, one that closes the client raises EBADF, any other answers as the
        same call with plain arguments."""
        row = base.PAGE * base.WORKERS
        path = os.path.join(self.srv.dir, "hostile-region")
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        os.ftruncate(fd, 8 * row)
        try:
            self.random_calls(fd, row)
        finally:
            os.close(fd)

    def random_calls(self, fd, row):
        rng = random.Random(7)
        stored = [key(i) for i in range(4)]
        c = None
        deadline = time.monotonic() + 10
        n = 0
        while n < 600 and time.monotonic() < deadline:
            n += 1
            if c is None or c._c is None:
                c = self.connect()
                c.attach_region(fd, 0, 8, row)
                if n == 1:
                    c.prepare_store("r", stored)
                    c.complete_store("r", stored)
            ks = [key(rng.randrange(8)) for _ in range(rng.randint(0, 5))]
            fate = rng.choice(["none", "none", "clear", "raise", "close"])
            src = []

            def act():
                if fate == "clear":
                    src.clear()
                elif fate == "raise":
                    raise Boom()
                elif fate == "close":
                    c.close()

            def wrap(k):
                r = rng.random()
                return (bytearray(k) if r < 0.15 else memoryview(k) if r < 0.3
                        else HKey(k) if r < 0.4 else k)
            items = [wrap(k) for k in ks]
            where = rng.randrange(len(items) + 1)
            if where < len(items):  # the item whose conversion acts: an iterable of ints
                items[where] = Effect(ks[where], act)
            src[:] = items
            if where == len(items):  # the sequence acts, as it is read
                def gen():
                    snap = list(src)
                    act()
                    yield from snap
                arg = gen()
            else:
                shape = rng.choice(["list", "tuple", "iter"])
                arg = src if shape == "list" else tuple(src) if shape == "tuple" else iter(src)
            flag = rng.random() < 0.5
            call = rng.choice(["lookup", "touch", "jobs_step"])
            want = {
                "lookup": lambda: c.fast.lookup(b"r", ks, flag),
                "touch": lambda: c.fast.touch(None, ks),
                "jobs_step": lambda: c.fast.jobs_step(ks, [])[0],
            }[call]()
            try:
                got = {
                    "lookup": lambda: c.fast.lookup("r", arg, Effect(flag, lambda: None)),
                    "touch": lambda: c.fast.touch(None, arg),
                    "jobs_step": lambda: c.fast.jobs_step(arg, [])[0],
                }[call]()
            except (Boom, TypeError):  # (a key that fails to convert is a TypeError)
                self.assertEqual(fate, "raise")
                continue
            except kvtier.KvtierError as e:
                self.assertEqual((fate, e.errno), ("close", errno.EBADF))
                continue
            self.assertIn(fate, ("none", "clear"))
            self.assertEqual(got, want, "call %d: %s %s" % (n, call, fate))
        c.close()
        self.assertGreater(n, 100)


if __name__ == "__main__":
    base.SERVER = sys.argv.pop(1)
    unittest.main(verbosity=2)

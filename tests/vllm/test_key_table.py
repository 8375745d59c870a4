# SPDX-License-Identifier: Apache-2.0
"""The secondary tier's lookup table: kvtier._fast.KeyTable (C, what the package
uses) against kvtier.vllm._PyKeyTable (Python, for a package without the
extension), operation by operation on random sequences, and the rules of the
tier's docstrings on each (the tier through vLLM: test_vllm_tier.py)."""

import random

import pytest

import kvtier
from kvtier import vllm as kv

from vllm.v1.kv_offload.base import LookupResult

R, H, M = LookupResult.RETRY, LookupResult.HIT, LookupResult.MISS


def tables():
    assert kvtier._fast is not None and hasattr(kvtier._fast, "KeyTable")
    return kvtier._fast.KeyTable(R, H, M), kv._PyKeyTable(R, H, M)


@pytest.fixture(params=["c", "py"])
def table(request):
    c, py = tables()
    return c if request.param == "c" else py


def same(c, py, universe):
    assert len(c) == len(py)
    assert c.requests == py.requests and c.pending == py.pending
    for k in universe:
        assert c.state(k) == py.state(k), k


@pytest.mark.parametrize("seed", range(12))
def test_c_table_answers_as_the_python_one(seed):
    rnd = random.Random(seed)
    c, py = tables()
    nkeys = rnd.choice([5, 40, 400])
    universe = [b"key-%d-%d" % (seed, i) for i in range(nkeys)]
    rids = ["req-%d" % i for i in range(rnd.choice([2, 8, 30]))]
    probes = []  # (keys, gens) flushed, their verdicts still to come
    ops = 0
    for _ in range(4000):
        op = rnd.random()
        if op < 0.55:
            k = rnd.choice(universe)
            k2 = bytes(bytearray(k))  # an equal key, another object
            rid = rnd.choice(rids)
            up = rnd.random() > 0.05
            assert c.lookup(k2 if rnd.random() < 0.3 else k, rid, up) is py.lookup(k, rid, up)
        elif op < 0.62:
            rid = rnd.choice(rids)
            c.request_finished(rid)
            py.request_finished(rid)
        elif op < 0.72:
            ks = rnd.sample(universe, min(len(universe), rnd.randint(1, 20)))
            present = rnd.random() < 0.6
            c.mark(set(ks) if not present else ks, present)
            py.mark(ks, present)
        elif op < 0.82:
            got = c.flush()
            assert got == py.flush()
            if got[0]:
                probes.append(got)
        elif op < 0.97 and probes:
            keys, gens = probes.pop(rnd.randrange(len(probes)))
            vs = [rnd.choice([kvtier.MISS, kvtier.HIT, kvtier.HIT_PENDING, kvtier.RETRY])
                  for _ in keys]
            assert c.apply(keys, gens, vs) == py.apply(keys, gens, vs)
            if rnd.random() < 0.3:  # a stale copy lands again: nothing may change
                assert c.apply(keys, gens, vs) == py.apply(keys, gens, vs)
        elif op > 0.995:
            c.node_down()
            py.node_down()
        ops += 1
        same(c, py, universe)
    for rid in rids:
        c.request_finished(rid)
        py.request_finished(rid)
    same(c, py, universe)
    assert ops == 4000 and c.requests == 0


def test_lookup_rules(table):
    t = table
    # a new key: RETRY, asked at the step's end; a node that is down makes it a MISS
    assert t.lookup(b"a", "r1", True) is R
    assert t.lookup(b"z", "r1", False) is M and t.state(b"z") is None
    assert t.state(b"a") == (0, R, False, 1)
    assert t.lookup(b"a", "r1", True) is R and t.state(b"a")[3] == 1  # once per request
    assert t.lookup(b"a", "r2", True) is R and t.state(b"a")[3] == 2
    assert t.lookup(b"b", "r2", True) is R and t.pending == 2
    keys, gens = t.flush()
    assert keys == [b"a", b"b"] and gens == [0, 1] and t.pending == 0
    assert t.state(b"a") == (0, R, True, 2)
    # verdicts land at their generation: HIT_PENDING is a HIT; RETRY changes nothing
    assert t.apply(keys, gens, [kvtier.HIT_PENDING, kvtier.RETRY]) == (0, 0, 1, 1)
    assert t.state(b"a") == (0, H, False, 2) and t.state(b"b") == (1, R, True, 1)
    assert t.lookup(b"a", "r3", True) is H
    # a successful store makes a key HIT at a new generation: a late verdict of the
    # old one does not land
    t.mark([b"b"], True)
    assert t.state(b"b") == (2, H, False, 1)
    assert t.apply([b"b"], [1], [kvtier.MISS]) == (1, 0, 0, 0)
    assert t.state(b"b") == (2, H, False, 1)
    # a failed load makes a verdict MISS (#49176), not a key still waiting
    assert t.lookup(b"c", "r3", True) is R
    t.mark({b"a", b"c"}, False)
    assert t.state(b"a")[1] is M and t.state(b"c")[1] is R
    assert t.lookup(b"a", "r1", True) is M
    # a request's end: its keys lose it; a key no request holds, no probe waits for, goes
    t.request_finished("r1")
    assert t.state(b"a")[3] == 2 and t.requests == 2
    t.request_finished("r2")
    assert t.state(b"b") is None and t.state(b"a")[3] == 1
    t.request_finished("r3")
    assert t.state(b"a") is None and t.requests == 0
    # c's probe never went out (no flush): it goes with its request; a probe out
    # keeps its key until its verdict lands
    assert t.state(b"c") is None and len(t) == 0
    assert t.lookup(b"d", "r4", True) is R
    keys, gens = t.flush()
    t.request_finished("r4")
    assert t.state(b"d") == (4, R, True, 0)
    assert t.apply(keys, gens, [kvtier.HIT]) == (0, 1, 0, 0)
    assert t.state(b"d") is None and len(t) == 0


def test_store_of_a_key_no_request_holds_drops_it(table):
    t = table
    assert t.lookup(b"k", "r", True) is R
    t.flush()
    t.request_finished("r")
    assert t.state(b"k")[3] == 0  # its probe is out
    t.mark([b"k"], True)
    assert t.state(b"k") is None and len(t) == 0


def test_node_down_makes_waiting_keys_miss(table):
    t = table
    for i in range(100):  # several runs of the C table's slots, deletions among them
        t.lookup(b"k%d" % i, "r%d" % (i % 3), True)
    keys, gens = t.flush()
    t.apply(keys[:50], gens[:50], [kvtier.HIT] * 50)
    t.request_finished("r0")
    t.node_down()
    for i in range(100):
        st = t.state(b"k%d" % i)
        if i % 3 == 0:
            assert st is None if i >= 50 else st is None or st[3] == 0
        elif i < 50:
            assert st[1] is H
        else:
            assert st[1] is M and not st[2]
    assert t.lookup(b"k61", "r1", True) is M


def test_bad_input_changes_nothing(table):
    t = table
    t.lookup(b"a", "r", True)
    keys, gens = t.flush()
    before = (len(t), t.state(b"a"))
    with pytest.raises(ValueError):
        t.apply(keys, gens, [])
    with pytest.raises(ValueError):
        t.apply(keys, gens, [7])
    with pytest.raises(ValueError):
        t.apply(keys + [b"a"], gens + [0], [kvtier.HIT, 9])
    assert (len(t), t.state(b"a")) == before


def test_c_table_takes_bytes_keys_only():
    c, _ = tables()
    with pytest.raises(TypeError):
        c.lookup("a str", "r", True)
    with pytest.raises(TypeError):
        c.mark([1], True)
    assert len(c) == 0 and c.requests == 0 and c.pending == 0


def test_c_table_grows_and_shrinks_by_many_keys():
    c, py = tables()
    universe = [b"g-%d" % i for i in range(20000)]
    for i, k in enumerate(universe):
        assert c.lookup(k, "r%d" % (i % 50), True) is py.lookup(k, "r%d" % (i % 50), True)
    assert c.flush() == py.flush()
    for r in range(0, 50, 2):
        c.request_finished("r%d" % r)
        py.request_finished("r%d" % r)
    same(c, py, universe)
    assert len(c) == 20000  # probes out keep their keys (a verdict may still come)
    keys = universe[::3]
    gens = [py.state(k)[0] for k in keys]
    assert c.apply(keys, gens, [kvtier.MISS] * len(keys)) == (len(keys), 0, 0, 0)
    py.apply(keys, gens, [kvtier.MISS] * len(keys))
    same(c, py, universe)
    assert len(c) == 20000 - len([i for i in range(0, 20000, 3) if i % 2 == 0])
    c.node_down()
    py.node_down()
    same(c, py, universe)
    assert len(c) == 10000

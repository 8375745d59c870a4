# SPDX-License-Identifier: Apache-2.0
"""kvtier.vllm.KvtierSecondaryTier inside the real vLLM 0.34.0 (tools/vllm-env):
vLLM's own TieringOffloadingManager, its real CPU primary tier on its shared
region, and the tier made by vLLM's SecondaryTierFactory, against real kvtierd
nodes (tests/vllm/kvt_nodes.py) on loopback.

Run by tests/vllm/run (ctest label "vllm"): $KVTIERD is the daemon to start."""

import errno
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import kvtier
from kvtier.vllm import KvtierMetrics, KvtierSecondaryTier, register

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)

import engine as eng_mod  # noqa: E402
import kvt_nodes  # noqa: E402

from vllm.v1.kv_offload.base import (  # noqa: E402
    Locality,
    LookupResult,
    Medium,
    OffloadPolicy,
    ReqContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.tiering.base import SecondaryTierManager, TransferJob  # noqa: E402
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory  # noqa: E402

KVTIERD = os.environ.get("KVTIERD", os.path.join(ROOT, "build", "node", "kvtierd"))
TMP = os.environ.get("KVT_TEST_TMPDIR")
ROW = 256 << 10
# The longest a scheduler step may take here (the tier never waits for a node; the
# bound is for a loaded 2-core machine running sanitized daemons beside the test).
STEP_BOUND_S = 0.25

register()


@pytest.fixture(params=["c", "py"])
def key_table(request, monkeypatch):
    """The tier's lookup table: kvtier._fast's (the package's) or the Python one (a
    package without the extension): both must keep the tier's rules."""
    if request.param == "py":
        monkeypatch.setattr(kvtier.vllm, "_key_table",
                            lambda: kvtier.vllm._PyKeyTable(LookupResult.RETRY, LookupResult.HIT,
                                                            LookupResult.MISS))
    return request.param


@pytest.fixture
def cluster():
    c = kvt_nodes.Cluster(KVTIERD, n=2, row_bytes=ROW, primary="128MiB", tmp=TMP,
                          log_level="info").start()
    yield c
    c.stop()
    c.cleanup()


def kv(socket, **extra):
    t = {"type": "kvtier", "socket": socket, "timeout_ms": 2000}
    t.update(extra)
    return t


def engine2(cluster, node, n, salt, announce=False, timeout=30):
    """Engine 2 in a process of its own (tests/vllm/engine.py)."""
    spec = {"tiers": [kv(cluster.socks[node])], "num_chunks": max(64, n + 8), "row": ROW,
            "n": n, "salt": salt, "announce": announce, "timeout": timeout}
    return subprocess.Popen([sys.executable, os.path.join(HERE, "engine.py"), json.dumps(spec)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def result_of(p, timeout=120):
    out, _ = p.communicate(timeout=timeout)
    assert p.returncode == 0, out
    return json.loads(out.strip().splitlines()[-1])


def store(e, n, salt):
    ctx = e.request()
    keys = [eng_mod.key(i, salt.encode()) for i in range(n)]
    e.store(ctx, keys, lambda i, k: eng_mod.row_bytes_of(i, e.row, salt.encode()))
    e.settle()
    e.finish(ctx)
    return keys


# ---- packaging --------------------------------------------------------------------

def test_version_is_the_projects():
    with open(os.path.join(ROOT, "CMakeLists.txt")) as f:
        want = re.search(r"project\(kvtier VERSION ([0-9.]+)", f.read()).group(1)
    assert kvtier.__version__ == want
    assert importlib.metadata.version("kvtier") == want
    # The library is the one inside the installed package: no variable needed.
    assert "KVTIER_CLIENT_LIB" not in os.environ
    assert os.path.dirname(kvtier._load()._name) == os.path.dirname(kvtier.__file__)
    # and so is its extension of the hot calls (pip builds it; abi3, one wheel for all)
    assert "KVTIER_FAST_MODULE" not in os.environ
    assert kvtier._fast is not None
    assert os.path.dirname(kvtier._fast.__file__) == os.path.dirname(kvtier.__file__)
    assert kvtier._fast.__file__.endswith(".abi3.so")


def test_tier_by_module_path_and_by_entry_point(cluster):
    # The entry point vLLM's plugin loader runs (vllm.general_plugins).
    eps = importlib.metadata.entry_points(group="vllm.general_plugins")
    assert "kvtier.vllm:register" in [ep.value for ep in eps if ep.name == "kvtier"]
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    assert SecondaryTierFactory.get_tier_class({"type": "kvtier"}) is KvtierSecondaryTier
    by_path = SecondaryTierFactory.get_tier_class(
        {"type": "KvtierSecondaryTier", "module_path": "kvtier.vllm"})
    assert by_path is KvtierSecondaryTier and issubclass(by_path, SecondaryTierManager)
    e = eng_mod.Engine([{"type": "KvtierSecondaryTier", "module_path": "kvtier.vllm",
                         "socket": cluster.socks[0]}])
    try:
        assert isinstance(e.tiers[0], KvtierSecondaryTier)
        store(e, 2, "mp")
    finally:
        e.shutdown()


# ---- the main path: two engines, two nodes ----------------------------------------

def test_engine2_on_another_node_loads_engine1s_chunks(cluster):
    e1 = eng_mod.Engine([kv(cluster.socks[0])])
    try:
        store(e1, 16, "two")
        r = result_of(engine2(cluster, 1, 16, "two"))
    finally:
        e1.shutdown()
    # RETRY (node B is asking), HIT_PENDING (promotion), HIT, for every key.
    assert r["seen"] == [["RETRY", "HIT_PENDING", "HIT"]] * 16, r["seen"]
    assert r["good"] == 16 and r["wrong"] == 0
    assert r["worst_step_s"] < STEP_BOUND_S
    # Node A took the 16 rows from engine 1 (its /metrics); node B, which no engine
    # stored anything on (its first verdicts were RETRY: it had to ask its peers),
    # filled engine 2's rows with them (engine 2's tier stats, in vLLM's names).
    assert cluster.wait_metric(0, "kvtier_engine_job_rows_stored", 16) == 16
    assert r["stats"]["vllm:kv_offload_kvtier_job_rows:('load', 'ok')"] == 16
    # Node B answered HIT once it located them (never HIT_PENDING: it promotes
    # nothing into its own primary), and its load jobs READ each row from node A
    # straight into engine 2's region: no intermediate copy, nothing in B's primary.
    assert r["stats"]["vllm:kv_offload_kvtier_lookup_verdicts:('hit',)"] >= 16
    assert r["stats"].get("vllm:kv_offload_kvtier_lookup_verdicts:('hit_pending',)", 0) == 0
    assert cluster.wait_metric(1, "kvtier_engine_job_rows_read_direct", 16) == 16
    assert cluster.wait_metric(1, "kvtier_net_pulled_into_chunks", 16) == 16
    assert cluster.metric(1, "kvtier_primary_chunks") == 0


def test_engines_on_one_node_share_its_cache(cluster):
    e1 = eng_mod.Engine([kv(cluster.socks[0])])
    e3 = eng_mod.Engine([kv(cluster.socks[0])])
    try:
        keys = store(e1, 8, "share")
        ctx = e3.request()
        seen, final, worst = e3.lookup_until_hit(ctx, keys)
        # Node A holds them: its verdict is HIT at once, so vLLM promotes.
        assert [s for s in seen.values()] == [["RETRY", "HIT_PENDING", "HIT"]] * 8
        rows = e3.load_rows(ctx, keys)
        assert rows == [eng_mod.row_bytes_of(i, ROW, b"share") for i in range(8)]
        e3.finish(ctx)
    finally:
        e1.shutdown()
        e3.shutdown()


def test_node_a_killed_during_loads(cluster):
    n = 96
    e1 = eng_mod.Engine([kv(cluster.socks[0])], num_chunks=n + 8)
    try:
        store(e1, n, "kill")
    finally:
        e1.shutdown()
    p = engine2(cluster, 1, n, "kill", announce=True, timeout=60)
    assert p.stdout.readline().strip() == "FIRST-STEP"
    cluster.kill(0)  # node A goes while node B pulls from it
    p.stdin.write("\n")
    p.stdin.flush()
    r = result_of(p)
    # Every key ends HIT or MISS; vLLM never sees a wrong byte; a step never waits.
    assert None not in r["final"]
    assert r["wrong"] == 0
    assert r["good"] == r["final"].count("HIT")
    assert r["worst_step_s"] < STEP_BOUND_S
    # The kill happened before every row arrived (else this test proves nothing).
    assert r["final"].count("MISS") > 0, r["final"]


def test_own_node_gone_jobs_fail_lookups_miss(cluster, key_table):
    e = eng_mod.Engine([kv(cluster.socks[0], reconnect_s=60)])
    try:
        tier = e.tiers[0]
        assert type(tier._table).__name__ == ("KeyTable" if key_table == "c" else "_PyKeyTable")
        ctx = e.request()
        keys = [eng_mod.key(i, b"gone") for i in range(4)]
        with e.mgr.lock:
            out = e.mgr.prepare_store(keys, ctx)
            e.mgr.complete_store(out.keys_to_store, ctx)  # the cascade job is queued
        cluster.kill(0)
        t0 = time.monotonic()
        e.step([ctx.req_id])  # sends it to a node that is gone
        assert time.monotonic() - t0 < STEP_BOUND_S
        e.settle(timeout=10)  # the job is reported (failed): nothing left pending
        assert not tier.has_pending_work()
        t0 = time.monotonic()
        with e.mgr.lock:
            r = [e.mgr.lookup(eng_mod.key(i, b"other"), ctx) for i in range(4)]
        assert time.monotonic() - t0 < STEP_BOUND_S
        assert r == [LookupResult.MISS] * 4
        st = tier.get_stats().reduce()
        assert st.get(KvtierMetrics.NODE_ERRORS, 0) >= 1
        assert st[KvtierMetrics.NODE_CONNECTED] == 0
        e.finish(ctx)
    finally:
        e.shutdown()


# ---- the contract, point by point, on the tier vLLM's factory made ------------------

def _job(job_id, keys, rows, req="r"):
    return TransferJob(job_id=job_id, keys=keys, chunk_ids=np.array(rows, dtype=np.int32),
                       is_promotion=True, req_context=ReqContext(req_id=req))


def _finished(tier, ids, timeout=10):
    got = {}
    deadline = time.monotonic() + timeout
    while True:
        tier.on_schedule_end(ScheduleEndContext([], ()))
        for res in tier.get_finished_jobs():
            assert res.job_id not in got, "a job reported twice"
            got[res.job_id] = res
        if (ids and set(got) >= set(ids)) or time.monotonic() >= deadline:
            return got
        time.sleep(0.002)


def test_contract_points(cluster, key_table):
    e = eng_mod.Engine([kv(cluster.socks[0], request_level=True, enable_kv_events=True,
                           locality="REMOTE")], events=True)
    try:
        tier = e.tiers[0]
        assert type(tier._table).__name__ == ("KeyTable" if key_table == "c" else "_PyKeyTable")
        assert tier.medium is Medium.CPU and tier.locality is Locality.REMOTE
        ctx = ReqContext(req_id="contract")
        # on_new_request: request-level policy when asked
        assert tier.on_new_request(ctx).policy is OffloadPolicy.REQUEST_LEVEL
        keys = [eng_mod.key(i, b"contract") for i in range(3)]
        for i in range(3):
            e.rows[i] = np.frombuffer(eng_mod.row_bytes_of(i, ROW, b"contract"), dtype=np.uint8)
        # lookup never blocks: RETRY until the node's verdict is here
        t0 = time.monotonic()
        assert tier.lookup(keys[0], ctx) is LookupResult.RETRY
        assert time.monotonic() - t0 < 0.01
        # submit_store never blocks; the step's job goes out at on_schedule_end
        t0 = time.monotonic()
        tier.submit_store(TransferJob(job_id=1, keys=keys, chunk_ids=np.array([0, 1, 2]),
                                      is_promotion=False, req_context=ctx))
        assert time.monotonic() - t0 < 0.01
        assert tier.has_pending_work()
        got = _finished(tier, [1])
        assert got[1].success and got[1].transfer_bytes == 3 * ROW
        # a successful store makes its keys present for the lookup that asked
        assert tier.lookup(keys[0], ctx) is LookupResult.HIT
        # take_events: stored, with the tier's medium and locality
        ev = list(tier.take_events())
        assert len(ev) == 1 and ev[0].keys == keys and not ev[0].removed
        assert ev[0].medium is Medium.CPU and ev[0].locality is Locality.REMOTE
        assert list(tier.take_events()) == []
        # a load with one key the node does not have: partial failure, exactly once,
        # successful_keys names the good one, its bytes are right
        missing = eng_mod.key(99, b"contract")
        assert tier.lookup(missing, ctx) is LookupResult.RETRY
        tier.on_schedule_end(ScheduleEndContext([], ()))
        e.rows[5] = 0
        tier.submit_load(_job(2, [keys[1], missing], [5, 6], req="contract"))
        got = _finished(tier, [2])
        assert not got[2].success and list(got[2].successful_keys) == [keys[1]]
        assert e.rows[5].tobytes() == eng_mod.row_bytes_of(1, ROW, b"contract")
        assert _finished(tier, [], timeout=0.2) == {}
        # a key the node said it had, whose load failed, is a MISS from now on (#49176)
        ghost = eng_mod.key(7, b"ghost")
        assert tier.lookup(ghost, ctx) is LookupResult.RETRY  # looked up by "contract"
        tier._table.mark([ghost], True)  # a HIT verdict for it (as a store's)
        assert tier.lookup(ghost, ctx) is LookupResult.HIT
        tier.submit_load(_job(3, [ghost], [7], req="contract"))
        got = _finished(tier, [3])
        assert not got[3].success and not got[3].successful_keys
        assert tier.lookup(ghost, ctx) is LookupResult.MISS
        # touch reaches the node with the next step (no error comes back)
        tier.touch(keys, ctx)
        tier.on_schedule_end(ScheduleEndContext([], ()))
        # drain_jobs blocks until every job is reported
        tier.submit_store(TransferJob(job_id=4, keys=[eng_mod.key(50, b"contract")],
                                      chunk_ids=np.array([3]), is_promotion=False,
                                      req_context=ctx))
        tier.drain_jobs()
        assert [r.job_id for r in tier.get_finished_jobs()] == [4]
        assert not tier.has_pending_work()
        # get_stats: vLLM's metric names, all defined by build_metric_definitions
        defs = KvtierSecondaryTier.build_metric_definitions({})
        st = tier.get_stats()
        types, values = st.metric_sections()
        assert set(values) <= set(defs) and KvtierMetrics.VERDICTS in values
        assert all(name.startswith("vllm:") for name in defs)
        assert values[KvtierMetrics.JOB_ROWS][("load", "failed")] == 2
        assert values[KvtierMetrics.NODE_CONNECTED][()] == 1
        # on_request_finished drops the request's lookup state
        tier.on_request_finished(ctx)
        # ("contract" is the only request here: no key is looked up by any now, and
        # none is left: every probe's verdict is in)
        assert tier._table.requests == 0
        for k in keys + [missing, ghost]:
            st = tier._table.state(k)
            assert st is None or st[3] == 0
        assert len(tier._table) == 0
    finally:
        e.shutdown()


def test_attach_refused_for_a_region_of_another_row_size(cluster):
    # vLLM's rows are 128 KiB here, the node's 256 KiB: the node refuses the
    # region (and counts it); the tier reports the node down, so lookups MISS.
    e = eng_mod.Engine([kv(cluster.socks[0], reconnect_s=60)], row=128 << 10)
    try:
        ctx = e.request()
        with e.mgr.lock:
            assert e.mgr.lookup(eng_mod.key(1), ctx) is LookupResult.MISS
        assert cluster.wait_metric(0, "kvtier_engine_attach_refused", 1) == 1
        e.finish(ctx)
    finally:
        e.shutdown()


def test_region_already_unlinked(cluster):
    # vLLM's workers unlink the region's path once all have mapped it; the tier
    # still finds the file behind the scheduler's view and the node maps it.
    from kvtier.vllm import region_fd_of

    e = eng_mod.Engine([])
    try:
        os.unlink(e.region.mmap_path)
        fd, off = region_fd_of(e.view, types_ns(_scheduler_mmap=e.region))
        try:
            assert off == 0 and os.fstat(fd).st_size >= e.view.nbytes
            with kvtier.Client(cluster.socks[0], timeout_ms=5000) as c:
                assert c.attach_region(fd, off, e.view.shape[0], ROW) == ROW
                e.rows[3] = np.frombuffer(eng_mod.row_bytes_of(3, ROW), dtype=np.uint8)
                k = eng_mod.key(3, b"unlinked")
                _, done = c.jobs_step([], [kvtier.Job(1, kvtier.JOB_STORE, [k], [3])])
                assert done and done[0].ok
        finally:
            os.close(fd)
    finally:
        e.shutdown()


def types_ns(**kw):
    import types

    return types.SimpleNamespace(**kw)


# ---- model fingerprints and resets ---------------------------------------------------

def _offloading_config(name="Qwen/Qwen3-0.6B", dtype="bfloat16", tp=1, agnostic=False):
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )

    return OffloadingConfig(
        groups=(OffloadingGroupConfig(16, ("layer.0", "layer.1"), 0),),
        worker_kv_bytes_per_block=ROW // tp, enable_kv_cache_events=False, extra_config={},
        engine_id="kvt-test", model=OffloadingModelConfig(name, dtype),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(0, tp, tp, 1, 1, 1, 0, 1, None, agnostic))


def test_fingerprint_from_vllm_config(monkeypatch):
    from kvtier.vllm import model_fingerprint

    monkeypatch.delenv("PYTHONHASHSEED", raising=False)

    def fp(row=ROW, **kw):
        return model_fingerprint(types_ns(config=_offloading_config(**kw)), row)

    a = fp()
    assert a == fp()  # the same config, the same fingerprint (nothing random in it)
    assert a.startswith("vllm:Qwen/Qwen3-0.6B:bfloat16:") and len(a) <= kvtier.FINGERPRINT_MAX
    assert len({a, fp(dtype="float16"), fp(name="other/model"), fp(tp=2), fp(row=ROW // 2)}) == 5
    # A layout that is the same bytes under any parallelism does not name it.
    assert fp(tp=2, agnostic=True) != fp(tp=2)
    monkeypatch.setenv("PYTHONHASHSEED", "7")
    assert fp() != a
    assert model_fingerprint(types_ns(), ROW) is None  # no config: declares none


def _total(sock, name, label):
    with kvtier.Client(sock, timeout_ms=5000) as c:
        return sum(s.value for s in c.get_stats(totals=True)
                   if s.name == name and s.label == label)


def test_engine_of_another_model_refused(cluster):
    e1 = eng_mod.Engine([kv(cluster.socks[0])], spec_attrs={"config": _offloading_config()})
    e2 = None
    try:
        fp = e1.tiers[0].fingerprint
        assert fp is not None and fp.startswith("vllm:")
        store(e1, 2, "fpa")
        with kvtier.Client(cluster.socks[0], timeout_ms=5000) as c:
            assert c.node_fingerprint == fp  # the first engine's is the node's
        # Another dtype: the node refuses the engine; its lookups MISS, nothing loads.
        e2 = eng_mod.Engine([kv(cluster.socks[0], reconnect_s=60)],
                            spec_attrs={"config": _offloading_config(dtype="float16")})
        assert e2.tiers[0].fingerprint != fp
        ctx = e2.request()
        with e2.mgr.lock:
            assert e2.mgr.lookup(eng_mod.key(0, b"fpa"), ctx) is LookupResult.MISS
        assert not e2.tiers[0]._node_up
        assert _total(cluster.socks[0], "kvtier_engine_refused", "fingerprint") == 1
        e2.finish(ctx)
    finally:
        e1.shutdown()
        if e2 is not None:
            e2.shutdown()


def test_vllm_reset_keeps_the_nodes_chunks_operator_reset_drops_them(cluster):
    e = eng_mod.Engine([kv(cluster.socks[0])])
    try:
        kept = store(e, 3, "rst-kept")
        dropped = store(e, 3, "rst-dropped")
        # vLLM's reset_cache (/reset_prefix_cache) drains the tier and clears vLLM's
        # primary; the node keeps its chunks: they come back from it.
        with e.mgr.lock:
            e.mgr.reset_cache()
            e.mgr.on_reset_flushed()
        ctx = e.request()
        _, final, _ = e.lookup_until_hit(ctx, kept)
        assert [final[k] for k in kept] == [LookupResult.HIT] * 3
        assert e.load_rows(ctx, kept) == [eng_mod.row_bytes_of(i, ROW, b"rst-kept")
                                          for i in range(3)]
        e.finish(ctx)
        e.settle()
        # The operator's reset on the node (the tier holds nothing between steps).
        with kvtier.Client(cluster.socks[0], timeout_ms=5000) as c:
            c.reset()
        ctx = e.request()
        _, final, _ = e.lookup_until_hit(ctx, dropped)
        assert [final[k] for k in dropped] == [LookupResult.MISS] * 3
        e.finish(ctx)
    finally:
        e.shutdown()


# ---- what the node's limits would refuse --------------------------------------------

def test_job_past_the_nodes_key_limit_goes_in_parts():
    # vLLM hands a request's whole promotion (or a request-level cascade) over as one
    # job: a long prompt has more keys than one message to the node may carry
    # (max_keys, 4096). The job goes in parts and is reported once, whole; a key
    # missing in a later part fails only that key.
    row = 4096
    c = kvt_nodes.Cluster(KVTIERD, n=1, row_bytes=row, primary="64MiB", tmp=TMP,
                          network=False).start()
    n = 4500
    e = None
    try:
        e = eng_mod.Engine([kv(c.socks[0])], num_chunks=n + 8, row=row)
        tier = e.tiers[0]
        with kvtier.Client(c.socks[0], timeout_ms=5000) as cl:
            assert n > cl.max_keys
        keys = [eng_mod.key(i, b"parts") for i in range(n)]
        for i in range(n):
            e.rows[i] = np.frombuffer(eng_mod.row_bytes_of(i, row, b"parts"), dtype=np.uint8)
        tier.submit_store(TransferJob(job_id=1, keys=keys, chunk_ids=np.arange(n),
                                      is_promotion=False, req_context=ReqContext(req_id="p")))
        got = _finished(tier, [1], timeout=30)
        assert got[1].success and got[1].transfer_bytes == n * row
        e.rows[:n] = 0
        load = keys[:]
        load[4400] = eng_mod.key(4400, b"nowhere")  # in the second part: not stored
        tier.submit_load(_job(2, load, list(range(n)), req="p"))
        got = _finished(tier, [2], timeout=30)
        assert list(got) == [2]
        assert not got[2].success
        assert list(got[2].successful_keys) == keys[:4400] + keys[4401:]
        for i in (0, 4095, 4096, 4399, 4401, n - 1):
            assert e.rows[i].tobytes() == eng_mod.row_bytes_of(i, row, b"parts"), i
        assert not e.rows[4400].any()
        assert _finished(tier, [], timeout=0.2) == {}  # (once)
        assert tier._node_up and not tier.has_pending_work()
    finally:
        if e is not None:
            e.shutdown()
        c.stop()
        c.cleanup()


def test_bad_keys_and_rows_fail_their_own_job_only(cluster, key_table):
    # A lookup key the node cannot take (not 1..64 bytes) is a MISS, a job with
    # one fails, a job naming rows outside vLLM's region fails: each alone. The
    # step's other lookups and jobs go on, the tier's I/O thread lives, the node
    # stays connected.
    e = eng_mod.Engine([kv(cluster.socks[0])])
    try:
        tier = e.tiers[0]
        ctx = ReqContext(req_id="bad")
        long_key = b"\x01" * 65
        good = [eng_mod.key(i, b"bad") for i in range(3)]
        for i in range(3):
            e.rows[i] = np.frombuffer(eng_mod.row_bytes_of(i, ROW, b"bad"), dtype=np.uint8)
        assert tier.lookup(long_key, ctx) is LookupResult.RETRY
        assert tier.lookup(good[2], ctx) is LookupResult.RETRY
        tier.submit_store(TransferJob(job_id=1, keys=[long_key], chunk_ids=np.array([0]),
                                      is_promotion=False, req_context=ctx))
        tier.submit_store(TransferJob(job_id=2, keys=[good[0]], chunk_ids=np.array([64]),
                                      is_promotion=False, req_context=ctx))
        tier.submit_store(TransferJob(job_id=3, keys=[good[1]], chunk_ids=np.array([-1]),
                                      is_promotion=False, req_context=ctx))
        tier.submit_store(TransferJob(job_id=4, keys=good, chunk_ids=np.array([0, 1, 2]),
                                      is_promotion=False, req_context=ctx))
        got = _finished(tier, [1, 2, 3, 4])
        assert {j: r.success for j, r in got.items()} == {1: False, 2: False, 3: False, 4: True}
        assert tier._thread.is_alive() and tier._node_up
        assert tier.lookup(long_key, ctx) is LookupResult.MISS
        assert tier.lookup(good[2], ctx) is LookupResult.HIT
        assert tier.get_stats().reduce().get(KvtierMetrics.NODE_ERRORS, 0) == 0
        tier.on_request_finished(ctx)
    finally:
        e.shutdown()


def test_bad_tier_options_stop_the_constructor(cluster):
    # A tier option of the wrong type or out of range is refused by the constructor
    # (vLLM stops at start and says which), not left to the tier's I/O thread, which
    # died of it (the tier then answered MISS for good, without a word) or ran with
    # it (a negative job_timeout_s failed every job and reconnected every step).
    e = eng_mod.Engine([])
    made = []
    try:
        spec = types_ns(kv_events_config=None)

        def make(**extra):
            t = SecondaryTierFactory.create_secondary_tier(kv(cluster.socks[0], **extra),
                                                           e.view, spec)
            made.append(t)
            return t

        for extra, what in [({"socket": None}, "socket"), ({"socket": 123}, "socket"),
                            ({"timeout_ms": "x"}, "timeout_ms"), ({"timeout_ms": -1}, "timeout_ms"),
                            ({"timeout_ms": 10**12}, "timeout_ms"),
                            ({"job_timeout_s": -1}, "job_timeout_s"),
                            ({"job_timeout_s": float("nan")}, "job_timeout_s"),
                            ({"poll_ms": -5}, "poll_ms"), ({"reconnect_s": "soon"}, "reconnect_s"),
                            ({"request_level": "maybe"}, "request_level"),
                            ({"enable_kv_events": 2}, "enable_kv_events"),
                            ({"fingerprint": "x" * 300}, "fingerprint"),
                            ({"fingerprint": 123}, "fingerprint"),
                            ({"name": 123}, "name")]:
            t0 = time.monotonic()
            with pytest.raises((TypeError, ValueError), match=what):
                make(**extra)
            assert time.monotonic() - t0 < 1.0
        # A JSON string "false" is false; a name of many bytes per character is cut
        # to the node's 63 bytes, not 63 characters (the node refused it: never up).
        t = make(request_level="false", name="é" * 40, timeout_ms="5000")
        assert t.on_new_request(ReqContext(req_id="o")).policy is not OffloadPolicy.REQUEST_LEVEL
        assert t._node_up and len(t._name.encode()) <= 63
        t.shutdown()
        assert make(request_level="true").on_new_request(
            ReqContext(req_id="o")).policy is OffloadPolicy.REQUEST_LEVEL
    finally:
        for t in made:
            t.shutdown()
        e.shutdown()


def test_fingerprint_of_a_long_non_ascii_model_name_fits(monkeypatch):
    # The model's name may be a local path of any characters: the fingerprint is cut
    # to what the node takes in bytes (a longer one made every connect fail).
    from kvtier.vllm import model_fingerprint

    name = "/models/" + "模型" * 100
    fp = model_fingerprint(types_ns(config=_offloading_config(name=name)), ROW)
    assert fp.startswith("vllm:/models/模型") and len(fp.encode()) <= kvtier.FINGERPRINT_MAX
    assert fp != model_fingerprint(types_ns(config=_offloading_config(name=name + "x")), ROW)


def test_after_shutdown_lookups_miss_and_jobs_fail(cluster, key_table):
    # shutdown() stops the I/O thread: a tier still called after it (shut down while
    # the node was up) answered RETRY for good and kept jobs pending, never reported.
    e = eng_mod.Engine([kv(cluster.socks[0])])
    try:
        tier = e.tiers[0]
        assert tier._node_up
        ctx = ReqContext(req_id="late")
        tier.shutdown()
        assert tier.lookup(eng_mod.key(1, b"late"), ctx) is LookupResult.MISS
        tier.submit_store(TransferJob(job_id=9, keys=[eng_mod.key(2, b"late")],
                                      chunk_ids=np.array([0]), is_promotion=False,
                                      req_context=ctx))
        tier.on_schedule_end(ScheduleEndContext([], ()))
        res = list(tier.get_finished_jobs())
        assert [(r.job_id, r.success) for r in res] == [(9, False)]
        assert not tier.has_pending_work()
        tier.drain_jobs()  # (returns at once)
        tier.shutdown()  # twice is harmless
        tier.on_request_finished(ctx)
    finally:
        e.shutdown()

# SPDX-License-Identifier: Apache-2.0
"""kvtier.vllm.KvtierOffloadingSpec inside the real vLLM 0.34.0: the node as vLLM's
CPU tier itself.

Scheduler side: random call sequences on vLLM's own CPUOffloadingManager and on the
spec's manager (made by vLLM's OffloadingSpecFactory from "spec_name" /
"spec_module_path", over a real kvtierd with no storage and no network tier, the
same policy and as many chunks) give the same answers call for call: lookup
results, the keys each prepare_store plans, their chunk ids, the keys it evicts (so
the policies pick the same victims in the same order), the chunk ids of each
prepare_load. Calls go through the shared-memory ring.

Worker side: vLLM's own CPUOffloadingWorker and transfer handlers (made by the
spec's get_worker) copy blocks between torch CPU tensors, standing in for the GPU's
KV cache (no GPU here), and the node's region, byte for byte both ways, rows laid
out as vLLM's SharedOffloadRegion lays them out; the stand-ins are only what needs
CUDA: the copy kernel (a memmove per descriptor), streams and events.

And: two engines on one node share chunks through the spec; an engine restarted
finds its chunks again; a node restarted under an engine fails the loads prepared
against it, and the engine (scheduler and workers) goes on with the new node; a
node whose rows do not fit the model is refused with what to configure.

Run by tests/vllm/run (ctest label "vllm"): $KVTIERD is the daemon to start."""

import contextlib
import ctypes
import errno
import os
import random
import sys
import time

import numpy as np
import pytest
import torch

import kvtier
from kvtier.vllm import (
    KvtierCPULoadStoreSpec,
    KvtierGeometryError,
    KvtierOffloadingManager,
    KvtierOffloadingSpec,
)

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)

import kvt_nodes  # noqa: E402

from vllm.v1.kv_offload.base import (  # noqa: E402
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
    LookupResult,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.config import (  # noqa: E402
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager  # noqa: E402
from vllm.v1.kv_offload.factory import OffloadingSpecFactory  # noqa: E402
from vllm.v1.kv_offload.pointer_utils import resolve_device_pointers  # noqa: E402

KVTIERD = os.environ.get("KVTIERD", os.path.join(ROOT, "build", "node", "kvtierd"))
TMP = os.environ.get("KVT_TEST_TMPDIR")
PAGE = 4096
END = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())


def node(chunks, policy="lru", row=PAGE, workers=1):
    """One kvtierd whose primary is `chunks` rows, nothing behind it."""
    return kvt_nodes.Cluster(KVTIERD, n=1, row_bytes=row, primary=str(chunks * row), tmp=TMP,
                             storage=False, network=False, workers=workers, policy=policy,
                             log_level="warn").start()


@contextlib.contextmanager
def running(chunks, policy="lru", row=PAGE, workers=1):
    c = node(chunks, policy, row, workers)
    try:
        yield c
    finally:
        c.stop()
        c.cleanup()


def offloading_config(sock, engine_id="eng-a", world_size=1, rank=0, block_bytes=0,
                      blocks_per_chunk=1, events=False, **extra):
    ex = {"spec_name": "KvtierOffloadingSpec", "spec_module_path": "kvtier.vllm",
          "kvtier_socket": sock, "kvtier_connect_timeout_s": 10, "kvtier_reconnect_s": 0.05}
    ex.update(extra)
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("layer.0", "layer.1"),
                                      group_id=0),),
        worker_kv_bytes_per_block=block_bytes,
        enable_kv_cache_events=events,
        extra_config=ex,
        engine_id=engine_id,
        model=OffloadingModelConfig(name="test-model", dtype="float16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=blocks_per_chunk),
        parallel=OffloadingParallelConfig(rank=rank, world_size=world_size, tp_size=world_size,
                                          pp_size=1, pcp_size=1, dcp_size=1,
                                          data_parallel_index=0, data_parallel_size=1,
                                          data_parallel_rank_local=None,
                                          is_parallelism_agnostic=True))


def make_spec(sock, **kw):
    spec = OffloadingSpecFactory.create_spec(offloading_config(sock, **kw))
    assert isinstance(spec, KvtierOffloadingSpec)
    return spec


def key_of(i, salt=b"k"):
    return make_offload_key(salt + str(i).encode().rjust(28, b"."), 0)


# ---- scheduler side: call for call against vLLM's CPU manager ----------------------------

class Pair:
    """vLLM's CPUOffloadingManager and the spec's manager, fed the same calls; every
    answer compared."""

    def __init__(self, chunks, policy, sock):
        self.v = CPUOffloadingManager(num_chunks=chunks, cache_policy=policy)
        self.spec = make_spec(sock, engine_id="conf-%d" % random.getrandbits(32))
        self.k = self.spec.get_manager()
        assert isinstance(self.k, KvtierOffloadingManager)
        assert self.k._client.has_ring
        self.ctx_v, self.ctx_k = {}, {}
        self.calls = 0

    def new(self, req):
        self.ctx_v[req], self.ctx_k[req] = ReqContext(req_id=req), ReqContext(req_id=req)
        a = self.v.on_new_request(self.ctx_v[req])
        b = self.k.on_new_request(self.ctx_k[req])
        assert a.policy == b.policy

    def lookup(self, req, keys):
        for key in keys:
            a = self.v.lookup(key, self.ctx_v[req])
            b = self.k.lookup(key, self.ctx_k[req])
            assert a == b, (key, a, b)
            self.calls += 1

    def ready(self, key, req):
        return self.v.lookup(key, self.ctx_v[req]) is LookupResult.HIT

    def prepare_store(self, req, keys):
        a = self.v.prepare_store(keys, self.ctx_v[req])
        b = self.k.prepare_store(keys, self.ctx_k[req])
        self.calls += 1
        if a is None:
            assert b is None
            return []
        assert b is not None
        assert b.keys_to_store == a.keys_to_store
        assert list(b.store_spec.block_ids) == list(a.store_spec.block_ids)
        assert b.evicted_keys == a.evicted_keys
        return list(a.keys_to_store)

    def complete_store(self, req, keys, success):
        self.v.complete_store(keys, self.ctx_v[req], success)
        self.k.complete_store(keys, self.ctx_k[req], success)
        self.calls += 1

    def prepare_load(self, req, keys):
        a = self.v.prepare_load(keys, self.ctx_v[req])
        b = self.k.prepare_load(keys, self.ctx_k[req])
        assert list(b.block_ids) == list(a.block_ids)
        assert b.region == self.k._region
        self.calls += 1

    def complete_load(self, req, keys):
        self.v.complete_load(keys, self.ctx_v[req])
        self.k.complete_load(keys, self.ctx_k[req])
        self.calls += 1

    def finished(self, req):
        self.v.on_request_finished(self.ctx_v.pop(req))
        self.k.on_request_finished(self.ctx_k.pop(req))
        self.calls += 1

    def step(self):
        self.v.on_schedule_end(END)
        self.k.on_schedule_end(END)
        self.calls += 1


def run_sequence(seed, chunks, policy, sock, ops=300):
    """The call mix of tests/conformance/vllm_policy_replay.py (without touch,
    which vLLM's manager does not have, and reset, which clears the node's cache
    only where the node can reset), with steps."""
    rng = random.Random(seed)
    p = Pair(chunks, policy, sock)
    salt = b"s%d-" % seed
    universe = [key_of(i, salt) for i in range(max(3, chunks * rng.choice([2, 3])))]
    reqs = {}  # req -> {"stores": [[keys]], "pins": [[keys]]}
    n_req = 0

    def finish(req):
        st = reqs.pop(req)
        for keys in st["stores"]:
            p.complete_store(req, keys, True)
        for keys in st["pins"]:
            p.complete_load(req, keys)
        p.finished(req)

    evictions = 0
    for _ in range(ops):
        op = rng.choices(["new", "lookup", "store", "complete_store", "load", "complete_load",
                          "finish", "step"], weights=[6, 8, 20, 14, 8, 8, 5, 6])[0]
        if op == "new" or not reqs:
            if len(reqs) >= 4:
                finish(rng.choice(list(reqs)))
                continue
            req = "r%d" % n_req
            n_req += 1
            reqs[req] = {"stores": [], "pins": []}
            p.new(req)
            continue
        req = rng.choice(list(reqs))
        st = reqs[req]
        if op == "lookup":
            p.lookup(req, rng.sample(universe, rng.randint(1, 4)))
        elif op == "store":
            keys = rng.sample(universe, rng.randint(1, min(4, chunks)))
            before = p.calls
            stored = p.prepare_store(req, keys)
            assert p.calls == before + 1
            if stored:
                st["stores"].append(stored)
        elif op == "complete_store" and st["stores"]:
            keys = st["stores"].pop(rng.randrange(len(st["stores"])))
            p.complete_store(req, keys, rng.random() < 0.9)
        elif op == "load":
            ready = [k for k in universe if p.ready(k, req)]
            if ready:
                keys = rng.sample(ready, rng.randint(1, min(3, len(ready))))
                st["pins"].append(keys)
                p.prepare_load(req, keys)
        elif op == "complete_load" and st["pins"]:
            p.complete_load(req, st["pins"].pop(rng.randrange(len(st["pins"]))))
        elif op == "finish":
            finish(req)
        elif op == "step":
            p.step()
    for req in list(reqs):
        finish(req)
    # Every key's final state, as both see it.
    spare = "final"
    p.new(spare)
    p.lookup(spare, universe)
    p.finished(spare)
    assert p.k._client.drain() == 0  # no posted call failed
    stats = p.k._client.ring_stats()
    p.k.shutdown()
    return p.calls, stats, evictions


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_same_answers_as_vllms_cpu_manager(policy):
    """Random sequences, each against a fresh node of the sequence's size."""
    calls = posted = 0
    for seed in range(1, 13):
        chunks = random.Random(seed).choice([2, 3, 4, 6, 8, 16])
        with running(chunks, policy) as c:
            n, stats, _ = run_sequence(seed, chunks, policy, c.socks[0])
        calls += n
        posted += stats["posted"]
    assert calls > 2000
    # The spec's calls went through the ring.
    assert posted >= calls * 0.5


def run_scans(seed, chunks, policy, sock, steps=60):
    """vLLM's scheduler's own pattern: every request's keys get their positions
    (update_offload_keys), then a forward prefix lookup from a first key until a
    miss (_maximal_prefix_lookup), prepare_load of the hits, prepare_store of the
    rest, completions one step later, on_schedule_end. Requests share prefixes."""
    rng = random.Random(seed)
    p = Pair(chunks, policy, sock)
    salt = b"q%d-" % seed
    prefixes = [[key_of(1000 * j + i, salt) for i in range(rng.randint(2, 10))]
                for j in range(4)]
    live = {}  # req -> keys
    pending = []  # (kind, req, keys) completed next step
    n_req = 0
    for _ in range(steps):
        for kind, req, keys in pending:
            if kind == "load":
                p.complete_load(req, keys)
            else:
                p.complete_store(req, keys, rng.random() < 0.95)
        pending = []
        if len(live) < 3 or rng.random() < 0.3:
            req = "s%d" % n_req
            n_req += 1
            keys = list(rng.choice(prefixes)) + [key_of(100000 + n_req * 100 + i, salt)
                                                for i in range(rng.randint(1, 6))]
            p.new(req)
            # update_offload_keys, on the spec's side only: vLLM's manager would
            # order a finished request's keys by these positions, which do not
            # reach the node (it orders them as first seen, as vLLM does without
            # positions); here they only let the spec scan.
            for i, k in enumerate(keys):
                p.ctx_k[req].set_offload_key_position(k, 16 * (i + 1))
            live[req] = keys
        for req, keys in list(live.items()):
            start = rng.randint(0, 2)
            hits = []
            for key in keys[start:]:  # _maximal_prefix_lookup
                a = p.v.lookup(key, p.ctx_v[req])
                b = p.k.lookup(key, p.ctx_k[req])
                assert a == b, (req, key, a, b)
                p.calls += 1
                if a is not LookupResult.HIT:
                    break
                hits.append(key)
            if hits and rng.random() < 0.7:
                p.prepare_load(req, hits)
                pending.append(("load", req, hits))
            rest = keys[start + len(hits):]
            if rest:
                stored = p.prepare_store(req, rest[:min(len(rest), chunks)])
                if stored:
                    pending.append(("store", req, stored))
            if rng.random() < 0.25:
                for kind, r_, ks in [x for x in pending if x[1] == req]:
                    if kind == "load":
                        p.complete_load(r_, ks)
                    else:
                        p.complete_store(r_, ks, True)
                pending = [x for x in pending if x[1] != req]
                p.finished(req)
                del live[req]
        p.step()
    for kind, req, keys in pending:
        if kind == "load":
            p.complete_load(req, keys)
        else:
            p.complete_store(req, keys, True)
    for req in list(live):
        p.finished(req)
    assert p.k._client.drain() == 0  # no posted call failed
    stats = p.k._client.ring_stats()
    p.k.shutdown()
    return p.calls, stats


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_same_answers_in_vllms_prefix_scans(policy):
    """The scheduler's pattern, where the spec asks the node for a scan's keys in
    one call: the same answers as vLLM's manager, in fewer calls to the node."""
    calls = posted = 0
    for seed in range(1, 7):
        chunks = random.Random(seed).choice([6, 8, 16, 32])
        with running(chunks, policy) as c:
            n, stats = run_scans(seed, chunks, policy, c.socks[0])
        calls += n
        posted += stats["posted"]
    assert calls > 1000
    assert posted < calls * 0.8, (posted, calls)  # scans took fewer node calls


def test_same_answers_through_ctypes_without_the_extension(monkeypatch):
    """A package without kvtier._fast (the Debian package's copy) makes the same
    calls through ctypes: the same answers as vLLM's manager, call for call."""
    monkeypatch.setattr(kvtier, "_fast", None)
    real = KvtierOffloadingSpec.get_manager
    made = []

    def get_manager(self):
        m = real(self)
        made.append(m)
        return m

    monkeypatch.setattr(KvtierOffloadingSpec, "get_manager", get_manager)
    calls = 0
    for seed in range(1, 5):
        chunks = random.Random(seed).choice([2, 4, 8, 16])
        with running(chunks) as c:
            calls += run_sequence(seed, chunks, "lru", c.socks[0])[0]
        with running(16) as c:
            calls += run_scans(seed, 16, "lru", c.socks[0])[0]
    assert calls > 800
    assert made and all(type(m._f).__name__ == "_CtypesConn" for m in made)


def test_spec_is_made_by_vllms_factory_and_checks_geometry():
    with running(8, row=8192, workers=2) as c:
        # 2 workers x 2 KiB per block x 2 blocks per chunk = 8 KiB rows: fits.
        spec = make_spec(c.socks[0], world_size=2, block_bytes=2048, blocks_per_chunk=2)
        assert spec.kv_bytes_per_chunk == 8192 and spec.cpu_page_size_per_worker == 4096
        m = spec.get_manager()
        assert spec.num_chunks == 8
        assert m.config_info()[0]["kvtier_row_bytes"] == 8192
        m.shutdown()
        # One worker too many, or rows too small: refused, with what to set.
        for kw in ({"world_size": 4, "block_bytes": 1024, "blocks_per_chunk": 2},
                   {"world_size": 2, "block_bytes": 4096, "blocks_per_chunk": 2}):
            bad = make_spec(c.socks[0], **kw)
            with pytest.raises(KvtierGeometryError) as ei:
                bad.get_manager()
            assert "primary.row_bytes=" in str(ei.value) and "primary.workers=" in str(ei.value)


# ---- worker side --------------------------------------------------------------------------

class _Stream:
    """current_platform.Stream() for a host without GPU: copies run at once."""

    def wait_stream(self, other):
        pass

    def wait_event(self, event):
        pass


class _Event:
    def __init__(self, enable_timing=False):
        pass

    def record(self, stream=None):
        pass

    def query(self):
        return True

    def synchronize(self):
        pass

    def elapsed_time(self, other):
        return 0.0


def _swap_blocks_batch(src, dst, sizes, is_src_access_order_any=False):
    """vLLM's copy kernel (cuMemcpyBatchAsync) on the host: one memmove per
    descriptor, addresses as vLLM's handlers computed them."""
    for s, d, n in zip(src.tolist(), dst.tolist(), sizes.tolist()):
        ctypes.memmove(d, s, n)


@pytest.fixture
def no_gpu(monkeypatch):
    """What the worker side needs from CUDA, on the host."""
    from vllm import _custom_ops as ops
    from vllm.platforms import current_platform
    from vllm.v1.kv_offload.cpu import gpu_worker

    monkeypatch.setattr(ops, "swap_blocks_batch", _swap_blocks_batch)
    monkeypatch.setattr(gpu_worker, "PIN_MEMORY", False)
    monkeypatch.setattr(gpu_worker.torch, "Event", _Event)
    monkeypatch.setattr(current_platform, "Stream", _Stream, raising=False)
    monkeypatch.setattr(current_platform, "current_stream", lambda: _Stream(), raising=False)
    monkeypatch.setattr(current_platform, "stream", lambda s: contextlib.nullcontext(),
                        raising=False)


class Gpu:
    """A model's KV cache on a torch CPU tensor per layer (the 'GPU' here): blocks of
    page bytes, filled with bytes that name (layer, block, offset)."""

    def __init__(self, n_blocks, page, layers=2, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.tensors = [torch.randint(-128, 127, (n_blocks, page), dtype=torch.int8, generator=g)
                        for _ in range(layers)]
        self.page = page
        self.caches = CanonicalKVCaches(
            tensors=[CanonicalKVCacheTensor(tensor=t, page_size_bytes=page) for t in self.tensors],
            group_data_refs=[[CanonicalKVCacheRef(tensor_idx=i, page_size_bytes=page)
                              for i in range(layers)]])

    def ptrs(self, block_ids):
        spec = GPULoadStoreSpec(list(block_ids), group_sizes=[len(block_ids)], block_indices=[0])
        return resolve_device_pointers(spec, self.caches)

    def block(self, layer, b):
        return self.tensors[layer][b].numpy().tobytes()


def wait_done(worker, job_ids, timeout=10):
    got = {}
    deadline = time.monotonic() + timeout
    while len(got) < len(job_ids) and time.monotonic() < deadline:
        for r in worker.get_finished():
            got[r.job_id] = r.success
        time.sleep(0.001)
    return got


def store_blocks(mgr, worker, gpu, ctx, keys, gpu_blocks, job):
    """vLLM's store path: prepare_store, the worker's copy GPU -> node, complete."""
    out = mgr.prepare_store(keys, ctx)
    assert out is not None and out.keys_to_store == keys
    assert isinstance(out.store_spec, KvtierCPULoadStoreSpec)
    assert worker.submit_store(job, gpu.ptrs(gpu_blocks), out.store_spec)
    assert wait_done(worker, [job]) == {job: True}
    mgr.complete_store(keys, ctx, True)
    return [int(c) for c in out.store_spec.block_ids]


def load_blocks(mgr, worker, gpu, ctx, keys, gpu_blocks, job):
    src = mgr.prepare_load(keys, ctx)
    assert worker.submit_load(job, src, gpu.ptrs(gpu_blocks))
    ok = wait_done(worker, [job])
    mgr.complete_load(keys, ctx)
    return ok.get(job)


def region_rows(sock):
    """An independent client's view of the node's region."""
    return kvtier.Client(sock, name="inspector")


def test_worker_copies_blocks_byte_exact_both_ways(no_gpu):
    page, layers, bpc = 1024, 2, 2  # two 1 KiB layers, two blocks per chunk
    row = page * layers * bpc  # one worker
    with running(16, row=row) as c:
        spec = make_spec(c.socks[0], block_bytes=page * layers, blocks_per_chunk=bpc)
        mgr = spec.get_manager()
        gpu = Gpu(32, page, layers, seed=1)
        worker = spec.get_worker(gpu.caches)
        ctx = ReqContext(req_id="w")
        mgr.on_new_request(ctx)
        keys = [key_of(i, b"w") for i in range(3)]
        chunks = store_blocks(mgr, worker, gpu, ctx, keys, list(range(6)), 1)
        # The node's rows hold the blocks as vLLM lays them out: per chunk, this
        # worker's cell holds layer 0's blocks then layer 1's.
        insp = region_rows(c.socks[0])
        try:
            for j, chunk in enumerate(chunks):
                r = bytes(insp.row(chunk))
                for layer in range(layers):
                    for sub in range(bpc):
                        off = layer * page * bpc + sub * page
                        assert r[off:off + page] == gpu.block(layer, 2 * j + sub)
        finally:
            insp.close()
        # And back, into other blocks.
        assert load_blocks(mgr, worker, gpu, ctx, keys, list(range(20, 26)), 2) is True
        for layer in range(layers):
            for b in range(6):
                assert gpu.block(layer, 20 + b) == gpu.block(layer, b)
        mgr.on_request_finished(ctx)
        worker.shutdown()
        mgr.shutdown()


def test_two_workers_fill_their_own_cells(no_gpu):
    """World size 2: each rank's CPUOffloadingWorker writes its cell of the row
    (rank * cpu_page_size), as in vLLM's shared region."""
    page = 2048
    with running(8, row=2 * page, workers=2) as c:
        specs = [make_spec(c.socks[0], engine_id="tp", world_size=2, rank=r, block_bytes=page)
                 for r in range(2)]
        mgr = specs[0].get_manager()
        gpus = [Gpu(8, page, 1, seed=10 + r) for r in range(2)]
        workers = [specs[r].get_worker(gpus[r].caches) for r in range(2)]
        ctx = ReqContext(req_id="tp")
        mgr.on_new_request(ctx)
        keys = [key_of(i, b"tp") for i in range(2)]
        out = mgr.prepare_store(keys, ctx)
        for r in range(2):
            assert workers[r].submit_store(7, gpus[r].ptrs([3, 4]), out.store_spec)
            assert wait_done(workers[r], [7]) == {7: True}
        mgr.complete_store(keys, ctx, True)
        insp = region_rows(c.socks[0])
        try:
            for j, chunk in enumerate(out.store_spec.block_ids):
                r_ = bytes(insp.row(int(chunk)))
                assert r_[:page] == gpus[0].block(0, 3 + j)
                assert r_[page:] == gpus[1].block(0, 3 + j)
        finally:
            insp.close()
        mgr.on_request_finished(ctx)
        for w in workers:
            w.shutdown()
        mgr.shutdown()


def test_two_engines_share_chunks_and_a_restarted_engine_finds_them(no_gpu):
    page = 4096
    with running(32, row=page) as c:
        a = make_spec(c.socks[0], engine_id="eng-a", block_bytes=page)
        ma, ga = a.get_manager(), Gpu(16, page, 1, seed=3)
        wa = a.get_worker(ga.caches)
        ctx = ReqContext(req_id="same-id")  # the same vLLM id in both engines
        ma.on_new_request(ctx)
        keys = [key_of(i, b"share") for i in range(4)]
        store_blocks(ma, wa, ga, ctx, keys, [0, 1, 2, 3], 1)

        b = make_spec(c.socks[0], engine_id="eng-b", block_bytes=page)
        mb, gb = b.get_manager(), Gpu(16, page, 1, seed=4)
        wb = b.get_worker(gb.caches)
        ctxb = ReqContext(req_id="same-id")
        mb.on_new_request(ctxb)
        assert [mb.lookup(k, ctxb) for k in keys] == [LookupResult.HIT] * 4
        assert load_blocks(mb, wb, gb, ctxb, keys, [8, 9, 10, 11], 1) is True
        assert [gb.block(0, 8 + i) for i in range(4)] == [ga.block(0, i) for i in range(4)]
        mb.on_request_finished(ctxb)
        wb.shutdown()
        mb.shutdown()

        # Engine A goes away and comes back as a new engine (another engine id).
        ma.on_request_finished(ctx)
        wa.shutdown()
        ma.shutdown()
        a2 = make_spec(c.socks[0], engine_id="eng-a-restarted", block_bytes=page)
        m2, g2 = a2.get_manager(), Gpu(16, page, 1, seed=5)
        w2 = a2.get_worker(g2.caches)
        ctx2 = ReqContext(req_id="again")
        m2.on_new_request(ctx2)
        assert [m2.lookup(k, ctx2) for k in keys] == [LookupResult.HIT] * 4
        assert load_blocks(m2, w2, g2, ctx2, keys, [5, 6, 7, 8], 1) is True
        assert [g2.block(0, 5 + i) for i in range(4)] == [ga.block(0, i) for i in range(4)]
        m2.on_request_finished(ctx2)
        w2.shutdown()
        m2.shutdown()


def test_node_restart_fails_loads_and_the_engine_goes_on(no_gpu):
    page = 4096
    c = node(16, row=page)
    try:
        spec = make_spec(c.socks[0], block_bytes=page)
        mgr, gpu = spec.get_manager(), Gpu(16, page, 1, seed=6)
        worker = spec.get_worker(gpu.caches)
        ctx = ReqContext(req_id="live")
        mgr.on_new_request(ctx)
        keys = [key_of(i, b"rs") for i in range(2)]
        store_blocks(mgr, worker, gpu, ctx, keys, [0, 1], 1)
        old_region = mgr._region
        # A load prepared against the node that is about to go.
        src = mgr.prepare_load(keys, ctx)
        assert src.region == old_region

        c.kill(0)
        # Node gone: lookups miss, stores are refused, loads carry no region.
        assert mgr.lookup(keys[0], ctx) is LookupResult.MISS
        assert mgr.prepare_store([key_of(9, b"rs")], ctx) is None
        gone = mgr.prepare_load(keys, ctx)
        assert gone.region is None
        assert worker.submit_load(2, gone, gpu.ptrs([4, 5]))
        assert wait_done(worker, [2]) == {2: False}
        mgr.complete_load(keys, ctx)  # harmless: nothing was pinned

        c.start(0)  # a new node: a new region, empty
        deadline = time.monotonic() + 10
        while mgr._down:  # every call tries to reconnect (kvtier_reconnect_s apart)
            assert mgr.lookup(keys[0], ctx) is LookupResult.MISS
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert mgr.lookup(keys[0], ctx) is LookupResult.MISS  # the new node is empty
        assert mgr._region != old_region
        # The load prepared against the old node fails in the worker.
        assert worker.submit_load(3, src, gpu.ptrs([6, 7]))
        assert wait_done(worker, [3]) == {3: False}
        # The same keys stored and pinned on the new node before the old load's
        # completion comes: that completion is dropped (its pins died with the old
        # node), and the new load's pins stay until its own completion.
        store_blocks(mgr, worker, gpu, ctx, keys, [0, 1], 6)
        again = mgr.prepare_load(keys, ctx)
        assert again.region == mgr._region
        assert read_usage(mgr) > 0
        errors = mgr._errors
        mgr.complete_load(keys, ctx)  # the old load's: dropped, not sent
        assert mgr._errors == errors
        assert read_usage(mgr) > 0
        assert worker.submit_load(7, again, gpu.ptrs([12, 13]))
        assert wait_done(worker, [7]) == {7: True}
        assert gpu.block(0, 12) == gpu.block(0, 0) and gpu.block(0, 13) == gpu.block(0, 1)
        mgr.complete_load(keys, ctx)
        assert read_usage(mgr) == 0
        # The request was registered again: stores and loads work on the new node,
        # the worker attached the new region.
        new_keys = [key_of(i, b"rs2") for i in range(2)]
        store_blocks(mgr, worker, gpu, ctx, new_keys, [8, 9], 4)
        assert load_blocks(mgr, worker, gpu, ctx, new_keys, [10, 11], 5) is True
        assert gpu.block(0, 10) == gpu.block(0, 8) and gpu.block(0, 11) == gpu.block(0, 9)
        mgr.on_request_finished(ctx)
        worker.shutdown()
        mgr.shutdown()
    finally:
        c.stop()
        c.cleanup()


def test_manager_calls_and_stats_through_the_ring():
    with running(8) as c:
        spec = make_spec(c.socks[0], events=True)
        m = spec.get_manager()
        assert isinstance(m._f, kvtier._fast.Conn)  # the package's extension, not ctypes
        before = m._client.ring_stats()["posted"]
        ctx = ReqContext(req_id="st")
        m.on_new_request(ctx)
        keys = [key_of(i, b"st") for i in range(3)]
        out = m.prepare_store(keys, ctx)
        m.complete_store(out.keys_to_store, ctx, True)
        m.on_schedule_end(ScheduleEndContext(new_req_ids=("st",), preempted_req_ids=()))
        evs = list(m.take_events())
        assert [k for e in evs if not e.removed for k in e.keys] == keys
        st = m.get_stats()
        flat = st.reduce()
        assert flat["vllm:kv_offload_kvtier_node_connected"] == 1
        assert "vllm:kv_offload_cpu_cache_usage_perc" in flat
        assert flat["vllm:kv_offload_cpu_allocation_size_count"] == 1
        m.on_request_finished(ctx)
        assert m._client.ring_stats()["posted"] - before >= 6
        m.shutdown()
        # after shutdown: calls answer as for a node gone (no reconnect, no crash)
        late = ReqContext(req_id="late")
        m.on_new_request(late)
        assert m.lookup(keys[0], late) is LookupResult.MISS
        assert m.prepare_store([key_of(9, b"st")], late) is None
        assert m._client is None


# ---- calls of more keys than one node request carries (max_keys) --------------------------
#
# A node request carries at most max_keys keys (4096, kvtierd's limit, not configurable):
# the manager sends a call of more in parts. These tests use more than max_keys keys on
# a node of small rows (one 4 KiB page per chunk).

MAX_KEYS = 4096  # kvtierd's engine limit; each test checks the client reports it


def node_pins_nothing(c, mgr):
    """True when the node holds no pin and no prepared store of any engine: a reset
    (which the node refuses with EBUSY while an engine holds either) succeeds. The
    manager's posted calls are drained first (none may have failed)."""
    assert mgr._client.drain() == 0
    insp = kvtier.Client(c.socks[0], name="resetter")
    try:
        insp.reset()
        return True
    except kvtier.KvtierError as e:
        if e.errno == errno.EBUSY:
            return False
        raise
    finally:
        insp.close()


def store_in_calls(mgr, ctx, keys):
    """Stores keys (no worker: the rows' bytes do not matter) in calls of at most
    MAX_KEYS keys, each planned whole."""
    for lo in range(0, len(keys), MAX_KEYS):
        part = keys[lo:lo + MAX_KEYS]
        out = mgr.prepare_store(part, ctx)
        assert out is not None and out.keys_to_store == part
        mgr.complete_store(part, ctx, True)


def read_usage(mgr):
    return mgr.get_stats().reduce()["vllm:kv_offload_cpu_cache_read_usage_perc"]


def test_a_load_of_more_than_max_keys_keys_loads_every_byte(no_gpu):
    """A long prompt's load (more blocks than one node request carries) is prepared in
    parts and loads every block byte for byte; its completion releases every pin."""
    page = PAGE
    n = 2 * MAX_KEYS + 5  # three parts
    with running(n + 8, row=page) as c:
        spec = make_spec(c.socks[0], block_bytes=page)
        mgr = spec.get_manager()
        assert mgr._client.max_keys == MAX_KEYS
        gpu = Gpu(2 * n, page, 1, seed=21)
        worker = spec.get_worker(gpu.caches)
        ctx = ReqContext(req_id="long")
        mgr.on_new_request(ctx)
        keys = [key_of(i, b"long") for i in range(n)]
        # Stored by vLLM's worker, in calls the node takes whole.
        for j, lo in enumerate(range(0, n, MAX_KEYS)):
            part = keys[lo:lo + MAX_KEYS]
            store_blocks(mgr, worker, gpu, ctx, part, list(range(lo, lo + len(part))), 1 + j)
        assert all(mgr.lookup(k, ctx) is LookupResult.HIT for k in keys)
        # One load of all of them, into other blocks.
        src = mgr.prepare_load(keys, ctx)
        assert src.region == mgr._region and len(src.block_ids) == n
        assert read_usage(mgr) > 0  # pinned
        assert worker.submit_load(10, src, gpu.ptrs(list(range(n, 2 * n))))
        assert wait_done(worker, [10], timeout=60) == {10: True}
        mgr.complete_load(keys, ctx)
        for b in range(n):
            assert gpu.block(0, n + b) == gpu.block(0, b), b
        assert read_usage(mgr) == 0
        assert node_pins_nothing(c, mgr)
        mgr.on_request_finished(ctx)
        worker.shutdown()
        mgr.shutdown()


def test_a_store_of_more_than_max_keys_keys_stores_all(no_gpu):
    """One prepare_store of more keys than a node request carries plans them all
    (chunk ids in key order), vLLM's worker writes them, complete_store completes them
    (nothing stays write-pending), and every key is then a HIT with its bytes."""
    page = PAGE
    n = MAX_KEYS + 300
    with running(n + 4, row=page) as c:
        spec = make_spec(c.socks[0], block_bytes=page)
        mgr = spec.get_manager()
        assert mgr._client.max_keys == MAX_KEYS
        gpu = Gpu(n, page, 1, seed=22)
        worker = spec.get_worker(gpu.caches)
        ctx = ReqContext(req_id="wide")
        mgr.on_new_request(ctx)
        keys = [key_of(i, b"wide") for i in range(n)]
        out = mgr.prepare_store(keys, ctx)
        assert out is not None and out.keys_to_store == keys
        assert out.evicted_keys == []
        ids = [int(x) for x in out.store_spec.block_ids]
        assert len(set(ids)) == n and out.store_spec.region == mgr._region
        assert worker.submit_store(1, gpu.ptrs(list(range(n))), out.store_spec)
        assert wait_done(worker, [1], timeout=60) == {1: True}
        mgr.complete_store(keys, ctx, True)
        assert mgr._client.drain() == 0  # every part's completion taken
        other = ReqContext(req_id="reader")
        mgr.on_new_request(other)
        assert [mgr.lookup(k, other) for k in keys] == [LookupResult.HIT] * n
        insp = region_rows(c.socks[0])
        try:
            for i in (0, 1, MAX_KEYS - 1, MAX_KEYS, n - 1):
                assert bytes(insp.row(ids[i]))[:page] == gpu.block(0, i)
        finally:
            insp.close()
        mgr.on_request_finished(other)
        mgr.on_request_finished(ctx)
        assert node_pins_nothing(c, mgr)  # no store left prepared
        worker.shutdown()
        mgr.shutdown()


def test_a_load_whose_second_part_fails_pins_nothing(no_gpu):
    """A load of more than max_keys keys whose second part the node refuses (one of
    its keys is absent) releases the first part's pins and fails as one refused call
    does: no region, the workers fail it, its completion is dropped; the node holds no
    pin (a reset, refused while an engine holds one, succeeds)."""
    page = PAGE
    n = MAX_KEYS + 20
    with running(n + 8, row=page) as c:
        spec = make_spec(c.socks[0], block_bytes=page)
        mgr = spec.get_manager()
        assert mgr._client.max_keys == MAX_KEYS
        gpu = Gpu(n + 1, page, 1, seed=23)
        worker = spec.get_worker(gpu.caches)
        ctx = ReqContext(req_id="part")
        mgr.on_new_request(ctx)
        keys = [key_of(i, b"part") for i in range(n)]
        store_in_calls(mgr, ctx, keys)
        # All present: the load is prepared (the parts pin), then completed.
        src = mgr.prepare_load(keys, ctx)
        assert src.region == mgr._region
        assert read_usage(mgr) > 0
        mgr.complete_load(keys, ctx)
        assert read_usage(mgr) == 0
        # A key of the second part absent: the first part was pinned, then released.
        bad = keys[:MAX_KEYS + 5] + [key_of(10 ** 6, b"absent")] + keys[MAX_KEYS + 5:]
        failed = mgr.prepare_load(bad, ctx)
        assert failed.region is None and len(failed.block_ids) == len(bad)
        assert not mgr._down  # a refusal, not a node gone
        assert read_usage(mgr) == 0
        assert worker.submit_load(5, failed, gpu.ptrs(list(range(len(bad)))))
        assert wait_done(worker, [5], timeout=60) == {5: False}
        mgr.complete_load(bad, ctx)  # as vLLM completes a failed load: dropped
        assert node_pins_nothing(c, mgr)
        mgr.on_request_finished(ctx)
        worker.shutdown()
        mgr.shutdown()


def test_calls_of_at_most_max_keys_keys_stay_one_node_call():
    """A call of at most max_keys keys is one node call, as before; one key more
    makes two, in order, the keys split at max_keys."""
    n = MAX_KEYS + 1
    with running(2 * n + 8) as c:
        mgr = make_spec(c.socks[0]).get_manager()
        assert mgr._client.max_keys == MAX_KEYS
        calls = []

        def counted(name):
            real = getattr(mgr, name)

            def call(rid, keys, *rest):
                calls.append((name, len(keys), keys[0]))
                return real(rid, keys, *rest)
            setattr(mgr, name, call)

        for name in ("_prepare_store", "_complete_store", "_prepare_load", "_complete_load",
                     "_touch"):
            counted(name)
        ctx = ReqContext(req_id="calls")
        mgr.on_new_request(ctx)
        for salt, size in ((b"one", MAX_KEYS), (b"two", n)):
            keys = [key_of(i, salt) for i in range(size)]
            del calls[:]
            out = mgr.prepare_store(keys, ctx)
            assert out is not None and out.keys_to_store == keys
            mgr.complete_store(keys, ctx, True)
            src = mgr.prepare_load(keys, ctx)
            assert src.region == mgr._region
            mgr.complete_load(keys, ctx)
            mgr.touch(keys, ctx)
            if size == MAX_KEYS:
                assert [(a, b) for a, b, _ in calls] == [
                    ("_prepare_store", MAX_KEYS), ("_complete_store", MAX_KEYS),
                    ("_prepare_load", MAX_KEYS), ("_complete_load", MAX_KEYS),
                    ("_touch", MAX_KEYS)]
            else:
                first, last = keys[0], keys[MAX_KEYS]
                assert calls == [
                    ("_prepare_store", MAX_KEYS, first), ("_prepare_store", 1, last),
                    ("_complete_store", MAX_KEYS, first), ("_complete_store", 1, last),
                    ("_prepare_load", MAX_KEYS, first), ("_prepare_load", 1, last),
                    ("_complete_load", MAX_KEYS, first), ("_complete_load", 1, last),
                    # touch: the last part first (see test_a_touch_of_more_...)
                    ("_touch", 1, last), ("_touch", MAX_KEYS, first)]
        assert node_pins_nothing(c, mgr)
        mgr.on_request_finished(ctx)
        mgr.shutdown()


def test_a_touch_of_more_than_max_keys_keys_orders_as_one_call():
    """LRU: a touch makes its first key the most recent and its last the least; a touch
    of more than max_keys keys (in parts) leaves the same order, so the next evictions
    take the touch's last keys."""
    n = MAX_KEYS + 10
    with running(n, policy="lru") as c:
        mgr = make_spec(c.socks[0]).get_manager()
        keys = [key_of(i, b"t") for i in range(n)]
        ctx = ReqContext(req_id="fill")
        mgr.on_new_request(ctx)
        store_in_calls(mgr, ctx, keys)
        mgr.on_request_finished(ctx)  # (its access applied: the node is full, in order)
        touched = list(keys)
        random.Random(7).shuffle(touched)
        mgr.touch(touched)
        new = ReqContext(req_id="more")
        mgr.on_new_request(new)
        out = mgr.prepare_store([key_of(i, b"new") for i in range(6)], new)
        assert out is not None and len(out.keys_to_store) == 6
        assert set(out.evicted_keys) == set(touched[-6:])
        mgr.complete_store(out.keys_to_store, new, True)
        mgr.on_request_finished(new)
        assert mgr._client.drain() == 0
        mgr.shutdown()

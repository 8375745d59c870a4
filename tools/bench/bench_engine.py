#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The Python rows of `kvtier-bench engine` (tools/bench/bench_engine.c runs this
under a Python with vLLM, against the kvtierd it started):

  per call, us (best and median of 1000-call windows):
    in_process.py.vllm_cpu.*      vLLM's CPUOffloadingManager, in this process
    in_process.py.vllm_tiering.*  vLLM's TieringOffloadingManager over its CPU
                                  primary tier (no secondary tier), in this process
    ring.py.ctypes.lookup1_us     libkvtier-client's kvtier_lookup_one straight
                                  from ctypes
    ring.py.fast.lookup1_us       the same through kvtier._fast, the package's CPython
                                  extension (Conn.lookup_one): the least a Python
                                  call to the node costs (absent when the extension
                                  is not there; "fast" in the JSON says which)
    ring.py.spec.*                kvtier.vllm.KvtierOffloadingSpec's manager over
                                  the ring, the calls vLLM makes (through
                                  kvtier._fast when it is there)
    socket.py.spec.*              the same with the ring switched off
  for lookup1 (a HIT), schedule_end (empty) and store1 (prepare_store +
  complete_store of one new key, an eviction each: the caches are full), and
  scan16: a key's share of a 16-key prefix scan of one request whose keys have
  their positions (vLLM's _maximal_prefix_lookup: what the spec asks the node for
  in one call);

  one scheduler step (step.*): the offloading calls vLLM's scheduler makes in one
  step for N requests of K blocks each (their positions recorded first, as vLLM's
  update_offload_keys does): a prefix lookup of every request's blocks
  (the first K/2 are HITs from earlier steps, then one MISS ends it), prepare_load
  of the hits, prepare_store of the rest, complete_load and complete_store of the
  last step's transfers, on_schedule_end. Against vLLM's TieringOffloadingManager
  and CPUOffloadingManager in process, and the spec over the ring, taking turns
  (four rounds); best and median step time of --steps steps each.

Prints one JSON object. Run alone:
    bench_engine.py --socket /path/engine.sock [--iters N] [--cpu C] [--json]
"""

import argparse
import json
import os
import statistics
import sys
import time
import warnings

WIN = 1000
ROUNDS = 4  # of the step comparison


def key_of(i, salt=b"b"):
    from vllm.v1.kv_offload.base import make_offload_key

    return make_offload_key((salt + b"%d" % i).rjust(32, b"."), 0)


class Rows:
    def __init__(self):
        self.win = {}

    def timed(self, name, n, fn):
        """fn(i) for i in range(n), timed window by window."""
        out = self.win.setdefault(name, [])
        clock = time.perf_counter
        for w0 in range(0, n, WIN):
            w1 = min(w0 + WIN, n)
            t = clock()
            for i in range(w0, w1):
                fn(i)
            out.append((clock() - t) / (w1 - w0) * 1e6)

    def best(self):
        return {k: round(min(v), 3) for k, v in self.win.items()}

    def median(self):
        return {k: round(statistics.median(v), 3) for k, v in self.win.items()}


def vllm_cpu(chunks):
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    return CPUOffloadingManager(num_chunks=chunks, cache_policy="lru")


def vllm_tiering(chunks):
    from vllm.v1.kv_offload.tiering.manager import (CPUPrimaryTierOffloadingManager,
                                                    TieringOffloadingManager)

    class Region:
        """SharedOffloadRegion's stand-in (no row is touched by these calls)."""

        def __init__(self, n):
            self.buf = bytearray(n)

        def create_kv_memoryview(self):
            return memoryview(self.buf).cast("B", [len(self.buf), 1])

        def cleanup(self):
            pass

    primary = CPUPrimaryTierOffloadingManager(num_chunks=chunks, mmap_region=Region(chunks),
                                              cache_policy="lru")
    return TieringOffloadingManager(primary, [], tier_poll_interval_s=0)


def spec_manager(sock, engine_id):
    from vllm.v1.kv_offload.config import (OffloadingCacheConfig, OffloadingConfig,
                                           OffloadingGroupConfig, OffloadingModelConfig,
                                           OffloadingParallelConfig)
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    cfg = OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("l",), group_id=0),),
        worker_kv_bytes_per_block=0, enable_kv_cache_events=False,
        extra_config={"spec_name": "KvtierOffloadingSpec", "spec_module_path": "kvtier.vllm",
                      "kvtier_socket": sock},
        engine_id=engine_id, model=OffloadingModelConfig(name="bench", dtype="float16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(rank=0, world_size=1, tp_size=1, pp_size=1,
                                          pcp_size=1, dcp_size=1, data_parallel_index=0,
                                          data_parallel_size=1, data_parallel_rank_local=None,
                                          is_parallelism_agnostic=True))
    return OffloadingSpecFactory.create_spec(cfg).get_manager()


def fill(m, ctx, keys):
    for k in keys:
        out = m.prepare_store([k], ctx)
        if out is not None and out.keys_to_store:
            m.complete_store(out.keys_to_store, ctx, True)


def per_call(rows, label, m, chunks, iters, salt):
    """lookup1, schedule_end, store1 through manager m (its cache `chunks` big)."""
    from vllm.v1.kv_offload.base import ReqContext, ScheduleEndContext

    ctx = ReqContext(req_id="bench-" + label)
    m.on_new_request(ctx)
    hot = [key_of(i, salt + b"h") for i in range(min(512, chunks // 2))]
    fill(m, ctx, hot)
    new = [key_of(i, salt + b"n") for i in range(iters)]
    end = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())
    nh = len(hot)
    lookup = m.lookup
    rows.timed(label + ".lookup1_us", iters, lambda i: lookup(hot[i % nh], ctx))
    rows.timed(label + ".schedule_end_us", iters, lambda i: m.on_schedule_end(end))

    def store(i):
        out = m.prepare_store([new[i]], ctx)
        m.complete_store(out.keys_to_store, ctx, True)

    rows.timed(label + ".store1_us", iters, store)
    m.on_request_finished(ctx)

    # 16-key prefix scans, a request whose keys have positions (the first 16 hot)
    sctx = ReqContext(req_id="scan-" + label)
    m.on_new_request(sctx)
    fill(m, sctx, hot[:16])  # (the stores above evicted them)
    scan = hot[:16] + [key_of(i, salt + b"x") for i in range(4)]
    for j, k in enumerate(scan):
        sctx.set_offload_key_position(k, 16 * (j + 1))

    def scan16(i):
        if i % 16 == 0:
            m.on_schedule_end(end)  # a new step: the scan starts again
        lookup(scan[i % 16], sctx)

    rows.timed(label + ".scan16_per_key_us", (iters // 16) * 16, scan16)
    m.on_request_finished(sctx)


def step_bench(m, n_req, k, steps, salt):
    """Step time in us, the calls of one scheduler step (see the top)."""
    from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext

    shared = [[key_of(r * 1000 + j, salt + b"p") for j in range(k // 2)] for r in range(n_req)]
    ctxs = [ReqContext(req_id="step-%d" % r) for r in range(n_req)]
    for c in ctxs:
        m.on_new_request(c)
    for r in range(n_req):
        fill(m, ctxs[r], shared[r])
    end = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())
    pending_loads, pending_stores = [], []
    times = []
    hit = (LookupResult.HIT, LookupResult.HIT_PENDING)
    for s in range(steps + 5):
        reqkeys = [shared[r] + [key_of((s * n_req + r) * 1000 + j, salt + b"q")
                                for j in range(k - k // 2)] for r in range(n_req)]
        for r in range(n_req):  # update_offload_keys: positions before the lookups
            for j, key in enumerate(reqkeys[r]):
                ctxs[r].set_offload_key_position(key, 16 * (j + 1))
        t = time.perf_counter()
        for ctx, keys in pending_loads:
            m.complete_load(keys, ctx)
        for ctx, keys in pending_stores:
            m.complete_store(keys, ctx, True)
        pending_loads, pending_stores = [], []
        for r in range(n_req):
            ctx, keys = ctxs[r], reqkeys[r]
            n_hit = 0
            for key in keys:
                if m.lookup(key, ctx) not in hit:
                    break
                n_hit += 1
            if n_hit:
                m.prepare_load(keys[:n_hit], ctx)
                pending_loads.append((ctx, keys[:n_hit]))
            out = m.prepare_store(keys[n_hit:], ctx)
            if out is not None and out.keys_to_store:
                pending_stores.append((ctx, out.keys_to_store))
        m.on_schedule_end(end)
        dt = (time.perf_counter() - t) * 1e6
        if s >= 5:  # (the first steps warm the caches)
            times.append(dt)
    for ctx, keys in pending_loads:
        m.complete_load(keys, ctx)
    for ctx, keys in pending_stores:
        m.complete_store(keys, ctx, True)
    for c in ctxs:
        m.on_request_finished(c)
    return times


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--socket", required=True)
    ap.add_argument("--iters", type=int, default=20000)
    ap.add_argument("--cpu", type=int, default=-1)
    ap.add_argument("--chunks", type=int, default=1024, help="the node's primary, in chunks")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--blocks", type=int, default=16)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    if args.cpu >= 0:
        os.sched_setaffinity(0, {args.cpu})
    import logging

    logging.disable(logging.WARNING)
    import vllm  # noqa: F401 - its import first: the figures are after it

    import kvtier

    rows = Rows()
    iters = max(args.iters, WIN)
    chunks = args.chunks
    out = {"vllm": vllm.__version__, "rows": None}

    per_call(rows, "in_process.py.vllm_cpu", vllm_cpu(chunks), chunks, iters, b"vc")
    per_call(rows, "in_process.py.vllm_tiering", vllm_tiering(chunks), chunks, iters, b"vt")
    m = spec_manager(args.socket, "bench-%d" % os.getpid())
    c = m._client
    assert c.has_ring
    # The least a Python call through the ring can cost: ctypes straight to C.
    f, h = c.lib.kvtier_lookup_one, c.handle
    from vllm.v1.kv_offload.base import ReqContext

    ctx = ReqContext(req_id="raw")
    m.on_new_request(ctx)
    rid = m._rid(ctx)
    probe = [key_of(i, b"raw") for i in range(64)]
    fill(m, ctx, probe)
    rows.timed("ring.py.ctypes.lookup1_us", iters, lambda i: f(h, rid, probe[i % 64], 36))
    out["fast"] = c.fast is not None
    if c.fast is not None:
        one = c.fast.lookup_one
        rows.timed("ring.py.fast.lookup1_us", iters, lambda i: one(rid, probe[i % 64]))
    m.on_request_finished(ctx)
    per_call(rows, "ring.py.spec", m, chunks, iters, b"sr")
    c.set_ring(False)
    per_call(rows, "socket.py.spec", m, chunks, max(iters // 10, WIN), b"ss")
    c.set_ring(True)

    step = {"requests": args.requests, "blocks": args.blocks, "steps": args.steps}
    # The three take turns (ROUNDS rounds of steps/ROUNDS steps each), so that a
    # neighbour's burst on a shared host falls on all of them alike.
    mgrs = (("vllm_tiering", vllm_tiering(chunks)), ("vllm_cpu", vllm_cpu(chunks)),
            ("kvtier_spec_ring", m))
    times = {label: [] for label, _ in mgrs}
    rounds = min(ROUNDS, args.steps)
    for r in range(rounds):
        for label, mgr in mgrs:
            times[label] += step_bench(mgr, args.requests, args.blocks,
                                       max(1, args.steps // rounds), b"%s%d" % (label.encode(), r))
    for label, _ in mgrs:
        step[label + "_us"] = round(min(times[label]), 1)
        step[label + "_median_us"] = round(statistics.median(times[label]), 1)
    m.shutdown()
    # kvtier's step over vLLM's own (1.0: as fast; below: faster)
    step["kvtier_over_vllm_tiering"] = round(step["kvtier_spec_ring_us"] /
                                             step["vllm_tiering_us"], 2)
    step["kvtier_over_vllm_cpu"] = round(step["kvtier_spec_ring_us"] / step["vllm_cpu_us"], 2)
    out["rows"] = rows.best()
    out["rows_median"] = rows.median()
    # the headline figures: a 1-key lookup (a HIT) from Python, by path
    best = out["rows"]
    out["lookup1_us"] = {
        "in_process_vllm_tiering": best["in_process.py.vllm_tiering.lookup1_us"],
        "in_process_vllm_cpu": best["in_process.py.vllm_cpu.lookup1_us"],
        "ring_kvtier_spec": best["ring.py.spec.lookup1_us"],
        "ring_ctypes": best["ring.py.ctypes.lookup1_us"],
        "ring_fast": best.get("ring.py.fast.lookup1_us"),
        "socket_kvtier_spec": best["socket.py.spec.lookup1_us"],
    }
    out["step"] = step
    print(json.dumps(out, separators=(",", ":")))


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""vLLM's side of `kvtier-bench core --vllm-python PY`: the manager-level call
sequence of tools/bench/bench_core.c (run_manager) on vLLM 0.34's
TieringOffloadingManager over its CPU primary tier, without secondary tiers,
timed the same way. Prints one JSON object: ns per key (or per call) for each op.

The primary's shared-memory region is replaced by a one-byte-per-chunk buffer:
only the manager's bookkeeping is timed, and it never reads the rows (a real
region at 1e6 chunks would be 4 GiB of /dev/shm for nothing).

    bench_core_vllm.py --chunks N --policy lru|arc [--lookups L]
"""

import argparse
import gc
import hashlib
import json
import random
import sys
import time

BATCH = 16
PER_REQ = 256  # keys per request, in batches of BATCH


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--chunks", type=int, required=True)
    ap.add_argument("--policy", choices=["lru", "arc"], required=True)
    ap.add_argument("--lookups", type=int, default=200_000)
    args = ap.parse_args()

    try:
        from vllm.v1.kv_offload.base import ReqContext, ScheduleEndContext, make_offload_key
        from vllm.v1.kv_offload.tiering.manager import (CPUPrimaryTierOffloadingManager,
                                                        TieringOffloadingManager)
    except Exception as e:  # noqa: BLE001
        print(f"bench_core_vllm: cannot import vLLM: {e!r}", file=sys.stderr)
        return 77

    class Region:
        """Stand-in for SharedOffloadRegion: a row of one byte per chunk."""

        def __init__(self, n):
            self.buf = bytearray(n)

        def create_kv_memoryview(self):
            return memoryview(self.buf).cast("B", [len(self.buf), 1])

        def cleanup(self):
            pass

    n = args.chunks
    primary = CPUPrimaryTierOffloadingManager(num_chunks=n, mmap_region=Region(n),
                                              cache_policy=args.policy)
    m = TieringOffloadingManager(primary, [])
    # 36-byte keys like the C bench's (32-byte hash + 4-byte group).
    keys = [make_offload_key(hashlib.blake2b(i.to_bytes(8, "little"), digest_size=32).digest(), 0)
            for i in range(3 * n)]
    rng = random.Random(1)
    order = list(range(n))
    rng.shuffle(order)
    res = {}
    serial = [0]
    empty_step = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())

    def new_req():
        serial[0] += 1
        ctx = ReqContext(req_id=f"b{serial[0]}")
        m.on_new_request(ctx)
        return ctx

    def store_range(lo, hi):
        """Requests of PER_REQ keys; returns (store ns/key, finish ns/key)."""
        t_store = t_fin = 0
        for r in range(lo, hi, PER_REQ):
            ctx = new_req()
            end = min(r + PER_REQ, hi)
            t0 = time.perf_counter_ns()
            for b in range(r, end, BATCH):
                batch = keys[b:min(b + BATCH, end)]
                out = m.prepare_store(batch, ctx)
                assert out is not None
                m.complete_store(out.keys_to_store, ctx)
            t1 = time.perf_counter_ns()
            m.on_request_finished(ctx)
            t_fin += time.perf_counter_ns() - t1
            t_store += t1 - t0
        return t_store / (hi - lo), t_fin / (hi - lo)

    gc.disable()  # as the engine's hot loop; the C side has no collector
    res["store_ns"], res["finish_ns"] = store_range(0, n)

    def lookups(pool, want):
        ops = args.lookups
        t = 0
        done = 0
        while done < ops:
            ctx = new_req()
            k = min(PER_REQ, ops - done)
            sel = [pool[order[(done + j) % n]] for j in range(k)]
            t0 = time.perf_counter_ns()
            for key in sel:
                r = m.lookup(key, ctx)
            t += time.perf_counter_ns() - t0
            assert r.name == want
            m.on_schedule_end(ScheduleEndContext(new_req_ids=(ctx.req_id,),
                                                 preempted_req_ids=()))
            m.on_request_finished(ctx)
            done += k
        return t / ops

    res["lookup_hit_ns"] = lookups(keys, "HIT")
    res["lookup_miss_ns"] = lookups(keys[n:2 * n], "MISS")

    # prepare_load + complete_load of BATCH hits, requests of PER_REQ keys
    ops = args.lookups
    t = done = 0
    while done < ops:
        ctx = new_req()
        k = min(PER_REQ, ops - done)
        sel = [keys[order[(done + j) % n]] for j in range(k)]
        t0 = time.perf_counter_ns()
        for b in range(0, k, BATCH):
            batch = list(dict.fromkeys(sel[b:b + BATCH]))  # no key twice in a load
            m.prepare_load(batch, ctx)
            m.complete_load(batch, ctx)
        t += time.perf_counter_ns() - t0
        m.on_request_finished(ctx)
        done += k
    res["load_ns"] = t / ops

    # touch16: vLLM has no touch; its equal is a request of its own that
    # re-offers BATCH ready keys and finishes (ns per call)
    calls = max(1, args.lookups // BATCH)
    t0 = time.perf_counter_ns()
    for i in range(calls):
        start = order[i % n] % (n - BATCH + 1)
        ctx = new_req()
        m.prepare_store(keys[start:start + BATCH], ctx)
        m.on_request_finished(ctx)
    res["touch16_ns"] = (time.perf_counter_ns() - t0) / calls

    m.on_schedule_end(empty_step)
    # Full: every batch evicts BATCH chunks; the second pass is the figure.
    store_range(n, 2 * n)
    res["store_evict_ns"], res["finish_evict_ns"] = store_range(2 * n, 3 * n)
    print(json.dumps(res))
    m.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())

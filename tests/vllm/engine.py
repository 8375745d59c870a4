# SPDX-License-Identifier: Apache-2.0
"""One vLLM engine's scheduler side, as its tests and the benchmark drive it: vLLM's
own TieringOffloadingManager over its real CPU primary tier (CPUPrimaryTierOffloadingManager
on a SharedOffloadRegion, the /dev/shm file vLLM creates) and one secondary tier
made by vLLM's SecondaryTierFactory from a tier config ({"type": "kvtier", ...}).

Run as a program it is engine 2 of the tests, in a process of its own:
    engine.py SPEC_JSON   prints one JSON line with what it saw."""

import json
import os
import sys
import time
import types
import uuid

import numpy as np

from vllm.v1.kv_offload.base import (
    LookupResult,
    OffloadingKVEventsConfig,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
from vllm.v1.kv_offload.tiering.manager import (
    CPUPrimaryTierOffloadingManager,
    TieringOffloadingManager,
)


def key(i, salt=b"kvt"):
    return make_offload_key(salt + i.to_bytes(8, "big") + b"\0" * (24 - len(salt)), 0)


def row_bytes_of(i, row, salt=b"kvt"):
    """The bytes engine 1 writes for key i: different in every 8-byte word."""
    base = np.frombuffer(salt.ljust(8, b".")[:8], dtype=np.uint64)[0]
    words = np.arange(row // 8, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    return (words ^ np.uint64(i) ^ base).tobytes()


class Engine:
    def __init__(self, tiers, num_chunks=64, row=256 << 10, events=False, spec_attrs=None):
        self.row = row
        self.region = SharedOffloadRegion(engine_id="kvt-test-%s" % uuid.uuid4().hex[:12],
                                          num_chunks=num_chunks, rank=None,
                                          kv_bytes_per_chunk=row, cpu_page_size=row)
        self.primary = CPUPrimaryTierOffloadingManager(num_chunks=num_chunks,
                                                       mmap_region=self.region,
                                                       enable_events=events)
        self.view = self.primary.get_kv_memoryview()
        self.rows = np.asarray(self.view)  # (num_chunks, row) bytes, the same memory
        # What a tier reads of the spec (an OffloadingSpec needs a whole VllmConfig).
        spec = types.SimpleNamespace(
            kv_events_config=OffloadingKVEventsConfig(enable_kv_cache_events=events,
                                                      self_describing_kv_events=False),
            **(spec_attrs or {}))
        self.tiers = [SecondaryTierFactory.create_secondary_tier(dict(t), self.view, spec)
                      for t in tiers]
        self.mgr = TieringOffloadingManager(self.primary, self.tiers)
        self.n_req = 0

    def request(self):
        self.n_req += 1
        ctx = ReqContext(req_id="req-%d-%d" % (os.getpid(), self.n_req))
        with self.mgr.lock:
            self.mgr.on_new_request(ctx)
        return ctx

    def step(self, new=()):
        with self.mgr.lock:
            self.mgr.on_schedule_end(ScheduleEndContext(list(new), ()))

    def store(self, ctx, keys, fill):
        """GPU -> primary for keys (fill(i, key) gives a row's bytes), then the
        cascade to the secondary tiers at the step's end."""
        with self.mgr.lock:
            out = self.mgr.prepare_store(keys, ctx)
            assert out is not None, "primary full"
            for k, cid in zip(out.keys_to_store, out.store_spec.chunk_ids):
                self.rows[int(cid)] = np.frombuffer(fill(keys.index(k), k), dtype=np.uint8)
            self.mgr.complete_store(out.keys_to_store, ctx)
        self.step([ctx.req_id])
        return out

    def settle(self, timeout=30.0):
        """Steps until no tier job is left; returns the seconds it took."""
        t0 = time.monotonic()
        while True:
            with self.mgr.lock:
                busy = self.mgr.has_pending_work()
            if not busy:
                return time.monotonic() - t0
            if time.monotonic() - t0 > timeout:
                raise TimeoutError("tier jobs still pending after %.0f s" % timeout)
            self.step()
            time.sleep(0.001)

    def lookup_until_hit(self, ctx, keys, timeout=30.0, step_sleep=0.002, after_first=None):
        """Looks keys up once per step until each is HIT or MISS; returns the
        sequence of distinct results per key and the longest single step."""
        seen = {k: [] for k in keys}
        final = {}
        worst = 0.0
        t0 = time.monotonic()
        while len(final) < len(keys):
            if time.monotonic() - t0 > timeout:
                break
            s0 = time.monotonic()
            with self.mgr.lock:
                for k in keys:
                    if k in final:
                        continue
                    r = self.mgr.lookup(k, ctx)
                    if not seen[k] or seen[k][-1] != r.name:
                        seen[k].append(r.name)
                    if r in (LookupResult.HIT, LookupResult.MISS):
                        final[k] = r
                self.mgr.on_schedule_end(ScheduleEndContext([], ()))
            worst = max(worst, time.monotonic() - s0)
            if after_first is not None:
                after_first()
                after_first = None
            time.sleep(step_sleep)
        return seen, final, worst

    def load_rows(self, ctx, keys):
        """primary -> 'GPU': the rows of keys (all HIT), as bytes."""
        with self.mgr.lock:
            spec = self.mgr.prepare_load(keys, ctx)
            rows = [self.rows[int(c)].tobytes() for c in spec.chunk_ids]
            self.mgr.complete_load(keys, ctx)
        return rows

    def finish(self, ctx):
        with self.mgr.lock:
            self.mgr.on_request_finished(ctx)

    def shutdown(self):
        del self.rows  # (an exported buffer keeps vLLM from unmapping its region)
        self.mgr.shutdown()


def main():
    spec = json.loads(sys.argv[1])
    from kvtier.vllm import register

    register()
    eng = Engine(spec["tiers"], num_chunks=spec["num_chunks"], row=spec["row"])
    out = {}
    try:
        ctx = eng.request()
        keys = [key(i, spec["salt"].encode()) for i in range(spec["n"])]
        announce = None
        if spec.get("announce"):
            def announce():
                # The test kills a node when it reads this (engine 2's first step is
                # out: node B is asking its peers and promoting).
                print("FIRST-STEP", flush=True)
                sys.stdin.readline()
        seen, final, worst = eng.lookup_until_hit(ctx, keys, timeout=spec.get("timeout", 30),
                                                  after_first=announce)
        out["seen"] = [seen[k] for k in keys]
        out["final"] = [final[k].name if k in final else None for k in keys]
        out["worst_step_s"] = worst
        hits = [k for k in keys if final.get(k) == LookupResult.HIT]
        rows = eng.load_rows(ctx, hits) if hits else []
        good = 0
        wrong = 0
        for k, data in zip(hits, rows):
            i = keys.index(k)
            if data == row_bytes_of(i, spec["row"], spec["salt"].encode()):
                good += 1
            else:
                wrong += 1
        out["good"] = good
        out["wrong"] = wrong
        eng.finish(ctx)
        eng.settle()
        st = eng.mgr.get_stats()
        out["stats"] = st.reduce() if st is not None else {}
    finally:
        eng.shutdown()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""kvtier's cache policies against the real vLLM CPU tier.

Drives vLLM's CPUOffloadingManager (vllm/v1/kv_offload/cpu/manager.py, the
request-scoped LRU and ARC) with random call sequences, writes each sequence as a
kvtier-replay trace (docs/replay-format.md) together with vLLM's answer to every
call, replays the trace through kvtier's manager with kvtier-replay and compares
the two answers line by line: lookup results, keys stored, slots, evicted keys
(which chunk, in which order), pinned slots, and every few calls the policy's
whole state (LRU order; ARC's T1, T2, ghost lists and target). Then the same
with vLLM's TieringOffloadingManager and its ExampleSecondaryTierManager against
kvtier-replay --tier example, with steps: there the manager drives the policy
through cascades (pins that record no access) and promotions (a lookup's
prepare_write, a store miss of the request), as in a real deployment.

The call mapping is one to one, but for touch, which vLLM's manager no longer
has: kvtier's touch is an access of its own, applied at once, which in vLLM is
a request of its own that offers the present ready keys for store again (that
records them as reused) and finishes; the script makes exactly those calls.

Needs a Python with vLLM installed (CPU torch is enough; no GPU is used) and a
built kvtier-replay. Exit status 0 when every sequence matches, 1 on the first
mismatch (printed with the trace), 77 when vLLM cannot be imported (a skip).

    vllm_policy_replay.py --replay build/tools/replay/kvtier-replay [--seeds 200]

A Python for it (vLLM's wheel with --no-deps, then what importing
vllm.v1.kv_offload.cpu.manager needs; all CPU, no GPU import on that path):

    python3 -m venv VENV && VENV/bin/pip install torch==2.13.0   # the +cpu build
    VENV/bin/pip install --no-deps vllm-0.34.0-cp38-abi3-manylinux_2_28_x86_64.whl
    VENV/bin/pip install --no-deps packaging psutil pyzmq urllib3 regex numpy pydantic \
        pydantic_core typing-inspection annotated-types transformers huggingface_hub tqdm \
        httpx2 idna pyyaml httpcore2 truststore h11 safetensors tokenizers aiohttp \
        multidict attrs yarl propcache aiohappyeyeballs aiosignal frozenlist requests \
        certifi pillow pybase64 cachetools cbor2 msgspec cloudpickle uvloop py-cpuinfo \
        prometheus_client llguidance xgrammar apache-tvm-ffi
"""

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile

SKIP = 77


def import_vllm():
    try:
        from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key
        from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
    except Exception as e:  # noqa: BLE001 - any import failure is a skip
        print(f"vllm_policy_replay: cannot import vLLM's CPU tier: {e!r}", file=sys.stderr)
        sys.exit(SKIP)
    return CPUOffloadingManager, ReqContext, LookupResult, make_offload_key


CPUOffloadingManager, ReqContext, LookupResult, make_offload_key = import_vllm()


def key_of(i, group=0):
    return make_offload_key(str(i).encode(), group)


class Vllm:
    """vLLM's CPU manager, answering in kvtier-replay's output format."""

    def __init__(self, chunks, policy):
        self.m = CPUOffloadingManager(num_chunks=chunks, cache_policy=policy)
        self.policy = policy
        self.ctx = {}
        self.touches = 0

    def new_request(self, req):
        ctx = ReqContext(req_id=req)
        self.ctx[req] = ctx
        self.m.on_new_request(ctx)
        return {"policy": "chunk"}

    def lookup(self, req, keys):
        return {"results": [self.m.lookup(k, self.ctx[req]).name for k in keys]}

    def ready(self, key):
        return self.m.lookup(key, None) is LookupResult.HIT

    def prepare_store(self, req, keys):
        out = self.m.prepare_store(keys, self.ctx[req])
        if out is None:
            return {"ok": False}
        return {
            "ok": True,
            "store": [k.hex() for k in out.keys_to_store],
            "slots": [int(c) for c in out.store_spec.chunk_ids],
            "evicted": [k.hex() for k in out.evicted_keys],
        }, list(out.keys_to_store)

    def complete_store(self, req, keys, success):
        self.m.complete_store(keys, self.ctx[req], success)
        return {"ok": True}

    def prepare_load(self, req, keys):
        spec = self.m.prepare_load(keys, self.ctx[req])
        return {"ok": True, "slots": [int(c) for c in spec.chunk_ids]}

    def complete_load(self, req, keys):
        self.m.complete_load(keys, self.ctx[req])
        return {"ok": True}

    def touch(self, req, keys):
        # A request of its own that re-offers the present ready keys (recorded as
        # reused) and finishes at once.
        self.touches += 1
        ctx = ReqContext(req_id=f"touch-{self.touches}")
        self.m.on_new_request(ctx)
        ready = [k for k in keys if self.ready(k)]
        if ready:
            self.m.prepare_store(ready, ctx)
        self.m.on_request_finished(ctx)
        return {}

    def request_finished(self, req):
        self.m.on_request_finished(self.ctx.pop(req))
        return {"ok": True}

    def reset_cache(self):
        self.m.reset_cache()
        return {"ok": True}

    def state(self, universe):
        p = self.m._policy
        if self.policy == "lru":
            return {"l1": [k.hex() for k in sorted(p.chunks, key=p._ranks.__getitem__)]}
        ghosts = {k.hex(): 1 if k in p.b1 else 2 if k in p.b2 else 0 for k in universe}
        return {
            "l1": [k.hex() for k in p.t1],
            "l2": [k.hex() for k in p.t2],
            "target": float(p.target_t1_size),
            "b1": len(p.b1),
            "b2": len(p.b2),
            "ghosts": ghosts,
        }


class VllmTiering(Vllm):
    """vLLM's TieringOffloadingManager over its CPU primary tier and one
    ExampleSecondaryTierManager (synchronous, every job finished at once): the
    manager drives the CPU tier's policy through promotions (prepare_write, a
    store miss of the request) and cascades (prepare_read, no access)."""

    def __init__(self, chunks, policy):
        from vllm.v1.kv_offload.tiering.example.manager import ExampleSecondaryTierManager
        from vllm.v1.kv_offload.tiering.manager import (CPUPrimaryTierOffloadingManager,
                                                        TieringOffloadingManager)

        class Region:
            """SharedOffloadRegion's stand-in: one byte per chunk (no row is read)."""

            def __init__(self, n):
                self.buf = bytearray(n)

            def create_kv_memoryview(self):
                return memoryview(self.buf).cast("B", [len(self.buf), 1])

            def cleanup(self):
                pass

        region = Region(chunks)
        self.primary = CPUPrimaryTierOffloadingManager(num_chunks=chunks, mmap_region=region,
                                                       cache_policy=policy)
        tier = ExampleSecondaryTierManager(None, self.primary.get_kv_memoryview(), "example")
        self.m = TieringOffloadingManager(self.primary, [tier], tier_poll_interval_s=0)
        self.policy = policy
        self.ctx = {}
        self.touches = 0

    def ready(self, key):
        return self.primary.lookup(key, None) is LookupResult.HIT

    def touch(self, req, keys):
        # kvtier's touch: the primary's access of its own (the example tier
        # ignores touches, as kvtier's does)
        self.touches += 1
        ctx = ReqContext(req_id=f"touch-{self.touches}")
        ready = [k for k in keys if self.ready(k)]
        if ready:
            self.primary.prepare_store(ready, ctx)
        self.primary.on_request_finished(ctx)
        return {}

    def schedule_end(self):
        from vllm.v1.kv_offload.base import ScheduleEndContext

        self.m.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))
        return {"pending_work": self.m.has_pending_work()}

    def state(self, universe):
        saved, self.m = self.m, self.primary
        try:
            return super().state(universe)
        finally:
            self.m = saved


class Sequence:
    """A random call sequence, written as a trace and answered by vLLM."""

    def __init__(self, seed, chunks, policy, ops, tiering=False):
        self.rng = random.Random(seed)
        self.chunks = chunks
        self.tiering = tiering
        self.v = VllmTiering(chunks, policy) if tiering else Vllm(chunks, policy)
        self.groups = self.rng.choice([1, 1, 2])
        n_ids = max(3, chunks * self.rng.choice([2, 3]))
        self.universe = [key_of(i, g) for g in range(self.groups) for i in range(n_ids)]
        self.lines = []  # (trace line, vLLM's answer)
        self.reqs = {}  # live request -> {"finished", "stores": [[keys]], "pins": [[keys]]}
        self.next_req = 0
        for _ in range(ops):
            self.step()
        for req in list(self.reqs):
            self.finish(req)
        self.emit({"op": "policy", "keys": self.hexes(self.universe)}, self.v.state(self.universe))

    @staticmethod
    def hexes(keys):
        return [k.hex() for k in keys]

    def emit(self, line, answer):
        self.lines.append((line, answer))

    def pick(self, lo, hi):
        n = self.rng.randint(lo, hi)
        return self.rng.sample(self.universe, min(n, len(self.universe)))

    def running(self):
        return [r for r, s in self.reqs.items() if not s["finished"]]

    def finish(self, req):
        s = self.reqs.pop(req)
        for keys in s["stores"]:
            self.emit({"op": "complete_store", "req": req, "keys": self.hexes(keys)},
                      self.v.complete_store(req, keys, True))
        for keys in s["pins"]:
            self.emit({"op": "complete_load", "req": req, "keys": self.hexes(keys)},
                      self.v.complete_load(req, keys))
        self.emit({"op": "request_finished", "req": req}, self.v.request_finished(req))

    def step(self):
        rng = self.rng
        running = self.running()
        # the tiering manager: steps (they poll and submit promotions) instead of
        # resets (vLLM holds promotions after a reset until the workers flush)
        op = rng.choices(
            ["new", "lookup", "store", "complete_store", "load", "complete_load", "touch",
             "finish", "policy", "reset", "step"],
            weights=[6, 8, 20, 14, 8, 8, 6, 5, 4, 0 if self.tiering else 0.3,
                     8 if self.tiering else 0])[0]
        if op == "step":
            return self.emit({"op": "schedule_end"}, self.v.schedule_end())
        if op == "new" or not running:
            if len(self.reqs) >= 4:
                return self.finish(rng.choice(list(self.reqs)))
            req = f"r{self.next_req}"
            self.next_req += 1
            self.reqs[req] = {"finished": False, "stores": [], "pins": []}
            return self.emit({"op": "new_request", "req": req}, self.v.new_request(req))
        req = rng.choice(running)
        s = self.reqs[req]
        if op == "lookup":
            keys = self.pick(1, 4)
            self.emit({"op": "lookup", "req": req, "keys": self.hexes(keys)},
                      self.v.lookup(req, keys))
        elif op == "store":
            keys = self.pick(1, min(4, self.chunks))
            answer = self.v.prepare_store(req, keys)
            if isinstance(answer, tuple):
                answer, stored = answer
                if stored:
                    s["stores"].append(stored)
            self.emit({"op": "prepare_store", "req": req, "keys": self.hexes(keys)}, answer)
        elif op == "complete_store" and s["stores"]:
            keys = s["stores"].pop(rng.randrange(len(s["stores"])))
            success = rng.random() < 0.9
            self.emit({"op": "complete_store", "req": req, "keys": self.hexes(keys),
                       "success": success}, self.v.complete_store(req, keys, success))
        elif op == "load":
            ready = [k for k in self.universe if self.v.ready(k)]
            if ready:
                keys = rng.sample(ready, rng.randint(1, min(3, len(ready))))
                s["pins"].append(keys)
                self.emit({"op": "prepare_load", "req": req, "keys": self.hexes(keys)},
                          self.v.prepare_load(req, keys))
        elif op == "complete_load" and s["pins"]:
            keys = s["pins"].pop(rng.randrange(len(s["pins"])))
            self.emit({"op": "complete_load", "req": req, "keys": self.hexes(keys)},
                      self.v.complete_load(req, keys))
        elif op == "touch":
            keys = self.pick(1, 4)
            self.emit({"op": "touch", "req": req, "keys": self.hexes(keys)},
                      self.v.touch(req, keys))
        elif op == "finish":
            self.finish(req)
        elif op == "policy":
            self.emit({"op": "policy", "keys": self.hexes(self.universe)},
                      self.v.state(self.universe))
        elif op == "reset":
            # Jobs in flight at a reset are never completed (the scheduler drops
            # them); their requests go on.
            for st in self.reqs.values():
                st["stores"].clear()
                st["pins"].clear()
            self.emit({"op": "reset_cache"}, self.v.reset_cache())


def same(want, got):
    if isinstance(want, float) or isinstance(got, float):
        return isinstance(got, (int, float)) and abs(want - got) <= 1e-9
    if isinstance(want, dict):
        return isinstance(got, dict) and want.keys() == got.keys() and all(
            same(want[k], got[k]) for k in want)
    if isinstance(want, list):
        return isinstance(got, list) and len(want) == len(got) and all(
            same(a, b) for a, b in zip(want, got))
    return want == got


def run_kvtier(replay, chunks, policy, trace_lines, tiering=False):
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
        for line, _ in trace_lines:
            f.write(json.dumps(line) + "\n")
        path = f.name
    try:
        cmd = [replay, "--chunks", str(chunks), "--policy", policy]
        if tiering:
            cmd += ["--tier", "example"]
        proc = subprocess.run(cmd + [path], capture_output=True, text=True, check=False)
    finally:
        os.unlink(path)
    if proc.returncode != 0:
        return None, proc.stderr
    out = [json.loads(x) for x in proc.stdout.splitlines()]
    return [o for o in out if "summary" not in o], ""


def compare(seq, got, label):
    """Returns the number of evictions compared, or raises with the first mismatch."""
    evictions = 0
    if len(got) != len(seq.lines):
        raise AssertionError(f"{label}: kvtier answered {len(got)} lines, vLLM {len(seq.lines)}")
    for i, ((line, want), have) in enumerate(zip(seq.lines, got)):
        have = {k: v for k, v in have.items() if k not in ("line", "op")}
        if line["op"] == "touch":
            want = {}
        if not same(want, have):
            ctx = "\n".join(json.dumps(x) for x, _ in seq.lines[max(0, i - 12):i + 1])
            raise AssertionError(f"{label}: line {i + 1} ({line['op']}) differs\n"
                                 f"  vLLM:   {json.dumps(want)}\n  kvtier: {json.dumps(have)}\n"
                                 f"the trace up to it:\n{ctx}")
        evictions += len(want.get("evicted", []))
    return evictions


SCENARIOS = {
    # the three scenarios where the simple-form policies evicted another chunk
    # than vLLM, as traces; A..E are keys 1..5
    "lru-finish": ("lru", 2, [
        ("new_request", "r0"), ("new_request", "r1"), ("new_request", "r2"),
        ("store", "r0", [1]), ("store", "r1", [2]), ("request_finished", "r0"),
        ("store", "r2", [3])]),
    "arc-reuse": ("arc", 2, [
        ("new_request", "r0"), ("new_request", "r1"), ("new_request", "r2"),
        ("store", "r0", [1, 2]), ("load", "r1", [1]), ("request_finished", "r1"),
        ("store", "r2", [3])]),
    "arc-store-miss": ("arc", 3, [
        ("new_request", "r0"), ("new_request", "r1"),
        ("store", "r0", [1, 2, 3]), ("touch", "r0", [3]), ("store", "r0", [4, 5]),
        ("store", "r1", [1, 2])]),
}


class Scenario(Sequence):
    def __init__(self, policy, chunks, calls):  # noqa: super init on purpose not called
        self.v = Vllm(chunks, policy)
        self.lines = []
        self.universe = [key_of(i) for i in range(1, 6)]
        for call in calls:
            op, req = call[0], call[1]
            keys = [key_of(i) for i in call[2]] if len(call) > 2 else []
            if op == "new_request":
                self.emit({"op": op, "req": req}, self.v.new_request(req))
            elif op == "request_finished":
                self.emit({"op": op, "req": req}, self.v.request_finished(req))
            elif op == "store":
                answer, stored = self.v.prepare_store(req, keys)
                self.emit({"op": "prepare_store", "req": req, "keys": self.hexes(keys)}, answer)
                self.emit({"op": "complete_store", "req": req, "keys": self.hexes(stored)},
                          self.v.complete_store(req, stored, True))
            elif op == "load":
                self.emit({"op": "prepare_load", "req": req, "keys": self.hexes(keys)},
                          self.v.prepare_load(req, keys))
                self.emit({"op": "complete_load", "req": req, "keys": self.hexes(keys)},
                          self.v.complete_load(req, keys))
            elif op == "touch":
                self.emit({"op": "touch", "req": req, "keys": self.hexes(keys)},
                          self.v.touch(req, keys))
        self.emit({"op": "policy", "keys": self.hexes(self.universe)}, self.v.state(self.universe))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--replay", required=True, help="path of kvtier-replay")
    ap.add_argument("--seeds", type=int, default=200, help="random sequences per policy")
    ap.add_argument("--ops", type=int, default=300, help="calls per sequence")
    ap.add_argument("--first-seed", type=int, default=1)
    ap.add_argument("--dump", metavar="DIR", help="write every trace and vLLM's answers here")
    args = ap.parse_args()

    for name, (policy, chunks, calls) in SCENARIOS.items():
        seq = Scenario(policy, chunks, calls)
        got, err = run_kvtier(args.replay, chunks, policy, seq.lines)
        if got is None:
            print(f"scenario {name}: kvtier-replay failed: {err}", file=sys.stderr)
            return 1
        try:
            compare(seq, got, f"scenario {name}")
        except AssertionError as e:
            print(e, file=sys.stderr)
            return 1
        evicted = [a["evicted"] for _, a in seq.lines if a.get("evicted")]
        print(f"scenario {name} ({policy}, {chunks} chunks): vLLM and kvtier evict "
              f"{evicted[-1] if evicted else []}")

    total_lines = total_evictions = n_seqs = 0
    for tiering in (False, True):
        manager = "TieringOffloadingManager + example tier" if tiering else "CPUOffloadingManager"
        for policy in ("lru", "arc"):
            for seed in range(args.first_seed, args.first_seed + args.seeds):
                chunks = random.Random(seed * 7 + 1).randint(2, 8)
                seq = Sequence(seed, chunks, policy, args.ops, tiering)
                label = f"{manager}, {policy}, seed {seed} ({chunks} chunks)"
                if args.dump:
                    os.makedirs(args.dump, exist_ok=True)
                    name = f"{'tiering-' if tiering else ''}{policy}-{seed}.jsonl"
                    with open(os.path.join(args.dump, name), "w") as f:
                        for line, answer in seq.lines:
                            f.write(json.dumps({"call": line, "vllm": answer}) + "\n")
                got, err = run_kvtier(args.replay, chunks, policy, seq.lines, tiering)
                if got is None:
                    print(f"{label}: kvtier-replay failed: {err}", file=sys.stderr)
                    return 1
                try:
                    total_evictions += compare(seq, got, label)
                except AssertionError as e:
                    print(e, file=sys.stderr)
                    return 1
                total_lines += len(seq.lines)
                n_seqs += 1
    print(f"{n_seqs} sequences, {total_lines} calls, {total_evictions} evictions: "
          "kvtier's answers equal vLLM's")
    print(f"{n_seqs} passed, 0 failed")
    return 0


if __name__ == "__main__":
    sys.exit(main())

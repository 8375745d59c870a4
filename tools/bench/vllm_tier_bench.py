#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""vllm_tier_bench: what kvtier.vllm costs vLLM's scheduler, and how fast rows move
through the node (not a timed test; run it with the venv of tools/vllm-env, the
kvtier package installed in it):

    py=$(tools/vllm-env) && $py -m pip install -q . &&
    $py tools/bench/vllm_tier_bench.py --kvtierd build-release/node/kvtierd [--json]

1. Scheduler time per engine step, side by side in one run: vLLM's
   TieringOffloadingManager (real CPU primary tier on its shared region) with no
   secondary tier, with vLLM's own example tier (a dict in the scheduler's process
   whose jobs end as they are submitted and move no byte: what vLLM's own cascade
   costs, the floor under any secondary tier), with vLLM's own fs tier, and with
   kvtier. A step is what the
   scheduler does for N requests x K blocks: each request is new, looks its K
   blocks up (not there: the secondary tier is asked), stores K blocks (the
   cascade submits a store job per tier), and the step ends; the requests of the
   step before finish. Only the manager calls are timed (vLLM holds its lock over
   them), not the pause between steps the model would take (`--pause-ms`, a
   list: the tiers run side by side at each). Target: kvtier's added time
   no more than fs's. A tier whose jobs cannot keep up with the pause keeps the
   primary's chunks pinned and vLLM refuses the stores it has no room for, which
   costs the scheduler less than storing them: the table shows the blocks each
   tier stored, and tiers compare fairly at a pause where both store them all.
2. Rows through the node: store jobs (vLLM's region -> the node's primary) and
   load jobs (the node's primary -> vLLM's region) of R rows, in GB/s, next to a
   plain memcpy (numpy copyto) of the same rows between the same two mappings.
"""

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import types

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "tests", "vllm"))

import numpy as np  # noqa: E402

import engine as eng_mod  # noqa: E402
import kvt_nodes  # noqa: E402
import kvtier  # noqa: E402
from kvtier.vllm import register  # noqa: E402

from vllm.v1.kv_offload.base import LookupResult, ScheduleEndContext  # noqa: E402


def fs_spec(row):
    """What vLLM's fs tier reads of an OffloadingSpec's config (its FileMapper's
    inputs); a whole OffloadingSpec needs a VllmConfig."""
    cfg = types.SimpleNamespace(
        groups=[types.SimpleNamespace(group_id=0, tokens_per_block=16, layer_names=["layer.0"],
                                      sliding_window_size_in_chunks=None)],
        parallel=types.SimpleNamespace(tp_size=1, pp_size=1, pcp_size=1, dcp_size=1, rank=0,
                                       is_parallelism_agnostic=True),
        canonical_layout=False, kv_cache_layout=None, replicated_layout=False,
        model=types.SimpleNamespace(name="bench-model", dtype="bfloat16"),
        cache=types.SimpleNamespace(tokens_per_hash=16))
    return cfg


def sched_bench(name, tiers, n_req, k, steps, row, pause_s, warmup=5):
    e = eng_mod.Engine(tiers, num_chunks=max(4 * n_req * k, 256), row=row,
                       spec_attrs={"config": fs_spec(row), "blocks_per_chunk": 1})
    times, cpu = [], []
    salt = b"b-%s" % name.encode()
    prev = []
    seq = 0
    offered = stored = 0  # blocks offered to prepare_store / taken by it (timed steps)
    try:
        for s in range(warmup + steps):
            ctxs, new = [], []
            t0 = time.perf_counter()
            c0 = time.thread_time()
            with e.mgr.lock:
                for c in prev:
                    e.mgr.on_request_finished(c)
                for r in range(n_req):
                    seq += 1
                    ctx = eng_mod.ReqContext(req_id="%s-%d" % (name, seq))
                    e.mgr.on_new_request(ctx)
                    keys = [eng_mod.key(seq * 1000 + b, salt) for b in range(k)]
                    for key in keys:
                        e.mgr.lookup(key, ctx)
                    out = e.mgr.prepare_store(keys, ctx)
                    if s >= warmup:
                        offered += len(keys)
                        stored += len(out.keys_to_store) if out is not None else 0
                    if out is not None:
                        e.mgr.complete_store(out.keys_to_store, ctx)
                    ctxs.append(ctx)
                    new.append(ctx.req_id)
                e.mgr.on_schedule_end(ScheduleEndContext(new, ()))
            dt = time.perf_counter() - t0
            dc = time.thread_time() - c0
            if s >= warmup:
                times.append(dt)
                cpu.append(dc)
            prev = ctxs
            time.sleep(pause_s)  # the model's forward pass
        # The jobs still out, to their end: vLLM's completions of them (unpins,
        # evictions) are the tier's cost too, wherever they land.
        c0 = time.thread_time()
        with e.mgr.lock:
            for c in prev:
                e.mgr.on_request_finished(c)
        settle_s = e.settle(timeout=120)
        settle_cpu = time.thread_time() - c0
    finally:
        e.shutdown()
    times.sort()
    cpu.sort()
    return {"tier": name, "steps": len(times), "blocks_offered": offered,
            "blocks_stored": stored,
            "cpu_with_settle_per_step_us": (sum(cpu) + settle_cpu) / len(cpu) * 1e6,
            "settle_s": settle_s,
            "cpu_mean_us": statistics.fmean(cpu) * 1e6,
            "cpu_p50_us": cpu[len(cpu) // 2] * 1e6,
            "mean_us": statistics.fmean(times) * 1e6,
            "p50_us": times[len(times) // 2] * 1e6,
            "p99_us": times[min(len(times) - 1, int(len(times) * 0.99))] * 1e6}


def node_throughput(sock, rows, row, rounds):
    """Store then load `rows` rows through the node with the tier's jobs, and a
    numpy memcpy of the same rows between the same mappings."""
    path = os.path.join(tempfile.gettempdir(), "kvt-bench-region-%d" % os.getpid())
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    os.unlink(path)
    try:
        os.ftruncate(fd, 2 * rows * row)
        import mmap

        m = mmap.mmap(fd, 2 * rows * row)
        a = np.frombuffer(m, dtype=np.uint8).reshape(2 * rows, row)
        a[:] = np.random.default_rng(1).integers(0, 255, size=a.shape, dtype=np.uint8)
        res = {"rows": rows, "row_bytes": row}
        best = {"store": 0.0, "load": 0.0, "memcpy": 0.0}
        with kvtier.Client(sock, name="bench", timeout_ms=60000) as c:
            c.attach_region(fd, 0, 2 * rows, row)
            for rnd in range(rounds):
                keys = [kvtier.make_key(b"tp-%d-%d" % (rnd, i)) for i in range(rows)]
                t0 = time.perf_counter()
                done = c.jobs_step([], [kvtier.Job(1, kvtier.JOB_STORE, keys, list(range(rows)))])[1]
                while not done:
                    done = c.jobs_step()[1]
                ts = time.perf_counter() - t0
                assert done[0].ok, "store failed"
                t0 = time.perf_counter()
                done = c.jobs_step([], [kvtier.Job(2, kvtier.JOB_LOAD, keys,
                                                   list(range(rows, 2 * rows)))])[1]
                while not done:
                    done = c.jobs_step()[1]
                tl = time.perf_counter() - t0
                assert done[0].ok and np.array_equal(a[:rows], a[rows:]), "load failed"
                t0 = time.perf_counter()
                np.copyto(a[rows:], a[:rows])
                tm = time.perf_counter() - t0
                gb = rows * row / 1e9
                best["store"] = max(best["store"], gb / ts)
                best["load"] = max(best["load"], gb / tl)
                best["memcpy"] = max(best["memcpy"], gb / tm)
        res.update({"store_GBps": best["store"], "load_GBps": best["load"],
                    "memcpy_GBps": best["memcpy"]})
        del a
        m.close()
        return res
    finally:
        os.close(fd)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kvtierd", default=os.path.join(ROOT, "build-release", "node", "kvtierd"))
    ap.add_argument("--requests", type=int, default=8, help="N requests per step")
    ap.add_argument("--blocks", type=int, default=16, help="K blocks per request")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--row", type=int, default=256 << 10, help="bytes of one chunk")
    ap.add_argument("--rows", type=int, default=256, help="rows of one throughput job")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--pause-ms", default="2,50",
                    help="the pause between steps (the model's forward pass), ms; a comma "
                    "list runs the tiers side by side at each")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--ring-spin-us", type=int, default=None,
                    help="the node's engine.ring_spin_us (its default when not given)")
    a = ap.parse_args()
    register()
    tmp = tempfile.mkdtemp(prefix="kvt-vllm-bench.")
    cluster = kvt_nodes.Cluster(a.kvtierd, n=1, row_bytes=a.row, primary="%dMiB" % max(
        256, 4 * a.requests * a.blocks * a.row >> 20, 2 * a.rows * a.row >> 20), tmp=tmp,
        storage=False, engine_extra="" if a.ring_spin_us is None else
        "  ring_spin_us: %d\n" % a.ring_spin_us).start()
    out = {"requests": a.requests, "blocks": a.blocks, "row": a.row, "sched": []}
    try:
        for pause_ms in [float(p) for p in a.pause_ms.split(",")]:
            rows = []
            for name, tiers in (("none", []),
                                ("example", [{"type": "example"}]),
                                ("fs", [{"type": "fs", "root_dir": os.path.join(tmp, "fs")}]),
                                ("kvtier", [{"type": "kvtier", "socket": cluster.socks[0]}])):
                rows.append(sched_bench(name, tiers, a.requests, a.blocks, a.steps, a.row,
                                        pause_ms / 1e3))
            for r in rows:
                r["pause_ms"] = pause_ms
                r["added_mean_us"] = r["mean_us"] - rows[0]["mean_us"]
                r["added_p50_us"] = r["p50_us"] - rows[0]["p50_us"]
                r["added_cpu_us"] = r["cpu_mean_us"] - rows[0]["cpu_mean_us"]
                r["added_cpu_with_settle_us"] = (r["cpu_with_settle_per_step_us"]
                                                 - rows[0]["cpu_with_settle_per_step_us"])
                # The like-for-like figure where tiers store different shares: what the
                # tier adds to the scheduler's mean step per block the step stored.
                per_step = r["blocks_stored"] / r["steps"]
                r["added_per_stored_block_us"] = (r["added_mean_us"] / per_step
                                                  if per_step and r["tier"] != "none" else 0.0)
            out["sched"] += rows
        out["node"] = node_throughput(cluster.socks[0], a.rows, a.row, a.rounds)
    finally:
        cluster.stop()
        cluster.cleanup()
        shutil.rmtree(tmp, ignore_errors=True)
    if a.json:
        print(json.dumps(out, indent=2))
        return
    print("scheduler time per step, %d requests x %d blocks of %d KiB (%d steps), at each "
          "pause between steps" % (a.requests, a.blocks, a.row >> 10, a.steps))
    print("  wall: the step as the scheduler lives it (other threads and processes share "
          "the cores);\n  cpu: the scheduler thread's own CPU time (thread_time)")
    print("  cpu+settle: the same thread's CPU over the steps and over finishing the jobs "
          "still out after them\n  (vLLM's completions of a tier's jobs land wherever the "
          "jobs end), per step")
    print("  stored: the blocks prepare_store took of those offered (a tier whose jobs are slow "
          "keeps\n  the primary's chunks pinned, and vLLM refuses the stores it has no room for,"
          " which costs\n  the scheduler less: compare tiers at a pause where both store all)")
    print("  per block: the wall added (mean) over the blocks stored per step, which compares "
          "tiers\n  that store different shares")
    print("  %-6s %-8s %9s %9s %9s %10s %9s | %9s %9s %10s | %10s %10s | %s" % (
        "pause", "tier", "wall mean", "wall p50", "wall p99", "wall added", "per block",
        "cpu mean", "cpu p50", "cpu added", "cpu+settle", "its added", "stored"))
    for r in out["sched"]:
        print("  %-6s %-8s %9.0f %9.0f %9.0f %10.0f %9.1f | %9.0f %9.0f %10.0f | %10.0f %10.0f | "
              "%d of %d  (us)" % (
                  "%gms" % r["pause_ms"], r["tier"], r["mean_us"], r["p50_us"], r["p99_us"],
                  r["added_mean_us"], r["added_per_stored_block_us"], r["cpu_mean_us"],
                  r["cpu_p50_us"], r["added_cpu_us"], r["cpu_with_settle_per_step_us"],
                  r["added_cpu_with_settle_us"], r["blocks_stored"], r["blocks_offered"]))
    n = out["node"]
    print("rows through the node, %d rows of %d KiB (best of %d)" % (n["rows"], a.row >> 10,
                                                                     a.rounds))
    print("  store %.2f GB/s, load %.2f GB/s, memcpy of the same rows %.2f GB/s"
          % (n["store_GBps"], n["load_GBps"], n["memcpy_GBps"]))


if __name__ == "__main__":
    main()

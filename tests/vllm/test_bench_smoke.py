# SPDX-License-Identifier: Apache-2.0
"""The vLLM benchmark script (tools/bench/vllm_tier_bench.py, docs/bench-vllm.md) runs
against this package and a real kvtierd, briefly, and prints every figure it
promises. Not a speed test: no figure is compared with a target here."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_vllm_tier_bench_prints_every_row():
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", "bench", "vllm_tier_bench.py"),
         "--kvtierd", os.environ["KVTIERD"], "--row", "65536", "--requests", "2",
         "--blocks", "4", "--steps", "3", "--rows", "8", "--rounds", "1", "--pause-ms", "1,5",
         "--json"],
        check=True, capture_output=True, text=True, timeout=600).stdout
    res = json.loads(out)
    # The four tiers side by side at each pause asked for, in order.
    assert [(r["pause_ms"], r["tier"]) for r in res["sched"]] == [
        (p, t) for p in (1.0, 5.0) for t in ("none", "example", "fs", "kvtier")]
    for r in res["sched"]:
        assert r["steps"] == 3
        for f in ("mean_us", "p50_us", "p99_us", "cpu_mean_us", "cpu_p50_us",
                  "cpu_with_settle_per_step_us"):
            assert r[f] > 0, (r["tier"], f)
        assert "added_cpu_with_settle_us" in r and "added_p50_us" in r
        # per block stored: 0 for the reference row and for a tier that stored none
        assert (r["added_per_stored_block_us"] == 0.0) == (
            r["tier"] == "none" or r["blocks_stored"] == 0), r
        assert 0 <= r["blocks_stored"] <= r["blocks_offered"] and r["blocks_offered"] > 0
    # With no secondary tier nothing holds the primary's chunks, and the example tier's
    # jobs end as they are submitted: every block is stored.
    for r in res["sched"]:
        if r["tier"] in ("none", "example"):
            assert r["blocks_stored"] == r["blocks_offered"]
    node = res["node"]
    assert node["store_GBps"] > 0 and node["load_GBps"] > 0 and node["memcpy_GBps"] > 0

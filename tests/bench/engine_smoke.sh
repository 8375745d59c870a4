#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# kvtier-bench engine once, briefly, with --json (label "bench"; with a Python that
# has vLLM, also "vllm"): it runs against a real kvtierd and prints every row it
# promises, each a positive figure. Not a speed test: no figure is compared with a
# target here (docs/bench-engine.md holds those, from quiet Release runs).
#   engine_smoke.sh PATH/TO/kvtier-bench [PYTHON_WITH_VLLM]
set -euo pipefail
BENCH=${1:?usage: engine_smoke.sh KVTIER_BENCH [PYTHON]}
PY=${2:-}
fail=0
check() { # name, jq filter that must print true, json
  if [ "$(jq -r "$2" <<<"$3")" != "true" ]; then
    echo "FAIL: $1: $2"
    echo "$3" | head -c 4000; echo
    fail=1
  else
    echo "ok: $1"
  fi
}
# every name in the list is a positive number in .rows and in .rows_median of $o
has_rows='. as $o | all($names[]; . as $n
  | ($o.rows[$n] | type == "number" and . > 0) and ($o.rows_median[$n] | type == "number" and . > 0))'

if [ -z "$PY" ]; then
  out=$("$BENCH" engine --json --iters 1000 --repeat 1)
  check "engine: no Python rows unless asked" '.python == null' "$out"
else
  out=$("$BENCH" engine --json --iters 1000 --repeat 1 --python "$PY" \
          --requests 2 --blocks 4 --steps 3)
fi
check "engine: the headline figures (1-key lookup from C), each positive" \
  'all(.in_process, .floor, .ring, .socket; type == "number" and . > 0)
   and .ring_lookup_over_in_process_plus_floor > 0' "$out"
check "engine: every C row, best and median, each positive" \
  '([("in_process.c", "ring.c", "socket.c") as $p
      | ("lookup1_us", "schedule_end_us", "store1_us") as $c | "\($p).\($c)"]
    + ["floor.cacheline_pingpong_us", "floor.unix_socket_pingpong_us",
       "ring.c.lookup1_node_asleep_us", "socket.c.lookup1_node_asleep_us"]) as $names
   | '"$has_rows" "$out"
if [ -n "$PY" ]; then
  check "engine: every Python row, best and median, each positive" \
    '([("in_process.py.vllm_cpu", "in_process.py.vllm_tiering", "ring.py.spec", "socket.py.spec")
        as $p | ("lookup1_us", "schedule_end_us", "store1_us", "scan16_per_key_us") as $c
        | "\($p).\($c)"] + ["ring.py.ctypes.lookup1_us"]
        + (if .python.fast then ["ring.py.fast.lookup1_us"] else [] end)) as $names
     | .python | '"$has_rows" "$out"
  check "engine: the Python headline figures, and vLLM's version" \
    '.python as $p | $p.vllm == "0.34.0" and ($p.fast | type == "boolean")
     and all($p.lookup1_us | to_entries[] | select(.key != "ring_fast" or $p.fast)
             | .value; type == "number" and . > 0)
     and ($p.lookup1_us | length) == 6' "$out"
  check "engine: the step, vLLM's managers and the spec, and the ratios" \
    '.python.step as $s | $s.requests == 2 and $s.blocks == 4 and $s.steps == 3
     and all($s.vllm_tiering_us, $s.vllm_cpu_us, $s.kvtier_spec_ring_us,
             $s.vllm_tiering_median_us, $s.vllm_cpu_median_us, $s.kvtier_spec_ring_median_us,
             $s.kvtier_over_vllm_tiering, $s.kvtier_over_vllm_cpu; type == "number" and . > 0)' \
    "$out"
fi
exit $fail

#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# /metrics of real nodes after real traffic: two kvtierd on loopback (UCX over tcp),
# a small primary each (so stores evict), kvtier-load against both (stores, hits,
# chunks pulled between the nodes), then every node is scraped: each page must be
# 200, promtool-clean (vLLM's "vllm:" names excepted) and show the counters that this
# traffic must have moved; then more load, and every one of those counters must
# have moved again on the second scrape. The second pages must also show the node's
# gauges: its build, this process, how full each tier is, and vLLM's own buckets
# for vLLM's histograms. kvtierd once froze its page for good after
# the first pull (two families of one name): the second scrape is what catches it.
#
#   test_metrics_scrape.sh KVTIERD KVTIER_LOAD TMPDIR
set -uo pipefail
kvtierd=$1 load=$2 tmp=$3
mkdir -p "$tmp"
work=$(mktemp -d "$tmp/scrape.XXXXXX")
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -KILL "$p" 2>/dev/null; done
  [ -n "${KEEP:-}" ] || rm -rf "$work"; rm -rf /dev/shm/kvt-scrape-$$-*
}
trap cleanup EXIT
pass=0 fail=0
t_start=$(date +%s)
ok() { pass=$((pass + 1)); echo "ok - $*"; }
bad() { fail=$((fail + 1)); echo "FAIL - $*"; }

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
head -c 40 /dev/urandom | base64 >"$work/secret" && chmod 600 "$work/secret"
declare -a nport mport
for i in 1 2; do nport[$i]=$(free_port); mport[$i]=$(free_port); done
for i in 1 2; do
  other=$((3 - i))
  cat >"$work/node$i.yaml" <<EOF
node:
  id: $((40 + i))
  namespace: scrape
primary:
  path: /dev/shm/kvt-scrape-$$-$i/region.mmap
  size: 16MiB
  row_bytes: 256KiB
storage:
  root: $work/storage$i
  capacity: 64MiB
  # No back-pressure drops on a loaded test host: every round must store.
  high_water_us: 60000000
  low_water_us: 30000000
network:
  listen: 127.0.0.1
  port: ${nport[$i]}
  peers:
    - 127.0.0.1:${nport[$other]}
cluster:
  secret_file: $work/secret
engine:
  socket: $work/node$i.sock
metrics:
  port: ${mport[$i]}
log:
  level: warn
EOF
  "$kvtierd" --config "$work/node$i.yaml" >"$work/node$i.log" 2>&1 &
  pids+=($!)
done
for i in 1 2; do
  for _ in $(seq 1 300); do [ -S "$work/node$i.sock" ] && break; sleep 0.1; done
  [ -S "$work/node$i.sock" ] || { cat "$work/node$i.log"; echo "FAIL - node $i did not start"; exit 1; }
done
sleep 1 # the nodes find each other

scrape() { # node, file: the page (status line checked)
  local code
  code=$(curl -s -o "$2" -w '%{http_code}' "http://127.0.0.1:${mport[$1]}/metrics")
  [ "$code" = 200 ] || { echo "node $1: /metrics answered $code: $(head -c 200 "$2")"; return 1; }
}
# The value of one series (name and labels as printed), summed when several match a
# prefix ending in "{".
value() { awk -v n="$2" 'index($1, n) == 1 { s += $2; f = 1 } END { if (f) printf "%.0f\n", s; else print "absent" }' "$1"; }

run_load() {
  "$load" --node "$work/node1.sock" --node "$work/node2.sock" --engines-per-node 1 \
    --duration "$1" --prompts 8 --conversations 32 --blocks-per-prompt 24 --seed "$2" --quiet \
    >"$work/load.$2.out" 2>&1
}

# Counters the traffic must move on each node. The pulls go one way or the other
# (whichever node a request lands on): pulled on one side, served on the other.
moving=(kvtier_engine_requests_total kvtier_primary_evictions_total kvtier_storage_stored_chunks_total
        "vllm:kv_offload_tiering_write_bytes_total{" "vllm:kv_offload_tiering_chunk_hits_total{")
per_pair=(kvtier_net_pulled_bytes_total kvtier_net_served_bytes_total)

declare -A first
# Whether node i's page shows every moving counter past round 1's value (0 before):
# the page is published once a second and storage writes finish after the load, so
# the test waits for the counters (10 s at most) instead of for a time.
moved_on() { # round, node, page
  local m v
  for m in "${moving[@]}"; do
    v=$(value "$3" "$m")
    [ "$v" != absent ] || return 1
    if [ "$1" = 1 ]; then [ "$v" -gt 0 ] || return 1; else [ "$v" -gt "${first[$2.$m]}" ] || return 1; fi
  done
}
for round in 1 2; do
  if run_load 4 "$round"; then ok "round $round: kvtier-load exit 0"; else bad "round $round: kvtier-load failed: $(tail -5 "$work/load.$round.out")"; fi
  for i in 1 2; do
    page=$work/page.$round.$i
    if scrape "$i" "$page"; then ok "round $round: node $i /metrics 200"; else bad "round $round: node $i /metrics"; continue; fi
    for _ in $(seq 1 50); do
      moved_on "$round" "$i" "$page" && break
      sleep 0.2
      scrape "$i" "$page" || break
    done
    # promtool (the test command installs it) wants Prometheus's own names; vLLM's
    # "vllm:" families are kept for vLLM's dashboards and are the only findings allowed.
    if ! command -v promtool >/dev/null; then
      bad "round $round: node $i: promtool is not installed (tools/install-deps test)"
    else
      out=$(promtool check metrics <"$page" 2>&1 | grep -v '^vllm:' || true)
      if [ -z "$out" ]; then ok "round $round: node $i page promtool-clean"; else bad "round $round: node $i promtool: $out"; fi
    fi
    for m in "${moving[@]}" "${per_pair[@]}"; do
      v=$(value "$page" "$m")
      if [ "$round" = 1 ]; then
        first[$i.$m]=$v
      fi
    done
  done
done

for m in "${moving[@]}"; do
  for i in 1 2; do
    a=${first[$i.$m]} b=$(value "$work/page.2.$i" "$m")
    if [ "$a" != absent ] && [ "$b" != absent ] && [ "$b" -gt "$a" ] && [ "$a" -gt 0 ]; then
      ok "node $i: $m moved ($a -> $b)"
    else
      bad "node $i: $m did not move across the rounds ($a -> $b)"
    fi
  done
done
for m in "${per_pair[@]}"; do
  a=0 b=0
  for i in 1 2; do
    x=${first[$i.$m]} y=$(value "$work/page.2.$i" "$m")
    [ "$x" = absent ] && x=0
    [ "$y" = absent ] && y=0
    a=$((a + x)) b=$((b + y))
  done
  if [ "$a" -gt 0 ] && [ "$b" -gt "$a" ]; then ok "cluster: $m moved ($a -> $b)"; else bad "cluster: $m did not move ($a -> $b)"; fi
done

# The node's own gauges on the second pages: its build, this process, how full each
# tier is (16 MiB primary of 256 KiB rows: 64 chunks; storage bounded at 64 MiB, files
# of a 4 KiB header and the row: 252 chunks; the network tier keeps none), and the
# histograms' buckets: vLLM's own for vLLM's metrics.
exact() { # page, series as printed -> its value, or "absent"
  awk -v n="$2" '$1 == n { v = $2; f = 1 } END { if (f) print v; else print "absent" }' "$1"
}
is() { # description, awk condition on a and b
  if awk -v a="$3" -v b="${4:-0}" "BEGIN { exit !($2) }" 2>/dev/null && [ "$3" != absent ]; then
    ok "$1 ($3${4:+, $4})"
  else
    bad "$1 ($3${4:+, $4})"
  fi
}
now=$(date +%s)
for i in 1 2; do
  page=$work/page.2.$i
  n=$(grep -Ec '^kvtier_build_info\{version="[0-9]+\.[0-9]+\.[0-9]+",revision="[^"]+"\} 1$' "$page")
  if [ "$n" = 1 ]; then ok "node $i: kvtier_build_info{version,revision} 1"; else bad "node $i: kvtier_build_info: $(grep build_info "$page")"; fi
  is "node $i: process_cpu_seconds_total moved" 'b > a && a > 0' \
    "$(exact "$work/page.1.$i" process_cpu_seconds_total)" "$(exact "$page" process_cpu_seconds_total)"
  is "node $i: process_resident_memory_bytes > 1 MiB" 'a > 1048576' "$(exact "$page" process_resident_memory_bytes)"
  is "node $i: 0 < process_open_fds <= process_max_fds" 'a > 0 && a <= b' \
    "$(exact "$page" process_open_fds)" "$(exact "$page" process_max_fds)"
  is "node $i: process_start_time_seconds within the test" "a >= $((t_start - 5)) && a <= $now" \
    "$(exact "$page" process_start_time_seconds)"
  t='{tier="0:primary"}'
  is "node $i: primary capacity 64 chunks, 16 MiB" 'a == 64 && b == 16777216' \
    "$(exact "$page" "kvtier_tier_capacity_chunks$t")" "$(exact "$page" "kvtier_tier_capacity_bytes$t")"
  uc=$(exact "$page" "kvtier_tier_used_chunks$t")
  is "node $i: primary used: 1..64 chunks of 256 KiB" "a >= 1 && a <= 64 && b == a * 262144" \
    "$uc" "$(exact "$page" "kvtier_tier_used_bytes$t")"
  t='{tier="1:storage"}'
  is "node $i: storage capacity 252 chunks, 64 MiB" 'a == 252 && b == 67108864' \
    "$(exact "$page" "kvtier_tier_capacity_chunks$t")" "$(exact "$page" "kvtier_tier_capacity_bytes$t")"
  uc=$(exact "$page" "kvtier_tier_used_chunks$t")
  is "node $i: storage used: 1..252 files of 260 KiB" "a >= 1 && a <= 252 && b == a * 266240" \
    "$uc" "$(exact "$page" "kvtier_tier_used_bytes$t")"
  if grep -q '^kvtier_tier_[a-z_]*{tier="2:network"}' "$page"; then bad "node $i: the network tier shows usage"; else ok "node $i: no usage for the network tier"; fi
  # Pulled chunks refused by their fence (network.verify: fence), one series a reason,
  # there whether or not one was refused.
  for r in changed writing unread; do
    is "node $i: kvtier_net_fence_failures_total{reason=\"$r\"} on the page" 'a >= 0' \
      "$(exact "$page" "kvtier_net_fence_failures_total{reason=\"$r\"}")"
  done
  # The loop's busy poll with transfers in flight (CPU less it is the node's work).
  is "node $i: kvtier_net_idle_polls_total on the page" 'a >= 0' \
    "$(exact "$page" kvtier_net_idle_polls_total)"
  is "node $i: kvtier_net_idle_poll_seconds_total on the page" 'a >= 0' \
    "$(exact "$page" kvtier_net_idle_poll_seconds_total)"
  if grep -q '^vllm:kv_offload_cpu_allocation_size_bucket{le="262144"} ' "$page" &&
     grep -q '^vllm:kv_offload_tiering_lookup_sync_delay_seconds_bucket{tier="0:primary",le="1e-05"} ' "$page" &&
     ! grep -q '^vllm:kv_offload_tiering_lookup_sync_delay_seconds_bucket{tier="0:primary",le="1e-06"} ' "$page"; then
    ok "node $i: vLLM's own histogram buckets"
  else
    bad "node $i: histogram buckets: $(grep -E 'allocation_size_bucket|sync_delay_seconds_bucket\{tier="0' "$page" | head -4)"
  fi
done

for i in 1 2; do
  p=${pids[$((i - 1))]}
  kill -TERM "$p"
  rc=0
  wait "$p" || rc=$?
  if [ "$rc" = 0 ]; then ok "node $i exits 0 on SIGTERM"; else bad "node $i exit $rc: $(tail -5 "$work/node$i.log")"; fi
done
pids=()
echo "$pass passed, $fail failed"
[ "$fail" = 0 ]

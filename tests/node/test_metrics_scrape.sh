#!/usr/bin/env bash
# /metrics of real nodes after real traffic: two kvtierd on loopback (UCX over tcp),
# a small primary each (so stores evict), kvtier-load against both (stores, hits,
# chunks pulled between the nodes), then every node is scraped: each page must be
# 200, promtool-clean (vLLM's "vllm:" names excepted) and show the counters that this
# traffic must have moved; then more load, and every one of those counters must
# have moved again on the second scrape. kvtierd once froze its page for good after
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
for round in 1 2; do
  if run_load 4 "$round"; then ok "round $round: kvtier-load exit 0"; else bad "round $round: kvtier-load failed: $(tail -5 "$work/load.$round.out")"; fi
  for i in 1 2; do
    page=$work/page.$round.$i
    if scrape "$i" "$page"; then ok "round $round: node $i /metrics 200"; else bad "round $round: node $i /metrics"; continue; fi
    if command -v promtool >/dev/null; then
      # promtool wants Prometheus's own names; vLLM's "vllm:" families are kept for
      # vLLM's dashboards and are the only findings allowed.
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

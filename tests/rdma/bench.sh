#!/bin/sh
# Verbs figures in one soft-RoCE guest (docs/rdma.md): kvtier-bench transport
# --backend verbs (two processes in the guest) beside ib_read_bw / ib_read_lat on
# rxe0 in the same guest, same sizes: 256 KiB READs with 32 outstanding, one 4 KiB
# READ for latency. Run by hand through the harness (not a ctest: speed is never
# asserted); the figures land in $KVT_RESULTS/*.txt, which the harness prints.
#   tools/rxe-harness/kvtier-rxe --guests 1 -- tests/rdma/bench.sh build/tools/bench/kvtier-bench
# (ADDR defaults to the guest's own address: rdma_cm cannot listen on 127.0.0.1.)
set -u
BENCH=${1:?usage: bench.sh PATH/TO/kvtier-bench [ADDR]}
ADDR=${2:-$KVT_ADDR}
R=$KVT_RESULTS

serve_and_run() { # $1 = output file, rest = perftest command (server first, then client)
  out=$1
  shift
  timeout 300 "$@" >"$out.server" 2>&1 &
  srv=$!
  i=0
  until timeout 300 "$@" "$KVT_ADDR" >"$out" 2>&1; do
    i=$((i + 1))
    [ $i -lt 20 ] || { echo "FAIL: $* did not run"; cat "$out"; exit 1; }
    sleep 1
  done
  wait $srv
}

echo "== kvtier-bench transport --backend verbs ($ADDR, in this guest)"
"$BENCH" transport --backend verbs --addr "$ADDR" >"$R/bench_verbs.out" 2>&1 || {
  cat "$R/bench_verbs.out"
  echo "FAIL: kvtier-bench transport --backend verbs"
  exit 1
}
cat "$R/bench_verbs.out"

echo "== ib_read_bw -R -d rxe0 -s 262144 -t 32 -n 500"
serve_and_run "$R/ib_read_bw.out" ib_read_bw -R -F -d rxe0 -s 262144 -t 32 -n 500
cat "$R/ib_read_bw.out"
echo "== ib_read_lat -R -d rxe0 -s 4096 -n 1000"
serve_and_run "$R/ib_read_lat.out" ib_read_lat -R -F -d rxe0 -s 4096 -n 1000
cat "$R/ib_read_lat.out"

{
  echo "date: $(date -u +%Y-%m-%dT%H:%MZ), one qemu TCG guest, rxe0 loopback"
  echo "kvtier-bench transport --backend verbs:"
  grep -iE "MB/s|latency|p50|p99" "$R/bench_verbs.out"
  echo "ib_read_bw -s 262144 -t 32 (MB/s row):"
  awk '$1 == 262144' "$R/ib_read_bw.out"
  echo "ib_read_lat -s 4096 (usec row):"
  awk '$1 == 4096' "$R/ib_read_lat.out"
} >"$R/figures.txt"
echo "PASS"

#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
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

# Interleaved (kvtier, ib_read_bw, ib_read_lat) x REPS, so that the guest's and the
# host's noise falls on both sides; the same bytes each: 16 x 32 x 256 KiB = 500 x
# 256 KiB + 12, 1000 READs of 4 KiB.
REPS=${KVT_BENCH_REPS:-3}
rep=1
while [ $rep -le "$REPS" ]; do
  echo "== rep $rep: kvtier-bench transport --backend verbs --iters 16 --lat-iters 1000 --reps 1 ($ADDR)"
  "$BENCH" transport --backend verbs --addr "$ADDR" --iters 16 --lat-iters 1000 --reps 1 \
    >"$R/bench_verbs.$rep.out" 2>&1 || {
    cat "$R/bench_verbs.$rep.out"
    echo "FAIL: kvtier-bench transport --backend verbs"
    exit 1
  }
  cat "$R/bench_verbs.$rep.out"
  echo "== rep $rep: ib_read_bw -R -F -d rxe0 -s 262144 -t 32 -n 500"
  serve_and_run "$R/ib_read_bw.$rep.out" ib_read_bw -R -F -d rxe0 -s 262144 -t 32 -n 500
  awk '$1 == 262144' "$R/ib_read_bw.$rep.out"
  echo "== rep $rep: ib_read_lat -R -F -d rxe0 -s 4096 -n 1000"
  serve_and_run "$R/ib_read_lat.$rep.out" ib_read_lat -R -F -d rxe0 -s 4096 -n 1000
  awk '$1 == 4096' "$R/ib_read_lat.$rep.out"
  rep=$((rep + 1))
done

{
  echo "date: $(date -u +%Y-%m-%dT%H:%MZ), one qemu TCG guest, rxe0 loopback, $REPS reps"
  rep=1
  while [ $rep -le "$REPS" ]; do
    echo "rep $rep kvtier-bench transport --backend verbs:"
    grep -iE "MB/s|latency|p50|p99|median" "$R/bench_verbs.$rep.out"
    echo "rep $rep ib_read_bw -s 262144 -t 32 (bytes iters peak avg MB/s ...):"
    awk '$1 == 262144' "$R/ib_read_bw.$rep.out"
    echo "rep $rep ib_read_lat -s 4096 (bytes iters min max typical avg stdev 99% 99.9% usec):"
    awk '$1 == 4096' "$R/ib_read_lat.$rep.out"
    rep=$((rep + 1))
  done
} >"$R/figures.txt"
echo "PASS"

#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Every kvtier-bench subcommand once, at a tiny size, with --json: the benchmarks the
# docs quote keep running, and what they check of their own work holds (every load
# verified, no corrupt chunk, every rebuilt file found). Not a speed test: no figure
# is compared with a target here (docs/bench-*.md hold those, from quiet Release runs).
#   smoke.sh PATH/TO/kvtier-bench PATH/TO/kvtier-simnode SCRATCH_DIR
set -euo pipefail
BENCH=${1:?usage: smoke.sh KVTIER_BENCH KVTIER_SIMNODE SCRATCH}
SIMNODE=${2:?}
SCRATCH=${3:?}
fail=0
check() { # name, jq filter that must print true, json
  if [ "$(jq -r "$2" <<<"$3")" != "true" ]; then
    echo "FAIL: $1: $2"
    echo "$3" | head -c 3000; echo
    fail=1
  else
    echo "ok: $1"
  fi
}

rm -rf "$SCRATCH"; mkdir -p "$SCRATCH"
trap 'rm -rf "$SCRATCH"' EXIT

out=$("$BENCH" core --json --repeat 1)
check "core: 6 rows (3 sizes x LRU, ARC), every time positive" \
  '(.results | length) == 6 and all(.results[]; .lookup_hit_ns > 0 and .lookup_miss_ns > 0
     and .store_complete_ns > 0 and .store_complete_evict_ns > 0 and .touch16_ns > 0
     and .index_bytes_per_chunk > .key_bytes_per_chunk)' "$out"
check "core: 6 manager rows, every time positive, no vLLM rows unless asked" \
  '(.manager | length) == 6 and (.vllm | length) == 0 and all(.manager[]; .lookup_hit_ns > 0
     and .lookup_miss_ns > 0 and .store_ns > 0 and .store_evict_ns > 0 and .load_ns > 0
     and .touch16_ns > 0 and .finish_ns > 0 and .finish_evict_ns > 0)' "$out"

out=$("$BENCH" storage --json --dir "$SCRATCH/storage" --chunks 64 --rounds 2 --rebuild-files 300)
check "storage: every chunk loaded and checked, every file rebuilt, fio beside it" \
  '.load_failures == 0 and .rebuild.found == .rebuild.files and .rebuild.files == 300
     and .fio.ok and all(.gbs[]; .median > 0)' "$out"

out=$(UCX_TLS=tcp UCX_NET_DEVICES=lo "$BENCH" transport --json --iters 64 --lat-iters 200 \
        --ref-lat-iters 200 --reps 1 --chunks 64)
check "transport: READs moved, latencies measured, ucx_perftest beside them" \
  '.median.read_mbps > 0 and .median.lat4k_p50_us > 0 and .median.ucx_perftest_read_mbps > 0' \
  "$out"
mkdir -p "$SCRATCH/bufs"
out=$(UCX_TLS=tcp UCX_NET_DEVICES=lo "$BENCH" transport --json --iters 64 --lat-iters 200 \
        --ref-lat-iters 200 --reps 1 --chunks 64 --buffer-dir "$SCRATCH/bufs")
check "transport --buffer-dir: READs moved between files there" '.median.read_mbps > 0' "$out"
if [ -n "$(ls -A "$SCRATCH/bufs")" ]; then
  echo "FAIL: transport --buffer-dir left $(ls -A "$SCRATCH/bufs")"
  fail=1
fi

out=$("$BENCH" pull --json --chunks 256 --tls tcp --simnode "$SIMNODE" 2>/dev/null)
check "pull: both validations (fence, checksum), fence by lease and direct, all 256 chunks hit, none corrupt, ceiling and redis beside them" \
  '(.rows | length) == 3 and ([.rows[].verify] == ["fence", "fence", "checksum"])
     and ([.rows[].fetch] == ["lease", "direct", "lease"])
     and all(.rows[]; .hit == 256 and .corrupt == 0 and .gbps > 0 and .transport_gbps > 0
             and .transport_same_pages_gbps > 0)
     and .rows[0].direct_chunks == 0 and .rows[1].direct_chunks >= 128
     and .redis_gbps > 0' "$out"
check "pull: CPU per chunk on both sides measured, the copy beside it, NIC shares within 0..1" \
  '.copy_us_per_chunk > 0 and all(.rows[]; .puller_cpu_us_per_chunk > 0
     and .holder_cpu_us_per_chunk >= 0 and .puller_cpu_us_per_chunk_less_copy >= 0
     and (.puller_core_nic_fraction_200g | . > 0 and . <= 1)
     and (.holder_core_nic_fraction_400g | . > 0 and . <= 1))' "$out"
check "pull: each side's busy poll measured (us per chunk), and the CPU per chunk less copy and poll" \
  'all(.rows[]; .puller_poll_us_per_chunk >= 0 and .holder_poll_us_per_chunk >= 0
     and (.puller_cpu_us_per_chunk_less_copy_and_poll | . >= 0 or . == -1)
     and (.holder_cpu_us_per_chunk_less_poll | . >= 0 or . == -1))' "$out"
check "pull: each node's primary on huge pages or not, said (0..1), with where it ran and the kernel's THP mode" \
  '.run_dir == "/dev/shm" and .thp_enabled != "unknown"
     and all(.rows[]; (.primary_huge_a | . >= 0 and . <= 1) and (.primary_huge_b | . >= 0 and . <= 1))' "$out"
# Mooncake runs only where its venv is (tools/mooncake-env; the test command does not
# make it): there it must have got every chunk back intact, elsewhere say "absent".
check "pull: Mooncake measured where its venv is, else absent (never failed)" \
  '(.mooncake.status == "measured" and .mooncake.gbps > 0 and .mooncake.req_ms_p50 > 0)
     or (.mooncake.status == "absent" and .mooncake.gbps < 0)' "$out"
# --run-dir puts the nodes' runtime folders (their primaries) elsewhere, e.g. on a tmpfs
# mounted huge=advise; here a scratch folder, which must hold them and nothing stay.
mkdir -p "$SCRATCH/run"
out=$("$BENCH" pull --json --chunks 64 --tls tcp --verify fence --fetch lease --no-mooncake \
        --run-dir "$SCRATCH/run" --simnode "$SIMNODE" 2>/dev/null)
check "pull --run-dir: the nodes ran there, the ceiling's buffers too, every chunk hit, nothing left behind" \
  ".run_dir == \"$SCRATCH/run\"
     and (.rows | length) == 1 and .rows[0].hit == 64 and .rows[0].corrupt == 0
     and .rows[0].transport_same_pages_gbps > 0" "$out"
if [ -n "$(ls -A "$SCRATCH/run")" ]; then
  echo "FAIL: pull --run-dir left $(ls -A "$SCRATCH/run")"
  fail=1
fi

out=$(UCX_TLS=tcp UCX_NET_DEVICES=lo "$BENCH" connect --json --iters 5)
check "connect: 5 links up and answering, the first reply after UP" \
  '.iters == 5 and .up_us.median > 0 and .first_rtt_us.median >= .up_us.median' "$out"

if [ $fail -ne 0 ]; then
  echo "bench smoke: FAILED"
  exit 1
fi
echo "bench smoke: all 5 subcommands ran and checked their work"

#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# kvtierd and kvtier under an operator's mistakes and a host's limits:
# - SIGHUP with new network.peers (a key --help marks reloadable): the node dials the
#   new seed and lists it up, without a restart;
# - an open files limit too low to start: a clear error naming the limit, exit 1, no
#   abort in a library half-way through the start, nothing left behind;
# - the limit reached while serving (engines and scrapers connecting past it): the
#   engine socket and /metrics rest instead of spinning on accept and logging each
#   failure; the node serves again once descriptors are free;
# - kvtier writing to a full standard output: exit 1, never a cut-off success.
#
#   test_kvtierd_ops.sh KVTIERD KVTIER_CLI TMPDIR
set -uo pipefail
kvtierd=$1 cli=$2 tmp=$3
mkdir -p "$tmp"
work=$(mktemp -d "$tmp/kvtierd-ops.XXXXXX")
shm=/dev/shm/kvtierd-ops-$$
pass=0 fail=0
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -KILL "$p" 2>/dev/null; done
  rm -rf "$work" "$shm"-*
}
trap cleanup EXIT

ok() { pass=$((pass + 1)); echo "ok - $*"; }
bad() { fail=$((fail + 1)); echo "FAIL - $*"; }
check() { if eval "$2"; then ok "$1"; else bad "$1"; fi; }
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

head -c 40 /dev/urandom | base64 >"$work/secret" && chmod 600 "$work/secret"
cfg() { # name id network.port metrics.port [peers]
  mkdir -p "$work/$1" && chmod 700 "$work/$1"
  cat <<EOF
node:
  id: $2
primary:
  path: $shm-$1/region.mmap
  size: 16MiB
  row_bytes: 256KiB
storage:
  root: $work/$1/storage
  capacity: 64MiB
network:
  port: $3
  peers: [$5]
  heartbeat_ms: 200
cluster:
  secret_file: $work/secret
engine:
  socket: $work/$1/engine.sock
metrics:
  port: $4
EOF
}
start() { # name -> pid in $started (waits for "ready")
  : >"$work/$1.log"
  "$kvtierd" --config "$work/$1.yaml" >"$work/$1.log" 2>&1 &
  started=$!
  pids+=("$started")
  for _ in $(seq 1 200); do
    grep -q "kvtierd: ready" "$work/$1.log" && return 0
    kill -0 "$started" 2>/dev/null || return 1
    sleep 0.05
  done
  return 1
}
stop() { # pid -> stop_rc
  kill -TERM "$1"
  for _ in $(seq 1 100); do kill -0 "$1" 2>/dev/null || break; sleep 0.1; done
  if kill -0 "$1" 2>/dev/null; then stop_rc=timeout; kill -KILL "$1"; else wait "$1"; stop_rc=$?; fi
}
cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }

# ---- SIGHUP: network.peers ----
pb=$(free_port)
cfg a 1 0 0 "" >"$work/a.yaml"
cfg b 2 "$pb" 0 "" >"$work/b.yaml"
check "node a starts with no peers" 'start a'
pa=$started
check "node b starts with no peers" 'start b'
pbid=$started
"$cli" peers --socket "$work/a/engine.sock" >"$work/peers0" 2>&1
check "a sees no peer before the reload" '! grep -q "^0000000000000002 " "$work/peers0"'
cfg a 1 0 0 "\"127.0.0.1:$pb\"" >"$work/a.yaml"
kill -HUP "$pa"
up=0
for _ in $(seq 1 50); do
  "$cli" peers --socket "$work/a/engine.sock" >"$work/peers1" 2>&1
  grep -Eq "^0000000000000002 .* up " "$work/peers1" && { up=1; break; }
  sleep 0.1
done
check "SIGHUP with network.peers: a dials the new seed and lists b up" '[ $up = 1 ]'
check "the reload is logged as applied" 'grep -q "SIGHUP: network.peers changed" "$work/a.log"'
cfg a 1 0 0 "\"127.0.0.1:0\"" >"$work/a.yaml"
kill -HUP "$pa"
sleep 0.5
check "SIGHUP with a bad seed: refused with the key and line, node kept" \
  'grep -q "a.yaml:[0-9]*: network.peers" "$work/a.log" && kill -0 $pa'
stop "$pa"
check "a stops cleanly after the reloads (exit 0)" '[ "$stop_rc" = 0 ]'
stop "$pbid"
check "b stops cleanly (exit 0)" '[ "$stop_rc" = 0 ]'

# ---- an open files limit too low to start ----
cfg c 3 0 0 "" >"$work/c.yaml"
(ulimit -n 20 && exec "$kvtierd" --config "$work/c.yaml") >"$work/c.log" 2>&1
rc=$?
check "ulimit -n 20: exit 1 (not an abort: rc $rc)" '[ $rc = 1 ]'
check "ulimit -n 20: the message names the limit" 'grep -q "open files limit is 20" "$work/c.log"'
check "ulimit -n 20: no region, lock or socket left" \
  '[ ! -e "$shm-c/region.mmap" ] && [ ! -e "$shm-c/region.mmap.lock" ] && [ ! -e "$work/c/engine.sock" ]'

# ---- the limit reached while serving ----
mport=$(free_port)
cfg d 4 0 "$mport" "" >"$work/d.yaml"
: >"$work/d.log"
(ulimit -n 64 && exec "$kvtierd" --config "$work/d.yaml") >"$work/d.log" 2>&1 &
pd=$!
pids+=("$pd")
for _ in $(seq 1 200); do grep -q "kvtierd: ready" "$work/d.log" && break; sleep 0.05; done
check "node d starts under ulimit -n 64" 'grep -q "kvtierd: ready" "$work/d.log"'
# 60 engine connections and 60 scrapers that say nothing, held 3 s: past the limit.
python3 - "$work/d/engine.sock" "$mport" <<'EOF' &
import socket, sys, time
held = []
for _ in range(60):
    s = socket.socket(socket.AF_UNIX)
    s.connect(sys.argv[1])
    held.append(s)
for _ in range(60):
    try:
        held.append(socket.create_connection(("127.0.0.1", int(sys.argv[2])), timeout=2))
    except OSError:
        pass
time.sleep(3)
EOF
hold=$!
sleep 1
t0=$(cpu_ticks "$pd")
sleep 1.5
t1=$(cpu_ticks "$pd")
hz=$(getconf CLK_TCK)
wait "$hold"
echo "# CPU over 1.5 s past the limit: $((t1 - t0)) ticks of $hz/s"
check "past the limit the node does not spin (< 0.5 s of CPU in 1.5 s)" '[ $((t1 - t0)) -lt $((hz / 2)) ]'
n_eng=$(grep -c "engine_api: accept on" "$work/d.log")
n_http=$(grep -c "metrics_http: accept" "$work/d.log")
check "accept failures logged a few times, not each ($n_eng engine, $n_http /metrics)" \
  '[ "$n_eng" -ge 1 ] && [ "$n_eng" -le 3 ] && [ "$n_http" -le 3 ]'
sleep 1.5 # the held connections' descriptors are free again: the sockets accept again
"$cli" status --socket "$work/d/engine.sock" >"$work/d.status" 2>&1
check "the engine socket serves again once descriptors are free" '[ $? = 0 ]'
check "/healthz serves again" 'curl -sf "http://127.0.0.1:$mport/healthz" >/dev/null'
curl -sf "http://127.0.0.1:$mport/metrics" >"$work/d.metrics"
check "/metrics counts the engine accepts that failed" \
  'grep -Eq "^kvtier_engine_accept_failures_total [1-9]" "$work/d.metrics"'

# ---- kvtier with a full standard output ----
for c in "status" "stats" "stats --json" "peers" "lookup 00c0ffee"; do
  # shellcheck disable=SC2086 # the command and its arguments
  "$cli" $c --socket "$work/d/engine.sock" >/dev/full 2>"$work/full.err"
  rc=$?
  check "kvtier $c > /dev/full: exit 1 with the write error (rc $rc)" \
    '[ $rc = 1 ] && grep -q "standard output" "$work/full.err"'
done
"$cli" --version >/dev/full 2>/dev/null
check "kvtier --version > /dev/full: exit 1" '[ $? = 1 ]'

stop "$pd"
check "d stops cleanly (exit 0)" '[ "$stop_rc" = 0 ]'

echo "# test_kvtierd_ops: $pass passed, $fail failed"
[ "$fail" = 0 ]

#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# kvtierd as its users run it (issue #6): --help/--version, every class of bad
# configuration (exit 78, key and line named, nothing created), start and stop,
# several engines under load then SIGTERM (exit 0 within 10 s, nothing pinned at exit),
# restart after SIGKILL (stale region, lock and socket), SIGHUP reload (a reloadable
# key applies; a fixed one is refused and the old configuration kept).
#
#   test_kvtierd.sh KVTIERD KVTIER_LOAD KVTIER_CLI TMPDIR
set -uo pipefail
kvtierd=$1 load=$2 cli=$3 tmp=$4
work=$(mktemp -d "$tmp/kvtierd.XXXXXX")
pass=0 fail=0
pid=""
cleanup() { [ -n "$pid" ] && kill -KILL "$pid" 2>/dev/null; rm -rf "$work" /dev/shm/kvtierd-test-$$*; }
trap cleanup EXIT
keep=${KEEP:-}

ok() { pass=$((pass + 1)); echo "ok - $*"; }
bad() { fail=$((fail + 1)); echo "FAIL - $*"; }
check() { if eval "$2"; then ok "$1"; else bad "$1"; fi; }

# The region in a runtime folder of its own on the /dev/shm tmpfs (kvtierd creates it
# 0700 and refuses a folder others may write, such as /dev/shm itself).
region=/dev/shm/kvtierd-test-$$/region.mmap
mport=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
sock=$work/engine.sock
head -c 40 /dev/urandom | base64 >"$work/secret" && chmod 600 "$work/secret"
base_cfg() {
  cat <<EOF
node:
  id: 7
primary:
  path: $region
  size: 64MiB
  row_bytes: 256KiB
storage:
  root: $work/storage
  capacity: 256MiB
network:
  port: 0
cluster:
  secret_file: $work/secret
engine:
  socket: $sock
metrics:
  port: $mport
log:
  level: info
EOF
}

# ---- --help, --version ----
"$kvtierd" --help >"$work/help" 2>&1
check "--help exits 0 and lists the keys" '[ $? = 0 ] && grep -q "primary.size" "$work/help"'
"$kvtierd" --version >"$work/ver" 2>&1
check "--version prints a version" 'grep -q "^kvtierd [0-9]" "$work/ver"'
# ... and the git revision it was built from: this tree's HEAD when it is a checkout
src=$(cd "$(dirname "$0")/../.." && pwd -P)
rev='[0-9a-f]{8}(, dirty)?|unknown'
[ "$(git -C "$src" rev-parse --show-toplevel 2>/dev/null)" = "$src" ] &&
  rev="$(git -C "$src" rev-parse --short=8 HEAD)(, dirty)?"
check "--version names the git revision ($rev)" \
  'grep -Eq "^kvtierd [0-9]+\.[0-9]+\.[0-9]+ \(git ($rev)\)\$" "$work/ver"'

# ---- bad configurations: exit 78, key named (and its line for files), nothing created ----
bad_cfg() { # name, expected text, kvtierd args...
  local name=$1 want=$2
  shift 2
  rm -f "$region" "$sock"
  "$kvtierd" "$@" >"$work/out" 2>&1
  local rc=$?
  if [ "$rc" = 78 ] && grep -q -- "$want" "$work/out" && [ ! -e "$region" ] && [ ! -e "$sock" ]; then
    ok "bad config ($name): exit 78, names '$want', nothing created"
  else
    bad "bad config ($name): rc=$rc, output: $(head -c 300 "$work/out")"
  fi
}
base_cfg >"$work/good.yaml"
{ base_cfg; echo "bogus_key: 1"; } >"$work/unknown.yaml"
bad_cfg "unknown key" "bogus_key" --config "$work/unknown.yaml"
bad_cfg "unknown key has its line" "unknown.yaml:20:" --config "$work/unknown.yaml"
sed 's/  size: 64MiB/  size: lots/' "$work/good.yaml" >"$work/type.yaml"
bad_cfg "wrong type" "primary.size" --config "$work/type.yaml"
awk '/^network:/{n=1} n&&/  port:/{sub(/port: .*/,"port: 70000");n=0} {print}' "$work/good.yaml" >"$work/range.yaml"
bad_cfg "out of range" "network.port" --config "$work/range.yaml"
sed "s#secret_file: .*#secret_file: $work/nope#" "$work/good.yaml" >"$work/secret.yaml"
bad_cfg "missing secret file" "cluster.secret_file" --config "$work/secret.yaml"
printf 'primary:\n  size: [1, 2\n' >"$work/yaml.yaml"
bad_cfg "malformed YAML" "yaml.yaml" --config "$work/yaml.yaml"
bad_cfg "bad --set" "primary.policy" --config "$work/good.yaml" --set primary.policy=fifo
bad_cfg "missing file" "nothere.yaml" --config "$work/nothere.yaml"

# ---- start, several engines under load, SIGTERM ----
start() {
  # Emptied here, before the daemon starts: its own redirection happens in the child,
  # after which the wait below could read the previous daemon's "ready".
  : >"$work/daemon.log"
  "$kvtierd" --config "$work/good.yaml" >"$work/daemon.log" 2>&1 &
  pid=$!
  for _ in $(seq 1 200); do
    grep -q "kvtierd: ready" "$work/daemon.log" && return 0 # a stale socket is no sign
    kill -0 "$pid" 2>/dev/null || return 1
    sleep 0.05
  done
  return 1
}
stop_term() { # -> sets stop_rc, stop_ms
  local t0
  t0=$(date +%s%N)
  kill -TERM "$pid"
  for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  if kill -0 "$pid" 2>/dev/null; then stop_rc=timeout; kill -KILL "$pid"; else wait "$pid"; stop_rc=$?; fi
  stop_ms=$((($(date +%s%N) - t0) / 1000000))
  pid=""
}

check "daemon starts and listens" 'start'
"$cli" status --socket "$sock" >"$work/status" 2>&1
check "kvtier status reaches it over the engine API" '[ $? = 0 ] && grep -q "health     ok" "$work/status"'
check "kvtier status: its cluster of one (itself, up)" 'grep -q "cluster    1 of 1 members up" "$work/status"'
"$cli" peers --socket "$sock" >"$work/peers" 2>&1
check "kvtier peers lists the node itself (engine API, no HTTP)" \
  '[ $? = 0 ] && grep -Eq "^0000000000000007 [0-9a-f]{16} 127\.0\.0\.1:[0-9]+ +self" "$work/peers"'
"$load" --node "$sock" --engines-per-node 4 --duration 2 --quiet >"$work/load1" 2>&1
check "4 engines, 2 s of load, 0 errors" '[ $? = 0 ] && grep -q "ERRORS *0" "$work/load1"'
# Engine steps paced as forward passes of 20 ms: 2 engines x 1 s make at most ~100.
"$load" --node "$sock" --engines-per-node 2 --duration 1 --step-us 20000 --json --quiet \
  >"$work/load_paced" 2>&1
check "--step-us 20000: 0 errors, each engine step lasts >= 20 ms" \
  '[ $? = 0 ] && jq -e ".errors == 0 and .steps > 0 and .steps <= 2 * (.duration_s / 0.02 + 2)" "$work/load_paced" >/dev/null'
"$load" --node "$sock" --step-us -5 --duration 1 >"$work/load_bad" 2>&1
check "--step-us -5: refused, exit 2, the option named" \
  '[ $? = 2 ] && grep -q -- "--step-us" "$work/load_bad"'
sleep 1.2 # the next /metrics snapshot
curl -sf "http://127.0.0.1:$mport/metrics" >"$work/metrics" 2>&1
check "/metrics serves the tiering core's series" 'grep -q "^vllm:kv_offload_tiering_chunk_queries" "$work/metrics"'
promtool check metrics <"$work/metrics" >"$work/promtool" 2>&1
prc=$?
cp "$work/promtool" "$tmp/promtool.last"
# The one lint finding allowed: vLLM's own names keep their "vllm:" prefix (so that
# vLLM's dashboards work); anything else promtool reports fails the test.
others=$(grep -vc "metric names should not contain ':'" "$work/promtool")
echo "# promtool: exit $prc, $others finding(s) besides the colons of vLLM's names"
check "promtool check metrics: parses, no lint finding but vLLM's colons" '[ "$others" = 0 ] && [ $prc != 1 ]'
"$load" --node "$sock" --engines-per-node 3 --duration 20 --quiet >"$work/load2" 2>&1 &
lp=$!
sleep 2
stop_term
wait "$lp" 2>/dev/null
echo "# SIGTERM under load: exit $stop_rc after $stop_ms ms"
check "SIGTERM under load: exit 0 within 10 s" '[ "$stop_rc" = 0 ]'
check "nothing pinned or write-pending at exit" 'grep -q "0 pinned, 0 write-pending" "$work/daemon.log"'
check "the region and socket are gone after a clean stop" '[ ! -e "$region" ] && [ ! -e "$sock" ]'

# ---- restart after SIGKILL ----
check "daemon starts again" 'start'
kill -KILL "$pid"; wait "$pid" 2>/dev/null; pid=""
check "SIGKILL leaves the region behind (the case to handle)" '[ -e "$region" ]'
check "restart after SIGKILL works" 'start'
"$load" --node "$sock" --engines-per-node 2 --duration 1 --quiet >"$work/load3" 2>&1
check "serves after the restart" '[ $? = 0 ]'

# ---- SIGHUP ----
sed 's/  level: info/  level: debug/' "$work/good.yaml" >"$work/next.yaml" && cp "$work/next.yaml" "$work/good.yaml"
kill -HUP "$pid"; sleep 0.5
check "SIGHUP applies a reloadable key" 'grep -q "log.level changed" "$work/daemon.log"'
sed 's/  size: 64MiB/  size: 128MiB/' "$work/good.yaml" >"$work/next.yaml" && cp "$work/next.yaml" "$work/good.yaml"
kill -HUP "$pid"; sleep 0.5
check "SIGHUP refuses a fixed key and keeps running" 'grep -q "primary.size cannot change" "$work/daemon.log" && kill -0 $pid'
stop_term
check "stops cleanly after the reloads" '[ "$stop_rc" = 0 ]'

echo "# test_kvtierd: $pass passed, $fail failed"
[ "$fail" = 0 ]

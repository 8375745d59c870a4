#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# The soft-RoCE harness leaves nothing behind (tools/rxe-harness/README.md, step 7):
# no qemu process, network namespace (with its bridge and taps), run folder or
# temporary folder, when a guest's command hangs (the run timeout), when the harness
# is interrupted (SIGINT), and when it is SIGKILLed (qemu dies with it; the next run
# removes the namespace and folders). Runs on the host, two guests on a bridge.
#   harness-cleanup.sh PATH/TO/kvtier-rxe CACHE_DIR
set -u
RXE=${1:?usage: harness-cleanup.sh KVTIER_RXE CACHE}
CACHE=${2:?usage: harness-cleanup.sh KVTIER_RXE CACHE}
REPO=$(cd "$(dirname "$RXE")/../.." && pwd)
LOG=$(mktemp /tmp/kvt-harness-cleanup.XXXXXX)
trap 'rm -f "$LOG"' EXIT

fail() {
  echo "FAIL: $*"
  echo "----- harness output -----"
  cat "$LOG"
  exit 1
}

# What a run of harness pid $1 could have left.
leftovers() {
  pid=$1
  left=""
  pgrep -f "rxe-run-$pid-" >/dev/null && left="$left qemu($(pgrep -f "rxe-run-$pid-" | tr '\n' ' '))"
  ip netns list 2>/dev/null | grep -qw "kvtrxe-$pid" && left="$left netns(kvtrxe-$pid)"
  for d in "$REPO"/build/rxe-run-"$pid"-* /tmp/kvtier-rxe-"$pid"-*; do
    [ -e "$d" ] && left="$left $d"
  done
  echo "$left"
}

# Starts the harness in the background on two guests running `sleep 1000`; sets
# $hpid once every guest is ready (its command started).
start_and_wait_ready() {
  "$RXE" --guests 2 --timeout 300 --boot-timeout 90 --cache "$CACHE" -- sleep 1000 >"$LOG" 2>&1 &
  hpid=$!
  i=0
  until grep -q "all guests ready" "$LOG"; do
    kill -0 $hpid 2>/dev/null || fail "the harness ended before its guests were ready"
    i=$((i + 1))
    [ $i -lt 240 ] || fail "guests not ready after 120 s"
    sleep 0.5
  done
  sleep 2 # the command runs
  pgrep -f "rxe-run-$hpid-" >/dev/null || fail "no qemu of run $hpid found while it runs"
  ip netns list | grep -qw "kvtrxe-$hpid" || fail "no namespace kvtrxe-$hpid while it runs"
}

# Guests boot in 3-8 s here (the rdma label's summaries), 40 s at most is allowed.
echo "== a guest command that hangs: the run timeout (45 s, boot included) ends it"
t0=$(date +%s)
"$RXE" --guests 2 --timeout 45 --boot-timeout 40 --cache "$CACHE" -- sleep 1000 >"$LOG" 2>&1 &
hpid=$!
wait $hpid
rc=$?
[ $rc -eq 1 ] || fail "exit $rc, expected 1"
grep -q "all guests ready" "$LOG" || fail "the guests never ran their command"
grep -q "timeout (45 s)" "$LOG" || fail "the summary does not say timeout"
left=$(leftovers $hpid)
[ -z "$left" ] || fail "left behind after the timeout:$left"
echo "ok: exit 1 after $(($(date +%s) - t0)) s, status timeout, nothing left"

echo "== SIGINT while the guests run"
start_and_wait_ready
kill -INT $hpid
wait $hpid
rc=$?
[ $rc -eq 130 ] || fail "exit $rc after SIGINT, expected 130"
left=$(leftovers $hpid)
[ -z "$left" ] || fail "left behind after SIGINT:$left"
echo "ok: exit 130, nothing left"

echo "== SIGKILL of the harness: qemu dies with it, the next run sweeps the rest"
start_and_wait_ready
kill -KILL $hpid
wait $hpid 2>/dev/null
i=0
while pgrep -f "rxe-run-$hpid-" >/dev/null; do
  i=$((i + 1))
  [ $i -lt 20 ] || fail "qemu of the SIGKILLed run $hpid still alive after 10 s"
  sleep 0.5
done
"$RXE" --prepare-only --cache "$CACHE" >"$LOG" 2>&1 || fail "--prepare-only failed"
left=$(leftovers $hpid)
[ -z "$left" ] || fail "left behind after SIGKILL and the next run:$left"
echo "ok: qemu gone within $((i / 2)) s, namespace and folders removed by the next run"
echo "PASS"

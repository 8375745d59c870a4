#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# Soft-RoCE smoke test, run inside every guest by tools/rxe-harness/kvtier-rxe
# (tests/rdma/CMakeLists.txt). It checks what the later rdma tests rely on: rxe0
# is ACTIVE (`rdma link`), libibverbs sees it (`ibv_devinfo`), UCX lists rc_verbs
# on rxe0:1 (`ucx_info -d`), and an RDMA READ stream works (`ib_read_bw` over
# rdma_cm). Mode "one": server and client in the same guest, against its own
# address (rxe loops back). Mode "two": role 0 serves, role 1 reads from it and
# records the bandwidth in $KVT_RESULTS/ib_read_bw.txt (printed by the harness).
# Bandwidth under qemu TCG says nothing about hardware; it is recorded, never
# asserted.
set -u
mode=${1:?usage: smoke.sh one|two}
R=$KVT_RESULTS
BW="ib_read_bw -R -F -d rxe0 -s 65536 -n 300"

fail() {
  echo "FAIL (role $KVT_ROLE): $*"
  echo "----- the kernel's last messages (a stalled NIC logs NETDEV WATCHDOG)"
  dmesg | tail -20
  exit 1
}

echo "== rdma link"
rdma link show >"$R/rdma_link.out" 2>&1
cat "$R/rdma_link.out"
grep -q '^link rxe0/1 state ACTIVE' "$R/rdma_link.out" || fail "rxe0/1 is not ACTIVE"

echo "== ibv_devinfo -d rxe0"
ibv_devinfo -d rxe0 >"$R/ibv_devinfo.out" 2>&1
cat "$R/ibv_devinfo.out"
grep -q 'hca_id:[[:space:]]*rxe0' "$R/ibv_devinfo.out" || fail "ibv_devinfo does not list rxe0"
grep -q 'state:[[:space:]]*PORT_ACTIVE' "$R/ibv_devinfo.out" || fail "rxe0 port is not PORT_ACTIVE"

echo "== ucx_info -d (transport device pairs)"
ucx_info -d >"$R/ucx_info.out" 2>&1 || fail "ucx_info -d failed: $(tail -5 "$R/ucx_info.out")"
awk '$2 == "Transport:" { t = $3 } $2 == "Device:" { print t, $3 }' "$R/ucx_info.out" >"$R/ucx_transports.out"
cat "$R/ucx_transports.out"
grep -qx 'rc_verbs rxe0:1' "$R/ucx_transports.out" || fail "UCX does not list rc_verbs on rxe0:1"

# ib_read_bw client with retries: the server (another process or guest) may not
# listen yet (on a loaded 2-core host its guest can be a minute behind). Retries
# for up to 120 s. $1 = server address, $2 = output file.
# Every attempt's output is kept in $2.attempts, printed when all have failed.
client() {
  end=$(($(date +%s) + 120))
  n=0
  while :; do
    n=$((n + 1))
    timeout 60 $BW "$1" >"$2" 2>&1 && return 0
    { echo "--- attempt $n, exit $?, $(date +%T)"; tail -5 "$2"; } >>"$2.attempts"
    [ "$(date +%s)" -lt "$end" ] || { tail -40 "$2.attempts"; return 1; }
    sleep 1
  done
}

# The "65536 <iters> <peak> <average> <rate>" row of an ib_read_bw report.
mbps() { awk '$1 == 65536 && NF >= 4 { print $4 }' "$1"; }

record() {
  m=$(mbps "$R/ib_read_bw_client.out")
  [ -n "$m" ] || fail "no bandwidth row in the ib_read_bw output"
  echo "ib_read_bw -R -s 65536 -n 300 $1: $m MB/s" >"$R/ib_read_bw.txt"
  echo "== $(cat "$R/ib_read_bw.txt")"
}

case "$mode" in
one)
  echo "== ib_read_bw, server and client on rxe0 ($KVT_ADDR)"
  timeout 120 $BW >"$R/ib_read_bw_server.out" 2>&1 &
  srv=$!
  client "$KVT_ADDR" "$R/ib_read_bw_client.out"
  crc=$?
  wait $srv
  src=$?
  cat "$R/ib_read_bw_client.out"
  [ $crc -eq 0 ] || fail "ib_read_bw client failed"
  [ $src -eq 0 ] || fail "ib_read_bw server exited $src: $(tail -5 "$R/ib_read_bw_server.out")"
  record "one guest, loopback on rxe0"
  ;;
two)
  set -- $KVT_PEERS
  server_addr=$1
  if [ "$KVT_ROLE" = 0 ]; then
    echo "== ib_read_bw server on $KVT_ADDR"
    timeout 200 $BW >"$R/ib_read_bw_server.out" 2>&1
    src=$?
    cat "$R/ib_read_bw_server.out"
    [ $src -eq 0 ] || fail "ib_read_bw server exited $src"
  else
    echo "== ib_read_bw client $KVT_ADDR -> $server_addr"
    client "$server_addr" "$R/ib_read_bw_client.out"
    crc=$?
    cat "$R/ib_read_bw_client.out"
    [ $crc -eq 0 ] || fail "ib_read_bw client failed"
    record "two guests, $KVT_ADDR reads from $server_addr"
  fi
  ;;
*) fail "unknown mode $mode" ;;
esac
echo "PASS (role $KVT_ROLE)"

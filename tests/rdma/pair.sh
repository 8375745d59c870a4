#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# Runs a two-sided test program inside the soft-RoCE guests of tools/rxe-harness
# (tests/rdma/CMakeLists.txt). The program takes `--role server|client --addr A
# --port P` (kvt-conformance <backend>, verbs_pair).
#   pair.sh one PROG [ARGS...]  one guest: PROG ARGS --addr $KVT_ADDR (the program
#                               starts its own peer process on the same rxe device)
#   pair.sh two PROG [ARGS...]  two guests: role 0 serves on its address, role 1 runs
#                               the client against it
# Anything the program exits with is the guest's result: a missing RDMA device or a
# skip exit code (77) fails here, loudly.
set -u
mode=${1:?usage: pair.sh one|two PROG [ARGS...]}
shift
PORT=${KVT_PAIR_PORT:-18515}

check_rxe() {
  rdma link show 2>&1 | grep -q '^link rxe0/1 state ACTIVE' || {
    echo "FAIL (role $KVT_ROLE): rxe0/1 is not ACTIVE"
    rdma link show
    exit 1
  }
}

finish() {
  rc=$1
  if [ "$rc" -eq 0 ]; then
    echo "PASS (role $KVT_ROLE): $*"
  else
    echo "FAIL (role $KVT_ROLE): exit $rc${2:+ ($2)}"
  fi
  exit "$rc"
}

check_rxe
case "$mode" in
one)
  echo "== $* --addr $KVT_ADDR (one guest, loopback on rxe0)"
  "$@" --addr "$KVT_ADDR"
  rc=$?
  [ $rc -ne 77 ] || finish 1 "the program skipped: no RDMA device"
  finish $rc
  ;;
two)
  set -- "$@"
  peers=$KVT_PEERS
  server_addr=${peers%% *}
  if [ "$KVT_ROLE" = 0 ]; then
    echo "== server: $* --role server --addr $KVT_ADDR --port $PORT"
    "$@" --role server --addr "$KVT_ADDR" --port "$PORT"
  else
    echo "== client: $* --role client --addr $server_addr --port $PORT"
    "$@" --role client --addr "$server_addr" --port "$PORT"
  fi
  rc=$?
  [ $rc -ne 77 ] || finish 1 "the program skipped: no RDMA device"
  finish $rc
  ;;
*)
  echo "FAIL: unknown mode $mode"
  exit 1
  ;;
esac

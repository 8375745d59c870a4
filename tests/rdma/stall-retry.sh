#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Runs a kvtier-rxe command (the arguments after RESULTS_DIR). When it fails and a
# guest's kernel log shows qemu's virtio-net transmit watchdog ("NETDEV WATCHDOG":
# the guest's network stopped for good under TCG, the qemu 7.2 stall of docs/rdma.md),
# the attempt's logs move to RESULTS_DIR.stalled.N and the command runs again, said
# in the output: at most twice more (a loaded host stalled two attempts in a row
# once). Any other failure, or a third stall, is the test's result.
set -uo pipefail
results=${1:?usage: stall-retry.sh RESULTS_DIR COMMAND...}
shift
"$@"
rc=$?
for again in 1 2; do
  [ $rc -ne 0 ] || break
  stalled=$(grep -ls "NETDEV WATCHDOG" "$results"/g*/console.log) || break
  echo "rdma: the guest network stalled (qemu's virtio-net transmit watchdog in" \
       "$stalled): run $((again + 1)); this attempt's logs are in $results.stalled.$again"
  rm -rf "$results.stalled.$again"
  mv "$results" "$results.stalled.$again"
  "$@"
  rc=$?
done
exit $rc

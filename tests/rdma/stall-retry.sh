#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Runs a kvtier-rxe command (the arguments after RESULTS_DIR). When it fails and a
# guest's kernel log shows qemu's virtio-net transmit watchdog ("NETDEV WATCHDOG":
# the guest's network stopped for good under TCG, the qemu 7.2 stall of docs/rdma.md),
# the attempt's logs move to RESULTS_DIR.stalled and the command runs once more, said
# in the output. Any other failure, or a second one, is the test's result.
set -uo pipefail
results=${1:?usage: stall-retry.sh RESULTS_DIR COMMAND...}
shift
"$@"
rc=$?
if [ $rc -ne 0 ] && stalled=$(grep -ls "NETDEV WATCHDOG" "$results"/g*/console.log); then
  echo "rdma: the guest network stalled (qemu's virtio-net transmit watchdog in" \
       "$stalled): one more run; this attempt's logs are in $results.stalled"
  rm -rf "$results.stalled"
  mv "$results" "$results.stalled"
  "$@"
  rc=$?
fi
exit $rc

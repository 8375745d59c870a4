#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The systemd unit the build installs passes `systemd-analyze verify` with nothing to
# say (it exits 0 even for unknown keys: any output fails the test), and its
# hardening keeps `systemd-analyze security --offline` at an exposure of at most
# 4.0. Neither needs systemd running. The unit names the installed kvtierd, which
# this host may not have: the copy checked here names the built one instead (the
# Debian package test verifies the installed unit as it is).
#
#   test_unit_verify.sh UNIT KVTIERD TMPDIR
set -uo pipefail
unit=$1 kvtierd=$2 tmp=$3
mkdir -p "$tmp"
work=$(realpath "$(mktemp -d "$tmp/unit.XXXXXX")")
trap 'rm -rf "$work"' EXIT
pass=0 fail=0
ok() { pass=$((pass + 1)); echo "ok - $*"; }
bad() { fail=$((fail + 1)); echo "FAIL - $*"; }

if ! command -v systemd-analyze >/dev/null; then
  echo "systemd-analyze is missing (Debian: apt install systemd)"
  exit 1
fi
name=$(basename "$unit")
sed -E "s#^(Exec[A-Za-z]*=)[^ ]*/kvtierd #\1$(realpath "$kvtierd") #" "$unit" >"$work/$name"
grep -E '^Exec' "$work/$name"
cd "$work" || exit 1
out=$(systemd-analyze verify "$name" 2>&1)
rc=$?
if [ "$rc" = 0 ] && [ -z "$out" ]; then ok "systemd-analyze verify $name: clean"; else
  bad "systemd-analyze verify $name: rc=$rc: $out"
fi
sec=$(systemd-analyze security --offline=yes "$name" 2>&1)
level=$(sed -n 's/.*Overall exposure level for [^:]*: \([0-9.]*\).*/\1/p' <<<"$sec")
if [ -n "$level" ] && awk -v l="$level" 'BEGIN { exit !(l <= 4.0) }'; then
  ok "systemd-analyze security: exposure $level (<= 4.0)"
else
  bad "systemd-analyze security: exposure '$level': $(tail -5 <<<"$sec")"
fi
echo "$pass passed, $fail failed"
[ "$fail" = 0 ]

#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Every program answers --version (exit 0) with its name, the project version and
# the git revision it was built from: "kvtierd 0.1.0 (git 1a2b3c4d, dirty)". The
# revision is this source tree's HEAD when the tree is a git checkout of its own.
#
#   test_versions.sh SOURCE_DIR PROJECT_VERSION PROGRAM...
set -uo pipefail
src=$1 version=$2
shift 2
pass=0 fail=0
ok() { pass=$((pass + 1)); echo "ok - $*"; }
bad() { fail=$((fail + 1)); echo "FAIL - $*"; }

rev='\(git ([0-9a-f]{8}(, dirty)?|unknown|[^()]+)\)'
head=""
if [ "$(git -C "$src" rev-parse --show-toplevel 2>/dev/null)" = "$(realpath "$src")" ]; then
  head=$(git -C "$src" rev-parse --short=8 HEAD)
fi
first=""
for prog in "$@"; do
  name=$(basename "$prog")
  out=$("$prog" --version 2>&1)
  rc=$?
  if [ "$rc" != 0 ]; then
    bad "$name --version: exit $rc: $out"
    continue
  fi
  if ! grep -Eq "^$name ${version//./\\.} $rev\$" <<<"$out"; then
    bad "$name --version: '$out' is not '$name $version (git REVISION)'"
    continue
  fi
  if [ -n "$head" ] && ! grep -Eq "\(git $head(, dirty)?\)\$" <<<"$out"; then
    bad "$name --version: '$out' does not name this tree's HEAD $head (built before a commit?)"
    continue
  fi
  ok "$name --version: $out"
  # every program of one build reports the same revision
  this=${out#"$name "}
  if [ -z "$first" ]; then first=$this; elif [ "$this" != "$first" ]; then
    bad "$name reports '$this', an earlier program '$first'"
  fi
done
echo "$pass passed, $fail failed"
[ "$fail" = 0 ]

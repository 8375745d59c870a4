#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# cmake/KvtVersion.cmake, the build-time writer of kvt_version_string(), on a git
# repository of its own: the revision follows commits without a reconfigure, a
# changed tracked file says "dirty" (an untracked one does not), an unchanged tree
# leaves the file untouched (nothing recompiles), and a tree without its own .git
# takes -DKVT_GIT_REVISION or says "unknown" (also when it sits inside another
# repository).
#
#   test_version_script.sh CMAKE KVTVERSION_CMAKE TMPDIR
set -uo pipefail
cmake=$1 script=$(realpath "$2") tmp=$3
mkdir -p "$tmp"
work=$(realpath "$(mktemp -d "$tmp/version.XXXXXX")")
trap 'rm -rf "$work"' EXIT
pass=0 fail=0
ok() { pass=$((pass + 1)); echo "ok - $*"; }
bad() { fail=$((fail + 1)); echo "FAIL - $*"; }

out=$work/version.c
gen() { # source dir, extra -D...
  local src=$1
  shift
  "$cmake" -DKVT_SOURCE_DIR="$src" -DKVT_OUT="$out" -DKVT_VERSION=9.8.7 "$@" -P "$script"
}
want() { # name, expected version string
  if grep -qF "return \"9.8.7 ($2)\";" "$out"; then ok "$1: 9.8.7 ($2)"; else
    bad "$1: wanted 9.8.7 ($2), got: $(grep -o 'return "9.8.7 [^"]*"' "$out")"
  fi
}

repo=$work/repo
mkdir -p "$repo" && cd "$repo" || exit 1
git init -q . && git config user.email t@example.com && git config user.name t
echo one >tracked && git add tracked && git commit -qm one
gen "$repo" -DKVT_GIT_REVISION=ignored
want "a clean checkout" "git $(git rev-parse --short=8 HEAD)"

touch -d '2000-01-01' "$out"
gen "$repo"
if [ "$(stat -c %Y "$out")" = "$(date -d '2000-01-01' +%s)" ]; then
  ok "an unchanged tree leaves the file as it was (nothing recompiles)"
else
  bad "an unchanged tree rewrote the file"
fi

echo two >tracked && git commit -qam two
gen "$repo"
want "a new commit, no reconfigure" "git $(git rev-parse --short=8 HEAD)"

echo untracked >other
gen "$repo"
want "an untracked file is not dirty" "git $(git rev-parse --short=8 HEAD)"

echo three >tracked
gen "$repo"
want "a changed tracked file" "git $(git rev-parse --short=8 HEAD), dirty"
git checkout -q tracked

# A release tarball: no .git; then the same tree unpacked inside another repository.
plain=$work/plain
mkdir -p "$plain"
gen "$plain" -DKVT_GIT_REVISION=1a2b3c4d
want "no .git, KVT_GIT_REVISION given" "git 1a2b3c4d"
gen "$plain"
want "no .git, nothing given" "git unknown"
mkdir -p "$repo/vendored"
gen "$repo/vendored" -DKVT_GIT_REVISION=feedf00d
want "inside another repository, KVT_GIT_REVISION given" "git feedf00d"
gen "$repo/vendored" '-DKVT_GIT_REVISION=x"y\z'
want "quotes and backslashes cannot break the C literal" "git xyz"

echo "$pass passed, $fail failed"
[ "$fail" = 0 ]

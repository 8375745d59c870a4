#!/usr/bin/env bash
# The example configurations shipped in packaging/ (the package's kvtierd.yaml and the
# three-host set) pass `kvtierd --check` as written, with only the secret file pointed
# at one the test makes; and a three-host file whose listen address is a wildcard
# fails without its advertise key, naming the key and line (exit 78).
# usage: test_example_configs.sh KVTIERD SOURCE_DIR TMPDIR
set -euo pipefail
kvtierd=$1 src=$2
mkdir -p "$3"
work=$(mktemp -d "$3/example-configs.XXXXXX")
trap 'rm -rf "$work"' EXIT
fails=0
check() { # name, then a command that must succeed
  local name=$1; shift
  if "$@"; then echo "ok - $name"; else echo "FAIL - $name"; fails=$((fails + 1)); fi
}

head -c 32 /dev/urandom | base64 >"$work/secret"
chmod 600 "$work/secret"
examples=("$src/packaging/kvtierd.yaml" "$src"/packaging/examples/three-hosts/*.yaml)
check "three host files" test "${#examples[@]}" -eq 4
for f in "${examples[@]}"; do
  check "kvtierd --check ${f#"$src"/}" \
    "$kvtierd" --check --config "$f" --set "cluster.secret_file=$work/secret"
done

host_a="$src/packaging/examples/three-hosts/host-a.yaml"
grep -v '^  advertise:' "$host_a" >"$work/no-advertise.yaml"
line=$(grep -n '^  listen: 0.0.0.0' "$work/no-advertise.yaml" | cut -d: -f1)
rc=0
out=$("$kvtierd" --check --config "$work/no-advertise.yaml" \
        --set "cluster.secret_file=$work/secret" 2>&1) || rc=$?
check "a wildcard listen address without advertise: exit 78 (got $rc)" test "$rc" -eq 78
check "the error names the line and the key: $out" \
  grep -q "no-advertise.yaml:$line: network.listen: .*network.advertise" <<<"$out"

[ "$fails" -eq 0 ] || { echo "$fails check(s) failed"; exit 1; }
echo "all checks passed"

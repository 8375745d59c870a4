#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# vLLM's own tests of its tier registry, run against kvtier's out-of-tree tier:
# vllm-0.34.0's tests/v1/kv_offload/tiering/test_factory.py, taken from the release's
# source archive on PyPI (the wheel has no tests; fetched once into BUILD/vllm-tests),
# with the general plugins loaded first so that the "kvtier" entry point is in the
# registry every test sees (the CI sentinel then checks that it imports and is a
# SecondaryTierManager with the hit source an out-of-tree tier must declare). The
# other files of that folder test vLLM's own tiers by name.
#   vllm_own_tests.sh PYTHON BUILD_DIR
set -euo pipefail
py=$1 build=$2
dir=$build/vllm-tests
src=$dir/vllm-0.34.0/tests/v1/kv_offload/tiering
if [ ! -f "$src/test_factory.py" ]; then
  mkdir -p "$dir"
  url=$(curl -fsS https://pypi.org/simple/vllm/ | grep -o 'https://[^"#]*/vllm-0\.34\.0\.tar\.gz' | head -1)
  [ -n "$url" ] || { echo "vllm-0.34.0.tar.gz is not on the index" >&2; exit 1; }
  curl -fsS -o "$dir/vllm-0.34.0.tar.gz" "$url"
  tar xzf "$dir/vllm-0.34.0.tar.gz" -C "$dir" vllm-0.34.0/tests/v1/kv_offload/tiering/test_factory.py
  rm -f "$dir/vllm-0.34.0.tar.gz"
fi
run=$dir/run
rm -rf "$run"
mkdir -p "$run"
cp "$src/test_factory.py" "$run/"
cat >"$run/conftest.py" <<'PY'
# Loads vLLM's general plugins (kvtier's entry point registers its tier) before any
# test, and checks that it did: a registry without "kvtier" would test nothing of ours.
from vllm.plugins import load_general_plugins
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

load_general_plugins()
assert "kvtier" in SecondaryTierFactory._registry, sorted(SecondaryTierFactory._registry)
PY
cd "$run"
exec "$py" -m pytest -q -p no:cacheprovider test_factory.py

#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The repository's own rules, checked on every run of the test command:
#   - every C file is formatted as .clang-format says (clang-format 14, Debian 12's);
#   - every source file (C, CMake, shell, Python, packaging scripts) carries the
#     SPDX licence line near its top;
#   - no file points at a document the repository does not contain.
# usage: check_sources.sh SOURCE_DIR
set -euo pipefail
cd "$1"
fails=0
fail() { echo "FAIL - $*"; fails=$((fails + 1)); }

if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  mapfile -t files < <(git ls-files)
else
  mapfile -t files < <(find . -type f -not -path './.git/*' -not -path './build*' | sed 's|^\./||')
fi

mapfile -t cfiles < <(printf '%s\n' "${files[@]}" | grep -E '\.(c|h)$')
bad=$(clang-format --dry-run "${cfiles[@]}" 2>&1 | grep -oE '^[^:]+\.(c|h):' | sort -u || true)
[ -z "$bad" ] && echo "ok - ${#cfiles[@]} C files formatted" || fail "not formatted (clang-format -i):" $bad

missing=()
for f in "${files[@]}"; do
  case "$f" in tests/fuzz/corpus/*) continue ;; esac
  [ -f "$f" ] || continue
  case "$f" in
    *.c | *.h | *.py | *.sh | *.cmake | *CMakeLists.txt | *.toml | *Dockerfile) ;;
    *) head -c2 "$f" | grep -q '^#!' || continue ;;
  esac
  head -n 3 "$f" | grep -q 'SPDX-License-Identifier: Apache-2.0' || missing+=("$f")
done
[ ${#missing[@]} -eq 0 ] && echo "ok - every source file has its SPDX line" ||
  fail "no SPDX line in: ${missing[*]}"

outside=$(printf '%s\n' "${files[@]}" | grep -v '^tests/check_sources.sh$' |
          xargs -d '\n' grep -nE '\.\./shared|DESIGN\.md|spec §' 2>/dev/null || true)
[ -z "$outside" ] && echo "ok - nothing points outside the repository" ||
  fail "points outside the repository: $outside"

[ "$fails" -eq 0 ] || exit 1
echo "all checks passed"

#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# libkvtier-client exports its public API and nothing else: the dynamic symbols it
# defines are exactly the functions <kvtier/client.h> declares (its copies of the wire
# codec and of kvt_common stay local: node/client/libkvtier-client.map), each in
# version KVTIER_0, behind the soname libkvtier-client.so.0.
#
#   test_client_abi.sh LIBRARY HEADER CC
set -uo pipefail
lib=$1 header=$2 cc=$3
pass=0 fail=0
ok() { pass=$((pass + 1)); echo "ok - $*"; }
bad() { fail=$((fail + 1)); echo "FAIL - $*"; }

declared=$("$cc" -E -P -x c "$header" | grep -oE '\bkvtier_[A-Za-z0-9_]+[[:space:]]*\(' |
  tr -d '( \t' | sort -u)
exported=$(nm -D --defined-only "$lib" | awk '$2 != "A" {print $3}' | sort -u)
names=$(cut -d@ -f1 <<<"$exported" | sort -u)
n=$(wc -l <<<"$declared")
if [ "$n" -lt 10 ]; then
  bad "found only $n functions in $header: the header parse is broken"
fi
extra=$(comm -13 <(echo "$declared") <(echo "$names"))
missing=$(comm -23 <(echo "$declared") <(echo "$names"))
if [ -z "$extra" ]; then ok "no symbol beyond <kvtier/client.h> is exported ($n functions)"; else
  bad "exported but not in the header: $(tr '\n' ' ' <<<"$extra")"
fi
if [ -z "$missing" ]; then ok "every function of <kvtier/client.h> is exported"; else
  bad "declared but not exported: $(tr '\n' ' ' <<<"$missing")"
fi
unversioned=$(grep -v '@@KVTIER_0$' <<<"$exported")
if [ -z "$unversioned" ]; then ok "every symbol is in version KVTIER_0"; else
  bad "symbols outside KVTIER_0: $(tr '\n' ' ' <<<"$unversioned")"
fi
soname=$(readelf -d "$lib" | sed -n 's/.*(SONAME).*\[\(.*\)\]/\1/p')
if [ "$soname" = libkvtier-client.so.0 ]; then ok "soname $soname"; else
  bad "soname '$soname', not libkvtier-client.so.0"
fi
echo "$pass passed, $fail failed"
[ "$fail" = 0 ]

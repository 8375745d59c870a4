#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The Debian package on a fresh Debian 12 (ctest deb_install, label "package").
#
#   1. tools/build-deb builds kvtier_<version>_amd64.deb (its own build tree, reruns
#      are incremental); its contents, control fields, conffiles and shlibs are checked.
#   2. A minimal Debian 12 root (debian-root.sh: debootstrap --variant=minbase, plus
#      systemd for sysusers/tmpfiles/systemd-analyze and python3 for the module), made
#      once and kept as a tarball in BUILD_DIR/package-cache/, is unpacked afresh.
#   3. In a chroot, in mount and pid namespaces of its own: `apt-get install
#      ./kvtier_*.deb` resolves the dependencies from the Debian mirror (apt's lists
#      and downloaded packages are cached too; the lists are refreshed once a day);
#      then the user, folders, conffile, unit (systemd-analyze verify of the installed
#      unit; not enabled), the programs' --version and the Python module are checked.
#   4. kvtierd is started as the installed unit's ExecStart, User=, Group= and UMask=
#      say, with the example configuration, in a network namespace of its own (its
#      default ports cannot clash with anything on the host): /healthz answers 200,
#      `kvtier status`, a put and a get by the CLI and a store and load by the Python
#      module, both as a user of the group kvtier (an engine of another user); SIGTERM
#      stops it with exit 0. Then `dpkg --purge` removes it cleanly.
#
# Needs root (chroot, namespaces), debootstrap, zstd and the mirror; exits 77
# (skipped, never passed) without root or debootstrap. Each phase's time is printed.
#
#   test_deb_install.sh SOURCE_DIR BUILD_DIR
# shellcheck disable=SC2016,SC2034 # check() evals its condition, in single quotes
set -uo pipefail

# shellcheck source=tests/package/debian-root.sh
. "$(dirname "$0")/debian-root.sh"

pass=0 fail=0
ok() { pass=$((pass + 1)); echo "ok - $*"; }
bad() { fail=$((fail + 1)); echo "FAIL - $*"; }
check() { if eval "$2"; then ok "$1"; else bad "$1"; fi; }
t_last=$(date +%s.%N)
phase() { # prints the time since the previous phase
  local now
  now=$(date +%s.%N)
  awk -v a="$t_last" -v b="$now" -v w="$1" 'BEGIN { printf "time: %-34s %6.1f s\n", w, b - a }'
  t_last=$now
}

# ---- inside the namespaces: the network phase (a fresh network namespace) ----
daemon_phase() {
  root=$1
  local unit=$root/lib/systemd/system/kvtierd.service
  local cmdline user group umask_ pid rc i code
  ip link set lo up
  cmdline=$(sed -n 's/^ExecStart=//p' "$unit")
  user=$(sed -n 's/^User=//p' "$unit")
  group=$(sed -n 's/^Group=//p' "$unit")
  umask_=$(sed -n 's/^UMask=//p' "$unit")
  echo "starting as the unit does: ${user}:${group} umask ${umask_}: $cmdline"
  # shellcheck disable=SC2086 # ExecStart is a command line
  (umask "$umask_" && exec chroot "$root" env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin \
    setpriv --reuid="$user" --regid="$group" --init-groups -- $cmdline) \
    >"$root/tmp/kvtierd.log" 2>&1 &
  pid=$!
  code=""
  for ((i = 0; i < 600; i++)); do
    code=$(in_root python3 -c 'import urllib.request as u
try:
    print(u.urlopen("http://127.0.0.1:9464/healthz", timeout=1).status)
except Exception as e:
    print(getattr(e, "code", "none"))' 2>/dev/null)
    [ "$code" = 200 ] && break
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.1
  done
  phase "kvtierd start to /healthz"
  check "the installed kvtierd serves: /healthz answers 200 (example config)" '[ "$code" = 200 ]'
  check "kvtier status (the installed CLI) exits 0" \
    'in_root kvtier status --socket /run/kvtier/engine.sock >"$root/tmp/status" 2>&1'
  sed 's/^/    /' "$root/tmp/status"
  check "the engine socket is in /run/kvtier, group kvtier may connect (srw-rw----, engine.socket_mode)" \
    '[ "$(in_root stat -c %A:%U:%G /run/kvtier/engine.sock)" = srw-rw----:kvtier:kvtier ]'
  check "kvtier put/get as an engine user of the group kvtier" \
    'in_root setpriv --reuid=engine --regid=engine --init-groups -- kvtier put c0ffee01 --pattern 7 \
       --socket /run/kvtier/engine.sock >"$root/tmp/put" 2>&1 &&
     in_root setpriv --reuid=engine --regid=engine --init-groups -- kvtier get c0ffee01 --pattern 7 \
       --socket /run/kvtier/engine.sock >"$root/tmp/get" 2>&1 && grep -q "matches pattern 7" "$root/tmp/get"'
  cat >"$root/tmp/engine.py" <<'EOF'
import kvtier

c = kvtier.Client("/run/kvtier/engine.sock", name="pkg-engine", timeout_ms=10000)
assert c.fast is not None, "the package's kvtier._fast did not load"
keys = [kvtier.make_key(b"pkg-%d" % i, 0) for i in range(3)]
c.on_new_request("store")
plan = c.prepare_store("store", keys)
for i, chunk in plan.stores:
    c.row(chunk)[:] = bytes([0x41 + i]) * c.row_bytes
c.complete_store("store", keys)
c.on_schedule_end(new=["store"])
c.on_new_request("load")
for _ in range(200):
    res = c.lookup("load", keys)
    if res == [kvtier.HIT] * 3:
        break
    c.on_schedule_end()
assert res == [kvtier.HIT] * 3, res
for i, chunk in enumerate(c.prepare_load("load", keys)):
    assert bytes(c.row(chunk)) == bytes([0x41 + i]) * c.row_bytes, i
c.complete_load("load", keys)
c.on_request_finished("store")
c.on_request_finished("load")
c.close()
print("stored and loaded 3 chunks of", c.row_bytes, "bytes")
EOF
  check "the Python module (its _fast extension over the installed library) stores and loads as an engine user" \
    'in_root setpriv --reuid=engine --regid=engine --init-groups -- python3 /tmp/engine.py \
       >"$root/tmp/engine.out" 2>&1'
  sed 's/^/    /' "$root/tmp/engine.out"
  kill -TERM "$pid"
  for ((i = 0; i < 200; i++)); do
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.1
  done
  if kill -0 "$pid" 2>/dev/null; then
    kill -KILL "$pid"
    bad "kvtierd still runs 20 s after SIGTERM"
  fi
  wait "$pid"
  rc=$?
  check "SIGTERM: kvtierd exits 0" '[ "$rc" = 0 ]'
  if [ "$fail" != 0 ]; then
    echo "---- kvtierd's log"
    tail -30 "$root/tmp/kvtierd.log"
  fi
  phase "daemon checks and stop"
  echo "$pass passed, $fail failed"
  [ "$fail" = 0 ]
}

# ---- inside the namespaces: install and check ----
inside() {
  root=$1 deb=$2 cache=$3
  chroot_setup "$root" "$cache" || {
    bad "preparing the chroot"
    return 1
  }
  phase "apt lists"
  cp "$deb" "$root/tmp/"
  if in_root apt-get install -y -q --no-install-recommends \
    "/tmp/$(basename "$deb")" >"$root/tmp/apt.log" 2>&1; then
    ok "apt-get install ./$(basename "$deb") on a fresh Debian 12 ($(grep -c '^Unpacking' \
      "$root/tmp/apt.log") packages unpacked)"
  else
    bad "apt-get install: $(tail -20 "$root/tmp/apt.log")"
    return 1
  fi
  phase "apt-get install"

  check "user kvtier: a system user with group kvtier" \
    '[ "$(in_root id -gn kvtier)" = kvtier ] && [ "$(in_root id -u kvtier)" -lt 1000 ]'
  check "/run/kvtier 0750 kvtier:kvtier (tmpfiles.d)" \
    '[ "$(in_root stat -c %a:%U:%G /run/kvtier)" = 750:kvtier:kvtier ]'
  check "/var/lib/kvtier 0700 kvtier:kvtier (tmpfiles.d)" \
    '[ "$(in_root stat -c %a:%U:%G /var/lib/kvtier)" = 700:kvtier:kvtier ]'
  check "/etc/kvtier/kvtierd.yaml is a conffile of kvtier" \
    'grep -q "^ /etc/kvtier/kvtierd.yaml " <<<"$(in_root dpkg-query -W -f="\${Conffiles}\n" kvtier)"'
  check "kvtierd.service is installed, not enabled" \
    '[ "$(in_root systemctl is-enabled kvtierd.service 2>&1)" = disabled ]'
  local verify vrc
  verify=$(in_root systemd-analyze verify kvtierd.service 2>&1)
  vrc=$?
  check "systemd-analyze verify of the installed unit: clean" '[ $vrc = 0 ] && [ -z "$verify" ]'
  [ -n "$verify" ] && echo "$verify"
  check "kvtier --version" 'grep -Eq "^kvtier [0-9.]+ \(git .+\)$" <<<"$(in_root kvtier --version)"'
  check "kvtierd --version" 'grep -Eq "^kvtierd [0-9.]+ \(git .+\)$" <<<"$(in_root kvtierd --version)"'
  check "kvtierd --check accepts the example configuration (as kvtier)" \
    'in_root setpriv --reuid=kvtier --regid=kvtier --init-groups -- \
       kvtierd --check --config /etc/kvtier/kvtierd.yaml'
  check "the library is in ld.so's cache (ldconfig trigger)" \
    'grep -q "libkvtier-client.so.0 " <<<"$(in_root ldconfig -p)"'
  check "pkg-config finds kvtier-client" \
    '[ ! -x "$root/usr/bin/pkg-config" ] || in_root pkg-config --exists kvtier-client'
  in_root useradd --create-home --groups kvtier engine
  phase "installed-package checks"

  unshare --net "$0" --daemon-phase "$root" || fail=$((fail + 1))

  check "dpkg --purge kvtier: removes it, its conffile and its state" \
    'in_root dpkg --purge kvtier >"$root/tmp/purge.log" 2>&1 &&
     [ ! -e "$root/etc/kvtier/kvtierd.yaml" ] && [ ! -e "$root/var/lib/kvtier" ] &&
     [ ! -e "$root/usr/sbin/kvtierd" ]'
  phase "purge"
  echo "$pass passed, $fail failed (install phase; the daemon phase counted as one)"
  [ "$fail" = 0 ]
}

case "${1:-}" in
--inside)
  shift
  inside "$@"
  exit
  ;;
--daemon-phase)
  shift
  daemon_phase "$@"
  exit
  ;;
esac

# ---- outside: build, check the .deb, prepare the root, enter the namespaces ----
src=$1 build=$2
cache=$build/package-cache
if [ "$(id -u)" != 0 ]; then
  echo "SKIP: needs root (chroot, mount and network namespaces)"
  exit 77
fi
need_tools debootstrap zstd unshare
mkdir -p "$cache" "$build/test-tmp"

build_deb "$src" "$build"
phase "tools/build-deb"
echo "package: $deb ($(stat -c %s "$deb") bytes)"
dpkg-deb -c "$deb" | awk '{ $2 = $3 = $4 = $5 = ""; print "    " $0 }' | tr -s ' '
files=$(dpkg-deb -c "$deb" | awk '{print $6}')
for f in ./usr/sbin/kvtierd ./usr/bin/kvtier ./usr/bin/kvtier-load ./usr/bin/kvtier-bench \
  ./usr/lib/x86_64-linux-gnu/libkvtier-client.so.0.1.0 ./usr/lib/x86_64-linux-gnu/libkvtier-client.so.0 \
  ./usr/lib/x86_64-linux-gnu/libkvtier-client.so ./usr/include/kvtier/client.h \
  ./usr/lib/x86_64-linux-gnu/pkgconfig/kvtier-client.pc ./usr/lib/python3/dist-packages/kvtier/__init__.py ./usr/lib/python3/dist-packages/kvtier/vllm.py \
  ./etc/kvtier/kvtierd.yaml ./lib/systemd/system/kvtierd.service ./usr/lib/tmpfiles.d/kvtier.conf \
  ./usr/lib/sysusers.d/kvtier.conf ./usr/share/doc/kvtier/copyright; do
  grep -qxF "$f" <<<"$files" || bad "the package lacks $f"
done
ok "the package holds the daemon, tools, library, header, pc, module, config, unit"
stray=$(grep -vE '^\./(etc/kvtier/|lib/systemd/system/|usr/(bin|sbin|include|lib|share)/|$|etc/$|lib/$|lib/systemd/$|usr/$)' <<<"$files")
check "nothing outside /etc/kvtier, the unit folder and /usr" '[ -z "$stray" ]'
depends=$(dpkg-deb -f "$deb" Depends)
echo "Depends: $depends"
has_depends() {
  for p in libc6 libucx0 libyaml-0-2 libxxhash0 libsystemd0 liburing2; do
    grep -qw "$p" <<<"$depends" || return 1
  done
}
check "Depends come from dpkg-shlibdeps (libucx0, libyaml-0-2, libsystemd0 ...)" \
  has_depends
ctl=$(mktemp -d "$build/test-tmp/debctl.XXXXXX")
dpkg-deb -e "$deb" "$ctl"
check "conffiles: /etc/kvtier/kvtierd.yaml" '[ "$(cat "$ctl/conffiles")" = /etc/kvtier/kvtierd.yaml ]'
check "shlibs: libkvtier-client 0" 'grep -q "^libkvtier-client 0 kvtier " "$ctl/shlibs"'
check "ldconfig trigger" 'grep -q ldconfig "$ctl/triggers"'
rm -rf "$ctl"
phase "package contents"

first=$([ -f "$cache/debian12-root.tar.zst" ] || echo yes)
if ! tarball=$(debian_root_tarball "$cache"); then
  echo "FAIL - no Debian 12 root"
  exit 1
fi
[ -n "$first" ] && phase "debootstrap (first run only)"

work=$(realpath "$(mktemp -d "$build/test-tmp/deb.XXXXXX")")
trap 'rm -rf "$work"' EXIT
mkdir "$work/root"
tar -C "$work/root" --numeric-owner --zstd -xf "$tarball"
phase "unpack the cached root"
unshare --mount --pid --fork --propagation private "$0" --inside "$work/root" "$deb" "$cache"
rc=$?
[ "$rc" = 0 ] || fail=$((fail + 1))
echo "$pass passed, $fail failed (package checks; the chroot phases counted as one)"
[ "$fail" = 0 ]

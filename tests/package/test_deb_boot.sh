#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The Debian package under a real systemd (ctest deb_boot, label "package"): a
# Debian 12 guest in qemu, booted with Debian's own kernel and initramfs and systemd
# as PID 1, runs kvtierd.service as installed, hardening and all.
#
#   1. tools/build-deb (incremental); the cached Debian 12 root (debian-root.sh) plus
#      linux-image-amd64, itself cached as a second tarball (made once, ~1.5 min).
#   2. A fresh copy gets the package with apt (in a chroot), a test unit that runs
#      boot-checks.sh once multi-user is reached, and a drop-in WatchdogSec=3s; then
#      mkfs.ext4 -d makes it a disk image (no loop device needed).
#   3. qemu (TCG: no KVM here) boots it; boot-checks.sh starts kvtierd.service
#      (Type=notify, User=kvtier, ProtectSystem=strict ...) with the example
#      configuration sized for the guest's memory, checks it serves and is sandboxed,
#      reloads it (a good file, then a bad one), stops it with SIGSTOP to see the
#      watchdog restart it, stops it, and powers off. Its ok/FAIL lines are read back
#      from the image with debugfs.
#
# Needs root, debootstrap, zstd, qemu-system-x86_64, mkfs.ext4/debugfs (e2fsprogs)
# and the Debian mirror; exits 77 (skipped) without them.
#
#   test_deb_boot.sh SOURCE_DIR BUILD_DIR
# shellcheck disable=SC2016 # check() evals its condition, in single quotes
set -uo pipefail

here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=tests/package/debian-root.sh
. "$here/debian-root.sh"
boot_recipe="linux-image-amd64 masked-gettys v1"

t_last=$(date +%s.%N)
phase() {
  local now
  now=$(date +%s.%N)
  awk -v a="$t_last" -v b="$now" -v w="$1" 'BEGIN { printf "time: %-34s %6.1f s\n", w, b - a }'
  t_last=$now
}

# ---- inside a mount namespace: apt-get install in the chroot ----
case "${1:-}" in
--install) # ROOT CACHE PACKAGES...
  shift
  root=$1 cache=$2
  shift 2
  chroot_setup "$root" "$cache" || exit 1
  in_root apt-get install -y -q --no-install-recommends "$@" >"$root/tmp/apt.log" 2>&1 || {
    tail -20 "$root/tmp/apt.log"
    exit 1
  }
  exit 0
  ;;
esac

src=$1 build=$2
cache=$build/package-cache
if [ "$(id -u)" != 0 ]; then
  echo "SKIP: needs root (chroot, mount namespaces)"
  exit 77
fi
need_tools debootstrap zstd unshare qemu-system-x86_64 mkfs.ext4 debugfs
mkdir -p "$cache" "$build/test-tmp"

build_deb "$src" "$build"
phase "tools/build-deb"

work=$(realpath "$(mktemp -d "$build/test-tmp/boot.XXXXXX")")
trap 'rm -rf "$work"' EXIT

# ---- the bootable root: the base root plus Debian's kernel (cached) ----
boot_tarball=$cache/debian12-boot.tar.zst
if ! base=$(debian_root_tarball "$cache"); then
  echo "FAIL - no Debian 12 root"
  exit 1
fi
if [ ! -f "$boot_tarball" ] ||
  [ "$(cat "$cache/debian12-boot.recipe" 2>/dev/null)" != "$root_recipe $boot_recipe" ]; then
  echo "adding Debian's kernel to the root (once; cached in $cache)"
  rm -rf "$cache/boot.new" "$boot_tarball"
  mkdir "$cache/boot.new"
  tar -C "$cache/boot.new" --numeric-owner --zstd -xf "$base"
  if ! unshare --mount --pid --fork --propagation private "$0" --install "$cache/boot.new" \
    "$cache" linux-image-amd64; then
    echo "FAIL - installing linux-image-amd64 in the root"
    exit 1
  fi
  r=$cache/boot.new
  echo "/dev/vda / ext4 defaults 0 1" >"$r/etc/fstab"
  echo kvtboot >"$r/etc/hostname"
  # The console is the test's log; no login prompts on it.
  ln -sf /dev/null "$r/etc/systemd/system/serial-getty@ttyS0.service"
  ln -sf /dev/null "$r/etc/systemd/system/getty@tty1.service"
  rm -f "$r/var/cache/apt/archives/"*.deb
  tar -C "$r" --numeric-owner --zstd -cf "$boot_tarball" . &&
    echo "$root_recipe $boot_recipe" >"$cache/debian12-boot.recipe"
  rm -rf "$r"
  phase "root with a kernel (first run only)"
fi

root=$work/root
mkdir "$root"
tar -C "$root" --numeric-owner --zstd -xf "$boot_tarball"
cp "$deb" "$root/tmp/"
if ! unshare --mount --pid --fork --propagation private "$0" --install "$root" "$cache" \
  "/tmp/$(basename "$deb")"; then
  echo "FAIL - apt-get install of the package in the guest's root"
  exit 1
fi
phase "unpack, apt-get install"

# The checks run by a unit of their own once the guest is up.
install -m 0755 "$here/boot-checks.sh" "$root/usr/local/sbin/kvt-boot-checks"
cat >"$root/etc/systemd/system/kvt-boot-checks.service" <<'EOF'
[Unit]
Description=kvtier package checks under systemd
After=multi-user.target

[Service]
Type=oneshot
ExecStart=/usr/local/sbin/kvt-boot-checks
ExecStopPost=/bin/systemctl --no-block poweroff

[Install]
WantedBy=multi-user.target
EOF
ln -s /etc/systemd/system/kvt-boot-checks.service \
  "$root/etc/systemd/system/multi-user.target.wants/kvt-boot-checks.service"
kver=$(basename "$(ls "$root"/boot/vmlinuz-*)" | sed 's/^vmlinuz-//')
img=$work/disk.img
if ! mkfs.ext4 -q -d "$root" "$img" 3G >"$work/mkfs.log" 2>&1; then
  echo "FAIL - mkfs.ext4 -d: $(cat "$work/mkfs.log")"
  exit 1
fi
cp "$root/boot/vmlinuz-$kver" "$root/boot/initrd.img-$kver" "$work/"
rm -rf "$root"
phase "disk image"

# TCG with 2 vCPUs at most (more than the host has is slower); 2 GiB: /run is 10%.
cpus=$(($(nproc) < 2 ? 1 : 2))
timeout "${KVT_BOOT_TIMEOUT:-480}" qemu-system-x86_64 -accel tcg,thread=multi -cpu max \
  -m 2G -smp "$cpus" -nographic -no-reboot -nic none \
  -kernel "$work/vmlinuz-$kver" -initrd "$work/initrd.img-$kver" \
  -append "root=/dev/vda rw console=ttyS0 init=/lib/systemd/systemd panic=-1" \
  -drive "file=$img,if=virtio,format=raw" >"$work/serial.log" 2>&1
qrc=$?
phase "boot, checks, power off (qemu)"

debugfs -R "cat /var/log/kvt-boot-checks.log" "$img" >"$work/checks.log" 2>/dev/null
cat "$work/checks.log"
pass=$(grep -c '^ok - ' "$work/checks.log")
fail=$(grep -c '^FAIL - ' "$work/checks.log")
if [ "$qrc" != 0 ]; then
  echo "FAIL - qemu exited $qrc (124: timed out); the guest's console:"
  tail -40 "$work/serial.log"
  fail=$((fail + 1))
elif ! grep -q '^checks done$' "$work/checks.log"; then
  echo "FAIL - the checks did not finish; the guest's console:"
  tail -40 "$work/serial.log"
  fail=$((fail + 1))
fi
echo "$pass passed, $fail failed"
[ "$fail" = 0 ] && [ "$pass" -gt 0 ]

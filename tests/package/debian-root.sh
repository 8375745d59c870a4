# SPDX-License-Identifier: Apache-2.0
# shellcheck shell=bash
# Debian 12 roots for the package tests (sourced by test_deb_install.sh and
# test_deb_boot.sh; needs root).
#
# One minimal root (debootstrap --variant=minbase with systemd, for sysusers,
# tmpfiles and systemd-analyze, and python3, for the module) is made once and kept as
# a zstd tarball in the cache folder, keyed by its recipe; every run unpacks a fresh
# copy. apt's lists and downloaded packages live in the cache too, bind-mounted into
# the chroot, so a rerun downloads nothing; the lists are refreshed once a day.
#
# Functions: debian_root_tarball CACHE [NAME INCLUDE] (prints the tarball, making it if
# needed; NAME [debian12-root] names it in the cache, INCLUDE [systemd,python3] is
# debootstrap's --include, "" for a bare minbase root such as the debian:12 image),
# chroot_setup ROOT CACHE (mounts for a chroot; call it in a private mount namespace:
# `unshare --mount --pid --fork --propagation private`), in_root CMD... (runs CMD in
# $root with a clean environment), need_tools TOOL... (exits 77, which ctest counts
# as a failure, when one is missing), build_deb SRC BUILD (sets $deb to the package
# tools/build-deb makes, or fails the test).

mirror=${KVT_DEBIAN_MIRROR:-http://deb.debian.org/debian}
# What the cached root is made of: a change here makes a new root.
root_recipe="bookworm minbase systemd,python3 $mirror v1"

need_tools() {
  local tool
  for tool in "$@"; do
    if ! command -v "$tool" >/dev/null; then
      echo "FAIL - $tool is missing (tools/install-deps installs it)"
      exit 77
    fi
  done
}

build_deb() {
  deb=$(KVT_JOBS=$(nproc) "$1/tools/build-deb" "$2/package-deb" | tail -n 1)
  if [ ! -f "$deb" ]; then
    echo "FAIL - tools/build-deb made no package"
    exit 1
  fi
}

in_root() {
  chroot "$root" env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8 \
    DEBIAN_FRONTEND=noninteractive "$@"
}

debian_root_tarball() {
  local cache=$1 name=${2:-debian12-root} include=${3-systemd,python3}
  local tarball=$cache/$name.tar.zst security recipe=$root_recipe
  [ "$include" = systemd,python3 ] || recipe="bookworm minbase ${include:-(none)} $mirror v1"
  mkdir -p "$cache"
  if [ -f "$tarball" ] && [ "$(cat "$cache/$name.recipe" 2>/dev/null)" = "$recipe" ]; then
    echo "$tarball"
    return 0
  fi
  echo "making the Debian 12 root $name (once; cached in $cache)" >&2
  rm -rf "$cache/$name.new" "$tarball"
  if ! debootstrap --variant=minbase ${include:+--include="$include"} bookworm "$cache/$name.new" \
    "$mirror" >"$cache/debootstrap.log" 2>&1; then
    echo "debootstrap failed: $(tail -5 "$cache/debootstrap.log")" >&2
    rm -rf "$cache/$name.new"
    return 1
  fi
  security=${mirror%/debian}/debian-security
  cat >"$cache/$name.new/etc/apt/sources.list" <<EOF
deb $mirror bookworm main
deb $mirror bookworm-updates main
deb $security bookworm-security main
EOF
  # as on the host: a clock ahead of the mirror's Release files must not stop apt
  printf 'Acquire::Check-Valid-Until "false";\nAcquire::Check-Date "false";\n' \
    >"$cache/$name.new/etc/apt/apt.conf.d/99kvtier-test"
  rm -rf "$cache/$name.new/var/cache/apt/archives/"*.deb "$cache/$name.new/var/lib/apt/lists/"*
  tar -C "$cache/$name.new" --numeric-owner --zstd -cf "$tarball" . || return 1
  echo "$recipe" >"$cache/$name.recipe"
  rm -rf "$cache/$name.new" "$cache/apt-lists.stamp"
  echo "$tarball"
}

chroot_setup() {
  root=$1
  local cache=$2
  local lists=$cache/apt-lists archives=$cache/apt-archives stamp=$cache/apt-lists.stamp
  mount -t proc proc "$root/proc"
  mount --rbind /dev "$root/dev"
  mount -t tmpfs -o mode=1777 tmpfs "$root/dev/shm" # regions stay off the host's
  mount --rbind /sys "$root/sys"
  mount -t tmpfs -o mode=755 tmpfs "$root/run"
  mkdir -p "$lists/partial" "$archives/partial"
  mount --bind "$lists" "$root/var/lib/apt/lists"
  mount --bind "$archives" "$root/var/cache/apt/archives"
  cp /etc/resolv.conf "$root/etc/resolv.conf"
  if [ ! -f "$stamp" ] || [ -n "$(find "$stamp" -mmin +1440)" ]; then
    if in_root apt-get update -qq; then
      touch "$stamp"
    elif [ -f "$stamp" ]; then
      echo "note: apt-get update failed; using the lists of $(date -r "$stamp")"
    else
      echo "apt-get update in the chroot failed (the Debian mirror $mirror)" >&2
      return 1
    fi
  fi
}

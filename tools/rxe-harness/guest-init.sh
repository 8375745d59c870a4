#!/bin/busybox sh
# SPDX-License-Identifier: Apache-2.0
# kvtier-rxe guest init: PID 1 of every qemu guest that tools/rxe-harness/kvtier-rxe
# boots. It is packed into the initramfs next to a static busybox and the kernel
# modules listed in /modules/order (virtio, 9p, crc32_generic, the rdma_rxe and
# rdma_ucm chains, virtio_net, in that order: rdma_rxe fails to init its crc32
# algorithm when crc32_generic is not loaded first).
#
# What it does: loads the modules, mounts the host's root (9p tag "hostroot",
# read-only) on /host and this guest's writable results folder (9p tag "results")
# at the same path inside /host, gives eth0 its static address, adds the soft-RoCE
# device rxe0 on it, reports "ready", waits for the harness's "go" (all guests
# ready), then chroots into /host and runs the job's command with KVT_ROLE,
# KVT_ADDR, KVT_PEERS and KVT_RESULTS set. Exit code and timings go to files in the
# results folder; then the guest powers off. Any failure is written to
# results/boot_error (when that folder is mounted) and to the console, and the
# guest powers off at once so the harness sees it fail instead of waiting.

/bin/busybox mkdir -p /bin /proc /sys /dev /host /tmp
/bin/busybox --install -s /bin
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev

R=""
KEEP=""
for a in $(cat /proc/cmdline); do
  case "$a" in
    kvt.results=*) R="${a#kvt.results=}" ;;
    kvt.keep=*) KEEP="${a#kvt.keep=}" ;;
  esac
done

halt_now() {
  sync
  poweroff -f
  sleep 5
  echo o >/proc/sysrq-trigger
}

die() {
  echo "kvt-init: FAILED: $*"
  if [ -n "$R" ] && [ -f "/host$R/job.env" ]; then
    echo "$*" >"/host$R/boot_error"
  fi
  halt_now
}

uptime_s() { cut -d' ' -f1 /proc/uptime; }

# Write a small file atomically (the host polls for it).
put() { echo "$2" >"/host$R/$1.tmp" && mv "/host$R/$1.tmp" "/host$R/$1"; }

echo "kvt-init: kernel up at $(uptime_s) s"
[ -n "$R" ] || die "no kvt.results= on the kernel command line"

while read -r m; do
  [ -n "$m" ] || continue
  insmod "/modules/$m" || die "insmod $m"
done </modules/order

n=0
until mount -t 9p -o trans=virtio,version=9p2000.L,msize=524288,ro hostroot /host; do
  n=$((n + 1))
  [ $n -lt 10 ] || die "cannot mount the host root (9p tag hostroot)"
  sleep 0.2
done
# The host's root as it is, before our tmpfs mounts hide its /tmp, /run and /dev/shm:
# the paths in kvt.keep (the repository or working folder under one of those) are
# bound back from it afterwards.
mkdir -p /hostroot
mount -o bind /host /hostroot || die "bind the host root"
mount -t proc proc /host/proc || die "mount /host/proc"
mount -t sysfs sysfs /host/sys || die "mount /host/sys"
mount -t devtmpfs devtmpfs /host/dev || die "mount /host/dev"
mkdir -p /host/dev/shm /host/dev/pts
mount -t tmpfs -o mode=1777 tmpfs /host/dev/shm || die "mount /host/dev/shm"
mount -t devpts devpts /host/dev/pts || true
mount -t tmpfs -o mode=1777 tmpfs /host/tmp || die "mount /host/tmp"
mount -t tmpfs -o mode=755 tmpfs /host/run || die "mount /host/run"
for p in $(echo "$KEEP" | tr ',' ' '); do
  mkdir -p "/host$p" && mount -o bind "/hostroot$p" "/host$p" || die "bind $p back from the host"
done
# After the tmpfs mounts, so that a results folder under /tmp or /run is not hidden
# (the mount point is then created in the guest's tmpfs).
mkdir -p "/host$R" 2>/dev/null
mount -t 9p -o trans=virtio,version=9p2000.L,msize=524288 results "/host$R" ||
  die "cannot mount the results folder $R (9p tag results)"
[ -f "/host$R/job.env" ] || die "no job.env in $R"
. "/host$R/job.env"

ip link set lo up
ip link set eth0 up || die "no eth0 (virtio_net)"
ip addr add "$KVT_ADDR/24" dev eth0 || die "ip addr add $KVT_ADDR/24 dev eth0"

chroot /host rdma link add rxe0 type rxe netdev eth0 || die "rdma link add rxe0 type rxe netdev eth0"
n=0
until grep -q ACTIVE /sys/class/infiniband/rxe0/ports/1/state 2>/dev/null; do
  n=$((n + 1))
  [ $n -lt 150 ] || die "rxe0 port 1 not ACTIVE after 30 s"
  sleep 0.2
done
echo "kvt-init: rxe0 ACTIVE on eth0 $KVT_ADDR at $(uptime_s) s"
put ready "$(uptime_s)" || die "cannot write to the results folder $R"

# Barrier: the harness creates "go" in every guest's results folder (9p without
# caching, so the guest sees it at once) when all guests are ready.
n=0
until [ -e "/host$R/go" ]; do
  n=$((n + 1))
  [ $n -lt $((KVT_BARRIER_TIMEOUT * 5)) ] || die "no go from the harness after $KVT_BARRIER_TIMEOUT s"
  sleep 0.2
done

export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export HOME=/root TERM=dumb TMPDIR=/tmp
export KVT_ROLE KVT_ADDR KVT_PEERS KVT_RESULTS KVT_GUESTS KVT_NETDEV=eth0 KVT_RDMA_DEV=rxe0
t0=$(uptime_s)
echo "kvt-init: running the job (role $KVT_ROLE) at $t0 s"
chroot /host /bin/sh -c 'cd "$KVT_CWD" || exit 125; exec /bin/sh -c "$KVT_CMD"' \
  >"/host$R/output.log" 2>&1 </dev/null
rc=$?
t1=$(uptime_s)
echo "kvt-init: job exited $rc at $t1 s"
put duration "$(awk "BEGIN { print $t1 - $t0 }")"
put exit_code "$rc"
halt_now

#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The runtime image's root filesystem, started the way compose starts its containers,
# without a container engine (ctest docker_rootfs, label "docker"; docker/README.md
# says what this covers and what only a Docker host can).
#
#  1. tools/build-deb makes the package (incremental; the tree deb_install uses).
#  2. The image's root: a Debian 12 minbase root (debootstrap, the local equivalent of
#     debian:12, made once and cached in BUILD_DIR/package-cache/), then what the
#     Dockerfile's runtime stage does: docker/install-runtime.sh with the package, the
#     entrypoint at /usr/local/bin/kvtier-entrypoint.
#  3. `docker compose --profile engine config --format json`, run from the repository
#     root, resolves the services; compose_plan.py turns each into what Docker would
#     run (the Dockerfile's ENV, ENTRYPOINT and CMD; compose's environment, command,
#     user, group_add, cap_add, ipc, network, shm_size, ulimits, volumes, secrets,
#     healthcheck). The test runs those, not a copy of them.
#  4. In network, mount and pid namespaces of its own (the "Docker host"): a bridge on
#     the compose network's subnet; each service a "container": its own network
#     namespace on a veth with its compose address (or none), its own mount, pid, uts
#     and ipc namespaces (or the ipc namespace of the service it names), an overlay of
#     the image root, /proc, a read-only /sys, a minimal /dev, /dev/shm a tmpfs of
#     shm_size, its named volumes (tmpfs when the volume's driver_opts say so; shared
#     between the containers that name them, read-only where compose says :ro), the
#     secret bind-mounted read-only in /run/secrets/, Docker's default capabilities
#     plus cap_add, memlock from ulimits, the user and groups, the environment, and
#     tini as PID 1 running the entrypoint.
#  5. Checks: a node without its secret stops with 78; node0..node2 start, compose's
#     healthcheck passes in each and /healthz answers 200 from the bridge (what a
#     published port forwards to); kvtier_peers_up is 3 everywhere; kvtierd runs as
#     kvtier with no capabilities and no_new_privs; the socket and folders have their
#     modes and the secret's copy is not in the shared volume; the engine service (no
#     network, node0's IPC namespace, node0-run read-only, user nobody + group_add)
#     runs its compose command (kvtier-load) to exit 0, sees the socket and nothing of
#     the node's secret, cannot write the volume or open the region by name; the
#     Python module stores chunks in one engine container and a second one loads them
#     byte for byte; nobody without the group cannot connect; SIGTERM to each node's
#     PID 1 ends it with exit 0, after which its healthcheck fails.
#
# KVT_DOCKER_IMAGE_ROOT=DIR: steps 1-2 skipped, DIR is the image's root (an image
# built from docker/Dockerfile and mounted, e.g. with `buildah mount`).
#
# Needs root, debootstrap, zstd, unshare, nsenter, the Debian mirror (first run) and
# `docker compose` (the CLI plugin; no engine: tools/install-deps installs it); exits
# 77 (skipped, never passed) without them. Each phase's time is printed.
#
#   test_rootfs.sh SOURCE_DIR BUILD_DIR
# check() evals its condition, in single quotes; plans are sourced from the work folder
# shellcheck disable=SC2016,SC2034,SC1090,SC1091,SC2153
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=tests/package/debian-root.sh
. "$here/../package/debian-root.sh"

pass=0 fail=0
ok() { pass=$((pass + 1)); echo "ok - $*"; }
bad() { fail=$((fail + 1)); echo "FAIL - $*"; }
check() { if eval "$2"; then ok "$1"; else bad "$1"; fi; }
t_last=$(date +%s.%N)
phase() { # prints the time since the previous phase
  local now
  now=$(date +%s.%N)
  awk -v a="$t_last" -v b="$now" -v w="$1" 'BEGIN { printf "time: %-40s %6.1f s\n", w, b - a }'
  t_last=$now
}

# ---- the image's root (inside a mount namespace of its own) ----
build_image() { # root deb cache src uid gid
  local root=$1 deb=$2 cache=$3 src=$4
  chroot_setup "$root" "$cache" || return 1
  # A Dockerfile's RUN sees the image's /run, not a tmpfs: what it makes there stays.
  umount "$root/run"
  cp "$deb" "$root/tmp/kvtier.deb"
  cp "$src/docker/install-runtime.sh" "$root/tmp/install-runtime.sh"
  in_root env KVT_UID="$5" KVT_GID="$6" KVT_APT_UPDATE=0 KVT_APT_CLEAN=0 \
    sh /tmp/install-runtime.sh /tmp/kvtier.deb >"$root/../install-runtime.log" 2>&1 || {
    tail -20 "$root/../install-runtime.log"
    return 1
  }
  rm -f "$root/tmp/kvtier.deb" "$root/tmp/install-runtime.sh" "$root/etc/resolv.conf"
  install -m 0755 "$src/docker/entrypoint.sh" "$root/usr/local/bin/kvtier-entrypoint"
}

# ---- one container's own namespaces: the mounts, then tini as PID 1 ----
container() { # plan root shm no-secret -- [command...]
  local plan=$1 r=$2 shm=$3 nosecret=$4 n v s src tgt mode uopts=() g
  shift 5
  # shellcheck source=/dev/null
  . "$plan"
  [ $# -eq 0 ] || CMDV=("$@")
  mount -t proc proc "$r/proc"
  mount -t sysfs -o ro,nosuid,nodev,noexec sysfs "$r/sys"
  mount -t tmpfs -o nosuid,mode=755,size=64k tmpfs "$r/dev"
  for n in null zero full random urandom tty; do
    touch "$r/dev/$n"
    mount --bind "/dev/$n" "$r/dev/$n"
  done
  ln -s /proc/self/fd "$r/dev/fd"
  ln -s /proc/self/fd/0 "$r/dev/stdin"
  ln -s /proc/self/fd/1 "$r/dev/stdout"
  ln -s /proc/self/fd/2 "$r/dev/stderr"
  mkdir -p "$r/dev/shm" "$r/dev/pts"
  mount --bind "$shm" "$r/dev/shm"
  for v in "${VOLUMES[@]}"; do
    IFS=: read -r src tgt mode <<<"$v"
    mkdir -p "$r$tgt"
    mount --bind "$work/vol/$src" "$r$tgt"
    [ "$mode" = rw ] || mount -o remount,bind,ro "$r$tgt"
  done
  if [ "$nosecret" = 0 ]; then
    for s in "${SECRETS[@]}"; do
      src=${s%%:*} tgt=${s#*:}
      mkdir -p "$(dirname "$r$tgt")"
      touch "$r$tgt"
      mount --bind "$src" "$r$tgt"
      mount -o remount,bind,ro "$r$tgt"
    done
  fi
  hostname "$HOSTNAME_"
  echo "$HOSTNAME_" >"$r/etc/hostname"
  printf '127.0.0.1\tlocalhost\n%s\t%s\n' "${ADDR:-127.0.1.1}" "$HOSTNAME_" >"$r/etc/hosts"
  if [ -n "$MEMLOCK" ] && ! ulimit -l "$MEMLOCK" 2>/dev/null; then
    # raising a hard limit takes CAP_SYS_RESOURCE, which this machine may not give
    echo "note: memlock $MEMLOCK refused here (CAP_SYS_RESOURCE); kept $(ulimit -Hl) KiB"
  fi
  if [ -n "$USER_" ] && [ "${USER_%%:*}" != root ] && [ "${USER_%%:*}" != 0 ]; then
    uopts=(--reuid="${USER_%%:*}" --regid="${USER_#*:}")
  fi
  if [ ${#GROUP_ADD[@]} -gt 0 ]; then
    g=$(IFS=,; echo "${GROUP_ADD[*]}")
    uopts+=(--groups="$g")
  else
    uopts+=(--clear-groups)
  fi
  exec chroot "$r" /usr/bin/setpriv "${uopts[@]}" --bounding-set=-all,"$CAPS" --inh-caps=-all \
    -- /usr/bin/env -i "${ENVS[@]}" "${ENTRY[@]}" "${CMDV[@]}"
}

# ---- the "Docker host": a bridge, containers, checks (its own namespaces) ----
declare -A PID1 BG
pv() { # service expr: a value of the service's plan ("ADDR", "CMDV[*]")
  (
    . "$work/plan/$1.sh"
    eval "echo \"\${$2}\""
  )
}
in_ct() { # name cmd...: `docker exec`, with the container's environment
  local name=$1
  shift
  (
    # shellcheck source=/dev/null
    . "$work/plan/${SVC[$name]}.sh"
    nsenter -t "${PID1[$name]}" -m -u -i -n -p -r -w -- /usr/bin/env -i "${ENVS[@]}" "$@"
  )
}

launch() { # name service no-secret [command...]: starts a container in the background
  local name=$1 svc=$2 nosecret=$3 c=$work/c/$1 v vn size src tgt mode shm i
  local pre=() flags=(--mount --pid --uts --fork --propagation private)
  shift 3
  SVC[$name]=$svc
  mkdir -p "$work/c"
  (
    # shellcheck source=/dev/null
    . "$work/plan/$svc.sh"
    echo "IPC_=$IPC NET_=$NETWORK_MODE ADDR_=$ADDR SHM_=$SHM_SIZE"
    for v in "${VOLUME_TMPFS[@]}"; do echo "TMPFS $v"; done
    for v in "${VOLUMES[@]}"; do echo "VOL $v"; done
  ) >"$c.plan.txt"
  local IPC_ NET_ ADDR_ SHM_
  eval "$(head -1 "$c.plan.txt")"
  # the root: an overlay of the image, as Docker's overlay2 gives each container
  # (a name used again, as `docker compose run` does, gets a fresh one)
  mountpoint -q "$c/root" && umount "$c/root"
  rm -rf "$c"
  mkdir -p "$c/upper" "$c/work" "$c/root"
  mount -t overlay overlay -o "lowerdir=$image,upperdir=$c/upper,workdir=$c/work" "$c/root"
  # named volumes: made on first use, tmpfs when compose says so, filled from the
  # image's folder at the target as Docker fills an empty volume
  while read -r kind v; do
    case $kind in
    TMPFS)
      vn=${v%%:*} size=${v#*:}
      mkdir -p "$work/vol/$vn"
      mountpoint -q "$work/vol/$vn" || mount -t tmpfs -o "size=$size" tmpfs "$work/vol/$vn"
      ;;
    VOL)
      IFS=: read -r src tgt mode <<<"$v"
      mkdir -p "$work/vol/$src"
      if [ ! -e "$work/vol/$src/.kvt-volume" ] && [ -z "$(ls -A "$work/vol/$src")" ] &&
        [ -d "$image$tgt" ]; then
        cp -a "$image$tgt/." "$work/vol/$src/"
        chown --reference="$image$tgt" "$work/vol/$src"
        chmod --reference="$image$tgt" "$work/vol/$src"
      fi
      ;;
    esac
  done < <(tail -n +2 "$c.plan.txt")
  # IPC: shareable/private get a namespace and a /dev/shm of their own; "service:X"
  # joins X's namespace and /dev/shm
  case $IPC_ in
  service:*)
    shm=$work/shm/${IPC_#service:}
    pre+=(nsenter --ipc="/proc/${PID1[${IPC_#service:}]}/ns/ipc" --)
    ;;
  *)
    shm=$work/shm/$name
    mkdir -p "$shm"
    mountpoint -q "$shm" && umount "$shm"
    mount -t tmpfs -o "size=$SHM_,mode=1777,nosuid,nodev" tmpfs "$shm"
    flags+=(--ipc)
    ;;
  esac
  # network: "none" is a namespace with lo only; else a veth on the bridge
  if [ "$NET_" = none ]; then
    flags+=(--net)
  elif [ -n "$ADDR_" ]; then
    if [ ! -e "/run/netns/$name" ]; then
      ip netns add "$name"
      ip link add "v-$name" type veth peer name eth0 netns "$name"
      ip link set "v-$name" master kvt-br up
      ip -n "$name" addr add "$ADDR_/${SUBNET_BITS}" dev eth0
      ip -n "$name" link set eth0 up
      ip -n "$name" link set lo up
      ip -n "$name" route add default via "$GATEWAY"
    fi
    pre=(ip netns exec "$name" "${pre[@]}")
  else
    bad "$name: no address and no network_mode none: not emulated"
    return 1
  fi
  "${pre[@]}" unshare "${flags[@]}" -- "$0" --container "$work/plan/$svc.sh" "$c/root" "$shm" \
    "$nosecret" -- "$@" <"${STDIN_:-/dev/null}" >"$work/$name.log" 2>&1 &
  BG[$name]=$!
  PID1[$name]=""
  for ((i = 0; i < 100; i++)); do
    PID1[$name]=$(awk '{print $1}' "/proc/${BG[$name]}/task/${BG[$name]}/children" 2>/dev/null)
    [ -n "${PID1[$name]}" ] && break
    kill -0 "${BG[$name]}" 2>/dev/null || break
    sleep 0.05
  done
  [ -n "${PID1[$name]}" ] || echo "note: $name ended before its PID 1 was seen: $(tail -3 "$work/$name.log")"
}

wait_ct() { # name timeout-s -> exit status (124: still running, then killed)
  local name=$1 t=$2 i rc
  for ((i = 0; i < t * 10; i++)); do
    kill -0 "${BG[$name]}" 2>/dev/null || break
    sleep 0.1
  done
  if kill -0 "${BG[$name]}" 2>/dev/null; then
    [ -z "${PID1[$name]}" ] || kill -KILL "${PID1[$name]}"
    wait "${BG[$name]}"
    return 124
  fi
  wait "${BG[$name]}"
  rc=$?
  return "$rc"
}

metric() { # addr name -> value (first sample)
  curl -fsS -m 3 "http://$1:9464/metrics" 2>/dev/null | awk -v n="$2" '$1 == n { print $2; exit }'
}

cluster_phase() {
  local nodes=(node0 node1 node2) n i rc code up t0 kpid st cfgjson=$work/compose.json
  declare -gA SVC
  mkdir -p "$work/plan" "$work/vol" "$work/shm" "$work/c" /run/netns
  mount -t tmpfs tmpfs /run/netns # ip netns's handles stay in this namespace
  ip link set lo up
  for n in "${nodes[@]}" engine; do
    python3 "$here/compose_plan.py" "$cfgjson" "$src/docker/Dockerfile" runtime "$n" \
      >"$work/plan/$n.sh" || {
      bad "compose_plan.py $n"
      return 1
    }
  done
  # the compose network: a bridge with the gateway's address, as Docker makes it
  local subnet
  subnet=$(pv node0 SUBNET)
  SUBNET_BITS=${subnet#*/}
  GATEWAY=$(python3 -c 'import ipaddress, sys; print(next(ipaddress.ip_network(sys.argv[1]).hosts()))' "$subnet")
  ip link add kvt-br type bridge
  ip addr add "$GATEWAY/$SUBNET_BITS" dev kvt-br
  ip link set kvt-br up
  phase "namespaces, bridge, plans"

  # A node without its secret: the entrypoint refuses with 78 (configuration).
  launch node2 node2 1
  wait_ct node2 30
  rc=$?
  check "a node without its secret stops with 78 ($(grep -o 'KVT_SECRET_FILE=[^:]*: no such file' "$work/node2.log" | head -1))" \
    '[ "$rc" = 78 ]'
  phase "node without secret"

  t0=$(date +%s.%N)
  for n in "${nodes[@]}"; do
    launch "$n" "$n" 0
  done
  # compose's healthcheck, in the container, until it passes (start_period 30 s)
  for n in "${nodes[@]}"; do
    rc=1
    for ((i = 0; i < 300; i++)); do
      (
        # shellcheck source=/dev/null
        . "$work/plan/$n.sh"
        in_ct "$n" "${HEALTH[@]}"
      ) >/dev/null 2>&1 && rc=0 && break
      kill -0 "${BG[$n]}" 2>/dev/null || break
      sleep 0.1
    done
    check "$n: compose's healthcheck passes ($(pv "$n" 'HEALTH[*]'))" '[ "$rc" = 0 ]'
  done
  awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "figure: 3 nodes started to all healthy: %.1f s\n", b - a }'
  for n in "${nodes[@]}"; do
    local addr
    addr=$(pv "$n" ADDR)
    code=$(curl -s -o "$work/healthz.body" -w '%{http_code}' -m 3 "http://$addr:9464/healthz")
    check "$n: /healthz from the bridge ($addr:9464, what the published port forwards to): $code $(cat "$work/healthz.body" 2>/dev/null)" \
      '[ "$code" = 200 ]'
  done
  phase "nodes start, healthchecks"
  for n in "${nodes[@]}"; do
    addr=$(pv "$n" ADDR)
    up=""
    for ((i = 0; i < 300; i++)); do
      up=$(metric "$addr" kvtier_peers_up)
      [ "$up" = 3 ] && break
      sleep 0.1
    done
    check "$n: kvtier_peers_up 3 (${up:-none})" '[ "$up" = 3 ]'
  done
  phase "peers up"

  # What runs in node0, and how.
  kpid=$(awk '{print $1}' "/proc/${PID1[node0]}/task/${PID1[node0]}/children" 2>/dev/null)
  check "node0: PID 1 is tini, its child kvtierd" \
    '[ "$(cat /proc/${PID1[node0]}/comm)" = tini ] && [ "$(cat /proc/$kpid/comm 2>/dev/null)" = kvtierd ]'
  st=$(cat "/proc/$kpid/status" 2>/dev/null)
  check "node0: kvtierd runs as kvtier ($IMAGE_UID) with no capabilities and no_new_privs" \
    'grep -Eq "^Uid:\s+$IMAGE_UID\s" <<<"$st" && grep -q "^CapEff:\s*0*$" <<<"$st" &&
     grep -q "^CapPrm:\s*0*$" <<<"$st" && grep -q "^NoNewPrivs:\s*1" <<<"$st"'
  echo "note: node0's memlock limit: $(awk '/Max locked memory/ { print $4, $5 }' "/proc/$kpid/limits") (compose: $(pv node0 MEMLOCK))"
  check "node0: engine socket srw-rw---- and /run/kvtier 0750, kvtier and the engine group ($IMAGE_GID)" \
    '[ "$(in_ct node0 stat -c %A:%u:%g /run/kvtier/engine.sock)" = "srw-rw----:$IMAGE_UID:$IMAGE_GID" ] &&
     [ "$(in_ct node0 stat -c %a:%u:%g /run/kvtier)" = "750:$IMAGE_UID:$IMAGE_GID" ]'
  check "node0: the region in /dev/shm/kvtier (0700), the secret's copy outside the shared volume" \
    '[ "$(in_ct node0 stat -c %a:%u /dev/shm/kvtier)" = "700:$IMAGE_UID" ] &&
     in_ct node0 test -f /dev/shm/kvtier/primary.mmap &&
     [ "$(in_ct node0 stat -c %a:%u /run/kvtierd/secret)" = "600:$IMAGE_UID" ] &&
     [ "$(in_ct node0 ls -A /run/kvtier)" = engine.sock ]'
  check "node0: kvtier status (docker exec node0 kvtier status) exits 0" \
    'in_ct node0 kvtier status >"$work/status.out" 2>&1'
  sed 's/^/    /' "$work/status.out" | head -20
  phase "node0 inspected"

  # The engine service: its compose command, kvtier-load, against node0.
  launch engine engine 0
  wait_ct engine 120
  rc=$?
  check "engine: compose's command ($(pv engine 'CMDV[*]')) exits 0" '[ "$rc" = 0 ]'
  grep -E 'kvtier-load:|stores|loads|errors' "$work/engine.log" | head -12 | sed 's/^/    /'
  phase "engine: kvtier-load"
  # What the engine container sees of node0.
  launch engine engine 0 /bin/sh -c '
    echo "id: $(id -u):$(id -G | tr " " ,)"
    echo "run: $(ls -A /run/kvtier)"
    if touch /run/kvtier/x 2>/dev/null; then echo "volume: writable"; else echo "volume: read-only"; fi
    if [ -e /run/secrets ] || [ -e /run/kvtierd ]; then echo "secret: visible"; else echo "secret: absent"; fi
    if [ -d /dev/shm/kvtier ]; then echo "shm: node0s"; else echo "shm: own"; fi
    if cat /dev/shm/kvtier/primary.mmap >/dev/null 2>&1; then echo "region: readable"; else echo "region: closed"; fi
    echo "links: $(ls /sys/class/net | tr "\n" " ")"'
  wait_ct engine 30
  sed 's/^/    /' "$work/engine.log"
  check "engine: nobody with the socket's group; sees the socket alone, read-only; no secret" \
    'grep -qx "id: 65534:65534,$IMAGE_GID" "$work/engine.log" && grep -qx "run: engine.sock" "$work/engine.log" &&
     grep -qx "volume: read-only" "$work/engine.log" && grep -qx "secret: absent" "$work/engine.log"'
  check "engine: node0s /dev/shm (its IPC namespace), the region not openable by name; no network but lo" \
    'grep -qx "shm: node0s" "$work/engine.log" && grep -qx "region: closed" "$work/engine.log" &&
     grep -qx "links: lo " "$work/engine.log"'
  # The Python module: one engine container stores, another loads byte for byte.
  cat >"$work/engine.py" <<'EOF'
import sys
import time
import kvtier

c = kvtier.Client("/run/kvtier/engine.sock", name="docker-engine", timeout_ms=10000)
keys = [kvtier.make_key(b"docker-engine-%d" % i, 0) for i in range(8)]
if sys.argv[1] == "store":
    c.on_new_request("store")
    plan = c.prepare_store("store", keys)
    for i, chunk in plan.stores:
        c.row(chunk)[:] = bytes([0x41 + i]) * c.row_bytes
    c.complete_store("store", keys)
    c.on_schedule_end(new=["store"])
    c.on_request_finished("store")
    print("stored", len(plan.stores), "chunks of", c.row_bytes, "bytes")
else:
    c.on_new_request("load")
    deadline = time.monotonic() + 20  # a node without them pulls them from a peer
    while time.monotonic() < deadline:
        res = c.lookup("load", keys)
        if res == [kvtier.HIT] * len(keys):
            break
        c.on_schedule_end()
        time.sleep(0.01)
    assert res == [kvtier.HIT] * len(keys), res
    for i, chunk in enumerate(c.prepare_load("load", keys)):
        assert bytes(c.row(chunk)) == bytes([0x41 + i]) * c.row_bytes, i
    c.complete_load("load", keys)
    c.on_request_finished("load")
    print("loaded", len(keys), "chunks byte for byte")
c.close()
EOF
  STDIN_=$work/engine.py launch engine engine 0 python3 - store
  wait_ct engine 60
  rc=$?
  sed 's/^/    /' "$work/engine.log" | tail -5
  check "engine: the Python module stores 8 chunks through the socket and the region" '[ "$rc" = 0 ]'
  STDIN_=$work/engine.py launch engine engine 0 python3 - load
  wait_ct engine 60
  rc=$?
  sed 's/^/    /' "$work/engine.log" | tail -5
  check "engine: another engine container loads them byte for byte (they live in node0)" '[ "$rc" = 0 ]'
  # The same engine service pointed at node1 (its volume and IPC namespace), as a
  # user adds one per node: node1 never stored the chunks, it pulls them from node0.
  sed -e 's/node0-run/node1-run/g' -e 's/^IPC=.*/IPC=service:node1/' "$work/plan/engine.sh" \
    >"$work/plan/engine1.sh"
  STDIN_=$work/engine.py launch engine1 engine1 0 python3 - load
  wait_ct engine1 60
  rc=$?
  sed 's/^/    /' "$work/engine1.log" | tail -5
  check "engine of node1: loads node0's chunks byte for byte, pulled over the cluster network (UCX_TLS=$(pv node1 ENVS[*] | grep -o 'UCX_TLS=[^ ]*' | cut -d= -f2))" \
    '[ "$rc" = 0 ]'
  # Without the group: the socket refuses nobody.
  sed -i 's/^GROUP_ADD=.*/GROUP_ADD=()/' "$work/plan/engine.sh"
  launch engine engine 0 kvtier status
  wait_ct engine 30
  rc=$?
  check "engine without group_add: cannot connect (exit $rc: $(grep -io 'permission denied' "$work/engine.log" | head -1))" \
    '[ "$rc" != 0 ] && grep -qi "permission denied" "$work/engine.log"'
  phase "engine containers"

  # docker compose stop: SIGTERM to PID 1 (tini), which forwards it to kvtierd.
  for n in "${nodes[@]}"; do
    t0=$(date +%s.%N)
    kill -TERM "${PID1[$n]}"
    wait_ct "$n" 15
    rc=$?
    awk -v a="$t0" -v b="$(date +%s.%N)" -v n="$n" 'BEGIN { printf "figure: %s SIGTERM to exit: %.2f s\n", n, b - a }'
    check "$n: SIGTERM to PID 1: exit 0 (stop_grace_period 15 s)" '[ "$rc" = 0 ]'
  done
  check "node0: the region was removed at the clean stop" '[ ! -e "$work/shm/node0/kvtier/primary.mmap" ]'
  addr=$(pv node0 ADDR)
  check "node0: /healthz no longer answers once it stopped" \
    '! curl -fsS -m 2 -o /dev/null "http://$addr:9464/healthz" 2>/dev/null'
  if [ "$fail" != 0 ]; then
    for n in "${nodes[@]}"; do
      echo "---- $n's log (tail)"
      tail -25 "$work/$n.log"
    done
  fi
  phase "stop"
  echo "$pass passed, $fail failed (cluster phase)"
  [ "$fail" = 0 ]
}

case "${1:-}" in
--build-image)
  shift
  build_image "$@"
  exit
  ;;
--container)
  shift
  work=$KVT_DOCKER_WORK
  container "$@"
  exit
  ;;
--cluster)
  shift
  src=$1 work=$2 image=$3 IMAGE_UID=$4 IMAGE_GID=$5
  export KVT_DOCKER_WORK=$work
  cluster_phase
  exit
  ;;
esac

# ---- outside: tools, the package, the image root, then the "Docker host" ----
src=$1 build=$2
cache=$build/package-cache
if [ "$(id -u)" != 0 ]; then
  echo "SKIP: needs root (chroot, mount, network and pid namespaces)"
  exit 77
fi
for tool in debootstrap zstd unshare nsenter curl ip; do
  if ! command -v $tool >/dev/null; then
    echo "SKIP: $tool is missing (tools/install-deps installs it)"
    exit 77
  fi
done
if docker compose version >/dev/null 2>&1; then
  compose=(docker compose)
elif command -v docker-compose >/dev/null && docker-compose version 2>/dev/null | grep -q 'v2\.'; then
  compose=(docker-compose)
else
  echo "SKIP: no docker compose v2 (tools/install-deps installs the CLI plugin)"
  exit 77
fi
echo "compose: $("${compose[@]}" version 2>&1 | head -1)"
mkdir -p "$cache" "$build/test-tmp"
work=$(realpath "$(mktemp -d "$build/test-tmp/docker.XXXXXX")")
trap 'rm -rf "$work"' EXIT

if [ -z "${KVT_DOCKER_IMAGE_ROOT:-}" ]; then
  deb=$(KVT_JOBS=$(nproc) "$src/tools/build-deb" "$build/package-deb" | tail -n 1)
  if [ ! -f "$deb" ]; then
    echo "FAIL - tools/build-deb made no package"
    exit 1
  fi
  phase "tools/build-deb"
fi

# compose's view, from the repository root (the root's compose.yaml includes
# docker/compose.yaml), with a small region and a short engine run
head -c 32 /dev/urandom >"$work/cluster.secret"
chmod 600 "$work/cluster.secret"
if (cd "$src" && env KVT_SECRET_FILE_HOST="$work/cluster.secret" KVT_PRIMARY_SIZE=128MiB \
  KVT_ENGINE_SECONDS=3 "${compose[@]}" --profile engine config --format json) \
  >"$work/compose.json" 2>"$work/compose.err"; then
  ok "docker compose --profile engine config, from the repository root"
else
  bad "docker compose config from the repository root: $(cat "$work/compose.err")"
  exit 1
fi

# the image's user and group numbers: the Dockerfile's ARG defaults
ids=$(python3 "$here/compose_plan.py" "$work/compose.json" "$src/docker/Dockerfile" runtime node0 |
  grep -E '^IMAGE_ARG_KVT_(UID|GID)=')
eval "$ids"
uid=${IMAGE_ARG_KVT_UID:?} gid=${IMAGE_ARG_KVT_GID:?}

if [ -n "${KVT_DOCKER_IMAGE_ROOT:-}" ]; then
  # an image built from docker/Dockerfile elsewhere (e.g. `buildah mount`), as is
  image=$KVT_DOCKER_IMAGE_ROOT
  [ -x "$image/usr/local/bin/kvtier-entrypoint" ] || {
    echo "FAIL - KVT_DOCKER_IMAGE_ROOT=$image: no kvtier-entrypoint in it"
    exit 1
  }
  echo "image root: $image (KVT_DOCKER_IMAGE_ROOT), $(chroot "$image" kvtierd --version 2>/dev/null)"
else
first=$([ -f "$cache/debian12-minbase.tar.zst" ] || echo yes)
if ! tarball=$(debian_root_tarball "$cache" debian12-minbase ""); then
  echo "FAIL - no Debian 12 minbase root"
  exit 1
fi
[ -n "$first" ] && phase "debootstrap minbase (first run only)"
mkdir "$work/image"
tar -C "$work/image" --numeric-owner --zstd -xf "$tarball"
if unshare --mount --pid --fork --propagation private "$0" --build-image "$work/image" "$deb" \
  "$cache" "$src" "$uid" "$gid"; then
  ok "the runtime stage's root: minbase + install-runtime.sh + the package ($(grep -c '^Unpacking' \
    "$work/install-runtime.log") packages unpacked; $(tail -1 "$work/install-runtime.log"))"
else
  bad "install-runtime.sh in the Debian 12 root"
  exit 1
fi
echo "image root: $(du -sm "$work/image" | cut -f1) MB"
phase "image root (unpack + install-runtime.sh)"
image=$work/image
fi

unshare --mount --net --pid --fork --mount-proc --propagation private "$0" --cluster "$src" "$work" \
  "$image" "$uid" "$gid"
rc=$?
[ "$rc" = 0 ] || fail=$((fail + 1))
echo "$pass passed, $fail failed (outer checks; the cluster phase counted as one)"
[ "$fail" = 0 ]

#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The kvtier container's entrypoint (docker/README.md); tini runs it as PID 1's child.
#
#   kvtier-entrypoint [daemon] [kvtierd args...]  config from env, folders, kvtierd
#   kvtier-entrypoint test [args...]              soft-RoCE up, barrier, cluster test
#   kvtier-entrypoint config                      print the config it would write, exit
#   kvtier-entrypoint <command> [args...]         any other command (kvtier status, bash)
#
# Daemon mode, as root: writes the node's config from the environment, prepares the
# folders below, then execs kvtierd as KVT_USER (setpriv: no capabilities, no new
# privileges), so that SIGTERM from tini reaches kvtierd itself.
#   /run/kvtier        engine.sock, mode 0660, group KVT_ENGINE_GID; the folder 0750
#                      KVT_USER:KVT_ENGINE_GID. The volume engine containers mount.
#   /dev/shm/kvtier    primary.mmap, the region (0700: engines get its fd over the
#                      socket, never open it by name). /dev/shm is the container's IPC
#                      namespace's: sized by compose's shm_size, shared with engines
#                      of ipc "service:<node>".
#   /var/lib/kvtier    storage tier ({id} below it), 0700 KVT_USER.
#   KVT_RUN_DIR        the secret's 0600 copy and scratch files, 0700 KVT_USER; kept
#                      out of /run/kvtier, which engines see.
#
# Soft-RoCE (KVT_RDMA=rxe; the test mode always): when no RDMA device carries this
# container's address, it runs `rdma link add rxe0 type rxe netdev eth0` (names from
# KVT_RDMA_DEV / KVT_NETDEV), waits for port 1 to be ACTIVE and creates the device's
# /dev/infiniband/uverbsN node if the container does not have it. Any failure stops
# the container with a message that says what the host lacks; nothing falls back
# silently.
#
# Environment (defaults in brackets):
#   KVT_RDMA [off; rxe in test mode]  rxe: set up soft-RoCE first; off: none
#   KVT_TRANSPORT [ucx; verbs with KVT_RDMA=rxe]  network.transport: verbs | ucx
#   KVT_NETDEV [eth0]          netdev that carries the cluster traffic (and RoCE)
#   KVT_RDMA_DEV [rxe0]        name of the rxe device to create
#   KVT_ADDR [KVT_NETDEV's IPv4 address]   network.listen
#   KVT_PORT [7170]            network.port (every node the same)
#   KVT_PEERS []               cluster addresses, "host" or "host:port", space or comma
#                              separated, in role order; this node's own is left out
#   KVT_ROLE                   this node's index in KVT_PEERS (test mode; else derived)
#   KVT_NODE_ID []             node.id (empty: derived by kvtierd)
#   KVT_NAMESPACE [default]    node.namespace
#   KVT_SECRET_FILE [/run/secrets/kvtier_secret]  shared secret, 16..1024 bytes; copied
#                              to a 0600 file of KVT_USER (cluster.secret_file)
#   KVT_PRIMARY_SIZE [512MiB]  primary.size (fits the container's /dev/shm: shm_size)
#   KVT_STORAGE_ROOT [/var/lib/kvtier/{id}]  KVT_STORAGE_CAPACITY [1GiB]
#   KVT_METRICS_PORT [9464]    metrics.port, on 0.0.0.0 (/metrics, /healthz)
#   KVT_LOG_LEVEL [info]
#   KVT_USER [kvtier]          the user kvtierd runs as ("root": stays root)
#   KVT_ENGINE_GID [KVT_USER's group]  group (number) of the engine socket and of
#                              /run/kvtier: engine containers get it with group_add
#   KVT_SET []                 extra "key=value" overrides, space separated (--set)
#   KVT_CONFIG []              use this YAML file as is instead of writing one
#   KVT_CONFIG_OUT [/etc/kvtier/kvtierd.yaml]  where the written config goes
#   KVT_RUN_DIR [/run/kvtierd] the secret's copy and scratch files
# Test mode only:
#   KVT_RESULTS_ROOT [/results]  shared by the nodes; this node writes $ROOT/g<role>/
#   KVT_BARRIER_TIMEOUT [120]    seconds to wait for every node's rxe device
#   KVT_CLUSTER_TEST [/opt/kvtier/src/tests/cluster/run-cluster-test]
set -euo pipefail

PROG=kvtier-entrypoint
EX_CONFIG=78

die() {
    echo "$PROG: error: $*" >&2
    exit 1
}
die_config() {
    echo "$PROG: configuration error: $*" >&2
    exit "$EX_CONFIG"
}
log() { echo "$PROG: $*" >&2; }

NETDEV=${KVT_NETDEV:-eth0}
RDMA_DEV=${KVT_RDMA_DEV:-rxe0}
PORT=${KVT_PORT:-7170}
METRICS_PORT=${KVT_METRICS_PORT:-9464}
TRANSPORT= # set in main, from the mode and KVT_RDMA
SECRET_SRC=${KVT_SECRET_FILE:-/run/secrets/kvtier_secret}
CONFIG_OUT=${KVT_CONFIG_OUT:-/etc/kvtier/kvtierd.yaml}
RUN_DIR=${KVT_RUN_DIR:-/run/kvtierd}
ENGINE_DIR=/run/kvtier
SHM_DIR=/dev/shm/kvtier
DAEMON_USER=${KVT_USER:-kvtier}
ENGINE_GID= # set by resolve_user

# ---- checks of single values -------------------------------------------------------

is_uint() { [[ $1 =~ ^[0-9]+$ ]]; }

check_port() { # name value
    { is_uint "$2" && [ "$2" -ge 1 ] && [ "$2" -le 65535 ]; } ||
        die_config "$1=$2: not a port (1..65535)"
}

# A value that goes into a double-quoted YAML scalar as is.
check_plain() { # name value
    local re='^[][A-Za-z0-9._:/{}@%+=,-]*$'
    [[ $2 =~ $re ]] ||
        die_config "$1=$2: only letters, digits and ._:/{}@%+=,[]- are accepted"
}

# ---- addresses -----------------------------------------------------------------------

netdev_ipv4() { # netdev -> first IPv4 address, or nothing
    ip -4 -o addr show dev "$1" 2>/dev/null | awk '{ split($4, a, "/"); print a[1]; exit }'
}

# KVT_PEERS as one "host:port" per line, in the given order.
# Checked first by check_peers: this runs in command substitutions.
peer_list() {
    local p
    [ -n "${KVT_PEERS:-}" ] || return 0
    for p in ${KVT_PEERS//,/ }; do
        if [[ $p == \[*\]:* || ($p == *:* && $p != *:*:*) ]]; then
            echo "$p"
        elif [[ $p == *:*:* ]]; then
            echo "[$p]:$PORT"
        else
            echo "$p:$PORT"
        fi
    done
}

check_peers() {
    local p
    [ -n "${KVT_PEERS:-}" ] || return 0
    for p in ${KVT_PEERS//,/ }; do
        check_plain KVT_PEERS "$p"
    done
}

peer_host() { # "host:port" or "[v6]:port" -> host
    local h=${1%:*}
    h=${h#[}
    echo "${h%]}"
}

# ---- soft-RoCE -------------------------------------------------------------------------

# The IPv4-mapped GID of an address, as sysfs prints it (0000:...:ffff:0a4e:000b).
ipv4_gid() {
    local IFS=. a b c d
    read -r a b c d <<<"$1"
    printf '0000:0000:0000:0000:0000:ffff:%02x%02x:%02x%02x\n' "$a" "$b" "$c" "$d"
}

# The RDMA device whose port 1 GID table holds this container's address: with the
# kernel's RDMA netns mode "shared", other containers' devices are visible here too,
# and all their netdevs are called eth0, so the address is what tells ours apart.
own_rdma_dev() {
    local gid d
    gid=$(ipv4_gid "$1")
    for d in /sys/class/infiniband/*; do
        [ -d "$d/ports/1/gids" ] || continue
        if grep -qx "$gid" "$d"/ports/1/gids/* 2>/dev/null; then
            basename "$d"
            return 0
        fi
    done
    return 1
}

rxe_help() {
    cat >&2 <<EOF
$PROG: soft-RoCE needs, on the Docker host and for this container:
  - a host kernel with rdma_rxe loaded: \`sudo modprobe rdma_rxe\` (also ib_uverbs,
    rdma_ucm); \`rdma link\` on the host must answer without "Failed to open
    NETLINK_RDMA socket";
  - cap_add NET_ADMIN (rdma link add) and IPC_LOCK, ulimit memlock unlimited;
  - devices /dev/infiniband/rdma_cm (and uverbs*), device_cgroup_rules 'c 231:* rmw';
  - a kernel whose rxe accepts a netdev inside a container's network namespace
    (Debian 12's 6.1 kernel refused this in our qemu measurements: see README.md).
EOF
}

setup_rxe() { # addr
    local addr=$1 dev i state
    [ -n "$addr" ] || die "$NETDEV has no IPv4 address (KVT_NETDEV=$NETDEV)"
    command -v rdma >/dev/null || die "the rdma command (iproute2) is missing from the image"
    if ! rdma link show >/dev/null 2>"$RUN_DIR/rdma.err"; then
        log "\`rdma link show\` failed: $(cat "$RUN_DIR/rdma.err")"
        rxe_help
        die "no RDMA netlink in this kernel: cannot set up soft-RoCE"
    fi
    if dev=$(own_rdma_dev "$addr"); then
        log "RDMA device $dev already carries $addr"
    else
        dev=$RDMA_DEV
        check_plain KVT_RDMA_DEV "$dev"
        i=0
        while [ -e "/sys/class/infiniband/$dev" ]; do # another node's (shared netns mode)
            i=$((i + 1))
            dev=rxe$i
        done
        [ "$dev" = "$RDMA_DEV" ] || log "$RDMA_DEV exists (another container's): using $dev"
        log "rdma link add $dev type rxe netdev $NETDEV"
        if ! rdma link add "$dev" type rxe netdev "$NETDEV" 2>"$RUN_DIR/rdma.err"; then
            log "\`rdma link add $dev type rxe netdev $NETDEV\` failed: $(cat "$RUN_DIR/rdma.err")"
            rxe_help
            die "cannot create the soft-RoCE device $dev on $NETDEV"
        fi
    fi
    for i in $(seq 1 100); do
        state=$(cat "/sys/class/infiniband/$dev/ports/1/state" 2>/dev/null || true)
        [[ $state == *ACTIVE* ]] && own_rdma_dev "$addr" >/dev/null && break
        [ "$i" -lt 100 ] || die "$dev port 1 is not ACTIVE with $addr after 10 s (state: ${state:-none})"
        sleep 0.1
    done
    make_uverbs_node "$dev"
    if ! ibv_devinfo -d "$dev" >"$RUN_DIR/ibv_devinfo.out" 2>&1 ||
        ! grep -q 'PORT_ACTIVE' "$RUN_DIR/ibv_devinfo.out"; then
        cat "$RUN_DIR/ibv_devinfo.out" >&2
        rxe_help
        die "libibverbs cannot open $dev (ibv_devinfo -d $dev)"
    fi
    RDMA_DEV=$dev
    log "soft-RoCE ready: $dev on $NETDEV ($addr), port 1 ACTIVE"
}

# A device created after the container started has no node in the container's /dev:
# create /dev/infiniband/uverbsN from sysfs (needs the cgroup rule c 231:* rmw).
make_uverbs_node() { # dev
    local u name mm
    for u in /sys/class/infiniband_verbs/uverbs*; do
        [ -e "$u/ibdev" ] || continue
        [ "$(cat "$u/ibdev")" = "$1" ] || continue
        name=/dev/infiniband/$(basename "$u")
        [ -c "$name" ] && return 0
        mm=$(cat "$u/dev")
        mkdir -p /dev/infiniband
        mknod -m 0666 "$name" c "${mm%:*}" "${mm#*:}" 2>"$RUN_DIR/mknod.err" || {
            log "mknod $name c ${mm%:*} ${mm#*:}: $(cat "$RUN_DIR/mknod.err")"
            rxe_help
            die "no device node for $1 and none can be made"
        }
        log "created $name for $1"
        return 0
    done
    die "no uverbs device for $1 in /sys/class/infiniband_verbs (is ib_uverbs loaded on the host?)"
}

# ---- configuration ---------------------------------------------------------------------

# KVT_USER's uid and gid, and the engine group. With strict unset (config mode, which
# also runs outside the image), a user this system lacks leaves them empty.
resolve_user() { # [strict]
    DAEMON_UID="" DAEMON_GID=""
    if [ "$DAEMON_USER" = root ]; then
        DAEMON_UID=0 DAEMON_GID=0
    elif id -u "$DAEMON_USER" >/dev/null 2>&1; then
        DAEMON_UID=$(id -u "$DAEMON_USER")
        DAEMON_GID=$(id -g "$DAEMON_USER")
    elif [ -n "${1:-}" ]; then
        die_config "KVT_USER=$DAEMON_USER: no such user in this image"
    fi
    ENGINE_GID=${KVT_ENGINE_GID:-$DAEMON_GID}
    [ -z "$ENGINE_GID" ] || is_uint "$ENGINE_GID" ||
        die_config "KVT_ENGINE_GID=$ENGINE_GID: a group number (engine containers' group_add)"
}

# The folders of the header, made or re-owned at every start: volumes and /dev/shm
# come up empty or owned by whoever made them.
prepare_dirs() {
    local u=$DAEMON_UID g=$DAEMON_GID
    install -d -m 0700 -o "$u" -g "$g" "$RUN_DIR"
    mkdir -p "$ENGINE_DIR" "$SHM_DIR"
    chown "$u:$ENGINE_GID" "$ENGINE_DIR"
    chmod 0750 "$ENGINE_DIR"
    chown "$u:$g" "$SHM_DIR"
    chmod 0700 "$SHM_DIR"
    if [ -z "${KVT_STORAGE_ROOT:-}" ]; then
        mkdir -p /var/lib/kvtier
        chown "$u:$g" /var/lib/kvtier
        chmod 0700 /var/lib/kvtier
    fi
}

# The shared secret as kvtierd wants it: a regular file, mode 0600, owned by its user.
install_secret() {
    local n
    [ -f "$SECRET_SRC" ] || die_config "KVT_SECRET_FILE=$SECRET_SRC: no such file (the compose secret kvtier_secret)"
    n=$(wc -c <"$SECRET_SRC")
    { [ "$n" -ge 16 ] && [ "$n" -le 1024 ]; } ||
        die_config "KVT_SECRET_FILE=$SECRET_SRC: $n bytes; the secret must have 16..1024"
    install -m 0600 -o "$DAEMON_UID" -g "$DAEMON_GID" "$SECRET_SRC" "$RUN_DIR/secret"
}

write_config() { # addr
    local addr=$1 self p size cap level ns id root out
    size=${KVT_PRIMARY_SIZE:-512MiB}
    root=${KVT_STORAGE_ROOT:-}
    [ -n "$root" ] || root='/var/lib/kvtier/{id}'
    cap=${KVT_STORAGE_CAPACITY:-1GiB}
    level=${KVT_LOG_LEVEL:-info}
    ns=${KVT_NAMESPACE:-default}
    id=${KVT_NODE_ID:-}
    check_port KVT_PORT "$PORT"
    check_port KVT_METRICS_PORT "$METRICS_PORT"
    [[ $TRANSPORT == verbs || $TRANSPORT == ucx ]] || die_config "KVT_TRANSPORT=$TRANSPORT: verbs or ucx"
    check_plain KVT_PRIMARY_SIZE "$size"
    check_plain KVT_STORAGE_CAPACITY "$cap"
    check_plain KVT_STORAGE_ROOT "$root"
    check_plain KVT_LOG_LEVEL "$level"
    check_plain KVT_NAMESPACE "$ns"
    [ -z "$id" ] || is_uint "$id" || die_config "KVT_NODE_ID=$id: a decimal number"
    self="$addr:$PORT"
    out=$(
        echo "# Written by $PROG from the environment; see docker/README.md."
        echo "node:"
        [ -z "$id" ] || echo "  id: $id"
        echo "  namespace: \"$ns\""
        echo "primary:"
        echo "  path: \"$SHM_DIR/primary.mmap\"" # the container's sized /dev/shm
        echo "  size: \"$size\""
        echo "storage:"
        echo "  root: \"$root\""
        echo "  capacity: \"$cap\""
        echo "network:"
        echo "  enabled: true"
        echo "  listen: \"$addr\""
        echo "  port: $PORT"
        echo "  transport: $TRANSPORT"
        echo "  peers:"
        for p in $(peer_list); do
            [ "$p" = "$self" ] || echo "    - \"$p\""
        done
        echo "cluster:"
        echo "  secret_file: \"$RUN_DIR/secret\""
        echo "engine:"
        echo "  socket: \"$ENGINE_DIR/engine.sock\""
        echo "  socket_mode: \"0660\""
        [ -z "$ENGINE_GID" ] || echo "  socket_group: \"$ENGINE_GID\""
        echo "metrics:"
        echo "  listen: \"0.0.0.0\""
        echo "  port: $METRICS_PORT"
        echo "log:"
        echo "  level: $level"
    )
    # An empty peer list ("peers:" and nothing) must read as an empty sequence.
    if ! grep -q '^    - ' <<<"$out"; then
        out=${out/  peers:/  peers: []}
    fi
    printf '%s\n' "$out"
}

prepare_config() { # addr -> sets CONFIG
    if [ -n "${KVT_CONFIG:-}" ]; then
        [ -f "$KVT_CONFIG" ] || die_config "KVT_CONFIG=$KVT_CONFIG: no such file"
        CONFIG=$KVT_CONFIG
        return
    fi
    install_secret
    mkdir -p "$(dirname "$CONFIG_OUT")"
    write_config "$1" >"$CONFIG_OUT.tmp"
    mv "$CONFIG_OUT.tmp" "$CONFIG_OUT"
    CONFIG=$CONFIG_OUT
    log "config $CONFIG:"
    sed 's/^/  /' "$CONFIG" >&2
}

# ---- modes -----------------------------------------------------------------------------

role_of() { # addr -> index of addr in KVT_PEERS
    local i=0 p
    for p in $(peer_list); do
        if [ "$(peer_host "$p")" = "$1" ]; then
            echo "$i"
            return 0
        fi
        i=$((i + 1))
    done
    return 1
}

# Every node writes $KVT_RESULTS_ROOT/g<role>/ready (its start time) once its rxe
# device is ACTIVE and waits until all KVT_GUESTS nodes have one from the last
# KVT_BARRIER_TIMEOUT*2 seconds (older ones are from an earlier run).
barrier() { # root role guests
    local root=$1 role=$2 n=$3 timeout=${KVT_BARRIER_TIMEOUT:-120} start now g ok t
    is_uint "$timeout" || die_config "KVT_BARRIER_TIMEOUT=$timeout: seconds"
    start=$(date +%s)
    echo "$start" >"$root/g$role/ready"
    while :; do
        now=$(date +%s)
        ok=0
        for g in $(seq 0 $((n - 1))); do
            t=$(cat "$root/g$g/ready" 2>/dev/null || echo 0)
            is_uint "$t" && [ "$t" -ge $((start - 2 * timeout)) ] && ok=$((ok + 1))
        done
        [ "$ok" -eq "$n" ] && break
        [ $((now - start)) -lt "$timeout" ] || die "barrier: $ok of $n nodes ready after ${timeout} s"
        sleep 1
    done
    log "barrier: all $n nodes have soft-RoCE up"
}

run_test() {
    local addr=$1 role guests root test peers p kvtierd
    shift
    kvtierd=$(command -v kvtierd) || die "kvtierd is not in this image"
    test=${KVT_CLUSTER_TEST:-/opt/kvtier/src/tests/cluster/run-cluster-test}
    [ -x "$test" ] || die "the cluster test $test is not in this image (it was not in tests/cluster/ when the image was built)"
    [ -n "${KVT_PEERS:-}" ] || die_config "test mode needs KVT_PEERS (every node's address, in role order)"
    guests=$(peer_list | wc -l)
    guests=${KVT_GUESTS:-$guests}
    { is_uint "$guests" && [ "$guests" -ge 1 ]; } || die_config "KVT_GUESTS=$guests: a count"
    if [ -n "${KVT_ROLE:-}" ]; then
        role=$KVT_ROLE
    else
        role=$(role_of "$addr") || die_config "$addr is not in KVT_PEERS=$KVT_PEERS; set KVT_ROLE"
    fi
    { is_uint "$role" && [ "$role" -lt "$guests" ]; } || die_config "KVT_ROLE=$role: 0..$((guests - 1))"
    root=${KVT_RESULTS_ROOT:-/results}
    mkdir -p "$root/g$role"
    rm -f "$root/g$role/ready" "$root/g$role/exit_code"
    barrier "$root" "$role" "$guests"
    peers=""
    for p in $(peer_list); do
        peers="$peers${peers:+ }$(peer_host "$p")"
    done
    # The interface of tools/rxe-harness/kvtier-rxe's guests (its README, step 4).
    export KVT_ROLE=$role KVT_ADDR=$addr KVT_PEERS=$peers KVT_GUESTS=$guests \
        KVT_RESULTS=$root/g$role KVT_NETDEV=$NETDEV KVT_RDMA_DEV=$RDMA_DEV \
        KVT_KVTIERD=$kvtierd KVT_CONFIG=$CONFIG
    log "running $test $* (role $role of $guests, $addr, peers: $peers)"
    cd /opt/kvtier/build
    set +e
    "$test" "$@" 2>&1 | tee "$KVT_RESULTS/output.log"
    local rc=${PIPESTATUS[0]}
    set -e
    echo "$rc" >"$KVT_RESULTS/exit_code"
    log "cluster test exit status $rc (role $role)"
    exit "$rc"
}

main() {
    local mode=${1:-daemon} addr rdma
    case $mode in
    daemon | test | config) shift || true ;;
    -*) mode=daemon ;; # kvtierd options only
    *) exec "$@" ;;
    esac
    if [ "$mode" = test ]; then
        rdma=${KVT_RDMA:-rxe}
        DAEMON_USER=root # the cluster test's own processes, as in the qemu guests
    else
        rdma=${KVT_RDMA:-off}
    fi
    case $rdma in
    rxe) TRANSPORT=${KVT_TRANSPORT:-verbs} ;;
    off) TRANSPORT=${KVT_TRANSPORT:-ucx} ;;
    *) die_config "KVT_RDMA=$rdma: rxe or off" ;;
    esac
    addr=${KVT_ADDR:-$(netdev_ipv4 "$NETDEV")}
    [ -n "$addr" ] || die "no address: $NETDEV has no IPv4 address and KVT_ADDR is not set"
    check_plain KVT_ADDR "$addr"
    check_peers
    local sets=() s
    for s in ${KVT_SET:-}; do
        [[ $s == *=* ]] || die_config "KVT_SET: \"$s\" is not key=value"
        sets+=(--set "$s")
    done
    if [ "$mode" = config ]; then
        resolve_user
        write_config "$addr"
        exit 0
    fi
    resolve_user strict
    prepare_dirs
    if [ "$rdma" = rxe ]; then
        setup_rxe "$addr"
    else
        [ "$mode" = daemon ] || die "KVT_RDMA=off: the cluster test runs on soft-RoCE only"
        log "KVT_RDMA=off: no soft-RoCE set-up (transport $TRANSPORT)"
    fi
    prepare_config "$addr"
    if [ "$mode" = test ]; then
        run_test "$addr" "$@"
    fi
    command -v kvtierd >/dev/null || die "kvtierd is not in this image"
    # As KVT_USER from here on: no capabilities (a uid change from root drops them),
    # none to regain (no_new_privs), the engine group among its groups so that it may
    # give the socket that group.
    local as=()
    if [ "$DAEMON_UID" != 0 ]; then
        local groups
        groups=$({ id -G "$DAEMON_USER" | tr ' ' '\n' && echo "$ENGINE_GID"; } | sort -un | paste -sd, -)
        as=(setpriv --reuid="$DAEMON_UID" --regid="$DAEMON_GID" --groups="$groups"
            --inh-caps=-all --no-new-privs --)
    fi
    "${as[@]}" kvtierd --config "$CONFIG" "${sets[@]}" --check ||
        die_config "kvtierd --check refused $CONFIG (above)"
    log "exec ${as[*]} kvtierd --config $CONFIG ${sets[*]} $*"
    exec "${as[@]}" kvtierd --config "$CONFIG" "${sets[@]}" "$@"
}

main "$@"

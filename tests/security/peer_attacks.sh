#!/usr/bin/env bash
# Issue #21: a remote attacker without the cluster secret against real kvtierd nodes
# on 127.0.0.1, with the attacker program peer_attack.c. Nodes A, B, C run with UCX's
# defaults (no UCX_TLS, no UCX_NET_DEVICES): on a loopback address the backend then
# gives UCX no tcp at all (shared memory reaches every peer), so the peer port and
# /metrics are all a node listens on. Node R runs with UCX_TLS=tcp, as a node whose
# peers are on other hosts does: UCX's own tcp port is the residual, confined to the
# listen device by the backend.
#
#   (i)   READ requests before AUTH, in our frame protocol and through UCX's
#         client-server connect on the peer port, and wired up to R's worker through
#         UCX's port: no byte back, each counted in /metrics, the node alive and still
#         serving its real peer (and a new one);
#   (ii)  hostile and random byte streams on the peer port and on R's UCX port,
#         bounded in count and time: no crash;
#   (iii) 2,000 idle connections on the peer port, then SIGTERM: exit 0; the same on
#         R's UCX port.
#   The residual: a uct PUT through R's UCX port (UCX 1.13 writes it where its header
#   says). Reported, not counted: it is UCX's, and a node with peers on other hosts
#   has that port (transport/README.md).
#
#   peer_attacks.sh KVTIERD PEER_ATTACK TMPDIR
set -uo pipefail
kvtierd=$1 att=$2 tmp=$3
mkdir -p "$tmp"
work=$(mktemp -d "$tmp/peer-attacks.XXXXXX")
pass=0 fail=0
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -KILL "$p" 2>/dev/null; done
  rm -rf "$work" /dev/shm/kvt-peer-attacks-$$-*
}
trap cleanup EXIT
ok() { pass=$((pass + 1)); echo "ok - $*"; }
bad() { fail=$((fail + 1)); echo "FAIL - $*"; }
check() { if eval "$2"; then ok "$1"; else bad "$1"; fi; }

unset UCX_TLS UCX_NET_DEVICES
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
head -c 40 /dev/urandom | base64 >"$work/secret" && chmod 600 "$work/secret"

declare -A NPID NPORT MPORT
# start NAME ID [SEED_PORT]: a node on 127.0.0.1, network tier only (the environment's
# UCX settings).
start() {
  local name=$1 id=$2 seed=${3:-}
  NPORT[$name]=$(free_port)
  MPORT[$name]=$(free_port)
  cat >"$work/$name.yaml" <<EOF
node:
  id: $id
primary:
  path: /dev/shm/kvt-peer-attacks-$$-$name/primary.mmap
  size: 32MiB
  row_bytes: 256KiB
storage:
  enabled: false
network:
  port: ${NPORT[$name]}
  heartbeat_ms: 100
  peers: [${seed:+127.0.0.1:$seed}]
cluster:
  secret_file: $work/secret
engine:
  socket: $work/$name.sock
metrics:
  port: ${MPORT[$name]}
log:
  level: info
EOF
  "$kvtierd" --config "$work/$name.yaml" >"$work/$name.log" 2>&1 &
  NPID[$name]=$!
  pids+=("${NPID[$name]}")
  for _ in $(seq 100); do
    curl -sf "http://127.0.0.1:${MPORT[$name]}/healthz" >/dev/null 2>&1 && return 0
    kill -0 "${NPID[$name]}" 2>/dev/null || break
    sleep 0.1
  done
  echo "# $name did not start:"; tail -20 "$work/$name.log"
  return 1
}
alive() { kill -0 "${NPID[$1]}" 2>/dev/null; }
# metric NAME SERIES: the value of a series on NAME's /metrics (a new snapshot each second).
metric() {
  curl -sf "http://127.0.0.1:${MPORT[$1]}/metrics" | awk -v s="$2" '$1 == s { print $2; f = 1 } END { if (!f) print -1 }'
}
refused() { metric "$1" "kvtier_net_refused_total{reason=\"$2\"}"; }
# wait_metric NAME SERIES OP VALUE SECONDS
wait_metric() {
  local v
  for _ in $(seq $(($5 * 10))); do
    v=$(metric "$1" "$2")
    awk -v a="$v" -v b="$4" "BEGIN { exit !(a $3 b) }" && return 0
    sleep 0.1
  done
  echo "# $1 $2 = $v, wanted $3 $4"
  return 1
}
# Listening TCP sockets of a pid: "ip:port" per line (IPv4 and IPv6).
listening() {
  python3 - "$1" <<'EOF'
import os, socket, struct, sys
pid = sys.argv[1]
inodes = set()
for fd in os.listdir(f"/proc/{pid}/fd"):
    try:
        link = os.readlink(f"/proc/{pid}/fd/{fd}")
    except OSError:
        continue
    if link.startswith("socket:["):
        inodes.add(link[8:-1])
for name, fam in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
    try:
        lines = open(f"/proc/{pid}/net/{name}").read().splitlines()[1:]
    except OSError:
        continue
    for l in lines:
        f = l.split()
        if f[3] != "0A" or f[9] not in inodes:
            continue
        ip, port = f[1].split(":")
        raw = bytes.fromhex(ip)
        if fam == socket.AF_INET:
            addr = socket.inet_ntop(fam, struct.pack("<I", int(ip, 16)))
        else:
            addr = socket.inet_ntop(fam, b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4)))
        print(f"{addr}:{int(port, 16)}")
EOF
}

# ---- two nodes, linked ----
check "node A starts" 'start A 1'
check "node B starts, seeded with A" 'start B 2 "${NPORT[A]}"'
check "A and B are linked (kvtier_peers_up 2 on both)" \
  'wait_metric A kvtier_peers_up == 2 15 && wait_metric B kvtier_peers_up == 2 15'
listening "${NPID[A]}" >"$work/A.listen"
echo "# A listens on: $(tr '\n' ' ' <"$work/A.listen")"
check "A listens on its peer and metrics ports only (no UCX port on a loopback node)" \
  '[ "$(sort "$work/A.listen" | tr "\n" " ")" = "$(printf "127.0.0.1:%s\n127.0.0.1:%s\n" "${NPORT[A]}" "${MPORT[A]}" | sort | tr "\n" " ")" ]'

# ---- node R: UCX over tcp ----
export UCX_TLS=tcp
start R 9
unset UCX_TLS
check "node R starts with UCX_TLS=tcp" 'alive R'
listening "${NPID[R]}" >"$work/R.listen"
echo "# R listens on: $(tr '\n' ' ' <"$work/R.listen")"
check "every listening socket of R is on 127.0.0.1 (UCX confined to the listen device)" \
  '[ -s "$work/R.listen" ] && ! grep -qv "^127\.0\.0\.1:" "$work/R.listen"'
uct=$(grep -v ":${NPORT[R]}\$" "$work/R.listen" | grep -v ":${MPORT[R]}\$" | sed 's/.*://' | head -1)
echo "# UCX's own tcp port of R: ${uct:-none}"
check "R has UCX's own tcp port (the residual)" '[ -n "$uct" ]'

# ---- (i) READ requests before AUTH ----
# The attacker's UCX; its own leaks (it exits mid-connection on purpose) are not ours.
export UCX_TLS=tcp UCX_NET_DEVICES=lo ASAN_OPTIONS=detect_leaks=0
"$att" frames 127.0.0.1 "${NPORT[A]}" >"$work/i.frames" 2>&1
rc=$?
cat "$work/i.frames"
check "(i) frames: a READ request before AUTH gets 0 bytes and the connection closed" '[ $rc = 0 ]'
check "(i) counted: kvtier_net_refused_total{reason=\"read_unauth\"} >= 1" \
  'wait_metric A "kvtier_net_refused_total{reason=\"read_unauth\"}" ">=" 1 3'
timeout 30 "$att" ucx-sockaddr 127.0.0.1 "${NPORT[A]}" >"$work/i.sockaddr" 2>&1
rc=$?
grep -v "^\[" "$work/i.sockaddr" | tail -2
check "(i) UCX client-server connect to the peer port: no answer to any active message" '[ $rc = 0 ]'
check "(i) counted: kvtier_net_refused_total{reason=\"preauth_malformed\"} >= 1" \
  'wait_metric A "kvtier_net_refused_total{reason=\"preauth_malformed\"}" ">=" 1 3'
if [ -n "$uct" ]; then
  timeout 30 "$att" ucx-worker 127.0.0.1 "$uct" >"$work/i.worker" 2>&1
  rc=$?
  grep -v "^\[" "$work/i.worker" | tail -2
  check "(i) wired up to R's worker through UCX's port: no answer, no software GET served" \
    '[ $rc = 0 ]'
  check "(i) counted on R: kvtier_net_refused_total{reason=\"unknown_conn\"} > 0" \
    'wait_metric R "kvtier_net_refused_total{reason=\"unknown_conn\"}" ">" 0 3'
  check "(i) R is alive" 'alive R'
fi
unset UCX_TLS UCX_NET_DEVICES ASAN_OPTIONS
check "(i) A is alive" 'alive A'
check "(i) A still serves its real peer B (kvtier_peers_up 2 on both)" \
  'wait_metric A kvtier_peers_up == 2 5 && wait_metric B kvtier_peers_up == 2 5'

# ---- (ii) hostile and random byte streams ----
t0=$(date +%s)
timeout 120 "$att" bytes 127.0.0.1 "${NPORT[A]}" 1 300 >"$work/ii.peer" 2>&1
rc=$?
cat "$work/ii.peer"
check "(ii) peer port: issue #21's 3 inputs, 64 frame streams, 300 random streams sent" '[ $rc = 0 ]'
check "(ii) A is alive after them" 'alive A'
check "(ii) counted as malformed (>= 3 more)" \
  'wait_metric A "kvtier_net_refused_total{reason=\"preauth_malformed\"}" ">=" 4 3'
if [ -n "$uct" ]; then
  timeout 120 "$att" bytes 127.0.0.1 "$uct" 2 300 >"$work/ii.uct" 2>&1
  rc=$?
  cat "$work/ii.uct"
  check "(ii) R's UCX port: the same streams sent" '[ $rc = 0 ]'
  check "(ii) R is alive after them" 'alive R'
fi
echo "# (ii) took $(($(date +%s) - t0)) s"
check "(ii) A still serves B" 'wait_metric A kvtier_peers_up == 2 5'
check "(ii) a new real peer C joins A after the attacks" 'start C 3 "${NPORT[A]}"'
check "(ii) A sees B and C (kvtier_peers_up 3)" 'wait_metric A kvtier_peers_up == 3 15'
curl -sf "http://127.0.0.1:${MPORT[A]}/metrics" | grep "kvtier_net_refused" >"$work/refused"
sed 's/^/# /' "$work/refused"

# ---- the residual: a uct PUT through R's UCX port ----
if [ -n "$uct" ]; then
  base=$(grep "kvt-peer-attacks-$$-R/primary.mmap" "/proc/${NPID[R]}/maps" | head -1 | cut -d- -f1)
  UCX_TLS=tcp UCX_NET_DEVICES=lo ASAN_OPTIONS=detect_leaks=0 \
    timeout 30 "$att" uct-put 127.0.0.1 "$uct" "0x$base" >"$work/residual" 2>&1
  grep "^uct-put" "$work/residual" | sed 's/^/# /'
  if head -c 64 "/dev/shm/kvt-peer-attacks-$$-R/primary.mmap" | grep -q "kvtier-uct-probe"; then
    echo "# RESIDUAL: 64 bytes written into R's primary (at 0x$base) through UCX's tcp port, unauthenticated"
  else
    echo "# residual probe: R's primary unchanged"
  fi
  check "R is alive after the probe" 'alive R'
fi

# ---- (iii) 2,000 idle connections, then SIGTERM ----
# stop NAME: SIGTERM, wait up to 30 s; sets stop_rc.
stop() {
  local p=${NPID[$1]}
  kill -TERM "$p"
  for _ in $(seq 300); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
  if kill -0 "$p" 2>/dev/null; then stop_rc=timeout; kill -KILL "$p"; wait "$p" 2>/dev/null
  else wait "$p"; stop_rc=$?; fi
}
idle_then_term() { # NAME PORT [CHECK]
  local ap
  coproc IDLE { "$att" idle 127.0.0.1 "$2" 2000; }
  ap=$IDLE_PID
  read -r -t 60 line <&"${IDLE[0]}"
  echo "# idle attacker on port $2: ${line:-nothing}"
  sleep 1
  [ -n "${3:-}" ] && "$3"
  stop "$1"
  kill -TERM "$ap" 2>/dev/null
  wait "$ap" 2>/dev/null
}
over_bound() {
  check "(iii) the connections over the pre-auth bound are counted (preauth_conns > 0)" \
    'wait_metric A "kvtier_net_refused_total{reason=\"preauth_conns\"}" ">" 0 3'
}
stop C
stop B
idle_then_term A "${NPORT[A]}" over_bound
echo "# (iii) A after 2,000 idle connections on the peer port and SIGTERM: exit $stop_rc"
check "(iii) 2,000 idle connections on the peer port, SIGTERM: exit 0" '[ "$stop_rc" = 0 ]'
grep -E "connections not yet authenticated" "$work/A.log" | head -1 | sed 's/^/# /'
if [ -n "$uct" ]; then
  idle_then_term R "$uct"
  echo "# (iii) R after 2,000 idle connections on UCX's port and SIGTERM: exit $stop_rc"
  check "(iii) 2,000 idle connections on R's UCX port, SIGTERM: exit 0" '[ "$stop_rc" = 0 ]'
  echo "# what UCX itself said on R (hostile bytes on its port among them):"
  grep -E "UCX +(ERROR|WARN)|Assertion|ucs_fatal" "$work/R.log" | grep -v "log.c:" |
    sed -E 's/^\[[^]]*\] \[[^]]*\] *//' | cut -c1-100 | sort | uniq -c | sort -rn | head -6 |
    sed 's/^/#   /'
fi

echo "# $pass passed, $fail failed"
[ "$fail" = 0 ]

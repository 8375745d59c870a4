#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Another user of the same host against a real kvtierd (issue #21, the local part):
# the daemon runs as root, the attacker as nobody (runuser). Each scenario plays one
# attack and checks that the daemon refuses with a clear error (exit 77 for an unsafe
# path), never deletes, joins or follows what the attacker made, and that forged
# chunk files are refused, removed and counted in /metrics.
#
#   local_attacks.sh KVTIERD KVTIER_LOAD TMPDIR
#
# Needs root (runuser to nobody, chown); exits 77 (ctest: skipped) without it.
set -uo pipefail
kvtierd=$1 load=$2 tmp=$3
pass=0 fail=0
pids=()

if [ "$(id -u)" != 0 ] || ! command -v runuser >/dev/null; then
  echo "local_attacks: needs root and runuser (plays another user): skipped"
  exit 77
fi
nobody() { runuser -u nobody -- "$@"; }

mkdir -p "$tmp"
work=$(mktemp -d "$tmp/local_attacks.XXXXXX")          # configs and logs: root only
shared=$(mktemp -d /dev/shm/kvt-sec-shared.XXXXXX)      # a folder every user may write
priv=$(mktemp -d /dev/shm/kvt-sec-priv.XXXXXX)          # root's own (0700)
chmod 1777 "$shared"
cleanup() {
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null; done
  [ -n "${KEEP:-}" ] || rm -rf "$work" "$shared" "$priv"
}
trap cleanup EXIT

ok() { pass=$((pass + 1)); echo "ok - $*"; }
bad() { fail=$((fail + 1)); echo "FAIL - $*"; }
check() { if eval "$2"; then ok "$1"; else bad "$1"; fi; }
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# cfg NAME REGION SOCKET STORAGE [METRICS_PORT]
cfg() {
  cat >"$work/$1.yaml" <<EOF
node:
  id: 0x5ec
primary:
  path: $2
  size: 16MiB
  row_bytes: 256KiB
storage:
  root: $4
  capacity: 64MiB
network:
  enabled: false
engine:
  socket: $3
metrics:
  port: ${5:-0}
log:
  level: info
EOF
}

# refuse NAME WANT_TEXT: the daemon must exit 77 at once, naming the cause.
refuse() {
  local name=$1 want=$2 rc
  timeout 30 "$kvtierd" --config "$work/$name.yaml" >"$work/$name.log" 2>&1
  rc=$?
  if [ "$rc" = 77 ] && grep -q -- "$want" "$work/$name.log"; then
    ok "$name: refused (exit 77): $(grep -m1 -- "$want" "$work/$name.log" | cut -c1-160)"
  else
    bad "$name: exit $rc, wanted 77 and '$want'; log: $(head -c 600 "$work/$name.log")"
  fi
}

# start NAME [ARGS...]: runs the daemon in the background until it is ready (pid in
# $dpid).
start() {
  local name=$1
  shift
  "$kvtierd" --config "$work/$name.yaml" "$@" >"$work/$name.log" 2>&1 &
  dpid=$!
  pids+=("$dpid")
  for _ in $(seq 1 300); do
    grep -q "kvtierd: ready" "$work/$name.log" 2>/dev/null && return 0
    kill -0 "$dpid" 2>/dev/null || return 1
    sleep 0.05
  done
  return 1
}
stop() {
  kill -TERM "$dpid" 2>/dev/null
  for _ in $(seq 1 100); do kill -0 "$dpid" 2>/dev/null || break; sleep 0.1; done
  wait "$dpid" 2>/dev/null
}

# ---- 5a. The region in a folder others may write: a file nobody made there first ----
nobody sh -c "echo attacker >$shared/a.mmap"
cfg a "$shared/a.mmap" "$priv/a.sock" "$priv/store-a"
refuse a "writable by group or others"
check "a: nobody's file at primary.path is still there, untouched" \
  '[ "$(cat $shared/a.mmap)" = attacker ] && [ "$(stat -c %U $shared/a.mmap)" = nobody ]'

# ---- 5b. The runtime folder made first by nobody, with a region file in it ----
nobody mkdir -m 0777 "$shared/rt-b"
nobody sh -c "echo attacker >$shared/rt-b/primary.mmap"
cfg b "$shared/rt-b/primary.mmap" "$shared/rt-b/engine.sock" "$priv/store-b"
refuse b "owned by uid 65534"
check "b: nobody's region file is neither removed nor joined" \
  '[ "$(cat $shared/rt-b/primary.mmap)" = attacker ] && [ ! -e $shared/rt-b/primary.mmap.lock ]'

# ---- 5c. A region file that is not ours inside our own folder (the creation window) ----
mkdir -m 0700 "$priv/rt-c"
echo attacker >"$priv/rt-c/primary.mmap"
chown nobody "$priv/rt-c/primary.mmap"
chmod 0666 "$priv/rt-c/primary.mmap"
cfg c "$priv/rt-c/primary.mmap" "$priv/rt-c/engine.sock" "$priv/store-c"
refuse c "not a region this daemon created (it is owned by uid 65534)"
check "c: the foreign region file is kept as it was" \
  '[ "$(cat $priv/rt-c/primary.mmap)" = attacker ] && [ "$(stat -c %U $priv/rt-c/primary.mmap)" = nobody ]'

# ---- 5d. flock on <region>.lock ----
# In a folder everyone may write, nobody takes the lock first: the daemon does not
# start there at all, and says why.
nobody flock "$shared/d.mmap.lock" sleep 10 &
pids+=($!)
sleep 0.3
cfg d1 "$shared/d.mmap" "$priv/d1.sock" "$priv/store-d1"
refuse d1 "writable by group or others"
# In the daemon's own runtime folder nobody cannot even open the lock file, though
# the folder sits in one that everyone may write (as /run/kvtier/<id> sits in /run).
cfg d2 "$shared/rt-d/primary.mmap" "$shared/rt-d/engine.sock" "$priv/store-d2"
check "d2: the daemon creates its runtime folder 0700 and starts" 'start d2'
stop
check "d2: runtime folder is root's, mode 0700" \
  '[ "$(stat -c %U:%a $shared/rt-d)" = root:700 ]'
check "d2: nobody cannot take the lock" \
  '! nobody flock -n "$shared/rt-d/primary.mmap.lock" true 2>/dev/null'
# A process of another user that holds our lock file open (an fd it was handed):
# refused, with its pid and uid.
python3 - "$shared/rt-d/primary.mmap.lock" <<'EOF' &
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
os.setgid(65534); os.setuid(65534)
fcntl.flock(fd, fcntl.LOCK_EX)
time.sleep(30)
EOF
holder=$!
pids+=("$holder")
sleep 0.5
refuse d2 "held by pid $holder of another user (uid 65534)"
kill "$holder" 2>/dev/null

# ---- 5e. A symlink at the lock path ----
nobody ln -s "$priv/e-target" "$shared/e.mmap.lock"
cfg e1 "$shared/e.mmap" "$priv/e1.sock" "$priv/store-e1"
refuse e1 "writable by group or others"
check "e1: the link's target was not created" '[ ! -e $priv/e-target ]'
mkdir -m 0700 "$priv/rt-e"
ln -s "$priv/e-target" "$priv/rt-e/primary.mmap.lock"
cfg e2 "$priv/rt-e/primary.mmap" "$priv/rt-e/engine.sock" "$priv/store-e2"
refuse e2 "is a symbolic link"
check "e2: the link's target was not created" '[ ! -e $priv/e-target ]'

# ---- 5f. primary.path naming an unrelated file ----
mkdir -m 0700 "$priv/data"
echo "precious" >"$priv/data/important.db"
cfg f "$priv/data/important.db" "$priv/f.sock" "$priv/store-f"
refuse f "not a region this daemon created (the lock file records no region)"
check "f: the unrelated file is not deleted" '[ "$(cat $priv/data/important.db)" = precious ]'
check "f: the refused start leaves no lock file of its own behind" '[ ! -e $priv/data/important.db.lock ]'

# ---- 6a. The storage root made first by nobody ----
mkdir -m 0700 "$priv/rt-g" # (so that a daemon without runtime folders gets as far)
nobody mkdir -m 0755 "$shared/store-g"
cfg g "$priv/rt-g/primary.mmap" "$priv/rt-g/engine.sock" "$shared/store-g"
refuse g "owned by uid 65534"
check "g: nothing written into nobody's folder" '[ -z "$(ls -A $shared/store-g)" ]'

# ---- 6b. Chunk files: private, and forged ones refused ----
mport=$(free_port)
mkdir -m 0700 "$priv/rt-h"
store=$shared/store-h # made by the daemon in a folder everyone may enter
cfg h "$priv/rt-h/primary.mmap" "$priv/rt-h/engine.sock" "$store" "$mport"
check "h: the daemon starts with its storage root" 'start h'
# 64 chunks of primary: a load of 3 s writes many more, evicted to the storage tier.
"$load" --node "$priv/rt-h/engine.sock" --engines-per-node 2 --duration 3 --quiet >"$work/h-load" 2>&1
stop
mapfile -t chunks < <(find "$store" -name '*.kvc' | sort)
echo "# h: ${#chunks[@]} chunk files on disk"
check "h: chunks were written to the storage tier" '[ ${#chunks[@]} -ge 3 ]'
check "h: chunk files 0600, folders 0700, key file 0600" \
  '[ -z "$(find $store -type f ! -perm 0600)" ] && [ -z "$(find $store -type d ! -perm 0700)" ] && [ "$(stat -c %a $store/storage.key)" = 600 ]'
check "h: nobody cannot read a chunk file" '! nobody cat "${chunks[0]:-/nonexistent}" >/dev/null 2>&1'
[ ${#chunks[@]} -ge 3 ] || { echo "# local_attacks: no chunk files to forge"; exit 1; }
# Forge: chunk 0 becomes a valid file of the old format (header and XXH3 sums right,
# the row the attacker's); chunk 1 keeps our format with one header byte changed.
python3 - "${chunks[0]}" "${chunks[1]}" <<'EOF'
import ctypes, struct, sys
xxh = ctypes.CDLL("libxxhash.so.0")
xxh.XXH3_64bits.restype = ctypes.c_uint64
xxh.XXH3_64bits.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
def h(b): return xxh.XXH3_64bits(bytes(b), len(b))
with open(sys.argv[1], "rb") as f:
    old = f.read()
row_len = struct.unpack_from("<Q", old, 16)[0]
row = b"\xee" * row_len
blk = bytearray(4096)
blk[0:4] = b"KVTS"
struct.pack_into("<HHIIQ", blk, 4, 1, struct.unpack_from("<H", old, 6)[0], 4096, 0, row_len)
blk[24:56] = old[24:56]      # the namespace
blk[56:120] = old[56:120]    # the key
struct.pack_into("<Q", blk, 120, h(row))
struct.pack_into("<Q", blk, 128, h(blk))
with open(sys.argv[1], "wb") as f:
    f.write(bytes(blk) + row)
with open(sys.argv[2], "r+b") as f:
    f.seek(16)
    f.write(struct.pack("<Q", row_len))  # same value: MAC intact...
    f.seek(200)
    f.write(b"\x01")                     # ...but a padding byte changed
EOF
check "h: the daemon restarts over the forged files" 'start h'
sleep 1.3 # the next /metrics snapshot
curl -sf "http://127.0.0.1:$mport/metrics" >"$work/h-metrics"
check "h: the forged files are removed" '[ ! -e "${chunks[0]}" ] && [ ! -e "${chunks[1]}" ]'
check "h: counted: old format 1, MAC failures 1 (in /metrics)" \
  'grep -q "^kvtier_storage_old_format_files_total{.*} 1$" $work/h-metrics && grep -q "^kvtier_storage_mac_failures_total{.*} 1$" $work/h-metrics && grep -q "^kvtier_storage_checksum_failures_total{.*} 2$" $work/h-metrics'
check "h: the other chunks survived the restart (warm restart, keyed format)" \
  'grep -q "$(( ${#chunks[@]} - 2 )) chunk file(s)" $work/h.log'
stop

# ---- node.group: engines of another user reach the runtime folder, nobody else ----
cfg i "$shared/rt-i/primary.mmap" "$shared/rt-i/engine.sock" "$priv/store-i"
check "i: starts with node.group=nogroup" 'start i --set node.group=nogroup'
stop
check "i: runtime folder 0750, group nogroup" '[ "$(stat -c %U:%G:%a $shared/rt-i)" = root:nogroup:750 ]'
check "i: a member of the group may enter it" 'nobody ls "$shared/rt-i" >/dev/null'

# ---- 7. The engine socket is not a name in /tmp ----
"$kvtierd" --dump >"$work/dump" 2>&1
check "7: default socket, region and storage are under /run/kvtier and /var/lib/kvtier" \
  'grep -q "socket: \"/run/kvtier/[0-9a-f]*/engine.sock\"" $work/dump && grep -q "path: \"/run/kvtier/[0-9a-f]*/primary.mmap\"" $work/dump && grep -q "root: \"/var/lib/kvtier/[0-9a-f]*\"" $work/dump'
check "7: nobody cannot bind the socket in the daemon's runtime folder" \
  "! nobody python3 -c 'import socket; socket.socket(socket.AF_UNIX).bind(\"$shared/rt-d/engine.sock\")' 2>/dev/null"

echo "# local_attacks: $pass passed, $fail failed"
[ "$fail" = 0 ]

#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Static checks of docker/ that need no container engine (ctest docker_files, label
# unit). Usage: check.sh REPO_ROOT [KVTIERD]
#  - the compose files parse as YAML (python3-yaml) and, with compose's ${VAR:-default}
#    defaults applied: the repository root's compose.yaml includes docker/compose.yaml;
#    node0..node2 (runtime target) have memlock unlimited, fixed distinct addresses
#    on one private bridge subnet, KVT_PEERS naming them in role order, the secret, a
#    /healthz healthcheck, /dev/shm large enough for the primary region, ipc
#    shareable, the volumes nodeN-run at /run/kvtier and one at /var/lib/kvtier,
#    peers and /metrics published on 127.0.0.1 at distinct host ports, KVT_RDMA off
#    and KVT_TRANSPORT ucx with no device, and every variable the entrypoint reads
#    passed through from the shell (but the per-node ones); merged with
#    docker/compose.rdma.yaml they have /dev/infiniband, the uverbs cgroup rule and
#    NET_ADMIN + IPC_LOCK; the test profile likewise (test target); the engine
#    service joins node0's IPC namespace, mounts node0-run read-only, runs as a user
#    with group_add = KVT_ENGINE_GID (the Dockerfile's KVT_GID), without network or
#    secret, after node0 is healthy; with docker compose v2 installed, `docker compose
#    config` from the repository root accepts each combination;
#  - entrypoint.sh passes `bash -n` and shellcheck (when installed; said when not);
#    its `config` mode writes YAML whose keys all exist in node/config.c's schema,
#    leaves the node's own address out of network.peers, and refuses bad values with
#    exit status 78; with KVTIERD, `kvtierd --config <that file> --check` accepts it;
#  - the Dockerfile's COPY/ADD sources exist in the repository and are not excluded by
#    docker/.dockerignore, COPY --from names a stage, every /src/... path a RUN needs
#    exists (paths the RUN tests with -d/-e/-f first are optional), and
#    docker/Dockerfile.dockerignore is docker/.dockerignore; the runtime stage is the
#    package from tools/build-deb installed by docker/install-runtime.sh in one RUN,
#    the entrypoint, tini (what tests/docker/test_rootfs.sh builds and starts).
# Each failure prints one line "FAIL: ..."; the exit status is the number of failures
# (capped at 100), 0 when all pass.
set -uo pipefail
ROOT=${1:?usage: check.sh REPO_ROOT [KVTIERD]}
KVTIERD=${2:-}
D=$ROOT/docker
fails=0
fail() {
    echo "FAIL: $*"
    fails=$((fails + 1))
}
pass() { echo "ok: $*"; }

# Debian's python3 (python3-yaml), not whatever python3 comes first on PATH.
PY=/usr/bin/python3
[ -x "$PY" ] || PY=$(command -v python3)
if ! "$PY" -c 'import yaml' 2>/dev/null; then
    echo "FAIL: $PY has no yaml module (Debian package python3-yaml, tools/install-deps)"
    exit 1
fi

for f in Dockerfile compose.yaml entrypoint.sh README.md .dockerignore; do
    [ -f "$D/$f" ] || fail "docker/$f is missing"
done
[ -x "$D/entrypoint.sh" ] || fail "docker/entrypoint.sh is not executable"

# ---- entrypoint.sh ---------------------------------------------------------------------
if bash -n "$D/entrypoint.sh"; then pass "bash -n entrypoint.sh"; else fail "bash -n entrypoint.sh"; fi
if command -v shellcheck >/dev/null; then
    if shellcheck -x "$D/entrypoint.sh" "$0"; then
        pass "shellcheck entrypoint.sh check.sh"
    else
        fail "shellcheck entrypoint.sh check.sh"
    fi
else
    fail "shellcheck is not installed (tools/install-deps installs it)"
fi

TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

# config mode: the YAML it writes, and what it refuses.
cfg_env=(env -i PATH="$PATH" KVT_ADDR=10.78.0.12 KVT_RUN_DIR="$TMP/run" KVT_ENGINE_GID=970
    KVT_PEERS="10.78.0.11 10.78.0.12,10.78.0.13:7171")
if "${cfg_env[@]}" "$D/entrypoint.sh" config >"$TMP/kvtierd.yaml" 2>"$TMP/config.err"; then
    pass "entrypoint.sh config"
else
    fail "entrypoint.sh config exited $?: $(cat "$TMP/config.err")"
fi
schema=$ROOT/node/config.c
[ -f "$schema" ] || schema=$ROOT/node/config.c.wip
"$PY" - "$TMP/kvtierd.yaml" "$schema" <<'EOF' || fails=$((fails + 1))
import re, sys, yaml
path, schema = sys.argv[1], sys.argv[2]
try:
    cfg = yaml.safe_load(open(path))
except yaml.YAMLError as e:
    print(f"FAIL: the config entrypoint.sh writes is not YAML: {e}")
    sys.exit(1)
keys = set(re.findall(r'^\s*\{"([a-z_]+\.[a-z_]+)",', open(schema).read(), re.M))
if not keys:
    print(f"FAIL: no schema keys found in {schema}")
    sys.exit(1)
flat = {}
def walk(d, prefix=""):
    for k, v in d.items():
        name = f"{prefix}.{k}" if prefix else k
        if isinstance(v, dict):
            walk(v, name)
        else:
            flat[name] = v
walk(cfg)
bad = []
unknown = sorted(set(flat) - keys)
if unknown:
    bad.append(f"keys not in {schema}: {unknown}")
if flat.get("network.listen") != "10.78.0.12":
    bad.append(f"network.listen is {flat.get('network.listen')!r}, want '10.78.0.12'")
if flat.get("engine.socket") != "/run/kvtier/engine.sock" or flat.get("engine.socket_group") != "970":
    bad.append("engine.socket is not /run/kvtier/engine.sock in group 970 (KVT_ENGINE_GID)")
if flat.get("network.transport") != "ucx":
    bad.append(f"network.transport is {flat.get('network.transport')!r}: ucx by default")
if flat.get("network.peers") != ["10.78.0.11:7170", "10.78.0.13:7171"]:
    bad.append(f"network.peers is {flat.get('network.peers')!r}: want the two others")
for k in ("cluster.secret_file", "network.transport", "primary.size", "metrics.port",
          "primary.path", "engine.socket", "engine.socket_mode", "engine.socket_group"):
    if k not in flat:
        bad.append(f"{k} is not written")
for b in bad:
    print(f"FAIL: entrypoint.sh config: {b}")
if not bad:
    print(f"ok: entrypoint.sh config: {len(flat)} keys, all in the schema")
sys.exit(1 if bad else 0)
EOF

refuse() { # description env...
    local what=$1 rc
    shift
    env -i PATH="$PATH" KVT_RUN_DIR="$TMP/run" KVT_ADDR=10.78.0.12 "$@" \
        "$D/entrypoint.sh" config >/dev/null 2>"$TMP/refuse.err"
    rc=$?
    if [ "$rc" -eq 78 ]; then
        pass "entrypoint.sh refuses $what (78: $(head -c 100 "$TMP/refuse.err"))"
    else
        fail "entrypoint.sh config with $what exited $rc, want 78"
    fi
}
refuse "a port out of range" KVT_PORT=70000
refuse "a quote in a peer" 'KVT_PEERS=10.78.0.11 a"b'
refuse "an unknown transport" KVT_TRANSPORT=tcp
refuse "a non-numeric node id" KVT_NODE_ID=abc
refuse "a KVT_SET without =" KVT_SET=log.level
refuse "a group name as KVT_ENGINE_GID" KVT_ENGINE_GID=kvtier
refuse "an unknown KVT_RDMA" KVT_RDMA=roce

if [ -n "$KVTIERD" ]; then
    mkdir -p "$TMP/run"
    head -c 32 /dev/urandom >"$TMP/run/secret"
    chmod 600 "$TMP/run/secret"
    # The address must be this machine's for kvtierd to accept network.listen.
    "${cfg_env[@]/KVT_ADDR=10.78.0.12/KVT_ADDR=127.0.0.1}" KVT_TRANSPORT=ucx \
        "$D/entrypoint.sh" config >"$TMP/local.yaml" 2>/dev/null
    # Leaks are the node tests' business (kvtierd --check leaked the loaded config on
    # 2026-12-03); this asks whether the file is accepted.
    if ASAN_OPTIONS=detect_leaks=0 "$KVTIERD" --config "$TMP/local.yaml" --check \
        >"$TMP/check.out" 2>&1; then
        pass "kvtierd --check accepts the entrypoint's config"
    else
        fail "kvtierd --check refuses the entrypoint's config: $(tail -3 "$TMP/check.out")"
    fi
else
    echo "note: no kvtierd given: the config was checked against the schema table only"
fi

# ---- compose files ---------------------------------------------------------------------
"$PY" - "$ROOT" <<'EOF' || fails=$((fails + 1))
import ipaddress, os, re, sys, yaml
root = sys.argv[1]
D = os.path.join(root, "docker")
errs = []

def load(path):
    try:
        return yaml.safe_load(open(path))
    except (OSError, yaml.YAMLError) as e:
        print(f"FAIL: {os.path.relpath(path, root)}: {e}")
        sys.exit(1)

# compose's interpolation with every variable unset: ${X:-d} and ${X-d} -> d.
def interp(v):
    if isinstance(v, str):
        if re.search(r"\$\{[A-Za-z_][A-Za-z0-9_]*(:?\?)", v):
            errs.append(f"{v!r} requires a variable to be set")
        v = re.sub(r"\$\{[A-Za-z_][A-Za-z0-9_]*:?-([^}]*)\}", r"\1", v)
        return re.sub(r"\$\{[A-Za-z_][A-Za-z0-9_]*\}", "", v)
    if isinstance(v, list):
        return [interp(x) for x in v]
    if isinstance(v, dict):
        return {k: interp(x) for k, x in v.items()}
    return v

# compose's merge of an override file, for what docker/compose.rdma.yaml uses:
# mappings merged key by key, sequences extended.
def merge(a, b):
    if isinstance(a, dict) and isinstance(b, dict):
        out = dict(a)
        for k, v in b.items():
            out[k] = merge(a[k], v) if k in a else v
        return out
    if isinstance(a, list) and isinstance(b, list):
        return a + [x for x in b if x not in a]
    return b

# The repository root's compose.yaml: what `docker compose up` finds there.
top = load(os.path.join(root, "compose.yaml")) or {}
inc = [i if isinstance(i, str) else (i or {}).get("path") for i in top.get("include") or []]
inc = [x if isinstance(x, str) else (x or [None])[0] for x in inc]
if inc != ["docker/compose.yaml"]:
    errs.append(f"compose.yaml (root): include is {inc}, want ['docker/compose.yaml']")

raw = load(os.path.join(D, "compose.yaml"))
doc = interp(raw)
rdma = merge(doc, interp(load(os.path.join(D, "compose.rdma.yaml"))))

UNITS = {"": 1, "b": 1, "k": 1024, "kb": 1024, "m": 1 << 20, "mb": 1 << 20, "g": 1 << 30,
         "gb": 1 << 30, "kib": 1024, "mib": 1 << 20, "gib": 1 << 30}
def size(s):
    m = re.fullmatch(r"\s*(\d+)\s*([A-Za-z]*)\s*", str(s))
    if not m or m.group(2).lower() not in UNITS:
        raise ValueError(f"bad size {s!r}")
    return int(m.group(1)) * UNITS[m.group(2).lower()]

def env_of(svc):
    e = svc.get("environment") or {}
    if isinstance(e, list):
        e = dict(x.split("=", 1) for x in e)
    return {k: "" if v is None else str(v) for k, v in e.items()}

def volumes_of(svc):  # [(source, target, ro)]
    out = []
    for v in svc.get("volumes") or []:
        if isinstance(v, dict):
            out.append((v.get("source"), v.get("target"), bool(v.get("read_only"))))
        else:
            p = str(v).split(":")
            out.append((p[0], p[1] if len(p) > 1 else p[0], len(p) > 2 and "ro" in p[2]))
    return out

def check_rdma(name, svc):
    devs = [str(d).split(":")[0] for d in svc.get("devices") or []]
    if not any(d == "/dev/infiniband" or d.startswith("/dev/infiniband/") for d in devs):
        errs.append(f"{name}: no /dev/infiniband device")
    rules = [str(r).split() for r in svc.get("device_cgroup_rules") or []]
    if not any(r[:2] == ["c", "231:*"] and "r" in r[-1] and "w" in r[-1] and "m" in r[-1]
               for r in rules):
        errs.append(f"{name}: no device_cgroup_rules 'c 231:* rmw' (uverbs nodes)")
    caps = {str(c).upper().removeprefix("CAP_") for c in svc.get("cap_add") or []}
    for c in ("NET_ADMIN", "IPC_LOCK"):
        if c not in caps:
            errs.append(f"{name}: cap_add lacks {c}")

def check_service(d, name, want_health, target, rdma_needed):
    services, nets, secrets = d.get("services") or {}, d.get("networks") or {}, d.get("secrets") or {}
    svc = services.get(name)
    if svc is None:
        errs.append(f"service {name} is missing")
        return None
    if rdma_needed:
        check_rdma(name, svc)
    ml = (svc.get("ulimits") or {}).get("memlock")
    if not (ml == -1 or (isinstance(ml, dict) and ml.get("soft") == -1 and ml.get("hard") == -1)):
        errs.append(f"{name}: ulimits memlock is {ml!r}, want -1 (soft and hard)")
    sec = [s if isinstance(s, str) else s.get("source") for s in svc.get("secrets") or []]
    if not sec:
        errs.append(f"{name}: no secret")
    for s in sec:
        if s not in secrets or not (secrets[s] or {}).get("file"):
            errs.append(f"{name}: secret {s} is not defined with a file")
    env = env_of(svc)
    if env.get("KVT_SECRET_FILE", "/run/secrets/kvtier_secret") not in \
            [f"/run/secrets/{s}" for s in sec]:
        errs.append(f"{name}: KVT_SECRET_FILE is not one of its secrets")
    try:
        if size(svc.get("shm_size", "64m")) < size(env.get("KVT_PRIMARY_SIZE", "512MiB")):
            errs.append(f"{name}: shm_size is smaller than KVT_PRIMARY_SIZE")
    except ValueError as e:
        errs.append(f"{name}: {e}")
    b = svc.get("build") or {}
    df = os.path.normpath(os.path.join(D, b.get("context", "."), b.get("dockerfile", "Dockerfile")))
    if not b or df != os.path.normpath(os.path.join(D, "Dockerfile")):
        errs.append(f"{name}: build does not point to docker/Dockerfile ({df})")
    elif b.get("target") != target:
        errs.append(f"{name}: build target {b.get('target')!r}, want {target!r}")
    if want_health:
        t = (svc.get("healthcheck") or {}).get("test") or []
        t = " ".join(t) if isinstance(t, list) else str(t)
        if "/healthz" not in t:
            errs.append(f"{name}: healthcheck does not ask /healthz")
    sn = svc.get("networks") or {}
    if not isinstance(sn, dict) or len(sn) != 1:
        errs.append(f"{name}: want exactly one network with a fixed address")
        return None
    (net, conf), = sn.items()
    addr = (conf or {}).get("ipv4_address")
    if net not in nets:
        errs.append(f"{name}: network {net} is not defined")
        return None
    n = nets[net] or {}
    if n.get("driver", "bridge") != "bridge":
        errs.append(f"network {net} is not a bridge")
    subnets = [ipaddress.ip_network(c["subnet"]) for c in (n.get("ipam") or {}).get("config") or []
               if "subnet" in c]
    if not subnets or not all(s.is_private for s in subnets):
        errs.append(f"network {net} has no private subnet")
    try:
        ip = ipaddress.ip_address(addr)
        if not any(ip in s for s in subnets):
            errs.append(f"{name}: {addr} is outside network {net}'s subnet")
    except ValueError:
        errs.append(f"{name}: no fixed ipv4_address ({addr!r})")
        return None
    return addr, env

def check_group(d, names, want_health, mode, target, rdma_needed):
    got = [check_service(d, n, want_health, target, rdma_needed) for n in names]
    if None in got:
        return
    services = d["services"]
    addrs = [a for a, _ in got]
    if len(set(addrs)) != len(addrs):
        errs.append(f"{names}: addresses are not distinct: {addrs}")
    for n, (a, env) in zip(names, got):
        peers = env.get("KVT_PEERS", "").replace(",", " ").split()
        if [p.split(":")[0] for p in peers] != addrs:
            errs.append(f"{n}: KVT_PEERS {peers} is not {addrs} (the group's addresses in order)")
        cmd = services[n].get("command")
        cmd = cmd if isinstance(cmd, list) else str(cmd or "daemon").split()
        if (cmd or ["daemon"])[0] != mode:
            errs.append(f"{n}: command {cmd}, want {mode!r}")
    if mode == "test":
        roles = [got[i][1].get("KVT_ROLE") for i in range(len(names))]
        if roles != [str(i) for i in range(len(names))]:
            errs.append(f"{names}: KVT_ROLE {roles}, want 0..{len(names) - 1} in address order")
        for n in names:
            if "test" not in (services[n].get("profiles") or []):
                errs.append(f"{n}: not in the profile 'test'")
            if not any(t == "/results" for _, t, _ in volumes_of(services[n])):
                errs.append(f"{n}: no results volume on /results")
            if env_of(services[n]).get("KVT_RDMA", "rxe") != "rxe":
                errs.append(f"{n}: the test runs on soft-RoCE: KVT_RDMA must be rxe")

nodes = ["node0", "node1", "node2"]
# The default cluster: UCX over tcp, nothing of RDMA needed from the host.
check_group(doc, nodes, True, "daemon", "runtime", False)
# With docker/compose.rdma.yaml: soft-RoCE devices, capabilities, verbs.
check_group(rdma, nodes, True, "daemon", "runtime", True)
check_group(doc, ["test0", "test1", "test2"], False, "test", "test", True)

# What every default node has for real use.
entry = open(os.path.join(D, "entrypoint.sh")).read()
read_vars = set(re.findall(r"\$\{(KVT_[A-Z_]+)", entry))
per_node = {"KVT_ADDR", "KVT_NODE_ID", "KVT_PEERS"}  # one value for all: nodes alike
per_node.add("KVT_SECRET_FILE")  # where compose mounts the secret (the host's: KVT_SECRET_FILE_HOST)
test_only = {"KVT_ROLE", "KVT_GUESTS", "KVT_RESULTS_ROOT", "KVT_BARRIER_TIMEOUT",
             "KVT_CLUSTER_TEST", "KVT_RESULTS", "KVT_KVTIERD"}
services = doc.get("services") or {}
published = []
gid_default = None
for n in nodes:
    svc, rsvc = services.get(n) or {}, (raw.get("services") or {}).get(n) or {}
    env, renv = env_of(svc), env_of(rsvc)
    for v in sorted(read_vars - per_node - test_only):
        if v not in renv:
            errs.append(f"{n}: {v} (read by the entrypoint) is not in its environment")
        elif "${" + v not in renv[v]:
            errs.append(f"{n}: {v} is {renv[v]!r}: not passed through from the shell (${{{v}:-...}})")
    for v in sorted(per_node & set(renv)):
        if v != "KVT_PEERS" and "${" in renv[v]:
            errs.append(f"{n}: {v} comes from the shell: one value would make every node alike")
    if env.get("KVT_RDMA") != "off" or env.get("KVT_TRANSPORT") != "ucx":
        errs.append(f"{n}: defaults KVT_RDMA={env.get('KVT_RDMA')} KVT_TRANSPORT="
                    f"{env.get('KVT_TRANSPORT')}, want off and ucx (tcp unless opted in)")
    if svc.get("devices") or svc.get("device_cgroup_rules"):
        errs.append(f"{n}: devices in the default node: a host without RDMA could not start it")
    if svc.get("ipc") != "shareable":
        errs.append(f"{n}: ipc is {svc.get('ipc')!r}, want shareable (engines join it)")
    vols = volumes_of(svc)
    if (f"{n}-run", "/run/kvtier", False) not in vols:
        errs.append(f"{n}: no volume {n}-run at /run/kvtier (the engine socket's folder)")
    elif f"{n}-run" not in (doc.get("volumes") or {}):
        errs.append(f"{n}: volume {n}-run is not defined")
    if not any(t == "/var/lib/kvtier" for _, t, _ in vols):
        errs.append(f"{n}: no volume at /var/lib/kvtier (the storage tier)")
    ports = {}
    for p in svc.get("ports") or []:
        parts = str(p).split(":")
        if len(parts) != 3:
            errs.append(f"{n}: port {p!r}: want HOST_IP:HOST_PORT:CONTAINER_PORT")
            continue
        ports[parts[2]] = parts[:2]
        published.append(parts[1])
    for want in (env.get("KVT_PORT"), env.get("KVT_METRICS_PORT")):
        if want not in ports:
            errs.append(f"{n}: container port {want} (peers, /metrics) is not published")
        elif ports[want][0] != "127.0.0.1":
            errs.append(f"{n}: port {want} published on {ports[want][0]}, want 127.0.0.1 by default")
    gid_default = env.get("KVT_ENGINE_GID")
if len(set(published)) != len(published):
    errs.append(f"host ports published twice: {published}")

# The engine service: the node's socket volume (read-only) and IPC namespace only.
eng = services.get("engine")
if eng is None:
    errs.append("service engine is missing")
else:
    if "engine" not in (eng.get("profiles") or []):
        errs.append("engine: not in the profile 'engine' (up would start it with the nodes)")
    if eng.get("ipc") != "service:node0":
        errs.append(f"engine: ipc {eng.get('ipc')!r}, want 'service:node0'")
    if volumes_of(eng) != [("node0-run", "/run/kvtier", True)]:
        errs.append(f"engine: volumes {volumes_of(eng)}, want node0-run at /run/kvtier read-only")
    if [str(g) for g in eng.get("group_add") or []] != [gid_default]:
        errs.append(f"engine: group_add {eng.get('group_add')}, want [{gid_default}] (KVT_ENGINE_GID)")
    if str(eng.get("user", "root")).split(":")[0] in ("root", "0"):
        errs.append("engine: runs as root: an engine of another image is another user")
    if eng.get("network_mode") != "none" or eng.get("secrets"):
        errs.append("engine: want network_mode none and no secret (it needs neither)")
    if ((eng.get("depends_on") or {}).get("node0") or {}).get("condition") != "service_healthy":
        errs.append("engine: does not wait for node0's healthcheck")
    if "/run/kvtier/engine.sock" not in " ".join(map(str, eng.get("command") or [])):
        errs.append("engine: its command does not name /run/kvtier/engine.sock")
dockerfile = open(os.path.join(D, "Dockerfile")).read()
m = re.search(r"^ARG KVT_GID=(\d+)", dockerfile, re.M)
if not m or m.group(1) != gid_default:
    errs.append(f"KVT_ENGINE_GID default {gid_default} is not the Dockerfile's ARG KVT_GID "
                f"({m.group(1) if m else 'none'})")

for e in errs:
    print(f"FAIL: compose: {e}")
if not errs:
    print(f"ok: compose files: {len(services)} services, the rdma override and the root include checked")
sys.exit(1 if errs else 0)
EOF

# The same files as compose itself reads them (no engine needed), from the repository
# root as a user types it; said when no compose v2 is installed.
compose=()
if docker compose version >/dev/null 2>&1; then
    compose=(docker compose)
elif command -v docker-compose >/dev/null && docker-compose version 2>/dev/null | grep -q 'v2\.'; then
    compose=(docker-compose)
fi
if [ ${#compose[@]} -gt 0 ]; then
    for args in "" "--profile engine" "--profile test" "-f compose.yaml -f docker/compose.rdma.yaml" \
        "-f docker/compose.yaml"; do
        # shellcheck disable=SC2086 # args are words
        if (cd "$ROOT" && "${compose[@]}" $args config -q) 2>"$TMP/compose.err"; then
            pass "${compose[*]} $args config (from the repository root)"
        else
            fail "${compose[*]} $args config: $(head -3 "$TMP/compose.err")"
        fi
    done
else
    fail "no docker compose v2 to parse the compose files (tools/install-deps installs it)"
fi

# ---- Dockerfile ------------------------------------------------------------------------
if [ -L "$D/Dockerfile.dockerignore" ] && [ "$(readlink "$D/Dockerfile.dockerignore")" = .dockerignore ]; then
    pass "docker/Dockerfile.dockerignore links to .dockerignore"
else
    fail "docker/Dockerfile.dockerignore is not a link to .dockerignore"
fi
"$PY" - "$D/Dockerfile" "$D/.dockerignore" "$ROOT" <<'EOF' || fails=$((fails + 1))
import fnmatch, os, re, shlex, sys
dockerfile, ignore, root = sys.argv[1:4]
errs = []
# Instructions: comment lines dropped, continuation lines joined.
instrs, cur = [], ""
for line in open(dockerfile):
    s = line.rstrip("\n")
    if re.match(r"\s*#", s) or (not s.strip() and not cur):
        continue
    if s.endswith("\\"):
        cur += s[:-1] + " "
        continue
    cur += s
    if cur.strip():
        instrs.append(cur.strip())
    cur = ""
patterns = [p.strip() for p in open(ignore) if p.strip() and not p.lstrip().startswith("#")]
def ignored(rel):
    parts = rel.split("/")
    for i in range(1, len(parts) + 1):
        sub = "/".join(parts[:i])
        for p in patterns:
            neg = p.startswith("!")
            p = p.lstrip("!").strip("/")
            if fnmatch.fnmatch(sub, p) or (p.startswith("**/") and
                                            fnmatch.fnmatch(parts[i - 1], p[3:])):
                if not neg:
                    return p
    return None
stages, copies = set(), 0
for ins in instrs:
    op, _, rest = ins.partition(" ")
    op = op.upper()
    if op == "FROM":
        m = re.search(r"\bAS\s+(\S+)", rest, re.I)
        if m:
            stages.add(m.group(1))
    elif op in ("COPY", "ADD"):
        args = shlex.split(rest)
        flags = [a for a in args if a.startswith("--")]
        paths = [a for a in args if not a.startswith("--")]
        frm = [f.split("=", 1)[1] for f in flags if f.startswith("--from=")]
        if frm:
            if frm[0] not in stages:
                errs.append(f"COPY --from={frm[0]}: no such stage before it")
            continue
        for src in paths[:-1]:
            copies += 1
            rel = os.path.normpath(src).lstrip("/")
            if not os.path.exists(os.path.join(root, rel)):
                errs.append(f"{op} {src}: not in the repository")
            elif ignored(rel):
                errs.append(f"{op} {src}: excluded by .dockerignore ({ignored(rel)})")
    elif op == "RUN":
        for p in set(re.findall(r"/src/([A-Za-z0-9_.\-/]+)", rest)):
            p = p.rstrip("/")
            optional = re.search(r"-[def]\s+/src/" + re.escape(p) + r"\b", rest)
            if not optional and not os.path.exists(os.path.join(root, p)):
                errs.append(f"RUN uses /src/{p}: not in the repository")
# The runtime stage is what tests/docker/test_rootfs.sh builds: the package from
# tools/build-deb installed by docker/install-runtime.sh, the entrypoint, tini.
stage, body = None, {}
for ins in instrs:
    op, _, rest = ins.partition(" ")
    if op.upper() == "FROM":
        m = re.search(r"\bAS\s+(\S+)", rest, re.I)
        stage = m.group(1) if m else None
    body.setdefault(stage, []).append(ins)
rt = "\n".join(body.get("runtime", []))
bl = "\n".join(body.get("builder", []))
for what, ok in (("the builder runs tools/build-deb", "tools/build-deb" in bl),
                 ("runtime copies the builder's package", re.search(r"COPY --from=builder \S+\.deb", rt)),
                 ("runtime copies docker/install-runtime.sh", "COPY docker/install-runtime.sh" in rt),
                 ("runtime runs install-runtime.sh with the package",
                  re.search(r"RUN .*install-runtime\.sh \S+\.deb", rt)),
                 ("runtime installs the entrypoint as kvtier-entrypoint",
                  re.search(r"COPY .*docker/entrypoint\.sh /usr/local/bin/kvtier-entrypoint", rt)),
                 ("runtime's ENTRYPOINT is tini -> kvtier-entrypoint",
                  re.search(r'ENTRYPOINT \["/usr/bin/tini", "--", "/usr/local/bin/kvtier-entrypoint"\]', rt)),
                 ("runtime installs nothing else (one RUN)", rt.count("\nRUN ") == 1)):
    if not ok:
        errs.append(f"{what}: not so")
if "runtime" not in stages or "builder" not in stages:
    errs.append(f"stages {sorted(stages)}: want builder and runtime")
if not any(i.upper().startswith("ENTRYPOINT") and "kvtier-entrypoint" in i for i in instrs):
    errs.append("no ENTRYPOINT running kvtier-entrypoint")
for e in errs:
    print(f"FAIL: Dockerfile: {e}")
if not errs:
    print(f"ok: Dockerfile: {copies} COPY sources exist and are in the build context")
sys.exit(1 if errs else 0)
EOF

echo "docker_files: $fails failure(s)"
[ "$fails" -le 100 ] || fails=100
exit "$fails"

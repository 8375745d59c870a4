#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""What Docker would run for one compose service, as bash assignments.

  compose_plan.py COMPOSE_JSON DOCKERFILE STAGE SERVICE

COMPOSE_JSON is `docker compose config --format json` (compose has interpolated,
merged and normalized the files); DOCKERFILE's stage STAGE gives the image's ENV,
ENTRYPOINT, CMD and the ARG defaults (KVT_UID...). tests/docker/test_rootfs.sh sources
the output and starts the service's "container" from it, so the test runs what the
compose file and the Dockerfile say, not a copy of them.

Printed (bash, quoted with shlex):
  ENTRY=(...) CMDV=(...)  ENTRYPOINT, and the service's command, else CMD
  ENVS=(K=V ...)        Docker's defaults, the image's ENV, then the service's
  HOSTNAME_ USER_ GROUP_ADD=(...) CAPS (Docker's default set + cap_add - cap_drop)
  IPC NETWORK_MODE ADDR (ipv4_address on its one network) SUBNET SHM_SIZE MEMLOCK
  VOLUMES=(source:target:ro|rw ...) VOLUME_TMPFS=(name:size ...) SECRETS=(file:target)
  HEALTH=(...)          the healthcheck's command (after CMD), or nothing
  IMAGE_ARG_<NAME>      the stage's ARG defaults
"""
import json
import re
import shlex
import sys

# Docker's default capabilities (moby's oci/caps/defaults.go).
DOCKER_CAPS = ["CHOWN", "DAC_OVERRIDE", "FSETID", "FOWNER", "MKNOD", "NET_RAW", "SETGID",
               "SETUID", "SETFCAP", "SETPCAP", "NET_BIND_SERVICE", "SYS_CHROOT", "KILL",
               "AUDIT_WRITE"]


def stage_of(dockerfile, stage):
    """ENV, ENTRYPOINT, CMD, ARG of a stage, following FROM <earlier stage>."""
    lines, cur = [], ""
    for raw in open(dockerfile):
        s = raw.rstrip("\n")
        if re.match(r"\s*#", s):
            continue
        if s.endswith("\\"):
            cur += s[:-1] + " "
            continue
        cur += s
        if cur.strip():
            lines.append(cur.strip())
        cur = ""
    stages, name = {}, None
    for ins in lines:
        op, _, rest = ins.partition(" ")
        op = op.upper()
        if op == "FROM":
            m = re.match(r"(\S+)(?:\s+AS\s+(\S+))?", rest, re.I)
            name = m.group(2) or m.group(1)
            base = stages.get(m.group(1))
            stages[name] = {"env": dict(base["env"]) if base else {},
                            "entrypoint": base["entrypoint"] if base else None,
                            "cmd": base["cmd"] if base else None,
                            "args": dict(base["args"]) if base else {}}
        elif name is None:
            continue
        elif op == "ENV":
            for k, v in re.findall(r'(\w+)=("[^"]*"|\S+)', rest):
                stages[name]["env"][k] = v.strip('"')
        elif op in ("ENTRYPOINT", "CMD"):
            stages[name]["entrypoint" if op == "ENTRYPOINT" else "cmd"] = json.loads(rest)
            if op == "ENTRYPOINT":
                stages[name]["cmd"] = None  # Docker resets CMD with ENTRYPOINT
        elif op == "ARG":
            k, _, v = rest.partition("=")
            stages[name]["args"][k.strip()] = v.strip()
    if stage not in stages:
        sys.exit(f"compose_plan: no stage {stage} in {dockerfile}")
    return stages[stage]


def size_bytes(v):
    if v is None:
        return 64 << 20  # Docker's default /dev/shm
    m = re.fullmatch(r"(\d+)([kmg]?)b?", str(v).strip().lower())
    if not m:
        sys.exit(f"compose_plan: shm_size {v!r}")
    return int(m.group(1)) << {"": 0, "k": 10, "m": 20, "g": 30}[m.group(2)]


def main():
    cfg_path, dockerfile, stage, service = sys.argv[1:5]
    cfg = json.load(open(cfg_path))
    svc = cfg["services"].get(service)
    if svc is None:
        sys.exit(f"compose_plan: no service {service} in {cfg_path}")
    img = stage_of(dockerfile, stage)
    out = []

    def arr(name, items):
        out.append(f"{name}=(" + " ".join(shlex.quote(str(i)) for i in items) + ")")

    def var(name, value):
        out.append(f"{name}={shlex.quote(str(value))}")

    entry = svc.get("entrypoint") or img["entrypoint"] or []
    cmd = svc.get("command") if svc.get("command") is not None else (img["cmd"] or [])
    arr("ENTRY", entry)
    arr("CMDV", cmd)
    hostname = svc.get("hostname") or service
    env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
           "HOSTNAME": hostname, "HOME": "/root"}
    if (svc.get("user") or "root").split(":")[0] not in ("root", "0"):
        env["HOME"] = "/"  # Docker takes the user's from /etc/passwd; no engine needs it
    env.update(img["env"])
    for k, v in (svc.get("environment") or {}).items():
        if v is not None:  # "KEY:" with nothing set in the shell: not set in the container
            env[k] = v
    arr("ENVS", [f"{k}={v}" for k, v in env.items()])
    var("HOSTNAME_", hostname)
    var("USER_", svc.get("user") or "")
    arr("GROUP_ADD", svc.get("group_add") or [])
    caps = [c for c in DOCKER_CAPS if c not in [x.upper() for x in svc.get("cap_drop") or []]]
    caps += [c.upper() for c in svc.get("cap_add") or [] if c.upper() not in caps]
    var("CAPS", ",".join("+" + c.lower() for c in caps))
    var("IPC", svc.get("ipc") or "private")
    var("NETWORK_MODE", svc.get("network_mode") or "")
    nets = svc.get("networks") or {}
    addr = subnet = ""
    if len(nets) == 1:
        (net, conf), = nets.items()
        addr = (conf or {}).get("ipv4_address") or ""
        ipam = (cfg.get("networks", {}).get(net) or {}).get("ipam") or {}
        subnet = ((ipam.get("config") or [{}])[0]).get("subnet") or ""
    var("ADDR", addr)
    var("SUBNET", subnet)
    var("SHM_SIZE", size_bytes(svc.get("shm_size")))
    ml = (svc.get("ulimits") or {}).get("memlock")
    if isinstance(ml, dict):
        ml = ml.get("hard")
    var("MEMLOCK", "unlimited" if ml == -1 else (ml if ml is not None else ""))
    vols, tmpfs = [], []
    for v in svc.get("volumes") or []:
        if v.get("type") != "volume":
            sys.exit(f"compose_plan: {service}: only named volumes are emulated ({v})")
        vols.append(f"{v['source']}:{v['target']}:{'ro' if v.get('read_only') else 'rw'}")
        opts = (cfg.get("volumes", {}).get(v["source"]) or {}).get("driver_opts") or {}
        if opts.get("type") == "tmpfs":
            m = re.search(r"size=(\w+)", opts.get("o", ""))
            tmpfs.append(f"{v['source']}:{m.group(1) if m else '64m'}")
    arr("VOLUMES", vols)
    arr("VOLUME_TMPFS", tmpfs)
    secs = []
    for s in svc.get("secrets") or []:
        src = cfg["secrets"][s["source"]]["file"]
        secs.append(f"{src}:{s.get('target') or '/run/secrets/' + s['source']}")
    arr("SECRETS", secs)
    test = (svc.get("healthcheck") or {}).get("test") or []
    if test[:1] == ["CMD"]:
        arr("HEALTH", test[1:])
    elif test[:1] == ["CMD-SHELL"]:
        arr("HEALTH", ["/bin/sh", "-c", test[1]])
    else:
        arr("HEALTH", [])
    for k, v in img["args"].items():
        if re.fullmatch(r"\w+", k):
            var(f"IMAGE_ARG_{k}", v)
    print("\n".join(out))


if __name__ == "__main__":
    main()

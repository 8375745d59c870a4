#!/bin/bash
# SPDX-License-Identifier: Apache-2.0
# Runs inside the Debian 12 guest of test_deb_boot.sh, as root, once multi-user is
# reached, with the kvtier package installed and systemd as PID 1: kvtierd.service
# as installed (plus a drop-in WatchdogSec=3s) with the example configuration, its
# primary.size cut to what the guest's /run holds (10% of 2 GiB), as an administrator
# sizes it. Writes "ok - ..." / "FAIL - ..." lines and "checks done" to
# /var/log/kvt-boot-checks.log, which the host reads from the disk image.
# shellcheck disable=SC2016,SC2034 # check() evals its condition, in single quotes
exec >/var/log/kvt-boot-checks.log 2>&1
set -u
pass=0 fail=0
ok() { pass=$((pass + 1)); echo "ok - $*"; }
bad() { fail=$((fail + 1)); echo "FAIL - $*"; }
check() { if eval "$2"; then ok "$1"; else bad "$1"; fi; }
show() { systemctl show -p "$1" --value kvtierd.service; }
conf=/etc/kvtier/kvtierd.yaml
wait_for() { # condition, seconds
  local i
  for ((i = 0; i < $2 * 10; i++)); do
    eval "$1" && return 0
    sleep 0.1
  done
  return 1
}
healthz() {
  python3 -c 'import urllib.request as u
print(u.urlopen("http://127.0.0.1:9464/healthz", timeout=2).status)' 2>/dev/null
}

sed -i 's/^  size: 1GiB$/  size: 128MiB/' "$conf"
mkdir -p /etc/systemd/system/kvtierd.service.d
printf '[Service]\nWatchdogSec=3s\n' >/etc/systemd/system/kvtierd.service.d/watchdog.conf
systemctl daemon-reload
useradd --create-home --groups kvtier engine

# ---- start: Type=notify returns once the daemon said READY=1 ----
check "systemctl start kvtierd returns 0 (after READY=1)" 'systemctl start kvtierd.service'
check "active (running), Type=notify, User=kvtier" \
  '[ "$(show ActiveState)/$(show SubState)/$(show Type)/$(show User)" = active/running/notify/kvtier ]'
check "the daemon's STATUS= shows in systemctl: $(show StatusText)" '[[ "$(show StatusText)" == serving:* ]]'
check "/healthz answers 200 right after the start returned" '[ "$(healthz)" = 200 ]'
pid=$(show MainPID)
check "it runs as the user kvtier" \
  '[ "$(awk "/^Uid:/ {print \$2}" /proc/$pid/status)" = "$(id -u kvtier)" ]'
check "NoNewPrivileges: NoNewPrivs 1" 'grep -q "^NoNewPrivs:[[:space:]]*1$" /proc/$pid/status'
check "CapabilityBoundingSet empty: CapBnd 0" \
  'grep -q "^CapBnd:[[:space:]]*0000000000000000$" /proc/$pid/status'
check "a mount namespace of its own (ProtectSystem, PrivateTmp)" \
  '[ "$(readlink /proc/$pid/ns/mnt)" != "$(readlink /proc/1/ns/mnt)" ]'
check "ProtectSystem=strict: /usr and /etc are read-only in it" \
  '! nsenter -t "$pid" -m touch /usr/kvt-probe 2>/dev/null && ! nsenter -t "$pid" -m touch /etc/kvt-probe 2>/dev/null'
check "its StateDirectory and RuntimeDirectory are writable in it" \
  'nsenter -t "$pid" -m sh -c "touch /var/lib/kvtier/probe /run/kvtier/probe && rm /var/lib/kvtier/probe /run/kvtier/probe"'
check "/run/kvtier 0750 kvtier:kvtier, the socket srw-rw----, /var/lib/kvtier 0700" \
  '[ "$(stat -c %a:%U:%G /run/kvtier) $(stat -c %A /run/kvtier/engine.sock) $(stat -c %a /var/lib/kvtier)" = "750:kvtier:kvtier srw-rw---- 700" ]'
check "kvtier status (as root)" 'kvtier status --socket /run/kvtier/engine.sock >/tmp/status 2>&1'
check "an engine of the group kvtier puts and gets a chunk" \
  'setpriv --reuid=engine --regid=engine --init-groups -- kvtier put c0ffee01 --pattern 7 --socket /run/kvtier/engine.sock >/dev/null 2>&1 &&
   setpriv --reuid=engine --regid=engine --init-groups -- kvtier get c0ffee01 --pattern 7 --socket /run/kvtier/engine.sock 2>&1 | grep -q "matches pattern 7"'
check "a user outside the group cannot reach the socket" \
  '! setpriv --reuid=nobody --regid=nogroup --clear-groups -- kvtier status --socket /run/kvtier/engine.sock >/dev/null 2>&1'

# ---- reload: the file is checked first, then SIGHUP ----
sed -i 's/^  level: info$/  level: debug/' "$conf"
since=$(date '+%Y-%m-%d %H:%M:%S')
check "systemctl reload with a good change returns 0" 'systemctl reload kvtierd.service'
check "the daemon took SIGHUP: 'SIGHUP: log.level changed' in the journal" \
  'wait_for "journalctl -u kvtierd --since \"$since\" --no-pager | grep -q \"SIGHUP: log.level changed\"" 10'
cp "$conf" /tmp/good.yaml
echo "bogus_key: 1" >>"$conf"
check "systemctl reload with a bad file fails" '! systemctl reload kvtierd.service 2>/dev/null'
check "... and the node keeps running, same process" \
  '[ "$(show ActiveState)" = active ] && [ "$(show MainPID)" = "$pid" ]'
cp /tmp/good.yaml "$conf"

# ---- watchdog: a loop that stops turning gets the daemon restarted ----
kill -STOP "$pid"
check "a stopped daemon: systemd's watchdog (3 s) kills and restarts it" \
  'wait_for "[ \"\$(show NRestarts)\" = 1 ] && [ \"\$(show ActiveState)/\$(show SubState)\" = active/running ]" 40'
check "... 'Watchdog timeout' in the journal, a new process" \
  'journalctl -u kvtierd --no-pager | grep -q "Watchdog timeout" && [ "$(show MainPID)" != "$pid" ]'
check "... and it serves again" 'wait_for "[ \"\$(healthz)\" = 200 ]" 20'

# ---- stop: drain, exit 0, the runtime folder goes ----
check "systemctl stop returns 0" 'systemctl stop kvtierd.service'
check "exit status 0, inactive" '[ "$(show ExecMainStatus)/$(show ActiveState)" = 0/inactive ]'
check "the daemon logged its clean stop" \
  'journalctl -u kvtierd --no-pager | grep -q "0 pinned, 0 write-pending"'
check "RuntimeDirectory removed at stop" '[ ! -e /run/kvtier ]'
systemd-analyze security kvtierd.service 2>&1 | tail -1
journalctl -u kvtierd --no-pager | tail -25 | sed 's/^/    /'
echo "$pass passed, $fail failed in the guest"
echo "checks done"

"""Install, enable and reboot in a real booted VM: what the README promises is live after the boot (issue 19).

In the session's QEMU guest (Debian 12 with its own kernel, systemd as PID 1, writable /proc/sys and
zram: everything the nspawn tests cannot have), as a user does it: ``sparkguard install``,
``systemctl enable sparkguard``, a real reboot of the guest.  After the boot: the zram swap of
/etc/sparkguard/zram.conf (size, priority, algorithm), the sysctls of
/etc/sysctl.d/99-zz-sparkguard.conf live, the guard active (Type=notify: only after READY=1) and
pinging its watchdog, ``oom_score_adj`` -1000, its memory locked (VmLck), its threads at the
unit's Nice= and scheduling policy.  Then ``sparkguard uninstall`` and another reboot: the guest's
files, swaps and those sysctls are as they were before the install.
"""

from __future__ import annotations

import json
import re
import time

import pytest

from sparkguard.units import parse_size
from .conftest import VENV

pytestmark = [pytest.mark.system, pytest.mark.vm]

UNIT = "sparkguard.service"
SYSCTL_FILE = "/etc/sysctl.d/99-zz-sparkguard.conf"
ZRAM_CONF = "/etc/sparkguard/zram.conf"
#: A user's own file that would load zram at boot (modules-load.d(5)): not needed, not made.
MODULES_LOAD = "/etc/modules-load.d/zram.conf"
#: Trees whose files are compared before the install and after the uninstall.
TREES = ("/etc", "/usr/local", "/usr/lib/systemd", "/var/lib/sparkguard")
#: Files a boot itself rewrites, sparkguard or not (compared by existence only).
BOOT_WRITES = ("/etc/adjtime",)
#: A guest program: every file, link and directory under TREES as {path: description}, JSON.
SNAPSHOT = r"""
import hashlib, json, os, sys
out = {}
for top in sys.argv[1:]:
    for d, dirs, files in os.walk(top):
        out[d] = "dir"
        for n in files + [x for x in dirs if os.path.islink(os.path.join(d, x))]:
            p = os.path.join(d, n)
            if os.path.islink(p):
                out[p] = "link " + os.readlink(p)
            elif os.path.isfile(p):
                with open(p, "rb") as f:
                    out[p] = "file " + hashlib.sha256(f.read()).hexdigest()
print(json.dumps(out))
"""


def _kv(text: str, sep: str = "=") -> dict[str, str]:
    """``key SEP value`` lines (comments and blanks skipped) as a dict, both sides stripped."""
    out = {}
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith(("#", ";")) and sep in line:
            k, v = line.split(sep, 1)
            out[k.strip()] = v.strip()
    return out


def _host_state(vm, sysctl_keys: list[str]) -> dict:
    """What the install may change, read in the guest: files under TREES, /proc/swaps, the sysctls."""
    files = json.loads(vm.run("python3", "-c", SNAPSHOT, *TREES).stdout)
    for p in BOOT_WRITES:
        if p in files:
            files[p] = "file (rewritten at boot)"
    swaps = vm.run("cat", "/proc/swaps").stdout.splitlines()[1:]
    sysctls = {k: vm.run("sysctl", "-n", k).stdout.strip() for k in sysctl_keys}
    return {"files": files, "swaps": swaps, "sysctls": sysctls}


def _zram_swap(vm) -> dict:
    """Device, size (bytes), priority and algorithm of the one live zram swap in the guest.

    Not necessarily zram0: install-zram --boot loads the module with no device
    (``num_devices=0``) and takes a new one from hot_add.
    """
    line = vm.run("swapon", "--show=NAME,TYPE,SIZE,PRIO", "--bytes", "--noheadings", "--raw").stdout
    rows = {r.split()[0]: r.split() for r in line.splitlines() if r.strip()}
    zrams = [d for d in rows if d.startswith("/dev/zram")]
    assert len(zrams) == 1, f"not one zram swap: {line!r}"
    device = zrams[0]
    name = device.rsplit("/", 1)[1]
    algo = vm.run("cat", f"/sys/block/{name}/comp_algorithm").stdout
    selected = re.search(r"\[(\w+)\]", algo)
    return {"device": device, "swap_size": int(rows[device][2]), "priority": int(rows[device][3]),
            "disksize": int(vm.run("cat", f"/sys/block/{name}/disksize").stdout),
            "algorithm": selected.group(1) if selected else algo.strip()}


def _guard_process(vm, pid: int) -> dict:
    """oom_score_adj, VmLck/VmRSS (kB), and (nice, policy) of every thread of ``pid`` in the guest."""
    status = _kv(vm.run("cat", f"/proc/{pid}/status").stdout, ":")
    tasks = vm.run("ls", f"/proc/{pid}/task").stdout.split()
    sched = {}
    for t in tasks:
        r = vm.run("cat", f"/proc/{pid}/task/{t}/stat", check=False)
        if r.returncode == 0:
            fields = r.stdout.rsplit(")", 1)[1].split()
            # proc(5): field 19 is nice, field 41 policy; fields[0] here is field 3 (state)
            sched[int(t)] = (int(fields[16]), int(fields[38]))
    return {"oom_score_adj": int(vm.run("cat", f"/proc/{pid}/oom_score_adj").stdout),
            "VmLck": int(status["VmLck"].split()[0]), "VmRSS": int(status["VmRSS"].split()[0]),
            "sched": sched}


def test_install_enable_reboot_then_uninstall_reboot(vm):
    pkg = vm.run(f"{VENV}/bin/python3", "-c", "import os, sparkguard; print(os.path.dirname(sparkguard.__file__))")
    shipped_keys = list(_kv(vm.run("cat", f"{pkg.stdout.strip()}/data/host/sysctl.d/99-zz-sparkguard.conf").stdout))
    assert shipped_keys, "the wheel ships no sysctl file"
    before = _host_state(vm, shipped_keys)
    assert not any("zram" in s for s in before["swaps"]), f"the fresh guest already has a zram swap: {before['swaps']}"

    r = vm.run(f"{VENV}/bin/sparkguard", "install", check=False, timeout=300)
    assert r.returncode == 0, f"sparkguard install failed:\n{r.stdout}\n{r.stderr}"
    vm.run("systemctl", "enable", UNIT)
    # Debian's kernel builds zram as a module that nothing loads at boot: install-zram --boot
    # (sparkguard-setup.service) loads it itself (modprobe zram num_devices=0), so the README's
    # steps alone give the zram swap after a reboot; no modules-load.d file of the user's.
    assert vm.run("test", "-e", MODULES_LOAD, check=False).returncode != 0
    zram = _kv(vm.run("cat", ZRAM_CONF).stdout)
    sysctls = _kv(vm.run("cat", SYSCTL_FILE).stdout)
    assert set(sysctls) == set(shipped_keys), (sysctls, shipped_keys)

    vm.reboot()

    def setup_log() -> str:
        return vm.run("journalctl", "-b", "--no-pager", "-u", "sparkguard-setup.service", "-u", UNIT,
                      check=False).stdout[-3000:]

    # -- the zram swap of zram.conf
    try:
        live = _zram_swap(vm)
    except AssertionError as e:
        raise AssertionError(f"{e}\n{setup_log()}") from None
    want = parse_size(zram["size"])
    assert live["disksize"] == want, f"{live['device']} disksize {live['disksize']} != {zram['size']} ({want})"
    # mkswap keeps one page for its header (mkswap(8)): the swap is the device less that page
    assert want - 64 * 1024 <= live["swap_size"] <= want, live
    assert live["priority"] == int(zram["priority"]), live
    assert live["algorithm"] == zram["algorithm"], live

    # -- the sysctls of the file, live
    for k, v in sysctls.items():
        assert vm.run("sysctl", "-n", k).stdout.strip() == v, f"{k}: live {vm.run('sysctl', '-n', k).stdout!r}, file {v}"

    # -- the guard: READY (Type=notify is active only after READY=1), watchdog armed and pinged
    props = ("ActiveState", "SubState", "Type", "MainPID", "WatchdogUSec", "WatchdogTimestampMonotonic",
             "NRestarts", "Nice", "CPUSchedulingPolicy", "OOMScoreAdjust", "StatusText")

    def show() -> dict:
        return _kv(vm.run("systemctl", "show", UNIT, *(f"--property={p}" for p in props)).stdout)

    s1 = show()
    assert (s1["ActiveState"], s1["SubState"], s1["Type"]) == ("active", "running", "notify"), s1
    assert s1["WatchdogUSec"] == "5s", s1
    t1 = time.monotonic()
    # the watchdog's last ping must move on: wait (bounded) for a later one than the first reading
    while True:
        s2 = show()
        if int(s2["WatchdogTimestampMonotonic"]) > int(s1["WatchdogTimestampMonotonic"]):
            break
        assert time.monotonic() - t1 < 30, f"no watchdog ping in 30 s: {s1} {s2}"
        time.sleep(0.5)
    assert s2["NRestarts"] == "0" and s2["MainPID"] == s1["MainPID"], (s1, s2)
    assert vm.run("systemctl", "is-active", "sparkguard-setup.service", check=False).stdout.strip() == "active", \
        setup_log()

    # -- the guard process as the unit says
    proc = _guard_process(vm, int(s2["MainPID"]))
    assert proc["oom_score_adj"] == -1000 == int(s2["OOMScoreAdjust"]), proc
    assert proc["VmLck"] > 0 and proc["VmLck"] >= proc["VmRSS"], f"guard memory not locked: {proc}"
    nice, policy = int(s2["Nice"]), int(s2["CPUSchedulingPolicy"])
    assert nice == -20, s2
    wrong = {t: ns for t, ns in proc["sched"].items() if ns != (nice, policy)}
    assert proc["sched"] and not wrong, f"threads not at Nice={nice} policy={policy}: {wrong}"

    # -- uninstall, reboot: as before
    r = vm.run(f"{VENV}/bin/sparkguard", "uninstall", check=False, timeout=300)
    assert r.returncode == 0, f"sparkguard uninstall failed:\n{r.stdout}\n{r.stderr}"
    vm.reboot()
    after = _host_state(vm, shipped_keys)
    assert after["swaps"] == before["swaps"], (before["swaps"], after["swaps"])
    assert after["sysctls"] == before["sysctls"], (before["sysctls"], after["sysctls"])
    # uninstall keeps (and names) the incident records unless --purge (README, "uninstall")
    kept = [ln.split()[1] for ln in r.stdout.splitlines() if ln.startswith("kept")]
    assert kept == ["/var/lib/sparkguard/incidents/"], r.stdout

    def named_kept(p: str) -> bool:
        return any(p.startswith(k) or k.startswith(p + "/") for k in kept)

    added = sorted(p for p in set(after["files"]) - set(before["files"]) if not named_kept(p))
    removed = sorted(set(before["files"]) - set(after["files"]))
    changed = sorted(p for p in set(before["files"]) & set(after["files"]) if before["files"][p] != after["files"][p])
    assert not (added or removed or changed), f"left by install+uninstall: added {added}, removed {removed}, changed {changed}"

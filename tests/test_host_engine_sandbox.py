"""The engine sandbox drop-in under a real, booted systemd: what an engine supervised by the guard may write.

The engine is the guard's child: it inherits the unit's mount namespace and capability bounding
set.  The engine here is a probe script started by the guard itself (``engine.command``); it
reports what it can write, its ``CapBnd`` and its parent, first with the drop-in that ``sparkguard
install`` adds once the config has an engine, then after ``sparkguard install --no-engine-sandbox``
and a stop and start, with the guard-only sandbox.  ``sparkguard doctor`` is asked about both.  One booted
Debian machine (see tests/system/nspawn.py), well under a minute.
"""

from __future__ import annotations

import json
import time

import pytest

from system.conftest import sparkguard_wheel, system_root  # noqa: F401  (fixtures)
from system.nspawn import Container, has_capability

pytestmark = pytest.mark.system

UNIT = "sparkguard.service"
CONFIG = "/etc/sparkguard/sparkguard.yaml"
DROPIN = "/etc/systemd/system/sparkguard.service.d/engine.conf"
#: a folder owned by another user, mode 0755: root writes there only with CAP_DAC_OVERRIDE
OTHERS = "/home/sgtest-alice"
PLACES = ("/root", OTHERS, "/tmp", "/var/tmp", "/usr", "/etc")
RESULT = "/run/sparkguard/sgtest-probe"  # the unit's RuntimeDirectory: writable under either sandbox
ENGINE = "/usr/local/bin/sgtest-engine"
ENGINE_SCRIPT = f"""#!/bin/sh
for d in {' '.join(PLACES)}; do
  if touch "$d/sgtest-probe" 2>/dev/null; then rm -f "$d/sgtest-probe"; echo "$d ok"; else echo "$d denied"; fi
done > {RESULT}.tmp
grep -E '^(CapBnd|PPid):' /proc/$$/status >> {RESULT}.tmp
mv {RESULT}.tmp {RESULT}
exec sleep 3600
"""
CAPS = {"CAP_CHOWN": 0, "CAP_DAC_OVERRIDE": 1, "CAP_FOWNER": 3, "CAP_NET_BIND_SERVICE": 10, "CAP_SYS_ADMIN": 21}
ENGINE_CAPS = ("CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FOWNER", "CAP_NET_BIND_SERVICE")


def engine_report(c: Container) -> tuple[dict[str, str], str, int]:
    """({folder: "ok"|"denied"}, CapBnd line, parent pid) written by the engine of the current run."""
    deadline = time.monotonic() + 60
    while c.run("test", "-e", RESULT, check=False).returncode != 0:
        assert time.monotonic() < deadline, c.journal_text("-b", "-u", UNIT)[-4000:]
        time.sleep(0.2)  # the engine's file is the event; nothing announces it
    lines = c.run("cat", RESULT).stdout.splitlines()
    places = dict(ln.split() for ln in lines if ln.startswith("/"))
    capbnd = next(ln for ln in lines if ln.startswith("CapBnd:"))
    ppid = int(next(ln for ln in lines if ln.startswith("PPid:")).split()[1])
    return places, capbnd, ppid


def doctor_sandbox(c: Container) -> dict:
    r = c.run("sparkguard", "doctor", "--json", check=False)
    return next(x for x in json.loads(r.stdout)["checks"] if x["name"] == "engine_sandbox")


def test_engine_config_brings_the_sandbox_drop_in_and_the_engine_can_write_its_files(system_root,  # noqa: F811
                                                                                     sparkguard_wheel):  # noqa: F811
    c = Container(system_root)
    try:
        c.install_wheel(sparkguard_wheel)
        c.chroot("sparkguard", "install")
        assert not (c.root / DROPIN.lstrip("/")).exists()
        # the operator configures an engine in the installed config and runs install again
        text = (c.root / CONFIG.lstrip("/")).read_text()
        assert text.count("  command: null\n") == 1
        c.write(CONFIG, text.replace("  command: null\n", f"  command: [{ENGINE}]\n").replace(
            "  stable_for: 5s\n", "  stable_for: 0s\n").replace("  start_above: 4GiB\n", "  start_above: 256MiB\n")
            .replace("  restart: always\n", "  restart: never\n").replace("  drop_caches: true\n", "  drop_caches: false\n"))
        c.write(ENGINE, ENGINE_SCRIPT, mode=0o755)
        c.chroot("install", "-d", "-o", "4242", "-g", "4242", "-m", "0755", OTHERS)
        r = c.chroot("sparkguard", "install")
        assert f"created       {DROPIN}  (engine.command is set in {CONFIG}" in r.stdout, r.stdout
        c.chroot("systemctl", "enable", UNIT)
        c.boot()

        places, capbnd, ppid = engine_report(c)
        assert ppid == int(c.show(UNIT, "MainPID")["MainPID"])  # really the guard's child
        assert places == {"/root": "ok", OTHERS: "ok", "/tmp": "ok", "/var/tmp": "ok",
                          "/usr": "denied", "/etc": "denied"}, places
        for cap in ENGINE_CAPS:
            assert has_capability(capbnd, CAPS[cap]), (cap, capbnd)
        assert not has_capability(capbnd, CAPS["CAP_SYS_ADMIN"]), capbnd
        assert doctor_sandbox(c)["status"] == "PASS"

        # the guard-only sandbox, the way an operator switches on the running machine
        r = c.run("sparkguard", "install", "--no-engine-sandbox")
        assert f"removed       {DROPIN}" in r.stdout and "ran           systemctl daemon-reload" in r.stdout, r.stdout
        assert "next: systemctl stop sparkguard && systemctl start sparkguard" in r.stdout, r.stdout
        check = doctor_sandbox(c)
        assert check["status"] == "WARN" and "read-only" in check["message"], check
        c.run("rm", "-f", RESULT)
        c.run("systemctl", "stop", UNIT, timeout=90)      # a restart would adopt the engine in its old sandbox
        c.run("systemctl", "start", UNIT, timeout=90)
        places, capbnd, _ = engine_report(c)
        assert places == {p: "denied" for p in PLACES}, places  # ProtectSystem=strict, ProtectHome=read-only
        for cap in ENGINE_CAPS:
            assert not has_capability(capbnd, CAPS[cap]), (cap, capbnd)
    finally:
        c.close()

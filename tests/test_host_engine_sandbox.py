"""The engine sandbox drop-in under a real, booted systemd: what a process of the guard's unit may write.

An engine supervised by the guard is the guard's child: it inherits the unit's mount namespace and
capability bounding set.  A probe run by systemd in the same unit (``ExecStartPost=``, same
sandbox settings as ``ExecStart=``) reports what it can write and its ``CapBnd``, first with the
drop-in that ``sparkguard install --engine-sandbox`` puts in place, then, after ``sparkguard install
--no-engine-sandbox`` and a restart, with the guard-only sandbox.  One booted Debian machine
(see tests/system/nspawn.py), about half a minute.
"""

from __future__ import annotations

import re
import time

import pytest

from system.conftest import sparkguard_wheel, system_root  # noqa: F401  (fixtures)
from system.nspawn import Container, has_capability

pytestmark = pytest.mark.system

UNIT = "sparkguard.service"
DROPIN_DIR = "/etc/systemd/system/sparkguard.service.d"
#: a folder owned by another user, mode 0755: root writes there only with CAP_DAC_OVERRIDE
OTHERS = "/home/sgtest-alice"
PLACES = ("/root", OTHERS, "/tmp", "/var/tmp", "/usr", "/etc")
PROBE = ("[Service]\nExecStartPost=/bin/sh -c 'for d in " + " ".join(PLACES) + "; do "
         "if touch \"$d/sgtest-probe\" 2>/dev/null; then rm -f \"$d/sgtest-probe\"; echo \"$d ok\"; "
         "else echo \"$d denied\"; fi; done > /run/sparkguard/probe; "
         "grep ^CapBnd: /proc/self/status >> /run/sparkguard/probe'\n")
CAPS = {"CAP_CHOWN": 0, "CAP_DAC_OVERRIDE": 1, "CAP_FOWNER": 3, "CAP_NET_BIND_SERVICE": 10, "CAP_SYS_ADMIN": 21}


def probe(c: Container) -> tuple[dict[str, str], str]:
    """({folder: "ok"|"denied"}, the CapBnd line) from the last start of the unit."""
    deadline = time.monotonic() + 60
    while c.run("systemctl", "is-active", UNIT, check=False).stdout.strip() != "active":
        assert time.monotonic() < deadline, c.journal_text("-b", "-u", UNIT)
        time.sleep(0.2)  # systemd offers no wait-for-active short of polling
    lines = c.run("cat", "/run/sparkguard/probe").stdout.splitlines()
    return dict(ln.split() for ln in lines if not ln.startswith("CapBnd")), lines[-1]


def test_engine_sandbox_drop_in_makes_the_engine_s_files_writable_and_goes_again(system_root,  # noqa: F811
                                                                                  sparkguard_wheel):  # noqa: F811
    c = Container(system_root)
    try:
        c.install_wheel(sparkguard_wheel)
        r = c.chroot("sparkguard", "install", "--engine-sandbox")
        assert f"created       {DROPIN_DIR}/engine.conf" in r.stdout, r.stdout
        c.write(f"{DROPIN_DIR}/zz-sgtest-probe.conf", PROBE)
        c.chroot("install", "-d", "-o", "4242", "-g", "4242", "-m", "0755", OTHERS)
        c.chroot("systemctl", "enable", UNIT)
        c.boot()

        places, capbnd = probe(c)
        assert places == {"/root": "ok", OTHERS: "ok", "/tmp": "ok", "/var/tmp": "ok",
                          "/usr": "denied", "/etc": "denied"}, places
        for cap in ("CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FOWNER", "CAP_NET_BIND_SERVICE"):
            assert has_capability(capbnd, CAPS[cap]), (cap, capbnd)
        assert not has_capability(capbnd, CAPS["CAP_SYS_ADMIN"]), capbnd
        dropins = c.show(UNIT, "DropInPaths")["DropInPaths"]
        assert f"{DROPIN_DIR}/engine.conf" in dropins, dropins

        # back to the guard-only sandbox, the way an operator does it on the running machine
        r = c.run("sparkguard", "install", "--no-engine-sandbox")
        assert f"removed       {DROPIN_DIR}/engine.conf" in r.stdout and "ran           systemctl daemon-reload" \
            in r.stdout, r.stdout
        assert "next: systemctl restart sparkguard" in r.stdout, r.stdout
        c.run("systemctl", "restart", UNIT, timeout=60)
        places, capbnd = probe(c)
        assert places == {p: "denied" for p in PLACES}, places  # ProtectSystem=strict, ProtectHome=read-only
        assert not re.search(r"engine\.conf", c.show(UNIT, "DropInPaths")["DropInPaths"])
        for cap in ("CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FOWNER", "CAP_NET_BIND_SERVICE"):
            assert not has_capability(capbnd, CAPS[cap]), (cap, capbnd)
    finally:
        c.close()

"""The README's install routes on a fresh Debian 12, in one booted container: its first command
verbatim (a venv at /opt/sparkguard, ``sparkguard install`` linking /usr/local/bin/sparkguard,
``sparkguard run``), then pipx.

Debian 12 and Ubuntu 24.04 refuse ``pip install`` into the system Python (PEP 668,
``error: externally-managed-environment``), hence the venv.  The container has no network (see
tests/system/nspawn.py): ``pip`` gets ``PIP_NO_INDEX=1`` and ``PIP_FIND_LINKS`` naming the wheels
the host downloaded (:func:`nspawn.routes_root`), and apt installs pipx from the root's apt cache;
the command line itself is the README's, read from README.md.
"""

from __future__ import annotations

import re
import shlex
import time
from pathlib import Path

import pytest

from system import nspawn

pytestmark = pytest.mark.system

README = nspawn.CHECKOUT / "README.md"
SRC = "/root/sparkguard"
LINK = "/usr/local/bin/sparkguard"
OFFLINE = {"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": nspawn.ROUTE_WHEELS, "DEBIAN_FRONTEND": "noninteractive",
           "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
#: pipx as root, where the README says: venvs under /opt/pipx, the command in /usr/local/bin
PIPX_ENV = {"PIPX_HOME": "/opt/pipx", "PIPX_BIN_DIR": "/usr/local/bin"}


def readme_first_command() -> str:
    """The README's first command: its first indented code line."""
    for line in README.read_text().splitlines():
        if line.startswith("    ") and line.strip():
            return line.strip()
    raise AssertionError("README.md has no indented command")


def metrics_up(c: nspawn.Container) -> bool:
    r = c.run("/usr/bin/python3", "-c", "import urllib.request as u; "
              "print(u.urlopen('http://127.0.0.1:8799/metrics', timeout=3).read().decode())", check=False)
    return r.returncode == 0 and "sparkguard_term_below_bytes" in r.stdout


def env_args(env: dict[str, str]) -> list[str]:
    return [f"{k}={v}" for k, v in env.items()]


@pytest.fixture(scope="module")
def fresh_debian(tmp_path_factory):
    """A booted Debian 12 without sparkguard, with the checkout copied to /root/sparkguard."""
    reason = nspawn.unavailable_reason()
    if reason:
        pytest.skip(f"booted-systemd test impossible here: {reason}")
    root = nspawn.routes_root(log=lambda m: print(f"[routes] {m}", flush=True))
    c = nspawn.Container(root)
    try:
        nspawn.copy_checkout(c.root / SRC.lstrip("/"))
        c.boot()
        yield c
    finally:
        c.close()


def test_readme_first_command_works_verbatim_on_debian_12(fresh_debian):
    c = fresh_debian
    line = readme_first_command()
    assert "pip install ." in line and line.endswith("sparkguard run"), line
    # Debian marks its Python as externally managed: pip refuses to install into it (PEP 668),
    # the reason for the venv (this minimal root has no system pip to try it with)
    marker = c.sh("ls /usr/lib/python3*/EXTERNALLY-MANAGED", check=False)
    assert marker.returncode == 0, "no EXTERNALLY-MANAGED marker: the venv route is not what this Debian needs"

    # the line runs as a transient unit (`sparkguard run` stays in the foreground)
    c.run("systemd-run", "--unit=sg-readme", f"--working-directory={SRC}",
          *(f"--setenv={kv}" for kv in env_args(OFFLINE)), "/bin/sh", "-c", line)
    try:
        deadline = time.monotonic() + 400
        while not metrics_up(c):
            state = c.show("sg-readme.service", "ActiveState")["ActiveState"]
            assert state in ("active", "activating") and time.monotonic() < deadline, \
                f"sg-readme is {state}:\n{c.journal_text('-u', 'sg-readme', '-n', '80')}"
            time.sleep(1)
        out = c.journal_text("-u", "sg-readme")
        assert "created       /etc/systemd/system/sparkguard.service" in out, out
        assert f"created       {LINK}  (-> /opt/sparkguard/bin/sparkguard" in out, out
        assert "ran           journalctl --update-catalog" in out, out
        assert c.run("readlink", LINK).stdout.strip() == "/opt/sparkguard/bin/sparkguard"
        # the guard running is the one the line started, found through PATH
        ps = c.run("ps", "-eo", "args").stdout
        assert re.search(r"^/opt/sparkguard/bin/python3? /usr/local/bin/sparkguard run$", ps, re.M), ps
        catalog = c.run("journalctl", "--list-catalog", "664d84b2b89942f2ac3a8c34e6254450").stdout
        assert "664d84b2" in catalog.replace("-", ""), catalog
    finally:
        c.run("systemctl", "stop", "sg-readme.service", check=False, timeout=60)

    # a re-run changes nothing and says only that; the unit works with the venv's interpreter
    again = c.run("sparkguard", "install").stdout
    assert re.match(r"no changes: everything was already in place \(\d+ unchanged\)\nnext: systemctl enable",
                    again), again
    c.run("systemctl", "enable", "--now", "sparkguard", timeout=90)
    assert c.show("sparkguard.service", "ActiveState")["ActiveState"] == "active"
    assert "/opt/sparkguard/bin/python3 -m sparkguard run" in c.show("sparkguard.service", "ExecStart")["ExecStart"]
    again = c.run("sparkguard", "install").stdout
    assert again.splitlines() == [again.splitlines()[0]] and again.startswith("no changes"), again

    out = c.run("sparkguard", "uninstall", timeout=120).stdout
    assert f"removed       {LINK}" in out, out
    assert c.run("test", "-e", LINK, check=False).returncode == 1


def test_pipx_route(fresh_debian):
    c = fresh_debian
    c.run("env", *env_args(OFFLINE), "apt-get", "install", "-y", "-q", "--no-install-recommends", "pipx",
          timeout=300)
    pipx = " ".join(env_args({**OFFLINE, **PIPX_ENV}))
    c.sh(f"cd {SRC} && env {pipx} pipx install .", timeout=400)
    target = c.run("readlink", "-f", LINK).stdout.strip()
    assert target == "/opt/pipx/venvs/sparkguard/bin/sparkguard", target

    out = c.run("sparkguard", "install", timeout=120).stdout
    assert LINK not in out, f"install touched pipx's link:\n{out}"  # already on PATH: pipx's, left alone
    c.run("systemctl", "enable", "--now", "sparkguard", timeout=90)
    assert c.show("sparkguard.service", "ActiveState")["ActiveState"] == "active"
    assert "/opt/pipx/venvs/sparkguard/bin/python -m sparkguard run" in \
        c.show("sparkguard.service", "ExecStart")["ExecStart"]
    doctor = c.run("sparkguard", "doctor", check=False, timeout=60)
    assert "Traceback" not in doctor.stderr and re.search(r"^(PASS|WARN|FAIL|INFO)\s", doctor.stdout, re.M)

    c.run("sparkguard", "uninstall", timeout=120)
    assert c.run("readlink", "-f", LINK).stdout.strip() == target, "uninstall removed pipx's link"
    c.sh(f"env {pipx} pipx uninstall sparkguard", timeout=120)
    assert c.run("test", "-e", LINK, check=False).returncode == 1
    assert shlex.quote(SRC) == SRC  # the shell lines above rely on it

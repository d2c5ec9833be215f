"""The README's first command run verbatim inside a booted container (tests/system/nspawn.py).

Shared by tests/test_install_routes.py (Debian 12) and the Ubuntu 24.04 case of tests/test_deb.py,
which runs it in the same boot as the package's life cycle.  The container has no network: pip
gets ``PIP_NO_INDEX=1`` and ``PIP_FIND_LINKS`` naming the wheels the host downloaded into the root
(:data:`nspawn.ROUTE_WHEELS`); pip reads every option from ``PIP_<OPTION>`` environment variables
(pip's "Configuration" documentation), so the command line itself is the README's, read from
README.md.
"""

from __future__ import annotations

import re
import shlex
import time

from . import nspawn

README = nspawn.CHECKOUT / "README.md"
#: where the checkout is copied inside (the README's `pip install .` runs there)
SRC = "/root/sparkguard"
LINK = "/usr/local/bin/sparkguard"
OFFLINE = {"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": nspawn.ROUTE_WHEELS, "DEBIAN_FRONTEND": "noninteractive",
           "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
#: pipx as root, where the README says: venvs under /opt/pipx, the command in /usr/local/bin
PIPX_ENV = {"PIPX_HOME": "/opt/pipx", "PIPX_BIN_DIR": "/usr/local/bin"}
#: the first MESSAGE_ID in sparkguard/data/catalog/sparkguard.catalog
CATALOG_ID = "664d84b2b89942f2ac3a8c34e6254450"


def readme_first_command() -> str:
    """The README's first command: its first indented code line."""
    for line in README.read_text().splitlines():
        if line.startswith("    ") and line.strip():
            return line.strip()
    raise AssertionError("README.md has no indented command")


def env_args(env: dict[str, str]) -> list[str]:
    """``["K=V", ...]`` for ``env`` / ``systemd-run --setenv``."""
    return [f"{k}={v}" for k, v in env.items()]


def metrics_up(c: nspawn.Container) -> bool:
    """Does a guard answer on 127.0.0.1:8799/metrics inside ``c``?"""
    r = c.run("/usr/bin/python3", "-c", "import urllib.request as u; "
              "print(u.urlopen('http://127.0.0.1:8799/metrics', timeout=3).read().decode())", check=False)
    return r.returncode == 0 and "sparkguard_term_below_bytes" in r.stdout


def check_readme_first_command(c: nspawn.Container, timeout: float = 400) -> None:
    """Run the README's first command as written in ``c`` (checkout at :data:`SRC`) and check what
    a new user sees: PEP 668's marker is there (the reason for the venv), the guard comes up from
    the venv through /usr/local/bin, the journal catalog is installed, a re-run of ``sparkguard
    install`` changes nothing, the installed unit runs, ``sparkguard uninstall`` removes the link.

    Raises:
        AssertionError: a step failed (the unit's journal in the message).
    """
    line = readme_first_command()
    assert "pip install ." in line and line.endswith("sparkguard run"), line
    # Debian and Ubuntu mark their Python as externally managed: pip refuses to install into it
    # (PEP 668), the reason for the venv (these minimal roots have no system pip to try it with)
    marker = c.sh("ls /usr/lib/python3*/EXTERNALLY-MANAGED", check=False)
    assert marker.returncode == 0, "no EXTERNALLY-MANAGED marker: the venv route is not what this system needs"

    # the line runs as a transient unit (`sparkguard run` stays in the foreground)
    c.run("systemd-run", "--unit=sg-readme", f"--working-directory={SRC}",
          *(f"--setenv={kv}" for kv in env_args(OFFLINE)), "/bin/sh", "-c", line)
    try:
        deadline = time.monotonic() + timeout
        while not metrics_up(c):
            state = c.show("sg-readme.service", "ActiveState")["ActiveState"]
            assert state in ("active", "activating") and time.monotonic() < deadline, \
                f"sg-readme is {state}:\n{c.journal_text('-u', 'sg-readme', '-n', '80')}"
            time.sleep(1)  # polls a pip install and a start-up that announce nothing to wait on
        out = c.journal_text("-u", "sg-readme")
        assert "created       /etc/systemd/system/sparkguard.service" in out, out
        assert f"created       {LINK}  (-> /opt/sparkguard/bin/sparkguard" in out, out
        assert "ran           journalctl --update-catalog" in out, out
        assert c.run("readlink", LINK).stdout.strip() == "/opt/sparkguard/bin/sparkguard"
        # the guard running is the one the line started, found through PATH
        ps = c.run("ps", "-eo", "args").stdout
        assert re.search(r"^/opt/sparkguard/bin/python3? /usr/local/bin/sparkguard run$", ps, re.M), ps
        catalog = c.run("journalctl", "--list-catalog", CATALOG_ID).stdout
        assert CATALOG_ID[:8] in catalog.replace("-", ""), catalog
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


def check_pipx_route(c: nspawn.Container) -> None:
    """The README's pipx route in ``c``: apt installs pipx (from the root's apt cache), ``pipx
    install .`` of the checkout puts the command in /usr/local/bin, ``sparkguard install`` leaves
    that link alone and its unit runs pipx's interpreter, ``sparkguard uninstall`` keeps pipx's
    link and ``pipx uninstall`` removes it.

    Raises:
        AssertionError: a step failed.
    """
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

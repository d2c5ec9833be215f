"""Debian 12's pyroute2 (0.7.2) has no AsyncIPRoute: the guard runs without the link watch, says so
once, and status and doctor say the watch is unavailable and why (sparkguard/linkcompat.py).

Run with Debian's own /usr/bin/python3 and its python3-pyroute2 (tests/install-deps installs it),
the interpreter the .deb runs the guard with."""

from __future__ import annotations

import json
import os
import subprocess
import types

import pytest
import yaml

from conftest import sg_env, sparkguard_cmd
from guardrun import GuardProc
from sparkguard import linkcompat

DEBIAN_PYTHON = "/usr/bin/python3"
#: exec Debian's python on the daemon's argv in place of this test's interpreter (argv[0])
WRAP = ("/bin/sh", "-c", f'shift; exec {DEBIAN_PYTHON} "$@"', "sh")


def debian_pyroute2_is_old() -> bool:
    code = "import pyroute2, sys; sys.exit(0 if not hasattr(pyroute2, 'AsyncIPRoute') else 1)"
    try:
        return subprocess.run([DEBIAN_PYTHON, "-c", code], timeout=60).returncode == 0
    except OSError:
        return False


def test_the_reason_names_the_version_and_what_is_needed():
    old = types.ModuleType("pyroute2")  # a pyroute2 with IPRoute only, as 0.7 is
    old.IPRoute = object
    reason = linkcompat.unavailable_reason(old)
    assert reason and reason.startswith("pyroute2 ") and "has no AsyncIPRoute" in reason and ">= 0.9.1" in reason
    new = types.ModuleType("pyroute2")
    new.AsyncIPRoute = object
    assert linkcompat.unavailable_reason(new) is None


@pytest.fixture
def old_pyroute2():
    if not debian_pyroute2_is_old():
        pytest.skip(f"{DEBIAN_PYTHON} has no pyroute2 0.7 (tests/install-deps installs python3-pyroute2)")


def test_guard_runs_without_the_watch_and_status_and_doctor_say_why(old_pyroute2, tmp_path):
    g = GuardProc({"link": {"interfaces": ["lo"]}}, wrap=WRAP)
    try:
        g.wait_ready(timeout=60)
        log = g.wait_log("link watch unavailable")
        assert "link watch unavailable: pyroute2 0.7" in log and "has no AsyncIPRoute" in log, log
        assert "lo are not watched" in log and "pyroute2 >= 0.9.1" in log
        assert "Traceback" not in log
        assert g.proc.poll() is None, "the guard ended"
        env = sg_env()
        st = subprocess.run([*WRAP, *sparkguard_cmd("status", "--config", g.config_path)], env=env,
                            capture_output=True, text=True, timeout=60)
        assert st.returncode == 0, st.stderr
        assert "link watch unavailable: pyroute2 0.7" in st.stdout and "lo missing" not in st.stdout, st.stdout
        doc = subprocess.run([*WRAP, *sparkguard_cmd("doctor", "--json", "--config", g.config_path)], env=env,
                             capture_output=True, text=True, timeout=120)
        assert "Traceback" not in doc.stderr, doc.stderr
        checks = {c["name"]: c for c in json.loads(doc.stdout)["checks"]} if doc.stdout.startswith("{") else \
            {c["name"]: c for c in json.loads(doc.stdout)}
        links = checks["links"]
        assert links["status"] == "WARN" and "link watch unavailable" in links["message"], links
    finally:
        assert g.stop() in (0, -15)

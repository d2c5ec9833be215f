"""Debian 12's pyroute2 (0.7.2) has no AsyncIPRoute: the guard runs without the link watch, says so
once, and status and doctor say the watch is unavailable and why (sparkguard/linkcompat.py), and
still read the links through 0.7's IPRoute (its messages read by IFLA_ names: linkstate.link_field).

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
from sparkguard import linkcompat, linkstate

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
        assert "link watch unavailable: pyroute2 0.7" in st.stdout, st.stdout
        assert "  lo: UP (operstate UNKNOWN, carrier True" in st.stdout and "MISSING" not in st.stdout, st.stdout
        doc = subprocess.run([*WRAP, *sparkguard_cmd("doctor", "--json", "--config", g.config_path)], env=env,
                             capture_output=True, text=True, timeout=120)
        assert "Traceback" not in doc.stderr, doc.stderr
        checks = {c["name"]: c for c in json.loads(doc.stdout)["checks"]} if doc.stdout.startswith("{") else \
            {c["name"]: c for c in json.loads(doc.stdout)}
        links = checks["links"]
        assert links["status"] == "WARN" and "link watch unavailable" in links["message"], links
        assert "lo up now but not watched" in links["message"], links
        lo = links["data"]["links"]["lo"]
        assert lo["present"] and lo["up"] and isinstance(lo["rx_errors"], int), lo
    finally:
        assert g.stop() in (0, -15)


class _Msg0_7(dict):
    """A link message as pyroute2 0.7 gives it: header fields by key, attributes only by IFLA_ name."""

    def __init__(self, header: dict, attrs: dict):
        super().__init__(header)
        self.attrs = attrs

    def get_attr(self, name):
        return self.attrs.get(name)


def test_link_fields_are_read_by_their_ifla_names_and_dicts_by_key():
    msg = _Msg0_7({"index": 3, "flags": 0x10043},
                  {"IFLA_IFNAME": "enp1s0f0np0", "IFLA_OPERSTATE": "UP", "IFLA_CARRIER": 1,
                   "IFLA_CARRIER_CHANGES": 4, "IFLA_STATS64": {"rx_errors": 2, "tx_dropped": 5}})
    assert msg.get("ifname") is None  # what 0.7 answers
    st = linkstate.new_state("enp1s0f0np0")
    linkstate.apply_msg(st, msg, deleted=False)
    assert linkstate.link_field(msg, "ifname") == "enp1s0f0np0"
    assert (st["index"], st["operstate"], st["carrier"], st["carrier_changes"]) == (3, "UP", True, 4)
    assert st["stats"] == {"rx_errors": 2, "tx_errors": 0, "rx_dropped": 0, "tx_dropped": 5}
    plain = {"ifname": "lo", "index": 1, "flags": 0x10049, "operstate": "UNKNOWN"}
    assert linkstate.link_field(plain, "ifname") == "lo" and linkstate.link_field(plain, "carrier") is None


def test_read_links_with_debian_pyroute2(old_pyroute2):
    """linkwatch.read_links under Debian's python3 and its pyroute2 0.7: lo is found and up, with counters."""
    code = ("import json; from sparkguard import linkwatch; "
            "print(json.dumps(linkwatch.read_links(['lo', 'sgnosuch0'])))")
    r = subprocess.run([DEBIAN_PYTHON, "-c", code], env=sg_env(), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    links = json.loads(r.stdout)
    assert links["lo"]["present"] and links["lo"]["up"] and links["lo"]["operstate"] == "UNKNOWN", links
    assert isinstance(links["lo"]["rx_errors"], int) and isinstance(links["lo"]["carrier_changes"], int), links
    assert links["sgnosuch0"]["present"] is False, links


def test_doctor_fails_a_missing_link_with_debian_pyroute2(old_pyroute2, tmp_path):
    """Without the watch, doctor still checks the links it can read: a missing one is a FAIL that
    also says the watch is unavailable."""
    cfg = tmp_path / "sparkguard.yaml"
    cfg.write_text(yaml.safe_dump({"link": {"interfaces": ["lo", "sgnosuch0"]}}))
    doc = subprocess.run([*WRAP, *sparkguard_cmd("doctor", "--json", "--config", str(cfg))], env=sg_env(),
                         capture_output=True, text=True, timeout=120)
    assert "Traceback" not in doc.stderr, doc.stderr
    out = json.loads(doc.stdout)
    checks = {c["name"]: c for c in (out["checks"] if isinstance(out, dict) else out)}
    links = checks["links"]
    assert links["status"] == "FAIL" and "sgnosuch0 missing" in links["message"], links
    assert "link watch unavailable: pyroute2 0.7" in links["message"], links
    assert links["data"]["links"]["lo"]["up"] is True, links

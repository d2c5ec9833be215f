"""tests/install-deps leaves running processes alone: a process named like a peer daemon
(earlyoom, nohang, prometheus) survives it.

The script runs in a PID namespace of its own with its own /proc, beside the peers this test
starts there: whatever it does by name, it can only reach them, never a process of the host.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from conftest import ROOT

SCRIPT = ROOT / "tests" / "install-deps"
PEERS = ("earlyoom", "nohang", "prometheus")


def _pkgs() -> list[str]:
    for line in SCRIPT.read_text().splitlines():
        if line.startswith("PKGS="):
            return line.split("=", 1)[1].strip('"').split()
    raise AssertionError("no PKGS= line in tests/install-deps")


def test_install_deps_leaves_running_peers_alone(root_only, tmp_path):
    if shutil.which("unshare") is None or shutil.which("dpkg") is None:
        pytest.skip("needs unshare and dpkg")
    missing = [p for p in _pkgs() if subprocess.run(["dpkg", "-s", p], capture_output=True, timeout=30).returncode]
    if missing:
        pytest.skip(f"packages missing ({' '.join(missing)}): the script would install them")
    # inside the namespace: a copy of sleep under each peer's name, started with that argv0,
    # then the script, then the names of those still alive
    starts = " ".join(f"cp /bin/sleep {tmp_path}/{n} && {tmp_path}/{n} 300 &" for n in PEERS)
    check = " ".join(f"$(pgrep -x {n} >/dev/null && echo {n})" for n in PEERS)
    # (polling, bounded to 5 s: no event says that a background child has exec'd)
    count = f"$(pgrep -c -x '{'|'.join(PEERS)}')"
    inner = (f"{starts} for i in $(seq 100); do [ {count} -eq {len(PEERS)} ] && break; sleep 0.05; done; "
             f"echo started={count}; sh {SCRIPT}; echo rc=$?; echo alive: {check}; kill $(jobs -p)")
    r = subprocess.run(["unshare", "--pid", "--fork", "--mount", "--mount-proc", "--kill-child", "sh", "-c", inner],
                       capture_output=True, text=True, timeout=120)
    assert f"started={len(PEERS)}" in r.stdout and "rc=0" in r.stdout, r.stdout + r.stderr
    alive = r.stdout.split("alive:", 1)[1].split()
    assert alive == list(PEERS), f"install-deps killed {sorted(set(PEERS) - set(alive))}: {r.stdout}{r.stderr}"

"""After a killed test run, :func:`vm.qemu.reap_stale` kills only the QEMU it recorded, never another process.

No VM is booted: a Python process whose command line names the VM's directory stands in for the
QEMU of a run that was killed outright; a second record points at a process that does not name its
directory (a PID reused by someone else), which must survive.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from system import nspawn
from vm import qemu


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait(timeout=10)
    return p.pid


def test_reap_stale_kills_the_recorded_qemu_only(tmp_path, monkeypatch):
    monkeypatch.setattr(nspawn, "CACHE_DIR", tmp_path)
    stale, reused, alive = tmp_path / "sgvm-stale", tmp_path / "sgvm-reused", tmp_path / "sgvm-alive"
    for d in (stale, reused, alive):
        d.mkdir()
    sleeper = [sys.executable, "-c", "import time; time.sleep(300)"]
    fake_qemu = subprocess.Popen(sleeper + [str(stale)])
    other = subprocess.Popen(sleeper)
    mine = subprocess.Popen(sleeper + [str(alive)])
    try:
        dead = _dead_pid()
        (stale / "owner").write_text(json.dumps({"pid": dead, "starttime": 1, "qemu": fake_qemu.pid}))
        (reused / "owner").write_text(json.dumps({"pid": dead, "starttime": 1, "qemu": other.pid}))
        # a live owner (this test process): its VM is left alone
        (alive / "owner").write_text(json.dumps({"pid": os.getpid(),
                                                 "starttime": nspawn._starttime(os.getpid()),
                                                 "qemu": mine.pid}))
        assert sorted(qemu.reap_stale()) == ["sgvm-reused", "sgvm-stale"]
        assert fake_qemu.wait(timeout=10) == -9
        assert other.poll() is None and mine.poll() is None
        assert not stale.exists() and not reused.exists() and alive.is_dir()
    finally:
        for p in (fake_qemu, other, mine):
            p.kill()
            p.wait(timeout=10)

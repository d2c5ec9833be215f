"""The guard refuses to start, with a clear message, when /proc hides other users' processes."""

import os
import shutil
import subprocess
import sys

import pytest
import tempfile
from pathlib import Path

from conftest import ROOT


request_cleanup: list = []


@pytest.fixture(autouse=True)
def _cleanup():
    yield
    while request_cleanup:
        shutil.rmtree(request_cleanup.pop(), ignore_errors=True)


def test_refuses_to_start_under_hidepid(root_only):
    if not shutil.which("unshare") or not shutil.which("setpriv"):
        pytest.skip("util-linux unshare/setpriv missing")
    # a copy of the package that an unprivileged user can read (pytest's tmp_path is 0700)
    tmp_path = Path(tempfile.mkdtemp(prefix="sg-hidepid-"))
    request_cleanup.append(tmp_path)
    pkg = tmp_path / "src"
    shutil.copytree(ROOT / "sparkguard", pkg / "sparkguard", ignore=shutil.ignore_patterns("__pycache__"))
    os.chmod(tmp_path, 0o755)
    for d, _, files in os.walk(pkg):
        os.chmod(d, 0o755)
        for f in files:
            os.chmod(os.path.join(d, f), 0o644)
    cfg = tmp_path / "sg.yaml"
    cfg.write_text("metrics:\n  listen: off\nincidents:\n  dir: /tmp\n  journal: off\n")
    os.chmod(cfg, 0o644)
    for python in (sys.executable, "/usr/bin/python3"):
        script = (
            # sh stays PID 1 of the new pid namespace (owned by root): the process the guard must see
            "mount -o remount,hidepid=invisible /proc && "
            f"setpriv --reuid=65534 --regid=65534 --clear-groups env PYTHONPATH={pkg} HOME=/tmp "
            f"{python} -m sparkguard run --config {cfg}"
        )
        # --kill-child: if the test times out and kills unshare, the namespace (and the guard) dies too
        r = subprocess.run(["unshare", "--mount", "--pid", "--fork", "--mount-proc", "--kill-child", "sh", "-c", script],
                           capture_output=True, text=True, timeout=60)
        # pyenv's interpreter under /root (0700) cannot be run by nobody: try the system one
        if not ("Permission denied" in r.stderr and "sparkguard" not in r.stderr):
            break
    else:
        pytest.skip(f"no interpreter an unprivileged user can run: {r.stderr.strip()[:200]}")
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "hidepid=invisible" in r.stderr
    assert "cannot see other users' processes" in r.stderr

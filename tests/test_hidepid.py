"""The guard refuses to start, with a clear message, when /proc hides other users' processes."""

import os
import shutil
import signal
import subprocess
import sys

import pytest
import tempfile
from pathlib import Path

from conftest import ROOT
from unprivileged import nobody  # noqa: F401 - fixture


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


def _in_pid_namespace(nobody, mount_opts: str, cfg: Path) -> list[str]:
    """argv: a new PID and mount namespace whose /proc is remounted with ``mount_opts``; a root-owned
    sleep is started in it, then the guard replaces the shell as PID 1, running as uid 65534."""
    guard = " ".join(nobody.sparkguard("run", "--config", str(cfg)))
    script = f"mount -o remount,{mount_opts} /proc && {{ sleep 600 & exec {guard}; }}"
    # --kill-child: if the test ends unshare, the namespace (guard and sleep) dies too
    return ["unshare", "--mount", "--pid", "--fork", "--mount-proc", "--kill-child", "sh", "-c", script]


def _start_namespace(nobody, mount_opts: str) -> subprocess.Popen:
    """The guard as PID 1 of a namespace whose /proc has ``mount_opts``; stderr piped (text)."""
    if not shutil.which("unshare"):
        pytest.skip("util-linux unshare missing")
    return subprocess.Popen(_in_pid_namespace(nobody, mount_opts, _guard_config(nobody)),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _guard_config(nobody) -> Path:
    cfg = nobody.dir / "sg.yaml"
    cfg.write_text("metrics:\n  listen: off\nincidents:\n  dir: /tmp\n  journal: off\n"
                   "targets:\n  match: ['^sg-hidepid-never$']\n")
    os.chmod(cfg, 0o644)
    return cfg


def test_refuses_to_start_as_pid_1_of_a_pid_namespace_under_hidepid(nobody):
    """A container entrypoint: the unprivileged guard is PID 1, the root-owned sleep beside it is hidden."""
    p = _start_namespace(nobody, "hidepid=invisible")
    try:
        _, err = p.communicate(timeout=60)
    finally:
        _end_namespace(p)
    assert p.returncode == 2, (p.returncode, err[-2000:])
    assert "sparkguard: not starting: /proc is mounted with hidepid=invisible and this process " \
           "(uid 65534, without CAP_SYS_PTRACE) cannot see other users' processes" in err, err


def _end_namespace(p: subprocess.Popen) -> None:
    """SIGKILL the namespace's PID 1 (unshare's child: setpriv's change of uid cleared the
    parent-death signal that --kill-child set), which ends everything in it, then unshare."""
    if p.poll() is None:
        with open(f"/proc/{p.pid}/task/{p.pid}/children") as f:
            for pid in f.read().split():
                os.kill(int(pid), signal.SIGKILL)
        p.kill()
        p.wait(30)


def test_starts_as_pid_1_when_the_gid_option_lets_it_see_and_says_what_it_sees(nobody):
    p = _start_namespace(nobody, "hidepid=invisible,gid=65534")
    try:
        import select
        import time
        seen, deadline = "", time.monotonic() + 60
        while "started:" not in seen:
            left = deadline - time.monotonic()
            assert left > 0 and p.poll() is None, seen
            # the raw fd, not p.stderr's buffer: select() cannot see lines already buffered
            if select.select([p.stderr], [], [], left)[0]:
                seen += os.read(p.stderr.fileno(), 65536).decode(errors="replace")
        # PID 1 is the guard (uid 65534): the root-owned sleep is the one process of another user
        assert "sees 2 processes in /proc, 1 of other users (1 readable), /proc hidepid=invisible" in seen, seen
        # PID 1 of the namespace (the guard), seen from here: unshare's child
        with open(f"/proc/{p.pid}/task/{p.pid}/children") as f:
            guard_pid = int(f.read().split()[0])
        os.kill(guard_pid, signal.SIGTERM)
        assert p.wait(30) == 0
    finally:
        _end_namespace(p)

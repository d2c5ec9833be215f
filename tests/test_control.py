"""The engine control socket: root-only permissions, and clear errors when the daemon is not there.

Real unix sockets and a real daemon; the unprivileged client runs as ``nobody``.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import subprocess
import tempfile

import pytest

from conftest import ROOT, run_sparkguard
from supervisor_helpers import Daemon, engine_config, fake_cmd, free_port, unique
from sparkguard import control

pytestmark = pytest.mark.usefixtures("root_only")


def test_no_daemon_gives_a_clear_error_and_exit_3(tmp_path):
    path = str(tmp_path / "absent.sock")
    with pytest.raises(control.ControlError) as e:
        control.request(path, {"op": "status"})
    assert "not running" in e.value.strerror and path in e.value.strerror
    r = run_sparkguard("engine", "--socket", path, "status")
    assert r.returncode == 3
    assert r.stderr.strip() == f"sparkguard engine: {e.value.strerror}"
    assert control.engine_status(path) is None


def test_stale_socket_is_reported_as_not_running(tmp_path):
    path = str(tmp_path / "stale.sock")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(path)            # bound, never listening: what a killed daemon leaves behind
    s.close()
    r = run_sparkguard("engine", "--socket", path, "restart", "--no-wait")
    assert r.returncode == 3
    assert "not running" in r.stderr and "stale socket" in r.stderr


def test_an_answer_sent_before_the_request_was_read_is_still_read(tmp_path):
    """The daemon refuses a non-root client at once (SO_PEERCRED) and closes without reading its
    request. Sending then fails with EPIPE; the client must still read and report the refusal,
    not end silently with status 0 (the CLI treats BrokenPipeError as a closed stdout). The
    request is made larger than the socket buffer so that the send always meets the closed end."""
    import threading
    path = str(tmp_path / "refusing.sock")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(1)
    answer = {"ok": False, "error": "permission denied: the engine control socket is for root only"}

    def refuse():
        conn, _ = srv.accept()
        conn.sendall(json.dumps(answer).encode() + b"\n")
        conn.close()
    t = threading.Thread(target=refuse, daemon=True)
    t.start()
    try:
        assert control.request(path, {"op": "stop", "pad": "x" * (8 << 20)}, timeout=20) == answer
    finally:
        t.join(20)
        srv.close()


def _nobody_python() -> str | None:
    """An interpreter user nobody can run (the test venv may live under /root)."""
    for exe in (shutil.which("python3"), "/usr/bin/python3"):
        if exe and subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", exe, "-c", "pass"],
                                  capture_output=True, timeout=30).returncode == 0:
            return exe
    return None


def test_socket_is_root_only_and_rejects_other_users(tmp_path):
    py = _nobody_python()
    if py is None or not shutil.which("setpriv"):
        pytest.skip("no interpreter runnable as nobody")
    # a directory nobody can traverse, so that the socket's own mode is what stops it
    sockdir = tempfile.mkdtemp(prefix="sgctl-", dir="/tmp")
    os.chmod(sockdir, 0o755)
    model, port = unique(), free_port()
    cfg = engine_config(tmp_path, model, fake_cmd(model, port), port,
                        control_socket=os.path.join(sockdir, "run", "control.sock"))
    d = Daemon(tmp_path, cfg)
    try:
        d.wait_control()
        st = os.stat(d.socket)
        assert stat.S_ISSOCK(st.st_mode)
        assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == 0
        assert stat.S_IMODE(os.stat(os.path.dirname(d.socket)).st_mode) == 0o755

        def as_nobody(*args):
            env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "HOME": "/"}
            return subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", py, "-m",
                                   "sparkguard", "engine", "--socket", d.socket, *args],
                                  capture_output=True, text=True, timeout=60, env=env, cwd="/")

        r = as_nobody("stop", "--no-wait")
        assert r.returncode == 3, r.stderr
        assert "permission denied" in r.stderr and "root" in r.stderr
        # even with the mode loosened, the daemon checks the peer's uid (SO_PEERCRED)
        os.chmod(d.socket, 0o666)
        r = as_nobody("stop", "--no-wait")
        assert r.returncode == 1, r.stderr
        assert "permission denied: the engine control socket is for root only" in r.stderr
        os.chmod(d.socket, 0o600)
        # nothing was stopped; root still controls it
        st = d.wait_ready()
        assert st["want"] == "run" and st["starts"] == 1
        # bad requests get errors, not a dead server
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(d.socket)
        s.sendall(b"this is not json\n")
        assert json.loads(s.makefile().readline()) == {"ok": False, "error": "bad request: expected one JSON "
                                                                           "object on one line"}
        s.close()
        assert "unknown op" in d.ctl("reboot")["error"]
        r = run_sparkguard("engine", "--socket", d.socket, "--json", "status")
        assert r.returncode == 0 and json.loads(r.stdout)["status"]["state"] == "ready"
        # a second daemon refuses to take over the socket
        d2 = Daemon(tmp_path, cfg, name="second")
        try:
            d2.wait_line(r"another sparkguard already serves " + d.socket.replace(".", r"\."), timeout=30)
            assert d2.proc.wait(30) == 2
        finally:
            d2.cleanup()
        assert d.status()["state"] == "ready"
    finally:
        d.cleanup()
        shutil.rmtree(sockdir, ignore_errors=True)
    # the daemon removed its socket on the way out
    assert not os.path.exists(d.socket)

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


def test_options_go_before_or_after_the_action_and_no_daemon_names_both(tmp_path):
    import yaml
    path = str(tmp_path / "absent.sock")
    cfg = tmp_path / "sg.yaml"
    cfg.write_text(yaml.safe_dump(engine_config(tmp_path, "m", ["true"], None, control_socket=path)))
    for argv in (["engine", "status", "--config", str(cfg)], ["engine", "-c", str(cfg), "status"],
                 ["engine", "status", "--json", "-c", str(cfg)], ["engine", "restart", "-c", str(cfg), "--no-wait"]):
        r = run_sparkguard(*argv)
        assert r.returncode == 3, (argv, r.stderr)
        err = r.stderr.strip()
        # the socket came from the config given after the action; the hint names both options
        assert err.startswith(f"sparkguard engine: sparkguard is not running with an engine: no control socket at {path}")
        assert "--config FILE" in err and "--socket PATH" in err, err
    r = run_sparkguard("engine", "status", "--no-wait", "--socket", path)
    assert r.returncode == 2 and "unrecognized arguments: --no-wait" in r.stderr    # status does not wait


def test_common_options_after_the_action_against_a_daemon_and_no_wait_says_what_it_did(tmp_path):
    model, port = unique(), free_port()
    d = Daemon(tmp_path, engine_config(tmp_path, model, fake_cmd(model, port), port))
    try:
        d.wait_control()
        st = d.wait_ready()
        cfg = str(d.path)
        r = run_sparkguard("engine", "status", "--config", cfg)
        assert r.returncode == 0, r.stderr
        assert r.stdout.startswith(f"engine: ready (pid {st['pid']}, up "), r.stdout
        for argv in (["engine", "status", "--json", "-c", cfg], ["engine", "--json", "status", "-c", cfg],
                     ["engine", "-c", cfg, "--json", "status"]):
            r = run_sparkguard(*argv)
            assert r.returncode == 0, (argv, r.stderr)
            assert json.loads(r.stdout)["status"]["pid"] == st["pid"]
        # --no-wait before or after the action: it says the restart was asked for, then the state
        for n, argv in enumerate((["engine", "restart", "--no-wait", "-c", cfg],
                                  ["engine", "--no-wait", "-c", cfg, "restart"]), start=1):
            r = run_sparkguard(*argv)
            assert r.returncode == 0, (argv, r.stderr)
            lines = r.stdout.splitlines()
            assert lines[0] == "sparkguard engine: restart requested; not waiting (see 'sparkguard engine status')"
            assert lines[1].startswith("engine: "), r.stdout
            st = d.wait_ready(after=n, timeout=30)
        assert st["restarts"]["manual"] == 2
        # waiting is the default, and --timeout also goes before the action
        r = run_sparkguard("engine", "--timeout", "60", "restart", "-c", cfg)
        assert r.returncode == 0, r.stderr
        assert r.stdout.startswith("engine: ready (pid "), r.stdout
        assert d.status()["starts"] == 4
    finally:
        d.cleanup()


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


def _server(tmp_path) -> control.ControlServer:
    srv = control.ControlServer(str(tmp_path / "c.sock"), lambda req: {"ok": True, "op": req.get("op")})
    srv.start()
    return srv


def test_a_dripping_client_is_dropped_at_the_request_deadline_and_busy_beyond_the_cap(tmp_path):
    """A client sending its request a byte at a time is cut off after REQUEST_DEADLINE in all
    (not per read); clients beyond MAX_CONNECTIONS get "busy" at once instead of a thread each."""
    import threading
    import time
    srv = _server(tmp_path)
    held = []
    try:
        drip = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        drip.connect(srv.path)
        drip.settimeout(0.3)
        t0 = time.monotonic()
        closed_after = None
        while time.monotonic() - t0 < control.REQUEST_DEADLINE + 3:
            try:
                drip.send(b" ")
                if drip.recv(1) == b"":
                    closed_after = time.monotonic() - t0
                    break
            except socket.timeout:
                continue
            except OSError:
                closed_after = time.monotonic() - t0
                break
        drip.close()
        assert closed_after is not None and closed_after < control.REQUEST_DEADLINE + 1

        threads_before = threading.active_count()
        for _ in range(control.MAX_CONNECTIONS + 5):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(srv.path)
            held.append(s)
        s = held[-1]
        s.settimeout(5)
        assert b"busy" in s.recv(4096)
        assert threading.active_count() <= threads_before + control.MAX_CONNECTIONS
        for s in held:
            s.close()
        # the slots come back: a real request is answered
        assert control.request(srv.path, {"op": "status"}, timeout=control.REQUEST_DEADLINE + 5)["ok"]
    finally:
        for s in held:
            s.close()
        srv.stop()


def test_a_broken_listening_socket_does_not_spin_the_accept_thread(tmp_path):
    """accept() failing at once on a shut-down socket: the thread pauses between tries."""
    import resource
    import time
    srv = _server(tmp_path)
    try:
        dup = socket.socket(fileno=os.dup(srv.sock.fileno()))
        dup.shutdown(socket.SHUT_RDWR)
        dup.close()
        cpu0 = resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.monotonic()
        time.sleep(1.0)      # measuring the CPU the thread burns meanwhile; nothing to await
        cpu1 = resource.getrusage(resource.RUSAGE_SELF)
        used = (cpu1.ru_utime + cpu1.ru_stime) - (cpu0.ru_utime + cpu0.ru_stime)
        assert used < 0.2 * (time.monotonic() - t0), f"{used:.2f} s of CPU in 1 s: the accept loop spins"
    finally:
        srv.stop()

"""Helpers for the engine-supervisor tests: a real ``sparkguard run`` with an ``engine:`` section
supervising the real fake vLLM (tests/fakes/fake_vllm.py), with output read line by line.

Everything a test starts is cleaned up: the daemon gets SIGTERM (which stops its engine), and
every engine process seen in the daemon's forwarded output ("fake-vllm: ready pids=...") is
SIGKILLed through a pidfd if still alive with the same start time.  Nothing else is signalled.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import threading
import time
import uuid

import yaml

from conftest import fake_vllm, sg_env, sparkguard_cmd, terminate
from sparkguard import control, proctree
from sparkguard.supervisor.process import proc_state as _state

READY_RE = re.compile(r"fake-vllm: ready pids=([0-9,]+)")


def free_port() -> int:
    """A TCP port free on loopback right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def unique(prefix: str = "sgsup") -> str:
    """A name no other test (or engineer) uses: used as the model name and targets.match."""
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def fake_cmd(model: str, port: int | None, *opts: str) -> list[str]:
    """argv of a small fake vLLM (8 MiB per process) serving on ``port``."""
    base = ["--hold", "8MiB", "--hold-core", "8MiB", "--hold-api", "8MiB", "--tp", "2"]
    if port is not None:
        base += ["--port", str(port)]
    return fake_vllm.command(model, *base, *opts)


def engine_config(tmp_path, model: str, command: list[str], port: int | None, **engine) -> dict:
    """A config dict: guard line far below MemAvailable (never fires unless a test moves it),
    targets.match unique to the test, files under tmp_path, fast gates and timeouts."""
    e = {
        "command": command, "log": "stderr", "drop_caches": False,
        "start_above": "64MiB", "stable_for": "0s", "quiesce_timeout": "60s",
        "health_interval": "100ms", "ready_timeout": "30s",
        "backoff_initial": "100ms", "backoff_max": "2s", "stable_after": "60s",
        "state_file": str(tmp_path / "engine-state.json"),
        "control_socket": str(tmp_path / "control.sock"),
    }
    if port is not None:
        e["health_url"] = f"http://127.0.0.1:{port}/health"
    e.update(engine)
    return {
        "guard": {"term_below": "128MiB", "grace": "3s", "recovery_wait": "2s"},
        "targets": {"match": [re.escape(model)]},
        "metrics": {"listen": "off"},
        "incidents": {"dir": str(tmp_path / "incidents"), "journal": "off"},
        "engine": e,
    }


class Daemon:
    """A running ``sparkguard run -c CFG``; its stderr collected line by line.

    Args:
        tmp_path: pytest tmp_path.
        cfg: config dict (written to tmp_path/NAME.yaml).
        extra_args: more arguments of ``sparkguard run`` (e.g. ``--meminfo FILE``).
    """

    def __init__(self, tmp_path, cfg: dict, name: str = "sparkguard", extra_args: tuple = ()):
        self.tmp_path = tmp_path
        self.cfg = cfg
        self.path = tmp_path / f"{name}.yaml"
        self.path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        self.socket = cfg.get("engine", {}).get("control_socket")
        self.lines: list[str] = []
        self.cv = threading.Condition()
        self.engine_pids: dict[int, int] = {}     # pid -> starttime of every engine process seen
        self.proc = subprocess.Popen(sparkguard_cmd("run", "-c", str(self.path), *extra_args), env=sg_env(),
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True, errors="replace")
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            line = line.rstrip("\n")
            m = READY_RE.search(line)
            if m:
                for pid in (int(x) for x in m.group(1).split(",")):
                    p = proctree.read_proc(pid)
                    if p is not None:
                        self.engine_pids[pid] = p.starttime
            with self.cv:
                self.lines.append(line)
                self.cv.notify_all()
        with self.cv:
            self.lines.append("<EOF>")
            self.cv.notify_all()

    def wait_line(self, pattern: str, timeout: float = 30.0, start: int = 0) -> re.Match:
        """First output line from index ``start`` on matching regex ``pattern``; AssertionError on timeout."""
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        with self.cv:
            i = start
            while True:
                while i < len(self.lines):
                    m = rx.search(self.lines[i])
                    if m:
                        return m
                    if self.lines[i] == "<EOF>":
                        raise AssertionError(f"daemon exited before {pattern!r}:\n" + self.output())
                    i += 1
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"no line matching {pattern!r} within {timeout} s:\n" + self.output())
                self.cv.wait(left)

    def mark(self) -> int:
        """Index for ``wait_line(start=...)``: only lines after now."""
        with self.cv:
            return len(self.lines)

    def output(self) -> str:
        """The last 200 lines, the engine's HTTP access lines left out."""
        with self.cv:
            lines = [ln for ln in self.lines if '"GET /health HTTP' not in ln]
        return "\n".join(lines[-200:])

    def wait_control(self, timeout: float = 30.0) -> None:
        """Until the control socket is served (the daemon logs it once bound)."""
        self.wait_line(r"engine control on ", timeout)

    def ctl(self, op: str, sock_timeout: float = 10.0, **kw) -> dict:
        """One control request (the real client code)."""
        return control.request(self.socket, {"op": op, **kw}, timeout=sock_timeout)

    def status(self) -> dict:
        r = self.ctl("status")
        assert r["ok"], r
        return r["status"]

    def wait_ready(self, after: int = 0, timeout: float = 30.0, lane: str | None = None) -> dict:
        """Until a start after the ``after``-th is ready; returns the status.  Fails on give-up."""
        req = {"until": "ready", "after": after, "timeout": timeout}
        if lane:
            req["lane"] = lane
        r = self.ctl("wait", sock_timeout=timeout + 10, **req)
        assert r["ok"], f"{r.get('error')}\n{self.output()}"
        return r["status"]

    def wait_starts(self, n: int, timeout: float = 30.0) -> dict:
        """Until the engine has been spawned more than ``n`` times; returns the status."""
        r = self.ctl("wait", sock_timeout=timeout + 10, until="starts", after=n, timeout=timeout)
        assert r["ok"], f"{r.get('error')}\n{self.output()}"
        return r["status"]

    def incident(self, kind: str, timeout: float = 30.0, start: int = 0, where=None) -> dict:
        """The first incident report of ``kind`` (and for which ``where(record)`` is true, e.g. the
        report again with its restart) from output index ``start`` on: the reporter logs
        "incident ID: OUTCOME: ..." once it has saved ``incidents.dir/ID.json``; the record is
        loaded from that file."""
        import json
        deadline = time.monotonic() + timeout
        i = start
        while True:
            m = self.wait_line(r"incident (\S+): (\w+): ", max(0.1, deadline - time.monotonic()), start=i)
            with self.cv:
                i = next(k for k in range(i, len(self.lines)) if m.group(0) in self.lines[k]) + 1
            path = os.path.join(self.cfg["incidents"]["dir"], m.group(1) + ".json")
            with open(path) as f:
                inc = json.load(f)
            if inc["kind"] == kind and (where is None or where(inc)):
                return inc

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM the daemon (it stops its engine) and wait; SIGKILL after ``timeout``."""
        terminate(self.proc, timeout)
        self.reader.join(10)
        return self.proc.returncode

    def alive_engine_pids(self) -> list[int]:
        """Engine processes seen so far that still run (same start time), zombies excluded."""
        out = []
        for pid, st in list(self.engine_pids.items()):
            p = proctree.read_proc(pid)
            if p is not None and p.starttime == st and _state(pid) not in ("Z", None):
                out.append(pid)
        return out

    def cleanup(self) -> None:
        """Stop the daemon, then SIGKILL (pidfd) any engine process it left: only ones we saw start."""
        self.stop()
        kill_pids(self.engine_pids)


def restarted(inc: dict) -> bool:
    """``where`` for :meth:`Daemon.incident`: the report once the restart it caused was added."""
    return bool(inc["timeline"]) and inc["timeline"][-1]["event"] == "restart"


def kill_pids(pids: dict[int, int]) -> None:
    """SIGKILL through pidfds every pid whose start time still matches (never a recycled pid)."""
    for pid, st in pids.items():
        try:
            fd = os.pidfd_open(pid)
        except OSError:
            continue
        try:
            p = proctree.read_proc(pid)
            if p is not None and p.starttime == st:
                signal.pidfd_send_signal(fd, signal.SIGKILL)
        except OSError:
            pass
        finally:
            os.close(fd)


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    """Wait (pidfd poll) until every pid has exited; returns those still running after ``timeout``."""
    import select
    fds = {}
    for pid in pids:
        try:
            fds[pid] = os.pidfd_open(pid)
        except OSError:
            pass
    try:
        deadline = time.monotonic() + timeout
        p = select.poll()
        for fd in fds.values():
            p.register(fd, select.POLLIN)
        left = dict(fds)
        while left and time.monotonic() < deadline:
            for fd, _ in p.poll(max(1, (deadline - time.monotonic()) * 1000)):
                p.unregister(fd)
                left = {k: v for k, v in left.items() if v != fd}
        return [pid for pid in left if _state(pid) not in ("Z", None)]
    finally:
        for fd in fds.values():
            os.close(fd)

"""Helpers to run a real ``sparkguard run`` with a config and a NOTIFY_SOCKET bound by the test."""

from __future__ import annotations

import os
import socket
import subprocess
import tempfile
import time
import uuid

import yaml

from conftest import sg_env, sparkguard_cmd, terminate


#: temp folders of every GuardProc, removed when the test session ends
TEMP_DIRS: list[str] = []


class NotifyListener:
    """A unix datagram socket standing in for systemd's NOTIFY_SOCKET."""

    def __init__(self, path: str):
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(path)
        self.messages: list[dict[str, str]] = []

    def recv(self, timeout: float) -> dict[str, str] | None:
        self.sock.settimeout(timeout)
        try:
            data = self.sock.recv(65536)
        except socket.timeout:
            return None
        msg = dict(line.split("=", 1) for line in data.decode().splitlines() if "=" in line)
        self.messages.append(msg)
        return msg

    def wait_for(self, pred, timeout: float = 20.0) -> dict[str, str]:
        """Wait for a datagram for which ``pred(msg)`` is true; AssertionError on timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            msg = self.recv(max(0.01, deadline - time.monotonic()))
            if msg is not None and pred(msg):
                return msg
        raise AssertionError(f"no matching sd_notify message within {timeout}s; got {self.messages[-10:]}")

    def close(self) -> None:
        self.sock.close()


class GuardProc:
    """``sparkguard run --config <tmp>`` as a child, with its own NOTIFY_SOCKET.

    Args:
        cfg: dict written as the YAML config (an ``incidents.dir`` in a temp dir and
            ``metrics.listen: off`` are added unless given).
        watchdog_usec: sets WATCHDOG_USEC for the child when given.
        wrap: argv put before the daemon's (e.g. ``unshare -m sh -c ... sh``), exec'ing into it.
    """

    def __init__(self, cfg: dict, watchdog_usec: int | None = None, extra_args: tuple = (),
                 env_extra: dict | None = None, wrap: tuple = ()):
        self.tmp = tempfile.mkdtemp(prefix="sg-guard-")
        TEMP_DIRS.append(self.tmp)        # removed at the end of the session (conftest)
        cfg = {k: dict(v) for k, v in cfg.items()}
        cfg.setdefault("incidents", {}).setdefault("dir", os.path.join(self.tmp, "incidents"))
        cfg["incidents"].setdefault("journal", "off")
        cfg.setdefault("metrics", {}).setdefault("listen", "off")
        self.cfg = cfg
        self.config_path = os.path.join(self.tmp, "sparkguard.yaml")
        self.write_config(cfg)
        self.notify = NotifyListener(os.path.join(self.tmp, "notify.sock"))
        # the reload result file (sparkguard.reload) goes to this test's folder, not /run/sparkguard
        env = sg_env(NOTIFY_SOCKET=self.notify.path, RUNTIME_DIRECTORY=self.tmp)
        if watchdog_usec:
            env["WATCHDOG_USEC"] = str(watchdog_usec)
        env.update(env_extra or {})
        self.log_path = os.path.join(self.tmp, "guard.log")
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen([*wrap, *sparkguard_cmd("run", "--config", self.config_path, *extra_args)],
                                     env=env, stdout=self._log, stderr=subprocess.STDOUT)

    def write_config(self, cfg: dict) -> None:
        tmp = self.config_path + ".tmp"
        with open(tmp, "w") as f:
            yaml.safe_dump(cfg, f)
        os.replace(tmp, self.config_path)

    def wait_ready(self, timeout: float = 20.0) -> dict[str, str]:
        return self.notify.wait_for(lambda m: m.get("READY") == "1", timeout)

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def wait_log(self, text: str, timeout: float = 10.0) -> str:
        """Wait until the daemon's log holds ``text`` (it logs through a queue and a thread, so a
        line can land just after the sd_notify message that announced the same event)."""
        deadline = time.monotonic() + timeout
        while text not in self.log():
            if time.monotonic() > deadline:
                raise AssertionError(f"{text!r} not in the log within {timeout}s:\n{self.log()[-2000:]}")
            self.notify.recv(0.05)   # waits on the socket: no other event tells a log line was written
        return self.log()

    def stop(self, timeout: float = 10.0) -> int:
        terminate(self.proc, timeout)
        self._log.close()
        self.notify.close()
        return self.proc.returncode




def unique(prefix: str = "sgtest") -> str:
    """A name no other test (or engineer) uses."""
    return f"{prefix}-{uuid.uuid4().hex[:10]}"

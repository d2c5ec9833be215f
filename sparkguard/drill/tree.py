"""The handle of a running fake tree (the drill's or the tests' fake vLLM): Popen, output, pids.

The tree's top prints ``fake-vllm: ready pids=<top>,<core>,<w0>,...[ port=N]`` once it is up;
:class:`Tree` drains its output in a thread, pins every pid of that line with a pidfd, and kills
the whole tree by those pidfds (and its process group) in :meth:`Tree.stop`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

from sparkguard.drill.plumbing import exited, send, wait_fds

READY_PREFIX = "fake-vllm: ready "


def parse_ready(line: str) -> dict:
    """``fake-vllm: ready pids=1,2,3 port=80`` -> ``{"pids": [1, 2, 3], "port": 80}``."""
    out: dict = {}
    for word in line[len(READY_PREFIX):].split():
        key, _, val = word.partition("=")
        if key == "pids":
            out["pids"] = [int(p) for p in val.split(",") if p]
        elif key == "port":
            out["port"] = int(val)
    return out


class Tree:
    """A running tree (this module's or the tests' full fake vLLM): its Popen, its output, its pids.

    Every pid of the ready line is pinned by a pidfd as soon as the line is read, so that
    :meth:`exited` and :meth:`stop` never touch a recycled pid.

    Attributes:
        proc: subprocess.Popen of the top process (stdout+stderr are a pipe drained by a thread).
        argv: list[str], the command line.
        lines: list[str], every output line so far (without newline).
    """

    def __init__(self, argv: list[str], on_line=None, **popen_kw):
        self.argv = argv
        self.lines: list[str] = []
        self._on_line = on_line
        self._cond = threading.Condition()
        self._ready_line: str | None = None
        self._pidfds: dict[int, int] = {}
        self._own_session = popen_kw.setdefault("start_new_session", True)
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, **popen_kw)
        self._pidfds[self.proc.pid] = os.pidfd_open(self.proc.pid)
        self._reader = threading.Thread(target=self._read, name=f"fake-vllm-{self.proc.pid}", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for raw in self.proc.stdout:
            line = raw.decode("utf-8", "replace").rstrip("\n")
            with self._cond:
                if line.startswith(READY_PREFIX) and self._ready_line is None:
                    for pid in parse_ready(line)["pids"]:
                        if pid not in self._pidfds:
                            try:
                                self._pidfds[pid] = os.pidfd_open(pid)
                            except OSError:
                                pass
                    self._ready_line = line
                self.lines.append(line)
                self._cond.notify_all()
            if self._on_line:
                try:
                    self._on_line(line)
                except Exception:  # noqa: BLE001 - a callback must not stop the draining
                    pass
        with self._cond:
            self._cond.notify_all()

    def wait_line(self, substring: str, timeout: float = 30.0, start: int = 0) -> str:
        """Wait for an output line containing ``substring`` (searching from index ``start``).

        Raises:
            TimeoutError: not seen within ``timeout`` seconds, or the output ended first.
        """
        deadline = time.monotonic() + timeout
        i = start
        with self._cond:
            while True:
                while i < len(self.lines):
                    if substring in self.lines[i]:
                        return self.lines[i]
                    i += 1
                left = deadline - time.monotonic()
                if left <= 0 or not self._reader.is_alive():
                    tail = "\n".join(self.lines[-20:])
                    raise TimeoutError(f"fake vllm: no line with {substring!r} within {timeout} s; output tail:\n{tail}")
                self._cond.wait(left)

    def pids(self, timeout: float = 30.0) -> list[int]:
        """Wait for the ready line; return ``[top, core, w0, w1, ...]``.

        Raises:
            TimeoutError: the tree was not up within ``timeout`` seconds (or it exited).
        """
        return parse_ready(self.wait_line(READY_PREFIX, timeout))["pids"]

    @property
    def worker_pids(self) -> list[int]:
        """Worker pids by rank; waits for readiness."""
        return self.pids()[2:]

    def start_fill(self) -> None:
        """Send SIGUSR1 to the filling worker (TP0); waits for readiness.

        Raises:
            ValueError: started without ``--fill-size`` (SIGUSR1 would kill that worker).
        """
        if "--fill-size" not in self.argv:
            raise ValueError("start_fill(): this tree was started without --fill-size")
        send(self._pidfds.get(self.worker_pids[0]), signal.SIGUSR1)

    def exited(self, pid: int) -> bool:
        """True once process ``pid`` of this tree has exited (pidfd readable; zombie counts as exited).

        Raises:
            KeyError: ``pid`` is not one of this tree's (or it was gone before its pidfd was opened).
        """
        fd = self._pidfds.get(pid)
        if fd is None:
            raise KeyError(f"pid {pid} is not part of this tree")
        return exited(fd)

    def wait_gone(self, pids: list[int], timeout: float) -> bool:
        """Wait until every pid in ``pids`` (of this tree) has exited; False on timeout."""
        fds = [self._pidfds[p] for p in pids]
        deadline = time.monotonic() + timeout
        while True:
            left = [fd for fd in fds if not exited(fd)]
            if not left:
                return True
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            wait_fds(left[:1], remaining)

    def stop(self, timeout: float = 10.0) -> None:
        """SIGKILL the whole tree this started (every recorded pid, by pidfd, plus its process group
        while the top is unreaped and in its own session), reap the top, close the pidfds.  Idempotent."""
        for fd in list(self._pidfds.values()):
            send(fd, signal.SIGKILL)
        if self._own_session and self.proc.returncode is None:
            try:  # the top is unreaped, so its pid (= our pgid) cannot have been reused
                os.killpg(self.proc.pid, signal.SIGKILL)
            except OSError:
                pass
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        self.wait_gone(list(self._pidfds), timeout)
        self._reader.join(timeout)
        for fd in self._pidfds.values():
            try:
                os.close(fd)
            except OSError:
                pass
        self._pidfds = {}
        if self.proc.stdout:
            self.proc.stdout.close()

    def __enter__(self) -> "Tree":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

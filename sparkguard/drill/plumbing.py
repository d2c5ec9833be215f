"""Per-process plumbing of the drill's tree and the tests' fake vLLM: log lines, signals, fork, pidfds.

Each process of a fake tree logs like vLLM (one ``write(2)`` per line), learns of signals through
a self-pipe (:class:`Signals`) and waits with ``select`` on it and on pidfds (``pidfd_open(2)``,
Linux 5.3: readable once the process has exited).  :func:`fork` blocks :data:`BLOCKED` around
``fork()`` so that a child installs its own handlers before any of them reaches it.
"""

from __future__ import annotations

import os
import select
import signal
import sys
import time

#: the signals a new child blocks until its own handlers are in place
BLOCKED = {signal.SIGTERM, signal.SIGINT, signal.SIGUSR1}


class Log:
    """vLLM-style log lines, one write(2) per line to stdout (atomic on a pipe below PIPE_BUF)."""

    def __init__(self, prefix: str = ""):
        self.prefix = prefix

    def raw(self, line: str) -> None:
        data = (line.rstrip("\n") + "\n").encode("utf-8", "replace")
        try:
            os.write(1, data)
        except OSError:
            pass  # reader gone: an orphan keeps running without its log, as vLLM's would

    def __call__(self, level: str, where: str, msg: str) -> None:
        self.raw(f"{self.prefix}{level} {time.strftime('%m-%d %H:%M:%S')} [{where}] {msg}")


class Signals:
    """Self-pipe for signals: handlers only wake ``rfd``; the owning loop decides what to do.

    SIGTERM and SIGINT are ignored (``ignore_term``) or caught; SIGUSR1 is caught with
    ``catch_usr1`` and keeps its default action (death) otherwise.
    """

    def __init__(self, ignore_term: bool, catch_usr1: bool = False):
        self.rfd, self.wfd = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(self.wfd, warn_on_full_buffer=False)
        for s in (signal.SIGTERM, signal.SIGINT):
            signal.signal(s, signal.SIG_IGN if ignore_term else _noop)
        signal.signal(signal.SIGUSR1, _noop if catch_usr1 else signal.SIG_DFL)

    def read(self) -> list[int]:
        """Signal numbers received since the last read (non-blocking)."""
        try:
            return list(os.read(self.rfd, 512))
        except BlockingIOError:
            return []

    def fds(self) -> list[int]:
        return [self.rfd, self.wfd]


def _noop(signum, frame) -> None:  # the wakeup fd carries the signal number
    return None


def is_term(signals: list[int]) -> bool:
    """True if SIGTERM or SIGINT is among ``signals`` (numbers from :meth:`Signals.read`)."""
    return any(s in (signal.SIGTERM, signal.SIGINT) for s in signals)


def settitle(title: str) -> None:
    """Rename this process as vLLM does (setproctitle: cmdline = title, comm = title[:15])."""
    import setproctitle  # imported only in the children: the top must keep its cmdline

    setproctitle.setproctitle(title)


def wait_fds(fds: list[int], timeout: float | None) -> list[int]:
    """The fds of ``fds`` readable within ``timeout`` seconds (None: no limit)."""
    if timeout is not None:
        timeout = max(0.0, timeout)
    return select.select(fds, [], [], timeout)[0]


def exited(pidfd: int) -> bool:
    """True once the process of ``pidfd`` has exited (the pidfd polls readable; a zombie counts)."""
    return bool(wait_fds([pidfd], 0))


def send(pidfd: int | None, sig: int) -> None:
    """Signal the process of ``pidfd``; nothing when it is None or gone."""
    if pidfd is None:
        return
    try:
        signal.pidfd_send_signal(pidfd, sig)
    except OSError:
        pass


def reap(pid: int, block: bool) -> int | None:
    """waitpid a child; returns its exit status (negative signal like Popen) or None if still running."""
    try:
        got, status = os.waitpid(pid, 0 if block else os.WNOHANG)
    except ChildProcessError:
        return None
    if got == 0:
        return None
    return os.waitstatus_to_exitcode(status)


def sleep_until(deadline: float) -> None:
    """Sleep to a monotonic deadline; signals meanwhile only wake the (unread) pipe."""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return
        time.sleep(left)


def fork(child_main, close_fds: list[int]) -> int:
    """fork with :data:`BLOCKED` blocked, so none reaches the child before it installs its own.

    The child closes ``close_fds`` (the parent's wakeup pipe, sockets, pidfds), runs
    ``child_main()`` (which unblocks the signals once its handlers are in place) and always
    leaves with os._exit, never through the parent's stack.  Returns the child's pid.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    old = signal.pthread_sigmask(signal.SIG_BLOCK, BLOCKED)
    pid = os.fork()
    if pid == 0:
        code = 70
        try:
            signal.set_wakeup_fd(-1)
            for fd in close_fds:
                try:
                    os.close(fd)
                except OSError:
                    pass
            code = child_main()
        except BaseException as e:  # noqa: BLE001 - a child must never return into the parent's code
            try:
                Log(f"(pid={os.getpid()}) ").raw(f"ERROR fake-vllm child failed: {e!r}")
            finally:
                os._exit(70)
        os._exit(code if isinstance(code, int) else 0)
    signal.pthread_sigmask(signal.SIG_SETMASK, old)
    return pid

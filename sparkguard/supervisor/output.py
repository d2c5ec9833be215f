"""Engine output: stdout/stderr forwarded line by line to the journal, the last lines kept.

The engine's pipes are read as the lines come (nothing buffered for minutes), each line goes to
journald under the engine's own identifier (``vllm``, ``sglang``...) with a syslog priority read
from its level prefix, and the last ``engine.log_lines`` lines are kept for incident reports.
"""

from __future__ import annotations

import collections
import errno
import logging
import os
import selectors
import socket
import stat
import sys
import time
from typing import Callable

from sparkguard import journal

log = logging.getLogger("sparkguard.supervisor")

MAX_LINE = 16384         # bytes; longer output lines are cut into pieces
#: lines of engine output passed on per second at most (journald's own default limit is
#: 10000 per 30 s per unit, journald.conf RateLimitBurst/RateLimitIntervalSec)
MAX_LINES_PER_SECOND = 1000
_LEVELS = {"CRITICAL": 2, "ERROR": 3, "WARNING": 4, "WARN": 4, "INFO": 6, "DEBUG": 7}


def identifier_for(argv: tuple[str, ...] | list[str]) -> str:
    """Journal SYSLOG_IDENTIFIER for an engine command: the program's name.

    ``[/usr/bin/python3, /usr/local/bin/vllm, serve, M]`` -> ``"vllm"``; ``[python3, -m,
    sglang.launch_server]`` -> ``"sglang"``; ``[/opt/tritonserver/bin/tritonserver]`` -> ``"tritonserver"``.
    """
    a = list(argv)
    if a and os.path.basename(a[0]).startswith("python"):
        if len(a) > 2 and a[1] == "-m":
            return a[2].split(".")[0]
        if len(a) > 1 and not a[1].startswith("-"):
            return os.path.basename(a[1]).removesuffix(".py")
    return os.path.basename(a[0]) if a else "engine"


def _level_priority(line: str, default: int) -> int:
    """syslog PRIORITY from a leading ``INFO``/``WARNING``/... (vLLM's and Python logging's format)."""
    head = line.lstrip("(").split(None, 1)
    if head:
        p = _LEVELS.get(head[0].rstrip(":").upper())
        if p is not None:
            return p
    for word, p in (("ERROR", 3), ("WARNING", 4), ("INFO", 6)):
        if f" {word} " in line[:120]:
            return p
    return default


class LogSink:
    """Where engine output lines go: journald (native protocol, the engine's own identifier)
    or the daemon's stderr ("IDENT[PID]: line").

    Args:
        mode: ``"auto"`` (journal if its socket answers, else stderr), ``"journal"``, ``"stderr"``.
        socket_path: journald's native socket.
        identifier: SYSLOG_IDENTIFIER of the entries.
    Uses :mod:`sparkguard.journal` (``encode``/``send``) for the journal.
    """

    def __init__(self, mode: str, socket_path: str, identifier: str):
        self.identifier = identifier
        self.socket_path = socket_path
        self.journal = None
        self.sock = None
        self._warned = False
        if mode != "stderr":
            if mode == "journal" or journal.available(socket_path):
                self.journal = journal
                self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                self.sock.settimeout(2.0)
            elif mode == "journal":
                log.warning("engine.log is journal but nothing listens on %s; engine output goes to stderr",
                            socket_path)

    def write(self, line: str, stream: str, pid: int | None, lane: str | None) -> None:
        """Send one line; never raises (falls back to stderr)."""
        default = 6 if stream == "stdout" else 4
        if self.journal is not None:
            fields = {"MESSAGE": line, "PRIORITY": _level_priority(line, default),
                      "SYSLOG_IDENTIFIER": self.identifier, "SPARKGUARD_ENGINE_STREAM": stream}
            if pid is not None:
                fields["SYSLOG_PID"] = pid
                fields["SPARKGUARD_ENGINE_PID"] = pid
            if lane:
                fields["SPARKGUARD_ENGINE_LANE"] = lane
            try:
                payload = self.journal.encode(fields)
                try:
                    self.sock.sendto(payload, self.socket_path)
                except OSError as e:
                    if e.errno not in (errno.EMSGSIZE, errno.ENOBUFS):
                        raise
                    self.journal.send(fields, self.socket_path)
                return
            except (OSError, ValueError) as e:
                if not self._warned:
                    log.warning("engine output to the journal failed (%s); using stderr", e)
                    self._warned = True
        try:
            sys.stderr.write(f"{self.identifier}[{pid}]: {line}\n")
            sys.stderr.flush()
        except (OSError, ValueError):
            pass

    def close(self) -> None:
        """Close the socket."""
        if self.sock is not None:
            self.sock.close()
            self.sock = None


class LastLines:
    """One run's last output lines, for incident reports (each run has its own, so a report
    written after the run ended, even after the next one started, still has that run's lines).

    Args:
        n: int, lines kept (``engine.log_lines``).
    """

    def __init__(self, n: int):
        self.ring: collections.deque[tuple[float, str, str]] = collections.deque(maxlen=n)

    def add(self, stream: str, line: str) -> None:
        """Keep one line (``stream`` is ``"stdout"`` or ``"stderr"``); thread-safe (deque append)."""
        self.ring.append((time.time(), stream, line))

    def current(self) -> list[str]:
        """The lines kept, oldest first."""
        return [ln for _, _, ln in list(self.ring)]


def pump(stdout, stderr, on_line: Callable[[str, bytes], None],
         max_rate: int | None = None, clock: Callable[[], float] = time.monotonic) -> None:
    """Read two pipes until both close (orphans holding them included), calling
    ``on_line(stream, raw_line)`` for every line as it arrives (``stream`` ``"stdout"``/``"stderr"``;
    the line without its newline; lines longer than :data:`MAX_LINE` bytes cut into pieces;
    a last line without a newline is passed at EOF).  Returns when both pipes are closed;
    never raises for pipes closed under it.

    At most ``max_rate`` lines a second (default :data:`MAX_LINES_PER_SECOND`) are passed on;
    beyond that the pipes are still drained (an engine blocked on a full pipe would stall) but
    the lines are only counted, and the next second starts with one line saying how many were
    dropped.  An engine printing as fast as it can so costs the daemon reads and a newline
    count per 64 KiB, not a journal entry per line.
    """
    rate = MAX_LINES_PER_SECOND if max_rate is None else max_rate
    sel = selectors.DefaultSelector()
    bufs = {}
    open_fds = 0
    for name, f in (("stdout", stdout), ("stderr", stderr)):
        if f is None:           # a stream that could not be re-attached after an adoption
            continue
        os.set_blocking(f.fileno(), False)
        sel.register(f.fileno(), selectors.EVENT_READ, name)
        bufs[name] = b""
        open_fds += 1
    window, passed, dropped = clock(), 0, 0
    try:
        while open_fds:
            for key, _ in sel.select():
                name = key.data
                try:
                    chunk = os.read(key.fd, 65536)
                except BlockingIOError:
                    continue
                except OSError:
                    chunk = b""
                now = clock()
                if now - window >= 1.0:
                    if dropped:
                        on_line("stderr", _dropped_line(dropped, rate))
                    window, passed, dropped = now, 0, 0
                if not chunk:
                    sel.unregister(key.fd)
                    open_fds -= 1
                    if bufs[name]:
                        on_line(name, bufs[name])
                        bufs[name] = b""
                    continue
                if passed >= rate:
                    # over the rate: count the lines, keep only the unfinished tail
                    nl = chunk.rfind(b"\n")
                    if nl >= 0:
                        dropped += chunk.count(b"\n")
                        bufs[name] = chunk[nl + 1:][-MAX_LINE:]
                    else:
                        bufs[name] = (bufs[name] + chunk)[-MAX_LINE:]
                    continue
                buf = bufs[name] + chunk
                *lines, rest = buf.split(b"\n")
                for ln in lines:
                    if passed < rate:
                        on_line(name, ln)
                        passed += 1
                    else:
                        dropped += 1
                while len(rest) > MAX_LINE:     # output without newlines: cut, and under the same rate
                    if passed < rate:
                        on_line(name, rest[:MAX_LINE])
                        passed += 1
                    else:
                        dropped += 1
                    rest = rest[MAX_LINE:]
                bufs[name] = rest
        if dropped:
            on_line("stderr", _dropped_line(dropped, rate))
    except (OSError, ValueError) as e:  # pipes closed under us at shutdown
        log.debug("engine output pump ended: %s", e)
    finally:
        sel.close()


def _dropped_line(n: int, rate: int) -> bytes:
    return b"[sparkguard: %d lines of engine output dropped: more than %d lines a second]" % (n, rate)


def decode(raw: bytes) -> str:
    """One output line as text: a trailing CR dropped, invalid UTF-8 replaced."""
    return raw.rstrip(b"\r").decode("utf-8", "replace")


# ---- output that outlives the daemon: a FIFO per stream --------------------------------------
#
# With plain pipes the daemon holds the only read end: when it dies, the engine's next write
# gets EPIPE (SIGPIPE kills a process that does not ignore it: pipe(7)).  Instead each stream is
# a FIFO (fifo(7)) in the runtime directory that the engine holds open read-write (the daemon
# opens it O_RDWR and passes that as the child's stdout/stderr), so a reader always exists: with
# no daemon the engine's writes only block once the pipe buffer is full (raised to
# /proc/sys/fs/pipe-max-size with F_SETPIPE_SZ, fcntl(2)).  The daemon reads through its own
# O_RDONLY|O_NONBLOCK open; a new daemon re-opens it (through /proc/PID/fd/N, which opens the
# same FIFO even when its path was removed: proc(5) /proc/pid/fd).  EOF still comes once every
# engine process has closed it (the engine's own read-write open counts as a writer).

F_SETPIPE_SZ = 1031          #: fcntl(2), linux/fcntl.h (F_LINUX_SPECIFIC_BASE + 7)
PIPE_MAX_SIZE = "/proc/sys/fs/pipe-max-size"
STREAMS = ("stdout", "stderr")


class Fd:
    """A raw file descriptor with the ``fileno()``/``close()`` of a file object (what :func:`pump` reads)."""

    def __init__(self, fd: int):
        self.fd = fd

    def fileno(self) -> int:
        return self.fd

    def close(self) -> None:
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)


def _pipe_max(path: str = PIPE_MAX_SIZE) -> int:
    try:
        with open(path) as f:
            return max(4096, min(int(f.read().strip()), 64 << 20))
    except (OSError, ValueError):
        return 1 << 20


def fifo_identity(fd_or_path) -> list[int] | None:
    """``[st_dev, st_ino]`` of an open fd or a path when it is a FIFO, else None (never raises)."""
    try:
        s = os.fstat(fd_or_path) if isinstance(fd_or_path, int) else os.stat(fd_or_path)
    except OSError:
        return None
    return [s.st_dev, s.st_ino] if stat.S_ISFIFO(s.st_mode) else None


def make_fifos(directory: str, tag: str) -> tuple[dict[str, str], dict[str, int], dict[str, Fd]]:
    """Make ``engine-<tag>.stdout`` / ``.stderr`` FIFOs (mode 0600) in ``directory``.

    Returns ``(paths, child_fds, readers)``: the paths; read-write fds to hand to the engine as
    its stdout/stderr (the caller closes them once it has spawned); this daemon's non-blocking
    read ends.  Raises OSError (the directory is not writable, no FIFO support).
    """
    os.makedirs(directory, mode=0o755, exist_ok=True)
    paths, child, readers = {}, {}, {}
    size = _pipe_max()
    try:
        for name in STREAMS:
            path = os.path.join(directory, f"engine-{tag}.{name}")
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            os.mkfifo(path, 0o600)
            paths[name] = path
            child[name] = os.open(path, os.O_RDWR | os.O_CLOEXEC)
            try:
                fcntl_setpipe(child[name], size)
            except OSError as e:          # pipe-user-pages-soft reached: keep the default 64 KiB
                log.debug("F_SETPIPE_SZ %d on %s: %s", size, path, e)
            readers[name] = Fd(os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC))
    except OSError:
        for fd in child.values():
            os.close(fd)
        for r in readers.values():
            r.close()
        remove_fifos(paths)
        raise
    return paths, child, readers


def fcntl_setpipe(fd: int, size: int) -> None:
    """Raise the pipe buffer of ``fd`` to ``size`` bytes (F_SETPIPE_SZ).  Raises OSError."""
    import fcntl
    fcntl.fcntl(fd, F_SETPIPE_SZ, size)


def reopen_fifos(pid: int, paths: dict[str, str], identity: dict[str, list[int]]) -> tuple[dict[str, Fd], str]:
    """Re-attach to a running engine's output FIFOs: for each stream the FIFO at ``/proc/PID/fd/1``
    (``2``) when it is the recorded one (``identity``: ``[st_dev, st_ino]``), else the recorded
    path when that is.  When neither is, the engine's fd itself is read whenever it is a FIFO or
    pipe at all (``pid`` is verified by the caller; its fd 1/2 is its output, and a pipe nobody
    reads would block the engine's writes once full, pipe(7)).  Returns ``(readers, why)``:
    non-blocking read ends of the streams found, and for the ones not found (or found only that
    way) why ("" when all were the recorded FIFOs)."""
    readers: dict[str, Fd] = {}
    why = []
    for n, name in enumerate(STREAMS, start=1):
        want = identity.get(name)
        for cand in (f"/proc/{pid}/fd/{n}", paths.get(name)):
            if name in readers or not cand or not want or fifo_identity(cand) != list(want):
                continue
            try:
                readers[name] = Fd(os.open(cand, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC))
            except OSError as e:
                why.append(f"{name}: {cand}: {e.strerror}")
        if name in readers:
            continue
        fd_path = f"/proc/{pid}/fd/{n}"
        if fifo_identity(fd_path) is not None:
            try:
                readers[name] = Fd(os.open(fd_path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC))
                why.append(f"{name}: not the recorded FIFO; reading the engine's fd {n} (a pipe) anyway")
                continue
            except OSError as e:
                why.append(f"{name}: {fd_path}: {e.strerror}")
        why.append(f"{name}: neither the engine's fd {n} nor {paths.get(name)} is the recorded FIFO")
    return readers, "; ".join(why)


def remove_fifos(paths: dict[str, str]) -> None:
    """Unlink the FIFOs (absent is fine)."""
    for path in (paths or {}).values():
        try:
            os.unlink(path)
        except OSError:
            pass

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
    for name, f in (("stdout", stdout), ("stderr", stderr)):
        os.set_blocking(f.fileno(), False)
        sel.register(f.fileno(), selectors.EVENT_READ, name)
        bufs[name] = b""
    open_fds = 2
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

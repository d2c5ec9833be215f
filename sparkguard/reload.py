"""``sparkguard reload``: SIGHUP the daemon and wait until it has applied or refused the config.

The daemon answers in a small JSON file, ``reload`` in its runtime directory
(``$RUNTIME_DIRECTORY``, set by systemd's ``RuntimeDirectory=``; ``/run/sparkguard`` without
it), replaced atomically (write a temporary file, ``rename(2)``) at start-up and after each
reload (:func:`write_result`).  Fields: ``pid`` (int), ``generation`` (int, reloads handled since start),
``started_usec`` (CLOCK_MONOTONIC microseconds when the daemon began that reload, the value it
also sends as ``MONOTONIC_USEC=``), ``ok`` (bool, None before the first reload), ``error``
(str, the refusal: ``file: key: value: reason``), ``config_path`` (str), ``starttime`` (int, the
daemon's start time in clock ticks, field 22 of /proc/PID/stat, proc(5)): a client that takes the
PID from the file signals it only while that PID is still the process that wrote it.

The client reads the clock, sends SIGHUP, and waits (inotify on the directory, the daemon's
pidfd, a timeout) for a record of that PID whose ``started_usec`` is later than its own clock
reading: a reload that began before the signal was sent does not count, and one that was
running when it arrived is followed by another (the daemon keeps the SIGHUP flag), so the
answer always reflects the file as it was when the command ran.  Both processes read the
same CLOCK_MONOTONIC (one host, one time namespace).

Works without systemd too: ``sparkguard reload [--pid PID] [--dir DIR]``.
"""

from __future__ import annotations

import argparse
import ctypes
import errno
import json
import os
import select
import signal
import sys
import time

from sparkguard import proctree, untrusted
from sparkguard.host.files import atomic_write

RESULT_NAME = "reload"
DEFAULT_DIR = "/run/sparkguard"
DEFAULT_TIMEOUT = 30.0

_IN_MOVED_TO = 0x80
_IN_CLOSE_WRITE = 0x08
_IN_NONBLOCK = 0o4000
_IN_CLOEXEC = 0o2000000


def starttime(pid: int | str = "self") -> int | None:
    """Field 22 of /proc/PID/stat (start time after boot, clock ticks; proc(5)), or None."""
    st = proctree.stat_fields(f"/proc/{pid}/stat")
    try:
        return int(st[1][19]) if st is not None else None
    except (ValueError, IndexError):
        return None


def result_dir(environ: dict | None = None) -> str:
    """The directory of the result file: the first entry of ``$RUNTIME_DIRECTORY`` (systemd.exec(5)
    "RuntimeDirectory="), else ``/run/sparkguard``."""
    env = os.environ if environ is None else environ
    first = (env.get("RUNTIME_DIRECTORY") or "").split(":")[0]
    return first or DEFAULT_DIR


def write_result(directory: str, record: dict) -> None:
    """Replace ``DIR/reload`` with ``record`` (compact JSON, mode 0644) by
    :func:`sparkguard.host.files.atomic_write`.  The directory is systemd's RuntimeDirectory
    under /run, a tmpfs, where the writer's fsyncs return at once.

    Raises:
        OSError: the directory is not writable.
    """
    atomic_write(os.path.join(directory, RESULT_NAME), json.dumps(record, separators=(",", ":")), 0o644)


def read_result(directory: str) -> dict | None:
    """The record in ``DIR/reload``, or None when it is absent, unreadable or not a JSON object."""
    try:     # no symlink, no FIFO, root's (or this user's), bounded: untrusted.read_file
        rec = json.loads(untrusted.read_file(os.path.join(directory, RESULT_NAME), 65536))
    except (OSError, ValueError):
        return None
    return rec if isinstance(rec, dict) else None


def _inotify(directory: str) -> int | None:
    """An inotify fd watching ``directory`` for files renamed or written into it, or None."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fd = libc.inotify_init1(_IN_NONBLOCK | _IN_CLOEXEC)
        if fd < 0:
            return None
        if libc.inotify_add_watch(fd, os.fsencode(directory), _IN_MOVED_TO | _IN_CLOSE_WRITE) < 0:
            os.close(fd)
            return None
        return fd
    except (OSError, AttributeError):
        return None


def wait_result(directory: str, pid: int, pidfd: int, after_usec: int, timeout: float
                ) -> tuple[dict | None, str]:
    """Wait for the daemon ``pid`` (its ``pidfd``) to record a reload begun after ``after_usec``
    (CLOCK_MONOTONIC us).

    Returns:
        ``(record, "")`` when it came; ``(None, why)`` on timeout or when the daemon exited.
    """
    ino = _inotify(directory)
    poller = select.poll()
    if ino is not None:
        poller.register(ino, select.POLLIN)
    poller.register(pidfd, select.POLLIN)
    deadline = time.monotonic() + timeout

    def answer() -> dict | None:
        rec = read_result(directory)
        if rec and rec.get("pid") == pid and isinstance(rec.get("started_usec"), int) \
                and rec["started_usec"] > after_usec and rec.get("ok") is not None:
            return rec
        return None
    try:
        while True:
            rec = answer()
            if rec is not None:
                return rec, ""
            left = deadline - time.monotonic()
            if left <= 0:
                return None, f"no answer from pid {pid} in {directory}/{RESULT_NAME} within {timeout:g}s"
            # without inotify the result file is re-read every 100 ms
            for fd, _ in poller.poll(min(left, 0.1 if ino is None else left) * 1000):
                if fd == pidfd:     # it may have answered just before exiting
                    rec = answer()
                    return (rec, "") if rec is not None else (None, f"pid {pid} exited before answering the reload")
                if fd == ino:
                    try:
                        while os.read(ino, 4096):
                            pass
                    except BlockingIOError:
                        pass
    finally:
        if ino is not None:
            os.close(ino)


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``reload``."""
    p = sub.add_parser("reload", help="reload the daemon's config and wait for the result",
                       description="Send SIGHUP to the guard daemon and wait until it has applied or refused "
                                   "the config. Exit 0 when applied, 1 with the reason when refused or when "
                                   "no answer came (used by the unit's ExecReload).")
    p.add_argument("--pid", type=int, help="daemon PID (default: the pid in the result file)")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT, metavar="S",
                   help=f"seconds to wait for the answer (default {DEFAULT_TIMEOUT:g})")
    p.add_argument("--dir", help=f"the daemon's runtime directory (default $RUNTIME_DIRECTORY or {DEFAULT_DIR})")
    p.set_defaults(func=cmd_reload)


def cmd_reload(args: argparse.Namespace) -> int:
    """SIGHUP the daemon, wait for its answer; 0 applied, 1 refused / no answer / no daemon."""
    directory = args.dir or result_dir()
    if not args.timeout > 0:
        print(f"sparkguard reload: --timeout {args.timeout}: must be a positive number of seconds", file=sys.stderr)
        return 1
    pid, born = args.pid, None
    if pid is None:
        rec = read_result(directory)
        pid, born = (rec.get("pid"), rec.get("starttime")) if rec else (None, None)
        if not isinstance(pid, int) or not isinstance(born, int):
            print(f"sparkguard reload: no daemon pid in {directory}/{RESULT_NAME}; give --pid", file=sys.stderr)
            return 1
    try:
        pidfd = os.pidfd_open(pid)
    except OSError as e:
        why = "no such process" if e.errno == errno.ESRCH else e.strerror
        print(f"sparkguard reload: cannot signal pid {pid}: {why}", file=sys.stderr)
        return 1
    try:
        if born is not None and starttime(pid) != born:
            print(f"sparkguard reload: pid {pid} in {directory}/{RESULT_NAME} is no longer the daemon that "
                  "wrote it (stale file); give --pid", file=sys.stderr)
            return 1
        after = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        try:
            signal.pidfd_send_signal(pidfd, signal.SIGHUP)
        except OSError as e:
            why = "no such process" if e.errno == errno.ESRCH else e.strerror
            print(f"sparkguard reload: cannot signal pid {pid}: {why}", file=sys.stderr)
            return 1
        rec, why = wait_result(directory, pid, pidfd, after, args.timeout)
    finally:
        os.close(pidfd)
    if rec is None:
        print(f"sparkguard reload: {why}", file=sys.stderr)
        return 1
    if rec["ok"]:
        print(f"sparkguard: reloaded {rec.get('config_path')}")
        return 0
    print(f"sparkguard reload: refused, running config kept: {rec.get('error')}", file=sys.stderr)
    return 1

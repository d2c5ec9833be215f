"""Reload on SIGHUP: the config is read and checked in a process of its own; the result file answers ``sparkguard reload``.

The :class:`Reloader` belongs to the poll loop, except :meth:`Reloader._load`, which runs in a
thread of its own (``sparkguard-reload``) and touches nothing of the running guard: it leaves
its outcome in ``loaded`` (one reference assignment) and wakes the loop.  The loop takes the
outcome (:meth:`Reloader.take`) and puts it in force (:func:`finish`).

The file is parsed and checked by a child process (``python -m sparkguard.guard.reconfig``,
:func:`read_in_child`), never in the daemon: Python threads share one interpreter lock, and
parsing YAML is work whose cost the file's author sets (a 591-byte file whose aliases multiply
once held the lock for 9.8 s and took 1.5 GB).  The child runs under an address-space and a CPU
limit, is killed at a deadline, and hands back the checked result pickled, at most
:data:`MAX_RESULT` bytes: the daemon's share of a reload is a ``posix_spawn`` and one
``pickle.loads`` of its own child's output, whatever the file holds.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import select
import subprocess
import sys
import threading
import time
from typing import Callable

from sparkguard import config
from sparkguard import reload as reload_cmd
from sparkguard.guard import settings
from sparkguard.units import format_line

log = logging.getLogger("sparkguard")

#: Seconds a config read may take in its child before it is killed and the reload refused
#: (a real config is read in ~0.3 s, most of it the child's interpreter start).
READ_DEADLINE = 20.0
#: Bytes of pickled result taken from the child (a 4-node cluster config pickles to ~10 KiB).
MAX_RESULT = 8 * 1024**2
#: The child's address-space and CPU-time limits (RLIMIT_AS bytes, RLIMIT_CPU seconds): a
#: Python with the config modules imported maps ~60-120 MiB.
CHILD_AS_BYTES = 1024**3
CHILD_CPU_SECONDS = 15
#: Seconds between the starts of two reads: a SIGHUP storm costs the daemon at most one
#: spawn and one result every MIN_GAP, the SIGHUPs in between are folded into the next read.
MIN_GAP = 0.5


def read_config(config_arg: str | None, force_dry_run: bool):
    """``config.load`` and :func:`settings.prepare`: ``(cfg, thresholds, protector)``, or the
    ``config.ConfigError`` (any other exception becomes one naming the file).  Pure; runs in the
    child process."""
    try:
        cfg = config.load(config_arg)
        if force_dry_run and not cfg.guard.dry_run:
            cfg = config.replace(cfg, guard=dataclasses.replace(cfg.guard, dry_run=True))
        return (cfg, *settings.prepare(cfg)[1:])
    except Exception as e:  # noqa: BLE001 - ConfigError, or a parser bug on a strange file
        if not isinstance(e, config.ConfigError):
            e = config.ConfigError(config_arg or config.DEFAULT_PATH, "(file)", None,
                                   f"cannot load: {type(e).__name__}: {e}")
        return e


def read_in_child(config_arg: str | None, force_dry_run: bool, deadline: float = READ_DEADLINE):
    """:func:`read_config` in a child process (``python -m sparkguard.guard.reconfig``): the
    result, or a ``config.ConfigError`` that says why the read failed (the child crashed, ran
    out of memory or time, or answered too much).  Blocks the calling thread (never the poll
    loop) for at most ``deadline`` seconds."""
    path = config_arg or config.DEFAULT_PATH
    root = os.path.dirname(os.path.dirname(os.path.abspath(config.__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    argv = [sys.executable, "-m", "sparkguard.guard.reconfig", config_arg or "", "1" if force_dry_run else "0"]
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, env=env, close_fds=True)
    except OSError as e:
        return config.ConfigError(path, "(file)", None, f"cannot start the config reader: {e.strerror or e}")
    chunks, size, end = [], 0, time.monotonic() + deadline
    why = ""
    try:
        fd = proc.stdout.fileno()
        while True:
            left = end - time.monotonic()
            if left <= 0:
                why = f"reading took more than {deadline:g} s"
                break
            if not select.select([fd], [], [], left)[0]:
                continue
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                break
            size += len(chunk)
            if size > MAX_RESULT:
                why = f"the reader answered more than {MAX_RESULT >> 20} MiB"
                break
            chunks.append(chunk)
    finally:
        if why:
            proc.kill()
        proc.stdout.close()
        rc = proc.wait()
    if not why and rc != 0:
        why = (f"the reader was killed by signal {-rc} (CPU limit {CHILD_CPU_SECONDS} s?)" if rc < 0 else
               f"the reader exited {rc} (memory limit {CHILD_AS_BYTES >> 20} MiB?)")
    if why:
        return config.ConfigError(path, "(file)", None, f"cannot load: {why}; a YAML file whose aliases "
                                  "multiply or a file far larger than a config does that")
    try:
        return pickle.loads(b"".join(chunks))
    except Exception as e:  # noqa: BLE001 - a truncated answer
        return config.ConfigError(path, "(file)", None, f"cannot load: the reader's answer is unreadable: {e}")


def _child_main(argv: list[str]) -> int:
    """The reader's entry point: limits itself, reads, writes the pickled result to stdout."""
    import resource
    try:
        os.setpriority(os.PRIO_PROCESS, 0, max(10, os.getpriority(os.PRIO_PROCESS, 0)))  # never beside the loop
    except OSError:
        pass
    resource.setrlimit(resource.RLIMIT_AS, (CHILD_AS_BYTES, CHILD_AS_BYTES))
    resource.setrlimit(resource.RLIMIT_CPU, (CHILD_CPU_SECONDS, CHILD_CPU_SECONDS))
    result = read_config(argv[0] or None, argv[1] == "1")
    sys.stdout.buffer.write(pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL))
    sys.stdout.flush()
    return 0


class Reloader:
    """Reads the config file again when asked, in a thread.

    Args:
        config_arg: the ``--config`` path given, or None for the default.
        force_dry_run: ``--dry-run`` was given: stays in force across reloads.
        reloading: ``() -> int``: tells the service manager (``Notifier.reloading``); returns the
            reload's MONOTONIC_USEC.
        wake: ``() -> None``: called from the reload thread once ``loaded`` is set; must not block.
    Attributes:
        loaded: ``(MONOTONIC_USEC of the reload, (cfg, thresholds, protector) or config.ConfigError)``
            once a read has finished, else None.
    """

    def __init__(self, config_arg: str | None, force_dry_run: bool, reloading: Callable[[], int],
                 wake: Callable[[], None]):
        self.config_arg = config_arg
        self.force_dry_run = force_dry_run
        self._reloading = reloading
        self._wake = wake
        self.loaded = None
        self._thread = None         # the thread reading the config after a SIGHUP
        self._again = False         # a SIGHUP came while it was reading
        self._record: dict = {}
        self._dir: str | None = None
        self._done = 0
        self._last_start = -MIN_GAP   # monotonic s the last read began

    def begin(self) -> None:
        """SIGHUP: read and check the config file in a child process (:func:`read_in_child`),
        waited for by a thread of its own, so neither parsing nor its memory touches the poll
        loop.  A SIGHUP while a file is being read is kept for one more reload once this one is
        taken; a read starts :data:`MIN_GAP` s after the one before at the earliest."""
        if self._thread is not None:
            self._again = True
            return
        started = self._reloading()
        self._thread = threading.Thread(target=self._load, args=(started,), name="sparkguard-reload", daemon=True)
        self._thread.start()

    def _load(self, started: int) -> None:
        """Reload thread: waits out :data:`MIN_GAP`, reads in the child, leaves the outcome in
        ``loaded``, then wakes the loop."""
        wait = self._last_start + MIN_GAP - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        self._last_start = time.monotonic()
        self.loaded = (started, read_in_child(self.config_arg, self.force_dry_run))
        self._wake()

    def take(self):
        """From the loop: the finished read (``loaded``), or None; a SIGHUP that came during the read
        starts the next one now."""
        loaded, self.loaded = self.loaded, None
        if loaded is None:
            return None
        self._thread = None          # it has stored its result: only its return is left
        if self._again:
            self._again = False
            self.begin()
        return loaded

    def start_result(self, config_path: str) -> None:
        """Write the reload result file's first record (pid, generation 0) so ``sparkguard reload``
        finds the daemon; creates the runtime directory when run without systemd."""
        d = reload_cmd.result_dir()
        try:
            os.makedirs(d, mode=0o755, exist_ok=True)
            self._record = {"pid": os.getpid(), "starttime": reload_cmd.starttime(), "generation": 0,
                            "started_usec": 0, "ok": None, "error": "", "config_path": config_path}
            reload_cmd.write_result(d, self._record)
            self._dir = d
        except OSError as e:
            log.warning("cannot write the reload result in %s (%s): `sparkguard reload` will get no answer",
                        d, e.strerror or e)

    def record(self, started_usec: int, ok: bool, error: str, config_path: str) -> None:
        """Record a reload's result (a tiny file on tmpfs; never raises)."""
        self._done += 1
        if self._dir is None:
            return
        try:
            reload_cmd.write_result(self._dir, dict(
                self._record, generation=self._done, started_usec=started_usec, ok=ok,
                error=error, config_path=config_path))
        except OSError as e:
            log.warning("cannot write the reload result in %s: %s", self._dir, e.strerror or e)


def finish(guard) -> bool:
    """From the loop: put a config read by ``guard.reloader.begin()`` in force, or keep the running
    one when it was refused.  ``guard``: the :class:`sparkguard.guard.loop.Guard`.  Returns success; False when no read had finished.

    The new config passed the same checks as ``check-config`` (``config.load`` and
    :func:`settings.prepare`, which builds everything derived from it) before any of it is put
    in force.  The result goes to the reload result file (:mod:`sparkguard.reload`) last, so
    ``sparkguard reload`` returns once it is in force or refused."""
    loaded = guard.reloader.take()
    if loaded is None:
        return False
    started, result = loaded
    if isinstance(result, Exception):
        e = result
        guard.reloads["failed"] += 1
        log.error("reload failed, keeping the running config: %s", e)
        guard.reporter.event(None, {"event": "config_reload_failed", "t": 0.0, "at": time.time(),
                                   "available_bytes": guard.value, "pids": [],
                                   "detail": f"reload failed, running config kept: {e}"})
        guard.notifier.ready()
        guard.notifier.status("reload FAILED, running config kept: " + str(e)[:200])
        guard._next_status = time.monotonic() + 30
        guard.reloader.record(started, False, str(e), guard.cfg.path)
        return False
    cfg, thresholds, protector = result
    for sec, key in (("metrics", "listen"), ("incidents", "dir"), ("incidents", "journal"),
                     ("link", "interfaces"), ("link", "down_after"), ("guard", "blackbox"),
                     ("guard", "blackbox_file"), ("guard", "blackbox_sync")):
        new, old = getattr(getattr(cfg, sec), key), getattr(getattr(guard.cfg, sec), key)
        if new != old:
            log.warning("%s.%s changed to %s: takes effect after a restart", sec, key, new)
    guard.actions.cfg = cfg
    guard.policy.thresholds = thresholds
    if guard.policy.state == "ok":
        guard.policy.dry_run = cfg.guard.dry_run
    elif guard.policy.dry_run != cfg.guard.dry_run:
        # switching mid-incident would SIGKILL a tree that never got SIGTERM (or leave a real
        # SIGTERM without its escalation): the new dry_run applies when this incident ends
        log.warning("guard.dry_run changes to %s when the open incident ends", cfg.guard.dry_run)
    guard.actions.protector = protector
    guard.soft.reload(cfg)
    error = ""
    try:
        guard.engine.reload(cfg)
    except Exception as e:  # noqa: BLE001 - the guard's part is in force; say what was not
        log.exception("reload: the engine supervisor did not take the new config")
        error = f"guard settings applied, engine supervisor refused them: {type(e).__name__}: {e}"
    guard.reloads["ok" if not error else "failed"] += 1
    log.info("reloaded %s: SIGTERM below %s, grace %.1fs", cfg.path, format_line(cfg.guard.term_below),
             cfg.guard.grace)
    guard.notifier.ready()
    guard._tick(time.monotonic())
    guard.reloader.record(started, not error, error, guard.cfg.path)
    return not error


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1:]))

"""Reload on SIGHUP: the config is read and checked off the poll loop; the result file answers ``sparkguard reload``.

The :class:`Reloader` belongs to the poll loop, except :meth:`Reloader._load`, which runs in a
thread of its own (``sparkguard-reload``) and touches nothing of the running guard: it leaves
its outcome in ``loaded`` (one reference assignment) and wakes the loop.  The loop takes the
outcome (:meth:`Reloader.take`) and puts it in force (:func:`finish`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from typing import Callable

from sparkguard import config
from sparkguard import reload as reload_cmd
from sparkguard.guard import settings
from sparkguard.units import format_line

log = logging.getLogger("sparkguard")


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

    def begin(self) -> None:
        """SIGHUP: read and check the config file in a thread of its own, so parsing (up to a 1 MiB
        YAML file: seconds of Python) never holds up the poll loop.  A SIGHUP while a file is being
        read is kept for one more reload once this one is taken."""
        if self._thread is not None:
            self._again = True
            return
        started = self._reloading()
        self._thread = threading.Thread(target=self._load, args=(started,), name="sparkguard-reload", daemon=True)
        self._thread.start()

    def _load(self, started: int) -> None:
        """Reload thread: ``config.load`` and :func:`settings.prepare` (pure), the outcome left in
        ``loaded``, then the loop woken."""
        try:
            cfg = config.load(self.config_arg)
            if self.force_dry_run and not cfg.guard.dry_run:
                cfg = config.replace(cfg, guard=dataclasses.replace(cfg.guard, dry_run=True))
            result = (cfg, *settings.prepare(cfg)[1:])
        except Exception as e:  # noqa: BLE001 - ConfigError, or a parser bug on a strange file
            if not isinstance(e, config.ConfigError):
                e = config.ConfigError(self.config_arg or config.DEFAULT_PATH, "(file)", None,
                                       f"cannot load: {type(e).__name__}: {e}")
            result = e
        self.loaded = (started, result)
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

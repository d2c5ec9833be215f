"""Reload on SIGHUP: the config is read and checked off the poll loop; the result file answers ``sparkguard reload``.

The :class:`Reloader` belongs to the poll loop, except :meth:`Reloader._load`, which runs in a
thread of its own (``sparkguard-reload``) and touches nothing of the running guard: it leaves
its outcome in ``loaded`` (one reference assignment) and wakes the loop.  The loop takes the
outcome (:meth:`Reloader.take`) and puts it in force (``Guard.finish_reload``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from typing import Callable

from sparkguard import config
from sparkguard import reload as reload_cmd
from sparkguard.guard import settings

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

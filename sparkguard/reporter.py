"""Incident reporting off the poll loop: journal entries, the JSON file, a log line.

Act first, report after: the poll loop calls :meth:`Reporter.event` and
:meth:`Reporter.finish`, which only snapshot what they need and put it on a queue; one
daemon thread (256 KiB stack) does the slow parts: it logs a one-line summary (logger
``sparkguard.reporter``, so a person running ``sparkguard run`` in a terminal sees it),
sends the journal entry over the native protocol (:mod:`sparkguard.journal`) and writes
the incident file (:class:`sparkguard.incidents.store.IncidentStore`).  Nothing here blocks or
raises to the caller; a failing journal or disk is logged once per failure streak
(later failures of the same kind at WARNING/DEBUG) and survived.

Journal entries (see README "Incidents" and ``sparkguard/data/catalog/sparkguard.catalog``):

* per event: ``MESSAGE`` (one line), ``MESSAGE_ID`` of the event kind, ``PRIORITY``,
  ``SPARKGUARD_INCIDENT``, ``SPARKGUARD_EVENT``, ``SPARKGUARD_KIND``, ``SPARKGUARD_PIDS``
  (space-separated), ``SPARKGUARD_AVAILABLE_BYTES``, ``SPARKGUARD_T_SECONDS`` (since the
  crossing), ``SPARKGUARD_DETAIL``, ``SPARKGUARD_DRY_RUN``, ``SPARKGUARD_DRILL``,
  ``SPARKGUARD_TARGET_PID``/``_TITLE``, plus any extra scalar keys of the event as
  ``SPARKGUARD_<KEY>``;
* per incident (finish): ``MESSAGE`` (the summary), ``MESSAGE_ID`` = report id,
  ``SPARKGUARD_OUTCOME``, ``SPARKGUARD_TARGET_PID``, ``SPARKGUARD_REPORT`` (the whole record
  as JSON; large ones travel by memfd), ``SPARKGUARD_FILE`` (where it was saved, absent if
  the file could not be written) and flat numbers: ``SPARKGUARD_TERM_BELOW_BYTES``,
  ``SPARKGUARD_KILL_BELOW_BYTES``, ``SPARKGUARD_GRACE_SECONDS``,
  ``SPARKGUARD_AVAILABLE_BYTES`` (at the crossing), ``SPARKGUARD_MIN_AVAILABLE_BYTES``,
  ``SPARKGUARD_DURATION_SECONDS``, ``SPARKGUARD_STARTED_AT``/``_ENDED_AT`` (unix s),
  ``SPARKGUARD_TARGET_MEM_BYTES``, ``SPARKGUARD_PIDS`` (the target tree).
"""

from __future__ import annotations

import copy
import logging
import os
import queue
import sys
import threading
from typing import Any

from sparkguard import journal, model
from sparkguard.incidents.store import IncidentStore

log = logging.getLogger("sparkguard.reporter")

JOURNAL_MODES = ("auto", "on", "off")
_STOP = object()
_STACK = 256 * 1024
#: characters of one string field written at most (a journal field, a value in the JSON report);
#: a process's cmdline is read whole into the report, and can be hundreds of KiB
MAX_FIELD = 512 * 1024
#: items of one list written at most (process trees, engine output lines)
MAX_ITEMS = 4096
#: nesting depth of a report written at most
MAX_DEPTH = 16


def bounded(obj: Any, depth: int = 0) -> Any:
    """``obj`` with every string cut to :data:`MAX_FIELD` characters, every list to
    :data:`MAX_ITEMS` items and nesting to :data:`MAX_DEPTH` levels, each cut saying what it
    left out; so one report costs the reporter thread a bounded amount of work and of disk."""
    if isinstance(obj, str):
        return obj if len(obj) <= MAX_FIELD else obj[:MAX_FIELD] + f"... [{len(obj) - MAX_FIELD} more characters]"
    if isinstance(obj, bytes | bytearray):
        return obj[:MAX_FIELD * 4]
    if depth >= MAX_DEPTH and isinstance(obj, dict | list | tuple):
        return f"[{type(obj).__name__} nested deeper than {MAX_DEPTH} levels left out]"
    if isinstance(obj, dict):
        return {k: bounded(v, depth + 1) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        out = [bounded(v, depth + 1) for v in obj[:MAX_ITEMS]]
        if len(obj) > MAX_ITEMS:
            out.append(f"[{len(obj) - MAX_ITEMS} more items left out]")
        return out
    return obj


def _level(prio: int) -> int:
    return logging.ERROR if prio <= 3 else logging.WARNING if prio == 4 else logging.INFO


def _stderr_is_journal() -> bool:
    """True when stderr is already connected to journald (``$JOURNAL_STREAM`` = device:inode of
    fd 2, ``man:systemd.exec(5)``): the log line would then duplicate the native entry."""
    js = os.environ.get("JOURNAL_STREAM", "")
    try:
        dev, ino = (int(x) for x in js.split(":"))
        st = os.fstat(sys.stderr.fileno())
        return st.st_dev == dev and st.st_ino == ino
    except (ValueError, OSError, AttributeError):
        return False


class Reporter:
    """Reports incidents without delaying the caller.

    Args:
        incidents_dir: str, directory of the JSON store (``incidents.dir``).
        journal: ``"auto"`` (send when the journal socket exists), ``"on"`` (always try;
            a missing journal is logged as an error once), ``"off"`` (never).
        journal_socket: str, path of journald's native socket.
        queue_size: int, reports waiting at most; beyond it new ones are dropped and counted
            (the caller is never blocked).
    Raises:
        ValueError: ``journal`` is not one of auto/on/off (from the constructor only).

    ``stats`` (dict of ints) counts events, reports, journal_sent, journal_memfd,
    journal_failed, files_written, files_failed, dropped, errors.
    """

    def __init__(self, incidents_dir: str, journal: str = "auto",
                 journal_socket: str = "/run/systemd/journal/socket", queue_size: int = 1024):
        if journal not in JOURNAL_MODES:
            raise ValueError(f"journal mode {journal!r}: expected one of auto, on, off")
        self.store = IncidentStore(incidents_dir)
        self.journal_mode = journal
        self.journal_socket = journal_socket
        self.stats = {k: 0 for k in ("events", "reports", "journal_sent", "journal_memfd", "journal_failed",
                                     "files_written", "files_failed", "dropped", "errors")}
        self._q: queue.Queue = queue.Queue(maxsize=queue_size)
        self._closed = False
        self._journal_failing = False
        self._disk_failing = False
        self._dropped_logged = 0
        self._quiet_stderr = _stderr_is_journal()
        self._thread = threading.Thread(target=self._run, name="sparkguard-reporter", daemon=True)
        old = None
        try:
            old = threading.stack_size(_STACK)
        except (ValueError, RuntimeError):
            pass
        try:
            self._thread.start()
        finally:
            if old is not None:
                threading.stack_size(old)

    # ---- caller side (poll loop): snapshot + enqueue, never block, never raise ----------

    def event(self, incident: dict | None, event: dict) -> None:
        """Queue one journal entry (and log line) for ``event`` of ``incident``.

        Args:
            incident: the open incident's :meth:`sparkguard.model.Incident.ref` (or its whole
                JSON record), or None for events outside an incident (``config_reload_failed``).
                Only id, kind, flags and target are read, now.
            event: ``{event, t, at, available_bytes, pids, detail, ...}``
                (:meth:`sparkguard.model.Event.to_json`); copied now.
        """
        try:
            inc = incident if isinstance(incident, dict) else {}
            tgt = inc.get("target") if isinstance(inc.get("target"), dict) else {}
            snap = {
                "ref": {"id": inc.get("id"), "kind": inc.get("kind"), "dry_run": inc.get("dry_run"),
                        "drill": inc.get("drill"),
                        "target": {"root_pid": tgt.get("root_pid"), "title": tgt.get("title")}},
                "ev": {k: (list(v) if isinstance(v, list | tuple) else v) for k, v in event.items()},
            }
            self._put(("event", snap))
        except Exception:  # noqa: BLE001 - reporting must never hurt the guard
            self.stats["errors"] += 1

    def finish(self, incident: dict) -> None:
        """Queue the full report: the JSON file, the journal report entry, a log line.

        Args:
            incident: the record (:meth:`sparkguard.model.Incident.to_json`); deep-copied now,
                so the caller may go on changing its own.
        """
        try:
            rec = copy.deepcopy(incident)
            self._put(("finish", rec))
        except Exception:  # noqa: BLE001
            self.stats["errors"] += 1

    def _put(self, item: tuple) -> None:
        if self._closed:
            self.stats["dropped"] += 1
            return
        try:
            self._q.put_nowait(item)
        except queue.Full:
            self.stats["dropped"] += 1

    def close(self, timeout: float = 5.0) -> None:
        """Report what is queued, then stop the thread; waits at most ``timeout`` seconds.

        Later :meth:`event`/:meth:`finish` calls are dropped (counted).  Safe to call twice.
        """
        if not self._closed:
            self._closed = True
            try:
                self._q.put(_STOP, timeout=max(timeout, 0.01))
            except queue.Full:
                log.error("reporter queue still full after %.1fs at close; unsent reports are lost", timeout)
                return
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.error("reporter did not finish within %.1fs; unsent reports may be lost", timeout)

    # ---- reporter thread ---------------------------------------------------------------

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is _STOP:
                break
            try:
                if item[0] == "event":
                    self._do_event(item[1])
                else:
                    self._do_finish(item[1])
            except Exception:  # noqa: BLE001 - keep reporting the next ones
                self.stats["errors"] += 1
                log.exception("reporting failed")
            if self.stats["dropped"] != self._dropped_logged:
                log.error("%d incident reports dropped (queue full or reporter closed)",
                          self.stats["dropped"] - self._dropped_logged)
                self._dropped_logged = self.stats["dropped"]

    def _do_event(self, s: dict) -> None:
        s = bounded(s)
        prio, msg, fields = model.event_entry(s["ref"], s["ev"])
        self.stats["events"] += 1
        sent = self._journal(fields)
        self._log(prio, sent, "%s", msg)

    def _do_finish(self, rec: dict) -> None:
        self.stats["reports"] += 1
        rec = bounded(rec)
        iid = rec.get("id")
        path = self.store.save(rec, log_errors=False)
        if path is not None:
            self.stats["files_written"] += 1
            if self._disk_failing:
                log.info("incident files are written again (%s)", path)
                self._disk_failing = False
        else:
            self.stats["files_failed"] += 1
        prio, msg, fields = model.report_entry(rec, path)
        sent = self._journal(fields)
        if path is None:
            level = logging.WARNING if self._disk_failing else logging.ERROR
            log.log(level, "incident %s not saved in %s: %s%s", iid, self.store.dir, self.store.last_error,
                    "" if self._disk_failing else " (the journal entry still carries the full report)" if sent
                    else f" and not journaled ({self._no_journal_reason()}): only the summary line below is kept")
            self._disk_failing = True
        self._log(prio, sent, "%s%s", msg, f" [saved {path}]" if path else " [NOT saved to disk]")

    def _no_journal_reason(self) -> str:
        """Why the last entry did not reach journald, for people."""
        if self.journal_mode == "off":
            return "incidents.journal is off"
        if not os.path.exists(self.journal_socket):
            return f"no journald socket at {self.journal_socket}"
        return f"the journal at {self.journal_socket} refused it"

    def _journal(self, fields: dict) -> bool:
        """Send one entry per the journal mode; True if journald took it."""
        if self.journal_mode == "off":
            return False
        if self.journal_mode == "auto" and not os.path.exists(self.journal_socket):
            return False
        try:
            how = journal.send(fields, self.journal_socket)
        except (OSError, ValueError) as e:
            self.stats["journal_failed"] += 1
            if not self._journal_failing:
                log.error("cannot write to the journal at %s: %s (logged once until it works again)",
                          self.journal_socket, getattr(e, "strerror", None) or e)
                self._journal_failing = True
            return False
        self.stats["journal_sent"] += 1
        if how == "memfd":
            self.stats["journal_memfd"] += 1
        if self._journal_failing:
            log.info("journal at %s works again", self.journal_socket)
            self._journal_failing = False
        return True

    def _log(self, prio: int, sent: bool, fmt: str, *args: Any) -> None:
        # under systemd stderr is the journal too: the native entry already says it
        level = logging.DEBUG if sent and self._quiet_stderr else _level(prio)
        log.log(level, fmt, *args)

"""The engine's part of incident reports.

Every guard action on the engine and every restart is part of the incident report (TEAM.md
"Incident record"): an incident is reported as soon as it closes, never held back for the engine's
restart (memory may never come back, the daemon may die); one that hit the engine is then
reported again, same id, with the ``restart`` event (or ``no_restart`` and why) appended: the
incident store overwrites the file by id, the journal gets the updated report.  The supervisor
also opens incidents of its own, of kind ``"wedged"``.  Reporting never blocks supervision and
never raises.
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Callable

log = logging.getLogger("sparkguard.supervisor")

#: summary suffix of an incident reported before the restart it causes (replaced when it is resolved)
PENDING = "; engine restart pending"


class EngineIncidents:
    """Reported incidents waiting for the engine's restart, and the supervisor's own incidents.

    Args:
        reporter: object with ``event(incident, event)`` / ``finish(incident)`` (TEAM.md
            "Reporter"), or None (nothing reported).
        count_incident: ``(kind: str, wall: float) -> None`` called when an incident of the
            supervisor's own opens, so the daemon's incident counters include it; or None.
    """

    def __init__(self, reporter=None, count_incident: Callable[[str, float], None] | None = None):
        self.reporter = reporter
        self.count_incident = count_incident
        self.pending: collections.deque[dict] = collections.deque()

    def finish(self, incident: dict) -> None:
        """Hand a closed incident to the reporter (JSON file, journal)."""
        if self.reporter is not None:
            try:
                self.reporter.finish(incident)
            except Exception as e:  # noqa: BLE001 - reporting must never break supervision
                log.error("reporting incident %s failed: %s", incident.get("id"), e)

    def event(self, incident: dict, event: str, detail: str, pids: list[int] | None = None) -> dict:
        """Append an event (with MemAvailable now) to the incident's timeline and report it."""
        from sparkguard.supervisor.gates import read_mem_available
        now = time.time()
        try:
            avail = read_mem_available()
        except (OSError, ValueError):
            avail = 0
        ev = {"event": event, "t": round(now - incident["started_at"], 4), "at": now, "available_bytes": avail,
              "pids": list(pids or []), "detail": detail}
        incident["timeline"].append(ev)
        if self.reporter is not None:
            try:
                self.reporter.event(incident, ev)
            except Exception as e:  # noqa: BLE001
                log.error("reporting an event of incident %s failed: %s", incident.get("id"), e)
        return ev

    def track(self, incident: dict) -> None:
        """Report ``incident`` again at the next :meth:`flush` (the restart it caused, or why none)."""
        self.pending.append(incident)

    def flush(self, now: dict, why: str, restart_detail: str | None = None, pids: list[int] | None = None) -> None:
        """Report every tracked incident again: with a ``restart`` event (``restart_detail``,
        ``pids``: the new engine) when the engine was restarted, else a ``no_restart`` event
        saying ``why``.  ``incident["engine"]`` keeps what it said at the close (that run's pid,
        exit, last lines) and gains ``restarted`` (bool), ``after`` (``now``: the supervisor's
        ``state``, ``pid``, ``lane`` at this point) and the updated ``restarts`` counters.

        Args:
            now: ``{"state": str, "pid": int|None, "lane": str|None, "restarts": {reason: int}}``.
        """
        pend = []
        while self.pending:
            pend.append(self.pending.popleft())
        for inc in pend:
            eng = inc.setdefault("engine", {})
            inc["summary"] = (inc.get("summary") or "").removesuffix(PENDING)
            if restart_detail is not None:
                self.event(inc, "restart", restart_detail, pids)
                eng["restarted"] = True
                inc["summary"] += "; engine restarted"
            else:
                self.event(inc, "no_restart", why)
                eng["restarted"] = False
                inc["summary"] += f"; engine not restarted ({why})"
            eng["after"] = {k: now.get(k) for k in ("state", "pid", "lane")}
            if now.get("restarts") is not None:
                eng["restarts"] = dict(now["restarts"])
            self.finish(inc)

    def open_wedged(self, cfg, target, detail: str, engine: dict, pid: int) -> dict:
        """An incident of kind ``"wedged"`` in the daemon's incident shape (TEAM.md), its first
        event ``wedged`` already reported.

        Args:
            cfg: ``config.Config`` (thresholds recorded).
            target: ``proctree.Target`` of the engine, or None.
            detail: why it is wedged (the probe failures).
            engine: the supervisor's engine info (state, lane, pid, last lines).
            pid: the engine's root pid.
        """
        from sparkguard import incidents, sysinfo
        g = cfg.guard
        wall = time.time()
        try:
            mi = sysinfo.read_meminfo()
        except OSError:
            mi = {}
        inc = {
            "id": incidents.new_id(wall),
            "kind": "wedged", "drill": False, "host": sysinfo.hostname(), "boot_id": sysinfo.boot_id(),
            "started_at": wall, "ended_at": None, "dry_run": g.dry_run,
            "thresholds": {"term_below_bytes": g.term_below, "kill_below_bytes": g.kill_below,
                           "grace_seconds": g.grace, "signal": g.signal},
            "meminfo": mi, "psi_memory": sysinfo.read_psi_memory(), "zram": sysinfo.read_zram(),
            "target": None if target is None else {"root_pid": target.root_pid, "title": target.title,
                                                   "pattern": target.pattern, "mem_bytes": target.mem_bytes,
                                                   "tree": target.tree},
            "timeline": [], "outcome": None, "summary": f"engine wedged: {detail}",
            "engine": engine,
        }
        if self.count_incident is not None:
            try:
                self.count_incident("wedged", wall)
            except Exception:  # noqa: BLE001
                pass
        self.event(inc, "wedged", detail, [pid])
        return inc

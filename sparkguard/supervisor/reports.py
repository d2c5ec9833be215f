"""The engine's part of incident reports.

Every guard action on the engine and every restart is part of the incident report
(docs/incident.md): an incident is reported as soon as it closes, never held back for the engine's
restart (memory may never come back, the daemon may die); one that hit the engine is then
reported again, same id, with the ``restart`` event (or ``no_restart`` and why) appended: the
incident store overwrites the file by id, the journal gets the updated report.  The supervisor
also opens incidents of its own (:meth:`EngineIncidents.open`): ``wedged``, ``exit``, ``peer``,
``head``, ``given_up``.  Reporting never blocks supervision and
never raises.
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Callable

from sparkguard import meminfo, sysinfo
from sparkguard.model import Event, Incident, Target, Thresholds, new_incident
from sparkguard.supervisor.gates import read_mem_available

log = logging.getLogger("sparkguard.supervisor")

#: summary suffix of an incident reported before the restart it causes (replaced when it is resolved)
PENDING = "; engine restart pending"


class EngineIncidents:
    """Reported incidents waiting for the engine's restart, and the supervisor's own incidents.

    Args:
        reporter: ``sparkguard.reporter.Reporter`` (``event(ref, event)`` / ``finish(record)``),
            or None (nothing reported).
        count_incident: ``(kind: str, wall: float, id: str) -> None`` called when an incident of the
            supervisor's own opens, so the daemon's incident counters include it; or None.
    """

    def __init__(self, reporter=None, count_incident: Callable[[str, float, str], None] | None = None):
        self.reporter = reporter
        self.count_incident = count_incident
        self.pending: collections.deque[Incident] = collections.deque()

    def finish(self, incident: Incident) -> None:
        """Hand a closed incident to the reporter (JSON file, journal)."""
        if self.reporter is not None:
            try:
                self.reporter.finish(incident.to_json())
            except Exception as e:  # noqa: BLE001 - reporting must never break supervision
                log.error("reporting incident %s failed: %s", incident.id, e)

    def event(self, incident: Incident, event: str, detail: str, pids: list[int] | None = None) -> Event:
        """Append an event (with MemAvailable now) to the incident's timeline and report it."""
        now = time.time()
        try:
            avail = read_mem_available()
        except (OSError, ValueError):
            avail = 0
        ev = Event(event, round(now - incident.started_at, 4), now, avail, list(pids or []), detail)
        incident.timeline.append(ev)
        if self.reporter is not None:
            try:
                self.reporter.event(incident.ref(), ev.to_json())
            except Exception as e:  # noqa: BLE001
                log.error("reporting an event of incident %s failed: %s", incident.id, e)
        return ev

    def track(self, incident: Incident) -> None:
        """Report ``incident`` again at the next :meth:`flush` (the restart it caused, or why none)."""
        self.pending.append(incident)

    def flush(self, now: dict, why: str, restart_detail: str | None = None, pids: list[int] | None = None,
              views=()) -> None:
        """Report every tracked incident again: with a ``restart`` event (``restart_detail``,
        ``pids``: the new engine) when the engine was restarted, else a ``no_restart`` event
        saying ``why``.  ``incident.engine`` keeps what it said at the close (that run's pid,
        exit, last lines) and gains ``restarted`` (bool), ``after`` (``now``: the supervisor's
        ``state``, ``pid``, ``lane`` at this point) and the updated ``restarts`` counters.

        Args:
            now: ``{"state": str, "pid": int|None, "lane": str|None, "restarts": {reason: int},
                "start_gates": [gate record]}`` (the records only when a gate beyond the quiesce
                gate ran, :func:`.memgate.notable`: then the restarted incident's engine part
                gains ``start_gates``).
            views: the other nodes as read just before the restart (``cluster.NodeView``): an
                incident caused by one of them gains ``cause.node_at_restart``, that node as it
                was then (its ``last_incident`` is the incident it recorded for the same event).
        """
        pend = []
        while self.pending:
            pend.append(self.pending.popleft())
        for inc in pend:
            if inc.engine is None:
                inc.engine = {}
            eng = inc.engine
            inc.summary = inc.summary.removesuffix(PENDING)
            if restart_detail is not None:
                self.event(inc, "restart", restart_detail, pids)
                eng["restarted"] = True
                if now.get("start_gates"):      # every gate of the pass (docs/start-gate.md)
                    eng["start_gates"] = list(now["start_gates"])
                inc.summary += "; engine restarted"
            else:
                self.event(inc, "no_restart", why)
                eng["restarted"] = False
                inc.summary += f"; engine not restarted ({why})"
            eng["after"] = {k: now.get(k) for k in ("state", "pid", "lane")}
            cause = eng.get("cause")
            if restart_detail is not None and cause and cause.get("node"):
                url = cause["node"].get("url")
                for v in views:
                    if v.url == url:
                        node = v.as_dict()
                        was = cause.get("was")
                        if v.last_incident_at is None or was is None or v.last_incident_at < was:
                            node["last_incident"] = None      # older than this event: not about it
                        cause["node_at_restart"] = node
            if now.get("restarts") is not None:
                eng["restarts"] = dict(now["restarts"])
            self.finish(inc)

    def open(self, kind: str, cfg, target, event: str, detail: str, engine: dict, pids: list[int],
             summary: str) -> Incident:
        """An incident of the supervisor's own (docs/incident.md), its first event already reported.

        Args:
            kind: ``"wedged"`` (health probes say the engine hangs), ``"exit"`` (its run ended by
                itself), ``"peer"``/``"head"`` (a TP cluster's other node: a rank of the head's group,
                the head run a headless rank was in, went away), ``"given_up"``.
            cfg: ``config.Config`` (thresholds recorded).
            target: ``enginetree.Target`` of the engine (its rows read), or None.
            event, detail: the first event (``wedged``, ``exited``, ``peer``, ``head``, ``given_up``) and why.
            engine: the supervisor's engine info (state, lane, pid, last lines; ``cause`` for the
                cluster kinds).
            pids: the engine's root pid (or none).
            summary: the summary line it opens with.
        """
        g = cfg.guard
        wall = time.time()
        try:
            mi = meminfo.read()
        except OSError:
            mi = {}
        inc = new_incident(kind, wall, Thresholds.of(g), mi, dry_run=g.dry_run,
                           psi_memory=sysinfo.read_psi_memory(), zram=sysinfo.read_zram(),
                           target=None if target is None else Target.of(target), summary=summary, engine=engine)
        if self.count_incident is not None:
            try:
                self.count_incident(kind, wall, inc.id)
            except Exception:  # noqa: BLE001
                pass
        self.event(inc, event, detail, pids)
        return inc

    def close_engine(self, inc: Incident, engine: dict, summary: str, restarting: bool) -> None:
        """The engine's run ended: outcome (``killed`` when the timeline has a SIGKILL,
        ``terminated`` after a SIGTERM (and for ``wedged``), else ``exited``: it ended by itself), end time, the engine
        part ``engine`` (the ``cause`` it opened with kept), the summary (``summary``: why; the
        outcome and, while ``restarting``, :data:`PENDING` appended)."""
        ev = inc.events()
        inc.outcome = ("killed" if "sigkill" in ev else "terminated" if "sigterm" in ev or inc.kind == "wedged"
                       else "exited")
        inc.ended_at = time.time()
        cause = (inc.engine or {}).get("cause")
        inc.engine = dict(engine, cause=cause) if cause is not None else engine
        inc.summary = f"{summary}; {inc.outcome}" + (PENDING if restarting else "")

    def close_wedged_dry_run(self, inc: Incident, detail: str) -> None:
        """A dry run's wedged incident: nothing was signalled (``detail``: why it was wedged)."""
        inc.outcome, inc.ended_at = "dry_run", time.time()
        inc.summary = f"engine wedged: {detail}; dry run, nothing signalled"

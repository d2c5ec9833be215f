"""The guard's memory incident: opened at the crossing, events added, filled after the signal, closed.

The :class:`Recorder` belongs to the poll-loop thread: the loop calls :meth:`Recorder.open` when
the signal crosses the SIGTERM line, :meth:`Recorder.event` for each thing that happens,
:meth:`Recorder.fill` after the SIGTERM (details that cost reads: act first, report after) and
:meth:`Recorder.close` with the outcome.  Each event goes to the reporter
(:meth:`sparkguard.reporter.Reporter.event`) and to the supervisor
(``Supervisor.on_guard_event``); the closed incident goes to the supervisor
(``Supervisor.take_incident``) when an engine is supervised, else to ``Reporter.finish``.
It also keeps the incident counters the daemon's snapshot shows (``counts``, ``last_incident``).

Ownership: the open :class:`sparkguard.model.Incident` is the poll-loop thread's alone; others see
copies (the reporter and the supervisor's event hook get :meth:`~sparkguard.model.Incident.ref`
and the event's JSON).  :meth:`Recorder.close` drops its reference, then hands the record over:
to ``Supervisor.take_incident`` (which owns it from then on) or, as JSON, to ``Reporter.finish``.
"""

from __future__ import annotations

import threading
import time

from sparkguard import enginetree, sysinfo
from sparkguard.model import Event, Incident, Target, Thresholds, TreeRow, new_incident
from sparkguard.units import format_line, format_size


class Recorder:
    """Builds the guard's incident records.

    Args:
        reader: ``meminfo.MeminfoReader``: its ``raw()`` bytes at the crossing go into the record.
        reporter: ``reporter.Reporter`` (or an object with its ``event``/``finish``).
        host: host name; boot_id: ``/proc/sys/kernel/random/boot_id`` (:mod:`sparkguard.sysinfo`).

    Attributes:
        incident: the open :class:`sparkguard.model.Incident`, or None.
        supervisor: the ``Supervisor`` when ``engine:`` is configured, else None.
        counts: incidents per kind since the start (``{"memory": n, "link": n, "wedged": n}``).
        last_incident: unix time, seconds, the last incident started, or None.
        last_incident_ref: ``(id, kind)`` of that incident, or None.
    """

    def __init__(self, reader, reporter, host: str, boot_id: str):
        self.reader = reader
        self.reporter = reporter
        self.host, self.boot_id = host, boot_id
        self.supervisor = None
        self.incident: Incident | None = None
        self.counts: dict[str, int] = {}
        self._count_lock = threading.Lock()     # count() is called from other threads too
        self.last_incident: float | None = None
        self.last_incident_ref: tuple[str, str] | None = None
        self._t0 = 0.0          # monotonic s of the crossing: events' ``t`` count from it
        self._min = 0           # lowest signal seen in the open incident, bytes

    def open(self, now: float, value: int, g, fired: dict | None = None) -> None:
        """The signal crossed the SIGTERM line, or is predicted to (``fired``).  ``now``: monotonic
        s; ``value``: the signal, bytes; ``g``: ``config.GuardConfig``; ``fired``: what triggered
        (``policy.Policy.fired``), kept as the incident's ``trigger`` unless it is the plain line
        of the serving phase (records of that case are as they always were)."""
        wall = time.time()
        self.incident = new_incident("memory", wall, Thresholds.of(g), self.reader.raw(), host=self.host,
                                     boot_id=self.boot_id, dry_run=g.dry_run)
        if fired is not None and (fired["trigger"] != "line" or fired["phase"] != "serving"):
            self.incident.trigger = dict(fired)
        self._t0, self._min = now, value
        with self._count_lock:                  # uncontended but for a rare supervisor/link incident
            self.counts["memory"] = self.counts.get("memory", 0) + 1
        self.last_incident = wall
        self.last_incident_ref = (self.incident.id, self.incident.kind)
        self.event(now, value, "crossed", [], crossed_detail(value, g.term_below, fired))

    def fill(self, target) -> None:
        """After the signal: details that cost reads (act first, report after)."""
        inc = self.incident
        if inc is None:
            return
        inc.parse_meminfo()
        inc.psi_memory = sysinfo.read_psi_memory()
        inc.zram = sysinfo.read_zram()
        if target is None:
            inc.top_consumers = [TreeRow.of(r) for r in enginetree.top_consumers(5)]
            return
        inc.target = Target.of(target)

    def close(self, now: float, value: int, g, dry_run: bool, recovered: bool, stopped: bool = False,
              pcp_free: int = 0, drained: float | None = None) -> None:
        """End the open incident: last event, outcome, report.  ``g``: ``config.GuardConfig``;
        ``dry_run``: the policy's; ``stopped``: the daemon is stopping with the incident still open;
        ``pcp_free``: the most bytes seen on the kernel's per-CPU free lists while waiting for memory
        (:mod:`sparkguard.pcp`; 0: not read); ``drained``: seconds the wait went on past
        ``recovery_wait`` because memory was back on those lists (None: it did not)."""
        inc = self.incident
        # the outcome follows what memory did, whatever ended the wait (the victim given up as
        # unkillable with memory back meanwhile, a victim thawed and killed late): above the line
        # is back
        recovered = recovered or value >= g.term_below
        try:
            if stopped:
                event, detail = "daemon_stopped", f"the guard stopped with memory at {format_line(value)}"
            elif recovered:
                event, detail = "recovered", f"memory back to {format_line(value)}"
                if drained is not None:
                    detail += (f" after {drained:.1f}s more for up to {format_line(pcp_free)} on the kernel's "
                               "per-CPU free lists to drain into MemAvailable")
            elif inc is not None and "unkillable" in inc.events():
                event, detail = "recovery_timeout", f"victim not gone and memory still {format_line(value)}"
            else:
                gone = round(g.recovery_wait + (drained or 0.0), 1)
                event, detail = "recovery_timeout", (f"victim gone {gone:g}s ago but memory still "
                                                     f"{format_line(value)}")
                if pcp_free:
                    detail += f" (and up to {format_line(pcp_free)} free on the kernel's per-CPU lists)"
            self.event(now, value, event, [], detail + (f", {now - self._t0:.2f}s after the crossing"
                                                        if inc else ""))
            if inc is not None:
                kinds = inc.events()
                outcome = ("dry_run" if dry_run else "killed" if "sigkill" in kinds else
                           "terminated" if "sigterm" in kinds else "no_target" if "no_target" in kinds
                           else "recovered")
                if stopped:
                    outcome += "_daemon_stopped"
                elif not recovered:
                    outcome += "_memory_not_back"
                inc.outcome = outcome
                inc.ended_at = time.time()
                inc.min_available_bytes = self._min
                inc.parse_meminfo()
                inc.summary = _summary(inc)
                self.incident = None
                self._hand_over(inc)
        finally:
            self.incident = None

    def event(self, now: float, value: int, event: str, pids: list[int], detail: str) -> None:
        """One timeline event of the open incident (none open: nothing).  ``now``: monotonic s."""
        inc = self.incident
        if inc is None:
            return
        ev = Event(event, round(now - self._t0, 4), time.time(), value, pids, detail)
        inc.timeline.append(ev)
        if value < self._min:
            self._min = value
        ref, ev_json = inc.ref(), ev.to_json()
        self.reporter.event(ref, ev_json)
        if self.supervisor is not None:
            self.supervisor.on_guard_event(ref, ev_json)

    def _hand_over(self, inc: Incident) -> None:
        """Report a closed incident.  With an engine the supervisor takes it
        (``Supervisor.take_incident``: adds the engine part, reports it, and again after the
        restart); from here on the supervisor owns it and the recorder never touches it again."""
        if self.supervisor is None or not self.supervisor.take_incident(inc):
            self.reporter.finish(inc.to_json())

    def count(self, kind: str, wall: float, incident_id: str | None = None) -> None:
        """An incident opened outside the poll loop (the supervisor's, a link's): ``kind``, its
        start (unix s) and id."""
        with self._count_lock:
            self.counts[kind] = self.counts.get(kind, 0) + 1
        self.last_incident = wall
        if incident_id is not None:
            self.last_incident_ref = (incident_id, kind)


def crossed_detail(value: int, term_below: int, fired: dict | None) -> str:
    """The ``crossed`` event's words: how far below the line, or, for a predicted crossing, the
    estimate (``"predicted: 2.1 GiB/s, crossing in 0.4 s: ..."``); a loading engine's incident
    says it is a failed load.  ``fired``: ``policy.Policy.fired`` or None."""
    line = term_below if fired is None else fired["line_bytes"]
    which = "the SIGTERM line" if fired is None or fired["phase"] == "serving" else "the load phase's SIGTERM line"
    if fired is not None and fired["trigger"] == "predicted":
        rate = fired["fall_rate_bytes_per_second"] / 1024**3
        out = (f"predicted: {rate:.1f} GiB/s, crossing in {fired['seconds_to_line']:.1f} s: {format_line(value)} "
               f"({value} bytes) is {(value - line) / 1024**2:.1f} MiB above {which} {format_line(line)}")
    else:
        out = (f"{format_line(value)} ({value} bytes) is {(line - value) / 1024**2:.1f} MiB below {which} "
               f"{format_line(line)}")
    if fired is not None and fired["phase"] == "loading":
        out += "; the engine is loading (not yet ready): a failed load"
    return out


def _summary(inc: Incident) -> str:
    """One line: what happened, to whom, memory."""
    th = inc.thresholds
    t = inc.target
    who = f"{t.title} (pid {t.root_pid})" if t is not None else "no target"
    tl = {e.event: e for e in inc.timeline}
    trig = getattr(inc, "trigger", None)
    line = trig["line_bytes"] if trig else th.term_below_bytes
    parts = [f"{'MemAvailable' if th.signal == 'available' else 'MemAvailable+SwapFree'} fell to "
             f"{format_size(inc.min_available_bytes)} (line {format_size(line)})"]
    if trig and trig["trigger"] == "predicted":
        parts[0] = (f"predicted crossing ({trig['fall_rate_bytes_per_second'] / 1024**3:.1f} GiB/s, "
                    f"{trig['seconds_to_line']:.1f} s to the line); " + parts[0])
    if trig and trig["phase"] == "loading":
        parts.insert(0, "failed load")
    if "sigterm" in tl:
        parts.append(f"SIGTERM {who}")
    elif "would_term" in tl:
        parts.append(f"dry run, would SIGTERM {who}")
    elif "no_target" in tl:
        parts.append("nothing to signal")
    if "sigkill" in tl:
        parts.append(f"SIGKILL after {tl['sigkill'].t:.1f}s")
    if "exited" in tl:
        parts.append(f"gone after {tl['exited'].t:.2f}s")
    end = tl.get("recovered") or tl.get("recovery_timeout")
    if end:
        parts.append(f"memory {format_size(end.available_bytes)} after {end.t:.2f}s")
    return "; ".join(parts)

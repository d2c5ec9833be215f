"""The guard's memory incident: opened at the crossing, events added, filled after the signal, closed.

The :class:`Recorder` belongs to the poll-loop thread: the loop calls :meth:`Recorder.open` when
the signal crosses the SIGTERM line, :meth:`Recorder.event` for each thing that happens,
:meth:`Recorder.fill` after the SIGTERM (details that cost reads: act first, report after) and
:meth:`Recorder.close` with the outcome.  Each event goes to the reporter
(:meth:`sparkguard.reporter.Reporter.event`) and to the supervisor
(``Supervisor.on_guard_event``); the closed incident goes to the supervisor
(``Supervisor.take_incident``) when an engine is supervised, else to ``Reporter.finish``.
It also keeps the incident counters the daemon's snapshot shows (``counts``, ``last_incident``).
"""

from __future__ import annotations

import time

from sparkguard import proctree, sysinfo
from sparkguard.incidents import new_id
from sparkguard.units import format_size


class Recorder:
    """Builds the guard's incident records.

    Args:
        reader: ``meminfo.MeminfoReader``: its ``raw()`` bytes at the crossing go into the record.
        reporter: ``reporter.Reporter`` (or an object with its ``event``/``finish``).
        host: host name; boot_id: ``/proc/sys/kernel/random/boot_id`` (:mod:`sparkguard.sysinfo`).

    Attributes:
        incident: the open incident (dict), or None.
        supervisor: the ``Supervisor`` when ``engine:`` is configured, else None.
        counts: incidents per kind since the start (``{"memory": n, "link": n, "wedged": n}``).
        last_incident: unix time, seconds, the last incident started, or None.
    """

    def __init__(self, reader, reporter, host: str, boot_id: str):
        self.reader = reader
        self.reporter = reporter
        self.host, self.boot_id = host, boot_id
        self._new_id = new_id
        self.supervisor = None
        self.incident: dict | None = None
        self.counts: dict[str, int] = {}
        self.last_incident: float | None = None

    def open(self, now: float, value: int, g) -> None:
        """The signal crossed the SIGTERM line.  ``now``: monotonic s; ``value``: the signal, bytes;
        ``g``: ``config.GuardConfig``."""
        wall = time.time()
        self.incident = {
            "id": self._new_id(wall),
            "kind": "memory", "drill": False, "host": self.host, "boot_id": self.boot_id,
            "started_at": wall, "ended_at": None, "dry_run": g.dry_run,
            "thresholds": {"term_below_bytes": g.term_below, "kill_below_bytes": g.kill_below,
                           "grace_seconds": g.grace, "signal": g.signal},
            "meminfo": self.reader.raw(), "psi_memory": None, "zram": [], "target": None,
            "timeline": [], "outcome": None, "summary": "",
            "_t0": now, "_min": value,
        }
        self.counts["memory"] = self.counts.get("memory", 0) + 1
        self.last_incident = wall
        self.event(now, value, "crossed", [], f"{_fmt_size(value)} ({value} bytes) is "
                   f"{(g.term_below - value) / 1024**2:.1f} MiB below the SIGTERM line {_fmt_size(g.term_below)}")

    def fill(self, target) -> None:
        """After the signal: details that cost reads (act first, report after)."""
        inc = self.incident
        if inc is None:
            return
        if isinstance(inc["meminfo"], bytes):
            inc["meminfo"] = sysinfo.parse_meminfo(inc["meminfo"])
        inc["psi_memory"] = sysinfo.read_psi_memory()
        inc["zram"] = sysinfo.read_zram()
        if target is None:
            inc["top_consumers"] = proctree.top_consumers(5)
            return
        inc["target"] = {"root_pid": target.root_pid, "title": target.title, "pattern": target.pattern,
                         "mem_bytes": target.mem_bytes, "tree": target.tree}

    def close(self, now: float, value: int, g, dry_run: bool, recovered: bool, stopped: bool = False) -> None:
        """End the open incident: last event, outcome, report.  ``g``: ``config.GuardConfig``;
        ``dry_run``: the policy's; ``stopped``: the daemon is stopping with the incident still open."""
        inc = self.incident
        try:
            if stopped:
                event, detail = "daemon_stopped", f"the guard stopped with memory at {_fmt_size(value)}"
            elif recovered:
                event, detail = "recovered", f"memory back to {_fmt_size(value)}"
            else:
                event, detail = "recovery_timeout", (f"victim gone {g.recovery_wait:g}s ago but "
                                                     f"memory still {_fmt_size(value)}")
            self.event(now, value, event, [], detail + (f", {now - inc['_t0']:.2f}s after the crossing"
                                                        if inc else ""))
            if inc is not None:
                kinds = [e["event"] for e in inc["timeline"]]
                inc["outcome"] = ("dry_run" if dry_run else "killed" if "sigkill" in kinds else
                                  "terminated" if "sigterm" in kinds else "no_target" if "no_target" in kinds
                                  else "recovered")
                if stopped:
                    inc["outcome"] += "_daemon_stopped"
                elif not recovered:
                    inc["outcome"] += "_memory_not_back"
                inc["ended_at"] = time.time()
                inc["min_available_bytes"] = inc.pop("_min")
                inc.pop("_t0", None)
                if isinstance(inc["meminfo"], bytes):
                    inc["meminfo"] = sysinfo.parse_meminfo(inc["meminfo"])
                inc["summary"] = _summary(inc)
                self._finish(inc)
        finally:
            self.incident = None

    def event(self, now: float, value: int, event: str, pids: list[int], detail: str) -> None:
        """One timeline event of the open incident (none open: nothing).  ``now``: monotonic s."""
        inc = self.incident
        ev = {"event": event, "t": round(now - inc["_t0"], 4) if inc else 0.0, "at": time.time(),
              "available_bytes": value, "pids": pids, "detail": detail}
        if inc is not None:
            inc["timeline"].append(ev)
            if value < inc["_min"]:
                inc["_min"] = value
            self.reporter.event(inc, ev)
            if self.supervisor is not None:
                self.supervisor.on_guard_event(inc, ev)

    def _finish(self, inc: dict) -> None:
        """Report a closed incident; with an engine the supervisor adds its state and the restart."""
        if self.supervisor is None or not self.supervisor.take_incident(inc):
            self.reporter.finish(inc)

    def count(self, kind: str, wall: float) -> None:
        """An incident opened outside the poll loop (the supervisor's ``wedged``, a link's)."""
        self.counts[kind] = self.counts.get(kind, 0) + 1
        self.last_incident = wall


def _fmt_size(n) -> str:
    return format_size(n) if n is not None else "off"


def _summary(inc: dict) -> str:
    """One line: what happened, to whom, memory."""
    th = inc["thresholds"]
    t = inc.get("target") or {}
    who = f"{t.get('title', '?')} (pid {t.get('root_pid')})" if t else "no target"
    tl = {e["event"]: e for e in inc["timeline"]}
    parts = [f"{'MemAvailable' if th['signal'] == 'available' else 'MemAvailable+SwapFree'} fell to "
             f"{format_size(inc.get('min_available_bytes'))} (line {format_size(th['term_below_bytes'])})"]
    if "sigterm" in tl:
        parts.append(f"SIGTERM {who}")
    elif "would_term" in tl:
        parts.append(f"dry run, would SIGTERM {who}")
    elif "no_target" in tl:
        parts.append("nothing to signal")
    if "sigkill" in tl:
        parts.append(f"SIGKILL after {tl['sigkill']['t']:.1f}s")
    if "exited" in tl:
        parts.append(f"gone after {tl['exited']['t']:.2f}s")
    end = tl.get("recovered") or tl.get("recovery_timeout")
    if end:
        parts.append(f"memory {format_size(end['available_bytes'])} after {end['t']:.2f}s")
    return "; ".join(parts)

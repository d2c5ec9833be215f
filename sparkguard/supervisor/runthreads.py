"""The Supervisor's per-run threads (exit watcher, output pump, monitor) and its gate hooks.

:class:`RunThreads` is a part of :class:`sparkguard.supervisor.core.Supervisor` (its base
class).  The exit watcher and the monitor post what they saw to the supervisor thread
(:meth:`ControlApi._post`); the monitor keeps only the probe's failure count itself.
"""

from __future__ import annotations

import time

from sparkguard import proctree
from sparkguard.supervisor import health, output, process
from sparkguard.supervisor.run import Run


class RunThreads:
    """What the threads of one run call on a :class:`Supervisor`."""

    def _watch_exit(self, run: Run) -> None:
        """Record the root's exit status (not reaped: :func:`process.wait_exit`)."""
        code, sig = process.wait_exit(run.pid)
        t_exit = time.monotonic()

        def exited() -> None:
            run.exit = (code, sig)
            run.t_exit = t_exit
            run.ready = False
        self._post(exited)

    def _pump(self, run: Run) -> None:
        """Forward stdout/stderr line by line to the sink and the last-lines ring."""
        def line(stream: str, raw: bytes) -> None:
            text = output.decode(raw)
            run.lines.add(stream, text)
            self.sink.write(text, stream, run.pid, run.lane)
        output.pump(run.proc.stdout, run.proc.stderr, line)

    # MonitorHooks (sparkguard.supervisor.health), called from the monitor thread

    def _refresh_members(self, run: Run) -> None:
        """Record every process of the run's tree; persisted when it changed."""
        if process.refresh_members(run):
            self._post(self._write_state)

    def _became_ready(self, run: Run) -> None:
        now = time.monotonic()
        run.ever_ready = True      # the monitor's own: it calls this once per run, and reads it next turn

        def ready() -> None:
            if run.exit is not None:
                return
            run.ready = True
            self.time_to_ready = now - run.t_spawn
            self.ready_count += 1
            self.state, self.detail = "ready", ""
            self._history("ready", f"pid {run.pid} ready after {self.time_to_ready:.2f} s")
        self._post(ready)

    def _health_changed(self, run: Run, ok: bool, url: str) -> None:
        def changed() -> None:
            if run.exit is not None or run is not self.run:    # seen before the exit was applied
                return
            run.ready = ok
            self.state = "ready" if ok else "starting"
            self.detail = "" if ok else f"{url} not answering 200"
        self._post(changed)

    def _probed(self, run: Run, ok: bool) -> int:
        run.probe_failures = 0 if ok else run.probe_failures + 1
        return run.probe_failures

    def _verdict(self, run: Run, verdict: str, detail: str) -> None:
        if run.exit is not None or run.verdict is not None:
            return
        if verdict == "wedged" and not self.cfg.guard.dry_run:
            run.incident = self._open_wedged_incident(run, detail)   # before _supervise acts on it

        def given() -> None:
            run.verdict, run.verdict_detail = verdict, detail
            self._history(verdict, detail)
        self._post(given)

    def _wedged_dry_run(self, run: Run) -> None:
        inc = self._open_wedged_incident(run, run.verdict_detail)
        self.reports.event(inc, "would_term", f"dry run: would SIGTERM the wedged engine (pid {run.pid})", [run.pid])
        self.reports.close_wedged_dry_run(inc, run.verdict_detail)
        self.reports.finish(inc)
        with self.cv:
            run.verdict, run.probe_failures = None, 0
        run.start_thread("sg-engine-mon", health.monitor, lambda: self.ecfg, SupervisorMonitorHooks(self))

    def _open_wedged_incident(self, run: Run, detail: str):
        """An incident of kind ``"wedged"`` (a ``model.Incident``, docs/incident.md)."""
        t = self.target(proctree.scan(), proctree.Protector(self.cfg.targets.protect))
        return self.reports.open_wedged(self.cfg, t, detail, self._engine_info(run), run.pid)


class SupervisorGateHooks:
    """:class:`gates.GateHooks` on a :class:`Supervisor` ``sup`` (called from the supervisor thread)."""

    def __init__(self, sup):
        self.sup = sup
        self.interrupted, self.wait, self.note = sup._interrupted, sup._wait, sup._history

    def held(self) -> str | None:
        """Why starts are held: a guard incident is open, or the TP link is down (the events
        posted so far applied first)."""
        with self.sup.cv:
            self.sup._apply_events()
            if self.sup.incident_open:
                return "a guard incident is open (memory below the SIGTERM line)"
            return "the TP link is down" if self.sup.link_down else None

    def show(self, detail: str) -> None:
        """State ``waiting`` with ``detail``."""
        self.sup._set("waiting", detail)

    def peers_seen(self, states: list[dict]) -> None:
        """The peers gate's last readings (status ``peers``)."""
        with self.sup.cv:
            self.sup.peer_states = states


class SupervisorMonitorHooks:
    """:class:`health.MonitorHooks` on a :class:`Supervisor` ``sup`` (called from the monitor thread)."""

    def __init__(self, sup):
        self.refresh_members, self.became_ready = sup._refresh_members, sup._became_ready
        self.health_changed, self.probed, self.verdict = sup._health_changed, sup._probed, sup._verdict
        self.note = sup._history

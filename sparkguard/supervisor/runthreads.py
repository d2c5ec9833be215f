"""The Supervisor's per-run threads (exit watcher, output pump, monitor) and its gate hooks.

:class:`RunThreads` is a part of :class:`sparkguard.supervisor.core.Supervisor` (its base
class).  The exit watcher and the monitor post what they saw to the supervisor thread
(:meth:`ControlApi._post`); the monitor keeps only the probe's failure count itself.
"""

from __future__ import annotations

import time

from sparkguard import enginetree, proctree
from sparkguard.supervisor import adopt, cluster, health, nodes, output, process
from sparkguard.supervisor.run import Run


class RunThreads:
    """What the threads of one run call on a :class:`Supervisor`."""

    def _watch_exit(self, run: Run) -> None:
        """Record the root's exit status (not reaped: :func:`process.wait_exit`); for an adopted
        run (not our child), its exit on the pidfd it was verified with, status unknown."""
        if run.adopted:
            fd, run.pidfd = run.pidfd, None
            code, sig = adopt.wait_exit(fd, run.pid, run.starttime) if fd is not None else (None, None)
        else:
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
        if run.streams or run.adopted:      # the run's FIFOs (output.make_fifos), re-opened if adopted
            output.pump(run.streams.get("stdout"), run.streams.get("stderr"), line)
        else:
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
            self.ready_count += 1
            self.state, self.detail = "ready", ""
            if run.adopted:       # its start-up happened under another daemon: no new time to ready
                self._history("ready", f"pid {run.pid} (adopted) answers: ready")
                return
            self.time_to_ready = now - run.t_spawn
            self._history("ready", f"pid {run.pid} ready after {self.time_to_ready:.2f} s")
        self._post(ready)

    def _health_changed(self, run: Run, ok: bool, url: str, why: str | None = None) -> None:
        def changed() -> None:
            if run.exit is not None or run is not self.run:    # seen before the exit was applied
                return
            run.ready = ok
            self.state = "ready" if ok else "starting"
            self.detail = "" if ok else (why or f"{url} not answering 200")
        self._post(changed)

    def _probed(self, run: Run, ok: bool) -> int:
        run.probe_failures = 0 if ok else run.probe_failures + 1
        return run.probe_failures

    def _verdict(self, run: Run, verdict: str, detail: str) -> None:
        if run.exit is not None or run.verdict is not None:
            return

        def given() -> None:
            run.verdict, run.verdict_detail = verdict, detail
            self._history(verdict, detail)
        self._post(given)

    def _cluster(self, run: Run) -> bool:
        """(Monitor thread.) Read the other nodes once; on the head, restart (``peer``) when a rank
        of its group has another run; on a headless rank, follow the head (:class:`cluster.HeadWatch`):
        ready while in its group and it is ready, ``waiting_for_head`` before, restart (``head``)
        when the head run it joined, or one it waited beside, is gone.  True when a verdict was given."""
        e = self.ecfg
        views = nodes.read_all(e.peers, min(3.0, max(0.5, e.health_interval)))

        def seen() -> None:
            self.node_views = views
        self._post(seen)
        if run.role.role == "head":
            broken = cluster.broken_group(run.group, views)
            if broken is None:
                return False
            v, why = broken
            run.cause = {"reason": "peer", "node": v.as_dict(), "was": run.group.get(v.node_rank)}
            self._verdict(run, "peer", f"{v.name()}: {why}; the group of this head run is broken"
                          + _their_incident(v, run.group.get(v.node_rank)))
            return True
        head = cluster.find_head(views)
        was = run.head_watch.joined
        action, why = run.head_watch.see(head)
        run.joined = run.head_watch.joined
        if action is not None:
            run.cause = {"reason": "head", "node": head.as_dict() if head else None, "was": was,
                         "wait": action == "stop"}
            self._verdict(run, "head", why + _their_incident(head, run.cause["was"]))
            return True
        if head is None:
            return False
        ready = run.joined is not None and head.ready
        if ready and not run.ever_ready:
            self._became_ready(run)
        elif ready != run.ready and run.ever_ready:
            self._health_changed(run, ready, head.url, f"head {head.url}: "
                                 + ("not ready" if run.joined is not None else "this rank is not in its group"))
        elif not ready and not run.ever_ready:
            detail = (f"in the group of head run {run.joined:.3f}; the head is not ready yet" if run.joined
                      else f"not yet in a group of head {head.url}")

            def waiting() -> None:
                if run is self.run and run.exit is None and run.verdict is None and self.state != "stopping":
                    self.state, self.detail = "waiting_for_head", detail
            self._post(waiting)
        return False

    def _wedged_dry_run(self, run: Run) -> None:
        inc = self._open_incident(run, "wedged", run.verdict_detail)
        self.reports.event(inc, "would_term", f"dry run: would SIGTERM the wedged engine (pid {run.pid})", [run.pid])
        self.reports.close_wedged_dry_run(inc, run.verdict_detail)
        self.reports.finish(inc)
        with self.cv:
            run.verdict, run.probe_failures = None, 0
        run.start_thread("sg-engine-mon", health.monitor, lambda: self.ecfg, SupervisorMonitorHooks(self))

    def _open_incident(self, run: Run, kind: str, detail: str):
        """An incident of kind ``wedged``, ``peer`` or ``head`` about ``run``, its tree read now
        (a ``model.Incident``, docs/incident.md)."""
        t = self.target(proctree.scan(), enginetree.Protector(self.cfg.targets.protect))
        engine = self._engine_info(run)
        if run.cause is not None:
            engine["cause"] = run.cause
        return self.reports.open(kind, self.cfg, t, kind, detail, engine, [run.pid], SUMMARY[kind] + detail)


def _their_incident(v, since: float | None) -> str:
    """`` (its last incident: ID)`` when node ``v``'s last incident started at or after ``since``
    (a run of that node, on its own clock): about this event, not an older one; else ""."""
    if v is None or not v.last_incident or v.last_incident_at is None or since is None or v.last_incident_at < since:
        return ""
    return f" (its last incident: {v.last_incident})"


#: the summary an incident of the supervisor's own opens with (its detail follows)
SUMMARY = {"wedged": "engine wedged: ", "not_ready": "engine not ready in time: ",
           "peer": "TP group broken, restarting the head: ",
           "head": "head run gone, restarting this headless rank: ", "exit": "engine exited by itself: ",
           "given_up": "gave up starting the engine: "}


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

    def nodes_seen(self, views: list) -> None:
        """The cluster order gate's last readings (status ``nodes``)."""
        with self.sup.cv:
            self.sup.node_views = list(views)


class SupervisorMonitorHooks:
    """:class:`health.MonitorHooks` on a :class:`Supervisor` ``sup`` (called from the monitor thread)."""

    def __init__(self, sup):
        self.refresh_members, self.became_ready = sup._refresh_members, sup._became_ready
        self.health_changed, self.probed, self.verdict = sup._health_changed, sup._probed, sup._verdict
        self.note, self.cluster = sup._history, sup._cluster
        self._sup = sup

    @property
    def engine_paused(self) -> bool:
        """The guard's soft line has the engine paused (``Supervisor.engine_paused``)."""
        return self._sup.engine_paused

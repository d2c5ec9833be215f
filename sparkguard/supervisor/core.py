"""The Supervisor: one thread that starts the engine, watches it and restarts it.

It ties the pieces together (see the package doc for one start in order): the gates
(:mod:`.gates`), the process and its tree (:mod:`.process`), output (:mod:`.output`), health
(:mod:`.health`), restart policy (:mod:`.restart`), lanes and the state file (:mod:`.lanes`) and
incident reports (:mod:`.reports`).  The guard's poll loop only calls the cheap, non-blocking
hooks (:meth:`Supervisor.target`, :meth:`Supervisor.on_guard_event`, :meth:`Supervisor.take_incident`);
control requests arrive on the control socket's threads (:meth:`Supervisor.handle`).

One owner: the supervisor thread (``sg-supervisor``) owns the Supervisor's state and writes it
under ``cv``.  Other threads never write it: they post an event (a function) to the
supervisor's mailbox (:meth:`ControlApi._post`), and the supervisor thread applies the events
under ``cv`` each time it waits (:meth:`ControlApi._wait_for`), in the order they were posted.
The poll loop's hooks post and return (a wake-up costs at most a 5 ms try for the lock); the
link watch, reload and control threads wait until their event is applied (bounded).  Other
threads read the state under ``cv`` (:meth:`status`, :meth:`wait`, the collector) or, from the
poll loop, as single attribute reads (``run``, ``last_run``, ``want``, ``quit``, ``state``...:
each is replaced whole by one assignment).  The events wait while the supervisor thread is in a
step that does not wait on ``cv``: a sweep of leftovers (up to ``guard.grace`` + 10 s), a spawn,
``sync``, ``compact_memory`` (seconds on a busy host), a peer read (``engine.peers``, 3 s each).
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from typing import Callable

from sparkguard import control, proctree, sysinfo
from sparkguard.guard import escalation
from sparkguard.supervisor import cgroup as cgroups
from sparkguard.supervisor import adopt, cluster, container, handover, health, lanes, nodes, output, process, reports
from sparkguard.supervisor import stopbudget, tracking
from sparkguard.supervisor.adoptrun import Adoption
from sparkguard.supervisor.api import EVENTS_MAX, ControlApi
from sparkguard.supervisor.gates import read_mem_available
from sparkguard.supervisor.restart import CLUSTER, COMMANDED, LOAD, REASONS, Backoff, GiveUp, classify_exit, restarts
from sparkguard.supervisor.run import Run
from sparkguard.supervisor.runthreads import SUMMARY, RunThreads, SupervisorMonitorHooks
from sparkguard.supervisor.schedule import BetweenRuns
from sparkguard.supervisor.state import HALTED, StatusViews
from sparkguard.units import format_size

log = logging.getLogger("sparkguard.supervisor")

HISTORY = 50             # status history entries kept
STALE_CGROUP_AGE = 60.0  # seconds: an empty engine-<run id> cgroup older than this at start is removed


class Supervisor(ControlApi, StatusViews, RunThreads, BetweenRuns, Adoption):
    """Starts, watches and restarts one engine.

    Args:
        cfg: ``config.Config`` (``engine`` must be enabled; ``guard.grace`` is the TERM->KILL time).
        reporter: :class:`sparkguard.reporter.Reporter` (``event(incident, event)``, ``finish(incident)``), or None.
        count_incident: ``(kind: str, wall: float, id: str) -> None`` called when the supervisor
            opens an incident of its own (``wedged``, ``exit``, ``peer``, ``head``, ``given_up``),
            so the daemon's incident counters and last incident include it.
        start_control: serve the control socket (``engine.control_socket``).
        placement: :class:`cgroup.Placement` of the engines' cgroups; None: decided at
            :meth:`start` (:func:`cgroup.place`, which may move the daemon into a leaf cgroup).
    Raises (from :meth:`start`):
        OSError: the control socket cannot be created (another daemon owns it, no permission).

    Who writes what (every field not named here: the supervisor thread, under ``cv``):

    * ``hits`` and each run's ``guard_hit`` and ``load_hit``: the poll loop's hooks (:meth:`on_guard_event`,
      :meth:`take_incident`), the guard's own marks; the supervisor thread only reads them.
    * a run's ``ever_ready``, ``probe_failures``, ``head_*``, ``joined`` and ``head_watch`` (a
      headless rank's view of its head), ``cause`` (the other node behind a verdict): that run's
      monitor thread; its ``members``: the monitor and the supervisor thread's escalation;
      ``lines``: the output pump (:class:`output.LastLines`, a deque: appends and copies are
      atomic); ``incident``, ``group`` (a head's ranks at its start), ``head_at_exit``: the
      supervisor thread.
    * ``cfg``/``ecfg``, ``control``, ``thread``, ``previous_state``: set before the thread
      starts, and ``cfg``/``ecfg`` again by the supervisor thread on a reload.
    * ``reports``: :class:`reports.EngineIncidents`, safe from any thread.
    * ``_events``: the mailbox, appended by any thread, emptied by the supervisor thread.
    """

    def __init__(self, cfg, reporter=None, count_incident: Callable[[str, float, str], None] | None = None,
                 start_control: bool = True, placement: cgroups.Placement | None = None):
        self.cfg = cfg
        self.placement = placement
        self.ecfg = cfg.engine
        self.reports = reports.EngineIncidents(reporter, count_incident)
        self.start_control = start_control
        self.cv = threading.Condition()
        self.state = "stopped"
        self.detail = ""
        self.want = "run"
        self.quit = False
        self.request: tuple[str, str | None] | None = None
        self.run: Run | None = None
        self.last_run: Run | None = None
        self.lane = lanes.initial_lane(self.ecfg, lanes.read_state(self.ecfg.state_file))
        self.restarts = {r: 0 for r in REASONS}
        self.starts = 0
        self.ready_count = 0
        self.failed_loads = 0       # runs the memory guard stopped while they loaded (restart.LOAD)
        self.engine_paused = False   # set by the guard's soft line (guard/soft.py): probes wait meanwhile
        self.backoff = Backoff(self.ecfg.backoff_initial, self.ecfg.backoff_max, self.ecfg.stable_after)
        self.give_up = GiveUp(self.ecfg.give_up_after, self.ecfg.give_up_window)
        self.node_views: list[cluster.NodeView] = []     # the other nodes, last read (gate or monitor)
        self.start_views: list[cluster.NodeView] = []    # what the gates read just before this start
        self.delay = 0.0
        self.next_start_at: float | None = None
        self.next_reason: str | None = None
        self.time_to_ready: float | None = None
        self.quiesce_wait: float | None = None
        self.quiesce_timed_out = False
        self.gate_timeout: dict | None = None   # {"gate": "quiesce"|"memfree"|"peers", "detail": str} of the last start
        self.start_gates: dict[str, dict] = {}  # gate -> its record (gates.StartGates), the pass now or the last
        self.last_gates: list[dict] = []        # the records of the pass before the last start
        self.last_exit: dict | None = None
        self.history: collections.deque[dict] = collections.deque(maxlen=HISTORY)
        self._events: collections.deque[Callable[[], None]] = collections.deque(maxlen=EVENTS_MAX)
        self.hits: dict[str, Run] = {}        # guard incident id -> the run the guard signalled in it
        self.incident_open = False
        self.link_down = False
        self.peer_states: list[dict] = []
        self.previous_state: dict = {}
        self.thread: threading.Thread | None = None
        self.control = None
        self.keep_engine = False              # exit keeping the engine (handover.decide); set with quit
        self.keep_why = ""
        self.adoption: dict | None = None     # what the start-up adoption found (status "adoption")
        self.adoptions = {r: 0 for r in adopt.RESULTS}
        self.sink = output.LogSink(self.ecfg.log, self.ecfg.journal_socket,
                                   self.ecfg.identifier or output.identifier_for(self.ecfg.command))

    # ---- public API (any thread) ------------------------------------------------------------

    def start(self) -> None:
        """Open the control socket and start the supervisor thread (which starts the engine).

        Raises:
            OSError: the control socket cannot be served (another daemon, permissions).
        """
        if self.start_control:
            self.control = control.ControlServer(self.ecfg.control_socket, self.handle)
            self.control.start()
        self.previous_state = lanes.read_state(self.ecfg.state_file)
        if self.placement is None:
            self.placement = cgroups.place()
        log.info("engine: tracked by %s", cgroups.describe(self.placement))
        if self.cfg.guard.grace > stopbudget.max_grace():
            log.warning("engine: guard.grace %g s: stopping the engine may take up to %g s, past the shipped unit's "
                        "TimeoutStopSec=%g s less %g s for the daemon's own stop; raise TimeoutStopSec in a drop-in "
                        "(docs/containers.md, 'One stop budget')", self.cfg.guard.grace,
                        stopbudget.join_timeout(self.cfg.guard.grace), stopbudget.UNIT_STOP_TIMEOUT, stopbudget.MARGIN)
        if self.placement.parent:
            for path in cgroups.remove_stale(self.placement.parent, time.time() - STALE_CGROUP_AGE):
                log.info("engine: removed the empty cgroup %s a previous run left", path)
        self.thread = threading.Thread(target=self._main, name="sg-supervisor", daemon=True)
        self.thread.start()

    def stop(self, timeout: float | None = None, keep: bool = False, why: str = "") -> None:
        """Stop the engine (SIGTERM, ``guard.grace``, SIGKILL of the tree and leftovers), flush
        pending incident reports, close the control socket.  Blocks up to ``timeout`` seconds
        (default :func:`stopbudget.join_timeout`: the run's whole stop budget).  ``keep``: leave a
        running engine running for the next daemon to adopt (its state file and a handover note
        written: :mod:`.handover`); ``why`` says why."""
        if self.control is not None:
            self.control.stop()

        def quit_() -> None:      # (event) the daemon is stopping: stop (or keep) the engine, end the thread
            self.keep_engine, self.keep_why = keep, why
            self.quit = True
        self._call(quit_, 0.0)
        if self.thread is not None:
            self.thread.join(timeout if timeout is not None else stopbudget.join_timeout(self.cfg.guard.grace))
        self._flush("daemon stopping")
        self.sink.close()

    def target(self, procs: dict, protector, details: bool = True):
        """The supervised engine as the guard's target: its root, descendants and every process
        still in its process group (reparented ``VLLM::`` orphans included).

        Args:
            procs: a ``proctree.scan()``; protector: ``proctree.Protector``.
            details: read the tree rows and memory now; False leaves them to
                ``proctree.add_details`` (the guard signals first).
        Returns:
            ``proctree.Target`` (pattern ``"engine:supervised"``) or None when no engine runs.
        """
        run = self.run
        return None if run is None else process.target(run, procs, protector, details)

    def on_guard_event(self, incident: dict, event: dict) -> None:
        """The guard recorded ``event`` in ``incident`` (called from the poll loop; never blocks).

        ``crossed`` holds restarts until the incident is closed; ``sigterm``/``sigkill``/
        ``would_*`` naming the engine mark the run as hit by the guard (restart reason ``guard``).
        """
        ev = event.get("event")
        run = self.run
        if ev == "crossed":
            self._post(self._incident_opened)
        elif ev in ("sigterm", "sigkill") and run is not None:
            pids = set(event.get("pids") or ())
            if run.pid in pids or pids & set(dict(run.members)):
                if not run.ever_ready:
                    run.load_hit = True     # before guard_hit: a reader of guard_hit sees both
                run.guard_hit = True
                if ev == "sigterm" and run.deadline is None:    # the stop budget runs from the guard's SIGTERM
                    ago = max(0.0, time.time() - float(event.get("at") or time.time()))
                    run.deadline = stopbudget.Deadline(self.cfg.guard.grace, t0=time.monotonic() - ago)
                if incident.get("id"):
                    self.hits[incident["id"]] = run
                self._history("guard", f"the memory guard sent {ev.upper()} to pid {run.pid} "
                                       f"(incident {incident.get('id')})")
        self._poke()

    def _incident_opened(self) -> None:
        """(Event.) A guard incident is open: hold starts until it is closed."""
        self.incident_open = True

    def _incident_closed(self) -> None:
        """(Event.) The guard incident is closed: starts may go on."""
        self.incident_open = False

    def take_incident(self, incident) -> bool:
        """The guard closed ``incident`` (a ``model.Incident``) and hands it over: from this call
        on the supervisor owns it (the guard keeps no reference).  Adds the engine's state and
        reports it (``reporter.finish``) at once.

        When the guard signalled the supervised engine in this incident, the engine part describes
        that run (its exit, its last output lines, even while the supervisor is still sweeping its
        tree), and the incident is reported again, same id, once the restart it causes happens
        (a ``restart`` event) or is called off (``no_restart``).  Other incidents (``no_target``,
        another victim) get the engine's state now and are reported once.

        Returns True (the supervisor took over finishing it).  Never blocks.
        """
        hit_run = self.hits.pop(incident.id, None)
        run = hit_run or (self.run if self.run is not None else self.last_run)
        exit_ = self._exit_of(run) if run is not None else None
        incident.engine = self._engine_info(run, exit_)
        restarting = (hit_run is not None and exit_ is not None and self.want == "run" and not self.quit
                      and restarts(self.ecfg.restart, True))
        if restarting:
            incident.summary += reports.PENDING
        self.reports.finish(incident)
        if restarting:
            self.reports.track(incident)
        self._post(self._incident_closed)
        return True

    # ---- helpers --------------------------------------------------------------------------

    def _set(self, state: str, detail: str = "") -> None:
        with self.cv:
            self.state, self.detail = state, detail
            self.cv.notify_all()

    def _sweep(self, pgid: int | None, members: dict[int, int], exclude: int | None = None,
               group_ok: bool = True, cgroup: cgroups.EngineCgroup | None = None, deadline=None) -> list[int]:
        return process.sweep(pgid, members, self.cfg.guard.grace, self.cfg.targets.protect, self._history,
                             exclude=exclude, group_ok=group_ok, cgroup=cgroup, deadline=deadline)

    def _status(self) -> dict:
        st = super()._status()
        run = self.run
        st["adoption"] = self.adoption       # what the start-up adoption found (supervisor.adoptrun)
        st["adoptions"] = dict(self.adoptions)
        st["adopted"] = bool(run is not None and run.adopted)
        st["tracking"] = tracking.status(self.placement, run)
        return st

    # ---- the supervisor thread --------------------------------------------------------------

    def _main(self) -> None:
        try:
            if self._adopt_previous():
                self._supervise()
            while True:
                with self.cv:
                    self._apply_events()
                    if self.quit:
                        break
                    req, self.request = self.request, None
                    if self.want != "run":
                        if self.state not in HALTED:
                            self.state = "stopped"
                            self.detail = "stopped by command" if self.starts else "not started"
                        self.cv.notify_all()
                if self.want != "run":
                    self._flush("the engine is stopped")
                    self._wait_for(lambda: self.quit or self.want == "run" or self.request is not None, 5.0)
                    continue
                with self.cv:
                    if req is not None:
                        kind, arg = req
                        self.delay, self.next_start_at = 0.0, None
                        if kind == "lane":
                            self.lane = arg
                            self.next_reason = "lane" if self.starts else None
                        else:
                            self.next_reason = ("link" if kind == "link" else "manual") if self.starts else None
                if req is not None and req[0] == "lane":
                    self._write_state()
                if not self._backoff():
                    continue
                self._flush_leftovers()
                if not self._gates():
                    continue
                self._spawn()
                self._supervise()
        except Exception:  # noqa: BLE001 - log loudly; the guard itself keeps running
            log.exception("engine supervisor failed; the guard keeps running without it")
            self._set("failed", "supervisor error (see the daemon's log)")
        finally:
            if self.keep_engine and self._may_hand_over():
                self._hand_over()           # (an engine already being stopped is stopped: below)
            else:
                if self.run is not None and self.run.exit is None:
                    self._terminate("shutdown")
                    self._await_exit(self.run.deadline.before_cleanup(self.cfg.guard.grace + 10)
                                     if self.run.deadline is not None else self.cfg.guard.grace + 10)
                if self.run is not None:
                    self._after_run()
            self._flush("daemon stopping")

    def _spawn(self) -> None:
        e = self.ecfg
        argv, env = lanes.command(self.cfg, self.lane)
        digest = adopt.command_digest(argv, e, self.lane)
        reason = self.next_reason
        wall = time.time()
        cg = cgroups.EngineCgroup.create(self.placement, round(wall, 3)) if self.placement else None
        fifos, child_fds, streams = self._make_fifos(f"{wall:.3f}")
        try:
            argv, launch = container.for_engine(argv, env, e, self.cfg.guard.grace)
            proc = process.spawn(argv, env, e.cwd, e.user, cgroup=cg, out=child_fds or None)
        except (OSError, ValueError) as ex:
            for r in streams.values():
                r.close()
            output.remove_fifos(fifos)
            if cg is not None:
                cg.remove()
            log.error("engine: cannot start %s: %s", argv, ex)
            with self.cv:
                self.last_exit = {"code": None, "signal": None, "at": time.time(), "uptime": 0.0,
                                  "reason": "exit", "detail": f"cannot start: {ex}"}
                if self.give_up.record(time.monotonic(), True, False, "exit"):
                    self._given_up(self.last_exit)
                else:
                    self._schedule_restart("exit", failure=True, uptime=0.0)
            return
        finally:
            for fd in child_fds.values():       # the engine holds its own copies now
                os.close(fd)
        role = cluster.role_of(argv)
        if cg is not None and not cg.entered:
            cg.remove()
            cg = None
        run = Run(proc, self.lane, argv, reason, e.log_lines, role, wall_spawn=wall)
        run.launch = launch
        run.cgroup = cg
        run.digest = digest
        run.fifos, run.streams = fifos, streams
        run.fifo_ids = {k: output.fifo_identity(v.fileno()) for k, v in streams.items()}
        if role.role == "head":
            run.group = {v.node_rank: v.run for v in self.start_views if cluster.waiting_for_head(v)}
        p = proctree.read_proc(run.pid)
        run.starttime = p.starttime if p else 0
        if p:
            run.members[run.pid] = p.starttime
        with self.cv:
            self.run = run
            self.starts += 1
            if reason:
                self.restarts[reason] = self.restarts.get(reason, 0) + 1
            self.next_reason = None
            if role.role == "headless" and e.peers:
                self.state, self.detail = "waiting_for_head", "not yet in the head's group"
            else:
                self.state = "starting"
                self.detail = f"waiting for {e.health_url} to answer 200" if e.health_url else ""
            self._history("start", f"pid {run.pid}" + (f" lane {run.lane}" if run.lane else "")
                          + (f" (restart: {reason})" if reason else "")
                          + f", tracked by {cgroups.describe(self.placement, cg, run=True)}: " + " ".join(argv)[:300])
            self.cv.notify_all()
        self._write_state()
        try:
            avail = format_size(read_mem_available())
        except (OSError, ValueError):
            avail = "?"
        gt = self.gate_timeout
        timed_out = (f" (the {gt['gate']} gate timed out after engine.quiesce_timeout "
                     f"{e.quiesce_timeout:g} s, started anyway: {gt['detail']})") if gt else ""
        self._flush("", restart_detail=(
            f"engine restarted (pid {run.pid}{', lane ' + run.lane if run.lane else ''}) after a quiesce wait of "
            f"{self.quiesce_wait or 0:.1f} s{timed_out}; MemAvailable {avail}{self._gates_note()}"), pids=[run.pid],
            views=self.start_views)
        run.start_thread("sg-engine-exit", self._watch_exit)
        run.start_thread("sg-engine-out", self._pump)
        run.start_thread("sg-engine-mon", health.monitor, lambda: self.ecfg, SupervisorMonitorHooks(self))
        if launch is not None:
            run.start_thread("sg-engine-ctr", self._find_container)

    def _find_container(self, run: Run) -> None:
        """(The run's ``sg-engine-ctr`` thread.) Learn the container of a ``docker|podman run``
        engine (:func:`container.discover`) and hand it to the supervisor thread: from then on the
        container's processes are in the run's tree."""
        ctr = container.discover(run.launch, run.done)
        if ctr is None:
            return

        def found() -> None:
            run.container = ctr
            self._history("container", f"{ctr.label()}: init pid {ctr.pid}, cgroup {ctr.cgroup or '(not found)'}")
            process.refresh_members(run)
            self._write_state()
        self._post(found)

    def _supervise(self) -> None:
        """Wait for the run to end; stop it on a command, a verdict or shutdown."""
        run = self.run
        while True:
            self._wait_for(lambda: run.exit is not None or run.verdict is not None or self._interrupted())
            with self.cv:
                if run.exit is not None:
                    break
                if self.quit and self.keep_engine:
                    return                      # the daemon exits keeping the engine (_hand_over)
                if self.quit:
                    why = "shutdown"
                elif self.want != "run":
                    why = "stop"
                elif self.request is not None:
                    why = self.request[0]
                    if why == "restart":
                        why = "manual"
                else:
                    why = run.verdict
            if run.guard_hit and why != "shutdown" and run.term_reason is None:
                # the memory guard is already escalating on this run (SIGTERM, grace, SIGKILL): one
                # owner per escalation, or the engine gets a second SIGTERM and a second grace clock
                # (uvicorn force-exits on a second signal); the command or verdict applies after exit
                if not self._await_exit(1.0):
                    continue
            elif run.term_reason is None:
                if why == "wedged" and self.cfg.guard.dry_run:
                    self._wedged_dry_run(run)
                    continue
                if why == run.verdict and why in SUMMARY and run.incident is None:
                    run.incident = self._open_incident(run, why, run.verdict_detail)   # before the SIGTERM
                self._terminate(why)
            elif not self._await_exit(1.0):
                continue
        self._after_run()

    def _await_exit(self, timeout: float) -> bool:
        """(Supervisor thread.) Wait up to ``timeout`` seconds for the run's exit; True once it exited."""
        run = self.run
        return self._wait_for(lambda: run.exit is not None, timeout)

    def _terminate(self, why: str) -> None:
        """SIGTERM the root, wait ``guard.grace`` for it to exit, then SIGKILL the whole tree: one
        escalation (:mod:`sparkguard.guard.escalation`).  When the guard is already stopping the
        same tree this joins it: no second SIGTERM, the rest of the guard's grace."""
        run = self.run
        run.term_reason = why
        grace = self.cfg.guard.grace
        self._set("stopping", f"{why}: SIGTERM pid {run.pid}, SIGKILL after {grace:g} s")
        inc = run.incident

        def note(event: str, esc: escalation.Escalation, killed: list[int]) -> None:
            if run.deadline is None:        # the one stop deadline, from the first SIGTERM (stopbudget)
                run.deadline = stopbudget.Deadline(esc.grace, t0=esc.t_term)
            if event == "joined":
                self._history("sigterm", f"{why}: pid {run.pid} is already being stopped ({esc.reason}): "
                                         "no second SIGTERM")
            elif event == "sigterm":
                to = f" (to its container's init, pid {esc.tree.term})" if esc.tree.term is not None else ""
                self._history("sigterm", f"{why}: SIGTERM pid {run.pid}{to}" + ("" if esc.sent else " (already gone)"))
                if inc is not None:
                    self.reports.event(inc, "sigterm", f"SIGTERM the wedged engine (pid {run.pid})" if inc.kind == "wedged"
                                       else f"SIGTERM the engine (pid {run.pid}): {why}", [run.pid])
            else:
                self._history("sigkill", f"{why}: pid {run.pid} still alive {esc.grace:g} s after SIGTERM; "
                                         f"SIGKILL {len(killed)} processes")
                if inc is not None:
                    self.reports.event(inc, "sigkill", f"SIGKILL {len(killed)} processes {esc.grace:g} s after "
                                       "SIGTERM", killed)
        escalation.OWNER.stop(process.signal_tree(run), why, grace, self._await_exit,
                              proctree.Protector(self.cfg.targets.protect), note=note)

    def _after_run(self) -> None:
        """The root exited: record it, sweep leftovers, reap, decide about the restart."""
        run = self.run
        run.done.set()
        self._set("sweeping", f"pid {run.pid} exited; sweeping what is left of its tree")
        if run.launch is not None:
            process.refresh_members(run)    # the container's processes, also when its client died
        if run.deadline is None:            # it ended on its own: the sweep's SIGTERM is its first
            run.deadline = stopbudget.Deadline(self.cfg.guard.grace)
        dl = run.deadline
        swept = self._sweep(run.pgid, run.members, exclude=run.pid, group_ok=self._group_ok(run),
                            cgroup=run.cgroup, deadline=dl)
        ctr_detail = container.finish(run.launch, run.container, dl) if run.launch is not None else ""
        try:
            run.proc.wait(timeout=dl.step(5))   # reap the root only now: its pgid stayed reserved meanwhile
        except Exception:  # noqa: BLE001
            pass
        self._remove_cgroup(run)
        for t in run.threads:
            if t is not threading.current_thread():
                t.join(min(2.0, dl.left()))
        for stream in (run.proc.stdout, run.proc.stderr, *run.streams.values()):
            try:
                stream.close()
            except (OSError, AttributeError):
                pass
        output.remove_fifos(run.fifos)
        code = run.exit[0] if run.exit is not None else None
        counts = True
        if run.role.role == "headless" and self.ecfg.peers:
            if code == 0 and run.term_reason is None and not run.guard_hit:
                run.head_at_exit = self._head_at_exit(run)
            counts = run.joined is not None or bool(run.head_watch.exposed)
        reason, failure = classify_exit(code, run.term_reason, run.guard_hit, run.headless_at_exit(), run.load_hit)
        rec = dict(run.exit_record() or run.exit_record((None, None), run.t_exit))
        if swept:
            rec["detail"] += f"; swept {len(swept)} leftover processes"
        if ctr_detail:
            rec["detail"] += f"; {ctr_detail}"
        if run.adopted:
            rec["detail"] += "; adopted from a previous sparkguard: not its child, exit status unknown"
        rec["reason"] = reason or run.term_reason
        with self.cv:
            if reason == LOAD:
                self.failed_loads += 1
            run.exit_info = rec
            self.last_exit = rec
            self._history("exit", f"pid {run.pid} {rec['detail']}")
            self.last_run, self.run = run, None
            if reason is None:
                self.state = "stopped"
                self.detail = "stopped by command" if run.term_reason == "stop" else "the daemon is stopping"
            elif reason in COMMANDED:
                self.next_reason = reason
                self.delay = 0.0
            elif self.give_up.record(time.monotonic(), failure, run.ever_ready, reason, counts):
                self._given_up(rec)
            else:
                self._schedule_restart(reason, failure, rec["uptime"])
            restarting = self.want == "run" and not self.quit and self.state not in HALTED + ("stopped",)
            self.cv.notify_all()
        if self.state == "given_up":
            given = self.reports.open("given_up", self.cfg, None, "given_up", self.detail,
                                      self._engine_info(run, rec), [run.pid], SUMMARY["given_up"] + self.detail)
            self.reports.close_engine(given, self._engine_info(run, rec), SUMMARY["given_up"] + self.detail, False)
            self.reports.finish(given)
        inc = run.incident
        if inc is None and reason in ("exit", "head") and not run.guard_hit:
            # the run ended by itself (a rank death; a headless rank whose head went away): the
            # verdicts' runs and the guard's have their incidents already
            kind = reason
            engine = self._engine_info(run, rec)
            if kind == "head":      # exited 0 by itself: its head went away (what the head's sparkguard said last)
                head = cluster.find_head(self.node_views)
                engine["cause"] = {"reason": "head", "node": head.as_dict() if head else None, "was": run.joined}
            detail = rec["detail"]
            run.incident = inc = self.reports.open(kind, self.cfg, None, "exited", f"engine pid {run.pid}: {detail}",
                                                   engine, [run.pid], SUMMARY[kind] + detail)
            summary = SUMMARY[kind] + detail
        elif inc is not None:
            self.reports.event(inc, "exited", f"engine pid {run.pid}: {rec['detail']}", [run.pid])
            summary = SUMMARY[inc.kind] + run.verdict_detail
        if inc is not None:
            self.reports.close_engine(inc, self._engine_info(run, rec), summary, restarting)
            if restarting:     # reported now, and again once the restart happened (else once, below)
                self.reports.finish(inc)
            self.reports.track(inc)
        self._write_state()
        if not restarting:
            self._flush("the engine is not restarted" if not self.quit else "daemon stopping")

    def _head_at_exit(self, run: Run) -> str:
        """(Supervisor thread.) A headless rank exited 0 by itself: read the head now.  ``"there"``
        when the head still runs the run this rank was in and is not stopping it (so this rank
        died on its own), else ``"gone"`` (also when the head cannot be read: vLLM's headless node exits 0 when its head
        dies, and a rank that cannot tell is given that benefit)."""
        views = nodes.read_all(self.ecfg.peers, min(3.0, max(0.5, self.ecfg.health_interval)))
        with self.cv:
            self.node_views = views
        head = cluster.find_head(views)
        if (run.joined is not None and head is not None and head.wanted and head.run == run.joined
                and head.state not in ("stopping", "sweeping")):
            return "there"
        return "gone"

    # ---- sweeping ------------------------------------------------------------------------------

    def _flush_leftovers(self) -> None:
        """Before a start: sweep anything of the previous run still alive (belt and braces: the
        normal path swept right after the exit)."""
        prev = self.last_run
        if prev is not None:
            self._set("sweeping", "checking for leftovers of the previous run")
            self._sweep(prev.pgid, prev.members, group_ok=False, cgroup=prev.cgroup)
            self._remove_cgroup(prev)

    def _remove_cgroup(self, run: Run) -> None:
        """The run's cgroup, once empty (``populated 0``, awaited up to 2 s), is removed; one that
        cannot be (still populated: a D-state process) is kept for the sweep before the next start."""
        cg = run.cgroup
        if cg is None:
            return
        if not (cg.wait_empty(2.0) and cg.remove()):
            self._history("sweep", f"cgroup {cg.path} is not empty yet; kept for the next sweep")

    def _sweep_previous(self) -> None:
        """At daemon start: stop what a previous daemon's engine left behind (same boot only).

        Its process group counts only while a recorded member is still alive (then the group
        never emptied, so its id cannot have been reused)."""
        prev = lanes.previous_engine(self.previous_state, sysinfo.boot_id())
        if prev is None:
            return
        pgid, members = prev
        live = process.leftovers(None, members)
        if live:
            # a member may have left the group (setsid, as Ray does): then the group id could have
            # been reused by a stranger; trust it only while a live member is still in it
            in_group = any((p := proctree.read_proc(pid)) is not None and p.pgrp == pgid for pid in live)
            self._set("sweeping", "stopping the engine a previous sparkguard left running")
            found = self._sweep(pgid, members, group_ok=in_group)
            log.warning("engine: stopped %d processes left by a previous sparkguard (pgid %d)", len(found), pgid)

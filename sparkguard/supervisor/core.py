"""The Supervisor: one thread that starts the engine, watches it and restarts it.

It ties the pieces together (see the package doc for one start in order): the gates
(:mod:`.gates`), the process and its tree (:mod:`.process`), output (:mod:`.output`), health
(:mod:`.health`), restart policy (:mod:`.restart`), lanes and the state file (:mod:`.lanes`) and
incident reports (:mod:`.reports`).  The guard's poll loop only calls the cheap, non-blocking
hooks (:meth:`Supervisor.target`, :meth:`Supervisor.on_guard_event`, :meth:`Supervisor.take_incident`);
control requests arrive on the control socket's threads (:meth:`Supervisor.handle`).

This module holds the state (``__init__``, who writes what), the public API and the guard's
hooks, and the supervisor thread's main loop (:meth:`Supervisor._main`).  The class's other parts,
one concern each, are its base classes: the mailbox and the other threads' hooks (:mod:`.api`),
the status views and state file (:mod:`.state`), the per-run threads (:mod:`.runthreads`), the
wait between runs (:mod:`.schedule`), adoption (:mod:`.adoptrun`), the start of a run
(:mod:`.spawn`), its supervision and stop (:mod:`.stopping`) and what follows its exit
(:mod:`.afterrun`).

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
import threading
import time
from typing import Callable

from sparkguard import control
from sparkguard.supervisor import cgroup as cgroups
from sparkguard.supervisor import adopt, cluster, lanes, output, process, reports, stopbudget, tracking
from sparkguard.supervisor.adoptrun import Adoption
from sparkguard.supervisor.afterrun import AfterRun
from sparkguard.supervisor.api import EVENTS_MAX, ControlApi
from sparkguard.supervisor.restart import REASONS, Backoff, GiveUp, restarts
from sparkguard.supervisor.run import Run
from sparkguard.supervisor.runthreads import RunThreads
from sparkguard.supervisor.schedule import BetweenRuns
from sparkguard.supervisor.spawn import Spawning
from sparkguard.supervisor.state import HALTED, StatusViews
from sparkguard.supervisor.stopping import Stopping

log = logging.getLogger("sparkguard.supervisor")

HISTORY = 50             # status history entries kept
STALE_CGROUP_AGE = 60.0  # seconds: an empty engine-<run id> cgroup older than this at start is removed


class Supervisor(ControlApi, StatusViews, RunThreads, BetweenRuns, Adoption, Spawning, Stopping, AfterRun):
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
            procs: a ``proctree.scan()``; protector: ``enginetree.Protector``.
            details: read the tree rows and memory now; False leaves them to
                ``enginetree.add_details`` (the guard signals first).
        Returns:
            ``enginetree.Target`` (pattern ``"engine:supervised"``) or None when no engine runs.
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

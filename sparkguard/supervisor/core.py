"""The Supervisor: one thread that starts the engine, watches it and restarts it.

It ties the pieces together (see the package doc for one start in order): the gates
(:mod:`.gates`), the process and its tree (:mod:`.process`), output (:mod:`.output`), health
(:mod:`.health`), restart policy (:mod:`.restart`), lanes and the state file (:mod:`.lanes`) and
incident reports (:mod:`.reports`).  The guard's poll loop only calls the cheap, non-blocking
hooks (:meth:`Supervisor.target`, :meth:`Supervisor.on_guard_event`, :meth:`Supervisor.take_incident`);
control requests arrive on the control socket's threads (:meth:`Supervisor.handle`).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Callable

from sparkguard import proctree, sysinfo
from sparkguard.guard import escalation
from sparkguard.supervisor import health, lanes, output, process, reports
from sparkguard.supervisor.gates import StartGates, read_mem_available
from sparkguard.supervisor.restart import COMMANDED, REASONS, Backoff, classify_exit, restarts
from sparkguard.supervisor.run import Run

log = logging.getLogger("sparkguard.supervisor")

#: supervisor states (``status()["state"]``)
STATES = ("stopped", "backoff", "sweeping", "waiting", "starting", "ready", "stopping", "exited", "failed")
HISTORY = 50             # status history entries kept


class Supervisor:
    """Starts, watches and restarts one engine.

    Args:
        cfg: ``config.Config`` (``engine`` must be enabled; ``guard.grace`` is the TERM->KILL time).
        reporter: object with ``event(incident, event)`` / ``finish(incident)`` (TEAM.md), or None.
        count_incident: ``(kind: str, wall: float) -> None`` called when the supervisor opens an
            incident of its own (``"wedged"``), so the daemon's incident counters include it.
        start_control: serve the control socket (``engine.control_socket``).
    Raises (from :meth:`start`):
        OSError: the control socket cannot be created (another daemon owns it, no permission).
    """

    def __init__(self, cfg, reporter=None, count_incident: Callable[[str, float], None] | None = None,
                 start_control: bool = True):
        self.cfg = cfg
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
        self.exits = 0
        self.backoff = Backoff(self.ecfg.backoff_initial, self.ecfg.backoff_max, self.ecfg.stable_after)
        self.delay = 0.0
        self.next_start_at: float | None = None
        self.next_reason: str | None = None
        self.time_to_ready: float | None = None
        self.quiesce_wait: float | None = None
        self.quiesce_timed_out = False
        self.gate_timeout: dict | None = None   # {"gate": "quiesce"|"peers", "detail": str} of the last start
        self.last_exit: dict | None = None
        self.history: collections.deque[dict] = collections.deque(maxlen=HISTORY)
        self._state_lock = threading.Lock()
        self.hits: dict[str, Run] = {}        # guard incident id -> the run the guard signalled in it
        self.incident_open = False
        self.link_down = False
        self.peer_states: list[dict] = []
        self.previous_state: dict = {}
        self.thread: threading.Thread | None = None
        self.control = None
        self.sink = output.LogSink(self.ecfg.log, self.ecfg.journal_socket,
                                   self.ecfg.identifier or output.identifier_for(self.ecfg.command))

    # ---- public API (any thread) ------------------------------------------------------------

    def start(self) -> None:
        """Open the control socket and start the supervisor thread (which starts the engine).

        Raises:
            OSError: the control socket cannot be served (another daemon, permissions).
        """
        if self.start_control:
            from sparkguard import control
            self.control = control.ControlServer(self.ecfg.control_socket, self.handle)
            self.control.start()
        self.previous_state = lanes.read_state(self.ecfg.state_file)
        self.thread = threading.Thread(target=self._main, name="sg-supervisor", daemon=True)
        self.thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Stop the engine (SIGTERM, ``guard.grace``, SIGKILL of the tree and leftovers), flush
        pending incident reports, close the control socket.  Blocks up to ``timeout`` seconds
        (default grace * 2 + 10)."""
        if self.control is not None:
            self.control.stop()
        with self.cv:
            self.quit = True
            self.cv.notify_all()
        if self.thread is not None:
            self.thread.join(timeout if timeout is not None else self.cfg.guard.grace * 2 + 10)
        self._flush("daemon stopping")
        self.sink.close()

    def reload(self, cfg) -> None:
        """New configuration (SIGHUP): gates, health, probe, restart policy take effect now or at the
        next start; the command, env and lanes' args at the next start.  A changed ``engine.lane``
        switches lanes now, as ``sparkguard engine lane`` does (a stopped engine starts in it when
        next started); so does a current lane that ``engine.lanes`` no longer has.  The state file
        is written by the supervisor thread once it switched; until then it still names the old
        ``config_lane``, so a daemon restart meanwhile also starts in the new ``engine.lane``
        (:func:`lanes.initial_lane`).  The control socket path needs a daemon restart."""
        with self.cv:
            if cfg.engine.control_socket != self.ecfg.control_socket:
                log.warning("engine.control_socket changed to %s: takes effect after a restart",
                            cfg.engine.control_socket)
            old_cfg_lane = lanes.config_lane(self.ecfg)
            self.cfg, self.ecfg = cfg, cfg.engine
            self.backoff.initial, self.backoff.maximum = cfg.engine.backoff_initial, cfg.engine.backoff_max
            self.backoff.stable_after = cfg.engine.stable_after
            new_cfg_lane = lanes.config_lane(cfg.engine)
            why = None
            if new_cfg_lane != old_cfg_lane and new_cfg_lane != self.lane:
                why = f"engine.lane changed from {old_cfg_lane} to {new_cfg_lane} in {cfg.path}"
            elif self.lane is not None and self.lane not in cfg.engine.lanes:
                why = f"lane {self.lane} is not in engine.lanes of {cfg.path} any more"
            if why is not None:
                self._switch_lane(new_cfg_lane, why)
            self.cv.notify_all()

    def _switch_lane(self, lane: str | None, why: str) -> None:
        """(Under ``cv``.) Run in ``lane`` from now on: a running (or starting) engine is restarted
        in it (reason ``lane``); a stopped one starts in it when next started."""
        if self.want == "run" and not self.quit and lane is not None:
            self.request = ("lane", lane)
            self.backoff.reset()
            self._history("lane", f"{why}: switching to lane {lane} (restart)")
        else:
            self.lane = lane
            self._history("lane", f"{why}: lane {lane} from the next start")

    def engine_pid(self) -> int | None:
        """PID of the running engine's root (None when none runs)."""
        run = self.run
        return run.pid if run is not None and run.exit is None else None

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
            self.incident_open = True
        elif ev in ("sigterm", "sigkill") and run is not None:
            pids = set(event.get("pids") or ())
            if run.pid in pids or pids & set(dict(run.members)):
                run.guard_hit = True
                if incident.get("id"):
                    self.hits[incident["id"]] = run
                self._history("guard", f"the memory guard sent {ev.upper()} to pid {run.pid} "
                                       f"(incident {incident.get('id')})")
        self._poke()

    def _poke(self) -> None:
        """Wake the supervisor without ever blocking the caller (the poll loop): a missed wake-up
        is caught by the supervisor's bounded waits."""
        if self.cv.acquire(timeout=0.005):
            try:
                self.cv.notify_all()
            finally:
                self.cv.release()

    def link_event(self, down: bool, detail: str) -> None:
        """The TP link watch declared a link incident (``down``) or its end (``link.mark_unhealthy``).

        While a link is down the engine (NCCL hangs inside a collective) is marked unhealthy and no
        new start happens; once the link is back the engine is restarted (reason ``link``) so its
        ranks meet again.  Never blocks.
        """
        if down:
            self.link_down = True
            run = self.run
            if run is not None:
                run.link_hit = True
            self._history("link", f"TP link down ({detail}): engine marked unhealthy; restart once it is back")
        else:
            self.link_down = False
            run = self.run
            if run is not None and run.link_hit and self.request is None and self.want == "run":
                self.request = ("link", None)
            self._history("link", f"TP link back ({detail})")
        self._poke()

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
        self.incident_open = False
        self._poke()
        return True

    def command(self, op: str, lane: str | None = None) -> dict:
        """Control: ``start``, ``stop``, ``restart``, ``lane`` (with ``lane``).

        Returns:
            ``{"ok": bool, "error": str?, "starts": int, "status": dict}``; ``starts`` is the
            spawn count before the command (wait for ``starts`` > it, then ready).
        """
        with self.cv:
            starts = self.starts
            if op == "start":
                if self.want == "run" and self.state not in ("exited", "failed"):
                    return {"ok": True, "starts": starts, "note": "already running", "status": self._status()}
                self.want = "run"
                self.backoff.reset()
                self.delay = 0.0
                self.next_reason = None
                self._history("command", "start")
            elif op == "stop":
                self.want = "stop"
                self.request = None
                self._history("command", "stop")
            elif op == "restart":
                self.want = "run"
                self.backoff.reset()
                self.request = ("restart", None)
                self._history("command", "restart")
            elif op == "lane":
                if not self.ecfg.lanes:
                    return {"ok": False, "error": "no engine.lanes configured"}
                if lane not in self.ecfg.lanes:
                    return {"ok": False, "error": f"no lane {lane!r}; engine.lanes has " + ", ".join(self.ecfg.lanes)}
                self.want = "run"
                self.backoff.reset()
                self.request = ("lane", lane)
                self._history("command", f"lane {lane}")
            else:
                return {"ok": False, "error": f"unknown command {op!r}"}
            self.cv.notify_all()
            return {"ok": True, "starts": starts, "status": self._status()}

    def wait(self, until: str, after: int = 0, timeout: float = 60.0, lane: str | None = None) -> dict:
        """Block until a condition (control ``wait``; bounded by ``timeout`` seconds).

        Args:
            until: ``"ready"`` (a start after the ``after``-th is ready, in ``lane`` if given),
                ``"stopped"``, or ``"starts"`` (spawn count > ``after``).
        Returns:
            ``{"ok": bool, "error": str?, "status": dict}``; ``ok`` False on timeout or when the
            engine gave up (stopped, exited, failed, or crashed into backoff) instead.
        """
        deadline = time.monotonic() + timeout

        def done() -> str | None:
            if self.quit:
                return "the daemon is stopping"
            if until == "stopped":
                return "" if self.state in ("stopped", "exited", "failed") else None
            if until == "starts":
                return "" if self.starts > after else None
            run = self.run
            if self.starts > after and run is not None and run.ready and (lane is None or run.lane == lane):
                return ""
            if self.starts > after and self.state in ("backoff", "exited", "failed", "stopped"):
                le = self.last_exit or {}
                return f"the engine did not become ready: {self.state} ({le.get('detail', self.detail)})"
            if self.want == "stop" and self.state == "stopped":
                return "the engine was stopped"
            return None

        with self.cv:
            while True:
                r = done()
                if r is not None:
                    return {"ok": r == "", **({"error": r} if r else {}), "status": self._status()}
                left = deadline - time.monotonic()
                if left <= 0:
                    return {"ok": False, "error": f"timed out after {timeout:g} s ({self.state}: {self.detail})",
                            "status": self._status()}
                self.cv.wait(left)

    def handle(self, req: dict) -> dict:
        """Control-socket request -> response (see :mod:`sparkguard.control` for the protocol)."""
        op = req.get("op")
        if op == "status":
            with self.cv:
                return {"ok": True, "status": self._status()}
        if op in ("start", "stop", "restart", "lane"):
            return self.command(op, req.get("lane"))
        if op == "wait":
            try:
                timeout = float(req.get("timeout", 60))
                after = int(req.get("after", 0))
            except (TypeError, ValueError):
                return {"ok": False, "error": "bad wait arguments"}
            return self.wait(str(req.get("until", "ready")), after, min(max(timeout, 0.0), 86400.0), req.get("lane"))
        return {"ok": False, "error": f"unknown op {op!r}; expected status, start, stop, restart, lane, wait"}

    def status(self) -> dict:
        """JSON-ready engine state (see :func:`sparkguard.supervisor.describe`); cheap, any thread."""
        with self.cv:
            return self._status()

    def _status(self) -> dict:
        run = self.run
        now_m, now_w = time.monotonic(), time.time()
        st = {
            "state": self.state, "detail": self.detail, "want": self.want,
            "pid": run.pid if run and run.exit is None else None,
            "lane": self.lane, "lanes": list(self.ecfg.lanes),
            "command": list(self.ecfg.command or ()) + (list(self.ecfg.lanes[self.lane].args) if self.lane else []),
            "up": bool(run and run.exit is None), "ready": bool(run and run.ready and run.exit is None),
            "started_at": run.wall_spawn if run else None,
            "uptime": (now_m - run.t_spawn) if run and run.exit is None else None,
            "time_to_ready": self.time_to_ready, "quiesce_wait": self.quiesce_wait,
            "quiesce_timed_out": self.quiesce_timed_out, "gate_timeout": self.gate_timeout,
            "starts": self.starts, "ready_count": self.ready_count, "restarts": dict(self.restarts),
            "backoff": self.delay, "consecutive_failures": self.backoff.failures,
            "next_start_at": (now_w + self.next_start_at - now_m) if self.next_start_at else None,
            "restart_policy": self.ecfg.restart, "last_exit": self.last_exit,
            "probe_failures": run.probe_failures if run else 0,
            "peers": list(self.peer_states), "history": list(self.history),
            "control_socket": self.ecfg.control_socket,
        }
        return st

    def collector(self):
        """A prometheus_client collector of the engine metrics (see :class:`EngineCollector`)."""
        from sparkguard.supervisor.collector import EngineCollector
        return EngineCollector(self)

    # ---- helpers --------------------------------------------------------------------------

    def _history(self, event: str, detail: str) -> None:
        self.history.append({"at": time.time(), "mono": time.monotonic(), "event": event, "detail": detail})
        log.info("engine: %s: %s", event, detail)

    def _set(self, state: str, detail: str = "") -> None:
        with self.cv:
            self.state, self.detail = state, detail
            self.cv.notify_all()

    def _interrupted(self) -> bool:
        return self.quit or self.want != "run" or self.request is not None

    def _wait(self, seconds: float, pred: Callable[[], bool] | None = None) -> bool:
        """Wait up to ``seconds`` on the condition; True if ``pred`` (default: interrupted) became true."""
        pred = pred or self._interrupted
        with self.cv:
            return self.cv.wait_for(pred, timeout=max(0.0, seconds))

    @staticmethod
    def _exit_of(run: Run) -> dict | None:
        """``run``'s exit record (:meth:`Run.exit_record`); when the exit watcher has not recorded it
        yet, the root's status is read without waiting (``waitid`` WNOHANG|WNOWAIT: not reaped)."""
        rec = run.exit_record()
        if rec is None:
            ex = process.poll_exit(run.pid)
            if ex is not None:
                rec = run.exit_record(ex, time.monotonic())
        return rec

    def _engine_info(self, run: Run | None, exit_: dict | None = None) -> dict:
        """The engine part of an incident report: the state now and ``run``'s own pid, lane,
        command, exit (``exit_``, :meth:`_exit_of`), last output lines; the restart counters now."""
        state, detail = self.state, self.detail
        if run is not None and exit_ is not None and self.run is run and state in ("starting", "ready", "stopping"):
            state, detail = "sweeping", f"pid {run.pid} exited; sweeping what is left of its tree"
        return {"state": state, "detail": detail, "lane": run.lane if run else self.lane,
                "pid": run.pid if run else None, "command": run.argv if run else None, "exit": exit_,
                "restarts": dict(self.restarts),
                "last_lines": run.lines.current()[-self.ecfg.log_lines:] if run else []}

    def _flush(self, why: str, restart_detail: str | None = None, pids: list[int] | None = None) -> None:
        """Resolve the incidents waiting for a restart (:meth:`reports.EngineIncidents.flush`)."""
        with self.cv:
            now = {"state": self.state, "pid": self.run.pid if self.run is not None else None, "lane": self.lane,
                   "restarts": dict(self.restarts)}
        self.reports.flush(now, why, restart_detail, pids)

    def _write_state(self) -> None:
        """Persist the lane (a lane switch asked for and not yet done counts: a daemon restart
        meanwhile starts in it) and the running engine; one writer at a time (the supervisor and
        monitor threads both write, through the same temp file)."""
        with self._state_lock:
            req = self.request
            lane = req[1] if req is not None and req[0] == "lane" else self.lane
            lanes.write_state(self.ecfg, lane, self.run)

    def _sweep(self, pgid: int | None, members: dict[int, int], exclude: int | None = None,
               group_ok: bool = True) -> list[int]:
        return process.sweep(pgid, members, self.cfg.guard.grace, self.cfg.targets.protect, self._history,
                             exclude=exclude, group_ok=group_ok)

    # ---- the supervisor thread --------------------------------------------------------------

    def _main(self) -> None:
        try:
            self._sweep_previous()
            while True:
                with self.cv:
                    if self.quit:
                        break
                    req, self.request = self.request, None
                    if self.want != "run":
                        if self.state not in ("exited", "failed"):
                            self.state = "stopped"
                            self.detail = "stopped by command" if self.starts else "not started"
                        self.cv.notify_all()
                if self.want != "run":
                    self._flush("the engine is stopped")
                    with self.cv:
                        self.cv.wait_for(lambda: self.quit or self.want == "run" or self.request is not None, 5.0)
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
            if self.run is not None and self.run.exit is None:
                self._terminate("shutdown")
                self._await_exit(self.cfg.guard.grace + 10)
            if self.run is not None:
                self._after_run()
            self._flush("daemon stopping")

    def _backoff(self) -> bool:
        from sparkguard.units import format_duration
        if self.delay <= 0:
            return True
        deadline = time.monotonic() + self.delay
        with self.cv:
            self.next_start_at = deadline
            le = self.last_exit or {}
            self.state = "backoff"
            n = self.backoff.failures
            self.detail = (f"restarting in {format_duration(self.delay)}"
                           + (f" ({n} restarts in a row)" if n > 1 else "")
                           + f"; last run: {le.get('detail', 'exited')}")
            self.cv.notify_all()
        interrupted = self._wait(self.delay)
        with self.cv:
            self.next_start_at = None
            if interrupted:
                return False
            self.delay = 0.0
        return True

    def _gates(self) -> bool:
        """Guard hold, drop caches, quiesce, peers.  False when interrupted (stop/lane/quit)."""
        r = StartGates(self.ecfg, _GateHooks(self)).run()
        if r is None:
            return False
        with self.cv:
            self.quiesce_wait, self.quiesce_timed_out = r.waited, bool(r.timed_out)
            self.gate_timeout = {"gate": r.timed_out, "detail": r.detail} if r.timed_out else None
        return True

    def _spawn(self) -> None:
        from sparkguard import proctree
        e = self.ecfg
        argv, env = lanes.command(self.cfg, self.lane)
        reason = self.next_reason
        try:
            proc = process.spawn(argv, env, e.cwd, e.user)
        except OSError as ex:
            log.error("engine: cannot start %s: %s", argv, ex)
            with self.cv:
                self.exits += 1
                self.last_exit = {"code": None, "signal": None, "at": time.time(), "uptime": 0.0,
                                  "reason": "exit", "detail": f"cannot start: {ex}"}
                self._schedule_restart("exit", failure=True, uptime=0.0)
            return
        run = Run(proc, self.lane, argv, reason, e.log_lines)
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
            self.state = "starting"
            self.detail = f"waiting for {e.health_url} to answer 200" if e.health_url else ""
            self._history("start", f"pid {run.pid}" + (f" lane {run.lane}" if run.lane else "")
                          + (f" (restart: {reason})" if reason else "") + ": " + " ".join(argv)[:300])
            self.cv.notify_all()
        self._write_state()
        from sparkguard.units import format_size
        try:
            avail = format_size(read_mem_available())
        except (OSError, ValueError):
            avail = "?"
        gt = self.gate_timeout
        timed_out = (f" (the {gt['gate']} gate timed out after engine.quiesce_timeout "
                     f"{e.quiesce_timeout:g} s, started anyway: {gt['detail']})") if gt else ""
        self._flush("", restart_detail=(
            f"engine restarted (pid {run.pid}{', lane ' + run.lane if run.lane else ''}) after a quiesce wait of "
            f"{self.quiesce_wait or 0:.1f} s{timed_out}; MemAvailable {avail}"), pids=[run.pid])
        run.start_thread("sg-engine-exit", self._watch_exit)
        run.start_thread("sg-engine-out", self._pump)
        run.start_thread("sg-engine-mon", health.monitor, lambda: self.ecfg, _MonitorHooks(self))

    def _supervise(self) -> None:
        """Wait for the run to end; stop it on a command, a verdict or shutdown."""
        run = self.run
        while True:
            with self.cv:
                self.cv.wait_for(lambda: run.exit is not None or run.verdict is not None or self._interrupted())
                if run.exit is not None:
                    break
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
                self._terminate(why)
            elif not self._await_exit(1.0):
                continue
        self._after_run()

    def _await_exit(self, timeout: float) -> bool:
        run = self.run
        with self.cv:
            return self.cv.wait_for(lambda: run.exit is not None, timeout=timeout)

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
            if event == "joined":
                self._history("sigterm", f"{why}: pid {run.pid} is already being stopped ({esc.reason}): "
                                         "no second SIGTERM")
            elif event == "sigterm":
                self._history("sigterm", f"{why}: SIGTERM pid {run.pid}" + ("" if esc.sent else " (already gone)"))
                if inc is not None:
                    self.reports.event(inc, "sigterm", f"SIGTERM the wedged engine (pid {run.pid})", [run.pid])
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
        swept = self._sweep(run.pgid, run.members, exclude=run.pid)
        try:
            run.proc.wait(timeout=5)   # reap the root only now: its pgid stayed reserved meanwhile
        except Exception:  # noqa: BLE001
            pass
        for t in run.threads:
            if t is not threading.current_thread():
                t.join(2.0)
        for stream in (run.proc.stdout, run.proc.stderr):
            try:
                stream.close()
            except (OSError, AttributeError):
                pass
        code = run.exit[0] if run.exit is not None else None
        reason, failure = classify_exit(code, run.term_reason, run.guard_hit)
        rec = dict(run.exit_record() or run.exit_record((None, None), run.t_exit))
        if swept:
            rec["detail"] += f"; swept {len(swept)} leftover processes"
        rec["reason"] = reason or run.term_reason
        with self.cv:
            run.exit_info = rec
            self.exits += 1
            self.last_exit = rec
            self._history("exit", f"pid {run.pid} {rec['detail']}")
            self.last_run, self.run = run, None
            if reason is None:
                self.state = "stopped"
                self.detail = "stopped by command" if run.term_reason == "stop" else "the daemon is stopping"
            elif reason in COMMANDED:
                self.next_reason = reason
                self.delay = 0.0
            else:
                self._schedule_restart(reason, failure, rec["uptime"])
            restarting = self.want == "run" and not self.quit and self.state not in ("exited", "failed", "stopped")
            self.cv.notify_all()
        inc = run.incident
        if inc is not None:
            self.reports.event(inc, "exited", f"engine pid {run.pid}: {rec['detail']}", [run.pid])
            self.reports.close_wedged(inc, self._engine_info(run, rec), run.verdict_detail, restarting)
            if restarting:     # reported now, and again once the restart happened (else once, below)
                self.reports.finish(inc)
            self.reports.track(inc)
        self._write_state()
        if not restarting:
            self._flush("the engine is not restarted" if not self.quit else "daemon stopping")

    def _schedule_restart(self, reason: str, failure: bool, uptime: float) -> None:
        """Decide (under ``cv``) whether and when to restart after an exit for ``reason``."""
        policy = self.ecfg.restart
        if not restarts(policy, failure):
            self.want = "stop"
            self.state = "exited" if not failure else "failed"
            self.detail = f"not restarted (engine.restart: {policy}): {self.last_exit and self.last_exit['detail']}"
            self._history("no_restart", self.detail)
            return
        self.delay = self.backoff.next(uptime)
        self.next_reason = reason
        if self.backoff.failures > 2:
            log.warning("engine: crash loop? %d restarts in a row; next in %g s", self.backoff.failures, self.delay)

    # ---- per-run threads ---------------------------------------------------------------------

    def _watch_exit(self, run: Run) -> None:
        """Record the root's exit status (not reaped: :func:`process.wait_exit`)."""
        code, sig = process.wait_exit(run.pid)
        with self.cv:
            run.exit = (code, sig)
            run.t_exit = time.monotonic()
            run.ready = False
            self.cv.notify_all()

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
            self._write_state()

    def _became_ready(self, run: Run) -> None:
        now = time.monotonic()
        with self.cv:
            if run.exit is not None:
                return
            run.ready = run.ever_ready = True
            run.t_ready = now
            self.time_to_ready = now - run.t_spawn
            self.ready_count += 1
            self.state, self.detail = "ready", ""
            self._history("ready", f"pid {run.pid} ready after {self.time_to_ready:.2f} s")
            self.cv.notify_all()

    def _health_changed(self, run: Run, ok: bool, url: str) -> None:
        with self.cv:
            run.ready = ok
            self.state = "ready" if ok else "starting"
            self.detail = "" if ok else f"{url} not answering 200"
            self.cv.notify_all()

    def _probed(self, run: Run, ok: bool) -> int:
        with self.cv:
            run.probe_failures = 0 if ok else run.probe_failures + 1
            return run.probe_failures

    def _verdict(self, run: Run, verdict: str, detail: str) -> None:
        if run.exit is not None or run.verdict is not None:
            return
        if verdict == "wedged" and not self.cfg.guard.dry_run:
            run.incident = self._open_wedged_incident(run, detail)   # before _supervise acts on it
        with self.cv:
            run.verdict, run.verdict_detail = verdict, detail
            self._history(verdict, detail)
            self.cv.notify_all()

    def _wedged_dry_run(self, run: Run) -> None:
        inc = self._open_wedged_incident(run, run.verdict_detail)
        self.reports.event(inc, "would_term", f"dry run: would SIGTERM the wedged engine (pid {run.pid})", [run.pid])
        self.reports.close_wedged_dry_run(inc, run.verdict_detail)
        self.reports.finish(inc)
        with self.cv:
            run.verdict, run.probe_failures = None, 0
        run.start_thread("sg-engine-mon", health.monitor, lambda: self.ecfg, _MonitorHooks(self))

    def _open_wedged_incident(self, run: Run, detail: str):
        """An incident of kind ``"wedged"`` (a ``model.Incident``, docs/incident.md)."""
        from sparkguard import proctree
        t = self.target(proctree.scan(), proctree.Protector(self.cfg.targets.protect))
        return self.reports.open_wedged(self.cfg, t, detail, self._engine_info(run), run.pid)

    # ---- sweeping ------------------------------------------------------------------------------

    def _flush_leftovers(self) -> None:
        """Before a start: sweep anything of the previous run still alive (belt and braces: the
        normal path swept right after the exit)."""
        prev = self.last_run
        if prev is not None:
            self._set("sweeping", "checking for leftovers of the previous run")
            self._sweep(prev.pgid, prev.members, group_ok=False)

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


class _GateHooks:
    """:class:`gates.GateHooks` on a :class:`Supervisor` (called from the supervisor thread)."""

    def __init__(self, sup: Supervisor):
        self.sup = sup
        self.interrupted, self.wait, self.note = sup._interrupted, sup._wait, sup._history

    def held(self) -> str | None:
        """Why starts are held: a guard incident is open, or the TP link is down."""
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


class _MonitorHooks:
    """:class:`health.MonitorHooks` on a :class:`Supervisor` (called from the monitor thread)."""

    def __init__(self, sup: Supervisor):
        self.refresh_members, self.became_ready = sup._refresh_members, sup._became_ready
        self.health_changed, self.probed, self.verdict = sup._health_changed, sup._probed, sup._verdict
        self.note = sup._history

"""The Supervisor's mailbox and the hooks of the other threads: reload, the link watch, the control socket.

:class:`ControlApi` is a part of :class:`sparkguard.supervisor.core.Supervisor` (its base
class).  Each hook posts an event, a function that changes the state, which the supervisor
thread applies under ``cv`` (:meth:`ControlApi._apply_events`); reads take ``cv``.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from sparkguard.supervisor import lanes
from sparkguard.supervisor.collector import EngineCollector
from sparkguard.supervisor.state import HALTED

log = logging.getLogger("sparkguard.supervisor")

#: events the mailbox holds at most; the oldest are dropped beyond (only a supervisor thread
#: that is dead or stuck lets that many pile up: a few events come per incident, command or run)
EVENTS_MAX = 1024
#: seconds the link watch and reload threads wait for their event to be applied (it is applied
#: later all the same, when the supervisor thread is busy longer)
HOOK_WAIT = 5.0
#: seconds a control command waits for the supervisor thread to take it; beyond, it stays queued
#: and is answered as accepted (:meth:`ControlApi.command`)
COMMAND_WAIT = 1.0
#: seconds the supervisor thread waits on ``cv`` at most before it looks at its mailbox again
#: (a wake-up the poll loop could not deliver because the lock was held is seen by then)
TICK = 0.5


class ControlApi:
    """The mailbox, reload, link events and the control requests of a :class:`Supervisor`."""

    def _owner(self) -> bool:
        """True on the supervisor thread, or when none runs (before :meth:`start`, after its end):
        then the caller may change the state itself, under ``cv``."""
        t = self.thread
        return t is None or t is threading.current_thread() or not t.is_alive()

    def _post(self, event: Callable[[], None]) -> None:
        """Hand ``event`` to the supervisor thread and wake it; never blocks (any thread)."""
        self._events.append(event)
        self._poke()

    def _poke(self) -> None:
        """Wake the supervisor without ever blocking the caller (the poll loop): a missed wake-up
        is caught by the supervisor's bounded waits (:data:`TICK`)."""
        if self.cv.acquire(timeout=0.005):
            try:
                self.cv.notify_all()
            finally:
                self.cv.release()

    def _apply_events(self) -> None:
        """(Supervisor thread, under ``cv``.) Apply the posted events in order; one that raises
        is logged and the others still apply."""
        if not self._events:
            return
        while self._events:
            event = self._events.popleft()
            try:
                event()
            except Exception:  # noqa: BLE001 - a broken event must not end supervision
                log.exception("engine: applying %r failed", event)
        self.cv.notify_all()

    def _interrupted(self) -> bool:
        return self.quit or self.want != "run" or self.request is not None

    def _wait(self, seconds: float, pred: Callable[[], bool] | None = None) -> bool:
        """Wait up to ``seconds`` on the condition; True if ``pred`` (default: interrupted) became true."""
        return self._wait_for(pred or self._interrupted, max(0.0, seconds))

    def _wait_for(self, pred: Callable[[], bool], timeout: float | None = None) -> bool:
        """(Supervisor thread.) Apply the posted events and wait on ``cv`` until ``pred()`` (read
        under ``cv``, after the events) is true or ``timeout`` seconds (None: no limit) passed.

        Returns:
            bool, ``pred()`` at the end.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.cv:
            while True:
                self._apply_events()
                if pred():
                    return True
                left = TICK if deadline is None else min(TICK, deadline - time.monotonic())
                if left <= 0:
                    return False
                self.cv.wait(left)

    def _call(self, fn: Callable[[], object], timeout: float, cancel: bool = False):
        """Have the supervisor thread run ``fn`` (under ``cv``) and return its result.

        Waits up to ``timeout`` seconds (0: does not wait).  When no supervisor thread runs,
        ``fn`` runs here, under ``cv``.

        Args:
            cancel: past ``timeout``, call ``fn`` off instead of leaving it queued.
        Returns:
            what ``fn`` returned, or None when it was not applied within ``timeout``.
        Raises:
            whatever ``fn`` raised.
        """
        box: dict = {}

        def event() -> None:
            if box.get("cancelled"):
                return
            try:
                box["result"] = fn()
            except Exception as e:  # noqa: BLE001 - raised again in the caller's thread
                box["error"] = e
            box["done"] = True

        with self.cv:
            if self._owner():
                event()
            else:
                self._events.append(event)
                self.cv.notify_all()
                if timeout > 0 and not self.cv.wait_for(lambda: "done" in box, timeout):
                    box["cancelled"] = cancel
        if "error" in box:
            raise box["error"]
        return box.get("result")

    def reload(self, cfg) -> None:
        """(Reload thread.) Hand a new configuration to the supervisor thread (:meth:`_reload`);
        waits up to :data:`HOOK_WAIT` seconds for it to be applied."""
        self._call(lambda: self._reload(cfg), HOOK_WAIT)

    def _reload(self, cfg) -> None:
        """(Event.) New configuration (SIGHUP): gates, health, probe, restart policy take effect now or at the
        next start; the command, env and lanes' args at the next start.  A changed ``engine.lane``
        switches lanes now, as ``sparkguard engine lane`` does (a stopped engine starts in it when
        next started); so does a current lane that ``engine.lanes`` no longer has.  The state file
        is written by the supervisor thread once it switched; until then it still names the old
        ``config_lane``, so a daemon restart meanwhile also starts in the new ``engine.lane``
        (:func:`lanes.initial_lane`).  The control socket path needs a daemon restart.

        A node of a cluster file (``cfg.cluster.name`` set) does not switch for a changed
        ``engine.lane``: its ranks would run two lanes until every node reloaded, and a TP group
        with mixed lanes does not form (docs/cluster.md).  It logs that ``sparkguard cluster lane
        NAME`` switches the cluster (every rank down, then up in the lane) and keeps its lane."""
        with self.cv:
            if cfg.engine.control_socket != self.ecfg.control_socket:
                log.warning("engine.control_socket changed to %s: takes effect after a restart",
                            cfg.engine.control_socket)
            old_cfg_lane = lanes.config_lane(self.ecfg)
            self.cfg, self.ecfg = cfg, cfg.engine
            self.backoff.initial, self.backoff.maximum = cfg.engine.backoff_initial, cfg.engine.backoff_max
            self.backoff.stable_after = cfg.engine.stable_after
            self.give_up.after, self.give_up.window = cfg.engine.give_up_after, cfg.engine.give_up_window
            new_cfg_lane = lanes.config_lane(cfg.engine)
            why = None
            clustered = getattr(getattr(cfg, "cluster", None), "name", None) is not None
            if new_cfg_lane != old_cfg_lane and new_cfg_lane != self.lane and clustered:
                msg = (f"engine.lane changed from {old_cfg_lane} to {new_cfg_lane} in the cluster file "
                       f"{cfg.cluster.file}: a cluster node does not switch lanes alone (its ranks would mix "
                       f"lanes); it stays in lane {self.lane}; 'sparkguard cluster lane {new_cfg_lane}' switches "
                       "the whole cluster")
                log.warning("%s", msg)
                self._history("lane", msg)
            elif new_cfg_lane != old_cfg_lane and new_cfg_lane != self.lane:
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
            self.give_up.reset()
            self._history("lane", f"{why}: switching to lane {lane} (restart)")
        else:
            self.lane = lane
            self._history("lane", f"{why}: lane {lane} from the next start")

    def link_event(self, down: bool, detail: str) -> None:
        """The TP link watch declared a link incident (``down``) or its end (``link.mark_unhealthy``).

        While a link is down the engine (NCCL hangs inside a collective) is marked unhealthy and no
        new start happens; once the link is back the engine is restarted (reason ``link``) so its
        ranks meet again.  Called from the link watch thread; waits up to :data:`HOOK_WAIT`
        seconds for the supervisor thread to apply it (:meth:`_link_changed`).
        """
        self._call(lambda: self._link_changed(down, detail), HOOK_WAIT)

    def _link_changed(self, down: bool, detail: str) -> None:
        """(Event.) :meth:`link_event`."""
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

    def command(self, op: str, lane: str | None = None) -> dict:
        """Control: ``start``, ``stop``, ``restart``, ``lane`` (with ``lane``), applied by the
        supervisor thread (:meth:`_command`).

        A command the supervisor thread does not take within :data:`COMMAND_WAIT` seconds (it is
        in a step that does not read its mailbox: a sweep of the engine's leftovers, up to
        ``guard.grace`` + 10 s) stays queued and is answered at once, as accepted: it applies when
        that step ends, as a command always did.  An unknown command or lane is refused here.
        ``lane X`` while the engine is ready in X (and nothing else is pending) changes nothing
        (note "already ready in lane X"); so does ``start`` while it runs ("already running").

        Returns:
            ``{"ok": bool, "error": str?, "note": str?, "starts": int, "status": dict}``; ``starts``
            is the spawn count before the command (wait for ``starts`` > it, then ready); for a
            command that changed nothing, the count before the current run (that wait is then
            answered by the current run).
        """
        refused = self._refuse(op, lane)
        if refused:
            return {"ok": False, "error": refused}
        r = self._call(lambda: self._command(op, lane), COMMAND_WAIT)
        if r is not None:
            return r
        with self.cv:
            return {"ok": True, "starts": self.starts, "status": self._status(),
                    "note": f"queued: the supervisor applies it once {self.state} ends ({self.detail})"}

    def _refuse(self, op: str, lane: str | None) -> str | None:
        """Why ``op`` (with ``lane``) cannot be applied whatever the state, or None (any thread:
        reads only the configuration reference)."""
        ecfg = self.ecfg
        if op not in ("start", "stop", "restart", "lane"):
            return f"unknown command {op!r}"
        if op == "lane" and not ecfg.lanes:
            return "no engine.lanes configured"
        if op == "lane" and lane not in ecfg.lanes:
            return f"no lane {lane!r}; engine.lanes has " + ", ".join(ecfg.lanes)
        return None

    def _command(self, op: str, lane: str | None) -> dict:
        """(Event.) :meth:`command`."""
        with self.cv:
            starts = self.starts
            run = self.run
            # the current run, when it is alive, answers a wait for "a start after the returned
            # count": a command that changes nothing answers with the count before that run
            current = starts - 1 if run is not None and run.exit is None and starts else starts
            if op == "start":
                if self.want == "run" and self.state not in HALTED:
                    return {"ok": True, "starts": current, "note": "already running", "status": self._status()}
                self.want = "run"
                self.backoff.reset()
                self.give_up.reset()
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
                self.give_up.reset()
                self.request = ("restart", None)
                self._history("command", "restart")
            elif op == "lane":
                if not self.ecfg.lanes:
                    return {"ok": False, "error": "no engine.lanes configured"}
                if lane not in self.ecfg.lanes:
                    return {"ok": False, "error": f"no lane {lane!r}; engine.lanes has " + ", ".join(self.ecfg.lanes)}
                if (self.want == "run" and self.request is None and self.lane == lane and run is not None
                        and run.exit is None and run.ready and run.lane == lane):
                    return {"ok": True, "starts": current, "note": f"already ready in lane {lane}",
                            "status": self._status()}
                self.want = "run"
                self.backoff.reset()
                self.give_up.reset()
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
                return "" if self.state in ("stopped",) + HALTED else None
            if until == "starts":
                return "" if self.starts > after else None
            run = self.run
            if self.starts > after and run is not None and run.ready and (lane is None or run.lane == lane):
                return ""
            if self.starts > after and self.state in ("backoff", "stopped") + HALTED:
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

    def collector(self):
        """A prometheus_client collector of the engine metrics (see :class:`EngineCollector`)."""
        return EngineCollector(self)

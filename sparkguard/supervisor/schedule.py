"""The Supervisor between two runs: the backoff wait, the start gates, the restart decision.

:class:`BetweenRuns` is a part of :class:`sparkguard.supervisor.core.Supervisor` (its base
class); it runs on the supervisor thread.
"""

from __future__ import annotations

import logging
import time

from sparkguard import buddyinfo
from sparkguard.supervisor import cluster, lanes, memgate
from sparkguard.supervisor.gates import StartGates
from sparkguard.supervisor.restart import CLUSTER, restarts
from sparkguard.supervisor.runthreads import SupervisorGateHooks
from sparkguard.units import format_duration

log = logging.getLogger("sparkguard.supervisor")

#: the summary of a ``fragmented`` incident opens with this (its detail follows)
BLOCKED = "engine start blocked by fragmentation: "


class BetweenRuns:
    """Backoff, gates and restart scheduling of a :class:`Supervisor`."""

    def _backoff(self) -> bool:
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
        """Guard hold, drop caches, compaction, quiesce, MemFree, peers, cluster order.  False when
        interrupted (stop/lane/quit)."""
        argv = lanes.command(self.cfg, self.lane)[0]
        role = cluster.role_of(argv)
        with self.cv:
            self.start_gates = {}
        r = StartGates(self.ecfg, SupervisorGateHooks(self), role=role, argv=argv, on_gate=self._gate_seen,
                       on_blocked=self._start_blocked).run()
        if r is None:
            return False
        with self.cv:
            self.last_gates = list(r.gates)
            self.start_views = list(r.views)
            self.quiesce_wait, self.quiesce_timed_out = r.waited, bool(r.timed_out)
            self.gate_timeout = {"gate": r.timed_out, "detail": r.detail} if r.timed_out else None
        return True

    def _gate_seen(self, record: dict) -> None:
        """(Supervisor thread, from the gates.) A gate's state changed: status ``start_gates``,
        the metric ``sparkguard_engine_start_gate_info``."""
        with self.cv:
            self.start_gates = dict(self.start_gates, **{record["gate"]: record})

    def _start_blocked(self, detail: str) -> None:
        """(Supervisor thread, from the gates.) Fragmentation blocks the start past
        engine.quiesce_timeout: an incident of kind ``fragmented`` (docs/start-gate.md), reported
        at once, outcome ``blocked``; the gates keep waiting."""
        engine = self._engine_info(None)
        with self.cv:
            engine["start_gates"] = list(self.start_gates.values())
        b = buddyinfo.read()
        engine["buddyinfo"] = b.as_dict() if b is not None else None
        inc = self.reports.open("fragmented", self.cfg, None, "fragmented", detail, engine, [], BLOCKED + detail)
        inc.outcome, inc.ended_at = "blocked", time.time()
        inc.summary = f"{BLOCKED}{detail}; the engine is not started until the blocks are there"
        self.reports.finish(inc)

    def _gates_note(self) -> str:
        """What the compaction and the memfree gate did before this start, for the restart event."""
        return memgate.summary(self.last_gates)

    def _schedule_restart(self, reason: str, failure: bool, uptime: float) -> None:
        """Decide (under ``cv``) whether and when to restart after an exit for ``reason``."""
        policy = self.ecfg.restart
        if not restarts(policy, failure, reason):
            self.want = "stop"
            self.state = "exited" if not failure else "failed"
            self.detail = f"not restarted (engine.restart: {policy}): {self.last_exit and self.last_exit['detail']}"
            self._history("no_restart", self.detail)
            return
        self.next_reason = reason
        if reason in CLUSTER:           # another node's doing: no backoff; the cluster gate orders the start
            self.delay = 0.0
            return
        self.delay = self.backoff.next(uptime)
        if self.backoff.failures > 2:
            log.warning("engine: crash loop? %d restarts in a row; next in %g s", self.backoff.failures, self.delay)

    def _given_up(self, rec: dict) -> None:
        """(Under ``cv``.) ``engine.give_up_after`` failed recoveries within ``engine.give_up_window``:
        stay stopped until ``sparkguard engine start``; an incident says so."""
        e = self.ecfg
        self.want = "stop"
        self.state = "given_up"
        loads = (f"; {self.failed_loads} failed loads (stopped by the memory guard while loading) since the "
                 "daemon started" if self.failed_loads else "")
        self.detail = (f"gave up after {len(self.give_up.failed)} failed starts within "
                       f"{format_duration(e.give_up_window)} (engine.give_up_after {e.give_up_after}){loads}; "
                       f"last run: {rec.get('detail', 'exited')}; `sparkguard engine start` tries again")
        self._history("given_up", self.detail)
        log.error("engine: %s", self.detail)

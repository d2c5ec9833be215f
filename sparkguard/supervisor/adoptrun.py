"""The Supervisor's side of adoption: take over a verified engine at start, hand it over at exit.

:class:`Adoption` is a part of :class:`sparkguard.supervisor.core.Supervisor` (its base class);
it runs in the supervisor thread.  The identity checks are :func:`adopt.check` (pure of
signals); what happens with each result:

* ``adopted``: a :class:`Run` is rebuilt from the record (same pid, run id, cgroup, members,
  lane, container) with an :class:`adopt.AdoptedProc` for its process; its output FIFOs are
  re-opened (:func:`output.reopen_fifos`), its exit is watched on the pidfd, and the usual
  monitor (health, readiness, probe, head watch) and escalation apply from then on;
* ``changed``: the recorded engine is ours (verified) but the config asks for another command:
  it is stopped through the one escalation (SIGTERM, ``guard.grace``, SIGKILL of its tree) and
  the supervisor starts the configured one as usual;
* ``refused`` / ``gone``: nothing is adopted and nothing unverified is signalled; what the old
  daemon left is swept as before (recorded members whose start time still matches).

Every result is logged (a journal line under the unit), kept in the status (``adoption``), added
to the engine history and counted (``sparkguard_engine_adoptions_total{result}``).
"""

from __future__ import annotations

import logging
import os
import time

from sparkguard import proctree, sysinfo
from sparkguard.guard import escalation
from sparkguard.supervisor import adopt, cluster, handover, health, lanes, output
from sparkguard.supervisor import cgroup as cgroups
from sparkguard.supervisor.run import Run
from sparkguard.supervisor.runthreads import SupervisorMonitorHooks

log = logging.getLogger("sparkguard.supervisor")


class Adoption:
    """Start-up adoption and exit handover of a :class:`Supervisor`."""

    def _make_fifos(self, tag: str):
        """The run's output FIFOs in the runtime directory (beside ``engine.control_socket``):
        ``(paths, child fds, readers)``; all empty (plain pipes, output lost if the daemon dies
        first) when they cannot be made, which is logged."""
        try:
            return output.make_fifos(os.path.dirname(self.ecfg.control_socket), tag)
        except OSError as e:
            log.warning("engine: cannot make output FIFOs in %s (%s); using pipes: this run's output "
                        "cannot outlive the daemon", os.path.dirname(self.ecfg.control_socket), e)
            return {}, {}, {}

    def _adoption_result(self, result: str, why: str) -> None:
        with self.cv:
            self.adoption = {"result": result, "detail": why, "at": time.time()}
            if result in self.adoptions:
                self.adoptions[result] += 1
        self._history("adopt", f"{result}: {why}")
        (log.info if result in (adopt.ADOPTED, adopt.GONE) else log.warning)(
            "engine: adoption %s: %s", result, why)

    def _adopt_previous(self) -> bool:
        """(Supervisor thread, at start.)  Adopt the engine a previous daemon left, or stop it
        (changed command), or sweep its verified leftovers.  True when a run was adopted
        (``self.run`` is set and its threads run)."""
        note = handover.note_path(self.ecfg)
        kept = handover.take_note(note)     # (under systemd taken at the daemon's start already)
        lane = self.lane
        try:
            argv, env = lanes.command(self.cfg, lane)
        except KeyError as e:           # engine.user does not exist (the start will say so too)
            log.error("engine: cannot build the engine's command (%s); nothing is adopted", e)
            self._sweep_previous()
            return False
        v = adopt.check(self.previous_state, sysinfo.boot_id(), adopt.command_digest(argv, self.ecfg, lane),
                        parent=self.placement.parent if self.placement else None)
        if not v.result:
            self._sweep_previous()
            return False
        why = v.why + (f"; kept by the previous daemon ({kept.get('kept')})" if kept else "")
        if v.result == adopt.CHANGED:
            self._adoption_result(v.result, why + ": stopping it, then starting the configured command")
            self._stop_changed(self._rebuild(v, argv, env, output_too=False))
            return False
        if v.result != adopt.ADOPTED:
            self._adoption_result(v.result, why)
            self._sweep_previous()
            return False
        run = self._rebuild(v, argv, env)
        if run.lane != lane and run.lane in self.ecfg.lanes:
            self.lane = run.lane
        self._adoption_result(v.result, why + ("" if run.streams else "; its output could not be re-attached"))
        with self.cv:
            self.run = run
            self.starts += 1            # a run this daemon supervises: `engine wait ready`, restarts count it
            self.state = "starting"
            self.detail = "adopted from a previous sparkguard" + (
                f"; waiting for {self.ecfg.health_url} to answer 200" if self.ecfg.health_url else "")
            self.cv.notify_all()
        self._write_state()
        run.start_thread("sg-engine-exit", self._watch_exit)
        run.start_thread("sg-engine-out", self._pump)
        run.start_thread("sg-engine-mon", health.monitor, lambda: self.ecfg, SupervisorMonitorHooks(self))
        if run.launch is not None and run.container is None:
            run.start_thread("sg-engine-ctr", self._find_container)
        return True

    def _rebuild(self, v: adopt.Verdict, argv: list[str], env: dict, output_too: bool = True) -> Run:
        """A :class:`Run` for the verified engine of ``v`` (its pidfd is the run's from now on)."""
        rec = v.record
        run = Run(adopt.AdoptedProc(rec.pid), rec.lane, rec.argv or argv, None, self.ecfg.log_lines,
                  cluster.role_of(rec.argv or argv), wall_spawn=rec.wall_spawn or time.time())
        run.t_spawn = time.monotonic() - max(0.0, time.time() - run.wall_spawn)
        # engine.ready_timeout: an engine recorded ready loaded long ago; counted from its original
        # start one failed /health at adoption (a 503, a slow answer under load) would be a
        # not_ready verdict at once.  Its clock starts again now; one still loading keeps its start.
        run.t_ready_clock = time.monotonic() if rec.ready else run.t_spawn
        run.adopted, run.pidfd, run.digest = True, v.pidfd, rec.digest
        run.pgid, run.starttime = rec.pgid or rec.pid, rec.starttime     # pgid: the verified root's (adopt.check)
        run.members = dict(rec.members)
        run.group = dict(rec.group)         # a TP head: the ranks' runs it started with (peer verdicts)
        run.members[rec.pid] = rec.starttime
        if rec.cgroup:                      # accepted by adopt.check: an engine-<run id> below placement.parent
            run.cgroup = cgroups.EngineCgroup(rec.cgroup)
            run.cgroup.entered = True
        # the rest of the record is untrusted too: a field that does not parse is left out (and
        # logged), never an exception out of the supervisor thread
        if rec.launch:
            run.launch, why = adopt.launch_of(rec.launch, argv, self.ecfg.state_file, env)
            if why:
                log.warning("engine: adopted pid %d: the state file's container launch is not taken (%s)", rec.pid, why)
        if rec.container:
            run.container, why = adopt.verified_container(rec.container)
            if why:
                log.warning("engine: adopted pid %d: recorded container not taken (%s)%s", rec.pid, why,
                            "; looking for it through the cidfile" if run.launch is not None else "")
        if output_too:
            run.fifos, run.fifo_ids = rec.fifos, rec.fifo_ids
            run.streams, why = output.reopen_fifos(rec.pid, rec.fifos, rec.fifo_ids)
            if why:
                log.warning("engine: adopted pid %d: output: %s", rec.pid, why)
        return run

    def _stop_changed(self, run: Run) -> None:
        """Stop a verified engine whose command is not the configured one: the one escalation
        (SIGTERM, ``guard.grace``, SIGKILL of its tree), then the sweep of what is left."""
        with self.cv:
            self.run = run
        run.start_thread("sg-engine-exit", self._watch_exit)
        self._terminate("changed")
        self._await_exit(self.cfg.guard.grace + 10)
        run.done.set()
        swept = self._sweep(run.pgid, run.members, cgroup=run.cgroup)
        self._remove_cgroup(run)
        output.remove_fifos(run.fifos)
        with self.cv:
            self.last_run, self.run = run, None
            self._history("exit", f"pid {run.pid} (adopted, command changed) stopped"
                          + (f"; swept {len(swept)} leftover processes" if swept else ""))

    @staticmethod
    def _group_ok(run: Run) -> bool:
        """May the sweep after ``run``'s exit take every process of its process group?  Always for a
        run this daemon started (its root, our child, is reaped only after the sweep, so the pgid
        stays reserved).  An adopted root is reaped at once by its new parent: once its group
        empties the pgid can be reused by a stranger, so only while a recorded member with its
        recorded start time is still in the group (as :meth:`Supervisor._sweep_previous`)."""
        if not run.adopted:
            return True
        for pid, start in dict(run.members).items():
            p = proctree.read_proc(pid) if pid != run.pid else None
            if p is not None and p.starttime == start and p.pgrp == run.pgid:
                return True
        return False

    def _may_hand_over(self) -> bool:
        """(Supervisor thread, at exit keeping the engine.)  May the run be left to the next daemon?
        Not when it is over or being stopped (``term_reason``), nor while the memory guard is
        stopping it (``guard_hit``, or an escalation of its root in progress: handed over, its
        pending SIGKILL would be lost and the next daemon would start a fresh grace under memory
        pressure), nor when its output is plain pipes (no FIFOs: its writes would fail with EPIPE
        once this daemon is gone).  A refusal is logged; the engine is then stopped."""
        run = self.run
        if run is None or run.exit is not None or run.term_reason is not None:
            return False
        why = None
        if run.guard_hit or escalation.OWNER.running(run.pid, run.starttime) is not None:
            why = "the memory guard is stopping it"
        elif not run.fifos:
            why = "its output is plain pipes (no FIFOs), which cannot outlive this daemon"
        if why:
            log.warning("engine: not handing pid %d over to the next sparkguard (%s): stopping it", run.pid, why)
            self._history("handover", f"refused for pid {run.pid}: {why}; stopping it")
        return why is None

    def _hand_over(self) -> None:
        """(Supervisor thread, at exit.)  Leave the running engine for the next daemon: its state
        and a handover note written, its output FIFOs left in place; nothing is signalled."""
        run = self.run
        why = self.keep_why or "kept"
        self._write_state()
        handover.write_note(handover.note_path(self.ecfg), run, why)
        self._history("handover", f"pid {run.pid} kept running for the next sparkguard: {why}")
        log.warning("engine: pid %d keeps running without a guard until the next sparkguard adopts it (%s)",
                    run.pid, why)

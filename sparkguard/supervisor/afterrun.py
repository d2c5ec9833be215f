"""The Supervisor after a run: sweep its leftovers, reap it, record its exit, decide the restart.

:class:`AfterRun` is a part of :class:`sparkguard.supervisor.core.Supervisor` (its base class);
it runs on the supervisor thread.  Also the sweeps of what an earlier run or an earlier daemon
left behind (:func:`process.sweep`: SIGTERM, ``guard.grace``, SIGKILL of the recorded members and
the process group), and the run's cgroup removal.
"""

from __future__ import annotations

import logging
import threading
import time

from sparkguard import proctree, sysinfo
from sparkguard.supervisor import cgroup as cgroups
from sparkguard.supervisor import cluster, container, lanes, nodes, output, process, stopbudget
from sparkguard.supervisor.restart import COMMANDED, LOAD, classify_exit
from sparkguard.supervisor.run import Run
from sparkguard.supervisor.runthreads import SUMMARY
from sparkguard.supervisor.state import HALTED

log = logging.getLogger("sparkguard.supervisor")


class AfterRun:
    """The end of a run of a :class:`Supervisor`, and the sweeps of leftovers."""

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

    def _sweep(self, pgid: int | None, members: dict[int, int], exclude: int | None = None,
               group_ok: bool = True, cgroup: cgroups.EngineCgroup | None = None, deadline=None) -> list[int]:
        """:func:`process.sweep` with this supervisor's ``guard.grace``, ``targets.protect`` and
        history (blocks this thread up to the grace and 10 s more); returns the pids found."""
        return process.sweep(pgid, members, self.cfg.guard.grace, self.cfg.targets.protect, self._history,
                             exclude=exclude, group_ok=group_ok, cgroup=cgroup, deadline=deadline)

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

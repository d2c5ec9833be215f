"""The Supervisor while a run lives: wait for its end, stop it on a command, a verdict or shutdown.

:class:`Stopping` is a part of :class:`sparkguard.supervisor.core.Supervisor` (its base class);
it runs on the supervisor thread.  Every stop goes through the one escalation
(:mod:`sparkguard.guard.escalation`: SIGTERM, ``guard.grace``, SIGKILL of the tree); a stop the
memory guard already began is joined, never started twice.
"""

from __future__ import annotations

from sparkguard import enginetree
from sparkguard.guard import escalation
from sparkguard.supervisor import process, stopbudget
from sparkguard.supervisor.runthreads import SUMMARY


class Stopping:
    """Supervising one run of a :class:`Supervisor` until it exits, and stopping it."""

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
                              enginetree.Protector(self.cfg.targets.protect), note=note)

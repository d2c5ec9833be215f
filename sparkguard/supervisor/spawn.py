"""The Supervisor's start of one run: its cgroup, output FIFOs, process, threads and start record.

:class:`Spawning` is a part of :class:`sparkguard.supervisor.core.Supervisor` (its base class);
:meth:`Spawning._spawn` runs on the supervisor thread once the gates passed
(:mod:`.schedule`), the container finder on the run's ``sg-engine-ctr`` thread.
"""

from __future__ import annotations

import logging
import os
import time

from sparkguard import proctree
from sparkguard.supervisor import adopt, cluster, container, health, lanes, output, process
from sparkguard.supervisor import cgroup as cgroups
from sparkguard.supervisor.gates import read_mem_available
from sparkguard.supervisor.run import Run
from sparkguard.supervisor.runthreads import SupervisorMonitorHooks
from sparkguard.units import format_size

log = logging.getLogger("sparkguard.supervisor")


class Spawning:
    """Spawning one engine run of a :class:`Supervisor`."""

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

"""The Supervisor's views of its state: the status dict, incident engine parts, history, the state file.

:class:`StatusViews` is a part of :class:`sparkguard.supervisor.core.Supervisor` (its base
class); the state it reads is the Supervisor's.
"""

from __future__ import annotations

import logging
import time

from sparkguard import gpumem
from sparkguard.supervisor import cluster, lanes, memgate, process
from sparkguard.supervisor.run import Run

log = logging.getLogger("sparkguard.supervisor")

#: supervisor states (``status()["state"]``)
STATES = ("stopped", "backoff", "sweeping", "waiting", "starting", "waiting_for_head", "ready", "stopping", "exited",
          "failed", "given_up")
#: states in which the supervisor stays stopped until a command (``engine start``)
HALTED = ("exited", "failed", "given_up")


def _gpu_bytes(run: Run | None) -> int | None:
    """GPU memory NVML reports over ``run``'s processes (its recorded members), None without NVML
    or without a live run (:mod:`sparkguard.gpumem`)."""
    if run is None or run.exit is not None or not gpumem.active():
        return None
    gpu = gpumem.reading()
    return sum(gpu.get(pid, 0) for pid in set(dict(run.members)) | {run.pid})


class StatusViews:
    """Status, history, incident engine parts and the state file of a :class:`Supervisor`."""

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
            "start_gates": list(self.start_gates.values()),
            "gpu_bytes": _gpu_bytes(run),
            # the guard's view: loading (started, never ready: engine.load_phase's lines), serving
            "phase": ("loading" if not run.ever_ready else "serving") if run and run.exit is None else None,
            "failed_loads": self.failed_loads,
        }
        alive = run is not None and run.exit is None
        role = run.role if run is not None else cluster.role_of(st["command"])
        st.update({
            "role": {"role": role.role, "node_rank": role.node_rank, "nnodes": role.nnodes},
            # until its tree is swept (orphans may hold the rendezvous): no rank starts beside it
            "run_start": run.run_id if run is not None else None,
            "joined": run.joined if alive and role.role == "headless" else None,
            "group": {str(k): v for k, v in run.group.items()} if alive and role.role == "head" else {},
            "given_up": self.state == "given_up",
            "nodes": [v.as_dict() for v in self.node_views],
            "cluster": _cluster_place(getattr(self, "cfg", None)),
        })
        return st

    def _history(self, event: str, detail: str) -> None:
        """Add a status history entry (``at`` unix s, ``mono`` monotonic s, ``event``, ``detail``)
        and log it; from another thread than the supervisor's the entry is posted (its times are
        those of the call)."""
        entry = {"at": time.time(), "mono": time.monotonic(), "event": event, "detail": detail}
        if self._owner():
            self._note(entry)
        else:
            self._post(lambda: self._note(entry))

    def _note(self, entry: dict) -> None:
        self.history.append(entry)
        log.info("engine: %s: %s", entry["event"], entry["detail"])

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
        command, exit (``exit_``, :meth:`_exit_of`), last output lines, its container (only for a
        container engine: ``{"id", "name", "pid", "cgroup"}``); the restart counters now."""
        state, detail = self.state, self.detail
        if run is not None and exit_ is not None and self.run is run and state in ("starting", "ready", "stopping"):
            state, detail = "sweeping", f"pid {run.pid} exited; sweeping what is left of its tree"
        info = {"state": state, "detail": detail, "lane": run.lane if run else self.lane,
                "pid": run.pid if run else None, "command": run.argv if run else None, "exit": exit_,
                "restarts": dict(self.restarts),
                "last_lines": run.lines.current()[-self.ecfg.log_lines:] if run else []}
        if run is not None and run.container is not None:     # a docker|podman run engine: its container
            info["container"] = run.container.as_dict()
        if run is not None and run.adopted:       # taken over from a previous daemon (supervisor.adoptrun)
            info["adopted"] = True
        return info

    def _flush(self, why: str, restart_detail: str | None = None, pids: list[int] | None = None,
               views=()) -> None:
        """Resolve the incidents waiting for a restart (:meth:`reports.EngineIncidents.flush`)."""
        with self.cv:
            now = {"state": self.state, "pid": self.run.pid if self.run is not None else None, "lane": self.lane,
                   "restarts": dict(self.restarts), "start_gates": memgate.notable(self.last_gates)}
        self.reports.flush(now, why, restart_detail, pids, views)

    def _write_state(self) -> None:
        """(Supervisor thread, the file's one writer.) Persist the lane (a lane switch asked for
        and not yet done counts: a daemon restart meanwhile starts in it) and the running engine."""
        req = self.request
        lane = req[1] if req is not None and req[0] == "lane" else self.lane
        lanes.write_state(self.ecfg, lane, self.run)


def _cluster_place(cfg) -> dict | None:
    """This node's place in its cluster file (``cfg.cluster``, sparkguard.config.cluster):
    ``{"name", "node", "rank", "nnodes", "digest"}``, None without a cluster file.  What
    ``sparkguard cluster`` compares with the operator's file (sparkguard.cluster.ops)."""
    cl = getattr(cfg, "cluster", None)
    if getattr(cl, "name", None) is None:
        return None
    return {"name": cl.name, "node": cl.node, "rank": cl.rank, "nnodes": cl.nnodes,
            "digest": getattr(cl, "digest", None)}

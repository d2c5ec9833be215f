"""The guard's side of the engine supervisor: start it, ask for its tree, pass on reloads and links, stop it.

The supervisor (:mod:`sparkguard.supervisor.core`) runs in threads of its own; every call here comes
from the poll loop (or the link-watch thread for :meth:`Engine.link`) and returns without waiting,
except :meth:`Engine.stop` at shutdown.
"""

from __future__ import annotations

import logging

from sparkguard.supervisor import handover
from sparkguard.supervisor.core import Supervisor

log = logging.getLogger("sparkguard")


class Engine:
    """The supervised engine as the guard sees it; without an ``engine:`` section every call is a no-op.

    Attributes:
        supervisor: the running :class:`Supervisor`, or None.
    """

    def __init__(self):
        self.supervisor = None

    def start(self, cfg, reporter, count_incident, metrics) -> None:
        """Start supervising ``engine:`` when configured.  ``count_incident``: ``(kind, wall, id)``
        called for the supervisor's own incidents; ``metrics``: the endpoint (its collector is
        registered) or None.  Raises OSError (control socket)."""
        if not cfg.engine.enabled:
            return
        self.supervisor = Supervisor(cfg, reporter, count_incident=count_incident)
        self.supervisor.start()
        register = getattr(metrics, "register_collector", None)
        if register is not None:
            register(self.supervisor.collector())

    def target(self, procs, protector):
        """The supervised engine's tree (the guard's first target, no tree rows yet), or None."""
        if self.supervisor is None:
            return None
        return self.supervisor.target(procs, protector, details=False)

    def root_pid(self) -> int | None:
        """The pid of the run the supervisor has now (running or not yet swept), or None."""
        run = getattr(self.supervisor, "run", None) if self.supervisor is not None else None
        return run.pid if run is not None else None

    def cgroups(self) -> set[str]:
        """The cgroup directories of the supervisor's run known now (its own, its container's);
        empty without a run.  Plain attribute reads (the poll loop, at the crossing)."""
        run = getattr(self.supervisor, "run", None) if self.supervisor is not None else None
        if run is None:
            return set()
        cg, ctr = getattr(run, "cgroup", None), run.container
        return {c for c in (cg.path if cg is not None else None, ctr.cgroup if ctr is not None else None) if c}

    def loading(self) -> bool:
        """True while the supervised engine loads: a run started and alive that was never ready
        (its health URL has not answered 200 yet; ``Run.ever_ready``, set by the run's monitor
        thread, :mod:`sparkguard.supervisor.health`).  Plain attribute reads, no lock: the poll
        loop calls it on every full pass; a stale answer lasts one poll."""
        sup = self.supervisor
        run = sup.run if sup is not None else None
        return run is not None and run.exit is None and not run.ever_ready

    def reload(self, cfg) -> None:
        """A new config is in force for the guard; the supervisor takes its ``engine:`` part."""
        if self.supervisor is not None and cfg.engine.enabled:
            self.supervisor.reload(cfg)
        elif cfg.engine.enabled != (self.supervisor is not None):
            log.warning("engine: section added or removed: takes effect after a restart")

    def link(self, inc: dict, mark_unhealthy: bool) -> None:
        """``link.mark_unhealthy``: a link incident marks the engine unhealthy; its end restarts it."""
        if self.supervisor is not None and mark_unhealthy:
            self.supervisor.link_event(inc.get("outcome") == "link_down", str(inc.get("summary") or ""))

    def stop(self, keep_signal: bool = False) -> None:
        """Stop the engine (SIGTERM, grace, SIGKILL) before the daemon exits, or keep it running
        for the next daemon (``keep_signal``: SIGUSR2; a restart under systemd with
        ``engine.on_daemon_restart: keep``...: :func:`handover.decide`, which may ask systemd for
        its job: up to 1 s, after the poll loop has ended)."""
        if self.supervisor is not None:
            keep, why = handover.decide(self.supervisor.ecfg, keep_signal)
            log.info("engine: %s: %s", "keeping the engine running" if keep else "stopping the engine", why)
            self.supervisor.stop(keep=keep, why=why)

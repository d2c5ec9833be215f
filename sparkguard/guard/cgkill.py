"""The guard's SIGKILL of a tree that is a cgroup: ``cgroup.kill``, else freeze, SIGKILL every member, thaw.

A supervised run in a cgroup of its own (:mod:`sparkguard.supervisor.cgroup`) and an engine in a
docker or podman container (its cgroup: :mod:`sparkguard.supervisor.container_cgroup`) are
cgroups: every process of theirs is a member, also one that double-forked and called setsid away
from the tree the guard chose (its pidfds, :class:`sparkguard.signals.Tree`, reach only members
and their descendants).  :class:`CgroupsTree` is that pidfd tree plus its cgroups; its SIGKILL:

* ``cgroup.kill`` (Linux >= 5.14): one write SIGKILLs every process of the cgroup and its
  descendants, forks racing the write included (kernel Documentation/admin-guide/cgroup-v2.rst,
  "cgroup.kill");
* else ``cgroup.freeze`` (Linux >= 5.2): the cgroup is frozen (no member runs, so none forks),
  every member is SIGKILLed through a pidfd (a fatal signal reaches a frozen process:
  cgroup-v2.rst, "cgroup.freeze"), then thawed; the write is not waited for (the poll loop never
  blocks): the pidfd rounds (:func:`sparkguard.supervisor.cgroup.kill_rounds`) pick up what was
  forked meanwhile;
* else (cgroup v1 only) the pidfd rounds alone.

A cgroup holding a protected process (``targets.protect``) is never killed whole: its members
are SIGKILLed one by one, the protected ones skipped.  Nothing here raises or waits; every file
read is bounded (:func:`sparkguard.supervisor.cgroup.members`).
"""

from __future__ import annotations

import logging
import os

from sparkguard import enginetree, proctree, signals
from sparkguard.supervisor import cgroup as cgroups

log = logging.getLogger("sparkguard")


def _write(path: str, text: str) -> bool:
    err = cgroups._write(path, text)
    if err is not None:
        log.warning("writing %s failed (%s); SIGKILL through pidfds", path, err)
    return err is None


class CgroupsTree(signals.Tree):
    """A :class:`sparkguard.signals.Tree` whose members include every process of ``cgroups``.

    Args:
        pids, starttimes, root, term: as :class:`sparkguard.signals.Tree`.
        cgroups: list[str], cgroup directories (cgroup2, or a v1 hierarchy's) whose members are the tree's.
        use_kill: False: never ``cgroup.kill`` (the freeze path; tests).
    Attributes:
        how: str, how the last :meth:`kill_all` killed (``"cgroup.kill"``, ``"freeze"``, ``"pidfd"``).
    """

    def __init__(self, pids: list[int], starttimes: dict[int, int], cgroups: list[str], root: int | None = None,
                 term: int | None = None, use_kill: bool = True):
        self.cgroups = [c for c in dict.fromkeys(cgroups) if c]
        self.use_kill = use_kill
        self.how = ""
        super().__init__(pids, starttimes, root, term)
        self.add_members()

    def add_members(self) -> list[int]:
        """Open pidfds for members of the cgroups not yet in the tree (never this process); the pids added."""
        return cgroups.add_pids(self, [pid for cg in self.cgroups for pid in cgroups.members(cg)])

    def sweep(self) -> list[int]:
        return self.add_members() + super().sweep()

    def _guarded(self, cg: str, protector: enginetree.Protector | None) -> bool:
        return protector is not None and any(
            (p := proctree.read_proc(pid)) is not None and protector.protected(p) for pid in cgroups.members(cg))

    def kill_all(self, protector: enginetree.Protector | None = None) -> list[int]:
        """SIGKILL the tree: each cgroup whole (module doc), then every member left through its pidfd.
        Returns the pids signalled (a pid once)."""
        self.add_members()
        killed: list[int] = []
        frozen: list[str] = []
        hows = set()
        for cg in self.cgroups:
            if self._guarded(cg, protector):
                continue
            inside = set(cgroups.members(cg))
            live = self.alive()                 # before the write: its members exit at once
            if self.use_kill and os.path.isfile(os.path.join(cg, "cgroup.kill")) and \
                    _write(os.path.join(cg, "cgroup.kill"), "1"):
                hows.add("cgroup.kill")
                new = [pid for pid in live if pid in inside and pid not in killed]
                self._release(new)
                killed += new
            elif os.path.isfile(os.path.join(cg, "cgroup.freeze")) and _write(os.path.join(cg, "cgroup.freeze"), "1"):
                hows.add("freeze")
                frozen.append(cg)
        try:
            killed = cgroups.kill_rounds(self, killed, protector)
        finally:
            for cg in frozen:       # the SIGKILLed members exit once thawed too; a protected one runs on
                _write(os.path.join(cg, "cgroup.freeze"), "0")
        self.how = "+".join(sorted(hows)) or "pidfd"
        return list(dict.fromkeys(killed))


def tree_for(target) -> signals.Tree:
    """The pidfd tree of a ``enginetree.Target``: a :class:`CgroupsTree` when the target names
    cgroups (``target.cgroups``: a supervised run's own, a container's), else a plain
    :class:`sparkguard.signals.Tree`."""
    cgs = [c for c in getattr(target, "cgroups", None) or [] if c]
    if cgs:
        return CgroupsTree(target.pids, target.starttimes, cgs, root=target.root_pid, term=target.term_pid)
    return signals.Tree(target.pids, target.starttimes, root=target.root_pid, term=target.term_pid)

"""The engine's processes: spawn it, wait for its exit, know its tree, sweep what it leaves.

The tree of a run is the root's descendants plus every process still in its process group
(vLLM never calls setsid, FIELD-NOTES) plus every process recorded as a member with the same
start time (``VLLM::EngineCore`` / ``VLLM::Worker_TP*`` reparented away when the API server was
SIGKILLed, FIELD-NOTES), plus, for a ``docker|podman run`` engine, every process in its
container's cgroup (:mod:`.container`: they run under containerd-shim, outside the client's tree;
the SIGTERM goes to the container's init).  Signals go through pidfds (``sparkguard.signals.Tree``),
so a recycled pid is never signalled.  Where the run has a cgroup of its own (:mod:`.cgroup`), its
members are in the tree too (whatever reparented or setsid'd itself away), its SIGKILL is the
cgroup's, and the sweep waits for the cgroup to empty.
"""

from __future__ import annotations

import logging
import os
import pwd
import select
import subprocess
import time
from typing import Callable

from sparkguard import enginetree, proctree, signals
from sparkguard.guard import escalation
from sparkguard.supervisor import cgroup as cgroups
from sparkguard.supervisor import container

log = logging.getLogger("sparkguard.supervisor")

#: environment a daemon started by systemd has that must not leak into the engine
ENV_DROP = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "LISTEN_FDS", "LISTEN_PID", "LISTEN_FDNAMES")
#: sh resets the oom_score_adj inherited from the daemon (-1000 would make the engine unkillable by
#: the kernel and protected from the guard), then execs the engine: same pid, cmdline intact.
WRAPPER = ("/bin/sh", "-c", 'echo 0 > /proc/self/oom_score_adj 2>/dev/null; exec "$@"', "sparkguard-engine")
#: the same, for an engine that runs in a cgroup of its own: sh first waits for the daemon's "go"
#: line on stdin (a pipe), written once the daemon has moved sh into the run's cgroup (it can move
#: a pid of another user, which the engine's user could not do itself: cgroup-v2.rst, "Delegation
#: Containment"), so no process of the engine ever runs outside it; EOF (the daemon died) exits 70.
#: stdin is /dev/null for the engine, as without a cgroup.
WRAPPER_CGROUP = ("/bin/sh", "-c", 'read -r go; [ "$go" = go ] || exit 70; '
                  'echo 0 > /proc/self/oom_score_adj 2>/dev/null; exec "$@" </dev/null', "sparkguard-engine")


def passwd(user: str):
    """The ``pwd.struct_passwd`` of ``engine.user`` (a name or a numeric uid).  Raises KeyError."""
    return pwd.getpwuid(int(user)) if user.isdigit() else pwd.getpwnam(user)


def spawn(argv: list[str], env: dict[str, str], cwd: str | None, user: str | None,
          cgroup: cgroups.EngineCgroup | None = None, out: dict[str, int] | None = None):
    """Start the engine: own session and process group, stdin /dev/null, stdout/stderr pipes
    (or the fds ``out["stdout"]``/``out["stderr"]``: the FIFOs of :func:`output.make_fifos`),
    oom_score_adj 0 (:data:`WRAPPER`), nice 0 (the guard's raised priority is not inherited), as
    ``user`` (uid, gid and its groups) when given; in ``cgroup`` before it executes
    (:data:`WRAPPER_CGROUP`; ``cgroup.entered`` False: it could not be moved and runs outside).

    Returns:
        ``subprocess.Popen`` (its pid is also its pgid and sid).
    Raises:
        OSError: the command (or ``cwd``) cannot be executed.  KeyError: no such user.
    """
    kw = {}
    if user is not None:
        pw = passwd(user)
        kw.update(user=pw.pw_uid, group=pw.pw_gid, extra_groups=os.getgrouplist(pw.pw_name, pw.pw_gid))
    # the guard runs at a raised CPU priority (harden_self, Nice=-20 in the unit): the engine must not
    # inherit it and compete with the guard or outrank sshd; nice(1) execs, the pid stays the engine's
    prio = os.getpriority(os.PRIO_PROCESS, 0)
    renice = ["nice", "-n", str(-prio)] if prio < 0 else []
    if out is not None:
        kw.update(stdout=out["stdout"], stderr=out["stderr"])
    else:
        kw.update(stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    if cgroup is None:
        return subprocess.Popen(list(WRAPPER) + renice + argv, stdin=subprocess.DEVNULL, cwd=cwd, env=env,
                                start_new_session=True, close_fds=True, **kw)
    proc = subprocess.Popen(list(WRAPPER_CGROUP) + renice + argv, stdin=subprocess.PIPE, cwd=cwd, env=env,
                            start_new_session=True, close_fds=True, **kw)
    cgroup.enter(proc.pid)
    try:
        proc.stdin.write(b"go\n")
        proc.stdin.close()
    except OSError:         # sh already gone (cannot happen before it read): its exit is seen as usual
        pass
    return proc


def proc_state(pid: int) -> str | None:
    """The state letter of /proc/PID/stat (proc(5) field 3), None if gone."""
    st = proctree.stat_fields(f"/proc/{pid}/stat")
    return st[1][0].decode() if st and st[1] else None


def wait_exit(pid: int) -> tuple[int | None, int | None]:
    """Block on the child's pidfd until it exits; ``(exit code, None)`` or ``(None, signal number)``
    (``(None, None)`` when unknown).  The child is not reaped (waitid WNOWAIT): its pid and process
    group id stay reserved until the caller reaps it (after the sweep)."""
    try:
        fd = os.pidfd_open(pid)
    except OSError:
        fd = None
    try:
        if fd is not None:
            select.select([fd], [], [])
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
        if info is None:
            return None, None
        if info.si_code == os.CLD_EXITED:
            return info.si_status, None
        return None, info.si_status
    except ChildProcessError:
        return None, None
    finally:
        if fd is not None:
            os.close(fd)


def poll_exit(pid: int) -> tuple[int | None, int | None] | None:
    """The child's exit status if it has exited, without waiting and without reaping it
    (``waitid`` WEXITED|WNOHANG|WNOWAIT, ``man:waitid(2)``): ``(exit code, None)`` or
    ``(None, signal number)``; None while it runs (or when it is not our child)."""
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except (ChildProcessError, OSError):
        return None
    if info is None:
        return None
    return (info.si_status, None) if info.si_code == os.CLD_EXITED else (None, info.si_status)


def _outside(procs: dict, tree, pgid: int, members: dict[int, int], ctr=None,
             cg_pids=frozenset()) -> list[int]:
    """Processes not in ``tree`` that still belong to the run: its process group, a recorded
    member with the same start time, a process of its container (``ctr``,
    :class:`container.Container`) or a member of its cgroup (``cg_pids``); never a kernel thread."""
    inside = container.members(ctr, procs)
    return [p.pid for p in procs.values()
            if p.pid not in tree and not p.kthread
            and (p.pgrp == pgid or members.get(p.pid) == p.starttime or inside.get(p.pid) == p.starttime
                 or p.pid in cg_pids)]


def cgroup_pids(run) -> frozenset[int]:
    """Members of the run's cgroup (empty without one): :meth:`cgroup.EngineCgroup.pids`."""
    cg = getattr(run, "cgroup", None)
    return frozenset(cg.pids()) if cg is not None else frozenset()


def target(run, procs: dict, protector, details: bool = True):
    """The run's tree as the guard's target (``enginetree.Target``, pattern ``"engine:supervised"``):
    root, descendants and reparented members hung under the root; None when the root is gone
    (exited, a zombie, or its pid reused).  ``details=False``: no tree rows / memory yet
    (``enginetree.add_details`` after the signal)."""
    root = procs.get(run.pid)
    if root is None or (run.starttime and root.starttime != run.starttime) or proc_state(run.pid) in ("Z", None):
        return None
    kids = proctree.children_map(procs)
    extra = _outside(procs, set(proctree.descendants([run.pid], kids)), run.pgid, run.members, run.container,
                     cgroup_pids(run))
    if extra:
        kids = dict(kids)
        kids[run.pid] = list(kids.get(run.pid, [])) + extra
    t = enginetree.build_target(run.pid, "engine:supervised", procs, kids, protector, details=details)
    t.term_pid = _init(run, t.starttimes)
    cg, ctr = getattr(run, "cgroup", None), run.container
    t.cgroups = [c for c in (cg.path if cg is not None else None, ctr.cgroup if ctr is not None else None) if c]
    return t


def _init(run, starttimes: dict[int, int]) -> int | None:
    """The container's init when the run is a ``docker run`` engine whose container is known and
    its init is in ``starttimes`` with its own start time: the member that gets the SIGTERM
    (``signals.Tree`` ``term``), as ``docker stop`` sends it; else None (the root gets it)."""
    ctr = run.container
    return ctr.pid if ctr is not None and starttimes.get(ctr.pid) == ctr.starttime else None


def signal_tree(run):
    """pidfd ``signals.Tree`` of the run (root first, then live members, process-group members
    and cgroup members; a :class:`cgroup.CgroupTree` when the run has a cgroup); every process
    found is recorded in ``run.members``."""
    procs = proctree.scan()
    kids = proctree.children_map(procs)
    pids = [pid for pid in proctree.descendants([run.pid], kids) if pid in procs]
    pids += _outside(procs, set(pids), run.pgid, run.members, run.container, cgroup_pids(run))
    for pid in pids:
        run.members.setdefault(pid, procs[pid].starttime)
    if run.pid not in pids:
        pids.insert(0, run.pid)
    starts = {pid: procs[pid].starttime for pid in pids if pid in procs}
    if getattr(run, "cgroup", None) is not None:
        return cgroups.CgroupTree(pids, starts, run.cgroup, term=_init(run, starts))
    return signals.Tree(pids, starts, term=_init(run, starts))


def refresh_members(run) -> bool:
    """Record every process of the run's tree and process group in ``run.members`` (pid ->
    start time), so that the sweep finds reparented ones.  Returns True when it changed."""
    procs = proctree.scan()
    kids = proctree.children_map(procs)
    found = [procs[pid] for pid in proctree.descendants([run.pid], kids) if pid in procs]
    cg = cgroup_pids(run)
    found += [p for p in procs.values() if p.pgrp == run.pgid or p.pid in cg]
    seen = {p.pid: p.starttime for p in found}
    # the container's members come with their start times (read now for one born after the scan)
    seen.update(container.members(run.container, procs))
    changed = False
    for pid, starttime in seen.items():
        if run.members.get(pid) != starttime:
            run.members[pid] = starttime
            changed = True
    return changed


def leftovers(pgid: int | None, members: dict[int, int], exclude: int | None = None,
              group_ok: bool = True, cgroup: cgroups.EngineCgroup | None = None) -> dict[int, int]:
    """Live (non-zombie) processes in process group ``pgid`` (when ``group_ok``), recorded in
    ``members`` with the same starttime, or in ``cgroup``; never sparkguard itself, pid 1 or a
    kernel thread.  Returns {pid: starttime}."""
    procs = proctree.scan()
    me = os.getpid()
    cg = frozenset(cgroup.pids()) if cgroup is not None else frozenset()
    out = {}
    for p in procs.values():
        if p.pid in (me, exclude) or p.kthread or p.pid <= 1:
            continue
        if (group_ok and pgid and p.pgrp == pgid) or members.get(p.pid) == p.starttime or p.pid in cg:
            if proc_state(p.pid) not in ("Z", "X", None):
                out[p.pid] = p.starttime
    return out


def sweep(pgid: int | None, members: dict[int, int], grace: float, protect, note: Callable[[str, str], None],
          exclude: int | None = None, group_ok: bool = True,
          cgroup: cgroups.EngineCgroup | None = None, deadline=None) -> list[int]:
    """SIGTERM every :func:`leftovers` process, wait ``grace`` seconds for all, SIGKILL (and
    process_mrelease) the rest, wait up to 10 s more: one escalation of
    :mod:`sparkguard.guard.escalation` on the leftovers (blocks the calling thread).  With the
    run's ``cgroup``: its members count, the SIGKILL is ``cgroup.kill`` (:class:`cgroup.CgroupTree`)
    and "gone" is the cgroup emptied (``populated 0``) as well as every pidfd readable.

    Args:
        protect: ``targets.protect`` patterns (never SIGKILLed).
        note: ``(event, detail)`` history callback ("sweep").
        deadline: the run's :class:`stopbudget.Deadline`, or None: the leftovers get only the
            grace left since the run's first SIGTERM (none once it ended: SIGKILL at once) and the
            waits end before the deadline's cleanup reserve.
    Returns:
        list[int], the pids found (empty: nothing was left).
    """
    left = leftovers(pgid, members, exclude, group_ok, cgroup)
    if not left:
        return []
    pids = sorted(left)
    titles = []
    for pid in pids[:8]:
        p = proctree.read_proc(pid)
        titles.append(f"{pid} {p.cmdline[:40] if p else '?'}")
    note("sweep", f"{len(pids)} leftover processes of the engine: " + ", ".join(titles))
    tree = signals.Tree(pids, left) if cgroup is None else cgroups.CgroupTree(pids, left, cgroup)
    full = grace
    if deadline is not None:
        grace = deadline.grace_left()

    def wait(seconds: float) -> bool:
        if deadline is not None:
            seconds = deadline.before_cleanup(seconds)
        if cgroup is None:
            return escalation.wait_gone(tree, seconds)
        t_end = time.monotonic() + seconds
        return cgroup.wait_empty(seconds) and escalation.wait_gone(tree, max(0.0, t_end - time.monotonic()))

    def noted(event: str, esc: escalation.Escalation, killed: list[int]) -> None:
        if event == "sigkill":
            note("sweep", f"SIGKILL {len(killed)} leftovers still alive after {full:g} s"
                 + (" since the run's first SIGTERM" if deadline is not None else ""))
    escalation.OWNER.stop(tree, "sweep", grace, wait, protector=enginetree.Protector(protect), term_all=True,
                          note=noted)
    return pids

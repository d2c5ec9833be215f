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
* else a cgroup v1 ``freezer`` hierarchy's directory: ``freezer.state`` ``FROZEN``, every member
  SIGKILLed, ``THAWED`` (a v1-frozen task dies of a SIGKILL only once thawed: kernel
  Documentation/admin-guide/cgroup-v1/freezer-subsystem.rst), then the pidfd rounds;
* else (other cgroup v1 hierarchies) the pidfd rounds alone.

A guard-only target (an engine the guard did not start, in no cgroup of its own) is given one
(:class:`VictimCgroups`, :func:`enclose`): right before its SIGTERM every live member is moved into
an empty cgroup of the guard's own (``victim-<daemon pid>-<n>``, made ahead of time), so every
process it forks from then on, one that double-forks and calls setsid included, is a member, and
the SIGKILL above converges on it as on a supervised engine's cgroup.

The tree is gone (:meth:`CgroupsTree.gone`) when every tracked member has exited *and* each of its
cgroups is empty (``cgroup.events`` ``populated 0``; v1: no pid in ``cgroup.procs``), never on the
pidfds alone: a fork racing the SIGKILL is a live process no pidfd of ours names.

A cgroup holding a protected process (``targets.protect``) is never killed whole: its members
are SIGKILLed one by one, the protected ones skipped, and it is not waited for to empty.  Nothing
here raises or waits; every file read is bounded (:func:`sparkguard.supervisor.cgroup.members`).
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import select

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
        how: str, how the last :meth:`kill_all` killed (``"cgroup.kill"``, ``"freeze"``, ``"freezer"``
            (v1), ``"pidfd"``).
        spared: set[str], the cgroups :meth:`kill_all` did not kill whole (they hold a protected
            process): :meth:`gone` does not wait for them to empty.
    """

    def __init__(self, pids: list[int], starttimes: dict[int, int], cgroups: list[str], root: int | None = None,
                 term: int | None = None, use_kill: bool = True):
        self.cgroups = [c for c in dict.fromkeys(cgroups) if c]
        self.use_kill = use_kill
        self.how = ""
        self.spared: set[str] = set()
        self.signalled: set[int] = set()
        super().__init__(pids, starttimes, root, term)
        self.add_members()

    def add_members(self) -> list[int]:
        """Open pidfds for members of the cgroups not yet in the tree (never this process); the pids added."""
        return cgroups.add_pids(self, [pid for cg in self.cgroups for pid in cgroups.members(cg)])

    def sweep(self) -> list[int]:
        return self.add_members() + super().sweep()

    def gone(self) -> bool:
        """True when every tracked member has exited and every cgroup of the tree but the spared
        ones is empty (module doc).  A cgroup that cannot be read any more (removed) is empty."""
        return super().gone() and not any(occupied(cg) for cg in self.cgroups if cg not in self.spared)

    def _guarded(self, cg: str, protector: enginetree.Protector | None) -> bool:
        return protector is not None and any(
            (p := proctree.read_proc(pid)) is not None and protector.protected(p) for pid in cgroups.members(cg))

    def kill_all(self, protector: enginetree.Protector | None = None) -> list[int]:
        """SIGKILL the tree: each cgroup whole (module doc), then every member left through its pidfd.
        Returns the pids signalled (a pid once)."""
        self.add_members()
        lingering = [pid for pid in self.alive() if pid in self.signalled]
        if lingering:       # SIGKILLed by an earlier pass and still there: frozen by someone in a v1 freezer?
            thaw_v1(lingering, protector)
        killed: list[int] = []
        frozen: list[tuple[str, str]] = []      # (file, the value that thaws it)
        hows = set()
        for cg in self.cgroups:
            if self._guarded(cg, protector):
                self.spared.add(cg)
                continue
            self.spared.discard(cg)
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
                frozen.append((os.path.join(cg, "cgroup.freeze"), "0"))
            elif os.path.isfile(os.path.join(cg, "freezer.state")) and \
                    _write(os.path.join(cg, "freezer.state"), "FROZEN"):
                hows.add("freezer")
                frozen.append((os.path.join(cg, "freezer.state"), "THAWED"))
        try:
            killed = cgroups.kill_rounds(self, killed, protector)
        finally:
            for path, thaw in frozen:   # the SIGKILLed members exit once thawed (v1: only then); a protected one runs on
                _write(path, thaw)
        if frozen:          # forked while the freeze was still going on (v1's FREEZING): SIGKILLed now
            killed = cgroups.kill_rounds(self, killed, protector)
        self.how = "+".join(sorted(hows)) or "pidfd"
        self.signalled.update(killed)
        return list(dict.fromkeys(killed))

    @classmethod
    def taking_over(cls, tree: signals.Tree, cgroup_dirs: list[str]) -> CgroupsTree:
        """A :class:`CgroupsTree` over ``cgroup_dirs`` that takes ``tree``'s pidfds (no pidfd is
        opened again; ``tree`` is left empty, its :meth:`close` closes nothing)."""
        new = cls.__new__(cls)
        new.cgroups = [c for c in dict.fromkeys(cgroup_dirs) if c]
        new.use_kill, new.how, new.spared, new.signalled = True, "", set(), set()
        new.root, new.term = tree.root, tree.term
        new.fds, new.starttimes = tree.fds, tree.starttimes
        tree.fds, tree.starttimes = {}, {}
        return new


def occupied(cg: str) -> bool:
    """True while cgroup directory ``cg`` or one below it holds a live process: cgroup2's
    ``cgroup.events`` (``populated``), else (v1) a pid in its ``cgroup.procs`` or a child's."""
    p = cgroups.populated(cg)
    return bool(cgroups.members(cg)) if p is None and os.path.isdir(cg) else bool(p)


def thaw_v1(pids: list[int], protector: enginetree.Protector | None = None) -> list[str]:
    """Thaw the cgroup v1 ``freezer`` cgroups that hold ``pids`` (SIGKILLed members still alive)
    and are frozen (``freezer.state`` not ``THAWED``): a task frozen there dies of its pending
    SIGKILL only once thawed (freezer-subsystem.rst), so a victim someone froze (``docker
    pause`` on cgroup v1) would otherwise hold its memory until the guard gives up on it.  A
    cgroup holding a protected process is left frozen.  Returns the directories thawed; never raises."""
    fz = None
    out: list[str] = []
    for pid in pids:
        for line in (cgroups._read(f"/proc/{pid}/cgroup") or "").splitlines():
            parts = line.split(":", 2)
            if len(parts) != 3 or "freezer" not in parts[1].split(",") or parts[2].strip() in ("", "/"):
                continue
            if fz is None:
                fz = _freezer_mount() or ("", "")
            if not fz[0]:
                return out
            d = cgroups.cgroup_dir(fz, parts[2].strip())
            state = (cgroups._read(os.path.join(d, "freezer.state")) or "").strip()
            if d in out or state in ("", "THAWED"):
                continue
            if protector is not None and any((p := proctree.read_proc(m)) is not None and protector.protected(p)
                                             for m in cgroups.members(d)):
                continue
            if _write(os.path.join(d, "freezer.state"), "THAWED"):
                log.warning("the victim's pid %d was frozen in the cgroup v1 freezer %s (%s); thawed, so that "
                            "its SIGKILL takes", pid, d, state)
                out.append(d)
    return out


def tree_for(target) -> signals.Tree:
    """The pidfd tree of a ``enginetree.Target``: a :class:`CgroupsTree` when the target names
    cgroups (``target.cgroups``: a supervised run's own, a container's), else a plain
    :class:`sparkguard.signals.Tree`."""
    cgs = [c for c in getattr(target, "cgroups", None) or [] if c]
    if cgs:
        return CgroupsTree(target.pids, target.starttimes, cgs, root=target.root_pid, term=target.term_pid)
    return signals.Tree(target.pids, target.starttimes, root=target.root_pid, term=target.term_pid)


# ---- a cgroup of the guard's own for a guard-only victim -------------------------------------------

VICTIM = "victim-"          #: prefix of the guard's victim cgroups: ``victim-<daemon pid>-<n>``
GATHER_ROUNDS = 8           #: passes over the stopped members' children at most (:func:`enclose`)
GATHER_MAX = 4096           #: processes added at most by one :func:`enclose`


def _freezer_mount(mountinfo: str = "/proc/self/mountinfo") -> tuple[str, str] | None:
    """The cgroup v1 ``freezer`` hierarchy's ``(mount point, root)``: the ``cgroup`` mount whose
    super options name ``freezer`` (proc(5) mountinfo); None when none is mounted."""
    for line in (cgroups._read(mountinfo) or "").splitlines():
        left, sep, right = line.partition(" - ")
        a, b = left.split(), right.split()
        if sep and len(a) >= 5 and len(b) >= 3 and b[0] == "cgroup" and "freezer" in b[2].split(","):
            return cgroups._unescape(a[4]), cgroups._unescape(a[3])
    return None


def _freezer_parent(mountinfo: str = "/proc/self/mountinfo", proc_cgroup: str = "/proc/self/cgroup") -> str | None:
    """This process's directory in the cgroup v1 ``freezer`` hierarchy (cgroups(7): the
    ``ID:freezer:PATH`` line of /proc/self/cgroup under :func:`_freezer_mount`), None when there is none."""
    mount = _freezer_mount(mountinfo)
    if mount is None:
        return None
    for line in (cgroups._read(proc_cgroup) or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3 and "freezer" in parts[1].split(","):
            return cgroups.cgroup_dir(mount, parts[2].strip() or "/")
    return None


class VictimCgroups:
    """The guard's own cgroups for guard-only victims: one empty spare is kept ready, so that the
    crossing pays only the writes to its ``cgroup.procs`` (:func:`enclose`); used ones are
    removed once empty (:meth:`tidy`, off the poll loop's hot path).

    Args:
        parent: str, the directory they are made in: the guard's cgroup2 place
            (:func:`sparkguard.supervisor.cgroup.place`, the parent of engine cgroups), else its
            directory in a v1 ``freezer`` hierarchy; None: the guard has no cgroup to give (the
            victim is then SIGKILLed through pidfds alone, as before).
        why: str, one line for the log: where, or why none.
    Attributes:
        spare: str, the empty cgroup the next victim goes into, or None.
        used: list[str], victim cgroups not removed yet (still populated, or not tried).
    """

    def __init__(self, parent: str | None, why: str):
        self.parent, self.why = parent, why
        self.spare: str | None = None
        self.used: list[str] = []
        self._n = 0

    @classmethod
    def find(cls, **place_args) -> VictimCgroups:
        """Where this daemon can make victim cgroups (class doc).  Never raises."""
        pl = cgroups.place(**place_args)
        if pl.mode == cgroups.CGROUP and pl.parent:
            return cls(pl.parent, f"cgroup2 {pl.parent}")
        fz = _freezer_parent()
        if fz is not None and os.access(fz, os.W_OK):
            return cls(fz, f"cgroup v1 freezer {fz} (no cgroup2: {pl.reason})")
        return cls(None, f"none: {pl.reason}; no writable cgroup v1 freezer")

    def ready(self) -> str | None:
        """Make the spare when there is none (mkdir); the spare, or None (logged once) when it cannot be made."""
        if self.spare is not None or self.parent is None:
            return self.spare
        for _ in range(100):
            self._n += 1
            path = os.path.join(self.parent, f"{VICTIM}{os.getpid()}-{self._n}")
            try:
                os.mkdir(path)
            except FileExistsError:
                continue
            except OSError as e:
                log.warning("cannot make the victim cgroup %s (%s): a guard-only target's SIGKILL goes through "
                            "pidfds alone", path, e)
                self.parent = None
                return None
            self.spare = path
            return path
        return None

    def take(self) -> str | None:
        """The spare, now the victim's (remembered for :meth:`tidy`); None when there is none."""
        path, self.spare = self.spare, None
        if path is not None:
            self.used.append(path)
        return path

    def tidy(self) -> None:
        """rmdir the used victim cgroups that are empty (one still populated is tried again next
        time), then make a new spare.  Never raises."""
        left = []
        for path in self.used:
            try:
                os.rmdir(path)
            except FileNotFoundError:
                pass
            except OSError as e:
                if e.errno != errno.EBUSY:
                    log.warning("cannot remove the victim cgroup %s: %s", path, e)
                left.append(path)
        self.used = left
        self.ready()

    def remove_stale(self) -> list[str]:
        """rmdir empty ``victim-<pid>-<n>`` cgroups left under the parent by daemons no longer
        running (their pid gone); the paths removed.  Never raises."""
        out = []
        if self.parent is None:
            return out
        try:
            with os.scandir(self.parent) as it:
                names = [e.name for e in it if e.name.startswith(VICTIM) and e.is_dir(follow_symlinks=False)]
        except OSError:
            return out
        for name in names:
            pid = name[len(VICTIM):].split("-")[0]
            if not pid.isdigit() or int(pid) == os.getpid() or os.path.exists(f"/proc/{pid}"):
                continue
            try:
                os.rmdir(os.path.join(self.parent, name))
                out.append(os.path.join(self.parent, name))
            except OSError:
                pass
        return out

    def close(self) -> None:
        """The daemon stops: remove the spare and the used cgroups that are empty."""
        if self.spare is not None:
            self.used.append(self.spare)
            self.spare = None
        parent, self.parent = self.parent, None     # no new spare
        self.tidy()
        self.parent = parent


def _exited(fd: int) -> bool:
    p = select.poll()
    p.register(fd, select.POLLIN)
    return bool(p.poll(0))


def _move(procs_fd: int, tree: signals.Tree, pid: int) -> bool:
    """Write member ``pid`` into the open ``cgroup.procs``.  The pid is the member's: its pidfd
    was not readable (not exited) before the write, so the number was not free to be reused;
    if it has become readable by the write the member exited meanwhile, and the number could
    only have gone to another process after the whole pid space wrapped, within microseconds.
    False when the member has exited or the write failed (logged)."""
    fd = tree.fds.get(pid)
    if fd is None or _exited(fd):
        return False
    try:
        os.write(procs_fd, str(pid).encode())
        return True
    except ProcessLookupError:
        return False
    except OSError as e:
        log.warning("cannot move pid %d into the victim cgroup (%s)", pid, e)
        return False


def enclose(tree: signals.Tree, path: str, protector: enginetree.Protector | None = None) -> CgroupsTree | None:
    """Stop the plain ``tree`` and move it into the empty cgroup ``path`` before its SIGTERM, so
    that every process it forks from then on is a member; return a :class:`CgroupsTree` over
    ``path`` that has taken ``tree``'s pidfds.  The caller SIGTERMs it, then :func:`resume`\ s it.

    1. SIGSTOP every live member through its pidfd (microseconds each): a stopped process
       neither allocates nor forks, and a fork in progress when the stop comes is restarted
       by the kernel after it (copy_process refuses to finish with a signal pending), so the
       tree stops growing at once;
    2. the children its members had forked since the scan that chose it are stopped and added
       too, pass after pass (:data:`GATHER_ROUNDS`, :data:`GATHER_MAX`; never a protected
       process or a kernel thread): each pass finds only processes that were running, and
       what it stops forks no more, so the passes end;
    3. every member is written into ``path``'s ``cgroup.procs``.
    Only the tree's members are stopped and moved (the pids its pidfds name, checked against
    their start times; protected processes are never members): the guard touches nothing it
    would not SIGKILL.  Cost: the kernel's first migration after a quiet spell waits for an RCU
    grace period (``cgroup_threadgroup_rwsem``: 5-11 ms on the 2-core test VM, the later writes
    ~20 us each), during which the tree is stopped.  None (logged; the tree resumed and
    unchanged) when ``cgroup.procs`` cannot be opened or no member could be moved."""
    try:
        procs_fd = os.open(os.path.join(path, "cgroup.procs"), os.O_WRONLY)
    except OSError as e:
        log.warning("cannot open %s/cgroup.procs (%s): the victim's SIGKILL goes through pidfds alone", path, e)
        return None
    try:
        _stop_all(tree, protector)
        moved = [pid for pid in tree.alive() if _move(procs_fd, tree, pid)]
    except BaseException:
        resume(tree)        # never leave an engine stopped
        raise
    finally:
        os.close(procs_fd)
    if not moved:
        resume(tree)
        return None
    return CgroupsTree.taking_over(tree, [path])


def resume(tree: signals.Tree) -> None:
    """SIGCONT every member of a tree :func:`enclose` stopped (after its SIGTERM: the engine's
    handler runs as soon as it continues).  Never raises."""
    for pid in list(tree.fds):
        tree.send(pid, signal.SIGCONT)


def _children(pid: int) -> list[int]:
    """Children of ``pid`` (every thread's ``/proc/PID/task/TID/children``, proc(5)); [] if unreadable."""
    out = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        text = cgroups._read(f"/proc/{pid}/task/{tid}/children") or ""
        out += [int(t) for t in text.split() if t.isdigit()]
    return out


def _stop_all(tree: signals.Tree, protector: enginetree.Protector | None) -> list[int]:
    """SIGSTOP every live member of ``tree``, then the children they forked that it does not
    hold yet (added to it), up to :data:`GATHER_ROUNDS` passes and :data:`GATHER_MAX` added.
    Returns the pids added."""
    todo = tree.alive()
    seen = set(tree.fds)
    added: list[int] = []
    for _ in range(GATHER_ROUNDS):
        for pid in todo:
            tree.send(pid, signal.SIGSTOP)
        kids = [k for pid in todo for k in _children(pid) if k not in seen]
        if not kids or len(added) >= GATHER_MAX:
            break
        seen.update(kids)
        todo = []
        for k in kids:
            p = proctree.read_proc(k)
            if p is None or p.kthread or (protector is not None and protector.protected(p)):
                continue
            if tree.add([k], {k: p.starttime}):
                todo.append(k)
        added += todo
    return added

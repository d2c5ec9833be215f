"""Each engine run in a cgroup v2 of its own: where to make it, its members, its SIGKILL, its emptying.

Membership of a cgroup is inherited by every child and kept across reparenting, a double fork
and setsid (only a write to another cgroup's ``cgroup.procs`` moves a process out, and that
needs write access to both: kernel Documentation/admin-guide/cgroup-v2.rst, "Processes"), so
the members of a run's cgroup are its tree with nothing escaping.  The kernel interface used:

* ``cgroup.procs``: the pids of the cgroup's own processes, one per line (a zombie is no
  longer listed: measured here, kernel 6.18); writing a pid moves that process (all its threads).
* ``cgroup.kill`` (Linux >= 5.14): writing ``1`` SIGKILLs every process of the cgroup and its
  descendants, forks racing the write included (cgroup-v2.rst "cgroup.kill").  Without it each
  member is SIGKILLed through a pidfd (:class:`CgroupTree`).
* ``cgroup.events``: ``populated 0|1``, 1 while the cgroup or a descendant holds a live
  process; a change wakes poll(2) with POLLPRI|POLLERR (cgroup-v2.rst "cgroup.events",
  kernfs_notify); measured here: an unreaped zombie root already counts as gone (populated 0).
* ``rmdir`` removes an empty cgroup (EBUSY while populated or with children).

Where engine cgroups are made (:func:`place`):

* under systemd (the daemon's cgroup is a ``.service`` or ``.scope`` unit's): only when the unit
  delegates its subtree (``Delegate=yes``, systemd.resource-control(5)); systemd marks a
  delegated cgroup with the ``trusted.delegate`` extended attribute (``user.delegate`` too
  since systemd 251: systemd docs/CGROUP_DELEGATION.md, "Delegation"); where neither can be
  read (systemd < 251 and no CAP_SYS_ADMIN, which ``trusted.*`` needs) a write test decides
  (:func:`delegation`).  Its "no processes in
  inner nodes" rule (same document, and cgroup-v2.rst "No Internal Process Constraint") makes
  the daemon first move itself into the leaf ``<unit cgroup>/guard``; engines go to
  ``<unit cgroup>/engine-<run id>``, siblings of that leaf.  Without delegation systemd owns the
  unit's subtree and the daemon leaves it alone (process-group tracking).
* elsewhere (no systemd, or a test): children of the daemon's own cgroup, when writable.
* ``$SPARKGUARD_ENGINE_CGROUP_PARENT``: a cgroup2 directory to make them in instead, or
  ``none`` to keep process-group tracking.

Every reader takes a path (fixture trees in tests) and returns None/empty on a failure it logs;
nothing here raises into the poll loop.
"""

from __future__ import annotations

import errno
import logging
import os
import select
import time
from dataclasses import dataclass

from sparkguard import enginetree, proctree, signals
from sparkguard.supervisor.cgroup_delegation import delegate_xattr, delegation

log = logging.getLogger("sparkguard.supervisor")

CGROUP = "cgroup"                 #: tracking mode: the run's cgroup
PGROUP = "process-group"          #: tracking mode: process group, descendants, recorded members
ENV_PARENT = "SPARKGUARD_ENGINE_CGROUP_PARENT"
LEAF = "guard"                    #: the daemon's own leaf under a delegated systemd unit
MAX_READ = 1 << 20                #: bytes read at most from one cgroup file (~100k pids)
MAX_DEPTH = 16                    #: nested cgroups walked at most below a run's cgroup
KILL_ROUNDS = 5                   #: pidfd SIGKILL passes without cgroup.kill (forks racing the kill)


def _read(path: str) -> str | None:
    """Text of a kernfs/proc file (at most :data:`MAX_READ` bytes), None if unreadable."""
    try:
        with open(path, "rb") as f:
            return f.read(MAX_READ).decode("utf-8", "replace")
    except OSError:
        return None


def _write(path: str, text: str) -> OSError | None:
    """Write ``text`` in one write(2); the error, or None on success."""
    try:
        fd = os.open(path, os.O_WRONLY)
    except OSError as e:
        return e
    try:
        os.write(fd, text.encode())
        return None
    except OSError as e:
        return e
    finally:
        os.close(fd)


def _unescape(field: str) -> str:
    """A mountinfo path field with its octal escapes (``\\040`` for a space) decoded (proc(5))."""
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and i + 3 < len(field) and field[i + 1:i + 4].isdigit():
            out.append(chr(int(field[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def find_mount(mountinfo: str = "/proc/self/mountinfo") -> tuple[str, str] | None:
    """The cgroup2 hierarchy: ``(mount point, root of the mount within the hierarchy)``.

    Reads proc(5) mountinfo lines (``ID PARENT MAJ:MIN ROOT MOUNTPOINT OPTS [TAGS] - FSTYPE ...``);
    with several cgroup2 mounts, ``/sys/fs/cgroup`` (pure v2, systemd's default) wins over
    ``/sys/fs/cgroup/unified`` (the v1 hybrid) over any other.  None when none is mounted.
    """
    text = _read(mountinfo)
    if text is None:
        return None
    found = []
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        if not sep or not right.split() or right.split()[0] != "cgroup2":
            continue
        f = left.split()
        if len(f) >= 5:
            found.append((_unescape(f[4]), _unescape(f[3])))
    rank = {"/sys/fs/cgroup": 0, "/sys/fs/cgroup/unified": 1}
    found.sort(key=lambda m: rank.get(m[0], 2))
    return found[0] if found else None


def own_path(proc_cgroup: str = "/proc/self/cgroup") -> str | None:
    """This process's cgroup2 path (the ``0::PATH`` line of /proc/self/cgroup, cgroups(7)), None if absent."""
    text = _read(proc_cgroup)
    for line in (text or "").splitlines():
        if line.startswith("0::"):
            return line[3:].strip() or "/"
    return None


def cgroup_dir(mount: tuple[str, str], path: str) -> str:
    """The directory of cgroup ``path`` (as /proc/PID/cgroup shows it) under ``mount`` (:func:`find_mount`)."""
    point, root = mount
    if root != "/" and (path == root or path.startswith(root.rstrip("/") + "/")):
        path = path[len(root.rstrip("/")):] or "/"
    return os.path.join(point, path.lstrip("/")).rstrip("/") or "/"


def delegated(path: str) -> bool:
    """True when systemd marked cgroup directory ``path`` as delegated (module doc: the xattrs)."""
    return delegate_xattr(path) is not None


def is_cgroup2(path: str) -> bool:
    """True when ``path`` is a cgroup2 directory (it has ``cgroup.procs`` and ``cgroup.events``,
    or is a root, which has ``cgroup.procs`` and no ``cgroup.events``)."""
    return os.path.isfile(os.path.join(path, "cgroup.procs")) and (
        os.path.isfile(os.path.join(path, "cgroup.events")) or os.path.isfile(os.path.join(path, "cgroup.max.depth")))


@dataclass
class Placement:
    """Where this daemon makes its engines' cgroups, or why it cannot.

    Attributes:
        mode: :data:`CGROUP` or :data:`PGROUP`.
        parent: str, the cgroup2 directory engine cgroups are made in (None in :data:`PGROUP` mode).
        reason: str, one line: why this mode (shown in status and the log).
        delegation: str, how systemd's delegation was found (:func:`delegation`: ``"xattr"``,
            ``"write-test"``), ``""`` when no systemd unit was involved.
    """

    mode: str
    parent: str | None
    reason: str
    delegation: str = ""


def _fallback(reason: str) -> Placement:
    return Placement(PGROUP, None, reason)


def _writable(parent: str) -> str | None:
    """None when cgroups can be made and filled under ``parent``, else why not."""
    if not is_cgroup2(parent):
        return f"{parent} is not a cgroup2 directory"
    if not os.access(parent, os.W_OK) or not os.access(os.path.join(parent, "cgroup.procs"), os.W_OK):
        return f"{parent} is not writable (read-only mount, e.g. ProtectControlGroups=yes, or no permission)"
    return None


def place(mountinfo: str = "/proc/self/mountinfo", proc_cgroup: str = "/proc/self/cgroup",
          env: dict | None = None, move_self: bool = True, **detect) -> Placement:
    """Decide where engine cgroups are made (module doc); under a delegated systemd unit, move
    this process into ``<unit cgroup>/guard`` first (``move_self``).  Never raises.

    Args:
        mountinfo, proc_cgroup: the files read (fixture trees in tests).
        env: the environment (default ``os.environ``), for :data:`ENV_PARENT`.
        detect: :func:`delegation`'s ``cap_sys_admin``, ``version``, ``probe`` (tests).
    Returns:
        :class:`Placement`.
    """
    env = os.environ if env is None else env
    forced = (env.get(ENV_PARENT) or "").strip()
    if forced.lower() == "none":
        return _fallback(f"{ENV_PARENT}=none")
    if forced:
        why = _writable(forced)
        return _fallback(why) if why else Placement(CGROUP, forced.rstrip("/"), f"{ENV_PARENT}={forced}")
    mount = find_mount(mountinfo)
    if mount is None:
        return _fallback("no cgroup2 hierarchy is mounted")
    path = own_path(proc_cgroup)
    if path is None:
        return _fallback("no cgroup2 line (0::) in /proc/self/cgroup")
    here = cgroup_dir(mount, path)
    base = os.path.basename(here)
    unit = base if base.endswith((".service", ".scope")) else None
    if base == LEAF and os.path.basename(os.path.dirname(here)).endswith((".service", ".scope")):
        unit, here = os.path.basename(os.path.dirname(here)), os.path.dirname(here)   # already moved
    if unit is not None:
        yes, how, found = delegation(here, **detect)
        if not yes:
            return Placement(PGROUP, None, f"systemd unit {unit} does not delegate its cgroup (Delegate=yes): "
                             + found, how)
        why = _writable(here)
        if why:
            return Placement(PGROUP, None, why, how)
        if move_self and base != LEAF:
            leaf = os.path.join(here, LEAF)
            try:
                os.makedirs(leaf, exist_ok=True)
            except OSError as e:
                return Placement(PGROUP, None, f"cannot make {leaf}: {e}", how)
            err = _write(os.path.join(leaf, "cgroup.procs"), str(os.getpid()))
            if err is not None:
                return Placement(PGROUP, None, f"cannot move the daemon into {leaf}: {err}", how)
        return Placement(CGROUP, here, f"delegated by systemd unit {unit} ({found}); the daemon runs in {LEAF}/",
                         how)
    why = _writable(here)
    return _fallback(why) if why else Placement(CGROUP, here, "child of the daemon's own cgroup")


# ---- readers (any cgroup directory; fixture trees in tests) -------------------------------------

def procs(path: str) -> list[int]:
    """Pids in ``path``'s ``cgroup.procs`` (its own processes, not its descendants'); [] if unreadable."""
    text = _read(os.path.join(path, "cgroup.procs"))
    return [int(t) for t in (text or "").split() if t.isdigit()]


def members(path: str) -> list[int]:
    """Pids of ``path`` and every cgroup below it (at most :data:`MAX_DEPTH` levels), sorted."""
    out: set[int] = set()
    stack = [(path, 0)]
    while stack:
        d, depth = stack.pop()
        out.update(procs(d))
        if depth >= MAX_DEPTH:
            continue
        try:
            with os.scandir(d) as it:
                stack += [(e.path, depth + 1) for e in it if e.is_dir(follow_symlinks=False)]
        except OSError:
            continue
    return sorted(out)


def events(path: str) -> dict[str, int] | None:
    """``cgroup.events`` as ``{"populated": 0|1, "frozen": 0|1}``, None if unreadable."""
    text = _read(os.path.join(path, "cgroup.events"))
    if text is None:
        return None
    out = {}
    for line in text.splitlines():
        k, _, v = line.partition(" ")
        if v.strip().isdigit():
            out[k] = int(v)
    return out


def populated(path: str) -> bool | None:
    """True while ``path`` or a descendant holds a live process; None when it cannot be read
    (removed, or not a cgroup)."""
    ev = events(path)
    return None if ev is None or "populated" not in ev else bool(ev["populated"])


def wait_empty(path: str, timeout: float) -> bool:
    """Block up to ``timeout`` seconds until ``path``'s ``populated`` is 0 (True; also when the
    cgroup is gone); False on timeout.  Sleeps in poll(2) on ``cgroup.events`` (POLLPRI), no
    polling interval (module doc)."""
    deadline = time.monotonic() + timeout
    try:
        fd = os.open(os.path.join(path, "cgroup.events"), os.O_RDONLY)
    except OSError:
        return True
    try:
        poller = select.poll()
        poller.register(fd, select.POLLPRI | select.POLLERR)
        while True:
            try:
                os.lseek(fd, 0, os.SEEK_SET)
                text = os.read(fd, 4096).decode()    # also re-arms the notification
            except OSError:
                return True
            if "populated 0" in text:
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            poller.poll(max(1, int(left * 1000)))
    finally:
        os.close(fd)


# ---- one run's cgroup ------------------------------------------------------------------------

class EngineCgroup:
    """The cgroup of one engine run: ``<parent>/engine-<run id>``.

    Attributes:
        path: str, its directory.
        has_kill: bool, ``cgroup.kill`` exists (Linux >= 5.14).
        entered: bool, the engine's root was moved in before it executed (:meth:`enter`).
    """

    def __init__(self, path: str, has_kill: bool | None = None):
        self.path = path
        self.has_kill = os.path.isfile(os.path.join(path, "cgroup.kill")) if has_kill is None else has_kill
        self.entered = False

    @classmethod
    def create(cls, placement: Placement, run_id: float) -> EngineCgroup | None:
        """Make ``engine-<run id>`` (``engine-<run id>-N`` when taken) under ``placement.parent``;
        None (logged) in process-group mode or when mkdir fails."""
        if placement.mode != CGROUP or not placement.parent:
            return None
        name = f"engine-{run_id:.3f}"
        for n in range(1, 10):
            path = os.path.join(placement.parent, name if n == 1 else f"{name}-{n}")
            try:
                os.mkdir(path)
                return cls(path)
            except FileExistsError:
                continue
            except OSError as e:
                log.warning("engine: cannot make cgroup %s (%s); tracking by process group", path, e)
                return None
        log.warning("engine: cgroups %s* all exist; tracking by process group", name)
        return None

    def enter(self, pid: int) -> bool:
        """Move process ``pid`` into this cgroup (``cgroup.procs``); :attr:`entered` says it worked."""
        err = _write(os.path.join(self.path, "cgroup.procs"), str(pid))
        if err is not None:
            log.warning("engine: cannot move pid %d into %s (%s); tracking by process group", pid, self.path, err)
        self.entered = err is None
        return self.entered

    def pids(self) -> list[int]:
        """Live members (this cgroup and its descendants), :func:`members`."""
        return members(self.path)

    def populated(self) -> bool | None:
        return populated(self.path)

    def wait_empty(self, timeout: float) -> bool:
        return wait_empty(self.path, timeout)

    def kill(self) -> bool:
        """SIGKILL every member in one write to ``cgroup.kill``; False (logged) without it or on error."""
        if not self.has_kill:
            return False
        err = _write(os.path.join(self.path, "cgroup.kill"), "1")
        if err is not None:
            log.warning("engine: writing %s/cgroup.kill failed (%s); SIGKILL through pidfds", self.path, err)
            return False
        return True

    def remove(self) -> bool:
        """rmdir this cgroup and any empty cgroups below it (deepest first).  True when it is gone;
        False (logged) while a process is still in it."""
        if not os.path.isdir(self.path):
            return True
        for d, dirs, _ in os.walk(self.path, topdown=False):
            try:
                os.rmdir(d)
            except FileNotFoundError:
                pass
            except OSError as e:
                log.warning("engine: cannot remove cgroup %s (%s): %s", d, e.strerror,
                            "processes are still in it" if e.errno == errno.EBUSY else "left in place")
                return False
        return True


class CgroupTree(signals.Tree):
    """A :class:`sparkguard.signals.Tree` whose members include every process of a run's cgroup.

    :meth:`sweep` adds the cgroup's members (and the parent class's new descendants);
    :meth:`kill_all` SIGKILLs the whole cgroup in one ``cgroup.kill`` write when the cgroup has
    it and holds no protected process, else every member through its pidfd, repeated up to
    :data:`KILL_ROUNDS` times while new members appear (forks racing the kill); members are
    process_mrelease'd either way.

    Args:
        pids, starttimes, root, term: as :class:`sparkguard.signals.Tree`.
        cg: the run's :class:`EngineCgroup`.
    """

    def __init__(self, pids: list[int], starttimes: dict[int, int], cg: EngineCgroup, root: int | None = None,
                 term: int | None = None):
        self.cg = cg
        super().__init__(pids, starttimes, root, term)
        self.add_members()

    def add_members(self) -> list[int]:
        """Open pidfds for cgroup members not yet in the tree; returns the pids added."""
        return add_pids(self, self.cg.pids())

    def sweep(self) -> list[int]:
        return self.add_members() + super().sweep()

    def kill_all(self, protector: enginetree.Protector | None = None) -> list[int]:
        self.add_members()
        live = self.alive()
        guarded = protector is not None and any(
            (p := proctree.read_proc(pid)) is not None and protector.protected(p) for pid in live)
        killed: list[int] = []
        in_cgroup = set(self.cg.pids())        # cgroup.kill reaches these, not members elsewhere
        if not guarded and self.cg.kill():     # (a container engine's processes: docker's cgroup)
            killed = [pid for pid in live if pid in in_cgroup]
            self._release(killed)
            self.add_members()                 # forked before the write: already SIGKILLed too
        return kill_rounds(self, killed, protector)


def add_pids(tree, pids: list[int]) -> list[int]:
    """Open pidfds in ``tree`` (a ``signals.Tree``) for those of ``pids`` not yet in it, never this
    process nor a kernel thread, with their start times read now; returns the pids added."""
    me = os.getpid()
    st = {}
    for pid in dict.fromkeys(pids):
        if pid in tree.fds or pid == me:
            continue
        p = proctree.read_proc(pid)
        if p is not None and not p.kthread:
            st[pid] = p.starttime
    return tree.add(list(st), st)


def kill_rounds(tree, killed: list[int], protector: enginetree.Protector | None) -> list[int]:
    """SIGKILL (and process_mrelease) every live member of ``tree`` not in ``killed``, repeated up
    to :data:`KILL_ROUNDS` times while ``tree.add_members()`` finds new ones (forks racing the
    kill), then once more after a sweep for descendants.  Returns ``killed`` plus the pids signalled."""
    for _ in range(KILL_ROUNDS):
        new = tree._kill([pid for pid in tree.alive() if pid not in killed], protector)
        tree._release(new)
        killed += new
        if not tree.add_members() and not new:
            break
    tree.sweep()
    rest = tree._kill([pid for pid in tree.alive() if pid not in killed], protector)
    tree._release(rest)
    return killed + rest


def remove_stale(parent: str, before: float) -> list[str]:
    """rmdir the empty ``engine-<run id>`` cgroups under ``parent`` made before unix time
    ``before`` (a daemon that died without removing its run's cgroup); populated ones are left
    (a live engine: a later daemon may adopt it) and so are younger ones (another daemon's run
    being started beside this one).  Returns the paths removed; never raises."""
    removed = []
    try:
        with os.scandir(parent) as it:
            names = [e.name for e in it if e.is_dir(follow_symlinks=False) and e.name.startswith("engine-")]
    except OSError:
        return removed
    for name in names:
        try:
            made = float(name[len("engine-"):].split("-")[0])
        except ValueError:
            continue
        path = os.path.join(parent, name)
        if made < before and populated(path) is False and EngineCgroup(path).remove():
            removed.append(path)
    return removed


def describe(placement: Placement, cg: EngineCgroup | None = None, run: bool = False) -> str:
    """One line for the log and status: the mode in force and where, or why process group.

    Args:
        cg: the run's cgroup, if it has one; run: describe a run (one without ``cg`` is tracked
            by process group even where the placement offers cgroups: its cgroup could not be
            made or entered, logged then).
    """
    if cg is not None:
        return f"cgroup {cg.path}" + ("" if cg.has_kill else " (no cgroup.kill: SIGKILL through pidfds)")
    if placement.mode != CGROUP:
        return f"process group ({placement.reason})"
    if run:
        return f"process group (its cgroup under {placement.parent} could not be made or entered; see the log)"
    return f"cgroup under {placement.parent} ({placement.reason})"

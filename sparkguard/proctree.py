"""Process discovery: one pass over /proc, pattern matching, engine trees, protection.

Run off the poll loop's critical path (:mod:`sparkguard.armed` keeps the choice ready
before a crossing), never per poll.  Reads /proc directly (stat, cmdline, status,
smaps_rollup, oom_score, oom_score_adj) in one pass; a process that vanishes mid-scan is
skipped.  Sources: proc(5) for /proc/PID/stat field numbers (ppid = 4, flags = 9,
starttime = 22) and PF_KTHREAD (include/linux/sched.h, 0x00200000).

Everything read from /proc is untrusted text: comm and cmdline pass through :func:`escape`
when they are read, so no title, log line, STATUS= or journal field can carry a raw control
character (a newline in argv would otherwise forge a log line).

A process whose main thread has exited while other threads run (a zombie leader) has an
empty /proc/PID/cmdline and no Vm* lines in /proc/PID/status (both read the leader's mm,
which is gone); its cmdline and memory are read from a live thread's /proc/PID/task/TID.

Target choice (issue #2): processes whose cmdline (setproctitle titles are the whole
cmdline, e.g. ``VLLM::Worker_TP0``) matches one of ``targets.match``; the root of an
engine tree is the topmost process of an unbroken chain of matching ancestors; the tree is
that root and all its descendants.  Several engines: lowest pattern index first (configured order),
then the largest tree memory (RSS + swap, plus each process's GPU memory when NVML is read:
:mod:`sparkguard.gpumem`; RSS alone hides unified-memory GPU allocations, so the configured
order comes first).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from sparkguard import gpumem, meminfo

PF_KTHREAD = 0x00200000


@dataclass
class Proc:
    """One process from the scan.  ``starttime`` is in clock ticks since boot (proc(5) field 22)."""

    pid: int
    ppid: int
    pgrp: int
    comm: str
    cmdline: str
    starttime: int
    kthread: bool


@dataclass
class Target:
    """An engine tree chosen for signalling.

    Attributes:
        root_pid: int, the process that gets SIGTERM.
        title: str, the root's cmdline as :func:`short_title` shows it.
        pattern: str, the ``targets.match`` regex that matched (or :data:`FALLBACK_PATTERN`).
        pids: list[int], root first, then descendants (breadth first), protected ones removed.
        starttimes: dict pid -> starttime (ticks), to detect PID reuse before signalling.
        mem_bytes: int, resident + swapped bytes over the tree (:func:`_status_mem`), plus the
            GPU memory NVML reports for its processes (:mod:`sparkguard.gpumem`) when it is read.
        tree: list[dict] with keys pid, ppid, title (:func:`short_title` of the cmdline, which
            setproctitle makes the title), comm (15 bytes), cmdline, rss_bytes, swap_bytes, oom_score,
            and gpu_bytes while NVML is read.
        rank: int, index of the pattern in ``targets.match`` (``len(match)`` for the fallback).
        launcher: bool, the root only mentions the engine (another matching root below it);
            :func:`find_targets` puts launchers after the real engines of the same rank.
        term_pid: int | None, the member that gets the SIGTERM instead of the root (a supervised
            ``docker run`` engine: the container's init, the root being the client), None: the root.
        cgroups: list[str], cgroup directories whose every process belongs to the tree (a
            supervised run's own cgroup, an engine's container): its SIGKILL is theirs
            (:mod:`sparkguard.guard.cgkill`).
    """

    root_pid: int
    title: str
    pattern: str
    pids: list[int]
    starttimes: dict[int, int]
    mem_bytes: int = 0
    tree: list[dict] = field(default_factory=list)
    rank: int = 0
    launcher: bool = False
    term_pid: int | None = None
    cgroups: list[str] = field(default_factory=list)


FALLBACK_PATTERN = "fallback:oom_score"

def _escape_table() -> dict[int, str]:
    table = {c: f"\\x{c:02x}" for c in (*range(0x20), 0x7f, *range(0x80, 0xa0))}
    table.update({0x0a: "\\n", 0x0d: "\\r", 0x09: "\\t"})
    return table


_ESCAPES = _escape_table()


def escape(text: str) -> str:
    """``text`` with every control character written out: newline, CR and tab as ``\\n``,
    ``\\r``, ``\\t``; the other C0 controls, DEL and the C1 controls (U+0080-U+009F, which
    terminals read as escape sequences) as ``\\xNN``.  Printable text is returned as is."""
    return text if text.isprintable() else text.translate(_ESCAPES)


READ_LIMIT = 64 * 1024      # bytes read of one /proc file (status with a long Groups: line is ~1 KiB + 7 B a group)
CMDLINE_LIMIT = 16 * 1024   # bytes of argv read: any user can pass ARG_MAX (2 MiB) of it, read and escaped on every scan


def read_limited(path: str, limit: int = READ_LIMIT) -> bytes | None:
    """At most ``limit`` bytes of ``path`` (bytes), or None when it cannot be opened or read.

    Everything under /proc/PID is written by the process's owner (argv, comm): a whole-file
    read would let any local user make each /proc pass slow and the guard's locked memory large."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        parts, left = [], limit
        while left > 0:
            b = os.read(fd, left)
            if not b:
                break
            parts.append(b)
            left -= len(b)
        return b"".join(parts)
    except OSError:
        return None
    finally:
        os.close(fd)


def read_proc(pid: int, root: str = "/proc") -> Proc | None:
    """Read one process's stat (:func:`stat_fields`) and cmdline under ``root`` (a /proc, or a
    copy of one); None if it is gone or unreadable."""
    st = stat_fields(f"{root}/{pid}/stat")
    if st is None:
        return None
    comm = escape(st[0].decode("utf-8", "replace"))
    f = st[1]
    try:
        ppid, pgrp, flags, start = int(f[1]), int(f[2]), int(f[6]), int(f[19])
    except (IndexError, ValueError):
        return None
    kthread = bool(flags & PF_KTHREAD)
    cmd = b"" if kthread else (read_limited(f"{root}/{pid}/cmdline", CMDLINE_LIMIT) or b"")
    if not cmd and not kthread:
        task = live_task(pid, root)
        cmd = (read_limited(f"{task}/cmdline", CMDLINE_LIMIT) or b"") if task else b""
    cmdline = escape(cmd.rstrip(b"\0").replace(b"\0", b" ").decode("utf-8", "replace"))
    return Proc(pid, ppid, pgrp, comm, cmdline, start, kthread)


def live_task(pid: int, root: str = "/proc") -> str | None:
    """``ROOT/PID/task/TID`` of a live thread other than the main one, or None.

    For a zombie leader (main thread exited, others running): the leader's own cmdline and
    status show no memory, a live thread's show the process's (the mm is shared by all
    threads, proc(5)).  A plain zombie has no other thread: None."""
    try:
        tids = os.listdir(f"{root}/{pid}/task")
    except OSError:
        return None
    for tid in tids:
        if tid != str(pid):
            st = stat_fields(f"{root}/{pid}/task/{tid}/stat")
            if st is not None and (st[1][0][:1] if st[1] else b"") not in (b"Z", b"X"):
                return f"{root}/{pid}/task/{tid}"
    return None


def stat_fields(path: str) -> tuple[bytes, list[bytes]] | None:
    """A /proc/PID/stat (or task/TID/stat) file as ``(comm, fields)``: comm is what lies between
    the first ``(`` and the last ``)`` (so a name holding spaces, parentheses or a newline is
    read whole), ``fields[k]`` is proc(5) field ``k + 3`` (``fields[0]`` the state letter,
    ``fields[1]`` ppid, ``fields[19]`` starttime).  None when unreadable or without ``(...)``."""
    stat = read_limited(path)
    if not stat:
        return None
    lp, rp = stat.find(b"("), stat.rfind(b")")
    if lp < 0 or rp < lp:
        return None
    return stat[lp + 1:rp], stat[rp + 2:].split()


STATUS_HEAD = 512          # bytes of /proc/PID/status read for its Tgid (the 4th line, after a Name of <= 64 bytes)
ARGV_HEAD = 512            # bytes of /proc/PID/cmdline that tell an exec or a new title (argv_head)


def new_processes(ids: Iterable[int], root: str = "/proc", missing: list[int] | None = None) -> list[int] | None:
    """Of ``ids``, those that name a process under ``root`` now: one whose ``Tgid`` in
    ``ROOT/ID/status`` is the id itself (a thread group's leader, a zombie too), proc(5), and
    that is no kernel thread (PF_KTHREAD in its stat's flags: the kernel starts and ends
    kworkers as it needs them).  A thread of an older process (its Tgid is another id) and an
    id with no entry are left out; the ids with no entry are added to ``missing`` when it is
    given: exited and reaped, never a process of this pid namespace, or handed out an instant
    ago to a process the kernel has not finished creating (fork allocates the id, and the /proc
    entry appears when the task is attached: kernel/fork.c copy_process, alloc_pid before
    attach_pid).  None when an entry cannot be read or parsed for another reason: the caller
    then does what it would do for a process.  One open and read per id: the caller bounds them."""
    found = []
    for pid in ids:
        try:
            fd = os.open(f"{root}/{pid}/status", os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            if missing is not None:
                missing.append(pid)
            continue
        except OSError:
            return None
        try:
            head = os.read(fd, STATUS_HEAD)
        except ProcessLookupError:      # ESRCH: it exited between the open and the read
            continue
        except OSError:
            return None
        finally:
            os.close(fd)
        i = head.find(b"\nTgid:")
        j = head.find(b"\n", i + 6)
        if i < 0 or j < 0:
            return None
        try:
            tgid = int(head[i + 6:j])
        except ValueError:
            return None
        if tgid == pid:
            st = stat_fields(f"{root}/{pid}/stat")
            try:
                kthread = st is not None and int(st[1][6]) & PF_KTHREAD
            except (IndexError, ValueError):
                return None
            if not kthread:         # a kernel thread (a new kworker) is never a target
                found.append(pid)
    return found


def argv_head(pid: int, root: str = "/proc") -> bytes | None:
    """The first :data:`ARGV_HEAD` bytes of ``ROOT/PID/cmdline``, or None when it cannot be
    read: what tells a process that has since exec'd another program or set its title
    (setproctitle rewrites argv) from the one seen before."""
    return read_limited(f"{root}/{pid}/cmdline", ARGV_HEAD)


def pids(root: str = "/proc") -> list[int]:
    """The pid of every process listed in ``root`` (a /proc, or a copy of one): the one walk of
    /proc that every reader of processes shares.

    Raises:
        OSError: ``root`` cannot be listed.
    """
    return [int(name) for name in os.listdir(root) if name.isdigit()]


def scan(root: str = "/proc") -> dict[int, Proc]:
    """One pass over ``root``.  Returns ``{pid: Proc}`` of every visible process.

    Raises:
        OSError: ``root`` cannot be listed.
    """
    out: dict[int, Proc] = {}
    for pid in pids(root):
        p = read_proc(pid, root)
        if p is not None:
            out[p.pid] = p
    return out


def short_title(cmdline: str, comm: str = "", limit: int = 160) -> str:
    """A name people recognise: ``/usr/bin/python3 /usr/local/bin/vllm serve M --tp 2`` ->
    ``vllm serve M --tp 2``; setproctitle titles (``VLLM::Worker_TP0``) unchanged; comm for an
    empty cmdline.  Longer than ``limit`` characters: cut, ending in ``…``."""
    if not cmdline:
        return comm
    toks = cmdline.split(" ")
    first = os.path.basename(toks[0])
    if first.startswith("python") and len(toks) > 1 and not toks[1].startswith("-"):
        toks = [os.path.basename(toks[1])] + toks[2:]
    elif "/" in toks[0]:
        toks[0] = first
    t = " ".join(toks)
    return t if len(t) <= limit else t[:limit - 1] + "…"


def children_map(procs: dict[int, Proc]) -> dict[int, list[int]]:
    """``{ppid: [child pids]}`` for a scan."""
    kids: dict[int, list[int]] = {}
    for p in procs.values():
        kids.setdefault(p.ppid, []).append(p.pid)
    return kids


def descendants(roots: list[int], kids: dict[int, list[int]]) -> list[int]:
    """``roots`` and all their descendants, breadth first, each once."""
    seen: set[int] = set()
    out: list[int] = []
    queue = list(roots)
    while queue:
        pid = queue.pop(0)
        if pid in seen:
            continue
        seen.add(pid)
        out.append(pid)
        queue.extend(kids.get(pid, ()))
    return out


def _status_mem(pid: int, shmem_swap: bool = True, root: str = "/proc") -> tuple[int, int]:
    """(resident, swapped) bytes of one process; (0, 0) if unreadable or gone.

    Resident is VmRSS of /proc/PID/status (of a live thread for a zombie leader).  Swapped is
    ``SwapPss`` of /proc/PID/smaps_rollup when ``shmem_swap``: VmSwap counts anonymous private
    pages only ("shmem swap usage is not included"), smaps' Swap also counts the mapped part of
    a shmem object that is out on swap, and SwapPss shares that between the processes mapping
    it, so a tree's sum counts each page once (Documentation/filesystems/proc.rst).  ``Swap``
    where the kernel lacks SwapPss, VmSwap where smaps_rollup cannot be read (Linux < 4.14,
    or ``shmem_swap=False``: reading it walks every mapping, too dear for a whole-/proc pass).
    """
    base = f"{root}/{pid}"
    text = read_limited(f"{base}/status") or b""
    if b"\nVmRSS:" not in text and text:
        task = live_task(pid, root)
        if task is None:
            return 0, 0
        base = task
        text = read_limited(f"{base}/status") or b""
    rss, swap = _kb_field(text, b"\nVmRSS:") or 0, _kb_field(text, b"\nVmSwap:") or 0
    if shmem_swap and rss:
        rollup = read_limited(f"{base}/smaps_rollup")
        if rollup:
            for label in (b"\nSwapPss:", b"\nSwap:"):
                v = _kb_field(rollup, label)
                if v is not None:
                    swap = v
                    break
    return rss, swap


def _kb_field(text: bytes, label: bytes) -> int | None:
    """Bytes of the ``Name: N kB`` line ``label`` of a /proc status or smaps_rollup text, by
    :func:`sparkguard.meminfo.field`; None when absent or malformed."""
    try:
        return meminfo.field(text, label)
    except ValueError:
        return None


def _int_file(path: str, default: int = 0) -> int:
    raw = read_limited(path)
    try:
        return int(raw) if raw is not None else default
    except ValueError:
        return default


class Protector:
    """Decides which processes must never be signalled.

    Never: PID 1, kernel threads, PID 2's children, sparkguard itself (``self_pid``),
    processes with oom_score_adj -1000 (the kernel's own "never kill" mark, proc(5)),
    and processes whose comm or argv[0] basename fullmatches a ``targets.protect`` regex.
    """

    def __init__(self, patterns: tuple[str, ...] | list[str], self_pid: int | None = None):
        self.regexes = [re.compile(p) for p in patterns]
        self.self_pid = os.getpid() if self_pid is None else self_pid

    def protected(self, p: Proc) -> bool:
        """True if ``p`` must not be signalled."""
        if p.pid <= 1 or p.kthread or p.ppid == 2 or p.pid == 2 or p.pid == self.self_pid:
            return True
        argv0 = os.path.basename(p.cmdline.split(" ", 1)[0]) if p.cmdline else ""
        for r in self.regexes:
            if r.fullmatch(p.comm) or (argv0 and r.fullmatch(argv0)):
                return True
        return _int_file(f"/proc/{p.pid}/oom_score_adj") == -1000


def _gpu() -> dict[int, int] | None:
    """``{pid: GPU bytes}`` from NVML (:mod:`sparkguard.gpumem`, read by its own thread: a dict
    lookup here), or None when NVML is not read (no nvidia-ml-py, no driver)."""
    return gpumem.reading() if gpumem.active() else None


def _tree_info(pids: list[int], procs: dict[int, Proc]) -> tuple[int, list[dict]]:
    total = 0
    rows = []
    gpu = _gpu()
    for pid in pids:
        p = procs[pid]
        rss, swap = _status_mem(pid)
        total += rss + swap
        rows.append({"pid": pid, "ppid": p.ppid, "title": short_title(p.cmdline, p.comm), "comm": p.comm,
                     "cmdline": p.cmdline[:400],
                     "rss_bytes": rss, "swap_bytes": swap,
                     "oom_score": _int_file(f"/proc/{pid}/oom_score", -1)})
        if gpu is not None:
            rows[-1]["gpu_bytes"] = gpu.get(pid, 0)
            total += rows[-1]["gpu_bytes"]
    return total, rows


def build_target(root: int, pattern: str, procs: dict[int, Proc], kids: dict[int, list[int]],
                 protector: Protector, rank: int = 0, details: bool = True) -> Target:
    """The :class:`Target` for the tree under ``root`` (protected members left out).

    ``details=False`` leaves ``tree`` empty and ``mem_bytes`` 0 (no /proc/PID/status reads):
    the guard signals first and calls :func:`add_details` after.
    """
    pids = [pid for pid in descendants([root], kids) if not protector.protected(procs[pid])]
    t = Target(root_pid=root, title=short_title(procs[root].cmdline, procs[root].comm), pattern=pattern,
               pids=pids, starttimes={pid: procs[pid].starttime for pid in pids}, rank=rank)
    if details:
        add_details(t, procs)
    return t


def add_details(target: Target, procs: dict[int, Proc]) -> None:
    """Fill ``target.tree`` rows and ``mem_bytes`` (RSS + swap) from /proc, for members of the scan."""
    target.mem_bytes, target.tree = _tree_info([pid for pid in target.pids if pid in procs], procs)


def refresh_details(target: Target) -> None:
    """Re-read the memory and oom_score of each row of ``target.tree``; a member gone since the
    rows were read keeps its last figures (vLLM's children exit within milliseconds of SIGTERM,
    so rows read after the signal would otherwise lose them).  Recomputes ``mem_bytes``."""
    total = 0
    gpu = _gpu()
    for row in target.tree:
        rss, swap = _status_mem(row["pid"])
        if rss or swap:
            row["rss_bytes"], row["swap_bytes"] = rss, swap
            row["oom_score"] = _int_file(f"/proc/{row['pid']}/oom_score", row["oom_score"])
            if gpu is not None:
                row["gpu_bytes"] = gpu.get(row["pid"], 0)
        total += row["rss_bytes"] + row["swap_bytes"] + row.get("gpu_bytes", 0)
    target.mem_bytes = total


def _tree_mem(pids: list[int]) -> int:
    gpu = _gpu() or {}
    return sum(sum(_status_mem(pid)) + gpu.get(pid, 0) for pid in pids)


def find_targets(targets_cfg, self_pid: int | None = None, procs: dict[int, Proc] | None = None,
                 details: bool = True) -> list[Target]:
    """Engine trees matching ``targets_cfg.match``, best first.

    Args:
        targets_cfg: ``config.TargetsConfig`` (``match``, ``protect``, ``fallback``).
        self_pid: sparkguard's own pid (never a target); default ``os.getpid()``.
        procs: a scan to reuse (default: scan now).
        details: fill each Target's ``tree`` rows; False reads tree memory only where it
            decides the order (several trees of the best pattern), so the caller can signal sooner.
    Returns:
        list[Target], sorted by (pattern index, -mem_bytes).  With ``fallback: oom_score``
        and no match, a single Target: the process with the largest /proc/PID/oom_score.
    """
    procs = scan() if procs is None else procs
    protector = Protector(targets_cfg.protect, self_pid)
    regexes = [re.compile(p) for p in targets_cfg.match]
    rank: dict[int, int] = {}
    for p in procs.values():
        if p.kthread or not p.cmdline:
            continue
        for i, r in enumerate(regexes):
            if r.search(p.cmdline):
                rank[p.pid] = i
                break
    kids = children_map(procs)
    roots: dict[int, int] = {}
    for pid in rank:
        # climb only through matching parents: a launcher that merely mentions the engine further
        # up (tmux new 'vllm serve ...', a shell, a job runner) must not become the root and take
        # its unrelated children into the tree
        top, hops = pid, 0
        while procs[top].ppid in rank and hops < 4096:
            top, hops = procs[top].ppid, hops + 1
        roots.setdefault(top, 0)
    out = []
    # A root with another root below it (through a non-matching process) only mentions the engine:
    # a launcher.  Its tree stops at the nested engine, and it comes after real engines.
    own_kids = {ppid: [c for c in cs if c not in roots] for ppid, cs in kids.items()}
    launchers = set()
    for root in roots:
        for pid in descendants([root], kids)[1:]:
            if pid in roots:
                launchers.add(root)
                break
    for root in roots:
        if protector.protected(procs[root]):
            continue
        tree_rank = min(rank[pid] for pid in descendants([root], own_kids) if pid in rank)
        out.append(build_target(root, targets_cfg.match[tree_rank], procs, own_kids, protector, tree_rank, details))
        out[-1].launcher = root in launchers
    if not details and len(out) > 1:
        best = min(t.rank for t in out)
        tied = [t for t in out if t.rank == best]
        if len(tied) > 1:
            for t in tied:
                t.mem_bytes = _tree_mem(t.pids)
    out.sort(key=lambda t: (t.rank, t.launcher, -t.mem_bytes))
    if not out and targets_cfg.fallback == "oom_score":
        best, score = None, -1
        for p in procs.values():
            if protector.protected(p):
                continue
            s = _int_file(f"/proc/{p.pid}/oom_score", -1)
            if s > score:
                best, score = p.pid, s
        if best is not None:
            out.append(build_target(best, FALLBACK_PATTERN, procs, kids, protector, len(regexes), details))
    return out


def ambiguous(targets: list[Target]) -> bool:
    """Whether the first of :func:`find_targets`'s list could stop being first without any
    process being created: it was chosen by memory among several trees of the same rank (and
    launcher-ness, which sorts before memory) or by ``/proc/PID/oom_score`` (the fallback).
    Either order follows memory use, which changes between scans.  Pure."""
    if not targets:
        return False
    best = targets[0]
    return best.pattern == FALLBACK_PATTERN or any(
        t.rank == best.rank and t.launcher == best.launcher for t in targets[1:])


def top_consumers(n: int = 5, procs: dict[int, Proc] | None = None) -> list[dict]:
    """The ``n`` processes holding the most RSS + swap (bytes), for a report with no target.

    Returns rows like :class:`Target`'s tree rows.  RSS hides unified-memory GPU allocations, so
    this is a hint for people, never a choice of victim.
    """
    procs = scan() if procs is None else procs
    sized = []
    for p in procs.values():
        if p.kthread:
            continue
        rss, swap = _status_mem(p.pid, shmem_swap=False)
        sized.append((rss + swap, p.pid))
    sized.sort(reverse=True)
    pids = [pid for _, pid in sized[:n] if pid in procs]
    return _tree_info(pids, procs)[1]

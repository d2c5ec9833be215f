"""The engine trees the guard stops: pattern matching, tree roots, protection, their order.

Processes whose cmdline (setproctitle titles are the whole cmdline, e.g. ``VLLM::Worker_TP0``)
matches one of ``targets.match``; the root of an engine tree is the topmost process of an unbroken
chain of matching ancestors; the tree is that root and all its descendants.  Several engines:
lowest pattern index first (configured order), then the largest tree memory (RSS + swap, plus each
process's GPU memory when NVML is read: :mod:`sparkguard.gpumem`; RSS alone hides unified-memory
GPU allocations, so the configured order comes first).

The processes come from one scan (:func:`sparkguard.proctree.scan`); nothing here runs on the
poll loop's path (:mod:`sparkguard.armed` keeps the choice ready before a crossing).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from sparkguard import gpumem
from sparkguard.proctree import Proc, children_map, descendants, int_file, scan, short_title, status_mem


@dataclass
class Target:
    """An engine tree chosen for signalling.

    Attributes:
        root_pid: int, the process that gets SIGTERM.
        title: str, the root's cmdline as :func:`sparkguard.proctree.short_title` shows it.
        pattern: str, the ``targets.match`` regex that matched (or :data:`FALLBACK_PATTERN`).
        pids: list[int], root first, then descendants (breadth first), protected ones removed.
        starttimes: dict pid -> starttime (ticks), to detect PID reuse before signalling.
        mem_bytes: int, resident + swapped bytes over the tree (:func:`sparkguard.proctree.status_mem`), plus the
            GPU memory NVML reports for its processes (:mod:`sparkguard.gpumem`) when it is read.
        tree: list[dict] with keys pid, ppid, title (:func:`sparkguard.proctree.short_title` of the cmdline, which
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
        return int_file(f"/proc/{p.pid}/oom_score_adj") == -1000


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
        rss, swap = status_mem(pid)
        total += rss + swap
        rows.append({"pid": pid, "ppid": p.ppid, "title": short_title(p.cmdline, p.comm), "comm": p.comm,
                     "cmdline": p.cmdline[:400],
                     "rss_bytes": rss, "swap_bytes": swap,
                     "oom_score": int_file(f"/proc/{pid}/oom_score", -1)})
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
        rss, swap = status_mem(row["pid"])
        if rss or swap:
            row["rss_bytes"], row["swap_bytes"] = rss, swap
            row["oom_score"] = int_file(f"/proc/{row['pid']}/oom_score", row["oom_score"])
            if gpu is not None:
                row["gpu_bytes"] = gpu.get(row["pid"], 0)
        total += row["rss_bytes"] + row["swap_bytes"] + row.get("gpu_bytes", 0)
    target.mem_bytes = total


def _tree_mem(pids: list[int]) -> int:
    gpu = _gpu() or {}
    return sum(sum(status_mem(pid)) + gpu.get(pid, 0) for pid in pids)


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
            s = int_file(f"/proc/{p.pid}/oom_score", -1)
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
        rss, swap = status_mem(p.pid, shmem_swap=False)
        sized.append((rss + swap, p.pid))
    sized.sort(reverse=True)
    pids = [pid for _, pid in sized[:n] if pid in procs]
    return _tree_info(pids, procs)[1]

"""Process discovery: one pass over /proc, the process tree, each process's memory.

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

Which trees the guard stops, from a scan: :mod:`sparkguard.enginetree`.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass

from sparkguard import meminfo

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


VIEW_LIMIT = 4096          # processes add_descendants reads before it gives up (the caller scans)


def add_descendants(procs: dict[int, Proc], root: str = "/proc", limit: int = VIEW_LIMIT) -> bool:
    """Add to ``procs`` (``{pid: Proc}``, changed in place) every descendant of the processes in
    it, read now, found through the kernel's list of each thread's children
    (``ROOT/PID/task/TID/children``, proc(5); Linux 3.5, CONFIG_PROC_CHILDREN) instead of a pass
    over every process: the cost follows these trees, not the number of processes on the box.

    The kernel documents the list as exact only while the children are neither being created nor
    exiting (Documentation/filesystems/proc.rst): a child born or gone during the read may be
    missed, as a process born during a whole-/proc pass is.  Returns False when a children file
    of a live thread cannot be read (a kernel without them) or the trees hold more than ``limit``
    processes: the caller then scans /proc.
    """
    queue = list(procs)
    while queue:
        pid = queue.pop()
        try:
            tids = os.listdir(f"{root}/{pid}/task")
        except FileNotFoundError:       # exited since it was read
            continue
        except OSError:
            return False
        for tid in tids:
            raw = read_limited(f"{root}/{pid}/task/{tid}/children")
            if raw is None:
                if os.path.isdir(f"{root}/{pid}/task/{tid}"):
                    return False        # a live thread without the file: the kernel has none
                continue                # the thread exited
            for word in raw.split():
                child = int(word)
                if child in procs:
                    continue
                p = read_proc(child, root)
                if p is not None:
                    procs[child] = p
                    queue.append(child)
                    if len(procs) > limit:
                        return False
    return True


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


def status_mem(pid: int, shmem_swap: bool = True, root: str = "/proc") -> tuple[int, int]:
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


def int_file(path: str, default: int = 0) -> int:
    raw = read_limited(path)
    try:
        return int(raw) if raw is not None else default
    except ValueError:
        return default

"""The armed target: the victim chosen before the crossing, its tree's pidfds already open.

A whole-/proc pass (:func:`sparkguard.proctree.scan`) costs about 50 us per process in
Python: 0.22-0.40 s with 5,000 sleeping processes on the 2-core dev VM.  On the critical
path it delayed crossing->SIGTERM from 5-7 ms to 217-446 ms (issue 11).  So the guard keeps
the target chosen beforehand, its members' pidfds open (start times checked when opened, so
a recycled pid is never signalled), and at the crossing only re-checks that the root is
still alive (its pidfd not readable, one poll(2)) and signals it.

Refreshing, from the poll loop's full pass while the state is OK (:meth:`Armed.tick`):

- Churn is noticed for the price of one ``pread`` of /proc/loadavg, whose last field is the
  last pid the kernel handed out in this pid namespace (proc(5)): it moves whenever a process
  or thread is created anywhere.  Exits inside the armed tree are seen on its pidfds (POLLIN,
  one poll(2)).  Both together cost ~8 us hot and ~100 us cold (after the loop's 200 ms sleep,
  2-core dev VM), so far from the line (headroom at or above ``small``) they are looked at every
  :data:`IDLE_CHECK` seconds only: ~0.001 % of a core beside the loop's ~0.07 %.
- Churn that creates no process is not a change: a rescan the churn alone would start first
  looks up the pids handed out since the last one (at most :data:`NEW_PIDS`, one read of
  /proc/PID/status each, :func:`sparkguard.proctree.new_processes`), and when all are
  threads of older processes or have already exited, and no process an earlier look found
  new has exec'd since (its argv, :func:`sparkguard.proctree.argv_head`), the cursor moves
  past them and nothing is scanned.  A host's services create threads and short-lived
  processes all the time: on the GPU machine a scan followed nearly every idle check, 2.8-10
  ms each, 55-205 us per wake-up of the loop (the loop itself: ~65 us); with the look,
  0.45-0.56 ms per check (bench/results/idle-parse.txt section 5).
- A pass rescans when something changed (churn that left a new process, a member exited, the
  target was used or dropped) or the choice is :data:`MAX_AGE` old (tree memory orders trees
  of one pattern),
  and never sooner than :data:`IDLE_DUTY` times the last scan's cost after the last one
  (so at most 1/IDLE_DUTY of a core: 2 %, 0.25 s every 12.5 s with 5,000 processes; about
  40 ms every 2 s, 2 %, with 800), nor sooner than :data:`MIN_GAP`.  A box without churn
  never rescans between :data:`MAX_AGE` ticks: the idle cost stays one pread per full pass.
- While the headroom is small (below ``small`` bytes: the daemon passes ``far``, one poll
  interval at the assumed fill rate, the band where the poll loop already polls faster) and
  the change is the armed tree's own (a member exited, the target was used or dropped), the
  gap shrinks to :data:`SMALL_DUTY` times the scan cost, so the choice follows a tree that is
  coming apart as memory runs out.  Churn elsewhere (a pid handed out anywhere on the box,
  the armed tree forking included: the pid cursor cannot tell whose it is) keeps the
  :data:`IDLE_DUTY` gap, so process creation on a busy box costs at most 2 % of a core.
- No scan starts while memory filling at ``fill_rate`` could reach the line before it ends
  (headroom below twice ``fill_rate`` x the scan's expected cost): the poll loop does not
  sample during a scan, and the armed choice, a few seconds old at worst, is the better bet.
  The expected cost is the larger of the last scan's cost and an estimate scaled to the box
  now: the last scan's cost per /proc entry it read (cost / processes scanned) times the
  number of scheduling entities in the same /proc/loadavg read (the 4th field,
  ``running/total``, the number after '/', proc(5)).  That number counts threads too, while a
  scan reads one entry per process, so the estimate is an upper bound; it keeps a burst of
  new processes since the last scan from making the next one far slower than the gate assumed.

An ambiguous choice is not used at the crossing: when the armed tree was ranked by memory
among several trees matching the best pattern, or chosen by ``targets.fallback: oom_score``,
another tree may have grown past it since the last scan without creating a process (no churn
to notice), so :meth:`Armed.take` returns None and the crossing pays for one scan to hit the
right victim.  The usual case, one engine tree, stays scan-free.

Nothing here blocks or raises into the loop: :meth:`Armed.tick` logs and swallows errors.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Callable

from sparkguard import proctree, signals
from sparkguard.guard import cgkill

log = logging.getLogger("sparkguard.armed")

IDLE_CHECK = 10.0    # seconds between churn/exit checks far from the line
MIN_GAP = 2.0        # seconds: the most often the guard rescans near the line (far from it: every IDLE_CHECK)
MAX_AGE = 60.0       # seconds: rescan at least this often, churn or not
IDLE_DUTY = 50       # idle: scans take at most 1/50 of the time (2 % of a core)
SMALL_DUTY = 4       # little headroom: at most 1/4 of the time
NEW_PIDS = 32        # pids of churn looked up one by one before a rescan (Armed._new_process)


def refresh_due(now: float, last_scan: float | None, scan_cost: float, churn: bool, ours: bool,
                headroom: int, small: int, fill_rate: float, estimate: float = 0.0) -> bool:
    """Whether a pass at ``now`` (monotonic s) rescans.  Pure.

    Args:
        last_scan: monotonic s of the last scan, None before the first.
        scan_cost: seconds the last scan took.
        churn: the pid cursor of /proc/loadavg moved since the last scan (a process or thread
            was created somewhere on the box).
        ours: a member of the armed tree exited, or the armed target was used or dropped.
        headroom: bytes between the memory signal and the SIGTERM line (>= 0).
        small: headroom in bytes below which the armed tree's own changes are followed at
            :data:`SMALL_DUTY`.
        fill_rate: assumed fill rate, bytes/s (``policy.FILL_RATE``).
        estimate: seconds the next scan is expected to take at the current process count
            (:meth:`Armed.tick`: cost per entry of the last scan x scheduling entities now, an
            upper bound).  Only the fill gate uses it, as ``max(scan_cost, estimate)``; the duty
            gaps bound the time spent scanning and use the measured ``scan_cost``.
    """
    if headroom < 2 * fill_rate * max(scan_cost, estimate):
        return False
    if last_scan is None:
        return True
    age = now - last_scan
    if age < (SMALL_DUTY * scan_cost if ours and headroom < small else max(MIN_GAP, IDLE_DUTY * scan_cost)):
        return False
    return churn or ours or age >= MAX_AGE


class Armed:
    """The chosen target and its open :class:`sparkguard.signals.Tree`, kept ready.

    Args:
        choose: callable returning ``(enginetree.Target with tree rows or None, {pid: proctree.Proc},
            ambiguous)``; it does the /proc pass (engine first, then ``targets.match``) and returns
            the whole scan, whose size gives the cost per entry, even when nothing matches;
            ``ambiguous`` (bool): the choice ranked trees by memory or came from the oom_score
            fallback (:func:`sparkguard.enginetree.ambiguous`).
        fill_rate: assumed fill rate, bytes/s.
        clock: monotonic seconds.
        proc_root: the /proc whose ``loadavg`` gives the pid cursor and whose entries tell
            processes from threads (:meth:`_new_process`).
    """

    def __init__(self, choose: Callable[[], tuple | None], fill_rate: float,
                 clock: Callable[[], float] = time.monotonic, proc_root: str = "/proc"):
        self.choose = choose
        self.fill_rate = fill_rate
        self.clock = clock
        self.target = None
        self.tree: signals.Tree | None = None
        self.procs: dict = {}
        self.last_scan: float | None = None
        self.scan_cost = 0.0
        self.entry_cost = 0.0       # seconds per /proc entry (process) of the last scan
        self.scans = 0
        self.stale = False
        self.ambiguous = False
        self._errors = 0
        self._next_check = 0.0
        self.proc_root = proc_root
        self._fd = os.open(os.path.join(proc_root, "loadavg"), os.O_RDONLY | os.O_CLOEXEC)
        self._last_pid: int | None = None    # the pid cursor at the last scan (or past churn of no process)
        self._recent: dict[int, bytes | None] = {}  # the last NEW_PIDS processes looks found new -> argv head
        self._unseen: tuple[int, ...] = ()   # ids of the last look's churn with no /proc entry (_new_process)
        self._next_look = 0.0                # monotonic s: no look at the churn before (MIN_GAP after one)

    def _loadavg(self) -> tuple[int, int]:
        """From one read of /proc/loadavg (proc(5)): the last field, the last pid handed out,
        and the number after '/' in the 4th field, the scheduling entities (processes and
        threads) that exist now."""
        f = os.pread(self._fd, 128, 0).split()
        return int(f[-1]), int(f[3].rpartition(b"/")[2])

    def tick(self, now: float, headroom: int, small: int) -> None:
        """One full pass in the OK state: note exits and churn, rescan when due (module doc)."""
        if headroom >= small:
            if now < self._next_check:
                return
            self._next_check = now + IDLE_CHECK
        try:
            tree = self.tree
            if tree is not None and len(tree.alive()) < len(tree.fds):
                self.stale = True
                if tree.root not in tree.alive():
                    self.disarm()
            cursor, entities = self._loadavg()
            gates = (self.stale, headroom, small, self.fill_rate, self.entry_cost * entities)
            if refresh_due(now, self.last_scan, self.scan_cost, False, *gates) \
                    or (cursor != self._last_pid or self._unseen) \
                    and refresh_due(now, self.last_scan, self.scan_cost, True, *gates) \
                    and self._new_process(cursor, now):
                self.refresh()
        except Exception:  # noqa: BLE001 - the poll loop must outlive this
            self._errors += 1
            if self._errors == 1 or self._errors % 100 == 0:
                log.exception("refreshing the armed target failed (%d times); the crossing will scan /proc",
                              self._errors)

    def _new_process(self, cursor: int, now: float) -> bool:
        """Whether the churn since the last scan (pids after ``_last_pid`` up to ``cursor``)
        may have changed the choice: it includes a process that exists now
        (:func:`sparkguard.proctree.new_processes`), or a process that an earlier look found new
        shows another argv now (it exec'd an engine, ``sh -c 'exec vllm serve ...'`` or a
        container's init, or set its title: the threads such an engine starts are all the churn
        it leaves).  True without a look when the cursor wrapped around pid_max or moved by more
        than :data:`NEW_PIDS` (a scan then costs about as much as the look).  Threads of other
        processes and processes already gone cannot change the choice: the cursor moves past
        them, no scan is due for them, and no look comes sooner than :data:`MIN_GAP` after.  The
        ids a look found no entry for are looked up once more at the next look, which comes
        whether the cursor moved again or not: an id is handed out before its process shows in
        /proc, so one may have been a process still being created."""
        last = self._last_pid
        if last is None or not 0 <= cursor - last <= NEW_PIDS:
            return True
        if now < self._next_look:
            return False
        root = self.proc_root
        missing: list[int] = []
        found = proctree.new_processes((*self._unseen, *range(last + 1, cursor + 1)), root, missing)
        now_heads = {pid: proctree.argv_head(pid, root) for pid in self._recent}
        alive = {pid: head for pid, head in now_heads.items() if head is not None}
        changed = any(head != self._recent[pid] for pid, head in alive.items())
        if found is None or found or changed:
            alive.update((pid, proctree.argv_head(pid, root)) for pid in found or ())
            self._recent = dict(list(alive.items())[-NEW_PIDS:])
            return True
        self._recent = alive
        self._unseen = tuple(pid for pid in missing if pid > last)     # once more at the next look, then gone
        self._last_pid = cursor
        self._next_look = now + MIN_GAP
        return False

    def refresh(self) -> None:
        """Choose again now (one /proc pass) and reopen the tree's pidfds."""
        self._last_pid = self._loadavg()[0]     # before the scan: a process born during it is churn
        self._unseen = ()
        t0 = self.clock()
        target, procs, ambiguous = self.choose()
        self.scan_cost = self.clock() - t0
        self.entry_cost = self.scan_cost / max(1, len(procs))
        self.last_scan = t0
        self.scans += 1
        self.stale = False
        self.disarm(stale=False)
        if target is not None:
            self.ambiguous = ambiguous
            self.target = target
            self.procs = {pid: procs[pid] for pid in target.pids if pid in procs}
            self.tree = cgkill.tree_for(target)     # a cgroup's tree: its SIGKILL is the cgroup's

    def take(self):
        """At the crossing: ``(target, tree, procs)`` if the armed root is still alive and the
        choice was not ambiguous (module doc), else None (the caller scans).

        The tree (and its pidfds) passes to the caller; the next :meth:`tick` rescans."""
        tree, target = self.tree, self.target
        if tree is None or self.ambiguous or tree.root not in tree.fds or tree.root not in tree.alive():
            self.disarm()
            return None
        procs = self.procs
        self.tree = self.target = None
        self.procs = {}
        self.stale = True
        self._next_check = 0.0
        return target, tree, procs

    def disarm(self, stale: bool = True) -> None:
        """Drop the armed choice and close its pidfds; ``stale``: rescan at the next due pass."""
        if self.tree is not None:
            self.tree.close()
        self.tree = self.target = None
        self.procs = {}
        self.ambiguous = False
        if stale:
            self.stale = True
            self._next_check = 0.0

    def close(self) -> None:
        self.disarm()
        os.close(self._fd)

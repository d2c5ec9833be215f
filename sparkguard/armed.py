"""The armed target: the victim chosen before the crossing, its tree's pidfds already open.

A whole-/proc pass (:func:`sparkguard.proctree.scan`) costs about 50 us per process in
Python: 0.22-0.40 s with 5,000 sleeping processes on the 2-core dev VM.  On the critical
path it delayed crossing->SIGTERM from 5-7 ms to 217-446 ms (issue 11).  So the guard keeps
the target chosen beforehand, its members' pidfds open (start times checked when opened, so
a recycled pid is never signalled), and at the crossing only re-checks that the root is
still alive (its pidfd not readable, one poll(2)) and signals it.

A new process is armed when it is first seen, by a look at the new processes alone (issue 32):

- Churn is noticed for the price of one ``pread`` of /proc/loadavg, whose last field is the
  last pid the kernel handed out in this pid namespace (proc(5)): it moves whenever a process
  or thread is created anywhere.  Exits inside the armed tree are seen on its pidfds (POLLIN,
  one poll(2)).  Both together cost ~8 us hot and ~100 us cold (after the loop's 200 ms sleep,
  2-core dev VM), so far from the line (headroom at or above ``small``) they are looked at every
  :data:`IDLE_CHECK` seconds only; below ``small`` (the band where the loop polls faster) at
  every full pass.
- When the cursor moved, a look (:meth:`Armed.look`) reads the ids handed out since the last
  one (at most :data:`LOOK_IDS`, one read of /proc/ID/status each: a thread of an older
  process or an id already gone is passed over, :func:`sparkguard.proctree.new_processes`), or,
  after more churn than that, one listing of /proc compared with the pids known; then the
  stat and argv of the new processes only, at most :data:`LOOK_BUDGET` a look (the rest wait
  for the next), and the argv of the last :data:`NEW_PIDS` processes found new, which tells an
  exec or a new title (``sh -c 'exec vllm serve ...'``; setproctitle).  Bystanders are never
  read again: the cost follows the churn.  With 5,000 sleeping processes a look costs ~0.1-1
  ms where a whole-/proc pass costs 180-400 ms; with 1,000 forks a second, ~30 ids a look.
- The matching processes (``targets.match``: ``matches``) are kept, pid and start time, from
  the last scan and every look since.  When a look finds a new one, or a child of the armed
  tree, or the armed tree lost a member, the choice is made again from those processes and
  their trees alone (:func:`sparkguard.proctree.add_descendants`, each thread's ``children``
  file): the same choice as a scan's, read in a few milliseconds whatever else runs, and the
  new target is armed at once.
- Looks near the line take at most 1/:data:`LOOK_DUTY` of the time (the next waits
  LOOK_DUTY x the last one's cost), so a flood of processes costs the loop a bounded share
  of a core; a flood that outruns the budget is read over the next looks.
- A whole-/proc pass (:meth:`Armed.refresh`) still comes at start, when the choice is
  :data:`MAX_AGE` old (an old process that exec'd an engine beyond the last NEW_PIDS new ones,
  memory order among trees of one pattern), and where the matching processes alone cannot
  decide (the supervised engine, whose tree is its process group; ``targets.fallback:
  oom_score`` with nothing matching; a kernel without ``children`` files).  It never comes
  sooner than :data:`IDLE_DUTY` times the last scan's cost after the last one (at most 2 % of
  a core: 0.25 s every 12.5 s with 5,000 processes), nor sooner than :data:`MIN_GAP`.
- No scan starts while memory filling at ``fill_rate`` could reach the line before it ends
  (headroom below twice ``fill_rate`` x the scan's expected cost): the poll loop does not
  sample during a scan.  The expected cost is the larger of the last scan's cost and an
  estimate scaled to the box now: the last scan's cost per /proc entry times the scheduling
  entities in the same /proc/loadavg read (4th field, the number after '/', proc(5): threads
  too, so an upper bound).
- At the crossing an armed target is signalled with no read of /proc but its pidfds'; without
  one (nothing was armed, or the choice was ambiguous) :meth:`Armed.fresh` makes a look and
  the choice from the matching trees, and only where those cannot decide does the crossing
  scan /proc.

An ambiguous choice is not used at the crossing: when the armed tree was ranked by memory
among several trees matching the best pattern, or chosen by ``targets.fallback: oom_score``,
another tree may have grown past it since the last choice without creating a process (no churn
to notice), so :meth:`Armed.take` returns None and the crossing chooses again, reading the
memory of the matching trees (:meth:`Armed.fresh`).  The usual case, one engine tree, is
signalled from its pidfds alone.

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
MIN_GAP = 2.0        # seconds: the most often the guard rescans /proc near the line (far from it: every IDLE_CHECK)
MAX_AGE = 60.0       # seconds: rescan at least this often, churn or not
IDLE_DUTY = 50       # idle: scans take at most 1/50 of the time (2 % of a core)
SMALL_DUTY = 4       # little headroom: at most 1/4 of the time
NEW_PIDS = 32        # processes found new whose argv each look reads again (an exec, a title)
LOOK_IDS = 1024      # ids handed out since the last look read one by one; more: one listing of /proc
LOOK_BUDGET = 128    # new processes read at one look (stat and argv); the rest at the next
LOOK_DUTY = 10       # looks take at most 1/10 of the time near the line


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
        choose: callable ``(procs=None)`` returning ``(enginetree.Target with tree rows or None,
            {pid: proctree.Proc}, ambiguous)``.  Without ``procs`` it does the /proc pass (engine
            first, then ``targets.match``) and returns the whole scan, whose size gives the cost
            per entry, even when nothing matches; with ``procs`` (the matching processes and
            their trees, :meth:`_view`) it chooses among them, or returns None where they cannot
            decide (the caller scans).  ``ambiguous`` (bool): the choice ranked trees by memory or
            came from the oom_score fallback (:func:`sparkguard.enginetree.ambiguous`).
        fill_rate: assumed fill rate, bytes/s.
        clock: monotonic seconds.
        proc_root: the /proc whose ``loadavg`` gives the pid cursor and whose entries are read.
        matches: callable(``proctree.Proc``) -> bool, whether a process matches ``targets.match``
            (:meth:`reset` replaces it on a reload).
    Attributes:
        scans: whole-/proc passes so far; looks: looks at new processes; seen: new processes
            read by looks; choices: choices made from the matching trees alone.
    """

    def __init__(self, choose: Callable[..., tuple | None], fill_rate: float,
                 clock: Callable[[], float] = time.monotonic, proc_root: str = "/proc",
                 matches: Callable[[proctree.Proc], bool] = lambda p: False):
        self.choose = choose
        self.fill_rate = fill_rate
        self.clock = clock
        self.matches = matches
        self.target = None
        self.tree: signals.Tree | None = None
        self.procs: dict = {}
        self.last_scan: float | None = None
        self.scan_cost = 0.0
        self.entry_cost = 0.0       # seconds per /proc entry (process) of the last scan
        self.scans = self.looks = self.seen = self.choices = 0
        self.stale = False
        self.ambiguous = False
        self._errors = 0
        self._next_check = 0.0
        self.proc_root = proc_root
        self._fd = os.open(os.path.join(proc_root, "loadavg"), os.O_RDONLY | os.O_CLOEXEC)
        self._last_pid: int | None = None    # the pid cursor at the last scan or look
        self.matching: dict[int, int] | None = None  # pid -> starttime of every matching process; None: unknown
        self._known: set[int] = set()        # pids read by the last scan and the looks since
        self._known_cap = LOOK_IDS           # pids known past which a look forgets those gone (_listed)
        self._pending: list[int] = []        # new processes a look had no budget for: read first at the next
        self._recent: dict[int, bytes | None] = {}  # the last NEW_PIDS processes looks found new -> argv head
        self._unseen: tuple[int, ...] = ()   # ids of the last look's churn with no /proc entry (look)
        self._next_look = 0.0                # monotonic s: no look before (LOOK_DUTY x the last one's cost)

    def _loadavg(self) -> tuple[int, int]:
        """From one read of /proc/loadavg (proc(5)): the last field, the last pid handed out,
        and the number after '/' in the 4th field, the scheduling entities (processes and
        threads) that exist now."""
        f = os.pread(self._fd, 128, 0).split()
        return int(f[-1]), int(f[3].rpartition(b"/")[2])

    def tick(self, now: float, headroom: int, small: int) -> None:
        """One full pass in the OK state: note exits and churn, look at new processes, choose
        again or rescan when due (module doc)."""
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
            moved = cursor != self._last_pid or self._unseen or self._pending
            if self.matching is None or self.last_scan is None:     # nothing to look from: scan when due
                if refresh_due(now, self.last_scan, self.scan_cost, bool(moved), *gates):
                    self.refresh()
            elif refresh_due(now, self.last_scan, self.scan_cost, False, False, *gates[1:]):
                self.refresh()          # MAX_AGE
            elif (moved or self.stale) and now >= self._next_look:
                t0 = self.clock()
                if self.look(cursor) or self.stale:
                    self.rechoose()
                self._next_look = now + LOOK_DUTY * (self.clock() - t0)
        except Exception:  # noqa: BLE001 - the poll loop must outlive this
            self._errors += 1
            if self._errors == 1 or self._errors % 100 == 0:
                log.exception("refreshing the armed target failed (%d times); the crossing will scan /proc",
                              self._errors)

    def look(self, cursor: int) -> bool:
        """Read the processes created since the last look (module doc), only them.  Returns True
        when the choice may have changed: a new process (or one found new before that exec'd or
        changed its title since) matches, or a new process is a child of the armed tree.

        The ids handed out after the last look up to ``cursor`` are looked up one by one
        (:func:`sparkguard.proctree.new_processes`: threads and exited ones passed over); past
        :data:`LOOK_IDS` of them, or across the wrap at pid_max, /proc is listed once and compared
        with the pids known.  An id is handed out before its process shows in /proc (fork:
        alloc_pid before attach_pid, kernel/fork.c), so the ids a look found no entry for are
        looked up once more at the next look, which comes whether the cursor moved again or not."""
        self.looks += 1
        root = self.proc_root
        last = self._last_pid
        missing: list[int] = []
        if last is not None and 0 <= cursor - last <= LOOK_IDS:
            found = proctree.new_processes((*self._unseen, *range(last + 1, cursor + 1)), root, missing)
            if found is None:       # an entry that cannot be read as a status: list /proc instead
                found = self._listed()
        else:
            found = self._listed()
        self._unseen = tuple(pid for pid in missing if last is None or pid > last)
        self._last_pid = cursor
        changed = False
        for pid, head in list(self._recent.items()):    # an exec or a new title since it was found
            now_head = proctree.argv_head(pid, root)
            if now_head is None:
                del self._recent[pid]
            elif now_head != head:
                self._recent[pid] = now_head
                p = proctree.read_proc(pid, root)
                if p is not None and self.matches(p):
                    self.matching[pid] = p.starttime
                    changed = True
        todo = list(dict.fromkeys((*self._pending, *found)))
        self._pending = todo[LOOK_BUDGET:]
        members = set(self.tree.fds) if self.tree is not None else set()
        for pid in todo[:LOOK_BUDGET]:
            self._known.add(pid)
            p = proctree.read_proc(pid, root)
            if p is None or p.kthread:
                continue
            self.seen += 1
            self._recent[pid] = proctree.argv_head(pid, root)
            if p.ppid in members:       # the armed tree grew
                changed = True
            if self.matches(p):
                self.matching[pid] = p.starttime
                changed = True
        while len(self._recent) > NEW_PIDS:
            del self._recent[next(iter(self._recent))]
        if len(self._known) > self._known_cap:     # exits are not seen: forget the pids gone now and then
            self._listed()
            self._known_cap = 2 * len(self._known) + LOOK_IDS
        return changed

    def _listed(self) -> list[int]:
        """The pids in /proc that no scan or look has read (one listing: its cost follows the
        number of processes, but no entry is opened); pids gone are forgotten."""
        now = set(proctree.pids(self.proc_root))
        self._known &= now
        return sorted(now - self._known)

    def _view(self) -> dict | None:
        """The matching processes alive now, read again (one gone, or whose pid was reused, is
        dropped), with their trees (:func:`sparkguard.proctree.add_descendants`); None when the
        trees cannot be read that way."""
        procs = {}
        for pid, start in list(self.matching.items()):
            p = proctree.read_proc(pid, self.proc_root)
            if p is None or p.starttime != start:
                del self.matching[pid]
            else:
                procs[pid] = p
        return procs if proctree.add_descendants(procs, self.proc_root) else None

    def _from_view(self):
        """``(target, procs, ambiguous)`` chosen among the matching trees, or None where they
        cannot decide (no look yet, the trees unreadable, ``choose`` declines)."""
        if self.matching is None:
            return None
        view = self._view()
        got = self.choose(view) if view is not None else None
        if got is not None:
            self.choices += 1
        return got

    def rechoose(self) -> None:
        """Choose again among the matching trees and arm the choice; where they cannot decide,
        mark the choice stale (a scan comes when due)."""
        got = self._from_view()
        if got is None:
            self.matching = None        # the next due pass scans
            self.stale = True
            return
        self.stale = False
        self._arm(*got)

    def fresh(self):
        """At the crossing, with nothing armed to take: a look at the new processes and the
        choice among the matching trees, their memory read now.  Returns ``(target, tree)``
        (``(None, None)``: nothing matches), or None where the matching trees cannot decide:
        the caller scans /proc."""
        if self.matching is None:
            return None
        self.look(self._loadavg()[0])
        got = self._from_view()
        if got is None:
            return None
        target = got[0]
        self.stale = True
        self._next_check = 0.0
        return (target, cgkill.tree_for(target)) if target is not None else (None, None)

    def refresh(self) -> None:
        """Choose again now (one /proc pass) and reopen the tree's pidfds."""
        self._last_pid = self._loadavg()[0]     # before the scan: a process born during it is churn
        self._unseen = ()
        self._pending = []
        self._recent = {}
        self.matching = None
        self._known = set()
        t0 = self.clock()
        target, procs, ambiguous = self.choose()
        self.scan_cost = self.clock() - t0
        self.entry_cost = self.scan_cost / max(1, len(procs))
        self.last_scan = t0
        self.scans += 1
        self.stale = False
        self._known = set(procs)
        self._known_cap = 2 * len(procs) + LOOK_IDS
        self.matching = {pid: p.starttime for pid, p in procs.items() if not p.kthread and self.matches(p)}
        self._arm(target, procs, ambiguous)

    def _arm(self, target, procs: dict, ambiguous: bool) -> None:
        """Arm ``target`` (None: nothing matches) chosen from ``procs``: open its tree's pidfds."""
        self.disarm(stale=False)
        if target is not None:
            self.ambiguous = ambiguous
            self.target = target
            self.procs = {pid: procs[pid] for pid in target.pids if pid in procs}
            self.tree = cgkill.tree_for(target)     # a cgroup's tree: its SIGKILL is the cgroup's

    def take(self):
        """At the crossing: ``(target, tree, procs)`` if the armed root is still alive and the
        choice was not ambiguous (module doc), else None (the caller chooses again: :meth:`fresh`).

        The tree (and its pidfds) passes to the caller; the next :meth:`tick` chooses again."""
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

    def reset(self, matches: Callable[[proctree.Proc], bool]) -> None:
        """A reload replaced ``targets``: drop the armed choice and the matching processes (the
        next due pass scans with ``matches``)."""
        self.matches = matches
        self.matching = None
        self.disarm()

    def disarm(self, stale: bool = True) -> None:
        """Drop the armed choice and close its pidfds; ``stale``: choose again at the next due pass."""
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

"""The one SIGTERM -> grace -> SIGKILL -> sweep: "stop this tree, for this reason".

The memory guard (its poll loop), the engine supervisor (its thread) and the leftover sweep all
stop processes through :class:`Stopper`.  A request for a tree that is already being stopped
*joins* that escalation: no second SIGTERM (uvicorn force-exits on a second one, FIELD-NOTES),
and the grace runs from the first SIGTERM.  That is the rule "never two SIGTERMs, one grace
clock", and it lives here only.

The state is plain data on an injected clock (:class:`Escalation`: the first SIGTERM's time,
the grace left); the signals go through the tree's pidfds (:class:`sparkguard.signals.Tree`), so a recycled
pid is never hit.  Two ways to drive one:

* the guard's poll loop never waits: its policy (:mod:`sparkguard.policy`, whose grace clock it
  sets from :attr:`Escalation.t_term` when it joins, and which cuts the grace short below
  ``guard.kill_below``) says when the SIGKILL is due, and it calls :meth:`Stopper.kill`; the
  tree's pidfds wake the loop when members exit;
* a thread that may wait (the supervisor's) calls :meth:`Stopper.stop`, which waits out the rest of
  the grace through a wait function it is given (the supervisor's bounded condition wait), then
  SIGKILLs the tree and waits again.

Threads: :class:`Stopper`'s lock guards its table of running escalations and each escalation's
``holders`` and ``killing``; it is held only for those O(1) updates, never
across a signal, a /proc pass or a wait, so the poll loop never waits behind the supervisor.  The
SIGTERM is sent by the one request that created the escalation; a SIGKILL pass already running in
another thread makes :meth:`Stopper.kill` return at once with nothing sent.  A tree is closed by
the last holder's :meth:`Stopper.release`.
"""

from __future__ import annotations

import logging
import select
import signal
import threading
import time
from typing import Callable

from sparkguard import enginetree, signals

log = logging.getLogger("sparkguard.escalation")

AFTER_KILL = 10.0      # seconds a waiting caller gives a SIGKILLed tree to exit (a D-state process may not)


class Escalation:
    """One tree being stopped: pure state, the signals are sent by :class:`Stopper`.

    Attributes:
        key: ``(root pid, root start time)``: what a second request must match to join.
        tree: the :class:`sparkguard.signals.Tree` (shared by every holder; read-only to them).
        reason: str, why it is stopped (``"memory"``, ``"wedged"``, ``"stop"``, ``"sweep"``...).
        grace: float seconds from the first SIGTERM to the SIGKILL.
        t_term: float monotonic seconds of the first SIGTERM (the one grace clock).
        sent: bool, the SIGTERM reached a live process (False: the root was already gone).
        dry_run: bool; nothing is sent, :meth:`Stopper.kill` returns the members it would kill.
        holders: int, requests not yet released (under the :class:`Stopper`'s lock).
        killing: bool, a SIGKILL pass runs in some thread (under the :class:`Stopper`'s lock).
    """

    __slots__ = ("key", "tree", "reason", "grace", "t_term", "sent", "dry_run", "holders", "killing")

    def __init__(self, key: tuple, tree: signals.Tree, reason: str, grace: float, t_term: float,
                 dry_run: bool = False):
        self.key, self.tree, self.reason, self.grace, self.t_term = key, tree, reason, grace, t_term
        self.sent = False
        self.dry_run = dry_run
        self.holders = 1
        self.killing = False

    def grace_left(self, now: float) -> float:
        """Seconds (>= 0) from ``now`` (monotonic) until the grace since the first SIGTERM ends."""
        return max(0.0, self.t_term + self.grace - now)


def key_of(tree: signals.Tree) -> tuple:
    """``(root pid, root start time)`` of ``tree``: the identity a joining request matches."""
    return tree.root, tree.starttimes.get(tree.root)


class Stopper:
    """The owner of every escalation of this process (module docstring: threads).

    Args:
        clock: monotonic seconds (``time.monotonic``; tests pass a fake clock).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self._lock = threading.Lock()
        self._running: dict[tuple, Escalation] = {}

    def request(self, tree: signals.Tree, reason: str, grace: float, dry_run: bool = False,
                term_all: bool = False) -> tuple[Escalation, bool]:
        """Stop ``tree`` for ``reason``: SIGTERM its root (``term_all``: every member, as the leftover
        sweep does) unless an escalation of the same tree runs, which is joined instead.

        The caller owns ``tree`` until this returns; from then on the escalation does (a joining
        request's own tree is closed here).  Every request is paired with one :meth:`release`.

        Args:
            tree: pidfds of the tree, opened by the caller.
            reason: str, recorded on a new escalation (a joiner reads the first one's).
            grace: float seconds; a joiner keeps the running escalation's grace and clock.
            dry_run: send nothing; never joins nor is joined (it stops nothing).
        Returns:
            ``(escalation, joined)``: ``joined`` is True when it was already running.
        """
        key = key_of(tree)
        now = self.clock()
        if dry_run:
            return Escalation(key, tree, reason, grace, now, dry_run=True), False
        with self._lock:
            esc = self._running.get(key) if key[1] is not None else None
            if esc is not None:
                esc.holders += 1
            else:
                esc = Escalation(key, tree, reason, grace, now)
                if key[1] is not None:      # a root with no pidfd (already gone) is no one else's tree
                    self._running[key] = esc
        if esc.tree is not tree:
            tree.close()
            return esc, True
        if term_all:
            esc.sent = any([tree.send(pid, signal.SIGTERM) for pid in list(tree.fds)])
        else:
            esc.sent = tree.term_root()
        return esc, False

    def kill(self, esc: Escalation, protector: enginetree.Protector | None = None) -> list[int]:
        """SIGKILL every live member of ``esc``'s tree, process_mrelease them, sweep descendants that
        appeared and SIGKILL those (:meth:`sparkguard.signals.Tree.kill_all`).  Never waits: when
        another thread is in a SIGKILL pass of the same tree, returns ``[]`` at once.

        Returns:
            list[int], the pids signalled now (dry run: the members that would be).
        """
        if esc.dry_run:
            return list(esc.tree.fds)
        with self._lock:
            if esc.killing:
                return []
            esc.killing = True
        try:
            return esc.tree.kill_all(protector)
        finally:
            with self._lock:
                esc.killing = False

    def running(self, root: int, starttime: int) -> Escalation | None:
        """The escalation of the tree rooted at ``root`` (with that start time) in progress, or None."""
        with self._lock:
            return self._running.get((root, starttime))

    def release(self, esc: Escalation) -> None:
        """The caller is done with ``esc``; the last holder's release closes the tree's pidfds."""
        if esc.dry_run:
            esc.tree.close()
            return
        with self._lock:
            esc.holders -= 1
            last = esc.holders == 0
            if last and self._running.get(esc.key) is esc:
                del self._running[esc.key]
        if last:
            esc.tree.close()

    def stop(self, tree: signals.Tree, reason: str, grace: float, wait: Callable[[float], bool] | None = None,
             protector: enginetree.Protector | None = None, term_all: bool = False,
             note: Callable[[str, Escalation, list[int]], None] | None = None) -> tuple[Escalation, list[int]]:
        """From a thread that may wait: :meth:`request`, wait out the grace from the first SIGTERM,
        SIGKILL what is left, wait up to :data:`AFTER_KILL` more; then :meth:`release`.

        Args:
            wait: ``(seconds) -> bool``: wait up to that long, True once the tree is stopped (the
                supervisor: its root's exit, on its condition); None: every member of the
                escalation's tree has exited (:func:`wait_gone`).
            note: ``(event, escalation, pids)`` called after the SIGTERM (``"sigterm"``, or
                ``"joined"``) and after a SIGKILL (``"sigkill"``), before any wait.
        Returns:
            ``(escalation, killed pids)``; the escalation is released when this returns.
        """
        esc, joined = self.request(tree, reason, grace, term_all=term_all)
        if wait is None:
            def wait(seconds: float) -> bool:
                return wait_gone(esc.tree, seconds, self.clock)
        try:
            if note is not None:
                note("joined" if joined else "sigterm", esc, [])
            if wait(esc.grace_left(self.clock())):
                return esc, []
            killed = self.kill(esc, protector)
            if note is not None:
                note("sigkill", esc, killed)
            wait(AFTER_KILL)
            return esc, killed
        finally:
            self.release(esc)


def wait_gone(tree: signals.Tree, seconds: float, clock: Callable[[], float] = time.monotonic) -> bool:
    """Sleep in poll(2) on ``tree``'s pidfds until every member has exited (True) or ``seconds``
    have passed (False)."""
    deadline = clock() + seconds
    poller = select.poll()
    for fd in list(tree.fds.values()):
        poller.register(fd, select.POLLIN)
    while tree.alive():
        left = deadline - clock()
        if left <= 0:
            return False
        # at most 100 ms: members a SIGKILL pass swept in are not in this poll set
        for fd, _ in poller.poll(min(max(1.0, left * 1000.0), 100.0)):
            poller.unregister(fd)
    return True


#: the process's one owner of escalations: the guard and the supervisor share it
OWNER = Stopper()

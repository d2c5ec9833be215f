"""The poll loop's idle fast path: far above the line, MemAvailable alone (or MemFree), five times a second.

``g`` is the :class:`sparkguard.guard.loop.Guard` whose loop runs it; its fields written here
(``fast_polls``, ``poll_mark``) are read by guard/view.py, ``_fast`` by :func:`run` alone; the
snapshot reads MemAvailable itself (:meth:`sparkguard.meminfo.MeminfoReader.available_now`).
What it costs, measured: bench/results/idle-parse.txt.
"""

from __future__ import annotations

import logging
import math
import os
import time

from sparkguard import meminfo, policy
from sparkguard.freepages import LRU_LABELS, FreeCheck
from sparkguard.guard import settings

log = logging.getLogger("sparkguard")

FREE_FIELDS = (meminfo.MEMFREE_LABEL, meminfo.AVAIL_LABEL, *LRU_LABELS)   # what FreeFloor.check reads of a pass


def run(g, left: int, s: settings.LoopSettings) -> None:
    """The idle fast path: up to ``left`` polls of MemAvailable alone, each followed by a sleep
    of ``s.interval``; returns at the first poll whose check fails (MemAvailable may be under
    ``s.idle_floor``, or a read failed) or that finds a flag set (a signal, a stop request).
    Kept to these few lines: five times a second, forever.

    The check is the one :func:`budget` made at the last full pass (``g._fast``):

    - a :class:`sparkguard.freepages.FreeCheck`: one ``os.sysconf`` call, MemFree in pages, at
      or above its need (MemAvailable is never below MemFree less the deficit bound the full
      pass read), and no read of /proc/meminfo; every ``check.every``-th poll (once a second)
      makes the window check below instead, which reads MemAvailable itself;
    - else a :class:`sparkguard.meminfo.FastCheck` at every poll: the read lands the MemAvailable
      line's label and first columns in a window of their own, and four byte-string compares of
      the window and the next column with the check's bounds tell a value at or above the floor.

    Either answer only ever ends the fast path; the full pass then reads with
    :meth:`meminfo.MeminfoReader.sample`, which reports what is wrong.

    A poll checks, counts, reads the clock and sleeps.  Only a poll at or after the time
    :func:`next_due` gives (the next watchdog ping's send time) calls :func:`due`: after 200 ms
    of sleep every line of Python runs cold, and a call that looks at the notifier costs
    microseconds there (bench/idle_budget.py), while one clock read and a compare cost about
    nothing (bench/results/idle-parse.txt)."""
    sleep, clock = g._idle_poll, time.monotonic
    ms, flags = s.interval * 1000.0, g._flags
    try:
        check = g._fast
        due_at = next_due(g, s.interval)
        # one loop per check, each written out: a call per poll costs microseconds cold
        if type(check) is FreeCheck:
            sysconf, name, need, every = os.sysconf, check.name, check.need, check.every
            view, size, window, low, high, last = check.window
            preadv, fd, k = os.preadv, g.reader.fd, every
            while left:
                k -= 1
                if k:
                    if sysconf(name) < need or flags:
                        return
                else:
                    k = every
                    if preadv(fd, view, 0) != size or window < low or window > high or last < b"0" \
                            or last > b"9" or flags:
                        return
                g.fast_polls += 1
                left -= 1
                if clock() >= due_at:
                    due(g, s)
                    due_at = next_due(g, s.interval)
                sleep(ms)
            return
        preadv, fd = os.preadv, g.reader.fd
        view, size, window, low, high, last = check
        while left:
            if preadv(fd, view, 0) != size or window < low or window > high or last < b"0" or last > b"9" \
                    or flags:
                return
            g.fast_polls += 1
            left -= 1
            if clock() >= due_at:
                due(g, s)
                due_at = next_due(g, s.interval)
            sleep(ms)
    except OSError:                         # the full pass reports it
        return
    except Exception:  # noqa: BLE001 - the guard must outlive its own bugs
        log.exception("poll loop error on the idle path; the guard keeps running")


def next_due(g, interval: float) -> float:
    """Monotonic s from which an idle poll calls :func:`due`: the next watchdog ping's send time
    (one ``interval`` before ``notifier.next_ping``: the poll after it would come too late);
    ``math.inf`` without a watchdog.  Read again after each :func:`due`.  The black box's idle
    records come from the full passes (:meth:`sparkguard.guard.loop.Guard._pass`), one every
    :data:`~sparkguard.blackbox.IDLE_INTERVAL` (the idle full pass's period)."""
    notifier = g.notifier
    return math.inf if notifier.watchdog_interval is None else notifier.next_ping - interval


def due(g, s: settings.LoopSettings) -> float:
    """At an idle poll at or after :func:`next_due`: note the poll's time and count
    (``poll_mark``, one tuple: other threads read it whole) and send the watchdog ping.  Returns
    the monotonic time (s)."""
    now = time.monotonic()
    g.poll_mark = (now, g.fast_polls)
    notifier = g.notifier
    if notifier.watchdog_interval is not None and now >= notifier.next_ping - s.interval:
        notifier.watchdog(max(now, notifier.next_ping))     # WATCHDOG=1 from the loop itself
    return now


def budget(g, timeout: float, s: settings.LoopSettings) -> int:
    """Fast polls allowed after a full pass that chose to sleep ``timeout`` seconds: none unless
    the guard is idle far above the line (state OK, MemAvailable at least ``s.idle_floor``, no
    signal flagged, reads succeeding) and a check can be made for them, kept in ``g._fast`` for
    :func:`run`: the window check of the pass's read
    (:meth:`sparkguard.meminfo.MeminfoReader.fast_check`), and with it the free-memory check
    where MemFree is well above its need (:meth:`sparkguard.freepages.FreeFloor.check`); else
    ``s.budget`` (the fast path sends the watchdog pings that fall due meanwhile)."""
    if timeout < s.interval or g.policy.state is not policy.OK or g.avail < s.idle_floor or g._flags \
            or g._fail_since is not None or g.soft.engaged():
        return 0
    r = g.reader
    window = r.fast_check(s.idle_floor)
    g._fast = g.free.check(s.idle_floor, s.far, s.interval, {k: r.last(k) for k in FREE_FIELDS},
                           r.last(meminfo.MEMTOTAL_LABEL) or 0, window) or window
    return 0 if g._fast is None else s.budget

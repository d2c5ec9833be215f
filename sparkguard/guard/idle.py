"""The poll loop's idle fast path: far above the line, MemAvailable alone, five times a second.

``g`` is the :class:`sparkguard.guard.loop.Guard` whose loop runs it; its fields written here
(``fast_polls``, ``fast_raw``, ``poll_mark``) are read by guard/view.py.  What it
costs, measured: bench/results/idle-parse.txt.
"""

from __future__ import annotations

import logging
import math
import os
import time

from sparkguard import meminfo, policy
from sparkguard.guard import ring as ring_mod
from sparkguard.guard import settings

log = logging.getLogger("sparkguard")

#: seconds of polls at most between two reads of the clock on the idle fast path: bounds how far
#: the wake-ups' lateness can add up before a due watchdog ping (:func:`batch`)
BATCH_MAX = 1.0


def run(g, left: int, s: settings.LoopSettings) -> None:
    """The idle fast path: up to ``left`` polls of MemAvailable alone, each followed by a sleep
    of ``s.interval``; returns at the first read that is not far above the line
    (``s.idle_floor``), fails, or finds a flag set (a signal, a stop request).  Kept to these
    few lines: five times a second, forever.

    MemAvailable is checked by :func:`sparkguard.meminfo.fast_above`, as bytes at the offset the
    last full pass found (``_fast_at``); its answer only ever ends the fast path: a line that
    moved, a short read or a value below the floor does, and the full pass then reads with
    :meth:`meminfo.MeminfoReader.sample`, which reports what is wrong.  The value itself is
    kept as the kernel printed it (``fast_raw``); :func:`sparkguard.guard.view.snapshot` parses it when asked.

    A poll only reads, compares, counts and sleeps.  The clock is read once per batch of
    polls (:func:`batch`: at most :data:`BATCH_MAX` s of them, ending at the poll where the next
    watchdog ping or black-box record falls due), since after 200 ms of sleep every line of
    Python runs cold and each costs (bench/results/idle-parse.txt)."""
    fd, view, buf = g.reader.inline_parts()
    preadv, above, sleep = os.preadv, meminfo.fast_above, g._idle_poll
    at, (width, pattern), ms, flags = g._fast_at, s.idle_pattern, s.interval * 1000.0, g._flags
    try:
        # the first poll comes at once, without a sleep before it: counted from one interval back
        k = min(left, batch(g, time.monotonic() - s.interval, s.interval))
        left -= k
        while True:
            n = preadv(fd, view, 0)
            raw = above(buf, n, at, width, pattern)
            if raw is None or flags:
                return
            g.fast_polls += 1
            g.fast_raw = raw
            k -= 1
            if not k:
                now = due(g, buf, n, s)
                if not left:
                    sleep(ms)
                    return
                k = min(left, batch(g, now, s.interval))
                left -= k
            sleep(ms)
    except OSError:                         # the full pass reports it
        return
    except Exception:  # noqa: BLE001 - the guard must outlive its own bugs
        log.exception("poll loop error on the idle path; the guard keeps running")


def batch(g, now: float, interval: float) -> int:
    """Polls of the idle fast path after the one at ``now`` (monotonic s) up to the first one at
    or after the next watchdog ping's send time (one ``interval`` before ``notifier.next_ping``)
    or the black box's next record (``ring.next_at``); at least 1, at most :data:`BATCH_MAX` s
    of polls.  Each poll sleeps ``interval`` s, so the batch never ends before that time; the
    wake-ups' lateness adds up over at most one batch: a ping is late by at most the lateness of
    ``BATCH_MAX / interval`` wake-ups (5 at 200 ms), against half of WatchdogSec of margin."""
    cap = max(1, math.ceil(BATCH_MAX / interval))
    due = math.inf
    notifier, ring = g.notifier, g.ring
    if notifier.watchdog_interval is not None:
        due = notifier.next_ping - interval
    if ring is not None:
        due = min(due, ring.next_at)
    if due - now >= cap * interval:
        return cap
    return max(1, math.ceil((due - now) / interval))


def due(g, buf: bytearray, n: int, s: settings.LoopSettings) -> float:
    """At the end of a batch of idle polls (``buf[:n]``, the last read): note the poll's time
    and count (``poll_mark``, one tuple: other threads read it whole), send the watchdog ping and
    take the black box's record when due.  Returns the monotonic time (s)."""
    now = time.monotonic()
    g.poll_mark = (now, g.fast_polls)
    notifier, ring = g.notifier, g.ring
    if notifier.watchdog_interval is not None and now >= notifier.next_ping - s.interval:
        notifier.watchdog(max(now, notifier.next_ping))     # WATCHDOG=1 from the loop itself
    if ring is not None and now >= ring.next_at:          # the black box's record (blackbox.IDLE_INTERVAL)
        ring.sample(now, buf, n, None, s.use_swap, policy.OK, True, ring_mod.target_mem(g.actions))
    return now


def budget(g, timeout: float, s: settings.LoopSettings) -> int:
    """Fast polls allowed after a full pass that chose to sleep ``timeout`` seconds: none unless
    the guard is idle far above the line (state OK, MemAvailable at least ``s.idle_floor``, no
    signal flagged, reads succeeding); else ``s.budget`` (the fast path sends the watchdog
    pings that fall due meanwhile)."""
    if timeout < s.interval or g.policy.state is not policy.OK or g.avail < s.idle_floor or g._flags \
            or g._fail_since is not None or g._fast_at < 0 or s.idle_pattern is None \
            or g.soft.engaged():
        return 0
    return s.budget

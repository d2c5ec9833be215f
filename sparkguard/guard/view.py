"""What the guard shows of itself: the STATUS= line and the snapshot that metrics and status read.

Both are plain reads of the :class:`sparkguard.guard.loop.Guard`'s attributes, done by the loop
(STATUS=) or another thread (the metrics scrape): no locks; a value the loop changes between two
reads is read once into a local.  The snapshot's one read is MemAvailable's, through the reader's
own second descriptor (:meth:`sparkguard.meminfo.MeminfoReader.available_now`): the idle fast
path does not parse what it reads.
"""

from __future__ import annotations

import time

from sparkguard.guard import logq
from sparkguard.units import format_line


def status_line(guard) -> str:
    """One line for STATUS= of ``guard`` (a :class:`sparkguard.guard.loop.Guard`): available, line,
    state; or why the guard is blind."""
    if guard.notifier is not None and guard.notifier.blind:
        since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(guard._fail_wall))
        return f"BLIND: cannot read {guard.reader.path} since {since}: {guard._fail_error}"
    g = guard.cfg.guard
    what = "MemAvailable" if g.signal == "available" else "MemAvailable+SwapFree"
    line = f"{what} {format_line(guard.value)}, SIGTERM line {format_line(g.term_below)}"
    if g.kill_below is not None:
        line += f", SIGKILL line {format_line(g.kill_below)}"
    state = guard.policy.state
    target = guard.actions.target
    if target is not None and state != "ok":
        state += f" (pid {target.root_pid})"
    problem = guard.metrics.problem() if guard.metrics is not None else None
    soft = guard.soft.status() if guard.soft is not None else ""
    return f"{line}; state {state}" + (f"; {soft}" if soft else "") + ("; DRY RUN" if g.dry_run else "") \
        + (f"; {problem}" if problem else "")


def last_poll(guard, mono_now: float) -> float:
    """Monotonic s of ``guard``'s last poll, or 0.0 before the first.  The idle fast path notes
    the time (``poll_mark``) only where a watchdog ping falls due
    (:func:`sparkguard.guard.idle.due`; the full pass at each), and counts each poll: its polls since the mark are
    taken as one ``guard.poll_interval`` apart (each sleeps that long; the first after a full
    pass whose sleep a wake-up cut short may come sooner), capped at ``mono_now``.  A loop that
    stops polling stops the count, so the timestamp goes stale as it should."""
    t, polls = guard.poll_mark
    return t and min(mono_now, t + (guard.fast_polls - polls) * guard.cfg.guard.poll_interval)


def snapshot(guard) -> dict:
    """The state of ``guard`` for metrics and status (its keys: docs/snapshot.md): plain reads of
    what the loop keeps, and MemAvailable read now, safe from any thread but the loop's."""
    g = guard.cfg.guard
    mono_now = time.monotonic()
    total = guard.reader.mem_total if guard.reader else 0
    swap_total = guard.reader.swap_total if guard.reader else 0
    victim = guard.actions.target      # read once: the loop may clear it between two reads
    rec = guard.recorder
    now = guard.reader.available_now() if guard.reader else None     # fresher than any poll's
    avail = guard.avail if now is None else now
    return {
        "available_bytes": avail, "total_bytes": total, "swap_free_bytes": guard.swap_free,
        "swap_total_bytes": swap_total, "signal": g.signal,
        # the idle fast path refreshes MemAvailable only: with signal "available" it is the value
        "signal_bytes": avail if g.signal == "available" else guard.value,
        "term_below_bytes": g.term_below, "kill_below_bytes": g.kill_below, "grace_seconds": g.grace,
        "poll_interval_seconds": g.poll_interval, "state": guard.policy.state, "dry_run": g.dry_run,
        "signals_sent": dict(guard.actions.signals_sent),
        "incidents": dict(rec.counts) if rec is not None else {},
        "last_incident_timestamp": rec.last_incident if rec is not None else None,
        "last_incident": rec.last_incident_ref if rec is not None else None, "poll_count": guard.poll_count,
        "poll_seconds_sum": guard.poll_sum, "polls_total": guard.poll_count + guard.fast_polls,
        "last_poll_timestamp": time.time() - (mono_now - last) if (last := last_poll(guard, mono_now)) else None,
        "started_timestamp": guard.started, "config_path": guard.cfg.path,
        "config_reloads": dict(guard.reloads),
        "notify_dropped": guard.notifier.dropped if guard.notifier else 0,
        "log_dropped": logq.dropped(),
        "blind": bool(guard.notifier and guard.notifier.blind),
        "victim": {"pid": victim.root_pid, "title": victim.title} if victim is not None else None,
        "proc_view": guard.proc_view,
        "fall_rate_bytes_per_second": guard.fall.rate if guard.fall is not None else None,
        "engine_loading": guard.engine.loading(),
        "metrics": guard.metrics.state() if guard.metrics is not None else None,
        "pause": guard.soft.snapshot() if guard.soft is not None else None,
    }

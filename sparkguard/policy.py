"""The pure decision core: when to SIGTERM, when to escalate, when an incident ends.

No I/O and no clock of its own: the caller passes the monotonic time and the memory
signal on every poll and carries out the returned actions.  Tests drive it with a fake
clock.

One incident is one episode (issue #2): it opens at the crossing of ``term_below`` and
closes when the victim is gone and memory is back above the line.  On Linux >= 6.7 a dead
victim's memory lands on the kernel's per-CPU free lists first, outside MemAvailable, and drains
into it over a minute or two (:mod:`sparkguard.pcp`): while the signal plus those free pages
(``pcp_free``) is above the line and the signal itself is not falling, the wait for memory goes on
past ``recovery_wait``, up to :data:`PCP_DRAIN_WAIT` more, so the hidden part is never a reason for
a second victim.  Every
decision to act looks at the signal alone: an allocation that finds the zone short drains the
lists itself.  States::

    OK --crossing--> TERM_SENT --victim gone--> RECOVERING --memory back--> OK
                        |  grace over, or below kill_below   ^
                        v                                    |
                     KILL_SENT ------victim gone-------------+
    OK --crossing, no target--> NO_TARGET --target found--> TERM_SENT
                                   '--memory back--> OK

What opens an incident (the *trigger*, :attr:`Policy.fired`): the signal below the line
(``"line"``), or, with a rate lead (``Thresholds.rate_lead`` > 0), the signal falling at least
``rate_min`` bytes/s fast enough to reach the line within ``rate_lead`` seconds (``"predicted"``;
the fall rate comes from :mod:`sparkguard.rate`, the caller's estimate).  While a supervised
engine loads (started, not yet ready: the caller says so), the load's own line and lead apply
(``Thresholds.load``), so a load's steep fall by design is not a serving leak, and an incident
it opens is a failed load (``Policy.fired["phase"] == "loading"``)::

    OK --value < line, or (fall >= rate_min and (value - line) / fall <= lead)--> TERM_SENT
       line, lead, rate_min: the load's while the engine loads, the guard's otherwise

A predicted trigger that finds no target waits in NO_TARGET until the signal is above the line
and no longer predicted to cross it (so a steady fall does not open one incident per poll).

Guarantees (FIELD-NOTES, "their users' worst reports"): a victim is SIGTERMed once; if
it has not exited ``grace`` seconds later it is SIGKILLed (tree-wide), never re-TERMed;
while a victim's memory is coming back (RECOVERING, up to ``recovery_wait`` seconds
after it is gone, longer while it is back on the per-CPU lists) no second victim is chosen.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from sparkguard.rate import seconds_to_line

OK, TERM_SENT, KILL_SENT, RECOVERING, NO_TARGET = "ok", "term_sent", "kill_sent", "recovering", "no_target"

# actions returned by Policy.step
CROSSED = "crossed"        # open an incident (memory fell below term_below)
TERM = "term"              # choose a target and SIGTERM its root
KILL = "kill"              # SIGKILL every process of the victim's tree (again, if repeated)
EXITED = "exited"          # the victim's tree is gone
RECOVERED = "recovered"    # memory is back above the line: close the incident
GAVE_UP_WAITING = "recovery_timeout"  # victim gone, memory still low after recovery_wait: close; next poll may act again
RETRY_TARGET = "retry_target"          # NO_TARGET: look for a target again
UNKILLABLE = "unkillable"              # SIGKILLed for kill_give_up seconds and still there (D state): close

#: seconds the wait for memory may go on past ``recovery_wait`` while memory is back on the
#: kernel's per-CPU lists.  They drain by ``batch << 5`` pages per CPU per ``vm.stat_interval``
#: (mm/page_alloc.c ``decay_pcp_high``: 7.9 MiB/s with the usual batch of 63) from at most 1/8 of
#: the zone split across the node's CPUs (``zone_highsize``): ~0.8 GiB per CPU on a 128 GiB,
#: 20-CPU GB10, ~100 s.
PCP_DRAIN_WAIT = 120.0
#: bytes the signal may fall below its value at the start of that extension before the wait ends:
#: MemAvailable rises while the lists drain (~8 MiB/s per CPU); a fall means something allocates
#: faster than that, and at 1 GiB/s this ends the wait within 64 ms
DRAIN_SLACK = 64 * 1024**2


@dataclass
class LoadLines:
    """The lines while a supervised engine loads (``engine.load_phase``).

    Attributes:
        term_below: int bytes; below it the loading engine gets SIGTERM (a failed load).
        rate_lead: float seconds; a load predicted to reach ``term_below`` within this is stopped
            (0: the load line alone).
        rate_min: float bytes/s; a slower fall is never predicted to cross.
    """

    term_below: int
    rate_lead: float = 0.0
    rate_min: float = 0.0


@dataclass
class Thresholds:
    """The lines, in bytes and seconds.

    Attributes:
        term_below: int bytes; below it the target gets SIGTERM.
        kill_below: int bytes or None; below it the grace period is cut short.
        grace: float seconds between SIGTERM and SIGKILL.
        recovery_wait: float seconds to wait, after the victim is gone, for memory to come back
            before a new incident may choose another victim.
        kill_repeat: float seconds between repeated SIGKILL sweeps while the tree lingers.
        retry_target: float seconds between target searches while nothing matches.
        kill_give_up: float seconds of repeated SIGKILL after which a victim that will not die
            (uninterruptible sleep in a driver) is reported as unkillable and the incident closes,
            so the next crossing can choose again.
        rate_lead: float seconds; SIGTERM when the signal would reach ``term_below`` within this
            at the estimated fall rate (0: off, the line alone; ``guard.rate_lead``).
        rate_min: float bytes/s; a slower fall never triggers (``guard.rate_min_fall``).
        load: :class:`LoadLines` while a supervised engine loads, or None (the lines above apply
            in every phase).
    """

    term_below: int
    kill_below: int | None
    grace: float
    recovery_wait: float = 10.0
    kill_repeat: float = 2.0
    retry_target: float = 1.0
    kill_give_up: float = 30.0
    rate_lead: float = 0.0
    rate_min: float = 0.0
    load: LoadLines | None = None


class Policy:
    """State machine of one guard.  ``step`` is called once per poll.

    Args:
        thresholds: :class:`Thresholds`; may be replaced (config reload) at any time via ``.thresholds``.
        dry_run: bool; when True the victim is assumed never to exit and KILL is issued once.
    """

    __slots__ = ("thresholds", "dry_run", "state", "t_term", "t_kill", "t_first_kill", "t_gone", "t_retry",
                 "t_drain", "v_drain", "fired")

    def __init__(self, thresholds: Thresholds, dry_run: bool = False):
        self.thresholds = thresholds
        self.dry_run = dry_run
        self.state = OK
        self.t_term = self.t_kill = self.t_first_kill = self.t_gone = self.t_retry = 0.0
        #: monotonic s when the wait for memory went past ``recovery_wait`` on memory back on the
        #: per-CPU lists (:data:`PCP_DRAIN_WAIT`), None otherwise (reset by a crossing and by RECOVERING)
        self.t_drain: float | None = None
        self.v_drain = 0            #: the signal (bytes) when that extension began
        #: what opened the current (or last) incident: {"trigger": "line"|"predicted", "phase":
        #: "serving"|"loading", "line_bytes", "fall_rate_bytes_per_second", "seconds_to_line"}
        self.fired: dict | None = None

    def lines(self, loading: bool = False) -> tuple[int, float, float]:
        """``(line bytes, lead seconds, rate_min bytes/s)`` in force for the phase."""
        th = self.thresholds
        ld = th.load
        if loading and ld is not None:
            return ld.term_below, ld.rate_lead, ld.rate_min
        return th.term_below, th.rate_lead, th.rate_min

    def trigger(self, value: int, fall_rate: float = 0.0, loading: bool = False) -> str | None:
        """``"line"`` when ``value`` is below the phase's line, ``"predicted"`` when falling at
        ``fall_rate`` bytes/s (>= its rate_min) it would reach the line within its lead, else None.
        Pure; the OK state's decision (:meth:`step`)."""
        line, lead, rmin = self.lines(loading)
        if value < line:
            return "line"
        if lead > 0 and fall_rate > 0 and fall_rate >= rmin and (value - line) <= fall_rate * lead:
            return "predicted"
        return None

    def step(self, now: float, value: int, victim_gone: bool = False, fall_rate: float = 0.0,
             loading: bool = False, pcp_free: int = 0) -> tuple[str, ...]:
        """Advance the state machine.

        Args:
            now: monotonic time, seconds.
            value: the memory signal now (MemAvailable, or MemAvailable+SwapFree), bytes.
            victim_gone: True once every process of the victim's tree has exited.
            fall_rate: the signal's estimated fall rate, bytes/s (0.0: unknown or not falling).
            loading: the supervised engine is loading (started, not yet ready).
            pcp_free: bytes free on the kernel's per-CPU lists (:mod:`sparkguard.pcp`), used only
                while RECOVERING past ``recovery_wait``: memory back there (a dead victim's pages
                land on them first, outside MemAvailable) extends the wait instead of ending it.
        Returns:
            A tuple of actions (module constants) to carry out in order; ``()`` for nothing.
        """
        st = self.state
        th = self.thresholds
        if st == OK:
            why = self.trigger(value, fall_rate, loading)
            if why is None:
                return ()
            line = self.lines(loading)[0]
            eta = seconds_to_line(value, line, fall_rate)
            self.fired = {"trigger": why, "phase": "loading" if loading else "serving", "line_bytes": line,
                          "fall_rate_bytes_per_second": round(fall_rate),
                          "seconds_to_line": round(eta, 3) if eta != math.inf else None}
            return self._term(now)
        if st == TERM_SENT:
            if victim_gone:
                self.state, self.t_gone, self.t_drain = RECOVERING, now, None
                return (EXITED,) + self._recovery(now, value, pcp_free)
            if now - self.t_term >= th.grace or (th.kill_below is not None and value < th.kill_below):
                self.state, self.t_kill, self.t_first_kill = KILL_SENT, now, now
                return (KILL,)
            return ()
        if st == KILL_SENT:
            if victim_gone:
                self.state, self.t_gone, self.t_drain = RECOVERING, now, None
                return (EXITED,) + self._recovery(now, value, pcp_free)
            if not self.dry_run and now - self.t_first_kill >= th.kill_give_up:
                self.state = OK
                return (UNKILLABLE,)
            if not self.dry_run and now - self.t_kill >= th.kill_repeat:
                self.t_kill = now
                return (KILL,)
            if self.dry_run and value >= th.term_below:
                self.state = OK
                return (RECOVERED,)
            return ()
        if st == RECOVERING:
            return self._recovery(now, value, pcp_free)
        if st == NO_TARGET:
            if value >= th.term_below and self.trigger(value, fall_rate, loading) is None:
                self.state = OK
                return (RECOVERED,)
            if now - self.t_retry >= th.retry_target:
                self.t_retry = now
                return (RETRY_TARGET,)
            return ()
        raise AssertionError(st)

    def _term(self, now: float) -> tuple[str, ...]:
        self.state, self.t_term, self.t_drain = TERM_SENT, now, None
        return (CROSSED, TERM)

    def _recovery(self, now: float, value: int, pcp_free: int = 0) -> tuple[str, ...]:
        """RECOVERING: back when the signal alone is above the line.  Past ``recovery_wait`` (when
        it is not 0), memory that is back on the per-CPU lists (``value + pcp_free`` above the line)
        extends the wait, up to :data:`PCP_DRAIN_WAIT` more, while they drain into MemAvailable and
        the signal does not fall: below what it was when the extension began, less
        :data:`DRAIN_SLACK`, or below ``kill_below``, something is taking memory again (the
        kernel's watermarks do not count the lists, so reclaim runs as if they were not there) and
        the wait ends, so the next poll may act."""
        th = self.thresholds
        if value >= th.term_below:
            self.state = OK
            return (RECOVERED,)
        waited = now - self.t_gone
        if waited < th.recovery_wait:
            return ()
        if th.recovery_wait > 0 and value + pcp_free >= th.term_below \
                and waited < th.recovery_wait + PCP_DRAIN_WAIT \
                and (th.kill_below is None or value >= th.kill_below):
            if self.t_drain is None:
                self.t_drain, self.v_drain = now, value
            if value >= self.v_drain - DRAIN_SLACK:
                return ()
        self.state = OK
        return (GAVE_UP_WAITING,)

    def counts_pcp(self, now: float, victim_gone: bool) -> bool:
        """Whether the next :meth:`step` at ``now`` would use ``pcp_free`` (so the caller reads
        the per-CPU lists only then): RECOVERING past a ``recovery_wait`` that is not 0."""
        rw = self.thresholds.recovery_wait
        return self.state == RECOVERING and rw > 0 and now - self.t_gone >= rw

    def no_target(self, now: float) -> None:
        """The caller found nothing to signal after TERM/RETRY_TARGET: wait in NO_TARGET."""
        self.state, self.t_retry = NO_TARGET, now

    def target_found(self, now: float) -> None:
        """The caller found and SIGTERMed a target after RETRY_TARGET: start the grace period."""
        self.state, self.t_term = TERM_SENT, now

    def term_sent_at(self, t: float) -> None:
        """The victim's first SIGTERM went out at ``t`` (monotonic s): the grace runs from it.
        Later than TERM's ``now`` when choosing and signalling the victim took time (the engine
        still gets the whole grace); earlier when the caller joined a running escalation of the
        same tree (:mod:`sparkguard.guard.escalation`), whose first SIGTERM it keeps."""
        self.t_term = t

    def watch_line(self) -> int | None:
        """The memory line (bytes) whose crossing would change the decision now, so the caller
        polls faster near it: ``term_below`` when idle (the higher of it and the load's line when
        ``load`` is set), ``kill_below`` (if set) during the grace
        period; None while only time or the victim's exit can move the state (KILL_SENT,
        RECOVERING, NO_TARGET): then polling at the plain interval is enough."""
        st, th = self.state, self.thresholds
        if st == OK:
            return th.term_below if th.load is None else max(th.term_below, th.load.term_below)
        if st == TERM_SENT and th.kill_below is not None and not self.dry_run:
            return th.kill_below
        return None

    def deadline(self, now: float) -> float | None:
        """Seconds until the next time-driven transition (grace end, KILL repeat, recovery
        timeout, target retry), or None when only memory can move the state."""
        st, th = self.state, self.thresholds
        if st == TERM_SENT:
            return max(0.0, self.t_term + th.grace - now)
        if st == KILL_SENT and not self.dry_run:
            return max(0.0, min(self.t_kill + th.kill_repeat, self.t_first_kill + th.kill_give_up) - now)
        if st == RECOVERING:
            end = self.t_gone + th.recovery_wait + (PCP_DRAIN_WAIT if self.t_drain is not None else 0.0)
            return max(0.0, end - now)
        if st == NO_TARGET:
            return max(0.0, self.t_retry + th.retry_target - now)
        return None


#: assumed worst fill rate, bytes per second.  A fill faster than this can cross the line inside
#: one sleep and be seen up to ``poll_interval x (1 - FILL_RATE / rate)`` late.  A 16-process tree
#: filled 16-23 GiB/s on the 16-core GPU machine (bench/results/device-tree16.txt): at an assumed
#: 8 GiB/s it got its SIGTERM ~96 ms after the crossing, at 16 GiB/s ~26 ms.  A GB10 has 20 cores;
#: ~3 GiB/s was seen during prefill on a Spark (FIELD-NOTES).  The price: polls come faster than
#: poll_interval only within ``poll_interval x FILL_RATE`` (6.4 GiB at 0.2 s) of the line, at
#: ``FILL_RATE / headroom`` per second (32/s at 1 GiB of headroom).
FILL_RATE = 32 * 1024**3


def next_interval(headroom: int, poll_interval: float, fill_rate: float = FILL_RATE,
                  min_interval: float = 0.002) -> float:
    """Seconds to sleep before the next poll.

    Sized so that memory filling at ``fill_rate`` cannot cross the line between two samples:
    ``headroom / fill_rate``, clamped to ``[min_interval, poll_interval]`` (earlyoom sizes its
    sleep the same way with an assumed 6000 MiB/s; FILL_RATE says why we assume 32 GiB/s).

    Args:
        headroom: bytes above the line (may be negative).
        poll_interval: the configured (longest) interval, seconds.
        fill_rate: assumed worst fill rate, bytes per second.
        min_interval: the shortest interval, seconds.
    """
    if headroom <= 0:
        return min_interval
    t = headroom / fill_rate
    if t >= poll_interval:
        return poll_interval
    return t if t > min_interval else min_interval

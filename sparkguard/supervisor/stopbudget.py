"""One deadline for stopping an engine run: set at its first SIGTERM, every later step fits inside it.

Stopping a run is several steps, each with a wait of its own: the grace after the SIGTERM, the
wait after the SIGKILL (:data:`sparkguard.guard.escalation.AFTER_KILL`), the sweep of leftovers,
the container runtime's ``inspect`` / ``rm -f``, reaping the client, joining the run's threads.
Summed as separate timeouts they could outlast the unit's ``TimeoutStopSec`` (systemd then
SIGKILLs the whole unit, the guard included, and the stop is recorded as a failure).  systemd does
not tell a service its stop timeout (systemd.service(5) documents no such variable; assumption:
none in the versions the Sparks run, 249-252), so the budget is derived from ``guard.grace``:

    budget(grace) = grace + AFTER_KILL + CLEANUP

counted from the first SIGTERM of the run (the supervisor's, or the sweep's when the run ended
on its own).  The grace is the engine's; :data:`AFTER_KILL` covers a SIGKILLed tree's exit
(CUDA teardown: 1.2-1.8 s measured, FIELD-NOTES); :data:`CLEANUP` is reserved for the runtime's
CLI calls, the reap and the joins, which get what is left of the budget and never less than
:data:`MIN_STEP` each.  The shipped unit's ``TimeoutStopSec=120s`` (systemd/sparkguard.service)
leaves :data:`MARGIN` for the rest of the daemon's stop when ``grace <= max_grace()`` (87 s);
the daemon's stop waits :func:`join_timeout` for the supervisor to finish.

Pure: a clock is injected (:class:`Deadline`).
"""

from __future__ import annotations

import time
from typing import Callable

from sparkguard.guard.escalation import AFTER_KILL

#: seconds reserved after the SIGKILL wait for the runtime's CLI calls, the reap and the joins
CLEANUP = 10.0
#: seconds of the unit's stop timeout kept for the rest of the daemon's stop (guard, incidents, state)
MARGIN = 10.0
#: the shipped unit's TimeoutStopSec (systemd/sparkguard.service), seconds
UNIT_STOP_TIMEOUT = 120.0
#: the least a cleanup step gets even when the budget is spent (one ``docker rm -f`` on a live daemon)
MIN_STEP = 1.0


def budget(grace: float) -> float:
    """Seconds from the first SIGTERM to the run fully stopped and cleaned up (module doc)."""
    return grace + AFTER_KILL + CLEANUP


def join_timeout(grace: float) -> float:
    """Seconds the daemon's stop waits for the supervisor's thread: the budget plus the
    :data:`MIN_STEP` floors of its three cleanup steps (inspect, rm -f, reap), so the cleanup
    is not abandoned half-way (the container would stay behind)."""
    return budget(grace) + 3 * MIN_STEP


def max_grace(stop_timeout: float = UNIT_STOP_TIMEOUT) -> float:
    """The largest ``guard.grace`` whose budget still leaves :data:`MARGIN` inside ``stop_timeout``."""
    return stop_timeout - MARGIN - AFTER_KILL - CLEANUP - 3 * MIN_STEP


class Deadline:
    """The stop deadline of one run.

    Args:
        grace: float seconds, ``guard.grace``.  t0: monotonic s of the first SIGTERM (default now).
        clock: monotonic seconds.
    Attributes:
        t0, grace, end: float (``end = t0 + budget(grace)``).
    """

    def __init__(self, grace: float, t0: float | None = None, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.grace = grace
        self.t0 = clock() if t0 is None else t0
        self.end = self.t0 + budget(grace)

    def left(self) -> float:
        """Seconds (>= 0) until the whole stop must be over."""
        return max(0.0, self.end - self.clock())

    def grace_left(self) -> float:
        """Seconds (>= 0) of the grace since the first SIGTERM still to run: what a leftover gets
        before its SIGKILL (no fresh grace after the first one ended)."""
        return max(0.0, self.t0 + self.grace - self.clock())

    def before_cleanup(self, seconds: float) -> float:
        """``seconds``, cut to what is left before the :data:`CLEANUP` reserve (>= 0): the waits
        for signalled processes."""
        return max(0.0, min(seconds, self.end - CLEANUP - self.clock()))

    def step(self, seconds: float) -> float:
        """``seconds`` cut to what is left of the budget, at least :data:`MIN_STEP`: one cleanup step's timeout."""
        return max(MIN_STEP, min(seconds, self.left()))

    def as_text(self) -> str:
        """``"stop budget 25 s (grace 5 s + 10 s after SIGKILL + 10 s cleanup)"``: for the log."""
        return (f"stop budget {budget(self.grace):g} s (grace {self.grace:g} s + {AFTER_KILL:g} s after SIGKILL "
                f"+ {CLEANUP:g} s cleanup)")

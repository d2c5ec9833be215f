"""How fast the memory signal is falling: a robust slope over the last samples, in a fixed ring.

Pure (no I/O, no clock): the poll loop passes each sample's monotonic time and value.  The
estimate is Theil-Sen's: the median of the slopes between every pair of samples in the window
(Sen 1968, "Estimates of the regression coefficient based on Kendall's tau", JASA 63).  A single
wild sample (a page-cache drop, a zram write-back, a parse of a torn read) moves the median by
at most one rank, where a least-squares slope would follow it; half the pairs must agree before
the estimate moves.  That same robustness means one allocation of several GiB between two
samples is one outlier, not a trend: no estimate predicts a step that has not yet started
(bench/results/rate.txt, the ``step`` scenario, measures what that costs).

Bounded work and memory: the ring holds :data:`RING` samples at most, spaced at least
``window / RING`` seconds apart (a sample closer than that to the one before the newest replaces
the newest, so the newest value is always the latest one read); the slopes go to a list preallocated once,
``RING * (RING - 1) / 2`` floats, sorted in place.  Nothing grows with the poll rate.
"""

from __future__ import annotations

import math

#: samples kept in the window; 16 samples give 120 pairwise slopes (about 40 us of Python per
#: estimate on the 2-core development machine, measured by tests/test_rate.py's bound)
RING = 16
#: fewest samples an estimate needs: with two, one noisy read is the whole estimate
MIN_SAMPLES = 3


class FallRate:
    """Robust estimate of the signal's fall rate over the last ``window`` seconds.

    Args:
        window: float seconds of samples the estimate looks back over (``guard.rate_window``).
        ring: int samples kept (default :data:`RING`).
    Attributes:
        rate: float bytes per second the signal fell at, per the last :meth:`estimate`
            (0.0 when rising, flat, or with fewer than :data:`MIN_SAMPLES` samples in the window).
    """

    __slots__ = ("window", "spacing", "cap", "_t", "_v", "_head", "_n", "_slopes", "_idx", "rate")

    def __init__(self, window: float, ring: int = RING):
        if not (isinstance(window, (int, float)) and math.isfinite(window) and window > 0):
            raise ValueError(f"window must be a finite number of seconds above 0, got {window!r}")
        if ring < MIN_SAMPLES:
            raise ValueError(f"ring must hold at least {MIN_SAMPLES} samples, got {ring}")
        self.window = float(window)
        self.cap = ring
        self.spacing = self.window / ring
        self._t = [0.0] * ring
        self._v = [0.0] * ring
        self._slopes = [0.0] * (ring * (ring - 1) // 2)
        self._idx = [0] * ring
        self._head = -1         # index of the newest sample
        self._n = 0             # samples held
        self.rate = 0.0

    def reset(self) -> None:
        """Forget every sample (after an incident, or a reload that changed the window)."""
        self._head, self._n, self.rate = -1, 0, 0.0

    def add(self, t: float, value: int) -> None:
        """One sample: ``t`` monotonic seconds, ``value`` bytes.  A sample less than
        ``window / ring`` seconds after the one before the newest replaces the newest; a sample older than the
        newest (a clock that went back) resets the ring."""
        n = self._n
        if n:
            if t < self._t[self._head]:
                self.reset()
                n = 0
            elif n > 1 and t - self._t[(self._head - 1) % self.cap] < self.spacing:
                self._t[self._head], self._v[self._head] = t, float(value)
                return
        self._head = h = (self._head + 1) % self.cap
        self._t[h], self._v[h] = t, float(value)
        if n < self.cap:
            self._n = n + 1

    def estimate(self, now: float) -> float:
        """Bytes per second the signal is falling at (>= 0.0; rises and flat count as 0.0), over
        the samples no older than ``window`` seconds before ``now``; also kept in :attr:`rate`.
        At most ``ring * (ring - 1) / 2`` slopes, computed into the preallocated list."""
        t, v, cap = self._t, self._v, self.cap
        oldest = now - self.window
        idx = self._idx
        h, m = self._head, 0
        for _ in range(self._n):
            if t[h] < oldest:
                break
            idx[m] = h
            m += 1
            h = (h - 1) % cap
        if m < MIN_SAMPLES:
            self.rate = 0.0
            return 0.0
        slopes = self._slopes
        k = 0
        for a in range(m):
            ia = idx[a]
            ta, va = t[ia], v[ia]
            for b in range(a + 1, m):
                ib = idx[b]
                dt = ta - t[ib]
                if dt > 0:
                    slopes[k] = (va - v[ib]) / dt
                    k += 1
        if k == 0:
            self.rate = 0.0
            return 0.0
        inf = math.inf
        for i in range(k, len(slopes)):
            slopes[i] = inf            # unused slots sort last
        slopes.sort()
        mid = slopes[k // 2] if k % 2 else 0.5 * (slopes[k // 2 - 1] + slopes[k // 2])
        self.rate = -mid if mid < 0 else 0.0
        return self.rate


def seconds_to_line(value: int, line: int, fall_rate: float) -> float:
    """Seconds until ``value`` bytes reaches ``line`` bytes falling at ``fall_rate`` bytes/s:
    0.0 at or below the line, ``math.inf`` when not falling."""
    if value <= line:
        return 0.0
    if fall_rate <= 0:
        return math.inf
    return (value - line) / fall_rate

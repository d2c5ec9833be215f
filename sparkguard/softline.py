"""The soft line's pure decision core: when to pause the engine, when to resume it, when to give up.

No I/O and no clock of its own, like :mod:`sparkguard.policy` beside it: the poll loop passes the
monotonic time, the memory signal and whether the hard policy is idle on every full pass
(:meth:`SoftLine.step`), and the engine's answers as they come (:meth:`SoftLine.answered`); it
carries out the returned actions (:mod:`sparkguard.guard.soft`).  Tests drive it on a fake clock.

The soft line sits above the SIGTERM line (``guard.pause_below`` > ``guard.term_below``).  Below
it the engine is asked to stop admitting work (vLLM's ``POST /pause``, docs/soft-line.md); once the
signal has been back above ``pause_below + hysteresis`` for ``resume_after`` seconds it is asked to
resume.  The hard line is never touched: :mod:`sparkguard.policy` SIGTERMs at ``term_below``
whatever the state here, and this machine only notes that it happened (ESCALATED).  States::

    IDLE --below pause_below--> PAUSING --answer ok--> PAUSED --above for resume_after--> RESUMING
      ^                            | answer failed, or      | hard line crossed             | answer ok
      |                            | no answer in time      v                               v
      |                            +------------------> LATCHED <---- hard line crossed --- IDLE
      +--- above pause_below + hysteresis, hard policy idle ---'   (resume fails resume_tries times)

A new run of the engine (:meth:`SoftLine.restarted`, the supervisor restarted it) ends an episode
in progress: a fresh process is not paused, and the line waits LATCHED.

LATCHED means "as without the soft line": nothing is sent until the signal is back above
``pause_below + hysteresis`` with the hard policy idle.  Leaving it with the engine still paused
(the hard line chose another victim, or resuming failed) sends one more resume first.
"""

from __future__ import annotations

from dataclasses import dataclass

IDLE, PAUSING, PAUSED, RESUMING, LATCHED = "idle", "pausing", "paused", "resuming", "latched"

# actions returned by SoftLine.step / SoftLine.answered
PAUSE = "pause"                  # the signal fell below pause_below: open the pause incident, POST /pause
PAUSED_OK = "paused"             # the engine says it is paused
PAUSE_FAILED = "pause_failed"    # no endpoint, an error, or no answer in time: close, go on without the soft line
RESUME = "resume"                # memory is back: POST /resume
RESUMED = "resumed"              # the engine says it resumed: close the incident
RESUME_FAILED = "resume_failed"  # the resume failed; it is tried again after resume_after
RESUME_GAVE_UP = "resume_gave_up"  # resume_tries resumes failed: close; the engine may still be paused
ESCALATED = "escalated"          # the hard line was crossed while pausing or paused: close (SIGTERM is the policy's)
RESTARTED = "restarted"          # a new run of the engine is ready: it is not paused; close


@dataclass(frozen=True)
class SoftLines:
    """The soft line's settings, bytes and seconds.

    Attributes:
        pause_below: int bytes, or None when the soft line is off.
        hysteresis: int bytes above ``pause_below`` the signal must reach before resume is considered.
        resume_after: float seconds the signal must stay above ``pause_below + hysteresis``.
        answer_timeout: float seconds a pause or resume may go unanswered before it counts as failed
            (the HTTP client's own deadline is shorter; this bounds the machine whatever it does).
        resume_tries: int resumes tried before giving up.
    """

    pause_below: int | None
    hysteresis: int
    resume_after: float
    answer_timeout: float = 5.0
    resume_tries: int = 3

    @property
    def resume_above(self) -> int | None:
        """Bytes: the signal at or above which resuming is considered, None when off."""
        return None if self.pause_below is None else self.pause_below + self.hysteresis


class SoftLine:
    """State machine of the soft line.  ``step`` once per full poll, ``answered`` per engine answer.

    Args:
        lines: :class:`SoftLines`; may be replaced (config reload) at any time via ``.lines``.
    Attributes:
        state: one of the module's states.
        engine_paused: bool, the last answer the engine gave was "paused" (and no "resumed" since).
    """

    __slots__ = ("lines", "state", "engine_paused", "t_sent", "t_above", "tries")

    def __init__(self, lines: SoftLines):
        self.lines = lines
        self.state = IDLE
        self.engine_paused = False
        self.t_sent = 0.0               # monotonic s the pending request went out
        self.t_above: float | None = None   # monotonic s the signal went back above resume_above
        self.tries = 0                  # resumes failed in a row

    def step(self, now: float, value: int, hard_idle: bool, offered: bool | None = None) -> tuple[str, ...]:
        """Advance on a poll.

        Args:
            now: monotonic time, seconds.
            value: the memory signal, bytes (the same one the hard policy compares).
            hard_idle: True while :class:`sparkguard.policy.Policy` is in its OK state; False
                from the hard line's crossing until its incident ends.
            offered: whether the engine offers pause (the last probe): False holds the soft line
                back; None (not known yet) lets it try.
        Returns:
            A tuple of actions to carry out in order; ``()`` for nothing.
        """
        st, ln = self.state, self.lines
        if st == IDLE:
            if (ln.pause_below is not None and hard_idle and value < ln.pause_below
                    and offered is not False):
                self.state, self.t_sent = PAUSING, now
                return (PAUSE,)
            return ()
        if st in (PAUSING, PAUSED, RESUMING) and not hard_idle:
            self.state = LATCHED
            return (ESCALATED,)
        if st == PAUSING:
            if now - self.t_sent >= ln.answer_timeout:
                self.state = LATCHED
                return (PAUSE_FAILED,)
            return ()
        if st == PAUSED:
            if ln.pause_below is None:          # turned off by a reload: let the engine work again
                return self._resume(now)
            if value >= ln.resume_above:
                if self.t_above is None:
                    self.t_above = now
                if now - self.t_above >= ln.resume_after:
                    return self._resume(now)
            else:
                self.t_above = None
            return ()
        if st == RESUMING:
            if now - self.t_sent >= ln.answer_timeout:
                return self._resume_failed(now)
            return ()
        if st == LATCHED:
            if hard_idle and (ln.pause_below is None or value >= ln.resume_above):
                if self.engine_paused:          # still paused (another victim was chosen, or resume failed)
                    self.tries = 0
                    return self._resume(now)
                self.state = IDLE
            return ()
        raise AssertionError(st)

    def answered(self, now: float, op: str, ok: bool) -> tuple[str, ...]:
        """The engine's answer to a pause (``op`` ``"pause"``) or resume (``"resume"``): ``ok`` True
        when it did it.  An answer nobody waits for any more (it came after the timeout, or after
        the hard line) only updates :attr:`engine_paused`."""
        if op == "pause":
            if ok:
                self.engine_paused = True
            if self.state != PAUSING:
                return ()
            if ok:
                self.state, self.t_above = PAUSED, None
                return (PAUSED_OK,)
            self.state = LATCHED
            return (PAUSE_FAILED,)
        if op == "resume":
            if ok:
                self.engine_paused = False
            if self.state != RESUMING:
                return ()
            if ok:
                self.state, self.tries = IDLE, 0
                return (RESUMED,)
            return self._resume_failed(now)
        raise ValueError(op)

    def restarted(self) -> tuple[str, ...]:
        """A new run of the engine became ready (the supervisor restarted it): a fresh process is
        not paused.  An episode in progress ends (RESTARTED) and the line waits, LATCHED, for
        memory to be back above the resume line before it may pause the new run."""
        self.engine_paused = False
        if self.state in (PAUSING, PAUSED, RESUMING):
            self.state, self.tries = LATCHED, 0
            return (RESTARTED,)
        return ()

    def _resume(self, now: float) -> tuple[str, ...]:
        self.state, self.t_sent = RESUMING, now
        return (RESUME,)

    def _resume_failed(self, now: float) -> tuple[str, ...]:
        self.tries += 1
        if self.tries >= self.lines.resume_tries:
            self.state, self.tries = LATCHED, 0
            return (RESUME_GAVE_UP,)
        self.state, self.t_above = PAUSED, now      # try again after resume_after
        return (RESUME_FAILED,)

    def engaged(self) -> bool:
        """True unless IDLE: the loop must run full passes (time or an answer can move the state)."""
        return self.state != IDLE

    def deadline(self, now: float) -> float | None:
        """Seconds until the next time-driven transition (an answer's timeout, the resume), or None."""
        st, ln = self.state, self.lines
        if st in (PAUSING, RESUMING):
            return max(0.0, self.t_sent + ln.answer_timeout - now)
        if st == PAUSED and self.t_above is not None:
            return max(0.0, self.t_above + ln.resume_after - now)
        return None

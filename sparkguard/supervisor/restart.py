"""Restart policy: why the engine's run ended, whether to restart it, and after how long.

Pure logic (no clock, no processes): the supervisor feeds it uptimes in seconds, so it is tested
with plain numbers.  Policy values are those of ``engine.restart`` (``sparkguard.config``).
"""

from __future__ import annotations

from sparkguard.units import format_duration

#: every restart reason (metric label values, all exported from the first scrape)
REASONS = ("exit", "guard", "wedged", "lane", "head", "not_ready", "manual", "link", "peer", "load")
#: reasons of a restart someone asked for: immediate, no backoff, not a failure
COMMANDED = ("lane", "manual", "link")
#: reasons the supervisor stopped the engine for because it was unhealthy: always a failure
UNHEALTHY = ("wedged", "not_ready")
#: reasons caused by another node of a TP cluster (:mod:`sparkguard.supervisor.cluster`): the head
#: run this headless rank was in is gone (``head``), a rank of the head's group is (``peer``).  Not
#: a failure of this node: no backoff, and restarted under ``on-failure`` too (a group that must
#: re-form is not a clean stop)
CLUSTER = ("head", "peer")
#: the memory guard stopped the run while it loaded (started, never ready): a failed load.  A
#: failure like ``guard`` (backoff doubles) that also counts towards ``engine.give_up_after``
#: (:class:`GiveUp`: a run that failed before it was ever ready), so a load that does not fit is
#: not retried blindly: after ``give_up_after`` of them the supervisor stops and says why
LOAD = "load"


class Backoff:
    """Capped exponential delay between automatic restarts, reset after a stable run.

    ``delay()`` of the n-th consecutive automatic restart is ``initial * 2**n`` capped at
    ``maximum`` (n from 0); a run that lasted ``stable_after`` seconds resets n.

    Args:
        initial: float seconds (``engine.backoff_initial``).
        maximum: float seconds (``engine.backoff_max``).
        stable_after: float seconds (``engine.stable_after``).
    """

    def __init__(self, initial: float, maximum: float, stable_after: float):
        self.initial, self.maximum, self.stable_after = initial, maximum, stable_after
        self.failures = 0

    def next(self, uptime: float) -> float:
        """Seconds to wait before the next automatic start, after a run of ``uptime`` seconds."""
        if uptime >= self.stable_after:
            self.failures = 0
        d = min(self.maximum, self.initial * (2 ** min(self.failures, 60)))
        self.failures += 1
        return d

    def reset(self) -> None:
        """Forget past failures (an explicit start/restart/lane command)."""
        self.failures = 0


def classify_exit(code: int | None, term_reason: str | None, guard_hit: bool,
                  headless: str | None = None, load_hit: bool = False) -> tuple[str | None, bool]:
    """Why a run ended, as ``(restart reason, failure)``.

    Args:
        code: the root's exit code, None when a signal ended it (or unknown).
        term_reason: why the supervisor stopped it (``stop``, ``shutdown``, one of
            :data:`COMMANDED`, :data:`UNHEALTHY` or :data:`CLUSTER`), None when it exited by itself.
        guard_hit: the guard signalled the engine during the run.
        headless: for a headless rank of a TP cluster, what its head was when it ended:
            ``"gone"`` (the head run it was in ended, was replaced or stopped; or it never was in
            one) or ``"there"``; None for any other engine.  vLLM's headless node exits 0 both
            when its head dies and when one of its own workers dies (``serve.py run_headless``,
            FIELD-NOTES): exit 0 with the head gone is ``head``, a group restart and not a clean
            stop; with the head run still there it is this rank's own death, ``exit``, a failure.
        load_hit: the guard signalled the run before it was ever ready (:data:`LOAD`).
    Returns:
        reason: None (stopped on purpose: no restart), else one of :data:`REASONS`.
        failure: bool, False only for a clean exit (code 0) or a commanded restart.
    """
    failure = code != 0
    if term_reason in ("stop", "shutdown"):
        return None, failure
    if term_reason in COMMANDED:
        return term_reason, failure
    if term_reason in UNHEALTHY:
        return term_reason, True
    if term_reason in CLUSTER:
        return term_reason, False
    if guard_hit:
        return (LOAD if load_hit else "guard"), True
    if headless == "gone" and code == 0:
        return "head", False
    if headless == "there":
        return "exit", True
    return "exit", failure


#: why a run was ended by someone (``Run.term_reason``, or ``guard``), as words for exit details
ENDED_BY = {"stop": "", "shutdown": "",           # the word says it
            "manual": "by 'sparkguard engine restart'", "lane": "switching lanes",
            "link": "restarting after the TP link came back", "wedged": "liveness probe failures",
            "head": "its head node went away", "not_ready": "not ready within engine.ready_timeout",
            "peer": "a rank of its TP group on another node went away",
            "guard": "signalled by the memory guard",
            LOAD: "stopped by the memory guard while loading: a failed load"}


def describe_exit(code: int | None, signame: str | None, uptime: float, term_reason: str | None,
                  guard_hit: bool, load_hit: bool = False) -> str:
    """One readable line about how and why a run ended.

    Args:
        code: exit code, None when a signal ended it; signame: e.g. ``"SIGKILL"`` or None.
        uptime: seconds it ran; term_reason: why sparkguard stopped it (keys of
            :data:`ENDED_BY`) or None; guard_hit: the memory guard signalled it; load_hit: before
            it was ever ready (a failed load).
    Returns:
        how, after how long, and (reason: why) when someone ended it, e.g.
        ``"exit code 0 after 9.9 s (guard: signalled by the memory guard)"``,
        ``"killed by SIGKILL after 3.1 s (lane: switching lanes)"``, ``"exit code 0 after 2.0 s (stop)"``,
        ``"exit code 1 after 100 ms"``.
    """
    how = (f"exit code {code}" if code is not None else f"killed by {signame}" if signame
           else "exit status unknown")
    out = f"{how} after {format_duration(uptime)}"
    why = term_reason or ((LOAD if load_hit else "guard") if guard_hit else None)
    if why:
        words = ENDED_BY.get(why, "stopped by sparkguard")
        out += f" ({why}: {words})" if words else f" ({why})"
    return out


def restarts(policy: str, failure: bool, reason: str | None = None) -> bool:
    """Whether ``engine.restart`` (``always`` | ``on-failure`` | ``never``) restarts after an
    automatic stop for ``reason`` that was (``failure``) or was not a failure.  A
    :data:`CLUSTER` reason restarts unless the policy is ``never``."""
    if reason in CLUSTER:
        return policy != "never"
    return policy == "always" or (policy == "on-failure" and failure)


class GiveUp:
    """Failed recoveries in a window: a boot that keeps failing needs a person.

    A failed recovery is a run that ended in failure (:func:`classify_exit`) before it was ever
    ready; ``after`` of them within ``window`` seconds means give up (the public multi-Spark
    recipes stop after 3, FIELD-NOTES).  Pure: the caller gives monotonic seconds.

    Args:
        after: int failed recoveries (0: never give up).
        window: float seconds.
    """

    def __init__(self, after: int, window: float):
        self.after, self.window = after, window
        self.failed: list[float] = []

    def record(self, now: float, failure: bool, ever_ready: bool, reason: str | None, counts: bool = True) -> bool:
        """One run ended at ``now``; True when the supervisor should give up now.  ``counts``
        False: a failure that is not this node's to count (a headless rank that never met a head
        run: it waited at a rendezvous nobody came to)."""
        if ever_ready or not failure or not counts or reason in CLUSTER or reason in COMMANDED or reason is None:
            if ever_ready:
                self.failed.clear()
            return False
        self.failed = [t for t in self.failed if now - t < self.window] + [now]
        return self.after > 0 and len(self.failed) >= self.after

    def reset(self) -> None:
        """Forget (``sparkguard engine start``)."""
        self.failed.clear()

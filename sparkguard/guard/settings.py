"""What the poll loop derives from a config, checked: shared by ``check-config``, start-up and reload."""

from __future__ import annotations

import math
from typing import NamedTuple

from sparkguard import config, enginetree, meminfo, policy

FULL_PASS_EVERY = 10.0      # seconds: the most the idle fast path runs between two full passes (= STATUS_EVERY)
MIN_POLL_INTERVAL = 0.002   # seconds: policy.next_interval's shortest sleep; a shorter poll_interval spins a core


class LoopSettings(NamedTuple):
    """The poll loop's figures for one config (:func:`loop_settings`)."""

    use_swap: bool      # the signal includes SwapFree
    interval: float     # guard.poll_interval, seconds
    far: int            # bytes of headroom beyond which the full interval is safe at policy.FILL_RATE
    idle_floor: int     # bytes of MemAvailable: the idle fast path runs at or above the top line + far
    budget: int         # fast polls allowed between two full passes
    rate_on: bool = False       # guard.rate_trigger is on: the loop keeps a rate.FallRate
    rate_window: float = 1.0    # guard.rate_window, seconds


def loop_settings(cfg) -> LoopSettings:
    """What the poll loop derives from a config, checked: the one validation that ``check-config``
    and a reload run beside ``config.load``.

    Returns:
        :class:`LoopSettings` ``(use_swap, interval, far, idle_floor, budget, rate_on, rate_window)``:
        the signal includes SwapFree (bool); ``guard.poll_interval`` (float seconds); the headroom
        beyond which the full interval is safe at ``policy.FILL_RATE`` (int bytes); the idle fast
        path's floor, ``far`` above the highest line (``term_below``, ``pause_below``,
        ``engine.load_phase.term_below``) (int bytes of MemAvailable); the fast polls allowed
        between two full passes, so that a full pass (policy, STATUS=, the armed target's check,
        poll metrics) runs at least every FULL_PASS_EVERY (int); whether the rate trigger is on
        (bool) and its window (float seconds).
    Raises:
        config.ConfigError: a value the loop cannot run on (not a finite positive interval, a line
            that is not a whole number of bytes), naming the file, key and value.
    """
    g = cfg.guard
    path = getattr(cfg, "path", None) or "<config>"

    def bad(key, value, reason):
        return config.ConfigError(path, f"guard.{key}", value, reason)
    iv = g.poll_interval
    if isinstance(iv, bool) or not isinstance(iv, int | float) or not math.isfinite(iv) or iv < MIN_POLL_INTERVAL:
        raise bad("poll_interval", iv, f"the poll loop needs a finite number of seconds, at least "
                  f"{MIN_POLL_INTERVAL:g} (its shortest sleep, policy.next_interval)")
    for key in ("term_below", "kill_below"):
        v = getattr(g, key)
        if v is None and key == "kill_below":
            continue
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise bad(key, v, "the poll loop needs a whole number of bytes, 0 or more")
    for key in ("grace", "recovery_wait"):
        v = getattr(g, key)
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < 0:
            raise bad(key, v, "the poll loop needs a finite number of seconds, 0 or more")
    if g.signal not in meminfo.SIGNALS:
        raise bad("signal", g.signal, "expected available or available+swap")
    far = int(iv * policy.FILL_RATE)
    line = max(g.term_below, g.pause_below or 0)     # the highest line the fast path must not skip
    lp = cfg.engine.load_phase.term_below if cfg.engine.enabled and cfg.engine.load_phase is not None else None
    if lp is not None and lp > line:
        line = lp
    floor = line + far
    return LoopSettings(g.signal == "available+swap", float(iv), far, floor,
                        max(0, int(FULL_PASS_EVERY / iv + 1e-9) - 1), g.rate_trigger == "on",
                        float(g.rate_window))


def prepare(cfg):
    """Everything the guard derives from a config, built and checked before any of it is used: the
    validation ``check-config`` and a reload share (beside ``config.load``).

    Returns:
        ``(loop settings, policy.Thresholds, enginetree.Protector)`` (see :func:`loop_settings`).
    Raises:
        config.ConfigError: naming the file, key and value.
    """
    settings = loop_settings(cfg)
    try:
        thresholds = make_thresholds(cfg)
    except Exception as e:  # noqa: BLE001 - whatever a future Thresholds refuses
        raise config.ConfigError(cfg.path, "guard", None, f"cannot use: {type(e).__name__}: {e}") from None
    try:
        protector = enginetree.Protector(cfg.targets.protect)
    except Exception as e:  # noqa: BLE001 - re.error from a pattern config.load let through
        raise config.ConfigError(cfg.path, "targets.protect", list(cfg.targets.protect),
                                 f"cannot compile: {e}") from None
    return settings, thresholds, protector


def make_thresholds(cfg):
    """``policy.Thresholds`` (bytes, seconds) from ``cfg.guard``, and the load phase's lines from
    ``cfg.engine.load_phase`` when an engine is supervised.  With ``guard.rate_trigger`` off both
    leads are 0 (the lines alone)."""
    g = cfg.guard
    on = g.rate_trigger == "on"
    load = None
    if cfg.engine.enabled:
        lp = cfg.engine.load_phase or config.LoadPhaseConfig()
        load = policy.LoadLines(term_below=g.term_below if lp.term_below is None else lp.term_below,
                                rate_lead=lp.rate_lead if on else 0.0,
                                rate_min=g.rate_min_fall if lp.rate_min_fall is None else lp.rate_min_fall)
    return policy.Thresholds(term_below=g.term_below, kill_below=g.kill_below, grace=g.grace,
                             recovery_wait=g.recovery_wait, rate_lead=g.rate_lead if on else 0.0,
                             rate_min=g.rate_min_fall, load=load)

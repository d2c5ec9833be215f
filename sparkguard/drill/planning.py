"""Where the drill's temporary lines go, and the memory signal it starts from."""

from __future__ import annotations

import sys

from sparkguard import meminfo
from sparkguard.units import format_size, parse_size

GiB = 1 << 30
SAFETY = 2 * GiB          # the drill's lowest point stays this far above the configured line
TERM_LATENCY_LIMIT = 0.5  # seconds from the guard's crossing to SIGTERM for a PASS
#: the most the drill's fill may take, in planned fills: it fills down to its floor, and memory that
#: other work frees meanwhile (a cache dropped, a process that exits) is filled too, up to this
FILL_CAP = 2


class DrillError(Exception):
    """The drill cannot run safely or at all (message says why and what to change)."""


def refused(e: Exception) -> int:
    """Say on stderr why the drill will not run (a bad option, or a :class:`DrillError`); exit status 2."""
    print(f"sparkguard drill: {'refused' if isinstance(e, DrillError) else 'bad option'}: {e}", file=sys.stderr)
    return 2


def parse_rate(text: str) -> float | None:
    """``"1GiB/s"`` / ``"512MiB"`` -> bytes per second; ``"max"`` -> None.  Raises ValueError."""
    t = str(text).strip()
    if t.lower() == "max":
        return None
    if t.lower().endswith("/s"):
        t = t[:-2]
    r = parse_size(t)
    if r <= 0:
        raise ValueError(f"rate must be positive, got {text!r}")
    return float(r)


def plan(cfg, value_now: int, margin: int, past: int) -> dict:
    """Where the temporary lines go.

    Args:
        cfg: ``config.Config`` being drilled.
        value_now: the memory signal now (bytes; MemAvailable or MemAvailable+SwapFree).
        margin: bytes between ``value_now`` and the temporary SIGTERM line.
        past: bytes the fake may fill past the line.
    Returns:
        dict with ``term_below``, ``kill_below`` (or None), ``fill_size`` (from the signal now
        down to ``floor``), ``floor`` (the level the fill stops at: the lowest the drill takes the
        signal), ``fill_cap`` (the most the fill may take, :data:`FILL_CAP` x ``fill_size``: memory
        that other work frees meanwhile is filled as well, up to that), all bytes.
    Raises:
        DrillError: the floor would come closer than 2 GiB to the configured ``guard.term_below``.
    """
    g = cfg.guard
    if margin <= 0 or past <= 0:
        raise DrillError("--margin and --past must be greater than 0")
    line = value_now - margin
    floor = line - past
    if floor < g.term_below + SAFETY:
        raise DrillError(
            f"not enough headroom for a safe drill: {signal_name(g.signal)} is {format_size(value_now)}; the drill "
            f"would take it to about {format_size(floor)}, closer than {format_size(SAFETY)} to the configured "
            f"SIGTERM line {format_size(g.term_below)} (guard.term_below in {cfg.path}). "
            f"Free some memory or lower --margin/--past.")
    kill = None if g.kill_below is None else line - (g.term_below - g.kill_below)
    return {"term_below": line, "kill_below": kill, "fill_size": margin + past, "floor": floor,
            "fill_cap": FILL_CAP * (margin + past)}


def signal_name(sig: str) -> str:
    return "MemAvailable" if sig == "available" else "MemAvailable+SwapFree"


def read_signal(signal_kind: str) -> int:
    """The configured memory signal now, bytes (one read of /proc/meminfo)."""
    r = meminfo.MeminfoReader()
    try:
        return meminfo.signal_bytes(signal_kind, *r.sample())
    finally:
        r.close()

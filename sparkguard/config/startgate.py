"""The ``engine.start_gate`` section: compaction and the MemFree gate before every engine start.

What the keys mean and why: docs/start-gate.md.  The vLLM facts the gate uses (its start-up
check, its default ``--gpu-memory-utilization``) live in :func:`vllm_utilization` with their
sources.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

from sparkguard.config.errors import NestedValueError
from sparkguard.config.parsers import boolean, choice, size

#: vLLM's default ``--gpu-memory-utilization``: ``CacheConfig.gpu_memory_utilization: float =
#: Field(default=0.92, gt=0, le=1)`` in vllm/config/cache.py (vllm-project/vllm at 002f10e0cfa1,
#: read 2026-12-02; older releases had 0.9), which ``EngineArgs.gpu_memory_utilization`` in
#: vllm/engine/arg_utils.py takes as its default.
VLLM_DEFAULT_UTILIZATION = 0.92


@dataclass(frozen=True)
class StartGateConfig:
    """``engine.start_gate``.

    Attributes:
        compact: ``"auto"`` (with ``engine.drop_caches``: the recipes run ``sync; drop_caches=3;
            compact_memory=1`` together), ``"on"`` or ``"off"``: write 1 to
            /proc/sys/vm/compact_memory before every start (after the page-cache drop).
        memfree: bool, gate the start on MemFree as well as MemAvailable.
        utilization: float in (0, 1], or None (``auto``): for a vLLM command its
            ``--gpu-memory-utilization`` (or vLLM's default), for another command 0.
        margin: int bytes added to ``utilization x MemTotal``.
        fragmentation: ``"wait"`` (MemFree is enough but too little of it lies in >= 2 MiB
            blocks: compact again with a backoff and do not start; never a crash loop),
            ``"start"`` (say so and start once ``engine.quiesce_timeout`` is over), ``"off"``
            (/proc/buddyinfo is not read).
    """

    compact: str = "auto"
    memfree: bool = False
    utilization: float | None = None
    margin: int = 3 * 1024**3 // 2
    fragmentation: str = "wait"


def _utilization(v: Any) -> float | None:
    if v is None or (isinstance(v, str) and v.lower() == "auto"):
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError("expected auto or a fraction from 0 to 1 (vLLM's --gpu-memory-utilization)")
    if not (math.isfinite(v) and 0 <= v <= 1):
        raise ValueError("must be from 0 to 1")
    return float(v)


_KEYS: dict[str, Callable[[Any], Any]] = {
    "compact": choice("auto", "on", "off"), "memfree": boolean, "utilization": _utilization, "margin": size,
    "fragmentation": choice("wait", "start", "off"),
}


def parse_start_gate(v: Any) -> StartGateConfig:
    """``engine.start_gate``: a mapping of :data:`_KEYS` (empty or absent: the defaults).

    Raises ValueError, or NestedValueError naming the key below ``start_gate``.
    """
    if v is None:
        return StartGateConfig()
    if not isinstance(v, dict):
        raise ValueError("expected a mapping with " + ", ".join(_KEYS))
    vals = {}
    for k, x in v.items():
        if k not in _KEYS:
            raise NestedValueError(f".{k}", x, "unknown key; expected one of " + ", ".join(_KEYS))
        try:
            vals[k] = _KEYS[k](x)
        except ValueError as e:
            raise NestedValueError(f".{k}", x, str(e)) from None
    return StartGateConfig(**vals)


def compacts(sg: StartGateConfig, drop_caches: bool) -> bool:
    """True when memory is compacted before a start (``compact: auto`` follows ``engine.drop_caches``)."""
    return sg.compact == "on" or (sg.compact == "auto" and drop_caches)


def vllm_utilization(argv) -> tuple[float | None, str]:
    """The ``--gpu-memory-utilization`` a vLLM command line asks for, and where it came from.

    Returns ``(fraction, source)``: the last ``--gpu-memory-utilization F`` /
    ``--gpu-memory-utilization=F`` (argparse keeps the last), else
    ``(VLLM_DEFAULT_UTILIZATION, "vLLM's default ...")``; ``(None, why)`` when the value written
    is no fraction (vLLM itself then refuses to start).  Source: vllm/engine/arg_utils.py
    (``--gpu-memory-utilization``, default ``CacheConfig.gpu_memory_utilization``).
    """
    found = None
    args = list(argv or ())
    for i, a in enumerate(args):
        if a == "--gpu-memory-utilization" and i + 1 < len(args):
            found = args[i + 1]
        elif a.startswith("--gpu-memory-utilization="):
            found = a.split("=", 1)[1]
    if found is None:
        return VLLM_DEFAULT_UTILIZATION, f"vLLM's default --gpu-memory-utilization {VLLM_DEFAULT_UTILIZATION:g}"
    try:
        f = float(found)
    except ValueError:
        return None, f"--gpu-memory-utilization {found[:40]!r} is no number"
    if not (math.isfinite(f) and 0 < f <= 1):
        return None, f"--gpu-memory-utilization {found[:40]!r} is not in (0, 1]"
    return f, f"--gpu-memory-utilization {f:g}"

"""The MemFree gate's pure decisions: how much MemFree a start needs, and what blocks it.

Why MemFree and not only MemAvailable, on a GB10 (FIELD-NOTES "How GB10 reports memory" and
"What the public multi-Spark recipes do"):

* vLLM's start-up check (vllm/v1/worker/utils.py ``request_memory``) refuses to start when
  free < ``ceil(total x gpu_memory_utilization)``; on Spark its "free" is MemAvailable
  (vllm/utils/mem_utils.py ``MemorySnapshot.measure``: psutil's ``available`` on the
  shared-memory devices, compute capability 12.1), ``total`` is cudaMemGetInfo's total.
* The driver's own allocator sees MemFree (cudaMemGetInfo's free equals MemFree on GB10) and
  fails instead of reclaiming page cache; allocations failed with MemAvailable at ~22 GiB.
* One recipe gates a restart on CUDA-free >= ``gpu_memory_utilization x total + 1.5 GiB`` ("the
  driver returns the torn-down context a few GiB behind MemFree").

So the gate needs ``MemFree >= utilization x MemTotal + margin`` (MemTotal standing in for the
device total: on GB10 the GPU's memory is the system's), never less than ``engine.start_above``.
Enough MemFree that lies in blocks smaller than 2 MiB (/proc/buddyinfo, :mod:`sparkguard.buddyinfo`)
is fragmentation, not quantity: compaction may merge it, else only a reboot helps.
Assumption (nothing public measures it): the driver backs a start's allocations with 2 MiB
blocks, so a start needs its whole ``need`` in such blocks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from sparkguard.config.engine import is_vllm
from sparkguard.config.startgate import StartGateConfig, vllm_utilization
from sparkguard.units import format_size

MiB = 1024**2

OPEN, SHORT, FRAGMENTED = "open", "short", "fragmented"


@dataclass(frozen=True)
class Need:
    """MemFree a start needs.

    Attributes:
        bytes: int, ``max(start_above, ceil(utilization x mem_total) + margin)``.
        utilization: float used (0 for a command that is not vLLM, with ``utilization: auto``).
        source: str, where the utilization came from (shown in the status and the incident).
    """

    bytes: int
    utilization: float
    source: str


def vllm_argv(argv) -> tuple[str, ...] | None:
    """The vLLM part of a command line: ``argv`` itself for ``vllm serve ...``, the tail from
    ``vllm serve`` / ``python -m vllm.entrypoints...`` of a wrapper such as ``docker run ... IMAGE
    vllm serve M ...`` (the recipes' form, FIELD-NOTES), or None when no vLLM is started."""
    args = tuple(argv or ())
    if is_vllm(args):
        return args
    for i, a in enumerate(args):
        if (a.rsplit("/", 1)[-1] == "vllm" and args[i + 1:i + 2] == ("serve",)) or (
                a == "-m" and args[i + 1:i + 2] and args[i + 1].split(".")[0] == "vllm"):
            return args[i:]
    return None


def notable(records) -> list[dict]:
    """The gate records worth an incident's engine part: all of them when a gate beyond the
    quiesce gate ran (hold, drop_caches, compact, memfree, peers, cluster), else none (the
    restart event already says the quiesce wait)."""
    records = list(records or ())
    return records if any(r.get("gate") != "quiesce" for r in records) else []


def summary(records) -> str:
    """``"; compacted in 0.08 s; memfree: MemFree ..."`` for the restart event, "" without
    compaction or memfree gate."""
    out = ""
    for r in records or ():
        if r.get("gate") in ("compact", "memfree"):
            out += f"; {r.get('detail')}" + (f" ({r['state']})" if r.get("state") in ("timed_out", "fragmented") else "")
    return out


def need_for(sg: StartGateConfig, argv, mem_total: int, start_above: int) -> Need:
    """The MemFree a start of ``argv`` needs (see the module doc).

    Args:
        sg: ``engine.start_gate``; argv: the command about to start (lane args included);
        mem_total: MemTotal in bytes; start_above: ``engine.start_above`` in bytes.
    """
    if sg.utilization is not None:
        util, source = sg.utilization, f"engine.start_gate.utilization {sg.utilization:g}"
    elif (vargv := vllm_argv(argv)) is not None:
        util, source = vllm_utilization(vargv)
        if util is None:
            util, source = 0.0, source + "; counted as 0"
    else:
        util, source = 0.0, "not a vLLM command: utilization 0"
    need = math.ceil(mem_total * util) + sg.margin
    if need < start_above:
        return Need(start_above, util, source + f"; engine.start_above {format_size(start_above)} is higher")
    return Need(need, util, source)


def verdict(mem_free: int, high_order: int | None, need: Need, fragmentation: str = "wait") -> tuple[str, str]:
    """Is a start possible now?  Returns ``(state, detail)``.

    Args:
        mem_free: MemFree in bytes; high_order: bytes free in >= 2 MiB blocks (None: unknown, or
        ``fragmentation: off``); need: :func:`need_for`; fragmentation: ``engine.start_gate.fragmentation``.
    Returns:
        :data:`OPEN`; :data:`SHORT` (MemFree below the need); :data:`FRAGMENTED` (MemFree is
        enough, the >= 2 MiB blocks are not).  ``detail`` is the line the status, history and
        incident show.
    """
    want = f"need >= {format_size(need.bytes)} ({need.utilization:g} x MemTotal + margin; {need.source})"
    if mem_free < need.bytes:
        return SHORT, f"memfree: MemFree {format_size(mem_free)}, {want}"
    if fragmentation != "off" and high_order is not None and high_order < need.bytes:
        return FRAGMENTED, fragmented_detail(mem_free, high_order)
    return OPEN, f"memfree: MemFree {format_size(mem_free)}, {want}"


def fragmented_detail(mem_free: int, high_order: int) -> str:
    """``"fragmented: N MiB in >= 2 MiB blocks of M MiB free; reboot recommended"``."""
    return (f"fragmented: {high_order // MiB} MiB in >= 2 MiB blocks of {mem_free // MiB} MiB free; "
            "reboot recommended")


class Backoff:
    """When to compact again while fragmentation blocks a start: ``first`` seconds, doubling up
    to ``most`` (so a box that stays fragmented is not compacted in a tight loop)."""

    def __init__(self, first: float = 30.0, most: float = 600.0):
        self.first, self.most = first, most
        self.delay = first

    def next(self) -> float:
        """The wait before the next compaction (seconds); doubles each call."""
        d = self.delay
        self.delay = min(self.most, self.delay * 2)
        return d

"""What every ``sparkguard doctor`` check shares: the verdicts, :class:`Check`, the
:class:`Context` (the configuration and the process list, read once), and the running guards
and engines found in that list.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any

from sparkguard import proctree
from sparkguard.host import procview

PASS, WARN, FAIL, INFO = "PASS", "WARN", "FAIL", "INFO"


UNIT = "sparkguard.service"


UNIT_FILE = "/etc/systemd/system/sparkguard.service"


@dataclass
class Check:
    """One verdict: ``name`` (stable id), ``status`` (PASS/WARN/FAIL/INFO), ``message``,
    ``fix`` (what to do, or None) and ``data`` (measured values, JSON-ready)."""

    name: str
    status: str
    message: str
    fix: str | None = None
    data: dict = field(default_factory=dict)


@dataclass
class Context:
    """What the checks share: the loaded config, and the GPU memory utilisation vLLM is
    started with (the fraction of MemTotal its start-up check wants free) when the operator
    gave one (``--gpu-memory-utilization``); None: from the configured engine, else vLLM's
    default (:func:`sparkguard.host.doctor_memory.utilization`)."""

    config: Any
    gpu_memory_utilization: float | None = None
    _procs: list | None = None

    def processes(self) -> list[tuple[int, int, list[str]]]:
        """``[(pid, ppid, argv)]`` of every process, read once; unreadable ones and kernel threads skipped."""
        if self._procs is None:
            out = []
            for pid in proctree.pids():
                try:
                    argv = procview.argv(pid)
                    ppid = procview.ppid(pid)
                except (OSError, ValueError, IndexError):
                    continue
                if argv:
                    out.append((pid, ppid, argv))
            self._procs = out
        return self._procs


def guard_pids(ctx: Context) -> list[int]:
    """Pids of the running guards: ``sparkguard run`` processes, not counting one whose parent
    is a guard too (a fork of the same guard)."""
    guards = {pid: ppid for pid, ppid, argv in ctx.processes() if pid != os.getpid() and procview.is_guard(argv)}
    return sorted(pid for pid, ppid in guards.items() if ppid not in guards)


ORDER = {INFO: 0, PASS: 0, WARN: 1, FAIL: 2}


def worse(a: str, b: str) -> str:
    """The worse of two verdicts (FAIL > WARN > PASS)."""
    return a if ORDER[a] >= ORDER[b] else b


def engine_roots(ctx: Context) -> list[tuple[int, str]]:
    """Root processes of the engines ``targets.match`` selects: ``[(pid, cmdline)]``.

    The cmdline is argv joined with spaces, as the guard matches it (sparkguard/enginetree.py).
    """
    pats = [re.compile(p) for p in ctx.config.targets.match]
    procs = [(pid, ppid, " ".join(argv)) for pid, ppid, argv in ctx.processes()]
    hit = {pid: cmd for pid, _, cmd in procs if pid != os.getpid() and any(p.search(cmd) for p in pats)}
    parent = {pid: ppid for pid, ppid, _ in procs}
    return sorted((pid, cmd) for pid, cmd in hit.items() if parent.get(pid) not in hit)


"""Each process's GPU memory from NVML, read off the poll loop by a thread of its own.

On unified memory the RSS of an inference process hides what it holds through the GPU driver
(1.8 GiB RSS beside a 77 GiB model; FIELD-NOTES "The machine it protects").  NVML's per-process
accounting (``nvmlDeviceGetComputeRunningProcesses``: pid and ``usedGpuMemory`` per compute
process, per device) is exact on a GB10 while ``nvmlDeviceGetMemoryInfo`` is NOT_SUPPORTED there
(FIELD-NOTES "How GB10 reports memory").  The figures count in the tree memory that orders
several engines (:mod:`sparkguard.enginetree`), and show in incidents, ``sparkguard status`` and
``sparkguard_engine_gpu_memory_bytes`` (docs/gpu-memory.md).

NVML comes from the optional dependency ``nvidia-ml-py`` (module ``pynvml``; its calls and error
classes are modelled on nvidia-ml-py 13.615's pynvml.py).  Without it nothing changes: the thread
is not started, :func:`reading` is empty, ``pynvml`` is never imported.  With it, only the
thread ``sg-gpumem`` imports it and calls NVML (a call can take tens of milliseconds, and the
library is a C driver interface that must not block the guard); the poll loop and every other
reader take :func:`reading`, the last complete dict, replaced whole (one reference read).
"""

from __future__ import annotations

import importlib.util
import logging
import threading
import time
from typing import Any

log = logging.getLogger("sparkguard.gpumem")

INTERVAL = 2.0          # seconds between NVML reads: loading takes minutes, a fill GiB/s; the order
                        # of engines is decided before the crossing (armed target), so a 2 s old
                        # figure is what the decision needs; each read is a few NVML calls
MAX_PROCS = 4096        # processes kept from one read (a device lists its compute processes)
STALE = 10.0            # seconds: a reading older than this is not shown (the thread is stuck)


def available() -> bool:
    """True when the ``pynvml`` module (nvidia-ml-py) is installed; nothing is imported."""
    try:
        return importlib.util.find_spec("pynvml") is not None
    except (ImportError, ValueError):
        return False


def read_once(nvml: Any) -> dict[int, int]:
    """One pass over every device: ``{pid: bytes}`` summed over devices.

    Args:
        nvml: the ``pynvml`` module (or a test double with its names), already initialised.
    Raises:
        nvml.NVMLError: the device count cannot be read (the driver went away).  A device whose
        process list cannot be read (``NVMLError_NotSupported``, ``NVMLError_GpuIsLost``...) is
        skipped; ``usedGpuMemory`` None (NVML_VALUE_NOT_AVAILABLE) counts 0.
    """
    out: dict[int, int] = {}
    for i in range(min(int(nvml.nvmlDeviceGetCount()), 64)):
        try:
            procs = nvml.nvmlDeviceGetComputeRunningProcesses(nvml.nvmlDeviceGetHandleByIndex(i))
        except nvml.NVMLError as e:
            log.debug("gpumem: device %d: %s", i, e)
            continue
        for p in procs[:MAX_PROCS]:
            pid, used = int(getattr(p, "pid", 0) or 0), getattr(p, "usedGpuMemory", None)
            if pid > 0 and isinstance(used, int) and 0 <= used < 1 << 60:
                out[pid] = out.get(pid, 0) + used
    return out


class GpuMemory:
    """The ``sg-gpumem`` thread: NVML read every ``interval`` seconds into :attr:`last`.

    Args:
        interval: float seconds between reads.
        load: ``() -> module``: the NVML module (default: ``import pynvml``); raising ImportError
            or the module's NVMLError at ``nvmlInit`` ends the thread with :attr:`error` set.
        clock: monotonic seconds.

    Attributes (read from any thread; each replaced whole):
        last: ``{pid: bytes}`` of the last complete read ({} before the first).
        at: monotonic time of that read, or None.
        error: why NVML is not read ("" while it is).
        first: threading.Event set after the first read (or the failure).
    """

    def __init__(self, interval: float = INTERVAL, load=None, clock=time.monotonic):
        self.interval, self.load, self.clock = interval, load or _import_pynvml, clock
        self.last: dict[int, int] = {}
        self.at: float | None = None
        self.error = ""
        self.first = threading.Event()
        self.stop_event = threading.Event()
        self.thread: threading.Thread | None = None

    def start(self) -> "GpuMemory":
        """Start the ``sg-gpumem`` daemon thread; returns self."""
        self.thread = threading.Thread(target=self._run, name="sg-gpumem", daemon=True)
        self.thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """End the thread after its NVML call in progress; waits at most ``timeout`` seconds."""
        self.stop_event.set()
        if self.thread is not None:
            self.thread.join(timeout)

    def fresh(self) -> dict[int, int]:
        """:attr:`last` when it is at most :data:`STALE` seconds old, else {}."""
        at = self.at
        return self.last if at is not None and self.clock() - at <= STALE else {}

    def _run(self) -> None:
        try:
            nvml = self.load()
            nvml.nvmlInit()
        except Exception as e:  # noqa: BLE001 - ImportError, NVMLError_LibraryNotFound, DriverNotLoaded...
            self.error = f"NVML not available: {type(e).__name__}: {e}"
            log.info("gpumem: %s; GPU memory per process is not read", self.error)
            self.first.set()
            return
        log.info("gpumem: reading each process's GPU memory from NVML every %g s", self.interval)
        failed = ""
        try:
            while not self.stop_event.is_set():
                try:
                    reading = read_once(nvml)
                except Exception as e:  # noqa: BLE001 - keep the last figures out of date rather than wrong
                    msg = f"{type(e).__name__}: {e}"
                    if msg != failed:
                        log.warning("gpumem: NVML read failed: %s", msg)
                        failed = msg
                    self.error = f"NVML read failed: {msg}"
                else:
                    self.last, self.at, self.error, failed = reading, self.clock(), "", ""
                self.first.set()
                self.stop_event.wait(self.interval)
        finally:
            try:
                nvml.nvmlShutdown()
            except Exception:  # noqa: BLE001
                pass


def _import_pynvml():
    """The nvidia-ml-py module, imported only here, in the ``sg-gpumem`` thread."""
    import pynvml
    return pynvml


#: the daemon's reader, started by :func:`start`; None: not started (no nvidia-ml-py, or a command
#: other than ``sparkguard run``)
_SHARED: GpuMemory | None = None


def start(interval: float = INTERVAL) -> GpuMemory | None:
    """Start the daemon's reader when nvidia-ml-py is installed; None (and nothing imported) when not."""
    global _SHARED
    if _SHARED is None and available():
        _SHARED = GpuMemory(interval).start()
    return _SHARED


def read_now(timeout: float = 3.0) -> bool:
    """For a command that is not the daemon (``sparkguard status``): with nvidia-ml-py, start a
    reader and wait up to ``timeout`` seconds for its first read, so that :func:`reading` has
    figures; True when it has.  Without nvidia-ml-py: False, nothing imported."""
    if not available():
        return False
    if _SHARED is None:
        install(GpuMemory(interval=60.0).start())
    _SHARED.first.wait(timeout)
    return active()


def install(reader: GpuMemory | None) -> None:
    """Make ``reader`` the one :func:`reading` returns (tests; None to uninstall)."""
    global _SHARED
    _SHARED = reader


def active() -> bool:
    """True while a reader runs and its last read is at most :data:`STALE` seconds old (a process
    it does not list then holds no GPU memory)."""
    r = _SHARED
    at = r.at if r is not None else None
    return at is not None and r.clock() - at <= STALE


def reading() -> dict[int, int]:
    """``{pid: GPU bytes}`` of the last NVML read ({} without NVML); never blocks, any thread."""
    r = _SHARED
    return r.fresh() if r is not None else {}

"""The drill's engine tree: real processes shaped, titled and stopped like vLLM's; one fills memory.

``sparkguard drill`` needs a victim that the guard's target selection, its tree walk and its
signals treat exactly as they treat vLLM, and that makes memory fall at a chosen rate.  What is
imitated (FIELD-NOTES "vLLM, the main engine guarded", read from vLLM 0.33:
``vllm/entrypoints/cli/serve.py``, ``vllm/v1/engine/core.py``,
``vllm/v1/executor/multiproc_executor.py``, ``vllm/v1/utils.py:shutdown``)::

    python3 .../sparkguard/drill/vllm serve MODEL ...   (the API server: cmdline intact)
      `- VLLM::EngineCore                               (setproctitle: cmdline is the title alone,
           |- VLLM::Worker_TP0                           /proc/PID/comm cut to 15 bytes:
           `- VLLM::Worker_TP1 ... TP<N-1>               "VLLM::EngineCor", "VLLM::Worker_TP")

All in the launcher's process group (nothing calls setsid or sets PDEATHSIG).  Each process
holds real, touched, incompressible memory (``--hold-api``, ``--hold-core``, ``--hold`` per
worker).  On SIGUSR1 worker TP0 allocates and touches ``--fill-size`` bytes at ``--fill-rate``
bytes/s (``max``: as fast as it can), then holds them; with ``--fill-to`` it stops as soon as
the memory signal (``--fill-signal``) is at or below that level (:class:`Fill`).

Shutdown, as vLLM's API server does it with its default shutdown timeout
(``VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS`` unset: 0 s): on SIGTERM or SIGINT the top SIGTERMs
EngineCore and SIGKILLs EngineCore and the workers at once, then "tears down" for
:data:`EXIT_DELAY` seconds and exits 0.  EngineCore forwards a SIGTERM it gets to its workers;
a worker exits :data:`EXIT_DELAY` s after its SIGTERM.  With ``--ignore-term`` every process
ignores SIGTERM and SIGINT: only SIGKILL ends them.  If the top is SIGKILLed, EngineCore and
the workers stay alive, reparented, holding memory (the open vLLM issue).

Output: vLLM-like log lines on stdout, one ``write(2)`` per line, and these lines, unprefixed::

    fake-vllm: ready pids=<top>,<core>,<w0>,<w1>       the tree is titled and holds its memory
    fake-vllm: fill pid=N bytes=N target=N [done [level]]   fill progress (about once a second);
                                                          "done level": --fill-to stopped it

:class:`Memory` and :class:`Fill` here, with :mod:`sparkguard.drill.plumbing` (log lines, signals,
fork, pidfds) and :mod:`sparkguard.drill.tree` (the handle of a running tree), are also the
building blocks of the full fake vLLM the tests use (tests/fakes/fake_vllm.py).

Python API: ``command(model, *opts)`` (argv) and ``start(model, *opts) -> Tree``.
"""

from __future__ import annotations

import argparse
import mmap
import os
import signal
import sys
import time

from sparkguard import meminfo
from sparkguard.drill.planning import parse_rate
from sparkguard.drill.plumbing import (BLOCKED, Log, Signals, exited, fork, is_term, reap, send, settitle, sleep_until,
                                       wait_fds)
from sparkguard.drill.tree import READY_PREFIX, Tree
from sparkguard.units import parse_size

FILL_PREFIX = "fake-vllm: fill "
#: seconds each process takes to exit after its SIGTERM (vLLM's CUDA teardown, shortened)
EXIT_DELAY = 0.2
#: seconds the top waits for EngineCore and every worker to report before it gives up
READY_TIMEOUT = 120.0
PAGE = mmap.PAGESIZE
BLOCK = 1 << 20


def script_path() -> str:
    """Absolute path of the ``vllm`` launcher script shipped beside this module.

    Raises:
        FileNotFoundError: the package was installed without its ``drill/vllm`` data file.
    """
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"drill launcher missing: {path} (package data not installed?)")
    return path


def command(model: str, *opts: str) -> list[str]:
    """argv of the drill's tree: ``[sys.executable, <pkg>/drill/vllm, "serve", model, *opts]``.

    The top's /proc/PID/cmdline is then exactly this list, like real vLLM's
    ``/usr/bin/python3 /usr/local/bin/vllm serve MODEL ...``; see :func:`build_parser` for ``opts``.
    """
    return [sys.executable, script_path(), "serve", str(model), *[str(o) for o in opts]]


def start(model: str, *opts: str) -> "Tree":
    """Start the drill's tree (``command(model, *opts)``) in a session of its own; returns at once.

    Use ``tree.pids()`` to wait for it and ``tree.stop()`` in a ``finally``.
    """
    return Tree(command(model, *opts))


# --------------------------------------------------------------------------------------------
# memory and the fill, shared with the tests' full fake vLLM

class Memory:
    """Anonymous private mappings filled with random bytes: resident, and incompressible for zram/KSM."""

    def __init__(self) -> None:
        self.maps: list[mmap.mmap] = []
        self.nbytes = 0
        self._block = os.urandom(BLOCK)

    def add(self, nbytes: int) -> None:
        """Allocate and touch ``nbytes`` (rounded up to a page).  Raises OSError (ENOMEM) like malloc would."""
        nbytes = -(-int(nbytes) // PAGE) * PAGE
        if nbytes <= 0:
            return
        m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        off = 0
        while off < nbytes:
            n = min(BLOCK, nbytes - off)
            m[off:off + n] = self._block[:n]
            off += n
        self.maps.append(m)
        self.nbytes += nbytes


class Fill:
    """Allocate up to ``size`` bytes at ``rate`` bytes/s (None = as fast as possible), then hold them.

    With ``level`` (bytes of the memory signal ``signal``: ``available`` for MemAvailable,
    ``available+swap`` for MemAvailable+SwapFree, as ``guard.signal`` names them) the fill also
    stops once the signal is at or below ``level``, read from /proc/meminfo before each step: it
    goes as far down as planned whatever else on the host allocates or frees meanwhile, and
    never further.  ``size`` then only caps what it may take.

    The owner calls :meth:`begin` once, then :meth:`step` whenever :meth:`next_due` says, while
    ``active``.  Progress goes to ``log`` as ``fake-vllm: fill`` lines, about once a second (the
    last ends ``done``, or ``done level`` where the level stopped it); ``where`` is the
    ``[file:line]`` tag of its other log lines.
    """

    MAX_STEP = 64 << 20

    def __init__(self, mem: Memory, rate: float | None, size: int, log: Log, where: str = "fill",
                 level: int | None = None, signal: str = "available"):
        self.mem, self.rate, self.size, self.log, self.where = mem, rate, int(size), log, where
        self.level, self.signal = level, signal
        self.reader: meminfo.MeminfoReader | None = None
        self.done = 0
        self.started = False
        self.active = False
        self.t0 = 0.0
        self.last_report = 0.0
        self.min_step = BLOCK if rate is None else max(PAGE, min(self.MAX_STEP, int(rate * 0.005) // PAGE * PAGE))

    def begin(self, now: float) -> None:
        """Start filling at ``now`` (monotonic s).  Raises OSError where a level is set and
        /proc/meminfo cannot be opened."""
        if self.level is not None:
            self.reader = meminfo.MeminfoReader()
        self.started = self.active = True
        self.t0 = self.last_report = now
        self.log("INFO", self.where, f"filling {self.size} bytes at "
                 f"{'max' if self.rate is None else f'{self.rate:.0f} B/s'}"
                 + ("" if self.level is None else f", until {self.signal} is {self.level} bytes or less"))

    def next_due(self, now: float) -> float:
        """Seconds until the next step is due (0 when behind or unlimited)."""
        if self.rate is None:
            return 0.0
        return self.t0 + min(self.size, self.done + self.min_step) / self.rate - now

    def _room(self) -> int:
        """Bytes of the signal above the level now (0 or less: the level is reached)."""
        return meminfo.signal_bytes(self.signal, *self.reader.sample()) - self.level

    def step(self, now: float) -> None:
        if self.rate is None:
            target = self.size
        else:
            target = min(self.size, int(self.rate * (now - self.t0)))
        n = min(self.MAX_STEP, target - self.done)
        room = None if self.level is None else self._room()
        if room is not None and n >= room:
            n = target = room               # the last step: down to the level
        added = 0
        if n > 0 and (n >= self.min_step or target in (self.size, room)):
            try:
                self.mem.add(n)
            except OSError as e:
                self.log("ERROR", self.where, f"fill allocation failed: {e}; holding {self.done} bytes")
                self.active = False
                return
            self.done += n
            added = n
        level = room is not None and room - added <= 0
        finished = self.done >= self.size or level
        if finished or now - self.last_report >= 1.0:
            self.last_report = now
            self.log.raw(f"{FILL_PREFIX}pid={os.getpid()} bytes={self.done} target={self.size}"
                         + (" done level" if level else " done" if finished else ""))
        if finished:
            self.active = False
            if self.reader is not None:
                self.reader.close()


# --------------------------------------------------------------------------------------------
# the drill's tree

def size_arg(text: str) -> int:
    """argparse type: ``64MiB`` -> bytes (see ``sparkguard.units.parse_size``)."""
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def rate_arg(text: str) -> float | None:
    """argparse type: ``1GiB/s``, ``512MiB``, ``1000000`` -> bytes/s; ``max`` -> None (see ``planning.parse_rate``)."""
    try:
        return parse_rate(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a rate like 1GiB/s, 512MiB or max, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    """Parser of ``vllm serve MODEL [options]`` for the drill's tree (sizes take units: ``64MiB``)."""
    p = argparse.ArgumentParser(prog="vllm serve", description="sparkguard drill's engine tree")
    p.add_argument("model")
    p.add_argument("--tp", type=int, default=2, help="workers VLLM::Worker_TP0..N-1 under EngineCore (default 2)")
    p.add_argument("--hold", type=size_arg, default=parse_size("64MiB"), help="memory each worker holds (default 64MiB)")
    p.add_argument("--hold-core", type=size_arg, default=parse_size("32MiB"), help="memory EngineCore holds (default 32MiB)")
    p.add_argument("--hold-api", type=size_arg, default=parse_size("16MiB"), help="memory the top holds (default 16MiB)")
    p.add_argument("--fill-size", type=size_arg, default=0, help="bytes worker TP0 fills on SIGUSR1 (then holds)")
    p.add_argument("--fill-rate", type=rate_arg, default=None, help="bytes/s of the fill (1GiB/s, 512MiB, max: default)")
    p.add_argument("--fill-to", type=size_arg, default=None,
                   help="the fill also stops once the memory signal is at or below this (bytes; --fill-size caps it)")
    p.add_argument("--fill-signal", choices=meminfo.SIGNALS, default="available",
                   help="the signal --fill-to reads: MemAvailable, or MemAvailable+SwapFree (guard.signal)")
    p.add_argument("--ignore-term", action="store_true", help="every process ignores SIGTERM and SIGINT")
    return p


def _worker(a: argparse.Namespace, rank: int, ready_w: int) -> int:
    """VLLM::Worker_TP<rank>: hold memory, report ready, fill on SIGUSR1 (TP0), exit after its SIGTERM."""
    settitle(f"VLLM::Worker_TP{rank}")
    log = Log(f"(Worker_TP{rank} pid={os.getpid()}) ")
    fills = rank == 0 and a.fill_size > 0
    sigs = Signals(a.ignore_term, catch_usr1=fills)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, BLOCKED)
    mem = Memory()
    mem.add(a.hold)
    log("INFO", "gpu_model_runner.py:1", f"Model loading took {mem.nbytes / 2**30:.4f} GiB")
    os.write(ready_w, f"W {rank} {os.getpid()}\n".encode())
    os.close(ready_w)
    fill = Fill(mem, a.fill_rate, a.fill_size, log, level=a.fill_to, signal=a.fill_signal) if fills else None
    while True:
        wait_fds([sigs.rfd], fill.next_due(time.monotonic()) if fill is not None and fill.active else None)
        now = time.monotonic()
        got = sigs.read()
        if is_term(got) and not a.ignore_term:
            log("INFO", "multiproc_executor.py:1", "Worker received SIGTERM, shutting down (CUDA teardown)")
            sleep_until(now + EXIT_DELAY)
            return 0
        if fill is not None:
            if signal.SIGUSR1 in got and not fill.started:
                fill.begin(now)
            if fill.active:
                fill.step(now)


def _core(a: argparse.Namespace, ready_w: int) -> int:
    """VLLM::EngineCore: fork the workers, hold memory, forward a SIGTERM to them, exit once they are gone.

    A worker that dies before any SIGTERM makes EngineCore SIGKILL the others and exit 1, as vLLM's
    executor does.
    """
    settitle("VLLM::EngineCore")
    log = Log(f"(EngineCore pid={os.getpid()}) ")
    log("INFO", "core.py:1", f"Initializing a V1 LLM engine with config: model={a.model!r}, tensor_parallel_size={a.tp}")
    workers: dict[int, int] = {}  # pid -> pidfd
    for rank in range(a.tp):
        pid = fork(lambda r=rank: _worker(a, r, ready_w), list(workers.values()))
        workers[pid] = os.pidfd_open(pid)
    sigs = Signals(a.ignore_term)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, BLOCKED)
    mem = Memory()
    mem.add(a.hold_core)
    os.write(ready_w, f"C {os.getpid()}\n".encode())
    os.close(ready_w)
    stopping_since = None
    while workers or stopping_since is None:
        ready = wait_fds([sigs.rfd, *workers.values()], None)
        if is_term(sigs.read()) and not a.ignore_term and stopping_since is None:
            stopping_since = time.monotonic()
            log("INFO", "core.py:1", "EngineCore received SIGTERM, shutting down workers")
            for fd in workers.values():
                send(fd, signal.SIGTERM)
        for pid, fd in list(workers.items()):
            if fd in ready:
                reap(pid, block=True)
                os.close(fd)
                del workers[pid]
                if stopping_since is None:
                    log("ERROR", "multiproc_executor.py:1", f"Worker proc {pid} died unexpectedly, shutting down executor.")
                    for other in workers.values():
                        send(other, signal.SIGKILL)
                    for other in workers:
                        reap(other, block=True)
                    return 1
    sleep_until(stopping_since + EXIT_DELAY)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``drill/vllm`` script: ``serve MODEL [options]``; returns the exit status.

    Exit status: 0 after a SIGTERM/SIGINT shutdown; 1 when the tree failed to come up within
    :data:`READY_TIMEOUT` or EngineCore died; 2 on bad options (argparse).
    """
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] != "serve":
        print("usage: vllm serve MODEL [options]   (sparkguard drill's engine tree)", file=sys.stderr)
        return 2
    a = build_parser().parse_args(argv[1:])
    log = Log("")
    where = "api_server.py:1"
    log("INFO", where, f"vLLM API server (sparkguard drill), model={a.model!r}, tp={a.tp}")
    sigs = Signals(a.ignore_term)
    ready_r, ready_w = os.pipe()
    child = fork(lambda: _core(a, ready_w), [ready_r, *sigs.fds()])
    os.close(ready_w)
    engine = {child: os.pidfd_open(child)}   # pid -> pidfd: EngineCore, then the workers
    mem = Memory()
    mem.add(a.hold_api)

    workers: dict[int, int] = {}   # rank -> pid
    core = None
    buf, deadline = b"", time.monotonic() + READY_TIMEOUT
    while core is None or len(workers) < a.tp:
        ready = wait_fds([ready_r, sigs.rfd], deadline - time.monotonic())
        if sigs.rfd in ready and is_term(sigs.read()) and not a.ignore_term:
            return _shutdown(engine, child, time.monotonic())
        data = os.read(ready_r, 4096) if ready_r in ready else b""
        if (ready_r in ready and not data) or time.monotonic() >= deadline:
            log("ERROR", where, "Engine core initialization failed: the tree did not come up")
            return _shutdown(engine, child, time.monotonic(), 1)
        buf += data
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            kind, *nums = line.split()
            if kind == b"C":
                core = int(nums[0])
            else:
                rank, pid = int(nums[0]), int(nums[1])
                workers[rank] = pid
                engine[pid] = os.pidfd_open(pid)
    os.close(ready_r)
    log.raw(READY_PREFIX + "pids=" + ",".join(map(str, [os.getpid(), core, *(workers[r] for r in sorted(workers))])))
    while True:
        ready = wait_fds([sigs.rfd, engine[child]], None)
        if sigs.rfd in ready and is_term(sigs.read()) and not a.ignore_term:
            return _shutdown(engine, child, time.monotonic())
        if engine[child] in ready:
            log("ERROR", "core_client.py:1", "Engine core proc EngineCore died unexpectedly, shutting down client.")
            return _shutdown(engine, child, time.monotonic(), 1)


def _shutdown(engine: dict[int, int], core: int, t_term: float, code: int = 0) -> int:
    """vllm/v1/utils.py:shutdown with timeout 0: SIGTERM EngineCore, SIGKILL it and the workers,
    reap EngineCore, tear down for :data:`EXIT_DELAY` s from ``t_term``; returns ``code``."""
    Log("").raw("INFO:     Shutting down")
    send(engine[core], signal.SIGTERM)
    for fd in engine.values():
        if not exited(fd):
            send(fd, signal.SIGKILL)
    reap(core, block=True)
    sleep_until(t_term + EXIT_DELAY)
    return code

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
bytes/s (``max``: as fast as it can), then holds them.

Shutdown, as vLLM's API server does it with its default shutdown timeout
(``VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS`` unset: 0 s): on SIGTERM or SIGINT the top SIGTERMs
EngineCore and SIGKILLs EngineCore and the workers at once, then "tears down" for
:data:`EXIT_DELAY` seconds and exits 0.  EngineCore forwards a SIGTERM it gets to its workers;
a worker exits :data:`EXIT_DELAY` s after its SIGTERM.  With ``--ignore-term`` every process
ignores SIGTERM and SIGINT: only SIGKILL ends them.  If the top is SIGKILLed, EngineCore and
the workers stay alive, reparented, holding memory (the open vLLM issue).

Output: vLLM-like log lines on stdout, one ``write(2)`` per line, and these lines, unprefixed::

    fake-vllm: ready pids=<top>,<core>,<w0>,<w1>       the tree is titled and holds its memory
    fake-vllm: fill pid=N bytes=N target=N [done]      fill progress (about once a second)

The parts here (logging, the signal self-pipe, memory, the fill, fork, pidfd helpers and the
:class:`Tree` handle of a running tree) are also the building blocks of the full fake vLLM the
tests use (tests/fakes/fake_vllm.py).

Python API: ``command(model, *opts)`` (argv) and ``start(model, *opts) -> Tree``.
"""

from __future__ import annotations

import argparse
import mmap
import os
import select
import signal
import subprocess
import sys
import threading
import time

from sparkguard.drill.planning import parse_rate
from sparkguard.units import parse_size

READY_PREFIX = "fake-vllm: ready "
FILL_PREFIX = "fake-vllm: fill "
#: seconds each process takes to exit after its SIGTERM (vLLM's CUDA teardown, shortened)
EXIT_DELAY = 0.2
#: seconds the top waits for EngineCore and every worker to report before it gives up
READY_TIMEOUT = 120.0
#: the signals a new child blocks until its own handlers are in place
BLOCKED = {signal.SIGTERM, signal.SIGINT, signal.SIGUSR1}
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
# building blocks, shared with the tests' full fake vLLM

class Log:
    """vLLM-style log lines, one write(2) per line to stdout (atomic on a pipe below PIPE_BUF)."""

    def __init__(self, prefix: str = ""):
        self.prefix = prefix

    def raw(self, line: str) -> None:
        data = (line.rstrip("\n") + "\n").encode("utf-8", "replace")
        try:
            os.write(1, data)
        except OSError:
            pass  # reader gone: an orphan keeps running without its log, as vLLM's would

    def __call__(self, level: str, where: str, msg: str) -> None:
        self.raw(f"{self.prefix}{level} {time.strftime('%m-%d %H:%M:%S')} [{where}] {msg}")


class Signals:
    """Self-pipe for signals: handlers only wake ``rfd``; the owning loop decides what to do.

    SIGTERM and SIGINT are ignored (``ignore_term``) or caught; SIGUSR1 is caught with
    ``catch_usr1`` and keeps its default action (death) otherwise.
    """

    def __init__(self, ignore_term: bool, catch_usr1: bool = False):
        self.rfd, self.wfd = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(self.wfd, warn_on_full_buffer=False)
        for s in (signal.SIGTERM, signal.SIGINT):
            signal.signal(s, signal.SIG_IGN if ignore_term else _noop)
        signal.signal(signal.SIGUSR1, _noop if catch_usr1 else signal.SIG_DFL)

    def read(self) -> list[int]:
        """Signal numbers received since the last read (non-blocking)."""
        try:
            return list(os.read(self.rfd, 512))
        except BlockingIOError:
            return []

    def fds(self) -> list[int]:
        return [self.rfd, self.wfd]


def _noop(signum, frame) -> None:  # the wakeup fd carries the signal number
    return None


def is_term(signals: list[int]) -> bool:
    """True if SIGTERM or SIGINT is among ``signals`` (numbers from :meth:`Signals.read`)."""
    return any(s in (signal.SIGTERM, signal.SIGINT) for s in signals)


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
    """Allocate ``size`` bytes at ``rate`` bytes/s (None = as fast as possible), then hold them.

    The owner calls :meth:`begin` once, then :meth:`step` whenever :meth:`next_due` says, while
    ``active``.  Progress goes to ``log`` as ``fake-vllm: fill`` lines, about once a second;
    ``where`` is the ``[file:line]`` tag of its other log lines.
    """

    MAX_STEP = 64 << 20

    def __init__(self, mem: Memory, rate: float | None, size: int, log: Log, where: str = "fill"):
        self.mem, self.rate, self.size, self.log, self.where = mem, rate, int(size), log, where
        self.done = 0
        self.started = False
        self.active = False
        self.t0 = 0.0
        self.last_report = 0.0
        self.min_step = BLOCK if rate is None else max(PAGE, min(self.MAX_STEP, int(rate * 0.005) // PAGE * PAGE))

    def begin(self, now: float) -> None:
        self.started = self.active = True
        self.t0 = self.last_report = now
        self.log("INFO", self.where, f"filling {self.size} bytes at "
                 f"{'max' if self.rate is None else f'{self.rate:.0f} B/s'}")

    def next_due(self, now: float) -> float:
        """Seconds until the next step is due (0 when behind or unlimited)."""
        if self.rate is None:
            return 0.0
        return self.t0 + min(self.size, self.done + self.min_step) / self.rate - now

    def step(self, now: float) -> None:
        if self.rate is None:
            target = self.size
        else:
            target = min(self.size, int(self.rate * (now - self.t0)))
        n = min(self.MAX_STEP, target - self.done)
        if n > 0 and (n >= self.min_step or target == self.size):
            try:
                self.mem.add(n)
            except OSError as e:
                self.log("ERROR", self.where, f"fill allocation failed: {e}; holding {self.done} bytes")
                self.active = False
                return
            self.done += n
        finished = self.done >= self.size
        if finished or now - self.last_report >= 1.0:
            self.last_report = now
            self.log.raw(f"{FILL_PREFIX}pid={os.getpid()} bytes={self.done} target={self.size}"
                         + (" done" if finished else ""))
        if finished:
            self.active = False


def settitle(title: str) -> None:
    """Rename this process as vLLM does (setproctitle: cmdline = title, comm = title[:15])."""
    import setproctitle  # imported only in the children: the top must keep its cmdline

    setproctitle.setproctitle(title)


def wait_fds(fds: list[int], timeout: float | None) -> list[int]:
    """The fds of ``fds`` readable within ``timeout`` seconds (None: no limit)."""
    if timeout is not None:
        timeout = max(0.0, timeout)
    return select.select(fds, [], [], timeout)[0]


def exited(pidfd: int) -> bool:
    """True once the process of ``pidfd`` has exited (the pidfd polls readable; a zombie counts)."""
    return bool(wait_fds([pidfd], 0))


def send(pidfd: int | None, sig: int) -> None:
    """Signal the process of ``pidfd``; nothing when it is None or gone."""
    if pidfd is None:
        return
    try:
        signal.pidfd_send_signal(pidfd, sig)
    except OSError:
        pass


def reap(pid: int, block: bool) -> int | None:
    """waitpid a child; returns its exit status (negative signal like Popen) or None if still running."""
    try:
        got, status = os.waitpid(pid, 0 if block else os.WNOHANG)
    except ChildProcessError:
        return None
    if got == 0:
        return None
    return os.waitstatus_to_exitcode(status)


def sleep_until(deadline: float) -> None:
    """Sleep to a monotonic deadline; signals meanwhile only wake the (unread) pipe."""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return
        time.sleep(left)


def fork(child_main, close_fds: list[int]) -> int:
    """fork with :data:`BLOCKED` blocked, so none reaches the child before it installs its own.

    The child closes ``close_fds`` (the parent's wakeup pipe, sockets, pidfds), runs
    ``child_main()`` (which unblocks the signals once its handlers are in place) and always
    leaves with os._exit, never through the parent's stack.  Returns the child's pid.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    old = signal.pthread_sigmask(signal.SIG_BLOCK, BLOCKED)
    pid = os.fork()
    if pid == 0:
        code = 70
        try:
            signal.set_wakeup_fd(-1)
            for fd in close_fds:
                try:
                    os.close(fd)
                except OSError:
                    pass
            code = child_main()
        except BaseException as e:  # noqa: BLE001 - a child must never return into the parent's code
            try:
                Log(f"(pid={os.getpid()}) ").raw(f"ERROR fake-vllm child failed: {e!r}")
            finally:
                os._exit(70)
        os._exit(code if isinstance(code, int) else 0)
    signal.pthread_sigmask(signal.SIG_SETMASK, old)
    return pid


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
    fill = Fill(mem, a.fill_rate, a.fill_size, log) if fills else None
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


# --------------------------------------------------------------------------------------------
# the handle of a running tree

def parse_ready(line: str) -> dict:
    """``fake-vllm: ready pids=1,2,3 port=80`` -> ``{"pids": [1, 2, 3], "port": 80}``."""
    out: dict = {}
    for word in line[len(READY_PREFIX):].split():
        key, _, val = word.partition("=")
        if key == "pids":
            out["pids"] = [int(p) for p in val.split(",") if p]
        elif key == "port":
            out["port"] = int(val)
    return out


class Tree:
    """A running tree (this module's or the tests' full fake vLLM): its Popen, its output, its pids.

    Every pid of the ready line is pinned by a pidfd as soon as the line is read, so that
    :meth:`exited` and :meth:`stop` never touch a recycled pid.

    Attributes:
        proc: subprocess.Popen of the top process (stdout+stderr are a pipe drained by a thread).
        argv: list[str], the command line.
        lines: list[str], every output line so far (without newline).
    """

    def __init__(self, argv: list[str], on_line=None, **popen_kw):
        self.argv = argv
        self.lines: list[str] = []
        self._on_line = on_line
        self._cond = threading.Condition()
        self._ready_line: str | None = None
        self._pidfds: dict[int, int] = {}
        self._own_session = popen_kw.setdefault("start_new_session", True)
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, **popen_kw)
        self._pidfds[self.proc.pid] = os.pidfd_open(self.proc.pid)
        self._reader = threading.Thread(target=self._read, name=f"fake-vllm-{self.proc.pid}", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for raw in self.proc.stdout:
            line = raw.decode("utf-8", "replace").rstrip("\n")
            with self._cond:
                if line.startswith(READY_PREFIX) and self._ready_line is None:
                    for pid in parse_ready(line)["pids"]:
                        if pid not in self._pidfds:
                            try:
                                self._pidfds[pid] = os.pidfd_open(pid)
                            except OSError:
                                pass
                    self._ready_line = line
                self.lines.append(line)
                self._cond.notify_all()
            if self._on_line:
                try:
                    self._on_line(line)
                except Exception:  # noqa: BLE001 - a callback must not stop the draining
                    pass
        with self._cond:
            self._cond.notify_all()

    def wait_line(self, substring: str, timeout: float = 30.0, start: int = 0) -> str:
        """Wait for an output line containing ``substring`` (searching from index ``start``).

        Raises:
            TimeoutError: not seen within ``timeout`` seconds, or the output ended first.
        """
        deadline = time.monotonic() + timeout
        i = start
        with self._cond:
            while True:
                while i < len(self.lines):
                    if substring in self.lines[i]:
                        return self.lines[i]
                    i += 1
                left = deadline - time.monotonic()
                if left <= 0 or not self._reader.is_alive():
                    tail = "\n".join(self.lines[-20:])
                    raise TimeoutError(f"fake vllm: no line with {substring!r} within {timeout} s; output tail:\n{tail}")
                self._cond.wait(left)

    def pids(self, timeout: float = 30.0) -> list[int]:
        """Wait for the ready line; return ``[top, core, w0, w1, ...]``.

        Raises:
            TimeoutError: the tree was not up within ``timeout`` seconds (or it exited).
        """
        return parse_ready(self.wait_line(READY_PREFIX, timeout))["pids"]

    @property
    def worker_pids(self) -> list[int]:
        """Worker pids by rank; waits for readiness."""
        return self.pids()[2:]

    def start_fill(self) -> None:
        """Send SIGUSR1 to the filling worker (TP0); waits for readiness.

        Raises:
            ValueError: started without ``--fill-size`` (SIGUSR1 would kill that worker).
        """
        if "--fill-size" not in self.argv:
            raise ValueError("start_fill(): this tree was started without --fill-size")
        send(self._pidfds.get(self.worker_pids[0]), signal.SIGUSR1)

    def exited(self, pid: int) -> bool:
        """True once process ``pid`` of this tree has exited (pidfd readable; zombie counts as exited).

        Raises:
            KeyError: ``pid`` is not one of this tree's (or it was gone before its pidfd was opened).
        """
        fd = self._pidfds.get(pid)
        if fd is None:
            raise KeyError(f"pid {pid} is not part of this tree")
        return exited(fd)

    def wait_gone(self, pids: list[int], timeout: float) -> bool:
        """Wait until every pid in ``pids`` (of this tree) has exited; False on timeout."""
        fds = [self._pidfds[p] for p in pids]
        deadline = time.monotonic() + timeout
        while True:
            left = [fd for fd in fds if not exited(fd)]
            if not left:
                return True
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            wait_fds(left[:1], remaining)

    def stop(self, timeout: float = 10.0) -> None:
        """SIGKILL the whole tree this started (every recorded pid, by pidfd, plus its process group
        while the top is unreaped and in its own session), reap the top, close the pidfds.  Idempotent."""
        for fd in list(self._pidfds.values()):
            send(fd, signal.SIGKILL)
        if self._own_session and self.proc.returncode is None:
            try:  # the top is unreaped, so its pid (= our pgid) cannot have been reused
                os.killpg(self.proc.pid, signal.SIGKILL)
            except OSError:
                pass
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        self.wait_gone(list(self._pidfds), timeout)
        self._reader.join(timeout)
        for fd in self._pidfds.values():
            try:
                os.close(fd)
            except OSError:
                pass
        self._pidfds = {}
        if self.proc.stdout:
            self.proc.stdout.close()

    def __enter__(self) -> "Tree":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

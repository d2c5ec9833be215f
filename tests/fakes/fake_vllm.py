"""The tests' fake vLLM: real processes that look, serve and die like vLLM's.

What sparkguard can observe of a vLLM engine is imitated with real processes, real memory and a
real HTTP port; nothing is mocked.  Facts imitated (FIELD-NOTES "vLLM, the main engine guarded",
read from vLLM 0.33: ``vllm/entrypoints/cli/serve.py``, ``vllm/v1/engine/core.py``,
``vllm/v1/executor/multiproc_executor.py``, ``vllm/v1/utils.py:shutdown``):

Process tree (all in the launcher's process group; nothing calls setsid, nothing sets PDEATHSIG)::

    python3 .../tests/fakes/vllm serve MODEL ...        (cmdline intact, not renamed: the API server)
      `- VLLM::EngineCore                               (setproctitle: cmdline is the title alone,
           |- VLLM::Worker_TP0                           /proc/PID/comm cut to 15 bytes:
           `- VLLM::Worker_TP1 ... TP<N-1>               "VLLM::EngineCor", "VLLM::Worker_TP")

    --headless --node-rank k:   vllm serve ... -> VLLM::Worker_TP<k>   (no API server, no HTTP)

Multi-node (``--nnodes N`` > 1, with ``--master-addr``, ``--master-port``,
``--distributed-timeout-seconds``, ``--fake-on-head-loss``): node k runs the TP ranks
k*tp/N .. (k+1)*tp/N-1, the head (``--node-rank 0``) under EngineCore, a ``--headless`` node
directly under its top; the nodes meet at a real TCP rendezvous before the head loads and
serves.  All of that lives in ``fake_cluster.py`` (imported only then); with ``--nnodes 1`` (the
default) nothing here changes.  ``--max-model-len`` (shown by /v1/models, default 4096) and
``--max-num-seqs`` are the lane flags the nodes must agree on.

Every process holds real, touched, incompressible memory (``--hold-api``, ``--hold-core``,
``--hold`` per worker), so RSS is real.

Shutdown, as vLLM's API server does it: on SIGTERM/SIGINT the top sends SIGTERM to the engine and
waits up to the shutdown timeout (``--shutdown-timeout`` if given, else the environment variable
``VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS``, else 0), then SIGKILLs the engine and its workers.  With the
default 0 the engine processes are therefore SIGKILLed within milliseconds.  EngineCore forwards
SIGTERM to its workers and exits once they are gone.  Each process "tears down CUDA" for
``--exit-delay`` seconds (counted from its SIGTERM) before it exits 0.

If the top is SIGKILLed, EngineCore and the workers stay alive, reparented, holding memory (the open
vLLM issue); this happens in every mode, ``orphans`` only names it.  If a worker dies unexpectedly,
EngineCore kills the other workers and exits 1; if EngineCore dies unexpectedly, the top answers 503
on /health for ``--dead-linger`` seconds and exits 1 (workers that EngineCore did not take down stay
orphans, as in vLLM).

Modes (``--mode``, comma-separated, combinable):
    clean        default: SIGTERM -> exit after ``--exit-delay``.
    orphans      same as clean (orphans are left whenever the top is SIGKILLed).
    ignore-term  every process ignores SIGTERM and SIGINT; only SIGKILL ends them.
    crash        ``--crash-after S`` seconds after serving starts EngineCore hits a fatal error: it
                 SIGKILLs its workers and exits 1, the top then exits 1 (``--crash-after`` implies it).
    wedge        ``--wedge-after S`` seconds after serving starts, completions hang forever while
                 /health keeps answering 200 (``--wedge-after`` implies it).

HTTP (only with ``--port``; 0 picks a free port): the port is bound at start but listens only once
"loading" is done, as vLLM does: ``--load-time`` has passed on the top's clock *and* every worker of
the node has reported its load done (TP0's ``--load-fill`` all allocated; the other ranks at once).
Meanwhile the top logs ``Waiting for 1 local, 0 remote core engine proc(s) to start.`` every 10 s,
the first time when ``--load-time`` is over.  Source: vllm/v1/engine/core.py ``EngineCore.__init__``
builds the executor (every worker loads its weights) and runs ``_initialize_kv_caches`` (profiling,
``initialize_from_config``: each worker allocates its KV cache) before EngineCoreProc sends its
ready response; vllm/v1/engine/utils.py ``wait_for_engine_startup`` has the API server wait for that
READY (logging the line above every ``STARTUP_POLL_PERIOD_MS`` = 10 s), and
vllm/entrypoints/openai/api_server.py ``run_server_worker`` starts uvicorn (``serve_http``, in
newer versions through ``build_and_serve``) only inside ``async with build_async_engine_client()``,
which returns once that handshake is done.  With ``--nnodes``, the head's top waits for its own
node's ranks only (the rendezvous stands for the others); a headless node's top waits for its
own (fake_cluster.py).

Endpoints: ``GET /health`` (200, empty body; 503 once the engine is known dead), ``GET /v1/models``,
``POST /v1/completions`` and ``/v1/chat/completions`` (one token), ``GET /metrics`` (Prometheus
text: ``vllm:num_requests_running``, ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``,
``vllm:request_success_total``), ``GET /ping``, ``GET /version``.  With ``VLLM_SERVER_DEV_MODE=1`` also ``POST /pause``
(``mode=abort|wait|keep``), ``POST /resume`` and ``GET /is_paused``, as vLLM's dev-mode router has
them (``fake_pause.py`` beside this file says what each does, with vLLM's file:function);
``--request-time S`` makes each completion take S seconds in the engine, so a pause has
something in flight to abort, freeze or wait for.

Memory fill: worker TP0 (the lowest rank of the node) allocates and touches ``--fill-size``
bytes at ``--fill-rate`` bytes/s (``max`` = as fast as it can), then holds them.  The fill starts
``--fill-delay`` seconds after the tree is ready, or, with ``--fill-on-signal``, when TP0 receives
SIGUSR1 (``FakeEngine.start_fill``).  ``--load-fill N``: the load phase's steep fall, N bytes within
``--load-time``, all of them before the port listens however long the allocations take
(:func:`_load_fill`); an allocation that fails while loading ends the worker with status 1
(a CUDA OOM while loading: the engine fails to start).  ``--alloc-step N``: the fill in
allocations of N bytes at once (:class:`_StepFill`).

Output: log lines like vLLM's (``INFO 05-14 10:22:33 [api_server.py:1] ...``; children prefixed
``(EngineCore pid=N)`` / ``(Worker_TP0 pid=N)``), uvicorn-style access lines, one ``write`` per line,
to stdout.  Machine-readable lines, unprefixed:

    fake-vllm: ready pids=<top>,<core>,<w0>,<w1>[ port=<port>]   tree titled and holding memory
                                                                  (headless: pids=<top>,<w_k>)
    fake-vllm: serving url=http://HOST:PORT                        the port listens (or, without
                                                                  --port, "serving" after load-time)
    fake-vllm: fill pid=N bytes=N target=N [done]                  fill progress (about 1/s)

(with ``--nnodes``: also the rendezvous and group lines listed in fake_cluster.py)

``--ready-file PATH`` also gets the ready line (written atomically).

Python API: ``command(model, *opts)`` (argv) and ``start(model, *opts, **popen_kw) -> FakeEngine``.

Built on the parts of ``sparkguard drill``'s own small tree (``sparkguard/drill/hog.py``: memory
and the fill; ``plumbing.py``: log lines, signals, fork, pidfds; ``tree.py``: the running-tree
handle); what only tests need (HTTP, crash, wedge, headless, load time, shutdown timeout, ready
file) lives here, outside the product.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field

from sparkguard.drill.hog import Fill, Memory, rate_arg, size_arg
from sparkguard.drill.plumbing import BLOCKED, Log, Signals, exited, fork, reap, send, settitle, sleep_until, wait_fds
from sparkguard.drill.tree import READY_PREFIX, Tree, parse_ready
from sparkguard.units import parse_duration, parse_size

#: the vLLM version whose behaviour this fake imitates (FIELD-NOTES)
VLLM_VERSION = "0.33.0"
MODES = ("clean", "orphans", "ignore-term", "crash", "wedge")
#: vllm/config/parallel.py ParallelConfig.master_port
DEFAULT_MASTER_PORT = 29501
#: PyTorch's default NCCL process-group timeout (vllm/config/parallel.py distributed_timeout_seconds: None)
DEFAULT_TIMEOUT_S = 600.0
HEAD_LOSS = ("exit", "hang")
SERVING_PREFIX = "fake-vllm: serving "
#: ``--load-fill`` spreads its bytes over this share of ``--load-time`` (the port listens only once it is done)
LOAD_FILL_SHARE = 0.8
#: seconds between the top's "Waiting for ... core engine proc(s) to start." lines while a rank
#: still loads (vllm/v1/engine/utils.py ``STARTUP_POLL_PERIOD_MS`` 10000, wait_for_engine_startup)
STARTUP_POLL_PERIOD = 10.0
_SHUTDOWN_ENV = "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS"


def script_path() -> str:
    """Absolute path of the ``vllm`` launcher script beside this module (``tests/fakes/vllm``)."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm")


def command(model: str, *opts: str) -> list[str]:
    """argv that starts a fake vLLM: ``[sys.executable, tests/fakes/vllm, "serve", model, *opts]``.

    The top process's /proc/PID/cmdline is then exactly this list, like real vLLM's
    ``/usr/bin/python3 /usr/local/bin/vllm serve MODEL ...``.  ``opts`` are strings (``"--tp", "4"``);
    see the module docstring or ``build_parser()`` for the options.
    """
    return [sys.executable, script_path(), "serve", str(model), *[str(o) for o in opts]]


# --------------------------------------------------------------------------------------------
# options

def _duration(text: str) -> float:
    try:
        return parse_duration(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _modes(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise argparse.ArgumentTypeError(f"unknown mode {text!r}; choose from {', '.join(MODES)} (comma-separated)")
    return modes


def build_parser() -> argparse.ArgumentParser:
    """Parser of ``vllm serve MODEL [options]``.  Unknown vLLM options are accepted and ignored.

    Sizes take units (``64MiB``), durations too (``500ms``); see ``sparkguard.units``.
    """
    p = argparse.ArgumentParser(prog="vllm serve", description="sparkguard's fake vLLM (see tests/fakes/fake_vllm.py)")
    p.add_argument("model")
    p.add_argument("--tp", "-tp", "--tensor-parallel-size", dest="tp", type=int, default=2,
                   help="workers VLLM::Worker_TP0..N-1 under EngineCore (default 2)")
    p.add_argument("--headless", action="store_true",
                   help="no API server, no EngineCore: one worker of rank --node-rank (with --nnodes: this node's ranks)")
    p.add_argument("--node-rank", type=int, default=0)
    p.add_argument("--nnodes", type=int, default=1, help="nodes the engine spans (default 1); see fake_cluster.py")
    p.add_argument("--master-addr", default="127.0.0.1", help="rendezvous address (default 127.0.0.1)")
    p.add_argument("--master-port", type=int, default=DEFAULT_MASTER_PORT,
                   help=f"rendezvous port on the head (default {DEFAULT_MASTER_PORT}, vLLM's)")
    p.add_argument("--distributed-timeout-seconds", type=_duration, default=DEFAULT_TIMEOUT_S,
                   help=f"rendezvous and collective timeout (default {DEFAULT_TIMEOUT_S:g} s, PyTorch's)")
    p.add_argument("--fake-on-head-loss", choices=HEAD_LOSS, default="exit",
                   help="what a headless node does when its head is gone: exit 0 (default) or hang")
    p.add_argument("--max-model-len", type=int, default=None, help="context length (/v1/models; default 4096)")
    p.add_argument("--max-num-seqs", type=int, default=None, help="lane flag; compared across nodes")
    p.add_argument("--mode", type=_modes, default=["clean"], help=f"comma-separated, from: {', '.join(MODES)}")
    p.add_argument("--exit-delay", type=_duration, default=0.2,
                   help="seconds each process takes to exit after SIGTERM (CUDA teardown; default 0.2)")
    p.add_argument("--shutdown-timeout", type=_duration, default=None,
                   help=f"seconds the engine gets to exit after SIGTERM before SIGKILL (default: ${_SHUTDOWN_ENV} or 0)")
    p.add_argument("--hold", type=size_arg, default=parse_size("64MiB"), help="memory each worker holds (default 64MiB)")
    p.add_argument("--hold-core", type=size_arg, default=parse_size("32MiB"), help="memory EngineCore holds (default 32MiB)")
    p.add_argument("--hold-api", type=size_arg, default=parse_size("16MiB"), help="memory the top holds (default 16MiB)")
    p.add_argument("--fill-rate", type=rate_arg, default=None, help="bytes/s worker TP0 fills at (1GiB/s, 512MiB, max)")
    p.add_argument("--fill-size", type=size_arg, default=None, help="bytes worker TP0 fills (then holds)")
    p.add_argument("--fill-delay", type=_duration, default=0.0, help="seconds after ready before the fill starts")
    p.add_argument("--fill-on-signal", action="store_true", help="start the fill when TP0 receives SIGUSR1")
    p.add_argument("--load-fill", type=size_arg, default=None,
                   help="bytes worker TP0 allocates while loading, spread over --load-time, before the port listens")
    p.add_argument("--alloc-step", type=size_arg, default=None,
                   help="TP0 fills in allocations of this many bytes at once (one mapping each)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=None, help="serve HTTP on this port (0: any free port); none: no HTTP")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--load-time", type=_duration, default=0.0, help="seconds of 'loading' before the port listens")
    p.add_argument("--crash-after", type=_duration, default=None, help="seconds of serving before EngineCore crashes")
    p.add_argument("--wedge-after", type=_duration, default=None, help="seconds of serving before completions hang")
    p.add_argument("--dead-linger", type=_duration, default=1.0,
                   help="seconds the top answers 503 after the engine died, before it exits 1 (default 1)")
    p.add_argument("--ready-file", default=None, help="also write the ready line to this file")
    p.add_argument("--request-time", type=_duration, default=0.0,
                   help="seconds a completion takes in the engine (default 0); see fake_pause.py")
    p.add_argument("--ready-timeout", type=_duration, default=120.0, help="seconds to wait for the tree to come up")
    return p


def _cluster():
    """The multi-node part (fake_cluster.py beside this file), imported only with --nnodes > 1."""
    if __package__:
        from . import fake_cluster
    else:
        import fake_cluster
    return fake_cluster


def _pause_module():
    """fake_pause.py beside this file (the /pause, /resume, /is_paused endpoints)."""
    if __package__:
        from . import fake_pause
    else:
        import fake_pause
    return fake_pause


def _local_ranks(a: argparse.Namespace) -> list[int]:
    """Global TP ranks of this node's workers: all of them on one node; see fake_cluster.local_ranks."""
    if a.nnodes > 1:
        return _cluster().local_ranks(a)
    return [a.node_rank] if a.headless else list(range(a.tp))


@dataclass
class _Cfg:
    args: argparse.Namespace
    extra: list[str]
    shutdown_timeout: float
    modes: set = field(default_factory=set)

    @property
    def ignore_term(self) -> bool:
        return "ignore-term" in self.modes


def _dashed(opt: str) -> str:
    """``--node_rank=1`` -> ``--node-rank=1``: vLLM takes either spelling of a long option
    (vllm/utils/argparse_utils.py FlexibleArgumentParser.parse_args); values are left alone."""
    if not opt.startswith("--"):
        return opt
    key, eq, value = opt.partition("=")
    return key.replace("_", "-") + eq + value


def _parse(argv: list[str]) -> _Cfg:
    if not argv or argv[0] != "serve":
        print("usage: vllm serve MODEL [options]   (sparkguard fake vLLM)", file=sys.stderr)
        raise SystemExit(2)
    parser = build_parser()
    args, extra = parser.parse_known_args([_dashed(o) for o in argv[1:]])
    modes = set(args.mode)
    if args.crash_after is not None:
        modes.add("crash")
    elif "crash" in modes:
        args.crash_after = 0.0
    if args.wedge_after is not None:
        modes.add("wedge")
    elif "wedge" in modes:
        args.wedge_after = 0.0
    if args.tp < 1:
        parser.error(f"--tp must be at least 1, got {args.tp}")
    if args.node_rank < 0:
        parser.error(f"--node-rank must not be negative, got {args.node_rank}")
    if args.nnodes < 1:
        parser.error(f"--nnodes must be at least 1, got {args.nnodes}")
    if args.nnodes > 1:
        _cluster().check_args(parser, args)
    if args.fill_rate is not None and args.fill_size is None:
        parser.error("--fill-rate needs --fill-size")
    if args.load_fill is not None:
        _load_fill(parser, args)
    timeout = args.shutdown_timeout
    if timeout is None:
        env = os.environ.get(_SHUTDOWN_ENV, "").strip()
        try:
            timeout = parse_duration(env) if env else 0.0
        except ValueError:
            parser.error(f"environment {_SHUTDOWN_ENV}={env!r}: expected seconds")
    try:
        _pause_module().dev_mode()
    except ValueError:
        parser.error(f"environment VLLM_SERVER_DEV_MODE={os.environ.get('VLLM_SERVER_DEV_MODE')!r}: expected 0 or 1")
    return _Cfg(args=args, extra=extra, shutdown_timeout=float(timeout), modes=modes)


def _load_fill(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--load-fill N``: the load phase's steep fall.  Worker TP0 allocates N bytes from the moment
    the tree is up, at N / (0.8 x ``--load-time``) bytes/s (as fast as it can without a load time), so
    that it is done while the port does not listen yet; then holds them.  vLLM loads the weights and allocates its KV cache
    before the API server listens (FIELD-NOTES "vLLM": the port only listens once the engine is
    ready; "How GB10 reports memory": free memory fell 17-19 GiB in 10 s right after weights load).
    Expressed as the serving fill's options (``--fill-size``, ``--fill-rate``, no delay), which it
    therefore replaces.  The rate is a plan on TP0's clock: on a loaded host the fill ends later,
    and the top then waits for it (TP0's ``D`` report) before it listens."""
    if args.fill_size is not None or args.fill_on_signal:
        parser.error("--load-fill replaces --fill-size/--fill-on-signal: TP0 has one fill")
    args.fill_size = args.load_fill
    args.fill_rate = args.load_fill / (LOAD_FILL_SHARE * args.load_time) if args.load_time > 0 else None
    args.fill_delay = 0.0


class _StepFill(Fill):
    """``--alloc-step N``: the fill in allocations of exactly N bytes (the last one the rest), each one
    mapping touched at once (:meth:`Memory.add`), paced at the fill's rate.  Assumption: a CUDA
    allocation on unified memory takes its whole size from system RAM in one driver call (issue 17:
    "one allocation of several GiB at once, as a driver allocation is"); no GB10 trace says how fast
    the driver touches it."""

    def __init__(self, mem: Memory, rate: float | None, size: int, log: Log, step: int, where: str = "fill"):
        super().__init__(mem, rate, size, log, where)
        self.MAX_STEP = self.min_step = max(1, int(step))


def _make_fill(mem: Memory, a: argparse.Namespace, log: Log) -> Fill:
    """TP0's fill: :class:`Fill`, or :class:`_StepFill` with ``--alloc-step``."""
    if a.alloc_step:
        return _StepFill(mem, a.fill_rate, a.fill_size, log, a.alloc_step, where="fake_engine.py:1")
    return Fill(mem, a.fill_rate, a.fill_size, log, where="fake_engine.py:1")


# --------------------------------------------------------------------------------------------
# worker

def _worker_main(cfg: _Cfg, rank: int, fills: bool, ready_w: int, cmd_r: int | None) -> int:
    """VLLM::Worker_TP<rank>: hold memory, report ready, fill if asked, exit after exit-delay on TERM."""
    a = cfg.args
    settitle(f"VLLM::Worker_TP{rank}")
    log = Log(f"(Worker_TP{rank} pid={os.getpid()}) ")
    sigs = Signals(cfg.ignore_term, catch_usr1=fills)
    if a.nnodes > 1:  # before the unblock: the link's thread keeps the signals blocked
        try:
            _cluster().start_link(a, rank, ready_w, log)
        except OSError as e:
            log("ERROR", "parallel_state.py:1", f"could not listen on {a.master_addr}:{a.master_port}: {e}")
            return 1
    signal.pthread_sigmask(signal.SIG_UNBLOCK, BLOCKED)
    mem = Memory()
    mem.add(a.hold)
    log("INFO", "gpu_model_runner.py:1", f"Model loading took {mem.nbytes / 2**30:.4f} GiB")
    loading = fills and a.load_fill is not None     # its load fill comes before the top may serve
    _report(ready_w, f"W {rank} {os.getpid()}\n" + ("" if loading else f"D {rank}\n"))
    if a.nnodes == 1 and not loading:
        os.close(ready_w)  # with --nnodes the link reports the group on it

    fill_at = None
    if fills and not a.fill_on_signal:
        fill_at = time.monotonic() + a.fill_delay
    fill = _make_fill(mem, a, log) if fills else None
    crash_at = None
    watch = [sigs.rfd] + ([cmd_r] if cmd_r is not None else [])
    while True:
        now = time.monotonic()
        timeouts = []
        if fill is not None and fill.active:
            timeouts.append(fill.next_due(now))
        elif fill_at is not None:
            timeouts.append(fill_at - now)
        if crash_at is not None:
            timeouts.append(crash_at - now)
        ready = wait_fds(watch, min(timeouts) if timeouts else None)
        now = time.monotonic()
        for s in sigs.read():
            if s in (signal.SIGTERM, signal.SIGINT) and not cfg.ignore_term:
                log("INFO", "multiproc_executor.py:1", "Worker received SIGTERM, shutting down (CUDA teardown)")
                sleep_until(now + a.exit_delay)
                return 0
            if s == signal.SIGUSR1 and fill is not None and not fill.started:
                fill_at = now
        if cmd_r is not None and cmd_r in ready:
            crash_at, eof = _read_cmd(cmd_r, cfg, now, crash_at)
            if eof:
                watch.remove(cmd_r)
                os.close(cmd_r)
                cmd_r = None
        if crash_at is not None and now >= crash_at:
            log("ERROR", "multiproc_executor.py:1", "Worker hit a fatal error (fake crash mode): CUDA error: an illegal memory access was encountered")
            return 1
        if fill is not None:
            if not fill.started and fill_at is not None and now >= fill_at:
                fill.begin(now)
                fill_at = None
            if fill.active:
                fill.step(now)
            if loading and not fill.active:
                if fill.done < fill.size:      # the allocation failed: a load that fails ends the worker
                    log("ERROR", "multiproc_executor.py:1", "WorkerProc failed to start: out of memory while loading")
                    return 1
                loading = False
                _report(ready_w, f"D {rank}\n")
                if a.nnodes == 1:
                    os.close(ready_w)


def _report(fd: int, text: str) -> None:
    """Write a report line (``W rank pid``, ``D rank``) to the top's ready pipe; a top that is
    gone is no error (the worker keeps running, as vLLM's do)."""
    try:
        os.write(fd, text.encode())
    except OSError:
        pass


def _read_cmd(cmd_r: int, cfg: _Cfg, now: float, crash_at: float | None) -> tuple[float | None, bool]:
    """Read the top's command pipe: ``S`` = serving started (arms the crash timer in crash mode).

    Returns ``(crash deadline (monotonic s) or None, eof)``; on EOF the top is gone and the
    caller keeps running, as vLLM's engine does.
    """
    try:
        data = os.read(cmd_r, 64)
    except BlockingIOError:
        return crash_at, False
    except OSError:
        return crash_at, True
    if not data:
        return crash_at, True
    if b"S" in data and "crash" in cfg.modes and crash_at is None:
        return now + (cfg.args.crash_after or 0.0), False
    return crash_at, False


# --------------------------------------------------------------------------------------------
# EngineCore

def _core_main(cfg: _Cfg, ready_w: int, cmd_r: int) -> int:
    """VLLM::EngineCore: fork the workers, hold memory, watch the workers, shut them down on TERM."""
    a = cfg.args
    settitle("VLLM::EngineCore")
    log = Log(f"(EngineCore pid={os.getpid()}) ")
    log("INFO", "core.py:1", f"Initializing a V1 LLM engine (v{VLLM_VERSION}) with config: model={a.model!r}, "
        f"tensor_parallel_size={a.tp}")
    workers: dict[int, tuple[int, int]] = {}  # pid -> (rank, pidfd)
    ranks = _local_ranks(a)
    for rank in ranks:
        pid = fork(lambda r=rank: _worker_main(cfg, r, r == ranks[0] and a.fill_size is not None, ready_w, None),
                    [cmd_r] + [fd for _, fd in workers.values()])
        workers[pid] = (rank, os.pidfd_open(pid))
    sigs = Signals(cfg.ignore_term)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, BLOCKED)
    mem = Memory()
    mem.add(a.hold_core)
    try:
        os.write(ready_w, f"C {os.getpid()}\n".encode())
    except OSError:
        pass
    os.close(ready_w)

    os.set_blocking(cmd_r, False)
    crash_at: float | None = None
    stopping_since: float | None = None
    while True:
        now = time.monotonic()
        fds = [sigs.rfd] + [fd for _, fd in workers.values()] + ([cmd_r] if cmd_r is not None else [])
        ready = wait_fds(fds, None if crash_at is None else crash_at - now)
        now = time.monotonic()
        for s in sigs.read():
            if s in (signal.SIGTERM, signal.SIGINT) and stopping_since is None and not cfg.ignore_term:
                stopping_since = now
                log("INFO", "core.py:1", "EngineCore received SIGTERM, shutting down workers")
                for _, fd in workers.values():
                    send(fd, signal.SIGTERM)
        if cmd_r is not None and cmd_r in ready:
            crash_at, eof = _read_cmd(cmd_r, cfg, now, crash_at)
            if eof:
                os.close(cmd_r)
                cmd_r = None
        for pid, (rank, fd) in list(workers.items()):
            if fd in ready:
                code = reap(pid, block=True)
                os.close(fd)
                del workers[pid]
                if stopping_since is None:
                    log("ERROR", "multiproc_executor.py:1",
                        f"Worker proc VLLM::Worker_TP{rank} died unexpectedly (exit {code}), shutting down executor.")
                    return _core_abort(workers, 1)
        if crash_at is not None and now >= crash_at and stopping_since is None:
            log("ERROR", "core.py:1", "EngineCore encountered a fatal error (fake crash mode).")
            return _core_abort(workers, 1)
        if stopping_since is not None and not workers:
            sleep_until(stopping_since + a.exit_delay)
            return 0


def _core_abort(workers: dict[int, tuple[int, int]], code: int) -> int:
    """Kill the remaining workers (SIGKILL, as vLLM's executor shutdown does), reap them, return ``code``."""
    for _, fd in workers.values():
        send(fd, signal.SIGKILL)
    for pid in workers:
        reap(pid, block=True)
    return code


# --------------------------------------------------------------------------------------------
# API server (the top process)

class _State:
    """What the HTTP threads read; written by the top's main loop."""

    def __init__(self, cfg: _Cfg, log: Log):
        self.cfg = cfg
        self.log = log
        self.model = cfg.args.model
        self.served = cfg.args.served_model_name or cfg.args.model
        self.lock = threading.Lock()
        self.serving_since: float | None = None
        self.dead = False
        self.stopping = False
        self.group = threading.Condition()  # --nnodes: notified when the group's state changes
        self.lost: set[int] = set()         # ranks whose connection ended (the group never recovers)
        self.unreachable: set[int] = set()  # ranks silent for a while (the group recovers when they are back)
        self.running = 0
        self.success = 0
        self.forever = threading.Event()  # never set: what wedged requests wait on
        fp = _pause_module()
        self.pause = fp.Pause(fp.dev_mode(), cfg.args.request_time)  # /pause, /resume, /is_paused

    def group_report(self, kind: str, rank: int) -> None:
        """A worker's report on rank ``rank``: ``L`` lost, ``U`` unreachable, ``R`` reachable again."""
        with self.group:
            if kind == "L":
                self.lost.add(rank)
                self.unreachable.discard(rank)
            elif kind == "U":
                self.unreachable.add(rank)
            elif kind == "R":
                self.unreachable.discard(rank)
            self.group.notify_all()

    def mark_dead(self) -> None:
        """The engine is known dead: /health 503; completions waiting on the group answer 500."""
        with self.group:
            self.dead = True
            self.group.notify_all()

    def wait_group(self) -> bool:
        """Block while a rank is lost or unreachable, as a request in NCCL would; True if the engine
        died meanwhile (without --nnodes the group is never broken and this returns False at once)."""
        with self.group:
            while (self.lost or self.unreachable) and not self.dead:
                self.group.wait()
            return self.dead

    def wedged(self) -> bool:
        w = self.cfg.args.wedge_after
        return (w is not None and self.serving_since is not None
                and time.monotonic() >= self.serving_since + w)


def _make_server(cfg: _Cfg, state: _State):
    """A ThreadingHTTPServer bound (not yet listening) to --host/--port, like vLLM's early bind."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server_version = "uvicorn"
        sys_version = ""

        def log_message(self, fmt, *args):  # uvicorn's access line
            pass

        def _send(self, code: int, body: bytes = b"", ctype: str = "application/json") -> None:
            self.send_response(code)
            self.send_header("content-type", ctype)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            if body and self.command != "HEAD":
                self.wfile.write(body)
            state.log.raw(f'INFO:     {self.client_address[0]}:{self.client_address[1]} - '
                          f'"{self.command} {self.path} {self.request_version}" {code} {_phrase(code)}')

        def _json(self, code: int, obj) -> None:
            self._send(code, json.dumps(obj).encode())

        def _error(self, code: int, kind: str, msg: str) -> None:
            self._json(code, {"error": {"message": msg, "type": kind, "param": None, "code": code}})

        def do_GET(self):  # noqa: N802 - http.server naming
            path = self.path.split("?", 1)[0]
            if path in ("/health", "/ping"):
                self._send(503 if state.dead or state.stopping else 200, b"")
            elif path == "/version":
                self._json(200, {"version": VLLM_VERSION})
            elif path == "/v1/models":
                self._json(200, {"object": "list", "data": [{
                    "id": state.served, "object": "model", "created": int(time.time()), "owned_by": "vllm",
                    "root": state.model, "parent": None,
                    "max_model_len": cfg.args.max_model_len or 4096}]})
            elif path == "/metrics":
                self._send(200, _metrics_text(state).encode(), "text/plain; version=0.0.4; charset=utf-8")
            elif state.pause.get(path) is not None:
                self._json(*state.pause.get(path))
            else:
                self._json(404, {"detail": "Not Found"})

        def do_HEAD(self):  # noqa: N802
            self.do_GET()

        def do_POST(self):  # noqa: N802
            path = self.path.split("?", 1)[0]
            try:
                n = int(self.headers.get("content-length") or 0)
                body = json.loads(self.rfile.read(n) or b"{}")
                if not isinstance(body, dict):
                    raise ValueError("body is not a JSON object")
            except ValueError as e:
                self._error(400, "BadRequestError", f"invalid JSON body: {e}")
                return
            answer = state.pause.post(path, self.path.partition("?")[2])
            if answer is not None:
                self._json(*answer)
                return
            if path not in ("/v1/completions", "/v1/chat/completions"):
                self._json(404, {"detail": "Not Found"})
                return
            if body.get("model", state.served) not in (state.served, state.model):
                self._error(404, "NotFoundError", f"The model `{body.get('model')}` does not exist.")
                return
            if state.dead:
                self._error(500, "EngineDeadError", "EngineCore encountered an issue. See stack trace for the root cause.")
                return
            with state.lock:
                state.running += 1
            try:
                if state.wait_group():
                    self._error(500, "EngineDeadError", "EngineCore encountered an issue. See stack trace for the root cause.")
                    return
                if state.wedged():
                    state.forever.wait()  # hangs like a wedged engine: the client's timeout ends it
                finish = state.pause.run()    # waits while paused, runs --request-time
                prompt = body.get("prompt", "")
                ptoks = max(1, len(str(prompt).split()))
                created = int(time.time())
                if path == "/v1/completions":
                    reply = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": created,
                             "model": state.served, "choices": [{"index": 0, "text": " the", "logprobs": None,
                                                                 "finish_reason": finish, "stop_reason": None}],
                             "usage": {"prompt_tokens": ptoks, "total_tokens": ptoks + 1, "completion_tokens": 1}}
                else:
                    reply = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": created,
                             "model": state.served, "choices": [{"index": 0, "message": {"role": "assistant",
                                                                 "content": "The"}, "finish_reason": finish}],
                             "usage": {"prompt_tokens": ptoks, "total_tokens": ptoks + 1, "completion_tokens": 1}}
                with state.lock:
                    state.success += 1
            finally:
                with state.lock:
                    state.running -= 1
            self._json(200, reply)

    class Server(ThreadingHTTPServer):
        address_family = socket.AF_INET6 if ":" in cfg.args.host else socket.AF_INET

    server = Server((cfg.args.host, cfg.args.port), Handler, bind_and_activate=False)
    server.daemon_threads = True
    server.block_on_close = False
    server.allow_reuse_address = True
    server.server_bind()
    return server


def _phrase(code: int) -> str:
    from http import HTTPStatus

    try:
        return HTTPStatus(code).phrase
    except ValueError:
        return ""


def _metrics_text(state: _State) -> str:
    """Prometheus text exposition of the vLLM metrics sparkguard and people read."""
    lbl = f'engine="0",model_name="{state.served}"'
    with state.lock:
        running, success = state.running, state.success
    running -= state.pause.waiting      # accepted while paused: waiting, not in a batch
    return (
        "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
        "# TYPE vllm:num_requests_running gauge\n"
        f"vllm:num_requests_running{{{lbl}}} {float(running)}\n"
        "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n"
        "# TYPE vllm:num_requests_waiting gauge\n"
        f"vllm:num_requests_waiting{{{lbl}}} {float(state.pause.waiting)}\n"
        "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.\n"
        "# TYPE vllm:kv_cache_usage_perc gauge\n"
        f"vllm:kv_cache_usage_perc{{{lbl}}} {min(1.0, 0.01 * running)}\n"
        "# HELP vllm:request_success_total Count of successfully processed requests.\n"
        "# TYPE vllm:request_success_total counter\n"
        f'vllm:request_success_total{{{lbl},finished_reason="length"}} {float(success)}\n'
    )


def _write_ready_file(path: str, line: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(line + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``tests/fakes/vllm`` script: ``serve MODEL [options]``; returns the exit status.

    Exit status: 0 after a SIGTERM/SIGINT shutdown; 1 when the engine died (crash mode, a child
    killed) or the tree failed to come up; 2 on bad options (argparse).
    """
    cfg = _parse(sys.argv[1:] if argv is None else argv)
    a = cfg.args
    log = Log("")
    where = "api_server.py:1"
    log("INFO", where, f"vLLM API server version {VLLM_VERSION} (sparkguard fake)")
    log("INFO", where, f"non-default args: model={a.model!r}, tp={a.tp}, modes={sorted(cfg.modes)}, "
        f"headless={a.headless}, shutdown_timeout={cfg.shutdown_timeout}" + (f", ignored={cfg.extra}" if cfg.extra else ""))
    if a.nnodes > 1:
        log("INFO", where, f"multi-node: nnodes={a.nnodes}, node_rank={a.node_rank}, "
            f"master={a.master_addr}:{a.master_port}, distributed_timeout_seconds={a.distributed_timeout_seconds:g}")
        if a.headless:
            return _cluster().headless_main(cfg)
    state = _State(cfg, log)
    server = None
    if a.port is not None and not a.headless:
        try:
            server = _make_server(cfg, state)
        except OSError as e:
            log("ERROR", where, f"could not bind {a.host}:{a.port}: {e}")
            return 1
    elif a.port is not None:
        log("WARNING", where, "--headless: no API server, --port ignored")

    sigs = Signals(cfg.ignore_term)
    ready_r, ready_w = os.pipe()
    cmd_r, cmd_w = os.pipe()
    parent_only = [ready_r, cmd_w] + sigs.fds() + ([server.fileno()] if server else [])
    if a.headless:
        child = fork(lambda: _worker_main(cfg, a.node_rank, a.fill_size is not None, ready_w, cmd_r),
                      parent_only)
    else:
        child = fork(lambda: _core_main(cfg, ready_w, cmd_r), parent_only)
    os.close(ready_w)
    os.close(cmd_r)
    child_fd = os.pidfd_open(child)
    mem = Memory()
    mem.add(a.hold_api)

    top = _Top(cfg, log, state, server, sigs, child, child_fd, cmd_w)
    return top.run(ready_r)


class _Top:
    """The top process's main loop: bring-up, loading, serving, shutdown, engine death."""

    def __init__(self, cfg, log, state, server, sigs, child, child_fd, cmd_w):
        self.cfg, self.a, self.log, self.state, self.server = cfg, cfg.args, log, state, server
        self.sigs, self.child, self.child_fd, self.cmd_w = sigs, child, child_fd, cmd_w
        self.worker_fds: dict[int, int] = {}
        self.where = "api_server.py:1"
        self.cluster = cfg.args.nnodes > 1
        self.formed = False
        self.loaded: set[int] = set()   # the local ranks whose load is done (their "D rank" reports)

    def _term_requested(self) -> bool:
        return any(s in (signal.SIGTERM, signal.SIGINT) for s in self.sigs.read()) and not self.cfg.ignore_term

    def run(self, ready_r: int) -> int:
        a = self.a
        t_term = None
        # 1. bring-up: wait for EngineCore and every worker to report (titled, memory held)
        want_workers = set(_local_ranks(a))
        core_pid = None
        workers: dict[int, int] = {}
        early: list[list[str]] = []  # --nnodes: the group's reports read during bring-up
        buf = b""
        deadline = time.monotonic() + a.ready_timeout
        while (not a.headless and core_pid is None) or set(workers) != want_workers:
            ready = wait_fds([ready_r, self.sigs.rfd, self.child_fd], deadline - time.monotonic())
            if self.sigs.rfd in ready and self._term_requested():
                t_term = time.monotonic()
                break
            if ready_r in ready:
                data = os.read(ready_r, 4096)
                buf += data
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    parts = line.decode().split()
                    if parts[0] == "C":
                        core_pid = int(parts[1])
                    elif parts[0] == "W":
                        pid = int(parts[2])
                        workers[int(parts[1])] = pid
                        try:
                            self.worker_fds[pid] = os.pidfd_open(pid)
                        except OSError:
                            pass
                    elif parts[0] == "D":
                        self.loaded.add(int(parts[1]))
                    else:
                        early.append(parts)
                if not data:
                    self.log("ERROR", self.where, "engine processes exited during start-up")
                    return self._abort(1)
            elif self.child_fd in ready:
                self.log("ERROR", self.where, "Engine core initialization failed. See root cause above.")
                return self._abort(1)
            if time.monotonic() >= deadline:
                self.log("ERROR", self.where, f"engine did not come up within {a.ready_timeout} s")
                return self._abort(1)
        if not self.cluster and self.loaded >= want_workers:
            os.close(ready_r)
            ready_r = None
        if t_term is not None:
            return self._shutdown(t_term)
        pids = [os.getpid()] + ([] if a.headless else [core_pid]) + [workers[r] for r in sorted(workers)]
        line = READY_PREFIX + "pids=" + ",".join(map(str, pids))
        if self.server:
            line += f" port={self.server.server_address[1]}"
        if a.ready_file:
            _write_ready_file(a.ready_file, line)
        self.log.raw(line)

        # 2. (--nnodes: the group forms,) loading, then serving once every local rank has loaded
        load_done = None if self.cluster else time.monotonic() + a.load_time
        for parts in early:
            load_done = self._group_report(parts, load_done)
        serving = False
        linger_until = None
        waiting_log = None      # when to say again that the engine core has not started yet
        while True:
            now = time.monotonic()
            timeout = None
            if not serving and load_done is not None:
                if now < load_done or self.loaded >= want_workers:
                    timeout = load_done - now
                else:
                    if waiting_log is None or now >= waiting_log:
                        waiting_log = now + STARTUP_POLL_PERIOD
                        if not a.headless:
                            self.log("DEBUG", "utils.py:1", "Waiting for 1 local, 0 remote core engine proc(s) to start.")
                    timeout = waiting_log - now
            if linger_until is not None:
                timeout = linger_until - now
            fds = [self.sigs.rfd] + ([self.child_fd] if linger_until is None else []) + ([ready_r] if ready_r else [])
            ready = wait_fds(fds, timeout)
            now = time.monotonic()
            if ready_r is not None and ready_r in ready:
                data = os.read(ready_r, 4096)
                buf += data
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    load_done = self._group_report(line.decode().split(), load_done)
                if not data or (not self.cluster and self.loaded >= want_workers):
                    os.close(ready_r)
                    ready_r = None
            if self.sigs.rfd in ready and self._term_requested():
                if linger_until is not None:
                    return self._finish(now, 1)
                return self._shutdown(now)
            if self.child_fd in ready and linger_until is None:
                code = reap(self.child, block=True)
                self.state.mark_dead()
                self.log("ERROR", "core_client.py:1",
                         f"Engine core proc {'VLLM::Worker' if a.headless else 'EngineCore'} died unexpectedly "
                         f"(exit {code}), shutting down client.")
                linger_until = now + a.dead_linger
                continue
            if linger_until is not None and now >= linger_until:
                return self._finish(now, 1)
            if not serving and load_done is not None and now >= load_done and self.loaded >= want_workers:
                serving = True
                self._start_serving()

    def _group_report(self, parts: list[str], load_done: float | None) -> float | None:
        """Handle a worker's report: ``D rank`` (its load is done), ``G`` (group formed: loading
        starts), ``L|U|R rank node`` (a rank lost, unreachable, reachable again: see
        _State.group_report); returns the new load deadline (monotonic s, None until formed)."""
        if len(parts) == 2 and parts[0] == "D":
            self.loaded.add(int(parts[1]))
            return load_done
        if parts and parts[0] == "G" and not self.formed:
            self.formed = True
            c = _cluster()
            self.log.raw(f"{c.FORMED_PREFIX}nnodes={self.a.nnodes} master={self.a.master_addr}:{self.a.master_port} "
                         f"node-rank={self.a.node_rank}")
            return time.monotonic() + self.a.load_time
        if len(parts) == 3 and parts[0] in ("L", "U", "R"):
            self.state.group_report(parts[0], int(parts[1]))
            self.log.raw(f"{_cluster().API_GROUP_PREFIX}{parts[0]} rank={int(parts[1])}")
        return load_done

    def _start_serving(self) -> None:
        if self.server:
            host, port = self.server.server_address[:2]
            url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
            self.log("INFO", self.where, f"Starting vLLM API server 0 on {url}")
            self.server.server_activate()  # listen(): only now do connections succeed
            threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.1},
                             name="http", daemon=True).start()
            self.log.raw(f"INFO:     Started server process [{os.getpid()}]")
            self.log.raw("INFO:     Waiting for application startup.")
            self.log.raw("INFO:     Application startup complete.")
        else:
            url = "none"
        self.state.serving_since = time.monotonic()
        try:
            os.write(self.cmd_w, b"S\n")
        except OSError:
            pass
        self.log.raw(f"{SERVING_PREFIX}url={url}")

    def _stop_http(self) -> None:
        """Stop accepting (in a thread: shutdown() waits for the serve loop) and answer 503 meanwhile."""
        if self.state.stopping:
            return
        self.state.stopping = True
        if self.server and self.state.serving_since is not None:
            threading.Thread(target=self.server.shutdown, daemon=True).start()

    def _shutdown(self, t_term: float) -> int:
        """vllm/v1/utils.py:shutdown: SIGTERM the engine, join up to the timeout, then kill its tree."""
        self.log.raw("INFO:     Shutting down")
        self._stop_http()
        T = self.cfg.shutdown_timeout
        self.log("INFO", "core_client.py:1", f"Shutting down engine (timeout {T} s)")
        send(self.child_fd, signal.SIGTERM)
        if T > 0:
            wait_fds([self.child_fd], t_term + T - time.monotonic())
        if not exited(self.child_fd):
            self.log("WARNING", "utils.py:1", "Engine did not exit in time: killing its process tree")
        self._kill_all()
        reap(self.child, block=True)
        return self._finish(t_term, 0)

    def _kill_all(self) -> None:
        for fd in [self.child_fd, *self.worker_fds.values()]:
            if not exited(fd):
                send(fd, signal.SIGKILL)

    def _abort(self, code: int) -> int:
        self._kill_all()
        reap(self.child, block=True)
        return code

    def _finish(self, t_term: float, code: int) -> int:
        self._stop_http()
        sleep_until(t_term + self.a.exit_delay)
        self.log.raw("INFO:     Application shutdown complete.")
        return code


# --------------------------------------------------------------------------------------------
# test helper

class FakeEngine(Tree):
    """A running fake vLLM started by ``start()``: the drill's :class:`~sparkguard.drill.tree.Tree`
    handle (Popen, output lines, pids pinned by pidfds, ``stop()``) plus what only this fake has.

    Attributes (beyond Tree's ``proc``, ``argv``, ``lines``):
        headless: bool, started with ``--headless`` (the ready line is then ``pids=<top>,<w_k>``).
    """

    def __init__(self, argv: list[str], on_line=None, **popen_kw):
        self.headless = "--headless" in argv
        super().__init__(argv, on_line=on_line, **popen_kw)

    @property
    def top_pid(self) -> int:
        return self.proc.pid

    @property
    def core_pid(self) -> int | None:
        """EngineCore's pid (None when headless); waits for readiness."""
        return None if self.headless else self.pids()[1]

    @property
    def worker_pids(self) -> list[int]:
        """Worker pids by rank; waits for readiness."""
        return self.pids()[1 if self.headless else 2:]

    @property
    def port(self) -> int | None:
        """The HTTP port (useful with ``--port 0``); waits for readiness.  None without --port."""
        self.pids()
        return parse_ready(self._ready_line).get("port")

    @property
    def url(self) -> str:
        """Base URL, e.g. ``http://127.0.0.1:41234``; waits for readiness."""
        argv = self.argv
        host = argv[argv.index("--host") + 1] if "--host" in argv else "127.0.0.1"
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self.port}"

    def wait_serving(self, timeout: float = 30.0) -> str:
        """Wait until the port listens (after --load-time); returns the serving line."""
        return self.wait_line(SERVING_PREFIX, timeout)

    def output(self) -> str:
        """All output so far, newline-joined."""
        with self._cond:
            return "\n".join(self.lines)


def start(model: str, *opts: str, on_line=None, **popen_kw) -> FakeEngine:
    """Start ``vllm serve MODEL *opts`` (the fake) and return its FakeEngine at once (not yet ready).

    Args:
        model: a model name; use a unique one per test so ``targets.match`` hits only this tree.
        opts: fake vLLM options as strings (see the module docstring).
        on_line: optional callable(str) called from the reader thread for each output line.
        popen_kw: passed to subprocess.Popen (env, cwd, ...); stdout/stderr are taken by the helper;
            ``start_new_session`` defaults to True (the tree gets its own process group).
    Raises:
        ValueError: stdout/stderr given in popen_kw.
    Use ``fe.pids()`` to wait for the tree and ``fe.stop()`` in a ``finally``.
    """
    if "stdout" in popen_kw or "stderr" in popen_kw:
        raise ValueError("start(): the helper owns stdout/stderr; use on_line= or .lines")
    return FakeEngine(command(model, *opts), on_line=on_line, **popen_kw)

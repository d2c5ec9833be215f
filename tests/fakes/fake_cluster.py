"""The fake vLLM's multi-node behaviour (``--nnodes N > 1``): rendezvous, the group's link, loss of a node.

One engine spans N nodes, each running ``vllm serve`` with the same arguments plus its
``--node-rank``; node 0 is the head (API server, EngineCore), the others run ``--headless``.
What is imitated, and where it was read (file + function of vLLM's main branch as of 2026, read
in public copies of its source: the vllm-project/vllm snapshot itself was too large to fetch here):

Local ranks.  ``vllm/v1/executor/multiproc_executor.py`` ``MultiprocExecutor._get_parallel_sizes``
asserts ``world_size % nnodes_within_dp == 0`` (world_size = TP x PP; here TP only), and
``_init_executor`` starts ``local_world_size`` workers with global ranks
``local_world_size * node_rank_within_dp + local_rank``; ``WorkerProc.setup_proc_title_and_log_prefix``
titles each ``VLLM::Worker_TP<i>`` with its rank in the (global) TP group.  So node k of N runs
``VLLM::Worker_TP<k*tp/N>`` .. ``VLLM::Worker_TP<(k+1)*tp/N - 1>``::

    head (rank 0):  vllm serve ... -> VLLM::EngineCore -> VLLM::Worker_TP0 .. TP<tp/N-1>
    headless k:     vllm serve ... --headless -> VLLM::Worker_TP<k*tp/N> .. (no EngineCore, no HTTP)

A headless node (``vllm/entrypoints/cli/serve.py`` ``run_headless``, ``node_rank_within_dp > 0``)
builds ``MultiprocExecutor(vllm_config, monitor_workers=False)`` and calls
``start_worker_monitor(inline=True)``: its top process waits on its own workers' sentinels; when
one ends it logs ``Worker proc ... died unexpectedly``, shuts the others down
(``_ensure_worker_termination``) and ``run_headless`` returns, so ``vllm serve`` exits 0.

Rendezvous.  ``vllm/distributed/parallel_state.py`` ``init_distributed_environment``: with
``nnodes > 1`` every worker calls ``torch.distributed.init_process_group`` with
``tcp://master_addr:master_port``; PyTorch's tcp:// rendezvous makes global rank 0 (the head's
``VLLM::Worker_TP0``) host the TCPStore and the others connect to it, retrying until the timeout.
Defaults from ``vllm/config/parallel.py`` ``ParallelConfig``: ``master_addr`` 127.0.0.1,
``master_port`` 29501, ``nnodes`` 1, ``node_rank`` 0, ``distributed_timeout_seconds`` None =
"PyTorch's default timeout is used (600s for NCCL)", passed to ``init_process_group``.
The fake: the head's Worker_TP0 listens on master-addr:master-port (real TCP); every other worker
(the head's own included) connects, retrying every :data:`RETRY_S` until the timeout, and sends
one JSON line ``{"rank", "node_rank", "args"}``.  The group forms when every rank 1..tp-1 has
joined; the head waits for them for at most the timeout (PyTorch's "Timed out ... waiting for
clients"), a joiner for the group likewise; either then exits 1.  A worker reports the formed
group to its node's top, which prints ``fake-vllm: group formed``; only then does the head
"load" for ``--load-time`` and its port listen.  A headless node's top prints its serving line
(``fake-vllm: serving url=none``) once ``--load-time`` has passed since forming and each of its
ranks has reported its load done (its lowest rank's ``--load-fill`` all allocated): every rank
loads its own shard before the group serves (``EngineCore.__init__`` runs the executor's load and
``_initialize_kv_caches`` on every worker, local or remote, before it reports ready).  Before that a start-up failure on a headless
node (refused, timed out: the worker exits 1) ends its top with exit 1, as
``WorkerProc.wait_for_ready`` raising does; after it, or when a worker exits 0 because its head
went away (a stale rendezvous, below), a worker that ends makes the top exit 0 (the inline monitor).

After forming, each worker's connection stands for the NCCL communicator:
    - a rank whose connection closes (its worker, or its node's top, died: each worker watches
      its parent like ``WorkerProc.monitor_death_pipe`` and exits when it is gone) is lost; the
      head's completions then hang while ``/health`` stays 200, and ``--distributed-timeout-seconds``
      after the loss the head's Worker_TP0 exits 1 as PyTorch's NCCL watchdog does on a collective
      timeout, so EngineCore dies and the top answers 503 and exits 1 (the dead-linger path);
    - a rank that stays connected but cannot be reached (a link down, a stopped process) is not
      lost: the head's completions hang while it is unreachable and go on once it is back; only
      if it stays away ``--distributed-timeout-seconds`` does the head die as above.  NCCL sends
      no heartbeat (a collective just waits), so the fake adds its own to see this without
      traffic: every rank sends one each :data:`HEARTBEAT_S`, and one silent for
      :data:`UNREACHABLE_S` is unreachable (an artefact of the fake, not vLLM's: completions in
      that first second of silence still succeed, where NCCL would stall at once);
    - a headless worker whose head's connection closes follows ``--fake-on-head-loss``:
      ``exit`` (default) exits 0, so its top exits 0 (the inline monitor); ``hang`` logs PyTorch's
      TCPStore ``recvValue failed`` warning and keeps running, never recovering (vLLM #32136).

Assumptions (nothing read says otherwise; each is a choice of this fake):
    - engine arguments that must match across nodes (:data:`MATCHED`) are compared at the
      rendezvous and a mismatching joiner is refused with an error naming the argument and
      both values, printed on both nodes; what vLLM really does with mismatched arguments is
      not known (issue 13).  A rank that has already joined is refused too (duplicate).
    - the watchdog's timer runs from the loss (or from the last heartbeat of a rank that went
      unreachable) whether or not a request is in flight (PyTorch's watchdog times out a
      collective in flight; issue 13 asks for this simpler rule).
    - head loss: the default ``exit`` is what issue 13 reports for TP with the mp backend and
      what the public multi-Spark recipes describe ("joins the stale rendezvous, exits 0 when
      the old head finally dies", FIELD-NOTES); the source shows why it is exit 0 (the inline
      monitor returns when a worker ends) but not after how long a worker notices a dead head
      (its busy loop waits on the broadcast queue with ``indefinite=True``); the fake notices at
      once.  ``hang`` is what #32136 reports for DP (``CoreEngineProcManager.monitor_engine_liveness``
      path); FIELD-NOTES' vLLM section also says "headless nodes do not exit when the head dies".
    - a node that arrives after the group formed reaches the stale rendezvous: the head keeps
      its connection without an answer (it never joins, never serves); when the old head goes
      away it acts as a headless node whose head died (FIELD-NOTES, recipes).
    - a rank that leaves before the group formed may join again (PyTorch's store keeps keys; not
      modelled); a rank refused or timed out exits 1.
    - the watchdog's abort is an exit 1 here (PyTorch aborts the process: SIGABRT).

Lines printed, unprefixed (``A:P`` is master-addr:master-port; K a node rank, R a global rank)::

    fake-vllm: rendezvous listening master=A:P world=T                head's Worker_TP0
    fake-vllm: rank joined rank=R node-rank=K joined=J/T              head's Worker_TP0
    fake-vllm: rendezvous refused rank=R node-rank=K reason=TEXT      head's Worker_TP0 and the joiner
    fake-vllm: late joiner rank=R node-rank=K                          head's Worker_TP0, group formed
    fake-vllm: group formed nnodes=N master=A:P node-rank=K           every node's top, once
    fake-vllm: rank lost rank=R node-rank=K timeout=S                  head's Worker_TP0
    fake-vllm: rank unreachable rank=R node-rank=K silent=S            head's Worker_TP0
    fake-vllm: rank reachable rank=R node-rank=K                       head's Worker_TP0, again
    fake-vllm: api group L|U|R rank=R                                  the top, once its API holds
                                                                       (L, U) or frees (R) requests for it
    fake-vllm: distributed timeout rank=0 after=S                      head's Worker_TP0, then exit 1
    fake-vllm: head lost master=A:P action=exit|hang                   a headless worker
    fake-vllm: rendezvous timeout rank=R after=S                       a worker, then exit 1

Test helpers: :func:`free_master`, :func:`node_opts`, :func:`node_command`, :func:`start_cluster`.
"""

from __future__ import annotations

import json
import os
import random
import select
import signal
import socket
import threading
import time

if __package__:
    from . import fake_vllm as fv
else:  # run by the tests/fakes/vllm launcher: fake_vllm is a top-level module there
    import fake_vllm as fv

from sparkguard.drill.hog import Memory
from sparkguard.drill.plumbing import Log, Signals, exited, fork, reap, send, sleep_until, wait_fds
from sparkguard.drill.tree import READY_PREFIX

DEFAULT_MASTER_PORT = fv.DEFAULT_MASTER_PORT
#: seconds between a joiner's connection attempts (PyTorch's TCPStore client retries until its timeout)
RETRY_S = 0.1
#: seconds between a rank's heartbeats to the head, and seconds without one after which the head
#: counts the rank unreachable (the fake's own artefact: NCCL has no heartbeat, see the docstring)
HEARTBEAT_S = 0.2
UNREACHABLE_S = 1.0
#: engine arguments every node must be started with alike (argparse dest -> vLLM flag)
MATCHED = {"model": "model", "tp": "--tensor-parallel-size", "nnodes": "--nnodes",
           "max_model_len": "--max-model-len", "max_num_seqs": "--max-num-seqs"}

P = "fake-vllm: "
LISTENING_PREFIX = P + "rendezvous listening "
JOINED_PREFIX = P + "rank joined "
REFUSED_PREFIX = P + "rendezvous refused "
LATE_PREFIX = P + "late joiner "
FORMED_PREFIX = P + "group formed "
LOST_PREFIX = P + "rank lost "
UNREACHABLE_PREFIX = P + "rank unreachable "
REACHABLE_PREFIX = P + "rank reachable "
API_GROUP_PREFIX = P + "api group "
TIMEOUT_PREFIX = P + "distributed timeout "
HEAD_LOST_PREFIX = P + "head lost "
RDZV_TIMEOUT_PREFIX = P + "rendezvous timeout "


# --------------------------------------------------------------------------------------------
# options

def check_args(parser, a) -> None:
    """Reject combinations the fake does not model (argparse ``parser.error``: exit 2)."""
    if a.tp % a.nnodes:
        parser.error(f"global world_size ({a.tp}) must be divisible by nnodes_within_dp ({a.nnodes}) "
                     "(--tensor-parallel-size must be a multiple of --nnodes)")
    if a.node_rank >= a.nnodes:
        parser.error(f"--node-rank {a.node_rank} must be below --nnodes {a.nnodes}")
    if a.node_rank > 0 and not a.headless:
        parser.error("with --nnodes > 1, node ranks above 0 run --headless")
    if a.node_rank == 0 and a.headless:
        parser.error("with --nnodes > 1, node rank 0 is the head (the fake does not model headless DP engines)")
    if not 0 < a.master_port < 65536:
        parser.error(f"--master-port must be 1..65535, got {a.master_port}")


def local_ranks(a) -> list[int]:
    """Global TP ranks run on this node: ``node_rank*tp/N .. (node_rank+1)*tp/N - 1``."""
    per = a.tp // a.nnodes
    return list(range(a.node_rank * per, (a.node_rank + 1) * per))


def engine_args(a) -> dict:
    """The arguments compared at the rendezvous (:data:`MATCHED`), by argparse dest."""
    return {k: getattr(a, k) for k in MATCHED}


def mismatch(head: dict, joiner: dict, joiner_node: int) -> str | None:
    """Text naming every argument that differs between ``head`` and ``joiner``, or None."""
    diffs = [f"{MATCHED.get(k, k)} is {head.get(k)!r} on node 0 (head) but {joiner.get(k)!r} on node {joiner_node}"
             for k in MATCHED if head.get(k) != joiner.get(k)]
    if not diffs:
        return None
    return "engine arguments differ: " + "; ".join(diffs)


def _master(a) -> str:
    return f"{a.master_addr}:{a.master_port}"


def _send(sock: socket.socket, obj: dict) -> None:
    try:
        sock.sendall((json.dumps(obj) + "\n").encode())
    except OSError:
        pass


def _parent_pidfd() -> int | None:
    """A pidfd of this process's parent, or None when the parent is already gone (reparented)."""
    ppid = os.getppid()
    try:
        fd = os.pidfd_open(ppid)
    except OSError:
        return None
    if os.getppid() != ppid:
        os.close(fd)
        return None
    return fd


# --------------------------------------------------------------------------------------------
# the worker's side: Worker_TP0 of the head hosts the rendezvous, every other worker joins it

def start_link(a, rank: int, report_fd: int, log: Log) -> None:
    """Start this worker's part of the group in a daemon thread.

    Args:
        a: the parsed options (``--nnodes`` > 1).
        rank: this worker's global TP rank; 0 hosts the rendezvous.
        report_fd: write end of the pipe to the node's top; gets ``G`` (group formed) and, from the
            head's Worker_TP0, ``L|U|R <rank> <node-rank>`` (a rank lost, unreachable, reachable
            again) lines.
        log: the worker's log.
    Raises:
        OSError: rank 0 could not bind master-addr:master-port (the worker then exits 1).
    The thread ends the process itself (``os._exit``) where vLLM's worker would die.
    """
    parent = _parent_pidfd()
    if parent is None:
        _parent_gone(log)
    if rank == 0:
        target = _Server(a, report_fd, log, parent).run
    else:
        target = _Client(a, rank, report_fd, log, parent).run

    def guarded() -> None:
        try:
            target()
        except BaseException as e:  # noqa: BLE001 - a broken link must not leave a half-alive worker
            log("ERROR", "fake_cluster.py:1", f"fake-vllm link failed: {e!r}")
            os._exit(70)

    threading.Thread(target=guarded, name="fake-rendezvous", daemon=True).start()


def _report(fd: int, line: str) -> None:
    try:
        os.write(fd, (line + "\n").encode())
    except OSError:
        pass


def _parent_gone(log: Log) -> None:
    """End this worker as vLLM's death-pipe monitor does (multiproc_executor.py monitor_death_pipe)."""
    log("INFO", "multiproc_executor.py:1", "Parent process exited, terminating worker queues")
    os._exit(0)


class _Server:
    """The head's Worker_TP0: the TCPStore host.  Admits ranks 1..tp-1, then watches them."""

    def __init__(self, a, report_fd: int, log: Log, parent: int):
        self.a, self.report_fd, self.log, self.parent = a, report_fd, log, parent
        family = socket.AF_INET6 if ":" in a.master_addr else socket.AF_INET
        self.lsock = socket.socket(family, socket.SOCK_STREAM)
        self.lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.lsock.bind((a.master_addr, a.master_port))
            self.lsock.listen(64)
        except OSError:
            self.lsock.close()
            raise
        self.world = a.tp
        self.mine = engine_args(a)
        self.pending: dict[socket.socket, bytes] = {}     # connected, hello not read yet
        self.members: dict[int, tuple[socket.socket, int]] = {}  # rank -> (sock, node rank)
        self.late: list[socket.socket] = []
        self.formed = False
        self.deadline = time.monotonic() + a.distributed_timeout_seconds
        self.seen: dict[int, float] = {}    # rank -> its last heartbeat (monotonic s), after forming
        self.down: dict[int, float] = {}    # rank -> since when it is unreachable or lost (monotonic s)
        self.unreachable: set[int] = set()
        log.raw(f"{LISTENING_PREFIX}master={_master(a)} world={self.world}")

    def run(self) -> None:
        while True:
            socks = [self.lsock, self.parent, *self.pending, *(s for s, _ in self.members.values()), *self.late]
            due = self._next_due()
            ready = select.select(socks, [], [], None if due is None else max(0.0, due - time.monotonic()))[0]
            now = time.monotonic()
            if self.parent in ready:
                _parent_gone(self.log)
            for s in ready:
                if s is self.lsock:
                    self._accept()
                elif s in self.pending:
                    self._read_hello(s)
                elif s in self.late:
                    if not _alive(s):
                        self.late.remove(s)
                        s.close()
                elif isinstance(s, socket.socket):
                    self._member_event(s, now)
            self._check(now)

    def _next_due(self) -> float | None:
        """When :meth:`_check` has work next (monotonic s): the rendezvous deadline before forming;
        after it, the next heartbeat that may be missed and the watchdog's deadline."""
        if not self.formed:
            return self.deadline
        dues = [t + UNREACHABLE_S for r, t in self.seen.items() if r not in self.unreachable]
        if self.down:
            dues.append(min(self.down.values()) + self.a.distributed_timeout_seconds)
        return min(dues) if dues else None

    def _check(self, now: float) -> None:
        """Time out the rendezvous; mark ranks without a recent heartbeat unreachable; time out a
        broken group ``--distributed-timeout-seconds`` after its first rank went down."""
        if not self.formed:
            if now >= self.deadline:
                self._time_out()
            return
        for rank, t in self.seen.items():
            if rank not in self.unreachable and now - t >= UNREACHABLE_S:
                self.unreachable.add(rank)
                self.down.setdefault(rank, t)
                node = self.members[rank][1]
                self.log.raw(f"{UNREACHABLE_PREFIX}rank={rank} node-rank={node} silent={now - t:.1f}")
                _report(self.report_fd, f"U {rank} {node}")
        if self.down and now >= min(self.down.values()) + self.a.distributed_timeout_seconds:
            self._time_out()

    def _time_out(self) -> None:
        t = self.a.distributed_timeout_seconds
        if not self.formed:
            self.log("ERROR", "parallel_state.py:1",
                     f"torch.distributed.DistStoreError: Timed out after {t:g} seconds waiting for clients. "
                     f"{len(self.members) + 1}/{self.world} clients joined.")
            self.log.raw(f"{RDZV_TIMEOUT_PREFIX}rank=0 after={t:g}")
        else:
            self.log("ERROR", "ProcessGroupNCCL.cpp:1",
                     f"[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(OpType=ALLREDUCE, "
                     f"Timeout(ms)={int(t * 1000)}) ran for {int(t * 1000)} milliseconds before timing out.")
            self.log.raw(f"{TIMEOUT_PREFIX}rank=0 after={t:g}")
        os._exit(1)

    def _accept(self) -> None:
        try:
            s, _ = self.lsock.accept()
        except OSError:
            return
        self.pending[s] = b""

    def _read_hello(self, s: socket.socket) -> None:
        try:
            data = s.recv(65536)
        except OSError:
            data = b""
        if not data:
            del self.pending[s]
            s.close()
            return
        buf = self.pending[s] + data
        if b"\n" not in buf:
            self.pending[s] = buf
            return
        del self.pending[s]
        try:
            hello = json.loads(buf.split(b"\n", 1)[0])
            rank, node, args = int(hello["rank"]), int(hello["node_rank"]), dict(hello["args"])
        except (ValueError, KeyError, TypeError):
            s.close()
            return
        if self.formed:
            self.log.raw(f"{LATE_PREFIX}rank={rank} node-rank={node}")
            self.late.append(s)  # the stale rendezvous: never answered, never admitted
            return
        reason = mismatch(self.mine, args, node)
        if reason is None and not 0 < rank < self.world:
            reason = f"rank {rank} is outside 1..{self.world - 1}"
        if reason is None and rank in self.members:
            reason = f"duplicate rank {rank}: already joined from node {self.members[rank][1]}"
        if reason is not None:
            self.log.raw(f"{REFUSED_PREFIX}rank={rank} node-rank={node} reason={reason}")
            _send(s, {"error": reason})
            s.close()
            return
        self.members[rank] = (s, node)
        self.log.raw(f"{JOINED_PREFIX}rank={rank} node-rank={node} joined={len(self.members) + 1}/{self.world}")
        if len(self.members) + 1 == self.world:
            self.formed = True
            self.seen = {r: time.monotonic() for r in self.members}
            for sock, _ in self.members.values():
                _send(sock, {"formed": True, "nnodes": self.a.nnodes, "master": _master(self.a)})
            _report(self.report_fd, "G")
        else:
            _send(s, {"joined": True})

    def _member_event(self, s: socket.socket, now: float) -> None:
        """A member's heartbeat (it is reachable, again) or its connection's end (it is lost)."""
        rank, node = next(((r, n) for r, (sock, n) in self.members.items() if sock is s), (None, None))
        if rank is None:
            return
        if _alive(s):
            if rank in self.seen:
                self.seen[rank] = now
            if rank in self.unreachable:
                self.unreachable.discard(rank)
                self.down.pop(rank, None)
                self.log.raw(f"{REACHABLE_PREFIX}rank={rank} node-rank={node}")
                _report(self.report_fd, f"R {rank} {node}")
            return
        del self.members[rank]
        s.close()
        if not self.formed:
            self.log("WARNING", "parallel_state.py:1", f"rank {rank} (node {node}) left before the group formed")
            return
        self.seen.pop(rank, None)
        self.unreachable.discard(rank)
        self.down.setdefault(rank, now)
        t = self.a.distributed_timeout_seconds
        self.log.raw(f"{LOST_PREFIX}rank={rank} node-rank={node} timeout={t:g}")
        _report(self.report_fd, f"L {rank} {node}")


def _alive(s: socket.socket) -> bool:
    """False once the peer of ``s`` has closed (EOF or an error); data it sends is dropped."""
    try:
        return bool(s.recv(4096))
    except BlockingIOError:
        return True
    except OSError:
        return False


class _Client:
    """A worker of rank > 0: joins the head's rendezvous, then holds the connection."""

    def __init__(self, a, rank: int, report_fd: int, log: Log, parent: int):
        self.a, self.rank, self.report_fd, self.log, self.parent = a, rank, report_fd, log, parent

    def run(self) -> None:
        a = self.a
        deadline = time.monotonic() + a.distributed_timeout_seconds
        sock = self._connect(deadline)
        _send(sock, {"rank": self.rank, "node_rank": a.node_rank, "args": engine_args(a)})
        buf = b""
        formed = False
        beat = time.monotonic() + HEARTBEAT_S
        while True:
            due = beat if formed else min(beat, deadline)
            ready = select.select([sock, self.parent], [], [], max(0.0, due - time.monotonic()))[0]
            if self.parent in ready:
                _parent_gone(self.log)
            now = time.monotonic()
            if not formed and now >= deadline:
                self._timed_out()
            if now >= beat:
                beat = now + HEARTBEAT_S
                try:
                    sock.send(b"\n")
                except OSError:
                    return self._head_lost(sock)
            if sock not in ready:
                continue
            try:
                data = sock.recv(65536)
            except OSError:
                data = b""
            if not data:
                return self._head_lost(sock)
            buf += data
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                msg = json.loads(line)
                if "error" in msg:
                    self.log.raw(f"{REFUSED_PREFIX}rank={self.rank} node-rank={a.node_rank} reason={msg['error']}")
                    self.log("ERROR", "multiproc_executor.py:1", "WorkerProc failed to start.")
                    os._exit(1)
                if msg.get("formed") and not formed:
                    formed = True
                    _report(self.report_fd, "G")

    def _connect(self, deadline: float) -> socket.socket:
        a = self.a
        while True:
            if wait_fds([self.parent], 0):
                _parent_gone(self.log)
            try:
                sock = socket.create_connection((a.master_addr, a.master_port),
                                                timeout=max(0.1, deadline - time.monotonic()))
                sock.settimeout(None)
                return sock
            except OSError:
                if time.monotonic() + RETRY_S >= deadline:
                    self._timed_out()
                wait_fds([self.parent], RETRY_S)  # a refused connect has no event to wait on: retry

    def _timed_out(self) -> None:
        t = self.a.distributed_timeout_seconds
        self.log("ERROR", "parallel_state.py:1",
                 f"torch.distributed.DistNetworkError: The client socket has timed out after {t:g}s while trying "
                 f"to connect to ({self.a.master_addr}, {self.a.master_port}).")
        self.log.raw(f"{RDZV_TIMEOUT_PREFIX}rank={self.rank} after={t:g}")
        os._exit(1)

    def _head_lost(self, sock: socket.socket) -> None:
        a = self.a
        sock.close()
        self.log("WARNING", "TCPStore.cpp:125",
                 f"[rank{self.rank}] [c10d] recvValue failed on SocketImpl(remote={_master(a)}): Failed to recv, "
                 "got 0 bytes. Connection was likely closed. Did the remote server shutdown or crash?")
        self.log.raw(f"{HEAD_LOST_PREFIX}master={_master(a)} action={a.fake_on_head_loss}")
        if a.fake_on_head_loss == "exit":
            os._exit(0)
        # hang: keep running without the group, never recovering (vLLM #32136); only the parent is watched
        wait_fds([self.parent], None)
        _parent_gone(self.log)


# --------------------------------------------------------------------------------------------
# the headless node's top: vllm serve --headless -> its workers (run_headless's inline monitor)

def headless_main(cfg) -> int:
    """Top of a headless node of ``--nnodes`` > 1; returns the exit status (see the module docstring)."""
    return _HeadlessTop(cfg).run()


class _HeadlessTop:
    """A headless node's ``vllm serve``: forks this node's workers, prints the ready, formed and
    serving lines, and ends with its first worker to end (run_headless's inline monitor)."""

    def __init__(self, cfg):
        self.cfg, self.a = cfg, cfg.args
        self.log = Log("")
        self.where = "serve.py:1"
        self.sigs = Signals(cfg.ignore_term)
        self.ranks = local_ranks(self.a)
        self.workers: dict[int, tuple[int, int]] = {}  # pid -> (rank, pidfd)
        self.reported: dict[int, int] = {}             # rank -> pid, from the W lines
        self.loaded: set[int] = set()                  # ranks whose load is done, from the D lines
        self.formed = False
        self.announced = False  # the ready line is out: the formed line follows it
        self.buf = b""

    def run(self) -> int:
        a = self.a
        self.log("INFO", self.where, f"Launching vLLM (v{fv.VLLM_VERSION}) headless multiproc executor, with head "
                 f"node address {_master(a)} for torch.distributed process group.")
        if a.port is not None:
            self.log("WARNING", self.where, "--headless: no API server, --port ignored")
        ready_r, ready_w = os.pipe()
        self.cmd_ws: list[int] = []  # one command pipe per worker: "S" = serving started
        first = self.ranks[0]
        for r in self.ranks:
            cmd_r, cmd_w = os.pipe()
            keep_out = [ready_r, *self.cmd_ws, cmd_w, *self.sigs.fds(), *self._fds()]
            pid = fork(lambda r=r, c=cmd_r: fv._worker_main(self.cfg, r, r == first and a.fill_size is not None,
                                                            ready_w, c), keep_out)
            os.close(cmd_r)
            self.cmd_ws.append(cmd_w)
            self.workers[pid] = (r, os.pidfd_open(pid))
        os.close(ready_w)
        mem = Memory()
        mem.add(a.hold_api)

        # 1. bring-up: every worker titled and holding memory
        deadline = time.monotonic() + a.ready_timeout
        while set(self.reported) != set(self.ranks):
            ready = wait_fds([ready_r, self.sigs.rfd, *self._fds()], deadline - time.monotonic())
            now = time.monotonic()
            if self.sigs.rfd in ready and self._term_requested():
                return self._shutdown(now)
            if ready_r in ready and not self._feed(ready_r):
                # every worker has closed its end, so they are ending: judge by the first to end
                ready = wait_fds(self._fds(), 10.0)
                if not ready:
                    self.log("ERROR", self.where, "engine processes exited during start-up")
                    return self._abort(1)
            died = self._dead_worker(ready)
            if died is not None:
                return self._worker_ended(*died)
            if now >= deadline:
                self.log("ERROR", self.where, f"workers did not come up within {a.ready_timeout} s")
                return self._abort(1)
        line = READY_PREFIX + "pids=" + ",".join(map(str, [os.getpid()] + [self.reported[r] for r in self.ranks]))
        if a.ready_file:
            fv._write_ready_file(a.ready_file, line)
        self.log.raw(line)
        self.announced = True
        if self.formed:
            self._announce_formed()

        # 2. the group forms, "load", then the inline worker monitor
        load_done = None
        serving = False
        watch_ready = True
        while True:
            now = time.monotonic()
            if self.formed and load_done is None:
                load_done = now + a.load_time
            if load_done is not None and not serving and now >= load_done and self.loaded >= set(self.ranks):
                serving = True
                for fd in self.cmd_ws:
                    try:
                        os.write(fd, b"S\n")
                    except OSError:
                        pass
                self.log.raw(f"{fv.SERVING_PREFIX}url=none")
            # until then: wake at the end of the load time; past it, at the last rank's D line
            timeout = load_done - now if load_done is not None and not serving and now < load_done else None
            ready = wait_fds([self.sigs.rfd, *([ready_r] if watch_ready else []), *self._fds()], timeout)
            now = time.monotonic()
            if self.sigs.rfd in ready and self._term_requested():
                return self._shutdown(now)
            if watch_ready and ready_r in ready and not self._feed(ready_r):
                watch_ready = False
                os.close(ready_r)
            died = self._dead_worker(ready)
            if died is not None:
                return self._worker_ended(*died)

    def _worker_ended(self, rank: int, code: int | None) -> int:
        """A worker ended: kill the others; the top's exit status.

        Before the group formed, a worker that failed (non-zero) is a start-up failure: 1.  Otherwise,
        and for a worker that exited 0 because its head went away (a stale rendezvous), the inline
        monitor returns: 0.
        """
        if not self.formed and code != 0:
            self.log("ERROR", "multiproc_executor.py:1", "WorkerProc initialization failed due to an "
                     "exception in a background process. See stack trace for root cause.")
            return self._abort(1)
        self.log("ERROR", "multiproc_executor.py:1", f"Worker proc VLLM::Worker_TP{rank} died unexpectedly "
                 f"(exit code: {code}), shutting down executor.")
        self._abort(0)
        self.log("INFO", self.where, "Shutting down.")
        return 0

    def _fds(self) -> list[int]:
        return [fd for _, fd in self.workers.values()]

    def _term_requested(self) -> bool:
        return any(s in (signal.SIGTERM, signal.SIGINT) for s in self.sigs.read()) and not self.cfg.ignore_term

    def _feed(self, ready_r: int) -> bool:
        """Read the workers' report lines (``W rank pid``, ``D rank``: its load is done, ``G``);
        False at EOF."""
        data = os.read(ready_r, 4096)
        self.buf += data
        while b"\n" in self.buf:
            line, self.buf = self.buf.split(b"\n", 1)
            parts = line.decode().split()
            if parts and parts[0] == "W":
                self.reported[int(parts[1])] = int(parts[2])
            elif parts and parts[0] == "D":
                self.loaded.add(int(parts[1]))
            elif parts and parts[0] == "G" and not self.formed:
                self.formed = True
                if self.announced:
                    self._announce_formed()
        return bool(data)

    def _announce_formed(self) -> None:
        self.log.raw(f"{FORMED_PREFIX}nnodes={self.a.nnodes} master={_master(self.a)} node-rank={self.a.node_rank}")

    def _dead_worker(self, ready: list[int]) -> tuple[int, int | None] | None:
        """The first worker of ``ready`` that has exited, reaped: ``(rank, exit code)``; else None."""
        for pid, (rank, fd) in list(self.workers.items()):
            if fd in ready:
                code = reap(pid, block=True)
                os.close(fd)
                del self.workers[pid]
                return rank, code
        return None

    def _abort(self, code: int) -> int:
        for _, fd in self.workers.values():
            send(fd, signal.SIGKILL)
        for pid in self.workers:
            reap(pid, block=True)
        return code

    def _shutdown(self, t_term: float) -> int:
        """SIGTERM the workers, wait up to the shutdown timeout, SIGKILL what is left, exit 0."""
        T = self.cfg.shutdown_timeout
        self.log("INFO", self.where, f"Waiting up to {T:g} seconds for processes to exit")
        for _, fd in self.workers.values():
            send(fd, signal.SIGTERM)
        end = t_term + T
        while True:
            left = [fd for fd in self._fds() if not exited(fd)]
            if not left or time.monotonic() >= end:
                break
            wait_fds(left[:1], end - time.monotonic())
        self._abort(0)
        sleep_until(t_term + self.a.exit_delay)
        self.log("INFO", self.where, "Shutting down.")
        return 0


# --------------------------------------------------------------------------------------------
# test helpers

def free_master() -> tuple[str, int]:
    """A loopback rendezvous address for one test cluster: a random 127.x.y.z and vLLM's port 29501.

    Any 127/8 address reaches this host, so clusters of parallel tests do not share a port;
    the address is checked by binding it once.
    Raises:
        OSError: no free address found in 20 tries.
    """
    for _ in range(20):
        addr = f"127.{random.randint(1, 254)}.{random.randint(0, 255)}.{random.randint(1, 254)}"
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            s.bind((addr, DEFAULT_MASTER_PORT))
            return addr, DEFAULT_MASTER_PORT
        except OSError:
            continue
        finally:
            s.close()
    raise OSError("free_master(): no free 127.x.y.z:29501 found")


def node_opts(n: int, tp: int, k: int, master: tuple[str, int], *opts: str) -> list[str]:
    """The fake's options for node ``k`` of an ``n``-node TP=``tp`` engine at ``master`` (addr, port).

    Node 0 gets ``--node-rank 0``; others ``--node-rank k --headless``; ``opts`` follow.
    """
    base = ["--tensor-parallel-size", str(tp), "--nnodes", str(n), "--node-rank", str(k),
            "--master-addr", master[0], "--master-port", str(master[1])]
    return base + (["--headless"] if k else []) + [str(o) for o in opts]


def node_command(model: str, n: int, tp: int, k: int, master: tuple[str, int], *opts: str) -> list[str]:
    """argv of node ``k`` (see :func:`node_opts`): ``fake_vllm.command(model, *node_opts(...))``."""
    return fv.command(model, *node_opts(n, tp, k, master, *opts))


def start_cluster(n: int, tp: int, *opts: str, model: str, master: tuple[str, int] | None = None,
                  per_node: dict[int, tuple[str, ...]] | None = None, order: list[int] | None = None,
                  **popen_kw) -> list["fv.FakeEngine"]:
    """Start an ``n``-node TP=``tp`` cluster of fakes on loopback; returns the engines by node rank.

    Args:
        n, tp: nodes and tensor-parallel size (``tp % n == 0``).
        opts: options every node gets (``--hold 8MiB``, ``--distributed-timeout-seconds 2``, ...);
            the head also gets ``--port 0`` unless ``--port`` is among them or its ``per_node`` options.
        model: the model name (unique per test).
        master: rendezvous (addr, port); default :func:`free_master`.
        per_node: extra options by node rank, after ``opts``.
        order: node ranks in start order; default workers first, head last (as the recipes do).
        popen_kw: passed to each ``fake_vllm.start``.
    Returns:
        ``[head, node1, ...]``; each FakeEngine has ``node_rank`` and ``master`` attributes.
        Started at once, not waited for: use ``wait_line(FORMED_PREFIX)``, ``wait_serving()``,
        and ``stop()`` each in a ``finally``.
    """
    master = master or free_master()
    per_node = per_node or {}
    order = list(range(1, n)) + [0] if order is None else order
    engines: dict[int, fv.FakeEngine] = {}
    try:
        for k in order:
            extra = list(opts) + list(per_node.get(k, ()))
            if k == 0 and "--port" not in extra:
                extra += ["--port", "0"]
            fe = fv.start(model, *node_opts(n, tp, k, master, *extra), **popen_kw)
            fe.node_rank, fe.master, fe.model = k, master, model
            engines[k] = fe
    except BaseException:
        for fe in engines.values():
            fe.stop()
        raise
    return [engines[k] for k in sorted(engines)]

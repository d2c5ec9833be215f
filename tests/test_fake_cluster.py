"""The fake vLLM across nodes (``--nnodes``): rendezvous, forming, loss of a rank or of the head.

Real processes on loopback: each cluster gets its own 127.x.y.z:29501 rendezvous
(``fake_cluster.free_master``), every node a real ``vllm serve`` tree; every test stops all of its
trees (SIGKILL by pidfd) in the fixture's ``finally``.  Timeouts are short (1-2 s) and load times
0.3-0.5 s so that the file runs in well under a minute.
"""

from __future__ import annotations

import http.client
import json
import os
import random
import shutil
import signal
import subprocess
import threading
import time
import uuid

import pytest

from conftest import fake_vllm
from fakes import fake_cluster as fc
from sparkguard.drill.hog import FILL_PREFIX

SMALL = ("--hold", "4MiB", "--hold-core", "4MiB", "--hold-api", "4MiB")


class Stamps:
    """Output lines of several trees with the monotonic time each was read (an ``on_line`` callback)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.seen: list[tuple[float, str]] = []

    def __call__(self, line: str) -> None:
        with self.lock:
            self.seen.append((time.monotonic(), line))

    def first(self, *parts: str) -> float:
        with self.lock:
            return next(t for t, line in self.seen if all(p in line for p in parts))


@pytest.fixture
def nodes():
    """``nodes.start(n, tp, k, *opts)`` starts node k (own master per test, shared model name);
    ``nodes.cluster(n, tp, *opts, **kw)`` starts a whole cluster; every tree is stopped afterwards."""

    class Nodes:
        def __init__(self):
            self.started: list[fake_vllm.FakeEngine] = []
            self.model = f"fake-cluster-{uuid.uuid4().hex[:10]}"
            self.master = fc.free_master()
            self.stamps = Stamps()

        def start(self, n: int, tp: int, k: int, *opts: str) -> fake_vllm.FakeEngine:
            extra = list(SMALL) + list(opts) + (["--port", "0"] if k == 0 else [])
            fe = fake_vllm.start(self.model, *fc.node_opts(n, tp, k, self.master, *extra), on_line=self.stamps)
            fe.node_rank, fe.model = k, self.model
            self.started.append(fe)
            return fe

        def cluster(self, n: int, tp: int, *opts: str, **kw) -> list[fake_vllm.FakeEngine]:
            got = fc.start_cluster(n, tp, *SMALL, *opts, model=self.model, master=self.master,
                                   on_line=self.stamps, **kw)
            self.started.extend(got)
            return got

    ns = Nodes()
    try:
        yield ns
    finally:
        for fe in ns.started:
            fe.stop()


def status(fe: fake_vllm.FakeEngine, path: str = "/health", timeout: float = 5.0) -> int:
    c = http.client.HTTPConnection("127.0.0.1", fe.port, timeout=timeout)
    try:
        c.request("GET", path)
        return c.getresponse().status
    finally:
        c.close()


def complete(fe: fake_vllm.FakeEngine, timeout: float) -> int:
    """POST one completion; its HTTP status.  Raises TimeoutError when it hangs past ``timeout``."""
    c = http.client.HTTPConnection("127.0.0.1", fe.port, timeout=timeout)
    try:
        body = json.dumps({"model": fe.model, "prompt": "hello", "max_tokens": 1})
        c.request("POST", "/v1/completions", body, {"content-type": "application/json"})
        return c.getresponse().status
    finally:
        c.close()


def comm(pid: int) -> str:
    with open(f"/proc/{pid}/comm") as f:
        return f.read().rstrip("\n")


def cmdline(pid: int) -> list[str]:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return [a.decode() for a in f.read().split(b"\0") if a]


def ppid(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def formed_lines(fe: fake_vllm.FakeEngine) -> list[str]:
    with fe._cond:
        return [line for line in fe.lines if line.startswith(fc.FORMED_PREFIX)]


# --------------------------------------------------------------------------------------------
# forming

def test_two_nodes_workers_first_head_serves_only_after_forming_and_load(nodes):
    worker = nodes.start(2, 2, 1)
    worker.pids()
    assert not formed_lines(worker)  # no head yet: it keeps retrying
    head = nodes.start(2, 2, 0, "--load-time", "0.5")
    for fe in (head, worker):
        line = fe.wait_line(fc.FORMED_PREFIX, 10)
        assert line == f"{fc.FORMED_PREFIX}nnodes=2 master={nodes.master[0]}:29501 node-rank={fe.node_rank}"
    head.wait_serving(10)
    formed_at = nodes.stamps.first(fc.FORMED_PREFIX, "node-rank=0")
    serving_at = nodes.stamps.first(fake_vllm.SERVING_PREFIX, "http://")
    assert serving_at - formed_at >= 0.45
    assert status(head) == 200 and complete(head, 5) == 200
    assert worker.proc.poll() is None


@pytest.mark.parametrize("order", [[0, 1, 2, 3], [2, 0, 3, 1]], ids=["head-first", "mixed"])
def test_four_nodes_form_only_when_the_last_rank_joins(nodes, order):
    fes = {}
    for k in order[:-1]:
        fes[k] = nodes.start(4, 4, k)
    head = fes[0]
    for k in order[:-1]:
        if k:
            head.wait_line(f"{fc.JOINED_PREFIX}rank={k} node-rank={k} ", 10)
    head.wait_line(f"{fc.JOINED_PREFIX}rank=", 10)
    head.wait_line("joined=3/4", 10)
    assert not any(formed_lines(fe) for fe in fes.values())
    with pytest.raises(ConnectionRefusedError):
        status(head)  # not formed: the port does not listen yet
    fes[order[-1]] = nodes.start(4, 4, order[-1])
    for fe in fes.values():
        fe.wait_line(fc.FORMED_PREFIX + "nnodes=4 ", 10)
    head.wait_serving(10)
    assert complete(head, 5) == 200


def test_titles_and_tree_of_head_and_headless_with_two_ranks_each(nodes):
    head, worker = nodes.cluster(2, 4)
    top, core, w0, w1 = head.pids()
    assert cmdline(top)[1:4] == [fake_vllm.script_path(), "serve", nodes.model]
    assert comm(core) == "VLLM::EngineCor" and cmdline(core) == ["VLLM::EngineCore"]
    assert [cmdline(w) for w in (w0, w1)] == [["VLLM::Worker_TP0"], ["VLLM::Worker_TP1"]]
    assert ppid(core) == top and ppid(w0) == core and ppid(w1) == core
    wtop, w2, w3 = worker.pids()
    assert cmdline(wtop)[1:5] == [fake_vllm.script_path(), "serve", nodes.model, "--tensor-parallel-size"]
    assert "--headless" in cmdline(wtop)
    assert [cmdline(w) for w in (w2, w3)] == [["VLLM::Worker_TP2"], ["VLLM::Worker_TP3"]]
    assert comm(w2) == "VLLM::Worker_TP" and ppid(w2) == wtop and ppid(w3) == wtop
    assert worker.worker_pids == [w2, w3] and head.worker_pids == [w0, w1]
    head.wait_line("joined=4/4", 10)
    joined = {line.split()[3:5][0] + " " + line.split()[4] for line in head.output().splitlines()
              if line.startswith(fc.JOINED_PREFIX)}
    assert joined == {"rank=1 node-rank=0", "rank=2 node-rank=1", "rank=3 node-rank=1"}
    head.wait_serving(10)


# --------------------------------------------------------------------------------------------
# refused at the rendezvous

def test_mismatched_max_model_len_is_refused_on_both_sides(nodes):
    head = nodes.start(2, 2, 0, "--max-model-len", "4096")
    bad = nodes.start(2, 2, 1, "--max-model-len", "8192")
    reason = "engine arguments differ: --max-model-len is 4096 on node 0 (head) but 8192 on node 1"
    assert head.wait_line(fc.REFUSED_PREFIX, 10) == f"{fc.REFUSED_PREFIX}rank=1 node-rank=1 reason={reason}"
    assert bad.wait_line(fc.REFUSED_PREFIX, 10) == f"{fc.REFUSED_PREFIX}rank=1 node-rank=1 reason={reason}"
    assert bad.proc.wait(10) == 1
    assert not formed_lines(head) and head.proc.poll() is None
    good = nodes.start(2, 2, 1, "--max-model-len", "4096")  # the head still waits for a matching rank
    good.wait_line(fc.FORMED_PREFIX, 10)
    head.wait_serving(10)
    assert status(head, "/v1/models") == 200


def test_duplicate_rank_is_refused(nodes):
    head = nodes.start(3, 3, 0)
    first = nodes.start(3, 3, 1)
    head.wait_line(f"{fc.JOINED_PREFIX}rank=1 node-rank=1 joined=2/3", 10)
    dup = nodes.start(3, 3, 1)
    line = dup.wait_line(fc.REFUSED_PREFIX, 10)
    assert "duplicate rank 1: already joined from node 1" in line
    assert dup.proc.wait(10) == 1
    nodes.start(3, 3, 2).wait_line(fc.FORMED_PREFIX, 10)
    first.wait_line(fc.FORMED_PREFIX, 10)
    head.wait_serving(10)


def test_rendezvous_times_out_on_both_sides(nodes):
    lonely = nodes.start(2, 2, 1, "--distributed-timeout-seconds", "0.5")
    assert lonely.proc.wait(10) == 1
    assert f"{fc.RDZV_TIMEOUT_PREFIX}rank=1 after=0.5" in lonely.output()
    head = nodes.start(2, 2, 0, "--distributed-timeout-seconds", "0.5")
    assert head.proc.wait(10) == 1
    assert f"{fc.RDZV_TIMEOUT_PREFIX}rank=0 after=0.5" in head.output()


def test_bad_cluster_options_are_clear_errors():
    for opts, text in [(["--tp", "3", "--nnodes", "2"], "must be divisible by nnodes_within_dp"),
                       (["--nnodes", "2", "--node-rank", "2", "--headless"], "must be below --nnodes 2"),
                       (["--nnodes", "2", "--node-rank", "1"], "node ranks above 0 run --headless")]:
        r = subprocess.run(fake_vllm.command("m", *opts), capture_output=True, text=True, timeout=30)
        assert r.returncode == 2 and text in r.stderr, (opts, r.stderr)


# --------------------------------------------------------------------------------------------
# after forming: a lost rank, a lost head, a late joiner

def test_headless_worker_killed_head_hangs_until_the_distributed_timeout(nodes):
    head, worker = nodes.cluster(2, 2, "--distributed-timeout-seconds", "1.5")
    head.wait_serving(10)
    os.kill(worker.worker_pids[0], signal.SIGKILL)
    assert worker.proc.wait(10) == 0  # run_headless's inline monitor returns: vllm serve exits 0
    head.wait_line(f"{fc.LOST_PREFIX}rank=1 node-rank=1 timeout=1.5", 10)
    lost_at = time.monotonic()
    assert status(head) == 200
    with pytest.raises(TimeoutError):
        complete(head, 0.4)
    head.wait_line("Engine core proc EngineCore died unexpectedly", 10)
    assert time.monotonic() - lost_at >= 1.0
    assert status(head) == 503
    assert head.proc.wait(10) == 1


def test_headless_top_killed_its_workers_exit_and_the_head_notices(nodes):
    head, worker = nodes.cluster(2, 4, "--distributed-timeout-seconds", "1")
    head.wait_serving(10)
    w2, w3 = worker.worker_pids
    os.kill(worker.top_pid, signal.SIGKILL)  # the workers watch their parent (vLLM's death pipe)
    assert worker.wait_gone([w2, w3], 10)
    head.wait_line(fc.LOST_PREFIX + "rank=", 10)
    assert head.proc.wait(10) == 1


@pytest.mark.parametrize("how", ["kill", "term"])
def test_head_gone_headless_exits_0(nodes, how):
    head, worker = nodes.cluster(2, 2)
    head.wait_serving(10)
    if how == "kill":
        head.stop()  # the whole head tree, SIGKILL
    else:
        os.kill(head.top_pid, signal.SIGTERM)
        assert head.proc.wait(10) == 0
    assert worker.wait_line(fc.HEAD_LOST_PREFIX, 10) == f"{fc.HEAD_LOST_PREFIX}master={nodes.master[0]}:29501 action=exit"
    assert worker.proc.wait(10) == 0


def test_head_gone_headless_hangs_with_the_flag_and_never_rejoins(nodes):
    head, worker = nodes.cluster(2, 2, per_node={1: ("--fake-on-head-loss", "hang")})
    head.wait_serving(10)
    head.stop()
    worker.wait_line(f"{fc.HEAD_LOST_PREFIX}master={nodes.master[0]}:29501 action=hang", 10)
    new_head = nodes.start(2, 2, 0, "--distributed-timeout-seconds", "1")
    assert new_head.proc.wait(10) == 1  # the old rank never joins the new head
    assert fc.JOINED_PREFIX not in new_head.output()
    assert worker.proc.poll() is None and not worker.exited(worker.worker_pids[0])


def test_late_joiner_reaches_the_stale_rendezvous_never_serves_and_exits_with_the_old_head(nodes):
    head, worker = nodes.cluster(2, 2)
    head.wait_serving(10)
    late = nodes.start(2, 2, 1)
    head.wait_line(f"{fc.LATE_PREFIX}rank=1 node-rank=1", 10)
    late.pids()  # its tree is up: what follows is about the group, not its start-up
    assert complete(head, 5) == 200  # the formed group is untouched
    assert not formed_lines(late)
    head.stop()
    for fe in (worker, late):
        fe.wait_line(fc.HEAD_LOST_PREFIX, 10)
        assert fe.proc.wait(10) == 0, fe.output()
    assert not formed_lines(late)


def test_sigterm_headless_node_shuts_down_and_fill_works_on_a_headless_node(nodes):
    head, worker = nodes.cluster(2, 4, per_node={1: ("--fill-size", "8MiB", "--fill-rate", "max", "--fill-on-signal")})
    worker.wait_line(fc.FORMED_PREFIX, 10)
    worker.start_fill()  # the node's lowest rank, Worker_TP2
    assert f"pid={worker.worker_pids[0]} " in worker.wait_line("fake-vllm: fill ", 10)
    os.kill(worker.top_pid, signal.SIGTERM)
    assert worker.proc.wait(10) == 0
    head.wait_line(fc.LOST_PREFIX + "rank=", 10)


def test_a_headless_node_serves_only_once_its_ranks_have_loaded(nodes):
    """``--load-fill`` on a headless node: its lowest rank allocates the fill over 0.8 x
    ``--load-time`` from its start.  Held up mid-load (SIGSTOP) that rank keeps the node's
    serving line back past ``--load-time`` after forming; let go (SIGCONT) it finishes its fill,
    and only then does the line come."""
    load = 8.0
    head, worker = nodes.cluster(2, 2, per_node={1: ("--load-fill", "64MiB", "--load-time", str(load))})
    rank = worker.worker_pids[0]
    worker.wait_line(fc.FORMED_PREFIX, 10)
    os.kill(rank, signal.SIGSTOP)
    try:
        if any(ln.startswith(FILL_PREFIX) and ln.endswith(" done") for ln in worker.output().splitlines()):
            pytest.skip("the fill was done before the rank could be stopped (a slow host)")
        formed_at = nodes.stamps.first(fc.FORMED_PREFIX, "node-rank=1")
        with pytest.raises(TimeoutError):
            worker.wait_line(fake_vllm.SERVING_PREFIX, formed_at + load + 1.0 - time.monotonic())
    finally:
        os.kill(rank, signal.SIGCONT)
    worker.wait_line(fake_vllm.SERVING_PREFIX, 10)
    filled = nodes.stamps.first(FILL_PREFIX, f"pid={rank} ", " done")
    assert filled <= nodes.stamps.first(fake_vllm.SERVING_PREFIX, "url=none"), worker.output()


# --------------------------------------------------------------------------------------------
# a rank that cannot be reached is not lost

class Completion(threading.Thread):
    """One completion in a thread: ``result`` is its HTTP status or the exception it raised."""

    def __init__(self, fe: fake_vllm.FakeEngine, timeout: float):
        super().__init__(daemon=True)
        self.fe, self.timeout, self.result = fe, timeout, None
        self.start()

    def run(self) -> None:
        try:
            self.result = complete(self.fe, self.timeout)
        except Exception as e:  # noqa: BLE001 - reported to the test
            self.result = e


def test_unreachable_rank_hangs_completions_until_it_is_back(nodes):
    head, worker = nodes.cluster(2, 2, "--distributed-timeout-seconds", "20")
    head.wait_serving(10)
    w1 = worker.worker_pids[0]
    os.kill(w1, signal.SIGSTOP)  # connected, silent: like a link that is down
    try:
        line = head.wait_line(f"{fc.UNREACHABLE_PREFIX}rank=1 node-rank=1 ", 10)
        assert float(line.rsplit("silent=", 1)[1]) >= fc.UNREACHABLE_S
        head.wait_line(f"{fc.API_GROUP_PREFIX}U rank=1", 10)      # the API server has the report
        assert status(head) == 200
        req = Completion(head, 15)
        req.join(0.5)
        assert req.is_alive()  # hangs while the rank is away
    finally:
        os.kill(w1, signal.SIGCONT)
    head.wait_line(f"{fc.REACHABLE_PREFIX}rank=1 node-rank=1", 10)
    req.join(10)
    assert req.result == 200
    assert complete(head, 5) == 200 and head.proc.poll() is None and worker.proc.poll() is None


def test_unreachable_past_the_timeout_ends_the_head_then_the_returning_rank(nodes):
    head, worker = nodes.cluster(2, 2, "--distributed-timeout-seconds", "1.5")
    head.wait_serving(10)
    w1 = worker.worker_pids[0]
    os.kill(w1, signal.SIGSTOP)
    try:
        head.wait_line(f"{fc.TIMEOUT_PREFIX}rank=0 after=1.5", 10)
        assert head.proc.wait(10) == 1
    finally:
        os.kill(w1, signal.SIGCONT)
    worker.wait_line(fc.HEAD_LOST_PREFIX, 10)  # its next heartbeat meets the closed connection
    assert worker.proc.wait(10) == 0


def test_head_top_killed_alone_leaves_the_group_to_its_orphans(nodes):
    head, worker = nodes.cluster(2, 2)
    head.wait_serving(10)
    top, core, w0 = head.pids()
    os.kill(top, signal.SIGKILL)  # EngineCore and Worker_TP0 (the rendezvous host) stay, reparented
    assert head.proc.wait(10) == -signal.SIGKILL
    assert not head.exited(core) and not head.exited(w0)
    assert worker.proc.poll() is None and fc.HEAD_LOST_PREFIX not in worker.output()
    head.stop()  # the orphans too: only now is the head gone for its ranks
    worker.wait_line(fc.HEAD_LOST_PREFIX, 10)
    assert worker.proc.wait(10) == 0


class Link:
    """A network namespace ``ns`` joined to this one by a veth pair: ``host_ip`` here, ``ns_ip`` there."""

    def __init__(self):
        tag = uuid.uuid4().hex[:8]
        self.ns, self.here, self.there = f"sgfake-{tag}", f"sgh{tag}", f"sgn{tag}"
        net = f"10.{random.randint(200, 250)}.{random.randint(0, 255)}.{4 * random.randint(1, 62)}"
        base = net.rsplit(".", 1)
        self.host_ip = f"{base[0]}.{int(base[1]) + 1}"
        self.ns_ip = f"{base[0]}.{int(base[1]) + 2}"
        self.made: list[str] = []
        self._ip("netns", "add", self.ns)
        self.made.append("netns")
        self._ip("link", "add", self.here, "type", "veth", "peer", "name", self.there, "netns", self.ns)
        self.made.append("veth")
        self._ip("addr", "add", f"{self.host_ip}/30", "dev", self.here)
        self._ip("link", "set", self.here, "up")
        self._ip("-n", self.ns, "addr", "add", f"{self.ns_ip}/30", "dev", self.there)
        self._ip("-n", self.ns, "link", "set", self.there, "up")
        self._ip("-n", self.ns, "link", "set", "lo", "up")

    @staticmethod
    def _ip(*args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)

    def set(self, state: str) -> None:
        """``down`` or ``up`` the namespace's end: the TCP connections across it stay, silent."""
        self._ip("-n", self.ns, "link", "set", self.there, state)

    def close(self) -> None:
        if "veth" in self.made:
            subprocess.run(["ip", "link", "del", self.here], capture_output=True, timeout=30)
        if "netns" in self.made:
            subprocess.run(["ip", "netns", "del", self.ns], capture_output=True, timeout=30)


@pytest.fixture
def link():
    if os.geteuid() != 0 or not shutil.which("ip"):
        pytest.skip("needs root and iproute2 (a network namespace)")
    made = None
    try:
        made = Link()
        yield made
    finally:
        if made is not None:
            made.close()
            assert made.ns not in os.listdir("/var/run/netns")


def test_link_down_makes_the_rank_unreachable_and_up_brings_the_group_back(link, nodes):
    master = (link.host_ip, fc.DEFAULT_MASTER_PORT)
    opts = [*SMALL, "--distributed-timeout-seconds", "30"]
    worker = fake_vllm.FakeEngine(["ip", "netns", "exec", link.ns,
                                   *fc.node_command(nodes.model, 2, 2, 1, master, *opts)], on_line=nodes.stamps)
    nodes.started.append(worker)
    head = fake_vllm.start(nodes.model, *fc.node_opts(2, 2, 0, master, *opts, "--port", "0"))
    head.model = nodes.model
    nodes.started.append(head)
    head.wait_serving(10)
    assert worker.wait_line(fc.FORMED_PREFIX, 10).endswith("node-rank=1")
    link.set("down")
    try:
        head.wait_line(f"{fc.UNREACHABLE_PREFIX}rank=1 node-rank=1 ", 10)
        assert status(head) == 200
        req = Completion(head, 20)
        req.join(0.5)
        assert req.is_alive()
    finally:
        link.set("up")
    head.wait_line(f"{fc.REACHABLE_PREFIX}rank=1 node-rank=1", 15)  # TCP retransmits once the link is back
    req.join(10)
    assert req.result == 200
    assert worker.proc.poll() is None and head.proc.poll() is None


def test_underscore_spellings_of_the_flags_are_vllms_too(nodes):
    m = nodes.master
    opts = [*SMALL, "--tensor_parallel_size=2", "--nnodes", "2", f"--master_addr={m[0]}", "--master_port", str(m[1])]
    worker = fake_vllm.start(nodes.model, *opts, "--node_rank", "1", "--headless")
    head = fake_vllm.start(nodes.model, *opts, "--node_rank=0", "--port", "0")
    nodes.started += [worker, head]
    for fe in (head, worker):
        fe.wait_line(fc.FORMED_PREFIX + "nnodes=2 ", 10)


def test_crash_mode_on_the_head_ends_the_head_then_its_ranks(nodes):
    head, worker = nodes.cluster(2, 2, per_node={0: ("--crash-after", "0.3")})
    head.wait_serving(10)
    head.wait_line("EngineCore encountered a fatal error", 10)
    assert head.proc.wait(10) == 1
    assert worker.wait_line(fc.HEAD_LOST_PREFIX, 10).endswith("action=exit")
    assert worker.proc.wait(10) == 0

"""The multi-node harness itself (tests/netcluster.py): real namespaces, veths, a bridge, real
HTTP between nodes, a real ``sparkguard run`` per node; and that nothing is left behind."""

from __future__ import annotations

import os
import queue
import re
import subprocess
import sys
import threading

import pytest

pytest.importorskip("pyroute2")

import netcluster  # noqa: E402
from netcluster import Cluster, start_nodes, tp_configs, value  # noqa: E402
from supervisor_helpers import kill_pids, unique, wait_gone  # noqa: E402

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (network namespaces)")


def first_line_of(stream, timeout: float) -> str:
    """The next line of text ``stream`` (read by a thread), AssertionError after ``timeout`` s."""
    q: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: q.put(stream.readline()), daemon=True).start()
    try:
        return q.get(timeout=timeout)
    except queue.Empty:
        raise AssertionError(f"no line within {timeout} s") from None


def http_server(node, port: int = 8080) -> subprocess.Popen:
    """``python -m http.server`` bound to the node's address, once it listens."""
    p = node.spawn([sys.executable, "-u", "-m", "http.server", "--bind", node.addr, str(port)],
                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert "Serving HTTP on" in first_line_of(p.stdout, 20)
    return p


def reachable(ns, url: str, within: float) -> bool:
    """Whether ``GET url`` from ``ns`` answers 200 within ``within`` seconds (tries every 0.1 s)."""
    import time
    deadline = time.monotonic() + within
    while True:
        try:
            if ns.http_get(url, timeout=1.0)[0] == 200:
                return True
        except OSError:
            pass
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)  # no event says "a route works again"


def host_links() -> str:
    return subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, timeout=10).stdout


def assert_gone(c: Cluster) -> None:
    netns = os.listdir(netcluster.NETNS_DIR) if os.path.isdir(netcluster.NETNS_DIR) else []
    assert not set(c.names()) & set(netns), netns
    links = host_links()
    assert not [n for n in c.links() if n in links]


def test_nodes_reach_each_other_and_a_link_drop_cuts_one_off():
    with Cluster(2) as c:
        a, b = c.nodes
        assert a.addr != b.addr and {a.addr, b.addr, c.hub_addr} < set(map(str, c.subnet))
        srv = http_server(b)
        # the spawned program is the Popen's own pid, and it runs in b's namespace
        assert os.stat(f"/proc/{srv.pid}/ns/net").st_ino == b.inode() != os.stat("/proc/self/ns/net").st_ino
        url = f"http://{b.addr}:8080/"
        assert a.http_get(url, 2)[0] == 200
        assert c.hub.http_get(url, 2)[0] == 200
        b.link_down()
        assert not b.link_is_up()
        with pytest.raises(OSError):
            a.http_get(url, 1.0)
        with pytest.raises(OSError):
            c.hub.http_get(url, 1.0)
        b.link_up()
        assert b.link_is_up()
        assert reachable(a, url, 5)
    assert srv.returncode is not None            # the cluster's exit killed what it spawned
    assert_gone(c)


def test_nothing_is_left_after_a_keyboard_interrupt_or_a_setup_cut_short(monkeypatch):
    with pytest.raises(KeyboardInterrupt):
        with Cluster(2) as c:
            made = set(os.listdir(netcluster.NETNS_DIR))
            assert set(c.names()) <= made
            assert not [n for n in c.links() if n in host_links()]    # nothing in the host's namespace
            sleeper = c.nodes[1].spawn(["sleep", "600"])
            raise KeyboardInterrupt
    assert sleeper.returncode == -9
    assert_gone(c)

    real = Cluster._add_node

    def add_node(self, k):
        if k == 2:
            raise KeyboardInterrupt("while making node 2")
        real(self, k)

    monkeypatch.setattr(Cluster, "_add_node", add_node)
    c3 = Cluster(3)
    with pytest.raises(KeyboardInterrupt):
        c3.__enter__()
    assert_gone(c3)


def test_tp_configs_give_every_node_its_rank_and_the_other_nodes_as_peers(tmp_path):
    with Cluster(3) as c:
        cfgs = tp_configs(c, "sgm", tmp_path, load_time=2)
    addrs = [str(c.subnet.network_address + k + 1) for k in range(3)]
    for k, cfg in enumerate(cfgs):
        e = cfg["engine"]
        argv = e["command"]
        i = argv.index("serve")
        assert argv[i + 1] == "sgm"
        opt = dict(zip(argv[i + 2::2], argv[i + 3::2]))
        assert opt["--tensor-parallel-size"] == "3" and opt["--nnodes"] == "3"
        assert opt["--node-rank"] == str(k) and opt["--master-addr"] == addrs[0]
        assert opt["--load-time"] == "2" and opt["--host"] == addrs[0]
        assert ("--headless" in argv) == (k > 0)
        assert e["peers"] == [f"http://{a}:8799/metrics" for j, a in enumerate(addrs) if j != k]
        assert cfg["metrics"]["listen"] == f"{addrs[k]}:8799"
        assert ("health_url" in e, "head_url" in e) == ((True, False) if k == 0 else (False, True))
        assert e.get("health_url", e.get("head_url")) == f"http://{addrs[0]}:8000/health"
        assert str(tmp_path / f"node{k}") in e["control_socket"]
        assert "health_interval" not in e and "head_lost_after" not in e     # sparkguard's defaults


def test_a_sparkguard_per_node_runs_its_rank_and_serves_metrics_on_its_address(tmp_path):
    model = unique("sgcl")
    fast = {"stable_for": "0s", "health_interval": "100ms", "backoff_initial": "100ms"}
    with Cluster(2) as c:
        head, rank1 = start_nodes(c, tp_configs(c, model, tmp_path, load_time=0.5, engine=fast), tmp_path)
        for d in (rank1, head):
            d.wait_control()
            d.wait_ready()
        st = head.status()
        assert st["state"] == "ready"
        # the ranks met at the head's rendezvous over the bridge (tests/fakes/fake_cluster.py)
        for d in (head, rank1):
            d.wait_line(rf"fake-vllm: group formed nnodes=2 master={re.escape(c.nodes[0].addr)}:")
        # the head's engine serves on the head's address, seen from the hub
        status, _ = c.hub.http_post(f"http://{c.nodes[0].addr}:8000/v1/completions",
                                    {"model": model, "prompt": "x", "max_tokens": 1}, timeout=5)
        assert status == 200
        # rank 1's sparkguard serves metrics on its own address, read from the head's namespace
        m = rank1.wait_metrics(via=c.nodes[0])
        assert value(m, "sparkguard_memory_available_bytes") > 64 * 2**20
        assert head.scrape()                                  # and the head's, from the hub
        # each engine runs in its node's namespace, started by that node's sparkguard
        rank1.wait_line(r"fake-vllm: ready pids=")
        for d, node in ((head, c.nodes[0]), (rank1, c.nodes[1])):
            assert d.engine_pids
            for pid in d.alive_engine_pids():
                assert os.stat(f"/proc/{pid}/ns/net").st_ino == node.inode()
        # a fault on one node is seen across the bridge: the head's rendezvous loses rank 1
        mark = head.mark()
        victim = rank1.kill_engine("VLLM::Worker_TP1")
        assert wait_gone([victim], 5) == []
        head.wait_line(r"fake-vllm: rank lost rank=1 ", 10, start=mark)
        pids = list(head.engine_pids) + list(rank1.engine_pids)
    assert wait_gone(pids, 10) == []
    assert_gone(c)


def test_the_cluster_bench_stopped_by_sigint_leaves_no_namespace_or_process(tmp_path):
    import signal
    from conftest import ROOT, sg_env
    from test_bench_cleanup import _alive, _descendants
    p = subprocess.Popen([sys.executable, str(ROOT / "bench" / "cluster.py"), "--nodes", "2", "--trials", "1",
                          "--faults", "link-drop", "--link-drop", "60", "--out", str(tmp_path / "cluster")],
                         env=sg_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    tag, procs = None, {}
    try:
        m, seen = None, []
        while m is None:                    # the bench's own lines, up to the one before the fault
            seen.append(first_line_of(p.stderr, 60))
            assert seen[-1], "".join(seen)
            m = re.search(r"cluster (\w+) serving", seen[-1])
        tag = m.group(1)
        assert {f"sgcl-{tag}-0", f"sgcl-{tag}-1"} <= set(os.listdir(netcluster.NETNS_DIR))
        procs = _descendants(p.pid)
        assert len(procs) >= 6              # two sparkguards, the head's tree, the headless rank
        p.send_signal(signal.SIGINT)        # during the 60 s link drop
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:                # the bench did not clean up: do it for it, then fail
            p.kill()
            p.wait(10)
            kill_pids(procs)
            for n in os.listdir(netcluster.NETNS_DIR):
                if tag and f"sgcl-{tag}-" in n:
                    subprocess.run(["ip", "netns", "del", n], timeout=10)
    assert p.returncode == 130, err
    assert "stopped by SIGINT" in err
    assert not [n for n in os.listdir(netcluster.NETNS_DIR) if tag in n]
    assert not [pid for pid, st in procs.items() if _alive(pid, st)]
    assert (tmp_path / "cluster.csv").exists() is False     # no trial finished: nothing to write

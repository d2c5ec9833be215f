"""The plan of ``sparkguard cluster lane|stop|start|restart`` (sparkguard/cluster/plan.py), decided
from NodeStatus values: refusals before anything stops, nothing to do when the cluster already
serves in the lane, otherwise every rank down first, workers started before the head; and the
``cluster`` subcommands' parser (register_ops)."""

from __future__ import annotations

import argparse

import pytest

from sparkguard.cluster import ops
from sparkguard.cluster.model import ClusterFile, ClusterNode, NodeStatus
from sparkguard.cluster.plan import Refused, plan, serving_in

LANES = {"small": {"args": ["--max-model-len", "4096"]}, "big": {"args": ["--max-model-len", "8192"]}}


def cluster(n: int = 2) -> ClusterFile:
    nodes = tuple(ClusterNode(name=f"gx{k}", rank=k, addr=f"10.0.0.{k + 1}", ssh=f"root@gx{k}", metrics_port=8799)
                  for k in range(n))
    return ClusterFile(path="/etc/sparkguard/cluster.yaml", name="c", nodes=nodes, engine={"lanes": LANES})


def st(c: ClusterFile, k: int, lane="small", ready=True, state=None, run=100.0, joined=100.0,
       lanes=("small", "big")) -> NodeStatus:
    return NodeStatus(node=c.nodes[k], up=True, state=state or ("ready" if ready else "stopped"), lane=lane,
                      lanes=lanes, ready=ready, run_start=run + k if k else run, joined_run_start=joined if k else None)


def serving(c: ClusterFile, lane="small") -> list[NodeStatus]:
    return [st(c, k, lane) for k in range(len(c.nodes))]


def test_a_lane_switch_stops_every_rank_then_starts_workers_then_the_head():
    c = cluster(4)
    p = plan(c, "lane", serving(c), "big")
    assert p.noop is None and p.lane == "big" and p.wait_ready
    assert [s.what for s in p.steps] == ["stop", "start workers", "start head"]
    assert p.steps[0].nodes == ("gx0", "gx1", "gx2", "gx3") and p.steps[0].args[:2] == ("engine", "stop")
    assert p.steps[1].nodes == ("gx1", "gx2", "gx3")
    assert p.steps[2].nodes == ("gx0",)
    assert p.steps[1].args == p.steps[2].args == ("engine", "lane", "big", "--no-wait")


def test_nothing_to_do_when_every_node_is_ready_in_the_lane_and_joined_the_heads_run():
    c = cluster()
    p = plan(c, "lane", serving(c, "big"), "big")
    assert p.noop and not p.steps
    # a rank that joined an older run of the head is not serving: the switch runs
    sts = serving(c, "big")
    sts[1] = st(c, 1, "big", joined=99.0)
    assert plan(c, "lane", sts, "big").steps
    # ready in the lane but the head not ready: runs
    sts = serving(c, "big")
    sts[0] = st(c, 0, "big", ready=False)
    assert plan(c, "lane", sts, "big").steps


def test_a_lane_one_node_lacks_is_refused_naming_it():
    c = cluster()
    sts = serving(c)
    sts[1] = st(c, 1, lanes=("small",))
    with pytest.raises(Refused, match=r"lane 'big' is missing on gx1 \(has: small\): nothing was stopped"):
        plan(c, "lane", sts, "big")
    with pytest.raises(Refused, match="no lane 'huge' in the cluster file"):
        plan(c, "lane", serving(c), "huge")


def test_start_and_restart():
    c = cluster()
    assert plan(c, "start", serving(c)).noop
    stopped = [st(c, k, ready=False) for k in range(2)]
    p = plan(c, "start", stopped)
    assert p.lane == "small" and [s.what for s in p.steps] == ["stop", "start workers", "start head"]
    assert p.steps[2].args == ("engine", "start", "--no-wait")
    p = plan(c, "restart", serving(c))
    assert p.noop is None and [s.what for s in p.steps] == ["stop", "start workers", "start head"]
    mixed = [st(c, 0, "small"), st(c, 1, "big")]
    with pytest.raises(Refused, match="different lanes .*gx0: small; gx1: big.*cluster lane NAME"):
        plan(c, "start", mixed)


def test_stop_is_one_parallel_step_and_no_wait_for_ready():
    c = cluster()
    p = plan(c, "stop", serving(c))
    assert len(p.steps) == 1 and p.steps[0].nodes == ("gx0", "gx1") and not p.wait_ready


def test_serving_in_wants_one_lane_everywhere():
    c = cluster()
    assert serving_in(serving(c), "small") and serving_in(serving(c), None)
    assert not serving_in([st(c, 0, "small"), st(c, 1, "big")], None)
    assert not serving_in([st(c, 0), NodeStatus(node=c.nodes[1], up=False, error="refused")], "small")


def test_register_ops_adds_the_subcommands_with_their_options():
    p = argparse.ArgumentParser(prog="sparkguard cluster")
    p.add_argument("--cluster", default="/etc/sparkguard/cluster.yaml")
    sub = p.add_subparsers(dest="cmd")
    ops.register_ops(sub)
    a = p.parse_args(["lane", "big", "--cluster", "/tmp/c.yaml", "--timeout", "60", "--dry-run"])
    assert (a.cluster_op, a.lane, a.cluster, a.timeout, a.dry_run) == ("lane", "big", "/tmp/c.yaml", 60.0, True)
    assert a.func is ops.handler
    # a --cluster before the subcommand is kept
    a = p.parse_args(["--cluster", "/x.yaml", "restart"])
    assert (a.cluster_op, a.cluster) == ("restart", "/x.yaml")
    for name in ("stop", "start"):
        assert p.parse_args([name]).cluster_op == name


def test_the_wait_ignores_a_halted_state_left_from_before_the_start_and_stops_on_a_new_one(monkeypatch):
    import io
    monkeypatch.setattr(ops, "POLL", 0.0)
    c = cluster()
    seq = [[st(c, 0, "big", ready=False, state="given_up"), st(c, 1, "big", ready=False, state="given_up")],
           [st(c, 0, "big", ready=False, state="starting"), st(c, 1, "big", ready=False, state="waiting_for_head")],
           serving(c, "big")]
    reads = iter(seq)
    assert ops.wait_serving(c, "big", 30, lambda _c, _t: next(reads), io.StringIO(), 0.0) is None
    seq = [[st(c, 0, "big", ready=False, state="starting"), st(c, 1, "big", ready=False, state="backoff")],
           [st(c, 0, "big", ready=False, state="starting"), st(c, 1, "big", ready=False, state="given_up")]]
    reads = iter(seq)
    why = ops.wait_serving(c, "big", 30, lambda _c, _t: next(reads), io.StringIO(), 0.0)
    assert why.startswith("gx1 stopped trying: "), why


def test_ssh_argv_ends_ssh_options_before_the_destination_and_refuses_one_that_is_an_option():
    from dataclasses import replace
    from sparkguard.cluster import ssh
    c = cluster()
    argv = ssh.ssh_argv(c, c.nodes[1], ["engine", "status"])
    assert argv[-3:-1] == ["--", "root@gx1"], argv
    assert argv.index("--") == len(argv) - 3 and all(a != "root@gx1" for a in argv[:-2])
    bad = replace(c.nodes[1], ssh="-oProxyCommand=touch /tmp/x")
    with pytest.raises(ValueError, match="would be read as an option"):
        ssh.ssh_argv(c, bad, ["engine", "status"])
    # run_all turns it into that node's failure, never an ssh run
    r = ssh.run_all(c, [bad], ["--version"], timeout=5)["gx1"]
    assert not r.ok and "would be read as an option" in r.error


def test_serving_in_wants_every_node_at_the_rank_the_file_gives_it():
    from dataclasses import replace
    c = cluster()
    sts = serving(c)
    assert serving_in(sts, "small")
    assert not serving_in([sts[0], replace(sts[1], node_rank=0)], "small")
    assert serving_in([sts[0], replace(sts[1], node_rank=1)], "small")


def test_the_wait_fails_early_when_a_node_stays_unreadable(monkeypatch):
    import io
    import time
    monkeypatch.setattr(ops, "POLL", 0.01)
    monkeypatch.setattr(ops, "UNREADABLE_FOR", 0.3)
    c = cluster()
    gone = NodeStatus(node=c.nodes[1], up=False, error="no answer: [Errno 113] No route to host")
    flaky = iter([gone, gone, st(c, 1, "big", ready=False, state="waiting_for_head")] + [gone] * 10_000)
    t = time.monotonic()
    why = ops.wait_serving(c, "big", 1800, lambda _c, _t: [st(c, 0, "big", ready=False, state="starting"),
                                                           next(flaky)], io.StringIO(), t)
    assert time.monotonic() - t < 30, "waited for the whole timeout"
    assert why.startswith("gx1 unreadable for 0 s (no answer: [Errno 113] No route to host): "), why


def test_every_ssh_keeps_alive_unless_the_file_says():
    from dataclasses import replace
    from sparkguard.cluster import ssh
    c = cluster()
    argv = ssh.ssh_argv(c, c.nodes[0], ["engine", "status"])
    assert "ServerAliveInterval=15" in argv and "ServerAliveCountMax=3" in argv
    c2 = replace(c, ssh_options=("ServerAliveInterval=5",))
    argv = ssh.ssh_argv(c2, c2.nodes[0], ["engine", "status"])
    assert "ServerAliveInterval=5" in argv and "ServerAliveInterval=15" not in argv     # the file's, once
    assert "ServerAliveCountMax=3" in argv and "ConnectTimeout=10" in argv


def test_the_preflight_identity_check_names_what_differs():
    from dataclasses import replace
    c = replace(cluster(3), digest="aaaaaaaaaaaa")
    me = [NodeStatus(node=n, up=True, state="ready", cluster="c", node_name=n.name, node_rank=n.rank, nnodes=3,
                     digest="aaaaaaaaaaaa") for n in c.nodes]
    assert ops.identity(c, me) == []
    bad = [me[0], replace(me[1], node_name="gx2", node_rank=2), replace(me[2], digest="bbbbbbbbbbbb")]
    assert ops.identity(c, bad) == [
        "gx1 (ssh root@gx1): reports node 'gx2', the cluster file gives 'gx1'; reports rank 2, the cluster file gives 1",
        "gx2 (ssh root@gx2): it runs the cluster file with digest bbbbbbbbbbbb, this one is aaaaaaaaaaaa "
        "(copy the file to every node and reload)"]
    assert ops.identity(c, [replace(me[0], cluster=None)] + me[1:]) == [
        "gx0 (ssh root@gx0): its sparkguard runs without a cluster file"]
    assert ops.identity(c, [replace(me[0], cluster="other", nnodes=2)] + me[1:]) == [
        "gx0 (ssh root@gx0): reports cluster 'other', the cluster file gives 'c'; reports nnodes 2, the cluster "
        "file gives 3"]
    # without the operator's digest the nodes must still agree
    c0 = replace(c, digest=None)
    assert ops.identity(c0, me[:2] + [replace(me[2], digest="bbbbbbbbbbbb")]) == [
        "the nodes run different cluster files: gx0 digest aaaaaaaaaaaa; gx1 digest aaaaaaaaaaaa; "
        "gx2 digest bbbbbbbbbbbb"]

"""``sparkguard cluster lane|stop|start|restart`` end to end: nodes in network namespaces
(tests/netcluster.py), a real sshd in each (tests/sshnodes.py), a real ``sparkguard run`` per node
supervising its rank of the multi-node fake vLLM, every node and the operator configured by one
cluster file; the operations run through the CLI in the hub namespace, or in this process with
their ssh client in the hub namespace (``nsenter`` prefix) and the nodes' metrics read from the
hub through the view's own parser.

Asserted as an operator sees it: the exit status and the lines printed; the head serving in the
new lane (its /v1/models shows the lane's --max-model-len) with every rank joined its run; never
two nodes ready in different lanes while it switches (statuses sampled from the hub throughout);
the outage measured by completions from the hub; a second switch doing nothing (the runs
unchanged); an unreachable node and a lane one node lacks (it runs an older copy of the file) named before
anything stops; a switch whose group cannot form leaves every node stopped.
"""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import threading
import time
from contextlib import contextmanager
from dataclasses import replace

import pytest
import yaml

from conftest import sg_env, sparkguard_cmd
from netcluster import Cluster, cluster_file, start_nodes
from sparkguard.cluster import ops, ssh, view
from sparkguard.cluster.file import load as load_cluster
from sparkguard.cluster.model import ClusterFile, NodeStatus
from sshnodes import SshNodes
from test_cluster import FAST, PORT, completion_ok, wait_until

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (network namespaces, sshd)")

LANES = {"small": {"args": ["--max-model-len", "4096"]}, "big": {"args": ["--max-model-len", "8192"]}}


def hub_reader(hub):
    """A reader for :func:`ops.execute` that reads every node's metrics from the hub namespace
    (view.read's parse, the hub's sockets)."""
    def read(cluster: ClusterFile, timeout: float) -> list[NodeStatus]:
        out = []
        for n in cluster.nodes:
            try:
                status, body = hub.http_get(n.metrics_url, timeout)
                out.append(view.parse(n, body.decode()) if status == 200
                           else NodeStatus(node=n, up=False, error=f"HTTP {status}"))
            except Exception as e:  # noqa: BLE001 - a node that does not answer is a status
                out.append(NodeStatus(node=n, up=False, error=str(e)))
        return out
    return read


def cli(c, *args: str, timeout: float = 240.0):
    """``sparkguard cluster ARGS`` run in the hub namespace (as the operator's machine): ``(rc, stdout, stderr)``."""
    p = c.hub.spawn(sparkguard_cmd("cluster", *args), env=sg_env(), stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = p.communicate(timeout=timeout)
    return p.returncode, out, err


def with_ssh(path, s: SshNodes) -> None:
    """Add the test's ``ssh:`` section (options, remote command) to the cluster file at ``path``."""
    data = yaml.safe_load(path.read_text())
    data["ssh"] = {"options": list(s.ssh_options), "command": list(s.remote_sparkguard)}
    path.write_text(yaml.safe_dump(data, sort_keys=False))


@contextmanager
def tp_cluster(tmp_path, n: int = 2, old_lanes=None, node_lanes=None, load_time: float = 0.5):
    """``(c, ds, cf, run)``: n nodes serving in lane small, every node configured by one cluster
    file (netcluster.cluster_file: the shared command and LANES, each node's SSH destination and
    config, the test's ssh section), ``cf`` that file as the operator loads it (also
    ``c.cluster_file`` for :func:`cli`), and ``run(action, lane=None, timeout=120) -> (rc, stdout,
    stderr)`` calling :func:`ops.execute` in this process.

    ``old_lanes`` ``{k: lanes}``: node k runs an older copy of the file with only those lanes;
    ``node_lanes`` ``{k: lanes}``: node k's additions to the shared lanes (``nodes[k].lanes``)."""
    with Cluster(n) as c, SshNodes(c, tmp_path) as s:
        c.model = "sgop-" + c.tag
        nodes = [{"ssh": node.addr, "config": str(tmp_path / f"node{node.rank}" / "sparkguard.yaml"),
                  **({"lanes": (node_lanes or {})[node.rank]} if node.rank in (node_lanes or {}) else {})}
                 for node in c.nodes]
        path, cfgs = cluster_file(c, c.model, tmp_path, engine={**FAST, "lane": "small"}, lanes=LANES,
                                  nodes=nodes, load_time=load_time)
        with_ssh(path, s)
        for k, lanes in (old_lanes or {}).items():
            old = yaml.safe_load(path.read_text())
            old["engine"]["lanes"] = lanes
            copy = tmp_path / f"cluster-old-{k}.yaml"
            copy.write_text(yaml.safe_dump(old, sort_keys=False))
            cfgs[k]["cluster"]["file"] = str(copy)
        ds = start_nodes(c, cfgs, tmp_path)
        assert [str(d.path) for d in ds] == [x["config"] for x in nodes]
        for d in ds:
            d.wait_control(60)
        ds[0].wait_ready(timeout=90)
        wait_until(lambda: all(d.status()["state"] == "ready" for d in ds), 60, "every rank ready")
        cf = load_cluster(str(path))
        c.cluster_file = path
        read = hub_reader(c.hub)
        saved = ssh.SSH
        ssh.SSH = s.ssh_cmd()

        def run(action: str, lane: str | None = None, timeout: float = 120.0):
            out, err = io.StringIO(), io.StringIO()
            rc = ops.execute(cf, action, lane, timeout=timeout, out=out, err=err, read=read)
            return rc, out.getvalue(), err.getvalue()
        try:
            c.sshd = s
            yield c, ds, cf, run
        finally:
            ssh.SSH = saved


def cluster_mod_digest(path) -> str:
    """The digest the loader gives the cluster file at ``path``."""
    return load_cluster(str(path)).digest


def runs(ds) -> list:
    return [(d.status()["run_start"], d.status()["starts"]) for d in ds]


def max_model_len(c) -> int:
    status, body = c.hub.http_get(f"http://{c.nodes[0].addr}:{PORT}/v1/models")
    assert status == 200
    return json.loads(body)["data"][0]["max_model_len"]


def one_run_in(ds, lane: str) -> None:
    head = ds[0].status()
    assert head["ready"] and head["lane"] == lane, (head["state"], head["lane"])
    for d in ds[1:]:
        st = d.status()
        assert st["ready"] and st["lane"] == lane and st["joined"] == head["run_start"], (st["state"], st["lane"])


class Sampler:
    """Statuses and completions sampled from the hub every 0.1 s while a block runs."""

    def __init__(self, c, read, cf):
        self.c, self.read, self.cf = c, read, cf
        self.samples: list[tuple[float, list[NodeStatus], bool]] = []
        self.stop = threading.Event()
        self.t = threading.Thread(target=self._loop, daemon=True)

    def _loop(self):
        while not self.stop.is_set():
            sts = self.read(self.cf, 2.0)
            self.samples.append((time.monotonic(), sts, completion_ok(self.c.hub, self.c.nodes[0].addr,
                                                                      self.c.model, timeout=1.0)))
            self.stop.wait(0.1)

    def __enter__(self):
        self.t.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.t.join(10)

    def mixed(self) -> list:
        """Samples where two nodes were ready in different lanes."""
        return [(t, [(s.node.name, s.lane) for s in sts if s.ready]) for t, sts, _ in self.samples
                if len({s.lane for s in sts if s.ready}) > 1]

    def outage(self) -> float:
        """Seconds from the first failed completion to the first one that succeeded after it."""
        down = next(t for t, _, ok in self.samples if not ok)
        back = next(t for t, _, ok in self.samples if ok and t > down)
        return back - down


def test_lane_switch_end_to_end_never_mixes_lanes_and_a_second_one_does_nothing(tmp_path):
    with tp_cluster(tmp_path) as (c, ds, cf, run):
        assert max_model_len(c) == 4096
        with Sampler(c, hub_reader(c.hub), cf) as smp:
            t0 = time.monotonic()
            rc, out, err = run("lane", "big")
            took = time.monotonic() - t0
            wait_until(lambda: smp.samples and smp.samples[-1][2], 10, "a completion after the switch")
        assert rc == 0, out + err
        assert "sparkguard cluster lane big: serving in lane big, every node joined the head's run" in out, out
        for line in ("sparkguard cluster: stop: node0, node1", "sparkguard cluster: start workers: node1",
                     "sparkguard cluster: start head: node0"):
            assert line in err, err
        assert err.index("start workers") < err.index("start head")
        one_run_in(ds, "big")
        assert max_model_len(c) == 8192
        assert smp.mixed() == [], smp.mixed()[:5]
        outage = smp.outage()
        assert 0 < outage < took + 1, (outage, took)
        print(f"lane switch: outage {outage:.2f} s, command {took:.2f} s (fake load 0.5 s)")
        # the same switch again: nothing to do, the runs unchanged
        before = runs(ds)
        rc, out, err = run("lane", "big")
        assert rc == 0, out + err
        assert "nothing to do: every node is ready in lane big and joined the head's run" in out, out
        assert runs(ds) == before
        # one node's 'engine lane big' while ready in big: a no-op that returns at once
        r = ssh.run_all(cf, cf.nodes[:1], ["engine", "lane", "big", "--timeout", "30"], 60)["node0"]
        assert r.ok and r.seconds < 20, r
        assert runs(ds) == before
        # ...and 'engine start' while it runs answers at once instead of waiting for a start that never comes
        r = ssh.run_all(cf, cf.nodes, ["engine", "start", "--timeout", "30"], 60)
        assert all(x.ok and x.seconds < 20 for x in r.values()), r
        assert runs(ds) == before


def test_unreachable_node_and_another_version_of_the_file_stop_nothing(tmp_path):
    with tp_cluster(tmp_path, old_lanes={1: {"small": LANES["small"]}}) as (c, ds, cf, run):
        before = runs(ds)
        old = cluster_mod_digest(tmp_path / "cluster-old-1.yaml")
        rc, out, err = run("lane", "big")
        assert rc == 2, out + err
        assert f"refused: node1 (ssh {c.nodes[1].addr}): it runs the cluster file with digest {old}, " \
               f"this one is {cf.digest}" in err, err
        assert "refused: nothing was stopped" in err, err
        assert runs(ds) == before
        # two destinations swapped in the operator's file: each node answers as the other (the
        # nodes of this harness share one file system, so the config path goes with the machine)
        swapped = replace(cf, nodes=(replace(cf.nodes[0], ssh=cf.nodes[1].ssh, config=cf.nodes[1].config),
                                     replace(cf.nodes[1], ssh=cf.nodes[0].ssh, config=cf.nodes[0].config)))
        o, e = io.StringIO(), io.StringIO()
        assert ops.execute(swapped, "restart", timeout=30, out=o, err=e, read=hub_reader(c.hub)) == 2, e.getvalue()
        assert f"refused: node0 (ssh {c.nodes[1].addr}): reports node 'node1', the cluster file gives 'node0'; " \
               "reports rank 1, the cluster file gives 0" in e.getvalue(), e.getvalue()
        assert runs(ds) == before
        c.sshd.stop(c.nodes[1])
        rc, out, err = run("restart")
        assert rc == 1, out + err
        assert f"node1: unreachable over SSH: ssh: connect to host {c.nodes[1].addr} port 22" in err, err
        assert "failed before anything was stopped" in err, err
        assert runs(ds) == before
        one_run_in(ds, "small")


def test_restart_stop_and_start_through_the_command_line(tmp_path):
    with tp_cluster(tmp_path) as (c, ds, cf, run):
        f = str(c.cluster_file)
        head_run = ds[0].status()["run_start"]
        before = runs(ds)
        rc, out, err = cli(c, "lane", "big", "--cluster", f, "--dry-run")
        assert rc == 0, out + err
        assert out.startswith("plan: lane big\n1. stop on node0, node1 (in parallel)\n"), out
        assert "2. start workers on node1" in out and "3. start head on node0" in out, out
        assert f"-o StrictHostKeyChecking=yes" in out and "engine lane big --no-wait -c" in out, out
        assert runs(ds) == before
        rc, out, err = cli(c, "restart", "--cluster", f)
        assert rc == 0, out + err
        assert "sparkguard cluster restart: serving in lane small" in out, out
        one_run_in(ds, "small")
        assert ds[0].status()["run_start"] != head_run
        rc, out, err = cli(c, "stop", "--cluster", f)
        assert rc == 0, out + err
        assert "every node's engine stopped" in out, out
        assert all(d.status()["state"] == "stopped" for d in ds)
        assert not completion_ok(c.hub, c.nodes[0].addr, c.model)
        rc, out, err = cli(c, "start", "--cluster", f)
        assert rc == 0, out + err
        one_run_in(ds, "small")
        rc, out, err = cli(c, "start", "--cluster", f)
        assert rc == 0 and "nothing to do: the cluster already serves in lane small" in out, out + err
        rc, out, err = cli(c, "lane", "big", "--cluster", str(tmp_path / "missing.yaml"))
        assert rc == 2 and "cluster file not found" in err, out + err


def test_four_nodes_switch_lanes_as_one_engine(tmp_path):
    with tp_cluster(tmp_path, n=4) as (c, ds, cf, run):
        with Sampler(c, hub_reader(c.hub), cf) as smp:
            rc, out, err = run("lane", "big", timeout=180)
        assert rc == 0, out + err
        assert "start workers: node1, node2, node3" in err, err
        one_run_in(ds, "big")
        assert max_model_len(c) == 8192
        assert smp.mixed() == [], smp.mixed()[:5]


def test_a_switch_that_cannot_form_the_group_stops_every_node_and_fails(tmp_path):
    """Node 1's big lane carries an argument the head's lacks: the head's rendezvous refuses it
    (tests/fakes/fake_cluster.py MATCHED), the group never forms, the wait times out."""
    with tp_cluster(tmp_path, node_lanes={1: {"big": {"args": ["--max-num-seqs", "7"]}}}) as (c, ds, cf, run):
        with Sampler(c, hub_reader(c.hub), cf) as smp:
            rc, out, err = run("lane", "big", timeout=15)
        assert rc == 1, out + err
        # either the wait ran out or node1's supervisor gave up first (its restarts are refused by
        # the head's rendezvous; which comes first depends on the machine's speed)
        m = re.search(r"^sparkguard cluster lane big: (not serving within 15 s|node1 stopped trying): (.*)$", err, re.M)
        assert m, err
        assert "node1 headless" in m.group(2), err
        # progress while it waited: elapsed time, each node's role, state and lane
        assert re.search(r"^sparkguard cluster: \d+ s: node0 head \w+ lane big; node1 headless \w+ lane big$", err, re.M), err
        assert "stopping every node again so that no mix of lanes serves" in err, err
        assert "sparkguard cluster lane big: every node's engine is stopped" in err, err
        # nothing runs: stopped, or given up (node1 when it gave up first: a stop leaves that state)
        assert all(d.status()["state"] in ("stopped", "given_up") and not d.status()["up"] for d in ds), \
            [d.status()["state"] for d in ds]
        assert smp.mixed() == [], smp.mixed()[:5]

"""``sparkguard cluster status`` against real daemons: 2 and 4 nodes in network namespaces
(tests/netcluster.py), every node a real ``sparkguard run`` configured by one cluster file
(``cluster: {file, node}``, :func:`netcluster.cluster_file`) supervising its rank of the multi-node fake vLLM, the command run
in the hub namespace so it reaches every node's metrics endpoint as an operator's would.

Asserted as the operator reads it: the table's rows and the verdict line, the exit status,
the JSON.  A headless rank's engine SIGKILLed shows the cluster degraded and then serving in
a new run; a node whose sparkguard is stopped shows down and is named; the head switched alone
to another lane shows "lane mismatch".  The fake's load time is 3 s so that a restart is seen.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import yaml

from conftest import sg_env, sparkguard_cmd
from netcluster import METRICS_PORT, Cluster, SparkguardNode, cluster_file, start_nodes
from sshnodes import SshNodes
from test_cluster import kill, wait_until

FAST = {"health_interval": "500ms", "stable_for": "0s", "quiesce_timeout": "60s"}
LOAD_TIME = 3.0


def start(c: Cluster, tmp_path: Path, lanes: dict | None = None) -> tuple[Path, list[SparkguardNode]]:
    """The cluster file (:func:`netcluster.cluster_file`: nodes node0.., the fake vLLM, shorter
    timers) and a daemon per node configured by it, headless ranks first and the head last."""
    c.model = "sgcv-" + c.tag
    cfile, cfgs = cluster_file(c, c.model, tmp_path, engine=FAST, lanes=lanes, load_time=LOAD_TIME)
    ds = start_nodes(c, cfgs, tmp_path)
    for d in ds:
        d.wait_control(60)
    return cfile, ds


def cluster_status(c: Cluster, cfile: Path, *extra: str) -> subprocess.CompletedProcess:
    """``sparkguard cluster status --cluster FILE`` run in the hub namespace, to completion."""
    p = c.hub.spawn(sparkguard_cmd("cluster", "status", "--cluster", str(cfile), "--timeout", "2", *extra),
                    env=sg_env(), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = p.communicate(timeout=60)
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def verdict_line(r: subprocess.CompletedProcess) -> str:
    return r.stdout.strip().splitlines()[-1] if r.stdout.strip() else ""


def until_verdict(c: Cluster, cfile: Path, word: str, timeout: float) -> subprocess.CompletedProcess:
    """Run the command until its verdict line is ``word``; that run."""
    seen: list[str] = []

    def once():
        r = cluster_status(c, cfile)
        seen.append(verdict_line(r) or r.stderr.strip()[-300:])
        return r if verdict_line(r).startswith(f"sgcl-{c.tag}: {word}:") else None
    try:
        return wait_until(once, timeout, f"verdict {word}", every=0.3)
    except AssertionError:
        raise AssertionError(f"verdict never {word!r}; last seen: {seen[-3:]}") from None


def rows(r: subprocess.CompletedProcess) -> dict[str, list[str]]:
    """The table's rows by node name (columns split on runs of 2+ spaces)."""
    lines = r.stdout.splitlines()
    assert lines and lines[0].startswith("NODE"), r.stdout
    return {ln.split()[0]: re.split(r"\s{2,}", ln.strip()) for ln in lines[1:] if re.match(r"node\d+\s", ln)}


def test_two_nodes_serving_then_a_killed_rank_degrades_and_recovers(tmp_path):
    with Cluster(2) as c:
        cfile, (head, rank) = start(c, tmp_path)
        r = until_verdict(c, cfile, "serving", 90)
        assert r.returncode == 0, r.stdout + r.stderr
        t = rows(r)
        assert t["node0"][1:4] == ["head/0", "up", "ready"], t
        assert t["node1"][1:4] == ["headless/1", "up", "ready"], t
        js = json.loads(cluster_status(c, cfile, "--json").stdout)
        assert js["verdict"] == "serving" and [n["cluster"] for n in js["nodes"]] == [f"sgcl-{c.tag}"] * 2
        run0 = js["nodes"][0]["run_start"]
        assert js["nodes"][1]["joined_run_start"] == run0

        worker = rank.status()["pid"]
        wk = [p for p in rank.alive_engine_pids() if p != worker]      # VLLM::Worker_TP1 of the headless rank
        assert wk, rank.alive_engine_pids()
        kill(wk[-1])
        r = until_verdict(c, cfile, "degraded", 30)
        assert r.returncode == 1
        r = until_verdict(c, cfile, "serving", 90)
        js = json.loads(cluster_status(c, cfile, "--json").stdout)
        assert js["verdict"] == "serving", js
        assert js["nodes"][0]["run_start"] != run0, "serving again, but in the old run"
        assert js["nodes"][1]["joined_run_start"] == js["nodes"][0]["run_start"]


def test_four_nodes_one_sparkguard_stopped_shows_down_and_named(tmp_path):
    with Cluster(4) as c:
        cfile, ds = start(c, tmp_path)
        r = until_verdict(c, cfile, "serving", 120)
        assert sorted(rows(r)) == ["node0", "node1", "node2", "node3"]
        ds[2].stop()
        r = until_verdict(c, cfile, "degraded", 30)
        assert r.returncode == 1
        t = rows(r)
        assert t["node2"][2] == "down" and t["node0"][2] == t["node1"][2] == t["node3"][2] == "up", t
        assert any(ln.startswith(f"node2: not read at http://{c.nodes[2].addr}:{METRICS_PORT}/metrics")
                   for ln in r.stdout.splitlines()), r.stdout
        assert "node2 (rank 2) down" in verdict_line(r)


def test_the_head_switched_alone_to_another_lane_is_a_lane_mismatch(tmp_path):
    lanes = {"short": {"args": ["--max-model-len", "8192"]}, "long": {"args": ["--max-model-len", "65536"]}}
    with Cluster(2) as c:
        cfile, (head, rank) = start(c, tmp_path, lanes)
        r = until_verdict(c, cfile, "serving", 90)
        assert rows(r)["node0"][4] == rows(r)["node1"][4] == "short"
        js = json.loads(cluster_status(c, cfile, "--json").stdout)
        assert [n["lanes"] for n in js["nodes"]] == [["short", "long"]] * 2      # sparkguard_engine_lanes_info
        assert head.ctl("lane", lane="long")["ok"]
        r = until_verdict(c, cfile, "lane mismatch", 60)
        assert r.returncode == 1
        assert "long: node0" in verdict_line(r) and "short: node1" in verdict_line(r), verdict_line(r)


# --------------------------------------------------------------------------------------------
# cluster incidents over SSH (tests/sshnodes.py: a real sshd per node, keys made here)

def incident(iid: str, at: float, kind: str) -> dict:
    """A minimal stored record (docs/incident.md): what the listing and the report read."""
    return {"id": iid, "kind": kind, "outcome": "recovered", "started_at": at, "ended_at": at + 1.5,
            "summary": f"{kind} incident {iid}"}


def incidents_setup(c: Cluster, s: SshNodes, tmp_path: Path, records: dict[int, list[dict]]) -> Path:
    """Each node's sparkguard.yaml (its incidents dir holding ``records[rank]``) and the cluster
    file naming them, with the harness's ssh options and remote command."""
    nodes = []
    for n in c.nodes:
        d = tmp_path / f"node{n.rank}"
        inc = d / "incidents"
        inc.mkdir(parents=True)
        for r in records.get(n.rank, []):
            (inc / f"{r['id']}.json").write_text(json.dumps(r))
        cfg = d / "sparkguard.yaml"
        cfg.write_text(yaml.safe_dump({"incidents": {"dir": str(inc), "journal": "off"}}))
        nodes.append({"name": f"n{n.rank}", "addr": n.addr, "ssh": n.addr, "config": str(cfg)})
    doc = {"name": "lab-" + c.tag, "nodes": nodes,
           "ssh": {"options": list(s.ssh_options), "command": list(s.remote_sparkguard)},
           "engine": {"command": ["vllm", "serve", "m", "--tensor-parallel-size", str(c.n)]}}
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def cluster_incidents(c: Cluster, cfile: Path, *args: str) -> subprocess.CompletedProcess:
    """``sparkguard cluster incidents --cluster FILE ARGS`` in the hub namespace, to completion."""
    p = c.hub.spawn(sparkguard_cmd("cluster", "incidents", "--cluster", str(cfile), *args), env=sg_env(),
                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = p.communicate(timeout=120)
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def test_incidents_of_every_node_in_one_timeline_over_ssh_and_an_unreachable_node_named(tmp_path):
    t = 1_780_000_000.0
    records = {0: [incident("20260528T000010Z-aaaaaa", t + 10, "link"), incident("20260528T000000Z-aaaaab", t, "memory")],
               1: [incident("20260528T000030Z-bbbbbb", t + 30, "wedged")],
               2: [incident("20260528T000010Z-cccccc", t + 10, "memory")]}
    with Cluster(3) as c, SshNodes(c, tmp_path) as s:
        cfile = incidents_setup(c, s, tmp_path, records)
        r = cluster_incidents(c, cfile, "--limit", "0")
        assert r.returncode == 0, r.stdout + r.stderr
        lines = r.stdout.splitlines()
        assert lines[0].split()[:2] == ["NODE", "ID"]
        got = [ln.split()[:2] for ln in lines[1:]]
        assert got == [["n1", "20260528T000030Z-bbbbbb"], ["n0", "20260528T000010Z-aaaaaa"],
                       ["n2", "20260528T000010Z-cccccc"], ["n0", "20260528T000000Z-aaaaab"]], r.stdout

        one = cluster_incidents(c, cfile, "20260528T000010Z-c")
        assert one.returncode == 0, one.stderr
        assert one.stdout.startswith("Node: n2 (rank 2, ") and "20260528T000010Z-cccccc" in one.stdout

        js = json.loads(cluster_incidents(c, cfile, "--json", "--limit", "2").stdout)
        assert [(x["node"], x["kind"]) for x in js] == [("n1", "wedged"), ("n0", "link")]

        s.stop(c.nodes[1])
        r = cluster_incidents(c, cfile, "--limit", "0")
        assert r.returncode == 1
        rows_ = [ln.split()[0] for ln in r.stdout.splitlines()[1:] if not ln.startswith("not read")]
        assert rows_ == ["n0", "n2", "n0"], r.stdout
        assert any(ln.startswith("not read: n1: unreachable over SSH: ") for ln in r.stdout.splitlines()), r.stdout

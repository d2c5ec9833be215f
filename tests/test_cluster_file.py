"""One cluster file for every node (issue 14): what it refuses (each error names the file, the key
and the value), what each node derives from it (the same engine command lines, peers and head URLs
as the hand-written per-node configs of tests/netcluster.tp_configs), how a node finds itself,
what check-config prints, a reload with a broken cluster file keeping the running config (a real
daemon), and two nodes in network namespaces started from the file serving as one engine and
recovering when the head's engine is SIGKILLed.
"""

from __future__ import annotations

import copy
import re
import signal
import socket
import time

import pytest
import yaml

from conftest import run_sparkguard
from netcluster import Cluster, cluster_file, start_nodes, tp_configs
from supervisor_helpers import Daemon, engine_config, fake_cmd, unique
from sparkguard import config
from sparkguard.cluster import file as cluster_mod
from sparkguard.supervisor.cluster import role_of

MEM = 128 * 1024**3          # MemTotal given to from_dict: the checks against it are not under test here


def base() -> dict:
    """A valid 4-node cluster file (the format of docs/cluster.md)."""
    return {
        "name": "spark4",
        "ssh": {"options": ["ConnectTimeout=5"], "command": ["sudo", "-n", "sparkguard"]},
        "nodes": [{"name": f"spark-{k}", "addr": f"10.10.0.{k}", "env": {"VLLM_HOST_IP": f"10.10.0.{k}"}}
                  for k in range(1, 5)],
        "engine": {
            "command": ["vllm", "serve", "/models/m", "--tensor-parallel-size", "4", "--port", "8001"],
            "lanes": {"200k": {"args": ["--max-model-len", "200000"]}, "1m": {"args": ["--max-model-len", "1000000"]}},
            "lane": "200k",
        },
    }


def write(tmp_path, data, name: str = "cluster.yaml"):
    p = tmp_path / name
    p.write_text(yaml.safe_dump(data, sort_keys=False))
    return p


def test_a_valid_file_loads_in_rank_order_with_its_defaults(tmp_path):
    cf = cluster_mod.load(str(write(tmp_path, base())))
    assert cf.name == "spark4" and [n.name for n in cf.nodes] == ["spark-1", "spark-2", "spark-3", "spark-4"]
    assert [n.rank for n in cf.nodes] == [0, 1, 2, 3] and cf.head.name == "spark-1"
    assert cf.master_port == 29501 and cf.api_port == 8001 and cf.lanes == ("200k", "1m")
    assert cf.nodes[1].ssh == "spark-2" and cf.nodes[1].metrics_port == 8799
    assert cf.nodes[1].metrics_url == "http://10.10.0.2:8799/metrics"
    assert cf.ssh_options == ("ConnectTimeout=5",) and cf.remote_sparkguard == ("sudo", "-n", "sparkguard")


def test_explicit_ranks_may_be_listed_in_any_order(tmp_path):
    d = base()
    for n, r in zip(d["nodes"], (2, 0, 3, 1)):
        n["rank"] = r
    cf = cluster_mod.load(str(write(tmp_path, d)))
    assert [n.name for n in cf.nodes] == ["spark-2", "spark-4", "spark-1", "spark-3"]
    assert cf.head.addr == "10.10.0.2"


def _set(path: str, value):
    def change(d):
        *parents, last = re.findall(r"[^.\[\]]+", path)
        cur = d
        for p in parents:
            cur = cur[int(p)] if p.isdigit() else cur[p]
        if value is KeyError:
            del cur[int(last) if last.isdigit() else last]
        elif last.isdigit():
            cur[int(last)] = value
        else:
            cur[last] = value
    return change


def _ranks(*ranks):
    def change(d):
        for n, r in zip(d["nodes"], ranks):
            if r is not None:
                n["rank"] = r
    return change


REFUSED = [
    # (change, key, value shown, reason)
    (_set("nodes", [{"name": "a", "addr": "10.0.0.1"}]), "nodes", "[{'name': 'a'", "at least 2 nodes"),
    (_set("nodes", []), "nodes", "[]", "at least 2 nodes"),
    (_set("nodes[2].name", "spark-1"), "nodes[2].name", "'spark-1'", "given twice: nodes[0] (spark-1) and nodes[2]"),
    (_set("nodes[3].addr", "10.10.0.1"), "nodes[3].addr", "'10.10.0.1'", "given twice"),
    (_ranks(0, 1, 1, 2), "nodes[2].rank", "1", "two nodes claiming one rank: spark-2 and spark-3 both claim rank 1"),
    (_ranks(0, 1, 3, 4), "nodes[3].rank", "4", "a rank gap: rank 2 is missing"),
    (_ranks(0, None, 2, 3), "nodes[1].rank", "None", "spark-2 has no rank while node spark-1 has one"),
    (_set("nodes[1].addr", "10.10.0.300"), "nodes[1].addr", "'10.10.0.300'", "IP address or a host name"),
    (_set("nodes[1].addr", "bad host"), "nodes[1].addr", "'bad host'", "IP address or a host name"),
    (_set("nodes[1].ssh", "-oProxyCommand=x"), "nodes[1].ssh", "'-oProxyCommand=x'", "not starting with '-'"),
    (_set("nodes[1].lanes", {"2m": {"env": {"X": "1"}}}), "nodes[1].lanes.2m", "{'env': {'X': '1'}}",
     "a lane that not every node has: node spark-2 adds to lane 2m, which engine.lanes does not define"),
    (_set("nodes[1].colour", "red"), "nodes[1].colour", "'red'", "unknown key"),
    (_set("nodes[0].name", KeyError), "nodes[0].name", "None", "missing"),
    (_set("nodes[1].args", ["--node-rank", "3"]), "nodes[1].args", "'--node-rank'", "derived for each node"),
    (_set("engine.command", ["vllm", "serve", "m", "--tensor-parallel-size", "4", "--nnodes", "4"]),
     "engine.command", "'--nnodes'", "--nnodes is derived for each node"),
    (_set("engine.command", ["vllm", "serve", "m", "--tensor-parallel-size", "4", "--master_addr=10.0.0.9"]),
     "engine.command", "'--master_addr=10.0.0.9'", "--master-addr is derived"),
    (_set("engine.command", ["vllm", "serve", "m", "--tensor-parallel-size", "4", "--headless"]),
     "engine.command", "'--headless'", "--headless is derived"),
    (_set("engine.lanes.1m.args", ["--master-port", "1"]), "engine.lanes.1m.args", "'--master-port'", "derived"),
    (_set("engine.command", ["python3", "-m", "mything", "--tensor-parallel-size", "4"]), "engine.command",
     "['python3', '-m', 'mything'", "lacks serve"),
    (_set("engine.command", ["vllm", "serve", "m", "--tensor-parallel-size", "6"]), "engine.command",
     "'--tensor-parallel-size 6'", "6 rank(s) (tensor-parallel x pipeline-parallel) cannot span 4 nodes"),
    (_set("engine.command", ["vllm", "serve", "m"]), "engine.command", "'--tensor-parallel-size 1'",
     "cannot span 4 nodes"),
    (_set("engine.command", KeyError), "engine.command", "None", "missing"),
    (_set("engine.peers", ["http://10.0.0.1:8799/metrics"]), "engine.peers", "['http://10.0.0.1:8799/metrics']",
     "derived for each node"),
    (_set("engine.health_url", "http://10.10.0.1:8001/health"), "engine.health_url", "'http://", "derived"),
    (_set("nodes[1].args", ["--port", "9000"]), "nodes[1].args", "'--port'", "--port is the whole cluster's"),
    (_set("nodes[1].args", ["--host=10.10.0.2"]), "nodes[1].args", "'--host=10.10.0.2'", "not one node's"),
    (_set("nodes[1].args", ["-tp", "8"]), "nodes[1].args", "'-tp'", "-tp is the whole cluster's"),
    (_set("nodes[1].lanes", {"1m": {"args": ["--pipeline_parallel_size", "2"]}}), "nodes[1].lanes.1m.args",
     "'--pipeline_parallel_size'", "--pipeline-parallel-size is the whole cluster's"),
    (_set("engine.lanes.1m.args", ["--tensor-parallel-size", "6"]), "engine.lanes.1m.args",
     "'--tensor-parallel-size 6'", "6 rank(s) (tensor-parallel x pipeline-parallel) cannot span 4 nodes "
     "(node spark-1 in lane 1m)"),
    (_set("engine.lanes.1m.args", ["--port", "9000"]), "engine.lanes.1m.args", "'--port 9000'",
     "node spark-1 in lane 1m would serve on port 9000, the cluster's API port (engine.command --port) is 8001"),
    (_set("engine.lanes.1m.args", ["--host", "127.0.0.1"]), "engine.lanes.1m.args", "'--host 127.0.0.1'",
     "would bind the API to 127.0.0.1"),
    (_set("engine.command", ["vllm", "serve", "m", "--tensor-parallel-size", "4", "--host", "10.10.0.2"]),
     "engine.command", "'--host 10.10.0.2'", "the shared command would bind the API to 10.10.0.2"),
    (_set("engine.lane", "2m"), "engine.lane", "'2m'", "no such lane; engine.lanes has 200k, 1m"),
    (_set("engine.lanes.1m.args", "--x"), "engine.lanes.1m.args", "'--x'", "expected a list"),
    (_set("engine.stable_for", "forever"), "engine.stable_for", "'forever'", ""),
    (_set("ssh", {"options": ["BatchMode=no"]}), "ssh.options[0]", "'BatchMode=no'", "always set"),
    (_set("ssh", {"options": ["-v"]}), "ssh.options[0]", "'-v'", "KEY=VALUE"),
    (_set("ssh", {"options": ["ProxyJump=-oProxyCommand=x"]}), "ssh.options[0]", "'ProxyJump=-o", "KEY=VALUE"),
    *[(_set("ssh", {"options": ["Port=22", opt]}), "ssh.options[1]", repr(opt), "not allowed here")
      for opt in ("ProxyCommand=sh", "LocalCommand=id", "PermitLocalCommand=yes", "KnownHostsCommand=/bin/x",
                  "HostKeyAlias=other", "SendEnv=X")],
    (_set("ssh", {"options": ["stricthostkeychecking=no"]}), "ssh.options[0]", "'stricthostkeychecking=no'",
     "always set"),
    (_set("ssh", {"options": ["LogLevel=QUIET"]}), "ssh.options[0]", "'LogLevel=QUIET'", "keep ssh's error"),
    (_set("nodes[1].name", "-oProxyCommand=x"), "nodes[1].name", "'-oProxyCommand=x'", "not starting with '-'"),
    (_set("nodes[2].ssh", "ops@spark-2"), "nodes[2].ssh", "'ops@spark-2'", "given twice: nodes[1] (spark-2)"),
    (_set("nodes[2].ssh", "root@spark-1"), "nodes[2].ssh", "'root@spark-1'", "given twice: nodes[0] (spark-1)"),
    (_set("nodes[2].ssh", "Spark-2."), "nodes[2].ssh", "'Spark-2.'", "are one host"),
    (_set("name", "spark 4"), "name", "'spark 4'", "letters, digits"),
    (_set("name", KeyError), "name", "None", "missing"),
    (_set("master_port", 70000), "master_port", "70000", "from 1 to 65535"),
    (_set("colour", "red"), "colour", "'red'", "unknown key"),
]


@pytest.mark.parametrize("change,key,shown,reason", REFUSED, ids=[r[1] + ":" + r[3][:30] for r in REFUSED])
def test_a_wrong_cluster_file_is_refused_naming_file_key_and_value(tmp_path, change, key, shown, reason):
    d = base()
    change(d)
    p = write(tmp_path, d)
    with pytest.raises(config.ConfigError) as ei:
        cluster_mod.load(str(p))
    e = ei.value
    assert (e.path, e.key) == (str(p), key), str(e)
    assert str(e).startswith(f"{p}: {key}: {shown}"), str(e)
    assert reason in e.reason, str(e)


def test_two_spellings_of_one_address_are_one_address(tmp_path):
    d = base()
    d["nodes"][0]["addr"], d["nodes"][1]["addr"] = "fd00::1", "fd00:0::0:1"
    p = write(tmp_path, d)
    with pytest.raises(config.ConfigError, match=r"nodes\[1\]\.addr: 'fd00:0::0:1': given twice.*are one host"):
        cluster_mod.load(str(p))


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.10.0.1"])
def test_a_shared_host_may_be_a_wildcard_or_the_heads_address(tmp_path, host):
    d = base()
    d["engine"]["command"] += ["--host", host]
    d["engine"]["lanes"]["1m"]["args"] += ["--port", "8001"]      # the cluster's port again: allowed
    assert cluster_mod.load(str(write(tmp_path, d))).api_port == 8001


def test_the_allowed_ssh_options_load(tmp_path):
    d = base()
    d["ssh"]["options"] = ["Port=2222", "User=ops", "IdentityFile=~/.ssh/id_spark", "IdentitiesOnly=yes",
                           "ConnectTimeout=5", "ServerAliveInterval=5", "ServerAliveCountMax=3", "ProxyJump=bastion",
                           "UserKnownHostsFile=~/.ssh/spark_hosts", "GlobalKnownHostsFile=/dev/null",
                           "LogLevel=ERROR"]
    assert cluster_mod.load(str(write(tmp_path, d))).ssh_options == tuple(d["ssh"]["options"])


def test_a_missing_or_broken_cluster_file_names_itself(tmp_path):
    with pytest.raises(config.ConfigError, match=r"nope.yaml: cluster file not found"):
        cluster_mod.load(str(tmp_path / "nope.yaml"))
    (tmp_path / "bad.yaml").write_text("name: [\n")
    with pytest.raises(config.ConfigError, match=r"bad.yaml: YAML error at line"):
        cluster_mod.load(str(tmp_path / "bad.yaml"))


# --------------------------------------------------------------------------------------------
# a node's config derived from the file

def node_cfg(tmp_path, node: str | None, engine: dict | None = None, **sections) -> dict:
    d = {"cluster": {"file": str(tmp_path / "cluster.yaml")}, "engine": {"drop_caches": False, **(engine or {})},
         **sections}
    if node is not None:
        d["cluster"]["node"] = node
    return d


def test_each_node_derives_its_flags_lanes_env_peers_and_head_url(tmp_path):
    d = base()
    d["nodes"][2]["lanes"] = {"1m": {"args": ["--enforce-eager"], "env": {"NCCL_IB_HCA": "mlx5_1"}}}
    d["nodes"][2]["args"] = ["--gpu-memory-utilization", "0.8"]
    d["engine"]["env"] = {"HF_HUB_OFFLINE": "1"}
    write(tmp_path, d)
    head = config.from_dict(node_cfg(tmp_path, "spark-1"), "sg.yaml", MEM)
    assert head.cluster == config.ClusterConfig(file=str(tmp_path / "cluster.yaml"), node="spark-1",
                                                name="spark4", nnodes=4, rank=0, role="head",
                                                digest=cluster_mod.load(str(tmp_path / "cluster.yaml")).digest)
    assert re.fullmatch(r"[0-9a-f]{12}", head.cluster.digest)
    assert head.engine.command == ("vllm", "serve", "/models/m", "--nnodes", "4", "--node-rank", "0",
                                   "--master-addr", "10.10.0.1", "--master-port", "29501",
                                   "--tensor-parallel-size", "4", "--port", "8001")
    assert head.engine.health_url == "http://10.10.0.1:8001/health" and head.engine.head_url is None
    assert head.engine.peers == tuple(f"http://10.10.0.{k}:8799/metrics" for k in (2, 3, 4))
    assert head.metrics.listen == ("10.10.0.1", 8799) and head.engine.lane == "200k"
    assert head.engine.env == {"HF_HUB_OFFLINE": "1", "VLLM_HOST_IP": "10.10.0.1"}
    r2 = config.from_dict(node_cfg(tmp_path, "spark-3", metrics={"listen": "0.0.0.0:8799"}), "sg.yaml", MEM)
    assert (r2.cluster.rank, r2.cluster.role) == (2, "headless")
    assert r2.engine.command[3:12] == ("--nnodes", "4", "--node-rank", "2", "--master-addr", "10.10.0.1",
                                       "--master-port", "29501", "--headless")
    assert r2.engine.command[-2:] == ("--gpu-memory-utilization", "0.8")
    assert role_of(r2.engine.command).role == "headless" and role_of(r2.engine.command).node_rank == 2
    assert r2.engine.head_url == "http://10.10.0.1:8001/health" and r2.engine.health_url is None
    assert r2.engine.lanes["1m"] == config.LaneConfig(args=("--max-model-len", "1000000", "--enforce-eager"),
                                                      env={"NCCL_IB_HCA": "mlx5_1"})
    assert r2.engine.lanes["200k"] == config.LaneConfig(args=("--max-model-len", "200000"))
    assert r2.metrics.listen == ("0.0.0.0", 8799)              # sparkguard.yaml's own metrics.listen wins
    assert r2.engine.drop_caches is False


@pytest.mark.parametrize("listen,ok", [("10.10.0.3:8799", True), ("[::]:8799", True), ("0.0.0.0:8799", True),
                                       ("127.0.0.1:8799", False), ("10.10.0.3:9000", False), ("0.0.0.0:9000", False),
                                       ("10.10.0.1:8799", False), ("off", False)])
def test_a_nodes_own_metrics_listen_must_stay_where_the_cluster_file_says(tmp_path, listen, ok):
    write(tmp_path, base())
    doc = node_cfg(tmp_path, "spark-3", metrics={"listen": listen})
    if ok:
        assert config.from_dict(doc, "sg.yaml", MEM).metrics.listen[1] == 8799
        return
    with pytest.raises(config.ConfigError) as ei:
        config.from_dict(doc, "sg.yaml", MEM)
    assert (ei.value.path, ei.value.key) == ("sg.yaml", "metrics.listen"), str(ei.value)
    assert "10.10.0.3:8799" in ei.value.reason, str(ei.value)


@pytest.mark.parametrize("key,value", [("command", ["vllm", "serve", "x"]), ("lanes", {}), ("lane", "1m"),
                                       ("peers", []), ("head_url", "http://h:1/health"),
                                       ("health_url", "http://h:1/health")])
def test_what_the_cluster_file_owns_cannot_be_set_in_a_node_config(tmp_path, key, value):
    write(tmp_path, base())
    with pytest.raises(config.ConfigError) as ei:
        config.from_dict(node_cfg(tmp_path, "spark-2", {key: value}), "sg.yaml", MEM)
    assert ei.value.key == f"engine.{key}" and ei.value.path == "sg.yaml"
    assert f"set in the cluster file {tmp_path / 'cluster.yaml'}; remove it here" in str(ei.value)


def test_a_node_finds_itself_by_hostname_or_by_its_key(tmp_path):
    host = socket.gethostname()
    d = base()
    d["nodes"][3]["name"] = host
    write(tmp_path, d)
    by_host = config.from_dict(node_cfg(tmp_path, None), "sg.yaml", MEM)
    assert (by_host.cluster.node, by_host.cluster.rank) == (host, 3)
    cf = cluster_mod.load(str(tmp_path / "cluster.yaml"))
    assert cluster_mod.find_node(cf, None, "spark-2.lab.example").name == "spark-2"     # the first label
    assert cluster_mod.find_node(cf, "spark-3", "elsewhere").rank == 2
    d["nodes"][3]["name"] = "spark-4"
    write(tmp_path, d)
    with pytest.raises(config.ConfigError) as ei:
        config.from_dict(node_cfg(tmp_path, None), "sg.yaml", MEM)
    assert f"this host ({host}) is none of the nodes (spark-1, spark-2, spark-3, spark-4)" in str(ei.value)
    with pytest.raises(config.ConfigError, match=r"no node called spark-9; the nodes are spark-1, spark-2"):
        config.from_dict(node_cfg(tmp_path, "spark-9"), "sg.yaml", MEM)


def test_a_bad_cluster_section_names_sparkguard_yaml(tmp_path):
    with pytest.raises(config.ConfigError, match=r"^sg.yaml: cluster.file: 'rel.yaml': expected an absolute path"):
        config.from_dict({"cluster": {"file": "rel.yaml"}}, "sg.yaml", MEM)
    with pytest.raises(config.ConfigError, match=r"^sg.yaml: cluster.nodes: .*unknown key; expected one of file, node"):
        config.from_dict({"cluster": {"file": "/x", "nodes": 2}}, "sg.yaml", MEM)
    with pytest.raises(config.ConfigError, match=r"cluster.yaml: cluster file not found"):
        config.from_dict({"cluster": {"file": str(tmp_path / "cluster.yaml")}}, "sg.yaml", MEM)


def _options(argv) -> tuple[list[str], list[tuple[str, ...]]]:
    """(argv up to the model, the option groups after it sorted): flag order is not meaning."""
    argv = list(argv)
    at = argv.index("serve") + 2
    groups: list[list[str]] = []
    for a in argv[at:]:
        if a.startswith("--") or not groups:
            groups.append([a])
        else:
            groups[-1].append(a)
    return argv[:at], sorted(tuple(g) for g in groups)


@pytest.mark.parametrize("n", [2, 4])
def test_the_derivation_equals_the_hand_written_per_node_configs(tmp_path, n):
    with Cluster(n) as c:
        model = unique("sgcf")
        path, cfgs = cluster_file(c, model, tmp_path / "file", lanes={"big": {"args": ["--max-model-len", "9"]}})
        hand = tp_configs(c, model, tmp_path / "hand")
        for k in range(n):
            got = config.from_dict(cfgs[k], f"node{k}.yaml", MEM)
            want = config.from_dict(hand[k], f"hand{k}.yaml", MEM)
            assert _options(got.engine.command) == _options(want.engine.command), k
            assert role_of(got.engine.command) == role_of(want.engine.command)
            assert got.engine.peers == want.engine.peers
            assert (got.engine.health_url, got.engine.head_url) == (want.engine.health_url, want.engine.head_url)
            assert got.metrics.listen == want.metrics.listen
            assert (got.cluster.rank, got.cluster.nnodes, got.cluster.name) == (k, n, f"sgcl-{c.tag}")
            assert got.engine.lanes["big"].args == ("--max-model-len", "9")


# --------------------------------------------------------------------------------------------
# check-config and reload

def test_check_config_prints_the_derivation_and_the_cluster_files_errors(tmp_path):
    write(tmp_path, base())
    p = tmp_path / "sg.yaml"
    p.write_text(yaml.safe_dump(node_cfg(tmp_path, "spark-2")))
    r = run_sparkguard("check-config", str(p))
    assert r.returncode == 0, r.stderr
    out = r.stdout.splitlines()
    assert "  TP cluster: headless, node rank 1 of 4 nodes; peers: 3 (the 3 other nodes)" in out
    assert f"  cluster spark4 ({tmp_path / 'cluster.yaml'}): node spark-2, headless, node rank 1 of 4 nodes" in out
    assert ("  peers: http://10.10.0.1:8799/metrics, http://10.10.0.3:8799/metrics, "
            "http://10.10.0.4:8799/metrics") in out
    assert "  head: http://10.10.0.1:8001/health" in out
    derived = "--nnodes 4 --node-rank 1 --master-addr 10.10.0.1 --master-port 29501 --headless"
    assert (f"  lane 200k: vllm serve /models/m {derived} --tensor-parallel-size 4 --port 8001 "
            "--max-model-len 200000") in out
    assert f"  lane 1m: vllm serve /models/m {derived} --tensor-parallel-size 4 --port 8001 --max-model-len 1000000" in out
    assert "  metrics: http://10.10.0.2:8799/metrics" in out
    d = base()
    d["nodes"][2]["rank"] = 1
    for k, n in enumerate(d["nodes"]):
        n.setdefault("rank", k)
    write(tmp_path, d)
    r = run_sparkguard("check-config", str(p))
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.strip() == (f"sparkguard: invalid config: {tmp_path / 'cluster.yaml'}: nodes[2].rank: 1: two nodes "
                                "claiming one rank: spark-2 and spark-3 both claim rank 1")


def test_a_reload_with_a_broken_cluster_file_keeps_the_running_config(tmp_path):
    """A real daemon, this machine node ``a`` of a 2-node cluster file (node ``b`` not running:
    the head waits for it, which is not under test).  The engine's lanes show which config runs."""
    model = unique("sgcf")
    cmd = fake_cmd(model, None, "--tensor-parallel-size", "2")
    with socket.socket() as s:                  # a free port for the node's metrics (the file's metrics_port)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    d = {"name": "pair", "metrics_port": port,
         "nodes": [{"name": "a", "addr": "127.0.0.1"}, {"name": "b", "addr": "127.0.0.2"}],
         "engine": {"command": cmd, "lanes": {"small": None, "big": None}, "quiesce_timeout": "1h"}}
    write(tmp_path, d)
    local = engine_config(tmp_path, model, cmd, None)
    for k in ("command", "health_url"):
        local["engine"].pop(k, None)
    local.pop("metrics", None)                  # a cluster node serves its metrics where the file says
    local["cluster"] = {"file": str(tmp_path / "cluster.yaml"), "node": "a"}
    daemon = Daemon(tmp_path, local)
    try:
        daemon.wait_control(30)
        r = daemon.ctl("lane", lane="none")
        assert not r["ok"] and "engine.lanes has small, big" in r["error"], r
        broken = copy.deepcopy(d)
        broken["engine"]["lanes"]["huge"] = None
        broken["nodes"][1]["name"] = "a"
        write(tmp_path, broken)
        mark = daemon.mark()
        daemon.proc.send_signal(signal.SIGHUP)
        daemon.wait_line(r"reload failed, keeping the running config: .*cluster.yaml: nodes\[1\].name: 'a': "
                         r"given twice", 20, start=mark)
        r = daemon.ctl("lane", lane="none")
        assert "engine.lanes has small, big" in r["error"] and "huge" not in r["error"], r
        assert daemon.proc.poll() is None
        broken["nodes"][1]["name"] = "b"
        write(tmp_path, broken)
        mark = daemon.mark()
        daemon.proc.send_signal(signal.SIGHUP)
        daemon.wait_line(r"reloaded .*sparkguard.yaml", 20, start=mark)
        r = daemon.ctl("lane", lane="none")
        assert "engine.lanes has small, big, huge" in r["error"], r
        # the cluster file's engine.lane changed: this node keeps its lane and says how to switch the cluster
        lane = daemon.status()["lane"]
        assert lane == "small", daemon.status()
        broken["engine"]["lane"] = "big"
        write(tmp_path, broken)
        mark = daemon.mark()
        daemon.proc.send_signal(signal.SIGHUP)
        daemon.wait_line(r"engine.lane changed from small to big in the cluster file .*cluster.yaml: a cluster node "
                         r"does not switch lanes alone .* it stays in lane small; 'sparkguard cluster lane big' "
                         r"switches the whole cluster", 20, start=mark)
        daemon.wait_line(r"reloaded .*sparkguard.yaml", 20, start=mark)
        assert daemon.status()["lane"] == "small" and daemon.status()["want"] == "run", daemon.status()
    finally:
        daemon.cleanup()


# --------------------------------------------------------------------------------------------
# end to end: two nodes started from one cluster file

FAST = {"health_interval": "500ms", "stable_for": "0s", "quiesce_timeout": "60s"}


def test_two_nodes_started_from_the_cluster_file_serve_as_one_engine_and_recover(tmp_path):
    with Cluster(2) as c:
        c.model = unique("sgcf")
        _, cfgs = cluster_file(c, c.model, tmp_path, engine=FAST, load_time=0.5)
        head, rank = start_nodes(c, cfgs, tmp_path)
        for d in (head, rank):
            d.wait_control(60)
        head.wait_ready(timeout=60)
        deadline = time.monotonic() + 30
        while rank.status()["state"] != "ready":
            assert time.monotonic() < deadline, rank.status()
            time.sleep(0.2)
        hs, rs = head.status(), rank.status()
        assert rs["joined"] == hs["run_start"] and hs["group"]["1"] == rs["run_start"]
        # every node serves its metrics on its own link address, as the cluster file derives
        for d, node in ((head, c.nodes[0]), (rank, c.nodes[1])):
            status, body = c.hub.http_get(f"http://{node.addr}:8799/metrics")
            assert status == 200 and b"sparkguard_engine_role_info" in body
        status, _ = c.hub.http_get(f"http://{c.nodes[0].addr}:8000/health")
        assert status == 200
        run0 = rs["run_start"]
        head.kill_engine()
        deadline = time.monotonic() + 30
        while rank.status()["run_start"] in (run0, None):
            assert time.monotonic() < deadline, "the rank did not restart after its head was killed"
            time.sleep(0.2)
        head.wait_ready(after=1, timeout=45)
        deadline = time.monotonic() + 30
        while not ((s := rank.status())["state"] == "ready" and s["joined"] == head.status()["run_start"]):
            assert time.monotonic() < deadline, rank.status()
            time.sleep(0.2)
        assert head.status()["group"]["1"] == rank.status()["run_start"]

"""``sparkguard.cluster.ssh.run_all`` against real OpenSSH servers, one per node namespace
(tests/sshnodes.py), the client run in the hub namespace: the remote sparkguard's output and
exit status per node, an unreachable node's result saying so with ssh's own line, a node whose
host key is not the known one refused (strict host keys, no prompt in BatchMode).
"""

from __future__ import annotations

import os
import shlex

import pytest

import sparkguard
from netcluster import Cluster
from sparkguard.cluster import ssh
from sparkguard.cluster.model import ClusterFile, ClusterNode
from sshnodes import SshNodes

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (network namespaces, sshd)")


def cluster_file(c: Cluster, s: SshNodes, **kw) -> ClusterFile:
    nodes = tuple(ClusterNode(name=f"n{n.rank}", rank=n.rank, addr=n.addr, ssh=n.addr, metrics_port=8799,
                              **kw) for n in c.nodes)
    return ClusterFile(path="<test>", name="t", nodes=nodes, engine={}, ssh_options=s.ssh_options,
                       remote_sparkguard=s.remote_sparkguard)


@pytest.fixture
def hub_ssh(monkeypatch):
    """Point ssh.SSH at the hub namespace of the cluster given to the returned function."""
    def use(s: SshNodes) -> None:
        monkeypatch.setattr(ssh, "SSH", s.ssh_cmd())
    return use


def test_run_all_runs_the_checkouts_sparkguard_on_every_node_and_reports_exit_status(tmp_path, hub_ssh):
    with Cluster(2) as c, SshNodes(c, tmp_path) as s:
        hub_ssh(s)
        cf = cluster_file(c, s)
        res = ssh.run_all(cf, cf.nodes, ["--version"], timeout=30)
        assert list(res) == ["n0", "n1"]
        for r in res.values():
            assert r.ok and r.rc == 0, r
            assert sparkguard.__version__ in r.stdout, r
            assert 0 < r.seconds < 30
        # the remote command's own failure: its exit status and message, not "unreachable"
        missing = str(tmp_path / "no such dir" / "sparkguard.yaml")
        cf = cluster_file(c, s, config=missing)
        res = ssh.run_all(cf, cf.nodes, ["engine", "status"], timeout=30)
        for r in res.values():
            assert not r.ok and not r.ssh_error and r.rc not in (0, None, 255), r
            assert r.error.startswith(f"exit status {r.rc}: "), r
            assert "sparkguard" in r.error, r
        # the argument with a space reached the remote argv as one argument
        assert shlex.quote(missing) in ssh.ssh_argv(cf, cf.nodes[0], ["engine", "status"])[-1]


def test_a_node_whose_sshd_is_stopped_is_reported_unreachable_and_the_other_still_runs(tmp_path, hub_ssh):
    with Cluster(2) as c, SshNodes(c, tmp_path) as s:
        hub_ssh(s)
        s.stop(c.nodes[1])
        cf = cluster_file(c, s)
        res = ssh.run_all(cf, cf.nodes, ["--version"], timeout=30)
        assert res["n0"].ok, res["n0"]
        bad = res["n1"]
        assert bad.ssh_error and bad.rc == 255, bad
        assert "Connection refused" in bad.error and c.nodes[1].addr in bad.error, bad.error
        assert ssh.describe(bad).startswith("n1: unreachable over SSH: ssh: connect to host")


def test_a_wrong_host_key_is_refused_without_running_anything(tmp_path, hub_ssh):
    with Cluster(2) as c, SshNodes(c, tmp_path) as s:
        hub_ssh(s)
        # node 1's entry in known_hosts is node 0's key: node 1 presents a key that is not the known one
        lines = s.known_hosts.read_text().splitlines()
        lines[1] = f"{c.nodes[1].addr} {lines[0].split(' ', 1)[1]}"
        s.known_hosts.write_text("\n".join(lines) + "\n")
        marker = tmp_path / "ran"
        cf = cluster_file(c, s)
        cf = ClusterFile(**{**cf.__dict__, "remote_sparkguard": ("touch", str(marker))})
        res = ssh.run_all(cf, cf.nodes[1:], [], timeout=30)
        r = res["n1"]
        assert r.ssh_error and r.rc == 255, r
        assert "Host key verification failed" in r.error, r
        assert not marker.exists()


def test_a_remote_command_past_the_timeout_is_cut_off(tmp_path, hub_ssh):
    with Cluster(1) as c, SshNodes(c, tmp_path) as s:
        hub_ssh(s)
        cf = cluster_file(c, s)
        cf = ClusterFile(**{**cf.__dict__, "remote_sparkguard": ("sleep", "30")})
        r = ssh.run_all(cf, cf.nodes, [], timeout=2)["n0"]
        assert r.rc is None and r.error == "timed out after 2 s", r
        assert r.seconds < 10


def test_a_key_the_node_does_not_authorize_is_an_ssh_failure_not_a_remote_one(tmp_path, hub_ssh):
    with Cluster(1) as c, SshNodes(c, tmp_path) as s:
        hub_ssh(s)
        s.authorized_keys.write_text("")       # sshd reads AuthorizedKeysFile at each login
        cf = cluster_file(c, s)
        r = ssh.run_all(cf, cf.nodes, ["--version"], timeout=30)["n0"]
        assert r.ssh_error and r.rc == 255, r
        assert "Permission denied (publickey" in r.error, r

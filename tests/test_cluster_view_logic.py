"""``sparkguard.cluster.view``: the verdict on crafted statuses, the parse of a real sparkguard
exposition's families, and :func:`read` against real TCP endpoints (one serving, one refusing,
one that never answers) so an unreachable node is a row, not an exception, and reads run at once."""

from __future__ import annotations

import http.server
import socket
import threading
import time
from dataclasses import replace

import pytest

from conftest import run_sparkguard
from sparkguard.cluster.model import ClusterFile, ClusterNode, NodeStatus
from sparkguard.cluster import view

RUN = 1_700_000_000.5


def node(rank: int, port: int = 9, addr: str = "127.0.0.1") -> ClusterNode:
    return ClusterNode(name=f"gx{rank + 1}", rank=rank, addr=addr, ssh=f"root@gx{rank + 1}", metrics_port=port)


def serving_statuses(n: int = 2, lane: str | None = "200k") -> list[NodeStatus]:
    out = [NodeStatus(node=node(0), up=True, role="head", node_rank=0, state="ready", lane=lane, ready=True,
                      run_start=RUN)]
    for k in range(1, n):
        out.append(NodeStatus(node=node(k), up=True, role="headless", node_rank=k, state="ready", lane=lane,
                              ready=True, run_start=RUN + k, joined_run_start=RUN))
    return out


def test_serving_when_every_rank_joined_the_heads_run_in_its_lane():
    word, detail = view.verdict(serving_statuses(4))
    assert word == "serving"
    assert "200k" in detail and "4 nodes" in detail


def test_down_when_no_node_answers():
    sts = [NodeStatus(node=node(k), up=False, error="connection refused") for k in range(2)]
    word, detail = view.verdict(sts)
    assert word == "down" and "gx1" in detail and "connection refused" in detail


def test_one_node_down_is_degraded_and_named():
    sts = serving_statuses(4)
    sts[2] = NodeStatus(node=node(2), up=False, error="timed out")
    word, detail = view.verdict(sts)
    assert word == "degraded" and "gx3 (rank 2) down: timed out" in detail


@pytest.mark.parametrize("rank,change,said", [
    (0, {"ready": False, "state": "starting"}, "head gx1 not ready (state starting)"),
    (1, {"ready": False, "state": "waiting_for_head"}, "gx2 (rank 1) joined the head's run but is not ready"),
    (1, {"joined_run_start": RUN - 100}, "gx2 (rank 1) has not joined the head's run (state ready)"),
    (1, {"joined_run_start": None, "state": "waiting_for_head"}, "gx2 (rank 1) has not joined"),
])
def test_a_head_not_ready_or_a_rank_outside_its_run_is_degraded(rank, change, said):
    sts = serving_statuses(2)
    sts[rank] = replace(sts[rank], **change)
    word, detail = view.verdict(sts)
    assert word == "degraded" and said in detail, detail


def test_head_without_a_run_means_no_rank_joined():
    sts = serving_statuses(2)
    sts[0] = replace(sts[0], run_start=None, ready=False, state="waiting")
    sts[1] = replace(sts[1], joined_run_start=None)
    word, detail = view.verdict(sts)
    assert word == "degraded" and "head gx1 not ready" in detail and "gx2 (rank 1) has not joined" in detail


def test_lane_mismatch_names_each_lanes_nodes():
    sts = serving_statuses(4)
    sts[0] = replace(sts[0], lane="1m")
    word, detail = view.verdict(sts)
    assert word == "lane mismatch"
    assert "1m: gx1" in detail and "200k: gx2, gx3, gx4" in detail


def test_lane_mismatch_wins_over_given_up_and_a_node_down():
    sts = serving_statuses(3)
    sts[1] = replace(sts[1], lane="1m", given_up=True)
    sts[2] = NodeStatus(node=node(2), up=False, error="refused")
    assert view.verdict(sts)[0] == "lane mismatch"


def test_given_up_is_named():
    sts = serving_statuses(2)
    sts[1] = replace(sts[1], given_up=True, state="given_up", ready=False)
    word, detail = view.verdict(sts)
    assert word == "given up" and "gx2 (rank 1)" in detail


def test_a_cluster_stopped_on_purpose_is_stopped_not_degraded():
    sts = [replace(s, state="stopped", ready=False, run_start=None, joined_run_start=None)
           for s in serving_statuses(3)]
    assert view.verdict(sts) == ("stopped", "every node's engine is stopped (3 nodes); "
                                            "'sparkguard cluster start' starts them")
    # one node still running, or one not answering: degraded, named
    assert view.verdict(sts[:2] + [serving_statuses(3)[2]])[0] == "degraded"
    assert view.verdict(sts[:2] + [replace(sts[2], up=False, error="refused")])[0] == "degraded"


def test_nodes_on_different_cluster_files_are_named_by_digest():
    sts = serving_statuses(3)
    sts = [replace(s, digest=d) for s, d in zip(sts, ("aaaaaaaaaaaa", "bbbbbbbbbbbb", "aaaaaaaaaaaa"))]
    word, detail = view.verdict(sts)
    assert word == "cluster file differs", (word, detail)
    assert detail == "digest aaaaaaaaaaaa: gx1, gx3; digest bbbbbbbbbbbb: gx2", detail
    # a node that does not say (an older sparkguard) is no difference
    assert view.verdict([replace(s, digest=None) if k == 1 else s for k, s in enumerate(sts[:2])])[0] == "serving"


def test_a_node_with_another_rank_than_the_file_is_degraded():
    sts = serving_statuses(2)
    sts[1] = replace(sts[1], node_rank=3)
    word, detail = view.verdict(sts)
    assert word == "degraded" and "gx2 runs as rank 3" in detail


EXPOSITION = """\
# HELP sparkguard_memory_available_bytes MemAvailable
# TYPE sparkguard_memory_available_bytes gauge
sparkguard_memory_available_bytes 1.2345e+11
# HELP sparkguard_cluster_info The cluster
# TYPE sparkguard_cluster_info gauge
sparkguard_cluster_info{cluster="lab",node="gx2",node_rank="1",nnodes="2",digest="0123456789ab"} 1.0
# HELP sparkguard_engine_role_info role
# TYPE sparkguard_engine_role_info gauge
sparkguard_engine_role_info{nnodes="2",node_rank="1",role="headless"} 1.0
# HELP sparkguard_engine_state state
# TYPE sparkguard_engine_state gauge
sparkguard_engine_state{state="starting"} 0.0
sparkguard_engine_state{state="ready"} 1.0
# HELP sparkguard_engine_ready ready
# TYPE sparkguard_engine_ready gauge
sparkguard_engine_ready 1.0
# HELP sparkguard_engine_given_up g
# TYPE sparkguard_engine_given_up gauge
sparkguard_engine_given_up 0.0
# HELP sparkguard_engine_lane_info lane
# TYPE sparkguard_engine_lane_info gauge
sparkguard_engine_lane_info{lane="500k"} 1.0
# HELP sparkguard_engine_lanes_info lanes
# TYPE sparkguard_engine_lanes_info gauge
sparkguard_engine_lanes_info{lane="200k"} 1.0
sparkguard_engine_lanes_info{lane="500k"} 1.0
# HELP sparkguard_engine_run_start_timestamp_seconds r
# TYPE sparkguard_engine_run_start_timestamp_seconds gauge
sparkguard_engine_run_start_timestamp_seconds 1.7000000015e+09
# HELP sparkguard_engine_joined_run_start_timestamp_seconds j
# TYPE sparkguard_engine_joined_run_start_timestamp_seconds gauge
sparkguard_engine_joined_run_start_timestamp_seconds 1.7000000005e+09
# HELP sparkguard_last_incident_info last
# TYPE sparkguard_last_incident_info gauge
sparkguard_last_incident_info{id="20261201T101010Z-memory-1",kind="memory"} 1.0
"""


def test_parse_reads_every_field_of_the_status():
    st = view.parse(node(1), EXPOSITION)
    assert st.up and st.error is None
    assert (st.node_name, st.nnodes, st.digest) == ("gx2", 2, "0123456789ab")
    assert (st.cluster, st.role, st.node_rank, st.state) == ("lab", "headless", 1, "ready")
    assert st.lane == "500k" and st.lanes == ("200k", "500k")
    assert st.ready and not st.given_up
    assert st.run_start == 1700000001.5 and st.joined_run_start == 1700000000.5
    assert st.mem_available == 123450000000
    assert st.last_incident == ("20261201T101010Z-memory-1", "memory")


class _Page(http.server.BaseHTTPRequestHandler):
    """Serves :meth:`page` (EXPOSITION) to every GET."""

    def page(self) -> bytes:
        return EXPOSITION.encode()

    def do_GET(self):  # noqa: N802 - http.server's name
        body = self.page()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *a):
        pass


@pytest.fixture
def endpoints():
    """(serving port, refusing port, silent port): a real HTTP server, a closed port, and a
    listener that accepts and never answers."""
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Page)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    refused = closed.getsockname()[1]
    closed.close()
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    try:
        yield srv.server_address[1], refused, silent.getsockname()[1]
    finally:
        srv.shutdown()
        srv.server_close()
        silent.close()


def test_read_gives_every_node_in_rank_order_and_never_raises(endpoints):
    ok, refused, silent = endpoints
    cf = ClusterFile(path="c.yaml", name="lab", engine={},
                     nodes=(node(0, ok), node(1, refused), node(2, silent), node(3, silent)))
    t0 = time.monotonic()
    sts = view.read(cf, timeout=1.0)
    took = time.monotonic() - t0
    assert [s.node.rank for s in sts] == [0, 1, 2, 3]
    assert sts[0].up and sts[0].lane == "500k"
    assert not sts[1].up and "refused" in sts[1].error.lower()
    assert not sts[2].up and not sts[3].up and sts[2].error
    assert took < 1.0 + view.SLACK + 0.5, f"the two silent nodes were read one after the other ({took:.2f} s)"


def test_a_bad_cluster_file_exits_2_naming_the_file_and_key(tmp_path):
    missing = tmp_path / "nope.yaml"
    r = run_sparkguard("cluster", "status", "--cluster", str(missing))
    assert r.returncode == 2 and str(missing) in r.stderr and "not found" in r.stderr, r.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: lab\nnodes: [{name: a, addr: 10.0.0.1}]\nengine: {command: [vllm, serve, m]}\n")
    r = run_sparkguard("cluster", "incidents", "--cluster", str(bad))
    assert r.returncode == 2 and f"{bad}: nodes:" in r.stderr, r.stderr

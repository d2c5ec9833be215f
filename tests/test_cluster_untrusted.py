"""Another node's answers are untrusted input: ``sparkguard cluster`` and ``sparkguard status
--url`` name a node whose answer is hostile or malformed (wrong types, JSON nested past the
recursion limit, timestamps of 1e300, NaN or negative, terminal control sequences) and keep
going, never crash, never print a control character.

The "nodes" are real processes: ``ssh.SSH`` is pointed at tests/fakes/fake_ssh.py, which prints
the file named after the destination (what that node "answered") instead of reaching a host.
"""

from __future__ import annotations

import http.server
import io
import json
import re
import sys
import threading
from pathlib import Path

import pytest

from sparkguard import status_gather, status_render, untrusted
from sparkguard.cluster import cli, ops, ssh
from sparkguard.cluster.model import ClusterFile, ClusterNode, NodeStatus
from test_cluster_view_logic import _Page

FAKE_SSH = Path(__file__).parent / "fakes" / "fake_ssh.py"
CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
ESC = "\x1b]0;owned\x07\x1b[2J"
ID = "20261201T101010Z-3f9a10"
DEEP = "[" * 200_000 + "]" * 200_000


def answering(tmp_path, monkeypatch, answers: dict[str, str]) -> ClusterFile:
    """A cluster whose node ``name`` answers every command with ``answers[name]`` (through the
    fake ssh, a real process per node)."""
    for name, text in answers.items():
        (tmp_path / name).write_text(text)
    monkeypatch.setattr(ssh, "SSH", (sys.executable, str(FAKE_SSH), str(tmp_path)))
    nodes = tuple(ClusterNode(name=n, rank=k, addr=f"10.0.0.{k + 1}", ssh=n, metrics_port=8799)
                  for k, n in enumerate(answers))
    return ClusterFile(path="<test>", name="c", nodes=nodes, engine={})


def status_answer(**st) -> str:
    return json.dumps({"ok": True, "status": {"state": "ready", "lane": "small", "lanes": ["small"], **st}})


def test_preflight_names_every_node_with_a_bad_answer_and_reads_the_good_one(tmp_path, monkeypatch):
    cf = answering(tmp_path, monkeypatch, {
        "good": status_answer(role={"role": "head", "node_rank": 0}),
        "deep": DEEP,
        "lanes": status_answer(lanes="small"),
        "lane": status_answer(lane=["small"]),
        "role": status_answer(role="head"),
        "rank": status_answer(role={"role": "head", "node_rank": "0"}),
        "time": status_answer(run_start="yesterday"),
        "esc": ESC,
    })
    statuses, failures = ops.preflight(cf)
    assert [s.node.name for s in statuses] == ["good"] and statuses[0].node_rank == 0
    by = {f.split(":", 1)[0]: f for f in failures}
    assert sorted(by) == ["deep", "esc", "lane", "lanes", "rank", "role", "time"], failures
    assert "nested too deeply" in by["deep"], by["deep"]
    assert "lanes: expected a list of strings" in by["lanes"]
    assert "lane: expected a string" in by["lane"]
    assert "role: expected a mapping" in by["role"]
    assert "role.node_rank: expected a whole number" in by["rank"]
    assert "run_start: expected unix seconds" in by["time"]
    assert not any(CONTROL.search(f) for f in failures), failures


def test_the_operation_fails_naming_the_node_and_stops_nothing(tmp_path, monkeypatch):
    cf = answering(tmp_path, monkeypatch, {"n0": status_answer(), "n1": DEEP})
    out, err = io.StringIO(), io.StringIO()
    assert ops.execute(cf, "restart", out=out, err=err, read=lambda c, t: []) == ops.EXIT_FAILED
    assert "n1: unreadable 'engine status --json': JSON nested too deeply" in err.getvalue(), err.getvalue()
    assert "failed before anything was stopped" in err.getvalue()


def record(**kw) -> dict:
    return {"id": ID, "kind": "memory", "outcome": "recovered", "started_at": 1.7e9, **kw}


def test_incidents_with_hostile_records_are_listed_with_question_marks_and_no_control_characters(
        tmp_path, monkeypatch):
    recs = [record(started_at=1e300), record(id=ID[:-1] + "b", started_at=float("nan")),
            record(id=ID[:-1] + "c", started_at=-5), record(id=ID[:-1] + "d", kind=ESC, outcome={"x": 1}),
            record(id=ID[:-1] + "e", timeline="not a list", meminfo=[1])]
    cf = answering(tmp_path, monkeypatch, {"n0": json.dumps(recs), "n1": DEEP, "n2": json.dumps({"a": 1})})
    out = io.StringIO()
    rc = cli.show_incidents(cf, None, 0, False, 10, out=out)
    text = out.getvalue()
    assert rc == 1
    assert not CONTROL.search(text.replace("\n", "")), text
    rows = {ln.split()[1]: ln for ln in text.splitlines() if ln.startswith("n0 ")}
    assert len(rows) == 5, text
    for suffix in "0bc":
        assert rows[ID[:-1] + suffix].split()[2] == "?", rows
    assert "?]0;owned??[2J" in rows[ID[:-1] + "d"], rows
    assert "not read: n1: its 'sparkguard incidents --json' printed no incident list (JSON nested too deeply)" \
        in text, text
    assert "not read: n2: its 'sparkguard incidents --json' printed no incident list (expected a JSON list" \
        in text, text
    # one report by id (NODE:ID asks that node only): shown (or said it cannot be), never a traceback
    for r in recs:
        (tmp_path / "n0").write_text(json.dumps(r))
        out = io.StringIO()
        assert cli.show_incidents(cf, "n0:" + r["id"], 0, False, 10, out=out) == 0
        assert out.getvalue().startswith("Node: n0 (rank 0, n0)\n"), out.getvalue()
        assert not CONTROL.search(out.getvalue().replace("\n", "")), out.getvalue()
        assert (tmp_path / "n0.cmd").read_text().splitlines()[-1].endswith(f"incidents {r['id']} --json")
    assert ID not in (tmp_path / "n1.cmd").read_text()               # the other nodes were not asked


def test_incidents_passes_the_operators_limit_to_every_node(tmp_path, monkeypatch):
    cf = answering(tmp_path, monkeypatch, {"n0": json.dumps([record()]), "n1": "[]"})
    assert cli.show_incidents(cf, None, 7, False, 10, out=io.StringIO()) == 0
    for n in ("n0", "n1"):
        assert (tmp_path / f"{n}.cmd").read_text().splitlines() == ["sparkguard incidents --json --limit 7"]


def test_a_long_listing_is_kept_up_to_the_incidents_cap_and_a_longer_one_named(tmp_path, monkeypatch):
    big = [record(id=f"20261201T1010{k // 60:02d}Z-{k:06x}", summary="x" * 2000) for k in range(400)]
    text = json.dumps(big)
    assert len(text) > ssh.MAX_OUTPUT                                  # more than ssh's default cap
    cf = answering(tmp_path, monkeypatch, {"n0": text, "n1": "[]"})
    entries, failed = cli.gather_incidents(cf, 10)
    assert failed == [] and len(entries) == 400
    monkeypatch.setattr(cli, "INCIDENTS_OUTPUT", 1 << 20)
    (tmp_path / "n0").write_text(json.dumps(big * 2))
    entries, failed = cli.gather_incidents(cf, 10)
    assert failed == ["n0: its 'sparkguard incidents --json' printed more than 1 MiB (cut); use --limit or an ID"]


def test_status_rows_of_a_hostile_node_are_printable(tmp_path):
    n = ClusterNode(name="n0", rank=0, addr="10.0.0.1", ssh="n0", metrics_port=8799)
    sts = [NodeStatus(node=n, up=True, role="head" + ESC, node_rank=0, state=ESC, lane=ESC, ready=True,
                      run_start=1e300, mem_available=10 ** 40, last_incident=(ID, ESC), cluster="x" + ESC),
           NodeStatus(node=n, up=False, error="no answer" + ESC)]
    cf = ClusterFile(path="<test>", name="c", nodes=(n,), engine={})
    lines, _word = cli.status_lines(cf, sts)
    assert not any(CONTROL.search(ln) for ln in lines), lines
    assert lines[1].split()[6] == "?" and lines[1].split()[7] == "?", lines[1]


def test_untrusted_stamp_and_loads():
    for t in (1e300, float("nan"), float("inf"), -5, "1700000000", True, None):
        assert untrusted.stamp(t) == "?", t
    assert untrusted.stamp(0, utc=True) == "1970-01-01 00:00:00"
    with pytest.raises(ValueError, match="deeper than 64"):
        untrusted.loads("[" * 70 + "]" * 70)
    assert untrusted.loads("[" * 60 + "]" * 60)
    assert untrusted.clean("a\x1b[31mb\u202ec\r\n") == "a?[31mb?c??"


HOSTILE_PAGE = f"""\
# TYPE sparkguard_memory_available_bytes gauge
sparkguard_memory_available_bytes NaN
# TYPE sparkguard_memory_total_bytes gauge
sparkguard_memory_total_bytes 1e300
# TYPE sparkguard_start_time_seconds gauge
sparkguard_start_time_seconds -5
# TYPE sparkguard_last_incident_timestamp_seconds gauge
sparkguard_last_incident_timestamp_seconds 1e300
# TYPE sparkguard_incidents_total counter
sparkguard_incidents_total{{kind="memory"}} NaN
# TYPE sparkguard_guard_state gauge
sparkguard_guard_state{{state="ok\\u001b[2J"}} 1
# TYPE sparkguard_engine_state gauge
sparkguard_engine_state{{state="ready"}} 1
# TYPE sparkguard_engine_run_start_timestamp_seconds gauge
sparkguard_engine_run_start_timestamp_seconds 1e300
# TYPE sparkguard_build_info gauge
sparkguard_build_info{{version="9{ESC.replace(chr(7), '').replace(chr(27), '')}"}} 1
"""


class _Hostile(_Page):
    def page(self) -> bytes:
        return HOSTILE_PAGE.replace("\\u001b", "\x1b").encode()


def test_status_url_of_a_hostile_endpoint_shows_question_marks_and_no_control_characters():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Hostile)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        st = status_gather.gather_remote(f"http://127.0.0.1:{srv.server_address[1]}/metrics")
    finally:
        srv.shutdown()
        srv.server_close()
    d = st["daemon"]
    assert d["running"] and d["available_bytes"] is None and d["incidents"] == {"memory": "?"}, d
    text = status_render.render_remote(st)
    assert not CONTROL.search(text.replace("\n", "")), text
    assert "run started ?" in text and "up ?" in text, text
    assert "last incident ? (? ago)" in text, text


INTERRUPTED = """\
import sys
from sparkguard.cluster import ops, ssh
from sparkguard.cluster.model import ClusterFile, ClusterNode, NodeStatus
ssh.SSH = (sys.executable, sys.argv[1], sys.argv[2])
nodes = tuple(ClusterNode(name=n, rank=k, addr=f"10.0.0.{k + 1}", ssh=n, metrics_port=8799)
              for k, n in enumerate(("n0", "n1")))
cf = ClusterFile(path="<test>", name="c", nodes=nodes, engine={})
read = lambda c, t: [NodeStatus(node=n, up=True, state="stopping", lane="small") for n in c.nodes]
sys.exit(ops.execute(cf, "restart", read=read))
"""


def test_ctrl_c_ends_the_ssh_children_and_says_what_state_the_cluster_is_left_in(tmp_path, monkeypatch):
    import os
    import signal
    import subprocess
    import time
    from conftest import sg_env
    for k, n in enumerate(("n0", "n1")):
        (tmp_path / n).write_text(status_answer(cluster={"name": "c", "node": n, "rank": k, "nnodes": 2},
                                                role={"role": "headless" if k else "head", "node_rank": k}))
        (tmp_path / f"{n}.hang").write_text("engine stop")     # the stop never returns
    script = tmp_path / "run.py"
    script.write_text(INTERRUPTED)
    p = subprocess.Popen([sys.executable, str(script), str(FAKE_SSH), str(tmp_path)], env=sg_env(),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not all((tmp_path / f"{n}.hung").exists() for n in ("n0", "n1")):   # both stops running
            assert time.monotonic() < deadline and p.poll() is None, p.communicate()
            time.sleep(0.05)
        hung = [int((tmp_path / f"{n}.hung").read_text()) for n in ("n0", "n1")]
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == ops.EXIT_INTERRUPTED, err
    assert "Traceback" not in err, err
    assert "sparkguard cluster restart: interrupted during 'stop' on n0, n1; 2 ssh command(s) ended" in err, err
    assert "the cluster is left as it is: n0 head stopping lane small; n1 headless stopping lane small" in err, err
    assert "nothing more is done" in err, err
    for pid in hung:                               # killed: gone, or a zombie its parent did not reap
        try:
            state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            continue
        assert state == "Z", (pid, state)

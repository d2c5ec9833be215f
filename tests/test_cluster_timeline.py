"""``sparkguard.cluster.timeline`` on crafted records: one timeline newest first with ties by
node rank, a record without a start last, lookup by id / prefix / NODE:ID, the table's columns,
the report naming its node, and a node's output that is not an incident list refused."""

from __future__ import annotations

import json

import pytest

from sparkguard.cluster import timeline
from sparkguard.cluster.model import ClusterNode

T = 1_780_000_000.0


def node(rank: int) -> ClusterNode:
    return ClusterNode(name=f"gx{rank + 1}", rank=rank, addr=f"10.0.0.{rank + 1}", ssh=f"root@gx{rank + 1}",
                       metrics_port=8799)


def rec(iid: str, at: float | None, kind: str = "memory") -> dict:
    r = {"id": iid, "kind": kind, "outcome": "recovered", "ended_at": None if at is None else at + 2.5}
    if at is not None:
        r["started_at"] = at
    return r


def merged() -> list[timeline.Entry]:
    return timeline.merge([
        (node(2), [rec("c-late", T + 30), rec("c-tie", T + 10)]),
        (node(0), [rec("a-tie", T + 10, "link"), rec("a-old", T)]),
        (node(1), [rec("b-nostart", None), rec("b-tie", T + 10, "wedged")]),
    ])


def test_newest_first_ties_by_node_rank_and_no_start_last():
    got = [(e.node.name, e.id) for e in merged()]
    assert got == [("gx3", "c-late"), ("gx1", "a-tie"), ("gx2", "b-tie"), ("gx3", "c-tie"), ("gx1", "a-old"),
                   ("gx2", "b-nostart")]


def test_a_start_that_is_not_a_finite_number_sorts_last():
    es = timeline.merge([(node(0), [rec("a-nan", float("nan")), rec("a-ok", T), {"id": "a-str", "started_at": "x"}])])
    assert [e.id for e in es][0] == "a-ok"


def test_find_by_id_prefix_and_node():
    es = merged()
    assert [e.id for e in timeline.find(es, "c-late")] == ["c-late"]
    assert sorted(e.node.name for e in timeline.find(es, "a-")) == ["gx1", "gx1"]
    assert len(timeline.find(es, "b-t")) == 1
    assert [e.id for e in timeline.find(es, "gx3:c-t")] == ["c-tie"]
    assert timeline.find(es, "gx1:c-late") == [] and timeline.find(es, "zzz") == []


def test_the_same_id_on_two_nodes_stays_two_entries_told_apart_by_node():
    es = timeline.merge([(node(0), [rec("same", T)]), (node(1), [rec("same", T)])])
    assert [e.node.name for e in timeline.find(es, "same")] == ["gx1", "gx2"]
    assert [e.node.name for e in timeline.find(es, "gx2:same")] == ["gx2"]


def test_table_has_a_node_column_and_says_how_many_are_not_shown():
    lines = timeline.table(merged(), limit=2)
    assert lines[0].split()[:3] == ["NODE", "ID", "STARTED"]
    assert lines[1].split()[:2] == ["gx3", "c-late"] and lines[2].split()[:2] == ["gx1", "a-tie"]
    assert "link" in lines[2]
    assert lines[-1] == "(4 older not shown; --limit 0 lists all)"
    assert len(timeline.table(merged())) == 7


def test_report_names_the_node_and_json_carries_it():
    e = timeline.find(merged(), "b-tie")[0]
    text = timeline.report(e)
    assert text.startswith("Node: gx2 (rank 1, root@gx2)\n") and "b-tie" in text
    js = timeline.as_json(merged())
    assert js[0]["node"] == "gx3" and js[0]["id"] == "c-late"


def test_parse_listing_keeps_records_with_an_id_and_refuses_what_is_no_list():
    text = json.dumps([rec("ok-1", T), {"id": "../evil"}, {"no": "id"}, 3])
    assert [r["id"] for r in timeline.parse_listing(text)] == ["ok-1"]
    with pytest.raises(ValueError):
        timeline.parse_listing('{"id": "x"}')
    with pytest.raises(ValueError):
        timeline.parse_listing("sparkguard: command not found")

"""The incident model (sparkguard.model) against its contract (docs/incident.md) and against
what the real daemon writes (the golden incidents of tests/golden, recorded from real runs)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from sparkguard import meminfo, model, sysinfo

ROOT = Path(__file__).resolve().parent.parent
DOC = (ROOT / "docs" / "incident.md").read_text()
GOLDEN = sorted((ROOT / "tests" / "golden").glob("*/expected/incident.json"))


def doc_fields() -> list[str]:
    """The field names of the "Fields, in order" table, in order."""
    table = DOC.split("## Fields, in order", 1)[1].split("\n\n", 2)[1]
    return re.findall(r"^\| `([a-z_]+)` \|", table, re.M)


def doc_keys(name: str) -> list[str]:
    """The backquoted keys of the paragraph that starts with ``**name**``: ..."""
    para = DOC.split(f"**{name}**", 1)[1].split("\n\n", 1)[0]
    return re.findall(r"`([a-z_]+)` \(", para)


def row_keys(name: str) -> list[str]:
    """The backquoted keys of the table row of field ``name``."""
    row = re.search(rf"^\| `{name}` \|.*$", DOC, re.M).group(0)
    return re.findall(r"`([a-z_]+)` \(", row)


def memory_incident() -> model.Incident:
    raw = b"MemTotal:       25165824 kB\nMemAvailable:     775946 kB\nHugePages_Total:       0\n"
    inc = model.new_incident("memory", 1_700_000_000.5, model.Thresholds(1 << 30, None, 10.0, "available"), raw,
                             host="spark", boot_id="ab" * 16)
    inc.timeline.append(model.Event("crossed", 0.0, 1_700_000_000.5, 900, [], "crossed"))
    inc.target = model.Target(4242, "vllm serve m", "vllm serve m", 3 << 30,
                              [model.TreeRow(4242, 1, "vllm serve m", "python3", "vllm serve m", 1 << 30, 0, 900)])
    inc.outcome, inc.ended_at, inc.min_available_bytes = "terminated", 1_700_000_003.0, 900
    return inc


def test_the_daemons_incidents_have_the_documented_fields_in_the_documented_order():
    fields = doc_fields()
    assert fields[:3] == ["id", "kind", "drill"] and "engine" in fields
    assert GOLDEN, "no golden incident to check against"
    for path in GOLDEN:
        rec = json.loads(path.read_text())
        keys = list(rec)
        assert set(keys) <= set(fields), (path, set(keys) - set(fields))
        assert keys == [f for f in fields if f in rec], path
        for ev in rec["timeline"]:
            assert list(ev) == doc_keys("event"), path
        for row in rec["target"]["tree"] if rec["target"] else []:
            assert list(row) == doc_keys("tree row"), path


def test_to_json_writes_what_the_golden_incidents_hold_in_their_order():
    rec = memory_incident().to_json()
    golden = json.loads(GOLDEN[0].read_text())
    assert list(rec) == list(golden)
    assert list(rec["thresholds"]) == list(golden["thresholds"])
    assert list(rec["timeline"][0]) == list(golden["timeline"][0])
    assert list(rec["target"]) == list(golden["target"])
    assert list(rec["target"]["tree"][0]) == list(golden["target"]["tree"][0])
    assert json.loads(json.dumps(rec)) == rec


def test_every_kind_writes_only_documented_fields_in_order():
    fields = doc_fields()
    link = model.new_incident("link", 1.0, model.LinkThresholds(5.0), {"MemAvailable": 1}, outcome="link_down",
                              link=model.Link("eth7", None, "DOWN", False, True, 5.0))
    wedged = model.new_incident("wedged", 1.0, model.Thresholds(1, 2, 3.0, "available+swap"), {},
                                engine={"state": "ready"}, summary="engine wedged: x")
    nothing = memory_incident()
    nothing.target, nothing.top_consumers = None, [model.TreeRow(1, 0, "init", "systemd", "/sbin/init", 1, 0, 0)]
    for inc in (link, wedged, nothing):
        keys = list(inc.to_json())
        assert keys == [f for f in fields if f in keys], (inc.kind, keys)
    assert list(link.to_json()["link"]) == row_keys("link")
    assert list(wedged.to_json()["thresholds"]) == row_keys("thresholds")[:4]
    assert list(link.to_json()["thresholds"]) == row_keys("thresholds")[4:]
    assert link.host == sysinfo.hostname() and link.boot_id == sysinfo.boot_id()


def test_meminfo_read_at_the_crossing_is_parsed_once_by_meminfos_parser():
    inc = memory_incident()
    raw = inc.meminfo_raw
    assert inc.meminfo == {} and raw is not None
    inc.parse_meminfo()
    assert inc.meminfo_raw is None and inc.meminfo == meminfo.parse(raw)
    assert inc.meminfo["MemAvailable"] == 775946 * 1024 and inc.meminfo["HugePages_Total"] == 0
    assert inc.to_json()["meminfo"] == inc.meminfo


def test_ids_name_files_and_sort_by_time():
    a, b = model.new_id(1_700_000_000), model.new_id(1_700_000_001)
    assert re.fullmatch(r"20231114T221320Z-[0-9a-f]{6}", a) and a < b
    assert model.new_incident("link", 1_700_000_000, model.LinkThresholds(1.0), {}).id[:16] == a[:16]


def test_the_journal_views_carry_the_documented_message_ids():
    from sparkguard import journal
    inc = memory_incident()
    ev = inc.timeline[0].to_json()
    prio, msg, f = model.event_entry(inc.ref(), ev)
    assert f["MESSAGE_ID"] == journal.MESSAGE_IDS["crossed"] and prio == 4
    assert f["SPARKGUARD_INCIDENT"] == inc.id and f["SPARKGUARD_TARGET_PID"] == 4242
    assert msg == f"crossed: crossed (available 900 B; incident {inc.id})"
    prio, msg, f = model.report_entry(inc.to_json(), None)
    assert f["MESSAGE_ID"] == journal.MESSAGE_IDS["report"] and f["SPARKGUARD_FILE"] is None
    assert json.loads(f["SPARKGUARD_REPORT"]) == inc.to_json()
    assert f["SPARKGUARD_AVAILABLE_BYTES"] == 775946 * 1024 and f["SPARKGUARD_MIN_AVAILABLE_BYTES"] == 900


def test_the_snapshot_doc_lists_exactly_the_keys_the_guard_returns():
    from sparkguard import config
    from sparkguard.guard.loop import Guard
    doc = (ROOT / "docs" / "snapshot.md").read_text()
    keys = re.findall(r"^\| `([a-z_]+)` \|", doc, re.M)
    snap = Guard(config.from_dict({}, "/etc/sparkguard/sparkguard.yaml")).snapshot()
    assert keys == list(snap)

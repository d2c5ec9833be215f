"""The guard's Recorder on real parts: a meminfo file read by the real MeminfoReader, the real
Reporter writing the real store; the daemon's own runs are tests/test_guard_incidents.py and the
golden incidents."""

from __future__ import annotations

import json

from sparkguard import config, meminfo
from sparkguard.recorder import Recorder
from sparkguard.reporter import Reporter

MEMINFO = b"MemTotal:       25165824 kB\nMemFree:          100000 kB\nMemAvailable:     500000 kB\n" \
          b"SwapTotal:             0 kB\nSwapFree:              0 kB\n"


def test_an_incident_from_crossing_to_close_is_written_once_with_typed_facts(tmp_path):
    path = tmp_path / "meminfo"
    path.write_bytes(MEMINFO)
    reader = meminfo.MeminfoReader(str(path))
    rep = Reporter(str(tmp_path / "inc"), "off")
    g = config.from_dict({"guard": {"term_below": "1GiB"}}, str(tmp_path / "x.yaml")).guard
    rec = Recorder(reader, rep, "spark-test", "ab" * 16)
    try:
        rec.open(100.0, 500000 * 1024, g)
        inc = rec.incident
        assert inc.meminfo_raw == MEMINFO and inc.meminfo == {}      # nothing parsed before the signal
        rec.event(100.25, 400 << 20, "no_target", [], "nothing matches")
        rec.fill(None)
        assert inc.meminfo_raw is None and inc.meminfo["MemAvailable"] == 500000 * 1024
        rec.close(101.5, 2 << 30, g, dry_run=False, recovered=True)
    finally:
        rep.close()
        reader.close()
    assert rec.incident is None, "the recorder keeps no reference to a closed incident"
    assert rec.counts == {"memory": 1} and rec.last_incident == inc.started_at
    saved = json.loads((tmp_path / "inc" / f"{inc.id}.json").read_text())
    assert saved == inc.to_json()
    assert [e["event"] for e in saved["timeline"]] == ["crossed", "no_target", "recovered"]
    assert [e["t"] for e in saved["timeline"]] == [0.0, 0.25, 1.5]
    assert saved["outcome"] == "no_target" and saved["min_available_bytes"] == 400 << 20
    assert saved["host"] == "spark-test" and saved["thresholds"]["term_below_bytes"] == 1 << 30
    assert saved["top_consumers"] and set(saved["top_consumers"][0]) >= {"pid", "rss_bytes", "title"}
    assert saved["summary"] == ("MemAvailable fell to 0.39 GiB (line 1.00 GiB); nothing to signal; "
                                "memory 2.00 GiB after 1.50s")


def test_events_without_an_open_incident_are_dropped(tmp_path):
    path = tmp_path / "meminfo"
    path.write_bytes(MEMINFO)
    reader = meminfo.MeminfoReader(str(path))
    rep = Reporter(str(tmp_path / "inc"), "off")
    try:
        rec = Recorder(reader, rep, "h", "b")
        rec.event(1.0, 1, "exited", [], "late")
        rec.fill(None)
    finally:
        rep.close()
        reader.close()
    assert rec.incident is None and rep.stats["events"] == 0 and not (tmp_path / "inc").exists()


def test_the_outcome_follows_memory_when_the_victim_is_given_up_with_memory_back(tmp_path):
    """Issue 32, "Also": a victim given up as unkillable while memory is above the line again (it
    was thawed and killed late) closes as ``killed`` with a ``recovered`` event, not
    ``killed_memory_not_back``; with memory still low it says the victim is not gone."""
    path = tmp_path / "meminfo"
    path.write_bytes(MEMINFO)
    reader = meminfo.MeminfoReader(str(path))
    rep = Reporter(str(tmp_path / "inc"), "off")
    g = config.from_dict({"guard": {"term_below": "1GiB"}}, str(tmp_path / "x.yaml")).guard
    rec = Recorder(reader, rep, "spark-test", "ab" * 16)
    saved = []
    try:
        for value in (2 << 30, 400 << 20):
            rec.open(100.0, 500000 * 1024, g)
            inc = rec.incident
            rec.event(100.1, 400 << 20, "sigterm", [1234], "SIGTERM")
            rec.event(101.1, 400 << 20, "sigkill", [1234], "SIGKILL 1 processes")
            rec.event(131.1, value, "unkillable", [1234], "1 processes still alive")
            rec.close(131.1, value, g, dry_run=False, recovered=False)
            saved.append(inc.id)
    finally:
        rep.close()
        reader.close()
    back, low = [json.loads((tmp_path / "inc" / f"{i}.json").read_text()) for i in saved]
    assert back["outcome"] == "killed" and back["timeline"][-1]["event"] == "recovered"
    assert low["outcome"] == "killed_memory_not_back" and low["timeline"][-1]["event"] == "recovery_timeout"
    assert low["timeline"][-1]["detail"].startswith("victim not gone and memory still")

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

"""The soft line for people (sparkguard/softview.py): the report's "Soft line" section of a pause
incident, the status section, and what they make of partial, old and hostile records.

The real daemon pausing a real fake vLLM, then ``sparkguard status`` and ``sparkguard incidents ID``
on what it recorded, is ``tests/test_softline.py``
``test_daemon_pauses_at_the_soft_line_and_resumes_when_memory_is_back``; here the records are
built by the real :func:`sparkguard.model.new_incident` (as ``sparkguard/guard/soft.py`` does) and
the store is a real directory.
"""

from __future__ import annotations

import json
import random

import pytest

from conftest import run_sparkguard
from unprivileged import nobody  # noqa: F401 - the fixture
from sparkguard import model, softview
from sparkguard.incidents.render import render

MiB = 1024 * 1024
GiB = 1024 * MiB
T0 = 1_764_637_200.0
URL = "http://127.0.0.1:8000"


def pause_record(outcome: str, events: list[tuple[str, float, str]], part: dict | None = None) -> dict:
    """A closed pause incident as guard/soft.py writes it: the thresholds of a 4 GiB soft line,
    events ``(name, t, detail)`` after the crossing, ended at the last event's time."""
    th = model.PauseThresholds(4 * GiB, 4 * GiB + 512 * MiB, 10.0, 768 * MiB, "keep", "available")
    inc = model.new_incident("pause", T0, th, b"MemAvailable: 4000000 kB\n", host="spark", boot_id="b" * 32)
    inc.timeline.append(model.Event("pause_crossed", 0.0, T0, 4 * GiB - 100 * MiB, [],
                                    f"3.90 GiB is 100.0 MiB below the soft line 4.00 GiB: POST {URL}/pause?mode=keep"))
    for name, t, detail in events:
        inc.timeline.append(model.Event(name, t, T0 + t, 4 * GiB, [], detail))
    inc.outcome, inc.ended_at, inc.min_available_bytes = outcome, T0 + events[-1][1], 3 * GiB
    inc.pause = part
    return inc.to_json()


RESUMED = pause_record("resumed", [("paused", 0.0026, "engine paused (POST ...: 200, 0.003s)"),
                                   ("resume_sent", 14.2, "memory back: POST /resume"),
                                   ("resumed", 14.21, "engine resumed (POST ...: 200)")],
                       {"url": URL, "engine_pid": 4242, "lane": "200k"})


def section(text: str) -> str:
    return text.split("Soft line (", 1)[1].split("\n\n", 1)[0]


def test_the_report_says_when_it_engaged_what_it_paused_for_how_long_and_how_it_ended():
    s = section(render(RESUMED))
    assert "lines          pause below 4.00 GiB, resume above 4.50 GiB held 10.0 s, SIGTERM below 0.75 GiB" in s
    assert "engaged        " in s and ": signal 3.90 GiB, 100 MiB below it" in s
    assert (f"paused         {URL} (engine pid 4242, lane 200k), mode keep, 3 ms after the crossing, "
            "for 14.2 s") in s
    assert "ended          resumed 14.2 s after the crossing at " in s
    # the memory incident's kill lines are not a pause incident's
    assert "  TERM below " not in render(RESUMED) and "KILL below" not in render(RESUMED)


@pytest.mark.parametrize("outcome,events,paused,ended", [
    ("pause_failed", [("pause_failed", 2.0, "POST x/pause: 404 (vLLM mounts it only with VLLM_SERVER_DEV_MODE=1): "
                                            "no pause endpoint; the guard goes on as without the soft line")],
     "not paused: POST x/pause: 404 (vLLM mounts it only with VLLM_SERVER_DEV_MODE=1): no pause endpoint",
     "the pause failed: the guard went on as without the soft line"),
    ("escalated", [("paused", 0.01, "engine paused"), ("pause_escalated", 3.5, "memory fell to the SIGTERM line")],
     "mode keep, 10 ms after the crossing, for 3.5 s",
     "the hard line 0.75 GiB was crossed 3.5 s after the crossing: SIGTERM (the memory incident has it)"),
    ("resume_failed", [("paused", 0.01, "engine paused"), ("resume_sent", 11.0, ""),
                       ("resume_failed", 16.0, "no answer within 2s; giving up: the engine may still be paused")],
     "for 16.0 s (or longer: it may still be paused)", "resuming failed: the engine may still be paused"),
    ("engine_restarted", [("paused", 0.01, "engine paused"),
                          ("pause_engine_restarted", 30.0, "a new run of the engine is ready")],
     "for 30.0 s", "the supervisor restarted the engine (a new run is not paused)"),
    ("daemon_stopped", [("paused", 0.01, "engine paused"), ("resumed", 5.0, "the guard stops: POST x/resume: 200")],
     "for 5.0 s", "the guard stopped: it resumed the engine"),
])
def test_every_ending_reads_as_what_happened(outcome, events, paused, ended):
    rec = pause_record(outcome, events, {"url": URL, "engine_pid": None, "lane": None})
    s = section(render(rec))
    assert paused in s.split("paused         ", 1)[1].split("\n", 1)[0], s
    assert f"ended          {ended}" in s, s
    assert ("by hand        curl -X POST http://127.0.0.1:8000/resume" in s) == (outcome == "resume_failed")


def test_a_record_from_before_the_pause_part_names_the_url_from_its_first_event():
    rec = dict(RESUMED)
    del rec["pause"]
    e = softview.episode(rec)
    assert e["url"] == URL and e["engine_pid"] is None
    assert f"paused         {URL}, mode keep" in section(render(rec))


def test_hostile_and_partial_records_never_raise():
    rng = random.Random(17)
    junk = [None, "", "x" * 5000, -1, 2**70, float("nan"), float("inf"), [], {}, [1, {}], {"a": None}, True,
            "\x1b[31m\x00", 1e300]
    for _ in range(3000):
        rec = json.loads(json.dumps(RESUMED))
        for _ in range(rng.randint(1, 6)):
            where = rng.choice(["top", "th", "ev", "part"])
            if where == "top":
                rec[rng.choice(list(rec) + ["pause"])] = rng.choice(junk)
            elif where == "th" and isinstance(rec.get("thresholds"), dict):
                rec["thresholds"][rng.choice(list(rec["thresholds"]))] = rng.choice(junk)
            elif where == "ev" and isinstance(rec.get("timeline"), list) and rec["timeline"]:
                ev = rng.choice(rec["timeline"])
                if isinstance(ev, dict):
                    ev[rng.choice(["event", "t", "detail", "available_bytes"])] = rng.choice(junk)
            elif isinstance(rec.get("pause"), dict):
                rec["pause"][rng.choice(["url", "engine_pid", "lane"])] = rng.choice(junk)
        text = "\n".join(softview.report_lines(rec))
        assert "\x1b" not in text and "\x00" not in text
        softview.render({"pause_below_bytes": 1, "resume_above_bytes": 2, "resume_after_seconds": 1.0,
                         "mode": "keep", "url": None, "dry_run": False, "last": softview.episode(rec)},
                        {"running": True, "pause": None}, T0)
    assert softview.episode({}) ["ended"].startswith("still engaged")


def test_metrics_of_another_host_are_counted_only_when_they_are_counts():
    assert softview.from_metrics({}, {}) is None            # a daemon older than the soft line
    got = softview.from_metrics({"sparkguard_engine_paused": 1.0},
                                {"sparkguard_pauses_total": {"ok": 3.0, "failed": float("nan")},
                                 "sparkguard_resumes_total": {"ok": 1e300, "failed": -2.0}})
    assert got == {"engine_paused": True, "pauses": {"ok": 3, "failed": 0}, "resumes": {"ok": 0, "failed": 0}}


def test_the_status_section_is_absent_while_the_soft_line_is_off_and_never_engaged():
    off = {"pause_below_bytes": None, "resume_above_bytes": None, "resume_after_seconds": 10.0, "mode": "keep",
           "url": None, "dry_run": False, "last": None}
    quiet = {"running": True, "pause": {"engine_paused": False, "pauses": {"ok": 0, "failed": 0},
                                        "resumes": {"ok": 0, "failed": 0}}}
    assert softview.render(off, quiet, T0) == []            # the status golden file stays as it was
    assert softview.render(None, {"running": False}, T0) == []
    lines = softview.render(dict(off, last=softview.episode(RESUMED)), quiet, T0 + 300)
    assert lines[0] == "Soft line   off (guard.pause_below not set)"
    assert "(5.0 min ago) at 3.90 GiB" in lines[2] and lines[-1] == ""
    assert "(3.0 days ago)" in softview.render(dict(off, last=softview.episode(RESUMED)), quiet, T0 + 3 * 86400)[2]
    remote = softview.render(None, dict(quiet, pause=dict(quiet["pause"], engine_paused=True)), T0)
    assert remote[:2] == ["Soft line   (from the endpoint's metrics)",
                          "  now          ENGINE PAUSED; since the daemon started: pauses 0 ok, 0 failed; "
                          "resumes 0 ok, 0 failed"]


def test_status_finds_the_last_pause_incident_in_a_real_store(tmp_path):
    from sparkguard.incidents.store import IncidentStore
    store = IncidentStore(str(tmp_path / "inc"))
    older = pause_record("pause_failed", [("pause_failed", 2.0, "x; y")])
    older["id"] = "20251101T000000Z-000001"
    memory = dict(RESUMED, kind="memory", id="20251203T000000Z-000003")
    for rec in (older, RESUMED, memory):
        assert store.save(rec)
    (tmp_path / "inc" / "20251204T000000Z-000004.json").write_text("{not json")
    assert store.newest("pause")["id"] == RESUMED["id"]
    assert store.newest("pause", scan=1) is None          # bounded: only the newest files are read
    assert IncidentStore(str(tmp_path / "missing")).newest("pause") is None
    cfg = tmp_path / "sparkguard.yaml"
    cfg.write_text(f"guard:\n  pause_below: 4GiB\n  pause_url: {URL}\nincidents:\n  dir: {store.dir}\n"
                   "metrics:\n  listen: \"off\"\n")
    r = run_sparkguard("status", "--config", str(cfg), timeout=60)
    assert r.returncode == 0, r.stderr
    soft = r.stdout.split("Soft line   ", 1)[1].split("\n\n", 1)[0]
    assert soft.startswith(f"pause below 4.00 GiB, resume above 4.50 GiB held 10.0 s, mode keep; engine {URL}")
    assert f"paused {URL} (engine pid 4242, lane 200k), mode keep, 3 ms after the crossing, for 14.2 s" in soft
    assert f"`sparkguard incidents {RESUMED['id']}`" in soft
    r = run_sparkguard("status", "--config", str(cfg), "--json", timeout=60)
    st = json.loads(r.stdout)
    assert st["soft"]["last"]["paused_seconds"] == pytest.approx(14.2074, abs=1e-3)
    assert st["soft"]["url"] == URL


def test_an_operator_outside_the_incidents_group_gets_a_plain_unknown_not_a_warning(nobody):
    """incidents.dir is 0750 root's: `sparkguard status` as another user says the last episode is
    unknown to it, and prints no warning about the directory on every call."""
    import os
    inc = nobody.dir / "inc"
    inc.mkdir(mode=0o700)
    (inc / f"{RESUMED['id']}.json").write_text(json.dumps(RESUMED))
    cfg = nobody.dir / "sparkguard.yaml"
    cfg.write_text(f"guard:\n  pause_below: 4GiB\n  pause_url: {URL}\nincidents:\n  dir: {inc}\n"
                   "metrics:\n  listen: \"off\"\n")
    os.chmod(cfg, 0o644)
    import subprocess
    r = subprocess.run(nobody.sparkguard("status", "--config", str(cfg)), capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert "last         unknown: incidents.dir is not readable by this user (run as root)" in r.stdout, r.stdout
    assert "incident directory" not in r.stderr, r.stderr

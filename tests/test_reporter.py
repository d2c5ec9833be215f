"""Reporter: real datagrams to a socket bound by the test (journald's stand-in), real files.

Incident records here have the shape the daemon writes (docs/incident.md: the JSON of
:class:`sparkguard.model.Incident`; its parts are tested in tests/test_model.py).
"""

from __future__ import annotations

import json
import sys
import logging
import os
import select
import stat
import threading
import time

import pytest

from conftest import fake_vllm
from sparkguard import journal
from sparkguard.reporter import Reporter
from test_journal import JournalStandIn

G = 1024 ** 3


def make_incident(iid="20250101T120000Z-abc123", t0=None, tree_pad=0, outcome="terminated"):
    t0 = time.time() - 60 if t0 is None else t0
    tree = [
        {"pid": 4242, "ppid": 1, "title": "vllm serve rnd-model", "cmdline": "vllm serve rnd-model --port 1",
         "rss_bytes": 2 * G, "swap_bytes": 0, "oom_score": 600},
        {"pid": 4243, "ppid": 4242, "title": "VLLM::EngineCore", "cmdline": "VLLM::EngineCore",
         "rss_bytes": 3 * G, "swap_bytes": 1 << 20, "oom_score": 700},
        {"pid": 4244, "ppid": 4243, "title": "VLLM::Worker_TP0", "cmdline": "VLLM::Worker_TP0" + " x" * tree_pad,
         "rss_bytes": 3 * G, "swap_bytes": 0, "oom_score": 700},
    ]
    return {
        "id": iid, "kind": "memory", "drill": False, "host": "spark-test", "boot_id": "ab" * 16,
        "started_at": t0, "ended_at": t0 + 2.5, "dry_run": False,
        "thresholds": {"term_below_bytes": int(0.75 * G), "kill_below_bytes": None, "grace_seconds": 10.0,
                       "signal": "available"},
        "meminfo": {"MemTotal": 24 * G, "MemAvailable": int(0.74 * G), "SwapFree": 0},
        "psi_memory": {"some": {"avg10": 1.5, "avg60": 0.5, "avg300": 0.1, "total_us": 1000},
                       "full": {"avg10": 0.5, "avg60": 0.1, "avg300": 0.0, "total_us": 100}},
        "zram": [],
        "target": {"root_pid": 4242, "title": "vllm serve rnd-model", "pattern": "vllm serve", "mem_bytes": 8 * G,
                   "tree": tree},
        "timeline": [
            {"event": "crossed", "t": 0.0, "at": t0, "available_bytes": int(0.74 * G), "pids": [], "detail": "below"},
            {"event": "sigterm", "t": 0.003, "at": t0 + 0.003, "available_bytes": int(0.70 * G), "pids": [4242],
             "detail": "SIGTERM vllm serve rnd-model (pid 4242)"},
            {"event": "exited", "t": 1.4, "at": t0 + 1.4, "available_bytes": int(0.5 * G),
             "pids": [4242, 4243, 4244], "detail": "victim tree gone 1.40s after SIGTERM"},
            {"event": "recovered", "t": 2.5, "at": t0 + 2.5, "available_bytes": 9 * G, "pids": [],
             "detail": "memory back to 9.00 GiB"},
        ],
        "outcome": outcome, "summary": "MemAvailable fell to 0.50 GiB (line 0.75 GiB); SIGTERM vllm serve rnd-model",
        "min_available_bytes": int(0.5 * G),
    }


@pytest.fixture
def standin(tmp_path):
    s = JournalStandIn(tmp_path / "journal.sock")
    yield s
    s.close()


def test_each_event_is_one_journal_entry_with_its_message_id_and_fields(tmp_path, standin):
    r = Reporter(str(tmp_path / "inc"), journal="on", journal_socket=standin.path)
    inc = make_incident()
    for ev in inc["timeline"]:
        r.event(inc, ev)
    r.close()
    got = [standin.recv()[0] for _ in inc["timeline"]]
    assert [g["SPARKGUARD_EVENT"] for g in got] == ["crossed", "sigterm", "exited", "recovered"]
    assert [g["MESSAGE_ID"] for g in got] == [journal.MESSAGE_IDS[e] for e in
                                             ("crossed", "sigterm", "exited", "recovered")]
    assert [g["PRIORITY"] for g in got] == ["4", "4", "5", "5"]
    term = got[1]
    assert term["SPARKGUARD_INCIDENT"] == inc["id"]
    assert term["SPARKGUARD_KIND"] == "memory"
    assert term["SPARKGUARD_PIDS"] == "4242"
    assert term["SPARKGUARD_AVAILABLE_BYTES"] == str(int(0.70 * G))
    assert term["SPARKGUARD_TARGET_PID"] == "4242"
    assert term["SYSLOG_IDENTIFIER"] == "sparkguard"
    assert "\n" not in term["MESSAGE"] and "SIGTERM vllm serve rnd-model" in term["MESSAGE"]
    assert inc["id"] in term["MESSAGE"]
    assert got[2]["SPARKGUARD_PIDS"] == "4242 4243 4244"
    assert r.stats["journal_sent"] == 4 and r.stats["errors"] == 0


def test_finish_writes_the_file_and_journals_the_full_report(tmp_path, standin):
    d = tmp_path / "inc"
    r = Reporter(str(d), journal="on", journal_socket=standin.path)
    inc = make_incident(outcome="killed")
    r.finish(inc)
    inc["timeline"].append({"event": "mutated-after-finish"})  # the caller may reuse its dict
    r.close()
    path = d / (inc["id"] + ".json")
    saved = json.loads(path.read_text())
    assert saved == {k: v for k, v in inc.items() if k != "timeline"} | {"timeline": saved["timeline"]}
    assert [e["event"] for e in saved["timeline"]] == ["crossed", "sigterm", "exited", "recovered"]
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    f, how, _ = standin.recv()
    assert f["MESSAGE_ID"] == journal.MESSAGE_IDS["report"]
    assert f["PRIORITY"] == "3"  # killed
    assert json.loads(f["SPARKGUARD_REPORT"]) == saved
    assert f["SPARKGUARD_INCIDENT"] == inc["id"]
    assert f["SPARKGUARD_OUTCOME"] == "killed"
    assert f["SPARKGUARD_TARGET_PID"] == "4242"
    assert f["SPARKGUARD_MIN_AVAILABLE_BYTES"] == str(int(0.5 * G))
    assert f["SPARKGUARD_AVAILABLE_BYTES"] == str(inc["meminfo"]["MemAvailable"])
    assert f["SPARKGUARD_TERM_BELOW_BYTES"] == str(int(0.75 * G))
    assert "SPARKGUARD_KILL_BELOW_BYTES" not in f  # off
    assert f["SPARKGUARD_PIDS"] == "4242 4243 4244"
    assert f["SPARKGUARD_FILE"] == str(path)
    assert float(f["SPARKGUARD_DURATION_SECONDS"]) == pytest.approx(2.5)
    assert "\n" not in f["MESSAGE"] and inc["id"] in f["MESSAGE"] and "killed" in f["MESSAGE"]


def test_a_report_larger_than_a_datagram_arrives_through_a_memfd(tmp_path, standin):
    r = Reporter(str(tmp_path / "inc"), journal="on", journal_socket=standin.path)
    inc = make_incident(tree_pad=150_000)  # ~300 KB of cmdline in the tree
    r.finish(inc)
    r.close()
    f, how, seals = standin.recv()
    assert how == "memfd"
    assert len(f["SPARKGUARD_REPORT"]) > 300_000
    assert json.loads(f["SPARKGUARD_REPORT"])["target"]["tree"][2]["cmdline"] == inc["target"]["tree"][2]["cmdline"]
    assert r.stats["journal_memfd"] == 1


def test_full_report_still_journaled_when_the_file_cannot_be_written(tmp_path, standin, caplog):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the directory should be")
    r = Reporter(str(blocker / "incidents"), journal="on", journal_socket=standin.path)
    with caplog.at_level(logging.INFO, logger="sparkguard"):
        r.finish(make_incident("20250101T120000Z-000001"))
        r.finish(make_incident("20250101T120000Z-000002"))
        r.close()
    for iid in ("20250101T120000Z-000001", "20250101T120000Z-000002"):
        f, _, _ = standin.recv()
        assert f["SPARKGUARD_INCIDENT"] == iid
        assert json.loads(f["SPARKGUARD_REPORT"])["id"] == iid
        assert "SPARKGUARD_FILE" not in f
    assert r.stats["files_failed"] == 2
    errors = [rec for rec in caplog.records if rec.levelno >= logging.ERROR]
    assert len(errors) == 1 and "Not a directory" in errors[0].getMessage()


def test_journal_modes(tmp_path, standin, caplog):
    inc = make_incident()
    off = Reporter(str(tmp_path / "a"), journal="off", journal_socket=standin.path)
    off.event(inc, inc["timeline"][0])
    off.finish(inc)
    off.close()
    assert (tmp_path / "a" / (inc["id"] + ".json")).exists()
    assert not select.select([standin.sock], [], [], 0.2)[0], "journal=off sent something"

    missing = str(tmp_path / "no-journald.sock")
    with caplog.at_level(logging.INFO, logger="sparkguard"):
        auto = Reporter(str(tmp_path / "b"), journal="auto", journal_socket=missing)
        for ev in inc["timeline"]:
            auto.event(inc, ev)
        auto.finish(inc)
        auto.close()
    assert (tmp_path / "b" / (inc["id"] + ".json")).exists()
    assert not [rec for rec in caplog.records if rec.levelno >= logging.ERROR], "auto without journald is fine"
    assert auto.stats["journal_failed"] == 0
    caplog.clear()

    with caplog.at_level(logging.INFO, logger="sparkguard"):
        on = Reporter(str(tmp_path / "c"), journal="on", journal_socket=missing)
        for ev in inc["timeline"]:
            on.event(inc, ev)
        on.finish(inc)
        on.close()
    errors = [rec.getMessage() for rec in caplog.records if rec.levelno >= logging.ERROR]
    assert len(errors) == 1 and missing in errors[0], errors  # logged once, not per entry
    assert on.stats["journal_failed"] == 5
    assert (tmp_path / "c" / (inc["id"] + ".json")).exists()
    # the one-line summaries still reach the log (a terminal user sees them)
    assert sum(rec.getMessage().startswith("sigterm: SIGTERM vllm serve rnd-model") for rec in caplog.records) == 1

    with pytest.raises(ValueError, match="journal mode"):
        Reporter(str(tmp_path / "d"), journal="yes")


def test_caller_never_blocks_when_journald_stops_reading(tmp_path, standin):
    """journald stuck: the socket queue fills, the reporter thread blocks in send; the
    poll loop's calls must still return at once, and excess reports are dropped, counted."""
    r = Reporter(str(tmp_path / "inc"), journal="on", journal_socket=standin.path, queue_size=8)
    inc = make_incident()
    ev = inc["timeline"][1]
    worst = 0.0
    t_all = time.monotonic()
    for _ in range(300):
        t = time.monotonic()
        r.event(inc, ev)
        worst = max(worst, time.monotonic() - t)
    total = time.monotonic() - t_all
    assert worst < 0.05 and total < 1.0, (worst, total)
    assert r.stats["dropped"] > 0
    standin.recv_raw()  # journald wakes up: what was queued still arrives
    while select.select([standin.sock], [], [], 0)[0]:
        standin.recv_raw()
    r.close(timeout=30)
    assert not r._thread.is_alive()


def test_never_raises_and_handles_events_outside_an_incident(tmp_path, standin):
    before = threading.stack_size()
    r = Reporter(str(tmp_path / "inc"), journal="on", journal_socket=standin.path)
    assert threading.stack_size() == before, "stack size must be restored for other threads"
    r.event(None, {"event": "config_reload_failed", "detail": "/etc/x.yaml: guard.grace: -1: negative"})
    r.event({"id": "x"}, "not a dict")       # garbage from a buggy caller: swallowed
    r.finish({"no": "id"})                   # unusable record: logged by the thread, not raised
    r.event({"id": "20250101T000000Z-eeeeee", "kind": "engine"},
            {"event": "engine_restart", "detail": "engine wedged", "reason": "wedged", "attempt": 2})
    r.close()
    r.close()                                 # twice is fine
    r.event(None, {"event": "late"})          # after close: dropped, not raised
    f, _, _ = standin.recv()
    assert f["MESSAGE_ID"] == journal.MESSAGE_IDS["config_reload_failed"]
    assert f["PRIORITY"] == "4"
    assert "SPARKGUARD_INCIDENT" not in f
    assert "guard.grace" in f["MESSAGE"]
    f, _, _ = standin.recv()  # finish({"no": "id"}): journaled even though it cannot be saved
    assert f["MESSAGE_ID"] == journal.MESSAGE_IDS["report"]
    f, _, _ = standin.recv()
    assert f["MESSAGE_ID"] == journal.MESSAGE_IDS["event"]  # unknown kinds get the generic id
    assert f["SPARKGUARD_EVENT"] == "engine_restart"
    assert f["SPARKGUARD_REASON"] == "wedged" and f["SPARKGUARD_ATTEMPT"] == "2"
    assert r.stats["dropped"] == 1
    assert not [p for p in os.listdir(tmp_path / "inc") if p.startswith(".")] if (tmp_path / "inc").exists() else True


GUARD_E2E = r"""
import json, os, signal, subprocess, sys, time
import yaml
from sparkguard import journal
model, base, fake_vllm = sys.argv[1], sys.argv[2], sys.argv[3]
ready = os.path.join(base, "ready")
eng = subprocess.Popen([sys.executable, fake_vllm, "serve", model, "--tp", "2", "--ready-file", ready,
                        "--hold", "16MiB", "--hold-core", "8MiB", "--hold-api", "8MiB", "--exit-delay", "0.2"],
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
deadline = time.monotonic() + 60
while not os.path.exists(ready):
    assert time.monotonic() < deadline and eng.poll() is None, "fake vLLM did not come up"
    time.sleep(0.05)  # the fake writes the file; nothing to wait on
pids = [int(p) for p in open(ready).read().split("pids=")[1].split()[0].split(",")]
mi = {l.split(":")[0]: int(l.split()[1]) * 1024 for l in open("/proc/meminfo")}
avail = mi["MemAvailable"]
# crossed at once; the config refuses a line at or above MemTotal.  The victim's exit frees far
# less than the gap, so memory is never back: recovery_wait 0 closes the incident as soon as the
# tree is gone (a longer wait could be stretched by the per-CPU lists' drain wait, up to 120 s,
# whenever other work on the host frees memory near the line)
line = min(avail + 512 * 2**20, mi["MemTotal"] - 64 * 2**20)
inc_dir = os.path.join(base, "inc")
cfg = {"guard": {"term_below": line, "grace": "5s", "recovery_wait": "0s"},
       "targets": {"match": ["vllm serve " + model]}, "metrics": {"listen": "off"},
       "incidents": {"dir": inc_dir, "journal": "auto"}}
cfg_path = os.path.join(base, "sparkguard.yaml")
with open(cfg_path, "w") as f:
    yaml.safe_dump(cfg, f)
log = open(os.path.join(base, "guard.log"), "w")
guard = subprocess.Popen([sys.executable, "-m", "sparkguard", "run", "--config", cfg_path], stdout=log,
                         stderr=subprocess.STDOUT)
rec = None
deadline = time.monotonic() + 60
while rec is None and time.monotonic() < deadline:
    for n in sorted(os.listdir(inc_dir)) if os.path.isdir(inc_dir) else []:
        if n.endswith(".json") and not n.startswith("."):
            r = json.load(open(os.path.join(inc_dir, n)))
            if (r.get("target") or {}).get("root_pid") == pids[0]:
                rec = r
    time.sleep(0.05)  # the guard writes the file from its reporter thread
guard.send_signal(signal.SIGTERM)
guard.wait(30)
eng_rc = eng.wait(30)
entries = []
deadline = time.monotonic() + 30
while rec and time.monotonic() < deadline:
    out = subprocess.run(["journalctl", "-o", "json", "--all", "--no-pager", "SPARKGUARD_INCIDENT=" + rec["id"]],
                         capture_output=True, text=True, timeout=30).stdout
    entries = [json.loads(l) for l in out.splitlines() if l.strip()]
    if any(e.get("MESSAGE_ID") == journal.MESSAGE_IDS["report"] for e in entries):
        break
    time.sleep(0.1)  # journald writes asynchronously
print(json.dumps({"pids": pids, "rec": rec, "entries": entries, "eng_rc": eng_rc, "guard_rc": guard.returncode,
                  "log": open(os.path.join(base, "guard.log")).read()}))
"""


def test_guard_run_reports_a_real_incident_to_a_real_journald_and_the_store(tmp_path):
    """End to end: ``sparkguard run`` SIGTERMs a fake vLLM tree; its reporter writes the JSON file
    and journals every event and the full report to a real systemd-journald.  Runs in a private
    PID namespace, so the guard can see (and signal) only the processes this test started."""
    import uuid

    from test_journal import run_with_journald
    model = "sgtest-report-" + uuid.uuid4().hex[:10]
    p = run_with_journald(tmp_path, [sys.executable, "-c", GUARD_E2E, model, str(tmp_path), fake_vllm.script_path()],
                          timeout=240)
    assert p.returncode == 0, p.stderr + p.stdout
    res = json.loads(p.stdout.strip().splitlines()[-1])
    rec, pids = res["rec"], res["pids"]
    assert rec is not None, res["log"]
    assert res["eng_rc"] is not None
    assert rec["outcome"].startswith("terminated"), rec
    tree_cmdlines = {e["cmdline"] for e in rec["target"]["tree"]}
    assert {"VLLM::EngineCore", "VLLM::Worker_TP0", "VLLM::Worker_TP1"} <= tree_cmdlines
    assert sorted(e["pid"] for e in rec["target"]["tree"]) == sorted(pids)
    by_event = {}
    for e in res["entries"]:
        by_event.setdefault(e["SPARKGUARD_EVENT"], e)
    assert {"crossed", "sigterm", "exited", "report"} <= set(by_event), sorted(by_event)
    term = by_event["sigterm"]
    assert term["MESSAGE_ID"] == journal.MESSAGE_IDS["sigterm"] and term["PRIORITY"] == "4"
    assert term["SPARKGUARD_PIDS"] == str(pids[0])
    assert term["SYSLOG_IDENTIFIER"] == "sparkguard" and term["_TRANSPORT"] == "journal"
    assert by_event["crossed"]["MESSAGE_ID"] == journal.MESSAGE_IDS["crossed"]
    report = by_event["report"]
    assert json.loads(report["SPARKGUARD_REPORT"]) == rec
    assert report["SPARKGUARD_TARGET_PID"] == str(pids[0])
    assert report["SPARKGUARD_OUTCOME"] == rec["outcome"]
    assert report["SPARKGUARD_FILE"].endswith(rec["id"] + ".json")
    # the terminal user saw one-line summaries on stderr
    assert "sigterm: SIGTERM" in res["log"] and f"incident {rec['id']}" in res["log"]


@pytest.mark.parametrize("mode,why", [("off", "incidents.journal is off"), ("auto", "no journald socket at ")])
def test_a_failed_file_write_without_a_journal_says_the_report_is_lost(tmp_path, caplog, mode, why):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the directory should be")
    r = Reporter(str(blocker / "incidents"), journal=mode, journal_socket=str(tmp_path / "no-journald.sock"))
    with caplog.at_level(logging.INFO, logger="sparkguard"):
        r.finish(make_incident("20250101T120000Z-000003"))
        r.close()
    errors = [rec.getMessage() for rec in caplog.records if rec.levelno >= logging.ERROR]
    assert len(errors) == 1 and "Not a directory" in errors[0], errors
    assert "journal entry" not in errors[0] and f"not journaled ({why}" in errors[0], errors[0]
    assert "only the summary line below is kept" in errors[0]


def test_what_one_report_writes_is_bounded(tmp_path, standin):
    """A record with a giant string and a giant list (a runaway tree, endless engine output) is
    written cut, each cut saying what it left out, the whole report within a few MiB."""
    from sparkguard import reporter
    d = tmp_path / "inc"
    r = Reporter(str(d), journal="on", journal_socket=standin.path)
    inc = make_incident()
    inc["target"]["tree"] = [dict(inc["target"]["tree"][0], pid=10_000 + i) for i in range(50_000)]
    inc["engine"] = {"last_lines": ["x" * 100 for _ in range(10)] + ["y" * (4 << 20)]}
    r.event(inc, {"event": "sigterm", "t": 0.0, "at": time.time(), "available_bytes": 1, "pids": [1],
                  "detail": "z" * (4 << 20)})
    r.finish(inc)
    r.close()
    ev, _, _ = standin.recv()
    assert len(ev["SPARKGUARD_DETAIL"]) < reporter.MAX_FIELD + 100 and "more characters]" in ev["SPARKGUARD_DETAIL"]
    saved = json.loads((d / (inc["id"] + ".json")).read_text())
    tree = saved["target"]["tree"]
    assert len(tree) == reporter.MAX_ITEMS + 1 and tree[-1] == f"[{50_000 - reporter.MAX_ITEMS} more items left out]"
    assert saved["engine"]["last_lines"][-1].endswith(f"... [{(4 << 20) - reporter.MAX_FIELD} more characters]")
    assert len((d / (inc["id"] + ".json")).read_bytes()) < 4 << 20
    f, _, _ = standin.recv()
    assert json.loads(f["SPARKGUARD_REPORT"]) == saved

"""Incident store on real directories (and a real full / read-only tmpfs), the readable
report, and the ``sparkguard incidents`` command, including incidents that only the
journal holds (a real systemd-journald in a private namespace)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import run_sparkguard
from sparkguard.incidents.render import render
from sparkguard.incidents.store import IncidentStore
from test_journal import JournalStandIn, run_with_journald
from test_reporter import G, make_incident

TESTS = Path(__file__).resolve().parent


def test_save_is_atomic_with_modes_and_leaves_no_temp_files(tmp_path):
    d = tmp_path / "var" / "incidents"
    store = IncidentStore(str(d))
    inc = make_incident()
    path = store.save(inc)
    assert path == str(d / (inc["id"] + ".json"))
    assert stat.S_IMODE(d.stat().st_mode) == 0o750
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o640
    assert json.loads(Path(path).read_text()) == inc
    assert os.listdir(d) == [inc["id"] + ".json"]

    # A reader never sees a half-written file while the same incident is rewritten.
    small = dict(inc, summary="small")
    big = dict(inc, summary="big", pad="x" * 2_000_000)
    stop = threading.Event()
    seen: set[str] = set()
    bad: list[str] = []

    def reader():
        while not stop.is_set():
            try:
                seen.add(json.loads(Path(path).read_bytes())["summary"])
            except ValueError as e:
                bad.append(str(e))

    t = threading.Thread(target=reader)
    t.start()
    try:
        for i in range(30):
            assert store.save(big if i % 2 else small)
    finally:
        stop.set()
        t.join(30)
    assert not bad, f"reader saw a torn file: {bad[:3]}"
    assert seen <= {"small", "big", inc["summary"]}
    assert os.listdir(d) == [inc["id"] + ".json"]


def test_list_newest_first_load_by_id(tmp_path, caplog):
    """Prefixes are the CLI's (test_cli_lists_newest_first_and_shows_one)."""
    store = IncidentStore(str(tmp_path))
    now = time.time()
    for iid, age in (("20250101T000000Z-aaaaaa", 300), ("20250102T000000Z-bbbbbb", 100),
                     ("20250102T000000Z-bccccc", 200)):
        assert store.save(make_incident(iid, t0=now - age))
    (tmp_path / "20250103T000000Z-broken.json").write_text("{not json")
    (tmp_path / ".20250104T000000Z-dddddd.x.tmp").write_text("{}")  # a temp file: not an incident
    with caplog.at_level(logging.WARNING, logger="sparkguard"):
        ids = [r["id"] for r in store.list()]
    assert ids == ["20250102T000000Z-bbbbbb", "20250102T000000Z-bccccc", "20250101T000000Z-aaaaaa"]
    assert any("20250103T000000Z-broken" in r.getMessage() for r in caplog.records)
    assert store.load("20250101T000000Z-aaaaaa")["id"] == "20250101T000000Z-aaaaaa"
    assert store.load("20250102T000000Z-bccccc")["id"] == "20250102T000000Z-bccccc"
    assert store.load("20250103T000000Z-broken") is None
    assert store.load("2099") is None
    assert store.load("../etc/passwd") is None
    assert IncidentStore(str(tmp_path / "missing")).list() == []


def test_path_under_a_file_is_logged_and_survived(tmp_path, caplog):
    f = tmp_path / "file"
    f.write_text("")
    store = IncidentStore(str(f / "incidents"))
    with caplog.at_level(logging.ERROR, logger="sparkguard"):
        assert store.save(make_incident()) is None
    assert "Not a directory" in store.last_error
    assert any("not saved" in r.getMessage() for r in caplog.records)
    assert store.list() == [] and store.load("20250101T000000Z-000001") is None
    assert store.save({"id": "../../etc/evil"}) is None and "invalid" in store.last_error


FULL_DISK = r"""
import json, os, subprocess, sys
sys.path.insert(0, sys.argv[3])
from sparkguard.incidents.store import IncidentStore
from sparkguard.reporter import Reporter
from test_reporter import make_incident
mnt, sock = sys.argv[1], sys.argv[2]
subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", mnt], check=True)
d = mnt + "/incidents"
store = IncidentStore(d)
res = {"small": store.save(make_incident("20250101T000000Z-000001"))}
big = make_incident("20250101T000000Z-000002", tree_pad=100_000)
res["big"] = store.save(big)
res["big_err"] = store.last_error
res["left"] = sorted(os.listdir(d))
res["small_back"] = store.load("20250101T000000Z-000001")["id"]
r = Reporter(d, journal="on", journal_socket=sock)
r.finish(big)
r.close()
res["stats"] = r.stats
subprocess.run(["mount", "-o", "remount,ro", mnt], check=True)
res["ro"] = store.save(make_incident("20250101T000000Z-000003"))
res["ro_err"] = store.last_error
res["list_ro"] = [x["id"] for x in store.list()]
print(json.dumps(res))
"""


def test_full_disk_and_read_only_store_are_survived(tmp_path):
    """A 64 KiB tmpfs (ENOSPC), then remounted read-only (EROFS, which root cannot bypass),
    in a private mount namespace so nothing is left mounted on the host."""
    if os.geteuid() != 0 or not shutil.which("unshare"):
        pytest.skip("needs root and unshare")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    standin = JournalStandIn(tmp_path / "journal.sock")
    try:
        env = dict(os.environ, PYTHONPATH=str(TESTS.parent))
        p = subprocess.run(["unshare", "--mount", "--propagation", "private", sys.executable, "-c", FULL_DISK,
                            str(mnt), standin.path, str(TESTS)], capture_output=True, text=True, timeout=120,
                           env=env)
        assert p.returncode == 0, p.stderr
        res = json.loads(p.stdout.strip().splitlines()[-1])
        assert res["small"].endswith("20250101T000000Z-000001.json")
        assert res["big"] is None and "No space left" in res["big_err"]
        assert res["left"] == ["20250101T000000Z-000001.json"], "a failed save must not leave temp files"
        assert res["small_back"] == "20250101T000000Z-000001"
        assert res["stats"]["files_failed"] == 1 and res["stats"]["errors"] == 0
        assert "incident 20250101T000000Z-000002 not saved" in p.stderr  # logged
        f, how, _ = standin.recv()  # ... and the journal still got the whole report
        assert json.loads(f["SPARKGUARD_REPORT"])["id"] == "20250101T000000Z-000002"
        assert res["ro"] is None and "Read-only file system" in res["ro_err"]
        assert res["list_ro"] == ["20250101T000000Z-000001"]
    finally:
        standin.close()


def test_render_reads_like_a_report():
    inc = make_incident()
    inc["zram"] = [{"device": "zram7", "disksize_bytes": 6 * G, "comp_algorithm": "zstd",
                    "orig_data_bytes": G, "compr_data_bytes": G // 4, "mem_used_bytes": G // 4}]
    inc["engine"] = {"state": "restarting", "last_log": ["INFO serving", "ERROR out of memory"]}
    text = render(inc)
    for want in (inc["id"], "terminated", inc["summary"], "TERM below     0.75 GiB", "KILL below off",
                 "grace 10.0 s", "at crossing    MemAvailable 0.74 GiB",
                 "lowest         MemAvailable 0.50 GiB at +1.400 s", "avg10 1.50%",
                 "zram7 (zstd): disksize 6.00 GiB, data 1.00 GiB in 0.25 GiB, ratio 4.0",
                 "+0.003 s  sigterm", "pids 4242, 4243, 4244", "victim tree gone 1.40s after SIGTERM",
                 "host           spark-test", "| ERROR out of memory", "cmdline: vllm serve rnd-model --port 1"):
        assert want in text, f"{want!r} missing from:\n{text}"
    rows = [line for line in text.splitlines() if "VLLM::" in line or "vllm serve rnd-model" in line]
    # the tree is shown parent before child, children indented under their parent
    engine = next(r for r in rows if r.rstrip().endswith("VLLM::EngineCore"))
    worker = next(r for r in rows if "VLLM::Worker_TP0" in r)
    assert rows.index(engine) < rows.index(worker)
    assert worker.index("VLLM::Worker") > engine.index("VLLM::EngineCore")
    # partial records (an open incident, an old format) still render
    assert "not yet (open)" in render({"id": "x", "started_at": time.time(), "ended_at": None})
    assert render({}).startswith("Incident ?")


def _store_three(d: Path) -> list[str]:
    store = IncidentStore(str(d))
    now = time.time()
    ids = ["20250101T000000Z-aaaaaa", "20250102T000000Z-bbbbbb", "20250103T000000Z-cccccc"]
    store.save(make_incident(ids[0], t0=now - 3000))
    store.save(make_incident(ids[1], t0=now - 2000, outcome="killed"))
    dry = make_incident(ids[2], t0=now - 1000, outcome="dry_run")
    dry["dry_run"] = True
    store.save(dry)
    return ids


def test_cli_lists_newest_first_and_shows_one(tmp_path):
    ids = _store_three(tmp_path)
    p = run_sparkguard("incidents", "--dir", str(tmp_path), "--no-journal")
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert lines[0].split() == ["ID", "STARTED", "KIND", "OUTCOME", "TARGET", "MIN", "AVAIL", "DURATION"]
    assert [line.split()[0] for line in lines[1:]] == list(reversed(ids))
    killed = lines[2]
    assert "killed" in killed and "memory" in killed and "vllm serve rnd-model (pid 4242)" in killed
    assert "0.50 GiB" in killed and "2.5 s" in killed
    assert time.strftime("%Y-%m-%d", time.localtime(time.time() - 2000)) in killed

    p = run_sparkguard("incidents", "--dir", str(tmp_path), "--no-journal", "20250102")
    assert p.returncode == 0, p.stderr
    assert p.stdout == render(IncidentStore(str(tmp_path)).load(ids[1]))

    p = run_sparkguard("incidents", "--dir", str(tmp_path), "--no-journal", "--json")
    assert [r["id"] for r in json.loads(p.stdout)] == list(reversed(ids))
    p = run_sparkguard("incidents", "--dir", str(tmp_path), "--no-journal", "--json", ids[0])
    assert json.loads(p.stdout) == IncidentStore(str(tmp_path)).load(ids[0])

    p = run_sparkguard("incidents", "--dir", str(tmp_path), "--no-journal", "--limit", "1")
    assert [line.split()[0] for line in p.stdout.splitlines()[1:2]] == [ids[2]]
    assert "2 older not shown" in p.stdout

    p = run_sparkguard("incidents", "--dir", str(tmp_path), "--no-journal", "2025010")
    assert p.returncode == 1 and "matches 3 incidents" in p.stderr
    p = run_sparkguard("incidents", "--dir", str(tmp_path), "--no-journal", "2099")
    assert p.returncode == 1 and "no incident '2099'" in p.stderr


def test_cli_reads_the_dir_from_the_config_and_says_when_there_are_none(tmp_path):
    d = tmp_path / "from-config"
    cfg = tmp_path / "sparkguard.yaml"
    cfg.write_text(f"incidents:\n  dir: {d}\n")
    p = run_sparkguard("incidents", "--config", str(cfg), "--no-journal")
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == f"No incidents recorded (looked in {d})."
    _store_three(d)
    p = run_sparkguard("incidents", "--config", str(cfg), "--no-journal")
    assert len(p.stdout.splitlines()) == 4

    cfg.write_text("incidents:\n  journal: maybe\n")
    p = run_sparkguard("incidents", "--config", str(cfg))
    assert p.returncode == 2
    assert f"{cfg}: incidents.journal: 'maybe'" in p.stderr


JOURNAL_CLI = r"""
import json, os, subprocess, sys, time
sys.path.insert(0, sys.argv[1])
from sparkguard import journal
from sparkguard.incidents.store import IncidentStore
from sparkguard.reporter import Reporter
from test_reporter import make_incident
base = sys.argv[2]
store_dir = base + "/inc"
now = time.time()
IncidentStore(store_dir).save(make_incident("20250104T000000Z-f00001", t0=now - 300))  # file only
blocker = base + "/blocker"
open(blocker, "w").close()
r = Reporter(blocker + "/incidents", journal="auto")   # file fails: journal only
r.finish(make_incident("20250105T000000Z-a00001", t0=now - 200, outcome="killed"))
r.close()
r = Reporter(store_dir, journal="auto")                # both
r.finish(make_incident("20250106T000000Z-b00001", t0=now - 100))
r.close()
q = ["journalctl", "-o", "json", "--all", "--no-pager", "MESSAGE_ID=" + journal.MESSAGE_IDS["report"]]
deadline = time.monotonic() + 30
while time.monotonic() < deadline:
    if len(subprocess.run(q, capture_output=True, text=True, timeout=30).stdout.splitlines()) >= 2:
        break
    time.sleep(0.1)  # journald writes asynchronously; nothing to wait on
out = {}
for name, args in (("list", []), ("json", ["--json"]), ("show", ["20250105T000000Z-a0"]),
                   ("nojournal", ["--no-journal"])):
    p = subprocess.run([sys.executable, "-m", "sparkguard", "incidents", "--dir", store_dir, *args],
                       capture_output=True, text=True, timeout=60)
    out[name] = [p.returncode, p.stdout, p.stderr]
print(json.dumps(out))
"""


def test_cli_merges_incidents_only_the_journal_holds(tmp_path):
    p = run_with_journald(tmp_path, [sys.executable, "-c", JOURNAL_CLI, str(TESTS), str(tmp_path)])
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout.strip().splitlines()[-1])
    rc, stdout, stderr = out["list"]
    assert rc == 0, stderr
    rows = stdout.splitlines()[1:]
    assert [r.split()[0] for r in rows] == ["20250106T000000Z-b00001", "20250105T000000Z-a00001",
                                           "20250104T000000Z-f00001"]
    assert rows[1].rstrip().endswith("journal only") and "killed" in rows[1]
    assert not rows[0].rstrip().endswith("journal only")
    rc, stdout, _ = out["json"]
    recs = json.loads(stdout)
    assert [r["id"] for r in recs] == ["20250106T000000Z-b00001", "20250105T000000Z-a00001",
                                       "20250104T000000Z-f00001"]
    assert recs[1] == make_incident("20250105T000000Z-a00001", t0=recs[1]["started_at"], outcome="killed")
    rc, stdout, stderr = out["show"]
    assert rc == 0, stderr
    assert stdout.startswith("Incident 20250105T000000Z-a00001") and "from the journal only" in stdout
    rc, stdout, _ = out["nojournal"]
    assert "20250105T000000Z-a00001" not in stdout


def test_merge_keeps_the_last_journal_report_of_an_id():
    from sparkguard.incidents import merge
    first = {"id": "20261130T000000Z-aaaaaa", "started_at": 1.0, "summary": "restart pending"}
    later = {"id": "20261130T000000Z-aaaaaa", "started_at": 1.0, "summary": "engine restarted"}
    [(rec, src)] = merge([], [first, later])
    assert rec["summary"] == "engine restarted" and src == "journal"
    [(rec, src)] = merge([dict(first, summary="file")], [first, later])
    assert rec["summary"] == "file" and src == "file+journal"


@pytest.mark.parametrize("t", [float("nan"), 1e300, -5.0, float("inf")])
def test_a_stored_record_with_no_real_time_lists_and_renders(t):
    """A record from disk or another node may hold any number as a time: the listing and the
    report show '?' instead of raising (time.localtime raises OverflowError/ValueError on these)."""
    from sparkguard.incidents.render import list_line, render
    rec = {"id": "20261201T000000-x", "started_at": t, "kind": "memory",
           "timeline": [{"event": "crossed", "t": 0.0, "at": t}]}
    assert list_line(rec)[1] == "?"
    assert "20261201T000000-x" in render(rec)

"""``sparkguard drill``: real fake-vLLM trees, real memory, real signals, the real guard loop.

Each drill puts its temporary line a fraction of a GiB under the MemAvailable read now and
fills at most 1 GiB; it is skipped when the host has too little headroom for that.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time

import pytest

from conftest import fake_vllm, line_below_now, mem_available, run_sparkguard, sg_env, sparkguard_cmd

GiB = 1 << 30


def _config(tmp_path, **guard) -> str:
    lines = ["incidents:", f"  dir: {tmp_path / 'incidents'}", "  journal: \"off\"", "metrics:", "  listen: \"off\""]
    if guard:
        lines += ["guard:"] + [f"  {k}: {v}" for k, v in guard.items()]
    path = tmp_path / "sparkguard.yaml"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def _need_headroom(extra: int = 0):
    _settle()
    if mem_available() < GiB + 2 * GiB + 2 * GiB + extra:
        pytest.skip("not enough MemAvailable for a safe drill on this host right now")


def _settle(band: int = 32 << 20, window: float = 1.5, limit: float = 20.0) -> None:
    """Wait (at most ``limit`` s) until MemAvailable stays within ``band`` bytes for ``window`` s.

    A previous drill's SIGKILLed tree returns its memory over a few seconds; a drill started
    meanwhile sees that memory come back during its fill and may never reach its line."""
    samples: list[tuple[float, int]] = []
    end = time.monotonic() + limit
    while time.monotonic() < end:
        now = time.monotonic()
        samples = [(t, v) for t, v in samples if now - t <= window] + [(now, mem_available())]
        vals = [v for _, v in samples]
        if now - samples[0][0] >= window * 0.9 and max(vals) - min(vals) <= band:
            return
        time.sleep(0.1)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


def _procs_with(word: str) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    if word.encode() in f.read():
                        out.append(int(d))
            except OSError:
                pass
    return out


def test_drill_passes_reports_and_leaves_real_engines_alone(tmp_path, root_only):
    """The default targets.match matches any `vllm serve`: a bystander engine must survive the drill."""
    _need_headroom()
    cfg = _config(tmp_path)
    bystander = fake_vllm.start("sg-bystander-" + os.urandom(3).hex(), "--hold", "16MiB")
    try:
        by_pids = bystander.pids(timeout=30)
        # --past 0.5GiB: memory that other work (or the kernel) gives back during the fill must not
        # keep the fill from reaching the line
        r = run_sparkguard("drill", "-c", cfg, "--json", "--rate", "1GiB/s", "--margin", "0.5GiB",
                           "--past", "0.5GiB", "--recover", "1s", timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
        rep = json.loads(r.stdout)
        assert rep["result"] == "PASS", rep["reason"]
        assert rep["escalated"] is False
        assert 0 <= rep["crossing_to_sigterm_seconds"] < 0.5
        assert rep["sigterm_to_exit_seconds"] is not None and rep["sigterm_to_exit_seconds"] < 5
        assert rep["term_below_bytes"] < rep["start_bytes"]
        assert rep["term_below_bytes"] - rep["configured_term_below_bytes"] > 2 * GiB
        assert rep["back_above_line"] is True and rep["left_processes"] == []
        # the headline says what happened, in order, with the real latency
        assert re.fullmatch(r"SIGTERM \d+\.\d ms after the crossing, tree gone \d+ ms later, "
                            r"memory back above the line", rep["reason"]), rep["reason"]
        events = [e["event"] for e in rep["timeline"]]
        assert events[:2] == ["crossed", "sigterm"] and "exited" in events and "sigkill" not in events
        inc = rep["incident"]
        assert inc["kind"] == "drill" and inc["drill"] is True
        assert rep["model"] in inc["target"]["title"]
        # the configured store holds the drill incident, marked as such
        files = list((tmp_path / "incidents").glob("*.json"))
        assert len(files) == 1, "no incident file in the configured store"
        rec = json.loads(files[0].read_text())
        assert rec["drill"] is True and rec["kind"] == "drill" and rec["id"] == rep["incident_id"]
        assert rep["incident_file"] == str(files[0])
        assert all(_alive(p) for p in by_pids), "the drill touched an engine that was not its own"
        assert "drill: fake engine" in r.stderr and "MemAvailable" in r.stderr   # progress was shown
        assert "sparkguard.reporter" not in r.stderr        # the report says it all; -v shows the log
    finally:
        bystander.stop()


def test_drill_ignore_term_escalates_after_grace(tmp_path, root_only):
    _need_headroom()
    cfg = _config(tmp_path, grace="1s")
    r = run_sparkguard("drill", "-c", cfg, "--json", "--ignore-term", "--rate", "1GiB/s", "--margin", "0.5GiB",
                       "--past", "0.5GiB", "--recover", "1s", timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    rep = json.loads(r.stdout)
    assert rep["result"] == "PASS", rep["reason"]
    assert rep["escalated"] is True
    assert 0.95 <= rep["sigkill_after_sigterm_seconds"] < 3.0
    assert rep["left_processes"] == []
    # SIGTERM's latency, then SIGKILL after the grace: not "SIGKILL ... ms after the crossing"
    assert re.fullmatch(r"SIGTERM \d+\.\d ms after the crossing \(ignored\), SIGKILL 1\.\d s after SIGTERM "
                        r"\(the 1 s grace was over\), tree gone, memory back above the line", rep["reason"]), rep["reason"]
    # the SIGKILL the reporter logs at priority err stays out of the progress output, yet is saved
    assert "sparkguard.reporter" not in r.stderr and "ERROR" not in r.stderr, r.stderr
    rec = json.loads((tmp_path / "incidents" / (rep["incident_id"] + ".json")).read_text())
    assert rec["kind"] == "drill" and rec["outcome"] == "killed"
    assert rep["incident_file"] == str(tmp_path / "incidents" / (rep["incident_id"] + ".json"))


def test_drill_verbose_shows_the_reporter_log(tmp_path, root_only):
    _need_headroom()
    cfg = _config(tmp_path)
    r = run_sparkguard("drill", "-c", cfg, "-v", "-q", "--rate", "1GiB/s", "--margin", "0.25GiB",
                       "--past", "0.5GiB", "--recover", "1s", timeout=120)
    assert r.returncode in (0, 1), r.stdout + r.stderr     # the verdict is the other tests' concern
    assert re.search(r"sparkguard\.reporter \w+ sigterm: SIGTERM vllm serve sparkguard-drill-", r.stderr), r.stderr


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_drill_interrupted_removes_its_fake_engine(tmp_path, root_only, sig):
    """Ctrl-C (SIGINT) or SIGTERM while the guard waits out a long grace: no fake process is left."""
    _need_headroom()
    cfg = _config(tmp_path, grace="60s")
    p = subprocess.Popen(sparkguard_cmd("drill", "-c", cfg, "--ignore-term", "--rate", "512MiB/s",
                                        "--margin", "0.25GiB", "--past", "0.5GiB"),
                         env=sg_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pids, model, seen = [], None, []
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = p.stderr.readline()
            if not line:
                break
            seen.append(line)
            m = re.search(r"fake engine (\S+) up \(pids ([\d, ]+)\)", line)
            if m:
                model, pids = m.group(1), [int(x) for x in m.group(2).split(",")]
            if pids and "term_sent" in line:       # the guard has SIGTERMed; the fake ignores it
                break
        assert pids and all(_alive(x) for x in pids), "".join(seen)
        p.send_signal(sig)
        out, err = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 130, err
    assert "interrupted" in out
    # memory after the tree was gone was never measured: say so, not "NOT above the line"
    assert re.search(r"^  after 3s +not measured \(the drill was interrupted\)$", out, re.M), out
    assert "NOT above" not in out and "recovered -" not in out
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_alive(x) for x in pids):
        time.sleep(0.05)
    assert not any(_alive(x) for x in pids)
    assert _procs_with(model) == []


def test_drill_refuses_near_the_configured_line(tmp_path, root_only):
    line = line_below_now(GiB)
    if line < GiB:
        pytest.skip("host too full for this check")
    cfg = _config(tmp_path, term_below=line)
    r = run_sparkguard("drill", "-c", cfg, timeout=60)
    assert r.returncode == 2
    assert "guard.term_below" in r.stderr and cfg in r.stderr and "refused" in r.stderr
    assert _procs_with("sparkguard-drill-") == []


def test_plan_places_lines_and_keeps_kill_distance():
    from sparkguard import config
    from sparkguard.drill import planning as drill
    cfg = config.from_dict({"guard": {"term_below": "1GiB", "kill_below": "0.5GiB"}}, "x.yaml", mem_total=64 * GiB)
    p = drill.plan(cfg, 20 * GiB, GiB, GiB // 2)
    assert p["term_below"] == 19 * GiB
    assert p["kill_below"] == 19 * GiB - GiB // 2
    assert p["fill_size"] == GiB + GiB // 2
    assert p["floor"] == 19 * GiB - GiB // 2 and p["fill_cap"] == drill.FILL_CAP * p["fill_size"]
    with pytest.raises(drill.DrillError, match="guard.term_below in x.yaml"):
        drill.plan(cfg, 4 * GiB, GiB, GiB // 2)      # floor 2.5 GiB < 1 GiB + 2 GiB
    assert drill.parse_rate("max") is None and drill.parse_rate("1GiB/s") == GiB


def _report(**kw) -> dict:
    r = {"result": "PASS", "reason": "", "config": "x.yaml", "signal": "available", "grace_seconds": 5.0,
         "term_below_bytes": 20 * GiB, "kill_below_bytes": None, "configured_term_below_bytes": GiB,
         "model": "sparkguard-drill-x", "fill_size_bytes": GiB, "fill_rate_bytes_per_second": float(GiB),
         "ignore_term": True, "start_bytes": 21 * GiB, "min_bytes": 19 * GiB, "overshoot_bytes": GiB,
         "crossing_to_sigterm_seconds": 0.0123, "sigterm_to_exit_seconds": 5.01, "escalated": True,
         "sigkill_after_sigterm_seconds": 5.0, "recover_seconds": 3.0, "after_bytes": 21 * GiB,
         "recovered_bytes": 2 * GiB, "back_above_line": True, "incident_id": "20260101T000000Z-abcdef",
         "incident_file": None, "incidents_dir": "/var/lib/sparkguard/incidents", "left_processes": [],
         "interrupted": False, "tree_gone": True}
    r.update(kw)
    return r


def test_headline_and_report_lines_say_what_was_measured():
    from sparkguard.drill import report as drill
    assert drill.headline(_report()) == ("SIGTERM 12.3 ms after the crossing (ignored), SIGKILL 5.0 s after SIGTERM "
                                         "(the 5 s grace was over), tree gone, memory back above the line")
    # a SIGKILL line reached before the grace is over is named as the reason
    assert "SIGKILL 800 ms after SIGTERM (below the SIGKILL line, before the 5 s grace was over)" in \
        drill.headline(_report(sigkill_after_sigterm_seconds=0.8, kill_below_bytes=19 * GiB))
    assert drill.headline(_report(escalated=False, sigkill_after_sigterm_seconds=None, sigterm_to_exit_seconds=0.25)) \
        == "SIGTERM 12.3 ms after the crossing, tree gone 250 ms later, memory back above the line"
    text = drill.format_report(_report(after_bytes=None, recovered_bytes=None, back_above_line=None,
                                       sigterm_to_exit_seconds=None, escalated=False, tree_gone=False))
    assert "  after 3s          not measured (the fake engine's tree was never gone)" in text
    assert "SIGTERM->exit     not measured (no exit seen)" in text
    assert "NOT saved in /var/lib/sparkguard/incidents" in text
    text = drill.format_report(_report(back_above_line=False, after_bytes=19 * GiB,
                                       incident_file="/i/20260101T000000Z-abcdef.json"))
    assert "  after 3s          19.00 GiB (recovered 2.00 GiB; NOT above the line)" in text
    assert "saved as /i/20260101T000000Z-abcdef.json" in text

"""Incident reports of the supervised engine: which run they describe, and when they are written.

A guard incident that hit the engine is reported when it closes (not only after the restart it
causes: memory may never come back, the daemon may die), describing the run the guard signalled,
even while the supervisor is still sweeping that run's tree; it is reported again, same id, with
the restart appended.  An incident that never touched the engine gets no restart event.

Real engines (the fake vLLM), real signals, the real reporter writing real files.  No memory is
allocated: the guard is made to act by moving its line above MemAvailable.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import threading
import time

import pytest
import yaml

from conftest import run_sparkguard
from supervisor_helpers import Daemon, engine_config, fake_cmd, free_port, restarted, unique, wait_gone
from sparkguard import meminfo, model

pytestmark = pytest.mark.usefixtures("root_only")


def mem_total() -> int:
    with open("/proc/meminfo", "rb") as f:
        return meminfo.parse(f.read())["MemTotal"]


class ReportLog(logging.Handler):
    """Awaits the reporter's "incident ID: OUTCOME: summary" log line (written once the file is saved)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.cv = threading.Condition()
        self.lines: list[str] = []

    def emit(self, record):
        with self.cv:
            self.lines.append(record.getMessage())
            self.cv.notify_all()

    def wait(self, pattern: str, timeout: float = 30.0) -> re.Match:
        rx = re.compile(pattern)
        with self.cv:
            m = None

            def found():
                nonlocal m
                m = next((rx.search(ln) for ln in self.lines if rx.search(ln)), None)
                return m is not None
            assert self.cv.wait_for(found, timeout), f"no report line {pattern!r}: {self.lines}"
            return m


def guard_incident(iid: str) -> model.Incident:
    """An incident as the guard's recorder builds it (:func:`sparkguard.model.new_incident`)."""
    inc = model.new_incident("memory", time.time(), model.Thresholds(1 << 30, None, 3.0, "available"), {})
    inc.id = iid
    return inc


def guard_event(inc: model.Incident, event: str, pids: list[int]) -> dict:
    """Append an event as the recorder does; returns its JSON (what the supervisor's hook gets)."""
    ev = model.Event(event, round(time.time() - inc.started_at, 4), time.time(), 0, pids, f"test: {event}")
    inc.timeline.append(ev)
    return ev.to_json()


def test_report_describes_the_run_the_guard_hit_while_its_tree_is_still_being_swept(tmp_path):
    """The guard SIGKILLs the engine's root; its EngineCore and workers (which ignore SIGTERM) are
    left behind, so the supervisor spends guard.grace sweeping them before it records the exit.
    The guard closes its incident meanwhile: the report must carry that run's own exit, last output
    lines and pid, not those of the run before it; and it is written at once."""
    from sparkguard import config, reporter
    from sparkguard.supervisor.core import Supervisor
    model, port = unique(), free_port()
    raw = engine_config(tmp_path, model, fake_cmd(model, port, "--mode", "ignore-term"), port)
    raw["guard"]["grace"] = "3s"
    cfg = config.from_dict(raw, str(tmp_path / "x.yaml"))
    rep = reporter.Reporter(str(tmp_path / "incidents"), "off")
    logs = ReportLog()
    rlog = logging.getLogger("sparkguard.reporter")
    level = rlog.level
    rlog.setLevel(logging.INFO)
    rlog.addHandler(logs)
    sup = Supervisor(cfg, reporter=rep, start_control=False)
    sup.start()
    seen: list[int] = []
    try:
        r = sup.wait("ready", 0, timeout=30)
        assert r["ok"], r
        first = r["status"]["pid"]
        seen += [first]
        # a previous run, whose exit and output lines a wrong report would show
        assert sup.command("restart")["ok"]
        r = sup.wait("ready", 1, timeout=30)
        assert r["ok"], r
        victim = r["status"]["pid"]
        seen += [victim]
        assert r["status"]["last_exit"]["pid"] == first
        victim_run = sup.run
        tree = [victim] + [p for p in victim_run.members if p != victim]
        seen += tree
        assert len(tree) == 4

        iid = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + os.urandom(3).hex()
        inc = guard_incident(iid)
        sup.on_guard_event(inc.ref(), guard_event(inc, "crossed", []))
        fd = os.pidfd_open(victim)
        signal.pidfd_send_signal(fd, signal.SIGKILL)       # the guard's escalation, root first
        os.close(fd)
        sup.on_guard_event(inc.ref(), guard_event(inc, "sigkill", [victim]))
        assert wait_gone([victim], 10) == []
        with sup.cv:     # the supervisor is sweeping the orphans (they ignore SIGTERM: grace 3 s)
            assert sup.cv.wait_for(lambda: sup.state == "sweeping" and sup.run is victim_run, 10), sup.status()
        t_close = time.monotonic()
        guard_event(inc, "recovered", [])
        inc.outcome, inc.ended_at, inc.summary = "killed", time.time(), "test: memory back"
        assert sup.take_incident(inc)
        assert sup.run is victim_run and sup.status()["last_exit"]["pid"] == first, "the sweep ended before the close"

        eng = inc.engine
        assert eng["pid"] == victim and eng["command"] == victim_run.argv
        assert eng["exit"]["pid"] == victim and eng["exit"]["signal"] == "SIGKILL", eng["exit"]
        assert eng["exit"]["reason"] == "guard"
        assert re.fullmatch(r"killed by SIGKILL after [0-9.]+ m?s \(guard: signalled by the memory guard\)",
                            eng["exit"]["detail"]), eng["exit"]
        assert any(f"ready pids={victim}," in ln for ln in eng["last_lines"]), eng["last_lines"]
        assert not any(f"ready pids={first}," in ln for ln in eng["last_lines"])
        assert eng["state"] == "sweeping" and eng["restarts"]["manual"] == 1 and eng["restarts"]["guard"] == 0

        # written at once (before the sweep is over, long before the restart), with the restart pending
        logs.wait(rf"incident {iid}: killed: test: memory back; engine restart pending", timeout=2.5)
        assert time.monotonic() - t_close < 3.0
        path = tmp_path / "incidents" / f"{iid}.json"
        saved = json.loads(path.read_text())
        assert saved["engine"]["pid"] == victim and saved["engine"]["exit"]["pid"] == victim
        assert saved["timeline"][-1]["event"] == "recovered"

        # the restart: reported again, same id, the restart appended; the run it describes unchanged
        r = sup.wait("ready", 2, timeout=30)
        assert r["ok"], r
        seen.append(r["status"]["pid"])
        logs.wait(rf"incident {iid}: killed: test: memory back; engine restarted", timeout=10)
        saved = json.loads(path.read_text())
        assert saved["timeline"][-1]["event"] == "restart" and saved["timeline"][-1]["pids"] == [r["status"]["pid"]]
        assert saved["engine"]["pid"] == victim and saved["engine"]["exit"]["pid"] == victim
        assert saved["engine"]["restarted"] is True and saved["engine"]["after"]["pid"] == r["status"]["pid"]
        assert saved["engine"]["restarts"]["guard"] == 1
        assert wait_gone(tree, 5) == []
    finally:
        sup.stop()
        rep.close()
        rlog.removeHandler(logs)
        rlog.setLevel(level)
    assert wait_gone(seen, 10) == []


def test_guard_incident_is_reported_when_it_closes_not_when_the_engine_restarts(tmp_path):
    """The guard SIGTERMs the engine and memory does not come back (its line stays above
    MemAvailable): the incident closes by recovery_timeout and must be saved and findable then,
    while the engine waits at the gate; the next incident (nothing to signal: no engine runs)
    gets no restart event.  Once the line is back down the engine restarts and the first
    incident is reported again with the restart."""
    model, port = unique(), free_port()
    total = mem_total()
    cfg = engine_config(tmp_path, model, fake_cmd(model, port), port,
                        start_above=total - 64 * 1024**2, quiesce_timeout="3s")
    cfg["guard"].update(grace="3s", recovery_wait="1s")
    d = Daemon(tmp_path, cfg)
    try:
        d.wait_control()
        st = d.wait_ready(timeout=30)        # the first start waited out the 3 s quiesce timeout
        victim = st["pid"]
        mark = d.mark()
        cfg["guard"]["term_below"] = total - 64 * 1024**2
        d.path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        d.proc.send_signal(signal.SIGHUP)
        d.wait_line(rf"sigterm: SIGTERM .*\(pid {victim}, ", timeout=30, start=mark)
        m = d.wait_line(r"incident (\S+): terminated_memory_not_back: (.*)", timeout=30, start=mark)
        iid = m.group(1)
        assert "; engine restart pending" in m.group(2)
        # saved now, while the engine is held (an incident is open again, then the gate)
        st = d.status()
        assert st["pid"] is None and st["starts"] == 1, st
        inc = json.loads((tmp_path / "incidents" / f"{iid}.json").read_text())
        assert inc["engine"]["pid"] == victim and inc["engine"]["exit"]["pid"] == victim
        assert inc["engine"]["exit"]["reason"] == "guard"
        assert [e["event"] for e in inc["timeline"]][-1] == "recovery_timeout"
        r = run_sparkguard("incidents", iid, "--dir", str(tmp_path / "incidents"), "--no-journal")
        assert r.returncode == 0, r.stderr
        assert f"Incident {iid}" in r.stdout and f"run            pid {victim}" in r.stdout, r.stdout
        assert "exit           exit code 0 after " in r.stdout and "(guard: signalled by the memory guard)" in r.stdout
        # memory still below the line: a second incident, with nothing to signal
        m2 = d.wait_line(r"no_target: ", timeout=30, start=mark)
        assert m2
        # the line back down: the second incident closes, the engine starts (the gate times out)
        mark2 = d.mark()
        cfg["guard"]["term_below"] = "128MiB"
        d.path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        d.proc.send_signal(signal.SIGHUP)
        other = d.wait_line(r"incident (\S+): no_target: ", timeout=30, start=mark2).group(1)
        st = d.wait_ready(after=1, timeout=60)
        d.wait_line(rf"incident {iid}: terminated_memory_not_back: .*; engine restarted", timeout=30, start=mark2)
        inc = d.incident("memory", start=mark2, where=lambda i: i["id"] == iid and restarted(i))
        assert inc["timeline"][-1]["pids"] == [st["pid"]]
        assert inc["engine"]["pid"] == victim and inc["engine"]["after"]["pid"] == st["pid"]
        assert st["restarts"]["guard"] == 1
        # the incident that never touched the engine: reported once, no restart in it
        no_target = json.loads((tmp_path / "incidents" / f"{other}.json").read_text())
        assert no_target["outcome"] == "no_target"
        assert "restart" not in [e["event"] for e in no_target["timeline"]]
        assert "engine restart" not in no_target["summary"] and "restarted" not in no_target["engine"]
        assert not any(re.search(rf"incident {other}: .*engine restarted", ln) for ln in d.lines)
    finally:
        d.cleanup()


def test_the_report_engine_section_reads_well():
    from sparkguard.incidents.render import render
    now = time.time()
    text = render({"id": "20250101T000000Z-abcdef", "started_at": now - 20, "ended_at": now, "engine": {
        "state": "sweeping", "detail": "pid 28114 exited; sweeping what is left of its tree", "lane": "calm",
        "pid": 28114, "command": ["/usr/bin/python3", "/usr/local/bin/vllm", "serve", "/models/a b", "--port", "8000"],
        "exit": {"code": 0, "signal": None, "at": now - 1, "uptime": 9.9, "reason": "guard", "pid": 28114,
                 "lane": "calm", "detail": "exit code 0 after 9.9 s (guard: signalled by the memory guard)"},
        "restarts": {"exit": 0, "guard": 1, "lane": 2, "manual": 0}, "last_lines": ["INFO loaded", "INFO bye"],
        "restarted": True, "after": {"state": "starting", "pid": 28200, "lane": "calm"}}})
    eng = text.split("\nEngine", 1)[1].splitlines()
    assert "  run            pid 28114, lane calm" in eng
    assert "  command        /usr/bin/python3 /usr/local/bin/vllm serve '/models/a b' --port 8000" in eng
    assert any(ln.startswith("  exit           exit code 0 after 9.9 s (guard: signalled by the memory guard) (at ")
               for ln in eng), eng
    assert "  restarted      yes, now starting (pid 28200, lane calm)" in eng
    assert "  restarts       guard 1, lane 2 (by reason, since the daemon started)" in eng
    assert "  last 2 output lines of pid 28114:" in eng and "    | INFO bye" in eng
    assert not any("{" in ln for ln in eng), eng          # no raw JSON

"""Engine supervision end to end: a real ``sparkguard run`` starts the real fake vLLM (processes,
memory, HTTP port), and the tests watch it through the real control socket, /proc and HTTP.

Each test uses a model name unique to it (also its targets.match), its own ports, socket and
state file; everything it starts is stopped in ``finally``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from conftest import fake_vllm, line_below_now, run_sparkguard, sg_env, sparkguard_cmd
from supervisor_helpers import (Daemon, engine_config, fake_cmd, free_port, kill_pids, restarted, unique,
                                wait_gone)

pytestmark = pytest.mark.usefixtures("root_only")


def http_get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(url, timeout=timeout) as r:
        return r.status, r.read()


def metric_samples(url: str) -> dict:
    _, body = http_get(url)
    out = {}
    for fam in text_string_to_metric_families(body.decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def environ(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        items = f.read().split(b"\0")
    return dict(x.decode().split("=", 1) for x in items if b"=" in x)


def history(st: dict, event: str) -> list[dict]:
    return [h for h in st["history"] if h["event"] == event]


def test_start_ready_output_env_process_group_and_metrics(tmp_path):
    model, port, mport = unique(), free_port(), free_port()
    cfg = engine_config(tmp_path, model, fake_cmd(model, port, "--load-time", "0.6"), port)
    cfg["metrics"]["listen"] = f"127.0.0.1:{mport}"
    d = Daemon(tmp_path, cfg)
    try:
        d.wait_control()
        st = d.wait_ready()
        pid = st["pid"]
        assert st["state"] == "ready" and st["up"] and st["ready"] and st["starts"] == 1
        # ready means the engine's port answers: the fake listens only after its 0.6 s "load"
        assert http_get(f"http://127.0.0.1:{port}/health")[0] == 200
        assert st["time_to_ready"] >= 0.6
        # its own process group and session, not the daemon's
        assert os.getpgid(pid) == pid and os.getsid(pid) == pid
        assert os.getpgid(pid) != os.getpgid(d.proc.pid)
        # the daemon's lowered oom_score_adj is not inherited; the engine's cmdline is intact (exec, same pid)
        assert open(f"/proc/{pid}/oom_score_adj").read().strip() == "0"
        # nor its raised CPU priority (the guard runs at nice -10 or lower, the engine at 0)
        assert os.getpriority(os.PRIO_PROCESS, d.proc.pid) < 0 and os.getpriority(os.PRIO_PROCESS, pid) == 0
        assert model in open(f"/proc/{pid}/cmdline").read()
        # vLLM gets a worker shutdown timeout below guard.grace (3 s): 3 - 2 = 1
        env = environ(pid)
        assert env["VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS"] == "1"
        # output forwarded line by line under the engine's own identifier and pid, as it happens
        d.wait_line(rf"^vllm\[{pid}\]: fake-vllm: serving url=http://127\.0\.0\.1:{port}")
        d.wait_line(rf"^vllm\[{pid}\]: \(Worker_TP1 pid=\d+\) ")
        # metrics over HTTP
        m = metric_samples(f"http://127.0.0.1:{mport}/metrics")
        assert m[("sparkguard_engine_up", ())] == 1
        assert m[("sparkguard_engine_ready", ())] == 1
        assert m[("sparkguard_engine_time_to_ready_seconds", ())] >= 0.6
        assert ("sparkguard_engine_quiesce_wait_seconds", ()) in m
        assert m[("sparkguard_engine_restarts_total", (("reason", "exit"),))] == 0
        if shutil.which("promtool"):
            _, body = http_get(f"http://127.0.0.1:{mport}/metrics")
            r = subprocess.run(["promtool", "check", "metrics"], input=body, capture_output=True, timeout=30)
            assert r.returncode == 0, r.stdout + r.stderr
        pids = list(d.engine_pids)
        assert len(pids) == 4
    finally:
        d.cleanup()
    # stopping the daemon stopped the whole engine tree
    assert wait_gone(pids, 10) == []


def test_output_to_journal_native_protocol(tmp_path):
    journal = pytest.importorskip("sparkguard.journal")
    import socket
    jpath = str(tmp_path / "journal.sock")
    js = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    js.bind(jpath)
    js.settimeout(20)
    model = unique()
    port = free_port()
    cfg = engine_config(tmp_path, model, fake_cmd(model, port), port, log="journal", journal_socket=jpath)
    d = Daemon(tmp_path, cfg)
    try:
        d.wait_control()
        st = d.wait_ready()
        seen = []
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            data = js.recv(1 << 20)
            fields = dict(ln.split(b"=", 1) for ln in data.split(b"\n") if b"=" in ln)
            seen.append(fields)
            if b"fake-vllm: serving" in fields.get(b"MESSAGE", b""):
                break
        last = seen[-1]
        assert b"fake-vllm: serving" in last[b"MESSAGE"]
        assert last[b"SYSLOG_IDENTIFIER"] == b"vllm"
        assert last[b"SYSLOG_PID"] == str(st["pid"]).encode()
        assert any(f.get(b"PRIORITY") == b"6" for f in seen)
        assert journal  # used
    finally:
        d.cleanup()
        js.close()


def test_crash_loop_backoff_grows(tmp_path):
    model, port = unique(), free_port()
    cfg = engine_config(tmp_path, model, fake_cmd(model, port, "--crash-after", "0.1", "--dead-linger", "0"), port,
                        backoff_initial="300ms", backoff_max="10s", stable_after="60s")
    d = Daemon(tmp_path, cfg)
    try:
        d.wait_control()
        st = d.wait_starts(4, timeout=60)
        starts = history(st, "start")
        exits = history(st, "exit")
        assert len(starts) >= 4 and len(exits) >= 3
        delays = [starts[i + 1]["mono"] - exits[i]["mono"] for i in range(3)]
        # 0.3 s, 0.6 s, 1.2 s: each wait longer than the last (plus sweep/gate time, small here)
        assert delays[0] >= 0.3 and delays[1] >= 0.6 and delays[2] >= 1.2, delays
        assert delays[0] < delays[1] < delays[2], delays
        assert st["restarts"]["exit"] >= 3
        for e in exits[:3]:
            assert "exit code 1" in e["detail"]
        # a crash loop is visible as such: the state says backoff with the count in a row
        assert st["consecutive_failures"] >= 3
    finally:
        d.cleanup()


def test_wedge_detected_terminated_restarted_with_incident(tmp_path):
    model, port, mport = unique(), free_port(), free_port()
    cfg = engine_config(tmp_path, model, fake_cmd(model, port, "--wedge-after", "0.3"), port,
                        probe={"interval": "300ms", "timeout": "500ms", "failures": 2})
    cfg["metrics"]["listen"] = f"127.0.0.1:{mport}"
    d = Daemon(tmp_path, cfg)
    try:
        d.wait_control()
        st = d.wait_ready()
        first = list(d.engine_pids)
        # /health keeps answering 200 on a wedged engine: only the probe can tell
        st = d.wait_starts(1, timeout=30)
        assert wait_gone(first, 10) == []
        assert st["restarts"]["wedged"] >= 1
        wedged = history(st, "wedged")
        assert wedged and "2 liveness probes failed" in wedged[0]["detail"]
        assert any("wedged: SIGTERM" in h["detail"] for h in history(st, "sigterm"))
        # reported once the engine exited (the log line of that first report), and again, same id,
        # with the restart it caused
        iid = d.wait_line(r"incident (\S+): terminated: engine wedged: .*; engine restart pending").group(1)
        d.wait_line(rf"incident {iid}: terminated: engine wedged: .*; engine restarted")
        inc = d.incident("wedged", where=restarted)
        assert inc["id"] == iid
        events = [e["event"] for e in inc["timeline"]]
        assert events[:2] == ["wedged", "sigterm"] and "exited" in events and events[-1] == "restart", events
        assert inc["outcome"] == "terminated" and inc["target"]["root_pid"] == first[0]
        assert inc["summary"].startswith("engine wedged: 2 liveness probes failed")
        assert any("fake-vllm: serving" in ln for ln in inc["engine"]["last_lines"])
        m = metric_samples(f"http://127.0.0.1:{mport}/metrics")
        assert m[("sparkguard_incidents_total", (("kind", "wedged"),))] >= 1
        assert m[("sparkguard_engine_restarts_total", (("reason", "wedged"),))] >= 1
    finally:
        d.cleanup()


def test_orphans_swept_before_the_next_start(tmp_path):
    model, port = unique(), free_port()
    cfg = engine_config(tmp_path, model, fake_cmd(model, port), port)
    d = Daemon(tmp_path, cfg)
    try:
        d.wait_control()
        st = d.wait_ready()
        first = list(d.engine_pids)
        top = st["pid"]
        assert first[0] == top and len(first) == 4
        # SIGKILL the API server (the test's own engine): vLLM leaves EngineCore and workers behind
        fd = os.pidfd_open(top)
        signal.pidfd_send_signal(fd, signal.SIGKILL)
        os.close(fd)
        st = d.wait_ready(after=1, timeout=30)
        assert wait_gone(first, 5) == [], "leftovers of the killed engine still run"
        sweep = [h for h in st["history"] if h["event"] == "sweep" and h["mono"] > 0]
        assert sweep and "3 leftover processes" in sweep[0]["detail"], st["history"]
        starts = history(st, "start")
        assert sweep[0]["mono"] < starts[-1]["mono"], "sweep must come before the next start"
        assert st["last_exit"]["signal"] == "SIGKILL"
        assert st["restarts"]["exit"] == 1
    finally:
        d.cleanup()


def test_stop_escalates_to_sigkill_on_an_engine_ignoring_sigterm(tmp_path):
    model, port = unique(), free_port()
    cfg = engine_config(tmp_path, model, fake_cmd(model, port, "--mode", "ignore-term"), port)
    cfg["guard"]["grace"] = "2s"
    d = Daemon(tmp_path, cfg)
    try:
        d.wait_control()
        d.wait_ready()
        pids = list(d.engine_pids)
        t0 = time.monotonic()
        r = run_sparkguard("engine", "--socket", d.socket, "stop", "--timeout", "30")
        took = time.monotonic() - t0
        assert r.returncode == 0, r.stderr
        assert "engine: stopped" in r.stdout
        assert took >= 2.0, "SIGKILL came before guard.grace"
        assert wait_gone(pids, 5) == []
        st = d.status()
        assert st["state"] == "stopped" and st["pid"] is None and st["starts"] == 1
        assert history(st, "sigkill"), st["history"]
        # and start brings it back (not counted as a restart)
        r = run_sparkguard("engine", "--socket", d.socket, "start", "--timeout", "30")
        assert r.returncode == 0, r.stderr
        st = d.status()
        assert st["ready"] and st["starts"] == 2 and sum(st["restarts"].values()) == 0
    finally:
        d.cleanup()


def test_guard_crossing_while_the_supervisor_stops_the_engine_sends_no_second_sigterm(tmp_path):
    # one escalation owner: `engine stop` has SIGTERMed the engine, which takes 6 s to shut down
    # (CUDA teardown); memory crosses the guard's line meanwhile.  The guard must not SIGTERM it
    # again (uvicorn force-exits on a second one), only keep its own grace clock and tree SIGKILL.
    model, port = unique(), free_port()
    cfg = engine_config(tmp_path, model, fake_cmd(model, port, "--exit-delay", "6"), port)
    MiB = 1024**2
    cfg["guard"].update({"term_below": line_below_now(768 * MiB), "grace": "30s", "recovery_wait": "10s"})
    d = Daemon(tmp_path, cfg)
    stop, hog = None, None
    try:
        d.wait_control()
        d.wait_ready()
        pids = list(d.engine_pids)
        mark = d.mark()
        stop = subprocess.Popen(sparkguard_cmd("engine", "--socket", d.socket, "stop", "--timeout", "60"),
                                env=sg_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 10
        while d.status()["state"] != "stopping":
            assert time.monotonic() < deadline, d.status()
            time.sleep(0.05)       # the control socket has no "until stopping" wait
        hog = b"\x01" * (1536 * MiB)        # memory under the line, by a process the guard cannot target
        out, err = stop.communicate(timeout=60)
        assert stop.returncode == 0 and "engine: stopped" in out, (out, err)
        del hog                               # memory back: the incident can close
        hog = None
        assert wait_gone(pids, 5) == []
        inc = d.incident("memory", start=mark, timeout=30)
        evs = [e["event"] for e in inc["timeline"]]
        assert evs[:2] == ["crossed", "sigterm"], evs
        assert "sigkill" not in evs, evs                  # the engine exited inside both graces
        assert "not sent again: the supervisor is already stopping it (stop)" in inc["timeline"][1]["detail"]
        st = d.status()
        assert len(history(st, "sigterm")) == 1, st["history"]      # the supervisor's own, once
        assert st["state"] == "stopped"
    finally:
        hog = None
        if stop is not None and stop.poll() is None:
            stop.kill()
            stop.wait()
        d.cleanup()


def test_lane_switch_end_to_end_and_lane_survives_daemon_restart(tmp_path):
    model, port, mport = unique(), free_port(), free_port()
    lanes = {"small": {"args": ["--served-model-name", f"{model}-small"], "env": {"SG_TEST_LANE": "small"}},
             "big": {"args": ["--served-model-name", f"{model}-big"], "env": {"SG_TEST_LANE": "big"}}}
    cfg = engine_config(tmp_path, model, fake_cmd(model, port), port, lanes=lanes, lane="small")
    cfg["metrics"]["listen"] = f"127.0.0.1:{mport}"
    d = Daemon(tmp_path, cfg)
    d2 = None
    try:
        d.wait_control()
        st = d.wait_ready()
        assert st["lane"] == "small"
        models = json.loads(http_get(f"http://127.0.0.1:{port}/v1/models")[1])
        assert models["data"][0]["id"] == f"{model}-small"
        first = list(d.engine_pids)
        r = run_sparkguard("engine", "--socket", d.socket, "lane", "big", "--timeout", "60")
        assert r.returncode == 0, r.stdout + r.stderr
        assert "lane big" in r.stdout
        st = d.status()
        assert st["lane"] == "big" and st["ready"] and st["restarts"]["lane"] == 1
        assert wait_gone(first, 5) == []
        models = json.loads(http_get(f"http://127.0.0.1:{port}/v1/models")[1])
        assert models["data"][0]["id"] == f"{model}-big"
        assert environ(st["pid"])["SG_TEST_LANE"] == "big"
        m = metric_samples(f"http://127.0.0.1:{mport}/metrics")
        assert m[("sparkguard_engine_lane_info", (("lane", "big"),))] == 1
        assert ("sparkguard_engine_lane_info", (("lane", "small"),)) not in m
        # an unknown lane is refused with the list of lanes
        r = run_sparkguard("engine", "--socket", d.socket, "lane", "huge")
        assert r.returncode == 1
        assert "no lane 'huge'; engine.lanes has small, big" in r.stderr
        # the lane survives a daemon restart
        assert d.stop() == 0
        assert wait_gone(list(d.engine_pids), 10) == []
        d2 = Daemon(tmp_path, cfg)
        d2.wait_control()
        st = d2.wait_ready()
        assert st["lane"] == "big"
        models = json.loads(http_get(f"http://127.0.0.1:{port}/v1/models")[1])
        assert models["data"][0]["id"] == f"{model}-big"
    finally:
        d.cleanup()
        if d2 is not None:
            d2.cleanup()


def test_editing_engine_lane_and_sighup_switches_lanes_and_survives_a_daemon_restart(tmp_path):
    """README: "editing engine.lane in the file wins" over the lane kept in the state file."""
    model, port = unique(), free_port()
    lanes = {name: {"args": ["--served-model-name", f"{model}-{name}"]} for name in ("calm", "fill", "big")}
    cfg = engine_config(tmp_path, model, fake_cmd(model, port), port, lanes=lanes, lane="calm")
    state_file = cfg["engine"]["state_file"]

    def serving() -> str:
        return json.loads(http_get(f"http://127.0.0.1:{port}/v1/models")[1])["data"][0]["id"]

    def reload(d: Daemon, lane: str) -> int:
        cfg["engine"]["lane"] = lane
        d.path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        mark = d.mark()
        d.proc.send_signal(signal.SIGHUP)
        d.wait_line(r"reloaded ", start=mark)
        return mark

    d = Daemon(tmp_path, cfg)
    d2 = None
    try:
        d.wait_control()
        assert d.wait_ready()["lane"] == "calm"
        first = list(d.engine_pids)
        # engine.lane edited, SIGHUP: the engine is restarted in the new lane, and the log says why
        mark = reload(d, "fill")
        d.wait_line(r"engine: lane: engine\.lane changed from calm to fill in \S+sparkguard\.yaml: "
                    r"switching to lane fill \(restart\)", start=mark)
        st = d.wait_ready(after=1, lane="fill", timeout=60)
        assert st["lane"] == "fill" and st["restarts"]["lane"] == 1 and serving() == f"{model}-fill"
        assert wait_gone(first, 5) == []
        with open(state_file) as f:
            state = json.load(f)
        assert state["lane"] == "fill" and state["config_lane"] == "fill"
        # ... and a daemon restart keeps it
        assert d.stop() == 0
        d2 = Daemon(tmp_path, cfg, name="again")
        d2.wait_control()
        st = d2.wait_ready()
        assert st["lane"] == "fill" and serving() == f"{model}-fill"
        # a lane chosen with 'sparkguard engine lane' stays over a reload that leaves engine.lane alone
        r = run_sparkguard("engine", "lane", "calm", "--socket", d2.socket, "--timeout", "60")
        assert r.returncode == 0, r.stdout + r.stderr
        reload(d2, "fill")
        st = d2.status()
        assert st["lane"] == "calm" and st["starts"] == 2 and st["want"] == "run"
        # a stopped engine stays stopped; the new engine.lane is used at its next start
        assert run_sparkguard("engine", "stop", "--socket", d2.socket, "--timeout", "30").returncode == 0
        mark = reload(d2, "big")
        d2.wait_line(r"engine: lane: engine\.lane changed from fill to big .*: lane big from the next start", start=mark)
        st = d2.status()
        assert st["state"] == "stopped" and st["lane"] == "big" and st["starts"] == 2
        r = run_sparkguard("engine", "start", "--socket", d2.socket, "--timeout", "60")
        assert r.returncode == 0, r.stdout + r.stderr
        st = d2.status()
        assert st["lane"] == "big" and st["ready"] and serving() == f"{model}-big"
    finally:
        d.cleanup()
        if d2 is not None:
            d2.cleanup()


def test_headless_rank_restarted_when_its_head_goes_away(tmp_path):
    head_model, model, hport = unique("sghead"), unique(), free_port()
    head = fake_vllm.start(head_model, "--hold", "8MiB", "--hold-core", "8MiB", "--hold-api", "8MiB",
                           "--tp", "1", "--port", str(hport))
    d = None
    try:
        head.wait_serving(30)
        cmd = fake_cmd(model, None, "--headless", "--node-rank", "1")
        cfg = engine_config(tmp_path, model, cmd, None, head_url=f"http://127.0.0.1:{hport}/health",
                            head_lost_after="1s")
        d = Daemon(tmp_path, cfg)
        d.wait_control()
        d.wait_ready()
        d.wait_line(r"engine: head: head http://127\.0\.0\.1:\d+/health answers")
        d.wait_line(r"fake-vllm: ready pids=")
        first = list(d.engine_pids)
        assert len(first) == 2          # vllm serve --headless -> VLLM::Worker_TP1
        t0 = time.monotonic()
        head.stop()
        st = d.wait_starts(1, timeout=30)
        assert time.monotonic() - t0 >= 1.0
        assert st["restarts"]["head"] == 1
        assert wait_gone(first, 5) == []
        assert history(st, "head")
    finally:
        head.stop()
        if d is not None:
            d.cleanup()


def test_engine_left_by_a_killed_daemon_with_another_command_is_stopped_before_the_new_start(tmp_path):
    """The daemon dies; the new one's config asks for another command: the engine it left is ours
    (verified: tests/test_adopt.py) but not adopted; it is stopped, and its tree gone, before the
    configured engine starts.  (With the same command it is adopted: tests/test_adopt.py.)"""
    model, port = unique(), free_port()
    cfg = engine_config(tmp_path, model, fake_cmd(model, port), port)
    d = Daemon(tmp_path, cfg)
    d2 = None
    try:
        d.wait_control()
        d.wait_ready()
        d.wait_line(r"fake-vllm: ready pids=")
        old = list(d.engine_pids)
        d.proc.kill()                      # the daemon dies; its engine keeps running, reparented
        d.proc.wait(10)
        assert all(os.path.exists(f"/proc/{p}") for p in old)
        cfg2 = engine_config(tmp_path, model, fake_cmd(model, port, "--load-time", "0.1"), port)
        d2 = Daemon(tmp_path, cfg2, name="again")
        d2.wait_control()
        st = d2.wait_ready()
        assert wait_gone(old, 5) == [], "the old engine is still running"
        assert st["pid"] not in old and http_get(f"http://127.0.0.1:{port}/health")[0] == 200
        assert st["adoption"]["result"] == "changed", st["adoption"]
        stopped = history(st, "sigterm")
        assert stopped and f"pid {old[0]}" in stopped[0]["detail"], st["history"]
    finally:
        d.cleanup()
        if d2 is not None:
            d2.cleanup()
        kill_pids(d.engine_pids)


def test_link_down_marks_the_engine_unhealthy_and_its_return_restarts_it(tmp_path):
    """link.mark_unhealthy: the daemon hands the link watch's incidents to Supervisor.link_event
    (netlink itself is tested in test_linkwatch); here the supervisor runs in-process on a real engine."""
    from sparkguard import config
    from sparkguard.supervisor.core import Supervisor
    model, port = unique(), free_port()
    cfg = config.from_dict(engine_config(tmp_path, model, fake_cmd(model, port), port), str(tmp_path / "x.yaml"))
    sup = Supervisor(cfg, reporter=None, start_control=False)
    sup.start()
    try:
        r = sup.wait("ready", 0, timeout=30)
        assert r["ok"], r
        first_pid = r["status"]["pid"]
        sup.link_event(True, "enp1s0f0np0 down for 5 s")
        st = sup.status()
        assert st["state"] == "ready" and st["pid"] == first_pid     # not restarted while the link is down
        assert "TP link down" in st["history"][-1]["detail"]
        sup.link_event(False, "enp1s0f0np0 back")
        r = sup.wait("ready", 1, timeout=30)
        assert r["ok"], r
        st = r["status"]
        assert st["restarts"]["link"] == 1 and st["pid"] != first_pid
        assert wait_gone([first_pid], 5) == []
    finally:
        sup.stop()
    assert sup.status()["pid"] is None


SYSTEM_PYTHON = "/usr/bin/python3"


def _runs_as_nobody() -> str | None:
    """Why the fake engine cannot run as nobody here (None when it can): the test interpreter may
    live under /root (mode 0700), so the engine runs on the system python, which needs
    setproctitle (python3-setproctitle, tests/install-deps) and this checkout readable by all."""
    import pwd
    try:
        pwd.getpwnam("nobody")
    except KeyError:
        return "no user nobody"
    if not os.access(SYSTEM_PYTHON, os.X_OK) or not shutil.which("setpriv"):
        return f"needs {SYSTEM_PYTHON} and setpriv"
    r = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", SYSTEM_PYTHON, "-c",
                        "import setproctitle, sys; sys.path[:0] = sys.argv[1:]; import fake_vllm",
                        os.path.dirname(fake_vllm.__file__),
                        str(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))],
                       capture_output=True, text=True, timeout=30, cwd="/")
    return None if r.returncode == 0 else f"nobody cannot run the fake engine on {SYSTEM_PYTHON}: {r.stderr[-300:]}"


def test_engine_user_runs_the_whole_tree_as_that_user(tmp_path):
    why = _runs_as_nobody()
    if why:
        pytest.skip(why + " (run tests/install-deps)")
    import pwd
    nobody = pwd.getpwnam("nobody")
    model, port = unique(), free_port()
    cmd = [SYSTEM_PYTHON] + fake_cmd(model, port)[1:]
    cfg = engine_config(tmp_path, model, cmd, port, user="nobody", cwd="/")
    d = Daemon(tmp_path, cfg)
    try:
        d.wait_control()
        st = d.wait_ready()
        pids = list(d.engine_pids)
        assert pids[0] == st["pid"] and len(pids) == 4          # vllm serve -> EngineCore -> 2 workers
        for pid in pids:
            with open(f"/proc/{pid}/status") as f:
                fields = dict(ln.split(":", 1) for ln in f if ":" in ln)
            uids, gids = fields["Uid"].split(), fields["Gid"].split()
            assert uids == [str(nobody.pw_uid)] * 4, (pid, uids)     # real, effective, saved, fs
            assert gids == [str(nobody.pw_gid)] * 4, (pid, gids)
            assert fields["Groups"].split() in ([], [str(nobody.pw_gid)]), fields["Groups"]  # root's dropped
        env = environ(st["pid"])
        assert env["USER"] == env["LOGNAME"] == "nobody" and env["HOME"] == nobody.pw_dir
        assert open(f"/proc/{st['pid']}/oom_score_adj").read().strip() == "0"
        assert os.readlink(f"/proc/{st['pid']}/cwd") == "/"
        # root's daemon still stops the tree it no longer owns
        r = run_sparkguard("engine", "--socket", d.socket, "stop", "--timeout", "30")
        assert r.returncode == 0, r.stderr
        assert wait_gone(pids, 10) == []
    finally:
        d.cleanup()


def test_a_start_that_keeps_failing_gives_up_with_an_incident_a_metric_and_engine_start_clears_it(tmp_path):
    """Three runs that fail before they are ready (engine.give_up_after's default) stop the
    supervisor: state given_up, sparkguard_engine_given_up 1, an incident of kind given_up; the
    backoff does not keep it trying.  `sparkguard engine start` tries again."""
    model, mport = unique(), free_port()
    cmd = [sys.executable, "-c", f"import sys; print({model!r}, 'cannot load'); sys.exit(3)"]
    cfg = engine_config(tmp_path, model, cmd, None, health_url=f"http://127.0.0.1:{free_port()}/health",
                        backoff_initial="100ms")
    cfg["metrics"] = {"listen": f"127.0.0.1:{mport}"}
    d = Daemon(tmp_path, cfg)
    try:
        d.wait_control()
        inc = d.incident("given_up", timeout=30)
        st = d.status()
        assert st["state"] == "given_up" and st["starts"] == 3, (st["state"], st["starts"])
        assert "gave up after 3 failed starts" in st["detail"], st["detail"]
        assert inc["outcome"] == "exited" and "gave up" in inc["summary"]
        assert inc["engine"]["exit"]["code"] == 3
        with urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=5) as r:
            fams = {f.name: f for f in text_string_to_metric_families(r.read().decode())}
        assert fams["sparkguard_engine_given_up"].samples[0].value == 1.0
        assert fams["sparkguard_engine_wanted"].samples[0].value == 0.0
        time.sleep(1.0)                         # the backoff would have started it again by now
        assert d.status()["starts"] == 3
        r = d.ctl("start")
        assert r["ok"], r
        st = d.wait_starts(3, timeout=10)
        assert st["starts"] >= 4
    finally:
        d.cleanup()

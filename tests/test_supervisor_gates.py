"""The gates before a (re)start, end to end: the guard's SIGTERM of the supervised engine, then a
restart only once memory is back and stable; and the peers gate against a second real
sparkguard on loopback.

Memory lines are placed relative to the MemAvailable read at the start of the test; at most
~5.5 GiB is held at once (a 2.5 GiB hog started by the test + the engine's 3 GiB fill).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import yaml

from conftest import mem_available, run_sparkguard
from supervisor_helpers import Daemon, engine_config, fake_cmd, free_port, restarted, unique
from sparkguard import meminfo, peers

pytestmark = pytest.mark.usefixtures("root_only")
GiB = 1024**3

HOG = r"""
import mmap, sys
n = int(sys.argv[1])
m = mmap.mmap(-1, n)
for i in range(0, n, 4096):
    m[i] = 1
print("held", flush=True)
sys.stdin.read()
"""


def history(st: dict, event: str) -> list[dict]:
    return [h for h in st["history"] if h["event"] == event]


def test_guard_sigterm_of_the_engine_restarts_only_after_the_quiesce_gate(tmp_path):
    if mem_available() < 10 * GiB:
        pytest.skip(f"needs 10 GiB MemAvailable, have {mem_available() / GiB:.1f}")
    model, port = unique(), free_port()
    cmd = fake_cmd(model, port, "--fill-size", "3GiB", "--fill-rate", "max", "--fill-on-signal")
    cfg = engine_config(tmp_path, model, cmd, port, stable_for="1s", stable_band="1GiB", quiesce_timeout="120s",
                        drop_caches=True)
    cfg["guard"].update(grace="3s", recovery_wait="5s")
    d = Daemon(tmp_path, cfg)
    hog = None
    try:
        d.wait_control()
        st = d.wait_ready()
        pids = list(d.engine_pids)
        tp0 = pids[2]
        # something else holds 2.5 GiB; the lines are placed around the MemAvailable read now
        # (other tests on this machine move it by GiBs): SIGTERM line 1.25 GiB below it, start gate
        # 1.25 GiB above it.  The engine's 3 GiB fill crosses the line; releasing the hog opens the gate.
        hog = subprocess.Popen([sys.executable, "-c", HOG, str(int(2.5 * GiB))], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True)
        assert hog.stdout.readline().strip() == "held"
        avail1 = mem_available()
        cfg["guard"]["term_below"] = avail1 - int(1.25 * GiB)
        cfg["engine"]["start_above"] = avail1 + int(1.25 * GiB)
        d.path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        mark = d.mark()
        d.proc.send_signal(signal.SIGHUP)
        d.wait_line(r"reloaded .*SIGTERM below", start=mark)
        # the engine's worker fills: MemAvailable falls below the line, the guard SIGTERMs the engine
        mark = d.mark()
        fd = os.pidfd_open(tp0)
        signal.pidfd_send_signal(fd, signal.SIGUSR1)
        os.close(fd)
        d.wait_line(r"engine: guard: the memory guard sent SIGTERM to pid \d+ \(incident ", timeout=60, start=mark)
        d.wait_line(r"engine: exit: pid \d+ exit code 0", timeout=30, start=mark)
        # memory is back above the line but not above the gate: the supervisor waits
        d.wait_line(r"engine: waiting: quiesce: MemAvailable", timeout=30, start=mark)
        st = d.status()
        assert st["state"] == "waiting" and st["pid"] is None and st["starts"] == 1, d.output()
        assert "quiesce" in st["detail"]
        drop = history(st, "drop_caches")
        assert drop and drop[-1]["detail"] == "dropped"
        # release the memory: the engine starts only after that, and after stable_for
        t_release = time.monotonic()
        hog.kill()
        hog.wait(10)
        st = d.wait_ready(after=1, timeout=60)
        start = history(st, "start")[-1]
        assert start["mono"] >= t_release + 1.0, (start, t_release, d.output())
        assert "(restart: guard)" in start["detail"]
        assert st["restarts"]["guard"] == 1
        assert st["quiesce_wait"] >= 1.0 and not st["quiesce_timed_out"]
        # the incident report carries the guard's actions, the engine's last lines and the restart
        inc = d.incident("memory", start=mark, where=restarted)
        events = [e["event"] for e in inc["timeline"]]
        assert events[:2] == ["crossed", "sigterm"] and "exited" in events and events[-1] == "restart", events
        assert inc["target"]["root_pid"] == pids[0] and inc["target"]["pattern"] == "engine:supervised"
        # the tree as it was when the guard chose it: memory read before SIGTERM, not after
        assert inc["target"]["tree"] and all(r["rss_bytes"] > 0 for r in inc["target"]["tree"])
        restart = inc["timeline"][-1]
        assert "engine restarted" in restart["detail"] and restart["pids"] == [st["pid"]]
        assert inc["engine"]["restarted"] and inc["engine"]["lane"] is None
        assert any("filling" in ln for ln in inc["engine"]["last_lines"]), inc["engine"]["last_lines"]
        assert inc["outcome"] == "terminated"
    finally:
        if hog is not None and hog.poll() is None:
            hog.kill()
            hog.wait(10)
        d.cleanup()


def test_peers_gate_waits_for_a_second_sparkguard(tmp_path):
    model, port, peer_port = unique(), free_port(), free_port()
    peer_url = f"http://127.0.0.1:{peer_port}"          # /metrics appended by the gate
    cfg = engine_config(tmp_path, model, fake_cmd(model, port), port, peers=[peer_url], start_above="256MiB")
    head = Daemon(tmp_path, cfg, name="head")
    peer = None
    try:
        head.wait_control()
        # no peer yet: the head does not start its engine
        head.wait_line(r"engine: waiting: peers: http://127\.0\.0\.1:\d+: no answer", timeout=30)
        st = head.status()
        assert st["state"] == "waiting" and st["starts"] == 0
        assert st["peers"][0]["ok"] is False and st["peers"][0]["available_bytes"] is None
        # the peer node's sparkguard comes up (guard only, metrics on loopback)
        pdir = tmp_path / "peer"
        pdir.mkdir()
        pmodel = unique("sgpeer")
        pcfg = {"guard": {"term_below": "128MiB"}, "targets": {"match": [pmodel]},
                "metrics": {"listen": f"127.0.0.1:{peer_port}"},
                "incidents": {"dir": str(pdir / "incidents"), "journal": "off"}}
        t_peer = time.monotonic()
        peer = Daemon(pdir, pcfg, name="peer")
        peer.wait_line(r"metrics on http://127\.0\.0\.1:\d+/metrics")
        st = head.wait_ready(timeout=60)
        assert history(st, "start")[-1]["mono"] > t_peer
        p = st["peers"][0]
        assert p["ok"] and p["available_bytes"] >= 256 * 1024**2 and p["url"] == peer_url
        # the gate compares what the peer reports with the threshold (read through prometheus_client)
        avail = mem_available()
        low = peers.check([peer_url], gate=avail + 64 * GiB)[0]
        assert not low.ok and low.available_bytes is not None and low.available_bytes < avail + 64 * GiB
        assert peers.check([peer_url], gate=64 * 1024**2)[0].ok
        bad = peers.check([f"http://127.0.0.1:{port}/health"], gate=1)[0]   # answers, but is no sparkguard
        assert not bad.ok and "sparkguard_memory_available_bytes" in bad.error
    finally:
        head.cleanup()
        if peer is not None:
            peer.cleanup()


def mem_total() -> int:
    with open("/proc/meminfo", "rb") as f:
        return meminfo.parse(f.read())["MemTotal"]


@pytest.mark.parametrize("gate", ["quiesce", "peers"])
def test_gate_timeout_starts_anyway_and_the_incident_says_so(tmp_path, gate):
    """A gate that never opens (start_above just below MemTotal; or a peer node that does not
    answer) delays the start by engine.quiesce_timeout, then the engine starts anyway; the status,
    the history and the guard incident's restart event say which gate timed out and why.
    The guard is made to act by moving its line above MemAvailable (no memory is allocated)."""
    model, port, dead = unique(), free_port(), free_port()
    total = mem_total()
    extra = ({"start_above": total - 64 * 1024**2} if gate == "quiesce"
             else {"peers": [f"http://127.0.0.1:{dead}"], "start_above": "64MiB"})
    cfg = engine_config(tmp_path, model, fake_cmd(model, port), port, quiesce_timeout="2s", **extra)
    cfg["guard"].update(grace="3s", recovery_wait="60s")
    d = Daemon(tmp_path, cfg)
    try:
        d.wait_control()
        st = d.wait_ready(timeout=30)
        # the first start waited the 2 s and says why it started anyway
        assert st["quiesce_timed_out"] and st["gate_timeout"]["gate"] == gate
        assert 2.0 <= st["quiesce_wait"] < 10, st["quiesce_wait"]
        want = "quiesce: MemAvailable" if gate == "quiesce" else f"peers: http://127.0.0.1:{dead}: no answer"
        assert st["gate_timeout"]["detail"].startswith(want), st["gate_timeout"]
        assert history(st, f"{gate}_timeout")[0]["detail"].startswith("starting anyway after 2.")
        r = run_sparkguard("engine", "--socket", d.socket, "status")
        assert f"(the {gate} gate timed out, started anyway)" in r.stdout, r.stdout
        first = st["pid"]
        # the guard's line above MemAvailable: it SIGTERMs the engine at once
        mark = d.mark()
        cfg["guard"]["term_below"] = total - 64 * 1024**2
        d.path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        d.proc.send_signal(signal.SIGHUP)
        d.wait_line(r"engine: guard: the memory guard sent SIGTERM to pid \d+ \(incident ", timeout=30, start=mark)
        d.wait_line(rf"engine: exit: pid {first} ", timeout=30, start=mark)
        d.wait_line(r"engine: waiting: a guard incident is open", timeout=30, start=mark)
        # the line back down: the incident closes, the gate times out again, the engine starts anyway
        cfg["guard"]["term_below"] = "128MiB"
        d.path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        d.proc.send_signal(signal.SIGHUP)
        st = d.wait_ready(after=1, timeout=60)
        assert st["restarts"]["guard"] == 1 and st["gate_timeout"]["gate"] == gate
        inc = d.incident("memory", start=mark, where=restarted)
        events = [e["event"] for e in inc["timeline"]]
        assert events[:2] == ["crossed", "sigterm"] and events[-1] == "restart", events
        restart = inc["timeline"][-1]
        assert restart["pids"] == [st["pid"]]
        assert (f"(the {gate} gate timed out after engine.quiesce_timeout 2 s, started anyway: {want}"
                in restart["detail"]), restart["detail"]
    finally:
        d.cleanup()

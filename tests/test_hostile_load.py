"""Issue 32, class 1: work whose cost someone else controls never stops the poll loop.

A config whose YAML aliases multiply, a SIGHUP storm and a connection storm on the metrics port
are applied to a real ``sparkguard run`` while a real fake-vLLM tree fills real memory; each
crossing's SIGTERM is compared with a quiet crossing of the same daemon (docs/failure-modes.md,
"Work whose cost someone else controls").
"""

from __future__ import annotations

import os
import re
import resource
import signal
import subprocess
import sys
import time

import pytest

from conftest import line_below_now, run_sparkguard, sg_env, sparkguard_cmd
from guardrun import GuardProc
from test_guard_incidents import events, filling_engine, wait_incident

GiB, MiB = 1024**3, 1024**2


def alias_bomb(levels: int = 9, width: int = 9) -> str:
    """A ~600-byte YAML document whose last anchor stands for ``width ** levels`` strings
    (9**9 = 387 million), given to a key that refuses a list (so an error message shows it)."""
    lines = [f"l0: &l0 [{', '.join(['lol'] * width)}]"]
    for i in range(1, levels):
        lines.append(f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * width)}]")
    return "\n".join(lines) + f"\nguard:\n  grace: *l{levels - 1}\n"


def _limited():
    resource.setrlimit(resource.RLIMIT_AS, (2 * GiB, 2 * GiB))


def test_yaml_whose_aliases_multiply_is_refused_at_once_naming_the_file(tmp_path):
    p = tmp_path / "bomb.yaml"
    p.write_text(alias_bomb())
    assert len(p.read_bytes()) < 700
    t = time.monotonic()
    r = subprocess.run(sparkguard_cmd("check-config", str(p)), env=sg_env(), capture_output=True, text=True,
                       timeout=60, preexec_fn=_limited)
    took = time.monotonic() - t
    assert r.returncode == 1, r.stderr[-2000:]
    assert str(p) in r.stderr and "aliases are expanded" in r.stderr, r.stderr[-2000:]
    assert took < 10, f"check-config took {took:.1f} s"


def test_recursive_alias_is_refused(tmp_path):
    p = tmp_path / "loop.yaml"
    p.write_text("targets:\n  match: &m [*m]\n")
    r = run_sparkguard("check-config", str(p))
    assert r.returncode == 1 and "recursive" in r.stderr, r.stderr


def test_anchors_that_stay_small_still_work(tmp_path):
    p = tmp_path / "anchors.yaml"
    p.write_text("guard:\n  grace: &g 9s\n  recovery_wait: *g\n"
                 "targets:\n  match: &pats ['vllm serve', 'sglang']\n  protect: *pats\n")
    r = run_sparkguard("check-config", str(p))
    assert r.returncode == 0, r.stderr


def test_deeply_nested_value_is_refused_with_a_bounded_message(tmp_path):
    p = tmp_path / "deep.yaml"
    p.write_text("guard:\n  grace: " + "[" * 40 + "]" * 40 + "\n")
    r = run_sparkguard("check-config", str(p))
    assert r.returncode == 1 and "levels deep" in r.stderr, r.stderr
    assert len(r.stderr) < 1000


#: A process that connects to PORT and closes at once, as fast as it can, for SECONDS.
STORM = """
import socket, sys, time
port, end = int(sys.argv[1]), time.monotonic() + float(sys.argv[2])
while time.monotonic() < end:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        pass
"""

#: A process that sends SIGNAL to PID RATE times a second for SECONDS (the test's own daemon).
SIGNALS = """
import os, sys, time
pid, sig, rate, end = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), time.monotonic() + float(sys.argv[4])
while time.monotonic() < end:
    os.kill(pid, sig)
    time.sleep(1 / rate)
"""


def _crossing(engine_factory, tmp_path, load: str) -> tuple[float, GuardProc | None, dict]:
    """One real crossing under ``load``: a fresh daemon (at the unit's Nice=-20) and a fresh
    filling fake vLLM; returns (crossing->SIGTERM s from the incident, the stopped daemon, the
    incident)."""
    from supervisor_helpers import free_port
    from test_guard_threads import PEER, wait_reads
    fe = filling_engine(engine_factory, fill=768 * MiB)
    port = free_port()
    # a short fill past a line 384 MiB down: little for the per-CPU lists to drain before the next case
    cfg = {"guard": {"term_below": line_below_now(384 * MiB), "grace": "20s"},
           "targets": {"match": [rf"vllm serve {fe.model}\b"], "fallback": "off"},
           "metrics": {"listen": f"127.0.0.1:{port}"}}
    helpers: list[subprocess.Popen] = []
    if load == "peer":
        # two hostile peers answering 8 MiB of valid exposition each; the supervised engine
        # (sleep) never starts: its peers gate reads them every 100 ms
        helpers = [subprocess.Popen([sys.executable, "-c", PEER], stdout=subprocess.PIPE, bufsize=0)
                   for _ in range(2)]
        peers = [f"http://127.0.0.1:{int(h.stdout.readline())}" for h in helpers]
        cfg["engine"] = {"command": ["sleep", "600"], "log": "stderr", "drop_caches": False,
                         "start_above": "64MiB", "stable_for": "0s", "quiesce_timeout": "600s",
                         "health_interval": "100ms", "peers": peers,
                         "state_file": str(tmp_path / "engine-state.json"),
                         "control_socket": str(tmp_path / "control.sock")}
    g = GuardProc(cfg, wrap=("nice", "-n", "-20"))
    try:
        g.wait_ready()
        if load == "peer":
            wait_reads(helpers[0], 3, timeout=60)
        g.wait_log("armed", timeout=20)
        if load == "connections":
            helpers = [subprocess.Popen([sys.executable, "-c", STORM, str(port), "60"]) for _ in range(2)]
        elif load == "sighup":
            helpers = [subprocess.Popen([sys.executable, "-c", SIGNALS, str(g.proc.pid), str(int(signal.SIGHUP)),
                                         "50", "60"])]
        elif load == "yaml":
            with open(g.config_path, "w") as f:
                f.write(alias_bomb())
            helpers = [subprocess.Popen([sys.executable, "-c", SIGNALS, str(g.proc.pid), str(int(signal.SIGHUP)),
                                         "10", "60"])]
        if helpers:
            time.sleep(2)       # the load runs: there is no event that says "storming now"
        pids = fe.pids()
        fe.start_fill()
        inc = wait_incident(g, timeout=60)
        assert fe.wait_gone(pids, timeout=10)
        assert events(inc)[:2] == ["crossed", "sigterm"], events(inc)
        status = open(f"/proc/{g.proc.pid}/status").read()
        inc["_vmhwm_kib"] = int(status.split("VmHWM:")[1].split()[0])
        # the kernel's wait to move the stopped tree into the guard's cgroup (one RCU grace
        # period, 5-20 ms here, docs/failure-modes.md class 2) is the same work under any load
        # and varies with the machine, not the load: it is taken out, what is left is the loop's
        log = g.wait_log("before its SIGTERM", timeout=10)
        moved = float(re.search(r"moved into cgroup \S+ in ([0-9.]+) ms before its SIGTERM", log).group(1))
        return inc["timeline"][1]["t"] - moved / 1000, g, inc
    finally:
        for p in helpers:
            p.kill()
            p.wait(10)
        g.stop()


def test_crossing_to_sigterm_under_hostile_load_stays_within_twice_the_quiet_case(engine_factory, tmp_path):
    """Connection storm on the metrics port (a new connection closed at once, 2 processes), SIGHUP
    50 times a second, two hostile peers whose pages the peers gate keeps reading, and a reload storm of a 600-byte YAML whose aliases multiply: each
    crossing's SIGTERM, less the kernel's wait to move the stopped tree into the guard's cgroup,
    within 2x the quiet crossing of the same run (10 ms of slack for a 2-core shared machine
    whose quiet figure is under a millisecond).  The reload storm is
    refused without the daemon's memory growing, and the armed target survives the SIGHUPs."""
    quiet, _, _ = _crossing(engine_factory, tmp_path, "quiet")
    bound = max(2 * quiet, quiet + 0.010)
    seen = {"quiet": quiet}
    for load in ("connections", "sighup", "yaml", "peer"):
        t, g, inc = _crossing(engine_factory, tmp_path, load)
        seen[load] = t
        if load == "yaml":
            log = g.log()
            assert "reload failed, keeping the running config" in log and "aliases are expanded" in log, log[-2000:]
            assert inc["_vmhwm_kib"] < 200 * 1024, f"daemon peaked at {inc['_vmhwm_kib']} KiB"
    print("crossing->SIGTERM (ms):", {k: round(v * 1000, 2) for k, v in seen.items()})
    over = {k: v for k, v in seen.items() if v > bound}
    assert not over, f"crossing->SIGTERM (s): {seen}; bound {bound:.4f} s"

"""End to end: a real ``sparkguard run`` against real fake-vLLM trees and real memory.

Each test starts its own fake vLLM (unique model name, ``targets.match`` hits only it),
places the line relative to the MemAvailable it reads, and allocates a few GiB at most.
"""

from __future__ import annotations

import glob
import json
import os
import re
import signal
import time

from conftest import line_above_now, mem_available
from conftest import line_below_now as _line_below
from guardrun import GuardProc

GiB = 1024**3
MiB = 1024**2


def incidents(g: GuardProc) -> list[dict]:
    out = []
    for path in glob.glob(os.path.join(g.cfg["incidents"]["dir"], "*.json")):
        with open(path) as f:
            out.append(json.load(f))
    return sorted(out, key=lambda i: i["started_at"])


def wait_incident(g: GuardProc, pred=lambda i: True, timeout: float = 30.0) -> dict:
    """Wait until a finished incident file satisfying ``pred`` exists."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for inc in incidents(g):
            if inc.get("ended_at") and pred(inc):
                return inc
        # the store is written by the reporter thread; its notify STATUS changes with each event
        g.notify.recv(0.2)
    raise AssertionError(f"no finished incident within {timeout}s (MemAvailable now "
                         f"{mem_available() / GiB:.2f} GiB); log:\n{g.log()[-3000:]}")


def events(inc: dict) -> list[str]:
    return [e["event"] for e in inc["timeline"]]


def filling_engine(engine_factory, *opts: str, fill: int = 2 * GiB):
    """A fake vLLM whose worker TP0 fills ``fill`` bytes as fast as it can on SIGUSR1."""
    return engine_factory("--fill-rate", "max", "--fill-size", str(fill), "--fill-on-signal", *opts)


def line_below_now(margin: int = GiB) -> int:
    """A line ``margin`` (default 1 GiB) under MemAvailable once it has settled (conftest)."""
    return _line_below(margin)


def test_engine_is_termed_and_gone_and_the_incident_says_so(engine_factory):
    fe = filling_engine(engine_factory)
    line = line_below_now()
    g = GuardProc({"guard": {"term_below": line, "grace": "20s"},
                   "targets": {"match": [rf"vllm serve {fe.model}\b"]}})
    try:
        g.wait_ready()
        pids = fe.pids()
        fe.start_fill()
        inc = wait_incident(g, timeout=60)
        assert fe.wait_gone(pids, timeout=10)
        assert events(inc)[:2] == ["crossed", "sigterm"]
        assert "exited" in events(inc) and events(inc)[-1] == "recovered"
        assert "sigkill" not in events(inc)
        assert inc["outcome"] == "terminated"
        assert inc["target"]["root_pid"] == fe.top_pid
        tree_pids = {r["pid"] for r in inc["target"]["tree"]}
        assert set(pids) <= tree_pids
        titles = {r["cmdline"] for r in inc["target"]["tree"]}
        assert "VLLM::EngineCore" in titles and "VLLM::Worker_TP0" in titles
        assert all(r["rss_bytes"] > 0 for r in inc["target"]["tree"])
        assert inc["thresholds"]["term_below_bytes"] == line
        assert inc["meminfo"]["MemAvailable"] < line + 512 * MiB
        assert inc["min_available_bytes"] < line
        assert inc["psi_memory"] is None or "some" in inc["psi_memory"]
        assert inc["host"] and inc["boot_id"] and inc["ended_at"] >= inc["started_at"]
        sigterm = inc["timeline"][1]
        assert sigterm["pids"] == [fe.top_pid] and sigterm["t"] < 1.0
    finally:
        g.stop()


def test_term_ignored_escalates_to_sigkill_of_the_whole_tree_including_orphans(engine_factory):
    fe = filling_engine(engine_factory, "--mode", "ignore-term", fill=GiB + 512 * MiB)
    line = line_below_now()
    g = GuardProc({"guard": {"term_below": line, "grace": "2s"},
                   "targets": {"match": [rf"vllm serve {fe.model}\b"]}})
    try:
        g.wait_ready()
        pids = fe.pids()
        fe.start_fill()
        g.notify.wait_for(lambda m: "term_sent" in m.get("STATUS", ""), timeout=60)
        t_term = time.monotonic()
        # the API server dies abruptly (as if OOM-killed): EngineCore and workers are orphaned
        os.kill(fe.top_pid, signal.SIGKILL)
        fe.proc.wait(10)
        survivors = pids[1:]
        assert all(not fe.exited(p) for p in survivors), "orphans should outlive the top"
        assert fe.wait_gone(survivors, timeout=15)
        assert time.monotonic() - t_term >= 1.5, "SIGKILL came before the grace period"
        inc = wait_incident(g, timeout=30)
        ev = events(inc)
        assert ev.count("sigterm") == 1 and "sigkill" in ev
        kill = next(e for e in inc["timeline"] if e["event"] == "sigkill")
        assert set(survivors) <= set(kill["pids"])
        assert kill["t"] >= 2.0
        assert inc["outcome"].startswith("killed")  # "killed_memory_not_back" if the box is busy
    finally:
        g.stop()


def test_no_second_victim_while_the_first_ones_memory_is_coming_back(engine_factory):
    first = engine_factory("--hold", "16MiB")
    second = engine_factory("--hold", "16MiB")
    # a line above MemAvailable and the kernel's per-CPU free lists (which would extend the wait,
    # sparkguard.pcp): memory stays "low" after the first victim is gone, as when stranded driver
    # memory takes a while to come back
    line = line_above_now()
    recovery_wait = 4.0
    g = GuardProc({"guard": {"term_below": line, "grace": "20s", "recovery_wait": f"{recovery_wait}s"},
                   "targets": {"match": [rf"vllm serve {first.model}\b", rf"vllm serve {second.model}\b"]}})
    try:
        first_pids, second_pids = first.pids(), second.pids()
        g.wait_ready()
        assert first.wait_gone(first_pids, timeout=30)
        t_gone = time.monotonic()
        # within recovery_wait the second engine must not be touched
        while time.monotonic() - t_gone < recovery_wait * 0.8:
            assert not second.exited(second.top_pid), "second victim chosen while memory was coming back"
            g.notify.recv(0.1)
        inc = wait_incident(g, lambda i: i["target"] and i["target"]["root_pid"] == first.top_pid, timeout=30)
        assert inc["outcome"] == "terminated_memory_not_back"
        assert events(inc)[-1] == "recovery_timeout"
        # after recovery_wait with memory still low, the guard acts again: a new incident, the next engine
        assert second.wait_gone(second_pids, timeout=30)
        assert time.monotonic() - t_gone >= recovery_wait * 0.9
        inc2 = wait_incident(g, lambda i: i["target"] and i["target"]["root_pid"] == second.top_pid, timeout=30)
        assert inc2["id"] != inc["id"]
    finally:
        g.stop()


def test_protected_processes_are_never_signalled(engine_factory):
    fe = engine_factory("--hold", "16MiB")
    line = line_above_now()
    # the engine's top runs as python3.x: protect it by comm
    g = GuardProc({"guard": {"term_below": line, "grace": "1s", "recovery_wait": "1s"},
                   "targets": {"match": [rf"vllm serve {fe.model}\b"], "protect": [r"python3.*"]}})
    try:
        g.wait_ready()
        g.notify.wait_for(lambda m: "no_target" in m.get("STATUS", ""), timeout=20)
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            g.notify.recv(0.2)
        assert all(not fe.exited(p) for p in fe.pids())
        assert "no_target" in g.log()
    finally:
        g.stop()
    # stopping closes the open incident: its report names no target but the largest processes
    inc = incidents(g)[-1]
    assert inc["outcome"].startswith("no_target") and inc["target"] is None
    assert inc["top_consumers"] and all(r["rss_bytes"] > 0 for r in inc["top_consumers"])


def test_dry_run_decides_and_reports_but_signals_nothing(engine_factory):
    fe = engine_factory("--hold", "16MiB")
    line = line_above_now()
    g = GuardProc({"guard": {"term_below": line, "grace": "1s", "dry_run": True},
                   "targets": {"match": [rf"vllm serve {fe.model}\b"]}})
    try:
        g.wait_ready()
        g.notify.wait_for(lambda m: "kill_sent" in m.get("STATUS", ""), timeout=20)
        assert all(not fe.exited(p) for p in fe.pids())
        # lower the line under memory: the dry-run incident closes
        g.write_config({**g.cfg, "guard": {"term_below": "64MiB", "dry_run": True}})
        g.proc.send_signal(signal.SIGHUP)
        inc = wait_incident(g, timeout=20)
        assert inc["dry_run"] is True and inc["outcome"] == "dry_run"
        assert events(inc)[:3] == ["crossed", "would_term", "would_kill"]
        assert all(not fe.exited(p) for p in fe.pids())
    finally:
        g.stop()


def test_an_action_that_raises_does_not_end_the_guard(engine_factory, tmp_path):
    """Fault injection: taking the armed target at the crossing raises the first time; the daemon
    logs it and searches again."""
    import subprocess
    import sys

    import yaml
    from conftest import sg_env
    fe = engine_factory("--hold", "16MiB")
    line = line_above_now()
    cfg = tmp_path / "sg.yaml"
    cfg.write_text(yaml.safe_dump({"guard": {"term_below": line, "grace": "5s"},
                                   "targets": {"match": [rf"vllm serve {fe.model}\b"]},
                                   "metrics": {"listen": "off"},
                                   "incidents": {"dir": str(tmp_path / "inc"), "journal": "off"}}))
    boot = ("import sys\nfrom sparkguard import armed, cli\nreal = armed.Armed.take\ncalls = []\n"
            "def flaky(*a, **k):\n    calls.append(1)\n    if len(calls) == 1:\n"
            "        raise RuntimeError('injected fault')\n    return real(*a, **k)\n"
            "armed.Armed.take = flaky\nsys.exit(cli.main(['run', '--config', sys.argv[1]]))\n")
    g = subprocess.Popen([sys.executable, "-c", boot, str(cfg)], env=sg_env(), stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    try:
        assert fe.wait_gone(fe.pids(), timeout=30), "the retry never TERMed the engine"
        assert g.poll() is None, "the guard died"
    finally:
        g.terminate()
        try:
            out = g.communicate(timeout=15)[0]
        except subprocess.TimeoutExpired:
            g.kill()
            out = g.communicate(timeout=15)[0]
    assert "injected fault" in out and "the guard keeps running" in out
    assert g.returncode == 0


# A guard-only engine (started here, outside any cgroup of its own) that answers the SIGTERM with a
# fork bomb whose members leave the tree: each forks FAN children, each child calls setsid and
# double-forks (the grandchild is re-parented to init: no descendant of anything the guard tracks),
# the grandchild does the same, GENERATIONS deep: at most 4 + 16 + 64 + 256 = 340 bombers, each
# holding 256 KiB of its own.  Its worker TP0 fills memory on SIGUSR1.  Every process of it carries
# the token (argv[1]) in its command line: that is how the test counts and cleans up its survivors.
FORK_BOMB = r"""
import os, signal, sys, time
tok, fill = sys.argv[1], int(sys.argv[2])
FAN, GENERATIONS = 4, 4

def bomber(depth):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    mine = bytearray(256 << 10)
    mine[::4096] = b"\1" * len(mine[::4096])
    if depth < GENERATIONS:
        for _ in range(FAN):
            try:
                pid = os.fork()
            except OSError:
                break
            if pid == 0:
                try:
                    os.setsid()
                    if os.fork() == 0:
                        bomber(depth + 1)
                finally:
                    os._exit(0)
            os.waitpid(pid, 0)
    while True:
        time.sleep(60)

def filler(*_):
    buf = bytearray(fill)
    buf[::4096] = b"\1" * len(buf[::4096])
    filler.buf = buf

workers = []
for role in ("fill", "sleep"):
    pid = os.fork()
    if pid == 0:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if role == "fill":
            signal.signal(signal.SIGUSR1, filler)
        while True:
            time.sleep(60)
    workers.append(pid)
signal.signal(signal.SIGUSR1, lambda *_: os.kill(workers[0], signal.SIGUSR1))
signal.signal(signal.SIGTERM, lambda *_: bomber(0))
print("ready", flush=True)
while True:
    time.sleep(60)
"""


def _with_token(tok: str) -> list[int]:
    """Live processes whose command line holds ``tok`` (a zombie's is empty)."""
    out, needle = [], tok.encode()
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    if needle in f.read():
                        out.append(int(d))
            except OSError:
                pass
    return out


def _kill_token(tok: str, timeout: float = 30.0) -> None:
    """SIGKILL (through pidfds) every process with ``tok`` in its command line until none is left
    (they are this test's: the token is unique); bounded."""
    deadline = time.monotonic() + timeout
    while (pids := _with_token(tok)) and time.monotonic() < deadline:
        for pid in pids:
            try:
                fd = os.pidfd_open(pid)
            except OSError:
                continue
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:      # still that process, after pidfd_open
                    if tok.encode() in f.read():
                        signal.pidfd_send_signal(fd, signal.SIGKILL)
            except OSError:
                pass
            finally:
                os.close(fd)
        time.sleep(0.05)


def test_a_guard_only_tree_that_forks_away_on_sigterm_is_killed_whole_and_gone_means_gone(tmp_path):
    """Issue 32, class 2: nothing of a forking guard-only tree is alive after the SIGKILL, memory
    comes back, and the incident says "exited" (victim tree gone) only when it is."""
    import subprocess
    import sys
    import uuid

    from sparkguard.guard import cgkill
    tok = f"sgforkbomb-{uuid.uuid4().hex[:12]}"
    fill = GiB + 384 * MiB
    line = line_below_now()
    root = subprocess.Popen([sys.executable, "-c", FORK_BOMB, tok, str(fill)], stdout=subprocess.PIPE)
    g = None
    try:
        assert root.stdout.readline() == b"ready\n"
        g = GuardProc({"guard": {"term_below": line, "grace": "1s", "recovery_wait": "5s"},
                       "targets": {"match": [re.escape(tok)]}})
        g.wait_ready()
        root.send_signal(signal.SIGUSR1)
        inc = wait_incident(g, timeout=60)
        alive = _with_token(tok)
        ev = events(inc)
        kill = next(e for e in inc["timeline"] if e["event"] == "sigkill")
        assert "exited" in ev, ev
        assert alive == [], (f"{len(alive)} processes of the tree alive after the incident said it was gone; "
                             f"timeline: {ev}")
        assert len(kill["pids"]) >= 20, f"the tree never forked (SIGKILL of {len(kill['pids'])} processes)"
        assert "(through cgroup.kill)" in kill["detail"] or "(through freeze" in kill["detail"], kill["detail"]
        assert inc["outcome"] == "killed", inc["outcome"]
        assert events(inc)[-1] == "recovered" and mem_available() > line
        # the victim's cgroup was removed once empty; the daemon's spare goes when it stops
        m = re.search(r"moved into cgroup (\S+) in [0-9.]+ ms before its SIGTERM", g.wait_log("before its SIGTERM"))
        victims = [m.group(1)]
        assert cgkill.VICTIM in victims[0] and not os.path.exists(victims[0])
        assert g.stop() == 0
        spare = os.path.join(os.path.dirname(victims[0]), f"{cgkill.VICTIM}{g.proc.pid}-2")
        assert not os.path.exists(spare)
        g = None
    finally:
        _kill_token(tok)
        if g is not None:
            g.stop()
        root.stdout.close()
        root.wait(10)


def test_a_victim_frozen_in_a_v1_freezer_is_thawed_so_its_sigkill_takes_and_the_outcome_follows_memory(
        engine_factory):
    """Issue 32, "Also": an engine frozen in a cgroup v1 freezer (what ``docker pause`` does on
    cgroup v1) cannot die of a SIGKILL until it is thawed: the guard's next SIGKILL pass thaws its
    freezer cgroup, the engine dies, memory comes back and the incident says ``killed``, not
    ``killed_memory_not_back`` after giving up on it."""
    import uuid

    with open("/proc/self/mountinfo") as f:      # the v1 freezer hierarchy: a "cgroup" mount with "freezer"
        mounts = [ln.split()[4] for ln in f if " - cgroup " in ln and "freezer" in ln.split(" - ")[1].split()[2]]
    if not mounts or not os.access(mounts[0], os.W_OK):
        import pytest
        pytest.skip("no writable cgroup v1 freezer hierarchy here")
    fz = os.path.join(mounts[0], f"sgtest-{uuid.uuid4().hex[:10]}")
    os.mkdir(fz)
    fe = filling_engine(engine_factory, "--mode", "ignore-term", fill=GiB + 512 * MiB)
    line = line_below_now()
    g = GuardProc({"guard": {"term_below": line, "grace": "1s", "recovery_wait": "5s"},
                   "targets": {"match": [rf"vllm serve {fe.model}\b"]}})
    try:
        pids = fe.pids()
        for pid in pids:
            with open(os.path.join(fz, "cgroup.procs"), "w") as f:
                f.write(str(pid))
        g.wait_ready()
        fe.start_fill()
        g.notify.wait_for(lambda m: "term_sent" in m.get("STATUS", ""), timeout=60)
        with open(os.path.join(fz, "freezer.state"), "w") as f:
            f.write("FROZEN")
        inc = wait_incident(g, timeout=45)
        assert "unkillable" not in events(inc) and "exited" in events(inc), events(inc)
        assert inc["outcome"] == "killed", inc["outcome"]
        assert fe.wait_gone(pids, timeout=10)
        assert "thawed, so that its SIGKILL takes" in g.wait_log("cgroup v1 freezer")
    finally:
        with open(os.path.join(fz, "freezer.state"), "w") as f:
            f.write("THAWED")
        g.stop()
        for pid in fe.pids() if not fe.exited(fe.top_pid) else []:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        wait_for_empty = time.monotonic() + 10
        while time.monotonic() < wait_for_empty:
            try:
                os.rmdir(fz)
                break
            except OSError:
                time.sleep(0.1)

"""The stop path's total time is one budget from the first SIGTERM (sparkguard/supervisor/stopbudget.py).

On a fake clock: the budget's arithmetic.  With real processes: a leftover found once the grace
is over is SIGKILLed at once (no fresh SIGTERM + grace), and a container runtime that does not
answer gets only what is left of the budget.  With the tests' real dockerd: a fake vLLM that
ignores SIGTERM inside a container, behind a runtime that hangs on the cleanup calls, and the
daemon's whole stop still ends inside the budget.
"""

from __future__ import annotations

import configparser
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dockerd import dockerd, unique_name  # noqa: F401 - the session fixture
from supervisor_helpers import Daemon, engine_config, free_port, wait_gone
from test_container import SMALL, _containers, _history, _inspect, _remove

from sparkguard import proctree
from sparkguard.guard.escalation import AFTER_KILL
from sparkguard.supervisor import container, process, stopbudget
from sparkguard.supervisor.stopbudget import CLEANUP, MARGIN, MIN_STEP, Deadline

ROOT = Path(__file__).resolve().parents[1]


class Clock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_the_budget_runs_from_the_first_sigterm_and_reserves_the_cleanup():
    clock = Clock()
    d = Deadline(5.0, clock=clock)
    assert stopbudget.budget(5.0) == 5.0 + AFTER_KILL + CLEANUP and d.left() == stopbudget.budget(5.0)
    clock.t += 3
    assert d.grace_left() == 2.0 and d.before_cleanup(AFTER_KILL) == AFTER_KILL
    clock.t += 4                       # the grace ended 2 s ago: a leftover gets none
    assert d.grace_left() == 0.0 and d.before_cleanup(AFTER_KILL) == 5.0 + AFTER_KILL - 7
    clock.t = d.end - CLEANUP + 1      # inside the cleanup reserve: no more waiting for processes
    assert d.before_cleanup(AFTER_KILL) == 0.0 and d.step(20) == CLEANUP - 1
    clock.t = d.end + 30               # spent: one short try per cleanup step, no more
    assert d.left() == 0.0 and d.step(20) == MIN_STEP


def test_the_shipped_units_stop_timeout_holds_the_default_grace_budget():
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.read(ROOT / "systemd" / "sparkguard.service")
    timeout = float(unit["Service"]["TimeoutStopSec"].rstrip("s"))
    assert timeout == stopbudget.UNIT_STOP_TIMEOUT
    from sparkguard.config.schema import GuardConfig
    assert stopbudget.join_timeout(GuardConfig().grace) + MARGIN <= timeout
    assert stopbudget.join_timeout(stopbudget.max_grace(timeout)) + MARGIN == timeout


def test_a_leftover_after_the_grace_is_sigkilled_at_once_not_given_a_fresh_grace():
    # a process of the engine's group that ignores SIGTERM, found by the sweep after the grace ended
    ignorer = subprocess.Popen([sys.executable, "-c", "import signal, sys, time\n"
                                "signal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint('up', flush=True)\n"
                                "time.sleep(120)"], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert ignorer.stdout.readline() == "up\n"
        st = proctree.read_proc(ignorer.pid).starttime
        notes = []
        dl = Deadline(30.0, t0=time.monotonic() - 31.0)       # the run's first SIGTERM was 31 s ago
        t0 = time.monotonic()
        found = process.sweep(ignorer.pid, {ignorer.pid: st}, 30.0, [], lambda e, d: notes.append(d), deadline=dl)
        took = time.monotonic() - t0
        assert found == [ignorer.pid] and ignorer.wait(10) == -signal.SIGKILL
        assert took < 5.0, f"the sweep waited {took:.1f} s: a fresh grace (30 s)"
        assert any("still alive after 30 s since the run's first SIGTERM" in n for n in notes), notes
    finally:
        if ignorer.poll() is None:
            ignorer.kill()
        ignorer.wait(10)
        ignorer.stdout.close()


def test_a_runtime_that_does_not_answer_gets_only_the_rest_of_the_budget(tmp_path):
    cli = tmp_path / "docker"
    cli.write_text("#!/bin/sh\nexec sleep 60\n")       # dockerd deep in reclaim: no answer
    cli.chmod(0o755)
    launch = container.Launch(str(cli), str(tmp_path / "x.cid"), None, dict(os.environ))
    (tmp_path / "x.cid").write_text("c" * 64)
    dl = Deadline(1.0, t0=time.monotonic() - 1.0 - AFTER_KILL - CLEANUP + 3.0)    # 3 s of the budget left
    t0 = time.monotonic()
    said = container.finish(launch, None, dl)
    took = time.monotonic() - t0
    assert "NOT removed" in said, said
    # without the budget: two CLI calls of CLI_TIMEOUT (20 s) each
    assert took < 3.0 + MIN_STEP + 2.0, f"finish took {took:.1f} s"


@pytest.fixture
def docker_env(dockerd, monkeypatch):  # noqa: F811
    monkeypatch.setenv("DOCKER_HOST", dockerd.host)
    return dockerd


def test_a_docker_engine_that_ignores_sigterm_behind_a_hung_runtime_stops_inside_the_budget(tmp_path, docker_env):
    d, tag = docker_env, unique_name()
    # the CLI sparkguard runs: the real docker, but once `slow` exists every call but `run` hangs
    # (dockerd not answering while the engine is being stopped); --rm=false: only rm -f removes it
    slow = tmp_path / "slow"
    wrapper = tmp_path / "bin" / "docker"
    wrapper.parent.mkdir()
    wrapper.write_text(f"#!/bin/sh\nif [ \"$1\" != run ] && [ -e {slow} ]; then exec sleep 120; fi\n"
                       f"exec {d.cli} \"$@\"\n")
    wrapper.chmod(0o755)
    grace = 1.0
    port = free_port()
    argv = d.fake_run(tag, *SMALL, "--mode", "ignore-term", "--port", str(port),
                      run_opts=("--label", f"sgtest={tag}"))
    argv = [str(wrapper), "run", "--rm=false", *[a for a in argv[2:] if a != "--rm"]]
    cfg = engine_config(tmp_path, tag, argv, port)
    cfg["guard"]["grace"] = f"{grace:g}s"
    sg = Daemon(tmp_path, cfg)
    try:
        sg.wait_control()
        st = sg.wait_ready(timeout=60)
        [cid] = _containers(d, tag)
        init = _inspect(d, cid)["State"]["Pid"]
        assert _history(st, "container"), st["history"]
        slow.write_text("")
        t0 = time.monotonic()
        code = sg.stop(timeout=120)
        took = time.monotonic() - t0
        assert code == 0
        assert wait_gone([init], 5) == [], "the engine that ignores SIGTERM was not SIGKILLed"
        # the whole stop: the budget (grace + after-kill + cleanup), one short try past it, the daemon's exit
        assert took <= stopbudget.join_timeout(grace) + 3.0, f"the stop took {took:.1f} s"
        sg.wait_line(r"SIGKILL \d+ processes", 1)
        sg.wait_line(r"rm -f .* failed", 1)          # it did try to remove the container
    finally:
        slow.unlink(missing_ok=True)
        sg.stop()
        _remove(d, tag)


def test_a_grace_the_units_stop_timeout_cannot_hold_is_warned_about_at_start(tmp_path):
    # a process engine is enough: the budget is the supervisor's, whatever the engine
    cfg = engine_config(tmp_path, "sgbudget", [sys.executable, "-c", "import time; time.sleep(60)"], None)
    cfg["guard"]["grace"] = f"{stopbudget.max_grace() + 1:g}s"
    sg = Daemon(tmp_path, cfg)
    try:
        sg.wait_line(r"guard.grace 88 s: stopping the engine may take up to 111 s, past the shipped unit's "
                     r"TimeoutStopSec=120 s", 20)
    finally:
        sg.stop(timeout=150)

"""The orphan check (sparkguard/supervisor/orphancheck.py): when it is armed, what it decides, what it stops.

The check under systemd itself (armed by a crash's stop-post, stopping the engine after a stop
during the restart wait, leaving an adopted one) runs in the booted Debian 12 container:
tests/system/test_adoption.py.  Here: the pure decision, the systemd-run command line, the
command with systemd's answers stood in for (PID 1 here is not systemd), and the stop of real
processes in a real cgroup2 directory this test makes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid

import pytest

from conftest import sg_env
from sparkguard import config, proctree, sysinfo
from sparkguard.host.files import atomic_write
from sparkguard.supervisor import cgroup as cgroups
from sparkguard.supervisor import handover, orphancheck as oc

ARMED = "0123456789abcdef0123456789abcdef"


def props(active="inactive", sub="dead", inv=ARMED) -> dict:
    return {"InvocationID": inv, "ActiveState": active, "SubState": sub}


def test_armed_after_a_crash_or_a_failed_start_not_after_a_restart_or_a_stop():
    crash = handover.CRASH_RESULTS
    assert oc.should_arm(None, "signal", crash) and oc.should_arm(None, "exit-code", crash)
    assert oc.should_arm("start", "exit-code", crash)
    assert not oc.should_arm("restart", "success", crash) and not oc.should_arm("stop", "signal", crash)
    assert oc.should_arm("?", "watchdog", crash) and not oc.should_arm("?", "success", crash)


@pytest.mark.parametrize("p,job,populated,keep,action,why", [
    (props(), None, True, "stop", oc.STOP, "stopped during its restart wait"),
    (props("failed", "failed"), None, True, "stop", oc.STOP, "stopped during its restart wait"),
    (props(), None, False, "stop", oc.LEAVE, "no engine cgroup"),
    (props("active", "running", "f" * 32), None, True, "stop", oc.LEAVE, "started again since"),
    # a later invocation stopped with engine.on_daemon_stop: keep, or its stop already ran stop-post
    (props("inactive", "dead", "f" * 32), None, True, "stop", oc.LEAVE, "started again since"),
    (props(inv=""), None, True, "stop", oc.LEAVE, "started again since"),
    (props(), "start", True, "stop", oc.LEAVE, "start job is queued"),
    (props(), "stop", True, "stop", oc.AGAIN, "a stop job"),
    (props("activating", "auto-restart"), None, True, "stop", oc.AGAIN, "auto-restart"),
    (props("deactivating", "stop-post"), None, True, "stop", oc.AGAIN, "stop-post"),
    (None, None, True, "stop", oc.AGAIN, "could not be read"),
    (props(), "?", True, "stop", oc.AGAIN, "could not be read"),
    (props(), None, True, "keep", oc.LEAVE, "on_daemon_stop: keep"),
])
def test_the_verdict_stops_only_an_engine_of_the_crashed_invocation_stopped_in_its_wait(p, job, populated, keep,
                                                                                         action, why):
    got, text = oc.verdict(ARMED, p, job, populated, keep)
    assert got == action and why in text, (got, text)


def test_the_timer_fires_after_the_wait_and_the_check_is_ordered_before_the_unit():
    argv = oc.argv("sparkguard.service", ARMED, 2, 4.0, "/sys/fs/cgroup/system.slice/sparkguard.service",
                   "/opt/sg/bin/python", "/etc/sparkguard/sparkguard.yaml", 62)
    assert argv[0] == "systemd-run" and f"--unit={oc.PREFIX}{ARMED}-2" in argv
    for opt in ("--on-active=4.000s", "--timer-property=AccuracySec=100ms", "--property=Type=oneshot",
                "--property=Before=sparkguard.service", "--property=TimeoutStartSec=62s", "--collect"):
        assert opt in argv, opt
    tail = argv[argv.index("--") + 1:]
    assert tail[:4] == ["/opt/sg/bin/python", "-m", "sparkguard", "orphan-check"]
    assert tail[tail.index("--invocation") + 1] == ARMED and tail[tail.index("--attempt") + 1] == "2"


def test_arm_refuses_what_it_cannot_put_on_a_command_line():
    assert "unusable" in oc.arm("sparkguard.service", "not-an-id", "/x", "/c", 2.0)
    assert "unusable" in oc.arm("a b.service", ARMED, "/x", "/c", 2.0)
    assert "unusable" in oc.arm("sparkguard.service", "", "/x", "/c", 2.0)
    assert "unusable" in oc.arm("-x.service", ARMED, "/x", "/c", 2.0)      # read as an option


@pytest.mark.parametrize("text,seconds", [("1s", 1.0), ("100ms", 0.1), ("1min 30s", 90.0), ("infinity", None),
                                          ("", None), ("1d 2h", 93600.0), ("2w", 1209600.0),
                                          ("1month", 2629800.0), ("1y 1d", 31557600.0 + 86400.0)])
def test_systemd_time_spans(text, seconds):
    assert oc.span(text) == seconds


@pytest.fixture
def engine_cgroup():
    """A unit-like cgroup2 directory ``sgtest-orphan-*.service`` with ``engine-t1`` holding a
    shell that ignores SIGTERM (a stubborn engine): ``(unit dir, engine dir, Popen)``; all removed after."""
    mount = cgroups.find_mount()
    if mount is None or os.geteuid() != 0:
        pytest.skip("needs root and a cgroup2 mount")
    unit = os.path.join(mount[0], f"sgtest-orphan-{uuid.uuid4().hex[:8]}.service")
    eng = os.path.join(unit, "engine-t1")
    try:
        os.makedirs(eng)
    except OSError as e:
        pytest.skip(f"cannot make a cgroup here: {e}")
    inside = subprocess.Popen(["sh", "-c", f"echo $$ > {eng}/cgroup.procs; trap '' TERM; exec sleep 60"])
    try:
        deadline = time.monotonic() + 5
        while not handover.unguarded_engines(unit) and time.monotonic() < deadline:
            time.sleep(0.02)       # the shell moves itself: awaited through cgroup.events, bounded
        assert handover.unguarded_engines(unit) == [eng]
        yield unit, eng, inside
    finally:
        inside.kill()
        inside.wait()
        for d in (eng, unit):
            try:
                os.rmdir(d)
            except OSError:
                pass


#: tests/: a stand-in for systemctl where PID 1 is not systemd: ``show`` prints $SG_SHOW (a file),
#: ``list-jobs`` prints nothing (no job); and for systemd-run, which records its arguments
SYSTEMCTL = """#!/bin/sh
case "$1" in show) cat "$SG_SHOW";; list-jobs) ;; *) exit 1;; esac
"""
SYSTEMD_RUN = """#!/bin/sh
printf '%s\n' "$@" > "$SG_RUN_LOG"
"""


@pytest.mark.parametrize("shown,effect", [
    ("InvocationID=%s\nActiveState=inactive\nSubState=dead\n" % ARMED, "stopped"),
    ("InvocationID=%s\nActiveState=activating\nSubState=auto-restart\n" % ARMED, "armed again"),
    ("InvocationID=%s\nActiveState=inactive\nSubState=dead\n" % ("f" * 32), "left"),
])
def test_the_command_stops_arms_again_or_leaves(tmp_path, engine_cgroup, shown, effect):
    """``sparkguard orphan-check`` as the timer runs it, with systemd's answers stood in for: the
    crashed invocation's unit stopped in its wait -> the engine cgroup's stubborn process is gone
    after the grace and the cgroup removed; still waiting -> check 2 armed through systemd-run,
    the engine untouched; started again since -> left alone."""
    unit, eng, inside = engine_cgroup
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    for name, text in (("systemctl", SYSTEMCTL), ("systemd-run", SYSTEMD_RUN)):
        (bin_ / name).write_text(text)
        (bin_ / name).chmod(0o755)
    (tmp_path / "show").write_text(shown)
    cfgfile = tmp_path / "sg.yaml"
    cfgfile.write_text("guard:\n  grace: 1s\nengine:\n  command: [x]\n  state_file: %s\n" % (tmp_path / "state.json"))
    env = dict(sg_env(), PATH=f"{bin_}:{os.environ['PATH']}", SG_SHOW=str(tmp_path / "show"),
               SG_RUN_LOG=str(tmp_path / "run.log"))
    r = subprocess.run([sys.executable, "-m", "sparkguard", "orphan-check", "--unit", os.path.basename(unit),
                        "--invocation", ARMED, "--cgroup", unit, "--config", str(cfgfile)],
                       env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    if effect == "stopped":
        assert inside.wait(10) is not None and not os.path.exists(eng), r.stderr
    else:
        assert inside.poll() is None and handover.unguarded_engines(unit) == [eng], r.stderr
    armed = (tmp_path / "run.log").read_text().split("\n") if (tmp_path / "run.log").exists() else []
    if effect == "armed again":
        assert f"--unit={oc.PREFIX}{ARMED}-2" in armed and armed[armed.index("--attempt") + 1] == "2", armed
    else:
        assert armed == [], armed


def test_the_check_signals_only_the_engine_cgroups_processes(tmp_path, engine_cgroup):
    """``stop_engines(loose=False)``: the processes of the unit's ``engine-*`` cgroup are stopped
    (SIGTERM, grace, SIGKILL); a process the state file records outside that cgroup (same start
    time) is not signalled."""
    unit, eng, inside = engine_cgroup
    outside = subprocess.Popen(["sleep", "60"])
    try:
        state = tmp_path / "state.json"
        atomic_write(str(state), json.dumps({"boot_id": sysinfo.boot_id(), "engine": {
            "pid": outside.pid, "starttime": proctree.read_proc(outside.pid).starttime, "members": {}}}))
        cfg = config.from_dict({"guard": {"grace": "1s"}, "engine": {"command": ["x"], "state_file": str(state)}})
        t0 = time.monotonic()
        stopped = handover.stop_engines(unit, cfg, loose=False)
        assert stopped == [eng], stopped
        assert inside.wait(10) is not None and time.monotonic() - t0 >= 0.9
        assert outside.poll() is None, "a recorded process outside the engine cgroup was signalled"
        assert not os.path.exists(eng)
    finally:
        outside.kill()
        outside.wait()


def test_a_cgroup_that_is_not_the_units_own_is_refused(tmp_path, engine_cgroup):
    """The ``--cgroup`` must be the unit's own ``ControlGroup`` when systemd reports one: a
    directory of the same name elsewhere is refused (exit 2) and its processes left alone."""
    unit, eng, inside = engine_cgroup
    name = os.path.basename(unit)
    mount = cgroups.find_mount()[0].rstrip("/")
    rel = "/" + os.path.relpath(unit, mount)
    assert oc.cgroup_ok(unit, name, rel) and oc.cgroup_ok(unit, name, None)
    assert not oc.cgroup_ok(unit, name, "/system.slice/" + name)
    assert not oc.cgroup_ok(unit + "/../" + name, name, None)                   # not as given
    link = tmp_path / name
    link.symlink_to(unit)
    assert not oc.cgroup_ok(str(link), name, None)                              # a symlink to it
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "systemctl").write_text(SYSTEMCTL)
    (bin_ / "systemctl").chmod(0o755)
    (tmp_path / "show").write_text("InvocationID=%s\nActiveState=inactive\nSubState=dead\n"
                                   "ControlGroup=/system.slice/%s\n" % (ARMED, name))
    env = dict(sg_env(), PATH=f"{bin_}:{os.environ['PATH']}", SG_SHOW=str(tmp_path / "show"))
    r = subprocess.run([sys.executable, "-m", "sparkguard", "orphan-check", "--unit", name, "--invocation", ARMED,
                        "--cgroup", unit, "--config", str(tmp_path / "absent.yaml")],
                       env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "refused" in r.stderr, r.stderr
    assert inside.poll() is None and handover.unguarded_engines(unit) == [eng]


def test_a_check_that_fails_says_so_in_the_units_journal_and_arms_the_next(monkeypatch, tmp_path):
    """An error while stopping (EPERM on a cgroup, a container CLI that fails) is logged at
    priority 3 to the unit's journal, and the next check is armed while attempts remain."""
    import argparse
    told, armed = [], []
    monkeypatch.setattr(oc, "args_ok", lambda *a: True)
    monkeypatch.setattr(oc, "show", lambda unit, props, timeout=0: {
        "InvocationID": ARMED, "ActiveState": "inactive", "SubState": "dead"})
    monkeypatch.setattr(handover, "unit_job", lambda unit, timeout: None)
    monkeypatch.setattr(handover, "unguarded_engines", lambda d: ["x/engine-1"])

    def fail(*a, **k):
        raise PermissionError(1, "Operation not permitted", "cgroup.kill")
    monkeypatch.setattr(handover, "stop_engines", fail)
    monkeypatch.setattr(oc, "arm", lambda *a: armed.append(a) or "orphan check 2 armed")
    monkeypatch.setattr(oc, "tell", lambda unit, text, priority=5: told.append((text, priority)))
    args = argparse.Namespace(unit="sparkguard.service", invocation=ARMED, cgroup=str(tmp_path), attempt=1,
                              config=str(tmp_path / "absent.yaml"))
    assert handover.orphan_check(args) == 0
    (text, priority), = told
    assert priority == 3 and "failed (PermissionError" in text and "again" in text, text
    assert len(armed) == 1 and armed[0][5] == 2


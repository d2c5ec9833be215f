"""bench/vm_oom.py's heartbeat, run here as it runs in the VM: it stamps its worst gap and takes
that gap apart into its own CPU, its runqueue wait and a watched process's CPU, from the real
/proc/PID/schedstat of real processes.  The table shows that breakdown."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "bench"))
import vm_oom  # noqa: E402


def _beat(hb) -> list[str]:
    """The heartbeat's last stamp, split; [] until it is whole (a read may meet a pwrite)."""
    try:
        fields = hb.read_text().split()
        int(fields[2])
        return fields if len(fields) == 7 else []
    except (OSError, IndexError, ValueError):
        return []


def test_the_heartbeat_takes_its_worst_gap_apart(tmp_path):
    script = tmp_path / "heartbeat.py"
    script.write_text(vm_oom.HEARTBEAT)
    hb, series = tmp_path / "hb", tmp_path / "series"
    # the watched "guard": a child that spins 0.3 s, then sleeps
    guard = subprocess.Popen([sys.executable, "-c", "import time\nend = time.monotonic() + 0.3\n"
                              "while time.monotonic() < end: pass\ntime.sleep(60)"])
    beat = subprocess.Popen([sys.executable, str(script), str(hb), str(series), str(guard.pid)])
    try:
        deadline = time.monotonic() + 30
        fields: list[str] = []
        while time.monotonic() < deadline:
            fields = _beat(hb)
            if fields and int(fields[2]) >= 30:
                break
            time.sleep(0.05)
        assert len(fields) == 7 and int(fields[2]) >= 30, fields
        now, worst, n, worst_at = float(fields[0]), float(fields[1]), int(fields[2]), float(fields[3])
        own_cpu, wait, guard_cpu = (float(x) for x in fields[4:7])
        assert 0.005 <= worst < 30 and worst_at <= now
        # the parts of one gap cannot add up to more than the gap (ms), nor the guard's CPU either,
        # give or take one scheduler tick: a running task's sum_exec_runtime is brought up to date
        # at ticks and switches, not when schedstat is read (kernel/sched/fair.c update_curr)
        tick = 11
        assert 0 <= own_cpu + wait <= worst * 1000 + tick
        assert 0 <= guard_cpu <= worst * 1000 + tick
        lines = series.read_text().split("\n")
        assert len(lines[0].split()) == 4      # time, MemAvailable, swap in use, MemTotal
    finally:
        beat.kill()
        guard.kill()
        beat.wait(timeout=10)
        guard.wait(timeout=10)


def test_the_heartbeat_without_a_guard_reports_zero_for_it(tmp_path):
    script = tmp_path / "heartbeat.py"
    script.write_text(vm_oom.HEARTBEAT)
    hb = tmp_path / "hb"
    beat = subprocess.Popen([sys.executable, str(script), str(hb), str(tmp_path / "series"), ""])
    try:
        deadline = time.monotonic() + 30
        fields: list[str] = []
        while time.monotonic() < deadline and (not fields or int(fields[2]) < 10):
            time.sleep(0.05)
            fields = _beat(hb)
        assert len(fields) == 7 and fields[6] == "0.0", fields
    finally:
        beat.kill()
        beat.wait(timeout=10)


def test_the_table_shows_the_worst_gap_taken_apart():
    rows = vm_oom.table([
        {"guard": "sparkguard", "procs": 1, "heartbeat_worst_stall_s": 0.013,
         "heartbeat_worst_gap_ms": {"own_cpu": 0.7, "runqueue_wait": 8.8, "guard_cpu": 2.1}},
        {"guard": "idle", "procs": 0, "heartbeat_worst_stall_s": 0.011}]).splitlines()
    assert rows[0].endswith("| worst gap: own CPU, runqueue wait, guard CPU ms |")
    assert rows[2].endswith("| 0.7, 8.8, 2.1 |") and rows[3].endswith("| - |")
    assert all(r.count("|") == rows[0].count("|") for r in rows)

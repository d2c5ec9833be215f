"""sparkguard doctor on this machine: real /proc, real sysctls (restored), real processes."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from conftest import run_sparkguard, sg_env
from test_host_sysctl import restore_sysctls  # noqa: F401  (fixture)

CHECKS = {"zram", "swappiness", "watermark_scale_factor", "page_cluster", "min_free_kbytes", "sysctl_boot",
          "memlock", "psi", "hidepid", "unit", "engine_sandbox", "engine_shutdown_timeout", "page_cache", "nvidia",
          "links", "metrics"}


def doctor_json(*args: str) -> tuple[int, dict]:
    r = run_sparkguard("doctor", "--json", *args)
    assert r.returncode in (0, 1), r.stderr
    return r.returncode, json.loads(r.stdout)


def by_name(report: dict) -> dict[str, dict]:
    return {c["name"]: c for c in report["checks"]}


def test_every_check_runs_and_the_exit_status_follows_the_verdicts():
    rc, report = doctor_json()
    checks = by_name(report)
    assert set(checks) == CHECKS
    for c in report["checks"]:
        assert c["status"] in ("PASS", "WARN", "FAIL", "INFO"), c
        assert c["message"] and "check could not run" not in c["message"], c
        if c["status"] in ("WARN", "FAIL"):
            assert c["fix"], c
    assert rc == (1 if any(c["status"] == "FAIL" for c in report["checks"]) else 0)
    assert report["exit_status"] == rc

    r = run_sparkguard("doctor")
    assert r.returncode == rc
    lines = [ln for ln in r.stdout.splitlines() if ln[:4] in ("PASS", "WARN", "FAIL", "INFO")]
    assert {ln.split()[1] for ln in lines} == CHECKS


def test_watermark_500_is_a_fail(restore_sysctls):  # noqa: F811
    Path("/proc/sys/vm/watermark_scale_factor").write_text("500")
    try:
        rc, report = doctor_json()
    finally:
        Path("/proc/sys/vm/watermark_scale_factor").write_text(restore_sysctls["vm.watermark_scale_factor"])
    c = by_name(report)["watermark_scale_factor"]
    assert c["status"] == "FAIL"
    assert "500" in c["message"] and "MemAvailable" in c["message"] and "leak" in c["message"]
    assert "--watermark-scale-factor 100" in c["fix"]
    assert c["data"]["high_watermarks_bytes"] > 0
    assert rc == 1


def test_zram_above_file_swap(own_zram, tmp_path):  # noqa: F811
    r = run_sparkguard("install-zram", "--device", own_zram, "--size", "64MiB", "--priority", "32000",
                       "--no-persist", "--root", str(tmp_path))
    assert r.returncode == 0, r.stderr
    c = by_name(doctor_json()[1])["zram"]
    assert f"/dev/{own_zram}" in c["message"]
    if c["status"] != "PASS":  # another swap at >= 32000 on this machine is not ours to judge
        pytest.skip(f"another swap outranks the test's zram: {c['message']}")

    swapfile = tmp_path / "slow.swap"
    swapfile.write_bytes(b"\0" * (32 * 1024**2))
    os.chmod(swapfile, 0o600)
    subprocess.run(["mkswap", str(swapfile)], check=True, capture_output=True, timeout=60)
    p = subprocess.run(["swapon", "--priority", "32767", str(swapfile)], capture_output=True, text=True, timeout=60)
    if p.returncode != 0:
        pytest.skip(f"cannot swapon a file here: {p.stderr.strip()}")
    try:
        c = by_name(doctor_json()[1])["zram"]
    finally:
        subprocess.run(["swapoff", str(swapfile)], timeout=300, check=False)
    assert c["status"] == "WARN"
    assert str(swapfile) in c["message"] and "priority" in c["fix"]


class FakeVllm:
    """A real process whose command line is ``<python> <dir>/vllm serve <model> ...``, as vLLM's
    entry-point script shows (the API server is not renamed), with a chosen environment."""

    def __init__(self, tmp_path: Path, args: list[str], env: dict[str, str]):
        script = tmp_path / "vllm"
        script.write_text(f"#!{sys.executable}\nimport time\nprint('ready', flush=True)\ntime.sleep(120)\n")
        script.chmod(0o755)
        self.proc = subprocess.Popen([str(script), *args], env=sg_env(**env), stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout.readline().strip() == "ready"

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=30)


@pytest.mark.parametrize("timeout,expected", [("30", "FAIL"), ("5", "PASS"), (None, "WARN")])
def test_engine_shutdown_timeout_against_grace(tmp_path, timeout, expected):
    model = f"sgtest-{uuid.uuid4().hex[:12]}"
    cfg = tmp_path / "sparkguard.yaml"
    cfg.write_text(f"guard:\n  grace: 10s\ntargets:\n  match: ['{model}']\n")
    env = {"VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS": timeout} if timeout else {}
    engine = FakeVllm(tmp_path, ["serve", model, "--port", "0"], env)
    try:
        rc, report = doctor_json("--config", str(cfg))
    finally:
        engine.stop()
    c = by_name(report)["engine_shutdown_timeout"]
    assert c["status"] == expected, c
    assert f"pid {engine.proc.pid}" in c["message"]
    assert [e["pid"] for e in c["data"]["engines"]] == [engine.proc.pid]
    if expected == "FAIL":
        assert rc == 1 and "grace" in c["message"]
    # the page-cache check knows an engine is running and does not judge its start-up
    assert by_name(report)["page_cache"]["status"] == "INFO"


def test_bad_config_is_a_clear_error(tmp_path):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("guard:\n  grace: soon\n")
    r = run_sparkguard("doctor", "--config", str(cfg))
    assert r.returncode == 1
    assert str(cfg) in r.stderr and "guard.grace" in r.stderr and "soon" in r.stderr


def test_renamed_engine_environment_is_reported_unknown(tmp_path):
    """setproctitle overwrites /proc/PID/environ: doctor must say it cannot tell, not PASS."""
    model = f"sgtest-{uuid.uuid4().hex[:12]}"
    cfg = tmp_path / "sparkguard.yaml"
    cfg.write_text(f"targets:\n  match: ['{model}']\n")
    code = ("import setproctitle, sys, time; setproctitle.setproctitle(sys.argv[1]); "
            "print('ready', flush=True); time.sleep(120)")
    proc = subprocess.Popen([sys.executable, "-c", code, f"VLLM::EngineCore {model}"], stdout=subprocess.PIPE,
                            text=True, env=sg_env(VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS="5"))
    try:
        assert proc.stdout.readline().strip() == "ready"
        rc, report = doctor_json("--config", str(cfg))
    finally:
        proc.kill()
        proc.wait(timeout=30)
    c = by_name(report)["engine_shutdown_timeout"]
    assert c["status"] == "WARN" and "overwritten" in c["message"], c


def start_guard(folder: Path) -> tuple[subprocess.Popen, Path]:
    """A real `sparkguard run` (dry run, nothing matched, no metrics/journal), running its loop;
    returns (process, its config file)."""
    import select
    import time

    folder.mkdir(parents=True, exist_ok=True)
    cfg = folder / "sparkguard.yaml"
    cfg.write_text(f"guard:\n  dry_run: true\ntargets:\n  match: ['sgtest-{uuid.uuid4().hex}']\n"
                   f"metrics:\n  listen: 'off'\nincidents:\n  dir: {folder}/inc\n  journal: 'off'\n")
    guard = subprocess.Popen([sys.executable, "-m", "sparkguard", "run", "--config", str(cfg)], env=sg_env(),
                             stderr=subprocess.PIPE, stdout=subprocess.DEVNULL)
    try:
        deadline, log = time.monotonic() + 30, ""
        while "started:" not in log:  # the daemon logs "started: ..." once its loop runs
            left = deadline - time.monotonic()
            assert left > 0 and guard.poll() is None, f"guard did not start: {log}"
            if select.select([guard.stderr], [], [], left)[0]:
                log += os.read(guard.stderr.fileno(), 65536).decode(errors="replace")
    except BaseException:
        stop_guard(guard)
        raise
    return guard, cfg


def stop_guard(guard: subprocess.Popen) -> None:
    guard.terminate()
    guard.wait(timeout=30)


def test_doctor_sees_a_running_guard_and_its_locked_memory(tmp_path):
    guard, _ = start_guard(tmp_path)
    try:
        _, report = doctor_json()
    finally:
        stop_guard(guard)
    checks = by_name(report)
    if checks["unit"]["data"].get("systemd") is False:
        assert guard.pid in checks["unit"]["data"]["pids"]
        assert checks["unit"]["status"] == "WARN" and str(guard.pid) in checks["unit"]["message"]
    locked = {int(k): v for k, v in checks["memlock"]["data"]["locked_bytes"].items()}
    assert locked[guard.pid] > 0  # root here: mlockall works and the check reads it back


def test_every_running_guard_is_named_and_several_are_a_warning(tmp_path):
    guards = []
    try:
        for name in ("one", "two"):
            guards.append(start_guard(tmp_path / name))
        _, report = doctor_json()
    finally:
        for g, _ in guards:
            stop_guard(g)
    unit = by_name(report)["unit"]
    assert unit["status"] == "WARN", unit
    assert "guards are running" in unit["message"]
    for g, cfg in guards:
        assert f"pid {g.pid} (--config {cfg})" in unit["message"]
        assert g.pid in unit["data"]["pids"]
    assert "stop" in unit["fix"]
    locked = {int(k) for k in by_name(report)["memlock"]["data"]["locked_bytes"]}
    assert {g.pid for g, _ in guards} <= locked


def _tune_commands(fix: str) -> list[str]:
    return [c.strip() for c in re.findall(r"sparkguard tune[^;()]*", fix)]


def test_doctor_suggests_tune_commands_that_tune_carries_out(restore_sysctls):  # noqa: F811
    """watermark_scale_factor 50 is a WARN whose fix is a tune run; without zram, plain `sparkguard tune`
    would be refused (swappiness 180 wants zram), so the fix must say what works."""
    Path("/proc/sys/vm/watermark_scale_factor").write_text("50")
    try:
        _, report = doctor_json()
        c = by_name(report)["watermark_scale_factor"]
        assert c["status"] == "WARN", c
        cmds = _tune_commands(c["fix"])
        assert cmds and all("--watermark-scale-factor 100" in cmd for cmd in cmds), c["fix"]
        runs = {cmd: run_sparkguard(*cmd.split()[1:], "--dry-run") for cmd in cmds}
    finally:
        Path("/proc/sys/vm/watermark_scale_factor").write_text(restore_sysctls["vm.watermark_scale_factor"])
    if by_name(report)["swappiness"]["data"]["fast_swap"]:
        assert len(cmds) == 1 and runs[cmds[0]].returncode == 0, runs
    else:  # install-zram first, or the command that passes without zram
        assert c["fix"].startswith("sparkguard install-zram, then sparkguard tune"), c["fix"]
        without = [cmd for cmd in cmds if "--swappiness 60" in cmd]
        assert len(without) == 1 and runs[without[0]].returncode == 0, runs[without[0]].stdout
        assert "would apply   vm.watermark_scale_factor  (50 -> 100)" in runs[without[0]].stdout

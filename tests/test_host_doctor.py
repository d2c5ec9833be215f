"""sparkguard doctor on this machine: real /proc, real sysctls (restored), real processes."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from conftest import run_sparkguard, sg_env
from test_host_sysctl import restore_sysctls  # noqa: F401  (fixture)

CHECKS = {"zram", "swappiness", "watermark_scale_factor", "page_cluster", "min_free_kbytes", "sysctl_boot",
          "memlock", "psi", "hidepid", "unit", "guard_priority", "other_killers", "container", "engine_sandbox", "engine_shutdown_timeout", "engine_restart_policy", "page_cache", "nvidia",
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


def doctor_beside_engine(tmp_path: Path, args: list[str], env: dict[str, str],
                         guard: str = "") -> tuple[int, int, dict]:
    """doctor, with a config matching a FakeVllm ``serve <model> ARGS`` it runs meanwhile:
    ``(engine pid, doctor's exit status, report)``.  ``guard``: extra ``guard:`` lines."""
    model = f"sgtest-{uuid.uuid4().hex[:12]}"
    cfg = tmp_path / "sparkguard.yaml"
    cfg.write_text((f"guard:\n{guard}" if guard else "") + f"targets:\n  match: ['{model}']\n")
    engine = FakeVllm(tmp_path, ["serve", model, *args], env)
    try:
        rc, report = doctor_json("--config", str(cfg))
    finally:
        engine.stop()
    return engine.proc.pid, rc, report


@pytest.mark.parametrize("timeout,expected", [("30", "FAIL"), ("5", "PASS"), (None, "WARN")])
def test_engine_shutdown_timeout_against_grace(tmp_path, timeout, expected):
    env = {"VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS": timeout} if timeout else {}
    pid, rc, report = doctor_beside_engine(tmp_path, ["--port", "0"], env, guard="  grace: 10s\n")
    c = by_name(report)["engine_shutdown_timeout"]
    assert c["status"] == expected, c
    assert f"pid {pid}" in c["message"]
    assert [e["pid"] for e in c["data"]["engines"]] == [pid]
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


def start_guard(folder: Path, prefix: tuple[str, ...] = ()) -> tuple[subprocess.Popen, Path]:
    """A real `sparkguard run` (dry run, nothing matched, no metrics/journal), running its loop,
    started through the command ``prefix`` (argv put before the interpreter); returns (process,
    its config file)."""
    import select
    import time

    folder.mkdir(parents=True, exist_ok=True)
    cfg = folder / "sparkguard.yaml"
    cfg.write_text(f"guard:\n  dry_run: true\ntargets:\n  match: ['sgtest-{uuid.uuid4().hex}']\n"
                   f"metrics:\n  listen: 'off'\nincidents:\n  dir: {folder}/inc\n  journal: 'off'\n")
    guard = subprocess.Popen([*prefix, sys.executable, "-m", "sparkguard", "run", "--config", str(cfg)], env=sg_env(),
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


def guard_pid(cfg: Path) -> int:
    """The pid (as this machine's /proc shows it) of the guard started with ``--config cfg``."""
    for d in os.listdir("/proc"):
        try:
            argv = Path(f"/proc/{d}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv[0] == sys.executable.encode() and b"sparkguard" in argv and str(cfg).encode() in argv:
            return int(d)
    raise AssertionError(f"no guard with --config {cfg}")


def lowering_oom_score_adj_works() -> bool:
    p = subprocess.run(["sh", "-c", "echo -1000 > /proc/self/oom_score_adj"], capture_output=True, timeout=30)
    return p.returncode == 0


def test_a_guard_at_oom_score_adj_0_and_nice_0_is_flagged(root_only, tmp_path):
    if not shutil.which("setpriv"):
        pytest.skip("setpriv (util-linux) missing")
    # root without CAP_SYS_RESOURCE and CAP_SYS_NICE: harden_self can lower neither
    prefix = ("sh", "-c", 'echo 0 > /proc/self/oom_score_adj && exec "$@"', "sh",
              "setpriv", "--bounding-set=-sys_resource,-sys_nice", "--inh-caps=-all")
    guards = [start_guard(tmp_path / "weak", prefix)]
    try:
        if lowering_oom_score_adj_works():
            guards.append(start_guard(tmp_path / "root"))
        rc, report = doctor_json()
    finally:
        for g, _ in guards:
            stop_guard(g)
    c = by_name(report)["guard_priority"]
    weak = guards[0][0].pid
    assert c["status"] == "FAIL" and rc == 1, c
    assert f"guard pid {weak}: oom_score_adj 0 (above -900" in c["message"], c["message"]
    assert "nice 0 (above -10" in c["message"] and "CAP_SYS_RESOURCE" in c["fix"]
    rows = {g["pid"]: g for g in c["data"]["guards"]}
    assert rows[weak]["oom_score_adj"] == 0 and rows[weak]["nice"] == 0 and rows[weak]["policy"] == "SCHED_OTHER"
    if len(guards) > 1:  # a guard that could harden itself is not flagged
        strong = guards[1][0].pid
        assert rows[strong]["oom_score_adj"] <= -900 and rows[strong]["nice"] <= -10
        assert f"guard pid {strong}: oom_score_adj {rows[strong]['oom_score_adj']}, nice" in c["message"]


def test_hidepid_is_judged_from_the_running_guards_own_view(root_only, tmp_path):
    if not shutil.which("setpriv") or not shutil.which("unshare"):
        pytest.skip("util-linux unshare/setpriv missing")
    # a real guard, root but without CAP_SYS_PTRACE, in its own mount and pid namespace: it starts
    # seeing everything, then /proc there is remounted hidepid=invisible (an admin's change after
    # the start-up check), and it sees only its own processes; doctor's own /proc shows everything
    prefix = ("unshare", "--mount", "--pid", "--fork", "--mount-proc", "--kill-child",
              "setpriv", "--bounding-set=-sys_ptrace", "--inh-caps=-all")
    guard, cfg = start_guard(tmp_path, prefix)
    try:
        pid = guard_pid(cfg)
        subprocess.run(["nsenter", "-t", str(pid), "-m", "mount", "-o", "remount,hidepid=invisible", "/proc"],
                       check=True, timeout=30)
        rc, report = doctor_json()
    finally:
        guard.kill()  # unshare ignores SIGTERM; --kill-child takes the namespace with it
        guard.wait(timeout=30)
    c = by_name(report)["hidepid"]
    assert c["status"] == "FAIL" and rc == 1, c
    assert f"guard pid {pid}: /proc is mounted hidepid=invisible where it runs" in c["message"], c["message"]
    assert "lacks CAP_SYS_PTRACE" in c["message"] and "CAP_SYS_PTRACE" in c["fix"]
    row = next(g for g in c["data"]["guards"] if g["pid"] == pid)
    assert row["uid"] == 0 and row["cap_sys_ptrace"] is False and row["proc_options"]["hidepid"] == "invisible"


SYSCTL_FILE = Path("/etc/sysctl.d/99-zz-sparkguard.conf")


def test_sysctl_file_passes_only_when_the_live_values_match(restore_sysctls):  # noqa: F811
    if SYSCTL_FILE.exists():
        pytest.skip(f"{SYSCTL_FILE} exists on this machine: not the test's to write")
    live = {k: int(v) for k, v in restore_sysctls.items()}
    SYSCTL_FILE.write_text("".join(f"{k} = {v}\n" for k, v in live.items()))
    try:
        c = by_name(doctor_json()[1])["sysctl_boot"]
        assert c["status"] == "PASS", c
        other = 61 if live["vm.swappiness"] != 61 else 62
        Path("/proc/sys/vm/swappiness").write_text(f"{other}\n")
        c = by_name(doctor_json()[1])["sysctl_boot"]
    finally:
        SYSCTL_FILE.unlink()
    assert c["status"] == "WARN", c
    assert f"vm.swappiness live {other} vs file {live['vm.swappiness']}" in c["message"], c["message"]
    assert "sparkguard tune --boot" in c["fix"]


def test_a_container_with_read_only_proc_sys_is_named_and_fixes_go_to_the_host(restore_sysctls):  # noqa: F811
    if not shutil.which("unshare"):
        pytest.skip("unshare (util-linux) missing")
    Path("/proc/sys/vm/watermark_scale_factor").write_text("50")
    cmd = f"exec {sys.executable} -m sparkguard doctor --json"
    r = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                        f"mount --bind /proc/sys /proc/sys && mount -o remount,bind,ro /proc/sys && {cmd}"],
                       env=sg_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode in (0, 1), r.stderr
    checks = by_name(json.loads(r.stdout))
    c = checks["container"]
    assert c["data"]["read_only"] == ["/proc/sys"] and "/proc/sys read-only here" in c["message"], c
    detect = shutil.which("systemd-detect-virt")
    if detect:
        box = subprocess.run([detect, "--container"], capture_output=True, text=True, timeout=30).stdout.strip()
        assert c["data"]["container"] == (None if box in ("", "none") else box)
    w = checks["watermark_scale_factor"]
    assert w["status"] == "WARN" and w["fix"].startswith("on the host (/proc/sys is read-only here): "), w


def start_named(tmp_path: Path, name: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """A real process whose program is ``name``: a copy of sleep under that name."""
    exe = tmp_path / name
    shutil.copy("/bin/sleep", exe)
    return subprocess.Popen([str(exe), "120"], env=env if env is not None else {"PATH": "/usr/bin:/bin"})


def test_other_killers_are_flagged(tmp_path):
    procs = [start_named(tmp_path, "earlyoom"), start_named(tmp_path, "nohang"),
             start_named(tmp_path / ".." / tmp_path.name, "raylet", {"RAY_ADDRESS": "127.0.0.1:6379"})]
    (tmp_path / "off").mkdir()
    procs.append(start_named(tmp_path / "off", "raylet", {"RAY_memory_monitor_refresh_ms": "0"}))
    try:
        rc, report = doctor_json()
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=30)
    c = by_name(report)["other_killers"]
    assert c["status"] == "WARN", c
    earlyoom, nohang, ray_on, ray_off = (p.pid for p in procs)
    assert f"earlyoom runs (pid {earlyoom})" in c["message"] and f"nohang runs (pid {nohang})" in c["message"]
    assert f"Ray process pid {ray_on} runs Ray's memory monitor (RAY_memory_monitor_refresh_ms unset)" in c["message"]
    assert f"pid {ray_off} " not in c["message"]
    assert "RAY_memory_monitor_refresh_ms=0" in c["fix"] and "earlyoom" in c["fix"]
    assert all(p.returncode == -9 for p in procs)  # doctor signalled none of them: only the test's kill ended them


@pytest.mark.parametrize("monitor,flagged", [(None, True), ("0", False)])
def test_a_vllm_engine_on_ray_without_the_monitor_off_is_flagged(tmp_path, monitor, flagged):
    env = {"RAY_memory_monitor_refresh_ms": monitor} if monitor else {}
    pid, _, report = doctor_beside_engine(tmp_path, ["--distributed-executor-backend", "ray"], env)
    c = by_name(report)["other_killers"]
    rows = {r["pid"]: r for r in c["data"]["ray"]}
    assert rows[pid]["RAY_memory_monitor_refresh_ms"] == monitor
    assert (f"Ray process pid {pid} runs Ray's memory monitor" in c["message"]) == flagged, c


@pytest.mark.parametrize("engine,flag,util,source", [
    (None, None, 0.92, "vLLM's default --gpu-memory-utilization 0.92; no engine in the configuration"),
    ({"command": ["vllm", "serve", "m", "--gpu-memory-utilization", "0.85"]}, None, 0.85,
     "--gpu-memory-utilization 0.85 (engine.command)"),
    ({"command": ["docker", "run", "--rm", "img", "vllm", "serve", "m", "--gpu-memory-utilization=0.7"],
      "lanes": {"big": {"args": ["--gpu-memory-utilization", "0.6"]}}, "lane": "big"}, None, 0.6,
     "--gpu-memory-utilization 0.6 (engine.command)"),
    ({"command": ["vllm", "serve", "m"]}, None, 0.92, "vLLM's default --gpu-memory-utilization 0.92"),
    ({"command": ["vllm", "serve", "m", "--gpu-memory-utilization", "lots"]}, None, 0.92,
     "vLLM's default 0.92 (--gpu-memory-utilization 'lots' is no number in engine.command)"),
    ({"command": ["vllm", "serve", "m", "--gpu-memory-utilization", "0.85"], "start_gate": {"utilization": 0.8}},
     None, 0.8, "engine.start_gate.utilization 0.8"),
    ({"command": ["vllm", "serve", "m", "--gpu-memory-utilization", "0.85"]}, "0.5", 0.5,
     "sparkguard doctor --gpu-memory-utilization 0.5"),
])
def test_the_page_cache_check_uses_the_engines_own_utilization(tmp_path, engine, flag, util, source):
    """vLLM's own default is 0.92 (vllm/config/cache.py), not 0.9; the configured engine's
    --gpu-memory-utilization (its lane's last) counts before it, the operator's flag before all."""
    import yaml
    cfg = {"guard": {"term_below": "1GiB"}}
    if engine is not None:
        cfg["engine"] = {"health_url": "http://127.0.0.1:8000/health", **engine}
    path = tmp_path / "sparkguard.yaml"
    path.write_text(yaml.safe_dump(cfg))
    _, report = doctor_json("--config", str(path), *(("--gpu-memory-utilization", flag) if flag else ()))
    c = by_name(report)["page_cache"]
    assert c["data"]["gpu_memory_utilization"] == util
    assert c["data"]["gpu_memory_utilization_source"] == source
    assert c["data"]["needed_bytes"] == int(c["data"]["mem_total_bytes"] * util)
    if c["status"] != "INFO":               # INFO: an engine runs on this host; the check then waits
        assert f"{util:g} x MemTotal" in c["message"] and source in c["message"]

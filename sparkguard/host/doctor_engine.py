"""doctor's checks of the engines beside the guard: other memory killers that would fight it,
the engine's sandbox, vLLM's worker shutdown timeout against the grace, a container restart
policy that restarts the engine behind the guard's back, the NVIDIA driver.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess

from sparkguard.host import procview
from sparkguard.host.doctor_base import (FAIL, INFO, PASS, UNIT, UNIT_FILE, WARN, Check, Context, engine_roots,
                                         worse)
from sparkguard.host.systemctl import query, systemd_running
from sparkguard.supervisor import container, container_cgroup
from sparkguard.units import format_duration

#: peer memory killers that act on their own lines: (program name, what it does)
KILLERS = {"earlyoom": "SIGTERMs/SIGKILLs the largest process when MemAvailable and SwapFree are low",
           "nohang": "SIGTERMs/SIGKILLs by its own thresholds and badness",
           "oomd": "kills whole cgroups on PSI pressure"}


def _program(argv: list[str]) -> str:
    """The program a process runs: argv[0]'s name, or the script's for an interpreter."""
    exe = os.path.basename(argv[0]) if argv else ""
    if exe.startswith(("python", "perl", "sh", "bash")) and len(argv) > 1 and not argv[1].startswith("-"):
        return os.path.basename(argv[1])
    return exe


def _is_ray(argv: list[str], env: dict[str, str] | None) -> bool:
    """A Ray process: raylet, ``ray start``, a ``ray::`` actor, vLLM on Ray's executor, or a process
    Ray started (RAY_ variables)."""
    cmd = " ".join(argv)
    return (_program(argv) == "raylet" or cmd.startswith("ray::") or
            re.search(r"--distributed-executor-backend[=\s]+ray\b", cmd) is not None or
            (_program(argv) == "ray" and "start" in argv) or
            any(k.startswith(("RAY_RAYLET_PID", "RAY_ADDRESS", "RAY_JOB_ID")) for k in (env or {})))


def check_other_killers(ctx: Context) -> Check:
    """Other killers that would fight the guard over the same engine: earlyoom, nohang or oomd
    running (found by program name in /proc; nothing is signalled), systemd-oomd active with
    ManagedOOMMemoryPressure/ManagedOOMSwap=kill on the unit or a slice above an engine
    (systemctl show; only when systemd is PID 1), and Ray's memory monitor in a Ray engine
    whose environment lacks ``RAY_memory_monitor_refresh_ms=0`` (FIELD-NOTES: Ray kills actors
    under unified-memory pressure; 0 turns its monitor off)."""
    worst, lines, fixes = PASS, [], []
    data: dict = {"killers": [], "oomd": None, "ray": []}
    me = os.getpid()
    for pid, _ppid, argv in ctx.processes():
        prog = _program(argv)
        if pid != me and prog in KILLERS:
            worst = worse(worst, WARN)
            data["killers"].append({"pid": pid, "program": prog, "cmdline": " ".join(argv)[:200]})
            lines.append(f"{prog} runs (pid {pid}): it {KILLERS[prog]}, beside the guard")
    if data["killers"]:
        fixes.append("stop " + ", ".join(sorted({k["program"] for k in data["killers"]})) +
                     " (systemctl disable --now NAME), or keep its lines below the guard's kill line")
    engines = engine_roots(ctx)
    if systemd_running():
        active = query("is-active", "systemd-oomd.service") == "active"
        data["oomd"] = {"active": active, "units": {}}
        if active:
            units = {UNIT}
            for pid, _cmd in engines:
                try:
                    path = procview.cgroup_path(pid) or ""
                except OSError:
                    continue
                units.update(p for p in path.split("/") if p.endswith((".service", ".slice", ".scope")))
            for u in sorted(units):
                out = query("show", "-p", "ManagedOOMMemoryPressure", "-p", "ManagedOOMSwap", u) or ""
                kv = dict(line.partition("=")[::2] for line in out.splitlines())
                data["oomd"]["units"][u] = kv
                kill = [k for k, v in kv.items() if v == "kill"]
                if kill:
                    worst = worse(worst, WARN)
                    lines.append(f"systemd-oomd is active and {u} has {', '.join(f'{k}=kill' for k in kill)}: "
                                 "it SIGKILLs the whole cgroup on its own pressure line, without the guard's TERM first")
                    fixes.append(f"set {', '.join(f'{k}=auto' for k in kill)} on {u} (a drop-in)")
    else:
        lines.append("systemd is not PID 1: no systemd-oomd to check")
    procs = {pid: argv for pid, _pp, argv in ctx.processes()}
    candidates = {pid for pid, _c in engines} | {pid for pid, argv in procs.items()
                                                  if _program(argv) == "raylet" or (_program(argv) == "ray" and "start" in argv)}
    for pid in sorted(candidates):
        try:
            env = procview.environ(pid)
        except OSError:
            continue
        if not _is_ray(procs.get(pid, []), env):
            continue
        value = None if env is None else env.get("RAY_memory_monitor_refresh_ms")
        data["ray"].append({"pid": pid, "RAY_memory_monitor_refresh_ms": value, "environment_hidden": env is None})
        if env is None:
            worst = worse(worst, WARN)
            lines.append(f"Ray process pid {pid}: its environment was overwritten by its title; cannot tell whether "
                         "Ray's memory monitor is off")
        elif value != "0":
            worst = worse(worst, WARN)
            lines.append(f"Ray process pid {pid} runs Ray's memory monitor (RAY_memory_monitor_refresh_ms "
                         f"{'unset' if value is None else '= ' + value}): Ray kills actors on its own line")
    if any(r["RAY_memory_monitor_refresh_ms"] != "0" for r in data["ray"]):
        fixes.append("start Ray (ray start, and the engine) with RAY_memory_monitor_refresh_ms=0")
    if worst == PASS:
        lines.insert(0, "no other memory killer runs (earlyoom, nohang, oomd, Ray's memory monitor)")
    return Check("other_killers", worst, "; ".join(lines), "; ".join(fixes) or None, data)


ENGINE_DROPIN = "/etc/systemd/system/sparkguard.service.d/engine.conf"


def check_engine_sandbox(ctx: Context) -> Check:
    """A configured engine (``engine.command``) gets the unit's engine drop-in: under the guard-only
    sandbox (ProtectSystem=strict, ProtectHome=read-only) a child of the guard finds the whole
    file system read-only (systemd/sparkguard.service.d/engine.conf says what it relaxes)."""
    command = getattr(getattr(ctx.config, "engine", None), "command", None)
    dropin = os.path.exists(ENGINE_DROPIN)
    unit = os.path.exists(UNIT_FILE)
    data = {"engine_configured": bool(command), "dropin": ENGINE_DROPIN if dropin else None, "unit_installed": unit}
    if not command:
        if dropin:
            return Check("engine_sandbox", INFO, f"no engine configured, but {ENGINE_DROPIN} relaxes the guard's "
                         "sandbox (ProtectSystem=full, ProtectHome=no, more capabilities)",
                         "sparkguard install --no-engine-sandbox (then systemctl restart sparkguard)", data)
        return Check("engine_sandbox", INFO, "no engine configured: the guard-only sandbox applies", None, data)
    if dropin:
        return Check("engine_sandbox", PASS, f"engine configured and {ENGINE_DROPIN} gives it a writable "
                     "/var, /tmp, /home and /root", None, data)
    if not unit:
        return Check("engine_sandbox", INFO, f"engine configured; {UNIT_FILE} is not installed "
                     "(`sparkguard install` adds the engine drop-in with it)", None, data)
    return Check("engine_sandbox", WARN, f"engine configured but {ENGINE_DROPIN} is missing: the engine inherits "
                 "the guard's sandbox and finds the file system read-only (model cache, compile caches, logs)",
                 "sparkguard install (adds the drop-in when the config has an engine), then systemctl restart "
                 "sparkguard", data)


def _engine_timeout(pid: int, cmd: str) -> tuple[float | None, str]:
    """vLLM's worker shutdown timeout of ``pid``: from ``--shutdown-timeout N`` or the
    environment variable VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS; ``(seconds|None, source)``.
    Raises PermissionError when the environment cannot be read."""
    m = re.search(r"--shutdown-timeout[=\s]+([0-9.]+)", cmd)
    if m:
        return float(m.group(1)), "--shutdown-timeout"
    with open(f"/proc/{pid}/environ", "rb") as f:
        env = f.read().split(b"\0")
    if not any(b"=" in kv for kv in env):
        # setproctitle grows the title into the environment's memory, which is what
        # /proc/PID/environ shows: renamed processes (VLLM::EngineCore) have none left
        return None, "hidden"
    for kv in env:
        if kv.startswith(b"VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS="):
            try:
                return float(kv.split(b"=", 1)[1]), "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS"
            except ValueError:
                return None, "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS (not a number)"
    return None, "unset"


def check_engine_timeout(ctx: Context) -> Check:
    """Each running vLLM's worker shutdown timeout is set and shorter than the guard's grace."""
    grace = ctx.config.guard.grace
    engines = [(pid, cmd) for pid, cmd in engine_roots(ctx) if "vllm" in cmd.lower()]
    if not engines:
        return Check("engine_shutdown_timeout", INFO, "no vLLM engine running; when you start one set "
                     f"VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS below the grace ({format_duration(grace)})",
                     None, {"grace_seconds": grace, "engines": []})
    worst, lines, fixes, data = PASS, [], set(), []
    for pid, cmd in engines:
        try:
            t, src = _engine_timeout(pid, cmd)
        except OSError as e:
            worst = WARN if worst == PASS else worst
            lines.append(f"pid {pid}: cannot read its environment ({e.strerror}; run doctor as root)")
            continue
        data.append({"pid": pid, "cmdline": cmd[:200], "timeout_seconds": t, "source": src})
        if src == "hidden":
            worst = WARN if worst == PASS else worst
            lines.append(f"pid {pid} ({cmd[:40]}): its environment was overwritten by its process title; "
                         "cannot tell its shutdown timeout")
            fixes.add(f"check that the engine was started with VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS below "
                      f"the grace ({format_duration(grace)})")
        elif t is None or t == 0:
            worst = WARN if worst == PASS else worst
            lines.append(f"pid {pid}: VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS {src}: on SIGTERM vLLM SIGKILLs its "
                         "workers within milliseconds, no clean CUDA teardown")
            fixes.add(f"start vLLM with VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS=N, N below the grace ({format_duration(grace)})")
        elif t >= grace:
            worst = FAIL
            lines.append(f"pid {pid}: shutdown timeout {t:g} s ({src}) is not shorter than the guard's grace "
                         f"{format_duration(grace)}: the guard SIGKILLs the tree mid-teardown")
            fixes.add(f"lower the engine's timeout below {format_duration(grace)}, or raise guard.grace above {t:g} s")
        else:
            lines.append(f"pid {pid}: shutdown timeout {t:g} s ({src}) < grace {format_duration(grace)}")
    return Check("engine_shutdown_timeout", worst, "; ".join(lines), "; ".join(sorted(fixes)) or None,
                 {"grace_seconds": grace, "engines": data})


#: restart policies under which docker/podman start a stopped engine again by themselves
#: (docker-run(1) ``--restart``: ``always`` and ``unless-stopped`` after any exit, ``on-failure`` after a non-zero one)
RESTARTING = ("always", "unless-stopped")


def check_engine_restart_policy(ctx: Context) -> Check:
    """A running engine in a docker/podman container (its root's cgroup,
    :func:`sparkguard.supervisor.container_cgroup.container_of`) whose restart policy (``docker inspect``:
    HostConfig.RestartPolicy) is ``always`` or ``unless-stopped``: after the guard stops it, the
    container runtime starts it again at once, with no memory gate, into the memory that is not
    back yet (FIELD-NOTES: unified memory has taken 60 s or more to come back after ``docker
    kill``; the public reports describe that OOM cascade).  ``on-failure`` is named too: the
    guard's SIGKILL is a failure."""
    found = [(pid, cmd, c) for pid, cmd in engine_roots(ctx) if (c := container_cgroup.container_of(pid)) is not None]
    data: dict = {"containers": []}
    if not found:
        return Check("engine_restart_policy", INFO, "no engine of targets.match runs in a container", None, data)
    worst, lines, fixes = PASS, [], []
    for pid, _cmd, (runtime, cid) in found:
        cli = shutil.which(runtime)
        if cli is None:
            worst = worse(worst, INFO)
            lines.append(f"pid {pid} runs in {runtime} container {cid[:12]}; {runtime} not found: cannot read its "
                         "restart policy")
            continue
        info = container.inspect(container.Launch(cli, "", None, dict(os.environ)), cid)
        if info is None:
            worst = worse(worst, INFO)
            lines.append(f"pid {pid} runs in container {cid[:12]}; `{runtime} inspect` did not answer "
                         "(DOCKER_HOST?): cannot read its restart policy")
            continue
        name = str(info.get("Name") or "").lstrip("/")
        policy = str(((info.get("HostConfig") or {}).get("RestartPolicy") or {}).get("Name") or "no")
        data["containers"].append({"pid": pid, "runtime": runtime, "id": cid, "name": name, "restart": policy})
        label = f"container {cid[:12]} ({name})" if name else f"container {cid[:12]}"
        if policy in RESTARTING or policy == "on-failure":
            worst = worse(worst, WARN)
            when = "after any exit" if policy in RESTARTING else "after a non-zero exit (the guard's SIGKILL)"
            lines.append(f"{label} runs the engine (pid {pid}) with --restart {policy}: {runtime} starts it "
                         f"again {when} at once, with no memory gate, before the memory is back")
            fixes.append(f"{runtime} update --restart no {name or cid[:12]}, and let sparkguard start it "
                         f"(engine.command: [{runtime}, run, ...], docs/containers.md)")
        else:
            lines.append(f"{label} runs the engine (pid {pid}), restart policy {policy}")
    return Check("engine_restart_policy", worst, "; ".join(lines), "; ".join(fixes) or None, data)


def check_nvidia(ctx: Context) -> Check:
    """NVIDIA driver and GPU visible (informational)."""
    data: dict = {}
    try:
        with open("/proc/driver/nvidia/version") as f:
            data["driver"] = f.readline().strip()
    except OSError:
        pass
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            p = subprocess.run([smi, "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=20)
            data["gpus"] = [ln.strip() for ln in p.stdout.splitlines() if ln.strip()]
        except (OSError, subprocess.TimeoutExpired) as e:
            data["nvidia_smi_error"] = str(e)
    if data.get("gpus"):
        return Check("nvidia", INFO, "GPU: " + "; ".join(data["gpus"]), None, data)
    if data.get("driver"):
        return Check("nvidia", INFO, "NVIDIA driver: " + data["driver"], None, data)
    return Check("nvidia", INFO, "no NVIDIA driver visible (/proc/driver/nvidia, nvidia-smi)", None, data)


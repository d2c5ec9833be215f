"""``sparkguard doctor``: check this host against what the guard needs.

Each check returns a :class:`Check` with a verdict (PASS, WARN, FAIL, or INFO for facts
that are neither), a one-line message with the measured values, and the fix.  A check
that cannot run (an odd /proc, a missing tool) is a WARN saying so; doctor itself never
dies of one.  Exit status: 1 when any check FAILs, else 0.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from sparkguard import meminfo, proctree
from sparkguard.host import procview, sysctl, virt
from sparkguard.units import format_duration, format_size

PASS, WARN, FAIL, INFO = "PASS", "WARN", "FAIL", "INFO"
UNIT = "sparkguard.service"
UNIT_FILE = "/etc/systemd/system/sparkguard.service"
CAP_IPC_LOCK = 14  # linux/capability.h


@dataclass
class Check:
    """One verdict: ``name`` (stable id), ``status`` (PASS/WARN/FAIL/INFO), ``message``,
    ``fix`` (what to do, or None) and ``data`` (measured values, JSON-ready)."""

    name: str
    status: str
    message: str
    fix: str | None = None
    data: dict = field(default_factory=dict)


@dataclass
class Context:
    """What the checks share: the loaded config, and the GPU memory utilisation vLLM is
    started with (the fraction of MemTotal its start-up check wants free)."""

    config: Any
    gpu_memory_utilization: float = 0.9
    _procs: list | None = None

    def processes(self) -> list[tuple[int, int, list[str]]]:
        """``[(pid, ppid, argv)]`` of every process, read once; unreadable ones and kernel threads skipped."""
        if self._procs is None:
            out = []
            for pid in proctree.pids():
                try:
                    argv = procview.argv(pid)
                    ppid = procview.ppid(pid)
                except (OSError, ValueError, IndexError):
                    continue
                if argv:
                    out.append((pid, ppid, argv))
            self._procs = out
        return self._procs


def tune_fix(**options: int) -> str:
    """The ``sparkguard tune`` command that sets ``options`` (``watermark_scale_factor=100``) and
    that tune will really carry out on this host, as doctor's fix text.

    tune applies every value at once (the persisted file's or the defaults, then the options),
    so a value its guard rails refuse blocks the whole run: a swappiness above 100 without zram
    or zswap (the default 180), a watermark_scale_factor above 200.  The text then says to run
    ``sparkguard install-zram`` first, or gives the options that pass without zram.
    """
    keys = {"swappiness": "vm.swappiness", "watermark_scale_factor": "vm.watermark_scale_factor",
            "page_cluster": "vm.page-cluster"}
    try:
        persisted = sysctl.read_persisted("/") or {}
    except Exception:  # noqa: BLE001 - a broken file is check_boot_sysctls' to report
        persisted = {}
    values = {**sysctl.DEFAULTS, **persisted, **{keys[k]: v for k, v in options.items()}}
    opts = dict(options)
    refusals = sysctl.guard_rails(values, sysctl.fast_swap())
    if any(r.key == "vm.watermark_scale_factor" for r in refusals):
        opts["watermark_scale_factor"] = 100
    cmd = "sparkguard tune" + "".join(f" --{k.replace('_', '-')} {v}" for k, v in opts.items())
    if any(r.key == "vm.swappiness" for r in refusals):
        alt = {**opts, "swappiness": 60}
        alt_cmd = "sparkguard tune" + "".join(f" --{k.replace('_', '-')} {v}" for k, v in alt.items())
        return (f"sparkguard install-zram, then {cmd}   (tune refuses swappiness {values['vm.swappiness']} "
                f"without zram; to stay without zram: {alt_cmd})")
    return cmd


# --- the checks ----------------------------------------------------------------------


def check_zram(ctx: Context) -> Check:
    """zram swap present, active, and used before any file/partition swap."""
    from sparkguard.sysinfo import read_swaps

    swaps = read_swaps()
    zr = [s for s in swaps if os.path.basename(s["filename"]).startswith("zram")]
    other = [s for s in swaps if s not in zr]
    data = {"zram": zr, "other_swap": other}
    if not zr:
        if not os.path.isdir("/sys/class/zram-control") and not os.path.isdir("/sys/block/zram0"):
            return Check("zram", WARN, "no zram swap, and the zram module is not loaded",
                         "modprobe zram; sparkguard install-zram", data)
        return Check("zram", WARN, "no zram swap is active: reclaim spikes go straight to the livelock",
                     "sparkguard install-zram (6 GiB at priority 100)", data)
    top = max(s["priority"] for s in zr)
    slow = [s for s in other if s["priority"] >= top]
    desc = ", ".join(f"{s['filename']} {format_size(s['size_bytes'])} prio {s['priority']}" for s in zr)
    if slow:
        names = ", ".join(f"{s['filename']} (prio {s['priority']})" for s in slow)
        return Check("zram", WARN, f"zram active ({desc}) but slow swap {names} is used as early",
                     "lower the file swap's priority (pri=10 in /etc/fstab, or swapon --priority) "
                     "or raise zram's (sparkguard install-zram --priority)", data)
    return Check("zram", PASS, f"zram active: {desc}" + (", above file swap" if other else ""), None, data)


def check_swappiness(ctx: Context) -> Check:
    """vm.swappiness: high with zram (180), at most 100 without a fast swap."""
    v = sysctl.read("vm.swappiness")
    if v is None:
        return Check("swappiness", WARN, "cannot read /proc/sys/vm/swappiness")
    fast = sysctl.fast_swap()
    data = {"value": v, "fast_swap": fast}
    if fast and v < 100:
        return Check("swappiness", WARN, f"vm.swappiness = {v} with {fast}: the kernel drops page cache "
                     "before using the fast swap", tune_fix(swappiness=180), data)
    if not fast and v > sysctl.SWAPPINESS_DISK_MAX:
        return Check("swappiness", WARN, f"vm.swappiness = {v} without zram or zswap: swapping goes to disk",
                     "sparkguard install-zram, or " + tune_fix(swappiness=60), data)
    return Check("swappiness", PASS, f"vm.swappiness = {v}" + (f" with {fast}" if fast else ""), None, data)


def _zone_high_bytes() -> int | None:
    """Sum of the zones' high watermarks in bytes (/proc/zoneinfo), or None."""
    try:
        with open("/proc/zoneinfo") as f:
            pages = sum(int(m.group(1)) for m in re.finditer(r"^\s+high\s+(\d+)\s*$", f.read(), re.M))
    except OSError:
        return None
    return pages * os.sysconf("SC_PAGE_SIZE")


def check_watermark(ctx: Context) -> Check:
    """vm.watermark_scale_factor: 100 is the tuning, above 200 a trap (500: ~12 GiB walled on a Spark)."""
    v = sysctl.read("vm.watermark_scale_factor")
    if v is None:
        return Check("watermark_scale_factor", WARN, "cannot read /proc/sys/vm/watermark_scale_factor")
    high = _zone_high_bytes()
    data = {"value": v, "high_watermarks_bytes": high}
    walled = f"; the high watermarks hold {format_size(high)} out of MemAvailable" if high is not None else ""
    if v > sysctl.WATERMARK_MAX:
        return Check("watermark_scale_factor", FAIL,
                     f"vm.watermark_scale_factor = {v}{walled}: above {sysctl.WATERMARK_MAX} this walls memory "
                     "off and looks exactly like a leak (at 500 ~12 GiB on a Spark); the guard fires early",
                     tune_fix(watermark_scale_factor=100), data)
    if v < 100:
        return Check("watermark_scale_factor", WARN, f"vm.watermark_scale_factor = {v}{walled}: kswapd wakes late "
                     "and allocations stall in direct reclaim", tune_fix(watermark_scale_factor=100), data)
    return Check("watermark_scale_factor", PASS, f"vm.watermark_scale_factor = {v}{walled}", None, data)


def check_page_cluster(ctx: Context) -> Check:
    """vm.page-cluster: 0 with zram (no swap read-ahead)."""
    v = sysctl.read("vm.page-cluster")
    fast = sysctl.fast_swap()
    if v is None:
        return Check("page_cluster", WARN, "cannot read /proc/sys/vm/page-cluster")
    if fast and v != 0:
        return Check("page_cluster", WARN, f"vm.page-cluster = {v} with zram: swap-in reads {2 ** v} pages "
                     "at a time, useless on zram", tune_fix(page_cluster=0), {"value": v})
    return Check("page_cluster", PASS, f"vm.page-cluster = {v}", None, {"value": v})


def check_min_free(ctx: Context) -> Check:
    """vm.min_free_kbytes: reported; more than 2 % of memory walls MemAvailable like the watermark trap."""
    v = sysctl.read("vm.min_free_kbytes")
    if v is None:
        return Check("min_free_kbytes", WARN, "cannot read /proc/sys/vm/min_free_kbytes")
    total = meminfo.read().get("MemTotal", 0)
    data = {"value_kb": v, "mem_total_bytes": total}
    if total and v * 1024 > 0.02 * total:
        return Check("min_free_kbytes", WARN, f"vm.min_free_kbytes = {v} ({format_size(v * 1024)}, "
                     f"{100 * v * 1024 / total:.1f} % of memory): reserved memory never shows in MemAvailable",
                     "lower vm.min_free_kbytes (the kernel default suits a Spark)", data)
    return Check("min_free_kbytes", PASS, f"vm.min_free_kbytes = {v} ({format_size(v * 1024)})", None, data)


def _guard_pids(ctx: Context) -> list[int]:
    """Pids of the running guards: ``sparkguard run`` processes, not counting one whose parent
    is a guard too (a fork of the same guard)."""
    guards = {pid: ppid for pid, ppid, argv in ctx.processes() if pid != os.getpid() and procview.is_guard(argv)}
    return sorted(pid for pid, ppid in guards.items() if ppid not in guards)


def _guard_config(ctx: Context, pid: int) -> str:
    """The ``--config`` a guard was started with (``default`` when none)."""
    argv = next((a for p, _, a in ctx.processes() if p == pid), [])
    for i, a in enumerate(argv):
        if a == "--config" and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith("--config="):
            return a.split("=", 1)[1]
    return "default"


def _several_guards(ctx: Context, pids: list[int]) -> str:
    """The sentence doctor says when more than one guard runs."""
    each = ", ".join(f"pid {pid} (--config {_guard_config(ctx, pid)})" for pid in pids)
    return (f"{len(pids)} guards are running: {each}. Each acts on its own: they signal the same engine, "
            "record every incident twice and, supervising, start a second engine")


def check_memlock(ctx: Context) -> Check:
    """Can the guard mlockall()?  Running guard's VmLck, else the unit's LimitMEMLOCK, else ours."""
    import resource

    locked: dict[int, int] = {}
    for pid in _guard_pids(ctx):
        try:
            locked[pid] = int(procview.status(pid).get("VmLck", "0 kB").split()[0]) * 1024
        except OSError:
            continue
    if locked:
        bad = [pid for pid, n in locked.items() if not n]
        desc = ", ".join(f"pid {pid}: {format_size(n)}" for pid, n in locked.items())
        if bad:
            who = (f"guard pid {bad[0]} has" if len(bad) == 1 else f"guard pids {', '.join(map(str, bad))} have")
            return Check("memlock", WARN, f"{who} no memory locked ({len(locked)} guard(s) running; {desc}): "
                         "under heavy swap it can be paged out and react seconds late",
                         "run the guard as root or with LimitMEMLOCK=infinity (the unit does)", {"locked_bytes": locked})
        return Check("memlock", PASS, f"running guard memory locked (mlockall; {desc})", None, {"locked_bytes": locked})
    from sparkguard.host.files import read_text

    unit = read_text(UNIT_FILE)
    if unit is not None:
        if re.search(r"^LimitMEMLOCK=infinity\s*$", unit, re.M):
            return Check("memlock", PASS, f"{UNIT_FILE} sets LimitMEMLOCK=infinity", None, {"unit": UNIT_FILE})
        return Check("memlock", WARN, f"{UNIT_FILE} does not set LimitMEMLOCK=infinity",
                     "sparkguard install (or add LimitMEMLOCK=infinity in a drop-in)", {"unit": UNIT_FILE})
    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    try:
        cap = procview.creds("self").has_cap(CAP_IPC_LOCK)
    except (OSError, KeyError, ValueError):
        cap = False
    data = {"rlimit_memlock": None if soft == resource.RLIM_INFINITY else soft, "cap_ipc_lock": cap}
    if soft == resource.RLIM_INFINITY or cap:
        why = "unlimited RLIMIT_MEMLOCK" if soft == resource.RLIM_INFINITY else "CAP_IPC_LOCK"
        return Check("memlock", PASS, f"mlockall possible from here ({why}); no guard running or installed", None, data)
    return Check("memlock", WARN, f"RLIMIT_MEMLOCK is {format_size(soft)} and no CAP_IPC_LOCK: mlockall would fail",
                 "run the guard from the unit (LimitMEMLOCK=infinity)", data)


def check_psi(ctx: Context) -> Check:
    """/proc/pressure/memory readable (kernel >= 4.20 with PSI on)."""
    from sparkguard.sysinfo import read_psi_memory

    psi = read_psi_memory()
    if psi is None:
        return Check("psi", WARN, "/proc/pressure/memory is missing: no memory-pressure wake-ups or metrics",
                     "boot with psi=1 (kernel >= 4.20, CONFIG_PSI)")
    some = psi.get("some", {}).get("avg10")
    return Check("psi", PASS, f"PSI available (memory some avg10 = {some} %)", None, {"psi_memory": psi})


def check_hidepid(ctx: Context) -> Check:
    """What the running guard sees of /proc: each guard's own /proc mount (its mount namespace)
    and its own credentials decide (procview.hides_others); with no guard running, doctor's /proc
    and the unit's credentials (root with CAP_SYS_PTRACE).  hidepid hides other users' engines
    from a guard without CAP_SYS_PTRACE; subset=pid hides /proc/meminfo."""
    pids = _guard_pids(ctx)
    if pids:
        return _guard_view(pids)
    opts = None
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                p = line.split()
                if len(p) >= 4 and p[1] == "/proc" and p[2] == "proc":
                    opts = p[3]
    except OSError:
        return Check("hidepid", WARN, "cannot read /proc/self/mounts")
    data = {"options": opts, "guards": []}
    o = dict(kv.partition("=")[::2] for kv in (opts or "").split(","))
    if o.get("subset") == "pid":
        return Check("hidepid", FAIL, f"/proc is mounted subset=pid ({opts}): /proc/meminfo is hidden",
                     "mount /proc without subset=pid", data)
    hp = o.get("hidepid")
    if hp and hp not in ("0", "off"):
        return Check("hidepid", PASS, f"no guard running; /proc here is mounted hidepid={hp}: the unit runs the "
                     "guard as root with CAP_SYS_PTRACE, which sees every process; a restricted user would see none",
                     None, data)
    return Check("hidepid", PASS, "no guard running; /proc here shows every process (no hidepid)", None, data)


def _guard_view(pids: list[int]) -> Check:
    """The hidepid verdict from each running guard's own /proc options and credentials."""
    worst, lines, data = PASS, [], []
    for pid in pids:
        try:
            opts, who = procview.proc_options(pid), procview.creds(pid)
        except (OSError, ValueError, KeyError) as e:
            worst = _worse(worst, WARN)
            lines.append(f"guard pid {pid}: cannot read its /proc view ({getattr(e, 'strerror', None) or e}; "
                         "run doctor as root)")
            continue
        shown = ",".join(f"{k}={v}" if v else k for k, v in opts.items() if k in ("hidepid", "gid", "subset"))
        data.append({"pid": pid, "proc_options": opts, "uid": who.uid,
                     "cap_sys_ptrace": who.has_cap(procview.CAP_SYS_PTRACE)})
        if opts.get("subset") == "pid":
            worst = FAIL
            lines.append(f"guard pid {pid}: its /proc is mounted subset=pid: /proc/meminfo is hidden from it")
        elif why := procview.hides_others(opts, who):
            worst = FAIL
            lines.append(f"guard pid {pid}: {why}; an engine run as another user is never found")
        else:
            lines.append(f"guard pid {pid} sees every process (uid {who.uid}"
                         + (", CAP_SYS_PTRACE" if who.has_cap(procview.CAP_SYS_PTRACE) else "")
                         + (f"; its /proc: {shown}" if shown else "; its /proc: no hidepid") + ")")
    fix = None if worst == PASS else ("run the guard as root with CAP_SYS_PTRACE (the unit does), or add its "
                                      "group to /proc's gid= option; mount /proc without subset=pid")
    return Check("hidepid", worst, "; ".join(lines), fix, {"guards": data})


def check_unit(ctx: Context) -> Check:
    """The guard runs, once: unit enabled and active under systemd, else a guard process; WARN
    when more than one guard runs (every one is named)."""
    pids = _guard_pids(ctx)
    c = _check_unit(ctx, pids)
    c.data["pids"] = pids
    if len(pids) > 1 and c.status in (PASS, WARN):
        fix = ("stop all but one" if c.data.get("systemd") is False else
               "stop every guard the unit did not start (systemctl show -p MainPID sparkguard names its own)")
        c = Check("unit", WARN, f"{_several_guards(ctx, pids)}. {c.message}", fix, c.data)
    return c


def _check_unit(ctx: Context, pids: list[int]) -> Check:
    from sparkguard.host.systemctl import query, systemd_running

    if systemd_running():
        enabled = query("is-enabled", UNIT) or "unknown"
        active = query("is-active", UNIT) or "unknown"
        data = {"enabled": enabled, "active": active}
        if enabled in ("not-found", "") or (enabled == "unknown" and not os.path.exists(UNIT_FILE)):
            return Check("unit", FAIL, f"{UNIT} is not installed", "sparkguard install && systemctl enable --now sparkguard", data)
        if active != "active":
            return Check("unit", FAIL, f"{UNIT} is {active} ({enabled}): nothing guards this box",
                         "systemctl enable --now sparkguard; journalctl -u sparkguard", data)
        if enabled != "enabled":
            return Check("unit", WARN, f"{UNIT} is active but {enabled}: it will not start at boot",
                         "systemctl enable sparkguard", data)
        return Check("unit", PASS, f"{UNIT} enabled and active", None, data)
    data = {"systemd": False, "pids": pids, "unit_installed": os.path.exists(UNIT_FILE)}
    if pids:
        return Check("unit", WARN, f"systemd does not run this machine; guard running as pid "
                     f"{', '.join(map(str, pids))} without watchdog restarts",
                     "run it under systemd (sparkguard install; systemctl enable --now sparkguard)", data)
    return Check("unit", FAIL, "systemd does not run this machine and no `sparkguard run` process is running: "
                 "nothing guards this box", "start `sparkguard run` under a supervisor that restarts it", data)


_ORDER = {INFO: 0, PASS: 0, WARN: 1, FAIL: 2}


def _worse(a: str, b: str) -> str:
    """The worse of two verdicts (FAIL > WARN > PASS)."""
    return a if _ORDER[a] >= _ORDER[b] else b


#: the highest oom_score_adj a guard should run at: harden_self writes -1000 and falls back to
#: -900 (sparkguard/daemon.py); the unit sets OOMScoreAdjust=-1000
GUARD_OOM_ADJ_MAX = -900
#: the highest nice a guard should run at: harden_self lowers it to -10 (daemon.NICE), the unit to -20
GUARD_NICE_MAX = -10


def check_guard_priority(ctx: Context) -> Check:
    """Each running guard's standing, read from its /proc/PID: oom_score_adj at most -900 (else
    the kernel OOM killer may choose the guard, FAIL), nice at most -10 (else busy fillers starve
    its poll loop, WARN), and a policy that is not SCHED_IDLE (FAIL) or SCHED_BATCH (WARN)."""
    pids = _guard_pids(ctx)
    if not pids:
        return Check("guard_priority", INFO, "no guard running: its OOM score and CPU priority are checked "
                     "while one runs", None, {"guards": []})
    worst, lines, data = PASS, [], []
    for pid in pids:
        try:
            adj, ni, pol = procview.oom_score_adj(pid), procview.nice(pid), procview.policy(pid)
        except (OSError, ValueError, IndexError) as e:
            worst = _worse(worst, WARN)
            lines.append(f"guard pid {pid}: cannot read its priority ({getattr(e, 'strerror', None) or e})")
            continue
        data.append({"pid": pid, "oom_score_adj": adj, "nice": ni, "policy": pol})
        bad = []
        if adj > GUARD_OOM_ADJ_MAX:
            worst = FAIL
            bad.append(f"oom_score_adj {adj} (above {GUARD_OOM_ADJ_MAX}: the kernel OOM killer may kill the guard "
                       "instead of the engine)")
        if ni > GUARD_NICE_MAX:
            worst = _worse(worst, WARN)
            bad.append(f"nice {ni} (above {GUARD_NICE_MAX}: a memory spike of busy threads delays its poll loop)")
        if pol in ("SCHED_IDLE", "SCHED_BATCH"):
            worst = _worse(worst, FAIL if pol == "SCHED_IDLE" else WARN)
            bad.append(f"policy {pol} (runs only when the CPUs are idle)" if pol == "SCHED_IDLE"
                       else f"policy {pol} (woken late)")
        lines.append(f"guard pid {pid}: " + ("; ".join(bad) if bad else f"oom_score_adj {adj}, nice {ni}, {pol}"))
    fix = None if worst == PASS else ("start the guard as root with CAP_SYS_RESOURCE and CAP_SYS_NICE (the unit: "
                                      "OOMScoreAdjust=-1000, Nice=-20); its start-up warnings say what it could "
                                      "not set")
    return Check("guard_priority", worst, "; ".join(lines), fix, {"guards": data})


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
    from sparkguard.host.systemctl import query, systemd_running

    worst, lines, fixes = PASS, [], []
    data: dict = {"killers": [], "oomd": None, "ray": []}
    me = os.getpid()
    for pid, _ppid, argv in ctx.processes():
        prog = _program(argv)
        if pid != me and prog in KILLERS:
            worst = _worse(worst, WARN)
            data["killers"].append({"pid": pid, "program": prog, "cmdline": " ".join(argv)[:200]})
            lines.append(f"{prog} runs (pid {pid}): it {KILLERS[prog]}, beside the guard")
    if data["killers"]:
        fixes.append("stop " + ", ".join(sorted({k["program"] for k in data["killers"]})) +
                     " (systemctl disable --now NAME), or keep its lines below the guard's kill line")
    engines = _engines(ctx)
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
                    worst = _worse(worst, WARN)
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
            worst = _worse(worst, WARN)
            lines.append(f"Ray process pid {pid}: its environment was overwritten by its title; cannot tell whether "
                         "Ray's memory monitor is off")
        elif value != "0":
            worst = _worse(worst, WARN)
            lines.append(f"Ray process pid {pid} runs Ray's memory monitor (RAY_memory_monitor_refresh_ms "
                         f"{'unset' if value is None else '= ' + value}): Ray kills actors on its own line")
    if any(r["RAY_memory_monitor_refresh_ms"] != "0" for r in data["ray"]):
        fixes.append("start Ray (ray start, and the engine) with RAY_memory_monitor_refresh_ms=0")
    if worst == PASS:
        lines.insert(0, "no other memory killer runs (earlyoom, nohang, oomd, Ray's memory monitor)")
    return Check("other_killers", worst, "; ".join(lines), "; ".join(fixes) or None, data)


#: checks whose fix changes the kernel, and the path it writes (read-only in most containers)
HOST_ONLY = {"zram": "/sys/class/zram-control", "swappiness": "/proc/sys/vm", "watermark_scale_factor": "/proc/sys/vm",
             "page_cluster": "/proc/sys/vm", "min_free_kbytes": "/proc/sys/vm", "sysctl_boot": "/proc/sys/vm"}


def check_container(ctx: Context) -> Check:
    """Whether doctor runs in a container (virt.container) and whether /sys and /proc/sys are
    read-only here; when they are, the fixes of the zram and sysctl checks are the host's to apply."""
    box = virt.container()
    ro = sorted({m.point for p in set(HOST_ONLY.values()) if (m := virt.read_only_mount(p))})
    data = {"container": box, "read_only": ro}
    if not box and not ro:
        return Check("container", INFO, "not in a container", None, data)
    what = f"runs in a {box} container" if box else "runs on the host"
    if ro:
        return Check("container", INFO, f"{what}; {' and '.join(ro)} read-only here: zram and the vm sysctls are "
                     "the host kernel's, their fixes below are to run on the host", None, data)
    return Check("container", INFO, f"{what} with /sys and /proc/sys writable: zram and the vm sysctls set here "
                 "change the host's kernel", None, data)


def _host_fixes(checks: list[Check]) -> None:
    """Say "on the host" in the fixes that cannot be carried out here (HOST_ONLY, read-only)."""
    for c in checks:
        path = HOST_ONLY.get(c.name)
        if path and c.fix and c.status in (WARN, FAIL) and (m := virt.read_only_mount(path)):
            c.fix = f"on the host ({m.point} is read-only here): {c.fix}"


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


def _engines(ctx: Context) -> list[tuple[int, str]]:
    """Root processes of the engines ``targets.match`` selects: ``[(pid, cmdline)]``.

    The cmdline is argv joined with spaces, as the guard matches it (sparkguard/config.py).
    """
    pats = [re.compile(p) for p in ctx.config.targets.match]
    procs = [(pid, ppid, " ".join(argv)) for pid, ppid, argv in ctx.processes()]
    hit = {pid: cmd for pid, _, cmd in procs if pid != os.getpid() and any(p.search(cmd) for p in pats)}
    parent = {pid: ppid for pid, ppid, _ in procs}
    return sorted((pid, cmd) for pid, cmd in hit.items() if parent.get(pid) not in hit)


def check_engine_timeout(ctx: Context) -> Check:
    """Each running vLLM's worker shutdown timeout is set and shorter than the guard's grace."""
    grace = ctx.config.guard.grace
    engines = [(pid, cmd) for pid, cmd in _engines(ctx) if "vllm" in cmd.lower()]
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


def check_page_cache(ctx: Context) -> Check:
    """Would vLLM's start-up check (free >= MemTotal * gpu_memory_utilization) fail because of page cache?

    On an integrated GPU "free" is close to MemFree, and page cache left from reading the
    weights trips it; ``sync; echo 3 > /proc/sys/vm/drop_caches`` is the fix (vLLM
    ``worker/gpu_worker.py`` "Free memory on device ... less than desired").
    """
    mi = meminfo.read()
    total, free = mi.get("MemTotal", 0), mi.get("MemFree", 0)
    cache = mi.get("Cached", 0) + mi.get("Buffers", 0)
    need = int(total * ctx.gpu_memory_utilization)
    data = {"mem_total_bytes": total, "mem_free_bytes": free, "page_cache_bytes": cache,
            "needed_bytes": need, "gpu_memory_utilization": ctx.gpu_memory_utilization}
    running = [pid for pid, cmd in _engines(ctx)]
    if running:
        return Check("page_cache", INFO, f"an engine is running (pid {running[0]}); the start-up check applies "
                     "at its next start", None, data)
    util = ctx.gpu_memory_utilization
    if free >= need:
        return Check("page_cache", PASS, f"MemFree {format_size(free)} >= {util:g} x MemTotal: an engine start "
                     "passes vLLM's free-memory check", None, data)
    if free + cache >= need:
        return Check("page_cache", WARN, f"MemFree {format_size(free)} < {util:g} x MemTotal "
                     f"({format_size(need)}) with {format_size(cache)} page cache: vLLM's start-up check "
                     "'Free memory on device ... less than desired' would fail",
                     "sync; echo 3 > /proc/sys/vm/drop_caches   (before starting the engine)", data)
    return Check("page_cache", WARN, f"MemFree {format_size(free)} < {util:g} x MemTotal ({format_size(need)}) "
                 "even without page cache: other processes hold the memory an engine start needs",
                 "stop what uses the memory, or lower --gpu-memory-utilization", data)


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


def check_boot_sysctls(ctx: Context) -> Check:
    """The persisted sysctl file exists, the kernel runs with its values now (/proc/sys), and no
    later file undoes it at boot."""
    persisted = sysctl.read_persisted("/")
    if persisted is None:
        return Check("sysctl_boot", WARN, f"{sysctl.SYSCTL_FILE} is absent: the tuning is lost at reboot",
                     "sparkguard install (writes it with the defaults; `sparkguard tune` also applies them)")
    live = {k: sysctl.read(k) for k in persisted}
    differ = [(k, live[k], v) for k, v in persisted.items() if live[k] != v]
    ov = sysctl.overrides("/", persisted)
    data = {"persisted": persisted, "live": live, "differ": differ, "overrides": ov}
    problems, fixes = [], []
    if differ:
        problems.append("the kernel runs with other values than the file: " +
                        ", ".join(f"{k} live {lv} vs file {fv}" for k, lv, fv in differ))
        fixes.append("sparkguard tune --boot (applies the file now)")
    if ov:
        problems.append("; ".join(f"{f} sets {k} = {v}" for f, k, v in ov) + f", after {sysctl.SYSCTL_FILE}")
        fixes.append("remove those lines")
    if problems:
        return Check("sysctl_boot", WARN, f"{sysctl.SYSCTL_FILE}: " + "; ".join(problems), "; ".join(fixes), data)
    return Check("sysctl_boot", PASS, f"{sysctl.SYSCTL_FILE} persists, and the kernel runs with, " +
                 ", ".join(f"{k} = {v}" for k, v in persisted.items()), None, data)


def check_links(ctx: Context) -> Check:
    """The TP fabric links named in ``link.interfaces`` exist and are up (INFO when none are configured)."""
    names = list(ctx.config.link.interfaces)
    if not names:
        return Check("links", INFO, "no TP links watched (link.interfaces is empty)",
                     "list the ConnectX-7 ports under link.interfaces to have link drops reported")
    from sparkguard import linkwatch

    links = linkwatch.read_links(names)
    missing = [n for n, ln in links.items() if not ln.get("present")]
    down = [n for n, ln in links.items() if ln.get("present") and not ln.get("up")]
    if missing or down:
        what = "; ".join([f"{n} missing" for n in missing] + [f"{n} down" for n in down])
        return Check("links", FAIL, f"TP link trouble: {what}",
                     "check the cable/port (ip link show), fix link.interfaces names", {"links": links})
    return Check("links", PASS, "TP links up: " + ", ".join(names), None, {"links": links})


def check_metrics(ctx: Context) -> Check:
    """The guard's metrics endpoint (``metrics.listen``) answers as sparkguard, and if not, who
    holds its port (``sparkguard.status.read_daemon``, ``port_holder``)."""
    from sparkguard import status
    url = status.metrics_url(ctx.config.metrics.listen)
    if url is None:
        return Check("metrics", INFO, "metrics.listen is off: no Prometheus metrics", None)
    d = status.read_daemon(url)
    if d.get("running"):
        return Check("metrics", PASS, f"the guard serves metrics on {url}", None, {"url": url})
    h = d.get("holder") or {}
    data = {"url": url, "error": d.get("error"), "holder": h}
    fix = ("stop the process holding the port, or set metrics.listen to a free port and restart the guard "
           "(until then it guards without metrics and binds again every 1-60 s)")
    if h.get("listening") and h.get("is_guard") is not True:
        return Check("metrics", FAIL, f"{url}: the port is held by {h['text']}, not by the guard", fix, data)
    if h.get("guards"):
        return Check("metrics", FAIL, f"a guard runs (pid {', '.join(map(str, h['guards']))}) but {url} does not "
                     f"answer: {d.get('error')}", "see the guard's log and STATUS= (systemctl status sparkguard)",
                     data)
    return Check("metrics", WARN, f"no guard is running: nothing serves {url}", "start sparkguard", data)


CHECKS: list[Callable[[Context], Check]] = [
    check_zram, check_swappiness, check_watermark, check_page_cluster, check_min_free, check_boot_sysctls,
    check_memlock, check_psi, check_hidepid, check_unit, check_guard_priority, check_other_killers, check_container,
    check_engine_sandbox, check_engine_timeout,
    check_page_cache, check_nvidia,
    check_links,
    check_metrics,
]


def run_checks(ctx: Context) -> list[Check]:
    """Every check in :data:`CHECKS`; one that raises becomes a WARN naming the error."""
    out = []
    for fn in CHECKS:
        name = fn.__name__.removeprefix("check_")
        try:
            out.append(fn(ctx))
        except Exception as e:  # noqa: BLE001 - a broken check must not hide the others
            out.append(Check(name, WARN, f"check could not run: {type(e).__name__}: {e}"))
    _host_fixes(out)
    return out


def doctor(args) -> int:
    """Handler of ``sparkguard doctor``: prints the verdicts (or JSON); 1 on any FAIL."""
    import json

    from sparkguard import config
    from sparkguard.host.files import HostError

    try:
        cfg = config.load(args.config)
    except config.ConfigError as e:
        raise HostError(f"cannot check against the configuration: {e}") from None
    checks = run_checks(Context(cfg, args.gpu_memory_utilization))
    status = 1 if any(c.status == FAIL for c in checks) else 0
    counts = {s: sum(c.status == s for c in checks) for s in (PASS, WARN, FAIL, INFO)}
    if args.json:
        print(json.dumps({"checks": [asdict(c) for c in checks], "counts": counts, "config": cfg.path,
                          "exit_status": status}, indent=2, default=str))
        return status
    width = max(len(c.name) for c in checks)
    for c in checks:
        print(f"{c.status:<4}  {c.name:<{width}}  {c.message}")
        if c.fix and c.status != PASS:
            print(f"{'':<4}  {'':<{width}}  fix: {c.fix}")
    print(f"\n{counts[PASS]} pass, {counts[WARN]} warn, {counts[FAIL]} fail, {counts[INFO]} info")
    return status

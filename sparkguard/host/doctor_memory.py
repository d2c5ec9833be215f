"""doctor's checks of the host's memory set-up: zram, the vm sysctls now and at boot, PSI, the
page cache an engine start trips on, and whether this is a container (the host's kernel).
"""

from __future__ import annotations

import os
import re

from sparkguard import meminfo, sysinfo
from sparkguard.host import sysctl, virt
from sparkguard.config.startgate import VLLM_DEFAULT_UTILIZATION, vllm_utilization
from sparkguard.host.doctor_base import FAIL, INFO, PASS, WARN, Check, Context, engine_roots
from sparkguard.supervisor.memgate import vllm_argv
from sparkguard.units import format_size

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


def check_zram(ctx: Context) -> Check:
    """zram swap present, active, and used before any file/partition swap."""
    swaps = sysinfo.read_swaps()
    zr = [s for s in swaps if os.path.basename(s["filename"]).startswith("zram")]
    other = [s for s in swaps if s not in zr]
    data = {"zram": zr, "other_swap": other}
    if not zr:
        if not os.path.isdir("/sys/class/zram-control") and not os.path.isdir("/sys/block/zram0"):
            return Check("zram", WARN, "no zram swap, and the zram module is not loaded",
                         "sparkguard install-zram (it loads the module, as the set-up unit does at boot)", data)
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


def check_psi(ctx: Context) -> Check:
    """/proc/pressure/memory readable (kernel >= 4.20 with PSI on)."""
    psi = sysinfo.read_psi_memory()
    if psi is None:
        return Check("psi", WARN, "/proc/pressure/memory is missing: no memory-pressure wake-ups or metrics",
                     "boot with psi=1 (kernel >= 4.20, CONFIG_PSI)")
    some = psi.get("some", {}).get("avg10")
    return Check("psi", PASS, f"PSI available (memory some avg10 = {some} %)", None, {"psi_memory": psi})


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


def utilization(ctx: Context) -> tuple[float, str]:
    """The ``gpu_memory_utilization`` (a fraction in (0, 1]) the page-cache check assumes, and
    where it came from (str, shown in the check).

    In order: ``sparkguard doctor --gpu-memory-utilization F``; ``engine.start_gate.utilization``
    when set (the operator's figure for the start gate, docs/start-gate.md); the last
    ``--gpu-memory-utilization`` of the configured engine's command and its ``engine.lane``'s args
    when it starts vLLM (``vllm serve``, ``python -m vllm...`` or a wrapper such as ``docker run
    ... vllm serve``: :func:`sparkguard.supervisor.memgate.vllm_argv`,
    :func:`sparkguard.config.startgate.vllm_utilization`); else vLLM's default, 0.92 (source:
    vllm/config/cache.py ``CacheConfig.gpu_memory_utilization: float = Field(default=0.92, gt=0,
    le=1)``, vllm-project/vllm at 002f10e0cfa1373a19a0d2756598a34b700d20e5, read 2026-12-02;
    ``EngineArgs`` in vllm/engine/arg_utils.py takes its default from there).
    """
    if ctx.gpu_memory_utilization is not None:
        return ctx.gpu_memory_utilization, f"sparkguard doctor --gpu-memory-utilization {ctx.gpu_memory_utilization:g}"
    e = getattr(ctx.config, "engine", None)
    if e is None or not e.enabled:
        return VLLM_DEFAULT_UTILIZATION, (f"vLLM's default --gpu-memory-utilization {VLLM_DEFAULT_UTILIZATION:g}; "
                                          "no engine in the configuration")
    if e.start_gate.utilization is not None:
        return e.start_gate.utilization, f"engine.start_gate.utilization {e.start_gate.utilization:g}"
    lane = e.lanes.get(e.lane) if e.lane else None
    argv = vllm_argv(list(e.command or ()) + (list(lane.args) if lane is not None else []))
    if argv is None:
        return VLLM_DEFAULT_UTILIZATION, (f"vLLM's default --gpu-memory-utilization {VLLM_DEFAULT_UTILIZATION:g}; "
                                          "engine.command does not start vLLM")
    util, source = vllm_utilization(argv)
    if util is None:        # a value vLLM refuses: it would not start at all; judge with its default
        return VLLM_DEFAULT_UTILIZATION, f"vLLM's default {VLLM_DEFAULT_UTILIZATION:g} ({source} in engine.command)"
    return util, source + (" (engine.command)" if source.startswith("--") else "")


def check_page_cache(ctx: Context) -> Check:
    """Would vLLM's start-up check (free >= MemTotal * gpu_memory_utilization) fail because of page cache?

    On an integrated GPU "free" is close to MemFree, and page cache left from reading the
    weights trips it; ``sync; echo 3 > /proc/sys/vm/drop_caches`` is the fix (vLLM
    ``worker/gpu_worker.py`` "Free memory on device ... less than desired").  The fraction is
    :func:`utilization`'s.
    """
    mi = meminfo.read()
    total, free = mi.get("MemTotal", 0), mi.get("MemFree", 0)
    cache = mi.get("Cached", 0) + mi.get("Buffers", 0)
    util, source = utilization(ctx)
    need = int(total * util)
    data = {"mem_total_bytes": total, "mem_free_bytes": free, "page_cache_bytes": cache,
            "needed_bytes": need, "gpu_memory_utilization": util, "gpu_memory_utilization_source": source}
    running = [pid for pid, cmd in engine_roots(ctx)]
    if running:
        return Check("page_cache", INFO, f"an engine is running (pid {running[0]}); the start-up check applies "
                     "at its next start", None, data)
    if free >= need:
        return Check("page_cache", PASS, f"MemFree {format_size(free)} >= {util:g} x MemTotal ({source}): an "
                     "engine start passes vLLM's free-memory check", None, data)
    if free + cache >= need:
        return Check("page_cache", WARN, f"MemFree {format_size(free)} < {util:g} x MemTotal "
                     f"({format_size(need)}; {source}) with {format_size(cache)} page cache: vLLM's start-up check "
                     "'Free memory on device ... less than desired' would fail",
                     "sync; echo 3 > /proc/sys/vm/drop_caches   (before starting the engine)", data)
    return Check("page_cache", WARN, f"MemFree {format_size(free)} < {util:g} x MemTotal ({format_size(need)}; {source}) "
                 "even without page cache: other processes hold the memory an engine start needs",
                 "stop what uses the memory, or lower --gpu-memory-utilization", data)


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


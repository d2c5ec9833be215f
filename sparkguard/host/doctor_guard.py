"""doctor's checks of the running guard: it runs once, under its unit, with memory locked, a
priority that keeps it first, a view of every process, its metrics endpoint and its TP links.
"""

from __future__ import annotations

import os
import re
import resource

from sparkguard import linkcompat, linkwatch, status_daemon, status_url
from sparkguard.host import procview
from sparkguard.host.doctor_base import FAIL, INFO, PASS, UNIT, UNIT_FILE, WARN, Check, Context, guard_pids, worse
from sparkguard.host.files import read_text
from sparkguard.host.systemctl import query, systemd_running
from sparkguard.units import format_size

CAP_IPC_LOCK = 14  # linux/capability.h


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
    locked: dict[int, int] = {}
    for pid in guard_pids(ctx):
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


def check_hidepid(ctx: Context) -> Check:
    """What the running guard sees of /proc: each guard's own /proc mount (its mount namespace)
    and its own credentials decide (procview.hides_others); with no guard running, doctor's /proc
    and the unit's credentials (root with CAP_SYS_PTRACE).  hidepid hides other users' engines
    from a guard without CAP_SYS_PTRACE; subset=pid hides /proc/meminfo."""
    pids = guard_pids(ctx)
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
            worst = worse(worst, WARN)
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
    pids = guard_pids(ctx)
    c = _check_unit(ctx, pids)
    c.data["pids"] = pids
    if len(pids) > 1 and c.status in (PASS, WARN):
        fix = ("stop all but one" if c.data.get("systemd") is False else
               "stop every guard the unit did not start (systemctl show -p MainPID sparkguard names its own)")
        c = Check("unit", WARN, f"{_several_guards(ctx, pids)}. {c.message}", fix, c.data)
    return c


def _check_unit(ctx: Context, pids: list[int]) -> Check:
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


#: the highest oom_score_adj a guard should run at: harden_self writes -1000 and falls back to
#: -900 (sparkguard/guard/harden.py); the unit sets OOMScoreAdjust=-1000
GUARD_OOM_ADJ_MAX = -900


#: the highest nice a guard should run at: harden_self lowers it to guard.harden.NICE (-20), as the unit's Nice=-20 does
GUARD_NICE_MAX = -10


def check_guard_priority(ctx: Context) -> Check:
    """Each running guard's standing, read from its /proc/PID: oom_score_adj at most -900 (else
    the kernel OOM killer may choose the guard, FAIL), nice at most -10 (else busy fillers starve
    its poll loop, WARN), and a policy that is not SCHED_IDLE (FAIL) or SCHED_BATCH (WARN)."""
    pids = guard_pids(ctx)
    if not pids:
        return Check("guard_priority", INFO, "no guard running: its OOM score and CPU priority are checked "
                     "while one runs", None, {"guards": []})
    worst, lines, data = PASS, [], []
    for pid in pids:
        try:
            adj, ni, pol = procview.oom_score_adj(pid), procview.nice(pid), procview.policy(pid)
        except (OSError, ValueError, IndexError) as e:
            worst = worse(worst, WARN)
            lines.append(f"guard pid {pid}: cannot read its priority ({getattr(e, 'strerror', None) or e})")
            continue
        data.append({"pid": pid, "oom_score_adj": adj, "nice": ni, "policy": pol})
        bad = []
        if adj > GUARD_OOM_ADJ_MAX:
            worst = FAIL
            bad.append(f"oom_score_adj {adj} (above {GUARD_OOM_ADJ_MAX}: the kernel OOM killer may kill the guard "
                       "instead of the engine)")
        if ni > GUARD_NICE_MAX:
            worst = worse(worst, WARN)
            bad.append(f"nice {ni} (above {GUARD_NICE_MAX}: a memory spike of busy threads delays its poll loop)")
        if pol in ("SCHED_IDLE", "SCHED_BATCH"):
            worst = worse(worst, FAIL if pol == "SCHED_IDLE" else WARN)
            bad.append(f"policy {pol} (runs only when the CPUs are idle)" if pol == "SCHED_IDLE"
                       else f"policy {pol} (woken late)")
        lines.append(f"guard pid {pid}: " + ("; ".join(bad) if bad else f"oom_score_adj {adj}, nice {ni}, {pol}"))
    fix = None if worst == PASS else ("start the guard as root with CAP_SYS_RESOURCE and CAP_SYS_NICE (the unit: "
                                      "OOMScoreAdjust=-1000, Nice=-20); its start-up warnings say what it could "
                                      "not set")
    return Check("guard_priority", worst, "; ".join(lines), fix, {"guards": data})


def check_links(ctx: Context) -> Check:
    """The TP fabric links named in ``link.interfaces`` exist and are up (INFO when none are configured)."""
    names = list(ctx.config.link.interfaces)
    if not names:
        return Check("links", INFO, "no TP links watched (link.interfaces is empty)",
                     "list the ConnectX-7 ports under link.interfaces to have link drops reported")
    unavailable = linkcompat.unavailable_reason()
    try:   # without the watch (pyroute2 0.7) the links are still read once, through its IPRoute
        links = linkwatch.read_links(names)
    except ImportError:   # no pyroute2 at all: `unavailable` says so
        return Check("links", WARN, f"link watch unavailable: {unavailable}; {', '.join(names)} not watched "
                     "nor checked", linkcompat.FIX, {"link_watch_unavailable": unavailable})
    missing = [n for n, ln in links.items() if not ln.get("present")]
    down = [n for n, ln in links.items() if ln.get("present") and not ln.get("up")]
    data = {"links": links, **({"link_watch_unavailable": unavailable} if unavailable else {})}
    unwatched = f"; link watch unavailable: {unavailable}" if unavailable else ""
    if missing or down:
        what = "; ".join([f"{n} missing" for n in missing] + [f"{n} down" for n in down])
        return Check("links", FAIL, f"TP link trouble: {what}{unwatched}",
                     "check the cable/port (ip link show), fix link.interfaces names", data)
    if unavailable:
        return Check("links", WARN, f"link watch unavailable: {unavailable}; {', '.join(names)} up now but "
                     "not watched", linkcompat.FIX, data)
    return Check("links", PASS, "TP links up: " + ", ".join(names), None, data)


def check_metrics(ctx: Context) -> Check:
    """The guard's metrics endpoint (``metrics.listen``) answers as sparkguard, and if not, who
    holds its port (``sparkguard.status_daemon.read_daemon``, ``port_holder``)."""
    url = status_url.metrics_url(ctx.config.metrics.listen)
    if url is None:
        return Check("metrics", INFO, "metrics.listen is off: no Prometheus metrics", None)
    d = status_daemon.read_daemon(url)
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


"""``sparkguard status``: one screen a person reads.

Memory and headroom above the lines, the thresholds, which processes would be signalled,
swap and zram, memory pressure (PSI), the running daemon's state as read from its
metrics endpoint (``metrics.listen`` of the configuration, or ``--url``), and its supervised
engine as read from its control socket (``engine.control_socket``, or ``--socket``).  Everything but
the daemon's state is read here and now from /proc and /sys, so the command is useful
also when the daemon is not running.

``--url`` naming another host's endpoint (:func:`is_local_url` false) shows only what that
endpoint reports (its memory, lines, state, engine): this host's /proc, targets, swap and control
socket say nothing about that node (issue 14), and the local configuration is not read.
"""

from __future__ import annotations

import argparse
import json
import math
import ipaddress
import os
import socket as socketlib
import sys
import time
import urllib.error
import urllib.request
from urllib.parse import urlsplit

from prometheus_client.parser import text_string_to_metric_families

from sparkguard import config, control, gpumem, linkcompat, linkwatch, meminfo, portowner, proctree, sysinfo, untrusted
from sparkguard import softview
from sparkguard.incidents.store import IncidentStore
from sparkguard.host import procview
from sparkguard.supervisor.render import describe
from sparkguard.units import format_duration as fd
from sparkguard.units import format_size as fs


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``sparkguard status [--config PATH] [--url URL] [--json]``."""
    p = subparsers.add_parser(
        "status", help="memory, headroom, targets, swap/zram, PSI and the daemon's state",
        description="Show memory and headroom above the guard's lines, the thresholds, matched "
                    "targets, swap and zram, memory pressure, and the running daemon's state "
                    "(scraped from its metrics endpoint).")
    p.add_argument("--config", metavar="PATH", default=None,
                   help="configuration file (default /etc/sparkguard/sparkguard.yaml; embedded "
                        "defaults when absent)")
    p.add_argument("--url", metavar="URL", default=None,
                   help="the daemon's metrics URL (default: http://<metrics.listen>/metrics); another "
                        "host's URL shows only what that endpoint reports")
    p.add_argument("--socket", metavar="PATH", default=None,
                   help="the daemon's engine control socket (default: $SPARKGUARD_CONTROL_SOCKET, else "
                        "engine.control_socket of the configuration)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead")
    p.set_defaults(func=handler)


def metrics_url(listen: tuple[str, int] | None) -> str | None:
    """``http://host:port/metrics`` for a ``metrics.listen`` value; None when metrics are off.

    A wildcard bind (0.0.0.0, ::) is reached on loopback.
    """
    if listen is None:
        return None
    host, port = listen
    host = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
    return f"http://[{host}]:{port}/metrics" if ":" in host else f"http://{host}:{port}/metrics"



def is_local_url(url: str) -> bool:
    """Whether ``url``'s host is this host: a loopback address, ``localhost``, this host's name,
    or an address one of its interfaces holds (in this network namespace).

    An address is this host's when a socket can be bound to it (``bind(2)`` fails with
    EADDRNOTAVAIL for an address no interface has); a name is resolved first (getaddrinfo).
    A URL that does not parse, or a name that does not resolve, is not local.  Never raises.
    """
    try:
        host = urlsplit(url).hostname
    except ValueError:
        return False
    if not host:
        return False
    if host == "localhost" or host in (socketlib.gethostname(), socketlib.gethostname().split(".", 1)[0]):
        return True
    try:
        addrs = [ipaddress.ip_address(host)]
    except ValueError:
        try:
            addrs = [ipaddress.ip_address(ai[4][0].split("%", 1)[0])
                     for ai in socketlib.getaddrinfo(host, None, proto=socketlib.IPPROTO_TCP)]
        except (OSError, ValueError, UnicodeError):
            return False
    for a in addrs:
        if a.is_loopback or a.is_unspecified:
            return True
        fam = socketlib.AF_INET6 if a.version == 6 else socketlib.AF_INET
        try:
            with socketlib.socket(fam, socketlib.SOCK_STREAM) as sk:
                sk.bind((str(a), 0))
            return True
        except OSError:
            continue
    return False

#: bytes of the daemon's answer read at most (its exposition is about 10 KiB)
MAX_SCRAPE = 4 << 20


def is_loopback_url(url: str) -> bool:
    """Whether ``url``'s host is a loopback address or ``localhost``: such a URL may reach this
    host's endpoint or, through a tunnel (``ssh -L 8799:node:8799``), another host's.  Never raises."""
    try:
        host = urlsplit(url).hostname
    except ValueError:
        return False
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host or "").is_loopback
    except ValueError:
        return False


def same_host(d: dict) -> bool:
    """Whether the endpoint that answered with the :func:`read_daemon` dict ``d`` runs on this
    host: its ``sparkguard_build_info{hostname}`` is this host's name (``socket.gethostname()``).
    An endpoint that does not answer is taken as this host's (nothing to mistake for it); one
    that answers without a hostname (an older sparkguard, or not sparkguard) is not."""
    if not d.get("running"):
        return True
    return d.get("hostname") is not None and d["hostname"] == socketlib.gethostname()


def port_holder(url: str) -> dict | None:
    """Who listens on the port of ``url`` when the guard's endpoint does not answer as itself.

    Returns None when nothing listens there, else ``{"pid": int | None, "comm": str, "uid": int,
    "text": str, "is_guard": bool | None, "guards": [pid, ...]}``: ``is_guard`` whether that
    process is a ``sparkguard run`` (None when the process was not found), ``guards`` the
    guards running on this host.  Never raises.  Sources: :mod:`sparkguard.portowner`,
    :func:`sparkguard.host.procview.is_guard`.
    """
    try:
        port = urlsplit(url).port
    except ValueError:
        return None
    h = portowner.find_holder(port) if port else None
    guards = []
    try:
        pids = proctree.pids()
    except OSError:
        pids = []
    for pid in pids:
        try:
            if procview.is_guard(procview.argv(pid)):
                guards.append(pid)
        except OSError:
            continue
    if h is None:
        return {"pid": None, "comm": "", "uid": None, "text": "", "is_guard": None, "guards": guards,
                "listening": False}
    return {"pid": h.pid, "comm": h.comm, "uid": h.uid, "text": h.describe(), "listening": True,
            "is_guard": None if h.pid is None else h.pid in guards, "guards": guards}


def read_daemon(url: str, timeout: float = 3.0, local: bool = True) -> dict:
    """Scrape the daemon's metrics endpoint and return its state as a dict.

    ``local``: the endpoint is this host's (:func:`is_local_url`); only then does a failure look
    up who holds the port here (``holder``).

    Returns:
        ``{"url", "running": False, "error": str, "detail": str}`` when nothing (or something else) answers;
        otherwise ``{"url", "running": True, "state", "dry_run", "version", "available_bytes",
        "signal_bytes", "term_below_bytes", "kill_below_bytes", "signals": {sig: n},
        "incidents": {kind: n}, "last_incident_timestamp", "last_poll_timestamp",
        "start_time", "polls", "poll_seconds_sum", "rss_bytes", "config_reloads": {result: n},
        "pause": the soft line, dict or None (sparkguard.softview.from_metrics)}``
        (absent metrics give None).  Never raises.
    Source: the metric names of sparkguard.metrics (README "Metrics").
    """
    out: dict = {"url": url, "running": False}
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            text = r.read(MAX_SCRAPE).decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        out["error"] = f"{url} answered HTTP {e.code} {e.reason}: not a sparkguard metrics endpoint"
        out["holder"] = port_holder(url) if local else None
        return out
    except (urllib.error.URLError, OSError, ValueError) as e:
        out["error"] = f"no answer at {url}"
        reason = getattr(e, "reason", e)
        out["detail"] = getattr(reason, "strerror", None) or str(reason)
        out["holder"] = port_holder(url) if local else None
        return out
    try:
        fams = list(text_string_to_metric_families(text))
    except Exception as e:  # not Prometheus text at all
        out["error"] = f"{url} answered, but not with Prometheus metrics ({e})"
        out["holder"] = port_holder(url) if local else None
        return out
    one: dict[str, float] = {}
    by: dict[str, dict[str, float]] = {}
    version = hostname = None
    tracking_labels: dict[str, str] = {}
    for fam in fams:
        for s in fam.samples:
            if s.name == "sparkguard_build_info":
                version, hostname = s.labels.get("version"), s.labels.get("hostname")
            elif s.labels:
                key = next(iter(s.labels.values()))
                by.setdefault(s.name, {})[key] = s.value
                if s.name == "sparkguard_engine_tracking_info":
                    tracking_labels = dict(s.labels)
            else:
                one[s.name] = s.value
    if version is None and not any(k.startswith("sparkguard_") for k in list(one) + list(by)):
        out["error"] = f"{url} answered, but it is not sparkguard (no sparkguard_ metrics)"
        out["holder"] = port_holder(url) if local else None
        return out

    def num(name: str, cast=float):
        # another host's endpoint may serve NaN, inf or 1e300: no number to show, not a crash
        v = one.get(name)
        if v is None or not math.isfinite(v) or (cast is int and abs(v) >= 2.0 ** 63):
            return None
        return cast(v)

    def count(v: float) -> int | str:
        return int(v) if math.isfinite(v) and abs(v) < 2.0 ** 63 else "?"

    states = by.get("sparkguard_guard_state", {})
    dry = num("sparkguard_dry_run")
    out.update({
        "running": True,
        "version": version,
        "hostname": hostname,
        "state": next((k for k, v in states.items() if v == 1), None),
        "dry_run": None if dry is None else bool(dry),
        "available_bytes": num("sparkguard_memory_available_bytes", int),
        "signal_bytes": num("sparkguard_guard_signal_bytes", int),
        "term_below_bytes": num("sparkguard_term_below_bytes", int),
        "kill_below_bytes": num("sparkguard_kill_below_bytes", int),
        "grace_seconds": num("sparkguard_grace_seconds"),
        "signals": {k: count(v) for k, v in by.get("sparkguard_signals_total", {}).items()},
        "incidents": {k: count(v) for k, v in by.get("sparkguard_incidents_total", {}).items()},
        "config_reloads": {k: count(v) for k, v in by.get("sparkguard_config_reloads_total", {}).items()},
        "last_incident_timestamp": num("sparkguard_last_incident_timestamp_seconds"),
        "last_poll_timestamp": num("sparkguard_last_poll_timestamp_seconds"),
        "start_time": num("sparkguard_start_time_seconds"),
        # every read of /proc/meminfo; a daemon older than sparkguard_polls_total counted them here
        "polls": num("sparkguard_polls_total", int) if "sparkguard_polls_total" in one
        else num("sparkguard_poll_duration_seconds_count", int),
        "poll_seconds_sum": num("sparkguard_poll_duration_seconds_sum"),
        "rss_bytes": num("process_resident_memory_bytes", int),
        "total_bytes": num("sparkguard_memory_total_bytes", int),
        "swap_free_bytes": num("sparkguard_swap_free_bytes", int),
        "swap_total_bytes": num("sparkguard_swap_total_bytes", int),
        "engine": _engine_from_metrics(one, by, tracking_labels),
        "pause": softview.from_metrics(one, by),
    })
    return out


def _engine_from_metrics(one: dict[str, float], by: dict[str, dict[str, float]],
                         tracking: dict[str, str] | None = None) -> dict | None:
    """The engine as the endpoint's ``sparkguard_engine_*`` metrics show it (docs/metrics.md):
    ``{"state", "lane", "ready", "given_up", "run_start", "tracking"}`` (tracking: ``cgroup`` or
    ``process-group``, with ``" (its container's cgroup, from the runtime's State.Pid)"`` for a
    container engine (the metric's ``tracks`` label), None from a daemon without the metric);
    None without an engine."""
    states = by.get("sparkguard_engine_state", {})
    if not states and "sparkguard_engine_up" not in one:
        return None
    return {"state": next((k for k, v in states.items() if v == 1), None),
            "lane": next(iter(by.get("sparkguard_engine_lane_info", {})), None),
            "ready": one.get("sparkguard_engine_ready") == 1.0,
            "given_up": one.get("sparkguard_engine_given_up") == 1.0,
            "run_start": one.get("sparkguard_engine_run_start_timestamp_seconds"),
            "tracking": _tracking(by, tracking or {})}


def _tracking(by: dict[str, dict[str, float]], labels: dict[str, str]) -> str | None:
    """The tracking line of :func:`_engine_from_metrics` (its docstring)."""
    # the exposition sorts labels: the mode is read by name (a daemon without labels but mode: the key)
    mode = labels.get("mode") or next(iter(by.get("sparkguard_engine_tracking_info", {})), None)
    if mode is not None and labels.get("tracks") == "container":
        return f"{mode} (its container's cgroup, from the runtime's State.Pid)"
    return mode


def read_engine(cfg, socket: str | None = None, timeout: float = 3.0) -> dict:
    """Ask the running daemon for its supervised engine (``sparkguard.control``, issue 5).

    Args:
        cfg: ``config.Config`` (``engine.enabled``, ``engine.control_socket``).
        socket: the control socket; None: $SPARKGUARD_CONTROL_SOCKET, else ``engine.control_socket``.
        timeout: seconds for the answer.
    Returns:
        ``{"socket": str, "configured": bool, "running": bool, "status": dict | None,
        "error": str | None}``; ``status`` is ``Supervisor.status()`` (render it with
        ``sparkguard.supervisor.describe``), ``error`` why the daemon could not be asked.  Never raises.
    """
    path = socket or os.environ.get(control.ENV_SOCKET) or cfg.engine.control_socket
    st, err = control.ask_status(path, timeout)
    return {"socket": path, "configured": cfg.engine.enabled, "running": st is not None, "status": st,
            "error": err}


def gather(cfg, url: str | None, socket: str | None = None) -> dict:
    """Everything the screen shows, as a JSON-ready dict.

    Args:
        cfg: ``config.Config``.
        url: the daemon's metrics URL, or None when metrics are off and none was given.
        socket: the engine control socket (see :func:`read_engine`).
    Reads /proc/meminfo, /proc/swaps, /sys/block/zram*, /proc/pressure/memory, scans /proc
    for targets (``proctree.find_targets``), scrapes ``url`` and asks the control socket.
    """
    g = cfg.guard
    try:
        mi = meminfo.read()
    except OSError as e:
        mi = {}
        mem_error = f"cannot read /proc/meminfo: {e.strerror}"
    else:
        mem_error = None
    avail, total = mi.get("MemAvailable"), mi.get("MemTotal")
    swap_free, swap_total = mi.get("SwapFree"), mi.get("SwapTotal")
    signal = None
    if avail is not None:
        signal = avail + (swap_free or 0) if g.signal == "available+swap" else avail
    memory = {
        "total_bytes": total, "available_bytes": avail,
        "swap_free_bytes": swap_free, "swap_total_bytes": swap_total,
        "signal": g.signal, "signal_bytes": signal,
        "headroom_term_bytes": None if signal is None else signal - g.term_below,
        "headroom_kill_bytes": None if signal is None or g.kill_below is None else signal - g.kill_below,
        "error": mem_error,
    }
    thresholds = {
        "term_below_bytes": g.term_below, "kill_below_bytes": g.kill_below,
        "grace_seconds": g.grace, "poll_interval_seconds": g.poll_interval,
        "signal": g.signal, "dry_run": g.dry_run, "fallback": cfg.targets.fallback,
    }

    targets: list[dict] = []
    targets_error = None
    nvml = gpumem.read_now()        # with nvidia-ml-py: the order and sizes the daemon sees
    try:
        for t in proctree.find_targets(cfg.targets):
            targets.append({"root_pid": t.root_pid, "title": t.title, "pattern": t.pattern,
                            "pids": list(t.pids), "mem_bytes": t.mem_bytes})
            if nvml:
                targets[-1]["gpu_bytes"] = sum(r.get("gpu_bytes", 0) for r in t.tree)
    except Exception as e:  # hidepid, a vanished process, ...: show the rest anyway
        targets_error = f"cannot scan processes: {type(e).__name__}: {e}"

    zram = []
    for d in sysinfo.read_zram():
        orig, compr = d.get("orig_data_bytes"), d.get("compr_data_bytes")
        d = dict(d)
        d["compression_ratio"] = round(orig / compr, 2) if orig and compr else None
        zram.append(d)

    if url is None:
        daemon = {"url": None, "running": None,
                  "error": "metrics.listen is off in the configuration; pass --url to ask the daemon"}
    else:
        daemon = read_daemon(url)
    links, links_error = {}, None
    unavailable = linkcompat.unavailable_reason() if cfg.link.interfaces else None
    if unavailable:   # no watch thread; the links are still read once below (pyroute2 0.7's IPRoute)
        links_error = f"link watch unavailable: {unavailable}; {linkcompat.FIX}"
    if cfg.link.interfaces:
        try:
            links = linkwatch.read_links(cfg.link.interfaces)
        except (OSError, ImportError) as e:
            links_error = "; ".join(filter(None, [links_error, f"cannot read links over netlink: {e}"]))
    return {
        "links": links, "links_error": links_error,
        "config_path": cfg.path, "memory": memory, "thresholds": thresholds,
        "targets": targets, "targets_error": targets_error,
        "swaps": sysinfo.read_swaps(), "zram": zram, "psi_memory": sysinfo.read_psi_memory(),
        "daemon": daemon, "engine": read_engine(cfg, socket), "timestamp": time.time(),
        "soft": softview.gather(cfg, IncidentStore(cfg.incidents.dir)),
    }


def gather_remote(url: str) -> dict:
    """What another host's endpoint ``url`` reports, and nothing of this host:
    ``{"remote": True, "url", "daemon": read_daemon(url, local=False), "timestamp"}``."""
    return {"remote": True, "url": url, "daemon": read_daemon(url, local=False), "timestamp": time.time()}


def render_remote(st: dict) -> str:
    """The screen for a :func:`gather_remote` dict: the endpoint's memory, lines, state and engine."""
    d, now = st["daemon"], st["timestamp"]
    host = d.get("hostname")
    L = [f"sparkguard status of {st['url']}" + (f" (host {host})" if host else ""),
         "  another host's endpoint: only what it reports is shown (this host's memory, targets, swap,",
         "  PSI and engine socket are not that node's; run `sparkguard status` there for them)", ""]
    if d.get("running"):
        # every value and label is the other host's: shown through untrusted (no control characters)
        L.append("Memory (as the endpoint reports it)")
        L.append(f"  MemTotal      {fs(d.get('total_bytes')):>11}")
        L.append(f"  MemAvailable  {fs(d.get('available_bytes')):>11}")
        sig, term, kill = d.get("signal_bytes"), d.get("term_below_bytes"), d.get("kill_below_bytes")
        if sig is not None and term is not None:
            L.append(f"  headroom      {fs(abs(sig - term)):>11}   {'above' if sig >= term else 'BELOW'} "
                     f"term_below ({fs(term)})")
        if sig is not None and kill is not None:
            L.append(f"                {fs(abs(sig - kill)):>11}   {'above' if sig >= kill else 'BELOW'} "
                     f"kill_below ({fs(kill)})")
        if d.get("swap_total_bytes"):
            L.append(f"  SwapFree {fs(d.get('swap_free_bytes'))} of {fs(d['swap_total_bytes'])}")
        L.append("")
    L += softview.render(None, d, now)
    L += render_daemon(d, now)
    e = d.get("engine") if d.get("running") else None
    if e is not None:
        L.append("")
        L.append("Engine   (from the endpoint's metrics)")
        run = untrusted.stamp(e["run_start"]) if e.get("run_start") else "none"
        L.append(f"  state {e.get('state') or '?'}, ready {'yes' if e.get('ready') else 'no'}"
                 + (f", lane {e['lane']}" if e.get("lane") else "") + f", run started {run}"
                 + (f", tracked by {e['tracking']}" if e.get("tracking") else "")
                 + ("  [GIVEN UP: sparkguard engine start clears it]" if e.get("given_up") else ""))
    return "\n".join(untrusted.clean(ln, 2000) for ln in L) + "\n"

def render(st: dict) -> str:
    """The human screen for a :func:`gather` dict."""
    m, th, d = st["memory"], st["thresholds"], st["daemon"]
    now = st["timestamp"]
    L: list[str] = [f"sparkguard status   (config: {st['config_path']})", ""]

    L.append("Memory")
    if m["error"]:
        L.append(f"  {m['error']}")
    L.append(f"  MemTotal      {fs(m['total_bytes']):>11}")
    L.append(f"  MemAvailable  {fs(m['available_bytes']):>11}")
    if m["signal"] == "available+swap":
        L.append(f"  + SwapFree    {fs(m['swap_free_bytes']):>11}   = signal {fs(m['signal_bytes'])}")
    ht = m["headroom_term_bytes"]
    if ht is not None:
        word = "above" if ht >= 0 else "BELOW"
        L.append(f"  headroom      {fs(abs(ht)):>11}   {word} term_below ({fs(th['term_below_bytes'])})")
    hk = m["headroom_kill_bytes"]
    if hk is not None:
        word = "above" if hk >= 0 else "BELOW"
        L.append(f"                {fs(abs(hk)):>11}   {word} kill_below ({fs(th['kill_below_bytes'])})")
    L.append("")

    L.append("Thresholds")
    kill = fs(th["kill_below_bytes"]) if th["kill_below_bytes"] is not None else "off"
    L.append(f"  term_below {fs(th['term_below_bytes'])}   kill_below {kill}   grace {fd(th['grace_seconds'])}"
             f"   poll every {fd(th['poll_interval_seconds'])} (or faster)")
    dry = "yes" if th["dry_run"] else "no"
    if d.get("running") and d.get("dry_run") is not None and d["dry_run"] != th["dry_run"]:
        # `run --dry-run` (or a config not reloaded yet): what the running guard does is what counts
        dry = f"{'yes' if d['dry_run'] else 'no'} in the running daemon (the config file says {dry})"
    L.append(f"  signal {th['signal']}   dry_run {dry}   fallback {th['fallback']}")
    L.append("")

    L.append("Targets (SIGTERM goes to the first, then SIGKILL to its whole tree after the grace)")
    if st["targets_error"]:
        L.append(f"  {st['targets_error']}")
    elif not st["targets"]:
        what = ("the process with the largest oom_score" if th["fallback"] == "oom_score"
                else "nothing (targets.fallback: off)")
        L.append(f"  no process matches targets.match; below the line sparkguard would signal {what}")
    for i, t in enumerate(st["targets"]):
        mark = "*" if i == 0 else " "
        L.append(f"  {mark} pid {t['root_pid']:<7} {t['title'][:60]}")
        gpu = f"+GPU (GPU {fs(t['gpu_bytes'])}, NVML)" if t.get("gpu_bytes") is not None else ""
        L.append(f"      {fs(t['mem_bytes'])} RSS+swap{gpu} in {len(t['pids'])} process(es), "
                 f"matched by {t['pattern']}")
    L.append("")

    L.append("Swap")
    if not st["swaps"]:
        L.append("  none active")
    for s in st["swaps"]:
        L.append(f"  {s['filename']:<20} {s['type']:<9} {fs(s['size_bytes']):>10}, used {fs(s['used_bytes'])}, "
                 f"priority {s['priority']}")
    if m["swap_total_bytes"]:
        L.append(f"  SwapFree {fs(m['swap_free_bytes'])} of {fs(m['swap_total_bytes'])}")
    for z in st["zram"]:
        ratio = f"{z['compression_ratio']:.2f}x" if z.get("compression_ratio") else "-"
        L.append(f"  zram {z['device']} ({z.get('comp_algorithm') or '?'}): {fs(z['disksize_bytes'])} disk, "
                 f"holds {fs(z.get('orig_data_bytes'))} in {fs(z.get('compr_data_bytes'))} "
                 f"(ratio {ratio}), uses {fs(z.get('mem_used_bytes'))} of RAM")
    if not st["zram"]:
        L.append("  no zram device")
    L.append("")

    if st.get("links") or st.get("links_error"):
        L.append("TP links (link.interfaces)")
        if st.get("links_error"):
            L.append(f"  {st['links_error']}")
        for name, ln in st["links"].items():
            if not ln.get("present"):
                L.append(f"  {name}: MISSING (no such interface)")
                continue
            speed = ln.get("speed_bytes_per_second")
            L.append(f"  {name}: {'UP' if ln.get('up') else 'DOWN'} (operstate {ln.get('operstate')}, "
                     f"carrier {ln.get('carrier')}"
                     + (f", {speed * 8 / 1e9:g} Gb/s" if speed else "")
                     + f", carrier changes {ln.get('carrier_changes')}, rx/tx errors "
                     f"{ln.get('rx_errors')}/{ln.get('tx_errors')}, drops {ln.get('rx_dropped')}/{ln.get('tx_dropped')})")
        L.append("")

    L.append("Memory pressure (PSI, share of time stalled)")
    psi = st["psi_memory"]
    if not psi:
        L.append("  not available (kernel without PSI, or psi=0)")
    else:
        for kind in ("some", "full"):
            v = psi.get(kind) or {}
            L.append(f"  {kind:<5} " + "   ".join(f"{w} {v[w]:5.2f}%" for w in ("avg10", "avg60", "avg300") if w in v)
                     + (f"   total {v['total_us'] / 1e6:.1f} s" if "total_us" in v else ""))
    L.append("")

    L += softview.render(st.get("soft"), d, now)
    L += render_daemon(d, now)
    L.append("")
    L += render_engine(st["engine"])
    return "\n".join(L) + "\n"


def render_daemon(d: dict, now: float) -> list[str]:
    """The "Daemon" section for a :func:`read_daemon` dict (``now``: unix seconds)."""
    L: list[str] = []
    L.append(f"Daemon   ({d['url'] or 'metrics off'})")
    if not d.get("running"):
        if d["url"] is None:
            L.append(f"  state unknown: {d['error']}")
        elif d["error"].startswith("no answer") and not (d.get("holder") or {}).get("guards"):
            L.append(f"  daemon not running ({d['error']})")
            if d.get("detail"):
                L.append(f"  ({d['detail']}; start it with `sparkguard run`, or pass --url)")
        else:
            L.append(f"  {d['error']}")
        L += render_holder(d.get("holder"))
    else:
        # a time that is no real time (NaN, negative, year > 2200: another host's page) shows "?"
        up = fd(now - d["start_time"]) if untrusted.stamp(d.get("start_time")) != "?" else "?"
        last = fd(max(0.0, now - d["last_poll_timestamp"])) + " ago" \
            if untrusted.stamp(d.get("last_poll_timestamp")) != "?" else "?"
        L.append(f"  running (sparkguard {d.get('version') or '?'}), state {d.get('state') or '?'}"
                 f"{'  [DRY RUN: signals nothing]' if d.get('dry_run') else ''}")
        L.append(f"  up {up}, last poll {last}, {d.get('polls') or 0} polls"
                 + (f", RSS {fs(d['rss_bytes'])}" if d.get("rss_bytes") else ""))
        if d.get("signal_bytes") is not None:
            L.append(f"  it sees {fs(d['signal_bytes'])} against term_below {fs(d.get('term_below_bytes'))}")
        sig = ", ".join(f"{k} {v}" for k, v in sorted(d["signals"].items(), reverse=True)) or "none"
        inc = ", ".join(f"{k} {v}" for k, v in sorted(d["incidents"].items())) or "none"
        L.append(f"  signals sent: {sig};  incidents: {inc}")
        if d.get("last_incident_timestamp"):
            ago = fd(max(0.0, now - d["last_incident_timestamp"])) \
                if untrusted.stamp(d["last_incident_timestamp"]) != "?" else "?"
            stamp = untrusted.stamp(d["last_incident_timestamp"])
            L.append(f"  last incident {stamp} ({ago} ago); see `sparkguard incidents`")
    return L


def render_holder(h: dict | None) -> list[str]:
    """Lines on who holds the metrics port, for a :func:`port_holder` dict (none when None)."""
    if h is None:
        return []
    guards = ", ".join(str(p) for p in h["guards"])
    L = []
    if h["listening"] and h["is_guard"] is False:
        L.append(f"  the port is held by {h['text']}: NOT the guard; the guard cannot serve metrics there")
    elif h["listening"] and h["is_guard"] is None:
        L.append(f"  the port is held by {h['text']}")
    elif not h["listening"]:
        L.append("  nothing listens on the port")
    if guards and h["is_guard"] is not True:
        L.append(f"  a guard runs (pid {guards}) without serving its metrics here: it keeps guarding and "
                 "binds again every 1-60 s; its STATUS= (systemctl status sparkguard) says why")
    return L


def render_engine(e: dict) -> list[str]:
    """The "Engine" section for a :func:`read_engine` dict: the supervisor's own status lines
    (``sparkguard.supervisor.describe``: state, pid, lane, ready, restarts, last exit), or why
    there is none."""
    L = [f"Engine   (control socket {e['socket']})"]
    if e["status"] is not None:
        L += ["  " + ln for ln in describe(e["status"])]
    elif not e["configured"]:
        L.append("  not supervised (no engine: section in the configuration)")
    elif "not running" in (e["error"] or ""):      # control.request's no-socket / stale-socket errors
        L.append(f"  daemon not running: {e['error']}")
    else:
        L.append(f"  cannot ask the daemon: {e['error']}")
    return L


def handler(args: argparse.Namespace) -> int:
    """Run ``sparkguard status``: 0 normally, 2 when the configuration is invalid (it is not read
    for another host's ``--url``)."""
    remote = bool(args.url) and not is_local_url(args.url)
    if args.url and not remote and is_loopback_url(args.url):
        # a loopback URL is this host's only if the endpoint says it runs here (a tunnel's is not)
        remote = not same_host(read_daemon(args.url, local=False))
    if remote:
        st, show = gather_remote(args.url), render_remote
    else:
        try:
            cfg = config.load(args.config)
        except config.ConfigError as e:
            print(f"sparkguard status: {e}", file=sys.stderr)
            return 2
        st, show = gather(cfg, args.url or metrics_url(cfg.metrics.listen), args.socket), render
    if args.json:
        json.dump(st, sys.stdout, indent=2, sort_keys=True)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(show(st))
    return 0

"""What ``sparkguard status`` shows, read here and now: /proc, /sys, the metrics endpoint, the control socket.

:func:`gather` reads this host (memory, targets, swap and zram, PSI, the TP links) and asks the
running daemon (its metrics endpoint: :mod:`sparkguard.status_daemon`; its control socket:
:func:`read_engine`); :func:`gather_remote` asks another host's endpoint only.  Both return
JSON-ready dicts that :mod:`sparkguard.status_render` turns into the screen.
"""

from __future__ import annotations

import os
import time

from sparkguard import control, enginetree, gpumem, linkcompat, linkwatch, meminfo, softview, sysinfo
from sparkguard.incidents.store import IncidentStore
from sparkguard.status_daemon import read_daemon


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
    for targets (``enginetree.find_targets``), scrapes ``url`` and asks the control socket.
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
        signal = meminfo.signal_bytes(g.signal, avail, swap_free or 0)
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
        for t in enginetree.find_targets(cfg.targets):
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

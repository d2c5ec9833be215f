"""The running daemon's state, read from its metrics endpoint for ``sparkguard status`` and ``doctor``.

:func:`read_daemon` scrapes the endpoint (one bounded HTTP GET); :func:`parse_metrics` turns its
Prometheus text into the state dict (pure); :func:`port_holder` says who holds the port when the
endpoint does not answer as the guard.  Source of the names: the metric families of
:mod:`sparkguard.metrics` (docs/metrics.md).
"""

from __future__ import annotations

import math
import urllib.error
import urllib.request
from urllib.parse import urlsplit

from prometheus_client.parser import text_string_to_metric_families

from sparkguard import portowner, proctree, softview
from sparkguard.host import procview

#: bytes of the daemon's answer read at most (its exposition is about 10 KiB)
MAX_SCRAPE = 4 << 20


def port_holder(url: str) -> dict | None:
    """Who listens on the port of ``url`` when the guard's endpoint does not answer as itself.

    Returns None when ``url``'s port does not parse, else ``{"listening": bool, "pid": int | None,
    "comm": str, "uid": int | None, "text": str, "is_guard": bool | None, "guards": [pid, ...]}``:
    ``listening`` False when nothing listens there, ``is_guard`` whether that process is a
    ``sparkguard run`` (None when the process was not found), ``guards`` the guards running on
    this host.  Never raises.  Sources: :mod:`sparkguard.portowner`,
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

    ``local``: the endpoint is this host's (:func:`sparkguard.status_url.is_local_url`); only then
    does a failure look up who holds the port here (``holder``: :func:`port_holder`).

    Returns:
        ``{"url", "running": False, "error": str, "detail": str, "holder"}`` when nothing (or something
        else) answers; otherwise :func:`parse_metrics`'s dict.  Never raises.
    """
    out: dict = {"url": url, "running": False}
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            text = r.read(MAX_SCRAPE).decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        out["error"] = f"{url} answered HTTP {e.code} {e.reason}: not a sparkguard metrics endpoint"
    except (urllib.error.URLError, OSError, ValueError) as e:
        out["error"] = f"no answer at {url}"
        reason = getattr(e, "reason", e)
        out["detail"] = getattr(reason, "strerror", None) or str(reason)
    else:
        out = parse_metrics(url, text)
    if not out["running"]:
        out["holder"] = port_holder(url) if local else None
    return out


def parse_metrics(url: str, text: str) -> dict:
    """The daemon's state from the Prometheus text ``text`` its endpoint ``url`` served (pure).

    Returns:
        ``{"url", "running": False, "error": str}`` when ``text`` is not Prometheus text or holds no
        ``sparkguard_`` metric; otherwise ``{"url", "running": True, "state", "dry_run", "version",
        "hostname", "available_bytes", "signal_bytes", "term_below_bytes", "kill_below_bytes",
        "grace_seconds", "signals": {sig: n}, "incidents": {kind: n}, "config_reloads": {result: n},
        "last_incident_timestamp", "last_poll_timestamp", "start_time", "polls", "poll_seconds_sum",
        "rss_bytes", "total_bytes", "swap_free_bytes", "swap_total_bytes", "engine", "pause"}`` (absent
        or unshowable metrics give None; ``engine``: :func:`_engine_from_metrics`; ``pause``: the soft
        line, :func:`sparkguard.softview.from_metrics`).  Never raises.
    Source: the metric names of sparkguard.metrics (docs/metrics.md).
    """
    out: dict = {"url": url, "running": False}
    try:
        fams = list(text_string_to_metric_families(text))
    except Exception as e:  # not Prometheus text at all
        out["error"] = f"{url} answered, but not with Prometheus metrics ({e})"
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

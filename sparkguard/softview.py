"""The soft line for people: when it engaged, what it paused, for how long, how it ended.

Read by ``sparkguard status`` (:func:`gather` here and now, :func:`from_metrics` from the daemon's
endpoint, :func:`render` the section; the last episode from
``sparkguard.incidents.store.IncidentStore.newest``) and by ``sparkguard incidents ID`` (:func:`report_lines`,
the "Soft line" section of a ``pause`` incident's report).  Everything but :func:`gather` is
pure: it takes the JSON dicts it is given (a stored record may be from an older version or
damaged, an endpoint may be another host's) and never raises on odd values.

The facts of one episode (:func:`episode`) come from the ``pause`` incident record
(docs/incident.md): ``started_at`` (the signal fell below ``guard.pause_below``), the timeline
(``pause_crossed``, ``paused``, ``resume_sent``, ``resumed``, ``pause_failed``,
``resume_failed``, ``pause_escalated``, ``pause_engine_restarted``; their ``t`` is seconds since
the crossing), ``outcome``, ``thresholds`` (the pause thresholds) and the ``pause`` part (the
engine's ``url``, ``engine_pid``, ``lane``; records written before it existed have none, then
the URL is read from the ``pause_crossed`` detail, which has named it since the soft line exists:
``sparkguard/guard/soft.py`` ``SoftGuard._open``).
"""

from __future__ import annotations

import math
import os
import re

from sparkguard import untrusted
from sparkguard.guard.soft import url_of
from sparkguard.model import number
from sparkguard.units import format_duration as fd
from sparkguard.units import format_size as fs

#: how each outcome reads (docs/incident.md "Outcomes", pause)
ENDINGS = {
    "resumed": "resumed",
    "pause_failed": "the pause failed: the guard went on as without the soft line",
    "escalated": "the hard line was crossed: SIGTERM (the memory incident has it)",
    "resume_failed": "resuming failed: the engine may still be paused",
    "engine_restarted": "the supervisor restarted the engine (a new run is not paused)",
    "daemon_stopped": "the guard stopped",
}

_URL_RE = re.compile(r"POST (\S+?)/pause\?")


def _first(rec: dict) -> dict[str, dict]:
    """The first event of each name of ``rec``'s timeline."""
    out: dict[str, dict] = {}
    tl = rec.get("timeline")
    for ev in tl if isinstance(tl, list) else []:
        if isinstance(ev, dict) and isinstance(ev.get("event"), str):
            out.setdefault(ev["event"], ev)
    return out


def _t(ev: dict | None) -> float | None:
    """An event's ``t`` (s since the crossing), None when absent or no finite number."""
    v = number(ev.get("t")) if isinstance(ev, dict) else None
    return v if v is not None and math.isfinite(v) else None


def episode(rec: dict) -> dict:
    """The facts of one ``pause`` incident record, for people.

    Returns:
        ``{"id", "engaged_at" (unix s or None), "signal_bytes" (at the crossing), "pause_below_bytes",
        "resume_above_bytes", "resume_after_seconds", "mode", "url", "engine_pid", "lane",
        "paused_after_seconds" (crossing to the engine's "paused", None when it never said so),
        "paused_seconds" (from "paused" to "resumed", else to the close; None when never paused
        or still open), "still_paused" (bool: the record ended with the engine perhaps paused),
        "outcome", "ended" (str: how it ended), "ended_at", "lowest_bytes", "detail" (str: the
        failure's detail, "" otherwise)}``; every value may be None for a partial record.
    """
    rec = rec if isinstance(rec, dict) else {}
    th = rec.get("thresholds") if isinstance(rec.get("thresholds"), dict) else {}
    part = rec.get("pause") if isinstance(rec.get("pause"), dict) else {}
    ev = _first(rec)
    crossed = ev.get("pause_crossed") or {}
    url = part.get("url") if isinstance(part.get("url"), str) else None
    if url is None and isinstance(crossed.get("detail"), str):
        m = _URL_RE.search(crossed["detail"])
        url = m.group(1) if m else None
    start, end = number(rec.get("started_at")), number(rec.get("ended_at"))
    pid = number(part.get("engine_pid"))
    pid = int(pid) if pid is not None and math.isfinite(pid) and 0 < pid < 2**32 else None
    t_paused, t_resumed = _t(ev.get("paused")), _t(ev.get("resumed"))
    outcome = rec.get("outcome") if isinstance(rec.get("outcome"), str) else None
    paused_for = None
    if t_paused is not None:
        if t_resumed is not None:
            paused_for = max(0.0, t_resumed - t_paused)
        elif start is not None and end is not None:
            paused_for = max(0.0, end - start - t_paused)
    still = t_paused is not None and t_resumed is None and outcome in ("resume_failed", "daemon_stopped")
    failure = ev.get("pause_failed") or ev.get("resume_failed") or {}
    detail = str(failure.get("detail") or "").split(";", 1)[0]
    ended = ENDINGS.get(outcome or "", outcome or "still engaged (no record closed yet)")
    if outcome == "resumed" and t_resumed is not None:
        ended = f"resumed {fd(t_resumed)} after the crossing"
    elif outcome == "escalated" and _t(ev.get("pause_escalated")) is not None:
        ended = (f"the hard line {fs(number(th.get('term_below_bytes')))} was crossed "
                 f"{fd(_t(ev['pause_escalated']))} after the crossing: SIGTERM (the memory incident has it)")
    elif outcome == "daemon_stopped" and t_paused is not None:
        ended += ": the engine may still be paused" if still else ": it resumed the engine"
    return {"id": rec.get("id"), "engaged_at": start, "signal_bytes": number(crossed.get("available_bytes")),
            "pause_below_bytes": number(th.get("pause_below_bytes")),
            "resume_above_bytes": number(th.get("resume_above_bytes")),
            "resume_after_seconds": number(th.get("resume_after_seconds")), "mode": th.get("mode"),
            "url": url, "engine_pid": pid, "lane": part.get("lane"),
            "paused_after_seconds": t_paused, "paused_seconds": paused_for, "still_paused": still,
            "outcome": outcome, "ended": ended, "ended_at": end,
            "lowest_bytes": number(rec.get("min_available_bytes")), "detail": detail}


def _what(e: dict) -> str:
    """``http://host:port (engine pid N, lane L)``: what was paused."""
    bits = [f"engine pid {e['engine_pid']}"] if e.get("engine_pid") is not None else []
    if isinstance(e.get("lane"), str) and e["lane"]:
        bits.append(f"lane {e['lane']}")
    return (e.get("url") or "the engine") + (f" ({', '.join(bits)})" if bits else "")


def _paused_line(e: dict) -> str:
    """What was paused, how soon, how long (or why nothing was)."""
    if e["paused_after_seconds"] is None:
        return f"not paused: {e['detail'] or e['ended']}" if e["outcome"] else "asked to pause, no answer yet"
    how = f"{_what(e)}, mode {e.get('mode') or '?'}, {fd(e['paused_after_seconds'])} after the crossing"
    if e["paused_seconds"] is not None:
        how += f", for {fd(e['paused_seconds'])}" + (" (or longer: it may still be paused)" if e["still_paused"]
                                                    else "")
    return how


def report_lines(rec: dict) -> list[str]:
    """The "Soft line" section of a ``pause`` incident's report (``sparkguard incidents ID``)."""
    e = episode(rec)
    below, sig = e["pause_below_bytes"], e["signal_bytes"]
    th = rec.get("thresholds") if isinstance(rec, dict) and isinstance(rec.get("thresholds"), dict) else {}
    under = f", {fs(below - sig)} below it" if sig is not None and below is not None else ""
    out = ["Soft line (guard.pause_below: the engine asked to pause instead of a kill; docs/soft-line.md)",
           f"  lines          pause below {fs(below)}, resume above {fs(e['resume_above_bytes'])} held "
           f"{fd(e['resume_after_seconds'])}, SIGTERM below {fs(number(th.get('term_below_bytes')))}",
           f"  engaged        {untrusted.stamp(e['engaged_at'])}: signal {fs(sig)}{under}",
           f"  paused         {_paused_line(e)}",
           f"  ended          {e['ended']}"
           + (f" at {untrusted.stamp(e['ended_at'])}" if e["ended_at"] is not None else "")
           + (f" ({e['detail']})" if e["detail"] and e["paused_after_seconds"] is not None else "")]
    if e["outcome"] == "resume_failed" and e.get("url"):
        out.append(f"  by hand        curl -X POST {e['url']}/resume")
    return [untrusted.clean(ln, 2000) for ln in out]


# --- sparkguard status ------------------------------------------------------------------


def from_metrics(one: dict[str, float], by: dict[str, dict[str, float]]) -> dict | None:
    """The soft line as the daemon's endpoint shows it (docs/metrics.md "Soft line"):
    ``{"engine_paused": bool, "pauses": {"ok": int, "failed": int}, "resumes": {...}}``, None from
    a daemon without ``sparkguard_engine_paused``.  ``one``/``by``: samples without labels, and by
    their first label's value (``sparkguard.status_daemon.read_daemon``); untrusted numbers count as 0."""
    if "sparkguard_engine_paused" not in one:
        return None

    def counts(name: str) -> dict[str, int]:
        got = by.get(name) or {}
        return {k: int(v) if isinstance(v, float | int) and math.isfinite(v) and 0 <= v < 2.0 ** 63 else 0
                for k, v in ((r, got.get(r, 0.0)) for r in ("ok", "failed"))}

    return {"engine_paused": one.get("sparkguard_engine_paused") == 1.0,
            "pauses": counts("sparkguard_pauses_total"), "resumes": counts("sparkguard_resumes_total")}


def gather(cfg, store) -> dict:
    """The soft line here and now, for ``sparkguard status``: the configuration's lines and the
    last episode.

    Args:
        cfg: ``config.Config``.
        store: the ``sparkguard.incidents.store.IncidentStore`` of ``incidents.dir``: its
            :meth:`newest` ``pause`` record is the last episode.  A directory this user may not
            read (it is 0750 root's) is not read: no warning on every ``status`` of an operator
            outside its group; ``store_readable`` says so.
    Returns:
        ``{"pause_below_bytes" (int or None: off), "resume_above_bytes", "resume_after_seconds",
        "mode", "url" (the engine's base URL or None), "dry_run", "store_readable" (bool),
        "last" (:func:`episode` of the newest pause incident, or None)}``.
    """
    g = cfg.guard
    readable = not os.path.isdir(store.dir) or os.access(store.dir, os.R_OK | os.X_OK)
    last = store.newest("pause") if readable else None
    return {"pause_below_bytes": g.pause_below,
            "resume_above_bytes": None if g.pause_below is None else g.pause_below + g.pause_hysteresis,
            "resume_after_seconds": g.resume_after, "mode": g.pause_mode, "url": url_of(cfg),
            "dry_run": g.dry_run, "store_readable": readable, "last": episode(last) if last is not None else None}


def _ago(seconds: float) -> str:
    """A span for people, up to days (``format_duration`` stops at minutes)."""
    seconds = max(0.0, seconds)
    if seconds >= 2 * 86400:
        return f"{seconds / 86400:.1f} days"
    if seconds >= 2 * 3600:
        return f"{seconds / 3600:.1f} h"
    return fd(seconds)


def render(soft: dict | None, daemon: dict, now: float) -> list[str]:
    """The "Soft line" section of ``sparkguard status`` (with a blank line after it), or ``[]``
    when the soft line is off and has never engaged.

    Args:
        soft: :func:`gather`'s dict, or None (another host's endpoint: only its metrics count).
        daemon: ``sparkguard.status_daemon.read_daemon``'s dict (its ``pause``: :func:`from_metrics`).
        now: unix seconds.
    """
    live = daemon.get("pause") if daemon.get("running") and isinstance(daemon.get("pause"), dict) else None
    soft = soft or {}
    last = soft.get("last")
    ever = live is not None and (live["engine_paused"] or any(live["pauses"].values()))
    if soft.get("pause_below_bytes") is None and last is None and not ever:
        return []
    if soft.get("pause_below_bytes") is not None:
        head = (f"Soft line   pause below {fs(soft['pause_below_bytes'])}, resume above "
                f"{fs(soft['resume_above_bytes'])} held {fd(soft['resume_after_seconds'])}, mode {soft['mode']}; "
                f"engine {soft['url'] or 'none (guard.pause_url, or engine.health_url with engine.pause: auto)'}")
        if soft.get("dry_run"):
            head += "  [off in a dry run]"
    elif "pause_below_bytes" in soft:
        head = "Soft line   off (guard.pause_below not set)"
    else:
        head = "Soft line   (from the endpoint's metrics)"
    L = [head]
    if live is not None:
        p, r = live["pauses"], live["resumes"]
        L.append(f"  now          {'ENGINE PAUSED' if live['engine_paused'] else 'not paused'}; since the daemon "
                 f"started: pauses {p['ok']} ok, {p['failed']} failed; resumes {r['ok']} ok, {r['failed']} failed")
    if last is not None:
        ago = f" ({_ago(now - last['engaged_at'])} ago)" if untrusted.stamp(last.get("engaged_at")) != "?" else ""
        L.append(f"  last         engaged {untrusted.stamp(last.get('engaged_at'))}{ago} at {fs(last['signal_bytes'])}")
        L.append(f"               paused {_paused_line(last)}")
        L.append(f"               ended: {last['ended']}; `sparkguard incidents {last['id']}`")
    elif "pause_below_bytes" in soft and not soft.get("store_readable", True):
        L.append("  last         unknown: incidents.dir is not readable by this user (run as root)")
    elif "pause_below_bytes" in soft:
        L.append("  last         never engaged (no pause incident in incidents.dir)")
    L.append("")
    return [untrusted.clean(ln, 2000) for ln in L]

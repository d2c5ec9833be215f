"""The readable report of an incident record and its one-line listing (``sparkguard incidents``).

Both read the JSON record (a dict: from the store, the journal, or
:meth:`sparkguard.model.Incident.to_json`) and never raise on a partial or older one.
"""

from __future__ import annotations

import shlex
from typing import Any

from sparkguard import softview, untrusted
from sparkguard.model import available_at_crossing, duration, min_available, number, summary, target_label
from sparkguard.units import format_duration, format_size


def _local(t: Any, with_ms: bool = False) -> str:
    """Unix seconds ``t`` as local time with its zone; ``-`` when absent, ``?`` when no time this
    host can show (NaN, 1e300, negative: a stored record may hold anything)."""
    if number(t) is None:
        return "-"
    s = untrusted.stamp(t)
    if s == "?":
        return s
    if with_ms:
        s += f".{int((t % 1) * 1000):03d}"
    return s + untrusted.stamp(t, " %Z")


# --- the readable report ---------------------------------------------------------------

_MEMINFO_SHOWN = ("MemTotal", "MemAvailable", "MemFree", "Cached", "Buffers", "Shmem", "AnonPages",
                  "Mlocked", "Unevictable", "SwapTotal", "SwapFree", "Dirty", "Writeback")


def _psi_line(psi: dict, kind: str) -> str | None:
    d = psi.get(kind) if isinstance(psi, dict) else None
    if not isinstance(d, dict):
        return None
    parts = [f"{w} {d[w]:.2f}%" for w in ("avg10", "avg60", "avg300") if number(d.get(w)) is not None]
    if number(d.get("total_us")) is not None:
        parts.append(f"total {d['total_us'] / 1e6:.3f} s stalled")
    return f"{kind:<5} " + ", ".join(parts)


def _tree_rows(tree: list[dict]) -> list[tuple[int, dict]]:
    """(depth, entry) in parent-before-child order; entries whose parent is outside the tree
    (the root, and orphans reparented away from it) start at depth 0."""
    entries = [e for e in tree if isinstance(e, dict)]
    pids = {e.get("pid") for e in entries}
    children: dict[Any, list[dict]] = {}
    roots = []
    for e in entries:
        if e.get("ppid") in pids and e.get("ppid") != e.get("pid"):
            children.setdefault(e.get("ppid"), []).append(e)
        else:
            roots.append(e)
    out: list[tuple[int, dict]] = []
    seen: set = set()

    def walk(e: dict, depth: int) -> None:
        if id(e) in seen:
            return
        seen.add(id(e))
        out.append((depth, e))
        for c in children.get(e.get("pid"), []):
            walk(c, depth + 1)

    for r in roots:
        walk(r, 0)
    for e in entries:  # cycles (should not happen): still show them
        walk(e, 0)
    return out


def _engine_lines(eng: dict) -> list[str]:
    """The report's "Engine" section from ``rec["engine"]`` (sparkguard.supervisor: the supervised
    engine's run the incident concerns, and what became of it); never raises on odd values."""
    def words(d: Any) -> str:       # a small dict as "k v, k v" (no JSON in a report for people)
        if isinstance(d, dict):
            return ", ".join(f"{k} {v}" for k, v in d.items() if v not in (None, "", 0, False)) or "none"
        return str(d)

    out = ["Engine (supervised by sparkguard)"]
    head = []
    if eng.get("pid") is not None:
        head.append(f"pid {eng['pid']}")
    if eng.get("lane"):
        head.append(f"lane {eng['lane']}")
    if head:
        out.append(f"  run            {', '.join(head)}")
    cmd = eng.get("command")
    if isinstance(cmd, list) and cmd:
        line = shlex.join(str(a) for a in cmd)
        out.append(f"  command        {line if len(line) <= 300 else line[:299] + '…'}")
    ex = eng.get("exit")
    if isinstance(ex, dict):
        when = _local(ex.get("at")) if number(ex.get("at")) is not None else ""
        out.append(f"  exit           {ex.get('detail') or words(ex)}" + (f" (at {when})" if when else ""))
    elif eng.get("pid") is not None and "exit" in eng:
        out.append("  exit           still running when reported")
    if eng.get("state"):
        out.append(f"  state          {eng['state']}" + (f": {eng['detail']}" if eng.get("detail") else "")
                   + " (when the incident closed)")
    if "restarted" in eng:
        after = eng.get("after") if isinstance(eng.get("after"), dict) else {}
        bits = [f"{k} {after[k]}" for k in ("pid", "lane") if after.get(k) is not None]
        out.append("  restarted      " + ("yes" if eng["restarted"] else "no")
                   + (f", now {after['state']}" if after.get("state") else "")
                   + (f" ({', '.join(bits)})" if bits else ""))
    if isinstance(eng.get("restarts"), dict):
        out.append(f"  restarts       {words(eng['restarts'])} (by reason, since the daemon started)")
    for k, v in eng.items():
        if k in ("pid", "lane", "command", "exit", "state", "detail", "restarted", "after", "restarts", "last_lines"):
            continue
        if isinstance(v, list) and all(isinstance(x, str) for x in v):
            out.append(f"  {k}:")
            out.extend(f"    | {x}" for x in v)
        else:
            out.append(f"  {str(k):<14} {words(v) if isinstance(v, dict) else v}")
    lines = eng.get("last_lines")
    if isinstance(lines, list) and lines:
        out.append(f"  last {len(lines)} output lines" + (f" of pid {eng['pid']}" if eng.get("pid") else "") + ":")
        out.extend(f"    | {x}" for x in lines)
    return out


def _blackbox_lines(bb: dict) -> list[str]:
    """The black box part of an ``unclean-shutdown`` incident (docs/blackbox.md)."""
    lo = bb.get("lowest") if isinstance(bb.get("lowest"), dict) else {}
    hi = bb.get("highest") if isinstance(bb.get("highest"), dict) else {}
    out = [f"Black box  {bb.get('cause', '-')}: previous boot {bb.get('previous_boot_id') or '-'}, "
           f"this boot {bb.get('boot_id') or '-'}, previous pid {bb.get('previous_pid', '-')}",
           f"  last sample    {_local(bb.get('last_sample_at'), True)}, {format_duration(number(bb.get('gap_seconds')))}"
           f" before this start ({bb.get('records', '-')} records, {bb.get('unreadable_slots', '-')} unreadable)",
           f"  last {format_duration(number(bb.get('window_seconds')))}: lowest MemAvailable "
           f"{format_size(lo.get('mem_available_bytes'))}, MemFree {format_size(lo.get('mem_free_bytes'))}, "
           f"SwapFree {format_size(lo.get('swap_free_bytes'))}",
           f"                 highest PSI some/full avg10 {hi.get('psi_some_avg10', '-')}/{hi.get('psi_full_avg10', '-')} %,"
           f" zram used {format_size(hi.get('zram_used_bytes'))}, target {format_size(hi.get('target_mem_bytes'))}"]
    last = [r for r in bb.get("last") or [] if isinstance(r, dict)]
    if last:
        out.append(f"  {'AT':<27} {'SIGNAL':>10} {'AVAIL':>10} {'FREE':>10} {'SWAPFREE':>10} {'ZRAM':>9} "
                   f"{'PSI s/f':>11}  STATE")
        for r in last:
            psi = f"{r.get('psi_some_avg10', '-')}/{r.get('psi_full_avg10', '-')}"
            out.append(f"  {_local(r.get('at'), True):<27} {format_size(r.get('signal_bytes')):>10} "
                       f"{format_size(r.get('mem_available_bytes')):>10} {format_size(r.get('mem_free_bytes')):>10} "
                       f"{format_size(r.get('swap_free_bytes')):>10} {format_size(r.get('zram_used_bytes')):>9} "
                       f"{psi:>11}  {r.get('state', '-')}{' (idle)' if r.get('idle') else ''}")
    return out


def render(rec: dict) -> str:
    """A readable multi-line report of one incident record (str, ends with a newline).

    Sections: what happened (kind, outcome, summary), when (local times, duration),
    where (host, boot id), memory (thresholds, MemAvailable at the crossing and lowest,
    /proc/meminfo excerpt, PSI, zram), the target's process tree, the timeline with
    times relative to the crossing, and the engine supervisor's notes if present.
    Missing or odd fields print as ``-``; render never raises on a partial record.
    """
    L: list[str] = []
    kind = rec.get("kind", "memory")
    flags = [f for f, on in (("DRILL", rec.get("drill")), ("DRY RUN", rec.get("dry_run"))) if on]
    L.append(f"Incident {rec.get('id', '?')}  ({kind}{', ' + ', '.join(flags) if flags else ''})")
    L.append(f"  {summary(rec)}")
    L.append("")
    L.append(f"  outcome        {rec.get('outcome', '-')}")
    L.append(f"  started        {_local(rec.get('started_at'), True)}")
    end = rec.get("ended_at")
    L.append(f"  ended          {_local(end, True) if end is not None else 'not yet (open)'}"
             + (f"   (after {format_duration(duration(rec))})" if duration(rec) is not None else ""))
    L.append(f"  host           {rec.get('host', '-')}   boot {rec.get('boot_id', '-') or '-'}")
    if kind == "pause":
        L += [""] + softview.report_lines(rec)

    th = rec.get("thresholds") or {}
    L.append("")
    L.append("Memory")
    if isinstance(th, dict):
        sig = th.get("signal", "available")
        L.append(f"  signal         {'MemAvailable + SwapFree' if sig == 'available+swap' else 'MemAvailable'}"
                 f" ({sig})")
        kill = th.get("kill_below_bytes")
        if "pause_below_bytes" not in th:        # a pause incident's lines are in its "Soft line" section
            L.append(f"  TERM below     {format_size(th.get('term_below_bytes'))}    "
                     f"KILL below {format_size(kill) if kill is not None else 'off'}    "
                     f"grace {format_duration(th.get('grace_seconds'))}")
    L.append(f"  at crossing    MemAvailable {format_size(available_at_crossing(rec))}")
    low = min_available(rec)
    low_t = None
    for ev in rec.get("timeline") or []:
        if isinstance(ev, dict) and ev.get("available_bytes") == low and low is not None:
            low_t = ev.get("t")
            break
    L.append(f"  lowest         MemAvailable {format_size(low)}"
             + (f" at +{low_t:.3f} s" if number(low_t) is not None else ""))
    mi = rec.get("meminfo")
    if isinstance(mi, dict) and mi:
        shown = [(k, mi[k]) for k in _MEMINFO_SHOWN if number(mi.get(k)) is not None]
        L.append("  /proc/meminfo at the crossing:")
        for i in range(0, len(shown), 3):
            L.append("    " + "   ".join(f"{k + ':':<14}{format_size(v):>10}" for k, v in shown[i:i + 3]))
    psi = rec.get("psi_memory")
    if isinstance(psi, dict):
        L.append("  PSI memory     " + (_psi_line(psi, "some") or "-"))
        if _psi_line(psi, "full"):
            L.append("                 " + _psi_line(psi, "full"))
    else:
        L.append("  PSI memory     - (not available)")
    zr = rec.get("zram")
    if isinstance(zr, list) and zr:
        for z in zr:
            if not isinstance(z, dict):
                continue
            orig, compr = number(z.get("orig_data_bytes")), number(z.get("compr_data_bytes"))
            ratio = f", ratio {orig / compr:.1f}" if orig and compr else ""
            L.append(f"  zram           {z.get('device', '?')} ({z.get('comp_algorithm', '?')}): "
                     f"disksize {format_size(z.get('disksize_bytes'))}, data {format_size(orig)} "
                     f"in {format_size(compr)}{ratio}, RAM used {format_size(z.get('mem_used_bytes'))}")
    else:
        L.append("  zram           none")

    L.append("")
    t = rec.get("target")
    if isinstance(t, dict):
        L.append(f"Target  {t.get('title', '?')}  (root pid {t.get('root_pid', '?')}, "
                 f"tree memory {format_size(t.get('mem_bytes'))} RSS+swap"
                 + ("+GPU" if any(isinstance(r, dict) and "gpu_bytes" in r for r in t.get("tree") or []) else "")
                 + ")")
        if t.get("pattern"):
            L.append(f"  matched by     {t.get('pattern')}")
        tree = t.get("tree") or []
        if tree:
            L.append(f"  {'PID':>8} {'PPID':>8} {'RSS':>10} {'SWAP':>10} {'OOM':>5}  TITLE")
            for depth, e in _tree_rows(tree):
                title = str(e.get("title") or "")
                L.append(f"  {e.get('pid', '?'):>8} {e.get('ppid', '?'):>8} "
                         f"{format_size(e.get('rss_bytes')):>10} {format_size(e.get('swap_bytes')):>10} "
                         f"{str(e.get('oom_score', '-')):>5}  {'  ' * depth}{title}"
                         + (f"  (GPU {format_size(e['gpu_bytes'])})" if e.get("gpu_bytes") else ""))
                cmd = str(e.get("cmdline") or "")
                if cmd and cmd != title:
                    cmd = cmd if len(cmd) <= 100 else cmd[:99] + "…"
                    L.append(f"  {'':>45}  {'  ' * depth}  cmdline: {cmd}")
    else:
        L.append("Target  none")
        top = [e for e in rec.get("top_consumers") or [] if isinstance(e, dict)]
        if top:
            L.append("  largest processes at the crossing (RSS+swap; unified-memory GPU allocations do not show):")
            for e in top:
                L.append(f"  {e.get('pid', '?'):>8} {format_size((e.get('rss_bytes') or 0) + (e.get('swap_bytes') or 0)):>10}"
                         f"  {e.get('title') or ''}")

    L.append("")
    L.append("Timeline (relative to the crossing)")
    t0 = number(rec.get("started_at"))
    tl = [e for e in rec.get("timeline") or [] if isinstance(e, dict)]
    if not tl:
        L.append("  (no events)")
    for ev in tl:
        rel = number(ev.get("t"))
        if rel is None and t0 is not None and number(ev.get("at")) is not None:
            rel = ev["at"] - t0
        parts = [f"  {('+%.3f s' % rel) if rel is not None else '?':>11}  {str(ev.get('event', '?')):<10}"]
        if number(ev.get("available_bytes")) is not None:
            parts.append(f"available {format_size(ev['available_bytes'])}")
        pids = ev.get("pids")
        if pids:
            ps = ", ".join(str(p) for p in pids[:12]) + (f" (+{len(pids) - 12})" if len(pids) > 12 else "")
            parts.append(f"pids {ps}")
        if ev.get("detail"):
            parts.append(str(ev["detail"]))
        L.append("  ".join(parts))

    eng = rec.get("engine")
    if isinstance(eng, dict) and eng:
        L.append("")
        L.extend(_engine_lines(eng))
    bb = rec.get("blackbox")
    if isinstance(bb, dict):
        L.append("")
        L.extend(_blackbox_lines(bb))
    return "\n".join(L) + "\n"


def list_line(rec: dict) -> tuple[str, ...]:
    """Columns of the one-line listing: id, local start, kind, outcome, target, min available, duration."""
    kind = str(rec.get("kind", "memory")) + (" (drill)" if rec.get("drill") and rec.get("kind") != "drill" else "")
    outcome = str(rec.get("outcome", "-")) + (" (dry run)" if rec.get("dry_run") and rec.get("outcome") != "dry_run"
                                              else "")
    d = duration(rec)
    return (str(rec.get("id", "?")), _local(rec.get("started_at")), kind, outcome, target_label(rec, 32),
            format_size(min_available(rec)), format_duration(d) if d is not None else "open")

"""The ``sparkguard status`` screen: pure rendering of the dicts :mod:`sparkguard.status_gather` returns.

:func:`render` is this host's screen, :func:`render_remote` another host's endpoint's (every value
shown through :mod:`sparkguard.untrusted`); :func:`render_daemon`, :func:`render_holder` and
:func:`render_engine` are their sections.  Nothing here reads a file, a socket or the clock.
"""

from __future__ import annotations

from sparkguard import softview, untrusted
from sparkguard.supervisor.render import describe
from sparkguard.units import format_duration as fd
from sparkguard.units import format_size as fs


def render_remote(st: dict) -> str:
    """The screen for a :func:`sparkguard.status_gather.gather_remote` dict: the endpoint's memory,
    lines, state and engine."""
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
    """The human screen for a :func:`sparkguard.status_gather.gather` dict."""
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
    """The "Daemon" section for a :func:`sparkguard.status_daemon.read_daemon` dict (``now``: unix seconds)."""
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
    """Lines on who holds the metrics port, for a :func:`sparkguard.status_daemon.port_holder` dict (none when None)."""
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
    """The "Engine" section for a :func:`sparkguard.status_gather.read_engine` dict: the
    supervisor's own status lines (``sparkguard.supervisor.describe``: state, pid, lane, ready,
    restarts, last exit), or why there is none."""
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

"""The engine's state as lines a person reads (``sparkguard engine status``, ``sparkguard status``)."""

from __future__ import annotations

import shlex
import time

from sparkguard.supervisor import cluster
from sparkguard.supervisor.lanes import config_lane
from sparkguard.units import format_duration, format_size


def describe(state: dict | None) -> list[str]:
    """Lines for ``sparkguard status`` / ``sparkguard engine status`` from :meth:`Supervisor.status`
    (as returned over the control socket, see :func:`sparkguard.control.engine_status`).

    Args:
        state: the status dict, or None (no engine supervised / daemon not reachable).
    Returns:
        list[str], the first line a summary.
    """
    if not state:
        return ["engine: not supervised (no engine: section, or the daemon is not running)"]
    s = state
    head = f"engine: {s.get('state')}"
    bits = []
    if s.get("pid"):
        bits.append(f"pid {s['pid']}")
    if s.get("lane"):
        bits.append(f"lane {s['lane']}")
    if s.get("uptime") is not None:
        bits.append(f"up {format_duration(s['uptime'])}")
    if bits:
        head += " (" + ", ".join(bits) + ")"
    detail = str(s.get("detail") or "")
    if detail and detail not in (", ".join(bits[:n]) for n in range(1, len(bits) + 1)):
        head += f": {detail}"       # not when it only repeats the pid/lane in parentheses
    out = [head]
    if s.get("command"):
        out.append("  command: " + " ".join(s["command"])[:200])
    if s.get("tracking"):
        out.append(f"  tracking: {s['tracking'].get('detail') or s['tracking'].get('mode')}")
    ad = s.get("adoption")
    if isinstance(ad, dict) and ad.get("result"):      # what this daemon did with a previous one's engine
        out.append(f"  adoption: {ad['result']}: {str(ad.get('detail') or '')[:300]}")
    if s.get("gpu_bytes") is not None:
        out.append(f"  GPU memory (NVML): {format_size(s['gpu_bytes'])} over the engine's processes")
    if s.get("lanes"):
        out.append("  lanes: " + ", ".join(("*" if ln == s.get("lane") else "") + ln for ln in s["lanes"]))
    r = {k: v for k, v in (s.get("restarts") or {}).items() if v}
    out.append(f"  starts {s.get('starts', 0)}, ready {'yes' if s.get('ready') else 'no'}, restarts: " + (", ".join(f"{k} {v}" for k, v in r.items()) or "none")
               + f" (policy {s.get('restart_policy')})")
    if s.get("time_to_ready") is not None or s.get("quiesce_wait") is not None:
        out.append(f"  last start: quiesce wait {format_duration(s.get('quiesce_wait'))}"
                   + ((f" (the {(s.get('gate_timeout') or {}).get('gate', 'quiesce')} gate timed out, "
                       "started anyway)") if s.get("quiesce_timed_out") else "")
                   + f", time to ready {format_duration(s.get('time_to_ready'))}")
    for g in s.get("start_gates") or []:
        if g.get("gate") != "quiesce" or g.get("state") != "open":
            out.append(f"  start gate {g.get('gate')}: {g.get('state')}: {g.get('detail')}")
    if s.get("state") == "backoff" and (s.get("consecutive_failures") or 0) > 2:
        out.append(f"  crash loop: {s.get('consecutive_failures')} restarts in a row; the wait doubles each time "
                   f"up to engine.backoff_max (next start in {format_duration(s.get('backoff'))})")
    if s.get("failed_loads"):
        out.append(f"  failed loads: {s['failed_loads']} stopped by the memory guard while loading (engine.load_phase); "
                   "each counts towards engine.give_up_after")
    le = s.get("last_exit")
    if le:
        ago = time.time() - le["at"] if le.get("at") else None
        out.append(f"  last exit: {le.get('detail')}" + (f", {format_duration(ago)} ago" if ago is not None else ""))
    role = s.get("role") or {}
    if role.get("role") in ("head", "headless"):
        line = f"  TP cluster: {role['role']}, node rank {role.get('node_rank')} of {role.get('nnodes')} nodes"
        if role["role"] == "head" and s.get("group"):
            line += "; group: " + ", ".join(f"rank {k} run {v:.3f}" for k, v in sorted(s["group"].items()))
        elif role["role"] == "headless":
            line += (f"; in the group of head run {s['joined']:.3f}" if s.get("joined")
                     else "; waiting for head" if s.get("run_start") else "")
        out.append(line)
        for v in s.get("nodes") or []:
            what = (v.get("error") or f"{v.get('role')} rank {v.get('node_rank')}, {v.get('state')}"
                    + (f", run {v['run']:.3f}" if v.get("run") else ", no run")
                    + (", ready" if v.get("ready") else "") + ("" if v.get("wanted", True) else ", stopped on purpose"))
            out.append(f"  node {v.get('url')}: {what}")
    if s.get("state") == "given_up":
        out.append("  given up: `sparkguard engine start` tries again (engine.give_up_after, engine.give_up_window)")
    for p in s.get("peers") or []:
        out.append(f"  peer {p['url']}: " + ("ok" if p["ok"] else p.get("error") or "below the gate")
                   + (f", {p['available_bytes'] / 1024**3:.2f} GiB available" if p.get("available_bytes") is not None
                      else ""))
    return out


def cluster_line(ecfg) -> str | None:
    """For ``sparkguard check-config``: the node's place in a TP cluster and whether
    ``engine.peers`` can make the nodes recover as one (every other node listed), or None for a
    single-node engine.

    Returns e.g. ``"TP cluster: head, node rank 0 of 2 nodes; peers: 1 (the 1 other node)"``, or
    the same line ending in a warning naming what is missing."""
    role = cluster.role_of(ecfg.command)
    if not role.clustered:
        return None
    others = role.nnodes - 1
    line = (f"TP cluster: {role.role}, node rank {role.node_rank} of {role.nnodes} nodes; "
            f"peers: {len(ecfg.peers)}")
    if len(ecfg.peers) == others:
        return line + f" (the {others} other node{'s' if others != 1 else ''})"
    return line + (f"; WARNING: engine.peers should list the metrics URL of each of the {others} other "
                   "node(s): without them the nodes do not restart as one engine (README \"Several nodes\")")


def config_line(ecfg) -> str:
    """One line about a configured engine for ``sparkguard check-config``: command, lane, health
    URL and restart policy (with its backoff).

    Args:
        ecfg: ``config.EngineConfig`` with a command.
    Returns:
        e.g. ``"vllm serve m (lane 200k of 200k, 1m); health http://127.0.0.1:8000/health; restart always,
        backoff 1.0 s to 5.0 min"``.
    """
    lane = config_lane(ecfg)
    return (shlex.join(ecfg.command)[:200]
            + (f" (lane {lane} of {', '.join(ecfg.lanes)})" if lane else "")
            + f"; health {ecfg.health_url or 'none (ready once started)'}"
            + f"; restart {ecfg.restart}"
            + (f", backoff {format_duration(ecfg.backoff_initial)} to {format_duration(ecfg.backoff_max)}"
               if ecfg.restart != "never" else "")
            + _start_gate_words(ecfg))


def _start_gate_words(ecfg) -> str:
    """``"; memfree gate: 0.8 x MemTotal + 1.50 GiB, fragmentation wait"`` with
    ``engine.start_gate.memfree``, else "" (docs/start-gate.md)."""
    sg = getattr(ecfg, "start_gate", None)
    if sg is None or not sg.memfree:
        return ""
    util = "the command's --gpu-memory-utilization" if sg.utilization is None else f"{sg.utilization:g}"
    return f"; memfree gate: {util} x MemTotal + {format_size(sg.margin)}, fragmentation {sg.fragmentation}"

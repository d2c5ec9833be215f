"""The drill's report for people: the headline and the report lines."""

from __future__ import annotations

from sparkguard.drill.planning import signal_name
from sparkguard.units import format_duration, format_size


def headline(r: dict) -> str:
    """What the guard did, for the PASS line: ``"SIGTERM 0.4 ms after the crossing, tree gone
    95 ms later, memory back above the line"``, or with escalation ``"SIGTERM 0.4 ms after the
    crossing (ignored), SIGKILL 1.0 s after SIGTERM (the 1 s grace was over), tree gone, ..."``.

    Args:
        r: the report dict of :meth:`Drill.report` (seconds in ``crossing_to_sigterm_seconds``,
            ``sigkill_after_sigterm_seconds``, ``sigterm_to_exit_seconds``, ``grace_seconds``).
    """
    text = f"SIGTERM {r['crossing_to_sigterm_seconds'] * 1000:.1f} ms after the crossing"
    if r["escalated"]:
        after = r["sigkill_after_sigterm_seconds"]
        grace = r["grace_seconds"]
        why = (f"the {grace:g} s grace was over" if after is None or after >= grace - 0.05 else
               f"below the SIGKILL line, before the {grace:g} s grace was over")
        text += f" (ignored), SIGKILL {format_duration(after)} after SIGTERM ({why}), tree gone"
    else:
        gone = r["sigterm_to_exit_seconds"]
        text += ", tree gone" + ("" if gone is None else f" {format_duration(gone)} later")
    return text + ", memory back above the line"


def progress_bar(v: int, top: int, floor: int, line: int, width: int = 20) -> str:
    """``[#####|....]``: how far the signal has fallen from the start towards the floor; ``|`` is the line."""
    span = max(1, top - floor)
    fill = min(width, max(0, round((top - v) / span * width)))
    mark = min(width - 1, max(0, round((top - line) / span * width)))
    cells = ["#" if i < fill else "." for i in range(width)]
    cells[mark] = "|"
    return "[" + "".join(cells) + "]"

def format_report(r: dict) -> str:
    """The report for people (several lines)."""
    lines = [f"sparkguard drill: {r['result']} - {r['reason']}",
             f"  config            {r['config']} (signal {signal_name(r['signal'])}, grace {r['grace_seconds']:g}s)",
             f"  lines             temporary SIGTERM {format_size(r['term_below_bytes'])}"
             + (f", SIGKILL {format_size(r['kill_below_bytes'])}" if r["kill_below_bytes"] is not None else "")
             + f"; configured {format_size(r['configured_term_below_bytes'])} (untouched)",
             f"  fake engine       {r['model']}, fill {format_size(r['fill_size_bytes'])} at "
             + ("full speed" if r["fill_rate_bytes_per_second"] is None
                else format_size(r["fill_rate_bytes_per_second"]) + "/s")
             + (f", down to {format_size(r['floor_bytes'])} at most" if r.get("floor_bytes") is not None else "")
             + (", ignores SIGTERM" if r["ignore_term"] else ""),
             f"  memory            start {format_size(r['start_bytes'])}, lowest {format_size(r['min_bytes'])}, "
             f"overshoot past the line {format_size(r['overshoot_bytes'])}",
             f"  crossing->SIGTERM " + ("-" if r["crossing_to_sigterm_seconds"] is None else
                                        f"{r['crossing_to_sigterm_seconds'] * 1000:.1f} ms"),
             f"  SIGTERM->exit     " + (format_duration(r["sigterm_to_exit_seconds"])
                                        if r["sigterm_to_exit_seconds"] is not None
                                        or r["crossing_to_sigterm_seconds"] is None else "not measured (no exit seen)"),
             f"  escalation        " + (f"yes, SIGKILL {format_duration(r['sigkill_after_sigterm_seconds'])} after "
                                        f"SIGTERM (grace {r['grace_seconds']:g}s)" if r["escalated"] else "no"),
             f"  {'after ' + format(r['recover_seconds'], 'g') + 's':<18}" + _after(r),
             f"  incident          " + _incident_line(r),
             f"  left processes    {r['left_processes'] or 'none'}"]
    return "\n".join(lines)


def _after(r: dict) -> str:
    """The report's memory-after line: measured, or why not."""
    if r["after_bytes"] is None:
        why = ("the drill was interrupted" if r["interrupted"] else
               "the fake engine's tree was never gone" if not r.get("tree_gone") else
               "memory was not back above the line before the drill's timeout")
        return f"not measured ({why})"
    return (f"{format_size(r['after_bytes'])} (recovered {format_size(r['recovered_bytes'])}; "
            + ("above" if r["back_above_line"] else "NOT above") + " the line)")


def _incident_line(r: dict) -> str:
    if not r["incident_id"]:
        return f"none (store {r['incidents_dir']})"
    if r.get("incident_file"):
        return f"{r['incident_id']} (kind drill, saved as {r['incident_file']})"
    return (f"{r['incident_id']} (kind drill, NOT saved in {r['incidents_dir']}; "
            f"run with -v to see the reporter's error)")

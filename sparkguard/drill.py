"""``sparkguard drill``: a fire drill of the memory guard on the live host.

It starts a synthetic engine tree (the fake vLLM of :mod:`sparkguard.fake_engine`:
``vllm serve sparkguard-drill-<hex>`` -> ``VLLM::EngineCore`` -> ``VLLM::Worker_TP0/1``)
whose worker TP0 fills memory at a chosen rate, and runs the guard's own poll loop
(:class:`sparkguard.guard.loop.Guard`, in this process) with the running configuration,
changed in three places only:

* ``guard.term_below`` becomes a temporary line ``--margin`` (default 1 GiB) under the
  memory signal read now (MemAvailable, or MemAvailable+SwapFree with
  ``guard.signal: available+swap``); ``guard.kill_below``, if set, keeps its distance under
  it.  The drill refuses to run when the lowest point it may reach (line minus ``--past``)
  would be closer than 2 GiB to the configured line: it never goes near the real floor.
* ``targets.match`` becomes the escaped model name unique to this drill and ``fallback``
  off, so the guard cannot signal any process but the drill's own fake engine.
* ``metrics.listen`` is off (a running daemon keeps its port).

Grace, poll interval, signal kind, protection list, incident store and journal are the
configured ones.  The incident is reported through the configured reporter with
``kind: "drill"`` and ``drill: true``.  Progress (memory vs the line, the guard's state)
goes to stderr while it runs.  The report: crossing-to-SIGTERM latency, overshoot past
the line, SIGTERM-to-exit time, whether escalation (SIGKILL) happened, memory recovered
``--recover`` seconds after the tree was gone, and PASS or FAIL with the reason.

The fake tree is SIGKILLed and reaped on every path (normal end, error, timeout,
SIGINT/Ctrl-C, SIGTERM); the report lists any process of it still alive (none expected).
Exit status: 0 PASS, 1 FAIL, 2 refused (bad config, not enough headroom), 130 interrupted.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time

GiB = 1 << 30
SAFETY = 2 * GiB          # the drill's lowest point stays this far above the configured line
TERM_LATENCY_LIMIT = 0.5  # seconds from the guard's crossing to SIGTERM for a PASS


class DrillError(Exception):
    """The drill cannot run safely or at all (message says why and what to change)."""


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``drill``."""
    p = sub.add_parser("drill", help="fire drill: a fake engine fills memory past a temporary line; "
                                     "watch the guard act and get PASS/FAIL",
                       description="Start a fake vLLM tree that fills memory, put a temporary SIGTERM line "
                                   "--margin under the current MemAvailable, let the configured guard logic act "
                                   "on it (it can only signal the drill's own fake engine), and report.")
    p.add_argument("--config", "-c", metavar="PATH", help="config whose logic is drilled (default "
                   "/etc/sparkguard/sparkguard.yaml; embedded defaults when absent)")
    p.add_argument("--rate", default="1GiB/s", help="fill rate of the fake engine: 512MiB/s, 1GiB/s, max "
                   "(default 1GiB/s)")
    p.add_argument("--margin", default="1GiB", help="temporary line this far under the memory now (default 1GiB)")
    p.add_argument("--past", default=None, help="how far past the line the fake may fill before it stops "
                   "(default 0.5GiB; 1GiB with --ignore-term)")
    p.add_argument("--ignore-term", action="store_true", help="the fake ignores SIGTERM: drills the escalation "
                   "(SIGKILL of the whole tree after guard.grace)")
    p.add_argument("--recover", default="3s", help="measure memory this long after the tree is gone (default 3s)")
    p.add_argument("--timeout", default=None, help="give up after this long (default: fill time + grace + 30s)")
    p.add_argument("--json", action="store_true", help="print the report as JSON on stdout")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress lines")
    p.add_argument("--verbose", "-v", action="store_true", help="show the guard's own log lines")
    p.set_defaults(func=cmd_drill)


# ---------------------------------------------------------------------------- planning


def parse_rate(text: str) -> float | None:
    """``"1GiB/s"`` / ``"512MiB"`` -> bytes per second; ``"max"`` -> None.  Raises ValueError."""
    from sparkguard.units import parse_size
    t = str(text).strip()
    if t.lower() == "max":
        return None
    if t.lower().endswith("/s"):
        t = t[:-2]
    r = parse_size(t)
    if r <= 0:
        raise ValueError(f"rate must be positive, got {text!r}")
    return float(r)


def plan(cfg, value_now: int, margin: int, past: int) -> dict:
    """Where the temporary lines go.

    Args:
        cfg: ``config.Config`` being drilled.
        value_now: the memory signal now (bytes; MemAvailable or MemAvailable+SwapFree).
        margin: bytes between ``value_now`` and the temporary SIGTERM line.
        past: bytes the fake may fill past the line.
    Returns:
        dict with ``term_below``, ``kill_below`` (or None), ``fill_size``, ``floor`` (lowest
        expected signal), all bytes.
    Raises:
        DrillError: the floor would come closer than 2 GiB to the configured ``guard.term_below``.
    """
    from sparkguard.units import format_size
    g = cfg.guard
    if margin <= 0 or past <= 0:
        raise DrillError("--margin and --past must be greater than 0")
    line = value_now - margin
    floor = line - past
    if floor < g.term_below + SAFETY:
        raise DrillError(
            f"not enough headroom for a safe drill: {_signal_name(g.signal)} is {format_size(value_now)}; the drill "
            f"would take it to about {format_size(floor)}, closer than {format_size(SAFETY)} to the configured "
            f"SIGTERM line {format_size(g.term_below)} (guard.term_below in {cfg.path}). "
            f"Free some memory or lower --margin/--past.")
    kill = None if g.kill_below is None else line - (g.term_below - g.kill_below)
    return {"term_below": line, "kill_below": kill, "fill_size": margin + past, "floor": floor}


def _signal_name(sig: str) -> str:
    return "MemAvailable" if sig == "available" else "MemAvailable+SwapFree"


def read_signal(signal_kind: str) -> int:
    """The configured memory signal now, bytes (one read of /proc/meminfo)."""
    from sparkguard import meminfo
    r = meminfo.MeminfoReader()
    try:
        a, s = r.sample()
    finally:
        r.close()
    return a + s if signal_kind == "available+swap" else a


# ---------------------------------------------------------------------------- the guard


class _DrillReporter:
    """Wraps the configured reporter: marks every incident as a drill and keeps what the guard did."""

    def __init__(self, inner, sink: "Drill"):
        self.inner = inner
        self.sink = sink

    @staticmethod
    def _mark(incident: dict | None) -> None:
        if incident is not None:
            incident["kind"] = "drill"
            incident["drill"] = True

    def event(self, incident, event) -> None:
        self._mark(incident)
        self.sink.on_event(event)
        self.inner.event(incident, event)

    def finish(self, incident) -> None:
        self._mark(incident)
        if not str(incident.get("summary", "")).startswith("DRILL"):
            incident["summary"] = "DRILL: " + str(incident.get("summary", ""))
        self.sink.on_finish(incident)
        self.inner.finish(incident)

    def close(self, timeout: float = 5.0) -> None:
        self.inner.close(timeout)


def _make_guard(cfg, drill: "Drill"):
    from sparkguard.guard.loop import Guard

    class DrillGuard(Guard):
        """The daemon's Guard with the drill's reporter and a stop button for the controller thread."""

        def start(self) -> None:
            super().start()
            self.reporter = self.recorder.reporter = _DrillReporter(self.reporter, drill)

        def request_stop(self) -> None:
            self.stopping = True
            try:
                os.write(self._wake_w, b"\0")
            except OSError:
                pass

    return DrillGuard(cfg, config_arg=None)


# ---------------------------------------------------------------------------- the drill


class Drill:
    """One drill run: the fake engine, the guard, the controller, the report."""

    def __init__(self, args, cfg, p: dict, rate: float | None, recover: float, timeout: float, out=sys.stderr):
        self.args, self.cfg, self.plan = args, cfg, p
        self.rate, self.recover, self.timeout = rate, recover, timeout
        self.out = out
        self.events: list[dict] = []
        self.incident: dict | None = None
        self.lock = threading.Lock()
        self.min_value: int | None = None
        self.value_start = 0
        self.value_after: int | None = None
        self.gone_at: float | None = None
        self.fail: str | None = None
        self.finished = False
        self.interrupted = False
        self.pids: list[int] = []
        self.left: list[int] = []
        self.model = "sparkguard-drill-" + os.urandom(4).hex()
        self.engine = None
        self.guard = None
        self._stop = threading.Event()

    # reporter callbacks (poll-loop thread: must be cheap)
    def on_event(self, event: dict) -> None:
        with self.lock:
            self.events.append(dict(event))

    def on_finish(self, incident: dict) -> None:
        with self.lock:
            self.incident = incident

    def _say(self, msg: str) -> None:
        if not self.args.quiet:
            print(msg, file=self.out, flush=True)

    def run(self) -> dict:
        """Run the drill to the end; always cleans up.  Returns the report dict."""
        import re
        import signal
        from sparkguard import config, fake_engine
        g = self.cfg.guard
        p = self.plan
        dcfg = config.replace(
            self.cfg,
            guard=config.dataclasses.replace(g, term_below=p["term_below"], kill_below=p["kill_below"],
                                             dry_run=False),
            targets=config.dataclasses.replace(self.cfg.targets, match=(re.escape(self.model) + r"(\s|$)",),
                                               fallback="off"),
            metrics=config.dataclasses.replace(self.cfg.metrics, listen=None))
        prev_term = signal.signal(signal.SIGTERM, _raise_interrupt)
        ctl = None
        try:
            opts = ["--tp", "2", "--hold", "16MiB", "--hold-core", "8MiB", "--hold-api", "8MiB",
                    "--fill-size", str(p["fill_size"]), "--fill-rate", "max" if self.rate is None else str(int(self.rate)),
                    "--fill-on-signal"]
            if self.args.ignore_term:
                opts += ["--mode", "ignore-term"]
            self.engine = fake_engine.start(self.model, *opts)
            self.pids = self.engine.pids(timeout=60)
            self._say(f"drill: fake engine {self.model} up (pids {', '.join(map(str, self.pids))}); "
                      f"temporary SIGTERM line {_fs(p['term_below'])}"
                      + (f", SIGKILL line {_fs(p['kill_below'])}" if p["kill_below"] is not None else "")
                      + f", grace {g.grace:g}s; configured line {_fs(g.term_below)} untouched")
            self.guard = _make_guard(dcfg, self)
            self.guard.start()
            self.value_start = self.guard.value
            ctl = threading.Thread(target=self._control, name="drill-control", daemon=True)
            ctl.start()
            self.guard.loop()
            if not self.finished:
                self.interrupted = True
        except KeyboardInterrupt:
            self.interrupted = True
        except TimeoutError as e:
            self.fail = f"the fake engine did not come up: {str(e).splitlines()[0]}"
        finally:
            self._stop.set()
            if ctl is not None:
                ctl.join(10)
            self._cleanup()
            signal.signal(signal.SIGTERM, prev_term)
        return self.report()

    def _control(self) -> None:
        """Controller thread: start the fill, show progress, decide when the drill is over."""
        from sparkguard import meminfo
        p = self.plan
        reader = meminfo.MeminfoReader()
        sig = self.cfg.guard.signal
        tty = hasattr(self.out, "isatty") and self.out.isatty()
        start = time.monotonic()
        deadline = start + self.timeout
        next_line = 0.0
        try:
            self.engine.start_fill()
            while not self._stop.is_set():
                now = time.monotonic()
                a, s = reader.sample()
                v = a + s if sig == "available+swap" else a
                if self.min_value is None or v < self.min_value:
                    self.min_value = v
                state = self.guard.policy.state
                if self.gone_at is None and self._tree_gone():
                    self.gone_at = now
                if not self.args.quiet and (tty or now >= next_line):
                    bar = _bar(v, self.value_start, p["floor"], p["term_below"])
                    msg = (f"  {now - start:5.1f}s {_signal_name(sig)} {_fs(v):>10} line {_fs(p['term_below'])} "
                           f"{bar} guard {state}")
                    print(("\r" + msg + "   ") if tty else msg, end="" if tty else "\n", file=self.out, flush=True)
                    next_line = now + 1.0
                if self.gone_at is not None and now - self.gone_at >= self.recover and state == "ok":
                    self.value_after = v
                    break
                if now > deadline:
                    self.fail = f"timed out after {self.timeout:g}s (guard state {state})"
                    break
                self._stop.wait(0.1 if tty else 0.05)
        except Exception as e:  # noqa: BLE001 - any failure must still end the drill cleanly
            self.fail = f"drill controller failed: {e!r}"
        finally:
            reader.close()
            if tty and not self.args.quiet:
                print(file=self.out)
            self.finished = True
            if self.guard is not None:
                self.guard.request_stop()

    def _tree_gone(self) -> bool:
        for pid in self.pids:
            try:
                if not self.engine.exited(pid):
                    return False
            except KeyError:          # no pidfd (gone before the helper opened one)
                continue
        return bool(self.pids)

    def _cleanup(self) -> None:
        """SIGKILL and reap the whole fake tree (every path), then list survivors."""
        if self.engine is None:
            return
        try:
            self.engine.stop(timeout=10)
        finally:
            self.left = _survivors(self.model, self.pids)

    # ------------------------------------------------------------------------ report

    def report(self) -> dict:
        """The drill's findings (JSON-ready dict); ``result`` is PASS or FAIL."""
        p = self.plan
        g = self.cfg.guard
        ev: dict[str, dict] = {}
        for e in self.events:
            ev.setdefault(e["event"], e)
        inc = self.incident
        mins = [x for x in (self.min_value, inc and inc.get("min_available_bytes")) if x is not None]
        low = min(mins) if mins else None
        # every interval from the events' ``t`` (seconds since the crossing, one monotonic clock
        # in the guard's loop); ``at`` is wall time, taken a little later, and is not mixed in
        t_cross = ev.get("crossed", {}).get("t")
        t_term, t_exit, t_kill = (_since(ev.get(k), t_cross) for k in ("sigterm", "exited", "sigkill"))
        rep = {
            "result": "FAIL", "reason": "", "drill": True, "model": self.model, "config": self.cfg.path,
            "signal": g.signal, "ignore_term": bool(self.args.ignore_term),
            "fill_rate_bytes_per_second": self.rate, "fill_size_bytes": p["fill_size"],
            "start_bytes": self.value_start or None, "term_below_bytes": p["term_below"],
            "kill_below_bytes": p["kill_below"], "configured_term_below_bytes": g.term_below,
            "grace_seconds": g.grace, "min_bytes": low,
            "overshoot_bytes": (p["term_below"] - low) if low is not None and low < p["term_below"] else 0,
            "crossing_to_sigterm_seconds": t_term,
            "sigterm_to_exit_seconds": (t_exit - t_term) if t_exit is not None and t_term is not None else None,
            "escalated": t_kill is not None, "sigkill_after_sigterm_seconds":
                (t_kill - t_term) if t_kill is not None and t_term is not None else None,
            "recover_seconds": self.recover, "after_bytes": self.value_after,
            "recovered_bytes": (self.value_after - low) if self.value_after is not None and low is not None else None,
            # None: not measured (interrupted, timed out, or the tree never went away)
            "back_above_line": None if self.value_after is None else self.value_after >= p["term_below"],
            "timeline": self.events, "incident_id": inc.get("id") if inc else (
                self.events[0].get("incident") if self.events and "incident" in self.events[0] else None),
            "incident": _jsonable(inc), "incidents_dir": self.cfg.incidents.dir,
            "left_processes": self.left, "interrupted": self.interrupted, "tree_gone": self.gone_at is not None,
        }
        rep["incident_file"] = _saved_incident(self.cfg.incidents.dir, rep["incident_id"])
        rep["result"], rep["reason"] = self._verdict(rep, ev)
        return rep

    def _verdict(self, r: dict, ev: dict) -> tuple[str, str]:
        g = self.cfg.guard
        if self.left:
            return "FAIL", f"fake engine processes left alive: {self.left}"
        if self.interrupted:
            return "FAIL", "interrupted (the fake engine was removed)"
        if "crossed" not in ev:
            if self.fail and not self.fail.startswith("timed out"):
                return "FAIL", self.fail
            return "FAIL", ("memory never fell below the temporary line (did something else free memory? "
                            "try a larger --past)" + (f"; {self.fail}" if self.fail else ""))
        if "sigterm" not in ev:
            return "FAIL", ("the guard found no target" if "no_target" in ev else "the guard sent no SIGTERM")
        if r["crossing_to_sigterm_seconds"] > TERM_LATENCY_LIMIT:
            return "FAIL", (f"SIGTERM came {r['crossing_to_sigterm_seconds'] * 1000:.0f} ms after the crossing "
                            f"(limit {TERM_LATENCY_LIMIT * 1000:.0f} ms)")
        if self.args.ignore_term:
            if not r["escalated"]:
                return "FAIL", "the fake ignored SIGTERM and the guard never sent SIGKILL"
            if g.kill_below is None and r["sigkill_after_sigterm_seconds"] < g.grace - 0.05:
                return "FAIL", f"SIGKILL came before the grace period ({g.grace:g}s) was over"
        elif r["escalated"]:
            return "FAIL", "the fake should have exited at SIGTERM but the guard had to SIGKILL it"
        if "exited" not in ev:
            return "FAIL", self.fail or "the fake engine's tree did not exit"
        if self.fail:
            return "FAIL", self.fail
        if r["back_above_line"] is None:
            return "FAIL", f"memory was not measured {self.recover:g}s after the tree was gone"
        if not r["back_above_line"]:
            return "FAIL", (f"memory was still under the line {self.recover:g}s after the tree was gone "
                            f"({_fs(r['after_bytes'])} < {_fs(r['term_below_bytes'])})")
        return "PASS", headline(r)


def headline(r: dict) -> str:
    """What the guard did, for the PASS line: ``"SIGTERM 0.4 ms after the crossing, tree gone
    95 ms later, memory back above the line"``, or with escalation ``"SIGTERM 0.4 ms after the
    crossing (ignored), SIGKILL 1.0 s after SIGTERM (the 1 s grace was over), tree gone, ..."``.

    Args:
        r: the report dict of :meth:`Drill.report` (seconds in ``crossing_to_sigterm_seconds``,
            ``sigkill_after_sigterm_seconds``, ``sigterm_to_exit_seconds``, ``grace_seconds``).
    """
    from sparkguard.units import format_duration as fd
    text = f"SIGTERM {r['crossing_to_sigterm_seconds'] * 1000:.1f} ms after the crossing"
    if r["escalated"]:
        after = r["sigkill_after_sigterm_seconds"]
        grace = r["grace_seconds"]
        why = (f"the {grace:g} s grace was over" if after is None or after >= grace - 0.05 else
               f"below the SIGKILL line, before the {grace:g} s grace was over")
        text += f" (ignored), SIGKILL {fd(after)} after SIGTERM ({why}), tree gone"
    else:
        gone = r["sigterm_to_exit_seconds"]
        text += ", tree gone" + ("" if gone is None else f" {fd(gone)} later")
    return text + ", memory back above the line"


def _since(event: dict | None, t_cross: float | None) -> float | None:
    """Seconds from the crossing to ``event`` (both ``t`` values of the guard's timeline), or None."""
    if event is None or event.get("t") is None:
        return None
    return max(0.0, float(event["t"]) - float(t_cross or 0.0))


def _saved_incident(store: str, incident_id: str | None) -> str | None:
    """Path of the drill's incident file in the configured store, None when it is not there."""
    if not incident_id:
        return None
    from sparkguard import incidents
    if not incidents.valid_id(incident_id):
        return None
    path = incidents.IncidentStore(store).path_for(incident_id)
    return path if os.path.exists(path) else None


def _survivors(model: str, pids: list[int]) -> list[int]:
    """Live (not zombie) processes of the drill's tree: its pids still titled VLLM::*, or any
    process whose cmdline names the drill's model.  Zombies hold no memory and are not counted
    (in a container whose init reaps lazily they linger for a while)."""
    from sparkguard import proctree
    left = []
    for pid, pr in proctree.scan().items():
        if model in pr.cmdline or (pid in pids and pr.comm.startswith("VLLM::")):
            try:
                with open(f"/proc/{pid}/stat", "rb") as f:
                    state = f.read().rsplit(b") ", 1)[1][:1]
            except (OSError, IndexError):
                continue
            if state not in (b"Z", b"X"):
                left.append(pid)
    return sorted(left)


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def _fs(n) -> str:
    from sparkguard.units import format_size
    return format_size(n)


def _bar(v: int, top: int, floor: int, line: int, width: int = 20) -> str:
    """``[#####|....]``: how far the signal has fallen from the start towards the floor; ``|`` is the line."""
    span = max(1, top - floor)
    fill = min(width, max(0, round((top - v) / span * width)))
    mark = min(width - 1, max(0, round((top - line) / span * width)))
    cells = ["#" if i < fill else "." for i in range(width)]
    cells[mark] = "|"
    return "[" + "".join(cells) + "]"


def _jsonable(inc):
    if inc is None:
        return None
    import json
    return json.loads(json.dumps({k: v for k, v in inc.items() if not k.startswith("_")}, default=str))


def format_report(r: dict) -> str:
    """The report for people (several lines)."""
    from sparkguard.units import format_duration as fd
    lines = [f"sparkguard drill: {r['result']} - {r['reason']}",
             f"  config            {r['config']} (signal {_signal_name(r['signal'])}, grace {r['grace_seconds']:g}s)",
             f"  lines             temporary SIGTERM {_fs(r['term_below_bytes'])}"
             + (f", SIGKILL {_fs(r['kill_below_bytes'])}" if r["kill_below_bytes"] is not None else "")
             + f"; configured {_fs(r['configured_term_below_bytes'])} (untouched)",
             f"  fake engine       {r['model']}, fill {_fs(r['fill_size_bytes'])} at "
             + ("full speed" if r["fill_rate_bytes_per_second"] is None else _fs(r["fill_rate_bytes_per_second"]) + "/s")
             + (", ignores SIGTERM" if r["ignore_term"] else ""),
             f"  memory            start {_fs(r['start_bytes'])}, lowest {_fs(r['min_bytes'])}, "
             f"overshoot past the line {_fs(r['overshoot_bytes'])}",
             f"  crossing->SIGTERM " + ("-" if r["crossing_to_sigterm_seconds"] is None else
                                        f"{r['crossing_to_sigterm_seconds'] * 1000:.1f} ms"),
             f"  SIGTERM->exit     " + (fd(r["sigterm_to_exit_seconds"]) if r["sigterm_to_exit_seconds"] is not None
                                        or r["crossing_to_sigterm_seconds"] is None else "not measured (no exit seen)"),
             f"  escalation        " + (f"yes, SIGKILL {fd(r['sigkill_after_sigterm_seconds'])} after SIGTERM "
                                        f"(grace {r['grace_seconds']:g}s)" if r["escalated"] else "no"),
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
    return (f"{_fs(r['after_bytes'])} (recovered {_fs(r['recovered_bytes'])}; "
            + ("above" if r["back_above_line"] else "NOT above") + " the line)")


def _incident_line(r: dict) -> str:
    if not r["incident_id"]:
        return f"none (store {r['incidents_dir']})"
    if r.get("incident_file"):
        return f"{r['incident_id']} (kind drill, saved as {r['incident_file']})"
    return (f"{r['incident_id']} (kind drill, NOT saved in {r['incidents_dir']}; "
            f"run with -v to see the reporter's error)")


def cmd_drill(args: argparse.Namespace) -> int:
    """Run the drill; 0 PASS, 1 FAIL, 2 refused, 130 interrupted."""
    import json
    import logging
    from sparkguard import config
    from sparkguard.units import parse_duration, parse_size
    logging.basicConfig(level=logging.INFO if args.verbose else logging.ERROR,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)
    if not args.verbose:
        # the reporter logs every event of the drill's incident (SIGKILL at priority err): the
        # report says all of it, and whether the incident was saved; -v shows these lines
        logging.getLogger("sparkguard.reporter").setLevel(logging.CRITICAL + 1)
    try:
        cfg = config.load(args.config)
    except config.ConfigError as e:
        print(f"sparkguard drill: invalid config: {e}", file=sys.stderr)
        return 2
    try:
        rate = parse_rate(args.rate)
        margin = parse_size(args.margin)
        past = parse_size(args.past) if args.past is not None else (GiB if args.ignore_term else GiB // 2)
        recover = parse_duration(args.recover)
        p = plan(cfg, read_signal(cfg.guard.signal), margin, past)
        fill_time = p["fill_size"] / rate if rate else 10.0
        timeout = parse_duration(args.timeout) if args.timeout else fill_time + cfg.guard.grace + recover + 30
    except ValueError as e:
        print(f"sparkguard drill: bad option: {e}", file=sys.stderr)
        return 2
    except DrillError as e:
        print(f"sparkguard drill: refused: {e}", file=sys.stderr)
        return 2
    d = Drill(args, cfg, p, rate, recover, timeout)
    rep = d.run()
    if args.json:
        print(json.dumps(rep, indent=2, default=str))
    else:
        print(format_report(rep))
    if rep["interrupted"]:
        return 130
    return 0 if rep["result"] == "PASS" else 1

"""One drill run: the fake engine, the guard's own loop on it, the controller, the report."""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import threading
import time

from sparkguard import config, meminfo, proctree
from sparkguard.incidents.store import IncidentStore, valid_id
from sparkguard.drill import hog
from sparkguard.drill.planning import TERM_LATENCY_LIMIT, signal_name
from sparkguard.drill.report import headline, progress_bar
from sparkguard.guard.loop import Guard
from sparkguard.units import format_size


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
    class DrillGuard(Guard):
        """The daemon's Guard with the drill's reporter (its controller thread stops it with
        :meth:`Guard.request_stop`)."""

        def start(self) -> None:
            super().start()
            self.reporter = self.recorder.reporter = _DrillReporter(self.reporter, drill)

    return DrillGuard(cfg, config_arg=None)


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
        g = self.cfg.guard
        p = self.plan
        dcfg = config.replace(
            self.cfg,
            # blackbox off: the ring belongs to the daemon (a drill must neither take its lock nor
            # report and reset the daemon's last run as its own)
            guard=config.dataclasses.replace(g, term_below=p["term_below"], kill_below=p["kill_below"],
                                             dry_run=False, blackbox=False),
            targets=config.dataclasses.replace(self.cfg.targets, match=(re.escape(self.model) + r"(\s|$)",),
                                               fallback="off"),
            metrics=config.dataclasses.replace(self.cfg.metrics, listen=None))
        prev_term = signal.signal(signal.SIGTERM, _raise_interrupt)
        ctl = None
        try:
            opts = ["--tp", "2", "--hold", "16MiB", "--hold-core", "8MiB", "--hold-api", "8MiB",
                    "--fill-size", str(p["fill_cap"]), "--fill-to", str(p["floor"]),
                    "--fill-signal", g.signal, "--fill-rate", "max" if self.rate is None else str(int(self.rate))]
            if self.args.ignore_term:
                opts.append("--ignore-term")
            self.engine = hog.start(self.model, *opts)
            self.pids = self.engine.pids(timeout=60)
            self._say(f"drill: fake engine {self.model} up (pids {', '.join(map(str, self.pids))}); "
                      f"temporary SIGTERM line {format_size(p['term_below'])}"
                      + (f", SIGKILL line {format_size(p['kill_below'])}" if p["kill_below"] is not None else "")
                      + f", grace {g.grace:g}s; configured line {format_size(g.term_below)} untouched")
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
                v = meminfo.signal_bytes(sig, *reader.sample())
                if self.min_value is None or v < self.min_value:
                    self.min_value = v
                state = self.guard.policy.state
                if self.gone_at is None and self._tree_gone():
                    self.gone_at = now
                if not self.args.quiet and (tty or now >= next_line):
                    bar = progress_bar(v, self.value_start, p["floor"], p["term_below"])
                    msg = (f"  {now - start:5.1f}s {signal_name(sig)} {format_size(v):>10} "
                           f"line {format_size(p['term_below'])} {bar} guard {state}")
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
            "fill_rate_bytes_per_second": self.rate, "fill_size_bytes": p["fill_size"], "floor_bytes": p["floor"],
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
            return "FAIL", ("memory never fell below the temporary line (the fill stops after twice the planned "
                            "bytes: did other work free more than that meanwhile?)"
                            + (f"; {self.fail}" if self.fail else ""))
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
                            f"({format_size(r['after_bytes'])} < {format_size(r['term_below_bytes'])})")
        return "PASS", headline(r)


def _since(event: dict | None, t_cross: float | None) -> float | None:
    """Seconds from the crossing to ``event`` (both ``t`` values of the guard's timeline), or None."""
    if event is None or event.get("t") is None:
        return None
    return max(0.0, float(event["t"]) - float(t_cross or 0.0))


def _saved_incident(store: str, incident_id: str | None) -> str | None:
    """Path of the drill's incident file in the configured store, None when it is not there."""
    if not incident_id:
        return None
    if not valid_id(incident_id):
        return None
    path = IncidentStore(store).path_for(incident_id)
    return path if os.path.exists(path) else None


def _survivors(model: str, pids: list[int]) -> list[int]:
    """Live (not zombie) processes of the drill's tree: its pids still titled VLLM::*, or any
    process whose cmdline names the drill's model.  Zombies hold no memory and are not counted
    (in a container whose init reaps lazily they linger for a while)."""
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

def _jsonable(inc):
    if inc is None:
        return None
    return json.loads(json.dumps({k: v for k, v in inc.items() if not k.startswith("_")}, default=str))

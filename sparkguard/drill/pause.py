"""``sparkguard drill --pause``: a fire drill of the soft line: pause at the line, memory back, resume.

The drill's engine is the drill's own tree (:mod:`sparkguard.drill.hog`, titled like vLLM's; the
hard line could only ever signal it) with an API that answers like vLLM's dev-mode pause router
(:class:`Endpoint`, a thread of this process on 127.0.0.1: ``POST /pause``, ``POST /resume``,
``GET /is_paused``, the same paths, answers and status codes, docs/soft-line.md).  The work the
engine would stop admitting is a separate process (:data:`_WORK`) that fills memory at ``--rate``;
the endpoint ends it when the engine is paused, so its memory comes back.  That stands for the
requests a pause keeps out; a real vLLM's preallocated KV cache does not shrink when it is paused
(docs/soft-line.md says what a pause can and cannot give back).

The guard's own loop (:class:`sparkguard.guard.loop.Guard`, in this process) runs with the
configured settings changed in these places only: ``guard.pause_below`` becomes a temporary soft
line ``--margin`` under the signal read now and ``guard.term_below`` a temporary hard line
``--past`` under that (the work fills the signal down to a quarter of the way from the soft line
to the hard one and no further, so the hard line is reached only when something else takes that
much memory meanwhile); ``guard.pause_url`` is the endpoint; ``targets.match`` is the drill's
model alone; no ``engine:`` is supervised and ``metrics.listen`` is off.  Hysteresis, resume
delay, pause mode and timeout, poll interval and signal kind are the configured ones.  The
pause incident is reported through the configured reporter with ``drill: true``.

PASS: the engine was paused below the soft line, memory came back, the engine was resumed after
the configured hysteresis and delay, and no signal was sent.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

from sparkguard import config, meminfo
from sparkguard.drill import hog
from sparkguard.drill.planning import FILL_CAP, GiB, SAFETY, DrillError, parse_rate, read_signal, refused, signal_name
from sparkguard.drill.run import _DrillReporter, _make_guard, _raise_interrupt, _survivors
from sparkguard.incidents.store import IncidentStore, valid_id
from sparkguard.units import format_size, parse_duration, parse_size

#: the work process: the drill tree's fill (:class:`sparkguard.drill.hog.Fill`) at argv[2] bytes/s
#: (0: at once) until the memory signal (argv[4], guard.signal) is at or below argv[3] bytes, argv[1]
#: bytes at most; it says "started", then holds its memory until stdin closes and exits (its memory
#: back), its fill's log lines to /dev/null
_WORK = """\
import os, select, sys, time
from sparkguard.drill.hog import Fill, Memory
from sparkguard.drill.plumbing import Log
size, rate, level, signal = int(sys.argv[1]), float(sys.argv[2]) or None, int(sys.argv[3]), sys.argv[4]
fill = Fill(Memory(), rate, size, Log(), "work", level, signal)
print("started", flush=True)
os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
fill.begin(time.monotonic())
while fill.active:
    if select.select([sys.stdin], [], [], max(0.0, fill.next_due(time.monotonic())))[0]:
        sys.exit(0)
    fill.step(time.monotonic())
sys.stdin.read()
"""


class Endpoint:
    """The drill engine's pause API on 127.0.0.1 (a port the kernel picks), answering like vLLM's.

    ``on_pause`` is called (from the HTTP thread) on each ``POST /pause``.  Attributes: ``url``;
    ``paused`` bool; ``pauses``/``resumes``: lists of ``(monotonic s, mode)`` / monotonic s.
    """

    def __init__(self, on_pause):
        self.paused = False
        self.pauses: list[tuple[float, str]] = []
        self.resumes: list[float] = []
        ep = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, fmt, *args):
                pass

            def _json(self, code: int, obj) -> None:
                body = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):  # noqa: N802 - http.server naming
                if urlsplit(self.path).path == "/is_paused":
                    self._json(200, {"is_paused": ep.paused})
                else:
                    self._json(404, {"detail": "Not Found"})

            def do_POST(self):  # noqa: N802
                u = urlsplit(self.path)
                if u.path == "/pause":
                    mode = (parse_qs(u.query).get("mode") or ["abort"])[-1]
                    ep.paused = True
                    ep.pauses.append((time.monotonic(), mode))
                    on_pause()
                    self._json(200, {"status": "paused"})
                elif u.path == "/resume":
                    ep.paused = False
                    ep.resumes.append(time.monotonic())
                    self._json(200, {"status": "resumed"})
                else:
                    self._json(404, {"detail": "Not Found"})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.5},
                                        name="drill-pause-api", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def plan(cfg, value_now: int, margin: int, past: int) -> dict:
    """Where the pause drill's temporary lines go.

    Args:
        cfg: ``config.Config`` being drilled; value_now: the signal now, bytes; margin: bytes from
            it down to the temporary soft line; past: bytes from the soft line down to the hard line.
    Returns:
        dict: ``pause_below``, ``term_below``, ``fill_size`` (the work: from the signal now a
        quarter of the way between the lines), ``floor`` (the level the work stops at: the lowest
        it takes the signal), ``fill_cap`` (the most it may take, as in
        :func:`sparkguard.drill.planning.plan`), bytes.
    Raises:
        DrillError: the hysteresis does not fit under the signal now, or the hard line would come
            within 2 GiB of the configured one.
    """
    g = cfg.guard
    if margin <= 0 or past <= 0:
        raise DrillError("--margin and --past must be greater than 0")
    if g.pause_hysteresis >= margin:
        raise DrillError(f"--margin ({format_size(margin)}) must be larger than guard.pause_hysteresis "
                         f"({format_size(g.pause_hysteresis)}): memory could never come back above the resume line")
    pause_below = value_now - margin
    term_below = pause_below - past
    if term_below < g.term_below + SAFETY:
        raise DrillError(f"not enough headroom for a safe drill: {signal_name(g.signal)} is "
                         f"{format_size(value_now)}; the temporary SIGTERM line {format_size(term_below)} would be "
                         f"closer than {format_size(SAFETY)} to the configured one {format_size(g.term_below)}. "
                         "Free some memory or lower --margin/--past.")
    return {"pause_below": pause_below, "term_below": term_below, "fill_size": margin + past // 4,
            "floor": pause_below - past // 4, "fill_cap": FILL_CAP * (margin + past // 4)}


class _Sink:
    """Keeps the incidents the drill's guard finished (the reporter's ``finish`` calls it)."""

    def __init__(self):
        self.finished: list[dict] = []

    def on_event(self, event) -> None:
        pass

    def on_finish(self, incident) -> None:
        self.finished.append(incident)


def _reporter(inner, sink: _Sink):
    """The normal drill's reporter wrapper, marking incidents ``drill: true`` but keeping their kind."""

    class _Reporter(_DrillReporter):
        @staticmethod
        def _mark(incident: dict | None) -> None:
            if incident is not None:
                incident["drill"] = True

    return _Reporter(inner, sink)


def command(args, cfg) -> int:
    """``sparkguard drill --pause`` after the config was read: options, plan, run, report; the exit
    status is the drill's (0 PASS, 1 FAIL, 2 refused, 130 interrupted)."""
    try:
        rate = parse_rate(args.rate)
        margin = parse_size(args.margin)
        past = parse_size(args.past) if args.past is not None else GiB
        p = plan(cfg, read_signal(cfg.guard.signal), margin, past)
        fill_time = p["fill_cap"] / rate if rate else 10.0
        timeout = (parse_duration(args.timeout) if args.timeout else
                   fill_time + cfg.guard.pause_timeout + cfg.guard.resume_after + 30)
    except (ValueError, DrillError) as e:
        return refused(e)
    rep = run(args, cfg, p, rate, timeout)
    print(json.dumps(rep, indent=2, default=str) if args.json else format_report(rep))
    if rep["interrupted"]:
        return 130
    return 0 if rep["result"] == "PASS" else 1


def run(args, cfg, p: dict, rate: float | None, timeout: float, out=sys.stderr) -> dict:
    """Run the pause drill to its end; always removes the drill's tree and work.  Returns the report.

    The guard's loop runs in this (the main) thread, as in the normal drill; a controller thread
    starts the work, shows progress and stops the guard once the pause incident is closed or
    ``timeout`` seconds have passed."""
    model = "sparkguard-drill-" + os.urandom(4).hex()
    sink = _Sink()
    finished = sink.finished
    work = {"proc": None}

    def end_work():
        proc = work["proc"]
        if proc is not None and proc.poll() is None and not proc.stdin.closed:
            proc.stdin.close()          # it exits; its memory comes back

    ep = Endpoint(end_work)
    g = cfg.guard
    dcfg = config.replace(
        cfg, guard=config.dataclasses.replace(g, term_below=p["term_below"], kill_below=None,
                                              pause_below=p["pause_below"], pause_url=ep.url, dry_run=False),
        targets=config.dataclasses.replace(cfg.targets, match=(model + r"(\s|$)",), fallback="off"),
        metrics=config.dataclasses.replace(cfg.metrics, listen=None), engine=config.EngineConfig())
    rep = {"result": "FAIL", "reason": "", "drill": True, "mode": "pause", "model": model, "config": cfg.path,
           "signal": g.signal, "pause_below_bytes": p["pause_below"], "term_below_bytes": p["term_below"],
           "configured_term_below_bytes": g.term_below, "fill_size_bytes": p["fill_size"],
           "floor_bytes": p["floor"],
           "fill_rate_bytes_per_second": rate, "hysteresis_bytes": g.pause_hysteresis,
           "resume_after_seconds": g.resume_after, "pause_mode": g.pause_mode, "interrupted": False,
           "start_bytes": None, "min_bytes": None}
    engine = guard = ctl = None
    pids: list[int] = []
    stop = threading.Event()
    prev_term = signal.signal(signal.SIGTERM, _raise_interrupt)

    def control():
        start = time.monotonic()
        reader = meminfo.MeminfoReader()
        next_line = 0.0
        try:
            work["proc"] = subprocess.Popen([sys.executable, "-c", _WORK, str(p["fill_cap"]), str(rate or 0),
                                             str(p["floor"]), g.signal],
                                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            work["proc"].stdout.readline()
            while not stop.is_set() and not finished:
                v = meminfo.signal_bytes(g.signal, *reader.sample())
                rep["min_bytes"] = v if rep["min_bytes"] is None else min(rep["min_bytes"], v)
                now = time.monotonic()
                if not args.quiet and now >= next_line:
                    print(f"  {now - start:5.1f}s {signal_name(g.signal)} {format_size(v):>10} soft line "
                          f"{format_size(p['pause_below'])} engine {'PAUSED' if ep.paused else 'running'}",
                          file=out, flush=True)
                    next_line = now + 1.0
                if now - start > timeout:
                    rep["reason"] = f"timed out after {timeout:g}s (engine {'paused' if ep.paused else 'not paused'})"
                    break
                stop.wait(0.05)
        except Exception as e:  # noqa: BLE001 - any failure must still end the drill cleanly
            rep["reason"] = f"drill controller failed: {e!r}"
        finally:
            reader.close()
            rep["done"] = True
            guard.request_stop()

    try:
        engine = hog.start(model, "--tp", "2", "--hold", "16MiB", "--hold-core", "8MiB", "--hold-api", "8MiB")
        pids = engine.pids(timeout=60)
        guard = _make_guard(dcfg, None)
        guard.start()
        # the normal drill's wrapper marks incidents kind "drill"; this one keeps the kind "pause"
        guard.reporter = guard.recorder.reporter = _reporter(guard.reporter.inner, sink)
        rep["start_bytes"] = guard.value
        if not args.quiet:
            print(f"drill: fake engine {model} up (pids {', '.join(map(str, pids))}), pause API {ep.url}; "
                  f"temporary soft line {format_size(p['pause_below'])}, SIGTERM line {format_size(p['term_below'])}; "
                  f"configured line {format_size(g.term_below)} untouched", file=out, flush=True)
        ctl = threading.Thread(target=control, name="drill-control", daemon=True)
        ctl.start()
        guard.loop()
        if not rep.get("done"):
            rep["interrupted"] = True
    except KeyboardInterrupt:
        rep["interrupted"] = True
    except TimeoutError as e:
        rep["reason"] = f"the fake engine did not come up: {str(e).splitlines()[0]}"
    finally:
        stop.set()
        if ctl is not None:
            ctl.join(10)
        end_work()
        if work["proc"] is not None:
            try:
                work["proc"].wait(10)
            except subprocess.TimeoutExpired:
                work["proc"].kill()
                work["proc"].wait(10)
        ep.close()
        left = []
        if engine is not None:
            try:
                engine.stop(timeout=10)
            finally:
                left = _survivors(model, pids)
        rep["left_processes"] = left
        signal.signal(signal.SIGTERM, prev_term)
    inc = next((i for i in finished if i.get("kind") == "pause"), None)
    return _verdict(rep, inc, ep, guard, cfg)


def _verdict(rep: dict, inc: dict | None, ep: Endpoint, guard, cfg) -> dict:
    """Fill in what was measured and PASS or FAIL with the reason."""
    rep.pop("done", None)
    tl = {e["event"]: e for e in (inc or {}).get("timeline", [])}
    sent = dict(guard.actions.signals_sent) if guard is not None else {}
    rep.update({
        "incident_id": inc.get("id") if inc else None, "incident": inc,
        "timeline": (inc or {}).get("timeline", []), "outcome": inc.get("outcome") if inc else None,
        "crossing_to_paused_seconds": tl["paused"]["t"] if "paused" in tl else None,
        "paused_to_resumed_seconds": (tl["resumed"]["t"] - tl["paused"]["t"])
        if "paused" in tl and "resumed" in tl else None,
        "resume_bytes": tl["resume_sent"]["available_bytes"] if "resume_sent" in tl else None,
        "pauses": len(ep.pauses), "resumes": len(ep.resumes), "signals_sent": sent,
        "incidents_dir": cfg.incidents.dir,
    })
    iid = rep["incident_id"]
    path = IncidentStore(cfg.incidents.dir).path_for(iid) if iid and valid_id(iid) else None
    rep["incident_file"] = path if path and os.path.exists(path) else None
    if rep["left_processes"]:
        rep["result"], rep["reason"] = "FAIL", f"fake engine processes left alive: {rep['left_processes']}"
    elif rep["interrupted"]:
        rep["reason"] = "interrupted (the fake engine was removed)"
    elif any(sent.values()):
        rep["reason"] = f"the guard sent signals ({sent}): the hard line was reached"
    elif inc is None:
        rep["reason"] = rep["reason"] or "no pause incident: memory never fell below the soft line?"
    elif inc.get("outcome") != "resumed":
        rep["reason"] = ((rep["reason"] + "; ") if rep["reason"] else "") + \
            f"the pause incident ended {inc.get('outcome')}: {inc.get('summary')}"
    elif not ep.pauses or not ep.resumes:
        rep["reason"] = "the engine's API saw no pause or no resume"
    elif rep["resume_bytes"] is None or rep["resume_bytes"] < rep["pause_below_bytes"] + rep["hysteresis_bytes"]:
        rep["reason"] = "resumed before memory was above the soft line plus its hysteresis"
    else:
        rep["result"] = "PASS"
        rep["reason"] = (f"engine paused {rep['crossing_to_paused_seconds'] * 1000:.1f} ms after the soft line, "
                         f"memory back, resumed {rep['paused_to_resumed_seconds']:.1f} s later "
                         f"(above the line + {format_size(rep['hysteresis_bytes'])} for "
                         f"{rep['resume_after_seconds']:g} s), no signal sent")
    return rep


def format_report(r: dict) -> str:
    """The pause drill's report for people (several lines)."""
    lines = [f"sparkguard drill --pause: {r['result']} - {r['reason']}",
             f"  config            {r['config']} (signal {signal_name(r['signal'])}, mode {r['pause_mode']})",
             f"  lines             temporary soft line {format_size(r['pause_below_bytes'])} (+"
             f"{format_size(r['hysteresis_bytes'])} for {r['resume_after_seconds']:g}s to resume), temporary SIGTERM "
             f"{format_size(r['term_below_bytes'])}; configured {format_size(r['configured_term_below_bytes'])} "
             "(untouched)",
             f"  work              {format_size(r['fill_size_bytes'])} at "
             + ("full speed" if not r["fill_rate_bytes_per_second"] else
                format_size(r["fill_rate_bytes_per_second"]) + "/s")
             + (f", down to {format_size(r['floor_bytes'])} at most" if r.get("floor_bytes") is not None else "")
             + ", ended by the pause",
             f"  memory            start {format_size(r.get('start_bytes'))}, lowest {format_size(r['min_bytes'])}",
             "  soft line->paused " + ("-" if r["crossing_to_paused_seconds"] is None
                                       else f"{r['crossing_to_paused_seconds'] * 1000:.1f} ms"),
             "  paused->resumed   " + ("-" if r["paused_to_resumed_seconds"] is None
                                       else f"{r['paused_to_resumed_seconds']:.2f} s"),
             f"  engine API        {r['pauses']} pause(s), {r['resumes']} resume(s); signals "
             + (", ".join(f"{k} {v}" for k, v in r["signals_sent"].items() if v) or "none sent"),
             "  incident          " + (f"{r['incident_id']} (kind pause, drill, "
                                       + (f"saved as {r['incident_file']})" if r["incident_file"]
                                          else f"NOT saved in {r['incidents_dir']})")
                                       if r["incident_id"] else "none"),
             f"  left processes    {r['left_processes'] or 'none'}"]
    return "\n".join(lines)

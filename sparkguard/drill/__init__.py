"""``sparkguard drill``: a fire drill of the memory guard on the live host.

It starts a synthetic engine tree (:mod:`sparkguard.drill.hog`, shaped and titled like vLLM's:
``vllm serve sparkguard-drill-<hex>`` -> ``VLLM::EngineCore`` -> ``VLLM::Worker_TP0/1``)
whose worker TP0 fills memory at a chosen rate down to a planned level of the memory signal
(``--past`` under the temporary line; memory that other work frees or takes meanwhile moves
how much it fills, not how low it goes), and runs the guard's own poll loop
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

``--pause`` drills the soft line instead (:mod:`sparkguard.drill.pause`): the drill's engine is
paused at a temporary ``guard.pause_below``, memory comes back, it is resumed; no signal is sent.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys


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
    p.add_argument("--past", default=None, help="the fake fills until the memory signal is this far under the line, "
                   "whatever other work frees or takes meanwhile (default 0.5GiB; 1GiB with --ignore-term)")
    p.add_argument("--ignore-term", action="store_true", help="the fake ignores SIGTERM: drills the escalation "
                   "(SIGKILL of the whole tree after guard.grace)")
    p.add_argument("--recover", default="3s", help="measure memory this long after the tree is gone (default 3s)")
    p.add_argument("--timeout", default=None, help="give up after this long (default: fill time + grace + 30s)")
    p.add_argument("--pause", action="store_true", help="drill the soft line: the fake engine is paused at a "
                   "temporary guard.pause_below (--margin under the memory now; the SIGTERM line --past under it), "
                   "memory comes back, it is resumed (docs/soft-line.md)")
    p.add_argument("--json", action="store_true", help="print the report as JSON on stdout")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress lines")
    p.add_argument("--verbose", "-v", action="store_true", help="show the guard's own log lines")
    p.set_defaults(func=cmd_drill)


def cmd_drill(args: argparse.Namespace) -> int:
    """Run the drill; 0 PASS, 1 FAIL, 2 refused, 130 interrupted."""
    from sparkguard import config
    from sparkguard.drill.planning import GiB, DrillError, parse_rate, plan, read_signal, refused
    from sparkguard.drill.report import format_report
    from sparkguard.drill.run import Drill
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
    if args.pause:
        from sparkguard.drill import pause
        return pause.command(args, cfg)
    try:
        rate = parse_rate(args.rate)
        margin = parse_size(args.margin)
        past = parse_size(args.past) if args.past is not None else (GiB if args.ignore_term else GiB // 2)
        recover = parse_duration(args.recover)
        p = plan(cfg, read_signal(cfg.guard.signal), margin, past)
        fill_time = p["fill_cap"] / rate if rate else 10.0
        timeout = parse_duration(args.timeout) if args.timeout else fill_time + cfg.guard.grace + recover + 30
    except (ValueError, DrillError) as e:
        return refused(e)
    d = Drill(args, cfg, p, rate, recover, timeout)
    rep = d.run()
    if args.json:
        print(json.dumps(rep, indent=2, default=str))
    else:
        print(format_report(rep))
    if rep["interrupted"]:
        return 130
    return 0 if rep["result"] == "PASS" else 1


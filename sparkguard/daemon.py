"""``sparkguard run`` and ``sparkguard check-config``: the command-line glue of the guard daemon.

The daemon itself is :class:`sparkguard.guard.loop.Guard` (the poll loop and its state); what a
config must satisfy beyond ``config.load`` is :func:`sparkguard.guard.settings.prepare`.
:mod:`sparkguard.cli` imports this module only when ``run`` or ``check-config`` is chosen.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys

from sparkguard import config
from sparkguard.host import procview
from sparkguard.guard import logq, settings
from sparkguard.guard.loop import Guard
from sparkguard.cluster.checkconfig import derivation_lines
from sparkguard.supervisor import handover
from sparkguard.supervisor.render import cluster_line, config_line
from sparkguard.units import format_duration, format_size

log = logging.getLogger("sparkguard")


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``run`` and ``check-config``."""
    p = sub.add_parser("run", help="run the guard daemon (systemd Type=notify)",
                       description="Poll MemAvailable and SIGTERM the inference engine below the line; "
                                   "SIGKILL its whole tree after the grace period.")
    p.add_argument("--config", "-c", metavar="PATH", help="YAML config (default /etc/sparkguard/sparkguard.yaml; "
                   "embedded defaults when that file is absent)")
    p.add_argument("--dry-run", action="store_true", help="decide and report everything, signal nothing")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="log verbosity on stderr (default info)")
    # tests point the reader at a file they control (README "Tests"); not for production
    p.add_argument("--meminfo", default="/proc/meminfo", help=argparse.SUPPRESS)
    p.set_defaults(func=cmd_run)
    c = sub.add_parser("check-config", help="validate a config file and print the effective settings",
                       description="Validate a sparkguard config (every error names the file, key and value) "
                                   "and print the effective settings. Exit 0 if valid, 1 if not.")
    c.add_argument("path", nargs="?", help="file to check (default /etc/sparkguard/sparkguard.yaml)")
    c.add_argument("--config", "-c", dest="config_opt", metavar="PATH", help="the same as PATH")
    c.set_defaults(func=cmd_check_config)


def cmd_check_config(args: argparse.Namespace) -> int:
    """Validate a config; exit 0 if valid, 1 with the error (file, key, value) otherwise."""
    path = args.config_opt or args.path
    try:
        cfg = config.load(path, required=path is not None)
        settings.prepare(cfg)
    except config.ConfigError as e:
        print(f"sparkguard: invalid config: {e}", file=sys.stderr)
        return 1
    g = cfg.guard
    print(f"{cfg.path}: OK")
    print(f"  guard: poll every {format_duration(g.poll_interval)}, SIGTERM below {format_size(g.term_below)} "
          f"of {'MemAvailable' if g.signal == 'available' else 'MemAvailable+SwapFree'}, "
          f"SIGKILL after {format_duration(g.grace)}"
          + (f" or below {format_size(g.kill_below)}" if g.kill_below is not None else "")
          + (" [dry run]" if g.dry_run else ""))
    print(f"  targets: {len(cfg.targets.match)} patterns, {len(cfg.targets.protect)} protected, "
          f"fallback {cfg.targets.fallback}")
    m = cfg.metrics.listen
    print(f"  metrics: {'http://%s:%d/metrics' % m if m else 'off'}")
    print(f"  incidents: {cfg.incidents.dir}, journal {cfg.incidents.journal}")
    links = cfg.link.interfaces
    print(f"  link watch: {', '.join(links) + f' (incident after {format_duration(cfg.link.down_after)} down)' if links else 'off'}")
    if cfg.engine.enabled:
        print(f"  engine: {config_line(cfg.engine)}")
        tp = cluster_line(cfg.engine)
        if tp:
            print(f"  {tp}")
    for line in derivation_lines(cfg):
        print(f"  {line}")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    """Run the daemon until SIGTERM/SIGINT; exit 2 on a bad config or a /proc it cannot use."""
    logq.setup_logging(args.log_level)
    handover.take_unit_note()       # no handover note outlives a start (ExecStopPost trusts none it did not write)
    view: dict = {}
    why = procview.hidepid_blocks_view(view)
    if why:
        print(f"sparkguard: not starting: {why}", file=sys.stderr)
        return 2
    log.info("sees %d processes in /proc, %d of other users (%d readable)%s", view["processes"],
             view["other_users"], view["other_users_readable"],
             f", /proc hidepid={view['hidepid']}" if view["hidepid"] else "")
    try:
        cfg = config.load(args.config)
        settings.prepare(cfg)
    except config.ConfigError as e:
        print(f"sparkguard: invalid config, not starting: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        cfg = config.replace(cfg, guard=dataclasses.replace(cfg.guard, dry_run=True))
    guard = Guard(cfg, config_arg=args.config, force_dry_run=args.dry_run, meminfo_path=args.meminfo)
    guard.proc_view = view
    try:
        guard.start()
    except (OSError, RuntimeError) as e:   # MeminfoError is a RuntimeError
        print(f"sparkguard: not starting: {e}", file=sys.stderr)
        return 2
    return guard.loop()

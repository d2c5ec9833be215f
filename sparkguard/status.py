"""``sparkguard status``: one screen a person reads.

Memory and headroom above the lines, the thresholds, which processes would be signalled,
swap and zram, memory pressure (PSI), the running daemon's state as read from its
metrics endpoint (``metrics.listen`` of the configuration, or ``--url``), and its supervised
engine as read from its control socket (``engine.control_socket``, or ``--socket``).  Everything but
the daemon's state is read here and now from /proc and /sys, so the command is useful
also when the daemon is not running.

``--url`` naming another host's endpoint (:func:`is_local_url` false) shows only what that
endpoint reports (its memory, lines, state, engine): this host's /proc, targets, swap and control
socket say nothing about that node (issue 14), and the local configuration is not read.

This module is the command (its arguments and handler); the rest is one concern each: where to
ask (:mod:`sparkguard.status_url`), the daemon's metrics (:mod:`sparkguard.status_daemon`),
reading everything now (:mod:`sparkguard.status_gather`) and the pure screen
(:mod:`sparkguard.status_render`).
"""

from __future__ import annotations

import argparse
import json
import sys

from sparkguard import config
from sparkguard.status_daemon import read_daemon
from sparkguard.status_gather import gather, gather_remote
from sparkguard.status_render import render, render_remote
from sparkguard.status_url import is_local_url, is_loopback_url, metrics_url, same_host


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``sparkguard status [--config PATH] [--url URL] [--json]``."""
    p = subparsers.add_parser(
        "status", help="memory, headroom, targets, swap/zram, PSI and the daemon's state",
        description="Show memory and headroom above the guard's lines, the thresholds, matched "
                    "targets, swap and zram, memory pressure, and the running daemon's state "
                    "(scraped from its metrics endpoint).")
    p.add_argument("--config", metavar="PATH", default=None,
                   help="configuration file (default /etc/sparkguard/sparkguard.yaml; embedded "
                        "defaults when absent)")
    p.add_argument("--url", metavar="URL", default=None,
                   help="the daemon's metrics URL (default: http://<metrics.listen>/metrics); another "
                        "host's URL shows only what that endpoint reports")
    p.add_argument("--socket", metavar="PATH", default=None,
                   help="the daemon's engine control socket (default: $SPARKGUARD_CONTROL_SOCKET, else "
                        "engine.control_socket of the configuration)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead")
    p.set_defaults(func=handler)


def handler(args: argparse.Namespace) -> int:
    """Run ``sparkguard status``: 0 normally, 2 when the configuration is invalid (it is not read
    for another host's ``--url``)."""
    remote = bool(args.url) and not is_local_url(args.url)
    if args.url and not remote and is_loopback_url(args.url):
        # a loopback URL is this host's only if the endpoint says it runs here (a tunnel's is not)
        remote = not same_host(read_daemon(args.url, local=False))
    if remote:
        st, show = gather_remote(args.url), render_remote
    else:
        try:
            cfg = config.load(args.config)
        except config.ConfigError as e:
            print(f"sparkguard status: {e}", file=sys.stderr)
            return 2
        st, show = gather(cfg, args.url or metrics_url(cfg.metrics.listen), args.socket), render
    if args.json:
        json.dump(st, sys.stdout, indent=2, sort_keys=True)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(show(st))
    return 0

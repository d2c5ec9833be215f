"""The ``sparkguard`` command line.

Each sub-command lives in its own module which exposes ``register(subparsers)``; that
function adds its parser(s) and sets ``func=handler`` where ``handler(args) -> int`` is
the exit status.  Modules must keep their top-level imports light (argparse, stdlib):
``sparkguard run`` imports all of them and the daemon's RSS is budgeted.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys

from sparkguard import __version__

#: modules that provide sub-commands, in help order
COMMAND_MODULES = [
    "sparkguard.daemon",        # run, check-config
    "sparkguard.status",        # status
    "sparkguard.incidents",     # incidents
    "sparkguard.host.cli",      # install, uninstall, install-zram, tune, doctor
    "sparkguard.control",       # engine status|start|stop|restart|lane
    "sparkguard.drill",         # drill
]


def build_parser() -> argparse.ArgumentParser:
    """Return the top-level parser with every available sub-command registered."""
    parser = argparse.ArgumentParser(
        prog="sparkguard",
        description="Memory-safety daemon for unified-memory GPU inference boxes (DGX Spark).",
    )
    parser.add_argument("--version", action="version", version=f"sparkguard {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            if importlib.util.find_spec(name) is None:
                continue
        except ModuleNotFoundError:  # its parent package is absent from this build
            continue
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``sparkguard`` script; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())

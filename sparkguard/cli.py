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
    "sparkguard.reload",        # reload
    "sparkguard.status",        # status
    "sparkguard.incidents",     # incidents
    "sparkguard.host.cli",      # install, uninstall, install-zram, tune, doctor
    "sparkguard.control",       # engine status|start|stop|restart|lane
    "sparkguard.drill",         # drill
]


class SubCommandParser(argparse.ArgumentParser):
    """A sub-command's parser that reports options it does not know itself, with its own usage.

    Plain argparse hands a sub-parser's unknown arguments back to the top-level parser, which
    then prints ``usage: sparkguard [-h] [--version] COMMAND ...``: no help for the command the
    user was typing.  A close match is suggested (``--forec`` -> ``--force``).
    """

    def parse_known_args(self, args=None, namespace=None):
        ns, extras = super().parse_known_args(args, namespace)
        if extras:
            import difflib

            known = [o for a in self._actions for o in a.option_strings]
            hints = []
            for x in extras:
                close = difflib.get_close_matches(x.split("=", 1)[0], known, n=1, cutoff=0.6)
                if x.startswith("-") and close:
                    hints.append(f"{x}: did you mean {close[0]}?")
            self.error("unrecognized arguments: " + " ".join(extras) + ("\n" + "\n".join(hints) if hints else ""))
        return ns, extras


def build_parser() -> argparse.ArgumentParser:
    """Return the top-level parser with every available sub-command registered."""
    parser = argparse.ArgumentParser(
        prog="sparkguard",
        description="Memory-safety daemon for unified-memory GPU inference boxes (DGX Spark).",
    )
    parser.add_argument("--version", action="version", version=f"sparkguard {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=SubCommandParser)
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

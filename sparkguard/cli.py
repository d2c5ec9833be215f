"""The ``sparkguard`` command line: the command table, and the import of the chosen command's module.

Each sub-command lives in a module which exposes ``register(subparsers)``; that function adds
its parser(s) and sets ``func=handler`` where ``handler(args) -> int`` is the exit status.
Only the module of the command given on the command line is imported (``sparkguard status``
does not load the daemon); the top-level help and an unknown command import them all, to list
every command.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import sys

from sparkguard import __version__

#: command -> the module that registers it, in help order (a module may register several)
COMMANDS = {
    "run": "sparkguard.daemon",
    "check-config": "sparkguard.daemon",
    "reload": "sparkguard.reload",
    "status": "sparkguard.status",
    "incidents": "sparkguard.incidents",
    "install": "sparkguard.host.cli",
    "uninstall": "sparkguard.host.cli",
    "install-zram": "sparkguard.host.cli",
    "tune": "sparkguard.host.cli",
    "doctor": "sparkguard.host.cli",
    "engine": "sparkguard.control",      # engine status|start|stop|restart|lane
    "stop-post": "sparkguard.supervisor.handover",   # the unit's ExecStopPost
    "orphan-check": "sparkguard.supervisor.handover",   # armed by stop-post after a crash
    "drill": "sparkguard.drill",
    "cluster": "sparkguard.cluster.cli",  # cluster status|incidents|lane|stop|start|restart
    "completion": "sparkguard.docgen",    # completion bash|zsh (shtab)
    "man": "sparkguard.docgen",           # the man page sparkguard(8) (argparse-manpage)
}
#: modules that provide sub-commands, in help order
COMMAND_MODULES = list(dict.fromkeys(COMMANDS.values()))


class SubCommandParser(argparse.ArgumentParser):
    """A sub-command's parser that reports options it does not know itself, with its own usage.

    Plain argparse hands a sub-parser's unknown arguments back to the top-level parser, which
    then prints ``usage: sparkguard [-h] [--version] COMMAND ...``: no help for the command the
    user was typing.  A close match is suggested (``--forec`` -> ``--force``).
    """

    def parse_known_args(self, args=None, namespace=None):
        ns, extras = super().parse_known_args(args, namespace)
        if extras:
            known = [o for a in self._actions for o in a.option_strings]
            hints = []
            for x in extras:
                close = difflib.get_close_matches(x.split("=", 1)[0], known, n=1, cutoff=0.6)
                if x.startswith("-") and close:
                    hints.append(f"{x}: did you mean {close[0]}?")
            self.error("unrecognized arguments: " + " ".join(extras) + ("\n" + "\n".join(hints) if hints else ""))
        return ns, extras


def chosen_modules(argv: list[str] | None) -> list[str]:
    """The command modules to import for ``argv`` (the arguments after ``sparkguard``).

    Returns:
        the one module of the command when ``argv`` starts with a known command, else (no
        argv, an option such as ``--help`` first, an unknown command) every command module.
    """
    if argv and argv[0] in COMMANDS:
        return [COMMANDS[argv[0]]]
    return COMMAND_MODULES


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """Return the top-level parser with the sub-commands :func:`chosen_modules` names for
    ``argv`` registered (None: every one)."""
    parser = argparse.ArgumentParser(
        prog="sparkguard",
        description="Memory-safety daemon for unified-memory GPU inference boxes (DGX Spark).",
    )
    parser.add_argument("--version", action="version", version=f"sparkguard {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=SubCommandParser)
    for name in chosen_modules(argv):
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``sparkguard`` script; returns the exit status."""
    if argv is None:
        argv = sys.argv[1:]
    parser = build_parser(argv)
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

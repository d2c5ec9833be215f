"""The man page sparkguard(8) and the bash/zsh completion, generated from the argparse parser.

Both are made from :func:`sparkguard.cli.build_parser` with every command registered, by
libraries that read an ``argparse.ArgumentParser``, so that the options are written once (in the
command modules) and never copied into a second document:

* the man page by argparse-manpage (PyPI ``argparse-manpage``; Debian ``python3-argparse-manpage``:
  1.2.2 in Debian 12, whose module is ``build_manpages.manpage``, 4.5 in Debian 13, whose module is
  ``argparse_manpage.manpage``: both are used through their ``Manpage(parser)`` class, whose
  ``str()`` is the roff text).  Section 8 (system administration commands, man-pages(7)
  "Sections of the manual pages"): the 1.x class always writes ``.TH prog "1"``, the 4.x class
  takes the section as its ``section`` attribute (argparse-manpage's manpage.py recommends
  setting attributes over its private ``_data``); :func:`manpage` sets the title line itself so
  that both give the same header.  The date is ``SOURCE_DATE_EPOCH``'s (reproducible builds;
  dpkg-buildpackage sets it from debian/changelog) and empty without it, so that the page does
  not change from one day to the next.
* the completion by shtab (PyPI ``shtab``; Debian ``python3-shtab``: 1.5.5 in Debian 12, 1.7.1 in
  Debian 13), ``shtab.complete(parser, shell)``.

Both libraries are optional (pyproject extra ``man``); without them the commands fail with a
clear message saying what to install (:class:`ToolMissing`).
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import sys

from sparkguard import __version__
from sparkguard.cli import build_parser

SHELLS = ("bash", "zsh")
#: the one-line summary of NAME (what ``whatis sparkguard`` prints)
SUMMARY = "memory guard for unified-memory GPU inference boxes (DGX Spark)"
MANUAL = "System Administration"
SEE_ALSO = ("systemctl(1), journalctl(1), systemd.service(5), sysctl.d(5); "
            "/usr/share/doc/sparkguard/ (Debian) or the README of the source tree")


class ToolMissing(RuntimeError):
    """The library that generates the page or the completion is not installed (message: how to get it)."""


def _parser() -> argparse.ArgumentParser:
    return build_parser(None)


def _date() -> str:
    """``YYYY-MM-DD`` of SOURCE_DATE_EPOCH (https://reproducible-builds.org/specs/source-date-epoch/), or ""."""
    epoch = os.environ.get("SOURCE_DATE_EPOCH", "")
    if not epoch.isdigit():
        return ""
    return datetime.datetime.fromtimestamp(int(epoch), datetime.timezone.utc).strftime("%Y-%m-%d")


def manpage() -> str:
    """The roff text of sparkguard(8).

    Raises:
        ToolMissing: argparse-manpage is not installed.
    """
    parser = _parser()
    parser.man_short_description = SUMMARY  # read by argparse-manpage 1.x for NAME
    try:
        from argparse_manpage.manpage import Manpage  # argparse-manpage >= 2 (Debian 13: 4.5)
    except ImportError:
        try:
            from build_manpages.manpage import Manpage  # argparse-manpage 1.x (Debian 12: 1.2.2)
        except ImportError:
            raise ToolMissing("argparse-manpage is not installed: pip install 'sparkguard[man]' "
                              "(Debian/Ubuntu: apt-get install python3-argparse-manpage)") from None
    page = Manpage(parser)
    for attr, value in (("section", 8), ("manual", MANUAL), ("date", _date()),
                        ("source", f"sparkguard {__version__}"), ("description", SUMMARY)):
        if hasattr(page, attr):
            setattr(page, attr, value)
    text = str(page)
    header = f'.TH SPARKGUARD "8" "{_date()}" "sparkguard {__version__}" "{MANUAL}"'
    text, n = re.subn(r"^\.TH .*$", lambda m: header, text, count=1, flags=re.M)
    if n != 1:
        raise RuntimeError("argparse-manpage wrote no .TH line: a version this module does not know")
    if ".SH SEE ALSO" not in text:
        text = text.rstrip("\n") + "\n.SH SEE ALSO\n" + SEE_ALSO + "\n"
    return text


def completion(shell: str) -> str:
    """The ``shell`` (``bash`` or ``zsh``) completion script for ``sparkguard``.

    Raises:
        ToolMissing: shtab is not installed.
        ValueError: ``shell`` is not one of :data:`SHELLS`.
    """
    if shell not in SHELLS:
        raise ValueError(f"shell {shell!r}: expected one of {', '.join(SHELLS)}")
    try:
        import shtab
    except ImportError:
        raise ToolMissing("shtab is not installed: pip install 'sparkguard[man]' "
                          "(Debian/Ubuntu: apt-get install python3-shtab)") from None
    return shtab.complete(_parser(), shell=shell)


def _run(func, *args) -> int:
    try:
        sys.stdout.write(func(*args))
    except ToolMissing as e:
        print(f"sparkguard: error: {e}", file=sys.stderr)
        return 1
    return 0


def register(sub) -> None:
    """Add ``sparkguard completion SHELL`` and ``sparkguard man`` to ``sub`` (argparse subparsers)."""
    p = sub.add_parser("completion", help="print the bash or zsh completion script",
                       description="Print the completion script for SHELL, generated from this command line "
                       "by shtab. bash: save it as /usr/local/share/bash-completion/completions/sparkguard "
                       "(the .deb installs it in /usr/share/bash-completion/completions/).")
    p.add_argument("shell", choices=SHELLS, metavar="SHELL", help="bash or zsh")
    p.set_defaults(func=lambda args: _run(completion, args.shell))

    p = sub.add_parser("man", help="print the manual page sparkguard(8) (roff)",
                       description="Print sparkguard(8), generated from this command line by argparse-manpage "
                       "(`sparkguard man | man -l -` reads it).")
    p.set_defaults(func=lambda args: _run(manpage))

"""Whether this pyroute2 can run the TP link watch, and why not: one answer for the guard, status and doctor.

The watch (:mod:`sparkguard.linkwatch`) reads netlink events through ``pyroute2.AsyncIPRoute``,
which pyroute2 has since 0.9 (pyroute2 changelog, 0.9.1: the asyncio core; pyproject.toml asks for
``pyroute2>=0.9.1``).  Debian 12 ships python3-pyroute2 0.7.2 and Ubuntu 24.04 0.7.11, which have no
``AsyncIPRoute``: there the guard runs without the watch (it says so once in the journal) and
``sparkguard status`` / ``sparkguard doctor`` say the watch is unavailable and why, and still read
the links once through 0.7's synchronous ``IPRoute`` (``linkwatch.read_links``; 0.7's messages
are read by their ``IFLA_`` attribute names: ``linkstate.link_field``).

Importing pyroute2 costs several MiB of RSS; :func:`unavailable_reason` is called only where
``link.interfaces`` is set (the guard's start, status, doctor).
"""

from __future__ import annotations

import importlib
from importlib import metadata
from types import ModuleType

#: what to do about it, said with the reason
FIX = ("install pyroute2 >= 0.9.1 where sparkguard runs (a venv: pip install 'pyroute2>=0.9.1'; "
       "README \"Install\")")


def _version(module: ModuleType | None) -> str:
    try:
        return metadata.version("pyroute2")
    except metadata.PackageNotFoundError:
        return str(getattr(module, "__version__", "unknown"))


def unavailable_reason(module: ModuleType | None = None) -> str | None:
    """None when the link watch can run here, else why not (one sentence, without the fix).

    Args:
        module: the pyroute2 module to look at (default: import it).
    """
    if module is None:
        try:
            module = importlib.import_module("pyroute2")
        except ImportError as e:
            return f"pyroute2 cannot be imported ({e})"
    try:
        getattr(module, "AsyncIPRoute")
    except (AttributeError, ImportError):
        return f"pyroute2 {_version(module)} has no AsyncIPRoute (the link watch needs pyroute2 >= 0.9.1)"
    return None

"""Waiting on an event that has no file descriptor to wait on: a bounded poll of a probe."""

from __future__ import annotations

import time


def wait_for(what: str, probe, timeout: float, interval: float = 0.1):
    """Call ``probe()`` until it returns something truthy; return that.  Bounded by ``timeout`` s,
    ``interval`` s between calls (a probe that runs a command in a VM or container costs more).

    Raises AssertionError naming ``what`` and the last value seen.
    """
    deadline = time.monotonic() + timeout
    last = None
    while True:
        last = probe()
        if last:
            return last
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}; last: {last!r}")
        time.sleep(interval)

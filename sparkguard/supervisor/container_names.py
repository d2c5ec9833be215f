"""Container names for the guard's titles: asked off the poll loop, a failed answer retried with a bounded backoff.

The guard's scan (:func:`sparkguard.supervisor.container.widen`) names a matched engine's
container in its title; the name comes from ``RUNTIME container inspect``, which may take seconds
or fail (dockerd busy, restarting, deep in reclaim).  :class:`NameCache` is the decision part:
a clock and the asking function are injected (the tests run it on a fake clock with a synchronous
"thread").  Its promises: a caller never waits for the CLI; one question per id is in flight at a
time; a failed question (no answer, no such container, no name) is asked again after
:data:`RETRY_FIRST` seconds, doubling to at most :data:`RETRY_MAX` (assumption: a dockerd that
is down comes back within minutes, and one question a minute per container costs nothing); at
most :data:`MAX_ENTRIES` ids are kept (a host that runs thousands of containers, one matched at a time).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable

RETRY_FIRST = 2.0        #: seconds before a failed lookup is asked again
RETRY_MAX = 60.0         #: the backoff's ceiling, seconds
MAX_ENTRIES = 256        #: ids kept at most (the oldest-asked is dropped first)


@dataclass
class Entry:
    """What is known of one id.  name: str | None; asking: a question is in flight;
    failures: consecutive failed answers; retry_at: monotonic s before which none is asked again."""

    name: str | None = None
    asking: bool = False
    failures: int = 0
    retry_at: float = 0.0
    asked_at: float = 0.0


def _thread(fn: Callable[[], None]) -> None:
    threading.Thread(target=fn, name="sg-ctr-name", daemon=True).start()


class NameCache:
    """Names of containers by id.

    Args:
        ask: ``(runtime, id) -> str | None``, the name (None: no answer); may block for seconds.
        clock: monotonic seconds.  spawn: runs a function off the caller's thread (a daemon thread).
    """

    def __init__(self, ask: Callable[[str, str], str | None], clock: Callable[[], float] = time.monotonic,
                 spawn: Callable[[Callable[[], None]], None] = _thread):
        self.ask, self.clock, self.spawn = ask, clock, spawn
        self.entries: dict[str, Entry] = {}
        self.lock = threading.Lock()

    def get(self, runtime: str, cid: str) -> str | None:
        """The name of ``cid`` if known; else None, after starting a question (through ``spawn``)
        when none is in flight and the backoff allows one.  Never waits for the answer."""
        now = self.clock()
        with self.lock:
            e = self.entries.get(cid)
            if e is not None and (e.name is not None or e.asking or now < e.retry_at):
                return e.name
            if e is None:
                if len(self.entries) >= MAX_ENTRIES:
                    oldest = min(self.entries, key=lambda k: self.entries[k].asked_at)
                    del self.entries[oldest]
                e = self.entries[cid] = Entry()
            e.asking, e.asked_at = True, now

        def question() -> None:
            try:
                name = self.ask(runtime, cid)
            except Exception:  # noqa: BLE001 - a failed question is a failed answer, retried later
                name = None
            with self.lock:
                e.asking = False
                if name:
                    e.name, e.failures = name, 0
                else:
                    e.failures += 1
                    e.retry_at = self.clock() + min(RETRY_MAX, RETRY_FIRST * 2 ** (e.failures - 1))
        self.spawn(question)
        return e.name

    def known(self, prefix: str) -> str | None:
        """The name of a known id that starts with ``prefix`` (a 12-digit short id), else None."""
        with self.lock:
            return next((e.name for cid, e in self.entries.items() if cid.startswith(prefix) and e.name), None)

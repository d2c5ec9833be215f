"""The gates before every engine start: guard hold, drop caches, quiesce, peers.

1. **hold**: no start while a guard incident is open (memory below the SIGTERM line) or the
   TP link is down.
2. ``sync`` + drop the page cache (``engine.drop_caches``): vLLM's start-up check on unified
   memory counts page cache as used ("Free memory on device ... less than desired GPU memory
   utilization", FIELD-NOTES).
3. **quiesce**: MemAvailable >= ``engine.start_above`` and stable (within ``stable_band``) for
   ``stable_for`` seconds, because memory stranded by a kill comes back only after a while.
4. **peers**: every ``engine.peers`` reports MemAvailable >= ``start_above`` (:mod:`sparkguard.peers`).
5. **cluster order** (a head or headless rank of a TP cluster with ``engine.peers``,
   :mod:`.cluster`): a headless rank waits until the head has no run and wants one; the head
   waits until every other rank runs and waits for a head.  No time limit: a rank started out
   of order joins a stale rendezvous and never serves (FIELD-NOTES, the multi-Spark recipes).

Past ``engine.quiesce_timeout`` (steps 2-4, counted from the end of the hold: a guard incident
that stays open must not use up the time memory gets to come back) the engine starts anyway, and
the result says which gate timed out and why.  :class:`StartGates` takes its clock, MemAvailable reader, peers reader
and waits from the caller, so the whole sequence runs on a fake clock in tests.
"""

from __future__ import annotations

import collections
import logging
import os
import time
from dataclasses import dataclass
from typing import Callable, Protocol

from sparkguard import meminfo, peers
from sparkguard.supervisor import cluster, nodes
from sparkguard.units import format_size

log = logging.getLogger("sparkguard.supervisor")

MEM_SAMPLE = 0.25        # seconds between MemAvailable samples in the quiesce gate
PEER_EVERY = 1.0         # seconds between peer reads in the peers gate
HOLD_EVERY = 1.0         # seconds between re-checks of a hold (the hook's wake-up comes first)


class QuiesceGate:
    """MemAvailable at or above a floor and stable for a while.

    Args:
        start_above: int bytes; samples below it restart the wait.
        stable_for: float seconds the samples must stay at/above the floor and within ``band``.
        band: int bytes; max - min of the window; a larger swing (memory still coming back, or
            going away) restarts the window from the samples that fit.
    """

    def __init__(self, start_above: int, stable_for: float, band: int):
        self.start_above, self.stable_for, self.band = start_above, stable_for, band
        self.window: collections.deque[tuple[float, int]] = collections.deque()

    def feed(self, now: float, avail: int) -> bool:
        """Add a sample (monotonic seconds, bytes); True once the gate is open."""
        w = self.window
        if avail < self.start_above:
            w.clear()
            return False
        w.append((now, avail))
        while len(w) > 1 and (max(v for _, v in w) - min(v for _, v in w) > self.band):
            w.popleft()
        while len(w) > 2 and now - w[1][0] >= self.stable_for:
            w.popleft()
        return now - w[0][0] >= self.stable_for


def read_mem_available(path: str = "/proc/meminfo") -> int:
    """MemAvailable in bytes, read by :func:`sparkguard.meminfo.field` (Documentation/filesystems/proc.rst).

    Raises:
        OSError: the file cannot be read; ValueError: no MemAvailable line, or an unparsable one.
    """
    with open(path, "rb") as f:
        avail = meminfo.field(f.read(), meminfo.AVAIL_LABEL)
    if avail is None:
        raise ValueError("no MemAvailable in /proc/meminfo")
    return avail


def drop_caches() -> str:
    """``sync`` then ``echo 3 > /proc/sys/vm/drop_caches`` (Documentation/admin-guide/sysctl/vm.rst).

    Returns a one-line result ("dropped" or why not); never raises.
    """
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "dropped"
    except OSError as e:
        return f"not dropped: {e.strerror or e}"


class GateHooks(Protocol):
    """What the gates need from the supervisor (all called from the supervisor thread)."""

    def held(self) -> str | None:
        """Why starts are held now (guard incident open, link down), None when not held."""

    def interrupted(self) -> bool:
        """True when the start was called off (stop, lane, restart command, shutdown)."""

    def wait(self, seconds: float, until: Callable[[], bool]) -> bool:
        """Wait up to ``seconds`` (waking early on news); True if ``until()`` became true."""

    def show(self, detail: str) -> None:
        """The supervisor's state is ``waiting`` with this detail."""

    def note(self, event: str, detail: str) -> None:
        """Record a history entry (``drop_caches``, ``waiting``, ``quiesced``, ``quiesce_timeout``,
        ``peers_timeout``)."""

    def peers_seen(self, states: list[dict]) -> None:
        """The peers' last readings (``peers.PeerState.as_dict()`` each)."""

    def nodes_seen(self, views: list) -> None:
        """The other nodes' last readings (``cluster.NodeView`` each), by the cluster order gate."""


@dataclass
class GateResult:
    """How the gates were passed.

    Attributes:
        waited: float seconds from the end of the hold (drop caches, quiesce, peers) to the start.
        timed_out: None when every gate opened, else the gate that was still closed at
            ``engine.quiesce_timeout``: ``"quiesce"`` or ``"peers"``.
        detail: str, what that gate was waiting for when it timed out ("" when none did).
        views: the other nodes as the cluster order gate last read them (``cluster.NodeView``;
            empty without that gate): a head's group is the ranks it saw waiting.
    """

    waited: float
    timed_out: str | None = None
    detail: str = ""
    views: tuple = ()


class StartGates:
    """Run the gates once before a start (see the module doc).

    Args:
        ecfg: ``config.EngineConfig`` (``drop_caches``, ``start_above``, ``stable_for``,
            ``stable_band``, ``quiesce_timeout``, ``peers``, ``health_interval``).
        hooks: :class:`GateHooks`.
        clock: monotonic seconds.
        read_mem: MemAvailable in bytes (raises OSError/ValueError: logged, counted as 0).
        check_peers: ``(urls, gate_bytes, timeout) -> list[peers.PeerState]``.
        drop: the page-cache drop, returning a one-line result.
        role: ``cluster.Role`` of the command about to start (the order gate runs for a head or
            headless rank with ``engine.peers``).
        read_nodes: ``(urls, timeout) -> list[cluster.NodeView]``.
    """

    def __init__(self, ecfg, hooks: GateHooks, clock: Callable[[], float] = time.monotonic,
                 read_mem: Callable[[], int] = read_mem_available, check_peers=peers.check,
                 drop: Callable[[], str] = drop_caches, role: cluster.Role = cluster.Role(),
                 read_nodes=nodes.read_all):
        self.e, self.hooks, self.clock = ecfg, hooks, clock
        self.read_mem, self.check_peers, self.drop = read_mem, check_peers, drop
        self.role, self.read_nodes = role, read_nodes

    def run(self) -> GateResult | None:
        """Pass the gates.  Returns None when interrupted (stop, lane, quit), else the result.

        A guard incident that opens during the quiesce wait starts the whole sequence over."""
        while True:
            r = self._once()
            if r is not _AGAIN:
                return r

    def _once(self):
        e, h = self.e, self.hooks
        held = None
        while (why := h.held()) is not None:
            if why != held:
                held = why
                h.note("waiting", why)
            h.show(why)
            h.wait(HOLD_EVERY, lambda: h.interrupted() or h.held() is None)
            if h.interrupted():
                return None
        t0 = self.clock()                 # the hold has no time limit and does not eat the timeout
        deadline = t0 + e.quiesce_timeout
        if e.drop_caches:
            h.show("sync and drop caches")
            h.note("drop_caches", self.drop())
        timed_out, detail = self._quiesce(deadline)
        if timed_out in (None, _AGAIN):
            return timed_out
        if e.peers and not timed_out:
            timed_out, detail = self._peers(deadline)
            if timed_out is None:
                return None
        views: tuple = ()
        if self.role.clustered and e.peers:
            views = self._order()
            if views is None or views is _AGAIN:
                return views
        waited = self.clock() - t0
        if timed_out:
            h.note(f"{timed_out}_timeout", f"starting anyway after {waited:.1f} s: {detail}")
            log.warning("engine: %s gate not met after %.0f s (engine.quiesce_timeout); starting anyway: %s",
                        timed_out, waited, detail)
            return GateResult(waited, timed_out, detail, views)
        h.note("quiesced", f"gates met after {waited:.2f} s")
        return GateResult(waited, views=views)

    def _order(self) -> tuple | None:
        """The cluster order gate (step 5): the views it passed on, None when interrupted,
        ``_AGAIN`` when a hold (guard incident, link down) came meanwhile: the gates start over."""
        e, h, role = self.e, self.hooks, self.role
        announced = None
        while True:
            views = self.read_nodes(e.peers, min(3.0, max(0.5, e.health_interval)))
            h.nodes_seen(views)
            if role.role == "head":
                ok, why = cluster.head_start_gate(role, views)
            else:
                ok, why = cluster.head_may_start_rank(cluster.find_head(views))
            if ok:
                if announced is not None:
                    h.note("cluster", f"{role.role} rank {role.node_rank} may start: "
                                      + ("every rank waits for a head" if role.role == "head" else "the head has no run"))
                return tuple(views)
            detail = f"cluster order: {why}"
            h.show(detail)
            if why != announced:
                announced = why
                h.note("waiting", detail)
            if h.wait(PEER_EVERY, h.interrupted):
                return None
            if h.held() is not None:
                return _AGAIN

    def _quiesce(self, deadline: float):
        """Returns ``("", "")`` open, ``("quiesce", detail)`` timed out, ``(None, ...)`` interrupted,
        ``(_AGAIN, ...)`` a guard hold came back."""
        e, h = self.e, self.hooks
        gate = QuiesceGate(e.start_above, e.stable_for, e.stable_band)
        announced = False
        while True:
            now = self.clock()
            try:
                avail = self.read_mem()
            except (OSError, ValueError) as ex:
                log.error("reading MemAvailable failed: %s", ex)
                avail = 0
            if gate.feed(now, avail):
                return "", ""
            detail = (f"quiesce: MemAvailable {format_size(avail)}, need >= {format_size(e.start_above)} "
                      f"stable for {e.stable_for:g} s")
            if now >= deadline:
                return "quiesce", detail
            h.show(detail)
            if not announced:
                announced = True
                h.note("waiting", f"{detail}; starting anyway after {e.quiesce_timeout:g} s")
            if h.wait(min(MEM_SAMPLE, deadline - now), h.interrupted):
                return None, ""
            if h.held() is not None:
                return (_AGAIN if not h.interrupted() else None), ""

    def _peers(self, deadline: float):
        """Returns ``("", "")`` all ok, ``("peers", detail)`` timed out, ``(None, "")`` interrupted."""
        e, h = self.e, self.hooks
        announced = False
        while True:
            states = self.check_peers(e.peers, e.start_above, timeout=min(3.0, max(0.5, e.health_interval)))
            h.peers_seen([s.as_dict() for s in states])
            if all(s.ok for s in states):
                return "", ""
            now = self.clock()
            waiting = "; ".join(f"{s.url}: " + (s.error or f"{format_size(s.available_bytes)} available")
                                for s in states if not s.ok)
            detail = f"peers: {waiting}; need >= {format_size(e.start_above)} each"
            if now >= deadline:
                return "peers", detail
            h.show(detail)
            if not announced:
                announced = True
                h.note("waiting", detail)
            if h.wait(min(PEER_EVERY, deadline - now), h.interrupted):
                return None, ""


_AGAIN = object()

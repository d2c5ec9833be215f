"""The gates before every engine start: guard hold, drop caches, compaction, quiesce, MemFree, peers.

1. **hold**: no start while a guard incident is open (memory below the SIGTERM line) or the
   TP link is down.
2. ``sync`` + drop the page cache (``engine.drop_caches``): vLLM's start-up check on unified
   memory counts page cache as used ("Free memory on device ... less than desired GPU memory
   utilization", FIELD-NOTES); then **compact** (``engine.start_gate.compact``: write 1 to
   /proc/sys/vm/compact_memory, Documentation/admin-guide/sysctl/vm.rst), as the multi-Spark
   recipes do before every start.
3. **quiesce**: MemAvailable >= ``engine.start_above`` and stable (within ``stable_band``) for
   ``stable_for`` seconds, because memory stranded by a kill comes back only after a while;
   with ``engine.start_gate.memfree`` also **memfree**: MemFree >= utilization x MemTotal +
   margin, enough of it in >= 2 MiB blocks (:mod:`.memgate`).  Fragmentation past the timeout
   does not start the engine (``fragmentation: wait``): it says "reboot recommended", compacts
   again with a backoff and starts once the blocks are there.
4. **peers**: every ``engine.peers`` reports MemAvailable >= ``start_above`` (:mod:`sparkguard.peers`).
5. **cluster order** (a head or headless rank of a TP cluster with ``engine.peers``,
   :mod:`.cluster`): a headless rank waits until the head has no run and wants one; the head
   waits until every other rank runs and waits for a head.  No time limit: a rank started out
   of order joins a stale rendezvous and never serves (FIELD-NOTES, the multi-Spark recipes).

Past ``engine.quiesce_timeout`` (steps 2-4, counted from the end of the hold: a guard incident
that stays open must not use up the time memory gets to come back) the engine starts anyway, and
the result says which gate timed out and why.  :class:`StartGates` takes its clock, MemAvailable reader, peers reader
and waits from the caller, so the whole sequence runs on a fake clock in tests.  Each step that
runs has a gate record, ``hold``, ``drop_caches``, ``compact``, ``quiesce``, ``memfree``,
``peers``, ``cluster``, whose state (``waiting``, ``open``, ``timed_out``, ``fragmented``; the
one-shot steps ``drop_caches`` and ``compact``: ``done``, ``failed``) goes to the ``on_gate``
callback as it changes (status, ``sparkguard_engine_start_gate_info``) and into the result (the
incident's engine part).
"""

from __future__ import annotations

import collections
import logging
import os
import time
from dataclasses import dataclass
from typing import Callable, Protocol

from sparkguard import buddyinfo, meminfo, peers
from sparkguard.config.startgate import compacts
from sparkguard.supervisor import cluster, memgate, nodes
from sparkguard.units import format_size

log = logging.getLogger("sparkguard.supervisor")

MEM_SAMPLE = 0.25        # seconds between MemAvailable samples in the quiesce gate
PEER_EVERY = 1.0         # seconds between peer reads in the peers gate
HOLD_EVERY = 1.0         # seconds between re-checks of a hold (the hook's wake-up comes first)
FRAG_SAMPLE = 5.0        # seconds between MemFree/buddyinfo reads while fragmentation blocks a start


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


def read_mem_free(path: str = "/proc/meminfo") -> tuple[int, int]:
    """``(MemFree, MemTotal)`` in bytes (Documentation/filesystems/proc.rst).

    Raises:
        OSError: the file cannot be read; ValueError: either line is missing.
    """
    mi = meminfo.read(path)
    if "MemFree" not in mi or "MemTotal" not in mi:
        raise ValueError("no MemFree or MemTotal in /proc/meminfo")
    return mi["MemFree"], mi["MemTotal"]


def read_high_order() -> int | None:
    """Bytes free in >= 2 MiB blocks (:func:`sparkguard.buddyinfo.read`), None when unknown."""
    s = buddyinfo.read()
    return None if s is None else s.high_order_bytes


def compact_memory(path: str = "/proc/sys/vm/compact_memory") -> str:
    """Write 1 to ``path``: the kernel compacts every zone before the write returns
    (Documentation/admin-guide/sysctl/vm.rst, compact_memory; needs CONFIG_COMPACTION).

    Returns a one-line result ("compacted in N s" or why not); never raises.
    """
    t0 = time.monotonic()
    try:
        with open(path, "w") as f:
            f.write("1\n")
    except OSError as e:
        return f"not compacted: {e.strerror or e}"
    return f"compacted in {time.monotonic() - t0:.2f} s"


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
        """Record a history entry (``drop_caches``, ``compact_memory``, ``waiting``, ``quiesced``,
        ``quiesce_timeout``, ``memfree_timeout``, ``peers_timeout``, ``fragmented``, ``memfree``)."""

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
            ``engine.quiesce_timeout``: ``"quiesce"``, ``"memfree"`` or ``"peers"``.
        detail: str, what that gate was waiting for when it timed out ("" when none did).
        views: the other nodes as the cluster order gate last read them (``cluster.NodeView``;
            empty without that gate): a head's group is the ranks it saw waiting.
        gates: each gate of this pass as ``{"gate", "state", "detail", "waited"}`` (seconds
            from the end of the hold to the gate's last change), in the order they ran
            (``hold``, ``drop_caches``, ``compact``, ``quiesce``, ``memfree``, ``peers``, ``cluster``).
    """

    waited: float
    timed_out: str | None = None
    detail: str = ""
    views: tuple = ()
    gates: tuple = ()


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
        argv: the command about to start (its ``--gpu-memory-utilization`` sizes the MemFree gate).
        read_free: ``() -> (MemFree, MemTotal)`` bytes (raises OSError/ValueError: logged, counted as 0).
        read_high: ``() -> int | None``, bytes free in >= 2 MiB blocks.
        compact: the compaction, returning a one-line result.
        on_gate: ``(record: dict) -> None``, a gate's ``{"gate", "state", "detail", "waited"}``
            each time its state changes.
        on_blocked: ``(detail: str) -> None``, once per pass when fragmentation blocks the start
            past ``engine.quiesce_timeout`` (the supervisor opens an incident).
    """

    def __init__(self, ecfg, hooks: GateHooks, clock: Callable[[], float] = time.monotonic,
                 read_mem: Callable[[], int] = read_mem_available, check_peers=peers.check,
                 drop: Callable[[], str] = drop_caches, role: cluster.Role = cluster.Role(),
                 read_nodes=nodes.read_all, argv=(), read_free: Callable[[], tuple[int, int]] = read_mem_free,
                 read_high: Callable[[], int | None] = read_high_order, compact: Callable[[], str] = compact_memory,
                 on_gate: Callable[[dict], None] | None = None, on_blocked: Callable[[str], None] | None = None):
        self.e, self.hooks, self.clock = ecfg, hooks, clock
        self.read_mem, self.check_peers, self.drop = read_mem, check_peers, drop
        self.role, self.read_nodes = role, read_nodes
        self.argv, self.read_free, self.read_high, self.compact = tuple(argv or ()), read_free, read_high, compact
        self.on_gate, self.on_blocked = on_gate, on_blocked
        self.records: dict[str, dict] = {}
        self.t0 = clock()

    def _gate(self, gate: str, state: str, detail: str) -> None:
        """Record ``gate``'s state; ``on_gate`` hears of it when the state or detail changed."""
        old = self.records.get(gate)
        if old is not None and old["state"] == state and old["detail"] == detail:
            return
        rec = {"gate": gate, "state": state, "detail": detail, "waited": round(self.clock() - self.t0, 3)}
        self.records[gate] = rec
        if self.on_gate is not None:
            self.on_gate(dict(rec))

    def _result(self, waited: float, timed_out: str | None = None, detail: str = "", views: tuple = ()) -> GateResult:
        return GateResult(waited, timed_out, detail, views, tuple(dict(r) for r in self.records.values()))

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
        self.records, self.t0 = {}, self.clock()
        while (why := h.held()) is not None:
            if why != held:
                held = why
                h.note("waiting", why)
                self._gate("hold", "waiting", why)
            h.show(why)
            h.wait(HOLD_EVERY, lambda: h.interrupted() or h.held() is None)
            if h.interrupted():
                return None
        if held is not None:
            self._gate("hold", "open", f"held {self.clock() - self.t0:.1f} s: {held}")
        t0 = self.t0 = self.clock()       # the hold has no time limit and does not eat the timeout
        deadline = t0 + e.quiesce_timeout
        dropped = None
        if e.drop_caches:
            h.show("sync and drop caches")
            dropped = self.drop()
            self._gate("drop_caches", "done" if dropped.startswith("dropped") else "failed", dropped)
        if compacts(e.start_gate, e.drop_caches):      # after the drop: the freed page cache is what it merges
            h.show("compact memory")
            res = self.compact()
            self._gate("compact", "done" if res.startswith("compacted") else "failed", res)
            if dropped is None:
                h.note("compact_memory", res)
            else:
                dropped += f"; {res}"
        if dropped is not None:
            h.note("drop_caches", dropped)
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
            return self._result(waited, timed_out, detail, views)
        h.note("quiesced", f"gates met after {waited:.2f} s")
        return self._result(waited, views=views)

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
            self._gate("cluster", "open" if ok else "waiting", f"cluster order: {why}" if not ok else
                       f"{role.role} rank {role.node_rank} may start")
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
        """The quiesce gate, and the memfree gate with ``engine.start_gate.memfree``.

        Returns ``("", "")`` open, ``("quiesce" | "memfree", detail)`` timed out, ``(None, ...)``
        interrupted, ``(_AGAIN, ...)`` a guard hold came back."""
        e, h = self.e, self.hooks
        gate = QuiesceGate(e.start_above, e.stable_for, e.stable_band)
        announced = set()
        while True:
            now = self.clock()
            try:
                avail = self.read_mem()
            except (OSError, ValueError) as ex:
                log.error("reading MemAvailable failed: %s", ex)
                avail = 0
            quiet = gate.feed(now, avail)
            qdetail = (f"quiesce: MemAvailable {format_size(avail)}, need >= {format_size(e.start_above)} "
                       f"stable for {e.stable_for:g} s")
            self._gate("quiesce", "open" if quiet else "waiting", qdetail)
            state, mdetail = self._memfree() if e.start_gate.memfree else (memgate.OPEN, "")
            if quiet and state == memgate.OPEN:
                return "", ""
            gate_name, detail = ("quiesce", qdetail) if not quiet else ("memfree", mdetail)
            if now >= deadline:
                if state == memgate.FRAGMENTED and quiet and e.start_gate.fragmentation == "wait":
                    return self._fragmented(mdetail)
                self._gate(gate_name, "timed_out", detail)
                return gate_name, detail
            h.show(detail)
            if gate_name not in announced:
                announced.add(gate_name)
                h.note("waiting", f"{detail}; starting anyway after {e.quiesce_timeout:g} s"
                       + (" unless fragmentation blocks it" if gate_name == "memfree"
                          and e.start_gate.fragmentation == "wait" else ""))
            if h.wait(min(MEM_SAMPLE, deadline - now), h.interrupted):
                return None, ""
            if h.held() is not None:
                return (_AGAIN if not h.interrupted() else None), ""

    def _memfree(self) -> tuple[str, str]:
        """Read MemFree (and /proc/buddyinfo once MemFree is enough): the memfree gate's verdict
        (:func:`memgate.verdict`), recorded as its state."""
        sg = self.e.start_gate
        try:
            free, total = self.read_free()
        except (OSError, ValueError) as ex:
            log.error("reading MemFree failed: %s", ex)
            free, total = 0, 0
        need = memgate.need_for(sg, self.argv, total, self.e.start_above)
        high = self.read_high() if free >= need.bytes and sg.fragmentation != "off" else None
        state, detail = memgate.verdict(free, high, need, sg.fragmentation)
        self._gate("memfree", {memgate.OPEN: "open", memgate.SHORT: "waiting"}.get(state, state), detail)
        return state, detail

    def _fragmented(self, detail: str):
        """Past the timeout, MemFree is enough but not in >= 2 MiB blocks: do not start (a start
        would fail, again and again); compact again after a backoff (:class:`memgate.Backoff`)
        and read the gate every :data:`FRAG_SAMPLE` s.  Returns ``("", "")`` once the gate opens,
        ``(None, "")`` interrupted, ``(_AGAIN, "")`` a guard hold came back."""
        h = self.hooks
        log.error("engine: not starting: %s (engine.start_gate.fragmentation: wait)", detail)
        h.note("fragmented", f"{detail}; not starting (a start would fail); compacting again with a backoff")
        if self.on_blocked is not None:
            self.on_blocked(detail)
        backoff = memgate.Backoff()
        while True:
            next_at = self.clock() + backoff.next()
            while (now := self.clock()) < next_at:
                h.show(f"{detail}; not starting; compacting again in {next_at - now:.0f} s")
                if h.wait(min(FRAG_SAMPLE, next_at - now), h.interrupted):
                    return None, ""
                if h.held() is not None:
                    return (_AGAIN if not h.interrupted() else None), ""
                state, detail = self._memfree()
                if state == memgate.OPEN:
                    h.note("memfree", f"the start may go on: {detail}")
                    return "", ""
            res = self.compact()
            h.note("compact_memory", res)
            self._gate("compact", "done" if res.startswith("compacted") else "failed", res)

    def _peers(self, deadline: float):
        """Returns ``("", "")`` all ok, ``("peers", detail)`` timed out, ``(None, "")`` interrupted."""
        e, h = self.e, self.hooks
        announced = False
        while True:
            states = self.check_peers(e.peers, e.start_above, timeout=min(3.0, max(0.5, e.health_interval)))
            h.peers_seen([s.as_dict() for s in states])
            if all(s.ok for s in states):
                self._gate("peers", "open", f"peers: {len(states)} at or above {format_size(e.start_above)}")
                return "", ""
            now = self.clock()
            waiting = "; ".join(f"{s.url}: " + (s.error or f"{format_size(s.available_bytes)} available")
                                for s in states if not s.ok)
            detail = f"peers: {waiting}; need >= {format_size(e.start_above)} each"
            if now >= deadline:
                self._gate("peers", "timed_out", detail)
                return "peers", detail
            self._gate("peers", "waiting", detail)
            h.show(detail)
            if not announced:
                announced = True
                h.note("waiting", detail)
            if h.wait(min(PEER_EVERY, deadline - now), h.interrupted):
                return None, ""


_AGAIN = object()

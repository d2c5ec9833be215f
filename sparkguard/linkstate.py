"""The TP link watch's decisions: each interface's up/down state and the link incidents.

:class:`LinkStates` is fed the kernel's link messages (``RTM_NEWLINK``/``RTM_DELLINK``, as
pyroute2 ifinfmsg objects or dicts with their keys) by :class:`sparkguard.linkwatch.LinkWatch`'s
netlink thread, and decides: a link that goes from up to down and stays down longer than
``down_after`` seconds is an incident of kind ``"link"`` (docs/incident.md), handed to
``on_incident`` when it is declared and again, completed, when the link is back; every up/down
transition goes to ``on_change``.  Time comes from the injected ``clock`` and the down_after
timer from the injected ``schedule``, so the decisions are tested on a fake clock
(tests/test_linkstate.py).  Sources: Documentation/networking/operstates.rst (operstate,
IFF_LOWER_UP, carrier), include/uapi/linux/if_link.h (IFLA_STATS64, IFLA_CARRIER_CHANGES).
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from typing import Any, Callable, Iterable

from sparkguard import meminfo, sysinfo
from sparkguard.model import Event, Incident, Link, LinkThresholds, new_incident

log = logging.getLogger("sparkguard.linkwatch")

IFF_UP = 0x1
IFF_RUNNING = 0x40
IFF_LOWER_UP = 0x10000
#: counter name (metric stem) -> key in IFLA_STATS64
STAT_KEYS = {
    "rx_errors": "rx_errors",
    "tx_errors": "tx_errors",
    "rx_dropped": "rx_dropped",
    "tx_dropped": "tx_dropped",
}


#: message field -> the rtnetlink attribute that carries it (include/uapi/linux/if_link.h)
IFLA = {
    "ifname": "IFLA_IFNAME",
    "operstate": "IFLA_OPERSTATE",
    "carrier": "IFLA_CARRIER",
    "carrier_changes": "IFLA_CARRIER_CHANGES",
    "stats64": "IFLA_STATS64",
    "stats": "IFLA_STATS",
}


def link_field(msg: Any, field: str) -> Any:
    """Field ``field`` of a link message: a key of :data:`IFLA` read as its attribute, the rest
    (``index``, ``flags``, ``event``: the ifinfomsg header and pyroute2's own keys) with ``get``.

    pyroute2 0.7 (Debian 12's 0.7.2, Debian 13's 0.7.7, Ubuntu 24.04's 0.7.11) answers
    ``msg.get("ifname")`` with None and knows attributes only by their IFLA_ names;
    ``msg.get_attr("IFLA_IFNAME")`` works on 0.7 and 0.9 (seen with both: tests/test_linkcompat.py).
    A plain dict (the tests' messages) is read by the short keys.  None when the field is absent.
    """
    get_attr = getattr(msg, "get_attr", None)
    if field in IFLA and callable(get_attr):
        return get_attr(IFLA[field])
    return msg.get(field)


def valid_ifname(name: Any) -> bool:
    """True when ``name`` is a possible Linux interface name (1-15 bytes, no ``/``, ``:``
    or whitespace, not ``.``/``..``).  Source: net/core/dev.c ``dev_valid_name``."""
    if not isinstance(name, str) or not 0 < len(name.encode()) < 16 or name in (".", ".."):
        return False
    return not any(c in name for c in "/: \t\n") and name.isprintable()


def is_up(operstate: str | None, flags: int) -> bool:
    """Operational state to a boolean: ``UP``, or ``UNKNOWN`` (drivers without operstate
    support, e.g. ``lo``) with IFF_UP and IFF_LOWER_UP set.  Source: operstates.rst."""
    if operstate == "UP":
        return True
    return operstate == "UNKNOWN" and bool(flags & IFF_UP) and bool(flags & IFF_LOWER_UP)



def _mem_available(read_meminfo: Callable[[], dict]) -> int:
    """MemAvailable in bytes, -1 when /proc/meminfo cannot be read."""
    try:
        return read_meminfo().get("MemAvailable", 0)
    except OSError:
        pass
    return -1


def new_state(name: str) -> dict:
    return {"ifname": name, "present": False, "index": None, "operstate": None, "flags": 0,
            "carrier": False, "up": False, "speed_mbps": None, "down_since": None,
            "last_change": None, "stats": {}, "carrier_changes": None}


def apply_msg(st: dict, msg: Any, deleted: bool) -> None:
    """Update one interface state dict from a pyroute2 ifinfmsg of 0.7 or 0.9, or a dict with the
    short keys (in place; :func:`link_field`)."""
    if deleted:
        st.update(present=False, index=None, operstate=None, flags=0, carrier=False)
        return
    st["present"] = True
    st["index"] = link_field(msg, "index")
    st["flags"] = int(link_field(msg, "flags") or 0)
    st["operstate"] = link_field(msg, "operstate")
    carrier = link_field(msg, "carrier")
    st["carrier"] = bool(carrier) if carrier is not None else bool(st["flags"] & IFF_LOWER_UP)
    apply_counters(st, msg)


def apply_counters(st: dict, msg: Any) -> None:
    stats = link_field(msg, "stats64") or link_field(msg, "stats")
    if stats is not None:
        st["stats"] = {k: int(stats.get(v) or 0) for k, v in STAT_KEYS.items()}
    cc = link_field(msg, "carrier_changes")
    if cc is not None:
        st["carrier_changes"] = int(cc)


class LinkStates:
    """The state of the watched interfaces and their open link incidents.

    Args:
        interfaces: interface names (valid ones: :func:`valid_ifname`).
        down_after: seconds (float) a link must stay down, after being seen up, before it is
            an incident.  A link already down at the first (``initial``) update is no incident.
        on_incident: ``callable(incident: dict) -> None``: a deep copy of the record
            (:meth:`sparkguard.model.Incident.to_json`), kind ``"link"``: first when the link has
            been down for ``down_after`` (``ended_at`` None, ``outcome`` ``"link_down"``, timeline
            ``down``, ``incident``), then with the same ``id`` when it is up again (``ended_at``
            set, ``outcome`` ``"recovered"``, timeline ``down``, ``incident``, ``up``).
        on_change: optional ``callable(ifname: str, up: bool) -> None`` on every transition.
        netns: the network namespace name recorded in the incident (None: this process's).
        clock: wall clock, unix seconds.
        schedule: ``schedule(delay_s, fn) -> handle`` with ``handle.cancel()``: runs ``fn()``
            after ``delay_s`` in the caller's thread (the watch gives its asyncio loop's
            ``call_later``); set before the first drop.
        speed: ``speed(ifname) -> int | None``, Mb/s of an up link.
        read_meminfo: ``() -> {field: bytes}`` (raises OSError), for the drop's snapshot and
            each event's ``available_bytes``.

    Exceptions raised by the callbacks are logged and swallowed.  Calls come from one thread
    (the feeder's); :attr:`lock` guards :attr:`state`, :attr:`incidents` and :attr:`counts`
    for readers in other threads.
    """

    def __init__(self, interfaces: Iterable[str], down_after: float, on_incident: Callable[[dict], None],
                 on_change: Callable[[str, bool], None] | None = None, *, netns: str | None = None,
                 clock: Callable[[], float] = time.time, schedule: Callable[[float, Callable], Any] | None = None,
                 speed: Callable[[str], int | None] = lambda name: None,
                 read_meminfo: Callable[[], dict] = meminfo.read):
        self.down_after = float(down_after)
        self.netns = netns
        self._on_incident = on_incident
        self._on_change = on_change
        self._clock = clock
        self.schedule = schedule
        self._speed = speed
        self._read_meminfo = read_meminfo
        self.lock = threading.Lock()
        self.state: dict[str, dict] = {n: new_state(n) for n in interfaces}
        self.incidents: dict[str, Incident] = {}     # ifname -> open incident
        self._timers: dict[str, Any] = {}            # ifname -> the schedule's handle
        self._pending: dict[str, dict] = {}          # ifname -> facts at the drop
        self.counts = {"events": 0, "incidents": 0, "resyncs": 0}

    def update(self, name: str, msg: Any, deleted: bool, initial: bool = False) -> None:
        """Apply one link message of interface ``name`` (None with ``deleted``: it is gone);
        ``initial``: part of the first dump (sets the state, decides nothing)."""
        now = self._clock()
        with self.lock:
            st = self.state[name]
            was_up = st["up"]
            was_present = st["present"]
            apply_msg(st, msg, deleted)
            st["up"] = st["present"] and is_up(st["operstate"], st["flags"])
            if st["up"]:
                st["speed_mbps"] = self._speed(name)
            else:
                st["speed_mbps"] = None
            changed = st["up"] != was_up
            if initial:
                st["last_change"] = now
                st["down_since"] = None if st["up"] else now
                return
            if not changed:
                if was_present != st["present"]:
                    log.info("link %s %s", name, "appeared" if st["present"] else "disappeared")
                return
            st["last_change"] = now
            detail = self._describe(st)
        if st["up"]:
            log.info("link %s up (%s)", name, detail)
            self._link_up(name, now, detail)
        else:
            log.warning("link %s down (%s)", name, detail)
            self._link_down(name, now, detail)
        self._call_change(name, st["up"])

    @staticmethod
    def _describe(st: dict) -> str:
        if not st["present"]:
            return "interface gone"
        return f"operstate {st['operstate']}, carrier {int(st['carrier'])}, admin {'up' if st['flags'] & IFF_UP else 'down'}"


    def _event(self, event: str, inc_start: float, at: float, detail: str) -> Event:
        return Event(event, round(at - inc_start, 3), at, _mem_available(self._read_meminfo), [], detail)

    def _link_down(self, name: str, now: float, detail: str) -> None:
        with self.lock:
            self.state[name]["down_since"] = now
        try:
            meminfo = self._read_meminfo()
        except OSError as e:
            log.warning("cannot read /proc/meminfo: %s", e)
            meminfo = {}
        self._pending[name] = {"at": now, "detail": detail, "meminfo": meminfo}
        old = self._timers.pop(name, None)
        if old is not None:
            old.cancel()
        self._timers[name] = self.schedule(self.down_after, lambda: self._declare(name))

    def _declare(self, name: str) -> None:
        """``down_after`` elapsed since the drop and the link is still down: incident."""
        self._timers.pop(name, None)
        p = self._pending.pop(name, None)
        with self.lock:
            st = dict(self.state[name])
        if p is None or st["up"]:
            return
        now = self._clock()
        start = p["at"]
        down_ev = self._event("down", start, start, f"{name}: {p['detail']}")
        down_ev.available_bytes = p["meminfo"].get("MemAvailable", down_ev.available_bytes)
        inc = new_incident(
            "link", start, LinkThresholds(self.down_after), p["meminfo"],   # the memory lines do not apply
            psi_memory=sysinfo.read_psi_memory(), zram=sysinfo.read_zram(), outcome="link_down",
            summary=f"TP link {name} down for more than {self.down_after:g} s ({p['detail']})",
            link=Link(name, self.netns, st["operstate"], st["carrier"], st["present"], self.down_after))
        inc.timeline += [
            down_ev,
            self._event("incident", start, now,
                        f"{name} down for {now - start:.1f} s (link.down_after {self.down_after:g} s)"),
        ]
        with self.lock:
            self.incidents[name] = inc
            self.counts["incidents"] += 1
        log.warning("incident %s: %s", inc.id, inc.summary)
        self._call_incident(inc)

    def _link_up(self, name: str, now: float, detail: str) -> None:
        with self.lock:
            st = self.state[name]
            down_since = st["down_since"]
            st["down_since"] = None
            inc = self.incidents.pop(name, None)
        h = self._timers.pop(name, None)
        if h is not None:
            h.cancel()
        pending = self._pending.pop(name, None)
        if inc is None:
            if pending is not None and down_since is not None:
                log.info("link %s was down %.2f s, under link.down_after: no incident", name, now - down_since)
            return
        inc.timeline.append(self._event("up", inc.started_at, now, f"{name}: {detail}"))
        inc.ended_at = now
        inc.outcome = "recovered"
        inc.summary = f"TP link {name} was down {now - inc.started_at:.1f} s, now up again"
        inc.link.operstate, inc.link.carrier, inc.link.present = st["operstate"], st["carrier"], st["present"]
        self._call_incident(inc)

    def _call_incident(self, inc: Incident) -> None:
        try:
            self._on_incident(copy.deepcopy(inc.to_json()))
        except Exception:                 # noqa: BLE001 - act first, report after; never die of it
            log.exception("on_incident callback failed")

    def cancel_timers(self) -> None:
        """Cancel every pending down_after timer (the watch is stopping: no incident is declared
        after it)."""
        for h in self._timers.values():
            h.cancel()
        self._timers.clear()

    def report_initial(self, where: str = "") -> None:
        """After the first dump: log the missing interfaces (``where``: e.g. " in netns X") and
        hand each interface's state to ``on_change``."""
        for name, st in self.state.items():
            if not st["present"]:
                log.warning("link %s: no such interface%s; reported down", name, where)
            self._call_change(name, st["up"])

    def _call_change(self, name: str, up: bool) -> None:
        if self._on_change is None:
            return
        try:
            self._on_change(name, up)
        except Exception:                 # noqa: BLE001
            log.exception("on_change callback failed")

    # ---------------------------------------------------------------- readers (any thread)

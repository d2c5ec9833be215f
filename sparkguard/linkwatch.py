"""Watch the tensor-parallel (TP) fabric link through netlink events.

A TP engine spread over several Sparks hangs when its inter-node link (the ConnectX-7
ports) drops: NCCL waits inside a collective and the engine neither dies nor serves.
:class:`LinkWatch` follows the configured interfaces as the kernel reports them:

* one thread owns one rtnetlink socket (pyroute2 ``AsyncIPRoute`` in the thread's own
  asyncio loop), bound to the ``RTMGRP_LINK`` multicast group *before* any request is
  sent on it (pyroute2 0.9: objects belong to the thread that made them).  Every
  ``RTM_NEWLINK``/``RTM_DELLINK`` is applied as it arrives; nothing is polled.
* a link that goes from up to down and stays down longer than ``down_after`` seconds is
  an incident of kind ``"link"`` (TEAM.md "Incident record"), handed to ``on_incident``
  when it is declared and again, completed, when the link is back;
* every up/down transition is handed to ``on_change(ifname, up)`` so the engine
  supervisor can mark the engine unhealthy;
* :meth:`LinkWatch.collector` is a prometheus_client collector: ``up``, ``carrier``,
  ``speed`` and the error/drop/carrier-change counters per interface, the counters read
  from netlink (``IFLA_STATS64``, ``IFLA_CARRIER_CHANGES``) at scrape time.

pyroute2 and asyncio are imported only inside this module's functions, and the daemon
imports this module only when ``link.interfaces`` is non-empty: they cost several MiB of
RSS that a guard without links should not pay.

Sources: Documentation/networking/operstates.rst (operstate, IFF_LOWER_UP, carrier),
include/uapi/linux/if_link.h (IFLA_STATS64, IFLA_CARRIER_CHANGES),
Documentation/ABI/testing/sysfs-class-net (``speed`` in Mb/s, -1 when unknown),
include/uapi/linux/ethtool.h (``struct ethtool_cmd``, ETHTOOL_GSET, SPEED_UNKNOWN),
pyroute2 0.9 docs (AsyncIPRoute, ``netns=``, ``bind(groups=...)``).
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from typing import Any, Callable, Iterable

from sparkguard import sysinfo
from sparkguard.model import Event, Incident, Link, LinkThresholds, new_incident

log = logging.getLogger("sparkguard.linkwatch")

#: rtnetlink multicast group of link events (include/uapi/linux/rtnetlink.h)
RTMGRP_LINK = 0x1
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
SIOCETHTOOL = 0x8946
ETHTOOL_GSET = 0x1
SYS_CLASS_NET = "/sys/class/net"


def valid_ifname(name: Any) -> bool:
    """True when ``name`` is a possible Linux interface name (1-15 bytes, no ``/``, ``:``
    or whitespace, not ``.``/``..``).  Source: net/core/dev.c ``dev_valid_name``."""
    if not isinstance(name, str) or not 0 < len(name.encode()) < 16 or name in (".", ".."):
        return False
    return not any(c in name for c in "/: \t\n") and name.isprintable()


def _is_up(operstate: str | None, flags: int) -> bool:
    """Operational state to a boolean: ``UP``, or ``UNKNOWN`` (drivers without operstate
    support, e.g. ``lo``) with IFF_UP and IFF_LOWER_UP set.  Source: operstates.rst."""
    if operstate == "UP":
        return True
    return operstate == "UNKNOWN" and bool(flags & IFF_UP) and bool(flags & IFF_LOWER_UP)


def _sysfs_speed_mbps(ifname: str, root: str = SYS_CLASS_NET) -> int | None:
    """``/sys/class/net/IF/speed`` in Mb/s, None when unknown (-1), unreadable (EINVAL on a
    down link) or absent."""
    try:
        with open(f"{root}/{ifname}/speed") as f:
            v = int(f.read().strip())
    except (OSError, ValueError):
        return None
    return v if v > 0 else None


def _ethtool_speed_mbps(sock_fd: int, ifname: str) -> int | None:
    """Link speed in Mb/s by the ETHTOOL_GSET ioctl on ``sock_fd`` (a socket of the
    interface's network namespace); None when unknown or unsupported.  This is the value
    ``/sys/class/net/IF/speed`` shows (both come from the driver's get_link_ksettings);
    it is used when the watched interfaces live in another namespace, whose sysfs this
    process cannot see.  ETHTOOL_GSET needs no privilege (net/ethtool/ioctl.c)."""
    import ctypes
    import fcntl
    import struct

    cmd = ctypes.create_string_buffer(struct.pack("I", ETHTOOL_GSET) + bytes(40))  # struct ethtool_cmd, 44 bytes
    ifreq = struct.pack("16sP", ifname.encode()[:15], ctypes.addressof(cmd)) + bytes(16)
    try:
        fcntl.ioctl(sock_fd, SIOCETHTOOL, ifreq)
    except OSError:
        return None
    speed_lo, = struct.unpack_from("H", cmd.raw, 12)
    speed_hi, = struct.unpack_from("H", cmd.raw, 28)
    v = (speed_hi << 16) | speed_lo
    return None if v in (0, 0xFFFFFFFF) else v


def _mem_available() -> int:
    try:
        return sysinfo.read_meminfo().get("MemAvailable", 0)
    except OSError:
        pass
    return -1


def _new_state(name: str) -> dict:
    return {"ifname": name, "present": False, "index": None, "operstate": None, "flags": 0,
            "carrier": False, "up": False, "speed_mbps": None, "down_since": None,
            "last_change": None, "stats": {}, "carrier_changes": None}


def _apply_msg(st: dict, msg: Any, deleted: bool) -> None:
    """Update one interface state dict from a pyroute2 ifinfmsg (in place)."""
    if deleted:
        st.update(present=False, index=None, operstate=None, flags=0, carrier=False)
        return
    st["present"] = True
    st["index"] = msg.get("index")
    st["flags"] = int(msg.get("flags") or 0)
    st["operstate"] = msg.get("operstate")
    carrier = msg.get("carrier")
    st["carrier"] = bool(carrier) if carrier is not None else bool(st["flags"] & IFF_LOWER_UP)
    _apply_counters(st, msg)


def _apply_counters(st: dict, msg: Any) -> None:
    stats = msg.get("stats64") or msg.get("stats")
    if stats is not None:
        st["stats"] = {k: int(stats.get(v) or 0) for k, v in STAT_KEYS.items()}
    cc = msg.get("carrier_changes")
    if cc is not None:
        st["carrier_changes"] = int(cc)


class LinkWatch:
    """Follow the state of network interfaces through rtnetlink events, in one thread.

    Args:
        interfaces: interface names (e.g. ``["enp1s0f0np0", "enp1s0f1np1"]``, the
            ConnectX-7 ports).  A name that does not exist is reported down and logged,
            never fatal; it is picked up when it appears.
        down_after: seconds (float) a link must stay down, after being seen up, before it
            is an incident.  A link that is already down when the watch starts is
            reported (``up=0``, ``on_change(name, False)``) but is no incident: only a
            drop observed while watching is.
        on_incident: ``callable(incident: dict) -> None``, called from the watch thread
            with a deep copy of the incident record (TEAM.md "Incident record", kind
            ``"link"``): first when the link has been down for ``down_after``
            (``ended_at`` None, ``outcome`` ``"link_down"``, timeline ``down``,
            ``incident``), then with the same ``id`` when it is up again (``ended_at``
            set, ``outcome`` ``"recovered"``, timeline ``down``, ``incident``, ``up``).
            A reporter that writes files by id therefore ends with the complete record.
            The record has an extra ``link`` dict (interface, netns, operstate, carrier,
            down_after_seconds); the daemon may add ``engine``.
        on_change: optional ``callable(ifname: str, up: bool) -> None``, called from the
            watch thread once per interface after start with its initial state, then on
            every up/down transition.
        netns: optional network namespace name (``/var/run/netns/NAME``) whose interfaces
            are watched instead of this process's own; it must exist.
        clock: wall clock returning unix seconds (for ``at``/``started_at``).

    Exceptions raised by the callbacks are logged and swallowed: they never stop the watch.
    ``start()``/``stop()`` may be called from any thread; ``snapshot()`` and the collector
    are thread-safe.
    """

    def __init__(self, interfaces: Iterable[str], down_after: float,
                 on_incident: Callable[[dict], None],
                 on_change: Callable[[str, bool], None] | None = None,
                 *, netns: str | None = None, clock: Callable[[], float] = time.time):
        names = list(dict.fromkeys(interfaces))
        for n in names:
            if not valid_ifname(n):
                raise ValueError(f"not a valid interface name: {n!r}")
        if down_after < 0:
            raise ValueError(f"down_after must not be negative: {down_after!r}")
        self.interfaces = names
        self.down_after = float(down_after)
        self.netns = netns
        self._on_incident = on_incident
        self._on_change = on_change
        self._clock = clock
        self._lock = threading.Lock()
        self._state: dict[str, dict] = {n: _new_state(n) for n in names}
        self._incidents: dict[str, Incident] = {}    # ifname -> open incident
        self._timers: dict[str, Any] = {}            # ifname -> asyncio.TimerHandle
        self._pending: dict[str, dict] = {}          # ifname -> facts at the drop
        self._counts = {"events": 0, "incidents": 0, "resyncs": 0}
        self._thread: threading.Thread | None = None
        self._loop = None
        self._stop_evt = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._ipr = None
        self._speed_sock = None

    # ---------------------------------------------------------------- lifecycle

    def start(self, timeout: float = 15.0) -> None:
        """Start the watch thread and wait until the initial link dump is applied.

        Args:
            timeout: seconds to wait for the socket and the first dump (entering a
                network namespace forks a helper in pyroute2, which takes a moment).
        Raises:
            OSError: the netlink socket could not be opened or bound (e.g. ``netns``
                does not exist); the thread has ended.
            TimeoutError: not ready within ``timeout``.
            RuntimeError: already started.
        """
        if self._thread is not None:
            raise RuntimeError("LinkWatch already started")
        self._thread = threading.Thread(target=self._run, name="sparkguard-linkwatch", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            self.stop()
            raise TimeoutError(f"link watch not ready after {timeout} s")
        if self._error is not None:
            self._thread.join(timeout)
            self._thread = None
            err = self._error
            if isinstance(err, OSError):
                raise err
            raise OSError(f"link watch failed to start: {err!r}") from err

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the thread and close the socket; an open incident stays as last reported.
        Idempotent.  ``timeout``: seconds to wait for the thread."""
        t = self._thread
        if t is None:
            return
        loop, evt = self._loop, self._stop_evt
        if loop is not None and evt is not None:
            try:
                loop.call_soon_threadsafe(evt.set)
            except RuntimeError:     # loop already closed
                pass
        t.join(timeout)
        if t.is_alive():
            log.warning("link watch thread did not stop within %.1f s", timeout)
        self._thread = None

    @property
    def running(self) -> bool:
        """True while the watch thread runs."""
        return self._thread is not None and self._thread.is_alive() and self._error is None

    # ---------------------------------------------------------------- thread

    def _run(self) -> None:
        import asyncio

        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            loop.run_until_complete(self._main())
        except BaseException as e:        # noqa: BLE001 - reported through start()
            if not self._ready.is_set():
                self._error = e
            else:
                log.exception("link watch stopped by an error")
        finally:
            self._ready.set()
            try:
                loop.run_until_complete(loop.shutdown_asyncgens())
            except Exception:             # noqa: BLE001
                pass
            loop.close()
            self._loop = None

    async def _open(self):
        from pyroute2 import AsyncIPRoute

        kw: dict = {}
        if self.netns is not None:
            kw = {"netns": self.netns, "flags": 0}      # flags=0: never create the netns
        ipr = AsyncIPRoute(**kw)
        await ipr.bind(groups=RTMGRP_LINK)              # before any request (pyroute2 0.9)
        return ipr

    async def _main(self) -> None:
        import asyncio
        import socket

        self._stop_evt = asyncio.Event()
        self._ipr = await self._open()
        try:
            if self.netns is None:
                self._speed_sock = None
            else:
                from pyroute2 import netns as _netns
                try:
                    self._speed_sock = _netns.create_socket(self.netns, socket.AF_INET, socket.SOCK_DGRAM, flags=0)
                except Exception as e:     # noqa: BLE001 - speed is optional
                    log.warning("link speed unavailable in netns %s: %s", self.netns, e)
            await self._resync(initial=True)
            self._ready.set()
            for name, st in self._state.items():
                if not st["present"]:
                    log.warning("link %s: no such interface%s; reported down", name,
                                f" in netns {self.netns}" if self.netns else "")
                self._call_change(name, st["up"])
            stop = asyncio.ensure_future(self._stop_evt.wait())
            backoff = 0.1
            while not self._stop_evt.is_set():
                reader = asyncio.ensure_future(self._read_events())
                await asyncio.wait({reader, stop}, return_when=asyncio.FIRST_COMPLETED)
                if self._stop_evt.is_set():
                    reader.cancel()
                    try:
                        await reader
                    except (asyncio.CancelledError, Exception):   # noqa: BLE001
                        pass
                    break
                exc = reader.exception()
                log.warning("link events interrupted (%r); re-reading link state", exc)
                try:
                    await asyncio.wait_for(self._stop_evt.wait(), backoff)
                except asyncio.TimeoutError:
                    pass
                backoff = min(backoff * 2, 5.0)
                try:
                    if exc is not None:     # e.g. ENOBUFS: events were lost, socket may be dead
                        try:
                            self._ipr.close()
                        except Exception:  # noqa: BLE001
                            pass
                        self._ipr = await self._open()
                    await self._resync(initial=False)
                    backoff = 0.1
                except Exception as e:     # noqa: BLE001
                    log.warning("link state re-read failed: %s", e)
        finally:
            for h in self._timers.values():
                h.cancel()
            self._timers.clear()
            try:
                self._ipr.close()
            except Exception:             # noqa: BLE001
                pass
            if self._speed_sock is not None:
                self._speed_sock.close()

    async def _read_events(self) -> None:
        while True:
            async for msg in self._ipr.get():
                ev = msg.get("event")
                if ev in ("RTM_NEWLINK", "RTM_DELLINK"):
                    name = msg.get("ifname")
                    if name in self._state:
                        self._counts["events"] += 1
                        self._update(name, msg, deleted=(ev == "RTM_DELLINK"))

    async def _dump(self) -> list:
        return [m async for m in await self._ipr.link("dump")]

    async def _resync(self, initial: bool) -> None:
        msgs = await self._dump()
        seen = set()
        for msg in msgs:
            name = msg.get("ifname")
            if name in self._state:
                seen.add(name)
                self._update(name, msg, deleted=False, initial=initial)
        for name in self._state:
            if name not in seen:
                self._update(name, None, deleted=True, initial=initial)
        if not initial:
            self._counts["resyncs"] += 1

    # ---------------------------------------------------------------- state machine (watch thread)

    def _update(self, name: str, msg: Any, deleted: bool, initial: bool = False) -> None:
        now = self._clock()
        with self._lock:
            st = self._state[name]
            was_up = st["up"]
            was_present = st["present"]
            _apply_msg(st, msg, deleted)
            st["up"] = st["present"] and _is_up(st["operstate"], st["flags"])
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

    def _speed(self, name: str) -> int | None:
        if self.netns is None:
            return _sysfs_speed_mbps(name)
        if self._speed_sock is None:
            return None
        return _ethtool_speed_mbps(self._speed_sock.fileno(), name)

    def _event(self, event: str, inc_start: float, at: float, detail: str) -> Event:
        return Event(event, round(at - inc_start, 3), at, _mem_available(), [], detail)

    def _link_down(self, name: str, now: float, detail: str) -> None:
        with self._lock:
            self._state[name]["down_since"] = now
        try:
            meminfo = sysinfo.read_meminfo()
        except OSError as e:
            log.warning("cannot read /proc/meminfo: %s", e)
            meminfo = {}
        self._pending[name] = {"at": now, "detail": detail, "meminfo": meminfo}
        old = self._timers.pop(name, None)
        if old is not None:
            old.cancel()
        self._timers[name] = self._loop.call_later(self.down_after, self._declare, name)

    def _declare(self, name: str) -> None:
        """``down_after`` elapsed since the drop and the link is still down: incident."""
        self._timers.pop(name, None)
        p = self._pending.pop(name, None)
        with self._lock:
            st = dict(self._state[name])
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
        with self._lock:
            self._incidents[name] = inc
            self._counts["incidents"] += 1
        log.warning("incident %s: %s", inc.id, inc.summary)
        self._call_incident(inc)

    def _link_up(self, name: str, now: float, detail: str) -> None:
        with self._lock:
            st = self._state[name]
            down_since = st["down_since"]
            st["down_since"] = None
            inc = self._incidents.pop(name, None)
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

    def _call_change(self, name: str, up: bool) -> None:
        if self._on_change is None:
            return
        try:
            self._on_change(name, up)
        except Exception:                 # noqa: BLE001
            log.exception("on_change callback failed")

    # ---------------------------------------------------------------- readers (any thread)

    def refresh_counters(self, timeout: float = 1.0) -> bool:
        """Read the error/drop/carrier-change counters of the watched interfaces now, by a
        netlink dump made in the watch thread.  Returns True when fresh, False when the
        watch is not running or did not answer within ``timeout`` seconds (the last
        values are kept).  Never raises."""
        import asyncio

        loop = self._loop
        if not self.running or loop is None:
            return False

        async def dump_counters():
            msgs = await self._dump()
            with self._lock:
                for msg in msgs:
                    st = self._state.get(msg.get("ifname"))
                    if st is not None:
                        _apply_counters(st, msg)

        try:
            asyncio.run_coroutine_threadsafe(dump_counters(), loop).result(timeout)
            return True
        except Exception as e:            # noqa: BLE001 - a scrape must not fail
            log.warning("link counters not read: %r", e)
            return False

    def snapshot(self, refresh: bool = False) -> dict:
        """State of the watch, JSON-ready, for ``sparkguard status`` / ``doctor``.

        Args:
            refresh: read the counters now first (see :meth:`refresh_counters`).
        Returns:
            ``{"running": bool, "netns": str|None, "down_after_seconds": float,
            "events": int, "incidents": int, "resyncs": int, "interfaces": {name: {"present",
            "up", "carrier", "operstate", "speed_bytes_per_second" (int|None),
            "down_since" (unix|None), "last_change" (unix|None), "carrier_changes" (int|None),
            "rx_errors", "tx_errors", "rx_dropped", "tx_dropped" (ints, absent if unknown),
            "open_incident" (id|None)}}}``.
        """
        if refresh:
            self.refresh_counters()
        with self._lock:
            ifs = {}
            for name, st in self._state.items():
                d = {"present": st["present"], "up": st["up"], "carrier": st["carrier"],
                     "operstate": st["operstate"],
                     "speed_bytes_per_second": st["speed_mbps"] * 125_000 if st["speed_mbps"] else None,
                     "down_since": st["down_since"], "last_change": st["last_change"],
                     "carrier_changes": st["carrier_changes"],
                     "open_incident": self._incidents[name].id if name in self._incidents else None}
                d.update(st["stats"])
                ifs[name] = d
            return {"running": self.running, "netns": self.netns, "down_after_seconds": self.down_after,
                    **self._counts, "interfaces": ifs}

    def collector(self):
        """A prometheus_client collector of the link metrics (TEAM.md "Metric names").

        Per interface (label ``interface``): ``sparkguard_link_up`` and
        ``sparkguard_link_carrier`` (gauges 0/1; a missing interface gives 0),
        ``sparkguard_link_speed_bytes_per_second`` (gauge; Mb/s x 125000; absent when the
        link is down or the speed is unknown), and the counters
        ``sparkguard_link_{rx,tx}_{errors,dropped}_total`` and
        ``sparkguard_link_carrier_changes_total`` read from netlink at scrape time
        (absent for a missing interface).  Register it with ``registry.register(...)``.
        """
        return _LinkCollector(self)


class _LinkCollector:
    def __init__(self, watch: LinkWatch):
        self.watch = watch

    def describe(self):
        """Metric families without samples (so registering does not trigger a scrape)."""
        return list(self._families().values())

    def _families(self) -> dict:
        """``{key: empty metric family}``; keys: up, carrier, speed, the STAT_KEYS, carrier_changes."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        lab = ["interface"]
        fams = {
            "up": GaugeMetricFamily("sparkguard_link_up",
                                    "1 when the watched interface is operationally up (operstate UP)", labels=lab),
            "carrier": GaugeMetricFamily("sparkguard_link_carrier",
                                         "1 when the interface has carrier (IFLA_CARRIER)", labels=lab),
            "speed": GaugeMetricFamily("sparkguard_link_speed_bytes_per_second",
                                       "Negotiated link speed in bytes per second (absent when down or unknown)",
                                       labels=lab),
        }
        for stem, what in (("rx_errors", "Receive errors"), ("tx_errors", "Transmit errors"),
                           ("rx_dropped", "Received packets dropped"), ("tx_dropped", "Transmit packets dropped")):
            fams[stem] = CounterMetricFamily(f"sparkguard_link_{stem}", f"{what} (IFLA_STATS64)", labels=lab)
        fams["carrier_changes"] = CounterMetricFamily(
            "sparkguard_link_carrier_changes", "Carrier up/down transitions counted by the kernel", labels=lab)
        return fams

    def collect(self):
        """Yield the metric families, counters read now (bounded to 1 s)."""
        fams = self._families()
        self.watch.refresh_counters(timeout=1.0)
        with self.watch._lock:
            states = [dict(st, stats=dict(st["stats"])) for st in self.watch._state.values()]
        for st in states:
            lv = [st["ifname"]]
            fams["up"].add_metric(lv, 1.0 if st["up"] else 0.0)
            fams["carrier"].add_metric(lv, 1.0 if st["present"] and st["carrier"] else 0.0)
            if st["up"] and st["speed_mbps"]:
                fams["speed"].add_metric(lv, st["speed_mbps"] * 125_000.0)
            if st["present"]:
                for stem in STAT_KEYS:
                    if stem in st["stats"]:
                        fams[stem].add_metric(lv, float(st["stats"][stem]))
                if st["carrier_changes"] is not None:
                    fams["carrier_changes"].add_metric(lv, float(st["carrier_changes"]))
        yield from fams.values()


def read_links(interfaces: Iterable[str], netns: str | None = None) -> dict:
    """One-shot state of ``interfaces`` without a watch thread (``sparkguard doctor``/``status``
    when no daemon runs).

    Returns:
        ``{name: {"present", "up", "carrier", "operstate", "speed_bytes_per_second",
        "carrier_changes", "rx_errors", "tx_errors", "rx_dropped", "tx_dropped"}}``;
        a missing interface has ``present`` False and ``up`` False.
    Raises:
        OSError: no netlink socket (or ``netns`` does not exist).
    """
    from pyroute2 import IPRoute

    names = list(dict.fromkeys(interfaces))
    states = {n: _new_state(n) for n in names}
    kw = {"netns": netns, "flags": 0} if netns is not None else {}
    with IPRoute(**kw) as ipr:
        for msg in ipr.link("dump"):
            st = states.get(msg.get("ifname"))
            if st is not None:
                _apply_msg(st, msg, deleted=False)
    sock = None
    if netns is not None and any(st["present"] for st in states.values()):
        import socket

        from pyroute2 import netns as _netns
        sock = _netns.create_socket(netns, socket.AF_INET, socket.SOCK_DGRAM, flags=0)
    out = {}
    try:
        for n, st in states.items():
            up = st["present"] and _is_up(st["operstate"], st["flags"])
            speed = None
            if up:
                speed = _sysfs_speed_mbps(n) if sock is None else _ethtool_speed_mbps(sock.fileno(), n)
            out[n] = {"present": st["present"], "up": up, "carrier": st["carrier"], "operstate": st["operstate"],
                      "speed_bytes_per_second": speed * 125_000 if speed else None,
                      "carrier_changes": st["carrier_changes"], **st["stats"]}
    finally:
        if sock is not None:
            sock.close()
    return out

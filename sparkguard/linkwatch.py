"""Watch the tensor-parallel (TP) fabric link through netlink events.

A TP engine spread over several Sparks hangs when its inter-node link (the ConnectX-7
ports) drops: NCCL waits inside a collective and the engine neither dies nor serves.
:class:`LinkWatch` follows the configured interfaces as the kernel reports them:

* one thread owns one rtnetlink socket (pyroute2 ``AsyncIPRoute`` in the thread's own
  asyncio loop), bound to the ``RTMGRP_LINK`` multicast group *before* any request is
  sent on it (pyroute2 0.9: objects belong to the thread that made them).  Every
  ``RTM_NEWLINK``/``RTM_DELLINK`` is applied as it arrives; nothing is polled.
* the messages feed :class:`sparkguard.linkstate.LinkStates`, which decides: a link that goes
  from up to down and stays down longer than ``down_after`` seconds is an incident of kind
  ``"link"`` (docs/incident.md), handed to ``on_incident`` when it is declared and again,
  completed, when the link is back; every up/down transition is handed to
  ``on_change(ifname, up)`` so the engine supervisor can mark the engine unhealthy;
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

import logging
import threading
import time
from typing import Callable, Iterable

from sparkguard.linkstate import (STAT_KEYS, LinkStates, apply_counters, apply_msg, is_up, link_field, new_state,
                                  valid_ifname)

log = logging.getLogger("sparkguard.linkwatch")

#: rtnetlink multicast group of link events (include/uapi/linux/rtnetlink.h)
RTMGRP_LINK = 0x1
SIOCETHTOOL = 0x8946
ETHTOOL_GSET = 0x1
SYS_CLASS_NET = "/sys/class/net"


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
            with a deep copy of the incident record (docs/incident.md, kind
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
        # the decisions; fed by this thread, its timers on this thread's asyncio loop
        self.states = LinkStates(names, down_after, on_incident, on_change, netns=netns, clock=clock,
                                 speed=self._speed)
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
        self.states.schedule = loop.call_later
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
            self.states.report_initial(f" in netns {self.netns}" if self.netns else "")
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
            self.states.cancel_timers()
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
                    name = link_field(msg, "ifname")
                    if name in self.states.state:
                        self.states.counts["events"] += 1
                        self.states.update(name, msg, deleted=(ev == "RTM_DELLINK"))

    async def _dump(self) -> list:
        return [m async for m in await self._ipr.link("dump")]

    async def _resync(self, initial: bool) -> None:
        msgs = await self._dump()
        seen = set()
        for msg in msgs:
            name = link_field(msg, "ifname")
            if name in self.states.state:
                seen.add(name)
                self.states.update(name, msg, deleted=False, initial=initial)
        for name in self.states.state:
            if name not in seen:
                self.states.update(name, None, deleted=True, initial=initial)
        if not initial:
            self.states.counts["resyncs"] += 1

    # ---------------------------------------------------------------- state machine (watch thread)

    def _speed(self, name: str) -> int | None:
        if self.netns is None:
            return _sysfs_speed_mbps(name)
        if self._speed_sock is None:
            return None
        return _ethtool_speed_mbps(self._speed_sock.fileno(), name)


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
            with self.states.lock:
                for msg in msgs:
                    st = self.states.state.get(link_field(msg, "ifname"))
                    if st is not None:
                        apply_counters(st, msg)

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
        with self.states.lock:
            ifs = {}
            for name, st in self.states.state.items():
                d = {"present": st["present"], "up": st["up"], "carrier": st["carrier"],
                     "operstate": st["operstate"],
                     "speed_bytes_per_second": st["speed_mbps"] * 125_000 if st["speed_mbps"] else None,
                     "down_since": st["down_since"], "last_change": st["last_change"],
                     "carrier_changes": st["carrier_changes"],
                     "open_incident": self.states.incidents[name].id if name in self.states.incidents else None}
                d.update(st["stats"])
                ifs[name] = d
            return {"running": self.running, "netns": self.netns, "down_after_seconds": self.down_after,
                    **self.states.counts, "interfaces": ifs}

    def collector(self):
        """A prometheus_client collector of the link metrics (names: docs/metrics.md).

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
        with self.watch.states.lock:
            states = [dict(st, stats=dict(st["stats"])) for st in self.watch.states.state.values()]
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
    when no daemon runs).  Works with pyroute2 0.7 too (its synchronous ``IPRoute``; the fields are
    read by :func:`sparkguard.linkstate.link_field`), where the watch thread cannot run.

    Returns:
        ``{name: {"present", "up", "carrier", "operstate", "speed_bytes_per_second",
        "carrier_changes", "rx_errors", "tx_errors", "rx_dropped", "tx_dropped"}}``;
        a missing interface has ``present`` False and ``up`` False.
    Raises:
        OSError: no netlink socket (or ``netns`` does not exist).
        ImportError: no pyroute2.
    """
    from pyroute2 import IPRoute

    names = list(dict.fromkeys(interfaces))
    states = {n: new_state(n) for n in names}
    kw = {"netns": netns, "flags": 0} if netns is not None else {}
    with IPRoute(**kw) as ipr:
        for msg in ipr.link("dump"):
            st = states.get(link_field(msg, "ifname"))
            if st is not None:
                apply_msg(st, msg, deleted=False)
    sock = None
    if netns is not None and any(st["present"] for st in states.values()):
        import socket

        from pyroute2 import netns as _netns
        sock = _netns.create_socket(netns, socket.AF_INET, socket.SOCK_DGRAM, flags=0)
    out = {}
    try:
        for n, st in states.items():
            up = st["present"] and is_up(st["operstate"], st["flags"])
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

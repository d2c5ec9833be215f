"""Prometheus metrics for the daemon: a collector built at scrape time and a small HTTP server.

Nothing here runs in the poll loop.  :class:`GuardCollector` calls the daemon's
``snapshot()`` (a cheap dict copy, see TEAM.md "Daemon snapshot") from the HTTP thread when
Prometheus scrapes, and reads PSI and zram itself at that moment through
:mod:`sparkguard.sysinfo`; so the loop pays nothing per poll.

The server is deliberately small: one thread, one request at a time, on its own
:class:`prometheus_client.CollectorRegistry` (never the global default), bound to loopback
unless the configuration says otherwise (prometheus_client's own ``start_http_server``
binds 0.0.0.0 by default and starts a thread per request; under ``mlockall(MCL_FUTURE)``
each such thread's 8 MiB default stack becomes locked resident memory, measured +8 MiB
RSS per scrape thread against the daemon's 30 MiB budget).

Metric names follow TEAM.md "Metric names": prefix ``sparkguard_``, base units (bytes,
seconds, ratios 0-1), counters end in ``_total``.  ``promtool check metrics`` passes on
the output (tests/test_metrics.py runs it).
"""

from __future__ import annotations

import logging
import os
import selectors
import socket
import threading
import time
from typing import Any, Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.exposition import make_wsgi_app
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    InfoMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from sparkguard import __version__, sysinfo

log = logging.getLogger("sparkguard.metrics")

#: Default ``metrics.listen``.  8799 lies outside 9100-9999 (Prometheus' default port
#: allocation list, full) and is not a well-known port of any peer tool.
DEFAULT_LISTEN = ("127.0.0.1", 8799)

#: Guard states, in the order the daemon moves through them (TEAM.md "Daemon snapshot");
#: ``no_target``: below the line with nothing to signal (``sparkguard.policy.NO_TARGET``).
#: All are exported from the first scrape, so ``guard_state{state="no_target"} == 1`` can be alerted on.
STATES = ("ok", "term_sent", "kill_sent", "recovering", "no_target")

#: Stack of the HTTP thread.  The daemon mlockall()s: every byte of a thread's stack is
#: resident, so the default 8 MiB would cost 8 MiB RSS.
THREAD_STACK_BYTES = 256 * 1024

#: Seconds a client may take to send its request before the server drops it (the server
#: handles one request at a time; a stalled client must not block scrapes for long).
REQUEST_TIMEOUT = 5.0

P = "sparkguard_"


class MetricsListenError(OSError):
    """The metrics server could not bind ``host:port``.

    Attributes:
        address: str, ``"host:port"`` as configured.
        errno / strerror: from the underlying OSError (``EADDRINUSE`` when the port is taken).
    """

    def __init__(self, address: str, err: OSError):
        super().__init__(err.errno, f"cannot listen for metrics on {address} (metrics.listen): "
                                    f"{err.strerror or err}")
        self.address = address

    def __str__(self) -> str:
        return self.strerror


def _gauge(name: str, doc: str, value: Any, labels: dict[str, str] | None = None) -> Metric | None:
    """One-sample gauge, or None when ``value`` is None (the metric is then absent)."""
    if value is None:
        return None
    if labels:
        g = GaugeMetricFamily(P + name, doc, labels=list(labels))
        g.add_metric(list(labels.values()), float(value))
        return g
    return GaugeMetricFamily(P + name, doc, value=float(value))


class GuardCollector:
    """Builds every ``sparkguard_*`` metric at scrape time.

    Args:
        snapshot: ``() -> dict`` returning the daemon snapshot (keys as in TEAM.md "Daemon
            snapshot"; missing keys or None values leave their metrics out).  Called once per
            scrape from the HTTP thread; an exception is logged and the guard's metrics are left
            out of that scrape (PSI, zram and build info still appear) rather than failing it.
        read_psi: ``() -> dict | None``, default :func:`sparkguard.sysinfo.read_psi_memory`.
        read_zram: ``() -> list[dict]``, default :func:`sparkguard.sysinfo.read_zram`.

    Sources: /proc/meminfo (MemAvailable, MemTotal, SwapFree, SwapTotal; Documentation/
    filesystems/proc.rst), /proc/pressure/memory (Documentation/accounting/psi.rst),
    /sys/block/zram*/mm_stat (Documentation/admin-guide/blockdev/zram.rst).
    """

    def __init__(self, snapshot: Callable[[], dict],
                 read_psi: Callable[[], dict | None] = sysinfo.read_psi_memory,
                 read_zram: Callable[[], list[dict]] = sysinfo.read_zram):
        self._snapshot = snapshot
        self._read_psi = read_psi
        self._read_zram = read_zram
        self._last_error = ""

    def collect(self) -> Iterator[Metric]:
        """Yield the metric families for one scrape (prometheus_client Collector protocol)."""
        info = InfoMetricFamily(P + "build", "sparkguard version running (value 1).")
        info.add_metric([], {"version": __version__})
        yield info
        try:
            snap = self._snapshot() or {}
        except Exception as e:  # the scrape must still answer; the daemon keeps guarding
            msg = f"{type(e).__name__}: {e}"
            if msg != self._last_error:
                log.warning("metrics: daemon snapshot failed, guard metrics left out: %s", msg)
                self._last_error = msg
            snap = {}
        for m in self._guard(snap):
            if m is not None:
                yield m
        yield from self._psi()
        yield from self._zram()

    # --- the daemon's own state

    def _guard(self, s: dict) -> Iterable[Metric | None]:
        mi = "from /proc/meminfo at the daemon's last poll"
        yield _gauge("memory_available_bytes", f"MemAvailable in bytes, {mi}.", s.get("available_bytes"))
        yield _gauge("memory_total_bytes", f"MemTotal in bytes, {mi}.", s.get("total_bytes"))
        yield _gauge("swap_free_bytes", f"SwapFree in bytes (zram included), {mi}.", s.get("swap_free_bytes"))
        yield _gauge("swap_total_bytes", f"SwapTotal in bytes (zram included), {mi}.", s.get("swap_total_bytes"))
        yield _gauge("guard_signal_bytes",
                     "Bytes the guard compares with its lines at the last poll: MemAvailable, or "
                     "MemAvailable+SwapFree when guard.signal is available+swap.", s.get("signal_bytes"))
        yield _gauge("term_below_bytes", "SIGTERM line (guard.term_below): the target is sent SIGTERM "
                     "when the signal falls below this many bytes.", s.get("term_below_bytes"))
        yield _gauge("kill_below_bytes", "SIGKILL floor (guard.kill_below): below this many bytes the "
                     "rest of the grace period is skipped. Absent when off.", s.get("kill_below_bytes"))
        yield _gauge("grace_seconds", "Seconds between SIGTERM and SIGKILL of the whole tree (guard.grace).",
                     s.get("grace_seconds"))
        yield _gauge("poll_interval_seconds", "Slowest interval between two polls of /proc/meminfo "
                     "(guard.poll_interval); the loop polls faster as headroom shrinks.",
                     s.get("poll_interval_seconds"))
        state = s.get("state")
        if state is not None:
            g = GaugeMetricFamily(P + "guard_state", "Guard state machine: 1 for the current state, 0 for "
                                  "the others (ok, term_sent, kill_sent, recovering, no_target).", labels=["state"])
            for st in STATES + (() if state in STATES else (str(state),)):
                g.add_metric([st], 1.0 if st == state else 0.0)
            yield g
        if s.get("dry_run") is not None:
            yield _gauge("dry_run", "1 when guard.dry_run is on: decisions are made and reported, "
                         "no signal is sent.", 1 if s["dry_run"] else 0)
        view = s.get("proc_view") or {}
        yield _gauge("visible_processes", "Processes the guard saw in /proc when it started.", view.get("processes"))
        yield _gauge("visible_other_user_processes", "Processes of other users whose /proc/PID/stat the guard "
                     "could read when it started (hidepid= hides them from a guard without CAP_SYS_PTRACE).",
                     view.get("other_users_readable"))
        if s.get("signals_sent") is not None:
            c = CounterMetricFamily(P + "signals", "Signals sent to targets since the daemon started, "
                                    "by signal (each process signalled counts once).", labels=["signal"])
            sent = dict(s["signals_sent"])
            for sig in ("SIGTERM", "SIGKILL"):
                sent.setdefault(sig, 0)
            for sig, n in sorted(sent.items()):
                c.add_metric([sig], float(n))
            yield c
        if s.get("incidents") is not None:
            c = CounterMetricFamily(P + "incidents", "Incidents (episodes from a crossing until memory is "
                                    "back and the victim gone) since the daemon started, by kind.",
                                    labels=["kind"])
            kinds = dict(s["incidents"])
            kinds.setdefault("memory", 0)
            for kind, n in sorted(kinds.items()):
                c.add_metric([str(kind)], float(n))
            yield c
        yield _gauge("last_incident_timestamp_seconds", "Unix time the last incident started. Absent "
                     "until the first incident.", s.get("last_incident_timestamp"))
        if s.get("poll_count") is not None and s.get("poll_seconds_sum") is not None:
            yield SummaryMetricFamily(P + "poll_duration_seconds", "Time spent in the timed polls of the "
                                      "loop (read /proc/meminfo, decide, act), seconds: every poll near the line "
                                      "or in an incident, one every 2 s while idle; _count is the number of timed "
                                      "polls.", count_value=int(s["poll_count"]), sum_value=float(s["poll_seconds_sum"]))
        if s.get("polls_total") is not None:
            c = CounterMetricFamily(P + "polls", "Reads of /proc/meminfo by the loop since start (timed and "
                                    "idle fast-path polls); its rate is the polling rate.")
            c.add_metric([], float(s["polls_total"]))
            yield c
        for key, name, what in (("notify_dropped", "notify_dropped", "sd_notify datagrams (WATCHDOG=1, STATUS=...) "
                                 "the service manager's socket could not take at once (queue full, no listener), "
                                 "dropped so the poll loop never waits"),
                                ("log_dropped", "log_dropped", "log records dropped because the queue to the stderr "
                                 "writer was full (stderr stalled); the poll loop never waits for its log")):
            if s.get(key) is not None:
                c = CounterMetricFamily(P + name, what + ".")
                c.add_metric([], float(s[key]))
                yield c
        yield _gauge("last_poll_timestamp_seconds", "Unix time of the daemon's last poll; a stale value "
                     "means the loop is stuck.", s.get("last_poll_timestamp"))
        yield _gauge("start_time_seconds", "Unix time the guard started.", s.get("started_timestamp"))
        if s.get("config_reloads") is not None:
            c = CounterMetricFamily(P + "config_reloads", "Configuration reloads (SIGHUP) since start, by "
                                    "result; a failed reload keeps the running configuration.",
                                    labels=["result"])
            r = dict(s["config_reloads"])
            for res in ("ok", "failed"):
                c.add_metric([res], float(r.get(res, 0)))
            yield c

    # --- read at scrape time

    def _psi(self) -> Iterator[Metric]:
        try:
            psi = self._read_psi()
        except Exception as e:  # sysinfo never raises; belt and braces for a custom reader
            log.warning("metrics: PSI read failed: %s", e)
            psi = None
        if not psi:
            return
        stalled = CounterMetricFamily(P + "pressure_memory_stalled_seconds", "Total time some / all "
                                      "non-idle tasks were stalled on memory, seconds "
                                      "(/proc/pressure/memory total=).", labels=["kind"])
        for kind in ("some", "full"):
            vals = psi.get(kind)
            if not vals:
                continue
            g = GaugeMetricFamily(P + f"pressure_memory_{kind}_ratio",
                                  f"Share of wall time (0-1) {'some' if kind == 'some' else 'all'} non-idle "
                                  f"tasks were stalled on memory, averaged over the window "
                                  f"(/proc/pressure/memory '{kind}' avgN / 100).", labels=["window"])
            for w in ("avg10", "avg60", "avg300"):
                if w in vals:
                    g.add_metric([w], vals[w] / 100.0)
            yield g
            if "total_us" in vals:
                stalled.add_metric([kind], vals["total_us"] / 1e6)
        if stalled.samples:
            yield stalled

    def _zram(self) -> Iterator[Metric]:
        try:
            devs = self._read_zram()
        except Exception as e:
            log.warning("metrics: zram read failed: %s", e)
            devs = []
        if not devs:
            return
        src = "/sys/block/<device>/"
        fams = [
            ("disksize_bytes", "disksize_bytes", f"Uncompressed capacity of the zram swap device, bytes ({src}disksize)."),
            ("orig_data_bytes", "orig_data_bytes", f"Uncompressed bytes stored in the zram device ({src}mm_stat orig_data_size)."),
            ("compr_data_bytes", "compr_data_bytes", f"Compressed size of the stored data, bytes ({src}mm_stat compr_data_size)."),
            ("mem_used_bytes", "mem_used_bytes", f"RAM the zram device really uses, allocator overhead included, bytes "
                                                f"({src}mm_stat mem_used_total); this comes out of MemAvailable."),
        ]
        for name, key, doc in fams:
            g = GaugeMetricFamily(P + "zram_" + name, doc, labels=["device"])
            for d in devs:
                if key in d:
                    g.add_metric([d["device"]], float(d[key]))
            if g.samples:
                yield g


def build_registry(snapshot: Callable[[], dict], extra_collectors: Iterable[Any] = ()) -> CollectorRegistry:
    """A fresh :class:`CollectorRegistry` with the guard, process and extra collectors.

    The process collector adds ``process_resident_memory_bytes``, ``process_cpu_seconds_total``,
    ``process_open_fds``... of this process (read from /proc/self at scrape time).
    """
    reg = CollectorRegistry()
    ProcessCollector(registry=reg)
    reg.register(GuardCollector(snapshot))
    for c in extra_collectors:
        reg.register(c)
    return reg


class _Handler(WSGIRequestHandler):
    """Request handler that logs nothing and gives up on a stalled client."""

    timeout = REQUEST_TIMEOUT

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (stdlib signature)
        pass


class MetricsServer:
    """A running metrics endpoint (returned by :func:`start_server`).

    Attributes:
        registry: the :class:`CollectorRegistry` served.
        address: ``(host, port)`` actually bound (port resolved when 0 was asked for).
        url: ``http://host:port/metrics``.
    """

    def __init__(self, httpd: WSGIServer, thread: threading.Thread, registry: CollectorRegistry,
                 wake_w: int):
        self._httpd, self._thread, self.registry, self._wake_w = httpd, thread, registry, wake_w
        host, port = httpd.server_address[:2]
        self.address = (host, port)
        self.url = f"http://{'[' + host + ']' if ':' in host else host}:{port}/metrics"

    def register_collector(self, collector: Any) -> None:
        """Add a collector (an object with ``collect() -> Iterable[Metric]``) to this endpoint.

        Used by the engine supervisor and link watch.  Raises ValueError (prometheus_client)
        if it describes a metric name already registered.
        """
        self.registry.register(collector)

    def unregister_collector(self, collector: Any) -> None:
        """Remove a collector added with :meth:`register_collector`.  Raises KeyError if unknown."""
        self.registry.unregister(collector)

    def stop(self, timeout: float = 5.0) -> None:
        """Stop serving, close the socket and join the thread (at most ``timeout`` seconds)."""
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass
        self._thread.join(timeout)
        self._httpd.server_close()
        if self in _servers:
            _servers.remove(self)

    shutdown = stop

    def __enter__(self) -> "MetricsServer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


_servers: list[MetricsServer] = []


def _serve(httpd: WSGIServer, wake_r: int) -> None:
    """Serve requests one at a time until ``wake_r`` becomes readable.

    Unlike ``serve_forever(poll_interval)``, this sleeps in poll(2) with no timeout: an idle
    daemon's metrics thread never wakes up (the idle CPU budget is 0.05 % of a core).
    """
    sel = selectors.PollSelector()
    sel.register(httpd, selectors.EVENT_READ)
    sel.register(wake_r, selectors.EVENT_READ)
    try:
        while True:
            for key, _ in sel.select(None):
                if key.fileobj == wake_r:
                    return
                httpd._handle_request_noblock()  # BaseServer's accept + handle + close, errors handled
    finally:
        sel.close()
        os.close(wake_r)


def start_server(listen: tuple[str, int] = DEFAULT_LISTEN, snapshot: Callable[[], dict] | None = None,
                 extra_collectors: Iterable[Any] = ()) -> MetricsServer:
    """Serve ``/metrics`` on ``listen`` from a daemon thread with a small stack.

    Args:
        listen: ``(host, port)`` from ``metrics.listen``; host ``""`` means 127.0.0.1 (never all
            interfaces unless configured so, e.g. ``0.0.0.0:8799``); port 0 picks a free port.
        snapshot: the daemon's ``Guard.snapshot`` (``() -> dict``); None serves only PSI, zram,
            process and build metrics.
        extra_collectors: more collectors for the same registry (engine supervisor, link watch).
    Returns:
        :class:`MetricsServer` with ``.stop()``, ``.address``, ``.url``, ``.register_collector()``.
    Raises:
        MetricsListenError: the address cannot be bound (port taken: ``EADDRINUSE``; unknown
            host name); the message names ``host:port``.
    """
    host, port = listen
    host = host or "127.0.0.1"
    shown = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    registry = build_registry(snapshot or dict, extra_collectors)

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, _, _, _, sockaddr = infos[0]

        class _Server(WSGIServer):
            address_family = family
            # allow_reuse_address (SO_REUSEADDR) lets a restarted daemon bind while old
            # connections sit in TIME_WAIT; a live listener still gives EADDRINUSE.

        httpd = _Server(sockaddr[:2], _Handler)
    except socket.gaierror as e:
        raise MetricsListenError(shown, OSError(e.errno, f"unknown host {host!r}: {e.strerror}")) from None
    except OSError as e:
        raise MetricsListenError(shown, e) from None
    httpd.set_app(make_wsgi_app(registry))

    wake_r, wake_w = os.pipe2(os.O_CLOEXEC)
    old = threading.stack_size(THREAD_STACK_BYTES)
    try:
        t = threading.Thread(target=_serve, args=(httpd, wake_r), name="sparkguard-metrics", daemon=True)
        t.start()
    finally:
        threading.stack_size(old)
    server = MetricsServer(httpd, t, registry, wake_w)
    _servers.append(server)
    log.info("metrics on %s", server.url)
    return server


def register_collector(collector: Any, server: MetricsServer | None = None) -> None:
    """Add ``collector`` to ``server``, or to the most recently started server when None.

    Raises:
        RuntimeError: no server was started (metrics.listen is off); callers may ignore it.
    """
    target = server or (_servers[-1] if _servers else None)
    if target is None:
        raise RuntimeError("no metrics server is running (metrics.listen off?)")
    target.register_collector(collector)


def scrape_text(snapshot: Callable[[], dict], extra_collectors: Iterable[Any] = ()) -> str:
    """The exposition text one scrape would return, without a server (for tools and tests)."""
    from prometheus_client import generate_latest
    return generate_latest(build_registry(snapshot, extra_collectors)).decode()


if __name__ == "__main__":  # pragma: no cover - manual look at the output
    now = time.time()
    print(scrape_text(lambda: {"available_bytes": 1, "state": "ok", "poll_count": 1, "poll_seconds_sum": 1e-5,
                               "started_timestamp": now}))

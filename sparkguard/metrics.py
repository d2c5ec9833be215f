"""Prometheus metrics for the daemon: a collector built at scrape time and a small HTTP server.

Nothing here runs in the poll loop.  :class:`GuardCollector` calls the daemon's
``snapshot()`` (a cheap dict copy, see TEAM.md "Daemon snapshot") from the HTTP thread when
Prometheus scrapes, and reads PSI and zram itself at that moment through
:mod:`sparkguard.sysinfo`; so the loop pays nothing per poll.

The server is deliberately small: one thread and one poll(2) loop for every connection, on its own
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

import errno
import gzip
import logging
import os
import select
import selectors
import socket
import threading
import time
from typing import Any, Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    InfoMetricFamily,
    Metric,
    SummaryMetricFamily,
)

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

#: Seconds from accepting a connection until its answer is written, reads and writes together;
#: a client slower than that is dropped (a slowloris client holds one slot for this long at most).
#: Prometheus sends its request at once and reads its answer at once.
REQUEST_DEADLINE = 3.0
#: Bytes of request line + headers; Prometheus sends about 300.
MAX_HEAD = 8192
#: Open connections at most; each holds one fd of the daemon, which also needs one per victim process.
MAX_CONNECTIONS = 64
#: Connections taken per wake-up of the listening socket.
ACCEPT_BATCH = 16
LISTEN_BACKLOG = 128
#: Seconds between two renderings of the registry (one costs about 1-1.5 ms of CPU, measured on
#: the dev VM): at most 10 a second, whatever the number of clients.
RENDER_GAP = 0.1
#: Seconds without accepting after accept() failed for lack of fds or memory.
ACCEPT_PAUSE = 0.5
#: Seconds before the first new attempt to bind a port that could not be bound, doubling to RETRY_MAX.
RETRY_FIRST, RETRY_MAX = 1.0, 60.0

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


class _Conn:
    """One client connection: its request head as it arrives, then the response being written."""

    __slots__ = ("sock", "head", "deadline", "request", "out")

    def __init__(self, sock: socket.socket, deadline: float):
        self.sock, self.head, self.deadline = sock, b"", deadline
        self.request: tuple[str, str, str] | None = None    # (method, accept, accept-encoding)
        self.out = b""


def parse_head(head: bytes) -> tuple[str, str, str] | int:
    """``(method, Accept, Accept-Encoding)`` of a complete HTTP/1.x request head, or the HTTP
    status to answer (400) when it is not one.  Source: RFC 9112 sections 3 and 5."""
    lines = head.decode("latin-1").split("\n")
    parts = lines[0].strip().split()
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        return 400
    accept = encoding = ""
    for ln in lines[1:]:
        name, sep, value = ln.partition(":")
        if not sep:
            continue
        name = name.strip().lower()
        if name == "accept":
            accept = value.strip()
        elif name == "accept-encoding":
            encoding = value.strip()
    return parts[0], accept, encoding


def _response(status: str, headers: list[tuple[str, str]], body: bytes, head_only: bool = False) -> bytes:
    lines = [f"HTTP/1.1 {status}", *(f"{k}: {v}" for k, v in headers),
             f"Content-Length: {len(body)}", "Connection: close", "", ""]
    return "\r\n".join(lines).encode("latin-1") + (b"" if head_only else body)


class MetricsServer:
    """The metrics endpoint: one thread that binds, serves, and binds again with a backoff.

    Args:
        listen: ``(host, port)`` as configured (host already defaulted).
        registry: the :class:`CollectorRegistry` served.

    Attributes:
        registry: the registry served.
        address: ``(host, port)`` bound (port resolved when 0 was asked for), or the configured
            one while not bound.
        url: ``http://host:port/metrics``.

    The thread serves every connection from one poll(2) loop, so the endpoint never has more
    than one thread whatever the clients do.  Bounds (each a module constant): a request head
    of :data:`MAX_HEAD` bytes (431 beyond), :data:`REQUEST_DEADLINE` seconds from accept until
    the response is written (a slow or stalled client is dropped then, whichever read or write
    it stalls in), :data:`MAX_CONNECTIONS` open connections (beyond, the oldest one still
    sending its request is dropped; when all are waiting for their answer, new ones wait in the
    kernel's accept queue), and at most one rendering of the registry per :data:`RENDER_GAP`
    seconds: every request complete by then is answered from that rendering, made after it
    arrived (values are read at scrape time, never cached across requests).  A flood of
    clients therefore costs the process at most one rendering per RENDER_GAP and a bounded
    number of short reads and writes, and Prometheus' request is answered within RENDER_GAP of
    arriving.
    """

    def __init__(self, listen: tuple[str, int], registry: CollectorRegistry):
        self.registry = registry
        self._listen = listen
        self._shown = _shown(*listen)
        self._set_address(listen)
        self._lock = threading.Lock()
        self._state: dict = {"serving": False, "address": self._shown, "error": None, "holder": None,
                             "attempts": 0, "next_attempt_in_seconds": None}
        self._next_attempt: float | None = None
        self._stopping = False
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None

    def _set_address(self, addr: tuple[str, int]) -> None:
        host, port = addr[:2]
        self.address = (host, port)
        self.url = f"http://{'[' + host + ']' if ':' in host else host}:{port}/metrics"

    # ---- state, for snapshot / STATUS= / status / doctor

    def state(self) -> dict:
        """``{"serving": bool, "address": "host:port", "error": str | None, "holder": str | None,
        "attempts": int, "next_attempt_in_seconds": float | None}``: ``error`` why it is not
        serving ("address in use"...), ``holder`` who listens on the port then
        (:meth:`sparkguard.portowner.Holder.describe`), ``attempts`` binds failed in a row."""
        with self._lock:
            st = dict(self._state)
            nxt = self._next_attempt
        if nxt is not None and not st["serving"]:
            st["next_attempt_in_seconds"] = round(max(0.0, nxt - time.monotonic()), 1)
        return st

    def problem(self) -> str | None:
        """None while serving, else one line for STATUS= and the log:
        ``metrics NOT serving on 127.0.0.1:8799: address in use (held by pid 42 nc, uid 1000)``."""
        st = self.state()
        if st["serving"]:
            return None
        held = f" (held by {st['holder']})" if st["holder"] else ""
        return f"metrics NOT serving on {st['address']}: {st['error'] or 'starting'}{held}"

    # ---- binding

    def _bind(self) -> socket.socket:
        """A listening non-blocking socket on the configured address.  Raises MetricsListenError."""
        host, port = self._listen
        try:
            family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                           flags=socket.AI_PASSIVE)[0]
        except socket.gaierror as e:
            raise MetricsListenError(self._shown, OSError(e.errno, f"unknown host {host!r}: {e.strerror}")) from None
        s = socket.socket(family, socket.SOCK_STREAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK)
        try:
            # SO_REUSEADDR lets a restarted daemon bind while old connections sit in TIME_WAIT;
            # a live listener still gives EADDRINUSE.
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(sockaddr[:2])
            s.listen(LISTEN_BACKLOG)
        except OSError as e:
            s.close()
            raise MetricsListenError(self._shown, e) from None
        return s

    def _bound(self, sock: socket.socket) -> None:
        self._sock = sock
        self._set_address(sock.getsockname())
        with self._lock:
            failed = self._state["attempts"]
            self._state.update(serving=True, error=None, holder=None, attempts=0, next_attempt_in_seconds=None)
            self._next_attempt = None
        if failed:
            log.warning("metrics on %s: serving after %d failed attempts", self.url, failed)
        else:
            log.info("metrics on %s", self.url)

    def _failed(self, e: OSError, delay: float) -> None:
        """Record and log a failed bind (or a server that ended); ``delay``: seconds to the next try."""
        from sparkguard import portowner
        holder = None
        if e.errno in (errno.EADDRINUSE, errno.EACCES):
            h = portowner.find_holder(self._listen[1])
            holder = h.describe() if h is not None else None
        reason = _REASONS.get(e.errno) or str(e.strerror or e)
        with self._lock:
            same = self._state["error"] == reason and self._state["holder"] == holder
            self._state.update(serving=False, error=reason, holder=holder, attempts=self._state["attempts"] + 1)
            self._next_attempt = time.monotonic() + delay
        if not same:
            log.error("%s (metrics.listen); the guard keeps guarding without it and binds again every "
                      "%g-%g s", self.problem(), RETRY_FIRST, RETRY_MAX)
        else:
            log.debug("%s; next attempt in %g s", self.problem(), delay)

    def start(self, retry: bool) -> "MetricsServer":
        """Bind now and start the thread.  ``retry``: a failed bind is logged and tried again
        in the thread with a backoff; else it raises MetricsListenError and nothing runs."""
        try:
            self._bound(self._bind())
            delay = RETRY_FIRST
        except MetricsListenError as e:
            if not retry:
                os.close(self._wake_r)
                os.close(self._wake_w)
                raise
            delay = RETRY_FIRST
            self._failed(e, delay)
        old = threading.stack_size(THREAD_STACK_BYTES)
        try:
            self._thread = threading.Thread(target=self._run, args=(delay,), name="sparkguard-metrics", daemon=True)
            self._thread.start()
        finally:
            threading.stack_size(old)
        _servers.append(self)
        return self

    def _run(self, delay: float) -> None:
        """Serve; when not bound (or serving ended with an error), bind again after ``delay``
        seconds, doubling up to RETRY_MAX.  Ends when :meth:`stop` is called."""
        try:
            while not self._stopping:
                if self._sock is None:
                    if self._sleep(delay):
                        return
                    delay = min(delay * 2, RETRY_MAX)
                    try:
                        self._bound(self._bind())
                    except MetricsListenError as e:
                        self._failed(e, delay)
                        continue
                t_bound = time.monotonic()
                try:
                    _Loop(self._sock, self._wake_r, self.registry).run()
                    return                      # stop() asked
                except Exception as e:  # noqa: BLE001 - the endpoint must come back, the guard goes on
                    log.exception("metrics server on %s failed", self._shown)
                    try:
                        self._sock.close()
                    except OSError:
                        pass
                    self._sock = None
                    if time.monotonic() - t_bound > RETRY_MAX:
                        delay = RETRY_FIRST
                    self._failed(OSError(getattr(e, "errno", None) or 0, f"server failed: {type(e).__name__}: {e}"),
                                 delay)
        finally:
            if self._sock is not None:
                self._sock.close()
                self._sock = None
            os.close(self._wake_r)

    def _sleep(self, seconds: float) -> bool:
        """Wait ``seconds`` or until :meth:`stop`; True when stopping."""
        select.select([self._wake_r], [], [], seconds)
        return self._stopping

    # ---- collectors, stop

    def register_collector(self, collector: Any) -> None:
        """Add a collector (an object with ``collect() -> Iterable[Metric]``) to this endpoint.

        Used by the engine supervisor and link watch; it is served from the next scrape on, also
        when the endpoint binds only later.  Raises ValueError (prometheus_client) if it describes
        a metric name already registered.
        """
        self.registry.register(collector)

    def unregister_collector(self, collector: Any) -> None:
        """Remove a collector added with :meth:`register_collector`.  Raises KeyError if unknown."""
        self.registry.unregister(collector)

    def stop(self, timeout: float = 5.0) -> None:
        """Stop serving (or retrying), close the socket and join the thread (at most ``timeout`` s)."""
        self._stopping = True
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass
        if self._thread is not None:
            self._thread.join(timeout)
        try:
            os.close(self._wake_w)
        except OSError:
            pass
        if self in _servers:
            _servers.remove(self)

    shutdown = stop

    def __enter__(self) -> "MetricsServer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


_servers: list[MetricsServer] = []


class _Loop:
    """The serving loop of one bound socket (see :class:`MetricsServer` for its bounds)."""

    def __init__(self, lsock: socket.socket, wake_r: int, registry: CollectorRegistry):
        self.lsock, self.wake_r, self.registry = lsock, wake_r, registry
        self.sel = selectors.PollSelector()
        self.conns: dict[int, _Conn] = {}
        self.pending: list[_Conn] = []
        self.listening = False
        self.paused_until = 0.0
        self.next_render = 0.0

    def run(self) -> None:
        """Serve until ``wake_r`` is readable.  Raises what poll/accept raise unexpectedly."""
        sel = self.sel
        sel.register(self.wake_r, selectors.EVENT_READ, None)
        try:
            while True:
                now = time.monotonic()
                self._listen(now)
                for key, _ in sel.select(self._timeout(now)):
                    if key.data is None:
                        return
                    if key.data == "listen":
                        self._accept(time.monotonic())
                    elif key.data.out:          # registered for writing (a hang-up reads as both)
                        self._write(key.data)
                    else:
                        self._read(key.data)
                now = time.monotonic()
                if self.pending and now >= self.next_render:
                    self._render()
                    self.next_render = now + RENDER_GAP
                for c in [c for c in self.conns.values() if c.deadline <= now]:
                    self._close(c)
        finally:
            for c in list(self.conns.values()):
                self._close(c)
            sel.close()

    def _timeout(self, now: float) -> float | None:
        """Seconds poll may sleep: until the next deadline, rendering or end of an accept pause;
        None (no wake-up at all) while idle."""
        t = [c.deadline for c in self.conns.values()]
        if self.pending:
            t.append(self.next_render)
        if not self.listening and now < self.paused_until:
            t.append(self.paused_until)
        return max(0.0, min(t) - now) if t else None

    def _listen(self, now: float) -> None:
        """Watch the listening socket while a connection may be taken."""
        want = now >= self.paused_until and (len(self.conns) < MAX_CONNECTIONS or self._evictable() is not None)
        if want and not self.listening:
            self.sel.register(self.lsock, selectors.EVENT_READ, "listen")
        elif not want and self.listening:
            self.sel.unregister(self.lsock)
        self.listening = want

    def _evictable(self) -> _Conn | None:
        """The oldest connection still sending its request (dicts keep insertion order)."""
        return next((c for c in self.conns.values() if c.request is None and not c.out), None)

    def _accept(self, now: float) -> None:
        for _ in range(ACCEPT_BATCH):
            if len(self.conns) >= MAX_CONNECTIONS:
                old = self._evictable()
                if old is None:
                    return
                self._close(old)
            try:
                sock, _ = self.lsock.accept()
            except BlockingIOError:
                return
            except OSError as e:
                if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    # the listener stays readable: without a pause this would spin a core
                    log.warning("metrics: cannot accept (%s); pausing %g s", e.strerror, ACCEPT_PAUSE)
                    self.paused_until = now + ACCEPT_PAUSE
                    self._listen(now)
                    return
                if e.errno in (errno.ECONNABORTED, errno.EPROTO, errno.EPERM, errno.EINTR):
                    return          # that client went away or was refused; the next one may come
                raise               # the listening socket itself is broken: the server binds again
            sock.setblocking(False)
            c = _Conn(sock, now + REQUEST_DEADLINE)
            self.conns[sock.fileno()] = c
            self.sel.register(sock, selectors.EVENT_READ, c)

    def _read(self, c: _Conn) -> None:
        try:
            chunk = c.sock.recv(MAX_HEAD + 1 - len(c.head))
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if not chunk:
            self._close(c)
            return
        c.head += chunk
        end = c.head.find(b"\r\n\r\n")
        if end < 0:
            end = c.head.find(b"\n\n")
        if end < 0:
            if len(c.head) > MAX_HEAD:
                self._answer(c, _response("431 Request Header Fields Too Large", [], b""))
            return
        req = parse_head(c.head[:end])
        if isinstance(req, int):
            self._answer(c, _response("400 Bad Request", [], b""))
        elif req[0] not in ("GET", "HEAD"):
            self._answer(c, _response("405 Method Not Allowed", [("Allow", "GET, HEAD")], b""))
        else:
            c.request = req
            self.sel.unregister(c.sock)     # nothing more is read; it waits for the next rendering
            self.pending.append(c)

    def _render(self) -> None:
        """One rendering per (format, compression) asked for, sent to every waiting request."""
        from prometheus_client.exposition import choose_encoder, gzip_accepted
        done: dict[tuple[str, bool], tuple[str, list[tuple[str, str]], bytes]] = {}
        pending, self.pending = self.pending, []
        for c in pending:
            method, accept, enc = c.request
            encoder, ctype = choose_encoder(accept)
            gz = gzip_accepted(enc)
            key = (ctype, gz)
            if key not in done:
                try:
                    body = encoder(self.registry)
                    headers = [("Content-Type", ctype)]
                    if gz:
                        body = gzip.compress(body)
                        headers.append(("Content-Encoding", "gzip"))
                    done[key] = ("200 OK", headers, body)
                except Exception as e:  # noqa: BLE001 - a collector's bug answers 500, serving goes on
                    log.warning("metrics: rendering failed: %s: %s", type(e).__name__, e)
                    done[key] = ("500 Internal Server Error", [("Content-Type", "text/plain")],
                                 f"rendering failed: {e}\n".encode())
            status, headers, body = done[key]
            self._answer(c, _response(status, headers, body, head_only=method == "HEAD"), registered=False)

    def _answer(self, c: _Conn, data: bytes, registered: bool = True) -> None:
        c.out = data
        if registered:
            self.sel.unregister(c.sock)
        self.sel.register(c.sock, selectors.EVENT_WRITE, c)
        self._write(c)

    def _write(self, c: _Conn) -> None:
        try:
            n = c.sock.send(c.out)
        except BlockingIOError:
            return
        except OSError:
            self._close(c)
            return
        c.out = c.out[n:]
        if not c.out:
            self._close(c)

    def _close(self, c: _Conn) -> None:
        fd = c.sock.fileno()
        if self.conns.pop(fd, None) is None:
            return
        try:
            self.sel.unregister(c.sock)
        except (KeyError, ValueError):
            pass
        if c in self.pending:
            self.pending.remove(c)
        c.sock.close()


_REASONS = {errno.EADDRINUSE: "address in use", errno.EACCES: "permission denied",
            errno.EADDRNOTAVAIL: "address not available on this host"}


def _shown(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def start_server(listen: tuple[str, int] = DEFAULT_LISTEN, snapshot: Callable[[], dict] | None = None,
                 extra_collectors: Iterable[Any] = (), retry: bool = False) -> MetricsServer:
    """Serve ``/metrics`` on ``listen`` from a daemon thread with a small stack.

    Args:
        listen: ``(host, port)`` from ``metrics.listen``; host ``""`` means 127.0.0.1 (never all
            interfaces unless configured so, e.g. ``0.0.0.0:8799``); port 0 picks a free port.
        snapshot: the daemon's ``Guard.snapshot`` (``() -> dict``); None serves only PSI, zram,
            process and build metrics.
        extra_collectors: more collectors for the same registry (engine supervisor, link watch).
        retry: False: a failed bind raises.  True (the daemon): it is logged as an error naming
            the address and who holds the port, and the thread binds again after 1 s, doubling
            up to 60 s (RETRY_FIRST, RETRY_MAX), as it does if serving ever fails;
            :meth:`MetricsServer.state` tells how it stands.
    Returns:
        :class:`MetricsServer` with ``.stop()``, ``.address``, ``.url``, ``.register_collector()``,
        ``.state()``, ``.problem()``.
    Raises:
        MetricsListenError: only with ``retry=False``: the address cannot be bound (port taken:
            ``EADDRINUSE``; unknown host name); the message names ``host:port``.
    """
    host, port = listen
    registry = build_registry(snapshot or dict, extra_collectors)
    return MetricsServer((host or "127.0.0.1", port), registry).start(retry)


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

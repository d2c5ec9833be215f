"""The metrics endpoint: one thread that binds, renders for the serving process, and binds again with a backoff.

The server is deliberately small: the daemon binds, and one process of its own
(:mod:`.httploop`, ``sparkguard: metrics``) serves every connection from one poll(2) loop, so
no client's work shares the daemon's interpreter lock with the poll loop; one thread of the
daemon answers that process's requests for a rendering of the registry, its own
:class:`prometheus_client.CollectorRegistry` (never the global default).  It is bound to
loopback unless the configuration says otherwise (prometheus_client's own ``start_http_server``
binds 0.0.0.0 by default and starts a thread per request; under ``mlockall(MCL_FUTURE)`` each
such thread's 8 MiB default stack becomes locked resident memory, measured +8 MiB RSS per
scrape thread against the daemon's 30 MiB budget).
"""

from __future__ import annotations

import errno
import logging
import os
import select
import socket
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Iterable

from prometheus_client import CollectorRegistry

from sparkguard import portowner
from sparkguard.metrics.families import build_registry
from sparkguard.metrics import httploop

log = logging.getLogger("sparkguard.metrics")

#: Default ``metrics.listen``.  8799 lies outside 9100-9999 (Prometheus' default port
#: allocation list, full) and is not a well-known port of any peer tool.
DEFAULT_LISTEN = ("127.0.0.1", 8799)

#: Stack of the HTTP thread.  The daemon mlockall()s: every byte of a thread's stack is
#: resident, so the default 8 MiB would cost 8 MiB RSS.
THREAD_STACK_BYTES = 256 * 1024
LISTEN_BACKLOG = 128
#: Seconds before the first new attempt to bind a port that could not be bound, doubling to RETRY_MAX.
RETRY_FIRST, RETRY_MAX = 1.0, 60.0
#: Seconds the serving process is given to exit once its channel is closed, before SIGKILL.
CHILD_EXIT_WAIT = 2.0


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
    than one thread whatever the clients do.  Bounds (constants of :mod:`.httploop`): a request head
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
        #: ``() -> None`` called from the endpoint's thread when :meth:`problem` changes (bound, or a
        #: new reason it is not); must not block (the guard flags its loop to send STATUS= again)
        self.on_change: Callable[[], None] | None = None

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
            self._changed()
        else:
            log.info("metrics on %s", self.url)

    def _failed(self, e: OSError, delay: float) -> None:
        """Record and log a failed bind (or a server that ended); ``delay``: seconds to the next try."""
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
            self._changed()
        else:
            log.debug("%s; next attempt in %g s", self.problem(), delay)

    def _changed(self) -> None:
        hook = self.on_change
        if hook is not None:
            try:
                hook()
            except Exception:  # noqa: BLE001 - the endpoint must outlive its listener
                log.exception("metrics state hook failed")

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
                    self._serve()
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

    def _serve(self) -> None:
        """Start the serving process (:mod:`.httploop`) on the bound socket and answer its
        requests for a rendering, at most one per ``RENDER_GAP / 2`` (it asks once per
        RENDER_GAP for all the clients waiting), until :meth:`stop`.  Raises RuntimeError when
        the serving process ends or misbehaves (the caller binds again after a backoff)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(httploop.__file__))))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
        lfd, cfd = self._sock.fileno(), theirs.fileno()
        try:
            proc = subprocess.Popen([sys.executable, "-c", httploop.CHILD, str(lfd), str(cfd)],
                                    pass_fds=(lfd, cfd), stdin=subprocess.DEVNULL, env=env)
        except OSError:
            ours.close()
            raise
        finally:
            theirs.close()
        render = httploop.registry_render(self.registry)
        last = -1.0
        try:
            while True:
                ready = select.select([ours, self._wake_r], [], [])[0]
                if self._wake_r in ready:
                    return
                wait = last + httploop.RENDER_GAP / 2 - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                last = time.monotonic()
                if not httploop.answer(ours, render):
                    raise RuntimeError(f"the serving process (pid {proc.pid}) ended: exit status {proc.wait()}")
        finally:
            ours.close()
            try:
                proc.wait(CHILD_EXIT_WAIT)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

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

    def __enter__(self) -> "MetricsServer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


_REASONS = {errno.EADDRINUSE: "address in use", errno.EACCES: "permission denied",
            errno.EADDRNOTAVAIL: "address not available on this host"}


def _shown(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def start_server(listen: tuple[str, int] = DEFAULT_LISTEN, snapshot: Callable[[], dict] | None = None,
                 extra_collectors: Iterable[Any] = (), retry: bool = False,
                 config: Callable[[], Any] | None = None) -> MetricsServer:
    """Serve ``/metrics`` on ``listen`` from a daemon thread with a small stack.

    Args:
        listen: ``(host, port)`` from ``metrics.listen``; host ``""`` means 127.0.0.1 (never all
            interfaces unless configured so, e.g. ``0.0.0.0:8799``); port 0 picks a free port.
        snapshot: the daemon's ``Guard.snapshot`` (``() -> dict``); None serves only PSI, zram,
            process and build metrics.
        extra_collectors: more collectors for the same registry (engine supervisor, link watch).
        config: ``() -> Config``, the configuration in force now: its cluster and lanes are
            served (:class:`sparkguard.metrics.families.ConfigCollector`); None: not served.
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
    registry = build_registry(snapshot or dict, extra_collectors, config)
    return MetricsServer((host or "127.0.0.1", port), registry).start(retry)

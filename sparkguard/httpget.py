"""One HTTP request with a deadline for the whole exchange and a cap on the answer's size.

For the supervisor's health checks and the peers gate: a server that answers slowly (a byte at
a time resets a per-read timeout forever) or hugely (parsing it costs the process CPU and
the interpreter lock the guard's loop needs) is cut off.  ``http.client`` does the HTTP;
the deadline is enforced by one watcher thread that shuts the connection's socket down when
its time is up, whichever read or write it is blocked in (TLS included); the thread sleeps
with no timeout while no request is in flight.  The name lookup and the connect attempts end
at the same deadline (:func:`_connector`).  Environment proxies are never used: these
URLs are local or on the TP fabric.
"""

from __future__ import annotations

import heapq
import http.client
import itertools
import socket
import threading
import time
from urllib.parse import urlsplit

_STACK = 256 * 1024


class _Watcher:
    """Shuts down sockets whose deadline passed (one daemon thread, started on first use)."""

    def __init__(self):
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, socket.socket]] = []
        self._live: set[int] = set()
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None

    def watch(self, sock: socket.socket, deadline: float) -> int:
        """Shut ``sock`` down at ``deadline`` (monotonic seconds) unless :meth:`forget` comes first."""
        with self._cond:
            if self._thread is None:
                old = threading.stack_size(_STACK)
                try:
                    self._thread = threading.Thread(target=self._run, name="sparkguard-http-deadline", daemon=True)
                    self._thread.start()
                finally:
                    threading.stack_size(old)
            key = next(self._ids)
            heapq.heappush(self._heap, (deadline, key, sock))
            self._live.add(key)
            self._cond.notify()
            return key

    def forget(self, key: int) -> None:
        with self._cond:
            self._live.discard(key)

    def _run(self) -> None:
        with self._cond:
            while True:
                while self._heap and self._heap[0][1] not in self._live:
                    heapq.heappop(self._heap)
                if not self._heap:
                    self._cond.wait()
                    continue
                left = self._heap[0][0] - time.monotonic()
                if left > 0:
                    self._cond.wait(left)
                    continue
                _, key, sock = heapq.heappop(self._heap)
                self._live.discard(key)
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


_watcher = _Watcher()


def _resolve(host: str, port: int, end: float) -> list[tuple]:
    """``getaddrinfo(host, port)`` (TCP) within the monotonic deadline ``end``.

    getaddrinfo(3) takes no timeout: with a resolver that does not answer it waits for
    resolv.conf's timeout x attempts (5 s x 2 by default, resolv.conf(5)).  An IP literal is
    resolved here at once; a name in a thread of its own that is given up at ``end`` (it ends when
    the resolver does).  Raises TimeoutError at the deadline, OSError when the name is unknown."""
    try:
        return socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_NUMERICHOST)
    except socket.gaierror:
        pass
    got: list = []

    def run():
        try:
            got.append(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM))
        except OSError as e:
            got.append(e)
    old = threading.stack_size(_STACK)
    try:
        t = threading.Thread(target=run, name="sparkguard-resolve", daemon=True)
        t.start()
    finally:
        threading.stack_size(old)
    t.join(max(0.0, end - time.monotonic()))
    if not got:
        raise TimeoutError(f"resolving {host} took longer than the deadline")
    if isinstance(got[0], OSError):
        raise got[0]
    return got[0]


def _connector(end: float):
    """A stand-in for ``socket.create_connection`` (``HTTPConnection._create_connection``) whose
    name lookup and connects all end at the monotonic deadline ``end``."""
    def create_connection(address, timeout=None, source_address=None):
        host, port = address
        last: OSError = TimeoutError("no address to connect to")
        for family, kind, proto, _, addr in _resolve(host, port, end):
            left = end - time.monotonic()
            if left <= 0:
                raise TimeoutError("no connection within the deadline")
            sock = socket.socket(family, kind, proto)
            try:
                sock.settimeout(left)
                if source_address:
                    sock.bind(source_address)
                sock.connect(addr)
                return sock
            except OSError as e:
                sock.close()
                last = e
        raise last
    return create_connection


def request(url: str, deadline: float, max_body: int, body: bytes | None = None,
            headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    """GET ``url`` (POST when ``body`` is given) and return ``(status, answer body)``.

    Args:
        url: ``http://`` or ``https://`` URL.
        deadline: seconds for everything: connect, send, status, headers and body.
        max_body: bytes of answer body accepted (any status).
        body, headers: the request's body and extra headers.
    Raises:
        OSError: nobody answers, the deadline passed (TimeoutError), the body is longer than
            ``max_body`` bytes, or the answer is not HTTP.  Never other exceptions.
    """
    u = urlsplit(url)
    end = time.monotonic() + deadline
    try:
        cls = http.client.HTTPSConnection if u.scheme == "https" else http.client.HTTPConnection
        conn = cls(u.hostname or "", u.port, timeout=deadline)
    except (ValueError, http.client.HTTPException) as e:      # a port that is not a number
        raise OSError(f"bad URL {url!r}: {e}") from None
    conn._create_connection = _connector(end)    # http.client's hook for socket.create_connection
    key = None
    try:
        conn.connect()
        key = _watcher.watch(conn.sock, end)
        path = (u.path or "/") + (f"?{u.query}" if u.query else "")
        conn.request("POST" if body is not None else "GET", path, body=body, headers=headers or {})
        r = conn.getresponse()
        data = r.read(max_body + 1)
        if time.monotonic() >= end:
            raise TimeoutError
        if len(data) <= max_body and r.length:      # bytes of Content-Length still missing
            raise OSError(f"answer cut short ({r.length} bytes missing)")
    except (OSError, http.client.HTTPException, ValueError) as e:
        if time.monotonic() >= end:
            raise TimeoutError(f"no complete answer within {deadline:g} s") from None
        if isinstance(e, OSError):
            raise
        raise OSError(f"broken HTTP answer: {type(e).__name__}: {e}") from None
    finally:
        if key is not None:
            _watcher.forget(key)
        conn.close()
    if len(data) > max_body:
        raise OSError(f"answer longer than {max_body} bytes")
    return r.status, data

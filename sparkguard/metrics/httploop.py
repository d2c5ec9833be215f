"""The serving loop of the metrics endpoint: every connection of one bound socket in one poll(2) loop,
run in a process of its own (:data:`CHILD`, titled ``sparkguard: metrics``).

The daemon's poll loop and kill path share the interpreter lock with every thread of the daemon, so
the work a client makes (accepting, reading, answering: about 20,000 connections a second from a
client that reconnects as fast as it is closed) must not run there: it once raised
crossing->SIGTERM from 0.3-0.5 ms to 46-82 ms.  The daemon binds the socket and starts this
process with it; this process accepts, reads and answers every client, and asks the daemon for a
rendering of its registry over a socket pair (:class:`Channel`) at most once per
:data:`RENDER_GAP` for every client waiting then.  The daemon's share is one rendering per
RENDER_GAP, whatever the clients do.  The process exits when the daemon closes its end.
"""

from __future__ import annotations

import errno
import gzip
import logging
import os
import select
import selectors
import socket
import struct
import sys
import time
from typing import Callable

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder, gzip_accepted

log = logging.getLogger("sparkguard.metrics")

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
#: Seconds between two renderings of the registry (one costs about 1-1.5 ms of CPU, measured on
#: the dev VM): at most 10 a second, whatever the number of clients.
RENDER_GAP = 0.1
#: Seconds without accepting after accept() failed for lack of fds or memory.
ACCEPT_PAUSE = 0.5
#: Seconds this process waits for the daemon's rendering before answering 503.
RENDER_DEADLINE = 2.0
#: Bytes of a rendering taken from the daemon (a node's page is ~30 KiB).
MAX_BODY = 16 * 1024**2

#: ``render(accept) -> (content type, body)``: the registry rendered for that Accept header.
Render = Callable[[str], "tuple[str, bytes]"]
_ANSWER = struct.Struct(">IHB")      # body bytes, content-type bytes, ok (1) or error text (0)


def registry_render(registry: CollectorRegistry) -> Render:
    """The :data:`Render` of ``registry`` in this process (prometheus_client's own encoders)."""
    def render(accept: str) -> tuple[str, bytes]:
        encoder, ctype = choose_encoder(accept)
        return ctype, encoder(registry)
    return render


class Channel:
    """The serving process's end of the socket pair to the daemon: :meth:`render` asks for a
    rendering and waits for it (at most :data:`RENDER_DEADLINE`).  Frames: a request is a 4-byte
    length and the Accept header (latin-1); an answer is :data:`_ANSWER`, the content type and the
    body (or the error's text)."""

    def __init__(self, sock: socket.socket):
        self.sock = sock

    def render(self, accept: str) -> tuple[str, bytes]:
        data = accept.encode("latin-1", "replace")[:MAX_HEAD]
        self.sock.sendall(struct.pack(">I", len(data)) + data)
        head = self._read(_ANSWER.size)
        size, clen, ok = _ANSWER.unpack(head)
        if size > MAX_BODY:
            raise OSError(f"the daemon's rendering is {size} bytes")
        ctype = self._read(clen).decode("latin-1")
        body = self._read(size)
        if not ok:
            raise RuntimeError(body.decode("utf-8", "replace"))
        return ctype, body

    def _read(self, n: int) -> bytes:
        buf, end = b"", time.monotonic() + RENDER_DEADLINE
        while len(buf) < n:
            left = end - time.monotonic()
            if left <= 0 or not select.select([self.sock], [], [], left)[0]:
                raise TimeoutError(f"no rendering from the daemon within {RENDER_DEADLINE:g} s")
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                raise EOFError("the daemon closed the channel")
            buf += chunk
        return buf


def answer(sock: socket.socket, render: Render, max_request: int = MAX_HEAD) -> bool:
    """The daemon's side of one request from the serving process: read it, render, answer.
    Blocking; returns False when the serving process closed its end.  Raises OSError when the
    request is longer than ``max_request`` (the channel is then closed by the caller)."""
    head = _recv_exact(sock, 4)
    if head is None:
        return False
    n = struct.unpack(">I", head)[0]
    if n > max_request:
        raise OSError(f"metrics request of {n} bytes")
    accept = (_recv_exact(sock, n) or b"").decode("latin-1")
    try:
        ctype, body = render(accept)
        ok = 1
    except Exception as e:  # noqa: BLE001 - a collector's bug answers 500, serving goes on
        ctype, body, ok = "", f"{type(e).__name__}: {e}".encode(), 0
    c = ctype.encode("latin-1")
    sock.sendall(_ANSWER.pack(len(body), len(c), ok) + c + body)
    return True


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return buf


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


class ServingLoop:
    """The serving loop of one bound socket (see :class:`MetricsServer` for its bounds)."""

    def __init__(self, lsock: socket.socket, wake_r: int, render: Render):
        """``wake_r``: an fd that ends the loop when readable (the daemon's channel: its EOF);
        ``render``: :data:`Render`."""
        self.lsock, self.wake_r, self.render = lsock, wake_r, render
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
        done: dict[tuple[str, bool], tuple[str, list[tuple[str, str]], bytes]] = {}
        pending, self.pending = self.pending, []
        for c in pending:
            method, accept, enc = c.request
            ctype = choose_encoder(accept)[1]
            gz = gzip_accepted(enc)
            key = (ctype, gz)
            if key not in done:
                try:
                    ctype, body = self.render(accept)
                    headers = [("Content-Type", ctype)]
                    if gz:
                        body = gzip.compress(body)
                        headers.append(("Content-Encoding", "gzip"))
                    done[key] = ("200 OK", headers, body)
                except (TimeoutError, EOFError) as e:
                    log.warning("metrics: %s", e)
                    done[key] = ("503 Service Unavailable", [("Content-Type", "text/plain")], f"{e}\n".encode())
                    if isinstance(e, EOFError):
                        raise
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


def _yield_cpu() -> None:
    """Run at nice 10 or lower: the daemon runs at Nice=-20 (systemd/sparkguard.service), and its
    helper processes must not compete with its poll loop for a CPU."""
    try:
        os.setpriority(os.PRIO_PROCESS, 0, max(10, os.getpriority(os.PRIO_PROCESS, 0)))
    except OSError:
        pass


#: The serving process's program (``python -c CHILD LISTEN_FD CHANNEL_FD``); ``-m`` would import
#: this module twice, once through the package.
CHILD = "import sys; from sparkguard.metrics.httploop import child_main; sys.exit(child_main(sys.argv[1:]))"


def child_main(argv: list[str]) -> int:
    """The serving process: ``LISTEN_FD CHANNEL_FD``, both inherited from the daemon.  Serves until
    the daemon closes the channel (or dies: its end closes with it)."""
    logging.basicConfig(stream=sys.stderr, level=logging.WARNING, format="sparkguard metrics: %(message)s")
    _yield_cpu()
    try:
        import setproctitle
        setproctitle.setproctitle("sparkguard: metrics")
    except ImportError:
        pass
    lsock = socket.socket(fileno=int(argv[0]))
    lsock.setblocking(False)
    chan = socket.socket(fileno=int(argv[1]))
    try:
        ServingLoop(lsock, chan.fileno(), Channel(chan).render).run()
    except EOFError:
        pass
    return 0

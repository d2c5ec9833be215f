"""``sparkguard engine status|start|stop|restart|lane NAME``: control of the supervised engine.

The daemon serves a unix stream socket (``engine.control_socket``, default
``/run/sparkguard/control.sock``), created mode 0600 and owned by the daemon's user (root), in
a directory of mode 0755; it also checks each client's SO_PEERCRED uid (root or its own) so the
permission holds even if the mode is loosened.  There is no network control surface.

Protocol: the client sends one JSON object on one line and reads one JSON line back.

    {"op": "status"}                          -> {"ok": true, "status": {...}}
    {"op": "start" | "stop" | "restart"}      -> {"ok": true, "starts": N, "status": {...}}
    {"op": "lane", "lane": NAME}              -> same; {"ok": false, "error": "..."} for an unknown lane
    {"op": "wait", "until": "ready"|"stopped"|"starts", "after": N, "timeout": S, "lane": NAME?}
                                              -> {"ok": bool, "error"?: str, "status": {...}}

``status`` is :meth:`sparkguard.supervisor.core.Supervisor.status`;
:func:`sparkguard.supervisor.render.describe` renders it.  ``engine_status()`` is the client call
``sparkguard status`` can use.
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import socket
import stat
import struct
import sys
import threading
import time
from typing import Callable

from sparkguard import config
from sparkguard.supervisor import handover
from sparkguard.supervisor.render import describe

log = logging.getLogger("sparkguard.control")

DEFAULT_SOCKET = "/run/sparkguard/control.sock"
ENV_SOCKET = "SPARKGUARD_CONTROL_SOCKET"
MAX_REQUEST = 64 * 1024
REQUEST_DEADLINE = 5.0         # seconds a client may take to send its whole request, all reads together
MAX_CONNECTIONS = 8            # connections served at once; more are answered "busy" and closed
ACCEPT_PAUSE = 0.5             # seconds without accepting after accept() failed (no fds, no memory)
EXIT_ERROR, EXIT_NOT_RUNNING = 1, 3


class ControlError(OSError):
    """The daemon could not be asked: not running, stale socket, no permission, bad answer."""


# ---------------------------------------------------------------------------------------------
# server (in the daemon)

class ControlServer:
    """Unix-socket control server, one short-lived thread per connection, at most
    :data:`MAX_CONNECTIONS` at once (each request is read within :data:`REQUEST_DEADLINE`
    seconds and :data:`MAX_REQUEST` bytes; ``wait`` answers within its own timeout).

    Args:
        path: socket path.
        handler: ``(request: dict) -> dict``; may block (``wait``) up to the request's timeout.
    """

    def __init__(self, path: str, handler: Callable[[dict], dict]):
        self.path = path
        self.handler = handler
        self.sock: socket.socket | None = None
        self.thread: threading.Thread | None = None
        self._ino = None
        self._stopping = False
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)

    def start(self) -> None:
        """Bind and listen (mode 0600), start the accept thread.

        Raises:
            OSError: another daemon answers on ``path``, or the socket cannot be created.
        """
        d = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(d, mode=0o755, exist_ok=True)
        if os.path.lexists(self.path):
            if not stat.S_ISSOCK(os.lstat(self.path).st_mode):
                raise OSError(errno.EEXIST, f"{self.path} exists and is not a socket (engine.control_socket)")
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
            try:
                probe.connect(self.path)
            except OSError:
                os.unlink(self.path)          # stale: left by a daemon that died
            else:
                raise OSError(errno.EADDRINUSE, f"another sparkguard already serves {self.path}")
            finally:
                probe.close()
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        old = os.umask(0o177)
        try:
            s.bind(self.path)
        except OSError:
            s.close()
            raise
        finally:
            os.umask(old)
        os.chmod(self.path, 0o600)
        s.listen(16)
        self._ino = os.stat(self.path).st_ino
        self.sock = s
        self.thread = threading.Thread(target=self._accept, name="sg-control", daemon=True)
        self.thread.start()
        log.info("engine control on %s (mode 0600)", self.path)

    def _accept(self) -> None:
        while not self._stopping:
            try:
                conn, _ = self.sock.accept()
            except OSError as e:
                if self._stopping:
                    return
                if e.errno not in (errno.ECONNABORTED, errno.EPROTO, errno.EPERM, errno.EINTR):
                    # no fds or memory, or the socket broken: retrying at once would spin a core
                    log.warning("control socket: cannot accept (%s); pausing %g s", e.strerror, ACCEPT_PAUSE)
                    time.sleep(ACCEPT_PAUSE)
                continue
            if not self._slots.acquire(blocking=False):
                with conn:
                    conn.setblocking(False)
                    try:
                        self._reply(conn, {"ok": False, "error": f"busy: {MAX_CONNECTIONS} requests are being "
                                                                 "served; try again"})
                    except OSError:
                        pass
                continue
            try:
                threading.Thread(target=self._serve, args=(conn,), name="sg-control-conn", daemon=True).start()
            except RuntimeError:            # no thread could be started
                self._slots.release()
                conn.close()

    def _serve(self, conn: socket.socket) -> None:
        try:
            self._serve_one(conn)
        finally:
            self._slots.release()

    def _serve_one(self, conn: socket.socket) -> None:
        with conn:
            try:
                uid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                          struct.calcsize("3i")))[1]
                if uid not in (0, os.geteuid()):
                    self._reply(conn, {"ok": False, "error": "permission denied: the engine control socket is "
                                                             "for root only"})
                    return
                deadline = time.monotonic() + REQUEST_DEADLINE
                data = b""
                while b"\n" not in data and len(data) < MAX_REQUEST:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise TimeoutError(f"request not complete within {REQUEST_DEADLINE:g} s")
                    conn.settimeout(left)
                    chunk = conn.recv(4096)
                    if not chunk:
                        break
                    data += chunk
                try:
                    req = json.loads(data.split(b"\n", 1)[0] or b"null")
                except ValueError:
                    req = None
                if not isinstance(req, dict):
                    self._reply(conn, {"ok": False, "error": "bad request: expected one JSON object on one line"})
                    return
                conn.settimeout(None)
                try:
                    resp = self.handler(req)
                except Exception as e:  # noqa: BLE001 - answer, log, keep serving
                    log.exception("control request %r failed", req.get("op"))
                    resp = {"ok": False, "error": f"internal error: {e}"}
                conn.settimeout(REQUEST_DEADLINE)    # a client that does not read its answer is dropped
                self._reply(conn, resp)
            except OSError as e:
                log.debug("control connection: %s", e)

    @staticmethod
    def _reply(conn: socket.socket, resp: dict) -> None:
        conn.sendall(json.dumps(resp, default=str).encode() + b"\n")

    def stop(self) -> None:
        """Stop accepting and remove the socket file (if it is still ours)."""
        self._stopping = True
        if self.sock is not None:
            try:
                self.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self.sock.close()
            self.sock = None
        try:
            if self._ino is not None and os.stat(self.path).st_ino == self._ino:
                os.unlink(self.path)
        except OSError:
            pass
        if self.thread is not None:
            self.thread.join(2.0)


# ---------------------------------------------------------------------------------------------
# client

def request(path: str, req: dict, timeout: float = 10.0) -> dict:
    """Send one request to the daemon and return its answer.

    Args:
        path: the control socket.
        req: e.g. ``{"op": "status"}``.
        timeout: seconds for connect + answer.
    Raises:
        ControlError: with a message a person can act on (not running, stale socket, not root, no answer).
    """
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    s.settimeout(timeout)
    try:
        try:
            s.connect(path)
        except FileNotFoundError:
            raise ControlError(errno.ENOENT, f"sparkguard is not running with an engine: no control socket at {path} "
                                             "(start it with 'sparkguard run' and an engine: section; if it runs "
                                             "with another config file or socket, pass --config FILE or "
                                             "--socket PATH)") from None
        except ConnectionRefusedError:
            raise ControlError(errno.ECONNREFUSED, f"sparkguard is not running: {path} is a stale socket "
                                                   "nobody listens on") from None
        except PermissionError:
            raise ControlError(errno.EACCES, f"permission denied on {path}: the engine control socket is "
                                             "root-only (mode 0600); run this as root") from None
        except socket.timeout:
            raise ControlError(errno.ETIMEDOUT, f"no answer from {path} within {timeout:g} s") from None
        except OSError as e:
            raise ControlError(e.errno, f"cannot reach sparkguard on {path}: {e.strerror or e}") from None
        try:
            s.sendall(json.dumps(req).encode() + b"\n")
        except (BrokenPipeError, ConnectionResetError):
            pass    # the daemon refused us (not root) and closed before reading: its answer is still there
        except OSError as e:
            raise ControlError(e.errno, f"connection to sparkguard on {path} failed: {e.strerror or e}") from None
        data = b""
        try:
            while not data.endswith(b"\n"):
                chunk = s.recv(65536)
                if not chunk:
                    break
                data += chunk
        except socket.timeout:
            raise ControlError(errno.ETIMEDOUT, f"sparkguard did not answer within {timeout:g} s") from None
        except OSError as e:
            raise ControlError(e.errno, f"connection to sparkguard on {path} failed: {e.strerror or e}") from None
    finally:
        s.close()
    try:
        resp = json.loads(data)
    except ValueError:
        raise ControlError(errno.EPROTO, f"unreadable answer from {path}: {data[:200]!r}") from None
    if not isinstance(resp, dict):
        raise ControlError(errno.EPROTO, f"unreadable answer from {path}: {data[:200]!r}")
    return resp


def engine_status(path: str | None = None, timeout: float = 3.0) -> dict | None:
    """The running daemon's engine state (``Supervisor.status()``), or None when it cannot be
    asked (not running, no engine, not root).  For ``sparkguard status``; never raises.
    Render with :func:`sparkguard.supervisor.render.describe`."""
    return ask_status(path, timeout)[0]


def ask_status(path: str | None = None, timeout: float = 3.0) -> tuple[dict | None, str | None]:
    """Like :func:`engine_status`, with the reason: ``(status, None)`` or ``(None, error)``, the
    error a sentence a person can act on ("sparkguard is not running ...", "permission denied ...")."""
    try:
        resp = request(path or socket_path(None, None), {"op": "status"}, timeout)
    except ControlError as e:
        return None, e.strerror
    if resp.get("ok") and isinstance(resp.get("status"), dict):
        return resp["status"], None
    return None, f"the daemon answered: {resp.get('error') or 'no status'}"


def socket_path(arg: str | None, config_path: str | None) -> str:
    """The socket to talk to: ``--socket``, else $SPARKGUARD_CONTROL_SOCKET, else the config's
    ``engine.control_socket`` (``--config`` or the default file), else the default."""
    if arg:
        return arg
    if os.environ.get(ENV_SOCKET):
        return os.environ[ENV_SOCKET]
    try:
        cfg = config.load(config_path, required=config_path is not None)
        return cfg.engine.control_socket
    except Exception:  # noqa: BLE001 - a broken config must not hide the socket; the daemon validates it
        return DEFAULT_SOCKET


# ---------------------------------------------------------------------------------------------
# command line

def register(sub: argparse._SubParsersAction) -> None:
    """Add ``engine`` with ``status``, ``start``, ``stop``, ``restart``, ``lane NAME``.

    The common options (``--config/-c``, ``--socket``, ``--json``, and ``--no-wait``/``--timeout``
    of the actions that wait) are accepted before and after the action: ``sparkguard engine -c F
    status`` and ``sparkguard engine status -c F`` are the same.
    """
    p = sub.add_parser("engine", help="control the supervised engine (status, start, stop, restart, lane)",
                       description="Talk to the running daemon over its root-only unix socket. Options go "
                                   "before or after the action.")
    _common_args(p, top=True)
    esub = p.add_subparsers(dest="engine_cmd", metavar="ACTION")
    esub.required = True
    st = esub.add_parser("status", help="the engine's state, lane, restarts")
    _common_args(st, top=False, waits=False)
    for name, what in (("start", "start the engine (after the memory gates)"),
                       ("stop", "SIGTERM the engine, SIGKILL its tree after guard.grace; no restart"),
                       ("restart", "stop, then start after the memory gates")):
        a = esub.add_parser(name, help=what)
        _common_args(a, top=False)
    ln = esub.add_parser("lane", help="switch lanes: stop, quiesce, start with the lane's args/env, wait ready")
    ln.add_argument("name", help="one of engine.lanes")
    _common_args(ln, top=False)
    p.set_defaults(func=handler)


def _common_args(a: argparse.ArgumentParser, top: bool, waits: bool = True) -> None:
    """The options of ``sparkguard engine``, on its parser (``top``: with the defaults) and again on
    each action's parser with suppressed defaults, so that a value given after the action wins
    and one given before it is not reset."""
    def kw(default):
        return {"default": default if top else argparse.SUPPRESS}
    a.add_argument("--socket", metavar="PATH",
                   help=f"control socket (default: engine.control_socket of the config, {DEFAULT_SOCKET})", **kw(None))
    a.add_argument("--config", "-c", metavar="PATH", help="config file to read engine.control_socket from",
                   **kw(None))
    a.add_argument("--json", action="store_true", help="print the daemon's answer as JSON", **kw(False))
    if waits:
        a.add_argument("--no-wait", action="store_true",
                       help="return at once (start, restart, lane: instead of waiting until the engine is ready; "
                            "stop: until it is stopped)", **kw(False))
        a.add_argument("--timeout", type=float, metavar="SECONDS", help="how long to wait (default 3600)",
                       **kw(3600.0))


#: what ``--no-wait`` prints for each action
REQUESTED = {"start": "start requested", "stop": "stop requested", "restart": "restart requested",
             "lane": "lane switch to {lane} requested"}


def handler(args: argparse.Namespace) -> int:
    """Run one ``sparkguard engine`` action; exit 0 ok, 1 refused/failed, 3 daemon unreachable."""
    path = socket_path(args.socket, args.config)
    op = args.engine_cmd
    try:
        if op == "status":
            resp = request(path, {"op": "status"})
        else:
            req = {"op": op}
            if op == "lane":
                req["lane"] = args.name
            resp = request(path, req)
            if resp.get("ok") and not args.no_wait:
                until = "stopped" if op == "stop" else "ready"
                w = {"op": "wait", "until": until, "after": resp.get("starts", 0), "timeout": args.timeout}
                if op == "lane":
                    w["lane"] = args.name
                resp = request(path, w, timeout=args.timeout + 10)
    except ControlError as e:
        print(f"sparkguard engine: {e.strerror}", file=sys.stderr)
        for cg in handover.unguarded_engines():
            print(f"sparkguard engine: WARNING: {cg} holds processes and no daemon answers: an engine nothing "
                  "guards ('systemctl start sparkguard' adopts it; docs/adoption.md, 'A stop during the restart "
                  "wait')", file=sys.stderr)
        return EXIT_NOT_RUNNING
    if args.json:
        print(json.dumps(resp, indent=2, default=str))
    else:
        if not resp.get("ok"):
            print(f"sparkguard engine {op}: {resp.get('error')}", file=sys.stderr)
        elif op != "status" and args.no_wait:
            # the state is still the one before the request: say first that it was taken
            print(f"sparkguard engine: {resp.get('note') or REQUESTED[op].format(lane=getattr(args, 'name', ''))}"
                  + ("" if resp.get("note") else "; not waiting (see 'sparkguard engine status')"))
        if resp.get("status"):
            print("\n".join(describe(resp["status"])))
    return 0 if resp.get("ok") else EXIT_ERROR

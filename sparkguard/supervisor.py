"""Engine supervision: start the inference engine, know it is healthy, restart it once memory is back.

With an ``engine:`` section (:class:`sparkguard.config.EngineConfig`) the daemon starts the
engine as its own child and keeps it running (issue #5).  Everything here runs in the
supervisor's own threads; the guard's poll loop only calls the cheap, non-blocking hooks
(:meth:`Supervisor.target`, :meth:`Supervisor.on_guard_event`, :meth:`Supervisor.take_incident`).

One start, in order (each step interruptible by stop / lane / shutdown):

1. **backoff** after an automatic restart: ``backoff_initial * 2**n`` capped at ``backoff_max``;
   ``n`` goes back to 0 after a run that lasted ``stable_after`` seconds.
2. **sweep** what is left of the previous run: every process still in the engine's process
   group (vLLM never calls setsid, FIELD-NOTES) and every process recorded as a descendant
   (also ``VLLM::EngineCore`` / ``VLLM::Worker_TP*`` reparented away when the API server was
   SIGKILLed).  SIGTERM, ``guard.grace``, SIGKILL + process_mrelease.  The dead root is kept as
   an unreaped zombie until then, so its process-group id cannot be reused meanwhile.
3. **guard hold**: no start while a guard incident is open (memory below the SIGTERM line).
4. ``sync`` + drop the page cache (``drop_caches``): vLLM's start-up check on unified memory
   counts page cache as used ("Free memory on device ... less than desired GPU memory
   utilization", FIELD-NOTES).
5. **quiesce gate**: MemAvailable >= ``start_above`` and stable (within ``stable_band``) for
   ``stable_for`` seconds, because memory stranded by a kill comes back only after a while.
6. **peers gate**: every ``engine.peers`` reports MemAvailable >= ``start_above``
   (:mod:`sparkguard.peers`).  Past ``quiesce_timeout`` (steps 4-6) it starts anyway and says so.
7. **spawn**: own session and process group, stdin /dev/null, stdout/stderr forwarded line by
   line to the journal under the engine's identifier (last ``log_lines`` kept for incident
   reports), oom_score_adj reset to 0 (the daemon's -1000 would be inherited), NOTIFY_SOCKET
   removed, and for vLLM ``VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS`` below ``guard.grace``.
8. **ready** when ``health_url`` answers 200 within ``ready_timeout`` (vLLM's port listens
   only once loaded).  Then the liveness **probe**: a real one-token completion every
   ``probe.interval``; ``probe.failures`` failures in a row = wedged (vLLM's /health answers
   200 while wedged): SIGTERM, grace, SIGKILL, restart, incident of kind ``"wedged"``.
   A headless rank with ``head_url``: once the head had answered 200, a head failing for
   ``head_lost_after`` seconds means stop and restart this rank (vLLM headless ranks do not exit
   by themselves), so it waits at the rendezvous when the head comes back.

Restart reasons (metric label ``reason``): ``exit`` (the engine exited by itself), ``guard``
(the guard signalled it), ``wedged``, ``lane``, ``head``, ``not_ready`` (ready_timeout),
``manual`` (``sparkguard engine restart``), ``link`` (reserved for the link watch).

Threads: one supervisor thread, and per run an exit watcher (pidfd), an output pump and a
monitor (health/probe/head).  The daemon sets ``threading.stack_size`` (512 KiB) before.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import select
import signal
import sys
import threading
import time
from typing import Any, Callable

log = logging.getLogger("sparkguard.supervisor")

#: every restart reason (metric label values, all exported from the first scrape)
REASONS = ("exit", "guard", "wedged", "lane", "head", "not_ready", "manual", "link")
#: supervisor states (``status()["state"]``)
STATES = ("stopped", "backoff", "sweeping", "waiting", "starting", "ready", "stopping", "exited", "failed")
MEM_SAMPLE = 0.25        # seconds between MemAvailable samples in the quiesce gate
PEER_EVERY = 1.0         # seconds between peer reads in the peers gate
MEMBERS_EVERY = 30.0     # seconds between tree-membership refreshes once ready
MAX_LINE = 16384         # bytes; longer output lines are cut into pieces
HISTORY = 50             # status history entries kept
_ENV_DROP = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "LISTEN_FDS", "LISTEN_PID", "LISTEN_FDNAMES")
_LEVELS = {"CRITICAL": 2, "ERROR": 3, "WARNING": 4, "WARN": 4, "INFO": 6, "DEBUG": 7}


# ---------------------------------------------------------------------------------------------
# pure pieces (tested with a fake clock)

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


class Backoff:
    """Capped exponential delay between automatic restarts, reset after a stable run.

    ``delay()`` of the n-th consecutive automatic restart is ``initial * 2**n`` capped at
    ``maximum`` (n from 0); a run that lasted ``stable_after`` seconds resets n.
    """

    def __init__(self, initial: float, maximum: float, stable_after: float):
        self.initial, self.maximum, self.stable_after = initial, maximum, stable_after
        self.failures = 0

    def next(self, uptime: float) -> float:
        """Seconds to wait before the next automatic start, after a run of ``uptime`` seconds."""
        if uptime >= self.stable_after:
            self.failures = 0
        d = min(self.maximum, self.initial * (2 ** min(self.failures, 60)))
        self.failures += 1
        return d

    def reset(self) -> None:
        """Forget past failures (an explicit start/restart/lane command)."""
        self.failures = 0


def identifier_for(argv: tuple[str, ...] | list[str]) -> str:
    """Journal SYSLOG_IDENTIFIER for an engine command: the program's name.

    ``[/usr/bin/python3, /usr/local/bin/vllm, serve, M]`` -> ``"vllm"``; ``[python3, -m,
    sglang.launch_server]`` -> ``"sglang"``; ``[/opt/tritonserver/bin/tritonserver]`` -> ``"tritonserver"``.
    """
    a = list(argv)
    if a and os.path.basename(a[0]).startswith("python"):
        if len(a) > 2 and a[1] == "-m":
            return a[2].split(".")[0]
        if len(a) > 1 and not a[1].startswith("-"):
            return os.path.basename(a[1]).removesuffix(".py")
    return os.path.basename(a[0]) if a else "engine"


def _level_priority(line: str, default: int) -> int:
    """syslog PRIORITY from a leading ``INFO``/``WARNING``/... (vLLM's and Python logging's format)."""
    head = line.lstrip("(").split(None, 1)
    if head:
        p = _LEVELS.get(head[0].rstrip(":").upper())
        if p is not None:
            return p
    for word, p in (("ERROR", 3), ("WARNING", 4), ("INFO", 6)):
        if f" {word} " in line[:120]:
            return p
    return default


# ---------------------------------------------------------------------------------------------
# small readers

def read_mem_available(path: str = "/proc/meminfo") -> int:
    """MemAvailable in bytes (Documentation/filesystems/proc.rst).  Raises OSError/ValueError."""
    with open(path, "rb") as f:
        for line in f:
            if line.startswith(b"MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise ValueError("no MemAvailable in /proc/meminfo")


def _proc_state(pid: int) -> str | None:
    """The state letter of /proc/PID/stat (proc(5) field 3), None if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            s = f.read()
    except OSError:
        return None
    r = s.rfind(b")")
    return s[r + 2:r + 3].decode() if r > 0 else None


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


def _http(url: str, timeout: float, body: dict | None = None) -> tuple[int, bytes]:
    """(status, body) of a GET (or a JSON POST when ``body``); raises OSError when nobody answers.
    Environment proxies are ignored: health checks are local or on the TP fabric."""
    import urllib.error
    import urllib.request
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"} if data else {})
    try:
        with opener.open(req, timeout=timeout) as r:
            return r.status, r.read(1 << 20)
    except urllib.error.HTTPError as e:
        return e.code, b""
    except urllib.error.URLError as e:
        r = e.reason
        raise r if isinstance(r, OSError) else OSError(str(r)) from None
    except (ValueError, EOFError) as e:  # broken HTTP (http.client.HTTPException is not an OSError)
        raise OSError(str(e)) from None
    except Exception as e:  # noqa: BLE001 - http.client.RemoteDisconnected, IncompleteRead...
        raise OSError(f"{type(e).__name__}: {e}") from None


def _base_url(url: str) -> str:
    from urllib.parse import urlsplit
    u = urlsplit(url)
    return f"{u.scheme}://{u.netloc}"


# ---------------------------------------------------------------------------------------------
# engine output -> journal

class LogSink:
    """Where engine output lines go: journald (native protocol, the engine's own identifier)
    or the daemon's stderr ("IDENT[PID]: line").

    Args:
        mode: ``"auto"`` (journal if its socket answers, else stderr), ``"journal"``, ``"stderr"``.
        socket_path: journald's native socket.
        identifier: SYSLOG_IDENTIFIER of the entries.
    Uses :mod:`sparkguard.journal` (``encode``/``send``) when present; otherwise stderr.
    """

    def __init__(self, mode: str, socket_path: str, identifier: str):
        self.identifier = identifier
        self.socket_path = socket_path
        self.journal = None
        self.sock = None
        self._warned = False
        if mode != "stderr":
            try:
                from sparkguard import journal  # the report branch's native-protocol sender
            except ImportError:
                journal = None
            if journal is not None and (mode == "journal" or journal.available(socket_path)):
                import socket
                self.journal = journal
                self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                self.sock.settimeout(2.0)
            elif mode == "journal":
                log.warning("engine.log is journal but %s", "sparkguard.journal is missing" if journal is None
                            else f"nothing listens on {socket_path}; engine output goes to stderr")

    def write(self, line: str, stream: str, pid: int | None, lane: str | None) -> None:
        """Send one line; never raises (falls back to stderr)."""
        default = 6 if stream == "stdout" else 4
        if self.journal is not None:
            fields = {"MESSAGE": line, "PRIORITY": _level_priority(line, default),
                      "SYSLOG_IDENTIFIER": self.identifier, "SPARKGUARD_ENGINE_STREAM": stream}
            if pid is not None:
                fields["SYSLOG_PID"] = pid
                fields["SPARKGUARD_ENGINE_PID"] = pid
            if lane:
                fields["SPARKGUARD_ENGINE_LANE"] = lane
            try:
                payload = self.journal.encode(fields)
                try:
                    self.sock.sendto(payload, self.socket_path)
                except OSError as e:
                    import errno
                    if e.errno not in (errno.EMSGSIZE, errno.ENOBUFS):
                        raise
                    self.journal.send(fields, self.socket_path)
                return
            except (OSError, ValueError) as e:
                if not self._warned:
                    log.warning("engine output to the journal failed (%s); using stderr", e)
                    self._warned = True
        try:
            sys.stderr.write(f"{self.identifier}[{pid}]: {line}\n")
            sys.stderr.flush()
        except (OSError, ValueError):
            pass

    def close(self) -> None:
        """Close the socket."""
        if self.sock is not None:
            self.sock.close()
            self.sock = None


# ---------------------------------------------------------------------------------------------
# one run of the engine

class _Run:
    """State of one spawned engine process (owned by the supervisor thread; fields read by others)."""

    def __init__(self, proc, lane: str | None, argv: list[str], reason: str | None):
        self.proc = proc
        self.pid: int = proc.pid
        self.pgid: int = proc.pid            # start_new_session: pid == pgid == sid
        self.lane = lane
        self.argv = argv
        self.reason = reason                 # why this start happened (None: first start)
        self.t_spawn = time.monotonic()
        self.wall_spawn = time.time()
        self.ready = False
        self.ever_ready = False
        self.t_ready: float | None = None
        self.exit: tuple[int | None, int | None] | None = None   # (code, signal)
        self.t_exit: float | None = None
        self.verdict: str | None = None     # monitor's: wedged | head | not_ready
        self.verdict_detail = ""
        self.term_reason: str | None = None  # why the supervisor stopped it
        self.guard_hit = False              # the guard signalled it
        self.done = threading.Event()       # the run is over: threads stop
        self.members: dict[int, int] = {}   # pid -> starttime, every process seen in its tree
        self.starttime = 0
        self.probe_failures = 0
        self.head_seen = False
        self.head_fail_since: float | None = None
        self.threads: list[threading.Thread] = []
        self.incident: dict | None = None   # the "wedged" incident this run caused
        self.link_hit = False               # a TP link went down during this run


# ---------------------------------------------------------------------------------------------

class Supervisor:
    """Starts, watches and restarts one engine.

    Args:
        cfg: ``config.Config`` (``engine`` must be enabled; ``guard.grace`` is the TERM->KILL time).
        reporter: object with ``event(incident, event)`` / ``finish(incident)`` (TEAM.md), or None.
        count_incident: ``(kind: str, wall: float) -> None`` called when the supervisor opens an
            incident of its own (``"wedged"``), so the daemon's incident counters include it.
        start_control: serve the control socket (``engine.control_socket``).
    Raises (from :meth:`start`):
        OSError: the control socket cannot be created (another daemon owns it, no permission).
    """

    def __init__(self, cfg, reporter=None, count_incident: Callable[[str, float], None] | None = None,
                 start_control: bool = True):
        from sparkguard import config as config_mod
        self._config_mod = config_mod
        self.cfg = cfg
        self.ecfg = cfg.engine
        self.reporter = reporter
        self.count_incident = count_incident
        self.start_control = start_control
        self.cv = threading.Condition()
        self.state = "stopped"
        self.detail = ""
        self.want = "run"
        self.quit = False
        self.request: tuple[str, str | None] | None = None
        self.run: _Run | None = None
        self.last_run: _Run | None = None
        self.lane = self._initial_lane()
        self.restarts = {r: 0 for r in REASONS}
        self.starts = 0
        self.ready_count = 0
        self.exits = 0
        self.backoff = Backoff(self.ecfg.backoff_initial, self.ecfg.backoff_max, self.ecfg.stable_after)
        self.delay = 0.0
        self.next_start_at: float | None = None
        self.next_reason: str | None = None
        self.time_to_ready: float | None = None
        self.quiesce_wait: float | None = None
        self.quiesce_timed_out = False
        self.last_exit: dict | None = None
        self.history: collections.deque[dict] = collections.deque(maxlen=HISTORY)
        self.lines: collections.deque[tuple[float, str, str]] = collections.deque(maxlen=self.ecfg.log_lines)
        self.last_lines: list[str] = []
        self.incident_open = False
        self.link_down = False
        self.pending_incidents: collections.deque[dict] = collections.deque()
        self.peer_states: list[dict] = []
        self.previous: dict | None = None
        self.thread: threading.Thread | None = None
        self.control = None
        self.sink = LogSink(self.ecfg.log, self.ecfg.journal_socket,
                            self.ecfg.identifier or identifier_for(self.ecfg.command))

    # ---- state file -----------------------------------------------------------------------

    def _read_state(self) -> dict:
        try:
            with open(self.ecfg.state_file) as f:
                st = json.load(f)
            return st if isinstance(st, dict) else {}
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as e:
            log.warning("engine state file %s unreadable (%s); starting from the config", self.ecfg.state_file, e)
            return {}

    def _initial_lane(self) -> str | None:
        """The lane to start in: the persisted one (``sparkguard engine lane``) unless the
        config's ``engine.lane`` changed since it was persisted; else the config's (or the first)."""
        e = self.ecfg
        if not e.lanes:
            return None
        cfg_lane = e.lane or next(iter(e.lanes))
        st = self._read_state()
        lane = st.get("lane")
        if lane in e.lanes and st.get("config_lane") == cfg_lane:
            return lane
        if lane and lane not in e.lanes:
            log.warning("persisted lane %r is not in engine.lanes any more; using %r", lane, cfg_lane)
        return cfg_lane

    def _write_state(self) -> None:
        """Persist lane and the current run's identity (atomic: temp file, fsync, rename)."""
        from sparkguard import sysinfo
        e = self.ecfg
        run = self.run
        st = {"version": 1, "lane": self.lane, "config_lane": (e.lane or next(iter(e.lanes))) if e.lanes else None,
              "boot_id": sysinfo.boot_id(), "updated_at": time.time()}
        if run is not None:
            st["engine"] = {"pid": run.pid, "pgid": run.pgid, "starttime": run.starttime,
                            "members": {str(k): v for k, v in dict(run.members).items()}}
        path = e.state_file
        try:
            os.makedirs(os.path.dirname(os.path.abspath(path)), mode=0o755, exist_ok=True)
            tmp = f"{path}.tmp{os.getpid()}"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
            with os.fdopen(fd, "w") as f:
                json.dump(st, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except OSError as ex:
            log.warning("cannot write engine state file %s: %s (the lane will not survive a restart)", path, ex)

    # ---- public API (any thread) ------------------------------------------------------------

    def start(self) -> None:
        """Open the control socket and start the supervisor thread (which starts the engine).

        Raises:
            OSError: the control socket cannot be served (another daemon, permissions).
        """
        if self.start_control:
            from sparkguard import control
            self.control = control.ControlServer(self.ecfg.control_socket, self.handle)
            self.control.start()
        self.previous = self._read_state().get("engine")
        self.thread = threading.Thread(target=self._main, name="sg-supervisor", daemon=True)
        self.thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Stop the engine (SIGTERM, ``guard.grace``, SIGKILL of the tree and leftovers), flush
        pending incident reports, close the control socket.  Blocks up to ``timeout`` seconds
        (default grace * 2 + 10)."""
        if self.control is not None:
            self.control.stop()
        with self.cv:
            self.quit = True
            self.cv.notify_all()
        if self.thread is not None:
            self.thread.join(timeout if timeout is not None else self.cfg.guard.grace * 2 + 10)
        self._flush_incidents("daemon stopping")
        self.sink.close()

    def reload(self, cfg) -> None:
        """New configuration (SIGHUP): gates, health, probe, restart policy take effect now or at the
        next start; the command, env and lanes at the next start.  The control socket path needs a
        daemon restart."""
        with self.cv:
            if cfg.engine.control_socket != self.ecfg.control_socket:
                log.warning("engine.control_socket changed to %s: takes effect after a restart",
                            cfg.engine.control_socket)
            self.cfg, self.ecfg = cfg, cfg.engine
            self.backoff.initial, self.backoff.maximum = cfg.engine.backoff_initial, cfg.engine.backoff_max
            self.backoff.stable_after = cfg.engine.stable_after
            if self.lane not in cfg.engine.lanes:
                self.lane = (cfg.engine.lane or next(iter(cfg.engine.lanes))) if cfg.engine.lanes else None
            self.cv.notify_all()

    def engine_pid(self) -> int | None:
        """PID of the running engine's root (None when none runs)."""
        run = self.run
        return run.pid if run is not None and run.exit is None else None

    def target(self, procs: dict, protector):
        """The supervised engine as the guard's target: its root, descendants and every process
        still in its process group (reparented ``VLLM::`` orphans included).

        Args:
            procs: a ``proctree.scan()``; protector: ``proctree.Protector``.
        Returns:
            ``proctree.Target`` (pattern ``"engine:supervised"``) or None when no engine runs.
        """
        from sparkguard import proctree
        run = self.run
        if run is None:
            return None
        root = procs.get(run.pid)
        if root is None or (run.starttime and root.starttime != run.starttime) or _proc_state(run.pid) in ("Z", None):
            return None
        kids = proctree.children_map(procs)
        tree = set(proctree.descendants([run.pid], kids))
        extra = [p.pid for p in procs.values()
                 if p.pid not in tree and (p.pgrp == run.pgid or run.members.get(p.pid) == p.starttime)
                 and not p.kthread]
        if extra:
            kids = dict(kids)
            kids[run.pid] = list(kids.get(run.pid, [])) + extra
        return proctree.build_target(run.pid, "engine:supervised", procs, kids, protector)

    def on_guard_event(self, incident: dict, event: dict) -> None:
        """The guard recorded ``event`` in ``incident`` (called from the poll loop; never blocks).

        ``crossed`` holds restarts until the incident is closed; ``sigterm``/``sigkill``/
        ``would_*`` naming the engine mark the run as hit by the guard (restart reason ``guard``).
        """
        ev = event.get("event")
        run = self.run
        if ev == "crossed":
            self.incident_open = True
        elif ev in ("sigterm", "sigkill") and run is not None:
            pids = set(event.get("pids") or ())
            if run.pid in pids or pids & set(dict(run.members)):
                run.guard_hit = True
                self._history("guard", f"guard {ev} of the engine (incident {incident.get('id')})")
        self._poke()

    def _poke(self) -> None:
        """Wake the supervisor without ever blocking the caller (the poll loop): a missed wake-up
        is caught by the supervisor's bounded waits."""
        if self.cv.acquire(timeout=0.005):
            try:
                self.cv.notify_all()
            finally:
                self.cv.release()

    def link_event(self, down: bool, detail: str) -> None:
        """The TP link watch declared a link incident (``down``) or its end (``link.mark_unhealthy``).

        While a link is down the engine (NCCL hangs inside a collective) is marked unhealthy and no
        new start happens; once the link is back the engine is restarted (reason ``link``) so its
        ranks meet again.  Never blocks.
        """
        if down:
            self.link_down = True
            run = self.run
            if run is not None:
                run.link_hit = True
            self._history("link", f"TP link down ({detail}): engine marked unhealthy; restart once it is back")
        else:
            self.link_down = False
            run = self.run
            if run is not None and run.link_hit and self.request is None and self.want == "run":
                self.request = ("link", None)
            self._history("link", f"TP link back ({detail})")
        self._poke()

    def take_incident(self, incident: dict) -> bool:
        """The guard closed ``incident``: add the engine's state and last output lines, and report it
        (``reporter.finish``) now, or after the restart it caused (with a ``restart`` event).

        Returns True (the supervisor took over finishing it).  Never blocks.
        """
        run = self.run if self.run is not None else self.last_run
        hit = run is not None and run.guard_hit
        incident["engine"] = self._engine_info(run)
        restarting = hit and self.want == "run" and not self.quit and self.ecfg.restart != "never"
        if restarting:
            self.pending_incidents.append(incident)
        self.incident_open = False
        self._poke()
        if not restarting:
            self._finish(incident)
        return True

    def command(self, op: str, lane: str | None = None) -> dict:
        """Control: ``start``, ``stop``, ``restart``, ``lane`` (with ``lane``).

        Returns:
            ``{"ok": bool, "error": str?, "starts": int, "status": dict}``; ``starts`` is the
            spawn count before the command (wait for ``starts`` > it, then ready).
        """
        with self.cv:
            starts = self.starts
            if op == "start":
                if self.want == "run" and self.state not in ("exited", "failed"):
                    return {"ok": True, "starts": starts, "note": "already running", "status": self._status()}
                self.want = "run"
                self.backoff.reset()
                self.delay = 0.0
                self.next_reason = None
                self._history("command", "start")
            elif op == "stop":
                self.want = "stop"
                self.request = None
                self._history("command", "stop")
            elif op == "restart":
                self.want = "run"
                self.backoff.reset()
                self.request = ("restart", None)
                self._history("command", "restart")
            elif op == "lane":
                if not self.ecfg.lanes:
                    return {"ok": False, "error": "no engine.lanes configured"}
                if lane not in self.ecfg.lanes:
                    return {"ok": False, "error": f"no lane {lane!r}; engine.lanes has " + ", ".join(self.ecfg.lanes)}
                self.want = "run"
                self.backoff.reset()
                self.request = ("lane", lane)
                self._history("command", f"lane {lane}")
            else:
                return {"ok": False, "error": f"unknown command {op!r}"}
            self.cv.notify_all()
            return {"ok": True, "starts": starts, "status": self._status()}

    def wait(self, until: str, after: int = 0, timeout: float = 60.0, lane: str | None = None) -> dict:
        """Block until a condition (control ``wait``; bounded by ``timeout`` seconds).

        Args:
            until: ``"ready"`` (a start after the ``after``-th is ready, in ``lane`` if given),
                ``"stopped"``, or ``"starts"`` (spawn count > ``after``).
        Returns:
            ``{"ok": bool, "error": str?, "status": dict}``; ``ok`` False on timeout or when the
            engine gave up (stopped, exited, failed, or crashed into backoff) instead.
        """
        deadline = time.monotonic() + timeout

        def done() -> str | None:
            if self.quit:
                return "the daemon is stopping"
            if until == "stopped":
                return "" if self.state in ("stopped", "exited", "failed") else None
            if until == "starts":
                return "" if self.starts > after else None
            run = self.run
            if self.starts > after and run is not None and run.ready and (lane is None or run.lane == lane):
                return ""
            if self.starts > after and self.state in ("backoff", "exited", "failed", "stopped"):
                le = self.last_exit or {}
                return f"the engine did not become ready: {self.state} ({le.get('detail', self.detail)})"
            if self.want == "stop" and self.state == "stopped":
                return "the engine was stopped"
            return None

        with self.cv:
            while True:
                r = done()
                if r is not None:
                    return {"ok": r == "", **({"error": r} if r else {}), "status": self._status()}
                left = deadline - time.monotonic()
                if left <= 0:
                    return {"ok": False, "error": f"timed out after {timeout:g} s ({self.state}: {self.detail})",
                            "status": self._status()}
                self.cv.wait(left)

    def handle(self, req: dict) -> dict:
        """Control-socket request -> response (see :mod:`sparkguard.control` for the protocol)."""
        op = req.get("op")
        if op == "status":
            with self.cv:
                return {"ok": True, "status": self._status()}
        if op in ("start", "stop", "restart", "lane"):
            return self.command(op, req.get("lane"))
        if op == "wait":
            try:
                timeout = float(req.get("timeout", 60))
                after = int(req.get("after", 0))
            except (TypeError, ValueError):
                return {"ok": False, "error": "bad wait arguments"}
            return self.wait(str(req.get("until", "ready")), after, min(max(timeout, 0.0), 86400.0), req.get("lane"))
        return {"ok": False, "error": f"unknown op {op!r}; expected status, start, stop, restart, lane, wait"}

    def status(self) -> dict:
        """JSON-ready engine state (see :func:`describe`); cheap, any thread."""
        with self.cv:
            return self._status()

    def _status(self) -> dict:
        run = self.run
        now_m, now_w = time.monotonic(), time.time()
        st = {
            "state": self.state, "detail": self.detail, "want": self.want,
            "pid": run.pid if run and run.exit is None else None,
            "lane": self.lane, "lanes": list(self.ecfg.lanes),
            "command": list(self.ecfg.command or ()) + (list(self.ecfg.lanes[self.lane].args) if self.lane else []),
            "up": bool(run and run.exit is None), "ready": bool(run and run.ready and run.exit is None),
            "started_at": run.wall_spawn if run else None,
            "uptime": (now_m - run.t_spawn) if run and run.exit is None else None,
            "time_to_ready": self.time_to_ready, "quiesce_wait": self.quiesce_wait,
            "quiesce_timed_out": self.quiesce_timed_out,
            "starts": self.starts, "ready_count": self.ready_count, "restarts": dict(self.restarts),
            "backoff": self.delay, "consecutive_failures": self.backoff.failures,
            "next_start_at": (now_w + self.next_start_at - now_m) if self.next_start_at else None,
            "restart_policy": self.ecfg.restart, "last_exit": self.last_exit,
            "probe_failures": run.probe_failures if run else 0,
            "peers": list(self.peer_states), "history": list(self.history),
            "control_socket": self.ecfg.control_socket,
        }
        return st

    def collector(self):
        """A prometheus_client collector of the engine metrics (see :class:`EngineCollector`)."""
        return EngineCollector(self)

    # ---- helpers --------------------------------------------------------------------------

    def _history(self, event: str, detail: str) -> None:
        self.history.append({"at": time.time(), "mono": time.monotonic(), "event": event, "detail": detail})
        log.info("engine: %s: %s", event, detail)

    def _set(self, state: str, detail: str = "") -> None:
        with self.cv:
            self.state, self.detail = state, detail
            self.cv.notify_all()

    def _interrupted(self) -> bool:
        return self.quit or self.want != "run" or self.request is not None

    def _wait(self, seconds: float, pred: Callable[[], bool] | None = None) -> bool:
        """Wait up to ``seconds`` on the condition; True if ``pred`` (default: interrupted) became true."""
        pred = pred or self._interrupted
        with self.cv:
            return self.cv.wait_for(pred, timeout=max(0.0, seconds))

    def _engine_info(self, run: _Run | None) -> dict:
        lines = self.last_lines if (run is not None and run.exit is not None and self.last_lines) else \
            [ln for _, _, ln in self.lines]
        return {"state": self.state, "lane": run.lane if run else self.lane, "pid": run.pid if run else None,
                "command": run.argv if run else None, "exit": self.last_exit if run and run.exit else None,
                "restarts": dict(self.restarts), "last_lines": lines[-self.ecfg.log_lines:]}

    def _finish(self, incident: dict) -> None:
        if self.reporter is not None:
            try:
                self.reporter.finish(incident)
            except Exception as e:  # noqa: BLE001 - reporting must never break supervision
                log.error("reporting incident %s failed: %s", incident.get("id"), e)

    def _incident_event(self, incident: dict, event: str, detail: str, pids: list[int] | None = None) -> dict:
        now = time.time()
        try:
            avail = read_mem_available()
        except (OSError, ValueError):
            avail = 0
        ev = {"event": event, "t": round(now - incident["started_at"], 4), "at": now, "available_bytes": avail,
              "pids": list(pids or []), "detail": detail}
        incident["timeline"].append(ev)
        if self.reporter is not None:
            try:
                self.reporter.event(incident, ev)
            except Exception as e:  # noqa: BLE001
                log.error("reporting an event of incident %s failed: %s", incident.get("id"), e)
        return ev

    def _flush_incidents(self, why: str, restart_detail: str | None = None, pids: list[int] | None = None) -> None:
        pend = []
        while self.pending_incidents:
            pend.append(self.pending_incidents.popleft())
        for inc in pend:
            if restart_detail is not None:
                self._incident_event(inc, "restart", restart_detail, pids)
                inc["engine"]["restarted"] = True
                inc["summary"] = (inc.get("summary") or "") + "; engine restarted"
            else:
                self._incident_event(inc, "no_restart", why)
            inc["engine"]["state"] = self.state
            self._finish(inc)

    # ---- the supervisor thread --------------------------------------------------------------

    def _main(self) -> None:
        try:
            self._sweep_previous()
            while True:
                with self.cv:
                    if self.quit:
                        break
                    req, self.request = self.request, None
                    if self.want != "run":
                        if self.state not in ("exited", "failed"):
                            self.state, self.detail = "stopped", "stopped by command" if self.starts else "not started"
                        self.cv.notify_all()
                if self.want != "run":
                    self._flush_incidents("the engine is stopped")
                    with self.cv:
                        self.cv.wait_for(lambda: self.quit or self.want == "run" or self.request is not None, 5.0)
                    continue
                with self.cv:
                    if req is not None:
                        kind, arg = req
                        self.delay, self.next_start_at = 0.0, None
                        if kind == "lane":
                            self.lane = arg
                            self.next_reason = "lane" if self.starts else None
                        else:
                            self.next_reason = ("link" if kind == "link" else "manual") if self.starts else None
                if req is not None and req[0] == "lane":
                    self._write_state()
                if not self._backoff():
                    continue
                self._flush_leftovers()
                if not self._gates():
                    continue
                self._spawn()
                self._supervise()
        except Exception:  # noqa: BLE001 - log loudly; the guard itself keeps running
            log.exception("engine supervisor failed; the guard keeps running without it")
            self._set("failed", "supervisor error (see the daemon's log)")
        finally:
            if self.run is not None and self.run.exit is None:
                self._terminate("shutdown")
                self._await_exit(self.cfg.guard.grace + 10)
            if self.run is not None:
                self._after_run()
            self._flush_incidents("daemon stopping")

    def _backoff(self) -> bool:
        if self.delay <= 0:
            return True
        deadline = time.monotonic() + self.delay
        with self.cv:
            self.next_start_at = deadline
            le = self.last_exit or {}
            self.state = "backoff"
            self.detail = (f"restart {self.backoff.failures} in a row in {self.delay:g} s after "
                           f"{le.get('detail', 'exit')}")
            self.cv.notify_all()
        interrupted = self._wait(self.delay)
        with self.cv:
            self.next_start_at = None
            if interrupted:
                return False
            self.delay = 0.0
        return True

    def _gates(self) -> bool:
        """Guard hold, drop caches, quiesce, peers.  False when interrupted (stop/lane/quit)."""
        e = self.ecfg
        t0 = time.monotonic()
        deadline = t0 + e.quiesce_timeout
        while self.incident_open or self.link_down:
            self._set("waiting", "a guard incident is open (memory below the SIGTERM line)" if self.incident_open
                      else "the TP link is down")
            self._wait(1.0, lambda: self._interrupted() or not (self.incident_open or self.link_down))
            if self._interrupted():
                return False
        if e.drop_caches:
            self._set("waiting", "sync and drop caches")
            self._history("drop_caches", drop_caches())
        gate = QuiesceGate(e.start_above, e.stable_for, e.stable_band)
        timed_out = False
        announced: bool | str = False
        from sparkguard.units import format_size
        while True:
            now = time.monotonic()
            try:
                avail = read_mem_available()
            except (OSError, ValueError) as ex:
                log.error("reading MemAvailable failed: %s", ex)
                avail = 0
            if gate.feed(now, avail):
                break
            if now >= deadline:
                timed_out = True
                break
            self._set("waiting", f"quiesce: MemAvailable {format_size(avail)}, need >= {format_size(e.start_above)} "
                                 f"stable for {e.stable_for:g} s")
            if not announced:
                announced = True
                self._history("waiting", f"{self.detail}; starting anyway after {e.quiesce_timeout:g} s")
            if self._wait(min(MEM_SAMPLE, deadline - now)):
                return False
            if self.incident_open:
                return self._gates() if not self._interrupted() else False
        if e.peers and not timed_out:
            from sparkguard import peers
            while True:
                states = peers.check(e.peers, e.start_above, timeout=min(3.0, max(0.5, e.health_interval)))
                with self.cv:
                    self.peer_states = [s.as_dict() for s in states]
                if all(s.ok for s in states):
                    break
                now = time.monotonic()
                if now >= deadline:
                    timed_out = True
                    break
                waiting = "; ".join(f"{s.url}: " + (s.error or f"{format_size(s.available_bytes)} available")
                                    for s in states if not s.ok)
                self._set("waiting", f"peers: {waiting}; need >= {format_size(e.start_above)} each")
                if announced != "peers":
                    announced = "peers"
                    self._history("waiting", self.detail)
                if self._wait(min(PEER_EVERY, deadline - now)):
                    return False
        waited = time.monotonic() - t0
        with self.cv:
            self.quiesce_wait, self.quiesce_timed_out = waited, timed_out
        if timed_out:
            self._history("quiesce_timeout", f"starting anyway after {waited:.1f} s: {self.detail}")
            log.warning("engine: quiesce gate not met after %.0f s (engine.quiesce_timeout); starting anyway: %s",
                        waited, self.detail)
        else:
            self._history("quiesced", f"memory gate met after {waited:.2f} s")
        return True

    def _argv_env(self) -> tuple[list[str], dict[str, str]]:
        e = self.ecfg
        lane = e.lanes.get(self.lane) if self.lane else None
        argv = list(e.command) + (list(lane.args) if lane else [])
        env = {k: v for k, v in os.environ.items() if k not in _ENV_DROP}
        if e.user is not None:
            import pwd
            pw = pwd.getpwuid(int(e.user)) if e.user.isdigit() else pwd.getpwnam(e.user)
            env.update(HOME=pw.pw_dir, USER=pw.pw_name, LOGNAME=pw.pw_name)
        env.update(e.env)
        if lane:
            env.update(lane.env)
        cm = self._config_mod
        if cm.is_vllm(argv) and cm.SHUTDOWN_ENV not in env and not any(
                a == "--shutdown-timeout" or a.startswith("--shutdown-timeout=") for a in argv):
            secs = e.shutdown_timeout if e.shutdown_timeout is not None else cm.vllm_shutdown_timeout(self.cfg.guard.grace)
            env[cm.SHUTDOWN_ENV] = f"{secs:g}"
        return argv, env

    def _spawn(self) -> None:
        import subprocess
        from sparkguard import proctree
        e = self.ecfg
        argv, env = self._argv_env()
        kw: dict[str, Any] = {}
        if e.user is not None:
            import pwd
            pw = pwd.getpwuid(int(e.user)) if e.user.isdigit() else pwd.getpwnam(e.user)
            kw.update(user=pw.pw_uid, group=pw.pw_gid, extra_groups=os.getgrouplist(pw.pw_name, pw.pw_gid))
        # sh resets the oom_score_adj inherited from the daemon (-1000 would make the engine
        # unkillable by the kernel and protected from the guard), then execs the engine: same pid.
        wrapper = ["/bin/sh", "-c", 'echo 0 > /proc/self/oom_score_adj 2>/dev/null; exec "$@"', "sparkguard-engine"]
        reason = self.next_reason
        with self.cv:
            self.lines.clear()
        try:
            proc = subprocess.Popen(wrapper + argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, cwd=e.cwd, env=env, start_new_session=True,
                                    close_fds=True, **kw)
        except OSError as ex:
            log.error("engine: cannot start %s: %s", argv, ex)
            with self.cv:
                self.exits += 1
                self.last_exit = {"code": None, "signal": None, "at": time.time(), "uptime": 0.0,
                                  "reason": "exit", "detail": f"cannot start: {ex}"}
                self._schedule_restart("exit", failure=True, uptime=0.0)
            return
        run = _Run(proc, self.lane, argv, reason)
        p = proctree.read_proc(run.pid)
        run.starttime = p.starttime if p else 0
        if p:
            run.members[run.pid] = p.starttime
        with self.cv:
            self.run = run
            self.starts += 1
            if reason:
                self.restarts[reason] = self.restarts.get(reason, 0) + 1
            self.next_reason = None
            self.state, self.detail = "starting", f"pid {run.pid}" + (f", lane {run.lane}" if run.lane else "")
            self._history("start", f"pid {run.pid}" + (f" lane {run.lane}" if run.lane else "")
                          + (f" (restart: {reason})" if reason else "") + ": " + " ".join(argv)[:300])
            self.cv.notify_all()
        self._write_state()
        from sparkguard.units import format_size
        try:
            avail = format_size(read_mem_available())
        except (OSError, ValueError):
            avail = "?"
        self._flush_incidents("", restart_detail=(
            f"engine restarted (pid {run.pid}{', lane ' + run.lane if run.lane else ''}) after a quiesce wait of "
            f"{self.quiesce_wait or 0:.1f} s{' (timed out)' if self.quiesce_timed_out else ''}; MemAvailable {avail}"),
            pids=[run.pid])
        for name, target in (("sg-engine-exit", self._watch_exit), ("sg-engine-out", self._pump),
                             ("sg-engine-mon", self._monitor)):
            t = threading.Thread(target=target, args=(run,), name=name, daemon=True)
            run.threads.append(t)
            t.start()

    def _supervise(self) -> None:
        """Wait for the run to end; stop it on a command, a verdict or shutdown."""
        run = self.run
        while True:
            with self.cv:
                self.cv.wait_for(lambda: run.exit is not None or run.verdict is not None or self._interrupted())
                if run.exit is not None:
                    break
                if self.quit:
                    why = "shutdown"
                elif self.want != "run":
                    why = "stop"
                elif self.request is not None:
                    why = self.request[0]
                    if why == "restart":
                        why = "manual"
                else:
                    why = run.verdict
            if run.term_reason is None:
                if why == "wedged" and self.cfg.guard.dry_run:
                    self._wedged_dry_run(run)
                    continue
                self._terminate(why)
            elif not self._await_exit(1.0):
                continue
        self._after_run()

    def _await_exit(self, timeout: float) -> bool:
        run = self.run
        with self.cv:
            return self.cv.wait_for(lambda: run.exit is not None, timeout=timeout)

    def _tree(self, run: _Run):
        """pidfd Tree of the run: root first, then live members and process-group members."""
        from sparkguard import proctree, signals
        procs = proctree.scan()
        kids = proctree.children_map(procs)
        pids = [pid for pid in proctree.descendants([run.pid], kids) if pid in procs]
        for p in procs.values():
            if p.pid not in pids and not p.kthread and (p.pgrp == run.pgid or run.members.get(p.pid) == p.starttime):
                pids.append(p.pid)
        for pid in pids:
            run.members.setdefault(pid, procs[pid].starttime)
        if run.pid not in pids:
            pids.insert(0, run.pid)
        return signals.Tree(pids, {pid: procs[pid].starttime for pid in pids if pid in procs})

    def _terminate(self, why: str) -> None:
        """SIGTERM the root, wait ``guard.grace`` for it to exit, then SIGKILL the whole tree."""
        from sparkguard import proctree
        run = self.run
        run.term_reason = why
        grace = self.cfg.guard.grace
        self._set("stopping", f"{why}: SIGTERM pid {run.pid}, SIGKILL after {grace:g} s")
        tree = self._tree(run)
        try:
            sent = tree.term_root()
            self._history("sigterm", f"{why}: SIGTERM pid {run.pid}" + ("" if sent else " (already gone)"))
            inc = run.incident
            if inc is not None:
                self._incident_event(inc, "sigterm", f"SIGTERM the wedged engine (pid {run.pid})", [run.pid])
            if self._await_exit(grace):
                return
            killed = tree.kill_all(proctree.Protector(self.cfg.targets.protect))
            self._history("sigkill", f"{why}: pid {run.pid} still alive {grace:g} s after SIGTERM; "
                                     f"SIGKILL {len(killed)} processes")
            if inc is not None:
                self._incident_event(inc, "sigkill", f"SIGKILL {len(killed)} processes {grace:g} s after SIGTERM",
                                     killed)
            self._await_exit(10.0)
        finally:
            tree.close()

    def _after_run(self) -> None:
        """The root exited: record it, sweep leftovers, reap, decide about the restart."""
        run = self.run
        run.done.set()
        code, sig = run.exit if run.exit is not None else (None, None)
        uptime = (run.t_exit or time.monotonic()) - run.t_spawn
        self._set("sweeping", f"pid {run.pid} exited; sweeping what is left of its tree")
        swept = self._sweep(run.pgid, run.members, exclude=run.pid)
        try:
            run.proc.wait(timeout=5)   # reap the root only now: its pgid stayed reserved meanwhile
        except Exception:  # noqa: BLE001
            pass
        for t in run.threads:
            if t is not threading.current_thread():
                t.join(2.0)
        for stream in (run.proc.stdout, run.proc.stderr):
            try:
                stream.close()
            except (OSError, AttributeError):
                pass
        how = f"exit code {code}" if code is not None else f"signal {signal.Signals(sig).name}" if sig else "unknown"
        failure = not (code == 0)
        if run.term_reason in ("stop", "shutdown"):
            reason = None
        elif run.term_reason in ("lane", "manual", "link"):
            reason = run.term_reason
        elif run.term_reason in ("wedged", "head", "not_ready"):
            reason, failure = run.term_reason, True
        elif run.guard_hit:
            reason, failure = "guard", True
        else:
            reason = "exit"
        detail = f"{how} after {uptime:.1f} s" + (f" ({run.term_reason})" if run.term_reason else
                                                   " (guard)" if run.guard_hit else "")
        if swept:
            detail += f"; swept {len(swept)} leftover processes"
        with self.cv:
            self.last_lines = [ln for _, _, ln in self.lines]
            self.exits += 1
            self.last_exit = {"code": code, "signal": signal.Signals(sig).name if sig else None, "at": time.time(),
                              "uptime": uptime, "reason": reason or run.term_reason, "detail": detail,
                              "pid": run.pid, "lane": run.lane}
            self._history("exit", f"pid {run.pid} {detail}")
            self.last_run, self.run = run, None
            if reason is None:
                self.state, self.detail = "stopped", f"stopped ({run.term_reason})"
            elif reason in ("lane", "manual", "link"):
                self.next_reason = reason
                self.delay = 0.0
            else:
                self._schedule_restart(reason, failure, uptime)
            self.cv.notify_all()
        inc = run.incident
        if inc is not None:
            self._incident_event(inc, "exited", f"engine pid {run.pid}: {detail}", [run.pid])
            kinds = [ev["event"] for ev in inc["timeline"]]
            inc["outcome"] = "killed" if "sigkill" in kinds else "terminated"
            inc["ended_at"] = time.time()
            inc["engine"] = self._engine_info(run)
            inc["summary"] = (f"engine wedged: {run.verdict_detail}; {inc['outcome']}"
                              + ("; restarting" if self.want == "run" and self.ecfg.restart != "never" else ""))
            self.pending_incidents.append(inc)
        self._write_state()
        if self.want != "run" or self.quit or (self.state in ("exited", "failed")):
            self._flush_incidents("the engine is not restarted" if not self.quit else "daemon stopping")

    def _schedule_restart(self, reason: str, failure: bool, uptime: float) -> None:
        """Decide (under ``cv``) whether and when to restart after an exit for ``reason``."""
        policy = self.ecfg.restart
        if policy == "never" or (policy == "on-failure" and not failure):
            self.want = "stop"
            self.state = "exited" if not failure else "failed"
            self.detail = f"not restarted (engine.restart: {policy}): {self.last_exit and self.last_exit['detail']}"
            self._history("no_restart", self.detail)
            return
        self.delay = self.backoff.next(uptime)
        self.next_reason = reason
        if self.backoff.failures > 2:
            log.warning("engine: crash loop? %d restarts in a row; next in %g s", self.backoff.failures, self.delay)

    # ---- per-run threads ---------------------------------------------------------------------

    def _watch_exit(self, run: _Run) -> None:
        """Block on the root's pidfd; record its exit status without reaping (waitid WNOWAIT)."""
        try:
            fd = os.pidfd_open(run.pid)
        except OSError:
            fd = None
        try:
            if fd is not None:
                select.select([fd], [], [])
            info = os.waitid(os.P_PID, run.pid, os.WEXITED | os.WNOWAIT)
            if info is None:
                code = sig = None
            elif info.si_code == os.CLD_EXITED:
                code, sig = info.si_status, None
            else:
                code, sig = None, info.si_status
        except ChildProcessError:
            code = sig = None
        finally:
            if fd is not None:
                os.close(fd)
        with self.cv:
            run.exit = (code, sig)
            run.t_exit = time.monotonic()
            run.ready = False
            self.cv.notify_all()

    def _pump(self, run: _Run) -> None:
        """Forward stdout/stderr line by line until both pipes close (orphans holding them included)."""
        import selectors
        sel = selectors.DefaultSelector()
        bufs = {}
        for name, f in (("stdout", run.proc.stdout), ("stderr", run.proc.stderr)):
            os.set_blocking(f.fileno(), False)
            sel.register(f.fileno(), selectors.EVENT_READ, name)
            bufs[name] = b""
        open_fds = 2
        try:
            while open_fds:
                for key, _ in sel.select():
                    name = key.data
                    try:
                        chunk = os.read(key.fd, 65536)
                    except BlockingIOError:
                        continue
                    except OSError:
                        chunk = b""
                    if not chunk:
                        sel.unregister(key.fd)
                        open_fds -= 1
                        if bufs[name]:
                            self._line(run, name, bufs[name])
                            bufs[name] = b""
                        continue
                    buf = bufs[name] + chunk
                    *lines, rest = buf.split(b"\n")
                    for ln in lines:
                        self._line(run, name, ln)
                    while len(rest) > MAX_LINE:
                        self._line(run, name, rest[:MAX_LINE])
                        rest = rest[MAX_LINE:]
                    bufs[name] = rest
        except (OSError, ValueError) as e:  # pipes closed under us at shutdown
            log.debug("engine output pump ended: %s", e)
        finally:
            sel.close()

    def _line(self, run: _Run, stream: str, raw: bytes) -> None:
        line = raw.rstrip(b"\r").decode("utf-8", "replace")
        self.lines.append((time.time(), stream, line))
        self.sink.write(line, stream, run.pid, run.lane)

    def _monitor(self, run: _Run) -> None:
        """Health -> ready, then liveness probe, head watch, membership refresh (until the run ends)."""
        e = self.ecfg
        next_members = 0.0
        next_probe = None
        model = None
        while not run.done.is_set() and run.exit is None and run.term_reason is None:
            now = time.monotonic()
            e = self.ecfg
            if now >= next_members:
                self._refresh_members(run)
                next_members = now + (e.health_interval if not run.ever_ready else MEMBERS_EVERY)
            if not run.ever_ready:
                ok = True
                if e.health_url:
                    ok = self._health(e.health_url, e.health_interval)
                if ok:
                    self._became_ready(run)
                    self._refresh_members(run)      # the whole tree exists once it serves
                    if e.probe is not None:
                        next_probe = time.monotonic() + e.probe.interval
                elif now - run.t_spawn >= e.ready_timeout:
                    self._verdict(run, "not_ready", f"no 200 from {e.health_url} within {e.ready_timeout:g} s")
                    return
            else:
                if e.health_url:
                    ok = self._health(e.health_url, e.health_interval)
                    if ok != run.ready and run.exit is None:
                        with self.cv:
                            run.ready = ok
                            self.state = "ready" if ok else "starting"
                            self.detail = f"pid {run.pid}" + ("" if ok else f": {e.health_url} not answering 200")
                            self.cv.notify_all()
                if next_probe is not None and time.monotonic() >= next_probe and e.probe is not None:
                    ok, why, model = self._probe(e, model)
                    next_probe = time.monotonic() + e.probe.interval
                    with self.cv:
                        run.probe_failures = 0 if ok else run.probe_failures + 1
                        fails = run.probe_failures
                    if not ok:
                        log.warning("engine: liveness probe failed (%d/%d): %s", fails, e.probe.failures, why)
                        if fails >= e.probe.failures:
                            self._verdict(run, "wedged", f"{fails} liveness probes failed in a row (last: {why}); "
                                                         f"/health still {'200' if run.ready else 'failing'}")
                            return
            if e.head_url:
                if self._head(run, e):
                    return
            waits = [e.health_interval]
            if next_probe is not None:
                waits.append(max(0.0, next_probe - time.monotonic()))
            run.done.wait(min(waits))

    def _health(self, url: str, interval: float) -> bool:
        try:
            status, _ = _http(url, timeout=min(5.0, max(0.5, interval)))
            return status == 200
        except OSError:
            return False

    def _probe(self, e, model: str | None) -> tuple[bool, str, str | None]:
        """One real one-token completion.  Returns (ok, why, model)."""
        p = e.probe
        base = _base_url(p.url or e.health_url)
        url = p.url or base + "/v1/completions"
        model = p.model or model
        if model is None:
            try:
                status, body = _http(base + "/v1/models", timeout=p.timeout)
                if status == 200:
                    data = json.loads(body or b"{}").get("data") or []
                    model = data[0].get("id") if data else None
            except (OSError, ValueError, AttributeError):
                pass
            if model is None:
                return False, f"no model from {base}/v1/models", None
        t0 = time.monotonic()
        try:
            status, body = _http(url, timeout=p.timeout, body={"model": model, "prompt": "ping", "max_tokens": 1,
                                                                "temperature": 0})
        except OSError as ex:
            return False, f"{url}: {ex} after {time.monotonic() - t0:.1f} s", model
        if status != 200:
            return False, f"{url}: HTTP {status}", model
        try:
            ok = bool(json.loads(body).get("choices"))
        except (ValueError, AttributeError):
            ok = False
        return ok, "" if ok else f"{url}: answer without choices", model

    def _head(self, run: _Run, e) -> bool:
        """Headless rank: True (verdict given) when the head has been gone for head_lost_after."""
        ok = self._health(e.head_url, e.health_interval)
        now = time.monotonic()
        if ok:
            if not run.head_seen:
                self._history("head", f"head {e.head_url} answers")
            run.head_seen, run.head_fail_since = True, None
            return False
        if not run.head_seen:
            return False
        if run.head_fail_since is None:
            run.head_fail_since = now
            self._history("head", f"head {e.head_url} stopped answering 200")
        if now - run.head_fail_since >= e.head_lost_after:
            self._verdict(run, "head", f"head {e.head_url} failing for {now - run.head_fail_since:.1f} s "
                                       f"(engine.head_lost_after {e.head_lost_after:g} s)")
            return True
        return False

    def _became_ready(self, run: _Run) -> None:
        now = time.monotonic()
        with self.cv:
            if run.exit is not None:
                return
            run.ready = run.ever_ready = True
            run.t_ready = now
            self.time_to_ready = now - run.t_spawn
            self.ready_count += 1
            self.state, self.detail = "ready", f"pid {run.pid}" + (f", lane {run.lane}" if run.lane else "")
            self._history("ready", f"pid {run.pid} ready after {self.time_to_ready:.2f} s")
            self.cv.notify_all()

    def _verdict(self, run: _Run, verdict: str, detail: str) -> None:
        if run.exit is not None or run.verdict is not None:
            return
        if verdict == "wedged" and not self.cfg.guard.dry_run:
            run.incident = self._open_wedged_incident(run, detail)   # before _supervise acts on it
        with self.cv:
            run.verdict, run.verdict_detail = verdict, detail
            self._history(verdict, detail)
            self.cv.notify_all()

    def _wedged_dry_run(self, run: _Run) -> None:
        inc = self._open_wedged_incident(run, run.verdict_detail)
        self._incident_event(inc, "would_term", f"dry run: would SIGTERM the wedged engine (pid {run.pid})",
                             [run.pid])
        inc["outcome"], inc["ended_at"] = "dry_run", time.time()
        inc["summary"] = f"engine wedged: {run.verdict_detail}; dry run, nothing signalled"
        self._finish(inc)
        with self.cv:
            run.verdict, run.probe_failures = None, 0
        t = threading.Thread(target=self._monitor, args=(run,), name="sg-engine-mon", daemon=True)
        run.threads.append(t)
        t.start()

    def _open_wedged_incident(self, run: _Run, detail: str) -> dict:
        """An incident of kind ``"wedged"`` in the daemon's incident shape (TEAM.md)."""
        from sparkguard import proctree, sysinfo
        g = self.cfg.guard
        wall = time.time()
        try:
            with open("/proc/meminfo", "rb") as f:
                mi = sysinfo.parse_meminfo(f.read())
        except OSError:
            mi = {}
        procs = proctree.scan()
        t = self.target(procs, proctree.Protector(self.cfg.targets.protect))
        inc = {
            "id": time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(wall)) + "-" + os.urandom(3).hex(),
            "kind": "wedged", "drill": False, "host": sysinfo.hostname(), "boot_id": sysinfo.boot_id(),
            "started_at": wall, "ended_at": None, "dry_run": g.dry_run,
            "thresholds": {"term_below_bytes": g.term_below, "kill_below_bytes": g.kill_below,
                           "grace_seconds": g.grace, "signal": g.signal},
            "meminfo": mi, "psi_memory": sysinfo.read_psi_memory(), "zram": sysinfo.read_zram(),
            "target": None if t is None else {"root_pid": t.root_pid, "title": t.title, "pattern": t.pattern,
                                              "mem_bytes": t.mem_bytes, "tree": t.tree},
            "timeline": [], "outcome": None, "summary": f"engine wedged: {detail}",
            "engine": self._engine_info(run),
        }
        if self.count_incident is not None:
            try:
                self.count_incident("wedged", wall)
            except Exception:  # noqa: BLE001
                pass
        self._incident_event(inc, "wedged", detail, [run.pid])
        return inc

    def _refresh_members(self, run: _Run) -> None:
        """Record every process of the run's tree (pid, starttime) so that reparented ones are
        found by the sweep; persisted when it changed."""
        from sparkguard import proctree
        procs = proctree.scan()
        kids = proctree.children_map(procs)
        changed = False
        for pid in proctree.descendants([run.pid], kids):
            p = procs.get(pid)
            if p is not None and run.members.get(pid) != p.starttime:
                run.members[pid] = p.starttime
                changed = True
        for p in procs.values():
            if p.pgrp == run.pgid and run.members.get(p.pid) != p.starttime:
                run.members[p.pid] = p.starttime
                changed = True
        if changed:
            self._write_state()

    # ---- sweeping ------------------------------------------------------------------------------

    def _leftovers(self, pgid: int | None, members: dict[int, int], exclude: int | None = None,
                   group_ok: bool = True) -> dict[int, int]:
        """Live (non-zombie) processes in process group ``pgid`` (when ``group_ok``) or recorded in
        ``members`` with the same starttime; never sparkguard itself or a kernel thread."""
        from sparkguard import proctree
        procs = proctree.scan()
        me = os.getpid()
        out = {}
        for p in procs.values():
            if p.pid in (me, exclude) or p.kthread or p.pid <= 1:
                continue
            if (group_ok and pgid and p.pgrp == pgid) or members.get(p.pid) == p.starttime:
                if _proc_state(p.pid) not in ("Z", "X", None):
                    out[p.pid] = p.starttime
        return out

    def _sweep(self, pgid: int | None, members: dict[int, int], exclude: int | None = None,
               group_ok: bool = True) -> list[int]:
        """SIGTERM every leftover, wait ``guard.grace`` for all, SIGKILL the rest.  Returns the pids found."""
        from sparkguard import proctree, signals
        left = self._leftovers(pgid, members, exclude, group_ok)
        if not left:
            return []
        pids = sorted(left)
        titles = []
        for pid in pids[:8]:
            p = proctree.read_proc(pid)
            titles.append(f"{pid} {p.cmdline[:40] if p else '?'}")
        self._history("sweep", f"{len(pids)} leftover processes of the engine: " + ", ".join(titles))
        tree = signals.Tree(pids, left)
        try:
            for pid in list(tree.fds):
                tree.send(pid, signal.SIGTERM)
            deadline = time.monotonic() + self.cfg.guard.grace
            poller = select.poll()
            for fd in tree.fds.values():
                poller.register(fd, select.POLLIN)
            while tree.alive() and time.monotonic() < deadline:
                poller.poll(max(1.0, (deadline - time.monotonic()) * 1000.0))
                for fd in list(tree.fds.values()):
                    if select.select([fd], [], [], 0)[0]:
                        try:
                            poller.unregister(fd)
                        except KeyError:
                            pass
            if tree.alive():
                killed = tree.kill_all(proctree.Protector(self.cfg.targets.protect))
                self._history("sweep", f"SIGKILL {len(killed)} leftovers still alive after {self.cfg.guard.grace:g} s")
                deadline = time.monotonic() + 10
                while tree.alive() and time.monotonic() < deadline:
                    poller.poll(100)
        finally:
            tree.close()
        return pids

    def _flush_leftovers(self) -> None:
        """Before a start: sweep anything of the previous run still alive (belt and braces: the
        normal path swept right after the exit)."""
        prev = self.last_run
        if prev is not None:
            self._set("sweeping", "checking for leftovers of the previous run")
            self._sweep(prev.pgid, prev.members, group_ok=False)

    def _sweep_previous(self) -> None:
        """At daemon start: stop what a previous daemon's engine left behind (same boot only).

        Its process group counts only while a recorded member is still alive (then the group
        never emptied, so its id cannot have been reused)."""
        from sparkguard import sysinfo
        prev = self.previous
        st = self._read_state()
        if not prev or st.get("boot_id") != sysinfo.boot_id():
            return
        try:
            members = {int(k): int(v) for k, v in (prev.get("members") or {}).items()}
            pgid = int(prev.get("pgid") or 0)
        except (TypeError, ValueError):
            return
        alive = self._leftovers(None, members)
        if alive:
            self._set("sweeping", "stopping the engine a previous sparkguard left running")
            found = self._sweep(pgid, members, group_ok=True)
            log.warning("engine: stopped %d processes left by a previous sparkguard (pgid %d)", len(found), pgid)


# ---------------------------------------------------------------------------------------------
# metrics

class EngineCollector:
    """prometheus_client collector of the engine metrics (TEAM.md "Metric names", issue #5).

    ``sparkguard_engine_up``, ``_ready`` (0/1), ``sparkguard_engine_restarts_total{reason}``,
    ``sparkguard_engine_lane_info{lane}``, ``sparkguard_engine_time_to_ready_seconds`` (last start;
    absent until one was ready), ``sparkguard_engine_quiesce_wait_seconds`` (last start),
    ``sparkguard_engine_restart_backoff_seconds`` (delay before the pending restart, 0 if none).
    """

    def __init__(self, sup: Supervisor):
        self.sup = sup

    def collect(self):
        """Yield the metric families (prometheus_client Collector protocol)."""
        from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily
        s = self.sup.status()
        P = "sparkguard_engine_"
        yield GaugeMetricFamily(P + "up", "1 while the supervised engine's process runs.", value=float(s["up"]))
        yield GaugeMetricFamily(P + "ready", "1 while the engine answers 200 on engine.health_url "
                                "(or runs, without a health_url).", value=float(s["ready"]))
        c = CounterMetricFamily(P + "restarts", "Engine restarts by reason: exit, guard, wedged, lane, head, "
                                "not_ready, manual, link.", labels=["reason"])
        for r, n in s["restarts"].items():
            c.add_metric([r], float(n))
        yield c
        if s["lane"]:
            i = InfoMetricFamily(P + "lane", "The engine's current lane (engine.lanes).", labels=None)
            i.add_metric([], {"lane": s["lane"]})
            yield i
        if s["time_to_ready"] is not None:
            yield GaugeMetricFamily(P + "time_to_ready_seconds", "Seconds from spawn to ready of the last start.",
                                    value=s["time_to_ready"])
        if s["quiesce_wait"] is not None:
            yield GaugeMetricFamily(P + "quiesce_wait_seconds", "Seconds the last start waited in the memory "
                                    "and peers gates.", value=s["quiesce_wait"])
        yield GaugeMetricFamily(P + "restart_backoff_seconds", "Delay before the pending automatic restart "
                                "(grows in a crash loop), 0 when none.",
                                value=float(s["backoff"] if s["state"] == "backoff" else 0.0))


# ---------------------------------------------------------------------------------------------
# for people

def describe(state: dict | None) -> list[str]:
    """Lines for ``sparkguard status`` / ``sparkguard engine status`` from :meth:`Supervisor.status`
    (as returned over the control socket, see :func:`sparkguard.control.engine_status`).

    Args:
        state: the status dict, or None (no engine supervised / daemon not reachable).
    Returns:
        list[str], the first line a summary.
    """
    from sparkguard.units import format_duration
    if not state:
        return ["engine: not supervised (no engine: section, or the daemon is not running)"]
    s = state
    head = f"engine: {s.get('state')}"
    bits = []
    if s.get("pid"):
        bits.append(f"pid {s['pid']}")
    if s.get("lane"):
        bits.append(f"lane {s['lane']}")
    if s.get("uptime") is not None:
        bits.append(f"up {format_duration(s['uptime'])}")
    if bits:
        head += " (" + ", ".join(bits) + ")"
    if s.get("detail"):
        head += f": {s['detail']}"
    out = [head]
    if s.get("command"):
        out.append("  command: " + " ".join(s["command"])[:200])
    if s.get("lanes"):
        out.append("  lanes: " + ", ".join(("*" if ln == s.get("lane") else "") + ln for ln in s["lanes"]))
    r = {k: v for k, v in (s.get("restarts") or {}).items() if v}
    out.append(f"  starts {s.get('starts', 0)}, restarts: " + (", ".join(f"{k} {v}" for k, v in r.items()) or "none")
               + f" (policy {s.get('restart_policy')})")
    if s.get("time_to_ready") is not None or s.get("quiesce_wait") is not None:
        out.append(f"  last start: quiesce wait {format_duration(s.get('quiesce_wait'))}"
                   + (" (timed out)" if s.get("quiesce_timed_out") else "")
                   + f", time to ready {format_duration(s.get('time_to_ready'))}")
    if s.get("state") == "backoff":
        out.append(f"  crash loop backoff: {s.get('consecutive_failures')} in a row, next start in "
                   f"{format_duration(s.get('backoff'))}")
    le = s.get("last_exit")
    if le:
        ago = time.time() - le["at"] if le.get("at") else None
        out.append(f"  last exit: {le.get('detail')}" + (f", {format_duration(ago)} ago" if ago is not None else ""))
    for p in s.get("peers") or []:
        out.append(f"  peer {p['url']}: " + ("ok" if p["ok"] else p.get("error") or "below the gate")
                   + (f", {p['available_bytes'] / 1024**3:.2f} GiB available" if p.get("available_bytes") is not None
                      else ""))
    return out

"""The state of one spawned engine process (one "run"), shared by the supervisor's threads."""

from __future__ import annotations

import signal
import threading
import time

from sparkguard.supervisor.cluster import HeadWatch, Role
from sparkguard.supervisor.output import LastLines
from sparkguard.supervisor.restart import classify_exit, describe_exit


class Run:
    """One spawned engine: owned by the supervisor thread; its fields are read by the others.

    Args:
        proc: the ``subprocess.Popen`` of the engine's root (own session: pid == pgid == sid).
        lane: str | None, the lane it was started in.
        argv: list[str], what was executed (after the oom_score_adj wrapper).
        reason: str | None, why this start happened (a restart reason; None: first start).
        role: :class:`cluster.Role` of the command (single, head, headless).
        wall_spawn: unix seconds of the spawn when the caller took them before it (the run's
            cgroup is named after its run id before the engine starts); default now.
    Times ``t_*`` are ``time.monotonic()`` seconds, ``wall_spawn`` is unix seconds; ``run_id``
    is ``wall_spawn`` to the millisecond: the name other nodes know this run by
    (``sparkguard_engine_run_start_timestamp_seconds``).
    """

    def __init__(self, proc, lane: str | None, argv: list[str], reason: str | None, log_lines: int = 200,
                 role: Role = Role(), wall_spawn: float | None = None):
        self.proc = proc
        self.pid: int = proc.pid
        self.pgid: int = proc.pid            # start_new_session: pid == pgid == sid
        self.lane = lane
        self.argv = argv
        self.reason = reason                 # why this start happened (None: first start)
        self.t_spawn = time.monotonic()
        self.t_ready_clock = self.t_spawn    # monotonic s engine.ready_timeout counts from (adoption may reset it)
        self.wall_spawn = time.time() if wall_spawn is None else wall_spawn
        self.run_id = round(self.wall_spawn, 3)
        self.role = role
        self.group: dict[int, float] = {}   # head: node rank -> the run of each rank it started with
        self.head_watch = HeadWatch(role.node_rank, self.run_id) if role.role == "headless" else None
        self.joined: float | None = None    # headless: the head run it is in (the monitor's)
        self.cause: dict | None = None      # the other node that made the monitor end this run
        self.head_at_exit: str | None = None  # headless: "gone" or "there" (the supervisor's, at the exit)
        self.ready = False
        self.ever_ready = False
        self.exit: tuple[int | None, int | None] | None = None   # (code, signal)
        self.t_exit: float | None = None
        self.verdict: str | None = None     # monitor's: wedged | not_ready | head | peer
        self.verdict_detail = ""
        self.term_reason: str | None = None  # why the supervisor stopped it
        self.guard_hit = False              # the guard signalled it
        self.load_hit = False               # ... before it was ever ready: a failed load (restart.LOAD)
        self.done = threading.Event()       # the run is over: threads stop
        self.members: dict[int, int] = {}   # pid -> starttime, every process seen in its tree
        self.cgroup = None                  # cgroup.EngineCgroup the run lives in (None: process-group tracking)
        self.starttime = 0
        self.probe_failures = 0
        self.head_seen = False
        self.head_fail_since: float | None = None
        self.threads: list[threading.Thread] = []
        self.incident = None                # model.Incident the supervisor opened about this run (its thread's)
        self.link_hit = False               # a TP link went down during this run
        self.lines = LastLines(log_lines)   # this run's last output lines (incident reports)
        self.exit_info: dict | None = None  # the exit as recorded once the run is over (sweep done)
        self.launch = None                  # container.Launch of a docker|podman run engine (else None)
        self.container = None               # its container.Container once known (the sg-engine-ctr thread's)
        # adoption (sparkguard.supervisor.adopt): what a later daemon needs to take this run over
        self.digest = ""                    # adopt.command_digest of the configured command
        self.fifos: dict[str, str] = {}     # stream -> FIFO path the engine writes (output.make_fifos)
        self.fifo_ids: dict[str, list[int]] = {}   # stream -> [st_dev, st_ino] of that FIFO
        self.streams: dict = {}             # stream -> this daemon's read end (output.Fd)
        self.adopted = False                # taken over from a previous daemon: not our child
        self.pidfd: int | None = None       # adopted: the pidfd its exit is watched on
        self.deadline = None                # stopbudget.Deadline of its stop, from its first SIGTERM

    def exit_record(self, exit: tuple[int | None, int | None] | None = None,
                    t_exit: float | None = None) -> dict | None:
        """This run's exit as a dict (None while it runs): ``code`` (int|None), ``signal``
        (name|None), ``at`` (unix s), ``uptime`` (s), ``pid``, ``lane``, ``reason`` (the restart
        reason it leads to, :func:`restart.classify_exit`; None: stopped on purpose) and
        ``detail`` (one line, e.g. ``"exit code 0 after 9.9 s, after the guard's SIGTERM"``).

        Available as soon as the exit is seen (before the supervisor has swept the tree), so an
        incident closed meanwhile describes this run, not the previous one; once the supervisor
        recorded the exit (:attr:`exit_info`, with what the sweep found) that is returned.

        Args:
            exit: ``(code, signal)`` seen by someone else than the exit watcher (default
                :attr:`exit`); t_exit: its monotonic time (default :attr:`t_exit`, else now).
        """
        if exit is None:
            if self.exit_info is not None:
                return self.exit_info
            exit, t_exit = self.exit, self.t_exit
        if exit is None:
            return None
        code, sig = exit
        uptime = (t_exit or time.monotonic()) - self.t_spawn
        reason, _ = classify_exit(code, self.term_reason, self.guard_hit, self.headless_at_exit(), self.load_hit)
        return {"code": code, "signal": _signame(sig), "at": self.wall_spawn + uptime, "uptime": uptime,
                "reason": reason or self.term_reason, "pid": self.pid, "lane": self.lane,
                "detail": describe_exit(code, _signame(sig), uptime, self.term_reason, self.guard_hit, self.load_hit)}

    def headless_at_exit(self) -> str | None:
        """For :func:`restart.classify_exit`: None unless a headless rank; what the supervisor
        found of its head at the exit (:attr:`head_at_exit`), or, before that, ``"gone"``
        unless this run is in a head's group (:attr:`joined`)."""
        if self.role.role != "headless":
            return None
        return self.head_at_exit or ("gone" if self.joined is None else "there")

    def start_thread(self, name: str, target, *args) -> threading.Thread:
        """Start a daemon thread ``target(self, *args)`` that belongs to this run (joined after it)."""
        t = threading.Thread(target=target, args=(self, *args), name=name, daemon=True)
        self.threads.append(t)
        t.start()
        return t


def _signame(sig: int | None) -> str | None:
    """``9`` -> ``"SIGKILL"``; None or 0 -> None."""
    if not sig:
        return None
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"

"""The state of one spawned engine process (one "run"), shared by the supervisor's threads."""

from __future__ import annotations

import threading
import time


class Run:
    """One spawned engine: owned by the supervisor thread; its fields are read by the others.

    Args:
        proc: the ``subprocess.Popen`` of the engine's root (own session: pid == pgid == sid).
        lane: str | None, the lane it was started in.
        argv: list[str], what was executed (after the oom_score_adj wrapper).
        reason: str | None, why this start happened (a restart reason; None: first start).
    Times ``t_*`` are ``time.monotonic()`` seconds, ``wall_spawn`` is unix seconds.
    """

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

    def start_thread(self, name: str, target, *args) -> threading.Thread:
        """Start a daemon thread ``target(self, *args)`` that belongs to this run (joined after it)."""
        t = threading.Thread(target=target, args=(self, *args), name=name, daemon=True)
        self.threads.append(t)
        t.start()
        return t

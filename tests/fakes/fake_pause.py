"""The fake vLLM's pause endpoints: ``POST /pause``, ``POST /resume``, ``GET /is_paused``, as vLLM has them.

What vLLM does (read from its source, 2026; the notes with file:function references are in
docs/soft-line.md, "What vLLM does"):

* Mounted only with ``VLLM_SERVER_DEV_MODE=1`` (``vllm/envs.py``: ``bool(int(os.getenv(...,
  "0")))``; ``vllm/entrypoints/serve/rlhf/api_router.py:attach_router`` returns without
  including the router otherwise, and later versions mount it from
  ``vllm/entrypoints/serve/__init__.py:register_vllm_dev_api_routers``, called only in dev
  mode).  Without it each path answers FastAPI's ``404 {"detail": "Not Found"}``.
* ``POST /pause`` query parameters (``rlhf/api_router.py:pause_generation``): ``mode`` =
  ``abort`` (default) | ``wait`` | ``keep``; ``wait_for_inflight_requests`` (deprecated, true
  means ``mode=wait``, ``AsyncLLM.pause_generation``); ``clear_cache`` (default true: prefix
  and multimodal caches are reset; no memory is given back to the system).  Another ``mode``
  is a FastAPI validation error, 422.  Answer: ``200 {"status": "paused"}``.
* What it does (``vllm/v1/engine/core.py:EngineCore.pause_scheduler``): ``abort`` finishes every
  in-flight request as aborted (the client gets its answer at once, ``finish_reason
  "abort"``) and sets the scheduler to PAUSED_NEW; ``wait`` sets PAUSED_NEW and the
  ``/pause`` answer comes once the in-flight requests have finished; ``keep`` sets
  PAUSED_ALL: in-flight requests are frozen where they are and continue on ``/resume``.
  In every mode new requests are accepted (the HTTP request stays open) but not scheduled
  until ``/resume``; nothing is rejected.  ``/health`` keeps answering 200 (``check_health``
  only looks at a dead engine).
* ``POST /resume`` (``resume_generation``): ``200 {"status": "resumed"}``; the scheduler is
  UNPAUSED and what waited runs.  ``GET /is_paused``: ``200 {"is_paused": bool}``.

A request's time in the engine is ``--request-time`` seconds (default 0: one token at once), so
that there is something in flight to abort, freeze or wait for.
"""

from __future__ import annotations

import os
import threading
import time
from urllib.parse import parse_qs

DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"
UNPAUSED, PAUSED_NEW, PAUSED_ALL = "unpaused", "paused_new", "paused_all"
MODES = ("abort", "wait", "keep")
_TRUE = {"1", "true", "on", "yes", "t", "y"}    # pydantic's bool parsing of a query value
_FALSE = {"0", "false", "off", "no", "f", "n"}


def dev_mode(env=os.environ) -> bool:
    """``VLLM_SERVER_DEV_MODE`` as vllm/envs.py reads it: ``bool(int(value or "0"))``.
    Raises ValueError for a value that is not an integer (vLLM fails at start-up the same way)."""
    return bool(int(env.get(DEV_MODE_ENV, "0") or "0"))


def _bool(values: list[str] | None, default: bool) -> bool:
    if not values:
        return default
    v = values[-1].strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise ValueError(v)


def _validation_error(name: str, value: str, expected: str) -> dict:
    """FastAPI's 422 body for a bad query parameter."""
    return {"detail": [{"type": "enum" if name == "mode" else "bool_parsing", "loc": ["query", name],
                        "msg": f"Input should be {expected}", "input": value}]}


class Pause:
    """The scheduler's pause state and the requests it holds (shared by the HTTP threads).

    Args:
        mounted: bool, the endpoints exist (dev mode).
        request_time: float seconds a request takes once scheduled.
    """

    def __init__(self, mounted: bool, request_time: float = 0.0):
        self.mounted = mounted
        self.request_time = request_time
        self.state = UNPAUSED
        self.cond = threading.Condition()
        self.abort_gen = 0      # bumped by an abort pause: every running request ends as aborted
        self.running = 0        # requests scheduled and not finished
        self.waiting = 0        # requests accepted while paused, not yet scheduled
        self.pauses = self.resumes = 0

    # ---- HTTP ---------------------------------------------------------------------------

    def post(self, path: str, query: str) -> tuple[int, dict] | None:
        """``(status, JSON body)`` for ``POST path?query``, or None when the path is not ours."""
        if path not in ("/pause", "/resume"):
            return None
        if not self.mounted:
            return 404, {"detail": "Not Found"}
        q = parse_qs(query, keep_blank_values=True)
        if path == "/resume":
            with self.cond:
                self.state = UNPAUSED
                self.resumes += 1
                self.cond.notify_all()
            return 200, {"status": "resumed"}
        mode = (q.get("mode") or ["abort"])[-1]
        if mode not in MODES:
            return 422, _validation_error("mode", mode, "'abort', 'wait' or 'keep'")
        for name, default in (("wait_for_inflight_requests", False), ("clear_cache", True)):
            try:
                value = _bool(q.get(name), default)
            except ValueError as e:
                return 422, _validation_error(name, str(e), "a valid boolean")
            if name == "wait_for_inflight_requests" and value:
                mode = "wait"
        with self.cond:
            self.pauses += 1
            if mode == "abort":
                self.abort_gen += 1
            self.state = PAUSED_ALL if mode == "keep" else PAUSED_NEW
            self.cond.notify_all()
            if mode == "wait":
                while self.running:
                    self.cond.wait()
        return 200, {"status": "paused"}

    def get(self, path: str) -> tuple[int, dict] | None:
        """``(status, JSON body)`` for ``GET /is_paused``, or None when the path is not ours."""
        if path != "/is_paused":
            return None
        if not self.mounted:
            return 404, {"detail": "Not Found"}
        with self.cond:
            return 200, {"is_paused": self.state != UNPAUSED}

    # ---- requests -----------------------------------------------------------------------

    def run(self) -> str:
        """One request through the scheduler: wait while paused (accepted, not scheduled), then
        run ``request_time`` seconds (frozen while PAUSED_ALL); returns its finish reason,
        ``"length"`` (its one token) or ``"abort"`` (an abort pause came while it ran)."""
        with self.cond:
            if self.state != UNPAUSED:
                self.waiting += 1
                try:
                    while self.state != UNPAUSED:
                        self.cond.wait()
                finally:
                    self.waiting -= 1
            gen = self.abort_gen
            self.running += 1
            try:
                left = self.request_time
                while True:
                    if self.abort_gen != gen:
                        return "abort"
                    if self.state == PAUSED_ALL:
                        self.cond.wait()
                        continue
                    if left <= 0:
                        return "length"
                    t0 = time.monotonic()
                    self.cond.wait(left)      # a pause or resume wakes it: the time run so far counts
                    left -= time.monotonic() - t0
            finally:
                self.running -= 1
                self.cond.notify_all()

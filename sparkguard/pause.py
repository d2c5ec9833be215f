"""The engine's pause endpoints over HTTP, off the poll loop: one worker thread, a short deadline per request.

The poll loop never waits on HTTP: :meth:`PauseClient.submit` queues a request (``probe``,
``pause``, ``resume``) and returns at once; the worker thread sends it with
:func:`sparkguard.httpget.request` (one deadline for the whole exchange, a cap on the answer's
size), stores the :class:`Answer` and calls ``wake`` so the loop reads it with
:meth:`PauseClient.answers` on its next pass.  The thread starts on the first request and then
sleeps on a condition with no timeout while nothing is queued: a guard whose soft line never
fires pays nothing.

The endpoints (vLLM, docs/soft-line.md "What vLLM does"): ``POST <base>/pause?mode=<mode>``,
``POST <base>/resume`` and ``GET <base>/is_paused``, mounted only when the engine runs with
``VLLM_SERVER_DEV_MODE=1`` (else 404).  A pause or resume succeeded when the answer is 2xx; the
probe says the engine offers pause when ``GET /is_paused`` answers 200 with a JSON object holding
a boolean ``is_paused``.  Every answer is untrusted: only its status and that one field are read.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable
from urllib.parse import urlsplit, urlunsplit

from sparkguard import httpget

log = logging.getLogger("sparkguard.pause")

MAX_BODY = 4096         # bytes of answer read: vLLM's answers are a few dozen bytes
OPS = ("probe", "pause", "resume")


@dataclass(frozen=True)
class Answer:
    """One finished request: ``op`` (``probe``/``pause``/``resume``); ``ok`` bool (probe: the engine
    offers pause); ``status`` int HTTP status or None (no answer); ``detail`` str for people;
    ``sent``/``done`` float monotonic seconds."""

    op: str
    ok: bool
    status: int | None
    detail: str
    sent: float
    done: float


def base_url(url: str | None) -> str | None:
    """``scheme://host:port`` of ``url`` (the engine's health URL or a configured base), None for None."""
    if not url:
        return None
    u = urlsplit(url)
    return urlunsplit((u.scheme, u.netloc, "", "", ""))


class PauseClient:
    """Sends the engine's pause, resume and probe requests from a worker thread.

    Args:
        base: ``http://host:port`` of the engine's API server.
        mode: vLLM's pause ``mode`` query value (``keep`` or ``abort``; docs/soft-line.md).
        timeout: float seconds for one whole request (connect, send, answer).
        wake: called from the worker thread after each answer (the loop's wake-up); must not block.
        request: the HTTP function, :func:`sparkguard.httpget.request` (tests pass their own).
    Attributes:
        offered: bool or None: what the last probe found (None before any).
        offered_detail: str, why (for ``status`` and the log).
    """

    def __init__(self, base: str, mode: str = "keep", timeout: float = 2.0, wake: Callable[[], None] = lambda: None,
                 request: Callable = httpget.request):
        self.base = base.rstrip("/")
        self.mode = mode
        self.timeout = timeout
        self.wake = wake
        self._request = request
        self._cond = threading.Condition()
        self._queue: list[tuple[str, float]] = []
        self._done: list[Answer] = []
        self._thread: threading.Thread | None = None
        self._stopped = False
        self.offered: bool | None = None
        self.offered_detail = "not probed yet"

    def submit(self, op: str, now: float | None = None) -> None:
        """Queue ``op`` (``probe``, ``pause``, ``resume``); never blocks.  A request of the same op
        already queued and not yet sent is not queued twice."""
        if op not in OPS:
            raise ValueError(op)
        with self._cond:
            if self._stopped:
                return
            if any(q == op for q, _ in self._queue):
                return
            self._queue.append((op, time.monotonic() if now is None else now))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="sparkguard-pause", daemon=True)
                self._thread.start()
            self._cond.notify()

    def answers(self) -> list[Answer]:
        """The answers that came since the last call, oldest first (non-blocking)."""
        with self._cond:
            if not self._done:
                return []
            out, self._done = self._done, []
            return out

    def call(self, op: str) -> Answer:
        """Send ``op`` now in the caller's thread (shutdown: the last resume), at most ``timeout`` s."""
        return self._send(op, time.monotonic())

    def stop(self) -> None:
        """Drop what is queued and end the worker thread after its request in flight."""
        with self._cond:
            self._stopped = True
            self._queue.clear()
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stopped:
                    self._cond.wait()
                if self._stopped:
                    return
                op, queued = self._queue.pop(0)
            try:
                ans = self._send(op, queued)
            except Exception as e:  # noqa: BLE001 - the worker must outlive any answer
                ans = Answer(op, False, None, f"{type(e).__name__}: {e}", queued, time.monotonic())
            with self._cond:
                self._done.append(ans)
                del self._done[:-16]            # bounded: the loop reads them every pass
            try:
                self.wake()
            except Exception:  # noqa: BLE001
                log.exception("waking the loop after a pause answer failed")

    def _send(self, op: str, queued: float) -> Answer:
        if op == "probe":
            url, body = self.base + "/is_paused", None
        elif op == "pause":
            url, body = f"{self.base}/pause?mode={self.mode}", b""
        else:
            url, body = self.base + "/resume", b""
        sent = time.monotonic()
        try:
            status, data = self._request(url, self.timeout, MAX_BODY, body=body)
        except OSError as e:
            ans = Answer(op, False, None, f"{'GET' if body is None else 'POST'} {url}: {e or type(e).__name__}",
                         sent, time.monotonic())
        else:
            ans = self._judge(op, url, status, data, sent)
        if op == "probe":
            self.offered, self.offered_detail = ans.ok, ans.detail
        return ans

    def _judge(self, op: str, url: str, status: int, data: bytes, sent: float) -> Answer:
        done = time.monotonic()
        verb = "GET" if op == "probe" else "POST"
        if op == "probe":
            try:
                obj = json.loads(data)
                ok = status == 200 and isinstance(obj, dict) and isinstance(obj.get("is_paused"), bool)
            except ValueError:
                ok = False
            if ok:
                return Answer(op, True, status, f"{verb} {url}: 200, the engine offers pause", sent, done)
            hint = " (vLLM mounts it only with VLLM_SERVER_DEV_MODE=1)" if status == 404 else ""
            return Answer(op, False, status, f"{verb} {url}: {status}{hint}: no pause endpoint", sent, done)
        if 200 <= status < 300:
            return Answer(op, True, status, f"{verb} {url}: {status}", sent, done)
        hint = " (vLLM mounts it only with VLLM_SERVER_DEV_MODE=1)" if status == 404 else ""
        return Answer(op, False, status, f"{verb} {url}: {status}{hint}: {_short(data)}", sent, done)


def _short(data: bytes, n: int = 160) -> str:
    """The first ``n`` printable characters of an untrusted answer body."""
    text = data[: n * 4].decode("utf-8", "replace")
    text = "".join(c if c.isprintable() else " " for c in text)
    return text[:n]

"""Is the engine ready, alive, and (for a headless rank) is its head still there?

* **ready** when ``engine.health_url`` answers 200 within ``engine.ready_timeout`` (vLLM's port
  listens only once the model is loaded, 1 to 15 minutes on a Spark; FIELD-NOTES).
* **liveness probe** (``engine.probe``): a real one-token completion on the OpenAI-compatible
  endpoint every ``probe.interval``; ``probe.failures`` failures in a row = wedged, because
  vLLM's ``/health`` answers 200 while the engine is wedged (it does not probe the workers).
* **head watch** (``engine.head_url``, headless ranks): once the head had answered 200, a head
  failing for ``head_lost_after`` seconds means stop and restart this rank, because vLLM's
  headless ranks do not exit by themselves.
* **cluster watch** (a head or headless rank with ``engine.peers``, :mod:`.cluster`): every
  ``health_interval`` the other nodes' sparkguards are read; a broken group is a verdict
  (``peer`` on the head, ``head`` on a headless rank), and a headless rank is ready only while
  it is in the head's group and the head is ready (its own readiness, not a health URL).

:func:`monitor` runs in one thread per run and reports through :class:`MonitorHooks`.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Callable, Protocol
from urllib.parse import urlsplit

from sparkguard import httpget

log = logging.getLogger("sparkguard.supervisor")

MEMBERS_EVERY = 30.0     # seconds between tree-membership refreshes once ready


#: bytes of an answer read at most: vLLM's /health is empty, a one-token completion and
#: /v1/models a few KiB; parsing more would cost the process CPU the guard's loop shares
MAX_ANSWER = 256 * 1024


def http(url: str, timeout: float, body: dict | None = None) -> tuple[int, bytes]:
    """(status, body) of a GET (or a JSON POST when ``body``) within ``timeout`` seconds for the
    whole request and :data:`MAX_ANSWER` bytes of answer (:func:`sparkguard.httpget.request`).
    Raises OSError when nobody answers, too slowly, too much, or not in HTTP.  Environment
    proxies are ignored: health checks are local or on the TP fabric."""
    data = None if body is None else json.dumps(body).encode()
    return httpget.request(url, timeout, MAX_ANSWER, data, {"Content-Type": "application/json"} if data else None)


def base_url(url: str) -> str:
    """``scheme://host:port`` of a URL."""
    u = urlsplit(url)
    return f"{u.scheme}://{u.netloc}"


def healthy(url: str, interval: float) -> bool:
    """True when ``url`` answers 200 (timeout: ``interval`` clamped to 0.5-5 s)."""
    try:
        status, _ = http(url, timeout=min(5.0, max(0.5, interval)))
        return status == 200
    except OSError:
        return False


def probe(ecfg, model: str | None) -> tuple[bool, str, str | None]:
    """One real one-token completion (``engine.probe``).

    Args:
        ecfg: ``config.EngineConfig`` with ``probe`` set.
        model: the model name found by an earlier probe (None: ``probe.model``, else the first id
            of ``GET /v1/models``).
    Returns:
        (ok, why it failed or "", the model name to reuse).
    """
    p = ecfg.probe
    base = base_url(p.url or ecfg.health_url)
    url = p.url or base + "/v1/completions"
    model = p.model or model
    if model is None:
        try:
            status, body = http(base + "/v1/models", timeout=p.timeout)
            if status == 200:
                data = json.loads(body or b"{}").get("data") or []
                model = data[0].get("id") if data else None
        except (OSError, ValueError, AttributeError):
            pass
        if model is None:
            return False, f"no model from {base}/v1/models", None
    t0 = time.monotonic()
    try:
        status, body = http(url, timeout=p.timeout, body={"model": model, "prompt": "ping", "max_tokens": 1,
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


class MonitorHooks(Protocol):
    """What :func:`monitor` reports to (the supervisor); called from the monitor thread."""

    def refresh_members(self, run) -> None:
        """Record the run's current tree (for the sweep)."""

    def became_ready(self, run) -> None:
        """The health URL answered 200 for the first time (or there is none)."""

    def health_changed(self, run, ok: bool, url: str) -> None:
        """After ready: the health URL started (``ok``) or stopped answering 200."""

    def probed(self, run, ok: bool) -> int:
        """A liveness probe result; returns the failures in a row so far."""

    def verdict(self, run, kind: str, detail: str) -> None:
        """Stop and restart the run: ``wedged``, ``head``, ``peer`` or ``not_ready``."""

    def cluster(self, run) -> bool:
        """Read the other nodes once and act on it (:mod:`.cluster`); True when a verdict was given."""

    def note(self, event: str, detail: str) -> None:
        """A history entry."""

    #: the guard's soft line has the engine paused: the liveness probe waits (docs/soft-line.md)
    engine_paused: bool


def monitor(run, config: Callable[[], object], hooks: MonitorHooks) -> None:
    """Health -> ready, then liveness probe, head watch, membership refresh, until the run ends
    (``run.done``, its exit, or the supervisor stopping it) or a verdict is given.

    Args:
        run: the ``Run``.
        config: returns the current ``config.EngineConfig`` (a reload takes effect at once).
        hooks: :class:`MonitorHooks`.
    """
    next_members = 0.0
    next_probe = None
    model = None
    while not run.done.is_set() and run.exit is None and run.term_reason is None:
        now = time.monotonic()
        e = config()
        clustered = run.role.clustered and bool(e.peers)
        if now >= next_members:
            hooks.refresh_members(run)
            next_members = now + (e.health_interval if not run.ever_ready else MEMBERS_EVERY)
        if clustered and run.role.role == "headless":
            pass                                # ready = in the head's group: hooks.cluster decides
        elif not run.ever_ready:
            ok = True
            if e.health_url:
                ok = healthy(e.health_url, e.health_interval)
            if ok:
                hooks.became_ready(run)
                hooks.refresh_members(run)      # the whole tree exists once it serves
                if e.probe is not None:
                    next_probe = time.monotonic() + e.probe.interval
            elif now - run.t_ready_clock >= e.ready_timeout:
                hooks.verdict(run, "not_ready", f"no 200 from {e.health_url} within {e.ready_timeout:g} s")
                return
        else:
            if e.health_url:
                ok = healthy(e.health_url, e.health_interval)
                if ok != run.ready and run.exit is None:
                    hooks.health_changed(run, ok, e.health_url)
            if next_probe is not None and e.probe is not None and hooks.engine_paused:
                # paused by the soft line (docs/soft-line.md): vLLM holds the probe's request, which proves nothing
                next_probe = max(next_probe, time.monotonic() + e.probe.interval)
            if next_probe is not None and time.monotonic() >= next_probe and e.probe is not None:
                ok, why, model = probe(e, model)
                next_probe = time.monotonic() + e.probe.interval
                fails = hooks.probed(run, ok)
                if not ok:
                    log.warning("engine: liveness probe failed (%d/%d): %s", fails, e.probe.failures, why)
                    if fails >= e.probe.failures:
                        hooks.verdict(run, "wedged", f"{fails} liveness probes failed in a row (last: {why}); "
                                                     f"/health still {'200' if run.ready else 'failing'}")
                        return
        if clustered and hooks.cluster(run):
            return
        if e.head_url and head_lost(run, e, hooks):
            return
        waits = [e.health_interval]
        if next_probe is not None:
            waits.append(max(0.0, next_probe - time.monotonic()))
        run.done.wait(min(waits))


def head_lost(run, ecfg, hooks: MonitorHooks) -> bool:
    """Headless rank: check the head once; True (verdict ``head`` given) when it has been failing
    for ``engine.head_lost_after`` seconds after it had answered 200 during this run."""
    ok = healthy(ecfg.head_url, ecfg.health_interval)
    now = time.monotonic()
    if ok:
        if not run.head_seen:
            hooks.note("head", f"head {ecfg.head_url} answers")
        run.head_seen, run.head_fail_since = True, None
        return False
    if not run.head_seen:
        return False
    if run.head_fail_since is None:
        run.head_fail_since = now
        hooks.note("head", f"head {ecfg.head_url} stopped answering 200")
    if now - run.head_fail_since >= ecfg.head_lost_after:
        hooks.verdict(run, "head", f"head {ecfg.head_url} failing for {now - run.head_fail_since:.1f} s "
                                   f"(engine.head_lost_after {ecfg.head_lost_after:g} s)")
        return True
    return False

"""The poll loop's soft line: feed :mod:`sparkguard.softline`, send its requests, record the pause incident.

:class:`SoftGuard` is called by :class:`sparkguard.guard.loop.Guard` on each full pass
(:meth:`SoftGuard.step`, after the hard policy has acted: a pause never delays a SIGTERM).  It
hands the answers of the engine (:class:`sparkguard.pause.PauseClient`, a worker thread that wakes
the loop when one comes) and the memory signal to the pure :class:`sparkguard.softline.SoftLine`,
sends what it decides (never waiting: requests are queued) and records one incident of kind
``pause`` per episode: opened when the signal falls below ``guard.pause_below``, closed when
the engine resumed (``resumed``), when the pause failed (``pause_failed``: no endpoint, an
error, no answer; the guard goes on as without the soft line), when the hard line was crossed
meanwhile (``escalated``: the memory incident of :mod:`sparkguard.recorder` takes over), when
resuming failed ``softline.SoftLines.resume_tries`` times (``resume_failed``), when the supervisor
restarted the engine meanwhile (``engine_restarted``: a new run is not paused) or when the daemon
stopped (``daemon_stopped``).

Where the engine is: ``guard.pause_url`` when set (a guard-only host); else, with ``engine.pause:
auto``, the supervised engine's ``engine.health_url`` (scheme, host and port).  It is probed
(``GET /is_paused``) at start for a configured URL and each time the supervised engine becomes
ready; an engine that does not offer pause is never sent one, nor is a supervised engine that is
not ready (loading: its memory falls by design; or gone).  Off in a dry run: a pause is an
action, and a dry run takes none.  Everything here runs on the poll-loop thread but
:meth:`SoftGuard.snapshot` (any thread, plain reads).
"""

from __future__ import annotations

import logging
import time

from sparkguard import pause, softline, sysinfo
from sparkguard.model import Event, PauseThresholds, new_incident
from sparkguard.units import format_size

log = logging.getLogger("sparkguard")


def lines_of(g) -> softline.SoftLines:
    """:class:`sparkguard.softline.SoftLines` from ``config.GuardConfig`` ``g`` (bytes, seconds)."""
    return softline.SoftLines(pause_below=g.pause_below, hysteresis=g.pause_hysteresis,
                              resume_after=g.resume_after, answer_timeout=g.pause_timeout + 1.0)


def url_of(cfg) -> str | None:
    """The engine's base URL for the soft line, or None when it has none (module docstring)."""
    if cfg.guard.pause_url:
        return pause.base_url(cfg.guard.pause_url)
    if cfg.engine.enabled and cfg.engine.pause == "auto":
        return pause.base_url(cfg.engine.health_url)
    return None


class SoftGuard:
    """The soft line of one guard.

    Args:
        cfg: ``config.Config`` in force.
        engine: :class:`sparkguard.guard.engine.Engine` (its supervisor's ``ready_count`` triggers probes).
        recorder: the loop's ``recorder.Recorder``: its ``reporter`` (replaced by the drill), its
            ``reader`` (meminfo at the crossing), ``count`` and host/boot id.
        wake: ``() -> None`` waking the loop (from the worker thread).
    Attributes:
        active: bool, the soft line is on (a line, an engine URL, not a dry run).
        machine: the :class:`sparkguard.softline.SoftLine`.
        client: the :class:`sparkguard.pause.PauseClient`, or None without a URL.
        counts: ``{"pause": {"ok": n, "failed": n}, "resume": {...}}`` since the start.
    """

    def __init__(self, cfg, engine, recorder, wake):
        self.engine, self.recorder, self.wake = engine, recorder, wake
        self.machine = softline.SoftLine(lines_of(cfg.guard))
        self.counts = {"pause": {"ok": 0, "failed": 0}, "resume": {"ok": 0, "failed": 0}}
        self.client: pause.PauseClient | None = None
        self.cfg = cfg
        self.active = False
        self.incident = None
        self._t0 = 0.0
        self._min = 0
        self._ready_seen = 0
        self.reload(cfg)

    def reload(self, cfg) -> None:
        """Put ``cfg``'s soft line in force (start-up and reloads); a new URL gets a new client."""
        self.cfg = cfg
        g = cfg.guard
        self.machine.lines = lines_of(g)
        url = url_of(cfg)
        if self.client is None or url != self.client.base or g.pause_mode != self.client.mode \
                or g.pause_timeout != self.client.timeout:
            if self.client is not None:
                self.client.stop()
            self.client = pause.PauseClient(url, g.pause_mode, g.pause_timeout, self.wake) if url else None
            if self.client is not None and not cfg.engine.enabled:
                self.client.submit("probe")     # a configured engine: probe now; a supervised one when ready
            self._ready_seen = 0
        was = self.active
        self.active = self.client is not None and (g.pause_below is not None or self.machine.engine_paused) \
            and not g.dry_run
        if g.pause_below is not None and not self.active and not was:
            why = "dry run" if g.dry_run else "no engine URL (guard.pause_url, or engine.health_url with engine.pause: auto)"
            log.warning("guard.pause_below is set but the soft line is off: %s", why)

    # ---- the loop's calls -------------------------------------------------------------------

    def step(self, now: float, value: int, hard_idle: bool) -> float | None:
        """One full pass: answers, probes, the machine's decision, what it asks.  ``now``: monotonic
        s; ``value``: the signal, bytes; ``hard_idle``: the hard policy is in its OK state.
        Returns seconds until the soft line needs a pass again, or None."""
        client = self.client
        for ans in client.answers():
            if ans.op == "probe":
                log.log(logging.INFO if ans.ok else logging.WARNING, "soft line: %s", ans.detail)
                continue
            self.counts[ans.op]["ok" if ans.ok else "failed"] += 1
            self._do(self.machine.answered(now, ans.op, ans.ok), now, value, ans)
        sup = self.engine.supervisor
        if sup is not None and sup.ready_count != self._ready_seen:
            if self._ready_seen:                # a new run, not the first: it is not paused
                self._do(self.machine.restarted(), now, value, None)
            self._ready_seen = sup.ready_count
            client.submit("probe")
        offered = client.offered
        if sup is not None and not getattr(sup.run, "ready", False):
            offered = False         # a supervised engine loading (memory falls by design) or gone: never paused
        self._do(self.machine.step(now, value, hard_idle, offered), now, value, None)
        if sup is not None:
            sup.engine_paused = self.machine.engine_paused      # its liveness probe waits while paused
        if self.incident is not None and value < self._min:
            self._min = value
        return self.machine.deadline(now)

    def engaged(self) -> bool:
        """True while the soft line needs full passes (not idle)."""
        return self.active and self.machine.engaged()

    def stop(self, now: float, value: int) -> None:
        """The daemon stops: a paused engine is resumed (in this thread, at most ``guard.pause_timeout``
        s), the open incident closed."""
        if self.client is None:
            return
        self.client.stop()
        if self.machine.engine_paused:
            ans = self.client.call("resume")
            self.counts["resume"]["ok" if ans.ok else "failed"] += 1
            self._event(now, value, "resumed" if ans.ok else "resume_failed",
                        f"the guard stops: {ans.detail}")
            if ans.ok:
                self.machine.engine_paused = False
        self._close(now, value, "daemon_stopped")

    def snapshot(self) -> dict:
        """``{"state", "engine_paused", "offered", "url", "pause_below_bytes", "counts"}`` (any thread)."""
        c = self.client
        return {"state": self.machine.state if self.active else "off", "engine_paused": self.machine.engine_paused,
                "offered": c.offered if c is not None else None, "url": c.base if c is not None else None,
                "pause_below_bytes": self.cfg.guard.pause_below if self.active else None,
                "counts": {k: dict(v) for k, v in self.counts.items()}}

    def status(self) -> str:
        """The STATUS= part: ``""`` when off, else the soft line and its state."""
        if not self.active:
            return ""
        st = self.machine.state
        text = f"soft line {format_size(self.cfg.guard.pause_below)}" if self.cfg.guard.pause_below else "soft line off"
        if st == softline.PAUSED or (st != softline.IDLE and self.machine.engine_paused):
            text += ": ENGINE PAUSED"
        elif st != softline.IDLE:
            text += f": {st}"
        if self.client.offered is False:
            text += " (engine offers no pause)"
        return text

    # ---- actions and the incident -------------------------------------------------------------

    def _do(self, acts: tuple[str, ...], now: float, value: int, ans) -> None:
        g = self.cfg.guard
        detail = ans.detail if ans is not None else ""
        if ans is not None:
            now = ans.done              # the answer's own time, not the pass that read it
        for a in acts:
            if a == softline.PAUSE:
                self._open(now, value)
                self.client.submit("pause", now)
            elif a == softline.PAUSED_OK:
                self._event(now, value, "paused", f"engine paused ({detail}, {ans.done - ans.sent:.3f}s)")
                self._fill()
            elif a == softline.PAUSE_FAILED:
                self._event(now, value, "pause_failed", (detail or f"no answer within {g.pause_timeout:g}s")
                            + "; the guard goes on as without the soft line (SIGTERM at the hard line)")
                self._close(now, value, "pause_failed")
            elif a == softline.RESUME:
                why = ("the soft line was turned off" if g.pause_below is None else
                       f"memory {format_size(value)} above {format_size(self.machine.lines.resume_above)} "
                       f"for {g.resume_after:g}s")
                self._event(now, value, "resume_sent", why + ": POST /resume")
                self.client.submit("resume", now)
            elif a == softline.RESUMED:
                self._event(now, value, "resumed", f"engine resumed ({detail})")
                self._close(now, value, "resumed")
            elif a in (softline.RESUME_FAILED, softline.RESUME_GAVE_UP):
                last = a == softline.RESUME_GAVE_UP
                self._event(now, value, "resume_failed", (detail or f"no answer within {g.pause_timeout:g}s")
                            + ("; giving up: the engine may still be paused" if last
                               else f"; trying again in {g.resume_after:g}s"))
                if last:
                    self._close(now, value, "resume_failed")
            elif a == softline.RESTARTED:
                self._event(now, value, "pause_engine_restarted", "a new run of the engine is ready: it is not paused")
                self._close(now, value, "engine_restarted")
            elif a == softline.ESCALATED:
                self._event(now, value, "pause_escalated",
                            f"memory {format_size(value)} fell to the SIGTERM line {format_size(g.term_below)} "
                            "with the soft line engaged: the memory incident takes over")
                self._close(now, value, "escalated")

    def _open(self, now: float, value: int) -> None:
        g = self.cfg.guard
        rec = self.recorder
        wall = time.time()
        self.incident = new_incident("pause", wall, PauseThresholds.of(g), rec.reader.raw(), host=rec.host,
                                     boot_id=rec.boot_id)
        self.incident.pause = self._paused_what()
        self._t0, self._min = now, value
        rec.count("pause", wall, self.incident.id)
        self._event(now, value, "pause_crossed",
                    f"{format_size(value)} ({value} bytes) is {(g.pause_below - value) / 1024**2:.1f} MiB below the "
                    f"soft line {format_size(g.pause_below)}: POST {self.client.base}/pause?mode={g.pause_mode}")

    def _paused_what(self) -> dict:
        """The incident's ``pause`` part (docs/incident.md): the engine's ``url``; the supervised
        run's ``engine_pid`` and ``lane`` (None for a ``guard.pause_url`` engine).  Plain
        attribute reads: it runs on the loop thread at the crossing."""
        run = getattr(self.engine.supervisor, "run", None)
        return {"url": self.client.base, "engine_pid": getattr(run, "pid", None), "lane": getattr(run, "lane", None)}

    def _fill(self) -> None:
        """After the pause: the details that cost reads (act first, report after)."""
        if self.incident is not None:
            self._fill_of(self.incident)

    def _event(self, now: float, value: int, name: str, detail: str) -> None:
        inc = self.incident
        if inc is None:
            log.info("soft line: %s: %s", name, detail)
            return
        ev = Event(name, round(now - self._t0, 4), time.time(), value, [], detail)
        inc.timeline.append(ev)
        if value < self._min:
            self._min = value
        self.recorder.reporter.event(inc.ref(), ev.to_json())

    def _close(self, now: float, value: int, outcome: str) -> None:
        inc, self.incident = self.incident, None
        if inc is None:
            return
        if inc.psi_memory is None:
            self._fill_of(inc)
        inc.outcome = outcome
        inc.ended_at = time.time()
        inc.min_available_bytes = self._min
        inc.summary = _summary(inc)
        self.recorder.reporter.finish(inc.to_json())

    @staticmethod
    def _fill_of(inc) -> None:
        """``inc``'s parsed meminfo (read at the crossing), PSI and zram now."""
        inc.parse_meminfo()
        inc.psi_memory = sysinfo.read_psi_memory()
        inc.zram = sysinfo.read_zram()


def _summary(inc) -> str:
    """One line: paused when, memory, how it ended."""
    th = inc.thresholds
    tl = {e.event: e for e in inc.timeline}
    parts = [f"{'MemAvailable' if th.signal == 'available' else 'MemAvailable+SwapFree'} fell below the soft "
             f"line {format_size(th.pause_below_bytes)} (lowest {format_size(inc.min_available_bytes)})"]
    if "paused" in tl:
        t = tl["paused"].t
        parts.append(f"engine paused after {t * 1000:.0f} ms" if t < 1 else f"engine paused after {t:.2f}s")
    ends = {"resumed": lambda: f"resumed after {tl['resumed'].t:.1f}s" if "resumed" in tl else "resumed",
            "pause_failed": lambda: "pause failed: " + tl["pause_failed"].detail.split(";")[0] if "pause_failed" in tl
            else "pause failed",
            "escalated": lambda: f"hard line crossed after {tl['pause_escalated'].t:.2f}s: SIGTERM"
            if "pause_escalated" in tl else "escalated",
            "resume_failed": lambda: "resume failed: the engine may still be paused",
            "daemon_stopped": lambda: "the guard stopped",
            "engine_restarted": lambda: "the engine was restarted"}
    parts.append(ends.get(inc.outcome, lambda: str(inc.outcome))())
    return "; ".join(parts)

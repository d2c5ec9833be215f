"""The guard's poll loop: read /proc/meminfo, decide, act, record, sleep; and the state it keeps.

:meth:`Guard.loop` samples memory (:mod:`sparkguard.meminfo`), feeds the pure decision core
(:mod:`sparkguard.policy`), has :class:`sparkguard.guard.act.Actions` carry out its actions
(the victim chosen by :mod:`sparkguard.enginetree` or armed beforehand, signals through pidfds),
whose steps :mod:`sparkguard.recorder` turns into the incident, and sleeps in ``poll(2)`` on: a
self-pipe for signals (SIGHUP reload, SIGTERM/SIGINT stop), an optional PSI trigger on
/proc/pressure/memory (POLLPRI wakes the loop as soon as the kernel sees memory stalls), and the
victim's pidfds (POLLIN when a member exits).  Act first, report after.

Threads: the loop's thread owns everything here.  The metrics thread calls :meth:`Guard.snapshot`
(plain reads); the reload thread sets ``Reloader.loaded`` and wakes the loop; the link-watch thread
calls :meth:`Guard._on_link_incident`; a signal handler adds to ``_flags``.
"""

from __future__ import annotations

import gc
import logging
import math
import os
import select
import signal
import time

from sparkguard import freepages, meminfo, notify, pcp, policy, rate, recorder, reporter, sysinfo
from sparkguard.guard import harden, idle, reconfig, settings, startup, view
from sparkguard.guard import ring as ring_mod
from sparkguard.guard.act import Actions
from sparkguard.guard.engine import Engine
from sparkguard.guard.soft import SoftGuard
from sparkguard.units import format_line

log = logging.getLogger("sparkguard")

STATUS_EVERY = 10.0         # seconds between STATUS= refreshes when nothing changes (settings.FULL_PASS_EVERY)
BLIND_AFTER = 3.0           # seconds of failed /proc/meminfo reads in a row before WATCHDOG=1 stops (WatchdogSec=5s)
RELOAD_READ = -1            # pseudo-signal in Guard._flags: the reload thread has read the config
STATUS_CHANGED = -2         # pseudo-signal in Guard._flags: another thread changed what STATUS= says
PCP_EVERY = 1.0             # seconds between reads of the per-CPU free lists (Guard._pcp_free)
SOFT_ANSWER = -3            # pseudo-signal in Guard._flags: the engine answered a pause/resume/probe
STOP_REQUESTED = -4         # pseudo-signal in Guard._flags: another thread set ``stopping`` (request_stop)


class Guard:
    """The daemon: its state and the poll loop.

    Args:
        cfg: ``config.Config``.
        config_arg: the ``--config`` path given (re-read on SIGHUP), or None for the default.
        force_dry_run: ``--dry-run`` was given: stays in force across reloads.
        meminfo_path: the file the loop reads (``/proc/meminfo``; tests give a file they write).
            The per-CPU lists are read from ``zoneinfo`` beside it (:mod:`sparkguard.pcp`), so a
            test's own meminfo has no real lists added to it.
    """

    def __init__(self, cfg, config_arg: str | None = None, force_dry_run: bool = False,
                 meminfo_path: str = "/proc/meminfo"):
        self.config_arg = config_arg
        self.force_dry_run = force_dry_run
        self.meminfo_path = meminfo_path
        self.policy = policy.Policy(settings.make_thresholds(cfg), cfg.guard.dry_run)
        self.engine = Engine()
        self._poller = select.poll()
        self.actions = Actions(cfg, self.policy, self.engine, self._poller)
        self._idle_poll = select.poll().poll    # nothing registered: the idle fast path waits for time only
        self.reader = self.reporter = self.recorder = self.notifier = self.metrics = self.linkwatch = None
        self.reloader = None
        self.ring = None            # the black box (guard/ring.py), None when off
        self.soft = None            # guard.soft.SoftGuard, the soft line (docs/soft-line.md)
        self.psi_fd = None
        self.stopping = False
        self.keep_engine = False    # SIGUSR2: the supervised engine outlives this daemon
        self._flags: set[int] = set()
        self._wake_r = self._wake_w = -1      # the wake-up pipe, made by start()
        self.avail = self.swap_free = self.value = 0
        self.fall: rate.FallRate | None = None     # the signal's fall-rate estimate (guard.rate_trigger on)
        self.poll_count = 0         # timed (full) passes; poll_sum is their total seconds
        self.fast_polls = 0         # polls on the idle fast path (untimed)
        self._fast = None           # the idle fast path's check (meminfo.fast_check), set by guard.idle.budget
        self.poll_sum = 0.0
        self.poll_mark = (0.0, 0)   # (monotonic s of the last full pass or guard.idle.due, fast_polls then);
                                    # 0.0 before the first: guard.view estimates the last poll from it
        self.started = time.time()
        self.reloads = {"ok": 0, "failed": 0}
        self.read_errors = 0
        self._fail_since: float | None = None   # monotonic s of the first failed read of this streak
        self._fail_wall = 0.0
        self._fail_error = ""
        self._next_status = 0.0
        self.proc_view: dict | None = None   # what /proc shows this process (procview.hidepid_blocks_view)
        self.pcp = pcp.PcpReader(os.path.join(os.path.dirname(meminfo_path), "zoneinfo"))
        self.free = freepages.FreeFloor(meminfo_path)     # the idle fast path's MemFree check
        self._pcp_failed = False    # the last read of the per-CPU lists failed (logged once per streak)
        self._pcp_at, self._pcp_last = -math.inf, 0     # monotonic s and bytes of the last read

    @property
    def cfg(self):
        """The ``config.Config`` in force (a reload replaces it)."""
        return self.actions.cfg

    # ---- start-up -------------------------------------------------------------------

    def start(self) -> None:
        """Open everything the loop needs.  Raises OSError when /proc/meminfo is unusable."""
        for w in harden.harden_self():
            log.warning("%s", w)
        self.actions.warm_up()
        self.reader = meminfo.MeminfoReader(self.meminfo_path)
        self.avail, self.swap_free = self.reader.sample()
        self.value = meminfo.signal_bytes(self.cfg.guard.signal, self.avail, self.swap_free)
        if self.pcp.free_bytes() is None:       # opened, its buffer allocated and the parse run once, now
            log.info("the per-CPU free lists cannot be read (%s): the wait for a victim's memory counts "
                     "MemAvailable alone", self.pcp.error)
        self.notifier = notify.Notifier()
        self.reporter = reporter.Reporter(self.cfg.incidents.dir, self.cfg.incidents.journal)
        self.recorder = self.actions.recorder = recorder.Recorder(self.reader, self.reporter, sysinfo.hostname(),
                                                                  sysinfo.boot_id())
        startup.check_incident_dir(self.cfg, self.reporter)
        self.ring = startup.open_blackbox(self.cfg, self.recorder, self.reporter, self.recorder.host,
                                          self.recorder.boot_id)
        self.psi_fd = harden.open_psi_trigger()
        if self.psi_fd is None:
            log.info("PSI memory trigger unavailable; polling only")
        self.metrics = startup.start_metrics(self.cfg, self.snapshot, lambda: self.cfg)
        self.linkwatch = startup.start_linkwatch(self.cfg, self._on_link_incident, self.metrics)
        self.gpumem = startup.start_gpumem()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False)
        if self.metrics is not None:      # a change before this is in the first STATUS= (loop())
            self.metrics.on_change = self._status_changed
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR2):   # USR2: exit, keep the engine
            signal.signal(sig, self._on_signal)
        self.reloader = reconfig.Reloader(self.config_arg, self.force_dry_run, self.notifier.reloading,
                                          self._reload_read)
        self.reloader.start_result(self.cfg.path)
        g = self.cfg.guard
        log.info("started: SIGTERM below %s, grace %.1fs, kill_below %s, poll %.3fs, config %s%s",
                 format_line(g.term_below), g.grace, format_line(g.kill_below), g.poll_interval, self.cfg.path,
                 " [DRY RUN]" if g.dry_run else "")
        if g.rate_trigger == "on":
            log.info("rate trigger on: SIGTERM when the fall would reach the line within %.2fs (window %.2fs, "
                     "at least %s/s)", g.rate_lead, g.rate_window, format_line(g.rate_min_fall))
        self.engine.start(self.cfg, self.reporter, self.recorder.count, self.metrics)
        self.recorder.supervisor = self.engine.supervisor
        self.soft = SoftGuard(self.cfg, self.engine, self.recorder, lambda: self._wake(SOFT_ANSWER))
        # everything start-up built (the imported modules, the config, the first armed scan) goes
        # to the collector's permanent generation: a collection that the crossing's allocations
        # trigger walks only what was made since, not the whole heap (gc.freeze, Python 3.7)
        gc.collect()
        gc.freeze()

    def _on_link_incident(self, inc: dict) -> None:
        """From the link-watch thread: a link stayed down past ``link.down_after`` (first call,
        outcome ``link_down``) or came back (second call, same id).  Reported as a ``link`` incident."""
        if inc.get("outcome") == "link_down":
            self.recorder.count("link", time.time(), inc.get("id"))
        self.reporter.finish(inc)
        self.engine.link(inc, self.cfg.link.mark_unhealthy)

    def _on_signal(self, signum, frame) -> None:
        self._flags.add(signum)

    def _reload_read(self) -> None:
        """From the reload thread: its result is in ``reloader.loaded``; end the idle fast path and
        wake the loop."""
        self._wake(RELOAD_READ)

    def _status_changed(self) -> None:
        """From the metrics thread: what STATUS= shows changed (the endpoint bound, or failed anew)."""
        self._wake(STATUS_CHANGED)

    def _wake(self, flag: int) -> None:
        """Flag ``flag`` (ends the idle fast path) and wake the loop; non-blocking: a full pipe
        already holds a wake-up."""
        self._flags.add(flag)
        try:
            os.write(self._wake_w, b"r")
        except OSError:
            pass

    def request_stop(self) -> None:
        """From another thread (the drill's controller): end the loop within one poll interval
        and shut down as after SIGTERM (a supervised engine is stopped), without STATUS= saying
        so; safe before :meth:`start` (the flag alone is set then)."""
        self.stopping = True
        self._wake(STOP_REQUESTED)

    # ---- the loop ------------------------------------------------------------------

    def loop(self) -> int:
        """Poll until stopped.  Returns the exit status (0).

        Two paths.  The full pass (:meth:`_pass`) samples, decides, acts, pings the watchdog and
        refreshes STATUS=, then sleeps in poll() on the signal pipe, the PSI trigger and the
        victim's pidfds.  While the state is OK and MemAvailable is at least ``poll_interval *
        FILL_RATE`` above the line (so the full interval is safe at the assumed fill rate), up to
        ten seconds of polls (:func:`sparkguard.guard.idle.budget`) take the idle fast path instead
        (:func:`sparkguard.guard.idle.run`): one ``sysconf`` call where MemFree alone, less twice
        the deficit bound of the last full pass, keeps MemAvailable above the floor
        (:class:`sparkguard.freepages.FreeCheck`; once a second the window check instead), else
        one ``preadv`` of /proc/meminfo up to its MemAvailable line's first columns and four
        byte-string compares of them with the floor's bounds (:class:`sparkguard.meminfo.FastCheck`);
        the watchdog ping when due, and a sleep on an empty poll set (the black box's idle record
        comes from the full pass, every 10 s).  After 200 ms of sleep every line runs cold, and
        each registered fd costs the kernel a poll-table set-up and tear-down per wake.  Signals
        are seen on the fast path through the flag the handler sets, within one poll interval.  The PSI trigger is not watched there: it could wake the loop before the next poll only for
        memory falling faster than FILL_RATE, and its own stall threshold (100-150 ms within a
        1-2 s window, harden.PSI_TRIGGERS) spends most of the 200 ms interval first; it is
        watched again from the first full pass.  The fast path checks MemAvailable alone, which
        is never above MemAvailable+SwapFree, so it is safe for either ``guard.signal``; anything
        else (a read or parse error, less headroom, a signal) ends it and the next poll is a
        full pass.
        """
        self._poller.register(self._wake_r, select.POLLIN)
        if self.psi_fd is not None:
            self._poller.register(self.psi_fd, select.POLLPRI)
        s = settings.loop_settings(self.cfg)
        fast = 0
        self._tick(time.monotonic(), first=True)
        while not self.stopping:
            if fast:
                idle.run(self, fast, s)                 # read, compare, sleep: nothing to decide
            try:
                timeout = self._pass(s)             # read, decide, act, record, ping
                fast = idle.budget(self, timeout, s)
            except Exception:  # noqa: BLE001 - the guard must outlive its own bugs
                log.exception("poll loop error; the guard keeps running")
                timeout, fast = s.interval, 0
            try:
                events = self._poller.poll(timeout * 1000.0)    # sleep: signals, PSI, the victim's exits
                if events and self._on_events(events):
                    fast = 0
                    s = settings.loop_settings(self.cfg)        # checked by the reload: cannot fail here
            except Exception:  # noqa: BLE001 - nothing after a wake-up (a reload) may end the loop
                log.exception("poll loop error after a wake-up; the guard keeps running")
                fast = 0
                self._idle_poll(s.interval * 1000.0)            # a fault that repeats must not spin the CPU
        return self._shutdown()

    def _pcp_free(self, value: int, now: float) -> int:
        """Bytes on the kernel's per-CPU free lists, while a victim's memory is not back by
        ``value`` alone past ``guard.recovery_wait``: one read of /proc/zoneinfo (~45 us on 2 CPUs)
        at most every :data:`PCP_EVERY` s (the lists drain once per ``vm.stat_interval``, and the
        read takes every zone's lock), the last one reused in between; 0 when unreadable, logged
        once per streak.  The largest read of the incident is kept in ``self.actions.pcp_free``
        for its closing event."""
        if value >= self.policy.thresholds.term_below:
            return 0
        if now - self._pcp_at < PCP_EVERY:
            return self._pcp_last
        b = self.pcp.free_bytes()
        if b is None and not self._pcp_failed:
            log.warning("cannot read the per-CPU free lists (%s); memory back is MemAvailable alone",
                        self.pcp.error)
        self._pcp_failed = b is None
        self._pcp_at, self._pcp_last = now, b or 0
        self.actions.pcp_free = max(self.actions.pcp_free, self._pcp_last)
        return self._pcp_last

    def _pass(self, s: settings.LoopSettings) -> float:
        """One full poll: sample, decide, act, record, ping.  Returns the seconds to sleep."""
        pol = self.policy
        t0 = time.monotonic()
        try:
            avail, swap_free = self.reader.sample()
        except (OSError, RuntimeError) as e:     # RuntimeError: meminfo.MeminfoError
            self._read_error(e, t0)
            timeout = s.interval
        else:
            value = avail + swap_free if s.use_swap else avail
            self.avail, self.swap_free, self.value = avail, swap_free, value
            if self._fail_since is not None:
                self._read_back(t0)             # its STATUS= shows this sample
            loading = self.engine.loading()
            fall = self._fall_rate(s, t0, value)
            headroom = value - pol.lines(loading)[0]
            if pol.state is policy.OK and headroom >= 0 and (fall == 0.0 or pol.trigger(value, fall, loading) is None):
                timeout = s.interval if headroom >= s.far else policy.next_interval(headroom, s.interval)
                self.actions.arm(t0, headroom, s.far)
            else:
                gone = self.actions.victim_gone()
                held = self._pcp_free(value, t0) if pol.counts_pcp(t0, gone) else 0
                acts = pol.step(t0, value, gone, fall, loading, held)
                if acts:
                    try:
                        self.actions.act(acts, t0, value)
                        self._tick(t0)
                    except Exception:  # noqa: BLE001 - the guard must outlive its own bugs
                        self.actions.failed(acts, t0)
                line = pol.watch_line()
                timeout = s.interval if line is None else policy.next_interval(value - line, s.interval)
                dl = pol.deadline(time.monotonic())
                if dl is not None and dl < timeout:
                    timeout = dl
            if self.soft.active:        # after the hard policy: a pause never delays a SIGTERM
                before = self.soft.machine.state
                dl = self.soft.step(t0, value, pol.state is policy.OK)
                if dl is not None and dl < timeout:
                    timeout = dl
                if self.soft.machine.state != before:
                    self._tick(t0)      # STATUS= shows the pause
            t1 = time.monotonic()
            self.poll_count += 1
            self.poll_sum += t1 - t0
            self.poll_mark = (t1, self.fast_polls)
            ring = self.ring
            if ring is not None:            # the black box's record: once a second near the line
                idle = pol.state is policy.OK and avail >= s.idle_floor
                # idle, the pass within one poll interval of the record's time writes it: the idle
                # full pass comes every budget + 1 intervals, just short of IDLE_INTERVAL where the
                # interval does not divide FULL_PASS_EVERY (0.3 s: 9.9 s)
                if t0 >= (ring.next_at - s.interval if idle else ring.next_full_at):
                    raw = self.reader.raw()
                    ring.sample(t0, raw, len(raw), avail, s.use_swap, pol.state, idle,
                                ring_mod.target_mem(self.actions))
        notifier = self.notifier
        if notifier.watchdog_interval is not None:
            notifier.watchdog(t0)
            # never sleep past the next ping (poll_interval may exceed WATCHDOG_USEC/2)
            timeout = min(timeout, max(0.0, notifier.next_ping - t0))
        if t0 >= self._next_status:
            self._tick(t0)
        return timeout

    def _fall_rate(self, s: settings.LoopSettings, now: float, value: int) -> float:
        """The signal's fall rate (bytes/s, :mod:`sparkguard.rate`) over the full passes' samples,
        with ``now``/``value`` added; 0.0 when ``guard.rate_trigger`` is off.  The idle fast path
        adds no samples: there, far above the line, the window empties and the estimate is 0.0.
        A reload that changes the window starts a new ring."""
        if not s.rate_on:
            self.fall = None
            return 0.0
        fr = self.fall
        if fr is None or fr.window != s.rate_window:
            fr = self.fall = rate.FallRate(s.rate_window)
        fr.add(now, value)
        return fr.estimate(now)

    def _on_events(self, events: list[tuple[int, int]]) -> bool:
        """Handle what poll() returned: the signal pipe, exited pidfds, a failed PSI trigger.
        Returns True when the loop settings may have changed (a signal was handled)."""
        changed = False
        for fd, ev in events:
            if fd == self._wake_r:
                try:
                    self._drain_wakeup()
                except Exception:  # noqa: BLE001
                    log.exception("handling a signal failed; the guard keeps running")
                changed = True
            elif fd in self.actions.tree_fds:
                self._poller.unregister(fd)
                self.actions.tree_fds.discard(fd)
            elif fd == self.psi_fd and ev & (select.POLLERR | select.POLLNVAL):
                log.warning("PSI trigger failed; polling only")
                self._poller.unregister(fd)
                os.close(fd)
                self.psi_fd = None
        return changed

    def _read_error(self, e: Exception, now: float) -> None:
        """A failed read of meminfo at ``now`` (monotonic s).  After BLIND_AFTER seconds of failures in
        a row the guard is blind: WATCHDOG=1 stops (systemd's WatchdogSec restarts the daemon),
        STATUS= says so, and one error is logged."""
        self.read_errors += 1
        self._fail_error = str(e) or type(e).__name__
        if self._fail_since is None:
            self._fail_since, self._fail_wall = now, time.time()
        n = self.notifier
        if not n.blind and now - self._fail_since >= BLIND_AFTER:
            n.blind = True
            log.error("BLIND: cannot read %s for %.1fs (%d failed reads): %s; watchdog pings stop so the "
                      "service manager restarts the guard", self.reader.path, now - self._fail_since,
                      self.read_errors, self._fail_error)
            self._tick(now)
        elif self.read_errors == 1 or self.read_errors % 300 == 0:
            log.error("reading %s failed (%d times so far): %s; still polling", self.reader.path,
                      self.read_errors, self._fail_error)

    def _read_back(self, now: float) -> None:
        """The first good read after failures: end the streak; a blind guard pings again."""
        since, self._fail_since = self._fail_since, None
        if self.notifier.blind:
            self.notifier.blind = False
            log.warning("reading %s again after %.1fs blind; watchdog pings resume", self.reader.path, now - since)
            self._tick(now)

    def _drain_wakeup(self) -> None:
        try:
            while os.read(self._wake_r, 512):
                pass
        except BlockingIOError:
            pass
        flags, self._flags = self._flags, set()
        if self.reloader.loaded is not None:
            self.finish_reload()
        if signal.SIGHUP in flags:
            self.reloader.begin()
        if flags & {signal.SIGTERM, signal.SIGINT, signal.SIGUSR2}:
            self.keep_engine = signal.SIGUSR2 in flags      # exit and leave the engine to the next daemon
            self.stopping = True
            self.notifier.stopping()
            log.info("stopping (signal)")
        elif STATUS_CHANGED in flags:
            self._tick(time.monotonic())

    def _tick(self, now: float, first: bool = False) -> None:
        """Refresh STATUS= (and send READY=1 after the first sample)."""
        self._next_status = now + STATUS_EVERY
        status = self.status_line()
        if first:
            self.notifier.ready(status)
        else:
            self.notifier.status(status)

    # ---- reload / stop / snapshot -----------------------------------------------------------

    def finish_reload(self) -> bool:
        """From the loop: put a finished config read in force, or keep the running config when it
        was refused (:func:`sparkguard.guard.reconfig.finish`).  Returns success."""
        return reconfig.finish(self)

    def _shutdown(self) -> int:
        if self.soft is not None:
            try:
                self.soft.stop(time.monotonic(), self.value)      # resume a paused engine before anything stops
            except Exception:  # noqa: BLE001 - shutting down anyway
                log.exception("stopping the soft line failed")
        self.engine.stop(self.keep_engine)
        if self.recorder is not None and self.recorder.incident is not None:
            self.actions.close_incident(time.monotonic(), self.value,
                                        recovered=self.value >= self.cfg.guard.term_below, stopped=True)
        if self.actions.victims is not None:
            self.actions.victims.close()        # the spare victim cgroup and used ones now empty
        if self.linkwatch is not None:
            self.linkwatch.stop()
        if self.reporter is not None:
            self.reporter.close()
        if self.metrics is not None:
            try:
                self.metrics.stop()
            except Exception:  # noqa: BLE001 - shutting down anyway
                pass
        if self.ring is not None:
            self.ring.close(clean=True)     # the last thing: the next start finds a clean stop
        log.info("stopped")
        return 0

    def status_line(self) -> str:
        """One line for STATUS= (:func:`sparkguard.guard.view.status_line`)."""
        return view.status_line(self)

    def snapshot(self) -> dict:
        """Current state for metrics/status (:func:`sparkguard.guard.view.snapshot`); cheap, any thread."""
        return view.snapshot(self)

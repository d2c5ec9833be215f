"""``sparkguard run``: the guard daemon, and ``sparkguard check-config``.

The poll loop (``Guard.loop``) samples /proc/meminfo (see :mod:`sparkguard.meminfo`),
feeds the pure decision core (:mod:`sparkguard.policy`) and carries out its actions:
choose a target (:mod:`sparkguard.proctree`), SIGTERM/SIGKILL through pidfds
(:mod:`sparkguard.signals`), then report (:mod:`sparkguard.reporter`) — act first, report
after.  It sleeps in ``poll(2)`` on: a self-pipe for signals (SIGHUP reload, SIGTERM/SIGINT
stop), an optional PSI trigger on /proc/pressure/memory (POLLPRI wakes the loop as soon
as the kernel sees memory stalls), and the victim's pidfds (POLLIN when a member exits).
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import select
import signal
import sys
import tempfile
import time

from sparkguard.guard import harden, logq, settings

log = logging.getLogger("sparkguard")

STATUS_EVERY = 2.0          # seconds between STATUS= refreshes when nothing changes
BLIND_AFTER = 3.0           # seconds of failed /proc/meminfo reads in a row before WATCHDOG=1 stops (WatchdogSec=5s)
RELOAD_READ = -1            # pseudo-signal in Guard._flags: the reload thread has read the config
PROBE_BYTES = 64 * 1024     # bytes the start-up probe of incidents.dir writes: room for one report of a large tree


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``run`` and ``check-config``."""
    p = sub.add_parser("run", help="run the guard daemon (systemd Type=notify)",
                       description="Poll MemAvailable and SIGTERM the inference engine below the line; "
                                   "SIGKILL its whole tree after the grace period.")
    p.add_argument("--config", "-c", metavar="PATH", help="YAML config (default /etc/sparkguard/sparkguard.yaml; "
                   "embedded defaults when that file is absent)")
    p.add_argument("--dry-run", action="store_true", help="decide and report everything, signal nothing")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="log verbosity on stderr (default info)")
    # tests point the reader at a file they control (README "Tests"); not for production
    p.add_argument("--meminfo", default="/proc/meminfo", help=argparse.SUPPRESS)
    p.set_defaults(func=cmd_run)
    c = sub.add_parser("check-config", help="validate a config file and print the effective settings",
                       description="Validate a sparkguard config (every error names the file, key and value) "
                                   "and print the effective settings. Exit 0 if valid, 1 if not.")
    c.add_argument("path", nargs="?", help="file to check (default /etc/sparkguard/sparkguard.yaml)")
    c.add_argument("--config", "-c", dest="config_opt", metavar="PATH", help="the same as PATH")
    c.set_defaults(func=cmd_check_config)


def cmd_check_config(args: argparse.Namespace) -> int:
    """Validate a config; exit 0 if valid, 1 with the error (file, key, value) otherwise."""
    from sparkguard import config
    from sparkguard.units import format_duration, format_size
    path = args.config_opt or args.path
    try:
        cfg = config.load(path, required=path is not None)
        settings.prepare(cfg)
    except config.ConfigError as e:
        print(f"sparkguard: invalid config: {e}", file=sys.stderr)
        return 1
    g = cfg.guard
    print(f"{cfg.path}: OK")
    print(f"  guard: poll every {format_duration(g.poll_interval)}, SIGTERM below {format_size(g.term_below)} "
          f"of {'MemAvailable' if g.signal == 'available' else 'MemAvailable+SwapFree'}, "
          f"SIGKILL after {format_duration(g.grace)}"
          + (f" or below {format_size(g.kill_below)}" if g.kill_below is not None else "")
          + (" [dry run]" if g.dry_run else ""))
    print(f"  targets: {len(cfg.targets.match)} patterns, {len(cfg.targets.protect)} protected, "
          f"fallback {cfg.targets.fallback}")
    m = cfg.metrics.listen
    print(f"  metrics: {'http://%s:%d/metrics' % m if m else 'off'}")
    print(f"  incidents: {cfg.incidents.dir}, journal {cfg.incidents.journal}")
    links = cfg.link.interfaces
    print(f"  link watch: {', '.join(links) + f' (incident after {format_duration(cfg.link.down_after)} down)' if links else 'off'}")
    if cfg.engine.enabled:
        from sparkguard.supervisor.render import config_line
        print(f"  engine: {config_line(cfg.engine)}")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    """Run the daemon until SIGTERM/SIGINT; exit 2 on a bad config or a /proc it cannot use."""
    logq.setup_logging(args.log_level)
    from sparkguard import config, proctree
    view: dict = {}
    why = proctree.hidepid_blocks_view(view)
    if why:
        print(f"sparkguard: not starting: {why}", file=sys.stderr)
        return 2
    log.info("sees %d processes in /proc, %d of other users (%d readable)%s", view["processes"],
             view["other_users"], view["other_users_readable"],
             f", /proc hidepid={view['hidepid']}" if view["hidepid"] else "")
    try:
        cfg = config.load(args.config)
        settings.prepare(cfg)
    except config.ConfigError as e:
        print(f"sparkguard: invalid config, not starting: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        cfg = config.replace(cfg, guard=config.dataclasses.replace(cfg.guard, dry_run=True))
    guard = Guard(cfg, config_arg=args.config, force_dry_run=args.dry_run, meminfo_path=args.meminfo)
    guard.proc_view = view
    try:
        guard.start()
    except (OSError, RuntimeError) as e:   # MeminfoError is a RuntimeError
        print(f"sparkguard: not starting: {e}", file=sys.stderr)
        return 2
    return guard.loop()


class Guard:
    """The daemon: state, the poll loop, and the actions.

    Args:
        cfg: ``config.Config``.
        config_arg: the ``--config`` path given (re-read on SIGHUP), or None for the default.
        force_dry_run: ``--dry-run`` was given: stays in force across reloads.
        meminfo_path: the file the loop reads (``/proc/meminfo``; tests give a file they write).
    """

    def __init__(self, cfg, config_arg: str | None = None, force_dry_run: bool = False,
                 meminfo_path: str = "/proc/meminfo"):
        from sparkguard import policy
        self.cfg = cfg
        self.config_arg = config_arg
        self.force_dry_run = force_dry_run
        self.policy = policy.Policy(settings.make_thresholds(cfg), cfg.guard.dry_run)
        self.reader = None
        self.reporter = None
        self.notifier = None
        self.metrics = None
        self.psi_fd = None
        self.tree = None
        self.target = None
        self.recorder = None
        self.protector = None
        self.supervisor = None
        self.stopping = False
        self._flags: set[int] = set()
        self.avail = self.swap_free = self.value = 0
        self.poll_count = 0         # timed (full) passes; poll_sum is their total seconds
        self.fast_polls = 0         # polls on the idle fast path (untimed)
        self.poll_sum = 0.0
        self.last_poll = 0.0
        self.started = time.time()
        self.signals_sent = {"SIGTERM": 0, "SIGKILL": 0}
        self.reloads = {"ok": 0, "failed": 0}
        self.read_errors = 0
        self.meminfo_path = meminfo_path
        self._fail_since: float | None = None   # monotonic s of the first failed read of this streak
        self._fail_wall = 0.0
        self._fail_error = ""
        self._reloads_done = 0
        self._reload_thread = None      # the thread reading the config after a SIGHUP
        self._reload_again = False      # a SIGHUP came while it was reading
        self._loaded = None             # (MONOTONIC_USEC of the reload, (cfg, thresholds, protector) or ConfigError)
        self._reload_dir: str | None = None
        self._next_status = 0.0
        self._poller = None
        self._tree_fds: set[int] = set()
        self._killed: set[int] = set()
        self.linkwatch = None
        self.proc_view: dict | None = None   # what /proc shows this process (proctree.hidepid_blocks_view)

    # ---- start-up -------------------------------------------------------------------

    def start(self) -> None:
        """Open everything the loop needs.  Raises OSError when /proc/meminfo is unusable."""
        from sparkguard import meminfo, notify, proctree, recorder, reporter
        for w in harden.harden_self():
            log.warning("%s", w)
        self._warm_up()
        from sparkguard import sysinfo
        self.reader = meminfo.MeminfoReader(self.meminfo_path)
        self.avail, self.swap_free = self.reader.sample()
        self.value = self.avail + self.swap_free if self.cfg.guard.signal == "available+swap" else self.avail
        self.notifier = notify.Notifier()
        self.protector = proctree.Protector(self.cfg.targets.protect)
        self.reporter = reporter.Reporter(self.cfg.incidents.dir, self.cfg.incidents.journal)
        self.recorder = recorder.Recorder(self.reader, self.reporter, sysinfo.hostname(), sysinfo.boot_id())
        self._check_incident_dir()
        self.psi_fd = harden.open_psi_trigger()
        if self.psi_fd is None:
            log.info("PSI memory trigger unavailable; polling only")
        self._start_metrics()
        self._start_linkwatch()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, self._on_signal)
        self._start_reload_result()
        g = self.cfg.guard
        log.info("started: SIGTERM below %s, grace %.1fs, kill_below %s, poll %.3fs, config %s%s",
                 _fmt_size(g.term_below), g.grace, _fmt_size(g.kill_below), g.poll_interval, self.cfg.path,
                 " [DRY RUN]" if g.dry_run else "")
        self._start_supervisor()

    def _check_incident_dir(self) -> None:
        """Create ``incidents.dir`` now and prove that a report fits, so a bad path or a full disk is
        known at start, not lost at the first incident (the guard still runs either way).

        The probe writes PROBE_BYTES (more than a typical report) and fsyncs them: creating an empty
        file succeeds on a full filesystem, and delayed allocation reports ENOSPC at fsync(2).
        The log says "and the journal" only when journald's socket exists (reporter's journal mode)."""
        d = self.cfg.incidents.dir
        sock = self.reporter.journal_socket
        journal = self.cfg.incidents.journal != "off" and os.path.exists(sock)
        if self.cfg.incidents.journal == "off":
            nojournal = ""
        elif journal:
            nojournal = None
        else:
            nojournal = f" (incidents.journal {self.cfg.incidents.journal}, but no journald socket at {sock})"
        try:
            os.makedirs(d, mode=0o750, exist_ok=True)
            fd, probe = tempfile.mkstemp(prefix=".probe-", dir=d)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(b"\0" * PROBE_BYTES)
                    f.flush()
                    os.fsync(f.fileno())
            finally:
                os.unlink(probe)
            log.info("incidents go to %s%s", d, " and the journal" if nojournal is None else nojournal)
        except OSError as e:
            log.error("incidents.dir %s is not writable (%s): incident files will be lost%s", d, e.strerror or e,
                      "; the journal still gets them" if nojournal is None else
                      f" and nothing keeps the full reports{nojournal}")

    def _warm_up(self) -> None:
        """Arm the first target (one /proc pass, touching, hence locking, the search's and the
        pidfd code's pages) and log it.  Sets ``self.armed`` (:class:`sparkguard.armed.Armed`)."""
        from sparkguard import armed, policy, proctree
        if self.protector is None:
            self.protector = proctree.Protector(self.cfg.targets.protect)
        self.armed = armed.Armed(self._scan_choice, policy.FILL_RATE)
        self._armed_for = self.cfg.targets
        self.armed.refresh()
        t = self.armed.target
        if t is not None:
            log.info("targets now: %s (pid %d, %d processes), armed", t.title, t.root_pid, len(t.pids))
        else:
            log.info("no process matches targets.match right now")

    def _arm(self, now: float, headroom: int, far: int) -> None:
        """The full pass's hook in the OK state: keep the armed target fresh (:mod:`sparkguard.armed`);
        a reload that replaced ``targets`` drops the armed choice first.  ``far``: bytes of headroom
        (poll interval x ``policy.FILL_RATE``) below which the loop polls faster; below it the armed
        tree's own changes are followed at ``armed.SMALL_DUTY``."""
        if self.cfg.targets is not self._armed_for:
            self._armed_for = self.cfg.targets
            self.armed.disarm()
        self.armed.tick(now, headroom, far)

    def _start_metrics(self) -> None:
        """Serve metrics on ``metrics.listen``.  A port that cannot be bound (taken, not
        permitted) is logged and bound again in the endpoint's thread with a backoff: the guard
        never waits for it (``sparkguard.metrics.start_server``, ``retry=True``)."""
        listen = self.cfg.metrics.listen
        if not listen:
            return
        from sparkguard import metrics
        self.metrics = metrics.start_server(listen, self.snapshot, retry=True)

    def _start_linkwatch(self) -> None:
        """Watch the TP fabric links (``link.interfaces``) through netlink events, in their own thread.

        pyroute2 is imported only here: it costs ~19 MiB of RSS, paid only when links are configured.
        """
        if not self.cfg.link.interfaces:
            return
        from sparkguard import linkwatch
        self.linkwatch = linkwatch.LinkWatch(self.cfg.link.interfaces, self.cfg.link.down_after,
                                             on_incident=self._on_link_incident)
        self.linkwatch.start()
        if self.metrics is not None:
            self.metrics.register_collector(self.linkwatch.collector())

    def _on_link_incident(self, inc: dict) -> None:
        """From the link-watch thread: a link stayed down past ``link.down_after`` (first call,
        outcome ``link_down``) or came back (second call, same id).  Reported as a ``link`` incident."""
        if inc.get("outcome") == "link_down":
            self.recorder.count("link", time.time())
        self.reporter.finish(inc)
        self._link_to_supervisor(inc)

    def _on_signal(self, signum, frame) -> None:
        self._flags.add(signum)

    # ---- the loop ------------------------------------------------------------------

    def loop(self) -> int:
        """Poll until stopped.  Returns the exit status (0).

        Two paths.  The full pass (:meth:`_pass`) samples, decides, acts, pings the watchdog and
        refreshes STATUS=, then sleeps in poll() on the signal pipe, the PSI trigger and the
        victim's pidfds.  While the state is OK and MemAvailable is at least ``poll_interval *
        FILL_RATE`` above the line (so the full interval is safe at the assumed fill rate), up to
        two seconds of polls (:meth:`_fast_budget`) take the idle fast path instead: one ``preadv``
        of /proc/meminfo, one parse of MemAvailable, one compare, and a sleep on an empty poll
        set, written inline with no call or clock read.  After 200 ms of sleep every line runs
        cold, and each registered fd costs the kernel a poll-table set-up and tear-down per wake;
        measured in-process on the dev VM, the fast path takes about half the CPU of a
        full pass.  Signals are seen on the fast path through the flag the handler sets, within one
        poll interval.  The PSI trigger is not watched there: it could wake the loop before the
        next poll only for memory falling faster than FILL_RATE, and its own stall threshold
        (100-150 ms within a 1-2 s window, PSI_TRIGGERS) spends most of the 200 ms interval first;
        it is watched again from the first full pass.
        The fast path checks MemAvailable alone, which is never above MemAvailable+SwapFree, so it
        is safe for either ``guard.signal``; anything else (a read or parse error, less headroom, a
        signal) ends it and the next poll is a full pass.
        """
        from sparkguard import meminfo, policy
        POLLIN, POLLPRI = select.POLLIN, select.POLLPRI
        poller = self._poller = select.poll()
        poller.register(self._wake_r, POLLIN)
        if self.psi_fd is not None:
            poller.register(self.psi_fd, POLLPRI)
        sample = self.reader.sample
        step = self.policy.step
        next_interval = policy.next_interval
        monotonic = time.monotonic
        poll = poller.poll
        pol = self.policy
        OK = policy.OK
        preadv = os.preadv
        fd, view, buf = self.reader.inline_parts()
        find = buf.find
        AVAIL, AT, KB = meminfo.AVAIL_LABEL, meminfo.AVAIL_VALUE_AT, meminfo.KB
        use_swap, interval, far, idle_floor, budget = self._loop_settings()
        idle_poll = select.poll().poll      # nothing registered: the fast path waits for time only
        fast_ms = interval * 1000.0
        fast_left = 0
        self._tick(monotonic(), first=True)
        while not self.stopping:
            if fast_left:
                try:
                    while fast_left:
                        # the idle fast path: keep it to these lines
                        try:
                            n = preadv(fd, view, 0)
                            i = find(AVAIL, 0, n)   # "\nMemAvailable:": only at a line's start
                            avail = int(buf[i + AT:find(KB, i, n)]) << 10 if i >= 0 else -1
                        except Exception:  # noqa: BLE001 - OSError, ValueError; the full pass reports it
                            break
                        if avail < idle_floor or self._flags or self.stopping:
                            break
                        fast_left -= 1
                        self.fast_polls += 1
                        self.avail = avail
                        self.last_poll = monotonic()
                        idle_poll(fast_ms)
                except Exception:  # noqa: BLE001 - the guard must outlive its own bugs
                    log.exception("poll loop error on the idle path; the guard keeps running")
                fast_left = 0
            try:
                timeout = self._pass(sample, step, next_interval, monotonic, pol, OK, use_swap, interval, far)
                if timeout >= interval and pol.state is OK and self.avail >= idle_floor and not self._flags \
                        and self._fail_since is None:
                    fast_left = self._fast_budget(budget, interval, monotonic())
            except Exception:  # noqa: BLE001 - the guard must outlive its own bugs
                log.exception("poll loop error; the guard keeps running")
                timeout = interval
            try:
                events = poll(timeout * 1000.0)
                if events and self._on_events(events):
                    fast_left = 0
                    # validated by reload(); a failure here keeps the settings in force
                    use_swap, interval, far, idle_floor, budget = self._loop_settings()
                    fast_ms = interval * 1000.0
            except Exception:  # noqa: BLE001 - nothing after a wake-up (a reload) may end the loop
                log.exception("poll loop error after a wake-up; the guard keeps running")
                fast_left = 0
                idle_poll(fast_ms)      # a fault that repeats must not spin the CPU
        return self._shutdown()

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
            elif fd in self._tree_fds:
                self._poller.unregister(fd)
                self._tree_fds.discard(fd)
            elif fd == self.psi_fd and ev & (select.POLLERR | select.POLLNVAL):
                log.warning("PSI trigger failed; polling only")
                self._poller.unregister(fd)
                os.close(fd)
                self.psi_fd = None
        return changed

    def _fast_budget(self, budget: int, interval: float, now: float) -> int:
        """Fast polls allowed from ``now`` (monotonic seconds): ``budget``, fewer when the
        watchdog ping falls due sooner (a full pass must send it on time)."""
        n = self.notifier
        if n.watchdog_interval is not None:
            until = int((n.next_ping - now) / interval) - 1
            if until < budget:
                return until if until > 0 else 0
        return budget

    def _pass(self, sample, step, next_interval, monotonic, pol, OK, use_swap, interval, far) -> float:
        """One poll: sample, decide, act, ping.  Returns the seconds to sleep.  The names are the
        loop's locals, passed in so the idle path does no attribute or module lookups."""
        t0 = monotonic()
        try:
            avail, swap_free = sample()
        except (OSError, RuntimeError) as e:     # RuntimeError: meminfo.MeminfoError
            self._read_error(e, t0)
            timeout = interval
        else:
            if self._fail_since is not None:
                self._read_back(t0)
            value = avail + swap_free if use_swap else avail
            self.avail, self.swap_free, self.value = avail, swap_free, value
            headroom = value - pol.thresholds.term_below
            if pol.state is OK and headroom >= 0:
                # the idle path: five times a second, forever; keep it short
                timeout = interval if headroom >= far else next_interval(headroom, interval)
                self._arm(t0, headroom, far)
            else:
                actions = step(t0, value, self._victim_gone())
                if actions:
                    try:
                        self._act(actions, t0, value)
                    except Exception:  # noqa: BLE001 - the guard must outlive its own bugs
                        self._act_failed(actions, t0)
                line = pol.watch_line()
                timeout = interval if line is None else next_interval(value - line, interval)
                dl = pol.deadline(monotonic())
                if dl is not None and dl < timeout:
                    timeout = dl
            t1 = monotonic()
            self.poll_count += 1
            self.poll_sum += t1 - t0
            self.last_poll = t1
        notifier = self.notifier
        if notifier.watchdog_interval is not None:
            notifier.watchdog(t0)
            # never sleep past the next ping (poll_interval may exceed WATCHDOG_USEC/2)
            timeout = min(timeout, max(0.0, notifier.next_ping - t0))
        if t0 >= self._next_status:
            self._tick(t0)
        return timeout


    def _loop_settings(self) -> tuple[bool, float, int, int, int]:
        """:func:`loop_settings` of the running config; re-read after a reload."""
        return settings.loop_settings(self.cfg)

    def _act_failed(self, actions: tuple[str, ...], now: float) -> None:
        """An action raised: log it with the traceback and keep guarding.  Without a victim tree
        the policy waits in NO_TARGET, which searches for a target again every second."""
        from sparkguard import policy
        log.exception("acting on %s failed; the guard keeps running", ",".join(actions))
        if self.tree is None and self.policy.state in (policy.TERM_SENT, policy.KILL_SENT):
            self.policy.no_target(now)

    def _victim_gone(self) -> bool:
        if self.tree is None or self.policy.dry_run:
            return False
        return self.tree.gone()

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
        if self._loaded is not None:
            self.finish_reload()
        if signal.SIGHUP in flags:
            self.begin_reload()
        if flags & {signal.SIGTERM, signal.SIGINT}:
            self.stopping = True
            self.notifier.stopping()
            log.info("stopping (signal)")

    def _tick(self, now: float, first: bool = False) -> None:
        """Refresh STATUS= (and send READY=1 after the first sample)."""
        self._next_status = now + STATUS_EVERY
        status = self.status_line()
        if first:
            self.notifier.ready(status)
        else:
            self.notifier.status(status)

    def status_line(self) -> str:
        """One line for STATUS=: available, line, state; or why the guard is blind."""
        if self.notifier is not None and self.notifier.blind:
            since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self._fail_wall))
            return f"BLIND: cannot read {self.reader.path} since {since}: {self._fail_error}"
        g = self.cfg.guard
        what = "MemAvailable" if g.signal == "available" else "MemAvailable+SwapFree"
        line = f"{what} {_fmt_size(self.value)}, SIGTERM line {_fmt_size(g.term_below)}"
        if g.kill_below is not None:
            line += f", SIGKILL line {_fmt_size(g.kill_below)}"
        state = self.policy.state
        if self.target is not None and state != "ok":
            state += f" (pid {self.target.root_pid})"
        problem = self.metrics.problem() if self.metrics is not None else None
        return f"{line}; state {state}" + ("; DRY RUN" if g.dry_run else "") + (f"; {problem}" if problem else "")

    # ---- actions -----------------------------------------------------------------------

    def _act(self, actions: tuple[str, ...], now: float, value: int) -> None:
        from sparkguard import policy
        for a in actions:
            if a == policy.CROSSED:
                self.recorder.open(now, value, self.cfg.guard)
            elif a in (policy.TERM, policy.RETRY_TARGET):
                self._term(now, value, retry=a == policy.RETRY_TARGET)
            elif a == policy.KILL:
                self._kill(now, value)
            elif a == policy.EXITED:
                self.recorder.event(now, value, "exited", self.tree.root and [self.tree.root] or [],
                            f"victim tree gone {now - self.policy.t_term:.2f}s after SIGTERM")
            elif a in (policy.RECOVERED, policy.GAVE_UP_WAITING):
                self._close_incident(now, value, recovered=a == policy.RECOVERED)
            elif a == policy.UNKILLABLE:
                alive = self.tree.alive() if self.tree is not None else []
                self.recorder.event(now, value, "unkillable", alive,
                            f"{len(alive)} processes still alive {self.policy.thresholds.kill_give_up:g}s after "
                            "the first SIGKILL (uninterruptible sleep in a driver?); giving up on them")
                self._close_incident(now, value, recovered=False)
        self._tick(now)

    def _scan_choice(self):
        """One /proc pass: ``(target, procs, ambiguous)``: the target with its tree rows read, or
        None when nothing matches; the whole scan; and whether the choice could change without a
        process being created (:func:`sparkguard.proctree.ambiguous`: ranked by memory among
        several trees of one pattern, or the oom_score fallback).  The supervised engine comes
        first, then ``targets.match``."""
        from sparkguard import proctree
        procs = proctree.scan()
        target = self._engine_target(procs)
        ambiguous = False
        if target is None:
            targets = proctree.find_targets(self.cfg.targets, procs=procs, details=False)
            if not targets:
                return None, procs, False
            target = targets[0]
            ambiguous = proctree.ambiguous(targets)
        # the chosen tree's RSS/swap/oom_score rows before any signal: after SIGTERM vLLM's children
        # are gone within milliseconds; one tree's reads cost about a millisecond
        proctree.add_details(target, procs)
        return target, procs, ambiguous

    def _choose(self):
        """``(target, tree, armed)``: the armed target when its root is alive, the choice was not
        ambiguous (:meth:`sparkguard.armed.Armed.take`) and the supervised engine (the first
        target) has not changed since it was armed, with no /proc pass; else the
        choice of one scan (its tree's pidfds opened now).  ``(None, None, False)`` when nothing matches."""
        from sparkguard import signals
        armed = getattr(self, "armed", None)
        if armed is not None and self.cfg.targets is not self._armed_for:
            armed.disarm()          # a reload changed targets since the last full pass in the OK state
        got = armed.take() if armed is not None else None
        if got is not None:
            target, tree, _ = got
            run = getattr(self.supervisor, "run", None) if self.supervisor is not None else None
            if run is None or run.pid == target.root_pid:
                return target, tree, True
            tree.close()
        target = self._scan_choice()[0]
        if target is None:
            return None, None, False
        return target, signals.Tree(target.pids, target.starttimes, root=target.root_pid), False

    def _term(self, now: float, value: int, retry: bool = False) -> None:
        from sparkguard import proctree
        target, tree, armed = self._choose()
        if target is None:
            if not retry:
                self.recorder.fill(None)
                self.recorder.event(now, value, "no_target", [], "nothing matches targets.match"
                            + (" and fallback is off" if self.cfg.targets.fallback == "off" else ""))
            self.policy.no_target(now)
            return
        self.target = target
        self.tree = tree
        if self.policy.dry_run:
            self.recorder.event(now, value, "would_term", [target.root_pid], f"dry run: would SIGTERM {target.title}")
        else:
            already = self.supervisor.stopping(target.root_pid) if self.supervisor is not None else None
            # the supervisor already SIGTERMed it (wedged, stop, lane): no second SIGTERM (uvicorn
            # force-exits on one); the guard's grace clock and tree SIGKILL still apply
            sent = False if already else self.tree.term_root()
            t_sig = time.monotonic()      # the event's time is the signal's, not the sample's
            if sent:
                self.signals_sent["SIGTERM"] += 1
            for fd in self.tree.fds.values():
                self._poller.register(fd, select.POLLIN)
                self._tree_fds.add(fd)
        if armed:
            # act first, report after: the armed rows (read when it was armed) are re-read now;
            # members already gone keep their armed figures
            proctree.refresh_details(target)
        if retry:
            self.policy.target_found(now)
        if not self.policy.dry_run:
            self.recorder.event(t_sig, value, "sigterm", [target.root_pid],
                        f"SIGTERM {target.title} (pid {target.root_pid}, {len(target.pids)} processes, "
                        f"{_fmt_size(target.mem_bytes)} RSS+swap)" +
                        (f" [not sent again: the supervisor is already stopping it ({already})]" if already
                         else "" if sent else " [already gone]"))
        self.recorder.fill(target)

    def _kill(self, now: float, value: int) -> None:
        if self.tree is None:
            return
        if self.policy.dry_run:
            self.recorder.event(now, value, "would_kill", list(self.tree.fds), "dry run: would SIGKILL the tree")
            return
        before = set(self.tree.fds)
        pids = self.tree.kill_all(self.protector)
        t_sig = time.monotonic()
        for pid, fd in self.tree.fds.items():
            if pid not in before:
                self._poller.register(fd, select.POLLIN)
                self._tree_fds.add(fd)
        self.signals_sent["SIGKILL"] += len(pids)
        new = [pid for pid in pids if pid not in self._killed]
        self._killed.update(pids)
        if not new:          # a repeated sweep of the same lingering processes: counted, not re-reported
            return
        pids = new
        why = "below the SIGKILL line" if (self.cfg.guard.kill_below is not None and value < self.cfg.guard.kill_below
                                          and now - self.policy.t_term < self.cfg.guard.grace) else \
            f"still alive {now - self.policy.t_term:.1f}s after SIGTERM (grace {self.cfg.guard.grace:g}s)"
        self.recorder.event(t_sig, value, "sigkill", pids, f"SIGKILL {len(pids)} processes: {why}")

    def _close_incident(self, now: float, value: int, recovered: bool, stopped: bool = False) -> None:
        """End the open incident (:meth:`sparkguard.recorder.Recorder.close`); release the victim's
        pidfds whatever happens while reporting.  ``stopped``: the daemon is stopping with the incident
        still open."""
        try:
            self.recorder.close(now, value, self.cfg.guard, self.policy.dry_run, recovered, stopped)
        finally:
            if self.tree is not None:
                for fd in list(self._tree_fds):
                    try:
                        self._poller.unregister(fd)
                    except KeyError:
                        pass
                self._tree_fds.clear()
                self.tree.close()
            self.tree = None
            self.target = None
            self._killed.clear()
            self.policy.dry_run = self.cfg.guard.dry_run   # a dry_run change deferred by reload()

    # ---- reload / stop / snapshot -----------------------------------------------------------

    def begin_reload(self) -> None:
        """SIGHUP: read and check the config file in a thread of its own, so parsing (up to a 1 MiB
        YAML file: seconds of Python) never holds up the poll loop; :meth:`finish_reload` applies
        the result from the loop.  A SIGHUP while a file is being read is kept for one more reload
        once this one is applied."""
        import threading
        if self._reload_thread is not None:
            self._reload_again = True
            return
        started = self.notifier.reloading()
        self._reload_thread = threading.Thread(target=self._load_new_config, args=(started,),
                                               name="sparkguard-reload", daemon=True)
        self._reload_thread.start()

    def _load_new_config(self, started: int) -> None:
        """Reload thread: ``config.load`` and :func:`prepare` (pure: nothing of the running guard
        is touched), the outcome left in ``_loaded`` and the loop woken through its self-pipe."""
        from sparkguard import config
        try:
            cfg = config.load(self.config_arg)
            if self.force_dry_run and not cfg.guard.dry_run:
                cfg = config.replace(cfg, guard=config.dataclasses.replace(cfg.guard, dry_run=True))
            result = (cfg, *settings.prepare(cfg)[1:])
        except Exception as e:  # noqa: BLE001 - ConfigError, or a parser bug on a strange file
            if not isinstance(e, config.ConfigError):
                e = config.ConfigError(self.config_arg or config.DEFAULT_PATH, "(file)", None,
                                       f"cannot load: {type(e).__name__}: {e}")
            result = e
        self._loaded = (started, result)
        self._flags.add(RELOAD_READ)        # ends the idle fast path; _loaded is what counts
        try:
            os.write(self._wake_w, b"r")    # non-blocking: a full pipe already holds a wake-up
        except OSError:
            pass

    def finish_reload(self) -> bool:
        """From the loop: put a config read by :meth:`begin_reload` in force, or keep the running one
        when it was refused.  Returns success; False when no read had finished.

        The new config passed the same checks as ``check-config`` (``config.load`` and
        :func:`prepare`, which builds everything derived from it) before any of it is put in force.
        The result goes to the reload result file (:mod:`sparkguard.reload`) last, so
        ``sparkguard reload`` returns once it is in force or refused."""
        loaded, self._loaded = self._loaded, None
        if loaded is None:
            return False
        self._reload_thread = None          # it has stored its result: only its return is left
        if self._reload_again:
            self._reload_again = False
            self.begin_reload()
        started, result = loaded
        if isinstance(result, Exception):
            e = result
            self.reloads["failed"] += 1
            log.error("reload failed, keeping the running config: %s", e)
            self.reporter.event(None, {"event": "config_reload_failed", "t": 0.0, "at": time.time(),
                                       "available_bytes": self.value, "pids": [],
                                       "detail": f"reload failed, running config kept: {e}"})
            self.notifier.ready()
            self.notifier.status("reload FAILED, running config kept: " + str(e)[:200])
            self._next_status = time.monotonic() + 30
            self._reload_result(started, False, str(e))
            return False
        cfg, thresholds, protector = result
        for sec, key in (("metrics", "listen"), ("incidents", "dir"), ("incidents", "journal"),
                         ("link", "interfaces"), ("link", "down_after")):
            new, old = getattr(getattr(cfg, sec), key), getattr(getattr(self.cfg, sec), key)
            if new != old:
                log.warning("%s.%s changed to %s: takes effect after a restart", sec, key, new)
        self.cfg = cfg
        self.policy.thresholds = thresholds
        if self.policy.state == "ok":
            self.policy.dry_run = cfg.guard.dry_run
        elif self.policy.dry_run != cfg.guard.dry_run:
            # switching mid-incident would SIGKILL a tree that never got SIGTERM (or leave a real
            # SIGTERM without its escalation): the new dry_run applies when this incident ends
            log.warning("guard.dry_run changes to %s when the open incident ends", cfg.guard.dry_run)
        self.protector = protector
        error = ""
        try:
            self._reload_supervisor(cfg)
        except Exception as e:  # noqa: BLE001 - the guard's part is in force; say what was not
            log.exception("reload: the engine supervisor did not take the new config")
            error = f"guard settings applied, engine supervisor refused them: {type(e).__name__}: {e}"
        self.reloads["ok" if not error else "failed"] += 1
        log.info("reloaded %s: SIGTERM below %s, grace %.1fs", cfg.path, _fmt_size(cfg.guard.term_below),
                 cfg.guard.grace)
        self.notifier.ready()
        self._tick(time.monotonic())
        self._reload_result(started, not error, error)
        return not error

    def _start_reload_result(self) -> None:
        """Write the reload result file's first record (pid, generation 0) so ``sparkguard reload``
        finds the daemon; creates the runtime directory when run without systemd."""
        from sparkguard import reload as reload_cmd
        d = reload_cmd.result_dir()
        try:
            os.makedirs(d, mode=0o755, exist_ok=True)
            self._reload_record = {"pid": os.getpid(), "starttime": reload_cmd.starttime(), "generation": 0,
                                   "started_usec": 0, "ok": None, "error": "", "config_path": self.cfg.path}
            reload_cmd.write_result(d, self._reload_record)
            self._reload_dir = d
        except OSError as e:
            log.warning("cannot write the reload result in %s (%s): `sparkguard reload` will get no answer",
                        d, e.strerror or e)

    def _reload_result(self, started_usec: int, ok: bool, error: str) -> None:
        """Record a reload's result (a tiny file on tmpfs; never raises)."""
        self._reloads_done += 1
        if self._reload_dir is None:
            return
        from sparkguard import reload as reload_cmd
        try:
            reload_cmd.write_result(self._reload_dir, dict(
                self._reload_record, generation=self._reloads_done, started_usec=started_usec, ok=ok,
                error=error, config_path=self.cfg.path))
        except OSError as e:
            log.warning("cannot write the reload result in %s: %s", self._reload_dir, e.strerror or e)

    def _shutdown(self) -> int:
        self._stop_supervisor()
        if self.recorder is not None and self.recorder.incident is not None:
            self._close_incident(time.monotonic(), self.value, recovered=self.value >= self.cfg.guard.term_below,
                                 stopped=True)
        if self.linkwatch is not None:
            self.linkwatch.stop()
        if self.reporter is not None:
            self.reporter.close()
        if self.metrics is not None:
            try:
                self.metrics.stop()
            except Exception:  # noqa: BLE001 - shutting down anyway
                pass
        log.info("stopped")
        return 0

    # ---- engine supervisor hooks (issue 5; sparkguard.supervisor runs in its own threads) ----------

    def _start_supervisor(self) -> None:
        """Start supervising ``engine:`` when configured.  Raises OSError (control socket)."""
        if not self.cfg.engine.enabled:
            return
        from sparkguard import supervisor
        self.supervisor = supervisor.Supervisor(self.cfg, self.reporter, count_incident=self.recorder.count)
        self.recorder.supervisor = self.supervisor
        self.supervisor.start()
        register = getattr(self.metrics, "register_collector", None)
        if register is not None:
            register(self.supervisor.collector())

    def _engine_target(self, procs):
        """The supervised engine's tree (the guard's first target), or None."""
        if self.supervisor is None:
            return None
        return self.supervisor.target(procs, self.protector, details=False)

    def _reload_supervisor(self, cfg) -> None:
        if self.supervisor is not None and cfg.engine.enabled:
            self.supervisor.reload(cfg)
        elif cfg.engine.enabled != (self.supervisor is not None):
            log.warning("engine: section added or removed: takes effect after a restart")

    def _link_to_supervisor(self, inc: dict) -> None:
        """``link.mark_unhealthy``: a link incident marks the engine unhealthy; its end restarts it."""
        if self.supervisor is not None and self.cfg.link.mark_unhealthy:
            self.supervisor.link_event(inc.get("outcome") == "link_down", str(inc.get("summary") or ""))

    def _stop_supervisor(self) -> None:
        """Stop the engine (SIGTERM, grace, SIGKILL) before the daemon exits."""
        if self.supervisor is not None:
            self.supervisor.stop()

    def snapshot(self) -> dict:
        """Current state for metrics/status (see TEAM interface); cheap, any thread."""
        g = self.cfg.guard
        mono_now = time.monotonic()
        total = self.reader.mem_total if self.reader else 0
        swap_total = self.reader.swap_total if self.reader else 0
        victim = self.target      # read once: the loop may clear it between two reads
        rec = self.recorder
        return {
            "available_bytes": self.avail, "total_bytes": total, "swap_free_bytes": self.swap_free,
            "swap_total_bytes": swap_total, "signal": g.signal,
            # the idle fast path refreshes avail only: with signal "available" it is the value
            "signal_bytes": self.avail if g.signal == "available" else self.value,
            "term_below_bytes": g.term_below, "kill_below_bytes": g.kill_below, "grace_seconds": g.grace,
            "poll_interval_seconds": g.poll_interval, "state": self.policy.state, "dry_run": g.dry_run,
            "signals_sent": dict(self.signals_sent),
            "incidents": dict(rec.counts) if rec is not None else {},
            "last_incident_timestamp": rec.last_incident if rec is not None else None, "poll_count": self.poll_count,
            "poll_seconds_sum": self.poll_sum, "polls_total": self.poll_count + self.fast_polls,
            "last_poll_timestamp": time.time() - (mono_now - self.last_poll) if self.last_poll else None,
            "started_timestamp": self.started, "config_path": self.cfg.path,
            "config_reloads": dict(self.reloads),
            "notify_dropped": self.notifier.dropped if self.notifier else 0,
            "log_dropped": getattr(logq._log_handler, "dropped", 0),
            "blind": bool(self.notifier and self.notifier.blind),
            "victim": {"pid": victim.root_pid, "title": victim.title} if victim is not None else None,
            "proc_view": self.proc_view,
            "metrics": self.metrics.state() if self.metrics is not None else None,
        }


def _fmt_size(n) -> str:
    from sparkguard.units import format_size
    return format_size(n) if n is not None else "off"


"""The guard's actions: choose the victim, SIGTERM it, SIGKILL its tree, record each step.

The poll loop hands :meth:`Actions.act` the actions :meth:`sparkguard.policy.Policy.step`
returned; this module carries them out, signal first and report after (the recorder's reads
come once the signal is out).  Everything here runs on the poll-loop thread.
"""

from __future__ import annotations

import logging
import re
import select
import time

from sparkguard import armed, enginetree, policy, proctree, signals
from sparkguard.guard import cgkill, escalation
from sparkguard.supervisor import container
from sparkguard.units import format_size

log = logging.getLogger("sparkguard")


class Actions:
    """The victim of the open incident and what was sent to it.

    Args:
        cfg: ``config.Config`` in force (the loop replaces ``cfg`` and ``protector`` on a reload).
        pol: the loop's ``policy.Policy``.
        engine: :class:`sparkguard.guard.engine.Engine` (the supervised engine is the first target).
        poller: the loop's ``select.poll``: the victim's pidfds are registered in it (POLLIN on exit).
    Attributes:
        recorder: ``recorder.Recorder``, set once it exists (after the first arming).
        target: ``enginetree.Target`` of the victim, or None; esc: its ``escalation.Escalation``
            (shared with the supervisor when it stops the same tree), or None; tree: ``esc.tree``.
        tree_fds: set[int], the victim's pidfds registered in ``poller``.
        signals_sent: ``{"SIGTERM": n, "SIGKILL": n}`` since the start.
        armed: ``armed.Armed``, the target chosen before the crossing.
        victims: :class:`sparkguard.guard.cgkill.VictimCgroups`, the guard's own cgroups for a
            victim in no cgroup of its own (set by :meth:`warm_up`; None before).
        pcp_free: int, the most bytes the loop saw on the kernel's per-CPU free lists while waiting
            for memory (:mod:`sparkguard.pcp`; 0 when not read), named in the incident's closing event.
    """

    def __init__(self, cfg, pol: policy.Policy, engine, poller):
        self.cfg = cfg
        self.policy = pol
        self.engine = engine
        self.poller = poller
        self.recorder = None
        self.protector = enginetree.Protector(cfg.targets.protect)
        self.target = None
        self.esc = None
        self.tree = None
        self.tree_fds: set[int] = set()
        self._killed: set[int] = set()
        self.signals_sent = {"SIGTERM": 0, "SIGKILL": 0}
        self.pcp_free = 0
        self.armed = armed.Armed(self.scan_choice, policy.FILL_RATE, matches=matcher(cfg.targets))
        self._armed_for = cfg.targets
        self.victims: cgkill.VictimCgroups | None = None

    def warm_up(self) -> None:
        """Find where victim cgroups are made and make the first (:class:`sparkguard.guard.cgkill.VictimCgroups`);
        arm the first target (one /proc pass, touching, hence locking, the search's and the
        pidfd code's pages) and log it."""
        self.victims = cgkill.VictimCgroups.find()
        self.victims.remove_stale()
        self.victims.ready()
        log.info("a target in no cgroup of its own is moved, before its SIGTERM, into a cgroup under: %s",
                 self.victims.why if self.victims.parent is not None else
                 f"{self.victims.why} (its SIGKILL goes through pidfds alone)")
        self.armed.refresh()
        t = self.armed.target
        if t is not None:
            log.info("targets now: %s (pid %d, %d processes), armed", t.title, t.root_pid, len(t.pids))
        else:
            log.info("no process matches targets.match right now")

    def arm(self, now: float, headroom: int, far: int) -> None:
        """The full pass's hook in the OK state: keep the armed target fresh (:mod:`sparkguard.armed`);
        a reload that changed ``targets`` drops the armed choice first (one of the same patterns keeps
        it: a SIGHUP storm must not leave every crossing to a full scan).  ``far``: bytes of headroom
        (poll interval x ``policy.FILL_RATE``) below which the loop polls faster; below it the armed
        tree's own changes are followed at ``armed.SMALL_DUTY``."""
        if self.cfg.targets is not self._armed_for:
            if self.cfg.targets != self._armed_for:     # a reload of the same patterns keeps the choice
                self.armed.reset(matcher(self.cfg.targets))
            self._armed_for = self.cfg.targets
        self.armed.tick(now, headroom, far)

    def victim_gone(self) -> bool:
        """True once every member of the victim's tree has exited (never in a dry run)."""
        if self.tree is None or self.policy.dry_run:
            return False
        return self.tree.gone()

    def act(self, actions: tuple[str, ...], now: float, value: int) -> None:
        """Carry out ``actions`` (``policy`` constants, in order) at ``now`` (monotonic s) with the
        signal at ``value`` bytes."""
        rec = self.recorder
        for a in actions:
            if a == policy.CROSSED:
                rec.open(now, value, self.cfg.guard, self.policy.fired)
            elif a in (policy.TERM, policy.RETRY_TARGET):
                self._term(now, value, retry=a == policy.RETRY_TARGET)
            elif a == policy.KILL:
                self._kill(now, value)
            elif a == policy.EXITED:
                rec.event(now, value, "exited", self.tree.root and [self.tree.root] or [],
                          f"victim tree gone {now - self.policy.t_term:.2f}s after SIGTERM")
            elif a in (policy.RECOVERED, policy.GAVE_UP_WAITING):
                self.close_incident(now, value, recovered=a == policy.RECOVERED)
            elif a == policy.UNKILLABLE:
                alive = self.tree.alive() if self.tree is not None else []
                rec.event(now, value, "unkillable", alive,
                          f"{len(alive)} processes still alive {self.policy.thresholds.kill_give_up:g}s after "
                          "the first SIGKILL (uninterruptible sleep in a driver?); giving up on them")
                self.close_incident(now, value, recovered=False)

    def failed(self, actions: tuple[str, ...], now: float) -> None:
        """An action raised: log it with the traceback and keep guarding.  Without a victim tree
        the policy waits in NO_TARGET, which searches for a target again every second."""
        log.exception("acting on %s failed; the guard keeps running", ",".join(actions))
        if self.tree is None and self.policy.state in (policy.TERM_SENT, policy.KILL_SENT):
            self.policy.no_target(now)

    def scan_choice(self, procs: dict | None = None):
        """One /proc pass: ``(target, procs, ambiguous)``: the target with its tree rows read, or
        None when nothing matches; the whole scan; and whether the choice could change without a
        process being created (:func:`sparkguard.enginetree.ambiguous`: ranked by memory among
        several trees of one pattern, or the oom_score fallback).  The supervised engine comes
        first, then ``targets.match``.

        ``procs``: instead of the pass, the matching processes and their trees
        (:meth:`sparkguard.armed.Armed.fresh`); None is returned where they cannot decide: a
        supervised engine (its tree is its process group, members anywhere in /proc), or
        ``targets.fallback: oom_score`` with nothing matching (every process is a candidate)."""
        view = procs is not None
        if view and self.engine.supervisor is not None:
            return None
        procs = proctree.scan() if procs is None else procs
        target = self.engine.target(procs, self.protector)
        ambiguous = False
        if target is None:
            targets = enginetree.find_targets(self.cfg.targets, procs=procs, details=False)
            if view and (not targets or targets[0].pattern == enginetree.FALLBACK_PATTERN) \
                    and self.cfg.targets.fallback == "oom_score":
                return None
            if not targets:
                return None, procs, False
            target = targets[0]
            ambiguous = enginetree.ambiguous(targets)
            try:        # an engine in a container: its cgroup's processes and its name
                container.widen(target, procs, self.protector)
            except Exception:  # noqa: BLE001 - the container's extras never cost the SIGTERM
                log.exception("reading the target's container failed; signalling its process tree")
        # the chosen tree's RSS/swap/oom_score rows before any signal: after SIGTERM vLLM's children
        # are gone within milliseconds; one tree's reads cost about a millisecond
        enginetree.add_details(target, procs)
        return target, procs, ambiguous

    def _choose(self):
        """``(target, tree, armed)``: the armed target when its root is alive, the choice was not
        ambiguous (:meth:`sparkguard.armed.Armed.take`) and the supervised engine (the first
        target) has not changed since it was armed, with no /proc pass; else the choice among the
        matching trees after a look at the new processes (:meth:`sparkguard.armed.Armed.fresh`),
        no bystander read; else, where those cannot decide, the choice of one scan (its tree's
        pidfds opened now).  ``(None, None, False)`` when nothing matches."""
        if self.cfg.targets is not self._armed_for:
            if self.cfg.targets != self._armed_for:     # a reload changed targets since the last OK pass
                self.armed.reset(matcher(self.cfg.targets))
            self._armed_for = self.cfg.targets
        got = self.armed.take()
        if got is not None:
            target, tree, _ = got
            engine_pid = self.engine.root_pid()
            # the supervised engine armed before its container or cgroup was known lacks their
            # members: chosen again from a scan
            if engine_pid is None or (engine_pid == target.root_pid and self.engine.cgroups() <= set(target.cgroups)):
                return target, tree, True
            tree.close()
        got = self.armed.fresh()
        if got is not None:
            return got[0], got[1], False
        target = self.scan_choice()[0]
        if target is None:
            return None, None, False
        return target, cgkill.tree_for(target), False

    def _watch(self, skip: set[int] = frozenset()) -> None:
        """Register the victim's pidfds in the loop's poll set, but those of the pids in ``skip``."""
        for pid, fd in list(self.tree.fds.items()):
            if pid not in skip:
                self.poller.register(fd, select.POLLIN)
                self.tree_fds.add(fd)

    def _term(self, now: float, value: int, retry: bool = False) -> None:
        rec = self.recorder
        target, tree, armed = self._choose()
        if target is None:
            if not retry:
                rec.fill(None)
                rec.event(now, value, "no_target", [], "nothing matches targets.match"
                          + (" and fallback is off" if self.cfg.targets.fallback == "off" else ""))
            self.policy.no_target(now)
            return
        self.target = target
        dry = self.policy.dry_run
        enclosed = None
        if not dry and type(tree) is signals.Tree and self.victims is not None:
            # in no cgroup of its own: into one of the guard's before the SIGTERM, so that nothing
            # it forks from now on (double fork, setsid) escapes the SIGKILL (guard.cgkill)
            # (stopped while it moves: cgkill.enclose; continued once its SIGTERM is queued)
            path = self.victims.take()
            t_enc = time.monotonic()
            enclosed = cgkill.enclose(tree, path, self.protector) if path is not None else None
            t_enc = time.monotonic() - t_enc
            tree = enclosed or tree
        try:
            # one escalation per tree: when the supervisor is already stopping it (wedged, stop, lane)
            # this joins it: no second SIGTERM (uvicorn force-exits on one), the grace from its SIGTERM
            self.esc, joined = escalation.OWNER.request(tree, "memory", self.cfg.guard.grace, dry_run=dry)
        finally:
            if enclosed is not None:
                cgkill.resume(enclosed)
        self.tree = self.esc.tree
        sent = False
        if dry:
            rec.event(now, value, "would_term", [target.root_pid], f"dry run: would SIGTERM {target.title}")
        else:
            sent = self.esc.sent and not joined
            t_sig = time.monotonic()      # the event's time is the signal's, not the sample's
            if sent:
                self.signals_sent["SIGTERM"] += 1
            self._watch()
        if armed:
            # act first, report after: the armed rows (read when it was armed) are re-read now;
            # members already gone keep their armed figures
            enginetree.refresh_details(target)
        container.retitle(target)     # after the signal: the container's name, if docker answered meanwhile
        if retry:
            self.policy.target_found(now)
        if joined or sent:      # the grace runs from the SIGTERM, not from the sample that crossed
            self.policy.term_sent_at(self.esc.t_term)
        if not dry:
            rec.event(t_sig, value, "sigterm", [target.root_pid],
                      f"SIGTERM {target.title} (pid {target.root_pid}, {len(target.pids)} processes, "
                      f"{format_size(target.mem_bytes)} RSS+swap)" +
                      (f" [not sent again: the supervisor is already stopping it ({self.esc.reason})]" if joined
                       else "" if sent else " [already gone]"))
        if enclosed is not None:
            log.info("victim %s stopped (SIGSTOP) and moved into cgroup %s in %.1f ms before its SIGTERM "
                     "(%d processes)", target.title, enclosed.cgroups[0], t_enc * 1000, len(enclosed.fds))
        rec.fill(target)

    def _kill(self, now: float, value: int) -> None:
        if self.tree is None:
            return
        if self.policy.dry_run:
            self.recorder.event(now, value, "would_kill", list(self.tree.fds), "dry run: would SIGKILL the tree")
            return
        before = set(self.tree.fds)
        pids = escalation.OWNER.kill(self.esc, self.protector)
        t_sig = time.monotonic()
        self._watch(skip=before)
        self.signals_sent["SIGKILL"] += len(pids)
        new = [pid for pid in pids if pid not in self._killed]
        self._killed.update(pids)
        if not new:          # a repeated sweep of the same lingering processes: counted, not re-reported
            return
        pids = new
        g = self.cfg.guard
        why = "below the SIGKILL line" if (g.kill_below is not None and value < g.kill_below
                                          and now - self.policy.t_term < g.grace) else \
            f"still alive {now - self.policy.t_term:.1f}s after SIGTERM (grace {g.grace:g}s)"
        how = getattr(self.tree, "how", "")     # a cgroup's tree (guard.cgkill): cgroup.kill, freeze or pidfd
        self.recorder.event(t_sig, value, "sigkill", pids, f"SIGKILL {len(pids)} processes: {why}"
                            + (f" (through {how})" if how and how != "pidfd" else ""))

    def close_incident(self, now: float, value: int, recovered: bool, stopped: bool = False) -> None:
        """End the open incident (:meth:`sparkguard.recorder.Recorder.close`); release the victim's
        pidfds whatever happens while reporting.  ``stopped``: the daemon is stopping with the incident
        still open."""
        try:
            t_drain = self.policy.t_drain
            self.recorder.close(now, value, self.cfg.guard, self.policy.dry_run, recovered, stopped,
                                pcp_free=self.pcp_free, drained=None if t_drain is None else now - t_drain)
        finally:
            self.pcp_free = 0
            if self.tree is not None:
                for fd in list(self.tree_fds):
                    try:
                        self.poller.unregister(fd)
                    except KeyError:
                        pass
                self.tree_fds.clear()
                escalation.OWNER.release(self.esc)
            if self.victims is not None:
                self.victims.tidy()     # the victim's cgroup once empty; a new spare
            self.esc = None
            self.tree = None
            self.target = None
            self._killed.clear()
            self.policy.dry_run = self.cfg.guard.dry_run   # a dry_run change deferred by a reload


def matcher(targets_cfg):
    """``targets_cfg.match`` (``config.TargetsConfig``) as a test of one ``proctree.Proc``: whether
    its cmdline matches a pattern (as :func:`sparkguard.enginetree.find_targets` ranks them);
    the look at new processes (:mod:`sparkguard.armed`) keeps those."""
    regexes = [re.compile(p) for p in targets_cfg.match]
    return lambda p: bool(p.cmdline) and any(r.search(p.cmdline) for r in regexes)

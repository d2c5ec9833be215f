"""The one escalation: never two SIGTERMs, one grace clock, SIGKILL once after the grace.

The clock is a fake where the test is about time; the processes are real children of this test
that count the SIGTERMs they receive (each one a line on their stdout), all reaped at the end."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import threading
import time

import pytest

from sparkguard import enginetree, policy, signals
from sparkguard.guard import escalation

COUNTER = ("import signal, sys, time\n"
           "signal.signal(signal.SIGTERM, lambda *a: (sys.stdout.write('TERM\\n'), sys.stdout.flush()))\n"
           "print('ready', flush=True)\n"
           "while True: time.sleep(1)\n")


class Clock:
    """A monotonic clock the test moves by hand (seconds)."""

    def __init__(self, t: float = 100.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def stubborn():
    """``start()``: a child that ignores SIGTERM and prints ``TERM`` for each one it gets;
    ``terms(p)``: how many it has printed so far.  Every child is killed and reaped afterwards."""
    procs: list[subprocess.Popen] = []

    def start() -> subprocess.Popen:
        p = subprocess.Popen([sys.executable, "-c", COUNTER], stdout=subprocess.PIPE)
        assert p.stdout.readline() == b"ready\n"
        os.set_blocking(p.stdout.fileno(), False)
        procs.append(p)
        return p

    yield start
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()
        p.stdout.close()


def terms(p: subprocess.Popen, settle: float = 0.3) -> int:
    """SIGTERMs the child has reported, after waiting ``settle`` seconds for late ones."""
    time.sleep(settle)
    out = b""
    while select.select([p.stdout], [], [], 0)[0]:
        chunk = p.stdout.read()
        if not chunk:
            break
        out += chunk
    terms.seen[p.pid] = terms.seen.get(p.pid, 0) + out.count(b"TERM\n")
    return terms.seen[p.pid]


terms.seen = {}


def tree_of(p: subprocess.Popen) -> signals.Tree:
    return signals.Tree([p.pid], {})


def test_two_requests_send_one_sigterm_and_the_second_joins_the_first(stubborn):
    p = stubborn()
    s = escalation.Stopper(Clock())
    first, joined1 = s.request(tree_of(p), "wedged", 10.0)
    second_tree = tree_of(p)
    second, joined2 = s.request(second_tree, "memory", 5.0)
    assert (joined1, joined2) == (False, True)
    assert second is first and second.reason == "wedged" and second.grace == 10.0
    assert not second_tree.fds, "the joiner's own pidfds are closed"
    assert first.sent
    assert terms(p) == 1
    s.release(second)
    assert first.tree.fds, "still held by the first"
    s.release(first)
    assert not first.tree.fds, "the last release closes the tree"


def test_the_grace_runs_from_the_first_sigterm(stubborn):
    p = stubborn()
    clock = Clock(100.0)
    s = escalation.Stopper(clock)
    esc, _ = s.request(tree_of(p), "wedged", 10.0)
    clock.t = 104.0
    joined, was_running = s.request(tree_of(p), "memory", 10.0)
    assert was_running and joined.t_term == 100.0
    assert joined.grace_left(clock.t) == pytest.approx(6.0)
    assert joined.grace_left(110.0) == 0.0
    s.release(joined)
    s.release(esc)


def test_the_guard_joining_keeps_the_first_grace_and_kill_below_cuts_it_short(stubborn):
    """The guard's policy decides its SIGKILL: joined, its grace runs from the supervisor's
    SIGTERM; below kill_below it does not wait for the grace at all."""
    p = stubborn()
    clock = Clock(100.0)
    s = escalation.Stopper(clock)
    sup, _ = s.request(tree_of(p), "wedged", 10.0)
    line, kill_below = 10 * 2**30, 5 * 2**30
    pol = policy.Policy(policy.Thresholds(term_below=line, kill_below=kill_below, grace=10.0))
    assert pol.step(104.0, line - 1) == (policy.CROSSED, policy.TERM)
    guard, joined = s.request(tree_of(p), "memory", 10.0)
    assert joined
    assert terms(p) == 1
    pol.term_sent_at(guard.t_term)
    assert pol.step(109.9, line - 1) == ()
    assert pol.step(110.0, line - 1) == (policy.KILL,), "the grace of the first SIGTERM, not 114"
    cut = policy.Policy(policy.Thresholds(term_below=line, kill_below=kill_below, grace=10.0))
    cut.step(104.0, line - 1)
    cut.term_sent_at(guard.t_term)
    assert cut.step(104.2, kill_below - 1) == (policy.KILL,)
    assert s.kill(guard) == [p.pid]
    assert p.wait(5) == -signal.SIGKILL
    s.release(guard)
    s.release(sup)


def test_dry_run_sends_nothing_and_is_never_joined(stubborn):
    p = stubborn()
    s = escalation.Stopper(Clock())
    dry, joined = s.request(tree_of(p), "memory", 10.0, dry_run=True)
    assert not joined and not dry.sent
    assert s.kill(dry) == [p.pid], "the members it would kill"
    assert terms(p) == 0 and p.poll() is None
    real, joined = s.request(tree_of(p), "wedged", 10.0)
    assert not joined and real is not dry
    assert terms(p) == 1
    s.release(dry)
    s.release(real)


def test_a_tree_that_ignores_sigterm_gets_one_sigkill_after_the_grace(stubborn):
    p = stubborn()
    s = escalation.Stopper()
    notes = []
    t0 = time.monotonic()
    esc, killed = s.stop(tree_of(p), "stop", 0.5, note=lambda ev, e, pids: notes.append((ev, list(pids))))
    took = time.monotonic() - t0
    assert p.wait(5) == -signal.SIGKILL
    assert killed == [p.pid] and notes == [("sigterm", []), ("sigkill", [p.pid])]
    assert took >= 0.5
    assert terms(p) == 1
    assert not esc.tree.fds
    again, joined = s.request(tree_of(stubborn()), "stop", 0.5)
    assert not joined, "a finished escalation is not joined"
    s.release(again)


def test_a_waiting_thread_joins_the_guards_escalation_and_keeps_its_clock(stubborn):
    """The guard (poll loop) SIGTERMed; the supervisor's shutdown joins: no second SIGTERM, and
    the SIGKILL comes at the guard's grace, not a fresh one."""
    p = stubborn()
    s = escalation.Stopper()
    guard, _ = s.request(tree_of(p), "memory", 0.8)
    t_first = guard.t_term
    time.sleep(0.3)
    out = {}

    def supervisor():
        out["esc"], out["killed"] = s.stop(tree_of(p), "shutdown", 30.0)
        out["at"] = time.monotonic()
    t = threading.Thread(target=supervisor)
    t.start()
    t.join(10)
    assert out["esc"] is guard and out["killed"] == [p.pid]
    assert 0.8 <= out["at"] - t_first < 5.0
    assert p.wait(5) == -signal.SIGKILL
    assert terms(p, settle=0) == 1
    assert guard.tree.fds, "the guard still holds it"
    s.release(guard)
    assert not guard.tree.fds


def test_a_tree_that_exits_on_sigterm_is_not_killed():
    p = subprocess.Popen(["sleep", "30"])
    try:
        s = escalation.Stopper()
        esc, killed = s.stop(tree_of(p), "stop", 5.0)
        assert killed == [] and esc.sent
        assert p.wait(5) == -signal.SIGTERM
    finally:
        if p.poll() is None:
            p.kill()
        p.wait()


def test_the_poll_loop_never_waits_behind_a_kill_pass_in_another_thread(stubborn):
    """While the supervisor's thread is inside a SIGKILL pass (held here inside its protector
    check), the guard's kill of the same tree and a request for another tree return at once."""
    p, other = stubborn(), stubborn()
    s = escalation.Stopper()
    inside, go = threading.Event(), threading.Event()

    class Held(enginetree.Protector):
        def protected(self, proc):
            inside.set()
            go.wait(10)
            return False
    esc, _ = s.request(tree_of(p), "wedged", 0.0)
    t = threading.Thread(target=s.kill, args=(esc, Held(())))
    t.start()
    try:
        assert inside.wait(5)
        t0 = time.monotonic()
        assert s.kill(esc) == [], "a pass already runs: nothing sent, no wait"
        other_esc, joined = s.request(tree_of(other), "memory", 5.0)
        assert time.monotonic() - t0 < 0.5 and not joined
        s.release(other_esc)
    finally:
        go.set()
        t.join(10)
    assert p.wait(5) == -signal.SIGKILL
    s.release(esc)

"""The loop's idle fast path (``Guard.loop``): far above the line the guard polls through a lean
inline read, and must still see a fill coming, answer signals, ping the watchdog on time and
poll five times a second.  Real daemon, real /proc/meminfo, real fake-vLLM trees and memory."""

from __future__ import annotations

import math
import os
import signal
import time
import urllib.request

import pytest

from conftest import line_below_now, mem_available, settled_mem_available
from guardrun import GuardProc, unique
from supervisor_helpers import free_port
from test_guard_incidents import events, filling_engine, wait_incident

GiB = 1024**3
MiB = 1024**2
POLL = 0.05                   # guard.poll_interval of the fill test: keeps FAR (and the fill) small
FAR = int(POLL * 32 * GiB)    # poll_interval * policy.FILL_RATE: above this headroom the fast path runs


def _caught_at_the_line(engine_factory, line: int, poll: float, near: int) -> None:
    """A fake vLLM fills past ``line`` under a guard polling every ``poll`` s: the guard SIGTERMs
    the tree at once, MemAvailable at the crossing within ``near`` bytes under the line."""
    fe = filling_engine(engine_factory, fill=mem_available() - line + GiB)
    g = GuardProc({"guard": {"term_below": line, "grace": "20s", "poll_interval": poll},
                   "targets": {"match": [rf"vllm serve {fe.model}\b"]}})
    try:
        g.wait_ready()
        pids = fe.pids()
        fe.start_fill()
        inc = wait_incident(g, timeout=60)
        assert fe.wait_gone(pids, timeout=10)
        assert events(inc)[:2] == ["crossed", "sigterm"]
        crossed, sigterm = inc["timeline"][0], inc["timeline"][1]
        assert line - near < crossed["available_bytes"] < line, crossed
        assert sigterm["pids"] == [fe.top_pid] and sigterm["t"] < 1.0
        assert inc["outcome"] == "terminated"
    finally:
        g.stop()


def test_a_fill_that_starts_on_the_fast_path_is_caught_at_the_line(engine_factory):
    # the line sits well beyond FAR below MemAvailable: the guard idles on the fast path
    # until the fill brings MemAvailable within FAR, then polls faster and SIGTERMs at the line
    # (seen within one short poll of it)
    _caught_at_the_line(engine_factory, line_below_now(FAR + GiB), POLL, 512 * MiB)


def test_a_fill_that_starts_on_the_free_memory_check_is_caught_at_the_line(engine_factory):
    # the line far enough under MemFree that the guard idles on the free-memory check (MemFree at
    # least the floor + twice the deficit bound + one poll interval's fill: freepages.FreeFloor):
    # the fill ends it when MemFree reaches floor + 2 x the bound, and the full passes take it from there
    from sparkguard import freepages, meminfo
    from sparkguard.guard.idle import FREE_FIELDS
    if not freepages.glibc_ok():
        pytest.skip("sysconf(_SC_AVPHYS_PAGES) is not glibc's here: no free-memory check")
    poll = 0.02
    far = int(poll * 32 * GiB)
    settled_mem_available()
    r = meminfo.MeminfoReader()
    fields = {k: r.last(k) for k in FREE_FIELDS}
    r.close()
    line = fields[meminfo.MEMFREE_LABEL] - 2 * freepages.deficit(fields) - 2 * far - GiB // 2
    if mem_available() - line > 5 * GiB:
        pytest.skip(f"the page cache and reserve put the line {(mem_available() - line) / GiB:.1f} GiB "
                    "under MemAvailable: more than this test fills")
    _caught_at_the_line(engine_factory, line, poll, 256 * MiB)


def test_signals_are_answered_while_idling_on_the_fast_path():
    # no watchdog: nothing shortens the fast path, the guard sleeps on an empty poll set
    name = unique()
    g = GuardProc({"guard": {"term_below": "0.6GiB"}, "targets": {"match": [f"^{name}$"]}})
    try:
        g.wait_ready()
        g.write_config({**g.cfg, "guard": {"term_below": "0.7GiB"}})
        t0 = time.monotonic()
        g.proc.send_signal(signal.SIGHUP)
        g.notify.wait_for(lambda m: m.get("RELOADING") == "1", timeout=5)
        g.notify.wait_for(lambda m: "SIGTERM line 0.70 GiB" in m.get("STATUS", ""), timeout=5)
        assert time.monotonic() - t0 < 2.0           # within a poll interval or two, not a full pass
        t0 = time.monotonic()
        g.proc.send_signal(signal.SIGTERM)
        g.notify.wait_for(lambda m: m.get("STOPPING") == "1", timeout=5)
        assert g.proc.wait(10) == 0
        assert time.monotonic() - t0 < 2.0
    finally:
        g.stop()


def test_watchdog_pings_stay_on_time_with_the_fast_path():
    # WatchdogSec=1.2s: a ping every 0.6 s; the fast path (up to 10 s) sends each one by its due time
    name = unique()
    g = GuardProc({"guard": {"term_below": "0.6GiB"}, "targets": {"match": [f"^{name}$"]}},
                  watchdog_usec=1_200_000)
    try:
        g.wait_ready()
        g.notify.wait_for(lambda m: m.get("WATCHDOG") == "1", timeout=5)
        last = time.monotonic()
        gaps = []
        while len(gaps) < 6:
            g.notify.wait_for(lambda m: m.get("WATCHDOG") == "1", timeout=5)
            now = time.monotonic()
            gaps.append(now - last)
            last = now
        # systemd kills at 1.2 s without a ping; half of it is the schedule, a poll of slack allowed
        assert max(gaps) < 0.95, gaps
    finally:
        g.stop()


def test_idle_polls_five_times_a_second_and_the_metrics_count_them():
    name = unique()
    port = free_port()
    g = GuardProc({"guard": {"term_below": "0.6GiB"}, "targets": {"match": [f"^{name}$"]},
                   "metrics": {"listen": f"127.0.0.1:{port}"}})

    def scrape() -> dict[str, float]:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            text = r.read().decode()
        return {ln.split()[0]: float(ln.split()[1]) for ln in text.splitlines()
                if ln.startswith(("sparkguard_poll", "sparkguard_last_poll")) and not ln.startswith("#")}

    try:
        g.wait_ready()
        g.wait_log("metrics on")
        a, t0 = scrape(), time.monotonic()
        # a rate needs an interval, and one full pass (every 10 s while idle) must fall in it:
        # 12 s of polling, waited out on the guard's own notify socket
        # the last poll's timestamp stays fresh on the fast path, which reads the clock only
        # once per batch of polls (at most a second of polls, guard/idle.py): checked at each scrape
        end = t0 + 12.0
        ages = []
        while time.monotonic() < end:
            g.notify.recv(max(0.01, min(1.0, end - time.monotonic())))
            ages.append(time.time() - scrape()["sparkguard_last_poll_timestamp_seconds"])
        assert len(ages) >= 8 and max(ages) < 0.7, ages
        b, t1 = scrape(), time.monotonic()
        rate = (b["sparkguard_polls_total"] - a["sparkguard_polls_total"]) / (t1 - t0)
        assert 4.0 <= rate <= 5.5, rate                           # poll_interval 0.2 s: 5 a second
        timed = b["sparkguard_poll_duration_seconds_count"] - a["sparkguard_poll_duration_seconds_count"]
        assert 0 < timed < 0.5 * (b["sparkguard_polls_total"] - a["sparkguard_polls_total"])  # mostly fast path
    finally:
        g.stop()


def test_an_idle_poll_calls_due_from_the_pings_send_time_and_leaves_the_black_box_to_full_passes():
    from types import SimpleNamespace as NS
    from sparkguard.guard import idle, view
    g = NS(notifier=NS(watchdog_interval=None), ring=NS(next_at=100.3))
    assert idle.next_due(g, 0.2) == math.inf                      # no watchdog: no call, a record due or not
    g.notifier = NS(watchdog_interval=2.5, next_ping=100.6)        # sent one interval early
    assert abs(idle.next_due(g, 0.2) - 100.4) < 1e-9
    # the snapshot's last poll: the last mark plus one interval per poll counted since,
    # never later than now; a loop that stops counting goes stale; 0.0 before any poll
    g = NS(poll_mark=(50.0, 7), fast_polls=10, cfg=NS(guard=NS(poll_interval=0.2)))
    assert abs(view.last_poll(g, 51.0) - 50.6) < 1e-9
    assert view.last_poll(g, 50.3) == 50.3
    assert abs(view.last_poll(g, 90.0) - 50.6) < 1e-9
    g.poll_mark = (0.0, 0)
    assert view.last_poll(g, 90.0) == 0.0


def meminfo_text(kb: int) -> bytes:
    """A /proc/meminfo text with MemAvailable ``kb`` laid out as the kernel prints it."""
    return b"MemTotal:       %8d kB\nMemFree:        %8d kB\nMemAvailable:   %8d kB\nBuffers: 0 kB\n" % (
        130000000, 5, kb)


def lay(view: list, text: bytes) -> int:
    """What ``os.preadv(fd, view, 0)`` does with a file holding ``text``: fill the buffers in
    order; the bytes read."""
    done = 0
    for b in view:
        b[:] = text[done:done + len(b)]
        done += len(b)
    return done


class _FakeIdle:
    """A Guard as guard.idle.run sees it, on a fake clock: each sleep advances it by the interval
    plus ``late`` s; ``answers`` scripts each read (True: a MemAvailable of 8 GiB, above the
    fast path's floor of 7 GiB; False: 6 GiB, below it), which the fake ``preadv`` lays into
    the buffers of a real meminfo.FastCheck as the kernel would."""

    def __init__(self, monkeypatch, answers, late=0.0, flag_at=None):
        from types import SimpleNamespace as NS
        from sparkguard import meminfo
        from sparkguard.guard import idle
        self.t, self.reads, self.sleeps, self.pings = 1000.0, 0, 0, []
        self.fast_polls, self.ring, self.actions, self.marks = 0, None, None, []
        self._mark = (0.0, 0)
        above, below = meminfo_text(8 << 20), meminfo_text(6 << 20)
        self._flags = set()
        self._fast = meminfo.fast_check(bytearray(above), len(above), 7 << 30)
        self.reader = NS(fd=-1)
        self.notifier = NS(watchdog_interval=2.5, next_ping=1000.0 + 2.5, watchdog=self._ping)

        def preadv(fd, view, off):
            self.reads += 1
            if self.reads == flag_at:
                self._flags.add(1)
            return lay(view, above if answers(self.reads) else below)

        def sleep(ms):
            self.sleeps += 1
            self.t += ms / 1000.0 + late

        self._idle_poll = sleep
        monkeypatch.setattr(idle.os, "preadv", preadv)
        monkeypatch.setattr(idle.time, "monotonic", lambda: self.t)

    @property
    def poll_mark(self):
        return self._mark

    @poll_mark.setter
    def poll_mark(self, mark):      # guard.idle.due notes each call here
        self.marks.append(mark)
        self._mark = mark

    def _ping(self, now):
        self.pings.append((self.t, self.notifier.next_ping))
        self.notifier.next_ping = now + self.notifier.watchdog_interval


def test_the_idle_fast_path_sleeps_after_every_poll_counts_only_good_reads_and_pings_on_time(monkeypatch):
    from types import SimpleNamespace as NS
    from sparkguard.guard import idle
    s = NS(interval=0.2, use_swap=False)
    for left in (1, 2, 3, 13, 49):
        g = _FakeIdle(monkeypatch, lambda i: True)
        idle.run(g, left, s)
        assert (g.reads, g.fast_polls, g.sleeps) == (left, left, left)      # the budget, each slept after
    g = _FakeIdle(monkeypatch, lambda i: i != 7)                        # a read below the floor
    idle.run(g, 49, s)
    assert (g.reads, g.fast_polls, g.sleeps) == (7, 6, 6)
    g = _FakeIdle(monkeypatch, lambda i: True, flag_at=3)               # a signal flagged
    idle.run(g, 49, s)
    assert (g.reads, g.fast_polls, g.sleeps) == (3, 2, 2)
    # 20 ms late at every wake-up, 5000 polls: the lateness never adds up (each ping within one
    # interval before and one wake-up's lateness after its time), and due() runs only at pings
    g = _FakeIdle(monkeypatch, lambda i: True, late=0.02)
    idle.run(g, 5000, s)
    assert len(g.pings) > 300 and all(due - 0.2 <= sent <= due + 0.02 + 1e-9 for sent, due in g.pings), g.pings[:5]
    assert len(g.marks) == len(g.pings)
    assert g.poll_mark[1] <= g.fast_polls == 5000

"""The idle fast path's free-memory check (sparkguard.freepages): the deficit bound against the
reserve the real kernel subtracts, the check's choice at a full pass, and the fast path's loop on
it (fake clock, scripted sysconf and reads; real sysconf)."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace as NS

import pytest

from sparkguard import freepages, meminfo, policy
from sparkguard.guard import idle
from test_guard_idle import lay, meminfo_text

PS = os.sysconf("SC_PAGE_SIZE")
GiB = 1024**3
MiB = 1024**2
LABELS = idle.FREE_FIELDS      # MemFree, MemAvailable, Active(file), Inactive(file), KReclaimable


def test_the_deficit_bound_is_memfree_plus_the_file_lru_and_kreclaimable_less_memavailable():
    text = (b"MemTotal:       16000000 kB\nMemFree:         4000000 kB\nMemAvailable:    9000000 kB\n"
            b"Active(file):    2000000 kB\nInactive(file):  3500000 kB\nKReclaimable:     600000 kB\n")
    f = {k: meminfo.field(text, k) for k in LABELS}
    assert freepages.deficit(f) == (4000000 + 2000000 + 3500000 + 600000 - 9000000) * 1024 + freepages.SKEW
    # MemAvailable at or above them all (no kernel prints it: its reserve is positive): no bound
    assert freepages.deficit({**f, meminfo.AVAIL_LABEL: 20 * GiB}) is None
    assert freepages.deficit({**f, meminfo.AVAIL_LABEL: (4000000 + 2000000 + 3500000 + 600000) * 1024}) is None
    for k in LABELS:                                          # a line missing: no bound
        assert freepages.deficit({**f, k: None}) is None


def _zoneinfo_reserve(z: bytes) -> tuple[int, int]:
    """(the kernel's totalreserve_pages, the sum of the zones' low watermarks) from /proc/zoneinfo:
    per zone min(managed, max(protection) + high) (mm/page_alloc.c calculate_totalreserve_pages)."""
    reserve = low = 0
    for zone in z.split(b"\nNode "):
        f = {ln.split()[0]: ln.split()[1] for ln in zone.split(b"\n") if len(ln.split()) == 2}
        prot = zone.split(b"protection: (")[1].split(b")")[0]
        reserve += min(int(f[b"managed"]), max(int(v) for v in prot.split(b",")) + int(f[b"high"]))
        low += int(f[b"low"])
    return reserve, low


def test_the_deficit_bound_of_the_real_kernel_covers_its_reserve_and_no_more_than_the_watermarks_beyond():
    # mm/show_mem.c si_mem_available: MemAvailable = MemFree - totalreserve + the file LRU and
    # KReclaimable, each less the smaller of half of it and the low watermarks; so the bound is
    # the reserve plus at most twice the low watermarks (plus the skew), read where two reads of
    # meminfo around zoneinfo agree (a quiet moment of this shared machine)
    for _ in range(200):
        a = meminfo.MeminfoReader()
        z = Path("/proc/zoneinfo").read_bytes()
        b = meminfo.MeminfoReader()
        same = a.raw() == b.raw()
        fields = {k: a.last(k) for k in LABELS}
        a.close()
        b.close()
        if same:
            break
    else:
        pytest.skip("meminfo never held still across a read of zoneinfo")
    reserve, low = _zoneinfo_reserve(z)
    u = freepages.deficit(fields) - freepages.SKEW
    assert reserve * PS <= u <= (reserve + 2 * low) * PS, (u // PS, reserve, low)
    assert fields[meminfo.AVAIL_LABEL] >= fields[meminfo.MEMFREE_LABEL] - u


def _pass(floor: int):
    """The real /proc/meminfo read now: (fields, MemTotal, the window check against ``floor``)."""
    r = meminfo.MeminfoReader()
    try:
        r.sample()
        return {k: r.last(k) for k in LABELS}, r.last(meminfo.MEMTOTAL_LABEL), r.fast_check(floor)
    finally:
        r.close()


@pytest.mark.skipif(not freepages.glibc_ok(), reason="sysconf(_SC_AVPHYS_PAGES) is not glibc's here")
def test_the_check_is_made_where_memfree_is_twice_the_deficit_and_a_slack_above_the_floor(caplog):
    ff = freepages.FreeFloor("/proc/meminfo")
    floor = GiB
    f, total, window = _pass(floor)
    free = f[meminfo.MEMFREE_LABEL]
    need = floor // PS + 2 * -(-freepages.deficit(f) // PS)
    if free < need * PS + 2 * GiB:
        pytest.skip("MemFree here is too close to the need for the check to be made")
    c = ff.check(floor, PS, 0.2, f, total, window)
    assert c == freepages.FreeCheck(os.sysconf_names["SC_AVPHYS_PAGES"], need, 5, window)
    assert os.sysconf(c.name) >= c.need
    assert ff.check(floor, PS, 0.02, f, total, window).every == 50      # once a second
    assert ff.check(floor, PS, 2.0, f, total, window).every == 1
    # not where MemFree is short of need + slack: the window check is made instead
    assert ff.check(floor, free - need * PS + GiB, 0.2, f, total, window) is None
    assert ff.check(floor, PS, 0.2, f, total, None) is None             # no window check, no fast path
    # nor where MemFree or MemTotal of the pass's read and sysconf disagree (another view of
    # memory, a sysinfo refused), said once in the log however many full passes find it so
    caplog.set_level("INFO", logger="sparkguard")
    for k in range(3):
        assert ff.check(floor, PS, 0.2, {**f, meminfo.MEMFREE_LABEL: free // 4 + k * PS}, total, window) is None
    assert ff.check(floor, PS, 0.2, f, total * 2, window) is None
    said = [r.getMessage() for r in caplog.records if "disagree" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("the idle fast path reads /proc/meminfo at every poll")
    assert ff.check(floor, PS, 0.2, {**f, freepages.LRU_LABELS[2]: None}, total, window) is None


def test_the_check_is_never_made_for_a_file_that_is_not_the_kernels_meminfo(tmp_path):
    ff = freepages.FreeFloor(str(tmp_path / "meminfo"))
    assert "not /proc/meminfo" in ff.off
    f, total, window = _pass(GiB)
    assert ff.check(0, 0, 0.2, f, total, window) is None


def test_glibc_of_this_machine_has_the_sysinfo_sysconf():
    lib = os.confstr("CS_GNU_LIBC_VERSION") or ""
    if not lib.startswith("glibc "):
        pytest.skip(f"not glibc: {lib!r}")
    assert freepages.glibc_ok()
    assert abs(os.sysconf("SC_AVPHYS_PAGES") * PS - meminfo.read()["MemFree"]) < GiB
    assert abs(os.sysconf("SC_PHYS_PAGES") * PS - meminfo.read()["MemTotal"]) < 64 * MiB


class _FreeIdle:
    """A Guard as guard.idle.run sees it on the free check, on a fake clock (each sleep is one
    interval): ``answers(i)`` scripts the i-th sysconf's free pages (None: the real call), and
    ``above(j)`` whether the j-th read shows MemAvailable above the floor (8 or 6 GiB against 7)."""

    def __init__(self, monkeypatch, need, every=5, answers=None, above=lambda j: True, flag_at=None):
        self.t, self.calls, self.reads, self.sleeps, self.fast_polls, self.pings = 1000.0, 0, 0, 0, 0, []
        self._flags, self.poll_mark = set(), (0.0, 0)
        up, down = meminfo_text(8 << 20), meminfo_text(6 << 20)
        window = meminfo.fast_check(bytearray(up), len(up), 7 << 30)
        self._fast = freepages.FreeCheck(os.sysconf_names["SC_AVPHYS_PAGES"], need, every, window)
        self.reader = NS(fd=-1)
        self.notifier = NS(watchdog_interval=2.5, next_ping=1002.5, watchdog=self._ping)
        real = os.sysconf

        def sysconf(name):
            self.calls += 1
            if self.calls == flag_at:
                self._flags.add(1)
            return real(name) if answers is None else answers(self.calls)

        def preadv(fd, view, off):
            self.reads += 1
            return lay(view, up if above(self.reads) else down)

        def sleep(ms):
            self.sleeps += 1
            self.t += ms / 1000.0

        self._idle_poll = sleep
        monkeypatch.setattr(idle.os, "sysconf", sysconf)
        monkeypatch.setattr(idle.os, "preadv", preadv)
        monkeypatch.setattr(idle.time, "monotonic", lambda: self.t)

    def _ping(self, now):
        self.pings.append(self.t)
        self.notifier.next_ping = now + self.notifier.watchdog_interval


def test_the_fast_path_on_the_free_check_polls_sysconf_reads_memavailable_each_second_and_ends_below(monkeypatch):
    s = NS(interval=0.2, use_swap=False)
    g = _FreeIdle(monkeypatch, need=0)                       # the real sysconf, always above
    idle.run(g, 49, s)
    # every 5th poll reads MemAvailable instead: 40 sysconf calls, 9 reads, each poll counted
    assert (g.calls, g.reads, g.fast_polls, g.sleeps) == (40, 9, 49, 49) and len(g.pings) == 3
    g = _FreeIdle(monkeypatch, need=os.sysconf("SC_PHYS_PAGES") + 1)      # more than the machine has
    idle.run(g, 49, s)
    assert (g.calls, g.reads, g.fast_polls, g.sleeps) == (1, 0, 0, 0)
    g = _FreeIdle(monkeypatch, need=100, answers=lambda i: 100 if i != 6 else 99)
    idle.run(g, 49, s)
    assert (g.calls, g.reads, g.fast_polls) == (6, 1, 6)     # polls 1-4 sysconf, 5 read, 6-7 sysconf: 7th ends
    g = _FreeIdle(monkeypatch, need=100, answers=lambda i: 100, above=lambda j: j != 2)   # MemAvailable fell
    idle.run(g, 49, s)
    assert (g.calls, g.reads, g.fast_polls) == (8, 2, 9)     # the 10th poll's read ends it
    g = _FreeIdle(monkeypatch, need=100, answers=lambda i: 100, flag_at=3)    # a signal flagged
    idle.run(g, 49, s)
    assert (g.calls, g.fast_polls, g.sleeps) == (3, 2, 2)

    def fails(i):
        raise OSError(22, "Invalid argument")
    g = _FreeIdle(monkeypatch, need=100, answers=fails)      # sysconf fails: the full pass next
    idle.run(g, 49, s)
    assert (g.calls, g.fast_polls) == (1, 0)


@pytest.mark.skipif(not freepages.glibc_ok(), reason="sysconf(_SC_AVPHYS_PAGES) is not glibc's here")
def test_a_full_pass_chooses_the_free_check_far_above_and_the_window_check_nearer():
    reader = meminfo.MeminfoReader()
    g = NS(policy=NS(state=policy.OK), avail=0, _flags=set(), _fail_since=None, soft=NS(engaged=lambda: False),
           reader=reader, free=freepages.FreeFloor("/proc/meminfo"), _fast=None)
    try:
        g.avail, _ = reader.sample()
        f = {k: reader.last(k) for k in LABELS}
        floor = min(g.avail, f[meminfo.MEMFREE_LABEL] - 2 * freepages.deficit(f)) // 4
        if floor < GiB:
            pytest.skip("MemFree here is too close to its deficit bound")
        s = NS(interval=0.2, idle_floor=floor, far=PS, budget=49)
        assert idle.budget(g, 0.2, s) == 49 and type(g._fast) is freepages.FreeCheck
        s = NS(interval=0.2, idle_floor=floor, far=f[meminfo.MEMFREE_LABEL], budget=49)   # MemFree not a slack above
        assert idle.budget(g, 0.2, s) == 49 and type(g._fast) is meminfo.FastCheck
    finally:
        reader.close()

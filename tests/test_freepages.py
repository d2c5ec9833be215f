"""The idle fast path's free-memory check (sparkguard.freepages): the kernel's reserve read from
/proc/zoneinfo, checked against the reserve the real kernel subtracts, the check's choice at a
full pass, and the fast path's loop on it (fake clock and real sysconf)."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace as NS

import pytest

from sparkguard import freepages, meminfo, pcp
from sparkguard.guard import idle

FIXTURES = Path(__file__).parent / "fixtures"
PS = os.sysconf("SC_PAGE_SIZE")
GiB = 1024**3

ZONE = b"""Node 0, zone   Normal
  pages free     1000
        boost    0
        min      10
        low      20
        high     %s
        promo    40
  pagesets
    cpu: 0
              count:    100
              high:     2378
        protection: %s
"""


def test_the_reserve_is_the_sum_of_each_zones_largest_protection_and_high_watermark():
    # fixture 40: DMA 13386 + 26, DMA32 10368 + 5707, Normal 19605, Movable 32, Device 0
    text = (FIXTURES / "40-zoneinfo-x86-2cpu-after-exit" / "proc" / "zoneinfo").read_bytes()
    assert freepages.reserve_pages(text) == 13412 + 16075 + 19605 + 32
    # the per-CPU lists' "high:" is not the zone's high watermark
    assert freepages.reserve_pages(ZONE % (b"30", b"(0, 7, 5)")) == 37
    assert freepages.reserve_pages(ZONE % (b"30", b"(0, 7, 5)") * 2) == 74


@pytest.mark.parametrize("text", [
    b"", ZONE % (b"30", b"(0, -7)"), ZONE % (b"x30", b"(0, 7)"), ZONE % (b"30", b"(0, 7"),
    ZONE % (b"30", b"(0, 12345678901234567890)"), ZONE % (b"30", b"()"),
    ZONE.replace(b"        high     %s\n", b"") % b"(0, 7)",               # protection without high
    ZONE.replace(b"        protection: %s\n", b"") % b"30" + ZONE % (b"30", b"(0, 7)"),   # high without protection
    (ZONE % (b"30", b"(0, 7)")).replace(b"Node 0, zone   Normal\n", b"") + b"        high     5\n",
])
def test_a_zoneinfo_that_does_not_say_the_reserve_gives_none(text):
    assert freepages.reserve_pages(text) is None


def _meminfo_pages() -> dict[str, int]:
    return {k: v // PS for k, v in meminfo.read().items()}


def test_the_reserve_read_is_at_least_what_the_real_kernel_subtracts_from_memfree():
    # mm/show_mem.c si_mem_available: MemAvailable = MemFree - totalreserve + pagecache' +
    # reclaimable', the last two each less the smaller of half of it and the low watermarks; so
    # the kernel's totalreserve_pages is MemFree + pagecache' + reclaimable' - MemAvailable, read
    # where two reads of meminfo around zoneinfo agree (a quiet moment of this shared machine)
    for _ in range(200):
        m = _meminfo_pages()
        z = Path("/proc/zoneinfo").read_bytes()
        if m != _meminfo_pages():
            continue
        low = sum(int(line.split()[1]) for line in z.split(b"\n") if line.strip().startswith(b"low "))
        cache = m["Active(file)"] + m["Inactive(file)"]
        recl = m["KReclaimable"]
        kernel = m["MemFree"] + cache - min(cache // 2, low) + recl - min(recl // 2, low) - m["MemAvailable"]
        if m["MemAvailable"] == 0:
            continue            # the kernel's figure is floored at 0 there: nothing to derive
        break
    else:
        pytest.skip("meminfo never held still across a read of zoneinfo")
    ours = freepages.reserve_pages(z)
    assert ours is not None and ours >= kernel, (ours, kernel)
    # and no more than the zones' caps at their managed pages account for
    capped = 0
    for zone in z.split(b"\nNode ")[0:]:
        f = {ln.split()[0]: ln.split()[1] for ln in zone.split(b"\n") if len(ln.split()) == 2}
        prot = zone.split(b"protection: (")[1].split(b")")[0]
        capped += min(int(f[b"managed"]), max(int(v) for v in prot.split(b",")) + int(f[b"high"]))
    assert abs(capped - kernel) <= 64, (capped, kernel)


def _floor(tmp_path, zoneinfo: bytes, sysctls=(b"67584\n", b"10\n", b"256\t256\t32\t0\t0\n")):
    vm = tmp_path / "vm"
    vm.mkdir(exist_ok=True)
    for name, text in zip(freepages.SYSCTLS, sysctls):
        (vm / name).write_bytes(text)
    (tmp_path / "zoneinfo").write_bytes(zoneinfo)
    return freepages.FreeFloor("/proc/meminfo", pcp.PcpReader(str(tmp_path / "zoneinfo")), str(vm))


@pytest.mark.skipif(not freepages.glibc_ok(), reason="sysconf(_SC_AVPHYS_PAGES) is not glibc's here")
def test_the_check_is_made_where_memfree_is_twice_the_reserve_and_a_slack_above_the_floor(tmp_path, caplog):
    reserve = 10_000                            # pages, in the zoneinfo the floor reads
    ff = _floor(tmp_path, ZONE % (b"%d" % (reserve - 7), b"(0, 7)"))
    free = os.sysconf("SC_AVPHYS_PAGES")
    floor = (free // 2) * PS                    # bytes of MemAvailable
    slack = 64 * PS
    c = ff.check(floor, slack, free * PS, 1 << 40, 0.0)
    assert c == freepages.FreeCheck(os.sysconf_names["SC_AVPHYS_PAGES"], free // 2 + 2 * reserve)
    assert os.sysconf(c.name) >= c.need
    # not where MemFree is short of need + slack: the window check is made instead
    assert ff.check((free - 2 * reserve - 8) * PS, slack, free * PS, 1 << 40, 1.0) is None
    # nor where MemFree of the pass's read and sysconf disagree (another view of memory), said
    # once in the log however many full passes find it so
    caplog.set_level("INFO", logger="sparkguard")
    for k in range(3):
        assert ff.check(floor, slack, free * PS // 4 + k * PS, 1 << 40, 2.0) is None
    said = [r.getMessage() for r in caplog.records if "disagree" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("the idle fast path reads /proc/meminfo: sysconf's free pages")
    assert ff.check(floor, slack, None, 1 << 40, 2.0) is None
    # a sysctl that sets the reserve changed: zoneinfo is read again at once
    (tmp_path / "zoneinfo").write_bytes(ZONE % (b"%d" % (2 * reserve - 7), b"(0, 7)"))
    assert ff.check(floor, slack, free * PS, 1 << 40, 3.0).need == free // 2 + 2 * reserve      # not yet read
    (tmp_path / "vm" / "min_free_kbytes").write_bytes(b"135168\n")
    assert ff.check(floor, slack, free * PS, 1 << 40, 4.0).need == free // 2 + 4 * reserve
    # MemTotal changed (memory hot-added), or a minute passed: read again too
    (tmp_path / "zoneinfo").write_bytes(ZONE % (b"%d" % (3 * reserve - 7), b"(0, 7)"))
    assert ff.check(floor, slack, free * PS, 2 << 40, 5.0).need == free // 2 + 6 * reserve
    (tmp_path / "zoneinfo").write_bytes(ZONE % (b"%d" % (reserve - 7), b"(0, 7)"))
    assert ff.check(floor, slack, free * PS, 2 << 40, 5.0 + freepages.RESERVE_EVERY).need == free // 2 + 2 * reserve
    # a zoneinfo that does not say the reserve, or a sysctl gone: no check, and it comes back
    (tmp_path / "zoneinfo").write_bytes(b"Node 0, zone   Normal\n")
    assert ff.check(floor, slack, free * PS, 3 << 40, 100.0) is None
    (tmp_path / "zoneinfo").write_bytes(ZONE % (b"%d" % (reserve - 7), b"(0, 7)"))
    (tmp_path / "vm" / "watermark_scale_factor").unlink()
    ff.close()
    assert ff.check(floor, slack, free * PS, 4 << 40, 101.0) is None
    (tmp_path / "vm" / "watermark_scale_factor").write_bytes(b"100\n")
    assert ff.check(floor, slack, free * PS, 4 << 40, 102.0) is not None
    ff.close()


def test_the_check_is_never_made_for_a_file_that_is_not_the_kernels_meminfo(tmp_path):
    ff = freepages.FreeFloor(str(tmp_path / "meminfo"), pcp.PcpReader("/proc/zoneinfo"))
    assert "not /proc/meminfo" in ff.off
    assert ff.check(0, 0, 1 << 40, 1 << 40, 0.0) is None


def test_glibc_of_this_machine_has_the_sysinfo_sysconf():
    lib = os.confstr("CS_GNU_LIBC_VERSION") or ""
    if not lib.startswith("glibc "):
        pytest.skip(f"not glibc: {lib!r}")
    assert freepages.glibc_ok()
    assert abs(os.sysconf("SC_AVPHYS_PAGES") * PS - meminfo.read()["MemFree"]) < GiB


class _FreeIdle:
    """A Guard as guard.idle.run sees it on the free check, on a fake clock (each sleep is one
    interval); ``answers(i)`` scripts the i-th sysconf's free pages, or None for the real call."""

    def __init__(self, monkeypatch, need, answers=None, flag_at=None):
        self.t, self.calls, self.sleeps, self.fast_polls, self.pings = 1000.0, 0, 0, 0, []
        self._flags, self.poll_mark = set(), (0.0, 0)
        self._fast = freepages.FreeCheck(os.sysconf_names["SC_AVPHYS_PAGES"], need)
        self.reader = None              # the free check reads no meminfo
        self.notifier = NS(watchdog_interval=2.5, next_ping=1002.5, watchdog=self._ping)
        real = os.sysconf

        def sysconf(name):
            self.calls += 1
            if self.calls == flag_at:
                self._flags.add(1)
            return real(name) if answers is None else answers(self.calls)

        def sleep(ms):
            self.sleeps += 1
            self.t += ms / 1000.0

        self._idle_poll = sleep
        monkeypatch.setattr(idle.os, "sysconf", sysconf)
        monkeypatch.setattr(idle.time, "monotonic", lambda: self.t)

    def _ping(self, now):
        self.pings.append(self.t)
        self.notifier.next_ping = now + self.notifier.watchdog_interval


def test_the_fast_path_on_the_free_check_polls_sysconf_and_ends_at_the_first_answer_below_need(monkeypatch):
    s = NS(interval=0.2, use_swap=False)
    g = _FreeIdle(monkeypatch, need=0)                       # the real sysconf, always above
    idle.run(g, 49, s)
    assert (g.calls, g.fast_polls, g.sleeps) == (49, 49, 49) and len(g.pings) == 3     # at 2.4, 4.8, 7.4 s
    g = _FreeIdle(monkeypatch, need=os.sysconf("SC_PHYS_PAGES") + 1)      # more than the machine has
    idle.run(g, 49, s)
    assert (g.calls, g.fast_polls, g.sleeps) == (1, 0, 0)
    g = _FreeIdle(monkeypatch, need=100, answers=lambda i: 100 if i != 5 else 99)
    idle.run(g, 49, s)
    assert (g.calls, g.fast_polls, g.sleeps) == (5, 4, 4)
    g = _FreeIdle(monkeypatch, need=100, answers=lambda i: 100, flag_at=3)    # a signal flagged
    idle.run(g, 49, s)
    assert (g.calls, g.fast_polls, g.sleeps) == (3, 2, 2)

    def fails(i):
        raise OSError(22, "Invalid argument")
    g = _FreeIdle(monkeypatch, need=100, answers=fails)      # sysconf fails: the full pass next
    idle.run(g, 49, s)
    assert (g.calls, g.fast_polls) == (1, 0)


@pytest.mark.skipif(not freepages.glibc_ok(), reason="sysconf(_SC_AVPHYS_PAGES) is not glibc's here")
def test_a_full_pass_chooses_the_free_check_far_above_and_the_window_check_nearer(tmp_path):
    from sparkguard import policy
    reader = meminfo.MeminfoReader()
    zi = pcp.PcpReader()
    g = NS(policy=NS(state=policy.OK), avail=0, _flags=set(), _fail_since=None, soft=NS(engaged=lambda: False),
           reader=reader, free=freepages.FreeFloor("/proc/meminfo", zi), _fast=None)
    try:
        g.avail, _ = reader.sample()
        free = reader.last(meminfo.MEMFREE_LABEL)
        reserve = freepages.reserve_pages(zi.read())
        floor = min(g.avail, free - 2 * reserve * PS) // 4
        s = NS(interval=0.2, idle_floor=floor, far=PS, budget=49)
        assert idle.budget(g, 0.2, s) == 49 and type(g._fast) is freepages.FreeCheck
        s = NS(interval=0.2, idle_floor=floor, far=free, budget=49)      # MemFree not a slack above
        assert idle.budget(g, 0.2, s) == 49 and type(g._fast) is meminfo.FastCheck
    finally:
        reader.close()
        g.free.close()

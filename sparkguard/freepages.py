"""The idle fast path's free-memory check: one ``sysconf`` call where a read of /proc/meminfo was.

Why it holds.  The kernel computes MemAvailable as (mm/show_mem.c ``si_mem_available``) ::

    available = NR_FREE_PAGES - totalreserve_pages + pagecache' + reclaimable'    (0 at least)

where ``pagecache'`` (the file LRU less the smaller of half of it and the low watermarks) and
``reclaimable'`` (reclaimable slab and kernel memory, the same way) are never negative.  So at
any instant MemAvailable >= MemFree - totalreserve_pages, MemFree being NR_FREE_PAGES (the
``freeram`` of ``si_meminfo``).  ``sysinfo(2)`` returns that counter, and glibc's
``sysconf(_SC_AVPHYS_PAGES)`` is it in pages (``__get_avphys_pages``: ``freeram * mem_unit`` /
page size, rounded down; since glibc 2.23, before which it parsed /proc/meminfo).  ``os.sysconf``
calls it with no Python-level work between: on the GPU machine (16 cores, Linux 6.18) a 200 ms
loop calling it costs 43 us of CPU per wake-up, one reading /proc/meminfo 58 us, which the
kernel formats in full (~55 lines) on every read (bench/results/idle-gpu-20261204c.txt).

The reserve.  ``totalreserve_pages`` is set by ``calculate_totalreserve_pages`` (mm/page_alloc.c)
whenever the watermarks or the lowmem reserves are set: per zone, the largest of the zone's
``lowmem_reserve[j]`` for j from the zone's own index up, plus its high watermark, capped at the
zone's managed pages.  /proc/zoneinfo prints each zone's ``high`` (the high watermark plus its
current boost) and ``protection: (...)`` (its ``lowmem_reserve``); :func:`reserve_pages` sums
max(protection) + high over the zones without the cap, which is never less (the dev VM, Linux
6.18: 41,188 pages against the kernel's 35,540, derived from meminfo at the same instant; the
difference is the DMA zone's cap).

What the check allows for.  The reserve can grow after zoneinfo was read: a write of
vm.min_free_kbytes, vm.watermark_scale_factor or vm.lowmem_reserve_ratio, memory hot-added; a
write of lowmem_reserve_ratio while a zone's watermark is boosted takes the boost in.
:class:`FreeFloor` reads those three sysctls and MemTotal at every full pass (every 10 s at the
most) and zoneinfo again when any changed, or a minute after the last read, and its check counts
the reserve twice: MemFree at or above ``floor + 2 x reserve`` means MemAvailable at or above the
floor while the reserve has not more than doubled since it was read.

Where it is used.  Only with the real /proc/meminfo (the kernel ``sysinfo`` asks), glibc 2.23 or
later, a readable zoneinfo, a ``sysconf`` that agrees with MemFree at the full pass (a container
whose /proc/meminfo is rewritten, LXCFS, does not), and MemFree well above the check's need (one
poll interval's fill, ``slack``, beyond it: a box whose free memory has gone to the page cache
keeps the window check of :class:`sparkguard.meminfo.FastCheck` instead).
"""

from __future__ import annotations

import logging
import math
import os
from typing import NamedTuple

from sparkguard import pcp

log = logging.getLogger("sparkguard")

RESERVE_EVERY = 60.0        # seconds: zoneinfo is read again at least this often while the check is used
SYSCTLS = ("min_free_kbytes", "watermark_scale_factor", "lowmem_reserve_ratio")   # /proc/sys/vm: what sets it
MAX_PAGES = pcp.MAX_PAGES   # a watermark or reserve above this is not one
GLIBC_MIN = (2, 23)         # sysconf(_SC_AVPHYS_PAGES) calls sysinfo(2) from this version on
_HIGH, _PROT, _NODE = b"high ", b"protection: (", b"Node "


class FreeCheck(NamedTuple):
    """The idle fast path's check against MemFree (:class:`FreeFloor`): MemAvailable is at or
    above the floor where ``os.sysconf(name) >= need``.

    Attributes:
        name: int, the ``sysconf`` name of ``_SC_AVPHYS_PAGES``.
        need: int pages of MemFree: the floor in pages, rounded up, plus twice the reserve.
    """

    name: int
    need: int


def reserve_pages(data: bytes | memoryview) -> int | None:
    """At least the kernel's ``totalreserve_pages``, from the text of /proc/zoneinfo: the sum over
    zones of the largest ``protection`` value and ``high`` (mm/vmstat.c ``zoneinfo_show_print``
    prints each zone as ``Node N, zone NAME``, then ``high N`` among its watermarks and
    ``protection: (a, b, ...)``; the per-CPU lists' ``high:`` has a colon).

    Args:
        data: the file's bytes.
    Returns:
        int pages, or None where any zone lacks either line, a value is not a decimal below
        :data:`MAX_PAGES`, or no zone is found (the check is not made then).
    """
    total = zones = 0
    high = None
    for line in bytes(data).split(b"\n"):
        s = line.strip()
        if s.startswith(_NODE):
            if high is not None:                # the zone before printed no protection line
                return None
        elif s.startswith(_HIGH):
            v = s[len(_HIGH):].strip()
            if not v.isdigit() or len(v) > 13 or high is not None:
                return None
            high = int(v)
        elif s.startswith(_PROT):
            if high is None or not s.endswith(b")"):
                return None
            prot = []
            for v in s[len(_PROT):-1].split(b","):
                v = v.strip()
                if not v.isdigit() or len(v) > 13:
                    return None
                prot.append(int(v))
            r = max(prot) + high
            if r >= MAX_PAGES:
                return None
            total += r
            zones += 1
            high = None
    if high is not None or not zones:
        return None
    return total


def glibc_ok() -> bool:
    """True where ``os.sysconf("SC_AVPHYS_PAGES")`` is glibc's, 2.23 or later (``confstr``
    ``CS_GNU_LIBC_VERSION``: ``glibc 2.36``); musl's adds the buffers to it."""
    try:
        name, _, ver = (os.confstr("CS_GNU_LIBC_VERSION") or "").partition(" ")
        return name == "glibc" and tuple(int(x) for x in ver.split(".")[:2]) >= GLIBC_MIN \
            and "SC_AVPHYS_PAGES" in os.sysconf_names
    except (ValueError, OSError):
        return False


class FreeFloor:
    """Makes the idle fast path's :class:`FreeCheck` at a full pass, where it can be made.

    Args:
        meminfo_path: str, the file the loop reads: the check is made only for ``/proc/meminfo``
            (``sysinfo`` answers for the kernel, not for a test's file).
        zoneinfo: the :class:`sparkguard.pcp.PcpReader` of /proc/zoneinfo the loop keeps.
        sysctl_dir: str, where :data:`SYSCTLS` are (tests give a folder of their own).
        page_size: int bytes (``SC_PAGE_SIZE``).
    Attributes:
        off: str, why the check is never made here, or None.
        reserve: int pages from the last zoneinfo read (:func:`reserve_pages`), or None.
    """

    def __init__(self, meminfo_path: str, zoneinfo: pcp.PcpReader, sysctl_dir: str = "/proc/sys/vm",
                 page_size: int | None = None):
        self.off = None
        if meminfo_path != "/proc/meminfo":
            self.off = f"the loop reads {meminfo_path}, not /proc/meminfo"
        elif not glibc_ok():
            self.off = "sysconf(_SC_AVPHYS_PAGES) is not glibc's (2.23 or later)"
        self.zoneinfo = zoneinfo
        self.paths = tuple(os.path.join(sysctl_dir, n) for n in SYSCTLS)
        self.page_size = page_size or os.sysconf("SC_PAGE_SIZE")
        self.name = os.sysconf_names.get("SC_AVPHYS_PAGES", -1)
        self.reserve: int | None = None
        self._key: bytes | None = None      # the sysctls and MemTotal when zoneinfo was read
        self._read_at = -math.inf
        self._fds: list[int] = []
        self._why = None                    # why the last full pass made no check (logged on change)

    def check(self, floor: int, slack: int, mem_free: int | None, mem_total: int, now: float) -> FreeCheck | None:
        """The check for the fast polls after this full pass, or None (the window check then).

        Args:
            floor: int bytes of MemAvailable the fast path must stay at or above.
            slack: int bytes of MemFree beyond the need before the check is made (a poll
                interval's fill: the check should not end the fast path at once).
            mem_free, mem_total: MemFree and MemTotal of the full pass's read, bytes (MemFree
                None where its line did not parse).
            now: monotonic seconds.
        Never raises: a failed read gives None, logged when the reason changes.
        """
        if self.off is not None or mem_free is None:
            return None
        why = detail = None
        try:
            key = b"".join(os.pread(fd, 256, 0) for fd in self._open()) + b"%d" % mem_total
            if key != self._key or now - self._read_at >= RESERVE_EVERY:
                data = self.zoneinfo.read()
                self.reserve = None if data is None else reserve_pages(data)
                self._key, self._read_at = key, now
            free = os.sysconf(self.name)
        except OSError as e:
            self.close()
            self.reserve, self._key, free = None, None, -1
            why = "unreadable"
            detail = f"reading {', '.join(self.paths)} or sysconf(_SC_AVPHYS_PAGES): {e.strerror or e}"
        ps = self.page_size
        if why is None and self.reserve is None:
            why = "no reserve"
            detail = self.zoneinfo.error or f"{self.zoneinfo.path}: no zone's high watermark and protection"
        elif why is None and abs(free - mem_free // ps) > max(mem_free // ps, free) // 64 + (64 << 20) // ps:
            why = "views differ"
            detail = f"sysconf's free pages ({free}) and MemFree ({mem_free // ps} pages) disagree"
        if why != self._why:        # logged once per reason, not at every full pass
            if why is not None:
                log.info("the idle fast path reads /proc/meminfo: %s", detail)
            self._why = why
        if why is not None:
            return None
        need = -(-floor // ps) + 2 * self.reserve
        return FreeCheck(self.name, need) if free >= need + -(-slack // ps) else None

    def _open(self) -> list[int]:
        if not self._fds:
            for p in self.paths:
                try:
                    self._fds.append(os.open(p, os.O_RDONLY | os.O_CLOEXEC))
                except OSError:
                    self.close()
                    raise
        return self._fds

    def close(self) -> None:
        """Close the sysctls' descriptors (the next check opens them again)."""
        fds, self._fds = self._fds, []
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass

"""The idle fast path's free-memory check: one ``sysconf`` call where a read of /proc/meminfo was.

Why it holds.  The kernel computes MemAvailable as (mm/show_mem.c ``si_mem_available``) ::

    available = NR_FREE_PAGES - totalreserve_pages + pagecache' + reclaimable'    (0 at least)

where ``pagecache'`` is at most the file LRU (Active(file) + Inactive(file)) and ``reclaimable'``
at most KReclaimable, each less the smaller of half of it and the low watermarks.  One read of
/proc/meminfo gives the *deficit bound* ::

    U = MemFree + Active(file) + Inactive(file) + KReclaimable - MemAvailable

so that at that instant MemAvailable = MemFree + (the file LRU + KReclaimable) - U >= MemFree - U,
and U is at least the kernel's reserve R (MemFree - MemAvailable is never more than R, whatever
the page cache, slab, mlock or isolation do: they only shrink the terms the kernel adds).  Only
the reserve's growth moves that limit: a write of vm.min_free_kbytes, vm.watermark_scale_factor
or vm.lowmem_reserve_ratio, THP turned on (khugepaged raises min_free_kbytes), memory set up or
hot-added, a watermark boost taken into the reserve.  No zoneinfo or sysctl is read for it: a read
of vm.lowmem_reserve_ratio recomputes the kernel's reserve.

The check: MemFree in pages, from ``sysconf(_SC_AVPHYS_PAGES)`` (glibc: ``sysinfo(2)``'s
``freeram * mem_unit`` / page size, rounded down, since 2.23; the same counter as MemFree's
line), at or above ``floor + 2 x U``: MemAvailable at or above the floor while the reserve is at
most 2U, i.e. has not grown by more than U since U was read at the last full pass (10 s at the
most).  Each second (:data:`VERIFY_EVERY`) a poll makes the window check of
:class:`sparkguard.meminfo.FastCheck` instead, which reads MemAvailable itself: a reserve that
grew by more than U since (a sysctl written) is seen within a second, as memory that fell below
the floor.

What it costs: on the GPU machine (16 cores, Linux 6.18) a 200 ms loop calling ``os.sysconf`` takes
36-43 us of CPU per wake-up, one reading /proc/meminfo 50-58 us: the kernel formats all of its ~55
lines on every read (bench/results/idle-gpu-20261204c.txt).

Where it is used: only with the real /proc/meminfo (``sysinfo`` answers for the kernel, not for
a test's file), glibc 2.23 or later, a ``sysconf`` that agrees with MemFree and MemTotal at the
full pass (a container whose /proc/meminfo is rewritten, LXCFS, or a ``sysinfo`` that a seccomp
filter refuses, whose struct glibc then returns unset, does not), and MemFree one poll interval's
fill (``slack``) above the need; elsewhere (free memory gone to the page cache) the window check
runs at every poll.
"""

from __future__ import annotations

import logging
import os
from typing import NamedTuple

from sparkguard import meminfo

log = logging.getLogger("sparkguard")

VERIFY_EVERY = 1.0          # seconds: a poll this often makes the window check instead (MemAvailable itself)
GLIBC_MIN = (2, 23)         # sysconf(_SC_AVPHYS_PAGES) calls sysinfo(2) from this version on
#: bytes added to the deficit bound: meminfo_proc_show reads MemFree and the file LRU a moment
#: before si_mem_available reads its own counters (and KReclaimable after), so memory freed, file
#: pages put back on the LRU or slab shrunk between the reads shows in MemAvailable alone and
#: makes the bound too small (a fill errs the safe way).  The window is microseconds; the skew
#: beyond this is also covered by the LRU and KReclaimable terms the bound over-counts, and the
#: window check reads MemAvailable itself each second
SKEW = 64 << 20
#: the meminfo lines of the deficit bound besides MemFree and MemAvailable (KReclaimable: Linux 4.20)
LRU_LABELS = (b"\nActive(file):", b"\nInactive(file):", b"\nKReclaimable:")


class FreeCheck(NamedTuple):
    """The idle fast path's check against MemFree (:class:`FreeFloor`): MemAvailable is at or
    above the floor where ``os.sysconf(name) >= need``; every ``every``-th poll makes ``window``'s
    check instead.

    Attributes:
        name: int, the ``sysconf`` name of ``_SC_AVPHYS_PAGES``.
        need: int pages of MemFree: the floor in pages, rounded up, plus twice the deficit bound.
        every: int, polls from one window check to the next (:data:`VERIFY_EVERY` s).
        window: the :class:`sparkguard.meminfo.FastCheck` of the same full pass.
    """

    name: int
    need: int
    every: int
    window: meminfo.FastCheck


def deficit(fields: dict[bytes, int | None]) -> int | None:
    """The deficit bound U (bytes) of one read of /proc/meminfo: MemFree + Active(file) +
    Inactive(file) + KReclaimable - MemAvailable, plus :data:`SKEW`; None where a line is missing
    or that difference is not positive (the kernel's reserve is, so the read is skewed or not the
    kernel's: no free check for it).

    Args:
        fields: label (``meminfo.MEMFREE_LABEL``, ``meminfo.AVAIL_LABEL`` and
            :data:`LRU_LABELS`) -> bytes, as ``MeminfoReader.last`` gives them.
    """
    vals = [fields.get(k) for k in (meminfo.MEMFREE_LABEL, *LRU_LABELS)]
    avail = fields.get(meminfo.AVAIL_LABEL)
    if avail is None or any(v is None for v in vals):
        return None
    raw = sum(vals) - avail
    return raw + SKEW if raw > 0 else None


def glibc_ok() -> bool:
    """True where ``os.sysconf("SC_AVPHYS_PAGES")`` is glibc's, 2.23 or later (``confstr``
    ``CS_GNU_LIBC_VERSION``: ``glibc 2.36``); musl's adds the buffers to it."""
    try:
        name, _, ver = (os.confstr("CS_GNU_LIBC_VERSION") or "").partition(" ")
        return name == "glibc" and tuple(int(x) for x in ver.split(".")[:2]) >= GLIBC_MIN \
            and "SC_AVPHYS_PAGES" in os.sysconf_names and "SC_PHYS_PAGES" in os.sysconf_names
    except (ValueError, OSError):
        return False


class FreeFloor:
    """Makes the idle fast path's :class:`FreeCheck` at a full pass, where it can be made.

    Args:
        meminfo_path: str, the file the loop reads: the check is made only for ``/proc/meminfo``.
        page_size: int bytes (``SC_PAGE_SIZE``).
    Attributes:
        off: str, why the check is never made here, or None.
    """

    def __init__(self, meminfo_path: str, page_size: int | None = None):
        self.off = None
        if meminfo_path != "/proc/meminfo":
            self.off = f"the loop reads {meminfo_path}, not /proc/meminfo"
        elif not glibc_ok():
            self.off = "sysconf(_SC_AVPHYS_PAGES) is not glibc's (2.23 or later)"
        self.page_size = page_size or os.sysconf("SC_PAGE_SIZE")
        self.name = os.sysconf_names.get("SC_AVPHYS_PAGES", -1)
        self._why = None                    # why the last full pass made no check (logged on change)

    def check(self, floor: int, slack: int, interval: float, fields: dict[bytes, int | None], mem_total: int,
              window: meminfo.FastCheck | None) -> FreeCheck | None:
        """The check for the fast polls after this full pass, or None (the window check then).

        Args:
            floor: int bytes of MemAvailable the fast path must stay at or above.
            slack: int bytes of MemFree beyond the need before the check is made (a poll
                interval's fill: the check should not end the fast path at once).
            interval: float seconds between polls.
            fields: the full pass's read (:func:`deficit`'s labels -> bytes).
            mem_total: MemTotal of that read, bytes.
            window: the window check of that read (None: no fast path at all).
        Never raises: a failed ``sysconf`` gives None, logged when the reason changes.
        """
        if self.off is not None or window is None:
            return None
        u, free_b = deficit(fields), fields.get(meminfo.MEMFREE_LABEL)
        ps = self.page_size
        why = detail = None
        try:
            free, total = os.sysconf(self.name), os.sysconf("SC_PHYS_PAGES")
        except (OSError, ValueError) as e:
            why, detail = "sysconf", f"sysconf: {e}"
        if why is None and u is None:
            why, detail = "fields", ("no MemFree, Active(file), Inactive(file) or KReclaimable line, or "
                                     "MemAvailable at or above their sum")
        elif why is None and (abs(free - free_b // ps) > max(free_b // ps, free) // 64 + (64 << 20) // ps
                              or abs(total - mem_total // ps) > mem_total // ps // 64 + (64 << 20) // ps):
            why = "views differ"
            detail = (f"sysconf's free and total pages ({free}, {total}) and MemFree, MemTotal "
                      f"({free_b // ps}, {mem_total // ps} pages) disagree")
        if why != self._why:        # logged once per reason, not at every full pass
            if why is not None:
                log.info("the idle fast path reads /proc/meminfo at every poll: %s", detail)
            self._why = why
        if why is not None:
            return None
        need = -(-floor // ps) + 2 * -(-u // ps)
        every = max(1, int(VERIFY_EVERY / interval + 1e-9))
        return FreeCheck(self.name, need, every, window) if free >= need + -(-slack // ps) else None

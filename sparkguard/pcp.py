"""Free pages the kernel holds on its per-CPU lists: memory that is back but not in MemAvailable.

The page allocator keeps a cache of free pages per CPU and zone (the "pcp" lists, ``struct
per_cpu_pages``).  Pages on them are free: the next allocation on that CPU takes them first, and
an allocation that finds the zone short drains every CPU's lists before it reclaims
(mm/page_alloc.c ``__alloc_pages_direct_reclaim`` -> ``drain_all_pages``).  But they are not
counted in ``NR_FREE_PAGES``, so not in MemFree nor MemAvailable.

Since Linux 6.7 the lists tune their own size ("mm: tune PCP high automatically"): a CPU that
frees many pages in a row raises its list's ``high`` towards ``high_max``, which is 1/8 of the
zone split across the node's CPUs (``zone_highsize`` with MIN_PERCPU_PAGELIST_HIGH_FRACTION = 8).
A process exiting with gigabytes resident frees them on one CPU, so after a victim dies that CPU's
list can hold up to ``zone / 8 / CPUs`` of the memory just freed.  The lists shrink back in
``decay_pcp_high``, called from the vmstat worker every ``vm.stat_interval`` (1 s): by at most
``batch << 5`` pages per CPU per call (2016 pages, 7.9 MiB, with the usual batch of 63).

Measured on a 2-CPU, 24 GiB VM (Linux 6.18): a fake engine holding 1.56 GiB exits; MemAvailable
comes back by 0.52 GiB, and 1.10 GiB sits on the two CPUs' lists, draining at ~15 MiB/s (a
minute to drain).  MemAvailable plus the lists' pages is back to within 1 MiB at once.  On a
20-CPU, 128 GiB GB10 the same arithmetic gives ~0.8 GiB per CPU that freed.

So while a victim's memory is coming back, memory back on these lists extends the guard's wait
(policy ``pcp_free``, ``PCP_DRAIN_WAIT``) instead of a second victim being chosen; no decision to
act counts them (an allocation under pressure drains the lists only after it has reclaimed, so
MemAvailable alone is the conservative signal there).

/proc/zoneinfo lists, per zone, ``pagesets`` then for each CPU ``cpu: N`` followed by
``count: N`` (pages on that CPU's lists), ``high:``, ``batch:`` and, since 6.7, ``high_min:`` and
``high_max:`` (mm/vmstat.c ``zoneinfo_show_print``).  The file is untrusted input: at most
:data:`MAX_BYTES` are read into a buffer allocated once, a ``count:`` that is not a decimal below
:data:`MAX_PAGES` is skipped, and a read that fails or fills the buffer gives None.
"""

from __future__ import annotations

import os

#: the buffer: /proc/zoneinfo is ~2.5 KiB per zone plus ~110 bytes per CPU per zone
#: (5 KiB on a 2-CPU VM; ~60 KiB for 128 CPUs x 4 zones)
MAX_BYTES = 256 * 1024
MAX_PAGES = 1 << 40            # a count above this (4 EiB of 4 KiB pages) is not a count
_CPU, _COUNT = b"cpu:", b"count:"


def pcp_pages(data: bytes) -> int:
    """Pages on the per-CPU free lists in the text of /proc/zoneinfo, summed over zones and CPUs.

    Args:
        data: the file's bytes (or a memoryview of them).
    Returns:
        int pages; 0 when no per-CPU ``count:`` line parses.  A ``count:`` counts only right
        after a ``cpu:`` line, so no other field of the file can be mistaken for one.
    """
    total = 0
    after_cpu = False
    for line in bytes(data).split(b"\n"):
        s = line.strip()
        if s.startswith(_CPU):
            after_cpu = True
            continue
        if after_cpu and s.startswith(_COUNT):
            v = s[len(_COUNT):].strip()
            if v.isdigit() and len(v) <= 13:
                n = int(v)
                if n < MAX_PAGES:
                    total += n
        after_cpu = False
    return total


class PcpReader:
    """Reads the bytes on the per-CPU free lists from an open /proc/zoneinfo.

    Args:
        path: str, normally ``/proc/zoneinfo`` (tests point at fixture files).
        page_size: int bytes per page (``os.sysconf("SC_PAGE_SIZE")``: 4096, or 16/64 KiB on arm64
            kernels built so).
    The file is opened lazily and kept open; the buffer is allocated at the first read.
    """

    def __init__(self, path: str = "/proc/zoneinfo", page_size: int | None = None):
        self.path = path
        self.page_size = page_size or os.sysconf("SC_PAGE_SIZE")
        self._fd: int | None = None
        self._buf: bytearray | None = None
        self.error: str | None = None       # why the last read gave None, for the caller's log

    def free_bytes(self) -> int | None:
        """Bytes free on the per-CPU lists now, or None when the file cannot be read (``error``
        says why: no file, no permission, larger than :data:`MAX_BYTES`).  Never raises; one
        ``preadv`` into the buffer, no allocation beyond the parse.

        The kernel prints each zone with its lock held (mm/vmstat.c ``zoneinfo_show``), the lock the
        page allocator takes: callers read this at most once a second."""
        try:
            if self._fd is None:
                self._fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
                self._buf = bytearray(MAX_BYTES)
            buf, n = self._buf, 0
            while n < MAX_BYTES:
                # seq_file fills a read with whole zones while they fit: a read shorter than what
                # was left of the buffer has reached the end (another read would print every zone
                # again, each under its zone lock)
                got = os.preadv(self._fd, [memoryview(buf)[n:]], n)
                n += max(got, 0)
                if got < MAX_BYTES - (n - got):
                    break
        except OSError as e:
            self.error = f"{self.path}: {e.strerror or e}"
            self.close()
            return None
        if n >= MAX_BYTES:
            self.error = f"{self.path}: larger than {MAX_BYTES} bytes; not read"
            return None
        self.error = None
        return pcp_pages(memoryview(self._buf)[:n]) * self.page_size

    def close(self) -> None:
        """Close the file (the next read opens it again)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass

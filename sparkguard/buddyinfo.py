"""/proc/buddyinfo: how much free memory lies in blocks large enough for the GPU driver.

Each line of /proc/buddyinfo is one memory zone: ``Node 0, zone   Normal  c0 c1 ... c10``, where
``cN`` is the number of free blocks of ``2**N`` pages (the buddy allocator's free lists; kernel
Documentation/filesystems/proc.rst, "buddyinfo").  Free memory in many small blocks is still
MemFree, but an allocator that wants 2 MiB blocks cannot use it: after pinning ~90 GiB on a
GB10 only ~500-650 MiB of order-9 (2 MiB) blocks were left (FIELD-NOTES "How GB10 reports
memory").  ``compact_memory`` (Documentation/admin-guide/sysctl/vm.rst) merges movable pages
back into large blocks; what it cannot merge only a reboot frees.

The reader takes its path (tests feed fixture files, tests/fixtures/buddyinfo/) and the page
size, and treats the file as untrusted: at most :data:`MAX_BYTES` are read, lines that do not
parse are skipped, counts are bounded.  It is called off the poll loop (the start gates, the
metrics scrape).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

MAX_BYTES = 64 * 1024       # a box with 64 NUMA nodes x 5 zones is ~20 KiB of text
MAX_ORDERS = 16             # MAX_ORDER is 10 or 11 on x86-64 and arm64 (mmzone.h); more is not buddyinfo
MAX_COUNT = 1 << 40         # a count above this (4 EiB of 4 KiB pages) is not a count
HIGH_BLOCK = 2 * 1024**2    # bytes: the block size the start gate counts (a 2 MiB huge page)


@dataclass(frozen=True)
class Zone:
    """One line of /proc/buddyinfo.

    Attributes:
        node: int NUMA node; zone: str zone name (``DMA``, ``DMA32``, ``Normal``, ``Movable``...);
        counts: tuple[int, ...], free blocks per order (index = order: blocks of ``2**order`` pages).
    """

    node: int
    zone: str
    counts: tuple[int, ...]


@dataclass(frozen=True)
class Summary:
    """Free memory by block size, over every zone.

    Attributes:
        free_bytes: int, bytes free in all blocks (close to MemFree, which also counts per-CPU lists).
        high_order_bytes: int, bytes free in blocks of at least ``block_bytes``.
        block_bytes: int, the block size counted (:data:`HIGH_BLOCK`, 2 MiB).
        min_order: int, the first order counted (``log2(block_bytes / page_size)``: 9 with 4 KiB pages).
    """

    free_bytes: int
    high_order_bytes: int
    block_bytes: int
    min_order: int

    def as_dict(self) -> dict:
        """JSON-ready form (status, incidents)."""
        return {"free_bytes": self.free_bytes, "high_order_bytes": self.high_order_bytes,
                "block_bytes": self.block_bytes, "min_order": self.min_order}


def parse(text: str) -> list[Zone]:
    """The zones of /proc/buddyinfo text; lines that are not ``Node N, zone NAME counts...`` are skipped."""
    zones = []
    for line in text.splitlines():
        head, sep, rest = line.partition(", zone")
        parts = head.split()
        if not sep or len(parts) != 2 or parts[0] != "Node" or not parts[1].isdigit():
            continue
        fields = rest.split()
        if len(fields) < 2 or len(fields) > MAX_ORDERS + 1:
            continue
        name, nums = fields[0], fields[1:]
        if not all(n.isdigit() and len(n) < 16 for n in nums):
            continue
        counts = tuple(int(n) for n in nums)
        if any(c > MAX_COUNT for c in counts):
            continue
        zones.append(Zone(int(parts[1]), name[:32], counts))
    return zones


def summarize(zones: list[Zone], page_size: int, block_bytes: int = HIGH_BLOCK) -> Summary:
    """Free bytes in all blocks and in blocks of at least ``block_bytes`` (``page_size`` bytes a page)."""
    min_order = max(0, (max(block_bytes, page_size) // page_size).bit_length() - 1)
    free = high = 0
    for z in zones:
        for order, n in enumerate(z.counts):
            b = n * (page_size << order)
            free += b
            if order >= min_order:
                high += b
    return Summary(free, high, block_bytes, min_order)


def read(path: str = "/proc/buddyinfo", page_size: int | None = None) -> Summary | None:
    """:func:`summarize` of the file at ``path``; None when it cannot be read or has no zone
    (no such file in a container without /proc, or a kernel that hides it).  Never raises."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_BYTES)
    except OSError:
        return None
    zones = parse(raw.decode("ascii", "replace"))
    if not zones:
        return None
    return summarize(zones, page_size or os.sysconf("SC_PAGE_SIZE"))

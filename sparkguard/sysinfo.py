"""Small readers of kernel state used outside the poll loop: PSI, zram, swaps, identity.

All functions return plain dicts/lists (JSON-ready) and never raise on a missing or
unreadable file: they return None / empty instead, because the guard must survive an
odd /proc (hidepid, containers, old kernels).  Each takes the path it reads (or the folder
of /sys/block), so tests run them on fixture files (tests/fixtures/).
"""

from __future__ import annotations

import os
import socket


SYS_ZRAM = "/sys/block"


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def read_psi_memory(path: str = "/proc/pressure/memory") -> dict | None:
    """Memory pressure (PSI) as ``{"some": {"avg10": %, "avg60": %, "avg300": %, "total_us": int}, "full": {...}}``.

    avg* are percentages (0-100) of wall time stalled; total is microseconds.
    Returns None without PSI (kernel < 4.20 or psi=0).  Source: Documentation/accounting/psi.rst.
    """
    text = _read(path)
    if text is None:
        return None
    out: dict = {}
    for line in text.splitlines():
        parts = line.split()
        if not parts:
            continue
        vals: dict = {}
        for kv in parts[1:]:
            k, _, v = kv.partition("=")
            try:
                vals["total_us" if k == "total" else k] = int(v) if k == "total" else float(v)
            except ValueError:
                pass
        out[parts[0]] = vals
    return out or None


ZRAM_MM_STAT = ("orig_data_bytes", "compr_data_bytes", "mem_used_bytes", "mem_limit_bytes",
                "mem_used_max_bytes", "same_pages", "pages_compacted", "huge_pages", "huge_pages_since")


def comp_algorithms(text: str) -> tuple[list[str], str | None]:
    """The algorithms of a zram ``comp_algorithm`` file (``"lzo [lz4] zstd"``) and the selected
    one, which the kernel writes in brackets (None when none is).
    Source: Documentation/admin-guide/blockdev/zram.rst."""
    names, selected = [], None
    for w in text.split():
        if w.startswith("["):
            w = w.strip("[]")
            selected = w
        names.append(w)
    return names, selected


def read_zram(sys_block: str = SYS_ZRAM) -> list[dict]:
    """zram devices with a non-zero disksize, each ``{"device", "disksize_bytes", "comp_algorithm", <mm_stat fields>}``.

    mm_stat columns (bytes unless named pages): orig_data_size, compr_data_size,
    mem_used_total (the RAM zram really uses), mem_limit, mem_used_max, same_pages,
    pages_compacted, huge_pages, huge_pages_since.  Source: Documentation/admin-guide/blockdev/zram.rst.

    Args:
        sys_block: the folder holding ``zramN/`` (``/sys/block``).
    """
    out = []
    try:
        names = sorted(n for n in os.listdir(sys_block) if n.startswith("zram"))
    except OSError:
        return out
    for name in names:
        base = f"{sys_block}/{name}"
        disksize = (_read(f"{base}/disksize") or "").strip()
        if not disksize.isdigit() or int(disksize) == 0:
            continue
        dev: dict = {"device": name, "disksize_bytes": int(disksize)}
        algo = _read(f"{base}/comp_algorithm") or ""
        selected = comp_algorithms(algo)[1]
        dev["comp_algorithm"] = selected if selected is not None else algo.strip()
        mm = (_read(f"{base}/mm_stat") or "").split()
        for k, v in zip(ZRAM_MM_STAT, mm):
            try:
                dev[k] = int(v)
            except ValueError:
                pass
        out.append(dev)
    return out


def read_swaps(path: str = "/proc/swaps") -> list[dict]:
    """Active swap areas: ``[{"filename", "type", "size_bytes", "used_bytes", "priority"}]``."""
    text = _read(path) or ""
    out = []
    for line in text.splitlines()[1:]:
        p = line.split()
        if len(p) >= 5:
            try:
                out.append({"filename": p[0], "type": p[1], "size_bytes": int(p[2]) * 1024,
                            "used_bytes": int(p[3]) * 1024, "priority": int(p[4])})
            except ValueError:
                pass
    return out


def boot_id(path: str = "/proc/sys/kernel/random/boot_id") -> str:
    """The kernel's boot id (/proc/sys/kernel/random/boot_id, dashes removed), or ``""``."""
    return (_read(path) or "").strip().replace("-", "")


def hostname() -> str:
    """This host's name (``socket.gethostname()``)."""
    return socket.gethostname()

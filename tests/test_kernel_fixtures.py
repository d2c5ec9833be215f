"""The /proc and /sys readers on fixture trees, the way zram-generator and systemd-oomd test
theirs: each folder of tests/fixtures/ is one case, named for what it tests, holding the input
files laid out as the kernel does (``proc/meminfo``, ``proc/swaps``, ``proc/pressure/memory``,
``proc/PID/{stat,cmdline,status,smaps_rollup,task/TID/...}``, ``sys/block/zramN/...``) beside
``expected.json``, what the readers give for them.  Adding a case is adding a folder.

The readers compared (a file a case lacks is read as absent, as the kernel would have it):
``meminfo`` :func:`sparkguard.meminfo.read`; ``reader`` :class:`sparkguard.meminfo.MeminfoReader`
(the poll loop's: its first sample, MemTotal and SwapTotal, or the error that stops the guard);
``start_gate`` the supervisor's MemAvailable reader (``supervisor.gates.read_mem_available``);
``swaps``, ``psi_memory``, ``zram`` the :mod:`sparkguard.sysinfo` readers; ``buddyinfo``
:func:`sparkguard.buddyinfo.read` and ``pcp_free_bytes``
:class:`sparkguard.pcp.PcpReader` (only for the cases that have the file); ``procs``
:func:`sparkguard.proctree.scan` and ``memory`` the resident and swapped bytes of each process
found (``proctree._status_mem``, what the incident's tree rows show); ``argv``, ``creds`` and ``stat`` (ppid, nice) the
:mod:`sparkguard.host.procview` readers doctor uses.

Regenerate after a deliberate change of a reader: ``python3 tests/test_kernel_fixtures.py``
rewrites every expected.json; read the diff before committing it.
"""

from __future__ import annotations

import dataclasses
import json
import random
import sys
from pathlib import Path

import pytest

from sparkguard import buddyinfo, meminfo, pcp, proctree, sysinfo
from sparkguard.host import procview
from sparkguard.supervisor import gates

FIXTURES = Path(__file__).parent / "fixtures"
CASES = sorted(p.name for p in FIXTURES.iterdir() if (p / "expected.json").exists())


def observe(case: Path) -> dict:
    """What every reader gives for the files of ``case`` (JSON-ready)."""
    proc, out = case / "proc", {}
    try:
        out["meminfo"] = meminfo.read(str(proc / "meminfo"))
    except OSError as e:
        out["meminfo"] = {"error": type(e).__name__}
    try:
        r = meminfo.MeminfoReader(str(proc / "meminfo"))
    except (OSError, meminfo.MeminfoError) as e:
        out["reader"] = {"error": type(e).__name__}
    else:
        try:
            out["reader"] = {"sample": list(r.sample()), "mem_total": r.mem_total, "swap_total": r.swap_total}
        finally:
            r.close()
    try:
        out["start_gate"] = gates.read_mem_available(str(proc / "meminfo"))
    except (OSError, ValueError) as e:
        out["start_gate"] = {"error": type(e).__name__}
    out["swaps"] = sysinfo.read_swaps(str(proc / "swaps"))
    out["psi_memory"] = sysinfo.read_psi_memory(str(proc / "pressure" / "memory"))
    out["zram"] = sysinfo.read_zram(str(case / "sys" / "block"))
    if (proc / "buddyinfo").exists():       # only the cases that have one (4 KiB pages, as on x86-64 and GB10)
        b = buddyinfo.read(str(proc / "buddyinfo"), page_size=4096)
        out["buddyinfo"] = b.as_dict() if b is not None else None
    if (proc / "zoneinfo").exists():        # the per-CPU free lists (4 KiB pages)
        out["pcp_free_bytes"] = pcp.PcpReader(str(proc / "zoneinfo"), page_size=4096).free_bytes()
    procs = proctree.scan(str(proc)) if proc.is_dir() else {}
    out["procs"] = {str(pid): dataclasses.asdict(p) for pid, p in sorted(procs.items())}
    out["memory"] = {str(pid): list(proctree._status_mem(pid, root=str(proc))) for pid in sorted(procs)}
    out["argv"], out["creds"], out["stat"] = {}, {}, {}
    for pid in sorted(procs):
        out["argv"][str(pid)] = procview.argv(pid, str(proc))
        out["stat"][str(pid)] = {"ppid": procview.ppid(pid, str(proc)), "nice": procview.nice(pid, str(proc))}
        try:
            c = procview.creds(pid, str(proc))
        except (OSError, KeyError, ValueError) as e:
            out["creds"][str(pid)] = {"error": type(e).__name__}
        else:
            out["creds"][str(pid)] = {"uid": c.uid, "gids": sorted(c.gids), "cap_eff": c.cap_eff}
    return out


@pytest.mark.parametrize("case", CASES)
def test_readers_on_fixture_tree(case):
    expected = json.loads((FIXTURES / case / "expected.json").read_text())
    assert observe(FIXTURES / case) == expected


def test_every_fixture_folder_is_a_case():
    assert CASES and CASES == sorted(p.name for p in FIXTURES.iterdir() if p.is_dir())


if __name__ == "__main__":
    for name in sorted(p.name for p in FIXTURES.iterdir() if p.is_dir()):
        (FIXTURES / name / "expected.json").write_text(json.dumps(observe(FIXTURES / name), indent=1) + "\n")
        print("wrote", FIXTURES / name / "expected.json", file=sys.stderr)


def _rounded_kb(floor: int) -> int:
    """``floor`` bytes in kB, rounded up as meminfo.fast_prefixes rounds it (3 significant digits)."""
    kb = max(1, -(-floor // 1024))
    q = 10 ** max(0, len(str(kb)) - 3)
    return -(-kb // q) * q


def _fast_possible(kb: int, floor: int) -> bool:
    """Where the fast path must have a check for a read of ``kb`` against ``floor`` bytes: at or
    above the rounded floor, and no wider than 20 digits (an unsigned long)."""
    return kb >= _rounded_kb(floor) and len(str(kb)) <= 20


@pytest.mark.parametrize("case", [c for c in CASES if (FIXTURES / c / "proc" / "meminfo").exists()])
def test_the_fast_path_check_agrees_with_the_full_parser_or_gives_up(case):
    """meminfo.fast_check (the idle fast path's check: one startswith of a read) on each fixture
    meminfo, for floors just below, at and just above the value the full parser (meminfo.field)
    reads: there is a check only where that value is at or above the floor and it holds on the
    read it was made from; the value other threads read (MeminfoReader.available_now) is that
    value; a file the full parser refuses, or one whose line is not laid out as the kernel's,
    gives no fast path at all (fast_layout -1), so the guard takes full passes."""
    from sparkguard import meminfo
    text = bytearray((FIXTURES / case / "proc" / "meminfo").read_bytes())
    try:
        want = meminfo.field(text, meminfo.AVAIL_LABEL)
    except ValueError:
        want = None
    at = meminfo.fast_layout(text, len(text))
    if want is None:
        assert at == -1
        assert meminfo.fast_check(text, len(text), meminfo.fast_prefixes(2**30), 2**30) is None
        return
    reader = meminfo.MeminfoReader(str(FIXTURES / case / "proc" / "meminfo"))
    try:
        assert reader.available_now() == want
    finally:
        reader.close()
    for floor in (want - 4096, want - 1024, want, want + 1, want + 1024, 0, 2**30, want // 2):
        floor = max(0, floor)
        check = meminfo.fast_check(text, len(text), meminfo.fast_prefixes(floor), floor)
        if check is None:
            assert at < 0 or not _fast_possible(want >> 10, floor), (floor, want)
            continue
        fn, first, off = check
        assert want >= floor, (floor, want)
        assert fn(first, off, len(text))


def _meminfo(kb: int, free: int = 5, before: bytes = b"") -> bytes:
    """The kernel's first lines of /proc/meminfo with MemAvailable ``kb`` (fs/proc/meminfo.c:
    ``%8lu`` after a 16-column label, wider from 10^8 kB) after a MemFree of ``free`` kB and
    the lines ``before``."""
    return b"MemTotal:       %8d kB\nMemFree:        %8d kB\n%sMemAvailable:   %8d kB\nBuffers:  0 kB\n" % (
        130000000, free, before, kb)


VALUES_KB = [0, 7, 999, 1000, 1234567, 7495270, 7500000, 9999999, 10000000, 12345678, 99999999, 100000000,
             120586240, 999999999, 1000000000, 9999999999]


@pytest.mark.parametrize("kb", VALUES_KB)
@pytest.mark.parametrize("floor_kb", [1, 786432, 7495270, 7500001, 12345678, 99999999, 100000000, 120586240,
                                      123456789, 999999999])
def test_the_fast_path_check_holds_only_at_or_above_the_floor_for_every_later_read(kb, floor_kb):
    """The check made from a read of ``kb`` holds on a later read only where that read's value is
    at or above the floor, whatever its width (the kernel widens the field from 10^8 kB on); it
    holds on the read it was made from; and it gives up when MemFree's width moves the line, the
    name stands inside another line where the line was, or the read is short.  Where a check must exist (at or above the floor rounded up to 3
    significant digits, and a floor under 10^8 kB or a value wider than it), it does."""
    from sparkguard import meminfo
    floor = floor_kb * 1024
    text = _meminfo(kb)
    buf = bytearray(4096)           # the reader's buffer: each read overwrites its start
    buf[:len(text)] = text
    check = meminfo.fast_check(buf, len(text), meminfo.fast_prefixes(floor), floor)
    assert (check is not None) == _fast_possible(kb, floor)
    if check is None:
        return
    fn, first, off = check
    assert fn(first, off, len(text))
    rng = random.Random(kb * 7919 + floor_kb)
    later = VALUES_KB + [floor_kb - 1, floor_kb, floor_kb + 1] + [rng.randrange(10 ** rng.randrange(1, 11))
                                                                    for _ in range(300)]
    for v in later:
        for free in (5, 123456789, 1234567890):
            t = _meminfo(max(0, v), free)
            buf[:len(t)] = t
            if fn(first, off, len(t)):
                assert v >= floor_kb and free == 5, (v, free)
    buf[:len(text)] = text
    assert not fn(first, off, off + 3)           # a short read
    # the name inside another line where the line was, also after MemFree narrowed by a digit
    wide = _meminfo(kb, 123456789)
    buf[:len(wide)] = wide
    moved = meminfo.fast_check(buf, len(wide), meminfo.fast_prefixes(floor), floor)
    for fn, first, off in (check, moved):
        for free in (5, 123456789, 1234567890, 1):
            for x in (b"XMemAvailable:   99999999999 kB\n", b"X" * (len(str(kb)) + 3) + b"\n"):
                t = _meminfo(0, free, x)
                buf[:len(t)] = t
                assert not fn(first, off, len(t)), (free, x)


def test_the_fast_path_is_made_only_from_a_line_as_the_kernel_prints_it():
    """A value not padded to 8 columns, or with a leading zero, is no kernel's: no fast path."""
    from sparkguard import meminfo
    for line in (b"MemAvailable:   5242880 kB\n", b"MemAvailable:   052428800 kB\n", b"MemAvailable: 52428800 kB\n"):
        text = bytearray(b"MemTotal:       130000000 kB\nMemFree:        %8d kB\n" % 5 + line + b"Buffers: 0 kB\n")
        assert meminfo.fast_check(text, len(text), meminfo.fast_prefixes(2**30), 2**30) is None, line
    text = bytearray(_meminfo(5242880))
    assert meminfo.fast_check(text, len(text), meminfo.fast_prefixes(2**30), 2**30) is not None


def test_the_fast_path_prefixes_are_few_and_where_they_stop():
    from sparkguard import meminfo
    for floor in (0, 1, 1023, 1024, 786432 * 1024, 7495270 * 1024, 99899999 * 1024):
        p = meminfo.fast_prefixes(floor)
        assert p is not None and 1 <= len(p) <= 72 and all(x.startswith(b"\n" + meminfo.FAST_LABEL) for x in p)
    assert meminfo.fast_prefixes(1)[-1] == b"\n" + meminfo.FAST_LABEL + b"       1"   # rounded up to whole kB
    assert meminfo.fast_prefixes(99999999 * 1024) is None       # rounds up to 10^8 kB: 9 digits
    assert meminfo.fast_prefixes(10**8 * 1024) is None

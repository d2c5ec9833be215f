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
found (``proctree.status_mem``, what the incident's tree rows show); ``argv``, ``creds`` and ``stat`` (ppid, nice) the
:mod:`sparkguard.host.procview` readers doctor uses.

Regenerate after a deliberate change of a reader: ``python3 tests/test_kernel_fixtures.py``
rewrites every expected.json; read the diff before committing it.
"""

from __future__ import annotations

import dataclasses
import json
import os
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
    out["memory"] = {str(pid): list(proctree.status_mem(pid, root=str(proc))) for pid in sorted(procs)}
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


def _floor_kb(floor: int) -> int:
    """``floor`` bytes in whole kB, rounded up."""
    return -(-floor // 1024)


def _fast_possible(kb: int, floor: int) -> bool:
    """Where the fast path must have a check for a read of ``kb`` against ``floor`` bytes: at or
    above the floor in kB rounded up to tens (meminfo.FastCheck compares all columns but the
    last), and a floor under meminfo.FAST_MAX_FLOOR_KB."""
    f = _floor_kb(floor)
    return kb >= 10 * -(-f // 10) and f < meminfo.FAST_MAX_FLOOR_KB


def _read_into(view: list, text: bytes) -> int:
    """What ``os.preadv(fd, view, 0)`` does with a file holding ``text``: fill the buffers in
    order, stop at the text's end; the bytes read."""
    done = 0
    for b in view:
        chunk = text[done:done + len(b)]
        b[:len(chunk)] = chunk
        done += len(chunk)
    return done


@pytest.mark.parametrize("case", [c for c in CASES if (FIXTURES / c / "proc" / "meminfo").exists()])
def test_the_fast_path_check_agrees_with_the_full_parser_or_gives_up(case):
    """meminfo.fast_check (the idle fast path's check) on each fixture meminfo, for floors just
    below, at and just above the value the full parser (meminfo.field) reads: there is a check
    only where that value is at or above the floor, and a real preadv of the file into its
    buffers passes it; the value other threads read (MeminfoReader.available_now) is that value;
    a file the full parser refuses, or one whose line is not laid out as the kernel's, gives no
    fast path at all (fast_layout -1), so the guard takes full passes."""
    path = FIXTURES / case / "proc" / "meminfo"
    text = bytearray(path.read_bytes())
    try:
        want = meminfo.field(text, meminfo.AVAIL_LABEL)
    except ValueError:
        want = None
    at = meminfo.fast_layout(text, len(text))
    if want is None:
        assert at == -1
        assert meminfo.fast_check(text, len(text), 2**30) is None
        return
    reader = meminfo.MeminfoReader(str(path))
    try:
        assert reader.available_now() == want
        fd = reader.fd
        for floor in (want - 20480, want - 4096, want - 1024, want, want + 1, want + 1024, 0, 2**30, want // 2):
            floor = max(0, floor)
            check = meminfo.fast_check(text, len(text), floor)
            if check is None:
                assert at < 0 or not _fast_possible(want >> 10, floor), (floor, want)
                continue
            assert want >= floor, (floor, want)
            assert check.holds(os.preadv(fd, check.view, 0))
    finally:
        reader.close()


def _meminfo(kb: int, free: int = 5, before: bytes = b"") -> bytes:
    """The kernel's first lines of /proc/meminfo with MemAvailable ``kb`` (fs/proc/meminfo.c:
    ``%8lu`` after a 16-column label, wider from 10^8 kB) after a MemFree of ``free`` kB and
    the lines ``before``."""
    return b"MemTotal:       %8d kB\nMemFree:        %8d kB\n%sMemAvailable:   %8d kB\nBuffers:        %8d kB\n" % (
        130000000, free, before, kb, 123456)


VALUES_KB = [0, 7, 9, 10, 999, 1000, 1234567, 7495270, 7500000, 9999999, 10000000, 12345678, 99999999, 100000000,
             120586240, 999999999, 1000000000, 9999999999, 10**11, 10**12 - 1, 10**20 - 1]


@pytest.mark.parametrize("kb", VALUES_KB)
@pytest.mark.parametrize("floor_kb", [0, 1, 786432, 7495270, 7500001, 12345678, 99999990, 99999999, 100000000,
                                      120586240, 123456789, 999999999, 10**10, 10**11 - 1, 10**11])
def test_the_fast_path_check_holds_only_at_or_above_the_floor_for_every_later_read(kb, floor_kb):
    """The check made from a read of ``kb`` holds on a later read only where that read's value is
    at or above the floor, whatever its width (the kernel widens the field from 10^8 kB on); it
    holds on the read it was made from; and it gives up when MemFree's width moves the line, the
    name stands inside another line where the line was, or the read is short.  Where a check
    must exist (at or above the floor rounded up to tens of kB, under FAST_MAX_FLOOR_KB), it does."""
    floor = floor_kb * 1024
    text = bytearray(_meminfo(kb))
    check = meminfo.fast_check(text, len(text), floor)
    assert (check is not None) == _fast_possible(kb, floor)
    if check is None:
        return
    assert check.holds(_read_into(check.view, text))
    rng = random.Random(kb * 7919 + floor_kb)
    later = VALUES_KB + [floor_kb - 1, floor_kb, floor_kb + 1] + [rng.randrange(10 ** rng.randrange(1, 14))
                                                                    for _ in range(300)]
    for v in (max(0, v) for v in later):
        for free in (5, 123456789, 1234567890, 1):
            if check.holds(_read_into(check.view, _meminfo(v, free))):
                assert v >= floor_kb and free < 10**8, (v, free)
    assert not check.holds(_read_into(check.view, text[:check.size - 1]))        # a short read
    # the name inside another line where the line was, also after MemFree widened or narrowed;
    # after an empty line the line moved by one is the line (MemAvailable 0: it holds on a floor of 0)
    wide = bytearray(_meminfo(kb, 123456789))
    moved = meminfo.fast_check(wide, len(wide), floor)
    for c in (check, moved):
        for free in (5, 123456789, 1234567890, 1):
            for x in (b"XMemAvailable:   99999999999 kB\n", b"X" * (len(str(kb)) + 3) + b"\n", b"\n"):
                assert not c.holds(_read_into(c.view, _meminfo(0, free, x))) or floor_kb == 0, (free, x)


def test_the_fast_path_check_holds_on_the_real_proc_meminfo():
    """A check made from a real read of /proc/meminfo holds on the next real read through the
    reader's descriptor (MemAvailable moves by far less than the floor's distance between them)."""
    reader = meminfo.MeminfoReader()
    try:
        avail, _ = reader.sample()
        check = reader.fast_check(avail // 2)
        assert check is not None
        assert check.holds(os.preadv(reader.fd, check.view, 0))
        assert reader.fast_check(avail * 2) is None
    finally:
        reader.close()


def test_the_fast_path_is_made_only_from_a_line_as_the_kernel_prints_it():
    """A value not padded to 8 columns, or with a leading zero, is no kernel's: no fast path."""
    for line in (b"MemAvailable:   5242880 kB\n", b"MemAvailable:   052428800 kB\n", b"MemAvailable: 52428800 kB\n"):
        text = bytearray(b"MemTotal:       130000000 kB\nMemFree:        %8d kB\n" % 5 + line + b"Buffers: 0 kB\n")
        assert meminfo.fast_check(text, len(text), 2**30) is None, line
    text = bytearray(_meminfo(5242880))
    assert meminfo.fast_check(text, len(text), 2**30) is not None


def test_the_fast_path_window_is_narrow_under_the_default_floor_and_reads_only_the_line():
    """Under a floor of 8 digits or fewer the window covers 7 of the value's columns whatever the
    value's width (a 9-digit MemAvailable of a 128 GB machine included); a read copies the text
    up to the value's 8th column and no more."""
    floor = 7497000 * 1024          # the default line (0.75 GiB) + poll_interval * FILL_RATE (6.4 GiB)
    for kb in (7500000, 99999999, 125829120):
        text = bytearray(_meminfo(kb))
        check = meminfo.fast_check(text, len(text), floor)
        assert check.low == b"\n" + meminfo.FAST_LABEL + b" 749700" and len(check.last) == 1
        assert check.size == text.index(b"MemAvailable:") + len(meminfo.FAST_LABEL) + 8


def test_the_memory_signals_are_memavailable_alone_or_with_swapfree():
    """``guard.signal`` as every reader of it computes it (:func:`sparkguard.meminfo.signal_bytes`)."""
    a, s = 40 << 30, 6 << 30
    assert {k: meminfo.signal_bytes(k, a, s) for k in meminfo.SIGNALS} == {"available": a, "available+swap": a + s}

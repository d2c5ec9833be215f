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


@pytest.mark.parametrize("case", [c for c in CASES if (FIXTURES / c / "proc" / "meminfo").exists()])
def test_the_fast_path_check_agrees_with_the_full_parser_or_gives_up(case):
    """meminfo.fast_above (the idle fast path's check, bytes against the floor's pattern) on each
    fixture meminfo, for floors just below, at and just above the value the full parser
    (meminfo.field) reads: it says "above" only where that value is at or above the floor, and its
    value (fast_value) is that value; a file the full parser refuses, or one whose line is not laid
    out as the kernel's, gives no fast path at all (fast_layout -1), so the guard takes full passes."""
    from sparkguard import meminfo
    text = (FIXTURES / case / "proc" / "meminfo").read_bytes()
    try:
        want = meminfo.field(text, meminfo.AVAIL_LABEL)
    except ValueError:
        want = None
    at = meminfo.fast_layout(text, len(text))
    if want is None:
        assert at == -1
        return
    for floor in (want - 4096, want - 1024, want, want + 1, want + 1024, 0, 2**30):
        pattern = meminfo.fast_floor(max(0, floor))
        if at < 0 or pattern is None:
            continue
        raw = meminfo.fast_above(text, len(text), at, *pattern)
        if raw is None:
            assert want < floor, (floor, want)
        else:
            assert want >= floor, (floor, want)
            assert meminfo.fast_value(raw) in (want, None)


@pytest.mark.parametrize("kb", [0, 7, 999, 1234567, 9999999, 12345678, 99999999, 100000000, 120586240,
                                9999999999])
@pytest.mark.parametrize("floor_kb", [1, 786432, 7495270, 12345678, 99999999, 100000000, 120586240, 123456789,
                                      999999999])
def test_the_fast_path_check_compares_as_numbers_across_widths(kb, floor_kb):
    """The MemAvailable line as the kernel prints it (fs/proc/meminfo.c: value right-aligned in 8
    columns, wider from 10^8 kB), after a MemFree line of another width: the byte compare gives the
    numeric answer for values of every width, and the fast path follows the line when MemFree's
    width changes (the old offset no longer holds the label: the check gives up)."""
    from sparkguard import meminfo
    text = b"MemTotal:       %8d kB\nMemFree:        %8d kB\nMemAvailable:   %8d kB\nBuffers:  0 kB\n" % (
        130000000, 5, kb)
    at = meminfo.fast_layout(text, len(text))
    assert at == text.index(b"MemAvailable:")
    raw = meminfo.fast_above(text, len(text), at, *meminfo.fast_floor(floor_kb * 1024))
    assert (raw is not None) == (kb >= floor_kb)
    if raw is not None:
        assert meminfo.fast_value(raw) == kb * 1024
    wider = text.replace(b"MemFree:               5", b"MemFree:        123456789")
    assert meminfo.fast_above(wider, len(wider), at, *meminfo.fast_floor(floor_kb * 1024)) is None
    assert meminfo.fast_above(text, at + 20, at, *meminfo.fast_floor(floor_kb * 1024)) is None   # short read


def test_the_fast_path_patterns_and_where_it_stays_off():
    from sparkguard import meminfo
    assert meminfo.fast_floor(1) == (8, b"       1 kB\n")        # rounded up to whole kB
    assert meminfo.fast_floor(10**8 * 1024 - 1024) == (8, b"99999999 kB\n")
    assert meminfo.fast_floor(10**8 * 1024) == (9, b"100000000 kB")
    assert meminfo.fast_floor(10**9 * 1024) is None                 # 954 GiB: full passes only

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
:func:`sparkguard.buddyinfo.read` (only for the cases that have the file); ``procs``
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

from sparkguard import buddyinfo, meminfo, proctree, sysinfo
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
def test_the_fast_path_parser_gives_the_full_parsers_value_or_gives_up(case):
    """meminfo.quick_available (the idle fast path) on each fixture meminfo gives what the full
    parser (meminfo.field) reads, or gives up (-1 or ValueError, which end the fast path and send
    the guard to the full pass): never another value, so a hostile file cannot keep the guard idle."""
    from sparkguard import meminfo
    text = (FIXTURES / case / "proc" / "meminfo").read_bytes()
    try:
        want = meminfo.field(text, meminfo.AVAIL_LABEL)
    except ValueError:
        want = None
    try:
        got = meminfo.quick_available(text, len(text))
    except ValueError:
        got = None
    assert got in (None, -1) or got == want, (got, want)

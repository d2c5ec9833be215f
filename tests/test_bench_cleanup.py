"""bench/headtohead.py leaves no guard or hog behind when it is stopped: SIGINT/SIGTERM unwind
through its cleanup, and a SIGKILLed bench takes its PID namespaces with it (PDEATHSIG on
unshare, ``--kill-child`` on the namespace's init).  Real bench, real namespaces, real signals."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import ROOT, mem_available, sg_env

GiB = 1 << 30


def _stat(pid: int) -> tuple[int, str, int] | None:
    """(ppid, state, starttime) of a live process, None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            rest = f.read().rsplit(") ", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(rest[1]), rest[0], int(rest[19])


def _descendants(root: int) -> dict[int, int]:
    """{pid: starttime} of every process below ``root`` (not ``root`` itself)."""
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            st = _stat(int(d))
            if st:
                kids.setdefault(st[0], []).append(int(d))
    out, todo = {}, list(kids.get(root, ()))
    while todo:
        p = todo.pop()
        st = _stat(p)
        if st:
            out[p] = st[2]
            todo.extend(kids.get(p, ()))
    return out


def _alive(pid: int, starttime: int) -> bool:
    st = _stat(pid)
    return st is not None and st[2] == starttime and st[1] not in ("Z", "X")


@pytest.mark.parametrize("sig,status", [(signal.SIGTERM, 143), (signal.SIGINT, 130), (signal.SIGKILL, -9)])
def test_stopped_bench_leaves_no_namespace_behind(tmp_path, root_only, sig, status):
    # the bench refuses below 8 GiB and measures one thread's fill rate with 1 GiB first
    if mem_available() < 10 * GiB:
        pytest.skip("the bench needs 8 GiB MemAvailable (+1 GiB for its calibration)")
    work = tmp_path / "tmp"            # the bench's work folders (tempfile honours TMPDIR)
    work.mkdir()
    p = subprocess.Popen([sys.executable, str(ROOT / "bench" / "headtohead.py"), "--idle-only", "--only",
                          "sparkguard", "--idle-seconds", "300", "--csv", str(tmp_path / "h.csv")],
                         cwd=ROOT, env=sg_env(TMPDIR=str(work)), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    seen, inside, left = [], {}, {}
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            line = p.stdout.readline()
            if not line:
                break
            seen.append(line)
            if line.startswith("idle: sparkguard"):
                break
        inside = _descendants(p.pid)
        assert seen and seen[-1].startswith("idle: sparkguard"), "".join(seen)
        # setpriv's exec of unshare, the namespace's init (sh) and the guard at least
        assert len(inside) >= 3, inside
        assert all(_alive(pid, st) for pid, st in inside.items())
        p.send_signal(sig)
        out, err = p.communicate(timeout=60)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and any(_alive(pid, st) for pid, st in inside.items()):
            time.sleep(0.05)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        for pid, st in inside.items():       # never leave them to the next test, even on failure
            if _alive(pid, st):
                try:
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        left[pid] = f.read().replace(b"\0", b" ").decode(errors="replace")
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
    assert not left, f"processes of the bench's namespaces outlived it: {left}"
    assert p.returncode == status, err
    if sig != signal.SIGKILL:
        assert f"stopped by {sig.name}" in err, err
        assert list(work.iterdir()) == []            # its work folders were removed too
    assert not (tmp_path / "h.csv").exists()        # no rows ran: nothing written

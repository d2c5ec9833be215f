"""The drill's own engine tree (sparkguard/drill/hog.py): shaped, titled and stopped like vLLM's.

Real processes read through the real /proc; each test kills its tree in ``finally`` (Tree.stop).
"""

from __future__ import annotations

import os
import signal
import time
import uuid

from sparkguard import config, proctree
from sparkguard.drill import hog


def _read(pid: int, name: str) -> str:
    with open(f"/proc/{pid}/{name}", "rb") as f:
        return f.read().decode().replace("\0", " ").strip()


def test_tree_looks_like_vllm_to_the_guard():
    model = f"sg-hog-{uuid.uuid4().hex[:10]}"
    opts = ("--tp", "2", "--hold", "8MiB", "--hold-core", "8MiB", "--hold-api", "8MiB")
    tree = hog.start(model, *opts)
    try:
        top, core, w0, w1 = tree.pids(timeout=60)
        assert proctree.short_title(_read(top, "cmdline")) == " ".join(("vllm", "serve", model) + opts)
        assert config.is_vllm(hog.command(model))
        assert [_read(p, "comm") for p in (core, w0, w1)] == ["VLLM::EngineCor", "VLLM::Worker_TP", "VLLM::Worker_TP"]
        assert [_read(p, "cmdline") for p in (core, w0, w1)] == ["VLLM::EngineCore", "VLLM::Worker_TP0",
                                                                 "VLLM::Worker_TP1"]
        ppid = {p: int(_read(p, "stat").rsplit(") ", 1)[1].split()[1]) for p in (core, w0, w1)}
        assert ppid == {core: top, w0: core, w1: core}
        assert len({os.getpgid(p) for p in (top, core, w0, w1)}) == 1
        # SIGTERM to the top alone takes the whole tree down, the top exiting 0
        t0 = time.monotonic()
        os.kill(top, signal.SIGTERM)
        assert tree.wait_gone([top, core, w0, w1], timeout=10)
        assert time.monotonic() - t0 >= hog.EXIT_DELAY
        assert tree.proc.wait(10) == 0
    finally:
        tree.stop()


def test_fill_on_sigusr1_and_ignore_term():
    tree = hog.start(f"sg-hog-{uuid.uuid4().hex[:10]}", "--tp", "1", "--hold", "8MiB", "--fill-size", "64MiB",
                     "--fill-rate", "256MiB/s", "--ignore-term")
    try:
        pids = tree.pids(timeout=60)
        before = int(_read(pids[2], "statm").split()[1]) * os.sysconf("SC_PAGE_SIZE")
        tree.start_fill()
        assert tree.wait_line(" done", timeout=30).startswith(f"fake-vllm: fill pid={pids[2]} bytes=67108864 ")
        after = int(_read(pids[2], "statm").split()[1]) * os.sysconf("SC_PAGE_SIZE")
        assert after - before >= 60 << 20
        for p in pids:
            os.kill(p, signal.SIGTERM)
        time.sleep(0.5)
        assert not any(tree.exited(p) for p in pids), "a process of an --ignore-term tree obeyed SIGTERM"
    finally:
        tree.stop()
    assert tree.proc.returncode == -signal.SIGKILL


MiB = 1 << 20
#: a process of the test's own that takes touched memory when told (a line on stdin) and holds it
#: until its stdin closes
_HOLD = ("import sys\nfrom sparkguard.drill.hog import Memory\nm = Memory()\nsys.stdin.readline()\n"
         "m.add(int(sys.argv[1]))\nprint('held', flush=True)\nsys.stdin.read()\n")


def _holder(nbytes: int):
    """Start the holder (imports done, nothing taken yet); :func:`_take` makes it take ``nbytes``."""
    import subprocess
    import sys
    return subprocess.Popen([sys.executable, "-c", _HOLD, str(nbytes)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)


def _take(p) -> None:
    p.stdin.write("\n")
    p.stdin.flush()
    assert p.stdout.readline().strip() == "held"


def _release(p) -> None:
    p.stdin.close()
    p.wait(10)


def _filled(line: str) -> int:
    return int(line.split(" bytes=")[1].split()[0])


def _level_fill(level: int, rate: str, cap: str = "3GiB"):
    return hog.start(f"sg-hog-{uuid.uuid4().hex[:10]}", "--tp", "1", "--hold", "8MiB", "--fill-size", cap,
                     "--fill-to", str(level), "--fill-rate", rate)


def test_a_fill_to_a_level_goes_as_low_as_planned_whatever_other_work_frees_or_takes():
    """The drill's fill stops at a MemAvailable level, not after a byte count: memory another
    process frees meanwhile is filled too (the drill still reaches its line), memory another
    process takes is not (the drill goes no lower than planned).

    The assertions are on MemAvailable when the fill says it is done, the property the drill
    relies on: a fill that counted bytes instead ends 768 MiB above the level in the first case
    and 384 MiB below it in the second, well outside the slack; the bytes filled are not (beyond
    a loose bound), as the rest of a shared host may free or take memory during the seconds a fill
    runs."""
    from conftest import mem_available, settled_mem_available as _settled
    import pytest
    if mem_available() < 8 << 30:
        pytest.skip("not enough MemAvailable for 2 GiB of fills on this host right now")
    slack = 256 * MiB                       # what the rest of the host may move meanwhile
    # another process frees 768 MiB while the fill runs: it fills those as well, down to the level
    other = _holder(768 * MiB)
    _take(other)
    level = _settled() - 512 * MiB
    tree = _level_fill(level, "256MiB/s")
    try:
        tree.pids(timeout=60)
        tree.start_fill()
        _release(other)
        done = tree.wait_line(" done", timeout=60)
        at_done = mem_available()
        assert done.endswith(" done level"), done
        assert abs(at_done - level) < slack, (done, at_done, level)
        assert _filled(done) > 512 * MiB, done
    finally:
        tree.stop()
        if other.poll() is None:
            _release(other)
    # another process takes 384 MiB while it runs: the fill stops at the level, 384 MiB early
    other = _holder(384 * MiB)
    level = _settled() - 512 * MiB
    tree = _level_fill(level, "128MiB/s")
    try:
        tree.pids(timeout=60)
        tree.start_fill()
        _take(other)                    # within ~0.3 s; the fill needs 4 s to the level alone
        done = tree.wait_line(" done", timeout=60)
        at_done = mem_available()
        assert done.endswith(" done level"), done
        assert abs(at_done - level) < slack, (done, at_done, level)
    finally:
        tree.stop()
        _release(other)

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

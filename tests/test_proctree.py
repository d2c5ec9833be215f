"""Target choice on real process trees (fake vLLM engines started by the test)."""

import os

import pytest

from guardrun import unique
from sparkguard import config, fake_engine, proctree


def cfg(*patterns, protect=()):
    return config.TargetsConfig(match=tuple(patterns), protect=tuple(protect) or config.TargetsConfig().protect)


@pytest.mark.parametrize("details", [True, False])
def test_same_pattern_the_larger_tree_first_and_the_root_is_the_api_server(engine_factory, details):
    small = engine_factory("--hold", "16MiB")
    big = engine_factory("--hold", "160MiB")
    pat = rf"vllm serve ({small.model}|{big.model})\b"
    ts = proctree.find_targets(cfg(pat, r"^VLLM::"), details=details)
    mine = [t for t in ts if t.root_pid in (small.top_pid, big.top_pid)]
    assert [t.root_pid for t in mine] == [big.top_pid, small.top_pid]
    t = mine[0]
    # the whole tree, root first; the VLLM:: children do not make roots of their own
    assert t.pids[0] == big.top_pid and set(big.pids()) <= set(t.pids)
    assert not any(x.root_pid in big.pids()[1:] for x in ts)
    assert t.title == f"vllm serve {big.model} --hold 160MiB"
    if details:
        rows = {r["pid"]: r for r in t.tree}
        assert rows[big.worker_pids[0]]["title"] == "VLLM::Worker_TP0"
        assert rows[big.worker_pids[0]]["comm"] == "VLLM::Worker_TP"
        assert t.mem_bytes > 2 * 160 * 1024**2
    else:
        assert t.tree == []
        proctree.add_details(t, proctree.scan())
        assert t.mem_bytes > 2 * 160 * 1024**2 and len(t.tree) == len(t.pids)


def test_configured_order_beats_memory(engine_factory):
    small = engine_factory("--hold", "16MiB")
    big = engine_factory("--hold", "160MiB")
    ts = proctree.find_targets(cfg(rf"vllm serve {small.model}\b", rf"vllm serve {big.model}\b"), details=False)
    assert [t.root_pid for t in ts][:2] == [small.top_pid, big.top_pid]


def test_protected_and_self_and_kernel_threads_are_never_targets(engine_factory):
    fe = engine_factory("--hold", "16MiB")
    ts = proctree.find_targets(cfg(rf"vllm serve {fe.model}\b", protect=[r"python3.*"]))
    assert fe.top_pid not in [t.root_pid for t in ts]
    # this test process itself matches ".*" but is sparkguard's "self" here; kthreads have no cmdline
    ts = proctree.find_targets(cfg(r"."), self_pid=os.getpid())
    assert os.getpid() not in [t.root_pid for t in ts]
    assert all(not proctree.read_proc(t.root_pid).kthread for t in ts if proctree.read_proc(t.root_pid))
    assert 1 not in [t.root_pid for t in ts]


def test_short_title():
    st = proctree.short_title
    assert st("/usr/bin/python3 /usr/local/bin/vllm serve Qwen/Qwen3 --tp 2") == "vllm serve Qwen/Qwen3 --tp 2"
    assert st("python3 -m vllm.entrypoints.openai.api_server --model M") == \
        "python3 -m vllm.entrypoints.openai.api_server --model M"
    assert st("VLLM::Worker_TP0") == "VLLM::Worker_TP0"
    assert st("/opt/tritonserver/bin/tritonserver --model-repository=/m") == "tritonserver --model-repository=/m"
    assert st("", "kthreadd") == "kthreadd"
    assert st("x" * 300).endswith("…") and len(st("x" * 300)) == 160


def test_a_launcher_that_only_mentions_the_engine_is_not_the_root(engine_factory, tmp_path):
    """launcher (argv mentions "vllm serve M") -> a middle process that does not match -> the engine,
    and an unrelated child of the launcher.  The root is where the unbroken chain of matching
    processes starts, so neither the launcher nor its other child is in the tree."""
    import json
    import subprocess
    import sys
    model = unique("sgpt")
    middle = ("import json, os, subprocess, sys\n"
              "e = subprocess.Popen(json.loads(os.environ['SG_ENGINE']))\n"
              "print(e.pid, flush=True); e.wait()\n")
    launcher_code = ("import subprocess, sys, time\n"
                     f"m = subprocess.Popen([sys.executable, '-c', {middle!r}], stdout=subprocess.PIPE, text=True)\n"
                     "ed = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
                     "print(m.stdout.readline().strip(), ed.pid, flush=True); time.sleep(120)\n")
    env = dict(os.environ, SG_ENGINE=json.dumps(fake_engine.command(model)))
    launcher = subprocess.Popen([sys.executable, "-c", launcher_code, f"vllm serve {model}"],
                                stdout=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        eng_pid, ed_pid = map(int, launcher.stdout.readline().split())
        ts = proctree.find_targets(cfg(rf"vllm serve {model}\b"))
        # the launcher matches too, as a tree of its own; the engine's tree is first (more memory)
        # and holds neither the launcher nor the launcher's unrelated child
        assert ts[0].root_pid == eng_pid
        assert ed_pid not in ts[0].pids and launcher.pid not in ts[0].pids
    finally:
        import signal
        os.killpg(launcher.pid, signal.SIGKILL)   # the launcher's session: everything this test started
        launcher.wait(10)

"""Target choice on real process trees (fake vLLM engines started by the test)."""

import os

import pytest

from conftest import fake_vllm
from guardrun import unique
from sparkguard import config, enginetree, proctree


def cfg(*patterns, protect=()):
    return config.TargetsConfig(match=tuple(patterns), protect=tuple(protect) or config.TargetsConfig().protect)


@pytest.mark.parametrize("details", [True, False])
def test_same_pattern_the_larger_tree_first_and_the_root_is_the_api_server(engine_factory, details):
    small = engine_factory("--hold", "16MiB")
    big = engine_factory("--hold", "160MiB")
    pat = rf"vllm serve ({small.model}|{big.model})\b"
    ts = enginetree.find_targets(cfg(pat, r"^VLLM::"), details=details)
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
        enginetree.add_details(t, proctree.scan())
        assert t.mem_bytes > 2 * 160 * 1024**2 and len(t.tree) == len(t.pids)


def test_configured_order_beats_memory(engine_factory):
    small = engine_factory("--hold", "16MiB")
    big = engine_factory("--hold", "160MiB")
    ts = enginetree.find_targets(cfg(rf"vllm serve {small.model}\b", rf"vllm serve {big.model}\b"), details=False)
    assert [t.root_pid for t in ts][:2] == [small.top_pid, big.top_pid]


def test_protected_and_self_and_kernel_threads_are_never_targets(engine_factory):
    fe = engine_factory("--hold", "16MiB")
    ts = enginetree.find_targets(cfg(rf"vllm serve {fe.model}\b", protect=[r"python3.*"]))
    assert fe.top_pid not in [t.root_pid for t in ts]
    # this test process itself matches ".*" but is sparkguard's "self" here; kthreads have no cmdline
    ts = enginetree.find_targets(cfg(r"."), self_pid=os.getpid())
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
    env = dict(os.environ, SG_ENGINE=json.dumps(fake_vllm.command(model)))
    launcher = subprocess.Popen([sys.executable, "-c", launcher_code, f"vllm serve {model}"],
                                stdout=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        eng_pid, ed_pid = map(int, launcher.stdout.readline().split())
        ts = enginetree.find_targets(cfg(rf"vllm serve {model}\b"))
        # the launcher matches too, as a tree of its own; the engine's tree is first (more memory)
        # and holds neither the launcher nor the launcher's unrelated child
        assert ts[0].root_pid == eng_pid
        assert ed_pid not in ts[0].pids and launcher.pid not in ts[0].pids
    finally:
        import signal
        os.killpg(launcher.pid, signal.SIGKILL)   # the launcher's session: everything this test started
        launcher.wait(10)


# ---- hostile /proc processes: a zombie leader, control characters in argv ----------------------

SYS_EXIT = {"x86_64": 60, "aarch64": 93}


def _start(code: str, *argv: str):
    import subprocess
    import sys
    p = subprocess.Popen([sys.executable, "-c", code, *argv], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    return p


def test_a_zombie_leader_is_found_signalled_and_its_memory_counted():
    """The main thread exits (the exit syscall, not exit_group) while another thread holds 64 MiB:
    /proc/PID/cmdline is empty and /proc/PID/status has no VmRSS, yet the process is matched (a live
    thread's cmdline), its memory counted (a live thread's status) and a SIGTERM ends it."""
    import platform
    import select
    import signal
    import time
    if platform.machine() not in SYS_EXIT:
        pytest.skip(f"exit syscall number unknown for {platform.machine()}")
    tag = unique("sgzombie")
    code = ("import ctypes, threading, time\n"
            "hold = b'\\x01' * (64 << 20)\n"
            "threading.Thread(target=time.sleep, args=(600,)).start()\n"
            "print('ready', flush=True)\n"
            f"ctypes.CDLL(None).syscall({SYS_EXIT[platform.machine()]}, 0)\n")
    p = _start(code, tag)
    try:
        # the leader shows as a zombie (state Z) once its thread is gone
        fd = os.pidfd_open(p.pid)
        deadline = time.monotonic() + 10
        while proctree.read_limited(f"/proc/{p.pid}/stat").split(b") ")[1][:1] != b"Z":
            assert time.monotonic() < deadline, "the main thread did not exit"
            select.select([p.stdout], [], [], 0.02)      # nothing signals a thread's exit to others
        assert proctree.read_limited(f"/proc/{p.pid}/cmdline") == b""
        assert b"VmRSS" not in proctree.read_limited(f"/proc/{p.pid}/status")
        ts = enginetree.find_targets(cfg(tag))
        assert [t.root_pid for t in ts] == [p.pid]
        assert ts[0].tree[0]["cmdline"].endswith(tag)
        assert ts[0].mem_bytes >= 64 << 20
        from sparkguard import signals
        tree = signals.Tree(ts[0].pids, ts[0].starttimes, root=p.pid)
        assert tree.term_root()
        assert select.select([fd], [], [], 10)[0], "SIGTERM did not end the process"
        assert p.wait(10) == -signal.SIGTERM
        tree.close()
        os.close(fd)
    finally:
        p.kill()
        p.wait(10)


def test_control_characters_from_proc_are_escaped_in_titles_logs_and_journal(tmp_path):
    """A real process whose argv carries a newline and an ESC: every string read from its /proc
    entry has them written out, so the guard's log and the journal entry hold one line each."""
    import socket
    from conftest import mem_available
    from guardrun import GuardProc
    from sparkguard import reporter
    tag = unique("sgnl")
    forged = "\nERROR sparkguard forged\x1b[2J"
    p = _start("import time\nprint('ready', flush=True)\ntime.sleep(600)\n", tag + forged)
    try:
        proc = proctree.read_proc(p.pid)
        assert "\n" not in proc.cmdline and "\x1b" not in proc.cmdline
        assert proc.cmdline.endswith(tag + "\\nERROR sparkguard forged\\x1b[2J")
        t = enginetree.find_targets(cfg(tag))[0]
        assert "\\n" in t.title and all(c.isprintable() for c in t.title)
        # the journal entry of an event naming it (the reporter over a real datagram socket)
        path = str(tmp_path / "journal.sock")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.bind(path)
        sock.settimeout(10)
        rep = reporter.Reporter(str(tmp_path / "inc"), "on", journal_socket=path)
        rep.event({"id": "x", "kind": "memory", "target": {"root_pid": t.root_pid, "title": t.title}},
                  {"event": "sigterm", "t": 0.0, "at": 0.0, "available_bytes": 1, "pids": [t.root_pid],
                   "detail": f"SIGTERM {t.title} (pid {t.root_pid})"})
        entry = sock.recv(65536)
        rep.close()
        sock.close()
        assert b"\x1b" not in entry
        # every field KEY=value on one line (the binary form would mean a value with a newline)
        assert all(b"=" in line for line in entry.splitlines()), entry
        assert b"SPARKGUARD_TARGET_TITLE=" + t.title.encode() in entry
        # the daemon's log: the armed target is logged at start-up, one line
        g = GuardProc({"guard": {"term_below": "64MiB"}, "targets": {"match": [tag]}})
        try:
            g.wait_ready()
            log_text = g.wait_log("targets now:")
        finally:
            g.stop()
        assert not [ln for ln in log_text.splitlines() if ln.startswith("ERROR sparkguard forged")]
        assert "\x1b" not in log_text and tag + "\\nERROR sparkguard forged" in log_text
        assert mem_available() > 0
    finally:
        p.kill()
        p.wait(10)


def test_a_huge_argv_is_read_only_up_to_the_limit():
    """Any local user can pass ~2 MiB of argv (control bytes escape to 4 characters each): a scan
    reads at most CMDLINE_LIMIT of it, so one process cannot make each /proc pass slow and the
    guard's (locked) memory large."""
    import subprocess
    import sys
    name = unique()
    # 16 arguments of 120 KiB (MAX_ARG_STRLEN is 128 KiB per argument): ~1.9 MiB of \x01
    junk = ["\x01" * (120 * 1024)] * 16
    p = subprocess.Popen([sys.executable, "-c", "import sys; print('up', flush=True); sys.stdin.read()", name, *junk],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        # the child's word that it runs: the exec has set its argv (Popen returns a little earlier)
        assert p.stdout.readline() == b"up\n"
        proc = proctree.read_proc(p.pid)
        assert proc is not None and name in proc.cmdline
        # escaped: 4 characters for each of at most CMDLINE_LIMIT bytes
        assert len(proc.cmdline) <= 4 * proctree.CMDLINE_LIMIT, len(proc.cmdline)
        assert "\x01" not in proc.cmdline and proc.cmdline.startswith(sys.executable)
    finally:
        p.stdin.close()
        p.wait(10)

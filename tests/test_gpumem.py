"""Each process's GPU memory from NVML (sparkguard.gpumem): the reader on the NVML test double
(tests/fakes/nvml/pynvml.py, nvidia-ml-py's names and error codes), its thread, the engine order
it changes (real processes), and a real daemon showing it in status, metrics and the incident.

The real NVML figure against ``nvidia-smi --query-compute-apps`` is checked on the GPU machine:
bench/nvml_check.py, its output in bench/results/nvml-h200.txt (docs/gpu-memory.md).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from conftest import ROOT, run_sparkguard, sg_env
from supervisor_helpers import READY_RE, Daemon, engine_config, fake_cmd, free_port, unique
from sparkguard import config, enginetree, gpumem

FAKES = Path(__file__).parent / "fakes" / "nvml"
sys.path.insert(0, str(FAKES))
import pynvml as fake  # noqa: E402  the test double, never the real nvidia-ml-py here
sys.path.remove(str(FAKES))

GiB, MiB = 1024**3, 1024**2


@pytest.fixture
def nvml():
    """The fake in its initial state; any reader installed by a test is removed after it."""
    fake.STATE = {"devices": []}
    fake.CALLS.clear()
    yield fake
    r = gpumem._SHARED
    gpumem.install(None)
    if r is not None:
        r.stop()


def test_read_once_sums_each_pid_over_devices_and_skips_what_nvml_cannot_say(nvml):
    nvml.STATE = {"devices": [
        {"procs": [{"pid": 100, "used": 2 * GiB}, {"pid": 200, "used": 512 * MiB}]},
        {"error": "NOT_SUPPORTED"},                                   # a device without accounting
        {"procs": [{"pid": 100, "used": 1 * GiB}, {"pid": 300, "used": None},   # NVML_VALUE_NOT_AVAILABLE
                   {"pid": 0, "used": 5}, {"pid": 400, "used": -1}, {"pid": 500, "used": 1 << 62}]},
    ]}
    nvml.nvmlInit()
    try:
        assert gpumem.read_once(nvml) == {100: 3 * GiB, 200: 512 * MiB}
        with pytest.raises(nvml.NVMLError_NotSupported):       # as on a GB10, and never called by gpumem
            nvml.nvmlDeviceGetMemoryInfo(nvml.nvmlDeviceGetHandleByIndex(0))
    finally:
        nvml.nvmlShutdown()


def test_the_thread_reads_on_its_cadence_and_ends_quietly_without_a_driver(nvml):
    nvml.STATE = {"devices": [{"procs": [{"pid": 4242, "used": 7 * GiB}]}]}
    r = gpumem.GpuMemory(interval=0.05, load=lambda: nvml).start()
    try:
        assert r.first.wait(10) and r.error == ""
        assert r.last == {4242: 7 * GiB} and r.fresh() == {4242: 7 * GiB}
        gpumem.install(r)
        assert gpumem.active() and gpumem.reading() == {4242: 7 * GiB}
        nvml.STATE = {"devices": [{"procs": []}]}
        deadline = time.monotonic() + 10
        while gpumem.reading() and time.monotonic() < deadline:
            r.stop_event.wait(0.05)
        assert gpumem.reading() == {} and gpumem.active()      # read, and nothing on the GPU
    finally:
        r.stop()
    assert nvml.CALLS[0] == "nvmlInit" and nvml.CALLS[-1] == "nvmlShutdown"
    # no driver: nvmlInit raises NVMLError_LibraryNotFound; the thread ends, nothing is read
    nvml.STATE = {"init_error": "LIBRARY_NOT_FOUND", "devices": []}
    r = gpumem.GpuMemory(interval=0.05, load=lambda: nvml).start()
    r.thread.join(10)
    assert not r.thread.is_alive() and r.first.is_set()
    assert r.error == "NVML not available: NVMLError_LibraryNotFound: NVML Shared Library Not Found"
    gpumem.install(r)
    assert not gpumem.active() and gpumem.reading() == {}


def test_without_nvidia_ml_py_nothing_is_imported_or_started():
    code = ("import sys; import sparkguard.guard.loop, sparkguard.proctree, sparkguard.gpumem as g; "
            "print(g.available(), g.start(), 'pynvml' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], env=sg_env(PYTHONPATH=str(ROOT)), capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    if out.stdout.split()[0] == "True":
        pytest.skip("nvidia-ml-py is installed on this machine")
    assert out.stdout.split() == ["False", "None", "False"]


ENGINE = r"""
import sys, time
n = int(sys.argv[2])
buf = bytearray(n)
for i in range(0, n, 4096):
    buf[i] = 1
print("up", flush=True)
sys.stdin.read()
"""


def test_gpu_memory_orders_engines_that_rss_would_order_the_other_way(nvml):
    """Two engine trees of the same pattern: A holds 96 MiB of RSS, B 16 MiB of RSS and, through
    the driver, 20 GiB that only NVML sees.  By RSS A is first; with NVML B is, and its rows
    carry gpu_bytes."""
    tag = unique("sggpu")
    procs = []
    try:
        for name, size in (("a", 96 * MiB), ("b", 16 * MiB)):
            p = subprocess.Popen([sys.executable, "-c", ENGINE, f"{tag}-{name}", str(size)], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True)
            assert p.stdout.readline().strip() == "up"
            procs.append(p)
        a, b = procs
        tcfg = config.TargetsConfig(match=(tag,))
        order = [t.root_pid for t in enginetree.find_targets(tcfg)]
        assert order == [a.pid, b.pid]
        nvml.STATE = {"devices": [{"procs": [{"pid": b.pid, "used": 20 * GiB}]}]}
        r = gpumem.GpuMemory(interval=0.05, load=lambda: nvml).start()
        assert r.first.wait(10)
        gpumem.install(r)
        ts = enginetree.find_targets(tcfg)
        assert [t.root_pid for t in ts] == [b.pid, a.pid]
        assert ts[0].mem_bytes >= 20 * GiB and ts[0].tree[0]["gpu_bytes"] == 20 * GiB
        assert ts[1].tree[0]["gpu_bytes"] == 0
        # the guard's fast path (details=False) orders tied trees by the same figure
        assert [t.root_pid for t in enginetree.find_targets(tcfg, details=False)] == [b.pid, a.pid]
    finally:
        for p in procs:
            p.kill()
            p.wait(10)


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return r.read().decode()


@pytest.mark.usefixtures("root_only")
def test_a_daemon_with_nvml_shows_the_engines_gpu_memory(tmp_path, monkeypatch):
    """A real ``sparkguard run`` that imports the NVML double (its JSON file says a worker of the
    supervised fake vLLM holds 3 GiB): ``engine status``, the metric and the guard incident's tree
    show it."""
    state = tmp_path / "nvml.json"
    state.write_text(json.dumps({"devices": [{"procs": []}]}))
    monkeypatch.setenv("PYTHONPATH", str(FAKES))
    monkeypatch.setenv("SG_FAKE_NVML", str(state))
    model, port, mport = unique(), free_port(), free_port()
    cfg = engine_config(tmp_path, model, fake_cmd(model, port), port)
    cfg["metrics"]["listen"] = f"127.0.0.1:{mport}"
    cfg["guard"].update(grace="3s", recovery_wait="60s")
    d = Daemon(tmp_path, cfg)
    try:
        d.wait_control()
        d.wait_line(r"gpumem: reading each process's GPU memory from NVML every 2 s")
        st = d.wait_ready(timeout=30)
        d.wait_line(READY_RE.pattern)       # the reader thread records the pids before it keeps the line
        pids = list(d.engine_pids)
        worker = pids[2]
        state.write_text(json.dumps({"devices": [{"procs": [{"pid": worker, "used": 3 * GiB}]},
                                                 {"procs": [{"pid": worker, "used": 1 * GiB}]}]}))
        deadline = time.monotonic() + 20         # the thread reads every 2 s
        while (st := d.status())["gpu_bytes"] != 4 * GiB and time.monotonic() < deadline:
            time.sleep(0.2)
        assert st["gpu_bytes"] == 4 * GiB, st
        r = run_sparkguard("engine", "--socket", d.socket, "status")
        assert "GPU memory (NVML): 4.00 GiB over the engine's processes" in r.stdout, r.stdout
        m = re.search(r"^sparkguard_engine_gpu_memory_bytes (\S+)$", scrape(mport), re.M)
        assert m and float(m.group(1)) == 4 * GiB
        # the guard's line above MemAvailable: it SIGTERMs the engine; the line back down closes the
        # incident, whose tree rows carry each process's figure as read when the target was chosen
        mark = d.mark()
        with open("/proc/meminfo") as f:
            total = next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("MemTotal:"))
        cfg["guard"]["term_below"] = total - 64 * MiB
        d.path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        d.proc.send_signal(signal.SIGHUP)
        d.wait_line(r"engine: guard: the memory guard sent SIGTERM to pid \d+ \(incident ", timeout=30, start=mark)
        d.wait_line(r"engine: exit: pid \d+ ", timeout=30, start=mark)
        cfg["guard"]["term_below"] = "128MiB"
        d.path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        d.proc.send_signal(signal.SIGHUP)
        inc = d.incident("memory", start=mark, timeout=60)
        rows = {r["pid"]: r for r in inc["target"]["tree"]}
        assert rows[worker]["gpu_bytes"] == 4 * GiB, rows
        assert all(r["gpu_bytes"] == 0 for pid, r in rows.items() if pid != worker)
        assert inc["target"]["mem_bytes"] >= 4 * GiB
        r = run_sparkguard("incidents", "--dir", cfg["incidents"]["dir"], "--no-journal", inc["id"])
        assert "RSS+swap+GPU)" in r.stdout and "(GPU 4.00 GiB)" in r.stdout, r.stdout
    finally:
        d.cleanup()
    assert os.environ.get("SG_FAKE_NVML") == str(state)


def test_status_reads_nvml_on_demand_for_the_targets(tmp_path):
    """``sparkguard status`` (not the daemon) reads NVML once, waited for up to 3 s: the targets
    show the GPU memory the daemon would count."""
    tag = unique("sggpust")
    p = subprocess.Popen([sys.executable, "-c", ENGINE, tag, str(8 * MiB)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "up"
        state = tmp_path / "nvml.json"
        state.write_text(json.dumps({"devices": [{"procs": [{"pid": p.pid, "used": 6 * GiB}]}]}))
        cfg = tmp_path / "sg.yaml"
        cfg.write_text(yaml.safe_dump({"targets": {"match": [tag]}, "metrics": {"listen": "off"}}))
        env = sg_env(PYTHONPATH=f"{ROOT}{os.pathsep}{FAKES}", SG_FAKE_NVML=str(state))
        out = subprocess.run([sys.executable, "-m", "sparkguard", "status", "--config", str(cfg)], env=env,
                             capture_output=True, text=True, timeout=60)
        assert "RSS+swap+GPU (GPU 6.00 GiB, NVML) in 1 process(es)" in out.stdout, out.stdout + out.stderr
        js = subprocess.run([sys.executable, "-m", "sparkguard", "status", "--config", str(cfg), "--json"], env=env,
                            capture_output=True, text=True, timeout=60)
        t = json.loads(js.stdout)["targets"][0]
        assert t["root_pid"] == p.pid and t["gpu_bytes"] == 6 * GiB and t["mem_bytes"] >= 6 * GiB
    finally:
        p.kill()
        p.wait(10)

"""Shared fixtures.  Tests run the real code against the real kernel: see README "Tests"."""

from __future__ import annotations

import errno
import os
import subprocess
import time
import sys
from pathlib import Path

import pytest

from fakes import fake_vllm  # the full fake vLLM (tests/fakes/): every test starts it through this name

ROOT = Path(__file__).resolve().parent.parent


def sg_env(**extra: str) -> dict[str, str]:
    """Environment for a child ``python -m sparkguard``: this checkout first on sys.path."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("NOTIFY_SOCKET", None)
    env.pop("WATCHDOG_USEC", None)
    env.pop("WATCHDOG_PID", None)
    env.update(extra)
    return env


def sparkguard_cmd(*args: str) -> list[str]:
    """argv that runs this checkout's sparkguard with the current interpreter."""
    return [sys.executable, "-m", "sparkguard", *args]


def run_sparkguard(*args: str, timeout: float = 60, **kw) -> subprocess.CompletedProcess:
    """Run ``sparkguard ARGS`` to completion; returns CompletedProcess with text stdout/stderr."""
    return subprocess.run(sparkguard_cmd(*args), env=kw.pop("env", sg_env()), capture_output=True,
                          text=True, timeout=timeout, **kw)


def mem_available() -> int:
    """MemAvailable in bytes, read now from /proc/meminfo."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def settled_mem_available(timeout: float = 90.0, lists_below: int = 256 << 20) -> int:
    """MemAvailable in bytes once the kernel's per-CPU free lists hold less than ``lists_below``
    bytes (or after ``timeout`` s).  Memory a test before freed sits on those lists, outside
    MemFree and MemAvailable, and drains into them at ~15 MiB/s (up to ~1 GiB on this 2-CPU VM:
    bench/results/pcp-after-exit.txt): a line placed under MemAvailable read before that would
    see MemAvailable rise under it while a fill runs."""
    from sparkguard import pcp
    r = pcp.PcpReader()
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            held = r.free_bytes()
            if held is None or held < lists_below:
                break
            time.sleep(0.5)     # no event says the lists drained: they decay on the kernel's own clock
    finally:
        r.close()
    return mem_available()


def line_below_now(margin: int) -> int:
    """A guard line ``margin`` bytes under MemAvailable, read once memory freed by earlier tests
    has reached MemAvailable (``settled_mem_available``): a fill of more than ``margin`` crosses it."""
    return settled_mem_available() - margin


def line_above_now(margin: int = 512 << 20) -> int:
    """A guard line ``margin`` bytes over MemAvailable (crossed with no allocation), read once the
    per-CPU free lists have drained into MemAvailable, and below MemTotal (the config refuses a line
    at or above it)."""
    return min(settled_mem_available() + margin, mem_total() - (64 << 20))


def mem_total() -> int:
    """MemTotal in bytes (the first line of /proc/meminfo); a guard line must stay below it."""
    with open("/proc/meminfo") as f:
        return int(f.readline().split()[1]) * 1024


@pytest.fixture
def root_only():
    """Skip unless running as root (CI runs as root)."""
    if os.geteuid() != 0:
        pytest.skip("needs root")


ZRAM_CONTROL = "/sys/class/zram-control"


def remove_zram_device(name: str) -> None:
    """swapoff, reset and hot_remove a test's own zram device (retrying EBUSY: the kernel
    holds a device briefly after swapoff/reset).  Fails loudly rather than leak it."""
    assert name != "zram0", "tests never touch zram0"
    with open("/proc/swaps") as f:
        if any(line.split()[0] == f"/dev/{name}" for line in f.readlines()[1:]):
            subprocess.run(["swapoff", f"/dev/{name}"], timeout=300, check=False)
    if not os.path.isdir(f"/sys/block/{name}"):
        return
    try:
        with open(f"/sys/block/{name}/reset", "w") as f:
            f.write("1")
    except OSError:
        pass
    deadline = time.monotonic() + 10
    while True:
        try:
            with open(f"{ZRAM_CONTROL}/hot_remove", "w") as f:
                f.write(name[4:])
            return
        except OSError as e:
            if e.errno != errno.EBUSY or time.monotonic() > deadline:
                raise AssertionError(f"test zram device {name} could not be removed: {e}") from None
        time.sleep(0.05)  # no event exists for "no longer busy"


@pytest.fixture
def own_zram(root_only):
    """Name (``"zramN"``) of a zram device made for this test with hot_add; removed afterwards."""
    if not os.path.exists(ZRAM_CONTROL):
        subprocess.run(["modprobe", "zram", "num_devices=0"], capture_output=True, timeout=30)
    if not os.path.exists(ZRAM_CONTROL):
        pytest.skip("no /sys/class/zram-control (zram module not loaded)")
    with open(f"{ZRAM_CONTROL}/hot_add") as f:
        name = "zram" + f.read().strip()
    assert name != "zram0"
    try:
        yield name
    finally:
        remove_zram_device(name)


def _zram_devices() -> set[str]:
    try:
        return {n for n in os.listdir("/sys/block") if n.startswith("zram")}
    except OSError:
        return set()


@pytest.fixture(autouse=True)
def _no_leaked_zram_devices(request):
    """Every test removes the zram devices it made: a device left behind fails the test (CI) or
    warns (a shared dev box, where another session may be making devices at the same time)."""
    before = _zram_devices()
    yield
    leaked = sorted(_zram_devices() - before)
    if leaked:
        msg = f"{request.node.nodeid} left zram devices behind: {', '.join(leaked)}"
        if os.environ.get("CI"):
            pytest.fail(msg)
        import warnings
        warnings.warn(msg)


@pytest.fixture(scope="session", autouse=True)
def _remove_guard_temp_dirs():
    """GuardProc's folders (config, log, incidents) outlive each test for its asserts; not the session."""
    yield
    import shutil
    import guardrun
    for d in guardrun.TEMP_DIRS:
        shutil.rmtree(d, ignore_errors=True)


def terminate(proc: subprocess.Popen, timeout: float = 10.0) -> int | None:
    """SIGTERM ``proc`` (if still running), wait ``timeout`` seconds, then SIGKILL; returns its status."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    return proc.returncode


@pytest.fixture
def engine_factory():
    """``start(*opts) -> FakeEngine``: fake vLLM trees with unique model names (``fe.model``), each
    waited for until its whole tree exists; every one is killed (whole tree, by pidfd) afterwards."""
    import uuid

    started = []

    def start(*opts: str, **kw):
        model = f"sgmodel-{uuid.uuid4().hex[:10]}"
        fe = fake_vllm.start(model, *opts, **kw)
        fe.model = model
        started.append(fe)
        fe.pids(timeout=60)
        return fe

    yield start
    for fe in started:
        fe.stop()

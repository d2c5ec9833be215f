"""Shared fixtures.  Tests run the real code against the real kernel: see README "Tests"."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

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


@pytest.fixture
def root_only():
    """Skip unless running as root (CI runs as root)."""
    if os.geteuid() != 0:
        pytest.skip("needs root")

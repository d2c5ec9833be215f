"""Talking to systemd, only when it runs the machine.

``systemd_running()`` follows sd_booted(3): systemd is PID 1 iff ``/run/systemd/system``
is a directory.  In a container build or a ``--root`` install nothing here is called.
"""

from __future__ import annotations

import os
import shutil
import subprocess

from sparkguard.host.files import Changes, HostError


def systemd_running() -> bool:
    """True when systemd is the init system of this machine (sd_booted(3))."""
    return os.path.isdir("/run/systemd/system")


def systemctl(ch: Changes, *args: str, check: bool = True, timeout: float = 90) -> subprocess.CompletedProcess | None:
    """Run ``systemctl ARGS``, reporting it; under dry-run only report.

    Returns:
        CompletedProcess (text), or None under dry-run.
    Raises:
        HostError: systemctl is missing, times out, or (with ``check``) fails; the
            message carries its stderr.
    """
    cmd = ["systemctl", *args]
    ch.note("ran", " ".join(cmd))
    if ch.dry_run:
        return None
    exe = shutil.which("systemctl")
    if not exe:
        raise HostError("systemctl not found on PATH although systemd runs this machine")
    try:
        p = subprocess.run([exe, *args], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise HostError(f"{' '.join(cmd)} did not finish within {timeout:.0f} s") from None
    if check and p.returncode != 0:
        raise HostError(f"{' '.join(cmd)} failed (exit {p.returncode}): {p.stderr.strip()}")
    return p


def query(*args: str, timeout: float = 15) -> str | None:
    """Output of a read-only ``systemctl ARGS`` (stripped), or None if it cannot run."""
    exe = shutil.which("systemctl")
    if not exe:
        return None
    try:
        p = subprocess.run([exe, *args], capture_output=True, text=True, timeout=timeout)
    except (subprocess.TimeoutExpired, OSError):
        return None
    return p.stdout.strip()

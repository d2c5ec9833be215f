"""Where the host commands run: inside a container, or with /sys or /proc/sys read-only.

zram devices and sysctls belong to the kernel, which a container shares with its host:
docker, podman and systemd-nspawn mount /sys and /proc/sys read-only unless privileged.
``install-zram``, ``tune`` and ``doctor`` ask here first, so that they name the cause
instead of failing half-way with EROFS.

Sources: proc(5) (/proc/PID/mountinfo fields, octal escapes in paths), systemd-detect-virt(1),
the marker files /.dockerenv (docker) and /run/.containerenv (podman), the ``container=``
variable that systemd-nspawn, LXC and podman put in PID 1's environment (systemd's
CONTAINER_INTERFACE), and cgroup paths naming a runtime in /proc/1/cgroup.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass

_ESCAPE = re.compile(r"\\([0-7]{3})")
#: cgroup path parts that name a container runtime (/proc/1/cgroup of a process inside one)
_CGROUP_RUNTIMES = (("docker", "docker"), ("kubepods", "kubernetes"), ("lxc", "lxc"), ("libpod", "podman"),
                    ("containerd", "containerd"))


@dataclass(frozen=True)
class Mount:
    """One line of /proc/PID/mountinfo: ``point`` (path), ``options`` (per-mount, such as
    ``rw``, ``nosuid``), ``fstype``, ``super_options`` (per-filesystem, such as ``hidepid=2``)."""

    point: str
    options: tuple[str, ...]
    fstype: str
    super_options: tuple[str, ...]

    @property
    def read_only(self) -> bool:
        """True when this mount (or its filesystem) is mounted ``ro``."""
        return "ro" in self.options or "ro" in self.super_options


def _unescape(s: str) -> str:
    return _ESCAPE.sub(lambda m: chr(int(m.group(1), 8)), s)


def mounts(pid: int | str = "self") -> list[Mount]:
    """The mounts of ``pid``'s mount namespace, in mountinfo order (later lines mount over earlier).

    Malformed lines are skipped. Raises OSError when /proc/PID/mountinfo cannot be read.
    """
    with open(f"/proc/{pid}/mountinfo") as f:
        text = f.read()
    out = []
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        lf, rf = left.split(), right.split()
        if not sep or len(lf) < 6 or len(rf) < 3:
            continue
        out.append(Mount(_unescape(lf[4]), tuple(lf[5].split(",")), rf[0], tuple(rf[2].split(","))))
    return out


def mount_of(path: str, table: list[Mount]) -> Mount | None:
    """The mount ``path`` lies on: the longest mount point above it, the last such line on ties."""
    path = os.path.normpath(path)
    best = None
    for m in table:
        p = m.point.rstrip("/") or "/"
        if path == p or path.startswith(p + "/") or p == "/":
            if best is None or len(p) >= len(best.point.rstrip("/") or "/"):
                best = m
    return best


def read_only_mount(path: str, pid: int | str = "self") -> Mount | None:
    """The read-only mount ``path`` lies on in ``pid``'s mount namespace, or None when that mount
    is writable (or mountinfo cannot be read: the write itself then says what is wrong)."""
    try:
        m = mount_of(path, mounts(pid))
    except OSError:
        return None
    return m if m is not None and m.read_only else None


def container() -> str | None:
    """The container technology this process runs in (``docker``, ``podman``, ``systemd-nspawn``,
    ``lxc``...), or None on the host.

    Asks ``systemd-detect-virt --container`` when installed, then the marker files, PID 1's
    ``container=`` variable and /proc/1/cgroup.  Never raises.
    """
    tool = shutil.which("systemd-detect-virt")
    if tool:
        try:
            p = subprocess.run([tool, "--container"], capture_output=True, text=True, timeout=10)
            name = p.stdout.strip()
            if p.returncode == 0 and name and name != "none":
                return name
        except (OSError, subprocess.TimeoutExpired):
            pass
    if os.path.exists("/.dockerenv"):
        return "docker"
    if os.path.exists("/run/.containerenv"):
        return "podman"
    try:
        with open("/proc/1/environ", "rb") as f:
            for kv in f.read().split(b"\0"):
                if kv.startswith(b"container=") and len(kv) > len(b"container="):
                    return kv.split(b"=", 1)[1].decode("utf-8", "replace")
    except OSError:
        pass
    try:
        with open("/proc/1/cgroup") as f:
            text = f.read()
    except OSError:
        return None
    for line in text.splitlines():
        path = line.rsplit(":", 1)[-1]
        for part, name in _CGROUP_RUNTIMES:
            if re.search(rf"(^|/|-){part}([-/.]|$)", path):
                return name
    return None


def read_only_cause(path: str) -> str | None:
    """Why ``path`` cannot be written here, for an error message (``"/sys is mounted read-only
    here (a docker container)"``), or None when its mount is writable."""
    m = read_only_mount(path)
    if m is None:
        return None
    box = container()
    return f"{m.point} is mounted read-only here" + (f" (a {box} container)" if box else "")

"""Which container a process is in, and the container's processes: read from its cgroup.

``/proc/PID/cgroup`` (cgroups(7): ``ID:CONTROLLERS:PATH`` per hierarchy) names the container (its id is
in the path docker and podman give it) and, with the hierarchy's mount in /proc/self/mountinfo, the
directory whose ``cgroup.procs`` lists every process of the container: cgroup v2 (the Sparks) and
the v1 hybrid (this machine) alike.
"""

from __future__ import annotations

import os
import re


#: a container's cgroup path names its id: cgroupfs driver ``/docker/<id>``, systemd driver
#: ``docker-<id>.scope``; podman ``libpod-<id>(.scope)`` / ``/libpod_parent/libpod-<id>``
CGROUP_ID = re.compile(r"\b(docker|libpod)[-/]([0-9a-f]{64})(?:\.scope)?(?:/|$)", re.M)


def container_of(pid: int, proc: str = "/proc") -> tuple[str, str] | None:
    """``(runtime, container id)`` when ``pid`` runs in a docker or podman container (read from
    ``/proc/PID/cgroup``: :data:`CGROUP_ID`), else None."""
    try:
        with open(f"{proc}/{pid}/cgroup") as f:
            text = f.read()
    except OSError:
        return None
    m = CGROUP_ID.search(text)
    if m is None:
        return None
    return ("docker" if m.group(1) == "docker" else "podman"), m.group(2)


def _mounts(mountinfo: str = "/proc/self/mountinfo") -> list[tuple[str, str, str, str]]:
    """Cgroup mounts as ``(fstype, root, mount point, super options)`` (proc(5): mountinfo fields
    4 root, 5 mount point, after the ``-``: fstype, source, super options)."""
    out = []
    try:
        with open(mountinfo) as f:
            lines = f.read().splitlines()
    except OSError:
        return out
    for line in lines:
        left, _, right = line.partition(" - ")
        a, b = left.split(), right.split()
        if len(a) >= 5 and len(b) >= 3 and b[0] in ("cgroup", "cgroup2"):
            out.append((b[0], a[3], a[4].replace("\\040", " "), b[2]))
    return out


def cgroup_dir(pid: int, proc: str = "/proc") -> str | None:
    """The cgroup directory of ``pid`` whose ``cgroup.procs`` lists its container's processes.

    ``/proc/PID/cgroup`` (cgroups(7): ``ID:CONTROLLERS:PATH``) names one path per hierarchy; the
    unified one (``0::``, cgroup v2 and the v1 hybrid) is tried first, then v1's ``pids``,
    ``memory``, ``name=systemd``, then any: the first whose directory (mount point + path below
    the mount's root) lists ``pid`` in its ``cgroup.procs``.  None when none does (no cgroup fs
    mounted, a cgroup namespace hiding it).
    """
    try:
        with open(f"{proc}/{pid}/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    mounts = _mounts()
    cands = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hid, ctrls, path = parts
        order = 0 if hid == "0" else 1 if "pids" in ctrls.split(",") else 2 if "memory" in ctrls.split(",") else \
            3 if ctrls == "name=systemd" else 4
        for fstype, root, mnt, opts in mounts:
            if (hid == "0") != (fstype == "cgroup2"):
                continue
            if hid != "0" and not set(ctrls.split(",")) <= set(opts.split(",")):
                continue
            if path != root and not path.startswith(root.rstrip("/") + "/") and root != "/":
                continue
            rel = path[len(root):] if root != "/" else path
            cands.append((order, os.path.join(mnt, rel.lstrip("/"))))
    for _, d in sorted(cands):
        if pid in procs_of(d):
            return d
    return None


def procs_of(cgdir: str) -> list[int]:
    """The pids in ``cgdir/cgroup.procs`` (empty when unreadable)."""
    try:
        with open(os.path.join(cgdir, "cgroup.procs")) as f:
            return [int(x) for x in f.read().split()]
    except (OSError, ValueError):
        return []

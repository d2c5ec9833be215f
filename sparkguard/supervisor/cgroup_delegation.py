"""Is a systemd unit's cgroup delegated to this daemon: the xattrs systemd sets, else a write test.

systemd marks a delegated cgroup (``Delegate=yes``, systemd.resource-control(5)) with the
``trusted.delegate`` extended attribute, and with ``user.delegate`` too since systemd 251
(systemd docs/CGROUP_DELEGATION.md, "Delegation"; NEWS of systemd 251).  ``trusted.*`` xattrs
read as absent without CAP_SYS_ADMIN (xattr(7)), which the shipped unit does not grant
(systemd/sparkguard.service ``CapabilityBoundingSet``): on systemd < 251 (Ubuntu 22.04 has 249)
the mark cannot be read there, and :func:`delegation` falls back to a write test.
Used once at daemon start (:func:`sparkguard.supervisor.cgroup.place`), never on the poll loop.
"""

from __future__ import annotations

import os
import subprocess

DELEGATE_XATTRS = ("trusted.delegate", "user.delegate")


def delegate_xattr(path: str) -> str | None:
    """The name of the delegation xattr that marks ``path`` (:data:`DELEGATE_XATTRS`), None if none does."""
    for name in DELEGATE_XATTRS:
        try:
            if os.getxattr(path, name).strip(b"\0") in (b"1", b"true", b"yes"):
                return name
        except OSError:
            continue
    return None


#: the first systemd that also sets ``user.delegate`` (readable without CAP_SYS_ADMIN; systemd
#: docs/CGROUP_DELEGATION.md, and NEWS of systemd 251)
USER_XATTR_SINCE = 251
CAP_SYS_ADMIN = 21                #: capability number (linux/capability.h)


def has_cap_sys_admin(status: str = "/proc/self/status") -> bool:
    """True when this process holds CAP_SYS_ADMIN (``CapEff`` of proc(5) status, hex), which reading
    ``trusted.*`` xattrs needs (xattr(7): without it they read as absent, ENODATA)."""
    try:
        with open(status) as f:
            text = f.read()
    except OSError:
        return False
    for line in text.splitlines():
        if line.startswith("CapEff:"):
            try:
                return bool(int(line.split()[1], 16) >> CAP_SYS_ADMIN & 1)
            except (IndexError, ValueError):
                return False
    return False


def systemd_version(timeout: float = 5.0) -> int | None:
    """systemd's version from ``systemctl --version`` (first line ``systemd 252 (252.22-1~deb12u1)``),
    None when it cannot be run or read.  Called once at start, off the poll loop."""
    try:
        r = subprocess.run(["systemctl", "--version"], capture_output=True, text=True, timeout=timeout,
                           stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError):
        return None
    words = (r.stdout.splitlines() or [""])[0].split()
    return int(words[1]) if len(words) >= 2 and words[0] == "systemd" and words[1].isdigit() else None


def write_probe(path: str) -> OSError | None:
    """The write test: mkdir and rmdir a probe cgroup ``sparkguard-probe-<pid>`` under ``path``;
    the error, or None when both worked."""
    probe = os.path.join(path, f"sparkguard-probe-{os.getpid()}")
    try:
        os.mkdir(probe)
    except OSError as e:
        return e
    try:
        os.rmdir(probe)
    except OSError as e:
        return e
    return None


def delegation(path: str, cap_sys_admin=None, version=None, probe=None) -> tuple[bool, str, str]:
    """Does systemd delegate unit cgroup ``path`` to this daemon: ``(yes, how, why)``.

    1. a delegation xattr marks it (``how`` ``"xattr"``);
    2. none does, and its absence is conclusive: this process can read ``trusted.delegate``
       (CAP_SYS_ADMIN), or systemd is >= :data:`USER_XATTR_SINCE`, which sets the readable
       ``user.delegate`` too: not delegated (``"xattr"``);
    3. else (systemd < 251 without CAP_SYS_ADMIN, as the shipped unit's capability set is, or a
       version that cannot be read) the write test (:func:`write_probe`, ``"write-test"``): a
       probe cgroup can be made and removed under it.  It shows the subtree is writable, which
       is what making engine cgroups needs; it cannot tell a ``Delegate=yes`` unit from one whose
       cgroup is merely writable (assumption: a unit that runs sparkguard and does not delegate
       is rare on systemd < 251; the unit shipped here sets ``Delegate=yes``).

    Args:
        cap_sys_admin: bool, or None: read (:func:`has_cap_sys_admin`).  version: int | None, or
            a callable returning it (default :func:`systemd_version`, only called when needed).
        probe: ``(path) -> OSError | None`` (default :func:`write_probe`).
    """
    name = delegate_xattr(path)
    if name is not None:
        return True, "xattr", f"{name} is set"
    if has_cap_sys_admin() if cap_sys_admin is None else cap_sys_admin:
        return False, "xattr", "no trusted.delegate xattr (readable: the daemon holds CAP_SYS_ADMIN)"
    v = (version if version is not None else systemd_version)
    v = v() if callable(v) else v
    if v is not None and v >= USER_XATTR_SINCE:
        return False, "xattr", f"no user.delegate xattr (systemd {v} sets it on a delegated cgroup)"
    err = (probe or write_probe)(path)
    old = f"systemd {v}" if v is not None else "systemd of unknown version"
    if err is not None:
        return False, "write-test", (f"delegation xattrs unreadable ({old} < {USER_XATTR_SINCE} sets only "
                                     f"trusted.delegate, which needs CAP_SYS_ADMIN) and the write test failed: {err}")
    return True, "write-test", (f"delegation xattrs unreadable ({old} < {USER_XATTR_SINCE} sets only "
                                "trusted.delegate, which needs CAP_SYS_ADMIN); the write test (mkdir/rmdir of a "
                                "probe cgroup) passed")

"""What a running process is and sees, read from /proc: its OOM and CPU standing, its
credentials, its /proc mount, its environment.  Used by doctor to judge the running guard and
its neighbours as they are, not as the unit file intends.

Sources: proc(5) (/proc/PID/stat field 19 ``nice``, /proc/PID/oom_score_adj, /proc/PID/status
``Uid:``/``Gid:``/``Groups:``/``CapEff:``, /proc/PID/mountinfo, /proc/PID/environ), sched(7),
and for who may see a process under hidepid: fs/proc/base.c ``has_pid_permissions`` (the
reader's group is /proc's ``gid=``, or ``ptrace_may_access(PTRACE_MODE_READ)``: same uids, or
CAP_SYS_PTRACE).  Every reader takes ``root`` (default ``/proc``; tests give a folder of fixture
files laid out the same way) and raises OSError when the process is gone or unreadable.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from sparkguard import proctree
from sparkguard.host import virt

CAP_SYS_PTRACE = 19  # linux/capability.h

#: sched(7) policy numbers to names
POLICIES = {0: "SCHED_OTHER", 1: "SCHED_FIFO", 2: "SCHED_RR", 3: "SCHED_BATCH", 5: "SCHED_IDLE", 6: "SCHED_DEADLINE"}


def oom_score_adj(pid: int, root: str = "/proc") -> int:
    """/proc/PID/oom_score_adj (-1000: never chosen by the kernel OOM killer .. 1000)."""
    with open(f"{root}/{pid}/oom_score_adj") as f:
        return int(f.read().strip())


def _stat(pid: int, root: str) -> list[bytes]:
    """The fields of /proc/PID/stat after comm (:func:`sparkguard.proctree.stat_fields`).
    Raises OSError when gone or unreadable."""
    st = proctree.stat_fields(f"{root}/{pid}/stat")
    if st is None:
        raise FileNotFoundError(2, "No such process", f"{root}/{pid}/stat")
    return st[1]


def nice(pid: int, root: str = "/proc") -> int:
    """The nice value (-20..19) of ``pid``'s main thread: field 19 of /proc/PID/stat.
    Raises OSError, or ValueError/IndexError on a malformed stat."""
    return int(_stat(pid, root)[16])


def ppid(pid: int, root: str = "/proc") -> int:
    """The parent's pid: field 4 of /proc/PID/stat.  Raises OSError, or ValueError/IndexError
    on a malformed stat."""
    return int(_stat(pid, root)[1])


def argv(pid: int, root: str = "/proc") -> list[str]:
    """The arguments of ``pid`` (/proc/PID/cmdline split at NULs, UTF-8 with replacement), at
    most :data:`sparkguard.proctree.CMDLINE_LIMIT` bytes of them; [] for a kernel thread or a
    zombie.

    Raises:
        OSError: gone or unreadable.
    """
    raw = proctree.read_limited(f"{root}/{pid}/cmdline", proctree.CMDLINE_LIMIT)
    if raw is None:
        raise FileNotFoundError(2, "No such process", f"{root}/{pid}/cmdline")
    return [a.decode("utf-8", "replace") for a in raw.rstrip(b"\0").split(b"\0")] if raw else []


def is_guard(args: list[str]) -> bool:
    """True for the argv of ``sparkguard run ...`` or ``<python> -m sparkguard run ...`` (not a
    shell wrapping one)."""
    if not args:
        return False
    exe = os.path.basename(args[0])
    if exe == "sparkguard":
        return len(args) > 1 and args[1] == "run"
    if exe.startswith("python"):
        return any(args[i:i + 3] == ["-m", "sparkguard", "run"] for i in range(1, len(args) - 2))
    return False


def status(pid: int | str, root: str = "/proc") -> dict[str, str]:
    """/proc/PID/status as ``{name: value}`` (the text after ``Name:``, blanks stripped); ``pid``
    may be ``"self"``.

    Raises:
        OSError: gone or unreadable.
    """
    with open(f"{root}/{pid}/status") as f:
        return {k: v.strip() for k, _, v in (line.rstrip("\n").partition(":") for line in f)}


def policy(pid: int) -> str:
    """The scheduling policy name of ``pid`` (``SCHED_OTHER``...), from sched_getscheduler(2)."""
    p = os.sched_getscheduler(pid)
    return POLICIES.get(p, str(p))


@dataclass(frozen=True)
class Creds:
    """A process's effective ``uid``, its ``gids`` (effective and supplementary) and ``cap_eff``
    (effective capability bit mask)."""

    uid: int
    gids: frozenset[int]
    cap_eff: int

    def has_cap(self, cap: int) -> bool:
        """True when capability number ``cap`` is effective."""
        return bool(self.cap_eff >> cap & 1)


def creds(pid: int | str, root: str = "/proc") -> Creds:
    """The credentials of ``pid`` (or ``"self"``) from /proc/PID/status.

    Raises:
        OSError: gone or unreadable; KeyError/ValueError: a field missing or malformed.
    """
    fields = status(pid, root)
    uid = int(fields["Uid"].split()[1])
    gids = {int(fields["Gid"].split()[1]), *(int(g) for g in fields.get("Groups", "").split())}
    return Creds(uid, frozenset(gids), int(fields["CapEff"].strip(), 16))


def proc_options(pid: int) -> dict[str, str]:
    """The options of the /proc that ``pid`` sees (its mount namespace, its root), such as
    ``{"hidepid": "invisible", "gid": "27"}``; {} when it sees no proc file system at /proc."""
    m = virt.mount_of("/proc", virt.mounts(pid))
    if m is None or m.fstype != "proc":
        return {}
    return {k: v for k, _, v in (o.partition("=") for o in m.super_options + m.options)}


def hides_others(options: dict[str, str], who: Creds) -> str | None:
    """Why a process with credentials ``who`` cannot see other users' processes in a /proc
    mounted with ``options`` (:func:`proc_options`), or None when it sees them all."""
    hide = options.get("hidepid")
    if hide in (None, "0", "off"):
        return None
    gid = options.get("gid")
    if gid is not None and gid.isdigit() and int(gid) in who.gids:
        return None
    if who.has_cap(CAP_SYS_PTRACE):
        return None
    return (f"/proc is mounted hidepid={hide} where it runs and it (uid {who.uid}) lacks CAP_SYS_PTRACE"
            + (f" and group {gid}" if gid else "") + ": processes of other users are invisible to it")


def environ(pid: int, root: str = "/proc") -> dict[str, str] | None:
    """The environment ``pid`` was started with, or None when its memory was taken over by a
    process title (setproctitle: no ``KEY=value`` left in /proc/PID/environ)."""
    with open(f"{root}/{pid}/environ", "rb") as f:
        raw = f.read().split(b"\0")
    pairs = [kv.decode("utf-8", "replace").partition("=") for kv in raw if b"=" in kv]
    if not pairs:
        return None
    return {k: v for k, _, v in pairs}


def cgroup_path(pid: int, root: str = "/proc") -> str | None:
    """``pid``'s cgroup v2 path (the ``0::`` line of /proc/PID/cgroup), or None on a v1-only host."""
    with open(f"{root}/{pid}/cgroup") as f:
        for line in f:
            if line.startswith("0::"):
                return line[3:].strip()
    return None


def hidepid_blocks_view(view: dict | None = None) -> str | None:
    """Why this process cannot see other users' processes, or None if it can.

    /proc mounted with ``hidepid=noaccess|invisible|ptraceable`` (or 1, 2, 4; proc(5)) shows another
    user's /proc/PID only to a process in the mount's ``gid=`` group or one that
    ``ptrace_may_access()`` lets read it (fs/proc/base.c ``has_pid_permissions``), which for another
    user's process needs CAP_SYS_PTRACE.  Decided from those rules for this process (its groups, and
    CapEff of /proc/self/status), the same in every mode: root or not, PID 1 of a PID namespace or
    not.  Then checked against what it sees: a process of another uid whose /proc/PID/stat it can
    read proves the view whatever the rules say.

    Args:
        view: if given, filled with what this process sees now: ``hidepid`` (str or None),
            ``processes`` (PIDs listed in /proc), ``other_users`` (of those, owned by another uid),
            ``other_users_readable`` (of those, with a readable stat).
    Returns:
        str, the reason (naming the hidepid value and the uid), or None.
    """
    opts = ""
    for line in (proctree.read_limited("/proc/self/mountinfo") or b"").decode(errors="replace").splitlines():
        parts = line.split()
        if len(parts) > 4 and parts[4] == "/proc":
            opts = parts[-1]        # the super options, where proc keeps hidepid= and gid=
    o = dict(x.split("=", 1) if "=" in x else (x, "") for x in opts.split(","))
    hide = None if o.get("hidepid") in (None, "0", "off") else o["hidepid"]
    me = os.geteuid()
    seen = other = readable = 0
    try:
        names = proctree.pids()
    except OSError:
        names = []
    for name in names:
        try:
            uid = os.stat(f"/proc/{name}").st_uid
        except OSError:
            continue                # gone
        seen += 1
        if uid != me:
            other += 1
            if proctree.read_limited(f"/proc/{name}/stat") is not None:
                readable += 1
    if view is not None:
        view.update(hidepid=hide, processes=seen, other_users=other, other_users_readable=readable)
    if hide is None or readable:
        return None
    gid = o.get("gid")
    if gid and gid.isdigit() and (int(gid) == os.getegid() or int(gid) in os.getgroups()):
        return None
    status = (proctree.read_limited("/proc/self/status") or b"").decode(errors="replace")
    cap_eff = next((int(ln.split()[1], 16) for ln in status.splitlines() if ln.startswith("CapEff:")), 0)
    if cap_eff >> 19 & 1:           # CAP_SYS_PTRACE, linux/capability.h
        return None
    return (f"/proc is mounted with hidepid={hide} and this process (uid {me}, without CAP_SYS_PTRACE"
            + (f", not in group {gid}" if gid else "") + ") cannot see other users' processes; run sparkguard "
            "as root with CAP_SYS_PTRACE (the unit does) or add its group to /proc's gid= option")

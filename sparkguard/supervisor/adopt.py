"""Adopting the engine a previous daemon left running: verify who it is, or say why not.

A daemon that exits keeping its engine (a restart of sparkguard: :mod:`.handover`), or that
died (SIGKILL, a watchdog abort), leaves the engine running with its identity in
``engine.state_file`` (:func:`lanes.write_state`).  At start the new daemon adopts it only
when every check holds, in this order (:func:`check`):

1. the record is from this boot (``boot_id``: pids and start times mean nothing across boots);
2. the recorded pid runs and has the recorded start time (``/proc/PID/stat`` field 22,
   proc(5)): a pid reused by another process has another start time;
3. where the run had a cgroup of its own, the pid is still in it (``/proc/PID/cgroup``'s
   ``0::`` line, cgroups(7)): only this daemon makes ``engine-<run id>`` cgroups;
4. a pidfd is opened (``pidfd_open(2)``) and the start time read again after it: from then on
   the fd refers to that process whatever happens to the pid (race-free against reuse);
5. the engine command is the one the config asks for now (:func:`command_digest`: argv,
   ``engine.env``, the lane's env, ``cwd``, ``user``); a changed command is verified as ours but
   not adopted: the caller stops it with the usual escalation and starts the new one.

An adopted engine is not this daemon's child: its exit is seen on the pidfd, its exit status is
unknown (``waitid(2)`` works only for children), and that is said in the exit record.
Nothing here signals anything; results are plain values the supervisor acts on.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import select
import time
from dataclasses import dataclass, field

from sparkguard import proctree
from sparkguard.supervisor import cgroup as cgroups
from sparkguard.supervisor import container, container_argv, container_cgroup

log = logging.getLogger("sparkguard.supervisor")

ADOPTED = "adopted"     #: result: the engine is supervised again
REFUSED = "refused"     #: result: an engine was recorded but its identity could not be verified
CHANGED = "changed"     #: result: verified as ours, but the config asks for another command: stopped
GONE = "gone"           #: result: the recorded engine is no longer running
RESULTS = (ADOPTED, REFUSED, CHANGED, GONE)


def command_digest(argv: list[str], ecfg, lane: str | None) -> str:
    """sha256 (hex) of what defines the engine's command: ``argv`` (``engine.command`` and the
    lane's ``args``, before a container wrapper adds its run-specific options), ``engine.env``, the
    lane's ``env``, ``engine.cwd`` and ``engine.user``.  The daemon's own environment is left out
    (systemd gives every start a new ``INVOCATION_ID``)."""
    ln = ecfg.lanes.get(lane) if lane else None
    doc = {"argv": list(argv), "env": dict(ecfg.env), "lane_env": dict(ln.env) if ln else {},
           "cwd": ecfg.cwd, "user": ecfg.user}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


@dataclass
class Record:
    """The engine a previous daemon recorded (``state["engine"]``, :func:`lanes.write_state`).

    Attributes: pid (int), starttime (ticks since boot), pgid, members ({pid: starttime}), cgroup
    (its run cgroup's directory or None), digest (:func:`command_digest`, "" when the file is
    older than adoption), wall_spawn (unix s: the run id), lane, argv (what was executed), ready
    (bool: it was ready when recorded), fifos / fifo_ids ({stream: path} / {stream: [dev, ino]}),
    container (the ``container.Container.as_dict()`` plus ``starttime``, or None), launch (the
    container's ``Launch`` fields, or None), group (a TP head: node rank -> the run of each rank
    it started with, :attr:`Run.group`).
    """

    pid: int
    starttime: int
    pgid: int = 0
    members: dict = field(default_factory=dict)
    cgroup: str | None = None
    digest: str = ""
    wall_spawn: float = 0.0
    lane: str | None = None
    argv: list = field(default_factory=list)
    ready: bool = False
    fifos: dict = field(default_factory=dict)
    fifo_ids: dict = field(default_factory=dict)
    container: dict | None = None
    launch: dict | None = None
    group: dict = field(default_factory=dict)


def record_of(state: dict) -> tuple[Record | None, str]:
    """The :class:`Record` in a state file's contents, or ``(None, why)``: none recorded (why "")
    or an unusable record (why says what is wrong).  Never raises (the file is untrusted)."""
    e = state.get("engine") if isinstance(state, dict) else None
    if not e:
        return None, ""
    if not isinstance(e, dict):
        return None, "the state file's engine record is not a mapping"
    try:
        rec = Record(pid=int(e["pid"]), starttime=int(e["starttime"]), pgid=int(e.get("pgid") or 0),
                     members={int(k): int(v) for k, v in (e.get("members") or {}).items()},
                     cgroup=str(e["cgroup"]) if e.get("cgroup") else None, digest=str(e.get("digest") or ""),
                     wall_spawn=float(e.get("wall_spawn") or 0.0),
                     lane=str(e["lane"]) if e.get("lane") else None,
                     argv=[str(a) for a in (e.get("argv") or [])][:4096], ready=bool(e.get("ready")),
                     fifos={str(k): str(v) for k, v in (e.get("fifos") or {}).items()},
                     fifo_ids={str(k): [int(x) for x in v][:2] for k, v in (e.get("fifo_ids") or {}).items()},
                     container=dict(e["container"]) if isinstance(e.get("container"), dict) else None,
                     launch=dict(e["launch"]) if isinstance(e.get("launch"), dict) else None,
                     group={int(k): float(v) for k, v in (e.get("group") or {}).items()})
    except (KeyError, TypeError, ValueError, AttributeError) as ex:
        return None, f"the state file's engine record is unusable ({type(ex).__name__}: {ex})"
    if rec.pid <= 1 or rec.starttime <= 0:
        return None, f"the state file's engine record has no usable pid/start time (pid {rec.pid})"
    return rec, ""


def cgroup_of(pid: int, proc: str = "/proc") -> str | None:
    """The cgroup2 path of ``pid`` (``0::PATH`` in /proc/PID/cgroup), None if unreadable."""
    try:
        with open(f"{proc}/{pid}/cgroup", "rb") as f:
            text = f.read(1 << 16).decode("utf-8", "replace")
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("0::"):
            return line[3:].strip() or "/"
    return None


def run_cgroup_ok(path: str, parent: str | None, wall_spawn: float) -> str:
    """Why the recorded run cgroup ``path`` cannot be the run's (``""``: it can).  Only a direct
    child of the engines' parent cgroup (``placement.parent``) named ``engine-<run id>`` (or
    ``engine-<run id>-N``: :meth:`cgroup.EngineCgroup.create`) after the record's ``wall_spawn``
    is: a path elsewhere (``/sys/fs/cgroup/system.slice``, the daemon's own) would put strangers
    in the run's tree and kill set.  Symlinks are resolved first."""
    if not parent:
        return "this daemon makes no engine cgroups (process-group tracking)"
    real, top = os.path.realpath(path), os.path.realpath(parent)
    name = f"engine-{wall_spawn:.3f}"
    base = os.path.basename(real)
    numbered = base.startswith(name + "-") and base[len(name) + 1:].isdigit()
    if os.path.dirname(real) != top or not (base == name or numbered):
        return f"it is not {os.path.join(top, name)}, the engine cgroup of that run"
    if not os.path.isdir(real):
        return "it does not exist"
    return ""


def verified_container(c: dict | None, proc: str = "/proc"):
    """The recorded container (``Record.container``) as a ``container.Container`` once verified:
    its init pid runs with the recorded start time and its own cgroup names the recorded id
    (:func:`container_cgroup.container_of`); the cgroup directory is read from the init's
    ``/proc/PID/cgroup``, never taken from the record.  ``(container or None, why)``; never raises."""
    if not c:
        return None, ""
    try:
        pid, start, cid = int(c.get("pid") or 0), int(c.get("starttime") or 0), str(c.get("id") or "")
    except (TypeError, ValueError) as e:
        return None, f"unusable container record ({e})"
    if pid <= 1 or not cid:
        return None, "the container record has no init pid or id"
    p = proctree.read_proc(pid, proc)
    if p is None or p.starttime != start:
        return None, f"its init pid {pid} no longer runs with the recorded start time"
    seen = container_cgroup.container_of(pid, proc)
    if seen is None or seen[1] != cid:
        return None, f"pid {pid} is not in container {cid[:12]}'s cgroup"
    return (container.Container(cid, str(c.get("name") or ""), pid, p.starttime,
                                container_cgroup.cgroup_dir(pid, proc)), "")


def launch_of(ln: dict | None, argv: list[str], state_file: str, env: dict):
    """The recorded container launch (``Record.launch``) as a ``container.Launch``, trusting no
    field that is run or written: the runtime CLI is the configured command's (``argv``:
    ``engine.command``, whose digest the record matched), never the file's (it is executed as
    root), with that command's global options and client environment (:func:`container.prepare`
    gives a started run the same), and the cidfile only as ``engine-<tag>.cid`` directly in :func:`container.rundir`
    (it is read, and removed after the run).  ``(launch or None, why)``; never raises."""
    if not ln:
        return None, ""
    cmd = container_argv.parse(list(argv))
    if cmd is None:
        return None, "the configured command is no docker|podman run"
    try:
        cidfile = os.path.realpath(str(ln.get("cidfile") or ""))
        name = str(ln["name"]) if ln.get("name") else None
        user_name = str(ln["user_name"]) if ln.get("user_name") else None
    except (TypeError, ValueError, AttributeError) as e:
        return None, f"unusable launch record ({e})"
    base = os.path.basename(cidfile)
    if (os.path.dirname(cidfile) != os.path.realpath(container.rundir(state_file))
            or not (base.startswith("engine-") and base.endswith(".cid"))):
        return None, f"its cidfile {cidfile} is not one of {container.rundir(state_file)}"
    return container.Launch(cmd.runtime, cidfile, name, cmd.client_env(dict(env)), user_name, list(cmd.global_opts)), ""


def in_cgroup(pid: int, cgroup_dir: str, proc: str = "/proc") -> bool:
    """True when ``pid`` is in cgroup directory ``cgroup_dir`` or below it (compared by the
    directory's ``cgroup.procs`` listing, so no mount-point arithmetic is needed)."""
    return pid in cgroups.members(cgroup_dir)


@dataclass
class Verdict:
    """What :func:`check` found: ``result`` (one of :data:`RESULTS`, or ``""``: nothing recorded),
    ``why`` (one line for the journal, status and history), ``pidfd`` (an open pidfd of the engine
    for :data:`ADOPTED` and :data:`CHANGED`; the caller owns and closes it), ``record``."""

    result: str
    why: str
    pidfd: int | None = None
    record: Record | None = None


def check(state: dict, boot_id: str, digest: str, proc: str = "/proc", parent: str | None = None) -> Verdict:
    """Decide about the engine recorded in ``state`` (module doc, checks 1-5).  On a verdict with a
    pidfd the record's ``pgid`` is the verified root's process group (``/proc/PID/stat``), never
    the file's.

    Args:
        state: the state file's contents (``lanes.read_state``); boot_id: this boot's
            (``sysinfo.boot_id()``); digest: :func:`command_digest` of the command the config asks for now;
            parent: the engines' parent cgroup (``placement.parent``; None: no cgroups): a recorded
            run cgroup is accepted only below it (:func:`run_cgroup_ok`).
    Returns:
        :class:`Verdict`.  Never raises.
    """
    rec, bad = record_of(state)
    if rec is None:
        return Verdict(REFUSED, bad) if bad else Verdict("", "no engine recorded")
    if not boot_id or state.get("boot_id") != boot_id:
        return Verdict(REFUSED, f"pid {rec.pid} was recorded in another boot (boot id "
                       f"{str(state.get('boot_id'))[:12]}, now {boot_id[:12]})", record=rec)
    p = proctree.read_proc(rec.pid, proc)
    if p is None or _state(rec.pid, proc) in ("Z", "X", None):
        return Verdict(GONE, f"pid {rec.pid} is no longer running", record=rec)
    if p.starttime != rec.starttime:
        return Verdict(REFUSED, f"pid {rec.pid} has start time {p.starttime}, the recorded engine had "
                       f"{rec.starttime}: another process has that pid now", record=rec)
    bad_cg = run_cgroup_ok(rec.cgroup, parent, rec.wall_spawn) if rec.cgroup else ""
    if bad_cg:
        return Verdict(REFUSED, f"the recorded cgroup {rec.cgroup} of pid {rec.pid} is not accepted: {bad_cg}",
                       record=rec)
    if rec.cgroup:
        rec.cgroup = os.path.realpath(rec.cgroup)
    if rec.cgroup and not in_cgroup(rec.pid, rec.cgroup):
        return Verdict(REFUSED, f"pid {rec.pid} is not in the run's cgroup {rec.cgroup} "
                       f"(it is in {cgroup_of(rec.pid, proc)})", record=rec)
    try:
        fd = os.pidfd_open(rec.pid)
    except OSError as e:
        return Verdict(GONE if e.errno == 3 else REFUSED, f"pidfd_open({rec.pid}): {e.strerror}", record=rec)
    p = proctree.read_proc(rec.pid, proc)
    if p is None or p.starttime != rec.starttime:     # exited, and the pid reused, between the checks
        os.close(fd)
        return Verdict(REFUSED, f"pid {rec.pid} changed while it was being verified", record=rec)
    rec.pgid = p.pgrp
    if not rec.digest:
        return Verdict(CHANGED, f"pid {rec.pid} was recorded without its command's digest (an older "
                       "sparkguard): cannot tell that it runs the configured command", fd, rec)
    if rec.digest != digest:
        return Verdict(CHANGED, f"pid {rec.pid} runs another command than the config asks for now "
                       f"({' '.join(rec.argv)[:200]})", fd, rec)
    return Verdict(ADOPTED, f"pid {rec.pid} (start time {rec.starttime}"
                   + (f", cgroup {rec.cgroup}" if rec.cgroup else ", no cgroup: process group") + ")", fd, rec)


def _state(pid: int, proc: str) -> str | None:
    st = proctree.stat_fields(f"{proc}/{pid}/stat")
    return st[1][0].decode() if st and st[1] else None


class AdoptedProc:
    """Stands in for the ``subprocess.Popen`` of an adopted engine (not this daemon's child):
    ``pid``, no pipes, nothing to reap."""

    def __init__(self, pid: int):
        self.pid = pid
        self.stdout = self.stderr = None
        self.returncode = None

    def wait(self, timeout: float | None = None) -> None:
        return None

    def poll(self) -> None:
        return None


POLL_EVERY = 0.5    #: seconds between /proc reads when the pidfd cannot be polled (:func:`wait_exit`)


def wait_exit(pidfd: int, pid: int | None = None, starttime: int | None = None) -> tuple[int | None, int | None]:
    """Block until the process of ``pidfd`` exits (its pidfd becomes readable: pidfd_open(2));
    ``(None, None)``: the status of a process that is not our child cannot be read.  Closes the fd.

    ``poll(2)`` (not ``select``, which cannot take an fd >= 1024).  An error of the poll is no
    exit: then ``/proc/PID/stat`` is read every :data:`POLL_EVERY` s until ``pid`` is gone, a
    zombie, or has another start time than ``starttime`` (without ``pid`` the wait ends)."""
    try:
        try:
            poller = select.poll()
            poller.register(pidfd, select.POLLIN)
            while not poller.poll():
                pass
            return None, None
        except (OSError, ValueError) as e:
            if pid is None:
                return None, None
            log.warning("engine: cannot poll the pidfd of adopted pid %d (%s); watching /proc instead", pid, e)
        while True:
            p = proctree.read_proc(pid)
            if p is None or p.starttime != starttime or _state(pid, "/proc") in ("Z", "X", None):
                return None, None
            time.sleep(POLL_EVERY)
    finally:
        try:
            os.close(pidfd)
        except OSError:
            pass

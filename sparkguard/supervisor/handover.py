"""Keep or stop the engine when the daemon exits; the handover note; the unit's ExecStopPost safety net.

When the daemon is asked to exit it decides whether its engine goes with it (:func:`decide`):

* ``SIGUSR2``: exit and keep the engine (for tests and hand-run daemons; a later daemon adopts it,
  :mod:`.adopt`);
* ``SIGTERM``/``SIGINT`` under systemd: systemd's job for the unit tells a restart from a stop
  (:func:`unit_job`: ``systemctl list-jobs``; found in the booted Debian 12 container, systemd 252:
  the job of ``systemctl restart`` is listed with type ``restart`` while the old process is being
  stopped, that of ``systemctl stop`` with type ``stop``); a restart applies
  ``engine.on_daemon_restart`` (default ``keep``), a stop ``engine.on_daemon_stop`` (default
  ``stop``).  Without systemd, or when the job cannot be read within 1 s, the engine is stopped
  (what ``SIGTERM`` always did).

A daemon that keeps its engine writes a handover note (:func:`write_note`: the run's pid, start
time, boot id and cgroup, the decision's kind and the writer's ``$INVOCATION_ID``) in the unit's
runtime directory (``/run/sparkguard``, which ``RuntimeDirectoryPreserve=restart`` keeps across
restarts; beside the control socket outside systemd).  Every daemon takes the note (reads and
removes it, :func:`take_note`) first thing at start, before its config is read.  The unit's
``ExecStopPost=sparkguard stop-post`` (:func:`stop_post`) runs after a stop of the daemon, also
when it died or hung (not after a stop during the auto-restart wait: there the check that the
crash's stop-post arms, :mod:`.orphancheck`, stops the engine):
on a stop job it stops the unit's engines unless the note was written by this invocation for a
stop (``engine.on_daemon_stop: keep``; ExecStopPost shares ``$INVOCATION_ID`` with the main
process, systemd.exec(5)); on a restart or after a crash (no job: ``Restart=`` comes later) it
leaves them for the next daemon to adopt.  When systemd's job cannot be read it stops them unless
``$SERVICE_RESULT`` says the daemon crashed.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time

from sparkguard import config, proctree, sysinfo, untrusted
from sparkguard.host.files import atomic_write
from sparkguard.supervisor import cgroup as cgroups
from sparkguard.supervisor import adopt, container, lanes, orphancheck, process
from sparkguard.units import parse_duration

log = logging.getLogger("sparkguard.supervisor")

NOTE_NAME = "engine-handover.json"
JOB_TIMEOUT = 1.0          #: seconds: how long ``systemctl list-jobs`` may take at shutdown
DEFAULT_NOTE = "/run/sparkguard/" + NOTE_NAME
JOB_UNKNOWN = "?"          #: :func:`unit_job`: systemd's job could not be read (not "no job")
#: ``$SERVICE_RESULT`` values of a daemon that died by itself (systemd.exec(5), "Environment
#: variables set or propagated by the service manager"): a crash, not a stop
CRASH_RESULTS = ("signal", "core-dump", "watchdog")
#: the decision's kind (:func:`decide`'s ``why`` starts with the key) recorded in the note
KINDS = (("SIGUSR2", "signal"), ("systemd is restarting", "restart"), ("systemd is stopping", "stop"))


def runtime_dir(env=None) -> str | None:
    """The unit's runtime directory: the first of ``$RUNTIME_DIRECTORY`` (systemd sets it for
    ``RuntimeDirectory=``, colon-separated: systemd.exec(5)), None outside such a unit."""
    env = os.environ if env is None else env
    first = (env.get("RUNTIME_DIRECTORY") or "").split(":")[0]
    return first or None


def note_path(ecfg, env=None) -> str:
    """The handover note's path: in the unit's runtime directory (:func:`runtime_dir`, where
    ExecStopPost looks), else beside ``engine.control_socket``."""
    return os.path.join(runtime_dir(env) or os.path.dirname(ecfg.control_socket), NOTE_NAME)


def under_systemd(env=None) -> bool:
    """True when this process was started by systemd as a service: ``$INVOCATION_ID`` set
    (systemd.exec(5), "Environment variables in spawned processes") and systemd is PID 1 of this
    namespace (``/run/systemd/system`` exists: sd_booted(3))."""
    env = os.environ if env is None else env
    return bool(env.get("INVOCATION_ID")) and os.path.isdir("/run/systemd/system")


def unit_name(proc_cgroup: str = "/proc/self/cgroup") -> str | None:
    """The ``.service`` unit this process runs in, from its cgroup2 path (``.../NAME.service/guard``)."""
    path = cgroups.own_path(proc_cgroup) or ""
    for part in reversed(path.split("/")):
        if part.endswith(".service"):
            return part
    return None


def unit_job(unit: str, timeout: float = JOB_TIMEOUT) -> str | None:
    """The type of systemd's job running for ``unit`` (``restart``, ``stop``, ``start``...),
    None when there is none, :data:`JOB_UNKNOWN` when it cannot be read within ``timeout`` s
    (systemctl missing, timed out, or exited non-zero).

    ``systemctl list-jobs --no-legend --plain --full UNIT`` prints ``ID UNIT TYPE STATE`` per job
    (systemctl(1)).  Never raises."""
    try:
        r = subprocess.run(["systemctl", "list-jobs", "--no-legend", "--plain", "--full", unit],
                           capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        log.warning("engine: cannot ask systemd for the job of %s: %s", unit, e)
        return JOB_UNKNOWN
    if r.returncode != 0:
        log.warning("engine: cannot ask systemd for the job of %s: systemctl exited %d: %s", unit,
                    r.returncode, (r.stderr or "").strip()[:200])
        return JOB_UNKNOWN
    for line in r.stdout.splitlines():
        f = line.split()
        if len(f) >= 3 and f[1] == unit:
            return f[2]
    return None


def decide(ecfg, keep_signal: bool, job: str | None = None) -> tuple[bool, str]:
    """Keep the engine running past this daemon's exit?  Returns ``(keep, why)``.

    Args:
        ecfg: ``config.EngineConfig`` (``on_daemon_restart``, ``on_daemon_stop``).
        keep_signal: the daemon got ``SIGUSR2`` (exit, keep the engine).
        job: systemd's job type for the unit when already known (tests); else asked for
            (:func:`unit_job`) when :func:`under_systemd`.
    """
    if keep_signal:
        return True, "SIGUSR2: exit and keep the engine"
    if job is None and under_systemd():
        unit = unit_name()
        job = unit_job(unit) if unit else None
    if job == "restart":
        keep = ecfg.on_daemon_restart == "keep"
        return keep, f"systemd is restarting the unit (engine.on_daemon_restart: {ecfg.on_daemon_restart})"
    if job == "stop":
        keep = ecfg.on_daemon_stop == "keep"
        return keep, f"systemd is stopping the unit (engine.on_daemon_stop: {ecfg.on_daemon_stop})"
    if job == JOB_UNKNOWN:
        return False, "systemd's job for the unit could not be read: stopping the daemon"
    return False, "stopping the daemon" + (f" (systemd job {job})" if job else "")


def kind_of(why: str) -> str:
    """The kind of a :func:`decide` reason: ``signal`` (SIGUSR2), ``restart``, ``stop``, else ``""``."""
    return next((k for prefix, k in KINDS if why.startswith(prefix)), "")


def write_note(path: str, run, why: str, env=None) -> None:
    """Record that the engine of ``run`` was kept on purpose (pid, start time, boot id, cgroup,
    ``kind``: :func:`kind_of` ``why``, ``invocation_id``: this process's ``$INVOCATION_ID`` or "").
    A write error is logged, never raised."""
    env = os.environ if env is None else env
    cg = getattr(run, "cgroup", None)
    note = {"kept": why, "kind": kind_of(why), "invocation_id": env.get("INVOCATION_ID") or "",
            "at": time.time(), "pid": run.pid, "starttime": run.starttime,
            "boot_id": sysinfo.boot_id(), "cgroup": cg.path if cg is not None else None}
    try:
        atomic_write(path, json.dumps(note))
    except OSError as e:
        log.warning("engine: cannot write the handover note %s: %s", path, e)


def read_note(path: str) -> dict | None:
    """The handover note when it names a live process of this boot with its recorded start time
    (else None: absent, unreadable, stale).  Never raises."""
    try:
        note = json.loads(untrusted.read_file(path, 1 << 16))     # no symlink, no FIFO, root's, bounded
        pid, start = int(note["pid"]), int(note["starttime"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    p = proctree.read_proc(pid) if pid > 1 else None
    if note.get("boot_id") != sysinfo.boot_id() or p is None or p.starttime != start:
        return None
    return note


def remove_note(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


_TAKEN: dict[str, dict | None] = {}     #: note path -> what :func:`take_note` read there (this process)


def take_note(path: str) -> dict | None:
    """Read (:func:`read_note`) and remove the handover note at ``path``, once per process: a
    later call for the same path returns what the first read.  The daemon calls it first thing at
    start (``$RUNTIME_DIRECTORY``'s note, before anything can fail), so no note outlives the start
    that follows it; adoption calls it again for the detail it logs."""
    if path not in _TAKEN:
        _TAKEN[path] = read_note(path)
        remove_note(path)
    return _TAKEN[path]


def take_unit_note(env=None) -> None:
    """At daemon start: :func:`take_note` of the unit's note, when run by systemd with a runtime
    directory (else the supervisor takes the one beside its control socket).  Never raises."""
    d = runtime_dir(env)
    if d:
        take_note(os.path.join(d, NOTE_NAME))


def honoured_for_stop(note: dict | None, env=None) -> bool:
    """Does ``note`` keep the engine on a stop job?  Only a note this invocation of the unit wrote
    (its ``invocation_id`` is ``$INVOCATION_ID``, which ExecStopPost shares with the main process:
    systemd.exec(5)) for a stop (``kind`` ``stop``: ``engine.on_daemon_stop: keep``)."""
    env = os.environ if env is None else env
    me = env.get("INVOCATION_ID") or ""
    return bool(note) and bool(me) and note.get("invocation_id") == me and note.get("kind") == "stop"


def engine_cgroups(unit_dir: str) -> list[str]:
    """The ``engine-*`` cgroup directories directly under ``unit_dir``."""
    try:
        with os.scandir(unit_dir) as it:
            return sorted(e.path for e in it if e.is_dir(follow_symlinks=False) and e.name.startswith("engine-"))
    except OSError:
        return []


def unguarded_engines(directory: str | None = None, unit: str = "sparkguard.service",
                      mountinfo: str = "/proc/self/mountinfo") -> list[str]:
    """The populated ``engine-*`` cgroups of the unit (``directory``; default
    ``<cgroup2 mount>/system.slice/UNIT``): asked when no daemon answers, they are engines nothing
    guards (a ``systemctl stop`` during the restart wait after a crash leaves one until the orphan
    check stops it: :mod:`.orphancheck`, docs/adoption.md).  Empty when none or unreadable; never raises."""
    if directory is None:
        mount = cgroups.find_mount(mountinfo)
        if mount is None:
            return []
        directory = cgroups.cgroup_dir(mount, f"/system.slice/{unit}")
    return [p for p in engine_cgroups(directory) if cgroups.populated(p)]


def unit_dir(proc_cgroup: str = "/proc/self/cgroup", mountinfo: str = "/proc/self/mountinfo") -> str | None:
    """The unit's cgroup directory as seen from a control process (ExecStopPost runs in
    ``<unit>/.control`` under ``Delegate=yes``, in the unit's cgroup otherwise)."""
    mount = cgroups.find_mount(mountinfo)
    path = cgroups.own_path(proc_cgroup)
    if mount is None or path is None:
        return None
    d = cgroups.cgroup_dir(mount, path)
    while os.path.basename(d) in (".control", cgroups.LEAF):
        d = os.path.dirname(d)
    return d if os.path.basename(d).endswith(".service") else None


def stop_post(note: str, job: str | None, service_result: str, directory: str | None,
              env=None, cfg=None, max_grace: float | None = None) -> tuple[list[str], str]:
    """The ExecStopPost decision and action (module doc).  Returns ``(what was stopped, why)``.

    Args:
        note: the handover note's path; job: systemd's job type for the unit (None: none,
        :data:`JOB_UNKNOWN`: it could not be read); service_result: ``$SERVICE_RESULT``
        (systemd.exec(5)); directory: the unit's cgroup dir; env: the environment
        (``INVOCATION_ID``; default ``os.environ``); cfg: ``config.Config`` (``guard.grace``,
        ``targets.protect``, ``engine.state_file``; default: the defaults); max_grace:
        :func:`stop_engines`.
    """
    if directory is None:
        return [], "not in a systemd unit's cgroup: nothing to do"
    if job == JOB_UNKNOWN:
        if service_result in CRASH_RESULTS:
            return [], (f"systemd's job could not be read, the daemon crashed (service result {service_result}): "
                        "left for the next daemon to adopt")
        job = "stop"                    # cannot tell: the safe side of a stop is the engine stopped
    kept = read_note(note)
    if job == "stop" and honoured_for_stop(kept, env):
        return [], f"the daemon kept pid {kept['pid']} on purpose ({kept.get('kept')})"
    if job != "stop":
        return [], (f"systemd job {job}: left for the next daemon to adopt" if job
                    else f"no stop job (service result {service_result or '?'}): left for the next daemon to adopt")
    if kept is not None:
        log.warning("sparkguard stop-post: ignoring the handover note %s (invocation %s, kind %s): not this "
                    "invocation's stop", note, kept.get("invocation_id") or "?", kept.get("kind") or "?")
    return stop_engines(directory, cfg, max_grace), "a stop job and no handover note: the engine goes with the daemon"


STOP_POST_MARGIN = 3.0     #: seconds of the unit's stop timeout kept for stop-post's start-up and the SIGKILL


def stop_timeout(unit: str, timeout: float = JOB_TIMEOUT) -> float | None:
    """The unit's ``TimeoutStopSec`` in seconds (``systemctl show -p TimeoutStopUSec --value``,
    a systemd time span such as ``2min`` or ``1min 30s``), None when unknown or infinite.  It
    bounds each ExecStopPost command too (systemd.service(5), TimeoutStopSec=): a stop-post still
    in its grace then is SIGKILLed and the engine left running.  Never raises."""
    try:
        r = subprocess.run(["systemctl", "show", "-p", "TimeoutStopUSec", "--value", unit],
                           capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return None
    total = 0.0
    try:
        for part in r.stdout.split():
            total += parse_duration(part)
    except ValueError:
        return None
    return total or None


def stop_engines(directory: str, cfg=None, max_grace: float | None = None, loose: bool = True,
                 who: str = "stop-post") -> list[str]:
    """Stop what the unit's engine left: every populated ``engine-*`` cgroup of ``directory``, the
    processes the state file records (``engine.state_file``, this boot; each only while it has its
    recorded start time: the process-group mode has no cgroup), and the recorded container once
    verified (:func:`adopt.verified_container`: its processes are in the container runtime's
    cgroup, not the engine's).  SIGTERM, ``guard.grace``, SIGKILL (``targets.protect`` never
    SIGKILLed: :func:`process.sweep`), then ``RUNTIME rm -f`` of the container
    (:func:`container.finish`).  ``max_grace``: the grace is cut to that many seconds (the time
    systemd gives this ExecStopPost, :func:`stop_timeout`, less :data:`STOP_POST_MARGIN`; logged).
    ``loose=False``: only the processes of the ``engine-*`` cgroups are signalled (the recorded
    container is still removed through its runtime CLI): :mod:`.orphancheck`.  ``who``: the
    command its log lines name (``sparkguard WHO: ...``).
    Returns what was stopped (cgroup paths, ``container ID``, ``N processes``)."""
    cfg = config.from_dict({}) if cfg is None else cfg
    grace, protect = cfg.guard.grace, cfg.targets.protect
    if max_grace is not None and grace > max_grace:
        log.warning("sparkguard %s: guard.grace %g s does not fit the unit's stop timeout: SIGKILL "
                    "after %g s", who, grace, max(0.0, max_grace))
        grace = max(0.0, max_grace)
    state = lanes.read_state(cfg.engine.state_file)
    rec, _ = adopt.record_of(state)
    if rec is not None and state.get("boot_id") != sysinfo.boot_id():
        rec = None
    members: dict[int, int] = dict(rec.members) if rec is not None else {}
    if rec is not None:
        members[rec.pid] = rec.starttime
    ctr, why = adopt.verified_container(rec.container if rec is not None else None)
    if why:
        log.warning("sparkguard %s: recorded container not taken: %s", who, why)
    members.update(container.members(ctr))
    if not loose:
        members = {}

    def note(ev: str, detail: str) -> None:
        log.warning("sparkguard %s: %s", who, detail)
    stopped = []
    for path in engine_cgroups(directory):
        cg = cgroups.EngineCgroup(path)
        if cg.populated():
            process.sweep(None, members, grace, protect, note, cgroup=cg)
            members = {}
            stopped.append(path)
        cg.remove()
    if members and process.sweep(None, members, grace, protect, note):
        stopped.append(f"{len(members)} recorded processes")
    if ctr is not None and rec is not None and rec.launch:
        launch, why = adopt.launch_of(rec.launch, list(cfg.engine.command), cfg.engine.state_file, dict(os.environ))
        if launch is not None:
            stopped.append(container.finish(launch, ctr))
        else:
            log.warning("sparkguard %s: the recorded container launch is not taken: %s", who, why)
    return stopped


def register(sub) -> None:
    """``sparkguard stop-post``: the unit's ExecStopPost (module doc); ``sparkguard orphan-check``:
    the check a crash's stop-post arms (:mod:`.orphancheck`)."""
    p = sub.add_parser("stop-post", help="(the unit's ExecStopPost) stop engine cgroups a stopped daemon left")
    p.add_argument("--config", default=None, help="the daemon's config (guard.grace, targets.protect, "
                   "engine.state_file; default /etc/sparkguard/sparkguard.yaml; its defaults when unreadable)")
    p.add_argument("--note", default=None, help=f"the handover note (default $RUNTIME_DIRECTORY/{NOTE_NAME}, "
                   f"else {DEFAULT_NOTE})")
    p.set_defaults(func=_main)
    p = sub.add_parser("orphan-check", help="(armed by stop-post after a crash) stop an engine that a stop of "
                       "the unit during its restart wait left unguarded")
    p.add_argument("--unit", required=True, help="the sparkguard unit (sparkguard.service)")
    p.add_argument("--invocation", required=True, help="the crashed invocation's id ($INVOCATION_ID)")
    p.add_argument("--attempt", type=int, default=1, help=f"this check's number (at most {orphancheck.ATTEMPTS})")
    p.add_argument("--cgroup", required=True, help="the unit's cgroup directory")
    p.add_argument("--config", default=config.DEFAULT_PATH, help="the daemon's config (guard.grace, "
                   "targets.protect, engine.state_file, engine.on_daemon_stop)")
    p.set_defaults(func=orphan_check)


def stop_config(path: str | None, who: str = "stop-post"):
    """The daemon's config for stop-post (``who``: the command, for the log), its defaults when it
    cannot be read (logged): a refused config must not leave the engine running."""
    path = path or config.DEFAULT_PATH
    try:
        return config.load(path)
    except (config.ConfigError, OSError) as e:
        log.warning("sparkguard %s: config %s not usable (%s); using the defaults", who, path, e)
        return config.from_dict({})


def _main(args) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    unit = unit_name()
    job = unit_job(unit, 5.0) if unit else None
    note = args.note or os.path.join(runtime_dir() or os.path.dirname(DEFAULT_NOTE), NOTE_NAME)
    limit = stop_timeout(unit) if unit else None
    result, directory, cfg = os.environ.get("SERVICE_RESULT", ""), unit_dir(), stop_config(args.config)
    stopped, why = stop_post(note, job, result, directory, cfg=cfg,
                             max_grace=limit - STOP_POST_MARGIN if limit else None)
    if unit and directory and unguarded_engines(directory) and orphancheck.should_arm(job, result, CRASH_RESULTS):
        why += "; " + orphancheck.arm(unit, os.environ.get("INVOCATION_ID", ""), directory,
                                      args.config or config.DEFAULT_PATH, cfg.guard.grace)
    print(f"sparkguard stop-post: {why}" + (f"; stopped {', '.join(stopped)}" if stopped else ""), file=sys.stderr)
    return 0


def orphan_check(args) -> int:
    """``sparkguard orphan-check``: the verdict of :func:`orphancheck.verdict` on the unit as it is
    now, and what it says: stop the engine cgroups (:func:`stop_engines`, ``loose=False``), arm the
    next check, or leave; one line to the unit's journal, also when the check itself fails (it then
    arms the next check while attempts remain).  Exit 2 on unusable arguments."""
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    oc = orphancheck
    props = oc.show(args.unit, ("InvocationID", "ActiveState", "SubState", "ControlGroup")) \
        if oc.unit_name_ok(args.unit) else None
    if not oc.args_ok(args.unit, args.invocation, args.cgroup, (props or {}).get("ControlGroup")):
        print(f"sparkguard orphan-check: refused: unit {args.unit!r}, invocation {args.invocation!r}, "
              f"cgroup {args.cgroup!r}", file=sys.stderr)
        return 2
    cfg, action, priority = None, oc.AGAIN, 5
    try:
        cfg = stop_config(args.config, who="orphan-check")
        action, why = oc.verdict(args.invocation, props, unit_job(args.unit, oc.CLI_TIMEOUT),
                                 bool(unguarded_engines(args.cgroup)), cfg.engine.on_daemon_stop)
        if action == oc.STOP:
            priority = 4
            why += "; stopped " + (", ".join(stop_engines(args.cgroup, cfg, loose=False, who="orphan-check"))
                                   or "nothing")
    except Exception as e:  # noqa: BLE001 - the unit's journal must say what happened, and a check follows
        action, priority = oc.AGAIN, 3
        why = f"the check failed ({type(e).__name__}: {e})"
    if action == oc.AGAIN:
        grace = cfg.guard.grace if cfg is not None else config.from_dict({}).guard.grace
        why += "; " + (oc.arm(args.unit, args.invocation, args.cgroup, args.config, grace, args.attempt + 1)
                       if args.attempt < oc.ATTEMPTS else f"no check after {oc.ATTEMPTS}")
    oc.tell(args.unit, f"sparkguard orphan-check: invocation {args.invocation}, check {args.attempt}: {action}: {why}",
            priority)
    return 0

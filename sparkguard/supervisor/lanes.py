"""Lanes and the persisted engine state: what to run, and what survives a daemon restart.

A lane (``engine.lanes: {name: {args, env}}``) appends its ``args`` to ``engine.command`` and
merges its ``env`` over ``engine.env``; switching lanes is a restart.  The current lane and the
running engine's identity (pid, pgid, start time, every member seen; and for adoption its run
cgroup, command digest, run id, ready flag and output FIFOs: :mod:`.adopt`) are kept in
``engine.state_file`` (JSON, written atomically), so that the lane survives a daemon restart and
a new daemon can sweep an engine that a killed one left running (same boot only).
"""

from __future__ import annotations

import json
import logging
import os
import time

from sparkguard import config as cm
from sparkguard import sysinfo, untrusted
from sparkguard.host.files import atomic_write
from sparkguard.supervisor.process import ENV_DROP, passwd

log = logging.getLogger("sparkguard.supervisor")
#: bytes the engine state file may hold (a few KiB: one engine's pids, argv and cgroup)
STATE_MAX = 1 << 20


def config_lane(ecfg) -> str | None:
    """The lane the configuration asks for: ``engine.lane``, else the first of ``engine.lanes``,
    None without lanes."""
    return (ecfg.lane or next(iter(ecfg.lanes))) if ecfg.lanes else None


def read_state(path: str) -> dict:
    """The persisted state (``{}`` when absent or unreadable; unreadable is logged).  Read as a
    file another user may have put there (:func:`sparkguard.untrusted.read_file`: no symlink, no
    FIFO, owned by root, at most :data:`STATE_MAX` bytes): what it names is signalled and adopted."""
    try:
        st = untrusted.loads(untrusted.read_file(path, STATE_MAX).decode("utf-8", "replace"))
        return st if isinstance(st, dict) else {}
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        log.warning("engine state file %s unreadable (%s); starting from the config", path, e)
        return {}


def initial_lane(ecfg, state: dict) -> str | None:
    """The lane to start in: the persisted one (``sparkguard engine lane``) unless the config's
    ``engine.lane`` changed since it was persisted; else the config's (or the first)."""
    if not ecfg.lanes:
        return None
    cfg_lane = config_lane(ecfg)
    lane = state.get("lane")
    if lane in ecfg.lanes and state.get("config_lane") == cfg_lane:
        return lane
    if lane and lane not in ecfg.lanes:
        log.warning("persisted lane %r is not in engine.lanes any more; using %r", lane, cfg_lane)
    return cfg_lane


def write_state(ecfg, lane: str | None, run) -> None:
    """Persist ``lane`` and ``run``'s identity (None: no engine runs) to ``engine.state_file``
    (:func:`sparkguard.host.files.atomic_write`).  A write error is logged, never raised."""
    st = {"version": 1, "lane": lane, "config_lane": config_lane(ecfg),
          "boot_id": sysinfo.boot_id(), "updated_at": time.time()}
    if run is not None:
        st["engine"] = {"pid": run.pid, "pgid": run.pgid, "starttime": run.starttime,
                        "members": {str(k): v for k, v in dict(run.members).items()}}
        if run.container is not None:     # a docker|podman run engine: what names its container
            st["engine"]["container"] = dict(run.container.as_dict(), starttime=run.container.starttime)
        # what a later daemon checks before it adopts the run (sparkguard.supervisor.adopt)
        cg = getattr(run, "cgroup", None)
        st["engine"].update({"cgroup": cg.path if cg is not None else None, "digest": getattr(run, "digest", ""),
                             "wall_spawn": run.wall_spawn, "lane": run.lane, "argv": list(run.argv),
                             "ready": bool(run.ready), "fifos": dict(getattr(run, "fifos", {})),
                             "fifo_ids": dict(getattr(run, "fifo_ids", {})), "adopted": bool(getattr(run, "adopted", False)),
                             "group": {str(k): v for k, v in dict(getattr(run, "group", {})).items()}})
        launch = getattr(run, "launch", None)
        if launch is not None:
            st["engine"]["launch"] = {"runtime": launch.runtime, "cidfile": launch.cidfile, "name": launch.name,
                                      "user_name": launch.user_name}
    path = ecfg.state_file
    try:
        atomic_write(path, json.dumps(st))
    except OSError as ex:
        log.warning("cannot write engine state file %s: %s (the lane will not survive a restart)", path, ex)


def previous_engine(state: dict, boot_id: str) -> tuple[int, dict[int, int]] | None:
    """``(pgid, members)`` of the engine a previous daemon recorded in ``state`` during this boot
    (``boot_id``), None when there is none or the record is unusable."""
    prev = state.get("engine")
    if not prev or state.get("boot_id") != boot_id:
        return None
    try:
        members = {int(k): int(v) for k, v in (prev.get("members") or {}).items()}
        return int(prev.get("pgid") or 0), members
    except (TypeError, ValueError, AttributeError):
        return None


def command(cfg, lane: str | None) -> tuple[list[str], dict[str, str]]:
    """argv and environment of the engine in ``lane``.

    The daemon's environment without systemd's per-service variables, HOME/USER/LOGNAME of
    ``engine.user``, ``engine.env``, the lane's env; for vLLM (unless the user set it, or passed
    ``--shutdown-timeout``) ``VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS`` below ``guard.grace`` so that
    SIGTERM gives its workers time to tear CUDA down (FIELD-NOTES, vLLM 0.33).

    Args:
        cfg: ``config.Config``.
    Raises:
        KeyError: ``engine.user`` does not exist.
    """
    e = cfg.engine
    ln = e.lanes.get(lane) if lane else None
    argv = list(e.command) + (list(ln.args) if ln else [])
    env = {k: v for k, v in os.environ.items() if k not in ENV_DROP}
    if e.user is not None:
        pw = passwd(e.user)
        env.update(HOME=pw.pw_dir, USER=pw.pw_name, LOGNAME=pw.pw_name)
    env.update(e.env)
    if ln:
        env.update(ln.env)
    if cm.is_vllm(argv) and cm.SHUTDOWN_ENV not in env and not any(
            a == "--shutdown-timeout" or a.startswith("--shutdown-timeout=") for a in argv):
        secs = e.shutdown_timeout if e.shutdown_timeout is not None else cm.vllm_shutdown_timeout(cfg.guard.grace)
        env[cm.SHUTDOWN_ENV] = f"{secs:g}"
    return argv, env

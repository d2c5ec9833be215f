"""An engine that is a container: recognise ``docker run`` / ``podman run``, know the container, remove it.

The public multi-Spark recipes (FIELD-NOTES, "What the public multi-Spark recipes do") start vLLM as::

    docker run --gpus all --network host --ipc host -v /models:/models IMAGE \\
        vllm serve MODEL --tensor-parallel-size 2 ...

and stop it with ``docker stop -t N`` or ``docker rm -f``.  Written as ``engine.command`` exactly
so (``[docker, run, ...]`` or ``[podman, run, ...]``), the process sparkguard spawns is the
attached client; the engine runs under containerd-shim (or conmon), outside the client's tree.
This module makes the container part of the run:

* :func:`prepare` (the command line read by :mod:`.container_argv`) adds ``--cidfile`` (in a
  runtime directory) so the client writes the container's id, ``--name sparkguard-engine-<hex>``
  only when the user gave no ``--name``, ``--rm`` unless given; it refuses ``-d``/``--detach``
  (the client would exit at once), ``--sig-proxy=false`` (until the container is known the SIGTERM
  goes to the client, which must forward it) and ``--restart`` (the runtime would restart the
  engine behind sparkguard).
* :func:`discover` (the run's ``sg-engine-ctr`` thread) waits for the cidfile, then ``docker
  inspect`` by the container's name until the container runs: its id, name and init pid
  (:class:`Container`).  With ``engine.user`` the cidfile's folder is that user's, and so is what
  it holds: the cidfile says only that the container was created; its content is read (as the
  engine user's file: :func:`sparkguard.untrusted.read_file`, no symlink, at most
  :data:`CID_MAX` bytes, a container id or nothing) only for a launch without a name.
* :func:`members` lists the container's processes from the cgroup of its init
  (:mod:`.container_cgroup`).  The engine's tree for the guard and the escalation is the client's
  tree plus these.
* :func:`finish` after the run: what the container's own exit status was (``docker inspect``), and
  ``docker rm -f`` so no container runs (or blocks the next start's ``--name``) behind a dead client.
* guard-only mode (no ``engine:``): :func:`widen` gives a matched tree whose root runs in a
  container that container's processes and names it in the title; :func:`retitle` adds the name
  once docker answered (never waited for on the guard's thread).

Signals: the SIGTERM goes to the container's init through its pidfd (what ``docker stop`` sends
first), not to the client (``signals.Tree`` ``term``, set by :mod:`.process`): the client's
``--sig-proxy`` would forward a second one.  Until the container is known it goes to the client,
which forwards it (``--sig-proxy``, default true: docker-run(1)).  The SIGKILL after the grace
reaches the client and every process in the container's cgroup directly (pidfds).  The CLIs run
with sparkguard's environment (``DOCKER_HOST``, ``CONTAINER_HOST`` are honoured as they document).
"""

from __future__ import annotations

import json
import logging
import os
import pwd
import re
import subprocess
import time
import uuid
from dataclasses import dataclass, field

from sparkguard import proctree, untrusted
from sparkguard.config import is_vllm, vllm_shutdown_timeout
from sparkguard.supervisor import container_argv, container_cgroup, container_names

log = logging.getLogger("sparkguard.supervisor")

#: seconds one CLI call (inspect, rm) may take before it is given up
CLI_TIMEOUT = 20.0
#: vLLM's TERM-first shutdown variable (FIELD-NOTES; :mod:`sparkguard.supervisor.lanes` sets it for a bare engine)
SHUTDOWN_ENV = "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS"
NAME_PREFIX = "sparkguard-engine-"
#: bytes a cidfile may hold: a full container id is 64 hex digits (docker, podman), plus a newline
CID_MAX = 128
#: what a container id is: 12 (short) to 64 hex digits
CID_RE = re.compile(r"[0-9a-f]{12,64}")


@dataclass
class Launch:
    """What :func:`prepare` added to a container command.

    Attributes:
        runtime: str, the CLI (``argv[0]`` as written: ``docker``, ``/usr/bin/podman``...).
        cidfile: str, the path the client writes the container id to.
        name: str | None, the ``--name`` sparkguard added (None: the user named it).
        env: dict, the client's environment (used for sparkguard's own CLI calls too).
        user_name: str | None, the ``--name`` the user gave.
        global_opts: list[str], the CLI's options before its verb (``-H``, ``--context``, podman's
            ``--url``, ``--root``...): sparkguard's own CLI calls repeat them, so they reach the
            same daemon or storage as the client.
        uid: int | None, who writes the cidfile (``engine.user``'s uid; None: root or this
            process's user): the only owner a cidfile read back may have.
    """

    runtime: str
    cidfile: str
    name: str | None
    env: dict
    user_name: str | None = None
    global_opts: list = field(default_factory=list)
    uid: int | None = None

    def ref(self) -> str | None:
        """How sparkguard's own CLI calls name the container: the ``--name`` it gave or the user's;
        None for a launch without one (only an adopted record can lack both)."""
        return self.name or self.user_name


@dataclass
class Container:
    """A running container of a run.

    Attributes:
        id: str, the full container id.  name: str, without the leading ``/``.
        pid: int, its init process (host pid).  starttime: int, the init's start time (ticks).
        cgroup: str | None, the cgroup directory whose ``cgroup.procs`` lists its processes.
    """

    id: str
    name: str
    pid: int
    starttime: int
    cgroup: str | None

    def as_dict(self) -> dict:
        """``{"id", "name", "pid", "cgroup"}`` (incident reports, the state file)."""
        return {"id": self.id, "name": self.name, "pid": self.pid, "cgroup": self.cgroup}

    def label(self) -> str:
        """``"container 0123456789ab (name)"``: how logs and incidents name it."""
        return f"container {self.id[:12]}" + (f" ({self.name})" if self.name else "")


def prepare(argv: list[str], env: dict, rundir: str, shutdown: float | None = None) -> tuple[list[str], Launch | None]:
    """The argv to execute for ``argv``, and the :class:`Launch` when it is a container.

    Args:
        argv: ``engine.command`` (+ the lane's args).  env: the client's environment (from
            ``lanes.command``).  rundir: a directory for the cidfile (created 0700).
    Returns:
        ``(argv, None)`` unchanged when it is no ``docker|podman run``; else the argv with
        ``--cidfile``, ``--name`` (only when none was given), ``--rm`` (unless given: the
        container lives as long as the run, and the runtime removes it even when sparkguard
        cannot) and, when the command inside is vLLM (``config.is_vllm``) and neither it nor the
        options mention ``--shutdown-timeout`` or :data:`SHUTDOWN_ENV`,
        ``-e VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS=N`` inserted right after the ``run`` verb (after
        any wrapper, global options and ``container``: :func:`container_argv.parse`) (N: the client
        environment's value, else ``shutdown`` seconds; the container does not inherit the
        client's environment, and without it vLLM SIGKILLs its workers at once on SIGTERM:
        FIELD-NOTES).
    Raises:
        ValueError: ``-d``/``--detach`` (``--detach=false`` is fine), docker's ``-i`` with ``-t``
            (no terminal: the client would refuse), ``--sig-proxy=false``,
            ``--cidfile`` or a ``--restart`` policy other than ``no``; or a command line
            :func:`container_argv.parse` refuses (``sudo docker run``, an unknown short option,
            no image).  The message says why.
        OSError: rundir cannot be created.
    """
    cmd = container_argv.parse(argv)
    if cmd is None:
        return argv, None
    rt = cmd.runtime
    why = container_argv.refusal(cmd)
    if why is not None:
        raise ValueError(why)
    os.makedirs(rundir, mode=0o700, exist_ok=True)
    tag = uuid.uuid4().hex[:12]
    cidfile = os.path.join(rundir, f"engine-{tag}.cid")
    extra = ["--cidfile", cidfile]
    name = None
    user_name = cmd.value("name")
    if user_name is None:
        name = NAME_PREFIX + tag
        extra += ["--name", name]
    if not cmd.has("rm"):
        extra += ["--rm"]
    client_env = cmd.client_env(env)
    if (is_vllm(cmd.inner) and not any(SHUTDOWN_ENV in a or a.startswith("--shutdown-timeout") for a in argv)
            and (SHUTDOWN_ENV in client_env or shutdown is not None)):
        extra += ["-e", f"{SHUTDOWN_ENV}={client_env.get(SHUTDOWN_ENV) or f'{shutdown:g}'}"]
    return ([*argv[:cmd.at], *extra, *argv[cmd.at:]],
            Launch(rt, cidfile, name, client_env, user_name, list(cmd.global_opts)))


def clear_stale(launch: Launch) -> str | None:
    """Before a start: remove a container that is not running and carries the user's ``--name``
    (left by a run whose cleanup did not happen: sparkguard was killed), which would make the
    client fail with a name conflict.  A running one is left alone (someone else's, or an engine
    that outlived its daemon): the start then fails with docker's own message.

    Returns:
        str, what was done (for the log), or None when there was nothing to do.
    """
    if launch.user_name is None:
        return None
    info = inspect(launch, launch.user_name)
    if info is None:
        return None
    if (info.get("State") or {}).get("Running"):
        return (f"a container named {launch.user_name} ({str(info.get('Id'))[:12]}) already runs: "
                f"{launch.runtime} run will refuse the name")
    try:
        r = cli(launch, "rm", launch.user_name)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"cannot remove the stopped container {launch.user_name}: {e}"
    if r.returncode != 0:
        return f"cannot remove the stopped container {launch.user_name}: {r.stderr.strip()[-200:]}"
    return f"removed the stopped container {launch.user_name} ({str(info.get('Id'))[:12]}) left by an earlier run"


def cli(launch: Launch, *args: str, timeout: float = CLI_TIMEOUT) -> subprocess.CompletedProcess:
    """Run ``RUNTIME GLOBAL_OPTS ARGS...`` with the client's environment; output captured as text.
    Raises OSError (no CLI) and subprocess.TimeoutExpired."""
    return subprocess.run([launch.runtime, *launch.global_opts, *args], env=launch.env, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=timeout)


def inspect(launch: Launch, ref: str, timeout: float = CLI_TIMEOUT) -> dict | None:
    """``RUNTIME inspect REF`` (container), its first object; None when there is no such container
    or the CLI fails or takes over ``timeout`` seconds (logged)."""
    return _inspect(launch, ref, timeout)[0]


def _inspect(launch: Launch, ref: str, timeout: float) -> tuple[dict | None, bool]:
    """:func:`inspect`'s answer and whether the runtime said there is no such container
    (docker: ``No such container``, podman: ``no such container``)."""
    try:
        r = cli(launch, "container", "inspect", ref, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        log.warning("engine: %s container inspect %s: %s", launch.runtime, ref, e)
        return None, False
    if r.returncode != 0:
        return None, "no such" in r.stderr.lower()
    try:
        data = json.loads(r.stdout)
    except ValueError:
        return None, False
    return (data[0] if isinstance(data, list) and data and isinstance(data[0], dict) else None), False


def created(launch: Launch) -> bool:
    """Whether the client has written the cidfile (it does once the container is created): only
    whether a name is there, nothing of it is read."""
    try:
        os.lstat(launch.cidfile)
    except OSError:
        return False
    return True


def read_cid(launch: Launch) -> tuple[str | None, str]:
    """The container id in the cidfile, read as a file the engine's user wrote in a folder that
    user owns (``engine.user``): the folder and the file opened without following a symlink
    (:func:`sparkguard.untrusted.open_dir`, :func:`~sparkguard.untrusted.read_file`), the file a
    regular one owned by :attr:`Launch.uid` (a hard link to root's file is not the user's), at
    most :data:`CID_MAX` bytes, its text 12-64 hex digits (:data:`CID_RE`).  Nothing else ever
    reaches a command line, a log or the state file.

    Returns:
        ``(id, "")``; ``(None, "")`` while the file is absent or empty; ``(None, why)`` when it is
        refused (why names the file and the reason, never what it holds).
    """
    owners = (launch.uid,) if launch.uid is not None else None
    try:
        dfd = untrusted.open_dir(os.path.dirname(launch.cidfile), owners=untrusted.trusted_uids() + (owners or ()))
        try:
            raw = untrusted.read_file(os.path.basename(launch.cidfile), CID_MAX, owners=owners, dir_fd=dfd)
        finally:
            os.close(dfd)
    except FileNotFoundError:
        return None, ""
    except untrusted.FileRefused as e:
        return None, f"{launch.cidfile}: {e.why}" if e.path != os.path.dirname(launch.cidfile) else str(e)
    except OSError as e:
        return None, f"{launch.cidfile}: {e.strerror or e}"
    cid = raw.decode("ascii", "replace").strip()
    if not cid:
        return None, ""
    if CID_RE.fullmatch(cid) is None:
        return None, f"{launch.cidfile}: holds no container id (not 12-64 hex digits)"
    return cid, ""


def discover(launch: Launch, done, timeout: float | None = None, interval: float = 0.2) -> Container | None:
    """Wait for the client to create and start the container; its :class:`Container`.

    The cidfile appears when the container is created (an image pull comes first and may take
    minutes), the init pid once it started; both are polled every ``interval`` seconds (the client
    gives no event for either), until ``done`` (a ``threading.Event``: the run is over) is set or
    ``timeout`` seconds (None: no limit) have passed.  Returns None then.  The container is asked
    for by its name (:meth:`Launch.ref`), which sparkguard gave or the configuration did, never by
    what the engine user's cidfile holds (:func:`read_cid` only for a launch without a name).
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    ref, why_said = None, ""
    while not done.is_set() and (deadline is None or time.monotonic() < deadline):
        if ref is None and created(launch):
            ref = launch.ref()
            if ref is None:         # a launch without a name: the cidfile's id, if it holds one
                ref, why = read_cid(launch)
                if why and why != why_said:     # said once, not at every poll
                    why_said = why
                    log.error("engine: the container's id file is refused: %s", why)
        if ref:
            info = inspect(launch, ref)
            state = (info or {}).get("State") or {}
            pid = state.get("Pid") if isinstance(state, dict) else 0
            pid = pid if isinstance(pid, int) and not isinstance(pid, bool) else 0
            full = str((info or {}).get("Id") or "")
            if pid > 0 and CID_RE.fullmatch(full):
                # State.Pid names a process of this host only when the runtime shares its pid
                # namespace (not a remote DOCKER_HOST, not docker-in-docker): the pid's own cgroup
                # must name this container, else the pid is someone else's and is never signalled
                seen = container_cgroup.container_of(pid)
                if seen is None or seen[1] != full:
                    log.warning("container %s: its init pid %d is not in the container's cgroup here "
                                "(a runtime in another pid namespace?); tracking the client only", full[:12], pid)
                    return None
                p = proctree.read_proc(pid)
                if p is not None:
                    name = str(info.get("Name") or "").lstrip("/")
                    return Container(full, name, pid, p.starttime, container_cgroup.cgroup_dir(pid))
            elif info is not None and isinstance(state, dict) and state.get("Status") in ("exited", "dead"):
                return None
        done.wait(interval)
    return None


def members(ctr: Container | None, procs: dict | None = None) -> dict[int, int]:
    """Live processes of the container: ``{pid: starttime}`` from its cgroup's ``cgroup.procs``
    (child cgroups are not read: docker and podman put a container's processes in one), with the
    start times of ``procs`` (a ``proctree.scan()``, or the matching trees alone), or read now
    where ``procs`` lacks one.  Empty when unknown."""
    if ctr is None or ctr.cgroup is None:
        return {}
    out = {}
    for pid in container_cgroup.procs_of(ctr.cgroup):
        p = (procs.get(pid) if procs is not None else None) or proctree.read_proc(pid)
        if p is not None and not p.kthread:
            out[pid] = p.starttime
    return out


def finish(launch: Launch, ctr: Container | None, deadline=None) -> str:
    """After the run: the container's own exit status, then ``RUNTIME rm -f`` (kills what still
    runs in it and removes it, so nothing runs behind a dead client and a user's ``--name`` is free
    for the next start).

    Args:
        deadline: the run's :class:`stopbudget.Deadline` (None: :data:`CLI_TIMEOUT` per call);
            each CLI call gets what is left of it (:meth:`stopbudget.Deadline.step`), so a
            runtime that does not answer cannot stretch the stop past the unit's stop timeout.
    Returns:
        str, one line for the exit record (``"container 0123456789ab exit code 143, removed"``),
        empty when the container was never created.
    """
    ref = ctr.id if ctr is not None else (launch.ref() or read_cid(launch)[0]) if created(launch) else None
    try:
        os.unlink(launch.cidfile)
    except OSError:
        pass
    if ref is None:
        return ""

    def timeout() -> float:
        return deadline.step(CLI_TIMEOUT) if deadline is not None else CLI_TIMEOUT
    info, gone = _inspect(launch, ref, timeout())
    label = ctr.label() if ctr is not None else f"container {ref[:12]}"
    if gone:
        return f"{label} already removed"
    state = (info or {}).get("State") or {}
    what = (f"{label} exit code {state.get('ExitCode')}" if info is not None and not state.get("Running")
            else f"{label} still running" if info is not None else label)
    try:        # also when inspect did not answer: the container may still run
        r = cli(launch, "rm", "-f", ref, timeout=timeout())
        ok = r.returncode == 0
        if not ok:
            log.error("engine: %s rm -f %s failed: %s", launch.runtime, ref, r.stderr.strip()[-300:])
    except (OSError, subprocess.TimeoutExpired) as e:
        log.error("engine: %s rm -f %s failed: %s", launch.runtime, ref, e)
        ok = False
    return what + (", removed" if ok else ", NOT removed")


def rundir(state_file: str) -> str:
    """The directory of the cidfiles: ``containers/`` beside ``engine.state_file``."""
    return os.path.join(os.path.dirname(os.path.abspath(state_file)), "containers")


# ---- guard-only mode: a matched engine that runs in a container ---------------------------------

def _ask_name(runtime: str, cid: str) -> str | None:
    """The container's name from ``RUNTIME container inspect`` (sparkguard's environment:
    DOCKER_HOST / CONTAINER_HOST), None when it does not answer."""
    info = inspect(Launch(runtime, "", None, dict(os.environ)), cid)
    return (str(info.get("Name") or "").lstrip("/") or None) if info is not None else None


NAMES = container_names.NameCache(_ask_name)


def name_of(runtime: str, cid: str) -> str | None:
    """The container's name if already known, else None: the question runs in a thread of its own
    and a failed one is retried with a bounded backoff (:class:`container_names.NameCache`), so no
    caller (the guard's scan) ever waits for the CLI."""
    return NAMES.get(runtime, cid)


def widen(target, procs: dict, protector) -> str | None:
    """A ``targets.match`` tree whose root runs in a container: add the container's other
    processes (its cgroup, :func:`members`) to ``target.pids`` and name the container in
    ``target.title`` (``"... [container 0123456789ab (name)]"``; the name once docker answered,
    :func:`name_of`).  Cheap: two small /proc and cgroup reads, no CLI call on the caller's thread.

    Args:
        target: ``enginetree.Target`` (changed in place).  procs: the scan it came from (or the
            matching trees alone: a member missing from it is read now).
        protector: ``enginetree.Protector`` (protected processes are not added).
    Returns:
        str, the container's label, or None when the root runs in no container.
    """
    found = container_cgroup.container_of(target.root_pid)
    if found is None:
        return None
    runtime, cid = found
    ctr = Container(cid, name_of(runtime, cid) or "", target.root_pid, 0,
                    container_cgroup.cgroup_dir(target.root_pid))
    for pid, st in members(ctr, procs).items():
        p = procs.get(pid) or proctree.read_proc(pid)    # procs: a scan, or only the matching trees
        if pid not in target.starttimes and p is not None and not protector.protected(p):
            target.pids.append(pid)
            target.starttimes[pid] = st
    if ctr.cgroup and ctr.cgroup not in target.cgroups:
        target.cgroups.append(ctr.cgroup)       # its SIGKILL is the container's cgroup's (guard.cgkill)
    label = ctr.label()
    if f"[{label}]" not in target.title:
        target.title = f"{target.title} [{label}]"
    return label


def retitle(target) -> None:
    """Put the container's name into a title :func:`widen` made before docker had answered
    (``[container 0123456789ab]`` -> ``[container 0123456789ab (name)]``); a dict lookup, no CLI call."""
    m = re.search(r"\[container ([0-9a-f]{12})\]$", target.title)
    if m is None:
        return
    name = NAMES.known(m.group(1))
    if name:
        target.title = f"{target.title[:m.start()]}[container {m.group(1)} ({name})]"


def for_engine(argv: list[str], env: dict, ecfg, grace: float) -> tuple[list[str], Launch | None]:
    """The supervisor's one call before a spawn: :func:`prepare` with the cidfiles beside
    ``engine.state_file`` (:func:`rundir`) and vLLM's shutdown timeout as ``lanes.command`` picks it
    (``engine.shutdown_timeout``, else ``config.vllm_shutdown_timeout(guard.grace)``), then
    :func:`clear_stale` (logged).  With ``engine.user`` the cidfile directory is that user's (the
    client runs as it).  Raises ValueError, OSError as :func:`prepare` does; KeyError: no such user."""
    shutdown = ecfg.shutdown_timeout if ecfg.shutdown_timeout is not None else vllm_shutdown_timeout(grace)
    where = rundir(ecfg.state_file)
    argv, launch = prepare(argv, env, where, shutdown)
    if launch is not None and ecfg.user is not None:     # the client runs as engine.user and writes the cidfile
        pw = pwd.getpwuid(int(ecfg.user)) if ecfg.user.isdigit() else pwd.getpwnam(ecfg.user)
        # the folder itself, never what a symlink in its place names (O_NOFOLLOW, then fchown)
        fd = os.open(where, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            os.fchown(fd, pw.pw_uid, pw.pw_gid)
        finally:
            os.close(fd)
        launch.uid = pw.pw_uid
    if launch is not None and (said := clear_stale(launch)):
        log.warning("engine: %s", said)
    return argv, launch

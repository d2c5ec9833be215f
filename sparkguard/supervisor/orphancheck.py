"""The engine a ``systemctl stop`` during the restart wait leaves: a one-shot check armed at the crash.

After the daemon crashes (SIGKILL, a watchdog abort, a failed start) systemd runs the unit's
``ExecStopPost=sparkguard stop-post`` with no job, which leaves the engine for the next daemon to
adopt, and then waits ``RestartSec=`` in state ``auto-restart``.  A ``systemctl stop`` in that wait
sends systemd 252 straight to ``inactive`` without running ``ExecStopPost`` again (its
``service_stop()`` on a unit in ``SERVICE_AUTO_RESTART``; found in the booted Debian 12 container,
tests/system/test_adoption.py), and with ``KillMode=process`` the engine runs on, unguarded.

So the crash's stop-post arms a check (:func:`arm`): a transient timer and oneshot service
(``systemd-run --on-active=``, systemd-run(1)) that fires once the restart wait is over
(``RestartUSec`` of the unit plus :data:`MARGIN`).  The check (``sparkguard orphan-check``,
:func:`verdict`) stops the unit's engine only when all of these hold:

* an ``engine-*`` cgroup of the unit still holds processes;
* the unit's ``InvocationID`` is still the crashed one: no daemon has started since (each start
  gets a new one: systemd.exec(5), ``$INVOCATION_ID``), so none adopted the engine, and a later
  daemon's own stop (with its ExecStopPost and ``engine.on_daemon_stop``) is left alone;
* the unit is ``inactive`` or ``failed`` with no job queued (a queued start adopts it);
* ``engine.on_daemon_stop`` is ``stop`` (with ``keep`` the operator asked for the engine to stay).

The check's service is ordered ``Before=`` the unit (systemd.unit(5), "Before=, After="): a start
of the unit queued while the check runs waits until it has finished, so no daemon can adopt the
engine between the verdict and the stop (seen in the booted Debian 12: the start job listed
``waiting`` while the check's job runs, tests/system/test_adoption.py step 7; a start queued before
the verdict is seen by it, and the check leaves the engine to that daemon).  A stop of the unit
goes first (systemd's ``src/core/job.c``, ``job_compare()``: of two ordered jobs a stop or restart
one runs first, else the one ordered before; read from the source, not provoked in a test).  Still in the restart wait
(a loaded machine), the check arms itself again, :data:`ATTEMPTS` times at most.

What it stops: the processes of the unit's ``engine-*`` cgroups (SIGTERM, ``guard.grace``,
``cgroup.kill``), and the recorded container once verified (its init's start time and its cgroup
name match the state file), through the configured runtime CLI (``rm -f``): the container runtime
kills that container's processes, which live in the runtime's own scope; nothing else outside
those cgroups is signalled or removed.  Tested on systemd 252 (Debian 12); the two behaviours it
relies on (``InvocationID`` kept after a stop in the restart wait, no ``ExecStopPost`` run by that
stop) were seen there only, not on the 255 of Ubuntu 24.04.  A start of the unit queued while the
check stops an engine waits for it: up to ``guard.grace`` plus :data:`START_TIMEOUT_EXTRA`.  The command (``sparkguard
orphan-check``) is :func:`sparkguard.supervisor.handover.orphan_check`, beside stop-post, whose
stop it shares.  Its verdict goes to the unit's journal (``OBJECT_SYSTEMD_UNIT=``, which
``journalctl -u`` matches for entries sent by root: systemd.journal-fields(7), journalctl's
``add_matches_for_unit()``).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

from sparkguard import journal
from sparkguard.supervisor import cgroup as cgroups
from sparkguard.units import parse_duration

PREFIX = "sparkguard-orphan-check-"   #: the transient units' name: PREFIX + invocation id + "-" + attempt
MARGIN = 3.0        #: seconds after the restart wait: the rest of stop-post's run, systemd queueing the restart
ATTEMPTS = 5        #: checks at most for one crash (each one restart wait + MARGIN after the last)
CLI_TIMEOUT = 5.0   #: seconds: each systemctl / systemd-run call
START_TIMEOUT_EXTRA = 60.0   #: seconds the check may run beyond guard.grace (its start-up, the container CLI)
STOP, LEAVE, AGAIN = "stop", "leave", "again"
_ID = re.compile(r"^[0-9a-f]{32}$")


def should_arm(job: str | None, service_result: str, crash_results) -> bool:
    """Does the stop-post that ran with systemd's ``job`` (None: none, ``?``: unreadable) leave
    the engine while the unit may wait to restart?  True for no job or a start job (a crash, a
    daemon that died while starting: ``Restart=`` comes next) and for an unreadable job after a
    crash (``service_result`` in ``crash_results``); False for ``restart`` (no wait follows) and
    ``stop`` (stop-post decided)."""
    if job in ("restart", "stop"):
        return False
    if job == "?":
        return service_result in crash_results
    return True


#: the units ``systemctl show`` prints a time span in beyond parse_duration's (systemd's
#: ``format_timespan()``, src/basic/time-util.c: ``y``, ``month``, ``w``, ``d``), seconds each
_LONG_UNITS = {"y": 31557600.0, "month": 2629800.0, "w": 604800.0, "d": 86400.0}
_LONG = re.compile(r"(\d+(?:\.\d+)?)(y|month|w|d)\Z")


def span(text: str) -> float | None:
    """A systemd time span as ``systemctl show`` prints it (``100ms``, ``5s``, ``1min 30s``,
    ``1d 2h``) in seconds; None when it does not parse or is ``infinity``."""
    total = 0.0
    try:
        for part in text.split():
            m = _LONG.match(part)
            total += float(m.group(1)) * _LONG_UNITS[m.group(2)] if m else parse_duration(part)
    except ValueError:
        return None
    return total if text.strip() else None


def show(unit: str, props: tuple[str, ...], timeout: float = CLI_TIMEOUT) -> dict[str, str] | None:
    """``systemctl show -p P... UNIT`` as a dict, None when systemctl fails.  Never raises."""
    try:
        r = subprocess.run(["systemctl", "show", *(f"--property={p}" for p in props), unit],
                           capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if r.returncode != 0:
        return None
    return dict(ln.split("=", 1) for ln in r.stdout.splitlines() if "=" in ln)


def restart_wait(unit: str) -> float:
    """The unit's restart wait in seconds: ``RestartUSec`` (``RestartUSecNext`` too where systemd
    has it, >= 254 with ``RestartSteps=``), 1 s (the shipped unit's) when unreadable."""
    props = show(unit, ("RestartUSec", "RestartUSecNext")) or {}
    waits = [w for w in (span(props.get("RestartUSec", "")), span(props.get("RestartUSecNext", ""))) if w is not None]
    return max(waits) if waits else 1.0


def unit_name_ok(name: str) -> bool:
    """A ``.service`` name safe to put on a command line (systemd.unit(5) name characters, and a
    first one that no command line reads as an option)."""
    return bool(re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9:_.\\@-]{0,199}\.service", name))


def argv(unit: str, invocation: str, attempt: int, delay: float, cgroup_dir: str, python: str,
         config_path: str, timeout: float) -> list[str]:
    """The ``systemd-run`` command line that arms check ``attempt`` (systemd-run(1)): a timer
    firing ``delay`` s from now (``AccuracySec=100ms``: the default is a minute, systemd.timer(5)),
    a oneshot service ordered ``Before=`` the unit, unloaded once done (``--collect``),
    ``TimeoutStartSec=timeout``."""
    return ["systemd-run", "--quiet", "--collect", f"--unit={PREFIX}{invocation}-{attempt}",
            f"--on-active={delay:.3f}s", "--timer-property=AccuracySec=100ms",
            "--property=Type=oneshot", f"--property=Before={unit}", f"--property=TimeoutStartSec={timeout:.0f}s",
            "--property=SyslogIdentifier=sparkguard",
            f"--description=sparkguard: stop an engine {unit} left unguarded (check {attempt})",
            "--", python, "-m", "sparkguard", "orphan-check", "--unit", unit, "--invocation", invocation,
            "--attempt", str(attempt), "--cgroup", cgroup_dir, "--config", config_path]


def arm(unit: str, invocation: str, cgroup_dir: str, config_path: str, grace: float, attempt: int = 1,
        python: str | None = None) -> str:
    """Arm check ``attempt`` for the crash of ``invocation`` (the unit's ``$INVOCATION_ID``), one
    restart wait (:func:`restart_wait`) plus :data:`MARGIN` from now.  Returns one line saying
    what was done (also why not: systemd-run missing or refused, a bad id).  Never raises."""
    if not _ID.match(invocation or "") or not unit_name_ok(unit):
        return f"no orphan check armed: unusable invocation id {invocation!r} or unit {unit!r}"
    delay = restart_wait(unit) + MARGIN
    cmd = argv(unit, invocation, attempt, delay, cgroup_dir, python or sys.executable, config_path,
               grace + START_TIMEOUT_EXTRA)
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=CLI_TIMEOUT)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"no orphan check armed: systemd-run: {e}"
    if r.returncode != 0:
        return f"no orphan check armed: systemd-run exited {r.returncode}: {(r.stderr or '').strip()[:200]}"
    return f"orphan check {attempt} armed: {PREFIX}{invocation}-{attempt}.timer in {delay:.1f} s"


def verdict(armed: str, props: dict[str, str] | None, job: str | None, populated: bool,
            on_daemon_stop: str) -> tuple[str, str]:
    """The check's decision (module doc): ``(STOP | LEAVE | AGAIN, why)``.

    Args:
        armed: the crashed invocation's id; props: the unit's ``InvocationID``, ``ActiveState``,
        ``SubState`` (None: unreadable); job: systemd's job for the unit (None: none, ``?``:
        unreadable); populated: an ``engine-*`` cgroup of the unit holds processes;
        on_daemon_stop: ``engine.on_daemon_stop`` of the config.
    """
    if not populated:
        return LEAVE, "no engine cgroup of the unit holds processes"
    if props is None or job == "?":
        return AGAIN, "the unit's state could not be read"
    now = props.get("InvocationID", "")
    active, sub = props.get("ActiveState", "?"), props.get("SubState", "?")
    if now != armed:
        return LEAVE, (f"the unit was started again since (invocation {now or '?'}, now {active}): that daemon "
                       "adopted the engine, or its own stop decided")
    if job == "stop":
        return AGAIN, "a stop job runs for the unit"
    if job:
        return LEAVE, (f"a {job} job is queued for the unit: the daemon it starts adopts the engine"
                       if job in ("start", "restart") else f"a {job} job is queued for the unit: left to it")
    if active not in ("inactive", "failed"):
        return AGAIN, f"the unit is still {active} ({sub}) after the crash"
    if on_daemon_stop != "stop":
        return LEAVE, f"the unit stopped during its restart wait; engine.on_daemon_stop: {on_daemon_stop} keeps the engine"
    return STOP, (f"the unit is {active} after the crash and was not started again (stopped during its restart "
                  "wait, or not restarted at all): no daemon guards the engine, which goes with it")


def tell(unit: str, text: str, priority: int = 5) -> None:
    """Log ``text`` to ``unit``'s journal (``OBJECT_SYSTEMD_UNIT=``), to stderr (this check's own
    unit) when journald cannot be reached.  Never raises."""
    try:
        journal.send({"MESSAGE": text, "PRIORITY": priority, "SYSLOG_IDENTIFIER": "sparkguard",
                      "MESSAGE_ID": journal.message_id("event"), "OBJECT_SYSTEMD_UNIT": unit})
    except OSError:
        print(text, file=sys.stderr)


def cgroup_ok(path: str, unit: str, control_group: str | None = None) -> bool:
    """``path`` (the ``--cgroup`` the check was armed with) is ``unit``'s cgroup directory under
    this host's cgroup2 mount, as given (no symlink in it), and, when systemd's ``ControlGroup``
    of the unit is known (``control_group``, e.g. ``/system.slice/sparkguard.service``), that one."""
    mount = cgroups.find_mount()
    if mount is None or os.path.realpath(path) != path:     # no "..", no symlink, no trailing "/"
        return False
    root = mount[0].rstrip("/")
    if os.path.basename(path) != unit or not path.startswith(root + "/") or cgroups.populated(path) is None:
        return False
    return not control_group or os.path.normpath(root + "/" + control_group.lstrip("/")) == os.path.normpath(path)


def args_ok(unit: str, invocation: str, cgroup_dir: str, control_group: str | None = None) -> bool:
    """The check's arguments are usable: a unit name, a 32-hex-digit invocation id, its cgroup
    (``control_group``: the unit's ``ControlGroup`` as systemd reports it, when readable)."""
    return unit_name_ok(unit) and bool(_ID.match(invocation)) and cgroup_ok(cgroup_dir, unit, control_group)

"""What check-config accepts, a real daemon starts with and reloads (SIGHUP); what it refuses, a
reload refuses too, mid-incident, and the running escalation goes on (issue 11)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import uuid

import pytest

from conftest import mem_available, run_sparkguard, sg_env, sparkguard_cmd, terminate
from guardrun import TEMP_DIRS, NotifyListener

GiB, MiB = 1024**3, 1024**2

#: edge configurations: every bound of SCHEMA's numeric keys, and the spellings read as written.
#: {match} is a pattern no process has and dry_run is on, so the daemons never signal anything.
EDGES = {
    "lower_bounds": """
guard: {{poll_interval: 10ms, term_below: 16MiB, kill_below: 16MiB, grace: 0, recovery_wait: 0, dry_run: yes}}
link: {{down_after: 0}}
""",
    "upper_bounds": """
guard: {{poll_interval: 10s, term_below: 16MiB, grace: 1h, recovery_wait: 1h, dry_run: on, signal: available+swap}}
link: {{interfaces: [sgnolink0], down_after: 24h}}
""",
    "spellings": """
guard: {{poll_interval: .5, grace: 1e1, term_below: '0.5GiB', kill_below: off, recovery_wait: 1.5e0, dry_run: true}}
""",
    "engine_bounds": """
guard: {{grace: 1h, dry_run: true, term_below: 16MiB}}
engine:
  command: [sleep, '600']
  log: stderr
  drop_caches: no
  start_above: 0
  stable_for: 0
  stable_band: 0
  quiesce_timeout: 0
  health_interval: 10ms
  ready_timeout: 24h
  backoff_initial: 0
  backoff_max: 24h
  stable_after: 168h
  shutdown_timeout: 59m
  head_lost_after: 24h
  log_lines: 1
  env: {{SG_EDGE_OCTAL: 010, SG_EDGE_ID: {edge_id}}}
  state_file: {dir}/engine-state.json
  control_socket: {dir}/control.sock
""",
}


def _tail(dir_: str, match: str) -> str:
    return (f"targets: {{match: ['{match}']}}\nmetrics: {{listen: off}}\n"
            f"incidents: {{dir: {dir_}/incidents, journal: off}}\n")


def _rendered_default(dir_: str, match: str) -> str:
    """The file ``sparkguard install`` writes, made harmless: dry run, a match no process has."""
    from sparkguard.host import configfile
    text = configfile.render()
    text = re.sub(r"\n  match:\n(  - .*\n)+", f"\n  match: ['{match}']\n", text)
    for old, new in (("dry_run: false", "dry_run: true"), ("listen: 127.0.0.1:8799", "listen: 'off'"),
                     ("dir: /var/lib/sparkguard/incidents", f"dir: {dir_}/incidents"),
                     ("journal: auto", "journal: 'off'")):
        assert old in text, old
        text = text.replace(old, new)
    return text


class Daemon:
    """``sparkguard run --config PATH`` with its own NOTIFY_SOCKET; log in a file."""

    def __init__(self, dir_: str, path: str):
        self.notify = NotifyListener(os.path.join(dir_, "notify.sock"))
        self.log_path = os.path.join(dir_, "guard.log")
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(sparkguard_cmd("run", "--config", path), env=sg_env(NOTIFY_SOCKET=self.notify.path),
                                     stdout=self._log, stderr=subprocess.STDOUT)

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def wait_log(self, text: str, timeout: float = 20.0) -> None:
        import time
        deadline = time.monotonic() + timeout
        while text not in self.log():
            assert self.proc.poll() is None, f"daemon exited {self.proc.returncode}:\n{self.log()[-3000:]}"
            assert time.monotonic() < deadline, f"{text!r} not logged within {timeout}s:\n{self.log()[-3000:]}"
            self.notify.recv(0.05)   # every event here also sends sd_notify; the log line may land just after

    def reload(self) -> None:
        """SIGHUP; returns once the daemon sent RELOADING=1 and then READY=1."""
        self.proc.send_signal(signal.SIGHUP)
        self.notify.wait_for(lambda m: m.get("RELOADING") == "1")
        self.notify.wait_for(lambda m: m.get("READY") == "1")

    def stop(self) -> int:
        rc = terminate(self.proc, 30)
        self._log.close()
        self.notify.close()
        return rc


@pytest.fixture
def workdir():
    d = tempfile.mkdtemp(prefix="sg-edge-")
    TEMP_DIRS.append(d)
    return d


@pytest.mark.parametrize("name", list(EDGES) + ["rendered_default"])
def test_what_check_config_accepts_starts_and_reloads_and_a_refused_reload_keeps_running(workdir, name):
    edge_id = uuid.uuid4().hex
    match = f"^sg-edge-{edge_id}$"
    path = os.path.join(workdir, "sg.yaml")
    text = _rendered_default(workdir, match) if name == "rendered_default" else \
        EDGES[name].format(dir=workdir, edge_id=edge_id) + _tail(workdir, match)
    with open(path, "w") as f:
        f.write(text)
    c = run_sparkguard("check-config", path, timeout=30)
    assert c.returncode == 0, c.stderr
    d = Daemon(workdir, path)
    try:
        d.notify.wait_for(lambda m: m.get("READY") == "1", timeout=30)
        d.wait_log("started:")
        d.reload()
        d.wait_log("reloaded ")
        with open(path, "w") as f:
            f.write("guard: {poll_interval: .nan}\n" + _tail(workdir, match))
        d.reload()
        d.wait_log("reload failed, keeping the running config")
        assert "guard.poll_interval: nan: not a number (NaN)" in d.log()
        assert d.proc.poll() is None
    finally:
        rc = d.stop()
        left = _kill_marked(f"SG_EDGE_ID={edge_id}")
    assert rc == 0 and "Traceback" not in d.log(), d.log()[-3000:]
    assert left == [], f"the daemon left its engine behind: {left}"


def _kill_marked(marker: str) -> list[int]:
    """SIGKILL the processes whose environment holds ``marker`` (an engine this test's daemon started
    and did not stop); returns their PIDs."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/environ", "rb") as f:
                    if marker.encode() in f.read().split(b"\0"):
                        os.kill(int(name), signal.SIGKILL)
                        found.append(int(name))
            except OSError:
                pass
    return found


def test_a_refused_reload_mid_incident_keeps_the_escalation_and_the_term_ignoring_victim_is_killed(workdir):
    """The guard SIGTERMs a victim that ignores SIGTERM; a reload to ``grace: .inf`` arrives within the
    grace.  The reload is refused and SIGKILL comes on the running grace."""
    token = f"sg-victim-{uuid.uuid4().hex}"
    victim = subprocess.Popen([sys.executable, "-c", "import signal, sys; signal.signal(signal.SIGTERM, signal.SIG_IGN);"
                               f" print('up', flush=True); signal.pause()  # {token}"], stdout=subprocess.PIPE, text=True)
    try:
        assert victim.stdout.readline().strip() == "up"       # its SIGTERM handler is installed
        with open("/proc/meminfo") as f:
            total = int(next(ln for ln in f if ln.startswith("MemTotal:")).split()[1]) * 1024
        avail = mem_available()
        if total - avail < 64 * MiB:
            pytest.skip("MemAvailable too close to MemTotal to draw a line above it")
        line = (avail + total) // 2                            # crossed at once, so the guard acts now
        path = os.path.join(workdir, "sg.yaml")
        good = (f"guard: {{term_below: {line}, grace: 3s, recovery_wait: 1s}}\n"
                f"targets: {{match: ['{token}']}}\nmetrics: {{listen: off}}\n"
                f"incidents: {{dir: {workdir}/incidents, journal: off}}\n")
        with open(path, "w") as f:
            f.write(good)
        d = Daemon(workdir, path)
        try:
            d.wait_log("SIGTERM python", timeout=30)
            with open(path, "w") as f:
                f.write(good.replace("grace: 3s", "grace: .inf"))
            d.reload()
            d.wait_log("reload failed, keeping the running config")
            assert "guard.grace: inf: infinite" in d.log()
            victim.wait(timeout=20)
            assert victim.returncode == -signal.SIGKILL
            d.wait_log("SIGKILL 1 processes")
            assert d.proc.poll() is None
        finally:
            rc = d.stop()
        assert rc == 0 and "Traceback" not in d.log(), d.log()[-3000:]
    finally:
        if victim.poll() is None:
            victim.kill()
        victim.wait(10)

"""The engine outlives the daemon: a real ``sparkguard run`` supervising the real fake vLLM is
SIGKILLed (or exits on SIGUSR2, keeping its engine), a second daemon on the same config adopts
the engine, which keeps serving throughout; a wrong start time is refused, a changed command is
stopped and replaced.

Every engine process a daemon forwarded as "fake-vllm: ready pids=..." is SIGKILLed through a
pidfd at the end if it still runs with the same start time; nothing else is signalled.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.request

import pytest

from dockerd import dockerd, unique_name  # noqa: F401 - the session fixture
from supervisor_helpers import Daemon, engine_config, fake_cmd, free_port, kill_pids, unique, wait_gone
from sparkguard import proctree

pytestmark = pytest.mark.usefixtures("root_only")


class Poller:
    """A client asking the fake vLLM's /health every 50 ms in a thread; counts the failures after
    its first 200 (before it, the engine is still loading)."""

    def __init__(self, url: str):
        self.url, self.ok, self.failures = url, 0, []
        self.stop = threading.Event()
        self.opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.wait(0.05):
            try:
                with self.opener.open(self.url, timeout=2) as r:
                    if r.status == 200:
                        self.ok += 1
                        continue
                    if self.ok:
                        self.failures.append(f"status {r.status}")
            except OSError as e:
                if self.ok:
                    self.failures.append(str(e))

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)


@pytest.fixture
def daemons(tmp_path):
    """``start(name, model, port, *fake opts, **engine keys) -> Daemon`` (control socket served);
    every daemon started is stopped at the end and every engine process any of them saw is
    SIGKILLed (pidfd, same start time only)."""
    made: list[Daemon] = []

    def start(name: str, model: str, port: int, *opts: str, **engine) -> Daemon:
        cfg = engine_config(tmp_path, model, fake_cmd(model, port, *opts), port, **engine)
        d = Daemon(tmp_path, cfg, name=name)
        made.append(d)
        d.wait_control()
        return d
    yield start
    for d in made:
        d.cleanup()
    for d in made:
        kill_pids(d.engine_pids)


def kill9(d: Daemon) -> None:
    d.proc.send_signal(signal.SIGKILL)
    d.proc.wait(10)
    d.reader.join(10)


def ready_then_killed(start, model: str, port: int) -> tuple[Daemon, int]:
    """A daemon whose engine is ready, then SIGKILLed; ``(daemon, engine pid)``."""
    a = start("a", model, port)
    pid = a.wait_ready()["pid"]
    a.wait_line(r"fake-vllm: ready pids=")
    kill9(a)
    return a, pid


def adopted_status(d: Daemon, timeout: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        st = d.status()
        if st.get("adoption") and st["state"] == "ready":
            return st
        if time.monotonic() > deadline:
            raise AssertionError(f"no adoption within {timeout} s: {st.get('adoption')} {st['state']}\n{d.output()}")
        time.sleep(0.05)


def test_sigkilled_daemon_engine_keeps_serving_and_is_adopted(daemons):
    model, port = unique(), free_port()
    poll = Poller(f"http://127.0.0.1:{port}/health")
    try:
        a, pid = ready_then_killed(daemons, model, port)
        seen = dict(a.engine_pids)
        # no daemon now: the engine's output goes into its FIFO, it keeps serving
        time.sleep(0.5)
        assert proctree.read_proc(pid) is not None
        b = daemons("b", model, port)
        st = adopted_status(b)
        served = (poll.ok, list(poll.failures))
    finally:
        poll.close()
    assert st["adoption"]["result"] == "adopted", st["adoption"]
    assert st["pid"] == pid and st["adopted"] is True and st["starts"] == 1, st
    assert st["adoptions"]["adopted"] == 1, st["adoptions"]
    assert any(h["event"] == "adopt" and "adopted" in h["detail"] for h in st["history"]), st["history"]
    ok, failures = served
    assert ok > 5 and not failures, served
    # output is re-attached: the fake logs each request it serves; a request now shows up
    # in the new daemon's forwarded output
    mark = b.mark()
    urllib.request.build_opener(urllib.request.ProxyHandler({})).open(
        f"http://127.0.0.1:{port}/v1/models", timeout=5).read()
    b.wait_line(r"GET /v1/models", timeout=10, start=mark)
    # supervision carries on: the adopted engine is stopped by command through the escalation
    r = b.ctl("stop", sock_timeout=30)
    assert r["ok"], r
    left = wait_gone(list(seen), 15)
    assert not left, f"still running after engine stop: {left}\n{b.output()}"
    deadline = time.monotonic() + 15
    while (st := b.status())["last_exit"] is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "exit status unknown" in (st["last_exit"] or {}).get("detail", ""), st["last_exit"]


def test_sigusr2_exits_keeping_the_engine_and_restart_adopts_it(daemons, tmp_path):
    model, port = unique(), free_port()
    a = daemons("a", model, port)
    pid = a.wait_ready()["pid"]
    a.proc.send_signal(signal.SIGUSR2)
    assert a.proc.wait(30) == 0, a.output()
    a.wait_line(r"keeps running without a guard")
    note = tmp_path / "engine-handover.json"
    assert json.loads(note.read_text())["pid"] == pid
    state = json.loads((tmp_path / "engine-state.json").read_text())
    assert state["engine"]["pid"] == pid and state["engine"]["digest"] and state["engine"]["fifos"], state
    b = daemons("b", model, port)
    st = adopted_status(b)
    assert st["adoption"]["result"] == "adopted" and "kept by the previous daemon" in st["adoption"]["detail"], st
    assert st["pid"] == pid
    assert not note.exists(), "the handover note is consumed by the daemon that adopts"
    b.stop()
    assert wait_gone([pid], 15) == [], "SIGTERM of the adopting daemon stops the engine (no systemd)"


def test_wrong_start_time_is_refused_and_nothing_is_signalled(daemons, tmp_path):
    model, port = unique(), free_port()
    a, pid = ready_then_killed(daemons, model, port)
    path = tmp_path / "engine-state.json"
    state = json.loads(path.read_text())
    state["engine"]["starttime"] += 1          # what a reused pid looks like: same pid, other process
    state["engine"]["members"] = {}
    path.write_text(json.dumps(state))
    b = daemons("b", model, free_port())       # the old engine still holds its port
    b.wait_line(r"adoption refused: pid %d has start time" % pid, timeout=20)
    st = b.status()
    assert st["adoption"]["result"] == "refused" and "another process has that pid" in st["adoption"]["detail"]
    assert proctree.read_proc(pid) is not None, "an engine that could not be verified must not be signalled"


def test_changed_command_is_stopped_and_the_configured_one_started(daemons):
    model, port = unique(), free_port()
    a, pid = ready_then_killed(daemons, model, port)
    b = daemons("b", model, port, "--load-time", "0.2")      # another command line
    st = b.wait_ready(timeout=40)
    assert st["adoption"]["result"] == "changed", st["adoption"]
    assert st["pid"] != pid and st["adopted"] is False
    assert wait_gone(list(a.engine_pids), 5) == [], "the old engine must be stopped before the new one starts"
    assert any(h["event"] == "sigterm" and f"pid {pid}" in h["detail"] for h in st["history"]), st["history"]


def line_above_available() -> int:
    """A SIGTERM line above MemAvailable (no memory is allocated to cross it) that the config
    still accepts: below MemTotal (on an idle machine MemAvailable + 800 MiB may not be)."""
    from conftest import line_above_now
    return line_above_now(800 * 1024**2)


def reload_with(d: Daemon, **guard) -> None:
    """Rewrite the daemon's config file with ``guard`` keys changed and wait for the reload."""
    import yaml
    d.cfg["guard"].update(guard)
    d.path.write_text(yaml.safe_dump(d.cfg, sort_keys=False))
    mark = d.mark()
    d.proc.send_signal(signal.SIGHUP)
    d.wait_line(r"reloaded ", timeout=20, start=mark)


def test_the_guard_signals_an_adopted_engine_and_the_incident_says_adopted(daemons):
    """The guard's target is the adopted run: a line placed above MemAvailable (no memory is
    allocated) makes the guard SIGTERM it; the incident's engine part says ``adopted``; once the
    line is back below, the incident closes and the engine is restarted (reason ``guard``)."""
    model, port = unique(), free_port()
    a, pid = ready_then_killed(daemons, model, port)
    b = daemons("b", model, port)
    adopted_status(b)
    mark = b.mark()
    reload_with(b, term_below=line_above_available(), grace="5s")
    b.wait_line(r"the memory guard sent SIGTERM to pid %d " % pid, timeout=20, start=mark)
    assert wait_gone([pid], 15) == [], b.output()
    reload_with(b, term_below="128MiB")
    inc = b.incident("memory", start=mark, timeout=30)
    assert inc["engine"]["pid"] == pid and inc["engine"].get("adopted") is True, inc["engine"]
    assert [e["event"] for e in inc["timeline"]][:2] == ["crossed", "sigterm"], inc["timeline"]
    st = b.wait_ready(after=1, timeout=40)
    assert st["pid"] != pid and st["restarts"]["guard"] == 1 and st["adopted"] is False, st


def test_an_engine_inside_the_guards_escalation_is_stopped_not_handed_over(daemons, tmp_path):
    """SIGUSR2 (exit keeping the engine) while the guard is in its grace on the engine (an engine
    that ignores SIGTERM): the daemon finishes the escalation (SIGKILL) instead of leaving the
    engine to a next daemon with its SIGKILL lost."""
    model, port = unique(), free_port()
    a = daemons("a", model, port, "--mode", "ignore-term")
    pid = a.wait_ready()["pid"]
    mark = a.mark()
    reload_with(a, term_below=line_above_available(), grace="4s")
    a.wait_line(r"the memory guard sent SIGTERM to pid %d " % pid, timeout=20, start=mark)
    a.proc.send_signal(signal.SIGUSR2)
    assert a.proc.wait(40) == 0, a.output()
    assert wait_gone(list(a.engine_pids) or [pid], 15) == [], a.output()
    assert "not handing pid %d over" % pid in a.output(), a.output()
    assert not (tmp_path / "engine-handover.json").exists()


# ---- the decisions, on real processes and files (no daemon) ------------------------------------

def _ecfg(**kw):
    from sparkguard import config
    return config.EngineConfig(command=("x",), **kw)


def test_decide_keep_or_stop_from_the_signal_and_systemds_job():
    from sparkguard.supervisor import handover
    assert handover.decide(_ecfg(), True)[0] is True                       # SIGUSR2
    assert handover.decide(_ecfg(), False, job="restart") == (
        True, "systemd is restarting the unit (engine.on_daemon_restart: keep)")
    assert handover.decide(_ecfg(on_daemon_restart="stop"), False, job="restart")[0] is False
    assert handover.decide(_ecfg(), False, job="stop")[0] is False
    assert handover.decide(_ecfg(on_daemon_stop="keep"), False, job="stop")[0] is True
    assert handover.decide(_ecfg(), False, job="start")[0] is False       # anything else: stop, as before


def test_the_new_keys_are_checked_with_file_key_and_value(tmp_path):
    from sparkguard import config
    p = tmp_path / "c.yaml"
    p.write_text("engine:\n  command: [x]\n  on_daemon_restart: maybe\n")
    with pytest.raises(config.ConfigError) as e:
        config.load(str(p))
    assert str(p) in str(e.value) and "engine.on_daemon_restart" in str(e.value) and "maybe" in str(e.value)


def test_check_refuses_other_boots_unusable_records_and_reused_pids():
    from sparkguard import sysinfo
    from sparkguard.supervisor import adopt
    me = proctree.read_proc(os.getpid())
    boot = sysinfo.boot_id()
    rec = {"pid": os.getpid(), "starttime": me.starttime, "digest": "d"}
    assert adopt.check({}, boot, "d").result == ""
    assert adopt.check({"boot_id": boot, "engine": {"pid": "x"}}, boot, "d").result == adopt.REFUSED
    assert adopt.check({"boot_id": boot, "engine": ["no"]}, boot, "d").result == adopt.REFUSED
    v = adopt.check({"boot_id": "0" * 32, "engine": rec}, boot, "d")
    assert v.result == adopt.REFUSED and "another boot" in v.why
    v = adopt.check({"boot_id": boot, "engine": dict(rec, starttime=me.starttime + 7)}, boot, "d")
    assert v.result == adopt.REFUSED and "another process has that pid" in v.why
    v = adopt.check({"boot_id": boot, "engine": dict(rec, cgroup="/nonexistent/engine-1")}, boot, "d")
    assert v.result == adopt.REFUSED and "not accepted" in v.why
    v = adopt.check({"boot_id": boot, "engine": rec}, boot, "other")
    assert v.result == adopt.CHANGED and v.pidfd is not None
    os.close(v.pidfd)
    v = adopt.check({"boot_id": boot, "engine": rec}, boot, "d")
    assert v.result == adopt.ADOPTED and v.pidfd is not None
    os.close(v.pidfd)


def test_the_adopted_exit_watch_takes_a_pidfd_above_1023_and_waits_for_the_real_exit():
    """A daemon with many fds open: the pidfd is >= 1024 (select() refuses those).  The watch
    must not report the live engine's exit; it reports it once the process is gone."""
    import resource
    import subprocess
    from sparkguard.supervisor import adopt
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 2048:
        pytest.skip(f"RLIMIT_NOFILE hard limit {hard} < 2048")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 2048), hard))
    p = subprocess.Popen(["sleep", "60"])
    try:
        fd = os.pidfd_open(p.pid)
        high = os.dup2(fd, 1500)
        os.close(fd)
        done = threading.Event()
        t = threading.Thread(target=lambda: (adopt.wait_exit(high, p.pid, proctree.read_proc(p.pid).starttime),
                                             done.set()), daemon=True)
        t.start()
        assert not done.wait(0.5), "an exit was reported for a live process"
        p.kill()
        assert done.wait(5), "the exit was not seen"
    finally:
        p.kill()
        p.wait()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_crafted_state_file_cannot_widen_the_kill_set(tmp_path):
    """The state file is untrusted: a recorded cgroup that is not ``engine-<run id>`` directly
    below the engines' parent is refused (here: the parent itself, which "contains" the test
    process; a sibling with another run id; a symlink into the parent); the pgid is the verified
    root's, whatever the file says; a container record that does not verify is not taken, and
    one with a non-integer pid raises nothing."""
    from sparkguard import sysinfo
    from sparkguard.supervisor import adopt
    me = proctree.read_proc(os.getpid())
    boot = sysinfo.boot_id()
    parent = tmp_path / "unit.service"
    (parent / "engine-1000.000").mkdir(parents=True)
    (parent / "engine-2000.000").mkdir()
    os.symlink(parent, tmp_path / "engine-1000.000")
    rec = {"pid": os.getpid(), "starttime": me.starttime, "digest": "d", "wall_spawn": 1000.0, "pgid": 1}
    for bad in (str(parent), str(parent / "engine-2000.000"), str(tmp_path / "engine-1000.000"), "/sys/fs/cgroup"):
        v = adopt.check({"boot_id": boot, "engine": dict(rec, cgroup=bad)}, boot, "d", parent=str(parent))
        assert v.result == adopt.REFUSED and "not accepted" in v.why, (bad, v)
    v = adopt.check({"boot_id": boot, "engine": dict(rec, cgroup=str(parent / "engine-1000.000"))}, boot, "d")
    assert v.result == adopt.REFUSED, "a recorded cgroup with no engines' parent (process-group mode)"
    v = adopt.check({"boot_id": boot, "engine": rec}, boot, "d", parent=str(parent))
    assert v.result == adopt.ADOPTED and v.record.pgid == os.getpgrp() != 1, v
    os.close(v.pidfd)
    for c in ({"id": "f" * 64, "pid": os.getpid(), "starttime": me.starttime, "cgroup": "/sys/fs/cgroup"},
              {"id": "f" * 64, "pid": "not a pid", "starttime": "x"}, {"pid": [1]}):
        run = _rebuilt(tmp_path, container=c, launch={"runtime": "docker", "cidfile": str(tmp_path / "cid")})
        assert run.container is None, c
    # the launch: the runtime CLI is the configured command's (it is executed), the cidfile only
    # one of sparkguard's container run directory
    state_file = str(tmp_path / "engine-state.json")
    rundir = os.path.join(str(tmp_path), "containers")
    argv = ["/usr/bin/docker", "run", "img", "vllm", "serve", "m"]
    ln, why = adopt.launch_of({"runtime": "/tmp/evil", "cidfile": f"{rundir}/engine-0123.cid"}, argv, state_file, {})
    assert ln is not None and ln.runtime == "/usr/bin/docker" and ln.cidfile == f"{rundir}/engine-0123.cid", why
    for cidfile in ("/etc/passwd", f"{rundir}/../engine-0123.cid", f"{rundir}/x.cid"):
        assert adopt.launch_of({"cidfile": cidfile}, argv, state_file, {})[0] is None, cidfile
    assert adopt.launch_of({"cidfile": f"{rundir}/engine-0123.cid"}, ["x"], state_file, {})[0] is None


def test_no_handover_of_a_run_without_fifos_or_one_the_guard_is_stopping(tmp_path):
    """``_may_hand_over``: a run whose output is plain pipes (no FIFOs: its writes would fail
    once the daemon is gone) or that the guard has signalled is not left to a next daemon."""
    import types
    from sparkguard.supervisor.adoptrun import Adoption
    run = _rebuilt(tmp_path)
    notes = []
    host = types.SimpleNamespace(run=run, _history=lambda ev, d: notes.append(d))
    run.fifos = {"stdout": "/run/x.stdout", "stderr": "/run/x.stderr"}
    assert Adoption._may_hand_over(host) is True
    run.guard_hit = True
    assert Adoption._may_hand_over(host) is False and "memory guard" in notes[-1]
    run.guard_hit, run.fifos = False, {}
    assert Adoption._may_hand_over(host) is False and "plain pipes" in notes[-1]


def test_an_engine_pipe_that_is_not_the_recorded_fifo_is_still_drained(tmp_path):
    """An engine whose stdout is a pipe that does not match the record (here an anonymous
    pipe, no identity recorded) is read through /proc/PID/fd/1 anyway: it writes 2 MiB (more
    than any pipe buffer) and exits instead of blocking on a pipe nobody reads."""
    import subprocess
    import sys
    from sparkguard.supervisor import output
    r, w = os.pipe()
    script = "import sys\nfor i in range(2048):\n    sys.stdout.write('x' * 1023 + '\\n')\nsys.stdout.flush()\n"
    p = subprocess.Popen([sys.executable, "-c", script], stdout=w, stderr=subprocess.DEVNULL)
    os.close(w)
    try:
        again, why = output.reopen_fifos(p.pid, {}, {})
        assert "stdout" in again and "anyway" in why, why
        lines = []
        output.pump(again["stdout"], None, lambda s, raw: lines.append(raw))
        assert p.wait(20) == 0 and lines, "the writer blocked"       # (the pump passes 1,000 lines/s on)
    finally:
        os.close(r)
        p.kill()
        p.wait()


def test_the_sweep_after_an_adopted_root_takes_its_group_only_while_a_recorded_member_is_in_it(tmp_path):
    """A process group whose recorded members are gone may belong to a stranger now (an adopted
    root is reaped at once): not swept by group; with a live recorded member in it, it is."""
    import subprocess
    from sparkguard.supervisor.adoptrun import Adoption
    stranger = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        run = _rebuilt(tmp_path)
        run.pgid = stranger.pid
        run.members = {run.pid: run.starttime, 999999: 1}
        assert Adoption._group_ok(run) is False
        deadline = time.monotonic() + 5
        while (p := proctree.read_proc(stranger.pid)) is None or p.comm != "sleep":
            assert time.monotonic() < deadline
            time.sleep(0.02)
        run.members[stranger.pid] = p.starttime
        assert Adoption._group_ok(run) is True
        run.adopted = False
        run.members = {}
        assert Adoption._group_ok(run) is True, "a run this daemon started: its pgid stays reserved"
    finally:
        stranger.kill()
        stranger.wait()


def test_fifo_output_survives_its_reader_and_is_reopened_through_proc(tmp_path):
    """The writer holds the FIFO read-write: with no reader left its writes still succeed (no
    EPIPE), and a new reader opened through /proc/PID/fd/1 gets what was written meanwhile."""
    import subprocess
    import sys
    from sparkguard.supervisor import output
    paths, child, readers = output.make_fifos(str(tmp_path), "1")
    script = "import sys, time\nfor i in range(40):\n    print('line', i, flush=True); time.sleep(0.05)\n"
    p = subprocess.Popen([sys.executable, "-c", script], stdout=child["stdout"], stderr=child["stderr"])
    try:
        for fd in child.values():
            os.close(fd)
        ids = {k: output.fifo_identity(v.fileno()) for k, v in readers.items()}
        for r in readers.values():
            r.close()                          # the daemon is gone
        time.sleep(0.5)
        again, why = output.reopen_fifos(p.pid, {}, ids)
        assert why == "" and set(again) == {"stdout", "stderr"}
        lines = []
        output.pump(again["stdout"], again["stderr"], lambda s, raw: lines.append(raw))
        assert p.wait(10) == 0, "the writer must not die of EPIPE while no reader is open"
        assert lines == [b"line %d" % i for i in range(40)], lines
    finally:
        p.kill()
        p.wait()
        output.remove_fifos(paths)


class _Me:
    """The running test process stands for the kept engine (a live pid with its start time)."""
    pid = os.getpid()
    starttime = proctree.read_proc(os.getpid()).starttime
    cgroup = None


def test_stop_post_keeps_on_a_note_or_without_a_stop_job(tmp_path):
    from sparkguard.supervisor import handover
    unit = tmp_path / "x.service"
    unit.mkdir()
    note = str(tmp_path / "note.json")
    env = {"INVOCATION_ID": "a" * 32}
    assert handover.stop_post(note, "restart", "success", str(unit), env)[0] == []
    assert "left for the next daemon" in handover.stop_post(note, None, "signal", str(unit), env)[1]
    handover.write_note(note, _Me, "systemd is stopping the unit (engine.on_daemon_stop: keep)", env)
    assert json.loads(open(note).read())["kind"] == "stop"
    assert "kept pid" in handover.stop_post(note, "stop", "success", str(unit), env)[1]
    os.unlink(note)
    assert "the engine goes with the daemon" in handover.stop_post(note, "stop", "success", str(unit), env)[1]


def test_stop_post_ignores_a_note_of_another_invocation_or_of_a_restart(tmp_path):
    """A note left from a restart (written by an earlier invocation, or for a restart) must not
    keep the engine on a later `systemctl stop`: only this invocation's note of a stop does."""
    from sparkguard.supervisor import handover
    unit = tmp_path / "x.service"
    unit.mkdir()
    note = str(tmp_path / "note.json")
    old, now = {"INVOCATION_ID": "1" * 32}, {"INVOCATION_ID": "2" * 32}
    handover.write_note(note, _Me, "systemd is restarting the unit (engine.on_daemon_restart: keep)", old)
    assert "the engine goes with the daemon" in handover.stop_post(note, "stop", "exit-code", str(unit), now)[1]
    handover.write_note(note, _Me, "systemd is stopping the unit (engine.on_daemon_stop: keep)", old)
    assert "the engine goes with the daemon" in handover.stop_post(note, "stop", "success", str(unit), now)[1]
    handover.write_note(note, _Me, "systemd is restarting the unit (engine.on_daemon_restart: keep)", now)
    assert "the engine goes with the daemon" in handover.stop_post(note, "stop", "success", str(unit), now)[1]
    assert "the engine goes with the daemon" in handover.stop_post(note, "stop", "success", str(unit), {})[1]


def test_stop_post_treats_an_unreadable_job_as_a_stop_unless_the_daemon_crashed(tmp_path):
    from sparkguard.supervisor import handover
    unit = tmp_path / "x.service"
    unit.mkdir()
    note = str(tmp_path / "note.json")
    for result in ("success", "exit-code", "timeout"):
        assert "the engine goes with the daemon" in handover.stop_post(note, handover.JOB_UNKNOWN, result,
                                                                       str(unit), {})[1], result
    for result in handover.CRASH_RESULTS:
        assert "left for the next daemon" in handover.stop_post(note, handover.JOB_UNKNOWN, result, str(unit), {})[1]
    assert handover.decide(_ecfg(), False, job=handover.JOB_UNKNOWN)[0] is False


@pytest.mark.parametrize("grace,max_grace", [("1s", None), ("30s", 1.0)])
def test_stop_post_stops_the_recorded_engine_with_the_configs_grace_and_protect(tmp_path, grace, max_grace):
    """Process-group mode (no engine cgroup): stop-post on a stop job stops the processes the
    state file records (same start time only), SIGKILL after ``guard.grace`` (not a fixed 5 s;
    or a longer one cut to the 1 s the unit's stop timeout leaves), and never SIGKILLs a
    ``targets.protect`` match."""
    import subprocess
    from sparkguard import config, sysinfo
    from sparkguard.supervisor import handover
    unit = tmp_path / "x.service"
    unit.mkdir()
    import shutil
    keep = tmp_path / "sgkeep"                 # a protected program: targets.protect matches its name
    shutil.copy("/bin/sleep", keep)
    stubborn = subprocess.Popen(["sh", "-c", "trap '' TERM; exec sleep 60"])
    held = subprocess.Popen(["sh", "-c", f"trap '' TERM; exec {keep} 60"])
    try:
        wait_until_proc = time.monotonic() + 5
        while time.monotonic() < wait_until_proc and not all(
                proctree.read_proc(p.pid) and "sh" not in proctree.read_proc(p.pid).comm for p in (stubborn, held)):
            time.sleep(0.02)
        st = {p.pid: proctree.read_proc(p.pid).starttime for p in (stubborn, held)}
        state = tmp_path / "state.json"
        state.write_text(json.dumps({"boot_id": sysinfo.boot_id(), "engine": {
            "pid": stubborn.pid, "starttime": st[stubborn.pid], "members": {str(k): v for k, v in st.items()}}}))
        cfg = config.from_dict({"guard": {"grace": grace}, "targets": {"protect": ["sgkeep"]},
                                "engine": {"command": ["x"], "state_file": str(state)}})
        out = []
        t0 = time.monotonic()
        t = threading.Thread(target=lambda: out.append(handover.stop_post(str(tmp_path / "note.json"), "stop",
                                                                          "success", str(unit), {}, cfg,
                                                                          max_grace=max_grace)))
        t.start()
        assert stubborn.wait(5) == -signal.SIGKILL
        took = time.monotonic() - t0
        t.join(20)         # the sweep waits a while for the protected process it did not SIGKILL
        [(stopped, why)] = out
        assert "the engine goes with the daemon" in why and stopped, (stopped, why)
        assert 0.9 <= took < 4.5, f"SIGKILL after {took:.2f} s, not after 1 s"
        assert held.poll() is None, "a targets.protect match was SIGKILLed"
    finally:
        for p in (stubborn, held):
            p.kill()
            p.wait()


def test_unit_job_tells_a_failed_lookup_from_no_job(tmp_path, monkeypatch):
    """A ``systemctl`` that fails (here: a script that exits 1, as systemctl does without a
    reachable systemd) is not "no job"."""
    from sparkguard.supervisor import handover
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "systemctl").write_text("#!/bin/sh\necho 'Failed to connect to bus' >&2\nexit 1\n")
    (bin_ / "systemctl").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_}:{os.environ['PATH']}")
    assert handover.unit_job("sparkguard.service") == handover.JOB_UNKNOWN
    (bin_ / "systemctl").write_text("#!/bin/sh\nexit 0\n")
    assert handover.unit_job("sparkguard.service") is None


def test_populated_engine_cgroups_of_an_inactive_unit_are_flagged(tmp_path):
    """What `engine status` warns about when no daemon answers: the unit's engine-* cgroups that
    still hold processes (read from cgroup.events, cgroup-v2.rst: "populated")."""
    from sparkguard.supervisor import handover
    unit = tmp_path / "sparkguard.service"
    for name, populated in (("engine-1.000", 1), ("engine-2.000", 0), ("guard", 1)):
        (unit / name).mkdir(parents=True)
        (unit / name / "cgroup.events").write_text(f"populated {populated}\nfrozen 0\n")
    assert handover.unguarded_engines(str(unit)) == [str(unit / "engine-1.000")]
    assert handover.unguarded_engines(str(tmp_path / "absent")) == []


def test_stop_post_reads_the_units_stop_timeout_which_bounds_its_grace(tmp_path, monkeypatch):
    """``systemctl show -p TimeoutStopUSec --value`` prints a systemd time span; stop-post's
    grace must end inside it (systemd SIGKILLs an ExecStopPost that outlives it)."""
    from sparkguard.supervisor import handover
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    monkeypatch.setenv("PATH", f"{bin_}:{os.environ['PATH']}")
    for printed, seconds in (("1min 30s", 90.0), ("8s", 8.0), ("infinity", None), ("", None)):
        (bin_ / "systemctl").write_text(f"#!/bin/sh\necho '{printed}'\n")
        (bin_ / "systemctl").chmod(0o755)
        assert handover.stop_timeout("sparkguard.service") == seconds, printed


def _stop_post_line(note: str, python: str) -> str:
    """The unit's ExecStopPost shell command as systemd runs it ("$$" -> "$", %n -> the unit's
    name, systemd.service(5)), with the note's path and the interpreter replaced."""
    from conftest import ROOT
    unit = open(os.path.join(ROOT, "systemd", "sparkguard.service")).read()
    [line] = [ln for ln in unit.splitlines() if ln.startswith("ExecStopPost=")]
    cmd = line.split("-c '", 1)[1].rsplit("'", 1)[0]
    return (cmd.replace("$$", "$").replace("%n", "sparkguard.service")
            .replace("/run/sparkguard/engine-handover.json", note).replace("@PYTHON@", python))


@pytest.mark.parametrize("writer,job,skips", [("this", "restart", True), ("this", "stop", False),
                                              ("other", "restart", False), (None, "restart", False),
                                              ("this", None, False)])
def test_the_units_stop_post_shortcut_skips_only_this_invocations_restart(tmp_path, writer, job, skips):
    """The shell shortcut in the shipped unit, run by /bin/sh: it skips `sparkguard stop-post`
    only when this invocation wrote the note and systemd's job is a restart (``systemctl`` is a
    script printing that job, as systemctl(1)'s list-jobs prints it)."""
    import subprocess
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    out = f"42 sparkguard.service {job} running" if job else ""
    (bin_ / "systemctl").write_text(f"#!/bin/sh\necho '{out}'\n")
    (bin_ / "systemctl").chmod(0o755)
    (bin_ / "py").write_text("#!/bin/sh\necho RAN \"$@\"\n")
    (bin_ / "py").chmod(0o755)
    note = str(tmp_path / "engine-handover.json")
    me, other = "c" * 32, "d" * 32
    if writer:
        handover_write = {"this": me, "other": other}[writer]
        from sparkguard.supervisor import handover
        handover.write_note(note, _Me, "systemd is restarting the unit (engine.on_daemon_restart: keep)",
                            {"INVOCATION_ID": handover_write})
    r = subprocess.run(["/bin/sh", "-c", _stop_post_line(note, str(bin_ / "py"))], capture_output=True, text=True,
                       timeout=10, env={"PATH": f"{bin_}:/usr/bin:/bin", "INVOCATION_ID": me})
    assert ("RAN -m sparkguard stop-post" not in r.stdout) == skips, (r.stdout, r.stderr)


def test_a_daemon_removes_the_handover_note_first_even_when_its_config_is_rejected(tmp_path):
    """A note must not outlive the start after it: a daemon whose config is refused (exit 2)
    has removed it already."""
    import subprocess
    import sys
    from conftest import sg_env
    from sparkguard.supervisor import handover
    note = tmp_path / "engine-handover.json"
    handover.write_note(str(note), _Me, "systemd is restarting the unit (engine.on_daemon_restart: keep)")
    bad = tmp_path / "bad.yaml"
    bad.write_text("guard:\n  grace: forever\n")
    r = subprocess.run([sys.executable, "-m", "sparkguard", "run", "--config", str(bad)], capture_output=True,
                       text=True, timeout=60, env=dict(sg_env(), RUNTIME_DIRECTORY=str(tmp_path)))
    assert r.returncode == 2, r.stderr
    assert not note.exists(), "the note outlived a rejected start"


def _rebuilt(tmp_path, **rec):
    """``Adoption._rebuild`` of a verified record of this test process (no daemon: the parts of
    the Supervisor it reads), its pidfd closed; returns the Run."""
    import types
    from sparkguard import config
    from sparkguard.supervisor import adopt
    from sparkguard.supervisor.adoptrun import Adoption
    me = proctree.read_proc(os.getpid())
    record = dict({"pid": os.getpid(), "starttime": me.starttime, "digest": "d", "wall_spawn": time.time() - 3600},
                  **rec)
    r, bad = adopt.record_of({"engine": record})
    assert r is not None, bad
    host = types.SimpleNamespace(ecfg=config.EngineConfig(command=("x",), control_socket=str(tmp_path / "c.sock")),
                                 placement=None)
    run = Adoption._rebuild(host, adopt.Verdict(adopt.ADOPTED, "", None, r), ["x"], {}, output_too=False)
    return run


class _Hooks:
    """health.MonitorHooks that record what the monitor said (the supervisor's side is not
    under test here)."""

    def __init__(self):
        self.verdicts, self.ready = [], 0

    def refresh_members(self, run):
        pass

    def became_ready(self, run):
        self.ready += 1
        run.ever_ready = True

    def health_changed(self, run, ok, url):
        pass

    def probed(self, run, ok):
        return 0

    def verdict(self, run, kind, detail):
        self.verdicts.append(kind)

    def cluster(self, run):
        return False

    def note(self, event, detail):
        pass


@pytest.mark.parametrize("ready,verdicts", [(True, []), (False, ["not_ready"])])
def test_an_adopted_ready_engine_is_not_restarted_on_its_first_failed_health_check(tmp_path, ready, verdicts):
    """An engine recorded ready, started an hour ago (ready_timeout 1200 s): a /health that does
    not answer (a closed port) at adoption is no not_ready verdict; one recorded still loading
    after an hour is (its clock is its start's)."""
    from sparkguard import config
    from sparkguard.supervisor import health
    run = _rebuilt(tmp_path, ready=ready)
    url = f"http://127.0.0.1:{free_port()}/health"
    ecfg = config.EngineConfig(command=("x",), health_url=url, health_interval=0.05)
    hooks = _Hooks()
    t = threading.Thread(target=health.monitor, args=(run, lambda: ecfg, hooks), daemon=True)
    t.start()
    t.join(1.0)
    run.done.set()
    t.join(5)
    assert hooks.verdicts == verdicts and hooks.ready == 0


def test_a_docker_run_engine_is_adopted_with_its_container(tmp_path, dockerd, monkeypatch):  # noqa: F811
    """``engine.command: [docker, run, ...]`` (real dockerd, tests/dockerd.py): the client and its
    container outlive the SIGKILLed daemon; the new one adopts the client, takes the container
    from the state file, and `engine stop` still stops and removes the container."""
    monkeypatch.setenv("DOCKER_HOST", dockerd.host)
    tag, port = unique_name(), free_port()
    argv = dockerd.fake_run(tag, "--hold", "8MiB", "--hold-core", "8MiB", "--hold-api", "8MiB", "--tp", "2",
                            "--port", str(port), run_opts=("--label", f"sgtest={tag}"))
    cfg = engine_config(tmp_path, tag, argv, port)
    made = []
    try:
        a = Daemon(tmp_path, cfg, name="a")
        made.append(a)
        a.wait_control()
        pid = a.wait_ready(timeout=60)["pid"]
        a.wait_line(r"container: container \w+", timeout=30)
        [cid] = dockerd.containers(f"label=sgtest={tag}")
        kill9(a)
        b = Daemon(tmp_path, cfg, name="b")
        made.append(b)
        b.wait_control()
        st = adopted_status(b, timeout=30)
        assert st["adoption"]["result"] == "adopted" and st["pid"] == pid, st["adoption"]
        state = json.loads((tmp_path / "engine-state.json").read_text())
        assert state["engine"]["container"]["id"] == cid, state["engine"]
        assert b.ctl("stop", sock_timeout=60)["ok"]
        deadline = time.monotonic() + 30
        while dockerd.containers(f"label=sgtest={tag}") and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not dockerd.containers(f"label=sgtest={tag}"), "the adopted engine's container was not removed"
    finally:
        for d in made:
            d.stop()
        ids = dockerd.containers(f"label=sgtest={tag}")
        if ids:
            dockerd.docker("rm", "-f", *ids, check=False)


def test_stop_post_stops_and_removes_the_recorded_container(tmp_path, dockerd, monkeypatch):  # noqa: F811
    """A docker run engine whose daemon died in a stop: its processes are in docker's cgroup, not
    the engine's, so stop-post takes the container from the state file (verified: its init's
    cgroup names the recorded id), stops its processes and removes it (real dockerd)."""
    import subprocess
    from sparkguard import config, sysinfo
    from sparkguard.supervisor import handover
    monkeypatch.setenv("DOCKER_HOST", dockerd.host)
    tag, port = unique_name(), free_port()
    argv = dockerd.fake_run(tag, "--port", str(port), run_opts=("--label", f"sgtest={tag}"))
    client = subprocess.Popen(["sleep", "60"])          # stands for the dead daemon's docker client
    try:
        cid = dockerd.docker(*argv[1:2], "-d", *argv[2:]).stdout.strip()
        init = int(dockerd.docker("inspect", "-f", "{{.State.Pid}}", cid).stdout.strip())
        deadline = time.monotonic() + 5
        while (c := proctree.read_proc(client.pid)) is None or c.comm != "sleep":
            assert time.monotonic() < deadline
            time.sleep(0.02)
        state = tmp_path / "state.json"
        state.write_text(json.dumps({"boot_id": sysinfo.boot_id(), "engine": {
            "pid": client.pid, "starttime": c.starttime,
            "container": {"id": cid, "name": "", "pid": init, "starttime": proctree.read_proc(init).starttime},
            "launch": {"runtime": "/tmp/not-run", "cidfile": str(tmp_path / "containers" / "engine-0123.cid")}}}))
        cfg = config.from_dict({"guard": {"grace": "5s"}, "engine": {"command": argv, "state_file": str(state)}})
        unit = tmp_path / "x.service"
        unit.mkdir()
        stopped, why = handover.stop_post(str(tmp_path / "note.json"), "stop", "success", str(unit), {}, cfg)
        assert any(s.startswith(f"container {cid[:12]}") for s in stopped), (stopped, why)
        assert not dockerd.containers(f"label=sgtest={tag}"), "the recorded container still exists"
    finally:
        client.kill()
        client.wait()
        ids = dockerd.containers(f"label=sgtest={tag}")
        if ids:
            dockerd.docker("rm", "-f", *ids, check=False)


def test_a_rolling_restart_of_sparkguard_node_by_node_keeps_the_tp_group(tmp_path):
    """A 2-node TP cluster (network namespaces, tests/netcluster.py): each node's sparkguard in
    turn exits keeping its engine (SIGUSR2, as a restart under systemd does) and a new one adopts
    it, the headless rank first, then the head.  No engine restarts: every node keeps its run,
    the head's group still lists the rank's run, and the head serves completions after each step."""
    from netcluster import Cluster, SparkguardNode
    from test_cluster import completion_ok, one_generation, up, wait_until
    with Cluster(2) as c:
        ds = up(c, tmp_path)
        one_generation(ds)
        runs = [d.status()["run_start"] for d in ds]
        pids = [d.status()["pid"] for d in ds]
        for k in (1, 0):
            old = ds[k]
            old.proc.send_signal(signal.SIGUSR2)
            assert old.proc.wait(30) == 0, old.output()
            new = SparkguardNode(c.nodes[k], old.cfg, old.tmp_path, name=f"again{k}")
            new.engine_pids.update(old.engine_pids)
            new.wait_control(60)
            st = adopted_status(new, timeout=60)
            assert st["adoption"]["result"] == "adopted" and st["pid"] == pids[k], st["adoption"]
            ds[k] = new
            wait_until(lambda: all(d.status()["state"] == "ready" for d in ds), 30, "every rank ready")
            assert completion_ok(c.hub, c.nodes[0].addr, c.model, timeout=5), f"node {k}: the head does not serve"
        one_generation(ds)
        assert [d.status()["run_start"] for d in ds] == runs, "an engine was restarted"
        assert all(sum(d.status()["restarts"].values()) == 0 for d in ds), [d.status()["restarts"] for d in ds]


def test_the_note_is_in_the_units_runtime_directory_whatever_the_control_socket():
    from sparkguard.supervisor import handover
    e = _ecfg(control_socket="/srv/sg/control.sock")
    assert handover.note_path(e, {"RUNTIME_DIRECTORY": "/run/sparkguard:/run/other"}) == \
        "/run/sparkguard/engine-handover.json"
    assert handover.note_path(e, {}) == "/srv/sg/engine-handover.json"

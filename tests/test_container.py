"""A supervised engine that is a ``docker run``: real dockerd (tests/dockerd.py), the fake vLLM inside.

Every container a test makes carries a label of its own and is removed in its ``finally``; the
daemon under test is stopped with SIGTERM (``Daemon.stop``).  ``Daemon.cleanup`` is not used: the
fake's "ready pids=" line gives pids of the container's pid namespace, which name other processes
on the host.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from conftest import line_below_now, run_sparkguard
from dockerd import dockerd, unique_name  # noqa: F401 - the session fixture
from supervisor_helpers import Daemon, engine_config, free_port, wait_gone

from sparkguard import proctree, signals
from sparkguard.supervisor import container, container_argv, container_cgroup

MiB = 1024 ** 2
SMALL = ("--hold", "8MiB", "--hold-core", "8MiB", "--hold-api", "8MiB", "--tp", "2")


@pytest.fixture
def docker_env(dockerd, monkeypatch):  # noqa: F811
    """sparkguard (and every docker CLI it runs) talks to the tests' dockerd through DOCKER_HOST."""
    monkeypatch.setenv("DOCKER_HOST", dockerd.host)
    return dockerd


def _containers(d, tag: str) -> list[str]:
    return d.containers(f"label=sgtest={tag}")


def _remove(d, tag: str) -> None:
    ids = _containers(d, tag)
    if ids:
        d.docker("rm", "-f", *ids, check=False)


def _history(st: dict, event: str) -> list[str]:
    return [h["detail"] for h in st["history"] if h["event"] == event]


def _container_found(sg, timeout: float = 60.0) -> tuple[list[str], dict]:
    """The status history's ``container`` entries, once there are any (bounded): the container is
    discovered by its own thread (``docker inspect``), which may finish after the engine is ready."""
    deadline = time.monotonic() + timeout
    while True:
        st = sg.status()
        found = _history(st, "container")
        if found or time.monotonic() > deadline:
            return found, st
        time.sleep(0.1)


def _inspect(d, ref: str) -> dict | None:
    r = d.docker("container", "inspect", ref, check=False)
    return json.loads(r.stdout)[0] if r.returncode == 0 else None


@contextlib.contextmanager
def supervised(d, tmp_path, tag: str, *opts: str, name: str | None = None, guard: dict | None = None,
               shape=None):
    """A ``sparkguard run`` supervising ``docker run ... fake vllm serve TAG OPTS`` (labelled
    ``sgtest=TAG``), ready: yields ``(daemon, status, container id, its init's host pid)``; the
    daemon is stopped and the test's containers removed afterwards.  ``shape``: a function that
    rewrites the command line (another spelling of it)."""
    port = free_port()
    argv = d.fake_run(tag, *SMALL, *opts, "--port", str(port), name=name, run_opts=("--label", f"sgtest={tag}"))
    argv = shape(argv) if shape is not None else argv
    cfg = engine_config(tmp_path, tag, argv, port)
    cfg["guard"].update(guard or {})
    sg = Daemon(tmp_path, cfg)
    try:
        sg.wait_control()
        st = sg.wait_ready(timeout=60)
        [cid] = _containers(d, tag)
        yield sg, st, cid, _inspect(d, cid)["State"]["Pid"]
    finally:
        sg.stop()
        _remove(d, tag)


def test_supervised_docker_run_becomes_ready_and_engine_stop_stops_the_container(tmp_path, docker_env):
    d, tag = docker_env, unique_name()
    with supervised(d, tmp_path, tag) as (sg, st, cid, init):
        info = _inspect(d, cid)
        assert info["State"]["Running"] and info["Name"].startswith("/sparkguard-engine-")
        found, st = _container_found(sg)
        assert found and cid[:12] in found[0] and f"init pid {init}" in found[0], st["history"]
        # status says what is tracked: the container's cgroup, found from docker's State.Pid
        tr = sg.status()["tracking"]
        assert tr["tracks"] == "container" and tr["container"]["id"] == cid and tr["container"]["pid"] == init, tr
        r = run_sparkguard("engine", "--socket", sg.socket, "status")
        line = next((ln for ln in r.stdout.splitlines() if "tracking:" in ln), "")
        assert f"tracking: container {cid[:12]}" in line and f"init pid {init}, from" in line, r.stdout
        assert "State.Pid); the client: cgroup" in line or "the client: process group" in line, line
        mark = sg.mark()
        r = run_sparkguard("engine", "--socket", sg.socket, "stop", "--timeout", "60")
        assert r.returncode == 0 and "engine: stopped" in r.stdout, (r.stdout, r.stderr)
        sg.wait_line(rf"SIGTERM pid {st['pid']} \(to its container's init, pid {init}\)", 5, start=mark)
        sg.wait_line(r"EngineCore received SIGTERM", 5, start=mark)     # the SIGTERM reached the engine inside
        assert wait_gone([init], 10) == []
        assert _containers(d, tag) == []
        st = sg.status()
        assert st["state"] == "stopped" and not _history(st, "sigkill"), st["history"]


def test_a_command_line_with_global_options_container_run_and_clusters_is_tracked_and_removed(
        tmp_path, dockerd, monkeypatch):  # noqa: F811
    # no DOCKER_HOST: -H alone picks the daemon, so sparkguard's own inspect and rm -f must carry it;
    # --rm=false: only sparkguard's rm -f removes the container
    monkeypatch.delenv("DOCKER_HOST", raising=False)
    d, tag = dockerd, unique_name()

    def shape(argv):
        i = argv.index(d.image)
        opts = [o for o in argv[2:i] if o != "--rm"]
        return [argv[0], "-H", d.host, "container", "run", "--rm=false", "-eSG_ARGV=1", "--detach=false", *opts,
                "--", *argv[i:]]
    with supervised(d, tmp_path, tag, shape=shape) as (sg, st, cid, init):
        assert "SG_ARGV=1" in _inspect(d, cid)["Config"]["Env"]
        found, st = _container_found(sg)
        assert found and cid[:12] in found[0] and f"init pid {init}" in found[0], st["history"]
        r = run_sparkguard("engine", "--socket", sg.socket, "stop", "--timeout", "60")
        assert r.returncode == 0 and "engine: stopped" in r.stdout, (r.stdout, r.stderr)
        assert wait_gone([init], 10) == []
        assert _containers(d, tag) == [], "sparkguard's rm -f did not reach the daemon -H names"
        assert "removed" in _history(sg.status(), "exit")[-1]


def test_killed_docker_client_its_container_is_stopped_and_removed_then_restarted(tmp_path, docker_env):
    d, tag = docker_env, unique_name()
    # the user's own --name: the dead client's container must be gone, or the restart's --name conflicts
    with supervised(d, tmp_path, tag, name=tag) as (sg, st, cid, init):
        fd = os.pidfd_open(st["pid"])           # the docker client
        try:
            signal.pidfd_send_signal(fd, signal.SIGKILL)
        finally:
            os.close(fd)
        assert wait_gone([init], 30) == [], "the container's engine outlived its client"
        st = sg.wait_ready(after=1, timeout=60)
        assert _inspect(d, cid) is None, "the dead client's container was not removed"
        [cid2] = _containers(d, tag)
        assert cid2 != cid and _inspect(d, cid2)["Name"] == f"/{tag}"
        ex = _history(st, "exit")[-1]
        assert "SIGKILL" in ex and f"container {cid[:12]}" in ex and "removed" in ex, ex
        init2 = _inspect(d, cid2)["State"]["Pid"]
        assert sg.stop() == 0                   # the daemon's own stop: the engine's container goes with it
        assert wait_gone([init2], 10) == [] and _containers(d, tag) == []


def test_guard_crossing_sigterms_the_engine_in_its_container(tmp_path, docker_env):
    d, tag = docker_env, unique_name()
    # the engine inside fills 640 MiB as soon as it is ready; the guard's line is 256 MiB below
    # MemAvailable now (a short window: other users of this machine move MemAvailable too)
    fill = ("--fill-size", "640MiB", "--fill-rate", "1GiB/s", "--fill-delay", "0.2")
    guard = {"term_below": line_below_now(256 * MiB), "grace": "10s", "recovery_wait": "2s"}
    with supervised(d, tmp_path, tag, *fill, guard=guard) as (sg, st, cid, init):
        mark = sg.mark()
        inc = sg.incident("memory", start=mark, timeout=60)
        assert [e for e in inc["timeline"] if e["event"] == "sigterm"], inc["timeline"]
        assert init in {row["pid"] for row in inc["target"]["tree"]}, inc["target"]   # the tree covers the container
        sg.wait_line(r"EngineCore received SIGTERM", 10, start=mark)
        assert wait_gone([init], 15) == []
        # the SIGTERM alone stopped it: the engine's clean exit, through the client.  (A SIGKILL may
        # still follow in the timeline when other users of this machine keep MemAvailable under the line.)
        sg.wait_line(r"engine: exit: pid \d+ exit code 0 ", 15, start=mark)
        assert inc["engine"]["container"]["id"] == cid, inc["engine"]
        assert any("fake-vllm: ready" in ln for ln in inc["engine"]["last_lines"]), inc["engine"]["last_lines"]


def _signal_tp0(init: int, sig: int) -> None:
    """Send ``sig`` to the worker titled ``VLLM::Worker_TP0`` under the container's init ``init``
    (host pids: the fake's own "ready pids=" are of the container's pid namespace).  The tree was
    started by this test; the signal goes through a pidfd opened before the title is re-read, so a
    reused pid is never signalled.  AssertionError when there is no such worker."""
    procs = proctree.scan()
    kids = proctree.children_map(procs)
    for pid in proctree.descendants([init], kids):
        p = procs.get(pid)
        if p is None or not p.cmdline.startswith("VLLM::Worker_TP0"):
            continue
        fd = os.pidfd_open(pid)
        try:
            again = proctree.read_proc(pid)
            if again is not None and again.starttime == p.starttime:
                signal.pidfd_send_signal(fd, sig)
                return
        finally:
            os.close(fd)
    raise AssertionError(f"no VLLM::Worker_TP0 under pid {init}")


@contextlib.contextmanager
def guarded_container(d, tmp_path, *opts: str, grace: str):
    """A fake vLLM in a container started by hand (``docker run``, labelled and named TAG) and a
    guard-only ``sparkguard run`` matching it, its line 256 MiB below MemAvailable once the engine
    serves; once the guard has armed the container's tree, TP0 is sent SIGUSR1 and fills 640 MiB.
    Yields ``(daemon, client, container id, init pid, tag)``.  Everything is stopped and removed
    afterwards.  (A fill on a timer raced the guard's start: on a loaded machine it was done before
    the line was read, and the guard never saw memory cross it.)"""
    tag = unique_name()
    fill = ("--fill-size", "640MiB", "--fill-rate", "1GiB/s", "--fill-on-signal", *opts)
    argv = d.fake_run(tag, *SMALL, *fill, name=tag, run_opts=("--label", f"sgtest={tag}"))
    engine = subprocess.Popen(argv, env=d.env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, errors="replace")
    sg = None
    try:
        seen = []
        for line in engine.stdout:              # bounded: the fake exits on its own after --ready-timeout
            seen.append(line)
            if "fake-vllm: serving" in line:
                break
        assert seen and "fake-vllm: serving" in seen[-1], "".join(seen)
        [cid] = _containers(d, tag)
        init = _inspect(d, cid)["State"]["Pid"]
        cfg = {"guard": {"term_below": line_below_now(256 * MiB), "grace": grace, "recovery_wait": "2s"},
               "targets": {"match": [re.escape(tag)]}, "metrics": {"listen": "off"},
               "incidents": {"dir": str(tmp_path / "incidents"), "journal": "off"}}
        sg = Daemon(tmp_path, cfg)
        sg.wait_line(rf"targets now: .*\[container {cid[:12]}.*, armed", 20)
        _signal_tp0(init, signal.SIGUSR1)
        yield sg, engine, cid, init, tag
    finally:
        if sg is not None:
            sg.stop()
        _remove(d, tag)
        engine.wait(30)
        engine.stdout.close()


def test_guard_only_mode_signals_an_engine_in_a_container_and_the_incident_names_it(tmp_path, docker_env):
    d = docker_env
    with guarded_container(d, tmp_path, grace="10s") as (sg, engine, cid, init, tag):
        inc = sg.incident("memory", timeout=60)
        term = [e for e in inc["timeline"] if e["event"] == "sigterm"]
        assert term and term[0]["pids"] == [init], inc["timeline"]
        assert f"[container {cid[:12]} ({tag})]" in inc["target"]["title"], inc["target"]
        assert engine.wait(30) == 0              # the engine shut down on the guard's SIGTERM
        assert _containers(d, tag) == []


def test_guard_only_sigkill_of_an_engine_in_a_container_is_its_cgroups(tmp_path, docker_env):
    # every process of the engine ignores SIGTERM: after the grace the guard SIGKILLs the
    # container's cgroup whole (cgroup.kill, guard/cgkill.py), and the container is gone
    d = docker_env
    with guarded_container(d, tmp_path, "--mode", "ignore-term", grace="2s") as (sg, engine, cid, init, tag):
        cg = container_cgroup.cgroup_dir(init) or "/nonexistent"
        how = next((f for f in ("cgroup.kill", "cgroup.freeze") if os.path.isfile(os.path.join(cg, f))), None)
        how = {"cgroup.freeze": "freeze"}.get(how, how)      # None: a cgroup v1 directory, pidfds only
        inc = sg.incident("memory", timeout=60)
        kill = [e for e in inc["timeline"] if e["event"] == "sigkill"]
        assert kill and init in kill[0]["pids"], inc["timeline"]
        assert how is None or f"(through {how})" in kill[0]["detail"], kill[0]
        assert wait_gone([init], 15) == []
        assert engine.wait(30) != 0              # the client saw its container SIGKILLed
        assert _containers(d, tag) == []


@pytest.mark.parametrize("policy,status", [("unless-stopped", "WARN"), ("no", "PASS")])
def test_doctor_warns_of_a_restart_policy_that_restarts_the_engine_behind_the_guard(tmp_path, docker_env, policy,
                                                                                    status):
    d = docker_env
    tag = unique_name()
    argv = d.fake_run(tag, *SMALL, name=tag, run_opts=("--label", f"sgtest={tag}", "-d", "--restart", policy))
    argv.remove("--rm")                          # docker refuses --rm with a restart policy
    try:
        cid = d.docker(*argv[1:]).stdout.strip()
        init = _inspect(d, cid)["State"]["Pid"]
        cfg = tmp_path / "sparkguard.yaml"
        cfg.write_text(f"targets:\n  match: ['{re.escape(tag)}']\n")
        r = run_sparkguard("doctor", "--json", "--config", str(cfg))
        assert r.returncode in (0, 1), r.stderr
        [c] = [c for c in json.loads(r.stdout)["checks"] if c["name"] == "engine_restart_policy"]
        assert c["status"] == status, c
        assert c["data"]["containers"] == [{"pid": init, "runtime": "docker", "id": cid, "name": tag,
                                            "restart": policy}], c
        if status == "WARN":
            assert f"--restart {policy}" in c["message"] and f"docker update --restart no {tag}" in c["fix"], c
    finally:
        _remove(d, tag)


def test_a_stopped_container_left_with_the_engines_name_is_removed_before_the_start(tmp_path, docker_env):
    d, tag = docker_env, unique_name()
    stale = d.docker("create", "--name", tag, "--label", f"sgtest={tag}", d.image, "true").stdout.strip()
    with supervised(d, tmp_path, tag, name=tag) as (sg, st, cid, init):
        sg.wait_line(rf"removed the stopped container {tag} \({stale[:12]}\)", 1)
        assert cid != stale and _inspect(d, stale) is None


# ---- the command line, without Docker ----------------------------------------------------------

RECIPE = ["docker", "run", "--gpus", "all", "--network", "host", "--ipc", "host", "--shm-size", "16g",
          "-v", "/models:/models", "-e", "NCCL_SOCKET_IFNAME=enp1s0f0np0", "-t", "--rm",
          "vllm/vllm-openai:latest", "vllm", "serve", "/models/GLM", "--tensor-parallel-size", "2"]


def test_prepare_adds_cidfile_name_and_the_shutdown_timeout_after_run(tmp_path):
    argv, launch = container.prepare(RECIPE, {"DOCKER_HOST": "unix:///x.sock"}, str(tmp_path / "c"), 8)
    assert argv[:2] == ["docker", "run"] and argv[-len(RECIPE) + 2:] == RECIPE[2:]
    added = argv[2:len(argv) - len(RECIPE) + 2]
    assert added[:2] == ["--cidfile", launch.cidfile] and launch.cidfile.startswith(str(tmp_path / "c") + "/")
    assert added[2:4] == ["--name", launch.name] and launch.name.startswith("sparkguard-engine-")
    assert added[4:] == ["-e", "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS=8"]     # RECIPE has its own --rm
    assert launch.env["DOCKER_HOST"] == "unix:///x.sock" and launch.user_name is None
    assert container_argv.inner(RECIPE) == ["vllm", "serve", "/models/GLM", "--tensor-parallel-size", "2"]


@pytest.mark.parametrize("opts,user_name,shutdown_env", [
    (["--name", "glm"], "glm", True), (["--name=glm"], "glm", True),
    (["-e", "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS=3"], None, False),
])
def test_prepare_keeps_what_the_user_gave(tmp_path, opts, user_name, shutdown_env):
    cmd = RECIPE[:2] + opts + RECIPE[2:]
    argv, launch = container.prepare(cmd, {}, str(tmp_path), 8)
    assert launch.user_name == user_name and (launch.name is None) == (user_name is not None)
    assert argv.count("--name") + sum(a.startswith("--name=") for a in argv) == 1
    assert ("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS=8" in argv) == shutdown_env
    assert argv.count("--rm") == 1


def test_prepare_adds_rm_unless_given(tmp_path):
    cmd = [a for a in RECIPE if a != "--rm"]
    argv, _ = container.prepare(cmd, {}, str(tmp_path), 8)
    assert argv.count("--rm") == 1 and argv.index("--rm") < argv.index("vllm/vllm-openai:latest")


@pytest.mark.parametrize("bad,why", [(["-d"], "-d detaches"), (["-dit"], "-d detaches"), (["--detach"], "-d detaches"),
                                     (["--sig-proxy=false"], "--sig-proxy=false"), (["--cidfile", "/x"], "--cidfile"),
                                     (["--restart", "unless-stopped"], "--restart unless-stopped"),
                                     (["--restart=always"], "--restart always")])
def test_prepare_refuses_what_would_hide_the_engine(tmp_path, bad, why):
    with pytest.raises(ValueError, match=re.escape(why)):
        container.prepare(RECIPE[:2] + bad + RECIPE[2:], {}, str(tmp_path))


def test_not_a_container_command_is_left_alone(tmp_path):
    for argv in (["vllm", "serve", "m"], ["docker", "exec", "x", "vllm"], ["/usr/bin/python3", "docker", "run"]):
        assert container.prepare(argv, {}, str(tmp_path)) == (argv, None)
    assert container_argv.runtime_of(["/usr/bin/podman", "run", "img"]) == "/usr/bin/podman"


def test_a_tree_with_a_term_member_sigterms_it_and_not_the_root():
    # a supervised container engine: the root is the docker client, the SIGTERM goes to the container's init
    kids = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(2)]
    try:
        client, init = (k.pid for k in kids)
        st = {pid: proctree.read_proc(pid).starttime for pid in (client, init)}
        tree = signals.Tree([client, init], st, root=client, term=init)
        try:
            assert tree.term_root()
            assert kids[1].wait(10) == -signal.SIGTERM and kids[0].poll() is None
            assert tree.term_root() and kids[0].wait(10) == -signal.SIGTERM   # the term member gone: the root
        finally:
            tree.close()
    finally:
        for k in kids:
            k.kill()
            k.wait(10)


@pytest.mark.parametrize("line,found", [
    ("0::/system.slice/docker-{id}.scope", ("docker", "{id}")),          # cgroup v2, systemd driver (the Sparks)
    ("4:memory:/docker/{id}\n0::/docker/{id}", ("docker", "{id}")),    # v1 hybrid, cgroupfs driver (here)
    ("0::/machine.slice/libpod-{id}.scope/container", ("podman", "{id}")),
    ("0::/user.slice/user-1000.slice/session-2.scope", None),
    # pure v1, or a hybrid whose unified line is not the container's: the id on an earlier line
    ("12:pids:/docker/{id}\n4:memory:/docker/{id}\n0::/system.slice/containerd.service", ("docker", "{id}")),
])
def test_the_container_of_a_process_is_read_from_its_cgroup(tmp_path, line, found):
    cid = "0123456789abcdef" * 4
    (tmp_path / "42").mkdir()
    (tmp_path / "42" / "cgroup").write_text(line.format(id=cid) + "\n")
    want = None if found is None else (found[0], found[1].format(id=cid))
    assert container_cgroup.container_of(42, proc=str(tmp_path)) == want


def test_sparkguard_status_says_a_container_engine_is_tracked_by_its_containers_cgroup():
    from sparkguard import status_daemon
    by = {"sparkguard_engine_state": {"running": 1.0}, "sparkguard_engine_tracking_info": {"none": 1.0}}
    labels = {"delegation": "none", "mode": "cgroup", "tracks": "container"}
    e = status_daemon._engine_from_metrics({"sparkguard_engine_up": 1.0}, by, labels)
    assert e["tracking"] == "cgroup (its container's cgroup, from the runtime's State.Pid)"
    e = status_daemon._engine_from_metrics({"sparkguard_engine_up": 1.0}, by, dict(labels, tracks="engine"))
    assert e["tracking"] == "cgroup"
    # a daemon of before the labels: the mode is the only label
    old = {"sparkguard_engine_state": {"running": 1.0}, "sparkguard_engine_tracking_info": {"process-group": 1.0}}
    assert status_daemon._engine_from_metrics({"sparkguard_engine_up": 1.0}, old, {"mode": "process-group"})["tracking"] \
        == "process-group"

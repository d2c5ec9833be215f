"""Files a root daemon reads where another user can write (issue 32, class 4), tried as that user.

* The container-id folder of a ``docker run`` engine with ``engine.user``: the engine's user owns
  it and, as that user, puts a symlink to a root-only file, a symlink to /dev/zero, a FIFO or a
  huge file where the client writes the id.  A real ``sparkguard run`` (root) supervises a
  ``docker`` client (a script: the attack is the user's, not docker's) running as nobody; the
  daemon must ask for the container by its name, never put what the file holds on a command line
  or in its log, never hang on the file and never grow with it.
* The configuration and the cluster file: one another user can change (its owner, a folder above
  it open to all) is refused by ``sparkguard run``, ``check-config`` and ``doctor``, naming the
  file, owner, mode and the fix; a reload of one kept (written by nobody itself) keeps the running
  config.
* :func:`sparkguard.untrusted.read_file`, the one reader of the daemon's own files (state file,
  handover note, reload result, incidents), on files nobody made.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
import uuid

import pytest
import yaml

from conftest import run_sparkguard
from supervisor_helpers import Daemon, engine_config, unique
from test_config_daemon import Daemon as ConfigDaemon, _tail
from unprivileged import NOBODY

from sparkguard import untrusted

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"),
                                reason="needs root and setpriv (to act as another user)")


def as_nobody(*argv: str, **kw) -> subprocess.CompletedProcess:
    """Run ``argv`` as uid/gid 65534 (a real other user)."""
    return subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *argv],
                          capture_output=True, text=True, timeout=30, **kw)


@pytest.fixture
def shared():
    """A folder root owns, mode 0755 (nobody can reach what is in it), removed afterwards."""
    d = tempfile.mkdtemp(prefix="sg-c4-")
    os.chmod(d, 0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


# ---- the container-id file of an engine run as engine.user --------------------------------------

#: the ``docker`` client sparkguard starts: as the engine's user for ``run`` (it plants ATTACK where
#: the id belongs, then is the engine); as root for sparkguard's own calls (logged to CALLS)
DOCKER = """#!/bin/sh
if [ "$1" = run ]; then
  while [ $# -gt 0 ]; do case "$1" in --cidfile) cid="$2"; shift 2;; *) shift;; esac; done
  {attack}
  exec sleep 600
fi
echo "$*" >> {calls}
echo "Error: No such container: $3" >&2
exit 1
"""

ATTACKS = {
    "symlink to a root-only file": 'ln -s {secret} "$cid"',
    "symlink to /dev/zero": 'ln -s /dev/zero "$cid"',
    "FIFO": 'mkfifo "$cid"',
    "huge file": 'truncate -s 256M "$cid"',
}


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(ln.split()[1]) << 10 for ln in f if ln.startswith("VmRSS:"))


@pytest.mark.parametrize("attack", list(ATTACKS))
def test_the_engine_users_cidfile_is_never_followed_nor_read_without_bound(tmp_path, shared, attack):
    secret = os.path.join(shared, "root-only")
    token = "SECRET-" + uuid.uuid4().hex
    with open(secret, "w") as f:
        f.write(token + "\n")
    os.chmod(secret, 0o600)
    calls = os.path.join(shared, "calls.log")
    docker = os.path.join(shared, "docker")
    with open(docker, "w") as f:
        f.write(DOCKER.format(attack=ATTACKS[attack].format(secret=secret), calls=calls))
    os.chmod(docker, 0o755)
    model = unique("sgcid")
    cfg = engine_config(tmp_path, model, [docker, "run", "sgtest-image", "sleep", "600"], None,
                        user="nobody", cwd="/", state_file=os.path.join(shared, "engine-state.json"))
    d = Daemon(tmp_path, cfg)
    try:
        d.wait_control()
        rundir = os.path.join(shared, "containers")
        deadline = time.monotonic() + 30
        asked = ""
        while "container inspect sparkguard-engine-" not in asked:
            assert d.proc.poll() is None, d.output()
            rss = _rss(d.proc.pid)
            assert rss < 512 << 20, f"the daemon grew to {rss >> 20} MiB reading the cidfile ({attack})"
            assert time.monotonic() < deadline, (f"the daemon never asked for the container by its name "
                                                 f"({attack}); it asked: {asked!r}\n{d.output()}")
            time.sleep(0.1)     # the CLI's calls land in a file: nothing to wait on
            asked = open(calls).read() if os.path.exists(calls) else ""
        assert os.stat(rundir).st_uid == NOBODY          # the user's folder, the user's planted file
        assert token not in asked and token not in d.output()
        assert _rss(d.proc.pid) < 512 << 20
    finally:
        assert d.stop() == 0, d.output()
    assert token not in d.output() and "Traceback" not in d.output(), d.output()
    assert len(d.output()) < 200_000


def test_a_cidfile_that_is_a_symlink_in_place_of_the_folder_is_not_chowned(tmp_path, shared):
    """The cidfile folder is handed to the engine's user with fchown on the folder opened
    O_NOFOLLOW: a symlink put where it belongs is refused, and what it names keeps its owner."""
    target = os.path.join(shared, "roots")
    os.mkdir(target, 0o700)
    os.symlink(target, os.path.join(shared, "containers"))
    model = unique("sgcid")
    cfg = engine_config(tmp_path, model, [os.path.join(shared, "docker"), "run", "img", "sleep", "600"], None,
                        user="nobody", cwd="/", state_file=os.path.join(shared, "engine-state.json"))
    d = Daemon(tmp_path, cfg)
    try:
        d.wait_line(r"engine: cannot start .*(Too many levels of symbolic links|Not a directory)")
        assert os.stat(target).st_uid == 0
    finally:
        d.stop()


# ---- the configuration and the cluster file ----------------------------------------------------

def _config(dir_: str) -> str:
    path = os.path.join(dir_, "sg.yaml")
    with open(path, "w") as f:
        f.write("guard: {dry_run: true, term_below: 16MiB}\n" + _tail(dir_, f"^sg-c4-{uuid.uuid4().hex}$"))
    return path


WAYS = {
    "owned by nobody": lambda path: os.chown(path, NOBODY, NOBODY),
    "a folder open to all": lambda path: os.chmod(os.path.dirname(path), 0o777),
    "group-writable by nogroup": lambda path: (os.chown(path, 0, NOBODY), os.chmod(path, 0o664)),
}


@pytest.mark.parametrize("way", list(WAYS))
def test_a_config_another_user_can_change_is_refused_by_run_check_config_and_doctor(shared, way):
    path = _config(shared)
    assert run_sparkguard("check-config", path, timeout=30).returncode == 0
    WAYS[way](path)
    for args in (("run", "--config", path), ("check-config", path), ("doctor", "--config", path)):
        r = run_sparkguard(*args, timeout=30)
        said = r.stdout + r.stderr
        assert r.returncode != 0 and "can be changed by a user other than root" in said, (args, said)
        assert ("chown root" in said if way == "owned by nobody" else "chmod go-w" in said), said
        assert ("owner nobody" in said if way == "owned by nobody" else "mode 0" in said), said


def test_a_cluster_file_another_user_can_change_is_refused(shared):
    cluster = os.path.join(shared, "cluster.yaml")
    with open(cluster, "w") as f:
        yaml.safe_dump({"name": "c4", "nodes": [{"name": "a", "addr": "127.0.0.1"}, {"name": "b", "addr": "127.0.0.2"}],
                        "engine": {"command": ["vllm", "serve", "/m", "--tensor-parallel-size", "2"]}}, f)
    path = _config(shared)
    with open(path, "a") as f:
        f.write(f"cluster: {{file: {cluster}, node: a}}\n")
    first = run_sparkguard("check-config", path, timeout=30)
    assert "can be changed" not in first.stdout + first.stderr
    os.chown(cluster, NOBODY, NOBODY)
    r = run_sparkguard("check-config", path, timeout=30)
    said = r.stdout + r.stderr
    assert r.returncode != 0 and f"the file {cluster} (owner nobody" in said and "chown root" in said, said


def test_a_reload_of_a_config_another_user_changed_keeps_the_running_config(shared):
    path = _config(shared)
    d = ConfigDaemon(shared, path)
    try:
        d.notify.wait_for(lambda m: m.get("READY") == "1", timeout=30)
        d.wait_log("started:")
        os.chown(path, NOBODY, NOBODY)          # handed over; nobody now writes a config of its own
        r = as_nobody("sh", "-c", f"printf 'guard: {{dry_run: false}}\\n' >> {path}")
        assert r.returncode == 0, r.stderr
        d.reload()
        d.wait_log("reload failed, keeping the running config")
        assert "owner nobody" in d.log() and "chown root" in d.log()
        assert d.proc.poll() is None
    finally:
        rc = d.stop()
    assert rc == 0 and "Traceback" not in d.log(), d.log()[-3000:]


# ---- the reader of the daemon's own files ------------------------------------------------------

def test_read_file_refuses_what_another_user_put_there(shared):
    """As nobody, in a folder nobody owns: a symlink to root's file, to /dev/zero, a FIFO (no
    writer: a plain open would wait forever), a huge file, a file of nobody's, a world-writable one."""
    own = os.path.join(shared, "own")
    os.mkdir(own)
    os.chown(own, NOBODY, NOBODY)
    secret = os.path.join(shared, "root-only")
    with open(secret, "w") as f:
        f.write("root's\n")
    os.chmod(secret, 0o600)
    made = as_nobody("sh", "-c", f"cd {own} && ln -s {secret} link && ln -s /dev/zero zero && mkfifo fifo && "
                                 f"truncate -s 1G huge && echo mine > mine")
    assert made.returncode == 0, made.stderr
    for name, why in (("link", "symbolic link"), ("zero", "symbolic link"), ("fifo", "a FIFO"),
                      ("mine", "owned by nobody")):
        t0 = time.monotonic()
        with pytest.raises(untrusted.FileRefused, match=why):
            untrusted.read_file(os.path.join(own, name), 1 << 16)
        assert time.monotonic() - t0 < 1.0
    with pytest.raises(untrusted.FileRefused, match="more than 65536 bytes"):
        untrusted.read_file(os.path.join(own, "huge"), 1 << 16, owners=(NOBODY,))
    assert untrusted.read_file(os.path.join(own, "mine"), 64, owners=(NOBODY,)) == b"mine\n"
    shared_file = os.path.join(shared, "open")
    with open(shared_file, "w") as f:
        f.write("{}")
    os.chmod(shared_file, 0o666)
    with pytest.raises(untrusted.FileRefused, match="writable by other users"):
        untrusted.read_file(shared_file, 64)
    dfd = untrusted.open_dir(own, owners=(NOBODY,))
    try:
        assert untrusted.read_file("mine", 64, owners=(NOBODY,), dir_fd=dfd) == b"mine\n"
    finally:
        os.close(dfd)
    os.symlink(own, os.path.join(shared, "own-link"))
    with pytest.raises(untrusted.FileRefused, match="symbolic link"):
        untrusted.open_dir(os.path.join(shared, "own-link"), owners=(NOBODY,))

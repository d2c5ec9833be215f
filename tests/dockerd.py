"""The tests' own Docker daemon and the fake-vLLM image: a session fixture, real dockerd, no registry.

:func:`dockerd` starts Debian's ``dockerd`` (docker.io, tests/install-deps) with a data root, an
exec root and a socket of its own, ``--iptables=false --ip6tables=false --bridge=none`` (it creates
no bridge and no firewall rule: the tests' containers use ``--network host``, as the recipes do),
the ``cgroupfs`` cgroup driver and the overlay2 storage driver (both work on this machine: cgroup
v1 hybrid, ext4; FIELD-NOTES).  It never talks to another dockerd: every CLI call of the tests and
of the sparkguard they start goes to ``DOCKER_HOST=unix://<its socket>``.

The data root (``/var/cache/sparkguard-tests/docker``, held by a lock for the session) keeps the
image between sessions; a second session running at the same time gets a throw-away data root
under /tmp instead.  The image is the cached Debian root of the booted-systemd tests
(:func:`system.nspawn.cached_root`: debootstrap minbase + python3 + a venv with sparkguard's
dependencies at /opt/sparkguard), made with ``tar -C ROOT -c . | docker import -`` (FIELD-NOTES);
the checkout is mounted read-only at /src by :meth:`Dockerd.fake_run`.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import uuid
from pathlib import Path

import pytest

from system import nspawn

CHECKOUT = Path(__file__).resolve().parents[1]
DATA_ROOT = nspawn.CACHE_DIR / "docker"
#: label on every container the tests create (the session's teardown removes what carries it)
LABEL = "sparkguard-test"
READY_LINE = "API listen on"
START_TIMEOUT = 60.0


class Dockerd:
    """A running test dockerd.

    Attributes:
        host: str, ``unix:///.../docker.sock`` (give it as DOCKER_HOST).
        env: dict, ``os.environ`` with DOCKER_HOST set.
        image: str, the fake image's tag (set by :meth:`ensure_image`).
        cli: str, the docker CLI found on PATH.
    """

    def __init__(self, data_root: Path, exec_root: Path):
        self.data_root, self.exec_root = data_root, exec_root
        self.host = f"unix://{exec_root}/docker.sock"
        self.env = dict(os.environ, DOCKER_HOST=self.host)
        self.cli = shutil.which("docker") or "docker"
        self.image = ""
        self.proc: subprocess.Popen | None = None
        self.log: list[str] = []
        self._ready = threading.Event()

    def start(self) -> None:
        """Start dockerd and wait for its "API listen on" line, then for ``docker info``.
        Raises RuntimeError (with dockerd's last lines) when it exits or is not up in time."""
        self.proc = subprocess.Popen(
            ["dockerd", "--data-root", str(self.data_root), "--exec-root", str(self.exec_root / "exec"),
             "--pidfile", str(self.exec_root / "dockerd.pid"), "-H", self.host,
             "--iptables=false", "--ip6tables=false", "--bridge=none", "--storage-driver", "overlay2",
             "--exec-opt", "native.cgroupdriver=cgroupfs"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            errors="replace", start_new_session=True)
        threading.Thread(target=self._read, daemon=True).start()
        if not self._ready.wait(START_TIMEOUT) or self.proc.poll() is not None:
            raise RuntimeError("dockerd did not start:\n" + "\n".join(self.log[-30:]))
        r = self.docker("info", "--format", "{{.ServerVersion}} {{.Driver}} {{.CgroupDriver}}", check=False)
        if r.returncode != 0:
            raise RuntimeError(f"docker info failed: {r.stderr}\n" + "\n".join(self.log[-30:]))

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.log.append(line.rstrip("\n"))
            del self.log[:-200]
            if READY_LINE in line:
                self._ready.set()
        self._ready.set()

    def docker(self, *args: str, check: bool = True, timeout: float = 60, input: bytes | str | None = None
               ) -> subprocess.CompletedProcess:
        """``docker ARGS`` against this daemon; text output.  check: raise AssertionError on failure."""
        r = subprocess.run([self.cli, *args], env=self.env, capture_output=True, text=True, timeout=timeout,
                           input=input)
        if check and r.returncode != 0:
            raise AssertionError(f"docker {' '.join(args)}: {r.returncode}\n{r.stderr}")
        return r

    def ensure_image(self) -> str:
        """The fake image (``sparkguard-test/fake:<root key>``), imported from the cached root once."""
        root = nspawn.cached_root(log=lambda m: print(f"[docker] {m}", flush=True))
        tag = f"sparkguard-test/fake:{root.name.rsplit('-', 1)[-1]}"
        if self.docker("image", "inspect", tag, check=False).returncode != 0:
            tar = subprocess.Popen(["tar", "-C", str(root), "-c", "."], stdout=subprocess.PIPE)
            try:
                r = subprocess.run([self.cli, "import", "-", tag], env=self.env, stdin=tar.stdout,
                                   capture_output=True, text=True, timeout=300)
            finally:
                tar.stdout.close()
                tar.wait(60)
            if r.returncode != 0:
                raise RuntimeError(f"docker import failed: {r.stderr}")
        self.image = tag
        return tag

    def fake_run(self, model: str, *opts: str, name: str | None = None, run_opts: tuple[str, ...] = ()) -> list[str]:
        """``docker run`` argv of a fake vLLM in the image, as the recipes write it (``--network
        host``), the checkout read-only at /src, labelled :data:`LABEL`, ``--rm``."""
        argv = [self.cli, "run", "--rm", "--network", "host", "--label", LABEL, "-v", f"{CHECKOUT}:/src:ro"]
        if name:
            argv += ["--name", name]
        return argv + list(run_opts) + [self.image, "/opt/sparkguard/bin/python3", "/src/tests/fakes/vllm",
                                        "serve", model, *opts]

    def containers(self, *filters: str) -> list[str]:
        """Ids of the containers (running or not) carrying :data:`LABEL` (and ``filters``)."""
        args = ["ps", "-aq", "--no-trunc", "--filter", f"label={LABEL}"]
        for f in filters:
            args += ["--filter", f]
        return self.docker(*args).stdout.split()

    def remove_all(self) -> None:
        """``docker rm -f`` every container of this daemon (its data root is the tests' own)."""
        ids = self.docker("ps", "-aq", check=False).stdout.split()
        if ids:
            self.docker("rm", "-f", *ids, check=False)

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM the dockerd started here (its pidfd), SIGKILL after ``timeout``; it stops the
        containerd it started."""
        if self.proc is None or self.proc.poll() is not None:
            return
        fd = os.pidfd_open(self.proc.pid)
        try:
            signal.pidfd_send_signal(fd, signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                signal.pidfd_send_signal(fd, signal.SIGKILL)
                self.proc.wait(10)
        finally:
            os.close(fd)


def unavailable_reason() -> str | None:
    """Why the tests' dockerd cannot run here, or None."""
    if os.geteuid() != 0:
        return "needs root (dockerd)"
    for tool in ("dockerd", "docker", "containerd", "runc", "debootstrap"):
        if shutil.which(tool) is None:
            return f"{tool} not found (tests/install-deps installs docker.io and debootstrap)"
    return None


@pytest.fixture(scope="session")
def dockerd():
    """A started :class:`Dockerd` with its image; every container removed and dockerd stopped at
    the end.  Skips (with the reason) where dockerd cannot run at all."""
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"Docker tests impossible here: {reason}")
    with started() as d:
        yield d


@contextlib.contextmanager
def started():
    """:func:`dockerd`'s body, for the benches too (bench/stop_paths.py): a started
    :class:`Dockerd` with its image; every container removed and dockerd stopped on exit."""
    DATA_ROOT.mkdir(parents=True, exist_ok=True)
    lock = open(nspawn.CACHE_DIR / ".docker.lock", "w")
    tmp = Path(tempfile.mkdtemp(prefix="sgdockerd-"))
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        data_root = DATA_ROOT
    except BlockingIOError:                  # another session holds the cached data root
        data_root = tmp / "data"
    d = Dockerd(data_root, tmp)
    try:
        d.start()
        d.remove_all()                       # left by a killed session: this data root is the tests' own
        d.ensure_image()
        yield d
    finally:
        try:
            if d.proc is not None and d.proc.poll() is None:
                d.remove_all()
        finally:
            d.stop()
            lock.close()
            nspawn.unmount_all(tmp)          # dockerd leaves exec/netns/default mounted
            shutil.rmtree(tmp, ignore_errors=True)


def unique_name(prefix: str = "sgctr") -> str:
    """A container / model name no one else uses."""
    return f"{prefix}-{uuid.uuid4().hex[:10]}"

"""Boot a real systemd in a Debian container for the system tests (systemd-nspawn).

What this module gives the tests:

* :func:`cached_root` -- a debootstrapped Debian root with a Python venv holding
  sparkguard's dependencies, cached under :data:`CACHE_DIR` and keyed by a hash of the
  package list, the suite, the mirror, the architecture and the dependency list.  It is
  built in a temporary directory and renamed into place (``rename(2)`` is atomic), so an
  interrupted build is never used; a lock file serialises concurrent builders.
* :func:`base_root` of :data:`UBUNTU` -- the same for Ubuntu 24.04 (noble), debootstrapped from
  the Ubuntu archive with Debian's ubuntu-keyring and debootstrap's gutsy script
  (:func:`debootstrap_source`); :func:`ubuntu_root` adds what the package and route tests need.
* :class:`Container` -- one throw-away machine: an overlayfs upper layer over the cached
  root (the cache stays pristine), sparkguard installed from a wheel built from the
  checkout, ``systemd-nspawn -b`` in the background with its console in a log file,
  commands run inside with ``nsenter``; :meth:`Container.close` powers it off and removes
  every process, mount and cgroup it made, also after a failure.

Facts found on the test machine (Debian 12 host, kernel 6.x, PID 1 not systemd, cgroup v1
controllers + a cgroup2 "unified" hierarchy without controllers; systemd 252):

* ``systemd-nspawn -b -D ROOT --register=no --keep-unit`` boots a bookworm root in ~0.3 s
  of userspace time; ``systemctl is-system-running --wait`` reports ``running``.
* Without a host systemd, nspawn creates the cgroups ``payload`` and ``supervisor`` in
  the cgroup it is started in (here the root of every hierarchy) and leaves them behind.
  Two containers started from the same cgroup would share them, so every container is
  started inside a cgroup of its own (``sparkguard-test-<id>``, in the name=systemd v1
  hierarchy and in the cgroup2 one) that :meth:`Container.close` removes.
* Default (hybrid) mode boots with harmless "Failed to create symlink
  /sys/fs/cgroup/net_cls" errors.  ``SYSTEMD_NSPAWN_UNIFIED_HIERARCHY=1`` boots the
  container on pure cgroup2, like the Ubuntu 24.04 target; we use that.  The cgroup2
  hierarchy here has no controllers (the host keeps memory/cpu/pids on v1), so the
  unit's MemoryMin= and similar resource settings are accepted but not enforced.
* Without ``--private-network`` a container shares the host's network namespace (so a guard
  inside would bind its metrics port on the host's loopback, next to other tests' guards);
  booted containers therefore get ``--private-network`` (loopback only).  pip inside a
  container cannot reach PyPI here anyway (CERTIFICATE_VERIFY_FAILED: the host
  reaches it through a TLS proxy whose CA only the host trusts).  So the host's pip fetches
  the dependency wheels (:func:`download_wheels`) and the root installs them with
  ``--no-index``; the resulting venv is cached with the root.
* Capabilities: nspawn's default bounding set for the container leaves out CAP_IPC_LOCK, so
  the unit's CAP_IPC_LOCK and LimitMEMLOCK=infinity could not work and the guard's mlockall
  failed with EPERM; containers get ``--capability=CAP_IPC_LOCK``, as a real host's PID 1 has
  it.  CAP_SYS_RESOURCE is missing from this host's own bounding set (CapBnd
  000001fffeffffff: bit 24 clear; nspawn warns "Some capabilities will not be set"), so inside
  the container systemd cannot raise LimitMEMLOCK above the inherited 8 MiB hard limit nor
  apply OOMScoreAdjust=-1000, and the guard cannot lower its own oom_score_adj: the test checks
  those only where CAP_SYS_RESOURCE exists (:func:`has_capability`).
* Inside: /proc/meminfo is the host's (same MemAvailable), /proc/pressure/memory (PSI) is
  readable, /sys/class/zram-control is visible but /sys is mounted read-only, and /proc/sys
  is read-only (nspawn's default): sysctls and zram cannot be set up from the container.
* A booted container mounts tmpfs on /tmp and /run: a file :meth:`Container.write` puts there
  lands under the mount and is invisible inside (write drop-ins to /etc/systemd/system, scratch
  files to /var/tmp or /opt).
* systemd 252 in the container (tests/system/test_adoption.py): ``systemctl list-jobs`` lists the
  unit's job as ``restart`` during ``systemctl restart`` and ``stop`` during ``systemctl stop``;
  ExecStopPost after a crash (SIGKILL, watchdog abort) runs with no job for the unit and
  ``$SERVICE_RESULT`` ``signal`` / ``watchdog``; with ``KillMode=process`` the next start logs
  "Found left-over process N (...) in control group while starting unit. Ignoring."; SIGSTOP
  cannot fake a hung daemon on stop (systemd sends SIGCONT after the SIGTERM, systemd.kill(5)).
* Same container, the orphan check (sparkguard/supervisor/orphancheck.py): a ``systemctl stop`` of
  the unit in ``auto-restart`` leaves it ``inactive`` with the crashed invocation's ``InvocationID``
  still shown by ``systemctl show`` (the engine's populated cgroup keeps the unit loaded);
  ``systemd-run --on-active=`` works from the unit's ExecStopPost under its sandbox
  (ProtectSystem=strict, the capability bounding set); an entry sent by root with
  ``OBJECT_SYSTEMD_UNIT=sparkguard.service`` is listed by ``journalctl -u sparkguard``.
* nspawn prints "Attempted to remove disk file system under /run/systemd/nspawn/propagate/
  NAME, and we can't allow that" at exit (host /run is not a tmpfs); the directory is
  removed anyway.  Machine names are unique per container so the propagate directories
  of concurrent containers never collide.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

#: Packages given to ``debootstrap --include`` (minbase variant).  procps: the unit's
#: ``ExecReload=/bin/kill -HUP $MAINPID`` needs /bin/kill, which minbase lacks (reload failed
#: with 203/EXEC "Failed to locate executable /bin/kill"); every real Debian/Ubuntu install has
#: it (procps is Priority: important; ubuntu-minimal depends on it).
PACKAGES = ("systemd", "systemd-sysv", "dbus", "python3", "python3-venv", "procps")
SUITE = "bookworm"
#: Debian 13, for the package test's second root (:func:`deb_root`).
TRIXIE = "trixie"
#: Ubuntu 24.04 (DGX OS's base), for the package and install-route test's Ubuntu root
#: (:func:`ubuntu_root`).
UBUNTU = "noble"
#: The Ubuntu archive debootstrap and apt fetch noble from; override with SPARKGUARD_TEST_UBUNTU_MIRROR.
UBUNTU_MIRROR = os.environ.get("SPARKGUARD_TEST_UBUNTU_MIRROR", "http://archive.ubuntu.com/ubuntu")
#: The archive's keys, from Debian's ubuntu-keyring package (tests/install-deps installs it).
UBUNTU_KEYRING = Path("/usr/share/keyrings/ubuntu-archive-keyring.gpg")
#: Debian's debootstrap (1.0.128 in Debian 12) has no script named noble; every Ubuntu script in
#: /usr/share/debootstrap/scripts/ is a symlink to gutsy, which is given as the script argument.
UBUNTU_SCRIPT = Path("/usr/share/debootstrap/scripts/gutsy")
#: python3-pyroute2 and pipx are in noble's universe, the rest of the Depends in main.
UBUNTU_COMPONENTS = "main,universe"
#: Where cached roots live; override with SPARKGUARD_TEST_CACHE.
CACHE_DIR = Path(os.environ.get("SPARKGUARD_TEST_CACHE", "/var/cache/sparkguard-tests"))
#: The venv inside the root that sparkguard is installed into.
VENV = "/opt/sparkguard"
CHECKOUT = Path(__file__).resolve().parents[2]
PATH_IN = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
#: The fake vLLM (tests/fakes) is not in the wheel: :meth:`Container.copy_fakes` copies its launcher
#: and the modules it imports (name, mode) to :data:`FAKES_IN`, where it runs on the installed sparkguard.
FAKE_FILES = (("vllm", 0o755), ("fake_vllm.py", 0o644), ("fake_cluster.py", 0o644), ("fake_pause.py", 0o644))
FAKES_IN = "/opt/sparkguard-tests/fakes"


class NspawnUnavailable(RuntimeError):
    """This host cannot boot a container (reason in the message); tests skip on it."""


class ArchiveUnavailable(RuntimeError):
    """A root that is not cached yet cannot be built: its archive cannot be reached or its
    keyring is missing (reason in the message); the tests that need that root skip on it."""


# ---------------------------------------------------------------------------- host checks


def unavailable_reason() -> str | None:
    """Why a booted-systemd container is impossible here, or None if it should work.

    Checks: running as root, the tools (systemd-nspawn, debootstrap, nsenter), overlayfs.
    """
    if os.geteuid() != 0:
        return "needs root (systemd-nspawn, debootstrap, mounts)"
    for tool in ("systemd-nspawn", "debootstrap", "nsenter"):
        if shutil.which(tool) is None:
            return f"{tool} not found (tests/install-deps installs systemd-container, debootstrap, util-linux)"
    try:
        with open("/proc/filesystems") as f:
            if "overlay" not in f.read():
                subprocess.run(["modprobe", "overlay"], capture_output=True, timeout=30)
        with open("/proc/filesystems") as f:
            if "overlay" not in f.read():
                return "kernel has no overlayfs"
    except OSError as e:
        return f"cannot read /proc/filesystems: {e}"
    return None


def debian_mirror() -> str:
    """The Debian mirror the host's apt uses (deb.debian.org here), for debootstrap.

    Reads /etc/apt/sources.list and /etc/apt/sources.list.d/*.{list,sources}; falls back to
    http://deb.debian.org/debian.  Override with SPARKGUARD_TEST_MIRROR.
    """
    if os.environ.get("SPARKGUARD_TEST_MIRROR"):
        return os.environ["SPARKGUARD_TEST_MIRROR"]
    files = [Path("/etc/apt/sources.list")]
    d = Path("/etc/apt/sources.list.d")
    if d.is_dir():
        files += sorted(d.iterdir())
    for f in files:
        try:
            text = f.read_text()
        except OSError:
            continue
        for url in re.findall(r"(https?://\S+)", text):
            url = url.rstrip("/")
            if url.endswith("/debian") and "security" not in url:
                return url
    return "http://deb.debian.org/debian"


def dependencies() -> list[str]:
    """sparkguard's runtime requirements, read from the checkout's pyproject.toml."""
    text = (CHECKOUT / "pyproject.toml").read_text()
    try:
        import tomllib
        return list(tomllib.loads(text)["project"]["dependencies"])
    except ImportError:  # Python 3.10: no tomllib; the list is a simple TOML array of strings
        m = re.search(r"^dependencies\s*=\s*\[(.*?)\]", text, re.S | re.M)
        return re.findall(r'"([^"]+)"', m.group(1)) if m else []


# ---------------------------------------------------------------------------- mounts, cgroups


def mounts_under(path: Path) -> list[str]:
    """Mount points at or below ``path`` in this mount namespace, deepest first."""
    prefix = str(path).rstrip("/")
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            mp = line.split()[4].replace("\\040", " ")
            if mp == prefix or mp.startswith(prefix + "/"):
                out.append(mp)
    return sorted(out, key=lambda m: m.count("/"), reverse=True)


def unmount_all(path: Path) -> None:
    """Unmount everything at or below ``path`` (lazily if busy)."""
    for _ in range(5):
        mps = mounts_under(path)
        if not mps:
            return
        for mp in mps:
            r = subprocess.run(["umount", mp], capture_output=True)
            if r.returncode != 0:
                subprocess.run(["umount", "-l", mp], capture_output=True)
    left = mounts_under(path)
    if left:
        raise RuntimeError(f"could not unmount {left}")


def remove_tree(path: Path) -> None:
    """Unmount everything below ``path`` and delete it, never crossing into another file system."""
    if not path.exists():
        return
    unmount_all(path)
    subprocess.run(["rm", "-rf", "--one-file-system", str(path)], check=True, timeout=300)


def _cgroup_dirs() -> list[Path]:
    """This process's cgroup directories in the hierarchies nspawn uses (name=systemd v1, cgroup2).

    Source: /proc/self/cgroup (``ID:controllers:path``) and the mounts under /sys/fs/cgroup.
    """
    mine = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            hid, ctl, path = line.rstrip("\n").split(":", 2)
            mine[ctl] = path
    out = []
    mounts = {}
    with open("/proc/self/mountinfo") as f:
        for line in f:
            pre, _, post = line.partition(" - ")
            fstype, _src, opts = post.split()[:3]
            mp = pre.split()[4]
            if fstype == "cgroup2":
                mounts[""] = mp
            elif fstype == "cgroup" and "name=systemd" in opts.split(","):
                mounts["name=systemd"] = mp
    for ctl, mp in mounts.items():
        if ctl in mine:
            out.append(Path(mp) / mine[ctl].lstrip("/"))
    return out


def _cgroup_pids(path: Path) -> set[int]:
    """PIDs in cgroup ``path`` and below (cgroup.procs of every directory)."""
    pids: set[int] = set()
    for d, _, files in os.walk(path):
        if "cgroup.procs" in files:
            with contextlib.suppress(OSError):
                pids.update(int(x) for x in Path(d, "cgroup.procs").read_text().split())
    return pids


def _kill_cgroup_tree(paths: list[Path], timeout: float = 10.0) -> None:
    """SIGKILL every process in these cgroups (created by this module for one container), wait
    until they are gone (bounded), and remove the cgroups."""
    deadline = time.monotonic() + timeout
    while True:
        pids = set().union(*(_cgroup_pids(p) for p in paths if p.exists()))
        if not pids or time.monotonic() > deadline:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)
    for p in paths:
        _rmdir_cgroup(p)


def _rmdir_cgroup(path: Path, timeout: float = 10.0) -> None:
    """Remove a cgroup directory and its children, depth first (cgroupfs dirs hold only control files)."""
    deadline = time.monotonic() + timeout
    while path.exists():
        dirs = sorted((Path(d) for d, _, _ in os.walk(path)), key=lambda p: len(p.parts), reverse=True)
        busy = False
        for d in dirs:
            try:
                d.rmdir()
            except FileNotFoundError:
                pass
            except OSError:
                busy = True  # EBUSY: a process (or a zombie being reaped) is still inside
        if not busy or time.monotonic() > deadline:
            break
        time.sleep(0.1)


# ---------------------------------------------------------------------------- the cached root


@contextlib.contextmanager
def _lock(name: str):
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    with open(CACHE_DIR / f".{name}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _key(*parts: object) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def _clean_stale(prefix: str) -> None:
    """Remove half-built trees left by interrupted builds (caller holds the lock)."""
    for p in CACHE_DIR.glob(f".tmp-{prefix}-*"):
        remove_tree(p)


def ubuntu_unavailable_reason(timeout: float = 15) -> str | None:
    """Why the Ubuntu root cannot be built here, or None: the keyring or debootstrap's script is
    missing, or ``UBUNTU_MIRROR/dists/noble/Release`` does not answer 200 within ``timeout`` s."""
    import urllib.request
    if not UBUNTU_KEYRING.is_file():
        return f"{UBUNTU_KEYRING} missing (tests/install-deps installs ubuntu-keyring)"
    if not UBUNTU_SCRIPT.is_file():
        return f"{UBUNTU_SCRIPT} missing: this debootstrap cannot build Ubuntu roots"
    url = f"{UBUNTU_MIRROR}/dists/{UBUNTU}/Release"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            if r.status != 200:
                return f"the Ubuntu archive answered {r.status} for {url}"
    except OSError as e:
        return f"the Ubuntu archive cannot be reached ({url}: {e})"
    return None


def debootstrap_source(suite: str) -> tuple[str, list[str], list[str]]:
    """(mirror, options, trailing arguments) of ``debootstrap`` for ``suite``.

    Debian suites: the host's Debian mirror (:func:`debian_mirror`), no more.  :data:`UBUNTU`: the
    Ubuntu archive with its keyring, main and universe, and the gutsy script (:data:`UBUNTU_SCRIPT`).
    """
    if suite == UBUNTU:
        return (UBUNTU_MIRROR, [f"--keyring={UBUNTU_KEYRING}", f"--components={UBUNTU_COMPONENTS}"],
                [str(UBUNTU_SCRIPT)])
    return debian_mirror(), [], []


def base_root(log=print, suite: str = SUITE) -> Path:
    """The cached debootstrap root (minbase + :data:`PACKAGES`) of ``suite``, built if missing.

    Args:
        suite: suite name for debootstrap: Debian's :data:`SUITE` (default) or :data:`TRIXIE`, or
            Ubuntu's :data:`UBUNTU` (:func:`debootstrap_source`).
    Returns:
        Path of ``CACHE_DIR/rootfs-<hash>``; never modified after it is renamed into place.
    Raises:
        ArchiveUnavailable: an Ubuntu root is to be built and :func:`ubuntu_unavailable_reason` says why not.
        subprocess.CalledProcessError: debootstrap failed (the temporary tree is removed).
    """
    mirror, opts, tail = debootstrap_source(suite)
    # Debian roots keep the key they had before Ubuntu's options existed (their cache stays valid).
    key = _key(suite, sorted(PACKAGES), mirror, platform.machine(), *([opts, tail] if opts else []))
    final = CACHE_DIR / f"rootfs-{key}"
    if final.is_dir():
        return final
    with _lock(f"rootfs-{key}"):
        if final.is_dir():
            return final
        if suite == UBUNTU:
            reason = ubuntu_unavailable_reason()
            if reason:
                raise ArchiveUnavailable(reason)
        _clean_stale(f"rootfs-{key}")
        tmp = CACHE_DIR / f".tmp-rootfs-{key}-{os.getpid()}"
        log(f"building {final} with debootstrap of {suite} from {mirror} (a minute or two)")
        try:
            subprocess.run(["debootstrap", "--variant=minbase", "--include=" + ",".join(PACKAGES), *opts,
                            suite, str(tmp), mirror, *tail], check=True, capture_output=True, text=True,
                           timeout=900)
            os.rename(tmp, final)
        except BaseException:
            remove_tree(tmp)
            raise
    return final


def root_python_version(root: Path) -> str:
    """``"3.11"``: the version of the root's ``/usr/bin/python3`` (from its symlink target)."""
    target = os.readlink(root / "usr/bin/python3")
    m = re.fullmatch(r"python(\d+\.\d+)", os.path.basename(target))
    if not m:
        raise RuntimeError(f"cannot tell the Python version of {root}/usr/bin/python3 -> {target}")
    return m.group(1)


def root_glibc_version(root: Path) -> tuple[int, int]:
    """glibc (major, minor) of the root, from libc6's Version in its dpkg status."""
    text = (root / "var/lib/dpkg/status").read_text()
    m = re.search(r"^Package: libc6\n(?:[^\n]+\n)*?Version: (\d+)\.(\d+)", text, re.M)
    if not m:
        raise RuntimeError(f"no libc6 in {root}/var/lib/dpkg/status")
    return int(m.group(1)), int(m.group(2))


def download_wheels(reqs: list[str], dest: Path, pyver: str, glibc: tuple[int, int]) -> None:
    """Fetch wheels for ``reqs`` (and their dependencies) that the root's interpreter can install.

    The container cannot be trusted to reach PyPI (here its TLS goes through the host's
    interception proxy whose CA only the host trusts), so the host's pip fetches them:
    binary wheels for the root's Python version, architecture and glibc (``pip download
    --only-binary --platform manylinux_2_X_ARCH ...``); a requirement published only as an
    sdist (sdnotify) is built into a wheel on the host (``pip wheel``), which is right for
    pure-Python packages; a compiled one would get the host's tags and be refused, loudly,
    by the install in the root.
    """
    arch = platform.machine()
    nodot = pyver.replace(".", "")
    plats = [f"manylinux_{glibc[0]}_{m}_{arch}" for m in range(5, glibc[1] + 1)]
    plats += [f"manylinux2014_{arch}", f"manylinux2010_{arch}", f"manylinux1_{arch}", "any"]
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--quiet"]
    binary = pip + ["download", "-d", str(dest), "--only-binary=:all:", "--python-version", pyver,
                    "--implementation", "cp", "--abi", f"cp{nodot}", "--abi", "abi3", "--abi", "none"]
    for p in plats:
        binary += ["--platform", p]
    for req in reqs:
        r = subprocess.run(binary + [req], capture_output=True, text=True, timeout=300)
        if r.returncode != 0:
            r = subprocess.run(pip + ["wheel", "-w", str(dest), req], capture_output=True, text=True,
                               timeout=300)
            if r.returncode != 0:
                raise RuntimeError(f"cannot get a wheel for {req}:\n{r.stdout}\n{r.stderr}")


def derived_root(base: Path, kind: str, key: str, what: str, fill, log=print) -> Path:
    """``CACHE_DIR/<kind>-<key>``: a copy of the cached root ``base`` changed by ``fill(tmp)``, built once.

    Built into ``.tmp-<kind>-<key>-<pid>`` under :func:`_lock` and renamed into place
    (``rename(2)`` is atomic), so an interrupted build is never used; a failed one is removed.

    Args:
        base: the root to copy (:func:`base_root`).
        kind: name prefix of the cached tree (``venvroot``, ``debroot``).
        key: hash of everything the tree depends on (:func:`_key`).
        what: said in the log line when it is built.
        fill: callable(Path) that completes the copy; raises on failure.
    """
    final = CACHE_DIR / f"{kind}-{key}"
    if final.is_dir():
        return final
    with _lock(f"{kind}-{key}"):
        if final.is_dir():
            return final
        _clean_stale(f"{kind}-{key}")
        tmp = CACHE_DIR / f".tmp-{kind}-{key}-{os.getpid()}"
        log(f"building {final}: {what}")
        try:
            subprocess.run(["cp", "-a", "--reflink=auto", str(base), str(tmp)], check=True, timeout=300)
            fill(tmp)
            os.rename(tmp, final)
        except BaseException:
            remove_tree(tmp)
            raise
    return final


def nspawn_script(root: Path, script: str, timeout: float = 600) -> None:
    """Run the shell ``script`` in ``root`` with a non-booted systemd-nspawn (host network); raise on failure."""
    run_in_own_cgroup(["systemd-nspawn", "--quiet", "--register=no", "--keep-unit",
                       "-M", f"sgbuild-{uuid.uuid4().hex[:8]}", "-D", str(root),
                       "/bin/sh", "-c", script], timeout=timeout)


def cached_root(log=print) -> Path:
    """The cached root that containers start from: :func:`base_root` plus a venv at :data:`VENV`
    holding sparkguard's dependencies (not sparkguard itself; each test run installs the checkout).

    Keyed by the base root and :func:`dependencies` (:func:`derived_root`).  Wheels come from the
    host (:func:`download_wheels`) and are installed with ``pip --no-index`` by the root's own
    python3 in a non-booted systemd-nspawn.
    """
    base = base_root(log)
    deps = dependencies()

    def fill(tmp: Path) -> None:
        download_wheels(deps, tmp / "var/tmp/wheels", root_python_version(tmp), root_glibc_version(tmp))
        nspawn_script(tmp, f"set -e; python3 -m venv {VENV}; "
                           f"{VENV}/bin/pip install --quiet --disable-pip-version-check --no-index "
                           "--find-links /var/tmp/wheels " + " ".join(f"'{d}'" for d in deps) +
                           "; rm -rf /var/tmp/wheels")

    return derived_root(base, "venvroot", _key(base.name, deps), f"venv with {deps}", fill, log)


def deb_depends() -> list[str]:
    """The Debian packages the sparkguard package depends on, from the checkout's debian/control
    (the ``Depends:`` of ``Package: sparkguard``, without ``${...}`` substitutions)."""
    text = (CHECKOUT / "debian/control").read_text()
    stanza = text[text.index("Package: sparkguard"):]
    m = re.search(r"^Depends:(.*?)(?=^\S)", stanza + "\nEnd:", re.S | re.M)
    names = [d.strip().split()[0] for d in m.group(1).split(",") if d.strip()] if m else []
    return [n for n in names if not n.startswith("$")]


def deb_root(log=print, suite: str = SUITE) -> Path:
    """A cached root for installing the sparkguard .deb offline: :func:`base_root` of ``suite``
    with apt's package lists and the ``.deb`` files of :func:`deb_depends` in apt's cache.

    Booted containers have no network (``--private-network``), so ``apt install ./sparkguard.deb``
    inside must find every dependency in /var/cache/apt/archives; it still resolves them itself
    (``apt-get install --download-only`` here, the real install in the test).  The downloads run
    in a non-booted systemd-nspawn that shares the host's network; the root's own sources.list
    (written by debootstrap) names the mirror.  Keyed by the base root and the dependency list.
    """
    base = base_root(log, suite)
    deps = deb_depends()
    script = ("set -e; export DEBIAN_FRONTEND=noninteractive; apt-get update -qq; "
              "apt-get install -y -qq --download-only --no-install-recommends " + " ".join(deps))
    return derived_root(base, "debroot", _key(base.name, "deb", deps), f"{suite} with {deps} downloaded for apt",
                        lambda tmp: nspawn_script(tmp, script), log)


#: what the README's install routes fetch besides the dependencies: pip's build-isolation
#: requirements of pyproject.toml's [build-system] (setuptools>=68, wheel) and pip itself (pipx
#: 1.1.0 upgrades pip in its shared venv)
BUILD_REQUIREMENTS = ("setuptools>=68", "wheel", "pip")
#: the Debian packages the routes install with apt inside (downloaded into the root's apt cache)
ROUTE_PACKAGES = ("pipx",)
#: where :func:`routes_root` puts the wheels; PIP_FIND_LINKS inside points here
ROUTE_WHEELS = "/var/tmp/wheels"


def routes_root(log=print, suite: str = SUITE) -> Path:
    """A cached root for the README's install routes (tests/test_install_routes.py): :func:`base_root`
    with no sparkguard and no venv, the wheels of :func:`dependencies` and
    :data:`BUILD_REQUIREMENTS` in :data:`ROUTE_WHEELS`, and :data:`ROUTE_PACKAGES` (pipx) downloaded
    into apt's cache.

    A booted container has no network (``--private-network``), and pip inside could not reach PyPI
    here anyway (see the module docstring), so the test runs the README's ``pip install .`` with
    ``PIP_NO_INDEX=1 PIP_FIND_LINKS=`` :data:`ROUTE_WHEELS` (pip reads every option from
    ``PIP_<OPTION>`` environment variables: pip's "Configuration" documentation): the same
    command, with the index replaced by the wheels the host fetched from it.
    """
    base = base_root(log, suite)
    reqs = dependencies() + list(BUILD_REQUIREMENTS)
    return derived_root(base, "routesroot", _key(base.name, "routes", reqs, ROUTE_PACKAGES),
                        f"{suite} with wheels of {reqs} and {ROUTE_PACKAGES} downloaded",
                        lambda tmp: _fill_offline(tmp, reqs, ROUTE_PACKAGES), log)


def _fill_offline(tmp: Path, reqs: list[str], packages) -> None:
    """Put the wheels of ``reqs`` in :data:`ROUTE_WHEELS` of the root ``tmp`` and the ``.deb`` files
    of ``packages`` (with what apt says they need) in its apt cache, for a booted container
    without network."""
    download_wheels(reqs, tmp / ROUTE_WHEELS.lstrip("/"), root_python_version(tmp), root_glibc_version(tmp))
    nspawn_script(tmp, "set -e; export DEBIAN_FRONTEND=noninteractive; apt-get update -qq; "
                       "apt-get install -y -qq --download-only --no-install-recommends " + " ".join(packages))


def ubuntu_root(log=print) -> Path:
    """A cached Ubuntu 24.04 root for one boot that installs the .deb (tests/test_deb.py) and runs
    the README's first command (tests/system/routes.py): :func:`base_root` of :data:`UBUNTU` with
    the ``.deb`` files of :func:`deb_depends` and :data:`ROUTE_PACKAGES` in apt's cache and the
    wheels of :func:`dependencies` and :data:`BUILD_REQUIREMENTS` in :data:`ROUTE_WHEELS`.

    apt inside resolves against noble's release pocket (the sources.list debootstrap writes), which
    is what a fresh 24.04 install starts from; noble-updates is left out (assumption: the
    package's Depends did not change there in a way that matters to it).

    Raises:
        ArchiveUnavailable: the root is not cached and the Ubuntu archive cannot be reached.
    """
    base = base_root(log, UBUNTU)
    deps = deb_depends()
    reqs = dependencies() + list(BUILD_REQUIREMENTS)
    packages = [*deps, *ROUTE_PACKAGES]
    return derived_root(base, "ubunturoot", _key(base.name, "deb+routes", deps, reqs, ROUTE_PACKAGES),
                        f"{UBUNTU} with {packages} downloaded for apt and wheels of {reqs}",
                        lambda tmp: _fill_offline(tmp, reqs, packages), log)


def copy_checkout(dest: Path) -> None:
    """Copy the checkout's tracked and untracked-but-not-ignored files to ``dest`` (no build products)."""
    files = subprocess.run(["git", "-C", str(CHECKOUT), "ls-files", "-z", "--cached", "--others",
                            "--exclude-standard"], capture_output=True, check=True, timeout=60).stdout
    for rel in filter(None, files.decode().split("\0")):
        src = CHECKOUT / rel
        if not os.path.lexists(src):
            continue  # deleted in the worktree, not yet committed
        out = dest / rel
        out.parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():
            os.symlink(os.readlink(src), out)
        else:
            shutil.copy2(src, out)


class OwnCgroup:
    """A fresh cgroup (in every hierarchy nspawn uses) to start one nspawn in; removed on close.

    Only used when PID 1 is not systemd (see the module docstring); with a systemd host the
    command runs in a transient scope with ``Delegate=yes`` instead (``systemd-run --scope``).
    """

    def __init__(self, name: str):
        self.name = name
        self.systemd_host = Path("/run/systemd/system").is_dir() and _comm(1) == "systemd"
        self.dirs: list[Path] = []
        if not self.systemd_host:
            for parent in _cgroup_dirs():
                d = parent / name
                d.mkdir()
                self.dirs.append(d)

    def wrap(self, argv: list[str]) -> list[str]:
        """argv that starts ``argv`` inside this cgroup."""
        if self.systemd_host:
            return ["systemd-run", "--scope", "--quiet", "--collect", "-p", "Delegate=yes",
                    f"--unit={self.name}", "--", *argv]
        moves = "; ".join(f"echo $$ > '{d}/cgroup.procs'" for d in self.dirs)
        return ["/bin/sh", "-c", f'{moves}; exec "$@"', "sh", *argv]

    def close(self) -> None:
        """Kill whatever is still inside (nothing, after a clean shutdown) and remove the cgroups."""
        _kill_cgroup_tree(self.dirs)


def run_in_own_cgroup(argv: list[str], timeout: float) -> subprocess.CompletedProcess:
    """Run ``argv`` (a non-booting nspawn) to completion in a cgroup of its own; raise on failure."""
    cg = OwnCgroup(f"sparkguard-test-{uuid.uuid4().hex[:12]}")
    try:
        r = subprocess.run(cg.wrap(argv), capture_output=True, text=True, timeout=timeout,
                           env=dict(os.environ, SYSTEMD_NSPAWN_UNIFIED_HIERARCHY="1"))
        if r.returncode != 0:
            raise RuntimeError(f"{argv} -> rc {r.returncode}\nstdout: {r.stdout}\nstderr: {r.stderr}")
        return r
    finally:
        cg.close()


CAP_SYS_RESOURCE = 24  # linux/capability.h


def has_capability(status_text: str, cap: int, field: str = "CapBnd") -> bool:
    """Is capability number ``cap`` set in ``field`` of a /proc/PID/status text?  (proc(5))"""
    for line in status_text.splitlines():
        if line.startswith(field + ":"):
            return bool(int(line.split()[1], 16) >> cap & 1)
    raise ValueError(f"no {field} in status text")


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def build_wheel(outdir: Path) -> Path:
    """Build a wheel of the checkout (``pip wheel --no-deps``) into ``outdir``; return its path.

    The checkout is copied first (without .git and build products) so the build leaves
    nothing behind in the worktree and picks up uncommitted changes.
    """
    src = outdir / "src"
    shutil.copytree(CHECKOUT, src, ignore=shutil.ignore_patterns(
        ".git", "__pycache__", "*.pyc", "build", "dist", "*.egg-info", ".pytest_cache", ".cache"))
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet",
                        "--disable-pip-version-check", "-w", str(outdir), str(src)],
                       capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        raise RuntimeError(f"pip wheel failed:\n{r.stdout}\n{r.stderr}")
    shutil.rmtree(src)
    wheels = list(outdir.glob("sparkguard-*.whl"))
    if len(wheels) != 1:
        raise RuntimeError(f"expected one wheel in {outdir}, found {wheels}")
    return wheels[0]


# ---------------------------------------------------------------------------- the container


def _starttime(pid: int) -> int | None:
    """Field 22 of /proc/PID/stat (start time in clock ticks): tells a PID from its reuse."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def reap_stale() -> list[str]:
    """Tear down containers whose test process is gone (a run killed by SIGKILL or a CI timeout
    cannot run its own teardown).  Returns the names reaped."""
    reaped = []
    for d in sorted(CACHE_DIR.glob("sgtest-*")):
        try:
            owner = json.loads((d / "owner").read_text())
        except (OSError, ValueError):
            owner = {}
        pid = owner.get("pid")
        if pid and _starttime(pid) is not None and _starttime(pid) == owner.get("starttime"):
            continue  # its test run is alive (perhaps another engineer's)
        if not owner and time.time() - d.stat().st_mtime < 600:
            continue  # being set up right now
        # Everything in the container's own cgroup was started by that test run, and nothing
        # else is: kill it all (its nspawn, and the container's init, which outlives a killed
        # nspawn), then remove mounts, files and cgroups.
        if owner.get("name"):
            _kill_cgroup_tree([parent / f"sparkguard-test-{owner['name']}" for parent in _cgroup_dirs()])
        remove_tree(d)
        reaped.append(d.name)
    # Cgroups left by killed runs: a booted container's whose directory is gone, and the
    # short-lived ones of set-up nspawns (populated within milliseconds of their creation and
    # removed as soon as nspawn exits) that are empty and older than a minute.
    for parent in _cgroup_dirs():
        for cg in parent.glob("sparkguard-test-*"):
            if cg.name.startswith("sparkguard-test-sgtest-"):
                name = cg.name[len("sparkguard-test-"):]
                if not any(CACHE_DIR.glob(f"{name}-*")):
                    _kill_cgroup_tree([q / cg.name for q in _cgroup_dirs()])
                    reaped.append(cg.name)
            else:
                with contextlib.suppress(OSError):
                    if not _cgroup_pids(cg) and time.time() - cg.stat().st_mtime > 60:
                        _rmdir_cgroup(cg, timeout=0)
                        reaped.append(cg.name)
    return reaped


class Container:
    """One booted Debian machine on an overlay of a cached root.

    Lifecycle: ``Container(lower)`` mounts the overlay; :meth:`chroot` runs set-up commands
    before boot; :meth:`boot` starts systemd; :meth:`run` / :meth:`sh` run commands inside;
    :meth:`close` tears everything down (idempotent, safe after any failure).

    Attributes:
        root: Path of the merged root as seen from the host.
        pid1: int, the container's systemd as a host PID (after :meth:`boot`).
        console_log: Path of the file that receives nspawn's output (the container console).
    """

    def __init__(self, lower: Path, workdir: Path | None = None):
        self.name = f"sgtest-{uuid.uuid4().hex[:10]}"
        self.dir = Path(workdir or tempfile.mkdtemp(prefix=f"{self.name}-", dir=CACHE_DIR))
        self.root = self.dir / "root"
        self.console_log = self.dir / "console.log"
        self.proc: subprocess.Popen | None = None
        self.pid1: int | None = None
        self.cgroup: OwnCgroup | None = None
        self._log = None
        for d in ("upper", "work", "root"):
            (self.dir / d).mkdir(parents=True, exist_ok=True)
        self._write_owner()
        try:
            subprocess.run(["mount", "-t", "overlay", "overlay", "-o",
                            f"lowerdir={lower},upperdir={self.dir}/upper,workdir={self.dir}/work",
                            str(self.root)], check=True, capture_output=True, text=True, timeout=30)
        except BaseException:
            self.close()
            raise

    def _write_owner(self) -> None:
        """Record who owns this container, for :func:`reap_stale` after a killed test run."""
        (self.dir / "owner").write_text(json.dumps({
            "pid": os.getpid(), "starttime": _starttime(os.getpid()), "name": self.name,
            "nspawn": self.proc.pid if self.proc else None, "pid1": self.pid1}))

    # -- before boot

    def chroot(self, *argv: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
        """Run ``argv`` in the (not yet booted) root with a plain ``systemd-nspawn`` (proc, dev, resolv.conf set up)."""
        assert self.proc is None, "chroot() is for set-up before boot()"
        r = None
        cg = OwnCgroup(f"sparkguard-test-{uuid.uuid4().hex[:12]}")
        try:
            r = subprocess.run(cg.wrap(["systemd-nspawn", "--quiet", "--register=no", "--keep-unit",
                                        "-M", self.name + "-setup", "-D", str(self.root),
                                        "--setenv=PATH=" + PATH_IN, *argv]),
                               capture_output=True, text=True, timeout=timeout,
                               env=dict(os.environ, SYSTEMD_NSPAWN_UNIFIED_HIERARCHY="1"))
        finally:
            cg.close()
        if check and r.returncode != 0:
            raise AssertionError(f"{argv} failed in {self.root} (rc={r.returncode}):\n{r.stdout}\n{r.stderr}")
        return r

    def install_wheel(self, wheel: Path) -> None:
        """pip-install the sparkguard wheel into :data:`VENV` (dependencies are already there)."""
        shutil.copy(wheel, self.root / "var/tmp" / wheel.name)
        self.chroot(f"{VENV}/bin/pip", "install", "--quiet", "--disable-pip-version-check",
                    "--no-index", "--no-deps", f"/var/tmp/{wheel.name}")
        (self.root / "var/tmp" / wheel.name).unlink()
        link = self.root / "usr/local/bin/sparkguard"
        if not link.exists() and not link.is_symlink():
            link.symlink_to(f"{VENV}/bin/sparkguard")

    def copy_in(self, src: Path, path: str, mode: int = 0o644) -> None:
        """Copy the host file ``src`` to ``path`` inside the root (before or after boot)."""
        p = self.root / path.lstrip("/")
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(p.name + ".sgtmp")
        shutil.copyfile(src, tmp)
        tmp.chmod(mode)
        os.rename(tmp, p)

    def copy_fakes(self, dest: str = FAKES_IN) -> str:
        """Copy the fake vLLM's files (:data:`FAKE_FILES`) to ``dest`` inside; returns its launcher's path."""
        for name, mode in FAKE_FILES:
            self.copy_in(CHECKOUT / "tests" / "fakes" / name, f"{dest}/{name}", mode)
        return f"{dest}/vllm"

    # -- boot

    def boot(self, timeout: float = 90) -> None:
        """Start ``systemd-nspawn -b`` in the background and wait until the system is up.

        Raises:
            AssertionError: nspawn exited, PID 1 never appeared, or ``is-system-running --wait``
                did not say running/degraded within ``timeout`` seconds (console log attached).
        """
        deadline = time.monotonic() + timeout
        self.cgroup = OwnCgroup(f"sparkguard-test-{self.name}")
        self._log = open(self.console_log, "wb")
        argv = ["systemd-nspawn", "-b", "-D", str(self.root), "-M", self.name,
                "--register=no", "--keep-unit", "--console=read-only", "--private-network",
                "--capability=CAP_IPC_LOCK"]
        self.proc = subprocess.Popen(self.cgroup.wrap(argv), stdin=subprocess.DEVNULL,
                                     stdout=self._log, stderr=subprocess.STDOUT,
                                     env=dict(os.environ, SYSTEMD_NSPAWN_UNIFIED_HIERARCHY="1"),
                                     start_new_session=True)
        self.pid1 = self._find_pid1(deadline)
        self._write_owner()
        state = ""
        while time.monotonic() < deadline:
            r = self.run("systemctl", "is-system-running", "--wait", check=False,
                         timeout=max(1.0, deadline - time.monotonic()))
            state = r.stdout.strip()
            if state in ("running", "degraded"):
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.2)  # systemd's bus is not up yet: is-system-running fails at once
        raise AssertionError(f"container did not come up (state {state!r}):\n{self.console()}")

    def _find_pid1(self, deadline: float) -> int:
        """The container's init: nspawn's child that lives in another PID namespace and is systemd."""
        nspawn = self.proc.pid  # our sh wrapper exec()s nspawn (systemd-run --scope execs too)
        my_ns = os.readlink("/proc/self/ns/pid")
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"systemd-nspawn exited with {self.proc.returncode}:\n{self.console()}")
            try:
                with open(f"/proc/{nspawn}/task/{nspawn}/children") as f:
                    children = [int(x) for x in f.read().split()]
            except OSError:
                children = []
            for c in children:
                try:
                    if os.readlink(f"/proc/{c}/ns/pid") != my_ns and _comm(c) == "systemd":
                        return c
                except OSError:
                    continue
            time.sleep(0.05)
        raise AssertionError(f"no container PID 1 under nspawn {nspawn}:\n{self.console()}")

    # -- inside

    def run(self, *argv: str, check: bool = True, timeout: float = 60, input: str | None = None
            ) -> subprocess.CompletedProcess:
        """Run ``argv`` inside the booted container (all namespaces, clean environment).

        Returns CompletedProcess with text stdout/stderr.  Raises AssertionError when
        ``check`` and the exit status is not 0 (command, status and output in the message),
        subprocess.TimeoutExpired after ``timeout`` seconds.
        """
        assert self.pid1, "boot() first"
        full = ["nsenter", "-t", str(self.pid1), "-a", "--", "/usr/bin/env", "-i", "PATH=" + PATH_IN,
                "LANG=C.UTF-8", "SYSTEMD_PAGER=", "SYSTEMD_COLORS=0", *argv]
        r = subprocess.run(full, capture_output=True, text=True, timeout=timeout, input=input)
        if check and r.returncode != 0:
            raise AssertionError(f"in container: {' '.join(argv)} -> rc {r.returncode}\n"
                                 f"stdout: {r.stdout}\nstderr: {r.stderr}")
        return r

    def sh(self, script: str, **kw) -> subprocess.CompletedProcess:
        """Run a shell script inside the container (see :meth:`run`)."""
        return self.run("/bin/sh", "-c", script, **kw)

    def show(self, unit: str, *props: str) -> dict[str, str]:
        """``systemctl show -p PROPS UNIT`` as a dict."""
        r = self.run("systemctl", "show", unit, *(f"--property={p}" for p in props))
        return dict(line.split("=", 1) for line in r.stdout.splitlines() if "=" in line)

    def journal(self, *args: str) -> list[dict]:
        """``journalctl -o json --all ARGS`` inside, parsed (one dict per entry)."""
        r = self.run("journalctl", "--no-pager", "-o", "json", "--all", *args, check=False)
        return [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]

    def journal_text(self, *args: str) -> str:
        """``journalctl -o short-monotonic ARGS`` inside, as text (for messages and diagnostics)."""
        return self.run("journalctl", "--no-pager", "-o", "short-monotonic", *args, check=False).stdout

    def write(self, path: str, text: str, mode: int = 0o644) -> None:
        """Write a file inside the container's root (through the overlay, visible at once)."""
        p = self.root / path.lstrip("/")
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(p.name + ".sgtmp")
        tmp.write_text(text)
        tmp.chmod(mode)
        os.rename(tmp, p)

    def console(self, tail: int = 60) -> str:
        """Last ``tail`` lines of the container console."""
        try:
            return "\n".join(self.console_log.read_text(errors="replace").splitlines()[-tail:])
        except OSError:
            return "(no console log)"

    # -- teardown

    def close(self, timeout: float = 30) -> None:
        """Power off, kill what is left, unmount, remove cgroups and the work directory.  Idempotent."""
        if self.proc is not None and self.proc.poll() is None:
            if self.pid1:
                with contextlib.suppress(Exception):
                    self.run("systemctl", "poweroff", "--no-block", check=False, timeout=10)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                # SIGKILL of the container's init ends its PID namespace: every process inside dies.
                if self.pid1:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(self.pid1, signal.SIGKILL)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.proc.pid, signal.SIGTERM)
                try:
                    self.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    os.kill(self.proc.pid, signal.SIGKILL)
                    self.proc.wait(timeout=10)
        if self._log:
            self._log.close()
            self._log = None
        if self.cgroup:
            self.cgroup.close()
            self.cgroup = None
        unmount_all(self.dir)
        remove_tree(self.dir)
        with contextlib.suppress(OSError):
            shutil.rmtree(f"/run/systemd/nspawn/propagate/{self.name}")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

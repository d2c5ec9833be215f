"""The Debian package (debian/): built with dpkg-buildpackage, installed with apt into booted Debian 12 and 13
and Ubuntu 24.04.

One session builds the package twice from a copy of the checkout (the version in debian/changelog
and a bumped one, for the upgrade), and one container per suite (bookworm, trixie, noble) is booted for
the whole life cycle a Spark owner goes through: ``apt install ./sparkguard_*.deb`` (dependencies
resolved by apt from Debian's or Ubuntu's archive, pre-downloaded into the cached root because booted
containers have no network), nothing started or enabled by the install, ``systemctl enable --now
sparkguard`` reaching READY, ``sparkguard doctor``, an upgrade that keeps an edited
/etc/sparkguard/sparkguard.yaml and restarts the guard, ``apt remove`` stopping it, ``apt purge``
removing configuration and state.

In a container ``sparkguard-setup.service`` (zram, sysctls) is skipped by its
``ConditionVirtualization=!container``; the test checks that it was skipped, not what it sets up.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from system import nspawn, routes

pytestmark = pytest.mark.system

#: PATH for dpkg-buildpackage: Debian's own python3 (pybuild builds for /usr/bin/python3*, and a
#: pyenv python3 first on PATH lacks the `build` module pybuild runs)
BUILD_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"
CONFIG = "/etc/sparkguard/sparkguard.yaml"
UNIT = "sparkguard.service"
#: the first MESSAGE_ID in sparkguard/data/catalog/sparkguard.catalog
CATALOG_ID = "664d84b2b89942f2ac3a8c34e6254450"
APT = ("env", "DEBIAN_FRONTEND=noninteractive", "apt-get", "-y", "-q")
DROPIN = "/etc/systemd/system/sparkguard.service.d/notify-reload.conf"


def build_deb(workdir: Path, version: str | None = None) -> Path:
    """``dpkg-buildpackage -us -uc -b`` of a copy of the checkout in ``workdir``; returns the .deb.

    Args:
        workdir: empty folder; the copy goes to ``workdir/src``, the .deb beside it.
        version: when given, a debian/changelog entry with this version is added first (an upgrade).
    Raises:
        AssertionError: the build failed (its log's tail in the message).
    """
    src = workdir / "src"
    nspawn.copy_checkout(src)
    if version:
        log = src / "debian/changelog"
        log.write_text(f"sparkguard ({version}) unstable; urgency=medium\n\n  * Test upgrade.\n\n"
                       f" -- sparkguard tests <tests@localhost>  Tue, 01 Dec 2026 21:00:00 +0000\n\n"
                       + log.read_text())
    r = subprocess.run(["dpkg-buildpackage", "-us", "-uc", "-b"], cwd=src, capture_output=True, text=True,
                       timeout=600, env=dict(os.environ, PATH=BUILD_PATH))
    assert r.returncode == 0, f"dpkg-buildpackage failed:\n{(r.stdout + r.stderr)[-4000:]}"
    debs = list(workdir.glob("sparkguard_*_all.deb"))
    assert len(debs) == 1, f"expected one .deb in {workdir}, found {debs}"
    return debs[0]


@pytest.fixture(scope="session")
def debs(tmp_path_factory) -> tuple[Path, Path]:
    """(the package of this checkout, the same with version 0.1.0+sgtest1), built once per session."""
    missing = [t for t in ("dpkg-buildpackage", "dh", "git") if shutil.which(t, path=BUILD_PATH) is None]
    if missing:
        pytest.skip(f"{', '.join(missing)} not found: tests/install-deps installs debhelper, dh-python, "
                    "pybuild-plugin-pyproject (and the rest of the build dependencies in debian/control)")
    first = build_deb(tmp_path_factory.mktemp("deb1"))
    second = build_deb(tmp_path_factory.mktemp("deb2"), "0.1.0+sgtest1")
    return first, second


@pytest.fixture(scope="session", params=[nspawn.SUITE, nspawn.TRIXIE, nspawn.UBUNTU])
def debian(request, debs):
    """A booted Debian 12 (bookworm), Debian 13 (trixie) or Ubuntu 24.04 (noble) machine on a cached
    root with the package's dependencies downloaded; one per suite for the session.  The Ubuntu
    root also holds what the README's routes need and the checkout at ``routes.SRC``: the same
    boot runs them after the package's life cycle (:func:`test_readme_routes_in_the_same_ubuntu_boot`).
    Skips, saying why, where the Ubuntu root is not cached and cannot be built (archive unreachable)."""
    reason = nspawn.unavailable_reason()
    if reason:
        pytest.skip(f"booted-systemd test impossible here: {reason}")
    def log(m: str) -> None:
        print(f"[deb] {m}", flush=True)

    if request.param == nspawn.UBUNTU:
        try:
            root = nspawn.ubuntu_root(log=log)
        except nspawn.ArchiveUnavailable as e:
            pytest.skip(f"no Ubuntu 24.04 root: {e}")
    else:
        root = nspawn.deb_root(log=log, suite=request.param)
    c = nspawn.Container(root)
    try:
        if request.param == nspawn.UBUNTU:
            nspawn.copy_checkout(c.root / routes.SRC.lstrip("/"))
        c.boot()
        yield c
    finally:
        c.close()


def metric(c: nspawn.Container, name: str) -> float | None:
    """Value of the unlabelled metric ``name`` on the guard's /metrics inside (127.0.0.1:8799)."""
    text = c.run("/usr/bin/python3", "-c", "import urllib.request as u; "
                 "print(u.urlopen('http://127.0.0.1:8799/metrics', timeout=5).read().decode())").stdout
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else None


def systemd_version(c: nspawn.Container) -> int:
    """The container's systemd version: 252 on Debian 12, 255 on Ubuntu 24.04, 257 on Debian 13
    (the first line of ``systemctl --version`` is ``systemd 255 (255.4-1ubuntu8)``)."""
    m = re.match(r"systemd (\d+)", c.run("systemctl", "--version").stdout)
    assert m, "systemctl --version said no version"
    return int(m.group(1))


def reload_as_the_unit_says(c: nspawn.Container) -> None:
    """The guard's unit type is what the package chose for this systemd, and ``systemctl reload``
    applies an edited config: Debian 13 (systemd 257) and Ubuntu 24.04 (255) get
    ``Type=notify-reload`` through the drop-in the postinst links where systemd >= 253
    (debian/notify-reload.conf); Debian 12 (systemd 252, which does not know notify-reload) keeps
    ``Type=notify`` with ExecReload=."""
    new = systemd_version(c) >= 253
    link = c.run("readlink", DROPIN, check=False).stdout.strip()
    assert link == ("/usr/share/sparkguard/systemd/notify-reload.conf" if new else ""), link
    assert c.show(UNIT, "Type")["Type"] == ("notify-reload" if new else "notify")
    c.sh(f"sed -i 's/^  term_below: .*/  term_below: 384MiB/' {CONFIG}")
    c.run("systemctl", "reload", UNIT, timeout=60)
    assert metric(c, "sparkguard_term_below_bytes") == 384 * 1024**2
    c.sh(f"sed -i 's/^  term_below: .*/  term_below: 512MiB/' {CONFIG}")
    c.run("systemctl", "reload", UNIT, timeout=60)


def test_package_life_cycle(debian, debs):
    c = debian
    first, second = debs
    c.copy_in(first, f"/var/tmp/{first.name}")
    c.copy_in(second, f"/var/tmp/{second.name}")

    # apt resolves the Depends from Debian's archive (python3-psutil, -pyroute2, ...), offline.
    r = c.run(*APT, "install", "--no-install-recommends", f"/var/tmp/{first.name}", timeout=300)
    assert "sparkguard is installed but not enabled" in r.stdout, r.stdout
    assert c.run("sparkguard", "--help").returncode == 0

    # Installed disabled and not started: the install changes no kernel setting by itself.
    # (the set-up unit has no [Install] section: "static", started only through the guard's Wants=)
    for unit, want in ((UNIT, "disabled"), ("sparkguard-setup.service", "static")):
        state = c.run("systemctl", "is-enabled", unit, check=False).stdout.strip()
        assert state == want, f"{unit} is {state!r} after install"
        assert c.show(unit, "ActiveState")["ActiveState"] == "inactive", unit
    # The journal catalog is compiled by systemd's dpkg trigger on /usr/lib/systemd/catalog
    # (journalctl --update-catalog): the first incident id of sparkguard.catalog is known.
    catalog = c.run("journalctl", "--list-catalog", CATALOG_ID).stdout
    assert CATALOG_ID in catalog.replace("-", ""), f"catalog entry {CATALOG_ID} missing: {catalog!r}"
    # sparkguard(8) and the completion, generated at build time from the parser (sparkguard/docgen.py)
    files = c.run("dpkg-query", "-L", "sparkguard").stdout.splitlines()
    for f in ("/usr/share/man/man8/sparkguard.8.gz", "/usr/share/bash-completion/completions/sparkguard",
              "/usr/share/zsh/vendor-completions/_sparkguard"):
        assert f in files, f"{f} not in the package"
    page = c.sh("gzip -dc /usr/share/man/man8/sparkguard.8.gz").stdout
    assert page.startswith('.TH SPARKGUARD "8" "2') and "install\\-zram" in page, page[:300]
    assert c.run("bash", "-n", "/usr/share/bash-completion/completions/sparkguard").returncode == 0
    conffiles = c.run("dpkg-query", "-W", "-f=${Conffiles}", "sparkguard").stdout
    assert CONFIG in conffiles, f"{CONFIG} is not a conffile: {conffiles!r}"

    # Enable: `systemctl start` of a Type=notify unit returns once READY=1 arrived.
    c.run("systemctl", "enable", "--now", UNIT, timeout=90)
    props = c.show(UNIT, "ActiveState", "SubState", "MainPID")
    assert (props["ActiveState"], props["SubState"]) == ("active", "running"), props
    setup = c.show("sparkguard-setup.service", "ConditionResult", "ActiveState")
    assert setup["ConditionResult"] == "no", f"set-up unit ran in a container: {setup}"
    assert metric(c, "sparkguard_term_below_bytes") == 0.75 * 1024**3

    doctor = c.run("sparkguard", "doctor", check=False, timeout=60)
    assert doctor.returncode in (0, 1) and "Traceback" not in doctor.stderr, doctor.stdout + doctor.stderr
    assert re.search(r"^(PASS|WARN|FAIL|INFO)\s", doctor.stdout, re.M), doctor.stdout
    # The distribution's python3-pyroute2 (0.7) cannot run the link watch, but status reads the links
    # through its IPRoute (sparkguard/linkstate.py link_field) and says why they are not watched.
    c.write("/var/tmp/links.yaml", "link:\n  interfaces: [lo]\n")
    st = c.run("sparkguard", "status", "--config", "/var/tmp/links.yaml", timeout=60).stdout
    assert "link watch unavailable: pyroute2 0.7" in st and "  lo: UP (operstate UNKNOWN" in st, st

    # An edited config survives an upgrade, and the upgrade restarts the running guard with it.
    c.sh(f"sed -i 's/^  term_below: .*/  term_below: 512MiB/' {CONFIG}")
    edited = c.run("cat", CONFIG).stdout
    assert "term_below: 512MiB" in edited
    old_pid = props["MainPID"]
    c.run(*APT, "install", "--no-install-recommends", f"/var/tmp/{second.name}", timeout=300)
    assert c.run("dpkg-query", "-W", "-f=${Version}", "sparkguard").stdout == "0.1.0+sgtest1"
    assert c.run("cat", CONFIG).stdout == edited, "the upgrade changed the edited config"
    props = c.show(UNIT, "ActiveState", "MainPID")
    assert props["ActiveState"] == "active" and props["MainPID"] not in (old_pid, "0"), \
        f"guard not restarted by the upgrade (pid {old_pid} -> {props})"
    assert metric(c, "sparkguard_term_below_bytes") == 512 * 1024**2

    reload_as_the_unit_says(c)

    # Remove stops the guard and keeps the configuration; purge removes configuration and state.
    assert c.run("test", "-d", "/var/lib/sparkguard", check=False).returncode == 0
    c.run(*APT, "remove", "sparkguard", timeout=120)
    assert c.show(UNIT, "ActiveState")["ActiveState"] in ("inactive", "failed") or \
        c.show(UNIT, "LoadState")["LoadState"] == "not-found"
    assert c.run("pgrep", "-f", "sparkguard run", check=False).returncode == 1, "a guard still runs"
    assert c.run("test", "-L", DROPIN, check=False).returncode == 1, "remove left the notify-reload link"
    assert c.run("test", "-f", CONFIG, check=False).returncode == 0, "remove deleted the config"
    c.run(*APT, "purge", "sparkguard", timeout=120)
    for path in ("/etc/sparkguard", "/var/lib/sparkguard", "/etc/systemd/system/sparkguard.service.d"):
        assert c.run("test", "-e", path, check=False).returncode == 1, f"{path} left after purge"


def test_lintian_reports_nothing_unexplained(debs):
    """lintian on the built package: every tag is fixed or overridden with a reason
    (debian/sparkguard.lintian-overrides)."""
    if shutil.which("lintian", path=BUILD_PATH) is None:
        pytest.skip("lintian not found (tests/install-deps installs it)")
    deb = debs[0]
    r = subprocess.run(["lintian", "--fail-on", "error,warning", str(deb)], capture_output=True, text=True,
                       timeout=300, env=dict(os.environ, PATH=BUILD_PATH))
    tags = [line for line in r.stdout.splitlines() if re.match(r"^[EWI]: ", line)]
    assert r.returncode == 0 and not tags, f"lintian (rc {r.returncode}):\n{r.stdout}{r.stderr}"


def test_readme_routes_in_the_same_ubuntu_boot(debian):
    """Ubuntu 24.04: the README's first command verbatim, then pipx, in the boot that ran the
    package's life cycle (the package is purged by then; run alone, the machine is fresh)."""
    if nspawn.UBUNTU not in debian.run("cat", "/etc/os-release").stdout:
        pytest.skip("runs on the Ubuntu root only (Debian 12's routes: tests/test_install_routes.py)")
    routes.check_readme_first_command(debian)
    routes.check_pipx_route(debian)


def test_an_unreachable_ubuntu_archive_is_a_reason_not_a_build(tmp_path, monkeypatch):
    """Where the Ubuntu root is not cached and the archive does not answer, base_root raises
    ArchiveUnavailable with the URL (the fixture turns it into a skip) and starts no debootstrap."""
    monkeypatch.setattr(nspawn, "CACHE_DIR", tmp_path)
    monkeypatch.setattr(nspawn, "UBUNTU_MIRROR", "http://127.0.0.1:9/ubuntu")  # discard port: refused
    with pytest.raises(nspawn.ArchiveUnavailable) as e:
        nspawn.base_root(log=lambda m: None, suite=nspawn.UBUNTU)
    if nspawn.UBUNTU_KEYRING.is_file():
        assert "cannot be reached (http://127.0.0.1:9/ubuntu/dists/noble/Release" in str(e.value), e.value
    assert not [*tmp_path.glob("rootfs-*"), *tmp_path.glob(".tmp-*")], list(tmp_path.iterdir())

"""Fixtures for the booted-systemd tests: a cached Debian root, a wheel of the checkout, and
throw-away machines booted with systemd-nspawn (see ``nspawn.py`` for what was found on this host).

Skips (with the reason) only when the tests cannot run here at all: not root, a tool missing,
or systemd-nspawn unable to start a container on this kernel.  A failed debootstrap or wheel
build is an error, not a skip.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest

from . import nspawn

#: Where ``sparkguard install`` puts the config the tests edit.
CONFIG_PATH = "/etc/sparkguard/sparkguard.yaml"


def _log(msg: str) -> None:
    print(f"[system] {msg}", flush=True)


@pytest.fixture(scope="session")
def system_root() -> Path:
    """The cached root (debootstrap + dependency venv); skips where nspawn cannot work."""
    reason = nspawn.unavailable_reason()
    if reason:
        pytest.skip(f"booted-systemd test impossible here: {reason}")
    nspawn.CACHE_DIR.mkdir(parents=True, exist_ok=True)
    reaped = nspawn.reap_stale()
    if reaped:
        _log(f"removed containers left by killed runs: {reaped}")
    root = nspawn.cached_root(log=_log)
    # Can nspawn run a container on this kernel at all?  (e.g. inside an unprivileged
    # container runtime it cannot: that is a skip, with nspawn's own words as the reason.)
    probe = nspawn.Container(root)
    try:
        r = probe.chroot("/bin/true", check=False, timeout=60)
    finally:
        probe.close()
    if r.returncode != 0:
        pytest.skip(f"systemd-nspawn cannot start a container here: {r.stderr.strip()[-500:]}")
    return root


@pytest.fixture(scope="session")
def sparkguard_wheel(tmp_path_factory) -> Path:
    """A wheel built from this checkout (``pip wheel --no-deps``)."""
    return nspawn.build_wheel(tmp_path_factory.mktemp("wheel"))


@pytest.fixture
def machine(system_root, sparkguard_wheel) -> Callable[..., nspawn.Container]:
    """Factory: ``machine(config=YAML, dropins={name: text}) -> Container``, booted.

    Steps, as a user does them: install the wheel into the venv, ``sparkguard install``, edit
    /etc/sparkguard/sparkguard.yaml, add drop-ins for sparkguard.service (only if given),
    ``systemctl enable sparkguard``, then boot.  Every machine made is torn down after the test,
    pass or fail.
    """
    made: list[nspawn.Container] = []

    def make(config: str | None = None, dropins: dict[str, str] | None = None) -> nspawn.Container:
        c = nspawn.Container(system_root)
        made.append(c)
        c.install_wheel(sparkguard_wheel)
        r = c.chroot("sparkguard", "install", check=False)
        assert r.returncode == 0, f"'sparkguard install' failed in the root:\n{r.stdout}\n{r.stderr}"
        if config is not None:
            c.write(CONFIG_PATH, config)
        for name, text in (dropins or {}).items():
            c.write(f"/etc/systemd/system/sparkguard.service.d/{name}", text)
        c.chroot("systemctl", "enable", "sparkguard.service")
        c.boot()
        return c

    yield make
    errors = []
    for c in made:
        try:
            c.close()
        except Exception as e:  # noqa: BLE001 - close the others, then report
            errors.append(f"{c.name}: {e}")
    assert not errors, f"teardown failed: {errors}"

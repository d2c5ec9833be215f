"""Fixtures for the VM tests: the cached image, a wheel of the checkout, and ONE booted VM per session.

The VM boots once (minutes under TCG) and is shared by every test of the session; it is powered off
in a finally, and QEMU is killed by its PID if it does not exit.  Skips, with the reason, only where
the tests cannot run here at all: not root, a tool missing (tests/install-deps installs them), or
QEMU itself refusing to run (its own words).  A failed image build or a guest that does not boot
is an error, not a skip.
"""

from __future__ import annotations

import pytest

from system import nspawn
from . import image, qemu

#: Where the guest's venv is (the README's route: python3 -m venv /opt/sparkguard).
VENV = nspawn.VENV


def _log(msg: str) -> None:
    print(f"[vm] {msg}", flush=True)


@pytest.fixture(scope="session")
def vm_image():
    """The cached image directory (:func:`vm.image.cached_image`); skips where a VM is impossible."""
    reason = qemu.unavailable_reason()
    if reason:
        pytest.skip(f"VM test impossible here: {reason}")
    reaped = qemu.reap_stale()
    if reaped:
        _log(f"removed VMs left by killed runs: {reaped}")
    return image.cached_image(log=_log)


@pytest.fixture(scope="session")
def vm(vm_image, tmp_path_factory):
    """The session's booted VM with sparkguard's wheel installed into /opt/sparkguard (not yet
    ``sparkguard install``-ed: the tests do that, as a user does)."""
    wheel = nspawn.build_wheel(tmp_path_factory.mktemp("vmwheel"))
    machine = qemu.VM(vm_image)
    try:
        try:
            machine.start()
        except qemu.QemuFailed as e:
            pytest.skip(f"QEMU cannot run a VM here: {e}")
        _log(f"booted in {machine.boot_seconds[-1]} s ({machine.accel}, {machine.memory_mib} MiB, "
             f"{machine.cpus} CPUs)")
        machine.put(f"/var/tmp/{wheel.name}", wheel.read_bytes())
        machine.run(f"{VENV}/bin/pip", "install", "--quiet", "--disable-pip-version-check", "--no-index",
                    "--no-deps", f"/var/tmp/{wheel.name}", timeout=300)
        machine.run("rm", "-f", f"/var/tmp/{wheel.name}")
        yield machine
    finally:
        machine.close()
        _log(f"boot times this session: {machine.boot_seconds} s")

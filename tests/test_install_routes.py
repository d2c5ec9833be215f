"""The README's install routes on a fresh Debian 12, in one booted container: its first command
verbatim (a venv at /opt/sparkguard, ``sparkguard install`` linking /usr/local/bin/sparkguard,
``sparkguard run``), then pipx.

Debian 12 and Ubuntu 24.04 refuse ``pip install`` into the system Python (PEP 668,
``error: externally-managed-environment``), hence the venv.  The container has no network (see
tests/system/nspawn.py): ``pip`` gets ``PIP_NO_INDEX=1`` and ``PIP_FIND_LINKS`` naming the wheels
the host downloaded (:func:`nspawn.routes_root`), and apt installs pipx from the root's apt cache;
the command line itself is the README's, read from README.md (tests/system/routes.py, whose steps
the Ubuntu 24.04 case of tests/test_deb.py runs too).
"""

from __future__ import annotations

import pytest

from system import nspawn, routes

pytestmark = pytest.mark.system

SRC = routes.SRC


@pytest.fixture(scope="module")
def fresh_debian(tmp_path_factory):
    """A booted Debian 12 without sparkguard, with the checkout copied to /root/sparkguard."""
    reason = nspawn.unavailable_reason()
    if reason:
        pytest.skip(f"booted-systemd test impossible here: {reason}")
    root = nspawn.routes_root(log=lambda m: print(f"[routes] {m}", flush=True))
    c = nspawn.Container(root)
    try:
        nspawn.copy_checkout(c.root / SRC.lstrip("/"))
        c.boot()
        yield c
    finally:
        c.close()


def test_readme_first_command_works_verbatim_on_debian_12(fresh_debian):
    routes.check_readme_first_command(fresh_debian)


def test_pipx_route(fresh_debian):
    routes.check_pipx_route(fresh_debian)

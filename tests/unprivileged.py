"""Run this checkout's sparkguard as an unprivileged user (uid/gid 65534, "nobody") through setpriv.

pytest's tmp_path is 0700 and a pyenv interpreter may live under /root (0700): the package is copied
to a world-readable folder and the first interpreter that nobody can run with it is used.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from conftest import ROOT

NOBODY = 65534


class Unprivileged:
    """A world-readable copy of the package and an interpreter uid 65534 can run it with.

    Attributes:
        dir: Path, a 0755 folder to put files the unprivileged process must read.
        python: str, the interpreter.
    """

    def __init__(self):
        if os.geteuid() != 0:
            pytest.skip("needs root (to switch to an unprivileged user)")
        if not shutil.which("setpriv"):
            pytest.skip("util-linux setpriv missing")
        self.dir = Path(tempfile.mkdtemp(prefix="sg-nobody-"))
        os.chmod(self.dir, 0o755)
        self.pkg = self.dir / "src"
        shutil.copytree(ROOT / "sparkguard", self.pkg / "sparkguard", ignore=shutil.ignore_patterns("__pycache__"))
        for d, _, files in os.walk(self.pkg):
            os.chmod(d, 0o755)
            for f in files:
                os.chmod(os.path.join(d, f), 0o644)
        self.python = None
        why = ""
        for python in dict.fromkeys((sys.executable, "/usr/bin/python3")):
            r = subprocess.run(self.argv(python, "-c", "import yaml, sparkguard.config"),
                               capture_output=True, text=True, timeout=60)
            if r.returncode == 0:
                self.python = python
                break
            why = r.stderr.strip()[-200:]
        if self.python is None:
            self.close()
            pytest.skip(f"no interpreter an unprivileged user can run sparkguard with: {why}")

    def argv(self, python: str, *args: str) -> list[str]:
        """setpriv ... env PYTHONPATH=<copy> PYTHON ARGS."""
        return ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                "env", f"PYTHONPATH={self.pkg}", "HOME=/tmp", python, *args]

    def sparkguard(self, *args: str) -> list[str]:
        """argv running ``sparkguard ARGS`` as nobody."""
        return self.argv(self.python, "-m", "sparkguard", *args)

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def nobody():
    """An :class:`Unprivileged` (skips unless root with setpriv); its folder is removed afterwards."""
    u = Unprivileged()
    try:
        yield u
    finally:
        u.close()

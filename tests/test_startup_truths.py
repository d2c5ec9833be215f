"""What the daemon says about itself is true: a full incidents.dir is found at start, the journal is
claimed only where journald runs, and ``status`` shows the dry run a ``run --dry-run`` daemon does."""

from __future__ import annotations

import errno
import os
import socket
import subprocess
import tempfile
import urllib.request
import uuid

import pytest

from conftest import run_sparkguard
from guardrun import GuardProc

JOURNAL_SOCKET = "/run/systemd/journal/socket"


def _match_nothing() -> dict:
    return {"match": [f"^sg-truth-{uuid.uuid4().hex}$"]}


@pytest.fixture
def full_tmpfs(root_only):
    """A 256 KiB tmpfs with an ``incidents`` folder, every block then taken; unmounted afterwards."""
    where = tempfile.mkdtemp(prefix="sg-fulltmpfs-")
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k,mode=0755", "tmpfs", where], check=True, timeout=30)
    try:
        os.mkdir(os.path.join(where, "incidents"))
        with open(os.path.join(where, "filler"), "wb", buffering=0) as f:
            try:
                while True:
                    f.write(b"\0" * 4096)
            except OSError as e:
                assert e.errno == errno.ENOSPC, e
        yield where
    finally:
        subprocess.run(["umount", where], check=True, timeout=30)
        os.rmdir(where)


def test_a_full_incident_dir_is_reported_at_start(full_tmpfs):
    d = os.path.join(full_tmpfs, "incidents")
    g = GuardProc({"incidents": {"dir": d, "journal": "off"}, "targets": _match_nothing()})
    try:
        g.wait_ready()
        log = g.wait_log("is not writable")
        assert f"incidents.dir {d} is not writable (No space left on device): incident files will be lost" in log
        assert "incidents go to" not in log
        assert [n for n in os.listdir(d) if n != "blackbox.ring"] == []    # the probe is removed (the black box stays)
    finally:
        assert g.stop() == 0


def test_the_journal_is_not_claimed_where_no_journald_runs():
    if os.path.exists(JOURNAL_SOCKET):
        pytest.skip(f"journald runs here ({JOURNAL_SOCKET} exists)")
    g = GuardProc({"incidents": {"journal": "auto"}, "targets": _match_nothing()})
    try:
        g.wait_ready()
        log = g.wait_log("incidents go to")
        d = g.cfg["incidents"]["dir"]
        assert f"incidents go to {d} (incidents.journal auto, but no journald socket at {JOURNAL_SOCKET})" in log
        assert "and the journal" not in log
    finally:
        assert g.stop() == 0


def test_status_of_a_daemon_run_with_dry_run_says_it_signals_nothing():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    g = GuardProc({"guard": {"dry_run": False}, "metrics": {"listen": f"127.0.0.1:{port}"},
                   "targets": _match_nothing()}, extra_args=("--dry-run",))
    try:
        g.wait_ready()
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            metrics = r.read().decode()
        assert "\nsparkguard_dry_run 1.0\n" in metrics
        # what the guard sees in /proc (doctor reads it); as root here it reads every process
        seen = dict(ln.split() for ln in metrics.splitlines() if ln.startswith("sparkguard_visible_"))
        assert float(seen["sparkguard_visible_processes"]) >= 2, seen
        assert "sparkguard_visible_other_user_processes" in seen, seen
        r = run_sparkguard("status", "--config", g.config_path)
        assert r.returncode == 0, r.stderr
        assert "[DRY RUN: signals nothing]" in r.stdout
        assert "dry_run yes in the running daemon (the config file says no)" in r.stdout, r.stdout
        assert "dry_run no " not in r.stdout
    finally:
        assert g.stop() == 0

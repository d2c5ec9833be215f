"""sparkguard install / uninstall into a temporary root, checked with systemd-analyze verify."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from importlib import resources
from pathlib import Path

import pytest

from conftest import ROOT, run_sparkguard

UNITS = ["sparkguard.service", "sparkguard-setup.service"]
EXPECTED = {
    "etc/systemd/system/sparkguard.service",
    "etc/systemd/system/sparkguard-setup.service",
    "etc/sysctl.d/99-zz-sparkguard.conf",
    "etc/sparkguard/zram.conf",
    "etc/sparkguard/sparkguard.yaml",
    "var/lib/sparkguard/installed.json",
}


def tree(root: Path) -> dict[str, str]:
    """Every file under root: {relative path: text}."""
    return {str(p.relative_to(root)): p.read_text(errors="replace") for p in sorted(root.rglob("*")) if p.is_file()}


def verify(unit_dir: Path) -> subprocess.CompletedProcess:
    """systemd-analyze verify of our units, found through SYSTEMD_UNIT_PATH (systemd.unit(5))."""
    exe = shutil.which("systemd-analyze")
    if not exe:
        pytest.fail("systemd-analyze missing: tests/install-deps installs the systemd package")
    env = dict(os.environ, SYSTEMD_UNIT_PATH=f"{unit_dir}:", SYSTEMD_LOG_LEVEL="notice")
    return subprocess.run([exe, "verify", *UNITS], env=env, capture_output=True, text=True, timeout=120)


def test_install_into_a_root_gives_exactly_the_tree_and_units_verify(tmp_path):
    r = run_sparkguard("install", "--root", str(tmp_path))
    assert r.returncode == 0, r.stderr
    files = tree(tmp_path)
    assert set(files) == EXPECTED
    for f in EXPECTED - {"var/lib/sparkguard/installed.json"}:
        assert f"created       /{f}" in r.stdout
    assert "systemctl enable" in r.stdout

    unit = files["etc/systemd/system/sparkguard.service"]
    assert f"ExecStart={sys.executable} -m sparkguard run --config /etc/sparkguard/sparkguard.yaml" in unit
    for line in ("Type=notify", "NotifyAccess=main", "WatchdogSec=5s", "Restart=always", "OOMScoreAdjust=-1000",
                 "ExecReload=/bin/kill -HUP $MAINPID", "LimitMEMLOCK=infinity", "Nice=-20"):
        assert line + "\n" in unit, line
    settings = [ln for ln in unit.splitlines() if ln and not ln.startswith("#")]
    assert not [ln for ln in settings if ln.startswith(("PrivateNetwork=", "SystemCallFilter=", "User=",
                                                         "DynamicUser=", "MemoryDenyWriteExecute="))]
    caps = next(ln for ln in unit.splitlines() if ln.startswith("CapabilityBoundingSet=")).split("=", 1)[1].split()
    assert {"CAP_KILL", "CAP_IPC_LOCK", "CAP_SYS_RESOURCE", "CAP_SYS_PTRACE"} <= set(caps)
    assert "@" not in unit.replace("systemd-zram-setup@", "")  # every placeholder filled in
    setup = files["etc/systemd/system/sparkguard-setup.service"]
    assert "Before=sparkguard.service" in setup and "install-zram --boot" in setup and "tune --boot" in setup

    p = verify(tmp_path / "etc/systemd/system")
    assert p.returncode == 0, p.stderr
    assert p.stderr.strip() == "" and p.stdout.strip() == "", p.stderr + p.stdout  # no warnings either

    # the default configuration is exactly the built-in defaults
    from sparkguard import config
    cfg = config.load(str(tmp_path / "etc/sparkguard/sparkguard.yaml"))
    assert dataclasses.replace(cfg, path="<defaults>") == config.Config()
    assert files["etc/sparkguard/sparkguard.yaml"].lstrip().startswith("#")

    sysctl_text = files["etc/sysctl.d/99-zz-sparkguard.conf"]
    assert "vm.swappiness = 180" in sysctl_text and "vm.watermark_scale_factor = 100" in sysctl_text
    zram_text = files["etc/sparkguard/zram.conf"]
    assert "size = 6GiB" in zram_text and "priority = 100" in zram_text
    manifest = json.loads(files["var/lib/sparkguard/installed.json"])
    assert set(manifest["files"]) == {"/" + f for f in EXPECTED - {"var/lib/sparkguard/installed.json",
                                                                    "etc/sparkguard/zram.conf"}}

    # second run: nothing changes, byte for byte
    mtimes = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*") if p.is_file()}
    r2 = run_sparkguard("install", "--root", str(tmp_path))
    assert r2.returncode == 0, r2.stderr
    assert "no changes" in r2.stdout and "created" not in r2.stdout and "updated" not in r2.stdout
    assert tree(tmp_path) == files
    assert {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*") if p.is_file()
            if p.name != "installed.json"} == {p: m for p, m in mtimes.items() if p.name != "installed.json"}


def test_python_option_and_missing_root(tmp_path):
    r = run_sparkguard("install", "--root", str(tmp_path), "--python", "/usr/bin/python3")
    assert r.returncode == 0, r.stderr
    unit = (tmp_path / "etc/systemd/system/sparkguard.service").read_text()
    assert "ExecStart=/usr/bin/python3 -m sparkguard run" in unit and "PYTHONPATH" not in unit
    r = run_sparkguard("install", "--root", str(tmp_path / "nope"))
    assert r.returncode == 2 and "no such folder" in r.stderr
    r = run_sparkguard("install", "--root", str(tmp_path), "--python", "python3")
    assert r.returncode == 2 and "absolute" in r.stderr


def test_edited_files_are_kept_and_uninstall_reverses_the_rest(tmp_path):
    assert run_sparkguard("install", "--root", str(tmp_path)).returncode == 0
    cfg = tmp_path / "etc/sparkguard/sparkguard.yaml"
    edited = cfg.read_text().replace("grace: 10s", "grace: 20s")
    cfg.write_text(edited)
    incident = tmp_path / "var/lib/sparkguard/incidents/20250101T000000Z-abcdef.json"
    incident.parent.mkdir(parents=True)
    incident.write_text("{}\n")

    r = run_sparkguard("install", "--root", str(tmp_path))
    assert r.returncode == 0
    assert "kept          /etc/sparkguard/sparkguard.yaml" in r.stdout
    assert cfg.read_text() == edited

    r = run_sparkguard("uninstall", "--root", str(tmp_path))
    assert r.returncode == 0, r.stderr
    left = set(tree(tmp_path))
    assert left == {"etc/sparkguard/sparkguard.yaml", str(incident.relative_to(tmp_path))}
    assert "kept" in r.stdout and "--purge" in r.stdout

    r = run_sparkguard("uninstall", "--root", str(tmp_path))
    assert r.returncode == 0 and "no changes" in r.stdout

    r = run_sparkguard("uninstall", "--purge", "--root", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert tree(tmp_path) == {}
    assert not (tmp_path / "var/lib/sparkguard").exists() and not (tmp_path / "etc/sparkguard").exists()


def test_unedited_install_uninstalls_to_nothing(tmp_path):
    assert run_sparkguard("install", "--root", str(tmp_path)).returncode == 0
    r = run_sparkguard("uninstall", "--root", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert tree(tmp_path) == {}


def test_dry_run_writes_nothing(tmp_path):
    r = run_sparkguard("install", "--root", str(tmp_path), "--dry-run")
    assert r.returncode == 0, r.stderr
    assert "would create  /etc/systemd/system/sparkguard.service" in r.stdout
    assert list(tmp_path.iterdir()) == []
    assert run_sparkguard("install", "--root", str(tmp_path)).returncode == 0
    before = tree(tmp_path)
    r = run_sparkguard("uninstall", "--root", str(tmp_path), "--dry-run", "--purge")
    assert r.returncode == 0 and "would remove" in r.stdout
    assert tree(tmp_path) == before


def test_generator_root_gets_the_generator_config_not_ours(tmp_path):
    gen = tmp_path / "usr/lib/systemd/system-generators/zram-generator"
    gen.parent.mkdir(parents=True)
    real = next((p for p in ("/usr/lib/systemd/system-generators/zram-generator",
                             "/lib/systemd/system-generators/zram-generator") if os.path.exists(p)), None)
    if real is None:
        pytest.skip("systemd-zram-generator is not installed (tests/install-deps installs it)")
    shutil.copy2(real, gen)
    r = run_sparkguard("install", "--root", str(tmp_path), "--zram-size", "8GiB")
    assert r.returncode == 0, r.stderr
    files = tree(tmp_path)
    assert "etc/sparkguard/zram.conf" not in files
    assert "zram-size = 8192" in files["etc/systemd/zram-generator.conf"]
    assert run_sparkguard("uninstall", "--root", str(tmp_path)).returncode == 0
    assert set(tree(tmp_path)) == {"usr/lib/systemd/system-generators/zram-generator"}


def _shipped(res: str) -> bool:
    return resources.files("sparkguard").joinpath("data", *res.split("/")).is_file()


@pytest.mark.parametrize("option,res,name", [
    ("--prometheus-rules", "prometheus/sparkguard-rules.yml", "sparkguard-rules.yml"),
    ("--grafana-dashboard", "grafana/sparkguard-dashboard.json", "sparkguard-dashboard.json"),
])
def test_monitoring_files_are_copied_or_clearly_missing(tmp_path, option, res, name):
    r = run_sparkguard("install", "--root", str(tmp_path), option, "/etc/monitoring/x")
    if _shipped(res):
        assert r.returncode == 0, r.stderr
        dest = tmp_path / "etc/monitoring/x" / name
        assert dest.read_bytes() == resources.files("sparkguard").joinpath("data", *res.split("/")).read_bytes()
        assert run_sparkguard("uninstall", "--root", str(tmp_path)).returncode == 0
        assert not dest.exists()
    else:
        assert r.returncode == 1
        assert f"sparkguard/data/{res}" in r.stderr
        assert list(tmp_path.iterdir()) == []  # checked before anything was written


def test_shipped_package_data_is_the_top_level_files():
    for rel in ("systemd/sparkguard.service", "systemd/sparkguard-setup.service",
                "sysctl.d/99-zz-sparkguard.conf", "zram/sparkguard-zram.conf", "zram/zram-generator.conf"):
        data = resources.files("sparkguard").joinpath("data", "host", *rel.split("/")).read_text()
        assert data == (ROOT / rel).read_text(), rel

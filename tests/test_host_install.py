"""sparkguard install / uninstall into a temporary root, checked with systemd-analyze verify."""

from __future__ import annotations

import dataclasses
import json
import os
import re
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
    "usr/local/lib/systemd/catalog/sparkguard.catalog",
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
    assert f"ExecReload={sys.executable} -m sparkguard reload --pid $MAINPID --timeout 20\n" in unit
    for line in ("Type=notify", "NotifyAccess=main", "WatchdogSec=5s", "Restart=always", "OOMScoreAdjust=-1000",
                 "LimitMEMLOCK=infinity", "Nice=-20"):
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
    manifest = json.loads(files["var/lib/sparkguard/installed.json"])  # every file install wrote
    assert set(manifest["files"]) == {"/" + f for f in EXPECTED - {"var/lib/sparkguard/installed.json"}}

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
    r = run_sparkguard("install", "--root", str(tmp_path), "--python", "python3")
    assert r.returncode == 2 and "absolute" in r.stderr
    r = run_sparkguard("uninstall", "--root", str(tmp_path / "nope"))
    assert r.returncode == 2 and "no such folder" in r.stderr


def test_a_missing_root_is_created_and_said_so(tmp_path):
    root = tmp_path / "new" / "root"
    r = run_sparkguard("install", "--root", str(root), "--dry-run")
    assert r.returncode == 0, r.stderr
    assert f"would create  {root}/" in r.stdout and not (tmp_path / "new").exists()
    r = run_sparkguard("install", "--root", str(root))
    assert r.returncode == 0, r.stderr
    assert f"created       {root}/" in r.stdout
    assert set(tree(root)) == EXPECTED
    (tmp_path / "afile").write_text("")
    r = run_sparkguard("install", "--root", str(tmp_path / "afile"))
    assert r.returncode == 2 and "not a folder" in r.stderr


def test_misspelled_option_shows_the_sub_command_usage():
    r = run_sparkguard("install", "--forec")
    assert r.returncode == 2
    assert r.stderr.startswith("usage: sparkguard install "), r.stderr
    assert "--forec" in r.stderr and "did you mean --force?" in r.stderr
    r = run_sparkguard("tune", "--swapiness", "60")
    assert r.returncode == 2 and r.stderr.startswith("usage: sparkguard tune "), r.stderr
    assert "did you mean --swappiness?" in r.stderr


def test_force_replaces_edited_files_but_never_the_config(tmp_path):
    assert run_sparkguard("install", "--root", str(tmp_path)).returncode == 0
    fresh = tree(tmp_path)
    edited = {}
    for f in ("etc/systemd/system/sparkguard.service", "etc/sysctl.d/99-zz-sparkguard.conf",
              "etc/sparkguard/zram.conf", "etc/sparkguard/sparkguard.yaml"):
        edited[f] = fresh[f].replace("100", "101", 1) + "# edited by the operator\n"
        (tmp_path / f).write_text(edited[f])

    r = run_sparkguard("install", "--root", str(tmp_path))
    assert r.returncode == 0, r.stderr
    for f in edited:
        assert f"kept          /{f}  (" in r.stdout, f
        assert (tmp_path / f).read_text() == edited[f]
    assert "zram configured otherwise" not in r.stdout  # install wrote zram.conf: it knows it
    assert "--force writes the new default beside it as sparkguard.yaml.dist" in r.stdout

    r = run_sparkguard("install", "--root", str(tmp_path), "--force")
    assert r.returncode == 0, r.stderr
    for f in ("etc/systemd/system/sparkguard.service", "etc/sysctl.d/99-zz-sparkguard.conf",
              "etc/sparkguard/zram.conf"):
        assert f"updated       /{f}" in r.stdout
        assert (tmp_path / f).read_text() == fresh[f]
    cfg = "etc/sparkguard/sparkguard.yaml"
    assert (tmp_path / cfg).read_text() == edited[cfg]  # the user's config: never replaced
    assert f"kept          /{cfg}" in r.stdout
    assert "created       /etc/sparkguard/sparkguard.yaml.dist" in r.stdout
    assert (tmp_path / "etc/sparkguard/sparkguard.yaml.dist").read_text() == fresh[cfg]
    manifest = json.loads((tmp_path / "var/lib/sparkguard/installed.json").read_text())
    assert "/etc/sparkguard/sparkguard.yaml.dist" in manifest["files"]

    r = run_sparkguard("install", "--root", str(tmp_path), "--force")
    assert r.returncode == 0 and "no changes" in r.stdout, r.stdout

    # uninstall: everything sparkguard wrote goes (the .dist too), the edited config stays
    r = run_sparkguard("uninstall", "--root", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert set(tree(tmp_path)) == {cfg}
    assert f"kept          /{cfg}" in r.stdout


def test_zram_conf_goes_through_the_manifest_like_every_file(tmp_path):
    conf = tmp_path / "etc/sparkguard/zram.conf"
    assert run_sparkguard("install", "--root", str(tmp_path)).returncode == 0
    conf.write_text(conf.read_text().replace("size = 6GiB", "size = 7GiB"))
    r = run_sparkguard("install", "--root", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert "kept          /etc/sparkguard/zram.conf  (changed since sparkguard wrote it; --force replaces it)" \
        in r.stdout
    r = run_sparkguard("uninstall", "--root", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert "kept          /etc/sparkguard/zram.conf  (changed since sparkguard wrote it; --purge removes it)" \
        in r.stdout
    assert "size = 7GiB" in conf.read_text()
    r = run_sparkguard("uninstall", "--root", str(tmp_path), "--purge")
    assert r.returncode == 0 and "removed       /etc/sparkguard/zram.conf" in r.stdout
    assert tree(tmp_path) == {}


def test_files_changed_by_tune_and_install_zram_stay_sparkguards(tmp_path):
    """tune and install-zram write the files install wrote: a re-run of install keeps their values
    without calling them edited, and uninstall removes them."""
    assert run_sparkguard("install", "--root", str(tmp_path)).returncode == 0
    r = run_sparkguard("install-zram", "--no-now", "--size", "8GiB", "--priority", "90", "--root", str(tmp_path))
    assert r.returncode == 0, r.stderr
    r = run_sparkguard("tune", "--no-apply", "--swappiness", "60", "--root", str(tmp_path))
    assert r.returncode == 0, r.stderr
    before = tree(tmp_path)
    assert "size = 8GiB" in before["etc/sparkguard/zram.conf"]
    assert "vm.swappiness = 60" in before["etc/sysctl.d/99-zz-sparkguard.conf"]

    r = run_sparkguard("install", "--root", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert "no changes" in r.stdout and "kept" not in r.stdout, r.stdout
    assert tree(tmp_path) == before

    r = run_sparkguard("install", "--root", str(tmp_path), "--zram-size", "4GiB")
    assert r.returncode == 0 and "updated       /etc/sparkguard/zram.conf" in r.stdout
    conf = (tmp_path / "etc/sparkguard/zram.conf").read_text()
    assert "size = 4GiB" in conf and "priority = 90" in conf  # only the option given changes

    r = run_sparkguard("uninstall", "--root", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert tree(tmp_path) == {} and "kept" not in r.stdout, r.stdout


def test_edited_files_are_kept_and_uninstall_reverses_the_rest(tmp_path):
    assert run_sparkguard("install", "--root", str(tmp_path)).returncode == 0
    cfg = tmp_path / "etc/sparkguard/sparkguard.yaml"
    edited, n = re.subn(r"(?m)^  grace: .*$", "  grace: 20s", cfg.read_text())
    assert n == 1 and edited != cfg.read_text()  # whatever the default grace is, this is an edit
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
        # DIR is the target's, under --root like every file, and the line says where it really went
        assert f"created       /etc/monitoring/x/{name}  (written to {dest}: under --root like every file)" \
            in r.stdout, r.stdout
        assert f"installing under --root {tmp_path}: the paths below are the installed system's" in r.stdout
        assert not os.path.exists(f"/etc/monitoring/x/{name}")
        dest.write_text(dest.read_text() + "\n# local edit\n")
        again = run_sparkguard("install", "--root", str(tmp_path), option, "/etc/monitoring/x/")
        assert again.returncode == 0, again.stderr
        assert f"kept          /etc/monitoring/x/{name}  (changed since sparkguard wrote it; --force replaces it; " \
               f"it is {dest})" in again.stdout, again.stdout
        assert run_sparkguard("uninstall", "--root", str(tmp_path), "--purge").returncode == 0
        assert not dest.exists()
    else:
        assert r.returncode == 1
        assert f"sparkguard/data/{res}" in r.stderr
        assert list(tmp_path.iterdir()) == []  # checked before anything was written


def test_shipped_package_data_is_the_top_level_files():
    for rel in ("systemd/sparkguard.service", "systemd/sparkguard-setup.service", "systemd/sparkguard.service.d/engine.conf",
                "sysctl.d/99-zz-sparkguard.conf", "zram/sparkguard-zram.conf", "zram/zram-generator.conf"):
        data = resources.files("sparkguard").joinpath("data", "host", *rel.split("/")).read_text()
        assert data == (ROOT / rel).read_text(), rel


ENGINE_DROPIN = "etc/systemd/system/sparkguard.service.d/engine.conf"
ENGINE_COMMAND = "  command: [/usr/bin/vllm, serve, sgtest-model]\n"


def security(root: Path) -> dict[str, dict]:
    """``systemd-analyze security --offline`` of the installed sparkguard.service with its drop-ins
    merged by systemd itself: ``{setting name: {"set", "description", ...}}``."""
    exe = shutil.which("systemd-analyze")
    if not exe:
        pytest.fail("systemd-analyze missing: tests/install-deps installs the systemd package")
    p = subprocess.run([exe, "security", "--offline=yes", f"--root={root}", "--json=short", "sparkguard.service"],
                       env=dict(os.environ, SYSTEMD_LOG_LEVEL="notice"), capture_output=True, text=True, timeout=120)
    assert p.stdout.startswith("["), p.stderr + p.stdout
    return {e["name"]: e for e in json.loads(p.stdout)}


def test_engine_config_installs_the_sandbox_drop_in_and_systemd_merges_it(tmp_path):
    guard_only, engine = tmp_path / "guard", tmp_path / "engine"
    r = run_sparkguard("install", "--root", str(guard_only))
    assert r.returncode == 0 and "engine.conf" not in r.stdout
    assert not (guard_only / ENGINE_DROPIN).exists()
    # the rendered defaults have an engine: section whose command is null: guard-only
    text = (guard_only / "etc/sparkguard/sparkguard.yaml").read_text()
    assert "\nengine:\n" in text and text.count("  command: null\n") == 1

    assert run_sparkguard("install", "--root", str(engine)).returncode == 0
    cfg = engine / "etc/sparkguard/sparkguard.yaml"
    cfg.write_text(text.replace("  command: null\n", ENGINE_COMMAND))
    from sparkguard import config
    assert config.load(str(cfg)).engine.command  # what the daemon will read: a valid engine config
    r = run_sparkguard("install", "--root", str(engine))
    assert r.returncode == 0, r.stderr
    assert f"created       /{ENGINE_DROPIN}  (engine.command is set in /etc/sparkguard/sparkguard.yaml" in r.stdout
    assert (engine / ENGINE_DROPIN).read_text() == (ROOT / "systemd/sparkguard.service.d/engine.conf").read_text()
    manifest = json.loads((engine / "var/lib/sparkguard/installed.json").read_text())
    assert "/" + ENGINE_DROPIN in manifest["files"]
    p = verify(engine / "etc/systemd/system")  # reads sparkguard.service.d/ too
    assert p.returncode == 0 and p.stderr.strip() == "" and p.stdout.strip() == "", p.stderr + p.stdout

    # systemd's own reading of the merged unit: the drop-in relaxes exactly what it says
    before, after = security(guard_only), security(engine)
    changed = {k for k in before if before[k]["set"] != after[k]["set"] or
               before[k]["description"] != after[k]["description"]}
    assert changed == {"ProtectSystem=", "ProtectHome=", "CapabilityBoundingSet=~CAP_NET_(BIND_SERVICE|BROADCAST|RAW)",
                       "CapabilityBoundingSet=~CAP_(CHOWN|FSETID|SETFCAP)"}, changed
    assert "strict read-only" in before["ProtectSystem="]["description"]
    assert "very limited write access" in after["ProtectSystem="]["description"]  # =full: /usr, /etc read-only
    assert "full access to home" in after["ProtectHome="]["description"]
    assert after["CapabilityBoundingSet=~CAP_(DAC_*|FOWNER|IPC_OWNER)"]["set"] is False
    for kept in ("CapabilityBoundingSet=~CAP_SYS_ADMIN", "CapabilityBoundingSet=~CAP_SYS_MODULE",
                 "ProtectKernelModules=", "ProtectKernelTunables=", "ProtectControlGroups="):
        assert after[kept]["set"] is True, kept

    r = run_sparkguard("install", "--root", str(engine))
    assert r.returncode == 0 and ENGINE_DROPIN not in r.stdout and "no changes" in r.stdout, r.stdout
    r = run_sparkguard("uninstall", "--root", str(engine))
    assert r.returncode == 0 and f"removed       /{ENGINE_DROPIN}" in r.stdout
    assert not (engine / "etc/systemd/system/sparkguard.service.d").exists()


def test_engine_sandbox_options_and_uninstall_keeps_other_drop_ins(tmp_path):
    r = run_sparkguard("install", "--root", str(tmp_path), "--engine-sandbox")
    assert r.returncode == 0 and f"created       /{ENGINE_DROPIN}  (--engine-sandbox" in r.stdout
    # no engine in the config: a later plain install leaves the choice alone and says how to undo it
    r = run_sparkguard("install", "--root", str(tmp_path))
    assert r.returncode == 0 and f"kept          /{ENGINE_DROPIN}" in r.stdout and "--no-engine-sandbox" in r.stdout
    assert "no changes" in r.stdout
    r = run_sparkguard("install", "--root", str(tmp_path), "--no-engine-sandbox")
    assert r.returncode == 0 and f"removed       /{ENGINE_DROPIN}" in r.stdout
    assert not (tmp_path / "etc/systemd/system/sparkguard.service.d").exists()
    r = run_sparkguard("install", "--root", str(tmp_path), "--engine-sandbox", "--no-engine-sandbox")
    assert r.returncode == 2 and r.stderr.startswith("usage: sparkguard install")

    assert run_sparkguard("install", "--root", str(tmp_path), "--engine-sandbox").returncode == 0
    mine = tmp_path / "etc/systemd/system/sparkguard.service.d/override.conf"
    mine.write_text("[Service]\nEnvironment=FOO=1\n")
    r = run_sparkguard("uninstall", "--root", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert f"removed       /{ENGINE_DROPIN}" in r.stdout
    assert "kept          /etc/systemd/system/sparkguard.service.d/override.conf" in r.stdout
    assert set(tree(tmp_path)) == {"etc/systemd/system/sparkguard.service.d/override.conf"}

"""sparkguard install's report: the journal catalog, a re-run that prints only changes, --dry-run's
diff, and the /usr/local/bin/sparkguard link of a venv install (sparkguard/host/pathlink.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib import resources
from pathlib import Path

import pytest

from conftest import run_sparkguard
from sparkguard.host import pathlink
from sparkguard.host.files import Changes, Manifest

CATALOG = "usr/local/lib/systemd/catalog/sparkguard.catalog"
SERVICE = "/etc/systemd/system/sparkguard.service"


def shipped_catalog() -> str:
    return resources.files("sparkguard").joinpath("data", "catalog", "sparkguard.catalog").read_text()


def test_catalog_is_installed_and_journalctl_can_read_it(tmp_path):
    r = run_sparkguard("install", "--root", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert f"created       /{CATALOG}" in r.stdout
    assert (tmp_path / CATALOG).read_text() == shipped_catalog()
    # journalctl --root compiles the catalog of that root (journalctl(1), --update-catalog with --root)
    db = tmp_path / "var/lib/systemd/catalog/database"
    p = subprocess.run(["journalctl", "--root", str(tmp_path), "--update-catalog"], capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert db.is_file() and db.stat().st_size > 0
    listed = subprocess.run(["journalctl", "--root", str(tmp_path), "--list-catalog"], capture_output=True,
                            text=True, timeout=60).stdout
    assert "664d84b2b89942f2ac3a8c34e6254450" in listed.replace("-", ""), listed
    db.unlink()
    r = run_sparkguard("uninstall", "--root", str(tmp_path))
    assert r.returncode == 0 and f"removed       /{CATALOG}" in r.stdout
    assert not (tmp_path / CATALOG).exists()


def test_a_rerun_prints_only_what_changed(tmp_path):
    assert run_sparkguard("install", "--root", str(tmp_path)).returncode == 0
    r = run_sparkguard("install", "--root", str(tmp_path))
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in r.stdout.splitlines() if not ln.startswith(("installing under --root", "note: "))]
    assert lines[0].startswith("no changes: everything was already in place ("), r.stdout
    assert "unchanged" in lines[0] and len(lines) == 2 and lines[1].startswith("next, inside"), r.stdout

    unit = tmp_path / SERVICE.lstrip("/")
    unit.write_text(unit.read_text() + "# edited\n")
    r = run_sparkguard("install", "--root", str(tmp_path), "--force")
    changed = [ln for ln in r.stdout.splitlines() if ln.startswith(("created", "updated", "kept", "unchanged"))]
    assert changed == [f"updated       {SERVICE}"], r.stdout


def test_dry_run_prints_the_diff_of_each_file_it_would_change(tmp_path):
    assert run_sparkguard("install", "--root", str(tmp_path)).returncode == 0
    unit = tmp_path / SERVICE.lstrip("/")
    unit.write_text(unit.read_text().replace("Nice=-20\n", "Nice=-5\n"))
    (tmp_path / CATALOG).unlink()
    before = unit.read_text()
    r = run_sparkguard("install", "--root", str(tmp_path), "--dry-run", "--force")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert f"would update  {SERVICE}\n--- a{SERVICE}\n+++ b{SERVICE}\n" in out, out
    assert "\n-Nice=-5\n+Nice=-20\n" in out
    assert f"would create  /{CATALOG}" in out and f"--- /dev/null\n+++ b/{CATALOG}\n" in out
    assert "".join(f"+{ln}\n" for ln in shipped_catalog().splitlines()[:3]) in out
    assert "sparkguard.yaml\n---" not in out  # unchanged files get no diff
    assert unit.read_text() == before and not (tmp_path / CATALOG).exists()
    # the printed diff is a patch: applied to the root it gives what install would write
    patch = subprocess.run(["patch", "-p1", "-d", str(tmp_path), "--dry-run"], input=out, text=True,
                           capture_output=True, timeout=60)
    if patch.returncode == 127 or "not found" in patch.stderr:
        pytest.skip("patch(1) missing")
    assert patch.returncode == 0, patch.stdout + patch.stderr


def venv(tmp_path: Path) -> str:
    """A real venv (no pip) with an executable ``bin/sparkguard``; returns that script."""
    d = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(d)], check=True, timeout=120)
    script = d / "bin/sparkguard"
    script.write_text(f"#!{d}/bin/python\nimport sys\nfrom sparkguard.cli import main\nsys.exit(main())\n")
    script.chmod(0o755)
    return str(script)


def test_venv_script_is_linked_on_path_and_unlinked(tmp_path):
    script = venv(tmp_path)
    assert pathlink.venv_script(str(tmp_path / "venv/bin/python3")) == script
    assert pathlink.venv_script("/usr/bin/python3") is None  # the .deb's: on PATH already
    root = tmp_path / "root"
    root.mkdir()
    m = Manifest(str(root))
    ch = Changes()
    assert pathlink.ensure(ch, str(root), script, m) == "created"
    link = root / "usr/local/bin/sparkguard"
    assert os.readlink(link) == script and pathlink.LINK in m.files
    assert pathlink.ensure(Changes(), str(root), script, m) == "unchanged"
    # the link runs the venv's sparkguard
    assert pathlink.remove(Changes(dry_run=True), str(root), Manifest(str(root))) is False  # no record saved
    assert pathlink.remove(ch, str(root), m) is True
    assert not os.path.lexists(link) and pathlink.LINK not in m.files


def test_a_foreign_file_or_pipx_link_is_never_replaced_nor_removed(tmp_path):
    script = venv(tmp_path)
    root = tmp_path / "root"
    link = root / "usr/local/bin/sparkguard"
    link.parent.mkdir(parents=True)
    link.write_text("#!/bin/sh\necho someone else's\n")
    m = Manifest(str(root))
    out = tmp_path / "out.txt"
    with open(out, "w") as f:
        assert pathlink.ensure(Changes(out=f), str(root), script, m) == "kept"
    assert "kept          /usr/local/bin/sparkguard  (not sparkguard's link" in out.read_text()
    assert link.read_text().startswith("#!/bin/sh") and pathlink.LINK not in m.files
    assert pathlink.remove(Changes(), str(root), m) is False and link.exists()

    link.unlink()
    link.symlink_to(script)  # pipx's own link (PIPX_BIN_DIR=/usr/local/bin) to the same script
    assert pathlink.ensure(Changes(), str(root), script, m) == "unchanged"
    assert pathlink.LINK not in m.files
    assert pathlink.remove(Changes(), str(root), m) is False and os.path.islink(link)

    # our link, replaced by someone since: kept by both
    link.unlink()
    assert pathlink.ensure(Changes(), str(root), script, m) == "created"
    link.unlink()
    link.symlink_to("/bin/true")
    assert pathlink.ensure(Changes(), str(root), script, m) == "kept"
    assert pathlink.remove(Changes(), str(root), m) is False and os.readlink(link) == "/bin/true"


def test_man_page_and_completion_are_written_and_removed_with_the_rest(tmp_path):
    pytest.importorskip("argparse_manpage", reason="argparse-manpage missing: pip install '.[man]'")
    pytest.importorskip("shtab", reason="shtab missing: pip install '.[man]'")
    from sparkguard.host import install
    from sparkguard import docgen

    m = Manifest(str(tmp_path))
    paths = (install.MAN_PATH, install.BASH_COMPLETION)
    assert install.install_generated(Changes(), str(tmp_path), m, force=False) == dict.fromkeys(paths, "created")
    page = tmp_path / install.MAN_PATH.lstrip("/")
    completion = tmp_path / install.BASH_COMPLETION.lstrip("/")
    assert page.read_text() == docgen.manpage() and completion.read_text() == docgen.completion("bash")
    assert set(paths) <= set(m.files)
    assert install.install_generated(Changes(), str(tmp_path), m, force=False) == dict.fromkeys(paths, "unchanged")
    m.save("test")
    r = run_sparkguard("uninstall", "--root", str(tmp_path))
    assert r.returncode == 0 and all(f"removed       {p}" in r.stdout for p in paths), r.stdout
    assert not page.exists() and not completion.exists()

"""sparkguard tune against the real kernel: real sysctl writes, every one restored after."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import run_sparkguard, sg_env

KEYS = {"vm.swappiness": "/proc/sys/vm/swappiness",
        "vm.watermark_scale_factor": "/proc/sys/vm/watermark_scale_factor",
        "vm.page-cluster": "/proc/sys/vm/page-cluster"}
FILE = "etc/sysctl.d/99-zz-sparkguard.conf"


def live(key: str) -> int:
    return int(Path(KEYS[key]).read_text())


#: held while a test changes sysctls, so that two runs of this suite at once (other engineers
#: run it too) cannot save each other's values as "the original" and restore the wrong one
LOCK = "/run/lock/sparkguard-tests-sysctl.lock" if os.path.isdir("/run/lock") else "/tmp/sparkguard-tests-sysctl.lock"


@pytest.fixture
def restore_sysctls(root_only):
    """Remember the three sysctls tune touches and put them back afterwards (under LOCK)."""
    with open(LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # blocks until the other run has restored its values
        saved = {k: Path(p).read_text().strip() for k, p in KEYS.items()}
        try:
            yield saved
        finally:
            for k, v in saved.items():
                Path(KEYS[k]).write_text(v + "\n")


def zram_or_zswap_active() -> bool:
    with open("/proc/swaps") as f:
        if any(line.split()[0].rsplit("/", 1)[-1].startswith("zram") for line in f.read().splitlines()[1:]):
            return True
    try:
        return Path("/sys/module/zswap/parameters/enabled").read_text().strip() in ("Y", "1")
    except OSError:
        return False


def test_watermark_above_200_is_refused_with_the_reason(restore_sysctls, tmp_path):
    before = live("vm.watermark_scale_factor")
    r = run_sparkguard("tune", "--watermark-scale-factor", "500", "--root", str(tmp_path))
    assert r.returncode == 2
    assert "refused" in r.stdout and "vm.watermark_scale_factor = 500" in r.stdout
    assert "MemAvailable" in r.stdout and "leak" in r.stdout and "--force" in r.stdout
    assert live("vm.watermark_scale_factor") == before
    assert not (tmp_path / FILE).exists()


def test_high_swappiness_without_zram_is_refused(restore_sysctls, tmp_path):
    if zram_or_zswap_active():
        pytest.skip("a zram or zswap swap is active on this machine right now (another test?)")
    before = live("vm.swappiness")
    r = run_sparkguard("tune", "--swappiness", "180", "--root", str(tmp_path))
    assert r.returncode == 2
    assert "vm.swappiness = 180" in r.stdout and "zram" in r.stdout and "disk" in r.stdout
    assert live("vm.swappiness") == before
    assert not (tmp_path / FILE).exists()


def test_out_of_range_is_refused_even_with_force(restore_sysctls, tmp_path):
    r = run_sparkguard("tune", "--swappiness", "201", "--force", "--root", str(tmp_path))
    assert r.returncode == 2 and "vm.swappiness = 201" in r.stderr and "0-200" in r.stderr


def test_tune_applies_persists_and_is_idempotent(restore_sysctls, own_zram, tmp_path):  # noqa: F811
    r = run_sparkguard("install-zram", "--device", own_zram, "--size", "64MiB", "--no-persist", "--root", str(tmp_path))
    assert r.returncode == 0, r.stderr
    # start from values that differ from the tuning, so every key really changes
    for k, v in (("vm.swappiness", "61"), ("vm.watermark_scale_factor", "11"), ("vm.page-cluster", "3")):
        Path(KEYS[k]).write_text(v)
    r = run_sparkguard("tune", "--root", str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    assert live("vm.swappiness") == 180 and live("vm.watermark_scale_factor") == 100 and live("vm.page-cluster") == 0
    assert "61 -> 180" in r.stdout and "11 -> 100" in r.stdout and "3 -> 0" in r.stdout
    text = (tmp_path / FILE).read_text()
    assert "vm.swappiness = 180" in text and "vm.watermark_scale_factor = 100" in text and "vm.page-cluster = 0" in text

    r = run_sparkguard("tune", "--root", str(tmp_path))
    assert r.returncode == 0 and "no changes" in r.stdout

    # the file is what procps sysctl(8) applies at boot: it must reproduce the values
    Path(KEYS["vm.swappiness"]).write_text("60")
    p = subprocess.run(["sysctl", "-p", str(tmp_path / FILE)], capture_output=True, text=True, timeout=30)
    assert p.returncode == 0, p.stderr
    assert live("vm.swappiness") == 180

    # an option changes one value; later runs keep the persisted choice
    r = run_sparkguard("tune", "--swappiness", "150", "--root", str(tmp_path))
    assert r.returncode == 0 and "180 -> 150" in r.stdout
    assert "vm.swappiness = 150" in (tmp_path / FILE).read_text()
    r = run_sparkguard("tune", "--root", str(tmp_path))
    assert r.returncode == 0 and "no changes" in r.stdout and live("vm.swappiness") == 150


def test_dry_run_changes_nothing(restore_sysctls, tmp_path):
    before = {k: live(k) for k in KEYS}
    target = 150 if before["vm.watermark_scale_factor"] != 150 else 151
    r = run_sparkguard("tune", "--watermark-scale-factor", str(target), "--force", "--dry-run", "--root", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert f"-> {target}" in r.stdout and "would" in r.stdout
    assert {k: live(k) for k in KEYS} == before
    assert not (tmp_path / FILE).exists()


def test_force_sets_a_refused_value_and_warns(restore_sysctls, tmp_path):
    r = run_sparkguard("tune", "--watermark-scale-factor", "250", "--swappiness", "60", "--force", "--no-persist",
                       "--root", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert "WARNING" in r.stdout and "MemAvailable" in r.stdout
    assert live("vm.watermark_scale_factor") == 250
    assert not (tmp_path / FILE).exists()


def test_boot_applies_the_persisted_file(restore_sysctls, tmp_path):
    r = run_sparkguard("tune", "--boot", "--root", str(tmp_path))
    assert r.returncode == 0 and "nothing to apply" in r.stdout
    f = tmp_path / FILE
    f.parent.mkdir(parents=True)
    f.write_text("vm.swappiness = 42\nvm.watermark_scale_factor = 77\nvm.page-cluster = 2\n")
    r = run_sparkguard("tune", "--boot", "--root", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert (live("vm.swappiness"), live("vm.watermark_scale_factor"), live("vm.page-cluster")) == (42, 77, 2)


def test_our_file_sorts_after_debian_99_sysctl_and_later_overrides_are_reported(restore_sysctls, tmp_path):
    assert sorted(["99-sysctl.conf", "99-zz-sparkguard.conf", "98-x.conf"])[-1] == "99-zz-sparkguard.conf"
    later = tmp_path / "etc/sysctl.d/99-zzz-late.conf"
    later.parent.mkdir(parents=True)
    later.write_text("vm.swappiness = 10\n")
    (tmp_path / "etc/sysctl.conf").write_text("vm.page-cluster=3\n")
    r = run_sparkguard("tune", "--no-apply", "--swappiness", "60", "--page-cluster", "0", "--root", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert "/etc/sysctl.d/99-zzz-late.conf sets vm.swappiness = 10" in r.stdout
    assert "/etc/sysctl.conf sets vm.page-cluster = 3" in r.stdout


def test_dry_run_shows_the_whole_plan_then_the_refusal(restore_sysctls, tmp_path):
    if zram_or_zswap_active():
        pytest.skip("a zram or zswap swap is active on this machine right now (another test?)")
    before = {k: live(k) for k in KEYS}
    r = run_sparkguard("tune", "--dry-run", "--root", str(tmp_path))
    assert r.returncode == 2, r.stdout + r.stderr
    out = r.stdout
    for k in KEYS:  # every step of the plan, changed or not
        assert f" {k}" in out, k
    assert "would create  /etc/sysctl.d/99-zz-sparkguard.conf" in out
    refusal = out.index("refused: vm.swappiness = 180")
    assert refusal > out.index("vm.page-cluster") and refusal > out.index("99-zz-sparkguard.conf")
    assert "install-zram" in out[refusal:] and "--swappiness 60" in out[refusal:]
    assert {k: live(k) for k in KEYS} == before
    assert not any(tmp_path.iterdir())


def test_help_gives_the_defaults_tune_really_uses():
    r = run_sparkguard("tune", "--help")
    assert r.returncode == 0
    text = " ".join(r.stdout.split())
    assert "default 180 with zram" not in text
    assert "--swappiness N 0-200 (default: the persisted file's, else 180; above 100 is refused while no zram " \
           "or zswap is active" in text


def test_read_only_proc_sys_is_named_and_nothing_changes(restore_sysctls, tmp_path):
    if shutil.which("unshare") is None:
        pytest.skip("unshare (util-linux) missing")
    before = {k: live(k) for k in KEYS}
    want = 61 if before["vm.swappiness"] != 61 else 62
    cmd = f"exec {sys.executable} -m sparkguard tune --swappiness {want} --root {tmp_path}"
    # a mount namespace of its own whose /proc/sys is read-only, as a container without privileges has it
    r = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                        f"mount --bind /proc/sys /proc/sys && mount -o remount,bind,ro /proc/sys && {cmd}"],
                       env=sg_env(), capture_output=True, text=True, timeout=60)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "/proc/sys is mounted read-only" in r.stderr and "nothing changed" in r.stderr, r.stderr
    assert "--no-apply" in r.stderr and "Traceback" not in r.stderr
    assert {k: live(k) for k in KEYS} == before
    assert not (tmp_path / FILE).exists()

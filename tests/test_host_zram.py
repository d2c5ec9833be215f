"""install-zram against the real kernel: a zram device this test makes with hot_add.

Never touches zram0 or any device the test did not create: every command gets
``--device`` and every boot configuration goes to a temporary ``--root``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import remove_zram_device, run_sparkguard, sg_env

HOT_ADD = "/sys/class/zram-control/hot_add"
DEBIAN_GENERATOR_CONF = "/etc/systemd/zram-generator.conf"
GENERATOR = next((p for p in ("/usr/lib/systemd/system-generators/zram-generator",
                              "/lib/systemd/system-generators/zram-generator") if os.path.exists(p)), None)


def swaps() -> dict[str, dict]:
    """/proc/swaps as {device basename: {"size_kb", "priority", "type"}}."""
    out = {}
    with open("/proc/swaps") as f:
        for line in f.read().splitlines()[1:]:
            p = line.split()
            out[os.path.basename(p[0])] = {"filename": p[0], "type": p[1], "size_kb": int(p[2]), "priority": int(p[4])}
    return out


def zram_devices() -> set[str]:
    return {n for n in os.listdir("/sys/block") if re.fullmatch(r"zram\d+", n)}


#: where install-zram records the devices it made (sparkguard/host/zramdev.py RECORD)
RECORD = Path("/run/sparkguard-zram/devices")


def recorded() -> list[str]:
    return RECORD.read_text().split() if RECORD.exists() else []


def made_by(stdout: str) -> str | None:
    """The device install-zram reported creating with hot_add (``created /dev/zramN``), if any."""
    m = re.search(r"^created\s+/dev/(zram\d+)", stdout, re.M)
    return m.group(1) if m else None


def no_sparkguard_swap_on_host() -> None:
    """Skip unless install-zram without --device would hot_add a new device: it reuses a device
    labelled ``sparkguard`` (another session's) when one exists."""
    from sparkguard.host import zramdev

    if not os.path.exists(HOT_ADD):
        pytest.skip("no /sys/class/zram-control")
    if zramdev.ours():
        pytest.skip(f"a sparkguard zram swap exists on this host ({zramdev.ours()}): install-zram would reuse it")


def sysfs(name: str, attr: str) -> str:
    return Path(f"/sys/block/{name}/{attr}").read_text().strip()


def selected_algorithm(name: str) -> str:
    return next(w.strip("[]") for w in sysfs(name, "comp_algorithm").split() if w.startswith("["))


def offered_algorithms(name: str) -> list[str]:
    return [w.strip("[]") for w in sysfs(name, "comp_algorithm").split()]


def algo_for(name: str) -> str:
    """An algorithm the kernel offers that is not the device's current default."""
    offered = offered_algorithms(name)
    sel = selected_algorithm(name)
    return next((a for a in ("lz4", "zstd", "lzo", "lzo-rle") if a in offered and a != sel), sel)


def test_setup_is_real_idempotent_and_removable(own_zram, tmp_path):
    algo = algo_for(own_zram)
    args = ["install-zram", "--device", own_zram, "--size", "256MiB", "--priority", "77",
            "--algorithm", algo, "--root", str(tmp_path)]
    r = run_sparkguard(*args)
    assert r.returncode == 0, r.stderr + r.stdout
    s = swaps()[own_zram]
    assert s["priority"] == 77
    assert s["size_kb"] * 1024 >= 256 * 1024**2 - 2 * 65536  # minus the swap header page
    assert selected_algorithm(own_zram) == algo
    assert int(sysfs(own_zram, "disksize")) == 256 * 1024**2
    label = subprocess.run(["blkid", "-p", "-o", "value", "-s", "LABEL", f"/dev/{own_zram}"],
                           capture_output=True, text=True, timeout=30).stdout.strip()
    assert label == "sparkguard"
    conf = (tmp_path / "etc/sparkguard/zram.conf").read_text()
    assert "size = 256MiB" in conf and "priority = 77" in conf and f"algorithm = {algo}" in conf

    r2 = run_sparkguard(*args)
    assert r2.returncode == 0, r2.stderr
    assert "no changes" in r2.stdout
    assert "unchanged" in r2.stdout and "ran" not in r2.stdout
    assert swaps()[own_zram] == s

    r3 = run_sparkguard("install-zram", "--remove", "--device", own_zram, "--root", str(tmp_path))
    assert r3.returncode == 0, r3.stderr
    assert own_zram not in swaps()
    assert not os.path.exists(f"/sys/block/{own_zram}")
    assert not (tmp_path / "etc/sparkguard/zram.conf").exists()
    assert not any(p.is_file() for p in tmp_path.rglob("*"))


def test_new_settings_rebuild_only_our_device(own_zram, tmp_path):
    base = ["install-zram", "--device", own_zram, "--root", str(tmp_path), "--no-persist"]
    assert run_sparkguard(*base, "--size", "128MiB", "--priority", "60").returncode == 0
    r = run_sparkguard(*base, "--size", "192MiB", "--priority", "61")
    assert r.returncode == 0, r.stderr
    assert "swapoff" in r.stdout
    assert swaps()[own_zram]["priority"] == 61
    assert int(sysfs(own_zram, "disksize")) == 192 * 1024**2
    assert not (tmp_path / "etc").exists()  # --no-persist


def test_dry_run_prints_every_step_and_changes_nothing(own_zram, tmp_path):
    r = run_sparkguard("install-zram", "--device", own_zram, "--size", "128MiB", "--root", str(tmp_path),
                       "--algorithm", algo_for(own_zram), "--dry-run")
    assert r.returncode == 0, r.stderr
    for step in ("comp_algorithm", "disksize", "mkswap", "swapon", "zram.conf"):
        assert step in r.stdout, step
    assert "would" in r.stdout
    assert sysfs(own_zram, "disksize") == "0"
    assert own_zram not in swaps()
    assert not any(tmp_path.iterdir())


def test_unknown_algorithm_is_refused_with_the_offered_list(own_zram, tmp_path):
    r = run_sparkguard("install-zram", "--device", own_zram, "--size", "64MiB", "--algorithm", "nosuchzip",
                       "--root", str(tmp_path))
    assert r.returncode == 2
    assert "nosuchzip" in r.stderr
    for a in offered_algorithms(own_zram):
        assert a in r.stderr
    assert sysfs(own_zram, "disksize") == "0"
    assert not any(tmp_path.iterdir())


def test_a_device_that_is_not_ours_is_left_alone(own_zram, tmp_path):
    # initialise the test's own device as something else: a swap without our label
    Path(f"/sys/block/{own_zram}/disksize").write_text(str(64 * 1024**2))
    subprocess.run(["mkswap", "-L", "other", f"/dev/{own_zram}"], check=True, capture_output=True, timeout=60)
    r = run_sparkguard("install-zram", "--device", own_zram, "--size", "64MiB", "--root", str(tmp_path))
    assert r.returncode == 2 and "in use" in r.stderr
    r = run_sparkguard("install-zram", "--remove", "--device", own_zram, "--root", str(tmp_path))
    assert r.returncode == 2 and "not a sparkguard zram swap" in r.stderr
    assert int(sysfs(own_zram, "disksize")) == 64 * 1024**2
    assert os.path.exists(f"/sys/block/{own_zram}")


def test_slow_swap_at_same_priority_is_warned_about(own_zram, tmp_path):
    swapfile = tmp_path / "slow.swap"
    with open(swapfile, "wb") as f:
        f.truncate(0)
        f.write(b"\0" * (32 * 1024**2))
    os.chmod(swapfile, 0o600)
    subprocess.run(["mkswap", str(swapfile)], check=True, capture_output=True, timeout=60)
    p = subprocess.run(["swapon", "--priority", "90", str(swapfile)], capture_output=True, text=True, timeout=60)
    if p.returncode != 0:
        pytest.skip(f"cannot swapon a file here: {p.stderr.strip()}")
    try:
        r = run_sparkguard("install-zram", "--device", own_zram, "--size", "64MiB", "--priority", "90",
                           "--no-persist", "--root", str(tmp_path))
        assert r.returncode == 0, r.stderr
        assert "WARNING" in r.stdout and str(swapfile) in r.stdout and "priority 90" in r.stdout
        r = run_sparkguard("install-zram", "--device", own_zram, "--size", "64MiB", "--priority", "91",
                           "--no-persist", "--root", str(tmp_path))
        assert r.returncode == 0 and str(swapfile) not in r.stdout
    finally:
        subprocess.run(["swapoff", str(swapfile)], timeout=300, check=False)


def test_boot_mode_sets_up_the_persisted_swap(own_zram, tmp_path):
    r = run_sparkguard("install-zram", "--boot", "--device", own_zram, "--root", str(tmp_path))
    assert r.returncode == 0 and "nothing to do" in r.stdout
    assert sysfs(own_zram, "disksize") == "0"
    r = run_sparkguard("install-zram", "--no-now", "--size", "96MiB", "--priority", "66", "--root", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert sysfs(own_zram, "disksize") == "0"  # --no-now: boot configuration only
    r = run_sparkguard("install-zram", "--boot", "--device", own_zram, "--root", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert swaps()[own_zram]["priority"] == 66
    assert int(sysfs(own_zram, "disksize")) == 96 * 1024**2


def test_boot_mode_falls_back_to_the_kernel_default_algorithm(own_zram, tmp_path):
    conf = tmp_path / "etc/sparkguard/zram.conf"
    conf.parent.mkdir(parents=True)
    conf.write_text("size = 64MiB\npriority = 65\nalgorithm = nosuchzip\n")
    default = selected_algorithm(own_zram)
    r = run_sparkguard("install-zram", "--boot", "--device", own_zram, "--root", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert "WARNING" in r.stdout and "nosuchzip" in r.stdout
    assert swaps()[own_zram]["priority"] == 65
    assert selected_algorithm(own_zram) == default


def test_bad_boot_configuration_names_file_key_and_value(own_zram, tmp_path):
    conf = tmp_path / "etc/sparkguard/zram.conf"
    conf.parent.mkdir(parents=True)
    conf.write_text("size = lots\n")
    r = run_sparkguard("install-zram", "--boot", "--device", own_zram, "--root", str(tmp_path))
    assert r.returncode == 1
    assert str(conf) in r.stderr and "size" in r.stderr and "lots" in r.stderr


@pytest.fixture
def generator_root(tmp_path):
    """A root where systemd-zram-generator is installed: the real binary and Debian's default config."""
    if GENERATOR is None or not os.path.exists(DEBIAN_GENERATOR_CONF):
        pytest.skip("systemd-zram-generator is not installed (tests/install-deps installs it)")
    gen = tmp_path / GENERATOR.lstrip("/")
    gen.parent.mkdir(parents=True)
    shutil.copy2(GENERATOR, gen)
    conf = tmp_path / DEBIAN_GENERATOR_CONF.lstrip("/")
    conf.parent.mkdir(parents=True)
    shutil.copy2(DEBIAN_GENERATOR_CONF, conf)
    (tmp_path / "proc").mkdir()
    shutil.copy("/proc/meminfo", tmp_path / "proc/meminfo")  # the generator reads MemTotal from ROOT/proc
    return tmp_path


def run_generator(root: Path, out: Path) -> list[str]:
    """Run the real zram-generator in test mode (ZRAM_GENERATOR_ROOT) and list the units it makes."""
    out.mkdir()
    env = dict(os.environ, ZRAM_GENERATOR_ROOT=str(root))
    p = subprocess.run([GENERATOR, str(out)], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    return sorted(x.name for x in out.iterdir())


def test_generator_config_replaces_zram0_and_is_restored(generator_root, tmp_path):
    root = generator_root
    conf = root / DEBIAN_GENERATOR_CONF.lstrip("/")
    original = conf.read_text()
    (root / "etc/systemd/zram-generator.conf.d").mkdir()
    r = run_sparkguard("install-zram", "--no-now", "--size", "6GiB", "--priority", "100", "--algorithm", "lz4",
                       "--root", str(root))
    assert r.returncode == 0, r.stderr
    assert "systemd-zram-generator" in r.stdout
    text = conf.read_text()
    headers = [ln.strip() for ln in text.splitlines() if ln.strip().startswith("[")]
    assert headers == ["[zram0]"]  # replaced, not a second device
    assert "zram-size = 6144" in text and "swap-priority = 100" in text and "compression-algorithm = lz4" in text
    assert text.startswith(original.split("[zram0]")[0])  # Debian's comments kept
    assert not (root / "etc/sparkguard/zram.conf").exists()

    units = run_generator(root, tmp_path / "gen1")
    assert [u for u in units if u.endswith(".swap")] == ["dev-zram0.swap"]
    swap_unit = (tmp_path / "gen1/dev-zram0.swap").read_text()
    assert "Priority=100" in swap_unit

    r = run_sparkguard("install-zram", "--no-now", "--size", "6GiB", "--priority", "100", "--algorithm", "lz4",
                       "--root", str(root))
    assert r.returncode == 0 and "no changes" in r.stdout

    r = run_sparkguard("install-zram", "--remove", "--no-now", "--root", str(root))
    assert r.returncode == 0, r.stderr
    assert conf.read_text() == original
    assert not (root / "var/lib/sparkguard/zram-generator.conf.orig.json").exists()


def test_generator_config_keeps_other_sections(generator_root):
    root = generator_root
    conf = root / DEBIAN_GENERATOR_CONF.lstrip("/")
    original = "# mine\n[zram0]\nzram-size = 1024\n\n[zram1]\nzram-size = 512\nmount-point = /var/tmp/z\n"
    conf.write_text(original)
    r = run_sparkguard("install-zram", "--no-now", "--size", "2GiB", "--priority", "100", "--algorithm", "lz4",
                       "--root", str(root))
    assert r.returncode == 0, r.stderr
    text = conf.read_text()
    assert "zram-size = 1024" not in text and "zram-size = 2048" in text
    assert "[zram1]\nzram-size = 512\nmount-point = /var/tmp/z\n" in text
    saved = json.loads((root / "var/lib/sparkguard/zram-generator.conf.orig.json").read_text())
    assert saved == {"existed": True, "text": original}
    assert run_sparkguard("install-zram", "--remove", "--no-now", "--root", str(root)).returncode == 0
    assert conf.read_text() == original


#: larger than the kernel can hold the table of: zram's disksize_store answers ENOMEM
#: (vmalloc refuses a size above the RAM total before allocating anything)
HUGE = str(2**50)


def test_a_step_failing_after_hot_add_rolls_the_new_device_back(root_only, tmp_path):
    no_sparkguard_swap_on_host()
    r = run_sparkguard("install-zram", "--size", HUGE, "--priority", "55", "--no-persist", "--root", str(tmp_path))
    name = made_by(r.stdout)
    left = name is not None and name in zram_devices()
    try:
        assert name, r.stdout + r.stderr  # it did hot_add
        assert r.returncode == 1, r.stdout + r.stderr
        assert f"/sys/block/{name}/disksize" in r.stderr and HUGE in r.stderr  # names the failed step
        assert "rolled back" in r.stderr and f"/dev/{name} removed" in r.stderr
        assert not left, f"{name} was left behind"
        assert name not in recorded()
        assert name not in swaps()
        # the failed write is not reported as done
        assert not re.search(rf"^ran .*{HUGE}", r.stdout, re.M), r.stdout
        assert re.search(r"^ran\s+echo 1 > /sys/class/zram-control/hot_remove", r.stdout, re.M), r.stdout
    finally:
        if left:
            remove_zram_device(name)


def test_a_failed_step_on_a_given_device_resets_it_and_keeps_it(own_zram, tmp_path):
    r = run_sparkguard("install-zram", "--device", own_zram, "--size", HUGE, "--no-persist", "--root", str(tmp_path))
    assert r.returncode == 1, r.stdout + r.stderr
    assert "disksize" in r.stderr and f"/dev/{own_zram} reset, free again" in r.stderr
    assert sysfs(own_zram, "disksize") == "0"
    assert own_zram in zram_devices() and own_zram not in recorded()  # not ours to remove


def test_remove_finds_a_recorded_device_that_has_no_label_yet(own_zram, tmp_path):
    # the state a killed install-zram leaves between hot_add and mkswap: recorded, initialised, no label
    RECORD.parent.mkdir(parents=True, exist_ok=True)
    RECORD.write_text("".join(n + "\n" for n in recorded() + [own_zram]))
    try:
        Path(f"/sys/block/{own_zram}/disksize").write_text(str(64 * 1024**2))
        r = run_sparkguard("install-zram", "--remove", "--device", own_zram, "--root", str(tmp_path))
        assert r.returncode == 0, r.stdout + r.stderr
        assert own_zram not in zram_devices()
        assert own_zram not in recorded()
    finally:
        rest = [n for n in recorded() if n != own_zram]
        RECORD.write_text("".join(n + "\n" for n in rest)) if rest else RECORD.unlink(missing_ok=True)


def in_read_only_sys(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """``sparkguard ARGS`` in a mount namespace of its own whose /sys is remounted read-only
    (what a container without privileges sees)."""
    cmd = " ".join(["exec", sys.executable, "-m", "sparkguard", *args])
    return subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                           f"mount -o remount,bind,ro /sys && {cmd}"],
                          env=sg_env(), capture_output=True, text=True, timeout=timeout)


def test_read_only_sys_is_named_and_nothing_changes(root_only, tmp_path):
    if not os.path.exists(HOT_ADD):
        pytest.skip("no /sys/class/zram-control")
    if shutil.which("unshare") is None:
        pytest.skip("unshare (util-linux) missing")
    before = (zram_devices(), swaps(), recorded())
    r = in_read_only_sys("install-zram", "--size", "64MiB", "--root", str(tmp_path))
    name = made_by(r.stdout)
    try:
        assert r.returncode == 1, r.stdout + r.stderr
        assert "/sys is mounted read-only" in r.stderr and "nothing changed" in r.stderr
        assert "--no-now" in r.stderr
        assert name is None, r.stdout
        assert not any(tmp_path.iterdir())  # not even the boot configuration
        assert (zram_devices(), swaps(), recorded()) == before
        r = in_read_only_sys("install-zram", "--remove", "--root", str(tmp_path))
        assert r.returncode == 1 and "/sys is mounted read-only" in r.stderr
    finally:
        if name and name in zram_devices():
            remove_zram_device(name)

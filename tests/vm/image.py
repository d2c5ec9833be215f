"""The VM's disk image for the QEMU tests: Debian 12 from Debian packages only, built once and cached.

:func:`cached_image` returns a directory ``CACHE_DIR/vmimage-<key>`` holding

* ``disk.raw`` -- an ext4 file system (no partition table) made with ``mkfs.ext4 -d`` from a
  copy of the nspawn tests' cached root (:func:`system.nspawn.cached_root`: debootstrap minbase
  of bookworm with systemd, systemd-sysv, dbus, python3, python3-venv, procps, and a venv at
  /opt/sparkguard holding sparkguard's dependencies) plus :data:`PACKAGES` (Debian's kernel,
  its initramfs, udev) installed by the root's own apt, an initramfs of the root's modules only, the agent (``tests/vm/agent.py``) and
  its unit, an fstab, a fixed machine id and a persistent journal;
* ``vmlinuz`` and ``initrd.img`` -- the Debian kernel and the initramfs its postinst made, for
  QEMU's ``-kernel``/``-initrd`` (no boot loader in the image: a guest reboot restarts the same
  kernel through the firmware, which is all the tests need);
* ``built.json`` -- what went in and how long the build took.

The key is a digest of everything that goes in (the cached root's name, which is itself a
digest of its packages and dependency list, :data:`PACKAGES`, the agent's source, the unit, the
fstab, the image size).  The build runs under the nspawn tests' lock on that key in a temporary
directory that is renamed into place (``rename(2)`` is atomic), so an interrupted build is never
used and concurrent test runs build it once.  sparkguard itself is not in the image: each test
session installs the wheel of its checkout (``conftest.py``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import uuid
from pathlib import Path

from system import nspawn

#: Installed with apt into the copy of the cached root.  linux-image-amd64 pulls in
#: initramfs-tools (its initramfs is then remade with :data:`INITRAMFS_MODULES` only); udev
#: gives /dev its nodes and links as on a real install.
PACKAGES = ("linux-image-amd64", "udev", "kmod")
#: Apparent size of disk.raw (a sparse file; ~1.3 GiB of it is used).
DISK_SIZE = "4G"
AGENT = Path(__file__).with_name("agent.py")
AGENT_PATH = "/usr/local/sbin/sg-test-agent"
#: The agent starts as early as the root file system allows (DefaultDependencies=no), so the
#: host learns of a boot before the rest of it completes, and stays up until the very end of
#: shutdown (no Conflicts=shutdown.target: systemd stops it with everything else).
AGENT_UNIT = f"""[Unit]
Description=sparkguard test agent (runs the host's commands from a virtio-serial port)
DefaultDependencies=no
After=local-fs.target

[Service]
ExecStart=/usr/bin/python3 {AGENT_PATH}
Restart=always
RestartSec=1s
OOMScoreAdjust=-1000

[Install]
WantedBy=sysinit.target
"""
FSTAB = "/dev/vda / ext4 rw,errors=remount-ro 0 0\n"
#: The initramfs holds only what mounts the root (initramfs.conf(5): MODULES=list takes the modules
#: of /etc/initramfs-tools/modules, with their dependencies).  Debian's default MODULES=most made a
#: 36 MB initramfs whose udev coldplug took ~36 s of a loaded TCG boot; crc32c_generic is the
#: checksum ext4's metadata_csum asks the crypto API for (no module dependency names it).
INITRAMFS_CONF = "MODULES=list\n"
INITRAMFS_MODULES = ("virtio_pci", "virtio_blk", "ext4", "crc32c_generic")
#: A fixed machine id: the journal of every boot of a session is in one directory
#: (/var/log/journal/<machine-id>), so ``journalctl`` reads across reboots.
MACHINE_ID = "5c1b0d6a9e2f4c3b8a7d6e5f4a3b2c1d\n"


def _fill(tree: Path) -> None:
    """Complete the copied root ``tree`` into the VM's root (apt in a non-booted nspawn, host network)."""
    nspawn.nspawn_script(tree, "set -e; export DEBIAN_FRONTEND=noninteractive; apt-get update -qq; "
                               "apt-get install -y -qq --no-install-recommends " + " ".join(PACKAGES) +
                               "; apt-get clean; rm -rf /var/lib/apt/lists/*", timeout=1200)
    (tree / "etc/initramfs-tools/conf.d/sparkguard-vm").write_text(INITRAMFS_CONF)
    with open(tree / "etc/initramfs-tools/modules", "a") as f:
        f.write("".join(m + "\n" for m in INITRAMFS_MODULES))
    nspawn.nspawn_script(tree, "update-initramfs -u -k all", timeout=600)
    (tree / AGENT_PATH.lstrip("/")).parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(AGENT, tree / AGENT_PATH.lstrip("/"))
    (tree / AGENT_PATH.lstrip("/")).chmod(0o755)
    unit = tree / "etc/systemd/system/sg-test-agent.service"
    unit.write_text(AGENT_UNIT)
    wants = tree / "etc/systemd/system/sysinit.target.wants"
    wants.mkdir(parents=True, exist_ok=True)
    (wants / "sg-test-agent.service").symlink_to("/etc/systemd/system/sg-test-agent.service")
    (tree / "etc/fstab").write_text(FSTAB)
    (tree / "etc/hostname").write_text("sgvm\n")
    (tree / "etc/machine-id").unlink(missing_ok=True)
    (tree / "etc/machine-id").write_text(MACHINE_ID)
    (tree / "var/log/journal").mkdir(parents=True, exist_ok=True)


def _kernel_files(tree: Path) -> tuple[Path, Path]:
    """(vmlinuz, initrd.img) in ``tree/boot``: the only kernel there (the newest if several)."""
    kernels = sorted((tree / "boot").glob("vmlinuz-*"))
    if not kernels:
        raise RuntimeError(f"no kernel in {tree}/boot after installing {PACKAGES}")
    vmlinuz = kernels[-1]
    initrd = tree / "boot" / ("initrd.img-" + vmlinuz.name[len("vmlinuz-"):])
    if not initrd.is_file():
        raise RuntimeError(f"{initrd} missing: update-initramfs did not run")
    return vmlinuz, initrd


def key(base: Path) -> str:
    """Digest of everything that goes into the image built on the cached root ``base``."""
    return nspawn._key("vmimage", base.name, sorted(PACKAGES), AGENT.read_text(), AGENT_UNIT, FSTAB,
                       MACHINE_ID, DISK_SIZE, INITRAMFS_CONF, INITRAMFS_MODULES)


def cached_image(log=print) -> Path:
    """The cached image directory (``disk.raw``, ``vmlinuz``, ``initrd.img``, ``built.json``); built if missing.

    Raises:
        subprocess.CalledProcessError, RuntimeError: apt, mkfs or the kernel's postinst failed
            (the temporary directory is removed; nothing is cached).
    """
    base = nspawn.cached_root(log)
    k = key(base)
    final = nspawn.CACHE_DIR / f"vmimage-{k}"
    if (final / "built.json").is_file():
        return final
    with nspawn._lock(f"vmimage-{k}"):
        if (final / "built.json").is_file():
            return final
        nspawn._clean_stale(f"vmimage-{k}")
        tmp = nspawn.CACHE_DIR / f".tmp-vmimage-{k}-{os.getpid()}"
        tree = tmp / "tree"
        log(f"building {final}: {base.name} + {' '.join(PACKAGES)}, agent, ext4 image (a few minutes)")
        t0 = time.monotonic()
        try:
            tmp.mkdir()
            subprocess.run(["cp", "-a", "--reflink=auto", str(base), str(tree)], check=True, timeout=300)
            _fill(tree)
            vmlinuz, initrd = _kernel_files(tree)
            shutil.copyfile(vmlinuz, tmp / "vmlinuz")
            shutil.copyfile(initrd, tmp / "initrd.img")
            subprocess.run(["truncate", "-s", DISK_SIZE, str(tmp / "disk.raw")], check=True, timeout=30)
            subprocess.run(["mkfs.ext4", "-q", "-F", "-L", "sgvm", "-U", str(uuid.uuid4()), "-d", str(tree),
                            str(tmp / "disk.raw")], check=True, capture_output=True, text=True, timeout=600)
            kernel = vmlinuz.name[len("vmlinuz-"):]
            nspawn.remove_tree(tree)
            (tmp / "built.json").write_text(json.dumps({
                "base": base.name, "packages": list(PACKAGES), "kernel": kernel,
                "build_seconds": round(time.monotonic() - t0, 1)}, indent=1) + "\n")
            os.rename(tmp, final)
        except BaseException:
            nspawn.remove_tree(tmp)
            raise
    log(f"built {final} in {time.monotonic() - t0:.0f} s")
    return final

"""zram devices as the kernel shows them: names, state, the swap label, and which are sparkguard's.

Reads /sys/block/zramN (``disksize``, ``comp_algorithm``; Documentation/admin-guide/blockdev/zram.rst),
/proc/swaps and the swap header on /dev/zramN.  A device is sparkguard's when it carries the swap
label :data:`LABEL`, or when its name is in :data:`RECORD`, written the moment hot_add returns
(before comp_algorithm, disksize or mkswap can fail).  Changing devices is :mod:`sparkguard.host.zram`'s.
"""

from __future__ import annotations

import fcntl
import os
import re

from sparkguard import sysinfo
from sparkguard.host import virt
from sparkguard.host.files import HostError, atomic_write

SYS_BLOCK = "/sys/block"
ZRAM_CONTROL = "/sys/class/zram-control"
LABEL = "sparkguard"
#: names of the zram devices sparkguard made with hot_add and has not removed, one a line.
#: Under /run: zram devices and this record both end at reboot.  Not in /run/sparkguard, the
#: guard unit's RuntimeDirectory, which systemd empties when the guard stops.  Always the live
#: host's (``--root`` places boot configuration only).
RECORD = "/run/sparkguard-zram/devices"


def read_sysfs(path: str) -> str | None:
    """The text of a sysfs (or /run) file, blanks stripped; None when it cannot be read."""
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def device_name(arg: str) -> str:
    """Normalise ``"3"``, ``"zram3"`` or ``"/dev/zram3"`` to ``"zram3"``.

    Raises:
        HostError (status 2): not a zram device name.
    """
    s = arg.strip()
    s = s[len("/dev/"):] if s.startswith("/dev/") else s
    if s.isdigit():
        s = "zram" + s
    if not re.fullmatch(r"zram\d+", s):
        raise HostError(f"--device {arg!r}: expected a zram device such as zram1 or /dev/zram1", 2)
    return s


def algorithms(name: str) -> tuple[list[str], str | None]:
    """Compression algorithms the kernel offers for device ``name`` and the selected one.

    Source: /sys/block/zramN/comp_algorithm lists them, the selected one in brackets.
    """
    return sysinfo.comp_algorithms(read_sysfs(f"{SYS_BLOCK}/{name}/comp_algorithm") or "")


def swap_entry(name: str, swaps: list[dict] | None = None) -> dict | None:
    """The /proc/swaps entry of ``/dev/<name>`` (sysinfo.read_swaps format) or None."""
    for s in swaps if swaps is not None else sysinfo.read_swaps():
        if os.path.basename(s["filename"]) == name:
            return s
    return None


def swap_label(devpath: str) -> str | None:
    """Label of the swap signature on ``devpath``, or None when it has none.

    Reads the swap header of mkswap(8) directly: magic ``SWAPSPACE2`` in the last 10
    bytes of the first page, the 16-byte volume name at offset 1052 (``union
    swap_header``: 1024 boot bytes, version, last_page, nr_badpages, 16-byte uuid).
    Source: include/linux/swap.h.
    """
    page = os.sysconf("SC_PAGE_SIZE")
    try:
        with open(devpath, "rb") as f:
            head = f.read(page)
    except OSError:
        return None
    if len(head) < page or head[page - 10:page] != b"SWAPSPACE2":
        return None
    return head[1052:1068].split(b"\0", 1)[0].decode("utf-8", "replace")


def state(name: str) -> dict:
    """Current state of device ``name``: ``{"exists", "disksize", "algorithm", "swap", "label"}``.

    ``swap`` is its /proc/swaps entry or None; ``label`` the swap label when initialised.
    """
    base = f"{SYS_BLOCK}/{name}"
    if not os.path.isdir(base):
        return {"exists": False, "disksize": 0, "algorithm": None, "swap": None, "label": None}
    disksize = int(read_sysfs(f"{base}/disksize") or 0)
    return {"exists": True, "disksize": disksize, "algorithm": algorithms(name)[1],
            "swap": swap_entry(name), "label": swap_label(f"/dev/{name}") if disksize else None}


def zram_devices() -> list[str]:
    """Names of all zram devices, in numeric order."""
    try:
        names = [n for n in os.listdir(SYS_BLOCK) if re.fullmatch(r"zram\d+", n)]
    except OSError:
        return []
    return sorted(names, key=lambda n: int(n[4:]))


def recorded() -> list[str]:
    """Device names in :data:`RECORD` (those sparkguard made and has not removed); [] when none."""
    text = read_sysfs(RECORD) or ""
    return [w for w in text.split() if re.fullmatch(r"zram\d+", w)]


def change_record(name: str, keep: bool) -> None:
    """Add (``keep``) or drop ``name`` in :data:`RECORD`, under an flock so that two runs
    cannot lose each other's entry.

    Raises:
        OSError: the record's folder cannot be created or written.
    """
    d = os.path.dirname(RECORD)
    os.makedirs(d, mode=0o755, exist_ok=True)
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        names = [n for n in recorded() if n != name] + ([name] if keep else [])
        if names:
            atomic_write(RECORD, "".join(n + "\n" for n in names))
        elif os.path.exists(RECORD):
            os.unlink(RECORD)
    finally:
        os.close(fd)


def is_ours(name: str, st: dict | None = None) -> bool:
    """True when device ``name`` (its :func:`state` ``st``) is sparkguard's: it carries our swap
    label, or it is in :data:`RECORD` and carries no other label and no swap of someone else."""
    st = state(name) if st is None else st
    if not st["exists"]:
        return False
    if st["label"] == LABEL:
        return True
    return name in recorded() and st["label"] is None and not st["swap"]


def ours() -> list[str]:
    """zram devices that are sparkguard's (:func:`is_ours`), in numeric order."""
    return [n for n in zram_devices() if is_ours(n)]


def check_writable() -> None:
    """Refuse, before anything is changed, where zram's sysfs files cannot be written.

    Reading hot_add creates a device even on a read-only /sys, whose next write then fails:
    this check comes first so that nothing is left behind.
    Raises:
        HostError: /sys is mounted read-only (names the mount, and the container when one is detected).
    """
    path = ZRAM_CONTROL if os.path.exists(ZRAM_CONTROL) else SYS_BLOCK
    cause = virt.read_only_cause(path)
    if cause:
        raise HostError(f"{cause}: zram devices belong to the kernel, which only the host can change; "
                        f"nothing changed. Run `sparkguard install-zram` on the host, or write only the "
                        f"boot configuration with --no-now")



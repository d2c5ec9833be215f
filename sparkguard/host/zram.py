"""zram swap now: set one up, take it away again (the boot side is :mod:`sparkguard.host.zramboot`,
reading devices :mod:`sparkguard.host.zramdev`).

Kernel: Documentation/admin-guide/blockdev/zram.rst:
  a free device from ``/sys/class/zram-control/hot_add`` (or the one named by
  ``--device``), ``comp_algorithm`` before ``disksize`` (the kernel answers EBUSY after),
  ``mkswap -L sparkguard``, ``swapon --discard --priority P``.  A device is ours when it
  carries the swap label, or when its name is in :data:`RECORD`, written the moment
  hot_add returns (before comp_algorithm, disksize or mkswap can fail).  ``--remove`` and
  the idempotence check only ever touch our devices (swapoff, ``reset``, ``hot_remove``).
  A step that fails after hot_add rolls the new device back (swapoff, reset, hot_remove);
  one that fails on an existing device resets it.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import subprocess
import time
from dataclasses import dataclass

from sparkguard import sysinfo
from sparkguard.host import ZRAM_DEFAULT_ALGORITHM as DEFAULT_ALGORITHM
from sparkguard.host import ZRAM_DEFAULT_PRIORITY as DEFAULT_PRIORITY
from sparkguard.host import ZRAM_DEFAULT_SIZE as DEFAULT_SIZE
from sparkguard.host.files import Changes, HostError
from sparkguard.host.zramdev import (LABEL, RECORD, SYS_BLOCK, ZRAM_CONTROL, algorithms, change_record, is_ours,
                                     ours, read_sysfs, recorded, state, swap_entry, zram_devices)
from sparkguard.units import format_size


@dataclass(frozen=True)
class ZramSettings:
    """A zram swap: ``size`` in bytes, swap ``priority`` (-1..32767, higher is used first),
    compression ``algorithm`` as the kernel names it (``lz4``, ``zstd``, ``lzo-rle``)."""

    size: int = DEFAULT_SIZE
    priority: int = DEFAULT_PRIORITY
    algorithm: str = DEFAULT_ALGORITHM

    def describe(self) -> str:
        """``"6.00 GiB lz4 at priority 100"``."""
        return f"{format_size(self.size)} {self.algorithm} at priority {self.priority}"


def validate(settings: ZramSettings) -> None:
    """Check sizes and priority before touching anything.

    Raises:
        HostError (status 2): size not positive or not a whole number of pages; priority
            outside -1..32767 (swapon(2)); empty algorithm name.
    """
    if settings.size <= 0:
        raise HostError(f"--size {settings.size}: must be greater than 0", 2)
    if not -1 <= settings.priority <= 32767:
        raise HostError(f"--priority {settings.priority}: swap priority must be -1..32767 (swapon(2))", 2)
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", settings.algorithm or ""):
        raise HostError(f"--algorithm {settings.algorithm!r}: not an algorithm name", 2)



def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _aligned(size: int) -> int:
    page = os.sysconf("SC_PAGE_SIZE")
    return (size + page - 1) // page * page


def matches(st: dict, settings: ZramSettings) -> bool:
    """True when device state ``st`` is already the swap ``settings`` describe."""
    return bool(st["swap"]) and st["label"] == LABEL and st["disksize"] == _aligned(settings.size) \
        and st["algorithm"] == settings.algorithm and st["swap"]["priority"] == settings.priority



# --- changing devices ----------------------------------------------------------------


def _tool(name: str) -> str:
    for d in (None, "/usr/sbin", "/sbin"):
        exe = shutil.which(name) if d is None else (f"{d}/{name}" if os.access(f"{d}/{name}", os.X_OK) else None)
        if exe:
            return exe
    raise HostError(f"{name} not found (package {'kmod' if name == 'modprobe' else 'util-linux'})")


def _run(ch: Changes, argv: list[str], timeout: float) -> None:
    """Run ``argv`` and report it once it succeeded (under dry-run: report only).

    Raises:
        HostError: the tool is missing, times out or fails (with its stderr).
    """
    if ch.dry_run:
        ch.note("ran", " ".join(argv))
        return
    try:
        p = subprocess.run([_tool(argv[0]), *argv[1:]], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise HostError(f"{' '.join(argv)} did not finish within {timeout:.0f} s") from None
    if p.returncode != 0:
        raise HostError(f"{' '.join(argv)} failed (exit {p.returncode}): {(p.stderr or p.stdout).strip()}")
    ch.note("ran", " ".join(argv))


def _sysfs(ch: Changes, path: str, value: str, why: str = "") -> None:
    """Write ``value`` to sysfs file ``path``, reported once the kernel took it.

    Raises:
        HostError: the kernel refused (names the value, the path and the errno text).
    """
    if not ch.dry_run:
        try:
            _write(path, value)
        except OSError as e:
            raise HostError(f"writing {value!r} to {path} failed: {e.strerror}") from None
    ch.note("ran", f"echo {value} > {path}", why)


def load_module(ch: Changes) -> None:
    """Load the zram module with no device of its own (``modprobe zram num_devices=0``: hot_add
    makes ours; the kernel's default of 1 would leave an empty zram0 beside it, zram.rst
    "num_devices").  Debian's and Ubuntu's kernels build zram as a module that nothing loads at
    boot (found in the test VM's Debian 12 kernel, tests/vm/), so the set-up unit's
    ``install-zram --boot`` loads it every boot.  Raises HostError when modprobe fails."""
    _run(ch, ["modprobe", "zram", "num_devices=0"], timeout=30)


def hot_add(ch: Changes) -> str:
    """A new zram device from ``/sys/class/zram-control/hot_add``; returns its name.

    Under dry-run returns ``"zram<new>"`` without creating anything.
    Raises:
        HostError: no zram-control (the module does not load: :func:`load_module`; or kernel < 4.2).
    """
    path = f"{ZRAM_CONTROL}/hot_add"
    if not os.path.exists(path) and not os.path.isdir(SYS_BLOCK + "/zram0"):
        load_module(ch)
    if not os.path.exists(path) and not ch.dry_run:
        if not os.path.isdir(SYS_BLOCK + "/zram0"):
            raise HostError("the zram module is not loaded and `modprobe zram` did not load it: "
                            "this kernel has no zram")
        raise HostError(f"{path} does not exist: this kernel cannot add zram devices")
    if ch.dry_run:
        ch.note("ran", f"cat {path}", "a new device")
        return "zram<new>"
    try:
        os.makedirs(os.path.dirname(RECORD), mode=0o755, exist_ok=True)
    except OSError as e:
        raise HostError(f"cannot create {os.path.dirname(RECORD)} to record the new device in: "
                        f"{e.strerror}; nothing changed") from None
    try:
        with open(path) as f:
            ident = f.read().strip()  # reading hot_add creates the device
    except OSError as e:
        raise HostError(f"reading {path} failed: {e.strerror}") from None
    if not ident.isdigit():
        raise HostError(f"{path} answered {ident!r}, not a device number")
    name = "zram" + ident
    try:
        change_record(name, keep=True)
    except OSError as e:
        _hot_remove(ch, name)
        raise HostError(f"cannot record /dev/{name} in {RECORD}: {e.strerror}; removed /dev/{name} again") from None
    ch.note("created", f"/dev/{name}", f"cat {path}; recorded in {RECORD}")
    return name


def choose_algorithm(ch: Changes, algo: str, name: str | None = None, boot: bool = False) -> str:
    """The algorithm to use: ``algo`` if the kernel offers it.

    Args:
        name: device whose list to read; None: any existing zram device (read only).
        boot: when not offered, warn and return the kernel's default instead of failing.
    Raises:
        HostError (status 2): not offered; the message lists what the kernel offers.
    """
    if name is None:
        name = next(iter(zram_devices()), None)
    offered, selected = algorithms(name) if name else ([], None)
    if not offered or algo in offered:
        return algo
    msg = f"the kernel does not offer compression algorithm {algo!r} for zram; it offers: {', '.join(offered)}"
    if not boot:
        raise HostError(msg + " (choose one with --algorithm)", 2)
    ch.warn(msg + f"; using the kernel default {selected}")
    return selected or algo


def setup(ch: Changes, name: str, settings: ZramSettings, boot: bool = False) -> None:
    """Make ``/dev/<name>`` (uninitialised) a swap with ``settings``.

    Order from zram.rst: comp_algorithm, disksize, then mkswap and swapon.
    Args:
        boot: when the algorithm is not offered, fall back to the kernel's default with
            a warning instead of failing (a boot must still get its swap).
    Raises:
        HostError: the kernel does not offer the algorithm (lists the ones it does), or
            a step fails.
    """
    dev = f"/dev/{name}"
    selected = None if name.endswith("<new>") else algorithms(name)[1]
    algo = choose_algorithm(ch, settings.algorithm, None if name.endswith("<new>") else name, boot)
    if selected != algo:
        _sysfs(ch, f"{SYS_BLOCK}/{name}/comp_algorithm", algo, "before disksize")
    _sysfs(ch, f"{SYS_BLOCK}/{name}/disksize", str(settings.size), format_size(settings.size))
    _run(ch, ["mkswap", "-L", LABEL, dev], timeout=120)
    _run(ch, ["swapon", "--discard", "--priority", str(settings.priority), dev], timeout=120)
    ch.note("set up", dev, f"swap {ZramSettings(settings.size, settings.priority, algo).describe()}")


def _write_busy(path: str, value: str, timeout: float) -> None:
    """Write ``value`` to ``path``, retrying while the kernel answers EBUSY (a zram device is
    briefly held open after mkswap, swapoff or reset, e.g. by a udev or blkid probe).

    Raises:
        OSError: another error, or still EBUSY after ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    while True:
        try:
            _write(path, value)
            return
        except OSError as e:
            if e.errno != errno.EBUSY or time.monotonic() > deadline:
                raise
        time.sleep(0.05)  # polling: the kernel offers no event for "no longer open"


def _hot_remove(ch: Changes, name: str, timeout: float = 5.0) -> None:
    """Write the device id to hot_remove (retrying EBUSY) and drop it from :data:`RECORD`.

    Raises:
        HostError: the kernel refused.
    """
    path = f"{ZRAM_CONTROL}/hot_remove"
    if not ch.dry_run:
        try:
            _write_busy(path, name[4:], timeout)
        except OSError as e:
            raise HostError(f"removing /dev/{name} ({path}) failed: {e.strerror}") from None
        try:
            change_record(name, keep=False)
        except OSError as e:
            ch.warn(f"/dev/{name} is removed but {RECORD} could not be updated: {e.strerror}")
    ch.note("ran", f"echo {name[4:]} > {path}")


def teardown(ch: Changes, name: str, remove_device: bool = True) -> None:
    """swapoff (if active), ``reset`` and (``remove_device``) ``hot_remove`` ``/dev/<name>``.

    Raises:
        HostError: a step fails (swapoff needs room in RAM for the pages it brings back).
    """
    dev = f"/dev/{name}"
    if swap_entry(name):
        _run(ch, ["swapoff", dev], timeout=600)
    if int(read_sysfs(f"{SYS_BLOCK}/{name}/disksize") or 0):
        path = f"{SYS_BLOCK}/{name}/reset"
        if not ch.dry_run:
            try:
                _write_busy(path, "1", timeout=5.0)
            except OSError as e:
                raise HostError(f"writing '1' to {path} failed: {e.strerror}") from None
        ch.note("ran", f"echo 1 > {path}")
    if remove_device and os.path.exists(f"{ZRAM_CONTROL}/hot_remove"):
        _hot_remove(ch, name)
    ch.note("torn down", dev)


def check_priority(ch: Changes, priority: int) -> None:
    """Warn about each active non-zram swap whose priority is >= ``priority``.

    On Sparks a 16 GiB file swap proved too slow to absorb reclaim spikes: zram must be
    used first, i.e. have the strictly highest priority.
    """
    for s in sysinfo.read_swaps():
        if not os.path.basename(s["filename"]).startswith("zram") and s["priority"] >= priority:
            ch.warn(f"swap {s['filename']} ({s['type']}, {format_size(s['size_bytes'])}) has priority "
                    f"{s['priority']}, not below zram's {priority}: the kernel fills it as early as zram, "
                    f"and a disk swap is too slow to absorb reclaim spikes. Lower it (swapon --priority 10, "
                    f"or pri=10 in /etc/fstab) or raise zram's with --priority")


def apply_now(ch: Changes, settings: ZramSettings, device: str | None = None, boot: bool = False) -> str:
    """Make a sparkguard zram swap with ``settings`` active; returns the device name.

    Args:
        device: use this device (``zramN``); it must be free (disksize 0) or already ours.
            None: reuse our labelled device if there is one, else a new one from hot_add.
        boot: see :func:`setup`.
    Raises:
        HostError: the named device does not exist or is used by something else, or a step fails.
    """
    if device:
        st = state(device)
        if not st["exists"]:
            raise HostError(f"/dev/{device} does not exist (create one with `cat {ZRAM_CONTROL}/hot_add`)", 2)
        if st["disksize"] and not is_ours(device, st):
            what = f"swap at priority {st['swap']['priority']}" if st["swap"] else "initialised"
            raise HostError(f"/dev/{device} is in use ({what}, {format_size(st['disksize'])}, not labelled "
                            f"{LABEL!r}); choose a free device or reset it yourself", 2)
        candidates = [device]
    else:
        candidates = ours()
    # refuse an algorithm the kernel lacks before anything is torn down
    if not boot:
        choose_algorithm(ch, settings.algorithm, candidates[0] if candidates else None)
    for name in candidates:
        st = state(name)
        if matches(st, settings):
            ch.note("unchanged", f"/dev/{name}", f"swap {settings.describe()} already active")
            return name
        if st["disksize"]:
            ch.info(f"/dev/{name} is a sparkguard swap with other settings: setting it up again")
            if not ch.dry_run:
                # once reset it has no label: the record keeps it ours for --remove
                _keep_record(name)
            teardown(ch, name, remove_device=False)
        _setup_or_roll_back(ch, name, settings, boot, created=False)
        return name
    name = hot_add(ch)
    _setup_or_roll_back(ch, name, settings, boot, created=True)
    return name


def _keep_record(name: str) -> None:
    """Record ``name`` in :data:`RECORD`; raises HostError (nothing changed yet) when it cannot."""
    try:
        change_record(name, keep=True)
    except OSError as e:
        raise HostError(f"cannot record /dev/{name} in {RECORD}: {e.strerror}; nothing changed") from None


def _setup_or_roll_back(ch: Changes, name: str, settings: ZramSettings, boot: bool, created: bool) -> None:
    """:func:`setup`; when a step fails, undo what it did: swapoff, reset, and hot_remove when
    this run ``created`` the device.

    Raises:
        HostError: the failed step, then what the roll-back did (or, when the roll-back failed
            too, that the device is left and recorded for ``--remove``).
    """
    try:
        setup(ch, name, settings, boot)
    except HostError as e:
        if ch.dry_run:
            raise
        try:
            teardown(ch, name, remove_device=created)
        except HostError as e2:
            undone = (f"rolling back failed too ({e2}): /dev/{name} is left" +
                      (f", recorded in {RECORD}; `sparkguard install-zram --remove` removes it"
                       if name in recorded() else ""))
        else:
            undone = f"rolled back: /dev/{name} " + ("removed" if created else "reset, free again")
        raise HostError(f"setting up /dev/{name} failed: {e}; {undone}", e.status) from None


def remove_now(ch: Changes, device: str | None = None) -> list[str]:
    """Tear down our zram swap(s): ``device`` only, or every device that is ours (:func:`is_ours`).

    Raises:
        HostError (status 2): ``device`` exists but is not ours.
    """
    if device:
        st = state(device)
        if not st["exists"]:
            if device in recorded() and not ch.dry_run:
                change_record(device, keep=False)  # removed by someone else since
            ch.note("absent", f"/dev/{device}")
            return []
        if st["disksize"] and not is_ours(device, st):
            raise HostError(f"/dev/{device} is not a sparkguard zram swap (swap label {st['label']!r}); "
                            f"not touching it", 2)
        names = [device]
    else:
        names = ours()
        for stale in set(recorded()) - set(zram_devices()):
            if not ch.dry_run:
                change_record(stale, keep=False)  # removed by someone else since
        if not names:
            ch.note("absent", "sparkguard zram swap", f"no device labelled {LABEL!r} or recorded in {RECORD}")
    for name in names:
        teardown(ch, name)
    return names



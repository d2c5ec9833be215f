"""zram swap: set one up now, make it survive reboots, take it away again.

Now (kernel: Documentation/admin-guide/blockdev/zram.rst):
  a free device from ``/sys/class/zram-control/hot_add`` (or the one named by
  ``--device``), ``comp_algorithm`` before ``disksize`` (the kernel answers EBUSY after),
  ``mkswap -L sparkguard``, ``swapon --discard --priority P``.  A device is ours when it
  carries the swap label, or when its name is in :data:`RECORD`, written the moment
  hot_add returns (before comp_algorithm, disksize or mkswap can fail).  ``--remove`` and
  the idempotence check only ever touch our devices (swapoff, ``reset``, ``hot_remove``).
  A step that fails after hot_add rolls the new device back (swapoff, reset, hot_remove);
  one that fails on an existing device resets it.

At boot, one of:
  * systemd-zram-generator installed (its binary in ``/usr/lib`` or ``/lib``
    ``/systemd/system-generators/zram-generator``): its ``/etc/systemd/zram-generator.conf``
    gets our ``[zram0]`` section in place of Debian's default one (never a second
    device); the replaced text is saved and put back by ``--remove``.  Source:
    zram-generator.conf(5).
  * otherwise ``/etc/sparkguard/zram.conf``, read by ``sparkguard-setup.service``
    (``sparkguard install-zram --boot``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from dataclasses import dataclass

from sparkguard import sysinfo
from sparkguard.host.files import (Changes, HostError, Manifest, atomic_write, in_root, install_file, read_text,
                                   remove_file, set_keys, shipped)
from sparkguard.units import format_size, parse_size

SYS_BLOCK = "/sys/block"
ZRAM_CONTROL = "/sys/class/zram-control"
LABEL = "sparkguard"
CONF_PATH = "/etc/sparkguard/zram.conf"
GENERATOR_CONF = "/etc/systemd/zram-generator.conf"
GENERATOR_BINARIES = ("/usr/lib/systemd/system-generators/zram-generator",
                      "/lib/systemd/system-generators/zram-generator")
#: the generator config text our [zram0] section replaced (JSON {"existed": bool, "text": str})
GENERATOR_ORIG = "/var/lib/sparkguard/zram-generator.conf.orig.json"
#: first line of our section in the generator config: marks it as ours
GENERATOR_MARK = "# sparkguard: zram0 swap"
#: names of the zram devices sparkguard made with hot_add and has not removed, one a line.
#: Under /run: zram devices and this record both end at reboot.  Not in /run/sparkguard, the
#: guard unit's RuntimeDirectory, which systemd empties when the guard stops.  Always the live
#: host's (``--root`` places boot configuration only).
RECORD = "/run/sparkguard-zram/devices"

from sparkguard.host import (ZRAM_DEFAULT_ALGORITHM as DEFAULT_ALGORITHM,  # noqa: E402
                             ZRAM_DEFAULT_PRIORITY as DEFAULT_PRIORITY, ZRAM_DEFAULT_SIZE as DEFAULT_SIZE)

_SECTION = re.compile(r"^\s*\[([^\]]*)\]\s*$")


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


# --- reading devices -----------------------------------------------------------------


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


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
    return sysinfo.comp_algorithms(_read(f"{SYS_BLOCK}/{name}/comp_algorithm") or "")


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
    disksize = int(_read(f"{base}/disksize") or 0)
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
    text = _read(RECORD) or ""
    return [w for w in text.split() if re.fullmatch(r"zram\d+", w)]


def _change_record(name: str, keep: bool) -> None:
    """Add (``keep``) or drop ``name`` in :data:`RECORD`, under an flock so that two runs
    cannot lose each other's entry.

    Raises:
        OSError: the record's folder cannot be created or written.
    """
    import fcntl

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
    from sparkguard.host import virt

    path = ZRAM_CONTROL if os.path.exists(ZRAM_CONTROL) else SYS_BLOCK
    cause = virt.read_only_cause(path)
    if cause:
        raise HostError(f"{cause}: zram devices belong to the kernel, which only the host can change; "
                        f"nothing changed. Run `sparkguard install-zram` on the host, or write only the "
                        f"boot configuration with --no-now")


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
    raise HostError(f"{name} not found (package util-linux)")


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


def hot_add(ch: Changes) -> str:
    """A new zram device from ``/sys/class/zram-control/hot_add``; returns its name.

    Under dry-run returns ``"zram<new>"`` without creating anything.
    Raises:
        HostError: no zram-control (module not loaded, or kernel < 4.2).
    """
    path = f"{ZRAM_CONTROL}/hot_add"
    if not os.path.exists(path):
        if not os.path.isdir(SYS_BLOCK + "/zram0"):
            raise HostError("the zram module is not loaded: run `modprobe zram` (and add zram to "
                            "/etc/modules-load.d/) then try again")
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
        _change_record(name, keep=True)
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
    import errno
    import time

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
            _change_record(name, keep=False)
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
    if int(_read(f"{SYS_BLOCK}/{name}/disksize") or 0):
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
        _change_record(name, keep=True)
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
                _change_record(device, keep=False)  # removed by someone else since
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
                _change_record(stale, keep=False)  # removed by someone else since
        if not names:
            ch.note("absent", "sparkguard zram swap", f"no device labelled {LABEL!r} or recorded in {RECORD}")
    for name in names:
        teardown(ch, name)
    return names


# --- at boot -------------------------------------------------------------------------


def generator_installed(root: str) -> str | None:
    """Path of systemd-zram-generator's binary under ``root``, or None when not installed."""
    for p in GENERATOR_BINARIES:
        if os.path.exists(in_root(root, p)):
            return p
    return None


def render_conf(settings: ZramSettings) -> str:
    """Text of /etc/sparkguard/zram.conf for ``settings`` (from the shipped zram/sparkguard-zram.conf)."""
    return set_keys(shipped("host/zram/sparkguard-zram.conf"), {
        "size": format_size(settings.size, exact=True), "priority": settings.priority, "algorithm": settings.algorithm})


def read_conf(root: str = "/") -> ZramSettings | None:
    """Settings of ``<root>/etc/sparkguard/zram.conf``; None when absent.

    Raises:
        HostError: a bad value (names file, key and value).
    """
    from sparkguard.host.files import parse_keys

    path = in_root(root, CONF_PATH)
    text = read_text(path)
    if text is None:
        return None
    kv = parse_keys(text)
    unknown = set(kv) - {"size", "priority", "algorithm"}
    if unknown:
        k = sorted(unknown)[0]
        raise HostError(f"{path}: {k}: {kv[k]!r}: unknown key; expected size, priority, algorithm")
    try:
        size = parse_size(kv.get("size", DEFAULT_SIZE))
    except ValueError as e:
        raise HostError(f"{path}: size: {kv.get('size')!r}: {e}") from None
    try:
        prio = int(kv.get("priority", DEFAULT_PRIORITY))
    except ValueError:
        raise HostError(f"{path}: priority: {kv.get('priority')!r}: expected an integer -1..32767") from None
    s = ZramSettings(size, prio, kv.get("algorithm", DEFAULT_ALGORITHM))
    try:
        validate(s)
    except HostError as e:
        raise HostError(f"{path}: {e}") from None
    return s


def _generator_block(settings: ZramSettings) -> list[str]:
    text = shipped("host/zram/zram-generator.conf")
    text = set_keys(text, {"zram-size": max(1, settings.size // 1024**2),
                           "compression-algorithm": settings.algorithm, "swap-priority": settings.priority})
    return text.splitlines(keepends=True)


def _split_zram0(lines: list[str]) -> tuple[int, int] | None:
    """(start, end) line indexes of the [zram0] section, our marker comments included."""
    start = next((i for i, ln in enumerate(lines) if (m := _SECTION.match(ln)) and m.group(1).strip() == "zram0"), None)
    if start is None:
        return None
    end = next((i for i in range(start + 1, len(lines)) if _SECTION.match(lines[i])), len(lines))
    # our section starts with our marker comment, a few comment lines above the header
    j = start
    while j > 0 and lines[j - 1].startswith("#"):
        j -= 1
        if lines[j].startswith(GENERATOR_MARK):
            return j, end
    return start, end


def merge_generator_conf(existing: str | None, settings: ZramSettings) -> str:
    """The generator config with its ``[zram0]`` section replaced by ours (or ours alone)."""
    block = _generator_block(settings)
    if existing is None:
        return "".join(block)
    lines = existing.splitlines(keepends=True)
    if lines and not lines[-1].endswith("\n"):
        lines[-1] += "\n"
    span = _split_zram0(lines)
    if span is None:
        sep = ["\n"] if lines and lines[-1].strip() else []
        return "".join(lines + sep + block)
    s, e = span
    return "".join(lines[:s] + block + lines[e:])


def persist(ch: Changes, root: str, settings: ZramSettings, manifest: Manifest | None = None,
            force: bool = True) -> str:
    """Make the zram swap come back at boot (generator config, or /etc/sparkguard/zram.conf).

    Args:
        manifest: install's record; /etc/sparkguard/zram.conf is recorded in it when written,
            so that ``install`` and ``uninstall`` know it as sparkguard's (None: not recorded).
        force: overwrite a zram.conf edited since sparkguard wrote it (``install-zram`` does:
            setting the swap is what it was asked for; ``install`` only with ``--force``).
    Returns:
        str, what happened to zram.conf ("created", "updated", "unchanged", "kept") or
        "generator" when systemd-zram-generator's config was used.
    Raises:
        HostError: a file cannot be written.
    """
    gen = generator_installed(root)
    if gen:
        path = in_root(root, GENERATOR_CONF)
        cur = read_text(path)
        new = merge_generator_conf(cur, settings)
        if cur == new:
            ch.note("unchanged", GENERATOR_CONF, "systemd-zram-generator, [zram0]")
        else:
            orig_path = in_root(root, GENERATOR_ORIG)
            if (cur is None or GENERATOR_MARK not in cur) and not os.path.exists(orig_path):
                if not ch.dry_run:
                    atomic_write(orig_path, json.dumps({"existed": cur is not None, "text": cur or ""}) + "\n", 0o600)
                ch.note("created", GENERATOR_ORIG, "what our [zram0] replaces, for --remove")
            if not ch.dry_run:
                try:
                    atomic_write(path, new)
                except OSError as e:
                    raise HostError(f"cannot write {path}: {e.strerror}") from None
            ch.note("created" if cur is None else "updated", GENERATOR_CONF,
                    f"systemd-zram-generator ({gen}) found: [zram0] = {settings.describe()}")
        # never two devices at boot: the oneshot's config goes when the generator owns zram
        remove_file(ch, root, CONF_PATH)
        if manifest is not None:
            manifest.forget(CONF_PATH)
        return "generator"
    return install_file(ch, root, CONF_PATH, render_conf(settings), manifest=manifest, force=force,
                        detail=f"applied at boot by sparkguard-setup.service: {settings.describe()}")


def conf_is_ours(root: str, manifest: Manifest | None = None) -> bool:
    """True when ``<root>/etc/sparkguard/zram.conf`` is as sparkguard wrote it: its hash is the
    one recorded in ``manifest``, or, with no record of it, it is exactly what :func:`render_conf`
    makes of its own values (a zram.conf written before the manifest recorded it)."""
    text = read_text(in_root(root, CONF_PATH))
    if text is None:
        return False
    if manifest is not None and CONF_PATH in manifest.files:
        return manifest.untouched(CONF_PATH, text)
    try:
        settings = read_conf(root)
    except HostError:
        return False
    return settings is not None and text == render_conf(settings)


def generator_settings(root: str) -> ZramSettings | None:
    """The settings of our ``[zram0]`` section in the generator config under ``root``, or None
    (no config, not ours, or a value that does not parse)."""
    from sparkguard.host.files import parse_keys

    text = read_text(in_root(root, GENERATOR_CONF))
    if not text or GENERATOR_MARK not in text:
        return None
    lines = text.splitlines(keepends=True)
    span = _split_zram0(lines)
    if span is None:
        return None
    kv = parse_keys("".join(ln for ln in lines[span[0]:span[1]] if not _SECTION.match(ln)))
    try:
        return ZramSettings(int(kv["zram-size"]) * 1024**2, int(kv["swap-priority"]), kv["compression-algorithm"])
    except (KeyError, ValueError):
        return None


def persisted_settings(root: str, manifest: Manifest | None = None) -> ZramSettings | None:
    """The zram settings sparkguard persisted under ``root`` (by ``install`` or ``install-zram``),
    or None when there are none, or the file was edited by someone else."""
    if generator_installed(root):
        return generator_settings(root)
    if not conf_is_ours(root, manifest):
        return None
    return read_conf(root)


def configured(root: str) -> str | None:
    """Where a sparkguard zram boot configuration exists under ``root`` (path), or None."""
    if os.path.exists(in_root(root, CONF_PATH)):
        return CONF_PATH
    text = read_text(in_root(root, GENERATOR_CONF))
    if text and GENERATOR_MARK in text:
        return GENERATOR_CONF
    return None


def unpersist(ch: Changes, root: str, manifest: Manifest | None = None) -> None:
    """Undo :func:`persist`: remove zram.conf (and forget it in ``manifest``), put back the
    generator's own ``[zram0]``.

    Raises:
        HostError: a file cannot be written.
    """
    remove_file(ch, root, CONF_PATH)
    if manifest is not None:
        manifest.forget(CONF_PATH)
    unpersist_generator(ch, root)


def unpersist_generator(ch: Changes, root: str) -> None:
    """Put back the ``[zram0]`` section of systemd-zram-generator's config that ours replaced
    (or remove the config when there was none before).

    Raises:
        HostError: a file cannot be written.
    """
    path = in_root(root, GENERATOR_CONF)
    cur = read_text(path)
    orig_path = in_root(root, GENERATOR_ORIG)
    orig = None
    if os.path.exists(orig_path):
        try:
            orig = json.loads(read_text(orig_path) or "{}")
        except ValueError:
            orig = None
    if cur is not None and GENERATOR_MARK in cur:
        lines = cur.splitlines(keepends=True)
        span = _split_zram0(lines)
        restored_block: list[str] = []
        if orig and orig.get("existed"):
            olines = orig.get("text", "").splitlines(keepends=True)
            ospan = _split_zram0(olines)
            if ospan:
                restored_block = olines[ospan[0]:ospan[1]]
        if span:
            lines = lines[:span[0]] + restored_block + lines[span[1]:]
        new = "".join(lines)
        if not (orig and orig.get("existed")) and not new.strip():
            remove_file(ch, root, GENERATOR_CONF)
        else:
            if not ch.dry_run:
                atomic_write(path, new)
            ch.note("restored", GENERATOR_CONF, "the [zram0] section sparkguard replaced")
    if orig is not None:
        remove_file(ch, root, GENERATOR_ORIG)

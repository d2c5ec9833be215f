"""The memory sysctls: read, guard-rail, apply now and persist for boot.

Values that turned livelocks into ordinary restarts on Sparks (FIELD-NOTES): zram swap
with ``vm.swappiness=180``, ``vm.watermark_scale_factor=100``, ``vm.page-cluster=0``.
Kernel reference: Documentation/admin-guide/sysctl/vm.rst (swappiness 0-200 since Linux
5.8; watermark_scale_factor in 1/10000 of memory, 1-3000).

The persisted file is ``/etc/sysctl.d/99-zz-sparkguard.conf``: files in sysctl.d apply in
lexical order of their names (sysctl.d(5)) and Debian's ``99-sysctl.conf`` (a link to
/etc/sysctl.conf) sorts after any ``99-<letter below s>...`` name, so ours is ``99-zz-``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from sparkguard import meminfo, sysinfo
from sparkguard.host import virt
from sparkguard.host.files import (Changes, HostError, Manifest, in_root, install_file, parse_keys, read_text,
                                   set_keys, shipped)
from sparkguard.units import format_size

SYSCTL_FILE = "/etc/sysctl.d/99-zz-sparkguard.conf"

#: the tuning, in file order
DEFAULTS: dict[str, int] = {"vm.swappiness": 180, "vm.watermark_scale_factor": 100, "vm.page-cluster": 0}

#: kernel ranges (vm.rst; page-cluster is capped at 31 by mm/swap.c)
RANGES: dict[str, tuple[int, int]] = {"vm.swappiness": (0, 200), "vm.watermark_scale_factor": (1, 3000),
                                      "vm.page-cluster": (0, 31)}

#: above this watermark_scale_factor tune refuses without --force
WATERMARK_MAX = 200
#: above this swappiness tune wants zram (or zswap) active
SWAPPINESS_DISK_MAX = 100

#: where systemd-sysctl looks, most important first (a name in an earlier folder hides
#: the same name in later ones); source: sysctl.d(5)
SYSCTL_DIRS = ("/etc/sysctl.d", "/run/sysctl.d", "/usr/local/lib/sysctl.d", "/usr/lib/sysctl.d", "/lib/sysctl.d")


def proc_path(key: str) -> str:
    """``vm.page-cluster`` -> ``/proc/sys/vm/page-cluster``."""
    return "/proc/sys/" + key.replace(".", "/")


def read(key: str) -> int | None:
    """Current integer value of sysctl ``key``, or None if unreadable."""
    try:
        with open(proc_path(key)) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def write(key: str, value: int) -> None:
    """Set sysctl ``key`` to ``value`` now.

    Raises:
        HostError: the kernel refuses (names key, value and the OS error; EACCES means
            not root or /proc/sys read-only, EINVAL out of range).
    """
    try:
        with open(proc_path(key), "w") as f:
            f.write(f"{value}\n")
    except OSError as e:
        raise HostError(f"setting {key} = {value} failed: {e.strerror} (writing {proc_path(key)})") from None


def check_writable() -> None:
    """Refuse, before any value is set, where /proc/sys cannot be written.

    Raises:
        HostError: /proc/sys is on a read-only mount (a container's, or one made read-only);
            names the mount and the container when one is detected.
    """
    cause = virt.read_only_cause(proc_path("vm.swappiness"))
    if cause:
        raise HostError(f"{cause}: the vm sysctls belong to the kernel, which only the host can change; "
                        f"nothing changed. Run `sparkguard tune` on the host, or write only the file with "
                        f"--no-apply")


@dataclass(frozen=True)
class Refusal:
    """A value a guard rail refuses: ``key``, ``value``, and ``reason`` for people."""

    key: str
    value: int
    reason: str


def mem_total() -> int:
    """MemTotal in bytes (0 if unreadable)."""
    try:
        return meminfo.read().get("MemTotal", 0)
    except OSError:
        return 0


def watermark_wall(factor: int, total: int | None = None) -> int:
    """Bytes the ``high`` watermarks take out of MemAvailable at ``watermark_scale_factor``.

    The gap between min, low and high watermarks is ``managed * factor / 10000`` per zone
    (mm/page_alloc.c ``__setup_per_zone_wmarks``) and MemAvailable subtracts the high
    watermarks, so about ``2 * MemTotal * factor / 10000`` (12.2 GiB at 500 on a 121.7 GiB Spark).
    """
    total = mem_total() if total is None else total
    return int(2 * total * factor / 10000)


def fast_swap() -> str | None:
    """Description of an active fast swap (zram, or zswap enabled), or None.

    Sources: /proc/swaps, /sys/module/zswap/parameters/enabled.
    """
    for s in sysinfo.read_swaps():
        if os.path.basename(s["filename"]).startswith("zram"):
            return f"zram {s['filename']} at priority {s['priority']}"
    try:
        with open("/sys/module/zswap/parameters/enabled") as f:
            if f.read().strip() in ("Y", "1"):
                return "zswap"
    except OSError:
        pass
    return None


def check_ranges(values: dict[str, int]) -> None:
    """Raises HostError (status 2) for a value the kernel would reject (names key, value, range)."""
    for k, v in values.items():
        lo, hi = RANGES[k]
        if not lo <= v <= hi:
            raise HostError(f"{k} = {v}: out of range; the kernel accepts {lo}-{hi}", 2)


def guard_rails(values: dict[str, int], fast: str | None = None, total: int | None = None) -> list[Refusal]:
    """Values ``tune`` refuses without ``--force``, each with the reason.

    Args:
        values: ``{key: value}`` to set.
        fast: :func:`fast_swap` result (an active zram/zswap description, or None).
        total: MemTotal in bytes (default: read now).
    Returns:
        list of Refusal (empty when all is well).
    """
    out = []
    wsf = values.get("vm.watermark_scale_factor")
    if wsf is not None and wsf > WATERMARK_MAX:
        out.append(Refusal("vm.watermark_scale_factor", wsf,
                           f"above {WATERMARK_MAX} the watermarks wall memory out of MemAvailable: at {wsf} about "
                           f"{format_size(watermark_wall(wsf, total))} on this host (~12 GiB at 500 on a Spark), "
                           f"which looks exactly like a leak and makes the guard fire early; 100 is enough"))
    sw = values.get("vm.swappiness")
    if sw is not None and sw > SWAPPINESS_DISK_MAX and not fast:
        out.append(Refusal("vm.swappiness", sw,
                           f"above {SWAPPINESS_DISK_MAX} the kernel prefers swapping to dropping page cache, "
                           f"and no zram (or zswap) swap is active: that swapping would go to disk and stall. "
                           f"Set up zram first (sparkguard install-zram), or stay without zram with --swappiness 60"))
    return out


def render(values: dict[str, int]) -> str:
    """Text of the sysctl file for ``values`` (shipped sysctl.d/99-zz-sparkguard.conf)."""
    return set_keys(shipped("host/sysctl.d/99-zz-sparkguard.conf"), values)


def read_persisted(root: str = "/") -> dict[str, int] | None:
    """Our keys as persisted in ``<root>/etc/sysctl.d/99-zz-sparkguard.conf``; None when absent.

    Raises:
        HostError: a value is not an integer (names file, key, value).
    """
    path = in_root(root, SYSCTL_FILE)
    text = read_text(path)
    if text is None:
        return None
    out = {}
    for k, v in parse_keys(text).items():
        if k in DEFAULTS:
            try:
                out[k] = int(v)
            except ValueError:
                raise HostError(f"{path}: {k}: {v!r}: expected an integer") from None
    return out


def boot_files(root: str = "/") -> list[str]:
    """sysctl.d files under ``root`` in the order systemd-sysctl applies them (target paths).

    Files sort by name across SYSCTL_DIRS; a name in an earlier folder hides the same
    name in a later one (sysctl.d(5)).
    """
    seen: dict[str, str] = {}
    for d in SYSCTL_DIRS:
        try:
            names = os.listdir(in_root(root, d))
        except OSError:
            continue
        for n in names:
            if n.endswith(".conf") and n not in seen:
                seen[n] = f"{d}/{n}"
    return [seen[n] for n in sorted(seen)]


def overrides(root: str, values: dict[str, int]) -> list[tuple[str, str, str]]:
    """Files that would undo our ``values`` at boot: ``[(file, key, their value)]``.

    Those sorting after ours in systemd-sysctl order, and /etc/sysctl.conf, which
    procps ``sysctl --system`` reads last of all.
    """
    files = boot_files(root)
    name = os.path.basename(SYSCTL_FILE)
    later = [f for f in files if os.path.basename(f) > name]
    if "/etc/sysctl.conf" not in later:
        later.append("/etc/sysctl.conf")
    out = []
    for f in later:
        text = read_text(in_root(root, f))
        if not text:
            continue
        for k, v in parse_keys(text).items():
            if k in values and v != str(values[k]):
                out.append((f, k, v))
    return out


def persist(ch: Changes, root: str, values: dict[str, int], manifest: Manifest | None = None) -> None:
    """Write ``values`` to the sysctl file under ``root`` (created/updated/unchanged), recording
    it in ``manifest`` (install's record) so that ``install`` and ``uninstall`` know it as
    sparkguard's.

    Raises:
        HostError: cannot write it.
    """
    install_file(ch, root, SYSCTL_FILE, render(values), manifest=manifest, force=True)


def installed_values(root: str, manifest: Manifest | None) -> dict[str, int]:
    """The values ``install`` writes: the defaults, then those of a sysctl file sparkguard wrote
    (``install`` or ``tune``; hash in ``manifest``), so a re-run keeps what ``tune`` set.
    An edited or unreadable file contributes nothing (install keeps it or, with --force,
    replaces it with the defaults)."""
    values = dict(DEFAULTS)
    text = read_text(in_root(root, SYSCTL_FILE))
    if text is not None and manifest is not None and manifest.untouched(SYSCTL_FILE, text):
        try:
            persisted = read_persisted(root) or {}
            check_ranges(persisted)
        except HostError:
            persisted = {}
        values.update(persisted)
    return values


def apply(ch: Changes, values: dict[str, int]) -> None:
    """Set each of ``values`` now, printing ``key: before -> after`` (read back) or unchanged.

    Raises:
        HostError: a write fails, or the kernel shows another value after the write.
    """
    for k, v in values.items():
        before = read(k)
        if before == v:
            ch.note("unchanged", k, f"{v}")
            continue
        if not ch.dry_run:
            write(k, v)
            after = read(k)
            if after != v:
                raise HostError(f"{k}: wrote {v} but the kernel shows {after}")
        ch.note("applied", k, f"{before} -> {v}")

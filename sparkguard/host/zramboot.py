"""zram swap at boot: systemd-zram-generator's config, or /etc/sparkguard/zram.conf.

One of:
  * systemd-zram-generator installed (its binary in ``/usr/lib`` or ``/lib``
    ``/systemd/system-generators/zram-generator``): its ``/etc/systemd/zram-generator.conf``
    gets our ``[zram0]`` section in place of Debian's default one (never a second
    device); the replaced text is saved and put back by ``--remove``.  Source:
    zram-generator.conf(5).
  * otherwise ``/etc/sparkguard/zram.conf``, read by ``sparkguard-setup.service``
    (``sparkguard install-zram --boot``).
Every path is taken below an install ``root``.
"""

from __future__ import annotations

import json
import os
import re

from sparkguard.host.files import (Changes, HostError, Manifest, atomic_write, in_root, install_file, parse_keys,
                                   read_text, remove_file, set_keys, shipped)
from sparkguard.host.zram import DEFAULT_ALGORITHM, DEFAULT_PRIORITY, DEFAULT_SIZE, ZramSettings, validate
from sparkguard.units import format_size, parse_size

CONF_PATH = "/etc/sparkguard/zram.conf"
GENERATOR_CONF = "/etc/systemd/zram-generator.conf"
GENERATOR_BINARIES = ("/usr/lib/systemd/system-generators/zram-generator",
                      "/lib/systemd/system-generators/zram-generator")
#: the generator config text our [zram0] section replaced (JSON {"existed": bool, "text": str})
GENERATOR_ORIG = "/var/lib/sparkguard/zram-generator.conf.orig.json"
#: first line of our section in the generator config: marks it as ours
GENERATOR_MARK = "# sparkguard: zram0 swap"

_SECTION = re.compile(r"^\s*\[([^\]]*)\]\s*$")


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

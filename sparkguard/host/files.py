"""Shipped files, writes under an install root, and the report of what changed.

Every host command prints one line per thing it touched (``created``, ``updated``,
``removed``, ``unchanged``, ``kept``...), or what it would do under ``--dry-run``, so a
second run visibly changes nothing.  Files are written atomically (:func:`atomic_write`: the
one writer of the product's files), so a crash never leaves half a unit file behind.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import re
import sys
import tempfile
from importlib import resources
from typing import TextIO

#: where ``sparkguard install`` records the sha256 of each file it wrote (root-relative)
MANIFEST_PATH = "/var/lib/sparkguard/installed.json"

#: verbs that mean the system was (or would be) changed
CHANGING = {"created", "updated", "removed", "ran", "set up", "torn down", "applied", "restored"}


class HostError(Exception):
    """A host command cannot do what was asked; the message says what and how to fix it.

    ``status`` is the exit status the command returns (1: failed, 2: refused or bad input).
    """

    def __init__(self, message: str, status: int = 1):
        super().__init__(message)
        self.status = status


class Changes:
    """Prints and counts what a command does.

    Args:
        dry_run: bool; when True every change is printed as ``would <verb>`` and the
            caller must not perform it (callers test :attr:`dry_run` themselves).
        out: text stream for the report (default stdout).
        quiet_unchanged: bool; when True ``unchanged`` lines are counted, not printed, so that a
            re-run prints only what changed (``sparkguard install``).
        show_diff: bool; when True (with ``dry_run``) :func:`install_file` prints the unified
            diff of each file it would create or change.
    """

    def __init__(self, dry_run: bool = False, out: TextIO | None = None, quiet_unchanged: bool = False,
                 show_diff: bool = False):
        self.dry_run = dry_run
        self.out = out or sys.stdout
        self.changed = 0
        self.unchanged = 0
        self.quiet_unchanged = quiet_unchanged
        self.show_diff = show_diff
        self.warnings: list[str] = []

    def note(self, verb: str, what: str, detail: str = "") -> None:
        """Report one action: ``verb`` such as ``"created"``, ``what`` a path or device."""
        if verb == "unchanged":
            self.unchanged += 1
            if self.quiet_unchanged:
                return
        if verb in CHANGING:
            self.changed += 1
            if self.dry_run:
                verb = "would " + {"created": "create", "updated": "update", "removed": "remove",
                                   "ran": "run", "set up": "set up", "torn down": "tear down",
                                   "applied": "apply", "restored": "restore"}[verb]
        line = f"{verb:<13} {what}"
        if detail:
            line += f"  ({detail})"
        print(line, file=self.out, flush=True)

    def warn(self, message: str) -> None:
        """Print a warning line (to the same stream, so the report keeps its order)."""
        self.warnings.append(message)
        print(f"WARNING: {message}", file=self.out, flush=True)

    def info(self, message: str) -> None:
        """Print a free-form line."""
        print(message, file=self.out, flush=True)

    def diff(self, path: str, old: str | None, new: str) -> None:
        """Print the unified diff (difflib) from ``old`` (None: no file) to ``new`` of the file at
        ``path``, after its ``would create/update`` line (``a/`` and ``b/`` prefixes as git writes
        them, so ``patch -p1`` in / applies the output)."""
        lines = difflib.unified_diff((old or "").splitlines(keepends=True), new.splitlines(keepends=True),
                                     fromfile="/dev/null" if old is None else f"a{path}", tofile=f"b{path}")
        for line in lines:
            self.info(line.rstrip("\n") + ("" if line.endswith("\n") else "\n\\ No newline at end of file"))

    def summary(self) -> None:
        """Print the closing line: how many changes, or that nothing changed."""
        if self.changed == 0:
            kept = f" ({self.unchanged} unchanged)" if self.quiet_unchanged and self.unchanged else ""
            self.info(f"no changes: everything was already in place{kept}")
        elif self.dry_run:
            self.info(f"dry run: {self.changed} change(s) not made")


def shipped(relpath: str) -> str:
    """Text of a file shipped with sparkguard under ``sparkguard/data/``.

    Args:
        relpath: path below ``sparkguard/data``, such as ``"host/systemd/sparkguard.service"``.
    Returns:
        str, the file's text.
    Raises:
        HostError: the file is not part of this installation (names it).
    """
    res = resources.files("sparkguard").joinpath("data", *relpath.split("/"))
    try:
        return res.read_text(encoding="utf-8")
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        raise HostError(f"sparkguard/data/{relpath} is not part of this installation of sparkguard "
                        f"(package data missing; reinstall sparkguard, or use a release that ships it)") from None


def in_root(root: str, path: str) -> str:
    """``path`` (absolute, as seen on the target) below install root ``root``."""
    return os.path.join(root, path.lstrip("/")) if root not in ("", "/") else path


def read_text(path: str) -> str | None:
    """Text of ``path``, or None when it does not exist."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except FileNotFoundError:
        return None


def sha256(text: str) -> str:
    """Hex sha256 of ``text`` encoded as UTF-8."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def atomic_write(path: str, data: str | bytes, mode: int = 0o644) -> None:
    """Replace ``path`` with ``data`` atomically and durably, creating parent folders (mode 0755).

    A temporary file with a name unique to this call (``tempfile.mkstemp``, so two threads or
    processes writing the same path never share one) is written in the same folder, given
    ``mode`` (exactly: ``fchmod``, not filtered by the umask), fsynced, renamed over ``path``
    (atomic within one file system, rename(2)), and the folder is fsynced so that the new name
    itself survives a crash (fsync(2)).  A reader sees the old file or the new one, never a
    part; on failure the temporary file is removed.  On tmpfs (/run) both fsyncs return at once.

    Args:
        path: the file to replace.
        data: str (written as UTF-8) or bytes.
        mode: permission bits of the new file.
    Raises:
        OSError: the folder or file cannot be written.
    """
    raw = data.encode("utf-8") if isinstance(data, str) else data
    d = os.path.dirname(path) or "."
    os.makedirs(d, mode=0o755, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".sparkguard-", dir=d)
    try:
        try:
            os.fchmod(fd, mode)
            view = memoryview(raw)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def set_keys(text: str, values: dict[str, object]) -> str:
    """Replace the value of each ``key = value`` line of ``text`` whose key is in ``values``.

    Comments and other lines are kept.  Raises KeyError when a key has no line (the
    shipped template and the code disagree).
    """
    for key, value in values.items():
        pat = re.compile(r"^(\s*" + re.escape(key) + r"\s*=\s*).*$", re.M)
        text, n = pat.subn(lambda m: m.group(1) + str(value), text)
        if n == 0:
            raise KeyError(f"no line for {key} in template")
    return text


def parse_keys(text: str) -> dict[str, str]:
    """``key = value`` lines of a sysctl.d-style file as ``{key: value}``; comments skipped.

    A leading ``-`` (systemd-sysctl: ignore errors) is dropped from the key.
    Source: sysctl.d(5).
    """
    out: dict[str, str] = {}
    for line in text.splitlines():
        s = line.strip()
        if not s or s[0] in "#;" or "=" not in s:
            continue
        k, _, v = s.partition("=")
        out[k.strip().lstrip("-").replace("/", ".")] = v.strip()
    return out


class Manifest:
    """Record of the files ``sparkguard install`` wrote: ``{path: sha256}`` at MANIFEST_PATH.

    A file whose text still has the recorded hash is untouched since we wrote it and may
    be updated; any other existing file was edited (by a person or by ``tune`` /
    ``install-zram``) and is kept.
    """

    def __init__(self, root: str):
        self.root = root
        self.path = in_root(root, MANIFEST_PATH)
        text = read_text(self.path)
        try:
            data = json.loads(text) if text else {}
        except ValueError:
            data = {}
        self.files: dict[str, str] = dict(data.get("files") or {})

    def untouched(self, path: str, text: str) -> bool:
        """True when ``text`` (the file's current text) is what install last wrote to ``path``."""
        return self.files.get(path) == sha256(text)

    def record(self, path: str, text: str) -> None:
        """Remember that install wrote ``text`` to ``path``."""
        self.files[path] = sha256(text)

    def forget(self, path: str) -> None:
        """Drop ``path`` from the record."""
        self.files.pop(path, None)

    def save(self, version: str) -> str | None:
        """Write the record; returns its text.  An empty record removes the file (returns None):
        nothing sparkguard wrote is left to account for."""
        if not self.files:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            return None
        text = json.dumps({"version": version, "files": dict(sorted(self.files.items()))},
                          indent=2) + "\n"
        if read_text(self.path) != text:
            atomic_write(self.path, text)
        return text


def install_file(ch: Changes, root: str, path: str, text: str, manifest: Manifest | None,
                 mode: int = 0o644, force: bool = False, detail: str = "", kept_detail: str = "") -> str:
    """Put ``text`` at ``path`` under ``root`` without clobbering a file someone edited.

    Args:
        ch: report.
        root: install root ("/" for the running system).
        path: absolute path on the target.
        text: wanted content.
        manifest: hashes of what install wrote before (None: never overwrite a different file).
        mode: permission bits.
        force: overwrite even an edited file.
        detail: said after the path when the file is created or updated.
        kept_detail: said after the path when an edited file is kept (default: how to replace it).
    Returns:
        str, one of "created", "updated", "unchanged", "kept".
    Raises:
        HostError: the file cannot be written (names it and the OS error).
    """
    full = in_root(root, path)
    cur = read_text(full)
    if cur == text:
        ch.note("unchanged", path)
        verb = "unchanged"
    elif cur is None or force or (manifest is not None and manifest.untouched(path, cur)):
        verb = "created" if cur is None else "updated"
        if not ch.dry_run:
            try:
                atomic_write(full, text, mode)
            except OSError as e:
                raise HostError(f"cannot write {full}: {e.strerror}") from None
        ch.note(verb, path, detail)
        if ch.dry_run and ch.show_diff:
            ch.diff(path, cur, text)
    else:
        ch.note("kept", path, kept_detail or f"{edited_reason(manifest, path)}; --force replaces it")
        return "kept"
    if manifest is not None:
        manifest.record(path, text)
    return verb


def edited_reason(manifest: Manifest | None, path: str) -> str:
    """Why an existing file at ``path`` counts as someone else's: edited since sparkguard wrote
    it, or never recorded as written by sparkguard."""
    if manifest is not None and path in manifest.files:
        return "changed since sparkguard wrote it"
    return "not written by sparkguard (no record in " + MANIFEST_PATH + ")"


def remove_file(ch: Changes, root: str, path: str, quiet_missing: bool = True) -> bool:
    """Remove ``path`` under ``root``; returns True when it existed.

    Raises:
        HostError: it exists but cannot be removed.
    """
    full = in_root(root, path)
    if not os.path.lexists(full):
        if not quiet_missing:
            ch.note("absent", path)
        return False
    if not ch.dry_run:
        try:
            os.unlink(full)
        except OSError as e:
            raise HostError(f"cannot remove {full}: {e.strerror}") from None
    ch.note("removed", path)
    return True


def remove_empty_dirs(ch: Changes, root: str, *paths: str) -> None:
    """Remove each folder of ``paths`` (absolute on the target) if it exists and is empty."""
    for path in paths:
        full = in_root(root, path)
        try:
            if os.path.isdir(full) and not os.listdir(full):
                if not ch.dry_run:
                    os.rmdir(full)
                ch.note("removed", path + "/")
        except OSError:
            pass

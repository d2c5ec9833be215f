"""Values read from another host (its metrics page, its JSON over SSH) or from a file, made safe to use and print.

Another node's answer is input this host did not write: a field may have any JSON type, a number
may be 1e300, NaN or negative, a string may carry terminal control sequences (ESC [ ...), and
JSON may nest deeply enough to exhaust Python's recursion limit.  These helpers turn each into a
typed value or a ValueError, and every string into one that prints as text; they do no I/O.

A file is input too, and for a daemon that runs as root a file in a folder another user can
write is that user's: :func:`read_file` is the one way the daemon reads back a file of its own
(state, notes, results, incidents): no symlink followed (O_NOFOLLOW), no FIFO or device waited
on (O_NONBLOCK, then fstat: a regular file only), the owner one the caller trusts, not writable
by other users, at most ``limit`` bytes.  :func:`open_dir` opens a folder the same way, for
``dir_fd`` reads of a folder another user owns.  :func:`others_can_write` is sshd's StrictModes
for the configuration: why a user other than root (or this process's own) can change a file.
"""

from __future__ import annotations

import json
import math
import os
import stat
import time
import unicodedata
from typing import Any

#: characters kept of one remote string when printed
MAX_TEXT = 300
#: lists/objects nested at most this deep in a remote JSON answer (an incident record: about 5)
MAX_DEPTH = 64
#: the latest unix time shown as a date (year 2200); a later one is no real timestamp
MAX_STAMP = 7_258_118_400.0


def loads(text: str, max_depth: int = MAX_DEPTH) -> Any:
    """``json.loads(text)``, nested at most ``max_depth`` lists/objects deep.

    Raises ValueError for anything that is not JSON, for JSON nested past the recursion limit
    (RecursionError, which json raises for ``[[[[...]]]]``) and for JSON nested deeper than
    ``max_depth`` (what reads it later, a renderer or ``json.dumps``, recurses too)."""
    try:
        data = json.loads(text)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None
    except (ValueError, TypeError) as e:
        raise ValueError(f"not JSON: {clean(e, 200)}") from None
    stack = [(data, 1)]
    while stack:                        # iterative: the check itself must not recurse
        v, depth = stack.pop()
        if isinstance(v, (list, dict)):
            if depth > max_depth:
                raise ValueError(f"JSON nested deeper than {max_depth} levels")
            stack.extend((x, depth + 1) for x in (v.values() if isinstance(v, dict) else v))
    return data


def clean(v: Any, limit: int = MAX_TEXT) -> str:
    """``str(v)`` as printable text: every control and format character (Unicode categories
    Cc, Cf, Cs, Co, Cn: ESC, CR, NUL, DEL, C1 controls, bidi overrides) replaced by ``?``, at most
    ``limit`` characters (then ``...``)."""
    s = v if isinstance(v, str) else str(v)
    if len(s) > limit:
        s = s[:limit] + "..."
    return "".join("?" if unicodedata.category(c).startswith("C") else c for c in s)


def opt_str(v: Any, what: str) -> str | None:
    """``v`` when a str or None.  Raises ValueError naming ``what`` otherwise."""
    if v is None or isinstance(v, str):
        return v
    raise ValueError(f"{what}: expected a string, got {type(v).__name__}")


def str_tuple(v: Any, what: str) -> tuple[str, ...]:
    """``v`` (a list or tuple of str; None is empty) as a tuple.  Raises ValueError otherwise."""
    if v is None:
        return ()
    if isinstance(v, (list, tuple)) and all(isinstance(x, str) for x in v):
        return tuple(v)
    raise ValueError(f"{what}: expected a list of strings, got {clean(repr(v), 80)}")


def opt_int(v: Any, what: str) -> int | None:
    """``v`` when an int (not a bool) or None.  Raises ValueError otherwise."""
    if v is None or (isinstance(v, int) and not isinstance(v, bool)):
        return v
    raise ValueError(f"{what}: expected a whole number, got {clean(repr(v), 80)}")


def opt_time(v: Any, what: str) -> float | None:
    """``v`` when a finite number (unix seconds) or None.  Raises ValueError otherwise."""
    if v is None:
        return None
    if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
        return float(v)
    raise ValueError(f"{what}: expected unix seconds, got {clean(repr(v), 80)}")


def opt_dict(v: Any, what: str) -> dict:
    """``v`` when a dict; None is ``{}``.  Raises ValueError otherwise."""
    if v is None:
        return {}
    if isinstance(v, dict):
        return v
    raise ValueError(f"{what}: expected a mapping, got {type(v).__name__}")


def stamp(t: Any, fmt: str = "%Y-%m-%d %H:%M:%S", utc: bool = False) -> str:
    """``t`` (unix seconds) formatted with ``fmt`` in local time (UTC with ``utc``); ``"?"`` for
    anything that is no time this host can show: not a number, NaN, infinite, negative, after
    :data:`MAX_STAMP`, or one strftime refuses."""
    if not isinstance(t, (int, float)) or isinstance(t, bool) or not math.isfinite(t) or not 0 <= t <= MAX_STAMP:
        return "?"
    try:
        return time.strftime(fmt, time.gmtime(t) if utc else time.localtime(t))
    except (OverflowError, OSError, ValueError):
        return "?"



# ---- files another user may write -----------------------------------------------------------

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symbolic link"))


class FileRefused(OSError):
    """A file (or folder) this process will not read: a symlink, not a regular file, owned by a
    user it does not trust, writable by other users, or larger than the caller's bound.  ``str()``
    names the path and why."""

    def __init__(self, path: str, why: str):
        super().__init__(f"{path}: {why}")
        self.path, self.why = path, why


def trusted_uids() -> tuple[int, ...]:
    """The owners a file this process reads back may have: root and this process's own user."""
    return tuple(dict.fromkeys((0, os.geteuid())))


def kind_of(mode: int) -> str:
    """``"a FIFO"``, ``"a directory"``...: what an ``st_mode`` that is no regular file is."""
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def _owner(uid: int) -> str:
    import pwd
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def check_stat(path: str, st: os.stat_result, owners, want) -> None:
    """FileRefused unless ``st`` passes ``want`` (``stat.S_ISREG``...), is owned by one of
    ``owners`` (None: anyone) and is writable by no other user: write for others, or for a group
    other than root's, is refused."""
    if not want(st.st_mode):
        raise FileRefused(path, f"is {kind_of(st.st_mode)}")
    if owners is not None and st.st_uid not in owners:
        raise FileRefused(path, f"is owned by {_owner(st.st_uid)}, not by {' or '.join(_owner(u) for u in owners)}")
    if st.st_mode & stat.S_IWOTH or (st.st_mode & stat.S_IWGRP and st.st_gid != 0):
        raise FileRefused(path, f"is writable by other users (mode {stat.S_IMODE(st.st_mode):04o})")


def open_dir(path: str, owners=None) -> int:
    """A descriptor of the folder ``path`` (O_DIRECTORY|O_NOFOLLOW: the last component is no
    symlink), owned by one of ``owners`` (default :func:`trusted_uids`) and writable by no other
    user; for :func:`read_file`'s ``dir_fd``.  The caller closes it.

    Raises:
        FileRefused: a symlink, not a folder, another owner, writable by others.
        OSError: it cannot be opened (FileNotFoundError: it does not exist).
    """
    owners = trusted_uids() if owners is None else owners
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        if e.errno in (40, 20):     # ELOOP, or ENOTDIR (O_DIRECTORY met the symlink first): which one
            raise FileRefused(path, "is a symbolic link" if os.path.islink(path) else "is not a directory") from None
        raise
    try:
        check_stat(path, os.fstat(fd), owners, stat.S_ISDIR)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_fd(fd: int, limit: int) -> bytes:
    """At most ``limit + 1`` bytes of the open ``fd`` (more than ``limit`` tells the caller the file
    is too large), so /dev/zero or a file that grows cannot take memory.  Raises OSError."""
    chunks, left = [], limit + 1
    while left > 0:
        chunk = os.read(fd, min(left, 65536))
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def read_file(path: str, limit: int, owners=None, dir_fd: int | None = None) -> bytes:
    """The bytes of the regular file ``path``, read as a file another user may have put there.

    Opened with O_NOFOLLOW (a symlink is refused, never followed: ELOOP, open(2)) and O_NONBLOCK
    (a FIFO without a writer cannot hang the caller; open(2) returns at once for a reader), then
    checked on the descriptor (fstat: no race with a rename): a regular file, owned by one of
    ``owners`` (None: :func:`trusted_uids`), not writable by other users.  At most
    ``limit + 1`` bytes are read, so a file that grows cannot take memory.

    Args:
        path: the file (relative to ``dir_fd`` when given: a folder :func:`open_dir` opened).
        limit: bytes the file may hold at most.
    Raises:
        FileRefused: a symlink, not a regular file, another owner, writable by others, over ``limit``.
        OSError: it cannot be opened or read (FileNotFoundError: it does not exist).
    """
    owners = trusted_uids() if owners is None else owners
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError as e:
        if e.errno == 40:                           # ELOOP: O_NOFOLLOW met a symlink
            raise FileRefused(path, "is a symbolic link") from None
        if e.errno == 6:                            # ENXIO: a socket
            raise FileRefused(path, "is a socket") from None
        raise
    try:
        check_stat(path, os.fstat(fd), owners, stat.S_ISREG)
        data = read_fd(fd, limit)
        if len(data) > limit:
            raise FileRefused(path, f"holds more than {limit} bytes")
        return data
    finally:
        os.close(fd)


def others_can_write(path: str) -> str | None:
    """Why a user other than root or this process's own can change the file ``path`` (sshd's
    StrictModes: sshd(8), secure_path), or None when none can.

    The file (symlinks resolved) and every folder above it, and every folder above the path as
    written, must be owned by root or this process's user and writable by no other user: neither
    for others nor for a group other than root's.  A folder with the sticky bit (/tmp) may be
    writable by all: no other user can rename or remove what it holds that is not theirs
    (unlink(2), EPERM with S_ISVTX).

    Returns:
        str naming the file or folder, its owner and mode, and how to fix it; None when safe.
        A path that cannot be examined (missing folder) is None: the read that follows says why.
    """
    owners = trusted_uids()
    real = os.path.realpath(path)
    seen = []
    for start in (real, os.path.abspath(path)):
        p = start
        while True:
            if p not in seen:
                seen.append(p)
            parent = os.path.dirname(p)
            if parent == p:
                break
            p = parent
    for p in seen:
        if p == os.path.abspath(path) and p != real:
            continue                                # the symlink itself: its target is checked
        try:
            st = os.stat(p)
        except OSError:
            return None
        sticky_dir = stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_ISVTX
        mode = stat.S_IMODE(st.st_mode)
        fix = None
        if st.st_uid not in owners:
            fix = f"chown root {p}"
        elif st.st_mode & stat.S_IWOTH and not sticky_dir or st.st_mode & stat.S_IWGRP and st.st_gid != 0:
            fix = f"chmod go-w {p}"
        if fix is not None:
            what = "the file" if p == real else "its folder"
            return (f"{what} {p} (owner {_owner(st.st_uid)}, mode {mode:04o}) can be changed by a user other than "
                    f"root: refused, as sshd's StrictModes does (the daemon runs engine.command from it as root); "
                    f"fix: {fix}")
    return None

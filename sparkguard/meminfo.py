"""The one parser of /proc/meminfo: the poll loop's hot-path reader and the whole-file parse.

The file is opened once and re-read with ``pread`` at offset 0 into a preallocated
buffer: the kernel regenerates the text on every read (``meminfo_proc_show``), so no
reopen is needed.  Only MemAvailable and SwapFree are parsed per poll; the raw text of
the last read is kept so that an incident can snapshot every field after the fact.
:func:`parse` / :func:`read` turn the whole text into ``{field: bytes}`` for reports, off the
poll loop, taking the guard's own fields from the same :func:`field`.
Source: Documentation/filesystems/proc.rst ("meminfo"); MemAvailable exists since 3.14.
"""

from __future__ import annotations

import functools
import os
import re

# Labels carry the newline that ends the line before: a field is found only where its line starts
# (a line "XMemAvailable:" is not MemAvailable).  MemTotal is the kernel's first line; a field at
# offset 0 is handled by :func:`field`.
_AVAIL = b"\nMemAvailable:"
AVAIL_LABEL = _AVAIL
_AVAIL_FIRST = _AVAIL[1:]       # the label as a text's first line
_SWAPFREE = b"\nSwapFree:"
_SWAPTOTAL = b"\nSwapTotal:"
_MEMTOTAL = b"\nMemTotal:"
_KB = b"kB"
_NL = b"\n"
#: fields :class:`MeminfoReader` parses, as ``(name, label)``; :func:`parse` takes these from
#: :func:`field` so every reader of them agrees with the guard
GUARD_FIELDS = (("MemTotal", _MEMTOTAL), ("MemAvailable", _AVAIL), ("SwapTotal", _SWAPTOTAL),
                ("SwapFree", _SWAPFREE))


def field(buf: bytes | bytearray, label: bytes, n: int | None = None) -> int | None:
    """The value in bytes of the ``kB`` line whose name is ``label`` (``b"\\nMemAvailable:"``).

    The one parser of the guard's fields, and of the ``Name: N kB`` lines of the other /proc
    files written the same way (/proc/PID/status ``VmRSS:``, smaps_rollup ``SwapPss:``).  Only a
    line that starts with the name matches (the first such line, or the text's first line); the
    value must be ASCII digits then ``kB``.

    Args:
        buf: /proc/meminfo text (or a file of the same form); n: its length in ``buf`` (default
            all of it).
    Returns:
        bytes (kB * 1024), or None when the line is absent.
    Raises:
        ValueError: the line is there but its value is not ``<digits> kB``.
    """
    if n is None:
        n = len(buf)
    if buf.startswith(label[1:], 0, n):
        i = len(label) - 1
    else:
        i = buf.find(label, 0, n)
        if i < 0:
            return None
        i += len(label)
    e = buf.find(_NL, i, n)
    parts = buf[i:n if e < 0 else e].split()
    if len(parts) != 2 or parts[1] != _KB or not parts[0].isdigit():
        raise ValueError(f"unparsable {label[1:].decode()} line: {bytes(buf[i:n if e < 0 else e])!r}")
    return int(parts[0]) * 1024


def parse(text: bytes | str) -> dict[str, int]:
    """Parse /proc/meminfo text into ``{field: bytes}``.

    Fields given in kB are converted to bytes; unit-less fields (HugePages_Total...) are
    kept as counts.  A name counts only at the start of its line (no leading blank) and the
    first line of a name wins; malformed lines are skipped, never fatal.  The guard's own
    fields (:data:`GUARD_FIELDS`: MemTotal, MemAvailable, SwapTotal, SwapFree) come from
    :func:`field`, the parser the poll loop uses, so a report shows the value the guard acted
    on; one of them whose line is malformed is left out.
    Source: Documentation/filesystems/proc.rst, "meminfo".
    """
    raw = text if isinstance(text, bytes) else text.encode("ascii", "replace")
    text = raw.decode("ascii", "replace")
    out: dict[str, int] = {}
    for line in text.splitlines():
        key, sep, rest = line.partition(":")
        if not sep or not key or key != key.strip() or key in out:
            continue
        parts = rest.split()
        if not parts or not parts[0].isdigit():
            continue
        n = int(parts[0])
        out[key] = n * 1024 if len(parts) > 1 and parts[1] == "kB" else n
    for name, label in GUARD_FIELDS:
        try:
            v = field(raw, label)
        except ValueError:
            v = None
        if v is None:
            out.pop(name, None)
        else:
            out[name] = v
    return out


def read(path: str = "/proc/meminfo") -> dict[str, int]:
    """The file at ``path`` (/proc/meminfo, or a copy of one) as :func:`parse` gives it
    (``{field: bytes}``).

    Raises:
        OSError: the file cannot be read (the caller decides what that means).
    """
    with open(path, "rb") as f:
        return parse(f.read())


#: the MemAvailable line as the kernel lays it out: fs/proc/meminfo.c meminfo_proc_show() calls
#: show_val_kb(m, "MemAvailable:   ", available), which prints the value right-aligned in 8
#: columns (seq_put_decimal_ull_width(m, s, kb, 8): wider only from 10^8 kB on) and then " kB\n"
FAST_LABEL = _AVAIL_FIRST + b"   "
_FAST_VALUE = len(FAST_LABEL)           # offset of the value's 8 columns from the label's start
FAST_SPAN = _FAST_VALUE + 12            # the label, 8 columns, " kB\n"


def fast_layout(buf: bytes | bytearray, n: int) -> int:
    """Where the idle fast path finds MemAvailable in the text ``buf[:n]`` (a read of
    /proc/meminfo): the offset of its line when that line starts with :data:`FAST_LABEL`, spans
    :data:`FAST_SPAN` bytes at least and :func:`field` reads it, else -1 (the fast path then stays
    off).  The
    offset holds while MemTotal's and MemFree's values keep their widths; :func:`fast_check`'s
    pattern notices when they do not."""
    i = buf.find(_AVAIL, 0, n) + 1
    # a text whose first line is MemAvailable: field() reads that one (the kernel's first is MemTotal)
    if i <= 0 or buf.startswith(_AVAIL_FIRST) or not buf.startswith(FAST_LABEL, i, n) or i + FAST_SPAN > n:
        return -1
    try:
        if field(buf[i - 1:n], _AVAIL) is None:
            return -1
    except ValueError:
        return -1
    return i


#: significant digits of the floor (in kB) that :func:`fast_prefixes` tells apart: the fast path's
#: floor is rounded up by less than 1 %, to keep the prefixes few (72 at most, 36 for 7 digits)
FAST_DIGITS = 3
#: the end of the MemAvailable line after its value
FAST_END = b" kB\n"


def _rounded_kb(floor: int) -> int:
    """``floor`` bytes in whole kB (at least 1), rounded up to :data:`FAST_DIGITS` significant digits."""
    kb = max(1, -(-floor // 1024))
    q = 10 ** max(0, len(str(kb)) - FAST_DIGITS)
    return -(-kb // q) * q


def _leading(kb: int) -> list[bytes]:
    """The leading digits of every number of ``kb``'s width at or above ``kb`` (a number with
    nothing but zeros after its first :data:`FAST_DIGITS` digits): at each of those places a
    larger digit after the same ones, and those digits themselves."""
    digits = str(kb)[:FAST_DIGITS].encode()
    out = [digits[:i] + b"%d" % c for i in range(len(digits)) for c in range(digits[i] - 47, 10)]
    return out + [digits]


def fast_prefixes(floor: int) -> tuple[bytes, ...] | None:
    """The MemAvailable lines at or above ``floor`` bytes as byte prefixes, for the idle fast
    path's check (:func:`fast_check`): each is the newline that ends the line before (a field is
    found only where its line starts, as :func:`field` finds it), :data:`FAST_LABEL` and the
    start of the kernel's 8 columns (spaces, then digits) of a value at or above the floor,
    rounded up to whole kB and to :data:`FAST_DIGITS` significant digits.

    The kernel right-aligns the value in 8 columns, padded with spaces (fs/proc/meminfo.c:
    ``seq_put_decimal_ull_width(m, s, kb, 8)``).  A prefix with ``p`` spaces therefore pins the
    value at ``8 - p`` digits, and its digits give the value's leading ones; a prefix with no
    space matches every value of 8 digits or more that starts with its digits, all of them at
    least those digits followed by zeros to 8 digits, which the prefixes keep at or above the
    floor.  So a line starts with one of them only where its value is at or above the floor.

    Returns:
        the prefixes, the wider values' first (digits only), then the floor's width; None for a
        floor that rounds up to 10^8 kB or more (above 99,900,000 kB, 95.3 GiB): the 8 columns
        are full, and no prefix tells a value of 9 digits from one of 8.  A prefix without
        padding also matches the values of 9 digits or more that start with its digits, all
        above the floor; :func:`fast_check` covers the others.
    """
    kb = _rounded_kb(floor)
    width = len(str(kb))
    if width > 8:
        return None
    label = _NL + FAST_LABEL
    out = [label + b" " * (8 - w) + b"%d" % c for w in range(8, width, -1) for c in range(1, 10)]
    return tuple(out + [label + b" " * (8 - width) + lead for lead in _leading(kb)])


@functools.lru_cache(maxsize=8)
def _wide(width: int, kb: int):
    """``match`` of a compiled pattern for the MemAvailable line with a value of exactly ``width``
    digits (9 or more: no padding) at or above ``kb`` (a :func:`_rounded_kb`), or None where no
    value of that width is (``kb`` is wider)."""
    fw = len(str(kb))
    if width < fw:
        return None
    if width > fw:
        body = b"[1-9][0-9]{%d}" % (width - 1)
    else:
        body = b"(?:" + b"|".join(lead + b"[0-9]{%d}" % (width - len(lead)) for lead in _leading(kb)) + b")"
    return re.compile(re.escape(_NL + FAST_LABEL) + body + re.escape(FAST_END)).match


def fast_check(buf: bytearray, n: int, prefixes: tuple[bytes, ...] | None, floor: int) -> tuple | None:
    """What the idle fast path checks its reads with until the next full pass, made from that
    pass's read (``buf[:n]``; the reader's own buffer, which later reads overwrite), the floor
    (``floor`` bytes) and its :func:`fast_prefixes`: ``(check, first, offset)``, such
    that ``check(first, offset, m)`` after a later read of ``m`` bytes into ``buf`` is true only
    while MemAvailable is at or above the floor.  One call of a C method, no slice, no ``int()``:
    after the loop's 200 ms sleep each operation runs cold (bench/results/idle-parse.txt).

    - Where one of the prefixes matches this read (a value in the 8 columns, or a wider one
      whose digits a prefix without padding covers): ``buf.startswith(prefixes, offset, m)`` at
      the MemAvailable line's offset, the prefix this read matches first (``startswith`` stops
      at the first that matches).
    - Else, for a value of 9 to 20 digits (from 95.4 GiB; 20 digits hold any unsigned long): a
      compiled pattern's ``match(buf, offset, m)`` of the line, exactly that many digits at or
      above the floor, and " kB\n" (a value one digit narrower or wider moves the end).

    Both begin with the newline before the label, at the line's offset (``offset`` is that
    newline's): a line that moves (MemFree's width changed), a name inside another line or a
    short read (``m``) ends the fast path.  Both rely on the kernel's layout (padding, no
    leading zeros), so a check is made only from a read whose MemAvailable line is exactly as
    the kernel prints its value, which :func:`field` reads at or above the floor.

    Returns:
        the check, or None where there is none: the line is not laid out as the kernel's, the
        value is below the floor (rounded up as the prefixes are) or wider than 20 digits.
    """
    at = fast_layout(buf, n)
    if at < 0:
        return None
    kb = field(buf[at - 1:n], _AVAIL) >> 10         # fast_layout: it parses
    if kb << 10 < floor or not buf.startswith(FAST_LABEL + b"%8d kB\n" % kb, at, n):
        return None
    at -= 1
    for i, p in enumerate(prefixes or ()):
        if buf.startswith(p, at, n):
            return buf.startswith, prefixes if i == 0 else (p, *prefixes[:i], *prefixes[i + 1:]), at
    match = _wide(len(str(kb)), _rounded_kb(floor)) if 9 <= len(str(kb)) <= 20 else None
    if match is not None and match(buf, at, n):
        return match, buf, at
    return None


class MeminfoError(RuntimeError):
    """/proc/meminfo lacks a field the guard needs (e.g. MemAvailable on kernels < 3.14)."""


class MeminfoReader:
    """Samples MemAvailable and SwapFree (bytes) from an open /proc/meminfo.

    Attributes (plain ints, safe to read from another thread): ``mem_total`` (MemTotal at open),
    ``swap_total`` (SwapTotal at the last sample), bytes.

    Args:
        path: str, normally ``/proc/meminfo`` (tests may point at a copy).
    Raises:
        OSError: the file cannot be opened.
        MeminfoError: the first read finds no ``MemAvailable:`` line.
    """

    __slots__ = ("path", "_fd", "_fd_now", "_buf", "_view", "_n", "mem_total", "swap_total")

    def __init__(self, path: str = "/proc/meminfo"):
        self.path = path
        self._fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        self._fd_now = os.open(path, os.O_RDONLY | os.O_CLOEXEC)     # available_now's
        self._buf = bytearray(16384)
        self._view = [self._buf]
        self._n = 0
        self.mem_total = self.swap_total = 0
        self.sample()
        self.mem_total = self._field(_MEMTOTAL)

    def sample(self) -> tuple[int, int]:
        """Read the file now.

        Returns:
            ``(mem_available, swap_free)`` in bytes (swap_free is 0 without swap fields).
        Raises:
            OSError: the read failed (the caller logs it and polls again).
            MeminfoError: MemAvailable is missing or unparsable.
        """
        n = os.preadv(self._fd, self._view, 0)
        self._n = n
        b = self._buf
        try:
            avail = field(b, _AVAIL, n)
        except ValueError as e:
            raise MeminfoError(f"{self.path}: {e}") from None
        if avail is None:
            raise MeminfoError(f"{self.path}: no MemAvailable line (kernel older than 3.14?)")
        try:
            # swap added after start (zram set up later) shows up in the next sample
            t = field(b, _SWAPTOTAL, n)
            if t is not None:
                self.swap_total = t
            return avail, field(b, _SWAPFREE, n) or 0
        except ValueError:
            return avail, 0

    def _field(self, label: bytes) -> int:
        try:
            return field(self._buf, label, self._n) or 0
        except ValueError:
            return 0

    def inline_parts(self) -> tuple[int, list, bytearray]:
        """What the daemon's idle fast path needs to read MemAvailable without a method call.

        Returns:
            ``(fd, view, buf)``: the open descriptor, the ``[buf]`` list for ``os.preadv`` and the
            buffer itself.  A read through them must be followed by :meth:`sample` before
            :meth:`raw` is used (``raw`` reports the length of the last ``sample``).

        After 200 ms of sleep every line of Python runs cold (its code and data evicted): each
        call the idle path avoids saves microseconds, five times a second, forever.
        """
        return self._fd, self._view, self._buf

    def fast_check(self, prefixes: tuple[bytes, ...] | None, floor: int) -> tuple | None:
        """:func:`fast_check` of the last :meth:`sample`."""
        return fast_check(self._buf, self._n, prefixes, floor)

    def available_now(self) -> int | None:
        """MemAvailable (bytes) read now through a descriptor of its own, for other threads (the
        snapshot): the buffer the loop's thread reads into is not theirs to parse (a copy of it
        can meet the kernel's copy into it half done).  None where the read fails or its
        MemAvailable line does not parse."""
        try:
            return field(os.pread(self._fd_now, 16384, 0), _AVAIL)
        except (OSError, ValueError):
            return None

    def raw(self) -> bytes:
        """The text of the last read (bytes), for snapshots and metrics."""
        return bytes(self._buf[: self._n])

    def close(self) -> None:
        """Close the file descriptors."""
        for fd in (self._fd, self._fd_now):
            if fd >= 0:
                os.close(fd)
        self._fd = self._fd_now = -1

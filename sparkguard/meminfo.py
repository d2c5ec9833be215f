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

import os

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
_FAST_MAX_KB = 10**8                    # the first value wider than 8 columns


def fast_layout(buf: bytes | bytearray, n: int) -> int:
    """Where the idle fast path finds MemAvailable in the text ``buf[:n]`` (a read of
    /proc/meminfo): the offset of its line when that line starts with :data:`FAST_LABEL`, spans
    :data:`FAST_SPAN` bytes at least and :func:`field` reads it, else -1 (the fast path then stays
    off).  The
    offset holds while MemTotal's and MemFree's values keep their widths; :func:`fast_above`
    notices when they do not."""
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


def fast_floor(floor: int) -> tuple[int, bytes] | None:
    """What :func:`fast_above` compares a read with, for a floor of ``floor`` bytes (rounded up to
    whole kB): ``(width, pattern)``, the columns the floor's value takes (8, the kernel's minimum,
    or 9 from 10^8 kB on) and the 12 bytes the MemAvailable line would hold after its label
    (:data:`FAST_LABEL`) at exactly the floor (``b"%8d kB\n"``, or ``b"%9d kB"``).  None from 10^9
    kB (954 GiB) on: the fast path stays off."""
    kb = max(0, -(-floor // 1024))
    if kb >= _FAST_MAX_KB * 10:
        return None
    width = 8 if kb < _FAST_MAX_KB else 9
    return width, (b"%*d kB\n" % (width, kb))[:12]


def fast_above(buf: bytes | bytearray, n: int, off: int, width: int, pattern: bytes) -> bytearray | None:
    """The idle fast path's check: is MemAvailable in the text just read (``buf[:n]``) at or above
    the floor that :func:`fast_floor` gave ``(width, pattern)`` for?  ``off``: :func:`fast_layout`
    of an earlier read.

    Compared as bytes, with no ``int()``: after the loop's 200 ms sleep an ``int()`` of the value
    cost about 15-20 us per wake-up, a quarter of the whole read (bench/results/idle-parse.txt).
    The kernel right-aligns the value in 8 columns, padded with spaces, and widens the field only
    for a value that needs more.  The byte after the floor's ``width`` columns tells the widths
    apart: a space there means the value is exactly as wide as the floor (or, at width 8,
    narrower: padded with spaces, which sort below digits), and then the bytes compare as the
    numbers do; a digit means the value is wider, so above; anything else (the ``k`` of ``kB``
    at width 9) means it is narrower, so below.

    Returns:
        the 12 bytes after the label (the value, as the kernel printed it: :func:`fast_value`
        reads it) when the value is at or above the floor; None when it is below, or the line is
        not where ``off`` says, or the read is short: the caller then takes a full sample, whose
        parser (:func:`field`) reports what is wrong.  The columns are trusted to hold digits and
        spaces, as the kernel writes them; a file written otherwise is refused by that full
        sample, which the loop takes at least every ``settings.FULL_PASS_EVERY`` seconds.
    """
    if n < off + FAST_SPAN or not buf.startswith(FAST_LABEL, off):
        return None
    raw = buf[off + _FAST_VALUE:off + FAST_SPAN]
    c = raw[width]
    if c == 32:
        return raw if raw >= pattern else None
    return raw if 48 <= c <= 57 else None


def fast_value(raw: bytes | bytearray) -> int | None:
    """MemAvailable in bytes from what :func:`fast_above` returned, or None when the 12 bytes do
    not hold a whole value (one over 10 digits, 9.3 TiB: the caller keeps its last full sample)."""
    parts = raw.split()
    if len(parts) != 2 or not parts[0].isdigit() or not b"kB".startswith(parts[1]):
        return None
    return int(parts[0]) << 10


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

    __slots__ = ("path", "_fd", "_buf", "_view", "_n", "mem_total", "swap_total")

    def __init__(self, path: str = "/proc/meminfo"):
        self.path = path
        self._fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
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

    def fast_layout(self) -> int:
        """:func:`fast_layout` of the last :meth:`sample`."""
        return fast_layout(self._buf, self._n)

    def raw(self) -> bytes:
        """The text of the last read (bytes), for snapshots and metrics."""
        return bytes(self._buf[: self._n])

    def close(self) -> None:
        """Close the file descriptor."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

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
from typing import NamedTuple

# Labels carry the newline that ends the line before: a field is found only where its line starts
# (a line "XMemAvailable:" is not MemAvailable).  MemTotal is the kernel's first line; a field at
# offset 0 is handled by :func:`field`.
_AVAIL = b"\nMemAvailable:"
AVAIL_LABEL = _AVAIL
_AVAIL_FIRST = _AVAIL[1:]       # the label as a text's first line
_SWAPFREE = b"\nSwapFree:"
_SWAPTOTAL = b"\nSwapTotal:"
_MEMTOTAL = b"\nMemTotal:"
MEMTOTAL_LABEL = _MEMTOTAL
MEMFREE_LABEL = b"\nMemFree:"
_KB = b"kB"
_NL = b"\n"
#: fields :class:`MeminfoReader` parses, as ``(name, label)``; :func:`parse` takes these from
#: :func:`field` so every reader of them agrees with the guard
GUARD_FIELDS = (("MemTotal", _MEMTOTAL), ("MemAvailable", _AVAIL), ("SwapTotal", _SWAPTOTAL),
                ("SwapFree", _SWAPFREE))

#: the memory signals a guard can watch (config ``guard.signal``): MemAvailable alone, or
#: MemAvailable + SwapFree (swap counted as headroom)
SIGNALS = ("available", "available+swap")


def signal_bytes(kind: str, available: int, swap_free: int) -> int:
    """The memory signal ``kind`` (one of :data:`SIGNALS`), bytes, from MemAvailable and SwapFree
    (bytes, as :meth:`MeminfoReader.sample` gives them).  The poll loop itself takes the same sum
    from ``LoopSettings.swap``, decided once at start-up."""
    return available + swap_free if kind == "available+swap" else available


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
#: floors (kB) from which the idle fast path has no check (10^11 kB, 93 TiB): the widest window it
#: compares then reaches 12 columns, and a narrower value's " kB\n" must cover the column after it
FAST_MAX_FLOOR_KB = 10**11


def fast_layout(buf: bytes | bytearray, n: int) -> int:
    """Where the idle fast path finds MemAvailable in the text ``buf[:n]`` (a read of
    /proc/meminfo): the offset of its line when that line starts with :data:`FAST_LABEL`, spans
    :data:`FAST_SPAN` bytes at least and :func:`field` reads it, else -1 (the fast path then stays
    off).  The offset holds while MemTotal's and MemFree's values keep their widths;
    :class:`FastCheck` notices when they do not."""
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


class FastCheck(NamedTuple):
    """The idle fast path's check of MemAvailable against a floor, made by :func:`fast_check`.

    A read ``n = os.preadv(fd, view, 0)`` of /proc/meminfo lands the text before the
    MemAvailable line in ``view[0]``, the newline that ends that text, the line's label and the
    value's first ``m - 1`` columns in :attr:`window`, the value's ``m``-th column in
    :attr:`last`, and nothing more (the kernel still writes the whole text; it copies these
    bytes).  MemAvailable is at or above the floor where ::

        n == size and low <= window <= high and b"0" <= last <= b"9"

    Four byte-string compares and an int compare, no call, no slice, no parse: after the loop's
    200 ms sleep every operation runs cold (bench/results/idle-parse.txt).  :meth:`holds` is that
    expression, for tests; the loop writes it out.

    Why it holds, for any later read of the kernel's text (fs/proc/meminfo.c: the value
    right-aligned in 8 columns, wider from 10^8 kB on, no leading zeros, then " kB\\n"):

    - ``n == size``: the read filled every buffer (a short read would leave the window stale).
    - ``low`` and ``high`` begin with the newline and the label, so a window between them (in
      byte order) begins with them too: a line that moved (MemTotal or MemFree changed width), a
      name inside another line or another field where the line was, is outside.
    - Narrow (``m == 8``, a floor under 10^8 kB): ``low`` ends with the floor's kB divided by 10,
      rounded up, right-aligned in 7 columns.  Right-aligned numerals of one width sort in byte
      order as numbers do, so the value's first 7 columns at or above it mean a value at or above
      the floor; a value of 9 digits or more is above any such floor.  ``last`` is always a digit.
    - Wide (``m`` from 9 to 12, a value of 9 digits or more): ``low`` is either ``1`` and zeros
      (the floor has fewer than ``m`` digits) or the floor's first ``m - 1`` digits, rounded up
      (it has ``m``).  A window at or above it starts with a non-zero digit, so the value has 8
      digits at least; a digit in ``last`` means ``m`` digits at least, since a narrower value's
      " kB\\n" covers that column (``m`` - 8 <= 4).  With ``m`` digits its first ``m - 1`` compare
      as numbers; with more it is above the floor.

    Attributes:
        view: ``[head, window, last]``, the buffers of the read (bytearrays).
        size: the bytes a read into them returns (their lengths' sum).
        window: bytearray, the newline before the line, its label (:data:`FAST_LABEL`) and the
            value's first ``m - 1`` columns.
        low, high: bytes, the lowest and highest window that passes.
        last: bytearray of 1, the value's ``m``-th column.
    """

    view: list
    size: int
    window: bytearray
    low: bytes
    high: bytes
    last: bytearray

    def holds(self, n: int) -> bool:
        """True where a read of ``n`` bytes into :attr:`view` shows MemAvailable at or above the floor."""
        return n == self.size and self.low <= self.window <= self.high and b"0" <= self.last <= b"9"


def _fast_windows(kb: int, floor_kb: int) -> list[tuple[int, bytes]]:
    """The ``(m, low's digits)`` a check for a read of ``kb`` against ``floor_kb`` (whole kB,
    under :data:`FAST_MAX_FLOOR_KB`) may take (:class:`FastCheck`), narrow first."""
    lead = -(-floor_kb // 10)           # the value's first columns but its last, rounded up
    out = [(8, b"%7d" % lead if lead else b" " * 7)] if lead < 10**7 else []     # 7 blanks: any value
    d, f = len(str(kb)), len(str(floor_kb))
    if d > f and d >= 9:
        m = max(9, f + 1)
        out.append((m, b"1" + b"0" * (m - 2)))
    elif d == f >= 9 and len(str(lead)) == d - 1:
        out.append((d, b"%d" % lead))
    return out


def fast_check(buf: bytearray, n: int, floor: int) -> FastCheck | None:
    """The check the idle fast path makes its reads with until the next full pass
    (:class:`FastCheck`), made from that pass's read (``buf[:n]``) and the floor (``floor``
    bytes of MemAvailable).  It is made only from a read whose MemAvailable line is exactly as
    the kernel prints its value (padding, no leading zero), at or above the floor, and it holds
    on that read.

    Returns:
        the check, or None where there is none: the line is not laid out as the kernel's, the
        value is below the floor (in kB rounded up to tens: :class:`FastCheck` compares all but
        the last column), or the floor is :data:`FAST_MAX_FLOOR_KB` or more.
    """
    at = fast_layout(buf, n)
    if at < 0:
        return None
    kb = field(buf[at - 1:n], _AVAIL) >> 10         # fast_layout: it parses
    floor_kb = -(-floor // 1024)
    if kb < floor_kb or floor_kb >= FAST_MAX_FLOOR_KB or not buf.startswith(FAST_LABEL + b"%8d kB\n" % kb, at, n):
        return None
    label = _NL + FAST_LABEL
    for m, low in _fast_windows(kb, floor_kb):
        end = at + _FAST_VALUE + m - 1             # the window's end, where the m-th column is
        window, last = bytearray(buf[at - 1:end]), bytearray(buf[end:end + 1])     # this read's, to test it
        check = FastCheck([bytearray(at - 1), window, last], end + 1, window, label + low, label + b"9" * (m - 1),
                          last)
        if check.holds(end + 1):
            return check
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
        return self.last(label) or 0

    def last(self, label: bytes) -> int | None:
        """The ``kB`` field ``label`` (``MEMFREE_LABEL``) of the last :meth:`sample`, bytes; None
        where it is absent or does not parse (:func:`field`)."""
        try:
            return field(self._buf, label, self._n)
        except ValueError:
            return None

    @property
    def fd(self) -> int:
        """The descriptor :meth:`sample` reads through, for the idle fast path's reads into a
        :class:`FastCheck`'s buffers (``os.preadv(reader.fd, check.view, 0)``)."""
        return self._fd

    def fast_check(self, floor: int) -> FastCheck | None:
        """:func:`fast_check` of the last :meth:`sample` against ``floor`` bytes: its reads go
        through this reader's descriptor (:attr:`fd`)."""
        return fast_check(self._buf, self._n, floor)

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

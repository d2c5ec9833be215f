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
_AVAIL_VALUE_AT = len(_AVAIL)   # offset of the value from the label's start
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


def quick_available(buf: bytes | bytearray, n: int) -> int:
    """MemAvailable in bytes from the first ``n`` bytes of ``buf``, read the cheapest way: the idle
    fast path's parser (:meth:`MeminfoReader.inline_parts` gives the buffer it reads into).

    Two finds and an ``int()``: after a 200 ms sleep every line runs cold, and :func:`field`'s
    stricter checks cost about twice as much per wake-up.  It reads the line :func:`field` reads or
    gives up: a value it cannot parse raises, a label it does not find gives -1, and so does a text
    whose first line is MemAvailable (field() reads that one; the kernel's first line is MemTotal).
    The caller then reads with :meth:`MeminfoReader.sample`, which reports what is wrong.

    Raises:
        ValueError: the text after the label is not a number.
    """
    i = buf.find(_AVAIL, 0, n)
    if i < 0 or buf.startswith(_AVAIL_FIRST):
        return -1
    return int(buf[i + _AVAIL_VALUE_AT:buf.find(_KB, i, n)]) << 10


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

    def raw(self) -> bytes:
        """The text of the last read (bytes), for snapshots and metrics."""
        return bytes(self._buf[: self._n])

    def close(self) -> None:
        """Close the file descriptor."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

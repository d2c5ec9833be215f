"""The hot-path reader of /proc/meminfo.

The file is opened once and re-read with ``pread`` at offset 0 into a preallocated
buffer: the kernel regenerates the text on every read (``meminfo_proc_show``), so no
reopen is needed.  Only MemAvailable and SwapFree are parsed per poll; the raw text of
the last read is kept so that an incident can snapshot every field after the fact.
Source: Documentation/filesystems/proc.rst ("meminfo"); MemAvailable exists since 3.14.
"""

from __future__ import annotations

import os

_AVAIL = b"MemAvailable:"
AVAIL_LABEL = _AVAIL            # for the daemon's inline idle read (see MeminfoReader.inline_parts)
_SWAPFREE = b"SwapFree:"
_SWAPTOTAL = b"SwapTotal:"
_MEMTOTAL = b"MemTotal:"
_KB = b"kB"
KB = _KB


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
        i = b.find(_AVAIL, 0, n)
        if i < 0:
            raise MeminfoError(f"{self.path}: no MemAvailable line (kernel older than 3.14?)")
        i += 13
        j = b.find(_KB, i, n)
        try:
            avail = int(b[i:j]) * 1024
        except ValueError:
            raise MeminfoError(f"{self.path}: unparsable MemAvailable line {bytes(b[i - 13:j + 2])!r}") from None
        t = b.find(_SWAPTOTAL, j, n)
        if t >= 0:
            # swap added after start (zram set up later) shows up in the next sample
            try:
                self.swap_total = int(b[t + 10:b.find(_KB, t, n)]) * 1024
            except ValueError:
                pass
        k = b.find(_SWAPFREE, j, n)
        if k < 0:
            return avail, 0
        k += 9
        m = b.find(_KB, k, n)
        try:
            return avail, int(b[k:m]) * 1024
        except ValueError:
            return avail, 0

    def _field(self, name: bytes) -> int:
        b, n = self._buf, self._n
        i = b.find(name, 0, n)
        if i < 0:
            return 0
        try:
            return int(b[i + len(name):b.find(_KB, i, n)]) * 1024
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

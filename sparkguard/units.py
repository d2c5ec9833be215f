"""Parsing and formatting of sizes (bytes) and durations (seconds).

Sizes: an integer number of bytes (``805306368``) or a number with a binary or
decimal unit (``0.75GiB``, ``768MiB``, ``6G``, ``512k``).  Single-letter units and
``KiB/MiB/GiB/TiB`` are powers of 1024; ``KB/MB/GB/TB`` are powers of 1000.
Durations: a number of seconds (``20``, ``0.2``) or a number with a unit
(``200ms``, ``20s``, ``5m``, ``1h``, ``500us``).
Numbers are plain decimals: NaN, infinities, numbers that overflow a float (``1e400``) and
the YAML 1.1 forms ``010`` (octal), ``0x10``, ``0o10``, ``0b10``, ``1_000`` and ``1:30``
(sexagesimal) are refused with a reason, so no one silently gets another value.
"""

from __future__ import annotations

import itertools
import math
import re
import reprlib


class _BoundedRepr(reprlib.Repr):
    """``repr`` built from bounded pieces: at most 4 levels and 8 items a level, and a string's first
    400 characters, so a value whose aliases multiply (a list of 9 references to a list of 9
    references ...) costs at most ~4,000 items to show, never its expansion.  Mappings keep
    their order (reprlib's own sorts their keys)."""

    def __init__(self):
        super().__init__()
        self.maxlevel, self.maxother, self.maxlong = 4, 400, 400
        self.maxlist = self.maxtuple = self.maxdict = self.maxset = self.maxfrozenset = 8

    def repr_str(self, x: str, level: int) -> str:
        return repr(x[:400])

    def repr_dict(self, x: dict, level: int) -> str:
        if not x:
            return "{}"
        if level <= 0:
            return "{...}"
        items = [f"{self.repr1(k, level - 1)}: {self.repr1(v, level - 1)}"
                 for k, v in itertools.islice(x.items(), self.maxdict)]
        return "{" + ", ".join(items) + (", ..." if len(x) > self.maxdict else "") + "}"


_REPR = _BoundedRepr()


def shown(value, limit: int = 200) -> str:
    """A repr of ``value`` for an error message, built from bounded pieces (:class:`_BoundedRepr`)
    and cut to ``limit`` characters; an int too long for repr (Python >= 3.11 refuses more than
    4300 digits) is shown by its size.  Never raises."""
    try:
        text = _REPR.repr(value)
    except ValueError:
        return f"<a number of {value.bit_length()} bits>" if isinstance(value, int) else "<unprintable>"
    except Exception:  # noqa: BLE001 - a repr that fails must not hide the error being reported
        return f"<a {type(value).__name__}>"
    return text if len(text) <= limit else text[:limit] + "..."


_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1024, "kib": 1024, "kb": 1000,
    "m": 1024**2, "mib": 1024**2, "mb": 1000**2,
    "g": 1024**3, "gib": 1024**3, "gb": 1000**3,
    "t": 1024**4, "tib": 1024**4, "tb": 1000**4,
}
_DURATION_UNITS = {"": 1.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "m": 60.0, "min": 60.0, "h": 3600.0}
_NUM_UNIT = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([A-Za-z]*)\s*$")
_LEADING_ZERO = re.compile(r"^\s*[-+]?0[0-9]")
_OTHER_BASE = re.compile(r"^\s*[-+]?0[xXoObB]")


def refuse_yaml11_number(value: str) -> None:
    """Refuse the spellings a YAML 1.1 reader turns into another number than the decimal one.

    Source: YAML 1.1 int/float types (yaml.org/type/int.html, float.html), as PyYAML reads them.
    Raises:
        ValueError: naming the form and the value YAML 1.1 gives it.
    """
    if _OTHER_BASE.match(value):
        raise ValueError("a number in another base (0x, 0o, 0b); write it in decimal")
    if _LEADING_ZERO.match(value):
        raise ValueError("a leading zero: YAML 1.1 reads 010 as octal 8; write the number without it")
    if "_" in value:
        raise ValueError("'_' in a number: write the digits alone")
    if ":" in value:
        raise ValueError("a sexagesimal number: YAML 1.1 reads 1:30 as 90; write 90s or 1.5m")


def _finite(value: float) -> float:
    """``value`` if finite; ValueError for NaN and infinities (``.nan``, ``.inf``, ``1e400``)."""
    if math.isnan(value):
        raise ValueError("not a number (NaN)")
    if math.isinf(value):
        raise ValueError("infinite: expected a finite number (1e400 and larger read as inf)")
    return value


def parse_size(value: object) -> int:
    """Parse a size into bytes.

    Args:
        value: int (bytes) or str such as ``"0.75GiB"``, ``"768MiB"``, ``"805306368"``.
    Returns:
        int, bytes (rounded down).
    Raises:
        ValueError: not a size, negative, not finite, or a YAML 1.1 number form (see the module).
            bool is rejected (YAML ``yes``).
    """
    if isinstance(value, bool):
        raise ValueError(f"expected a size like 0.75GiB, got {shown(value)}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"size must not be negative, got {shown(value)}")
        return value
    if isinstance(value, float):
        if _finite(value) < 0:
            raise ValueError(f"size must not be negative, got {shown(value)}")
        return int(value)
    if not isinstance(value, str):
        raise ValueError(f"expected a size like 0.75GiB, got {shown(value)}")
    refuse_yaml11_number(value)
    m = _NUM_UNIT.match(value)
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"expected a size like 0.75GiB, 768MiB or 805306368, got {shown(value)}")
    return int(_finite(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()]))


def parse_duration(value: object) -> float:
    """Parse a duration into seconds.

    Args:
        value: int/float (seconds) or str such as ``"200ms"``, ``"20s"``, ``"5m"``.
    Returns:
        float, seconds.
    Raises:
        ValueError: not a duration, negative, not finite, or a YAML 1.1 number form (see the module).
    """
    if isinstance(value, bool):
        raise ValueError(f"expected a duration like 200ms or 20s, got {shown(value)}")
    if isinstance(value, (int, float)):
        try:
            seconds = _finite(float(value))
        except OverflowError:           # an int beyond a float's range
            raise ValueError(f"duration too large, got {shown(value)}") from None
        if seconds < 0:
            raise ValueError(f"duration must not be negative, got {shown(value)}")
        return seconds
    if not isinstance(value, str):
        raise ValueError(f"expected a duration like 200ms or 20s, got {shown(value)}")
    refuse_yaml11_number(value)
    m = _NUM_UNIT.match(value)
    if not m or m.group(2).lower() not in _DURATION_UNITS:
        raise ValueError(f"expected a duration like 200ms, 20s or 5m, got {shown(value)}")
    return _finite(float(m.group(1)) * _DURATION_UNITS[m.group(2).lower()])


def format_size(nbytes: int | float | None, exact: bool = False) -> str:
    """Format bytes for people: ``format_size(805306368) == "0.75 GiB"``; None gives ``"-"``.

    With ``exact`` (for files that :func:`parse_size` reads back), the largest of GiB, MiB, KiB
    that divides an int ``nbytes`` evenly, without a space (``"6GiB"``), else the plain number
    of bytes (``"1000"``).
    """
    if nbytes is None:
        return "-"
    if exact:
        for unit, mult in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
            if nbytes % mult == 0:
                return f"{nbytes // mult}{unit}"
        return str(nbytes)
    n = float(nbytes)
    sign = "-" if n < 0 else ""
    n = abs(n)
    if n >= 1024**3 * 0.1:
        return f"{sign}{n / 1024**3:.2f} GiB"
    if n >= 1024**2:
        return f"{sign}{n / 1024**2:.0f} MiB"
    if n >= 1024:
        return f"{sign}{n / 1024:.0f} KiB"
    return f"{sign}{n:.0f} B"


def format_line(nbytes: int | float | None) -> str:
    """A memory line for people: :func:`format_size`, or ``"off"`` for a line that is not set (None)."""
    return format_size(nbytes) if nbytes is not None else "off"


def format_duration(seconds: float | None) -> str:
    """Format seconds for people: ``"250 ms"``, ``"12.0 s"``, ``"3.5 min"``; None gives ``"-"``."""
    if seconds is None:
        return "-"
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 120:
        return f"{seconds:.1f} s"
    return f"{seconds / 60:.1f} min"

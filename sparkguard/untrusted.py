"""Values read from another host (its metrics page, its JSON over SSH) made safe to use and print.

Another node's answer is input this host did not write: a field may have any JSON type, a number
may be 1e300, NaN or negative, a string may carry terminal control sequences (ESC [ ...), and
JSON may nest deeply enough to exhaust Python's recursion limit.  These helpers turn each into a
typed value or a ValueError, and every string into one that prints as text.  Pure, no I/O.
"""

from __future__ import annotations

import json
import math
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

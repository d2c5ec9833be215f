"""Value parsers of the configuration: raw YAML value -> typed value, or ValueError with the reason.

Sizes and durations are read by :mod:`sparkguard.units`; each parser here adds the bounds of
the keys that use it (see :data:`sparkguard.config.schema.SCHEMA`).
"""

from __future__ import annotations

import os
import pwd
import re
from typing import Any, Callable
from urllib.parse import urlsplit

from sparkguard.config.errors import NestedValueError
from sparkguard.units import parse_duration, parse_size, refuse_yaml11_number, shown

MINUTE, HOUR, DAY = 60.0, 3600.0, 86400.0
MIN_TICK = 0.01             # seconds: the shortest period of anything that repeats (no busy loop)
MAX_SIZE = 1024**5          # bytes (1 PiB): far above any machine's RAM, far below overflow
MIN_LINE = 16 * 1024**2     # bytes: a line lower than this cannot save the box
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


def boolean(v: Any) -> bool:
    """``true``/``false`` as bool; any other value (``1``, ``"yes"`` quoted) is refused."""
    if isinstance(v, bool):
        return v
    raise ValueError("expected true or false")


def _secs(x: float) -> str:
    """Seconds as a config duration: ``_secs(0.01) == "10ms"``, ``_secs(3600) == "1h"``."""
    for unit, n in (("d", DAY), ("h", HOUR), ("m", MINUTE), ("s", 1.0)):
        if x >= n and x % n == 0:
            return f"{x / n:g}{unit}" if unit != "d" else f"{x / HOUR:g}h"
    return f"{x * 1000:g}ms"


def duration(lo: float, hi: float) -> Callable[[Any], float]:
    """Parser of a duration in seconds from ``lo`` to ``hi`` (inclusive); ValueError outside."""
    def parse(v: Any) -> float:
        d = parse_duration(v)
        if not lo <= d <= hi:
            raise ValueError(f"must be from {_secs(lo) if lo else '0'} to {_secs(hi)}")
        return d
    return parse


def size(v: Any) -> int:
    """A size in bytes from 0 to :data:`MAX_SIZE`."""
    n = parse_size(v)
    if n > MAX_SIZE:
        raise ValueError("must be at most 1024TiB")
    return n


def line_size(v: Any) -> int:
    """A threshold: a size from 16 MiB to 1 PiB; a small bare number is taken for a unit slip."""
    n = size(v)
    if isinstance(v, (int, float)) and not isinstance(v, bool) and n < MIN_LINE:
        raise ValueError(f"a bare number is bytes; did you mean {v}GiB?")
    if n < MIN_LINE:
        raise ValueError("must be at least 16MiB: a lower line cannot act before the kernel livelocks")
    return n


def optional_line_size(v: Any) -> int | None:
    """A threshold as :func:`line_size`, or None for ``off``/``none``/``false``/empty."""
    if v is None or v is False or (isinstance(v, str) and v.lower() in ("off", "none")):
        return None
    return line_size(v)


def fall_rate(v: Any) -> int:
    """A fall rate in bytes per second: ``512MiB/s`` (or a size, read per second), 0 to 1 PiB/s."""
    t = v.strip() if isinstance(v, str) else v
    if isinstance(t, str) and t.lower().endswith("/s"):
        t = t[:-2].strip()
    return size(t)


def choice(*choices: str) -> Callable[[Any], str]:
    """Parser of one word out of ``choices``; a YAML bool reads as the ``on``/``off`` written."""
    def parse(v: Any) -> str:
        # YAML 1.1 reads a bare off/on/no/yes as a bool: take it as the word the user wrote
        if isinstance(v, bool):
            v = "on" if v else "off"
        if v not in choices:
            raise ValueError("expected one of " + ", ".join(choices))
        return v
    return parse


def regex_list(v: Any) -> tuple[str, ...]:
    """A list of Python regular expressions, each compiled once to refuse a bad one."""
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise ValueError("expected a list of regular expressions (strings)")
    for x in v:
        try:
            re.compile(x)
        except re.error as e:
            raise ValueError(f"bad regular expression {shown(x)}: {e}") from None
    return tuple(v)


def listen_address(v: Any) -> tuple[str, int] | None:
    """``host:port`` (``[v6]:port``; empty host = 127.0.0.1) as ``(host, port)``, or None for ``off``."""
    if v is None or v is False or (isinstance(v, str) and v.lower() == "off"):
        return None
    if not isinstance(v, str) or ":" not in v:
        raise ValueError("expected host:port such as 127.0.0.1:8799, or off")
    host, _, port = v.rpartition(":")
    host = host.strip("[]")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError("port must be 1-65535")
    return (host or "127.0.0.1", int(port))


def ifname_list(v: Any) -> tuple[str, ...]:
    """Network interface names (empty for None), each valid for the kernel and listed once."""
    if v is None:
        return ()
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise ValueError("expected a list of interface names such as [enp1s0f0np0]")
    for x in v:
        # net/core/dev.c dev_valid_name: 1-15 bytes, no '/', ':' or whitespace, not '.' or '..'
        if not 0 < len(x.encode()) < 16 or x in (".", "..") or any(c in x for c in "/: \t\n"):
            raise ValueError(f"{shown(x)} is not a valid interface name (1-15 characters, no '/', ':' or spaces)")
    if len(set(v)) != len(v):
        raise ValueError("an interface is listed twice")
    return tuple(v)


def abs_path(v: Any) -> str:
    """An absolute path (the daemon runs in /, so a relative one would mean something else)."""
    if not isinstance(v, str) or not v:
        raise ValueError("expected a path")
    if not os.path.isabs(v):
        raise ValueError("expected an absolute path (the daemon's working directory is /)")
    return v


def argv_list(v: Any) -> tuple[str, ...] | None:
    """The engine's argv: a non-empty list of non-empty strings, or None (no engine)."""
    if v is None:
        return None
    if not isinstance(v, list) or not v or not all(isinstance(x, str) and x for x in v):
        raise ValueError("expected a non-empty list of strings (argv), e.g. [vllm, serve, MODEL]")
    return tuple(v)


def extra_args(v: Any) -> tuple[str, ...]:
    """Extra argv (a lane's ``args``): scalars kept as written, empty for None."""
    if v is None:
        return ()
    if not isinstance(v, list) or not all(isinstance(x, (str, int, float)) and not isinstance(x, bool) for x in v):
        raise ValueError("expected a list of strings (extra argv)")
    return tuple(_as_written(x) for x in v)


def _as_written(x: str | int | float) -> str:
    """A scalar as the file spells it: a float keeps its text (``1e3``, not ``1000.0``)."""
    return getattr(x, "text", None) or str(x)


def env_map(v: Any) -> dict:
    """Environment ``{NAME: value}`` (values as written); NestedValueError names the bad entry."""
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise ValueError("expected a mapping NAME: value")
    out = {}
    for k, x in v.items():
        if not isinstance(k, str) or not _ENV_NAME.match(k):
            raise NestedValueError(f".{k}", x, "not a valid environment variable name")
        if isinstance(x, bool) or not isinstance(x, (str, int, float)):
            raise NestedValueError(f".{k}", x, "expected a string or number")
        out[k] = _as_written(x)
    return out


def optional_str(v: Any) -> str | None:
    """A non-empty string, or None."""
    if v is None:
        return None
    if not isinstance(v, str) or not v:
        raise ValueError("expected a non-empty string")
    return v


def user_name(v: Any) -> str | None:
    """A user name or uid that exists on this machine (pwd), as str, or None."""
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (str, int)):
        raise ValueError("expected a user name or uid")
    try:
        pwd.getpwuid(v) if isinstance(v, int) else pwd.getpwnam(v)
    except (KeyError, OverflowError, ValueError):   # OverflowError: a uid out of uid_t's range
        raise ValueError("no such user on this machine") from None
    return str(v)


def http_url(v: Any) -> str:
    """An ``http://`` or ``https://`` URL with a host and a valid port, unchanged."""
    if not isinstance(v, str) or not v:
        raise ValueError("expected an http:// URL")
    u = urlsplit(v)
    if u.scheme not in ("http", "https") or not u.hostname:
        raise ValueError("expected an http:// or https:// URL with a host")
    try:
        u.port
    except ValueError:
        raise ValueError("bad port in URL") from None
    return v


def optional_url(v: Any) -> str | None:
    """An :func:`http_url`, or None."""
    return None if v is None else http_url(v)


def url_list(v: Any) -> tuple[str, ...]:
    """A list of :func:`http_url` (empty for None); NestedValueError names the bad index."""
    if v is None:
        return ()
    if not isinstance(v, list):
        raise ValueError("expected a list of URLs (the other nodes' sparkguard metrics endpoints)")
    out = []
    for i, x in enumerate(v):
        try:
            out.append(http_url(x))
        except ValueError as e:
            raise NestedValueError(f"[{i}]", x, str(e)) from None
    return tuple(out)


def int_range(lo: int, hi: int) -> Callable[[Any], int]:
    """Parser of a whole number from ``lo`` to ``hi`` (inclusive), YAML 1.1 spellings refused."""
    def parse(v: Any) -> int:
        if isinstance(v, str):
            refuse_yaml11_number(v)
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            raise ValueError(f"expected a whole number from {lo} to {hi}")
        return v
    return parse

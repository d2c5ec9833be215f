"""The peers gate: read the other nodes' sparkguard metrics before (re)starting a TP engine.

A tensor-parallel engine spans 2-4 Sparks and every node runs sparkguard.  When one node's
guard kills its rank, the ranks on the other nodes fail or hang, and their memory comes
back only after their own guard (or supervisor) has cleaned up.  Before the head (re)starts
the engine it therefore reads each peer's metrics endpoint (``engine.peers``) and waits
until every peer reports ``sparkguard_memory_available_bytes`` at or above the gate
(``engine.start_above``).

The metric's lines are parsed with prometheus_client's own text parser
(``prometheus_client.parser.text_string_to_metric_families``), so whatever that endpoint
serves (a real sparkguard, through a proxy) is read the way Prometheus would read it.  Each
read is bounded: one deadline for the whole request, :data:`MAX_ANSWER` bytes of answer
(:mod:`sparkguard.httpget`).
Source of the metric name: :mod:`sparkguard.metrics`, the exporter every node runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

from prometheus_client.parser import text_string_to_metric_families

from sparkguard import httpget

METRIC = "sparkguard_memory_available_bytes"


class PeerError(OSError):
    """A peer could not be read: no answer, an HTTP error, or no ``sparkguard_memory_available_bytes``."""


@dataclass
class PeerState:
    """What one peer reported.

    Attributes:
        url: str, the metrics URL read.
        available_bytes: int MemAvailable the peer reported, or None when it could not be read.
        ok: bool, True when ``available_bytes >= gate``.
        error: str, why it could not be read ("" when read).
    """

    url: str
    available_bytes: int | None
    ok: bool
    error: str = ""

    def as_dict(self) -> dict:
        """JSON-ready form (for status and incident reports)."""
        return {"url": self.url, "available_bytes": self.available_bytes, "ok": self.ok, "error": self.error}


def metrics_url(url: str) -> str:
    """``http://host:port`` or ``http://host:port/`` -> ``http://host:port/metrics``; other paths unchanged."""
    u = urlsplit(url)
    if u.path in ("", "/"):
        u = u._replace(path="/metrics")
    return urlunsplit(u)


def select(text: str, names: tuple[str, ...]) -> list:
    """The metric families of ``text`` (Prometheus text exposition) whose names start with one of
    ``names``, parsed by prometheus_client's own parser.

    Only those families' lines (their ``# HELP``/``# TYPE`` and samples) go through the parser:
    the CPU spent does not grow with what else the peer serves.

    Raises:
        PeerError: the selected lines do not parse.
    """
    keep = []
    for line in text.splitlines():
        name = line[7:] if line.startswith(("# HELP ", "# TYPE ")) else line
        if name.startswith(names):
            keep.append(line)
    try:
        return list(text_string_to_metric_families("\n".join(keep) + "\n"))
    except Exception as e:  # the parser raises ValueError/TypeError/IndexError on junk
        raise PeerError(f"not Prometheus text: {e}") from None


def parse_available(text: str) -> int:
    """``sparkguard_memory_available_bytes`` from Prometheus text exposition (:func:`select`).

    Raises:
        PeerError: the text does not parse or holds no such sample.
    """
    for fam in select(text, (METRIC + " ", METRIC + "{")):
        for s in fam.samples:
            if s.name == METRIC:
                return finite_int(s.value, METRIC)
    raise PeerError(f"no {METRIC} (is it a sparkguard metrics endpoint?)")


def finite_int(value: float, name: str) -> int:
    """``value`` as an int, or PeerError when it is NaN, infinite or negative (a peer's numbers
    are untrusted)."""
    if not math.isfinite(value) or value < 0:
        raise PeerError(f"{name} is {value!r}")
    return int(value)


#: bytes of a peer's answer read at most; a sparkguard exposition is about 10 KiB
MAX_ANSWER = 256 * 1024


def read_available(url: str, timeout: float = 3.0) -> int:
    """Scrape one peer and return the MemAvailable it reports, in bytes.

    Args:
        url: the peer's sparkguard metrics URL (``/metrics`` appended when the path is empty).
        timeout: seconds for the whole request (connect, answer and body together).
    Raises:
        PeerError: unreachable, too slow, an answer over :data:`MAX_ANSWER` bytes, HTTP status
            other than 200, or no usable metric.
    """
    return parse_available(fetch(url, timeout))


def fetch(url: str, timeout: float = 3.0) -> str:
    """The text a sparkguard metrics endpoint serves (``/metrics`` appended when the path is empty).

    Args:
        timeout: seconds for the whole request (connect, answer and body together).
    Raises:
        PeerError: unreachable, too slow, an answer over :data:`MAX_ANSWER` bytes, HTTP status
            other than 200.
    """
    try:
        status, body = httpget.request(metrics_url(url), timeout, MAX_ANSWER)
    except OSError as e:
        raise PeerError(f"no answer: {e.strerror or e}") from None
    if status != 200:
        raise PeerError(f"HTTP {status}")
    return body.decode("utf-8", "replace")


def check(urls: list[str] | tuple[str, ...], gate: int, timeout: float = 3.0) -> list[PeerState]:
    """Read every peer once.

    Args:
        urls: the peers' metrics URLs (``engine.peers``).
        gate: bytes of MemAvailable each peer must report (``engine.start_above``).
        timeout: seconds per peer, for the whole request.
    Returns:
        list[PeerState], one per URL, in order.  Never raises.
    """
    out = []
    for url in urls:
        try:
            avail = read_available(url, timeout)
        except Exception as e:  # noqa: BLE001 - PeerError, or whatever a peer's text makes of a parser
            out.append(PeerState(url, None, False, str(e) if isinstance(e, PeerError) else f"unreadable: {e!r}"))
        else:
            out.append(PeerState(url, avail, avail >= gate))
    return out

"""The peers gate: read the other nodes' sparkguard metrics before (re)starting a TP engine.

A tensor-parallel engine spans 2-4 Sparks and every node runs sparkguard.  When one node's
guard kills its rank, the ranks on the other nodes fail or hang, and their memory comes
back only after their own guard (or supervisor) has cleaned up.  Before the head (re)starts
the engine it therefore reads each peer's metrics endpoint (``engine.peers``) and waits
until every peer reports ``sparkguard_memory_available_bytes`` at or above the gate
(``engine.start_above``).

The exposition is parsed with prometheus_client's own text parser
(``prometheus_client.parser.text_string_to_metric_families``), so whatever that endpoint
serves (a real sparkguard, through a proxy) is read the way Prometheus would read it.
Source of the metric name: TEAM.md "Metric names" / ``sparkguard.metrics``.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

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


def parse_available(text: str) -> int:
    """``sparkguard_memory_available_bytes`` from Prometheus text exposition.

    Raises:
        PeerError: the text does not parse or holds no such sample.
    """
    from prometheus_client.parser import text_string_to_metric_families
    try:
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if s.name == METRIC:
                    return int(s.value)
    except Exception as e:  # the parser raises ValueError/TypeError/IndexError on junk
        raise PeerError(f"not Prometheus text: {e}") from None
    raise PeerError(f"no {METRIC} (is it a sparkguard metrics endpoint?)")


def read_available(url: str, timeout: float = 3.0) -> int:
    """Scrape one peer and return the MemAvailable it reports, in bytes.

    Args:
        url: the peer's sparkguard metrics URL (``/metrics`` appended when the path is empty).
        timeout: seconds for connect + read.
    Raises:
        PeerError: unreachable, HTTP status other than 200, or no usable metric.
    """
    import urllib.error
    import urllib.request
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(metrics_url(url), timeout=timeout) as r:
            text = r.read(8 * 1024 * 1024).decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        raise PeerError(f"HTTP {e.code} {e.reason}") from None
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", e)
        raise PeerError(f"no answer: {getattr(reason, 'strerror', None) or reason}") from None
    return parse_available(text)


def check(urls: list[str] | tuple[str, ...], gate: int, timeout: float = 3.0) -> list[PeerState]:
    """Read every peer once.

    Args:
        urls: the peers' metrics URLs (``engine.peers``).
        gate: bytes of MemAvailable each peer must report (``engine.start_above``).
        timeout: seconds per peer.
    Returns:
        list[PeerState], one per URL, in order.  Never raises.
    """
    out = []
    for url in urls:
        try:
            avail = read_available(url, timeout)
        except PeerError as e:
            out.append(PeerState(url, None, False, str(e)))
        else:
            out.append(PeerState(url, avail, avail >= gate))
    return out

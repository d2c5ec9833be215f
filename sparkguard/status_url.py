"""Where ``sparkguard status`` asks: the daemon's metrics URL, and whether a URL is this host's.

``metrics.listen`` of the configuration gives the default URL (:func:`metrics_url`); a ``--url``
naming another host's endpoint (:func:`is_local_url` false, or a loopback URL whose endpoint says
it runs elsewhere: :func:`is_loopback_url`, :func:`same_host`) is shown as that host's alone
(issue 14).  Pure of /proc; the only I/O is name resolution and a test ``bind(2)``.
"""

from __future__ import annotations

import ipaddress
import socket as socketlib
from urllib.parse import urlsplit


def metrics_url(listen: tuple[str, int] | None) -> str | None:
    """``http://host:port/metrics`` for a ``metrics.listen`` value; None when metrics are off.

    A wildcard bind (0.0.0.0, ::) is reached on loopback.
    """
    if listen is None:
        return None
    host, port = listen
    host = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
    return f"http://[{host}]:{port}/metrics" if ":" in host else f"http://{host}:{port}/metrics"


def is_local_url(url: str) -> bool:
    """Whether ``url``'s host is this host: a loopback address, ``localhost``, this host's name,
    or an address one of its interfaces holds (in this network namespace).

    An address is this host's when a socket can be bound to it (``bind(2)`` fails with
    EADDRNOTAVAIL for an address no interface has); a name is resolved first (getaddrinfo).
    A URL that does not parse, or a name that does not resolve, is not local.  Never raises.
    """
    try:
        host = urlsplit(url).hostname
    except ValueError:
        return False
    if not host:
        return False
    if host == "localhost" or host in (socketlib.gethostname(), socketlib.gethostname().split(".", 1)[0]):
        return True
    try:
        addrs = [ipaddress.ip_address(host)]
    except ValueError:
        try:
            addrs = [ipaddress.ip_address(ai[4][0].split("%", 1)[0])
                     for ai in socketlib.getaddrinfo(host, None, proto=socketlib.IPPROTO_TCP)]
        except (OSError, ValueError, UnicodeError):
            return False
    for a in addrs:
        if a.is_loopback or a.is_unspecified:
            return True
        fam = socketlib.AF_INET6 if a.version == 6 else socketlib.AF_INET
        try:
            with socketlib.socket(fam, socketlib.SOCK_STREAM) as sk:
                sk.bind((str(a), 0))
            return True
        except OSError:
            continue
    return False


def is_loopback_url(url: str) -> bool:
    """Whether ``url``'s host is a loopback address or ``localhost``: such a URL may reach this
    host's endpoint or, through a tunnel (``ssh -L 8799:node:8799``), another host's.  Never raises."""
    try:
        host = urlsplit(url).hostname
    except ValueError:
        return False
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host or "").is_loopback
    except ValueError:
        return False


def same_host(d: dict) -> bool:
    """Whether the endpoint that answered with ``d`` (a :func:`sparkguard.status_daemon.read_daemon`
    dict) runs on this host: its ``sparkguard_build_info{hostname}`` is this host's name (``socket.gethostname()``).
    An endpoint that does not answer is taken as this host's (nothing to mistake for it); one
    that answers without a hostname (an older sparkguard, or not sparkguard) is not."""
    if not d.get("running"):
        return True
    return d.get("hostname") is not None and d["hostname"] == socketlib.gethostname()

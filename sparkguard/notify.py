"""systemd notification (sd_notify(3)) for ``Type=notify`` units, sent without ever blocking.

The poll loop itself sends WATCHDOG=1 and STATUS=, so a send must never wait: when the
service manager's socket queue is full (PID 1 busy in reclaim is exactly when) a blocking
``sendto`` would freeze the guard.  Each message is one ``sendto`` on an AF_UNIX datagram
socket opened ``SOCK_NONBLOCK|SOCK_CLOEXEC``; a datagram the kernel cannot queue at once
(EAGAIN, ENOBUFS, ECONNREFUSED, ENOENT...) is dropped and counted in ``dropped``, and the
caller goes on.  ``NOTIFY_SOCKET`` is a path, or an abstract address when it starts with
``@`` (sd_notify(3), "NOTIFY_SOCKET"); other forms (``vsock:``) are not supported and turn
the notifier off with a warning.

Also what sd_notify users must add themselves (FIELD-NOTES): the watchdog interval from
``WATCHDOG_USEC``/``WATCHDOG_PID`` (sd_watchdog_enabled(3)), ASCII sanitising, and the reload
protocol (``RELOADING=1`` + ``MONOTONIC_USEC=``, then ``READY=1``; systemd.service(5)
"Type=notify-reload").  Every method is a no-op without ``NOTIFY_SOCKET``.
"""

from __future__ import annotations

import logging
import os
import socket
import time

log = logging.getLogger("sparkguard")


def notify_address(value: str) -> str | bytes | None:
    """The ``sendto`` address for a ``NOTIFY_SOCKET`` value: a path (str), an abstract name
    (bytes starting with NUL, from a leading ``@``), or None for an empty or unsupported value."""
    if value.startswith("@") and len(value) > 1:
        return b"\0" + value[1:].encode()
    if value.startswith("/"):
        return value
    return None


class Notifier:
    """Talks to the service manager.

    Attributes:
        enabled: bool, NOTIFY_SOCKET is set to an address this notifier can use.
        watchdog_interval: float seconds between WATCHDOG=1 pings (half of WATCHDOG_USEC),
            or None when the watchdog is off or meant for another PID.
        next_ping: float, monotonic seconds when the next ping is due (the loop never sleeps past it).
        dropped: int, datagrams the kernel refused at once (queue full, no listener); any thread may read it.
        ready_pending: bool, a READY=1 was dropped and is owed (sent again by :meth:`status` and
            :meth:`watchdog`).
        blind: bool; while True, :meth:`watchdog` sends no WATCHDOG=1 (the guard cannot read memory,
            so systemd's watchdog should restart it).
    """

    def __init__(self, environ: dict | None = None):
        env = os.environ if environ is None else environ
        raw = env.get("NOTIFY_SOCKET") or ""
        self._addr = notify_address(raw)
        if raw and self._addr is None:
            log.warning("NOTIFY_SOCKET=%s: unsupported address (expected /path or @abstract); "
                        "not notifying the service manager", raw)
        self.enabled = self._addr is not None
        self._sock = None
        if self.enabled:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)
        self.watchdog_interval: float | None = None
        usec, wpid = env.get("WATCHDOG_USEC"), env.get("WATCHDOG_PID")
        if self.enabled and usec and usec.isdigit() and int(usec) > 0 and (not wpid or wpid == str(os.getpid())):
            self.watchdog_interval = int(usec) / 2e6
        self.next_ping = 0.0
        self.dropped = 0
        self.ready_pending = False
        self.blind = False
        self._last_status = ""

    def send(self, text: str) -> bool:
        """Send raw ``KEY=value`` lines (non-ASCII replaced by '?') in one non-blocking datagram.

        Returns:
            True if the kernel queued it; False when there is no socket or it was dropped
            (counted in ``dropped``).  Never raises, never waits.
        """
        if self._sock is None:
            return False
        try:
            self._sock.sendto(text.encode("ascii", "replace"), self._addr)
            return True
        except OSError:
            self.dropped += 1
            return False

    def ready(self, status: str | None = None) -> None:
        """READY=1 (and STATUS=).  A dropped one is sent again by the next :meth:`status`: after
        RELOADING=1 the service manager waits for READY=1 until its timeout fails the reload."""
        self.ready_pending = not self.send("READY=1" + (f"\nSTATUS={status}" if status else "")) and self.enabled

    def status(self, status: str) -> None:
        """STATUS= one line, sent only when it changed (a dropped one is sent again next time),
        after a READY=1 that is still owed."""
        if self.ready_pending and self.send("READY=1"):
            self.ready_pending = False
        status = status.replace("\n", " ")
        if status != self._last_status and self.send(f"STATUS={status}"):
            self._last_status = status

    def watchdog(self, now: float) -> None:
        """WATCHDOG=1 if half of WATCHDOG_USEC has passed since the last ping, unless ``blind``.

        Args:
            now: monotonic seconds.  Call from the poll loop itself, so a stuck loop stops the pings.
        """
        if self.watchdog_interval is not None and now >= self.next_ping:
            self.next_ping = now + self.watchdog_interval
            if self.ready_pending and self.send("READY=1"):
                self.ready_pending = False
            if not self.blind:
                self.send("WATCHDOG=1")

    def reloading(self) -> int:
        """RELOADING=1 with MONOTONIC_USEC (CLOCK_MONOTONIC, microseconds); returns that value."""
        usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        self.send(f"RELOADING=1\nMONOTONIC_USEC={usec}")
        return usec

    def stopping(self) -> None:
        """STOPPING=1."""
        self.send("STOPPING=1")

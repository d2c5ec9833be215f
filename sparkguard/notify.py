"""systemd notification (sd_notify(3)) for ``Type=notify`` units.

Uses the ``sdnotify`` library for the socket; adds what it lacks (FIELD-NOTES): the
watchdog interval from ``WATCHDOG_USEC``/``WATCHDOG_PID`` (sd_watchdog_enabled(3)), ASCII
sanitising (sdnotify drops non-Latin-1 text silently), and the reload protocol
(``RELOADING=1`` + ``MONOTONIC_USEC=``, then ``READY=1``; systemd.service(5)
"Type=notify-reload").  Every method is a no-op without ``NOTIFY_SOCKET``.
"""

from __future__ import annotations

import os
import time


class Notifier:
    """Talks to the service manager.

    Attributes:
        enabled: bool, NOTIFY_SOCKET is set.
        watchdog_interval: float seconds between WATCHDOG=1 pings (half of WATCHDOG_USEC),
            or None when the watchdog is off or meant for another PID.
        next_ping: float, monotonic seconds when the next ping is due (the loop never sleeps past it).
    """

    def __init__(self, environ: dict | None = None):
        env = os.environ if environ is None else environ
        self.enabled = bool(env.get("NOTIFY_SOCKET"))
        self._n = None
        if self.enabled:
            import sdnotify
            self._n = sdnotify.SystemdNotifier()
        self.watchdog_interval: float | None = None
        usec, wpid = env.get("WATCHDOG_USEC"), env.get("WATCHDOG_PID")
        if self.enabled and usec and usec.isdigit() and int(usec) > 0 and (not wpid or wpid == str(os.getpid())):
            self.watchdog_interval = int(usec) / 2e6
        self.next_ping = 0.0
        self._last_status = ""

    def send(self, text: str) -> None:
        """Send raw ``KEY=value`` lines (non-ASCII replaced by '?')."""
        if self._n is not None:
            self._n.notify(text.encode("ascii", "replace").decode("ascii"))

    def ready(self, status: str | None = None) -> None:
        """READY=1 (and STATUS=)."""
        self.send("READY=1" + (f"\nSTATUS={status}" if status else ""))

    def status(self, status: str) -> None:
        """STATUS= one line, sent only when it changed."""
        status = status.replace("\n", " ")
        if status != self._last_status:
            self._last_status = status
            self.send(f"STATUS={status}")

    def watchdog(self, now: float) -> None:
        """WATCHDOG=1 if half of WATCHDOG_USEC has passed since the last ping.

        Args:
            now: monotonic seconds.  Call from the poll loop itself, so a stuck loop stops the pings.
        """
        if self.watchdog_interval is not None and now >= self.next_ping:
            self.next_ping = now + self.watchdog_interval
            self.send("WATCHDOG=1")

    def reloading(self) -> None:
        """RELOADING=1 with MONOTONIC_USEC (CLOCK_MONOTONIC, microseconds)."""
        self.send(f"RELOADING=1\nMONOTONIC_USEC={time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000}")

    def stopping(self) -> None:
        """STOPPING=1."""
        self.send("STOPPING=1")

"""Who listens on a TCP port: /proc/net/tcp{,6} for the socket, /proc/PID/fd for its process.

Used when the metrics endpoint cannot bind (the guard's log, ``sparkguard status``, doctor) to
name what holds the port.  Every read is bounded: at most :data:`MAX_TABLE` bytes of each
table, at most :data:`MAX_LINKS` fd links and :data:`DEADLINE` seconds for the process search.

Sources: proc(5) ``/proc/net/tcp`` (columns ``sl local_address rem_address st tx_queue:rx_queue
tr:tm->when retrnsmt uid timeout inode``; addresses are hex ``IP:PORT``, ``st`` 0A is
TCP_LISTEN, include/net/tcp_states.h); an open socket's fd link reads ``socket:[INODE]``.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from sparkguard import proctree

TABLES = ("/proc/net/tcp", "/proc/net/tcp6")
LISTEN = "0A"
MAX_TABLE = 4 << 20      # bytes read of each table (a few thousand sockets)
MAX_LINKS = 200_000      # fd links read in one search
DEADLINE = 0.5           # seconds for one search of /proc/PID/fd


@dataclass
class Holder:
    """A listening socket on the port.

    Attributes:
        uid: int, owner of the socket (from the table; always known).
        pid: int | None, a process holding it (None: not found: hidepid, another namespace, or
            the search bound was reached).
        comm: str, that process's /proc/PID/comm ("" when pid is None).
    """

    uid: int
    pid: int | None = None
    comm: str = ""

    def describe(self) -> str:
        """``"pid 123 nc, uid 1000"`` or ``"uid 1000, process not found"``."""
        if self.pid is None:
            return f"uid {self.uid}, process not found"
        return f"pid {self.pid} {self.comm}, uid {self.uid}"


def listening_inodes(port: int, tables: tuple[str, ...] = TABLES) -> dict[int, int]:
    """``{socket inode: uid}`` of every TCP socket listening on ``port`` (any address).

    A listener on the wildcard address holds the port for every address, so the address is not
    compared.  Unreadable tables are skipped; never raises.
    """
    out: dict[int, int] = {}
    want = f":{port:04X}"
    for path in tables:
        try:
            with open(path, "rb") as f:
                text = f.read(MAX_TABLE).decode("ascii", "replace")
        except OSError:
            continue
        for line in text.splitlines()[1:]:
            p = line.split()
            if len(p) < 10 or p[3] != LISTEN or not p[1].endswith(want):
                continue
            try:
                out[int(p[9])] = int(p[7])
            except ValueError:
                continue
    return out


def find_holder(port: int, proc: str = "/proc", tables: tuple[str, ...] = TABLES) -> Holder | None:
    """The listener on ``port`` and, when it can be found within the bounds, its process.

    Returns None when nothing listens on the port.  Never raises.
    """
    inodes = listening_inodes(port, tables)
    if not inodes:
        return None
    links = {f"socket:[{ino}]": uid for ino, uid in inodes.items()}
    first = Holder(next(iter(inodes.values())))
    deadline = time.monotonic() + DEADLINE
    budget = MAX_LINKS
    try:
        pids = proctree.pids(proc)
    except OSError:
        return first
    for pid in pids:
        if budget <= 0 or time.monotonic() > deadline:
            break
        fd_dir = f"{proc}/{pid}/fd"
        try:
            fds = os.scandir(fd_dir)      # an iterator: a process with 500k fds is not listed whole
        except OSError:
            continue
        try:
            with fds:
                found = _holder_in(fds, links, budget, deadline)
        except OSError:           # the process exited while its fds were read
            continue
        if found is None:
            break
        budget, target = found
        if target is not None:
            try:
                with open(f"{proc}/{pid}/comm", "rb") as f:
                    comm = f.read(64).decode("utf-8", "replace").strip()
            except OSError:
                comm = "?"
            return Holder(links[target], pid, comm)
    return first


def _holder_in(fds, links: dict[str, int], budget: int, deadline: float) -> tuple[int, str | None] | None:
    """Look through one process's fd entries (an ``os.scandir`` iterator) for a link in ``links``.

    Returns ``(budget left, the matching link or None)``, or None once the link budget or the
    monotonic ``deadline`` is spent (both checked per fd, not per process)."""
    for entry in fds:
        budget -= 1
        if budget <= 0 or (budget & 255) == 0 and time.monotonic() > deadline:
            return None
        try:
            target = os.readlink(entry.path)
        except OSError:
            continue
        if target in links:
            return budget, target
    return budget, None

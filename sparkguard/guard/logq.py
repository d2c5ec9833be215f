"""The guard's logging: stderr through a bounded queue and a listener thread, never blocking the loop."""

from __future__ import annotations

import atexit
import logging
import logging.handlers
import os
import queue
import sys

LOG_QUEUE_MAX = 256         # log records waiting for the stderr thread (an incident logs ~20); more are dropped and counted


class DroppingQueueHandler(logging.handlers.QueueHandler):
    """QueueHandler that never waits: a record that finds the queue full is dropped and counted."""
    dropped = 0

    def enqueue(self, record: logging.LogRecord) -> None:
        try:
            self.queue.put_nowait(record)
        except queue.Full:
            self.dropped += 1


_log_handler = None     # the DroppingQueueHandler of a running daemon (its ``dropped`` count is in the snapshot)


def setup_logging(level: str) -> None:
    """Log to stderr through a bounded queue (LOG_QUEUE_MAX records) and a listener thread
    (logging.handlers.QueueListener): a stalled stderr (journald starved under memory pressure)
    never blocks the poll loop, and its backlog never grows without bound (later records are dropped
    and counted, ``sparkguard_log_dropped_total``)."""
    global _log_handler
    fmt = "%(levelname)s %(message)s" if os.environ.get("JOURNAL_STREAM") else \
        "%(asctime)s sparkguard[%(process)d] %(levelname)s %(message)s"
    out = logging.StreamHandler(sys.stderr)
    out.setFormatter(logging.Formatter(fmt))

    q: queue.Queue = queue.Queue(maxsize=LOG_QUEUE_MAX)
    root = logging.getLogger()
    _log_handler = DroppingQueueHandler(q)
    root.handlers[:] = [_log_handler]
    root.setLevel(getattr(logging, level.upper()))
    listener = logging.handlers.QueueListener(q, out)
    listener.start()

    def stop() -> None:
        try:
            listener.stop()
        except queue.Full:      # stderr stalled at exit: what is queued is lost
            pass
    atexit.register(stop)


def dropped() -> int:
    """Log records dropped so far because the queue was full (0 before :func:`setup_logging`)."""
    return getattr(_log_handler, "dropped", 0)

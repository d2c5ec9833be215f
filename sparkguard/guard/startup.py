"""Start-up checks and side services of the guard: the incidents directory, metrics, the link watch."""

from __future__ import annotations

import logging
import os
import tempfile

from sparkguard import gpumem, linkcompat, linkwatch, metrics

log = logging.getLogger("sparkguard")

PROBE_BYTES = 64 * 1024     # bytes the start-up probe of incidents.dir writes: room for one report of a large tree


def check_incident_dir(cfg, reporter) -> None:
    """Create ``incidents.dir`` now and prove that a report fits, so a bad path or a full disk is
    known at start, not lost at the first incident (the guard still runs either way).

    The probe writes PROBE_BYTES (more than a typical report) and fsyncs them: creating an empty
    file succeeds on a full filesystem, and delayed allocation reports ENOSPC at fsync(2).
    The log says "and the journal" only when journald's socket exists (reporter's journal mode)."""
    d = cfg.incidents.dir
    sock = reporter.journal_socket
    journal = cfg.incidents.journal != "off" and os.path.exists(sock)
    if cfg.incidents.journal == "off":
        nojournal = ""
    elif journal:
        nojournal = None
    else:
        nojournal = f" (incidents.journal {cfg.incidents.journal}, but no journald socket at {sock})"
    try:
        os.makedirs(d, mode=0o750, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".probe-", dir=d)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(b"\0" * PROBE_BYTES)
                f.flush()
                os.fsync(f.fileno())
        finally:
            os.unlink(probe)
        log.info("incidents go to %s%s", d, " and the journal" if nojournal is None else nojournal)
    except OSError as e:
        log.error("incidents.dir %s is not writable (%s): incident files will be lost%s", d, e.strerror or e,
                  "; the journal still gets them" if nojournal is None else
                  f" and nothing keeps the full reports{nojournal}")


def start_metrics(cfg, snapshot, config=None):
    """Serve metrics on ``metrics.listen`` (``snapshot``: the guard's :meth:`Guard.snapshot`;
    ``config``: ``() -> Config`` in force now, for the cluster and lanes metrics); None when off.
    A port that cannot be bound (taken, not permitted) is logged and bound again in the endpoint's
    thread with a backoff: the guard never waits for it (``metrics.start_server``, ``retry=True``)."""
    listen = cfg.metrics.listen
    if not listen:
        return None
    return metrics.start_server(listen, snapshot, retry=True, config=config)


def start_linkwatch(cfg, on_incident, endpoint):
    """Watch the TP fabric links (``link.interfaces``) through netlink events, in their own thread;
    None when none are configured.  ``on_incident(inc)`` is called from that thread; the watch's
    collector is registered on the metrics ``endpoint`` (or None).  pyroute2 is imported by the
    watch's thread only (~19 MiB of RSS, paid only when links are configured).  With a pyroute2
    that cannot run the watch (Debian 12's 0.7: :mod:`sparkguard.linkcompat`) the guard runs
    without it and says so once (an error line in the journal); None then too."""
    if not cfg.link.interfaces:
        return None
    reason = linkcompat.unavailable_reason()
    if reason:
        log.error("link watch unavailable: %s; %s are not watched (%s)", reason,
                  ", ".join(cfg.link.interfaces), linkcompat.FIX)
        return None
    watch = linkwatch.LinkWatch(cfg.link.interfaces, cfg.link.down_after, on_incident=on_incident)
    watch.start()
    if endpoint is not None:
        endpoint.register_collector(watch.collector())
    return watch


def start_gpumem():
    """Read each process's GPU memory from NVML in the ``sg-gpumem`` thread when nvidia-ml-py is
    installed (:mod:`sparkguard.gpumem`, docs/gpu-memory.md); None, and pynvml never imported,
    when it is not."""
    return gpumem.start()

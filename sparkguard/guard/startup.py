"""Start-up checks and side services of the guard: the incidents directory, the black box, metrics, the link watch."""

from __future__ import annotations

import logging
import os
import tempfile
import time

from sparkguard import gpumem, linkcompat, linkwatch, metrics

from sparkguard import blackbox, meminfo
from sparkguard.guard import ring
from sparkguard.model import Thresholds

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


def blackbox_path(cfg) -> str:
    """``guard.blackbox_file``, or ``blackbox.ring`` in ``incidents.dir`` (the state directory the
    incidents live in: each guard with its own incidents has its own ring)."""
    return cfg.guard.blackbox_file or os.path.join(cfg.incidents.dir, "blackbox.ring")


def open_blackbox(cfg, recorder, reporter, host: str, boot_id: str):
    """Open the black box (``guard.blackbox``) and report how the run before ended.

    When the previous run's ring shows no clean stop (:func:`sparkguard.blackbox.verdict`), an
    ``unclean-shutdown`` incident is reported now: its ``unclean_shutdown`` event and the report
    go to the reporter (journal, incident file), and ``recorder`` counts it.  Then this run's ring
    starts.  Returns the :class:`sparkguard.guard.ring.Ring`, or None when off or unusable (logged:
    the guard runs on without it).
    """
    if not cfg.guard.blackbox:
        return None
    path = blackbox_path(cfg)
    now = time.time()
    try:
        r, previous, error = ring.open_ring(path, boot_id, cfg.guard.blackbox_sync, now)
    except Exception as e:  # noqa: BLE001 - the black box must never cost the guard its start
        log.exception("black box off: opening %s failed (%s)", path, e)
        return None
    if r is None:
        log.error("black box off: %s", error)
        return None
    if previous is not None:
        try:
            _report_previous(cfg, path, previous, now, recorder, reporter, host, boot_id)
        except Exception as e:  # noqa: BLE001 - nor what the previous run left there
            log.exception("black box %s: the previous run's ring could not be reported (%s); starting a new one",
                          path, e)
    log.info("black box: one sample a second in %s (writeback every %s)", path,
             f"{cfg.guard.blackbox_sync:g}s" if cfg.guard.blackbox_sync else "- (the kernel's writeback)")
    return r


def _report_previous(cfg, path: str, previous: bytes, now: float, recorder, reporter, host: str, boot_id: str) -> None:
    """Decode the previous run's ring (``previous``: its bytes) and, when it shows no clean stop,
    report the ``unclean-shutdown`` incident (:func:`open_blackbox`).  Records with values out of
    range are skipped and counted by :func:`sparkguard.blackbox.decode` (``unreadable_slots``)."""
    try:
        old = blackbox.decode(previous)
    except blackbox.RingError as e:
        log.warning("black box %s: the previous run's ring is unreadable (%s); starting a new one", path, e)
        return
    if old.bad:
        log.warning("black box %s: %d slots of the previous run's ring are unreadable or out of range: skipped",
                    path, old.bad)
    cause = blackbox.verdict(old, boot_id)
    if cause is None:
        return
    try:
        mi = meminfo.read()
    except OSError:
        mi = {}
    inc = blackbox.incident(old, cause, now, host, boot_id, Thresholds.of(cfg.guard), mi)
    rec = inc.to_json()
    recorder.count(inc.kind, inc.started_at, inc.id)
    reporter.event(inc.ref(), rec["timeline"][-1])
    reporter.finish(rec)
    log.warning("black box: %s", inc.summary)


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

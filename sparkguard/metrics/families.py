"""The ``sparkguard_*`` metric families, built at scrape time from the daemon snapshot, PSI and zram.

Nothing here runs in the poll loop.  :class:`GuardCollector` calls the daemon's
``snapshot()`` (a cheap dict copy of the guard's state) from the HTTP thread when
Prometheus scrapes, and reads PSI and zram itself at that moment through
:mod:`sparkguard.sysinfo`; so the loop pays nothing per poll.

Metric names (docs/metrics.md lists every one): prefix ``sparkguard_``, base units (bytes,
seconds, ratios 0-1), counters end in ``_total``.  ``promtool check metrics`` passes on
the output (tests/test_metrics.py runs it).
"""

from __future__ import annotations

import logging
import socket
from typing import Any, Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    InfoMetricFamily,
    Metric,
    SummaryMetricFamily,
)

from sparkguard import __version__, buddyinfo, meminfo, sysinfo

log = logging.getLogger("sparkguard.metrics")

#: Guard states, in the order the daemon moves through them (the snapshot's ``state``);
#: ``no_target``: below the line with nothing to signal (``sparkguard.policy.NO_TARGET``).
#: All are exported from the first scrape, so ``guard_state{state="no_target"} == 1`` can be alerted on.
STATES = ("ok", "term_sent", "kill_sent", "recovering", "no_target")


P = "sparkguard_"


def _gauge(name: str, doc: str, value: Any, labels: dict[str, str] | None = None) -> Metric | None:
    """One-sample gauge, or None when ``value`` is None (the metric is then absent)."""
    if value is None:
        return None
    if labels:
        g = GaugeMetricFamily(P + name, doc, labels=list(labels))
        g.add_metric(list(labels.values()), float(value))
        return g
    return GaugeMetricFamily(P + name, doc, value=float(value))


class GuardCollector:
    """Builds every ``sparkguard_*`` metric at scrape time.

    Args:
        snapshot: ``() -> dict`` returning the daemon snapshot (``Guard.snapshot()``; missing
            keys or None values leave their metrics out).  Called once per
            scrape from the HTTP thread; an exception is logged and the guard's metrics are left
            out of that scrape (PSI, zram and build info still appear) rather than failing it.
        read_psi: ``() -> dict | None``, default :func:`sparkguard.sysinfo.read_psi_memory`.
        read_zram: ``() -> list[dict]``, default :func:`sparkguard.sysinfo.read_zram`.
        read_meminfo: ``() -> dict``, default :func:`sparkguard.meminfo.read` (MemFree).
        read_buddy: ``() -> buddyinfo.Summary | None``, default :func:`sparkguard.buddyinfo.read`.

    Sources: /proc/meminfo (MemAvailable, MemTotal, SwapFree, SwapTotal; Documentation/
    filesystems/proc.rst), /proc/pressure/memory (Documentation/accounting/psi.rst),
    /sys/block/zram*/mm_stat (Documentation/admin-guide/blockdev/zram.rst), /proc/buddyinfo
    (Documentation/filesystems/proc.rst).
    """

    def __init__(self, snapshot: Callable[[], dict],
                 read_psi: Callable[[], dict | None] = sysinfo.read_psi_memory,
                 read_zram: Callable[[], list[dict]] = sysinfo.read_zram,
                 read_meminfo: Callable[[], dict] = meminfo.read,
                 read_buddy: Callable[[], Any] = buddyinfo.read):
        self._snapshot = snapshot
        self._read_psi = read_psi
        self._read_zram = read_zram
        self._read_meminfo = read_meminfo
        self._read_buddy = read_buddy
        self._last_error = ""

    def collect(self) -> Iterator[Metric]:
        """Yield the metric families for one scrape (prometheus_client Collector protocol)."""
        info = InfoMetricFamily(P + "build", "sparkguard version running and the host it runs on (value 1).")
        # the host's name: `sparkguard status --url` tells this host's endpoint from another's
        # reached through a loopback address (an ssh -L tunnel)
        info.add_metric([], {"version": __version__, "hostname": socket.gethostname()})
        yield info
        try:
            snap = self._snapshot() or {}
        except Exception as e:  # the scrape must still answer; the daemon keeps guarding
            msg = f"{type(e).__name__}: {e}"
            if msg != self._last_error:
                log.warning("metrics: daemon snapshot failed, guard metrics left out: %s", msg)
                self._last_error = msg
            snap = {}
        for m in self._guard(snap):
            if m is not None:
                yield m
        yield from self._psi()
        yield from self._zram()
        yield from self._free()

    # --- the daemon's own state

    def _guard(self, s: dict) -> Iterable[Metric | None]:
        mi = "from /proc/meminfo at the daemon's last poll"
        yield _gauge("memory_available_bytes", "MemAvailable in bytes, from /proc/meminfo when scraped (the "
                     "daemon's last full pass if that read fails).", s.get("available_bytes"))
        yield _gauge("memory_total_bytes", f"MemTotal in bytes, {mi}.", s.get("total_bytes"))
        yield _gauge("swap_free_bytes", f"SwapFree in bytes (zram included), {mi}.", s.get("swap_free_bytes"))
        yield _gauge("swap_total_bytes", f"SwapTotal in bytes (zram included), {mi}.", s.get("swap_total_bytes"))
        yield _gauge("guard_signal_bytes",
                     "Bytes the guard compares with its lines at the last poll: MemAvailable, or "
                     "MemAvailable+SwapFree when guard.signal is available+swap.", s.get("signal_bytes"))
        yield _gauge("term_below_bytes", "SIGTERM line (guard.term_below): the target is sent SIGTERM "
                     "when the signal falls below this many bytes.", s.get("term_below_bytes"))
        yield _gauge("kill_below_bytes", "SIGKILL floor (guard.kill_below): below this many bytes the "
                     "rest of the grace period is skipped. Absent when off.", s.get("kill_below_bytes"))
        yield _gauge("grace_seconds", "Seconds between SIGTERM and SIGKILL of the whole tree (guard.grace).",
                     s.get("grace_seconds"))
        yield _gauge("poll_interval_seconds", "Slowest interval between two polls of /proc/meminfo "
                     "(guard.poll_interval); the loop polls faster as headroom shrinks.",
                     s.get("poll_interval_seconds"))
        yield _gauge("memory_fall_rate_bytes_per_second",
                     "Estimated fall rate of the guard's signal in bytes per second (sparkguard.rate: median of "
                     "pairwise slopes over guard.rate_window; 0 while rising or far above the line). Absent "
                     "with guard.rate_trigger off.", s.get("fall_rate_bytes_per_second"))
        state = s.get("state")
        if state is not None:
            g = GaugeMetricFamily(P + "guard_state", "Guard state machine: 1 for the current state, 0 for "
                                  "the others (ok, term_sent, kill_sent, recovering, no_target).", labels=["state"])
            for st in STATES + (() if state in STATES else (str(state),)):
                g.add_metric([st], 1.0 if st == state else 0.0)
            yield g
        if s.get("dry_run") is not None:
            yield _gauge("dry_run", "1 when guard.dry_run is on: decisions are made and reported, "
                         "no signal is sent.", 1 if s["dry_run"] else 0)
        view = s.get("proc_view") or {}
        yield _gauge("visible_processes", "Processes the guard saw in /proc when it started.", view.get("processes"))
        yield _gauge("visible_other_user_processes", "Processes of other users whose /proc/PID/stat the guard "
                     "could read when it started (hidepid= hides them from a guard without CAP_SYS_PTRACE).",
                     view.get("other_users_readable"))
        if s.get("signals_sent") is not None:
            c = CounterMetricFamily(P + "signals", "Signals sent to targets since the daemon started, "
                                    "by signal (each process signalled counts once).", labels=["signal"])
            sent = dict(s["signals_sent"])
            for sig in ("SIGTERM", "SIGKILL"):
                sent.setdefault(sig, 0)
            for sig, n in sorted(sent.items()):
                c.add_metric([sig], float(n))
            yield c
        if s.get("incidents") is not None:
            c = CounterMetricFamily(P + "incidents", "Incidents (episodes from a crossing until memory is "
                                    "back and the victim gone) since the daemon started, by kind.",
                                    labels=["kind"])
            kinds = dict(s["incidents"])
            kinds.setdefault("memory", 0)
            for kind, n in sorted(kinds.items()):
                c.add_metric([str(kind)], float(n))
            yield c
        yield _gauge("last_incident_timestamp_seconds", "Unix time the last incident started. Absent "
                     "until the first incident.", s.get("last_incident_timestamp"))
        if s.get("last_incident"):
            i = InfoMetricFamily(P + "last_incident", "The last incident's id and kind (the file "
                                 "<incidents.dir>/<id>.json, `sparkguard incidents`). Absent until the first.")
            i.add_metric([], {"id": str(s["last_incident"][0]), "kind": str(s["last_incident"][1])})
            yield i
        if s.get("poll_count") is not None and s.get("poll_seconds_sum") is not None:
            yield SummaryMetricFamily(P + "poll_duration_seconds", "Time spent in the timed polls of the "
                                      "loop (read /proc/meminfo, decide, act), seconds: every poll near the line "
                                      "or in an incident, one every 10 s while idle; _count is the number of timed "
                                      "polls.", count_value=int(s["poll_count"]), sum_value=float(s["poll_seconds_sum"]))
        if s.get("polls_total") is not None:
            c = CounterMetricFamily(P + "polls", "Reads of /proc/meminfo by the loop since start (timed and "
                                    "idle fast-path polls); its rate is the polling rate.")
            c.add_metric([], float(s["polls_total"]))
            yield c
        for key, name, what in (("notify_dropped", "notify_dropped", "sd_notify datagrams (WATCHDOG=1, STATUS=...) "
                                 "the service manager's socket could not take at once (queue full, no listener), "
                                 "dropped so the poll loop never waits"),
                                ("log_dropped", "log_dropped", "log records dropped because the queue to the stderr "
                                 "writer was full (stderr stalled); the poll loop never waits for its log")):
            if s.get(key) is not None:
                c = CounterMetricFamily(P + name, what + ".")
                c.add_metric([], float(s[key]))
                yield c
        yield _gauge("last_poll_timestamp_seconds", "Unix time of the daemon's last poll; a stale value "
                     "means the loop is stuck.", s.get("last_poll_timestamp"))
        yield _gauge("start_time_seconds", "Unix time the guard started.", s.get("started_timestamp"))
        if s.get("config_reloads") is not None:
            c = CounterMetricFamily(P + "config_reloads", "Configuration reloads (SIGHUP) since start, by "
                                    "result; a failed reload keeps the running configuration.",
                                    labels=["result"])
            r = dict(s["config_reloads"])
            for res in ("ok", "failed"):
                c.add_metric([res], float(r.get(res, 0)))
            yield c
        yield from self._pause(s.get("pause"))

    @staticmethod
    def _pause(p: dict | None) -> Iterator[Metric | None]:
        """The soft line's families (docs/soft-line.md) from the snapshot's ``pause`` part."""
        if not isinstance(p, dict):
            return
        yield _gauge("engine_paused", "1 while the engine's last answer to the soft line was: paused "
                     "(POST /pause, guard.pause_below), 0 otherwise.", 1 if p.get("engine_paused") else 0)
        counts = p.get("counts") or {}
        for op, name, what in (("pause", "pauses", "Pause requests (POST /pause) the engine answered, by result; "
                                "failed: an error, no endpoint or no answer in guard.pause_timeout"),
                               ("resume", "resumes", "Resume requests (POST /resume) the engine answered, by "
                                "result")):
            c = CounterMetricFamily(P + name, what + ".", labels=["result"])
            r = counts.get(op) or {}
            for res in ("ok", "failed"):
                c.add_metric([res], float(r.get(res, 0)))
            yield c

    # --- read at scrape time

    def _psi(self) -> Iterator[Metric]:
        try:
            psi = self._read_psi()
        except Exception as e:  # sysinfo never raises; belt and braces for a custom reader
            log.warning("metrics: PSI read failed: %s", e)
            psi = None
        if not psi:
            return
        stalled = CounterMetricFamily(P + "pressure_memory_stalled_seconds", "Total time some / all "
                                      "non-idle tasks were stalled on memory, seconds "
                                      "(/proc/pressure/memory total=).", labels=["kind"])
        for kind in ("some", "full"):
            vals = psi.get(kind)
            if not vals:
                continue
            g = GaugeMetricFamily(P + f"pressure_memory_{kind}_ratio",
                                  f"Share of wall time (0-1) {'some' if kind == 'some' else 'all'} non-idle "
                                  f"tasks were stalled on memory, averaged over the window "
                                  f"(/proc/pressure/memory '{kind}' avgN / 100).", labels=["window"])
            for w in ("avg10", "avg60", "avg300"):
                if w in vals:
                    g.add_metric([w], vals[w] / 100.0)
            yield g
            if "total_us" in vals:
                stalled.add_metric([kind], vals["total_us"] / 1e6)
        if stalled.samples:
            yield stalled

    def _free(self) -> Iterator[Metric]:
        """MemFree (what the GPU driver can allocate on a GB10) and how much of the free memory
        lies in >= 2 MiB blocks (the start gate's fragmentation check, docs/start-gate.md)."""
        try:
            free = self._read_meminfo().get("MemFree")
            buddy = self._read_buddy()
        except Exception as e:  # noqa: BLE001 - the scrape must still answer
            log.warning("metrics: MemFree / buddyinfo read failed: %s", e)
            return
        m = _gauge("memory_free_bytes", "MemFree in bytes from /proc/meminfo at scrape time: on a GB10 what "
                   "the GPU driver can allocate (it does not reclaim page cache).", free)
        if m is not None:
            yield m
        if buddy is not None:
            yield _gauge("buddy_high_order_bytes", "Free bytes in blocks of at least 2 MiB (order >= 9 with 4 KiB "
                         "pages), from /proc/buddyinfo at scrape time; far below MemFree means fragmented.",
                         buddy.high_order_bytes)

    def _zram(self) -> Iterator[Metric]:
        try:
            devs = self._read_zram()
        except Exception as e:
            log.warning("metrics: zram read failed: %s", e)
            devs = []
        if not devs:
            return
        src = "/sys/block/<device>/"
        fams = [
            ("disksize_bytes", "disksize_bytes", f"Uncompressed capacity of the zram swap device, bytes ({src}disksize)."),
            ("orig_data_bytes", "orig_data_bytes", f"Uncompressed bytes stored in the zram device ({src}mm_stat orig_data_size)."),
            ("compr_data_bytes", "compr_data_bytes", f"Compressed size of the stored data, bytes ({src}mm_stat compr_data_size)."),
            ("mem_used_bytes", "mem_used_bytes", f"RAM the zram device really uses, allocator overhead included, bytes "
                                                f"({src}mm_stat mem_used_total); this comes out of MemAvailable."),
        ]
        for name, key, doc in fams:
            g = GaugeMetricFamily(P + "zram_" + name, doc, labels=["device"])
            for d in devs:
                if key in d:
                    g.add_metric([d["device"]], float(d[key]))
            if g.samples:
                yield g


class ConfigCollector:
    """The running configuration's place in a cluster: ``sparkguard_cluster_info`` and
    ``sparkguard_engine_lanes_info``, read from the config at scrape time (a reload shows at once).

    ``sparkguard_cluster_info{cluster,node,node_rank,nnodes,digest}`` 1 only with a cluster file
    and ``sparkguard_cluster_nodes`` (its ``nnodes`` as a value, for alert arithmetic)
    (``cfg.cluster`` with ``.name``, ``.node``, ``.rank``, ``.nnodes``, ``.digest``, set by
    :mod:`sparkguard.cluster.file`); ``sparkguard_engine_lanes_info{lane}`` 1 for each of
    ``engine.lanes`` (none without lanes).  Alert rules join other series to the cluster's name
    with ``* on(instance) group_left(cluster) sparkguard_cluster_info``.

    Args:
        config: ``() -> Config``, the configuration in force now (the guard's ``cfg``).
    """

    def __init__(self, config: Callable[[], Any]):
        self._config = config

    def collect(self) -> Iterator[Metric]:
        """Yield the metric families for one scrape (prometheus_client Collector protocol)."""
        cfg = self._config()
        cl = getattr(cfg, "cluster", None)
        if getattr(cl, "name", None) is not None:       # without a cluster file every field is None
            i = InfoMetricFamily(P + "cluster", "This node's place in its cluster file: the cluster's name, "
                                 "this node's name, its node rank, the number of nodes and the file's "
                                 "digest (value 1).")
            i.add_metric([], {"cluster": str(cl.name), "node": str(cl.node), "node_rank": str(cl.rank),
                              "nnodes": str(cl.nnodes), "digest": str(getattr(cl, "digest", None) or "")})
            yield i
            g = GaugeMetricFamily(P + "cluster_nodes", "The number of nodes in this node's cluster file: what "
                                  "the cluster alert compares the nodes that report with.")
            g.add_metric([], float(cl.nnodes))
            yield g
        engine = getattr(cfg, "engine", None)
        lanes = getattr(engine, "lanes", None) or {}
        if lanes and getattr(engine, "enabled", True):
            i = InfoMetricFamily(P + "engine_lanes", "Every lane the engine's config has (engine.lanes), one "
                                 "series each (value 1).")
            for name in lanes:
                i.add_metric([], {"lane": str(name)})
            yield i


def build_registry(snapshot: Callable[[], dict], extra_collectors: Iterable[Any] = (),
                   config: Callable[[], Any] | None = None) -> CollectorRegistry:
    """A fresh :class:`CollectorRegistry` with the guard, process and extra collectors, and the
    :class:`ConfigCollector` of ``config`` (``() -> Config``) when given.

    The process collector adds ``process_resident_memory_bytes``, ``process_cpu_seconds_total``,
    ``process_open_fds``... of this process (read from /proc/self at scrape time).
    """
    reg = CollectorRegistry()
    ProcessCollector(registry=reg)
    reg.register(GuardCollector(snapshot))
    if config is not None:
        reg.register(ConfigCollector(config))
    for c in extra_collectors:
        reg.register(c)
    return reg

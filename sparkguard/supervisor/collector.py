"""The engine's Prometheus metrics, read from the supervisor's status at scrape time."""

from __future__ import annotations

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily


class EngineCollector:
    """prometheus_client collector of the engine metrics (exported beside :mod:`sparkguard.metrics`' own).

    ``sparkguard_engine_up``, ``_ready`` (0/1), ``sparkguard_engine_restarts_total{reason}``,
    ``sparkguard_engine_lane_info{lane}``, ``sparkguard_engine_time_to_ready_seconds`` (last start;
    absent until one was ready), ``sparkguard_engine_quiesce_wait_seconds`` (last start),
    ``sparkguard_engine_restart_backoff_seconds`` (delay before the pending restart, 0 if none).

    Args:
        sup: anything with ``status() -> dict`` shaped like :meth:`Supervisor.status`.
    """

    def __init__(self, sup):
        self.sup = sup

    def collect(self):
        """Yield the metric families (prometheus_client Collector protocol)."""
        s = self.sup.status()
        P = "sparkguard_engine_"
        yield GaugeMetricFamily(P + "up", "1 while the supervised engine's process runs.", value=float(s["up"]))
        yield GaugeMetricFamily(P + "ready", "1 while the engine answers 200 on engine.health_url "
                                "(or runs, without a health_url).", value=float(s["ready"]))
        c = CounterMetricFamily(P + "restarts", "Engine restarts by reason: exit, guard, wedged, lane, head, "
                                "not_ready, manual, link.", labels=["reason"])
        for r, n in s["restarts"].items():
            c.add_metric([r], float(n))
        yield c
        if s["lane"]:
            i = InfoMetricFamily(P + "lane", "The engine's current lane (engine.lanes).", labels=None)
            i.add_metric([], {"lane": s["lane"]})
            yield i
        if s["time_to_ready"] is not None:
            yield GaugeMetricFamily(P + "time_to_ready_seconds", "Seconds from spawn to ready of the last start.",
                                    value=s["time_to_ready"])
        if s["quiesce_wait"] is not None:
            yield GaugeMetricFamily(P + "quiesce_wait_seconds", "Seconds the last start waited in the memory "
                                    "and peers gates.", value=s["quiesce_wait"])
        yield GaugeMetricFamily(P + "restart_backoff_seconds", "Delay before the pending automatic restart "
                                "(grows in a crash loop), 0 when none.",
                                value=float(s["backoff"] if s["state"] == "backoff" else 0.0))

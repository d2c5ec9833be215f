"""The engine's Prometheus metrics, read from the supervisor's status at scrape time."""

from __future__ import annotations

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily

from sparkguard.supervisor.state import STATES


class EngineCollector:
    """prometheus_client collector of the engine metrics (exported beside :mod:`sparkguard.metrics`' own).

    ``sparkguard_engine_up``, ``_ready`` (0/1), ``sparkguard_engine_restarts_total{reason}``,
    ``sparkguard_engine_lane_info{lane}``, ``sparkguard_engine_time_to_ready_seconds`` (last start;
    absent until one was ready), ``sparkguard_engine_quiesce_wait_seconds`` (last start),
    ``sparkguard_engine_restart_backoff_seconds`` (delay before the pending restart, 0 if none),
    ``sparkguard_engine_tracking_info{mode, tracks, delegation}`` (cgroup or process-group; container
    or engine; xattr, write-test or none),
    ``sparkguard_engine_adoptions_total{result}`` (:mod:`.adoptrun`),
    ``sparkguard_engine_start_gate_info{gate,state}`` (each gate of the pass now or the last:
    docs/start-gate.md), ``sparkguard_engine_gpu_memory_bytes`` (with NVML: docs/gpu-memory.md).

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
                                "not_ready, manual, link, peer, load.", labels=["reason"])
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
        if "adoptions" in s:
            c = CounterMetricFamily(P + "adoptions", "Engines a previous sparkguard left running, by what this "
                                    "daemon did at start: adopted, refused (identity not verified), changed "
                                    "(another command configured: stopped), gone (no longer running).",
                                    labels=["result"])
            for r, n in s["adoptions"].items():
                c.add_metric([r], float(n))
            yield c
        t = s.get("tracking")
        if t:
            i = InfoMetricFamily(P + "tracking", "How the engine's processes are tracked: mode cgroup (a cgroup of "
                                 "its own per run) or process-group (process group, descendants, recorded members); "
                                 "tracks container (a docker/podman run engine: its container's cgroup) or engine; "
                                 "delegation xattr, write-test or none (how systemd's delegation was found).",
                                 labels=None)
            i.add_metric([], {"mode": t["mode"], "tracks": t.get("tracks") or "engine",
                              "delegation": t.get("delegation") or "none"})
            yield i
        if s.get("gpu_bytes") is not None:
            yield GaugeMetricFamily(P + "gpu_memory_bytes", "GPU memory NVML reports over the engine's processes "
                                    "(nvmlDeviceGetComputeRunningProcesses), bytes; absent without nvidia-ml-py "
                                    "or a running engine (docs/gpu-memory.md).", value=float(s["gpu_bytes"]))
        gates = s.get("start_gates") or []
        if gates:
            i = InfoMetricFamily(P + "start_gate", "Each start gate of the current or last start (hold, "
                                 "drop_caches, compact, quiesce, memfree, peers, cluster) and its state: waiting, "
                                 "open, timed_out, fragmented, done, failed (docs/start-gate.md).", labels=None)
            for g in gates:
                i.add_metric([], {"gate": str(g.get("gate")), "state": str(g.get("state"))})
            yield i
        # what the other nodes of a TP cluster read (sparkguard.supervisor.cluster, nodes)
        r = s["role"]
        i = InfoMetricFamily(P + "role", "The engine's part in a TP cluster, from its command line: role "
                             "(single, head, headless), node_rank (--node-rank), nnodes (--nnodes).", labels=None)
        i.add_metric([], {"role": r["role"], "node_rank": str(r["node_rank"]), "nnodes": str(r["nnodes"])})
        yield i
        g = GaugeMetricFamily(P + "state", "Supervisor state: 1 for the current state, 0 for the others.",
                              labels=["state"])
        for st in STATES:
            g.add_metric([st], 1.0 if st == s["state"] else 0.0)
        yield g
        yield GaugeMetricFamily(P + "wanted", "1 while the supervisor wants the engine running, 0 when it is "
                                "stopped on purpose (engine stop, engine.restart, given up).",
                                value=1.0 if s["want"] == "run" else 0.0)
        yield GaugeMetricFamily(P + "given_up", "1 when the supervisor gave up after engine.give_up_after failed "
                                "starts within engine.give_up_window; cleared by sparkguard engine start.",
                                value=1.0 if s["given_up"] else 0.0)
        if s["run_start"] is not None:
            yield GaugeMetricFamily(P + "run_start_timestamp_seconds", "Unix time the current run of the engine "
                                    "was started (the name other nodes know the run by). Absent while none runs.",
                                    value=s["run_start"])
        if s["joined"] is not None:
            yield GaugeMetricFamily(P + "joined_run_start_timestamp_seconds", "A headless rank: the head run "
                                    "(its run_start_timestamp_seconds) whose group this run is in. Absent while "
                                    "it waits for a head.", value=s["joined"])
        if s["group"]:
            g = GaugeMetricFamily(P + "group_run_start_timestamp_seconds", "The head: the run of each rank "
                                  "of its current run's group, by node rank, as that node reported it.",
                                  labels=["node_rank"])
            for k, v in sorted(s["group"].items()):
                g.add_metric([k], v)
            yield g

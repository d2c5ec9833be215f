"""Prometheus metrics for the daemon: the ``sparkguard_*`` families built at scrape time
(:mod:`.families`) and the small HTTP endpoint that serves them (:mod:`.server`, :mod:`.httploop`).

The metric names, types, labels and units are listed in docs/metrics.md.
"""

from __future__ import annotations

from sparkguard.metrics.families import ConfigCollector, GuardCollector, build_registry
from sparkguard.metrics.server import (
    DEFAULT_LISTEN, MetricsListenError, MetricsServer, start_server,
)

__all__ = ["DEFAULT_LISTEN", "ConfigCollector", "GuardCollector", "MetricsListenError", "MetricsServer", "build_registry",
           "start_server"]

"""The cluster file as the operator's commands use it: ``load(path) -> ClusterFile`` and one
node's derived engine command and section.

The implementation is :mod:`sparkguard.config.clusterfile` (load, validate) and
:mod:`sparkguard.config.clusternode` (one node's section): ``config.load`` builds each node's
configuration from the same file, and the config package cannot import this one without an
import circle; this module is the name ``sparkguard cluster`` and its helpers import.
"""

from __future__ import annotations

from sparkguard.config.clusterfile import (
    DEFAULT_API_PORT, DEFAULT_MASTER_PORT, DEFAULT_METRICS_PORT, DEFAULT_PATH, DERIVED_FLAGS, DERIVED_KEYS, from_dict,
    load,
)
from sparkguard.config.clusternode import derived_args, find_node, head_health_url, node_command, node_engine

__all__ = [
    "DEFAULT_API_PORT", "DEFAULT_MASTER_PORT", "DEFAULT_METRICS_PORT", "DEFAULT_PATH", "DERIVED_FLAGS",
    "DERIVED_KEYS", "derived_args", "find_node", "from_dict", "head_health_url", "load", "node_command",
    "node_engine",
]

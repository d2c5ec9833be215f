"""Configuration: schema, embedded defaults, loading and validation.

The file is YAML, default path ``/etc/sparkguard/sparkguard.yaml``; when it is absent
the embedded defaults apply.  Every error names the file, the dotted key and the value
(:class:`ConfigError`), so that ``sparkguard run`` refuses to start and a SIGHUP reload
keeps the running configuration.

Sections and keys (see README "Configuration"):

* ``guard``: ``poll_interval``, ``term_below``, ``kill_below``, ``grace``, ``signal``,
  ``dry_run``, ``recovery_wait``, ``rate_trigger``, ``rate_lead``, ``rate_window``, ``rate_min_fall``
  (docs/rate.md),
  the soft line's ``pause_below``, ``pause_hysteresis``,
  ``resume_after``, ``pause_url``, ``pause_mode``, ``pause_timeout`` (docs/soft-line.md)
* ``targets``: ``match``, ``protect``, ``fallback``
* ``metrics``: ``listen``
* ``incidents``: ``dir``, ``journal``
* ``engine`` (optional; absent = guard only): ``command``, ``env``, ``cwd``, ``user``, lifecycle,
  gates, health, probe, restart policy, lanes, control socket, peers, head, ``load_phase`` (see
  :class:`EngineConfig`)
* ``link``: ``interfaces``, ``down_after``, ``mark_unhealthy``
* ``cluster`` (optional): ``file``, ``node``: this node of a cluster file (docs/cluster.md); its
  engine command, lanes, peers, head URL and metrics address are derived from that file

Numbers are read as the decimal the user wrote or refused (:class:`.yamlload.Loader`, sparkguard.units):
NaN, infinities, ``1e400``, octal ``010``, ``0x10``, ``1_000``, sexagesimal ``1:30`` and dates
never become another value; each numeric key has bounds (SCHEMA) that keep the poll loop sane.
The file itself must be a regular file of at most :data:`.yamlload.MAX_FILE_BYTES` (1 MiB).

Modules: ``errors`` (ConfigError), ``parsers`` (value parsers and their bounds), ``engine`` (the
``engine:`` section and its vLLM facts), ``schema`` (the section dataclasses and SCHEMA),
``yamlload`` (the bounded file read and the YAML loader), ``cluster`` (the ``cluster:`` section
resolved through ``clusterfile``, the cluster file's load and validation, and ``clusternode``,
one node's engine section derived from it), ``load`` (build and cross-checks).
This package exposes the names callers use.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from sparkguard.config.engine import (
    SHUTDOWN_ENV, EngineConfig, LaneConfig, LoadPhaseConfig, ProbeConfig, is_vllm, vllm_shutdown_timeout,
)
from sparkguard.config.errors import ConfigError
from sparkguard.config.load import DEFAULT_PATH, from_dict, load
from sparkguard.config.schema import SCHEMA, ClusterConfig, Config, GuardConfig, IncidentsConfig, LinkConfig, MetricsConfig, TargetsConfig

__all__ = [
    "ClusterConfig", "Config", "ConfigError", "DEFAULT_PATH", "EngineConfig", "GuardConfig", "IncidentsConfig", "LaneConfig",
    "LinkConfig", "LoadPhaseConfig", "MetricsConfig", "ProbeConfig", "SCHEMA", "SHUTDOWN_ENV", "TargetsConfig", "from_dict", "is_vllm",
    "load", "replace", "vllm_shutdown_timeout",
]


def replace(cfg: Config, **sections: Any) -> Config:
    """Return a copy of ``cfg`` with whole sections replaced (``replace(cfg, guard=g)``)."""
    return dataclasses.replace(cfg, **sections)

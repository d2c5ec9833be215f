"""The ``cluster:`` section of sparkguard.yaml: find this node in the cluster file and write its
derived ``engine:`` section (and ``metrics.listen``) into the document before the sections are built.

``cluster: {file: /etc/sparkguard/cluster.yaml, node: spark-1}``; ``node`` defaults to this
host's name (``socket.gethostname()``, also its first label).  The node's own ``engine:`` may set
node-local keys (state_file, control_socket, log, user, cwd, drop_caches, start_above, timers, env
added over the cluster's) but not the keys the cluster file owns (:data:`CLUSTER_KEYS`).
"""

from __future__ import annotations

import socket
from typing import Any

from sparkguard.cluster.model import host_port
from sparkguard.config.clusterfile import load, normal_host
from sparkguard.config.clusternode import find_node, node_engine
from sparkguard.config.errors import ConfigError
from sparkguard.config.parsers import abs_path, listen_address, optional_str
from sparkguard.config.schema import ClusterConfig

#: engine keys set by the cluster file only (shared or derived per node)
CLUSTER_KEYS = ("command", "lanes", "lane", "peers", "head_url", "health_url")
_KEYS = {"file": abs_path, "node": optional_str}


#: bind addresses that include the node's addr (every address of the host)
_WILDCARDS = ("0.0.0.0", "::")


def _check_listen(path: str, raw: Any, node) -> None:
    """A node's own ``metrics.listen`` must still serve where the cluster file says the node's
    metrics are (``http://<addr>:<metrics_port>/metrics``: its peers' recovery and ``sparkguard
    cluster status`` read there): the node's ``metrics_port`` on its ``addr`` or a wildcard.

    Raises:
        ConfigError: at ``metrics.listen`` of ``path`` (off, another port or another host).
    """
    try:
        listen = listen_address(raw)
    except ValueError:
        return                      # the metrics section's own parser names this error
    want = host_port(node.addr, node.metrics_port)
    if listen is None:
        raise ConfigError(path, "metrics.listen", raw, f"a cluster node serves its metrics (the others read them at "
                          f"{want}); remove metrics.listen or give {want}")
    host, port = listen
    if port != node.metrics_port or (host not in _WILDCARDS and normal_host(host) != normal_host(node.addr)):
        raise ConfigError(path, "metrics.listen", raw,
                          f"the cluster file gives node {node.name}'s metrics at {want}: listen there "
                          f"(or on 0.0.0.0:{node.metrics_port} / [::]:{node.metrics_port}), or change the cluster "
                          "file's metrics_port/addr")


def resolve(data: dict, path: str, hostname: str | None = None) -> tuple[dict, ClusterConfig]:
    """The document ``data`` with its ``cluster:`` section resolved, and what it says about this node.

    Args:
        data: the parsed sparkguard.yaml (a mapping); not changed.
        path: its file name, for errors.
        hostname: this host's name; None: ``socket.gethostname()``.
    Returns:
        (data without ``cluster`` and with the node's ``engine`` and ``metrics.listen``,
        ClusterConfig); ``(data, ClusterConfig())`` unchanged without a ``cluster:`` section.
    Raises:
        ConfigError: a bad ``cluster:`` key (naming ``path``), any error of the cluster file
        (naming the cluster file), this node not in it, or an engine key the cluster file owns
        set in ``path``.
    """
    if "cluster" not in data:
        return data, ClusterConfig()
    body = data["cluster"]
    if not isinstance(body, dict):
        raise ConfigError(path, "cluster", body, "expected a mapping with file and node")
    vals: dict[str, Any] = {}
    for k, v in body.items():
        if k not in _KEYS:
            raise ConfigError(path, f"cluster.{k}", v, "unknown key; expected one of " + ", ".join(_KEYS))
        try:
            vals[k] = _KEYS[k](v)
        except ValueError as e:
            raise ConfigError(path, f"cluster.{k}", v, str(e)) from None
    if "file" not in vals:
        raise ConfigError(path, "cluster.file", None, "missing: the cluster file's path")
    cf = load(vals["file"])
    node = find_node(cf, vals.get("node"), hostname if hostname is not None else socket.gethostname())
    local = data.get("engine") or {}
    if not isinstance(local, dict):
        raise ConfigError(path, "engine", local, "expected a mapping of keys")
    for k, v in local.items():
        if k in CLUSTER_KEYS:
            raise ConfigError(path, f"engine.{k}", v, f"set in the cluster file {cf.path}; remove it here")
    engine = node_engine(cf, node)
    for k, v in local.items():
        if k == "env" and isinstance(v, dict):
            engine["env"] = {**(engine.get("env") or {}), **v}
        else:
            engine[k] = v
    out = {k: v for k, v in data.items() if k != "cluster"}
    out["engine"] = engine
    metrics = out.get("metrics") or {}
    if isinstance(metrics, dict) and "listen" not in metrics:
        out["metrics"] = {**metrics, "listen": host_port(node.addr, node.metrics_port)}
    elif isinstance(metrics, dict):
        _check_listen(path, metrics["listen"], node)
    return out, ClusterConfig(file=cf.path, node=node.name, name=cf.name, nnodes=len(cf.nodes),
                              rank=node.rank, role=node.role, digest=cf.digest)

"""One node's ``engine:`` section, derived from a validated cluster file
(:class:`~sparkguard.cluster.model.ClusterFile`, read by :mod:`.clusterfile`): which node this host
is, its multi-node flags and command, its lanes, env, peers and head URL (docs/cluster.md).

``config.cluster`` writes that section into a node's configuration; the operator's commands
import these functions as :mod:`sparkguard.cluster.file`.
"""

from __future__ import annotations

from sparkguard.cluster.model import HEAD_RANK, ClusterFile, ClusterNode, host_port
from sparkguard.config.errors import ConfigError


def find_node(cf: ClusterFile, name: str | None, hostname: str) -> ClusterNode:
    """The node called ``name``, or without a name the one whose name is ``hostname`` or its
    first label (``spark-1`` for ``spark-1.lab``).

    Raises:
        ConfigError: no such node (naming the name or hostname and the nodes' names).
    """
    names = ", ".join(n.name for n in cf.nodes)
    if name is not None:
        for n in cf.nodes:
            if n.name == name:
                return n
        raise ConfigError(cf.path, "nodes", name, f"no node called {name}; the nodes are {names}")
    short = hostname.split(".", 1)[0]
    for want in (hostname, short):
        for n in cf.nodes:
            if n.name == want:
                return n
    raise ConfigError(cf.path, "nodes", hostname,
                      f"this host ({hostname}) is none of the nodes ({names}); name it with cluster.node "
                      "in sparkguard.yaml or rename the node")


def derived_args(cf: ClusterFile, node: ClusterNode) -> list[str]:
    """The multi-node flags of ``node``: ``--nnodes N --node-rank k --master-addr <head addr>
    --master-port P``, and ``--headless`` for k > 0 (vLLM multi-node without Ray, FIELD-NOTES "vLLM")."""
    out = ["--nnodes", str(len(cf.nodes)), "--node-rank", str(node.rank), "--master-addr", cf.head.addr,
           "--master-port", str(cf.master_port)]
    return out + (["--headless"] if node.rank != HEAD_RANK else [])


def node_command(cf: ClusterFile, node: ClusterNode) -> list[str]:
    """``node``'s engine argv: the shared command with :func:`derived_args` right after
    ``serve MODEL`` (after ``serve`` when the model is given by an option), then ``node.args``."""
    cmd = list(cf.engine["command"])
    at = cmd.index("serve") + 1
    if at < len(cmd) and not cmd[at].startswith("-"):
        at += 1
    return cmd[:at] + derived_args(cf, node) + cmd[at:] + list(node.args)


def head_health_url(cf: ClusterFile) -> str:
    """``http://<head addr>:<api_port>/health``: the head's health_url and every rank's head_url."""
    return f"http://{host_port(cf.head.addr, cf.api_port)}/health"


def node_engine(cf: ClusterFile, node: ClusterNode) -> dict:
    """``node``'s raw ``engine:`` section (as sparkguard.yaml would spell it): the shared keys,
    :func:`node_command`, env = shared env + node env, lanes = shared lanes with the node's
    additions (args appended, env merged over), peers = every other node's metrics URL, and
    ``health_url`` (the head) or ``head_url`` (a headless rank) = :func:`head_health_url`."""
    e = dict(cf.engine)
    e["command"] = node_command(cf, node)
    if node.env or "env" in e:
        e["env"] = {**(e.get("env") or {}), **node.env}
    if "lanes" in e:
        lanes = {}
        for name, body in (e["lanes"] or {}).items():
            body = dict(body or {})
            add = node.lanes.get(name)
            if add is not None:
                body["args"] = list(body.get("args") or []) + list(add.args)
                body["env"] = {**(body.get("env") or {}), **add.env}
            lanes[name] = body
        e["lanes"] = lanes
    e["peers"] = [n.metrics_url for n in cf.nodes if n.name != node.name]
    e["health_url" if node.rank == HEAD_RANK else "head_url"] = head_health_url(cf)
    return e

"""``sparkguard check-config``'s lines for a node configured from a cluster file: what this node
derived from it (its place, peers, head URL and the engine command of every lane)."""

from __future__ import annotations

import shlex


def derivation_lines(cfg) -> list[str]:
    """Lines about ``cfg``'s cluster derivation, each to be indented under check-config's OK line;
    empty without a ``cluster:`` section.

    Args:
        cfg: ``sparkguard.config.Config``.
    Returns:
        e.g. ``["cluster spark4 (/etc/sparkguard/cluster.yaml): node spark-2, headless, node rank 1
        of 4 nodes", "peers: http://10.10.0.1:8799/metrics, ...", "head: http://10.10.0.1:8000/health",
        "lane 200k: vllm serve ... --max-model-len 200000", ...]``.
    """
    c = getattr(cfg, "cluster", None)
    if c is None or c.file is None:
        return []
    e = cfg.engine
    out = [f"cluster {c.name} ({c.file}): node {c.node}, {c.role}, node rank {c.rank} of {c.nnodes} nodes",
           "peers: " + ", ".join(e.peers)]
    out.append(f"health: {e.health_url}" if c.role == "head" else f"head: {e.head_url}")
    command = list(e.command or ())
    if not e.lanes:
        out.append(f"command: {shlex.join(command)}")
    for name, lane in e.lanes.items():
        out.append(f"lane {name}: {shlex.join(command + list(lane.args))}")
    return out

"""Read the whole cluster: every node's metrics endpoint -> :class:`NodeStatus`, and the cluster's verdict.

:func:`read` scrapes every node of the cluster file at once (one bounded HTTP GET each,
:func:`sparkguard.peers.fetch`: one deadline, 256 KiB) and parses the page with
prometheus_client's text parser through :func:`sparkguard.supervisor.nodes.parse` (the reader
the nodes themselves use for recovery), plus the families only the operator's view needs:
``sparkguard_cluster_info``, ``sparkguard_engine_lane_info``, ``sparkguard_engine_lanes_info``
and the kind of ``sparkguard_last_incident_info`` (docs/metrics.md).  :func:`verdict` is pure:
it judges a list of statuses.  Reading needs no SSH (issue 14).
"""

from __future__ import annotations

import concurrent.futures
import math

from sparkguard import peers
from sparkguard.cluster.model import HEAD_RANK, ClusterFile, ClusterNode, NodeStatus
from sparkguard.supervisor import nodes

#: the families read beside :data:`sparkguard.supervisor.nodes.FAMILIES` (prefixes of their names)
EXTRA = ("sparkguard_cluster_info", "sparkguard_engine_lane_info", "sparkguard_engine_lanes_info",
         "sparkguard_last_incident_info")
#: seconds a read may run past ``timeout`` before it counts as no answer
SLACK = 0.5


def parse(node: ClusterNode, text: str) -> NodeStatus:
    """The :class:`NodeStatus` of ``node`` from one exposition ``text`` of its metrics endpoint.

    Raises:
        sparkguard.peers.PeerError: the text does not parse or is no sparkguard's.
    """
    v = nodes.parse(node.metrics_url, text)
    cluster = lane = kind = node_name = nnodes = digest = None
    lanes: list[str] = []
    for fam in peers.select(text, EXTRA):
        for s in fam.samples:
            if not math.isfinite(s.value) or s.value != 1.0:
                continue
            if s.name == "sparkguard_cluster_info":
                cluster, node_name = s.labels.get("cluster"), s.labels.get("node")
                digest = s.labels.get("digest") or None
                n = s.labels.get("nnodes", "")
                nnodes = int(n) if n.isdigit() and len(n) < 6 else None
            elif s.name == "sparkguard_engine_lane_info":
                lane = s.labels.get("lane")
            elif s.name == "sparkguard_engine_lanes_info" and "lane" in s.labels:
                lanes.append(s.labels["lane"])
            elif s.name == "sparkguard_last_incident_info":
                kind = s.labels.get("kind")
    return NodeStatus(
        node=node, up=True, cluster=cluster, role=v.role, node_rank=v.node_rank, state=v.state, lane=lane,
        lanes=tuple(lanes), ready=v.ready, run_start=v.run, joined_run_start=v.joined,
        mem_available=v.available_bytes,
        last_incident=(v.last_incident, kind or "?") if v.last_incident else None, given_up=v.given_up,
        node_name=node_name, nnodes=nnodes, digest=digest)


def read_one(node: ClusterNode, timeout: float = 3.0) -> NodeStatus:
    """One node's status; unreachable or unreadable -> ``up=False`` with ``error`` set.  Never raises.

    Args:
        timeout: seconds for the whole request (connect, answer, body).
    """
    try:
        return parse(node, peers.fetch(node.metrics_url, timeout))
    except peers.PeerError as e:
        return NodeStatus(node=node, up=False, error=str(e))
    except Exception as e:  # noqa: BLE001 - whatever a node's text makes of the parser: unreadable
        return NodeStatus(node=node, up=False, error=f"unreadable: {e!r}")


def read(cluster: ClusterFile, timeout: float = 3.0) -> list[NodeStatus]:
    """Every node's status, in rank order, read at once (a thread each).

    Args:
        cluster: the cluster file; each node is read at ``node.metrics_url``.
        timeout: seconds per node for the whole request; the reads run side by side, so the
            whole call takes at most ``timeout`` + :data:`SLACK` seconds.
    Returns:
        list[NodeStatus], one per node of ``cluster.nodes``, in that (rank) order.  Never raises.
    """
    ns = list(cluster.nodes)
    if not ns:
        return []
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=len(ns), thread_name_prefix="sg-cluster-read")
    try:
        futs = [pool.submit(read_one, n, timeout) for n in ns]
        concurrent.futures.wait(futs, timeout + SLACK)
        return [f.result() if f.done() else NodeStatus(node=n, up=False, error="no answer in time")
                for n, f in zip(ns, futs)]
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


def _name(st: NodeStatus) -> str:
    """``"gx2 (rank 1)"`` for the verdict's text."""
    return f"{st.node.name} (rank {st.node.rank})"


def verdict(statuses: list[NodeStatus]) -> tuple[str, str]:
    """The cluster's state and why, from every node's status.  Pure.

    Args:
        statuses: one per node of the cluster file, the head (rank 0) among them.
    Returns:
        ``(word, detail)``; the word, the first that holds:
        ``"down"``: no node answers;
        ``"lane mismatch"``: the nodes that answer do not all run the same lane (detail names
        each lane's nodes);
        ``"cluster file differs"``: the nodes that answer report different cluster file digests
        (``sparkguard_cluster_info{digest}``; detail names each digest's nodes);
        ``"given up"``: a node's supervisor stopped restarting (detail names it);
        ``"stopped"``: every node answers and its engine is stopped (``sparkguard cluster stop``,
        or ``engine stop`` on each: on purpose, not a fault);
        ``"degraded"``: a node is down, the head is not ready, a headless rank has not joined
        the head's current run (``joined_run_start != head.run_start``) or is not ready, or a node
        reports another rank than the file gives it (detail lists each);
        ``"serving"``: none of these (detail: the lane and the head's run).
        The order is a choice (assumption, no source): mixed lanes come first because the head
        then answers as if serving (issue 14: "the head reports ready ... lane 1m while the
        others run 200k"); a give-up next because it needs a person.
    """
    up = [s for s in statuses if s.up]
    if not up:
        return "down", "no node answers" + "".join(f"; {_name(s)}: {s.error}" for s in statuses)
    by_lane: dict[str, list[str]] = {}
    for s in up:
        by_lane.setdefault(s.lane or "(none)", []).append(s.node.name)
    if len(by_lane) > 1:
        return "lane mismatch", "; ".join(f"{lane}: {', '.join(names)}" for lane, names in by_lane.items())
    by_digest: dict[str, list[str]] = {}
    for s in up:
        if s.digest is not None:
            by_digest.setdefault(s.digest, []).append(s.node.name)
    if len(by_digest) > 1:
        return "cluster file differs", "; ".join(f"digest {d}: {', '.join(names)}" for d, names in by_digest.items())
    gave = [s for s in up if s.given_up]
    if gave:
        return "given up", ", ".join(_name(s) for s in gave) + " gave up restarting (sparkguard engine start clears it)"
    if len(up) == len(statuses) and all(s.state == "stopped" for s in up):
        return "stopped", f"every node's engine is stopped ({len(statuses)} nodes); 'sparkguard cluster start' starts them"
    why = []
    head = next((s for s in statuses if s.node.rank == HEAD_RANK), None)
    for s in statuses:
        if not s.up:
            why.append(f"{_name(s)} down: {s.error}")
        elif s.node_rank is not None and s.node_rank != s.node.rank:
            why.append(f"{s.node.name} runs as rank {s.node_rank}, the cluster file gives it rank {s.node.rank}")
    if head is None:
        why.append("no node of rank 0 in the cluster file")
    elif head.up and not head.ready:
        why.append(f"head {head.node.name} not ready (state {head.state or 'unknown'})")
    for s in up:
        if head is None or s is head or not head.up:
            continue
        if head.run_start is None or s.joined_run_start != head.run_start:
            why.append(f"{_name(s)} has not joined the head's run (state {s.state or 'unknown'})")
        elif not s.ready:
            why.append(f"{_name(s)} joined the head's run but is not ready (state {s.state or 'unknown'})")
    if why:
        return "degraded", "; ".join(why)
    lane = up[0].lane
    return "serving", (f"lane {lane}, " if lane else "") + f"{len(statuses)} nodes in the head's run"

"""Read the other nodes' sparkguards: one scrape of a metrics endpoint -> a :class:`cluster.NodeView`.

What is read is what :class:`sparkguard.supervisor.collector.EngineCollector` exports on every
node (docs/metrics.md): the engine's role, state, current run, readiness, group or joined run,
given-up flag, plus MemAvailable and the last incident.  Each read is bounded
(:func:`sparkguard.peers.fetch`: one deadline, 256 KiB); a node that cannot be read is a view
with ``error`` set, never an exception.
"""

from __future__ import annotations

import math
import threading
import time

from sparkguard import peers
from sparkguard.supervisor.cluster import NodeView

E = "sparkguard_engine_"
#: the families a view is built from (prefixes of their names)
FAMILIES = (E, peers.METRIC + " ", peers.METRIC + "{", "sparkguard_last_incident_")


def parse(url: str, text: str) -> NodeView:
    """A :class:`NodeView` from one exposition ``text`` read from ``url``.

    A number that is not finite counts as absent (a run named NaN would never equal itself).

    Raises:
        peers.PeerError: the text does not parse, or is no sparkguard's (no MemAvailable).
    """
    vals: dict = {}
    group: dict[int, float] = {}
    info: dict = {}
    state = None
    for fam in peers.select(text, FAMILIES):
        for s in fam.samples:
            n, lb, v = s.name, s.labels, s.value
            if not math.isfinite(v):
                continue
            if n == E + "role_info":
                info = lb
            elif n == E + "state" and v == 1.0:
                state = lb.get("state")
            elif n == E + "group_run_start_timestamp_seconds":
                try:
                    group[int(lb.get("node_rank", ""))] = v
                except ValueError:
                    continue
            elif n == "sparkguard_last_incident_info":
                vals["last_incident"] = lb.get("id")
            else:
                vals[n] = v
    if peers.METRIC not in vals:
        raise peers.PeerError(f"no {peers.METRIC} (is it a sparkguard metrics endpoint?)")
    if len(group) > 1024:
        raise peers.PeerError(f"{len(group)} group members")

    def num(key: str) -> int | None:
        try:
            return int(info[key])
        except (KeyError, ValueError):
            return None

    return NodeView(
        url=url, available_bytes=peers.finite_int(vals[peers.METRIC], peers.METRIC), role=info.get("role"),
        node_rank=num("node_rank"), nnodes=num("nnodes"), state=state,
        wanted=vals.get(E + "wanted", 1.0) == 1.0, given_up=vals.get(E + "given_up", 0.0) == 1.0,
        run=vals.get(E + "run_start_timestamp_seconds"), ready=vals.get(E + "ready", 0.0) == 1.0,
        joined=vals.get(E + "joined_run_start_timestamp_seconds"), group=group,
        last_incident=vals.get("last_incident"),
        last_incident_at=vals.get("sparkguard_last_incident_timestamp_seconds"))


def read(url: str, timeout: float = 3.0) -> NodeView:
    """One node's view; unreachable or unreadable -> a view with ``error`` set.  Never raises."""
    try:
        return parse(url, peers.fetch(url, timeout))
    except peers.PeerError as e:
        return NodeView(url=url, error=str(e))
    except Exception as e:  # noqa: BLE001 - whatever a peer's text makes of the parser: unreadable
        return NodeView(url=url, error=f"unreadable: {e!r}")


def read_all(urls, timeout: float = 3.0) -> list[NodeView]:
    """:func:`read` of each URL at once (a thread each), in order; within ``timeout`` (+ 0.5 s)
    in all, so unreachable nodes do not add up.  Never raises."""
    urls = list(urls)
    out: list[NodeView | None] = [None] * len(urls)

    def one(i: int) -> None:
        out[i] = read(urls[i], timeout)
    threads = [threading.Thread(target=one, args=(i,), name="sg-node-read", daemon=True) for i in range(len(urls))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout + 0.5
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    return [v if v is not None else NodeView(url=u, error="no answer in time") for u, v in zip(urls, out)]

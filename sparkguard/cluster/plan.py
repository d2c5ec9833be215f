"""What ``sparkguard cluster lane|stop|start|restart`` will do, decided from every node's status
(:class:`NodeStatus`): pure, no I/O, so every decision is unit-tested on plain values.

The order is the one a TP engine needs (issue 14; FIELD-NOTES "multi-Spark": every rank of the
old run gone before any rank of the new one starts, headless ranks started before the head):
every node's engine stopped first, in parallel, and all stops awaited; then every headless
rank started (``--no-wait``: a headless rank's start returns at once and it waits for the head
at the rendezvous, sparkguard.supervisor.cluster); the head last; then a wait until the head
is ready in the lane and every node reports that lane and joined the head's current run.
"""

from __future__ import annotations

from dataclasses import dataclass

from sparkguard.cluster.model import HEAD_RANK, ClusterFile, NodeStatus

ACTIONS = ("lane", "stop", "start", "restart")


class Refused(Exception):
    """The action is refused before anything is done (a lane some node lacks, nodes in
    different lanes for ``start``).  ``str(e)`` is the sentence for the operator."""


@dataclass(frozen=True)
class Step:
    """One step of a plan: ``args`` (a sparkguard argv) run on ``nodes`` in parallel.

    Attributes:
        what: str, ``"stop"``, ``"start workers"``, ``"start head"``.
        nodes: tuple of node names.
        args: tuple of str, e.g. ``("engine", "stop", "--timeout", "300")``.
    """

    what: str
    nodes: tuple[str, ...]
    args: tuple[str, ...]


@dataclass(frozen=True)
class Plan:
    """What an action does.

    Attributes:
        action: str, one of :data:`ACTIONS`.
        lane: str or None, the lane every node must end in (``lane``: the one asked for;
            ``start``/``restart``: the one the nodes report; None: no lanes configured or stop).
        steps: tuple of :class:`Step`, in order; empty: nothing to do.
        noop: str or None, why there is nothing to do.
        wait_ready: bool, after the steps wait until the cluster serves (every action but stop).
    """

    action: str
    lane: str | None
    steps: tuple[Step, ...] = ()
    noop: str | None = None
    wait_ready: bool = True


def serving_in(statuses: list[NodeStatus], lane: str | None) -> bool:
    """Every node up and ready in ``lane`` (any lane when None, but the same on every node),
    running as the rank the cluster file gives it (a node that does not say is taken at its
    word, as :func:`sparkguard.cluster.view.verdict` does), the head's run known, and every
    headless rank joined that run."""
    if not statuses or not all(s.up and s.ready for s in statuses):
        return False
    if any(s.node_rank is not None and s.node_rank != s.node.rank for s in statuses):
        return False
    lanes = {s.lane for s in statuses}
    if len(lanes) != 1 or (lane is not None and lanes != {lane}):
        return False
    head = next((s for s in statuses if s.node.rank == HEAD_RANK), None)
    if head is None or head.run_start is None:
        return False
    return all(s.joined_run_start == head.run_start for s in statuses if s is not head)


def missing_lane(statuses: list[NodeStatus], lane: str) -> list[str]:
    """``"<node> (has: a, b)"`` for every node whose config lacks ``lane`` (its ``lanes``)."""
    return [f"{s.node.name} (has: {', '.join(s.lanes) or 'no engine.lanes'})" for s in statuses
            if lane not in s.lanes]


def start_steps(cluster: ClusterFile, start_args: tuple[str, ...], stop_timeout: float) -> tuple[Step, ...]:
    """Stop every node, start the headless ranks, then the head, each start with ``start_args``."""
    workers = tuple(n.name for n in cluster.nodes if n.rank != HEAD_RANK)
    steps = [Step("stop", tuple(n.name for n in cluster.nodes), stop_args(stop_timeout))]
    if workers:
        steps.append(Step("start workers", workers, start_args))
    steps.append(Step("start head", (cluster.head.name,), start_args))
    return tuple(steps)


def stop_args(timeout: float) -> tuple[str, ...]:
    """``engine stop`` waiting until stopped (SIGTERM, grace, SIGKILL on the node) for at most
    ``timeout`` seconds."""
    return ("engine", "stop", "--timeout", f"{timeout:g}")


def plan(cluster: ClusterFile, action: str, statuses: list[NodeStatus], lane: str | None = None,
         stop_timeout: float = 300.0) -> Plan:
    """The plan of ``action`` on ``cluster`` given every node's status (one per node, each up).

    Args:
        cluster: the cluster file.
        action: one of :data:`ACTIONS`.
        statuses: every node's status, as read just before (up; an unreachable node is the
            caller's failure before planning).
        lane: the lane of ``lane``.
        stop_timeout: seconds each node's ``engine stop`` may take.
    Raises:
        Refused: ``lane`` that the cluster file or some node lacks; ``start``/``restart`` while
            the nodes are set to different lanes (``lane NAME`` says which one).
        ValueError: an unknown action.
    """
    if action not in ACTIONS:
        raise ValueError(f"unknown action {action!r}")
    if action == "stop":
        return Plan("stop", None, (Step("stop", tuple(n.name for n in cluster.nodes), stop_args(stop_timeout)),),
                    wait_ready=False)
    if action == "lane":
        if cluster.lanes and lane not in cluster.lanes:
            raise Refused(f"no lane {lane!r} in the cluster file {cluster.path}; its lanes: "
                          + (", ".join(cluster.lanes) or "none"))
        lacking = missing_lane(statuses, lane)
        if lacking:
            raise Refused(f"lane {lane!r} is missing on " + "; ".join(lacking) + ": nothing was stopped")
        if serving_in(statuses, lane):
            return Plan("lane", lane, noop=f"every node is ready in lane {lane} and joined the head's run")
        return Plan("lane", lane, start_steps(cluster, ("engine", "lane", lane, "--no-wait"), stop_timeout))
    lanes = {s.lane for s in statuses}
    if len(lanes) > 1:
        which = "; ".join(f"{s.node.name}: {s.lane or '(none)'}" for s in statuses)
        raise Refused(f"the nodes are set to different lanes ({which}); choose one with "
                      "'sparkguard cluster lane NAME'")
    target = next(iter(lanes), None)
    if action == "start" and serving_in(statuses, target):
        return Plan("start", target, noop="the cluster already serves"
                    + (f" in lane {target}" if target else "") + " (every node joined the head's run)")
    # start: a rank that runs while another does not is stopped too, so the group forms anew
    return Plan(action, target, start_steps(cluster, ("engine", "start", "--no-wait"), stop_timeout))

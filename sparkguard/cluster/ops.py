"""``sparkguard cluster lane NAME|stop|start|restart``: run the plan of :mod:`sparkguard.cluster.plan`
on every node over SSH (:mod:`sparkguard.cluster.ssh`) and wait until the cluster serves.

The run, in order:

1. Preflight: ``sparkguard engine status --json`` on every node over SSH, in parallel.  It proves
   every node reachable and its sparkguard running before anything stops, and gives each node's
   own view (state, lane, the lanes its config has, its run and the head's run it joined, its
   place in its cluster file).  A node that fails here is named with how it failed (unreachable
   over SSH with ssh's line, or the remote exit status and message); exit 1, nothing stopped.
   A node that answers as another node (its cluster file's cluster name, node name or rank is
   not what the operator's file gives that destination), or runs another version of the file
   (another digest), is refused: exit 2, nothing stopped, the node and what differs named.
2. The plan (pure): refused (exit 2) for a lane some node lacks; nothing to do (exit 0) when
   every node is ready in the lane and joined the head's run.
3. Its steps: ``engine stop`` on every node, all awaited; ``engine lane NAME --no-wait`` (or
   ``engine start --no-wait``) on the headless ranks, then on the head.
4. The wait: every node's metrics read over HTTP (:func:`sparkguard.cluster.view.read`, no SSH
   per poll) each second, a progress line on stderr every :data:`PROGRESS_EVERY` seconds (each
   node's state and lane, the time since the first stop), until the head is ready in the lane
   and every node reports that lane and joined the head's current run; bounded by ``--timeout``.

Partial failure after something was stopped (a step failed on a node, a node gave up, the wait
timed out): every node is stopped again (``engine stop`` on all, in parallel) so that no mix of
old and new lanes serves, this is said on stderr, and the exit status is 1.  A TP engine with a
rank stopped serves nothing, so this leaves the cluster down rather than half-switched; the
operator fixes the named node and runs the command again.

Exit status: 0 done or nothing to do; 1 failed (what failed is on stderr); 2 a bad cluster
file or the action refused.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from typing import Callable

from sparkguard.cluster import file as cluster_file
from sparkguard.cluster import plan as planner
from sparkguard import untrusted
from sparkguard.cluster import ssh, view
from sparkguard.cluster.model import ClusterFile, ClusterNode, NodeStatus
from sparkguard.config import ConfigError
from sparkguard.supervisor.state import HALTED

EXIT_OK, EXIT_FAILED, EXIT_REFUSED = 0, 1, 2
DEFAULT_CLUSTER = "/etc/sparkguard/cluster.yaml"
#: seconds between two reads of every node's metrics while waiting
POLL = 1.0
#: seconds between two progress lines
PROGRESS_EVERY = 5.0
#: seconds an SSH command that does not wait on the engine may take (status, --no-wait starts)
QUICK_TIMEOUT = 60.0
#: seconds each node's ``engine stop`` may take (SIGTERM, the guard's grace, SIGKILL, sweep)
STOP_TIMEOUT = 300.0
#: seconds each metrics read may take
READ_TIMEOUT = 3.0
#: seconds a node's metrics may go unread in a row during the wait before it fails: a node's
#: sparkguard keeps serving metrics while its engine stops and loads, so a minute without an
#: answer is a node (or its link) gone, not a slow load (assumption: no source; a choice)
UNREADABLE_FOR = 60.0
#: exit status after the operator's Ctrl-C (128 + SIGINT, the shell's convention)
EXIT_INTERRUPTED = 130

Reader = Callable[[ClusterFile, float], list]


def from_engine_status(node: ClusterNode, resp: dict) -> NodeStatus:
    """The :class:`NodeStatus` of ``node`` from its ``sparkguard engine status --json`` answer
    (``{"ok": true, "status": Supervisor.status()}``, sparkguard/supervisor/state.py
    ``_status``).  The answer is another host's: every field's type is checked
    (:mod:`sparkguard.untrusted`).  Raises ValueError when it is not such an answer."""
    st = resp.get("status") if isinstance(resp, dict) else None
    if not isinstance(st, dict) or not isinstance(st.get("state"), str):
        raise ValueError(f"not an engine status: {untrusted.clean(repr(resp), 200)}")
    role = untrusted.opt_dict(st.get("role"), "role")
    place = untrusted.opt_dict(st.get("cluster"), "cluster")
    rank = untrusted.opt_int(role.get("node_rank"), "role.node_rank")
    if rank is None:
        rank = untrusted.opt_int(place.get("rank"), "cluster.rank")
    return NodeStatus(node=node, up=True, role=untrusted.opt_str(role.get("role"), "role.role"), node_rank=rank,
                      state=st["state"], lane=untrusted.opt_str(st.get("lane"), "lane"),
                      lanes=untrusted.str_tuple(st.get("lanes"), "lanes"),
                      ready=st.get("ready") is True, run_start=untrusted.opt_time(st.get("run_start"), "run_start"),
                      joined_run_start=untrusted.opt_time(st.get("joined"), "joined"),
                      given_up=st.get("given_up") is True,
                      cluster=untrusted.opt_str(place.get("name"), "cluster.name"),
                      node_name=untrusted.opt_str(place.get("node"), "cluster.node"),
                      nnodes=untrusted.opt_int(place.get("nnodes"), "cluster.nnodes"),
                      digest=untrusted.opt_str(place.get("digest"), "cluster.digest"))


def identity(cluster: ClusterFile, statuses: list[NodeStatus]) -> list[str]:
    """One line per node that did not answer as itself: ``"<node> (ssh DEST): reports rank 1, the
    cluster file gives 0"`` (each difference named).

    A node answers as itself when its own cluster file (its ``engine status --json``'s
    ``cluster``) has this cluster's name, gives it the node name and rank the operator's file
    gives that SSH destination, the same number of nodes and (when both are known) the same
    digest.  Anything else means the destination reaches another machine than the file says, or
    a node runs another version of the file: acting on it could stop the wrong engine."""
    out = []
    for s in statuses:
        n = s.node
        if s.cluster is None:
            out.append(f"{n.name} (ssh {n.ssh}): its sparkguard runs without a cluster file")
            continue
        diff = []
        for what, got, want in (("cluster", s.cluster, cluster.name), ("node", s.node_name, n.name),
                                ("rank", s.node_rank, n.rank), ("nnodes", s.nnodes, len(cluster.nodes))):
            if got != want:
                diff.append(f"reports {what} {got!r}, the cluster file gives {want!r}")
        if not diff and cluster.digest and s.digest and s.digest != cluster.digest:
            diff.append(f"it runs the cluster file with digest {s.digest}, this one is {cluster.digest} "
                        "(copy the file to every node and reload)")
        if diff:
            out.append(f"{n.name} (ssh {n.ssh}): " + "; ".join(diff))
    digests = {s.digest for s in statuses if s.digest}
    if not out and not cluster.digest and len(digests) > 1:     # a ClusterFile not read from a file
        out.append("the nodes run different cluster files: " + "; ".join(
            f"{s.node.name} digest {s.digest}" for s in statuses if s.digest))
    return out


def preflight(cluster: ClusterFile) -> tuple[list[NodeStatus], list[str]]:
    """Every node's own status over SSH: ``(statuses, failures)``; ``failures`` one line per node
    that could not be asked (``"<node>: <how>"``), ``statuses`` complete only when it is empty."""
    got, failures = ssh.collect(cluster, cluster.nodes, ["engine", "status", "--json"], QUICK_TIMEOUT,
                                untrusted.loads, "'engine status --json'")
    statuses = []
    for n, resp in got:
        try:
            statuses.append(from_engine_status(n, resp))
        except Exception as e:  # noqa: BLE001 - whatever a node answers is that node's failure
            failures.append(f"{n.name}: unreadable 'engine status --json': {untrusted.clean(e)}")
    return statuses, failures


def progress(statuses: list[NodeStatus], elapsed: float) -> str:
    """``"12 s: n0 head starting lane big; n1 headless waiting_for_head lane big"``."""
    parts = []
    for s in statuses:
        what = (f"{s.state or '?'}" + (f" lane {s.lane}" if s.lane else "")) if s.up else f"down ({s.error})"
        parts.append(f"{s.node.name} {s.node.role} {untrusted.clean(what)}")
    return f"{elapsed:.0f} s: " + "; ".join(parts)


def wait_serving(cluster: ClusterFile, lane: str | None, timeout: float, read: Reader, err,
                 t0: float) -> str | None:
    """Wait until :func:`plan.serving_in` holds for ``lane`` on the statuses ``read`` returns;
    None, or why not (a node gave up, a node unread for :data:`UNREADABLE_FOR` seconds in a row,
    timed out).  Progress on ``err`` every :data:`PROGRESS_EVERY` seconds (``t0``: monotonic
    time of the first stop)."""
    deadline = time.monotonic() + timeout
    last = 0.0
    moved: set[str] = set()     # nodes seen in another state than a halted one since the starts
    down_since: dict[str, float] = {}   # node -> monotonic time of its first failed read in a row
    while True:
        sts = read(cluster, READ_TIMEOUT)
        if planner.serving_in(sts, lane):
            return None
        now = time.monotonic()
        for s in sts:
            if s.up:
                down_since.pop(s.node.name, None)
            else:
                down_since.setdefault(s.node.name, now)
        gone = [s for s in sts if not s.up and now - down_since[s.node.name] >= UNREADABLE_FOR]
        if gone:
            return (", ".join(f"{s.node.name} unreadable for {now - down_since[s.node.name]:.0f} s "
                              f"({untrusted.clean(s.error)})" for s in gone) + ": " + progress(sts, now - t0))
        # a node halted before the command may still say so until its supervisor takes the start
        moved |= {s.node.name for s in sts if s.up and s.state not in HALTED}
        gave = [s.node.name for s in sts if s.up and s.state in HALTED and s.node.name in moved]
        if gave:
            return f"{', '.join(gave)} stopped trying: " + progress(sts, now - t0)
        if now - last >= PROGRESS_EVERY:
            print(f"sparkguard cluster: {progress(sts, now - t0)}", file=err, flush=True)
            last = now
        if now >= deadline:
            return f"not serving within {timeout:g} s: " + progress(sts, now - t0)
        time.sleep(POLL)


def show_plan(cluster: ClusterFile, p: planner.Plan, out) -> None:
    """The plan and the ssh commands, for ``--dry-run``."""
    if p.action == "lane":
        print(f"plan: lane {p.lane}", file=out)
    else:
        print(f"plan: {p.action}" + (f" (lane {p.lane})" if p.lane else ""), file=out)
    for k, step in enumerate(p.steps, 1):
        print(f"{k}. {step.what} on {', '.join(step.nodes)}" + (" (in parallel)" if len(step.nodes) > 1 else ""),
              file=out)
        for name in step.nodes:
            print("   " + shlex.join(ssh.ssh_argv(cluster, cluster.node(name), list(step.args))), file=out)
    if p.wait_ready:
        print(f"{len(p.steps) + 1}. wait until the head is ready" + (f" in lane {p.lane}" if p.lane else "")
              + " and every node joined its run (metrics over HTTP)", file=out)


def execute(cluster: ClusterFile, action: str, lane: str | None = None, *, timeout: float = 1800.0,
            dry_run: bool = False, out=None, err=None, read: Reader | None = None) -> int:
    """Run ``action`` (:data:`plan.ACTIONS`) on ``cluster``; the exit status (see the module).

    Args:
        timeout: seconds to wait for the cluster to serve after the starts.
        dry_run: print the plan and the ssh commands; run nothing over SSH (the plan is made
            from the nodes' metrics, read over HTTP).
        read: the metrics reader (default :func:`sparkguard.cluster.view.read`).
    """
    out = out or sys.stdout
    err = err or sys.stderr
    read = read or view.read
    me = f"sparkguard cluster {action}" + (f" {lane}" if lane else "")
    phase = ["the preflight"]
    try:
        return _execute(cluster, action, lane, timeout, dry_run, out, err, read, me, phase)
    except KeyboardInterrupt:
        return interrupted(cluster, me, phase[0], read, err)


def interrupted(cluster: ClusterFile, me: str, phase: str, read: Reader, err) -> int:
    """After the operator's Ctrl-C: end every ssh this command started (:func:`ssh.kill_all`),
    read every node once and say in what state the cluster is left; no traceback.  Returns
    :data:`EXIT_INTERRUPTED`."""
    killed = ssh.kill_all()
    print(f"\n{me}: interrupted during {phase}" + (f"; {len(killed)} ssh command(s) ended (what they started "
          "on a node may still finish there)" if killed else ""), file=err, flush=True)
    try:
        sts = read(cluster, READ_TIMEOUT)
        word, detail = view.verdict(sts)
        print(f"{me}: the cluster is left as it is: {progress(sts, 0).split(': ', 1)[1]}", file=err)
        print(f"{me}: {cluster.name}: {word}: {untrusted.clean(detail, 2000)}", file=err)
    except KeyboardInterrupt:
        print(f"{me}: the cluster's state was not read; run 'sparkguard cluster status'", file=err)
    print(f"{me}: nothing more is done; run the command again, or 'sparkguard cluster stop'", file=err, flush=True)
    return EXIT_INTERRUPTED


def _execute(cluster: ClusterFile, action: str, lane: str | None, timeout: float, dry_run: bool, out, err,
             read: Reader, me: str, phase: list) -> int:
    """:func:`execute`'s body; ``phase[0]`` names what runs now (for an interruption)."""
    if dry_run:
        statuses = read(cluster, READ_TIMEOUT)
        down = [s for s in statuses if not s.up]
        for s in down:
            print(f"{me}: {s.node.name} does not answer ({s.error}); planned as if stopped", file=err)
        # a node whose metrics do not list its lanes is taken to have the cluster file's
        statuses = [s if s.lanes else NodeStatus(**{**s.__dict__, "lanes": cluster.lanes}) for s in statuses]
    else:
        statuses, failures = preflight(cluster)
        if failures:
            for f in failures:
                print(f"{me}: {f}", file=err)
            print(f"{me}: failed before anything was stopped", file=err)
            return EXIT_FAILED
        wrong = identity(cluster, statuses)
        if wrong:
            for w in wrong:
                print(f"{me}: refused: {w}", file=err)
            print(f"{me}: refused: nothing was stopped", file=err)
            return EXIT_REFUSED
    try:
        p = planner.plan(cluster, action, statuses, lane, STOP_TIMEOUT)
    except planner.Refused as e:
        print(f"{me}: refused: {e}", file=err)
        return EXIT_REFUSED
    if p.noop:
        print(f"{me}: nothing to do: {p.noop}", file=out)
        return EXIT_OK
    if dry_run:
        show_plan(cluster, p, out)
        return EXIT_OK
    t0 = time.monotonic()
    for step in p.steps:
        phase[0] = f"'{step.what}' on {', '.join(step.nodes)}"
        nodes = [cluster.node(n) for n in step.nodes]
        budget = STOP_TIMEOUT + 30 if step.what == "stop" else QUICK_TIMEOUT
        res = ssh.run_all(cluster, nodes, list(step.args), budget)
        bad = [r for r in res.values() if not r.ok]
        if bad:
            for r in bad:
                print(f"{me}: {step.what} failed on {ssh.describe(r)}", file=err)
            phase[0] = "the stop after a failure"
            return _fail(cluster, me, p, step, err)
        print(f"sparkguard cluster: {step.what}: {', '.join(step.nodes)} ({time.monotonic() - t0:.1f} s)",
              file=err, flush=True)
    if p.wait_ready:
        phase[0] = "the wait for the cluster to serve"
        why = wait_serving(cluster, p.lane, timeout, read, err, t0)
        if why:
            print(f"{me}: {why}", file=err)
            phase[0] = "the stop after a failure"
            return _fail(cluster, me, p, None, err)
    took = time.monotonic() - t0
    if p.wait_ready:
        print(f"{me}: serving" + (f" in lane {p.lane}" if p.lane else "")
              + f", every node joined the head's run; {took:.1f} s since the first stop", file=out)
    else:
        print(f"{me}: every node's engine stopped ({took:.1f} s)", file=out)
    return EXIT_OK


def _fail(cluster: ClusterFile, me: str, p: planner.Plan, step: planner.Step | None, err) -> int:
    """After a failure once something was stopped: stop every node again (no mixed lanes may
    serve); say what is left.  Returns :data:`EXIT_FAILED`."""
    if p.action == "stop" or (step is not None and step.what == "stop" and p.steps[0] is step):
        # the failure was in the stop itself: the nodes that stopped stay stopped
        print(f"{me}: the other nodes' engines are stopped; fix the node named above and run it again",
              file=err)
        return EXIT_FAILED
    print(f"{me}: stopping every node again so that no mix of lanes serves", file=err)
    res = ssh.run_all(cluster, list(cluster.nodes), list(planner.stop_args(STOP_TIMEOUT)), STOP_TIMEOUT + 30)
    bad = [r for r in res.values() if not r.ok]
    for r in bad:
        print(f"{me}: stop failed on {ssh.describe(r)}", file=err)
    if not bad:
        print(f"{me}: every node's engine is stopped", file=err)
    return EXIT_FAILED


# ---------------------------------------------------------------------------------------------
# command line

def _common(a: argparse.ArgumentParser) -> None:
    # suppressed defaults: a --cluster given to 'sparkguard cluster' itself is not reset here
    a.add_argument("--cluster", metavar="PATH", default=argparse.SUPPRESS,
                   help=f"the cluster file (default {DEFAULT_CLUSTER})")
    a.add_argument("--timeout", type=float, metavar="SECONDS", default=argparse.SUPPRESS,
                   help="how long to wait for the cluster to serve (default 1800)")
    a.add_argument("--dry-run", action="store_true", default=argparse.SUPPRESS,
                   help="print the plan and the ssh commands; run nothing")


def register_ops(csub: argparse._SubParsersAction) -> None:
    """Add ``lane NAME``, ``stop``, ``start``, ``restart`` to the ``sparkguard cluster`` parser's
    subparsers ``csub``; each sets ``func=handler`` and ``cluster_op``."""
    ln = csub.add_parser("lane", help="switch every node to a lane: all ranks down, workers first, head last, "
                                      "wait until serving in it")
    ln.add_argument("lane", metavar="NAME", help="one of the cluster's engine.lanes")
    _common(ln)
    ln.set_defaults(func=handler, cluster_op="lane")
    for name, what in (("stop", "stop every node's engine (in parallel) and wait until stopped"),
                       ("start", "start every node's engine, workers first, head last; wait until serving"),
                       ("restart", "stop every node, then start them, workers first, head last; "
                                   "wait until serving")):
        a = csub.add_parser(name, help=what)
        _common(a)
        a.set_defaults(func=handler, cluster_op=name)


def handler(args: argparse.Namespace) -> int:
    """``sparkguard cluster lane|stop|start|restart``: load the cluster file, :func:`execute`."""
    path = getattr(args, "cluster", None) or DEFAULT_CLUSTER
    try:
        cluster = cluster_file.load(path)
    except (ConfigError, OSError) as e:
        print(f"sparkguard cluster: {e}", file=sys.stderr)
        return EXIT_REFUSED
    return execute(cluster, args.cluster_op, getattr(args, "lane", None),
                   timeout=getattr(args, "timeout", None) or 1800.0, dry_run=getattr(args, "dry_run", False))


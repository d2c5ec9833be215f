"""``sparkguard cluster``: the whole TP cluster from one place, ``status`` and ``incidents`` here,
``lane``/``stop``/``start``/``restart`` from :mod:`sparkguard.cluster.ops` when it is installed.

``status`` reads every node's metrics endpoint over HTTP (:mod:`sparkguard.cluster.view`; no
SSH); ``incidents`` runs ``sparkguard incidents --json --limit N`` (or ``incidents ID --json``)
on every node over the operator's SSH (:mod:`sparkguard.cluster.ssh`) and merges them
(:mod:`sparkguard.cluster.timeline`).
Exit status: 0 serving / every node read; 1 otherwise; 2 the cluster file is unusable.
Usage: docs/cluster-status.md.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from typing import Any, TextIO

from sparkguard import untrusted
from sparkguard.cluster import file as cluster_file
from sparkguard.cluster import ssh, timeline, view
from sparkguard.cluster.model import ClusterFile, NodeStatus
from sparkguard.config import ConfigError
from sparkguard.units import format_size

DEFAULT_CLUSTER = "/etc/sparkguard/cluster.yaml"
#: seconds per node: a metrics read (status), one ssh with its remote command (incidents)
STATUS_TIMEOUT = 3.0
INCIDENTS_TIMEOUT = 30.0
#: bytes of one node's ``sparkguard incidents --json`` kept (a record is a few KiB to a few
#: hundred with its timeline; ssh's default cap, 256 KiB, cuts a long listing)
INCIDENTS_OUTPUT = 32 << 20


def add_common(p: argparse.ArgumentParser, timeout: float) -> None:
    """``--cluster PATH``, ``--json``, ``--timeout S`` on one ``sparkguard cluster`` action."""
    p.add_argument("--cluster", metavar="PATH", default=DEFAULT_CLUSTER,
                   help=f"the cluster file (default {DEFAULT_CLUSTER})")
    p.add_argument("--json", action="store_true", help="print JSON instead")
    p.add_argument("--timeout", type=float, default=timeout, metavar="S",
                   help=f"seconds per node (default {timeout:g})")


def register(subparsers: Any) -> None:
    """Add ``sparkguard cluster status|incidents`` (and the operations of
    :func:`sparkguard.cluster.ops.register_ops` when that module is importable)."""
    p = subparsers.add_parser(
        "cluster", help="the whole TP cluster: status, incidents, lanes",
        description="Read or drive every node of a TP cluster from one place. status reads each "
                    "node's metrics endpoint; the other actions use the operator's SSH.")
    csub = p.add_subparsers(dest="cluster_action", metavar="ACTION")
    s = csub.add_parser("status", help="one table of every node and the cluster's verdict",
                        description="Read every node's sparkguard metrics endpoint (HTTP, no SSH) and "
                                    "print one table and a verdict: serving, degraded, lane mismatch, "
                                    "given up or down. Exit 0 when serving, 1 otherwise, 2 for a bad "
                                    "cluster file.")
    add_common(s, STATUS_TIMEOUT)
    s.set_defaults(func=_status)
    i = csub.add_parser("incidents", help="every node's incidents as one timeline, or one report",
                        description="Run 'sparkguard incidents --json --limit N' on every node over SSH "
                                    "and list them newest first with a NODE column, or show one by id "
                                    "(ID, a unique prefix, or NODE:ID; 'sparkguard incidents ID --json' on "
                                    "each node). Exit 1 when a node cannot be read.")
    i.add_argument("id", nargs="?", metavar="ID", help="incident id, a unique prefix of one, or NODE:ID")
    i.add_argument("--limit", type=int, default=20, metavar="N", help="list at most N (default 20; 0 lists all)")
    add_common(i, INCIDENTS_TIMEOUT)
    i.set_defaults(func=_incidents)
    try:
        ops = importlib.import_module("sparkguard.cluster.ops")
    except ModuleNotFoundError as e:      # ops not installed; an import error inside it still shows
        if e.name != "sparkguard.cluster.ops":
            raise
    else:
        ops.register_ops(csub)
    p.set_defaults(func=lambda _a: (p.print_help(), 2)[1])


def _err(msg: str) -> None:
    print(f"sparkguard cluster: {msg}", file=sys.stderr)


def load(path: str) -> ClusterFile:
    """The cluster file at ``path`` (:func:`sparkguard.cluster.file.load`).

    Raises:
        sparkguard.config.ConfigError: unreadable or invalid (names file, key, value).
    """
    return cluster_file.load(path)


def _loaded(args: argparse.Namespace) -> ClusterFile | None:
    try:
        return load(args.cluster)
    except ConfigError as e:
        _err(str(e))
        return None


# --- status ---------------------------------------------------------------------------------

STATUS_HEADER = ("NODE", "ROLE/RANK", "SPARKGUARD", "ENGINE", "LANE", "READY", "RUN START", "MEMAVAILABLE",
                 "LAST INCIDENT")


def _local(t: float | None) -> str:
    """Local time of a node's unix seconds; ``-`` for None, ``?`` for no showable time."""
    return untrusted.stamp(t) if t is not None else "-"


def status_row(st: NodeStatus) -> tuple[str, ...]:
    """The table's columns for one node (the file's rank when the node does not say); what the
    node reported is another host's text: its control characters are replaced
    (:func:`sparkguard.untrusted.clean`), a memory size that is no whole number shows ``?``."""
    if not st.up:
        return (st.node.name, f"{st.node.role}/{st.node.rank}", "down", "-", "-", "-", "-", "-", "-")
    rank = st.node_rank if st.node_rank is not None else st.node.rank
    inc = f"{st.last_incident[0]} {st.last_incident[1]}" if st.last_incident else "-"
    mem = st.mem_available
    mem_s = "-" if mem is None else (format_size(mem) if isinstance(mem, int) and 0 <= mem < 1 << 70 else "?")
    cols = (st.node.name, f"{st.role or '-'}/{rank}", "up", st.state or "-", st.lane or "-",
            "yes" if st.ready else "no", _local(st.run_start), mem_s, inc)
    return tuple(untrusted.clean(c, 80) for c in cols)


def status_lines(cluster: ClusterFile, statuses: list[NodeStatus]) -> tuple[list[str], str]:
    """The table's lines (header, a row per node, then a line per node that could not be read or
    runs with another cluster's file) and the verdict's word."""
    rows = [STATUS_HEADER] + [status_row(s) for s in statuses]
    widths = [max(len(r[i]) for r in rows) for i in range(len(STATUS_HEADER))]
    lines = ["  ".join(c.ljust(widths[i]) for i, c in enumerate(r)).rstrip() for r in rows]
    for s in statuses:
        if not s.up:
            lines.append(f"{s.node.name}: not read at {s.node.metrics_url}: {untrusted.clean(s.error)}")
        elif s.cluster is not None and s.cluster != cluster.name:
            lines.append(f"{s.node.name}: runs with the cluster file of {untrusted.clean(repr(s.cluster))}, "
                         f"not {cluster.name!r}")
    word, detail = view.verdict(statuses)
    lines.append(f"{cluster.name}: {word}: {untrusted.clean(detail, 4000)}")
    return lines, word


def status_json(cluster: ClusterFile, statuses: list[NodeStatus]) -> dict:
    """``{"cluster", "verdict", "detail", "nodes": [...]}``, one dict per node."""
    word, detail = view.verdict(statuses)
    nodes = [{"node": s.node.name, "rank": s.node.rank, "url": s.node.metrics_url, "up": s.up, "error": s.error,
              "cluster": s.cluster, "role": s.role, "node_rank": s.node_rank, "state": s.state, "lane": s.lane,
              "lanes": list(s.lanes), "ready": s.ready, "run_start": s.run_start,
              "joined_run_start": s.joined_run_start, "mem_available": s.mem_available,
              "last_incident": list(s.last_incident) if s.last_incident else None, "given_up": s.given_up}
             for s in statuses]
    return {"cluster": cluster.name, "verdict": word, "detail": detail, "nodes": nodes}


def show_status(cluster: ClusterFile, as_json: bool, timeout: float, out: TextIO = sys.stdout) -> int:
    """Read every node, print the table and verdict (or JSON); 0 when serving, else 1."""
    statuses = view.read(cluster, timeout)
    if as_json:
        doc = status_json(cluster, statuses)
        out.write(json.dumps(doc, indent=2) + "\n")
        return 0 if doc["verdict"] == "serving" else 1
    lines, word = status_lines(cluster, statuses)
    out.write("\n".join(lines) + "\n")
    return 0 if word == "serving" else 1


def _status(args: argparse.Namespace) -> int:
    cluster = _loaded(args)
    if cluster is None:
        return 2
    return show_status(cluster, args.json, args.timeout)


# --- incidents ------------------------------------------------------------------------------

def _cut(r: ssh.RemoteResult) -> str | None:
    """The failure line of a node whose output was longer than :data:`INCIDENTS_OUTPUT`."""
    if r.truncated:
        return (f"{r.node}: its 'sparkguard incidents --json' printed more than {INCIDENTS_OUTPUT >> 20} MiB "
                "(cut); use --limit or an ID")
    return None


def gather_incidents(cluster: ClusterFile, timeout: float, limit: int = 0) -> tuple[list[timeline.Entry], list[str]]:
    """Every node's newest ``limit`` incidents (0: all) over SSH (``sparkguard incidents --json
    --limit N`` on each: the newest N of the cluster are among them), merged
    (:func:`timeline.merge`), and one line per node that could not be read (``"gx2: unreachable
    over SSH: ..."``)."""
    results = ssh.run_all(cluster, cluster.nodes, ["incidents", "--json", "--limit", str(limit)], timeout,
                          INCIDENTS_OUTPUT)
    per_node, failed = [], []
    for n in cluster.nodes:
        r = results[n.name]
        if not r.ok or r.truncated:
            failed.append(_cut(r) or ssh.describe(r))
            continue
        try:
            per_node.append((n, timeline.parse_listing(r.stdout)))
        except Exception as e:  # noqa: BLE001 - another host's output: that node's failure, named
            failed.append(f"{n.name}: its 'sparkguard incidents --json' printed no incident list "
                          f"({untrusted.clean(e, 200)})")
    return timeline.merge(per_node), failed


def gather_one(cluster: ClusterFile, wanted: str, timeout: float) -> tuple[list[timeline.Entry], list[str], list[str]]:
    """The incident ``wanted`` (an id or a unique prefix; ``NODE:ID`` asks that node only):
    ``sparkguard incidents ID --json`` on each node asked.

    Returns:
        ``(found, ambiguous, failed)``: the entries found (one per node that has it), one line per
        node where the prefix matches several (that node's own message), one line per node that
        could not be read.  A node that answers "no incident" (exit 1) has none.
    """
    node, sep, iid = wanted.partition(":")
    nodes = [n for n in cluster.nodes if n.name == node] if sep else list(cluster.nodes)
    if sep and not nodes:
        return [], [], [f"{node}: no such node in {cluster.path} (its nodes: {', '.join(n.name for n in cluster.nodes)})"]
    key = iid if sep else wanted
    results = ssh.run_all(cluster, nodes, ["incidents", key, "--json"], timeout, INCIDENTS_OUTPUT)
    found, ambiguous, failed = [], [], []
    for n in nodes:
        r = results[n.name]
        if r.rc == 1 and not r.ssh_error and "no incident " in r.stderr:
            continue
        if r.rc == 1 and not r.ssh_error and " matches " in r.stderr:
            ambiguous.append(f"{n.name}: " + untrusted.clean(r.error.split(": ", 1)[-1], 400))
            continue
        if not r.ok or r.truncated:
            failed.append(_cut(r) or ssh.describe(r))
            continue
        try:
            rec = untrusted.loads(r.stdout)
            if not isinstance(rec, dict) or not timeline.valid_id(rec.get("id")):
                raise ValueError("expected one incident record with an id")
            found.append(timeline.Entry(n, rec))
        except Exception as e:  # noqa: BLE001 - another host's output: that node's failure, named
            failed.append(f"{n.name}: its 'sparkguard incidents {key} --json' printed no incident "
                          f"({untrusted.clean(e, 200)})")
    return found, ambiguous, failed


def show_incidents(cluster: ClusterFile, wanted: str | None, limit: int, as_json: bool, timeout: float,
                   out: TextIO = sys.stdout) -> int:
    """List the newest ``limit`` of the timeline (0: all), or show the incident ``wanted``; 0
    when every node was read and the incident found, 1 otherwise."""
    if wanted is not None:
        found, ambiguous, failed = gather_one(cluster, wanted, timeout)
        rc = 1 if failed else 0
        exact = [e for e in found if e.id == wanted.partition(":")[2] or e.id == wanted]
        found = exact or found
        if len(found) == 1 and not ambiguous:
            e = found[0]
            out.write(json.dumps({"node": e.node.name, **e.record}, indent=2, default=str) + "\n" if as_json
                      else timeline.report(e))
        elif not found and not ambiguous:
            _err(f"no incident {wanted!r} on the nodes read")
            rc = 1
        else:
            _err(f"{wanted!r} matches more than one incident: " +
                 "; ".join([f"{e.node.name}:{e.id}" for e in found[:10]] + ambiguous))
            rc = 1
        for line in failed:
            (sys.stderr if as_json else out).write(f"not read: {line}\n")
        return rc
    entries, failed = gather_incidents(cluster, timeout, limit)
    rc = 1 if failed else 0
    if as_json:
        out.write(json.dumps(timeline.as_json(entries[:limit] if limit else entries), indent=2, default=str) + "\n")
    elif entries:
        out.write("\n".join(timeline.table(entries, limit)) + "\n")
    else:
        out.write("No incidents recorded on the nodes read.\n")
    for line in failed:
        (sys.stderr if as_json else out).write(f"not read: {line}\n")
    return rc


def _incidents(args: argparse.Namespace) -> int:
    if args.limit < 0:
        _err(f"--limit: {args.limit}: must be 0 (all) or more")
        return 2
    cluster = _loaded(args)
    if cluster is None:
        return 2
    return show_incidents(cluster, args.id, args.limit, args.json, args.timeout)

"""Every node's incidents as one timeline: merge, order, find one by id, format.  Pure (no I/O).

Input is what each node's ``sparkguard incidents --json --limit 0`` prints (a JSON list of
incident records, docs/incident.md), parsed per node; output is ``(node, record)`` pairs and
the table ``sparkguard cluster incidents`` prints.  The columns after NODE are those of
``sparkguard incidents`` (:func:`sparkguard.incidents.render.list_line`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

from sparkguard import untrusted
from sparkguard.cluster.model import ClusterNode
from sparkguard.incidents.render import list_line, render
from sparkguard.incidents.store import valid_id  # noqa: F401 - also the cluster CLI's check of one record
from sparkguard.model import number

HEADER = ("NODE", "ID", "STARTED", "KIND", "OUTCOME", "TARGET", "MIN AVAIL", "DURATION")


@dataclass(frozen=True)
class Entry:
    """One incident of the timeline.

    Attributes:
        node: :class:`ClusterNode`, where it happened.
        record: dict, the incident record as that node stored it.
    """

    node: ClusterNode
    record: dict

    @property
    def id(self) -> str:
        return str(self.record.get("id", ""))


def parse_listing(text: str) -> list[dict]:
    """The records of one node's ``sparkguard incidents --json`` output; a record without a valid
    id is dropped.

    Raises:
        ValueError: the text is not a JSON list (the message says what it is), or JSON nested
            too deeply (:func:`sparkguard.untrusted.loads`).
    """
    data = untrusted.loads(text)
    if not isinstance(data, list):
        raise ValueError(f"expected a JSON list of incidents, got {type(data).__name__}")
    return [r for r in data if isinstance(r, dict) and valid_id(r.get("id"))]


def merge(per_node: Iterable[tuple[ClusterNode, Iterable[dict]]]) -> list[Entry]:
    """One timeline of every node's records: newest first by ``started_at`` (unix seconds; a
    record without one sorts last), ties by node rank, then by id.  The same id on two nodes
    stays two entries (each node names its own incidents)."""
    out = [Entry(n, r) for n, recs in per_node for r in recs]
    out.sort(key=lambda e: (-_started(e), e.node.rank, e.id))
    return out


def _started(e: Entry) -> float:
    """The entry's ``started_at``; -inf when absent or not a finite number (it sorts last)."""
    t = number(e.record.get("started_at"))
    return t if t is not None and math.isfinite(t) else -math.inf


def find(entries: list[Entry], wanted: str) -> list[Entry]:
    """The entries whose id is ``wanted``, else those whose id starts with it (what
    ``sparkguard incidents ID`` accepts); ``node:ID`` picks on that node only."""
    node, sep, iid = wanted.partition(":")
    pool = [e for e in entries if e.node.name == node] if sep else entries
    key = iid if sep else wanted
    return [e for e in pool if e.id == key] or [e for e in pool if e.id.startswith(key)]


def table(entries: list[Entry], limit: int = 0) -> list[str]:
    """The timeline's lines: a header and one row per entry (the first ``limit``; 0: all), columns
    aligned; a last line says how many are not shown."""
    shown = entries[:limit] if limit else entries
    rows = [HEADER] + [(e.node.name, *row(e)) for e in shown]
    widths = [max(len(r[i]) for r in rows) for i in range(len(HEADER))]
    lines = ["  ".join(c.ljust(widths[i]) for i, c in enumerate(r)).rstrip() for r in rows]
    if len(entries) > len(shown):
        lines.append(f"({len(entries) - len(shown)} older not shown; --limit 0 lists all)")
    return lines


def row(e: Entry) -> tuple[str, ...]:
    """The columns after NODE of one entry (:func:`list_line`), each printable
    (:func:`sparkguard.untrusted.clean`); a record list_line cannot format (it is another host's)
    shows its id and ``?`` in the others."""
    try:
        cols = list_line(e.record)
    except Exception:  # noqa: BLE001 - a remote record of any shape is shown, never a crash
        cols = (e.id,) + ("?",) * (len(HEADER) - 2)
    if e.record.get("started_at") is not None and untrusted.stamp(e.record.get("started_at")) == "?":
        cols = (cols[0], "?", *cols[2:])
    return tuple(untrusted.clean(c, 80) for c in cols)


def report(entry: Entry) -> str:
    """One incident's readable report (:func:`sparkguard.incidents.render.render`), under a line
    naming the node it happened on; control characters of the remote record replaced (line
    breaks kept); a record the renderer cannot format is said to be so."""
    try:
        body = render(entry.record)
    except Exception as e:  # noqa: BLE001 - another host's record
        body = f"this record cannot be shown ({untrusted.clean(repr(e), 200)}); --json prints it\n"
    body = "\n".join(untrusted.clean(ln, 10_000) for ln in body.split("\n"))
    return f"Node: {entry.node.name} (rank {entry.node.rank}, {entry.node.ssh})\n" + body


def as_json(entries: list[Entry]) -> list[dict]:
    """JSON-ready records, each with a ``node`` key added (the node's name)."""
    return [{"node": e.node.name, **e.record} for e in entries]

"""The incident record: typed parts, the one builder (:func:`new_incident`) and its views.

Every incident (kind ``memory`` from the guard's poll loop, ``pause`` from its soft line,
``wedged`` from the engine supervisor, ``link`` from the TP link watch, ``unclean-shutdown`` from
the black box at start (:mod:`sparkguard.blackbox`); ``sparkguard drill`` marks its memory
incident ``drill``) is an :class:`Incident` built by :func:`new_incident`.  Its views:

* :meth:`Incident.to_json`: the incident file (``<incidents.dir>/<id>.json``), the journal's
  ``SPARKGUARD_REPORT`` and ``sparkguard incidents --json``; key order is part of the format.
* :meth:`Incident.ref`: the few facts an event's journal entry and the supervisor's hook read.
* :func:`event_entry` / :func:`report_entry`: the journal entries of an event and of the
  report (fields: :mod:`sparkguard.reporter`; MESSAGE_IDs: :mod:`sparkguard.journal`).

The schema (every field, type, unit, meaning) and who owns a record when are in
``docs/incident.md``; ``tests/test_model.py`` checks it against what the daemon writes.
Stored records (the store, the journal, ``sparkguard incidents``) are read as the JSON dicts
they are: the facts at the end of this module and :mod:`sparkguard.incidents.render` take any
record, old files included, a missing field showing as unknown.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from typing import Any

from sparkguard import journal, meminfo, sysinfo
from sparkguard.units import format_size


@dataclass
class Thresholds:
    """The guard's lines when the incident opened (``guard:`` config).

    ``term_below_bytes``: int bytes; ``kill_below_bytes``: int bytes or None (off);
    ``grace_seconds``: float s; ``signal``: ``"available"`` or ``"available+swap"``.
    """

    term_below_bytes: int
    kill_below_bytes: int | None
    grace_seconds: float
    signal: str

    @classmethod
    def of(cls, g) -> "Thresholds":
        """From ``config.GuardConfig`` ``g``."""
        return cls(g.term_below, g.kill_below, g.grace, g.signal)

    def to_json(self) -> dict:
        return {"term_below_bytes": self.term_below_bytes, "kill_below_bytes": self.kill_below_bytes,
                "grace_seconds": self.grace_seconds, "signal": self.signal}


@dataclass
class LinkThresholds:
    """A link incident's threshold: ``down_after_seconds`` (float s, ``link.down_after``)."""

    down_after_seconds: float

    def to_json(self) -> dict:
        return {"down_after_seconds": self.down_after_seconds}


@dataclass
class PauseThresholds:
    """A pause incident's lines (the soft line, docs/soft-line.md): ``pause_below_bytes`` (int,
    ``guard.pause_below``), ``resume_above_bytes`` (int, plus ``guard.pause_hysteresis``),
    ``resume_after_seconds`` (float, ``guard.resume_after``), ``term_below_bytes`` (int, the hard
    line), ``mode`` (str, ``guard.pause_mode``), ``signal`` (str, ``guard.signal``)."""

    pause_below_bytes: int
    resume_above_bytes: int
    resume_after_seconds: float
    term_below_bytes: int
    mode: str
    signal: str

    @classmethod
    def of(cls, g) -> "PauseThresholds":
        """From ``config.GuardConfig`` ``g`` with ``pause_below`` set."""
        return cls(g.pause_below, g.pause_below + g.pause_hysteresis, g.resume_after, g.term_below,
                   g.pause_mode, g.signal)

    def to_json(self) -> dict:
        return {"pause_below_bytes": self.pause_below_bytes, "resume_above_bytes": self.resume_above_bytes,
                "resume_after_seconds": self.resume_after_seconds, "term_below_bytes": self.term_below_bytes,
                "mode": self.mode, "signal": self.signal}


@dataclass
class TreeRow:
    """One process of a target tree or of ``top_consumers`` (read by :mod:`sparkguard.enginetree`).

    ``pid``/``ppid``: int; ``title``: str (short command line); ``comm``: str
    (/proc/PID/comm); ``cmdline``: str (at most 400 characters); ``rss_bytes``/``swap_bytes``:
    int bytes (VmRSS, VmSwap of /proc/PID/status); ``oom_score``: int (-1 unreadable);
    ``gpu_bytes``: int bytes NVML reports for the process (:mod:`sparkguard.gpumem`), None (and
    absent from the JSON) when NVML is not read.
    """

    pid: int
    ppid: int
    title: str
    comm: str
    cmdline: str
    rss_bytes: int
    swap_bytes: int
    oom_score: int
    gpu_bytes: int | None = None

    @classmethod
    def of(cls, row: dict) -> "TreeRow":
        """From a row dict of :func:`sparkguard.enginetree.add_details` / ``top_consumers``."""
        return cls(row["pid"], row["ppid"], row["title"], row["comm"], row["cmdline"], row["rss_bytes"],
                   row["swap_bytes"], row["oom_score"], row.get("gpu_bytes"))

    def to_json(self) -> dict:
        out = {"pid": self.pid, "ppid": self.ppid, "title": self.title, "comm": self.comm,
               "cmdline": self.cmdline, "rss_bytes": self.rss_bytes, "swap_bytes": self.swap_bytes,
               "oom_score": self.oom_score}
        if self.gpu_bytes is not None:
            out["gpu_bytes"] = self.gpu_bytes
        return out


@dataclass
class Target:
    """The tree signalled: ``root_pid`` int, ``title`` str, ``pattern`` str (the ``targets.match``
    regex that chose it, or the fallback's name), ``mem_bytes`` int (RSS + swap of the tree),
    ``tree`` (:class:`TreeRow` per member, read after the signal)."""

    root_pid: int
    title: str
    pattern: str
    mem_bytes: int
    tree: list[TreeRow]

    @classmethod
    def of(cls, t) -> "Target":
        """From an ``enginetree.Target`` whose rows were read."""
        return cls(t.root_pid, t.title, t.pattern, t.mem_bytes, [TreeRow.of(r) for r in t.tree])

    def to_json(self) -> dict:
        return {"root_pid": self.root_pid, "title": self.title, "pattern": self.pattern,
                "mem_bytes": self.mem_bytes, "tree": [r.to_json() for r in self.tree]}


@dataclass
class Event:
    """One timeline entry.

    ``event``: str (``crossed``, ``sigterm``, ``sigkill``, ``exited``, ``recovered``, ...: see
    docs/incident.md); ``t``: float s since the incident started (the crossing); ``at``: float
    unix s; ``available_bytes``: int bytes (the guard's signal for memory incidents,
    MemAvailable for the others; unreadable: -1 in link events, 0 in the supervisor's); ``pids``: list of
    int; ``detail``: str for people.
    """

    event: str
    t: float
    at: float
    available_bytes: int
    pids: list[int]
    detail: str

    def to_json(self) -> dict:
        return {"event": self.event, "t": self.t, "at": self.at, "available_bytes": self.available_bytes,
                "pids": list(self.pids), "detail": self.detail}


@dataclass
class Link:
    """A link incident's interface: ``interface`` str, ``netns`` str or None, ``operstate`` str or
    None, ``carrier`` bool, ``present`` bool, ``down_after_seconds`` float s."""

    interface: str
    netns: str | None
    operstate: str | None
    carrier: bool
    present: bool
    down_after_seconds: float

    def to_json(self) -> dict:
        return {"interface": self.interface, "netns": self.netns, "operstate": self.operstate,
                "carrier": self.carrier, "present": self.present, "down_after_seconds": self.down_after_seconds}


@dataclass
class Incident:
    """One incident.  Built by :func:`new_incident`; fields as in docs/incident.md.

    ``meminfo_raw`` holds the /proc/meminfo text read at the crossing until
    :meth:`parse_meminfo` turns it into ``meminfo`` (once, after the signal: act first, report
    after).  ``engine`` is the supervisor's part (a dict of its own schema, docs/incident.md).
    """

    id: str
    kind: str
    host: str
    boot_id: str
    started_at: float
    thresholds: Thresholds | LinkThresholds | PauseThresholds
    meminfo: dict[str, int]
    drill: bool = False
    ended_at: float | None = None
    dry_run: bool = False
    psi_memory: dict | None = None
    zram: list[dict] = field(default_factory=list)
    target: Target | None = None
    timeline: list[Event] = field(default_factory=list)
    outcome: str | None = None
    summary: str = ""
    top_consumers: list[TreeRow] | None = None
    min_available_bytes: int | None = None
    link: Link | None = None
    engine: dict | None = None
    blackbox: dict | None = None
    meminfo_raw: bytes | None = None
    trigger: dict | None = None
    pause: dict | None = None

    def parse_meminfo(self) -> None:
        """Parse :attr:`meminfo_raw` into :attr:`meminfo` (no-op once done)."""
        if self.meminfo_raw is not None:
            self.meminfo = meminfo.parse(self.meminfo_raw)
            self.meminfo_raw = None

    def events(self) -> list[str]:
        """The timeline's event names, in order."""
        return [e.event for e in self.timeline]

    def ref(self) -> dict:
        """What an event's journal entry and the supervisor's event hook read of the incident:
        ``{"id", "kind", "dry_run", "drill", "target": {"root_pid", "title"} or None}`` (a new dict)."""
        t = self.target
        return {"id": self.id, "kind": self.kind, "dry_run": self.dry_run, "drill": self.drill,
                "target": {"root_pid": t.root_pid, "title": t.title} if t is not None else None}

    def to_json(self) -> dict:
        """The record as written (a new dict, nothing shared with the Incident but ``engine``'s
        and ``psi_memory``'s and ``zram``'s values): key order id, kind, drill, host, boot_id,
        started_at, ended_at, dry_run, thresholds, meminfo, psi_memory, zram, target, timeline,
        outcome, summary, then where set top_consumers, min_available_bytes, link, engine, trigger, blackbox,
        pause.
        Parses :attr:`meminfo_raw` first if nobody has (:meth:`parse_meminfo`)."""
        self.parse_meminfo()
        out = {
            "id": self.id, "kind": self.kind, "drill": self.drill, "host": self.host, "boot_id": self.boot_id,
            "started_at": self.started_at, "ended_at": self.ended_at, "dry_run": self.dry_run,
            "thresholds": self.thresholds.to_json(), "meminfo": dict(self.meminfo),
            "psi_memory": self.psi_memory, "zram": list(self.zram),
            "target": self.target.to_json() if self.target is not None else None,
            "timeline": [e.to_json() for e in self.timeline], "outcome": self.outcome, "summary": self.summary,
        }
        if self.top_consumers is not None:
            out["top_consumers"] = [r.to_json() for r in self.top_consumers]
        if self.min_available_bytes is not None:
            out["min_available_bytes"] = self.min_available_bytes
        if self.link is not None:
            out["link"] = self.link.to_json()
        if self.engine is not None:
            out["engine"] = self.engine
        if self.trigger is not None:
            out["trigger"] = dict(self.trigger)
        if self.blackbox is not None:
            out["blackbox"] = self.blackbox
        if self.pause is not None:
            out["pause"] = dict(self.pause)
        return out


def new_id(started_at: float) -> str:
    """A fresh incident id: ``YYYYmmddTHHMMSSZ-xxxxxx`` (UTC start, 6 random hex digits).

    Args:
        started_at: unix time of the incident's start, seconds.
    """
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(started_at)) + "-" + os.urandom(3).hex()


def new_incident(kind: str, started_at: float, thresholds: Thresholds | LinkThresholds | PauseThresholds,
                 meminfo: bytes | dict[str, int], *, host: str | None = None, boot_id: str | None = None,
                 dry_run: bool = False, psi_memory: dict | None = None, zram: list[dict] | None = None,
                 target: Target | None = None, summary: str = "", outcome: str | None = None,
                 engine: dict | None = None, link: Link | None = None) -> Incident:
    """The one builder of incidents, with a fresh id (:func:`new_id`).

    Args:
        kind: ``"memory"``, ``"wedged"``, ``"link"``, ``"pause"`` (the soft line,
            :mod:`sparkguard.guard.soft`), ``"unclean-shutdown"`` (and the supervisor's, docs/incident.md).
        started_at: unix s (names the id).
        thresholds: the lines that applied.
        meminfo: the raw /proc/meminfo text (bytes, parsed later by :meth:`Incident.parse_meminfo`)
            or the parsed ``{field: bytes}``.
        host, boot_id: this host's name and boot id; None reads them now (:mod:`sparkguard.sysinfo`);
            the guard passes the ones read at start, so the crossing costs no reads.
    """
    raw = meminfo if isinstance(meminfo, bytes) else None
    return Incident(id=new_id(started_at), kind=kind, host=sysinfo.hostname() if host is None else host,
                    boot_id=sysinfo.boot_id() if boot_id is None else boot_id,
                    started_at=started_at, thresholds=thresholds, meminfo={} if raw is not None else meminfo,
                    meminfo_raw=raw, dry_run=dry_run, psi_memory=psi_memory, zram=list(zram or []),
                    target=target, summary=summary, outcome=outcome, engine=engine, link=link)


# --- facts of a stored record (a dict: the JSON of this or an older version) ------------


def number(v: Any) -> float | None:
    """``v`` when it is an int or float (not a bool), else None: a stored record may hold anything."""
    return v if isinstance(v, int | float) and not isinstance(v, bool) else None


def available_at_crossing(rec: dict) -> int | None:
    """MemAvailable in bytes at the crossing: ``meminfo.MemAvailable``, else the crossed event's value."""
    mi = rec.get("meminfo") or {}
    v = number(mi.get("MemAvailable")) if isinstance(mi, dict) else None
    if v is not None:
        return int(v)
    for ev in rec.get("timeline") or []:
        if isinstance(ev, dict) and ev.get("event") == "crossed" and number(ev.get("available_bytes")) is not None:
            return int(ev["available_bytes"])
    return None


def min_available(rec: dict) -> int | None:
    """Lowest available bytes seen during the incident (``min_available_bytes`` if the record
    has it, else the minimum over the timeline and the crossing snapshot); None if unknown."""
    v = number(rec.get("min_available_bytes"))
    if v is not None:
        return int(v)
    vals = [ev.get("available_bytes") for ev in rec.get("timeline") or [] if isinstance(ev, dict)]
    vals.append(available_at_crossing(rec))
    vals = [int(x) for x in vals if number(x) is not None]
    return min(vals) if vals else None


def duration(rec: dict) -> float | None:
    """Seconds from start to end, None while open or unknown."""
    a, b = number(rec.get("started_at")), number(rec.get("ended_at"))
    return b - a if a is not None and b is not None else None


def target_label(rec: dict, width: int = 40) -> str:
    """``"title (pid N)"`` of the target, ``"-"`` without one."""
    t = rec.get("target")
    if not isinstance(t, dict):
        return "-"
    title = str(t.get("title") or "?")
    if len(title) > width:
        title = title[:width - 1] + "…"
    return f"{title} (pid {t.get('root_pid', '?')})"


def summary(rec: dict) -> str:
    """One line for people: the record's own ``summary``, else one built from its facts."""
    s = rec.get("summary")
    if isinstance(s, str) and s:
        return s
    return (f"{rec.get('kind', 'memory')} incident {rec.get('id', '?')}: {rec.get('outcome', '?')}, "
            f"target {target_label(rec)}, MemAvailable down to {format_size(min_available(rec))}")


# --- the journal views (fields: sparkguard.reporter's docstring, MESSAGE_IDs: sparkguard.journal) ---

#: an event's own keys; any other scalar key of an event becomes a ``SPARKGUARD_<KEY>`` field
EVENT_KEYS = ("event", "t", "at", "available_bytes", "pids", "detail")


def event_entry(ref: dict, ev: dict) -> tuple[int, str, dict[str, Any]]:
    """The journal entry of one event: ``(PRIORITY, MESSAGE, fields)``.

    Args:
        ref: the incident's :meth:`Incident.ref` (``{}`` for an event outside an incident).
        ev: the event's JSON (:meth:`Event.to_json`, or a dict with its keys and maybe more).
    """
    name = str(ev.get("event") or "event")
    prio = journal.priority(name)
    avail = ev.get("available_bytes")
    detail = str(ev.get("detail") or "")
    iid = ref.get("id")
    tgt = ref.get("target") if isinstance(ref.get("target"), dict) else {}
    ctx = [f"available {format_size(avail)}"] if isinstance(avail, int | float) else []
    if iid:
        ctx.append(f"incident {iid}")
    msg = f"{name}: {detail}" if detail else name
    if ctx:
        msg += " (" + "; ".join(ctx) + ")"
    msg = msg.replace("\n", " ")
    fields: dict[str, Any] = {
        "MESSAGE": msg, "MESSAGE_ID": journal.message_id(name), "PRIORITY": prio,
        "SPARKGUARD_INCIDENT": iid, "SPARKGUARD_EVENT": name, "SPARKGUARD_KIND": ref.get("kind"),
        "SPARKGUARD_PIDS": journal.flatten_pids(ev.get("pids")),
        "SPARKGUARD_AVAILABLE_BYTES": avail, "SPARKGUARD_T_SECONDS": ev.get("t"),
        "SPARKGUARD_DETAIL": detail or None,
        "SPARKGUARD_DRY_RUN": ref.get("dry_run"), "SPARKGUARD_DRILL": ref.get("drill"),
        "SPARKGUARD_TARGET_PID": tgt.get("root_pid"), "SPARKGUARD_TARGET_TITLE": tgt.get("title"),
    }
    for k, v in ev.items():
        name_k = "SPARKGUARD_" + str(k).upper()
        if k not in EVENT_KEYS and name_k not in fields and journal.valid_field_name(name_k) \
                and isinstance(v, str | int | float | bool):
            fields[name_k] = v
    return prio, msg, fields


def report_entry(rec: dict, path: str | None) -> tuple[int, str, dict[str, Any]]:
    """The journal entry of a report: ``(PRIORITY, MESSAGE, fields)``; ``SPARKGUARD_REPORT`` is
    ``rec`` as compact JSON.

    Args:
        rec: the record (:meth:`Incident.to_json`, or a stored one).
        path: where the file was saved, None when it was not.
    """
    iid = rec.get("id")
    th = rec.get("thresholds") if isinstance(rec.get("thresholds"), dict) else {}
    tgt = rec.get("target") if isinstance(rec.get("target"), dict) else {}
    outcome = rec.get("outcome")
    prio = journal.report_priority(outcome)
    msg = f"incident {iid}: {outcome}: {summary(rec).replace(chr(10), ' ')}"
    tree_pids = [e.get("pid") for e in tgt.get("tree") or [] if isinstance(e, dict)
                 and isinstance(e.get("pid"), int)]
    fields: dict[str, Any] = {
        "MESSAGE": msg, "MESSAGE_ID": journal.MESSAGE_IDS["report"], "PRIORITY": prio,
        "SPARKGUARD_INCIDENT": iid, "SPARKGUARD_EVENT": "report", "SPARKGUARD_KIND": rec.get("kind"),
        "SPARKGUARD_OUTCOME": outcome, "SPARKGUARD_DRY_RUN": rec.get("dry_run"),
        "SPARKGUARD_DRILL": rec.get("drill"),
        "SPARKGUARD_TARGET_PID": tgt.get("root_pid"), "SPARKGUARD_TARGET_TITLE": tgt.get("title"),
        "SPARKGUARD_TARGET_MEM_BYTES": tgt.get("mem_bytes"),
        "SPARKGUARD_PIDS": journal.flatten_pids(tree_pids) or None,
        "SPARKGUARD_TERM_BELOW_BYTES": th.get("term_below_bytes"),
        "SPARKGUARD_KILL_BELOW_BYTES": th.get("kill_below_bytes"),
        "SPARKGUARD_GRACE_SECONDS": th.get("grace_seconds"), "SPARKGUARD_SIGNAL": th.get("signal"),
        "SPARKGUARD_AVAILABLE_BYTES": available_at_crossing(rec),
        "SPARKGUARD_MIN_AVAILABLE_BYTES": min_available(rec),
        "SPARKGUARD_DURATION_SECONDS": duration(rec),
        "SPARKGUARD_STARTED_AT": rec.get("started_at"), "SPARKGUARD_ENDED_AT": rec.get("ended_at"),
        "SPARKGUARD_FILE": path,
        "SPARKGUARD_REPORT": json.dumps(rec, separators=(",", ":"), default=str),
    }
    return prio, msg, fields

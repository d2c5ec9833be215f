"""Incident store (one JSON file per incident), the readable report, and ``sparkguard incidents``.

An incident record is the dict described in TEAM.md "Incident record" (id, kind, host,
boot_id, started_at/ended_at unix seconds, thresholds, meminfo at the crossing in bytes,
psi_memory, zram, target with its process tree, timeline, outcome, summary).

Files live in ``incidents.dir`` (default ``/var/lib/sparkguard/incidents``) as ``<id>.json``,
written atomically: temp file in the same directory, fsync, rename over the final name,
fsync of the directory (``man:rename(2)``: rename is atomic within one file system; the
directory fsync makes the new name itself durable, ``man:fsync(2)``).  Mode 0640, the
directory 0750 when created here.  A full disk or read-only directory is logged and
survived: the journal still carries the report (see :mod:`sparkguard.reporter`).

``sparkguard incidents`` reads this store and, where journald runs, the journal's report
entries (``MESSAGE_ID`` = :data:`sparkguard.journal.MESSAGE_IDS` ``["report"]``), merged by id,
so an incident whose file could not be written still shows.

Only stdlib at import time: this module registers a CLI command (see :mod:`sparkguard.cli`).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
import time
from typing import Any, Iterable

log = logging.getLogger("sparkguard.incidents")

FILE_MODE = 0o640
DIR_MODE = 0o750
#: ids become file names: refuse anything that could leave the directory
_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}\Z")
DEFAULT_LIMIT = 20


class AmbiguousId(ValueError):
    """An id prefix matches several incidents.  ``matches``: list[str] of the full ids."""

    def __init__(self, prefix: str, matches: list[str]):
        self.prefix, self.matches = prefix, matches
        super().__init__(f"{prefix!r} matches {len(matches)} incidents: " + ", ".join(matches[:10]))


def new_id(started_at: float) -> str:
    """A fresh incident id: ``YYYYmmddTHHMMSSZ-xxxxxx`` (UTC start, 6 random hex digits).

    Args:
        started_at: unix time of the incident's start, seconds.
    """
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(started_at)) + "-" + os.urandom(3).hex()


def valid_id(incident_id: Any) -> bool:
    """True if ``incident_id`` can be used as a file name (``YYYYmmddTHHMMSSZ-xxxxxx`` and the like)."""
    return isinstance(incident_id, str) and bool(_ID_RE.match(incident_id))


class IncidentStore:
    """One JSON file per incident in a directory.

    Args:
        directory: str, the store (``incidents.dir``); created 0750 on first save.
    Nothing here raises on I/O errors: failures are logged (logger ``sparkguard.incidents``)
    and reported by the return value, because the guard must outlive a full disk.
    """

    def __init__(self, directory: str):
        self.dir = directory
        #: str, why the last :meth:`save` failed ("" after a success)
        self.last_error = ""

    def path_for(self, incident_id: str) -> str:
        """Path of the file for ``incident_id`` (str)."""
        return os.path.join(self.dir, incident_id + ".json")

    def save(self, incident: dict, log_errors: bool = True) -> str | None:
        """Write ``incident`` atomically as ``<dir>/<id>.json`` (mode 0640).

        Args:
            incident: the record; its ``id`` names the file.
            log_errors: log a failure at ERROR (the caller may prefer to log it itself).
        Returns:
            str path written, or None when it could not be (invalid id, ENOSPC, EROFS,
            EACCES, ENOTDIR...); :attr:`last_error` says why.  No temp file is left behind.
        """
        iid = incident.get("id") if isinstance(incident, dict) else None
        self.last_error = ""
        if not valid_id(iid):
            return self._fail(f"invalid incident id {iid!r}", iid, log_errors)
        try:
            data = json.dumps(incident, indent=1, default=str).encode() + b"\n"
        except (TypeError, ValueError) as e:
            return self._fail(f"not serialisable: {e}", iid, log_errors)
        final = self.path_for(iid)
        tmp = None
        try:
            self._make_dir()
            name = os.path.join(self.dir, f".{iid}.{os.getpid()}.{os.urandom(4).hex()}.tmp")
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, FILE_MODE)
            tmp = name
            try:
                os.fchmod(fd, FILE_MODE)
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, final)
            tmp = None
            self._fsync_dir()
            return final
        except OSError as e:
            return self._fail(f"{e.strerror or e} ({e.filename or self.dir})", iid, log_errors)
        finally:
            if tmp is not None:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass

    def _fail(self, why: str, iid: Any, log_errors: bool) -> None:
        self.last_error = why
        if log_errors:
            log.error("incident %s not saved in %s: %s", iid, self.dir, why)
        return None

    def _make_dir(self) -> None:
        if os.path.isdir(self.dir):
            return
        try:
            os.mkdir(self.dir, DIR_MODE)
        except FileNotFoundError:
            os.makedirs(os.path.dirname(os.path.abspath(self.dir)), exist_ok=True)
            os.mkdir(self.dir, DIR_MODE)
        except FileExistsError:
            if not os.path.isdir(self.dir):
                raise NotADirectoryError(20, "Not a directory", self.dir) from None
            return
        os.chmod(self.dir, DIR_MODE)  # mkdir's mode is filtered by the umask

    def _fsync_dir(self) -> None:
        fd = os.open(self.dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def ids(self) -> list[str]:
        """Ids of the stored incidents (unsorted); [] when the directory is missing or unreadable."""
        try:
            names = os.listdir(self.dir)
        except FileNotFoundError:
            return []
        except OSError as e:
            log.warning("cannot read incident directory %s: %s", self.dir, e.strerror or e)
            return []
        return [n[:-5] for n in names if n.endswith(".json") and not n.startswith(".")]

    def load(self, incident_id: str) -> dict | None:
        """The record stored under exactly ``incident_id``, or None (missing, unreadable, bad JSON: logged)."""
        if not valid_id(incident_id):
            return None
        path = self.path_for(incident_id)
        try:
            with open(path, "rb") as f:
                rec = json.loads(f.read())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            log.warning("skipping unreadable incident file %s: %s", path, getattr(e, "strerror", None) or e)
            return None
        if not isinstance(rec, dict):
            log.warning("skipping incident file %s: not a JSON object", path)
            return None
        return rec

    def list(self) -> list[dict]:
        """All readable records, newest first (by ``started_at``, then id)."""
        recs = [r for r in (self.load(i) for i in self.ids()) if r is not None]
        return sort_newest_first(recs)

    def get(self, incident_id: str) -> dict | None:
        """The record with this id or unique id prefix; None if none matches.

        Raises:
            AmbiguousId: the prefix matches several stored incidents.
        """
        rec = self.load(incident_id)
        if rec is not None:
            return rec
        matches = sorted(i for i in self.ids() if i.startswith(incident_id))
        if len(matches) > 1:
            raise AmbiguousId(incident_id, matches)
        return self.load(matches[0]) if matches else None


def _sort_key(rec: dict) -> tuple:
    t = rec.get("started_at")
    return (t if isinstance(t, int | float) else 0.0, str(rec.get("id", "")))


def sort_newest_first(recs: Iterable[dict]) -> list[dict]:
    """Records sorted newest first by ``started_at`` (unix seconds), ties by id."""
    return sorted(recs, key=_sort_key, reverse=True)


# --- facts derived from a record --------------------------------------------------------


def _num(v: Any) -> float | None:
    return v if isinstance(v, int | float) and not isinstance(v, bool) else None


def available_at_crossing(rec: dict) -> int | None:
    """MemAvailable in bytes at the crossing: ``meminfo.MemAvailable``, else the crossed event's value."""
    mi = rec.get("meminfo") or {}
    v = _num(mi.get("MemAvailable")) if isinstance(mi, dict) else None
    if v is not None:
        return int(v)
    for ev in rec.get("timeline") or []:
        if isinstance(ev, dict) and ev.get("event") == "crossed" and _num(ev.get("available_bytes")) is not None:
            return int(ev["available_bytes"])
    return None


def min_available(rec: dict) -> int | None:
    """Lowest available bytes seen during the incident (``min_available_bytes`` if the record
    has it, else the minimum over the timeline and the crossing snapshot); None if unknown."""
    v = _num(rec.get("min_available_bytes"))
    if v is not None:
        return int(v)
    vals = [ev.get("available_bytes") for ev in rec.get("timeline") or [] if isinstance(ev, dict)]
    vals.append(available_at_crossing(rec))
    vals = [int(x) for x in vals if _num(x) is not None]
    return min(vals) if vals else None


def duration(rec: dict) -> float | None:
    """Seconds from start to end, None while open or unknown."""
    a, b = _num(rec.get("started_at")), _num(rec.get("ended_at"))
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
    from sparkguard.units import format_size
    return (f"{rec.get('kind', 'memory')} incident {rec.get('id', '?')}: {rec.get('outcome', '?')}, "
            f"target {target_label(rec)}, MemAvailable down to {format_size(min_available(rec))}")


def _local(t: Any, with_ms: bool = False) -> str:
    if _num(t) is None:
        return "-"
    s = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))
    if with_ms:
        s += f".{int((t % 1) * 1000):03d}"
    return s + time.strftime(" %Z", time.localtime(t))


# --- the readable report ---------------------------------------------------------------

_MEMINFO_SHOWN = ("MemTotal", "MemAvailable", "MemFree", "Cached", "Buffers", "Shmem", "AnonPages",
                  "Mlocked", "Unevictable", "SwapTotal", "SwapFree", "Dirty", "Writeback")


def _psi_line(psi: dict, kind: str) -> str | None:
    d = psi.get(kind) if isinstance(psi, dict) else None
    if not isinstance(d, dict):
        return None
    parts = [f"{w} {d[w]:.2f}%" for w in ("avg10", "avg60", "avg300") if _num(d.get(w)) is not None]
    if _num(d.get("total_us")) is not None:
        parts.append(f"total {d['total_us'] / 1e6:.3f} s stalled")
    return f"{kind:<5} " + ", ".join(parts)


def _tree_rows(tree: list[dict]) -> list[tuple[int, dict]]:
    """(depth, entry) in parent-before-child order; entries whose parent is outside the tree
    (the root, and orphans reparented away from it) start at depth 0."""
    entries = [e for e in tree if isinstance(e, dict)]
    pids = {e.get("pid") for e in entries}
    children: dict[Any, list[dict]] = {}
    roots = []
    for e in entries:
        if e.get("ppid") in pids and e.get("ppid") != e.get("pid"):
            children.setdefault(e.get("ppid"), []).append(e)
        else:
            roots.append(e)
    out: list[tuple[int, dict]] = []
    seen: set = set()

    def walk(e: dict, depth: int) -> None:
        if id(e) in seen:
            return
        seen.add(id(e))
        out.append((depth, e))
        for c in children.get(e.get("pid"), []):
            walk(c, depth + 1)

    for r in roots:
        walk(r, 0)
    for e in entries:  # cycles (should not happen): still show them
        walk(e, 0)
    return out


def _engine_lines(eng: dict) -> list[str]:
    """The report's "Engine" section from ``rec["engine"]`` (sparkguard.supervisor: the supervised
    engine's run the incident concerns, and what became of it); never raises on odd values."""
    import shlex

    def words(d: Any) -> str:       # a small dict as "k v, k v" (no JSON in a report for people)
        if isinstance(d, dict):
            return ", ".join(f"{k} {v}" for k, v in d.items() if v not in (None, "", 0, False)) or "none"
        return str(d)

    out = ["Engine (supervised by sparkguard)"]
    head = []
    if eng.get("pid") is not None:
        head.append(f"pid {eng['pid']}")
    if eng.get("lane"):
        head.append(f"lane {eng['lane']}")
    if head:
        out.append(f"  run            {', '.join(head)}")
    cmd = eng.get("command")
    if isinstance(cmd, list) and cmd:
        line = shlex.join(str(a) for a in cmd)
        out.append(f"  command        {line if len(line) <= 300 else line[:299] + '…'}")
    ex = eng.get("exit")
    if isinstance(ex, dict):
        when = _local(ex.get("at")) if _num(ex.get("at")) is not None else ""
        out.append(f"  exit           {ex.get('detail') or words(ex)}" + (f" (at {when})" if when else ""))
    elif eng.get("pid") is not None and "exit" in eng:
        out.append("  exit           still running when reported")
    if eng.get("state"):
        out.append(f"  state          {eng['state']}" + (f": {eng['detail']}" if eng.get("detail") else "")
                   + " (when the incident closed)")
    if "restarted" in eng:
        after = eng.get("after") if isinstance(eng.get("after"), dict) else {}
        bits = [f"{k} {after[k]}" for k in ("pid", "lane") if after.get(k) is not None]
        out.append("  restarted      " + ("yes" if eng["restarted"] else "no")
                   + (f", now {after['state']}" if after.get("state") else "")
                   + (f" ({', '.join(bits)})" if bits else ""))
    if isinstance(eng.get("restarts"), dict):
        out.append(f"  restarts       {words(eng['restarts'])} (by reason, since the daemon started)")
    for k, v in eng.items():
        if k in ("pid", "lane", "command", "exit", "state", "detail", "restarted", "after", "restarts", "last_lines"):
            continue
        if isinstance(v, list) and all(isinstance(x, str) for x in v):
            out.append(f"  {k}:")
            out.extend(f"    | {x}" for x in v)
        else:
            out.append(f"  {str(k):<14} {words(v) if isinstance(v, dict) else v}")
    lines = eng.get("last_lines")
    if isinstance(lines, list) and lines:
        out.append(f"  last {len(lines)} output lines" + (f" of pid {eng['pid']}" if eng.get("pid") else "") + ":")
        out.extend(f"    | {x}" for x in lines)
    return out


def render(rec: dict) -> str:
    """A readable multi-line report of one incident record (str, ends with a newline).

    Sections: what happened (kind, outcome, summary), when (local times, duration),
    where (host, boot id), memory (thresholds, MemAvailable at the crossing and lowest,
    /proc/meminfo excerpt, PSI, zram), the target's process tree, the timeline with
    times relative to the crossing, and the engine supervisor's notes if present.
    Missing or odd fields print as ``-``; render never raises on a partial record.
    """
    from sparkguard.units import format_duration, format_size

    L: list[str] = []
    kind = rec.get("kind", "memory")
    flags = [f for f, on in (("DRILL", rec.get("drill")), ("DRY RUN", rec.get("dry_run"))) if on]
    L.append(f"Incident {rec.get('id', '?')}  ({kind}{', ' + ', '.join(flags) if flags else ''})")
    L.append(f"  {summary(rec)}")
    L.append("")
    L.append(f"  outcome        {rec.get('outcome', '-')}")
    L.append(f"  started        {_local(rec.get('started_at'), True)}")
    end = rec.get("ended_at")
    L.append(f"  ended          {_local(end, True) if end is not None else 'not yet (open)'}"
             + (f"   (after {format_duration(duration(rec))})" if duration(rec) is not None else ""))
    L.append(f"  host           {rec.get('host', '-')}   boot {rec.get('boot_id', '-') or '-'}")

    th = rec.get("thresholds") or {}
    L.append("")
    L.append("Memory")
    if isinstance(th, dict):
        sig = th.get("signal", "available")
        L.append(f"  signal         {'MemAvailable + SwapFree' if sig == 'available+swap' else 'MemAvailable'}"
                 f" ({sig})")
        kill = th.get("kill_below_bytes")
        L.append(f"  TERM below     {format_size(th.get('term_below_bytes'))}    "
                 f"KILL below {format_size(kill) if kill is not None else 'off'}    "
                 f"grace {format_duration(th.get('grace_seconds'))}")
    L.append(f"  at crossing    MemAvailable {format_size(available_at_crossing(rec))}")
    low = min_available(rec)
    low_t = None
    for ev in rec.get("timeline") or []:
        if isinstance(ev, dict) and ev.get("available_bytes") == low and low is not None:
            low_t = ev.get("t")
            break
    L.append(f"  lowest         MemAvailable {format_size(low)}"
             + (f" at +{low_t:.3f} s" if _num(low_t) is not None else ""))
    mi = rec.get("meminfo")
    if isinstance(mi, dict) and mi:
        shown = [(k, mi[k]) for k in _MEMINFO_SHOWN if _num(mi.get(k)) is not None]
        L.append("  /proc/meminfo at the crossing:")
        for i in range(0, len(shown), 3):
            L.append("    " + "   ".join(f"{k + ':':<14}{format_size(v):>10}" for k, v in shown[i:i + 3]))
    psi = rec.get("psi_memory")
    if isinstance(psi, dict):
        L.append("  PSI memory     " + (_psi_line(psi, "some") or "-"))
        if _psi_line(psi, "full"):
            L.append("                 " + _psi_line(psi, "full"))
    else:
        L.append("  PSI memory     - (not available)")
    zr = rec.get("zram")
    if isinstance(zr, list) and zr:
        for z in zr:
            if not isinstance(z, dict):
                continue
            orig, compr = _num(z.get("orig_data_bytes")), _num(z.get("compr_data_bytes"))
            ratio = f", ratio {orig / compr:.1f}" if orig and compr else ""
            L.append(f"  zram           {z.get('device', '?')} ({z.get('comp_algorithm', '?')}): "
                     f"disksize {format_size(z.get('disksize_bytes'))}, data {format_size(orig)} "
                     f"in {format_size(compr)}{ratio}, RAM used {format_size(z.get('mem_used_bytes'))}")
    else:
        L.append("  zram           none")

    L.append("")
    t = rec.get("target")
    if isinstance(t, dict):
        L.append(f"Target  {t.get('title', '?')}  (root pid {t.get('root_pid', '?')}, "
                 f"tree memory {format_size(t.get('mem_bytes'))} RSS+swap)")
        if t.get("pattern"):
            L.append(f"  matched by     {t.get('pattern')}")
        tree = t.get("tree") or []
        if tree:
            L.append(f"  {'PID':>8} {'PPID':>8} {'RSS':>10} {'SWAP':>10} {'OOM':>5}  TITLE")
            for depth, e in _tree_rows(tree):
                title = str(e.get("title") or "")
                L.append(f"  {e.get('pid', '?'):>8} {e.get('ppid', '?'):>8} "
                         f"{format_size(e.get('rss_bytes')):>10} {format_size(e.get('swap_bytes')):>10} "
                         f"{str(e.get('oom_score', '-')):>5}  {'  ' * depth}{title}")
                cmd = str(e.get("cmdline") or "")
                if cmd and cmd != title:
                    cmd = cmd if len(cmd) <= 100 else cmd[:99] + "…"
                    L.append(f"  {'':>45}  {'  ' * depth}  cmdline: {cmd}")
    else:
        L.append("Target  none")
        top = [e for e in rec.get("top_consumers") or [] if isinstance(e, dict)]
        if top:
            L.append("  largest processes at the crossing (RSS+swap; unified-memory GPU allocations do not show):")
            for e in top:
                L.append(f"  {e.get('pid', '?'):>8} {format_size((e.get('rss_bytes') or 0) + (e.get('swap_bytes') or 0)):>10}"
                         f"  {e.get('title') or ''}")

    L.append("")
    L.append("Timeline (relative to the crossing)")
    t0 = _num(rec.get("started_at"))
    tl = [e for e in rec.get("timeline") or [] if isinstance(e, dict)]
    if not tl:
        L.append("  (no events)")
    for ev in tl:
        rel = _num(ev.get("t"))
        if rel is None and t0 is not None and _num(ev.get("at")) is not None:
            rel = ev["at"] - t0
        parts = [f"  {('+%.3f s' % rel) if rel is not None else '?':>11}  {str(ev.get('event', '?')):<10}"]
        if _num(ev.get("available_bytes")) is not None:
            parts.append(f"available {format_size(ev['available_bytes'])}")
        pids = ev.get("pids")
        if pids:
            ps = ", ".join(str(p) for p in pids[:12]) + (f" (+{len(pids) - 12})" if len(pids) > 12 else "")
            parts.append(f"pids {ps}")
        if ev.get("detail"):
            parts.append(str(ev["detail"]))
        L.append("  ".join(parts))

    eng = rec.get("engine")
    if isinstance(eng, dict) and eng:
        L.append("")
        L.extend(_engine_lines(eng))
    return "\n".join(L) + "\n"


def list_line(rec: dict) -> tuple[str, ...]:
    """Columns of the one-line listing: id, local start, kind, outcome, target, min available, duration."""
    from sparkguard.units import format_duration, format_size

    kind = str(rec.get("kind", "memory")) + (" (drill)" if rec.get("drill") and rec.get("kind") != "drill" else "")
    outcome = str(rec.get("outcome", "-")) + (" (dry run)" if rec.get("dry_run") and rec.get("outcome") != "dry_run"
                                              else "")
    d = duration(rec)
    return (str(rec.get("id", "?")), _local(rec.get("started_at")), kind, outcome, target_label(rec, 32),
            format_size(min_available(rec)), format_duration(d) if d is not None else "open")


# --- reading the journal ----------------------------------------------------------------


def journal_running(socket_path: str | None = None) -> bool:
    """True where journald runs: ``journalctl`` is on PATH and the native socket exists."""
    import shutil

    from sparkguard import journal
    return bool(shutil.which("journalctl")) and os.path.exists(socket_path or journal.DEFAULT_SOCKET)


def _field_text(v: Any) -> str | None:
    """A ``journalctl -o json`` field value as text: str, a list of byte values (binary), or a
    list of those (field repeated: first one), None (over the size limit without --all)."""
    if isinstance(v, str):
        return v
    if isinstance(v, list) and v and all(isinstance(x, int) for x in v):
        return bytes(v).decode("utf-8", "replace")
    if isinstance(v, list) and v:
        return _field_text(v[0])
    return None


def read_journal(timeout: float = 30.0) -> list[dict]:
    """Incident records found in the journal's report entries.

    Runs ``journalctl -o json --all --no-pager MESSAGE_ID=<report id>`` (``--all`` because
    ``-o json`` prints fields over 4096 bytes as null otherwise, ``man:journalctl(1)``) and
    parses each entry's ``SPARKGUARD_REPORT`` JSON.  Returns [] when journalctl fails
    (logged); entries that do not parse are skipped.
    """
    import subprocess

    from sparkguard import journal
    cmd = ["journalctl", "-o", "json", "--all", "--no-pager", "MESSAGE_ID=" + journal.MESSAGE_IDS["report"]]
    try:
        r = subprocess.run(cmd, capture_output=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        log.warning("cannot read the journal (%s): %s", " ".join(cmd), e)
        return []
    if r.returncode != 0 and not r.stdout:
        err = r.stderr.decode(errors="replace").strip()
        if err and "No journal files" not in err:
            log.warning("journalctl failed (exit %d): %s", r.returncode, err)
        return []
    out = []
    for line in r.stdout.splitlines():
        try:
            entry = json.loads(line)
            text = _field_text(entry.get("SPARKGUARD_REPORT"))
            rec = json.loads(text) if text else None
        except ValueError:
            continue
        if isinstance(rec, dict) and valid_id(rec.get("id")):
            out.append(rec)
    return out


def merge(stored: Iterable[dict], journaled: Iterable[dict]) -> list[tuple[dict, str]]:
    """Merge records by id; the file wins over the journal copy, and among journal copies of one id
    (an incident is reported again when the engine restarts) the last one, in journal order, wins.

    Returns ``[(record, source)]`` newest first, source ``"file"``, ``"journal"`` or
    ``"file+journal"``.
    """
    by_id: dict[str, tuple[dict, str]] = {}
    for r in stored:
        by_id[r["id"]] = (r, "file")
    for r in journaled:
        iid = r["id"]
        if iid in by_id and by_id[iid][1] == "journal":
            by_id[iid] = (r, "journal")
        elif iid in by_id:
            by_id[iid] = (by_id[iid][0], "file+journal")
        else:
            by_id[iid] = (r, "journal")
    order = {id(r): i for i, r in enumerate(sort_newest_first(r for r, _ in by_id.values()))}
    return sorted(by_id.values(), key=lambda rs: order[id(rs[0])])


# --- the CLI ----------------------------------------------------------------------------


def register(subparsers: Any) -> None:
    """Add ``sparkguard incidents [ID] [--json] [--dir DIR] [--config PATH] [--limit N]``."""
    p = subparsers.add_parser(
        "incidents", help="list recorded incidents, or show one as a report",
        description="List incidents newest first (one line each), or show one as a readable report. "
                    "Reads the JSON store (incidents.dir) and, where journald runs, the journal's "
                    "report entries, merged by id.")
    p.add_argument("id", nargs="?", metavar="ID", help="incident id or a unique prefix of one")
    p.add_argument("--json", action="store_true", help="print JSON (a list, or the one record)")
    p.add_argument("--dir", metavar="DIR", help="incident directory (default: incidents.dir of the config)")
    p.add_argument("--config", metavar="PATH", help="configuration file (default /etc/sparkguard/sparkguard.yaml)")
    p.add_argument("--limit", type=int, default=DEFAULT_LIMIT, metavar="N",
                   help=f"list at most N incidents (default {DEFAULT_LIMIT}; 0 lists all)")
    p.add_argument("--no-journal", action="store_true", help="read only the JSON store, not the journal")
    p.set_defaults(func=_cmd)


def _err(msg: str) -> None:
    print(f"sparkguard incidents: {msg}", file=sys.stderr)


def _cmd(args: argparse.Namespace) -> int:
    directory = args.dir
    if directory is None:
        from sparkguard import config
        try:
            directory = config.load(args.config).incidents.dir
        except config.ConfigError as e:
            _err(str(e))
            return 2
    if args.limit < 0:
        _err(f"--limit: {args.limit}: must be 0 (all) or more")
        return 2
    store = IncidentStore(directory)
    use_journal = not args.no_journal and journal_running()
    records = merge(store.list(), read_journal() if use_journal else [])
    where = directory + (" and the journal" if use_journal else "")

    if args.id is not None:
        matches = [(r, s) for r, s in records if r["id"] == args.id] or \
                  [(r, s) for r, s in records if r["id"].startswith(args.id)]
        if not matches:
            _err(f"no incident {args.id!r} in {where}")
            return 1
        if len(matches) > 1:
            _err(f"{args.id!r} matches {len(matches)} incidents: " + ", ".join(r["id"] for r, _ in matches[:10]))
            return 1
        rec, source = matches[0]
        if args.json:
            print(json.dumps(rec, indent=2, default=str))
        else:
            sys.stdout.write(render(rec))
            if source == "journal":
                print(f"\n(from the journal only: no file {store.path_for(rec['id'])})")
        return 0

    shown = records[:args.limit] if args.limit else records
    if args.json:
        print(json.dumps([r for r, _ in shown], indent=2, default=str))
        return 0
    if not records:
        print(f"No incidents recorded (looked in {where}).")
        return 0
    rows = [("ID", "STARTED", "KIND", "OUTCOME", "TARGET", "MIN AVAIL", "DURATION")]
    rows += [list_line(r) + (("journal only",) if s == "journal" else ()) for r, s in shown]
    widths = [max(len(r[i]) for r in rows if len(r) > i) for i in range(7)]
    for r in rows:
        print("  ".join(c.ljust(widths[i]) if i < 7 else c for i, c in enumerate(r)).rstrip())
    if len(records) > len(shown):
        print(f"({len(records) - len(shown)} older not shown; --limit 0 lists all)")
    return 0

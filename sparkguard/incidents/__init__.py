"""``sparkguard incidents``: list the recorded incidents, or show one as a report.

It reads the store (:mod:`sparkguard.incidents.store`) and, where journald runs, the journal's
report entries (``MESSAGE_ID`` = :data:`sparkguard.journal.MESSAGE_IDS` ``["report"]``), merged by
id, so an incident whose file could not be written still shows; one is rendered by
:mod:`sparkguard.incidents.render`.  The record's schema: docs/incident.md.

It registers a CLI command (:mod:`sparkguard.cli`): it imports no third-party module; the
configuration (YAML) is read only when the command runs without ``--dir``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
from typing import Any, Iterable

from sparkguard import journal
from sparkguard.incidents.render import list_line, render
from sparkguard.incidents.store import IncidentStore, sort_newest_first, valid_id

log = logging.getLogger("sparkguard.incidents")

DEFAULT_LIMIT = 20


# --- reading the journal ----------------------------------------------------------------


def journal_running(socket_path: str | None = None) -> bool:
    """True where journald runs: ``journalctl`` is on PATH and the native socket exists."""
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
    p.add_argument("--config", "-c", metavar="PATH", help="configuration file (default /etc/sparkguard/sparkguard.yaml)")
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

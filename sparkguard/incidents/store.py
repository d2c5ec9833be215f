"""The incident store: one JSON file per incident in ``incidents.dir``.

Files live in ``incidents.dir`` (default ``/var/lib/sparkguard/incidents``) as ``<id>.json``,
written atomically by :func:`sparkguard.host.files.atomic_write` (temp file in the same
directory, fsync, rename over the final name, fsync of the directory).  Mode 0640, the
directory 0750 when created here.  A full disk or read-only directory is logged and
survived: the journal still carries the report (see :mod:`sparkguard.reporter`).
"""

from __future__ import annotations

import json
import logging
import os
import re
from typing import Any, Iterable

from sparkguard import untrusted
from sparkguard.host.files import atomic_write

log = logging.getLogger("sparkguard.incidents")

FILE_MODE = 0o640
#: bytes one incident file may hold when read back (a report of a large tree is some 100 KiB)
RECORD_MAX = 16 << 20
DIR_MODE = 0o750
#: ids become file names: refuse anything that could leave the directory
_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}\Z")


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
            data = json.dumps(incident, indent=1, default=str) + "\n"
        except (TypeError, ValueError) as e:
            return self._fail(f"not serialisable: {e}", iid, log_errors)
        try:
            self._make_dir()
            atomic_write(self.path_for(iid), data, FILE_MODE)
        except OSError as e:
            return self._fail(f"{e.strerror or e} ({e.filename or self.dir})", iid, log_errors)
        return self.path_for(iid)

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
        try:     # no symlink, no FIFO, root's (or this user's), bounded: untrusted.read_file
            rec = untrusted.loads(untrusted.read_file(path, RECORD_MAX).decode("utf-8", "replace"))
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            log.warning("skipping unreadable incident file %s: %s", path, getattr(e, "strerror", None) or e)
            return None
        if not isinstance(rec, dict):
            log.warning("skipping incident file %s: not a JSON object", path)
            return None
        return rec

    def newest(self, kind: str, scan: int = 64) -> dict | None:
        """The newest closed record of ``kind`` (``ended_at`` set) among the ``scan`` newest files
        by name (an id starts with its UTC start), or None: a bounded read for ``sparkguard status``."""
        for iid in sorted(self.ids(), reverse=True)[:scan]:
            rec = self.load(iid)
            if rec is not None and rec.get("kind") == kind and rec.get("ended_at") is not None:
                return rec
        return None

    def list(self) -> list[dict]:
        """All readable records, newest first (by ``started_at``, then id)."""
        recs = [r for r in (self.load(i) for i in self.ids()) if r is not None]
        return sort_newest_first(recs)


def _sort_key(rec: dict) -> tuple:
    t = rec.get("started_at")
    return (t if isinstance(t, int | float) else 0.0, str(rec.get("id", "")))


def sort_newest_first(recs: Iterable[dict]) -> list[dict]:
    """Records sorted newest first by ``started_at`` (unix seconds), ties by id."""
    return sorted(recs, key=_sort_key, reverse=True)

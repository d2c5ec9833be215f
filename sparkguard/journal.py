"""journald native protocol sender (no python-systemd dependency).

A journal entry is one datagram of fields sent to journald's native socket
(``/run/systemd/journal/socket``).  Each field is ``KEY=value\\n``; a value holding a
newline uses the binary form ``KEY\\n`` + 64-bit little-endian length + value + ``\\n``.
A datagram larger than the socket's send buffer fails with EMSGSIZE (ENOBUFS on some
kernels); then the entry is written to a sealed memfd and the fd alone is passed with
SCM_RIGHTS in an empty datagram, which journald reads as the entry.  Python 3.11's
``socket.send_fds`` ignores its address argument, so ``sendmsg`` is used directly.

Sources: systemd ``man:systemd.journal-fields(7)``, "Native Journal Protocol"
(https://systemd.io/JOURNAL_NATIVE_PROTOCOL/), systemd ``src/libsystemd/sd-journal/journal-send.c``
(``sd_journal_sendv``: memfd fallback on EMSGSIZE/ENOBUFS, seals SHRINK|GROW|WRITE|SEAL) and
``src/journal/journald-native.c`` (field name rules, sealed-memfd requirement).

MESSAGE_ID values are fixed 128-bit ids, one per kind of sparkguard event, so that
``journalctl MESSAGE_ID=<id>`` finds every entry of that kind on any machine.  They
never change once released; new kinds of events get new ids.  The catalog
``sparkguard/data/catalog/sparkguard.catalog`` explains each one.

====================  ================================  ========  =================================================
event                 MESSAGE_ID                        PRIORITY  meaning
====================  ================================  ========  =================================================
report                664d84b2b89942f2ac3a8c34e6254450  4 (3)     full incident report (3 when killed or no target)
crossed               74e88fbf103c4eb9a44164a26efee8bf  4         MemAvailable fell below the TERM line
sigterm               48e06cb02cb345de9342309dac34c2ec  4         SIGTERM sent to the target's root
sigkill               f96b804f9ade4a7eb4401d73d38282ed  3         SIGKILL sent to the whole target tree
exited                81e11ad5ae2f4bd9969aad810f4f2316  5         the target tree is gone
recovered             feaf84f15ae246828dcca44dd7d0192c  5         memory is back above the line; incident over
no_target             275449425a144f28ace72a82befb8881  3         below the line but nothing may be signalled
would_signal          032dbf9ce9894711a9187727029087d9  4         dry run: would have sent SIGTERM/SIGKILL
config_reload_failed  7f5e066f6b814f52b7a19d56c14bbf98  4         SIGHUP reload refused; old config kept
recovery_timeout      ec9ec42d9229412cb75748ac8d0793fe  3         victim gone, memory still low after recovery_wait
unclean_shutdown      7bdd0f0e6aee40a2821c59306fae68cf  3         the last run ended without a clean stop (black box)
event                 592ef58734144acc9848eab09e8ca020  5         any other event (engine, link, drill...)
pause_crossed         832dc603cced4e4a8dd03b2131cada76  4         below the soft line: the engine is asked to pause
paused                e387c43629584dba91dc85e73c23f04a  5         the engine says it is paused
pause_failed          38ec2aee78b442d3b57d91f7b213785b  4         the pause failed; the guard goes on without it
resume_sent           e722342fc5b14c8b9eeaef7fba40e5d6  5         memory is back: the engine is asked to resume
resumed               c6ecc0ee1eed4b4b8998027781e51879  5         the engine says it resumed; pause incident over
resume_failed         fc3c6a3c50594fc1a0f88bed42e3cafa  3         the resume failed (tried again, then given up)
pause_escalated       e086d53fefb04e9cbc4fa50bb9e84ee3  4         the hard line was crossed while paused: SIGTERM
fragmented            250a5fc9ab854a85af67458906434ada  3         the engine's start is blocked: MemFree not in 2 MiB blocks
====================  ================================  ========  =================================================
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import socket
import stat
import struct
from typing import Any, Iterable, Mapping

DEFAULT_SOCKET = "/run/systemd/journal/socket"
SYSLOG_IDENTIFIER = "sparkguard"

#: event name -> MESSAGE_ID (32 lowercase hex digits).  Never change a released id.
MESSAGE_IDS: dict[str, str] = {
    "report": "664d84b2b89942f2ac3a8c34e6254450",
    "crossed": "74e88fbf103c4eb9a44164a26efee8bf",
    "sigterm": "48e06cb02cb345de9342309dac34c2ec",
    "sigkill": "f96b804f9ade4a7eb4401d73d38282ed",
    "exited": "81e11ad5ae2f4bd9969aad810f4f2316",
    "recovered": "feaf84f15ae246828dcca44dd7d0192c",
    "no_target": "275449425a144f28ace72a82befb8881",
    "would_signal": "032dbf9ce9894711a9187727029087d9",
    "config_reload_failed": "7f5e066f6b814f52b7a19d56c14bbf98",
    "recovery_timeout": "ec9ec42d9229412cb75748ac8d0793fe",
    "unclean_shutdown": "7bdd0f0e6aee40a2821c59306fae68cf",
    "event": "592ef58734144acc9848eab09e8ca020",
    # the soft line (sparkguard/guard/soft.py, docs/soft-line.md)
    "pause_crossed": "832dc603cced4e4a8dd03b2131cada76",
    "paused": "e387c43629584dba91dc85e73c23f04a",
    "pause_failed": "38ec2aee78b442d3b57d91f7b213785b",
    "resume_sent": "e722342fc5b14c8b9eeaef7fba40e5d6",
    "resumed": "c6ecc0ee1eed4b4b8998027781e51879",
    "resume_failed": "fc3c6a3c50594fc1a0f88bed42e3cafa",
    "pause_escalated": "e086d53fefb04e9cbc4fa50bb9e84ee3",
    # the start gates (sparkguard/supervisor/gates.py, docs/start-gate.md)
    "fragmented": "250a5fc9ab854a85af67458906434ada",
}

#: timeline event names that share an id (dry-run "would" events)
EVENT_ALIASES: dict[str, str] = {"would_term": "would_signal", "would_kill": "would_signal"}

#: event name -> syslog PRIORITY (0 emerg .. 7 debug); see ``man:syslog(3)``.
PRIORITIES: dict[str, int] = {
    "report": 4,
    "crossed": 4,
    "sigterm": 4,
    "sigkill": 3,
    "exited": 5,
    "recovered": 5,
    "no_target": 3,
    "would_signal": 4,
    "config_reload_failed": 4,
    "recovery_timeout": 3,
    "unclean_shutdown": 3,
    "event": 5,
    "pause_crossed": 4,
    "paused": 5,
    "pause_failed": 4,
    "resume_sent": 5,
    "resumed": 5,
    "resume_failed": 3,
    "pause_escalated": 4,
    "fragmented": 3,
}

#: Report id priority by outcome (default ``PRIORITIES["report"]``): the worst outcomes are errors.
REPORT_PRIORITIES: dict[str, int] = {"killed": 3, "no_target": 3, "hard_reset": 3, "resume_failed": 3,
                                     "blocked": 3}


def report_priority(outcome: str | None) -> int:
    """PRIORITY of an incident report: 3 (err) when the outcome is ``killed``/``no_target``/``hard_reset``
    (an ``unclean-shutdown`` incident from another boot), ``resume_failed`` (the engine may still be
    paused), ``blocked`` (a ``fragmented`` incident: no start until a person acts, or the blocks come
    back) or memory did not come back (``*_memory_not_back``), else 4 (warning)."""
    o = str(outcome or "")
    if o.endswith("_memory_not_back"):
        return 3
    return REPORT_PRIORITIES.get(o, PRIORITIES["report"])

_FIELD_RE = re.compile(r"[A-Z][A-Z0-9_]{0,63}\Z")
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL


def _canonical(event: str) -> str:
    event = EVENT_ALIASES.get(event, event)
    return event if event in MESSAGE_IDS else "event"


def message_id(event: str) -> str:
    """MESSAGE_ID (32 hex digits) for an event name (``"sigterm"``, ``"would_kill"``...).

    Unknown names get the generic ``"event"`` id rather than an error: the engine
    supervisor and later modules may report kinds of events this table does not know yet.
    """
    return MESSAGE_IDS[_canonical(event)]


def priority(event: str) -> int:
    """syslog PRIORITY (int 0-7) for an event name; unknown names get 5 (notice)."""
    return PRIORITIES[_canonical(event)]


def valid_field_name(name: str) -> bool:
    """True if ``name`` is a field name a client may send.

    journald accepts 1-64 characters of ``A-Z``, ``0-9`` and ``_``, not starting with a
    digit; names starting with ``_`` are trusted fields journald sets itself and are
    refused from clients.  Source: systemd ``journal_field_valid()``.
    """
    return bool(_FIELD_RE.match(name))


def _value_bytes(value: Any) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, bytearray | memoryview):
        return bytes(value)
    if isinstance(value, bool):
        return b"1" if value else b"0"
    if isinstance(value, str):
        return value.encode("utf-8", "surrogateescape")
    if isinstance(value, dict):
        return json.dumps(value, separators=(",", ":"), default=str).encode()
    return str(value).encode("utf-8", "surrogateescape")


def encode(fields: Mapping[str, Any]) -> bytes:
    """Serialise fields to one native-protocol entry (bytes).

    Args:
        fields: ``{NAME: value}``.  Values: str (UTF-8), bytes (as is), int/float
            (decimal), bool (``1``/``0``), dict (compact JSON), list/tuple (the field is
            repeated once per item, as journald allows), None (field left out).
            ``SYSLOG_IDENTIFIER=sparkguard`` is added unless given.
    Returns:
        bytes: ``KEY=value\\n`` per field; the length-prefixed binary form for values that
        contain a newline.
    Raises:
        ValueError: a field name journald would refuse (see :func:`valid_field_name`).
    """
    out = bytearray()
    items: list[tuple[str, Any]] = []
    for name, value in fields.items():
        if not isinstance(name, str) or not valid_field_name(name):
            raise ValueError(f"invalid journal field name {name!r}: "
                             "expected 1-64 of A-Z 0-9 _, not starting with a digit or _")
        if value is None:
            continue
        if isinstance(value, list | tuple):
            items.extend((name, v) for v in value if v is not None)
        else:
            items.append((name, value))
    if "SYSLOG_IDENTIFIER" not in fields:
        items.append(("SYSLOG_IDENTIFIER", SYSLOG_IDENTIFIER))
    for name, value in items:
        data = _value_bytes(value)
        key = name.encode("ascii")
        if b"\n" in data:
            out += key + b"\n" + struct.pack("<Q", len(data)) + data + b"\n"
        else:
            out += key + b"=" + data + b"\n"
    return bytes(out)


def _send_memfd(sock: socket.socket, payload: bytes, socket_path: str) -> None:
    fd = os.memfd_create("sparkguard-journal", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        view = memoryview(payload)
        while view:
            n = os.write(fd, view)
            view = view[n:]
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
        sock.sendmsg([b""], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("i", fd))],
                      0, socket_path)
    finally:
        os.close(fd)


def send(fields: Mapping[str, Any], socket_path: str = DEFAULT_SOCKET, timeout: float = 2.0) -> str:
    """Send one journal entry to journald over the native protocol.

    Args:
        fields: see :func:`encode` (``MESSAGE``, ``MESSAGE_ID``, ``PRIORITY``, ``SPARKGUARD_*``...).
        socket_path: journald's native socket (a unix datagram socket).
        timeout: seconds to wait when the socket's queue is full (journald busy).
    Returns:
        ``"datagram"`` or ``"memfd"``: how the entry went (memfd when the datagram was
        refused as too large: EMSGSIZE/ENOBUFS).
    Raises:
        ValueError: invalid field name.
        OSError: the socket is missing (ENOENT), nobody listens (ECONNREFUSED), the
            queue stayed full for ``timeout`` (``TimeoutError``), or memfd failed.
    """
    payload = encode(fields)
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
        sock.settimeout(timeout)
        try:
            sock.sendmsg([payload], [], 0, socket_path)
            return "datagram"
        except OSError as e:
            if e.errno not in (errno.EMSGSIZE, errno.ENOBUFS):
                raise
        _send_memfd(sock, payload, socket_path)
        return "memfd"


def available(socket_path: str = DEFAULT_SOCKET) -> bool:
    """True if a journald (or stand-in) listens on ``socket_path``.

    The path must be a unix socket and a datagram socket must be able to connect to it
    (a stale socket file left by a dead journald refuses the connection).
    """
    try:
        if not stat.S_ISSOCK(os.stat(socket_path).st_mode):
            return False
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(socket_path)
        return True
    except OSError:
        return False


def flatten_pids(pids: Iterable[int] | None) -> str:
    """Space-separated PIDs for a ``SPARKGUARD_PIDS`` field (``""`` for none)."""
    return " ".join(str(int(p)) for p in (pids or ()))

"""The black box's format: a ring of the last minute of memory samples, pure encode/decode and verdict.

The ring file (``guard.blackbox_file``, default ``<incidents.dir>/blackbox.ring``) is written in
place by :mod:`sparkguard.guard.ring` and read back here, at the next start, to tell whether the
previous run ended without a clean stop (a hard reset, a power cycle, a SIGKILL) and what memory
looked like in its last minute.  Nothing here does I/O: every function takes or returns bytes.

Layout (little-endian, fixed sizes, so a record is one ``pwrite`` at ``HEADER_SIZE + slot *
RECORD_SIZE`` and no record straddles a 4 KiB page: both sizes divide 4096)::

    header  HEADER_SIZE (128) bytes: magic b"SGBLKBOX", version, header size, record size, slot
            count, flags (bit 0: CLEAN, set by a clean stop, cleared at start), the boot id of the
            run that wrote it (16 bytes), its start and clean-stop times (unix s), its pid, the
            record interval (s), CRC-32 of the bytes before it
    record  RECORD_SIZE (128) bytes, SLOTS of them: sequence number (1, 2, ...: 0 is a slot never
            written; record n lives in slot (n - 1) % SLOTS), CLOCK_REALTIME (unix s),
            CLOCK_MONOTONIC (s), boot id, the guard's signal, MemAvailable, MemFree, SwapFree,
            zram RAM used, the target's memory (bytes, -1 unknown), PSI memory some/full avg10
            (percent, -1 unknown), the policy state, whether memory was far above the line (idle), CRC-32

Reading is for untrusted bytes (a truncated file, a torn write at a reset, another program's
file at that path): :func:`decode` never raises on content but :class:`RingError`, only
bounds-checked structs are unpacked, a record whose CRC does not match is skipped and counted, and
every value is checked as a value from /proc is: a record whose time, sequence number or sizes are
out of range (:func:`_valid`: a time of 1e300, a negative MemAvailable) is skipped and counted
too, a header time out of range reads as unknown (0.0).  A CRC proves only that the bytes were
not torn, not who wrote them.

Sources: the CRC is zlib's CRC-32 (RFC 1952); boot id: /proc/sys/kernel/random/boot_id
(Documentation/admin-guide/sysctl/kernel.rst, "random"); PSI avg10: Documentation/accounting/psi.rst.
"""

from __future__ import annotations

import math
import struct
import zlib
from typing import NamedTuple

from sparkguard import model
from sparkguard.units import format_duration, format_size
from sparkguard.untrusted import MAX_STAMP

MAGIC = b"SGBLKBOX"
VERSION = 1
HEADER_SIZE = 128
RECORD_SIZE = 128
#: slots of the ring: 64 s of history at INTERVAL s per record, 640 s at IDLE_INTERVAL (a minute asked)
SLOTS = 64
#: seconds between two records of full passes (memory near the line, an incident): the loop
#: writes one at its first full pass after this
INTERVAL = 1.0
#: seconds between two records while memory is far above the line: a record costs a cold wake-up
#: about one extra read of /proc/meminfo, and the issue's bound is the idle CPU figure
#: (bench/results/ring.txt: one a second moved it by 7-8 %; one every 5 s by 4-5 us per wake-up on
#: the GPU machine, bench/results/idle-parse.txt section 4, against 2.7 us between identical copies);
#: 10 s is the idle full pass's period (settings.FULL_PASS_EVERY): the full pass writes it, and the
#: fast path's wake-ups between two full passes write none
IDLE_INTERVAL = 10.0
FLAG_CLEAN = 1
#: how many of the last records an incident carries in full
LAST_IN_FULL = 10

#: the largest size a record may hold, bytes (64 PiB: more than any memory this guard watches)
MAX_BYTES = 1 << 56
#: the largest CLOCK_MONOTONIC a record may hold, s (uptime of about 3,000 years)
MAX_MONO = 1e11
#: the largest record interval a header may hold, s
MAX_INTERVAL = 3600.0

#: policy states as stored (one byte); unknown codes read back as "?"
STATES = ("ok", "term_sent", "kill_sent", "recovering", "no_target")

_HEAD = struct.Struct("<8sHHHHII16sddId")       # + crc32 (I) after it
_HEAD_CRC = struct.Struct("<I")
_REC = struct.Struct("<Qdd16sqqqqqqffBB")       # + pad, then crc32 (I) in the last 4 bytes
_REC_CRC_AT = RECORD_SIZE - 4
assert _HEAD.size + 4 <= HEADER_SIZE and _REC.size <= _REC_CRC_AT
assert 4096 % RECORD_SIZE == 0 and 4096 % HEADER_SIZE == 0


class RingError(ValueError):
    """Bytes that are not a ring this version can read (wrong magic, version, sizes, bad CRC)."""


class Header(NamedTuple):
    """The ring's header: ``boot_id`` 32 hex digits (str, "" unknown); ``started_at`` /
    ``stopped_at`` unix s (0.0: not stopped cleanly); ``pid`` int; ``interval`` s; ``clean`` bool."""

    slots: int
    clean: bool
    boot_id: str
    started_at: float
    stopped_at: float
    pid: int
    interval: float


class Record(NamedTuple):
    """One sample.  Sizes in bytes (-1 unknown), ``psi_*`` percent (-1.0 unknown), ``at`` unix s
    (CLOCK_REALTIME), ``mono`` s (CLOCK_MONOTONIC), ``state`` a policy state name, ``idle`` True
    when memory was far above the line (state OK, MemAvailable at least the idle fast path's floor:
    written every IDLE_INTERVAL s, PSI and zram as read at most 10 s before)."""

    seq: int
    at: float
    mono: float
    boot_id: str
    signal: int
    mem_available: int
    mem_free: int
    swap_free: int
    zram_used: int
    target_mem: int
    psi_some_avg10: float
    psi_full_avg10: float
    state: str
    idle: bool


class Ring(NamedTuple):
    """What :func:`decode` read: the header, the valid records oldest first, and the count of
    slots that held something unreadable (``bad``: CRC mismatch, cut off by the file's end)."""

    header: Header
    records: list[Record]
    bad: int


def _boot_bytes(boot_id: str) -> bytes:
    """16 bytes of a 32-hex-digit boot id (dashes allowed); zeros for anything else."""
    try:
        b = bytes.fromhex(boot_id.replace("-", ""))
    except (ValueError, AttributeError):
        return bytes(16)
    return b if len(b) == 16 else bytes(16)


def _boot_str(b: bytes) -> str:
    return "" if b == bytes(16) else b.hex()


def encode_header(h: Header) -> bytes:
    """HEADER_SIZE bytes of ``h`` (this version's magic and sizes, its CRC)."""
    body = _HEAD.pack(MAGIC, VERSION, HEADER_SIZE, RECORD_SIZE, 0, h.slots, FLAG_CLEAN if h.clean else 0,
                      _boot_bytes(h.boot_id), float(h.started_at), float(h.stopped_at), h.pid & 0xFFFFFFFF,
                      float(h.interval))
    return (body + _HEAD_CRC.pack(zlib.crc32(body))).ljust(HEADER_SIZE, b"\0")


def decode_header(data: bytes) -> Header:
    """The header at the start of ``data``.

    Raises:
        RingError: too short, not this magic/version/sizes, a slot count that is 0 or over 65536,
            or a CRC mismatch (the message says which).
    """
    if len(data) < _HEAD.size + 4:
        raise RingError(f"{len(data)} bytes: shorter than a header ({_HEAD.size + 4})")
    (magic, version, hsize, rsize, _, slots, flags, boot, started, stopped, pid,
     interval) = _HEAD.unpack_from(data, 0)
    if magic != MAGIC:
        raise RingError(f"not a sparkguard black box (magic {magic!r})")
    if version != VERSION or hsize != HEADER_SIZE or rsize != RECORD_SIZE:
        raise RingError(f"version {version}, header {hsize} B, record {rsize} B: this sparkguard reads "
                        f"version {VERSION}, {HEADER_SIZE} B, {RECORD_SIZE} B")
    (crc,) = _HEAD_CRC.unpack_from(data, _HEAD.size)
    if crc != zlib.crc32(data[:_HEAD.size]):
        raise RingError("header CRC mismatch (torn or overwritten)")
    if not 0 < slots <= 65536:
        raise RingError(f"slot count {slots} out of range 1-65536")
    return Header(slots, bool(flags & FLAG_CLEAN), _boot_str(boot), _stamp(started), _stamp(stopped), pid,
                  interval if math.isfinite(interval) and 0.0 < interval <= MAX_INTERVAL else 0.0)


def _stamp(x: float) -> float:
    """A header's unix time, 0.0 (unknown) unless finite and within 0..MAX_STAMP (year 2200)."""
    return x if math.isfinite(x) and 0.0 <= x <= MAX_STAMP else 0.0


def _valid(seq: int, wall: float, mono: float, sizes: tuple[int, ...]) -> str | None:
    """Why a record's values are no sample this guard could have written, or None: the sequence
    number 1..2**62, the time a finite unix time after 0 and before MAX_STAMP (year 2200), the
    monotonic clock finite within 0..MAX_MONO, the signal and MemAvailable 0..MAX_BYTES, the other
    sizes -1 (unknown) or 0..MAX_BYTES."""
    if not 0 < seq <= 1 << 62:
        return f"sequence number {seq}"
    if not (math.isfinite(wall) and 0.0 < wall <= MAX_STAMP):
        return f"time {wall!r}"
    if not (math.isfinite(mono) and 0.0 <= mono <= MAX_MONO):
        return f"monotonic time {mono!r}"
    signal, avail, *rest = sizes
    if not (0 <= signal <= MAX_BYTES and 0 <= avail <= MAX_BYTES and all(-1 <= v <= MAX_BYTES for v in rest)):
        return "a size out of range"
    return None


def offset(seq: int, slots: int = SLOTS) -> int:
    """Byte offset of record number ``seq`` (1-based) in a ring of ``slots``."""
    return HEADER_SIZE + ((seq - 1) % slots) * RECORD_SIZE


def file_size(slots: int = SLOTS) -> int:
    """Bytes of a ring file of ``slots`` records."""
    return HEADER_SIZE + slots * RECORD_SIZE


def state_code(state: str) -> int:
    """The byte stored for a policy state name (255 for a name :data:`STATES` lacks)."""
    try:
        return STATES.index(state)
    except ValueError:
        return 255


def pack_record(buf: bytearray, seq: int, at: float, mono: float, boot: bytes, signal: int, avail: int,
                free: int, swap_free: int, zram_used: int, target_mem: int, psi_some: float, psi_full: float,
                state: int, idle: bool) -> None:
    """Fill ``buf`` (RECORD_SIZE bytes, reused: the poll loop allocates nothing per record) with one
    record and its CRC.  ``boot``: the 16 bytes of :func:`boot_bytes`; ``state``: :func:`state_code`."""
    _REC.pack_into(buf, 0, seq, at, mono, boot, signal, avail, free, swap_free, zram_used, target_mem,
                   psi_some, psi_full, state, idle)
    _HEAD_CRC.pack_into(buf, _REC_CRC_AT, zlib.crc32(memoryview(buf)[:_REC_CRC_AT]))


def boot_bytes(boot_id: str) -> bytes:
    """The 16 bytes a record stores for ``boot_id`` (32 hex digits, dashes allowed; zeros if not)."""
    return _boot_bytes(boot_id)


def encode_record(r: Record) -> bytes:
    """RECORD_SIZE bytes of ``r`` (for tests and tools; the loop uses :func:`pack_record`)."""
    buf = bytearray(RECORD_SIZE)
    pack_record(buf, r.seq, r.at, r.mono, _boot_bytes(r.boot_id), r.signal, r.mem_available, r.mem_free,
                r.swap_free, r.zram_used, r.target_mem, r.psi_some_avg10, r.psi_full_avg10,
                state_code(r.state), r.idle)
    return bytes(buf)


def decode_record(data: bytes, at: int = 0) -> Record | None:
    """The record at byte ``at`` of ``data``; None for a slot never written (sequence 0).

    Raises:
        RingError: fewer than RECORD_SIZE bytes there, a CRC mismatch, or a value out of range
            (:func:`_valid`).
    """
    if at < 0 or len(data) - at < RECORD_SIZE:
        raise RingError("record cut off by the end of the file")
    (crc,) = _HEAD_CRC.unpack_from(data, at + _REC_CRC_AT)
    (seq, wall, mono, boot, signal, avail, free, swap_free, zram, target, some, full, state,
     idle) = _REC.unpack_from(data, at)
    if seq == 0 and crc == 0:
        return None
    if crc != zlib.crc32(memoryview(data)[at:at + _REC_CRC_AT]):
        raise RingError(f"record CRC mismatch at byte {at}")
    why = _valid(seq, wall, mono, (signal, avail, free, swap_free, zram, target))
    if why is not None:
        raise RingError(f"record at byte {at}: {why} out of range")
    return Record(seq, wall, mono, _boot_str(boot), signal, avail, free, swap_free, zram, target,
                  _pct(some), _pct(full), STATES[state] if state < len(STATES) else "?", bool(idle))


def _pct(x: float) -> float:
    return round(x, 2) if math.isfinite(x) and 0.0 <= x <= 100.0 else -1.0


def decode(data: bytes) -> Ring:
    """The whole ring in ``data`` (a file's bytes): the header and every valid record, oldest first.

    A file cut short keeps the records it still holds (the rest count as ``bad``), and so does
    one with torn records; a record in a slot its number does not own, or with a value out of
    range (:func:`decode_record`), counts as ``bad`` too.
    Records are ordered by sequence number.

    Raises:
        RingError: the header is unreadable (:func:`decode_header`): nothing can be trusted.
    """
    h = decode_header(data)
    recs: list[Record] = []
    bad = 0
    for slot in range(h.slots):
        at = HEADER_SIZE + slot * RECORD_SIZE
        try:
            r = decode_record(data, at)
        except RingError:
            bad += 1
            continue
        if r is None:
            continue
        if (r.seq - 1) % h.slots != slot:       # a record in a slot its number does not own
            bad += 1
            continue
        recs.append(r)
    recs.sort(key=lambda r: r.seq)
    return Ring(h, recs, bad)


def verdict(ring: Ring, boot_id_now: str) -> str | None:
    """Why the run that wrote ``ring`` ended uncleanly, or None when it stopped cleanly (or never
    wrote a sample).

    Returns:
        ``"hard_reset"``: no clean stop, and the last record is from another boot (the box was reset
        or power-cycled under the guard: what a lock-up ends in); ``"daemon_died"``: no clean stop
        within this boot (the guard was SIGKILLed, crashed, or its watchdog restarted it); None.
    """
    if ring.header.clean or not ring.records:
        return None
    last = ring.records[-1]
    boot = last.boot_id or ring.header.boot_id
    return "hard_reset" if boot != boot_id_now.replace("-", "") else "daemon_died"


def record_json(r: Record) -> dict:
    """A record as the incident carries it (sizes in bytes, None where unknown)."""
    def known(v):
        return None if v < 0 else v
    return {"seq": r.seq, "at": round(r.at, 3), "boot_id": r.boot_id, "signal_bytes": r.signal,
            "mem_available_bytes": r.mem_available, "mem_free_bytes": known(r.mem_free),
            "swap_free_bytes": known(r.swap_free), "zram_used_bytes": known(r.zram_used),
            "target_mem_bytes": known(r.target_mem), "psi_some_avg10": known(r.psi_some_avg10),
            "psi_full_avg10": known(r.psi_full_avg10), "state": r.state, "idle": r.idle}


def summarise(ring: Ring, cause: str, now: float, boot_id_now: str, window: float = 60.0,
              last_n: int = LAST_IN_FULL) -> dict:
    """The incident's ``blackbox`` part for an unclean end (:func:`verdict` gave ``cause``).

    Args:
        ring: what :func:`decode` read (at least one record).
        now: unix s of this start; boot_id_now: this boot's id.
        window: seconds before the last record summarised (lowest MemAvailable/MemFree/SwapFree,
            highest PSI and zram use); last_n: records carried in full, newest last.
    Returns:
        ``{"cause", "previous_boot_id", "boot_id", "previous_pid", "previous_started_at",
        "last_sample_at", "gap_seconds", "records", "unreadable_slots", "window_seconds",
        "lowest": {...}, "highest": {...}, "last": [record, ...]}``; ``gap_seconds`` is how long
        before this start the last sample was written (the reset came within ``interval`` of it,
        plus what writeback had not flushed: docs/blackbox.md).
    """
    recs = ring.records
    last = recs[-1]
    win = [r for r in recs if r.at >= last.at - window]

    def low(attr):
        vals = [getattr(r, attr) for r in win if getattr(r, attr) >= 0]
        return min(vals) if vals else None

    def high(attr):
        vals = [getattr(r, attr) for r in win if getattr(r, attr) >= 0]
        return max(vals) if vals else None
    return {
        "cause": cause, "previous_boot_id": last.boot_id or ring.header.boot_id,
        "boot_id": boot_id_now.replace("-", ""), "previous_pid": ring.header.pid,
        "previous_started_at": ring.header.started_at or None, "last_sample_at": last.at,
        "gap_seconds": round(now - last.at, 3), "records": len(recs), "unreadable_slots": ring.bad,
        "window_seconds": round(last.at - win[0].at, 3),
        "lowest": {"signal_bytes": low("signal"), "mem_available_bytes": low("mem_available"),
                   "mem_free_bytes": low("mem_free"), "swap_free_bytes": low("swap_free")},
        "highest": {"psi_some_avg10": high("psi_some_avg10"), "psi_full_avg10": high("psi_full_avg10"),
                    "zram_used_bytes": high("zram_used"), "target_mem_bytes": high("target_mem")},
        "last": [record_json(r) for r in recs[-last_n:]],
    }


#: the incident kind of an unclean end (docs/incident.md) and its outcomes (:func:`verdict`)
KIND = "unclean-shutdown"
CAUSES = {"hard_reset": "the box was reset or power-cycled under the guard (a new boot)",
          "daemon_died": "the guard was killed or crashed without stopping (same boot)"}


def incident(ring: Ring, cause: str, now: float, host: str, boot_id: str, thresholds: model.Thresholds,
             meminfo_now: dict[str, int]) -> model.Incident:
    """The ``unclean-shutdown`` incident of a ring that :func:`verdict` found unclean.

    It starts at the last sample (the last moment the guard is known to have run) and ends at
    this start (``now``, unix s); ``outcome`` is ``cause``; ``meminfo`` is /proc/meminfo now
    (``meminfo_now``); ``blackbox`` is :func:`summarise`; the timeline has ``last_sample`` and
    ``unclean_shutdown`` (its journal MESSAGE_ID: :data:`sparkguard.journal.MESSAGE_IDS`).
    """
    bb = summarise(ring, cause, now, boot_id)
    last = ring.records[-1]
    lo, hi = bb["lowest"], bb["highest"]
    inc = model.new_incident(KIND, last.at, thresholds, dict(meminfo_now), host=host, boot_id=boot_id.replace("-", ""),
                             outcome=cause)
    inc.ended_at = now
    inc.blackbox = bb
    inc.min_available_bytes = lo["signal_bytes"]
    inc.timeline.append(model.Event("last_sample", 0.0, last.at, last.signal, [],
                                    f"the last sample the previous run wrote (state {last.state}): "
                                    f"MemAvailable {format_size(last.mem_available)}, MemFree "
                                    f"{format_size(last.mem_free if last.mem_free >= 0 else None)}"))
    gap = bb["gap_seconds"]
    avail_now = meminfo_now.get("MemAvailable", 0)
    inc.timeline.append(model.Event("unclean_shutdown", round(gap, 4), now, avail_now, [],
                                    f"no clean stop: {CAUSES.get(cause, cause)}; this start came "
                                    f"{format_duration(gap)} after the last sample"))
    psi = hi["psi_full_avg10"]
    inc.summary = (f"{'hard reset' if cause == 'hard_reset' else 'guard died'} "
                   f"{format_duration(gap)} before this start; last {format_duration(bb['window_seconds'])}: "
                   f"lowest MemAvailable {format_size(lo['mem_available_bytes'])}, MemFree "
                   f"{format_size(lo['mem_free_bytes'])}, PSI full avg10 up to "
                   + (f"{psi:.1f} %" if psi is not None else "-"))
    return inc

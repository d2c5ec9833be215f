"""The black box's file: lock it, read the last run's ring, hand a sample a second to its writer, mark the clean stop.

The format and every decision are in :mod:`sparkguard.blackbox` (pure); this module does the I/O:

* :func:`open_ring` (start-up): opens ``guard.blackbox_file`` (O_NOFOLLOW, mode 0640), takes an
  exclusive ``flock`` (a second guard on the same file gets no ring, rather than reporting the
  running one as dead), leaves alone a file that is not this daemon's (:func:`_not_ours`: another
  owner, a hard link, writable by others, not a ring: named in the error, the guard runs without
  a black box), reads what the previous run left (at most :data:`MAX_READ` bytes),
  then starts this run's ring: header with the CLEAN flag cleared, every slot zeroed, one
  ``fdatasync``.  Any failure leaves the guard without a black box, never without its loop.
* :meth:`Ring.sample` (poll loop, once per :data:`sparkguard.blackbox.INTERVAL`): parses MemFree
  and SwapFree from the /proc/meminfo text the loop just read, preads the PSI file and each zram
  ``mm_stat`` through descriptors opened at start (for idle records every :data:`SLOW_EVERY`
  seconds, else every record), packs the record into a reused buffer and hands a copy of it
  (:data:`~sparkguard.blackbox.RECORD_SIZE` bytes) to the writer thread: no file I/O, no
  allocation that grows (at most :data:`~sparkguard.blackbox.SLOTS` records wait; a newer one
  pushes out the oldest), and no open but the zram devices' listing every :data:`ZRAM_RELIST`
  seconds (sysfs, in memory).
* The writer thread (``sparkguard-blackbox``) ``pwrite``\\ s each record at its slot.  A write
  into the page cache can wait: on a frozen filesystem (``fsfreeze``, a snapshot) until it is
  thawed, in ``balance_dirty_pages`` while the host's dirty pages are over their limit (a limit
  that shrinks as free memory does), on a page under writeback where the device needs stable
  pages; the loop never waits with it.  Errors are counted and logged once per streak.
  While records are not idle (memory near the line, an incident open) it also starts writeback
  of the file (:func:`flush`: ``sync_file_range``) every ``guard.blackbox_sync`` seconds; while
  memory is far above the line it wakes only for the idle records, and the kernel's own
  writeback writes dirty pages once they are ``vm.dirty_expire_centisecs`` old (30 s by default,
  Documentation/admin-guide/sysctl/vm.rst), as it always does with ``blackbox_sync: 0``.
* :meth:`Ring.close` (clean stop): the writer writes what it holds, then the header with CLEAN
  set and the stop time, and ``fdatasync``\\ s, all as its last step; close() waits
  :data:`CLOSE_WAIT` s for it.  On a disk that does not answer, the stop goes on without them
  (logged), though the process cannot end before the kernel lets the writer's write return.

Sources for the waits: fsfreeze(8) ("any process attempting to write to the frozen filesystem is
blocked"); mm/page-writeback.c (``balance_dirty_pages``: writers pause while dirty pages exceed a
limit taken from ``global_dirtyable_memory``, free plus file pages); measured here: a ``pwrite``
on a frozen ext4 waits until the thaw, and ``pwritev2(RWF_NOWAIT)`` is no way out: buffered ext4
writes refuse it (EOPNOTSUPP, kernel 6.18), on a frozen filesystem only after the thaw; so only
a thread of its own keeps the wait off the loop.

What a hard reset loses: the records written since the last flush that the kernel had not
written back itself: near the line at most ``blackbox_sync`` seconds plus the device's write
latency; far above it (the idle fast path, records from the full pass every 10 s) up to ~35 s,
unless the box stays up long enough for the kernel's writeback (a lock-up usually does: it lasts
until someone holds the power button).
``sync_file_range`` does not flush the drive's volatile cache (``fdatasync`` would, at about 1.5x
the CPU and a cache flush that stalls every other writer of the device): assumption: a drive
commits its cache within seconds, and a lock-up lasts longer than that before a person
power-cycles the box.  A crash of the process loses only the records handed to the writer and
not yet written (none while the disk answers: the writer takes each within microseconds); the
page cache holds every ``pwrite``.
The file's pages are also mapped (``mmap``) and touched once, so that under the daemon's
``mlockall(MCL_FUTURE|MCL_ONFAULT)`` (:mod:`sparkguard.guard.harden`) they stay resident: a
``pwrite`` under memory pressure then never waits to read an evicted page back from disk.
Source: mlockall(2) ("MCL_ONFAULT ... lock pages when they are faulted in"), mmap(2).
"""

from __future__ import annotations

import collections
import ctypes
import fcntl
import logging
import mmap
import os
import stat
import threading
import time

from sparkguard import blackbox, sysinfo, untrusted

log = logging.getLogger("sparkguard")

#: bytes read of a previous ring at most: the largest header-declared ring this version accepts
MAX_READ = blackbox.file_size(65536)
FILE_MODE = 0o640
#: seconds between reads of PSI and zram for idle records (each one at IDLE_INTERVAL 10 s): PSI's
#: avg10 is itself a 10 s average (Documentation/accounting/psi.rst), and memory is far above the
#: line then; each read is a syscall on a cold path
SLOW_EVERY = 10.0
#: seconds between two listings of the zram devices: one set up after the guard started (a boot's
#: zram swap unit may start after sparkguard; FIELD-NOTES "What the peers do": swap added after
#: start must not go unnoticed) is counted from the next listing on; a listing is a readdir of
#: /sys/block and three small sysfs reads per device
ZRAM_RELIST = 60.0
#: seconds :meth:`Ring.close` waits for the writer to write what it was handed (a stalled disk:
#: the stop goes on without them, and the header's clean mark waits on the same disk)
CLOSE_WAIT = 5.0
_MEMFREE = b"\nMemFree:"
_KB = b"kB"
_SWAPFREE = b"\nSwapFree:"
_AVG10 = b"avg10="
_PSI_PATH = "/proc/pressure/memory"
_SYS_BLOCK = "/sys/block"


class Ring:
    """This run's ring, open and locked.  Built by :func:`open_ring`; used by the poll-loop thread
    (``sample``, ``close``) and its own writer thread (each record's ``pwrite``, the flushes).

    Attributes:
        path: the file; next_at, next_full_at: monotonic s when the next record is due while memory
        is far above the line (idle) and while it is not (the loop compares them); written: records
        written by this run, errors: failed writes (both counted by the writer thread alone);
        dropped: records lost before the writer had them (a failure making one, or one pushed out of
        a full hand-over queue while the disk did not answer; counted by the loop thread alone).
    """

    def __init__(self, path: str, fd: int, boot_id: str, started_at: float, sync_every: float,
                 psi_path: str = _PSI_PATH, sys_block: str = _SYS_BLOCK):
        self.path, self.fd = path, fd
        self.boot_id, self.started_at = boot_id, started_at
        self._boot = blackbox.boot_bytes(boot_id)
        self.next_at = self.next_full_at = 0.0
        self.written = self.errors = self.dropped = 0
        self._seq = 0
        self._buf = bytearray(blackbox.RECORD_SIZE)
        self._psi_buf = bytearray(512)
        self._mm_buf = bytearray(256)
        self._psi_fd = _open_ro(psi_path)
        self._sys_block = sys_block
        self._zram_fds = _open_zram(sys_block)
        self._zram_list_at = time.monotonic() + ZRAM_RELIST
        self._some = self._full = -1.0
        self._zram_used = -1
        self._slow_at = 0.0
        self._failing = False
        self._map = _pin(fd)
        self._dirty = self._stopped = self._near = self._clean = False
        self._stop_at = 0.0                 # unix s of the clean stop, for the writer's last header
        #: (offset, record bytes) handed over by the loop, oldest first; append and popleft are
        #: atomic, and a full deque drops the oldest rather than grow
        self._pending: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=blackbox.SLOTS)
        self._wake = threading.Event()      # set by the loop with each record, and by close()
        # its own descriptor: the thread may run on after close() gave up waiting, and must not
        # write to a number the process has reused since
        self._thread = threading.Thread(target=self._io_loop, args=(os.dup(fd), sync_every),
                                        name="sparkguard-blackbox", daemon=True)
        self._thread.start()

    # ---- the poll loop's side ------------------------------------------------------------

    def sample(self, now: float, buf: bytes | bytearray, n: int, avail: int, use_swap: bool, state: str,
               idle: bool, target_mem: int) -> float:
        """Make one record; returns when the next one is due while memory stays far above the line
        (:attr:`next_at`, monotonic s: :data:`~sparkguard.blackbox.IDLE_INTERVAL` after an idle
        record, :data:`~sparkguard.blackbox.INTERVAL` after another); near it the next is due at
        :attr:`next_full_at` (always ``INTERVAL`` later).  The record is handed to the writer thread,
        which writes it (no file I/O here); one that is not idle also starts its flushes.

        Args:
            now: monotonic s of the read; buf, n: the /proc/meminfo text the loop just read and its
                length; avail: MemAvailable parsed from it (bytes);
                use_swap: the guard's signal includes SwapFree; state: the policy state; idle:
                memory is far above the line (state OK, MemAvailable at least the idle fast
                path's floor);
                target_mem: the target tree's memory in bytes, -1 unknown.
        Never raises: a failure is counted in :attr:`dropped` and logged once per streak.
        """
        self.next_full_at = now + blackbox.INTERVAL
        self.next_at = now + blackbox.IDLE_INTERVAL if idle else self.next_full_at
        try:
            free = _quick(buf, _MEMFREE, n)
            swap = _quick(buf, _SWAPFREE, n)
            self._seq += 1
            if not idle or now >= self._slow_at:
                self._slow_at = now + SLOW_EVERY
                self._some, self._full = self._psi()
                if now >= self._zram_list_at:
                    self._relist_zram(now)
                self._zram_used = self._zram()
            blackbox.pack_record(self._buf, self._seq, time.time(), now, self._boot,
                                 avail + max(swap, 0) if use_swap else avail, avail, free, swap, self._zram_used,
                                 target_mem, self._some, self._full, blackbox.state_code(state), idle)
            self._near = not idle           # before the hand-over: the writer's flush schedule reads it
            pending = self._pending
            if len(pending) == blackbox.SLOTS:
                self.dropped += 1           # the writer is stuck: the oldest record goes
            pending.append((blackbox.offset(self._seq), bytes(self._buf)))
            if not self._wake.is_set():
                self._wake.set()
            self._failing = False
        except Exception as e:  # noqa: BLE001 - the black box must never cost the guard its loop
            self.dropped += 1
            if not self._failing:           # logged once per streak
                self._failing = True
                log.error("black box %s: making a sample failed (%s)", self.path, e)
        return self.next_at

    def _psi(self) -> tuple[float, float]:
        """PSI memory some/full avg10 (percent), -1.0 each when unreadable."""
        fd = self._psi_fd
        if fd is None:
            return -1.0, -1.0
        try:
            n = os.preadv(fd, [self._psi_buf], 0)
        except OSError:
            return -1.0, -1.0
        return _avg10(self._psi_buf, n)

    def _relist_zram(self, now: float) -> None:
        """Open the ``mm_stat`` of the zram devices there now (:func:`_open_zram`) in place of the
        last listing's; the next listing is due :data:`ZRAM_RELIST` s after ``now`` (monotonic s)."""
        self._zram_list_at = now + ZRAM_RELIST
        old, self._zram_fds = self._zram_fds, _open_zram(self._sys_block)
        for fd in old:
            os.close(fd)

    def _zram(self) -> int:
        """RAM used by every zram device (mm_stat's third column, bytes), -1 without zram."""
        if not self._zram_fds:
            return -1
        total = 0
        b = self._mm_buf
        for fd in self._zram_fds:
            try:
                n = os.preadv(fd, [b], 0)
                total += int(b[:n].split()[2])
            except (OSError, ValueError, IndexError):
                continue
        return total

    # ---- the writer thread: records and flushes ------------------------------------------

    def _io_loop(self, fd: int, every: float) -> None:
        """Write each record the loop hands over at its slot; while records are not idle (memory
        near the line), start writeback (:func:`flush`) of what was written every ``every`` s (0:
        never).  Sleeps until the next record, or the next flush while one is due.  Once close()
        is called: writes what is left, then (clean stop) the header with CLEAN set, ``fdatasync``,
        and ends.  An unexpected error is logged once and the thread goes on."""
        failing = flush_failing = broken = False
        flush_at: float | None = None       # monotonic s of the next flush; None while records are idle
        try:
            while True:
                self._wake.wait(None if flush_at is None else max(0.0, flush_at - time.monotonic()))
                self._wake.clear()          # before writing: a record handed over meanwhile wakes it again
                stopping = self._stopped    # read before the drain: every record of the loop precedes it
                try:
                    failing = self._write_pending(fd, failing)
                    if stopping:
                        self._last_step(fd)
                        return
                    if every <= 0:
                        continue
                    now = time.monotonic()
                    if flush_at is None:
                        if self._near:
                            flush_at = now + every
                    elif now >= flush_at:
                        if self._dirty:
                            self._dirty = False
                            try:
                                flush(fd)
                                flush_failing = False
                            except OSError as e:
                                if not flush_failing:
                                    log.warning("black box %s: flushing failed: %s", self.path, e.strerror or e)
                                flush_failing = True
                        flush_at = now + every if self._near else None
                except Exception as e:  # noqa: BLE001 - the writer must outlive any one record
                    if stopping:
                        raise
                    if not broken:
                        broken = True
                        log.exception("black box %s: the writer failed (%s); it goes on", self.path, e)
        finally:
            os.close(fd)

    def _write_pending(self, fd: int, failing: bool) -> bool:
        """``pwrite`` every record handed over, oldest first; a failure is counted in
        :attr:`errors` and logged once per streak.  Returns whether the last write failed."""
        pending = self._pending
        while pending:
            at, record = pending.popleft()
            try:
                os.pwrite(fd, record, at)
            except OSError as e:
                self.errors += 1
                if not failing:
                    failing = True
                    log.error("black box %s: writing a sample failed (%s); trying each new one",
                              self.path, e.strerror or e)
                continue
            self.written += 1
            self._dirty = True              # the next flush takes it
            if failing:
                failing = False
                log.info("black box %s is written again", self.path)
        return failing

    # ---- stop ------------------------------------------------------------------------------

    def _last_step(self, fd: int) -> None:
        """The writer's end (every record written): with a clean stop, the header with CLEAN set
        and the stop time, then ``fdatasync``.  Errors are logged."""
        if not self._clean:
            return
        try:
            os.pwrite(fd, blackbox.encode_header(self._header(True, self._stop_at)), 0)
            os.fdatasync(fd)
        except OSError as e:
            log.error("black box %s: marking the clean stop failed (%s): the next start will report an "
                      "unclean shutdown", self.path, e.strerror or e)

    def close(self, clean: bool = True) -> None:
        """Stop the writer: it writes what it was handed, then with ``clean`` marks the clean stop
        (header CLEAN flag, stop time) and flushes.  Waits at most :data:`CLOSE_WAIT` s for that
        (a disk that does not answer: logged, and the stop goes on without it).  The file is closed
        either way.  Safe to call twice."""
        if self.fd < 0:
            return
        self._clean, self._stop_at = clean, time.time()
        self._stopped = True                # after the two above: the writer reads them once it sees this
        self._wake.set()
        self._thread.join(CLOSE_WAIT)
        if self._thread.is_alive():
            log.error("black box %s: the disk has not taken the last samples%s after %gs: the stop goes "
                      "on without waiting", self.path, " and the clean-stop mark" if clean else "", CLOSE_WAIT)
        for fd in [self._psi_fd, *self._zram_fds]:
            if fd is not None:
                os.close(fd)
        self._psi_fd, self._zram_fds = None, []
        if self._map is not None:
            self._map.close()
            self._map = None
        os.close(self.fd)           # the flock goes with the writer's descriptor, its last (a dup)
        self.fd = -1

    def _header(self, clean: bool, stopped_at: float = 0.0) -> blackbox.Header:
        return blackbox.Header(blackbox.SLOTS, clean, self.boot_id, self.started_at, stopped_at, os.getpid(),
                               blackbox.INTERVAL)


def _sync_file_range():
    """libc's sync_file_range(2) (Linux >= 2.6.17, glibc >= 2.6), or None."""
    try:
        f = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    f.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
    f.restype = ctypes.c_int
    return f


_SFR = _sync_file_range()
_SFR_WRITE = 2      # SYNC_FILE_RANGE_WRITE (linux/fs.h)


def flush(fd: int) -> None:
    """Start writeback of the file's dirty pages now, without waiting for it:
    ``sync_file_range(fd, 0, 0, SYNC_FILE_RANGE_WRITE)`` (sync_file_range(2): "initiate write-out of
    all dirty pages ... not presently under write-out"); ``fdatasync`` where libc lacks it.

    Raises:
        OSError: the call failed (EIO, ENOSPC...).
    """
    if _SFR is None:
        os.fdatasync(fd)
        return
    if _SFR(fd, 0, 0, _SFR_WRITE) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


def target_mem(actions) -> int:
    """The target tree's memory for a record (``guard.act.Actions``): the victim's, else the armed
    target's (bytes, RSS + swap as last read); -1 when unknown."""
    t = actions.target or actions.armed.target
    m = getattr(t, "mem_bytes", 0) if t is not None else 0
    return m if isinstance(m, int) and m > 0 else -1


def open_ring(path: str, boot_id: str, sync_every: float, now: float | None = None,
              psi_path: str = _PSI_PATH, sys_block: str = _SYS_BLOCK
              ) -> tuple[Ring | None, bytes | None, str | None]:
    """Open, lock and read the ring at ``path``, then start this run's ring in it.

    Args:
        path: ``guard.blackbox_file``; its directory is created (0750) if missing.
        boot_id: this boot's id (:func:`sparkguard.sysinfo.boot_id`); sync_every: seconds between
            the writer thread's writeback starts while near the line (0: none); now: unix s of
            this start (default time.time()).
    Returns:
        ``(ring, previous, error)``: this run's :class:`Ring` (None when it could not be had); the
        bytes the previous run left (None: no file, or unreadable), for
        :func:`sparkguard.blackbox.decode`; why there is no ring or no previous content (str), or None.
    """
    now = time.time() if now is None else now
    try:
        os.makedirs(os.path.dirname(path) or ".", mode=0o750, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC,
                     FILE_MODE)
    except OSError as e:
        if e.errno == 40:           # ELOOP: O_NOFOLLOW met a symlink
            return None, None, f"{path} is a symbolic link: left alone (remove it, or set guard.blackbox_file)"
        return None, None, f"cannot open {path}: {e.strerror or e}"
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        return None, None, f"{path} is locked by another process ({e.strerror or e}): another sparkguard uses it"
    try:
        why = _not_ours(path, fd)
        if why is not None:
            os.close(fd)
            return None, None, f"{path} {why}: left alone (move it away, or set guard.blackbox_file)"
        previous = _read_bounded(fd)
        ring_bytes = blackbox.encode_header(blackbox.Header(blackbox.SLOTS, False, boot_id, now, 0.0, os.getpid(),
                                                            blackbox.INTERVAL))
        ring_bytes += bytes(blackbox.SLOTS * blackbox.RECORD_SIZE)
        os.ftruncate(fd, len(ring_bytes))
        os.pwrite(fd, ring_bytes, 0)
        os.fdatasync(fd)
    except OSError as e:
        os.close(fd)
        return None, None, f"cannot write {path}: {e.strerror or e}"
    return Ring(path, fd, boot_id, now, sync_every, psi_path, sys_block), previous or None, None


def _not_ours(path: str, fd: int) -> str | None:
    """Why the open file ``fd`` is not a ring this daemon may overwrite, or None when it is.

    Only a regular file owned by this process's user, with one name (a hard link is another
    file's name too), writable by no other user (:func:`sparkguard.untrusted.read_file`'s checks),
    that is empty (just created), all zeros (a ring whose start was cut short) or starts with the
    ring's magic is overwritten; anything else, a file that starts with zero bytes and holds
    something after them included, is someone else's."""
    st = os.fstat(fd)
    try:
        untrusted.check_stat(path, st, (os.geteuid(),), stat.S_ISREG)
    except untrusted.FileRefused as e:
        return e.why
    if st.st_nlink != 1:
        return f"has {st.st_nlink} names (hard links): another may be someone else's file"
    if st.st_size == 0:
        return None
    if st.st_size > MAX_READ:
        return f"holds {st.st_size} bytes, more than a sparkguard black box"
    head = os.pread(fd, len(blackbox.MAGIC), 0)
    if head == blackbox.MAGIC:
        return None
    if st.st_size <= blackbox.file_size() and not any(_read_bounded(fd)):
        return None
    return "holds something that is not a sparkguard black box"


def _read_bounded(fd: int) -> bytes:
    """The file's bytes from offset 0, at most MAX_READ."""
    size = min(os.fstat(fd).st_size, MAX_READ)
    out = bytearray()
    while len(out) < size:
        chunk = os.pread(fd, size - len(out), len(out))
        if not chunk:
            break
        out += chunk
    return bytes(out)


def _pin(fd: int):
    """A shared mapping of the ring, each page touched once (resident under mlockall's
    MCL_FUTURE|MCL_ONFAULT); None where mapping fails (the ring works without it)."""
    try:
        m = mmap.mmap(fd, blackbox.file_size(), mmap.MAP_SHARED, mmap.PROT_READ)
        for at in range(0, blackbox.file_size(), mmap.PAGESIZE):
            m[at]
        return m
    except (OSError, ValueError):
        return None


def _open_ro(path: str) -> int | None:
    try:
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None


def _open_zram(sys_block: str) -> list[int]:
    """Descriptors of the ``mm_stat`` of every zram device with a disksize at start
    (:func:`sparkguard.sysinfo.read_zram` lists them).
    Source: Documentation/admin-guide/blockdev/zram.rst (mm_stat: mem_used_total is column 3)."""
    fds = [_open_ro(f"{sys_block}/{d['device']}/mm_stat") for d in sysinfo.read_zram(sys_block)]
    return [fd for fd in fds if fd is not None]


def _quick(buf: bytes | bytearray, label: bytes, n: int) -> int:
    """A ``kB`` field of the meminfo text in bytes, read the way :func:`sparkguard.meminfo.quick_available`
    reads MemAvailable (one find, one int); -1 when absent or not a number.  A record is evidence,
    not a decision: a value this misreads costs nothing but that record's field."""
    i = buf.find(label, 0, n)
    if i < 0:
        return -1
    try:
        return int(buf[i + len(label):buf.find(_KB, i, n)]) << 10
    except ValueError:
        return -1


def _avg10(buf: bytearray, n: int) -> tuple[float, float]:
    """``avg10`` of the ``some`` and ``full`` lines of /proc/pressure/memory text (percent), -1.0
    each when absent.  Source: Documentation/accounting/psi.rst ("some avg10=0.00 avg60=...")."""
    out = [-1.0, -1.0]
    i = 0
    for k in (0, 1):
        j = buf.find(_AVG10, i, n)
        if j < 0:
            break
        e = buf.find(b" ", j, n)
        try:
            out[k] = float(buf[j + len(_AVG10):e if e >= 0 else n])
        except ValueError:
            pass
        i = j + 1
    return out[0], out[1]

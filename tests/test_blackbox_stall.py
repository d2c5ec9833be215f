"""The black box on a disk that stops answering: the guard still acts.

The ring's file lives on a filesystem of the test's own (an ext4 image on a loop device, mounted
under the test's tmp_path) that the test freezes with ``fsfreeze``: a ``pwrite`` into the page
cache then waits in the kernel (``sb_start_write``) until the thaw, as it can on a real host in
``balance_dirty_pages`` while dirty pages are over a limit that shrinks with free memory, or
behind a snapshot's freeze.  Needs root, ``losetup``, ``mkfs.ext4`` and ``fsfreeze`` (util-linux,
e2fsprogs: on every Debian and Ubuntu root).  Everything is thawed, unmounted and detached
afterwards.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading
import time

import pytest

from conftest import line_below_now, mem_available
from guardrun import GuardProc
from sparkguard import blackbox
from sparkguard.guard import ring

MiB = 1 << 20
GiB = 1 << 30
BOOT = "0123456789abcdef0123456789abcdef"

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not all(shutil.which(t) for t in ("losetup", "mkfs.ext4", "fsfreeze", "mount")),
    reason="needs root, losetup, mkfs.ext4, fsfreeze")


class FreezableDisk:
    """An ext4 filesystem of 64 MiB on a loop device, mounted at ``path``; :meth:`freeze` makes
    every write into it wait until :meth:`thaw`.  A frozen one also thaws itself after
    :data:`SAFETY_THAW` s (a process of its own session, so that a killed test run leaves no
    frozen filesystem behind)."""

    SAFETY_THAW = 120

    def __init__(self, where):
        self.image = str(where / "disk.img")
        self.path = str(where / "mnt")
        self.frozen = False
        self._lock = threading.Lock()
        self._safety: subprocess.Popen | None = None
        os.mkdir(self.path)
        with open(self.image, "wb") as f:
            f.truncate(64 * MiB)
        subprocess.run(["mkfs.ext4", "-q", "-F", self.image], check=True, timeout=60)
        self.dev = subprocess.run(["losetup", "--find", "--show", self.image], check=True, timeout=30,
                                  capture_output=True, text=True).stdout.strip()
        try:
            subprocess.run(["mount", self.dev, self.path], check=True, timeout=30)
        except BaseException:
            subprocess.run(["losetup", "--detach", self.dev], timeout=30)
            raise

    def freeze(self) -> None:
        with self._lock:
            self._safety = subprocess.Popen(
                ["sh", "-c", f"sleep {self.SAFETY_THAW}; exec fsfreeze --unfreeze '{self.path}'"],
                start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            subprocess.run(["fsfreeze", "--freeze", self.path], check=True, timeout=30)
            self.frozen = True

    def thaw(self) -> None:
        """Thaw if frozen (from any thread; idempotent)."""
        with self._lock:
            if self.frozen:
                subprocess.run(["fsfreeze", "--unfreeze", self.path], timeout=30)
                self.frozen = False
            if self._safety is not None:
                # our own child's session (sh and its sleep): its sleep has not run out
                os.killpg(self._safety.pid, signal.SIGKILL)
                self._safety.wait(10)
                self._safety = None

    def remove(self) -> None:
        """Thaw, unmount (lazily if a descriptor still holds it after 10 s) and detach, each
        attempted whatever the one before did."""
        try:
            self.thaw()
        finally:
            deadline = time.monotonic() + 10
            while subprocess.run(["umount", self.path], timeout=60, capture_output=True).returncode != 0:
                if time.monotonic() > deadline:
                    subprocess.run(["umount", "--lazy", self.path], timeout=60)
                    break
                time.sleep(0.1)
            subprocess.run(["losetup", "--detach", self.dev], timeout=30)   # autoclear once unused


@pytest.fixture
def disk(tmp_path):
    d = FreezableDisk(tmp_path)
    try:
        yield d
    finally:
        d.remove()


def _blocked_tasks(pid: int) -> list[str]:
    """The threads of ``pid`` waiting uninterruptibly (state D), as ``tid:comm`` (the main
    thread, the poll loop's, has tid == pid)."""
    out = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                st = f.read()
        except OSError:
            continue
        comm, rest = st[st.index("(") + 1:st.rindex(")")], st[st.rindex(")") + 2:]
        if rest.startswith("D"):
            out.append(f"{tid}:{comm}")
    return out


def _await(pred, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not (got := pred()):
        assert time.monotonic() < deadline, f"{what} within {timeout}s"
        time.sleep(0.02)
    return got


def test_sample_hands_over_and_returns_while_the_disk_is_frozen_and_the_records_land_after(disk):
    """The poll loop's call never waits on the disk: every sample returns while the filesystem
    is frozen (a watchdog thaws it after 30 s; the test fails if the samples needed it), and the
    records made meanwhile are in the file once it thaws, in order."""
    r, _, err = ring.open_ring(os.path.join(disk.path, "blackbox.ring"), BOOT, 1.0)
    assert err is None
    buf = bytearray(b"MemTotal: 100 kB\nMemFree: 7 kB\nMemAvailable: 9 kB\nSwapFree: 3 kB\n")
    thawed_by_watchdog = threading.Event()

    def watchdog():
        if not done.wait(30):
            thawed_by_watchdog.set()
            disk.thaw()
    done = threading.Event()
    try:
        disk.freeze()
        threading.Thread(target=watchdog, daemon=True).start()
        for i in range(5):
            r.sample(100.0 + i, buf, len(buf), 9216, False, "term_sent", False, 1 << 30)
        done.set()
        assert not thawed_by_watchdog.is_set(), "a sample waited for the frozen disk"
        assert r.written == 0                   # the writer is held by the frozen filesystem
        disk.thaw()
        deadline = time.monotonic() + 20
        while r.written < 5:
            assert time.monotonic() < deadline, f"{r.written} of 5 records written after the thaw"
            time.sleep(0.01)
    finally:
        done.set()
        try:
            disk.thaw()
        finally:
            r.close()
    recs = blackbox.decode(open(os.path.join(disk.path, "blackbox.ring"), "rb").read()).records
    assert [x.mono for x in recs] == [100.0, 101.0, 102.0, 103.0, 104.0]
    assert all(x.state == "term_sent" and x.target_mem == 1 << 30 for x in recs)


def test_the_guard_terms_the_engine_while_its_black_box_disk_is_frozen(disk, engine_factory):
    """A real daemon near its line writes a record a second to a ring on a disk that then
    freezes; once a thread of it is stuck on that disk, memory crosses the line: the engine still
    gets SIGTERM and goes, and after the thaw the ring holds the records of the frozen seconds,
    one a second."""
    if mem_available() < 6 * GiB:
        pytest.skip("not enough MemAvailable for a 1.5 GiB fill on this host right now")
    fe = engine_factory("--fill-rate", "max", "--fill-size", str(GiB + 512 * MiB), "--fill-on-signal")
    path = os.path.join(disk.path, "blackbox.ring")
    line = line_below_now(GiB)              # near: far below the idle floor, a record every second
    g = GuardProc({"guard": {"term_below": line, "grace": "20s", "blackbox_file": path},
                   "targets": {"match": [rf"vllm serve {fe.model}\b"]}})
    try:
        g.wait_ready()
        pids = fe.pids()
        _await(lambda: os.path.getsize(path) > 0, 10, "no ring file")
        disk.freeze()
        frozen_at = time.time()
        stuck = _await(lambda: _blocked_tasks(g.proc.pid), 10, "no thread of the guard waiting on the frozen disk")
        assert not any(t.startswith(f"{g.proc.pid}:") for t in stuck), f"the poll loop waits on the disk: {stuck}"
        fe.start_fill()
        g.notify.wait_for(lambda m: "term_sent" in m.get("STATUS", ""), timeout=30)
        assert fe.wait_gone(pids, timeout=20), "the engine outlived its SIGTERM"
        assert disk.frozen and _blocked_tasks(g.proc.pid), stuck   # it all happened while frozen
        thawed_at = time.time()
        disk.thaw()
        assert g.stop() == 0
    finally:
        try:
            disk.thaw()
        finally:
            g.stop()
    recs = blackbox.decode(open(path, "rb").read())
    assert recs.header.clean
    during = [x.at for x in recs.records if frozen_at <= x.at <= thawed_at]
    assert len(during) >= max(1, int(thawed_at - frozen_at) - 1), (during, frozen_at, thawed_at)

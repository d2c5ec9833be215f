#!/usr/bin/env python3
"""A memory hog that measures the guard acting on it.

It fills anonymous memory (mmap + memset, so pages are really faulted in) at a given
rate or at full speed, in one or more threads, or as a tree of small child processes.
A sampler thread in the root reads /proc/meminfo about every 0.5 ms and reports, on the
report FIFO, when MemAvailable first crossed the line and the lowest MemAvailable seen.
Every process blocks SIGTERM and takes it with ``sigtimedwait`` in a dedicated thread,
so the moment it arrives is stamped with CLOCK_MONOTONIC at once (a Python signal
handler would wait for the main thread to leave a long C call).

Report lines (text, one per event, written with a single write(2) each so that lines of
different processes never interleave)::

    R <pid>                      ready (before the go)
    C <t> <avail>                first sample below --line (t: CLOCK_MONOTONIC seconds)
    M <avail>                    a new lowest MemAvailable (only below the line + 64 MiB)
    T <pid> <t>                  SIGTERM received by process pid
    S <t> <bytes>                a filler stopped at the cap
    X <pid> <t>                  process exits on its own (after SIGTERM)

The writer end closes when the last hog process exits, which the reader sees as EOF.
Safety: filling stops when MemAvailable drops under --cap or --max-bytes are allocated.
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import signal
import sys
import threading
import time

CHUNK = 8 << 20
libc = ctypes.CDLL(None, use_errno=True)
libc.memset.argtypes = (ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t)
mono = time.monotonic


class Out:
    """Line writer on the report FIFO (one write(2) per line: atomic below PIPE_BUF)."""

    def __init__(self, fd: int):
        self.fd = fd

    def __call__(self, *parts) -> None:
        try:
            os.write(self.fd, (" ".join(str(p) for p in parts) + "\n").encode())
        except OSError:
            pass


def mem_available(fd: int, buf=bytearray(8192)) -> int:
    """MemAvailable in bytes, read with pread from an open /proc/meminfo."""
    n = os.preadv(fd, [buf], 0)
    i = buf.find(b"MemAvailable:", 0, n) + 13
    return int(buf[i:buf.find(b"kB", i, n)]) * 1024


def filler(rate: float, max_bytes: int, cap: int, stop: threading.Event, out: Out, keep: list) -> None:
    """Fault in CHUNK-sized anonymous maps until ``stop`` or ``max_bytes``; rate 0 = full speed."""
    t0 = mono()
    done = 0
    mfd = os.open("/proc/meminfo", os.O_RDONLY)
    buf = bytearray(8192)
    while not stop.is_set() and done < max_bytes:
        if mem_available(mfd, buf) < cap:
            break
        m = mmap.mmap(-1, CHUNK, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
        libc.memset(addr, 1, CHUNK)          # releases the GIL: threads fill in parallel
        keep.append(m)
        done += CHUNK
        if rate > 0:
            ahead = t0 + done / rate - mono()
            if ahead > 0:
                time.sleep(ahead)
    out("S", f"{mono():.6f}", done)


def term_waiter(out: Out, ignore: bool, on_term) -> None:
    """Stamp SIGTERM the moment it is delivered; exit unless ``ignore``."""
    while True:
        info = signal.sigwaitinfo({signal.SIGTERM})
        t = mono()
        out("T", os.getpid(), f"{t:.6f}")
        if not ignore:
            on_term()


def sampler(args, out: Out, stop: threading.Event) -> None:
    """Watch MemAvailable: crossing, lowest value, cap."""
    fd = os.open("/proc/meminfo", os.O_RDONLY)
    crossed = False
    low = 1 << 62
    report_below = args.line + (64 << 20)
    while True:
        a = mem_available(fd)
        if a < low:
            low = a
            if a < report_below:
                out("M", a)
        if not crossed and a < args.line:
            crossed = True
            out("C", f"{mono():.6f}", a)
        if a < args.cap and not stop.is_set():
            stop.set()
        time.sleep(0.0005)


def child_main(args, out: Out, rate: float, max_bytes: int) -> None:
    """One process of the tree: a filler thread and a TERM waiter; never returns."""
    stop = threading.Event()
    keep: list = []
    threading.Thread(target=filler, args=(rate, max_bytes, args.cap, stop, out, keep), daemon=True).start()

    def die():
        out("X", os.getpid(), f"{mono():.6f}")
        os._exit(0)
    term_waiter(out, args.ignore_term, die)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tag", required=True, help="unique word in the cmdline (the guards match it)")
    ap.add_argument("--report", required=True, help="FIFO to write events to")
    ap.add_argument("--go", help="FIFO to read one byte from before filling")
    ap.add_argument("--line", type=int, required=True, help="the guards' SIGTERM line, bytes of MemAvailable")
    ap.add_argument("--cap", type=int, required=True, help="stop filling below this MemAvailable, bytes")
    ap.add_argument("--max-bytes", type=int, required=True, help="never allocate more than this in total")
    ap.add_argument("--rate", type=float, default=0, help="total bytes/s (0: full speed)")
    ap.add_argument("--threads", type=int, default=1, help="filler threads (single process)")
    ap.add_argument("--procs", type=int, default=0, help="tree mode: this many child processes fill")
    ap.add_argument("--ignore-term", action="store_true", help="stamp SIGTERM but keep going")
    args = ap.parse_args()

    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    out = Out(os.open(args.report, os.O_WRONLY))
    out("R", os.getpid())
    if args.go:
        with open(args.go, "rb") as g:
            g.read(1)
    n = args.procs or args.threads
    rate = args.rate / n if args.rate else 0.0
    each = args.max_bytes // n
    stop = threading.Event()
    if args.procs:
        kids = []
        for _ in range(args.procs):
            pid = os.fork()
            if pid == 0:
                try:
                    child_main(args, out, rate, each)
                finally:
                    os._exit(1)
            kids.append(pid)
        threading.Thread(target=sampler, args=(args, out, stop), daemon=True).start()

        def forward():
            for k in kids:
                try:
                    os.kill(k, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        threading.Thread(target=term_waiter, args=(out, args.ignore_term, forward), daemon=True).start()
        for _ in kids:
            try:
                os.wait()
            except ChildProcessError:
                break
        out("X", os.getpid(), f"{mono():.6f}")
        return 0
    keep: list = []
    threading.Thread(target=sampler, args=(args, out, stop), daemon=True).start()

    def die():
        out("X", os.getpid(), f"{mono():.6f}")
        os._exit(0)
    threading.Thread(target=term_waiter, args=(out, args.ignore_term, die), daemon=True).start()
    fills = [threading.Thread(target=filler, args=(rate, each, args.cap, stop, out, keep), daemon=True) for _ in range(n)]
    for t in fills:
        t.start()
    while True:          # hold the memory until killed
        time.sleep(3600)


if __name__ == "__main__":
    sys.exit(main())

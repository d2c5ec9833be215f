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
    P <t> <bytes>                ``--step``: the one allocation is in place (t: after it returned)
    L <t> <bytes>                ``--load-bytes``: the load is done (the port listens from now on)

Two shapes beside the steady fill:

* ``--step N``: one allocation of N bytes at once, as a GPU driver's allocation is: a single
  ``mmap(MAP_POPULATE)`` that the kernel faults in completely before it returns (mmap(2)), so no
  sample of MemAvailable can see it half done from user space.  Then the hog holds it.
* ``--load-bytes N --load-rate R --leak-rate r``: a load then a serving leak.  N bytes at R bytes/s
  (a steep fall by design: FIELD-NOTES "How GB10 reports memory", 17-19 GiB in 10 s after weights
  load), then, with ``--port``, the port listens and answers every request 200 (vLLM's port
  listens only once the engine is ready, FIELD-NOTES "vLLM"), then r bytes/s until the cap.

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
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
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


def step(nbytes: int, out: Out, keep: list) -> None:
    """One allocation of ``nbytes``: ``mmap(MAP_POPULATE)`` faults every page in before it returns.
    A writable private mapping is populated with write faults (mm/gup.c populate_vma_page_range:
    "touch writable mappings with a write fault in order to break COW"), so these are real pages,
    not the shared zero page."""
    # libc's mmap through ctypes, which releases the GIL for the call: Python's mmap.mmap holds it
    # through the whole populate (seconds for a few GiB), starving this process's 0.5 ms sampler
    addr = libc.mmap(None, nbytes, mmap.PROT_READ | mmap.PROT_WRITE,
                     mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE, -1, 0)
    if addr in (None, ctypes.c_void_p(-1).value):
        out("P", f"{mono():.6f}", 0)
        return
    out("P", f"{mono():.6f}", nbytes)
    keep.append(addr)


def serve_health(sock) -> None:
    """Answer every HTTP request on the listening ``sock`` with 200 and an empty body (as vLLM's
    /health once serving); one connection at a time."""
    while True:
        try:
            c, _ = sock.accept()
        except OSError:
            return
        try:
            c.settimeout(2.0)
            c.recv(4096)
            c.sendall(b"HTTP/1.0 200 OK\r\nContent-Length: 0\r\n\r\n")
        except OSError:
            pass
        finally:
            c.close()


def load_then_serve(args, out: Out, stop: threading.Event, keep: list) -> None:
    """``--load-bytes`` at ``--load-rate``, the port listens, then ``--leak-rate`` until the cap."""
    import socket
    sock = None
    if args.port:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", args.port))         # bound now, listening only once loaded
    filler(args.load_rate, args.load_bytes, args.cap, stop, Out(-1), keep)
    out("L", f"{mono():.6f}", args.load_bytes)
    if sock is not None:
        sock.listen(16)
        threading.Thread(target=serve_health, args=(sock,), daemon=True).start()
    filler(args.leak_rate, args.max_bytes - args.load_bytes, args.cap, stop, out, keep)


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
    ap.add_argument("--step", type=int, default=0, help="one allocation of this many bytes at once (MAP_POPULATE)")
    ap.add_argument("--load-bytes", type=int, default=0, help="load-then-serve: bytes of the load")
    ap.add_argument("--load-rate", type=float, default=0, help="bytes/s of the load (0: full speed)")
    ap.add_argument("--leak-rate", type=float, default=0, help="bytes/s of the serving leak after the load")
    ap.add_argument("--port", type=int, default=0, help="load-then-serve: listen on 127.0.0.1:PORT once loaded")
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
    if args.step:
        fills = [threading.Thread(target=step, args=(min(args.step, args.max_bytes), out, keep), daemon=True)]
    elif args.load_bytes:
        fills = [threading.Thread(target=load_then_serve, args=(args, out, stop, keep), daemon=True)]
    else:
        fills = [threading.Thread(target=filler, args=(rate, each, args.cap, stop, out, keep), daemon=True)
                 for _ in range(n)]
    for t in fills:
        t.start()
    while True:          # hold the memory until killed
        time.sleep(3600)


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Idle CPU of the idle fast path's check written as a Python loop and as a chain of C-level
iterators (issue 12's idle CPU; results: bench/results/idle-parse.txt section 6).

    python3 bench/idle_chain.py SECONDS COPIES [VARIANT ...]

Starts COPIES processes of each variant side by side (each ``python3 bench/idle_chain.py --loop
VARIANT LINE``), waits 3 s, measures SECONDS of CPU from /proc/PID/task/*/schedstat (on-CPU
nanoseconds, proc(5)) and prints each variant's median CPU microseconds per wake-up (5 a
second) beside the read-only loop's.  The line is 8 GiB under MemAvailable at start, never
crossed.  Every process it starts is its own child and is SIGKILLed at the end.

    read           bench/headtohead.py's floor_python (FLOOR_PY): preadv /proc/meminfo, poll(200)
    check          its floor_python_check (FLOOR_PY_CHECK): + find MemAvailable, int() it, compare
    pyfast         sparkguard's fast path as a Python loop as it was then (a slice of the line
                   compared with the floor's bytes, the counter, the value, monotonic(), the
                   ping check; meminfo.fast_check replaced it)
    chain_min2     read, copy the line, compare it with two bounds, sleep: all C-level
                   iterators driven by collections.deque.extend, no line of Python per poll
    chain          chain_min2 + the bookkeeping as C calls (setattr through functools.partial,
                   itertools.count, a flag check, monotonic() against a due time)
    deque          chain_min2 + a poll counter from range(), the flag check, a deque of one
                   keeping (count, line) for other threads
    deque_noflags  deque without the flag check
    deque_re       deque with a regular expression (value >= floor) as the check
Not a product: none of these loops pings a watchdog or takes a full pass.
"""
import os
import statistics
import subprocess
import sys
import time

#: the variants, run as a module's top-level code (as bench/headtohead.py runs its floor loops):
#: argv is VARIANT LINE (bytes of MemAvailable the check compares with)
LOOPS = r'''import os, select, sys, time
from collections import deque
from functools import partial
from itertools import count, repeat, starmap, takewhile
from operator import itemgetter, not_

variant, line = sys.argv[1], int(sys.argv[2])
fd = os.open("/proc/meminfo", os.O_RDONLY)
buf = bytearray(8192)
view = [buf]
poll = select.poll().poll
n = os.preadv(fd, view, 0)
off = buf.find(b"\nMemAvailable:") + 1
LABEL = b"MemAvailable:   "
SPAN = len(LABEL) + 12
kb = -(-line // 1024)
pattern = (b"%8d kB\n" % kb)[:12]
lo, hi = LABEL + pattern, LABEL + b"99999999 kB\n"
print("ready", flush=True)

class G:
    fast_polls = 0
    fast_raw = None
g = G()
flags = set()

def above(buf, n, off, width, pattern):
    if n < off + SPAN or not buf.startswith(LABEL, off):
        return None
    raw = buf[off + 16:off + SPAN]
    c = raw[width]
    if c == 32:
        return raw if raw >= pattern else None
    return raw if 48 <= c <= 57 else None

if variant == "pyfast":
    preadv, clock = os.preadv, time.monotonic
    due_at = clock() + 10.0
    while True:
        left = 50
        while left:
            n = preadv(fd, view, 0)
            raw = above(buf, n, off, 8, pattern)
            if raw is None or flags:
                sys.exit("below")
            g.fast_polls += 1
            g.fast_raw = raw
            left -= 1
            if clock() >= due_at:
                due_at = clock() + 10.0
            poll(200.0)

mv = memoryview(buf)[off:off + SPAN]
if variant == "chain_min":
    while True:
        deque(zip(takewhile(lo.__le__, map(bytes, zip(starmap(os.preadv, repeat((fd, view, 0))), repeat(mv)) and repeat(mv))),
                  starmap(poll, repeat((200.0,)))), maxlen=0)
        sys.exit("chain ended")
if variant == "chain_min2":
    # read, copy, two compares, sleep
    reads = takewhile((off + SPAN).__le__, starmap(os.preadv, repeat((fd, view, 0))))
    while True:
        raws = map(bytes, map(itemgetter(1), zip(reads, repeat(mv))))
        deque(zip(takewhile(hi.__ge__, takewhile(lo.__le__, raws)), starmap(poll, repeat((200.0,)))), maxlen=0)
        sys.exit("chain ended")
if variant == "chain":
    clock = time.monotonic
    while True:
        due_at = clock() + 10.0
        reads = takewhile((off + SPAN).__le__, starmap(os.preadv, repeat((fd, view, 0))))
        raws = map(bytes, map(itemgetter(1), zip(reads, repeat(mv))))
        kept = map(partial(setattr, g, "fast_raw"), takewhile(hi.__ge__, takewhile(lo.__le__, raws)))
        counted = map(partial(setattr, g, "fast_polls"), count(g.fast_polls + 1))
        unflagged = takewhile(not_, repeat(flags))
        early = takewhile(due_at.__gt__, starmap(clock, repeat(())))
        sleeps = starmap(poll, repeat((200.0,)))
        deque(zip(range(50), kept, counted, unflagged, early, sleeps), maxlen=0)
        if g.fast_raw is None or flags:
            sys.exit("ended")

# --- second experiment: the full design candidates ---------------------------------------------
import re
def ge_regex(kb):
    """bytes regex: the 8-column field of a value >= kb (kb < 10**8), or any 9+ digit value"""
    s = str(kb); w = len(s)
    alts = [rb"\d{9}"]
    for d in range(w + 1, 9):
        alts.append(b" " * (8 - d) + rb"[1-9]\d{%d}" % (d - 1))
    same = [s.encode()]
    for i in range(w):
        c = int(s[i])
        if c < 9:
            same.append(s[:i].encode() + b"[%d-9]" % (c + 1) + (rb"\d{%d}" % (w - i - 1) if w - i - 1 else b""))
    alts.append(b" " * (8 - w) + b"(?:" + b"|".join(same) + b")")
    return re.compile(LABEL + b"(?:" + b"|".join(alts) + b")")
if variant in ("deque", "deque_noflags", "deque_re"):
    last = deque([(0, None)], maxlen=1)
    reads = takewhile((off + SPAN).__le__, starmap(os.preadv, repeat((fd, view, 0))))
    if variant == "deque_re":
        pat = ge_regex(kb)
        raws = takewhile(bool, starmap(pat.match, repeat((buf, off, off + SPAN))))
        raws = map(itemgetter(1), zip(reads, raws))
    else:
        raws = takewhile(hi.__ge__, takewhile(lo.__le__, map(bytes, map(itemgetter(1), zip(reads, repeat(mv))))))
    sleeps = starmap(poll, repeat((200.0,)))
    while True:
        start = last[-1][0]
        if variant == "deque_noflags":
            last.extend(zip(range(start + 1, start + 51), raws, sleeps))
        else:
            last.extend(zip(range(start + 1, start + 51), raws, takewhile(not_, repeat(flags)), sleeps))
        if last[-1][0] != start + 50:
            sys.exit("ended")
'''


def cpu_ns(pid: int) -> int:
    """On-CPU nanoseconds of every thread of ``pid`` (/proc/PID/task/*/schedstat, proc(5))."""
    ns = 0
    for t in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{t}/schedstat") as f:
            ns += int(f.read().split()[0])
    return ns


def bench(seconds: float, copies: int, variants: list[str]) -> None:
    """COPIES of each variant side by side for ``seconds``; prints the table."""
    with open("/proc/meminfo") as f:
        avail = next(int(x.split()[1]) for x in f if x.startswith("MemAvailable:")) << 10
    line = avail - (8 << 30)
    procs = []
    try:
        for _ in range(copies):
            for v in variants:
                procs.append((v, subprocess.Popen([sys.executable, os.path.abspath(__file__), "--loop", v, str(line)],
                                                  stdout=subprocess.PIPE, text=True)))
        for v, p in procs:
            if p.stdout.readline().strip() != "ready":
                raise SystemExit(f"idle_chain: variant {v} did not start")
        time.sleep(3)
        t0, c0 = time.monotonic(), {p.pid: cpu_ns(p.pid) for _, p in procs}
        time.sleep(seconds)
        t1, c1 = time.monotonic(), {p.pid: cpu_ns(p.pid) for _, p in procs}
        alive = {p.pid: p.poll() is None for _, p in procs}
    finally:
        for _, p in procs:
            p.kill()
            p.wait()
    by: dict[str, list[float]] = {}
    for v, p in procs:
        by.setdefault(v, []).append((c1[p.pid] - c0[p.pid]) / 1e3 / ((t1 - t0) * 5))
    floor = statistics.median(by["read"]) if "read" in by else None
    for v in variants:
        m = statistics.median(by[v])
        print(f"{v:14s} median {m:7.1f} us/wake-up  min {min(by[v]):6.1f} max {max(by[v]):6.1f}  "
              f"/read {m / floor if floor else 0:.3f}  alive {sum(alive[p.pid] for w, p in procs if w == v)}/{copies}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--loop"]:
        variant, line = sys.argv[2:4]
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import headtohead
        floors = {"read": (headtohead.FLOOR_PY, []), "check": (headtohead.FLOOR_PY_CHECK, [line])}
        code, sys.argv = floors[variant] if variant in floors else (LOOPS, [variant, line])
        sys.argv = [__file__, *sys.argv]
        exec(compile(code, "idle_chain:" + variant, "exec"), {"__name__": "__loop__"})
    elif len(sys.argv) < 3:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    else:
        bench(float(sys.argv[1]), int(sys.argv[2]),
              sys.argv[3:] or ["read", "check", "pyfast", "chain_min2", "chain"])

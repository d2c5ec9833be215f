#!/usr/bin/env python3
"""Idle CPU of Python poll loops that differ only in how they check MemAvailable (issue 12).

    python3 bench/idle_parse.py COPIES SECONDS

Starts COPIES processes of each loop (read /proc/meminfo with preadv, check, poll(200)) side by
side, waits SECONDS, and prints each loop's median CPU microseconds per wake-up, from
/proc/PID/schedstat (on-CPU nanoseconds and timeslices, proc(5)), beside the read-only loop's.
The line is 8 GiB under MemAvailable at start: never crossed.  Results: bench/results/idle-parse.txt.
Every process it starts is its own child and is SIGKILLed at the end.
"""
import os, subprocess, sys, time, statistics
N, T = int(sys.argv[1]), float(sys.argv[2])
HEAD = """import os, select, sys
fd = os.open("/proc/meminfo", os.O_RDONLY)
buf = bytearray(8192); view = [buf]
poll = select.poll().poll
line = int(sys.argv[1])
n = os.preadv(fd, view, 0)
off = buf.find(b"MemAvailable:", 0, n)
F8 = b"%8d" % (line >> 10)
class S: pass
self = S(); self.avail = 0; self.fast_polls = 0; self.last_poll = 0.0; self.stopping = False
flags = set()
mono = __import__("time").monotonic
print("ready", flush=True)
"""
V = {
 "read": "while True:\n    os.preadv(fd, view, 0)\n    poll(200)\n",
 "find_int": "while True:\n    n = os.preadv(fd, view, 0)\n    i = buf.find(b'MemAvailable:', 0, n)\n    if int(buf[i + 13:buf.find(b' kB', i, n)]) << 10 < line:\n        print('below', flush=True)\n    poll(200)\n",
 "fixed_cmp": "while True:\n    os.preadv(fd, view, 0)\n    if not buf.startswith(b'MemAvailable:', off) or buf[off + 16:off + 24] < F8:\n        print('below', flush=True)\n    poll(200)\n",
 "fixed_int": "while True:\n    os.preadv(fd, view, 0)\n    if not buf.startswith(b'MemAvailable:', off) or buf[off + 24] != 32 or int(buf[off + 16:off + 24]) << 10 < line:\n        print('below', flush=True)\n    poll(200)\n",
 "fixed_int_book": "ping = 1e18\nwhile True:\n    os.preadv(fd, view, 0)\n    if not buf.startswith(b'MemAvailable:', off) or buf[off + 24] != 32:\n        print('below', flush=True)\n    a = int(buf[off + 16:off + 24]) << 10\n    if a < line or flags or self.stopping:\n        print('below', flush=True)\n    self.fast_polls += 1\n    self.avail = a\n    self.last_poll = now = mono()\n    if now >= ping:\n        pass\n    poll(200)\n",
}
line = 0
with open("/proc/meminfo") as f:
    for l in f:
        if l.startswith("MemAvailable:"):
            line = int(l.split()[1]) * 1024 - 8 * 2**30
procs = []
for name, body in V.items():
    for k in range(N):
        p = subprocess.Popen([sys.executable, "-c", HEAD + body, str(line)], stdout=subprocess.PIPE, text=True)
        procs.append((name, p))
for _, p in procs:
    p.stdout.readline()
def st(p):
    with open(f"/proc/{p.pid}/schedstat") as f:
        a = f.read().split()
    return int(a[0]), int(a[2])
t0 = {p.pid: st(p) for _, p in procs}
time.sleep(T)
res = {}
for name, p in procs:
    ns, sl = st(p)
    ns0, sl0 = t0[p.pid]
    res.setdefault(name, []).append((ns - ns0) / 1000 / max(1, sl - sl0))
for _, p in procs:
    p.kill()
base = statistics.median(res["read"])
for name, v in res.items():
    print(f"{name:16s} median {statistics.median(v):6.1f} us  min {min(v):6.1f} max {max(v):6.1f}  /read {statistics.median(v)/base:.2f}")

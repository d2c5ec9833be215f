#!/usr/bin/env python3
"""How much of a dead process's memory MemAvailable shows at once, and how much waits on the
kernel's per-CPU free lists (sparkguard.pcp).

For each case (processes x bytes each): fork the processes, each pinned to its own CPU, each
holding touched, incompressible anonymous memory; read MemAvailable and the per-CPU lists' pages;
SIGKILL them all (each exits on its own CPU, as TP workers do) and then sample every 100 ms for
``--watch`` seconds.  Reported per case: what came back in MemAvailable at once and after 1, 5
and ``--watch`` s, what MemAvailable plus the lists show at once, the lists' peak and the time
until MemAvailable alone is back within 64 MiB.

Safe on a shared machine: the total held is at most a quarter of MemAvailable (cases that would
need more are scaled down and say so).  Every process is this script's own child.

    python3 bench/pcp_after_exit.py [--watch 15] [--cases 1x1GiB,1x4GiB,4x1GiB] [--zoneinfo-out F]
"""

from __future__ import annotations

import argparse
import mmap
import os
import platform
import signal
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from sparkguard import meminfo, pcp  # noqa: E402
from sparkguard.units import format_size, parse_size  # noqa: E402

GiB, MiB = 1024**3, 1024**2


def avail() -> int:
    return meminfo.read()["MemAvailable"]


def hold(nbytes: int, cpu: int, ready_w: int) -> None:
    """Child: pin to ``cpu``, touch ``nbytes`` of random bytes, say so, sleep until killed."""
    try:
        os.sched_setaffinity(0, {cpu})
    except OSError:
        pass
    block = os.urandom(MiB)
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    for off in range(0, nbytes, MiB):
        m[off:off + MiB] = block[:min(MiB, nbytes - off)]
    os.write(ready_w, b"r")
    while True:
        signal.pause()


def run_case(procs: int, each: int, watch: float, reader: pcp.PcpReader) -> dict:
    cpus = sorted(os.sched_getaffinity(0))
    r, w = os.pipe()
    pids = []
    for i in range(procs):
        pid = os.fork()
        if pid == 0:
            os.close(r)
            try:
                hold(each, cpus[(i + 1) % len(cpus)], w)
            finally:
                os._exit(0)
        pids.append(pid)
    os.close(w)
    got = 0
    deadline = time.monotonic() + 120
    while got < procs and time.monotonic() < deadline:
        got += len(os.read(r, procs))
    os.close(r)
    time.sleep(1.0)                      # let the allocation's own list traffic settle
    a0, p0 = avail(), reader.free_bytes() or 0
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    for pid in pids:
        os.waitpid(pid, 0)
    t0 = time.monotonic()
    with open("/proc/zoneinfo") as f:
        zoneinfo = f.read()             # the lists at their fullest, for --zoneinfo-out
    samples = []
    while True:
        t = time.monotonic() - t0
        samples.append((t, avail() - a0, (reader.free_bytes() or 0) - p0))
        if t >= watch:
            break
        time.sleep(0.1)
    held = procs * each

    def at(s):
        return min(samples, key=lambda x: abs(x[0] - s))

    back_at = next((t for t, da, _ in samples if da >= held - 64 * MiB), None)
    return {"procs": procs, "each": each, "held": held, "now": samples[0], "1s": at(1), "5s": at(5),
            "end": samples[-1], "pcp_peak": max(p for _, _, p in samples), "back_at": back_at,
            "zoneinfo": zoneinfo}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--watch", type=float, default=15.0, help="seconds to watch after the kill (default 15)")
    ap.add_argument("--cases", default="1x1GiB,1x4GiB,4x1GiB", help="PROCSxSIZE,... (default 1x1GiB,1x4GiB,4x1GiB)")
    ap.add_argument("--zoneinfo-out", help="write /proc/zoneinfo as read right after the last case's kill here")
    a = ap.parse_args()
    reader = pcp.PcpReader()
    if reader.free_bytes() is None:
        print(f"cannot read the per-CPU lists: {reader.error}", file=sys.stderr)
        return 1
    print(f"# {platform.node()} {platform.release()} {platform.machine()}, {os.cpu_count()} CPUs, "
          f"MemTotal {format_size(meminfo.read()['MemTotal'])}, vm.stat_interval "
          f"{open('/proc/sys/vm/stat_interval').read().strip()} s")
    highs = [int(ln.split()[1]) for ln in open("/proc/zoneinfo") if ln.strip().startswith("high_max:")]
    if highs:
        print(f"# largest per-CPU high_max: {format_size(max(highs) * reader.page_size)}")
    print("case        held      MemAvailable back: at once   1 s      5 s      end  | +lists at once | "
          "lists peak | MemAvailable back at")
    for spec in a.cases.split(","):
        n, size = spec.split("x")
        procs, each = int(n), parse_size(size)
        cap = avail() // 4
        if procs * each > cap:
            each = cap // procs // MiB * MiB
            print(f"# {spec}: scaled down to {procs}x{format_size(each)} (a quarter of MemAvailable)")
        res = run_case(procs, each, a.watch, reader)
        h = res["held"]

        def pct(x):
            return f"{100 * x / h:6.1f}%"
        now, s1, s5, end = res["now"], res["1s"], res["5s"], res["end"]
        back = f"{res['back_at']:.1f} s" if res["back_at"] is not None else f"> {a.watch:g} s"
        print(f"{spec:10s} {format_size(h):>9s}  {pct(now[1])}  {pct(s1[1])}  {pct(s5[1])}  {pct(end[1])} | "
              f"{pct(now[1] + now[2]):>14s} | {format_size(res['pcp_peak']):>10s} | {back}")
    if a.zoneinfo_out:
        with open(a.zoneinfo_out, "w") as dst:
            dst.write(res["zoneinfo"])
    return 0


if __name__ == "__main__":
    sys.exit(main())

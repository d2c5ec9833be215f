#!/usr/bin/env python3
"""Where an idle sparkguard's CPU goes, part by part (issue 12's idle CPU).

    python3 bench/idle_budget.py [--seconds 120] [--headroom 8] [--source DIR]

Runs ``sparkguard run`` (from ``--source``, default this checkout) in this process with the line
``--headroom`` GiB under MemAvailable (so the loop idles on its fast path), wraps each part of the
idle loop in a thread-CPU clock (``time.thread_time_ns``, CLOCK_THREAD_CPUTIME_ID), and after a
5 s warm-up measures ``--seconds`` of idling.  Prints one row per part: calls, microseconds of
CPU each, and microseconds per wake-up of the loop's thread (the unit bench/headtohead.py's idle
table reports), beside the loop thread's whole CPU per wake-up from its
/proc/PID/task/TID/schedstat (run time and timeslices, proc(5)).

Nested parts are counted in their callers too (``pass`` holds ``arm``, ``ring.sample`` and the
rest).  Each wrapped call adds two reads of the thread's CPU clock (a system call each: the vDSO
does not serve CPU clocks), so a part's figure is an upper bound and the total runs a little
above an unwrapped daemon's.  Not a test: a reading of one machine at one time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
WARMUP = 5.0    # seconds after start-up before the counters are reset: start-up is not idling

#: (module, class or None, function, label): the idle loop's parts, outermost first
PARTS = [
    ("sparkguard.guard.loop", "Guard", "_pass", "pass"),
    ("sparkguard.guard.act", "Actions", "arm", "pass/arm"),
    ("sparkguard.guard.ring", "Ring", "sample", "pass|due/ring.sample"),
    ("sparkguard.meminfo", "MeminfoReader", "sample", "pass/reader.sample"),
    ("sparkguard.meminfo", "MeminfoReader", "fast_check", "budget/fast_check"),
    ("sparkguard.meminfo", "MeminfoReader", "raw", "pass/reader.raw"),
    ("sparkguard.guard.loop", "Guard", "_tick", "pass/tick (STATUS=)"),
    ("sparkguard.guard.loop", "Guard", "_fall_rate", "pass/fall_rate"),
    ("sparkguard.guard.engine", "Engine", "loading", "pass/engine.loading"),
    ("sparkguard.notify", "Notifier", "watchdog", "pass|due/watchdog"),
    ("sparkguard.guard.idle", None, "run", "idle.run (fast path, sleeps included)"),
    ("sparkguard.guard.idle", None, "due", "idle.due"),
    ("sparkguard.guard.idle", None, "next_due", "idle.next_due"),
    ("sparkguard.guard.idle", None, "budget", "idle.budget"),
]


def wrap(acc: dict, owner, name: str, label: str) -> None:
    """Replace ``owner.name`` by a wrapper that adds its thread CPU (ns) and calls to ``acc[label]``."""
    f = getattr(owner, name)
    clock = time.thread_time_ns

    def timed(*a, **k):
        t0 = clock()
        try:
            return f(*a, **k)
        finally:
            c = acc.setdefault(label, [0, 0])
            c[0] += clock() - t0
            c[1] += 1
    setattr(owner, name, timed)


def schedstat(tid: int) -> tuple[int, int]:
    """(run time ns, timeslices) of thread ``tid`` of this process."""
    with open(f"/proc/{os.getpid()}/task/{tid}/schedstat") as f:
        ns, _, runs = f.read().split()
    return int(ns), int(runs)


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) << 10
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=120.0, help="seconds of idling measured")
    ap.add_argument("--headroom", type=float, default=8.0, help="GiB between MemAvailable and the line")
    ap.add_argument("--source", default=ROOT, help="folder holding the sparkguard package to run")
    ap.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    args = ap.parse_args()
    sys.path.insert(0, os.path.abspath(args.source))
    import importlib
    acc: dict[str, list[int]] = {}
    for mod, cls, fn, label in PARTS:
        m = importlib.import_module(mod)
        wrap(acc, getattr(m, cls) if cls else m, fn, label)
    work = tempfile.mkdtemp(prefix="sg-idle-budget-", dir="/var/tmp")
    term = mem_available() - int(args.headroom * (1 << 30))
    if term < 1 << 30:
        sys.exit(f"idle_budget: MemAvailable is under {args.headroom + 1:g} GiB: no room for an idle line")
    conf = os.path.join(work, "sparkguard.yaml")
    with open(conf, "w") as f:
        json.dump({"guard": {"term_below": f"{term >> 20}MiB", "kill_below": f"{(term >> 20) - 1024}MiB"},
                   "targets": {"match": ["sg-idle-budget-matches-nothing"]}, "metrics": {"listen": "off"},
                   "incidents": {"dir": os.path.join(work, "incidents"), "journal": "off"}}, f)
    loop_tid = threading.get_native_id()

    def measure() -> None:
        time.sleep(WARMUP)
        acc.clear()
        ns0, runs0 = schedstat(loop_tid)
        t0 = time.monotonic()
        time.sleep(args.seconds)
        ns1, runs1 = schedstat(loop_tid)
        secs = time.monotonic() - t0
        parts = {k: list(v) for k, v in acc.items()}
        wakes = runs1 - runs0
        rows = [(k, n, ns / 1e3 / max(1, n), ns / 1e3 / max(1, wakes)) for k, (ns, n) in parts.items()]
        print(f"\n{secs:.0f} s idle: loop thread {wakes / secs:.2f} wake-ups/s, "
              f"{(ns1 - ns0) / 1e3 / max(1, wakes):.1f} us CPU per wake-up (schedstat)")
        print("| part | calls | us each | us per wake-up |\n|---|---|---|---|")
        for k, n, each, per in rows:
            print(f"| {k} | {n} | {each:.1f} | {per:.2f} |")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"seconds": secs, "wakeups": wakes, "cpu_ns": ns1 - ns0, "parts": parts}, f)
        sys.stdout.flush()
        os._exit(0)

    threading.Thread(target=measure, daemon=True).start()
    from sparkguard.cli import main as sg_main
    return sg_main(["run", "--config", conf])


if __name__ == "__main__":
    sys.exit(main())

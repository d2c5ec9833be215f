#!/usr/bin/env python3
"""Build copies of this checkout whose idle fast path leaves out one part each (issue 12's idle CPU).

    python3 bench/idle_variants.py [--no-nvml] DIR [REV]
    python3 bench/headtohead.py --idle-only --only sparkguard --idle-copies 8 --idle-seconds 120 \\
        --baseline DIR/before --baseline DIR/fastfloor --baseline DIR/lean --baseline DIR/noring ...

Each variant is DIR/<name>/sparkguard, a copy of ./sparkguard with ``guard.idle.run``'s loop (or one
constant) replaced; headtohead runs each beside this checkout and the floor loops and reports CPU
microseconds per wake-up.  The first ``--baseline`` is reported as ``sparkguard@base``.  Not a
product: fastfloor drops the watchdog ping from the fast path.
``--no-nvml``: every variant also runs without the NVML thread (sparkguard/gpumem.py), as on a
host without nvidia-ml-py, so that a GPU machine that has it measures the loop alone.

    now          an unchanged copy (the run's own noise between identical guards)
    before       ./sparkguard as of git revision REV (default HEAD), to compare a change side by side
    fastfloor    the fast path is the read-only floor: a preadv of the whole of /proc/meminfo, sleep
                 (no check at all)
    lean         the fast path without its per-poll count (guard.fast_polls)
    window       the free-memory check off (sparkguard/freepages.py): the window check at every poll
    noring       the whole daemon without the black box
    full30       a full pass every 30 s instead of every 10 s (settings.FULL_PASS_EVERY)
    fastfloor30  fastfloor with a full pass every 30 s
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
HEAD = "    try:\n        check = g._fast\n"
END = "def next_due("

BODIES = {
    "fastfloor": "    fd, view = g.reader.fd, [bytearray(16384)]\n"
                 "    while left:\n        os.preadv(fd, view, 0)\n        left -= 1\n        sleep(ms)\n\n",
}
#: variants that are another one with a full pass every 30 s (settings.FULL_PASS_EVERY)
EVERY30 = {"fastfloor30": "fastfloor"}
#: the per-poll line the ``lean`` variant drops
LEAN_DROP = "            g.fast_polls += 1\n"
#: where the ``window`` variant turns the free-memory check off (guard/loop.py)
WINDOW_AT = "self.free = freepages.FreeFloor(meminfo_path)"
#: gpumem.available()'s test for nvidia-ml-py (``--no-nvml`` makes it False)
NVML_CHECK = 'return importlib.util.find_spec("pynvml") is not None'


def build(out: str, rev: str = "HEAD", nvml: bool = True) -> list[str]:
    """Write every variant under ``out`` (``before`` from git revision ``rev``; without the NVML
    thread unless ``nvml``); returns their folder names."""
    names = ["now", "before", *BODIES, "lean", "window", "noring", "full30", *EVERY30]
    for name in names:
        dst = os.path.join(out, name)
        shutil.rmtree(dst, ignore_errors=True)
        if name == "before":
            os.makedirs(dst)
            tar = subprocess.run(["git", "-C", ROOT, "archive", rev, "sparkguard"], check=True,
                                 capture_output=True).stdout
            subprocess.run(["tar", "-x", "-C", dst], input=tar, check=True)
        else:
            shutil.copytree(os.path.join(ROOT, "sparkguard"), os.path.join(dst, "sparkguard"),
                            ignore=shutil.ignore_patterns("__pycache__"))
        body = BODIES.get(EVERY30.get(name, name))
        if body is not None or name == "lean":
            p = os.path.join(dst, "sparkguard", "guard", "idle.py")
            s = open(p).read()
            if name == "lean":
                assert LEAN_DROP in s
                s = s.replace(LEAN_DROP, "")
            else:
                a, b = s.index(HEAD), s.index(END)
                s = s[:a] + body + s[b:]
            open(p, "w").write(s)
        elif name == "window":
            p = os.path.join(dst, "sparkguard", "guard", "loop.py")
            s = open(p).read()
            assert WINDOW_AT in s
            open(p, "w").write(s.replace(WINDOW_AT, WINDOW_AT + "\n        self.free.off = 'the window variant'", 1))
        elif name == "noring":
            p = os.path.join(dst, "sparkguard", "guard", "startup.py")
            s = open(p).read()
            i = s.index("def open_blackbox(")
            j = s.index('"""', s.index('"""', i) + 3) + 3
            open(p, "w").write(s[:j] + "\n    return None\n" + s[j:])
        if name == "full30" or name in EVERY30:
            p = os.path.join(dst, "sparkguard", "guard", "settings.py")
            s = open(p).read()
            assert "FULL_PASS_EVERY = 10.0" in s
            open(p, "w").write(s.replace("FULL_PASS_EVERY = 10.0", "FULL_PASS_EVERY = 30.0"))
        if not nvml:
            p = os.path.join(dst, "sparkguard", "gpumem.py")
            s = open(p).read()
            assert NVML_CHECK in s
            open(p, "w").write(s.replace(NVML_CHECK, "return False", 1))
    return names


if __name__ == "__main__":
    args = sys.argv[1:]
    nvml = "--no-nvml" not in args
    args = [a for a in args if a != "--no-nvml"]
    if len(args) not in (1, 2):
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    print(" ".join(build(*args, nvml=nvml)))

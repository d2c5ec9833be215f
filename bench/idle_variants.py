#!/usr/bin/env python3
"""Build copies of this checkout whose idle fast path leaves out one part each (issue 12's idle CPU).

    python3 bench/idle_variants.py [--no-nvml] DIR [REV]
    python3 bench/headtohead.py --idle-only --only sparkguard --idle-copies 8 --idle-seconds 120 \\
        --baseline DIR/before --baseline DIR/fastfloor --baseline DIR/lean --baseline DIR/noring ...

Each variant is DIR/<name>/sparkguard, a copy of ./sparkguard with ``guard.idle.run``'s loop (or one
constant) replaced; headtohead runs each beside this checkout and the floor loops and reports CPU
microseconds per wake-up.  The first ``--baseline`` is reported as ``sparkguard@base``.  Not a
product: the variants drop the watchdog ping and the black box's records from the fast path.
``--no-nvml``: every variant also runs without the NVML thread (sparkguard/gpumem.py), as on a
host without nvidia-ml-py, so that a GPU machine that has it measures the loop alone.

    now        an unchanged copy (the run's own noise between identical guards)
    before     ./sparkguard as of git revision REV (default HEAD), to compare a change side by side
    fastfloor  the fast path is the read-only floor: preadv, sleep (no check at all)
    lean       the fast path without its two per-poll writes (the poll counter, the raw value)
    inline     the fast path with meminfo.fast_above's compare written out in the loop (no call)
    oneline    the least a check can be: the read's length, one slice compared with the floor's
               bytes (right only where value and floor have the same width), the flags; nothing
               counted or kept
    noring     the whole daemon without the black box
    full30     a full pass every 30 s instead of every 10 s (settings.FULL_PASS_EVERY)
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
HEAD = "    try:\n        due_at = next_due("
END = "def next_due("

BODIES = {
    "oneline": "    end, vat = at + meminfo.FAST_SPAN, at + meminfo._FAST_VALUE\n"
               "    while left:\n"
               "        if preadv(fd, view, 0) < end or buf[vat:end] < pattern or flags:\n"
               "            return\n"
               "        left -= 1\n        sleep(ms)\n\n",
    "fastfloor": "    while left:\n        preadv(fd, view, 0)\n        left -= 1\n        sleep(ms)\n\n",
}
#: the ``inline`` variant: the call of meminfo.fast_above and its test, and what replaces them
INLINE_CALL = """            raw = above(buf, n, at, width, pattern)
            if raw is None or flags:
                return
"""
INLINE_BODY = """            if n < end or not buf.startswith(label, at) or flags:
                return
            raw = buf[vat:end]
            c = raw[width]
            if c == 32:
                if raw < pattern:
                    return
            elif not 48 <= c <= 57:
                return
"""
INLINE_SETUP = "    label, end, vat = meminfo.FAST_LABEL, at + meminfo.FAST_SPAN, at + meminfo._FAST_VALUE\n" + HEAD
#: gpumem.available()'s test for nvidia-ml-py (``--no-nvml`` makes it False)
NVML_CHECK = 'return importlib.util.find_spec("pynvml") is not None'
#: per-poll lines the ``lean`` variant drops
LEAN_DROP = ("            g.fast_polls += 1\n", "            g.fast_raw = raw\n")


def build(out: str, rev: str = "HEAD", nvml: bool = True) -> list[str]:
    """Write every variant under ``out`` (``before`` from git revision ``rev``; without the NVML
    thread unless ``nvml``); returns their folder names."""
    names = ["now", "before", *BODIES, "lean", "inline", "noring", "full30"]
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
        if name in BODIES or name in ("lean", "inline"):
            p = os.path.join(dst, "sparkguard", "guard", "idle.py")
            s = open(p).read()
            if name == "inline":
                assert INLINE_CALL in s and HEAD in s
                s = s.replace(INLINE_CALL, INLINE_BODY, 1).replace(HEAD, INLINE_SETUP, 1)
            elif name == "lean":
                for line in LEAN_DROP:
                    assert line in s, line
                    s = s.replace(line, "", 1)
            else:
                a, b = s.index(HEAD), s.index(END)
                s = s[:a] + BODIES[name] + s[b:]
            open(p, "w").write(s)
        elif name == "noring":
            p = os.path.join(dst, "sparkguard", "guard", "startup.py")
            s = open(p).read()
            i = s.index("def open_blackbox(")
            j = s.index('"""', s.index('"""', i) + 3) + 3
            open(p, "w").write(s[:j] + "\n    return None\n" + s[j:])
        elif name == "full30":
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

#!/usr/bin/env python3
"""Build copies of this checkout whose idle fast path leaves out one part each (issue 12's idle CPU).

    python3 bench/idle_variants.py DIR
    python3 bench/headtohead.py --idle-only --only sparkguard --idle-copies 8 --idle-seconds 120 \\
        --baseline DIR/now --baseline DIR/fastfloor --baseline DIR/f3 --baseline DIR/inline --baseline DIR/nobook

Each variant is DIR/<name>/sparkguard, a copy of ./sparkguard with ``Guard._idle``'s loop (or one
constant) replaced; headtohead runs each beside this checkout and the floor loops and reports CPU
microseconds per wake-up.  The first ``--baseline`` is reported as ``sparkguard@base``, so pass
``now`` (an unchanged copy: the run's own noise between identical guards) first.  Not a product:
the variants drop the watchdog ping and the black box's records from the fast path.

    now        an unchanged copy
    fastfloor  the fast path is the read-only floor: preadv, sleep (no check at all)
    f1         + the try/except around the read
    f2         + the check of the signal flags and ``stopping``
    f3         + the MemAvailable label check at the known offset
    inline     + the byte compare with the floor, inline (no function call, no bookkeeping)
    nobook     the compare through meminfo.fast_above, no bookkeeping (counter, value, monotonic(),
               ping and black-box checks)
    noring     the whole daemon without the black box
    full30     a full pass every 30 s instead of every 10 s (settings.FULL_PASS_EVERY)
"""

from __future__ import annotations

import os
import shutil
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
HEAD = "        try:\n            while left:"
END = "    def _fast_budget"

_READ = """            try:
                {n}preadv(fd, view, 0)
            except OSError:
                return
"""
_LOOP = "        while left:\n"
_TAIL = "            left -= 1\n            sleep(ms)\n\n"


def _body(setup: str = "", check: str = "", n: str = "") -> str:
    """The loop: ``setup`` lines before it, the read, ``check`` lines after the read, the sleep."""
    return setup + _LOOP + _READ.format(n=n) + check + _TAIL


BODIES = {
    "fastfloor": _LOOP + "            preadv(fd, view, 0)\n" + _TAIL,
    "f1": _body(),
    "f2": _body(check="            if flags or self.stopping:\n                return\n"),
    "f3": _body("        label = meminfo.FAST_LABEL\n",
                "            if not buf.startswith(label, at) or flags or self.stopping:\n                return\n"),
    "inline": _body("        label, end = meminfo.FAST_LABEL, at + meminfo.FAST_SPAN\n"
                    "        vat = at + meminfo._FAST_VALUE\n"
                    "        wat, pend = vat + width, vat + len(pattern)\n",
                    "            if n < end or not buf.startswith(label, at) or flags or self.stopping:\n"
                    "                return\n"
                    "            c = buf[wat]\n"
                    "            if c == 32:\n"
                    "                if buf[vat:pend] < pattern:\n"
                    "                    return\n"
                    "            elif not 48 <= c <= 57:\n"
                    "                return\n", n="n = "),
    "nobook": _body(check="            raw = above(buf, n, at, width, pattern)\n"
                          "            if raw is None or flags or self.stopping:\n                return\n", n="n = "),
}


def build(out: str) -> list[str]:
    """Write every variant under ``out``; returns their folder names."""
    names = ["now", *BODIES, "noring", "full30"]
    for name in names:
        dst = os.path.join(out, name)
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(os.path.join(ROOT, "sparkguard"), os.path.join(dst, "sparkguard"),
                        ignore=shutil.ignore_patterns("__pycache__"))
        if name in BODIES:
            p = os.path.join(dst, "sparkguard", "guard", "loop.py")
            s = open(p).read()
            a, b = s.index(HEAD), s.index(END)
            open(p, "w").write(s[:a] + BODIES[name] + s[b:])
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
    return names


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    print(" ".join(build(sys.argv[1])))

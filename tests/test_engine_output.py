"""The engine output pump drains a real child's pipes at a bounded line rate."""

from __future__ import annotations

import re
import subprocess
import sys
import time

from sparkguard.supervisor import output

LINES = 300_000


def pump_child(code: str, rate: int) -> tuple[list[tuple[str, bytes]], float]:
    """Run ``python3 -c code`` and pump its pipes at ``rate`` lines/s until it ends:
    ``(lines passed on as (stream, line), seconds it took)``."""
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    got: list[tuple[str, bytes]] = []
    t0 = time.monotonic()
    try:
        output.pump(child.stdout, child.stderr, lambda stream, line: got.append((stream, line)), max_rate=rate)
    finally:
        child.kill()
        child.wait(10)
    return got, time.monotonic() - t0


def test_an_engine_spewing_output_is_drained_and_passed_on_at_a_bounded_rate():
    got, elapsed = pump_child(f"import sys\nfor i in range({LINES}): sys.stdout.write('INFO line %d\\n' % i)\n"
                              "sys.stderr.write('last words\\n')", 1000)
    notes = [int(m.group(1)) for _, ln in got
             if (m := re.match(rb"\[sparkguard: (\d+) lines of engine output dropped", ln))]
    passed = len(got) - len(notes)
    assert passed <= 1000 * (elapsed + 1) + 1
    assert notes, "lines beyond the rate are reported as dropped"
    assert passed + sum(notes) == LINES + 1          # every line passed on or counted
    assert got[0] == ("stdout", b"INFO line 0")


def test_output_without_newlines_is_cut_under_the_same_rate():
    """64 MiB with no newline: cut into MAX_LINE pieces, and those count against the rate too."""
    size = 64 << 20
    got, elapsed = pump_child(f"import sys\nb = b'x' * (1 << 20)\nfor i in range({size >> 20}): sys.stdout.buffer.write(b)\n",
                              100)
    notes = [ln for _, ln in got if ln.startswith(b"[sparkguard:")]
    pieces = len(got) - len(notes)
    assert pieces <= 100 * (elapsed + 1) + 1, (pieces, elapsed)
    assert notes, "pieces beyond the rate are reported as dropped"

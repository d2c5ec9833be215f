"""The engine output pump drains a real child's pipes at a bounded line rate."""

from __future__ import annotations

import re
import subprocess
import sys
import time

from sparkguard.supervisor import output

LINES = 300_000


def test_an_engine_spewing_output_is_drained_and_passed_on_at_a_bounded_rate():
    child = subprocess.Popen([sys.executable, "-c",
                              f"import sys\nfor i in range({LINES}): sys.stdout.write('INFO line %d\\n' % i)\n"
                              "sys.stderr.write('last words\\n')"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    got: list[tuple[str, bytes]] = []
    t0 = time.monotonic()
    try:
        output.pump(child.stdout, child.stderr, lambda stream, line: got.append((stream, line)), max_rate=1000)
    finally:
        child.kill()
        child.wait(10)
    elapsed = time.monotonic() - t0
    notes = [int(m.group(1)) for _, ln in got
             if (m := re.match(rb"\[sparkguard: (\d+) lines of engine output dropped", ln))]
    passed = len(got) - len(notes)
    assert passed <= 1000 * (elapsed + 1) + 1
    assert notes, "lines beyond the rate are reported as dropped"
    assert passed + sum(notes) == LINES + 1          # every line passed on or counted
    assert got[0] == ("stdout", b"INFO line 0")

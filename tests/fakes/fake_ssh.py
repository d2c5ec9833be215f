"""A stand-in for the ``ssh`` client in tests of untrusted answers (tests/test_cluster_untrusted.py):
``fake_ssh.py DIR [-o OPT ...] -- DEST COMMAND`` prints the file ``DIR/DEST`` (what that node
"answers" to every command), appends COMMAND as one line to ``DIR/DEST.cmd`` (what it was asked)
and exits 0.  When ``DIR/DEST.hang`` exists and COMMAND contains its text, it writes its pid to
``DIR/DEST.hung`` and blocks until killed (a node that never answers).  It reaches no host; it checks that the argv has the
shape sparkguard.cluster.ssh.ssh_argv gives it (``--`` right before the destination) and exits
255 with an ``ssh: `` line otherwise, as ssh does for a bad command line (assumption: the exact
message of OpenSSH's usage error is not needed here).
"""

import os
import signal
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    base, rest = Path(argv[1]), argv[2:]
    if "--" not in rest or len(rest) != rest.index("--") + 3:
        print(f"ssh: bad command line: {rest}", file=sys.stderr)
        return 255
    dest, command = rest[rest.index("--") + 1:]
    with open(base / f"{dest}.cmd", "a") as f:
        f.write(command + "\n")
    hang = base / f"{dest}.hang"
    if hang.exists() and hang.read_text().strip() in command:
        tmp = base / f"{dest}.hung.tmp"
        tmp.write_text(str(os.getpid()))
        tmp.rename(base / f"{dest}.hung")           # appears whole
        signal.pause()                              # until killed
    sys.stdout.write((base / dest).read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

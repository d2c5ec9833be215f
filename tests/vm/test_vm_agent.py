"""The VM's test agent on this host, without a VM: its protocol over a raw pseudo-terminal.

The agent (tests/vm/agent.py) reads JSON lines from a character device and answers on it; a pty
in raw mode stands in for the virtio-serial port (both are byte streams to the agent).  Runs in
a second or two; the booted VM test needs the protocol to hold, so it is checked here first.
"""

from __future__ import annotations

import base64
import json
import os
import select
import subprocess
import sys
import time
import tty
from pathlib import Path

import pytest

AGENT = Path(__file__).with_name("agent.py")


@pytest.fixture
def agent():
    """(send, receive): the agent running on a raw pty's slave side; killed afterwards."""
    master, slave = os.openpty()
    tty.setraw(slave)
    path = os.ttyname(slave)
    code = f"import sys; sys.path.insert(0, {str(AGENT.parent)!r}); import agent; agent.Agent({path!r}).serve()"
    p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.DEVNULL)
    buf = b""

    def send(obj: dict) -> None:
        os.write(master, (json.dumps(obj) + "\n").encode())

    def receive(timeout: float = 10) -> dict:
        nonlocal buf
        deadline = time.monotonic() + timeout
        while b"\n" not in buf:
            left = deadline - time.monotonic()
            assert left > 0, f"no line from the agent in {timeout} s (got {buf!r})"
            if select.select([master], [], [], left)[0]:
                buf += os.read(master, 65536)
        line, buf = buf.split(b"\n", 1)
        return json.loads(line)

    try:
        yield send, receive
    finally:
        p.kill()
        p.wait(timeout=10)
        os.close(master)
        os.close(slave)


def test_agent_says_hello_runs_commands_writes_files_and_kills_on_timeout(agent, tmp_path):
    send, receive = agent
    hello = receive()
    assert hello["hello"] == Path("/proc/sys/kernel/random/boot_id").read_text().strip()

    send({"id": 1, "argv": ["sh", "-c", "cat; echo err >&2; exit 3"], "input": "in\n", "timeout": 10})
    assert receive() == {"id": 1, "rc": 3, "stdout": "in\n", "stderr": "err\n"}

    target = tmp_path / "sub" / "f.bin"
    send({"id": 2, "put": str(target), "data": base64.b64encode(b"\x00\xffdata").decode(), "mode": 0o600})
    assert receive()["rc"] == 0
    assert target.read_bytes() == b"\x00\xffdata" and target.stat().st_mode & 0o777 == 0o600

    # a command past its timeout is SIGKILLed with its process group; a second request is not held up
    t0 = time.monotonic()
    send({"id": 3, "argv": ["sh", "-c", "sleep 30 & sleep 30"], "timeout": 0.5})
    send({"id": 4, "argv": ["true"], "timeout": 10})
    answers = {a["id"]: a for a in (receive(), receive())}
    assert answers[4]["rc"] == 0
    assert answers[3]["rc"] == -9 and answers[3]["timeout"] is True
    assert time.monotonic() - t0 < 10

    send({"id": 5, "argv": ["/nonexistent/x"], "timeout": 10})
    a = receive()
    assert a["id"] == 5 and a["rc"] == 127 and "/nonexistent/x" in a["stderr"]

    send({"id": 6, "argv": ["cat", "/proc/self/oom_score_adj"], "timeout": 10})
    assert receive()["stdout"] == "0\n"

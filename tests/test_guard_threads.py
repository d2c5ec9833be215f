"""The guard's kill path stays fast while the daemon's other threads are kept busy by hostile
clients and peers: a real ``sparkguard run`` whose supervisor's peers gate keeps reading a
hostile peer, its metrics endpoint flooded by scraping processes, and a real fake-vLLM tree
filling real memory."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

from conftest import ROOT, line_below_now
from guardrun import GuardProc
from test_guard_incidents import events, filling_engine, wait_incident

GiB = 1024**3

#: a hostile peer in a process of its own: every request gets 8 MiB of valid exposition with the
#: peer's metric last (parsing all of it is seconds of pure Python); it prints "read" per request
sys.path.insert(0, str(ROOT / "bench"))
from threads_load import CLIENT, PEER  # noqa: E402  (CLIENT: a scraping process, a connection per scrape)

#: idle processes the test adds to /proc: a DGX Spark runs several hundred, this VM about 80, and
#: the crossing's /proc scan makes a few system calls for each, each one a hand-over of the lock
EXTRA_PROCS = 250


def wait_reads(peer: subprocess.Popen, n: int, timeout: float) -> None:
    """Wait until the hostile peer has been asked ``n`` times (it prints a line per request)."""
    import select
    import time
    deadline = time.monotonic() + timeout
    seen = 0
    while seen < n:
        left = deadline - time.monotonic()
        assert left > 0, f"the peers gate asked the peer {seen} times in {timeout} s"
        if select.select([peer.stdout], [], [], left)[0]:
            seen += os.read(peer.stdout.fileno(), 4096).count(b"read\n")


def test_sigterm_follows_the_crossing_quickly_while_peers_and_scrapes_keep_other_threads_busy(engine_factory,
                                                                                            tmp_path):
    fe = filling_engine(engine_factory)
    helpers = [subprocess.Popen([sys.executable, "-c", PEER], stdout=subprocess.PIPE, bufsize=0)]
    try:
        helpers += [subprocess.Popen(["sleep", "600"]) for _ in range(EXTRA_PROCS)]
        peer = int(helpers[0].stdout.readline())
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        g = GuardProc({
            "guard": {"term_below": line_below_now(GiB), "grace": "20s"},
            "targets": {"match": [rf"vllm serve {fe.model}\b"]},
            "metrics": {"listen": f"127.0.0.1:{port}"},
            # the supervised engine never starts: its peers gate keeps reading the hostile peer
            "engine": {"command": ["sleep", "600"], "log": "stderr", "drop_caches": False,
                       "start_above": "64MiB", "stable_for": "0s", "quiesce_timeout": "600s",
                       "health_interval": "100ms", "peers": [f"http://127.0.0.1:{peer}"] * 2,
                       "state_file": str(tmp_path / "engine-state.json"),
                       "control_socket": str(tmp_path / "control.sock")},
        })
        try:
            g.wait_ready()
            # the gate has read both peers once and now reads one again: it is busy with that answer
            wait_reads(helpers[0], 3, timeout=60)
            for _ in range(2):
                helpers.append(subprocess.Popen([sys.executable, "-c", CLIENT, str(port)]))
            pids = fe.pids()
            fe.start_fill()
            inc = wait_incident(g, timeout=60)
            assert fe.wait_gone(pids, timeout=10)
            assert events(inc)[:2] == ["crossed", "sigterm"]
            t = inc["timeline"][1]["t"]
            assert t < 0.1, f"SIGTERM {t * 1000:.0f} ms after the crossing"
        finally:
            g.stop()
    finally:
        for p in helpers:
            p.kill()
            p.wait(10)

"""Peers and health reads are bounded: one deadline for the whole request, a cap on the answer.

Each test serves a real hostile HTTP endpoint on a loopback port from a thread of its own.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest

from sparkguard import httpget, peers
from sparkguard.supervisor import health


class Hostile:
    """A loopback HTTP server answering every connection with ``answer(conn)``."""

    def __init__(self, answer):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}/metrics"
        self.answer = answer
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        self.sock.settimeout(0.2)
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except socket.timeout:
                continue
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn):
        with conn:
            try:
                conn.recv(65536)
                self.answer(conn, self.stop)
            except OSError:
                pass

    def close(self):
        self.stop.set()
        self.thread.join(5)
        self.sock.close()


def drip(conn, stop):
    """Headers at once, then the body one byte every 0.2 s (each read sees data: no read times out)."""
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n")
    while not stop.wait(0.2):
        conn.sendall(b"#")


def huge(conn, stop):
    """A valid exposition of 16 MiB with the peer's metric at its very end."""
    filler = b"# HELP x_pad a\n# TYPE x_pad gauge\n" + b"".join(b"x_pad{i=\"%d\"} 1\n" % i for i in range(800_000))
    body = filler + b"sparkguard_memory_available_bytes 123\n"
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: %d\r\n\r\n" % len(body) + body)


@pytest.fixture
def hostile():
    made = []

    def make(answer):
        h = Hostile(answer)
        made.append(h)
        return h

    yield make
    for h in made:
        h.close()


def test_a_dripping_peer_is_given_up_at_the_deadline(hostile):
    h = hostile(drip)
    t0 = time.monotonic()
    with pytest.raises(peers.PeerError, match="within 1 s"):
        peers.read_available(h.url, timeout=1.0)
    assert time.monotonic() - t0 < 1.5


def test_a_huge_peer_answer_is_refused_without_parsing_it(hostile):
    h = hostile(huge)
    t0 = time.monotonic()
    with pytest.raises(peers.PeerError, match="longer than"):
        peers.read_available(h.url, timeout=10.0)
    assert time.monotonic() - t0 < 5.0          # refused at the cap, long before the 10 s deadline


def test_a_dripping_health_endpoint_fails_the_check_at_the_deadline(hostile):
    h = hostile(drip)
    t0 = time.monotonic()
    with pytest.raises(OSError):
        health.http(h.url, timeout=1.0)
    assert time.monotonic() - t0 < 1.5
    t0 = time.monotonic()
    assert health.healthy(h.url, 1.0) is False
    assert time.monotonic() - t0 < 1.5


def test_a_peer_metric_among_many_lines_is_read(hostile):
    def answer(conn, stop):
        body = (b"# HELP a_b x\n# TYPE a_b gauge\na_b 1\n"
                b"# HELP sparkguard_memory_available_bytes MemAvailable.\n"
                b"# TYPE sparkguard_memory_available_bytes gauge\n"
                b"sparkguard_memory_available_bytes 4.2e+10\nz 2\n")
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    h = hostile(answer)
    assert peers.read_available(h.url) == 42_000_000_000
    st = peers.check([h.url], 40 * 10**9)
    assert st[0].ok and st[0].available_bytes == 42_000_000_000


def test_nobody_answering_is_an_oserror():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(OSError):
        httpget.request(f"http://127.0.0.1:{port}/", 2.0, 1024)


def test_a_name_lookup_that_never_answers_ends_at_the_deadline(tmp_path):
    """getaddrinfo takes no timeout: with a DNS server that never answers (a UDP socket of this
    test, named in a resolv.conf bind-mounted in a mount namespace of the child's own) a peer
    given by name fails at the request's deadline, not after resolv.conf's 5 s x attempts."""
    import os
    import shutil
    import subprocess
    import sys
    if os.geteuid() != 0 or not shutil.which("unshare"):
        pytest.skip("needs root and util-linux unshare for a private /etc/resolv.conf")
    # glibc's resolver asks port 53 of the nameserver: a loopback address of the test's own
    dns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        dns.bind(("127.0.0.42", 53))
    except OSError as e:
        dns.close()
        pytest.skip(f"cannot bind a silent DNS server on 127.0.0.42:53: {e}")
    conf = tmp_path / "resolv.conf"
    conf.write_text("nameserver 127.0.0.42\noptions timeout:5 attempts:2\n")
    code = ("import time, sys; from sparkguard import peers\n"
            "t0 = time.monotonic()\n"
            "try:\n    peers.read_available('http://peer-a.sparkguard-test.example:8799/metrics', timeout=1.0)\n"
            "except Exception as e:\n    print(type(e).__name__, e)\n"
            "print('took %.2f' % (time.monotonic() - t0))\n")
    from conftest import sg_env
    try:
        r = subprocess.run(["unshare", "--mount", "sh", "-c", f'mount --bind "{conf}" /etc/resolv.conf && exec "$0" -c "$1"',
                            sys.executable, code], env=sg_env(), capture_output=True, text=True, timeout=30)
    finally:
        dns.close()
    assert r.returncode == 0, r.stderr
    took = float(r.stdout.split("took ")[1])
    assert "PeerError" in r.stdout and took < 2.0, r.stdout

#!/usr/bin/env python3
"""Crossing-to-SIGTERM of a real sparkguard while hostile clients keep its other threads busy.

Run as root from the repository root (not part of the test suite; about a minute per trial set)::

    python3 bench/threads_load.py                        # 5 trials of every mode, this checkout
    python3 bench/threads_load.py --switch-interval 0.005 --switch-interval 0.0005
    python3 bench/threads_load.py --pythonpath /work/main   # another checkout, for before/after

The daemon shares one interpreter lock between its poll loop and its other threads: each
system call of the loop hands the lock over, and a thread busy in Python keeps it for up to
the switch interval (``sys.setswitchinterval``) before the loop gets it back.  Each trial set
runs the modes side by side, one after the other in the same run, each with a fresh daemon
and a fresh hog (``bench/hog.py``, one thread at 0.5 GiB/s, exits at SIGTERM):

* ``quiet``: nothing but the hog;
* ``flood``: --clients processes scrape the metrics endpoint as fast as they can (a new
  connection per scrape, as a hostile local user would);
* ``stall``: the flood, plus 64 connections that send half a request and then nothing (more
  than the endpoint's connection cap);
* ``connect``: --clients processes connect to the metrics port and close at once, as fast as
  they can (~20,000 accepts a second on the GPU machine);
* ``hup``: SIGHUP 50 times a second (a reload storm of a good config);
* ``yaml``: the config replaced by a 600-byte YAML whose aliases multiply (9**9 strings), and
  SIGHUP 10 times a second: every reload is refused, the running config kept;
* ``peer``: the flood, and a supervised engine (``sleep``) whose peers gate keeps reading two
  hostile peers that answer 8 MiB of valid exposition each (the engine never starts, so the
  hog stays the target).

The daemon watches the whole of this host's /proc (no PID namespace: the /proc scan of the
crossing path is as long as this host's, longer with --extra-procs), matches only the hog's unique tag, and has
``targets.fallback: off``: it can signal nothing but the hog.  Per trial: the hog's own
crossing-to-SIGTERM (its 0.5 ms sampler, CLOCK_MONOTONIC) and the guard's (the incident's
``sigterm`` event ``t``, from the poll that saw the crossing), and the scrapes answered.

Memory safety: the line is MemAvailable now minus --headroom; the hog stops filling 2 GiB
under it or after headroom + 2.5 GiB.  Every process started is SIGKILLed at the end.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import select
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOG = os.path.join(ROOT, "bench", "hog.py")
GiB, MiB = 1 << 30, 1 << 20
MODES = ("quiet", "flood", "stall", "peer", "connect", "hup", "yaml")

#: one connect-and-close client: a new connection closed at once, forever (until SIGKILLed)
CONNECT = """
import socket, sys
port = int(sys.argv[1])
while True:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        pass
"""

#: a signal sender: SIGNAL to PID, RATE a second, forever (until SIGKILLed)
SIGNALS = """
import os, sys, time
pid, sig, rate = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
while True:
    os.kill(pid, sig)
    time.sleep(1 / rate)
"""


def alias_bomb(levels: int = 9, width: int = 9) -> str:
    """~600 bytes of YAML whose last anchor stands for width**levels strings, given to guard.grace."""
    lines = [f"l0: &l0 [{', '.join(['lol'] * width)}]"]
    for i in range(1, levels):
        lines.append(f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * width)}]")
    return "\n".join(lines) + f"\nguard:\n  grace: *l{levels - 1}\n"


#: a hostile peer: 8 MiB of valid exposition per request, the peer's metric last
PEER = r"""
import socket
body = (b"# HELP x_pad a\n# TYPE x_pad gauge\n" + b"".join(b'x_pad{i="%d"} 1\n' % i for i in range(420000))
        + b"sparkguard_memory_available_bytes 1\n")
head = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: %d\r\n\r\n" % len(body)
srv = socket.create_server(("127.0.0.1", 0))
print(srv.getsockname()[1], flush=True)
while True:
    conn, _ = srv.accept()
    try:
        conn.recv(65536)
        print("read", flush=True)      # one line per request (tests/test_guard_threads.py waits on it)
        conn.sendall(head + body)
    except OSError:
        pass
    conn.close()
"""

#: one scraping client: new connection per request, forever (until SIGKILLed)
CLIENT = """
import http.client, sys
port = int(sys.argv[1])
n = 0
while True:
    try:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        c.request("GET", "/metrics")
        c.getresponse().read()
        c.close()
        n += 1
    except OSError:
        pass
"""


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape_ok(port: int) -> bool:
    import urllib.request
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def guard_argv(conf: str, switch: float | None) -> list[str]:
    """The daemon's entry point (``cmd_run``), with ``sys.setswitchinterval`` forced when given."""
    code = ("import sys, argparse\nfrom sparkguard import daemon\nfrom sparkguard.guard import harden\n"
            + (f"harden.SWITCH_INTERVAL = {switch!r}\nsys.setswitchinterval({switch!r})\n" if switch else "")
            + "sys.exit(daemon.cmd_run(argparse.Namespace(config=sys.argv[1], dry_run=False, log_level='info')))")
    return [sys.executable, "-c", code, conf]


def trial(mode: str, args, switch: float | None) -> dict:
    work = tempfile.mkdtemp(prefix="sg-threads-")
    tag = "sghog" + uuid.uuid4().hex[:10]
    term = mem_available() - int(args.headroom * GiB)
    port = free_port()
    conf = os.path.join(work, "sparkguard.yaml")
    cfg = {"guard": {"term_below": term, "kill_below": term - GiB, "grace": "5s"},
           "targets": {"match": [tag], "fallback": "off"},
           "metrics": {"listen": f"127.0.0.1:{port}"},
           "incidents": {"dir": os.path.join(work, "incidents"), "journal": "off"}}
    procs: list[subprocess.Popen] = []
    if mode == "peer":
        peer = subprocess.Popen([sys.executable, "-c", PEER], stdout=subprocess.PIPE, text=True)
        procs.append(peer)
        url = f"http://127.0.0.1:{int(peer.stdout.readline())}"
        cfg["engine"] = {"command": ["sleep", "600"], "log": "stderr", "drop_caches": False,
                         "start_above": "64MiB", "stable_for": "0s", "quiesce_timeout": "600s",
                         "health_interval": "100ms", "peers": [url, url],
                         "state_file": os.path.join(work, "engine-state.json"),
                         "control_socket": os.path.join(work, "control.sock")}
    with open(conf, "w") as f:
        json.dump(cfg, f)
    env = dict(os.environ, PYTHONPATH=args.pythonpath or ROOT)
    held: list[socket.socket] = []
    row = {"mode": mode, "switch_interval": switch or sys.getswitchinterval(), "error": ""}
    report, go = os.path.join(work, "report"), os.path.join(work, "go")
    os.mkfifo(report)
    os.mkfifo(go)
    rfd = os.open(report, os.O_RDONLY | os.O_NONBLOCK)
    try:
        log = open(os.path.join(work, "guard.log"), "w")
        guard = subprocess.Popen(guard_argv(conf, switch), env=env, stdout=log, stderr=subprocess.STDOUT)
        procs.append(guard)
        end = time.monotonic() + 20
        while not scrape_ok(port):
            if time.monotonic() > end or guard.poll() is not None:
                row["error"] = "guard did not serve metrics: " + open(log.name).read()[-300:]
                return row
            time.sleep(0.05)
        if mode in ("flood", "stall", "peer"):
            for _ in range(args.clients):
                procs.append(subprocess.Popen([sys.executable, "-c", CLIENT, str(port)]))
        if mode == "connect":
            for _ in range(args.clients):
                procs.append(subprocess.Popen([sys.executable, "-c", CONNECT, str(port)]))
        if mode in ("hup", "yaml"):
            if mode == "yaml":
                with open(conf, "w") as f:
                    f.write(alias_bomb())
            procs.append(subprocess.Popen([sys.executable, "-c", SIGNALS, str(guard.pid), str(int(signal.SIGHUP)),
                                           "50" if mode == "hup" else "10"]))
        if mode == "stall":
            for _ in range(64):
                s = socket.create_connection(("127.0.0.1", port), timeout=5)
                s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
                held.append(s)
        hog = subprocess.Popen([sys.executable, HOG, "--tag", tag, "--report", report, "--go", go, "--line", str(term),
                                "--cap", str(term - 2 * GiB), "--max-bytes", str(int((args.headroom + 2.5) * GiB)),
                                "--rate", str(int(0.5 * GiB))])
        procs.append(hog)
        # the load ramps up, the guard settles, the peers gate is into its reads (one takes the
        # old code 5 s of parsing here); nothing to await from outside the daemon
        time.sleep(3.0 if mode == "peer" else 1.0)
        gfd = os.open(go, os.O_WRONLY)
        os.write(gfd, b"g")
        os.close(gfd)
        buf = b""
        deadline = time.monotonic() + args.trial_timeout
        while time.monotonic() < deadline:
            r, _, _ = select.select([rfd], [], [], 0.05)
            if r:
                chunk = os.read(rfd, 65536)
                if not chunk:
                    break
                buf += chunk
        c = t = None
        for line in buf.decode(errors="replace").splitlines():
            p = line.split()
            if p and p[0] == "C" and c is None:
                c = float(p[1])
            elif p and p[0] == "T" and t is None:
                t = float(p[2])
        row["hog_ms"] = round((t - c) * 1000, 2) if c and t else None
        t_scrape = time.monotonic()
        row["scrape_ok"] = scrape_ok(port)
        row["scrape_ms"] = round((time.monotonic() - t_scrape) * 1000, 1)
        inc_end = time.monotonic() + 15
        while time.monotonic() < inc_end and not glob.glob(os.path.join(work, "incidents", "*.json")):
            time.sleep(0.1)
        for path in glob.glob(os.path.join(work, "incidents", "*.json")):
            with open(path) as f:
                tl = json.load(f)["timeline"]
            row["guard_ms"] = next((round(e["t"] * 1000, 2) for e in tl if e["event"] == "sigterm"), None)
        if row["hog_ms"] is None:
            row["error"] = "no crossing or no SIGTERM seen by the hog"
        return row
    finally:
        for s in held:
            s.close()
        for p in reversed(procs):
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
            p.wait(10)
        os.close(rfd)
        subprocess.run(["rm", "-rf", work])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--clients", type=int, default=4, help="scraping processes in flood and stall")
    ap.add_argument("--switch-interval", type=float, action="append",
                    help="seconds (sys.setswitchinterval in the daemon); repeat to compare; default: the daemon's own")
    ap.add_argument("--pythonpath", help="checkout whose sparkguard runs (default: this one)")
    ap.add_argument("--extra-procs", type=int, default=0,
                    help="idle processes (sleep) added to /proc for the whole run: a DGX Spark runs several hundred")
    ap.add_argument("--headroom", type=float, default=1.0, help="GiB between MemAvailable now and the line")
    ap.add_argument("--trial-timeout", type=float, default=20.0)
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    if mem_available() < 6 * GiB:
        print("needs >= 6 GiB MemAvailable", file=sys.stderr)
        return 1
    rows = []
    idle = [subprocess.Popen(["sleep", "3600"]) for _ in range(args.extra_procs)]
    try:
        for switch in args.switch_interval or [None]:
            for i in range(args.trials):
                for mode in args.modes.split(","):
                    r = trial(mode, args, switch)
                    r["extra_procs"] = args.extra_procs
                    rows.append(r)
                    print(json.dumps(r), flush=True)
    finally:
        for p in idle:
            p.kill()
            p.wait(10)
    print(f"\n{'switch':>8} {'mode':<6} {'n':>2}  hog crossing->SIGTERM ms (median, max)  guard ms (median, max)"
          "  scrapes ok")
    for switch in sorted({r["switch_interval"] for r in rows}):
        for mode in args.modes.split(","):
            rs = [r for r in rows if r["mode"] == mode and r["switch_interval"] == switch and r.get("hog_ms") is not None]
            if not rs:
                continue
            h = [r["hog_ms"] for r in rs]
            g = [r["guard_ms"] for r in rs if r.get("guard_ms") is not None]
            print(f"{switch * 1000:>6.2f}ms {mode:<6} {len(rs):>2}  {statistics.median(h):>10.1f} {max(h):>10.1f}"
                  f"                 {statistics.median(g) if g else float('nan'):>8.1f} {max(g) if g else float('nan'):>8.1f}"
                  f"  {sum(r['scrape_ok'] for r in rs)}/{len(rs)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

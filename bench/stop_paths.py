#!/usr/bin/env python3
"""Stop-path timings: SIGTERM -> engine gone, for a supervised process engine and a ``docker run`` engine.

Run as root from the repository root (not part of the test suite; about a minute)::

    python3 bench/stop_paths.py                 # 5 trials of each path
    python3 bench/stop_paths.py --trials 9 --out bench/results/stop_paths

One ``sparkguard run`` per path supervises the fake vLLM of tests/fakes (``--tp 2``, 8 MiB held
per process, its default 0.2 s teardown on SIGTERM); the docker path runs it in a container of
the tests' own dockerd (tests/dockerd.py: Debian's docker.io, an image imported from a
debootstrap root, ``--network host`` as the recipes write it, the ``--rm`` they use).  Each trial
waits until the engine is ready, opens pidfds of what it watches, asks the daemon to stop the
engine (``engine stop``, the control socket) and records, from the daemon's SIGTERM (its log
line ``engine: sigterm: stop: SIGTERM pid ...``, wall clock in ms):

    engine exited      process path: every process of the engine's tree exited (pidfds);
                       docker path: the container's init exited (its pidfd)
    client exited      docker path: the ``docker run`` client exited
    container removed  docker path: dockerd's ``destroy`` event for the container (``docker
                       events``, its TimeNano)
    stopped            the daemon reports the engine ``stopped`` (``wait until stopped`` answered):
                       the whole stop path, the sweep and ``docker rm -f`` included

and whether ``docker ps -a`` (the trial's label) is empty after it.  The engine is then started
again for the next trial.  Output: a markdown table (median and min-max per column) on stdout and
in ``OUT.md``, every trial in ``OUT.csv`` (``--out``, default bench/results/stop_paths).
"""

from __future__ import annotations

import argparse
import csv
import datetime
import os
import re
import select
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

import dockerd  # noqa: E402 - the tests' dockerd helper
from supervisor_helpers import Daemon, engine_config, fake_cmd, free_port, unique  # noqa: E402

from sparkguard import proctree  # noqa: E402

SMALL = ("--hold", "8MiB", "--hold-core", "8MiB", "--hold-api", "8MiB", "--tp", "2")
SIGTERM_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*engine: sigterm: stop: SIGTERM pid")
COLUMNS = ("engine_exited_ms", "client_exited_ms", "container_removed_ms", "stopped_ms")


def log_time(stamp: str) -> float:
    """Unix time of a logging timestamp (``2026-12-01 21:42:20,985``, local time)."""
    day, ms = stamp.split(",")
    return time.mktime(datetime.datetime.strptime(day, "%Y-%m-%d %H:%M:%S").timetuple()) + int(ms) / 1000


class ExitWatch:
    """Exit times (unix s) of ``pids``, from their pidfds, in a thread of its own."""

    def __init__(self, pids: list[int]):
        self.fds = {}
        for pid in pids:
            try:
                self.fds[os.pidfd_open(pid)] = pid
            except ProcessLookupError:
                pass
        self.exited: dict[int, float] = {}
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        left = dict(self.fds)
        deadline = time.monotonic() + 120
        while left and time.monotonic() < deadline:
            ready, _, _ = select.select(list(left), [], [], 1.0)
            now = time.time()
            for fd in ready:
                self.exited[left.pop(fd)] = now

    def wait(self, timeout: float = 60) -> dict[int, float]:
        self.thread.join(timeout)
        for fd in self.fds:
            os.close(fd)
        return self.exited


def tree_of(pid: int) -> list[int]:
    procs = proctree.scan()
    return [p for p in proctree.descendants([pid], proctree.children_map(procs)) if p in procs]


def trial(sg: Daemon, d, tag: str | None, after: int) -> dict:
    """One stop of the engine of ``sg`` (docker path when ``d``); the row, times in ms from the SIGTERM."""
    st = sg.wait_ready(after=after, timeout=120)
    events = cid = None
    if d is None:
        watch = ExitWatch(tree_of(st["pid"]))
        engine = client = None
    else:
        ctr = (st.get("tracking") or {}).get("container") or {}
        cid, init = ctr.get("id"), ctr.get("pid")
        if not cid:
            raise RuntimeError(f"the container is not known: {st.get('tracking')}")
        engine, client = init, st["pid"]
        watch = ExitWatch([init, client])
        events = subprocess.Popen([d.cli, "events", "--since", f"{time.time() - 5:.3f}", "--filter",
                                   f"container={cid}", "--filter", "event=destroy", "--format", "{{.TimeNano}}"],
                                  env=d.env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    mark = sg.mark()
    assert sg.ctl("stop")["ok"]
    r = sg.ctl("wait", sock_timeout=130, until="stopped", after=0, timeout=120)
    t_stopped = time.time()
    if not r.get("ok"):
        raise RuntimeError(f"not stopped: {r}")
    t_term = log_time(SIGTERM_LINE.search(sg.wait_line(SIGTERM_LINE.pattern, 10, start=mark).string).group(1))
    exited = watch.wait()
    row = {"stopped_ms": (t_stopped - t_term) * 1000}
    if d is None:
        row["engine_exited_ms"] = (max(exited.values()) - t_term) * 1000 if exited else None
    else:
        row["engine_exited_ms"] = (exited[engine] - t_term) * 1000 if engine in exited else None
        row["client_exited_ms"] = (exited[client] - t_term) * 1000 if client in exited else None
        line = ""
        if select.select([events.stdout], [], [], 30)[0]:
            line = events.stdout.readline().strip()
        events.kill()
        events.wait(10)
        events.stdout.close()
        row["container_removed_ms"] = (int(line) / 1e9 - t_term) * 1000 if line.isdigit() else None
        row["ps_a_empty"] = d.containers(f"label=sgbench={tag}") == []
    return row


def run_path(path: str, trials: int, d, work: Path) -> list[dict]:
    port = free_port()
    tag = unique("sgstop")
    if d is None:
        argv = fake_cmd(tag, port, *SMALL)
    else:
        argv = d.fake_run(tag, *SMALL, "--port", str(port), run_opts=("--label", f"sgbench={tag}"))
        os.environ["DOCKER_HOST"] = d.host          # the daemon (and its docker CLI calls) talk to the bench's dockerd
    wd = work / path
    wd.mkdir(parents=True)
    sg = Daemon(wd, engine_config(wd, tag, argv, port))
    rows = []
    try:
        sg.wait_control()
        for k in range(trials):
            if k:
                assert sg.ctl("start")["ok"]
            row = {"path": path, "trial": k, **trial(sg, d, tag, after=k)}
            print(f"{path} trial {k}: " + ", ".join(f"{c}={row[c]:.0f}" for c in COLUMNS if row.get(c) is not None)
                  + (f", ps_a_empty={row['ps_a_empty']}" if "ps_a_empty" in row else ""), file=sys.stderr, flush=True)
            rows.append(row)
    finally:
        sg.stop()
        if d is not None:
            ids = d.containers(f"label=sgbench={tag}")
            if ids:
                d.docker("rm", "-f", *ids, check=False)
    return rows


def table(rows: list[dict]) -> str:
    def cell(vals: list[float]) -> str:
        if not vals:
            return "-"
        return f"{statistics.median(vals):.0f} ({min(vals):.0f}-{max(vals):.0f})"
    out = ["| path | runs | SIGTERM -> engine exited, ms | -> client exited | -> container removed | "
           "-> sparkguard says stopped | `docker ps -a` empty |", "|---|---|---|---|---|---|---|"]
    for path in dict.fromkeys(r["path"] for r in rows):
        rs = [r for r in rows if r["path"] == path]
        cols = [cell([r[c] for r in rs if r.get(c) is not None]) for c in COLUMNS]
        empty = f"{sum(bool(r.get('ps_a_empty')) for r in rs)}/{len(rs)}" if "ps_a_empty" in rs[0] else "-"
        out.append(f"| {path} | {len(rs)} | " + " | ".join(cols) + f" | {empty} |")
    return "\n".join(out) + "\n\nmedian (min-max) over the runs, from the daemon's SIGTERM\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "stop_paths"))
    ap.add_argument("--paths", default="process,docker", help="comma-separated: process, docker")
    a = ap.parse_args()
    reason = dockerd.unavailable_reason()
    paths = a.paths.split(",")
    if "docker" in paths and reason:
        print(f"docker path impossible here: {reason}", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="sgstop-"))
    rows: list[dict] = []
    if "process" in paths:
        rows += run_path("process", a.trials, None, work)
    if "docker" in paths:
        with dockerd.started() as d:
            rows += run_path("docker", a.trials, d, work)
    shutil.rmtree(work, ignore_errors=True)
    text = table(rows)
    print(text)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out + ".md").write_text(text)
    with open(a.out + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["path", "trial", *COLUMNS, "ps_a_empty"])
        w.writeheader()
        for r in rows:
            w.writerow({k: (f"{v:.1f}" if isinstance(v, float) else v) for k, v in r.items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())

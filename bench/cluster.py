#!/usr/bin/env python3
"""Cluster outage benchmark: how long one vLLM TP engine spread over 2 or 4 nodes stops serving
after a fault on one node, with a sparkguard supervising each node's rank.

Run as root from the repository root (not part of the test suite; each trial builds its own
cluster, about 15 s of start-up plus the outage)::

    python3 bench/cluster.py                               # 2 and 4 nodes, every fault, 3 trials
    python3 bench/cluster.py --nodes 2 --trials 1          # the quick proof that it works
    python3 bench/cluster.py --faults kill-head,link-drop --timeout 120

Each trial: a fresh ``netcluster.Cluster(n)`` (n network namespaces, veths to one bridge in a
hub namespace: tests/netcluster.py), a ``sparkguard run`` in each node's namespace
(``netcluster.tp_configs``: the fake vLLM of tests/fakes, TP = n, one rank per node, head on node
0, ``--load-time`` 2 s, 8 MiB held per process), started headless ranks first and the head last.
A client in the hub namespace POSTs a one-token ``/v1/completions`` to the head every 100 ms
(sequentially; the next request goes out at the next 100 ms tick after the previous answer),
each with a 1 s timeout for the connect and for each read; a request is good when it answers
200.  Once every node's sparkguard reports its engine ready and the client has had 3 s of good
answers, one fault is applied:

    kill-worker        SIGKILL of the last headless rank's ``VLLM::Worker_TP<k>``
    kill-head          SIGKILL of the head's ``vllm serve`` top process
    restart-head       ``sparkguard engine restart`` (the control socket's ``restart``) on the head
    restart-headless   the same on the last headless node
    link-drop          the last headless node's veth down for --link-drop seconds (10), then up

Outage = from the send time of the first failed request (one that ended after the fault
began) to the send time of the first good request after it; 0 when no request fails within
--quiet seconds (20) of the fault's end.  A trial that has not recovered --timeout seconds (300)
after the fault is reported as "> timeout" and its cluster torn down.  After the first good
request the bench keeps watching for --settle seconds (5) and counts requests that failed again
(``relapse_failures``).  Per trial it also records what each node's sparkguard did: the change of
its ``restarts`` counters by reason and of its ``starts``.

Timers: sparkguard's defaults apply (sparkguard/config/engine.py EngineConfig:
``health_interval`` 2 s, ``probe`` off, ``head_lost_after`` 60 s, ``backoff_initial`` 1 s doubling
to ``backoff_max`` 300 s, ``stable_for`` 5 s, ``ready_timeout`` 1200 s, ``quiesce_timeout``
300 s, ``guard.grace`` the default) except what this shared machine forces: ``start_above:
64MiB`` (the memory gates; every node reads the same MemAvailable here), ``drop_caches: false``,
``guard.term_below: 128MiB`` (the guard never fires).  ``--engine KEY=VALUE`` changes an
``engine:`` key on every node (printed in the table's header): e.g. ``stable_band=1GiB`` where
other work on a shared machine moves MemAvailable by more than the default 256 MiB within
``stable_for`` and so stretches the quiesce gate (seen here: 27 s instead of 5 s).

Output: on stderr "n=N FAULT trial K: cluster TAG serving MODEL; fault now" before each fault
and one line per trial with its result; a markdown table (per node count and fault: median and
min-max outage over the trials, how many recovered, failed requests) on stdout and in
``OUT.md``; every trial in ``OUT.csv`` (``--out``, default bench/results/cluster); with ``--logs
DIR`` each node's sparkguard output per trial.

Cleanup: SIGINT (Ctrl-C), SIGTERM and SIGHUP end the bench at its next safe point (within
about 0.5 s; a link drop's link is put back up first) and unwind through the cluster's exit (every
sparkguard stopped, every engine process it reported SIGKILLed by pidfd, every namespace,
veth and bridge removed); the rows so far are written; exit 130, 143, 129.
"""

from __future__ import annotations

import argparse
import csv
import os
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

from headtohead import Stopped  # noqa: E402 - SIGINT/SIGTERM/SIGHUP as a KeyboardInterrupt with .signum

FAULTS = ("kill-worker", "kill-head", "restart-head", "restart-headless", "link-drop")
PERIOD = 0.1            # seconds between the client's requests
REQ_TIMEOUT = 1.0       # seconds for the connect and for each read of one request
WARM = 3.0              # seconds of good answers before a fault
SETUP_TIMEOUT = 120.0   # seconds for a fresh cluster to serve


class Client:
    """The hub's client: one-token completions to the head every PERIOD s, results kept.

    ``records``: list of ``(t_sent, t_done, ok, what)`` (monotonic seconds, bool, HTTP status or
    the error's name); ``cv`` is notified after each one.
    """

    def __init__(self, hub, url: str, model: str):
        self.hub, self.url, self.model = hub, url, model
        self.records: list[tuple[float, float, bool, str]] = []
        self.cv = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="client", daemon=True)

    def start(self) -> "Client":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(REQ_TIMEOUT * 3 + 5)

    def _run(self) -> None:
        body = {"model": self.model, "prompt": "x", "max_tokens": 1}
        tick = time.monotonic()
        while not self._stop.is_set():
            t0 = time.monotonic()
            try:
                status, _ = self.hub.http_post(self.url, body, timeout=REQ_TIMEOUT)
                ok, what = status == 200, str(status)
            except Exception as e:  # noqa: BLE001 - every failure is a failed request
                ok, what = False, type(e).__name__
            with self.cv:
                self.records.append((t0, time.monotonic(), ok, what))
                self.cv.notify_all()
            tick += PERIOD
            now = time.monotonic()
            if tick < now:                      # a slow answer: next tick from now
                tick = now + PERIOD - (now - tick) % PERIOD
            self._stop.wait(tick - now)

    def wait(self, until: float) -> None:
        """Until the next record or monotonic time ``until``, whichever first."""
        with self.cv:
            n = len(self.records)
            while len(self.records) == n and time.monotonic() < until:
                self.cv.wait(max(0.0, until - time.monotonic()))

    def good_since(self) -> float | None:
        """Send time of the first of the current run of good answers (None if the last failed)."""
        with self.cv:
            t = None
            for t0, _, ok, _ in reversed(self.records):
                if not ok:
                    break
                t = t0
            return t


def wait_serving(daemons, client: Client, timeout: float) -> None:
    """Until every node's sparkguard says ready and the client has had WARM s of good answers."""
    deadline = time.monotonic() + timeout
    while True:
        since = client.good_since()
        now = time.monotonic()
        if since is not None and now - since >= WARM and all(d.status()["ready"] for d in daemons):
            return
        if now > deadline:
            raise RuntimeError("the cluster did not serve within %.0f s:\n%s" % (timeout, "\n".join(
                f"--- node{k}\n" + d.output()[-3000:] for k, d in enumerate(daemons))))
        check_stop()
        client.wait(min(deadline, now + 0.5))


def apply_fault(fault: str, cluster, daemons, link_drop: float) -> tuple[float, float]:
    """Apply ``fault``; returns (its start, its end) in monotonic seconds."""
    head, last = daemons[0], daemons[-1]
    if fault in ("kill-worker", "kill-head"):
        t = time.monotonic()
        if fault == "kill-worker":
            last.kill_engine("VLLM::Worker")
        else:
            head.kill_engine(None)
        return t, t
    if fault in ("restart-head", "restart-headless"):
        d = head if fault == "restart-head" else last
        t = time.monotonic()
        r = d.ctl("restart")
        if not r.get("ok"):
            raise RuntimeError(f"engine restart refused: {r}")
        return t, t
    if fault == "link-drop":
        node = cluster.nodes[-1]
        t = time.monotonic()
        node.link_down()
        until = t + link_drop               # the length of the fault itself
        while not STOP and time.monotonic() < until:
            time.sleep(min(0.5, until - time.monotonic()))
        node.link_up()
        check_stop()
        return t, time.monotonic()
    raise ValueError(f"unknown fault {fault!r}")


def measure(client: Client, t_fault: float, t_end: float, timeout: float, quiet: float, settle: float) -> dict:
    """Outage after a fault from the client's records (see the module docstring)."""
    deadline = t_fault + timeout
    first_fail = first_good = None
    while True:
        with client.cv:
            recs = list(client.records)
        if first_fail is None:
            first_fail = next((r for r in recs if r[1] >= t_fault and not r[2]), None)
        if first_fail is not None and first_good is None:
            first_good = next((r for r in recs if r[0] > first_fail[0] and r[2]), None)
        now = time.monotonic()
        if first_fail is None and now >= t_end + quiet:
            return {"outage_s": 0.0, "timed_out": False, "failed": 0, "relapse_failures": 0}
        if first_good is not None and now >= first_good[0] + settle:
            after = [r for r in recs if r[0] >= first_fail[0]]
            return {"outage_s": round(first_good[0] - first_fail[0], 2), "timed_out": False,
                    "failed": sum(1 for r in after if not r[2] and r[0] < first_good[0]),
                    "relapse_failures": sum(1 for r in after if not r[2] and r[0] > first_good[0]),
                    "first_error": first_fail[3]}
        if now >= deadline:
            return {"outage_s": None, "timed_out": True,
                    "failed": sum(1 for r in recs if r[0] >= first_fail[0] and not r[2]) if first_fail else 0,
                    "relapse_failures": 0, "first_error": first_fail[3] if first_fail else ""}
        check_stop()
        client.wait(min(deadline, now + 0.5))


def changes(before: list[dict], after: list[dict | None]) -> str:
    """What each node's sparkguard did: ``node1:starts+1,head+1`` per node, ';'-joined."""
    out = []
    for k, (b, a) in enumerate(zip(before, after)):
        if a is None:
            out.append(f"node{k}:?")
            continue
        parts = [f"starts+{a['starts'] - b['starts']}"] if a["starts"] != b["starts"] else []
        for reason, v in sorted(a["restarts"].items()):
            if v != b["restarts"].get(reason, 0):
                parts.append(f"{reason}+{v - b['restarts'].get(reason, 0)}")
        if parts:
            out.append(f"node{k}:" + ",".join(parts))
    return ";".join(out) or "none"


def trial(n: int, fault: str, k: int, args, work: Path) -> dict:
    """One fault on a fresh n-node cluster; returns the CSV row."""
    import netcluster
    from supervisor_helpers import unique
    model = unique("sgbench")
    row = {"nodes": n, "fault": fault, "trial": k}
    daemons = []
    with netcluster.Cluster(n) as c:
        try:
            cfgs = netcluster.tp_configs(c, model, work, load_time=args.load_time, engine=args.engine)
            daemons = netcluster.start_nodes(c, cfgs, work)
            client = Client(c.hub, f"http://{c.nodes[0].addr}:8000/v1/completions", model).start()
            try:
                wait_serving(daemons, client, SETUP_TIMEOUT)
                print(f"n={n} {fault} trial {k}: cluster {c.tag} serving {model}; fault now", file=sys.stderr, flush=True)
                before = [d.status() for d in daemons]
                t0, t1 = apply_fault(fault, c, daemons, args.link_drop)
                row.update(measure(client, t0, t1, args.timeout, args.quiet, args.settle))
                after = []
                for d in daemons:
                    try:
                        after.append(d.status())
                    except OSError:
                        after.append(None)
                row["changes"] = changes(before, after)
            finally:
                client.stop()
        finally:
            if args.logs:
                logs = Path(args.logs)
                logs.mkdir(parents=True, exist_ok=True)
                for j, d in enumerate(daemons):
                    (logs / f"n{n}-{fault}-t{k}-node{j}.log").write_text(d.output() + "\n")
    return row


def med_range(vals: list[float]) -> str:
    if not vals:
        return "-"
    return f"{statistics.median(vals):.1f} ({min(vals):.1f}-{max(vals):.1f})"


def table(rows: list[dict], timeout: float) -> str:
    """Markdown: per (nodes, fault) the median (min-max) outage in seconds."""
    out = ["| nodes | fault | outage s, median (min-max) | recovered | failed requests, median | what sparkguard did (last trial) |",
           "|---|---|---|---|---|---|"]
    keys = []
    for r in rows:
        if (r["nodes"], r["fault"]) not in keys:
            keys.append((r["nodes"], r["fault"]))
    for n, fault in keys:
        rs = [r for r in rows if r["nodes"] == n and r["fault"] == fault]
        ok = [r["outage_s"] for r in rs if r.get("outage_s") is not None]
        late = sum(1 for r in rs if r.get("timed_out"))
        errors = sum(1 for r in rs if r.get("error"))
        cells = ([med_range(ok)] if ok else []) + ([f"{late} > {timeout:.0f}" if ok else f"> {timeout:.0f}"]
                                                   if late else []) + ([f"{errors} broken"] if errors else [])
        cell = ", ".join(cells)
        fails = [r.get("failed", 0) for r in rs]
        out.append(f"| {n} | {fault} | {cell} | {len(ok)}/{len(rs)} | "
                   f"{statistics.median(fails):g} | {rs[-1].get('changes', '')} |")
    return "\n".join(out)


STOP: list[int] = []     # the signal that asked the bench to stop, once one came


def stop_on_signals() -> None:
    """SIGINT/SIGTERM/SIGHUP ask the bench to stop: :func:`check_stop` then raises
    :class:`Stopped` (headtohead's) at the bench's next safe point, within about 0.5 s; later
    signals are ignored so the cleanup that follows is not cut short.  The handler never raises
    itself: an exception inside a pyroute2 call (a link going down, a namespace being made) can
    leave pyroute2 unable to do the cleanup's own calls.  A forked child (pyroute2 forks helpers
    to enter namespaces and stops them with SIGTERM) inherits the handler: there it only ends
    that child."""
    sigs = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    owner = os.getpid()

    def handler(signum, frame):
        if os.getpid() != owner:
            os._exit(128 + signum)
        for s in sigs:
            signal.signal(s, signal.SIG_IGN)
        STOP.append(signum)

    for s in sigs:
        signal.signal(s, handler)


def check_stop() -> None:
    """Raise :class:`Stopped` if a stop signal came (see :func:`stop_on_signals`)."""
    if STOP:
        raise Stopped(STOP[0])


FIELDS = ["nodes", "fault", "trial", "outage_s", "timed_out", "failed", "relapse_failures", "first_error",
          "changes", "error"]


def revision() -> str:
    """``git describe --always --dirty`` of this checkout, or "?" without git."""
    import subprocess
    try:
        return subprocess.run(["git", "-C", str(ROOT), "describe", "--always", "--dirty"], capture_output=True,
                              text=True, timeout=10).stdout.strip() or "?"
    except (OSError, subprocess.SubprocessError):
        return "?"


def write(rows: list[dict], args, out: Path) -> str:
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_suffix(".csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    md = (f"Cluster outage after one fault ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
          f"{os.uname().nodename}, {os.cpu_count()} CPUs, code {args.revision}): fake vLLM load time {args.load_time:g} s, "
          f"sparkguard's default timers, {args.trials} trial(s), timeout {args.timeout:g} s, "
          f"link drop {args.link_drop:g} s"
          + (f", engine overrides {args.engine}" if args.engine else "") + ".\n\n" + table(rows, args.timeout) + "\n")
    out.with_suffix(".md").write_text(md)
    return md


def main() -> int:
    ap = argparse.ArgumentParser(description="outage of a TP engine over 2-4 namespaced nodes after one fault")
    ap.add_argument("--nodes", default="2,4", help="comma-separated node counts (default 2,4)")
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--faults", default=",".join(FAULTS), help=f"comma-separated, from {', '.join(FAULTS)}")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds after a fault before '> timeout'")
    ap.add_argument("--quiet", type=float, default=20.0,
                    help="seconds after the fault's end without a failed request that mean no outage")
    ap.add_argument("--settle", type=float, default=5.0, help="seconds watched after recovery for relapses")
    ap.add_argument("--load-time", type=float, default=2.0, help="the fake vLLM's load time, seconds")
    ap.add_argument("--link-drop", type=float, default=10.0, help="seconds the link stays down")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "cluster"), help="OUT.csv and OUT.md")
    ap.add_argument("--logs", default=None, help="folder for each node's sparkguard output per trial")
    ap.add_argument("--engine", action="append", default=[], metavar="KEY=VALUE",
                    help="an engine: key for every node, e.g. stable_band=1GiB (YAML value; repeatable)")
    args = ap.parse_args()
    try:
        args.engine = {k: yaml.safe_load(v) for k, _, v in (x.partition("=") for x in args.engine)}
    except yaml.YAMLError as e:
        ap.error(f"--engine: {e}")
    if os.geteuid() != 0:
        print("bench/cluster.py needs root (network namespaces)", file=sys.stderr)
        return 2
    faults = [f for f in args.faults.split(",") if f]
    bad = [f for f in faults if f not in FAULTS]
    if bad:
        ap.error(f"unknown fault(s) {bad}; choose from {', '.join(FAULTS)}")
    sizes = [int(x) for x in args.nodes.split(",") if x]
    args.revision = revision()              # before this run rewrites a tracked results file
    stop_on_signals()
    cases = [{"nodes": n, "fault": fault, "trial": k} for n in sizes for fault in faults for k in range(args.trials)]
    return run_trials(cases, lambda c, tw: trial(c["nodes"], c["fault"], c["trial"], args, tw),
                      FIELDS[3:], lambda rows: write(rows, args, Path(args.out)), "sgbench-cluster-",
                      {"timed_out": False})


def run_trials(cases: list[dict], run, shown: list[str], finish, prefix: str, on_error: dict | None = None) -> int:
    """Each case (a dict of the row's key fields, e.g. ``{"nodes": 2, "trial": 0}``) through
    ``run(case, workdir)``, which returns the row; a trial that raises is a row with ``error`` (and
    ``on_error``'s fields) and the bench goes on; one line per row on stderr (its ``shown`` fields).
    A signal (:func:`stop_on_signals`) ends it after the trial in progress; ``finish(rows)`` (the
    results files) runs then too and its text is printed.  Returns the exit status (0, or 128 +
    the signal).  Shared by this bench and bench/cluster_lane.py."""
    rows: list[dict] = []
    status = 0
    work = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        for case in cases:
            check_stop()
            name = "-".join(f"{v}" for v in case.values())
            try:
                row = run(case, work / name)
            except Stopped:
                raise
            except Exception as e:  # noqa: BLE001 - a broken trial is a row, the bench goes on
                row = {**case, **(on_error or {}), "error": f"{type(e).__name__}: {str(e)[:2000]}"}
            rows.append(row)
            print(" ".join(f"{k}={v}" for k, v in case.items()) + ": " +
                  ", ".join(f"{f}={row.get(f)}" for f in shown if row.get(f) not in (None, "")),
                  file=sys.stderr, flush=True)
    except Stopped as e:
        status = 128 + e.signum
        print(f"stopped by {e}; {len(rows)} trial(s) written", file=sys.stderr)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if rows:
            print(finish(rows))
    return status


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Lane-switch benchmark: how long one vLLM TP engine over 2 or 4 nodes stops serving while
``sparkguard cluster lane big`` switches every node from lane ``small`` to ``big`` over SSH.

Run as root from the repository root (not part of the test suite; each trial builds its own
cluster, about 15-25 s of start-up plus the switch)::

    python3 bench/cluster_lane.py                       # 2 and 4 nodes, 3 trials each
    python3 bench/cluster_lane.py --nodes 2 --trials 1  # the quick proof that it works

Each trial: a fresh ``netcluster.Cluster(n)`` (tests/netcluster.py), a real sshd in every node's
namespace with keys made for the trial (tests/sshnodes.py), a ``sparkguard run`` per node
configured by one cluster file (``netcluster.cluster_file``: the fake vLLM of tests/fakes, TP = n,
one rank per node, ``--load-time`` --load-time s, lanes ``small`` = ``--max-model-len 4096`` and
``big`` = ``--max-model-len 8192``, starting in ``small``; each node's SSH destination and the
harness's ``ssh:`` section added), and bench/cluster.py's client in
the hub namespace (a one-token completion to the head every 100 ms, 1 s timeout).  Once the
cluster serves (every node ready, 3 s of good answers), ``sparkguard cluster lane big --cluster
FILE`` runs as a subprocess in the hub namespace (the operator's machine: its ssh reaches every
node's sshd, its reads every node's metrics).  Then the same command again, which must do
nothing.

Recorded per trial: ``outage_s`` (bench/cluster.py ``measure``: send time of the first failed
request after the command began to that of the first good one after it), ``command_s`` (the
command's wall time: preflight, stops, starts, the wait until every node joined the head's run
in ``big``), ``noop_s`` and ``noop_failed`` (the second command's wall time and the requests that
failed meanwhile: 0 expected), the command's exit status.

Timers: sparkguard's defaults, as in bench/cluster.py (its docstring), with ``start_above:
64MiB``, ``drop_caches: false``, ``guard.term_below: 128MiB`` forced by this shared machine.
Output: a markdown table (median and min-max) on stdout and in ``OUT.md``, every trial in
``OUT.csv`` (``--out``, default bench/results/cluster-lane).  SIGINT/SIGTERM/SIGHUP end the bench
at its next safe point and unwind through the cluster's exit (bench/cluster.py
``stop_on_signals``).
"""

from __future__ import annotations

import argparse
import csv
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

import cluster as cb  # noqa: E402 - bench/cluster.py: the client, measure, signals
from conftest import sg_env, sparkguard_cmd  # noqa: E402
from headtohead import Stopped  # noqa: E402
from netcluster import Cluster, cluster_file, start_nodes  # noqa: E402
from sshnodes import SshNodes  # noqa: E402

import yaml  # noqa: E402

LANES = {"small": {"args": ["--max-model-len", "4096"]}, "big": {"args": ["--max-model-len", "8192"]}}
PORT = 8000
FIELDS = ["nodes", "trial", "outage_s", "command_s", "noop_s", "noop_failed", "rc", "failed", "error"]


def make_cluster_file(c: Cluster, s: SshNodes, model: str, work: Path, load_time: float) -> tuple[Path, list[dict]]:
    """netcluster.cluster_file of the trial's nodes (shared command, LANES, starting in small), each
    node's SSH destination and config path, and the sshd harness's ``ssh:`` section."""
    nodes = [{"ssh": node.addr, "config": str(work / f"node{node.rank}" / "sparkguard.yaml")} for node in c.nodes]
    path, cfgs = cluster_file(c, model, work, engine={"lane": "small"}, lanes=LANES, nodes=nodes, load_time=load_time)
    data = yaml.safe_load(path.read_text())
    data["ssh"] = {"options": list(s.ssh_options), "command": list(s.remote_sparkguard)}
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path, cfgs


def lane_cli(c: Cluster, path: Path, timeout: float) -> tuple[int, float, str]:
    """``sparkguard cluster lane big`` in the hub: ``(rc, seconds, stdout+stderr tail)``."""
    t0 = time.monotonic()
    p = c.hub.spawn(sparkguard_cmd("cluster", "lane", "big", "--cluster", str(path), "--timeout", f"{timeout:g}"),
                    env=sg_env(), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                    text=True)
    try:
        out, _ = p.communicate(timeout=timeout + 60)
    except subprocess.TimeoutExpired:
        p.kill()
        out, _ = p.communicate(timeout=10)
    return p.returncode, time.monotonic() - t0, out[-2000:]


def trial(n: int, k: int, args, work: Path) -> dict:
    row: dict = {"nodes": n, "trial": k}
    with Cluster(n) as c, SshNodes(c, work) as s:
        model = "sglane-" + c.tag
        path, cfgs = make_cluster_file(c, s, model, work, args.load_time)
        ds = start_nodes(c, cfgs, work)
        client = cb.Client(c.hub, f"http://{c.nodes[0].addr}:{PORT}/v1/completions", model).start()
        try:
            cb.wait_serving(ds, client, cb.SETUP_TIMEOUT)
            t_cmd = time.monotonic()
            rc, secs, out = lane_cli(c, path, args.timeout)
            row.update(rc=rc, command_s=round(secs, 2))
            if rc != 0:
                row["error"] = out.replace("\n", " | ")
                return row
            m = cb.measure(client, t_cmd, time.monotonic(), args.timeout, quiet=5.0, settle=3.0)
            row.update(outage_s=m["outage_s"], failed=m["failed"])
            t_noop = time.monotonic()
            rc2, secs2, out2 = lane_cli(c, path, args.timeout)
            with client.cv:
                row["noop_failed"] = sum(1 for r in client.records if r[0] >= t_noop and not r[2])
            row["noop_s"] = round(secs2, 2)
            if rc2 != 0 or "nothing to do" not in out2:
                row["error"] = "second switch: " + out2.replace("\n", " | ")
        finally:
            client.stop()
    return row


def write(rows: list[dict], args, out: Path) -> str:
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_suffix(".csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    lines = ["| nodes | outage s (median, min-max) | command s | second (no-op) command s | requests failed "
             "during the no-op | trials ok |", "|---|---|---|---|---|---|"]
    for n in sorted({r["nodes"] for r in rows}):
        rs = [r for r in rows if r["nodes"] == n]
        ok = [r for r in rs if not r.get("error") and r.get("outage_s") is not None]
        lines.append(f"| {n} | {cb.med_range([r['outage_s'] for r in ok])} | "
                     f"{cb.med_range([r['command_s'] for r in ok])} | {cb.med_range([r['noop_s'] for r in ok])} | "
                     f"{sum(r.get('noop_failed') or 0 for r in ok)} | {len(ok)}/{len(rs)} |")
    md = (f"Cluster-wide lane switch small -> big with `sparkguard cluster lane big` over SSH "
          f"({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.uname().nodename}, {os.cpu_count()} CPUs, "
          f"code {args.revision}): fake vLLM load time {args.load_time:g} s, sparkguard's default timers, "
          f"{args.trials} trial(s).\n\n" + "\n".join(lines) + "\n")
    out.with_suffix(".md").write_text(md)
    return md


def main() -> int:
    ap = argparse.ArgumentParser(description="outage of a cluster-wide lane switch over SSH")
    ap.add_argument("--nodes", default="2,4", help="comma-separated node counts (default 2,4)")
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--load-time", type=float, default=2.0, help="the fake vLLM's load time, seconds")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds the switch may take")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "cluster-lane"), help="OUT.csv and OUT.md")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("bench/cluster_lane.py needs root (network namespaces, sshd)", file=sys.stderr)
        return 2
    args.revision = cb.revision()
    cb.stop_on_signals()
    cases = [{"nodes": n, "trial": k} for n in [int(x) for x in args.nodes.split(",") if x] for k in range(args.trials)]
    return cb.run_trials(cases, lambda c, tw: trial(c["nodes"], c["trial"], args, tw), FIELDS[2:],
                         lambda rows: write(rows, args, Path(args.out)), "sgbench-lane-")


if __name__ == "__main__":
    sys.exit(main())

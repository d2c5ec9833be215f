"""docs/metrics.md is the metric names contract: what the real endpoint serves matches its tables.

A family served and not listed, listed and not served, or served with another type, label set or
HELP text than its row fails here, so a metric cannot be added, renamed or dropped without the doc.
"""

from __future__ import annotations

import re
import socket
import time
import urllib.request
from types import SimpleNamespace

from prometheus_client import CollectorRegistry

from conftest import ROOT
from guardrun import GuardProc
from sparkguard import metrics

DOC = ROOT / "docs" / "metrics.md"

#: Families a quiet daemon on an arbitrary host may not serve: the last incident's time (none yet),
#: PSI (kernels without it) and zram (hosts without a device).  The second test serves them.
SCRAPE_TIME_ONLY = re.compile(r"sparkguard_(last_incident_timestamp_seconds|last_incident_info|pressure_memory_.*|zram_.*)")
#: served only by a node of a TP cluster (a head's group, a headless rank's joined run, the cluster
#: file's info); the single-node daemon here cannot show them: tests/test_cluster_logic.py reads
#: them back from the real exposition, tests/test_cluster.py from nodes in network namespaces, the
#: last test here serves the cluster file's info
CLUSTER_ONLY = re.compile(r"sparkguard_engine_(group|joined)_run_start_timestamp_seconds|sparkguard_cluster_(info|nodes)")
#: served only with nvidia-ml-py and an NVIDIA driver (sparkguard.gpumem): tests/test_gpumem.py
#: reads it from a daemon running the NVML test double
NVML_ONLY = re.compile(r"sparkguard_engine_gpu_memory_bytes")

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? ")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="(?:[^"\\]|\\.)*"')


def doc_rows() -> dict[str, dict]:
    """``{name: {"type", "labels": set, "help", "section"}}`` from the tables of docs/metrics.md."""
    rows, section = {}, ""
    for line in DOC.read_text().splitlines():
        if line.startswith("## "):
            section = line[3:].strip()
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("| `") else []
        if len(cells) == 6:        # | `name` | type | labels | unit | present | HELP |
            name, typ, labels, _, _, help_ = cells
            name = name.strip("`")
            assert name not in rows, f"{name} listed twice in {DOC}"
            rows[name] = {"type": typ, "labels": set(re.findall(r"`(\w+)`", labels)), "help": help_,
                          "section": section}
    assert rows, f"no metric rows found in {DOC}"
    return rows


def served(text: str) -> dict[str, dict]:
    """``{name: {"type", "labels": set | None, "help"}}`` from Prometheus text exposition;
    ``labels`` None for a family without samples."""
    fams: dict[str, dict] = {}
    for line in text.splitlines():
        if line.startswith("# HELP "):
            name, _, help_ = line[7:].partition(" ")
            fams.setdefault(name, {"labels": None})["help"] = help_.replace("\\n", "\n").replace("\\\\", "\\")
        elif line.startswith("# TYPE "):
            name, _, typ = line[7:].partition(" ")
            fams.setdefault(name, {"labels": None})["type"] = typ
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m or line.startswith("#"):
            continue
        name = m.group(1)
        fam = name if name in fams else re.sub(r"_(count|sum|bucket|created)$", "", name)
        assert fam in fams, f"sample {name} of no declared family"
        got = {k for k in _LABEL.findall(m.group(2) or "") if k not in ("quantile", "le")}
        fams[fam]["labels"] = (fams[fam]["labels"] or set()) | got
    return fams


def mismatches(fams: dict[str, dict], rows: dict[str, dict]) -> list[str]:
    """Served families that are not in the doc, or differ from their row."""
    out = []
    for name, f in sorted(fams.items()):
        row = rows.get(name)
        if row is None:
            out.append(f"{name} ({f['type']}) is served but not listed in {DOC.name}")
            continue
        if f["type"] != row["type"]:
            out.append(f"{name}: served as {f['type']}, listed as {row['type']}")
        if f["help"] != row["help"]:
            out.append(f"{name}: HELP served {f['help']!r}, listed {row['help']!r}")
        if f["labels"] is not None and f["labels"] != row["labels"]:
            out.append(f"{name}: labels served {sorted(f['labels'])}, listed {sorted(row['labels'])}")
    return out


def metrics_port() -> int:
    """A TCP port free on loopback right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def test_the_daemon_serves_the_documented_metrics_and_only_those(tmp_path):
    """A real ``sparkguard run`` with an engine, a lane, a KILL floor and a watched link (lo)."""
    rows = doc_rows()
    port = metrics_port()
    g = GuardProc({
        "guard": {"term_below": "128MiB", "kill_below": "64MiB", "rate_trigger": "on"},
        "targets": {"match": [f"^sgdoc-never-{time.monotonic_ns()}$"]},
        "metrics": {"listen": f"127.0.0.1:{port}"},
        "engine": {"command": ["sleep", "600"], "log": "stderr", "drop_caches": False,
                   "start_above": "64MiB", "stable_for": "0s", "quiesce_timeout": "60s",
                   "health_interval": "100ms", "lanes": {"a": {}}, "lane": "a",
                   "state_file": str(tmp_path / "engine-state.json"),
                   "control_socket": str(tmp_path / "control.sock")},
        "link": {"interfaces": ["lo"]},
    })
    try:
        g.wait_ready()
        url = f"http://127.0.0.1:{port}/metrics"
        deadline = time.monotonic() + 60
        while True:
            text = scrape(url)
            fams = served(text)
            done = (fams.get("sparkguard_engine_time_to_ready_seconds") and
                    (fams.get("sparkguard_link_rx_errors_total") or {}).get("labels"))
            if done or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    finally:
        g.stop()
    assert not mismatches(fams, rows), "\n".join(mismatches(fams, rows))
    # the tracking mode in force, one of the two documented (cgroup here, as root with cgroup2)
    assert re.search(r'^sparkguard_engine_tracking_info\{delegation="(xattr|write-test|none)",'
                     r'mode="(cgroup|process-group)",tracks="engine"\} 1\.0$', text, re.M), text
    missing = sorted(n for n in rows if n not in fams and not SCRAPE_TIME_ONLY.fullmatch(n)
                     and not CLUSTER_ONLY.fullmatch(n) and not NVML_ONLY.fullmatch(n))
    assert not missing, f"listed in {DOC.name} but not served: {missing}"


def test_families_read_at_scrape_time_are_documented(tmp_path):
    """The guard families with every snapshot key set, PSI and a zram device, over real HTTP."""
    rows = doc_rows()
    now = time.time()
    snap = {
        "available_bytes": 5 * 1024**3, "total_bytes": 120 * 1024**3, "swap_free_bytes": 1, "swap_total_bytes": 2,
        "signal_bytes": 5 * 1024**3, "term_below_bytes": 1024**3, "kill_below_bytes": 512 * 1024**2,
        "grace_seconds": 5.0, "poll_interval_seconds": 0.2, "state": "ok", "dry_run": False,
        "proc_view": {"processes": 10, "other_users_readable": 3},
        "signals_sent": {"SIGTERM": 1}, "incidents": {"memory": 1}, "last_incident_timestamp": now - 60,
        "last_incident": ("20261201T120000Z-abcdef", "memory"),
        "poll_count": 10, "poll_seconds_sum": 0.01, "polls_total": 100, "notify_dropped": 0, "log_dropped": 0,
        "last_poll_timestamp": now, "started_timestamp": now - 3600, "config_reloads": {"ok": 1},
        "fall_rate_bytes_per_second": 0.0,
    }
    psi = {k: {"avg10": 1.0, "avg60": 0.5, "avg300": 0.1, "total_us": 1234} for k in ("some", "full")}
    zram = [{"device": "zram0", "disksize_bytes": 8 * 1024**3, "orig_data_bytes": 4096,
             "compr_data_bytes": 1024, "mem_used_bytes": 2048}]
    reg = CollectorRegistry()
    reg.register(metrics.GuardCollector(lambda: snap, read_psi=lambda: psi, read_zram=lambda: zram))
    srv = metrics.MetricsServer(("127.0.0.1", 0), reg).start(retry=False)
    try:
        fams = served(scrape(srv.url))
    finally:
        srv.stop()
    assert not mismatches(fams, rows), "\n".join(mismatches(fams, rows))
    want = sorted(n for n, r in rows.items() if r["section"] in ("Guard", "Kernel"))
    assert sorted(fams) == want


def test_the_configurations_cluster_and_lanes_are_documented_and_follow_a_reload():
    """:class:`metrics.ConfigCollector` over real HTTP: a config with a cluster and two lanes, then
    one without either (what a reload that drops them serves)."""
    rows = doc_rows()
    place = SimpleNamespace(name="lab", node="gx2", rank=1, nnodes=2, digest="0123456789ab")
    with_cluster = SimpleNamespace(cluster=place, engine=SimpleNamespace(enabled=True, lanes={"200k": 1, "1m": 2}))
    current = [with_cluster]
    reg = CollectorRegistry()
    reg.register(metrics.ConfigCollector(lambda: current[0]))
    srv = metrics.MetricsServer(("127.0.0.1", 0), reg).start(retry=False)
    try:
        text = scrape(srv.url)
        current[0] = SimpleNamespace(engine=SimpleNamespace(enabled=False, lanes={}))
        after = scrape(srv.url)
    finally:
        srv.stop()
    fams = served(text)
    assert not mismatches(fams, rows), "\n".join(mismatches(fams, rows))
    assert sorted(fams) == ["sparkguard_cluster_info", "sparkguard_cluster_nodes", "sparkguard_engine_lanes_info"]
    assert "sparkguard_cluster_nodes 2.0" in text
    assert 'sparkguard_cluster_info{cluster="lab",digest="0123456789ab",nnodes="2",node="gx2",node_rank="1"} 1.0' in text
    assert 'sparkguard_engine_lanes_info{lane="200k"} 1.0' in text and 'lane="1m"' in text
    assert served(after) == {}

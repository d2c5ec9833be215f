"""The shipped Prometheus rules and Grafana dashboard: linted and unit-tested with the real promtool,
every metric they use checked against the metric names the daemon exports (docs/metrics.md),
and both present in the built wheel at the paths ``sparkguard install`` copies from."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import zipfile

import pytest
import yaml

from conftest import ROOT
from test_metrics_doc import doc_rows

DATA = ROOT / "sparkguard" / "data"
RULES = DATA / "prometheus" / "sparkguard-rules.yml"
RULES_TEST = DATA / "prometheus" / "sparkguard-rules.test.yml"
DASHBOARD = DATA / "grafana" / "sparkguard-dashboard.json"

#: the metric names the daemon exports: the contract docs/metrics.md (checked against the real
#: endpoint by tests/test_metrics_doc.py); summaries add _count/_sum
METRICS = set(doc_rows()) | {n + sfx for n, r in doc_rows().items() if r["type"] == "summary"
                             for sfx in ("_count", "_sum")}

#: the alerts issues 7, 13 and 14 ask for: alert name -> metric that must appear in its expression
REQUIRED_ALERTS = {
    "SparkguardDown": "up", "SparkguardNotScraped": "up",
    "SparkguardPollStale": "sparkguard_last_poll_timestamp_seconds",
    "SparkguardMemoryBelowLine": "sparkguard_term_below_bytes",
    "SparkguardIncident": "sparkguard_incidents_total",
    "SparkguardEngineNotReady": "sparkguard_engine_ready",
    "SparkguardEngineRestarting": "sparkguard_engine_restarts_total",
    "SparkguardEngineReadyTimeout": "sparkguard_engine_restarts_total",
    "SparkguardEngineGivenUp": "sparkguard_engine_given_up",
    "SparkguardLinkDown": "sparkguard_link_up",
    "SparkguardZramNearlyFull": "sparkguard_zram_disksize_bytes",
    "SparkguardZramPoorCompression": "sparkguard_zram_compr_data_bytes",
    # issue 14: per cluster, joined to sparkguard_cluster_info on (instance, job)
    "SparkguardClusterLaneMismatch": "sparkguard_cluster_info",
    "SparkguardClusterNotServing": "sparkguard_cluster_info",
    "SparkguardClusterRankRestarting": "sparkguard_cluster_info",
    "SparkguardClusterGivenUp": "sparkguard_cluster_info",
}

_IDENT = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")


def metric_names(expr: str) -> set[str]:
    """sparkguard_* identifiers in a PromQL expression (label values in quotes are skipped)."""
    no_strings = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    return {m for m in _IDENT.findall(no_strings) if m.startswith("sparkguard_")}


def promtool() -> str:
    p = shutil.which("promtool")
    if not p:
        pytest.skip("promtool not installed (tests/install-deps installs the prometheus package)")
    return p


def rules() -> list[dict]:
    doc = yaml.safe_load(RULES.read_text())
    return [r for g in doc["groups"] for r in g["rules"]]


def test_promtool_check_rules():
    p = subprocess.run([promtool(), "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    assert f"SUCCESS: {len(rules())} rules found" in p.stdout


def test_promtool_test_rules(tmp_path):
    # run on a copy: promtool resolves rule_files relative to the test file
    for f in (RULES, RULES_TEST):
        shutil.copy(f, tmp_path / f.name)
    p = subprocess.run([promtool(), "test", "rules", RULES_TEST.name], cwd=tmp_path, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "SUCCESS" in p.stdout + p.stderr


@pytest.mark.parametrize("old,new,alert", [
    ("sparkguard_link_up == 0", "sparkguard_link_up == 2", "SparkguardLinkDown"),
    # the supervisor's label value is not_ready (sparkguard/supervisor/restart.py REASONS)
    ('reason="not_ready"', 'reason="notready"', "SparkguardEngineReadyTimeout"),
    # a `for` as long as engine.ready_timeout never fires: the restart resets it
    ("        for: 15m\n", "        for: 20m\n", "SparkguardEngineNotReady"),
    # a lane mismatch of two clusters told apart only by lane: lab2's 1m and lab's 200k would count
    ("count by (cluster, lane)", "count by (lane)", "SparkguardClusterLaneMismatch"),
    # a rank in its head's run (lab2) must not count as not joined
    ("!= on (cluster) group_left", "== on (cluster) group_left", "SparkguardClusterNotServing"),
    # a node gone: its failed scrape, and fewer nodes reporting than the file has
    ("(up == 0)", "(up == 2)", "SparkguardClusterNotServing"),
    ("count by (cluster) (sparkguard_cluster_info)\n", "count by (cluster) (sparkguard_cluster_info) * 2\n",
     "SparkguardClusterNotServing"),
    # the head's restarts for its rank (peer) name the rank, not the head
    ('reason=~"exit|guard|wedged|not_ready|link"', 'reason=~"exit|guard|wedged|not_ready|link|peer"',
     "SparkguardClusterRankRestarting"),
])
def test_promtool_test_rules_fails_on_a_broken_rule(tmp_path, old, new, alert):
    """The unit tests can fail: an alert that never fires (or fires on the wrong thing) is caught."""
    shutil.copy(RULES_TEST, tmp_path / RULES_TEST.name)
    text = RULES.read_text()
    assert text.count(old) == 1, old
    (tmp_path / RULES.name).write_text(text.replace(old, new))
    p = subprocess.run([promtool(), "test", "rules", RULES_TEST.name], cwd=tmp_path, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode != 0 and alert in p.stdout + p.stderr


def test_engine_that_never_gets_ready_alerts_with_the_default_ready_timeout():
    """SparkguardEngineNotReady's `for` must end before the supervisor's default engine.ready_timeout
    restarts the engine (which drops engine_up and resets the `for`), and restarts for not_ready, the
    reason label the supervisor counts, must alert by themselves (any ready_timeout)."""
    from sparkguard import config
    from sparkguard.supervisor.restart import REASONS
    from sparkguard.units import parse_duration
    by_name = {r["alert"]: r for r in rules() if "alert" in r}
    ready_timeout = config.EngineConfig.__dataclass_fields__["ready_timeout"].default
    assert parse_duration(by_name["SparkguardEngineNotReady"]["for"]) < ready_timeout
    assert "not_ready" in REASONS
    expr = by_name["SparkguardEngineReadyTimeout"]["expr"]
    assert 'sparkguard_engine_restarts_total{reason="not_ready"}' in expr and "for" not in by_name[
        "SparkguardEngineReadyTimeout"]


def test_every_required_alert_exists_with_severity_summary_and_description():
    by_name = {r["alert"]: r for r in rules() if "alert" in r}
    assert set(REQUIRED_ALERTS) <= set(by_name), set(REQUIRED_ALERTS) - set(by_name)
    for name, r in by_name.items():
        assert r["labels"]["severity"] in ("critical", "warning", "info"), name
        ann = r["annotations"]
        assert ann["summary"].strip() and "\n" not in ann["summary"], name
        # a description that says what to do: long enough to name a command or a setting
        assert len(ann["description"]) > 120 and ("`" in ann["description"] or "sparkguard" in ann["description"]), name
    for name, metric in REQUIRED_ALERTS.items():
        assert re.search(rf"\b{re.escape(metric)}\b", by_name[name]["expr"]), (name, metric)
    # the incident rule must fire at the first evaluation (the integration test relies on it)
    assert "for" not in by_name["SparkguardIncident"]


def test_every_alert_has_a_firing_and_a_quiet_case():
    doc = yaml.safe_load(RULES_TEST.read_text())
    firing, quiet = set(), set()
    for t in doc["tests"]:
        for case in t.get("alert_rule_test", []):
            (firing if case.get("exp_alerts") else quiet).add(case["alertname"])
    names = {r["alert"] for r in rules() if "alert" in r}
    assert names <= firing, names - firing
    assert names <= quiet, names - quiet


def test_rules_use_only_known_metrics():
    for r in rules():
        used = metric_names(r["expr"])
        assert used <= METRICS, (r.get("alert"), used - METRICS)


def test_dashboard_is_valid_and_uses_only_known_metrics():
    dash = json.loads(DASHBOARD.read_text())        # valid JSON
    assert [i["name"] for i in dash["__inputs"]] == ["DS_PROMETHEUS"]
    assert dash["__inputs"][0]["pluginId"] == "prometheus"
    panels = [p for p in dash["panels"] if p["type"] != "row"]
    assert panels
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    used: set[str] = set()
    for p in panels:
        assert p["datasource"]["uid"] == "${DS_PROMETHEUS}", p["title"]
        assert p["targets"], p["title"]
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
        for t in p["targets"]:
            assert t["datasource"]["uid"] == "${DS_PROMETHEUS}"
            names = metric_names(t["expr"])
            assert names, (p["title"], t["expr"])
            assert names <= METRICS, (p["title"], names - METRICS)
            used |= names
    ann = [a for a in dash["annotations"]["list"] if a.get("expr")]
    assert {a["name"] for a in ann} >= {"Incidents", "Signals"}
    for a in ann:
        assert a["datasource"]["uid"] == "${DS_PROMETHEUS}"
        assert metric_names(a["expr"]) <= METRICS, a["name"]
        used |= metric_names(a["expr"])
    for v in dash["templating"]["list"]:
        if v.get("datasource"):
            assert v["datasource"]["uid"] == "${DS_PROMETHEUS}"
            assert metric_names(v["definition"]) <= METRICS
    # what the issue asks the dashboard to show
    for m in ("sparkguard_guard_signal_bytes", "sparkguard_term_below_bytes", "sparkguard_memory_available_bytes",
              "sparkguard_signals_total", "sparkguard_incidents_total", "sparkguard_engine_up",
              "sparkguard_engine_ready", "sparkguard_engine_lane_info", "sparkguard_zram_orig_data_bytes",
              "sparkguard_zram_compr_data_bytes", "sparkguard_pressure_memory_some_ratio",
              "sparkguard_pressure_memory_full_ratio", "sparkguard_link_up", "sparkguard_link_carrier"):
        assert m in used, m


def test_metric_name_check_catches_an_unknown_name():
    assert metric_names('rate(sparkguard_link_rx_errors_total{interface="sparkguard_x"}[5m])') == \
        {"sparkguard_link_rx_errors_total"}
    assert not metric_names("sparkguard_memory_freed_bytes") <= METRICS    # no such metric


def test_wheel_ships_rules_and_dashboard(tmp_path):
    """``sparkguard install --prometheus-rules/--grafana-dashboard`` copy these package-data paths.

    Built from a clean copy of the source (a stale build/ directory could hide a missing file)."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "sparkguard", src / "sparkguard", ignore=shutil.ignore_patterns("__pycache__"))
    p = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(src)],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    wheel = next(tmp_path.glob("sparkguard-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    for f in (RULES, RULES_TEST, DASHBOARD):
        assert str(f.relative_to(ROOT)) in names, f


def test_dashboard_has_a_cluster_row_joined_on_the_cluster_name():
    """Issue 14: a cluster row whose panels join sparkguard_cluster_info (so one dashboard shows several
    clusters, chosen with the $cluster variable) and show readiness, lanes, rank failures and give-up."""
    dash = json.loads(DASHBOARD.read_text())
    rows = [p for p in dash["panels"] if p["type"] == "row"]
    start = next(p["gridPos"]["y"] for p in rows if p["title"] == "Cluster")
    after = min([p["gridPos"]["y"] for p in rows if p["gridPos"]["y"] > start] or [10**6])
    cluster = [p for p in dash["panels"] if p["type"] != "row" and start < p["gridPos"]["y"] < after]
    assert len(cluster) >= 4
    used: set[str] = set()
    for p in cluster:
        for t in p["targets"]:
            assert "sparkguard_cluster_info" in t["expr"] and "$cluster" in t["expr"], p["title"]
            used |= metric_names(t["expr"])
    for m in ("sparkguard_engine_ready", "sparkguard_engine_lane_info", "sparkguard_engine_restarts_total",
              "sparkguard_engine_given_up", "sparkguard_engine_joined_run_start_timestamp_seconds"):
        assert m in used, m
    var = next(v for v in dash["templating"]["list"] if v["name"] == "cluster")
    assert var["definition"] == "label_values(sparkguard_cluster_info, cluster)"

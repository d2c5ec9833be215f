"""A real Prometheus server (Debian package ``prometheus``) scrapes a real ``sparkguard run`` on loopback
with the shipped alert rules loaded; the test reads Prometheus's HTTP API.

* the guard's series arrive and every shipped rule evaluates without error;
* when the guard SIGTERMs a fake vLLM (``targets.match`` unique to the test; the fake holds about
  1.5 GiB, the line is raised by a SIGHUP reload to 512 MiB above the MemAvailable read then, so the
  crossing does not depend on what other tests on this shared box allocate), the SparkguardIncident
  alert fires;
* every expression of the shipped Grafana dashboard is accepted by Prometheus's query engine.

Prometheus scrapes every second and evaluates rules every second; the incident rule has no ``for:``.
Everything started here (Prometheus, the guard, the fake engine) is stopped and its temp dir removed
in ``finally``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid

import pytest
import yaml

from conftest import ROOT, fake_vllm, line_above_now, mem_available

PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
RULES = ROOT / "sparkguard" / "data" / "prometheus" / "sparkguard-rules.yml"
DASHBOARD = ROOT / "sparkguard" / "data" / "grafana" / "sparkguard-dashboard.json"
GiB = 1024**3
MiB = 1024**2

needs_prometheus = pytest.mark.skipif(not os.access(PROMETHEUS, os.X_OK),
                                      reason="prometheus not installed (tests/install-deps)")


def _missing(*modules: str) -> list[str]:
    return [m for m in modules if importlib.util.find_spec(m) is None]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Prometheus:
    """``prometheus`` on 127.0.0.1:<free port> with a temp storage dir, scraping ``targets`` every 1 s
    as job ``job`` and loading ``rule_files`` (evaluated every 1 s)."""

    def __init__(self, targets: list[str], job: str = "sparkguard-it", rule_files: tuple = ()):
        self.tmp = tempfile.mkdtemp(prefix="sg-prom-")
        self.job = job
        cfg = {
            "global": {"scrape_interval": "1s", "scrape_timeout": "900ms", "evaluation_interval": "1s"},
            "rule_files": [str(p) for p in rule_files],
            "scrape_configs": [{"job_name": job, "static_configs": [{"targets": targets}]}] if targets else [],
        }
        self.config = os.path.join(self.tmp, "prometheus.yml")
        with open(self.config, "w") as f:
            yaml.safe_dump(cfg, f)
        self.log_path = os.path.join(self.tmp, "prometheus.log")
        self.proc = None
        for _attempt in range(3):      # a free port can be taken by someone else before we bind it
            self.port = free_port()
            self.url = f"http://127.0.0.1:{self.port}"
            self._log = open(self.log_path, "w")
            self.proc = subprocess.Popen(
                [PROMETHEUS, f"--config.file={self.config}", f"--storage.tsdb.path={self.tmp}/data",
                 f"--web.listen-address=127.0.0.1:{self.port}", "--storage.tsdb.retention.time=1h",
                 "--log.level=warn"],
                stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
            if self._wait_ready(60):
                return
            self._kill()
            if "address already in use" not in self.log():
                break
        log = self.log()
        self.close()
        raise AssertionError(f"prometheus did not become ready; log:\n{log[-3000:]}")

    def _wait_ready(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            try:
                with urllib.request.urlopen(self.url + "/-/ready", timeout=2) as r:
                    if r.status == 200:
                        return True
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.1)
        return False

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def api(self, path: str, **params) -> dict:
        """GET /api/v1/<path>; returns ``data``; AssertionError (with Prometheus's error) otherwise."""
        url = f"{self.url}/api/v1/{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                body = json.load(r)
        except urllib.error.HTTPError as e:
            body = json.load(e)
        assert body.get("status") == "success", (path, params, body)
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        return self.api("query", query=expr)["result"]

    def wait(self, what: str, fn, timeout: float = 30.0, every: float = 0.25):
        """Poll Prometheus (it has no push API) until ``fn()`` is truthy; bounded."""
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            last = fn()
            if last:
                return last
            time.sleep(every)
        raise AssertionError(f"{what}: not within {timeout}s (last: {last!r}); prometheus log:\n{self.log()[-2000:]}")

    def _kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._log.close()

    def close(self) -> None:
        try:
            self._kill()
        finally:
            shutil.rmtree(self.tmp, ignore_errors=True)


def firing(prom: Prometheus, alertname: str) -> list[dict]:
    return [a for a in prom.api("alerts")["alerts"]
            if a["labels"].get("alertname") == alertname and a["state"] == "firing"]


def dashboard_exprs() -> list[tuple[str, str]]:
    """(where, expr) of every panel target, annotation and variable query of the shipped dashboard,
    with Grafana's variables replaced the way Grafana does before sending them."""
    dash = json.loads(DASHBOARD.read_text())
    out = []
    for p in dash["panels"]:
        for t in p.get("targets", []):
            out.append((p["title"], t["expr"]))
    for a in dash["annotations"]["list"]:
        if a.get("expr"):
            out.append(("annotation " + a["name"], a["expr"]))
    subst = {"$instance": ".*", "$cluster": ".*", "$__rate_interval": "1m", "$__range": "1h", "$__interval": "15s"}
    res = []
    for where, e in out:
        for k, v in subst.items():
            e = e.replace(k, v)
        assert "$" not in e, (where, e)
        res.append((where, e))
    return res


@needs_prometheus
def test_dashboard_expressions_and_rules_load_in_prometheus():
    prom = Prometheus([], rule_files=(RULES,))
    try:
        exprs = dashboard_exprs()
        assert len(exprs) > 20
        for where, e in exprs:
            try:
                prom.api("query", query=e)        # a parse error is HTTP 400, status "error"
            except AssertionError as err:
                raise AssertionError(f"dashboard panel {where!r}: {err}") from None
        with pytest.raises(AssertionError):       # the check can fail
            prom.api("query", query="sparkguard_link_up{")
        n_rules = sum(len(g["rules"]) for g in yaml.safe_load(RULES.read_text())["groups"])
        prom.wait("rules loaded", lambda: sum(len(g["rules"]) for g in prom.api("rules")["groups"]) == n_rules)
    finally:
        prom.close()


@needs_prometheus
def test_prometheus_scrapes_guard_and_incident_alert_fires(tmp_path):
    missing = _missing("sparkguard.daemon", "sparkguard.metrics")
    if missing:
        pytest.skip(f"not on this branch yet: {', '.join(missing)}")
    from guardrun import GuardProc

    model = f"sgprom-{uuid.uuid4().hex[:10]}"
    hold_worker, hold_core, hold_api = 640 * MiB, 128 * MiB, 64 * MiB      # ~1.5 GiB in the tree
    if mem_available() < 4 * GiB:
        pytest.skip(f"only {mem_available() / GiB:.1f} GiB available")
    # Start with a line no test on this shared box will push MemAvailable under, so that the
    # incident counter is 0 and no alert fires while the series arrive; then move the line.
    low_line = 256 * MiB
    mport = free_port()
    guard = GuardProc({"guard": {"term_below": low_line, "grace": "5s"},
                       "targets": {"match": [rf"\bserve {re.escape(model)}(\s|$)"]},
                       "metrics": {"listen": f"127.0.0.1:{mport}"}})
    prom = fe = None
    try:
        guard.wait_ready(30)
        fe = fake_vllm.start(model, "--tp", "2", "--hold", str(hold_worker), "--hold-core", str(hold_core),
                             "--hold-api", str(hold_api))
        fe.pids(60)                                           # the tree is up, holding its memory
        prom = Prometheus([f"127.0.0.1:{mport}"], rule_files=(RULES,))
        job = f'job="{prom.job}"'

        # the series arrive
        prom.wait("guard scraped", lambda: [r for r in prom.query(f"up{{{job}}}") if r["value"][1] == "1"])
        for name in ("sparkguard_memory_available_bytes", "sparkguard_guard_signal_bytes",
                     "sparkguard_term_below_bytes", "sparkguard_last_poll_timestamp_seconds",
                     "sparkguard_poll_duration_seconds_count"):
            prom.wait(name, lambda n=name: prom.query(f"{n}{{{job}}}"))
        term = prom.query(f"sparkguard_term_below_bytes{{{job}}}")
        assert int(float(term[0]["value"][1])) == low_line
        state = prom.query(f'sparkguard_guard_state{{{job},state="ok"}}')
        assert state and state[0]["value"][1] == "1"
        assert prom.query(f'sparkguard_incidents_total{{{job},kind="memory"}}')[0]["value"][1] == "0"

        # every shipped rule is loaded and evaluates cleanly against the real series
        def rules_ok():
            rules = [r for g in prom.api("rules")["groups"] for r in g["rules"]]
            return rules if rules and all(r["health"] == "ok" for r in rules) else None
        names = {r["name"] for r in prom.wait("rules evaluated", rules_ok)}
        assert {"SparkguardIncident", "SparkguardMemoryBelowLine", "SparkguardLinkDown"} <= names
        assert not firing(prom, "SparkguardIncident")
        assert not firing(prom, "SparkguardDown")

        # the guard acts: the line is moved 512 MiB above MemAvailable (SIGHUP reload); the fake
        # holds ~1.5 GiB, so its death brings memory back over the line
        line = line_above_now()
        guard.write_config({**guard.cfg, "guard": {"term_below": line, "grace": "5s"}})
        guard.proc.send_signal(signal.SIGHUP)
        try:
            fe.proc.wait(60)
        except subprocess.TimeoutExpired:
            raise AssertionError("guard did not TERM the fake engine; guard log:\n" + guard.log()[-3000:]) from None

        alerts = prom.wait("SparkguardIncident firing", lambda: firing(prom, "SparkguardIncident"), timeout=30)
        a = alerts[0]
        assert a["labels"]["kind"] == "memory" and a["labels"]["severity"] == "warning"
        assert a["labels"]["instance"] == f"127.0.0.1:{mport}"
        assert "memory incident" in a["annotations"]["summary"]
        sent = prom.wait("SIGTERM counted", lambda: [r for r in prom.query(
            f'sparkguard_signals_total{{{job},signal="SIGTERM"}}') if float(r["value"][1]) >= 1])
        assert sent
    finally:
        if fe is not None:
            fe.stop()
        if prom is not None:
            prom.close()
        rc = guard.stop()
        shutil.rmtree(guard.tmp, ignore_errors=True)
    assert rc == 0, guard.log()[-3000:]

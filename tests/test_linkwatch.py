"""LinkWatch against real netlink: a veth pair in a network namespace the test creates.

Nothing here touches a host interface: links are created, flipped and deleted only inside a
namespace with a unique name, which is removed (with its veths) in a finally.  Reading the
host's ``lo`` (read-only) checks the sysfs speed path.
"""

from __future__ import annotations

import os
import queue
import shutil
import subprocess
import sys
import time
import urllib.request
import uuid

import pytest

from conftest import ROOT, sg_env

pyroute2 = pytest.importorskip("pyroute2")

from sparkguard import config  # noqa: E402
from sparkguard.linkwatch import LinkWatch, read_links, valid_ifname  # noqa: E402

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (network namespaces)")

WAIT = 2.0          # generous bound for "follows within a second" on a loaded 2-core box


class Ns:
    """A network namespace with a veth pair ``a`` <-> ``b`` inside, both up."""

    def __init__(self):
        from pyroute2 import IPRoute, netns

        self.name = "sgtest-" + uuid.uuid4().hex[:10]
        tag = uuid.uuid4().hex[:6]
        self.a, self.b = f"sga{tag}", f"sgb{tag}"
        netns.create(self.name)
        self.ipr = IPRoute(netns=self.name, flags=0)
        self.ipr.link("add", ifname=self.a, kind="veth", peer={"ifname": self.b})
        self.set(self.a, "up")
        self.set(self.b, "up")

    def idx(self, ifname: str) -> int:
        return self.ipr.link_lookup(ifname=ifname)[0]

    def set(self, ifname: str, state: str) -> None:
        self.ipr.link("set", index=self.idx(ifname), state=state)

    def close(self):
        from pyroute2 import netns

        try:
            self.ipr.close()
        finally:
            netns.remove(self.name)


@pytest.fixture
def ns():
    n = Ns()
    try:
        yield n
    finally:
        n.close()
        assert n.name not in os.listdir("/var/run/netns")


class Recorder:
    """Callbacks that put what they receive on queues the test awaits (bounded)."""

    def __init__(self):
        self.changes: queue.Queue = queue.Queue()
        self.incidents: queue.Queue = queue.Queue()

    def on_change(self, ifname, up):
        self.changes.put((ifname, up, time.monotonic()))

    def on_incident(self, inc):
        self.incidents.put((inc, time.monotonic()))

    def change(self, timeout=WAIT):
        return self.changes.get(timeout=timeout)

    def incident(self, timeout=WAIT):
        return self.incidents.get(timeout=timeout)


def watch(ns, rec, interfaces, down_after=0.3):
    w = LinkWatch(interfaces, down_after, rec.on_incident, rec.on_change, netns=ns.name)
    w.start()
    return w


def serve(w):
    """Expose the collector on a real HTTP endpoint (loopback, free port); returns (url, server)."""
    from prometheus_client import CollectorRegistry, start_http_server

    reg = CollectorRegistry()
    reg.register(w.collector())
    server, _thread = start_http_server(0, addr="127.0.0.1", registry=reg)
    return f"http://127.0.0.1:{server.server_port}/metrics", server


def scrape(url) -> dict:
    """``{(name, interface): value}`` from a real scrape."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=5) as r:
        text = r.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, s.labels.get("interface"))] = s.value
    return out


def test_initial_state_metrics_and_missing_interface(ns):
    rec = Recorder()
    w = watch(ns, rec, [ns.a, "sgmissing0"])
    url, server = serve(w)
    try:
        got = {rec.change()[:2], rec.change()[:2]}
        assert got == {(ns.a, True), ("sgmissing0", False)}
        m = scrape(url)
        assert m[("sparkguard_link_up", ns.a)] == 1
        assert m[("sparkguard_link_carrier", ns.a)] == 1
        # veth reports 10000 Mb/s (drivers/net/veth.c) = 1.25e9 bytes/s, read by ETHTOOL_GSET in the netns
        assert m[("sparkguard_link_speed_bytes_per_second", ns.a)] == 10_000 * 125_000
        for c in ("rx_errors", "tx_errors", "rx_dropped", "tx_dropped", "carrier_changes"):
            assert (f"sparkguard_link_{c}_total", ns.a) in m
        # a missing interface: reported down, no counters, not fatal
        assert m[("sparkguard_link_up", "sgmissing0")] == 0
        assert m[("sparkguard_link_carrier", "sgmissing0")] == 0
        assert ("sparkguard_link_speed_bytes_per_second", "sgmissing0") not in m
        assert ("sparkguard_link_rx_errors_total", "sgmissing0") not in m
        snap = w.snapshot(refresh=True)
        assert snap["running"] and snap["netns"] == ns.name
        assert snap["interfaces"][ns.a]["up"] and snap["interfaces"][ns.a]["speed_bytes_per_second"] == 1_250_000_000
        assert snap["interfaces"]["sgmissing0"] == {**snap["interfaces"]["sgmissing0"], "present": False, "up": False}
        assert rec.incidents.empty()          # down at start is reported, not an incident
    finally:
        server.shutdown()
        w.stop()
    assert not w.running


def test_promtool_accepts_the_link_metrics(ns):
    promtool = shutil.which("promtool")
    if not promtool:
        pytest.skip("promtool not installed (tests/install-deps)")
    rec = Recorder()
    w = watch(ns, rec, [ns.a, "sgmissing0"])
    url, server = serve(w)
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            text = r.read()
    finally:
        server.shutdown()
        w.stop()
    p = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, timeout=30)
    assert p.returncode == 0, p.stdout.decode() + p.stderr.decode()


def test_link_down_longer_than_down_after_is_an_incident_and_up_closes_it(ns):
    rec = Recorder()
    w = watch(ns, rec, [ns.a], down_after=0.4)
    url, server = serve(w)
    try:
        assert rec.change()[:2] == (ns.a, True)
        before = scrape(url)[("sparkguard_link_carrier_changes_total", ns.a)]

        t0 = time.monotonic()
        ns.set(ns.b, "down")                  # peer down: our end loses carrier (LOWERLAYERDOWN)
        name, up, t = rec.change()
        assert (name, up) == (ns.a, False) and t - t0 < 1.0
        m = scrape(url)
        assert m[("sparkguard_link_up", ns.a)] == 0
        assert m[("sparkguard_link_carrier", ns.a)] == 0
        assert ("sparkguard_link_speed_bytes_per_second", ns.a) not in m
        assert m[("sparkguard_link_carrier_changes_total", ns.a)] > before

        inc, t_inc = rec.incident()
        assert 0.4 <= t_inc - t0 < 1.4
        assert inc["kind"] == "link" and inc["outcome"] == "link_down" and inc["ended_at"] is None
        assert [e["event"] for e in inc["timeline"]] == ["down", "incident"]
        assert inc["link"]["interface"] == ns.a and inc["link"]["operstate"] == "LOWERLAYERDOWN"
        assert inc["timeline"][1]["t"] >= 0.4
        for key in ("id", "host", "boot_id", "started_at", "dry_run", "thresholds", "meminfo", "psi_memory",
                    "zram", "target", "summary", "drill"):
            assert key in inc
        assert inc["meminfo"]["MemAvailable"] > 0
        assert w.snapshot()["interfaces"][ns.a]["open_incident"] == inc["id"]

        t1 = time.monotonic()
        ns.set(ns.b, "up")
        name, up, t = rec.change()
        assert (name, up) == (ns.a, True) and t - t1 < 1.0
        done, _ = rec.incident()
        assert done["id"] == inc["id"]
        assert done["outcome"] == "recovered" and done["ended_at"] >= done["started_at"]
        assert [e["event"] for e in done["timeline"]] == ["down", "incident", "up"]
        m = scrape(url)
        assert m[("sparkguard_link_up", ns.a)] == 1 and m[("sparkguard_link_carrier", ns.a)] == 1
        assert w.snapshot()["interfaces"][ns.a]["open_incident"] is None
    finally:
        server.shutdown()
        w.stop()


def test_short_flap_is_no_incident(ns):
    rec = Recorder()
    w = watch(ns, rec, [ns.a], down_after=1.5)
    try:
        assert rec.change()[:2] == (ns.a, True)
        ns.set(ns.a, "down")                  # admin down of the watched end itself
        assert rec.change()[:2] == (ns.a, False)
        assert w.snapshot()["interfaces"][ns.a]["operstate"] == "DOWN"
        ns.set(ns.a, "up")
        assert rec.change()[:2] == (ns.a, True)
        with pytest.raises(queue.Empty):
            rec.incident(timeout=2.0)         # past down_after: the timer was cancelled
        assert w.snapshot()["incidents"] == 0
    finally:
        w.stop()


def test_deleted_and_recreated_interface(ns):
    rec = Recorder()
    w = watch(ns, rec, [ns.a], down_after=0.3)
    try:
        assert rec.change()[:2] == (ns.a, True)
        ns.ipr.link("del", index=ns.idx(ns.a))          # deletes the pair
        assert rec.change()[:2] == (ns.a, False)
        assert w.snapshot()["interfaces"][ns.a]["present"] is False
        inc, _ = rec.incident()
        # the kernel first announces the interface admin-down (RTM_NEWLINK), then RTM_DELLINK
        assert inc["link"]["present"] is False
        ns.ipr.link("add", ifname=ns.a, kind="veth", peer={"ifname": ns.b})
        ns.set(ns.a, "up")
        ns.set(ns.b, "up")
        assert rec.change()[:2] == (ns.a, True)
        done, _ = rec.incident()
        assert done["id"] == inc["id"] and done["outcome"] == "recovered"
    finally:
        w.stop()


def test_incident_reaches_the_reporter_store_and_the_incidents_command(ns, tmp_path):
    """on_incident wired to the real Reporter (as the daemon does): the JSON file ends complete."""
    from conftest import run_sparkguard
    from sparkguard.incidents.store import IncidentStore
    from sparkguard.reporter import Reporter

    rep = Reporter(str(tmp_path), journal="off")
    rec = Recorder()

    def on_incident(inc):
        rep.finish(inc)
        rec.on_incident(inc)

    w = LinkWatch([ns.a], 0.2, on_incident, rec.on_change, netns=ns.name)
    w.start()
    try:
        assert rec.change()[:2] == (ns.a, True)
        ns.set(ns.b, "down")
        inc, _ = rec.incident()
        ns.set(ns.b, "up")
        done, _ = rec.incident()
    finally:
        w.stop()
        rep.close()
    stored = IncidentStore(str(tmp_path)).load(inc["id"])
    assert stored["outcome"] == "recovered" and [e["event"] for e in stored["timeline"]] == ["down", "incident", "up"]
    p = run_sparkguard("incidents", inc["id"], "--dir", str(tmp_path), "--no-journal")
    assert p.returncode == 0, p.stderr
    assert inc["id"] in p.stdout and "link" in p.stdout and ns.a in p.stdout


def test_callback_errors_do_not_stop_the_watch(ns):
    seen = queue.Queue()

    def bad_change(ifname, up):
        seen.put(up)
        raise RuntimeError("supervisor bug")

    w = LinkWatch([ns.a], 0.2, lambda inc: 1 / 0, bad_change, netns=ns.name)
    w.start()
    try:
        assert seen.get(timeout=WAIT) is True
        ns.set(ns.b, "down")
        assert seen.get(timeout=WAIT) is False
        deadline = time.monotonic() + WAIT
        while w.snapshot()["incidents"] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)                  # the incident callback raises; only the count shows it
        assert w.snapshot()["incidents"] == 1
        ns.set(ns.b, "up")
        assert seen.get(timeout=WAIT) is True
        assert w.running
    finally:
        w.stop()


def test_missing_netns_fails_start_and_creates_nothing():
    name = "sgtest-absent-" + uuid.uuid4().hex[:8]
    w = LinkWatch(["eth0"], 1.0, lambda inc: None, netns=name)
    with pytest.raises(OSError):
        w.start()
    assert not os.path.exists(f"/var/run/netns/{name}")
    assert not w.running


def test_host_namespace_reads_sysfs_read_only():
    """The daemon's own namespace: ``lo`` (operstate UNKNOWN, LOWER_UP) counts as up and its
    /sys/class/net/lo/speed is unreadable (EINVAL), so no speed.  Nothing is changed on the host."""
    rec = Recorder()
    w = LinkWatch(["lo"], 5.0, rec.on_incident, rec.on_change)
    w.start()
    try:
        assert rec.change()[:2] == ("lo", True)
        snap = w.snapshot(refresh=True)["interfaces"]["lo"]
        assert snap["up"] and snap["speed_bytes_per_second"] is None
        assert snap["rx_errors"] >= 0 and snap["carrier_changes"] is not None
    finally:
        w.stop()
    links = read_links(["lo", "sgmissing0"])
    assert links["lo"]["up"] is True and links["sgmissing0"]["present"] is False


def test_read_links_in_netns(ns):
    links = read_links([ns.a, "sgmissing0"], netns=ns.name)
    assert links[ns.a]["up"] and links[ns.a]["speed_bytes_per_second"] == 1_250_000_000
    assert links["sgmissing0"] == {**links["sgmissing0"], "present": False, "up": False}


def test_bad_arguments():
    for bad in ("", "a/b", "x" * 16, "a b", ".."):
        assert not valid_ifname(bad)
        with pytest.raises(ValueError):
            LinkWatch([bad], 1.0, lambda inc: None)
    with pytest.raises(ValueError):
        LinkWatch(["eth0"], -1, lambda inc: None)


def test_link_config_section():
    cfg = config.from_dict({"link": {"interfaces": ["enp1s0f0np0", "enp1s0f1np1"], "down_after": "2s",
                                     "mark_unhealthy": True}}, "f.yaml", mem_total=1 << 40)
    assert cfg.link.interfaces == ("enp1s0f0np0", "enp1s0f1np1")
    assert cfg.link.down_after == 2.0 and cfg.link.mark_unhealthy is True
    d = config.from_dict({}, mem_total=1 << 40).link
    assert d.interfaces == () and d.down_after == 5.0 and d.mark_unhealthy is False
    for body, key, value in (({"interfaces": "eth0"}, "link.interfaces", "eth0"),
                             ({"interfaces": ["bad/name"]}, "link.interfaces", ["bad/name"]),
                             ({"interfaces": ["e", "e"]}, "link.interfaces", ["e", "e"]),
                             ({"down_after": "soon"}, "link.down_after", "soon"),
                             ({"mark_unhealthy": "yes"}, "link.mark_unhealthy", "yes"),
                             ({"speed": 1}, "link.speed", 1)):
        with pytest.raises(config.ConfigError) as e:
            config.from_dict({"link": body}, "f.yaml", mem_total=1 << 40)
        assert (e.value.path, e.value.key, e.value.value) == ("f.yaml", key, value)


def test_importing_linkwatch_does_not_import_pyroute2():
    """The daemon's RSS budget: pyroute2 loads only when a watch starts."""
    code = ("import sys, sparkguard.config, sparkguard.linkwatch; "
            "assert 'pyroute2' not in sys.modules and 'asyncio' not in sys.modules, sorted(sys.modules)")
    p = subprocess.run([sys.executable, "-c", code], env=sg_env(), cwd=ROOT, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0, p.stderr


def test_daemon_reports_a_link_incident_and_exports_link_metrics(ns, tmp_path):
    """``sparkguard run`` with ``link.interfaces``, started inside the test's namespace."""
    import glob
    import json

    import yaml
    inc_dir = tmp_path / "incidents"
    cfg = tmp_path / "sg.yaml"
    cfg.write_text(yaml.safe_dump({
        "link": {"interfaces": [ns.a], "down_after": "300ms"},
        "metrics": {"listen": "127.0.0.1:8799"},     # the namespace's own loopback
        "incidents": {"dir": str(inc_dir), "journal": "off"},
        "targets": {"match": ["^sgtest-never-matches-" + uuid.uuid4().hex]},
    }))
    ns.set("lo", "up")
    log = open(tmp_path / "guard.log", "w")
    guard = subprocess.Popen(["ip", "netns", "exec", ns.name, sys.executable, "-m", "sparkguard", "run",
                              "--config", str(cfg)], env=sg_env(), stdout=log, stderr=subprocess.STDOUT)

    def ns_scrape() -> str:
        r = subprocess.run(["ip", "netns", "exec", ns.name, sys.executable, "-c",
                            "import urllib.request;print(urllib.request.urlopen("
                            "'http://127.0.0.1:8799/metrics',timeout=5).read().decode())"],
                           capture_output=True, text=True, timeout=30)
        return r.stdout if r.returncode == 0 else ""

    def wait(pred, timeout):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            v = pred()
            if v:
                return v
            time.sleep(0.1)  # polling files/HTTP of another process: no event to await
        raise AssertionError((tmp_path / "guard.log").read_text()[-2000:])

    try:
        up_line = f'sparkguard_link_up{{interface="{ns.a}"}} 1.0'
        wait(lambda: up_line in ns_scrape(), 30)
        ns.set(ns.a, "down")
        down_line = f'sparkguard_link_up{{interface="{ns.a}"}} 0.0'
        wait(lambda: down_line in ns_scrape(), 10)
        files = wait(lambda: glob.glob(str(inc_dir / "*.json")), 10)
        inc = json.loads(open(files[0]).read())
        assert inc["kind"] == "link" and ns.a in json.dumps(inc)
        wait(lambda: 'sparkguard_incidents_total{kind="link"} 1.0' in ns_scrape(), 10)
        ns.set(ns.a, "up")
        wait(lambda: json.loads(open(files[0]).read()).get("outcome") == "recovered", 10)
    finally:
        guard.terminate()
        guard.wait(15)
        log.close()
    assert guard.returncode == 0


def test_status_and_doctor_show_the_links(ns, tmp_path):
    """``sparkguard status`` and ``doctor`` run in the namespace name a down link and an up one."""
    import json

    import yaml
    cfg = tmp_path / "sg.yaml"
    cfg.write_text(yaml.safe_dump({"link": {"interfaces": ["lo", ns.a, "sgmissing0"]},
                                   "metrics": {"listen": "off"}}))
    ns.set("lo", "up")
    ns.set(ns.a, "down")

    def in_ns(*args):
        return subprocess.run(["ip", "netns", "exec", ns.name, sys.executable, "-m", "sparkguard", *args],
                              env=sg_env(), capture_output=True, text=True, timeout=60)

    st = in_ns("status", "--config", str(cfg))
    assert st.returncode == 0, st.stderr
    assert "lo: UP" in st.stdout and f"{ns.a}: DOWN" in st.stdout and "sgmissing0: MISSING" in st.stdout
    doc = in_ns("doctor", "--config", str(cfg), "--json")
    checks = {c["name"]: c for c in json.loads(doc.stdout)["checks"]}
    msg = checks["links"]["message"]
    assert checks["links"]["status"] == "FAIL" and f"{ns.a} down" in msg and "sgmissing0 missing" in msg
    assert doc.returncode != 0

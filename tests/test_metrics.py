"""The metrics endpoint: a real HTTP server on loopback, scraped over HTTP, linted by promtool."""

from __future__ import annotations

import errno
import importlib.util
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from sparkguard import __version__, config, metrics
from sparkguard.metrics import httploop
from sparkguard.metrics.server import RETRY_FIRST, RETRY_MAX

GiB = 1024**3


def snapshot_dict(**over) -> dict:
    """A snapshot as the daemon's Guard.snapshot() returns it mid-incident (TEAM.md)."""
    now = time.time()
    s = {
        "available_bytes": int(0.6 * GiB), "total_bytes": int(121.7 * GiB),
        "swap_free_bytes": 5 * GiB, "swap_total_bytes": 6 * GiB,
        "signal_bytes": int(0.6 * GiB), "signal": "available",
        "term_below_bytes": int(0.75 * GiB), "kill_below_bytes": None,
        "grace_seconds": 10.0, "poll_interval_seconds": 0.2,
        "state": "term_sent", "dry_run": False,
        "signals_sent": {"SIGTERM": 1, "SIGKILL": 0},
        "incidents": {"memory": 3, "drill": 1},
        "last_incident_timestamp": now - 2.5,
        "poll_count": 123456, "poll_seconds_sum": 0.987, "polls_total": 1234567,
        "last_poll_timestamp": now - 0.1, "started_timestamp": now - 3600,
        "config_path": "/etc/sparkguard/sparkguard.yaml",
        "config_reloads": {"ok": 2, "failed": 1},
        "victim": {"pid": 4242, "title": "vllm serve demo"},
    }
    s.update(over)
    return s


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/plain")
        return r.read().decode()


def samples(text: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted label items): value} from exposition text (prometheus_client's parser)."""
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def types(text: str) -> dict[str, str]:
    return {f.name: f.type for f in text_string_to_metric_families(text)}


def promtool(text: str) -> subprocess.CompletedProcess:
    assert shutil.which("promtool"), "promtool missing: run tests/install-deps (Debian package prometheus)"
    return subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)


@pytest.fixture
def server():
    """Start servers on free loopback ports; stop them all afterwards."""
    started = []

    def start(snapshot, **kw):
        srv = metrics.start_server(("127.0.0.1", 0), snapshot, **kw)
        started.append(srv)
        return srv

    yield start
    for s in started:
        s.stop()


def test_scrape_over_http_carries_the_snapshot_and_passes_promtool(server):
    snap = snapshot_dict()
    srv = server(lambda: snap)
    assert srv.address[0] == "127.0.0.1" and srv.address[1] > 0
    text = scrape(srv.url)
    v = samples(text)

    assert v[("sparkguard_memory_available_bytes", ())] == int(0.6 * GiB)
    assert v[("sparkguard_memory_total_bytes", ())] == int(121.7 * GiB)
    assert v[("sparkguard_swap_free_bytes", ())] == 5 * GiB
    assert v[("sparkguard_swap_total_bytes", ())] == 6 * GiB
    assert v[("sparkguard_guard_signal_bytes", ())] == int(0.6 * GiB)
    assert v[("sparkguard_term_below_bytes", ())] == int(0.75 * GiB)
    assert v[("sparkguard_grace_seconds", ())] == 10.0
    assert v[("sparkguard_poll_interval_seconds", ())] == 0.2
    assert v[("sparkguard_dry_run", ())] == 0
    # one-hot state
    state = {dict(k[1])["state"]: val for k, val in v.items() if k[0] == "sparkguard_guard_state"}
    assert state == {"ok": 0, "term_sent": 1, "kill_sent": 0, "recovering": 0, "no_target": 0}
    # counters with _total and labels; SIGKILL present at 0 so rate() works from the first kill
    assert v[("sparkguard_signals_total", (("signal", "SIGTERM"),))] == 1
    assert v[("sparkguard_signals_total", (("signal", "SIGKILL"),))] == 0
    assert v[("sparkguard_incidents_total", (("kind", "memory"),))] == 3
    assert v[("sparkguard_incidents_total", (("kind", "drill"),))] == 1
    assert v[("sparkguard_config_reloads_total", (("result", "ok"),))] == 2
    assert v[("sparkguard_config_reloads_total", (("result", "failed"),))] == 1
    assert v[("sparkguard_poll_duration_seconds_count", ())] == 123456
    assert v[("sparkguard_polls_total", ())] == 1234567
    assert v[("sparkguard_poll_duration_seconds_sum", ())] == pytest.approx(0.987)
    assert v[("sparkguard_last_incident_timestamp_seconds", ())] == pytest.approx(snap["last_incident_timestamp"])
    assert v[("sparkguard_last_poll_timestamp_seconds", ())] == pytest.approx(snap["last_poll_timestamp"])
    assert v[("sparkguard_start_time_seconds", ())] == pytest.approx(snap["started_timestamp"])
    assert v[("sparkguard_build_info", (("hostname", socket.gethostname()), ("version", __version__)))] == 1
    # kill_below is off: the metric is absent, not 0 (0 would read as "a floor at 0 bytes")
    assert not any(k[0] == "sparkguard_kill_below_bytes" for k in v)
    # the process collector of this process
    assert v[("process_resident_memory_bytes", ())] > 1024 * 1024
    assert ("process_cpu_seconds_total", ()) in v

    t = types(text)
    assert t["sparkguard_signals"] == "counter"
    assert t["sparkguard_incidents"] == "counter"
    assert t["sparkguard_poll_duration_seconds"] == "summary"
    assert t["sparkguard_memory_available_bytes"] == "gauge"
    assert "# TYPE sparkguard_signals_total counter" in text

    # every HELP says something
    for line in text.splitlines():
        if line.startswith("# HELP sparkguard_"):
            assert len(line.split(" ", 3)[3]) > 20, line

    r = promtool(text)
    assert r.returncode == 0 and r.stdout.strip() == "" and r.stderr.strip() == "", r.stdout + r.stderr


def test_kill_below_appears_when_configured_and_dry_run_is_one(server):
    srv = server(lambda: snapshot_dict(kill_below_bytes=256 * 1024**2, dry_run=True, state="ok"))
    text = scrape(srv.url)
    v = samples(text)
    assert v[("sparkguard_kill_below_bytes", ())] == 256 * 1024**2
    assert v[("sparkguard_dry_run", ())] == 1
    assert v[("sparkguard_guard_state", (("state", "ok"),))] == 1
    assert promtool(text).returncode == 0


def test_no_target_state_is_exported_from_the_first_scrape(server):
    """Below the line with nothing to signal: state no_target is 1 and every other state 0; while ok,
    the no_target row is there at 0 (so an alert on it has a series from the start)."""
    state = {"state": "no_target"}
    srv = server(lambda: snapshot_dict(**state))
    for want in ("no_target", "ok"):
        state["state"] = want
        text = scrape(srv.url)
        v = samples(text)
        got = {dict(k[1])["state"]: val for k, val in v.items() if k[0] == "sparkguard_guard_state"}
        assert got == {s: (1 if s == want else 0) for s in ("ok", "term_sent", "kill_sent", "recovering", "no_target")}
        assert promtool(text).returncode == 0


def test_values_are_read_at_scrape_time(server):
    """The collector holds nothing: each scrape calls snapshot() and reads PSI anew."""
    calls = []

    def snap():
        calls.append(1)
        return snapshot_dict(available_bytes=len(calls) * GiB)

    srv = server(snap)
    assert samples(scrape(srv.url))[("sparkguard_memory_available_bytes", ())] == 1 * GiB
    assert samples(scrape(srv.url))[("sparkguard_memory_available_bytes", ())] == 2 * GiB


def psi_totals() -> dict[str, float]:
    out = {}
    with open("/proc/pressure/memory") as f:
        for line in f:
            p = line.split()
            out[p[0]] = int(p[-1].partition("=")[2]) / 1e6
    return out


@pytest.mark.skipif(not os.path.exists("/proc/pressure/memory"), reason="kernel without PSI")
def test_psi_is_read_from_the_kernel_as_ratios(server):
    before = psi_totals()
    srv = server(snapshot_dict)
    v = samples(scrape(srv.url))
    after = psi_totals()
    for kind in ("some", "full"):
        for w in ("avg10", "avg60", "avg300"):
            r = v[(f"sparkguard_pressure_memory_{kind}_ratio", (("window", w),))]
            assert 0.0 <= r <= 1.0
        stalled = v[("sparkguard_pressure_memory_stalled_seconds_total", (("kind", kind),))]
        assert before[kind] <= stalled <= after[kind]


def test_snapshot_failure_still_answers_with_kernel_metrics(server, caplog):
    def broken():
        raise RuntimeError("guard not started")

    srv = server(broken)
    text = scrape(srv.url)
    v = samples(text)
    # the guard's memory figures come from the snapshot; MemFree is read at scrape time (a kernel metric)
    assert not any(k[0].startswith("sparkguard_memory_") and k[0] != "sparkguard_memory_free_bytes" for k in v)
    assert ("sparkguard_memory_free_bytes", ()) in v
    assert ("sparkguard_build_info", (("hostname", socket.gethostname()), ("version", __version__))) in v
    assert ("process_resident_memory_bytes", ()) in v
    assert "guard not started" in caplog.text
    assert promtool(text).returncode == 0


def test_extra_collectors_and_a_collector_registered_later(server):
    from prometheus_client.metrics_core import GaugeMetricFamily

    class Engine:
        def collect(self):
            yield GaugeMetricFamily("sparkguard_engine_up", "1 when the engine process runs.", value=1)

    class Link:
        def collect(self):
            g = GaugeMetricFamily("sparkguard_link_up", "1 when the interface is up.", labels=["interface"])
            g.add_metric(["enp1s0f0np0"], 1)
            yield g

    srv = server(snapshot_dict, extra_collectors=[Engine()])
    assert samples(scrape(srv.url))[("sparkguard_engine_up", ())] == 1
    srv.register_collector(Link())
    text = scrape(srv.url)
    assert samples(text)[("sparkguard_link_up", (("interface", "enp1s0f0np0"),))] == 1
    assert promtool(text).returncode == 0


def test_prometheus_style_request_gzip_openmetrics(server):
    """Prometheus itself asks for OpenMetrics, gzipped; the small-stack thread must serve that too."""
    import gzip

    from prometheus_client.openmetrics.parser import text_string_to_metric_families as om_parse

    srv = server(snapshot_dict)
    req = urllib.request.Request(srv.url, headers={
        "Accept-Encoding": "gzip",
        "Accept": "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5"})
    with urllib.request.urlopen(req, timeout=10) as r:
        assert r.headers["Content-Encoding"] == "gzip"
        assert r.headers["Content-Type"].startswith("application/openmetrics-text")
        text = gzip.decompress(r.read()).decode()
    fams = {f.name: f for f in om_parse(text)}
    assert fams["sparkguard_signals"].type == "counter"
    assert {s.labels["signal"]: s.value for s in fams["sparkguard_signals"].samples
            if s.name == "sparkguard_signals_total"} == {"SIGTERM": 1, "SIGKILL": 0}
    assert fams["sparkguard_build"].type == "info"


def test_port_in_use_names_the_address():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(metrics.MetricsListenError) as ei:
            metrics.start_server(("127.0.0.1", port), snapshot_dict)
    assert ei.value.errno == errno.EADDRINUSE
    assert f"127.0.0.1:{port}" in str(ei.value)
    assert "metrics.listen" in str(ei.value)
    assert isinstance(ei.value, OSError)


def test_stop_closes_the_port(server):
    srv = metrics.start_server(("127.0.0.1", 0), snapshot_dict)
    url, port = srv.url, srv.address[1]
    scrape(url)
    srv.stop()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(url, timeout=5)
    # the port is free again: a restarted daemon can bind it
    again = metrics.start_server(("127.0.0.1", port), snapshot_dict)
    try:
        assert samples(scrape(again.url))[("sparkguard_memory_available_bytes", ())] > 0
    finally:
        again.stop()


def test_defaults_listen_on_loopback_8799():
    assert metrics.DEFAULT_LISTEN == ("127.0.0.1", 8799)
    assert config.Config().metrics.listen == metrics.DEFAULT_LISTEN


def test_empty_host_binds_loopback_not_all_interfaces(server):
    srv = metrics.start_server(("", 0), snapshot_dict)
    try:
        assert srv.address[0] == "127.0.0.1"
    finally:
        srv.stop()


def test_scrapes_cost_no_stack_memory_under_mlockall(tmp_path):
    """The daemon mlockall()s: a scrape thread with an 8 MiB default stack would add 8 MiB RSS."""
    script = tmp_path / "locked.py"
    script.write_text(textwrap.dedent("""
        import ctypes, sys, urllib.request
        from sparkguard import metrics
        def rss():
            for line in open("/proc/self/status"):
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.mlockall(3) != 0:   # MCL_CURRENT | MCL_FUTURE
            print("SKIP mlockall failed", ctypes.get_errno()); sys.exit(0)
        srv = metrics.start_server(("127.0.0.1", 0), dict)
        before = rss()   # glibc caches a dead thread's stack: the first scrape is the one that shows
        for _ in range(5):
            urllib.request.urlopen(srv.url, timeout=10).read()
        print("GROWTH", rss() - before)
        srv.stop()
    """))
    from conftest import sg_env
    r = subprocess.run([sys.executable, str(script)], env=sg_env(), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    if r.stdout.startswith("SKIP"):
        pytest.skip(r.stdout)
    growth = int(r.stdout.split()[-1])
    assert growth < 4 * 1024**2, f"RSS grew {growth} bytes over 5 scrapes"


@pytest.fixture
def zram_device(own_zram):
    """Our own zram device (conftest.own_zram) with 4 MiB of compressible data written to it."""
    name = own_zram
    with open(f"/sys/block/{name}/disksize", "w") as f:
        f.write(str(64 * 1024**2))
    data = (b"sparkguard metrics test " * 200)[:4096] * 1024   # 4 MiB, compresses well
    fd = os.open(f"/dev/{name}", os.O_WRONLY)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    return name


def test_zram_device_stats(server, zram_device):
    srv = server(snapshot_dict)
    text = scrape(srv.url)
    v = samples(text)
    lab = (("device", zram_device),)
    with open(f"/sys/block/{zram_device}/mm_stat") as f:
        mm = [int(x) for x in f.read().split()]
    assert v[("sparkguard_zram_disksize_bytes", lab)] == 64 * 1024**2
    assert v[("sparkguard_zram_orig_data_bytes", lab)] == mm[0] >= 4 * 1024**2
    assert 0 < v[("sparkguard_zram_compr_data_bytes", lab)] < v[("sparkguard_zram_orig_data_bytes", lab)]
    assert v[("sparkguard_zram_mem_used_bytes", lab)] > 0
    r = promtool(text)
    assert r.returncode == 0, r.stdout + r.stderr


def wait_for_scrape(url: str, proc: subprocess.Popen, timeout: float = 30.0) -> str:
    """Scrape ``url`` as soon as the daemon listens; fail if it exits or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return scrape(url)
        except (urllib.error.URLError, ConnectionError):
            if proc.poll() is not None:
                out, err = proc.communicate(timeout=5)
                pytest.fail(f"sparkguard run exited {proc.returncode}: {err}")
            if time.monotonic() > deadline:
                pytest.fail(f"sparkguard run did not serve {url} within {timeout} s")
            time.sleep(0.05)  # nothing to await across processes but the port itself


@pytest.mark.skipif(importlib.util.find_spec("sparkguard.daemon") is None, reason="sparkguard.daemon not merged yet")
def test_sparkguard_run_serves_metrics_end_to_end(tmp_path):
    from conftest import mem_available, sg_env, sparkguard_cmd

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = tmp_path / "sparkguard.yaml"
    cfg.write_text(textwrap.dedent(f"""
        guard:
          term_below: 128MiB
          dry_run: true
        targets:
          match: ['^sgtest-never-{os.getpid()}-{time.monotonic_ns()}$']
        metrics:
          listen: 127.0.0.1:{port}
        incidents:
          dir: {tmp_path}/incidents
          journal: "off"
    """))
    proc = subprocess.Popen(sparkguard_cmd("run", "--config", str(cfg)), env=sg_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}/metrics"
        text = wait_for_scrape(url, proc)
        deadline = time.monotonic() + 30
        while not samples(text).get(("sparkguard_poll_duration_seconds_count", ())) and time.monotonic() < deadline:
            time.sleep(0.05)
            text = scrape(url)
        v = samples(text)
        assert v[("sparkguard_poll_duration_seconds_count", ())] > 0
        assert abs(v[("sparkguard_memory_available_bytes", ())] - mem_available()) < 2 * GiB
        assert v[("sparkguard_term_below_bytes", ())] == 128 * 1024**2
        assert v[("sparkguard_guard_state", (("state", "ok"),))] == 1
        assert v[("sparkguard_dry_run", ())] == 1
        assert v[("sparkguard_signals_total", (("signal", "SIGTERM"),))] == 0
        assert time.time() - v[("sparkguard_last_poll_timestamp_seconds", ())] < 10
        assert v[("sparkguard_build_info", (("hostname", socket.gethostname()), ("version", __version__)))] == 1
        with open(f"/proc/{proc.pid}/status") as f:
            rss = next(int(x.split()[1]) * 1024 for x in f if x.startswith("VmRSS:"))
        assert abs(v[("process_resident_memory_bytes", ())] - rss) < 16 * 1024**2  # the daemon's own RSS
        r = promtool(text)
        assert r.returncode == 0 and not (r.stdout + r.stderr).strip(), r.stdout + r.stderr

        from conftest import run_sparkguard
        st = run_sparkguard("status", "--config", str(cfg))
        assert st.returncode == 0, st.stderr
        assert "state ok" in st.stdout and "DRY RUN" in st.stdout
    finally:
        proc.terminate()
        try:
            proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate(timeout=10)


def test_a_taken_port_is_an_error_the_guard_runs_and_binds_once_it_is_free():
    """A local user who binds the metrics port first no longer keeps the guard from starting."""
    from conftest import run_sparkguard
    from guardrun import GuardProc
    from sparkguard.host import doctor

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    url = f"http://127.0.0.1:{port}/metrics"
    g = GuardProc({"guard": {"dry_run": True, "term_below": "128MiB"},
                   "targets": {"match": [f"^sgtest-never-{os.getpid()}-{time.monotonic_ns()}$"]},
                   "metrics": {"listen": f"127.0.0.1:{port}"}})
    try:
        held = f"metrics NOT serving on 127.0.0.1:{port}: address in use (held by pid {os.getpid()} "
        assert held in g.wait_ready()["STATUS"]
        g.wait_log(held)
        assert "ERROR" in next(ln for ln in g.log().splitlines() if held in ln)
        # the loop keeps guarding: once the port is free, the loop's own STATUS= says it serves
        # (below), sent at once when the endpoint binds

        st = run_sparkguard("status", "--config", g.config_path)
        assert st.returncode == 0, st.stderr
        assert f"the port is held by pid {os.getpid()} " in st.stdout and "NOT the guard" in st.stdout
        runs = next(ln for ln in st.stdout.splitlines() if "a guard runs (pid " in ln)
        assert str(g.proc.pid) in runs.split("(pid ")[1].split(")")[0].split(", ")   # others may run too
        from sparkguard import config as cfgmod
        chk = doctor.check_metrics(doctor.Context(cfgmod.load(g.config_path)))
        assert chk.status == doctor.FAIL and f"held by pid {os.getpid()} " in chk.message

        taken.close()
        t0 = time.monotonic()
        text = wait_for_scrape(url, g.proc, timeout=RETRY_MAX / 2)
        # binds 1, 3, 7, 15 s after start: the port freed a few seconds in is bound within 10 s
        assert time.monotonic() - t0 < 10
        assert samples(text)[("sparkguard_guard_state", (("state", "ok"),))] == 1
        g.notify.wait_for(lambda m: "STATUS" in m and "NOT serving" not in m["STATUS"], timeout=10)
        g.wait_log(f"metrics on {url}: serving after")
        assert doctor.check_metrics(doctor.Context(cfgmod.load(g.config_path))).status == doctor.PASS
    finally:
        taken.close()
        assert g.stop() == 0


def _stalled(port: int, head: bytes) -> socket.socket:
    """A client that connected and sent ``head`` (part of a request), then nothing."""
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    if head:
        s.sendall(head)
    return s


def test_stalled_clients_do_not_hold_up_a_scrape(server):
    """More stalled clients than the connection cap, some mid-header: Prometheus is still answered at once."""
    srv = server(snapshot_dict)
    port = srv.address[1]
    stalled = [_stalled(port, b"GET /metrics HTTP/1.1\r\nHost: x\r\n" if i % 2 else b"")
               for i in range(httploop.MAX_CONNECTIONS + 8)]
    try:
        t0 = time.monotonic()
        v = samples(scrape(srv.url))
        assert time.monotonic() - t0 < 1.0
        assert v[("sparkguard_memory_available_bytes", ())] == int(0.6 * GiB)
    finally:
        for s in stalled:
            s.close()


def test_a_slow_drip_client_is_dropped_at_the_request_deadline(server):
    """One byte every 0.3 s never trips a per-read timeout; the whole-request deadline ends it."""
    srv = server(snapshot_dict)
    s = _stalled(srv.address[1], b"G")
    t0 = time.monotonic()
    try:
        s.settimeout(0.3)
        closed_after = None
        for ch in b"ET /metrics HTTP/1.1\r\nX-Slow: " + b"a" * 100:
            try:
                if s.recv(1) == b"":
                    closed_after = time.monotonic() - t0
                    break
            except socket.timeout:
                pass
            try:
                s.send(bytes([ch]))
            except OSError:
                closed_after = time.monotonic() - t0
                break
        assert closed_after is not None, "the server kept a dripping client past the request deadline"
        assert closed_after < httploop.REQUEST_DEADLINE + 1.0
    finally:
        s.close()


def test_an_oversized_request_head_is_refused(server):
    srv = server(snapshot_dict)
    s = _stalled(srv.address[1], b"GET /metrics HTTP/1.1\r\nX-Big: " + b"a" * (2 * httploop.MAX_HEAD) + b"\r\n\r\n")
    try:
        s.settimeout(5)
        answer = s.recv(4096)
        assert answer.startswith(b"HTTP/1.1 431 ")
    finally:
        s.close()
    assert samples(scrape(srv.url))[("sparkguard_memory_available_bytes", ())] == int(0.6 * GiB)


def test_a_flood_of_scrapes_is_answered_and_rendered_at_a_bounded_rate(server):
    """Many clients scraping as fast as they can: each gets a fresh answer, the registry is
    rendered at most once per RENDER_GAP, and a scrape among them is answered within a second."""
    import threading
    calls = []
    srv = server(lambda: calls.append(1) or snapshot_dict())
    stop = threading.Event()
    answered = []

    def flood():
        while not stop.is_set():
            try:
                scrape(srv.url)
                answered.append(1)
            except OSError:
                pass

    threads = [threading.Thread(target=flood) for _ in range(8)]
    for t in threads:
        t.start()
    try:
        t_start = time.monotonic()
        time.sleep(1.0)  # the flood runs for this long; nothing to await
        t0 = time.monotonic()
        scrape(srv.url)
        assert time.monotonic() - t0 < 1.0
    finally:
        stop.set()
        for t in threads:
            t.join(10)
    elapsed = time.monotonic() - t_start
    assert len(answered) > len(calls)          # requests share renderings
    assert len(calls) <= elapsed / httploop.RENDER_GAP + 2


def _own_listener_fd(port: int) -> int:
    """The fd of this process that listens on ``port``, found through /proc like portowner does."""
    from sparkguard import portowner
    links = {f"socket:[{ino}]" for ino in portowner.listening_inodes(port)}
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}") in links:
                return int(fd)
        except OSError:
            continue
    raise AssertionError(f"no fd of this process listens on {port}")


def test_a_server_whose_socket_breaks_binds_again_without_spinning(server):
    """The listening socket shut down under the endpoint (a fault it cannot cause itself): the
    endpoint logs it, binds again after the backoff and serves; meanwhile it does not spin."""
    import resource
    srv = metrics.start_server(("127.0.0.1", 0), snapshot_dict, retry=True)
    try:
        port = srv.address[1]
        scrape(srv.url)
        dup = socket.socket(fileno=os.dup(_own_listener_fd(port)))
        cpu0 = resource.getrusage(resource.RUSAGE_SELF)
        dup.shutdown(socket.SHUT_RDWR)
        dup.close()
        t0 = time.monotonic()
        while srv.state()["serving"]:
            assert time.monotonic() - t0 < 5, "the broken socket was not noticed"
            time.sleep(0.01)   # the state flips in the server's thread; nothing to await
        assert srv.state()["attempts"] >= 1 and "server failed" in srv.state()["error"]
        text = None
        while text is None:
            try:
                text = scrape(srv.url)
            except (urllib.error.URLError, ConnectionError):
                assert time.monotonic() - t0 < RETRY_FIRST + 5
                time.sleep(0.05)
        cpu1 = resource.getrusage(resource.RUSAGE_SELF)
        wall = time.monotonic() - t0
        used = (cpu1.ru_utime + cpu1.ru_stime) - (cpu0.ru_utime + cpu0.ru_stime)
        assert used < 0.5 * wall, f"{used:.2f} s of CPU in {wall:.2f} s: a retry loop spins"
        assert srv.state()["serving"] and srv.problem() is None
        assert samples(text)[("sparkguard_memory_available_bytes", ())] == int(0.6 * GiB)
    finally:
        srv.stop()

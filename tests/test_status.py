"""``sparkguard status`` run as a command, against a real metrics server and real processes."""

from __future__ import annotations

import json
import secrets
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from conftest import mem_available, run_sparkguard, sg_env, sparkguard_cmd
from sparkguard import metrics, status_daemon, status_url
from sparkguard.units import format_size, parse_size
from test_metrics import snapshot_dict, zram_device  # noqa: F401  (fixture; uses conftest.own_zram)

GiB = 1024**3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_config(tmp_path, body: str) -> str:
    p = tmp_path / "sparkguard.yaml"
    p.write_text(body)
    return str(p)


def mem_total() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError


@pytest.fixture
def daemon_endpoint():
    """A real metrics server on a free loopback port serving a mid-incident snapshot."""
    snap = snapshot_dict(dry_run=True)
    srv = metrics.start_server(("127.0.0.1", 0), lambda: snap)
    yield srv
    srv.stop()


def test_status_reads_the_daemon_from_metrics_listen(tmp_path, daemon_endpoint):
    host, port = daemon_endpoint.address
    cfg = write_config(tmp_path, f"metrics:\n  listen: {host}:{port}\nguard:\n  term_below: 1GiB\n  grace: 20s\n")
    r = run_sparkguard("status", "--config", cfg)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert f"config: {cfg}" in out
    assert f"Daemon   (http://127.0.0.1:{port}/metrics)" in out
    assert "running (sparkguard 0.1.0), state term_sent" in out
    assert "DRY RUN" in out
    assert "signals sent: SIGTERM 1, SIGKILL 0" in out
    assert "incidents: drill 1, memory 3" in out
    assert "last incident" in out and "sparkguard incidents" in out
    assert f"it sees {format_size(int(0.6 * GiB))} against term_below {format_size(int(0.75 * GiB))}" in out
    # the screen's own thresholds come from the config given
    assert "term_below 1.00 GiB   kill_below off   grace 20.0 s" in out
    assert f"MemTotal      {format_size(mem_total()):>11}" in out
    assert "above term_below (1.00 GiB)" in out


def test_status_with_url_and_json(daemon_endpoint):
    before = mem_available()
    r = run_sparkguard("status", "--url", daemon_endpoint.url, "--json")
    after = mem_available()
    assert r.returncode == 0, r.stderr
    st = json.loads(r.stdout)
    m = st["memory"]
    lo, hi = sorted((before, after))
    assert lo - 256 * 1024**2 <= m["available_bytes"] <= hi + 256 * 1024**2
    assert m["total_bytes"] == mem_total()
    assert m["headroom_term_bytes"] == m["signal_bytes"] - int(0.75 * GiB)
    assert m["headroom_kill_bytes"] is None
    d = st["daemon"]
    assert d["running"] is True and d["state"] == "term_sent" and d["dry_run"] is True
    assert d["signals"] == {"SIGTERM": 1, "SIGKILL": 0}
    assert d["incidents"] == {"memory": 3, "drill": 1}
    assert d["polls"] == 1234567         # sparkguard_polls_total: every read, not only the timed ones
    assert d["rss_bytes"] > 0          # the process collector of the serving process
    assert st["thresholds"]["term_below_bytes"] == int(0.75 * GiB)


def test_status_without_daemon_says_so_and_exits_0(tmp_path):
    port = free_port()
    cfg = write_config(tmp_path, f"metrics:\n  listen: 127.0.0.1:{port}\nguard:\n  kill_below: 256MiB\n")
    r = run_sparkguard("status", "--config", cfg)
    assert r.returncode == 0, r.stderr
    assert f"daemon not running (no answer at http://127.0.0.1:{port}/metrics)" in r.stdout
    # the rest of the screen is still there, read from /proc
    assert "MemAvailable" in r.stdout and "Memory pressure (PSI" in r.stdout
    assert f"above kill_below ({format_size(256 * 1024**2)})" in r.stdout
    assert "Connection refused; start it with `sparkguard run`" in r.stdout


def test_status_metrics_off(tmp_path):
    cfg = write_config(tmp_path, "metrics:\n  listen: off\n")
    r = run_sparkguard("status", "--config", cfg)
    assert r.returncode == 0, r.stderr
    assert "metrics.listen is off" in r.stdout


def test_status_something_else_on_the_port():
    class NotFound(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_error(404)

        def log_message(self, *a):
            pass

    httpd = HTTPServer(("127.0.0.1", 0), NotFound)
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    try:
        url = f"http://127.0.0.1:{httpd.server_address[1]}/metrics"
        r = run_sparkguard("status", "--url", url)
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert r.returncode == 0, r.stderr
    assert "answered HTTP 404" in r.stdout and "not a sparkguard metrics endpoint" in r.stdout


def test_status_lists_matched_targets(tmp_path):
    model = "sgtest-" + secrets.token_hex(4)
    title = f"vllm serve {model}"
    proc = subprocess.Popen(["bash", "-c", f"exec -a '{title}' sleep 120"])
    try:
        cfg = write_config(tmp_path, f"targets:\n  match: ['serve {model}']\nmetrics:\n  listen: off\n")
        r = run_sparkguard("status", "--config", cfg)
        assert r.returncode == 0, r.stderr
        assert f"* pid {proc.pid:<7} {title}" in r.stdout
        assert f"matched by serve {model}" in r.stdout

        r = run_sparkguard("status", "--config", cfg, "--json")
        t = json.loads(r.stdout)["targets"]
        assert [x["root_pid"] for x in t] == [proc.pid]
        assert t[0]["mem_bytes"] > 0
    finally:
        proc.kill()
        proc.wait(10)

    r = run_sparkguard("status", "--config", cfg)
    assert "no process matches targets.match" in r.stdout
    assert "nothing (targets.fallback: off)" in r.stdout


def test_status_bad_config_names_file_key_value(tmp_path):
    cfg = write_config(tmp_path, "guard:\n  grace: soon\n")
    r = run_sparkguard("status", "--config", cfg)
    assert r.returncode == 2
    assert cfg in r.stderr and "guard.grace" in r.stderr and "'soon'" in r.stderr


def test_status_shows_zram_with_compression_ratio(tmp_path, zram_device):  # noqa: F811
    cfg = write_config(tmp_path, "metrics:\n  listen: off\n")
    r = run_sparkguard("status", "--config", cfg, "--json")
    z = {d["device"]: d for d in json.loads(r.stdout)["zram"]}[zram_device]
    assert z["disksize_bytes"] == 64 * 1024**2
    assert z["compression_ratio"] == round(z["orig_data_bytes"] / z["compr_data_bytes"], 2) > 2
    r = run_sparkguard("status", "--config", cfg)
    line = next(x for x in r.stdout.splitlines() if f"zram {zram_device} (" in x)
    assert f"{format_size(64 * 1024**2)} disk, holds {format_size(z['orig_data_bytes'])}" in line
    assert f"(ratio {z['compression_ratio']:.2f}x)" in line


def test_status_shows_the_supervised_engine_from_a_real_daemon(tmp_path):
    """A real ``sparkguard run`` supervising the real fake vLLM: ``sparkguard status`` asks its
    control socket and shows state, pid, lane, ready, restarts and the last exit; once the daemon
    is gone it says so."""
    import os

    from supervisor_helpers import Daemon, engine_config, fake_cmd, unique, wait_gone

    if os.geteuid() != 0:
        pytest.skip("the engine control socket is root-only")
    model, port = unique(), free_port()
    lanes = {"short": {"args": ["--max-model-len", "2048"]}, "long": {"args": []}}
    d = Daemon(tmp_path, engine_config(tmp_path, model, fake_cmd(model, port), port, lanes=lanes, lane="short"))
    try:
        d.wait_control()
        st = d.wait_ready()
        pid = st["pid"]
        r = run_sparkguard("status", "--config", str(d.path))
        assert r.returncode == 0, r.stderr
        screen = r.stdout.split(f"Engine   (control socket {d.socket})\n", 1)
        assert len(screen) == 2, r.stdout
        engine = screen[1]
        assert engine.startswith(f"  engine: ready (pid {pid}, lane short, up "), engine
        assert "  lanes: *short, long" in engine
        assert "starts 1, ready yes, restarts: none (policy always)" in engine
        r = run_sparkguard("status", "--config", str(d.path), "--json")
        e = json.loads(r.stdout)["engine"]
        assert e["running"] and e["configured"] and e["error"] is None and e["socket"] == d.socket
        assert e["status"]["pid"] == pid and e["status"]["ready"] and e["status"]["lane"] == "short"
        # stopped by command: the screen shows it, with the exit
        pids = list(d.engine_pids)
        assert run_sparkguard("engine", "--socket", d.socket, "stop", "--timeout", "30").returncode == 0
        assert wait_gone(pids, 10) == []
        r = run_sparkguard("status", "--config", str(d.path))
        engine = r.stdout.split("Engine   (", 1)[1]
        assert "  engine: stopped (lane short): stopped by command" in engine
        assert "ready no" in engine and "  last exit: exit code 0 after " in engine and "(stop)" in engine
    finally:
        d.cleanup()
    r = run_sparkguard("status", "--config", str(d.path))
    assert r.returncode == 0, r.stderr
    engine = r.stdout.split("Engine   (", 1)[1]
    assert f"  daemon not running: sparkguard is not running with an engine: no control socket at {d.socket}" in engine
    e = json.loads(run_sparkguard("status", "--config", str(d.path), "--json").stdout)["engine"]
    assert e == {"socket": d.socket, "configured": True, "running": False, "status": None, "error": e["error"]}
    assert "not running" in e["error"]


def test_status_without_an_engine_section(tmp_path):
    sock = str(tmp_path / "none.sock")
    cfg = write_config(tmp_path, "metrics:\n  listen: off\n")
    r = run_sparkguard("status", "--config", cfg, "--socket", sock)
    assert r.returncode == 0, r.stderr
    assert r.stdout.endswith(f"Engine   (control socket {sock})\n  not supervised (no engine: section in the "
                             "configuration)\n"), r.stdout


def test_one_size_formatter_for_people_and_for_files():
    assert format_size(805306368) == "0.75 GiB" and format_size(None) == "-"
    assert format_size(3 * 1024**2) == "3 MiB" and format_size(512) == "512 B"
    for n in (6 * 1024**3, 768 * 1024**2, 4096 * 3, 1000, 0):
        assert parse_size(format_size(n, exact=True)) == n
    assert format_size(6 * 1024**3, exact=True) == "6GiB" and format_size(1000, exact=True) == "1000"


# --- --url of another host (issue 14): only what that endpoint reports

REMOTE_SNAPSHOT = {"available_bytes": 7 * GiB, "total_bytes": 100 * GiB, "swap_free_bytes": 0, "swap_total_bytes": 0,
                   "signal_bytes": 7 * GiB, "term_below_bytes": 1 * GiB, "grace_seconds": 5.0,
                   "poll_interval_seconds": 0.2, "state": "ok", "dry_run": False, "signals_sent": {},
                   "incidents": {"memory": 2}, "polls_total": 42, "started_timestamp": 1.0}


def test_is_local_url():
    assert status_url.is_local_url("http://127.0.0.1:8799/metrics")
    assert status_url.is_local_url("http://localhost:8799/metrics")
    assert status_url.is_local_url("http://[::1]:8799/metrics")
    assert status_url.is_local_url(f"http://{socket.gethostname()}:8799/metrics")
    assert not status_url.is_local_url("http://sparkguard-test.invalid:8799/metrics")   # RFC 2606: never resolves
    assert not status_url.is_local_url("not a url")


def test_the_daemons_state_is_parsed_from_its_exposition_text():
    """The scraped text turns into the dict the screen shows, with no I/O (status_daemon.parse_metrics):
    labelled families by their label, the state that is 1, a value no number can show (NaN, an
    int past 2**63) as None; text that is not Prometheus, or holds no sparkguard_ metric, is an
    error that names the URL."""
    text = ('sparkguard_build_info{hostname="h1",version="9.9"} 1\n'
            'sparkguard_guard_state{state="normal"} 1\nsparkguard_guard_state{state="stopping"} 0\n'
            'sparkguard_memory_available_bytes 5e9\nsparkguard_term_below_bytes NaN\n'
            'sparkguard_kill_below_bytes 1e300\nsparkguard_signals_total{signal="SIGTERM"} 2\n'
            'sparkguard_polls_total 7\n')
    d = status_daemon.parse_metrics("http://h1:8799/metrics", text)
    assert d["running"] and (d["version"], d["hostname"], d["state"]) == ("9.9", "h1", "normal")
    assert d["available_bytes"] == 5_000_000_000 and d["term_below_bytes"] is None and d["kill_below_bytes"] is None
    assert d["signals"] == {"SIGTERM": 2} and d["polls"] == 7 and d["engine"] is None
    bad = status_daemon.parse_metrics("http://h1:8799/metrics", "not prometheus {{{")
    assert not bad["running"] and bad["error"].startswith("http://h1:8799/metrics answered, but not with Prometheus")
    other = status_daemon.parse_metrics("http://h1:8799/metrics", "node_load1 0.5\n")
    assert not other["running"] and "it is not sparkguard" in other["error"]


def test_status_url_of_another_node_shows_only_what_its_endpoint_reports(root_only):
    """The endpoint serves in a node namespace; ``sparkguard status --url`` runs in the hub,
    which has none of that node's addresses: its own memory must not appear."""
    from netcluster import Cluster
    code = ("import sys, json; from sparkguard import metrics\n"
            f"snap = json.loads({json.dumps(json.dumps(REMOTE_SNAPSHOT))})\n"
            "srv = metrics.start_server((sys.argv[1], 0), lambda: snap)\n"
            "print(srv.url, flush=True); sys.stdin.read()\n")
    with Cluster(1) as c:
        node = c.nodes[0]
        assert not status_url.is_local_url(f"http://{node.addr}:1/metrics")      # not this (root) namespace's
        srv = node.spawn([sys.executable, "-c", code, node.addr], env=sg_env(), stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
        try:
            url = srv.stdout.readline().strip()
            assert url.startswith(f"http://{node.addr}:"), url
            p = c.hub.spawn(sparkguard_cmd("status", "--url", url, "--config", "/nonexistent/sparkguard.yaml"),
                            env=sg_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            out, err = p.communicate(timeout=60)
            assert p.returncode == 0, err
            assert f"sparkguard status of {url}" in out and "another host's endpoint" in out
            assert f"MemAvailable  {format_size(7 * GiB):>11}" in out
            assert f"above term_below ({format_size(GiB)})" in out
            assert "incidents: memory 2" in out
            for local_only in ("Targets (", "Memory pressure (PSI", "Swap\n", "control socket"):
                assert local_only not in out, local_only
            p = c.hub.spawn(sparkguard_cmd("status", "--url", url, "--json"), env=sg_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            out, err = p.communicate(timeout=60)
            st = json.loads(out)
            assert st["remote"] is True and "memory" not in st and "targets" not in st
            assert st["daemon"]["available_bytes"] == 7 * GiB
            # nobody there: said so, without this host's port holder or guards
            p = c.hub.spawn(sparkguard_cmd("status", "--url", f"http://{node.addr}:1/metrics"), env=sg_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            out, err = p.communicate(timeout=60)
            assert p.returncode == 0, err
            assert f"no answer at http://{node.addr}:1/metrics" in out
            assert "a guard runs" not in out and "listens on the port" not in out, out
        finally:
            srv.stdin.close()
            srv.wait(10)


def test_a_loopback_url_of_another_hosts_endpoint_is_remote(root_only, daemon_endpoint):
    """A tunnel (``ssh -L``) makes another host's endpoint answer on this host's loopback: the
    endpoint's ``sparkguard_build_info{hostname}`` says whose it is.  The other host is an
    endpoint in a UTS namespace of its own (another hostname), on this loopback."""
    code = ("import socket, sys, json; from sparkguard import metrics\n"
            f"snap = json.loads({json.dumps(json.dumps(REMOTE_SNAPSHOT))})\n"
            "srv = metrics.start_server(('127.0.0.1', 0), lambda: snap)\n"
            "print(srv.url, socket.gethostname(), flush=True); sys.stdin.read()\n")
    other = "sgtunnel-" + secrets.token_hex(3)
    srv = subprocess.Popen(["unshare", "--uts", "--", "sh", "-c", f'hostname {other} && exec "$0" -c "$1"',
                            sys.executable, code], env=sg_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                           text=True)
    try:
        url, host = srv.stdout.readline().split()
        assert host == other and status_url.is_local_url(url)
        r = run_sparkguard("status", "--url", url, "--config", "/nonexistent/sparkguard.yaml")
        assert r.returncode == 0, r.stderr
        assert f"sparkguard status of {url} (host {other})" in r.stdout and "another host's endpoint" in r.stdout
        assert f"MemAvailable  {format_size(7 * GiB):>11}" in r.stdout
        assert "Targets (" not in r.stdout
        # this host's own endpoint on loopback stays local (the whole screen, this host's config read)
        r = run_sparkguard("status", "--url", daemon_endpoint.url, "--config", "/nonexistent/sparkguard.yaml")
        assert r.returncode == 2 and "/nonexistent/sparkguard.yaml" in r.stderr, r.stdout + r.stderr
    finally:
        srv.stdin.close()
        srv.wait(10)

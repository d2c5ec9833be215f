"""The fake vLLM, checked against what sparkguard observes of the real one (FIELD-NOTES, vLLM 0.33).

Real processes, read through the real /proc, real signals, real HTTP on loopback.  Every test
starts its own tree with a unique model name and kills it in ``finally`` (FakeEngine.stop).
"""

from __future__ import annotations

import http.client
import json
import os
import select
import signal
import socket
import sys
import time
import urllib.error
import urllib.request
import uuid

import pytest

from conftest import fake_vllm
from sparkguard.units import parse_size

MiB = 1024 * 1024


@pytest.fixture
def fakes():
    """Start fakes through ``fakes(*opts)``; all are SIGKILLed and reaped at the end, whatever happened."""
    started: list[fake_vllm.FakeEngine] = []

    def _start(*opts: str, model: str | None = None, **kw) -> fake_vllm.FakeEngine:
        model = model or f"fake-model-{uuid.uuid4().hex[:10]}"
        fe = fake_vllm.start(model, *opts, **kw)
        fe.model = model
        started.append(fe)
        return fe

    try:
        yield _start
    finally:
        for fe in started:
            fe.stop()


def stat(pid: int) -> dict:
    """ppid, pgid, sid and state of ``pid`` from /proc/PID/stat (fields after the comm)."""
    with open(f"/proc/{pid}/stat") as f:
        rest = f.read().rsplit(")", 1)[1].split()
    return {"state": rest[0], "ppid": int(rest[1]), "pgid": int(rest[2]), "sid": int(rest[3])}


def comm(pid: int) -> str:
    with open(f"/proc/{pid}/comm") as f:
        return f.read().rstrip("\n")


def cmdline(pid: int) -> list[str]:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        raw = f.read()
    return [a.decode() for a in raw.split(b"\0") if a]


def gone(pid: int) -> bool:
    """True if ``pid`` no longer runs: absent from /proc, or a zombie (orphans here are reaped by
    PID 1 only after a second or two)."""
    try:
        return stat(pid)["state"] in ("Z", "X")
    except FileNotFoundError:
        return True


def rss_anon(pid: int) -> int:
    """RssAnon of ``pid`` in bytes (the process's own touched anonymous memory)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no RssAnon for {pid}")


def exit_times(pids: list[int], timeout: float) -> dict[int, float]:
    """Monotonic time at which each pid exited (pidfd readable), waiting up to ``timeout`` s."""
    fds = {os.pidfd_open(p): p for p in pids}
    out: dict[int, float] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(out) < len(pids):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            for fd in select.select([fd for fd, p in fds.items() if p not in out], [], [], left)[0]:
                out[fds[fd]] = time.monotonic()
    finally:
        for fd in fds:
            os.close(fd)
    return out


def http_get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def complete(url: str, model: str, timeout: float = 5.0) -> tuple[int, dict]:
    req = urllib.request.Request(url + "/v1/completions", method="POST",
                                 data=json.dumps({"model": model, "prompt": "Hello", "max_tokens": 1}).encode(),
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


# ------------------------------------------------------------------------------------------------
# the process tree as /proc shows it

def test_command_reads_like_vllm_serve():
    argv = fake_vllm.command("some/model", "--tp", "4")
    assert argv[0] == sys.executable
    assert os.path.basename(argv[1]) == "vllm" and os.path.isfile(argv[1])
    assert argv[2:] == ["serve", "some/model", "--tp", "4"]


def test_tree_titles_comm_cmdline_ppid_pgid(fakes):
    fe = fakes("--tp", "2", "--max-model-len", "200000", "--gpu-memory-utilization", "0.8")  # real vLLM flags are accepted
    top, core, w0, w1 = fe.pids()
    assert top == fe.proc.pid
    # the top is not renamed: its cmdline is the launch argv, intact
    assert cmdline(top) == fe.argv
    assert cmdline(top)[1:4] == [fake_vllm.script_path(), "serve", fe.model]
    # the children are renamed with setproctitle: cmdline is the title alone, comm cut to 15 bytes
    assert cmdline(core) == ["VLLM::EngineCore"] and comm(core) == "VLLM::EngineCor"
    assert cmdline(w0) == ["VLLM::Worker_TP0"] and comm(w0) == "VLLM::Worker_TP"
    assert cmdline(w1) == ["VLLM::Worker_TP1"] and comm(w1) == "VLLM::Worker_TP"
    # ancestry, and one process group: the launcher's (start() gives it its own session)
    assert stat(core)["ppid"] == top
    assert stat(w0)["ppid"] == core and stat(w1)["ppid"] == core
    assert {stat(p)["pgid"] for p in (top, core, w0, w1)} == {top}
    assert {stat(p)["sid"] for p in (top, core, w0, w1)} == {top}
    assert fe.core_pid == core and fe.worker_pids == [w0, w1]


def test_tree_stays_in_callers_process_group_without_new_session(fakes):
    fe = fakes("--tp", "1", "--hold", "4MiB", start_new_session=False)
    pids = fe.pids()
    assert {stat(p)["pgid"] for p in pids} == {os.getpgrp()}


def test_each_process_holds_real_memory(fakes):
    fe = fakes("--tp", "2", "--hold", "48MiB", "--hold-core", "24MiB", "--hold-api", "12MiB")
    top, core, w0, w1 = fe.pids()
    assert rss_anon(w0) >= 48 * MiB and rss_anon(w1) >= 48 * MiB
    assert rss_anon(core) >= 24 * MiB
    assert rss_anon(top) >= 12 * MiB
    # each holds its own pages, not the parent's copy-on-write ones (allocated after the forks)
    assert rss_anon(core) < 48 * MiB + 24 * MiB


def test_headless_rank_is_vllm_serve_over_one_worker(fakes):
    fe = fakes("--headless", "--node-rank", "1", "--tp", "2", "--hold", "8MiB")
    top, w = fe.pids()
    assert cmdline(top)[2:5] == ["serve", fe.model, "--headless"]
    assert cmdline(w) == ["VLLM::Worker_TP1"] and comm(w) == "VLLM::Worker_TP"
    assert stat(w)["ppid"] == top and stat(w)["pgid"] == top
    assert fe.core_pid is None and fe.worker_pids == [w]
    assert fe.port is None


def test_ready_file_carries_the_ready_line(fakes, tmp_path):
    path = tmp_path / "ready"
    fe = fakes("--tp", "1", "--hold", "4MiB", "--ready-file", str(path))
    pids = fe.pids()
    assert path.read_text() == f"fake-vllm: ready pids={','.join(map(str, pids))}\n"


# ------------------------------------------------------------------------------------------------
# shutdown as vLLM does it

def test_sigterm_default_timeout_kills_engine_at_once(fakes):
    # VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS unset -> 0: EngineCore and workers are SIGKILLed within
    # milliseconds, long before their 3 s "CUDA teardown" could finish; the top itself takes its 3 s.
    env = {k: v for k, v in os.environ.items() if k != "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS"}
    fe = fakes("--exit-delay", "3", env=env)
    top, *engine = fe.pids()
    t0 = time.monotonic()
    os.kill(top, signal.SIGTERM)
    times = exit_times(engine, timeout=10)
    assert set(times) == set(engine)
    assert max(times.values()) - t0 < 1.0, "engine processes were not killed at once"
    assert fe.proc.wait(timeout=10) == 0
    assert time.monotonic() - t0 >= 2.5, "top did not take its exit delay"


def test_sigterm_with_shutdown_timeout_exits_cleanly_in_order(fakes):
    # with a timeout longer than the teardown, every process exits on its own: workers first,
    # then EngineCore (it waits for them), then the top (it waits for EngineCore)
    env = dict(os.environ, VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS="3")
    fe = fakes("--exit-delay", "0.5", env=env)
    top, core, w0, w1 = fe.pids()
    t0 = time.monotonic()
    os.kill(top, signal.SIGTERM)
    times = exit_times([top, core, w0, w1], timeout=10)
    assert set(times) == {top, core, w0, w1}
    assert min(times[w0], times[w1]) - t0 >= 0.4, "workers did not take their teardown time"
    assert max(times[w0], times[w1]) <= times[core] <= times[top]
    assert times[top] - t0 < 2.5, "a process waited for the SIGKILL instead of exiting by itself"
    assert fe.proc.wait(timeout=5) == 0
    assert "killing its process tree" not in fe.output()


def test_shutdown_timeout_expires_then_sigkill(fakes):
    env = dict(os.environ, VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS="0.5")
    fe = fakes("--exit-delay", "2.5", env=env)
    top, *engine = fe.pids()
    t0 = time.monotonic()
    os.kill(top, signal.SIGTERM)
    times = exit_times(engine, timeout=10)
    assert set(times) == set(engine)
    assert 0.4 <= max(times.values()) - t0 < 2.0, "engine not SIGKILLed when the shutdown timeout ran out"
    assert fe.proc.wait(timeout=10) == 0
    assert "killing its process tree" in fe.output()


def test_ignore_term_survives_sigterm_until_sigkill(fakes):
    fe = fakes("--mode", "ignore-term", "--exit-delay", "0")
    pids = fe.pids()
    os.killpg(pids[0], signal.SIGTERM)  # every process of the group gets it
    assert exit_times(pids, timeout=1.0) == {}, "a process exited on SIGTERM in ignore-term mode"
    for p in pids:
        assert stat(p)["state"] != "Z"
    os.killpg(pids[0], signal.SIGKILL)
    assert fe.wait_gone(pids, timeout=10)


def test_orphans_keep_running_and_holding_memory_after_top_is_killed(fakes):
    fe = fakes("--mode", "orphans", "--hold", "32MiB")
    top, core, w0, w1 = fe.pids()
    os.kill(top, signal.SIGKILL)
    assert fe.proc.wait(timeout=10) == -signal.SIGKILL
    # EngineCore is reparented away from the dead top; workers are still under EngineCore
    deadline = time.monotonic() + 5
    while stat(core)["ppid"] == top and time.monotonic() < deadline:  # reparenting is immediate; bounded anyway
        time.sleep(0.01)
    assert stat(core)["ppid"] != top
    assert exit_times([core, w0, w1], timeout=1.0) == {}, "engine processes died with their parent"
    assert stat(w0)["ppid"] == core and stat(w1)["ppid"] == core
    assert stat(core)["pgid"] == top  # still in the dead launcher's group: a killpg sweep finds them
    assert rss_anon(w0) >= 32 * MiB and rss_anon(w1) >= 32 * MiB
    assert cmdline(core) == ["VLLM::EngineCore"]
    fe.stop()
    assert all(gone(p) for p in (core, w0, w1))


def test_worker_death_takes_the_engine_down_and_health_says_503(fakes):
    fe = fakes("--port", "0", "--dead-linger", "3", "--exit-delay", "0")
    top, core, w0, w1 = fe.pids()
    fe.wait_serving()
    assert http_get(fe.url + "/health")[0] == 200
    n = len(fe.lines)
    os.kill(w1, signal.SIGKILL)
    fe.wait_line("died unexpectedly", timeout=10, start=n)  # EngineCore saw its worker die
    fe.wait_line("Engine core proc EngineCore died unexpectedly", timeout=10, start=n)
    assert http_get(fe.url + "/health")[0] == 503
    assert complete(fe.url, fe.model)[0] == 500
    assert fe.proc.wait(timeout=10) == 1
    assert fe.wait_gone([core, w0, w1], timeout=5)


# ------------------------------------------------------------------------------------------------
# memory fill for drills

def test_fill_rate_is_roughly_honoured(fakes):
    size = parse_size("384MiB")
    fe = fakes("--tp", "2", "--hold", "16MiB", "--fill-rate", "256MiB/s", "--fill-size", "384MiB")
    top, core, w0, w1 = fe.pids()
    t0 = time.monotonic()
    fe.wait_line("fake-vllm: fill ", timeout=10)
    done = fe.wait_line(" done", timeout=30)
    elapsed = time.monotonic() - t0
    assert f"pid={w0} bytes={size} target={size} done" in done
    assert 1.0 <= elapsed <= 10.0, f"384MiB at 256MiB/s took {elapsed:.2f} s"
    assert rss_anon(w0) >= 16 * MiB + size
    assert rss_anon(w1) < 16 * MiB + size / 2  # only TP0 fills


def test_fill_max_and_on_signal(fakes):
    fe = fakes("--tp", "1", "--hold", "8MiB", "--fill-rate", "max", "--fill-size", "256MiB", "--fill-on-signal")
    top, core, w0 = fe.pids()
    assert exit_times([w0], timeout=0.5) == {}
    assert rss_anon(w0) < 8 * MiB + 128 * MiB, "filled before the signal"
    fe.start_fill()
    fe.wait_line(" done", timeout=30)
    assert rss_anon(w0) >= 8 * MiB + 256 * MiB


def test_bad_option_is_a_clear_error():
    import subprocess

    r = subprocess.run(fake_vllm.command("m", "--fill-rate", "fast", "--fill-size", "1GiB"),
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 2
    assert "--fill-rate" in r.stderr and "'fast'" in r.stderr
    r = subprocess.run(fake_vllm.command("m", "--fill-rate", "1GiB/s"), capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "--fill-rate needs --fill-size" in r.stderr


# ------------------------------------------------------------------------------------------------
# HTTP, as vLLM's OpenAI-compatible server

def _connect_refused(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    except ConnectionRefusedError:
        return True
    return False


def test_port_listens_only_after_loading_then_serves(fakes):
    fe = fakes("--port", "0", "--load-time", "1.5", "--tp", "1", "--hold", "8MiB")
    fe.pids()
    port = fe.port
    assert _connect_refused(port), "listening while still loading"
    fe.wait_serving(timeout=15)
    assert any(f"Starting vLLM API server 0 on http://127.0.0.1:{port}" in line for line in fe.lines)
    status, body = http_get(fe.url + "/health")
    assert (status, body) == (200, b"")
    status, body = http_get(fe.url + "/v1/models")
    assert status == 200 and json.loads(body)["data"][0]["id"] == fe.model
    status, reply = complete(fe.url, fe.model)
    assert status == 200
    assert reply["object"] == "text_completion" and reply["model"] == fe.model
    assert len(reply["choices"]) == 1 and reply["usage"]["completion_tokens"] == 1
    assert complete(fe.url, "not-" + fe.model)[0] == 404
    status, body = http_get(fe.url + "/metrics")
    text = body.decode()
    assert status == 200
    assert f'vllm:num_requests_running{{engine="0",model_name="{fe.model}"}} 0.0' in text
    assert "vllm:kv_cache_usage_perc{" in text


def test_metrics_parse_with_prometheus_client(fakes):
    from prometheus_client.parser import text_string_to_metric_families

    fe = fakes("--port", "0", "--tp", "1", "--hold", "4MiB")
    fe.wait_serving(timeout=15)
    complete(fe.url, fe.model)
    names = {s.name: s.value for fam in text_string_to_metric_families(http_get(fe.url + "/metrics")[1].decode())
             for s in fam.samples}
    assert names["vllm:num_requests_running"] == 0.0
    assert names["vllm:request_success_total"] == 1.0


def test_wedge_health_200_but_completions_hang(fakes):
    fe = fakes("--port", "0", "--wedge-after", "0.3", "--tp", "1", "--hold", "4MiB")
    fe.wait_serving(timeout=15)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # serves normally until wedged (bounded)
        try:
            complete(fe.url, fe.model, timeout=1.0)
        except (TimeoutError, socket.timeout, urllib.error.URLError):
            break
    else:
        pytest.fail("completions never hung")
    t0 = time.monotonic()
    with pytest.raises((TimeoutError, socket.timeout, urllib.error.URLError)):
        complete(fe.url, fe.model, timeout=1.5)
    assert time.monotonic() - t0 >= 1.4
    assert http_get(fe.url + "/health") == (200, b"")
    from prometheus_client.parser import text_string_to_metric_families

    samples = {s.name: s.value for fam in text_string_to_metric_families(http_get(fe.url + "/metrics")[1].decode())
               for s in fam.samples}
    assert samples["vllm:num_requests_running"] >= 1.0  # the hung requests are still "running"


def test_crash_mode_tree_dies_non_zero(fakes):
    fe = fakes("--port", "0", "--crash-after", "0.5", "--dead-linger", "0.2", "--exit-delay", "0")
    pids = fe.pids()
    fe.wait_serving(timeout=15)
    assert http_get(fe.url + "/health")[0] == 200
    t0 = time.monotonic()
    assert fe.proc.wait(timeout=15) == 1
    assert time.monotonic() - t0 >= 0.2
    assert fe.wait_gone(pids, timeout=5)
    assert "EngineCore encountered a fatal error" in fe.output()


def test_sigterm_while_loading_shuts_down(fakes):
    fe = fakes("--port", "0", "--load-time", "30", "--exit-delay", "0")
    pids = fe.pids()
    os.kill(pids[0], signal.SIGTERM)
    assert fe.proc.wait(timeout=10) == 0
    assert fe.wait_gone(pids, timeout=5)


def test_http_keepalive_connection_reuse(fakes):
    fe = fakes("--port", "0", "--tp", "1", "--hold", "4MiB")
    fe.wait_serving(timeout=15)
    conn = http.client.HTTPConnection("127.0.0.1", fe.port, timeout=5)
    try:
        for _ in range(3):
            conn.request("GET", "/health")
            r = conn.getresponse()
            assert (r.status, r.read()) == (200, b"")
    finally:
        conn.close()


def test_start_fill_refuses_without_fill(fakes):
    fe = fakes("--tp", "1", "--hold", "4MiB")
    with pytest.raises(ValueError):
        fe.start_fill()
    assert exit_times(fe.pids(), timeout=0.2) == {}

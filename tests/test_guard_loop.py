"""The poll loop keeps guarding: a stalled NOTIFY_SOCKET, a /proc/meminfo it cannot read (blind), a reload
that yields values the loop cannot run on, a synchronous ``sparkguard reload``, and MemAvailable found only
at the start of its line.  Real daemons, real sockets, real files, real signals and real memory."""

from __future__ import annotations

import errno
import fcntl
import os
import select
import signal
import socket
import subprocess
import time
import urllib.request

import pytest

from conftest import run_sparkguard, sg_env
from guardrun import GuardProc, unique
from test_guard_incidents import filling_engine, line_below_now, wait_incident

GiB = 1024**3
KiB = 1024


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> dict[str, float]:
    """``{name{labels}: value}`` from the daemon's /metrics (labels as written)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def wait_scrape(port: int, g: GuardProc, pred=lambda m: True, timeout: float = 30.0) -> dict[str, float]:
    """Scrape until ``pred(metrics)``; fail if the daemon exits or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    last: dict = {}
    while True:
        try:
            last = scrape(port)
            if pred(last):
                return last
        except OSError:
            pass
        if g.proc.poll() is not None:
            pytest.fail(f"sparkguard run exited {g.proc.returncode}:\n{g.log()[-3000:]}")
        if time.monotonic() > deadline:
            pytest.fail(f"metrics never matched within {timeout}s; last {last}\n{g.log()[-2000:]}")
        time.sleep(0.05)  # nothing to await across processes but the port itself


def meminfo_text(avail_kb: int, first: str = "") -> bytes:
    """A /proc/meminfo in the kernel's layout (MemTotal 64 GiB, no swap); ``first`` goes before MemTotal."""
    return (first + f"MemTotal:       {64 * 1024 * 1024} kB\nMemFree:        {avail_kb} kB\n"
            f"MemAvailable:   {avail_kb} kB\nBuffers:            1024 kB\nCached:         1048576 kB\n"
            "SwapTotal:             0 kB\nSwapFree:              0 kB\n").encode()


def rewrite(path, data: bytes) -> None:
    """Replace the file's text in place (the daemon keeps the file open and re-reads it)."""
    with open(path, "r+b") as f:
        f.write(data)
        f.truncate()


# ---- 1: a NOTIFY_SOCKET that never reads -------------------------------------------------------

def full_notify_socket(path: str) -> socket.socket:
    """A bound AF_UNIX datagram socket that never reads, its queue already full (the state a service
    manager's socket is in while PID 1 is stuck in reclaim)."""
    stalled = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    stalled.bind(path)
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_NONBLOCK) as filler:
        for _ in range(100_000):
            try:
                filler.sendto(b"X=1", path)
            except OSError as e:
                assert e.errno in (errno.EAGAIN, errno.ENOBUFS), e
                return stalled
    raise AssertionError("the notify socket's queue never filled")


def test_a_notify_socket_that_never_reads_does_not_stop_the_sigterm(engine_factory):
    fe = filling_engine(engine_factory)
    port = free_port()
    line = line_below_now()
    tmp_sock = f"/tmp/{unique('sg-stalled')}.sock"
    stalled = full_notify_socket(tmp_sock)
    g = GuardProc({"guard": {"term_below": line, "grace": "20s"}, "targets": {"match": [rf"vllm serve {fe.model}\b"]},
                   "metrics": {"listen": f"127.0.0.1:{port}"}},
                  watchdog_usec=20_000, env_extra={"NOTIFY_SOCKET": tmp_sock})
    try:
        pids = fe.pids()
        # the loop polls and every ping is dropped and counted
        m = wait_scrape(port, g, lambda m: m.get("sparkguard_notify_dropped_total", 0) >= 20
                        and m.get("sparkguard_polls_total", 0) >= 5)
        polls = m["sparkguard_polls_total"]
        fe.start_fill()
        inc = wait_incident(g, timeout=60)
        assert inc["timeline"][1]["event"] == "sigterm" and inc["timeline"][1]["t"] < 1.0, inc["timeline"]
        assert fe.wait_gone(pids, timeout=10)
        after = wait_scrape(port, g, lambda x: x["sparkguard_notify_dropped_total"] > m["sparkguard_notify_dropped_total"])
        assert after["sparkguard_polls_total"] > polls
        assert after['sparkguard_signals_total{signal="SIGTERM"}'] == 1
    finally:
        g.stop()
        stalled.close()
        os.unlink(tmp_sock)


def test_notifier_sends_to_abstract_addresses_and_counts_what_a_full_queue_refuses():
    """sd_notify(3): NOTIFY_SOCKET=@name is the abstract socket "\\0name"."""
    from sparkguard import notify
    name = unique("sg-notify")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(b"\0" + name.encode())
    try:
        n = notify.Notifier({"NOTIFY_SOCKET": "@" + name, "WATCHDOG_USEC": "1000000"})
        n.ready("up")
        sock.settimeout(5)
        assert sock.recv(4096) == b"READY=1\nSTATUS=up"
        t0 = time.monotonic()
        sent = 0
        while n.dropped == 0:           # nobody reads: the queue fills, then sends are refused at once
            assert n.send("WATCHDOG=1") or n.dropped, "a refused send must be counted"
            sent += 1
            assert sent < 100_000
        assert time.monotonic() - t0 < 5
        n.status("still here")          # dropped too: it is sent again at the next refresh
        assert n.dropped == 2
        n.ready()                       # the READY=1 that ends a reload: dropped, and owed
        assert n.dropped == 3 and n.ready_pending
        sock.setblocking(False)
        try:
            while sock.recv(4096):
                pass
        except BlockingIOError:
            pass
        n.status("still here")
        sock.settimeout(5)
        assert sock.recv(4096) == b"READY=1" and not n.ready_pending
        assert sock.recv(4096) == b"STATUS=still here"
    finally:
        sock.close()


# ---- 3: a blind guard stops the watchdog ------------------------------------------------------

def test_a_blind_guard_stops_watchdog_pings_says_so_and_resumes(tmp_path):
    mi = tmp_path / "meminfo"
    mi.write_bytes(meminfo_text(50 * 1024 * 1024))
    g = GuardProc({"targets": {"match": [f"^{unique()}$"]}}, watchdog_usec=200_000,
                  extra_args=("--meminfo", str(mi)))
    try:
        assert "MemAvailable 50.00 GiB" in g.wait_ready()["STATUS"]
        g.notify.wait_for(lambda m: m.get("WATCHDOG") == "1", timeout=5)
        t_bad = time.monotonic()
        rewrite(mi, b"MemTotal:       67108864 kB\nMemFree: garbage\n")
        blind = g.notify.wait_for(lambda m: m.get("STATUS", "").startswith("BLIND"), timeout=10)
        assert time.monotonic() - t_bad >= 2.9
        assert f"BLIND: cannot read {mi} since " in blind["STATUS"] and "no MemAvailable line" in blind["STATUS"]
        # absence cannot be awaited: watch 1.5 s, more than seven ping intervals
        n = len(g.notify.messages)
        end = time.monotonic() + 1.5
        while time.monotonic() < end:
            g.notify.recv(max(0.01, end - time.monotonic()))
        assert not [m for m in g.notify.messages[n:] if m.get("WATCHDOG") == "1"]
        assert g.log().count("BLIND: cannot read") == 1
        n = len(g.notify.messages)
        rewrite(mi, meminfo_text(40 * 1024 * 1024))
        # the first good read sends STATUS= (with that sample) and then resumes the pings
        g.notify.wait_for(lambda m: m.get("WATCHDOG") == "1", timeout=5)
        assert any("MemAvailable 40.00 GiB" in m.get("STATUS", "") for m in g.notify.messages[n:]), \
            g.notify.messages[n:]
        g.wait_log("watchdog pings resume")
    finally:
        g.stop()


# ---- 6: MemAvailable only at the start of its line -----------------------------------------------

def test_reader_and_report_parser_anchor_memavailable_at_line_start(tmp_path):
    from sparkguard import meminfo
    mi = tmp_path / "meminfo"
    mi.write_bytes(meminfo_text(50 * 1024 * 1024, first="XMemAvailable:      1024 kB\n"))
    r = meminfo.MeminfoReader(str(mi))
    try:
        assert r.sample() == (50 * GiB, 0)
        assert r.mem_total == 64 * GiB
        assert meminfo.parse(r.raw())["MemAvailable"] == 50 * GiB
        assert "XMemAvailable" in meminfo.parse(r.raw())
        # a field on the first line, and a value that is not "<digits> kB"
        rewrite(mi, b"MemAvailable:   2048 kB\nMemTotal:  67108864 kB\n SwapFree: 1 kB\n")
        assert r.sample() == (2 * 1024 * KiB, 0)
        assert "SwapFree" not in meminfo.parse(r.raw())
        rewrite(mi, meminfo_text(1).replace(b"MemAvailable:   1 kB", b"MemAvailable:  -5 kB"))
        with pytest.raises(meminfo.MeminfoError, match="unparsable MemAvailable"):
            r.sample()
        assert "MemAvailable" not in meminfo.parse(mi.read_bytes())
    finally:
        r.close()


def test_an_xmemavailable_line_first_does_not_sigterm_the_engine(engine_factory, tmp_path):
    fe = engine_factory("--hold", "16MiB")
    mi = tmp_path / "meminfo"
    mi.write_bytes(meminfo_text(50 * 1024 * 1024, first="XMemAvailable:      1024 kB\n"))
    port = free_port()
    g = GuardProc({"guard": {"term_below": "1GiB", "grace": "1s"}, "targets": {"match": [rf"vllm serve {fe.model}\b"]},
                   "metrics": {"listen": f"127.0.0.1:{port}"}}, extra_args=("--meminfo", str(mi)))
    try:
        assert "MemAvailable 50.00 GiB" in g.wait_ready()["STATUS"]
        # 3 s of polls: the full passes and the idle fast path both read 50 GiB
        m = wait_scrape(port, g, lambda m: m.get("sparkguard_polls_total", 0) >= 15)
        assert m["sparkguard_memory_available_bytes"] == 50 * GiB
        assert m["sparkguard_polls_total"] > m["sparkguard_poll_duration_seconds_count"] + 5, "fast path unused"
        assert m['sparkguard_incidents_total{kind="memory"}'] == 0
        assert m['sparkguard_signals_total{signal="SIGTERM"}'] == 0
        assert all(not fe.exited(p) for p in fe.pids())
    finally:
        g.stop()


def test_the_metrics_show_the_last_polls_memavailable_on_the_idle_fast_path(tmp_path):
    """docs/snapshot.md: ``available_bytes`` is MemAvailable at the last poll.  On the idle fast
    path (no parse, one full pass every 10 s) a new value shows in the next scrapes, read from the
    reader's buffer, before any full pass has parsed it."""
    mi = tmp_path / "meminfo"
    mi.write_bytes(meminfo_text(50 * 1024 * 1024))
    port = free_port()
    g = GuardProc({"guard": {"term_below": "1GiB"}, "metrics": {"listen": f"127.0.0.1:{port}"}},
                  extra_args=("--meminfo", str(mi)))
    try:
        g.wait_ready()
        wait_scrape(port, g, lambda m: m.get("sparkguard_polls_total", 0)
                    > m.get("sparkguard_poll_duration_seconds_count", 0) + 3)       # on the fast path
        seen_between_full_passes = 0
        for gib in (40, 45, 41, 44, 42):        # 8 digits of kB, far above the fast path's floor
            full = scrape(port)["sparkguard_poll_duration_seconds_count"]
            rewrite(mi, meminfo_text(gib * 1024 * 1024))
            m = wait_scrape(port, g, lambda m: m["sparkguard_memory_available_bytes"] == gib * GiB, timeout=5)
            seen_between_full_passes += m["sparkguard_poll_duration_seconds_count"] == full
        assert seen_between_full_passes >= 3, "MemAvailable showed only after full passes"
    finally:
        g.stop()


# ---- 4: nothing a reload yields ends the loop --------------------------------------------------

def test_a_reload_to_values_the_loop_cannot_run_on_is_refused_and_the_loop_goes_on():
    g = GuardProc({"targets": {"match": [f"^{unique()}$"]}}, watchdog_usec=200_000)
    try:
        g.wait_ready()
        with open(g.config_path, "w") as f:
            f.write("guard:\n  poll_interval: .nan\n")
        g.proc.send_signal(signal.SIGHUP)
        g.notify.wait_for(lambda m: m.get("RELOADING") == "1", timeout=10)
        bad = g.notify.wait_for(lambda m: "reload FAILED" in m.get("STATUS", ""), timeout=10)
        assert "guard.poll_interval" in bad["STATUS"] and "nan" in bad["STATUS"]
        for _ in range(3):      # the loop still runs: it pings
            g.notify.wait_for(lambda m: m.get("WATCHDOG") == "1", timeout=5)
        assert g.proc.poll() is None
        r = run_sparkguard("check-config", g.config_path)
        assert r.returncode == 1 and "guard.poll_interval" in r.stderr, r.stderr
    finally:
        g.stop()


def test_a_reload_of_a_big_config_is_read_off_the_loop_which_keeps_pinging():
    """A 1 MiB config takes seconds of Python to parse: the loop keeps its cadence meanwhile
    (watchdog pings every 0.2 s) and applies the new config once it is read."""
    g = GuardProc({"guard": {"term_below": "0.6GiB"}, "targets": {"match": [f"^{unique()}$"]}},
                  watchdog_usec=400_000)
    try:
        g.wait_ready()
        body = "guard:\n  term_below: 0.7GiB\nlink:\n  interfaces:\n"
        lines, size = [], len(body)
        while size < 1000 * 1024:           # just under config.py's 1 MiB limit
            lines.append(f"    - e{len(lines)}\n")
            size += len(lines[-1])
        with open(g.config_path, "w") as f:
            f.write(body + "".join(lines))
        g.proc.send_signal(signal.SIGHUP)
        g.notify.wait_for(lambda m: m.get("RELOADING") == "1", timeout=10)
        t0 = last = time.monotonic()
        gaps = []
        while True:
            m = g.notify.recv(10)
            assert m is not None, "the guard went silent during the reload"
            now = time.monotonic()
            if m.get("WATCHDOG") == "1":
                gaps.append(now - last)
                last = now
            if "SIGTERM line 0.70 GiB" in m.get("STATUS", ""):
                break
            assert now - t0 < 60, "the reload never applied"
        took = time.monotonic() - t0
        # the parse takes seconds here; pings came on time all along (0.2 s apart, slack for a busy box)
        assert len(gaps) >= 2 and max(gaps) < 1.0, (took, gaps)
    finally:
        g.stop()


# ---- 5: a synchronous reload ------------------------------------------------------------------

def test_sparkguard_reload_fails_on_a_bad_config_and_returns_once_the_new_one_is_in_force():
    port = free_port()
    cfg = {"guard": {"term_below": "0.6GiB"}, "targets": {"match": [f"^{unique()}$"]},
           "metrics": {"listen": f"127.0.0.1:{port}"}}
    g = GuardProc(cfg)
    env = sg_env(RUNTIME_DIRECTORY=g.tmp)
    try:
        g.wait_ready()
        with open(g.config_path, "w") as f:
            f.write("guard:\n  grace: soon\n")
        r = run_sparkguard("reload", "--pid", str(g.proc.pid), "--timeout", "20", env=env)
        assert r.returncode == 1, (r.stdout, r.stderr)
        assert "refused, running config kept" in r.stderr and "guard.grace" in r.stderr and "soon" in r.stderr
        assert scrape(port)['sparkguard_config_reloads_total{result="failed"}'] == 1

        g.write_config({**cfg, "guard": {"term_below": "0.7GiB"}})
        r = run_sparkguard("reload", "--timeout", "20", env=env)      # the pid from the result file
        assert r.returncode == 0, r.stderr
        m = scrape(port)                                            # in force when the command returned
        assert m["sparkguard_term_below_bytes"] == int(0.7 * GiB)
        assert m['sparkguard_config_reloads_total{result="ok"}'] == 1
    finally:
        g.stop()
    # no daemon: a clear error at once, not a wait
    r = run_sparkguard("reload", "--pid", str(g.proc.pid), "--timeout", "20", env=env)
    assert r.returncode == 1 and "no such process" in r.stderr, r.stderr


def test_sparkguard_reload_without_an_answer_times_out_with_the_reason(tmp_path):
    """A process that ignores SIGHUP and never answers: the command gives up after --timeout."""
    p = subprocess.Popen(["python3", "-c", "import signal,sys; signal.signal(signal.SIGHUP, signal.SIG_IGN); "
                          "print(1, flush=True); sys.stdin.read()"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert p.stdout.readline().strip() == b"1"
        t0 = time.monotonic()
        r = run_sparkguard("reload", "--pid", str(p.pid), "--timeout", "1", "--dir", str(tmp_path))
        assert r.returncode == 1 and f"no answer from pid {p.pid}" in r.stderr, r.stderr
        assert 0.9 <= time.monotonic() - t0 < 15
    finally:
        p.kill()
        p.wait(10)


# ---- 2: a stalled stderr ----------------------------------------------------------------------

def test_a_stalled_stderr_drops_and_counts_log_lines_and_the_loop_goes_on(tmp_path):
    """stderr is a pipe nobody reads: once it and the log queue are full, log records are dropped and
    counted, and the loop keeps polling and pinging."""
    import yaml

    from conftest import sparkguard_cmd
    from guardrun import NotifyListener
    port = free_port()
    cfg = tmp_path / "sparkguard.yaml"
    good = {"targets": {"match": [f"^{unique()}$"]}, "metrics": {"listen": f"127.0.0.1:{port}"},
            "incidents": {"dir": str(tmp_path / "incidents"), "journal": "off"}}
    cfg.write_text(yaml.safe_dump(good))
    notify = NotifyListener(str(tmp_path / "notify.sock"))
    r, w = os.pipe()
    fcntl.fcntl(w, 1031, 4096)     # F_SETPIPE_SZ: the pipe holds a dozen lines, not 64 KiB of them
    proc = subprocess.Popen(sparkguard_cmd("run", "--config", str(cfg)), stdout=w, stderr=w,
                            env=sg_env(NOTIFY_SOCKET=notify.path, WATCHDOG_USEC="200000",
                                       RUNTIME_DIRECTORY=str(tmp_path)))
    os.close(w)
    try:
        notify.wait_for(lambda m: m.get("READY") == "1")
        # each reload changes eight keys that take effect after a restart: nine log lines a reload
        # (the reads run in a child process, at most two a second: a few dozen reloads fill the queue)
        for i in range(400):
            cfg.write_text(yaml.safe_dump(dict(good, metrics={"listen": f"127.0.0.1:{port + 1 + i % 2}"},
                                               incidents={"dir": str(tmp_path / f"incidents{i % 2}"),
                                                          "journal": "off" if i % 2 else "auto"},
                                               link={"interfaces": [f"sgt{i % 2}"], "down_after": f"{3 + i % 2}s"},
                                               guard={"blackbox": not i % 2,
                                                      "blackbox_file": str(tmp_path / f"bb{i % 2}"),
                                                      "blackbox_sync": f"{1 + i % 2}s"})))
            proc.send_signal(signal.SIGHUP)
            notify.wait_for(lambda m: m.get("RELOADING") == "1", timeout=10)
            notify.wait_for(lambda m: m.get("READY") == "1", timeout=30)     # the reload is in force
            if i % 10 == 9 and scrape(port).get("sparkguard_log_dropped_total", 0) > 0:
                break
        m = scrape(port)
        assert m["sparkguard_log_dropped_total"] > 0, m
        assert m['sparkguard_config_reloads_total{result="ok"}'] == i + 1
        polls = m["sparkguard_polls_total"]
        for _ in range(3):
            notify.wait_for(lambda m: m.get("WATCHDOG") == "1", timeout=5)
        assert scrape(port)["sparkguard_polls_total"] > polls
    finally:
        os.set_blocking(r, False)
        try:                    # unblock the writer thread so the daemon can exit
            while os.read(r, 1 << 16):
                pass
        except BlockingIOError:
            pass
        proc.terminate()
        deadline = time.monotonic() + 10
        while proc.poll() is None and time.monotonic() < deadline:   # keep draining until it exits
            if select.select([r], [], [], 0.1)[0]:
                os.read(r, 1 << 16)
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        os.close(r)
        notify.close()


def test_sparkguard_reload_never_signals_a_pid_reused_after_the_daemon_died(tmp_path):
    """The result file outlives a crashed daemon (RuntimeDirectoryPreserve=restart): its PID, now another
    process (here one of the test's own, which SIGHUP would end), is not signalled."""
    from sparkguard import reload as reload_cmd
    p = subprocess.Popen(["sleep", "60"])
    try:
        real = reload_cmd.starttime(p.pid)
        assert real is not None
        reload_cmd.write_result(str(tmp_path), {"pid": p.pid, "starttime": real - 1, "generation": 3,
                                                "started_usec": 1, "ok": True, "error": "", "config_path": "x"})
        r = run_sparkguard("reload", "--dir", str(tmp_path), "--timeout", "5")
        assert r.returncode == 1 and "no longer the daemon that wrote it" in r.stderr, r.stderr
        assert p.poll() is None, "the unrelated process got SIGHUP"
    finally:
        p.kill()
        p.wait(10)

"""The fall-rate estimate (sparkguard.rate) on a fake clock, and the rate trigger on a real daemon."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import fake_vllm
from guardrun import GuardProc, unique
from sparkguard import rate
from test_guard_loop import meminfo_text, rewrite

GiB, MiB = 1024**3, 1024**2


def feed(fr: rate.FallRate, t0: float, v0: float, slope: float, dt: float, n: int) -> float:
    """``n`` samples ``dt`` apart on the line ``v0 + slope * (t - t0)``; returns the last time."""
    t = t0
    for i in range(n):
        t = t0 + i * dt
        fr.add(t, int(v0 + slope * (t - t0)))
    return t


def test_a_steady_fall_is_measured_at_any_cadence():
    for dt in (0.2, 0.05, 0.002):
        fr = rate.FallRate(1.0)
        t = feed(fr, 100.0, 20 * GiB, -2 * GiB, dt, int(2 / dt))
        assert fr.estimate(t) == pytest.approx(2 * GiB, rel=0.01), dt
        assert fr.rate == fr.estimate(t)


def test_rises_and_flat_read_as_zero():
    fr = rate.FallRate(1.0)
    t = feed(fr, 0.0, 5 * GiB, +1 * GiB, 0.05, 30)
    assert fr.estimate(t) == 0.0
    fr.reset()
    t = feed(fr, 10.0, 5 * GiB, 0.0, 0.05, 30)
    assert fr.estimate(t) == 0.0


def test_one_wild_sample_does_not_move_the_median():
    fr = rate.FallRate(1.0)
    t = feed(fr, 0.0, 10 * GiB, -256 * MiB, 0.1, 10)
    fr.add(t + 0.1, 10 * GiB - 6 * GiB)          # one torn or transient read, 6 GiB low
    fr.add(t + 0.2, int(10 * GiB - 256 * MiB * (t + 0.2)))
    est = fr.estimate(t + 0.2)
    assert est == pytest.approx(256 * MiB, rel=0.5), est / MiB
    assert est < 1 * GiB


def test_samples_older_than_the_window_are_ignored():
    fr = rate.FallRate(0.5)
    feed(fr, 0.0, 10 * GiB, -4 * GiB, 0.05, 10)          # a fall, then nothing for a second
    assert fr.estimate(2.0) == 0.0                        # all of it older than 0.5 s
    fr.add(2.0, 1 * GiB)
    fr.add(2.1, 1 * GiB)
    assert fr.estimate(2.1) == 0.0                        # two samples are not an estimate


def test_the_ring_stays_bounded_and_the_estimate_cheap_at_the_fastest_cadence():
    fr = rate.FallRate(1.0)
    t = feed(fr, 0.0, 100 * GiB, -1 * GiB, 0.002, 10_000)    # 500 polls/s for 20 s
    assert fr._n <= rate.RING and len(fr._slopes) == rate.RING * (rate.RING - 1) // 2
    n = 2000
    t0 = time.perf_counter()
    for _ in range(n):
        fr.estimate(t)
    per = (time.perf_counter() - t0) / n
    assert fr.rate == pytest.approx(1 * GiB, rel=0.01)
    assert per < 1e-3, f"{per * 1e6:.0f} us per estimate"     # ~25-40 us here; bounded work per poll


def test_a_clock_that_goes_back_starts_again_and_bad_windows_are_refused():
    fr = rate.FallRate(1.0)
    feed(fr, 10.0, 10 * GiB, -1 * GiB, 0.1, 10)
    fr.add(5.0, GiB)
    assert fr._n == 1
    for bad in (0, -1, math.inf, math.nan):
        with pytest.raises(ValueError):
            rate.FallRate(bad)
    assert rate.seconds_to_line(3 * GiB, GiB, GiB) == 2.0
    assert rate.seconds_to_line(GiB, GiB, GiB) == 0.0 and rate.seconds_to_line(2 * GiB, GiB, 0.0) == math.inf


# ---- a real daemon, a real victim ------------------------------------------------------------------

def victim(tag: str) -> subprocess.Popen:
    """A real process the daemon can match and SIGTERM (Python's default: TERM ends it)."""
    return subprocess.Popen([sys.executable, "-c", "import time, sys; time.sleep(600)", tag])


def run_fall(tmp_path, rate_trigger: str, *, line_gib=2, start_gib=6.0, stop_gib=2.5, fall_gib_s=2.0):
    """A daemon reading a meminfo file that the test lowers at ``fall_gib_s`` from ``start_gib`` to
    ``stop_gib`` (never below the ``line_gib`` line); returns (guard, victim, lowest value written)."""
    mi = tmp_path / "meminfo"
    mi.write_bytes(meminfo_text(int(start_gib * GiB) // 1024))
    tag = unique("sgrate")
    v = victim(tag)
    g = GuardProc({"guard": {"term_below": f"{line_gib}GiB", "grace": "5s", "rate_trigger": rate_trigger,
                             "rate_lead": "1s", "rate_window": "1s", "rate_min_fall": "256MiB/s"},
                   "targets": {"match": [tag]}}, extra_args=("--meminfo", str(mi)))
    g.wait_ready()
    t0 = time.monotonic()
    low = start_gib * GiB
    while low > stop_gib * GiB and v.poll() is None:
        low = max(stop_gib * GiB, start_gib * GiB - fall_gib_s * GiB * (time.monotonic() - t0))
        rewrite(mi, meminfo_text(int(low) // 1024))
        time.sleep(0.01)       # the test's own fill cadence, 100 writes/s: not a synchronisation
    return g, v, low


def test_the_rate_trigger_sigterms_a_fall_before_it_crosses_the_line(tmp_path):
    from test_guard_incidents import wait_incident
    g, v, low = run_fall(tmp_path, "on")
    try:
        assert v.wait(10) == -15, "the victim was not SIGTERMed"
        inc = wait_incident(g, timeout=20)
        trig = inc["trigger"]
        assert trig["trigger"] == "predicted" and trig["phase"] == "serving", trig
        assert 1.0 * GiB < trig["fall_rate_bytes_per_second"] < 3.0 * GiB, trig
        assert 0 < trig["seconds_to_line"] <= 1.0
        crossed = inc["timeline"][0]
        assert crossed["event"] == "crossed" and crossed["detail"].startswith("predicted: "), crossed
        assert crossed["available_bytes"] > 2 * GiB           # acted while still above the line
        assert [e["event"] for e in inc["timeline"]][:2] == ["crossed", "sigterm"]
        assert inc["summary"].startswith("predicted crossing ("), inc["summary"]
    finally:
        g.stop()
        if v.poll() is None:
            v.kill()
        v.wait(5)


def test_with_the_rate_trigger_off_the_same_fall_above_the_line_is_left_alone(tmp_path):
    g, v, low = run_fall(tmp_path, "off")
    try:
        assert low == 2.5 * GiB and v.poll() is None
        # the fall has ended above the line: nothing may happen; give the daemon a second to be wrong
        with pytest.raises(subprocess.TimeoutExpired):
            v.wait(1.0)
        inc_dir = os.path.join(g.tmp, "incidents")
        assert not os.path.isdir(inc_dir) or not [f for f in os.listdir(inc_dir) if f.endswith(".json")]
        assert "crossed" not in g.log() and "predicted" not in g.log()
    finally:
        g.stop()
        v.kill()
        v.wait(5)


# ---- the load phase: a supervised engine that is loading ------------------------------------------

def write_fall(mi, start: float, stop: float, gib_s: float) -> None:
    """Lower the meminfo file's MemAvailable from ``start`` to ``stop`` bytes at ``gib_s`` GiB/s."""
    t0 = time.monotonic()
    v = start
    while v > stop:
        v = max(stop, start - gib_s * GiB * (time.monotonic() - t0))
        rewrite(mi, meminfo_text(int(v) // 1024))
        time.sleep(0.01)       # the test's own fill cadence: not a synchronisation


@pytest.mark.usefixtures("root_only")
def test_a_loads_steep_fall_is_not_a_leak_but_a_load_below_its_line_is_a_failed_load(tmp_path):
    """A real daemon supervising the real fake vLLM (loading for a minute: its port does not listen),
    the memory signal from a file the test writes.  The serving lines (2 GiB, rate lead 1 s) would
    SIGTERM a 4 GiB/s fall ending at 5 GiB; the load phase's (4 GiB, no lead) leave it alone and stop
    the load only once it is below 4 GiB: a failed load, restart reason ``load``, counted."""
    from supervisor_helpers import Daemon, engine_config, fake_cmd, free_port, unique as sup_unique
    mi = tmp_path / "meminfo"
    mi.write_bytes(meminfo_text(20 * GiB // 1024))
    model, port = sup_unique("sgload"), free_port()
    cfg = engine_config(tmp_path, model, fake_cmd(model, port, "--load-time", "120"), port,
                        ready_timeout="600s", give_up_after=2, load_phase={"term_below": "4GiB"})
    cfg["guard"].update({"term_below": "2GiB", "rate_trigger": "on", "rate_lead": "1s", "rate_window": "1s"})
    d = Daemon(tmp_path, cfg, extra_args=("--meminfo", str(mi)))
    try:
        d.wait_control()
        d.wait_starts(0)
        d.wait_line(r"fake-vllm: ready pids=")
        st = d.status()
        assert st["phase"] == "loading" and st["failed_loads"] == 0, st
        pid = st["pid"]
        mark = d.mark()
        write_fall(mi, 20 * GiB, 5 * GiB, 4.0)
        # the fall has ended above the load line: nothing may happen; give the daemon a second to be wrong
        with pytest.raises(AssertionError):
            d.wait_line(r"crossed|SIGTERM", timeout=1.0, start=mark)
        assert d.status()["pid"] == pid
        write_fall(mi, 5 * GiB, 3.5 * GiB, 2.0)
        inc = d.incident("memory", timeout=30, start=mark)
        trig = inc["trigger"]
        assert trig["phase"] == "loading" and trig["trigger"] == "line" and trig["line_bytes"] == 4 * GiB, trig
        assert "a failed load" in inc["timeline"][0]["detail"], inc["timeline"][0]
        assert inc["summary"].startswith("failed load; "), inc["summary"]
        rewrite(mi, meminfo_text(20 * GiB // 1024))        # memory back: the incident closes, the restart may go
        st = d.wait_starts(1, timeout=60)
        assert st["failed_loads"] == 1 and st["restarts"]["load"] == 1, st
        assert "failed load" in st["last_exit"]["detail"] and st["last_exit"]["reason"] == "load", st["last_exit"]
    finally:
        d.cleanup()


def test_failed_loads_are_failures_that_end_in_giving_up_not_blind_retries():
    """A load the guard stopped (restart reason ``load``) is a failure before ready: the backoff
    grows and ``engine.give_up_after`` of them within the window stop the supervisor (issue 17:
    "not retried blindly"); a load the guard did not touch is an ordinary exit, and a run that
    got ready in between starts the count again.  The pure parts the supervisor uses
    (sparkguard/supervisor/restart.py)."""
    from sparkguard.supervisor import restart
    assert restart.classify_exit(None, None, guard_hit=True, load_hit=True) == (restart.LOAD, True)
    assert restart.classify_exit(None, None, guard_hit=True, load_hit=False) == ("guard", True)
    g = restart.GiveUp(after=3, window=600.0)
    assert not g.record(0.0, True, False, restart.LOAD)
    assert not g.record(60.0, True, False, restart.LOAD)
    assert g.record(120.0, True, False, restart.LOAD)          # the third failed load: give up
    g = restart.GiveUp(after=3, window=600.0)
    g.record(0.0, True, False, restart.LOAD)
    g.record(60.0, True, False, restart.LOAD)
    assert not g.record(90.0, True, True, "guard")            # it got ready once: the count starts again
    assert not g.record(120.0, True, False, restart.LOAD) and not g.record(180.0, True, False, restart.LOAD)
    assert g.record(240.0, True, False, restart.LOAD)
    b = restart.Backoff(1.0, 60.0, stable_after=300.0)
    assert [b.next(5.0) for _ in range(3)] == [1.0, 2.0, 4.0]  # loads that fail at once back off


# ---- the fake vLLM's load phase and allocation size ------------------------------------------------

def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def test_the_fake_vllm_loads_memory_before_its_port_listens_in_allocations_of_the_given_size(engine_factory):
    fe = engine_factory("--port", "0", "--load-time", "1.5", "--load-fill", "384MiB", "--alloc-step", "128MiB",
                        "--hold", "8MiB")
    tp0 = fe.worker_pids[0]
    serving = fe.wait_serving(timeout=30)
    assert serving.startswith("fake-vllm: serving url=")
    out = fe.output().splitlines()
    fills = [ln for ln in out if ln.startswith("fake-vllm: fill ")]
    assert fills and fills[-1].endswith(f"bytes={384 * MiB} target={384 * MiB} done"), fills
    # the load's memory was all held before the port listened
    assert out.index(fills[-1]) < out.index(serving), out
    assert rss(tp0) >= 384 * MiB + 8 * MiB, rss(tp0) / MiB
    done = [int(ln.split("bytes=")[1].split()[0]) for ln in fills]
    assert all(b % (128 * MiB) == 0 for b in done), done          # whole allocations only
    rate = 384 * MiB / (fake_vllm.LOAD_FILL_SHARE * 1.5)
    assert any("filling" in ln and f"{rate:.0f} B/s" in ln for ln in out), out


def proc_state(pid: int) -> str:
    """The state letter of /proc/PID/stat (proc(5): the field after the parenthesised comm)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def test_the_fake_vllms_port_listens_only_once_tp0s_load_is_done_however_late(engine_factory):
    """A load that takes longer than ``--load-time`` (TP0 stopped mid-load, as a loaded host
    would slow it): the top's own clock runs out, it says it waits for the engine core, and the
    port refuses connections until TP0 has allocated all of its load; then it serves."""
    import socket
    fe = engine_factory("--port", "0", "--load-time", "2", "--load-fill", "384MiB", "--alloc-step", "128MiB",
                        "--hold", "8MiB")
    tp0, port = fe.worker_pids[0], fe.port
    fd = os.pidfd_open(tp0)
    try:
        signal.pidfd_send_signal(fd, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while proc_state(tp0) != "T":           # no event says a process stopped: read its state, bounded
            assert time.monotonic() < deadline, "TP0 did not stop within 10 s"
            time.sleep(0.01)
        if rss(tp0) >= 384 * MiB + 8 * MiB:
            pytest.skip("TP0 had allocated its whole load before the test could stop it (a very slow start)")
        # the load time (2 s on the top's clock) runs out while TP0 still loads: no serving yet
        waiting = fe.wait_line("Waiting for 1 local, 0 remote core engine proc(s) to start.", timeout=30)
        assert not any(ln.startswith(fake_vllm.SERVING_PREFIX) for ln in fe.lines), fe.output()
        with socket.socket() as s, pytest.raises(ConnectionRefusedError):
            s.settimeout(5)
            s.connect(("127.0.0.1", port))      # bound, not listening
        signal.pidfd_send_signal(fd, signal.SIGCONT)
        serving = fe.wait_serving(timeout=30)
    finally:
        signal.pidfd_send_signal(fd, signal.SIGCONT)
        os.close(fd)
    out = fe.output().splitlines()
    done = [ln for ln in out if ln.startswith("fake-vllm: fill ") and ln.endswith(" done")]
    assert done and out.index(waiting) < out.index(done[0]) < out.index(serving), out
    assert rss(tp0) >= 384 * MiB + 8 * MiB, rss(tp0) / MiB
    with socket.create_connection(("127.0.0.1", port), timeout=5):
        pass


# ---- configuration ---------------------------------------------------------------------------------

def test_the_rate_and_load_phase_keys_are_checked_naming_file_key_and_value():
    from sparkguard import config
    from sparkguard.guard import settings
    eng = {"command": ["sleep", "1"]}
    cfg = config.from_dict({"guard": {"rate_trigger": "on", "rate_lead": "1500ms", "rate_min_fall": "512MiB/s"},
                            "engine": dict(eng, load_phase={"term_below": "3GiB", "rate_lead": "2s"})},
                           "/etc/sg.yaml", mem_total=64 * GiB)
    th = settings.make_thresholds(cfg)
    assert (th.rate_lead, th.rate_min) == (1.5, 512 * MiB)
    assert (th.load.term_below, th.load.rate_lead, th.load.rate_min) == (3 * GiB, 2.0, 512 * MiB)
    assert settings.loop_settings(cfg).idle_floor == 3 * GiB + settings.loop_settings(cfg).far
    # off: no lead in either phase, the load's line still applies
    off = config.from_dict({"engine": dict(eng, load_phase={"term_below": "3GiB", "rate_lead": "2s"})},
                           "/etc/sg.yaml", mem_total=64 * GiB)
    th = settings.make_thresholds(off)
    assert th.rate_lead == 0.0 and th.load.rate_lead == 0.0 and th.load.term_below == 3 * GiB
    assert settings.make_thresholds(config.from_dict({}, "x", mem_total=64 * GiB)).load is None
    bad = [({"guard": {"rate_trigger": "maybe"}}, "guard.rate_trigger", "maybe"),
           ({"guard": {"rate_lead": "61s"}}, "guard.rate_lead", "61s"),
           ({"guard": {"rate_window": "1ms"}}, "guard.rate_window", "1ms"),
           ({"guard": {"rate_min_fall": "fast"}}, "guard.rate_min_fall", "fast"),
           ({"engine": dict(eng, load_phase={"term_below": "1MiB"})}, "engine.load_phase.term_below", "1MiB"),
           ({"engine": dict(eng, load_phase={"lead": "1s"})}, "engine.load_phase.lead", "1s"),
           ({"engine": dict(eng, load_phase="on")}, "engine.load_phase", "on"),
           ({"engine": dict(eng, load_phase={"term_below": "80GiB"})}, "engine.load_phase.term_below", "80GiB")]
    for doc, key, value in bad:
        with pytest.raises(config.ConfigError) as e:
            config.from_dict(doc, "/etc/sg.yaml", mem_total=64 * GiB)
        msg = str(e.value)
        assert "/etc/sg.yaml" in msg and key in msg and value in msg, msg


def test_a_reload_turns_the_rate_trigger_on_and_its_gauge_appears(tmp_path):
    """SIGHUP with ``guard.rate_trigger: on``: the running daemon estimates from then on (the
    gauge is served), and a fall then ends in a predicted SIGTERM."""
    from test_guard_incidents import wait_incident
    from test_guard_loop import free_port, wait_scrape
    mi = tmp_path / "meminfo"
    mi.write_bytes(meminfo_text(6 * GiB // 1024))
    tag = unique("sgrate")
    v = victim(tag)
    port = free_port()
    cfg = {"guard": {"term_below": "2GiB", "grace": "5s"}, "targets": {"match": [tag]},
           "metrics": {"listen": f"127.0.0.1:{port}"}}
    g = GuardProc(cfg, extra_args=("--meminfo", str(mi)))
    try:
        g.wait_ready()
        m = wait_scrape(port, g, lambda m: "sparkguard_polls_total" in m)
        assert "sparkguard_memory_fall_rate_bytes_per_second" not in m
        cfg["guard"]["rate_trigger"] = "on"
        g.write_config(cfg)
        g.proc.send_signal(signal.SIGHUP)
        g.wait_log("reloaded")
        wait_scrape(port, g, lambda m: "sparkguard_memory_fall_rate_bytes_per_second" in m)
        write_fall(mi, 6 * GiB, 2.5 * GiB, 2.0)
        assert v.wait(10) == -15
        assert wait_incident(g, timeout=20)["trigger"]["trigger"] == "predicted"
    finally:
        g.stop()
        if v.poll() is None:
            v.kill()
        v.wait(5)

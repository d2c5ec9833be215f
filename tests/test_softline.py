"""The soft line (issue 17): the fake vLLM's pause endpoints, the pure soft-line machine on a fake
clock, the pause client, and the real daemon pausing and resuming a real fake vLLM.

Real parts: the fake vLLM is a real process tree serving real HTTP; the end-to-end tests fill
real memory (a few hundred MiB) with lines placed relative to the MemAvailable read at the start.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid

import pytest

from conftest import fake_vllm

MiB = 1024 * 1024
GiB = 1024 * MiB
DEV = {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}


@pytest.fixture
def fakes():
    """``fakes(*opts, env=...)``: fake vLLMs serving HTTP, each stopped (whole tree) at the end."""
    started: list = []

    def _start(*opts: str, env=None):
        model = f"pause-model-{uuid.uuid4().hex[:10]}"
        fe = fake_vllm.start(model, "--port", "0", "--tp", "1", *opts, env=env if env is not None else DEV)
        fe.model = model
        started.append(fe)
        fe.wait_serving(30)
        return fe

    try:
        yield _start
    finally:
        for fe in started:
            fe.stop()


def _http(url: str, body: bytes | None = None, timeout: float = 10.0) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=body, method="POST" if body is not None else "GET")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def _complete(url: str, out: dict, key: str) -> threading.Thread:
    """A completion in a thread; its ``(status, body)`` lands in ``out[key]``."""
    def run():
        out[key] = _http(url + "/v1/completions", json.dumps({"prompt": "hi"}).encode(), timeout=30)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _wait(pred, timeout: float = 10.0, what: str = "condition") -> None:
    """Poll ``pred`` (an HTTP read: no event tells when a request reached the fake's scheduler)."""
    end = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > end:
            raise AssertionError(f"{what} not reached within {timeout}s")
        time.sleep(0.02)


def _waiting(url: str) -> float:
    text = urllib.request.urlopen(url + "/metrics", timeout=5).read().decode()
    return float(next(ln.split()[-1] for ln in text.splitlines() if ln.startswith("vllm:num_requests_waiting")))


# ---- the fake vLLM's endpoints (fake_pause.py; docs/soft-line.md "What vLLM does") -------------

def test_fake_pause_endpoints_absent_without_dev_mode(fakes):
    fe = fakes(env={k: v for k, v in os.environ.items() if k != "VLLM_SERVER_DEV_MODE"})
    assert _http(fe.url + "/pause", b"") == (404, {"detail": "Not Found"})
    assert _http(fe.url + "/resume", b"") == (404, {"detail": "Not Found"})
    assert _http(fe.url + "/is_paused") == (404, {"detail": "Not Found"})


def test_fake_pause_keep_freezes_new_and_inflight_until_resume(fakes):
    fe = fakes("--request-time", "0.5")
    out: dict = {}
    t_run = _complete(fe.url, out, "inflight")
    _wait(lambda: "inflight" not in out and _running(fe.url) >= 1, what="a request in flight")
    assert _http(fe.url + "/pause?mode=keep", b"") == (200, {"status": "paused"})
    assert _http(fe.url + "/is_paused") == (200, {"is_paused": True})
    t_new = _complete(fe.url, out, "new")
    _wait(lambda: _waiting(fe.url) >= 1, what="the new request waiting")
    assert _http(fe.url + "/health")[0] == 200          # /health is not affected by a pause
    t_run.join(1.0)
    assert "inflight" not in out and "new" not in out    # frozen and held, not rejected
    assert _http(fe.url + "/resume", b"") == (200, {"status": "resumed"})
    t_run.join(10)
    t_new.join(10)
    assert out["inflight"][0] == 200 and out["inflight"][1]["choices"][0]["finish_reason"] == "length"
    assert out["new"][0] == 200 and out["new"][1]["choices"][0]["finish_reason"] == "length"
    assert _http(fe.url + "/is_paused") == (200, {"is_paused": False})


def test_fake_pause_abort_ends_inflight_at_once(fakes):
    fe = fakes("--request-time", "20")
    out: dict = {}
    t = _complete(fe.url, out, "inflight")
    _wait(lambda: _running(fe.url) >= 1, what="a request in flight")
    assert _http(fe.url + "/pause", b"") == (200, {"status": "paused"})   # default mode: abort
    t.join(5)
    assert out["inflight"][0] == 200 and out["inflight"][1]["choices"][0]["finish_reason"] == "abort"
    assert _http(fe.url + "/resume", b"")[0] == 200


def test_fake_pause_wait_answers_after_inflight_and_bad_mode_is_422(fakes):
    fe = fakes("--request-time", "0.6")
    out: dict = {}
    t = _complete(fe.url, out, "inflight")
    _wait(lambda: _running(fe.url) >= 1, what="a request in flight")
    t0 = time.monotonic()
    assert _http(fe.url + "/pause?wait_for_inflight_requests=true", b"") == (200, {"status": "paused"})
    t.join(5)
    assert out["inflight"][1]["choices"][0]["finish_reason"] == "length"
    assert time.monotonic() - t0 > 0.2
    code, body = _http(fe.url + "/pause?mode=sleep", b"")
    assert code == 422 and body["detail"][0]["loc"] == ["query", "mode"]


def _running(url: str) -> float:
    text = urllib.request.urlopen(url + "/metrics", timeout=5).read().decode()
    return float(next(ln.split()[-1] for ln in text.splitlines() if ln.startswith("vllm:num_requests_running")))


# ---- the pure machine on a fake clock (sparkguard/softline.py) ------------------------------

from sparkguard import policy, softline  # noqa: E402
from sparkguard.softline import SoftLine, SoftLines  # noqa: E402

PAUSE_AT, HYST, TERM = 8 * GiB, 512 * MiB, 4 * GiB
LINES = SoftLines(pause_below=PAUSE_AT, hysteresis=HYST, resume_after=10.0, answer_timeout=3.0)


class Run:
    """The soft line beside the real hard policy, both on one fake clock, as the loop feeds them."""

    def __init__(self, lines=LINES):
        self.soft = SoftLine(lines)
        self.hard = policy.Policy(policy.Thresholds(term_below=TERM, kill_below=None, grace=5.0))
        self.t = 0.0
        self.log: list[tuple[float, str]] = []

    def poll(self, value: int, dt: float = 0.2, offered=True, victim_gone=False) -> tuple[str, ...]:
        self.t += dt
        hard = self.hard.step(self.t, value, victim_gone) if (self.hard.state != policy.OK or value < TERM) else ()
        soft = self.soft.step(self.t, value, self.hard.state == policy.OK, offered)
        self.log += [(self.t, a) for a in hard + soft]
        return hard + soft

    def answer(self, op: str, ok: bool) -> tuple[str, ...]:
        acts = self.soft.answered(self.t, op, ok)
        self.log += [(self.t, a) for a in acts]
        return acts


def test_cross_soft_line_pauses_once_and_holds():
    r = Run()
    assert r.poll(9 * GiB) == ()
    assert r.poll(PAUSE_AT - 1) == (softline.PAUSE,)
    assert r.poll(PAUSE_AT - 2) == ()                     # one request, not one per poll
    assert r.answer("pause", True) == (softline.PAUSED_OK,)
    assert r.soft.state == softline.PAUSED and r.soft.engine_paused
    for _ in range(100):                                   # below the line: held, no hard action
        assert r.poll(6 * GiB) == ()
    assert r.hard.state == policy.OK


def test_resume_needs_the_hysteresis_for_resume_after_seconds():
    r = Run()
    r.poll(PAUSE_AT - 1)
    r.answer("pause", True)
    for _ in range(100):                                   # above the line, inside the band: no resume
        assert r.poll(PAUSE_AT + HYST - 1) == ()
    r.poll(PAUSE_AT + HYST)                                # the clock starts here
    t_above = r.t
    for _ in range(60):
        r.poll(PAUSE_AT + HYST + GiB, dt=0.2)
        if r.log[-1][1] == softline.RESUME:
            break
    assert r.log[-1][1] == softline.RESUME and r.log[-1][0] - t_above == pytest.approx(10.0, abs=0.21)
    # one dip below the band on the way restarts the count
    r2 = Run()
    r2.poll(PAUSE_AT - 1)
    r2.answer("pause", True)
    r2.poll(PAUSE_AT + HYST, dt=0.0)
    r2.poll(PAUSE_AT + HYST, dt=9.0)
    assert r2.poll(PAUSE_AT, dt=0.5) == ()                 # dipped
    assert r2.poll(PAUSE_AT + HYST, dt=0.5) == ()          # back: the count restarts
    assert r2.poll(PAUSE_AT + HYST, dt=9.9) == ()
    assert r2.poll(PAUSE_AT + HYST, dt=0.2) == (softline.RESUME,)
    assert r2.answer("resume", True) == (softline.RESUMED,)
    assert r2.soft.state == softline.IDLE and not r2.soft.engine_paused
    assert r2.poll(PAUSE_AT - 1) == (softline.PAUSE,)      # a fresh crossing pauses again


def test_hard_line_while_paused_sigterms_at_once():
    r = Run()
    r.poll(PAUSE_AT - 1)
    r.answer("pause", True)
    r.poll(5 * GiB)
    acts = r.poll(TERM - 1)
    assert acts == (policy.CROSSED, policy.TERM, softline.ESCALATED)   # SIGTERM first, same poll
    assert r.soft.state == softline.LATCHED
    # while the kill runs and memory is low, the soft line sends nothing
    for _ in range(20):
        assert softline.PAUSE not in r.poll(TERM - 1)
    assert r.poll(TERM - 1, victim_gone=True) == (policy.EXITED,)
    # memory back, the hard incident over; the engine still counts as paused (the victim may have
    # been another tree): one resume, so it never stays paused
    assert r.poll(PAUSE_AT + HYST, victim_gone=True) == (policy.RECOVERED, softline.RESUME)
    assert r.hard.state == policy.OK


def test_hard_line_while_the_pause_is_still_unanswered_is_not_delayed():
    r = Run()
    assert r.poll(PAUSE_AT - 1) == (softline.PAUSE,)
    assert r.poll(TERM - 1, dt=0.01) == (policy.CROSSED, policy.TERM, softline.ESCALATED)
    assert r.answer("pause", True) == ()                 # a late answer changes nothing but the flag
    assert r.soft.engine_paused


def test_pause_failure_goes_on_as_without_the_soft_line():
    r = Run()
    r.poll(PAUSE_AT - 1)
    assert r.answer("pause", False) == (softline.PAUSE_FAILED,)
    for _ in range(50):                                   # no retry while memory stays low
        assert r.poll(6 * GiB) == ()
    assert r.poll(TERM - 1) == (policy.CROSSED, policy.TERM)   # the hard line as ever
    # no answer at all: failed after answer_timeout
    r2 = Run()
    r2.poll(PAUSE_AT - 1)
    assert r2.poll(6 * GiB, dt=2.9) == ()
    assert r2.poll(6 * GiB, dt=0.2) == (softline.PAUSE_FAILED,)
    r2.answer("pause", True)                              # too late: counted as paused, resumed when back
    assert r2.poll(PAUSE_AT + HYST) == (softline.RESUME,)
    # re-armed only above the band
    r3 = Run()
    r3.poll(PAUSE_AT - 1)
    r3.answer("pause", False)
    assert r3.poll(PAUSE_AT + HYST - 1) == ()
    assert r3.poll(PAUSE_AT + HYST) == ()
    assert r3.soft.state == softline.IDLE
    assert r3.poll(PAUSE_AT - 1) == (softline.PAUSE,)


def test_engine_without_pause_is_never_sent_one_and_off_means_off():
    r = Run()
    assert r.poll(PAUSE_AT - 1, offered=False) == ()
    assert r.soft.state == softline.IDLE
    off = Run(SoftLines(pause_below=None, hysteresis=HYST, resume_after=1.0))
    assert off.poll(TERM + 1) == () and off.soft.state == softline.IDLE


def test_resume_failures_retry_then_give_up():
    r = Run()
    r.poll(PAUSE_AT - 1)
    r.answer("pause", True)
    r.poll(PAUSE_AT + HYST, dt=0.0)
    assert r.poll(PAUSE_AT + HYST, dt=10.0) == (softline.RESUME,)
    assert r.answer("resume", False) == (softline.RESUME_FAILED,)
    assert r.poll(PAUSE_AT + HYST, dt=9.0) == ()
    assert r.poll(PAUSE_AT + HYST, dt=1.0) == (softline.RESUME,)
    assert r.poll(PAUSE_AT + HYST, dt=3.0) == (softline.RESUME_FAILED,)     # no answer in time
    r.poll(PAUSE_AT + HYST, dt=10.0)
    assert r.answer("resume", False) == (softline.RESUME_GAVE_UP,)
    assert r.soft.state == softline.LATCHED and r.soft.engine_paused


def test_deadline_says_when_time_alone_moves_the_state():
    r = Run()
    assert r.soft.deadline(r.t) is None
    r.poll(PAUSE_AT - 1)
    assert r.soft.deadline(r.t) == pytest.approx(3.0)
    r.answer("pause", True)
    assert r.soft.deadline(r.t) is None                   # only memory can move it now
    r.poll(PAUSE_AT + HYST)
    assert r.soft.deadline(r.t) == pytest.approx(10.0)


# ---- end to end: the real daemon, a real fake vLLM, real memory -----------------------------

import glob  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

from conftest import mem_available, run_sparkguard, sg_env  # noqa: E402
from sparkguard.units import format_size  # noqa: E402
from guardrun import GuardProc  # noqa: E402

_HOLD = ("import sys\nfrom sparkguard.drill.hog import Memory\nm = Memory()\n"
         "for line in sys.stdin:\n    m.add(int(line))\n    print('held', m.nbytes, flush=True)\n")


class Hold:
    """A process holding real, touched, incompressible memory (``nbytes`` at once, more with
    :meth:`grow`) until :meth:`release`."""

    def __init__(self, nbytes: int = 0):
        self.proc = subprocess.Popen([sys.executable, "-c", _HOLD], env=sg_env(),
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        if nbytes:
            self.grow(nbytes)

    def grow(self, nbytes: int) -> None:
        self.proc.stdin.write(f"{int(nbytes)}\n")
        self.proc.stdin.flush()
        assert self.proc.stdout.readline().startswith("held")

    def until_paused(self, g: GuardProc, step: int = 200 * MiB, limit: int = 3 * GiB) -> None:
        """Grow by ``step`` until the daemon's STATUS= says the engine is paused: the drop needed
        depends on what the machine's other work does meanwhile (MemAvailable moved 1.2 GiB in 30 s
        here), so the fill follows the daemon rather than a fixed size."""
        held = 0
        while held < limit:
            self.grow(step)
            held += step
            end = time.monotonic() + 1.0
            while time.monotonic() < end:
                msg = g.notify.recv(max(0.01, end - time.monotonic()))
                if msg is not None and "ENGINE PAUSED" in msg.get("STATUS", ""):
                    return
        raise AssertionError(f"not paused after holding {held / MiB:.0f} MiB; log:\n{g.log()[-2000:]}")

    def release(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(10)


def _settled_available() -> int:
    """MemAvailable once it has settled (test_drill's ``_settle``: a tree another test just killed
    returns its memory over seconds); the lines are placed relative to it."""
    from test_drill import _settle
    _settle(band=64 * MiB)
    return mem_available()


#: the hard line this far under MemAvailable in the tests that must never reach it: MemAvailable on
#: this shared machine moved 1.2 GiB within 30 s with none of these tests running (2026-12-01)
FAR = 4 * GiB
#: the soft line this far under MemAvailable: memory must come back within SOFT - 100 MiB (the tests'
#: hysteresis) of where it started for the resume, whatever the other work on the machine does
SOFT = 600 * MiB


def _incidents(g: GuardProc, kind: str) -> list[dict]:
    out = []
    for path in glob.glob(os.path.join(g.cfg["incidents"]["dir"], "*.json")):
        with open(path) as f:
            rec = json.load(f)
        if rec.get("kind") == kind and rec.get("ended_at"):
            out.append(rec)
    return sorted(out, key=lambda r: r["started_at"])


def _wait_incident(g: GuardProc, kind: str, timeout: float = 30.0) -> dict:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = _incidents(g, kind)
        if got:
            return got[0]
        g.notify.recv(0.2)          # each pause event changes STATUS=; the file comes from the reporter thread
    raise AssertionError(f"no finished {kind} incident within {timeout}s (MemAvailable "
                         f"{mem_available() / MiB:.0f} MiB); log:\n{g.log()[-3000:]}")


def _soft_cfg(fe, pause_below: int, term_below: int, **guard) -> dict:
    return {"guard": {"term_below": term_below, "pause_below": pause_below, "pause_hysteresis": "100MiB",
                      "resume_after": "1s", "pause_url": fe.url, "pause_timeout": "2s", "grace": "10s", **guard},
            "targets": {"match": [rf"serve {fe.model}\b"]}}


def _far_lines() -> tuple[int, int]:
    """``(pause_below, term_below)``: the soft line SOFT under the settled MemAvailable, the hard
    line FAR under it (the test is skipped when the host has not that much)."""
    avail = _settled_available()
    if avail < FAR + 2 * GiB:
        pytest.skip("not enough MemAvailable for the soft and hard lines on this host right now")
    return avail - SOFT, avail - FAR


def test_daemon_pauses_at_the_soft_line_and_resumes_when_memory_is_back(fakes):
    from supervisor_helpers import free_port
    fe = fakes()
    pause_below, term_below = _far_lines()
    cfg = _soft_cfg(fe, pause_below, term_below)
    cfg["metrics"] = {"listen": f"127.0.0.1:{free_port()}"}
    g = GuardProc(cfg)
    hold = None
    try:
        g.wait_ready()
        g.wait_log("soft line: GET")            # the probe at start found the endpoint
        hold = Hold()
        hold.until_paused(g)
        assert _http(fe.url + "/is_paused") == (200, {"is_paused": True})
        # `sparkguard status` shows the pause now, from the daemon's metrics (sparkguard/softview.py)
        st = run_sparkguard("status", "--config", g.config_path, timeout=60)
        assert st.returncode == 0, st.stderr
        soft = st.stdout.split("Soft line   ", 1)[1].split("\n\n", 1)[0]
        assert soft.startswith(f"pause below {format_size(pause_below)}, resume above "
                               f"{format_size(pause_below + 100 * MiB)} held 1.0 s, mode keep; engine {fe.url}"), soft
        assert "now          ENGINE PAUSED; since the daemon started: pauses 1 ok, 0 failed" in soft, soft
        assert "never engaged" in soft                  # the episode is open: no record yet
        out: dict = {}
        t = _complete(fe.url, out, "held")
        _wait(lambda: _waiting(fe.url) >= 1, what="a request held by the pause")
        assert "held" not in out
        hold.release()
        inc = _wait_incident(g, "pause", timeout=60)
        t.join(10)
        assert out["held"][0] == 200                 # the held request ran after the resume
        assert _http(fe.url + "/is_paused") == (200, {"is_paused": False})
        ev = [e["event"] for e in inc["timeline"]]
        assert ev == ["pause_crossed", "paused", "resume_sent", "resumed"], ev
        assert inc["outcome"] == "resumed" and inc["target"] is None
        assert inc["thresholds"]["pause_below_bytes"] == pause_below
        assert inc["thresholds"]["term_below_bytes"] == term_below
        assert inc["thresholds"]["mode"] == "keep"
        assert inc["min_available_bytes"] < pause_below
        assert inc["meminfo"]["MemAvailable"] < pause_below + 256 * MiB
        tl = {e["event"]: e for e in inc["timeline"]}
        assert tl["paused"]["t"] < 1.0               # the engine answered at once
        assert tl["resume_sent"]["t"] - tl["paused"]["t"] >= 1.0     # resume_after
        assert tl["resume_sent"]["available_bytes"] >= pause_below + 100 * MiB
        assert not _incidents(g, "memory")           # the hard line was never reached
        assert fe.proc.poll() is None                # nothing was killed
        assert inc["pause"] == {"url": fe.url, "engine_pid": None, "lane": None}   # a guard.pause_url engine
        # after it: status tells the last episode, `incidents ID` the whole of it
        st = run_sparkguard("status", "--config", g.config_path, timeout=60)
        assert st.returncode == 0, st.stderr
        soft = st.stdout.split("Soft line   ", 1)[1].split("\n\n", 1)[0]
        assert "now          not paused; since the daemon started: pauses 1 ok, 0 failed; resumes 1 ok" in soft
        assert re.search(rf"last         engaged .* at \d+\.\d\d GiB\n +paused {re.escape(fe.url)}, mode keep, "
                         rf"\d+ ms after the crossing, for \d+\.\d s\n +ended: resumed \d+\.\d s after the "
                         rf"crossing; `sparkguard incidents {inc['id']}`", soft), soft
        rep = run_sparkguard("incidents", inc["id"], "--dir", g.cfg["incidents"]["dir"], "--no-journal")
        assert rep.returncode == 0, rep.stderr
        section = rep.stdout.split("Soft line (", 1)[1].split("\n\n", 1)[0]
        assert f"pause below {format_size(pause_below)}, resume above" in section
        assert f"SIGTERM below {format_size(term_below)}" in section
        assert re.search(rf"paused +{re.escape(fe.url)}, mode keep, \d+ ms after the crossing, for "
                         rf"{tl['resumed']['t'] - tl['paused']['t']:.1f} s", section), section
        assert re.search(r"ended +resumed \d+\.\d s after the crossing at ", section), section
        assert "  TERM below " not in rep.stdout            # no kill/grace lines a pause incident does not have
    finally:
        if hold is not None:
            hold.release()
        g.stop()


def test_daemon_without_the_endpoint_records_the_failure_and_keeps_the_hard_line(fakes):
    fe = fakes(env={k: v for k, v in os.environ.items() if k != "VLLM_SERVER_DEV_MODE"})
    pause_below, term_below = _far_lines()
    g = GuardProc(_soft_cfg(fe, pause_below, term_below))
    hold = None
    try:
        g.wait_ready()
        g.wait_log("no pause endpoint")              # the probe saw the 404
        assert "VLLM_SERVER_DEV_MODE=1" in g.log()
        hold = Hold(SOFT + 600 * MiB)
        # an engine that offers no pause is not sent one: no incident, the daemon guards as before
        g.notify.wait_for(lambda m: "engine offers no pause" in m.get("STATUS", ""), timeout=20)
        assert not _incidents(g, "pause")
        assert fe.proc.poll() is None
    finally:
        if hold is not None:
            hold.release()
        g.stop()


def test_hard_line_while_paused_sigterms_the_engine_and_both_incidents_tell(fakes):
    fe = fakes("--fill-size", str(1600 * MiB), "--fill-rate", "300MiB", "--fill-on-signal")
    avail = _settled_available()
    pause_below, term_below = avail - 150 * MiB, avail - 600 * MiB
    g = GuardProc(_soft_cfg(fe, pause_below, term_below))
    try:
        g.wait_ready()
        g.wait_log("soft line: GET")
        pids = fe.pids()
        fe.start_fill()                              # pausing does not stop this fill: memory keeps falling
        mem = None
        end = time.monotonic() + 40
        while time.monotonic() < end and mem is None:
            got = _incidents(g, "memory")
            mem = got[0] if got else None
            g.notify.recv(0.2)
        assert mem is not None, g.log()[-3000:]
        assert fe.wait_gone(pids, timeout=15)
        soft = _wait_incident(g, "pause", timeout=10)
        ev = [e["event"] for e in soft["timeline"]]
        assert ev[:2] == ["pause_crossed", "paused"] and ev[-1] == "pause_escalated", soft["timeline"]
        assert soft["outcome"] == "escalated"
        assert [e["event"] for e in mem["timeline"]][:2] == ["crossed", "sigterm"]
        assert mem["target"]["root_pid"] == fe.top_pid
        # the SIGTERM came at the hard line as without the soft line
        assert mem["timeline"][1]["t"] < 0.5
        assert soft["started_at"] < mem["started_at"]
    finally:
        g.stop()


# ---- configuration (file, key, value on every refusal; a reload keeps the running config) ------

import socket  # noqa: E402

from conftest import run_sparkguard  # noqa: E402
from sparkguard import config  # noqa: E402


@pytest.mark.parametrize("text, key, value, why", [
    ("guard:\n  term_below: 2GiB\n  pause_below: 1GiB\n", "guard.pause_below", "1GiB", "not above guard.term_below"),
    ("guard:\n  term_below: 2GiB\n  pause_below: 2GiB\n", "guard.pause_below", "2GiB", "not above guard.term_below"),
    ("guard:\n  pause_below: 100PiB\n", "guard.pause_below", "100PiB", ""),
    ("guard:\n  pause_mode: wait\n", "guard.pause_mode", "wait", "keep"),
    ("guard:\n  pause_url: ftp://x\n", "guard.pause_url", "ftp://x", ""),
    ("guard:\n  pause_timeout: 0s\n", "guard.pause_timeout", "0s", ""),
    ("engine:\n  command: [sleep, '1']\n  pause: on\n", "engine.pause", "on", "auto"),
])
def test_bad_soft_line_config_names_file_key_value(tmp_path, text, key, value, why):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(config.ConfigError) as e:
        config.load(str(path))
    msg = str(e.value)
    assert str(path) in msg and key in msg and value in msg and why in msg, msg
    c = run_sparkguard("check-config", str(path), timeout=30)
    assert c.returncode != 0 and key in c.stderr + c.stdout


def test_soft_line_defaults_are_off():
    g = config.from_dict({}, "x").guard
    assert g.pause_below is None and g.pause_mode == "keep"
    assert config.from_dict({"guard": {"term_below": "1GiB", "pause_below": "3GiB"}}, "x").guard.pause_below == 3 * GiB


def test_a_pause_that_never_answers_does_not_delay_the_sigterm(fakes):
    """The engine's URL is a socket that accepts and never answers: the pause hangs in the worker
    thread while memory runs on to the hard line, which SIGTERMs as without the soft line."""
    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(8)
    fe = fakes("--fill-size", str(1600 * MiB), "--fill-rate", "400MiB", "--fill-on-signal")
    avail = _settled_available()
    pause_below, term_below = avail - 150 * MiB, avail - 500 * MiB
    cfg = _soft_cfg(fe, pause_below, term_below)
    cfg["guard"].update(pause_url=f"http://127.0.0.1:{hole.getsockname()[1]}", pause_timeout="10s")
    g = GuardProc(cfg)
    try:
        g.wait_ready()
        pids = fe.pids()
        fe.start_fill()
        end = time.monotonic() + 40
        mem = None
        while time.monotonic() < end and mem is None:
            got = _incidents(g, "memory")
            mem = got[0] if got else None
            g.notify.recv(0.2)
        assert mem is not None, g.log()[-3000:]
        assert [e["event"] for e in mem["timeline"]][:2] == ["crossed", "sigterm"]
        assert mem["timeline"][1]["t"] < 0.5          # not held up by the unanswered pause
        assert fe.wait_gone(pids, timeout=15)
        soft = _wait_incident(g, "pause", timeout=10)
        assert [e["event"] for e in soft["timeline"]] == ["pause_crossed", "pause_escalated"]
        assert soft["outcome"] == "escalated"
    finally:
        g.stop()
        hole.close()


def test_reload_turns_the_soft_line_on_and_a_bad_one_is_refused(fakes):
    fe = fakes()
    avail = _settled_available()
    g = GuardProc({"guard": {"term_below": avail - FAR, "pause_url": fe.url},
                   "targets": {"match": [rf"serve {fe.model}\b"]}})
    hold = None
    try:
        g.wait_ready()
        bad = {**g.cfg, "guard": {**g.cfg["guard"], "pause_below": avail - FAR - GiB}}
        g.write_config(bad)
        g.proc.send_signal(1)
        g.wait_log("guard.pause_below")
        assert "not above guard.term_below" in g.log()
        good = {**g.cfg, "guard": {**g.cfg["guard"], "pause_below": avail - SOFT, "resume_after": "1s",
                                   "pause_hysteresis": "100MiB"}}
        g.write_config(good)
        g.proc.send_signal(1)
        g.notify.wait_for(lambda m: "soft line" in m.get("STATUS", ""), timeout=20)
        hold = Hold()
        hold.until_paused(g)
        hold.release()
        inc = _wait_incident(g, "pause", timeout=60)
        assert inc["outcome"] == "resumed", (inc["timeline"], inc["thresholds"])
    finally:
        if hold is not None:
            hold.release()
        g.stop()


def test_the_pause_incident_writes_only_documented_fields_in_order():
    import test_model
    from sparkguard import model
    from sparkguard.guard.soft import SoftGuard  # noqa: F401 - the module that builds it
    th = model.PauseThresholds(8 * GiB, 8 * GiB + HYST, 10.0, TERM, "keep", "available")
    inc = model.new_incident("pause", 1.0, th, b"MemAvailable: 1 kB\n", host="h", boot_id="b")
    inc.timeline.append(model.Event("pause_crossed", 0.0, 1.0, 1, [], "x"))
    inc.outcome, inc.ended_at, inc.min_available_bytes = "resumed", 2.0, 1
    rec = inc.to_json()
    fields = test_model.doc_fields()
    assert list(rec) == [f for f in fields if f in rec]
    assert list(rec["thresholds"]) == test_model.doc_keys("pause thresholds")
    assert list(rec["timeline"][0]) == test_model.doc_keys("event")
    names = test_model.DOC.split("Event names:", 1)[1].split("\n\n", 1)[0]
    for ev in ("pause_crossed", "paused", "pause_failed", "resume_sent", "resumed", "resume_failed",
               "pause_escalated"):
        assert f"`{ev}`" in names
        from sparkguard import journal
        assert journal.message_id(ev) != journal.MESSAGE_IDS["event"]


# ---- sparkguard drill --pause ----------------------------------------------------------------

def test_drill_pause_pauses_recovers_resumes_and_says_so(tmp_path, root_only):
    # the work fills --margin + --past/4 (2 GiB here), 1 GiB past the soft line: other work on this
    # shared machine may hand memory back while it fills (0.6 GiB in 2 s seen in CI)
    if _settled_available() < 10 * GiB:
        pytest.skip("not enough MemAvailable for a safe drill on this host right now")
    cfg = tmp_path / "sparkguard.yaml"
    cfg.write_text(f"guard:\n  resume_after: 1s\n  pause_hysteresis: 128MiB\nincidents:\n  dir: {tmp_path / 'inc'}\n"
                   "  journal: \"off\"\nmetrics:\n  listen: \"off\"\n")
    r = run_sparkguard("drill", "--pause", "-c", str(cfg), "--json", "--rate", "1GiB/s", "--margin", "1GiB",
                       "--past", "4GiB", timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    rep = json.loads(r.stdout)
    assert rep["result"] == "PASS", rep["reason"]
    assert rep["mode"] == "pause" and rep["pauses"] == 1 and rep["resumes"] == 1
    assert not any(rep["signals_sent"].values())
    assert rep["crossing_to_paused_seconds"] < 0.5
    assert rep["paused_to_resumed_seconds"] >= 1.0
    assert rep["resume_bytes"] >= rep["pause_below_bytes"] + 128 * MiB
    assert [e["event"] for e in rep["timeline"]] == ["pause_crossed", "paused", "resume_sent", "resumed"]
    assert rep["left_processes"] == []
    files = list((tmp_path / "inc").glob("*.json"))
    assert len(files) == 1
    rec = json.loads(files[0].read_text())
    assert rec["kind"] == "pause" and rec["drill"] is True and rec["outcome"] == "resumed"
    assert rec["summary"].startswith("DRILL: ")
    assert re.match(r"engine paused \d+\.\d ms after the soft line, memory back, resumed", rep["reason"])
    from sparkguard.drill import pause
    text = pause.format_report(rep)
    assert text.startswith("sparkguard drill --pause: PASS - engine paused")
    assert "1 pause(s), 1 resume(s); signals none sent" in text and "kind pause, drill, saved as" in text


def test_drill_pause_refuses_a_margin_inside_the_hysteresis(tmp_path):
    cfg = tmp_path / "sparkguard.yaml"
    cfg.write_text("guard:\n  pause_hysteresis: 1GiB\n")
    r = run_sparkguard("drill", "--pause", "-c", str(cfg), "--margin", "0.5GiB", timeout=60)
    assert r.returncode == 2 and "guard.pause_hysteresis" in r.stderr, r.stderr


# ---- a supervised engine: probed when ready (engine.pause: auto, engine.health_url) -----------

def test_supervised_engine_is_probed_when_ready_then_paused_and_resumed(tmp_path):
    from supervisor_helpers import engine_config, fake_cmd, free_port
    model, port = f"pause-sup-{uuid.uuid4().hex[:10]}", free_port()
    cfg = engine_config(tmp_path, model, fake_cmd(model, port, "--tp", "1"), port,
                        env={"VLLM_SERVER_DEV_MODE": "1"},
                        probe={"interval": "300ms", "timeout": "500ms", "failures": 2})
    avail = _settled_available()
    cfg["guard"].update(term_below=avail - FAR, pause_below=avail - SOFT, pause_hysteresis="100MiB",
                        resume_after="1s")
    cfg["incidents"] = {"dir": str(tmp_path / "incidents"), "journal": "off"}
    g = GuardProc(cfg)
    hold = None
    try:
        g.wait_ready()
        g.wait_log(f"soft line: GET http://127.0.0.1:{port}/is_paused: 200, the engine offers pause", timeout=60)
        hold = Hold()
        hold.until_paused(g)
        assert _http(f"http://127.0.0.1:{port}/is_paused") == (200, {"is_paused": True})
        end = time.monotonic() + 3.0    # paused longer than two probe timeouts: the probe waits, no verdict
        while time.monotonic() < end:
            g.notify.recv(max(0.01, end - time.monotonic()))
        assert "wedged" not in g.log() and "liveness probe failed (2/2)" not in g.log(), g.log()[-2000:]
        hold.release()
        inc = _wait_incident(g, "pause", timeout=60)
        assert inc["outcome"] == "resumed", (inc["timeline"], inc["thresholds"])
        assert f"http://127.0.0.1:{port}/pause?mode=keep" in inc["timeline"][0]["detail"]
        assert "wedged" not in g.log()
        assert _http(f"http://127.0.0.1:{port}/is_paused") == (200, {"is_paused": False})
    finally:
        if hold is not None:
            hold.release()
        g.stop()


def test_a_restarted_engine_is_not_paused_and_the_episode_ends():
    r = Run()
    r.poll(PAUSE_AT - 1)
    r.answer("pause", True)
    assert r.soft.restarted() == (softline.RESTARTED,)
    assert not r.soft.engine_paused and r.soft.state == softline.LATCHED
    assert r.poll(PAUSE_AT - 1) == ()                     # latched: not paused again while memory is low
    assert r.poll(PAUSE_AT + HYST) == ()                  # back: re-armed, no resume sent to the new run
    assert r.soft.state == softline.IDLE
    assert Run().soft.restarted() == ()


# ---- the pause client (sparkguard/pause.py): answers are untrusted ---------------------------

def _client_with(answers: dict):
    """A PauseClient whose HTTP function answers from ``answers`` ({path: (status, body) or an
    exception}); its worker thread, queue and wake-up are the real ones."""
    from sparkguard import pause
    woke = threading.Event()

    def request(url, deadline, max_body, body=None):
        path = urllib.parse.urlsplit(url).path
        got = answers[path]
        if isinstance(got, Exception):
            raise got
        return got

    return pause.PauseClient("http://127.0.0.1:1", "keep", 1.0, woke.set, request=request), woke


def _answer(client, woke, op):
    woke.clear()
    client.submit(op)
    assert woke.wait(5)
    (ans,) = client.answers()
    return ans


def test_pause_client_judges_untrusted_answers():
    c, woke = _client_with({"/is_paused": (200, b'{"is_paused": false}'), "/pause": (404, b'{"detail":"Not Found"}'),
                            "/resume": (200, b"\xff" * 10)})
    assert _answer(c, woke, "probe").ok and c.offered is True
    ans = _answer(c, woke, "pause")
    assert not ans.ok and ans.status == 404 and "VLLM_SERVER_DEV_MODE=1" in ans.detail
    assert _answer(c, woke, "resume").ok                 # any 2xx, whatever the body
    c2, woke2 = _client_with({"/is_paused": (200, b'{"is_paused": "yes"}'), "/pause": TimeoutError("no answer"),
                              "/resume": RuntimeError("bug")})
    assert not _answer(c2, woke2, "probe").ok and c2.offered is False
    ans = _answer(c2, woke2, "pause")
    assert not ans.ok and ans.status is None and "no answer" in ans.detail
    ans = _answer(c2, woke2, "resume")                   # the worker outlives a bug in a request
    assert not ans.ok and "RuntimeError" in ans.detail
    assert _answer(c2, woke2, "probe").op == "probe"     # and keeps serving
    c.stop()
    c2.stop()

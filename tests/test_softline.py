"""The soft line (issue 17): the fake vLLM's pause endpoints, the pure soft-line machine on a fake
clock, the pause client, and the real daemon pausing and resuming a real fake vLLM.

Real parts: the fake vLLM is a real process tree serving real HTTP; the end-to-end tests fill
real memory (a few hundred MiB) with lines placed relative to the MemAvailable read at the start.
"""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.error
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
        fe = fake_vllm.start(f"pause-model-{uuid.uuid4().hex[:10]}", "--port", "0", "--tp", "1", *opts,
                             env=env if env is not None else DEV)
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

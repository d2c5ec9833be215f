"""One owner: the supervisor thread applies what the other threads' hooks hand it.

The supervisor runs in-process on a real (small, fake) engine; each test records which thread
applies an event (``threading.get_ident()`` at apply time) and times the poll loop's hooks while
the supervisor thread holds its lock.
"""

from __future__ import annotations

import threading
import time

from supervisor_helpers import engine_config, fake_cmd, unique, wait_gone

from sparkguard import config, model
from sparkguard.supervisor.core import Supervisor


def started(tmp_path) -> Supervisor:
    """A Supervisor with a ready engine (no health URL: ready once it runs)."""
    model = unique()
    cfg = config.from_dict(engine_config(tmp_path, model, fake_cmd(model, None), None), str(tmp_path / "x.yaml"))
    sup = Supervisor(cfg, reporter=None, start_control=False)
    sup.start()
    r = sup.wait("ready", 0, timeout=30)
    assert r["ok"], r
    return sup


def recording(sup: Supervisor, name: str, seen: list[int]) -> None:
    """Record the applying thread of ``sup.<name>`` (an event function), then run it."""
    real = getattr(sup, name)

    def wrapper(*args):
        seen.append(threading.get_ident())
        return real(*args)
    setattr(sup, name, wrapper)


def crossed(iid: str) -> tuple[model.Incident, dict]:
    """A guard incident as the recorder builds it, and its ``crossed`` event's JSON (the hook's argument)."""
    inc = model.new_incident("memory", time.time(), model.Thresholds(1 << 30, None, 3.0, "available"), {})
    inc.id = iid
    ev = model.Event("crossed", 0.0, time.time(), 0, [], "test: crossed")
    inc.timeline.append(ev)
    return inc, ev.to_json()


def test_hooks_from_other_threads_are_applied_by_the_supervisor_thread(tmp_path):
    sup = started(tmp_path)
    pid = sup.status()["pid"]
    try:
        seen_link: list[int] = []
        seen_cmd: list[int] = []
        recording(sup, "_link_changed", seen_link)
        recording(sup, "_command", seen_cmd)
        caller = threading.Thread(target=sup.link_event, args=(True, "enp1s0f0np0 down for 5 s"), name="test-link")
        caller.start()
        caller.join(10)
        assert seen_link == [sup.thread.ident] and seen_link[0] != caller.ident
        # applied before link_event returned: the status read right after shows it
        st = sup.status()
        assert "TP link down" in st["history"][-1]["detail"] and sup.link_down

        answers: list[dict] = []
        caller = threading.Thread(target=lambda: answers.append(sup.command("stop")), name="test-control")
        caller.start()
        caller.join(10)
        assert seen_cmd == [sup.thread.ident]
        assert answers and answers[0]["ok"] and answers[0]["status"]["want"] == "stop"
        assert sup.wait("stopped", timeout=30)["ok"]
    finally:
        sup.stop()
    assert wait_gone([pid], 10) == []


def test_poll_loop_hooks_return_at_once_while_the_supervisor_holds_its_lock(tmp_path):
    sup = started(tmp_path)
    pid = sup.status()["pid"]
    try:
        held, release = threading.Event(), threading.Event()

        def hold() -> None:           # an event: the supervisor thread holds cv while it runs
            held.set()
            release.wait(5)
        sup._post(hold)
        assert held.wait(5)
        seen: list[int] = []
        recording(sup, "_incident_opened", seen)
        recording(sup, "_incident_closed", seen)

        inc, ev = crossed("20260101T000000Z-owner1")
        took: list[float] = []

        def poll_loop() -> None:
            t0 = time.monotonic()
            sup.on_guard_event(inc.ref(), ev)
            took.append(time.monotonic() - t0)
            t0 = time.monotonic()
            inc.outcome, inc.ended_at, inc.summary = "recovered", time.time(), "test"
            assert sup.take_incident(inc)
            took.append(time.monotonic() - t0)
        caller = threading.Thread(target=poll_loop, name="test-poll")
        caller.start()
        caller.join(5)
        assert len(took) == 2 and max(took) < 0.1, took         # a try for the lock of 5 ms, no more
        assert inc.engine["pid"] == pid                      # the incident was completed at once
        assert seen == [] and not sup.incident_open             # nothing applied while the lock is held
        release.set()
        deadline = time.monotonic() + 5
        while len(seen) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert seen == [sup.thread.ident, sup.thread.ident]     # opened, then closed, on the supervisor thread
        assert not sup.incident_open
        assert sup.status()["state"] == "ready"
    finally:
        sup.stop()
    assert wait_gone([pid], 10) == []

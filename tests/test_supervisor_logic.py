"""The supervisor's start gates and restart policy on a fake clock: every branch of the sequence
hold -> drop caches -> quiesce -> peers, the timeouts that start anyway, and why a run ended.

Nothing here waits for real: the hooks advance a fake monotonic clock by the time the gates ask
to wait, MemAvailable and the peers' readings are functions of that clock.
"""

from __future__ import annotations

from sparkguard import config, peers
from sparkguard.supervisor import gates, restart
from sparkguard.supervisor.output import LastLines

GiB = 1024**3
MiB = 1024**2


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class Hooks:
    """GateHooks on a fake clock: ``wait`` advances it; ``hold_until`` / ``stop_at`` are clock times."""

    def __init__(self, clock: Clock, hold_until: float | None = None, stop_at: float | None = None,
                 incident_at: tuple[float, float] | None = None):
        self.clock, self.hold_until, self.stop_at, self.incident_at = clock, hold_until, stop_at, incident_at
        self.shown: list[str] = []
        self.notes: list[tuple[str, str]] = []
        self.peers: list[list[dict]] = []

    def held(self):
        t = self.clock.t
        if self.hold_until is not None and t < self.hold_until:
            return "a guard incident is open"
        if self.incident_at is not None and self.incident_at[0] <= t < self.incident_at[1]:
            return "a guard incident is open"
        return None

    def interrupted(self) -> bool:
        return self.stop_at is not None and self.clock.t >= self.stop_at

    def wait(self, seconds, until) -> bool:
        assert 0 <= seconds <= 60
        self.clock.t += max(seconds, 0.01)
        return until()

    def show(self, detail):
        self.shown.append(detail)

    def note(self, event, detail):
        self.notes.append((event, detail))

    def peers_seen(self, states):
        self.peers.append(states)

    def events(self) -> list[str]:
        return [e for e, _ in self.notes]


def ecfg(**kw) -> config.EngineConfig:
    base = dict(command=("vllm", "serve", "m"), drop_caches=True, start_above=8 * GiB, stable_for=2.0,
                stable_band=256 * MiB, quiesce_timeout=30.0, health_interval=1.0)
    base.update(kw)
    return config.EngineConfig(**base)


def gates_for(e, hooks, clock, mem, check_peers=None, drops=None):
    drops = drops if drops is not None else []

    def drop():
        drops.append(clock.t)
        return "dropped"
    return gates.StartGates(e, hooks, clock=clock, read_mem=lambda: mem(clock.t), check_peers=check_peers, drop=drop)


def test_memory_coming_back_opens_the_quiesce_gate_after_stable_for():
    clock = Clock()
    t0 = clock.t
    h = Hooks(clock)
    drops = []
    # 6 GiB now, back to 9 GiB 3 s later
    r = gates_for(ecfg(), h, clock, lambda t: 6 * GiB if t < t0 + 3 else 9 * GiB, drops=drops).run()
    assert r is not None and r.timed_out is None and r.detail == ""
    assert 5.0 <= r.waited <= 5.5, r.waited                  # 3 s below the gate + 2 s stable
    assert drops == [t0]                                       # caches dropped once, before the gate
    assert h.events() == ["drop_caches", "waiting", "quiesced"]
    assert h.notes[1][1].startswith("quiesce: MemAvailable 6.00 GiB, need >= 8.00 GiB stable for 2 s")
    assert "starting anyway after 30 s" in h.notes[1][1]


def test_quiesce_timeout_starts_anyway_and_says_why():
    clock = Clock()
    h = Hooks(clock)
    calls = []
    r = gates_for(ecfg(peers=("http://peer:8799",)), h, clock, lambda t: 5 * GiB,
                  check_peers=lambda *a, **k: calls.append(a) or []).run()
    assert r is not None and r.timed_out == "quiesce"
    assert 30.0 <= r.waited <= 30.5
    assert r.detail == "quiesce: MemAvailable 5.00 GiB, need >= 8.00 GiB stable for 2 s"
    event, detail = h.notes[-1]
    assert event == "quiesce_timeout" and detail.startswith("starting anyway after 30.0 s: quiesce: MemAvailable")
    assert calls == []                     # past the timeout the peers are not waited for either


def test_peers_timeout_starts_anyway_and_says_which_peer():
    clock = Clock()
    h = Hooks(clock)
    url_ok, url_low, url_dead = "http://a:8799", "http://b:8799", "http://c:8799"

    def check(urls, gate, timeout):
        assert list(urls) == [url_ok, url_low, url_dead] and gate == 8 * GiB and 0.5 <= timeout <= 3.0
        return [peers.PeerState(url_ok, 20 * GiB, True), peers.PeerState(url_low, 3 * GiB, False),
                peers.PeerState(url_dead, None, False, "no answer: Connection refused")]
    r = gates_for(ecfg(peers=(url_ok, url_low, url_dead), stable_for=0.0), h, clock, lambda t: 9 * GiB,
                  check_peers=check).run()
    assert r is not None and r.timed_out == "peers"
    assert 30.0 <= r.waited <= 31.0
    assert r.detail == ("peers: http://b:8799: 3.00 GiB available; http://c:8799: no answer: Connection refused; "
                        "need >= 8.00 GiB each")
    assert h.events() == ["drop_caches", "waiting", "peers_timeout"]
    assert h.peers[-1][1] == {"url": url_low, "available_bytes": 3 * GiB, "ok": False, "error": ""}


def test_peers_coming_up_open_the_gate_without_a_timeout():
    clock = Clock()
    t0 = clock.t
    h = Hooks(clock)

    def check(urls, gate, timeout):
        up = clock.t >= t0 + 4
        return [peers.PeerState(urls[0], 10 * GiB if up else None, up, "" if up else "no answer")]
    r = gates_for(ecfg(peers=("http://a:8799",), stable_for=0.0, drop_caches=False), h, clock, lambda t: 9 * GiB,
                  check_peers=check).run()
    assert r is not None and r.timed_out is None and 4.0 <= r.waited <= 5.0
    assert h.events() == ["waiting", "quiesced"]


def test_the_hold_does_not_use_up_the_quiesce_timeout():
    # a guard incident stays open for 100 s (> quiesce_timeout 30 s); once it closes memory still
    # needs 3 s to come back: the gate must wait for it rather than time out at once
    clock = Clock()
    t0 = clock.t
    h = Hooks(clock, hold_until=t0 + 100)
    drops = []
    r = gates_for(ecfg(), h, clock, lambda t: 6 * GiB if t < t0 + 103 else 9 * GiB, drops=drops).run()
    assert r is not None and r.timed_out is None
    assert h.shown[0] == "a guard incident is open"
    assert h.notes[0] == ("waiting", "a guard incident is open")          # said once, not every second
    assert h.events() == ["waiting", "drop_caches", "waiting", "quiesced"]
    assert drops[0] >= t0 + 100                                 # caches dropped after the hold, not before
    assert 5.0 <= r.waited <= 5.5, r.waited


def test_an_incident_during_the_quiesce_wait_starts_the_gates_over():
    clock = Clock()
    t0 = clock.t
    h = Hooks(clock, incident_at=(t0 + 1, t0 + 4))
    drops = []
    r = gates_for(ecfg(), h, clock, lambda t: 6 * GiB if t < t0 + 6 else 9 * GiB, drops=drops).run()
    assert r is not None and r.timed_out is None
    assert len(drops) == 2 and drops[1] >= t0 + 4               # the whole sequence again after the incident
    assert h.events().count("drop_caches") == 2


def test_a_stop_during_the_gates_calls_the_start_off():
    clock = Clock()
    t0 = clock.t
    assert gates_for(ecfg(), Hooks(clock, stop_at=t0 + 2), clock, lambda t: 1 * GiB).run() is None
    clock = Clock()
    h = Hooks(clock, hold_until=clock.t + 50, stop_at=clock.t + 5)
    assert gates_for(ecfg(), h, clock, lambda t: 9 * GiB).run() is None
    clock = Clock()
    h = Hooks(clock, stop_at=clock.t + 2)
    dead = [peers.PeerState("http://a", None, False, "no answer")]
    assert gates_for(ecfg(peers=("http://a",), stable_for=0.0), h, clock, lambda t: 9 * GiB,
                     check_peers=lambda *a, **k: dead).run() is None


def test_unreadable_meminfo_counts_as_no_memory():
    clock = Clock()
    h = Hooks(clock)

    def broken(t):
        raise OSError("EIO")
    r = gates_for(ecfg(quiesce_timeout=1.0), h, clock, broken).run()
    assert r.timed_out == "quiesce" and r.detail.startswith("quiesce: MemAvailable 0 B, need >= 8.00 GiB")


# ---- restart policy

def test_why_a_run_ended():
    c = restart.classify_exit
    assert c(0, None, False) == ("exit", False)            # exited by itself, cleanly
    assert c(1, None, False) == ("exit", True)
    assert c(None, None, False) == ("exit", True)          # killed by a signal nobody here sent
    assert c(None, None, True) == ("guard", True)          # the guard signalled it
    assert c(0, None, True) == ("guard", True)             # even a clean exit after the guard's TERM
    assert c(0, "stop", False) == (None, False)            # stopped on purpose: no restart
    assert c(None, "shutdown", True)[0] is None
    for why in ("lane", "manual", "link"):
        assert c(0, why, False) == (why, False)
    for why in ("wedged", "not_ready"):
        assert c(0, why, False) == (why, True)
    # caused by another node of a TP cluster: not this node's failure (no backoff)
    for why in ("head", "peer"):
        assert c(None, why, False) == (why, False)
    # a headless rank exits 0 by itself when its head went away (a group restart) and when one of
    # its own workers died while the head run goes on (its own death: a failure)
    assert c(0, None, False, headless="gone") == ("head", False)
    assert c(0, None, False, headless="there") == ("exit", True)
    assert c(1, None, False, headless="gone") == ("exit", True)
    assert c(0, "stop", False, headless="gone") == (None, False)


def test_restart_policy():
    assert restart.restarts("always", False) and restart.restarts("always", True)
    assert restart.restarts("on-failure", True) and not restart.restarts("on-failure", False)
    assert not restart.restarts("never", True) and not restart.restarts("never", False)
    # a group that must re-form is restarted under on-failure too, never under never
    assert restart.restarts("on-failure", False, "head") and restart.restarts("on-failure", False, "peer")
    assert not restart.restarts("never", False, "peer")


def test_give_up_after_failed_starts_in_a_window():
    g = restart.GiveUp(3, 600.0)
    assert not g.record(0.0, True, False, "exit")
    assert not g.record(10.0, True, False, "not_ready")
    assert g.record(20.0, True, False, "exit")              # the third failed start in 10 min
    g.reset()
    assert not g.record(30.0, True, False, "exit")
    assert not g.record(700.0, True, False, "exit")         # the first one left the window
    assert not g.record(800.0, True, True, "exit")          # a run that was ready is no failed start...
    assert not g.record(810.0, True, False, "exit")         # ...and clears the count
    assert not g.record(820.0, False, False, "head")        # another node's doing counts for nothing
    assert not g.record(830.0, True, False, "peer")
    assert not g.record(840.0, False, False, "manual")
    assert not g.record(850.0, True, False, "wedged")
    assert g.record(860.0, True, False, "exit")              # 810, 850, 860
    assert not restart.GiveUp(0, 600.0).record(0.0, True, False, "exit")   # 0: never give up
    g = restart.GiveUp(1, 600.0)
    assert not g.record(0.0, True, False, "exit", counts=False)   # a rank that never met a head run
    assert g.record(1.0, True, False, "exit")


def test_last_lines_keep_the_last_n():
    ll = LastLines(3)
    for i in range(5):
        ll.add("stdout", f"line {i}")
    assert ll.current() == ["line 2", "line 3", "line 4"]
    ll.add("stderr", "from stderr")
    assert ll.current() == ["line 3", "line 4", "from stderr"]

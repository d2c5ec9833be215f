"""The TP cluster's decisions (sparkguard/supervisor/cluster.py) on plain readings, and the node
view read back from a real exposition of the engine collector (sparkguard/supervisor/nodes.py)."""

from __future__ import annotations

from dataclasses import replace

from prometheus_client import CollectorRegistry, generate_latest

from sparkguard.supervisor import cluster, nodes
from sparkguard.supervisor.cluster import HeadWatch, NodeView, Role
from sparkguard.supervisor.collector import EngineCollector
from sparkguard.supervisor.state import STATES

GiB = 1024**3


def head(run=None, group=None, ready=False, wanted=True, given_up=False, url="http://10.0.0.1:8799"):
    return NodeView(url, available_bytes=GiB, role="head", node_rank=0, nnodes=2, state="ready" if ready else "waiting",
                    wanted=wanted, given_up=given_up, run=run, ready=ready, group=group or {})


def rank(k=1, run=100.0, joined=None, wanted=True, given_up=False, state="waiting_for_head", nnodes=2):
    return NodeView(f"http://10.0.0.{k + 1}:8799", available_bytes=GiB, role="headless", node_rank=k, nnodes=nnodes,
                    state=state, wanted=wanted, given_up=given_up, run=run, joined=joined)


def test_role_from_the_vllm_command():
    base = ["vllm", "serve", "m", "--tensor-parallel-size", "4"]
    assert cluster.role_of(base) == Role()
    assert cluster.role_of(base + ["--nnodes", "4", "--node-rank", "0"]) == Role("head", 0, 4)
    assert cluster.role_of(base + ["--nnodes=4", "--node-rank=2", "--headless"]) == Role("headless", 2, 4)
    assert cluster.role_of(base + ["--nnodes", "2", "--node_rank", "1"]) == Role("headless", 1, 2)
    assert cluster.role_of(base + ["--nnodes", "two"]) == Role()       # vLLM refuses it; no cluster here
    assert cluster.role_of(None) == Role()
    # a wrapper's own flags are not vLLM's: nice -n 10, chrt -r 1
    assert cluster.role_of(["nice", "-n", "10", "chrt", "-r", "1", *base]) == Role()
    assert cluster.role_of(["nice", "-n", "10", *base, "--nnodes", "2", "--node-rank", "1", "--headless"]) == \
        Role("headless", 1, 2)
    assert cluster.role_of(["ray", "start", "--block"]) == Role()
    assert not Role().clustered and Role("head", 0, 2).clustered


def test_the_head_starts_last_once_every_rank_waits_for_it():
    me = Role("head", 0, 3)

    def rank(k=1, **kw):
        return globals()["rank"](k, nnodes=3, **kw)
    ok, why = cluster.head_start_gate(me, [rank(1), NodeView("http://10.0.0.3:8799", error="no answer: refused")])
    assert not ok and "node rank 2: not read" in why and "refused" in why
    ok, why = cluster.head_start_gate(me, [rank(1), rank(2, run=None, state="waiting")])
    assert not ok and "no rank running" in why
    ok, why = cluster.head_start_gate(me, [rank(1), rank(2, joined=50.0)])
    assert not ok and "still in an old head's group" in why
    ok, why = cluster.head_start_gate(me, [rank(1), rank(2, given_up=True, wanted=False)])
    assert not ok and "given up" in why
    assert cluster.head_start_gate(me, [rank(1), rank(2)]) == (True, "")
    # misconfigured nodes are named, not waited for in silence
    ok, why = cluster.head_start_gate(me, [rank(1), rank(1)])
    assert not ok and "both claim node rank 1" in why
    ok, why = cluster.head_start_gate(me, [rank(1), rank(5)])
    assert not ok and "not a headless rank 1..2 of 3" in why
    ok, why = cluster.head_start_gate(me, [rank(1), NodeView("http://10.0.0.3:8799", available_bytes=GiB)])
    assert not ok and "export no engine role" in why


def test_a_headless_rank_starts_only_while_the_head_has_no_run_and_wants_one():
    assert cluster.head_may_start_rank(None)[0] is False
    assert cluster.head_may_start_rank(head(run=10.0))[0] is False
    ok, why = cluster.head_may_start_rank(head(wanted=False))
    assert not ok and "stopped on purpose" in why
    assert cluster.head_may_start_rank(head(given_up=True, wanted=False))[0] is False
    assert cluster.head_may_start_rank(head()) == (True, "")


def test_the_group_breaks_when_a_rank_has_another_run_and_unreachable_decides_nothing():
    group = {1: 100.0, 2: 200.0}
    assert cluster.broken_group(group, [rank(1, 100.0, joined=5.0), rank(2, 200.0, joined=5.0)]) is None
    assert cluster.broken_group(group, [rank(1), NodeView("http://x", error="timed out")]) is None
    v, why = cluster.broken_group(group, [rank(1, 100.0), rank(2, 201.0)])
    assert v.node_rank == 2 and "restarted" in why
    v, why = cluster.broken_group(group, [rank(1, None, state="backoff")])
    assert v.node_rank == 1 and "gone" in why and "backoff" in why


def test_head_watch_joins_follows_and_restarts():
    w = HeadWatch(1, 100.0)
    assert w.see(head()) == (None, "")                            # no head run yet: waiting
    assert w.see(head(run=7.0, group={1: 100.0})) == (None, "")   # the head started with this run
    assert w.joined == 7.0
    assert cluster.joined(1, 100.0, head(run=7.0, group={1: 100.0}))
    assert w.see(NodeView("http://x", error="no answer")) == (None, "")   # unreachable: nothing
    assert w.joined == 7.0
    action, why = w.see(head(run=8.0, group={1: 99.0}))           # a new head run
    assert action == "restart" and "replaced by 8.000" in why
    w = HeadWatch(1, 100.0)
    w.see(head(run=7.0, group={1: 100.0}))
    action, why = w.see(head(wanted=False))                        # engine stop on the head
    assert action == "stop" and "stopped on purpose" in why


def test_head_watch_restarts_a_rank_that_waited_beside_an_old_head_run():
    w = HeadWatch(1, 100.0)
    assert w.see(head(run=7.0, group={1: 90.0})) == (None, "")    # an old group, not this run's
    assert w.joined is None
    action, why = w.see(head())                                    # that head run ended
    assert action == "restart" and "stale rendezvous" in why


def test_node_view_read_back_from_the_real_exposition():
    """What EngineCollector exports on one node is what nodes.parse reads on another."""
    status = {"up": True, "ready": True, "restarts": {"exit": 0}, "lane": "200k", "time_to_ready": 2.0,
              "quiesce_wait": 0.1, "backoff": 0.0, "state": "ready", "want": "run", "given_up": False,
              "role": {"role": "head", "node_rank": 0, "nnodes": 4}, "run_start": 1764600000.123,
              "joined": None, "group": {"1": 1764599990.5, "2": 1764599991.25, "3": 1764599992.001}}

    class Sup:
        def status(self):
            return status

    reg = CollectorRegistry()
    reg.register(EngineCollector(Sup()))
    text = generate_latest(reg).decode()
    text += "# HELP sparkguard_memory_available_bytes x\n# TYPE sparkguard_memory_available_bytes gauge\n"
    text += "sparkguard_memory_available_bytes 1.2e+10\n"
    text += '# HELP sparkguard_last_incident_info x\n# TYPE sparkguard_last_incident_info gauge\n'
    text += 'sparkguard_last_incident_info{id="20261201T120000Z-abcdef",kind="peer"} 1.0\n'
    v = nodes.parse("http://h:8799", text)
    assert (v.role, v.node_rank, v.nnodes, v.state, v.ready, v.wanted, v.given_up) == ("head", 0, 4, "ready", True,
                                                                                        True, False)
    assert v.run == 1764600000.123 and v.joined is None
    assert v.group == {1: 1764599990.5, 2: 1764599991.25, 3: 1764599992.001}
    assert v.available_bytes == 12 * 10**9 and v.last_incident == "20261201T120000Z-abcdef"
    status.update(state="waiting_for_head", want="run", ready=False, run_start=1764600001.5, joined=None,
                  group={}, role={"role": "headless", "node_rank": 2, "nnodes": 4})
    v = nodes.parse("http://w:8799", generate_latest(reg).decode() + "sparkguard_memory_available_bytes 5\n")
    assert cluster.waiting_for_head(v) and v.node_rank == 2 and v.run == 1764600001.5
    assert set(STATES) >= {"waiting_for_head", "given_up"}


def test_untrusted_numbers_from_a_node_never_raise():
    """NaN, infinities, negative sizes: a NaN run would never equal itself (a head restarting in
    a loop); the reading is an error view or the number is dropped, never an exception."""
    from sparkguard import peers
    base = "# TYPE sparkguard_memory_available_bytes gauge\nsparkguard_memory_available_bytes {}\n"
    for bad in ("NaN", "+Inf", "-1"):
        try:
            nodes.parse("http://x", base.format(bad))
        except peers.PeerError as e:
            assert "sparkguard_memory_available_bytes" in str(e)
        else:
            raise AssertionError(bad)
    text = base.format("5") + ("# TYPE sparkguard_engine_run_start_timestamp_seconds gauge\n"
                               "sparkguard_engine_run_start_timestamp_seconds NaN\n")
    assert nodes.parse("http://x", text).run is None
    v = nodes.read("http://127.0.0.1:9/metrics", timeout=0.2)      # and read() turns anything into an error view
    assert v.error


def test_a_node_that_is_no_sparkguard_is_a_view_with_an_error():
    v = nodes.read("http://127.0.0.1:9/metrics", timeout=0.5)       # discard port: refused
    assert not v.reachable and v.error.startswith("no answer")


def test_a_node_whose_daemon_just_restarted_breaks_no_group_until_it_says_what_it_runs():
    # a rolling restart of sparkguard itself: the new daemon's endpoint answers before its
    # supervisor has adopted the running engine; state "stopped" with the engine wanted, no run
    fresh = dict(state="stopped", wanted=True, run=None, ready=False)
    r1 = rank(1, run=100.0)
    assert cluster.broken_group({1: 100.0}, [r1]) is None
    assert cluster.broken_group({1: 100.0}, [replace(r1, **fresh)]) is None
    gone = cluster.broken_group({1: 100.0}, [replace(r1, state="backoff", run=None)])
    assert gone is not None and "its rank is gone" in gone[1]
    off = cluster.broken_group({1: 100.0}, [replace(r1, **dict(fresh, wanted=False))])
    assert off is not None                        # a rank stopped on purpose does break the group
    # the headless side: its head's daemon restarting, then back with the same run
    w = HeadWatch(1, 100.0)
    h = replace(head(ready=True), run=200.0, group={1: 100.0})
    assert w.see(h) == (None, "")
    assert w.see(replace(h, **fresh, group={})) == (None, "")
    assert w.see(h) == (None, "")
    act, why = w.see(replace(h, state="starting", run=None, group={}))   # the head's run really ended
    assert act == "restart" and "ended" in why

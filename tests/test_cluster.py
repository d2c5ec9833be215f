"""The TP cluster recovers as one engine: nodes in network namespaces (tests/netcluster.py), each
a real ``sparkguard run`` supervising its rank of the multi-node fake vLLM (tests/fakes), the
head served to a client on the hub.

Each test asserts what an operator depends on: who restarts and why, in which order (no rank
starts while an old rank of the group is alive; workers first, head last), no mixed generations
after recovery (the head's group lists the very runs its ranks report), restarts caused by
another node outside the backoff, an incident on every node that restarted, a head stopped on
purpose leaving its ranks waiting, and an unreachable node treated as unknown, not dead.
Timers are shortened where the test would otherwise wait on them (health_interval 0.5 s,
stable_for 0 s, the fake's load time 0.5 s); bench/cluster.py measures with the defaults.
"""

from __future__ import annotations

import glob
import json
import os
import signal
import time

import pytest

from netcluster import Cluster, start_nodes, tp_configs
from supervisor_helpers import restarted
from waiting import wait_for

FAST = {"health_interval": "500ms", "stable_for": "0s", "quiesce_timeout": "60s"}
PORT = 8000


def completion_ok(hub, head_addr: str, model: str, timeout: float = 1.0) -> bool:
    """One one-token completion of ``model`` on the head from the hub: True on a 200 with choices."""
    try:
        status, body = hub.http_post(f"http://{head_addr}:{PORT}/v1/completions",
                                     {"model": model, "prompt": "ping", "max_tokens": 1}, timeout=timeout)
    except OSError:
        return False
    return status == 200 and bool(json.loads(body or b"{}").get("choices"))


def wait_until(pred, timeout: float, what: str, every: float = 0.2):
    """:func:`waiting.wait_for` with this file's argument order."""
    return wait_for(what, pred, timeout, every)


def serving(c, timeout: float = 60.0) -> None:
    wait_until(lambda: completion_ok(c.hub, c.nodes[0].addr, c.model), timeout, "the head serves completions")


def starts(d) -> list[dict]:
    return [h for h in d.status()["history"] if h["event"] == "start"]


def exits(d) -> list[dict]:
    return [h for h in d.status()["history"] if h["event"] == "exit"]


def incident_kinds(d) -> set[str]:
    """Kinds of the incidents a node's sparkguard has written so far."""
    out = set()
    for path in glob.glob(os.path.join(d.cfg["incidents"]["dir"], "*.json")):
        try:
            with open(path) as f:
                out.add(json.load(f)["kind"])
        except (OSError, ValueError, KeyError):
            continue
    return out


def kill(pid: int) -> None:
    """SIGKILL through a pidfd (a process of this test's cluster)."""
    fd = os.pidfd_open(pid)
    try:
        signal.pidfd_send_signal(fd, signal.SIGKILL)
    finally:
        os.close(fd)


def one_generation(ds) -> None:
    """The head's group lists exactly the runs its ranks report, and each rank joined the head's run."""
    head = ds[0].status()
    assert head["state"] == "ready" and head["run_start"], head["state"]
    for k, d in enumerate(ds[1:], 1):
        st = d.status()
        assert st["state"] == "ready", (k, st["state"], st["detail"])
        assert head["group"][str(k)] == st["run_start"], (k, head["group"], st["run_start"])
        assert st["joined"] == head["run_start"], (k, st["joined"], head["run_start"])


def up(c, tmp_path, load_time: float = 0.5, wait: bool = True, **engine):
    c.model = "sgcl-" + c.tag
    cfgs = tp_configs(c, c.model, tmp_path, engine={**FAST, **engine}, load_time=load_time)
    ds = start_nodes(c, cfgs, tmp_path)
    if not wait:
        return ds
    for d in ds:
        d.wait_control(60)
    ds[0].wait_ready(timeout=90)
    serving(c)
    wait_until(lambda: all(d.status()["state"] == "ready" for d in ds), 30, "every rank ready")
    return ds


def test_a_headless_rank_that_dies_restarts_the_whole_group_in_order(tmp_path):
    with Cluster(2) as c:
        ds = up(c, tmp_path)
        head, rank = ds
        one_generation(ds)
        h0, r0 = starts(head)[-1], starts(rank)[-1]
        before = [d.status()["restarts"] for d in ds]
        worker = rank.status()["pid"]
        # the headless rank's worker: vllm serve --headless -> VLLM::Worker_TP1
        wk = [p for p in rank.alive_engine_pids() if p != worker]
        assert wk, rank.alive_engine_pids()
        run0 = head.status()["run_start"]
        kill(wk[-1])
        t_kill = time.time()
        wait_until(lambda: head.status()["run_start"] != run0, 30, "the head restarts")
        serving(c, 60)
        outage = time.time() - t_kill
        wait_until(lambda: all(d.status()["state"] == "ready" for d in ds), 30, "every rank ready again")
        one_generation(ds)
        # the head restarted because of its peer, at once (no probe, no NCCL timeout)
        hs, rs = head.status(), rank.status()
        assert hs["restarts"]["peer"] == before[0]["peer"] + 1, hs["restarts"]
        assert sum(rs["restarts"].values()) == sum(before[1].values()) + 1, rs["restarts"]
        # order: the head's new run started after the rank's old run ended and after its new run began
        h1, r1 = starts(head)[-1], starts(rank)[-1]
        assert h1 is not h0 and r1 is not r0
        old_rank_end = [e for e in exits(rank) if e["at"] >= r0["at"]][0]["at"]
        old_head_end = [e for e in exits(head) if e["at"] >= h0["at"]][0]["at"]
        assert r1["at"] >= old_head_end, "a rank started while the old head was still alive"
        assert h1["at"] >= r1["at"] and h1["at"] >= old_rank_end, "the head did not start last"
        # the rank's own death is its failure (backoff); the head's restart, another node's doing, is not
        assert hs["consecutive_failures"] == 0 and rs["consecutive_failures"] == 1
        assert rs["restarts"]["exit"] == before[1]["exit"] + 1, rs["restarts"]
        assert outage < 30, outage
        # the story on both nodes: the head's incident names the rank that went away
        inc = head.incident("peer", timeout=10, where=restarted)
        cause = inc["engine"]["cause"]
        assert cause["node"]["node_rank"] == 1
        # ...and, read just before the head's restart, the incident the rank recorded for it
        there = cause["node_at_restart"]["last_incident"]
        assert there and os.path.exists(os.path.join(rank.cfg["incidents"]["dir"], there + ".json")), cause
        wait_until(lambda: "exit" in incident_kinds(rank), 10, "an exit incident on the rank's node")


def test_a_headless_rank_waits_for_head_until_the_group_has_formed(tmp_path):
    """Not ready while it waits at the rendezvous: status and metrics say waiting_for_head."""
    with Cluster(2) as c:
        ds = up(c, tmp_path, load_time=4.0, wait=False)
        head, rank = ds
        for d in ds:
            d.wait_control(60)
        st = wait_until(lambda: (s := rank.status())["state"] == "waiting_for_head" and s, 60, "waiting_for_head")
        assert st["up"] and not st["ready"], st
        m = rank.wait_metrics()
        assert m[("sparkguard_engine_state", (("state", "waiting_for_head"),))] == 1.0
        assert m[("sparkguard_engine_ready", ())] == 0.0
        assert m[("sparkguard_engine_role_info", (("nnodes", "2"), ("node_rank", "1"), ("role", "headless")))] == 1.0
        head.wait_ready(timeout=60)
        wait_until(lambda: rank.status()["state"] == "ready", 30, "the rank is ready once the head is")
        one_generation(ds)
        m = rank.scrape()
        assert m[("sparkguard_engine_joined_run_start_timestamp_seconds", ())] == head.status()["run_start"]
        assert m[("sparkguard_engine_ready", ())] == 1.0


def test_the_head_killed_restarts_each_rank_once_without_waiting_for_head_lost_after(tmp_path):
    """Also under ``restart: on-failure``: a headless rank whose head died is a group restart."""
    with Cluster(2) as c:
        ds = up(c, tmp_path, restart="on-failure")
        head, rank = ds
        n_rank = len(starts(rank))
        top = head.status()["pid"]
        run0 = rank.status()["run_start"]
        kill(top)
        t_kill = time.monotonic()
        wait_until(lambda: rank.status()["run_start"] != run0, 30, "the rank restarts")
        serving(c, 45)
        assert time.monotonic() - t_kill < 45        # head_lost_after is 60 s: it did not wait for it
        wait_until(lambda: all(d.status()["state"] == "ready" for d in ds), 30, "every rank ready again")
        one_generation(ds)
        rs = rank.status()
        assert len(starts(rank)) == n_rank + 1, "the rank restarted more than once for one head restart"
        assert rs["restarts"]["head"] >= 1 and rs["consecutive_failures"] == 0
        inc = rank.incident("head", timeout=10)
        assert inc["engine"]["cause"]["node"]["role"] == "head"


def test_a_head_stopped_on_purpose_leaves_its_ranks_waiting_until_it_starts(tmp_path):
    with Cluster(2) as c:
        ds = up(c, tmp_path)
        head, rank = ds
        r = head.ctl("stop")
        assert r["ok"], r
        wait_until(lambda: rank.status()["up"] is False, 30, "the headless rank stopped its rank")
        n = len(starts(rank))
        time.sleep(3)                 # a rank that restarted in a loop would show starts here
        st = rank.status()
        assert len(starts(rank)) == n and not st["up"], st
        assert "stopped on purpose" in st["detail"], st["detail"]
        r = head.ctl("start")
        assert r["ok"], r
        serving(c, 45)
        wait_until(lambda: all(d.status()["state"] == "ready" for d in ds), 30, "every rank ready again")
        one_generation(ds)


def test_an_unreachable_rank_is_not_a_dead_one(tmp_path):
    with Cluster(2) as c:
        ds = up(c, tmp_path)
        head, rank = ds
        before = [sum(d.status()["restarts"].values()) for d in ds]
        runs = [d.status()["run_start"] for d in ds]
        c.nodes[1].link_down()
        try:
            # both sides read each other as unreachable and decide nothing
            wait_until(lambda: any(v["error"] for v in head.status()["nodes"]), 10, "the head sees the rank unreachable")
            time.sleep(2)
        finally:
            c.nodes[1].link_up()
        serving(c, 30)
        assert [sum(d.status()["restarts"].values()) for d in ds] == before
        assert [d.status()["run_start"] for d in ds] == runs
        one_generation(ds)


@pytest.mark.parametrize("victim", [2])
def test_four_nodes_recover_as_one_engine(tmp_path, victim):
    with Cluster(4) as c:
        ds = up(c, tmp_path)
        one_generation(ds)
        n = [len(starts(d)) for d in ds]
        rank = ds[victim]
        run0 = ds[0].status()["run_start"]
        r = rank.ctl("restart")
        assert r["ok"], r
        wait_until(lambda: ds[0].status()["run_start"] != run0, 30, "the head restarts")
        serving(c, 60)
        wait_until(lambda: all(d.status()["state"] == "ready" for d in ds), 30, "every rank ready again")
        one_generation(ds)
        assert [len(starts(d)) for d in ds] == [k + 1 for k in n], "each node restarted exactly once"
        for d in ds:
            assert d.status()["consecutive_failures"] == 0


def test_a_rank_that_keeps_failing_gives_up_and_the_head_waits_for_it(tmp_path):
    """A headless rank refused at the rendezvous (its --max-model-len differs) fails before it is
    ever ready: after engine.give_up_after (3) it gives up, and the head waits for it instead of
    restarting in a loop; the head's own restarts (reason peer) never count as its failures."""
    with Cluster(2) as c:
        c.model = "sgcl-" + c.tag
        cfgs = tp_configs(c, c.model, tmp_path, engine={**FAST, "backoff_initial": "100ms"}, load_time=0.5)
        cfgs[1]["engine"]["command"] = cfgs[1]["engine"]["command"] + ["--max-model-len", "8192"]
        head, rank = start_nodes(c, cfgs, tmp_path)
        for d in (head, rank):
            d.wait_control(60)
        inc = rank.incident("given_up", timeout=90)
        assert "gave up after 3 failed starts" in inc["summary"], inc["summary"]
        st = wait_until(lambda: (s := head.status())["state"] == "waiting" and "given up" in s["detail"] and s,
                        30, "the head waits for the rank that gave up")
        assert st["consecutive_failures"] == 0 and st["state"] != "given_up"
        n = st["starts"]
        time.sleep(2)                 # a head restarting in a loop would show starts here
        assert head.status()["starts"] == n
        m = rank.scrape()
        assert m[("sparkguard_engine_given_up", ())] == 1.0

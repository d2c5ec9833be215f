"""The link watch's decisions (sparkguard.linkstate.LinkStates) on a fake clock and a fake timer:
what the netlink thread feeds it is a link message; what comes out is on_change calls and the
link incident's records.  The netlink thread itself runs against real interfaces in
tests/test_linkwatch.py."""

from __future__ import annotations

from sparkguard.linkstate import IFF_LOWER_UP, IFF_UP, LinkStates

UP = {"index": 7, "flags": IFF_UP | IFF_LOWER_UP, "operstate": "UP", "carrier": 1}
DOWN = {"index": 7, "flags": IFF_UP, "operstate": "DOWN", "carrier": 0}


class Timer:
    """The injected schedule: remembers each call; the test runs it when its fake time comes."""

    def __init__(self):
        self.calls: list[list] = []     # [delay, fn, cancelled]

    def __call__(self, delay, fn):
        entry = [delay, fn, False]
        self.calls.append(entry)

        class Handle:
            def cancel(self):
                entry[2] = True
        return Handle()


def machine(down_after=5.0):
    now = [100.0]
    incidents, changes, timer = [], [], Timer()
    m = LinkStates(["eth7"], down_after, incidents.append, lambda n, up: changes.append((n, up)),
                   clock=lambda: now[0], schedule=timer, read_meminfo=lambda: {"MemAvailable": 4096})
    m.update("eth7", UP, deleted=False, initial=True)
    m.report_initial()
    return m, now, incidents, changes, timer


def test_a_drop_shorter_than_down_after_is_no_incident():
    m, now, incidents, changes, timer = machine()
    now[0] = 110.0
    m.update("eth7", DOWN, deleted=False)
    assert [c[0] for c in timer.calls] == [5.0]
    assert m.state["eth7"]["down_since"] == 110.0
    now[0] = 112.0
    m.update("eth7", UP, deleted=False)
    assert timer.calls[0][2], "the down_after timer is cancelled when the link is back"
    assert incidents == []
    assert changes == [("eth7", True), ("eth7", False), ("eth7", True)]


def test_a_drop_past_down_after_is_one_incident_reported_twice_with_one_id():
    m, now, incidents, changes, timer = machine()
    now[0] = 110.0
    m.update("eth7", DOWN, deleted=False)
    now[0] = 115.5
    timer.calls[0][1]()                        # down_after elapsed
    assert len(incidents) == 1
    first = incidents[0]
    assert first["kind"] == "link" and first["outcome"] == "link_down" and first["ended_at"] is None
    assert first["started_at"] == 110.0 and first["thresholds"] == {"down_after_seconds": 5.0}
    assert [e["event"] for e in first["timeline"]] == ["down", "incident"]
    assert first["timeline"][0]["available_bytes"] == 4096 and first["timeline"][1]["t"] == 5.5
    assert first["link"] == {"interface": "eth7", "netns": None, "operstate": "DOWN", "carrier": False,
                             "present": True, "down_after_seconds": 5.0}
    assert m.counts["incidents"] == 1 and m.incidents["eth7"].id == first["id"]

    now[0] = 120.0
    m.update("eth7", UP, deleted=False)
    assert len(incidents) == 2
    done = incidents[1]
    assert done["id"] == first["id"] and done["outcome"] == "recovered" and done["ended_at"] == 120.0
    assert [e["event"] for e in done["timeline"]] == ["down", "incident", "up"]
    assert done["timeline"][2]["t"] == 10.0
    assert done["link"]["operstate"] == "UP" and done["link"]["carrier"] is True
    assert done["summary"] == "TP link eth7 was down 10.0 s, now up again"
    assert first["outcome"] == "link_down", "each report is a copy: the first one is not changed afterwards"
    assert m.incidents == {}


def test_a_link_down_at_start_or_gone_is_reported_down_but_no_incident_until_seen_up():
    now = [100.0]
    incidents, changes, timer = [], [], Timer()
    m = LinkStates(["eth7", "eth8"], 5.0, incidents.append, lambda n, up: changes.append((n, up)),
                   clock=lambda: now[0], schedule=timer, read_meminfo=lambda: {})
    m.update("eth7", DOWN, deleted=False, initial=True)
    m.update("eth8", None, deleted=True, initial=True)
    m.report_initial()
    assert changes == [("eth7", False), ("eth8", False)]
    assert m.state["eth8"]["present"] is False
    now[0] = 200.0
    m.update("eth7", DOWN, deleted=False)      # no transition: nothing scheduled
    assert timer.calls == [] and incidents == []

"""Container names for the guard's titles: never waited for, a failed lookup retried with a bounded backoff.

The decision part (:class:`container_names.NameCache`) on a fake clock with a synchronous stand-in
for its thread; then the real path: ``container.name_of`` against a stand-in CLI that fails first.
"""

from __future__ import annotations

import threading

from sparkguard.supervisor import container, container_names
from sparkguard.supervisor.container_names import MAX_ENTRIES, RETRY_FIRST, RETRY_MAX, NameCache

CID = "0123456789ab" + "c" * 52


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_a_failed_lookup_is_retried_with_a_doubling_bounded_backoff():
    clock, asked, answers = Clock(), [], iter([None] * 8 + ["glm"])

    def ask(rt, cid):
        asked.append(clock.t)
        return next(answers)
    cache = NameCache(ask, clock, spawn=lambda fn: fn())
    assert cache.get("docker", CID) is None and asked == [100.0]
    waits = []
    for _ in range(8):
        before = len(asked)
        while len(asked) == before:          # step the clock until the cache asks again
            clock.t += 0.5
            cache.get("docker", CID)
        waits.append(asked[-1] - asked[-2])
    assert waits[:5] == [RETRY_FIRST, 2 * RETRY_FIRST, 4 * RETRY_FIRST, 8 * RETRY_FIRST, 16 * RETRY_FIRST]
    assert max(waits) == RETRY_MAX and all(w <= RETRY_MAX for w in waits)
    assert cache.get("docker", CID) == "glm" and cache.known(CID[:12]) == "glm"
    n = len(asked)
    clock.t += 3600
    assert cache.get("docker", CID) == "glm" and len(asked) == n      # a known name is not asked again


def test_one_question_in_flight_and_the_caller_never_waits():
    started, release = [], threading.Event()

    def ask(rt, cid):
        release.wait(10)
        return "glm"
    cache = NameCache(ask, spawn=lambda fn: started.append(threading.Thread(target=fn)) or started[-1].start())
    try:
        assert [cache.get("docker", CID) for _ in range(5)] == [None] * 5     # returned while docker "hangs"
        assert len(started) == 1
    finally:
        release.set()
        started[0].join(10)
    assert cache.get("docker", CID) == "glm"


def test_the_cache_is_bounded():
    cache = NameCache(lambda rt, cid: cid[:4], spawn=lambda fn: fn())
    for i in range(MAX_ENTRIES + 50):
        cache.get("docker", f"{i:064x}")
    assert len(cache.entries) == MAX_ENTRIES


def test_name_of_asks_the_cli_again_after_a_failure(tmp_path, monkeypatch):
    # a stand-in CLI: fails on its first call (dockerd not answering), answers on the next
    cli = tmp_path / "docker"
    cli.write_text("#!/bin/sh\nif [ -e \"$0.once\" ]; then echo '[{\"Name\": \"/glm\"}]'; exit 0; fi\n"
                   "touch \"$0.once\"; exit 1\n")
    cli.chmod(0o755)
    clock, threads = Clock(), []
    cache = NameCache(container._ask_name, clock, spawn=lambda fn: threads.append(threading.Thread(target=fn))
                      or threads[-1].start())
    monkeypatch.setattr(container, "NAMES", cache)
    assert container.name_of(str(cli), CID) is None
    threads[-1].join(20)
    assert container.name_of(str(cli), CID) is None and len(threads) == 1      # inside the backoff
    clock.t += container_names.RETRY_FIRST
    assert container.name_of(str(cli), CID) is None
    threads[-1].join(20)
    assert container.name_of(str(cli), CID) == "glm" and len(threads) == 2
